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
//!   goes on, and the import reports the same error when a run reaches it. A source whose
//!   compilation gets the sandbox killed (memory, tasks, a crash) is named and skipped;
//!   the files after it are compiled in a fresh sandbox ([`MAX_COMPILERS`] at most).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::app::{self, FromPayload, RuntimeArgs};
use crate::policy::AgentPolicy;

/// Wall-clock limit of the compiling sandbox.
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(120);

/// Most source files compiled per package (more are left to be compiled at import).
pub const MAX_FILES: usize = 20_000;

/// Most compiling sandboxes per package: each after the first resumes after a source that
/// got the previous one killed.
pub const MAX_COMPILERS: usize = 4;

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

/// [`precompile`] of `sources`, the `.py` files under `pkg`. A source that kills the
/// compiler (memory, tasks, a crash) is reported and skipped, and the files after it are
/// compiled in a fresh sandbox — at most [`MAX_COMPILERS`] per package.
fn compile_sources(pkg: &Path, mut sources: Vec<PathBuf>, policy: &AgentPolicy) -> Result<Precompiled, String> {
    let mut done = Precompiled::default();
    if sources.len() > MAX_FILES {
        done.failed.push(format!("{} more source files than {MAX_FILES} not precompiled", sources.len() - MAX_FILES));
        sources.truncate(MAX_FILES);
    }
    let mut rest: &[PathBuf] = &sources;
    let mut compilers = 0;
    while !rest.is_empty() {
        if compilers == MAX_COMPILERS {
            done.failed.push(format!(
                "{} more files not precompiled: {MAX_COMPILERS} compiling sandboxes were killed",
                rest.len()
            ));
            break;
        }
        compilers += 1;
        let batch = match compile_batch(pkg, rest, policy) {
            Ok(b) => b,
            // Nothing compiled yet: the compilation could not run at all.
            Err(e) if compilers == 1 => return Err(e),
            Err(e) => {
                done.failed.push(format!("{} more files not precompiled: {e}", rest.len()));
                break;
            }
        };
        done.written += batch.written;
        done.failed.extend(batch.failed);
        match batch.killed_at {
            Some(i) => rest = &rest[i + 1..],
            None => break,
        }
    }
    Ok(done)
}

/// What one compiling sandbox did.
struct Batch {
    written: usize,
    failed: Vec<String>,
    /// The sandbox was killed while compiling `sources[i]` (reported in `failed`): the
    /// files after it may be compiled in another.
    killed_at: Option<usize>,
}

/// Compile `sources` in one sandbox. `Err` when it could not start.
fn compile_batch(pkg: &Path, sources: &[PathBuf], policy: &AgentPolicy) -> Result<Batch, String> {
    let runtime = crate::executor_run::runtime_binary().map_err(|e| e.0)?;
    let (mut spec, _) = policy.spec_for(None, &runtime.to_string_lossy(), vec![]).map_err(|e| e.to_string())?;
    crate::policy::runtime_payload(&mut spec, &runtime);
    crate::policy::interpreter_view(&mut spec);
    spec.filesystem.paths.push(sandbox::PathRule {
        source: None,
        path: pkg.to_path_buf(),
        access: sandbox::Access::Read,
        optional: false,
        identity: None,
    });
    // The agent's own job, not an executor's run: one CPU from the start, a longer clock.
    spec.limits.cpu_deferred = false;
    spec.limits.cpu_percent = Some(100);
    spec.limits.timeout_ms = Some(COMPILE_TIMEOUT.as_millis() as u64);
    spec.validate().map_err(|e| e.to_string())?;

    let mut sb = sandbox::Sandbox::spawn(&spec, &crate::launch::cold(), None).map_err(|e| e.to_string())?;
    let chan = sb.take_app_channel().ok_or("no application channel")?;
    let files: Vec<String> = sources.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    chan.send_bytes(&app::encode_args(&RuntimeArgs::Compile { files }))
        .map_err(|e| format!("runtime arguments: {}", e.desc()))?;
    let (owned, root) = (sources.to_vec(), pkg.to_path_buf());
    let unblock = chan.shutdown_handle().map_err(|e| format!("application channel: {}", e.desc()))?;
    let writer = std::thread::spawn(move || receive(chan, &root, owned));
    let outcome = sb.wait(sandbox::OutputOptions::default());
    // The sandbox's processes are gone (or abandoned): the writer reads what they sent and
    // then end of file, whoever else holds the other end (see `executor_run`).
    unblock.shutdown();
    let received = writer.join().map_err(|_| "the bytecode writer panicked".to_string())?;
    let mut batch = Batch { written: received.written, failed: received.failed, killed_at: None };
    let outcome = outcome.map_err(|e| e.to_string())?;
    if outcome.success() {
        batch.failed.extend(received.protocol);
        return Ok(batch);
    }
    let how = match (&outcome.killed_by, outcome.timed_out, &outcome.exit) {
        (_, true, _) => format!("timed out after {} s", COMPILE_TIMEOUT.as_secs()),
        (Some(k), _, _) => format!("killed ({k})"),
        (None, _, Some(sandbox::ExitInfo { signal: Some(n), .. })) => format!("killed (signal:{n})"),
        (None, _, Some(e)) => format!("exit status {:?}", e.code),
        (None, _, None) => "ended".into(),
    };
    let stderr = String::from_utf8_lossy(&outcome.stderr.bytes);
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).map(|l| format!(": {}", shown(l)));
    let last = last.unwrap_or_default();
    // Killed (not timed out, not failed by itself) while a file was being compiled: that
    // file is the likely cause; it is named, and the files after it may be retried.
    let killed = !outcome.timed_out
        && (matches!(outcome.killed_by, Some(k) if k != sandbox::KilledBy::Timeout)
            || outcome.exit.as_ref().is_some_and(|e| e.signal.is_some()));
    match (killed, received.stopped_at) {
        (true, Some(i)) => {
            let name = in_package(pkg, &sources[i]);
            batch.failed.push(format!("{name}: the compiling sandbox was {how} compiling it{last}"));
            batch.killed_at = Some(i);
        }
        _ => {
            batch.failed.extend(received.protocol);
            batch.failed.push(format!("the compiling sandbox {how}{last}"));
        }
    }
    Ok(batch)
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

/// What [`receive`] read from one compiler.
struct Received {
    written: usize,
    /// Sources without bytecode, each with the reason.
    failed: Vec<String>,
    /// A protocol error, or the compiler's early stop, that ended the reading.
    protocol: Option<String>,
    /// The compiler's channel closed before it answered for `sources[i]`.
    stopped_at: Option<usize>,
}

/// `source` as the warnings name it: its path in the package (not the staging directory's).
fn in_package(pkg: &Path, source: &Path) -> String {
    source.strip_prefix(pkg).unwrap_or(source).display().to_string()
}

/// Read one reply per source, in order, and write each `.pyc`.
fn receive(chan: sandbox::channel::Channel, pkg: &Path, sources: Vec<PathBuf>) -> Received {
    use base64::Engine;
    let mut r = Received { written: 0, failed: Vec::new(), protocol: None, stopped_at: None };
    for (i, source) in sources.iter().enumerate() {
        let (path, pyc, error) = match app::recv(&chan) {
            Ok(Some(FromPayload::Compiled { path, pyc_base64, error })) => (path, pyc_base64, error),
            // Its first message, before any file was compiled (see `app::BUILD`).
            Ok(Some(FromPayload::WrongBuild { build })) if i == 0 => {
                r.protocol = Some(app::wrong_build_error(&build));
                return r;
            }
            Ok(Some(_)) => {
                r.protocol = Some("unexpected message from the compiler".into());
                return r;
            }
            Ok(None) => {
                r.protocol = Some(format!("the compiler stopped after {i} of {} files", sources.len()));
                r.stopped_at = Some(i);
                return r;
            }
            Err(e) => {
                r.protocol = Some(e);
                return r;
            }
        };
        if Path::new(&path) != source.as_path() {
            r.protocol = Some(format!("the compiler answered for {}, not {}", shown(&path), in_package(pkg, source)));
            return r;
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
            Ok(()) => r.written += 1,
            Err(e) => r.failed.push(format!("{}: {e}", in_package(pkg, source))),
        }
    }
    r
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

/// Write `bytes` as the cache file of `source` (mode 0644, its directory 0755, whatever
/// the umask — the systemd unit's 0077 made them unreadable to the executor user, and
/// every run compiled from source): a new file renamed into place, so an import running
/// meanwhile (in place, at agent start) reads the old state or the whole new file, never
/// a part.
fn write_pyc(source: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    let target = cache_path(source).ok_or("no cache path")?;
    let dir = target.parent().ok_or("no cache directory")?;
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{}: not a directory", dir.display())),
        Err(_) => {
            std::fs::DirBuilder::new().mode(0o755).create(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| format!("{}: {e}", dir.display()))?;
        }
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
        .and_then(|mut f| {
            f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
            std::io::Write::write_all(&mut f, bytes)
        })
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
        // Written in place: no install or removal meanwhile (a removal would find files
        // appearing in the tree it deletes).
        let _lock = match crate::executor_install::lock_root(root) {
            Ok(l) => l,
            Err(e) => return tracing::warn!(error = %e, "bytecode: cannot lock the executors root"),
        };
        if !dir.is_dir() {
            continue;
        }
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
