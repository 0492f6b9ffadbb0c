//! Replay protection: the `command_id`s the agent has accepted, persisted so that a command
//! replayed after a restart is still refused.
//!
//! Guarantees: [`SeenCommands::check_and_insert`] is atomic across processes (an exclusive
//! `flock` on the file) and durable before it returns `Ok` (the new line is `fdatasync`ed,
//! and so is the directory entry of a file or state directory it created, or of a compacted
//! file renamed into place; when one of those syncs fails it returns `Err` — the id is in
//! the file by then, so the command is rejected and a resend is refused as a replay);
//! an id accepted once is refused for as long as a command carrying it could still pass the
//! clock-skew check — entries are pruned only when older than twice the skew window, after
//! which such a command is refused for its timestamp anyway. An unreadable or malformed file
//! is an error, never an empty set (fail closed).
//!
//! **The clock may step.** "Older" is judged by the wall clock at the compaction, which may be
//! wrong: a clock stepped a day forward drops every entry, and once it is set right a
//! captured command's timestamp passes the skew check again. So a compaction also records
//! the *horizon* — the latest receipt time among the entries it dropped — and a check at a
//! time `now <= horizon + RETENTION_S` returns [`Seen::Forgotten`] (refused) for an id not in
//! the file: a dropped id was accepted at a time `t <= horizon`, so its command's timestamp is
//! at most `horizon + MAX_SKEW_S`, and it passes the skew check only while `now <= horizon +
//! 2 × MAX_SKEW_S`. An id whose command could still pass the check is therefore never
//! forgotten, whatever the clock did. With a clock that only goes forward this refuses
//! nothing (a compaction at `now` drops only entries before `now - RETENTION_S -
//! COMPACTION_MARGIN_S`, so no check that read its `now` before it took the lock is refused either); after a
//! step back it refuses every new id for at most `RETENTION_S` past the horizon — fail
//! closed, the platform resends with a new id. (Pruning by the commands' own timestamps
//! would not help: the clock checking them is the one that stepped.)
//!
//! The file: one line per id, `<receipt time> <id as a JSON string>`; the horizon is a line of
//! the same form with the empty id (`<horizon> ""`, first in a compacted file), which no
//! command carries (`command_id` is 1–256 bytes; [`SeenCommands::check_and_insert`] refuses an
//! empty one). A file written before the horizon existed reads as one without it, and an
//! older agent reads the horizon as an id no command matches (its own compaction drops it
//! once expired: after a downgrade the horizon is kept only until then).
//!
//! Cost: each process keeps an index of what it has read — per id a 128-bit SHA-256 prefix
//! and its time — keyed to the file's inode and the offset read up to; a check reads only
//! the lines appended since (by it or by another process), so a busy agent does not re-read
//! the whole window on every command (at 300 commands/s that is 180 000 lines). The file is
//! read in full again after a compaction (a new inode), or when it is shorter than the
//! offset or the byte before the offset is not a line end (it was rewritten in place).
//! Two different ids sharing a 128-bit prefix would make the second one refused as a replay:
//! an error on the safe side, and at these sizes beyond any practical chance.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Entries younger than this are kept (twice the skew window).
pub const RETENTION_S: i64 = 2 * crate::signing::MAX_SKEW_S;
/// How much longer than [`RETENTION_S`] a compaction keeps an entry: a caller reads `now`
/// before it takes the file's lock (behind a signature check, an audit record's lock wait of
/// up to an hour, other checks), so a concurrent check with a later `now` may compact first;
/// dropping only what even the earliest caller still waiting would count as expired keeps
/// that caller's `now` out of the horizon's reach.
pub const COMPACTION_MARGIN_S: i64 = 2 * 3600;
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
    /// The empty id is the file's horizon line, never a command's.
    #[error("an empty command_id cannot be recorded")]
    EmptyId,
}

pub struct SeenCommands {
    path: PathBuf,
    compact_after: usize,
    /// What this process has read of the file (None: nothing yet, or read it all again).
    index: std::sync::Mutex<Option<Index>>,
}

/// The ids of the file up to `offset`, for the inode `(dev, ino)`.
struct Index {
    dev: u64,
    ino: u64,
    /// Bytes read, at a line end.
    offset: u64,
    /// Lines read.
    lines: usize,
    ids: HashMap<[u8; 16], i64>,
    /// Lines per timestamp (to count the expired ones).
    times: BTreeMap<i64, usize>,
    /// The latest receipt time a compaction dropped ids of (the module documentation's
    /// horizon), from the file's `<t> ""` lines.
    forgotten: Option<i64>,
}

impl Index {
    fn add(&mut self, t: i64, id: &str) {
        if id.is_empty() {
            // The horizon line: not an id, never expired.
            self.forgotten = Some(self.forgotten.map_or(t, |f| f.max(t)));
            self.lines += 1;
            return;
        }
        self.ids.insert(digest(id), t);
        *self.times.entry(t).or_default() += 1;
        self.lines += 1;
    }

    /// Lines a compaction at `now` drops: older than the retention window and the margin.
    fn expired(&self, now: i64) -> usize {
        self.times.range(..drop_before(now)).map(|(_, n)| n).sum()
    }
}

fn digest(id: &str) -> [u8; 16] {
    use sha2::Digest;
    let full = sha2::Sha256::digest(id.as_bytes());
    let mut d = [0u8; 16];
    d.copy_from_slice(&full[..16]);
    d
}

/// Whether a command id was new.
#[derive(Debug, PartialEq, Eq)]
pub enum Seen {
    New,
    Replayed,
    /// Not in the file, but ids were dropped whose commands could still pass the clock
    /// check now (the clock went back past a compaction): it cannot be told from a replay,
    /// and is not recorded.
    Forgotten,
}

impl SeenCommands {
    pub fn new(path: &Path) -> SeenCommands {
        SeenCommands { path: path.to_path_buf(), compact_after: COMPACT_AFTER, index: Default::default() }
    }

    fn io(&self, source: std::io::Error) -> ReplayError {
        ReplayError::Io { path: self.path.display().to_string(), source }
    }

    /// Record `id` (accepted at `now`) unless it was seen before.
    pub fn check_and_insert(&self, id: &str, now: i64) -> Result<Seen, ReplayError> {
        if id.is_empty() {
            return Err(ReplayError::EmptyId);
        }
        if let Some(dir) = self.path.parent() {
            // The state directory itself, when missing, is created the agent's alone (0700).
            if let Some(up) = dir.parent() {
                std::fs::create_dir_all(up).map_err(|e| self.io(e))?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(self.io(e)),
                Err(_) => {}
                // A directory made here survives a crash before anything is recorded in it.
                Ok(()) => sync_dir(dir.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")))
                    .map_err(|e| self.io(e))?,
            }
        }
        let mut f = loop {
            // Never through a link planted at the name, never blocking on a FIFO; a regular
            // file only.
            let f = crate::bounded::open_regular_nofollow(
                &self.path,
                std::fs::OpenOptions::new().read(true).append(true).create(true).mode(0o600),
            )
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
        // The index is only ever changed under the file lock; a panic while holding it
        // leaves at worst a stale index, which the next check discards (None).
        let mut guard = self.index.lock().unwrap_or_else(|e| e.into_inner());
        let index = self.catch_up(guard.take(), &mut f)?;
        // A torn last line (see `for_each_from`) is cut off before anything is appended.
        if f.metadata().map_err(|e| self.io(e))?.len() > index.offset {
            f.set_len(index.offset).map_err(|e| self.io(e))?;
        }
        if index.ids.contains_key(&digest(id)) {
            *guard = Some(index);
            return Ok(Seen::Replayed);
        }
        if index.forgotten.is_some_and(|h| now <= h.saturating_add(RETENTION_S)) {
            *guard = Some(index);
            return Ok(Seen::Forgotten);
        }
        let line = format!("{now} {}\n", escape(id));
        // Compact only when there is something to drop — at least a quarter of the lines
        // expired — so a busy agent whose entries are all within the window does not rewrite
        // the file on every command.
        if index.lines >= self.compact_after && index.expired(now) * 4 >= index.lines {
            // Rewrite without the expired entries: a new file renamed over the old one, under
            // the same lock (the lock is on the old inode; writers re-check after locking).
            let tmp = self.path.with_extension("tmp");
            // A new file, never through a link planted at its name (a crash's leftover is
            // removed first; removing a link removes the link).
            match std::fs::remove_file(&tmp) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(self.io(e)),
                _ => {}
            }
            let out = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&tmp)
                .map_err(|e| self.io(e))?;
            let mut out = std::io::BufWriter::new(out);
            // The horizon first: the one read, raised to the latest entry dropped now (the
            // entries kept are exactly those the index does not count as expired).
            let dropped = index.times.range(..drop_before(now)).next_back().map(|(t, _)| *t);
            let horizon = index.forgotten.max(dropped);
            if let Some(h) = horizon {
                writeln!(out, "{h} {}", escape("")).map_err(|e| self.io(e))?;
            }
            self.for_each(&mut f, |t, id| {
                if !id.is_empty() && t >= drop_before(now) {
                    writeln!(out, "{t} {}", escape(id))?;
                }
                Ok(())
            })?;
            out.write_all(line.as_bytes()).map_err(|e| self.io(e))?;
            let out = out.into_inner().map_err(|e| self.io(e.into_error()))?;
            out.sync_data().map_err(|e| self.io(e))?;
            std::fs::rename(&tmp, &self.path).map_err(|e| self.io(e))?;
            // The rename made durable: until then a crash could bring back the old file,
            // without this id. A failed sync is an error (the command does not run); the id
            // is in the file now, so a resend is refused as a replay.
            self.sync_parent().map_err(|e| self.io(e))?;
            // A new inode: read in full by the next check.
            return Ok(Seen::New);
        }
        let mut index = index;
        // A file made by this check (or another's that did not get this far) is still
        // empty: its directory entry is synced once the line is, or a crash could lose the
        // file and the id with it.
        let first_line = index.offset == 0;
        if let Err(e) = f.write_all(line.as_bytes()).and_then(|()| f.sync_data()) {
            // Whatever part of the line was written goes again (this id was not recorded and
            // its command does not run), so the next check finds a whole file.
            let _ = f.set_len(index.offset);
            *guard = None;
            return Err(self.io(e));
        }
        if first_line {
            // The id is in the file: a resend is refused as a replay even when this fails.
            self.sync_parent().map_err(|e| self.io(e))?;
        }
        index.offset += line.len() as u64;
        index.add(now, id);
        *guard = Some(index);
        Ok(Seen::New)
    }

    /// `fsync` the directory holding the file.
    fn sync_parent(&self) -> std::io::Result<()> {
        sync_dir(self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")))
    }

    /// `index` brought up to the end of the locked file `f`: the lines appended since it was
    /// read, or the whole file when `index` is for another inode, or the file no longer
    /// continues what was read.
    fn catch_up(&self, index: Option<Index>, f: &mut std::fs::File) -> Result<Index, ReplayError> {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let meta = f.metadata().map_err(|e| self.io(e))?;
        let continues = |i: &Index| {
            let mut last = [0u8; 1];
            i.dev == meta.dev()
                && i.ino == meta.ino()
                && meta.len() >= i.offset
                && (i.offset == 0 || (f.read_at(&mut last, i.offset - 1).ok() == Some(1) && last[0] == b'\n'))
        };
        let mut index = match index {
            Some(i) if continues(&i) => i,
            _ => Index {
                dev: meta.dev(),
                ino: meta.ino(),
                offset: 0,
                lines: 0,
                ids: HashMap::new(),
                times: BTreeMap::new(),
                forgotten: None,
            },
        };
        f.seek(SeekFrom::Start(index.offset)).map_err(|e| self.io(e))?;
        let mut read = 0u64;
        self.for_each_from(
            &*f,
            index.lines,
            |t, id| {
                index.add(t, id);
                Ok(())
            },
            &mut read,
        )?;
        index.offset += read;
        Ok(index)
    }

    /// Call `each(timestamp, id)` for every line of the whole file (for a compaction); a
    /// malformed line is an error.
    fn for_each(
        &self,
        f: &mut std::fs::File,
        each: impl FnMut(i64, &str) -> std::io::Result<()>,
    ) -> Result<(), ReplayError> {
        f.rewind().map_err(|e| self.io(e))?;
        let mut read = 0;
        self.for_each_from(&*f, 0, each, &mut read)
    }

    /// Parse the lines from the current position of `f` to its end, calling `each(timestamp,
    /// id)` for each; lines are numbered from `lines_before + 1` in errors. Adds the bytes
    /// consumed to `read`.
    fn for_each_from(
        &self,
        f: impl Read,
        lines_before: usize,
        mut each: impl FnMut(i64, &str) -> std::io::Result<()>,
        read: &mut u64,
    ) -> Result<(), ReplayError> {
        let mut reader = std::io::BufReader::new(f);
        let mut raw_line = Vec::new();
        let mut n = lines_before;
        loop {
            raw_line.clear();
            // Bytes first: a line torn inside a multi-byte character is not UTF-8.
            let len = reader.read_until(b'\n', &mut raw_line).map_err(|e| self.io(e))?;
            if len == 0 {
                return Ok(());
            }
            if raw_line.last() != Some(&b'\n') {
                // A last line without its newline is a write that failed or a crash cut
                // short: its id was never confirmed (the check returns only after the whole
                // line is written and synced), so it is not read; the next append truncates
                // it away ([`SeenCommands::check_and_insert`]).
                return Ok(());
            }
            n += 1;
            let malformed = || ReplayError::Malformed { path: self.path.display().to_string(), line: n };
            let line = std::str::from_utf8(&raw_line).map_err(|_| malformed())?;
            let (t, raw) = line.trim_end_matches('\n').split_once(' ').ok_or_else(malformed)?;
            let t: i64 = t.parse().map_err(|_| malformed())?;
            let id = unescape(raw).ok_or_else(malformed)?;
            each(t, &id).map_err(|e| self.io(e))?;
            *read += len as u64;
        }
    }
}

/// Entries received before this are dropped by a compaction at `now`.
fn drop_before(now: i64) -> i64 {
    now.saturating_sub(RETENTION_S).saturating_sub(COMPACTION_MARGIN_S)
}

/// `fsync` a directory. A filesystem that cannot sync directories (`EINVAL`) has nothing to
/// make durable that way: not an error.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::File::open(dir).and_then(|d| d.sync_all()) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        r => r,
    }
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

    /// The index is never opened through a link planted at its name, nor waited on as a
    /// FIFO; a state directory it creates is 0700.
    #[test]
    fn the_index_is_a_regular_file_never_reached_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let (dir, s) = store();
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("target");
        std::fs::write(&target, "precious\n").unwrap();
        std::os::unix::fs::symlink(&target, dir.join("seen")).unwrap();
        assert!(s.check_and_insert("cmd-1", 1000).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious\n");
        std::fs::remove_file(dir.join("seen")).unwrap();
        nix::unistd::mkfifo(&dir.join("seen"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = s.check_and_insert("cmd-1", 1000).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        let (dir, s) = store();
        assert_eq!(s.check_and_insert("cmd-1", 1000).unwrap(), Seen::New);
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
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

    /// The clock stepped a day forward and a compaction there dropped every entry; once the
    /// clock is set right, a captured command (its timestamp within the skew window again)
    /// must not be accepted as new. Before, its id was simply gone.
    #[test]
    fn ids_dropped_under_a_clock_stepped_forward_are_not_accepted_once_it_is_set_back() {
        let (dir, s) = store();
        for i in 0..16 {
            s.check_and_insert(&format!("cmd-{i}"), 1000).unwrap();
        }
        assert_eq!(s.check_and_insert("captured", 1000).unwrap(), Seen::New);
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata(dir.join("seen")).unwrap().ino();
        assert_eq!(s.check_and_insert("x", 87_400).unwrap(), Seen::New);
        assert_ne!(std::fs::metadata(dir.join("seen")).unwrap().ino(), inode, "compacted");
        for store in [&s, &SeenCommands::new(&dir.join("seen"))] {
            assert_ne!(store.check_and_insert("captured", 1100).unwrap(), Seen::New);
            // Nor any other id while a command dropped could still pass the clock check.
            assert_eq!(store.check_and_insert("fresh", 1000 + RETENTION_S).unwrap(), Seen::Forgotten);
        }
        // Past that, new ids are accepted again.
        assert_eq!(s.check_and_insert("fresh", 1001 + RETENTION_S).unwrap(), Seen::New);
        assert_eq!(s.check_and_insert("fresh", 1001 + RETENTION_S).unwrap(), Seen::Replayed);
        // The horizon is the compacted file's first line, an id no command can carry.
        let text = std::fs::read_to_string(dir.join("seen")).unwrap();
        assert_eq!(text.lines().next(), Some("1000 \"\""), "{text}");
        assert!(matches!(s.check_and_insert("", 2000), Err(ReplayError::EmptyId)));
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Two checks read `now` (1000 and 1001) before they take the lock; the later one takes
    /// it first and compacts. The earlier one's new id is still new: what the compaction
    /// dropped cannot put the horizon within reach of a `now` read a moment before.
    #[test]
    fn a_compaction_by_a_later_check_does_not_refuse_an_earlier_ones_new_id() {
        for old in [1000 - RETENTION_S, 1001 - RETENTION_S - COMPACTION_MARGIN_S - 1] {
            let (dir, s) = store();
            for i in 0..16 {
                s.check_and_insert(&format!("old-{i}"), old).unwrap();
            }
            assert_eq!(s.check_and_insert("later", 1001).unwrap(), Seen::New);
            assert_eq!(s.check_and_insert("earlier", 1000).unwrap(), Seen::New, "entries at {old}");
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    #[test]
    fn each_store_sees_what_another_appended_or_compacted() {
        // Two stores on one file, as the agent and a second process would be.
        let (dir, a) = store();
        let mut b = SeenCommands::new(&dir.join("seen"));
        b.compact_after = 16;
        assert_eq!(a.check_and_insert("from-a", 0).unwrap(), Seen::New);
        assert_eq!(b.check_and_insert("from-b", 0).unwrap(), Seen::New);
        assert_eq!(a.check_and_insert("from-b", 1).unwrap(), Seen::Replayed);
        assert_eq!(b.check_and_insert("from-a", 1).unwrap(), Seen::Replayed);
        for i in 0..16 {
            a.check_and_insert(&format!("old-{i}"), 0).unwrap();
        }
        // B compacts (18 of 18 lines expired; a new file renamed over the old one): A reads
        // the new file in full.
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata(dir.join("seen")).unwrap().ino();
        assert_eq!(b.check_and_insert("late", 10_000).unwrap(), Seen::New);
        assert_ne!(std::fs::metadata(dir.join("seen")).unwrap().ino(), inode, "compacted");
        assert_eq!(a.check_and_insert("late", 10_000).unwrap(), Seen::Replayed);
        assert_eq!(a.check_and_insert("from-a", 10_000).unwrap(), Seen::New, "expired and compacted away");
        assert_eq!(b.check_and_insert("from-a", 10_000).unwrap(), Seen::Replayed, "B catches up with A");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Checks racing on one file — threads of one store and stores of their own, as other
    /// processes would be — accept each id exactly once and leave every line whole (a
    /// shared `flock` in place of the exclusive one fails it).
    #[test]
    fn concurrent_checks_accept_each_id_once() {
        let (dir, s) = store();
        let s = std::sync::Arc::new(s);
        const THREADS: usize = 8;
        const IDS: usize = 40;
        let accepted: Vec<Vec<String>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..THREADS)
                .map(|t| {
                    let shared = std::sync::Arc::clone(&s);
                    let own = SeenCommands::new(&dir.join("seen"));
                    scope.spawn(move || {
                        let store = if t % 2 == 0 { &*shared } else { &own };
                        let mut mine = Vec::new();
                        for i in 0..IDS {
                            // Every thread tries every id, starting at a different one.
                            let id = format!("cmd-{}", (i + t * 5) % IDS);
                            if store.check_and_insert(&id, 1000).unwrap() == Seen::New {
                                mine.push(id);
                            }
                        }
                        mine
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let mut all: Vec<String> = accepted.into_iter().flatten().collect();
        all.sort();
        let mut expected: Vec<String> = (0..IDS).map(|i| format!("cmd-{i}")).collect();
        expected.sort();
        assert_eq!(all, expected, "each id accepted by exactly one check");
        let text = std::fs::read_to_string(dir.join("seen")).unwrap();
        assert_eq!(text.lines().count(), IDS);
        assert!(text.lines().all(|l| l.starts_with("1000 \"cmd-") && l.ends_with('"')), "{text}");
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

    #[test]
    fn a_torn_last_line_is_cut_off_not_an_error_for_ever() {
        // A write cut short (a full disk, a crash before the sync) leaves a line without its
        // newline; that id was never confirmed. Before, every later check was `Malformed`.
        let (dir, s) = store();
        s.check_and_insert("a", 1).unwrap();
        let mut f = std::fs::OpenOptions::new().append(true).open(dir.join("seen")).unwrap();
        // Cut inside a multi-byte character (é is 0xC3 0xA9): not even UTF-8.
        f.write_all(b"2 \"tor\xC3").unwrap();
        drop(f);
        for reopened in [false, true] {
            let other;
            let s = if reopened {
                other = SeenCommands::new(&dir.join("seen"));
                &other
            } else {
                &s
            };
            let id = format!("next-{reopened}");
            assert_eq!(s.check_and_insert(&id, 3).unwrap(), Seen::New);
            assert_eq!(s.check_and_insert(&id, 3).unwrap(), Seen::Replayed);
            assert_eq!(s.check_and_insert("a", 3).unwrap(), Seen::Replayed);
        }
        let text = std::fs::read_to_string(dir.join("seen")).unwrap();
        assert_eq!(text.lines().count(), 3, "{text:?}");
        assert!(!text.contains("tor"), "{text:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
