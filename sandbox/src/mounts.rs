//! The filesystem view, built inside the sandbox's own mount namespace.
//!
//! Guarantees (for the payload):
//! - `/` is a read-only tmpfs that holds only: the system paths, each a read-only, nosuid,
//!   nodev bind of the host path (or the same symlink, on merged-/usr hosts); declared paths,
//!   bound read-only or read-write (always nosuid, nodev); a fresh, read-only `/proc`; a read-only `/dev`
//!   with only null, zero, full, random, urandom and a private `/dev/shm`; an empty `/sys`, or
//!   a fresh read-only sysfs when asked for; an empty `/run`; and a size-limited scratch tmpfs on `/tmp`
//!   containing `/tmp/opservant/scratch` — `/dev/shm` is its directory `/tmp/opservant/shm`,
//!   so the two share the one size limit. Nothing else of the host is reachable: the old root
//!   is detached before the payload starts (`pivot_root`, never chroot).
//! - Masked paths inside the view are covered by an inaccessible (mode 000, read-only) file
//!   or directory, unless a declared path names them exactly — also beneath a declared
//!   parent (masks and declared paths are applied in one pass, parents first). A mask's path
//!   is resolved as a mount target's is (below), and its cover is sealed through descriptors
//!   only: a clone of the cover file (or empty directory) before it is attached; a masked
//!   directory that declared paths are placed beneath (or that is reached through a link)
//!   gets a search-only tmpfs of its own (made with `fsmount`), sealed through the
//!   descriptor it was made with: nothing in it can be listed or read, the declared paths
//!   beneath it are reached through it. Masks in `/proc` and `/sys` cover entries of the
//!   sandbox's own procfs and sysfs, mounted before any mask is placed.
//! - Host paths are resolved with `openat2(RESOLVE_IN_ROOT)` against the old root, so a host
//!   symlink cannot redirect a bind mount into the half-built new root; a rule's exact
//!   `source` also with `RESOLVE_NO_SYMLINKS`: one whose components include a symlink fails
//!   the build, so what a caller checked is what is bound.
//! - A mount target is resolved component by component and followed through a symlink only
//!   where no sandbox can have put the link (a filesystem the builder made, or a host
//!   directory no sandbox can change); one through any other symlink fails the view, so a
//!   link swapped into a shared writable directory cannot redirect a bind elsewhere in the
//!   view. A bind is sealed (nosuid, nodev, read-only as declared) while it is a detached
//!   clone and then attached onto the opened target: no path is resolved in between.
//! - No host file is ever created or written: every mount point that does not exist (and
//!   each missing parent) is created in a filesystem this builder mounted itself, checked on
//!   the directory it is created in, held open. A declared path whose mount point would have
//!   to be made in a host directory — beneath a writable one bound there, or through a
//!   symlink left in one — fails the view.
//!
//! - The view's `/proc` is mounted read-only: nothing in the sandbox writes through it, with
//!   or without Landlock (and no process there can mount another). The two writes the
//!   sandbox's own steps make — init's per-user-namespace limits and the payload's OOM
//!   score — go through a [`SetupProc`]: the old root's `/proc`, detached with the old root
//!   and reachable only through init's descriptor (closed once the payload is forked) and
//!   the payload's copy (closed right after its write, before anything of the payload runs).
//!
//! Precondition: called by the sandbox init, in fresh user + mount namespaces, already
//! switched to the sandbox identity with capabilities retained (see `privileges`).

use std::ffi::CString;
use std::fs;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::{Stage, StepError};
use crate::spec::{Access, Filesystem, PathRule, SCRATCH_DIR};

/// Host directory used only as the mount point of the new root while it is built.
const STAGE: &str = "/tmp";
const OLD_ROOT: &str = "/.oldroot";
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom"];
/// The scratch tmpfs's directory bound at `/dev/shm`.
const SHM_DIR: &str = "/tmp/opservant/shm";
/// Mode-000 file bound over masked files (removed from the root before the payload runs).
const INACCESSIBLE: &str = "/.inaccessible";
/// Empty mode-000 directory bound over masked directories that nothing is placed beneath
/// (removed from the root before the payload runs, like [`INACCESSIBLE`]).
const INACCESSIBLE_DIR: &str = "/.inaccessible-dir";

/// What the view builder could provide.
#[derive(Debug)]
pub struct ViewReport {
    /// `fresh` or `none`.
    pub sysfs: &'static str,
    /// System paths bound into the view (those recreated as symlinks are covered by their
    /// targets and not listed), each with a descriptor of what was bound there.
    pub system_bound: Vec<(PathBuf, OwnedFd)>,
    /// Declared paths bound from the host, each with a descriptor of what was bound there:
    /// Landlock's rules are made from these, never by opening the path again (a path that
    /// passes through a directory another sandbox can write could lead elsewhere by then).
    /// Declared paths made in the scratch (writable ones under `/tmp`) are not listed.
    pub declared_bound: Vec<(PathBuf, OwnedFd)>,
    /// The procfs for the sandbox's own writes (see the module doc).
    pub setup_proc: SetupProc,
}

/// The old root's `/proc` — the host's procfs, read-write — held as a descriptor once the
/// old root is detached: reachable through nothing else in the view. Its `self` names the
/// process that resolves it (by its host pid), so init writes its user namespace's limits
/// and the payload its own OOM score through it, before anything of the payload runs.
/// Close-on-exec; dropping it closes it.
#[derive(Debug)]
pub struct SetupProc(OwnedFd);

impl SetupProc {
    /// `path` (not followed if a symlink) must be a procfs root.
    fn open(path: &Path) -> Result<SetupProc, StepError> {
        use nix::fcntl::OFlag;
        let fd = nix::fcntl::open(
            path,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| fail(format!("open {}", path.display()), e))?;
        let fs = nix::sys::statfs::fstatfs(&fd).map_err(|e| fail(format!("statfs {}", path.display()), e))?;
        if fs.filesystem_type() != nix::sys::statfs::PROC_SUPER_MAGIC {
            return Err(StepError::new(Stage::Mounts, format!("{} is not a procfs", path.display())));
        }
        Ok(SetupProc(fd))
    }

    /// Write `value` to `rel` (relative to the procfs root, e.g. `self/oom_score_adj`).
    pub fn write(&self, rel: &str, value: &str) -> Result<(), Errno> {
        use nix::fcntl::{openat, OFlag};
        let fd = openat(&self.0, rel, OFlag::O_WRONLY | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())?;
        let n = nix::unistd::write(&fd, value.as_bytes())?;
        if n != value.len() {
            return Err(Errno::EIO);
        }
        Ok(())
    }

    /// Read `rel` (relative to the procfs root) whole.
    pub fn read(&self, rel: &str) -> Result<String, Errno> {
        use nix::fcntl::{openat, OFlag};
        let fd = openat(&self.0, rel, OFlag::O_RDONLY | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut fs::File::from(fd), &mut text)
            .map_err(|e| e.raw_os_error().map_or(Errno::EIO, Errno::from_raw))?;
        Ok(text)
    }
}

fn fail(what: impl std::fmt::Display, e: Errno) -> StepError {
    StepError::errno(Stage::Mounts, what, e)
}

fn fail_io(what: impl std::fmt::Display, e: std::io::Error) -> StepError {
    StepError::io(Stage::Mounts, what, e)
}

fn do_mount(
    src: Option<&str>,
    dst: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), StepError> {
    mount(src, dst, fstype, flags, data)
        .map_err(|e| fail(format!("mount {} on {}", src.unwrap_or("none"), dst.display()), e))
}

/// Build the view and `pivot_root` into it. `net_ns`: a private network namespace exists
/// (required for a fresh sysfs).
///
/// `prepared`: detached mounts the parent made of declared paths, by index into
/// `fs_spec.paths` ([`crate::idmap`]): attached in place of a bind of the host path;
/// `idmapped` (the sandbox runs as a leased host uid): every declared path the parent did
/// not prepare is absent, never bound here.
pub fn build(
    fs_spec: &Filesystem,
    net_ns: bool,
    cwd: &Path,
    prepared: Vec<(usize, OwnedFd)>,
    idmapped: bool,
) -> Result<ViewReport, StepError> {
    let mut prepared: Vec<Option<OwnedFd>> = {
        let mut v: Vec<Option<OwnedFd>> = fs_spec.paths.iter().map(|_| None).collect();
        for (i, fd) in prepared {
            match v.get_mut(i) {
                Some(slot) => *slot = Some(fd),
                None => {
                    return Err(StepError::new(Stage::Mounts, format!("a prepared bind for no declared path ({i})")))
                }
            }
        }
        v
    };
    // Modes below are exact; the payload gets the usual 022 back before execve.
    nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    // 1. Nothing we do propagates back to the host.
    do_mount(None, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)?;

    // 2. The new root: a small tmpfs, pivoted into with the host root kept at OLD_ROOT.
    let synthetic_bytes: usize = fs_spec.synthetic.iter().map(|s| s.content.len() + 4096).sum();
    let root_size = 1024 * 1024 + synthetic_bytes;
    do_mount(
        Some("opservant-root"),
        Path::new(STAGE),
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&format!("mode=0755,size={root_size},nr_inodes=4096")),
    )?;
    mkdir(&Path::new(STAGE).join(OLD_ROOT.trim_start_matches('/')), 0o700)?;
    nix::unistd::pivot_root(STAGE, &*format!("{STAGE}{OLD_ROOT}")).map_err(|e| fail("pivot_root", e))?;
    nix::unistd::chdir("/").map_err(|e| fail("chdir /", e))?;
    let old_root = open_path(Path::new(OLD_ROOT)).map_err(|e| fail(OLD_ROOT, e))?;
    // The filesystems this builder mounts itself: the only ones it creates anything in.
    let mut owned = Owned::new()?;

    // 3. A fresh, read-only /proc for our PID namespace (first: later binds go through
    // /proc/self/fd). The old root's /proc — the host's procfs — is kept as a descriptor for
    // the sandbox's own writes (see [`SetupProc`]).
    mkdir(Path::new("/proc"), 0o555)?;
    do_mount(
        Some("proc"),
        Path::new("/proc"),
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY,
        None,
    )?;
    let setup_proc = SetupProc::open(&Path::new(OLD_ROOT).join("proc"))?;

    // 4. System paths, read-only.
    let mut system_bound = Vec::new();
    for rule in sorted(&fs_spec.system) {
        if let Some(bound) = bind_host(&old_root, rule, true, &owned)? {
            system_bound.push((rule.path.clone(), bound));
        }
    }

    // 5. /dev, /sys, /tmp, /run.
    build_dev(&old_root)?;
    owned.add(Path::new("/dev"))?;
    let sysfs = build_sys(fs_spec.sysfs && net_ns)?;
    build_tmp(fs_spec.scratch_bytes)?;
    owned.add(Path::new("/tmp"))?;
    mkdir(Path::new("/run"), 0o755)?;

    // 6. Masks and declared paths in one pass, parents before children: a mask beneath a
    // declared path covers it again (declaring `/etc` or `/run` does not show what is masked
    // there), and a declared path beneath a mask is shown on top of it. A mask named
    // exactly by a declared path is not applied.
    let mut masks_to_seal = Vec::new();
    let mut declared_bound = Vec::new();
    let inaccessible = Path::new(INACCESSIBLE);
    create_file(inaccessible, 0o000, b"")?;
    let inaccessible_dir = Path::new(INACCESSIBLE_DIR);
    // Made here or the view fails: never a directory of the same name found in its place.
    fs::DirBuilder::new()
        .mode(0o000)
        .create(inaccessible_dir)
        .map_err(|e| fail_io(format!("create {INACCESSIBLE_DIR}"), e))?;
    let covers = Covers {
        file: open_path(inaccessible).map_err(|e| fail(format!("open {INACCESSIBLE}"), e))?,
        dir: open_path(inaccessible_dir).map_err(|e| fail(format!("open {INACCESSIBLE_DIR}"), e))?,
    };
    let mut steps: Vec<(&Path, Option<(usize, &PathRule)>)> = fs_spec
        .masked
        .iter()
        .filter(|m| !fs_spec.paths.iter().any(|p| &p.path == *m))
        .map(|m| (m.as_path(), None))
        .chain(fs_spec.paths.iter().enumerate().map(|(i, r)| (r.path.as_path(), Some((i, r)))))
        .collect();
    steps.sort_by_key(|(path, _)| path.components().count());
    for (path, declared) in steps {
        match declared {
            Some((_, rule)) if !crate::idmap::bound_from_host(&rule.path, rule.access) => {
                if !fs::metadata(&rule.path).is_ok_and(|m| m.is_dir()) {
                    ensure_parent(&rule.path, &owned)?;
                    create_in_owned(&rule.path, Kind::Dir(0o700), &owned)?;
                }
            }
            Some((i, rule)) => {
                let bound = match prepared.get_mut(i).and_then(Option::take) {
                    Some(mnt) => Some(attach_prepared(mnt, rule, &owned)?),
                    // With a leased host uid the parent prepares every declared path (an
                    // optional one absent on the host: none); this process, running as the
                    // leased uid, never binds one with its own rights.
                    None if idmapped && rule.optional => None,
                    None if idmapped => {
                        return Err(StepError::new(
                            Stage::Mounts,
                            format!("declared path {}: not prepared by the parent", rule.path.display()),
                        ))
                    }
                    None => bind_host(&old_root, rule, false, &owned)?,
                };
                if let Some(bound) = bound {
                    declared_bound.push((rule.path.clone(), bound));
                }
            }
            None => {
                // Whether anything is placed beneath the mask later (a declared path or a
                // synthetic file: their mount points are made in the mask's own tmpfs).
                let holds = fs_spec.paths.iter().map(|r| &r.path).chain(fs_spec.synthetic.iter().map(|s| &s.path));
                let placed_beneath = holds.into_iter().any(|p| p != path && p.starts_with(path));
                if let Some(seal_later) = mask(path, &covers, placed_beneath, &mut owned)? {
                    masks_to_seal.push(seal_later);
                }
            }
        }
    }

    // 7. Synthetic files.
    for (i, s) in fs_spec.synthetic.iter().enumerate() {
        let src = PathBuf::from(format!("/.synthetic-{i}"));
        create_file(&src, 0o444, s.content.as_bytes())?;
        // A synthetic file replaces a symlink the view copied from the host at its path (a
        // systemd-resolved host's /etc/resolv.conf): the bind would follow the link.
        if fs::symlink_metadata(&s.path).is_ok_and(|m| m.file_type().is_symlink()) {
            remove_in_owned(&s.path, &owned)?;
        }
        mount_point(&s.path, false, &owned)?;
        let target = open_target(&s.path, false, &owned)?;
        let src_fd = open_path(&src).map_err(|e| fail(format!("open {}", src.display()), e))?;
        drop(bind_sealed(&src_fd, &target, &s.path, true, false)?);
        fs::remove_file(&src).map_err(|e| fail_io(format!("remove {}", src.display()), e))?;
    }
    drop(covers);
    fs::remove_file(inaccessible).map_err(|e| fail_io(format!("remove {INACCESSIBLE}"), e))?;
    fs::remove_dir(inaccessible_dir).map_err(|e| fail_io(format!("remove {INACCESSIBLE_DIR}"), e))?;

    // 8. Detach the host root.
    drop(old_root);
    umount2(OLD_ROOT, MntFlags::MNT_DETACH).map_err(|e| fail("detach old root", e))?;
    fs::remove_dir(OLD_ROOT).map_err(|e| fail_io("remove old root mount point", e))?;

    // 9. Seal: masks and the root become read-only.
    for m in masks_to_seal {
        m.seal()?;
    }
    seal(Path::new("/"), true, false)?;

    nix::unistd::chdir(cwd).map_err(|e| fail(format!("chdir {}", cwd.display()), e))?;
    Ok(ViewReport { sysfs, system_bound, declared_bound, setup_proc })
}

/// What masks are covered with: the mode-000 file [`INACCESSIBLE`] and the empty mode-000
/// directory [`INACCESSIBLE_DIR`], both on the view's root tmpfs.
struct Covers {
    file: OwnedFd,
    dir: OwnedFd,
}

/// Cover `path` in the view, when it exists there. A directory that something is placed
/// beneath later (`placed_beneath`), or that `path` reaches through a symlink, gets an
/// empty search-only tmpfs of its own ([`MASK_TMPFS_OPTIONS`]; returned: sealed read-only
/// once the old root is gone, when nothing more is placed beneath it); any other directory
/// a clone of the empty directory `covers.dir`, anything else a clone of the file
/// `covers.file` — each sealed (read-only, nosuid, nodev; a directory also noexec) before
/// it is attached. A clone of the shared cover costs no filesystem of its own, and nothing
/// can be made in it: it is read-only from the start.
///
/// The path is resolved as a mount target is ([`resolve`]): a masked path that
/// is a symlink masks what it leads to in the view, but only through links no sandbox can
/// have put there — through any other link the view fails, so a link swapped into a shared
/// writable directory cannot move a mask off what it covers. Absent, a link into nothing,
/// or beneath a directory init cannot search (a host directory such as /etc/ssl/private,
/// whose owner is not mapped into the sandbox's user namespace, so init's capabilities do
/// not apply to it — the payload, the same uid with no groups and no capabilities, cannot
/// reach it either): nothing to cover. Any other error fails the view.
fn mask(path: &Path, covers: &Covers, placed_beneath: bool, owned: &mut Owned) -> Result<Option<MaskSeal>, StepError> {
    let (target, via_link) = match resolve_walk(path, owned)? {
        Ok(found) => found,
        Err(Errno::ENOENT | Errno::EACCES) => return Ok(None),
        Err(e) => return Err(fail(format!("mask {}", path.display()), e)),
    };
    if !fstat_is_dir(&target).map_err(|e| fail(format!("mask {}", path.display()), e))? {
        drop(bind_sealed(&covers.file, &target, path, true, false)?);
        return Ok(None);
    }
    // Reached through a link, what declared paths lie beneath it cannot be told from their
    // names: a tmpfs of its own, as when something is placed beneath.
    if !placed_beneath && !via_link {
        let attrs =
            libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV | libc::MOUNT_ATTR_NOEXEC;
        match attach_sealed_clone(&covers.dir, &target, attrs, false) {
            Ok(_) => return Ok(None),
            // Kernels before 5.12: a tmpfs of its own, below.
            Err(Errno::ENOSYS) => {}
            Err(e) => return Err(fail(format!("mask {}", path.display()), e)),
        }
    }
    match mount_mask_tmpfs(&target) {
        Ok(mnt) => {
            let st = nix::sys::stat::fstat(&mnt).map_err(|e| fail(format!("stat mask {}", path.display()), e))?;
            owned.devs.push(st.st_dev);
            Ok(Some(MaskSeal::Mount(mnt, path.to_path_buf())))
        }
        // Kernels before 5.2 (no fsopen): mounted onto the opened target through its
        // descriptor's name, sealed by path.
        Err(Errno::ENOSYS) => {
            let target_name = PathBuf::from(format!("/proc/self/fd/{}", target.as_raw_fd()));
            do_mount(
                Some("opservant-mask"),
                &target_name,
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some(MASK_TMPFS_OPTIONS),
            )?;
            owned.add_unless_linked(path)?;
            Ok(Some(MaskSeal::Path(path.to_path_buf())))
        }
        Err(e) => Err(fail(format!("mask {}", path.display()), e)),
    }
}

/// A mask directory's tmpfs: empty, room for the mount points of declared paths beneath
/// it, and search-only (mode 0111): nothing in it can be listed or read, but a declared
/// path beneath it is reached through it (with mode 000 no path through the mask led to
/// one: the payload has no capability to search it).
const MASK_TMPFS_OPTIONS: &str = "mode=0111,size=4096,nr_inodes=64";

/// A directory mask to make read-only once the view is complete.
enum MaskSeal {
    /// The mask's mount, held as the descriptor it was made with (sealed through it: no
    /// path is resolved again).
    Mount(OwnedFd, PathBuf),
    /// Kernels without the new mount API: sealed by path.
    Path(PathBuf),
}

impl MaskSeal {
    fn seal(self) -> Result<(), StepError> {
        match self {
            MaskSeal::Mount(mnt, path) => {
                let attrs = libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
                match setattr_fd(&mnt, attrs, false) {
                    Ok(()) => Ok(()),
                    // Kernels 5.2-5.11 (fsmount, no mount_setattr): remounted read-only through
                    // the mount's own descriptor (its name in /proc/self/fd leads to exactly
                    // that mount; no path of the view is resolved).
                    Err(Errno::ENOSYS) => {
                        remount_fallback(Path::new(&format!("/proc/self/fd/{}", mnt.as_raw_fd())), attrs, false)
                    }
                    Err(e) => Err(fail(format!("mount_setattr mask {}", path.display()), e)),
                }
            }
            MaskSeal::Path(path) => seal(&path, true, false),
        }
    }
}

/// Make a mask's tmpfs with the new mount API (`fsopen` / `fsconfig` / `fsmount`) and
/// attach it onto `target`; returns the mount's descriptor. `Err(ENOSYS)` on kernels
/// without it (nothing was attached).
fn mount_mask_tmpfs(target: &OwnedFd) -> Result<OwnedFd, Errno> {
    let attrs = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV | libc::MOUNT_ATTR_NOEXEC;
    let mnt = detached_tmpfs("opservant-mask", MASK_TMPFS_OPTIONS, attrs)?;
    move_mount_onto(&mnt, target)?;
    Ok(mnt)
}

/// A new tmpfs with `options` (`key=value,…`: `size`, `nr_inodes`, `mode`…), mounted with
/// `attrs` (`MOUNT_ATTR_*`) but attached nowhere: its descriptor (close-on-exec) is the only
/// way to it until it is attached with `move_mount` — in any mount namespace its holder
/// enters. Kernels before 5.2: `Err(ENOSYS)`.
pub fn detached_tmpfs(source: &str, options: &str, attrs: u64) -> Result<OwnedFd, Errno> {
    // SAFETY: a NUL-terminated filesystem name; the flag asks for a close-on-exec
    // descriptor, which we then own.
    let fs_fd = unsafe { libc::syscall(libc::SYS_fsopen, c"tmpfs".as_ptr(), libc::FSOPEN_CLOEXEC) };
    if fs_fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: fsopen returned a new descriptor nothing else owns.
    let fs_fd = unsafe { OwnedFd::from_raw_fd(fs_fd as i32) };
    let options = options.split(',').filter_map(|o| o.split_once('='));
    for (key, value) in std::iter::once(("source", source)).chain(options) {
        let (key, value) =
            (CString::new(key).map_err(|_| Errno::EINVAL)?, CString::new(value).map_err(|_| Errno::EINVAL)?);
        // SAFETY: `fs_fd` is an open filesystem context; key and value are NUL-terminated
        // strings that outlive the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                fs_fd.as_raw_fd(),
                libc::FSCONFIG_SET_STRING,
                key.as_ptr(),
                value.as_ptr(),
                0,
            )
        };
        if rc != 0 {
            return Err(Errno::last());
        }
    }
    // SAFETY: an open filesystem context; the command takes no key or value.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs_fd.as_raw_fd(),
            libc::FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    };
    if rc != 0 {
        return Err(Errno::last());
    }
    // SAFETY: a created filesystem context; the flags ask for a close-on-exec descriptor of
    // a detached mount, which we then own.
    let mnt = unsafe { libc::syscall(libc::SYS_fsmount, fs_fd.as_raw_fd(), libc::FSMOUNT_CLOEXEC, attrs) };
    if mnt < 0 {
        return Err(Errno::last());
    }
    // SAFETY: fsmount returned a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(mnt as i32) })
}

/// Parents before children so nested binds land on top.
fn sorted(rules: &[PathRule]) -> Vec<&PathRule> {
    let mut v: Vec<&PathRule> = rules.iter().collect();
    v.sort_by_key(|r| r.path.components().count());
    v
}

/// Bind the host's `rule.path` at the same path in the new root. Returns a descriptor of
/// the bind's root when a bind mount was made (`None`: an optional path is absent, or a
/// system symlink was recreated).
fn bind_host(old_root: &OwnedFd, rule: &PathRule, system: bool, owned: &Owned) -> Result<Option<OwnedFd>, StepError> {
    let rel = rule.path.strip_prefix("/").unwrap_or(&rule.path);
    // A system path that is a symlink on the host (merged /usr) is recreated as the same
    // symlink; its target is bound on its own.
    if system {
        let host = Path::new(OLD_ROOT).join(rel);
        match fs::symlink_metadata(&host) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = fs::read_link(&host).map_err(|e| fail_io(format!("readlink {}", host.display()), e))?;
                ensure_parent(&rule.path, owned)?;
                std::os::unix::fs::symlink(&target, &rule.path)
                    .map_err(|e| fail_io(format!("symlink {}", rule.path.display()), e))?;
                return Ok(None);
            }
            Err(e) if e.kind() == ErrorKind::NotFound && rule.optional => return Ok(None),
            _ => {}
        }
    }
    // A rule with an exact source binds that host path only when no component of it is a
    // symlink: what the caller checked is then what is bound (other paths resolve inside
    // the host root).
    let exact = rule.source.as_deref().filter(|_| !system);
    let host = exact.unwrap_or(&rule.path);
    let host_rel = host.strip_prefix("/").unwrap_or(host);
    let src = match open_in_root(old_root, Path::new(OLD_ROOT), host_rel, exact.is_some()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) if rule.optional => return Ok(None),
        Err(e) => return Err(host_path_error(host, exact.is_some(), e)),
    };
    if !system {
        refuse_read_only_write_grant(rule, &src)?;
    }
    let st = nix::sys::stat::fstat(&src).map_err(|e| fail(format!("stat {}", rule.path.display()), e))?;
    check_identity(rule, &st)?;
    let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
    mount_point(&rule.path, is_dir, owned)?;
    let target = open_target(&rule.path, is_dir, owned)?;
    bind_sealed(&src, &target, &rule.path, rule.access == Access::Read, true).map(Some)
}

/// A path declared writable (`rule`) whose host source `src` — a file or a directory — is
/// read-only where the sandbox is built (its mount or its filesystem) is an error naming it,
/// never a bind the payload then finds read-only: under the shipped systemd unit every path
/// outside the unit's `ReadWritePaths=` is (`ProtectSystem=strict`), which the command line
/// does not see. Only the declared path's own mount is checked, not mounts beneath it.
pub(crate) fn refuse_read_only_write_grant(rule: &PathRule, src: &OwnedFd) -> Result<(), StepError> {
    if rule.access != Access::ReadWrite {
        return Ok(());
    }
    // A read-only mount refuses writes to files and directories only: a socket is still
    // connected to and a FIFO or device written through one (a write grant of a socket is
    // what talking to it takes).
    let kind = nix::sys::stat::fstat(src).map_err(|e| fail(format!("stat {}", rule.path.display()), e))?.st_mode
        & libc::S_IFMT;
    if kind != libc::S_IFREG && kind != libc::S_IFDIR {
        return Ok(());
    }
    let flags =
        nix::sys::statvfs::fstatvfs(src).map_err(|e| fail(format!("statvfs {}", rule.path.display()), e))?.flags();
    if flags.contains(nix::sys::statvfs::FsFlags::ST_RDONLY) {
        return Err(StepError::new(
            Stage::Mounts,
            format!(
                "declared path {} is writable in the manifest but read-only here (its mount or its filesystem is; \
                 under the shipped systemd unit every path outside the unit's ReadWritePaths= is read-only to the \
                 agent: add it there with a drop-in, see systemd/README.md)",
                rule.path.display()
            ),
        ));
    }
    Ok(())
}

/// Why host path `host` (an exact source: `exact`) could not be opened to be bound.
pub(crate) fn host_path_error(host: &Path, exact: bool, e: Errno) -> StepError {
    match e {
        Errno::ELOOP if exact => StepError::new(
            Stage::Mounts,
            format!(
                "host path {}: a component is a symlink (a checked path is never bound through one)",
                host.display()
            ),
        ),
        Errno::EACCES => StepError::new(
            Stage::Mounts,
            format!(
                "host path {}: permission denied to the sandbox's user, which is not root on the host: each \
                 directory on the way must be searchable by it (o+x makes a directory searchable by all)",
                host.display()
            ),
        ),
        e => fail(format!("host path {}", host.display()), e),
    }
}

/// Attach `mnt`, a detached mount of `rule`'s host path the parent prepared (resolved,
/// cloned and sealed there: [`crate::idmap`]), at `rule.path` — after the same identity
/// check [`bind_host`] makes. Returns the attached mount's descriptor.
fn attach_prepared(mnt: OwnedFd, rule: &PathRule, owned: &Owned) -> Result<OwnedFd, StepError> {
    let st = nix::sys::stat::fstat(&mnt).map_err(|e| fail(format!("stat {}", rule.path.display()), e))?;
    check_identity(rule, &st)?;
    let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
    mount_point(&rule.path, is_dir, owned)?;
    let target = open_target(&rule.path, is_dir, owned)?;
    move_mount_onto(&mnt, &target).map_err(|e| fail(format!("bind onto {}", rule.path.display()), e))?;
    Ok(mnt)
}

/// The file `rule`'s caller checked (`rule.identity`) is the one opened (`st`).
fn check_identity(rule: &PathRule, st: &libc::stat) -> Result<(), StepError> {
    let Some(want) = rule.identity else { return Ok(()) };
    // `st_dev` is the kernel's device number, the same in every user namespace.
    if (st.st_dev, st.st_ino) != (want.dev, want.ino) {
        let host = rule.source.as_deref().unwrap_or(&rule.path);
        return Err(StepError::new(
            Stage::Mounts,
            format!(
                "host path {}: not the file the caller checked (device {} inode {}, now device {} inode {}): replaced since",
                host.display(),
                want.dev,
                want.ino,
                st.st_dev,
                st.st_ino
            ),
        ));
    }
    Ok(())
}

/// Bind `src` (recursively: `recursive`) onto `target`, the opened mount point of `path` in the
/// view, nosuid, nodev and read-only when `read_only` — sealed before it is attached (see
/// [`attach_sealed_clone`]); on kernels without the new mount API, bound and then sealed by
/// path. Returns a descriptor of what was bound (the attached clone, or on those kernels
/// `src` itself: the same file, whose inode Landlock's rules are keyed on).
fn bind_sealed(
    src: &OwnedFd,
    target: &OwnedFd,
    path: &Path,
    read_only: bool,
    recursive: bool,
) -> Result<OwnedFd, StepError> {
    let mut attrs = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
    if read_only {
        attrs |= libc::MOUNT_ATTR_RDONLY;
    }
    match attach_sealed_clone(src, target, attrs, recursive) {
        Ok(attached) => Ok(attached),
        // Kernels before 5.12 (no mount_setattr) or 5.2 (no open_tree).
        Err(Errno::ENOSYS) => {
            let src_name = format!("/proc/self/fd/{}", src.as_raw_fd());
            let target_name = PathBuf::from(format!("/proc/self/fd/{}", target.as_raw_fd()));
            let flags = if recursive { MsFlags::MS_BIND | MsFlags::MS_REC } else { MsFlags::MS_BIND };
            mount(Some(src_name.as_str()), &target_name, None::<&str>, flags, None::<&str>)
                .map_err(|e| fail(format!("bind onto {}", path.display()), e))?;
            seal(path, read_only, recursive)?;
            src.try_clone().map_err(|e| fail_io(format!("bind onto {}", path.display()), e))
        }
        Err(e) => Err(fail(format!("bind onto {}", path.display()), e)),
    }
}

/// Attach a clone of `src` (recursive: `recursive`) onto `target` with `attrs` (`MOUNT_ATTR_*`) already set
/// on the whole clone while it is still detached: nothing is resolved by path between the
/// clone and its sealing, so no swapped path can make the attributes land on another mount.
/// Returns the clone's descriptor, now attached. `Err(ENOSYS)` on kernels without
/// `open_tree` / `mount_setattr` (nothing was attached).
fn attach_sealed_clone(src: &OwnedFd, target: &OwnedFd, attrs: u64, recursive: bool) -> Result<OwnedFd, Errno> {
    let empty = c"";
    let mut flags = libc::OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | libc::AT_EMPTY_PATH as libc::c_uint;
    if recursive {
        flags |= libc::AT_RECURSIVE as libc::c_uint;
    }
    // SAFETY: `src` is an open descriptor, the path an empty NUL-terminated string; the flags
    // ask for a close-on-exec descriptor of a detached clone, which we then own.
    let tree = unsafe { libc::syscall(libc::SYS_open_tree, src.as_raw_fd(), empty.as_ptr(), flags) };
    if tree < 0 {
        return Err(Errno::last());
    }
    // SAFETY: open_tree returned a new descriptor nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as i32) };
    setattr_fd(&tree, attrs, recursive)?;
    move_mount_onto(&tree, target)?;
    Ok(tree)
}

/// `mount_setattr(2)` on the mount `mnt` refers to (and, when `recursive`, every mount beneath it),
/// through its descriptor: `attrs` (`MOUNT_ATTR_*`) are added, none cleared.
fn setattr_fd(mnt: &OwnedFd, attrs: u64, recursive: bool) -> Result<(), Errno> {
    let attr = libc::mount_attr { attr_set: attrs, attr_clr: 0, propagation: 0, userns_fd: 0 };
    let mut flags = libc::AT_EMPTY_PATH as libc::c_uint;
    if recursive {
        flags |= libc::AT_RECURSIVE as libc::c_uint;
    }
    // SAFETY: `mnt` is open, the path empty and NUL-terminated, `attr` a properly sized
    // mount_attr that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            mnt.as_raw_fd(),
            c"".as_ptr(),
            flags,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Attach the detached mount `mnt` onto `target` (both descriptors: nothing is resolved by
/// path).
fn move_mount_onto(mnt: &OwnedFd, target: &OwnedFd) -> Result<(), Errno> {
    let empty = c"";
    // SAFETY: both descriptors are open, both paths empty and NUL-terminated.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mnt.as_raw_fd(),
            empty.as_ptr(),
            target.as_raw_fd(),
            empty.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

fn build_dev(old_root: &OwnedFd) -> Result<(), StepError> {
    let dev = Path::new("/dev");
    mkdir(dev, 0o755)?;
    do_mount(
        Some("opservant-dev"),
        dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=0755,size=65536,nr_inodes=64"),
    )?;
    for name in DEVICES {
        let dst = dev.join(name);
        create_file(&dst, 0o666, b"")?;
        let src = open_in_root(old_root, Path::new(OLD_ROOT), &Path::new("dev").join(name), false)
            .map_err(|e| fail(format!("host /dev/{name}"), e))?;
        let src_name = format!("/proc/self/fd/{}", src.as_raw_fd());
        // Device nodes need a mount without nodev (nosuid and noexec mean nothing for a
        // character device; /dev itself is sealed read-only, nosuid, noexec below).
        do_mount(Some(&src_name), &dst, None, MsFlags::MS_BIND, None)?;
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(name)).map_err(|e| fail_io(format!("symlink /dev/{name}"), e))?;
    }
    // The mount point of /dev/shm, a directory of the scratch tmpfs bound there by
    // [`build_tmp`].
    mkdir(&dev.join("shm"), 0o755)?;
    // The /dev tmpfs itself becomes read-only; the bound nodes and /dev/shm keep their own flags.
    setattr(dev, libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NOEXEC, false)
}

fn build_sys(fresh: bool) -> Result<&'static str, StepError> {
    let sys = Path::new("/sys");
    mkdir(sys, 0o555)?;
    if !fresh {
        return Ok("none");
    }
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    match mount(Some("sysfs"), sys, Some("sysfs"), flags, None::<&str>) {
        Ok(()) => Ok("fresh"),
        // The kernel refuses a fresh sysfs when the host's is partly hidden; an empty /sys is
        // strictly less than the payload could otherwise see, and is reported.
        Err(Errno::EPERM | Errno::EACCES) => Ok("none"),
        Err(e) => Err(fail("mount sysfs", e)),
    }
}

/// The scratch tmpfs on `/tmp`, `scratch_bytes` in all: `/dev/shm` is its directory
/// [`SHM_DIR`] bound there (nosuid, nodev, noexec), so the two share one size limit — filling
/// both ends in `ENOSPC` at `max_disk_mb`, never at twice that.
fn build_tmp(scratch_bytes: u64) -> Result<(), StepError> {
    let tmp = Path::new("/tmp");
    mkdir(tmp, 0o1777)?;
    do_mount(
        Some("opservant-scratch"),
        tmp,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&format!("mode=1777,size={scratch_bytes},nr_inodes={}", inodes_for(scratch_bytes))),
    )?;
    mkdir(Path::new("/tmp/opservant"), 0o755)?;
    mkdir(Path::new(SCRATCH_DIR), 0o700)?;
    let shm = Path::new(SHM_DIR);
    mkdir(shm, 0o1777)?;
    // Both paths are in filesystems this builder has just made; nothing else runs yet.
    do_mount(Some(SHM_DIR), Path::new("/dev/shm"), None, MsFlags::MS_BIND, None)?;
    setattr(Path::new("/dev/shm"), libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV | libc::MOUNT_ATTR_NOEXEC, false)
}

/// One inode per 4 KiB of scratch, at least 1024: bounds the kernel memory small files cost.
fn inodes_for(bytes: u64) -> u64 {
    (bytes / 4096).max(1024)
}

/// Apply read-only (optionally) + nosuid + nodev to the mount at `path` (and, when
/// `recursive`, every mount beneath it).
fn seal(path: &Path, read_only: bool, recursive: bool) -> Result<(), StepError> {
    let mut attrs = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
    if read_only {
        attrs |= libc::MOUNT_ATTR_RDONLY;
    }
    setattr(path, attrs, recursive)
}

/// `mount_setattr(2)`, falling back to bind-remounts on kernels older than 5.12.
fn setattr(path: &Path, attrs: u64, recursive: bool) -> Result<(), StepError> {
    let c = cstr(path)?;
    let attr = libc::mount_attr { attr_set: attrs, attr_clr: 0, propagation: 0, userns_fd: 0 };
    let flags = if recursive { libc::AT_RECURSIVE as libc::c_uint } else { 0 };
    // SAFETY: `c` is a valid NUL-terminated path and `attr` a properly sized mount_attr that
    // outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            c.as_ptr(),
            flags,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    match Errno::last() {
        Errno::ENOSYS => remount_fallback(path, attrs, recursive),
        e => Err(fail(format!("mount_setattr {}", path.display()), e)),
    }
}

fn remount_fallback(path: &Path, attrs: u64, recursive: bool) -> Result<(), StepError> {
    let mut targets = vec![path.to_path_buf()];
    if recursive {
        let info = fs::read_to_string("/proc/self/mountinfo").map_err(|e| fail_io("read mountinfo", e))?;
        for line in info.lines() {
            if let Some(mp) = line.split(' ').nth(4) {
                let mp = PathBuf::from(mp);
                if mp != path && mp.starts_with(path) {
                    targets.push(mp);
                }
            }
        }
    }
    for t in targets {
        // Locked flags (inherited from a more privileged namespace) must be kept on remount.
        let st = nix::sys::statvfs::statvfs(&t).map_err(|e| fail(format!("statvfs {}", t.display()), e))?;
        use nix::sys::statvfs::FsFlags;
        let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND;
        let f = st.flags();
        for (have, ms) in [
            (FsFlags::ST_RDONLY, MsFlags::MS_RDONLY),
            (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
            (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
            (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
            (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
            (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
            (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
        ] {
            if f.contains(have) {
                flags |= ms;
            }
        }
        for (attr, ms) in [
            (libc::MOUNT_ATTR_RDONLY, MsFlags::MS_RDONLY),
            (libc::MOUNT_ATTR_NOSUID, MsFlags::MS_NOSUID),
            (libc::MOUNT_ATTR_NODEV, MsFlags::MS_NODEV),
            (libc::MOUNT_ATTR_NOEXEC, MsFlags::MS_NOEXEC),
        ] {
            if attrs & attr != 0 {
                flags |= ms;
            }
        }
        do_mount(None, &t, None, flags, None)?;
    }
    Ok(())
}

/// Resolve `rel` beneath `root` as if `root` were `/` (symlinks cannot escape it);
/// `no_symlinks`: any symlink in `rel` fails with `ELOOP`. `base` is `root`'s path in this
/// process's mount namespace, where a kernel (or a seccomp filter: a systemd unit's
/// `SystemCallFilter=` answers `ENOSYS` for what it does not know) without `openat2`
/// resolves `rel` instead — init's old root, or `/` in the parent.
pub(crate) fn open_in_root(root: &OwnedFd, base: &Path, rel: &Path, no_symlinks: bool) -> Result<OwnedFd, Errno> {
    let c = CString::new(rel.as_os_str().as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: open_how is plain old data; all-zero is valid (and required for unused fields).
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    if no_symlinks {
        how.resolve |= libc::RESOLVE_NO_SYMLINKS;
    }
    // SAFETY: valid dirfd, NUL-terminated path, and an open_how of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd >= 0 {
        // SAFETY: openat2 returned a fresh descriptor that nothing else owns.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    }
    match Errno::last() {
        // Kernels before 5.6, or a systemd unit with `RestrictSUIDSGID=` (which answers
        // `openat2` with ENOSYS: it cannot see the mode in its struct; the shipped unit no
        // longer sets it): with `no_symlinks`, a walk of one `openat` per component that refuses a
        // symlink at each, as race-free as `RESOLVE_NO_SYMLINKS`; otherwise resolve normally
        // (absolute symlinks then resolve from `base`'s process root — init's new root,
        // which only ever holds what the sandbox may see anyway, or the parent's `/`).
        Errno::ENOSYS if no_symlinks => walk_no_symlinks(root, rel),
        Errno::ENOSYS => open_path(&base.join(rel)),
        e => Err(e),
    }
}

/// Open `rel` beneath `root` one component at a time (`O_PATH | O_NOFOLLOW`), failing with
/// `ELOOP` at a component that is a symlink (magic links included) and with `EINVAL` at a
/// `..`: what `openat2`'s `RESOLVE_NO_SYMLINKS` gives, without it. Each step is made on the
/// descriptor of the one before, so nothing swapped in meanwhile is followed.
fn walk_no_symlinks(root: &OwnedFd, rel: &Path) -> Result<OwnedFd, Errno> {
    use std::path::Component;
    let mut cur = nix::fcntl::openat(
        root,
        ".",
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    for comp in rel.components() {
        let name = match comp {
            Component::Normal(name) => name,
            Component::CurDir | Component::RootDir => continue,
            Component::ParentDir | Component::Prefix(_) => return Err(Errno::EINVAL),
        };
        let next = nix::fcntl::openat(
            &cur,
            name,
            nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        if nix::sys::stat::fstat(&next)?.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(Errno::ELOOP);
        }
        cur = next;
    }
    Ok(cur)
}

fn open_path(p: &Path) -> Result<OwnedFd, Errno> {
    let fd =
        nix::fcntl::open(p, nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())?;
    Ok(fd)
}

fn fstat_is_dir(fd: &OwnedFd) -> Result<bool, Errno> {
    let st = nix::sys::stat::fstat(fd)?;
    Ok(st.st_mode & libc::S_IFMT == libc::S_IFDIR)
}

/// The filesystems the view builder mounted itself (its root, `/dev`, `/dev/shm`, the
/// scratch `/tmp`, the masks' tmpfs), by device number: anything it creates — mount points,
/// their parents — is created in one of these, never through a host bind (a declared
/// writable directory, or a symlink a payload left there that leads into the old root).
struct Owned {
    devs: Vec<u64>,
    /// The view's root, opened once (to find masks and mount targets without following a
    /// symlink the builder did not make).
    root: OwnedFd,
    /// Device and inode of the host root, attached at [`OLD_ROOT`] while the view is built.
    old_root: (u64, u64),
}

impl Owned {
    /// The view's root (just pivoted into) as the first filesystem of the builder's own.
    fn new() -> Result<Owned, StepError> {
        let root = open_path(Path::new("/")).map_err(|e| fail("open /", e))?;
        let st = nix::sys::stat::fstat(&root).map_err(|e| fail("stat /", e))?;
        let old = nix::sys::stat::stat(OLD_ROOT).map_err(|e| fail(format!("stat {OLD_ROOT}"), e))?;
        Ok(Owned { devs: vec![st.st_dev], root, old_root: (old.st_dev, old.st_ino) })
    }

    fn add(&mut self, path: &Path) -> Result<(), StepError> {
        let st = nix::sys::stat::stat(path).map_err(|e| fail(format!("stat {}", path.display()), e))?;
        self.devs.push(st.st_dev);
        Ok(())
    }

    /// A mask's tmpfs, found at `path` without following a symlink in any component (one
    /// swapped in after the mount would otherwise name a host filesystem): a mask reached
    /// through a link is not added — nothing is then created beneath it.
    fn add_unless_linked(&mut self, path: &Path) -> Result<(), StepError> {
        match open_in_root(&self.root, Path::new("/"), path.strip_prefix("/").unwrap_or(path), true) {
            Ok(fd) => {
                let st = nix::sys::stat::fstat(&fd).map_err(|e| fail(format!("stat {}", path.display()), e))?;
                if st.st_mode & libc::S_IFMT == libc::S_IFDIR && st.st_mode & 0o7777 == 0 {
                    self.devs.push(st.st_dev);
                }
                Ok(())
            }
            Err(Errno::ELOOP | Errno::ENOTDIR | Errno::ENOSYS) => Ok(()),
            Err(e) => Err(fail(format!("open {}", path.display()), e)),
        }
    }
}

/// What to create.
#[derive(Clone, Copy)]
enum Kind {
    Dir(u32),
    File,
}

/// Make sure `path` exists to be mounted on (created in a sandbox-owned tmpfs if needed).
fn mount_point(path: &Path, is_dir: bool, owned: &Owned) -> Result<(), StepError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() == is_dir => Ok(()),
        Ok(_) => Err(StepError::new(
            Stage::Mounts,
            format!("{}: host path and sandbox view disagree on file vs directory", path.display()),
        )),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            ensure_parent(path, owned)?;
            create_in_owned(path, if is_dir { Kind::Dir(0o755) } else { Kind::File }, owned)
        }
        Err(e) => Err(fail_io(format!("stat {}", path.display()), e)),
    }
}

/// Open `path` in the view (`O_PATH`) as a mount target (see [`resolve`]); `is_dir`: what the
/// target must be.
fn open_target(path: &Path, is_dir: bool, owned: &Owned) -> Result<OwnedFd, StepError> {
    let cur = resolve(path, owned)?.map_err(|e| fail(format!("mount target {}", path.display()), e))?;
    if fstat_is_dir(&cur).map_err(|e| fail(format!("mount target {}", path.display()), e))? != is_dir {
        return Err(StepError::new(
            Stage::Mounts,
            format!("{}: host path and sandbox view disagree on file vs directory", path.display()),
        ));
    }
    Ok(cur)
}

/// Resolve `path` in the view to an `O_PATH` descriptor, component by component, following a
/// symlink only where no sandbox can have put it: in a filesystem the builder made (`owned`:
/// the merged-/usr links of the root, say), or in a host directory no sandbox can change (see
/// [`sandbox_may_write`]: a root-owned, mode-0755 `/etc/ssl` whose `certs` is a link, say). A
/// symlink in a host directory a sandbox can change — where another sandbox sharing it could
/// swap one in between the checks and the mount — fails the view instead of redirecting the
/// mount; so does a walk into the host root (still attached while the view is built). The
/// inner `Err` is the errno of a component that could not be opened (`ENOENT`: absent).
fn resolve(path: &Path, owned: &Owned) -> Result<Result<OwnedFd, Errno>, StepError> {
    Ok(resolve_walk(path, owned)?.map(|(fd, _)| fd))
}

/// [`resolve`], also telling whether a symlink was followed on the way (then what the
/// descriptor names is not `path` in the view's namespace of names).
fn resolve_walk(path: &Path, owned: &Owned) -> Result<Result<(OwnedFd, bool), Errno>, StepError> {
    use nix::fcntl::{openat, readlinkat, OFlag};
    use std::ffi::OsString;
    let fail_at = |e: Errno| fail(format!("mount target {}", path.display()), e);
    let components = |p: &Path| -> Vec<OsString> {
        p.components()
            .filter_map(|c| match c {
                std::path::Component::Normal(n) => Some(n.to_os_string()),
                std::path::Component::ParentDir => Some(OsString::from("..")),
                _ => None,
            })
            .collect()
    };
    let mut pending: std::collections::VecDeque<OsString> = components(path).into();
    // Where the walk is: `None` for the view's root (held by `owned`, not reopened per bind).
    let mut cur: Option<OwnedFd> = None;
    // Where the walk is, for messages (links followed are spliced in).
    let mut walked = PathBuf::from("/");
    let mut links = 0;
    while let Some(name) = pending.pop_front() {
        let dir_fd = cur.as_ref().unwrap_or(&owned.root);
        let next = match openat(
            dir_fd,
            name.as_os_str(),
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(e) => return Ok(Err(e)),
        };
        let st = nix::sys::stat::fstat(&next).map_err(fail_at)?;
        if (st.st_dev, st.st_ino) == owned.old_root {
            // A followed link that leads into the host root, still attached while the view
            // is built: a mount there would vanish with it.
            return Err(StepError::new(
                Stage::Mounts,
                format!(
                    "mount target {}: leads into the host's root ({})",
                    path.display(),
                    walked.join(&name).display()
                ),
            ));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFLNK {
            cur = Some(next);
            if name == ".." {
                walked.pop();
            } else {
                walked.push(&name);
            }
            continue;
        }
        let dir = nix::sys::stat::fstat(dir_fd).map_err(fail_at)?;
        if !owned.devs.contains(&dir.st_dev) && sandbox_may_write(dir_fd, &dir).map_err(fail_at)? {
            return Err(StepError::new(
                Stage::Mounts,
                format!(
                    "mount target {}: {} is a symlink in a host directory a sandbox can change; a mount is \
                     never placed through one",
                    path.display(),
                    walked.join(&name).display()
                ),
            ));
        }
        links += 1;
        if links > 40 {
            return Err(fail_at(Errno::ELOOP));
        }
        // Read from the link opened above, not by its name again.
        let target = PathBuf::from(readlinkat(&next, "").map_err(fail_at)?);
        for c in components(&target).into_iter().rev() {
            pending.push_front(c);
        }
        if target.is_absolute() {
            cur = None;
            walked = PathBuf::from("/");
        }
    }
    let followed = links > 0;
    match cur {
        Some(fd) => Ok(Ok((fd, followed))),
        None => Ok(owned
            .root
            .try_clone()
            .map(|fd| (fd, followed))
            .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))),
    }
}

/// Whether a sandbox could have changed what is in host directory `dir`: it is writable by
/// group or others by its mode (an ACL granting anyone write shows in the group bits), or
/// the sandbox identity — which every sandbox shares — owns it (and so could make it
/// writable at will), or that cannot be told. The owner is probed with `O_NOATIME`, which
/// the kernel allows only to the owner (or to capabilities that apply to the directory,
/// which then counts as the sandbox's too); `st_uid` could not tell: unmapped host root
/// shows as the overflow uid, which is also `nobody`'s, a possible sandbox identity.
fn sandbox_may_write(dir: &OwnedFd, st: &libc::stat) -> Result<bool, Errno> {
    use nix::fcntl::{openat, OFlag};
    if st.st_mode & 0o022 != 0 {
        return Ok(true);
    }
    match openat(
        dir,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOATIME | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    ) {
        Ok(_) => Ok(true),
        Err(Errno::EPERM) => Ok(false),
        // Not even readable for the sandbox identity: cannot tell, so it counts as writable.
        Err(Errno::EACCES) => Ok(true),
        Err(e) => Err(e),
    }
}

/// Make sure `path`'s parent directories exist, creating the missing ones (mode 0755) in
/// sandbox-owned filesystems only.
fn ensure_parent(path: &Path, owned: &Owned) -> Result<(), StepError> {
    let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return Ok(());
    };
    match fs::metadata(parent) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(StepError::new(Stage::Mounts, format!("{}: not a directory", parent.display()))),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            ensure_parent(parent, owned)?;
            create_in_owned(parent, Kind::Dir(0o755), owned)
        }
        Err(e) => Err(fail_io(format!("stat {}", parent.display()), e)),
    }
}

/// Remove the non-directory `path` from its parent directory, held open, only when that
/// directory lies on a filesystem of `owned` (never anything of the host).
fn remove_in_owned(path: &Path, owned: &Owned) -> Result<(), StepError> {
    let dir = owned_parent(path, owned)?;
    let name = path.file_name().unwrap_or_default();
    nix::unistd::unlinkat(&dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
        .map_err(|e| fail(format!("remove {}", path.display()), e))
}

/// `path`'s parent directory, opened, when it lies on a filesystem of `owned`.
fn owned_parent(path: &Path, owned: &Owned) -> Result<OwnedFd, StepError> {
    use nix::fcntl::{open, OFlag};
    use nix::sys::stat::{fstat, Mode};
    let (Some(parent), Some(_)) = (path.parent(), path.file_name()) else {
        return Err(StepError::new(Stage::Mounts, format!("{}: not a path with a parent", path.display())));
    };
    let dir = open(parent, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|e| fail(format!("open {}", parent.display()), e))?;
    let st = fstat(&dir).map_err(|e| fail(format!("stat {}", parent.display()), e))?;
    if !owned.devs.contains(&st.st_dev) {
        return Err(StepError::new(
            Stage::Mounts,
            format!(
                "{}: it would have to be made or replaced in {}, a directory on the host; the view never changes \
                 anything on the host",
                path.display(),
                parent.display()
            ),
        ));
    }
    Ok(dir)
}

/// Create `path` (its parent exists) in its parent directory, held open, only when that
/// directory lies on a filesystem of `owned`: a parent that is (or leads into) a host
/// directory fails the view instead of creating anything on the host.
fn create_in_owned(path: &Path, kind: Kind, owned: &Owned) -> Result<(), StepError> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::{mkdirat, Mode};
    let dir = owned_parent(path, owned)?;
    let name = path.file_name().unwrap_or_default();
    match kind {
        Kind::Dir(mode) => mkdirat(&dir, name, Mode::from_bits_truncate(mode)),
        Kind::File => openat(
            &dir,
            name,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .map(drop),
    }
    .map_err(|e| fail(format!("create {}", path.display()), e))
}

fn mkdir(path: &Path, mode: u32) -> Result<(), StepError> {
    // The umask is 0 while the view is built, so `mode` is exact.
    match fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) => Err(fail_io(format!("create {}", path.display()), e)),
    }
}

fn create_file(path: &Path, mode: u32, content: &[u8]) -> Result<(), StepError> {
    use std::io::Write;
    // The umask is 0 while the view is built, so `mode` is exact. Content is written
    // through the descriptor, which keeps write access even for mode 000.
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| fail_io(format!("create {}", path.display()), e))?;
    if !content.is_empty() {
        f.write_all(content).map_err(|e| fail_io(format!("write {}", path.display()), e))?;
    }
    Ok(())
}

fn cstr(p: &Path) -> Result<CString, StepError> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| StepError::new(Stage::Mounts, format!("{}: contains NUL", p.display())))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn the_walk_without_openat2_refuses_symlinks_and_dotdot_as_resolve_no_symlinks_does() {
        let dir = std::env::temp_dir().join(format!("opservant-walk-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("a/b/f"), "x").unwrap();
        std::os::unix::fs::symlink("b", dir.join("a/link")).unwrap();
        std::os::unix::fs::symlink("b/f", dir.join("a/flink")).unwrap();
        let root = super::open_path(&dir).unwrap();
        let walked = super::walk_no_symlinks(&root, Path::new("a/b/f")).unwrap();
        let ino = nix::sys::stat::fstat(&walked).unwrap().st_ino;
        assert_eq!(ino, std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(dir.join("a/b/f")).unwrap()));
        assert!(super::walk_no_symlinks(&root, Path::new("./a/./b")).is_ok());
        for (rel, want) in [
            ("a/link/f", nix::errno::Errno::ELOOP),
            ("a/flink", nix::errno::Errno::ELOOP),
            ("a/../a/b", nix::errno::Errno::EINVAL),
            ("a/missing", nix::errno::Errno::ENOENT),
        ] {
            assert_eq!(super::walk_no_symlinks(&root, Path::new(rel)).unwrap_err(), want, "{rel}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
