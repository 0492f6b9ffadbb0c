//! The log's high-water marks: the seq and SHA-256 of the newest record *written*, and of
//! the newest record known *durable*, kept in the log's lock file (`<log>.lock`, which no
//! rotation renames and no set-aside of a log file moves), one 192-byte slot each, each
//! stored with a checksum of itself.
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
//! - Each is one `pwrite` (no flush of its own); reading both is one `pread`, once an
//!   append: ~2 µs each, measured, some 2 % of an append's ~200–250 µs. The durable mark's write holds no lock, so a read
//!   can see the start of one mark and the end of another: each carries a checksum of
//!   itself, and a mixed read is no mark (it lags); so is a durable mark past the written
//!   one.
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
//! - Tell an append about records missing before it reads the log: the next append records
//!   the gap; until then `verify` of the configured log reports it
//!   ([`super::verify::against_marks`]), `verify` of files given by name does not.
//! - Chain a gap from the right file when the newest rotated file (`.1`) is missing too:
//!   the record then starts from the genesis, and `verify` reports it (as `edited`, the
//!   seqs it says are missing overlapping records still there).

use std::fs::File;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

/// One mark's size on disk: its JSON, padded with spaces, and a newline.
pub const BYTES: usize = 192;

/// Where each mark is in the lock file.
const WRITTEN_AT: u64 = 0;
const DURABLE_AT: u64 = BYTES as u64;

/// A record of the log: its seq and the SHA-256 of its line as stored (lowercase hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HighWater {
    pub seq: u64,
    pub sha256: String,
}

/// A mark as stored: with `check`, the FNV-1a hash (64 bits, 16 hex digits) of
/// `SEQ:SHA256` — a checksum against torn reads, not against whoever can write the file.
/// The durable mark is written without the log's lock (by a flush, after the lock was let
/// go) while an append may read it: a read can then return the start of one mark and the
/// end of another — on ext4, at 16-byte boundaries here, and where a copy splits at 8 bytes
/// `{"seq":9` + `0,…` would read as seq 90, a mark past the log. A mixed read fails its
/// check and is no mark.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    seq: u64,
    sha256: String,
    check: String,
}

fn check(seq: u64, sha256: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in format!("{seq}:{sha256}").bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
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

    /// The last of the records the log no longer holds, if the marks say some are missing
    /// after `last` — the seq the log ends at — the one rule the appender (which records the
    /// gap) and `verify` (which reports it first) share: while the newest file holds
    /// records (`newest_file_holds_records`), a durable mark past `last` (a crash can leave
    /// the written one past lines never flushed); while it holds none, either mark past
    /// `last` (a rotation cut short leaves the written mark at `.1`'s last record). The
    /// range runs to the newer mark.
    pub fn missing_after(&self, last: u64, newest_file_holds_records: bool) -> Option<&HighWater> {
        let missing = match newest_file_holds_records {
            true => self.durable.as_ref().is_some_and(|d| d.seq > last),
            false => self.newest().is_some_and(|m| m.seq > last),
        };
        self.newest().filter(|_| missing)
    }
}

/// The marks in `lock` (one `pread`), each `None` unless this module wrote it whole — and
/// the durable one `None` too when it is past the written one (the written mark is always
/// written before its record's durable one, under the lock: a durable mark past it is not
/// one this log's appends left).
pub fn read(lock: &File) -> Marks {
    let mut buf = [0u8; 2 * BYTES];
    let n = lock.read_at(&mut buf, 0).unwrap_or(0);
    let slot = |at: usize| -> Option<HighWater> {
        let bytes = buf.get(at..(at + BYTES).min(n))?;
        let s: Stored = serde_json::from_slice(bytes.trim_ascii()).ok()?;
        (s.seq >= 1 && super::is_hex64(&s.sha256) && s.check == check(s.seq, &s.sha256))
            .then_some(HighWater { seq: s.seq, sha256: s.sha256 })
    };
    let written = slot(WRITTEN_AT as usize);
    let durable = slot(DURABLE_AT as usize).filter(|d| written.as_ref().is_some_and(|w| d.seq <= w.seq));
    Marks { written, durable }
}

/// One mark's bytes: always [`BYTES`], so a shorter mark leaves nothing of a longer one.
fn slot(mark: &HighWater) -> std::io::Result<Vec<u8>> {
    let stored = Stored { seq: mark.seq, sha256: mark.sha256.clone(), check: check(mark.seq, &mark.sha256) };
    let mut bytes = serde_json::to_vec(&stored).map_err(std::io::Error::other)?;
    // `{"seq":` + 20 digits + `,"sha256":"` + 64 + `","check":"` + 16 + `"}` is 131 bytes:
    // it always fits.
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
        let shorter = HighWater { seq: 6, sha256: "0e".repeat(32) };
        write(&f, &short, true).unwrap();
        write(&f, &shorter, false).unwrap();
        assert_eq!(read(&f), Marks { written: Some(shorter.clone()), durable: None }, "durable past written: none");
        write(&f, &short, false).unwrap();
        assert_eq!(read(&f), Marks { written: Some(short.clone()), durable: Some(short.clone()) });
        write_durable(&f, &shorter).unwrap();
        assert_eq!(read(&f), Marks { written: Some(short.clone()), durable: Some(shorter.clone()) });
        assert_eq!(read(&f).newest(), Some(&short));
        assert_eq!(f.metadata().unwrap().len(), 2 * BYTES as u64);
        // Written alone into a fresh lock file: no durable mark.
        let (_s, f) = scratch_file("hw-written-only");
        write(&f, &short, false).unwrap();
        assert_eq!(read(&f), Marks { written: Some(short.clone()), durable: None });
    }

    /// A read that sees the start of one durable mark and the end of the next (the durable
    /// mark is written without the log's lock) is no mark, wherever the two meet — at 8
    /// bytes, `{"seq":9` + `0,…` would otherwise read as seq 90.
    #[test]
    fn a_mixed_read_of_two_marks_is_no_mark() {
        let (_s, f) = scratch_file("hw-mixed");
        let nine = slot(&HighWater { seq: 9, sha256: "ab".repeat(32) }).unwrap();
        let ten = slot(&HighWater { seq: 10, sha256: "cd".repeat(32) }).unwrap();
        let (w99, w100) = (
            slot(&HighWater { seq: 99, sha256: "ab".repeat(32) }).unwrap(),
            slot(&HighWater { seq: 100, sha256: "ab".repeat(32) }).unwrap(),
        );
        let written = slot(&HighWater { seq: 1000, sha256: "ef".repeat(32) }).unwrap();
        for (old, new) in [(&nine, &ten), (&w99, &w100)] {
            for cut in 1..BYTES {
                let mixed = [&old[..cut], &new[cut..]].concat();
                f.write_all_at(&[&written[..], &mixed[..]].concat(), 0).unwrap();
                if mixed != *old && mixed != *new {
                    assert_eq!(read(&f).durable, None, "cut {cut}: {}", String::from_utf8_lossy(&mixed));
                }
            }
        }
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
