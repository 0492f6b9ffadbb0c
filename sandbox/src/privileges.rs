//! Identity and privileges: switching to the sandbox identity, dropping every capability,
//! locking the securebits, `no_new_privs`.
//!
//! Guarantee: after [`drop_all`] the calling thread has empty effective, permitted,
//! inheritable, ambient and bounding sets (verified against `/proc/self/status`, i.e. against
//! what the kernel holds, not what we asked for), securebits that forbid regaining any
//! capability through uid 0 or ambient raising (locked), and `no_new_privs` set.

use crate::error::{Stage, StepError};

const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
const SECBIT_KEEP_CAPS_LOCKED: libc::c_ulong = 1 << 5;
const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;

fn prctl(op: libc::c_int, a: libc::c_ulong) -> Result<(), nix::errno::Errno> {
    // SAFETY: the prctl operations used here take integer arguments only.
    let rc = unsafe { libc::prctl(op, a, 0 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong) };
    if rc < 0 {
        Err(nix::errno::Errno::last())
    } else {
        Ok(())
    }
}

/// Become `uid:gid` (ids inside the user namespace) while keeping the capabilities this
/// thread has in its namespace, so that the view can still be built — and files created
/// while building it belong to a mapped id.
pub fn switch_identity(uid: u32, gid: u32) -> Result<(), StepError> {
    prctl(libc::PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP)
        .map_err(|e| StepError::errno(Stage::Identity, "securebits", e))?;
    let g = nix::unistd::Gid::from_raw(gid);
    let u = nix::unistd::Uid::from_raw(uid);
    nix::unistd::setresgid(g, g, g).map_err(|e| StepError::errno(Stage::Identity, format!("setresgid {gid}"), e))?;
    nix::unistd::setresuid(u, u, u).map_err(|e| StepError::errno(Stage::Identity, format!("setresuid {uid}"), e))?;
    let r = nix::unistd::getresuid().map_err(|e| StepError::errno(Stage::Identity, "getresuid", e))?;
    if [r.real, r.effective, r.saved].iter().any(|x| x.as_raw() != uid) {
        return Err(StepError::new(Stage::Identity, "uid did not change"));
    }
    Ok(())
}

/// Highest capability number the kernel knows.
fn cap_last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(63)
}

/// Drop everything: bounding, ambient, then lock the securebits, then the base sets; set
/// `no_new_privs`; verify.
pub fn drop_all() -> Result<(), StepError> {
    let err = |what: &str, e| StepError::errno(Stage::Capabilities, what, e);
    for cap in 0..=cap_last_cap() {
        match prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap)) {
            Ok(()) | Err(nix::errno::Errno::EINVAL) => {}
            Err(e) => return Err(err(&format!("drop bounding capability {cap}"), e)),
        }
    }
    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL takes no pointer arguments.
    let rc = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0, 0, 0) };
    if rc < 0 {
        return Err(err("clear ambient capabilities", nix::errno::Errno::last()));
    }
    let bits = SECBIT_NOROOT
        | SECBIT_NOROOT_LOCKED
        | SECBIT_NO_SETUID_FIXUP
        | SECBIT_NO_SETUID_FIXUP_LOCKED
        | SECBIT_KEEP_CAPS_LOCKED
        | SECBIT_NO_CAP_AMBIENT_RAISE
        | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
    prctl(libc::PR_SET_SECUREBITS, bits).map_err(|e| err("lock securebits", e))?;
    for set in [caps::CapSet::Inheritable, caps::CapSet::Effective, caps::CapSet::Permitted] {
        caps::clear(None, set).map_err(|e| StepError::new(Stage::Capabilities, format!("clear {set:?}: {e}")))?;
    }
    set_no_new_privs()?;
    if !all_dropped() {
        return Err(StepError::new(Stage::Capabilities, "capabilities remain after dropping (see /proc/self/status)"));
    }
    Ok(())
}

pub fn set_no_new_privs() -> Result<(), StepError> {
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1).map_err(|e| StepError::errno(Stage::Capabilities, "no_new_privs", e))
}

pub fn no_new_privs() -> bool {
    // SAFETY: PR_GET_NO_NEW_PRIVS takes no arguments.
    unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1 }
}

/// All five capability sets of this thread are empty, per the kernel.
pub fn all_dropped() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/thread-self/status") else { return false };
    let mut seen = 0;
    for line in status.lines() {
        for key in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"] {
            if let Some(v) = line.strip_prefix(key) {
                seen += 1;
                if u64::from_str_radix(v.trim(), 16) != Ok(0) {
                    return false;
                }
            }
        }
    }
    seen == 5
}
