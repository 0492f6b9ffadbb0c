//! Parent side: declared paths bound through the sandbox's own idmapping.
//!
//! A sandbox with a leased host uid ([`crate::host_uid`]) runs as a uid no file on the host
//! belongs to. Its declared paths are bound so that the identity's files are its own: the
//! parent — host root, the only one allowed to — clones each declared path as a detached
//! mount and gives it the sandbox's user namespace as its idmapping (`mount_setattr`,
//! `MOUNT_ATTR_IDMAP`). That namespace maps the identity's uid inside to the leased uid,
//! which is exactly the mapping a bind needs: a file the identity owns on disk is the
//! sandbox's through the bind, a file the sandbox creates there is the identity's on disk,
//! and every other owner — a file another sandbox's uid might own included — is unmapped
//! (no owner rights). The prepared mounts go to the sandbox's init with the handshake
//! ([`crate::channel::ToSandbox::Binds`]); init attaches them where it would have bound the
//! paths itself ([`crate::mounts`]).
//!
//! Guarantees:
//! - A path is resolved as init would resolve it — in the host root, `RESOLVE_IN_ROOT`, with
//!   `RESOLVE_NO_SYMLINKS` for an exact source — and with the identity's file permissions:
//!   the resolving thread takes the identity's fsuid and fsgid and no supplementary groups,
//!   which drops every file capability, so no path the identity could not reach is bound.
//!   Those credentials die with the thread. Init still checks the bound file against the
//!   caller's identity check (device and inode), and seals nothing: each mount is already
//!   nosuid, nodev (and read-only as declared) before it leaves the parent.
//! - A path the parent cannot open fails the run, with the error init gives (an optional
//!   path absent on the host is left out); init never binds a declared path of a sandbox
//!   with a leased uid itself — with the leased uid's rights, which are not the identity's.
//! - Every prepared tree is made private (no propagation): a clone of a shared host mount
//!   would otherwise stay in the host's peer group, and mounts made beneath it in the view
//!   would appear on the host (and host mounts in the view).
//! - A read-only path whose filesystem (or a mount beneath it) cannot be idmapped is bound
//!   unmapped, and listed in [`Prepared::not_idmapped`]: the sandbox then has only the
//!   rights any other user has there — less access, reported, never more. A writable one
//!   fails the run: files the sandbox made there would be its leased uid's on disk, and so
//!   the next sandbox's that leases the uid.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;

use crate::error::{Stage, StepError};
use crate::spec::{Access, SandboxSpec};

/// The declared paths prepared for a sandbox.
#[derive(Debug, Default)]
pub struct Prepared {
    /// Index into `filesystem.paths`, and the detached mount to attach there.
    pub binds: Vec<(usize, OwnedFd)>,
    /// Declared paths bound without the idmapping, each with the reason.
    pub not_idmapped: Vec<String>,
}

/// Whether init binds `rule` from the host at all: a writable path under `/tmp` is a
/// directory of the scratch instead.
pub(crate) fn bound_from_host(path: &Path, access: Access) -> bool {
    !(path.starts_with("/tmp") && access == Access::ReadWrite)
}

/// Whether `spec` has a declared path [`prepare`] makes (one init would bind from the host).
pub fn needed(spec: &SandboxSpec) -> bool {
    spec.filesystem.paths.iter().any(|r| bound_from_host(&r.path, r.access))
}

/// Prepare `spec`'s declared paths with `userns` (the sandbox's user namespace) as their
/// idmapping: every path init binds from the host, or an error naming the path as init
/// would (an optional path absent on the host is left out: init then binds nothing there).
pub fn prepare(spec: &SandboxSpec, userns: BorrowedFd<'_>) -> Result<Prepared, StepError> {
    let (uid, gid) = (spec.identity.host_uid, spec.identity.host_gid);
    let work = move || -> Result<Prepared, StepError> {
        take_file_credentials(uid, gid)
            .map_err(|e| StepError::new(Stage::Mounts, format!("cannot take the identity's file credentials: {e}")))?;
        let root = nix::fcntl::open(
            "/",
            nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| StepError::errno(Stage::Mounts, "open /", e))?;
        let mut out = Prepared::default();
        for (i, rule) in spec.filesystem.paths.iter().enumerate() {
            if !bound_from_host(&rule.path, rule.access) {
                continue;
            }
            let exact = rule.source.as_deref();
            let host = exact.unwrap_or(&rule.path);
            let rel = host.strip_prefix("/").unwrap_or(host);
            let src = match crate::mounts::open_in_root(&root, Path::new("/"), rel, exact.is_some()) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) if rule.optional => continue,
                Err(e) => return Err(crate::mounts::host_path_error(host, exact.is_some(), e)),
            };
            crate::mounts::refuse_read_only_write_grant(rule, &src)?;
            let tree = clone_tree(&src)
                .map_err(|e| StepError::errno(Stage::Mounts, format!("clone {}", host.display()), e))?;
            let mut attrs = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
            if rule.access == Access::Read {
                attrs |= libc::MOUNT_ATTR_RDONLY;
            }
            match setattr(&tree, attrs | libc::MOUNT_ATTR_IDMAP, Some(userns)) {
                Ok(()) => out.binds.push((i, tree)),
                // Writable, unmapped: what the sandbox made there would be its leased uid's
                // on disk — and the next sandbox's that leases the uid.
                Err(e) if rule.access == Access::ReadWrite => {
                    return Err(StepError::new(
                        Stage::Mounts,
                        format!(
                            "declared path {}: {}; a writable path must be idmappable when each sandbox runs as a host \
                             uid of its own (sandbox.host_uids), or what one sandbox writes there would belong to \
                             the next one given its uid (declare it read-only, or use host_uids: shared)",
                            rule.path.display(),
                            reason(e)
                        ),
                    ))
                }
                Err(e) => {
                    setattr(&tree, attrs, None)
                        .map_err(|e| StepError::errno(Stage::Mounts, format!("seal {}", host.display()), e))?;
                    out.not_idmapped.push(format!("{}: {}", rule.path.display(), reason(e)));
                    out.binds.push((i, tree));
                }
            }
        }
        Ok(out)
    };
    // A thread of its own: the credentials above are per thread and end with it.
    std::thread::scope(|s| {
        let thread = std::thread::Builder::new()
            .name("opservant-idmap".into())
            .spawn_scoped(s, work)
            .map_err(|e| StepError::io(Stage::Mounts, "start the thread that prepares declared paths", e))?;
        thread.join().map_err(|_| StepError::new(Stage::Mounts, "the thread that prepares declared paths panicked"))?
    })
}

fn reason(e: Errno) -> String {
    match e {
        Errno::EINVAL => "its filesystem, or one mounted beneath it, cannot be idmapped".into(),
        Errno::EPERM => "it is already idmapped, or its filesystem is not the host's".into(),
        e => e.desc().into(),
    }
}

/// Take `uid`/`gid` as this thread's file system ids, with no supplementary groups: the
/// kernel then clears the thread's file capabilities (`CAP_DAC_OVERRIDE` & co.), so paths
/// resolve with the identity's permissions. Raw system calls: the C library's wrappers of
/// `setgroups` apply to every thread of the process.
fn take_file_credentials(uid: u32, gid: u32) -> Result<(), String> {
    // SAFETY: setgroups(0, NULL) reads nothing; it changes only this thread's credentials.
    if unsafe { libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) } != 0 {
        return Err(format!("setgroups: {}", Errno::last().desc()));
    }
    // SAFETY: setfsgid/setfsuid take an id and change only this thread's credentials; each
    // returns the previous id, so a second call tells whether the first took effect.
    unsafe {
        libc::syscall(libc::SYS_setfsgid, gid);
        libc::syscall(libc::SYS_setfsuid, uid);
        let fsgid = libc::syscall(libc::SYS_setfsgid, gid) as u32;
        let fsuid = libc::syscall(libc::SYS_setfsuid, uid) as u32;
        if (fsuid, fsgid) != (uid, gid) {
            return Err(format!("file ids are {fsuid}/{fsgid}, not {uid}/{gid}"));
        }
    }
    Ok(())
}

/// A detached clone of the mount tree at `src` (recursive, close-on-exec).
fn clone_tree(src: &OwnedFd) -> Result<OwnedFd, Errno> {
    let flags = libc::OPEN_TREE_CLONE
        | libc::O_CLOEXEC as libc::c_uint
        | libc::AT_EMPTY_PATH as libc::c_uint
        | libc::AT_RECURSIVE as libc::c_uint;
    // SAFETY: `src` is open, the path an empty NUL-terminated string; we own the result.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, src.as_raw_fd(), c"".as_ptr(), flags) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: open_tree returned a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `mount_setattr(2)` on the whole detached tree `tree`: `attrs` set, private propagation,
/// and with `MOUNT_ATTR_IDMAP` the idmapping `userns`. All or nothing: the kernel checks every mount
/// of the tree before changing any.
fn setattr(tree: &OwnedFd, attrs: u64, userns: Option<BorrowedFd<'_>>) -> Result<(), Errno> {
    // Private: a clone of a shared host mount is in the host's peer group, and mounts made
    // beneath it in the sandbox (a nested declared path) would propagate out to the host —
    // and host mounts in — where init's own binds, cloned from its private old root, never
    // were.
    let attr = libc::mount_attr {
        attr_set: attrs,
        attr_clr: 0,
        propagation: libc::MS_PRIVATE,
        userns_fd: userns.map_or(0, |u| u.as_raw_fd() as u64),
    };
    // SAFETY: `tree` is open, the path empty and NUL-terminated, `attr` a mount_attr of the
    // size passed that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc != 0 {
        return Err(Errno::last());
    }
    Ok(())
}
