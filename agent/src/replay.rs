//! Replay protection: the `command_id`s the agent has accepted, persisted so that a command
//! replayed after a restart is still refused.
//!
//! Guarantees: [`SeenCommands::check_and_insert`] is atomic across processes (an exclusive
//! `flock` on the file) and durable before it returns `Ok` (the new line is `fdatasync`ed);
//! an id accepted once is refused for as long as a command carrying it could still pass the
//! clock-skew check — entries are pruned only when older than twice the skew window, after
//! which such a command is refused for its timestamp anyway. An unreadable or malformed file
//! is an error, never an empty set (fail closed).

use std::io::{BufRead, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Entries younger than this are kept (twice the skew window).
pub const RETENTION_S: i64 = 2 * crate::signing::MAX_SKEW_S;
/// The file is compacted when it holds more lines than this.
const COMPACT_AFTER: usize = 4096;
/// Longest `command_id` accepted.
pub const MAX_ID_BYTES: usize = 256;

#[derive(Debug, Error)]
pub enum ReplayError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}:{line}: malformed replay record")]
    Malformed { path: String, line: usize },
}

pub struct SeenCommands {
    path: PathBuf,
    compact_after: usize,
}

/// Whether a command id was new.
#[derive(Debug, PartialEq, Eq)]
pub enum Seen {
    New,
    Replayed,
}

impl SeenCommands {
    pub fn new(path: &Path) -> SeenCommands {
        SeenCommands { path: path.to_path_buf(), compact_after: COMPACT_AFTER }
    }

    fn io(&self, source: std::io::Error) -> ReplayError {
        ReplayError::Io { path: self.path.display().to_string(), source }
    }

    /// Record `id` (accepted at `now`) unless it was seen before.
    pub fn check_and_insert(&self, id: &str, now: i64) -> Result<Seen, ReplayError> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| self.io(e))?;
        }
        let mut f = loop {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .mode(0o600)
                .open(&self.path)
                .map_err(|e| self.io(e))?;
            // SAFETY: flock on a descriptor this File owns; no memory is passed.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(self.io(std::io::Error::last_os_error()));
            }
            // A compaction may have renamed a new file over the one we locked: lock that.
            use std::os::unix::fs::MetadataExt;
            let locked = f.metadata().map_err(|e| self.io(e))?;
            match std::fs::metadata(&self.path) {
                Ok(now) if now.ino() == locked.ino() && now.dev() == locked.dev() => break f,
                _ => continue,
            }
        };
        let scan = self.scan(&mut f, id, now)?;
        if scan.found {
            return Ok(Seen::Replayed);
        }
        let line = format!("{now} {}\n", escape(id));
        // Compact only when there is something to drop — at least a quarter of the lines
        // expired — so a busy agent whose entries are all within the window does not rewrite
        // the file on every command.
        if scan.lines >= self.compact_after && scan.expired * 4 >= scan.lines {
            // Rewrite without the expired entries: a new file renamed over the old one, under
            // the same lock (the lock is on the old inode; writers re-check after locking).
            let tmp = self.path.with_extension("tmp");
            let out = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| self.io(e))?;
            let mut out = std::io::BufWriter::new(out);
            self.for_each(&mut f, |t, raw| {
                if now - t <= RETENTION_S {
                    writeln!(out, "{t} {raw}")?;
                }
                Ok(())
            })?;
            out.write_all(line.as_bytes()).map_err(|e| self.io(e))?;
            let out = out.into_inner().map_err(|e| self.io(e.into_error()))?;
            out.sync_data().map_err(|e| self.io(e))?;
            std::fs::rename(&tmp, &self.path).map_err(|e| self.io(e))?;
            return Ok(Seen::New);
        }
        f.write_all(line.as_bytes()).and_then(|()| f.sync_data()).map_err(|e| self.io(e))?;
        Ok(Seen::New)
    }

    /// One pass over the file, holding one line at a time (the file may hold tens of
    /// thousands of ids; collecting them on every command grew the agent's heap).
    fn scan(&self, f: &mut std::fs::File, id: &str, now: i64) -> Result<Scan, ReplayError> {
        let mut scan = Scan { found: false, lines: 0, expired: 0 };
        self.for_each(f, |t, raw| {
            scan.lines += 1;
            if now - t > RETENTION_S {
                scan.expired += 1;
            }
            if !scan.found && unescape(raw).as_deref() == Some(id) {
                scan.found = true;
            }
            Ok(())
        })?;
        Ok(scan)
    }

    /// Call `each(timestamp, escaped id)` for every line; a malformed line is an error.
    fn for_each(
        &self,
        f: &mut std::fs::File,
        mut each: impl FnMut(i64, &str) -> std::io::Result<()>,
    ) -> Result<(), ReplayError> {
        f.rewind().map_err(|e| self.io(e))?;
        let mut reader = std::io::BufReader::new(&*f);
        let mut line = String::new();
        let mut n = 0;
        loop {
            line.clear();
            if reader.read_line(&mut line).map_err(|e| self.io(e))? == 0 {
                return Ok(());
            }
            n += 1;
            let malformed = || ReplayError::Malformed { path: self.path.display().to_string(), line: n };
            let (t, raw) = line.trim_end_matches('\n').split_once(' ').ok_or_else(malformed)?;
            let t: i64 = t.parse().map_err(|_| malformed())?;
            if unescape(raw).is_none() {
                return Err(malformed());
            }
            each(t, raw).map_err(|e| self.io(e))?;
        }
    }
}

/// What one pass over the file found.
struct Scan {
    found: bool,
    lines: usize,
    expired: usize,
}

/// Ids are stored JSON-escaped so any string fits on one line.
fn escape(id: &str) -> String {
    serde_json::Value::String(id.to_string()).to_string()
}

fn unescape(s: &str) -> Option<String> {
    match serde_json::from_str::<serde_json::Value>(s).ok()? {
        serde_json::Value::String(v) => Some(v),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (PathBuf, SeenCommands) {
        let dir = std::env::temp_dir().join(format!("opservant-replay-{}-{}", std::process::id(), rand()));
        let path = dir.join("seen");
        let mut s = SeenCommands::new(&path);
        s.compact_after = 16;
        (dir, s)
    }

    fn rand() -> u64 {
        let mut b = [0u8; 8];
        crate::random::fill(&mut b).unwrap();
        u64::from_ne_bytes(b)
    }

    #[test]
    fn ids_are_refused_the_second_time_even_after_reopening() {
        let (dir, s) = store();
        assert_eq!(s.check_and_insert("cmd-1", 1000).unwrap(), Seen::New);
        assert_eq!(s.check_and_insert("cmd-2", 1000).unwrap(), Seen::New);
        assert_eq!(s.check_and_insert("cmd-1", 1001).unwrap(), Seen::Replayed);
        let again = SeenCommands::new(&dir.join("seen"));
        assert_eq!(again.check_and_insert("cmd-2", 1002).unwrap(), Seen::Replayed);
        assert_eq!(again.check_and_insert("odd \"id\"\nwith newline", 1002).unwrap(), Seen::New);
        assert_eq!(again.check_and_insert("odd \"id\"\nwith newline", 1003).unwrap(), Seen::Replayed);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn compaction_keeps_what_is_within_the_window() {
        let (dir, s) = store();
        for i in 0..16 {
            s.check_and_insert(&format!("old-{i}"), 0).unwrap();
        }
        s.check_and_insert("recent", 10).unwrap();
        // Nothing has expired (t=0 is within 600 s of 10): the file is not rewritten.
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata(dir.join("seen")).unwrap().ino();
        assert_eq!(s.check_and_insert("old-5", 20).unwrap(), Seen::Replayed);
        s.check_and_insert("recent-2", 20).unwrap();
        assert_eq!(std::fs::metadata(dir.join("seen")).unwrap().ino(), inode);
        // Much later, a compaction drops them.
        for i in 0..32 {
            s.check_and_insert(&format!("new-{i}"), 10_000).unwrap();
        }
        assert_eq!(s.check_and_insert("old-5", 10_000).unwrap(), Seen::New);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_damaged_file_is_an_error_not_an_empty_set() {
        let (dir, s) = store();
        s.check_and_insert("a", 1).unwrap();
        std::fs::write(dir.join("seen"), "garbage\n").unwrap();
        assert!(matches!(s.check_and_insert("a", 2), Err(ReplayError::Malformed { line: 1, .. })));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
