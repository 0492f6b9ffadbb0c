//! A zygote: a long-lived, single-threaded process that starts sandboxes by `fork`ing
//! itself, so whatever it initialised once (an interpreter, imported modules) is already
//! there in every sandbox, without an `execve` or a start-up per run.
//!
//! The zygote runs exactly the isolation steps of [`crate::init`] in each forked child —
//! the same code as the cold path, not a second implementation — and the parent drives the
//! sandbox exactly as in the cold path (spec, cgroups, id maps, namespace hook, output,
//! timeout) over the same channel. The only differences:
//!
//! - the monitor is the zygote's child, not the parent's: the zygote hands the parent a
//!   pidfd for it (opened before the zygote can reap it, so it names that process and no
//!   other), and the parent signals and waits through the pidfd;
//! - with [`PayloadEnd::Return`] the payload process returns into the zygote's code (its
//!   interpreter) instead of `execve`, after every restriction is in place;
//! - with a prepared network namespace, the zygote starts the sandbox *directly*
//!   ([`crate::init::run_direct`]): it joins that namespace, `clone`s the child into new
//!   user, mount, PID, IPC and UTS namespaces and returns to its own network namespace, and
//!   the child is the sandbox's init, running the monitor's protocol steps and then init's,
//!   with no monitor process (the reply says so; the pidfd is then init's). A request for a
//!   direct start may name a host uid leased for the sandbox: the zygote takes it as its
//!   effective uid for the `clone`, which makes that uid the owner of the new user
//!   namespace, and restores its own credentials (or exits) right after.
//!
//! Guarantees: the zygote receives nothing but descriptors, a mode byte and a direct
//! start's owner uid — no spec, no secrets, no executor code; the forked child reads its
//! spec from the channel like a cold monitor. A child starts with default signal
//! dispositions, an empty signal mask and only stdio, the channel and (optionally) the
//! application channel and a fresh network namespace from the zygote's [`NetnsStash`] open
//! (the monitor joins that namespace instead of creating one). The zygote exits when its
//! control socket closes — when the [`Zygote`] is dropped or its process dies, since only
//! that process holds the other end (close-on-exec). Not `PR_SET_PDEATHSIG`: that
//! follows the *thread* that spawned the zygote, and a multi-threaded agent starts it from
//! whichever thread needs it first. A request the zygote cannot serve is an error
//! ([`SandboxError::Zygote`]) before anything of the sandbox ran, so the caller may fall back
//! to the cold path; so is a zygote that does not serve within [`START_LIMIT`] of its start
//! or answer a request within [`REPLY_LIMIT`] (stopped, frozen, stuck in the kernel): it is
//! killed — reaped by a thread, never waited for — and the next request starts a new one;
//! after one that did not start serving (or could not be started), requests fail at once
//! for a pause (5 s, doubling up to 300 s while it keeps happening), so the runs queued
//! behind it start cold instead of each waiting out the start limit in turn.
//! A child it may have forked before it stalled never receives a spec: it sees the channel
//! close and exits.
//!
//! Known limits of any fork-based zygote (documented for operators): every child shares the
//! zygote's address-space layout (ASLR), stack-protector canary and the interpreter's
//! string-hash secret; the caller reseeds the user-space random generators it knows of.

use std::ffi::CString;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::SignalFd;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{ForkResult, Pid};

use crate::channel::CHILD_FD;
use crate::error::SandboxError;
use crate::init::{Handoff, PayloadEnd};
use crate::netns_stash::NetnsStash;

/// The zygote's control socket, as the zygote program finds it.
pub const CONTROL_FD: RawFd = 3;

/// How long a zygote may take to answer a request once it serves (a fork and a reply:
/// milliseconds). One that takes longer — stopped, frozen, stuck in the kernel — is killed
/// and replaced, and the request fails as if it had died, so its run falls back to the cold
/// path instead of every run waiting behind it.
pub const REPLY_LIMIT: Duration = Duration::from_secs(5);

/// How long dropping a zygote waits for it to die once killed.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// How long a new zygote may take to start serving (initialising an interpreter: ~15 ms
/// here, far longer under emulation), checked likewise at its first request.
pub const START_LIMIT: Duration = Duration::from_secs(30);

/// Descriptors of one request: stdin, stdout, stderr, the channel and, optionally, the
/// application channel — placed at 0, 1, 2, 3, 4 in the child.
const MIN_FDS: usize = CHILD_FD as usize + 1;
const MAX_FDS: usize = MIN_FDS + 1;

const MODE_EXEC: u8 = b'e';
const MODE_RETURN: u8 = b'r';
/// The same modes with one more descriptor after the others: a prepared network namespace
/// for the sandbox to join (placed at [`crate::init::NET_FD`] in the child).
const MODE_EXEC_NET: u8 = b'E';
const MODE_RETURN_NET: u8 = b'R';
/// As the `NET` modes, the sandbox started directly when the zygote can
/// ([`crate::init::run_direct`]): joined to the namespace and created in the others by the
/// zygote's `clone`, PID 1 of its sandbox, without a monitor. The reply says which it did.
const MODE_EXEC_DIRECT: u8 = b'x';
const MODE_RETURN_DIRECT: u8 = b'y';

/// How [`serve`] ended in this process.
pub enum Served {
    /// The zygote's control socket closed: the zygote should exit.
    Shutdown,
    /// This process is a sandbox's payload, every restriction in place
    /// ([`PayloadEnd::Return`] requests only).
    Payload(Handoff),
}

fn zerr(msg: impl Into<String>) -> SandboxError {
    SandboxError::Zygote(msg.into())
}

/// The zygote's loop, on the control socket at [`CONTROL_FD`]. Call from a single-threaded
/// process. `identity` (at most [`MAX_IDENTITY`] bytes) goes with the ready message: the
/// build the program is, which the parent checks ([`Zygote::expecting`]). Returns in the
/// zygote when its control socket closes, and in every payload process started with
/// [`PayloadEnd::Return`]; other processes of a sandbox exit inside.
pub fn serve(identity: &[u8]) -> Result<Served, SandboxError> {
    if identity.len() > MAX_IDENTITY {
        return Err(zerr(format!("identity of {} bytes (at most {MAX_IDENTITY})", identity.len())));
    }
    // SAFETY: the zygote's parent placed the control socket at CONTROL_FD; nothing else in
    // this process owns it.
    let control = unsafe { OwnedFd::from_raw_fd(CONTROL_FD) };
    nix::fcntl::fcntl(&control, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))
        .map_err(|e| zerr(format!("control socket on fd {CONTROL_FD}: {}", e.desc())))?;
    // No PR_SET_PDEATHSIG (it would follow the spawning thread, see the module doc): the
    // control socket's end of file is the parent's death.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    mask.thread_block().map_err(|e| zerr(format!("block SIGCHLD: {}", e.desc())))?;
    let sfd = SignalFd::new(&mask).map_err(|e| zerr(format!("signalfd: {}", e.desc())))?;
    let direct = Direct::prepare();
    // Serving from now on: the parent times its requests' replies from here, not from the
    // start-up.
    sendmsg::<()>(
        control.as_raw_fd(),
        &[IoSlice::new(&[REPLY_READY]), IoSlice::new(identity)],
        &[],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| zerr(format!("send ready: {}", e.desc())))?;
    loop {
        let mut fds = [PollFd::new(control.as_fd(), PollFlags::POLLIN), PollFd::new(sfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(zerr(format!("poll: {}", e.desc()))),
            Ok(_) => {}
        }
        let (request, children) = (fds[0].any().unwrap_or(true), fds[1].any().unwrap_or(false));
        if children {
            let _ = sfd.read_signal();
            reap_children();
        }
        if !request {
            continue;
        }
        let (mode, owner, received) = match receive(&control)? {
            None => return Ok(Served::Shutdown),
            Some(r) => r,
        };
        let (end, net, wants_direct) = match mode {
            MODE_EXEC => (PayloadEnd::Exec, false, false),
            MODE_RETURN => (PayloadEnd::Return, false, false),
            MODE_EXEC_NET => (PayloadEnd::Exec, true, false),
            MODE_RETURN_NET => (PayloadEnd::Return, true, false),
            MODE_EXEC_DIRECT => (PayloadEnd::Exec, true, true),
            MODE_RETURN_DIRECT => (PayloadEnd::Return, true, true),
            _ => {
                reply_error(&control, "malformed request");
                continue;
            }
        };
        if !(MIN_FDS..=MAX_FDS).contains(&received.len().saturating_sub(usize::from(net)))
            || (owner.is_some() && !wants_direct)
        {
            reply_error(&control, "malformed request");
            continue;
        }
        // Without what a direct start needs (see `Direct::prepare`), through a monitor.
        let mut received = received;
        let direct_start = match (&direct, wants_direct) {
            (Some(d), true) => Some(d.start(std::mem::take(&mut received), owner)?),
            _ => None,
        };
        if let Some(started) = direct_start {
            match started {
                DirectStart::Child(received) => {
                    // Before the descriptors are moved into their slots (the numbers these
                    // hold may become the sandbox's).
                    drop(control);
                    drop(sfd);
                    drop(direct);
                    return Ok(Served::Payload(become_direct_init(received, end)));
                }
                DirectStart::Started(child) => match pidfd_open(child) {
                    // As below: only this loop reaps, so the pidfd names the child.
                    Ok(pidfd) => reply_started(&control, started_body(child, REPLY_STARTED_INIT), &pidfd),
                    Err(e) => {
                        let _ = nix::sys::signal::kill(child, Signal::SIGKILL);
                        reply_error(&control, &format!("pidfd_open: {}", e.desc()));
                    }
                },
                DirectStart::Refused(m) => reply_error(&control, &m),
            }
            continue;
        }
        // SAFETY: this process is single-threaded (the caller's contract), so the child is a
        // complete copy of the only thread.
        match unsafe { nix::unistd::fork() } {
            Err(e) => reply_error(&control, &format!("fork: {}", e.desc())),
            Ok(ForkResult::Child) => {
                drop(control);
                drop(sfd);
                drop(direct);
                return Ok(Served::Payload(become_monitor(received, end, net)));
            }
            Ok(ForkResult::Parent { child }) => {
                drop(received);
                // The child cannot have been reaped yet (only this loop reaps), so the pidfd
                // names it.
                match pidfd_open(child) {
                    Ok(pidfd) => reply_started(&control, started_body(child, REPLY_STARTED), &pidfd),
                    Err(e) => {
                        let _ = nix::sys::signal::kill(child, Signal::SIGKILL);
                        reply_error(&control, &format!("pidfd_open: {}", e.desc()));
                    }
                }
            }
        }
    }
}

/// In the forked child: put the received descriptors in place (with `net`, the last one is
/// a prepared network namespace, placed at [`crate::init::NET_FD`]), restore a fresh
/// process's signal state, and run the monitor (see [`crate::init`]).
fn become_monitor(received: Vec<OwnedFd>, end: PayloadEnd, net: bool) -> Handoff {
    crate::process::reset_signals();
    into_slots(received, net);
    match end {
        PayloadEnd::Exec => crate::init::run_monitor(None, net),
        PayloadEnd::Return => crate::init::run_monitor_returning(net),
    }
}

/// In a forked or cloned child: the received descriptors onto 0, 1, 2, 3 (and 4) — with
/// `net`, the last one onto [`crate::init::NET_FD`] — or `_exit` (the parent then sees the
/// channel close). Every one or none: a descriptor left out would shift the others into the
/// wrong slots.
fn into_slots(received: Vec<OwnedFd>, net: bool) {
    // Moved above the target range first, then dup2'd onto the slots (dup2 clears
    // close-on-exec on the copy).
    let high: Option<Vec<OwnedFd>> = received
        .into_iter()
        .map(|fd| {
            nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10))
                .ok()
                // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor we now own.
                .map(|raw| unsafe { OwnedFd::from_raw_fd(raw) })
        })
        .collect();
    let mut high = high.unwrap_or_default();
    let netns = if net { high.pop() } else { None };
    if high.len() < MIN_FDS || net != netns.is_some() {
        // SAFETY: _exit is always sound; the parent sees the channel close.
        unsafe { libc::_exit(125) };
    }
    let slots = high.iter().enumerate().map(|(target, fd)| (target as RawFd, fd));
    for (target, fd) in slots.chain(netns.iter().map(|fd| (crate::init::NET_FD, fd))) {
        // SAFETY: dup2 onto the stdio/channel numbers; the source is open and above them.
        if unsafe { libc::dup2(fd.as_raw_fd(), target) } < 0 {
            // SAFETY: as above.
            unsafe { libc::_exit(125) };
        }
    }
}

/// What a zygote needs to start sandboxes directly ([`crate::init::run_direct`]), set up once.
struct Direct {
    /// The zygote's own network namespace, returned to after each `clone`.
    own_net: OwnedFd,
    /// The zygote's own `oom_score_adj`, opened, and its value: lowered to −1000 around each
    /// `clone` (the new init inherits the score and, where the lowering was allowed, the
    /// floor), then put back — the long-lived zygote itself stays a candidate for the OOM
    /// killer, as the agent that started it is.
    oom: Option<(std::fs::File, String)>,
}

/// How [`Direct::start`] went.
enum DirectStart {
    /// In the new process: the descriptors received for it, to go on with
    /// [`become_direct_init`] once the zygote's own descriptors are closed.
    Child(Vec<OwnedFd>),
    /// In the zygote: the sandbox's init.
    Started(Pid),
    /// Nothing was started (the reply says why); the zygote serves on.
    Refused(String),
}

impl Direct {
    /// The monitor's step 3, done once for every sandbox the zygote will start directly (their
    /// init inherits it): no supplementary groups (the OOM shield is lowered around each
    /// `clone`, [`Direct::shield`]); and the descriptors [`Direct`] holds. `None` when any of
    /// it fails: requests for a direct start are then served through a monitor, which does
    /// step 3 itself.
    fn prepare() -> Option<Direct> {
        if let Err(e) = nix::unistd::setgroups(&[]) {
            tracing::debug!(error = %e, "zygote: supplementary groups not cleared; sandboxes start through a monitor");
            return None;
        }
        let own_net = nix::fcntl::open(
            "/proc/self/ns/net",
            nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .ok()?;
        // Best effort, as in a monitor: lowering needs CAP_SYS_RESOURCE. Tried once here
        // (and put back); without it no `clone` tries again.
        let oom = std::fs::read_to_string("/proc/self/oom_score_adj").ok().and_then(|value| {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new().write(true).open("/proc/self/oom_score_adj").ok()?;
            file.write_at(b"-1000", 0).ok()?;
            Some((file, value.trim().to_string()))
        });
        let direct = Direct { own_net, oom };
        direct.unshield();
        Some(direct)
    }

    /// The OOM shield for the next `clone` (see [`Direct::oom`]). Whether it was lowered.
    fn shield(&self) -> bool {
        use std::os::unix::fs::FileExt;
        self.oom.as_ref().is_some_and(|(file, _)| file.write_at(b"-1000", 0).is_ok())
    }

    /// The zygote's own score back after a `clone` (with CAP_SYS_RESOURCE, which the
    /// lowering needed, the floor comes back with it).
    fn unshield(&self) {
        use std::os::unix::fs::FileExt;
        if let Some((file, value)) = &self.oom {
            if let Err(e) = file.write_at(value.as_bytes(), 0) {
                tracing::warn!(error = %e, "zygote: its own OOM score could not be put back");
            }
        }
    }

    /// Start a sandbox directly: `received` are its descriptors, the prepared network
    /// namespace last; with `owner`, its user namespace is that host uid's (the zygote takes
    /// it as its effective uid around the `clone`, see
    /// [`crate::namespaces::OwnerCreds`]: init then starts with that effective uid, and
    /// the parent puts it in its cgroups). In the zygote an `Err` is fatal (it could not
    /// return to its own network namespace, or to its own credentials, where every later
    /// child would start).
    fn start(&self, mut received: Vec<OwnedFd>, owner: Option<u32>) -> Result<DirectStart, SandboxError> {
        let Some(netns) = received.pop() else {
            return Ok(DirectStart::Refused("malformed request".into()));
        };
        // Init's signals blocked from its creation on, so that one sent before init waits
        // for them stays pending (PID 1 drops a signal it neither handles nor blocks).
        let before = match crate::init::init_signals().thread_swap_mask(nix::sys::signal::SigmaskHow::SIG_BLOCK) {
            Ok(b) => b,
            Err(e) => return Ok(DirectStart::Refused(format!("block signals: {}", e.desc()))),
        };
        if let Err(e) = nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET) {
            let _ = before.thread_set_mask();
            return Ok(DirectStart::Refused(format!("join the prepared network namespace: {}", e.desc())));
        }
        let euid = nix::unistd::geteuid();
        let creds = match owner.map(crate::namespaces::OwnerCreds::take).transpose() {
            Ok(c) => c,
            Err(e) => {
                if nix::unistd::geteuid() != euid {
                    // It could not even put its own uid back: it serves no more.
                    return Err(zerr(format!("cannot return to its own credentials: {e}")));
                }
                let back = nix::sched::setns(&self.own_net, nix::sched::CloneFlags::CLONE_NEWNET);
                let _ = before.thread_set_mask();
                back.map_err(|e| zerr(format!("cannot return to its own network namespace: {}", e.desc())))?;
                return Ok(DirectStart::Refused(format!("take the owner's uid: {e}")));
            }
        };
        let shielded = self.shield();
        // SAFETY: a `clone` without CLONE_VM or a new stack: like fork(2), both processes
        // return here, the child with a copy of this single-threaded process (the caller's
        // contract). The C library did not make the child, so the thread id it keeps for it
        // is this process's — stale, but the only one the child ever reads: its recursive
        // locks (the dynamic loader's) record and compare that same id, no lock is held
        // across the `clone` (single-threaded), no other thread exists to be signalled,
        // `raise` asks the kernel for the caller's id; and the child's own children, made
        // with fork(), get theirs.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_clone,
                (crate::init::DIRECT_CLONE_FLAGS | libc::SIGCHLD) as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            )
        };
        if rc == 0 {
            return Ok(DirectStart::Child(received));
        }
        let clone_err = Errno::last();
        if shielded {
            self.unshield();
        }
        if let Some(creds) = creds {
            if let Err(e) = creds.restore() {
                if rc > 0 {
                    let _ = nix::sys::signal::kill(Pid::from_raw(rc as i32), Signal::SIGKILL);
                }
                return Err(zerr(format!("cannot return to its own credentials: {e}")));
            }
        }
        let back = nix::sched::setns(&self.own_net, nix::sched::CloneFlags::CLONE_NEWNET);
        let _ = before.thread_set_mask();
        if let Err(e) = back {
            if rc > 0 {
                let _ = nix::sys::signal::kill(Pid::from_raw(rc as i32), Signal::SIGKILL);
            }
            return Err(zerr(format!("cannot return to its own network namespace: {}", e.desc())));
        }
        if rc < 0 {
            return Ok(DirectStart::Refused(format!("clone: {}", clone_err.desc())));
        }
        Ok(DirectStart::Started(Pid::from_raw(rc as i32)))
    }
}

/// In a sandbox's new process ([`Direct::start`]): put the received descriptors in place,
/// default signal dispositions (init's signals stay blocked), then the sandbox's steps as its
/// init. No parent-death signal: the zygote's death must not end its sandboxes (init watches
/// its caller through the channel instead).
fn become_direct_init(received: Vec<OwnedFd>, end: PayloadEnd) -> Handoff {
    crate::process::default_dispositions();
    if crate::init::init_signals().thread_set_mask().is_err() {
        // SAFETY: _exit is always sound; the parent sees the channel close.
        unsafe { libc::_exit(125) };
    }
    into_slots(received, false);
    match crate::init::run_direct(end) {
        Some(handoff) => handoff,
        // SAFETY: as above (exec mode returns only when it could not exec).
        None => unsafe { libc::_exit(127) },
    }
}

fn reap_children() {
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
            Err(Errno::EINTR) | Ok(_) => continue,
            Err(_) => break,
        }
    }
}

/// A request as received: its mode byte, the owner of a direct start's user namespace, its
/// descriptors.
type Request = (u8, Option<u32>, Vec<OwnedFd>);

/// One request: the mode byte, the owner of the sandbox's user namespace (a direct start's
/// leased host uid: four more bytes, little-endian) and the descriptors; `None` when the
/// socket closed. A malformed request has mode 0.
fn receive(control: &OwnedFd) -> Result<Option<Request>, SandboxError> {
    let mut byte = [0u8; 16];
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS + 1]);
    loop {
        let mut iov = [IoSliceMut::new(&mut byte)];
        match recvmsg::<()>(control.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Err(Errno::EINTR | Errno::EAGAIN) => continue,
            Err(e) => return Err(zerr(format!("receive: {}", e.desc()))),
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs().map_err(|e| zerr(format!("control message: {}", e.desc())))? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        // SAFETY: SCM_RIGHTS installed these descriptors in this process
                        // for us alone.
                        fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
                    }
                }
                let truncated = msg.flags.intersects(MsgFlags::MSG_CTRUNC | MsgFlags::MSG_TRUNC);
                if msg.bytes == 0 && fds.is_empty() {
                    return Ok(None);
                }
                let (mode, owner) = match msg.bytes {
                    _ if truncated => (0, None),
                    1 => (byte[0], None),
                    5 => (byte[0], Some(u32::from_le_bytes([byte[1], byte[2], byte[3], byte[4]]))),
                    _ => (0, None),
                };
                return Ok(Some((mode, owner, fds)));
            }
        }
    }
}

/// First byte of a reply: the sandbox's monitor started (then the pid, little-endian, and a
/// pidfd)…
const REPLY_STARTED: u8 = b'+';
/// … or the sandbox was started directly: its init (then as above) …
const REPLY_STARTED_INIT: u8 = b'#';
/// … or the request was refused (then a message).
const REPLY_REFUSED: u8 = b'!';
/// Sent once, before the first request is read: the zygote serves.
const REPLY_READY: u8 = b'*';
/// Longest identity a ready message carries (see [`serve`]).
pub const MAX_IDENTITY: usize = 256;

fn started_body(pid: Pid, tag: u8) -> [u8; 5] {
    let [a, b, c, d] = pid.as_raw().to_le_bytes();
    [tag, a, b, c, d]
}

/// What a zygote started: its pid, a pidfd for it, and whether it is the sandbox's init
/// (started directly) rather than its monitor.
#[derive(Debug)]
pub(crate) struct Started {
    pub pid: Pid,
    pub pidfd: OwnedFd,
    pub direct: bool,
}

/// A reply's meaning; `pidfd` is the descriptor that came with it, if any.
fn decode_reply(data: &[u8], pidfd: Option<OwnedFd>) -> Result<Started, Failure> {
    match (data, pidfd) {
        ([], _) => Err(Failure::Transport("the zygote exited".into())),
        ([REPLY_REFUSED, message @ ..], _) => Err(Failure::Refused(String::from_utf8_lossy(message).into_owned())),
        ([tag @ (REPLY_STARTED | REPLY_STARTED_INIT), a, b, c, d], Some(pidfd)) => Ok(Started {
            pid: Pid::from_raw(i32::from_le_bytes([*a, *b, *c, *d])),
            pidfd,
            direct: *tag == REPLY_STARTED_INIT,
        }),
        _ => Err(Failure::Transport("malformed reply".into())),
    }
}

fn reply_started(control: &OwnedFd, body: [u8; 5], pidfd: &OwnedFd) {
    let fds = [pidfd.as_raw_fd()];
    let _ = sendmsg::<()>(
        control.as_raw_fd(),
        &[IoSlice::new(&body)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    );
}

fn reply_error(control: &OwnedFd, message: &str) {
    let mut body = vec![REPLY_REFUSED];
    body.extend_from_slice(message.as_bytes());
    let _ = sendmsg::<()>(control.as_raw_fd(), &[IoSlice::new(&body)], &[], MsgFlags::MSG_NOSIGNAL, None);
}

pub(crate) fn pidfd_open(pid: Pid) -> Result<OwnedFd, Errno> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let rc = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0 as libc::c_uint) };
    if rc < 0 {
        return Err(Errno::last());
    }
    // SAFETY: a new close-on-exec descriptor (pidfds always are) that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as RawFd) })
}

pub(crate) fn pidfd_signal(pidfd: &OwnedFd, sig: Signal) {
    // SAFETY: pidfd_send_signal with no siginfo and no flags.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0 as libc::c_uint,
        )
    };
}

/// Whether the process behind `pidfd` still holds its pid (alive, or a zombie not yet
/// reaped): a `/proc/PID` opened before this says yes names that process, never one that
/// took the pid over.
pub(crate) fn pidfd_holds_pid(pidfd: &OwnedFd) -> bool {
    // SAFETY: pidfd_send_signal with signal 0 (a check only), no siginfo and no flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0 as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0 as libc::c_uint,
        )
    };
    r == 0
}

/// Wait up to `patience` for the process behind `pidfd` to exit; whether it has.
pub(crate) fn pidfd_wait(pidfd: &OwnedFd, patience: Duration) -> bool {
    let give_up = Instant::now() + patience;
    loop {
        let left = give_up.saturating_duration_since(Instant::now());
        let wait = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, wait) {
            Err(Errno::EINTR) => continue,
            Ok(0) if left.is_zero() => return false,
            Ok(0) => continue,
            // Readable: exited. An error on a valid pidfd does not happen; not waited for.
            _ => return true,
        }
    }
}

/// The parent's handle on a zygote: starts it on first use, sends it requests, restarts it
/// after it died. Safe to share between threads (requests are serialised).
pub struct Zygote {
    program: CString,
    args: Vec<CString>,
    /// What its ready message must say it is ([`Zygote::expecting`]); `None`: not checked.
    identity: Option<Vec<u8>>,
    running: Mutex<Option<Running>>,
    netns: Option<NetnsStash>,
    /// How long a new zygote may take to serve ([`START_LIMIT`]).
    start_limit: Duration,
    /// After a zygote that did not start serving (locked after `running`).
    backoff: Mutex<Backoff>,
}

/// While a zygote keeps failing to start, requests fail at once for a while — their runs
/// start cold — instead of each waiting out the start limit behind the one before it.
#[derive(Debug)]
struct Backoff {
    /// No new zygote is started before this.
    until: Option<Instant>,
    /// The next pause: [`Backoff::FIRST`]-ish, doubling up to [`Backoff::MAX`].
    next: Duration,
    first: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_secs(5);
    const MAX: Duration = Duration::from_secs(300);

    fn new(first: Duration) -> Backoff {
        Backoff { until: None, next: first, first }
    }

    /// A zygote did not start serving: pause, twice as long as last time.
    fn failed(&mut self) {
        self.until = Some(Instant::now() + self.next);
        self.next = (self.next * 2).min(Self::MAX.max(self.first));
    }

    fn served(&mut self) {
        self.until = None;
        self.next = self.first;
    }

    /// How long the pause still lasts.
    fn left(&self) -> Option<Duration> {
        self.until.map(|u| u.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero())
    }
}

struct Running {
    control: OwnedFd,
    pid: Pid,
    /// Its ready message was read.
    serving: bool,
}

impl std::fmt::Debug for Zygote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zygote").field("program", &self.program).field("netns", &self.netns).finish_non_exhaustive()
    }
}

impl Zygote {
    /// A zygote that runs `program args…` (which must call [`serve`] with the control socket
    /// at [`CONTROL_FD`]). Nothing starts until [`Zygote::start`] or the first sandbox.
    pub fn new(program: CString, args: Vec<CString>) -> Zygote {
        Zygote {
            program,
            args,
            identity: None,
            running: Mutex::new(None),
            netns: None,
            start_limit: START_LIMIT,
            backoff: Mutex::new(Backoff::new(Backoff::FIRST)),
        }
    }

    /// Serve only as the program whose ready message carries `identity` (the build it is,
    /// see [`serve`]). A zygote that says another — its program file replaced since this
    /// process started, by an upgrade — is stopped before any request, as one that did not
    /// start serving (its runs start cold), and the error names both. An identity longer
    /// than [`MAX_IDENTITY`] matches no zygote.
    pub fn expecting(mut self, identity: Vec<u8>) -> Zygote {
        self.identity = Some(identity);
        self
    }

    /// Another start limit than [`START_LIMIT`], and the first pause after a zygote that did
    /// not serve within it (5 s by default, doubling up to 300 s) — for tests.
    pub fn with_start_limit(mut self, limit: Duration, first_backoff: Duration) -> Zygote {
        self.start_limit = limit;
        self.backoff = Mutex::new(Backoff::new(first_backoff));
        self
    }

    /// Keep up to `target` fresh network namespaces ready ([`NetnsStash`]) for the sandboxes
    /// this zygote starts whose spec allows it ([`crate::SandboxSpec::can_join_prepared_net`]);
    /// the others, and any that finds the stash empty, create their own. A stash that cannot
    /// start is logged and left out (the sandboxes then create their own namespaces).
    pub fn with_netns_stash(mut self, target: usize) -> Zygote {
        if target > 0 {
            match NetnsStash::start(target) {
                Ok(stash) => self.netns = Some(stash),
                Err(e) => tracing::warn!(error = %e, "cannot start the network namespace stash"),
            }
        }
        self
    }

    /// The network namespace stash, if this zygote has one.
    pub fn netns_stash(&self) -> Option<&NetnsStash> {
        self.netns.as_ref()
    }

    /// Start the zygote now, if it is not running.
    pub fn start(&self) -> Result<(), SandboxError> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if running.is_none() {
            *running = Some(self.launch()?);
        }
        Ok(())
    }

    /// Stop the running zygote if it is the one with `pid`, without waiting for it (a thread
    /// reaps it); the next request starts a new one. For a zygote whose children fail before
    /// they can start a sandbox — never a replacement another thread has started meanwhile.
    pub fn discard(&self, pid: i32) {
        let running = {
            let mut guard = self.running.lock().unwrap_or_else(|e| e.into_inner());
            if guard.as_ref().is_some_and(|r| r.pid.as_raw() == pid) {
                guard.take()
            } else {
                None
            }
        };
        if let Some(r) = running {
            tracing::warn!(pid = r.pid.as_raw(), "zygote discarded: its sandbox process ended before it started");
            r.abandon();
        }
    }

    /// The zygote's pid while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|r| r.pid.as_raw())
    }

    /// Whether a zygote was started and its process is still alive — not a zombie, not gone
    /// (one that died is only replaced at the next request). Whether it serves is known
    /// only from a request.
    pub fn alive(&self) -> bool {
        let Some(pid) = self.pid() else { return false };
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned)))
            .is_some_and(|state| state != "Z" && state != "X")
    }

    /// How long runs still start cold without trying a zygote, after one that did not start
    /// serving (`None`: no pause).
    pub fn paused_for(&self) -> Option<Duration> {
        self.backoff.lock().unwrap_or_else(|e| e.into_inner()).left()
    }

    fn launch(&self) -> Result<Running, SandboxError> {
        use nix::spawn::{posix_spawn, PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags};
        use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
        let (control, child) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
            .map_err(|e| zerr(format!("socketpair: {}", e.desc())))?;
        let err = |e: Errno| zerr(format!("cannot start {}: {}", self.program.to_string_lossy(), e.desc()));
        let null = nix::fcntl::open(
            "/dev/null",
            nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(err)?;
        let mut actions = PosixSpawnFileActions::init().map_err(err)?;
        for target in 0..=2 {
            actions.add_dup2(null.as_raw_fd(), target).map_err(err)?;
        }
        actions.add_dup2(child.as_raw_fd(), CONTROL_FD).map_err(err)?;
        let mut attr = PosixSpawnAttr::init().map_err(err)?;
        attr.set_flags(PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF)
            .map_err(err)?;
        attr.set_sigmask(&SigSet::empty()).map_err(err)?;
        attr.set_sigdefault(&SigSet::all()).map_err(err)?;
        let mut argv = vec![self.program.clone()];
        argv.extend(self.args.iter().cloned());
        let env: [&std::ffi::CStr; 0] = [];
        let pid = posix_spawn(self.program.as_c_str(), &actions, &attr, &argv, &env).map_err(err)?;
        tracing::debug!(pid = pid.as_raw(), program = %self.program.to_string_lossy(), "zygote started");
        Ok(Running { control, pid, serving: false })
    }

    /// Ask the zygote for a sandbox monitor with `fds` at 0, 1, 2, 3 (and 4) and, when
    /// `prepared_net` allows it and the stash has one, a prepared network namespace to join —
    /// with `direct` also allowed, the zygote starts the sandbox's init directly instead
    /// ([`crate::init::run_direct`]; [`Started::direct`] says whether it did). Returns what
    /// was started and the zygote's pid. On any failure the zygote is stopped (the next
    /// request starts a new one) and [`SandboxError::Zygote`] says why.
    pub(crate) fn spawn(
        &self,
        fds: &[(OwnedFd, RawFd)],
        end: PayloadEnd,
        prepared_net: bool,
        direct: bool,
        owner: Option<u32>,
    ) -> Result<(Started, i32), SandboxError> {
        let mut guard = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let mut backoff = self.backoff.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(left) = backoff.left() {
                return Err(zerr(format!(
                    "the last zygote did not start serving; none is started for {} s more",
                    left.as_secs() + 1
                )));
            }
            match self.launch() {
                Ok(r) => *guard = Some(r),
                Err(e) => {
                    backoff.failed();
                    return Err(e);
                }
            }
        }
        let netns = self.netns.as_ref().filter(|_| prepared_net).and_then(NetnsStash::take);
        tracing::debug!(prepared_net = netns.is_some(), "zygote request");
        let running = guard.as_mut().ok_or_else(|| zerr("not running"))?;
        let ready = if running.serving {
            Ok(())
        } else {
            await_ready(&running.control, self.start_limit, self.identity.as_deref(), &self.program)
        };
        if !running.serving {
            let mut backoff = self.backoff.lock().unwrap_or_else(|e| e.into_inner());
            match &ready {
                Ok(()) => backoff.served(),
                Err(Failure::Refused(e) | Failure::Transport(e)) => {
                    backoff.failed();
                    tracing::warn!(
                        pause_s = backoff.left().map_or(0, |d| d.as_secs()),
                        error = %e,
                        "zygote did not start serving; runs start cold meanwhile"
                    );
                }
            }
        }
        running.serving = ready.is_ok();
        match ready.and_then(|()| request(&running.control, fds, end, netns.as_ref(), direct, owner)) {
            Ok(started) => Ok((started, running.pid.as_raw())),
            Err(Failure::Refused(m)) => Err(zerr(m)),
            Err(Failure::Transport(m)) => {
                if let Some(r) = guard.take() {
                    r.abandon();
                }
                Err(zerr(m))
            }
        }
    }
}

enum Failure {
    /// The zygote answered with an error (it still runs).
    Refused(String),
    /// The zygote is gone or the exchange broke.
    Transport(String),
}

fn request(
    control: &OwnedFd,
    fds: &[(OwnedFd, RawFd)],
    end: PayloadEnd,
    netns: Option<&OwnedFd>,
    direct: bool,
    owner: Option<u32>,
) -> Result<Started, Failure> {
    let mut ordered: Vec<&(OwnedFd, RawFd)> = fds.iter().collect();
    ordered.sort_by_key(|(_, t)| *t);
    if ordered.iter().enumerate().any(|(i, (_, t))| *t != i as RawFd) || !(MIN_FDS..=MAX_FDS).contains(&ordered.len()) {
        return Err(Failure::Refused("descriptors must be exactly 0..=3 or 0..=4".into()));
    }
    let mut raw: Vec<RawFd> = ordered.iter().map(|(fd, _)| fd.as_raw_fd()).collect();
    raw.extend(netns.map(|fd| fd.as_raw_fd()));
    let mode = [match (end, netns.is_some(), direct) {
        (PayloadEnd::Exec, false, _) => MODE_EXEC,
        (PayloadEnd::Return, false, _) => MODE_RETURN,
        (PayloadEnd::Exec, true, false) => MODE_EXEC_NET,
        (PayloadEnd::Return, true, false) => MODE_RETURN_NET,
        (PayloadEnd::Exec, true, true) => MODE_EXEC_DIRECT,
        (PayloadEnd::Return, true, true) => MODE_RETURN_DIRECT,
    }];
    // The owner of a direct start's user namespace follows the mode byte.
    let mut message = mode.to_vec();
    if let (true, Some(uid)) = (netns.is_some() && direct, owner) {
        message.extend_from_slice(&uid.to_le_bytes());
    }
    loop {
        match sendmsg::<()>(
            control.as_raw_fd(),
            &[IoSlice::new(&message)],
            &[ControlMessage::ScmRights(&raw)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(Failure::Transport(format!("send request: {}", e.desc()))),
            Ok(_) => break,
        }
    }
    wait_readable(control, REPLY_LIMIT, "no reply")?;
    let mut body = [0u8; 512];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    loop {
        let mut iov = [IoSliceMut::new(&mut body)];
        match recvmsg::<()>(control.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(Failure::Transport(format!("receive reply: {}", e.desc()))),
            Ok(msg) => {
                let mut pidfd = None;
                if let Ok(cmsgs) = msg.cmsgs() {
                    for c in cmsgs {
                        if let ControlMessageOwned::ScmRights(raw) = c {
                            for r in raw {
                                // SAFETY: SCM_RIGHTS installed this descriptor for us alone.
                                let fd = unsafe { OwnedFd::from_raw_fd(r) };
                                pidfd.get_or_insert(fd);
                            }
                        }
                    }
                }
                let n = msg.bytes;
                return decode_reply(&body[..n], pidfd);
            }
        }
    }
}

/// Wait until the control socket has something to read (a message, or the end of file of a
/// zygote that died), at most `limit`; `what` names the wait in the error.
fn wait_readable(control: &OwnedFd, limit: Duration, what: &str) -> Result<(), Failure> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
        match poll(&mut [PollFd::new(control.as_fd(), PollFlags::POLLIN)], wait) {
            Ok(0) if left.is_zero() => return Err(Failure::Transport(format!("{what} within {} s", limit.as_secs()))),
            Ok(0) | Err(Errno::EINTR) => continue,
            Err(e) => return Err(Failure::Transport(format!("{what}: poll: {}", e.desc()))),
            Ok(_) => return Ok(()),
        }
    }
}

/// Read a new zygote's ready message (see [`serve`]), waiting at most `limit`; it must carry
/// `identity`, when given (`program` names the zygote in the error).
fn await_ready(control: &OwnedFd, limit: Duration, identity: Option<&[u8]>, program: &CString) -> Result<(), Failure> {
    wait_readable(control, limit, "not serving")?;
    // One byte more than the longest identity: a longer message is cut (SOCK_SEQPACKET) and
    // then differs from any identity expected.
    let mut body = [0u8; 1 + MAX_IDENTITY + 1];
    loop {
        match nix::sys::socket::recv(control.as_raw_fd(), &mut body, MsgFlags::empty()) {
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(Failure::Transport(format!("receive ready: {}", e.desc()))),
            Ok(0) => return Err(Failure::Transport("the zygote exited".into())),
            Ok(_) if body[0] == REPLY_READY && identity.is_none() => return Ok(()),
            // (A message of MAX_IDENTITY + 1 bytes after the marker was cut, or too long:
            // it matches nothing.)
            Ok(n) if body[0] == REPLY_READY && n <= 1 + MAX_IDENTITY && Some(&body[1..n]) == identity => return Ok(()),
            Ok(n) if body[0] == REPLY_READY => {
                let shown = |b: &[u8]| {
                    if b.is_empty() {
                        "an older build (it names none)".to_string()
                    } else {
                        format!("build {}", String::from_utf8_lossy(b).escape_debug())
                    }
                };
                return Err(Failure::Transport(format!(
                    "the zygote {} is {}, not {}: its file was replaced (an upgrade?) since this process started; restart it",
                    program.to_string_lossy(),
                    shown(&body[1..n]),
                    shown(identity.unwrap_or_default())
                )));
            }
            Ok(_) => return Err(Failure::Transport("malformed ready message".into())),
        }
    }
}

impl Running {
    /// Close the control socket (the zygote exits) and SIGKILL it as a backstop; returns its
    /// pid, still to be reaped.
    fn kill(self) -> Pid {
        let Running { control, pid, .. } = self;
        drop(control);
        let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
        pid
    }

    /// Kill the zygote and reap it, waiting up to [`STOP_WAIT`]; one that has not died by
    /// then (frozen, stuck in the kernel) is left to a reaper thread, so dropping a zygote
    /// — at the agent's shutdown — never hangs on it.
    fn stop(self) {
        let pid = self.kill();
        let deadline = Instant::now() + STOP_WAIT;
        loop {
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Ok(WaitStatus::StillAlive) => {
                    tracing::warn!(pid = pid.as_raw(), "the zygote did not die when killed; not waiting for it");
                    let _ = std::thread::Builder::new().name("zygote-reaper".into()).spawn(move || waitpid(pid, None));
                    return;
                }
                Err(Errno::EINTR) => {}
                _ => return,
            }
        }
    }

    /// As [`Running::stop`], without waiting for the death: a zygote that stopped answering
    /// may be frozen or stuck in the kernel, where SIGKILL takes effect only when it leaves,
    /// and the caller (and every request queued behind it) must not wait for that. A thread
    /// reaps it.
    fn abandon(self) {
        let pid = self.kill();
        if let Ok(WaitStatus::StillAlive) = waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            let reaper = std::thread::Builder::new().name("zygote-reaper".into()).spawn(move || waitpid(pid, None));
            if let Err(e) = reaper {
                // Left a zombie until this process exits; nothing else is lost.
                tracing::warn!(pid = pid.as_raw(), error = %e, "cannot start a thread to reap the stopped zygote");
            }
        }
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        let running = self.running.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(r) = running {
            r.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn some_fd() -> OwnedFd {
        std::fs::File::open("/dev/null").unwrap().into()
    }

    #[test]
    fn every_pid_decodes_as_started_even_one_whose_first_byte_is_the_refusal_marker() {
        // 0x6e21 = 28193: little-endian it starts with b'!' (an untagged reply was read as
        // a refusal, and the run fell back to the cold path).
        for raw in [0x6e21, 1, 0x2b, 0x7fff_ffff, 4_194_304] {
            for tag in [REPLY_STARTED, REPLY_STARTED_INIT] {
                let started = decode_reply(&started_body(Pid::from_raw(raw), tag), Some(some_fd())).ok().unwrap();
                assert_eq!((started.pid.as_raw(), started.direct), (raw, tag == REPLY_STARTED_INIT));
            }
        }
    }

    /// A ready message serves only with the identity expected (none expected: any), and an
    /// over-long one, cut by the socket, matches nothing.
    #[test]
    fn a_ready_message_must_carry_the_identity_expected() {
        use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
        let program = CString::new("/usr/lib/opservant/opservant-runtime").unwrap();
        let ready = |message: &[u8], expected: Option<&[u8]>| {
            let (parent, zygote) =
                socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
            nix::sys::socket::send(zygote.as_raw_fd(), message, MsgFlags::empty()).unwrap();
            match await_ready(&parent, Duration::from_secs(5), expected, &program) {
                Ok(()) => Ok(()),
                Err(Failure::Refused(e) | Failure::Transport(e)) => Err(e),
            }
        };
        assert_eq!(ready(b"*0.1.0+ab", Some(b"0.1.0+ab")), Ok(()));
        assert_eq!(ready(b"*0.1.0+ab", None), Ok(()));
        assert_eq!(ready(b"*", None), Ok(()));
        let e = ready(b"*0.1.0+cd", Some(b"0.1.0+ab")).unwrap_err();
        assert!(e.contains("opservant-runtime is build 0.1.0+cd, not build 0.1.0+ab"), "{e}");
        let e = ready(b"*", Some(b"0.1.0+ab")).unwrap_err();
        assert!(e.contains("is an older build (it names none), not build 0.1.0+ab"), "{e}");
        assert!(ready(b"?0.1.0+ab", Some(b"0.1.0+ab")).unwrap_err().contains("malformed"));
        // Longer than any identity: cut to MAX_IDENTITY + 1 bytes, and refused even when
        // that much is what was expected.
        let long = [b'x'; MAX_IDENTITY + 40];
        let mut message = vec![REPLY_READY];
        message.extend_from_slice(&long);
        assert!(ready(&message, Some(&long[..MAX_IDENTITY + 1])).is_err());
        assert!(ready(&message, Some(&long)).is_err());
        let mut exact = vec![REPLY_READY];
        exact.extend_from_slice(&long[..MAX_IDENTITY]);
        assert_eq!(ready(&exact, Some(&long[..MAX_IDENTITY])), Ok(()));
    }

    /// A zygote that never serves costs one start limit; requests during the pause that
    /// follows fail at once without starting another; after the pause one is tried again.
    #[test]
    fn a_zygote_that_never_serves_is_not_retried_during_the_pause() {
        let dir = std::env::temp_dir().join(format!("opservant-zygote-backoff-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let starts = dir.join("starts");
        let script = format!("echo x >> {}; exec sleep 60", starts.display());
        let z = Zygote::new(
            CString::new("/bin/sh").unwrap(),
            vec![CString::new("-c").unwrap(), CString::new(script).unwrap()],
        )
        .with_start_limit(Duration::from_millis(300), Duration::from_secs(2));
        let fds = || (0..4).map(|i| (some_fd(), i)).collect::<Vec<_>>();
        let count = || std::fs::read_to_string(&starts).unwrap_or_default().lines().count();
        let err = z.spawn(&fds(), PayloadEnd::Exec, false, false, None).expect_err("never serves");
        assert!(err.to_string().contains("not serving"), "{err}");
        for _ in 0..3 {
            let err = z.spawn(&fds(), PayloadEnd::Exec, false, false, None).expect_err("paused");
            assert!(err.to_string().contains("none is started for"), "{err}");
        }
        assert_eq!(count(), 1, "no zygote is started during the pause");
        assert_eq!(z.pid(), None);
        assert!(!z.alive());
        assert!(z.paused_for().is_some());
        std::thread::sleep(Duration::from_millis(2100));
        let err = z.spawn(&fds(), PayloadEnd::Exec, false, false, None).expect_err("still never serves");
        assert!(err.to_string().contains("not serving"), "{err}");
        assert_eq!(count(), 2, "tried again after the pause");
        // The next pause is longer (doubled).
        let left = z.paused_for().unwrap();
        assert!(left > Duration::from_secs(2), "{left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `alive` is the process's state, not the pid on record: a zygote that died is not
    /// alive before the next request notices.
    #[test]
    fn a_dead_zygote_is_not_alive() {
        let z = Zygote::new(
            CString::new("/bin/sh").unwrap(),
            vec![CString::new("-c").unwrap(), CString::new("exit 0").unwrap()],
        );
        assert!(!z.alive(), "not started");
        z.start().unwrap();
        let pid = z.pid().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while z.alive() {
            assert!(Instant::now() < deadline, "pid {pid} still alive");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(z.pid(), Some(pid), "still on record until a request");
    }

    #[test]
    fn refusals_empty_and_malformed_replies_are_told_apart() {
        assert!(matches!(decode_reply(b"!no fork", None), Err(Failure::Refused(m)) if m == "no fork"));
        assert!(matches!(decode_reply(b"", None), Err(Failure::Transport(_))));
        assert!(matches!(
            decode_reply(&started_body(Pid::from_raw(7), REPLY_STARTED), None),
            Err(Failure::Transport(_))
        ));
        assert!(matches!(decode_reply(b"+\x01\x00\x00", Some(some_fd())), Err(Failure::Transport(_))));
    }
}
