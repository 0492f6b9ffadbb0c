//! The log's high-water marks: the seq and SHA-256 of the newest record *written*, and of
//! the newest record known *durable*, kept in the log's lock file (`<log>.lock`, which no
//! rotation renames and no set-aside of a log file moves), one 128-byte slot each.
//!
//! What they are for: telling records lost to a crash from records taken out of the log.
//! - When the newest file holds no complete record — missing, or empty — the next append
//!   chains from the newest rotated file (a rotation cut short after its rename) or starts
//!   the genesis. The same state is what an operator leaves who sets the newest file aside
//!   (a damaged tail, as the append's error says to do), or what a file emptied or deleted
//!   leaves; before, the next append then reused the missing records' seqs and `verify` said
//!   the log was intact. A cut-short rotation leaves the written mark at the rotated file's
//!   last record; records that went with the file leave it past that.
//! - When the newest file does hold records, a crash can still leave the written mark past
//!   its end (lines written but never flushed, never acknowledged) — but never the durable
//!   mark: that one past the file's last record means records that were durable were cut
//!   off its end, or the log was put back to an older copy.
//!
//! Either way the next record says which seqs are missing (`gap`, see the parent module) and
//! is numbered after them.
//!
//! Guarantees:
//! - The written mark is written under the log's lock, after the record's line — and, when
//!   the line's flush and the directory's are made under the lock (a rotation's
//!   continuation, a file's first record, a repair, a process whose flush failed once), after
//!   those too, together with the durable mark. A mark that reached the disk so never names
//!   a record of a file whose first record did not.
//! - The durable mark is written only after a flush that covered its record succeeded
//!   ([`super::GroupCommit`]), by the process that flushed; a later flush of another
//!   process may write an older one over it (a mark may lag, never lead).
//! - Each is one `pwrite` (no flush of its own; ~1 µs beside an append's ~200 µs); reading
//!   both is one `pread`, once an append.
//! - A mark that cannot be read — none yet (an older build's lock file is empty), or not
//!   one this module wrote — is `None`: the append behaves as before the marks existed. A
//!   mark never makes an append fail; one that cannot be written is a warning.
//!
//! What they do not do:
//! - Survive a power loss whole: they are not flushed (that would double an append's
//!   cost), so after a crash of the host either may lag the log by up to the kernel's
//!   write-back interval (~30 s) — and so may they when an append failed after its line was
//!   durable (the directory's flush) or an older build appended meanwhile. A lagging mark
//!   records a gap short, or not at all (as before the marks: seqs reused); it never
//!   records one where no record went missing.
//! - Resist whoever can remove or rewrite the lock file too (root: the journald mirror and
//!   the platform's heads are the anchors off the host). A lock file removed with the
//!   newest file leaves a silent continuation, as before the marks.
//! - Name records cut off the end when no append follows (`verify` reads no marks: the
//!   next append records the gap).
//! - Chain a gap from the right file when the newest rotated file (`.1`) is missing too:
//!   the record then starts from the genesis, and `verify` reports it (as `edited`, the
//!   seqs it says are missing overlapping records still there).

use std::fs::File;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

/// One mark's size on disk: its JSON, padded with spaces, and a newline.
pub const BYTES: usize = 128;

/// Where each mark is in the lock file.
const WRITTEN_AT: u64 = 0;
const DURABLE_AT: u64 = BYTES as u64;

/// A record of the log: its seq and the SHA-256 of its line as stored (lowercase hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HighWater {
    pub seq: u64,
    pub sha256: String,
}

/// The two marks as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Marks {
    /// The newest record written (its line in the file, flushed or not).
    pub written: Option<HighWater>,
    /// The newest record known durable (its flush, or a later one of its file, succeeded).
    pub durable: Option<HighWater>,
}

impl Marks {
    /// The newest record either mark names.
    pub fn newest(&self) -> Option<&HighWater> {
        [&self.written, &self.durable].into_iter().flatten().max_by_key(|m| m.seq)
    }
}

/// The marks in `lock` (one `pread`), each `None` unless this module wrote it.
pub fn read(lock: &File) -> Marks {
    let mut buf = [0u8; 2 * BYTES];
    let n = lock.read_at(&mut buf, 0).unwrap_or(0);
    let slot = |at: usize| -> Option<HighWater> {
        let bytes = buf.get(at..(at + BYTES).min(n))?;
        let mark: HighWater = serde_json::from_slice(bytes.trim_ascii()).ok()?;
        (mark.seq >= 1 && super::is_hex64(&mark.sha256)).then_some(mark)
    };
    Marks { written: slot(WRITTEN_AT as usize), durable: slot(DURABLE_AT as usize) }
}

/// One mark's bytes: always [`BYTES`], so a shorter mark leaves nothing of a longer one.
fn slot(mark: &HighWater) -> std::io::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec(mark).map_err(std::io::Error::other)?;
    // `{"seq":` + 20 digits + `,"sha256":"` + 64 + `"}` is 104 bytes: it always fits.
    if bytes.len() >= BYTES {
        return Err(std::io::Error::other("a high-water mark does not fit its slot"));
    }
    bytes.resize(BYTES - 1, b' ');
    bytes.push(b'\n');
    Ok(bytes)
}

/// Mark `mark` written — and durable too when `durable` (one `pwrite` either way).
pub fn write(lock: &File, mark: &HighWater, durable: bool) -> std::io::Result<()> {
    let mut bytes = slot(mark)?;
    if durable {
        bytes.extend_from_within(..);
    }
    lock.write_all_at(&bytes, WRITTEN_AT)
}

/// Mark `mark` durable (one `pwrite`): called once its flush succeeded.
pub fn write_durable(lock: &File, mark: &HighWater) -> std::io::Result<()> {
    lock.write_all_at(&slot(mark)?, DURABLE_AT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch_file(tag: &str) -> (super::super::tests::Scratch, File) {
        let s = super::super::tests::Scratch::new(tag);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(s.0.join("lock"))
            .unwrap();
        (s, f)
    }

    #[test]
    fn marks_read_back_and_a_shorter_one_replaces_a_longer() {
        let (_s, f) = scratch_file("hw-roundtrip");
        assert_eq!(read(&f), Marks::default(), "an empty lock file (an older build's) has no marks");
        let long = HighWater { seq: u64::MAX, sha256: "ab".repeat(32) };
        write(&f, &long, true).unwrap();
        assert_eq!(read(&f), Marks { written: Some(long.clone()), durable: Some(long.clone()) });
        assert_eq!(f.metadata().unwrap().len(), 2 * BYTES as u64);
        let short = HighWater { seq: 7, sha256: "0f".repeat(32) };
        write(&f, &short, false).unwrap();
        assert_eq!(read(&f), Marks { written: Some(short.clone()), durable: Some(long.clone()) });
        write_durable(&f, &short).unwrap();
        assert_eq!(read(&f), Marks { written: Some(short.clone()), durable: Some(short.clone()) });
        assert_eq!(f.metadata().unwrap().len(), 2 * BYTES as u64);
        // Written alone into a fresh lock file: no durable mark.
        let (_s, f) = scratch_file("hw-written-only");
        write(&f, &short, false).unwrap();
        assert_eq!(read(&f), Marks { written: Some(short.clone()), durable: None });
        assert_eq!(read(&f).newest(), Some(&short));
    }

    #[test]
    fn anything_else_in_the_lock_file_is_no_mark() {
        let (_s, f) = scratch_file("hw-garbage");
        for junk in [
            &b"garbage"[..],
            br#"{"seq":0,"sha256":"0000000000000000000000000000000000000000000000000000000000000000"}"#,
            br#"{"seq":3,"sha256":"short"}"#,
            br#"{"seq":3,"sha256":"ABABABABABABABABABABABABABABABABABABABABABABABABABABABABABABABAB"}"#,
            br#"{"seq":3,"sha256":"abababababababababababababababababababababababababababababababab","x":1}"#,
        ] {
            f.set_len(0).unwrap();
            f.write_all_at(junk, 0).unwrap();
            assert_eq!(read(&f), Marks::default(), "{}", String::from_utf8_lossy(junk));
        }
    }
}
