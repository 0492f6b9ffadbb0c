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
/// up — host root, whose host-wide limits (128 inotify instances) one sandbox could
/// otherwise take whole — but it also checks the namespace's own limit first, so these bound
/// one sandbox. `max_user_namespaces` is 0: the seccomp profile refuses namespace creation
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
