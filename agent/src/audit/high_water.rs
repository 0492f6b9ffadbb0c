//! The log's high-water mark: the seq and SHA-256 of the newest record written, kept in the
//! log's lock file (`<log>.lock`, which no rotation renames and no set-aside of a log file
//! moves).
//!
//! What it is for: when the newest file holds no complete record — missing, or empty — the
//! next append chains from the newest rotated file (a rotation cut short after its rename)
//! or starts the genesis. The same state is what an operator leaves who sets the newest
//! file aside (a damaged tail, as the append's error says to do), or what a file emptied or
//! deleted leaves; before, the next append then reused the set-aside records' seqs and
//! `verify` said the log was intact. The mark tells the two apart: a cut-short rotation
//! leaves it at the rotated file's last record, while records missing with the file leave
//! it past that, and the next record then says which seqs are missing (`gap`, see the
//! parent module), numbered after them.
//!
//! Guarantees:
//! - It is written under the log's lock, after the record's line (and after the line's
//!   flush and the directory's, when those are made under the lock: a rotation's
//!   continuation, a file's first record, a repair) — so a mark that reached the disk never
//!   names a line of a file whose first record did not: a crash can leave it behind the
//!   log (a record that was never acknowledged), never a missing file's first record ahead.
//! - It is one `pwrite` of [`BYTES`] bytes at offset 0 (no flush of its own): nothing is
//!   read or written on an append but that write, unless the newest file holds no complete
//!   record.
//! - A mark that cannot be read — none yet (an older build's lock file is empty), or not
//!   one this module wrote — is `None`: the append behaves as before the mark existed. It
//!   never makes an append fail; a mark that cannot be written is a warning.
//!
//! What it does not do: tell a cut-off tail of a file that is still there (records lost
//! by a crash before their flush leave the mark past the file's end too), or resist
//! whoever can rewrite the lock file (root: the journald mirror and the platform's heads
//! are the anchors off the host).

use std::fs::File;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

/// The mark's size on disk: its JSON, padded with spaces, and a newline.
pub const BYTES: usize = 128;

/// The newest record written to the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HighWater {
    pub seq: u64,
    /// The SHA-256 of its line as stored (lowercase hex).
    pub sha256: String,
}

/// The mark in `lock`, if there is one this module wrote.
pub fn read(lock: &File) -> Option<HighWater> {
    let mut buf = [0u8; BYTES];
    let n = lock.read_at(&mut buf, 0).ok()?;
    let mark: HighWater = serde_json::from_slice(buf[..n].trim_ascii()).ok()?;
    (mark.seq >= 1 && super::is_hex64(&mark.sha256)).then_some(mark)
}

/// Write `mark` into `lock` (one `pwrite` at offset 0, always [`BYTES`] bytes, so a shorter
/// mark leaves nothing of a longer one behind).
pub fn write(lock: &File, mark: &HighWater) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(mark).map_err(std::io::Error::other)?;
    // `{"seq":` + 20 digits + `,"sha256":"` + 64 + `"}` is 104 bytes: it always fits.
    if bytes.len() >= BYTES {
        return Err(std::io::Error::other("the high-water mark does not fit its slot"));
    }
    bytes.resize(BYTES - 1, b' ');
    bytes.push(b'\n');
    lock.write_all_at(&bytes, 0)
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
    fn a_mark_reads_back_and_a_shorter_one_replaces_a_longer() {
        let (_s, f) = scratch_file("hw-roundtrip");
        assert_eq!(read(&f), None, "an empty lock file (an older build's) has no mark");
        let long = HighWater { seq: u64::MAX, sha256: "ab".repeat(32) };
        write(&f, &long).unwrap();
        assert_eq!(read(&f), Some(long));
        assert_eq!(f.metadata().unwrap().len(), BYTES as u64);
        let short = HighWater { seq: 7, sha256: "0f".repeat(32) };
        write(&f, &short).unwrap();
        assert_eq!(read(&f), Some(short));
        assert_eq!(f.metadata().unwrap().len(), BYTES as u64);
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
            assert_eq!(read(&f), None, "{}", String::from_utf8_lossy(junk));
        }
    }
}
