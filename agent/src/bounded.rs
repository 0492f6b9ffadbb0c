//! Reading a file the configuration or the command line names as a file of a kind (a
//! configuration, a manifest, a script, a CA, a certificate, a key, a signature, an archive),
//! no further than a cap: only a regular file is read, opened without blocking, so a FIFO
//! cannot hang the agent and a device like `/dev/zero` cannot fill its memory. Arguments
//! that are data rather than files (`--params @FILE`, a command read from a path or `-`)
//! may be FIFOs — a shell's `<(…)` — and are read with a cap only.

use std::fs::File;
use std::io::{Error, ErrorKind, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Open one of the agent's own files (the audit log, its lock and rotated files, the replay
/// index) with `options`: never through a link at its name, never blocking on a FIFO or
/// taking a terminal; anything but a regular file is refused (`InvalidInput`), before it is
/// opened (opening a device can act) and on what was opened.
pub fn open_regular_nofollow(path: &Path, options: &mut std::fs::OpenOptions) -> std::io::Result<File> {
    let not_regular = || Error::new(ErrorKind::InvalidInput, "not a regular file");
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.is_file() => return Err(not_regular()),
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let file =
        options.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY).open(path)?;
    if !file.metadata()?.is_file() {
        return Err(not_regular());
    }
    Ok(file)
}

/// The regular file at `path` (links followed: the path is the caller's), opened for reading
/// with `O_NONBLOCK` (no effect on a regular file's reads). Errors: `InvalidInput` when it is
/// not a regular file; otherwise the I/O error.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let not_regular = || Error::new(ErrorKind::InvalidInput, "not a regular file");
    // Checked before opening — opening a device can act (a watchdog is armed by it) — and
    // again on what was opened, should the path have been swapped in between (non-blocking
    // and without a controlling terminal, so that a swapped-in FIFO or tty does nothing).
    if !std::fs::metadata(path)?.is_file() {
        return Err(not_regular());
    }
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path)?;
    if !file.metadata()?.is_file() {
        return Err(not_regular());
    }
    Ok(file)
}

/// The whole of the regular file at `path`, at most `limit` bytes. Errors: `InvalidInput`
/// when it is not a regular file, `InvalidData` when it is larger; otherwise the I/O error.
pub fn read_regular(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    read_capped(open_regular(path)?, limit)
}

/// The rest of `file`, at most `limit` bytes (`InvalidData` when there is more). The buffer
/// is sized from the file's length once, so that a secret read here is not left behind in
/// the freed copies of a growing buffer.
pub fn read_capped(file: File, limit: u64) -> std::io::Result<Vec<u8>> {
    let size = file.metadata()?.len().min(limit);
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0).saturating_add(1));
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(Error::new(ErrorKind::InvalidData, format!("larger than {limit} bytes")));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_regular_file_up_to_the_cap_and_refuses_anything_else() {
        let dir = std::env::temp_dir().join(format!("opservant-bounded-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, b"12345").unwrap();
        assert_eq!(read_regular(&file, 5).unwrap(), b"12345");
        let e = read_regular(&file, 4).unwrap_err();
        assert!(e.to_string().contains("larger than 4 bytes"), "{e}");
        let e = read_regular(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = read_regular(&fifo, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
