//! Stateful Python sessions (seed 002): `opservant session start|exec|stop|list`.
//!
//! A session is one long-lived sandbox whose payload is the embedded runtime in session
//! mode: one interpreter whose globals persist between calls. A small daemon (this binary,
//! detached) owns the sandbox and serves a Unix socket in [`SESSION_DIR`]; `exec` and `stop`
//! are clients of that socket.
//!
//! Guarantees:
//! - each session is its own sandbox (namespaces, cgroups, Landlock, seccomp): sessions share
//!   nothing with each other or the host beyond what the manifest (or the defaults: no
//!   network, scratch only) allows;
//! - imports are refused inside the interpreter unless allowlisted (none by default); `os`,
//!   `subprocess`, `ctypes` and `socket` are never implied by a default import — only an
//!   explicit `--allow-import` grants them. This is defence in depth on top of the OS sandbox,
//!   not a boundary by itself: Python code can reach modules through the object graph;
//! - every call has a timeout, which bounds sending it and every message of its answer too
//!   (a runtime that stops reading, or sends part of a message and stalls, cannot hold the
//!   daemon); a call that times out or exhausts the memory limit ends the session (the whole
//!   sandbox is killed) and its reply says so; a stop signal ends a call at once;
//! - every call is audited before its code is sent (`session_exec`, fail closed) and when it
//!   ends (`session_exec_end`); a call whose client is gone before it starts (killed, or
//!   given up waiting behind another call) never runs (`session_exec_abandoned`); one whose
//!   client goes while it runs is interrupted (SIGINT to the sandbox's processes, seen as
//!   KeyboardInterrupt by the call only: `session_exec_interrupted`) and the session goes on;
//! - an idle session (no call: status requests do not count) expires, and every session ends
//!   after its maximum lifetime;
//! - only root, or the user the daemon runs as, can reach a session: the directory is 0700,
//!   the socket 0600, and the daemon checks each client's credentials (`SO_PEERCRED`).

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::app::{self, FromPayload, RuntimeArgs, ToPayload};
use crate::audit;
use crate::executor_run::CannotRun;
use crate::limits::EffectiveLimits;
use crate::policy::AgentPolicy;

/// Where session sockets, locks and logs live (root-only).
pub const SESSION_DIR: &str = "/run/opservant/sessions";
/// Per-call timeout: default and maximum (seconds).
pub const DEFAULT_CALL_TIMEOUT_S: u64 = 60;
pub const MAX_CALL_TIMEOUT_S: u64 = 300;
/// Idle expiry: default and maximum (seconds).
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 600;
pub const MAX_IDLE_TIMEOUT_S: u64 = 86_400;
/// Longest a session lives, busy or not: default and maximum (seconds).
pub const DEFAULT_MAX_LIFETIME_S: u64 = 86_400;
pub const MAX_MAX_LIFETIME_S: u64 = 7 * 86_400;
/// Largest request a client may send (code plus globals).
pub const MAX_REQUEST: usize = 8 << 20;
/// How long the daemon waits for the interpreter to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a client has to send its whole request, and then to take each write of its
/// reply: the daemon serves one client at a time.
const CLIENT_DEADLINE: Duration = Duration::from_secs(10);
/// Modules a default import never implies: only an explicit `--allow-import` grants them.
pub const NEVER_IMPLIED: &[&str] = &["os", "subprocess", "ctypes", "socket"];

/// Everything `session start` decides; handed to the daemon on its stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub name: String,
    pub allow_imports: Vec<String>,
    /// (alias, module), e.g. ("np", "numpy").
    pub default_imports: Vec<(String, String)>,
    pub call_timeout_s: u64,
    pub idle_timeout_s: u64,
    pub max_lifetime_s: u64,
    /// Directories of third-party packages (read-only in the sandbox, on `sys.path`).
    #[serde(default)]
    pub python_paths: Vec<PathBuf>,
    pub manifest: Option<PathBuf>,
    pub config: Option<PathBuf>,
}

fn is_identifier(s: &str) -> bool {
    s.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_module_name(s: &str) -> bool {
    !s.is_empty() && s.split('.').all(is_identifier)
}

/// A session name: `[A-Za-z0-9_-]`, 1–64 characters (it names files in [`SESSION_DIR`]).
pub fn check_name(name: &str) -> Result<(), CannotRun> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('-')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(CannotRun(format!("session name '{name}': use 1-64 characters of [A-Za-z0-9_-]")))
    }
}

impl Settings {
    /// Parse `--allow-import` lists and `--default-import alias=module` pairs and check
    /// every value. Default imports extend the allowlist, except [`NEVER_IMPLIED`] modules.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        allow: &[String],
        defaults: &[String],
        call_timeout_s: Option<u64>,
        idle_timeout_s: Option<u64>,
        max_lifetime_s: Option<u64>,
        python_paths: &[PathBuf],
        manifest: Option<PathBuf>,
        config: Option<PathBuf>,
    ) -> Result<Settings, CannotRun> {
        check_name(name)?;
        let mut paths = Vec::new();
        for p in python_paths {
            let abs = p.canonicalize().map_err(|e| CannotRun(format!("--python-path {}: {e}", p.display())))?;
            if !abs.is_dir() {
                return Err(CannotRun(format!("--python-path {}: not a directory", p.display())));
            }
            paths.push(abs);
        }
        let mut allow_imports: Vec<String> = Vec::new();
        for item in allow.iter().flat_map(|a| a.split(',')).map(str::trim).filter(|s| !s.is_empty()) {
            if !is_module_name(item) {
                return Err(CannotRun(format!("--allow-import: '{item}' is not a module name")));
            }
            if !allow_imports.iter().any(|a| a == item) {
                allow_imports.push(item.to_string());
            }
        }
        let mut default_imports = Vec::new();
        for item in defaults.iter().flat_map(|a| a.split(',')).map(str::trim).filter(|s| !s.is_empty()) {
            let (alias, module) = match item.split_once('=') {
                Some((a, m)) => (a.trim(), m.trim()),
                None => (item.rsplit('.').next().unwrap_or(item), item),
            };
            if !is_identifier(alias) || !is_module_name(module) {
                return Err(CannotRun(format!("--default-import: '{item}' is not ALIAS=MODULE")));
            }
            let covered = |m: &str| allow_imports.iter().any(|a| m == a || m.starts_with(&format!("{a}.")));
            if !covered(module) {
                let top = module.split('.').next().unwrap_or(module);
                if NEVER_IMPLIED.contains(&top) {
                    return Err(CannotRun(format!(
                        "--default-import {item}: '{top}' is never implied by a default import; allow it explicitly with --allow-import {top} if you really mean it"
                    )));
                }
                allow_imports.push(module.to_string());
            }
            default_imports.push((alias.to_string(), module.to_string()));
        }
        // Above their maxima they are clamped as the session starts (reported in its reply).
        let bounded = |flag: &str, v: Option<u64>, default: u64| -> Result<u64, CannotRun> {
            match v {
                None => Ok(default),
                Some(0) => Err(CannotRun(format!("{flag}: must be at least 1 second"))),
                Some(v) => Ok(v),
            }
        };
        Ok(Settings {
            name: name.to_string(),
            allow_imports,
            default_imports,
            call_timeout_s: bounded("--timeout", call_timeout_s, DEFAULT_CALL_TIMEOUT_S)?,
            idle_timeout_s: bounded("--idle-timeout", idle_timeout_s, DEFAULT_IDLE_TIMEOUT_S)?,
            max_lifetime_s: bounded("--max-lifetime", max_lifetime_s, DEFAULT_MAX_LIFETIME_S)?,
            python_paths: paths,
            manifest: manifest.map(|m| std::path::absolute(&m).unwrap_or(m)),
            config: config.map(|c| std::path::absolute(&c).unwrap_or(c)),
        })
    }
}

fn socket_path(name: &str) -> PathBuf {
    Path::new(SESSION_DIR).join(format!("{name}.sock"))
}

fn lock_path(name: &str) -> PathBuf {
    Path::new(SESSION_DIR).join(format!("{name}.lock"))
}

fn log_path(name: &str) -> PathBuf {
    Path::new(SESSION_DIR).join(format!("{name}.log"))
}

/// A session log untouched for longer than this belongs to no running session (a session
/// writes to its log when it starts, and lives at most [`MAX_MAX_LIFETIME_S`]).
const LOG_MAX_AGE: Duration = Duration::from_secs(MAX_MAX_LIFETIME_S + 3600);
/// A session's log larger than this is moved to `NAME.log.1` (replacing the one before)
/// when a session of that name starts, and by a running session after a request.
const LOG_ROTATE_BYTES: u64 = 1 << 20;

/// Removes session logs (`NAME.log`, `NAME.log.1`, a rotation's `NAME.log.new` it could not
/// finish) older than [`LOG_MAX_AGE`]: `/run` is
/// memory, and every session name ever used would otherwise keep its log until a reboot.
fn sweep_old_logs() {
    let Ok(entries) = std::fs::read_dir(SESSION_DIR) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.ends_with(".log") || name.ends_with(".log.1") || name.ends_with(".log.new")) {
            continue;
        }
        // `DirEntry::metadata` does not follow a link.
        let Ok(meta) = e.metadata() else { continue };
        let stale = meta.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age > LOG_MAX_AGE);
        if meta.is_file() && stale {
            match std::fs::remove_file(e.path()) {
                Ok(()) => tracing::info!(target: "opservant::session", log = name, "removed a stale session log"),
                Err(err) => {
                    tracing::warn!(target: "opservant::session", log = name, error = %err, "cannot remove a stale session log")
                }
            }
        }
    }
}

/// Moves the log of the session `name` to `NAME.log.1` when it is larger than
/// [`LOG_ROTATE_BYTES`] (one generation is kept).
fn rotate_log(name: &str) {
    let log = log_path(name);
    if std::fs::symlink_metadata(&log).is_ok_and(|m| m.is_file() && m.len() > LOG_ROTATE_BYTES) {
        let old = log.with_extension("log.1");
        if let Err(e) = std::fs::rename(&log, &old) {
            tracing::warn!(target: "opservant::session", log = %log.display(), error = %e, "cannot rotate the session log");
        }
    }
}

/// The running session `name`'s own log (its stderr) once it is larger than
/// [`LOG_ROTATE_BYTES`]: moved to `NAME.log.1` and replaced by a new `NAME.log` on stderr, so
/// a session that lives for days does not grow a file in `/run` (memory) all that time. Only
/// when stderr is that log (the same file): never a file someone put at its name.
fn rotate_own_log(name: &str) {
    use std::os::unix::fs::MetadataExt;
    let log = log_path(name);
    let Ok(own) = nix::sys::stat::fstat(std::io::stderr()) else { return };
    if own.st_mode & libc::S_IFMT != libc::S_IFREG || (own.st_size as u64) <= LOG_ROTATE_BYTES {
        return;
    }
    let same =
        std::fs::symlink_metadata(&log).is_ok_and(|m| m.is_file() && m.dev() == own.st_dev && m.ino() == own.st_ino);
    if !same {
        return;
    }
    let warn = |e: std::io::Error| tracing::warn!(target: "opservant::session", log = %log.display(), error = %e, "cannot rotate the session log");
    // The new log is made first, under a name of its own: if it cannot be (`/run` full),
    // nothing moves and stderr stays the log, to be rotated at a later request.
    let (old, fresh) = (log.with_extension("log.1"), log.with_extension("log.new"));
    let _ = std::fs::remove_file(&fresh);
    let new = std::fs::OpenOptions::new()
        .append(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&fresh);
    let new = match new {
        Ok(f) => f,
        Err(e) => return warn(e),
    };
    if let Err(e) = std::fs::rename(&log, &old) {
        let _ = std::fs::remove_file(&fresh);
        return warn(e);
    }
    if let Err(e) = std::fs::rename(&fresh, &log) {
        // Put the log back where the next rotation finds it.
        let _ = std::fs::rename(&old, &log);
        let _ = std::fs::remove_file(&fresh);
        return warn(e);
    }
    // dup2 replaces fd 2 atomically: every later write goes to the new file.
    if let Err(e) = nix::unistd::dup2_stderr(&new) {
        warn(e.into());
    }
}

/// Create [`SESSION_DIR`] (0700) and its parent if needed; refuse one others could enter.
fn ensure_dir() -> Result<(), CannotRun> {
    let dir = Path::new(SESSION_DIR);
    if let Some(parent) = dir.parent() {
        if !parent.exists() {
            std::fs::create_dir_all(parent).map_err(|e| CannotRun(format!("{}: {e}", parent.display())))?;
            let _ = std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755));
        }
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(CannotRun(format!("{SESSION_DIR}: {e}"))),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| CannotRun(format!("{SESSION_DIR}: {e}")))?;
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(CannotRun(format!(
            "{SESSION_DIR}: must be a directory owned by uid {me} with mode 0700 (is uid {}, mode {:o})",
            meta.uid(),
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Clients

/// `session start`: launch the daemon and wait until the session is ready (or failed).
pub fn start(settings: &Settings, exe: &Path, serve_subcommand: &str) -> Result<Value, CannotRun> {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    ensure_dir()?;
    if UnixStream::connect(socket_path(&settings.name)).is_ok() {
        return Err(CannotRun(already_running(&settings.name)));
    }
    sweep_old_logs();
    rotate_log(&settings.name);
    // A log this start creates goes again if the start fails (nothing of a failed start is
    // left; the error is in the reply). One that exists belongs to an earlier session.
    let open_log = |create_new: bool| {
        let mut o = std::fs::OpenOptions::new();
        o.append(true).mode(0o600);
        if create_new {
            o.create_new(true);
        }
        o.open(log_path(&settings.name))
    };
    // Created here (`create_new`: not one a concurrent start of the same name made), or an
    // earlier session's, appended to. One created here goes again if the start fails.
    let (log, created_log) = match open_log(true) {
        Ok(f) => (Ok(f), true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => (open_log(false), false),
        Err(e) => (Err(e), false),
    };
    let log = log.map_err(|e| CannotRun(format!("{}: {e}", log_path(&settings.name).display())))?;
    // Not when a session of that name runs after all: a concurrent start won, and its
    // daemon writes to the log this start created — it holds the name's lock from its first
    // step, long before its socket exists, and this start's daemon failed on that lock.
    let remove_log = |lost_the_name: bool| {
        if created_log && !lost_the_name && UnixStream::connect(socket_path(&settings.name)).is_err() {
            let _ = std::fs::remove_file(log_path(&settings.name));
        }
    };
    let mut cmd = Command::new(exe);
    cmd.arg(serve_subcommand).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(log);
    // SAFETY: setsid and chdir are async-signal-safe and touch no memory of the parent (the
    // path is a static C string).
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // A session lives for days: it must not keep the caller's directory busy.
            if libc::chdir(c"/".as_ptr()) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // On a delegated cgroup v2 host, this process moves itself into its own leaf first (as
    // any process that makes sandboxes does): born there, the daemon finds its base cgroup
    // free of processes it did not start — with this one beside it in the base, it refused
    // the controllers.
    sandbox::cgroup::prepare();
    let mut child = cmd.spawn().map_err(|e| CannotRun(format!("cannot start the session daemon: {e}")))?;
    let settings_json = serde_json::to_vec(settings)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(&settings_json).map_err(|e| CannotRun(format!("session daemon: {e}")))?;
    }
    let mut status = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = out.take(1 << 20).read_to_string(&mut status);
    }
    let reply: Value = match serde_json::from_str(status.trim()) {
        Ok(v) => v,
        Err(_) => {
            let _ = child.wait();
            return Err(CannotRun(format!(
                "the session daemon did not start (see {})",
                log_path(&settings.name).display()
            )));
        }
    };
    if reply.get("error").and_then(Value::as_str).is_some() && reply.get("status") != Some(&json!("started")) {
        let _ = child.wait();
        remove_log(reply["error"].as_str() == Some(already_running(&settings.name).as_str()));
        return Err(CannotRun(format!(
            "session '{}': {}",
            settings.name,
            reply["error"].as_str().unwrap_or("failed to start")
        )));
    }
    // The daemon lives on in its own session; this process does not wait for it.
    drop(child);
    Ok(reply)
}

/// How long a client waits for the daemon to take its request: it serves one client at a
/// time, so a request may wait behind calls of up to [`MAX_CALL_TIMEOUT_S`] each. A daemon
/// that dies meanwhile resets the connection at once.
pub const QUEUE_WAIT: Duration = Duration::from_secs(3600);

/// Send one request to a session's daemon and return its reply, waiting up to
/// [`QUEUE_WAIT`] for the daemon to take it and then up to `timeout` for the reply.
pub fn request(name: &str, req: &Value, timeout: Duration) -> Result<Value, CannotRun> {
    check_name(name)?;
    let reply = request_io(&socket_path(name), req, QUEUE_WAIT, timeout).map_err(|e| match e {
        Failed::Connect(e) => match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
                CannotRun(format!("no session '{name}' is running"))
            }
            std::io::ErrorKind::PermissionDenied => {
                CannotRun(format!("session '{name}': permission denied (only root or the session's owner may use it)"))
            }
            _ => CannotRun(format!("session '{name}': {e}")),
        },
        Failed::TooLarge(n) => {
            // Refused here, naming the limit: the daemon would stop reading and reset the send.
            CannotRun(format!(
                "session '{name}': the request takes {n} bytes, more than the {MAX_REQUEST} a session accepts"
            ))
        }
        Failed::Send(e) => CannotRun(format!("session '{name}': {e}")),
        Failed::Reply(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            CannotRun(format!(
                "session '{name}': no reply within {} s of the daemon taking the request",
                timeout.as_secs()
            ))
        }
        Failed::Reply(e) => CannotRun(format!("session '{name}': no reply: {e}")),
        Failed::NoReply => CannotRun(format!("session '{name}': the daemon sent no reply")),
    })?;
    if let Some(refused) = reply.get("refused").and_then(Value::as_str) {
        return Err(CannotRun(format!("session '{name}': {refused}")));
    }
    Ok(reply)
}

/// Where a request to a session's daemon failed.
#[derive(Debug)]
enum Failed {
    Connect(std::io::Error),
    TooLarge(usize),
    Send(std::io::Error),
    /// Reading the reply (a timeout: `WouldBlock`).
    Reply(std::io::Error),
    NoReply,
}

/// [`request`]'s exchange; a refusal is returned as the reply it is. The daemon writes a
/// line end as it takes a request (JSON whitespace before the reply): `queue` bounds the
/// wait for it — for the calls ahead — and `timeout` the wait for the reply after it.
fn request_io(socket: &Path, req: &Value, queue: Duration, timeout: Duration) -> Result<Value, Failed> {
    let mut stream = UnixStream::connect(socket).map_err(Failed::Connect)?;
    stream.set_read_timeout(Some(queue)).map_err(Failed::Connect)?;
    let bytes = serde_json::to_vec(req).map_err(|e| Failed::Send(e.into()))?;
    if bytes.len() > MAX_REQUEST {
        return Err(Failed::TooLarge(bytes.len()));
    }
    stream.write_all(&bytes).map_err(Failed::Send)?;
    stream.shutdown(std::net::Shutdown::Write).map_err(Failed::Send)?;
    let mut buf = vec![0u8; 1];
    let first = loop {
        match stream.read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => break r.map_err(Failed::Reply)?,
        }
    };
    buf.truncate(first);
    if first > 0 {
        stream.set_read_timeout(Some(timeout)).map_err(Failed::Reply)?;
        stream.take(64 << 20).read_to_end(&mut buf).map_err(Failed::Reply)?;
    }
    serde_json::from_slice(&buf).map_err(|_| Failed::NoReply)
}

/// Whether a client closed its end of `stream` (its process ended or dropped the
/// connection), not only its writing side as every client does once its request is sent:
/// a Unix stream socket reports `POLLHUP` only once its peer has closed both directions.
fn client_gone(stream: &UnixStream) -> bool {
    let mut fd = [PollFd::new(stream.as_fd(), PollFlags::empty())];
    matches!(poll(&mut fd, PollTimeout::ZERO), Ok(n) if n > 0)
        && fd[0].revents().is_some_and(|r| r.contains(PollFlags::POLLHUP))
}

/// One session's line in `session list`: its status; `busy` when its daemon is running a
/// call (it serves one client at a time); `None` for a socket left by a daemon that is
/// gone, or one this user may not reach.
fn status_of(name: &str) -> Option<Value> {
    let wait = Duration::from_secs(5);
    match request_io(&socket_path(name), &json!({"op": "status"}), wait, wait) {
        Ok(status) if status.get("refused").is_none() => Some(status),
        Err(Failed::Reply(e)) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            Some(json!({"session": name, "status": "busy"}))
        }
        _ => None,
    }
}

/// `session list`: the running sessions and their status.
pub fn list() -> Result<Value, CannotRun> {
    let mut sessions = Vec::new();
    let entries = match std::fs::read_dir(SESSION_DIR) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(json!({"sessions": []})),
        Err(e) => return Err(CannotRun(format!("{SESSION_DIR}: {e}"))),
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_suffix(".sock")).map(str::to_string))
        .collect();
    names.sort();
    let names: Vec<String> = names.into_iter().filter(|n| check_name(n).is_ok()).collect();
    // Asked at once, up to 16 at a time: a busy session takes the 5 s of its request's
    // time limit, and a list of several must not take that many times over.
    for batch in names.chunks(16) {
        let replies: Vec<Option<Value>> = std::thread::scope(|scope| {
            let asked: Vec<_> = batch.iter().map(|name| scope.spawn(move || status_of(name))).collect();
            asked.into_iter().map(|t| t.join().unwrap_or(None)).collect()
        });
        sessions.extend(replies.into_iter().flatten());
    }
    Ok(json!({ "sessions": sessions }))
}

// ---------------------------------------------------------------------------------------
// The daemon

/// A client request.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum Request {
    Exec {
        code: String,
        #[serde(default)]
        globals: serde_json::Map<String, Value>,
        #[serde(default)]
        r#return: Vec<String>,
        #[serde(default)]
        timeout_s: Option<u64>,
    },
    Stop,
    Status,
}

/// Why no message came from the runtime.
enum NoMessage {
    /// Its end of the channel is closed, or the sandbox ended.
    Ended,
    /// It broke the protocol (a malformed or oversize message) or the channel failed; it
    /// may still be running.
    Broken(String),
    /// The daemon received a stop signal (SIGTERM, SIGINT, SIGHUP).
    Signalled,
    /// The client of the call has gone (closed its connection: killed, Ctrl-C, gave up).
    ClientGone,
}

impl std::fmt::Display for NoMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoMessage::Ended => f.write_str("the session's interpreter ended"),
            NoMessage::Broken(e) => f.write_str(e),
            NoMessage::Signalled => f.write_str("the daemon was signalled"),
            NoMessage::ClientGone => f.write_str("the call's client went away"),
        }
    }
}

/// Why the session ended.
enum End {
    Stopped,
    Idle,
    CallTimeout(u64),
    /// The sandbox ended on its own (OOM, lifetime, crash).
    Died,
    Signal,
}

/// Most bytes of JSON a call's `stdout`, `stderr` and `error` keep (as the runtime counts).
const OUTPUT_CAP: usize = 1 << 20;

/// Room past [`OUTPUT_CAP`] for the note the runtime appends to what it cut
/// (`[opservant: N more characters dropped]`), kept as it is.
const OUTPUT_NOTE_ROOM: usize = 256;

/// `text` within [`OUTPUT_CAP`] bytes of JSON (and the runtime's note of what it cut), or
/// cut to it with a note of what was dropped.
fn capped(text: String) -> String {
    let json_len = |t: &str| serde_json::to_string(t).map_or(usize::MAX, |j| j.len() - 2);
    let total = json_len(&text);
    if total <= OUTPUT_CAP + OUTPUT_NOTE_ROOM {
        return text;
    }
    let mut end = OUTPUT_CAP.min(text.len());
    loop {
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let cost = json_len(&text[..end]);
        if cost <= OUTPUT_CAP {
            break;
        }
        end = end.saturating_sub((cost - OUTPUT_CAP).max(1));
    }
    let dropped = text.len() - end;
    format!("{}\n[opservant: {dropped} more bytes dropped]", &text[..end])
}

struct Daemon {
    settings: Settings,
    limits: EffectiveLimits,
    /// The cgroup limits in force, and those degraded mode let go, as a run's result says
    /// them (`limits.enforced`, `limits.degraded`).
    cgroup: Option<sandbox::CgroupReport>,
    /// The CPU quota, written when the runtime is ready (in force from then on).
    cpu: std::sync::Arc<sandbox::CpuLimiter>,
    chan: sandbox::channel::Channel,
    stop: sandbox::StopHandle,
    /// The OOM kills in the sandbox: any ends it (the monitor then kills the rest), but the
    /// killed process's parent may reply to the call first.
    oom: Option<sandbox::cgroup::OomCounter>,
    /// Becomes readable (end of file) when the sandbox has ended.
    done: std::os::fd::OwnedFd,
    waiter: Option<std::thread::JoinHandle<Result<sandbox::Outcome, sandbox::SandboxError>>>,
    outcome: Option<Result<sandbox::Outcome, String>>,
    started: Instant,
    started_unix: u64,
    calls: u64,
    /// Interrupts sent to the session's processes so far (each call is told the count, see
    /// `ToPayload::SessionExec`).
    interrupts: u64,
    last_active: Instant,
    signals: nix::sys::signalfd::SignalFd,
}

/// `__session-serve`: the daemon. Reads [`Settings`] from stdin, reports one JSON line on
/// stdout (started, or the error), then serves the socket until the session ends.
pub fn serve(launcher: sandbox::Launcher, runtime: PathBuf) -> i32 {
    let mut input = Vec::new();
    let settings: Settings = match std::io::stdin().take(1 << 20).read_to_end(&mut input) {
        Ok(_) => match serde_json::from_slice(&input) {
            Ok(s) => s,
            Err(e) => return report_failure(&format!("bad settings: {e}")),
        },
        Err(e) => return report_failure(&format!("cannot read settings: {e}")),
    };
    match Daemon::start(settings, launcher, runtime) {
        Ok((mut daemon, listener, lock)) => {
            let end = daemon.run(&listener);
            drop(listener);
            daemon.finish(end, lock);
            0
        }
        Err(e) => report_failure(&e.0),
    }
}

/// The limits as reported: bandwidth is not enforced (sessions have no network), so null,
/// as in a run's result; which are in force (`enforced`) and which degraded mode let go
/// (`degraded`, with the reason), as a run's result says them.
fn limits_json(limits: &EffectiveLimits, cgroup: Option<&sandbox::CgroupReport>, cpu: &sandbox::CpuLimiter) -> Value {
    let mut v = serde_json::to_value(limits).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.insert("max_bandwidth_mbps".into(), Value::Null);
        // A deferred quota is in force once written (the report was taken before).
        let (memory, pids) = cgroup.map_or((false, false), |c| (c.memory, c.pids));
        let cpu = cgroup.is_some_and(|c| c.cpu) || cpu.enforced();
        o.insert("enforced".into(), json!({"memory": memory, "cpu": cpu, "pids": pids, "disk": true, "timeout": true}));
        o.insert("degraded".into(), json!(cgroup.map_or(&[][..], |c| &c.degraded[..])));
    }
    v
}

fn report_failure(error: &str) -> i32 {
    tracing::error!(target: "opservant::session", "{error}");
    // Never a panic (`println!`'s) when whoever started the session is gone.
    let _ = crate::stdout::print(&format!("{}\n", json!({ "status": "failed", "error": error })));
    1
}

/// Why a start of `name` fails while a daemon holds the name.
fn already_running(name: &str) -> String {
    format!("session '{name}' is already running")
}

/// Hold `NAME.lock` for the daemon's life; a second daemon for the same name fails here.
fn take_lock(name: &str) -> Result<std::fs::File, CannotRun> {
    use std::os::unix::fs::MetadataExt;
    let path = lock_path(name);
    for _ in 0..3 {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| CannotRun(format!("{}: {e}", path.display())))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(CannotRun(already_running(name)));
        }
        // The previous holder may have removed the path after we opened it: the lock is only
        // ours if the path still names the file we locked.
        let ours = file.metadata().map(|m| m.ino()).ok();
        let current = std::fs::metadata(&path).map(|m| m.ino()).ok();
        if ours.is_some() && ours == current {
            return Ok(file);
        }
    }
    Err(CannotRun(format!("{}: could not be locked", path.display())))
}

impl Daemon {
    fn start(
        settings: Settings,
        launcher: sandbox::Launcher,
        runtime: PathBuf,
    ) -> Result<(Daemon, UnixListener, std::fs::File), CannotRun> {
        ensure_dir()?;
        let lock = take_lock(&settings.name)?;
        // Ours: a start that fails from here on removes it — before the lock is let go (the
        // duplicate holds it: flock belongs to the open file), so no other daemon's is removed.
        let held = lock.try_clone().map_err(|e| CannotRun(format!("{}: {e}", lock_path(&settings.name).display())))?;
        let name = settings.name.clone();
        Self::start_locked(settings, launcher, runtime, lock).inspect_err(|_| {
            let _ = std::fs::remove_file(lock_path(&name));
            drop(held);
        })
    }

    fn start_locked(
        mut settings: Settings,
        launcher: sandbox::Launcher,
        runtime: PathBuf,
        lock: std::fs::File,
    ) -> Result<(Daemon, UnixListener, std::fs::File), CannotRun> {
        let config = crate::config::Config::load(settings.config.as_deref())?;
        let policy = AgentPolicy::from_config(&config)?;
        audit::init(&config)?;
        // Each past its maximum is clamped to it, reported in the reply's `limits.clamped`. A
        // call is one execution: it runs at most the agent's ceiling too
        // (`resource_limits.max_timeout_seconds`), as an executor run or a script does. The
        // session itself lives up to its lifetime, idle most of it.
        let ceiling = policy.limits.ceilings.timeout_seconds.max(1);
        let (call_max, call_reason) = if ceiling < MAX_CALL_TIMEOUT_S {
            (ceiling, "above the agent's ceiling")
        } else {
            (MAX_CALL_TIMEOUT_S, "a call runs at most 300 s")
        };
        let mut clamped = Vec::new();
        for (field, value, max, reason) in [
            ("call_timeout_seconds", &mut settings.call_timeout_s, call_max, call_reason),
            (
                "idle_timeout_seconds",
                &mut settings.idle_timeout_s,
                MAX_IDLE_TIMEOUT_S,
                "a session idles at most 86400 s",
            ),
            (
                "max_lifetime_seconds",
                &mut settings.max_lifetime_s,
                MAX_MAX_LIFETIME_S,
                "a session lives at most 7 days",
            ),
        ] {
            if *value > max {
                clamped.push(crate::limits::Clamp { field, requested: *value, applied: max, reason: reason.into() });
                *value = max;
            }
        }
        let manifest = match &settings.manifest {
            Some(p) => Some(crate::manifest::Manifest::load(p)?.0),
            None => None,
        };
        let runtime_str = runtime.to_string_lossy().into_owned();
        crate::policy::refuse_unmet(manifest.as_ref(), "a session", true)?;
        let (mut spec, mut limits) = policy.spec_for(manifest.as_ref(), &runtime_str, vec![])?;
        crate::policy::runtime_payload(&mut spec, &runtime);
        crate::policy::interpreter_view(&mut spec);
        // The same rules as a manifest's read paths: key material and host credentials are
        // never readable, even when an operator names them.
        let masked = spec.filesystem.masked.clone();
        for p in &settings.python_paths {
            let real = policy.check_read("--python-path", p, &masked)?;
            spec.filesystem.paths.push(sandbox::PathRule {
                source: Some(real),
                path: p.clone(),
                access: sandbox::Access::Read,
                optional: false,
                identity: None,
            });
        }
        spec.limits.timeout_ms = Some(settings.max_lifetime_s * 1000);
        limits.timeout_seconds = settings.max_lifetime_s;
        limits.clamped.retain(|c| c.field != "timeout_seconds");
        limits.clamped.extend(clamped);
        spec.hostname = format!("session-{}", settings.name).chars().take(63).collect();
        spec.validate()?;

        let path = socket_path(&settings.name);
        // Only a stale socket can be here: the lock is ours.
        let _ = std::fs::remove_file(&path);

        let mut sb = sandbox::Sandbox::spawn(&spec, &launcher, None)?;
        // Signals that end the daemon are read from a signalfd, so the sandbox is always
        // torn down (blocked only now: the sandbox's processes must not inherit the mask).
        let mut mask = nix::sys::signal::SigSet::empty();
        for s in [nix::sys::signal::SIGTERM, nix::sys::signal::SIGINT, nix::sys::signal::SIGHUP] {
            mask.add(s);
        }
        mask.thread_block().map_err(|e| CannotRun(format!("sigprocmask: {e}")))?;
        let signals = nix::sys::signalfd::SignalFd::with_flags(
            &mask,
            nix::sys::signalfd::SfdFlags::SFD_CLOEXEC | nix::sys::signalfd::SfdFlags::SFD_NONBLOCK,
        )
        .map_err(|e| CannotRun(format!("signalfd: {e}")))?;

        let chan = sb.take_app_channel().ok_or_else(|| CannotRun("no application channel".into()))?;
        let args = RuntimeArgs::Session {
            allow_imports: settings.allow_imports.clone(),
            default_imports: settings.default_imports.clone(),
            paths: settings.python_paths.iter().map(|p| p.to_string_lossy().into_owned()).collect(),
            proceed: true,
        };
        if let Err(e) = chan.send_bytes(&app::encode_args(&args)) {
            return Err(crate::executor_run::arguments_not_taken(sb, e));
        }
        let stop = sb.stop_handle();
        let oom = sb.oom_counter();
        let cgroup = sb.cgroup_report().cloned();
        let cpu = sb.cpu_limiter();
        // What the sandbox enforces, for the start's report (DESIGN.md §4's `sandbox`): the
        // payload's own report comes through the waiter.
        let started_report = sb.started_report();
        let (launch, host_uid, not_idmapped) = (sb.launch(), sb.host_uid(), sb.not_idmapped().to_vec());
        let (done, done_tx) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| CannotRun(format!("pipe: {e}")))?;
        let waiter = std::thread::spawn(move || {
            // Small caps: the runtime's own stdout/stderr carry nothing of the calls (each
            // call's output is captured inside and returned in its reply).
            let out = sandbox::OutputOptions { stdout_cap: 64 << 10, stderr_cap: 64 << 10, tee: None };
            let outcome = sb.wait(out);
            drop(done_tx);
            outcome
        });
        let now = Instant::now();
        let mut daemon = Daemon {
            settings,
            limits,
            cgroup,
            cpu: cpu.clone(),
            chan,
            stop,
            oom,
            done,
            waiter: Some(waiter),
            outcome: None,
            started: now,
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            calls: 0,
            interrupts: 0,
            last_active: now,
            signals,
        };

        // Start-up: the runtime reports ready (the CPU quota applies from here), then the
        // outcome of the default imports.
        let deadline = Instant::now() + START_TIMEOUT;
        let mut ready = false;
        let started = loop {
            match daemon.next_message(deadline, None) {
                // Answered once; a second `ready` is a protocol error.
                Ok(Some(FromPayload::Ready)) if !ready => {
                    ready = true;
                    // A failed write stops the sandbox at once (fail closed); the runtime,
                    // waiting for the answer, never reaches session code.
                    if let Err(e) = app::proceed(&daemon.chan, &cpu) {
                        break Err(format!("the runtime's start (CPU quota, then proceed): {e}"));
                    }
                }
                // Only after `ready`: the CPU quota is written on it. A start reply before it
                // (sent by code a default import ran) would have the session run unlimited.
                Ok(Some(FromPayload::SessionReply { .. })) if !ready => {
                    break Err("the runtime reported its start before it was ready".into())
                }
                // Its first message, before any session code (see `app::BUILD`).
                Ok(Some(FromPayload::WrongBuild { build })) if !ready => break Err(app::wrong_build_error(&build)),
                // The start's reply is call 0 (session code cannot run before it).
                Ok(Some(FromPayload::SessionReply { call: 0, success: true, .. })) => break Ok(()),
                Ok(Some(FromPayload::SessionReply { call: 0, error, .. })) => {
                    break Err(error.unwrap_or_else(|| "the session could not start".into()))
                }
                Ok(Some(other)) => break Err(format!("unexpected {} message from the runtime", other.kind())),
                Ok(None) => break Err(format!("the interpreter did not start within {} s", START_TIMEOUT.as_secs())),
                Err(e) => break Err(e.to_string()),
            }
        };
        // Sent before the payload's `execve`, so before `ready`: here by now, or on its way
        // through the waiter.
        let enforced = started.and_then(|()| {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
            started_report.recv_timeout(left).map_err(|_| "the sandbox's enforcement report never came".to_string())
        });
        let summary = enforced.as_ref().ok().map(|e| {
            let none = sandbox::CgroupReport::none();
            crate::result::SandboxSummary::new(
                e,
                daemon.cgroup.as_ref().unwrap_or(&none),
                launch,
                host_uid,
                &not_idmapped,
            )
        });
        let listener = enforced.and_then(|_| {
            let listener = UnixListener::bind(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .and_then(|()| listener.set_nonblocking(true))
                .map_err(|e| format!("{}: {e}", path.display()))?;
            Ok(listener)
        });
        // A start that cannot be audited fails like any other (DESIGN.md §6: fail closed).
        let listener = listener.and_then(|l| {
            let (name, pid) = (&daemon.settings.name, std::process::id().to_string());
            let imports = daemon.settings.allow_imports.join(",");
            // What degraded mode let go, in the record of the start (empty: every limit holds).
            let degraded = daemon.cgroup.as_ref().map_or_else(String::new, |c| c.degraded.join("; "));
            audit::try_record(
                "session_start",
                &[("session", name), ("allow_imports", &imports), ("pid", &pid), ("degraded", &degraded)],
            )
            .map(|()| {
                daemon.limits.audit_clamps(("session", name));
                l
            })
            .map_err(|e| e.to_string())
        });
        let listener = match listener {
            Ok(l) => l,
            Err(e) => {
                // Nothing of the session may outlive a failed start: sandbox, socket, lock.
                daemon.stop.stop();
                let detail = daemon.ended_because();
                let _ = std::fs::remove_file(&path);
                // The lock's path is removed by `start` while its duplicate still holds the
                // lock: removed here too, a successor's new lock file could go with it.
                drop(lock);
                return Err(CannotRun(if detail.is_empty() { e } else { format!("{e} ({detail})") }));
            }
        };
        let warnings: Vec<String> = daemon
            .settings
            .allow_imports
            .iter()
            .filter(|m| NEVER_IMPLIED.contains(&m.split('.').next().unwrap_or(m)))
            .map(|m| format!("'{m}' is allowlisted: session code can use it (seed 002 advises against it)"))
            .collect();
        let report = json!({
            "session": daemon.settings.name,
            "status": "started",
            "pid": std::process::id(),
            "socket": path,
            "allow_imports": daemon.settings.allow_imports,
            "default_imports": daemon.settings.default_imports.iter().map(|(a, m)| json!({"alias": a, "module": m})).collect::<Vec<_>>(),
            "call_timeout_seconds": daemon.settings.call_timeout_s,
            "idle_timeout_seconds": daemon.settings.idle_timeout_s,
            "max_lifetime_seconds": daemon.settings.max_lifetime_s,
            "limits": limits_json(&daemon.limits, daemon.cgroup.as_ref(), &daemon.cpu),
            "sandbox": summary,
            "warnings": warnings,
        });
        // Whoever started the session may be gone (Ctrl-C, a `timeout`): the session runs on
        // regardless (`session list` shows it), never a panic on the closed pipe.
        if let Err(e) = crate::stdout::print(&format!("{report}\n")) {
            tracing::warn!(target: "opservant::session", error = %e, "the start report could not be written");
        }
        // From here on the daemon's stdout is not read by anyone.
        if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
            // SAFETY: dup2 onto fd 1 replaces our own stdout; `null` stays valid for the call.
            unsafe { libc::dup2(null.as_raw_fd(), 1) };
        }
        Ok((daemon, listener, lock))
    }

    /// The next message from the runtime; `Ok(None)` when `deadline` passed first, `Err`
    /// when the runtime is gone or broke the protocol — sending part of a message and not
    /// the rest by `deadline` included —, a stop signal arrived, or the `client` watched
    /// has closed its connection.
    fn next_message(
        &mut self,
        deadline: Instant,
        client: Option<&UnixStream>,
    ) -> Result<Option<FromPayload>, NoMessage> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let ms = left.as_millis().min(60_000) as u16;
            let mut fds = vec![
                PollFd::new(self.chan.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.done.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.signals.as_fd(), PollFlags::POLLIN),
            ];
            // No events asked: a socket whose peer closed both directions reports POLLHUP
            // anyway (see `client_gone`).
            if let Some(c) = client {
                fds.push(PollFd::new(c.as_fd(), PollFlags::empty()));
            }
            match poll(&mut fds, PollTimeout::from(ms.max(1))) {
                Err(nix::errno::Errno::EINTR) | Ok(0) => continue,
                Err(e) => return Err(NoMessage::Broken(format!("poll: {e}"))),
                Ok(_) => {}
            }
            if fds[2].any().unwrap_or(false) {
                return Err(NoMessage::Signalled);
            }
            if fds.get(3).and_then(|c| c.revents()).is_some_and(|r| r.contains(PollFlags::POLLHUP)) {
                return Err(NoMessage::ClientGone);
            }
            if fds[0].any().unwrap_or(false) {
                return match app::recv_by(&self.chan, Some(deadline)) {
                    Ok(Some(msg)) => Ok(Some(msg)),
                    Ok(None) => Err(NoMessage::Ended),
                    // A message still incomplete at the deadline: the call ran out of time.
                    Err(_) if Instant::now() >= deadline => Ok(None),
                    Err(e) => Err(NoMessage::Broken(e)),
                };
            }
            if fds[1].any().unwrap_or(false) {
                return Err(NoMessage::Ended);
            }
        }
    }

    /// After the runtime's end of the channel: give the sandbox `grace` to end on its own
    /// (so that its own end — OOM, a signal — is what gets reported), then stop it. The
    /// sandbox itself ends only at the session's maximum lifetime: code that closed its end
    /// of the channel and went on must not keep the daemon waiting that long.
    fn let_end(&self, grace: Duration) {
        let ms = u16::try_from(grace.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(self.done.as_fd(), PollFlags::POLLIN)];
        let ended = matches!(poll(&mut fds, PollTimeout::from(ms)), Ok(n) if n > 0);
        if !ended {
            self.stop.stop();
        }
    }

    /// Wait for the sandbox to end (after a stop, or on its own) and describe how it ended.
    fn ended_because(&mut self) -> String {
        if let Some(waiter) = self.waiter.take() {
            self.outcome = Some(match waiter.join() {
                Ok(Ok(o)) => Ok(o),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("the sandbox supervisor panicked".into()),
            });
        }
        match &self.outcome {
            Some(Ok(o)) => match o.killed_by {
                Some(sandbox::KilledBy::Oom) if o.oom_at_limit == Some(false) => format!(
                    "the host or a parent cgroup ran out of memory (the session's limit of {} MB was not reached)",
                    self.limits.max_memory_mb
                ),
                Some(sandbox::KilledBy::Oom) => {
                    format!("it ran out of memory (limit {} MB)", self.limits.max_memory_mb)
                }
                Some(sandbox::KilledBy::Timeout) => {
                    format!("it reached its maximum lifetime ({} s)", self.settings.max_lifetime_s)
                }
                Some(sandbox::KilledBy::Pids) => format!("it hit the process limit ({})", self.limits.max_pids),
                _ if !o.stopped && o.ended_from_outside.is_some() => {
                    o.ended_from_outside.map(|e| e.to_string()).unwrap_or_default()
                }
                Some(sandbox::KilledBy::Signal(n)) if !o.stopped => format!("its interpreter was killed by signal {n}"),
                _ if o.stopped => String::new(),
                _ => match o.exit {
                    Some(x) => {
                        // The sandbox's own words, quoted and short: never read as the agent's.
                        let stderr = String::from_utf8_lossy(&o.stderr.bytes);
                        let last: String = stderr.lines().last().unwrap_or("").chars().take(200).collect();
                        format!(
                            "its interpreter exited with status {}{}",
                            x.shell_code(),
                            if last.is_empty() {
                                String::new()
                            } else {
                                format!(" (the last line it wrote to stderr: {last:?})")
                            }
                        )
                    }
                    None => "its interpreter ended".into(),
                },
            },
            Some(Err(e)) => e.clone(),
            None => String::new(),
        }
    }

    /// Serve clients until the session ends.
    fn run(&mut self, listener: &UnixListener) -> End {
        loop {
            let idle_deadline = self.last_active + Duration::from_secs(self.settings.idle_timeout_s);
            let left = idle_deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return End::Idle;
            }
            let ms = left.as_millis().min(60_000) as u16;
            let mut fds = [
                PollFd::new(listener.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.done.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.signals.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::from(ms.max(1))) {
                Err(nix::errno::Errno::EINTR) | Ok(0) => continue,
                Err(e) => {
                    tracing::error!(target: "opservant::session", "poll: {e}");
                    return End::Died;
                }
                Ok(_) => {}
            }
            let (listen_ready, done_ready, signal_ready) =
                (fds[0].any().unwrap_or(false), fds[1].any().unwrap_or(false), fds[2].any().unwrap_or(false));
            if signal_ready {
                return End::Signal;
            }
            if done_ready {
                return End::Died;
            }
            if listen_ready {
                let stream = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(_) => continue,
                };
                let end = self.client(stream);
                rotate_own_log(&self.settings.name);
                if let Some(end) = end {
                    return end;
                }
            }
        }
    }

    /// Handle one client connection; `Some` when the session ends with it.
    fn client(&mut self, mut stream: UnixStream) -> Option<End> {
        let _ = stream.set_nonblocking(false);
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let peer = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials);
        let allowed = matches!(&peer, Ok(c) if c.uid() == 0 || c.uid() == me);
        if !allowed {
            let uid = peer.map(|c| c.uid().to_string()).unwrap_or_else(|_| "?".into());
            audit::record("session_refused", &[("session", &self.settings.name), ("uid", &uid)]);
            let _ = stream.write_all(json!({"refused": "permission denied"}).to_string().as_bytes());
            return None;
        }
        // One deadline for the whole request (not per read: a client trickling bytes would
        // hold the daemon, which serves one client at a time), one for writing the reply.
        let _ = stream.set_write_timeout(Some(CLIENT_DEADLINE));
        let Some(buf) = crate::daemon::read_request(&mut stream, MAX_REQUEST as u64 + 1, CLIENT_DEADLINE) else {
            let why = format!("cannot read the request within {} s", CLIENT_DEADLINE.as_secs());
            let _ = stream.write_all(json!({"refused": why}).to_string().as_bytes());
            return None;
        };
        if buf.len() > MAX_REQUEST {
            let _ = stream.write_all(
                json!({"refused": format!("request larger than {MAX_REQUEST} bytes")}).to_string().as_bytes(),
            );
            return None;
        }
        let req: Request = match serde_json::from_slice(&buf) {
            Ok(r) => r,
            Err(e) => {
                let _ = stream.write_all(json!({"refused": format!("bad request: {e}")}).to_string().as_bytes());
                return None;
            }
        };
        // Taken: the client's wait for the reply starts now (JSON whitespace before it).
        let _ = stream.write_all(b"\n");
        let exec = matches!(req, Request::Exec { .. });
        // A call whose client has gone — killed, or given up while the call waited behind
        // another (the daemon serves one client at a time) — is not run: its caller was
        // told it failed, and nobody would get its reply.
        if let (Request::Exec { code, .. }, true) = (&req, client_gone(&stream)) {
            let digest = audit::sha256_hex(code.as_bytes());
            audit::record("session_exec_abandoned", &[("session", &self.settings.name), ("code_sha256", &digest)]);
            return None;
        }
        let (reply, end) = match req {
            Request::Status => (self.status(), None),
            Request::Stop => {
                self.stop.stop();
                let _ = self.ended_because();
                // The socket goes before the reply: a client told "stopped" never finds it.
                let _ = std::fs::remove_file(socket_path(&self.settings.name));
                let usage = self.outcome.as_ref().and_then(|o| o.as_ref().ok()).map(|o| o.usage);
                (
                    json!({"session": self.settings.name, "status": "stopped", "calls": self.calls, "usage": usage}),
                    Some(End::Stopped),
                )
            }
            // The CLI refuses `--timeout 0`; a raw request's is refused too, never raised.
            Request::Exec { timeout_s: Some(0), .. } => {
                (json!({"refused": "bad request: timeout_s must be at least 1 second"}), None)
            }
            Request::Exec { code, globals, r#return, timeout_s } => {
                let ceiling = self.settings.call_timeout_s;
                let (mut reply, end) = self.exec(code, globals, r#return, timeout_s, &stream);
                // `--timeout` above the session's is shortened, and the reply says so (a
                // limit is never changed silently).
                if let (Some(requested), Some(fields)) = (timeout_s.filter(|&t| t > ceiling), reply.as_object_mut()) {
                    if !fields.contains_key("refused") {
                        fields.insert(
                            "clamped".into(),
                            json!([{"field": "timeout_seconds", "requested": requested, "applied": ceiling,
                                    "reason": "the session's call timeout"}]),
                        );
                    }
                }
                (reply, end)
            }
        };
        let _ = stream.write_all(reply.to_string().as_bytes());
        // Idle means without a call: `status` (`session list`) and refusals do not count.
        if exec && reply.get("refused").is_none() {
            self.last_active = Instant::now();
        }
        end
    }

    fn status(&self) -> Value {
        json!({
            "session": self.settings.name,
            "status": "running",
            "pid": std::process::id(),
            "started_at": self.started_unix,
            "uptime_seconds": self.started.elapsed().as_secs(),
            "idle_seconds": self.last_active.elapsed().as_secs(),
            "calls": self.calls,
            "allow_imports": self.settings.allow_imports,
            "call_timeout_seconds": self.settings.call_timeout_s,
            "idle_timeout_seconds": self.settings.idle_timeout_s,
            "limits": limits_json(&self.limits, self.cgroup.as_ref(), &self.cpu),
        })
    }

    fn exec(
        &mut self,
        code: String,
        globals: serde_json::Map<String, Value>,
        names: Vec<String>,
        timeout_s: Option<u64>,
        client: &UnixStream,
    ) -> (Value, Option<End>) {
        let timeout_s = timeout_s.unwrap_or(self.settings.call_timeout_s).clamp(1, self.settings.call_timeout_s);
        let started = Instant::now();
        // A stop signal that came while the request was read: the call does not run.
        let mut pending = [PollFd::new(self.signals.as_fd(), PollFlags::POLLIN)];
        if matches!(poll(&mut pending, PollTimeout::ZERO), Ok(n) if n > 0) {
            self.stop.stop();
            let _ = self.ended_because();
            let reply = json!({
                "status": "failed",
                "success": false, "error": "the session has ended: its daemon was signalled",
                "stdout": "", "stderr": "", "globals": {}, "session_ended": true, "killed_by": null,
                "duration_ms": 0,
            });
            return (reply, Some(End::Signal));
        }
        let digest = audit::sha256_hex(code.as_bytes());
        // Fail closed: a call whose start cannot be audited does not run (the session goes on).
        if let Err(e) = audit::try_record("session_exec", &[("session", &self.settings.name), ("code_sha256", &digest)])
        {
            return (json!({"refused": format!("the call could not be audited: {e}")}), None);
        }
        self.calls += 1;
        // The OOM kills so far: one during this call ends the session with it.
        let oom_before = self.oom.as_ref().and_then(|c| c.kills());
        let deadline = started + Duration::from_secs(timeout_s);
        let call = self.calls;
        let msg = ToPayload::SessionExec { call, interrupts: self.interrupts, code, globals, r#return: names };
        // A runtime that stopped reading (session code can make it) must not hold the daemon:
        // the whole send, too, is bounded by the call's time limit.
        let sent = self.chan.send_bytes_by(&app::encode(&msg), Some(deadline));
        let ended = |d: &Daemon, why: String, killed_by: Option<&str>| -> Value {
            let reply = json!({
                // DESIGN.md §4's status: the call's own time limit, or the session's lifetime.
                "status": if killed_by == Some("timeout") { "timeout" } else { "failed" },
                "success": false,
                "error": why,
                "stdout": "", "stderr": "", "globals": {},
                "session_ended": true,
                "killed_by": killed_by,
                "duration_ms": started.elapsed().as_millis() as u64,
            });
            audit::record(
                "session_exec_end",
                &[("session", &d.settings.name), ("code_sha256", &digest), ("success", "false"), ("ended", &why)],
            );
            reply
        };
        if let Err(e) = sent {
            self.stop.stop();
            let _ = self.ended_because();
            let why = format!("the session has ended: the call could not be sent to its interpreter: {}", e.desc());
            return (ended(self, why, None), Some(End::Died));
        }
        // Watched until it goes: then the call is interrupted (KeyboardInterrupt in session
        // code, SIGINT to its processes), as Ctrl-C would stop it in a terminal; the session
        // goes on. Code that carries on regardless is still bounded by the call's timeout.
        let mut watched = Some(client);
        loop {
            match self.next_message(deadline, watched) {
                Err(NoMessage::ClientGone) => {
                    watched = None;
                    audit::record(
                        "session_exec_interrupted",
                        &[("session", &self.settings.name), ("code_sha256", &digest), ("reason", "client_gone")],
                    );
                    self.interrupts += 1;
                    self.stop.interrupt();
                }
                Ok(Some(FromPayload::SessionReply { call: answers, success, error, stdout, stderr, globals }))
                    if answers == call =>
                {
                    if self.oom.as_ref().and_then(|c| c.kills()).is_some_and(|n| Some(n) > oom_before.or(Some(0))) {
                        // A process of the call was killed for memory (a child whose parent
                        // then replied): the sandbox is ending, and the call with it.
                        self.let_end(Duration::from_secs(2));
                        let why = match self.ended_because() {
                            // Stopped by `let_end` before the monitor ended it: the kill is
                            // still the reason.
                            why if why.is_empty() => {
                                format!("it ran out of memory (limit {} MB)", self.limits.max_memory_mb)
                            }
                            why => why,
                        };
                        return (ended(self, format!("the session has ended: {why}"), Some("oom")), Some(End::Died));
                    }
                    // The runtime keeps each within its cap; what the sandbox sends is held
                    // to it here too.
                    let (stdout, stderr) = (capped(stdout), capped(stderr));
                    let error = error.map(capped);
                    audit::record(
                        "session_exec_end",
                        &[
                            ("session", &self.settings.name),
                            ("code_sha256", &digest),
                            ("success", if success { "true" } else { "false" }),
                        ],
                    );
                    let reply = json!({
                        "status": if success { "completed" } else { "failed" },
                        "success": success, "error": error, "stdout": stdout, "stderr": stderr, "globals": globals,
                        "session_ended": false,
                        "duration_ms": started.elapsed().as_millis() as u64,
                    });
                    return (reply, None);
                }
                Ok(Some(FromPayload::Ready)) => continue,
                Ok(Some(FromPayload::SessionReply { call: answers, .. })) => {
                    // A reply to another call: session code replied for the runtime (whose
                    // own reply to that call comes now), or a stale one. Taken as this
                    // call's answer it would shift every later reply by one.
                    self.stop.stop();
                    let _ = self.ended_because();
                    let why = format!(
                        "the session has ended: its interpreter broke the protocol: a reply to call {answers} during call {call}"
                    );
                    tracing::warn!(target: "opservant::session", "{why}");
                    return (ended(self, why, None), Some(End::Died));
                }
                Ok(Some(other)) => {
                    // Not part of a call (session code reaching `_opservant`): a protocol
                    // break that ends the session. Named, never logged in full — the log is
                    // on tmpfs, and the message up to 16 MiB.
                    self.stop.stop();
                    let _ = self.ended_because();
                    let why = format!(
                        "the session has ended: its interpreter broke the protocol: a {} message during a call",
                        other.kind()
                    );
                    tracing::warn!(target: "opservant::session", "{why}");
                    return (ended(self, why, None), Some(End::Died));
                }
                Ok(None) => {
                    self.stop.stop();
                    let _ = self.ended_because();
                    let why = format!("the call timed out after {timeout_s} s; the session has ended");
                    return (ended(self, why, Some("timeout")), Some(End::CallTimeout(timeout_s)));
                }
                Err(NoMessage::Signalled) => {
                    self.stop.stop();
                    let _ = self.ended_because();
                    let why = "the session has ended: its daemon was signalled during the call".to_string();
                    return (ended(self, why, None), Some(End::Signal));
                }
                Err(no) => {
                    // Broken: it may run on (its sandbox ends only at the maximum lifetime) —
                    // stopped at once, and the reply says why.
                    let broken = match no {
                        NoMessage::Broken(e) => {
                            self.stop.stop();
                            Some(e)
                        }
                        NoMessage::Ended | NoMessage::Signalled | NoMessage::ClientGone => {
                            self.let_end(Duration::from_secs(2));
                            None
                        }
                    };
                    let why = self.ended_because();
                    let killed_by = self
                        .outcome
                        .as_ref()
                        .and_then(|o| o.as_ref().ok())
                        .and_then(|o| match o.killed_by {
                            // Our own stop's signal is not what ended it.
                            Some(sandbox::KilledBy::Signal(_)) if o.stopped => None,
                            k => k,
                        })
                        .map(|k| k.to_string());
                    let killed_by = killed_by.as_deref();
                    let why = match broken {
                        Some(e) => format!("the session has ended: its interpreter broke the protocol: {e}"),
                        None if why.is_empty() => "the session has ended: its interpreter ended".to_string(),
                        None => format!("the session has ended: {why}"),
                    };
                    return (ended(self, why, killed_by), Some(End::Died));
                }
            }
        }
    }

    /// Tear down: stop the sandbox, remove the socket and lock, audit the end.
    fn finish(&mut self, end: End, lock: std::fs::File) {
        self.stop.stop();
        let detail = self.ended_because();
        let reason = match end {
            End::Stopped => "stopped".to_string(),
            End::Idle => format!("idle for {} s", self.settings.idle_timeout_s),
            End::CallTimeout(s) => format!("a call timed out after {s} s"),
            End::Died => {
                if detail.is_empty() {
                    "the interpreter ended".into()
                } else {
                    detail
                }
            }
            End::Signal => "the daemon was signalled".into(),
        };
        let _ = std::fs::remove_file(socket_path(&self.settings.name));
        let _ = std::fs::remove_file(lock_path(&self.settings.name));
        drop(lock);
        audit::record(
            "session_end",
            &[("session", &self.settings.name), ("reason", &reason), ("calls", &self.calls.to_string())],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's wait for its reply starts when the daemon takes its request, not when it
    /// is sent: behind a long call (the daemon serves one client at a time) it gave up after
    /// the call timeout + 60 s while its own call ran, which then saw it gone.
    #[test]
    fn the_reply_is_awaited_from_when_the_daemon_takes_the_request() {
        let dir = std::env::temp_dir().join(format!("opservant-session-queue-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("s.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            for taken_after in [Duration::from_secs(4), Duration::ZERO] {
                let (mut c, _) = listener.accept().unwrap();
                std::thread::sleep(taken_after);
                let mut req = Vec::new();
                c.read_to_end(&mut req).unwrap();
                c.write_all(b"\n").unwrap();
                std::thread::sleep(Duration::from_millis(500));
                // (The second client has given up by then.)
                let _ = c.write_all(b"{\"success\": true}");
            }
        });
        // Queued 4 s, answered 0.5 s after being taken: within a 3 s reply wait (a clock
        // started at the send would have given up after 3 s).
        let reply = request_io(&socket, &json!({"op": "exec"}), Duration::from_secs(10), Duration::from_secs(3));
        assert_eq!(reply.ok(), Some(json!({"success": true})));
        // The reply wait itself still holds.
        let late = request_io(&socket, &json!({"op": "exec"}), Duration::from_secs(10), Duration::from_millis(200));
        assert!(matches!(late, Err(Failed::Reply(ref e)) if e.kind() == std::io::ErrorKind::WouldBlock), "{late:?}");
        daemon.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn settings(allow: &[&str], defaults: &[&str]) -> Result<Settings, CannotRun> {
        let allow: Vec<String> = allow.iter().map(|s| s.to_string()).collect();
        let defaults: Vec<String> = defaults.iter().map(|s| s.to_string()).collect();
        Settings::new("s1", &allow, &defaults, None, None, None, &[], None, None)
    }

    #[test]
    fn allowlist_and_defaults() {
        let s = settings(&["json,math", "re"], &["np=numpy", "m=math"]).unwrap();
        assert_eq!(s.allow_imports, ["json", "math", "re", "numpy"]);
        assert_eq!(s.default_imports, [("np".to_string(), "numpy".to_string()), ("m".to_string(), "math".to_string())]);
        assert_eq!(s.call_timeout_s, DEFAULT_CALL_TIMEOUT_S);
        // A default import never implies os, subprocess, ctypes or socket...
        assert!(settings(&[], &["o=os"]).is_err());
        assert!(settings(&[], &["p=os.path"]).is_err());
        assert!(settings(&[], &["s=socket"]).is_err());
        // ...but an explicit allow does.
        assert!(settings(&["os"], &["p=os.path"]).is_ok());
        // No allowlist: nothing allowed.
        assert!(settings(&[], &[]).unwrap().allow_imports.is_empty());
    }

    #[test]
    fn names_and_values_are_checked() {
        assert!(settings(&["json;rm"], &[]).is_err());
        assert!(settings(&[], &["1x=json"]).is_err());
        assert!(check_name("../x").is_err());
        assert!(check_name("").is_err());
        assert!(check_name("-x").is_err());
        assert!(check_name("analysis_1").is_ok());
        let allow: Vec<String> = vec![];
        assert!(Settings::new("s", &allow, &allow, Some(0), None, None, &[], None, None).is_err());
        // Past the maximum: clamped when the session starts, not refused.
        assert_eq!(
            Settings::new("s", &allow, &allow, Some(301), None, None, &[], None, None).unwrap().call_timeout_s,
            301
        );
    }
}
