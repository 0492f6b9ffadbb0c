//! `opservant script {python|bash} FILE`: one script in a fresh sandbox (seed 003), with the
//! embedded runtime as its payload.
//!
//! Guarantees: the script is validated inside the sandbox before anything of it runs —
//! Python is compiled by the embedded interpreter, Bash is checked with `bash -n` — and a
//! validation failure yields `validation_error` with nothing executed; the timeout defaults
//! to 60 s and is clamped to 300 s (and to the agent's ceiling), the clamp reported in
//! `limits.clamped`; without a manifest the script gets no network, only its scratch
//! directory and the default limits.

use std::path::{Path, PathBuf};
use std::thread;

use serde::Serialize;

use crate::app::{self, FromPayload, RuntimeArgs};
use crate::audit;
use crate::executor_run::CannotRun;
use crate::limits::Clamp;
use crate::manifest::Manifest;
use crate::policy::AgentPolicy;
use crate::result::{LimitsReport, RunResult, SandboxSummary};

/// Default wall-clock limit of a script (seed 003): the shipped default timeout, which the
/// configuration's `default_timeout_seconds` changes.
pub const DEFAULT_TIMEOUT_S: u64 = 60;
/// Longest a script may run (seed 003's `MAX_TIMEOUT`).
pub const MAX_TIMEOUT_S: u64 = 300;
/// Largest script accepted.
pub const MAX_SCRIPT_BYTES: usize = 1 << 20;
/// Where the script is shown, read-only, inside the sandbox.
pub const SCRIPT_DIR: &str = "/run/script";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Language {
    Python,
    Bash,
}

impl Language {
    pub fn as_str(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Bash => "bash",
        }
    }
}

/// A request to run a script.
pub struct ScriptRequest<'a> {
    pub language: Language,
    pub file: &'a Path,
    /// `--timeout` (seconds).
    pub timeout_s: Option<u64>,
    pub manifest: Option<&'a Manifest>,
    pub policy: &'a AgentPolicy,
    pub launcher: sandbox::Launcher,
    /// The runtime binary (see [`crate::executor_run::runtime_binary`]).
    pub runtime: PathBuf,
}

/// The script result: seed 003's fields first, then what the sandbox enforced and measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScriptResult {
    pub success: bool,
    pub timeout: bool,
    pub validation_error: Option<String>,
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub duration_ms: u64,
    pub language: Language,
    pub script: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub killed_by: Option<String>,
    /// Why the script did not succeed, in words (null on success).
    pub error: Option<String>,
    pub limits: LimitsReport,
    pub usage: sandbox::ResourceUsage,
    pub sandbox: SandboxSummary,
    /// DESIGN.md §4's keys, after seed 003's, so that a consumer reading every run's result
    /// the same way finds them: `completed` (exit 0), `failed`, `timeout`, or `rejected`
    /// (validation failed: nothing ran); a script has no output object, artifacts, executor,
    /// action or command id.
    pub status: &'static str,
    pub output: Option<serde_json::Value>,
    pub artifacts: [(); 0],
    pub executor: Option<()>,
    pub action: Option<()>,
    pub command_id: Option<()>,
}

/// The timeout a script gets: `--timeout`, else the manifest's, else the default (60 s, or
/// the configuration's `default_timeout_seconds`); at most 300 s and the agent's ceiling.
/// The clamp of a timeout asked for, if any, is returned for the report (a default above
/// the caps is not a request: it becomes the cap).
pub fn script_timeout(
    requested: Option<u64>,
    manifest: Option<u64>,
    default: u64,
    ceiling: u64,
) -> (u64, Option<Clamp>) {
    let (cap, reason) = if ceiling < MAX_TIMEOUT_S {
        (ceiling, "above the agent's ceiling")
    } else {
        (MAX_TIMEOUT_S, "scripts run at most 300 s")
    };
    match requested.or(manifest) {
        Some(want) if want > cap => {
            (cap, Some(Clamp { field: "timeout_seconds", requested: want, applied: cap, reason: reason.into() }))
        }
        Some(want) => (want, None),
        None => (default.min(cap), None),
    }
}

/// The file name the script gets inside the sandbox: its own, when that is a plain name.
fn inside_name(file: &Path, language: Language) -> String {
    let fallback = match language {
        Language::Python => "script.py",
        Language::Bash => "script.sh",
    };
    file.file_name()
        .and_then(|n| n.to_str())
        .filter(|n| {
            !n.starts_with('.') && n.len() <= 128 && n.chars().all(|c| c.is_ascii_alphanumeric() || "._-+".contains(c))
        })
        .unwrap_or(fallback)
        .to_string()
}

/// Run one script. `Err` means it could not run at all (exit status 2).
pub fn run(req: ScriptRequest) -> Result<ScriptResult, CannotRun> {
    if req.timeout_s == Some(0) {
        return Err(CannotRun("--timeout: must be at least 1 second".into()));
    }
    let bytes = read_script(req.file)?;
    let runtime = req.runtime.to_string_lossy().into_owned();
    // What the manifest asks that is refused (a network it cannot have, a path never
    // granted) is a check that said no: audited, as a run's refusal is.
    let refused = |e: CannotRun| {
        audit::record_quietly(
            "script_refused",
            &[("language", req.language.as_str()), ("script", &req.file.display().to_string()), ("reason", &e.0)],
        );
        e
    };
    crate::policy::refuse_unmet(req.manifest, "opservant script", req.language == Language::Python)
        .map_err(|e| refused(e.into()))?;
    let (mut spec, mut limits) = req.policy.spec_for(req.manifest, &runtime, vec![]).map_err(|e| refused(e.into()))?;

    let manifest_timeout = req.manifest.and_then(|m| m.resource_limits.timeout_seconds);
    let limit_policy = &req.policy.limits;
    let (timeout_s, clamp) = script_timeout(
        req.timeout_s,
        manifest_timeout,
        limit_policy.defaults.timeout_seconds,
        limit_policy.ceilings.timeout_seconds,
    );
    limits.clamped.retain(|c| c.field != "timeout_seconds");
    limits.clamped.extend(clamp);
    limits.timeout_seconds = timeout_s;
    spec.limits.timeout_ms = Some(timeout_s * 1000);

    let inside = PathBuf::from(SCRIPT_DIR).join(inside_name(req.file, req.language));
    let source = String::from_utf8(bytes).map_err(|e| {
        CannotRun(format!(
            "{}: not UTF-8 text (invalid byte at offset {}); scripts must be UTF-8",
            req.file.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    let source_sha256 = audit::sha256_hex(source.as_bytes());
    spec.filesystem.synthetic.push(sandbox::SyntheticFile { path: inside.clone(), content: source });
    crate::policy::runtime_payload(&mut spec, &req.runtime);
    spec.validate()?;

    let args = RuntimeArgs::Script {
        language: req.language.as_str().into(),
        path: inside.to_string_lossy().into_owned(),
        proceed: true,
    };
    let script = req.file.display().to_string();
    // What ran, not only the name it was given: the absolute path (links not resolved, as
    // the file was read) and the SHA-256 of the text that went into the sandbox.
    let path = std::path::absolute(req.file).unwrap_or_else(|_| req.file.to_path_buf());
    // Fail closed: a script whose start cannot be audited does not start.
    audit::try_record(
        "script_start",
        &[
            ("language", req.language.as_str()),
            ("script", &script),
            ("path", &path.to_string_lossy()),
            ("sha256", &source_sha256),
        ],
    )?;
    limits.audit_clamps(("script", &script));
    // From here on, a script that cannot finish is audited as ended: every start has an end.
    let run = || -> Result<ScriptResult, CannotRun> {
        let mut sb = sandbox::Sandbox::spawn(&spec, &req.launcher, None)?;
        let chan = sb.take_app_channel().ok_or_else(|| CannotRun("no application channel".into()))?;
        if let Err(e) = chan.send_bytes(&app::encode_args(&args)) {
            return Err(crate::executor_run::arguments_not_taken(sb, e));
        }
        let cpu = sb.cpu_limiter();
        let unblock = chan.shutdown_handle().map_err(|e| CannotRun(format!("application channel: {}", e.desc())))?;
        let server = thread::spawn(move || serve(chan, &cpu));
        let outcome = sb.wait(sandbox::OutputOptions::default());
        // The sandbox's processes are gone (or abandoned): the server reads what they sent
        // and then end of file, whoever else holds the other end (see `executor_run`).
        unblock.shutdown();
        let served = server.join().map_err(|_| CannotRun("application channel server panicked".into()))?;
        // The script ended, but processes it left cannot die (stuck in the kernel): its
        // result stands, the abandon said beside it (`sandbox.abandoned`, audited).
        let (outcome, abandoned) = match outcome {
            Err(sandbox::SandboxError::Abandoned { reason, outcome }) if outcome.exit.is_some() => {
                (*outcome, Some(reason))
            }
            other => (other?, None),
        };
        let mut result = assemble(&outcome, &limits, served, &req);
        if let Some(why) = abandoned {
            audit::record("sandbox_abandoned", &[("script", &script), ("reason", &why)]);
            result.sandbox.abandoned = Some(why);
        }
        Ok(result)
    };
    let result = match run() {
        Ok(r) => r,
        Err(e) => {
            audit::record(
                "script_end",
                &[
                    ("language", req.language.as_str()),
                    ("script", &script),
                    ("success", "false"),
                    ("killed_by", ""),
                    ("error", &e.0),
                ],
            );
            return Err(e);
        }
    };
    audit::record(
        "script_end",
        &[
            ("language", req.language.as_str()),
            ("script", &script),
            ("success", if result.success { "true" } else { "false" }),
            ("killed_by", result.killed_by.as_deref().unwrap_or("")),
        ],
    );
    Ok(result)
}

fn read_script(file: &Path) -> Result<Vec<u8>, CannotRun> {
    // A regular file only, checked before it is opened: a FIFO would block the open.
    crate::bounded::read_regular(file, MAX_SCRIPT_BYTES as u64).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => {
            CannotRun(format!("{}: larger than {} bytes", file.display(), MAX_SCRIPT_BYTES))
        }
        _ => CannotRun(format!("{}: {e}", file.display())),
    })
}

/// What the application channel delivered.
#[derive(Default)]
struct Served {
    /// The runtime started (validation, then the script, come after).
    ready: bool,
    validation_error: Option<String>,
    protocol_error: Option<String>,
}

fn serve(chan: sandbox::channel::Channel, cpu: &sandbox::CpuLimiter) -> Served {
    let mut out = Served::default();
    loop {
        match app::recv(&chan) {
            Ok(None) => return out,
            // Answered once; a second `ready` (written by the script) is a protocol error.
            Ok(Some(FromPayload::Ready)) if !out.ready => {
                out.ready = true;
                // A failed write stops the sandbox at once (fail closed); the script, waiting
                // for the answer, never starts.
                if app::proceed(&chan, cpu).is_err() {
                    return out;
                }
            }
            Ok(Some(FromPayload::ValidationError { error })) => {
                out.validation_error.get_or_insert(error);
            }
            // Its first message, before any script had the channel (see `app::BUILD`).
            Ok(Some(FromPayload::WrongBuild { build })) if !out.ready => {
                out.protocol_error.get_or_insert(app::wrong_build_error(&build));
                return out;
            }
            Ok(Some(other)) => {
                out.protocol_error.get_or_insert(format!("unexpected {} message for a script", other.kind()));
            }
            Err(e) => {
                out.protocol_error.get_or_insert(e);
                return out;
            }
        }
    }
}

fn assemble(
    outcome: &sandbox::Outcome,
    limits: &crate::limits::EffectiveLimits,
    served: Served,
    req: &ScriptRequest,
) -> ScriptResult {
    let base = RunResult::for_program(outcome, limits);
    let timeout = outcome.timed_out;
    let validation_error = if timeout || outcome.killed_by.is_some() { None } else { served.validation_error };
    let validated = validation_error.is_none();
    let success = validated && served.protocol_error.is_none() && outcome.success();
    let error = if success {
        None
    } else if let Some(v) = &validation_error {
        Some(format!("validation failed, nothing was run: {v}"))
    } else if let Some(p) = &served.protocol_error {
        Some(app::misbehaved("script", p))
    } else if !served.ready && !timeout && outcome.killed_by.is_none() {
        let stderr = String::from_utf8_lossy(&outcome.stderr.bytes);
        Some(app::could_not_start("script", stderr.lines().last().unwrap_or("")))
    } else {
        base.error.clone()
    };
    ScriptResult {
        success,
        timeout,
        exit_code: if validated { base.exit_code } else { None },
        validation_error,
        stdout: base.stdout,
        stderr: base.stderr,
        duration_ms: outcome.usage.wall_ms,
        language: req.language,
        script: req.file.display().to_string(),
        stdout_truncated: base.stdout_truncated,
        stderr_truncated: base.stderr_truncated,
        killed_by: base.killed_by,
        error,
        limits: base.limits,
        usage: base.usage,
        sandbox: base.sandbox,
        status: if !validated {
            "rejected"
        } else if timeout {
            "timeout"
        } else if success {
            "completed"
        } else {
            "failed"
        },
        output: None,
        artifacts: [],
        executor: None,
        action: None,
        command_id: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_default_and_clamp() {
        assert_eq!(script_timeout(None, None, DEFAULT_TIMEOUT_S, 3600), (60, None));
        assert_eq!(script_timeout(Some(5), Some(100), DEFAULT_TIMEOUT_S, 3600), (5, None));
        assert_eq!(script_timeout(None, Some(100), DEFAULT_TIMEOUT_S, 3600), (100, None));
        let (t, c) = script_timeout(Some(900), None, DEFAULT_TIMEOUT_S, 3600);
        assert_eq!(t, 300);
        let c = c.unwrap();
        assert_eq!((c.requested, c.applied), (900, 300));
        let (t, c) = script_timeout(Some(200), None, DEFAULT_TIMEOUT_S, 120);
        assert_eq!((t, c.unwrap().reason.as_str()), (120, "above the agent's ceiling"));
        // The configuration's default, capped without a clamp (nothing was asked for).
        assert_eq!(script_timeout(None, None, 20, 3600), (20, None));
        assert_eq!(script_timeout(None, None, 600, 3600), (300, None));
        assert_eq!(script_timeout(None, None, 60, 30), (30, None));
        // Without a configuration, the shipped default is seed 003's.
        assert_eq!(crate::limits::LimitPolicy::builtin().defaults.timeout_seconds, DEFAULT_TIMEOUT_S);
    }

    #[test]
    fn inside_names() {
        assert_eq!(inside_name(Path::new("/x/check.py"), Language::Python), "check.py");
        assert_eq!(inside_name(Path::new("/x/.hidden"), Language::Bash), "script.sh");
        assert_eq!(inside_name(Path::new("/x/we ird.sh"), Language::Bash), "script.sh");
    }
}
