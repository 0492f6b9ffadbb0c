//! Landlock: filesystem rules mirroring the sandbox's view, plus IPC scoping.
//!
//! The ruleset is built by the sandbox init *before* it drops its capabilities (every path
//! handle is opened then) and enforced by the payload just before seccomp. Enforcement is
//! best-effort across ABIs, but never silent: [`LandlockReport`] lists exactly which access
//! rights and scopes the running kernel enforces and which it does not know, and the caller's
//! minimum ABI is checked first (fail closed).

/// The largest Landlock ABI a spec may require (far beyond any kernel's today: a larger
/// value is a mistake, not a future kernel).
pub const MAX_PLAUSIBLE_ABI: u32 = 64;

use std::path::{Path, PathBuf};

use landlock::{
    make_bitflags, Access, AccessFs, BitFlags, CompatLevel, Compatible, PathBeneath, Ruleset, RulesetAttr,
    RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use nix::fcntl::OFlag;

use crate::error::{Stage, StepError};
use crate::report::{LandlockReport, LandlockStatus};

/// Newest ABI whose rights we request; older kernels enforce the subset they know.
const REQUESTED_ABI: ABI = ABI::V9;

/// What a rule grants beneath its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// List directories only.
    ListDir,
    /// Execute, read files, list directories.
    ReadExec,
    /// List, read, write, truncate and ioctl on (device) files; no creation, no exec.
    Devices,
    /// Everything.
    Full,
}

impl Grant {
    fn access(self) -> BitFlags<AccessFs> {
        match self {
            Grant::ListDir => make_bitflags!(AccessFs::{ReadDir}),
            Grant::ReadExec => AccessFs::from_read(REQUESTED_ABI),
            Grant::Devices => make_bitflags!(AccessFs::{ReadDir | ReadFile | WriteFile | Truncate | IoctlDev}),
            Grant::Full => AccessFs::from_all(REQUESTED_ABI),
        }
    }
}

/// The running kernel's Landlock ABI (0 when Landlock is unavailable or disabled).
pub fn kernel_abi() -> u32 {
    // SAFETY: landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) only returns
    // the ABI version; it reads no memory.
    let v = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) };
    u32::try_from(v).unwrap_or(0)
}

/// What a rule is made on.
#[derive(Debug)]
pub enum RuleTarget {
    /// A path of the view, opened now: only paths of filesystems the sandbox's builder made
    /// (its `/proc`, `/dev`, scratch, synthetic files), which nothing outside can change.
    Named(PathBuf),
    /// A path of the view and a descriptor of what was bound there when the view was built
    /// (rules are keyed on its inode): nothing is resolved again.
    Opened(PathBuf, std::os::fd::OwnedFd),
}

impl RuleTarget {
    /// The path of the view the rule is for.
    pub fn path(&self) -> &Path {
        match self {
            RuleTarget::Named(p) | RuleTarget::Opened(p, _) => p,
        }
    }
}

/// A ruleset ready to be enforced, plus the report of what it will enforce.
pub struct Prepared {
    ruleset: RulesetCreated,
    report: LandlockReport,
}

/// Build the ruleset for `rules` (paths as seen inside the sandbox). Named paths that do not
/// exist are skipped only when `optional`. The descriptors are closed on return.
pub fn prepare(rules: Vec<(RuleTarget, Grant, bool)>, min_abi: u32) -> Result<Prepared, StepError> {
    let abi = kernel_abi();
    if abi < min_abi {
        return Err(StepError::new(
            Stage::Landlock,
            format!("kernel Landlock ABI {abi} is below the required minimum {min_abi}"),
        ));
    }
    let report = report_for(abi);
    let err = |e: landlock::RulesetError| StepError::new(Stage::Landlock, e.to_string());
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(REQUESTED_ABI))
        .map_err(err)?
        .scope(Scope::from_all(REQUESTED_ABI))
        .map_err(err)?
        .create()
        .map_err(err)?;
    for (target, grant, optional) in rules {
        let path = target.path().to_path_buf();
        let fd: std::os::fd::OwnedFd = match target {
            RuleTarget::Opened(_, fd) => fd,
            RuleTarget::Named(path) => {
                match nix::fcntl::open(&path, OFlag::O_PATH | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty()) {
                    Ok(fd) => fd,
                    Err(_) if optional && !exists(&path) => continue,
                    Err(e) => return Err(StepError::new(Stage::Landlock, format!("{}: {e}", path.display()))),
                }
            }
        };
        // A file's rule carries only the rights that apply to files: the crate would drop the
        // directory-only ones itself and call the whole ruleset partially enforced.
        let is_dir = nix::sys::stat::fstat(&fd)
            .map_err(|e| StepError::new(Stage::Landlock, format!("{}: {e}", path.display())))?
            .st_mode
            & libc::S_IFMT
            == libc::S_IFDIR;
        let access = if is_dir { grant.access() } else { grant.access() & AccessFs::from_file(REQUESTED_ABI) };
        ruleset = ruleset.add_rule(PathBeneath::new(fd, access)).map_err(err)?;
    }
    Ok(Prepared { ruleset, report })
}

fn exists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

/// What the kernel with `abi` will enforce of what we request.
fn report_for(abi: u32) -> LandlockReport {
    let kernel = ABI::from(i32::try_from(abi).unwrap_or(i32::MAX));
    let fs_req = AccessFs::from_all(REQUESTED_ABI);
    let fs_ok = if abi == 0 { BitFlags::EMPTY } else { AccessFs::from_all(kernel) & fs_req };
    let sc_req = Scope::from_all(REQUESTED_ABI);
    let sc_ok = if abi == 0 { BitFlags::EMPTY } else { Scope::from_all(kernel) & sc_req };
    let status = if abi == 0 {
        LandlockStatus::NotEnforced
    } else if fs_ok == fs_req && sc_ok == sc_req {
        LandlockStatus::FullyEnforced
    } else {
        LandlockStatus::PartiallyEnforced
    };
    LandlockReport {
        abi,
        status,
        fs_enforced: fs_ok.iter().map(fs_name).collect(),
        fs_unsupported: (fs_req & !fs_ok).iter().map(fs_name).collect(),
        scopes_enforced: sc_ok.iter().map(scope_name).collect(),
        scopes_unsupported: (sc_req & !sc_ok).iter().map(scope_name).collect(),
    }
}

/// Enforce on the calling thread. The report is cross-checked with the crate's verdict: a
/// ruleset that applied less than the kernel's ABI (measured by [`prepare`]) promises is an
/// error, never a weaker report — the minimum ABI was checked against that measurement, and
/// the crate, which asks the kernel again, can conclude otherwise (a failed query makes it
/// build an empty ruleset that "applies" nothing).
pub fn enforce(prepared: Prepared) -> Result<LandlockReport, StepError> {
    let Prepared { ruleset, report } = prepared;
    let status = ruleset.restrict_self().map_err(|e| StepError::new(Stage::Landlock, e.to_string()))?;
    let actual = match status.ruleset {
        RulesetStatus::FullyEnforced => LandlockStatus::FullyEnforced,
        RulesetStatus::PartiallyEnforced => LandlockStatus::PartiallyEnforced,
        RulesetStatus::NotEnforced => LandlockStatus::NotEnforced,
    };
    let strength = |s: LandlockStatus| match s {
        LandlockStatus::NotEnforced => 0,
        LandlockStatus::PartiallyEnforced => 1,
        LandlockStatus::FullyEnforced => 2,
    };
    if strength(actual) < strength(report.status) {
        return Err(StepError::new(
            Stage::Landlock,
            format!(
                "the ruleset was {} although the kernel's Landlock ABI {} enforces it {}",
                actual.as_str(),
                report.abi,
                report.status.as_str()
            ),
        ));
    }
    Ok(report)
}

/// What this host supports, for `doctor` and for an early parent-side check.
pub fn probe() -> LandlockReport {
    report_for(kernel_abi())
}

fn fs_name(a: AccessFs) -> String {
    let s = match a {
        AccessFs::Execute => "execute",
        AccessFs::WriteFile => "write_file",
        AccessFs::ReadFile => "read_file",
        AccessFs::ReadDir => "read_dir",
        AccessFs::RemoveDir => "remove_dir",
        AccessFs::RemoveFile => "remove_file",
        AccessFs::MakeChar => "make_char",
        AccessFs::MakeDir => "make_dir",
        AccessFs::MakeReg => "make_reg",
        AccessFs::MakeSock => "make_sock",
        AccessFs::MakeFifo => "make_fifo",
        AccessFs::MakeBlock => "make_block",
        AccessFs::MakeSym => "make_sym",
        AccessFs::Refer => "refer",
        AccessFs::Truncate => "truncate",
        AccessFs::IoctlDev => "ioctl_dev",
        AccessFs::ResolveUnix => "resolve_unix",
        _ => return format!("{a:?}").to_lowercase(),
    };
    s.to_string()
}

fn scope_name(s: Scope) -> String {
    match s {
        Scope::AbstractUnixSocket => "abstract_unix_socket".into(),
        Scope::Signal => "signal".into(),
        _ => format!("{s:?}").to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_abi2_is_partial_and_lists_missing_rights() {
        let r = report_for(2);
        assert_eq!(r.status, LandlockStatus::PartiallyEnforced);
        assert!(r.fs_enforced.contains(&"refer".to_string()));
        assert!(r.fs_unsupported.contains(&"truncate".to_string()));
        assert!(r.fs_unsupported.contains(&"ioctl_dev".to_string()));
        assert!(r.scopes_enforced.is_empty());
        assert_eq!(r.scopes_unsupported, vec!["abstract_unix_socket", "signal"]);
    }

    #[test]
    fn report_abi0_enforces_nothing() {
        let r = report_for(0);
        assert_eq!(r.status, LandlockStatus::NotEnforced);
        assert!(r.fs_enforced.is_empty());
    }

    #[test]
    fn below_the_minimum_abi_is_refused() {
        let e = prepare(vec![], 99).err().expect("ABI 99 does not exist yet");
        assert_eq!(e.stage, Stage::Landlock);
        assert!(e.message.contains("below the required minimum 99"), "{e}");
    }

    #[test]
    fn report_newest_is_full() {
        let r = report_for(9);
        assert_eq!(r.status, LandlockStatus::FullyEnforced);
        assert!(r.fs_unsupported.is_empty() && r.scopes_unsupported.is_empty());
    }
}
