//! Files the agent writes for its caller (`bench --json`/`--svg`, `sign --package`'s
//! signature): written whole or not at all, never through a link and never into a FIFO or
//! device left at the name.
//!
//! Guarantee of [`replace`]: the bytes go to a new file beside the destination (created
//! exclusively, `O_NOFOLLOW`, so nothing planted at the temporary name is opened), are
//! synced, and the new file is renamed over the destination — a symbolic link, FIFO or file
//! there is replaced, never followed or opened; a directory there fails the rename. A
//! failure at any step leaves the destination as it was and removes the temporary file.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The directory `path` is in (`.` for a bare name).
fn parent(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Replace `path` with `bytes` (a new file of `mode`), then sync its directory so the
/// rename is on the disk before success is reported.
pub fn replace(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let mut r = [0u8; 8];
    crate::random::fill(&mut r)?;
    let suffix: String = r.iter().map(|b| format!("{b:02x}")).collect();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp: PathBuf = parent(path).join(format!(".{name}.tmp-{}-{suffix}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::File::open(parent(path)).and_then(|d| d.sync_all()).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("written, but its directory could not be synced ({e}): a crash may lose it"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_or_fifo_at_the_name_is_replaced_never_followed_or_opened() {
        let dir = std::env::temp_dir().join(format!("opservant-whole-file-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let link = dir.join("report.json");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        replace(&link, b"report", 0o644).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(std::fs::symlink_metadata(&link).unwrap().is_file());
        assert_eq!(std::fs::read_to_string(&link).unwrap(), "report");

        let fifo = dir.join("chart.svg");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        replace(&fifo, b"<svg/>", 0o644).unwrap();
        assert_eq!(std::fs::read_to_string(&fifo).unwrap(), "<svg/>");

        std::fs::create_dir(dir.join("a-dir")).unwrap();
        assert!(replace(&dir.join("a-dir"), b"x", 0o644).is_err());
        // Nothing left beside them.
        let names: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().all(|n| !n.contains(".tmp-")), "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
