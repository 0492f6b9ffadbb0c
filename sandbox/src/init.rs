//! The inside of a sandbox, step by step. This file is the one place that lists the order of
//! the isolation steps; each step lives in its own module.
//!
//! Three processes, all of this binary, none multi-threaded:
//!
//! ```text
//! monitor  (re-exec'd or forked by the parent; host root until step 4)
//!   1. close every inherited fd but stdio, the channel (and a prepared network namespace);
//!      a session of its own, so a terminal's signals (Ctrl-C, hangup) reach only its caller,
//!      which stops the sandbox and cleans up (see [`crate::parent::stop_all`]); default
//!      dispositions for the termination signals
//!   2. read the spec
//!   3. shield itself (and so init) from the OOM killer where allowed; clear supplementary groups
//!   4. join the prepared network namespace if one was handed over (a zygote's stash, see
//!      [`crate::netns_stash`]); with a host uid range, receive the uid leased for the
//!      sandbox and create the user namespace owned by it, then join it
//!      ([`crate::namespaces::enter_user_namespace_owned_by`]: the monitor's own uid stays
//!      root); unshare user (unless made so), mount, pid, net (unless joined), ipc, uts —
//!      meanwhile the parent creates the cgroups and then names the files to join them by
//!   5. "unshared" → parent writes the uid/gid maps (to a host uid leased for this sandbox
//!      when the spec has a range, [`crate::host_uid`]), then makes the declared paths
//!      detached mounts idmapped through this user namespace and sends them
//!      ([`crate::idmap`]), wires the namespaces → "proceed"
//!   6. fork the init (PID 1 of the new PID namespace) with init's signals blocked, so that a
//!      stop sent while init builds the sandbox stays pending (PID 1 drops a signal it
//!      neither handles nor blocks); report its host pid; close its own stdio (only sandbox
//!      processes hold the output pipes)
//!   7. wait for init; kill it if the parent goes away; report the tree's resource usage,
//!      then exit (the monitor is outside the sandbox cgroup, so the parent can remove the
//!      cgroups while the monitor's exit tears the namespaces down — except a zygote
//!      sandbox's mount namespace, which its parent holds and releases in the background)
//! init     (PID 1)
//!   1. die with the monitor
//!   2. join the sandbox cgroups (still host uid 0, so the cgroupfs permission check
//!      passes), then unshare the cgroup namespace, which is thereby rooted there
//!   3. become the sandbox uid/gid, keeping capabilities in the user namespace; arm the
//!      parent-death signal again (the id change cleared it) and check the monitor lives
//!   4. build the filesystem view and pivot_root into it, attaching the parent's prepared
//!      mounts where declared paths go; its /proc is read-only, and the old root's /proc is
//!      kept as a descriptor for the two writes below                  (mounts)
//!   5. hostname, loopback (a prepared namespace's is already up); the user namespace's
//!      own limits: inotify instances and watches, no nested namespaces (namespaces,
//!      through the old root's /proc)
//!   6. open every Landlock path handle, build the ruleset         (landlock)
//!   7. drop every capability, lock securebits, no_new_privs       (privileges)
//!   8. end here if a stop or a termination signal is pending (the payload never starts);
//!      fork the payload; reap every process; forward SIGTERM to all, SIGKILL all on request;
//!      when the payload ends, kill and reap every other process; report the payload's end;
//!      close its stdio (the output pipes reach end of file) and report the tree's resource
//!      usage — the outcome is complete, init and the monitor only exit from here
//! payload
//!   1. default signals, new session, OOM score to the maximum (first victim) through the
//!      old root's /proc, then closed; rlimits
//!   2. enforce Landlock                                            (landlock)
//!   3. close every fd but stdio and the channel; verify the channel is close-on-exec
//!   4. install seccomp — last                                      (seccomp)
//!   5. report what is enforced
//!   6. held (a warm pool's sandbox, `command.held`): wait for the go on fd 4, then close it
//!      unless it is the application channel
//!   7. execve (with the application channel, if any, as fd 4)
//! ```
//!
//! A zygote with a prepared network namespace starts its sandboxes *directly*
//! ([`run_direct`]): it joins the namespace, creates the process with `clone` in new user,
//! mount, PID, IPC and UTS namespaces — so that the process is PID 1 of its sandbox from the
//! start — and returns to its own network namespace. That process runs the monitor's steps
//! 1, 2 and 5 (the zygote did 3 once for itself — no supplementary groups, the OOM shield
//! where allowed — and 4 and 6 with the `clone`; init's signals are blocked from its
//! creation on) and then init's steps as init, with one difference: there is no monitor to
//! die with or to watch the caller, so init watches the caller through the channel itself
//! (at its step 3, and from step 8 on: a caller gone gets every process killed) — the
//! zygote is only init's parent, and a zygote that dies takes none of its sandboxes with
//! it. Init's report of the tree's usage (step 8) is the sandbox's last word. One fork of
//! the zygote's interpreter and one process exit per sandbox fewer. With a leased host uid
//! the zygote takes it as its effective uid around the `clone`, so that the user namespace
//! is that uid's ([`crate::namespaces::OwnerCreds`]); init then runs as that uid on the host
//! from its start, so the cgroup files are closed to it: the parent opens them and sends
//! the descriptors with "cgroups", and init's step 2 writes "0" through them (on kernels
//! before 5.16, which check the writer's credentials rather than the opener's, the parent
//! writes init's pid itself, paying the global lock's RCU grace period per hierarchy that
//! a process moving itself through a v1 `tasks` file skips); init hands its namespaces
//! over with "unshared" as a monitor does.
//!
//! Every step either succeeds or reports a [`StepError`] over the channel and the sandbox is
//! torn down; nothing continues past a failed step. The monitor/init/payload functions only
//! need a single-threaded caller and the channel, so a zygote runs exactly these steps after
//! `fork` ([`crate::zygote`]). The one difference is the payload's last step: with
//! [`PayloadEnd::Return`] it does not `execve` but returns to its caller (an interpreter
//! that was initialised before the fork) after every restriction above is in place, the
//! environment is the spec's and the control channel is closed.

use std::os::fd::{AsFd, FromRawFd};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::SignalFd;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};

use crate::channel::{Channel, FromSandbox, ToSandbox, APP_FD, CHILD_FD, GO};
use crate::error::{Stage, StepError};
use crate::landlock::{self, Grant, RuleTarget};
use crate::report::{EnforcementReport, ExitInfo, SeccompReport};
use crate::spec::{Access, Namespaces, SandboxSpec, SeccompPolicy};
use crate::{mounts, namespaces, privileges, process, seccomp};

/// Where a monitor started with a prepared network namespace finds it (a zygote places it
/// there, see [`crate::zygote`]); the monitor joins it and closes it before unsharing.
pub(crate) const NET_FD: std::os::fd::RawFd = APP_FD + 1;

/// The namespaces a zygote creates for a sandbox it starts directly ([`run_direct`]), in one
/// `clone` (the network namespace is the prepared one it joined first; the cgroup namespace
/// is init's, after it joined the cgroups).
pub(crate) const DIRECT_CLONE_FLAGS: libc::c_int =
    libc::CLONE_NEWUSER | libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;

/// Whether a zygote may start a sandbox of `spec` directly: it asks for exactly the
/// namespaces [`DIRECT_CLONE_FLAGS`] creates, and a prepared network namespace. With a
/// leased host uid, the zygote takes it as its effective uid around the `clone`, so that
/// the user namespace is that uid's ([`crate::namespaces::OwnerCreds`]).
pub(crate) fn direct_fits(spec: &SandboxSpec) -> bool {
    let ns = &spec.namespaces;
    ns.user && ns.mount && ns.pid && ns.ipc && ns.uts && spec.can_join_prepared_net()
}

/// Entry point of the re-exec'd sandbox init (`opservant __sandbox-init`): the channel is
/// fd 3. Call before anything else in `main` — no threads may exist.
pub fn main() -> ! {
    run_monitor(None, false)
}

/// What the payload process does once every restriction is in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadEnd {
    /// `execve` the spec's program.
    Exec,
    /// Return to the caller (a zygote child whose interpreter was initialised before the
    /// fork): the caller's code is then the payload.
    Return,
}

/// What a payload process started with [`PayloadEnd::Return`] receives: every restriction
/// is in place, the control channel is closed, the environment is the spec's.
#[derive(Debug)]
pub struct Handoff {
    /// The application channel (fd 4), if the spec asks for one.
    pub app: Option<Channel>,
    /// The spec's environment (already installed as the process environment).
    pub env: Vec<(String, String)>,
}

/// Run the monitor with the channel on fd 3; `spec` is given when the monitor was forked
/// (it is otherwise read from the channel); `prepared_net`: a network namespace to join is
/// at [`NET_FD`]. Never returns.
pub(crate) fn run_monitor(spec: Option<&SandboxSpec>, prepared_net: bool) -> ! {
    // Exec mode only returns from the payload process if `execve` was skipped, which
    // `payload_steps` never does in this mode; exit rather than run anything else.
    let _ = run_monitor_until(spec, PayloadEnd::Exec, prepared_net);
    exit(127)
}

/// Like [`run_monitor`], but with [`PayloadEnd::Return`]: returns only in the payload
/// process, with every restriction in place and the control channel closed; every other
/// process of the sandbox exits here.
pub(crate) fn run_monitor_returning(prepared_net: bool) -> Handoff {
    match run_monitor_until(None, PayloadEnd::Return, prepared_net) {
        Some(h) => h,
        None => exit(127),
    }
}

/// A sandbox a zygote started directly, in its namespaces already and PID 1 of its PID
/// namespace (see the module documentation): the channel is on fd 3, init's signals
/// blocked. Returns only in the payload process, with
/// [`PayloadEnd::Return`]; every other process of the sandbox exits here.
pub(crate) fn run_direct(end: PayloadEnd) -> Option<Handoff> {
    // SAFETY: the zygote placed the channel at CHILD_FD and nothing else in this process
    // owns that descriptor.
    let chan = match unsafe { Channel::from_raw(CHILD_FD) } {
        Ok(c) => c,
        // Without close-on-exec the payload would inherit the channel: refuse to go on.
        Err(_) => exit(125),
    };
    match direct_until(&chan, end) {
        Ok(InitEnd::Exit(code)) => exit(code),
        Ok(InitEnd::Payload(handoff)) => {
            // As in `run_monitor_until`: the payload's own code must not hold the channel.
            drop(chan);
            Some(handoff)
        }
        Err(e) => {
            let _ = chan.send(&FromSandbox::Failed(e));
            exit(1)
        }
    }
}

/// The monitor's steps a sandbox started directly still takes, then init's (see the module
/// documentation).
fn direct_until(chan: &Channel, end: PayloadEnd) -> Result<InitEnd, StepError> {
    // 1. (the zygote put stdio, the channel and the application channel in place and reset
    // the signal dispositions; init's signals stay blocked)
    process::close_fds_from(APP_FD + 1)?;
    nix::unistd::setsid().map_err(|e| StepError::errno(Stage::Fork, "setsid", e))?;
    // 2.
    let spec = match chan.recv::<ToSandbox>().map_err(protocol)? {
        Some(ToSandbox::Spec(s)) => s,
        other => return Err(protocol(format!("expected the spec, got {other:?}"))),
    };
    spec.validate().map_err(|e| protocol(e.to_string()))?;
    if !direct_fits(&spec) {
        return Err(protocol("a sandbox started directly by a zygote for a spec that asks for other namespaces"));
    }
    let app = app_channel(&spec)?;
    // 4. (created by the zygote's `clone`)
    // 5.
    let handshake = unshared_handshake(chan, spec.host_uids.is_some())?;
    // 6. (this process is init; init's signals have been blocked since the `clone`)
    init(chan, app, &spec, handshake, end, true, None)
}

fn run_monitor_until(spec: Option<&SandboxSpec>, end: PayloadEnd, prepared_net: bool) -> Option<Handoff> {
    // SAFETY: the parent placed the channel at CHILD_FD and nothing else in this process
    // owns that descriptor.
    let chan = match unsafe { Channel::from_raw(CHILD_FD) } {
        Ok(c) => c,
        // Without close-on-exec the payload would inherit the channel: refuse to go on.
        Err(_) => exit(125),
    };
    match monitor_until(&chan, spec, end, prepared_net) {
        Ok(None) => exit(0),
        Ok(Some(handoff)) => {
            // The payload's own code must not hold the control channel (it could forge the
            // sandbox's reports): it is closed here, before the caller runs anything.
            drop(chan);
            Some(handoff)
        }
        Err(e) => {
            let _ = chan.send(&FromSandbox::Failed(e));
            exit(1)
        }
    }
}

fn exit(code: i32) -> ! {
    // SAFETY: _exit skips atexit handlers and stdio flushing, which a forked sandbox process
    // must not run twice.
    unsafe { libc::_exit(code) }
}

fn protocol(msg: impl Into<String>) -> StepError {
    StepError::new(Stage::Protocol, msg)
}

/// The monitor (see the module documentation for the steps), ending in `execve`.
pub fn monitor(chan: &Channel, given: Option<&SandboxSpec>) -> Result<(), StepError> {
    monitor_until(chan, given, PayloadEnd::Exec, false).map(drop)
}

/// The monitor; `Ok(Some(_))` is returned only in the payload process, with
/// [`PayloadEnd::Return`].
fn monitor_until(
    chan: &Channel,
    given: Option<&SandboxSpec>,
    end: PayloadEnd,
    prepared_net: bool,
) -> Result<Option<Handoff>, StepError> {
    // 1. (fd 4 may be the application channel; decided once the spec is in)
    process::close_fds_from(if prepared_net { NET_FD + 1 } else { APP_FD + 1 })?;
    nix::unistd::setsid().map_err(|e| StepError::errno(Stage::Fork, "setsid", e))?;
    // A forked monitor inherits its caller's handlers (a command-line caller handles these
    // to stop its sandboxes); the monitor's are the defaults.
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        // SAFETY: installing SIG_DFL is always sound.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
    // 2.
    let received;
    let spec = match given {
        Some(s) => s,
        None => match chan.recv::<ToSandbox>().map_err(protocol)? {
            Some(ToSandbox::Spec(s)) => {
                received = s;
                &*received
            }
            other => return Err(protocol(format!("expected the spec, got {other:?}"))),
        },
    };
    spec.validate().map_err(|e| protocol(e.to_string()))?;
    let app = app_channel(spec)?;
    if prepared_net && !spec.can_join_prepared_net() {
        return Err(protocol("a prepared network namespace was handed over for a spec that cannot use one"));
    }
    // 3.
    // Best effort: lowering needs CAP_SYS_RESOURCE, which some hosts withhold even from
    // root. The payload raises its own score to the maximum below, so it is the OOM killer's
    // first victim either way.
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
    nix::unistd::setgroups(&[]).map_err(|e| StepError::errno(Stage::Groups, "setgroups", e))?;
    // 4.
    if prepared_net {
        // SAFETY: the zygote placed the prepared namespace at NET_FD (step 1 kept it open);
        // nothing else in this process owns that descriptor.
        namespaces::join_prepared_net(unsafe { std::os::fd::OwnedFd::from_raw_fd(NET_FD) })?;
    }
    let mut rest = Namespaces { cgroup: false, net: spec.namespaces.net && !prepared_net, ..spec.namespaces };
    if spec.host_uids.is_some() {
        // A leased host uid owns the user namespace (its allowances, not root's, pay for the
        // sandbox's use of them).
        let uid = match chan.recv::<ToSandbox>().map_err(protocol)? {
            Some(ToSandbox::Owner { uid }) => uid,
            None => return Err(protocol("parent went away")),
            other => return Err(protocol(format!("expected the owner, got {other:?}"))),
        };
        namespaces::enter_user_namespace_owned_by(uid)?;
        rest.user = false;
    }
    namespaces::unshare(&rest)?;
    // 5.
    let mut handshake = Some(unshared_handshake(chan, spec.host_uids.is_some())?);
    // 6.
    // Block SIGCHLD before forking so its arrival is seen through the signalfd; and init's
    // signals, so that init starts with them blocked: PID 1 of a namespace ignores a signal
    // it has no handler for unless the signal is blocked, and a stop or a timeout sent while
    // init builds the sandbox must wait for init's step 8, not be dropped.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    let mut before = init_signals()
        .thread_swap_mask(nix::sys::signal::SigmaskHow::SIG_BLOCK)
        .map_err(|e| StepError::errno(Stage::Fork, "block signals", e))?;
    let sfd = SignalFd::new(&mask).map_err(|e| StepError::errno(Stage::Fork, "signalfd", e))?;
    // The monitor's liveness, for init: only the monitor holds the write end, so the read end
    // hangs up when it is gone (see init's step 3).
    let (alive_r, alive_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| StepError::errno(Stage::Fork, "pipe", e))?;
    // SAFETY: the monitor is single-threaded (a fresh exec, or forked from a single-threaded
    // caller).
    let init_pid = match unsafe { fork() }.map_err(|e| StepError::errno(Stage::Fork, "fork init", e))? {
        ForkResult::Child => {
            drop(sfd);
            drop(alive_w);
            let handshake = handshake.take().ok_or_else(|| protocol("the handshake was taken"))?;
            match init(chan, app, spec, handshake, end, prepared_net, Some(alive_r)) {
                Ok(InitEnd::Exit(code)) => exit(code),
                Ok(InitEnd::Payload(handoff)) => return Ok(Some(handoff)),
                Err(e) => {
                    let _ = chan.send(&FromSandbox::Failed(e));
                    exit(126)
                }
            }
        }
        ForkResult::Parent { child } => {
            // The monitor's own mask again, with SIGCHLD blocked.
            before.add(Signal::SIGCHLD);
            before.thread_set_mask().map_err(|e| StepError::errno(Stage::Fork, "restore the signal mask", e))?;
            // Only init and the payload hold the application channel (and init the
            // prepared binds).
            drop(app);
            drop(handshake.take());
            drop(alive_r);
            child
        }
    };
    // Held to the monitor's end (never written).
    let _alive = alive_w;
    for fd in 0..=2 {
        // SAFETY: the monitor never uses its stdio again; closing lets the output pipes reach
        // end-of-file as soon as the sandbox's own processes are gone. Before the report below:
        // once init may have ended, no copy of the pipes is left outside the sandbox (the
        // parent takes one still open then as held by another process).
        unsafe { libc::close(fd) };
    }
    // With a pidfd of init, opened while init cannot have been reaped (only this process
    // reaps it), so that it names init: the parent signals init through it, and ends the
    // sandbox when none comes. One the parent opened itself would need init's `/proc/PID`
    // to tell init from a process that took its pid.
    let pidfd = crate::zygote::pidfd_open(init_pid).ok();
    let fds: Vec<std::os::fd::RawFd> = pidfd.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
    chan.send_with_fds(&FromSandbox::InitForked { pid: init_pid.as_raw() }, &fds)
        .map_err(|e| StepError::errno(Stage::Protocol, "send", e))?;
    drop(pidfd);
    // 7.
    let (ru, status) = wait_for_init(chan, &sfd, init_pid)?;
    let tv_ms = |t: libc::timeval| (t.tv_sec.max(0) as u64) * 1000 + (t.tv_usec.max(0) as u64) / 1000;
    let _ = chan.send(&FromSandbox::InitExited {
        cpu_ms: tv_ms(ru.ru_utime) + tv_ms(ru.ru_stime),
        peak_rss_bytes: ru.ru_maxrss.max(0) as u64 * 1024,
        init_exit: ExitInfo::from_wait_status(status),
    });
    Ok(None)
}

/// The application channel at fd 4 when the spec asks for one; otherwise fd 4 is closed.
fn app_channel(spec: &SandboxSpec) -> Result<Option<Channel>, StepError> {
    if spec.command.uses_app_fd() {
        // SAFETY: the caller (the parent, or a zygote) placed the application channel at
        // APP_FD; nothing else in this process owns it.
        let app = unsafe { Channel::from_raw(APP_FD) };
        return app.map(Some).map_err(|e| StepError::errno(Stage::Protocol, "app channel", e));
    }
    // SAFETY: fd 4 is unused in this sandbox (nothing here owns it); EBADF when it was never
    // open is harmless.
    unsafe { libc::close(APP_FD) };
    Ok(None)
}

/// What step 5 brings from the parent.
struct Handshake {
    /// The cgroup files to join.
    join: Vec<std::path::PathBuf>,
    /// Or descriptors of them the parent opened, for an init that cannot open them (a
    /// sandbox started directly with a leased owner runs as that uid from its start).
    join_fds: Vec<std::os::fd::OwnedFd>,
    /// Detached mounts of declared paths the parent prepared ([`crate::idmap`]), by index
    /// into `filesystem.paths`.
    binds: Vec<(usize, std::os::fd::OwnedFd)>,
}

/// Step 5 once the namespaces exist: the cgroups to join arrive, "unshared" goes out (the
/// parent writes the id maps, prepares declared paths and wires the namespaces), the
/// prepared paths and "proceed" come back. With `hand_over` the message carries this
/// process's user, mount and network namespaces ([`crate::channel::UNSHARED_NAMESPACES`]):
/// in a user namespace a leased uid owns this process is not dumpable (see
/// [`crate::namespaces::enter_user_namespace_owned_by`]), and without `CAP_SYS_PTRACE` (the
/// shipped unit withholds it) the parent cannot open them through `/proc/PID/ns`.
fn unshared_handshake(chan: &Channel, hand_over: bool) -> Result<Handshake, StepError> {
    let (join, join_fds) = match chan.recv_with_fds::<ToSandbox>().map_err(protocol)? {
        Some((ToSandbox::Cgroups { join }, fds)) => (join, fds),
        None => return Err(protocol("parent went away")),
        Some((other, _)) => return Err(protocol(format!("expected the cgroups, got {other:?}"))),
    };
    let mut namespaces = Vec::new();
    if hand_over {
        for name in crate::channel::UNSHARED_NAMESPACES {
            let fd = nix::fcntl::open(
                format!("/proc/self/ns/{name}").as_str(),
                nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            )
            .map_err(|e| StepError::errno(Stage::Unshare, format!("open /proc/self/ns/{name}"), e))?;
            namespaces.push(fd);
        }
    }
    let fds: Vec<std::os::fd::RawFd> = namespaces.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
    chan.send_with_fds(&FromSandbox::Unshared, &fds).map_err(|e| StepError::errno(Stage::Protocol, "send", e))?;
    drop(namespaces);
    let mut binds = Vec::new();
    loop {
        match chan.recv_with_fds::<ToSandbox>().map_err(protocol)? {
            Some((ToSandbox::Proceed, fds)) if fds.is_empty() => return Ok(Handshake { join, join_fds, binds }),
            Some((ToSandbox::Binds { paths }, fds)) if fds.len() == paths.len() => {
                binds.extend(paths.into_iter().zip(fds));
            }
            None => return Err(protocol("parent went away")),
            Some((other, fds)) => {
                return Err(protocol(format!(
                    "expected binds or proceed, got {other:?} with {} descriptors",
                    fds.len()
                )))
            }
        }
    }
}

/// CPU time (ms) and peak resident memory (bytes) of this process and of every child it has
/// reaped — what `wait4` reports of it to its parent once it exits.
fn tree_usage() -> (u64, u64) {
    let usage = |who| {
        // SAFETY: rusage is plain old data; all-zero is valid, and getrusage only writes it.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::getrusage(who, &mut ru) };
        ru
    };
    let (own, children) = (usage(libc::RUSAGE_SELF), usage(libc::RUSAGE_CHILDREN));
    let ms = |t: libc::timeval| (t.tv_sec.max(0) as u64) * 1000 + (t.tv_usec.max(0) as u64) / 1000;
    let cpu = ms(own.ru_utime) + ms(own.ru_stime) + ms(children.ru_utime) + ms(children.ru_stime);
    (cpu, own.ru_maxrss.max(children.ru_maxrss).max(0) as u64 * 1024)
}

/// How `init` returns: as init (its exit code), or in the payload process (return mode).
enum InitEnd {
    Exit(i32),
    Payload(Handoff),
}

/// Wait for init to end and return the resource usage of the tree (init waited for every
/// process of the namespace) and init's wait status; if the parent goes away (channel
/// readable or hung up), kill it.
fn wait_for_init(chan: &Channel, sfd: &SignalFd, init: Pid) -> Result<(libc::rusage, i32), StepError> {
    loop {
        // SAFETY: rusage is plain old data; all-zero is valid.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        let mut status = 0;
        // SAFETY: wait4 writes into the status and rusage we own.
        match unsafe { libc::wait4(init.as_raw(), &mut status, libc::WNOHANG, &mut ru) } {
            0 => {}
            pid if pid == init.as_raw() => return Ok((ru, status)),
            _ => match nix::errno::Errno::last() {
                nix::errno::Errno::EINTR => continue,
                e => return Err(StepError::errno(Stage::Fork, "wait for init", e)),
            },
        }
        let mut fds = [PollFd::new(sfd.as_fd(), PollFlags::POLLIN), PollFd::new(chan.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(StepError::errno(Stage::Fork, "poll", e)),
            Ok(_) => {}
        }
        if fds[0].any().unwrap_or(false) {
            let _ = sfd.read_signal();
        }
        if fds[1].any().unwrap_or(false) {
            // The parent never writes after "proceed": readable means it is gone.
            let _ = kill(init, Signal::SIGKILL);
        }
    }
}

/// SIGKILL this process when its parent (thread) dies.
fn die_with_parent() -> Result<(), StepError> {
    // SAFETY: PR_SET_PDEATHSIG takes an integer signal number.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(StepError::errno(Stage::Fork, "prctl(PR_SET_PDEATHSIG)", nix::errno::Errno::last()));
    }
    Ok(())
}

/// The sandbox init, PID 1 of the new PID namespace. Returns its exit code.
fn init(
    chan: &Channel,
    app: Option<Channel>,
    spec: &SandboxSpec,
    handshake: Handshake,
    end: PayloadEnd,
    prepared_net: bool,
    // The read end of a pipe only the monitor writes to: readable or hung up once the monitor
    // is gone. `None` for a sandbox started directly, which has no monitor: init then
    // watches its caller through the channel itself (step 3 and from step 8 on).
    monitor_alive: Option<std::os::fd::OwnedFd>,
) -> Result<InitEnd, StepError> {
    // 1.
    if monitor_alive.is_some() {
        die_with_parent()?;
    }
    // 2.
    let Handshake { join: cgroup_join, join_fds, binds } = handshake;
    for file in &cgroup_join {
        // Writing "0" to a v1 `tasks` file moves this (single-threaded) process without the
        // global threadgroup lock (see `cgroup::SandboxCgroup::join_files`).
        std::fs::write(file, "0").map_err(|e| StepError::io(Stage::Cgroup, format!("join {}", file.display()), e))?;
    }
    // The same through the parent's descriptors (each closed here: written through, such a
    // descriptor moves any process of the sandbox with host root's credentials).
    for fd in join_fds {
        let written = nix::unistd::write(&fd, b"0");
        if written != Ok(1) {
            let e = written.err().unwrap_or(nix::errno::Errno::EIO);
            return Err(StepError::errno(
                Stage::Cgroup,
                "join the sandbox's cgroups through the parent's descriptors",
                e,
            ));
        }
    }
    if spec.namespaces.cgroup {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWCGROUP)
            .map_err(|e| StepError::errno(Stage::Unshare, "unshare cgroup namespace", e))?;
    }
    // 3.
    privileges::switch_identity(spec.identity.inside_uid, spec.identity.inside_gid)?;
    // Non-dumpable whatever `fs.suid_dumpable` says (the id change applied it): init's /proc
    // files then belong to unmapped root, so no process of the sandbox (same uid) can reach
    // its descriptors — the old root's /proc among them until the payload is forked.
    process::not_dumpable(Stage::Identity)?;
    // Changing the effective ids cleared the parent-death signal (`commit_creds`): armed
    // again, then the monitor checked — had it died in between, nothing would kill init.
    let direct = monitor_alive.is_none();
    match monitor_alive {
        Some(monitor_alive) => {
            die_with_parent()?;
            let mut alive = [PollFd::new(monitor_alive.as_fd(), PollFlags::POLLIN)];
            if poll(&mut alive, PollTimeout::ZERO).map_err(|e| StepError::errno(Stage::Fork, "poll", e))? > 0 {
                return Err(StepError::new(Stage::Fork, "the monitor has gone"));
            }
        }
        // The caller sends nothing after "proceed": a readable channel means it is gone.
        None if caller_gone(chan) => return Err(protocol("the caller has gone")),
        None => {}
    }
    // 4. The view keeps a descriptor per bound path until Landlock's rules are made (step
    // 6): the soft descriptor limit raised to the hard one for it (the payload gets its own
    // limits in its steps), so that a long list of declared paths does not run out.
    if let Ok((_, hard)) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard);
    }
    let mut view =
        mounts::build(&spec.filesystem, spec.namespaces.net, &spec.command.cwd, binds, spec.host_uids.is_some())?;
    // 5.
    if spec.namespaces.uts {
        namespaces::set_hostname(&spec.hostname)?;
    }
    if spec.namespaces.net && !prepared_net {
        namespaces::loopback_up()?;
    }
    if spec.namespaces.user {
        namespaces::limit_ucounts(&view.setup_proc, spec.limits.inotify_instances, spec.limits.inotify_watches)?;
    }
    // 6.
    let bound = (std::mem::take(&mut view.system_bound), std::mem::take(&mut view.declared_bound));
    let ruleset = landlock::prepare(landlock_rules(spec, bound.0, bound.1), spec.landlock.min_abi)?;
    // 7.
    privileges::drop_all()?;
    // 8.
    // Blocked since the fork (see the monitor's step 6): one that came meanwhile is pending.
    let handled = init_signals();
    if let Some(sig) = pending_stop(&handled) {
        // Stopped or timed out while the sandbox was being built: the payload never starts.
        return Ok(InitEnd::Exit(128 + sig as i32));
    }
    // Without a monitor nothing killed init if its caller went during steps 4-7 (one of
    // them blocked on a hung mount, say): checked again before the payload exists.
    if direct && caller_gone(chan) {
        return Err(protocol("the caller has gone"));
    }
    // Made before the payload exists (close-on-exec; the payload closes its copy at its step
    // 3): without it init could not watch its caller, which a sandbox without a monitor
    // depends on — fail before anything of the payload runs.
    let signals = SignalFd::with_flags(&handled, nix::sys::signalfd::SfdFlags::SFD_CLOEXEC)
        .map_err(|e| StepError::errno(Stage::Fork, "signalfd", e))?;
    // SAFETY: init is single-threaded (forked from the single-threaded monitor).
    let payload_pid = match unsafe { fork() }.map_err(|e| StepError::errno(Stage::Fork, "fork payload", e))? {
        ForkResult::Child => {
            // Init's alone: the payload closes its copy with every other descriptor (step 3),
            // so the number must not be closed again when the payload returns (return mode)
            // through this frame — it may name another descriptor by then.
            std::mem::forget(signals);
            let err = match payload_steps(chan, app, spec, ruleset, view, end, prepared_net) {
                Ok(Ok(handoff)) => return Ok(InitEnd::Payload(handoff)),
                Ok(Err(e)) | Err(e) => e,
            };
            let _ = chan.send(&FromSandbox::Failed(err));
            exit(127)
        }
        ForkResult::Parent { child } => {
            // The payload owns its copies of the ruleset, of the application channel and of
            // the set-up procfs.
            drop(ruleset);
            drop(app);
            drop(view);
            child
        }
    };
    let status = reap_until(payload_pid, &signals, chan);
    // Said before the rest is killed and reaped: a process stuck in the kernel would hold
    // that wait, and the parent bounds it from here (its backstop, then abandon).
    let _ = chan.send(&FromSandbox::PayloadEnded(status));
    kill_and_reap_all();
    // Every other process is reaped: once init lets go of the output pipes they reach end of
    // file, and the run's outcome is complete before init and the monitor have exited.
    for fd in 0..=2 {
        // SAFETY: init never uses its stdio again.
        unsafe { libc::close(fd) };
    }
    let _ = chan.send(&FromSandbox::PayloadExited(status));
    let (cpu_ms, peak_rss_bytes) = tree_usage();
    let _ = chan.send(&FromSandbox::TreeUsage { cpu_ms, peak_rss_bytes });
    Ok(InitEnd::Exit(status.shell_code()))
}

/// Sent by the parent to the sandbox init: SIGKILL every process of the sandbox now.
pub const KILL_ALL: Signal = Signal::SIGUSR1;

/// The signals init waits for at its step 8 (blocked from its fork on).
pub(crate) fn init_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGCHLD, Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGQUIT, KILL_ALL] {
        set.add(s);
    }
    set
}

/// A termination signal or [`KILL_ALL`] among `handled` that is pending already.
fn pending_stop(handled: &SigSet) -> Option<Signal> {
    // SAFETY: sigset_t is plain old data; sigpending fills the one we own.
    let mut pending: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; sigpending only writes into `pending`.
    if unsafe { libc::sigpending(&mut pending) } != 0 {
        return None;
    }
    // SAFETY: `pending` was filled by sigpending, so it is an initialised signal set.
    let pending = unsafe { SigSet::from_sigset_t_unchecked(pending) };
    handled.iter().find(|&s| s != Signal::SIGCHLD && pending.contains(s))
}

/// SIGKILL every other process of the PID namespace and reap all of them. Reaping them
/// here, rather than letting the kernel do it when PID 1 exits, is what keeps their CPU
/// time in the sandbox's accounting (the kernel autoreaps them then).
fn kill_and_reap_all() {
    // kill(-1) from PID 1 reaches every other process of the namespace.
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::__WALL)) {
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// Whether the caller has gone: the channel is readable (it sends nothing after "proceed",
/// so that is its end of file) without waiting.
fn caller_gone(chan: &Channel) -> bool {
    let mut pfd = [PollFd::new(chan.as_fd(), PollFlags::POLLIN)];
    poll(&mut pfd, PollTimeout::ZERO).is_ok_and(|n| n > 0)
}

/// Reap every child; forward termination signals to the whole namespace; on [`KILL_ALL`]
/// kill everything. When the payload ends, return its status (nothing else may outlive it:
/// the caller kills and reaps the rest). Should the caller go away meanwhile (the
/// channel readable: it sends nothing after "proceed"), everything is killed too — what
/// the monitor does for a sandbox that has one, and the only watch over a sandbox a zygote
/// started directly, whose init outlives the zygote.
fn reap_until(payload: Pid, signals: &SignalFd, chan: &Channel) -> ExitInfo {
    let mut watching = true;
    let status = loop {
        let mut fds = [PollFd::new(signals.as_fd(), PollFlags::POLLIN), PollFd::new(chan.as_fd(), PollFlags::POLLIN)];
        let watched = if watching { &mut fds[..] } else { &mut fds[..1] };
        if poll(watched, PollTimeout::NONE).is_err() {
            continue;
        }
        if watching && fds[1].any().unwrap_or(false) {
            // Once: a hung-up channel stays readable, and what was killed is reaped below.
            watching = false;
            let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
        }
        if !fds[0].any().unwrap_or(false) {
            continue;
        }
        let sig = match signals.read_signal() {
            Ok(Some(info)) => match Signal::try_from(info.ssi_signo as i32) {
                Ok(s) => s,
                Err(_) => continue,
            },
            _ => continue,
        };
        match sig {
            Signal::SIGCHLD => {
                let mut found = None;
                loop {
                    match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                        Ok(WaitStatus::Exited(pid, code)) if pid == payload => {
                            found = Some(ExitInfo { code: Some(code), signal: None })
                        }
                        Ok(WaitStatus::Signaled(pid, s, _)) if pid == payload => {
                            found = Some(ExitInfo { code: None, signal: Some(s as i32) })
                        }
                        Ok(WaitStatus::StillAlive) | Err(_) => break,
                        Ok(_) => continue,
                    }
                }
                if let Some(s) = found {
                    break s;
                }
            }
            s if s == KILL_ALL => {
                let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
            }
            other => {
                // kill(-1) from PID 1 reaches every other process of the namespace.
                let _ = kill(Pid::from_raw(-1), other);
            }
        }
    };
    status
}

/// Landlock rules mirroring the view built by `mounts`.
/// Landlock's rules for the view: on what was bound at each system and declared path
/// (`system_bound`, `declared_bound`: [`mounts::ViewReport`]), and by name on what the
/// builder made itself.
fn landlock_rules(
    spec: &SandboxSpec,
    system_bound: Vec<(std::path::PathBuf, std::os::fd::OwnedFd)>,
    mut declared: Vec<(std::path::PathBuf, std::os::fd::OwnedFd)>,
) -> Vec<(RuleTarget, Grant, bool)> {
    // Listing any directory of the view is harmless: the view itself is an allowlist.
    let mut rules = vec![(RuleTarget::Named("/".into()), Grant::ListDir, false)];
    for (p, bound) in system_bound {
        rules.push((RuleTarget::Opened(p, bound), Grant::ReadExec, false));
    }
    for r in &spec.filesystem.paths {
        let grant = match r.access {
            Access::Read => Grant::ReadExec,
            Access::ReadWrite => Grant::Full,
        };
        // What was bound at the path, or (a writable path under `/tmp`) made in the scratch.
        let target = match declared.iter().position(|(p, _)| p == &r.path) {
            Some(i) => {
                let (p, bound) = declared.swap_remove(i);
                RuleTarget::Opened(p, bound)
            }
            None => RuleTarget::Named(r.path.clone()),
        };
        rules.push((target, grant, r.optional));
    }
    for s in &spec.filesystem.synthetic {
        rules.push((RuleTarget::Named(s.path.clone()), Grant::ReadExec, false));
    }
    for (p, g) in [
        ("/proc", Grant::ReadExec),
        ("/sys", Grant::ReadExec),
        // Only the five harmless devices exist in /dev (read-only tmpfs).
        ("/dev", Grant::Devices),
        ("/dev/shm", Grant::Full),
        ("/tmp", Grant::Full),
    ] {
        rules.push((RuleTarget::Named(p.into()), g, false));
    }
    rules
}

/// A held payload waits for the go on its hold channel; any other message, or the caller
/// going away, ends it before anything runs. Returns the hold channel (the application
/// channel, when the spec asks for one; dropping it closes it).
fn await_go(hold: Option<Channel>) -> Result<Channel, StepError> {
    let chan = hold.ok_or_else(|| StepError::new(Stage::Protocol, "held, but no hold channel"))?;
    match chan.recv_bytes(64) {
        Ok(Some(m)) if m == GO => Ok(chan),
        Ok(Some(_)) => Err(StepError::new(Stage::Protocol, "held: expected the go")),
        Ok(None) => Err(StepError::new(Stage::Protocol, "held: the caller went away before the go")),
        Err(e) => Err(StepError::new(Stage::Protocol, format!("held: {e}"))),
    }
}

/// The payload: final restrictions, then `execve` — which only returns the error that
/// stopped it, `Ok(Err(_))` — or, with [`PayloadEnd::Return`], `Ok(Ok(handoff))`.
fn payload_steps(
    chan: &Channel,
    app: Option<Channel>,
    spec: &SandboxSpec,
    ruleset: landlock::Prepared,
    view: mounts::ViewReport,
    end: PayloadEnd,
    prepared_net: bool,
) -> Result<Result<Handoff, StepError>, StepError> {
    // 1.
    process::reset_signals();
    nix::unistd::setsid().map_err(|e| StepError::errno(Stage::Exec, "setsid", e))?;
    // After the identity switch the process is non-dumpable, so its /proc files belong to
    // (unmapped) root. It becomes dumpable at execve anyway; ptrace and core dumps stay
    // impossible (seccomp, RLIMIT_CORE 0).
    // SAFETY: PR_SET_DUMPABLE takes an integer.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1 as libc::c_ulong, 0, 0, 0) };
    // Through the old root's /proc (the view's is read-only), closed right after.
    let mounts::ViewReport { sysfs, setup_proc, .. } = view;
    setup_proc.write("self/oom_score_adj", "1000").map_err(|e| StepError::errno(Stage::Rlimits, "oom_score_adj", e))?;
    drop(setup_proc);
    process::set_rlimits(spec.limits.nofile, spec.limits.sigpending)?;
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    let path_var = spec.command.env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str());
    let program = match end {
        PayloadEnd::Exec => Some(process::find_program(&spec.command.program, path_var)?),
        PayloadEnd::Return => {
            process::replace_environment(&spec.command.env)?;
            None
        }
    };
    // 2.
    let landlock = landlock::enforce(ruleset)?;
    // 3.
    process::close_fds_from(if app.is_some() { APP_FD + 1 } else { CHILD_FD + 1 })?;
    if !chan.is_cloexec() || app.as_ref().is_some_and(|a| !a.is_cloexec()) {
        return Err(StepError::new(Stage::Exec, "a sandbox channel is not close-on-exec; refusing to go on"));
    }
    // 4.
    let filters = seccomp::install(&spec.seccomp)?;
    // 5.
    let report = EnforcementReport {
        namespaces: spec.namespaces.enabled().into_iter().map(String::from).collect(),
        landlock,
        seccomp: match &spec.seccomp {
            SeccompPolicy::Disabled => SeccompReport { status: "disabled".into(), profile: None, filters: 0 },
            SeccompPolicy::Enforced { profile, .. } => {
                SeccompReport { status: "enforced".into(), profile: Some(profile.clone()), filters }
            }
        },
        // Verified by init (`privileges::drop_all`); fork copies credentials exactly.
        capabilities_dropped: true,
        no_new_privs: privileges::no_new_privs(),
        sysfs: sysfs.to_string(),
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        net_prepared: prepared_net,
    };
    chan.send(&FromSandbox::Started(Box::new(report))).map_err(|e| StepError::errno(Stage::Protocol, "send", e))?;
    // 6. (held: a warm pool's sandbox; every restriction is in place, nothing of the work
    // has been handed over yet)
    let app = match (spec.command.held, app) {
        (true, hold) => spec.command.app_channel.then_some(await_go(hold)?),
        (false, app) => app,
    };
    let Some(program) = program else {
        // Return mode: the caller closes the control channel before running anything else.
        return Ok(Ok(Handoff { app, env: spec.command.env.clone() }));
    };
    if let Some(app) = app {
        // The program inherits the application channel (and only it: the control channel is
        // close-on-exec, so the program cannot forge the sandbox's reports).
        app.set_inheritable().map_err(|e| StepError::errno(Stage::Exec, "app channel", e))?;
        std::mem::forget(app);
    }
    // 7.
    Ok(Err(process::exec(&program, &spec.command.program, &spec.command.args, &spec.command.env)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The view's /proc and /sys are read-only mounts; Landlock's rules for them are
    /// read-only as well (a second wall where the mounts are the first: a test that writes
    /// there sees the mount's EROFS, not Landlock's EACCES, so this one checks the rules).
    #[test]
    fn landlock_grants_only_reading_proc_and_sys() {
        let ids = crate::spec::Identity { host_uid: 65534, host_gid: 65534, inside_uid: 65534, inside_gid: 65534 };
        let spec = SandboxSpec::new("/bin/true", vec![], ids);
        let rules = landlock_rules(&spec, vec![], vec![]);
        for path in ["/proc", "/sys"] {
            let grants: Vec<Grant> =
                rules.iter().filter(|(p, _, _)| p.path() == std::path::Path::new(path)).map(|(_, g, _)| *g).collect();
            assert_eq!(grants, [Grant::ReadExec], "{path}");
        }
    }
}
