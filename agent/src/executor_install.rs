//! Installed executors: `opservant executor install | list | remove`, and the lookup that
//! lets `opservant run NAME` find one.
//!
//! Layout under the executors directory (default [`DEFAULT_ROOT`], root-owned):
//!
//! ```text
//! <root>/<name>/<version>[.<n>]/    an installed package (read-only once in place)
//! <root>/<name>/current -> <dir>    the version runs use; switched with one rename(2)
//! <root>/.staging-<pid>-<n>/        work area of an install in progress (same filesystem)
//! <root>/.download-<pid>-<n>/       a package being downloaded for `install_executor`
//! <root>/.removing-<pid>-<n>/       an executor being removed
//! <root>/.switch-<name>              an install's switch in progress (JSON: to, from, …)
//! ```
//!
//! The three work areas of a process that is gone (killed part-way) are removed by the next
//! install or removal, under the root lock; a `.removing-…` directory whatever its process,
//! but for the versions runs still hold. A `.switch-…` marker found then belongs to an
//! install cut short between its copy and its switch: the switch is completed while
//! `current` still names what it named then (see [`Switching`]); the agent takes the lock as
//! it starts ([`settle`]) for this.
//!
//! Guarantees:
//! - an archive (`.tar.gz`, `.tgz`, `.tar`) is unpacked entry by entry and refused as a whole
//!   on the first absolute path, `..` component, symbolic or hard link, device, FIFO, or
//!   anything but a regular file or a directory, on a non-UTF-8 name, or beyond the size and
//!   entry limits; on an entry two tar readers would name differently or a PAX global header
//!   that changes later entries; on a GNU long name or link over 4 KiB or a PAX header over
//!   1 MiB, before any of it is read into memory (a first pass over the raw headers), on a
//!   PAX `size` record and on a GNU sparse file; on compiled bytecode outside `__pycache__` (archives and
//!   directories); every member of a multi-member gzip file is read, so what is installed is
//!   what `tar` lists; nothing of a refused package is left behind;
//! - a package is installed only if `executor lint` finds no error in it — with its Python
//!   requirements installed first, from wheels only (never a source build, which would run
//!   the package's code as root): the package's own `wheels/` directory (its `*.whl` files
//!   only: pip would follow an HTML page's links), `--find-links`, or
//!   `--index-url`; pip resolves no dependencies (a wheel's direct-reference dependency
//!   would be built), so the requirements list every distribution, checked from the
//!   wheels' metadata;
//! - the new version becomes visible atomically (the `current` link is replaced by a rename),
//!   and durably: its files are on the disk (`syncfs`) before it is recorded and switched to,
//!   and the switch before the install reports success — a write the disk refused fails the
//!   install, and a crash never leaves `current` naming a half-written package;
//!   a run that started before keeps the directory it resolved; the previous version is kept
//!   for one more install (rollback by hand), older ones are removed unless a run holds
//!   them (a shared `flock` on the version directory, [`crate::executor_run::Executor`]),
//!   and then by a later install;
//! - removal first renames the executor out of the way, so a half-deleted executor is never
//!   visible under its name, and the rename is on the disk before the removal succeeds; a
//!   version a run holds is deleted by a later install or removal;
//! - an archive is first copied into the root-only staging directory while its SHA-256 and
//!   its detached signature ([`crate::package_signing`]) are checked in the same pass; only
//!   that copy is unpacked, and only after both checks passed ([`PackageCheck`]; the verdict is
//!   audited as `package_signature`). With `executors.require_signature` an unsigned archive
//!   and any directory are refused; a signature that is present is never ignored; an archive
//!   larger than `executors.max_package_mb` is refused while it is copied;
//! - [`install_download`] (the `install_executor` command) first writes the download into a
//!   root-only staging file, bounded by the cap and the declared size, then installs that file
//!   exactly as above — the SHA-256 from the signed command is checked before unpacking;
//! - [`install_configured`] installs `executors.install` when the agent starts: a version
//!   already installed with the same content (the same files, contents and executable bits)
//!   is skipped, the same version with other content is refused (bump the version), and a
//!   failing entry is logged and audited (`executor_install_failed`) and skipped — the agent
//!   still starts. `agent --check-config` reports such entries as warnings.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use serde::Serialize;
use thiserror::Error;

use crate::executor_run::Executor;
use crate::package_signing::{Checker, Trust, Verdict};
use crate::policy::AgentPolicy;

pub const DEFAULT_ROOT: &str = "/var/lib/opservant/executors";
/// Most bytes an archive may unpack to.
pub const MAX_UNPACKED_BYTES: u64 = 256 * 1024 * 1024;
/// Most entries an archive may hold.
pub const MAX_ENTRIES: usize = 20_000;
/// The most names deep a package's path may go (`a/b/c` is 3). Packages need far fewer; a
/// deeper tree only exhausts — directories made for one deep file, and the walks over an
/// installed tree, which recurse.
pub const MAX_DEPTH: usize = 64;

#[derive(Debug, Error)]
pub enum InstallError {
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{name} {version} is already installed (install it with force to replace it: `--force`, or \"force\": true in install_executor)")]
    AlreadyInstalled { name: String, version: String },
    /// No signature where one is required (or a directory, which cannot be signed).
    #[error("{0}")]
    Unsigned(String),
    /// A signature that does not verify with a trusted key, or cannot be checked.
    #[error("{0}")]
    BadSignature(String),
    /// The archive's SHA-256 is not the one expected.
    #[error("{0}")]
    Checksum(String),
    /// The same version is installed with other content (installs from the configuration).
    #[error("{0}")]
    Conflict(String),
    /// The archive is larger than allowed (`executors.max_package_mb`, or a declared size).
    #[error("{0}")]
    TooLarge(String),
    /// The change could not be audited first, so it was not made.
    #[error("audit log: {0}; nothing was changed")]
    Audit(String),
    /// The process received a stop signal ([`stop_signalled`]) before the install's change.
    #[error("stopped by {}; nothing was installed", signal_name(*.0))]
    Interrupted(i32),
}

fn signal_name(sig: i32) -> &'static str {
    nix::sys::signal::Signal::try_from(sig).map_or("a signal", |s| s.as_str())
}

/// The stop signal this process received (0: none); see [`stop_signalled`].
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The process was asked to stop by `sig` (SIGINT, SIGTERM, …): an install under way stops
/// at its next step — before it records or changes anything of the installed executors —,
/// stops pip, and removes what it staged ([`InstallError::Interrupted`]); one past that
/// point completes (a rename and a link). Async-signal-safe (one atomic store): called from
/// a command-line caller's signal handler.
pub fn stop_signalled(sig: i32) {
    STOP_SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
}

fn check_stop() -> Result<(), InstallError> {
    match STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst) {
        0 => Ok(()),
        sig => Err(InstallError::Interrupted(sig)),
    }
}

impl InstallError {
    /// A stable reason code for audit records (the same as `command::Reason::of_install`).
    pub fn reason(&self) -> &'static str {
        match self {
            InstallError::Invalid(_) => "invalid_package",
            InstallError::Io { .. } => "cannot_run",
            InstallError::AlreadyInstalled { .. } => "already_installed",
            InstallError::Unsigned(_) => "unsigned_package",
            InstallError::BadSignature(_) => "bad_package_signature",
            InstallError::Checksum(_) => "checksum",
            InstallError::Conflict(_) => "version_conflict",
            InstallError::TooLarge(_) => "too_large",
            InstallError::Audit(_) => "cannot_run",
            InstallError::Interrupted(_) => "interrupted",
        }
    }
}

fn io(path: &Path, source: std::io::Error) -> InstallError {
    InstallError::Io { path: path.display().to_string(), source }
}

/// Where requirements come from, besides the package's own `wheels/` directory.
#[derive(Debug, Default, Clone)]
pub struct InstallOptions {
    pub force: bool,
    pub find_links: Vec<PathBuf>,
    pub index_url: Option<String>,
    /// Skip a version already installed with the same content (and refuse the same version
    /// with other content) instead of [`InstallError::AlreadyInstalled`].
    pub skip_identical: bool,
    /// A directory package's every entry must be root's or the agent's and writable by no
    /// one else (group-writable only by root's group): for what is installed unattended
    /// at every start (`executors.install`), where whoever could change a file would
    /// choose what the agent installs.
    pub owned_tree: bool,
}

/// The two archive formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArchiveKind {
    TarGz,
    Tar,
}

impl ArchiveKind {
    /// By the name: `.tar.gz`, `.tgz`, `.tar`.
    pub fn from_name(p: &Path) -> Result<ArchiveKind, InstallError> {
        let name = p.to_string_lossy();
        if name.ends_with(".tar.gz") || name.ends_with(".tgz") {
            Ok(ArchiveKind::TarGz)
        } else if name.ends_with(".tar") {
            Ok(ArchiveKind::Tar)
        } else {
            Err(InstallError::Invalid(format!(
                "{}: expected a .tar.gz, .tgz or .tar archive, or a directory",
                p.display()
            )))
        }
    }

    /// By the content (a download whose name does not tell): gzip magic, or a ustar header.
    pub fn sniff(p: &Path) -> Result<ArchiveKind, InstallError> {
        let mut head = [0u8; 262];
        let mut f = std::fs::File::open(p).map_err(|e| io(p, e))?;
        let mut n = 0;
        while n < head.len() {
            match f.read(&mut head[n..]).map_err(|e| io(p, e))? {
                0 => break,
                k => n += k,
            }
        }
        if n >= 2 && head[..2] == [0x1f, 0x8b] {
            Ok(ArchiveKind::TarGz)
        } else if n >= 262 && &head[257..262] == b"ustar" {
            Ok(ArchiveKind::Tar)
        } else {
            Err(InstallError::Invalid("the package is neither a gzip-compressed nor a plain tar archive".into()))
        }
    }
}

/// What an archive must satisfy before anything of it is unpacked.
pub struct PackageCheck<'a> {
    pub trust: &'a Trust,
    /// The detached signature (base64 text), when there is one ([`signature_for`]).
    pub signature: Option<String>,
    /// The SHA-256 (hex) the archive must have.
    pub sha256: Option<String>,
    /// Who asked — `cli`, `config`, `command` — for the audit record.
    pub source: &'a str,
    pub command_id: Option<&'a str>,
    /// The format, when the archive's name does not tell (default: by the name).
    pub kind: Option<ArchiveKind>,
    /// The largest archive accepted (`executors.max_package_mb`).
    pub max_bytes: u64,
    /// What the audit record calls the package (default: its path; a download: its name).
    pub label: Option<&'a str>,
}

/// The signature for `package`: the file `explicit` (which must exist), else `PACKAGE.sig`
/// beside an archive when it exists, else none.
pub fn signature_for(package: &Path, explicit: Option<&Path>) -> Result<Option<String>, InstallError> {
    if let Some(f) = explicit {
        return crate::package_signing::read_signature_file(f).map(Some).map_err(InstallError::BadSignature);
    }
    let beside = crate::package_signing::sig_path(package);
    if std::fs::symlink_metadata(package).is_ok_and(|m| m.is_file()) && std::fs::symlink_metadata(&beside).is_ok() {
        return crate::package_signing::read_signature_file(&beside).map(Some).map_err(InstallError::BadSignature);
    }
    Ok(None)
}

fn audit_verdict(check: &PackageCheck, package: &Path, sha: &str, verdict: &str, key: &str, detail: &str) {
    crate::audit::record(
        "package_signature",
        &[
            ("package", &check.label.map_or_else(|| package.to_string_lossy(), std::borrow::Cow::from)),
            ("source", check.source),
            ("command_id", check.command_id.unwrap_or("")),
            ("sha256", sha),
            ("signature", verdict),
            ("key", key),
            ("detail", detail),
        ],
    );
}

/// Copy `src` to the new file `dest` (0600) while hashing and verifying it; `Ok` only when
/// the SHA-256 matches (if one is expected) and the signature verdict allows installing.
/// Returns the SHA-256 and the trusted key the signature verified with (none: unsigned and
/// not required).
fn checked_copy(src: &Path, dest: &Path, check: &PackageCheck) -> Result<(String, Option<String>), InstallError> {
    // Not following a link, not blocking on a FIFO swapped in after the caller's check, and
    // a regular file on the open descriptor.
    let mut input = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(src)
        .map_err(|e| io(src, e))?;
    if !input.metadata().map_err(|e| io(src, e))?.is_file() {
        return Err(InstallError::Invalid(format!("{}: not a regular file", src.display())));
    }
    let mut out =
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(dest).map_err(|e| io(dest, e))?;
    let mut checker = Checker::new(check.signature.as_deref(), check.trust);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = input.read(&mut buf).map_err(|e| io(src, e))?;
        if n == 0 {
            break;
        }
        checker.update(&buf[..n]);
        if checker.bytes > check.max_bytes {
            return Err(InstallError::TooLarge(format!(
                "larger than {} bytes (executors.max_package_mb)",
                check.max_bytes
            )));
        }
        std::io::Write::write_all(&mut out, &buf[..n]).map_err(|e| io(dest, e))?;
    }
    out.sync_all().map_err(|e| io(dest, e))?;
    let (sha, verdict) = checker.finish();
    if let Some(want) = &check.sha256 {
        if !sha.eq_ignore_ascii_case(want.trim()) {
            let msg = format!("sha256 is {sha}, expected {want}");
            audit_verdict(check, src, &sha, "not_checked", "", &format!("checksum mismatch: {msg}"));
            return Err(InstallError::Checksum(msg));
        }
    }
    match verdict {
        Verdict::Valid(key) => {
            audit_verdict(check, src, &sha, "valid", &key, "");
            Ok((sha, Some(key)))
        }
        Verdict::Missing if check.trust.required => {
            let msg = match check.source {
                "cli" => format!(
                    "no signature, and executors.require_signature is on (give --signature FILE or put {} beside it)",
                    crate::package_signing::sig_path(src).display()
                ),
                _ => "no signature, and executors.require_signature is on".to_string(),
            };
            audit_verdict(check, src, &sha, "missing", "", "refused: a signature is required");
            Err(InstallError::Unsigned(msg))
        }
        Verdict::Missing => {
            audit_verdict(check, src, &sha, "missing", "", "accepted: signatures are not required");
            Ok((sha, None))
        }
        Verdict::Bad(why) => {
            audit_verdict(check, src, &sha, "bad", "", &why);
            Err(InstallError::BadSignature(why))
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Installed {
    pub name: String,
    pub version: String,
    pub path: PathBuf,
    pub previous: Option<String>,
    pub warnings: Vec<String>,
    /// Already installed with the same content, or a newer version is; nothing was changed
    /// ([`InstallOptions::skip_identical`]).
    pub unchanged: bool,
    /// The archive's SHA-256 (none for a directory).
    pub sha256: Option<String>,
    /// The trusted key its signature verified with (none: unsigned, or a directory).
    pub signed_by: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ListEntry {
    pub name: String,
    pub version: String,
    pub path: PathBuf,
    pub supported_actions: Vec<String>,
    pub description: String,
}

/// A staging directory removed on drop (whatever is left in it), locked (`flock`, exclusive)
/// while it is in use: [`sweep_leftovers`] never removes a locked one, so an install that
/// runs in another PID namespace — whose pid in the name means nothing here — keeps its
/// staging directory.
struct Staging {
    path: PathBuf,
    /// The directory, opened before anything was written into it: [`Staging::make_durable`]
    /// flushes its filesystem through it, and Linux reports to `syncfs` every write-back
    /// error of that filesystem since the descriptor was opened (5.8 and later).
    opened: std::fs::File,
    _lock: Option<nix::fcntl::Flock<std::fs::File>>,
}

impl Staging {
    /// A new staging directory `PREFIX-PID-N` in `root`, locked. A lock that cannot be
    /// taken (a filesystem without `flock`) leaves it to the pid check alone.
    fn new(root: &Path, prefix: &str) -> Result<Staging, InstallError> {
        let path = unique(root, prefix)?;
        let opened = std::fs::File::open(&path).map_err(|e| io(&path, e))?;
        let _lock = opened
            .try_clone()
            .ok()
            .and_then(|f| nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).ok());
        Ok(Staging { path, opened, _lock })
    }

    /// Everything written to the executors' filesystem so far is on the disk (`syncfs`), or
    /// an error saying so, and what it means (`consequence`): a write the disk refused during
    /// the install — even one the kernel wrote back before this call — fails it here. So does
    /// one that filesystem refused another writer since the staging directory was opened
    /// (the kernel keeps one write-back error per filesystem): failing closed, the message
    /// blames the filesystem, not the package. Before Linux 5.8 `syncfs` did not report
    /// write-back errors: there every file and directory of `tree` and each of `dirs` is
    /// `fsync`ed instead.
    fn make_durable(&self, consequence: &str, tree: Option<&Path>, dirs: &[&Path]) -> Result<(), InstallError> {
        let failed = |e: String| InstallError::Io {
            path: self.path.parent().unwrap_or(&self.path).display().to_string(),
            source: std::io::Error::other(format!(
                "the executors' filesystem reported a write error ({e}): {consequence}"
            )),
        };
        if syncfs_reports_errors() {
            return nix::unistd::syncfs(&self.opened).map_err(|e| failed(format!("syncfs: {e}")));
        }
        /// `fsync` of `p`, an error naming it.
        fn fsync(p: &Path) -> Result<(), String> {
            std::fs::File::open(p).and_then(|f| f.sync_all()).map_err(|e| format!("fsync {}: {e}", p.display()))
        }
        /// Every file and directory of the tree at `p`, depth first; an error names the
        /// entry that failed.
        fn fsync_tree(p: &Path) -> Result<(), String> {
            let named = |e: std::io::Error| format!("fsync {}: {e}", p.display());
            let meta = std::fs::symlink_metadata(p).map_err(named)?;
            if meta.is_dir() {
                for entry in std::fs::read_dir(p).map_err(named)? {
                    fsync_tree(&entry.map_err(named)?.path())?;
                }
            } else if !meta.is_file() {
                return Ok(());
            }
            fsync(p)
        }
        tree.map_or(Ok(()), fsync_tree).map_err(failed)?;
        dirs.iter().try_for_each(|d| fsync(d)).map_err(failed)
    }
}

/// `executors.dir` as installs and runs need it, checked by `agent --check-config` without
/// creating anything: not there yet (the first install makes it), or a directory that is
/// the agent's alone.
pub fn check_configured_root(root: &Path) -> Result<(), InstallError> {
    match std::fs::metadata(root) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(InstallError::Invalid(format!("executors.dir: {}: {e}", root.display()))),
        Ok(m) if !m.is_dir() => {
            Err(InstallError::Invalid(format!("executors.dir: {}: not a directory", root.display())))
        }
        Ok(m) => check_root(root, &m),
    }
}

/// Why the sandbox's user (`identity`, with no other groups) cannot search its way to the
/// executors' root `root`, judged by mode bits (ACLs not read): a run of any executor
/// installed there would fail at its sandbox's set-up. `None` when it can, or when `root`
/// is not there yet.
pub fn out_of_reach(root: &Path, identity: &sandbox::Identity) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let real = root.canonicalize().ok()?;
    for dir in real.ancestors() {
        let meta = std::fs::metadata(dir).ok()?;
        let search = if meta.uid() == identity.host_uid {
            0o100
        } else if meta.gid() == identity.host_gid {
            0o010
        } else {
            0o001
        };
        if meta.mode() & search == 0 {
            return Some(format!(
                "executors.dir {}: {} (mode {:04o}) is not searchable by the sandboxes' user (uid {}): every run of \
                 an executor installed there would fail at its set-up; make it searchable (chmod o+x) or move \
                 executors.dir",
                root.display(),
                dir.display(),
                meta.mode() & 0o7777,
                identity.host_uid
            ));
        }
    }
    None
}

/// Whether `syncfs(2)` reports the filesystem's write-back errors since its descriptor was
/// opened: Linux 5.8 and later (a release that cannot be read counts as older).
fn syncfs_reports_errors() -> bool {
    sandbox::probe::kernel_at_least((5, 8))
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Whether no process holds a lock on the directory `dir` (see [`Staging`]).
fn unlocked(dir: &Path) -> bool {
    match std::fs::File::open(dir) {
        Ok(f) => nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).is_ok(),
        Err(_) => false,
    }
}

/// The executors root must be the agent's alone ([`crate::config::check_agents_own_dir`]):
/// whoever may write to it decides what `opservant run NAME` runs, with the manifest's host
/// paths. `Invalid` names the rule it breaks.
pub fn check_root(root: &Path, meta: &std::fs::Metadata) -> Result<(), InstallError> {
    crate::config::check_agents_own_dir(root, meta).map_err(|m| InstallError::Invalid(format!("executors.dir: {m}")))
}

/// [`check_root`] on `root` before anything is written into it (a staging or download
/// directory): a root another user may write to could redirect those writes.
fn checked_root(root: &Path) -> Result<(), InstallError> {
    check_root(root, &std::fs::metadata(root).map_err(|e| io(root, e))?)
}

/// An exclusive `flock` on the executors root directory itself (no lock file among the
/// executors), released when the returned guard is dropped. The root is searchable but not
/// readable by others ([`ROOT_MODE`], tightened here on a root an older version made
/// 0755): a directory must be opened for reading to be locked, so no other user can hold
/// the lock and stall every install and removal.
pub(crate) fn lock_root(root: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, InstallError> {
    let mut dir = std::fs::File::open(root).map_err(|e| io(root, e))?;
    let meta = dir.metadata().map_err(|e| io(root, e))?;
    check_root(root, &meta)?;
    if meta.permissions().mode() & 0o044 != 0 {
        let mode = meta.permissions().mode() & 0o7777 & !0o044;
        dir.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|e| io(root, e))?;
        tracing::info!(path = %root.display(), mode = format!("{mode:04o}"), "executors root made unreadable to others");
    }
    loop {
        match nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusive) {
            Ok(lock) => {
                sweep_leftovers(root);
                return Ok(lock);
            }
            Err((f, nix::errno::Errno::EINTR)) => dir = f,
            Err((_, e)) => return Err(io(root, e.into())),
        }
    }
}

/// At the agent's start, before it takes commands: the sweep every holder of the root lock
/// makes ([`lock_root`]) — an install cut short between its copy and its switch is completed,
/// what interrupted installs and removals left is removed — so the agent's runs see the
/// version an install it was making when it stopped switched to. No root: nothing to do.
pub fn settle(root: &Path) -> Result<(), InstallError> {
    if !root.is_dir() {
        return Ok(());
    }
    lock_root(root).map(drop)
}

/// First completes installs cut short between their copy and their switch
/// ([`complete_interrupted_switches`]). Then removes the staging, download and removal
/// directories ([`unique`]: `.PREFIX-PID-N`) of
/// processes that are gone — an install killed part-way (SIGKILL, a power cut, a daemon
/// stopped mid-install) leaves its unpacked package, or a removed executor's files, behind,
/// and nothing else would ever delete them. A directory of a live process (this one's other
/// threads included) is never touched; one whose pid was reused waits for a later sweep; a
/// staging or download directory someone holds locked (an install in another PID namespace,
/// where its pid names nothing here: see [`Staging`]) is never touched either.
fn sweep_leftovers(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    let entries: Vec<std::fs::DirEntry> = entries.flatten().collect();
    complete_interrupted_switches(root, &entries);
    for e in entries {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = [".staging-", ".download-", ".removing-"].iter().find_map(|p| name.strip_prefix(p)) else {
            continue;
        };
        let Some((pid, n)) = rest.split_once('-') else { continue };
        let (Ok(pid), true) = (pid.parse::<i32>(), n.bytes().all(|b| b.is_ascii_digit()) && !n.is_empty()) else {
            continue;
        };
        if name.starts_with(".removing-") {
            // Removals run under the root lock, which the sweep holds: none is in progress.
            // What is left is an interrupted removal's, or versions that runs held.
            if e.file_type().is_ok_and(|t| t.is_dir()) && remove_doomed(&e.path()) {
                tracing::info!(path = %e.path().display(), "removed what an earlier removal left behind");
            }
            continue;
        }
        let gone = pid > 0
            && pid as u32 != std::process::id()
            && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) == Err(nix::errno::Errno::ESRCH);
        // Its pid gone here, and no lock on it: an install in another PID namespace holds
        // the lock on its staging directory for as long as it runs.
        // Nor one changed in the last minute: an install locks its directory just after
        // making it, and a sweep must not take it in between.
        let settled = e
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(60));
        if gone && settled && e.file_type().is_ok_and(|t| t.is_dir()) && unlocked(&e.path()) {
            match std::fs::remove_dir_all(e.path()) {
                Ok(()) => {
                    tracing::warn!(path = %e.path().display(), "removed what an interrupted install or removal left behind")
                }
                Err(err) => {
                    tracing::warn!(path = %e.path().display(), error = %err, "cannot remove what an interrupted install or removal left behind")
                }
            }
        }
    }
}

/// The marker of an install's switch in progress: the file `<root>/.switch-<name>`, JSON
/// naming the version directory `current` is about to name (`to`) and the one it names now
/// (`from`, null for a first install). It is on the disk (the file and the root `fsync`ed)
/// before the package is moved into place, and removed once the switch is on the disk, or
/// once the install failed short of the switch (or could not flush it:
/// [`Switching::unlink_unflushed`]). Installs and removals run under the root
/// lock, and every holder of the lock first settles what a marker names
/// ([`complete_interrupted_switches`]): one found then is an install's that was cut short
/// (a crash) or whose switch could not be flushed. Its package is complete (it was flushed
/// before the marker was written) and its `executor_install` record is in the audit log;
/// the switch is completed only while `current` still names `from` — not over a version an
/// operator or another agent switched to since. Without the marker, a copy `current` does
/// not name could not be told from the previous version each install keeps on purpose.
struct Switching {
    marker: PathBuf,
    root: PathBuf,
    /// Dealt with: not removed when dropped.
    keep: bool,
}

const SWITCH_MARKER: &str = ".switch-";

impl Switching {
    /// `marked`: the marker's content — the switch, and the install's own record's fields,
    /// repeated by the record of its completion or of its end.
    fn begin(root: &Path, name: &str, marked: &SwitchMarker) -> Result<Switching, InstallError> {
        let marker = root.join(format!("{SWITCH_MARKER}{name}"));
        let text = serde_json::to_string(marked).map_err(|e| InstallError::Invalid(e.to_string()))? + "\n";
        let written = (|| {
            let mut f =
                std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&marker)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::File::open(root)?.sync_all()
        })();
        written.map_err(|e| {
            let _ = std::fs::remove_file(&marker);
            io(&marker, std::io::Error::other(format!("{e}; nothing was switched")))
        })?;
        Ok(Switching { marker, root: root.to_path_buf(), keep: false })
    }

    /// The switch is made but could not be flushed: the marker is removed but not flushed.
    /// Until a restart no lock holder finds it — whatever `current` is made to name by hand
    /// meanwhile stays — while a restart that finds the package but not the switch most
    /// likely finds the marker too (its removal came after the switch), and has the switch
    /// completed.
    fn unlink_unflushed(mut self) {
        self.keep = true;
        let _ = std::fs::remove_file(&self.marker);
    }

    /// The switch is on the disk, or the install failed short of it: the marker goes.
    /// Whether its removal is on the disk (a marker left by a crash just before names the
    /// version `current` names, and is removed by the next lock holder).
    fn finish(mut self) -> bool {
        self.keep = true;
        let removed = remove_flushed(&self.marker, &self.root);
        if let Err(e) = &removed {
            tracing::warn!(marker = %self.marker.display(), error = %e, "an install's switch marker could not be removed");
        }
        removed.is_ok()
    }
}

impl Drop for Switching {
    /// An install that returned early between the marker and the switch (its package not
    /// moved into place): the marker goes.
    fn drop(&mut self) {
        if !self.keep {
            let _ = remove_flushed(&self.marker, &self.root);
        }
    }
}

/// Settles what [`Switching`] markers in `root` name, with the root lock held: an install
/// cut short between its copy and its switch is completed (`current` switched to its
/// version, on the disk, audited as `executor_installed` with `source: recovery` and the
/// install's own record's fields) when its version directory is there, its manifest loads
/// and `current` still names what it named before; otherwise the marker is removed and
/// nothing switched (audited as `executor_install_failed`, `source: recovery`, saying why;
/// a marker that cannot be read was never followed by its install's move — it was flushed
/// before it — and one naming the version `current` names is a finished install's). A
/// marker whose settling failed (an I/O error) stays for the next lock holder, and is
/// logged.
fn complete_interrupted_switches(root: &Path, entries: &[std::fs::DirEntry]) {
    for e in entries {
        let file_name = e.file_name();
        let Some(name) = file_name.to_str().and_then(|n| n.strip_prefix(SWITCH_MARKER)) else { continue };
        if !e.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        if let Err(error) = complete_switch(root, name, &e.path()) {
            tracing::error!(executor = name, marker = %e.path().display(), %error, "an interrupted install could not be settled; retried by the next install or removal, or at the agent's start");
        }
    }
}

/// Removes the file `path` and flushes its directory `dir`.
fn remove_flushed(path: &Path, dir: &Path) -> std::io::Result<()> {
    std::fs::remove_file(path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// Points `<name_dir>/current` at the version directory `dir_name` with one rename: a new
/// link beside it (`.current.new`), renamed over it. Not flushed. On failure the new link
/// does not stay.
fn point_current(name_dir: &Path, dir_name: &str) -> std::io::Result<()> {
    let tmp_link = name_dir.join(".current.new");
    let _ = std::fs::remove_file(&tmp_link);
    let switched = std::os::unix::fs::symlink(dir_name, &tmp_link)
        .and_then(|()| std::fs::rename(&tmp_link, name_dir.join("current")));
    if switched.is_err() {
        let _ = std::fs::remove_file(&tmp_link);
    }
    switched
}

/// What a switch marker says: the version directory to switch to, the text of the `current`
/// link before (none: a first install), and the install's `executor_install` record's
/// fields.
#[derive(serde::Serialize, serde::Deserialize)]
struct SwitchMarker {
    to: String,
    from: Option<String>,
    #[serde(default)]
    version: String,
    #[serde(default)]
    source: String,
    #[serde(default)]
    command_id: String,
    #[serde(default)]
    sha256: String,
    #[serde(default)]
    signed_by: String,
}

fn complete_switch(root: &Path, name: &str, marker: &Path) -> std::io::Result<()> {
    let remove = || remove_flushed(marker, root);
    let mut bytes = Vec::new();
    std::fs::File::open(marker)?.take(64 * 1024).read_to_end(&mut bytes)?;
    // Every marker's name is an executor's (a manifest's, checked): another one is not ours.
    if !crate::manifest::valid_name(name) {
        tracing::warn!(marker = %marker.display(), "a switch marker for no executor name removed");
        return remove();
    }
    let is_dir_name = |d: &str| !d.is_empty() && !d.starts_with('.') && !d.contains('/') && d != "current";
    let Some(m) = serde_json::from_slice::<SwitchMarker>(&bytes).ok().filter(|m| is_dir_name(&m.to)) else {
        // Flushed before its install moved anything: one written part-way was never followed.
        tracing::warn!(executor = name, marker = %marker.display(), "a switch marker that cannot be read (written part-way: its install moved nothing) removed");
        return remove();
    };
    // The install this marker is of ends here, one way or the other: audited with its own
    // record's fields (its `executor_install` was made before the marker).
    let record = |event: &str, detail: &str, previous: Option<&str>| {
        let mut fields = vec![
            ("executor", name),
            ("version", m.version.as_str()),
            ("source", "recovery"),
            ("install_source", m.source.as_str()),
            ("command_id", m.command_id.as_str()),
            ("sha256", m.sha256.as_str()),
            ("signed_by", m.signed_by.as_str()),
            ("dir", m.to.as_str()),
            ("detail", detail),
        ];
        if let Some(p) = previous {
            fields.push(("previous", p));
        }
        crate::audit::record(event, &fields);
    };
    let not_completed = |why: &str| -> std::io::Result<()> {
        tracing::warn!(executor = name, marker = %marker.display(), "an install cut short was not completed: {why}");
        record("executor_install_failed", &format!("an install cut short, not completed: {why}"), None);
        remove()
    };
    let name_dir = root.join(name);
    let dest = name_dir.join(&m.to);
    let current = name_dir.join("current");
    if !std::fs::symlink_metadata(&dest).is_ok_and(|d| d.is_dir()) {
        return not_completed(&format!("{} was never moved into place", m.to));
    }
    // Link texts compared as written (an operator's link may be absolute).
    let now = std::fs::read_link(&current).ok().map(|p| p.to_string_lossy().into_owned());
    if now.as_deref() == Some(m.to.as_str()) {
        // The switch was made (this marker's removal did not reach the disk).
        return remove();
    }
    if now != m.from {
        return not_completed(&format!(
            "`current` names {} now, not {} as when the install began: switched since",
            now.as_deref().unwrap_or("nothing"),
            m.from.as_deref().unwrap_or("nothing")
        ));
    }
    match crate::manifest::Manifest::load(&dest.join("manifest.json")) {
        Ok((manifest, _)) if manifest.name == name => {}
        Ok((manifest, _)) => return not_completed(&format!("{} holds executor {}, not {name}", m.to, manifest.name)),
        Err(e) => return not_completed(&format!("{}'s manifest does not load: {}", m.to, e.message)),
    }
    point_current(&name_dir, &m.to)?;
    std::fs::File::open(&name_dir)?.sync_all()?;
    tracing::warn!(
        executor = name,
        version = m.version,
        dir = m.to,
        "completed an install that was cut short between its copy and its switch"
    );
    record(
        "executor_installed",
        "an install cut short between its copy and its switch, completed",
        Some(m.from.as_deref().unwrap_or("")),
    );
    remove()
}

/// A directory removed on drop if it is empty then (`rmdir`: never anything in it).
struct RemoveIfEmpty(PathBuf);

impl Drop for RemoveIfEmpty {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn mkdir(p: &Path) -> Result<(), InstallError> {
    std::fs::DirBuilder::new().mode(0o755).create(p).map_err(|e| io(p, e))
}

/// The executors root's mode: sandboxes read packages as the executor user and must
/// traverse it; nobody else may list (or lock, see [`lock_root`]) it.
const ROOT_MODE: u32 = 0o711;

/// The executors root ([`ROOT_MODE`]) or a package's name directory (0755), created if
/// missing, with that mode whatever the umask (the systemd unit's is 0077). An existing one
/// keeps its mode: a root others may write to is refused by [`lock_root`], not quietly
/// mended.
fn traversable_dir(p: &Path, mode: u32) -> Result<(), InstallError> {
    if p.is_dir() {
        return Ok(());
    }
    if std::fs::symlink_metadata(p).is_ok() {
        return Err(InstallError::Invalid(format!("{}: not a directory", p.display())));
    }
    std::fs::DirBuilder::new().mode(mode).recursive(true).create(p).map_err(|e| io(p, e))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(|e| io(p, e))
}

/// Install from a package directory or archive, after `check` ([`PackageCheck`]) passed.
pub fn install(
    src: &Path,
    root: &Path,
    policy: &AgentPolicy,
    opts: &InstallOptions,
    check: &PackageCheck,
) -> Result<Installed, InstallError> {
    let meta = std::fs::symlink_metadata(src).map_err(|e| io(src, e))?;
    let kind = if meta.is_dir() {
        if check.trust.required {
            audit_verdict(check, src, "", "missing", "", "refused: a directory cannot be signed");
            return Err(InstallError::Unsigned(
                "a directory cannot be signed, and executors.require_signature is on: install a signed archive (tar czf PKG.tar.gz …; opservant sign --key KEY --package PKG.tar.gz)".into(),
            ));
        }
        if check.signature.is_some() || check.sha256.is_some() {
            return Err(InstallError::Invalid(
                "a signature or sha256 applies to an archive, not to a directory".into(),
            ));
        }
        None
    } else if meta.is_file() {
        Some(match check.kind {
            Some(k) => k,
            None => ArchiveKind::from_name(src)?,
        })
    } else {
        return Err(InstallError::Invalid(format!("{}: not a directory or an archive", src.display())));
    };
    // A root this install creates is removed again if it stays empty (the install failed):
    // declared before the staging directory, so it is dropped after it.
    let _new_root = (!root.exists()).then(|| RemoveIfEmpty(root.to_path_buf()));
    traversable_dir(root, ROOT_MODE)?;
    // A package holding the executors directory would be copied into its own staging
    // directory, deeper and deeper (judged once the root is there: a first install's too).
    if kind.is_none() {
        let real_src = src.canonicalize().map_err(|e| io(src, e))?;
        let real_root = root.canonicalize().map_err(|e| io(root, e))?;
        if real_root.starts_with(&real_src) {
            return Err(InstallError::Invalid(format!(
                "it holds the executors directory {}; a package cannot",
                root.display()
            )));
        }
    }
    checked_root(root)?;
    let staging = Staging::new(root, ".staging")?;
    let unpacked = staging.path.join("pkg");
    let (sha256, signed_by) = match kind {
        None => {
            let mut budget = Budget { owned_only: opts.owned_tree, ..Budget::default() };
            copy_tree(src, &unpacked, &mut budget)?;
            (None, None)
        }
        Some(kind) => {
            // Verified and unpacked from the same private copy.
            let archive = staging.path.join("archive");
            let (sha, key) = checked_copy(src, &archive, check)?;
            check_stop()?;
            unpack(&archive, kind, src, &unpacked)?;
            std::fs::remove_file(&archive).map_err(|e| io(&archive, e))?;
            (Some(sha), key)
        }
    };
    check_stop()?;
    let pkg = package_root(&unpacked)?;
    let text = crate::manifest::read_in_package(&pkg)
        .map_err(|e| InstallError::Invalid(format!("manifest.json: {}", e.message)))?;
    let (manifest, errors, _) = crate::manifest::Manifest::check(&text);
    let Some(manifest) = manifest.filter(|_| errors.is_empty()) else {
        let list: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        return Err(InstallError::Invalid(format!("manifest.json: {}", list.join("; "))));
    };
    // One install or removal at a time per root changes or compares the installed versions
    // (the daemon serves commands on several threads; an operator may install at the same
    // time): two at once raced for `current` and removed each other's versions. Not held
    // across pip, lint and precompiling (minutes, at worst), which touch only the staging copy.
    let lock = lock_root(root)?;
    if opts.skip_identical {
        let name_dir = root.join(&manifest.name);
        // A newer version is current (installed later, e.g. by a command): never downgrade.
        let current = std::fs::read_link(name_dir.join("current")).ok();
        // By its manifest; a directory whose manifest no longer loads by its name (`VERSION`
        // or a forced copy's `VERSION~N`), so that a broken `current` is not replaced by an
        // older version either (a link to nothing is replaced).
        let mut broken = None;
        let current_version = current.as_ref().and_then(|c| {
            let dir = name_dir.join(c);
            match crate::executor_run::Executor::load(&dir) {
                Ok(e) => Some(e.manifest.version),
                Err(e) if std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) => {
                    broken = Some(e.0);
                    version_of_dir_name(&c.to_string_lossy())
                }
                Err(_) => None,
            }
        });
        if let (Some(cur), Ok(new)) = (&current_version, semver::Version::parse(&manifest.version)) {
            if semver::Version::parse(cur).is_ok_and(|cur| cur > new) {
                let mut warnings = vec![format!(
                    "{} {cur} is installed, newer than {}: left as it is",
                    manifest.name, manifest.version
                )];
                if let Some(why) = broken {
                    warnings.push(format!("{} {cur}, which `current` names, does not load: {why}", manifest.name));
                }
                return Ok(Installed {
                    warnings,
                    path: name_dir.join("current"),
                    name: manifest.name,
                    version: cur.clone(),
                    previous: None,
                    unchanged: true,
                    sha256,
                    signed_by,
                });
            }
        }
        let digest = tree_digest(&pkg)?;
        let mut same_version = false;
        if let Ok(entries) = std::fs::read_dir(&name_dir) {
            for e in entries.flatten() {
                if !is_version_dir(&e.path(), &manifest.version) || !e.path().is_dir() {
                    continue;
                }
                same_version = true;
                if tree_digest(&e.path())? == digest {
                    return Ok(Installed {
                        name: manifest.name,
                        version: manifest.version,
                        path: e.path(),
                        previous: None,
                        warnings: vec![],
                        unchanged: true,
                        sha256,
                        signed_by,
                    });
                }
            }
        }
        if same_version {
            return Err(InstallError::Conflict(format!(
                "{} {} is already installed with different content (bump the version, or remove it first)",
                manifest.name, manifest.version
            )));
        }
    }
    drop(lock);
    if pkg.join(".deps").exists() {
        return Err(InstallError::Invalid(
            ".deps: a package must not bring its own .deps (requirements are installed from wheels)".into(),
        ));
    }
    let mut warnings: Vec<String> = out_of_reach(root, &policy.identity).into_iter().collect();
    if !manifest.requirements.packages.is_empty() {
        let offered = package_wheels(&pkg, &staging.path.join("wheels"))?;
        warnings.extend(offered.ignored.iter().map(|n| format!("wheels/{n}: not a wheel, not offered to pip")));
        let work = staging.path.join("pip");
        install_requirements(&pkg, &work, offered.dir.as_deref(), &manifest.requirements.packages, opts)?;
    }
    check_stop()?;
    let report = crate::lint::lint(&pkg, policy).map_err(|e| InstallError::Invalid(e.to_string()))?;
    if !report.errors.is_empty() {
        return Err(InstallError::Invalid(report.errors.join("; ")));
    }
    // Normalise permissions: the sandbox reads the package as an unprivileged user.
    normalise_modes(&pkg)?;
    warnings.extend(report.warnings);
    // Bytecode caches, compiled in a sandbox; best effort (see `crate::bytecode`). The
    // sandbox's unprivileged user must reach the package: the staging directory becomes
    // traversable (not listable); everything in it is world-readable from here on, as the
    // installed package is.
    // So does every directory between it and the package (created under the agent's umask:
    // the systemd unit's 0077 made them 0700, and nothing was precompiled).
    std::fs::set_permissions(&staging.path, std::fs::Permissions::from_mode(0o711))
        .map_err(|e| io(&staging.path, e))?;
    for dir in pkg.ancestors().skip(1).take_while(|d| d.starts_with(&staging.path) && *d != staging.path) {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).map_err(|e| io(dir, e))?;
    }
    match crate::bytecode::precompile(&pkg, policy) {
        Ok(p) => {
            tracing::info!(executor = %manifest.name, written = p.written, failed = p.failed.len(), "bytecode precompiled");
            warnings.extend(p.failed.iter().map(|f| format!("bytecode not precompiled: {f}")));
        }
        Err(e) => warnings.push(format!("bytecode not precompiled: {e}")),
    }

    // The last point a stop signal stops the install (the precompiling sandbox, stopped by
    // it, reported only a warning): from the record on, it completes.
    check_stop()?;
    // The version already there: refused before anything is recorded (a refused install
    // is not logged as an install), unless forced. Locked to the end.
    let _lock = lock_root(root)?;
    let name_dir = root.join(&manifest.name);
    let mut dir_name = manifest.version.clone();
    let installed = std::fs::read_dir(&name_dir)
        .is_ok_and(|entries| entries.flatten().any(|e| is_version_dir(&e.path(), &manifest.version)));
    if installed {
        if !opts.force {
            return Err(InstallError::AlreadyInstalled { name: manifest.name, version: manifest.version });
        }
        // `~` is not in any semantic version: the directory can never be a later version's.
        let n = (1..).find(|n| !name_dir.join(format!("{}~{n}", manifest.version)).exists()).unwrap_or(1);
        dir_name = format!("{}~{n}", manifest.version);
    }
    // The new version's files are on the disk before anything points to them: a crash after
    // the switch below never leaves `current` naming a half-written package, and a disk that
    // refused a write fails the install here, with nothing switched or recorded.
    staging.make_durable(
        &format!("{} {} is not on the disk; nothing was switched", manifest.name, manifest.version),
        Some(&staging.path),
        &[],
    )?;
    // Fail closed: the executors that can run change only once the change is in the audit
    // log (`executor_installed` follows it).
    crate::audit::try_record(
        "executor_install",
        &[
            ("executor", &manifest.name),
            ("version", &manifest.version),
            ("source", check.source),
            ("command_id", check.command_id.unwrap_or("")),
            ("sha256", sha256.as_deref().unwrap_or("")),
            ("signed_by", signed_by.as_deref().unwrap_or("")),
        ],
    )
    .map_err(|e| InstallError::Audit(e.to_string()))?;
    traversable_dir(&name_dir, 0o755)?;
    let dest = name_dir.join(&dir_name);
    // From the copy to the switch, a marker on the disk names the version being switched to:
    // an install cut short in between (SIGKILL, a power cut) is completed by the next process
    // that takes the root lock ([`complete_interrupted_switches`]).
    let current_link = std::fs::read_link(name_dir.join("current")).ok().map(|p| p.to_string_lossy().into_owned());
    // The previous version's directory, kept below: `current` as this agent writes it (a
    // bare name), or an operator's link (absolute, `./X`) resolved to a directory here.
    let previous = current_link.as_ref().and_then(|link| {
        let p = Path::new(link);
        match p.file_name().and_then(|f| f.to_str()) {
            Some(f) if p.components().count() == 1 => Some(f.to_string()),
            _ => {
                let resolved = name_dir.join(p).canonicalize().ok()?;
                let here = name_dir.canonicalize().ok()?;
                (resolved.parent() == Some(here.as_path()))
                    .then(|| resolved.file_name()?.to_str().map(str::to_string))
                    .flatten()
            }
        }
    });
    let switching = Switching::begin(
        root,
        &manifest.name,
        &SwitchMarker {
            to: dir_name.clone(),
            from: current_link,
            version: manifest.version.clone(),
            source: check.source.to_string(),
            command_id: check.command_id.unwrap_or("").to_string(),
            sha256: sha256.clone().unwrap_or_default(),
            signed_by: signed_by.clone().unwrap_or_default(),
        },
    )?;
    std::fs::rename(&pkg, &dest).map_err(|e| io(&dest, e))?;
    // The switch. If it fails, the new version's directory goes too: nothing of a refused
    // package is left behind.
    if let Err(e) = point_current(&name_dir, &dir_name).map_err(|e| io(&name_dir.join("current"), e)) {
        // Back into the staging directory (removed with it): gone from the name's directory
        // at once, never half-deleted there while a marker names it — and that on the disk
        // before the marker goes (a filesystem need not order the two). Failing that,
        // deleted in place once the marker is gone.
        if std::fs::rename(&dest, &pkg).is_ok() {
            if let Err(err) = std::fs::File::open(&name_dir).and_then(|d| d.sync_all()) {
                tracing::warn!(dir = %name_dir.display(), error = %err, "a failed switch's move back could not be flushed");
            }
        } else if switching.finish() {
            let _ = std::fs::remove_dir_all(&dest);
        }
        return Err(e);
    }
    // The switch itself (and a first install's new directories) on the disk too. Should that
    // fail, the new version is in place until the host restarts, and may not be after: the
    // install is reported failed, saying so.
    let flushed = staging.make_durable(
        &format!(
            "{name}'s `current` names {dir_name} now but may not after a restart; the agent's \
             start after it then completes the switch if {dir_name} reached the disk — if \
             `opservant executor list` still shows the version before, install it again with force \
             (`--force`, or \"force\": true in install_executor)",
            name = manifest.name
        ),
        None,
        &[&name_dir, root],
    );
    if let Err(e) = flushed {
        switching.unlink_unflushed();
        return Err(e);
    }
    switching.finish();
    // Keep the new and the previous version; remove older ones that no run holds (a later
    // install removes those).
    if let Ok(entries) = std::fs::read_dir(&name_dir) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n == "current" || n == dir_name || Some(&n) == previous.as_ref() || n.starts_with('.') {
                continue;
            }
            let _ = remove_unless_in_use(&e.path());
        }
    }
    Ok(Installed {
        name: manifest.name,
        version: manifest.version,
        path: dest,
        previous,
        warnings,
        unchanged: false,
        sha256,
        signed_by,
    })
}

/// Removes the old version directory `dir` unless a run holds it (the shared lock of
/// [`crate::executor_run::Executor`]): the exclusive lock is tried without waiting and held
/// until the directory is gone, so a run loading it meanwhile waits and then sees it removed.
/// Whether it is gone.
fn remove_unless_in_use(dir: &Path) -> bool {
    let Ok(file) = std::fs::File::open(dir) else { return !dir.exists() };
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => {
            let removed = std::fs::remove_dir_all(dir);
            drop(lock);
            if let Err(e) = &removed {
                tracing::warn!(dir = %dir.display(), error = %e, "an executor version could not be removed");
            }
            removed.is_ok()
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            tracing::info!(dir = %dir.display(), "an executor version is in use by a run: kept until a later install or removal");
            false
        }
        Err((_, e)) => {
            tracing::warn!(dir = %dir.display(), error = %e, "an executor version could not be locked");
            false
        }
    }
}

/// Empties a `.removing-PID-N` directory (`doomed/<name>/<version>…`) but for the versions a
/// run still holds ([`remove_unless_in_use`]), and removes it once nothing is left. Whether it
/// is gone.
fn remove_doomed(doomed: &Path) -> bool {
    let Ok(names) = std::fs::read_dir(doomed) else { return !doomed.exists() };
    for name in names.flatten() {
        if !name.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = std::fs::remove_file(name.path());
            continue;
        }
        if let Ok(versions) = std::fs::read_dir(name.path()) {
            for v in versions.flatten() {
                if v.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_unless_in_use(&v.path());
                } else {
                    let _ = std::fs::remove_file(v.path());
                }
            }
        }
        let _ = std::fs::remove_dir(name.path());
    }
    std::fs::remove_dir(doomed).is_ok()
}

/// The version an installed directory's name gives: `VERSION`, or a forced copy's
/// `VERSION~N` (`VERSION.N` before 2026-11-24); none when that is not a semantic version.
fn version_of_dir_name(name: &str) -> Option<String> {
    let copy_of = |sep: char| name.rsplit_once(sep).filter(|(_, n)| n.parse::<u32>().is_ok()).map(|(v, _)| v);
    [Some(name), copy_of('~'), copy_of('.')]
        .into_iter()
        .flatten()
        .find(|v| semver::Version::parse(v).is_ok())
        .map(str::to_string)
}

/// Whether the installed directory `dir` holds `version`: the version itself, or a forced
/// copy of it (`VERSION~N`, or `VERSION.N` as agents before 2026-11-24 named it; a name that
/// is also a version of its own, as `1.0.0-rc.1` is beside `1.0.0-rc`, is decided by the
/// manifest inside).
fn is_version_dir(dir: &Path, version: &str) -> bool {
    let Some(name) = dir.file_name().and_then(|n| n.to_str()) else { return false };
    let digits = |k: &str| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit());
    if name == version || name.strip_prefix(version).and_then(|r| r.strip_prefix('~')).is_some_and(digits) {
        return true;
    }
    if !name.strip_prefix(version).and_then(|r| r.strip_prefix('.')).is_some_and(digits) {
        return false;
    }
    semver::Version::parse(name).is_err()
        || crate::manifest::Manifest::load(&dir.join("manifest.json")).is_ok_and(|(m, _)| m.version == version)
}

/// Install a package downloaded for an `install_executor` command: the body is written into
/// a root-only staging file named after the package — at most `check.max_bytes` bytes, and
/// exactly `size` when the command declared one — and then installed like a local archive
/// ([`install`]: SHA-256 and signature checked on a private copy before anything is
/// unpacked). The format is told by the content, not the name. Nothing is left behind on
/// failure.
pub fn install_download<'a>(
    body: &mut dyn Read,
    name: &'a str,
    size: Option<u64>,
    root: &Path,
    policy: &AgentPolicy,
    opts: &InstallOptions,
    mut check: PackageCheck<'a>,
) -> Result<Installed, InstallError> {
    if name.is_empty() || name.starts_with('.') || name.contains('/') {
        return Err(InstallError::Invalid(format!("{name:?}: not a valid package name")));
    }
    if let Some(size) = size.filter(|s| *s > check.max_bytes) {
        return Err(InstallError::TooLarge(format!(
            "{name}: the declared size {size} is more than the {} bytes allowed (executors.max_package_mb)",
            check.max_bytes
        )));
    }
    let cap = size.unwrap_or(check.max_bytes);
    // As in `install`: a root this creates goes again if the install fails.
    let _new_root = (!root.exists()).then(|| RemoveIfEmpty(root.to_path_buf()));
    traversable_dir(root, ROOT_MODE)?;
    checked_root(root)?;
    let staging = Staging::new(root, ".download")?;
    let file = staging.path.join(name);
    let mut out =
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&file).map_err(|e| io(&file, e))?;
    let n = std::io::copy(&mut body.take(cap + 1), &mut out).map_err(|e| io(&file, e))?;
    if n > cap {
        return Err(InstallError::TooLarge(match size {
            Some(s) => format!("{name}: the download is larger than the {s} bytes the command declared"),
            None => format!("{name}: the download is larger than {cap} bytes (executors.max_package_mb)"),
        }));
    }
    if let Some(s) = size.filter(|s| *s != n) {
        return Err(InstallError::Invalid(format!("{name}: downloaded {n} bytes, the command declared {s}")));
    }
    out.sync_all().map_err(|e| io(&file, e))?;
    drop(out);
    check.kind = Some(ArchiveKind::sniff(&file)?);
    check.label = check.label.or(Some(name));
    install(&file, root, policy, opts, &check)
}

/// A digest of a package tree: relative paths, kinds, executable bits and file contents,
/// in name order; `__pycache__` anywhere and the top-level `.deps` are left out.
fn tree_digest(dir: &Path) -> Result<String, InstallError> {
    fn walk(base: &Path, rel: &Path, h: &mut sha2::Sha256) -> Result<(), InstallError> {
        use sha2::Digest;
        let here = base.join(rel);
        let mut entries: Vec<_> =
            std::fs::read_dir(&here).map_err(|e| io(&here, e))?.collect::<Result<_, _>>().map_err(|e| io(&here, e))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name();
            if name == "__pycache__" || (rel.as_os_str().is_empty() && name == ".deps") {
                continue;
            }
            let r = rel.join(&name);
            let meta = std::fs::symlink_metadata(e.path()).map_err(|err| io(&e.path(), err))?;
            h.update(r.as_os_str().as_encoded_bytes());
            h.update([0]);
            if meta.is_dir() {
                h.update(b"D");
                walk(base, &r, h)?;
            } else if meta.is_file() {
                h.update(if meta.permissions().mode() & 0o111 != 0 { b"X" } else { b"F" });
                let mut f = std::fs::File::open(e.path()).map_err(|err| io(&e.path(), err))?;
                let mut fh = sha2::Sha256::new();
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match f.read(&mut buf).map_err(|err| io(&e.path(), err))? {
                        0 => break,
                        n => fh.update(&buf[..n]),
                    }
                }
                h.update(fh.finalize());
            } else {
                h.update(b"O");
            }
        }
        Ok(())
    }
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    walk(dir, Path::new(""), &mut h)?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// `executors.install` problems found without installing (`agent --check-config`): missing
/// entries, directories or unsigned archives under `require_signature`, bad signatures; and
/// an executors root the sandboxes' user (`identity`) cannot reach.
pub fn check_configured(config: &crate::config::Config, trust: &Trust, identity: &sandbox::Identity) -> Vec<String> {
    let mut problems: Vec<String> = out_of_reach(&config.executors.root(), identity).into_iter().collect();
    for (i, p) in config.executors.install.iter().enumerate() {
        let at = format!("executors.install[{i}]: {}", p.display());
        let meta = match std::fs::symlink_metadata(p) {
            Ok(m) => m,
            Err(e) => {
                problems.push(format!("{at}: {e}"));
                continue;
            }
        };
        if let Err(e) = configured_source_trusted(&format!("executors.install[{i}]"), p) {
            problems.push(e.to_string());
            continue;
        }
        if meta.is_dir() {
            if trust.required {
                problems.push(format!("{at}: a directory cannot be signed, and executors.require_signature is on"));
            }
            continue;
        }
        if !meta.is_file() {
            problems.push(format!("{at}: not a directory or an archive"));
            continue;
        }
        if let Err(e) = ArchiveKind::from_name(p) {
            problems.push(format!("{at}: {e}"));
            continue;
        }
        let sig = match signature_for(p, None) {
            Ok(s) => s,
            Err(e) => {
                problems.push(format!("{at}: {e}"));
                continue;
            }
        };
        match crate::package_signing::check_file(p, sig.as_deref(), trust, config.executors.max_package_bytes()) {
            Err(e) => problems.push(format!("{at}: {e}")),
            Ok((_, Verdict::Bad(why))) => problems.push(format!("{at}: {why}")),
            Ok((_, Verdict::Missing)) if trust.required => {
                problems.push(format!("{at}: no signature, and executors.require_signature is on"))
            }
            Ok(_) => {}
        }
    }
    problems
}

/// An `executors.install` entry is installed as root at every start, signed or not (unless
/// `executors.require_signature`): like the files the agent trusts, an archive must be
/// root's or the agent's and writable by no one else, a directory the agent's own and
/// writable by no one else, and so the way to either ([`crate::config::check_trust_file`],
/// [`crate::config::check_agents_own_dir`]) — whoever else could change it would choose
/// what the agent installs. (What lies inside a directory is checked as it is copied:
/// [`InstallOptions::owned_tree`].)
fn configured_source_trusted(entry: &str, p: &Path) -> Result<(), InstallError> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => crate::config::check_agents_own_dir(p, &m).map_err(|e| {
            InstallError::Invalid(format!(
                "{entry}: {e}: whoever else could change it would choose what the agent installs"
            ))
        }),
        Ok(_) => crate::config::check_trust_file(entry, p).map_err(InstallError::Invalid),
        // Missing: reported as the install's own error.
        Err(_) => Ok(()),
    }
}

/// An `executors.install` entry that did not install at agent start (reported in heartbeats
/// and `ping` replies until the agent restarts).
#[derive(Debug, Clone, serde::Serialize)]
pub struct InstallFailure {
    /// `executors.install[N]`.
    pub entry: String,
    pub package: String,
    pub error: String,
}

/// Install `executors.install` (at agent start): each entry checked like `executor install`
/// (signature rules included), an identical version skipped; a failure is logged and audited
/// (`executor_install_failed`) and that entry skipped. Returns the entries that failed.
pub fn install_configured(config: &crate::config::Config, policy: &AgentPolicy, trust: &Trust) -> Vec<InstallFailure> {
    let root = config.executors.root();
    let opts = InstallOptions { skip_identical: true, owned_tree: true, ..Default::default() };
    let mut failed = Vec::new();
    for (i, p) in config.executors.install.iter().enumerate() {
        let entry = format!("executors.install[{i}]");
        let package = p.to_string_lossy();
        let result = configured_source_trusted(&entry, p).and_then(|()| signature_for(p, None)).and_then(|signature| {
            let check = PackageCheck {
                trust,
                signature,
                sha256: None,
                source: "config",
                command_id: None,
                kind: None,
                max_bytes: config.executors.max_package_bytes(),
                label: None,
            };
            install(p, &root, policy, &opts, &check)
        });
        match result {
            Ok(i) if i.unchanged => {
                tracing::info!(entry, package = %package, executor = %i.name, version = %i.version, "already installed, unchanged");
                for warning in &i.warnings {
                    tracing::warn!(entry, package = %package, executor = %i.name, "{warning}");
                }
            }
            Ok(i) => {
                tracing::info!(entry, package = %package, executor = %i.name, version = %i.version, "installed");
                crate::audit::record(
                    "executor_installed",
                    &[("executor", &i.name), ("version", &i.version), ("source", "config"), ("package", &package)],
                );
            }
            Err(e) => {
                let error = e.to_string();
                tracing::error!(entry, package = %package, error = %error, "not installed; the agent starts without it");
                crate::audit::record(
                    "executor_install_failed",
                    &[("source", "config"), ("entry", &entry), ("package", &package), ("error", &error)],
                );
                failed.push(InstallFailure { entry, package: package.into_owned(), error });
            }
        }
    }
    failed
}

/// A fresh directory `<root>/<prefix>-<pid>-<n>`.
fn unique(root: &Path, prefix: &str) -> Result<PathBuf, InstallError> {
    for n in 0..1000 {
        let p = root.join(format!("{prefix}-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io(&p, e)),
        }
    }
    Err(InstallError::Invalid(format!("{}: no free staging directory name", root.display())))
}

#[derive(Default)]
struct Budget {
    bytes: u64,
    entries: usize,
    /// [`InstallOptions::owned_tree`]: [`copy_dir`] refuses an entry another user could change.
    owned_only: bool,
}

/// A path of more than [`MAX_DEPTH`] names is refused, naming it.
fn check_depth(path: &Path, depth: usize) -> Result<(), InstallError> {
    if depth > MAX_DEPTH {
        return Err(InstallError::Invalid(format!(
            "{}: more than {MAX_DEPTH} names deep (a package's paths are refused beyond)",
            path.display()
        )));
    }
    Ok(())
}

impl Budget {
    fn entry(&mut self) -> Result<(), InstallError> {
        check_stop()?;
        self.entries += 1;
        if self.entries > MAX_ENTRIES {
            return Err(InstallError::Invalid(format!("the package has more than {MAX_ENTRIES} entries")));
        }
        Ok(())
    }

    /// Copy at most the remaining byte budget from `r` into a new file `dest`; an error
    /// reading `r` becomes `read_error(e)`, one writing `dest` names `dest`.
    fn copy(
        &mut self,
        r: &mut dyn Read,
        dest: &Path,
        executable: bool,
        read_error: impl Fn(std::io::Error) -> InstallError,
    ) -> Result<(), InstallError> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(if executable { 0o755 } else { 0o644 })
            .open(dest)
            .map_err(|e| io(dest, e))?;
        let left = MAX_UNPACKED_BYTES - self.bytes;
        let mut r = r.take(left + 1);
        let mut buf = vec![0u8; 64 * 1024];
        let mut n = 0u64;
        loop {
            let got = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(got) => got,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(read_error(e)),
            };
            f.write_all(&buf[..got]).map_err(|e| io(dest, e))?;
            n += got as u64;
        }
        self.bytes += n;
        if self.bytes > MAX_UNPACKED_BYTES {
            return Err(InstallError::Invalid(format!("the package unpacks to more than {MAX_UNPACKED_BYTES} bytes")));
        }
        Ok(())
    }
}

/// A relative path made only of normal components (no `..`, no root, UTF-8).
fn safe_relative(p: &Path) -> Result<PathBuf, InstallError> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(s) => {
                let s =
                    s.to_str().ok_or_else(|| InstallError::Invalid(format!("{}: name is not UTF-8", p.display())))?;
                out.push(s);
            }
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(InstallError::Invalid(format!("{}: '..' in an archive path is refused", p.display())))
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(InstallError::Invalid(format!("{}: absolute archive paths are refused", p.display())))
            }
        }
    }
    Ok(out)
}

/// What a tar stream may hold beyond the files' bytes (headers, long names, padding).
const MAX_TAR_OVERHEAD: u64 = 64 * 1024 * 1024;

/// A reader that fails once more than `left` bytes have been read, and says so in
/// `exceeded` (the tar reader reports the failure as a malformed archive).
struct Capped<R> {
    inner: R,
    left: u64,
    exceeded: std::rc::Rc<std::cell::Cell<bool>>,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.left = self.left.checked_sub(n as u64).ok_or_else(|| {
            self.exceeded.set(true);
            std::io::Error::new(std::io::ErrorKind::InvalidData, capped_message())
        })?;
        Ok(n)
    }
}

fn capped_message() -> String {
    format!("the archive unpacks to more than {} bytes", MAX_UNPACKED_BYTES + MAX_TAR_OVERHEAD)
}

/// Unpack `file` (of `kind`) into `dest`; messages name `archive` (where it came from).
///
/// Two passes over the stream: [`check_headers`] first bounds what the `tar` reader would
/// read into memory whole (long names, PAX headers) before any of it is read, then
/// [`unpack_stream`] unpacks. Both read the decompressed stream through the same cap.
fn unpack(file: &Path, kind: ArchiveKind, archive: &Path, dest: &Path) -> Result<(), InstallError> {
    let (reader, exceeded) = open_stream(file, kind)?;
    check_headers(reader, archive, kind == ArchiveKind::TarGz).map_err(|e| capped(&exceeded, archive, e))?;
    let (reader, exceeded) = open_stream(file, kind)?;
    mkdir(dest)?;
    unpack_stream(reader, archive, dest).map_err(|e| capped(&exceeded, archive, e))
}

/// The decompressed tar stream of `file`, capped (see [`Capped`]); the flag says whether a
/// read failed at the cap.
#[allow(clippy::type_complexity)]
fn open_stream(
    file: &Path,
    kind: ArchiveKind,
) -> Result<(Capped<Box<dyn Read>>, std::rc::Rc<std::cell::Cell<bool>>), InstallError> {
    let f = std::fs::File::open(file).map_err(|e| io(file, e))?;
    let reader: Box<dyn Read> = match kind {
        // Every member of a multi-member gzip file, as `gzip -d` (and so `tar -xzf`) reads
        // it: a reviewer's `tar` must see what is installed.
        ArchiveKind::TarGz => Box::new(flate2::read::MultiGzDecoder::new(f)),
        ArchiveKind::Tar => Box::new(f),
    };
    // The whole tar stream is bounded, headers included: a header can claim gigabytes (a
    // small gzip of zeros), and the stream is read to its end even where nothing of it is
    // kept.
    let exceeded = std::rc::Rc::new(std::cell::Cell::new(false));
    Ok((Capped { inner: reader, left: MAX_UNPACKED_BYTES + MAX_TAR_OVERHEAD, exceeded: exceeded.clone() }, exceeded))
}

/// However the tar reader reported a read cut at the cap (a bad entry, a truncated one), it
/// was the cap.
fn capped(exceeded: &std::cell::Cell<bool>, archive: &Path, e: InstallError) -> InstallError {
    if exceeded.get() {
        InstallError::TooLarge(format!("{}: {}", archive.display(), capped_message()))
    } else {
        e
    }
}

/// The most a GNU long name or long link entry may hold: Linux's `PATH_MAX`, its NUL
/// included (no longer name can be created anyway).
const MAX_LONG_NAME_BYTES: u64 = 4096;
/// The most a PAX header's records may hold (names, times, owners, extended attributes).
const MAX_PAX_HEADER_BYTES: u64 = 1024 * 1024;

/// The first pass: the raw entries of the stream (nothing applied to the next entry), each
/// header the `tar` reader of [`unpack_stream`] reads into memory whole — a GNU long name
/// or link, a PAX header — checked against its limit by the size its header claims, before
/// a byte of it is read (without this, only the stream's cap bounded it: ~320 MiB that root
/// would allocate). Refused too, because this pass and the next would frame the stream
/// differently: a PAX `size` record (which the reading pass applies to the next entry; no
/// entry that fits the cap needs one, the header's own field holds up to 8 GiB) and a GNU
/// sparse file (its extension headers follow its header).
///
/// Refused as well, because GNU tar (what a reviewer lists the package with) frames the
/// stream differently from this reader: a size or mode field that is not plain octal
/// digits or base-256 (GNU tar reads a leading `+` as its obsolete base-64) and an entry
/// that has no data (a directory, a link, a device) whose header claims a size (GNU tar
/// skips no data after some of them — a directory, a hard link —, this reader skips the
/// size: the bytes after it would be other entries to each). With `whole_stream` (a gzip stream) it is read to its end once the
/// archive's end is reached: its checksum and length are checked, and bytes after it
/// that are not another gzip member are refused, as `gzip -d` refuses them.
fn check_headers(reader: impl Read, archive: &Path, whole_stream: bool) -> Result<(), InstallError> {
    let invalid = |what: &dyn std::fmt::Display| InstallError::Invalid(format!("{}: {what}", archive.display()));
    let mut tar = tar::Archive::new(reader);
    check_entries(&mut tar, archive)?;
    if whole_stream {
        std::io::copy(&mut tar.into_inner(), &mut std::io::sink())
            .map_err(|e| invalid(&format!("not a valid gzip stream after the archive's end: {e}")))?;
    }
    Ok(())
}

/// The entries of [`check_headers`]'s pass.
fn check_entries<R: Read>(tar: &mut tar::Archive<R>, archive: &Path) -> Result<(), InstallError> {
    let invalid = |what: &dyn std::fmt::Display| InstallError::Invalid(format!("{}: {what}", archive.display()));
    let entries = tar.entries().map_err(|e| io(archive, e))?.raw(true);
    // The name in the last header read, for a stream that ends or breaks after it.
    let mut last = String::from("its start");
    for entry in entries {
        let mut entry =
            entry.map_err(|e| invalid(&format!("not a valid archive (truncated or corrupt after {last}): {e}")))?;
        last = String::from_utf8_lossy(&entry.header().path_bytes()).into_owned();
        // A POSIX magic with another version: GNU tar and Python's `tarfile` read the name
        // prefix of such a header, this reader does not — the names a reviewer's `tar`
        // lists would not be the ones installed.
        // Nor a name prefix outside the POSIX format (GNU, V7 headers): Python's `tarfile`
        // joins one wherever the bytes are set, GNU tar and this reader do not.
        let raw_header = entry.header().as_bytes();
        let posix = &raw_header[257..263] == b"ustar\0";
        if posix && &raw_header[263..265] != b"00" {
            return Err(invalid(&format!(
                "{last}: a ustar header of version {:?} is refused (tar programs disagree on its name)",
                String::from_utf8_lossy(&raw_header[263..265])
            )));
        }
        if !posix && raw_header[345] != 0 && !matches!(entry.header().entry_type(), tar::EntryType::GNUSparse) {
            return Err(invalid(&format!(
                "{last}: a name prefix in a header outside the ustar format is refused (tar programs disagree on its name)"
            )));
        }
        for (field, range) in [("size", 124..136), ("mode", 100..108)] {
            if !plain_number(&raw_header[range]) {
                return Err(invalid(&format!(
                    "{last}: a {field} field that is not plain octal digits is refused (tar programs disagree on its value)"
                )));
            }
        }
        let kind = entry.header().entry_type();
        let size = entry.header().entry_size().map_err(|e| invalid(&format!("not a valid archive: {e}")))?;
        let has_data = kind.is_file()
            || matches!(
                kind,
                tar::EntryType::Continuous
                    | tar::EntryType::GNULongName
                    | tar::EntryType::GNULongLink
                    | tar::EntryType::XHeader
                    | tar::EntryType::XGlobalHeader
                    | tar::EntryType::GNUSparse
            );
        if !has_data && size != 0 {
            return Err(invalid(&format!(
                "{last}: an entry without data (a directory, a link, a device) whose header claims {size} bytes is refused \
                 (tar programs disagree on where the next entry begins)"
            )));
        }
        let (what, limit) = match kind {
            tar::EntryType::GNULongName => ("a GNU long name", MAX_LONG_NAME_BYTES),
            tar::EntryType::GNULongLink => ("a GNU long link", MAX_LONG_NAME_BYTES),
            tar::EntryType::XHeader | tar::EntryType::XGlobalHeader => ("a PAX header", MAX_PAX_HEADER_BYTES),
            tar::EntryType::GNUSparse => return Err(invalid(&"a GNU sparse file is refused")),
            _ => continue,
        };
        if size > limit {
            return Err(InstallError::TooLarge(format!(
                "{}: {what} of {size} bytes is refused (at most {limit})",
                archive.display()
            )));
        }
        if kind == tar::EntryType::XHeader {
            let mut body = Vec::with_capacity(size as usize);
            entry
                .read_to_end(&mut body)
                .map_err(|e| invalid(&format!("not a valid archive (truncated or corrupt at {last}): {e}")))?;
            // A malformed record is the reading pass's to report.
            for ext in tar::PaxExtensions::new(&body).map_while(Result::ok) {
                if ext.key_bytes() == b"size" {
                    return Err(invalid(&"a PAX `size` record is refused (an entry's size is its header's)"));
                }
            }
        }
    }
    Ok(())
}

/// Whether a numeric header field reads the same to every tar program: positive base-256
/// (first byte 0x80; in a 12-byte field the next three zero, which the `tar` crate skips
/// and GNU tar reads), or optional leading spaces, at least one octal digit, and then only
/// NULs or spaces up to the field's end or its first NUL.
fn plain_number(field: &[u8]) -> bool {
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        return field[0] == 0x80 && (field.len() != 12 || field[1..4] == [0, 0, 0]);
    }
    let text = field.split(|b| *b == 0).next().unwrap_or_default();
    let digits = text.iter().skip_while(|b| **b == b' ');
    let mut seen_digit = false;
    let mut trailing = false;
    for b in digits {
        match b {
            b'0'..=b'7' if !trailing => seen_digit = true,
            b' ' if seen_digit => trailing = true,
            _ => return false,
        }
    }
    seen_digit
}

fn unpack_stream(reader: impl Read, archive: &Path, dest: &Path) -> Result<(), InstallError> {
    let mut budget = Budget::default();
    // What the archive has put where so far: an entry given twice, or one beneath a file,
    // is refused naming the entry (not as the staging directory's "File exists").
    let mut files: std::collections::HashSet<PathBuf> = std::collections::HashSet::new();
    let mut dirs: std::collections::HashSet<PathBuf> = std::collections::HashSet::new();
    // Every directory made, the ones an entry's path implies too: each counts as an entry.
    let mut made: std::collections::HashSet<PathBuf> = std::collections::HashSet::new();
    let mut tar = tar::Archive::new(reader);
    let entries = tar.entries().map_err(|e| io(archive, e))?;
    for entry in entries {
        let mut entry =
            entry.map_err(|e| InstallError::Invalid(format!("{}: not a valid archive: {e}", archive.display())))?;
        budget.entry()?;
        let raw = entry
            .path()
            .map_err(|e| InstallError::Invalid(format!("{}: bad entry name: {e}", archive.display())))?
            .into_owned();
        let kind = entry.header().entry_type();
        // A PAX global header (`git archive` writes one holding the commit id) describes
        // the archive, not a file: nothing to unpack — unless it changes what later entries
        // are, which GNU tar would apply and this reader would not.
        if kind == tar::EntryType::XGlobalHeader {
            check_global_header(&mut entry)?;
            continue;
        }
        one_name(&mut entry, &raw)?;
        // A file whose name ends in `/` is a directory to GNU tar (the old convention), and
        // would be installed as a file here.
        if !kind.is_dir() && entry.path_bytes().ends_with(b"/") {
            return Err(InstallError::Invalid(format!(
                "{}: {}: a file entry whose name ends in '/' is refused (tar programs disagree on what it is)",
                archive.display(),
                raw.display()
            )));
        }
        let rel = safe_relative(&raw)?;
        if rel.as_os_str().is_empty() {
            if kind.is_dir() {
                continue;
            }
            return Err(InstallError::Invalid(format!("{}: an entry without a name", archive.display())));
        }
        // Refused wherever it lies, in a bytecode cache too (which is skipped below).
        if let Some(what) = refused_kind(kind) {
            return Err(InstallError::Invalid(format!("{}: {what} is refused", rel.display())));
        }
        // Bytecode caches are not part of a package (as for a directory, see `copy_tree`):
        // the agent writes its own, compiled from the package's sources.
        if rel.components().any(|c| c.as_os_str() == "__pycache__") {
            continue;
        }
        check_depth(&rel, rel.components().count())?;
        let target = dest.join(&rel);
        let invalid = |why: &str| InstallError::Invalid(format!("{}: {why}", rel.display()));
        if let Some(file) = rel.ancestors().skip(1).find(|a| files.contains(*a)) {
            return Err(invalid(&format!("beneath {}, which the archive gave as a file", file.display())));
        }
        // The directories this entry's path implies, made below: counted like entries.
        for ancestor in rel.ancestors().skip(1).filter(|a| !a.as_os_str().is_empty()) {
            if made.insert(ancestor.to_path_buf()) {
                budget.entry()?;
            }
        }
        if kind.is_dir() {
            made.insert(rel.clone());
        }
        if kind.is_dir() {
            if files.contains(&rel) {
                return Err(invalid("given twice in the archive (a file, then a directory)"));
            }
            std::fs::DirBuilder::new().mode(0o755).recursive(true).create(&target).map_err(|e| io(&target, e))?;
            dirs.insert(rel);
        } else {
            if files.contains(&rel) || dirs.contains(&rel) {
                return Err(invalid("given twice in the archive"));
            }
            refuse_unreadable_code(&rel)?;
            if let Some(parent) = target.parent() {
                std::fs::DirBuilder::new().mode(0o755).recursive(true).create(parent).map_err(|e| io(parent, e))?;
            }
            let executable = entry.header().mode().is_ok_and(|m| m & 0o111 != 0);
            // A read error here is the archive's (a truncated or corrupt stream), not the
            // staging file's.
            budget.copy(&mut entry, &target, executable, |e| {
                InstallError::Invalid(format!("not a valid archive (truncated or corrupt at {}): {e}", rel.display()))
            })?;
            files.insert(rel);
        }
    }
    Ok(())
}

/// Why an archive entry of `kind` is refused: anything but a directory or a regular file.
fn refused_kind(kind: tar::EntryType) -> Option<&'static str> {
    Some(if kind.is_dir() || kind.is_file() {
        return None;
    } else if kind.is_symlink() {
        "a symbolic link"
    } else if kind.is_hard_link() {
        "a hard link"
    } else if kind.is_character_special() || kind.is_block_special() {
        "a device"
    } else if kind.is_fifo() {
        "a FIFO"
    } else {
        "not a regular file or directory"
    })
}

/// PAX keywords a global header may set: they describe the archive or file metadata the
/// install does not use (owners, times), never an entry's name, target, size or layout.
const HARMLESS_GLOBAL_PAX_KEYS: &[&str] =
    &["comment", "mtime", "atime", "ctime", "uid", "gid", "uname", "gname", "charset", "hdrcharset"];

/// A PAX global header, read as GNU tar reads it: its own records apply to every later
/// entry, so only [`HARMLESS_GLOBAL_PAX_KEYS`] are accepted. The `tar` reader attaches a
/// pending local header or GNU long name to the global header, where GNU tar keeps it for the
/// next file: refused, as two readers would name that file differently.
fn check_global_header<R: Read>(entry: &mut tar::Entry<'_, R>) -> Result<(), InstallError> {
    let invalid = |e: &dyn std::fmt::Display| InstallError::Invalid(format!("not a valid archive (a PAX header): {e}"));
    let mut body = Vec::new();
    entry.read_to_end(&mut body).map_err(|e| invalid(&e))?;
    // The body is consumed: any records the reader still has are a local header's.
    let attached = entry.pax_extensions().map_err(|e| invalid(&e))?.is_some_and(|mut x| x.next().is_some());
    if attached || entry.path_bytes() != entry.header().path_bytes() {
        return Err(InstallError::Invalid(
            "a PAX global header after a local header or a GNU long name is refused (tar readers disagree on the next entry's name)".into(),
        ));
    }
    for ext in tar::PaxExtensions::new(&body) {
        let ext = ext.map_err(|e| invalid(&e))?;
        let key = String::from_utf8_lossy(ext.key_bytes());
        if !HARMLESS_GLOBAL_PAX_KEYS.contains(&key.as_ref()) {
            return Err(InstallError::Invalid(format!(
                "a PAX global header setting `{key}` is refused (it would change every later entry)"
            )));
        }
    }
    Ok(())
}

/// Refuses an entry two tar readers could read differently. This reader takes the first of
/// repeated PAX `path` or `linkpath` records, GNU tar (and libarchive, Python) the last (a
/// PAX `size` record is refused whole, by [`check_headers`]); it takes a GNU long name over
/// a PAX `path`, GNU tar the PAX path; it ignores GNU sparse records (`GNU.sparse.name`
/// renames the file for GNU tar). `name` is the name this reader gave the entry.
fn one_name<R: Read>(entry: &mut tar::Entry<'_, R>, name: &Path) -> Result<(), InstallError> {
    use std::os::unix::ffi::OsStrExt;
    let invalid = |e: &dyn std::fmt::Display| InstallError::Invalid(format!("not a valid archive (a PAX header): {e}"));
    let Some(extensions) = entry.pax_extensions().map_err(|e| invalid(&e))? else {
        return Ok(());
    };
    let refused = |why: &str| InstallError::Invalid(format!("{}: {why} is refused", name.display()));
    let mut seen: Vec<Vec<u8>> = Vec::new();
    let mut path = None;
    for ext in extensions {
        let ext = ext.map_err(|e| invalid(&e))?;
        let key = ext.key_bytes();
        if key.starts_with(b"GNU.sparse.") {
            return Err(refused("a GNU sparse PAX record"));
        }
        if matches!(key, b"path" | b"linkpath") {
            if seen.iter().any(|k| k == key) {
                return Err(refused(&format!(
                    "an entry named twice (two PAX `{}` records)",
                    String::from_utf8_lossy(key)
                )));
            }
            seen.push(key.to_vec());
        }
        if key == b"path" {
            path = Some(ext.value_bytes().to_vec());
        }
    }
    if path.is_some_and(|p| p != name.as_os_str().as_bytes()) {
        return Err(refused("an entry named twice (a PAX path and a GNU long name)"));
    }
    Ok(())
}

/// Refuses code in a package that nobody can read: compiled bytecode outside `__pycache__` (a
/// sourceless `NAME.pyc` is importable as `NAME` with no source for a reviewer, or `executor
/// lint`, to read) and native modules (`NAME.so`, `NAME.cpython-311-….so`: imported in
/// preference to a reviewed `NAME.py` beside them). Caches in `__pycache__` are dropped, not
/// refused: the agent compiles its own. Requirements' native modules come from wheels into
/// `.deps`, which a package cannot bring.
fn refuse_unreadable_code(rel: &Path) -> Result<(), InstallError> {
    let name = rel.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    if name.ends_with(".pyc") || name.ends_with(".pyo") {
        return Err(InstallError::Invalid(format!(
            "{}: compiled bytecode outside __pycache__ is refused (ship the source)",
            rel.display()
        )));
    }
    // Every extension-module suffix of CPython on Linux (`.cpython-311-x86_64-linux-gnu.so`,
    // `.abi3.so`) ends in `.so`.
    if name.ends_with(".so") {
        return Err(InstallError::Invalid(format!(
            "{}: a native module in the package is refused (the import system prefers it to a .py of \
             the same name, and nobody can review it); ship it as a wheel in wheels/",
            rel.display()
        )));
    }
    Ok(())
}

/// Copy the package directory `src` into `dest`. The walk goes by descriptors: every entry
/// is looked at and opened relative to its directory's descriptor, never following a link
/// (a directory or file swapped for a symbolic link while the copy runs is refused, not
/// followed out of the package), and files are opened without blocking and checked again on
/// the open descriptor (a file swapped for a FIFO is refused, not waited on).
fn copy_tree(src: &Path, dest: &Path, budget: &mut Budget) -> Result<(), InstallError> {
    use nix::fcntl::OFlag;
    let dir = nix::fcntl::openat(
        nix::fcntl::AT_FDCWD,
        src,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| io(src, e.into()))?;
    copy_dir(dir, src, dest, budget, Copied::Package, 0)
}

/// What [`copy_dir`] copies: a package (its build products and caches left out, compiled
/// code refused), or the requirements pip installed from wheels (all of it).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Copied {
    Package,
    Requirements,
}

fn copy_dir(
    dir: std::os::fd::OwnedFd,
    src: &Path,
    dest: &Path,
    budget: &mut Budget,
    copied: Copied,
    depth: usize,
) -> Result<(), InstallError> {
    use nix::fcntl::OFlag;
    use nix::sys::stat::{Mode, SFlag};
    use std::os::unix::ffi::OsStrExt;
    mkdir(dest)?;
    // `try_clone` duplicates with F_DUPFD_CLOEXEC.
    let copy = dir.try_clone().map_err(|e| io(src, e))?;
    let mut listing = nix::dir::Dir::from_fd(copy).map_err(|e| io(src, e.into()))?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let entry = entry.map_err(|e| io(src, e.into()))?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(std::ffi::OsStr::from_bytes(name).to_os_string());
        }
    }
    // One descriptor per level stays open (the directory's), not two.
    drop(listing);
    names.sort();
    for name in names {
        budget.entry()?;
        let path = src.join(&name);
        // Counted as in an archive: this entry is `depth + 1` names below the top.
        check_depth(&path, depth + 1)?;
        let name_str =
            name.to_str().ok_or_else(|| InstallError::Invalid(format!("{}: name is not UTF-8", path.display())))?;
        // Build products and caches are not part of a package.
        if copied == Copied::Package && matches!(name_str, ".git" | "__pycache__" | ".pytest_cache" | ".deps") {
            continue;
        }
        let refused = || {
            InstallError::Invalid(format!(
                "{}: symbolic links, devices, FIFOs and sockets are refused in a package",
                path.display()
            ))
        };
        let kind = |mode: u32| SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits());
        let stat = nix::sys::stat::fstatat(&dir, name.as_os_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| io(&path, e.into()))?;
        if budget.owned_only {
            let euid = nix::unistd::geteuid().as_raw();
            let others_write = stat.st_mode & 0o002 != 0 || (stat.st_mode & 0o020 != 0 && stat.st_gid != 0);
            if (stat.st_uid != 0 && stat.st_uid != euid) || others_write {
                return Err(InstallError::Invalid(format!(
                    "{}: owned by uid {} with mode {:04o}: another user could change it, and so what the agent installs at every start (each entry must be root's or the agent's and writable by no one else)",
                    path.display(),
                    stat.st_uid,
                    stat.st_mode & 0o7777
                )));
            }
        }
        let target = dest.join(name_str);
        let nofollow = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        // The entry changed type since it was looked at: a link (ELOOP) or a file where a
        // directory was (ENOTDIR) is refused as such.
        let open_error = |e: nix::errno::Errno| match e {
            nix::errno::Errno::ELOOP | nix::errno::Errno::ENOTDIR => refused(),
            e => io(&path, e.into()),
        };
        if kind(stat.st_mode) == SFlag::S_IFDIR {
            let sub = nix::fcntl::openat(&dir, name.as_os_str(), nofollow | OFlag::O_DIRECTORY, Mode::empty())
                .map_err(open_error)?;
            copy_dir(sub, &path, &target, budget, copied, depth + 1)?;
        } else if kind(stat.st_mode) == SFlag::S_IFREG {
            let fd = nix::fcntl::openat(
                &dir,
                name.as_os_str(),
                nofollow | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
                Mode::empty(),
            )
            .map_err(open_error)?;
            let mut f = std::fs::File::from(fd);
            let meta = f.metadata().map_err(|e| io(&path, e))?;
            if !meta.is_file() {
                return Err(refused());
            }
            // As in an archive: a hard link could be another file of the host's (where
            // fs.protected_hardlinks is off, any file on the same filesystem).
            if std::os::unix::fs::MetadataExt::nlink(&meta) > 1 {
                return Err(InstallError::Invalid(format!("{}: a hard link is refused in a package", path.display())));
            }
            if copied == Copied::Package {
                refuse_unreadable_code(&path)?;
            }
            budget.copy(&mut f, &target, meta.permissions().mode() & 0o111 != 0, |err| io(&path, err))?;
        } else {
            return Err(refused());
        }
    }
    Ok(())
}

/// The directory holding `manifest.json`: the top, or its single subdirectory.
fn package_root(unpacked: &Path) -> Result<PathBuf, InstallError> {
    if unpacked.join("manifest.json").is_file() {
        return Ok(unpacked.to_path_buf());
    }
    let entries: Vec<_> = std::fs::read_dir(unpacked).map_err(|e| io(unpacked, e))?.flatten().collect();
    if let [only] = entries.as_slice() {
        if only.path().join("manifest.json").is_file() {
            return Ok(only.path());
        }
    }
    Err(InstallError::Invalid("no manifest.json at the top of the package (or of its single directory)".into()))
}

fn normalise_modes(dir: &Path) -> Result<(), InstallError> {
    for e in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
        let meta = std::fs::symlink_metadata(e.path()).map_err(|err| io(&e.path(), err))?;
        if meta.is_dir() {
            std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o755))
                .map_err(|err| io(&e.path(), err))?;
            normalise_modes(&e.path())?;
        } else if meta.is_file() {
            let mode = if meta.permissions().mode() & 0o111 != 0 { 0o755 } else { 0o644 };
            std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(mode))
                .map_err(|err| io(&e.path(), err))?;
        }
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(|e| io(dir, e))
}

/// The interpreter matching the embedded one (pip must pick wheels for that version).
fn python() -> String {
    let (major, minor, _) = crate::executor_run::embedded_python();
    format!("/usr/bin/python{major}.{minor}")
}

/// pip runs as root, outside any sandbox, on an untrusted package: it reads no
/// configuration of the package's (`--isolated`: no user configuration, no `PIP_*`
/// variables; `HOME` is a directory that does not exist — it was the package, whose
/// `.config/pip/pip.conf` could name a log or report file for root to write anywhere), it
/// installs wheels only (`--only-binary :all:`: no build, no package code runs) from the
/// package's `wheels/` (its `*.whl` files only, [`package_wheels`]) or the operator's sources, and the requirements are names with
/// version specifiers only ([`crate::manifest`] refuses URLs and paths).
///
/// pip resolves no dependencies (`--no-deps`): a wheel's own `Requires-Dist` may be a
/// direct reference (`boom @ file:///…` or `https://…`), which pip 23 fetches and prepares —
/// running its build backend, the package's code, as root — whatever `--only-binary` says.
/// So `requirements.packages` must name every distribution the executor needs, as a lock
/// file does, and [`check_dependencies`] then reads the installed wheels' metadata (no code of
/// theirs runs) and refuses a dependency that is missing, of another version, or a direct
/// reference.
///
/// Everything pip writes — the installed files, its downloads and temporary files — goes to
/// a tmpfs of at most [`PIP_SCRATCH_BYTES`] and [`PIP_SCRATCH_FILES`] ([`PipScratch`]), and
/// what it installed is then copied into the package within the package's own bounds: a
/// wheel of a few kilobytes that expands to gigabytes (a zip bomb) fills that tmpfs, not the
/// host's disk, and is refused (`too_large`).
fn install_requirements(
    pkg: &Path,
    work: &Path,
    package_wheels: Option<&Path>,
    packages: &[String],
    opts: &InstallOptions,
) -> Result<(), InstallError> {
    let scratch = PipScratch::new(work)?;
    let mut cmd = std::process::Command::new(python());
    cmd.args(["-I", "-m", "pip", "install", "--isolated", "--no-cache-dir", "--no-deps"])
        .args(["--disable-pip-version-check", "--no-input", "--no-compile"])
        .args(["--only-binary", ":all:", "--target"])
        .arg(work.join("deps"));
    let mut sources = 0;
    if let Some(wheels) = package_wheels {
        cmd.arg("--find-links").arg(wheels);
        sources += 1;
    }
    for f in &opts.find_links {
        cmd.arg("--find-links").arg(f);
        sources += 1;
    }
    match &opts.index_url {
        Some(url) => {
            cmd.args(["--index-url", url]);
            sources += 1;
        }
        None => {
            cmd.arg("--no-index");
        }
    }
    if sources == 0 {
        return Err(InstallError::Invalid(format!(
            "requirements.packages ({}): no wheels to install them from (put them in the package's wheels/ directory, or give --find-links DIR or --index-url URL)",
            packages.join(", ")
        )));
    }
    cmd.arg("--").args(packages);
    cmd.env_clear().env("PATH", "/usr/bin:/bin").env("HOME", "/nonexistent").env("TMPDIR", work.join("tmp"));
    cmd.current_dir("/");
    scratch.attach_in_child(&mut cmd)?;
    let (status, stderr) = run_pip(cmd)?;
    // pip removes what it was writing when the write fails, so the tmpfs may have room
    // again by now: its own report of the failed write counts too.
    let no_room = |stderr: &[u8]| String::from_utf8_lossy(stderr).contains("No space left on device");
    if scratch.full() || (!status.success() && no_room(&stderr)) {
        return Err(InstallError::TooLarge(format!(
            "requirements.packages: installing {} needs more than pip's {PIP_SCRATCH_BYTES} bytes or {PIP_SCRATCH_FILES} files (its downloads, temporary files and the installed packages)",
            packages.join(", ")
        )));
    }
    if !status.success() {
        let stderr = String::from_utf8_lossy(&stderr);
        let last: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).rev().take(3).collect();
        return Err(InstallError::Invalid(format!(
            "requirements.packages: pip could not install {}: {}",
            packages.join(", "),
            last.into_iter().rev().collect::<Vec<_>>().join(" / ")
        )));
    }
    scratch.copy_installed(&pkg.join(".deps"), packages)?;
    drop(scratch);
    check_dependencies(&pkg.join(".deps"), packages)
}

/// Most bytes pip may write while installing a package's requirements, its downloads and
/// temporary files included ([`PipScratch`]): twice what it may install, so that the wheels
/// it downloads fit beside what it unpacks from them.
pub const PIP_SCRATCH_BYTES: u64 = 2 * MAX_UNPACKED_BYTES;
/// Most files and directories pip may make meanwhile.
pub const PIP_SCRATCH_FILES: usize = 2 * MAX_ENTRIES;

/// Where pip writes: a tmpfs of [`PIP_SCRATCH_BYTES`] and [`PIP_SCRATCH_FILES`] inodes, made
/// detached (`fsmount`) and attached only in pip's own mount namespace, at `work` (an empty
/// directory of the staging area): `work/deps` is its `--target`, `work/tmp` its `TMPDIR`.
/// The agent reaches it through its descriptor only; it is gone when that is dropped.
struct PipScratch {
    mnt: std::os::fd::OwnedFd,
    work: std::ffi::CString,
}

impl PipScratch {
    fn new(work: &Path) -> Result<PipScratch, InstallError> {
        use std::os::unix::ffi::OsStrExt;
        let options = format!("mode=0700,size={PIP_SCRATCH_BYTES},nr_inodes={PIP_SCRATCH_FILES}");
        let attrs = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
        let mnt = sandbox::mounts::detached_tmpfs("opservant-pip", &options, attrs)
            .map_err(|e| io(work, std::io::Error::other(format!("a tmpfs for pip: {e}"))))?;
        for (name, mode) in [("deps", 0o755), ("tmp", 0o700)] {
            nix::sys::stat::mkdirat(&mnt, name, nix::sys::stat::Mode::from_bits_truncate(mode))
                .map_err(|e| io(&work.join(name), e.into()))?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(work).map_err(|e| io(work, e))?;
        let work = std::ffi::CString::new(work.as_os_str().as_bytes())
            .map_err(|_| InstallError::Invalid(format!("{}: a NUL in the path", work.display())))?;
        Ok(PipScratch { mnt, work })
    }

    /// Have `cmd`'s process attach the tmpfs at `work` in a mount namespace of its own
    /// before it runs pip (nothing of it shows, or propagates, in the host's).
    fn attach_in_child(&self, cmd: &mut std::process::Command) -> Result<(), InstallError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let mnt = self.mnt.as_raw_fd();
        let work = self.work.clone();
        let step = |rc: libc::c_long| if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
        // SAFETY: the closure runs in the forked child before exec and makes only system
        // calls (async-signal-safe), on a descriptor and a C string both alive in the child's
        // copy of this process's memory; the descriptor is close-on-exec, so pip does not get it.
        unsafe {
            cmd.pre_exec(move || {
                step(libc::unshare(libc::CLONE_NEWNS) as libc::c_long)?;
                step(libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) as libc::c_long)?;
                step(libc::syscall(
                    libc::SYS_move_mount,
                    mnt,
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    work.as_ptr(),
                    libc::MOVE_MOUNT_F_EMPTY_PATH,
                ))
            });
        }
        Ok(())
    }

    /// Whether the tmpfs is out of room now (bytes or inodes).
    fn full(&self) -> bool {
        nix::sys::statvfs::fstatvfs(&self.mnt).is_ok_and(|v| v.blocks_available() == 0 || v.files_available() == 0)
    }

    /// Copy what pip installed for `packages` into `deps`: at most a package's bounds
    /// ([`MAX_UNPACKED_BYTES`], [`MAX_ENTRIES`]) — told first from the tmpfs's use, before
    /// anything is written —, links and special files refused, as for a package.
    fn copy_installed(&self, deps: &Path, packages: &[String]) -> Result<(), InstallError> {
        use nix::fcntl::OFlag;
        let too_large = || {
            InstallError::TooLarge(format!(
                "requirements.packages: what pip installed for {} is more than {MAX_UNPACKED_BYTES} bytes or {MAX_ENTRIES} files",
                packages.join(", ")
            ))
        };
        // What pip left there is what it installed (its temporary files are gone).
        if let Ok(v) = nix::sys::statvfs::fstatvfs(&self.mnt) {
            let used_bytes = (v.blocks() - v.blocks_free()).saturating_mul(v.fragment_size());
            let used_files = v.files().saturating_sub(v.files_free());
            if used_bytes > MAX_UNPACKED_BYTES || used_files > MAX_ENTRIES as u64 {
                return Err(too_large());
            }
        }
        let installed = nix::fcntl::openat(
            &self.mnt,
            "deps",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| io(deps, e.into()))?;
        // The copy's own bounds, the second wall (the same limits' errors, about requirements).
        copy_dir(installed, Path::new("requirements.packages"), deps, &mut Budget::default(), Copied::Requirements, 0)
            .map_err(|e| match e {
                InstallError::Invalid(m)
                    if m.starts_with("the package has more than")
                        || m.starts_with("the package unpacks to more than") =>
                {
                    too_large()
                }
                e => e,
            })
    }
}

/// Run pip (`cmd`) to its end — or, once a stop signal came ([`stop_signalled`]), kill it
/// and return [`InstallError::Interrupted`]: pip may wait minutes on an index. Its stdout is
/// not kept; its stderr is returned (the last 64 KiB: its last lines name the failure).
fn run_pip(mut cmd: std::process::Command) -> Result<(std::process::ExitStatus, Vec<u8>), InstallError> {
    const KEPT: usize = 64 << 10;
    // Not the package's fault (its own mount namespace and tmpfs are made as it starts).
    let cannot = |e: std::io::Error| InstallError::Io {
        path: format!("{} (pip, in a mount namespace of its own)", python()),
        source: e,
    };
    cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
    check_stop()?;
    let mut child = cmd.spawn().map_err(cannot)?;
    let stderr = child.stderr.take().map(|mut err| {
        std::thread::spawn(move || {
            let mut kept = std::collections::VecDeque::new();
            let mut buf = [0u8; 8192];
            while let Ok(n @ 1..) = err.read(&mut buf) {
                kept.extend(&buf[..n]);
                let over = kept.len().saturating_sub(KEPT);
                kept.drain(..over);
            }
            Vec::from(kept)
        })
    });
    let status = loop {
        if let Some(status) = child.try_wait().map_err(cannot)? {
            break Ok(status);
        }
        if let Err(stop) = check_stop() {
            // Not yet reaped, so the pid is still pip's.
            let _ = child.kill();
            let _ = child.wait();
            break Err(stop);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // Joined once pip has ended (its end of the pipe closed with it, as `output()` waited).
    let stderr = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    let status = status?;
    // A terminal's Ctrl-C reaches pip too, which then fails on its own: still a stop.
    check_stop()?;
    Ok((status, stderr))
}

/// What of a package's `wheels/` directory pip is given ([`package_wheels`]).
struct OfferedWheels {
    /// The private directory holding them; `None` when the package has no wheel.
    dir: Option<PathBuf>,
    /// Names in `wheels/` that were left out (not a regular `*.whl` file).
    ignored: Vec<String>,
}

/// The package's own wheels, as pip may see them: the regular files named `*.whl` directly
/// in `wheels/`, hard-linked into `private` (a new directory of the staging area, outside the
/// package). pip reads a `--find-links` directory as an index: an HTML file there is parsed as
/// a page whose links — `file:///…` anywhere on the host, `https://…` — it follows, so the
/// package's `wheels/` itself would let it choose wheels its signature does not cover.
fn package_wheels(pkg: &Path, private: &Path) -> Result<OfferedWheels, InstallError> {
    let wheels = pkg.join("wheels");
    let mut offered = OfferedWheels { dir: None, ignored: Vec::new() };
    match std::fs::symlink_metadata(&wheels) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(InstallError::Invalid("wheels: not a directory".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(offered),
        Err(e) => return Err(io(&wheels, e)),
    }
    let mut entries: Vec<_> = std::fs::read_dir(&wheels)
        .map_err(|e| io(&wheels, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| io(&wheels, e))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_file = entry.file_type().map_err(|e| io(&entry.path(), e))?.is_file();
        // pip takes a link for a wheel by this exact, case-sensitive suffix.
        if !is_file || !name.ends_with(".whl") {
            offered.ignored.push(name);
            continue;
        }
        if offered.dir.is_none() {
            std::fs::DirBuilder::new().mode(0o700).create(private).map_err(|e| io(private, e))?;
            offered.dir = Some(private.to_path_buf());
        }
        std::fs::hard_link(entry.path(), private.join(&name)).map_err(|e| io(&entry.path(), e))?;
    }
    Ok(offered)
}

/// Reads the metadata of the distributions pip put in `deps` and follows every
/// `requirements.packages` entry's dependencies (markers evaluated for the embedded
/// interpreter and the extras asked for) through them; prints one line per problem and
/// exits 3 when there is any.
/// It parses `METADATA` files only: no code of the wheels' runs.
const CHECK_DEPENDENCIES_PY: &str = r#"
import sys, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
deps, wanted = sys.argv[1], sys.argv[2:]
problems = []
try:
    dists = {}
    for d in md.distributions(path=[deps]):
        if d.metadata["Name"]:
            dists.setdefault(canonicalize_name(d.metadata["Name"]), d)
    todo = [(Requirement(w), "requirements.packages") for w in wanted]
    seen = set()
    while todo:
        req, by = todo.pop()
        key = canonicalize_name(req.name)
        if req.url:
            problems.append(f"{by} requires {req.name} by a direct reference ({req.url}), which is refused")
            continue
        d = dists.get(key)
        if d is None:
            problems.append(f"{by} requires {req.name}{req.specifier}, which is not in requirements.packages")
            continue
        if req.specifier and not req.specifier.contains(d.version, prereleases=True):
            problems.append(f"{by} requires {req.name}{req.specifier}, but requirements.packages installs {d.version}")
            continue
        # An extra as asked for and as the wheel spells it (`Provides-Extra`): markers
        # compare the text, and `Foo_Bar`, `foo-bar` and `foo_bar` name one extra.
        provided = d.metadata.get_all("Provides-Extra") or []
        for extra in [""] + sorted({canonicalize_name(e) for e in req.extras}):
            if (key, extra) in seen:
                continue
            seen.add((key, extra))
            spellings = {extra, extra.replace("-", "_")} | {p for p in provided if canonicalize_name(p) == extra}
            spellings |= {e for e in req.extras if canonicalize_name(e) == extra}
            for r in d.requires or []:
                sub = Requirement(r)
                if sub.marker is None or any(sub.marker.evaluate({"extra": x}) for x in spellings):
                    todo.append((sub, f"{d.metadata['Name']} {d.version}"))
except Exception as e:
    problems.append(f"unreadable wheel metadata: {e}")
print("\n".join(problems[:8]))
sys.exit(3 if problems else 0)
"#;

/// Refuses an installed set of wheels whose dependencies `requirements.packages` does not
/// name (see [`install_requirements`]).
fn check_dependencies(deps: &Path, packages: &[String]) -> Result<(), InstallError> {
    let out = std::process::Command::new(python())
        .args(["-I", "-c", CHECK_DEPENDENCIES_PY])
        .arg(deps)
        .args(packages)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", "/nonexistent")
        .current_dir("/")
        .output()
        .map_err(|e| InstallError::Invalid(format!("{}: cannot check the dependencies: {e}", python())))?;
    match out.status.code() {
        Some(0) => Ok(()),
        // 3: problems found (1 would be an uncaught exception's).
        Some(3) => {
            let problems = String::from_utf8_lossy(&out.stdout);
            let problems: Vec<&str> = problems.lines().filter(|l| !l.trim().is_empty()).collect();
            Err(InstallError::Invalid(format!(
                "requirements.packages: dependencies are not resolved at install, so every distribution the executor needs must be listed (as in a lock file): {}",
                problems.join("; ")
            )))
        }
        _ => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("no message");
            Err(InstallError::Invalid(format!("requirements.packages: cannot check the dependencies: {last}")))
        }
    }
}

/// The installed executors, by name.
pub fn list(root: &Path) -> Result<Vec<ListEntry>, InstallError> {
    Ok(loaded(root)?
        .into_iter()
        .map(|(path, ex)| ListEntry {
            name: ex.manifest.name.clone(),
            version: ex.manifest.version.clone(),
            path,
            supported_actions: ex.manifest.supported_actions.clone(),
            description: ex.manifest.description.clone(),
        })
        .collect())
}

/// Every installed executor that loads, with its resolved directory, by name; one that does
/// not load is logged and left out.
pub fn loaded(root: &Path) -> Result<Vec<(PathBuf, Executor)>, InstallError> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io(root, e)),
    };
    check_root(root, &std::fs::metadata(root).map_err(|e| io(root, e))?)?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let Ok(Some(dir)) = resolve(root, &name) else { continue };
        match Executor::load(&dir) {
            Ok(ex) => out.push((dir, ex)),
            Err(err) => tracing::warn!(executor = name, error = %err.0, "installed executor does not load"),
        }
    }
    out.sort_by(|a, b| a.1.manifest.name.cmp(&b.1.manifest.name));
    Ok(out)
}

/// The directory `opservant run NAME` uses: `<root>/<name>/current`, resolved. `Ok(None)`:
/// not installed; `Err`: the root is not the agent's alone ([`check_root`]).
pub fn resolve(root: &Path, name: &str) -> Result<Option<PathBuf>, InstallError> {
    if !crate::manifest::valid_name(name) {
        return Ok(None);
    }
    // The root as well: `executors.dir` (or a directory above it) may be a link, and the
    // version directory's real path then begins with the root's real path, not its name.
    let Ok(root) = root.canonicalize() else { return Ok(None) };
    check_root(&root, &std::fs::metadata(&root).map_err(|e| io(&root, e))?)?;
    Ok(root.join(name).join("current").canonicalize().ok().filter(|p| p.starts_with(&root) && p.is_dir()))
}

/// Remove an installed executor. `Ok(false)` when it is not installed.
pub fn remove(root: &Path, name: &str, source: &str, command_id: Option<&str>) -> Result<bool, InstallError> {
    if !crate::manifest::valid_name(name) {
        return Err(InstallError::Invalid(format!("'{name}' is not an executor name")));
    }
    if !root.join(name).is_dir() {
        return Ok(false);
    }
    let _lock = lock_root(root)?;
    if !root.join(name).is_dir() {
        return Ok(false);
    }
    // Fail closed, as for an install (`executor_removed` follows).
    crate::audit::try_record(
        "executor_remove",
        &[("executor", name), ("source", source), ("command_id", command_id.unwrap_or(""))],
    )
    .map_err(|e| InstallError::Audit(e.to_string()))?;
    let doomed = unique(root, ".removing")?;
    let target = doomed.join(name);
    std::fs::rename(root.join(name), &target).map_err(|e| io(&root.join(name), e))?;
    // On the disk before it is reported: an executor removed (a vulnerable one, say) must not
    // come back with a restart.
    std::fs::File::open(root).and_then(|d| d.sync_all()).map_err(|e| {
        io(root, std::io::Error::other(format!("{name} is removed now but may come back after a restart ({e})")))
    })?;
    // A version a run still holds stays (beneath `.removing-PID-N`, no longer runnable by
    // name) until the sweep of a later install or removal finds it free.
    if !remove_doomed(&doomed) {
        tracing::info!(executor = name, dir = %doomed.display(), "removed; a version in use by a run is deleted later");
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_version_directorys_name_gives_its_version() {
        for (name, want) in [
            ("1.0.0", Some("1.0.0")),
            ("1.0.0~3", Some("1.0.0")),
            ("1.0.0.2", Some("1.0.0")),
            ("1.0.0-rc.1", Some("1.0.0-rc.1")),
            ("1.0.0-rc~1", Some("1.0.0-rc")),
            ("1.0.0~x", None),
            ("current", None),
            ("", None),
        ] {
            assert_eq!(version_of_dir_name(name).as_deref(), want, "{name}");
        }
    }

    #[test]
    fn forced_copies_are_the_same_version() {
        for (name, version, want) in [
            ("1.0.0", "1.0.0", true),
            ("1.0.0~1", "1.0.0", true),
            ("1.0.0~12", "1.0.0", true),
            ("1.0.0.1", "1.0.0", true),
            ("1.0.0-rc~1", "1.0.0-rc", true),
            ("1.0.0-rc.1", "1.0.0-rc", false),
            ("1.0.0~", "1.0.0", false),
            ("1.0.0~x", "1.0.0", false),
            ("1.0.01", "1.0.0", false),
            ("current", "1.0.0", false),
        ] {
            assert_eq!(is_version_dir(&Path::new("/nonexistent").join(name), version), want, "{name} of {version}");
        }
    }

    use super::*;

    #[test]
    fn archive_paths() {
        assert_eq!(safe_relative(Path::new("./a/b.py")).unwrap(), PathBuf::from("a/b.py"));
        assert!(safe_relative(Path::new("a/../../etc/passwd")).is_err());
        assert!(safe_relative(Path::new("/etc/passwd")).is_err());
        assert!(safe_relative(Path::new("..")).is_err());
    }
}
