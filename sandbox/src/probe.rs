//! What the running host offers the sandbox, for `doctor` and for operators. Probes are
//! read-only except the user-namespace check, which creates (and immediately discards) one
//! namespace in a short-lived child.

use serde::Serialize;

use crate::cgroup::{self, CgroupProbe};
use crate::landlock;
use crate::report::LandlockReport;

#[derive(Debug, Clone, Serialize)]
pub struct UserNsProbe {
    /// `user.max_user_namespaces`.
    pub max_user_namespaces: Option<u64>,
    /// Debian/Ubuntu `kernel.unprivileged_userns_clone`, when present.
    pub unprivileged_userns_clone: Option<bool>,
    /// Ubuntu AppArmor `kernel.apparmor_restrict_unprivileged_userns`, when present.
    pub apparmor_restrict_unprivileged_userns: Option<bool>,
    /// A child could create a user namespace together with all the others.
    pub can_create: Result<(), String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HostProbe {
    pub kernel: String,
    pub namespaces: Vec<(&'static str, bool)>,
    pub user_namespaces: UserNsProbe,
    pub landlock: LandlockReport,
    /// Seccomp filter mode is available.
    pub seccomp: bool,
    /// `unified` (v2 only), `hybrid` (v1 controllers plus a v2 mount), `legacy` (v1 only).
    pub cgroup_mode: String,
    pub cgroup: CgroupProbe,
    /// `mount_setattr(2)` (Linux 5.12): recursive read-only binds in one call.
    pub mount_setattr: bool,
    /// `openat2(2)` with `RESOLVE_IN_ROOT` (Linux 5.6).
    pub openat2: bool,
}

fn read_sysctl(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Can a child create user + mount + pid + net + ipc + uts + cgroup namespaces?
fn try_unshare() -> Result<(), String> {
    use nix::sys::wait::{waitpid, WaitStatus};
    use nix::unistd::{fork, ForkResult};
    let flags = nix::sched::CloneFlags::CLONE_NEWUSER
        | nix::sched::CloneFlags::CLONE_NEWNS
        | nix::sched::CloneFlags::CLONE_NEWPID
        | nix::sched::CloneFlags::CLONE_NEWNET
        | nix::sched::CloneFlags::CLONE_NEWIPC
        | nix::sched::CloneFlags::CLONE_NEWUTS
        | nix::sched::CloneFlags::CLONE_NEWCGROUP;
    // SAFETY: the child only calls unshare(2) and _exit(2), both async-signal-safe, so this
    // is sound even in a multi-threaded caller.
    match unsafe { fork() }.map_err(|e| e.to_string())? {
        ForkResult::Child => {
            let code = match nix::sched::unshare(flags) {
                Ok(()) => 0,
                Err(e) => e as i32,
            };
            // SAFETY: _exit is async-signal-safe.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, 0)) => Ok(()),
            Ok(WaitStatus::Exited(_, e)) => Err(format!("unshare: {}", nix::errno::Errno::from_raw(e).desc())),
            other => Err(format!("probe child ended unexpectedly: {other:?}")),
        },
    }
}

/// How cgroups are mounted on this host.
fn cgroup_mode() -> String {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let types: Vec<&str> =
        info.lines().filter_map(|l| l.split_once(" - ").and_then(|(_, post)| post.split(' ').next())).collect();
    let v1 = types.contains(&"cgroup");
    let v2 = types.contains(&"cgroup2");
    match (v1, v2) {
        (false, true) => "unified".into(),
        (true, true) => "hybrid".into(),
        (true, false) => "legacy".into(),
        (false, false) => "none".into(),
    }
}

fn syscall_exists(nr: libc::c_long) -> bool {
    // Calling with invalid arguments: ENOSYS means the kernel lacks the call, anything else
    // (EBADF, EFAULT, EINVAL) means it exists. No side effects with these arguments.
    // SAFETY: fd -1 and null pointers make every probed call fail before touching memory.
    let rc = unsafe { libc::syscall(nr, -1, std::ptr::null::<u8>(), 0, std::ptr::null::<u8>(), 0) };
    !(rc < 0 && nix::errno::Errno::last() == nix::errno::Errno::ENOSYS)
}

/// Whether `openat2(2)` answers in this process — a kernel before 5.6 lacks it, and a
/// seccomp filter may refuse it with `ENOSYS` (systemd's `RestrictSUIDSGID=` does: it cannot
/// see the mode in its struct). Inherited filters make this the sandboxes' answer too.
pub fn openat2_available() -> bool {
    syscall_exists(libc::SYS_openat2)
}

pub fn probe() -> HostProbe {
    let uname = nix::sys::utsname::uname().ok();
    let kernel = uname
        .map(|u| format!("{} {}", u.sysname().to_string_lossy(), u.release().to_string_lossy()))
        .unwrap_or_default();
    // SAFETY: PR_GET_SECCOMP takes no arguments.
    let seccomp_mode = unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) };
    let filter_avail = std::fs::read_to_string("/proc/sys/kernel/seccomp/actions_avail")
        .map(|s| s.split_whitespace().any(|a| a == "errno"))
        .unwrap_or(false);
    HostProbe {
        kernel,
        namespaces: crate::namespaces::available(),
        user_namespaces: UserNsProbe {
            max_user_namespaces: read_sysctl("/proc/sys/user/max_user_namespaces"),
            unprivileged_userns_clone: read_sysctl("/proc/sys/kernel/unprivileged_userns_clone").map(|v| v != 0),
            apparmor_restrict_unprivileged_userns: read_sysctl(
                "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
            )
            .map(|v| v != 0),
            can_create: try_unshare(),
        },
        landlock: landlock::probe(),
        seccomp: seccomp_mode >= 0 && filter_avail,
        cgroup_mode: cgroup_mode(),
        cgroup: cgroup::probe(),
        mount_setattr: syscall_exists(libc::SYS_mount_setattr),
        openat2: syscall_exists(libc::SYS_openat2),
    }
}

/// Whether this kernel's release is at least `major.minor` (one that cannot be read counts
/// as older).
pub fn kernel_at_least(version: (u32, u32)) -> bool {
    nix::sys::utsname::uname().is_ok_and(|u| release_at_least(&u.release().to_string_lossy(), version))
}

/// Whether a kernel release (`6.18.44-fc`, `4.18.0-553.el8_10.x86_64`) is at least
/// `major.minor`; one that does not start with both counts as older.
pub fn release_at_least(release: &str, (major, minor): (u32, u32)) -> bool {
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse::<u32>().ok());
    matches!((parts.next().flatten(), parts.next().flatten()), (Some(a), Some(b)) if (a, b) >= (major, minor))
}

#[cfg(test)]
mod release_tests {
    #[test]
    fn kernel_releases_are_compared_by_major_and_minor() {
        use super::release_at_least;
        for (release, at_least_5_8) in [
            ("6.18.44-fc-v1272", true),
            ("6.1.0-57-amd64", true),
            ("5.8.0", true),
            ("5.10.0-32-amd64", true),
            ("5.7.19", false),
            ("4.18.0-553.el8_10.x86_64", false),
            ("", false),
            ("linux", false),
            ("6", false),
        ] {
            assert_eq!(release_at_least(release, (5, 8)), at_least_5_8, "{release}");
        }
    }
}
