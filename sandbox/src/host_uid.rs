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
//! - A uid is not leased while processes of an earlier sandbox may still run as it, even
//!   after the process that leased it for that sandbox has ended (abandoned it stuck in the
//!   kernel and exited, or was killed outright): every lease writes, before it is handed
//!   out, a marker beside the lock file (`cgroups-UID`) naming the cgroups its sandbox's
//!   processes are in, removed when the lease is dropped — by the caller, which keeps a
//!   lease with any cgroup left behind until that cgroup is removed
//!   ([`crate::cgroup::SandboxCgroup::hold_until_removed`]). A uid whose lock is free but
//!   whose marker remains is leased again only once none of the cgroups it names holds a
//!   process; a marker that cannot be written is an error, never a lease.
//! - A range with every uid taken is an error naming the range ([`SandboxError::HostUid`]):
//!   never a fall back to a shared uid.
//!
//! What the leased uid does not cover — the files a sandbox writes where its declared paths
//! are bound — is the bind's job: the parent binds declared paths with the sandbox's user
//! namespace as their mount idmapping, so the identity's files on disk are the sandbox's
//! inside, and what it creates is the identity's on disk (see [`crate::idmap`]).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

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
    /// The lock file's directory, where the lease's marker is.
    dir: OwnedFd,
}

impl Lease {
    pub fn uid(&self) -> u32 {
        self.uid
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Before the lock goes with `_lock` (dropped after this body): no other lease takes
        // the uid and writes its own marker in between.
        if let Err(e) =
            nix::unistd::unlinkat(&self.dir, marker_name(self.uid).as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir)
        {
            // Left, it only holds the uid back until a lease finds its cgroups empty.
            tracing::warn!(uid = self.uid, error = %e, "cannot remove a host uid's marker");
        }
    }
}

fn marker_name(uid: u32) -> String {
    format!("cgroups-{uid}")
}

/// The marker an earlier version left only for a sandbox it abandoned (same content): read
/// by the same rule, so an upgrade does not lease such a sandbox's uid.
fn legacy_marker_name(uid: u32) -> String {
    format!("abandoned-{uid}")
}

/// Write the marker of a lease of `uid`: the cgroups its sandbox's processes are in, one
/// path per line.
fn write_marker(dir: &OwnedFd, uid: u32, cgroups: &[&Path]) -> std::io::Result<()> {
    use std::io::Write;
    let fd = nix::fcntl::openat(
        dir,
        marker_name(uid).as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::from_bits_truncate(0o600),
    )?;
    let mut text = Vec::new();
    for cgroup in cgroups {
        text.extend_from_slice(cgroup.as_os_str().as_encoded_bytes());
        text.push(b'\n');
    }
    std::fs::File::from(fd).write_all(&text)
}

/// Whether processes of an earlier lease of `uid` may still run as it — its marker is there
/// (its holder ended without removing it) and names a cgroup that still holds a process, or
/// names none (a sandbox without cgroups: nothing tells when its processes are gone, so the
/// uid stays held until the marker is removed, at the latest at reboot). A marker whose
/// cgroups hold none is removed. Called with the uid's lock held.
fn marked_in_use(dir: &OwnedFd, uid: u32) -> bool {
    marker_in_use(dir, &marker_name(uid)) || marker_in_use(dir, &legacy_marker_name(uid))
}

fn marker_in_use(dir: &OwnedFd, name: &str) -> bool {
    let fd = match nix::fcntl::openat(dir, name, OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW, Mode::empty())
    {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return false,
        // Unreadable: cannot tell, so in use.
        Err(_) => return true,
    };
    let mut text = Vec::new();
    if std::io::Read::read_to_end(&mut std::fs::File::from(fd), &mut text).is_err() {
        return true;
    }
    let mut cgroups = text.split(|b| *b == b'\n').filter(|l| !l.is_empty()).peekable();
    if cgroups.peek().is_none() {
        return true;
    }
    let in_use = cgroups.any(|line| cgroup_holds_processes(Path::new(std::ffi::OsStr::from_bytes(line))));
    if !in_use {
        let _ = nix::unistd::unlinkat(dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
    in_use
}

/// Whether the cgroup directory `cgroup` may hold a process: it exists, and lists a process
/// or has a cgroup beneath it (or cannot be read).
fn cgroup_holds_processes(cgroup: &Path) -> bool {
    match std::fs::read(cgroup.join("cgroup.procs")) {
        Ok(procs) if procs.iter().all(u8::is_ascii_whitespace) => {}
        Ok(_) => return true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !cgroup.exists() => return false,
        Err(_) => return true,
    }
    match std::fs::read_dir(cgroup) {
        Ok(entries) => entries.flatten().any(|e| e.file_type().is_ok_and(|t| t.is_dir())),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
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

/// Lease a uid of `range` that no other sandbox holds, for a sandbox whose processes are in
/// `cgroups` (noted in the lease's marker before it is returned; they may be created after
/// the lease — one that does not exist holds no process — but nothing may run as the uid
/// outside them).
pub fn lease(range: &HostUids, cgroups: &[&Path]) -> Result<Lease, SandboxError> {
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
        match try_lock(&fd, uid, libc::F_WRLCK) {
            Ok(()) => {}
            Err(Errno::EAGAIN | Errno::EACCES) => continue,
            Err(e) => return Err(err(format!("lock uid {uid}: {}", e.desc()))),
        }
        if marked_in_use(&dir, uid) {
            try_lock(&fd, uid, libc::F_UNLCK).map_err(|e| err(format!("unlock uid {uid}: {}", e.desc())))?;
            continue;
        }
        if let Err(e) = write_marker(&dir, uid, cgroups) {
            let _ = nix::unistd::unlinkat(&dir, marker_name(uid).as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
            return Err(SandboxError::HostUid(format!(
                "{}: write the marker of uid {uid}: {e}",
                dir_path.join(marker_name(uid)).display()
            )));
        }
        NEXT.store(offset.wrapping_add(1) % range.count, Ordering::Relaxed);
        return Ok(Lease { uid, _lock: fd, dir });
    }
    Err(SandboxError::HostUid(format!(
        "every host uid of {}-{} is held by a running sandbox or a lock ({} at once at most: raise the range's count)",
        range.first,
        range.last(),
        range.count
    )))
}

/// Take (`F_WRLCK`) or release (`F_UNLCK`) the write lock on byte `uid` of the lock file,
/// owned by `fd`'s open file description; `EAGAIN` (or `EACCES`) when another description
/// holds it.
fn try_lock(fd: &OwnedFd, uid: u32, kind: libc::c_int) -> Result<(), Errno> {
    let lock = libc::flock {
        l_type: kind as libc::c_short,
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
        let a = lease(&r, &[]).unwrap();
        let b = lease(&r, &[]).unwrap();
        let c = lease(&r, &[]).unwrap();
        let mut uids = [a.uid(), b.uid(), c.uid()];
        uids.sort();
        assert_eq!(uids, [3_000_000_000, 3_000_000_001, 3_000_000_002]);
        let e = lease(&r, &[]).unwrap_err().to_string();
        assert!(e.contains("every host uid of 3000000000-3000000002 is held"), "{e}");
        // A lock file others could open is refused, not used.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&r.lock, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = lease(&r, &[]).unwrap_err().to_string();
        assert!(e.contains("mode 644: open to others"), "{e}");
        // And what doctor reports before any run.
        assert!(lock_problem(&r).is_some_and(|p| p.contains("mode 644: open to others")));
        std::fs::set_permissions(&r.lock, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = lease(&r, &[]).unwrap_err().to_string();
        assert!(e.contains("no one else may write"), "{e}");
        assert!(lock_problem(&r).is_some_and(|p| p.contains("no one else may write")));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(lock_problem(&r), None);
        // An overlapping range of another configuration sees the same leases.
        let wider = range(&dir, 2_999_999_999, 3);
        let d = lease(&wider, &[]).unwrap();
        assert_eq!(d.uid(), 2_999_999_999);
        assert!(lease(&wider, &[]).is_err());
        let freed = b.uid();
        drop(b);
        assert_eq!(lease(&r, &[]).unwrap().uid(), freed);
        drop((a, c, d));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A lease's marker names its sandbox's cgroups while it lives and goes with it; one left
    /// by a holder that ended without dropping its lease keeps the uid from every lease while
    /// a cgroup it names holds a process (or a cgroup of its own), and is replaced after.
    #[test]
    fn a_uid_whose_holder_died_is_not_leased_while_its_cgroups_hold_processes() {
        let dir = std::env::temp_dir().join(format!("opservant-host-uid-marker-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // Stand-ins for a sandbox's cgroup directories (the files the kernel would show).
        let (memory, pids) = (dir.join("cg/memory"), dir.join("cg/pids"));
        for cg in [&memory, &pids] {
            std::fs::create_dir_all(cg).unwrap();
            std::fs::write(cg.join("cgroup.procs"), "").unwrap();
        }
        let r = range(&dir, 3_100_000_000, 1);
        let marker = dir.join("cgroups-3100000000");
        let a = lease(&r, &[&memory, &pids]).unwrap();
        let listed = format!("{}\n{}\n", memory.display(), pids.display());
        assert_eq!(std::fs::read_to_string(&marker).unwrap(), listed);
        drop(a);
        assert!(!marker.exists(), "a dropped lease leaves its marker");

        // Its holder was killed: the lock is free, the marker stays.
        std::fs::write(&marker, &listed).unwrap();
        std::fs::write(pids.join("cgroup.procs"), "4242\n").unwrap();
        let e = lease(&r, &[]).unwrap_err().to_string();
        assert!(e.contains("is held by a running sandbox"), "{e}");
        assert!(marker.exists());
        std::fs::write(pids.join("cgroup.procs"), "").unwrap();
        std::fs::create_dir(pids.join("child")).unwrap();
        assert!(lease(&r, &[]).is_err(), "a cgroup beneath it may hold processes");
        std::fs::remove_dir(pids.join("child")).unwrap();
        // Empty, or gone: leased again, with a marker of its own.
        std::fs::remove_dir_all(&memory).unwrap();
        let b = lease(&r, &[&pids]).unwrap();
        assert_eq!(
            (b.uid(), std::fs::read_to_string(&marker).unwrap()),
            (3_100_000_000, format!("{}\n", pids.display()))
        );
        assert!(lease(&r, &[]).is_err());
        drop(b);

        // A uid skipped for its marker is not kept locked by the lease that skipped it.
        let two = range(&dir, 3_100_000_000, 2);
        std::fs::write(&marker, &listed).unwrap();
        std::fs::write(pids.join("cgroup.procs"), "4242\n").unwrap();
        let c = lease(&two, &[]).unwrap();
        assert_eq!(c.uid(), 3_100_000_001);
        std::fs::write(pids.join("cgroup.procs"), "").unwrap();
        assert_eq!(lease(&two, &[]).map(|l| l.uid()).ok(), Some(3_100_000_000));
        drop(c);

        // An earlier version's marker of an abandoned sandbox counts the same way.
        let legacy = dir.join("abandoned-3100000000");
        std::fs::write(&legacy, format!("{}\n", pids.display())).unwrap();
        std::fs::write(pids.join("cgroup.procs"), "4242\n").unwrap();
        assert!(lease(&r, &[]).is_err(), "a legacy marker of a live sandbox was passed over");
        std::fs::write(pids.join("cgroup.procs"), "").unwrap();
        drop(lease(&r, &[]).unwrap());
        assert!(!legacy.exists() && !marker.exists());
        // A marker naming no cgroup (a sandbox without any) holds the uid: nothing tells
        // when its processes are gone.
        std::fs::write(&marker, "").unwrap();
        assert!(lease(&r, &[]).is_err(), "a marker naming no cgroup was passed over");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
