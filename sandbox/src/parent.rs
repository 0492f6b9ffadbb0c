//! The parent side: start a sandbox, complete the namespace handshake, supervise it to the end.
//!
//! Safe to call from a multi-threaded program: the sandbox starts with `posix_spawn` (no
//! `fork` of the caller), as a fresh exec of the init program, configured over a socketpair.
//! Blocking; an async caller runs it on a blocking thread.
//!
//! Guarantees: a started sandbox is always fully torn down — on success, on error and when a
//! [`Sandbox`] is dropped — with its cgroups removed (by a background thread once its
//! outcome is complete, for a caller that asks for it: [`Sandbox::teardown_in_background`],
//! [`await_background_teardown`]); the timeout sends SIGTERM to every
//! process in the sandbox, then SIGKILL after the grace period; output is captured up to the
//! caller's caps while the rest is drained and counted, so a runaway writer cannot block the
//! sandbox or grow the parent.

use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::cgroup::SandboxCgroup;
use crate::channel::{Channel, FromSandbox, ToSandbox, APP_FD, CHILD_FD, GO};
use crate::error::{SandboxError, Stage, StepError};
use crate::init::PayloadEnd;
use crate::report::{Captured, EndedFromOutside, EnforcementReport, ExitInfo, KilledBy, Outcome, ResourceUsage};
use crate::spec::SandboxSpec;
use crate::{landlock, namespaces};

/// How to start the sandbox's monitor process.
#[derive(Debug, Clone)]
pub enum Launcher {
    /// `posix_spawn` a program (normally this binary) whose arguments make it call
    /// [`crate::init::main`] first thing. Safe from multi-threaded callers.
    Exec { program: CString, args: Vec<CString> },
    /// `fork` the caller and run the monitor in the child. Only for single-threaded callers
    /// (a CLI, a zygote): it saves one `execve` of this binary per sandbox.
    Fork,
    /// Ask a [`crate::zygote::Zygote`] to fork the monitor; the payload `execve`s the spec's
    /// program or, with [`PayloadEnd::Return`], continues in the zygote's own code.
    Zygote { zygote: std::sync::Arc<crate::zygote::Zygote>, end: PayloadEnd },
}

impl Launcher {
    pub fn new(program: impl AsRef<OsStr>, args: &[&OsStr]) -> Result<Self, SandboxError> {
        let c = |s: &OsStr| {
            CString::new(s.as_bytes()).map_err(|_| SandboxError::Spawn {
                program: s.to_string_lossy().into_owned(),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            })
        };
        let program = c(program.as_ref())?;
        let mut argv = vec![program.clone()];
        for a in args {
            argv.push(c(a)?);
        }
        Ok(Self::Exec { program, args: argv })
    }

    /// Re-execute the running binary (`/proc/self/exe`, immune to the file being replaced)
    /// with a hidden sub-command.
    pub fn reexec(subcommand: &str) -> Self {
        let program = c"/proc/self/exe".to_owned();
        // A sub-command name with NUL is a programming error; fall back to no argument,
        // which makes the init fail loudly rather than run something else.
        let sub = CString::new(subcommand).unwrap_or_default();
        Self::Exec { args: vec![program.clone(), sub], program }
    }

    /// [`Launcher::Fork`] when the calling process has exactly one thread right now,
    /// otherwise [`Launcher::reexec`]. (The check cannot race with thread creation by the
    /// caller itself; callers that start threads concurrently must use `reexec`.)
    pub fn fork_or_reexec(subcommand: &str) -> Self {
        let threads = std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0);
        if threads == 1 {
            Self::Fork
        } else {
            Self::reexec(subcommand)
        }
    }

    fn describe(&self) -> String {
        match self {
            Launcher::Exec { program, .. } => program.to_string_lossy().into_owned(),
            Launcher::Fork => "fork".into(),
            Launcher::Zygote { .. } => "zygote".into(),
        }
    }
}

/// Called once the namespaces exist and the id maps are written, with the monitor's
/// `/proc/PID` (its `ns/*` are the sandbox's namespaces). An error aborts the sandbox.
pub type NamespaceHook<'a> = &'a mut dyn FnMut(&MonitorProc<'_>) -> Result<(), String>;

/// The sandbox monitor's `/proc/PID`, opened so that it names the monitor (see
/// [`Sandbox::spawn`]'s handshake): what a [`NamespaceHook`] opens through it is the
/// sandbox's, never a process's that took over the pid.
pub struct MonitorProc<'a> {
    pid: i32,
    dir: std::os::fd::BorrowedFd<'a>,
    /// The namespaces the monitor handed over ([`crate::channel::UNSHARED_NAMESPACES`], in
    /// that order), or none: then they are opened through `dir`.
    handed_over: &'a [OwnedFd],
}

impl MonitorProc<'_> {
    /// The monitor's host pid (for messages; open its files with [`MonitorProc::namespace`]).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The sandbox's namespace `name` (`user`, `net`, `mnt`), handed over by the monitor or
    /// opened through its `/proc/PID/ns`.
    pub fn namespace(&self, name: &str) -> std::io::Result<OwnedFd> {
        if !self.handed_over.is_empty() {
            let i = crate::channel::UNSHARED_NAMESPACES.iter().position(|n| *n == name);
            return match i.and_then(|i| self.handed_over.get(i)) {
                Some(fd) => fd.try_clone(),
                None => Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("namespace {name} is not among those the monitor hands over"),
                )),
            };
        }
        nix::fcntl::openat(
            self.dir,
            format!("ns/{name}").as_str(),
            nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(std::io::Error::from)
    }
}

/// The namespaces a monitor handed over ([`crate::channel::UNSHARED_NAMESPACES`], in that
/// order) are what they claim to be: each of its kind (`NS_GET_NSTYPE`), the user namespace
/// owned by the leased uid `owner` (else the kernel would charge its use to someone else),
/// and the mount and network namespaces the sandbox was to have of its own none of this
/// process's — the hooks wire, bind and mount into them.
fn check_handed_over(
    handed_over: &[OwnedFd],
    owner: u32,
    namespaces: &crate::spec::Namespaces,
) -> Result<(), SandboxError> {
    use nix::sched::CloneFlags;
    let bad = |what: String| SandboxError::Channel(format!("the monitor's handed-over namespaces: {what}"));
    for (name, fd) in crate::channel::UNSHARED_NAMESPACES.iter().zip(handed_over) {
        let (kind, own) = match *name {
            "user" => (CloneFlags::CLONE_NEWUSER, namespaces.user),
            "mnt" => (CloneFlags::CLONE_NEWNS, namespaces.mount),
            "net" => (CloneFlags::CLONE_NEWNET, namespaces.net),
            other => return Err(bad(format!("no check for namespace {other}"))),
        };
        match namespaces::namespace_type(fd.as_fd()) {
            Ok(got) if got == kind => {}
            Ok(got) => return Err(bad(format!("{name} is a namespace of kind {:#x}", got.bits()))),
            Err(e) => return Err(bad(format!("{name} is not a namespace ({e})"))),
        }
        if kind == CloneFlags::CLONE_NEWUSER {
            match namespaces::owner_uid(fd) {
                Ok(got) if got == owner => {}
                Ok(got) => {
                    return Err(bad(format!("the user namespace is owned by uid {got}, not the leased {owner}")))
                }
                Err(e) => return Err(bad(format!("the user namespace's owner: {e}"))),
            }
        } else if own {
            let theirs = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| bad(format!("fstat {name}: {}", e.desc())))?;
            let ours = nix::sys::stat::stat(format!("/proc/self/ns/{name}").as_str())
                .map_err(|e| bad(format!("stat /proc/self/ns/{name}: {}", e.desc())))?;
            if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino) {
                return Err(bad(format!("{name} is the agent's own namespace, not the sandbox's")));
            }
        }
    }
    Ok(())
}

/// Whether `pidfd` is a pidfd of the process `pid` (its `/proc/self/fdinfo` says so; any
/// other kind of descriptor has no `Pid:` there): `Ok(Some(true))`, or `Ok(Some(false))`
/// for a pidfd whose process has been reaped (`Pid: -1`: signals through it reach no one);
/// `Ok(None)` for anything else, `Err` when the fdinfo cannot be read (why).
fn pidfd_names(pidfd: &OwnedFd, pid: i32) -> Result<Option<bool>, String> {
    let path = format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd());
    let info = std::fs::read_to_string(&path).map_err(|e| format!("read {path}: {e}"))?;
    Ok(match info.lines().find_map(|l| l.strip_prefix("Pid:")?.trim().parse::<i32>().ok()) {
        Some(-1) => Some(false),
        Some(n) if n == pid => Some(true),
        _ => None,
    })
}

/// Which stream a chunk of output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// The longest a deferred CPU quota waits after the payload started.
pub const CPU_DEFER_MAX: Duration = Duration::from_secs(1);

/// Applies a sandbox's CPU quota once, from any thread. Without `limits.cpu_deferred` it is
/// written when the cgroup is created, before any process joins it. With it, the caller
/// applies it when the payload's trusted start-up is over (e.g. an interpreter's
/// initialisation) and holds the payload until then; the sandbox applies it itself at the
/// latest [`CPU_DEFER_MAX`] after the payload started. A failed write stops the run (fail
/// closed).
#[derive(Debug, Default)]
pub struct CpuLimiter {
    writes: Vec<(std::path::PathBuf, String)>,
    state: std::sync::Mutex<CpuState>,
    /// Wakes the supervising [`Sandbox::wait`] at once when a write fails, so the run stops
    /// now rather than at the loop's next wake-up.
    stop: Option<StopHandle>,
}

#[derive(Debug, Default)]
struct CpuState {
    applied: bool,
    error: Option<String>,
}

impl CpuLimiter {
    /// Write the quota (once; later calls return the first outcome).
    pub fn apply(&self) -> Result<(), String> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.applied {
            return st.error.clone().map_or(Ok(()), Err);
        }
        st.applied = true;
        for (path, value) in &self.writes {
            if let Err(e) = SandboxCgroup::write_control(path, value) {
                st.error = Some(e.to_string());
                if let Some(stop) = &self.stop {
                    stop.stop();
                }
                return Err(e.to_string());
            }
        }
        Ok(())
    }

    /// Whether the quota is in place (written without error, with a CPU controller).
    pub fn enforced(&self) -> bool {
        self.outcome().0
    }

    fn outcome(&self) -> (bool, Option<String>) {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        (st.applied && st.error.is_none() && !self.writes.is_empty(), st.error.clone())
    }
}

/// Stops a running sandbox from any thread: everything in it is killed and [`Sandbox::wait`]
/// returns with [`Outcome::stopped`] set. Stopping twice, or after the end, does nothing.
#[derive(Debug, Clone)]
pub struct StopHandle {
    wake: std::sync::Arc<OwnedFd>,
}

/// What a [`StopHandle`] asks of [`Sandbox::wait`], one byte each on its wake-up socket.
const WAKE_STOP: u8 = 1;
const WAKE_INTERRUPT: u8 = 2;

impl StopHandle {
    pub fn stop(&self) {
        self.wake(WAKE_STOP);
    }

    /// SIGINT to every process of the sandbox (its init forwards it, as a terminal's Ctrl-C
    /// reaches a whole process group); the sandbox goes on. Does nothing before its payload
    /// has started, after its init is gone, or once the sandbox is stopped.
    pub fn interrupt(&self) {
        self.wake(WAKE_INTERRUPT);
    }

    fn wake(&self, what: u8) {
        use nix::sys::socket::{send, MsgFlags};
        // A full buffer only delays what it holds (a stop is then still read: the buffer
        // is drained whole); a closed peer means the wait is over (MSG_NOSIGNAL: no SIGPIPE
        // for a caller that did not ignore it).
        let _ = send(self.wake.as_raw_fd(), &[what], MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT);
    }
}

/// The process-wide stop ([`stop_all`]): a pipe whose read end every [`Sandbox::wait`] of
/// this process watches once [`enable_stop_all`] made it; never read, so once written it
/// stays readable. (read end, write end)
static STOP_ALL: std::sync::OnceLock<(OwnedFd, OwnedFd)> = std::sync::OnceLock::new();

/// Make [`stop_all`] usable (a command-line caller, before it installs the signal handler
/// that calls it). Idempotent.
pub fn enable_stop_all() -> Result<(), SandboxError> {
    if STOP_ALL.get().is_none() {
        let ends = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
            .map_err(|e| SandboxError::io("pipe", e.into()))?;
        let _ = STOP_ALL.set(ends);
    }
    Ok(())
}

/// Stop every sandbox of this process, running or yet to start, as [`StopHandle::stop`]
/// does: each [`Sandbox::wait`] returns with [`Outcome::stopped`] and its caller reports
/// and cleans up. Async-signal-safe (an atomic load and a `write`): a command-line caller
/// calls it from its handler of a terminal signal. Does nothing before [`enable_stop_all`].
pub fn stop_all() {
    if let Some((_, tx)) = STOP_ALL.get() {
        // SAFETY: a one-byte buffer we own, written to a pipe that lives for the process
        // (non-blocking: a full pipe is already readable).
        let _ = unsafe { libc::write(tx.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }
}

/// The longest sandbox setup may take, from spawn to the payload's `started` report (it takes
/// milliseconds; seconds on an overloaded or emulated machine). A setup step stuck in the
/// kernel fails the run, naming what it waited for, instead of hanging its caller.
/// (The default of [`crate::spec::Limits::setup_timeout_ms`].)
pub const SETUP_LIMIT: Duration = Duration::from_secs(30);

/// How long after SIGKILL of the sandbox init the monitor may take to exit on its own
/// before it and everything in the cgroup are killed too.
const BACKSTOP: Duration = Duration::from_secs(1);

/// How long init may take, once the payload has ended, to kill and reap the rest of the
/// sandbox before the backstop kills everything (and [`ABANDON`] runs from there): killed
/// processes release even a large tree's memory in well under a second; longer means one is
/// stuck in the kernel, which must not hold the run until its time limit.
const REAP_PATIENCE: Duration = Duration::from_secs(5);

/// How long after a v1 OOM notification the sandbox's own OOM kill counter is read: the
/// kernel notifies before it picks and kills its victim (see [`Sandbox::wait`]).
const OOM_SETTLE: Duration = Duration::from_millis(20);

/// How long after a v1 OOM notification the counter is read again (every [`OOM_SETTLE`])
/// while it has not grown.
const OOM_CHECK_FOR: Duration = Duration::from_secs(2);

/// How long after that last SIGKILL [`Sandbox::wait`] still waits, with no output arriving
/// meanwhile, for the sandbox's processes to go (its channel and output pipes to close).
/// One that has not exited by then is stuck in the kernel (uninterruptible I/O, a frozen
/// cgroup): the run fails instead of waiting for it forever, and its cgroups are left
/// behind at once and retried later (see [`crate::cgroup`]). Output still being read (a
/// caller's slow consumer) counts as progress: killed processes write nothing new, so
/// what is buffered runs out.
const ABANDON: Duration = Duration::from_secs(5);

/// How long [`Sandbox::wait`] waits for the monitor's exit once the sandbox is over (it is
/// on its way out: milliseconds). A monitor that has not exited by then — stuck in the
/// kernel — is killed and left behind instead of hanging the caller; an abandoned sandbox's
/// monitor (killed [`ABANDON`] earlier) gets no more time at all. A left-behind monitor that
/// is this process's child is reaped whenever this process spawns another sandbox (see
/// [`reap_left_behind`]); a zygote's is its zygote's to reap.
const MONITOR_EXIT: Duration = Duration::from_secs(5);

/// Monitors (children of this process) that had not exited when their sandbox was over.
static UNREAPED: std::sync::Mutex<Vec<Pid>> = std::sync::Mutex::new(Vec::new());

/// Reap, without waiting, the monitors left behind that have exited since. Their pids stay
/// theirs until reaped (a child's pid is never reused before), so none names another process.
fn reap_left_behind() {
    // A poisoned list is still a list of pids: nothing half-updated matters here.
    let mut left = UNREAPED.lock().unwrap_or_else(|e| e.into_inner());
    left.retain(|pid| match waitpid(*pid, Some(WaitPidFlag::WNOHANG)) {
        Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => true,
        Ok(_) => {
            tracing::info!(monitor = pid.as_raw(), "sandbox monitor left behind earlier reaped");
            false
        }
        // Not our child any more (reaped elsewhere): nothing left to do.
        Err(_) => false,
    });
}

/// Receives output chunks as they arrive.
pub type Tee<'a> = &'a mut dyn FnMut(Stream, &[u8]);

/// Output handling while the sandbox runs.
pub struct OutputOptions<'a> {
    pub stdout_cap: usize,
    pub stderr_cap: usize,
    /// Receives every chunk as it arrives (e.g. to stream it to a terminal).
    pub tee: Option<Tee<'a>>,
}

impl Default for OutputOptions<'_> {
    fn default() -> Self {
        Self { stdout_cap: 1 << 20, stderr_cap: 1 << 20, tee: None }
    }
}

/// A running sandbox.
pub struct Sandbox {
    monitor: Pid,
    /// A pidfd for the monitor when it is not our child (a zygote forked it).
    monitor_pidfd: Option<OwnedFd>,
    /// How the monitor was started (reported in the [`Outcome`]).
    launch: &'static str,
    /// Started some other way because its zygote could not ([`Sandbox::mark_zygote_fallback`]).
    zygote_fallback: bool,
    /// A pidfd for the sandbox init (the monitor's child, reaped by the monitor): signals go
    /// through it, so one sent after init is gone never reaches a process that reused its pid.
    init: Option<OwnedFd>,
    chan: Channel,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    cgroup: Option<SandboxCgroup>,
    started: Instant,
    timeout: Option<Duration>,
    /// The setup limit ([`SETUP_LIMIT`] unless the spec sets one), counted from
    /// `setup_from`: once the monitor exists, so that waiting for a zygote (its lock, its
    /// start) does not use up the sandbox's own setup time.
    setup_limit: Duration,
    setup_from: Instant,
    grace: Duration,
    reaped: bool,
    /// How the monitor ended, when this process reaped it (it is our child).
    monitor_exit: Option<ExitInfo>,
    /// Where [`Sandbox::wait`] sends the payload's enforcement report as it arrives
    /// ([`Sandbox::started_report`]).
    started_tx: Option<std::sync::mpsc::SyncSender<EnforcementReport>>,
    /// The parent's end of the application channel, if the spec asks for one, or of the
    /// hold channel of a held sandbox until [`Sandbox::start_pooled`] releases it.
    app: Option<Channel>,
    /// Whether the spec asks for an application channel (`app` may be only a hold channel).
    app_requested: bool,
    /// Started held and not yet released.
    held: bool,
    cpu: std::sync::Arc<CpuLimiter>,
    cpu_deferred: bool,
    /// Receiving end of the stop socket pair, and the handle that writes to it.
    stop_rx: OwnedFd,
    stop: StopHandle,
    /// The sandbox's mount namespace, held from the handshake on by a zygote-launched
    /// sandbox so that its destruction is not the monitor's (see [`release_later`]).
    mount_ns: Option<OwnedFd>,
    /// [`Sandbox::teardown_in_background`] was asked for.
    teardown_in_background: bool,
    /// A zygote started the sandbox directly ([`crate::init::run_direct`]): the "monitor"
    /// (pid, pidfd) is the sandbox's init, and there is no monitor process.
    direct: bool,
    /// The host uid leased for this sandbox (`spec.host_uids`), held until the sandbox is
    /// dropped — after every process of it is gone — unless its monitor was left behind.
    host_uid: Option<std::sync::Arc<crate::host_uid::Lease>>,
    /// Declared paths bound without the idmapping ([`crate::idmap::Prepared::not_idmapped`]).
    not_idmapped: Vec<String>,
}

impl Sandbox {
    /// Create the cgroup, start the init, and complete the handshake. On return the payload
    /// is being set up; call [`Sandbox::wait`].
    pub fn spawn(
        spec: &SandboxSpec,
        launcher: &Launcher,
        hook: Option<NamespaceHook>,
    ) -> Result<Sandbox, SandboxError> {
        spec.validate()?;
        let abi = landlock::kernel_abi();
        if abi < spec.landlock.min_abi {
            return Err(SandboxError::LandlockTooOld { found: abi, required: spec.landlock.min_abi });
        }
        let started = Instant::now();
        // Discover the cgroup layout before this process has sandbox children: on a
        // delegated v2 host it moves itself into its leaf cgroup on first use.
        crate::cgroup::prepare();
        reap_left_behind();

        let (chan, chan_child) = Channel::pair().map_err(|e| SandboxError::io("socketpair", e.into()))?;
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let null = nix::fcntl::open(
            "/dev/null",
            nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| SandboxError::io("open /dev/null", e.into()))?;
        // Move the child's ends above the stdio range so dup2 onto 0..=3 cannot clobber one
        // with another.
        let high = |fd: &dyn AsFd| -> Result<OwnedFd, SandboxError> {
            nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10))
                .map_err(|e| SandboxError::io("dup", e.into()))
                // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor we now own.
                .map(|raw| unsafe { OwnedFd::from_raw_fd(raw) })
        };
        let mut fds = vec![(high(&null)?, 0), (high(&out_w)?, 1), (high(&err_w)?, 2), (high(&chan_child)?, CHILD_FD)];
        drop((null, out_w, err_w, chan_child));
        let app = if spec.command.uses_app_fd() {
            let (app, app_child) = Channel::pair().map_err(|e| SandboxError::io("socketpair", e.into()))?;
            fds.push((high(&app_child)?, APP_FD));
            Some(app)
        } else {
            None
        };

        let (stop_rx, stop_tx) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC | nix::sys::socket::SockFlag::SOCK_NONBLOCK,
        )
        .map_err(|e| SandboxError::io("socketpair", e.into()))?;
        // Leased before anything of the sandbox exists: its user namespace is the leased
        // uid's, created by the monitor (sent the uid in the handshake) or by a zygote
        // starting the sandbox directly (sent it with the request). The marker names the
        // cgroups, planned here and created in the handshake (one not created yet holds no
        // process: nothing runs as the uid before the id maps, in the handshake too).
        let plan = SandboxCgroup::plan();
        let host_uid = match &spec.host_uids {
            Some(range) => Some(std::sync::Arc::new(crate::host_uid::lease(range, &plan.dirs())?)),
            None => None,
        };
        let owner = host_uid.as_ref().map(|l| l.uid());
        let (monitor, monitor_pidfd, zygote_pid, direct) = spawn_monitor(launcher, &fds, spec, owner)?;
        drop(fds);
        let stop = StopHandle { wake: std::sync::Arc::new(stop_tx) };
        let mut sb = Sandbox {
            monitor,
            monitor_pidfd,
            launch: match launcher {
                Launcher::Exec { .. } => "exec",
                Launcher::Fork => "fork",
                Launcher::Zygote { .. } => "zygote",
            },
            init: None,
            chan,
            stdout: Some(out_r),
            stderr: Some(err_r),
            cgroup: None,
            started,
            timeout: spec.limits.timeout_ms.map(Duration::from_millis),
            setup_limit: spec.limits.setup_timeout_ms.map_or(SETUP_LIMIT, Duration::from_millis),
            setup_from: Instant::now(),
            grace: Duration::from_millis(spec.limits.kill_grace_ms),
            reaped: false,
            monitor_exit: None,
            started_tx: None,
            app,
            app_requested: spec.command.app_channel,
            held: spec.command.held,
            cpu: Default::default(),
            cpu_deferred: spec.limits.cpu_deferred,
            stop_rx,
            stop,
            mount_ns: None,
            zygote_fallback: false,
            teardown_in_background: false,
            direct,
            host_uid,
            not_idmapped: Vec::new(),
        };
        match sb.handshake(spec, !matches!(launcher, Launcher::Fork), hook, plan) {
            Ok(()) => Ok(sb),
            Err(e) => {
                if let (SandboxError::Zygote(_), Launcher::Zygote { zygote, .. }, Some(pid)) =
                    (&e, launcher, zygote_pid)
                {
                    // Its child could not even start: the zygote is replaced — that zygote,
                    // not one another thread has started since.
                    zygote.discard(pid);
                }
                Err(e)
            }
        }
    }

    /// [`Sandbox::wait`] returns as soon as the outcome is complete — the payload ended, every
    /// other process of the sandbox killed and reaped by its init, the output read to its end,
    /// the tree's resource usage reported — and leaves what is left, init's and the monitor's
    /// exits and the removal of the cgroups, to a background thread of this process (see
    /// [`await_background_teardown`]): a long-lived caller (the agent) answers its run that
    /// much sooner. A sandbox that failed, or was abandoned, is torn down before `wait`
    /// returns, as without this; so is one when too many teardowns are already waiting.
    /// A cgroup the background teardown cannot remove is logged and tried again later, as
    /// one left behind. Not for a caller about to exit (a command-line run).
    pub fn teardown_in_background(&mut self) {
        self.teardown_in_background = true;
    }

    /// The caller started this sandbox with another launcher because its zygote could not:
    /// a pooled one then does not report `pool` ([`Sandbox::start_pooled`]).
    pub fn mark_zygote_fallback(&mut self) {
        self.zygote_fallback = true;
    }

    /// A sandbox started ahead of its work (a warm pool) is put to work now: its clock — the
    /// timeout and the reported wall time — starts here, and the outcome reports `pool`
    /// (one the caller started cold because its zygote could not —
    /// [`Sandbox::mark_zygote_fallback`] — keeps its launcher's name: it is not what a pool
    /// of that caller promises).
    /// Only sound while nothing of the payload's work has been handed to it yet. A held
    /// sandbox ([`crate::spec::CommandSpec::held`]) is released: its payload gets the go.
    /// A sandbox whose payload (or monitor) has ended while it waited — killed by the OOM
    /// killer, where pooled payloads are the first victims — is refused here, so the caller
    /// starts a sandbox of its own instead of handing its run to a dead one.
    pub fn start_pooled(&mut self) -> Result<(), SandboxError> {
        for (what, chan) in [("payload", self.app.as_ref()), ("monitor", Some(&self.chan))] {
            if chan.is_some_and(hung_up) {
                return Err(SandboxError::Channel(format!("the pooled sandbox's {what} has ended")));
            }
        }
        if self.held {
            let hold = self.app.as_ref().ok_or_else(|| SandboxError::Channel("held, but no hold channel".into()))?;
            hold.send_bytes(GO).map_err(|e| SandboxError::Channel(format!("send the go: {}", e.desc())))?;
            self.held = false;
            if !self.app_requested {
                self.app = None;
            }
        }
        self.started = Instant::now();
        if !self.zygote_fallback {
            self.launch = "pool";
        }
        Ok(())
    }

    fn handshake(
        &mut self,
        spec: &SandboxSpec,
        send_spec: bool,
        hook: Option<NamespaceHook>,
        plan: crate::cgroup::CgroupPlan,
    ) -> Result<(), SandboxError> {
        // Until the monitor has unshared, nothing of the sandbox exists: a zygote's child
        // that ends before then (a failed dup in a zygote out of descriptors, say) is the
        // zygote's failure — the caller may start the sandbox cold, and the zygote is replaced.
        let zygote = self.monitor_pidfd.is_some();
        let early = |m: String| {
            if zygote {
                SandboxError::Zygote(format!("its sandbox process: {m}"))
            } else {
                SandboxError::Channel(m)
            }
        };
        if send_spec {
            self.chan
                .send(&ToSandbox::Spec(Box::new(spec.clone())))
                .map_err(|e| early(format!("send spec: {}", e.desc())))?;
        }
        // The monitor creates the user namespace, owned by the leased uid (a zygote's
        // direct start made it already, see `spawn_monitor`).
        if let (Some(lease), false) = (&self.host_uid, self.direct) {
            self.chan
                .send(&ToSandbox::Owner { uid: lease.uid() })
                .map_err(|e| early(format!("send the owner: {}", e.desc())))?;
        }
        // The cgroups are created while the monitor creates the namespaces (the two are the
        // slowest setup steps and run on different CPUs).
        let cgroup = SandboxCgroup::create_planned(plan, &spec.limits)?;
        let writes = cgroup.cpu_writes();
        let join = cgroup.join_files();
        // Kept before the quota is written: a failure below removes it with `self`.
        self.cgroup = Some(cgroup);
        let applied = !self.cpu_deferred;
        if applied {
            // In force before anything joins the cgroup: no process of the sandbox ever runs
            // unthrottled (its own setup, a few ms of CPU, counts against the quota too).
            for (path, value) in &writes {
                SandboxCgroup::write_control(path, value)?;
            }
        }
        self.cpu = std::sync::Arc::new(CpuLimiter {
            writes,
            state: std::sync::Mutex::new(CpuState { applied, error: None }),
            stop: Some(self.stop.clone()),
        });
        let mut join_fds: Vec<OwnedFd> = Vec::new();
        let join = if self.direct && self.host_uid.is_some() {
            // Init started directly in a namespace the leased uid owns runs as that uid on
            // the host from its start: the cgroup files are closed to it.
            if crate::cgroup::open_time_credentials() {
                // It writes "0" through descriptors opened here (the kernel checks the
                // opener's credentials): a process moving itself through a v1 `tasks`
                // file skips the global threadgroup lock, whose RCU grace period a write
                // of its pid from here takes — 1–3 ms per hierarchy, on the start path.
                for file in &join {
                    let fd = nix::fcntl::open(
                        file.as_path(),
                        nix::fcntl::OFlag::O_WRONLY | nix::fcntl::OFlag::O_CLOEXEC,
                        nix::sys::stat::Mode::empty(),
                    )
                    .map_err(|e| SandboxError::io(format!("open {}", file.display()), e.into()))?;
                    join_fds.push(fd);
                }
            } else {
                // Older kernels check the writer's: init is placed in them here (before it
                // unshares its cgroup namespace, after "cgroups"). By pid: init holding it
                // after the writes held it during them (pids are not reused while their
                // process, or its zombie, exists) — and one that ended first could only have
                // lost it to another process after the kernel's cyclic allocation went round
                // every pid (`kernel.pid_max`) in between.
                let pid = self.monitor.as_raw().to_string();
                for file in &join {
                    SandboxCgroup::write_control(file, &pid)?;
                }
                self.check_monitor_pid("placing init in its cgroups")?;
            }
            Vec::new()
        } else {
            join
        };
        let raw: Vec<RawFd> = join_fds.iter().map(AsRawFd::as_raw_fd).collect();
        self.chan
            .send_with_fds(&ToSandbox::Cgroups { join }, &raw)
            .map_err(|e| early(format!("send cgroups: {}", e.desc())))?;
        drop(join_fds);
        self.await_setup("the namespaces")?;
        let handed_over = match self.chan.recv_with_fds::<FromSandbox>().map_err(early)? {
            Some((FromSandbox::Unshared, fds)) => fds,
            Some((FromSandbox::Failed(e), _)) => return Err(e.into()),
            None => return Err(early("sandbox init exited during setup".into())),
            Some((other, _)) => return Err(SandboxError::Channel(format!("unexpected {other:?}"))),
        };
        // A monitor in a namespace a leased uid owns hands its namespaces over; the others
        // are opened through its /proc/PID/ns.
        let expected = if self.host_uid.is_some() { crate::channel::UNSHARED_NAMESPACES.len() } else { 0 };
        if handed_over.len() != expected {
            return Err(SandboxError::Channel(format!(
                "the monitor handed over {} namespaces, not {expected}",
                handed_over.len()
            )));
        }
        if let Some(lease) = &self.host_uid {
            check_handed_over(&handed_over, lease.uid(), &spec.namespaces)?;
        }
        let proc_dir = self.monitor_proc_dir()?;
        let monitor = MonitorProc { pid: self.monitor.as_raw(), dir: proc_dir.as_fd(), handed_over: &handed_over };
        let identity = match &self.host_uid {
            Some(lease) => {
                // The sandbox's processes are in its cgroups: one left behind (processes
                // stuck in the kernel) keeps the uid from the next sandbox.
                if let Some(cg) = &mut self.cgroup {
                    cg.hold_until_removed(lease.clone());
                }
                crate::spec::Identity { host_uid: lease.uid(), ..spec.identity }
            }
            None => spec.identity,
        };
        namespaces::write_id_maps(&proc_dir, self.monitor.as_raw(), &identity)?;
        if self.host_uid.is_some() && crate::idmap::needed(spec) {
            // The namespace now maps the identity's uid to the leased one: the idmapping of
            // the declared paths' binds.
            let userns =
                monitor.namespace("user").map_err(|e| SandboxError::io("open the sandbox's user namespace", e))?;
            self.check_monitor_pid("opening its user namespace")?;
            let prepared = crate::idmap::prepare(spec, userns.as_fd())?;
            self.not_idmapped = prepared.not_idmapped;
            let mut binds = prepared.binds;
            while !binds.is_empty() {
                let rest = binds.split_off(binds.len().min(crate::channel::MAX_FDS));
                let paths: Vec<usize> = binds.iter().map(|(i, _)| *i).collect();
                let fds: Vec<std::os::fd::RawFd> = binds.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
                self.chan
                    .send_with_fds(&ToSandbox::Binds { paths }, &fds)
                    .map_err(|e| SandboxError::Channel(format!("send the prepared binds: {}", e.desc())))?;
                binds = rest;
            }
        }
        // Only for a zygote's sandboxes: their caller is a long-lived, multi-threaded program
        // (the agent, the bench) that gains from the background release. A cold caller is a
        // one-shot process whose exit would pay for the namespace instead of its monitor, or
        // a forking one that must stay single-threaded (`Launcher::Fork`).
        if self.monitor_pidfd.is_some() && spec.namespaces.mount {
            // The monitor has unshared and waits for "proceed": this names its namespace.
            self.mount_ns = monitor
                .namespace("mnt")
                .inspect_err(|e| tracing::debug!(error = %e, "cannot hold the sandbox's mount namespace"))
                .ok();
        }
        if let Some(hook) = hook {
            hook(&monitor).map_err(SandboxError::Hook)?;
            // Whatever the hook did meanwhile, a monitor gone by now ends the sandbox here.
            self.check_monitor_pid("the namespace hook")?;
        }
        self.chan
            .send(&ToSandbox::Proceed)
            .map_err(|e| SandboxError::Channel(format!("send proceed: {}", e.desc())))?;
        if self.direct {
            // No monitor reports init's pid: the process the zygote started is init.
            self.init = self.monitor_pidfd.as_ref().and_then(|p| p.try_clone().ok());
        }
        Ok(())
    }

    /// The monitor's `/proc/PID`, opened so that it names the monitor. A monitor that is our
    /// child cannot lose its pid before we reap it; one a zygote forked (reaped by the
    /// zygote) must still hold it, by its pidfd, once the directory is open.
    fn monitor_proc_dir(&self) -> Result<OwnedFd, SandboxError> {
        let pid = self.monitor.as_raw();
        let dir = nix::fcntl::open(
            format!("/proc/{pid}").as_str(),
            nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| SandboxError::IdMap { what: "/proc/PID", pid, source: e.into() })?;
        self.check_monitor_pid("opening /proc/PID")?;
        Ok(dir)
    }

    /// Fails when the monitor a zygote forked no longer holds its pid (it died and was
    /// reaped: the pid may name another process by now).
    fn check_monitor_pid(&self, during: &str) -> Result<(), SandboxError> {
        match &self.monitor_pidfd {
            Some(pidfd) if !crate::zygote::pidfd_holds_pid(pidfd) => Err(SandboxError::Channel(format!(
                "the sandbox monitor (pid {}) ended during {during}",
                self.monitor.as_raw()
            ))),
            _ => Ok(()),
        }
    }

    /// Wait until the channel has a message, or fail once the setup limit has passed since
    /// the spawn (the caller's drop of `self` then kills and reaps everything).
    fn await_setup(&self, waiting_for: &str) -> Result<(), SandboxError> {
        loop {
            let left = self.setup_limit.saturating_sub(self.setup_from.elapsed());
            if left.is_zero() {
                return Err(setup_overdue(self.setup_limit, waiting_for).into());
            }
            let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX).max(1);
            let mut pfd = [PollFd::new(self.chan.as_fd(), PollFlags::POLLIN)];
            match poll(&mut pfd, PollTimeout::from(ms)) {
                Ok(0) | Err(Errno::EINTR) => continue,
                Ok(_) => return Ok(()),
                Err(e) => return Err(SandboxError::io("poll", e.into())),
            }
        }
    }

    /// Whether a message (or the end of the channel) is waiting, without blocking.
    fn chan_readable(&self) -> bool {
        let mut pfd = [PollFd::new(self.chan.as_fd(), PollFlags::POLLIN)];
        poll(&mut pfd, PollTimeout::ZERO).is_ok_and(|n| n > 0)
    }

    /// The parent's end of the application channel, borrowed while the caller has not taken
    /// it — for a caller that talks to the payload before handing it its work, as a warm
    /// pool's warm-up does. `None` without an application channel, and while the sandbox is
    /// held (the channel's first message is then the go).
    pub fn app_channel(&self) -> Option<&Channel> {
        if !self.app_requested || self.held {
            return None;
        }
        self.app.as_ref()
    }

    /// The parent's end of the application channel (once). Its protocol is the caller's;
    /// everything read from it comes from code running in the sandbox.
    pub fn take_app_channel(&mut self) -> Option<Channel> {
        if !self.app_requested {
            return None;
        }
        self.app.take()
    }

    /// The CPU quota's handle (see [`CpuLimiter`]).
    pub fn cpu_limiter(&self) -> std::sync::Arc<CpuLimiter> {
        self.cpu.clone()
    }

    /// Which cgroup limits are in force and which were let go (degraded mode), as the
    /// outcome will report them; `None` without a cgroup.
    pub fn cgroup_report(&self) -> Option<&crate::report::CgroupReport> {
        self.cgroup.as_ref().map(|c| c.report())
    }

    /// A reader of the OOM kills inside this sandbox, for another thread (`None` without a
    /// memory cgroup). Any kill ends the whole sandbox soon after (v2: `memory.oom.group`;
    /// v1: [`Sandbox::wait`] kills the rest once it is told): a caller that sees the count
    /// rise knows the sandbox is ending, before its processes are all gone.
    pub fn oom_counter(&self) -> Option<crate::cgroup::OomCounter> {
        self.cgroup.as_ref().and_then(|c| c.oom_counter())
    }

    /// A handle that stops this sandbox from another thread (see [`StopHandle`]).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Host pid of the monitor process (its namespaces are the sandbox's).
    pub fn monitor_pid(&self) -> i32 {
        self.monitor.as_raw()
    }

    /// How the sandbox was started, as its [`Outcome::launch`] will say.
    pub fn launch(&self) -> &'static str {
        self.launch
    }

    /// The host uid the sandbox runs as when it has one of its own, as its
    /// [`Outcome::host_uid`] will say.
    pub fn host_uid(&self) -> Option<u32> {
        self.host_uid.as_ref().map(|l| l.uid())
    }

    /// Declared paths bound without the sandbox's idmapping, as its
    /// [`Outcome::not_idmapped`] will say.
    pub fn not_idmapped(&self) -> &[String] {
        &self.not_idmapped
    }

    /// The payload's enforcement report as soon as [`Sandbox::wait`] (on another thread)
    /// reads it, before the outcome: for a caller that reports what a long-lived sandbox
    /// enforces while it runs (a session). Sent once; the channel closes without it when
    /// the sandbox ends before its payload started. A second call replaces the first.
    pub fn started_report(&mut self) -> std::sync::mpsc::Receiver<EnforcementReport> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.started_tx = Some(tx);
        rx
    }

    /// Supervise to the end and tear everything down.
    pub fn wait(mut self, mut out: OutputOptions) -> Result<Outcome, SandboxError> {
        let mut stdout = Captured::default();
        let mut stderr = Captured::default();
        let mut report: Option<EnforcementReport> = None;
        let mut failure: Option<StepError> = None;
        // The payload's status once init reaped it (`payload_ended`), and once init reaped every
        // other process too (`payload_exit`: the sandbox's processes are all gone).
        let mut payload_ended: Option<ExitInfo> = None;
        let mut payload_exit: Option<ExitInfo> = None;
        let mut payload_exited_at: Option<Instant> = None;
        let mut chan_open = true;
        // (cpu ms, peak rss bytes) of the tree, from the monitor once init is reaped.
        let mut tree: Option<(u64, u64)> = None;
        // How init ended, from the monitor that reaped it.
        let mut init_exit: Option<ExitInfo> = None;
        let deadline = self.timeout.map(|t| self.started + t);
        let mut kill_at: Option<Instant> = None;
        let mut backstop_at: Option<Instant> = None;
        // When to stop waiting for processes that survived the backstop's SIGKILL.
        let mut abandon_at: Option<Instant> = None;
        let mut abandoned = false;
        // Why, when the payload had started and nothing else had failed: the outcome is then
        // returned with it (`SandboxError::Abandoned`).
        let mut abandoned_why: Option<String> = None;
        let mut stopped_after_end = false;
        // When a deferred CPU quota is applied at the latest.
        let mut cpu_at: Option<Instant> = None;
        let mut timed_out = false;
        let mut stopped = false;
        // v1: the sandbox's memory cgroup ran out of memory — the kernel kills one victim,
        // this kills the rest, as v2's `memory.oom.group` does (see `SandboxCgroup::oom_event`).
        // The notification comes before the kernel's kill, and an ancestor's OOM notifies
        // every cgroup beneath it: the rest is killed only once the sandbox's own cgroup has
        // an OOM kill, checked a moment after the notification.
        let mut out_of_memory = false;
        let mut oom_noticed = false;
        let mut oom_check_at: Option<Instant> = None;
        let mut oom_check_until: Option<Instant> = None;
        // Setup is bounded too (a pooled sandbox's report is already waiting when it is
        // taken, and its clock restarts then).
        let mut setup_at = Some(self.started.max(self.setup_from) + self.setup_limit);
        let mut buf = vec![0u8; 64 * 1024];

        // Done when init is gone (or the monitor is) and the output pipes are drained; the
        // monitor's own exit (namespace teardown) overlaps with the cleanup below.
        while (chan_open && tree.is_none()) || self.stdout.is_some() || self.stderr.is_some() {
            let now = Instant::now();
            // (Once the payload has ended its time limit is moot: the rest is being reaped,
            // bounded by the backstop and the abandon.)
            if let Some(d) = deadline.filter(|_| payload_ended.is_none()) {
                if !timed_out && now >= d {
                    timed_out = true;
                    self.terminate();
                    kill_at = Some(now + self.grace);
                }
            }
            if let Some(k) = kill_at {
                if now >= k {
                    self.kill();
                    kill_at = None;
                    backstop_at = Some(now + BACKSTOP);
                }
            }
            if let Some(b) = backstop_at {
                if now >= b {
                    self.kill_everything();
                    backstop_at = None;
                    abandon_at.get_or_insert(now + ABANDON);
                }
            }
            if abandon_at.is_some_and(|a| now >= a) {
                tracing::error!(
                    monitor = self.monitor.as_raw(),
                    "sandbox processes still there {} s after SIGKILL; abandoned",
                    ABANDON.as_secs()
                );
                let why = format!(
                    "the sandbox's processes had not exited {} s after SIGKILL (stuck in the kernel?); abandoned, \
                     with their output",
                    ABANDON.as_secs()
                );
                // Only a payload that ended has an outcome worth keeping: one abandoned while
                // it ran (stuck, or stopped) fails, as before.
                if failure.is_none() && report.is_some() && payload_ended.is_some() {
                    abandoned_why = Some(why);
                } else {
                    failure.get_or_insert(StepError::new(Stage::Protocol, why));
                }
                // Our ends of the output pipes close; the processes die whenever the kernel
                // lets them, and their cgroups go then (left behind below, retried later).
                self.stdout = None;
                self.stderr = None;
                abandoned = true;
                break;
            }
            if report.is_some() || failure.is_some() || timed_out || stopped || !chan_open {
                setup_at = None;
            }
            if let Some(s) = setup_at {
                // A report already waiting is read first (a caller may come to `wait` late).
                if now >= s && !self.chan_readable() {
                    setup_at = None;
                    failure = Some(setup_overdue(self.setup_limit, "the payload's start report"));
                    self.kill_everything();
                    backstop_at.get_or_insert(now + BACKSTOP);
                }
            }
            if oom_check_at.is_some_and(|c| now >= c) {
                oom_check_at = None;
                if self.cgroup.as_ref().is_some_and(|c| c.usage().oom_kills > 0) {
                    out_of_memory = true;
                    self.kill();
                    backstop_at.get_or_insert(now + BACKSTOP);
                } else if oom_check_until.is_some_and(|u| now < u) {
                    // The kernel has not killed yet (it may wait for the global OOM lock, or
                    // print its report to a slow console): read again.
                    oom_check_at = Some(now + OOM_SETTLE);
                }
            }
            if let Some(c) = cpu_at {
                if now >= c {
                    cpu_at = None;
                    let _ = self.cpu.apply();
                }
            }
            if let (_, Some(e)) = self.cpu.outcome() {
                if failure.is_none() {
                    // Fail closed: a CPU quota that could not be written stops the run.
                    self.kill();
                    failure = Some(StepError::new(Stage::Protocol, e));
                }
            }
            let wake = [
                if timed_out || payload_ended.is_some() { None } else { deadline },
                kill_at,
                backstop_at,
                abandon_at,
                cpu_at,
                setup_at,
                oom_check_at,
            ]
            .into_iter()
            .flatten()
            .min();
            let timeout = match wake {
                None => PollTimeout::NONE,
                Some(w) => {
                    let ms = w.saturating_duration_since(Instant::now()).as_millis().min(60_000) as u16;
                    PollTimeout::from(ms.max(1))
                }
            };
            let mut pfds = Vec::with_capacity(4);
            let mut slots = Vec::with_capacity(4);
            if !stopped {
                pfds.push(PollFd::new(self.stop_rx.as_fd(), PollFlags::POLLIN));
                slots.push(4);
                if let Some((all, _)) = STOP_ALL.get() {
                    pfds.push(PollFd::new(all.as_fd(), PollFlags::POLLIN));
                    slots.push(3);
                }
            }
            if chan_open && tree.is_none() {
                pfds.push(PollFd::new(self.chan.as_fd(), PollFlags::POLLIN));
                slots.push(0);
            }
            if let Some(fd) = &self.stdout {
                pfds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
                slots.push(1);
            }
            if let Some(fd) = &self.stderr {
                pfds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
                slots.push(2);
            }
            if let Some(event) =
                self.cgroup.as_ref().and_then(|c| c.oom_event()).filter(|_| !out_of_memory && oom_check_at.is_none())
            {
                pfds.push(PollFd::new(event.as_fd(), PollFlags::POLLIN));
                slots.push(5);
            }
            match poll(&mut pfds, timeout) {
                Err(Errno::EINTR) | Ok(0) => continue,
                Err(e) => return Err(SandboxError::io("poll", e.into())),
                Ok(_) => {}
            }
            let ready: Vec<usize> =
                pfds.iter().zip(&slots).filter(|(p, _)| p.any().unwrap_or(true)).map(|(_, s)| *s).collect();
            drop(pfds);
            for slot in ready {
                match slot {
                    0 => match self.chan.recv_with_fds::<FromSandbox>() {
                        Ok(None) => {
                            chan_open = false;
                            // The monitor is gone; whatever still holds the output pipes is
                            // killed a little later, and then waited for a bounded time.
                            if self.stdout.is_some() || self.stderr.is_some() {
                                backstop_at.get_or_insert(Instant::now() + BACKSTOP);
                            }
                        }
                        Ok(Some((msg, mut fds))) => match msg {
                            // Once (a repeat is ignored): init is what stops and timeouts
                            // signal. (It may come after the payload's report: the monitor
                            // sends it from another process than init.)
                            // Init's pidfd is the monitor's to send (opened before it could
                            // reap init, it names init): without it, a stop or a timeout
                            // could not reach init, so the sandbox ends here.
                            FromSandbox::InitForked { pid } if self.init.is_none() => {
                                let pidfd = fds.pop().filter(|_| fds.is_empty());
                                let named = match &pidfd {
                                    Some(p) => pidfd_names(p, pid),
                                    None => Ok(None),
                                };
                                match (pidfd, named) {
                                    (Some(pidfd), Ok(Some(true))) => self.init = Some(pidfd),
                                    // Init is over already (reaped by the monitor).
                                    (_, Ok(Some(false))) => {}
                                    (_, named) => {
                                        let why = named.err().unwrap_or_else(|| "no pidfd of it came with it".into());
                                        failure.get_or_insert(StepError::new(
                                            Stage::Protocol,
                                            format!("the monitor reported init (pid {pid}): {why}"),
                                        ));
                                        self.kill_everything();
                                        backstop_at.get_or_insert(Instant::now() + BACKSTOP);
                                    }
                                }
                            }
                            FromSandbox::InitForked { .. } => {}
                            FromSandbox::Started(r) => {
                                if let Some(tx) = self.started_tx.take() {
                                    // (The receiver may be gone: nobody waits any more.)
                                    let _ = tx.try_send((*r).clone());
                                }
                                report = Some(*r);
                                // (A quota that is not deferred was written at creation.)
                                if self.cpu_deferred {
                                    cpu_at = Some(Instant::now() + CPU_DEFER_MAX);
                                }
                            }
                            FromSandbox::Failed(e) => {
                                failure.get_or_insert(e);
                            }
                            FromSandbox::PayloadEnded(x) => {
                                payload_ended = Some(x);
                                payload_exited_at.get_or_insert_with(Instant::now);
                                // Init now kills and reaps the rest; a process stuck in the
                                // kernel must not keep the sandbox alive.
                                backstop_at.get_or_insert(Instant::now() + REAP_PATIENCE);
                            }
                            FromSandbox::PayloadExited(x) => {
                                payload_exit = Some(x);
                                payload_exited_at.get_or_insert_with(Instant::now);
                                // Every process but init is gone: init and the monitor only
                                // exit now.
                                let soon = Instant::now() + BACKSTOP;
                                backstop_at = Some(backstop_at.map_or(soon, |b| b.min(soon)));
                            }
                            // From init as it ends: the outcome is complete. A caller
                            // that tears down in the background is done here; the others
                            // wait for the monitor's report that init is gone too.
                            FromSandbox::TreeUsage { cpu_ms, peak_rss_bytes } => {
                                // (A sandbox started directly has no monitor to report.)
                                if self.teardown_in_background || self.direct {
                                    tree = Some((cpu_ms, peak_rss_bytes));
                                }
                            }
                            FromSandbox::InitExited { cpu_ms, peak_rss_bytes, init_exit: x } => {
                                self.init = None;
                                tree = Some((cpu_ms, peak_rss_bytes));
                                init_exit = Some(x);
                            }
                            FromSandbox::Unshared => {}
                        },
                        Err(e) => {
                            failure.get_or_insert(StepError::new(Stage::Protocol, e));
                            self.kill_everything();
                            chan_open = false;
                            // Again, and then bounded, should something survive it.
                            backstop_at.get_or_insert(Instant::now() + BACKSTOP);
                        }
                    },
                    5 => {
                        if let Some(event) = self.cgroup.as_ref().and_then(|c| c.oom_event()) {
                            let _ = event.read();
                        }
                        oom_noticed = true;
                        oom_check_at = Some(Instant::now() + OOM_SETTLE);
                        oom_check_until = Some(Instant::now() + OOM_CHECK_FOR);
                    }
                    3 | 4 if stopped => {}
                    3 | 4 if slot == 4 && !self.stop_requested(report.is_some()) => {}
                    3 | 4 => {
                        stopped = true;
                        // A stop after the payload's end ends nothing of it: the run is not
                        // "stopped before it finished".
                        stopped_after_end = payload_ended.is_some();
                        self.kill();
                        backstop_at.get_or_insert(Instant::now() + BACKSTOP);
                    }
                    1 => Self::drain(
                        &mut abandon_at,
                        &mut self.stdout,
                        &mut stdout,
                        out.stdout_cap,
                        Stream::Stdout,
                        &mut buf,
                        &mut out.tee,
                    ),
                    _ => Self::drain(
                        &mut abandon_at,
                        &mut self.stderr,
                        &mut stderr,
                        out.stderr_cap,
                        Stream::Stderr,
                        &mut buf,
                        &mut out.tee,
                    ),
                }
            }
            // Every process of the sandbox is gone once init reports the payload's exit (it
            // killed and reaped the rest first, then let go of its stdio) or is itself gone
            // (the namespace's end takes every process with it): what they wrote is in the
            // pipes. A pipe that stays open after that is held by a process outside the
            // sandbox — a descriptor passed over a socket to another sandbox — which could
            // otherwise hold this one's end, and write into its output, as long as it lives.
            if payload_exit.is_some() || tree.is_some() {
                for (fd, cap, limit, stream) in [
                    (&mut self.stdout, &mut stdout, out.stdout_cap, Stream::Stdout),
                    (&mut self.stderr, &mut stderr, out.stderr_cap, Stream::Stderr),
                ] {
                    if Self::drain_buffered(fd, cap, limit, stream, &mut buf, &mut out.tee) {
                        tracing::warn!(
                            monitor = self.monitor.as_raw(),
                            stream = ?stream,
                            "an output pipe is held open outside the sandbox after its processes ended; closed"
                        );
                    }
                }
            }
        }
        let stopped = stopped && !stopped_after_end;
        let wall = self.started.elapsed();
        let launch = self.launch;
        let mut cgroup = self.cgroup.take();
        if let (Some(cg), (true, _)) = (cgroup.as_mut(), self.cpu.outcome()) {
            cg.mark_cpu_enforced();
        }
        let cg_usage = cgroup.as_ref().map(|c| c.usage()).unwrap_or_default();
        let cg_report = cgroup.as_ref().map(|c| c.report().clone());
        // (An OOM the loop had no turn to see: the payload ended at once after it.)
        oom_noticed |= out_of_memory || cgroup.as_ref().and_then(|c| c.oom_event()).is_some_and(|e| e.read().is_ok());
        // The outcome is complete (the tree's usage is in, the output read to its end, every
        // process but init and the monitor, which only exit now, gone): what is left is
        // teardown, which a caller that asked for it gets done in the background.
        let host_uid = self.host_uid.as_ref().map(|l| l.uid());
        let not_idmapped = std::mem::take(&mut self.not_idmapped);
        let deferred = self.teardown_in_background
            && tree.is_some()
            && report.is_some()
            && failure.is_none()
            && !abandoned
            && background::admit();
        let direct = self.direct;
        let (removed, monitor, monitor_exit) = if deferred {
            background::submit(cgroup, self);
            (Ok(()), None, None)
        } else {
            // The payload ended and init never reported the rest reaped: init is waiting for a
            // process stuck in the kernel (the backstop killed it, and a PID 1 exits only once
            // its namespace is empty), so its exit is not waited for.
            let stuck_after_end = payload_ended.is_some() && payload_exit.is_none() && tree.is_none();
            if let (true, false, false, Some(init)) = (self.direct, abandoned, stuck_after_end, &self.init) {
                // A sandbox started directly reported its outcome from init as it ended: its
                // exit empties the cgroups.
                crate::zygote::pidfd_wait(init, MONITOR_EXIT);
            }
            let removed = match cgroup {
                // Their processes cannot go yet: no patience spent on them now.
                Some(cg) if abandoned => {
                    cg.leave_behind();
                    Ok(())
                }
                Some(cg) => cg.remove(),
                None => Ok(()),
            };
            // (A monitor whose init is stuck cannot exit either: no patience for it then.)
            let hopeless = abandoned || (stuck_after_end && removed.is_err());
            let ru = self.reap(if hopeless { Duration::ZERO } else { MONITOR_EXIT });
            (removed, ru, self.monitor_exit)
        };
        if let Err(e) = removed {
            // A failure of the run is what its caller needs to hear; the cgroups are logged.
            match failure {
                Some(f) => {
                    tracing::error!(error = %e, "sandbox cgroup left behind");
                    return Err(f.into());
                }
                // The payload ended and the rest could not be reaped nor removed (a process
                // stuck in the kernel that let go of the output pipes): abandoned, as the
                // loop would have said, with the outcome.
                None if report.is_some() && payload_ended.is_some() => {
                    abandoned = true;
                    abandoned_why.get_or_insert_with(|| {
                        format!(
                            "the sandbox's cgroups could not be removed after its payload ended ({e}): processes \
                             stuck in the kernel?; left behind"
                        )
                    });
                }
                None => return Err(e.into()),
            }
        }

        let report = match (report, failure) {
            (_, Some(e)) => return Err(e.into()),
            (Some(r), None) => r,
            (None, None) if timed_out => {
                return Err(StepError::new(Stage::Protocol, "the timeout expired before the payload started").into())
            }
            (None, None) if stopped => {
                return Err(StepError::new(Stage::Protocol, "the sandbox was stopped before the payload started").into())
            }
            (None, None) => return Err(SandboxError::Channel("the sandbox ended before the payload started".into())),
        };
        let usage = ResourceUsage {
            wall_ms: wall.as_millis() as u64,
            // The cgroup counts everything; otherwise the rusage of the tree init reaped (or of
            // the monitor, which includes it, if the monitor could not report).
            cpu_ms: cg_usage
                .cpu_ms
                .or(tree.map(|t| t.0))
                .unwrap_or_else(|| monitor.map_or(0, |ru| tv_ms(ru.ru_utime) + tv_ms(ru.ru_stime))),
            peak_memory_bytes: cg_usage
                .peak_memory_bytes
                .or(tree.map(|t| t.1))
                .or(monitor.map(|ru| ru.ru_maxrss.max(0) as u64 * 1024)),
            oom_kills: cg_usage.oom_kills,
            pids_limit_hits: cg_usage.pids_limit_hits,
            cpu_throttled_periods: cg_usage.cpu_throttled_periods,
            cpu_throttled_ms: cg_usage.cpu_throttled_ms,
        };
        // Reported once init reaped it, even when the rest could not be reaped after it.
        let payload_exit = payload_exit.or(payload_ended);
        let exited_cleanly = payload_exit.is_some_and(|e| e.code == Some(0));
        // Init (PID 1 of the sandbox's namespace) ended while the payload ran, and nothing
        // here ended it: someone outside killed init or the monitor (whose death kills init,
        // its parent-death signal) — and the kernel kills every process of the namespace.
        let ended_from_outside =
            (payload_exit.is_none() && !timed_out && !stopped && !abandoned && usage.oom_kills == 0).then(|| {
                let monitor_signal = monitor_exit.and_then(|e| e.signal);
                match init_exit {
                    Some(x) if x.signal.is_some() => EndedFromOutside { process: "init", signal: x.signal },
                    Some(_) => EndedFromOutside { process: "init", signal: None },
                    // No report of init from the monitor: the monitor went first.
                    None if !direct => EndedFromOutside { process: "monitor", signal: monitor_signal },
                    None => EndedFromOutside { process: "init", signal: None },
                }
            });
        // A sandbox out of memory ends as a whole (v2 kills every process, and so does the
        // loop above on v1), whatever its payload made of its victim's death.
        let killed_by = if usage.oom_kills > 0 && (!exited_cleanly || oom_noticed) {
            Some(KilledBy::Oom)
        } else if timed_out {
            Some(KilledBy::Timeout)
        } else if let Some(n) = ended_from_outside.and_then(|e| e.signal) {
            Some(KilledBy::Signal(n))
        } else if usage.pids_limit_hits > 0 && !exited_cleanly {
            Some(KilledBy::Pids)
        } else {
            payload_exit.and_then(|e| e.signal).map(KilledBy::Signal)
        };
        let outcome = Outcome {
            exit: payload_exit,
            timed_out,
            stopped,
            oom_at_limit: if killed_by == Some(KilledBy::Oom) { cg_usage.memory_limit_reached } else { None },
            killed_by,
            stdout,
            stderr,
            usage,
            enforcement: report,
            cgroup: cg_report.unwrap_or_else(crate::report::CgroupReport::none),
            launch,
            payload_exited_at,
            host_uid,
            not_idmapped,
            ended_from_outside,
        };
        match abandoned_why {
            Some(reason) => Err(SandboxError::Abandoned { reason, outcome: Box::new(outcome) }),
            None => Ok(outcome),
        }
    }

    /// Read what is there on one output pipe; data read puts off `abandon_at` (progress).
    fn drain(
        abandon_at: &mut Option<Instant>,
        fd: &mut Option<OwnedFd>,
        cap: &mut Captured,
        limit: usize,
        stream: Stream,
        buf: &mut [u8],
        tee: &mut Option<Tee<'_>>,
    ) {
        let Some(f) = fd else { return };
        match nix::unistd::read(f.as_fd(), buf) {
            Ok(0) => *fd = None,
            Ok(n) => {
                if let Some(a) = abandon_at {
                    *a = Instant::now() + ABANDON;
                }
                Self::keep(&buf[..n], cap, limit, stream, tee);
            }
            Err(Errno::EINTR | Errno::EAGAIN) => {}
            Err(_) => *fd = None,
        }
    }

    /// A chunk read from an output pipe: counted, kept up to `limit`, passed to the tee.
    fn keep(chunk: &[u8], cap: &mut Captured, limit: usize, stream: Stream, tee: &mut Option<Tee<'_>>) {
        cap.total += chunk.len() as u64;
        let room = limit.saturating_sub(cap.bytes.len());
        cap.bytes.extend_from_slice(&chunk[..room.min(chunk.len())]);
        if let Some(t) = tee {
            t(stream, chunk);
        }
    }

    /// Read what one output pipe holds — at most its capacity, all a writer that is gone can
    /// have left — then close it. `true` when it was still open: a writer outside the
    /// sandbox holds it.
    fn drain_buffered(
        fd: &mut Option<OwnedFd>,
        cap: &mut Captured,
        limit: usize,
        stream: Stream,
        buf: &mut [u8],
        tee: &mut Option<Tee<'_>>,
    ) -> bool {
        let Some(f) = fd.take() else { return false };
        // Read without waiting: whoever holds the other end may write nothing more. (This
        // read end is the parent's alone; the flag is its open file's.) A pipe that cannot be
        // made so is left to the loop's own reads, bounded by the abandon timer, rather than
        // read here where a read could block the run.
        if nix::fcntl::fcntl(f.as_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)).is_err() {
            *fd = Some(f);
            return false;
        }
        // F_GETPIPE_SZ cannot fail on a pipe; the kernel's most for an unprivileged writer
        // (`fs.pipe-max-size`'s default) should it.
        let capacity = nix::fcntl::fcntl(f.as_fd(), nix::fcntl::FcntlArg::F_GETPIPE_SZ).unwrap_or(1 << 20).max(0);
        let mut read = 0usize;
        while read <= capacity as usize {
            match nix::unistd::read(f.as_fd(), buf) {
                Ok(0) => return false,
                Ok(n) => {
                    read += n;
                    Self::keep(&buf[..n], cap, limit, stream, tee);
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => break,
                Err(_) => return false,
            }
        }
        true
    }

    /// Read what the stop handles asked: `true` for a stop (or every handle gone, which
    /// would leave the socket readable for ever); an interrupt is passed on to init here
    /// once the payload has `started` (during setup init takes SIGINT as a stop).
    fn stop_requested(&self, started: bool) -> bool {
        let mut asked = [0u8; 64];
        let mut interrupt = false;
        loop {
            match nix::unistd::read(&self.stop_rx, &mut asked) {
                Ok(0) => return true,
                Ok(n) if asked[..n].contains(&WAKE_STOP) => return true,
                Ok(n) => interrupt |= asked[..n].contains(&WAKE_INTERRUPT),
                Err(Errno::EINTR) => continue,
                // EAGAIN: all read.
                Err(_) => break,
            }
        }
        if interrupt && started {
            if let Some(init) = &self.init {
                crate::zygote::pidfd_signal(init, Signal::SIGINT);
            }
        }
        false
    }

    /// SIGTERM to the sandbox init, which forwards it to every process inside.
    fn terminate(&self) {
        match &self.init {
            Some(init) => crate::zygote::pidfd_signal(init, Signal::SIGTERM),
            None => self.kill(),
        }
    }

    /// Ask the sandbox init to SIGKILL and reap every process (which keeps their accounting);
    /// init, then the monitor, exit on their own. Before init exists, or as a backstop,
    /// [`Sandbox::kill_everything`].
    fn kill(&self) {
        match &self.init {
            Some(init) => crate::zygote::pidfd_signal(init, crate::init::KILL_ALL),
            None => self.kill_everything(),
        }
    }

    /// SIGKILL init, the monitor and anything left in the cgroup.
    fn kill_everything(&self) {
        if let Some(init) = &self.init {
            crate::zygote::pidfd_signal(init, Signal::SIGKILL);
        }
        match &self.monitor_pidfd {
            Some(pidfd) => crate::zygote::pidfd_signal(pidfd, Signal::SIGKILL),
            None => {
                let _ = kill(self.monitor, Signal::SIGKILL);
            }
        }
        if let Some(cg) = &self.cgroup {
            cg.kill_all();
        }
    }

    fn left_behind(&mut self, waited: Duration) {
        // Its processes may outlive this: the uid stays theirs (leaked until this process
        // ends) rather than go to another sandbox meanwhile.
        std::mem::forget(self.host_uid.take());
        tracing::error!(
            monitor = self.monitor.as_raw(),
            waited_ms = waited.as_millis() as u64,
            "the sandbox's monitor had not exited (stuck in the kernel?); killed and left behind"
        );
    }

    /// Reap the monitor, waiting at most `patience` for it to exit; returns the resource
    /// usage of the whole sandbox tree (the monitor waited for init, init for every process
    /// of the PID namespace). A monitor that does not exit in time is killed and left
    /// behind ([`MONITOR_EXIT`]).
    fn reap(&mut self, patience: Duration) -> Option<libc::rusage> {
        if self.reaped {
            return None;
        }
        self.reaped = true;
        if let Some(pidfd) = &self.monitor_pidfd {
            // Not our child: its parent (the zygote) reaps it; wait until it is gone.
            if !crate::zygote::pidfd_wait(pidfd, patience) {
                crate::zygote::pidfd_signal(pidfd, Signal::SIGKILL);
                self.left_behind(patience);
                // Whenever the monitor does exit, the namespace's teardown is not ours.
                if let Some(ns) = self.mount_ns.take() {
                    release_later(ns);
                }
                return None;
            }
            // Every process of the sandbox is gone: nothing uses its mounts any more.
            if let Some(ns) = self.mount_ns.take() {
                release_later(ns);
            }
            return None;
        }
        // Our child, not yet reaped: its pid cannot name another process, so neither can
        // the pidfd. (Without pidfds — before Linux 5.3 — the wait below is unbounded.)
        if let Ok(pidfd) = crate::zygote::pidfd_open(self.monitor) {
            if !crate::zygote::pidfd_wait(&pidfd, patience) {
                crate::zygote::pidfd_signal(&pidfd, Signal::SIGKILL);
                self.left_behind(patience);
                UNREAPED.lock().unwrap_or_else(|e| e.into_inner()).push(self.monitor);
                return None;
            }
        }
        // SAFETY: rusage is plain old data; all-zero is valid.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        let mut status = 0;
        loop {
            // SAFETY: wait4 writes into the status and rusage we own.
            let rc = unsafe { libc::wait4(self.monitor.as_raw(), &mut status, 0, &mut ru) };
            if rc >= 0 {
                self.monitor_exit = Some(ExitInfo::from_wait_status(status));
                return Some(ru);
            }
            if Errno::last() != Errno::EINTR {
                return None;
            }
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if !self.reaped {
            self.kill_everything();
            self.reap(MONITOR_EXIT);
        }
        // The cgroup (if still held) removes itself on drop.
    }
}

/// Drop the last reference to an emptied sandbox's mount namespace on a background thread.
///
/// Destroying a mount namespace unmounts its tree and then waits for an RCU grace period
/// (`namespace_unlock` → `synchronize_rcu_expedited`, ~0.4 ms here) in whichever task drops
/// the last reference. Without this that task is the monitor, in its exit, and the run waits
/// for it; held here, the wait is a background thread's. Nothing of the sandbox runs by then
/// (every process of it has exited), so no isolation depends on when the mounts go. The
/// thread starts on first use and lives as long as the process; should it be gone, the
/// namespace is dropped here.
fn release_later(ns: OwnedFd) {
    use std::sync::mpsc::{channel, Sender};
    use std::sync::OnceLock;
    static RELEASER: OnceLock<Option<Sender<OwnedFd>>> = OnceLock::new();
    let releaser = RELEASER.get_or_init(|| {
        let (tx, rx) = channel::<OwnedFd>();
        std::thread::Builder::new()
            .name("opservant-ns-release".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .map_err(|e| tracing::debug!(error = %e, "no namespace release thread"))
            .ok()
            .map(|_| tx)
    });
    if let Some(tx) = releaser {
        // A send fails only without the thread; the namespace then comes back in the error
        // and is dropped here.
        let _ = tx.send(ns);
    }
}

/// Wait until every teardown left to the background ([`Sandbox::teardown_in_background`]) is
/// done, at most `timeout`; `false` when some are still under way. A process that used it
/// calls this before it exits (the agent's shutdown), so that no sandbox cgroup outlives it.
pub fn await_background_teardown(timeout: Duration) -> bool {
    background::wait_idle(timeout)
}

/// The background teardown of sandboxes whose outcome is complete: one thread, started on
/// first use, removing their cgroups and reaping their monitors in turn.
mod background {
    use super::{Sandbox, SandboxCgroup, MONITOR_EXIT};
    use std::sync::mpsc::{channel, Sender};
    use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
    use std::time::{Duration, Instant};

    /// At most this many teardowns wait; past that a caller tears its sandbox down itself, so
    /// that sandboxes that cannot be removed (stuck in the kernel) do not pile up.
    const MAX_PENDING: usize = 32;

    type Job = (Option<SandboxCgroup>, Sandbox);

    struct Teardowns {
        tx: Mutex<Option<Sender<Job>>>,
        pending: Mutex<usize>,
        idle: Condvar,
    }

    static TEARDOWNS: Teardowns = Teardowns { tx: Mutex::new(None), pending: Mutex::new(0), idle: Condvar::new() };
    static THREAD: OnceLock<bool> = OnceLock::new();

    fn started() -> bool {
        *THREAD.get_or_init(|| {
            let (tx, rx) = channel::<Job>();
            let spawned = std::thread::Builder::new()
                .name("opservant-teardown".into())
                .spawn(move || rx.into_iter().for_each(finish))
                .map_err(|e| tracing::debug!(error = %e, "no background teardown thread"))
                .is_ok();
            if spawned {
                *TEARDOWNS.tx.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
            }
            spawned
        })
    }

    /// A place for one more teardown (the caller then must [`submit`] it).
    pub(super) fn admit() -> bool {
        if !started() {
            return false;
        }
        let mut pending = TEARDOWNS.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if *pending >= MAX_PENDING {
            return false;
        }
        *pending += 1;
        true
    }

    /// Tear down `sandbox` (admitted) in the background; here should the thread be gone.
    pub(super) fn submit(cgroup: Option<SandboxCgroup>, sandbox: Sandbox) {
        let tx = TEARDOWNS.tx.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let job = (cgroup, sandbox);
        let unsent = match tx {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            finish(job);
        }
    }

    fn finish((cgroup, mut sandbox): Job) {
        // Init is on its way out (it reported the tree's usage as it ended): its exit empties
        // the cgroups, which can then go without a sweep.
        if let Some(init) = sandbox.init.take() {
            crate::zygote::pidfd_wait(&init, MONITOR_EXIT);
        }
        if let Some(cg) = cgroup {
            if let Err(e) = cg.remove() {
                tracing::error!(error = %e, "sandbox cgroup left behind (background teardown)");
            }
        }
        sandbox.reap(MONITOR_EXIT);
        drop(sandbox);
        let mut pending = TEARDOWNS.pending.lock().unwrap_or_else(PoisonError::into_inner);
        *pending = pending.saturating_sub(1);
        TEARDOWNS.idle.notify_all();
    }

    pub(super) fn wait_idle(timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        let mut pending = TEARDOWNS.pending.lock().unwrap_or_else(PoisonError::into_inner);
        while *pending > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            pending = TEARDOWNS.idle.wait_timeout(pending, left).unwrap_or_else(PoisonError::into_inner).0;
        }
        true
    }
}

/// Whether every other end of `chan` is closed (checked without waiting).
fn hung_up(chan: &Channel) -> bool {
    let mut pfd = [PollFd::new(chan.as_fd(), PollFlags::empty())];
    matches!(poll(&mut pfd, PollTimeout::ZERO), Ok(n) if n > 0)
        && pfd[0].revents().is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR))
}

/// Spawn + supervise in one call.
pub fn run(spec: &SandboxSpec, launcher: &Launcher, out: OutputOptions) -> Result<Outcome, SandboxError> {
    Sandbox::spawn(spec, launcher, None)?.wait(out)
}

/// The error of a setup that exceeded its limit.
fn setup_overdue(limit: Duration, waiting_for: &str) -> StepError {
    StepError::new(
        Stage::Protocol,
        format!("sandbox setup did not finish within {} ms (waiting for {waiting_for})", limit.as_millis()),
    )
}

fn tv_ms(t: libc::timeval) -> u64 {
    (t.tv_sec.max(0) as u64) * 1000 + (t.tv_usec.max(0) as u64) / 1000
}

fn pipe() -> Result<(OwnedFd, OwnedFd), SandboxError> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| SandboxError::io("pipe", e.into()))
}

/// Start the monitor with stdio and the channel in place: `posix_spawn` with an empty
/// environment, or `fork` (single-threaded callers). Returns its pid, a pidfd for it when a
/// zygote started it, that zygote's pid, and whether the zygote started the sandbox's init
/// directly instead ([`crate::init::run_direct`]: the process is then init, and there is no
/// monitor).
fn spawn_monitor(
    launcher: &Launcher,
    fds: &[(OwnedFd, RawFd)],
    spec: &SandboxSpec,
    owner: Option<u32>,
) -> Result<(Pid, Option<OwnedFd>, Option<i32>, bool), SandboxError> {
    use nix::spawn::{posix_spawn, PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags};
    let err = |e: Errno| SandboxError::Spawn { program: launcher.describe(), source: e.into() };
    let (program, args) = match launcher {
        Launcher::Exec { program, args } => (program, args),
        Launcher::Zygote { zygote, end } => {
            return zygote
                .spawn(fds, *end, spec.can_join_prepared_net(), crate::init::direct_fits(spec), owner)
                .map(|(started, zygote_pid)| (started.pid, Some(started.pidfd), Some(zygote_pid), started.direct));
        }
        Launcher::Fork => {
            // SAFETY: `Launcher::Fork` is only chosen for single-threaded callers, so the
            // child is a complete copy of the only thread and may run arbitrary code.
            return match unsafe { nix::unistd::fork() }.map_err(err)? {
                nix::unistd::ForkResult::Child => {
                    for (fd, target) in fds.iter().map(|(fd, t)| (fd, *t)) {
                        // SAFETY: dup2 onto the stdio/channel numbers; the sources are open.
                        if unsafe { libc::dup2(fd.as_raw_fd(), target) } < 0 {
                            // SAFETY: _exit is always sound; the parent sees the channel close.
                            unsafe { libc::_exit(125) };
                        }
                    }
                    // The caller's arguments must not show as the sandbox's PID 1.
                    // SAFETY: this fork child is single-threaded and has run nothing but dup2;
                    // the caller (the opservant CLI) never moves its argument range.
                    if unsafe { crate::process::blank_command_line() }.is_err() {
                        // SAFETY: as above; the parent sees the channel close.
                        unsafe { libc::_exit(125) };
                    }
                    crate::init::run_monitor(Some(spec), false)
                }
                nix::unistd::ForkResult::Parent { child } => Ok((child, None, None, false)),
            };
        }
    };
    let mut actions = PosixSpawnFileActions::init().map_err(err)?;
    for (fd, target) in fds.iter().map(|(fd, t)| (fd, *t)) {
        actions.add_dup2(fd.as_raw_fd(), target).map_err(err)?;
    }
    let mut attr = PosixSpawnAttr::init().map_err(err)?;
    attr.set_flags(PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF).map_err(err)?;
    attr.set_sigmask(&SigSet::empty()).map_err(err)?;
    attr.set_sigdefault(&SigSet::all()).map_err(err)?;
    let env: [&CStr; 0] = [];
    posix_spawn(program.as_c_str(), &actions, &attr, args, &env).map_err(err).map(|pid| (pid, None, None, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Identity, SandboxSpec};

    /// What the parent accepts as init's pidfd from the monitor: a pidfd of that pid only.
    #[test]
    fn only_a_pidfd_of_the_reported_pid_is_taken_for_init() {
        let me = std::process::id() as i32;
        let pidfd = crate::zygote::pidfd_open(Pid::from_raw(me)).unwrap();
        assert_eq!(pidfd_names(&pidfd, me), Ok(Some(true)));
        assert_eq!(pidfd_names(&pidfd, me + 1), Ok(None), "a pidfd of another pid");
        let file: OwnedFd = std::fs::File::open("/proc/self/status").unwrap().into();
        assert_eq!(pidfd_names(&file, me), Ok(None), "not a pidfd");
        // A pidfd of a process reaped since: it names no one any more.
        let mut child = std::process::Command::new("/bin/true").spawn().unwrap();
        let pid = child.id() as i32;
        let pidfd = crate::zygote::pidfd_open(Pid::from_raw(pid)).unwrap();
        child.wait().unwrap();
        assert_eq!(pidfd_names(&pidfd, pid), Ok(Some(false)));
    }

    /// What the parent accepts as the monitor's handed-over namespaces: user, mount and
    /// network namespaces, in that order, the user namespace owned by the lease's uid, and
    /// none of the agent's own where the sandbox was to have its own.
    #[test]
    fn handed_over_namespaces_are_checked_for_kind_owner_and_not_being_the_agents() {
        // Namespaces of another process's (owned by root: its creator).
        let mut child = std::process::Command::new("unshare")
            .args(["--user", "--mount", "--net", "sleep", "60"])
            .spawn()
            .expect("run unshare");
        let ns = |pid: &str, name: &str| -> OwnedFd {
            std::fs::File::open(format!("/proc/{pid}/ns/{name}")).unwrap().into()
        };
        let same = |a: &OwnedFd, b: &OwnedFd| {
            let (a, b) = (nix::sys::stat::fstat(a.as_fd()).unwrap(), nix::sys::stat::fstat(b.as_fd()).unwrap());
            (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        };
        let pid = child.id().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        while same(&ns(&pid, "net"), &ns("self", "net")) || same(&ns(&pid, "user"), &ns("self", "user")) {
            assert!(Instant::now() < deadline, "unshare never made its namespaces");
            std::thread::sleep(Duration::from_millis(10));
        }
        let theirs: Vec<OwnedFd> = ["user", "mnt", "net"].iter().map(|n| ns(&pid, n)).collect();
        let all = crate::spec::Namespaces::default();
        let check = |fds: Vec<OwnedFd>, owner: u32| check_handed_over(&fds, owner, &all).map_err(|e| e.to_string());
        let copy = |i: usize| theirs[i].try_clone().unwrap();

        assert_eq!(check(vec![copy(0), copy(1), copy(2)], 0), Ok(()));
        let err = check(vec![copy(0), copy(1), copy(2)], 4242).unwrap_err();
        assert!(err.contains("owned by uid 0, not the leased 4242"), "{err}");
        let err = check(vec![copy(1), copy(0), copy(2)], 0).unwrap_err();
        assert!(err.contains("user is a namespace of kind"), "{err}");
        let err = check(vec![copy(0), ns("self", "mnt"), copy(2)], 0).unwrap_err();
        assert!(err.contains("mnt is the agent's own namespace"), "{err}");
        let err = check(vec![copy(0), copy(1), ns("self", "net")], 0).unwrap_err();
        assert!(err.contains("net is the agent's own namespace"), "{err}");
        let file: OwnedFd = std::fs::File::open("/proc/self/status").unwrap().into();
        let err = check(vec![copy(0), copy(1), file], 0).unwrap_err();
        assert!(err.contains("net is not a namespace"), "{err}");
        // A sandbox that shares the host's network namespace hands the host's over.
        let shared_net = crate::spec::Namespaces { net: false, ..all };
        assert!(check_handed_over(&[copy(0), copy(1), ns("self", "net")], 0, &shared_net).is_ok());
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn landlock_minimum_is_checked_before_anything_starts() {
        let mut spec = SandboxSpec::new("/bin/true", vec![], Identity::same_inside(65534, 65534));
        spec.landlock.min_abi = 60;
        // A launcher that cannot work proves nothing was started: the check comes first.
        let launcher = Launcher::new("/nonexistent/init", &[]).unwrap();
        match Sandbox::spawn(&spec, &launcher, None) {
            Err(SandboxError::LandlockTooOld { required: 60, found }) => assert!(found < 60),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("started despite an unmet Landlock minimum"),
        }
    }

    #[test]
    fn invalid_specs_are_refused_before_anything_starts() {
        let mut spec = SandboxSpec::new("/bin/true", vec![], Identity::same_inside(0, 0));
        spec.landlock.min_abi = 0;
        let launcher = Launcher::new("/nonexistent/init", &[]).unwrap();
        assert!(matches!(Sandbox::spawn(&spec, &launcher, None), Err(SandboxError::Spec(_))));
    }
}
