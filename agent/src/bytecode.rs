//! Precompiled bytecode for installed executors.
//!
//! An executor's package directory is read-only in its sandbox, so without a `__pycache__`
//! the interpreter compiles every module from source on every import of every run — ~2.6 ms
//! for each of the shipped 200–300 line executors' modules (`compile()` in Debian's 3.11).
//! At installation [`precompile`] compiles the package's modules (its `.deps` included)
//! once and writes `__pycache__/NAME.cpython-XY.pyc` beside each source; at agent start
//! [`precompile_installed`] does the same, in place, for installed executors without any.
//!
//! Guarantees:
//! - Untrusted source is parsed only inside a sandbox: the embedded runtime compiles it in
//!   one started with the agent's default policy (no network, the package read-only, the
//!   default memory and task limits, one CPU, [`COMPILE_TIMEOUT`]); `compile()` runs none
//!   of it. The agent never parses it.
//! - The agent decides where every file goes: it lists the sources, and writes each reply
//!   only to the cache path of the source it asked for next; a reply for another path ends
//!   the compilation. The bytes are the sandbox's, and only that executor's sandboxes load
//!   them — where its source could run anything anyway.
//! - The files are timestamp-checked (the source's mtime and size in the header, as the
//!   interpreter writes them itself): a source changed afterwards is compiled in memory
//!   again, as before.
//! - Best effort: a source that does not compile, or a compilation that cannot run, leaves
//!   the package without (some) bytecode and is reported as a warning; the installation
//!   goes on, and the import reports the same error when a run reaches it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::app::{self, FromPayload, RuntimeArgs};
use crate::policy::AgentPolicy;

/// Wall-clock limit of the compiling sandbox.
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(120);

/// Most source files compiled per package (more are left to be compiled at import).
pub const MAX_FILES: usize = 20_000;

/// What [`precompile`] did.
#[derive(Debug, Default)]
pub struct Precompiled {
    /// `.pyc` files written.
    pub written: usize,
    /// Sources without bytecode, each with the reason.
    pub failed: Vec<String>,
}

/// Compile the Python sources under `pkg` in a sandbox and write their bytecode caches.
/// `Err` when the compilation could not run at all.
pub fn precompile(pkg: &Path, policy: &AgentPolicy) -> Result<Precompiled, String> {
    let mut sources = Vec::new();
    collect(pkg, &mut sources)?;
    compile_sources(pkg, sources, policy)
}

/// [`precompile`] of `sources`, the `.py` files under `pkg`.
fn compile_sources(pkg: &Path, mut sources: Vec<PathBuf>, policy: &AgentPolicy) -> Result<Precompiled, String> {
    let mut done = Precompiled::default();
    if sources.len() > MAX_FILES {
        done.failed.push(format!("{} more source files than {MAX_FILES} not precompiled", sources.len() - MAX_FILES));
        sources.truncate(MAX_FILES);
    }
    if sources.is_empty() {
        return Ok(done);
    }
    let runtime = crate::executor_run::runtime_binary().map_err(|e| e.0)?;
    let (mut spec, _) = policy.spec_for(None, &runtime.to_string_lossy(), vec![]).map_err(|e| e.to_string())?;
    crate::policy::runtime_payload(&mut spec, &runtime);
    crate::policy::interpreter_view(&mut spec);
    spec.filesystem.paths.push(sandbox::PathRule {
        path: pkg.to_path_buf(),
        access: sandbox::Access::Read,
        optional: false,
    });
    // The agent's own job, not an executor's run: one CPU from the start, a longer clock.
    spec.limits.cpu_deferred = false;
    spec.limits.cpu_percent = Some(100);
    spec.limits.timeout_ms = Some(COMPILE_TIMEOUT.as_millis() as u64);
    spec.validate().map_err(|e| e.to_string())?;

    let mut sb = sandbox::Sandbox::spawn(&spec, &crate::launch::cold(), None).map_err(|e| e.to_string())?;
    let chan = sb.take_app_channel().ok_or("no application channel")?;
    let files: Vec<String> = sources.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    chan.send_bytes(&app::encode(&RuntimeArgs::Compile { files }))
        .map_err(|e| format!("runtime arguments: {}", e.desc()))?;
    let writer = std::thread::spawn(move || receive(chan, sources));
    let outcome = sb.wait(sandbox::OutputOptions::default());
    let (written, mut failed, protocol) = writer.join().map_err(|_| "the bytecode writer panicked".to_string())?;
    done.written = written;
    done.failed.append(&mut failed);
    let outcome = outcome.map_err(|e| e.to_string())?;
    if let Some(e) = protocol {
        done.failed.push(e);
    }
    if !outcome.success() {
        let how = match (&outcome.killed_by, outcome.timed_out, &outcome.exit) {
            (_, true, _) => format!("timed out after {} s", COMPILE_TIMEOUT.as_secs()),
            (Some(k), _, _) => format!("killed ({k})"),
            (None, _, Some(e)) => format!("exit status {:?}", e.code),
            (None, _, None) => "ended".into(),
        };
        let stderr = String::from_utf8_lossy(&outcome.stderr.bytes);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        done.failed.push(format!("the compiling sandbox {how}: {last}"));
    }
    Ok(done)
}

/// Every regular `.py` file under `dir`, in name order, outside `__pycache__`.
fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .and_then(|rd| rd.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let meta = std::fs::symlink_metadata(e.path()).map_err(|err| format!("{}: {err}", e.path().display()))?;
        if meta.is_dir() && e.file_name() != "__pycache__" {
            collect(&e.path(), out)?;
        } else if meta.is_file() && e.path().extension().is_some_and(|x| x == "py") {
            out.push(e.path());
        }
    }
    Ok(())
}

/// The interpreter's cache file for `source`: `DIR/__pycache__/STEM.cpython-XY.pyc`.
pub fn cache_path(source: &Path) -> Option<PathBuf> {
    let (major, minor, _) = crate::executor_run::embedded_python();
    let stem = source.file_stem()?.to_str()?;
    Some(source.parent()?.join("__pycache__").join(format!("{stem}.cpython-{major}{minor}.pyc")))
}

/// Read one reply per source, in order, and write each `.pyc`: (written, failed sources,
/// a protocol error that ended the reading).
fn receive(chan: sandbox::channel::Channel, sources: Vec<PathBuf>) -> (usize, Vec<String>, Option<String>) {
    use base64::Engine;
    let (mut written, mut failed) = (0, Vec::new());
    for (i, source) in sources.iter().enumerate() {
        let (path, pyc, error) = match app::recv(&chan) {
            Ok(Some(FromPayload::Compiled { path, pyc_base64, error })) => (path, pyc_base64, error),
            Ok(Some(_)) => return (written, failed, Some("unexpected message from the compiler".into())),
            Ok(None) => {
                let why = format!("the compiler stopped after {i} of {} files", sources.len());
                return (written, failed, Some(why));
            }
            Err(e) => return (written, failed, Some(e)),
        };
        if Path::new(&path) != source.as_path() {
            let why = format!("the compiler answered for {}, not {}", shown(&path), source.display());
            return (written, failed, Some(why));
        }
        let result = match (pyc, error) {
            (Some(b64), None) => base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| format!("not base64: {e}"))
                .and_then(|bytes| write_pyc(source, &bytes)),
            (_, Some(error)) => Err(shown(&error)),
            (None, None) => Err("no bytecode".into()),
        };
        match result {
            Ok(()) => written += 1,
            Err(e) => failed.push(format!("{}: {e}", source.display())),
        }
    }
    (written, failed, None)
}

/// Text from the sandbox as the install's warnings show it: at most 300 characters, control
/// characters escaped (it reaches terminals and logs).
fn shown(text: &str) -> String {
    let mut out: String = text.chars().take(300).collect::<String>().escape_debug().collect();
    if text.chars().nth(300).is_some() {
        out.push('…');
    }
    out
}

/// Write `bytes` as the cache file of `source` (mode 0644, its directory 0755): a new file
/// renamed into place, so an import running meanwhile (in place, at agent start) reads the
/// old state or the whole new file, never a part.
fn write_pyc(source: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let target = cache_path(source).ok_or("no cache path")?;
    let dir = target.parent().ok_or("no cache directory")?;
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{}: not a directory", dir.display())),
        Err(_) => std::fs::DirBuilder::new().mode(0o755).create(dir).map_err(|e| format!("{}: {e}", dir.display()))?,
    }
    let name = target.file_name().and_then(|n| n.to_str()).ok_or("no cache file name")?;
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| std::io::Write::write_all(&mut f, bytes))
        .and_then(|()| std::fs::rename(&tmp, &target));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("{}: {e}", target.display())
    })
}

/// At agent start: installed executors without any bytecode (installed by an agent before
/// this one) get it, in place. One with some (a source that does not compile has none) is
/// left alone, so a broken file is not retried at every start. Failures are logged; runs
/// compile from source as before.
pub fn precompile_installed(root: &Path, policy: &AgentPolicy) {
    let installed = match crate::executor_install::loaded(root) {
        Ok(i) => i,
        Err(e) => return tracing::warn!(error = %e, "bytecode: cannot list the installed executors"),
    };
    for (dir, executor) in installed {
        let mut sources = Vec::new();
        if collect(&dir, &mut sources).is_err() || sources.iter().any(|s| cache_path(s).is_some_and(|c| c.is_file())) {
            continue;
        }
        let name = &executor.manifest.name;
        match compile_sources(&dir, sources, policy) {
            Ok(p) => {
                tracing::info!(executor = %name, written = p.written, failed = p.failed.len(), "bytecode precompiled in place");
                for f in &p.failed {
                    tracing::warn!(executor = %name, "bytecode not precompiled: {f}");
                }
            }
            Err(e) => tracing::warn!(executor = %name, error = %e, "bytecode not precompiled"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_the_sandbox_is_bounded_and_escaped() {
        assert_eq!(shown("SyntaxError: invalid syntax"), "SyntaxError: invalid syntax");
        assert_eq!(shown("a\u{1b}[2Jb\n"), "a\\u{1b}[2Jb\\n");
        let long = "x".repeat(10_000);
        assert_eq!(shown(&long), format!("{}…", "x".repeat(300)));
    }
}
