//! Namespaces: creation, the single-id uid/gid maps (written by the privileged parent), the
//! UTS hostname and the loopback interface of a private network namespace.

use nix::sched::CloneFlags;

use crate::error::{SandboxError, Stage, StepError};
use crate::spec::{Identity, Namespaces};

/// `unshare(2)` flags for the selected namespaces. The PID namespace applies to children
/// created afterwards (the sandbox init).
pub fn clone_flags(ns: &Namespaces) -> CloneFlags {
    let mut f = CloneFlags::empty();
    for (on, flag) in [
        (ns.user, CloneFlags::CLONE_NEWUSER),
        (ns.mount, CloneFlags::CLONE_NEWNS),
        (ns.pid, CloneFlags::CLONE_NEWPID),
        (ns.net, CloneFlags::CLONE_NEWNET),
        (ns.ipc, CloneFlags::CLONE_NEWIPC),
        (ns.uts, CloneFlags::CLONE_NEWUTS),
        (ns.cgroup, CloneFlags::CLONE_NEWCGROUP),
    ] {
        if on {
            f |= flag;
        }
    }
    f
}

/// Create the namespaces for the calling (single-threaded) process.
pub fn unshare(ns: &Namespaces) -> Result<(), StepError> {
    nix::sched::unshare(clone_flags(ns)).map_err(|e| {
        let hint = if e == nix::errno::Errno::EPERM || e == nix::errno::Errno::ENOSPC {
            " (user namespaces disabled or exhausted? see `opservant doctor`)"
        } else {
            ""
        };
        StepError::errno(Stage::Unshare, format!("unshare{hint}"), e)
    })
}

/// Create a user namespace owned by host uid `owner`, and make it the calling process's
/// own (`setns`), with every capability in it — what `unshare(CLONE_NEWUSER)` does, except
/// for the owner: `unshare` makes the caller's effective uid (host root) the owner, and the
/// kernel charges what every process of a namespace uses of the per-user allowances kept
/// with user namespaces (inotify instances and watches, queued signals, POSIX message queue
/// bytes, locked memory, processes) to its owner at each level up — one sandbox could use
/// up host root's host-wide allowance (128 inotify instances by default) for every root
/// process of the host. Owned by the sandbox's leased uid, it charges that uid's.
///
/// The owner is the creator's effective uid, so a helper creates the namespace: for the
/// duration this process's effective uid is `owner` (its real and saved uids stay, and with
/// them its permitted capabilities; its effective set is raised again, so creating the
/// namespace never depends on unprivileged user namespaces being allowed), and the helper
/// — `clone(CLONE_VM | CLONE_VFORK | CLONE_FILES | CLONE_NEWUSER)`, which suspends this
/// process until it ends — only opens its `/proc/self/ns/user` into the shared descriptor
/// table. Then the effective uid and capabilities are restored and this process joins the
/// namespace — `setns` needs `CAP_SYS_ADMIN` over it, which it has in the initial
/// namespace. Its own uids are then those it had (host root, unmapped inside until the id
/// maps are written): only the owner changed.
///
/// Not dumpable on return, whatever `fs.suid_dumpable` says (the uid change and `setns`
/// reset the flag to it): a process of the initial namespace running as `owner` holds every
/// capability in the namespace, `CAP_SYS_PTRACE` included, and only a process that is not
/// dumpable stays out of its reach (`ptrace`, `pidfd_getfd`) — this one is host root with
/// the sandbox's channel. Its parent-death signal is cleared (by `setns`): callers set none.
/// Single-threaded callers only.
pub fn enter_user_namespace_owned_by(owner: u32) -> Result<(), StepError> {
    let ns = user_namespace_owned_by(owner)?;
    nix::sched::setns(&ns, CloneFlags::CLONE_NEWUSER)
        .map_err(|e| StepError::errno(Stage::Unshare, "setns: join the user namespace made for the sandbox", e))?;
    crate::process::not_dumpable(Stage::Unshare)
}

fn user_namespace_owned_by(owner: u32) -> Result<std::os::fd::OwnedFd, StepError> {
    let creds = OwnerCreds::take(owner)?;
    // The helper shares this memory and runs in the namespace `owner` owns.
    let made = clone_user_namespace_helper();
    // Restored whatever happened: on an error the caller ends the sandbox, and this process
    // must not go on as anyone but itself meanwhile.
    let restored = creds.restore();
    let ns = made?;
    restored?;
    // Fail closed: a namespace someone else owns would charge them (or root) again.
    match owner_uid(&ns) {
        Ok(got) if got == owner => Ok(ns),
        Ok(got) => Err(StepError::new(
            Stage::Unshare,
            format!("the user namespace made for the sandbox is owned by uid {got}, not by {owner}"),
        )),
        Err(e) => Err(StepError::io(Stage::Unshare, "read the owner of the sandbox's user namespace", e)),
    }
}

/// The kind of namespace `ns` is (`NS_GET_NSTYPE`): one `CLONE_NEW*` flag.
pub fn namespace_type(ns: std::os::fd::BorrowedFd<'_>) -> std::io::Result<CloneFlags> {
    // SAFETY: NS_GET_NSTYPE takes no argument and returns the CLONE_NEW* flag of the
    // namespace `ns` refers to (or fails: ENOTTY for any other descriptor).
    let kind = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::NS_GET_NSTYPE) };
    if kind < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(CloneFlags::from_bits_retain(kind))
}

/// The host uid that owns the user namespace `ns` (`NS_GET_OWNER_UID`, as seen from the
/// caller's own user namespace).
pub fn owner_uid(ns: impl std::os::fd::AsFd) -> std::io::Result<u32> {
    let mut owner: libc::uid_t = 0;
    // SAFETY: NS_GET_OWNER_UID writes one uid_t to the address given, which is `owner`'s;
    // any descriptor but a user namespace's fails (EINVAL, ENOTTY) without writing.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&ns.as_fd()),
            libc::NS_GET_OWNER_UID,
            &mut owner as *mut libc::uid_t,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(owner)
}

/// The effective uid of a process of host root's that creates a user namespace for `owner`
/// ([`OwnerCreds::take`]), and what [`OwnerCreds::restore`] puts back.
pub(crate) struct OwnerCreds {
    ids: nix::unistd::ResUid,
    effective: caps::CapsHashSet,
    dumpable: libc::c_int,
}

impl OwnerCreds {
    /// Take `owner` as this process's effective uid — a user namespace it creates now is
    /// `owner`'s — keeping the real and saved uids (and with them the permitted
    /// capabilities), with the effective capabilities raised again (the uid change cleared
    /// them), and not dumpable (the change set the flag to `fs.suid_dumpable`; what this
    /// process creates in the namespace starts with a copy of it). Single-threaded callers.
    pub(crate) fn take(owner: u32) -> Result<OwnerCreds, StepError> {
        use caps::CapSet;
        let ids = nix::unistd::getresuid().map_err(|e| StepError::errno(Stage::Unshare, "getresuid", e))?;
        let effective = caps::read(None, CapSet::Effective)
            .map_err(|e| StepError::new(Stage::Unshare, format!("read the effective capabilities: {e}")))?;
        // SAFETY: PR_GET_DUMPABLE takes no argument; it returns 0, 1 or 2.
        let dumpable = unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
        nix::unistd::setresuid(ids.real, nix::unistd::Uid::from_raw(owner), ids.saved).map_err(|e| {
            StepError::errno(Stage::Unshare, format!("set the effective uid to {owner}, the namespace's owner"), e)
        })?;
        let creds = OwnerCreds { ids, effective, dumpable };
        let raised = crate::process::not_dumpable(Stage::Unshare).and_then(|()| {
            caps::set(None, CapSet::Effective, &creds.effective)
                .map_err(|e| StepError::new(Stage::Unshare, format!("raise the effective capabilities again: {e}")))
        });
        match raised {
            Ok(()) => Ok(creds),
            Err(e) => {
                creds.restore()?;
                Err(e)
            }
        }
    }

    /// Back to the effective uid, the effective capabilities and the dumpable flag this
    /// process had before [`OwnerCreds::take`].
    pub(crate) fn restore(self) -> Result<(), StepError> {
        nix::unistd::setresuid(self.ids.real, self.ids.effective, self.ids.saved)
            .map_err(|e| StepError::errno(Stage::Unshare, "restore the effective uid", e))?;
        caps::set(None, caps::CapSet::Effective, &self.effective)
            .map_err(|e| StepError::new(Stage::Unshare, format!("restore the effective capabilities: {e}")))?;
        if self.dumpable == 0 || self.dumpable == 1 {
            // SAFETY: PR_SET_DUMPABLE takes an integer (0 or 1; 2 is only ever the kernel's).
            if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, self.dumpable as libc::c_ulong, 0, 0, 0) } != 0 {
                return Err(StepError::errno(Stage::Unshare, "restore the dumpable flag", nix::errno::Errno::last()));
            }
        }
        Ok(())
    }
}

/// The helper of [`user_namespace_owned_by`]: a process created in a new user namespace
/// that shares this process's memory and descriptor table and only opens its own
/// `/proc/self/ns/user` there. Returns that descriptor, once the helper has ended.
fn clone_user_namespace_helper() -> Result<std::os::fd::OwnedFd, StepError> {
    use std::os::fd::FromRawFd;
    use std::sync::atomic::{AtomicI32, Ordering};
    extern "C" fn helper(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: `arg` is the address of the `AtomicI32` below, which outlives this helper:
        // its creator is suspended until the helper ends (CLONE_VFORK).
        let slot = unsafe { &*(arg as *const AtomicI32) };
        // Only a raw system call here: this process shares its creator's memory (and so its
        // allocator's and the C library's state).
        // SAFETY: openat with a NUL-terminated path and no other pointer.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat,
                libc::AT_FDCWD,
                c"/proc/self/ns/user".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        let value = if fd < 0 { -nix::errno::Errno::last_raw() } else { fd as i32 };
        slot.store(value, Ordering::SeqCst);
        0
    }
    // i32::MIN: the helper never reported (it cannot have opened anything).
    let slot = AtomicI32::new(i32::MIN);
    let mut stack = vec![0u8; 64 * 1024];
    // The stack grows down from its (16-byte aligned) top.
    let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
    // SAFETY: the helper runs on `stack` (alive until after the helper has ended: CLONE_VFORK
    // suspends this process until then), touches only `slot` and makes one system call; the
    // caller is single-threaded, so no lock is held by a thread the helper cannot see.
    let pid = unsafe {
        libc::clone(
            helper,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_FILES | libc::CLONE_NEWUSER | libc::SIGCHLD,
            &slot as *const AtomicI32 as *mut libc::c_void,
        )
    };
    if pid < 0 {
        let e = nix::errno::Errno::last();
        let hint = if e == nix::errno::Errno::EPERM || e == nix::errno::Errno::ENOSPC {
            " (user namespaces disabled, or the owner's allowance of them exhausted? see `opservant doctor`)"
        } else {
            ""
        };
        return Err(StepError::errno(Stage::Unshare, format!("clone(CLONE_NEWUSER){hint}"), e));
    }
    loop {
        match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None) {
            Err(nix::errno::Errno::EINTR) => continue,
            // Reaped already (SIGCHLD ignored by a caller): it has ended (CLONE_VFORK), and
            // what it did is in `slot`.
            Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) | Err(nix::errno::Errno::ECHILD) => break,
            Ok(other) => {
                return Err(StepError::new(Stage::Unshare, format!("the user namespace helper ended with {other:?}")))
            }
            Err(e) => return Err(StepError::errno(Stage::Unshare, "wait for the user namespace helper", e)),
        }
    }
    drop(stack);
    match slot.load(Ordering::SeqCst) {
        fd if fd >= 0 => {
            // SAFETY: the helper opened `fd` in the descriptor table this process shares with
            // it, and nothing else knows of it.
            Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
        }
        i32::MIN => Err(StepError::new(Stage::Unshare, "the user namespace helper never reported")),
        e => Err(StepError::errno(Stage::Unshare, "open the new user namespace", nix::errno::Errno::from_raw(-e))),
    }
}

/// Join a network namespace made beforehand ([`crate::netns_stash`]) instead of creating one;
/// `setns` checks that `ns` is a network namespace. Call before unsharing the user namespace
/// (joining needs `CAP_SYS_ADMIN` over the namespace's owner). The descriptor is closed.
pub fn join_prepared_net(ns: std::os::fd::OwnedFd) -> Result<(), StepError> {
    nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET)
        .map_err(|e| StepError::errno(Stage::Unshare, "setns: join the prepared network namespace", e))
}

/// Parent side: write the single-id maps of the user namespace of `pid`, whose `/proc/PID`
/// directory `proc_dir` is (opened by the caller so that it names that process). `setgroups`
/// is denied first, so the payload can never drop into a supplementary group it was not
/// given.
pub fn write_id_maps(proc_dir: &std::os::fd::OwnedFd, pid: i32, id: &Identity) -> Result<(), SandboxError> {
    use std::io::Write;
    let w = |what: &'static str, content: String| {
        let fd = nix::fcntl::openat(
            proc_dir,
            what,
            nix::fcntl::OFlag::O_WRONLY | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| SandboxError::IdMap { what, pid, source: e.into() })?;
        std::fs::File::from(fd).write_all(content.as_bytes()).map_err(|source| SandboxError::IdMap {
            what,
            pid,
            source,
        })
    };
    w("setgroups", "deny".into())?;
    w("uid_map", format!("{} {} 1\n", id.inside_uid, id.host_uid))?;
    w("gid_map", format!("{} {} 1\n", id.inside_gid, id.host_gid))?;
    Ok(())
}

pub fn set_hostname(name: &str) -> Result<(), StepError> {
    nix::unistd::sethostname(name).map_err(|e| StepError::errno(Stage::Hostname, "sethostname", e))
}

/// Bring `lo` up in the (private) network namespace of the caller.
pub fn loopback_up() -> Result<(), StepError> {
    let err = |what: &str, e| StepError::errno(Stage::Loopback, what, e);
    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| err("socket", e))?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    use std::os::fd::AsRawFd;
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) < 0 {
            return Err(err("SIOCGIFFLAGS lo", nix::errno::Errno::last()));
        }
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr) < 0 {
            return Err(err("SIOCSIFFLAGS lo", nix::errno::Errno::last()));
        }
    }
    Ok(())
}

/// Namespace types this kernel offers (`/proc/self/ns/*`), for `doctor`.
pub fn available() -> Vec<(&'static str, bool)> {
    [
        ("user", "user"),
        ("mount", "mnt"),
        ("pid", "pid"),
        ("net", "net"),
        ("ipc", "ipc"),
        ("uts", "uts"),
        ("cgroup", "cgroup"),
        ("time", "time"),
    ]
    .into_iter()
    .map(|(name, file)| (name, std::path::Path::new("/proc/self/ns").join(file).exists()))
    .collect()
}

/// Per-user-namespace limits of `/proc/sys/user` the sandbox's init writes for its own user
/// namespace before it drops its capabilities (`CAP_SYS_RESOURCE` there is what allows the
/// write; the files show the opener's user namespace, whichever procfs they are read
/// through). The kernel charges every count of these to the namespace's owner at each level
/// up — the leased host uid ([`enter_user_namespace_owned_by`]), or host root, whose
/// host-wide limits (128 inotify instances) one sandbox could otherwise take whole — but it
/// also checks the namespace's own limit first, so these bound one sandbox. `max_user_namespaces` is 0: the seccomp profile refuses namespace creation
/// anyway; this makes a nested user namespace (the one every other kind needs without
/// privileges) fail without it. A value out of a sysctl's range fails its write (these
/// handlers never accept and ignore one), so the writes are not read back (~3 µs each).
/// Written through `proc`, the old root's procfs held for the sandbox's set-up (the view's
/// `/proc` is read-only).
pub fn limit_ucounts(
    proc: &crate::mounts::SetupProc,
    inotify_instances: u32,
    inotify_watches: u32,
) -> Result<(), StepError> {
    let fail = |what: &str, e: nix::errno::Errno| StepError::errno(Stage::Ucounts, what.to_string(), e);
    // Never the host's: in the initial user namespace these files are the host's limits.
    let map = proc.read("self/uid_map").map_err(|e| fail("read uid_map", e))?;
    if map.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"] {
        return Err(StepError::new(
            Stage::Ucounts,
            "not in a user namespace of its own; refusing to write host limits",
        ));
    }
    let (instances, watches) = (inotify_instances.to_string(), inotify_watches.to_string());
    for (name, value) in
        [("max_inotify_instances", instances.as_str()), ("max_inotify_watches", &watches), ("max_user_namespaces", "0")]
    {
        let path = format!("sys/user/{name}");
        proc.write(&path, value).map_err(|e| fail(&format!("write /proc/{path}"), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prepared_namespace_that_is_not_a_network_namespace_is_refused() {
        // What a monitor handed a wrong descriptor at NET_FD gets: an error (the sandbox
        // fails), never a sandbox left in the namespace it started in.
        let file: std::os::fd::OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let err = join_prepared_net(file).unwrap_err();
        assert!(err.to_string().contains("prepared network namespace"), "{err}");
        let user_ns: std::os::fd::OwnedFd = std::fs::File::open("/proc/self/ns/user").unwrap().into();
        assert!(join_prepared_net(user_ns).is_err(), "a user namespace is not a network namespace");
    }
}
