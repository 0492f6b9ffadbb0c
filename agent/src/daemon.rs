//! `opservant agent`: the long-running agent, and `opservant submit`, its on-host client.
//!
//! This part of the daemon accepts signed commands on a root-only Unix socket (default
//! [`DEFAULT_SOCKET`]): a client connects, writes one command, shuts its write side, and reads
//! one reply (JSON, one line). Every command goes through [`crate::command::Pipeline`].
//!
//! Guarantees:
//! - only clients running as root (uid 0, checked with `SO_PEERCRED`) are served; the socket
//!   is created mode 0600, inside a 0700 directory when the agent creates that directory (an
//!   existing one is never chmodded);
//! - at most `agent.max_concurrent` commands run at once; one more is answered at once with
//!   `status: "rejected"`, `reason: "overloaded"` (audited), never queued without bound;
//! - at most `max_concurrent` + [`CONNECTION_HEADROOM`] connections are served at once (each
//!   has a thread); a connection beyond them is answered `overloaded` without being read, by
//!   a thread of its own (its audit record may wait for the log's lock; the accept loop and
//!   the watchdog never do), at most [`REFUSAL_QUEUE`] waiting — past them, closed
//!   unanswered and counted in the next refusal's record (at the stop, those still queued
//!   are closed unanswered and counted in one record before `agent_stop`);
//! - a client has [`READ_DEADLINE`] in all to send its command (not per read: a client
//!   trickling bytes cannot hold its thread), then the connection is closed unanswered;
//! - SIGHUP is logged and ignored (there is no reload: a restart applies a new configuration);
//! - SIGTERM or SIGINT: the socket is closed and removed (no new work), the commands already
//!   running finish (their limits bound how long) and get their replies, then the process
//!   exits 0; systemd is told `READY=1`, `STOPPING=1` and, with `WatchdogSec`, `WATCHDOG=1`
//!   (a ping never waits: one that finds the notify socket's queue full is dropped);
//! - a second agent on the same socket is refused (exit 2), a stale socket is replaced, and a
//!   path that exists but is not a socket is refused (exit 2), never deleted.
//!
//! With `network.agent_to_platform` configured it also polls the platform over mutual TLS
//! ([`crate::platform`]); those commands share the concurrency limit and the drain.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::command::Pipeline;
use crate::executor_run::CannotRun;

pub const DEFAULT_SOCKET: &str = "/run/opservant/agent.sock";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/opservant";
pub const DEFAULT_MAX_CONCURRENT: usize = 4;
/// How often the warm pool is checked for sandboxes idle past their limit.
const POOL_EXPIRY_CHECK: Duration = Duration::from_secs(60);
/// How long a client may take to send its whole command.
pub const READ_DEADLINE: Duration = Duration::from_secs(10);
/// Connections served at once beyond `max_concurrent`: clients still sending their command
/// and those being answered `overloaded`. Bounds the daemon's threads.
pub const CONNECTION_HEADROOM: usize = 64;

/// `sd_notify(3)` without libsystemd: one datagram to `$NOTIFY_SOCKET`, when set. Blocks
/// while the reader's queue is full (`net.unix.max_dgram_qlen`): for the state changes
/// (`READY=1`, `STOPPING=1`), which must arrive. Watchdog pings use [`watchdog_ping`].
pub fn sd_notify(state: &str) {
    notify(state, false);
}

/// `WATCHDOG=1` without waiting: a ping that finds the reader's queue full is dropped (and
/// warned about), so that a slow reader of `$NOTIFY_SOCKET` cannot stall the accept loop
/// that sends it; the next ping goes out on the loop's next turn.
fn watchdog_ping() {
    notify("WATCHDOG=1", true);
}

fn notify(state: &str, nonblocking: bool) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else { return };
    if nonblocking && sock.set_nonblocking(true).is_err() {
        return;
    }
    let bytes = path.as_encoded_bytes();
    let sent = if let Some(abstract_name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)
            .and_then(|addr| sock.send_to_addr(state.as_bytes(), &addr))
    } else {
        sock.send_to(state.as_bytes(), Path::new(&path))
    };
    // A reader that falls behind fails every ping (one per accepted connection): warned
    // about once until a ping gets through again.
    static BEHIND: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match sent {
        Ok(_) => BEHIND.store(false, Ordering::Relaxed),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            if !BEHIND.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    state,
                    "sd_notify: the notify socket's queue is full; watchdog pings dropped until it drains"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, state, "sd_notify failed"),
    }
}

/// `path`, when something is there, must be a socket: anything else is not the agent's to
/// replace (a configuration naming a regular file must not delete it).
fn check_socket_path(path: &Path) -> Result<(), CannotRun> {
    use std::os::unix::fs::FileTypeExt;
    // `sun_path` holds 108 bytes, the terminating NUL among them.
    let len = path.as_os_str().len();
    if len > 107 {
        return Err(CannotRun(format!(
            "agent.socket: {} is {len} bytes long; a Unix socket's path holds at most 107",
            path.display()
        )));
    }
    // The socket's directory must be the agent's alone (a missing one is created 0700 by
    // `bind`): whoever else could write it — a shared `/tmp` — could take the socket's name
    // first, keep the agent from starting, and answer `opservant submit` in its place.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        match std::fs::metadata(dir) {
            Ok(m) => crate::config::check_agents_own_dir(dir, &m).map_err(|m| {
                CannotRun(format!(
                    "agent.socket: {m}; the socket's directory must be the agent's alone (whoever else can write it \
                     could take the socket's name)"
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(CannotRun(format!("agent.socket: {}: {e}", dir.display()))),
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => Ok(()),
        Ok(_) => Err(CannotRun(format!(
            "agent.socket: {} exists and is not a socket; refusing to replace it",
            path.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match path.parent().map(std::fs::metadata) {
            Some(Ok(m)) if !m.is_dir() => {
                Err(CannotRun(format!("agent.socket: {}: its parent is not a directory", path.display())))
            }
            _ => Ok(()),
        },
        Err(e) => Err(CannotRun(format!("agent.socket: {}: {e}", path.display()))),
    }
}

/// The device and inode of the file at `path` (not followed).
fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Bind the socket: refuse if an agent answers on it or if the path is not a socket, replace
/// a stale socket. The parent directory is created 0700 when missing; one that exists must
/// be the agent's alone ([`check_socket_path`]).
fn bind(path: &Path) -> Result<UnixListener, CannotRun> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| CannotRun(format!("{}: {e}", dir.display())))?;
            // Created here: 0700 whatever the umask.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| CannotRun(format!("{}: {e}", dir.display())))?;
        }
    }
    check_socket_path(path)?;
    if std::fs::symlink_metadata(path).is_ok() {
        if UnixStream::connect(path).is_ok() {
            return Err(CannotRun(format!("{}: another agent is already listening", path.display())));
        }
        std::fs::remove_file(path).map_err(|e| CannotRun(format!("{}: {e}", path.display())))?;
    }
    // Created 0600 by bind itself under this umask — no chmod by path afterwards, which in
    // a shared directory could be sent through a link planted at the name.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let listener = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    listener.map_err(|e| CannotRun(format!("{}: {e}", path.display())))
}

/// Block the stop signals (SIGTERM, SIGINT), and SIGHUP, in the calling thread and so in every thread it
/// starts afterwards; [`serve`] reads them from a signalfd. Call before the daemon starts
/// any thread (the zygote's network namespace stash, the warm pool's pre-warm): a thread
/// that leaves them unblocked would take a stop signal with its default action, killing the
/// agent instead of draining it. A stop signal that arrives before `serve` stays pending
/// and stops the agent as soon as it serves.
pub fn block_stop_signals() -> Result<nix::sys::signal::SigSet, CannotRun> {
    use nix::sys::signal::{SigSet, Signal};
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    // Not a stop signal, read from the same signalfd: at its default a SIGHUP (the usual
    // "reload") killed the agent mid-command, unaudited — and systemd counts a death by
    // SIGHUP as a clean exit, so `Restart=on-failure` left the host without an agent.
    mask.add(Signal::SIGHUP);
    mask.thread_block().map_err(|e| CannotRun(format!("block signals: {e}")))?;
    Ok(mask)
}

/// Serve until SIGTERM/SIGINT.
/// The daemon's memory never goes to a core dump: it holds the platform's connection key,
/// the secret store's key, a cached Vault token and the values being delivered. No core
/// file size (inherited by everything it starts; sandboxes set it again) and not dumpable
/// (a piped `core_pattern` handler is not bound by the size limit). Its own children are
/// `execve`d (the zygote, the monitor), which makes them dumpable again where they need it.
pub fn no_core_dumps() -> Result<(), CannotRun> {
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0)
        .map_err(|e| CannotRun(format!("setrlimit(RLIMIT_CORE, 0): {e}")))?;
    // SAFETY: PR_SET_DUMPABLE takes an integer argument and touches no memory.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(CannotRun(format!("prctl(PR_SET_DUMPABLE, 0): {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

/// `opservant doctor` as the service sees the host — under its unit's capabilities, system
/// call filters and `ProtectSystem=`, which `doctor` run from a shell does not share: a
/// summary, an error for each missing required feature and a warning for each degradation
/// (the sandboxes' shared `nobody` or host uid, root's inotify headroom, …), logged at start.
/// The heartbeat reports the same list to the platform.
fn log_service_view(policy: &crate::policy::AgentPolicy) {
    let report = crate::doctor::examine(policy.landlock_min_abi, policy.allow_degraded, policy.host_uids.as_ref());
    let missing: Vec<&crate::doctor::Finding> = report.findings.iter().filter(|f| f.required && !f.ok).collect();
    let (count_missing, count_degraded) = (missing.len(), report.degraded.len());
    if count_missing + count_degraded > 0 {
        tracing::warn!(
            target: "opservant::daemon",
            "doctor, as the service sees this host: {count_missing} required features missing, {count_degraded} degradations"
        );
    } else {
        tracing::info!(target: "opservant::daemon", "doctor, as the service sees this host: nothing missing or degraded");
    }
    for f in missing {
        tracing::error!(target: "opservant::daemon", feature = f.feature, "missing (as the service sees this host): {}: {}", f.feature, f.detail);
    }
    for d in &report.degraded {
        tracing::warn!(target: "opservant::daemon", "degraded (as the service sees this host): {d}");
    }
}

pub fn serve(pipeline: Pipeline, socket: &Path, platform: Option<crate::platform::Platform>) -> Result<(), CannotRun> {
    let mask = block_stop_signals()?;
    let signals = nix::sys::signalfd::SignalFd::with_flags(&mask, nix::sys::signalfd::SfdFlags::SFD_CLOEXEC)
        .map_err(|e| CannotRun(format!("signalfd: {e}")))?;

    let listener = bind(socket)?;
    // The socket file this agent bound: only that one is removed at the stop (another's,
    // bound at the same path since, is left alone).
    let bound = socket_identity(socket);
    if !sandbox::probe::openat2_available() {
        // A reported degradation of path resolution (as the shared host uid below).
        tracing::warn!(
            target: "opservant::daemon",
            "openat2 answers ENOSYS in this process (a kernel before 5.6, or a seccomp filter such as systemd's RestrictSUIDSGID=): \
             declared host paths are resolved one component at a time without following a symlink, the view's system paths \
             without RESOLVE_IN_ROOT"
        );
    }
    // Before readiness, as the identity's own lookup (NSS, which a directory service may
    // answer slowly) is.
    log_service_view(&pipeline.policy);
    let pipeline = Arc::new(pipeline);
    let mut workers: Vec<std::thread::JoinHandle<()>> = Vec::new();
    let refusals = Refusals::start(pipeline.clone())?;
    crate::audit::record(
        "agent_start",
        &[("socket", &socket.to_string_lossy()), ("pid", &std::process::id().to_string())],
    );
    // The binaries' digests, off the start path: `agent_binaries` in the log, `binaries` in
    // pings and heartbeats.
    crate::integrity::start();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Commands from the platform taken but not yet answered (the drain waits for them).
    let platform_commands = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    if let Some(p) = platform {
        // Its threads are not joined: a long poll in flight may take its full timeout (the
        // commands it brings back after the stop are left to the platform to send again).
        drop(crate::platform::run(p, pipeline.clone(), stop.clone(), platform_commands.clone()));
    }
    sd_notify("READY=1");
    let watchdog = watchdog_interval();
    // The warm pool's idle sandboxes are discarded on this loop's clock (on a thread: each
    // is killed, reaped and its cgroups removed).
    let mut expired_at = std::time::Instant::now();
    // Twice per idle limit (so none waits more than half its limit past it), at most a minute
    // apart.
    let expiry_check = pipeline.pool.as_ref().map_or(POOL_EXPIRY_CHECK, |p| (p.max_idle() / 2).min(POOL_EXPIRY_CHECK));
    let wake = watchdog.map_or(expiry_check, |w| w.min(expiry_check));
    let mut failure = None;
    loop {
        workers.retain(|w| !w.is_finished());
        if let Some(pool) = pipeline.pool.as_ref().filter(|_| expired_at.elapsed() >= expiry_check) {
            expired_at = std::time::Instant::now();
            let pool = pool.clone();
            let _ = std::thread::Builder::new().name("warm-pool-expiry".into()).spawn(move || pool.expire());
        }
        let mut fds = [
            nix::poll::PollFd::new(listener.as_fd(), nix::poll::PollFlags::POLLIN),
            nix::poll::PollFd::new(signals.as_fd(), nix::poll::PollFlags::POLLIN),
        ];
        let timeout = nix::poll::PollTimeout::try_from(wake).unwrap_or(nix::poll::PollTimeout::MAX);
        match nix::poll::poll(&mut fds, timeout) {
            Ok(0) => {
                if watchdog.is_some() {
                    watchdog_ping();
                }
                continue;
            }
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                // Stop as for a signal — what runs is drained and its sandboxes torn down —
                // and then fail.
                failure = Some(CannotRun(format!("poll: {e}")));
                break;
            }
        }
        if watchdog.is_some() {
            watchdog_ping();
        }
        if fds[1].revents().is_some_and(|r| !r.is_empty()) {
            match signals.read_signal() {
                Ok(Some(info)) if info.ssi_signo == libc::SIGHUP as u32 => {
                    tracing::warn!(
                        sender_pid = info.ssi_pid,
                        "SIGHUP ignored: the agent has no reload; restart it to apply a new configuration"
                    );
                    continue;
                }
                _ => break,
            }
        }
        let Ok((stream, _)) = listener.accept() else { continue };
        if workers.len() >= pipeline.max_concurrent() + CONNECTION_HEADROOM {
            refusals.refuse(stream, workers.len());
            continue;
        }
        // A thread that cannot be made (EAGAIN: the unit's TasksMax, the host's pid limit) is
        // a refusal like a full house, not a panic (which aborts a release build).
        let for_worker = pipeline.clone();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new().spawn(move || {
            if let Ok(stream) = rx.recv() {
                serve_client(stream, &for_worker)
            }
        });
        match spawned {
            Ok(worker) => {
                let _ = tx.send(stream);
                workers.push(worker);
            }
            Err(e) => {
                tracing::warn!(error = %e, "agent socket: no thread for a connection");
                refusals.refuse(stream, workers.len());
            }
        }
    }
    // Stop taking work, let what runs finish and reply.
    sd_notify("STOPPING=1");
    // The platform's poll takes no more commands from now on.
    stop.store(true, Ordering::SeqCst);
    // Refusals still queued are closed unanswered (one record counts them), so that a log
    // lock held by a stuck process delays the stop by at most the refusal being audited
    // and that record — and the record comes before `agent_stop`.
    let refusing = refusals.close();
    drop(listener);
    if bound.is_some() && socket_identity(socket) == bound {
        let _ = std::fs::remove_file(socket);
    }
    // Everything below waits feeding the watchdog: systemd keeps it armed while the unit
    // stops, and a drain may last as long as the longest wall-time ceiling.
    let mut pinged = std::time::Instant::now();
    let mut wait_while = |busy: &dyn Fn() -> bool| {
        while busy() {
            if watchdog.is_some_and(|w| pinged.elapsed() >= w) {
                watchdog_ping();
                pinged = std::time::Instant::now();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_while(&|| !refusing.is_finished());
    let _ = refusing.join();
    crate::audit::record("agent_stop", &[("running", &pipeline.running().to_string())]);
    // The socket's workers and the commands from the platform (on their own threads).
    wait_while(&|| {
        workers.iter().any(|w| !w.is_finished())
            || pipeline.running() > 0
            || platform_commands.load(Ordering::SeqCst) > 0
    });
    for w in workers {
        let _ = w.join();
    }
    // The runs answered before their sandboxes were torn down (in the background): none of
    // their cgroups outlives the agent. Waited for in slices, feeding the watchdog.
    let teardown_from = std::time::Instant::now();
    loop {
        if watchdog.is_some() {
            watchdog_ping();
        }
        let left = TEARDOWN_PATIENCE.saturating_sub(teardown_from.elapsed());
        if sandbox::parent::await_background_teardown(left.min(watchdog.unwrap_or(left))) {
            break;
        }
        if teardown_from.elapsed() >= TEARDOWN_PATIENCE {
            tracing::error!("sandbox teardowns still under way at exit; their cgroups are left to the next agent");
            break;
        }
    }
    failure.map_or(Ok(()), Err)
}

/// How long a stopping agent waits for the sandbox teardowns left to the background.
const TEARDOWN_PATIENCE: Duration = Duration::from_secs(30);

/// Half the systemd watchdog interval, when one is set for this process.
fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Some(pid) = std::env::var("WATCHDOG_PID").ok().and_then(|p| p.parse::<u32>().ok()) {
        if pid != std::process::id() {
            return None;
        }
    }
    Some(Duration::from_micros(usec / 2))
}

/// Whether the peer runs as root; a peer that does not is audited.
fn peer_is_root(stream: &UnixStream) -> bool {
    let root =
        nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials).is_ok_and(|c| c.uid() == 0);
    if !root {
        crate::audit::record("security_event", &[("reason", "non_root_client"), ("detail", "agent socket")]);
    }
    root
}

/// Connections refused waiting for the refusal thread; past them, a connection is closed
/// unanswered (and counted in the next refusal's audit record).
pub const REFUSAL_QUEUE: usize = 16;

/// The thread that answers connections beyond the limit `overloaded`, off the accepting
/// thread: each answer is audited first, and an audit append may wait for the log's lock
/// (`audit.lock_wait_seconds`) — on the accepting thread, a lock held by a stuck process
/// stopped the accept loop and its watchdog pings. The accepting thread only queues the
/// connection, never waiting: with the queue full it closes it unanswered.
///
/// At the stop ([`Refusals::close`]) the connections still queued are closed unanswered,
/// not audited one by one: each audit may wait `audit.lock_wait_seconds` for the lock, and
/// the stop would wait for all of them. One record counts every connection closed
/// unanswered since the last refusal's.
struct Refusals {
    queue: std::sync::mpsc::SyncSender<(UnixStream, usize)>,
    /// Connections closed unanswered since the last refusal was audited.
    dropped: Arc<std::sync::atomic::AtomicU64>,
    /// Set by [`Refusals::close`]: what is still queued is closed unanswered.
    stopping: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Refusals {
    fn start(pipeline: Arc<Pipeline>) -> Result<Refusals, CannotRun> {
        let (queue, refused) = std::sync::mpsc::sync_channel::<(UnixStream, usize)>(REFUSAL_QUEUE);
        let dropped = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (unanswered, stopped) = (dropped.clone(), stopping.clone());
        let thread = std::thread::Builder::new()
            .name("socket-refusals".into())
            .spawn(move || {
                for (stream, open) in refused {
                    if stopped.load(Ordering::SeqCst) {
                        unanswered.fetch_add(1, Ordering::SeqCst);
                        drop(stream);
                    } else {
                        refuse(stream, &pipeline, open, &unanswered);
                    }
                }
                // Closed unanswered after the last refusal answered: on record before
                // `agent_stop`.
                let left = unanswered.swap(0, Ordering::SeqCst);
                if left > 0 {
                    pipeline.overloaded(
                        None,
                        "socket",
                        &format!(
                            "{left} connections closed unanswered (the refusal queue full, or the agent stopping)"
                        ),
                    );
                }
            })
            .map_err(|e| CannotRun(format!("agent socket: a thread for its refusals: {e}")))?;
        Ok(Refusals { queue, dropped, stopping, thread })
    }

    /// Hand a connection with `open` connections open to the refusal thread, or close it
    /// unanswered when its queue is full.
    fn refuse(&self, stream: UnixStream, open: usize) {
        match self.queue.try_send((stream, open)) {
            Ok(()) => {}
            Err(std::sync::mpsc::TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::SeqCst);
                tracing::warn!(target: "opservant::daemon", open, "agent socket: refusals queued full; a connection closed unanswered");
            }
            // Only a panic ends the thread before `close` (release builds abort on one).
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {
                tracing::error!(target: "opservant::daemon", open, "agent socket: the refusal thread is gone; a connection closed unanswered");
            }
        }
    }

    /// No more refusals: the thread finishes the one it is answering, closes those queued
    /// unanswered, records how many connections went unanswered, and ends.
    fn close(self) -> std::thread::JoinHandle<()> {
        self.stopping.store(true, Ordering::SeqCst);
        drop(self.queue);
        self.thread
    }
}

/// A connection beyond the limit (`open` connections open; `unanswered` more closed
/// without an answer since the last refusal): answered `overloaded` at once, without
/// reading its command and without blocking (the reply fits the socket's buffer; a write
/// that would block is dropped).
fn refuse(stream: UnixStream, pipeline: &Pipeline, open: usize, unanswered: &std::sync::atomic::AtomicU64) {
    if !peer_is_root(&stream) {
        return;
    }
    let unanswered = unanswered.swap(0, Ordering::SeqCst);
    let mut why = format!("{open} connections are open");
    if unanswered > 0 {
        why.push_str(&format!(" ({unanswered} more closed unanswered, the refusal queue full)"));
    }
    let reply = pipeline.overloaded(None, "socket", &why);
    let mut line = reply.to_string();
    line.push('\n');
    if stream.set_nonblocking(true).is_ok() {
        let _ = (&stream).write_all(line.as_bytes());
    }
}

/// Read a client's request up to its end of file: at most `limit` bytes, all within
/// `within` (one deadline for the whole request, not per read). `None` when the client failed
/// to send it in time or the connection broke.
pub(crate) fn read_request(stream: &mut UnixStream, limit: u64, within: Duration) -> Option<Vec<u8>> {
    let deadline = std::time::Instant::now() + within;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = deadline.checked_duration_since(std::time::Instant::now()).filter(|d| !d.is_zero())?;
        stream.set_read_timeout(Some(left)).ok()?;
        let room = usize::try_from(limit - buf.len() as u64).unwrap_or(usize::MAX).min(chunk.len());
        if room == 0 {
            return Some(buf);
        }
        match stream.read(&mut chunk[..room]) {
            Ok(0) => return Some(buf),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

fn serve_client(mut stream: UnixStream, pipeline: &Pipeline) {
    if !peer_is_root(&stream) {
        return;
    }
    // Who sent it, for the receipt (the credentials of the client at its connect).
    let source = match nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials) {
        Ok(c) => format!("socket (pid {}, uid {})", c.pid(), c.uid()),
        Err(_) => "socket".to_string(),
    };
    let limit = crate::signing::MAX_COMMAND_BYTES as u64 + 1;
    let Some(buf) = read_request(&mut stream, limit, READ_DEADLINE) else { return };
    if buf.is_empty() {
        // Connected and closed without a byte (a liveness probe): no command, no reply,
        // and no place in the concurrency limit.
        return;
    }
    let handled = pipeline.submit(&buf, &source);
    let mut line = handled.reply.to_string();
    line.push('\n');
    // A client that never reads a reply larger than the socket's buffer must not hold this
    // thread (and with it the agent's shutdown, which waits for its workers) for ever.
    let _ = stream.set_write_timeout(Some(READ_DEADLINE));
    let _ = stream.write_all(line.as_bytes());
    // Delivered (or given up on): the command's record in `running/` goes only now.
    drop(handled.delivery);
}

/// The most `submit` reads of a reply: a result's output is capped at 4 MiB of JSON, its
/// captured streams and artifacts at less.
const MAX_REPLY_BYTES: u64 = 64 * 1024 * 1024;

/// `opservant submit`: send one signed command, return the reply.
pub fn submit(socket: &Path, command: &[u8]) -> Result<Value, CannotRun> {
    let mut stream = UnixStream::connect(socket)
        .map_err(|e| CannotRun(format!("{}: cannot reach the agent: {e}", socket.display())))?;
    // Only an agent gets the signed command, and only its answer is believed: the process
    // listening must be root's or this user's own (an agent runs as root; so does the user
    // who may connect to its 0600 socket).
    let peer = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| CannotRun(format!("{}: the listening process's credentials: {e}", socket.display())))?;
    let me = nix::unistd::geteuid().as_raw();
    if peer.uid() != 0 && peer.uid() != me {
        return Err(CannotRun(format!(
            "{}: the process listening there runs as uid {} (pid {}), not as root: not an agent; nothing was sent",
            socket.display(),
            peer.uid(),
            peer.pid()
        )));
    }
    // An agent past its connection limit answers before reading and closes: the send then
    // fails, and the answer is still there to read.
    let sent = stream.write_all(command).and_then(|()| stream.shutdown(std::net::Shutdown::Write));
    let mut bytes = Vec::new();
    let read = (&mut stream).take(MAX_REPLY_BYTES + 1).read_to_end(&mut bytes);
    if bytes.len() as u64 > MAX_REPLY_BYTES {
        return Err(CannotRun(format!("{}: the reply is over {MAX_REPLY_BYTES} bytes", socket.display())));
    }
    let reply = String::from_utf8(bytes).map_err(|_| CannotRun("the reply is not UTF-8".into()))?;
    if reply.trim().is_empty() {
        if let Err(e) = sent {
            return Err(CannotRun(format!("send: {e}")));
        }
        read.map_err(|e| CannotRun(format!("reply: {e}")))?;
        return Err(CannotRun(format!("{}: the agent closed the connection without a reply", socket.display())));
    }
    serde_json::from_str(reply.trim()).map_err(|e| CannotRun(format!("reply is not JSON: {e}")))
}

/// `agent.state_dir` holds the replay index: whoever can write the directory can delete
/// the index (and have an old signed command run again) or plant a link at its name for
/// root to append to. So a directory that exists must be the agent's own — owned by its
/// user and writable by no one else, like sshd's `StrictModes`; one that does not exist is
/// created 0700 with the index.
fn check_state_dir(dir: &Path) -> Result<(), CannotRun> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(CannotRun(format!("agent.state_dir: {}: {e}", dir.display()))),
    };
    crate::config::check_agents_own_dir(dir, &meta)
        .map_err(|m| CannotRun(format!("agent.state_dir: {m}; the replay index must be the agent's alone")))
}

/// The agent's hold on its state directory ([`prepare_state_dir`]): an exclusive `flock` on
/// `agent.lock` in it, kept for the process's life.
pub struct StateDirLock(#[allow(dead_code)] nix::fcntl::Flock<std::fs::File>);

/// Create `agent.state_dir` when missing (0711, its parents as the umask has them), then
/// check it as [`DaemonSettings::from_config`] does: it must exist now and be the agent's.
/// Searchable by all but listable by the agent alone, as systemd's `StateDirectoryMode=0711`
/// makes it: the default executors root is beneath it, and sandboxes reach the installed
/// executors as an unprivileged user (under 0700 every run failed at its set-up). What the
/// agent keeps in it is its own by its files' modes (the replay store's are 0600). It must be
/// writable (a file written and flushed), and no other agent may hold it: the returned lock
/// is held for the agent's life.
pub fn prepare_state_dir(dir: &Path) -> Result<StateDirLock, CannotRun> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let fail = |e: std::io::Error| CannotRun(format!("agent.state_dir: {}: {e}", dir.display()));
    if let Some(up) = dir.parent() {
        std::fs::create_dir_all(up).map_err(fail)?;
    }
    match std::fs::DirBuilder::new().mode(0o711).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(fail(e)),
        Err(_) => {}
        // Made now: its entry on the disk before the replay store records anything in it
        // (a store whose directory a crash could lose would forget every command id).
        Ok(()) => {
            // Whatever the umask.
            std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o711)).map_err(fail)?;
            let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(fail)?;
        }
    }
    check_state_dir(dir)?;
    std::fs::metadata(dir).map(drop).map_err(fail)?;
    // One agent per state directory, decided before the agent does anything else: two
    // started at once both found the socket stale, and the second replaced the first's (which went on running unreachable,
    // and took the socket with it when stopped); a second start also installed executors,
    // compiled bytecode and started a zygote and sandboxes before it was refused.
    let lock_path = dir.join("agent.lock");
    let file = crate::bounded::open_regular_nofollow(
        &lock_path,
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600),
    )
    .map_err(|e| {
        CannotRun(format!(
            "agent.state_dir: {}: cannot be written ({}: {e}); the replay store keeps every command id there",
            dir.display(),
            lock_path.display()
        ))
    })?;
    let held = match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(held) => held,
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            let by = crate::audit::lock::holders(&lock_path).unwrap_or_else(|| "another process".into());
            return Err(CannotRun(format!(
                "agent.state_dir: {}: another agent runs with this state directory ({} holds {})",
                dir.display(),
                by,
                lock_path.display()
            )));
        }
        Err((_, e)) => return Err(CannotRun(format!("agent.state_dir: {}: flock: {e}", lock_path.display()))),
    };
    // Writable now, not at the first command: a read-only or broken file system here made
    // the agent start, then refuse every command ("replay store: … Read-only file system")
    // with nothing at start to say why.
    let probe = dir.join(".write-check");
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        // A FIFO planted at the name must not hang the start (root-only directory).
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&probe)
        .and_then(|mut f| {
            std::io::Write::write_all(&mut f, b"ok\n")?;
            f.sync_data()
        });
    let _ = std::fs::remove_file(&probe);
    written.map_err(|e| {
        CannotRun(format!(
            "agent.state_dir: {}: cannot be written ({e}); the replay store keeps every command id there",
            dir.display()
        ))
    })?;
    Ok(StateDirLock(held))
}

/// Paths and limits of the daemon from the configuration.
pub struct DaemonSettings {
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub max_concurrent: usize,
    pub platform_key: PathBuf,
    /// `agent.launch`; the daemon defaults to the zygote.
    pub launch: crate::launch::LaunchMode,
    /// `agent.warm_pool` (0: off).
    pub warm_pool: usize,
    /// `agent.warm_pool_idle_seconds`.
    pub warm_pool_idle: Duration,
}

impl DaemonSettings {
    pub fn from_config(c: &crate::config::Config) -> Result<DaemonSettings, CannotRun> {
        let a = &c.agent;
        let platform_key = a.platform_public_key.clone().ok_or_else(|| {
            CannotRun("agent.platform_public_key: required (the Ed25519 key commands are verified with)".into())
        })?;
        crate::config::check_trust_file("agent.platform_public_key", &platform_key).map_err(CannotRun)?;
        let socket: PathBuf = a.socket.clone().unwrap_or_else(|| DEFAULT_SOCKET.into());
        check_socket_path(&socket)?;
        let state_dir: PathBuf = a.state_dir.clone().unwrap_or_else(|| DEFAULT_STATE_DIR.into());
        check_state_dir(&state_dir)?;
        Ok(DaemonSettings {
            socket,
            state_dir,
            max_concurrent: a.max_concurrent.unwrap_or(DEFAULT_MAX_CONCURRENT),
            platform_key,
            launch: a.launch.unwrap_or(crate::launch::LaunchMode::Zygote),
            warm_pool: a.warm_pool.unwrap_or(0),
            warm_pool_idle: a.warm_pool_idle_seconds.map_or(crate::warm_pool::DEFAULT_MAX_IDLE, Duration::from_secs),
        })
    }
}
