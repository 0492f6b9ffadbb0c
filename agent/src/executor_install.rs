//! Installed executors: `opservant executor install | list | remove`, and the lookup that
//! lets `opservant run NAME` find one.
//!
//! Layout under the executors directory (default [`DEFAULT_ROOT`], root-owned):
//!
//! ```text
//! <root>/<name>/<version>[.<n>]/    an installed package (read-only once in place)
//! <root>/<name>/current -> <dir>    the version runs use; switched with one rename(2)
//! <root>/.staging-<pid>-<n>/        work area of an install in progress (same filesystem)
//! ```
//!
//! Guarantees:
//! - an archive (`.tar.gz`, `.tgz`, `.tar`) is unpacked entry by entry and refused as a whole
//!   on the first absolute path, `..` component, symbolic or hard link, device, FIFO, or
//!   anything but a regular file or a directory, on a non-UTF-8 name, or beyond the size and
//!   entry limits; nothing of a refused package is left behind;
//! - a package is installed only if `executor lint` finds no error in it — with its Python
//!   requirements installed first, from wheels only (never a source build, which would run
//!   the package's code as root): the package's own `wheels/` directory, `--find-links`, or
//!   `--index-url`;
//! - the new version becomes visible atomically (the `current` link is replaced by a rename);
//!   a run that started before keeps the directory it resolved; the previous version is kept
//!   for one more install (rollback by hand), older ones are removed;
//! - removal first renames the executor out of the way, so a half-deleted executor is never
//!   visible under its name.

use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use serde::Serialize;
use thiserror::Error;

use crate::executor_run::Executor;
use crate::policy::AgentPolicy;

pub const DEFAULT_ROOT: &str = "/var/lib/opservant/executors";
/// Most bytes an archive may unpack to.
pub const MAX_UNPACKED_BYTES: u64 = 256 * 1024 * 1024;
/// Most entries an archive may hold.
pub const MAX_ENTRIES: usize = 20_000;

#[derive(Debug, Error)]
pub enum InstallError {
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{name} {version} is already installed (use --force to install it again)")]
    AlreadyInstalled { name: String, version: String },
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
}

#[derive(Debug, Serialize)]
pub struct Installed {
    pub name: String,
    pub version: String,
    pub path: PathBuf,
    pub previous: Option<String>,
    pub warnings: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct ListEntry {
    pub name: String,
    pub version: String,
    pub path: PathBuf,
    pub supported_actions: Vec<String>,
    pub description: String,
}

/// A staging directory removed on drop (whatever is left in it).
struct Staging(PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn mkdir(p: &Path) -> Result<(), InstallError> {
    std::fs::DirBuilder::new().mode(0o755).create(p).map_err(|e| io(p, e))
}

/// Install from a package directory or archive.
pub fn install(
    src: &Path,
    root: &Path,
    policy: &AgentPolicy,
    opts: &InstallOptions,
) -> Result<Installed, InstallError> {
    std::fs::DirBuilder::new().mode(0o755).recursive(true).create(root).map_err(|e| io(root, e))?;
    let staging = Staging(unique(root, ".staging")?);
    let unpacked = staging.0.join("pkg");
    let meta = std::fs::symlink_metadata(src).map_err(|e| io(src, e))?;
    if meta.is_dir() {
        let mut budget = Budget::default();
        copy_tree(src, &unpacked, &mut budget)?;
    } else if meta.is_file() {
        unpack(src, &unpacked)?;
    } else {
        return Err(InstallError::Invalid(format!("{}: not a directory or an archive", src.display())));
    }
    let pkg = package_root(&unpacked)?;
    let text = crate::manifest::read(&pkg.join("manifest.json"))
        .map_err(|e| InstallError::Invalid(format!("manifest.json: {}", e.message)))?;
    let (manifest, errors, _) = crate::manifest::Manifest::check(&text);
    let Some(manifest) = manifest.filter(|_| errors.is_empty()) else {
        let list: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        return Err(InstallError::Invalid(format!("manifest.json: {}", list.join("; "))));
    };
    if pkg.join(".deps").exists() {
        return Err(InstallError::Invalid(
            ".deps: a package must not bring its own .deps (requirements are installed from wheels)".into(),
        ));
    }
    if !manifest.requirements.packages.is_empty() {
        install_requirements(&pkg, &manifest.requirements.packages, opts)?;
    }
    let report = crate::lint::lint(&pkg, policy).map_err(|e| InstallError::Invalid(e.to_string()))?;
    if !report.errors.is_empty() {
        return Err(InstallError::Invalid(report.errors.join("; ")));
    }
    // Normalise permissions: the sandbox reads the package as an unprivileged user.
    normalise_modes(&pkg)?;

    let name_dir = root.join(&manifest.name);
    match std::fs::DirBuilder::new().mode(0o755).create(&name_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(&name_dir, e)),
    }
    let mut dir_name = manifest.version.clone();
    if name_dir.join(&dir_name).exists() {
        if !opts.force {
            return Err(InstallError::AlreadyInstalled { name: manifest.name, version: manifest.version });
        }
        let n = (1..).find(|n| !name_dir.join(format!("{}.{n}", manifest.version)).exists()).unwrap_or(1);
        dir_name = format!("{}.{n}", manifest.version);
    }
    let dest = name_dir.join(&dir_name);
    std::fs::rename(&pkg, &dest).map_err(|e| io(&dest, e))?;
    let previous = std::fs::read_link(name_dir.join("current")).ok().map(|p| p.to_string_lossy().into_owned());
    // The switch: a new link beside `current`, renamed over it.
    let tmp_link = name_dir.join(".current.new");
    let _ = std::fs::remove_file(&tmp_link);
    std::os::unix::fs::symlink(&dir_name, &tmp_link).map_err(|e| io(&tmp_link, e))?;
    std::fs::rename(&tmp_link, name_dir.join("current")).map_err(|e| io(&name_dir, e))?;
    if let Ok(d) = std::fs::File::open(&name_dir) {
        let _ = d.sync_all();
    }
    // Keep the new and the previous version; remove older ones.
    if let Ok(entries) = std::fs::read_dir(&name_dir) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n == "current" || n == dir_name || Some(&n) == previous.as_ref() || n.starts_with('.') {
                continue;
            }
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    Ok(Installed { name: manifest.name, version: manifest.version, path: dest, previous, warnings: report.warnings })
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
}

impl Budget {
    fn entry(&mut self) -> Result<(), InstallError> {
        self.entries += 1;
        if self.entries > MAX_ENTRIES {
            return Err(InstallError::Invalid(format!("the package has more than {MAX_ENTRIES} entries")));
        }
        Ok(())
    }

    /// Copy at most the remaining byte budget from `r` into a new file `dest`.
    fn copy(&mut self, r: &mut dyn Read, dest: &Path, executable: bool) -> Result<(), InstallError> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(if executable { 0o755 } else { 0o644 })
            .open(dest)
            .map_err(|e| io(dest, e))?;
        let left = MAX_UNPACKED_BYTES - self.bytes;
        let n = std::io::copy(&mut r.take(left + 1), &mut f).map_err(|e| io(dest, e))?;
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

fn unpack(archive: &Path, dest: &Path) -> Result<(), InstallError> {
    let file = std::fs::File::open(archive).map_err(|e| io(archive, e))?;
    let name = archive.to_string_lossy();
    let reader: Box<dyn Read> = if name.ends_with(".tar.gz") || name.ends_with(".tgz") {
        Box::new(flate2::read::GzDecoder::new(file))
    } else if name.ends_with(".tar") {
        Box::new(file)
    } else {
        return Err(InstallError::Invalid(format!(
            "{}: expected a .tar.gz, .tgz or .tar archive, or a directory",
            archive.display()
        )));
    };
    mkdir(dest)?;
    let mut budget = Budget::default();
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
        let rel = safe_relative(&raw)?;
        let kind = entry.header().entry_type();
        if rel.as_os_str().is_empty() {
            if kind.is_dir() {
                continue;
            }
            return Err(InstallError::Invalid(format!("{}: an entry without a name", archive.display())));
        }
        let target = dest.join(&rel);
        if kind.is_dir() {
            std::fs::DirBuilder::new().mode(0o755).recursive(true).create(&target).map_err(|e| io(&target, e))?;
        } else if kind.is_file() {
            if let Some(parent) = target.parent() {
                std::fs::DirBuilder::new().mode(0o755).recursive(true).create(parent).map_err(|e| io(parent, e))?;
            }
            let executable = entry.header().mode().is_ok_and(|m| m & 0o111 != 0);
            budget.copy(&mut entry, &target, executable)?;
        } else {
            let what = if kind.is_symlink() {
                "a symbolic link"
            } else if kind.is_hard_link() {
                "a hard link"
            } else if kind.is_character_special() || kind.is_block_special() {
                "a device"
            } else if kind.is_fifo() {
                "a FIFO"
            } else {
                "not a regular file or directory"
            };
            return Err(InstallError::Invalid(format!("{}: {what} is refused", rel.display())));
        }
    }
    Ok(())
}

fn copy_tree(src: &Path, dest: &Path, budget: &mut Budget) -> Result<(), InstallError> {
    mkdir(dest)?;
    let mut entries: Vec<_> =
        std::fs::read_dir(src).map_err(|e| io(src, e))?.collect::<Result<_, _>>().map_err(|e| io(src, e))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        budget.entry()?;
        let name = e.file_name();
        let name_str =
            name.to_str().ok_or_else(|| InstallError::Invalid(format!("{}: name is not UTF-8", e.path().display())))?;
        // Build products and caches are not part of a package.
        if matches!(name_str, ".git" | "__pycache__" | ".pytest_cache" | ".deps") {
            continue;
        }
        let meta = std::fs::symlink_metadata(e.path()).map_err(|err| io(&e.path(), err))?;
        let target = dest.join(name_str);
        if meta.is_dir() {
            copy_tree(&e.path(), &target, budget)?;
        } else if meta.is_file() {
            let mut f = std::fs::File::open(e.path()).map_err(|err| io(&e.path(), err))?;
            budget.copy(&mut f, &target, meta.permissions().mode() & 0o111 != 0)?;
        } else {
            return Err(InstallError::Invalid(format!(
                "{}: symbolic links, devices and sockets are refused in a package",
                e.path().display()
            )));
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

fn install_requirements(pkg: &Path, packages: &[String], opts: &InstallOptions) -> Result<(), InstallError> {
    let mut cmd = std::process::Command::new(python());
    cmd.args(["-I", "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-compile"])
        .args(["--only-binary", ":all:", "--target"])
        .arg(pkg.join(".deps"));
    let wheels = pkg.join("wheels");
    let mut sources = 0;
    if wheels.is_dir() {
        cmd.arg("--find-links").arg(&wheels);
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
    cmd.env_clear().env("PATH", "/usr/bin:/bin").env("HOME", pkg).env("PIP_NO_CACHE_DIR", "1");
    let out = cmd.output().map_err(|e| InstallError::Invalid(format!("{}: cannot run pip: {e}", python())))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).rev().take(3).collect();
        return Err(InstallError::Invalid(format!(
            "requirements.packages: pip could not install {}: {}",
            packages.join(", "),
            last.into_iter().rev().collect::<Vec<_>>().join(" / ")
        )));
    }
    Ok(())
}

/// The installed executors, by name.
pub fn list(root: &Path) -> Result<Vec<ListEntry>, InstallError> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io(root, e)),
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let Some(dir) = resolve(root, &name) else { continue };
        match Executor::load(&dir) {
            Ok(ex) => out.push(ListEntry {
                name: ex.manifest.name.clone(),
                version: ex.manifest.version.clone(),
                path: dir,
                supported_actions: ex.manifest.supported_actions.clone(),
                description: ex.manifest.description.clone(),
            }),
            Err(err) => tracing::warn!(executor = name, error = %err.0, "installed executor does not load"),
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The directory `opservant run NAME` uses: `<root>/<name>/current`, resolved.
pub fn resolve(root: &Path, name: &str) -> Option<PathBuf> {
    if !crate::manifest::valid_name(name) {
        return None;
    }
    root.join(name).join("current").canonicalize().ok().filter(|p| p.starts_with(root) && p.is_dir())
}

/// Remove an installed executor. `Ok(false)` when it is not installed.
pub fn remove(root: &Path, name: &str) -> Result<bool, InstallError> {
    if !crate::manifest::valid_name(name) {
        return Err(InstallError::Invalid(format!("'{name}' is not an executor name")));
    }
    if !root.join(name).is_dir() {
        return Ok(false);
    }
    let doomed = unique(root, ".removing")?;
    let target = doomed.join(name);
    std::fs::rename(root.join(name), &target).map_err(|e| io(&root.join(name), e))?;
    std::fs::remove_dir_all(&doomed).map_err(|e| io(&doomed, e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_paths() {
        assert_eq!(safe_relative(Path::new("./a/b.py")).unwrap(), PathBuf::from("a/b.py"));
        assert!(safe_relative(Path::new("a/../../etc/passwd")).is_err());
        assert!(safe_relative(Path::new("/etc/passwd")).is_err());
        assert!(safe_relative(Path::new("..")).is_err());
    }
}
