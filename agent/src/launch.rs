//! How the agent starts sandboxes: cold (a fresh `execve` of the sandbox init, then of the
//! runtime) or through a zygote (`opservant-runtime --zygote`: CPython initialised and the
//! runtime imported once; each sandbox is a fork of it that runs the same isolation steps —
//! see `sandbox::zygote`).
//!
//! Guarantees: a zygote failure never fails a run — the run falls back to the cold path
//! (audited as `zygote_fallback`) and the next run starts a new zygote; the zygote holds no
//! secrets and no executor code (it is started with an empty environment and only the
//! standard library and the embedded runtime loaded).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;

use sandbox::zygote::Zygote;
use sandbox::{Launcher, PayloadEnd};

/// The hidden sub-command that makes this binary a sandbox init.
pub const SANDBOX_INIT: &str = "__sandbox-init";

/// `--launch` of the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LaunchMode {
    /// A fresh process per sandbox (the default for one-shot commands).
    #[default]
    Cold,
    /// Fork a pre-initialised runtime (what the agent daemon uses).
    Zygote,
    /// `run` and `sandbox`, for tests: take a sandbox started beforehand through the zygote,
    /// as the daemon's warm pool (`agent.warm_pool`) does (a program's sandbox started held,
    /// its payload waiting with every restriction in place until it is taken).
    Pool,
}

impl LaunchMode {
    /// As `--launch` and the result's `sandbox.launch` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            LaunchMode::Cold => "cold",
            LaunchMode::Zygote => "zygote",
            LaunchMode::Pool => "pool",
        }
    }
}

/// A zygote running `runtime --zygote` (started on first use), with up to `netns_stash`
/// fresh network namespaces made ahead of time for its sandboxes (`sandbox::netns_stash`;
/// 0: each sandbox creates its own).
pub fn zygote(runtime: &Path, netns_stash: usize) -> Arc<Zygote> {
    // A path from `runtime_binary` never contains NUL; an empty program fails to start and
    // every run then falls back to the cold path.
    let program = CString::new(runtime.as_os_str().as_bytes()).unwrap_or_default();
    let flag = CString::from(c"--zygote");
    // Only the runtime of this very build serves (its file replaced by an upgrade while this
    // process runs starts no zygote: runs start cold, and say why — `app::BUILD`).
    Arc::new(
        Zygote::new(program, vec![flag]).expecting(crate::app::BUILD.as_bytes().to_vec()).with_netns_stash(netns_stash),
    )
}

/// A zygote for one command-line run, with one prepared network namespace, ready before
/// the sandbox starts (so a one-shot `--launch zygote|pool` always takes the path the
/// daemon takes when its stash is not empty).
pub fn one_shot_zygote(runtime: &Path) -> Arc<Zygote> {
    let z = zygote(runtime, 1);
    if let Some(stash) = z.netns_stash() {
        stash.wait_full();
    }
    z
}

/// The launcher for an executor (or Python script) run through `zygote`: the payload
/// continues in the zygote's interpreter.
pub fn for_runtime(zygote: &Arc<Zygote>) -> Launcher {
    Launcher::Zygote { zygote: zygote.clone(), end: PayloadEnd::Return }
}

/// The launcher for a plain program through `zygote` (the monitor is forked from the
/// zygote; the payload `execve`s the program).
pub fn for_program(zygote: &Arc<Zygote>) -> Launcher {
    Launcher::Zygote { zygote: zygote.clone(), end: PayloadEnd::Exec }
}

/// The cold launcher for a caller that may be multi-threaded.
pub fn cold() -> Launcher {
    Launcher::reexec(SANDBOX_INIT)
}

/// Start a sandbox with `launcher`; if a zygote could not start it (nothing of the sandbox
/// ran), audit that and start it cold instead.
pub fn spawn_with_fallback(
    spec: &sandbox::SandboxSpec,
    launcher: &Launcher,
    mut hook: Option<sandbox::NamespaceHook>,
) -> Result<sandbox::Sandbox, sandbox::SandboxError> {
    match sandbox::Sandbox::spawn(spec, launcher, hook.as_mut().map(|h| &mut **h as sandbox::NamespaceHook)) {
        Err(sandbox::SandboxError::Zygote(e)) => {
            tracing::warn!(error = %e, "zygote unavailable; starting the sandbox cold");
            crate::audit::record("zygote_fallback", &[("error", &e)]);
            let mut sb = sandbox::Sandbox::spawn(spec, &cold(), hook)?;
            sb.mark_zygote_fallback();
            Ok(sb)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::LaunchMode;

    #[test]
    fn launch_names_are_the_command_lines_and_the_results() {
        for m in [LaunchMode::Cold, LaunchMode::Zygote, LaunchMode::Pool] {
            assert_eq!(serde_json::to_value(m).unwrap(), m.as_str());
            assert_eq!(clap::ValueEnum::to_possible_value(&m).unwrap().get_name(), m.as_str());
        }
    }
}
