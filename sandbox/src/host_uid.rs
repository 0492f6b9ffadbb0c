//! A host uid per sandbox: leases out of a [`HostUids`] range.
//!
//! Some kernel allowances are counted per host uid, not per namespace: pipe buffer pages
//! (`fs.pipe-user-pages-soft`), descriptors in flight over Unix sockets (`RLIMIT_NOFILE` of
//! the sender), epoll watches. Sandboxes that share a host uid share them, so one can use
//! them up for the others. A sandbox given a [`Lease`] runs as a host uid no other sandbox
//! holds while the lease lives (the caller's [`crate::Sandbox`] holds it until every
//! process of the sandbox is gone), mapped to the identity's uid inside.
//!
//! Guarantees:
//! - A uid is leased by an open-file-description lock (`F_OFD_SETLK`) on the byte at the
//!   uid's own offset in the range's lock file, through a descriptor of the lease's own: no
//!   two leases alive at once — in this process or any other on the host using the same
//!   lock file — hold one uid. The kernel drops the lock when the last copy of the
//!   descriptor closes, so a caller that dies (even by SIGKILL) leaks no uid.
//! - The lock file is a regular file owned by root, mode 0600, opened without following a
//!   symlink, in a directory of root's no one else may write; anything else is an error,
//!   never a lease (anyone who could open it could lock uids out; anyone who could rename
//!   it could split the leases between two files).
//! - A uid is not leased while processes of an abandoned sandbox may still run as it: the
//!   caller keeps the lease with any cgroup left behind until it is removed
//!   ([`crate::cgroup::SandboxCgroup::hold_until_removed`]), and marks it beside the lock
//!   file (`abandoned-UID`, naming the cgroups, [`Lease::mark_abandoned`]), so no lease —
//!   also after the caller has exited — takes the uid while one of those cgroups exists.
//! - A range with every uid taken is an error naming the range ([`SandboxError::HostUid`]):
//!   never a fall back to a shared uid.
//!
//! What the leased uid does not cover — the files a sandbox writes where its declared paths
//! are bound — is the bind's job: the parent binds declared paths with the sandbox's user
//! namespace as their mount idmapping, so the identity's files on disk are the sandbox's
//! inside, and what it creates is the identity's on disk (see [`crate::idmap`]).

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::error::SandboxError;
use crate::spec::HostUids;

/// A host uid held for one sandbox; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct Lease {
    uid: u32,
    /// The descriptor whose open file description holds the lock.
    _lock: OwnedFd,
    /// The lock file's directory, where [`Lease::mark_abandoned`] leaves its marker.
    dir: OwnedFd,
    /// A marker was left (removed again on drop: the caller dropped its last hold only once
    /// the sandbox's cgroups were gone).
    marked: AtomicBool,
}

impl Lease {
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// Note, beside the lock file, that the sandbox holding this uid was abandoned with
    /// processes left in `cgroup` (stuck in the kernel): until that cgroup is gone no lease —
    /// of any process, after this one has exited too — takes the uid. Best effort: a marker
    /// that cannot be written is logged (the lease itself still holds the uid while this
    /// process lives).
    pub fn mark_abandoned(&self, cgroup: &Path) {
        use std::io::Write;
        let name = marker_name(self.uid);
        let written = nix::fcntl::openat(
            &self.dir,
            name.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_APPEND | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(std::io::Error::from)
        .and_then(|fd| {
            let mut line = cgroup.as_os_str().as_encoded_bytes().to_vec();
            line.push(b'\n');
            std::fs::File::from(fd).write_all(&line)
        });
        match written {
            Ok(()) => self.marked.store(true, Ordering::Relaxed),
            Err(e) => tracing::error!(uid = self.uid, error = %e, "cannot mark an abandoned sandbox's host uid"),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.marked.load(Ordering::Relaxed) {
            let _ = nix::unistd::unlinkat(
                &self.dir,
                marker_name(self.uid).as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
    }
}

fn marker_name(uid: u32) -> String {
    format!("abandoned-{uid}")
}

/// Whether an abandoned sandbox's processes may still run as `uid`: its marker names a
/// cgroup that still exists. A marker whose cgroups are all gone is removed.
fn abandoned(dir: &OwnedFd, uid: u32) -> bool {
    let name = marker_name(uid);
    let fd = match nix::fcntl::openat(
        dir,
        name.as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return false,
        // Unreadable: cannot tell, so held.
        Err(_) => return true,
    };
    let mut text = String::new();
    if std::io::Read::read_to_string(&mut std::fs::File::from(fd), &mut text).is_err() {
        return true;
    }
    if text.lines().any(|cgroup| Path::new(cgroup).exists()) {
        return true;
    }
    let _ = nix::unistd::unlinkat(dir, name.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    false
}

/// Why the lock file's directory (`d`, at `path`) is not one to lease through: anyone who
/// can write it can rename the lock file away, and leases taken on the old file and on a
/// new one would no longer exclude each other.
fn dir_refused(d: &libc::stat, path: &Path) -> Option<String> {
    (d.st_mode & libc::S_IFMT != libc::S_IFDIR || d.st_uid != 0 || d.st_mode & 0o022 != 0)
        .then(|| format!("its directory {} must be a directory of root's that no one else may write", path.display()))
}

/// Why the lock file (`st`) is not one to lease through: anyone who can open it can take a
/// lock on it (a read lock over every byte blocks every lease).
fn file_refused(st: &libc::stat) -> Option<String> {
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != 0 {
        return Some("not a regular file owned by root".into());
    }
    (st.st_mode & 0o077 != 0)
        .then(|| format!("mode {:o}: open to others, who could lock uids out (must be 0600)", st.st_mode & 0o7777))
}

/// What would make every lease of `range` fail on its lock file or directory as they are
/// now (absent ones are made at the first lease): for a report before any run (`doctor`).
pub fn lock_problem(range: &HostUids) -> Option<String> {
    let in_lock = |why: String| format!("{}: {why}", range.lock.display());
    if let Some(dir) = range.lock.parent() {
        if let Ok(d) = nix::sys::stat::lstat(dir) {
            if let Some(why) = dir_refused(&d, dir) {
                return Some(in_lock(why));
            }
        }
    }
    nix::sys::stat::lstat(&range.lock).ok().and_then(|f| file_refused(&f)).map(in_lock)
}

/// Where the next search starts, relative to the range's first uid: after the last uid
/// leased, so a uid just released is the last to be leased again; each process starts at a
/// place of its own (from its pid), so command-line runs do not all take the first uid.
static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);

/// Lease a uid of `range` that no other sandbox holds.
pub fn lease(range: &HostUids) -> Result<Lease, SandboxError> {
    let err = |what: String| SandboxError::HostUid(format!("{}: {what}", range.lock.display()));
    let (Some(dir_path), Some(file_name)) = (range.lock.parent(), range.lock.file_name()) else {
        return Err(err("not a file in a directory".into()));
    };
    if !dir_path.exists() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir_path)
            .map_err(|e| err(format!("create its directory: {e}")))?;
    }
    // The directory first, by descriptor: what is checked is where the file is opened.
    let dir = nix::fcntl::open(dir_path, OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|e| err(format!("open its directory: {}", e.desc())))?;
    let d = nix::sys::stat::fstat(&dir).map_err(|e| err(format!("stat its directory: {}", e.desc())))?;
    if let Some(why) = dir_refused(&d, dir_path) {
        return Err(err(why));
    }
    let fd = nix::fcntl::openat(
        &dir,
        file_name,
        OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(|e| err(format!("open: {}", e.desc())))?;
    let st = nix::sys::stat::fstat(&fd).map_err(|e| err(format!("stat: {}", e.desc())))?;
    if let Some(why) = file_refused(&st) {
        return Err(err(why));
    }
    let mut start = NEXT.load(Ordering::Relaxed);
    if start == u32::MAX {
        start = std::process::id().wrapping_mul(2_654_435_761);
    }
    let start = start % range.count;
    for i in 0..range.count {
        let offset = (start + i) % range.count;
        let uid = range.first + offset;
        if abandoned(&dir, uid) {
            continue;
        }
        match try_lock(&fd, uid) {
            Ok(()) => {
                NEXT.store(offset.wrapping_add(1) % range.count, Ordering::Relaxed);
                return Ok(Lease { uid, _lock: fd, dir, marked: AtomicBool::new(false) });
            }
            Err(Errno::EAGAIN | Errno::EACCES) => continue,
            Err(e) => return Err(err(format!("lock uid {uid}: {}", e.desc()))),
        }
    }
    Err(SandboxError::HostUid(format!(
        "every host uid of {}-{} is held by a running sandbox or a lock ({} at once at most: raise the range's count)",
        range.first,
        range.last(),
        range.count
    )))
}

/// Take the write lock on byte `uid` of the lock file, owned by `fd`'s open file
/// description; `EAGAIN` (or `EACCES`) when another description holds it.
fn try_lock(fd: &OwnedFd, uid: u32) -> Result<(), Errno> {
    let lock = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: libc::off_t::from(uid),
        l_len: 1,
        // Must be 0 for OFD locks.
        l_pid: 0,
    };
    // SAFETY: `fd` is open; F_OFD_SETLK reads the flock struct we own for the duration of
    // the call.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &lock as *const libc::flock) };
    if rc != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(dir: &std::path::Path, first: u32, count: u32) -> HostUids {
        HostUids { first, count, lock: dir.join("uids.lock") }
    }

    #[test]
    fn leases_are_distinct_until_released_and_a_full_range_is_an_error() {
        let dir = std::env::temp_dir().join(format!("opservant-host-uid-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r = range(&dir, 3_000_000_000, 3);
        let a = lease(&r).unwrap();
        let b = lease(&r).unwrap();
        let c = lease(&r).unwrap();
        let mut uids = [a.uid(), b.uid(), c.uid()];
        uids.sort();
        assert_eq!(uids, [3_000_000_000, 3_000_000_001, 3_000_000_002]);
        let e = lease(&r).unwrap_err().to_string();
        assert!(e.contains("every host uid of 3000000000-3000000002 is held"), "{e}");
        // A lock file others could open is refused, not used.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&r.lock, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = lease(&r).unwrap_err().to_string();
        assert!(e.contains("mode 644: open to others"), "{e}");
        // And what doctor reports before any run.
        assert!(lock_problem(&r).is_some_and(|p| p.contains("mode 644: open to others")));
        std::fs::set_permissions(&r.lock, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = lease(&r).unwrap_err().to_string();
        assert!(e.contains("no one else may write"), "{e}");
        assert!(lock_problem(&r).is_some_and(|p| p.contains("no one else may write")));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(lock_problem(&r), None);
        // An overlapping range of another configuration sees the same leases.
        let wider = range(&dir, 2_999_999_999, 3);
        let d = lease(&wider).unwrap();
        assert_eq!(d.uid(), 2_999_999_999);
        assert!(lease(&wider).is_err());
        let freed = b.uid();
        drop(b);
        assert_eq!(lease(&r).unwrap().uid(), freed);
        drop((a, c, d));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
