//! The audit trail (DESIGN.md §6): every security-relevant decision — executor start, end and
//! failure, limit clamps and kills, secret grants and refusals, permission refusals, session
//! calls, and (with the daemon) command verdicts and security events — is a record.
//!
//! Each record goes to three places: a `tracing` event with target `opservant::audit` (the CLI
//! prints those on stderr), the hash-chained log file below once [`init`] has been called, and
//! journald (native protocol, best effort) when `/run/systemd/journal/socket` exists.
//!
//! # The log file
//!
//! `audit.path` (default [`DEFAULT_PATH`]; directory created 0700, file 0600): one JSON object
//! a line, keys in this order (`fields`: the event's string values, keys sorted, each cut at
//! [`MAX_FIELD_BYTES`]; `host` the hostname, `pid` the writing process):
//!
//! ```text
//! {"seq":42,"ts":"2026-11-22T13:45:01.123456Z","host":"web-1","pid":4242,"event":"executor_start",
//!  "fields":{"executor":"port-scanner",…},["continues":{"file":"audit.jsonl.1","seq":41},]
//!  ["gap":{"from":42,"to":57,"sha256":"…"},]["repaired":{"bytes":37,"sha256":"…"},]"prev":"<64 hex>"}
//! ```
//!
//! Chain rules, which `opservant audit verify` ([`verify`]) checks:
//!
//! - `prev` is the lowercase hex SHA-256 of the bytes of the previous record's line exactly
//!   as stored, without its terminating `\n`. Hashing the stored bytes (not a re-serialisation)
//!   makes any byte changed, added or removed in a record visible in the next one.
//! - `seq` goes up by exactly 1 from record to record, across rotated files too: a gap is a
//!   removal, a step back a reordering.
//! - The genesis — the first record ever — has `seq` 1 and `prev` = 64 zeros.
//! - Rotation (`audit.max_bytes`, `audit.keep` files `audit.jsonl.1` … `.N`, `.1` the newest):
//!   the first record of the new file chains to the last record of the file just rotated, and
//!   says so in `continues` (that file's name at rotation time and the seq it follows). A
//!   file's first record is therefore either the genesis or a continuation; anything else
//!   means records before it were removed. Verifying one rotated file alone reports the
//!   continuation as a note, not an error. The continuation also says where the history kept
//!   after the rotation begins (`continues.oldest`, the first seq of the oldest rotated file —
//!   of its first record as `verify` counts them, so after a torn first line the repair's):
//!   verifying the whole log (`verify_all`), an oldest file that begins later — a rotated file
//!   removed other than by a rotation — is a removal. When that seq cannot be read the append
//!   fails (the rotation stays cut short) rather than write the continuation without it. A rotation renames every file one
//!   number up and drops the ones past `keep` only once that continuation is durable, so a
//!   rotation cut short anywhere leaves a log that verifies intact.
//! - A torn line (a writer died mid-`write`; the record was never acknowledged, so a gated
//!   action did not proceed) is left in place. The next writer terminates it with `\n` and
//!   appends a record whose `prev` is the hash of the last *complete* record, whose `seq`
//!   follows that record's, and which carries `"repaired":{"bytes":N,"sha256":H}` — the
//!   length and hash of the torn line. The verifier accepts a non-record line only when the
//!   line right after it is such a repair naming exactly its bytes, and always reports the
//!   repair as a note. Repair cannot hide a deletion: the repair record must chain to the
//!   record before the torn line with the next seq, so turning a complete record into a
//!   "torn" one means rewriting the record after it, which breaks the `prev` of the record
//!   after that — only the very last record could be hidden this way, and the tail of a
//!   file can be cut off in any case (below). A tail the writer cannot interpret (its last two
//!   lines are not records) is never guessed at: appends fail, and so do gated actions, until
//!   an operator moves the damaged file aside (the next append then continues from the
//!   newest rotated file, or from the genesis, and says which records went with the file:
//!   below).
//! - A gap the log records itself ([`high_water`]: marks in the lock file of the newest record
//!   written and the newest durable): when the newest file holds no complete record (missing
//!   or empty) but records past the head were written, they went with the file — set aside,
//!   removed or emptied; when it does hold records but one past its last was durable, they
//!   were cut off its end, or the log was put back to an older copy. The next record says
//!   so, `"gap":{"from","to","sha256"}` (the seqs missing, and the hash of the last of them
//!   as written), and its seq is `to + 1`: no seq the marks name is reused, so a copy of the
//!   set-aside file, journald's mirror and the platform's heads agree with the log on those
//!   seqs (the marks are not flushed: after a power loss they may lag, [`high_water`]).
//!   `verify` reports every gap as `removed` (the log is not intact) and checks the chain on
//!   past it. Before the twenty-fifth session the next append reused the missing records'
//!   seqs, and `verify` said the log was intact. With `.1` gone too, the record chains to
//!   the newest rotated file left, and the gap runs from past it (before the twenty-sixth
//!   session it started from the genesis, claiming seqs older files still held). A log set
//!   aside whole starts a new genesis only with its lock file set aside too.
//!
//! What the chain does not show by itself: records cut off the *end* of the newest file (the
//! durable mark shows them, in the next record: above — unless the lock file was rewritten
//! too), or a wholesale rewrite with recomputed hashes by someone holding root. The journald mirror
//! carries each record's seq and SHA-256 (`OPSERVANT_AUDIT_SEQ`, `OPSERVANT_AUDIT_SHA256`)
//! as an independent anchor, and `verify` prints the chain head to compare with it. Once a
//! record was appended after a cut, the head matches journald's newest again: the cut then
//! shows only as journald holding a different SHA-256 for the same seq (compare them per
//! seq; `verify` does not read the journal).
//!
//! # Concurrency and durability
//!
//! Several processes append to one log (concurrent `opservant run`s, session daemons, the
//! agent): each append takes an exclusive `flock` on `<path>.lock` (a separate file, so a
//! rotation's renames never move the lock), reads the last line(s) to chain from, rotates if
//! needed, appends the line with one `write`, and unlocks; the `fdatasync` that makes the line
//! durable follows before the append returns (shared by concurrent writers of one process:
//! group commit, below). Only the tail is read,
//! so an append costs the same at any log size. The `fdatasync` makes an acknowledged record
//! durable before the action it audits proceeds, and it dominates an append's cost. Measured
//! on the development VM (ext4 on a virtio disk, 2000 appends of a 250-byte record): a bare
//! `fdatasync` 140–170 µs; a whole append 230 µs with it against 68 µs without it (debug
//! build). The lock serialises appends, so concurrent writers share that rate (≈ 4000
//! records/s on this disk); on a spinning disk or a loaded host an `fdatasync` takes
//! milliseconds — a few per run, which stays small beside a sandbox start.
//!
//! **Group commit.** Within one process (the agent's concurrent runs) the `fdatasync` is not
//! made under the lock: a writer appends its line, takes a ticket and unlocks, then waits
//! until a flush that began after its write has ended. One writer at a time flushes the file
//! of the newest ticket, and every ticket up to that one is then durable: a line is only
//! appended after the lines before it, so flushing the file flushes them too, whoever wrote
//! them; and no unflushed line of the process is ever left in an older file (a rotation
//! flushes the file before renaming it away, and a writer whose line lands in another file
//! than the process's unflushed ones — a rotation by an older agent — flushes those first).
//! Concurrent writers so share `fdatasync`s, and the lock is held for a write, not a flush
//! (a writer whose line lands in the file being flushed does not wait for that flush).
//! Every flush of the process's unflushed lines goes through the descriptor of the file it
//! opened first for one of them, before any of them was written: Linux reports a write-back
//! error once per open file, and not at all through a descriptor opened after another one
//! (another process's) has reported it — flushing through the newest line's descriptor
//! could succeed while an older line's page was lost.
//! A rotation, a repair and a file's first record are still flushed under the lock (the
//! renames, the removal of files past `keep` and the next records rely on it), and the
//! process's other unflushed lines then through their own first descriptor. A flush that
//! fails — grouped or under the lock — fails every line not durable yet (their actions do
//! not proceed), and from then on the process flushes each line under the lock by itself:
//! no later flush is trusted to cover a line the failed one covered.
//! A write that fails is cut back under the lock, as above; a line whose *flush* failed
//! stays in the file (later lines may chain to it already), and its action did not proceed.
//!
//! The wait for the lock is bounded (`audit.lock_wait_seconds`, default 30; [`lock`]): a
//! writer that holds it and stops — suspended, frozen, stuck on a dead disk — makes appends
//! fail after that long, with an error naming the holder from `/proc/locks`, instead of
//! silently stalling every gated action of the agent.
//!
//! **Records before a gate.** An `execute` command's receipt (`command_received`) and its
//! permission verdict (`permission_granted`) are appended without waiting for their own
//! flush ([`record_before_gate`]), and held by the thread that handles the command. The
//! next record that thread makes with a flush flushes every earlier line of the process,
//! theirs included; the run's gate, `executor_start` ([`try_record`]), then checks that
//! they are durable: a gate whose check fails fails (the executor does not run), whichever
//! flush covered them and however (grouped, under the lock after a rotation, or not at all
//! after an earlier failure). Records made in between ([`record`]: a limit clamped, a
//! zygote fallback) do not check, so the gate always does. The command calls [`settle`]
//! before its reply, which flushes them if still needed and checks them once more.
//! Nothing of the executor runs, and no reply goes out, before the flush that covers them
//! has ended — what their own flush ensured, two `fdatasync`s fewer per executed command
//! (a failed flush fails the gate; before a reply it is logged as an error, as a failed
//! `record` always was). Their journald mirror is sent only once they are durable, so a
//! crash cannot leave journald anchoring a seq the file lost. (The sandbox a run starts
//! before its gate runs nothing of the executor until the gate has passed. Other commands
//! — installs, removals, pings — flush every record as it is made.)
//!
//! # Failing closed
//!
//! [`try_record`] returns the error when the record could not be appended; the gates use it —
//! `executor_start` and `script_start` (the run stops before any executor or script code
//! runs, exit status 2), `session_start`, `session_exec` (a session call is refused before
//! its code is sent), and `secret_access` (the secret is refused when its
//! grant cannot be audited). [`record`] keeps its signature for the events that report what
//! already happened (completion, refusals, limits): a failure there is logged as an error on
//! stderr and the event still appears as the `tracing` line. [`init`] itself fails when the
//! log cannot be created or locked, so a command configured for a log it cannot write stops
//! before it starts anything.

pub mod cli;
mod high_water;
pub mod lock;
mod outage;
pub mod verify;

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::Digest;
use thiserror::Error;

use crate::config::Config;

pub const DEFAULT_PATH: &str = "/var/log/opservant/audit.jsonl";
pub const DEFAULT_MAX_BYTES: u64 = 16 << 20;
pub const DEFAULT_KEEP: u32 = 8;
/// Smallest `audit.max_bytes` accepted (a record is a few hundred bytes).
pub const MIN_MAX_BYTES: u64 = 1024;
/// Largest `audit.max_bytes` accepted (1 GiB): `audit verify` reads one file at a time whole.
pub const MAX_MAX_BYTES: u64 = 1 << 30;
pub const MAX_KEEP: u32 = 1000;

/// The highest `N` of a rotated file `path.N`: rotations keep the numbers within `keep` and
/// the gaps rotations cut short left; a file numbered higher is not the log's.
pub const MAX_ROTATED_NUMBER: u32 = 2 * MAX_KEEP;
/// How long an append waits for the log's lock by default (`audit.lock_wait_seconds`): far
/// beyond any append (a few ms, a slow disk's `fdatasync` included), short enough that a
/// stuck holder shows as failing runs rather than a silent stall.
pub const DEFAULT_LOCK_WAIT_SECONDS: u64 = 30;
pub const MAX_LOCK_WAIT_SECONDS: u64 = 3600;
/// `prev` of the genesis record.
pub const GENESIS_PREV: &str = "0000000000000000000000000000000000000000000000000000000000000000";
/// A field value longer than this is cut (on a character boundary) and marked, so a sandboxed
/// executor cannot bloat the log through, say, the name of a secret it asks for.
pub const MAX_FIELD_BYTES: usize = 4096;
/// The most read to find the first record of a rotated file (records are far smaller).
const MAX_RECORD_BYTES: u64 = 1 << 20;
const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

#[derive(Debug, Error)]
#[error("audit log {path}: {message}")]
pub struct AuditError {
    pub path: String,
    pub message: String,
}

impl AuditError {
    fn new(path: &Path, message: impl std::fmt::Display) -> AuditError {
        AuditError { path: path.display().to_string(), message: message.to_string() }
    }
}

/// The `audit:` section of the agent configuration, validated when the file is parsed.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, try_from = "AuditSectionRaw")]
pub struct AuditSection {
    /// The log file (default [`DEFAULT_PATH`]); absolute.
    pub path: Option<PathBuf>,
    /// Rotate before a file would grow past this many bytes (default 16 MiB, at least 1024).
    pub max_bytes: Option<u64>,
    /// Rotated files kept: `path.1` (newest) … `path.N` (default 8, 1–1000).
    pub keep: Option<u32>,
    /// Mirror records to journald when its socket exists (default true).
    pub journald: Option<bool>,
    /// Longest wait for the log's lock, held by another writer, before an append fails
    /// (default 30, 1–3600).
    pub lock_wait_seconds: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditSectionRaw {
    path: Option<PathBuf>,
    max_bytes: Option<u64>,
    keep: Option<u32>,
    journald: Option<bool>,
    lock_wait_seconds: Option<u64>,
}

impl TryFrom<AuditSectionRaw> for AuditSection {
    type Error = String;
    fn try_from(r: AuditSectionRaw) -> Result<Self, String> {
        if let Some(p) = &r.path {
            if !p.is_absolute() || p.file_name().is_none() {
                return Err(format!("audit.path: '{}' must be an absolute file path", p.display()));
            }
        }
        if r.max_bytes.is_some_and(|m| !(MIN_MAX_BYTES..=MAX_MAX_BYTES).contains(&m)) {
            return Err(format!("audit.max_bytes: {MIN_MAX_BYTES} to {MAX_MAX_BYTES}"));
        }
        if r.keep.is_some_and(|k| k == 0 || k > MAX_KEEP) {
            return Err(format!("audit.keep: 1 to {MAX_KEEP} (rotation needs somewhere to carry the chain)"));
        }
        if r.lock_wait_seconds.is_some_and(|s| s == 0 || s > MAX_LOCK_WAIT_SECONDS) {
            return Err(format!("audit.lock_wait_seconds: 1 to {MAX_LOCK_WAIT_SECONDS}"));
        }
        Ok(AuditSection {
            path: r.path,
            max_bytes: r.max_bytes,
            keep: r.keep,
            journald: r.journald,
            lock_wait_seconds: r.lock_wait_seconds,
        })
    }
}

/// Where and how the log is written.
#[derive(Debug, Clone)]
pub struct AuditSettings {
    pub path: PathBuf,
    pub max_bytes: u64,
    pub keep: u32,
    pub journald: bool,
    /// Longest wait for the lock (see [`lock`]).
    pub lock_wait: Duration,
    /// The journald socket (a test may point it elsewhere).
    pub journal_socket: PathBuf,
}

impl AuditSettings {
    pub fn from_config(config: &Config) -> AuditSettings {
        let a = &config.audit;
        AuditSettings {
            path: a.path.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_PATH)),
            max_bytes: a.max_bytes.unwrap_or(DEFAULT_MAX_BYTES),
            keep: a.keep.unwrap_or(DEFAULT_KEEP),
            journald: a.journald.unwrap_or(true),
            lock_wait: Duration::from_secs(a.lock_wait_seconds.unwrap_or(DEFAULT_LOCK_WAIT_SECONDS)),
            journal_socket: PathBuf::from(JOURNAL_SOCKET),
        }
    }

    /// A log at `path` with the default rotation and no journald mirror.
    pub fn at(path: &Path) -> AuditSettings {
        AuditSettings {
            path: path.to_path_buf(),
            max_bytes: DEFAULT_MAX_BYTES,
            keep: DEFAULT_KEEP,
            journald: false,
            lock_wait: Duration::from_secs(DEFAULT_LOCK_WAIT_SECONDS),
            journal_socket: PathBuf::from(JOURNAL_SOCKET),
        }
    }

    /// `path.N`.
    pub fn rotated(&self, n: u32) -> PathBuf {
        rotated_path(&self.path, n)
    }

    fn lock_path(&self) -> PathBuf {
        lock_path(&self.path)
    }
}

/// `path.lock`, the file appenders `flock` (a separate file: rotation never renames it).
pub fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    path.with_file_name(name)
}

/// `path.N`, the N-th newest rotated file.
pub fn rotated_path(path: &Path, n: u32) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{n}"));
    path.with_file_name(name)
}

/// A record appended without waiting for its flush ([`AuditLog::append_deferred`]), until
/// [`AuditLog::settle`] checks that it is durable.
#[derive(Debug)]
pub struct Deferred {
    /// Its flush's ticket; `None` when it was flushed under the log's lock already.
    ticket: Option<u64>,
    /// Its journald message, sent once it is durable.
    journal: Option<Vec<u8>>,
    /// Its gap, if any (`from`, `to`, its seq): reported once it is durable.
    gap: Option<(u64, u64, u64)>,
}

/// What one append wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    pub seq: u64,
    /// SHA-256 of the line written (the next record's `prev`).
    pub sha256: String,
    /// The line (without `\n`).
    pub line: String,
    /// This append rotated the log first.
    pub rotated: bool,
    /// This append repaired a torn last line.
    pub repaired: bool,
    /// The seqs this record says are missing before it (`gap`), if any.
    pub gap: Option<(u64, u64)>,
}

/// A record as parsed back from a line: what chaining and verification need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub prev: String,
    pub event: String,
    pub ts: String,
    pub continues: Option<(String, u64)>,
    /// `continues.oldest`: the first seq of the oldest file the rotation kept (absent in
    /// records written before it was recorded).
    pub oldest_kept: Option<u64>,
    pub repaired: Option<(u64, String)>,
    /// `gap`: the records this one follows are missing from the log (see [`Gap`]).
    pub gap: Option<Gap>,
}

/// Records missing from the log, as the record after them says (`"gap":{"from","to",
/// "sha256"}`): when it was appended, the log's high-water marks ([`high_water`]) said
/// records up to `to` had been written, but the log no longer held them — its newest file set
/// aside, removed, emptied or cut short, or the log put back to an older copy. The record's
/// seq is `to + 1`; `from` follows the last
/// record still in the log (1 when none is); `sha256` is the hash of record `to` as it was
/// written, to find it by in a copy (the set-aside file, journald's mirror).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    pub from: u64,
    pub to: u64,
    pub sha256: String,
}

/// Parse one stored line (without its `\n`); `Err` says why it is not a record.
pub fn parse_record(line: &[u8]) -> Result<Record, String> {
    let v: Value = serde_json::from_slice(line).map_err(|e| format!("not JSON ({e})"))?;
    let o = v.as_object().ok_or("not a JSON object")?;
    let seq = o.get("seq").and_then(Value::as_u64).filter(|s| *s >= 1).ok_or("no positive integer 'seq'")?;
    let prev = o.get("prev").and_then(Value::as_str).filter(|p| is_hex64(p)).ok_or("no 64-hex-digit 'prev'")?;
    let event = o.get("event").and_then(Value::as_str).ok_or("no string 'event'")?;
    let ts = o.get("ts").and_then(Value::as_str).ok_or("no string 'ts'")?;
    if !o.get("fields").is_some_and(Value::is_object) {
        return Err("no object 'fields'".into());
    }
    let continues = match o.get("continues") {
        None => None,
        Some(c) => Some(match (c.get("file").and_then(Value::as_str), c.get("seq").and_then(Value::as_u64)) {
            (Some(f), Some(s)) => (f.to_string(), s),
            _ => return Err("'continues' is not {file, seq}".into()),
        }),
    };
    let oldest_kept = match o.get("continues").and_then(|c| c.get("oldest")) {
        None => None,
        Some(v) => Some(v.as_u64().filter(|n| *n >= 1).ok_or("'continues.oldest' is not a positive integer")?),
    };
    let repaired = match o.get("repaired") {
        None => None,
        Some(r) => Some(match (r.get("bytes").and_then(Value::as_u64), r.get("sha256").and_then(Value::as_str)) {
            (Some(b), Some(h)) if is_hex64(h) => (b, h.to_string()),
            _ => return Err("'repaired' is not {bytes, sha256}".into()),
        }),
    };
    let gap = match o.get("gap") {
        None => None,
        Some(g) => Some(
            match (
                g.get("from").and_then(Value::as_u64),
                g.get("to").and_then(Value::as_u64),
                g.get("sha256").and_then(Value::as_str),
            ) {
                (Some(from), Some(to), Some(h)) if from >= 1 && from <= to && is_hex64(h) => {
                    Gap { from, to, sha256: h.to_string() }
                }
                _ => return Err("'gap' is not {from, to, sha256} with 1 <= from <= to".into()),
            },
        ),
    };
    Ok(Record {
        seq,
        prev: prev.to_string(),
        event: event.to_string(),
        ts: ts.to_string(),
        continues,
        oldest_kept,
        repaired,
        gap,
    })
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(data: &[u8]) -> String {
    hex(&sha2::Sha256::digest(data))
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(2 * bytes.len());
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// `2026-11-22T13:45:01.123456Z` (UTC, microseconds).
pub fn timestamp(t: SystemTime) -> String {
    crate::rfc3339::format_micros(t)
}

/// `v` as recorded within `max` bytes: whole when it fits, else its first `max` bytes (at a
/// character boundary) and how many were cut.
pub fn cut(v: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if v.len() <= max {
        return std::borrow::Cow::Borrowed(v);
    }
    let mut end = max;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    std::borrow::Cow::Owned(format!("{}…[{} bytes cut]", &v[..end], v.len() - end))
}

/// `fields` as the JSON object stored, each value cut to [`MAX_FIELD_BYTES`].
pub fn fields_object(fields: &[(&str, &str)]) -> Map<String, Value> {
    fields.iter().map(|(k, v)| (k.to_string(), Value::String(cut(v, MAX_FIELD_BYTES).into_owned()))).collect()
}

/// `event k=v k2="v 2"`: the human form (tail, journald's MESSAGE).
pub fn summary(event: &str, fields: &Map<String, Value>) -> String {
    let mut s = event.to_string();
    for (k, v) in fields {
        let v = match v {
            Value::String(t) => t.clone(),
            other => other.to_string(),
        };
        if v.is_empty() || v.chars().any(|c| c.is_whitespace() || c == '"' || c.is_control()) {
            s.push_str(&format!(" {k}={v:?}"));
        } else {
            s.push_str(&format!(" {k}={v}"));
        }
    }
    s
}

/// The last lines of a file, as an appender sees them.
#[derive(Debug, Default, PartialEq, Eq)]
struct Tail {
    /// Up to the last two lines (oldest first), without their `\n`.
    lines: Vec<Vec<u8>>,
    /// The file is empty or ends with `\n`.
    terminated: bool,
}

/// Read only as much of the end of `f` (of length `len`) as holds its last two lines.
fn read_tail(f: &File, len: u64) -> std::io::Result<Tail> {
    let mut size: u64 = 8192;
    loop {
        let start = len.saturating_sub(size);
        let mut buf = vec![0u8; (len - start) as usize];
        f.read_exact_at(&mut buf, start)?;
        let terminated = buf.last().is_none_or(|b| *b == b'\n');
        if buf.is_empty() {
            return Ok(Tail { lines: vec![], terminated });
        }
        let body = if terminated { &buf[..buf.len() - 1] } else { &buf[..] };
        let pieces: Vec<&[u8]> = body.split(|b| *b == b'\n').collect();
        // Unless the read reaches the start of the file its first piece may be cut.
        if start == 0 || pieces.len() >= 3 {
            let from = pieces.len().saturating_sub(2);
            return Ok(Tail { lines: pieces[from..].iter().map(|p| p.to_vec()).collect(), terminated });
        }
        size = size.saturating_mul(4);
    }
}

/// Where the next record chains from.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Head {
    /// The last complete record's line, or `None` for the genesis.
    line: Option<Vec<u8>>,
    seq: u64,
    /// Set when the head is the last record of the rotated file `(name, seq)`.
    continues: Option<(String, u64)>,
    /// With `continues`, after a rotation: the first seq of the oldest rotated file kept.
    oldest_kept: Option<u64>,
    /// Records written after this head that the log no longer holds.
    gap: Option<Gap>,
}

impl Head {
    fn genesis() -> Head {
        Head { line: None, seq: 0, continues: None, oldest_kept: None, gap: None }
    }
    /// The seq the next record follows: the head's, or past the records missing after it.
    fn follows(&self) -> u64 {
        self.gap.as_ref().map_or(self.seq, |g| g.to)
    }
    fn prev(&self) -> String {
        self.line.as_deref().map(sha256_hex).unwrap_or_else(|| GENESIS_PREV.to_string())
    }
}

/// What the current file's tail means for the next append: the head to chain from (`None`:
/// the file holds no complete record, so chain from the newest rotated file or the genesis)
/// and the torn line to repair, if any.
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    head: Option<(Vec<u8>, u64)>,
    torn: Option<Vec<u8>>,
    /// The torn line still lacks its `\n`.
    unterminated: bool,
}

fn plan(tail: &Tail) -> Result<Plan, String> {
    let Some(last) = tail.lines.last() else {
        return Ok(Plan { head: None, torn: None, unterminated: false });
    };
    if tail.terminated {
        if let Ok(r) = parse_record(last) {
            return Ok(Plan { head: Some((last.clone(), r.seq)), torn: None, unterminated: false });
        }
    }
    // The last line is torn (no `\n`) or not a record: repair it, chaining from the line
    // before, which must be a record.
    let before = tail.lines.len().checked_sub(2).map(|i| &tail.lines[i]);
    let head = match before {
        None => None,
        Some(b) => match parse_record(b) {
            Ok(r) => Some((b.clone(), r.seq)),
            Err(e) => {
                return Err(format!(
                    "its last two lines are not audit records ({e}); run `opservant audit verify` and move \
                     the damaged file aside"
                ))
            }
        },
    };
    Ok(Plan { head, torn: Some(last.clone()), unterminated: !tail.terminated })
}

/// Build one record line (without `\n`); `seq` is the head's plus one.
#[allow(clippy::too_many_arguments)]
fn format_line(
    head: &Head,
    seq: u64,
    ts: &str,
    host: &str,
    pid: u32,
    event: &str,
    fields: &Map<String, Value>,
    repaired: Option<&[u8]>,
) -> String {
    let js = |s: &str| Value::String(s.to_string()).to_string();
    let mut line = format!(
        "{{\"seq\":{seq},\"ts\":{},\"host\":{},\"pid\":{pid},\"event\":{},\"fields\":{}",
        js(ts),
        js(host),
        js(event),
        Value::Object(fields.clone())
    );
    if let Some((file, cseq)) = &head.continues {
        let oldest = head.oldest_kept.map(|n| format!(",\"oldest\":{n}")).unwrap_or_default();
        line.push_str(&format!(",\"continues\":{{\"file\":{},\"seq\":{cseq}{oldest}}}", js(file)));
    }
    if let Some(g) = &head.gap {
        line.push_str(&format!(",\"gap\":{{\"from\":{},\"to\":{},\"sha256\":\"{}\"}}", g.from, g.to, g.sha256));
    }
    if let Some(torn) = repaired {
        line.push_str(&format!(",\"repaired\":{{\"bytes\":{},\"sha256\":\"{}\"}}", torn.len(), sha256_hex(torn)));
    }
    line.push_str(&format!(",\"prev\":\"{}\"}}", head.prev()));
    line
}

/// An append-only, hash-chained audit log file shared by every process that writes to it.
#[derive(Debug)]
pub struct AuditLog {
    settings: AuditSettings,
    host: String,
    journal: Option<UnixDatagram>,
    /// This process's unflushed lines (see "Group commit" in the module documentation).
    flush: GroupCommit,
    /// This process's runs of failed appends, and their `audit_resumed` records.
    outages: outage::Outages,
}

/// Group commit of one process's appends: tickets for written, unflushed lines, one flusher
/// at a time, and the highest ticket known durable.
#[derive(Debug, Default)]
struct GroupCommit {
    state: Mutex<FlushState>,
    flushed: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct FlushState {
    /// The last ticket issued, with the file its line was written to.
    newest: Option<(u64, Unflushed)>,
    /// The last ticket's record, to mark durable ([`high_water`]) once its flush succeeded.
    newest_mark: Option<high_water::HighWater>,
    /// The log's lock file as the last ticket's append opened it, where durable marks go.
    marks_file: Option<Arc<File>>,
    /// Every ticket up to this one is durable.
    durable: u64,
    /// A flush failed (the error): every ticket not durable by then fails, `durable` never
    /// moves again, and this process flushes every later line under the log's lock, by
    /// itself ([`GroupCommit::grouping`]) — no later flush is trusted to cover a line the
    /// failed one covered (Linux reports a write-back error once per open file).
    failed: Option<String>,
    /// A writer is flushing now (the others wait for it).
    flushing: bool,
    /// The file of the unflushed lines as this process first opened it for one of them —
    /// before any of them was written — and every flush goes through it. Linux reports a
    /// write-back error through each descriptor that was open when it happened, once, but
    /// not through one opened after another descriptor (another process's, a rotating
    /// writer's) has reported it: a flush through the newest line's descriptor could then
    /// succeed while an older line's page was lost.
    flush_via: Option<Unflushed>,
}

/// A file holding unflushed lines, and which file it is.
#[derive(Debug, Clone)]
struct Unflushed {
    file: Arc<File>,
    id: (u64, u64),
}

/// `(st_dev, st_ino)`: which file `f` is, whatever its name now.
fn file_id(f: &File) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    f.metadata().map(|m| (m.dev(), m.ino()))
}

impl FlushState {
    /// Every ticket up to `upto` is durable, and so `mark`'s record (`upto`'s), which the
    /// lock file's durable mark then names ([`high_water`]) — unless a later ticket was
    /// already durable (a mark never goes back by this process's doing).
    fn made_durable(&mut self, upto: u64, mark: Option<high_water::HighWater>) {
        if upto <= self.durable {
            return;
        }
        self.durable = upto;
        if let (Some(f), Some(m)) = (&self.marks_file, mark) {
            if let Err(e) = high_water::write_durable(f, &m) {
                warn_mark_unwritten(&e);
            }
        }
    }
}

/// A high-water mark could not be written: the log goes on (the mark is an aid, never a
/// gate), said once per failure.
fn warn_mark_unwritten(e: &std::io::Error) {
    tracing::warn!(error = %e, "audit: cannot write the log's high-water mark in its lock file; records lost with the newest file before the next append could go unrecorded");
}

impl GroupCommit {
    /// A ticket for a line just written to `file`, not yet flushed. Called under the log's
    /// lock, right after the write, so tickets follow the order of the lines in the log. When
    /// the line is in another file than this process's unflushed ones (the log was rotated
    /// meanwhile — by a writer that flushed the old file first, or by an older agent that
    /// did not), those are flushed here, so that no unflushed line is ever left behind in an
    /// older file.
    fn issue(&self, file: File, mark: high_water::HighWater, lock: &File) -> Result<u64, String> {
        let id = file_id(&file).map_err(|e| format!("fstat: {e}"))?;
        // The lock file, for the durable mark (a second descriptor of the description the
        // lock is held on: the lock's guard unlocks it explicitly, this one keeps no lock).
        let marks_file = lock.try_clone().map(Arc::new).inspect_err(warn_mark_unwritten).ok();
        // A flush under way of the same file does not hold this writer (nor the log's lock
        // it holds): the flush covers the tickets issued before it began, this one gets the
        // next.
        let mut st = self.settle_other_file(id, false);
        let ticket = st.newest.as_ref().map_or(st.durable, |(t, _)| *t) + 1;
        let file = Unflushed { file: Arc::new(file), id };
        if st.flush_via.as_ref().is_none_or(|via| via.id != id) {
            st.flush_via = Some(file.clone());
        }
        st.newest = Some((ticket, file));
        st.newest_mark = Some(mark);
        st.marks_file = marks_file;
        Ok(ticket)
    }

    /// Every line this process wrote so far is durable once `file` (the current file) was
    /// flushed by the writer calling, under the log's lock — and the unflushed lines of
    /// others too, through the descriptor that was open before them ([`FlushState::flush_via`]:
    /// the caller's own descriptor may have been opened after their write-back error was
    /// reported elsewhere), and those of another file, if any.
    fn all_durable(&self, file: &File) {
        let Ok(id) = file_id(file) else { return };
        let mut st = self.settle_other_file(id, true);
        let Some(upto) = st.newest.as_ref().map(|(t, _)| *t).filter(|t| *t > st.durable) else { return };
        if st.failed.is_some() {
            return;
        }
        match st.flush_via.as_ref().filter(|via| via.id == id).map(|via| via.file.sync_data()) {
            Some(Ok(())) => {
                let mark = st.newest_mark.clone();
                st.made_durable(upto, mark)
            }
            Some(Err(e)) => st.failed = Some(format!("fdatasync: {e}")),
            // The unflushed lines were settled with their own file above.
            None => {}
        }
    }

    /// A flush under the log's lock failed (`error`): no later flush is trusted either, as
    /// after a group flush that failed ([`FlushState::failed`]).
    fn fail(&self, error: &str) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.failed.get_or_insert_with(|| error.to_string());
        self.flushed.notify_all();
    }

    /// The state, once this process's unflushed lines are flushed if they are in another
    /// file than `id` (after a flush under way has ended: its outcome decides first; with
    /// `always_wait`, a flush under way is waited for in any case).
    fn settle_other_file(&self, id: (u64, u64), always_wait: bool) -> std::sync::MutexGuard<'_, FlushState> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let other_file = |st: &FlushState| st.newest.as_ref().is_some_and(|(t, f)| *t > st.durable && f.id != id);
        while st.flushing && (always_wait || other_file(&st)) {
            st = self.flushed.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        if st.failed.is_none() && !st.flushing && other_file(&st) {
            let upto = st.newest.as_ref().map_or(st.durable, |(t, _)| *t);
            match st.flush_via.as_ref().map(|via| via.file.sync_data()) {
                Some(Ok(())) => {
                    let mark = st.newest_mark.clone();
                    st.made_durable(upto, mark)
                }
                Some(Err(e)) => st.failed = Some(format!("fdatasync: {e}")),
                None => st.failed = Some("unflushed lines without their file".into()),
            }
        }
        st
    }

    /// Whether appends still share flushes: not after one failed (see [`FlushState::failed`]).
    fn grouping(&self) -> bool {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).failed.is_none()
    }

    /// Return once `ticket`'s line is durable: flushed by this writer, or by another whose
    /// flush began after the line was written; `Err` when the flush covering it failed.
    fn wait_durable(&self, ticket: u64) -> Result<(), String> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if st.durable >= ticket {
                return Ok(());
            }
            if let Some(e) = &st.failed {
                return Err(e.clone());
            }
            if st.flushing {
                st = self.flushed.wait(st).unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            // This writer flushes the file that holds every unflushed line up to the newest
            // ticket (its own included: tickets only grow), through the descriptor that was
            // open before any of them was written ([`FlushState::flush_via`]).
            let Some(upto) = st.newest.as_ref().map(|(t, _)| *t) else {
                return Ok(());
            };
            let mark = st.newest_mark.clone();
            let Some(via) = st.flush_via.clone() else {
                return Err("unflushed lines without their file".into());
            };
            st.flushing = true;
            drop(st);
            let result = via.file.sync_data();
            st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.flushing = false;
            match result {
                Ok(()) if st.failed.is_none() => st.made_durable(upto, mark),
                Ok(()) => {}
                Err(e) => {
                    st.failed.get_or_insert(format!("fdatasync: {e}"));
                }
            }
            self.flushed.notify_all();
        }
    }
}

impl AuditLog {
    /// Create the directory (0700) and file (0600) if needed, check that the directory is
    /// the agent's alone ([`crate::config::check_agents_own_dir`]) and that the log can be locked and opened for
    /// appending.
    pub fn open(settings: AuditSettings) -> Result<AuditLog, AuditError> {
        let path = &settings.path;
        if let Some(dir) = path.parent() {
            let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
            if !dir.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| AuditError::new(path, format!("cannot create {}: {e}", dir.display())))?;
            }
        }
        Self::check_dir(&settings)?;
        let log = AuditLog {
            host: nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_default(),
            journal: if settings.journald && settings.journal_socket.exists() {
                UnixDatagram::unbound().ok()
            } else {
                None
            },
            settings,
            flush: GroupCommit::default(),
            outages: outage::Outages::default(),
        };
        let _lock = log.lock()?;
        log.open_file(&log.settings.path)?;
        Ok(log)
    }

    /// The log's directory, when it exists, is the agent's alone: whoever can write it could
    /// rename the log away and start a new chain in its place, remove or replace the rotated
    /// files, or plant a file at the lock's or a rotated file's name that stops every append.
    /// The log and its lock, where they exist, are regular files. (`agent --check-config`
    /// checks this without creating anything.)
    pub fn check_dir(settings: &AuditSettings) -> Result<(), AuditError> {
        let path = &settings.path;
        // The log and its lock, where they are already: regular files (not links to one), as
        // the append opens them.
        for file in [path.clone(), settings.lock_path()] {
            let Ok(meta) = std::fs::symlink_metadata(&file) else { continue };
            if !meta.is_file() {
                return Err(AuditError::new(
                    path,
                    format!("{}: not a regular file; the audit log and its lock must be ones", file.display()),
                ));
            }
            // The agent's own, as it creates them (0600): another owner, or a group or others
            // who may write it, could write records in the chain's place, and a second name
            // (a hard link, which survives the rotation's rename) is a copy someone else
            // holds open. Readable by a group is the operator's choice (a log shipper).
            use std::os::unix::fs::MetadataExt;
            let euid = nix::unistd::geteuid().as_raw();
            let wrong = if meta.uid() != euid {
                Some(format!("owned by uid {}, not the agent's ({euid})", meta.uid()))
            } else if meta.mode() & 0o022 != 0 {
                Some(format!("writable by group or others (mode {:04o}; chmod 600)", meta.mode() & 0o7777))
            } else if meta.nlink() > 1 {
                Some(format!("has {} names (hard links); it must have one", meta.nlink()))
            } else {
                None
            };
            if let Some(wrong) = wrong {
                return Err(AuditError::new(
                    path,
                    format!("{}: {wrong}; the audit log and its lock are the agent's alone", file.display()),
                ));
            }
        }
        let Some(dir) = path.parent() else { return Ok(()) };
        let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        let meta = match std::fs::metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            r => r.map_err(|e| AuditError::new(path, format!("{}: {e}", dir.display())))?,
        };
        crate::config::check_agents_own_dir(dir, &meta).map_err(|m| {
            AuditError::new(path, format!("its directory {m}; the audit log's directory must be the agent's alone"))
        })
    }

    pub fn settings(&self) -> &AuditSettings {
        &self.settings
    }

    fn lock(&self) -> Result<nix::fcntl::Flock<File>, AuditError> {
        let lp = self.settings.lock_path();
        let f = crate::bounded::open_regular_nofollow(
            &lp,
            OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600),
        )
        .map_err(|e| AuditError::new(&self.settings.path, format!("lock file {}: {e}", lp.display())))?;
        lock::exclusive(f, &lp, self.settings.lock_wait)
            .map_err(|e| AuditError::new(&self.settings.path, format!("{e}; nothing was appended")))
    }

    /// The log file, created when missing. Anything but a regular file is refused, before
    /// it is opened (opening a device can act) and on what was opened.
    fn open_file(&self, path: &Path) -> Result<File, AuditError> {
        crate::bounded::open_regular_nofollow(path, OpenOptions::new().read(true).append(true).create(true).mode(0o600))
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::InvalidInput => {
                    AuditError::new(path, "not a regular file; the audit log must be one")
                }
                _ => AuditError::new(path, e),
            })
    }

    /// Append one record (see the module documentation for the sequence of steps); it is
    /// durable when this returns `Ok`.
    pub fn append(&self, event: &str, fields: &Map<String, Value>) -> Result<Appended, AuditError> {
        self.append_with(event, fields, true)
    }

    /// Append one record without waiting for its flush: it becomes durable with the next
    /// flush of this process's lines — typically the next [`AuditLog::append`]'s (a line is
    /// only appended after the ones before it, and a flush covers every earlier line of the
    /// process, see "Group commit"). [`AuditLog::settle`] with the returned [`Deferred`]
    /// says whether it is durable (flushing it if no flush did), and only then mirrors it to
    /// journald. For records that precede a gate in the same command ("Records before a
    /// gate" in the module documentation).
    pub fn append_deferred(
        &self,
        event: &str,
        fields: &Map<String, Value>,
    ) -> Result<(Appended, Deferred), AuditError> {
        let (appended, ticket) = self.append_unflushed(event, fields)?;
        let journal = self.journal.as_ref().map(|_| journal_datagram(event, fields, &appended));
        let gap = appended.gap.map(|(from, to)| (from, to, appended.seq));
        Ok((appended, Deferred { ticket, journal, gap }))
    }

    /// Return once the `deferred` records are durable — flushed by a flush that began after
    /// they were written, this call's own if none did — and mirror them to journald; `Err`
    /// when the flush that covered one of them failed (then none is mirrored, as a record
    /// whose own flush failed is not).
    pub fn settle(&self, deferred: Vec<Deferred>) -> Result<(), AuditError> {
        if let Some(ticket) = deferred.iter().filter_map(|d| d.ticket).max() {
            self.flush.wait_durable(ticket).map_err(|e| {
                AuditError::new(&self.settings.path, format!("a record made before a gate is not durable: {e}"))
            })?;
        }
        for d in deferred {
            note_gap(d.gap);
            if let Some(datagram) = d.journal {
                self.mirror(&datagram);
            }
        }
        Ok(())
    }

    fn append_with(&self, event: &str, fields: &Map<String, Value>, wait: bool) -> Result<Appended, AuditError> {
        let (appended, ticket) = self.append_unflushed(event, fields)?;
        if let Some(ticket) = ticket.filter(|_| wait) {
            self.flush.wait_durable(ticket).map_err(|e| AuditError::new(&self.settings.path, e))?;
        }
        if wait {
            note_head(&appended);
            note_gap(appended.gap.map(|(from, to)| (from, to, appended.seq)));
        }
        if self.journal.is_some() {
            self.mirror(&journal_datagram(event, fields, &appended));
        }
        Ok(appended)
    }

    /// Append under the log's lock; the ticket of the line's flush when it still needs one.
    fn append_unflushed(
        &self,
        event: &str,
        fields: &Map<String, Value>,
    ) -> Result<(Appended, Option<u64>), AuditError> {
        let lock = self.lock()?;
        let (appended, unflushed) = self.append_locked(&lock, event, fields)?;
        let ticket = unflushed
            .map(|(file, mark)| self.flush.issue(file, mark, &lock))
            .transpose()
            .map_err(|e| AuditError::new(&self.settings.path, e))?;
        drop(lock);
        Ok((appended, ticket))
    }

    fn mirror(&self, datagram: &[u8]) {
        if let Some(sock) = &self.journal {
            // Best effort: journald may be absent, restarting or full.
            let _ = sock.send_to(datagram, &self.settings.journal_socket);
        }
    }

    /// Append under the log's lock; the file (and the line's mark) is returned when the line
    /// still needs its flush ([`GroupCommit`]), `None` when it was flushed here (a rotation,
    /// a repair, a file's first record: what comes next relies on it being durable now).
    fn append_locked(
        &self,
        lock: &File,
        event: &str,
        fields: &Map<String, Value>,
    ) -> Result<(Appended, Option<(File, high_water::HighWater)>), AuditError> {
        let path = &self.settings.path;
        let io = |e: std::io::Error| AuditError::new(path, e);
        let mut file = self.open_file(path)?;
        let len = file.metadata().map_err(io)?.len();
        let tail = read_tail(&file, len).map_err(io)?;
        let plan = plan(&tail).map_err(|m| AuditError::new(path, m))?;
        let marks = high_water::read(lock);
        let mut head = match &plan.head {
            Some((line, seq)) => Head { line: Some(line.clone()), seq: *seq, ..Head::genesis() },
            None => self.head_from_rotated(marks.newest().is_some())?,
        };
        // Records missing past the head ([`high_water::Marks::missing_after`]: the newest
        // file set aside, removed, emptied or cut short, or the log put back to an older
        // copy): the record says which, numbered after them.
        if let Some(last) = marks.missing_after(head.seq, plan.head.is_some()) {
            let from = head.seq + 1;
            tracing::warn!(
                path = %path.display(),
                from,
                to = last.seq,
                "audit: records seq {from}..{} were written but are not in the log (its newest file set aside, \
                 removed, emptied or cut short); the next record says so",
                last.seq
            );
            head.gap = Some(Gap { from, to: last.seq, sha256: last.sha256.clone() });
        }
        // The last record's seq is what the file (or the mark) says, so it may be any u64:
        // one past the largest is refused, never wrapped to 0 (nothing is written).
        let seq = head.follows().checked_add(1).ok_or_else(|| {
            AuditError::new(
                path,
                format!("the last record has seq {}, the largest there is: no record can follow it; run `opservant audit verify`", head.follows()),
            )
        })?;
        let ts = timestamp(SystemTime::now());
        let pid = std::process::id();
        let mut line = format_line(&head, seq, &ts, &self.host, pid, event, fields, plan.torn.as_deref());
        let mut rotated = false;
        // Rotate only from a clean tail (a repair stays next to the line it repairs), and
        // never leave an empty file behind.
        if plan.torn.is_none() && plan.head.is_some() && len + line.len() as u64 + 1 > self.settings.max_bytes {
            // Its unflushed lines (this process's others' too) become durable before the file
            // is renamed away: the new file's first record chains to its last.
            file.sync_data().map_err(|e| {
                let message = format!("fdatasync before rotating: {e}");
                self.flush.fail(&message);
                AuditError::new(path, message)
            })?;
            self.rotate().map_err(io)?;
            rotated = true;
            head.continues = Some((file_name(&self.settings.rotated(1)), head.seq));
            // Where the kept history now begins: a rotated file removed later (not by a
            // rotation) is then found missing by `verify`.
            head.oldest_kept = Some(self.oldest_kept_seq()?);
            line = format_line(&head, seq, &ts, &self.host, pid, event, fields, None);
            file = self.open_file(path)?;
        }
        let mut bytes = Vec::with_capacity(line.len() + 2);
        if plan.unterminated {
            bytes.push(b'\n');
        }
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        // Flushed here, under the lock, when what follows relies on it; otherwise by the
        // group commit once the lock is released.
        let flush_now = rotated || len == 0 || plan.torn.is_some() || !self.flush.grouping();
        let written = file.write_all(&bytes).and_then(|()| {
            if flush_now {
                file.sync_data().inspect_err(|e| self.flush.fail(&format!("fdatasync: {e}")))
            } else {
                Ok(())
            }
        });
        if let Err(e) = written {
            // Not left half-written (a short write on a full disk, a quota, a file-size
            // limit): the file is cut back to where this record began, so the next append
            // finds the same clean tail — not a torn line whose repair, failing too, would
            // leave two lines no writer may guess at and stop every later append.
            let _ = file.set_len(if rotated { 0 } else { len });
            return Err(io(e));
        }
        if flush_now {
            // The file holds every unflushed line of this process (a rotation flushed the
            // one before): all of them are durable now.
            self.flush.all_durable(&file);
        }
        if rotated || len == 0 {
            // The new directory entry must survive a crash too.
            if let Some(dir) = path.parent() {
                File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
            }
        }
        // The first record of a file after a rotation (this one's, or one cut short before
        // it wrote) says where the kept history begins: what lies before is dropped now.
        if head.continues.is_some() {
            self.drop_past_keep();
        }
        let appended = Appended {
            seq,
            sha256: sha256_hex(line.as_bytes()),
            line,
            rotated,
            repaired: plan.torn.is_some(),
            gap: head.gap.as_ref().map(|g| (g.from, g.to)),
        };
        // After the line (and its flush and the directory's, when made here): see
        // [`high_water`]'s guarantees. A line flushed later is marked durable by its flush.
        let mark = high_water::HighWater { seq, sha256: appended.sha256.clone() };
        if let Err(e) = high_water::write(lock, &mark, flush_now) {
            warn_mark_unwritten(&e);
        }
        Ok((appended, (!flush_now).then_some((file, mark))))
    }

    /// The current file holds no complete record: chain from the newest rotated file (a
    /// rotation was interrupted after the rename) or start the genesis. `marked`: the lock
    /// file holds a high-water mark — the log's records are known to have been written —
    /// so when `.1` is missing too (set aside or removed with the newest file), the newest
    /// rotated file there is, not the genesis, is what the log still holds last: the record
    /// then chains to it, and the gap it records starts after it (from the genesis, it
    /// claimed seqs the older files still hold, which `verify` could only call an edit).
    /// Without a mark, a missing `.1` is a log set aside whole with its lock file: a new
    /// genesis.
    fn head_from_rotated(&self, marked: bool) -> Result<Head, AuditError> {
        let mut number = 1;
        if marked && !self.settings.rotated(1).exists() {
            let numbered = self
                .numbered()
                .map_err(|e| AuditError::new(&self.settings.path, format!("cannot list rotated files: {e}")))?;
            match numbered.into_iter().min() {
                Some(n) => number = n,
                None => return Ok(Head::genesis()),
            }
        }
        let r1 = self.settings.rotated(number);
        let f = match crate::bounded::open_regular_nofollow(&r1, OpenOptions::new().read(true)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Head::genesis()),
            Err(e) => return Err(AuditError::new(&r1, e)),
        };
        let len = f.metadata().map_err(|e| AuditError::new(&r1, e))?.len();
        let tail = read_tail(&f, len).map_err(|e| AuditError::new(&r1, e))?;
        match (tail.terminated, tail.lines.last().map(|l| (l, parse_record(l)))) {
            (true, Some((line, Ok(r)))) => Ok(Head {
                line: Some(line.clone()),
                seq: r.seq,
                continues: Some((file_name(&r1), r.seq)),
                oldest_kept: Some(self.oldest_kept_seq()?),
                gap: None,
            }),
            _ => Err(AuditError::new(
                &r1,
                "the newest rotated file does not end with a complete record; run `opservant audit verify`",
            )),
        }
    }

    /// Where the kept history begins after a rotation (`continues.oldest`): the first seq
    /// of the oldest kept rotated file ([`AuditLog::first_record_of`]) — unless rotated
    /// files were removed other than by a rotation since the last claim. The file just
    /// rotated (`.1`) begins with that claim (or is the genesis: the history began at 1);
    /// when even the oldest rotated file there is begins after it, records the last
    /// rotation kept are gone, and the claim stays where it was, so that `verify` goes on
    /// reporting them removed — a new claim from the files left would hide the removal
    /// from every later `verify`. (An operator who removes old files on purpose sets the
    /// whole log aside: a new log starts a new genesis.) `Err` when it cannot be
    /// determined: the rotation's continuation is then not written at all (the rotation
    /// stays cut short, which verifies intact) rather than written without the claim,
    /// which would leave `verify_all` nothing to check a removed rotated file against.
    fn oldest_kept_seq(&self) -> Result<u64, AuditError> {
        let s = &self.settings;
        let list_error = |e: std::io::Error| AuditError::new(&s.path, format!("cannot list rotated files: {e}"));
        let kept = self.kept().map_err(list_error)?;
        // Called after a rotation or with `.1` present: there is a kept file.
        let Some(&oldest_kept) = kept.last() else {
            return Err(AuditError::new(&s.path, "no rotated file to say where the kept history begins"));
        };
        let kept_first = self.first_record_of(&s.rotated(oldest_kept))?.seq;
        let Some(&newest) = kept.first() else { return Ok(kept_first) };
        let newest_first = self.first_record_of(&s.rotated(newest))?;
        let claimed = match (&newest_first.continues, newest_first.oldest_kept) {
            (None, _) if newest_first.seq == 1 => 1,
            (Some(_), Some(claim)) => claim,
            // A continuation written before claims were recorded: nothing to hold to.
            _ => return Ok(kept_first),
        };
        let oldest_present = self.numbered().map_err(list_error)?.into_iter().max().unwrap_or(oldest_kept);
        let present_first = if oldest_present == oldest_kept {
            kept_first
        } else {
            // A file past `keep`, which this rotation drops: one that cannot be read does not
            // stop the log (every append would fail on it until an operator came) — the
            // claim stays, and `verify` reports what lay before the kept files.
            match self.first_record_of(&s.rotated(oldest_present)) {
                Ok(r) => r.seq,
                Err(e) => {
                    tracing::warn!(path = %s.rotated(oldest_present).display(), error = %e, "audit: a rotated file past audit.keep cannot be read; the rotation keeps the last claim of where the kept history begins");
                    return Ok(claimed);
                }
            }
        };
        if present_first > claimed {
            tracing::warn!(
                path = %s.path.display(),
                claimed,
                oldest_present = present_first,
                "audit: rotated files holding seq {claimed}..{} were removed other than by a rotation; the rotation keeps claiming {claimed} (`opservant audit verify` reports them)",
                present_first - 1
            );
            return Ok(claimed);
        }
        Ok(kept_first)
    }

    /// The first record of the file at `path`, as `verify` counts it: the first line's, or —
    /// when the second line repairs the first (a torn line, [`verify`]'s rule: the repair
    /// names exactly its bytes) — the second's. `Err` (naming the file) when neither is one.
    fn first_record_of(&self, path: &Path) -> Result<Record, AuditError> {
        use std::io::{BufRead, Read};
        let fail = |m: &dyn std::fmt::Display| {
            AuditError::new(
                path,
                format!(
                    "{m}: cannot say where the kept history begins; nothing was appended (run `opservant audit \
                     verify`; set this file aside once its records are kept elsewhere, and appends go on)"
                ),
            )
        };
        let f = crate::bounded::open_regular_nofollow(path, OpenOptions::new().read(true)).map_err(|e| fail(&e))?;
        let mut r = std::io::BufReader::new(f);
        // One complete line (with its `\n`) of at most MAX_RECORD_BYTES, else `None`.
        let mut next_line = || -> Result<Option<Vec<u8>>, AuditError> {
            let mut line = Vec::new();
            (&mut r).take(MAX_RECORD_BYTES).read_until(b'\n', &mut line).map_err(|e| fail(&e))?;
            Ok(line.strip_suffix(b"\n").map(<[u8]>::to_vec))
        };
        let first = next_line()?.ok_or_else(|| fail(&"its first line is incomplete or too long"))?;
        if let Some(second) = next_line()? {
            if let Ok(rec) = parse_record(&second) {
                if rec.repaired.as_ref().is_some_and(|(n, h)| *n == first.len() as u64 && *h == sha256_hex(&first)) {
                    return Ok(rec);
                }
            }
        }
        parse_record(&first).map_err(|e| fail(&format!("its first record: {e}")))
    }

    /// Every rotated file `path.N` → `path.N+1`, newest last, then `path` → `path.1`.
    /// Nothing is dropped here: the files older than the `keep` newest are removed by
    /// [`AuditLog::drop_past_keep`] once the new file's first record — which says where the
    /// kept history begins — is durable. A rotation cut short at any step (a crash, a full
    /// disk) so leaves every record and a claim that still holds, and `audit verify`
    /// reports the log intact, not a removed file.
    fn rotate(&self) -> std::io::Result<()> {
        let s = &self.settings;
        let numbers = self.numbered()?;
        // Only the run `.1`, `.2`, … up to the first gap moves (oldest first, each into the
        // number above it, which no file has): after a rotation cut short before its last
        // rename `.1` is missing, and the next attempt moves nothing again.
        let run = (1..=MAX_ROTATED_NUMBER).take_while(|n| numbers.contains(n)).last().unwrap_or(0);
        for n in (1..=run).rev() {
            std::fs::rename(s.rotated(n), s.rotated(n + 1))?;
        }
        std::fs::rename(&s.path, s.rotated(1))
    }

    /// The numbers of the `keep` newest rotated files, newest first. By rank, not by number:
    /// a rotation cut short leaves a gap in the numbers (`.1` missing, say), which the
    /// next rotation keeps, and the kept history must not shrink by it.
    fn kept(&self) -> std::io::Result<Vec<u32>> {
        let mut numbers = self.numbered()?;
        numbers.sort_unstable();
        numbers.truncate(self.settings.keep as usize);
        Ok(numbers)
    }

    /// The numbers `N` of the rotated files `path.N` there are (at most
    /// [`MAX_ROTATED_NUMBER`]: a file numbered higher — an operator's dated copy — is not
    /// one, and is neither renamed nor removed).
    fn numbered(&self) -> std::io::Result<Vec<u32>> {
        let s = &self.settings;
        let mut out = Vec::new();
        if let (Some(dir), Some(base)) = (s.path.parent(), s.path.file_name()) {
            for entry in std::fs::read_dir(dir)?.flatten() {
                out.extend(rotated_number(base, &entry.file_name()));
            }
        }
        Ok(out)
    }

    /// Remove the rotated files older than the `keep` newest (the oldest after a rotation, or
    /// left by a larger `keep` before): called once a record claiming the kept history is
    /// durable. Kept, they would only hold more history; a failure is logged, not an append
    /// error.
    fn drop_past_keep(&self) {
        let s = &self.settings;
        let mut numbered = match self.numbered() {
            Ok(n) => n,
            Err(e) => return tracing::warn!(path = %s.path.display(), error = %e, "audit: cannot list rotated files"),
        };
        numbered.sort_unstable();
        // Oldest first, stopping at a failure: what is left is always the newest files, so
        // `verify` finds no file missing between them.
        for n in numbered.into_iter().skip(s.keep as usize).rev() {
            if let Err(e) = ignore_missing(std::fs::remove_file(s.rotated(n))) {
                return tracing::warn!(path = %s.rotated(n).display(), error = %e, "audit: cannot remove a rotated file past audit.keep");
            }
        }
    }
}

fn ignore_missing(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// One journald native-protocol datagram. Values with a newline use the binary form
/// (`NAME\n<u64 LE length><bytes>\n`); none of ours normally do.
fn journal_datagram(event: &str, fields: &Map<String, Value>, a: &Appended) -> Vec<u8> {
    let mut out = Vec::new();
    let message = format!("audit #{} {}", a.seq, summary(event, fields));
    let seq = a.seq.to_string();
    for (name, value) in [
        ("MESSAGE", message.as_str()),
        ("SYSLOG_IDENTIFIER", "opservant-audit"),
        ("PRIORITY", "6"),
        ("OPSERVANT_EVENT", event),
        ("OPSERVANT_AUDIT_SEQ", seq.as_str()),
        ("OPSERVANT_AUDIT_SHA256", a.sha256.as_str()),
        ("OPSERVANT_AUDIT_RECORD", a.line.as_str()),
    ] {
        out.extend_from_slice(name.as_bytes());
        if value.contains('\n') {
            out.push(b'\n');
            out.extend_from_slice(&(value.len() as u64).to_le_bytes());
            out.extend_from_slice(value.as_bytes());
        } else {
            out.push(b'=');
            out.extend_from_slice(value.as_bytes());
        }
        out.push(b'\n');
    }
    out
}

/// The process-wide log `record` and `try_record` append to (none until [`init`]).
static SINK: Mutex<Option<Arc<AuditLog>>> = Mutex::new(None);

/// Open the configured log (`audit:` section; the default path without one) as this
/// process's sink. Called by the commands that run things (run, script, session, agent).
pub fn init(config: &Config) -> Result<(), AuditError> {
    init_with(AuditSettings::from_config(config))
}

/// What an operator should hear when the journald mirror is on (the default) but journald's
/// socket is missing: the log then has no copy off its own file, so a cut end, a forged
/// tail or a whole-set rollback verifies intact and shows nowhere (the heartbeat's and a
/// ping's `audit.head` are then the only record of it elsewhere). `None` when the mirror is
/// off by the configuration's word, or journald listens.
pub fn journald_warning(settings: &AuditSettings) -> Option<String> {
    (settings.journald && !settings.journal_socket.exists()).then(|| {
        format!(
            "audit.journald is on but {} is missing: the audit log has no copy off its own file, so a cut or \
             rewritten end, or the whole set rolled back, verifies intact and shows nowhere but against the \
             platform's record of the heads heartbeats carry; run journald, or set audit.journald: false to say so",
            settings.journal_socket.display()
        )
    })
}

/// The newest record this process made durable: `(seq, sha256)`.
static HEAD: Mutex<Option<(u64, String)>> = Mutex::new(None);

/// The latest gap this process recorded, once its record was durable: `(from, to, seq of
/// the record that says it)`.
static LAST_GAP: Mutex<Option<(u64, u64, u64)>> = Mutex::new(None);

fn note_gap(gap: Option<(u64, u64, u64)>) {
    if let Some(gap) = gap {
        let mut last = LAST_GAP.lock().unwrap_or_else(PoisonError::into_inner);
        if last.is_none_or(|(_, _, seq)| gap.2 > seq) {
            *last = Some(gap);
        }
    }
}

fn note_head(appended: &Appended) {
    let mut head = HEAD.lock().unwrap_or_else(PoisonError::into_inner);
    if head.as_ref().is_none_or(|(seq, _)| appended.seq > *seq) {
        *head = Some((appended.seq, appended.sha256.clone()));
    }
}

pub fn init_with(settings: AuditSettings) -> Result<(), AuditError> {
    let log = AuditLog::open(settings)?;
    *SINK.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(log));
    Ok(())
}

fn sink() -> Option<Arc<AuditLog>> {
    SINK.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

/// Record an event; a failure to append is logged as an error (see the module doc for which
/// events must use [`try_record`] instead). Its flush covers the records this thread made
/// before a gate, but it does not settle them: the gate ([`try_record`]) or the command's
/// [`settle`] checks them.
pub fn record(event: &str, fields: &[(&str, &str)]) {
    if let Err(e) = append_to(sink(), event, fields) {
        not_appended(event, &fields_object(fields), &e);
    }
}

/// A record that could not be appended: on stderr, whole, at `error` (the filter of a
/// command whose stderr is its program's still shows it; its `info` line may not be).
fn not_appended(event: &str, fields: &Map<String, Value>, e: &AuditError) {
    let shown = Value::Object(fields.clone());
    tracing::error!(target: "opservant::audit", event, fields = %shown, error = %e, "audit log append failed: this event is only on stderr");
}

/// Record an event; `Err` when a log is configured and the record could not be appended —
/// the caller must not go on with what the event audits. Also `Err` when a record this
/// thread made before this gate ([`record_before_gate`]) is not durable: the flush that
/// covered it failed.
pub fn try_record(event: &str, fields: &[(&str, &str)]) -> Result<(), AuditError> {
    try_record_to(sink(), event, fields)
}

fn try_record_to(sink: Option<Arc<AuditLog>>, event: &str, fields: &[(&str, &str)]) -> Result<(), AuditError> {
    // A record before this gate that could not be written fails the gate before its own
    // record is made: the log never says something began that was refused.
    if let Some(lost) = BEFORE_GATE_LOST.with(|l| l.borrow_mut().take()) {
        let _ = settle();
        return Err(lost);
    }
    append_to(sink, event, fields)?;
    // This line's flush covered the records this thread made before it (they were written
    // first): normally nothing is left to flush here, only to check.
    settle()
}

/// Append with its flush, and the record's `tracing` line.
fn append_to(sink: Option<Arc<AuditLog>>, event: &str, fields: &[(&str, &str)]) -> Result<(), AuditError> {
    append_traced(sink, event, fields, false)
}

/// [`record`] with its line on stderr at `debug`, not `info`: for a command-line run's
/// refusal, whose reason the run prints as its one line (DESIGN.md §5: exit 2 with a
/// one-line reason).
pub fn record_quietly(event: &str, fields: &[(&str, &str)]) {
    if let Err(e) = append_traced(sink(), event, fields, true) {
        not_appended(event, &fields_object(fields), &e);
    }
}

fn append_traced(
    sink: Option<Arc<AuditLog>>,
    event: &str,
    fields: &[(&str, &str)],
    quiet: bool,
) -> Result<(), AuditError> {
    let fields = fields_object(fields);
    let began = std::time::Instant::now();
    let appended = sink.as_ref().map(|log| log.append(event, &fields)).transpose();
    if quiet {
        let seq = appended.as_ref().ok().and_then(|a| a.as_ref().map(|a| a.seq));
        let shown = Value::Object(fields.clone());
        tracing::debug!(target: "opservant::audit", event, seq, fields = %shown, "audit");
    } else {
        trace(event, &fields, &appended);
    }
    if let Some(log) = &sink {
        outage::note(log, appended.as_ref().map(|_| ()), began);
    }
    appended.map(|_| ())
}

/// The log as this process has found it, for `ping` and heartbeats: `ok` unless its latest
/// append failed — `error`, the latest failure, and `since`, the first of the run of them;
/// every run whose start cannot be recorded is refused meanwhile. When nothing has tried
/// the log for [`outage::RETRY_AFTER`], a call has a record of the run tried in the
/// background ([`outage::at_heartbeat`]): once the log takes records again, an idle
/// agent's later call says `ok` without waiting for a command's record. `flush_failed`:
/// the first flush of this process that failed, if one did — the lines it covered may not
/// be on the disk even once appends succeed again (`audit verify` after the next restart
/// tells).
///
/// Never waits for a flush: the group commit's state is held across `fdatasync`, which a
/// hung disk can make last for ever, so while it is busy the last `flush_failed` read is
/// reported (a heartbeat or `ping` goes on answering).
pub fn health() -> Value {
    static LAST_FLUSH_FAILED: Mutex<Option<String>> = Mutex::new(None);
    let log = sink();
    let failing = log.as_deref().and_then(outage::failing);
    let mut last = LAST_FLUSH_FAILED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(log) = &log {
        match log.flush.state.try_lock() {
            Ok(st) => last.clone_from(&st.failed),
            Err(std::sync::TryLockError::Poisoned(p)) => last.clone_from(&p.into_inner().failed),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
    }
    let flush_failed = last.clone();
    drop(last);
    if let Some(log) = &log {
        outage::at_heartbeat(log);
    }
    let head = HEAD.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let gap = *LAST_GAP.lock().unwrap_or_else(PoisonError::into_inner);
    serde_json::json!({
        "ok": failing.is_none(),
        "error": failing.as_ref().map(|f| &f.error),
        "since": failing.as_ref().map(|f| &f.since),
        "flush_failed": flush_failed,
        // An anchor off the host: the platform that keeps these can tell a log cut back,
        // rolled back or rewritten past one of them (that seq missing, or another hash).
        "head": head.map(|(seq, sha256)| serde_json::json!({"seq": seq, "sha256": sha256})),
        // Records this agent found missing from the log (the newest file set aside, removed,
        // emptied or cut short) and recorded as a gap: the latest such.
        "gap": gap.map(|(from, to, seq)| serde_json::json!({"from": from, "to": to, "seq": seq})),
    })
}

/// Wait, at most `max`, for the `audit_resumed` records in line to be appended (or to fail):
/// a command's process calls it before it exits.
pub fn drain(max: Duration) {
    if let Some(log) = sink() {
        outage::drain(&log, max);
    }
}

thread_local! {
    /// The records this thread made before a gate and has not settled yet, with the log
    /// each went to.
    static BEFORE_GATE: std::cell::RefCell<Vec<(Arc<AuditLog>, Deferred)>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A record this thread could not even append before a gate (the first such failure
    /// since its last settle): the gate and the settle fail with it, as for a lost flush.
    static BEFORE_GATE_LOST: std::cell::RefCell<Option<AuditError>> = const { std::cell::RefCell::new(None) };
}

/// Record an event that precedes a gate of the same command, on the same thread, without
/// waiting for its flush ("Records before a gate" in the module documentation). The
/// thread's next [`try_record`] — whose flush covers this line — or its [`settle`] checks
/// that it is durable, flushing it if needed; the caller reaches one of them before
/// anything the event precedes happens or is answered. A failure to append is logged as an
/// error, as by [`record`], and fails the thread's next gate or settle as a lost flush does.
pub fn record_before_gate(event: &str, fields: &[(&str, &str)]) {
    record_before_gate_to(sink(), event, fields)
}

fn record_before_gate_to(sink: Option<Arc<AuditLog>>, event: &str, fields: &[(&str, &str)]) {
    let fields = fields_object(fields);
    let appended = sink
        .as_ref()
        .map(|log| {
            log.append_deferred(event, &fields).map(|(appended, deferred)| {
                BEFORE_GATE.with(|b| b.borrow_mut().push((log.clone(), deferred)));
                appended
            })
        })
        .transpose();
    trace(event, &fields, &appended);
    if let (Err(e), Some(log)) = (appended, &sink) {
        outage::note(log, Err(&e), std::time::Instant::now());
        not_appended(event, &fields, &e);
        let lost = AuditError {
            message: format!("a record made before a gate ({event}) could not be written: {}", e.message),
            path: e.path,
        };
        BEFORE_GATE_LOST.with(|l| {
            l.borrow_mut().get_or_insert(lost);
        });
    }
}

/// Return once the records this thread made before a gate ([`record_before_gate`]) are
/// durable, and mirror them to journald; `Err` when one of them is not (the flush that
/// covered it failed). A daemon's command calls it before its reply.
pub fn settle() -> Result<(), AuditError> {
    let pending = BEFORE_GATE.with(|b| std::mem::take(&mut *b.borrow_mut()));
    let mut result = match BEFORE_GATE_LOST.with(|l| l.borrow_mut().take()) {
        Some(lost) => Err(lost),
        None => Ok(()),
    };
    let mut pending = pending.into_iter().peekable();
    while let Some((log, first)) = pending.next() {
        // Grouped by log (one in practice; a test may open another meanwhile).
        let mut same = vec![first];
        while let Some((_, d)) = pending.next_if(|(l, _)| Arc::ptr_eq(l, &log)) {
            same.push(d);
        }
        if let Err(e) = log.settle(same) {
            outage::note(&log, Err(&e), std::time::Instant::now());
            result = result.and(Err(e));
        }
    }
    result
}

/// The record's `tracing` line (the CLI prints those on stderr).
fn trace(event: &str, fields: &Map<String, Value>, appended: &Result<Option<Appended>, AuditError>) {
    let shown = Value::Object(fields.clone());
    match appended {
        Ok(Some(a)) => tracing::info!(target: "opservant::audit", event, seq = a.seq, fields = %shown, "audit"),
        _ => tracing::info!(target: "opservant::audit", event, fields = %shown, "audit"),
    }
}

/// The number of a rotated file of the log named `log_name` (`NAME.<n>`, `n` from 1 to
/// [`MAX_ROTATED_NUMBER`], written without leading zeros, as a rotation names them), or
/// `None` for any other name. The writer and `verify` both read the set of files with it: a
/// copy named `NAME.01` is neither's.
pub(crate) fn rotated_number(log_name: &std::ffi::OsStr, file_name: &std::ffi::OsStr) -> Option<u32> {
    let prefix = format!("{}.", log_name.to_str()?);
    file_name
        .to_str()?
        .strip_prefix(&prefix)
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()) && !d.starts_with('0'))
        .and_then(|d| d.parse::<u32>().ok())
        .filter(|&n| n <= MAX_ROTATED_NUMBER)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory, removed on drop.
    pub(crate) struct Scratch(pub PathBuf);
    impl Scratch {
        pub(crate) fn new(tag: &str) -> Scratch {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("opservant-audit-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Scratch(p)
        }
        pub(crate) fn log(&self) -> PathBuf {
            self.0.join("audit.jsonl")
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    pub(crate) fn append(log: &AuditLog, n: usize) -> Vec<Appended> {
        (0..n).map(|i| log.append("test", &fields_object(&[("i", &i.to_string())])).unwrap()).collect()
    }

    fn lines(p: &Path) -> Vec<String> {
        std::fs::read_to_string(p).unwrap().lines().map(str::to_string).collect()
    }

    #[test]
    fn timestamps_are_rfc3339_utc_micros() {
        assert_eq!(timestamp(std::time::UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_micros(1_795_355_101_123_456);
        assert_eq!(timestamp(t), "2026-11-22T13:45:01.123456Z");
        let leap = std::time::UNIX_EPOCH + std::time::Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(timestamp(leap), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn genesis_then_each_record_chains_to_the_previous_line() {
        let s = Scratch::new("chain");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        let a = append(&log, 3);
        let l = lines(&s.log());
        assert_eq!(l.len(), 3);
        let r: Vec<Record> = l.iter().map(|x| parse_record(x.as_bytes()).unwrap()).collect();
        assert_eq!((r[0].seq, r[0].prev.as_str()), (1, GENESIS_PREV));
        assert_eq!(r[1].prev, sha256_hex(l[0].as_bytes()));
        assert_eq!(r[2].prev, sha256_hex(l[1].as_bytes()));
        assert_eq!(r[2].seq, 3);
        assert_eq!(a[2].sha256, sha256_hex(l[2].as_bytes()));
        // Key order as documented, prev last.
        assert!(
            l[0].starts_with("{\"seq\":1,\"ts\":\"") && l[0].contains("\"event\":\"test\",\"fields\":{\"i\":\"0\"}")
        );
        assert!(l[0].ends_with(&format!(",\"prev\":\"{GENESIS_PREV}\"}}")));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(s.log()).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn directory_is_created_0700() {
        use std::os::unix::fs::PermissionsExt;
        let s = Scratch::new("dir");
        let path = s.0.join("a/b/audit.jsonl");
        let log = AuditLog::open(AuditSettings::at(&path)).unwrap();
        append(&log, 1);
        assert_eq!(std::fs::metadata(s.0.join("a/b")).unwrap().permissions().mode() & 0o777, 0o700);
    }

    #[test]
    fn a_torn_last_line_is_repaired_without_losing_the_chain() {
        let s = Scratch::new("torn");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        append(&log, 2);
        let torn = b"{\"seq\":3,\"ts\":\"2026-";
        std::fs::OpenOptions::new().append(true).open(s.log()).unwrap().write_all(torn).unwrap();
        let a = log.append("after", &Map::new()).unwrap();
        assert!(a.repaired);
        let l = lines(&s.log());
        assert_eq!(l.len(), 4);
        assert_eq!(l[2].as_bytes(), torn);
        let r = parse_record(l[3].as_bytes()).unwrap();
        assert_eq!(r.seq, 3, "the torn record never counted");
        assert_eq!(r.prev, sha256_hex(l[1].as_bytes()), "chains to the last complete record");
        assert_eq!(r.repaired, Some((torn.len() as u64, sha256_hex(torn))));
        let next = parse_record(log.append("next", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!((next.seq, next.repaired), (4, None));
    }

    #[test]
    fn plan_cases() {
        let rec = |seq: u64| {
            format!("{{\"seq\":{seq},\"ts\":\"t\",\"event\":\"e\",\"fields\":{{}},\"prev\":\"{GENESIS_PREV}\"}}")
                .into_bytes()
        };
        let t = |lines: Vec<Vec<u8>>, terminated| Tail { lines, terminated };
        assert_eq!(plan(&t(vec![], true)).unwrap(), Plan { head: None, torn: None, unterminated: false });
        let p = plan(&t(vec![rec(1), rec(2)], true)).unwrap();
        assert_eq!((p.head.map(|h| h.1), p.torn), (Some(2), None));
        // A complete-looking record without its newline was never acknowledged: repaired.
        let p = plan(&t(vec![rec(1), rec(2)], false)).unwrap();
        assert_eq!((p.head.map(|h| h.1), p.torn.is_some(), p.unterminated), (Some(1), true, true));
        // A terminated garbage line (a repair interrupted after its `\n`) is repaired too.
        let p = plan(&t(vec![rec(4), b"garbage".to_vec()], true)).unwrap();
        assert_eq!((p.head.map(|h| h.1), p.unterminated), (Some(4), false));
        // The torn line is the file's only line: chain from the rotated file / genesis.
        let p = plan(&t(vec![b"{\"se".to_vec()], false)).unwrap();
        assert_eq!((p.head, p.torn.is_some()), (None, true));
        // Two bad lines: refuse rather than guess.
        assert!(plan(&t(vec![b"x".to_vec(), b"y".to_vec()], true)).is_err());
    }

    #[test]
    fn read_tail_finds_the_last_two_lines_of_long_files() {
        let s = Scratch::new("tail");
        let long = "x".repeat(50_000);
        std::fs::write(s.log(), format!("a\n{long}\nb\nc")).unwrap();
        let f = File::open(s.log()).unwrap();
        let t = read_tail(&f, f.metadata().unwrap().len()).unwrap();
        assert_eq!((t.lines, t.terminated), (vec![b"b".to_vec(), b"c".to_vec()], false));
        std::fs::write(s.log(), format!("a\n{long}\n")).unwrap();
        let f = File::open(s.log()).unwrap();
        let t = read_tail(&f, f.metadata().unwrap().len()).unwrap();
        assert_eq!((t.lines, t.terminated), (vec![b"a".to_vec(), long.into_bytes()], true));
    }

    #[test]
    fn rotation_carries_the_chain_into_the_next_file() {
        let s = Scratch::new("rotate");
        let mut settings = AuditSettings::at(&s.log());
        settings.max_bytes = 1024;
        settings.keep = 3;
        let log = AuditLog::open(settings.clone()).unwrap();
        let a = append(&log, 40);
        assert!(a.iter().any(|x| x.rotated));
        assert!(settings.rotated(3).exists() && !settings.rotated(4).exists(), "keep 3");
        for p in [settings.rotated(1), settings.rotated(2), s.log()] {
            assert!(std::fs::metadata(&p).unwrap().len() <= 1024, "{}", p.display());
        }
        let last_of_1 = lines(&settings.rotated(1)).pop().unwrap();
        let first = parse_record(lines(&s.log())[0].as_bytes()).unwrap();
        let before = parse_record(last_of_1.as_bytes()).unwrap();
        assert_eq!(first.prev, sha256_hex(last_of_1.as_bytes()));
        assert_eq!(first.continues, Some(("audit.jsonl.1".into(), before.seq)));
        assert_eq!(first.seq, before.seq + 1);
        // An interrupted rotation (renamed, nothing written yet) continues from `.1`.
        std::fs::rename(s.log(), settings.rotated(1)).unwrap();
        let r = parse_record(log.append("x", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!(r.continues.map(|c| c.1), Some(40));
        assert_eq!((r.seq, r.gap), (41, None), "a rotation cut short is no gap");
    }

    /// Records cut off the end of the newest file, or the log put back to an older copy:
    /// the durable mark is past the file's last record, and the next record says which
    /// are missing. Lines a crash lost before their flush (written, never durable) are not
    /// missing records: their seqs are used again, as before.
    #[test]
    fn records_cut_off_the_end_are_a_gap_but_lines_never_durable_are_not() {
        let s = Scratch::new("gap-cut");
        let settings = AuditSettings::at(&s.log());
        let log = AuditLog::open(settings.clone()).unwrap();
        let a = append(&log, 6);
        let kept = lines(&s.log())[..3].iter().map(|l| format!("{l}\n")).collect::<String>();
        std::fs::write(s.log(), &kept).unwrap();
        let r = parse_record(log.append("after", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!(r.gap, Some(Gap { from: 4, to: 6, sha256: a[5].sha256.clone() }));
        assert_eq!((r.seq, r.prev.clone()), (7, a[2].sha256.clone()));
        let v = verify::verify(&[s.log()]).unwrap();
        assert!(!v.intact && v.problem.is_none(), "{v:?}");
        assert_eq!((v.gaps.len(), v.gaps[0].line, v.records), (1, 4, 4), "{v:?}");

        // A line written but not flushed when the host crashed: the written mark is past
        // the file, the durable mark is not — the next record takes the lost line's seq.
        let s = Scratch::new("gap-crash");
        let settings = AuditSettings::at(&s.log());
        let log = AuditLog::open(settings.clone()).unwrap();
        let a = append(&log, 3);
        let lock = File::options().read(true).write(true).open(settings.lock_path()).unwrap();
        let marks = high_water::read(&lock);
        assert_eq!(marks.durable.as_ref().map(|m| m.seq), Some(3), "a command's appends are durable when they return");
        high_water::write(&lock, &high_water::HighWater { seq: 4, sha256: "ab".repeat(32) }, false).unwrap();
        let r = parse_record(log.append("after", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!((r.seq, r.gap, r.prev), (4, None, a[2].sha256.clone()));
        assert!(verify::verify(&[s.log()]).unwrap().intact);
    }

    /// The newest file set aside (what an append's error says to do with a damaged tail),
    /// removed or emptied: the next record says which seqs are missing, is numbered after
    /// them (none reused), and `verify` reports them. A rotation cut short after its rename
    /// is no gap; a log set aside whole, its lock file with it, starts a new genesis.
    #[test]
    fn records_missing_with_the_newest_file_are_recorded_as_a_gap() {
        let verify_all = |s: &Scratch| verify::verify_all(&verify::chain_files(&s.log()).unwrap()).unwrap();
        // A log never rotated: its only file set aside.
        let s = Scratch::new("gap-only-file");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        let before = append(&log, 5);
        std::fs::rename(s.log(), s.0.join("audit.jsonl.set-aside")).unwrap();
        let r = parse_record(log.append("after", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!((r.seq, r.prev.as_str(), r.continues), (6, GENESIS_PREV, None));
        assert_eq!(r.gap, Some(Gap { from: 1, to: 5, sha256: before[4].sha256.clone() }));
        append(&log, 2);
        let v = verify_all(&s);
        assert!(!v.intact && v.problem.is_none(), "{v:?}");
        assert_eq!((v.gaps.len(), v.first_seq, v.last_seq), (1, Some(6), Some(8)), "{v:?}");

        // A rotated log: the newest file removed, then (after more records) emptied.
        let (s, settings, log) = rotating_log("gap-rotated", 4);
        while !settings.rotated(1).exists() || lines(&s.log()).len() < 3 {
            log.append("x", &Map::new()).unwrap();
        }
        let last_of_1 = parse_record(lines(&settings.rotated(1)).pop().unwrap().as_bytes()).unwrap().seq;
        let newest = log.append("x", &Map::new()).unwrap();
        std::fs::remove_file(s.log()).unwrap();
        let r = parse_record(log.append("after", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!(r.continues.as_ref().map(|c| c.1), Some(last_of_1));
        assert_eq!(r.gap, Some(Gap { from: last_of_1 + 1, to: newest.seq, sha256: newest.sha256.clone() }));
        assert_eq!(r.seq, newest.seq + 1);
        let newest = log.append("y", &Map::new()).unwrap();
        File::create(s.log()).unwrap();
        let r = parse_record(log.append("after", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!(r.gap.map(|g| (g.from, g.to)), Some((last_of_1 + 1, newest.seq)), "emptied");
        let v = verify_all(&s);
        assert!(!v.intact && v.problem.is_none(), "{v:?}");
        assert_eq!(v.gaps.len(), 1, "the file emptied held the first gap's record: {v:?}");

        // The newest file and `.1` both set aside: the record chains to the newest rotated
        // file left (`.2`), the gap runs from past it.
        let (s, settings, log) = rotating_log("gap-newest-two", 4);
        while !settings.rotated(2).exists() || lines(&s.log()).len() < 3 {
            log.append("x", &Map::new()).unwrap();
        }
        let last_of_2 = parse_record(lines(&settings.rotated(2)).pop().unwrap().as_bytes()).unwrap().seq;
        let newest = log.append("x", &Map::new()).unwrap();
        std::fs::remove_file(s.log()).unwrap();
        std::fs::remove_file(settings.rotated(1)).unwrap();
        let r = parse_record(log.append("after", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!(r.continues, Some(("audit.jsonl.2".to_string(), last_of_2)));
        assert_eq!(r.gap, Some(Gap { from: last_of_2 + 1, to: newest.seq, sha256: newest.sha256.clone() }));
        append(&log, 2);
        let v = verify_all(&s);
        assert!(!v.intact && v.problem.is_none(), "a gap, not an edit: {v:?}");
        assert_eq!(v.gaps.len(), 1, "{v:?}");
        // And on through the next rotation (which renames `.2` to `.3`, the gap's file to `.1`).
        while !settings.rotated(1).exists() || !lines(&settings.rotated(1)).iter().any(|l| l.contains("\"gap\"")) {
            log.append("x", &Map::new()).unwrap();
        }
        append(&log, 2);
        let v = verify_all(&s);
        assert!(!v.intact && v.problem.is_none() && v.gaps.len() == 1, "{v:?}");

        // A rotation cut short after its rename: no gap, the log intact.
        let (s, settings, log) = rotating_log("gap-cut-rotation", 4);
        append(&log, 6);
        log.rotate().unwrap();
        assert!(!s.log().exists() && settings.rotated(1).exists());
        let r = parse_record(log.append("after", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!((r.seq, r.gap), (7, None));
        assert!(verify_all(&s).intact);

        // The whole log set aside with its lock file: a new genesis.
        let (s, settings, log) = rotating_log("gap-whole-log", 4);
        append(&log, 30);
        let aside = s.0.join("aside");
        std::fs::create_dir(&aside).unwrap();
        for f in verify::chain_files(&s.log()).unwrap().into_iter().chain([settings.lock_path()]) {
            std::fs::rename(&f, aside.join(f.file_name().unwrap())).unwrap();
        }
        let r = parse_record(log.append("fresh", &Map::new()).unwrap().line.as_bytes()).unwrap();
        assert_eq!((r.seq, r.gap, r.continues), (1, None, None));
        assert!(verify_all(&s).intact);
    }

    /// A log in a scratch directory that rotates at 1 KiB and keeps `keep` rotated files.
    fn rotating_log(name: &str, keep: u32) -> (Scratch, AuditSettings, AuditLog) {
        let s = Scratch::new(name);
        let mut settings = AuditSettings::at(&s.log());
        settings.max_bytes = 1024;
        settings.keep = keep;
        let log = AuditLog::open(settings.clone()).unwrap();
        (s, settings, log)
    }

    /// Rotated files removed other than by a rotation stay reported after the next rotation:
    /// its continuation keeps the last claim of where the kept history begins, never one
    /// made from the files left (which hid the removal from every later `verify`) — with
    /// `keep` not yet used up (the genesis file among those removed) and with it full (the
    /// oldest three removed, two of which the rotation would have kept).
    #[test]
    fn rotated_files_removed_outside_a_rotation_stay_reported_after_the_next_one() {
        for (keep, rotations_before, removed) in [(8u32, 4u32, vec![4u32, 3]), (4, 6, vec![4, 3, 2])] {
            let (s, settings, log) = rotating_log("removed-rotated", keep);
            let rotations = |log: &AuditLog| {
                let mut n = 0;
                while n < 1 {
                    n += u32::from(log.append("x", &Map::new()).unwrap().rotated);
                }
            };
            for _ in 0..rotations_before {
                rotations(&log);
            }
            let verify_all = || verify::verify_all(&verify::chain_files(&s.log()).unwrap()).unwrap();
            assert!(verify_all().intact, "keep {keep}");
            for n in &removed {
                std::fs::remove_file(settings.rotated(*n)).unwrap();
            }
            let r = verify_all();
            assert!(!r.intact, "keep {keep}: the removal is found");
            let problem = format!("{:?}", r.problem);
            // One rotation (and a record after it), then another: still found.
            rotations(&log);
            log.append("after", &Map::new()).unwrap();
            let r = verify_all();
            assert!(!r.intact, "keep {keep}: the removal is hidden after a rotation (before: {problem})");
            rotations(&log);
            assert!(!verify_all().intact, "keep {keep}: hidden after a second rotation");
        }
        // A file past `keep` that cannot be read (its first line garbage) does not stop the
        // log at the rotation that drops it.
        let (_scratch, settings, log) = rotating_log("unreadable-past-keep", 2);
        while !settings.rotated(2).exists() {
            log.append("x", &Map::new()).unwrap();
        }
        let oldest = settings.rotated(2);
        let text = std::fs::read_to_string(&oldest).unwrap();
        std::fs::write(&oldest, format!("garbage\n{}", text.split_once('\n').unwrap().1)).unwrap();
        let mut rotated = false;
        while !rotated {
            rotated = log.append("x", &Map::new()).expect("appends go on").rotated;
        }
        assert!(!settings.rotated(3).exists(), "dropped past keep");
        // Files a rotation drops past `keep` are not a removal.
        let (s, settings, log) = rotating_log("dropped-rotated", 2);
        append(&log, 80);
        assert!(!settings.rotated(3).exists());
        let r = verify::verify_all(&verify::chain_files(&s.log()).unwrap()).unwrap();
        assert!(r.intact, "{:?}", r.problem);
    }

    /// A rotation cut short at its last rename (the log append-only, `chattr +a`: it cannot
    /// be renamed) leaves a log that verifies intact — before, the oldest file was already
    /// deleted while the last claim still said it was kept, a "removal" until the next
    /// append. Once the rename works again, the next append completes it.
    #[test]
    fn a_rotation_cut_short_leaves_a_log_that_verifies() {
        struct AppendOnly(PathBuf);
        impl Drop for AppendOnly {
            fn drop(&mut self) {
                let _ = std::process::Command::new("chattr").arg("-a").arg(&self.0).status();
            }
        }
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var_os("CI").is_none(), "CI runs the tests as root");
            return;
        }
        let (s, settings, log) = rotating_log("cut-rotation", 2);
        append(&log, 30);
        assert!(settings.rotated(2).exists(), "rotated twice at least");
        let verify_all = || verify::verify_all(&verify::chain_files(&s.log()).unwrap()).unwrap();
        assert!(verify_all().intact);
        // The newest rotated file's history must survive the rotation after the cut one
        // (keep 2: it is then the older of the two kept).
        let newest_rotated = lines(&settings.rotated(1))[0].clone();
        let st = std::process::Command::new("chattr").arg("+a").arg(s.log()).status().unwrap();
        assert!(st.success(), "chattr +a");
        let guard = AppendOnly(s.log());
        let mut failed = false;
        for _ in 0..20 {
            if log.append("x", &Map::new()).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed, "a rotation was tried and cut short");
        let r = verify_all();
        assert!(r.intact, "{:?}", r.problem);
        drop(guard);
        // A second cut attempt before the rename works again shifts the files once more.
        log.append("after", &Map::new()).unwrap();
        let r = verify_all();
        assert!(r.intact, "{:?}", r.problem);
        let rotated = verify::chain_files(&s.log()).unwrap();
        assert_eq!(rotated.len(), 3, "the log and keep = 2 rotated files: {rotated:?}");
        assert!(
            rotated.iter().any(|f| std::fs::read_to_string(f).unwrap().lines().next() == Some(newest_rotated.as_str())),
            "the newest rotated file before the cut was dropped: {rotated:?}"
        );
        // A file numbered past any rotation's (an operator's dated copy) is not the log's:
        // neither renamed nor removed, nor verified with it.
        std::fs::write(settings.rotated(20_261_125), "a copy").unwrap();
        for _ in 0..20 {
            log.append("more", &Map::new()).unwrap();
        }
        assert!(verify_all().intact);
        assert_eq!(std::fs::read_to_string(settings.rotated(20_261_125)).unwrap(), "a copy");
    }

    /// The lock file and the newest rotated file are opened as the log is: a FIFO there is
    /// refused at once (it would block the open), a link is not followed.
    #[test]
    fn the_lock_and_the_rotated_file_must_be_regular_files_never_links() {
        let fifo = |p: &Path| nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let s = Scratch::new("kinds");
        let settings = AuditSettings::at(&s.log());
        fifo(&settings.lock_path());
        let Err(e) = AuditLog::open(settings.clone()) else { panic!("a FIFO lock is refused") };
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::remove_file(settings.lock_path()).unwrap();
        let target = s.0.join("elsewhere");
        std::fs::write(&target, "").unwrap();
        std::os::unix::fs::symlink(&target, settings.lock_path()).unwrap();
        assert!(AuditLog::open(settings.clone()).is_err(), "a linked lock is not followed");
        std::fs::remove_file(settings.lock_path()).unwrap();
        // An empty log chains from `.1`: a FIFO or a link there is refused, not opened.
        let log = AuditLog::open(settings.clone()).unwrap();
        fifo(&settings.rotated(1));
        let e = log.append("x", &Map::new()).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::remove_file(settings.rotated(1)).unwrap();
        let other = Scratch::new("kinds-other");
        let other_log = AuditLog::open(AuditSettings::at(&other.log())).unwrap();
        append(&other_log, 2);
        std::os::unix::fs::symlink(other.log(), settings.rotated(1)).unwrap();
        assert!(log.append("x", &Map::new()).is_err(), "a linked rotated file is not followed");
        assert_eq!(std::fs::metadata(s.log()).unwrap().len(), 0);
    }

    #[test]
    fn concurrent_appenders_keep_one_chain() {
        let s = Scratch::new("threads");
        let path = s.log();
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let p = path.clone();
                // Each thread its own AuditLog: separate lock descriptions, as separate
                // processes have.
                std::thread::spawn(move || append(&AuditLog::open(AuditSettings::at(&p)).unwrap(), 25))
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let report = verify::verify(&[path]).unwrap();
        assert!(report.intact, "{}", report.render());
        assert_eq!(report.records, 200);
    }

    /// Threads of one process share its log (the agent's concurrent runs): their flushes are
    /// grouped, and through rotations too the log is one intact chain with every record.
    #[test]
    fn one_process_threads_share_flushes_and_keep_one_chain_across_rotations() {
        let s = Scratch::new("group-threads");
        let mut settings = AuditSettings::at(&s.log());
        settings.max_bytes = 4096;
        settings.keep = 1000;
        let log = Arc::new(AuditLog::open(settings.clone()).unwrap());
        // One more writer with its own lock description, as another process has.
        let other = std::thread::spawn({
            let settings = settings.clone();
            move || append(&AuditLog::open(settings).unwrap(), 40)
        });
        let threads: Vec<_> = (0..6)
            .map(|_| {
                let log = log.clone();
                std::thread::spawn(move || append(&log, 40))
            })
            .collect();
        let mut rotated = other.join().unwrap().iter().filter(|a| a.rotated).count();
        for t in threads {
            rotated += t.join().unwrap().iter().filter(|a| a.rotated).count();
        }
        assert!(rotated >= 5, "rotations under way: {rotated}");
        let mut files: Vec<PathBuf> =
            (1..=rotated as u32 + 1).map(|n| settings.rotated(n)).filter(|p| p.exists()).collect();
        files.reverse();
        files.push(s.log());
        let report = verify::verify_all(&files).unwrap();
        assert!(report.intact, "{}", report.render());
        assert_eq!(report.records, 280);
    }

    /// The group commit's bookkeeping: a flush covers every ticket up to the newest; a line
    /// in another file first flushes the older file's unflushed lines; a failed flush fails
    /// every line not durable yet, and grouping stops.
    #[test]
    fn group_commit_covers_older_tickets_and_fails_closed() {
        let s = Scratch::new("group");
        let gc = GroupCommit::default();
        let durable = |gc: &GroupCommit| gc.state.lock().unwrap().durable;
        // Each ticket's record, and the lock file its durable mark goes to.
        let lock = File::options().read(true).write(true).create(true).truncate(false).open(s.0.join("lock")).unwrap();
        let mark = |seq: u64| high_water::HighWater { seq, sha256: format!("{seq:064x}") };
        let marked = || high_water::read(&lock).durable.map(|m| m.seq);
        // The lines' written mark (appends write it under the log's lock, before their flush).
        high_water::write(&lock, &mark(16), false).unwrap();
        let a = File::create(s.0.join("a")).unwrap();
        let t1 = gc.issue(a.try_clone().unwrap(), mark(11), &lock).unwrap();
        let t2 = gc.issue(a.try_clone().unwrap(), mark(12), &lock).unwrap();
        assert_eq!((t1, t2, durable(&gc), marked()), (1, 2, 0, None));
        gc.wait_durable(t1).unwrap();
        assert_eq!(durable(&gc), 2, "the flush for ticket 1 covered ticket 2, written before it");
        assert_eq!(marked(), Some(12), "the durable mark names the newest record the flush covered");
        let t3 = gc.issue(a.try_clone().unwrap(), mark(13), &lock).unwrap();
        let t4 = gc.issue(File::create(s.0.join("b")).unwrap(), mark(14), &lock).unwrap();
        assert_eq!(durable(&gc), t3, "a line in another file: the older file's lines were flushed first");
        // fdatasync on a pipe fails (EINVAL), as a failing disk's would.
        let (r, _w) = nix::unistd::pipe().unwrap();
        let pipe = File::from(r);
        let t5 = gc.issue(pipe.try_clone().unwrap(), mark(15), &lock).unwrap();
        let t6 = gc.issue(pipe, mark(16), &lock).unwrap();
        assert_eq!((durable(&gc), marked()), (t4, Some(14)));
        assert!(gc.grouping());
        assert!(gc.wait_durable(t5).unwrap_err().starts_with("fdatasync"));
        assert!(gc.wait_durable(t6).is_err(), "not durable when the flush failed: failed too");
        assert!(gc.wait_durable(t4).is_ok(), "durable before the failure");
        assert_eq!(marked(), Some(14), "no record whose flush failed is marked durable");
        assert!(!gc.grouping(), "after a failed flush every line is flushed by its writer");
    }

    /// Every flush of unflushed lines goes through the descriptor first opened for one of
    /// them (opened before any of them was written: the one Linux still reports their
    /// write-back errors through), never a later writer's. Shown with an `O_PATH` descriptor
    /// of the same file as the first, through which `fdatasync` always fails (`EBADF`).
    #[test]
    fn flushes_go_through_the_first_descriptor_of_the_unflushed_lines() {
        use std::os::unix::fs::OpenOptionsExt;
        let s = Scratch::new("flush-via");
        let path = s.0.join("a");
        File::create(&path).unwrap();
        let first = || OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(&path).unwrap();
        let later = || OpenOptions::new().append(true).open(&path).unwrap();
        let lock = File::create(s.0.join("lock")).unwrap();
        let mark = || high_water::HighWater { seq: 1, sha256: "ab".repeat(32) };

        // A group flush.
        let gc = GroupCommit::default();
        let t1 = gc.issue(first(), mark(), &lock).unwrap();
        let t2 = gc.issue(later(), mark(), &lock).unwrap();
        assert!(gc.wait_durable(t2).unwrap_err().contains("Bad file descriptor"), "flushed through the newest");
        assert!(gc.wait_durable(t1).is_err());
        assert!(!gc.grouping());

        // A writer that flushed its own line under the lock: the others' lines are only
        // durable once flushed through their first descriptor.
        let gc = GroupCommit::default();
        let t1 = gc.issue(first(), mark(), &lock).unwrap();
        let own = later();
        own.sync_data().unwrap();
        gc.all_durable(&own);
        assert!(gc.wait_durable(t1).is_err(), "counted durable through the caller's descriptor");

        // The other file's lines, settled when a line lands in a new file.
        let gc = GroupCommit::default();
        let t1 = gc.issue(first(), mark(), &lock).unwrap();
        let _t2 = gc.issue(later(), mark(), &lock).unwrap();
        let b = File::create(s.0.join("b")).unwrap();
        assert!(gc.issue(b, mark(), &lock).is_ok());
        assert!(gc.wait_durable(t1).is_err(), "settled through the newest descriptor of the old file");

        // A failed flush under the log's lock ends grouping too.
        let gc = GroupCommit::default();
        gc.fail("fdatasync: Input/output error");
        assert!(!gc.grouping());
    }

    /// A record before a gate is written at once and made durable by the next flush of the
    /// process's lines — the gate's append, or the settle's own — never counted durable
    /// before one; a flush that fails, however it covered the record, fails its settle.
    #[test]
    fn records_before_a_gate_are_durable_with_the_next_flush() {
        use std::os::unix::fs::OpenOptionsExt;
        let s = Scratch::new("deferred");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        let durable = |log: &AuditLog| {
            let st = log.flush.state.lock().unwrap();
            (st.durable, st.newest.as_ref().map(|(t, _)| *t))
        };
        let deferred = |log: &AuditLog, event: &str| log.append_deferred(event, &fields_object(&[])).unwrap();
        // A file's first record is flushed under the lock, whatever the caller asked.
        let (_, first) = deferred(&log, "first");
        assert_eq!((durable(&log), first.ticket), ((0, None), None));
        let (received, r) = deferred(&log, "command_received");
        let (granted, g) = deferred(&log, "permission_granted");
        assert_eq!(durable(&log), (0, Some(2)), "written, not flushed");
        assert_eq!(lines(&s.log()).len(), 3, "both lines are in the file already");
        let gate = log.append("executor_start", &fields_object(&[])).unwrap();
        assert_eq!(durable(&log), (3, Some(3)), "the gate's flush covers the lines before it");
        assert_eq!((received.seq, granted.seq, gate.seq), (2, 3, 4));
        log.settle(vec![first, r, g]).unwrap();
        assert_eq!(durable(&log), (3, Some(3)), "nothing left to flush");
        let (_, r) = deferred(&log, "command_received");
        assert_eq!(durable(&log), (3, Some(4)));
        log.settle(vec![r]).unwrap();
        assert_eq!(durable(&log), (4, Some(4)), "flushed by the settle itself");

        // Through a descriptor whose fdatasync fails (O_PATH) as the one the deferred line's
        // flush must go through: a grouped gate fails with it, and so does its settle.
        let o_path = |path: PathBuf| {
            let f = OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(path).unwrap();
            let id = file_id(&f).unwrap();
            Unflushed { file: Arc::new(f), id }
        };
        let (_, r) = deferred(&log, "command_received");
        log.flush.state.lock().unwrap().flush_via = Some(o_path(s.log()));
        let gate = log.append("executor_start", &fields_object(&[])).unwrap_err();
        assert!(gate.to_string().contains("Bad file descriptor"), "{gate}");
        assert!(log.settle(vec![r]).is_err());
        let report = verify::verify(&[s.log()]).unwrap();
        assert!(report.intact, "{}", report.render());
        assert_eq!(report.records, 7, "a line whose flush failed stays in the file");

        // A gate flushed under the lock (here: it rotates the log) passes by itself, while
        // the deferred line's flush failed: its settle says so.
        let s = Scratch::new("deferred-rotate");
        let mut settings = AuditSettings::at(&s.log());
        settings.max_bytes = 600;
        let log = AuditLog::open(settings).unwrap();
        log.append("first", &fields_object(&[])).unwrap();
        let (_, r) = deferred(&log, "command_received");
        assert!(r.ticket.is_some());
        log.flush.state.lock().unwrap().flush_via = Some(o_path(s.log()));
        let gate = log.append("executor_start", &fields_object(&[("pad", &"x".repeat(200))])).unwrap();
        assert!(gate.rotated, "the gate rotated the log");
        assert!(log.settle(vec![r]).unwrap_err().to_string().contains("Bad file descriptor"));
    }

    /// The daemon's sequence on one thread: receipt before the gate, a record in between, the
    /// gate. When the flush covering the receipt failed (here: another writer's grouped
    /// flush, after which lines are flushed under the lock and pass by themselves), the
    /// record in between does not clear the check, and the gate fails.
    #[test]
    fn a_gate_fails_when_its_threads_records_before_it_are_not_durable() {
        use std::os::unix::fs::OpenOptionsExt;
        let s = Scratch::new("gate-thread");
        let log = Arc::new(AuditLog::open(AuditSettings::at(&s.log())).unwrap());
        let sink = || Some(log.clone());
        append_to(sink(), "first", &[]).unwrap();
        record_before_gate_to(sink(), "command_received", &[]);
        assert_eq!(BEFORE_GATE.with(|b| b.borrow().len()), 1);
        let f = OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(s.log()).unwrap();
        let id = file_id(&f).unwrap();
        log.flush.state.lock().unwrap().flush_via = Some(Unflushed { file: Arc::new(f), id });
        let other = {
            let log = log.clone();
            std::thread::spawn(move || log.append("other", &fields_object(&[]))).join().unwrap()
        };
        assert!(other.is_err(), "the grouped flush failed");
        assert!(!log.flush.grouping());
        append_to(sink(), "limit_clamped", &[]).expect("flushed under the lock by itself");
        let gate = try_record_to(sink(), "executor_start", &[]).unwrap_err();
        assert!(gate.to_string().contains("before a gate is not durable"), "{gate}");
        assert_eq!(BEFORE_GATE.with(|b| b.borrow().len()), 0, "settled (and failed) once");
        // The next command on the thread is not held by it.
        record_before_gate_to(sink(), "command_received", &[]);
        try_record_to(sink(), "executor_start", &[]).unwrap();
        settle().unwrap();
    }

    /// A writer whose line lands in the file being flushed does not wait for that flush (it
    /// holds the log's lock meanwhile); one whose line lands in another file does, and then
    /// flushes the older file's lines first.
    #[test]
    fn a_flush_under_way_holds_only_writers_of_another_file() {
        let s = Scratch::new("flush-wait");
        let gc = Arc::new(GroupCommit::default());
        let a = File::create(s.0.join("a")).unwrap();
        let lock = File::create(s.0.join("lock")).unwrap();
        let mark = || high_water::HighWater { seq: 1, sha256: "ab".repeat(32) };
        let t1 = gc.issue(a.try_clone().unwrap(), mark(), &lock).unwrap();
        // Another writer's flush, under way.
        gc.state.lock().unwrap().flushing = true;
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let (gc, a, lock) = (gc.clone(), a.try_clone().unwrap(), lock.try_clone().unwrap());
            std::thread::spawn(move || tx.send(gc.issue(a, mark(), &lock)).unwrap());
        }
        let t2 = rx.recv_timeout(Duration::from_secs(30)).expect("waited for the flush of its own file").unwrap();
        assert_eq!((t1, t2), (1, 2));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let (gc, b, lock) = (gc.clone(), File::create(s.0.join("b")).unwrap(), lock.try_clone().unwrap());
            std::thread::spawn(move || tx.send(gc.issue(b, mark(), &lock)).unwrap());
        }
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "did not wait for the flush under way");
        {
            let mut st = gc.state.lock().unwrap();
            st.flushing = false;
            gc.flushed.notify_all();
        }
        let t3 = rx.recv_timeout(Duration::from_secs(30)).expect("still waiting after the flush ended").unwrap();
        assert_eq!(t3, 3);
        assert_eq!(gc.state.lock().unwrap().durable, 2, "the older file's lines were flushed first");
    }

    #[test]
    fn long_field_values_are_cut() {
        let v = "é".repeat(MAX_FIELD_BYTES);
        let m = fields_object(&[("name", &v)]);
        let s = m["name"].as_str().unwrap();
        assert!(s.len() < MAX_FIELD_BYTES + 40 && s.ends_with("bytes cut]"), "{}", s.len());
    }

    #[test]
    fn journald_datagram_is_native_protocol() {
        let s = Scratch::new("journal");
        let sock_path = s.0.join("journal.sock");
        let server = UnixDatagram::bind(&sock_path).unwrap();
        let mut settings = AuditSettings::at(&s.log());
        settings.journald = true;
        settings.journal_socket = sock_path;
        let log = AuditLog::open(settings).unwrap();
        let a = log.append("secret_access", &fields_object(&[("secret", "db"), ("note", "two\nlines")])).unwrap();
        let mut buf = vec![0u8; 65536];
        let n = server.recv(&mut buf).unwrap();
        let d = &buf[..n];
        let text = String::from_utf8_lossy(d);
        assert!(text.starts_with("MESSAGE=audit #1 secret_access note=\"two\\nlines\" secret=db\n"), "{text}");
        for want in [
            "\nSYSLOG_IDENTIFIER=opservant-audit\n".to_string(),
            "\nPRIORITY=6\n".into(),
            "\nOPSERVANT_EVENT=secret_access\n".into(),
            format!("\nOPSERVANT_AUDIT_SHA256={}\n", a.sha256),
            format!("\nOPSERVANT_AUDIT_RECORD={}\n", a.line),
        ] {
            assert!(text.contains(&want), "{want:?} in {text}");
        }
        // A value holding a newline goes in the binary form: NAME\n<u64 LE length><bytes>\n.
        let odd = Appended { line: "a\nb".into(), ..a };
        let d = journal_datagram("e", &Map::new(), &odd);
        let mut want = b"OPSERVANT_AUDIT_RECORD\n".to_vec();
        want.extend_from_slice(&3u64.to_le_bytes());
        want.extend_from_slice(b"a\nb\n");
        assert!(d.ends_with(&want));
    }

    #[test]
    fn config_section_is_validated_on_parse() {
        let c =
            Config::parse("audit:\n  path: /var/tmp/x/audit.jsonl\n  max_bytes: 2048\n  keep: 2\n  journald: false\n")
                .unwrap();
        let s = AuditSettings::from_config(&c);
        assert_eq!(
            (s.path, s.max_bytes, s.keep, s.journald),
            (PathBuf::from("/var/tmp/x/audit.jsonl"), 2048, 2, false)
        );
        for bad in [
            "audit:\n  path: rel/audit.jsonl\n",
            "audit:\n  max_bytes: 10\n",
            "audit:\n  keep: 0\n",
            "audit:\n  pth: /x\n",
            "audit:\n  lock_wait_seconds: 0\n",
            "audit:\n  lock_wait_seconds: 3601\n",
        ] {
            assert!(Config::parse(bad).is_err(), "{bad}");
        }
        let d = AuditSettings::from_config(&Config::default());
        assert_eq!(
            (d.path, d.max_bytes, d.keep, d.journald, d.lock_wait),
            (PathBuf::from(DEFAULT_PATH), DEFAULT_MAX_BYTES, DEFAULT_KEEP, true, Duration::from_secs(30))
        );
        let w = Config::parse("audit:\n  lock_wait_seconds: 2\n").unwrap();
        assert_eq!(AuditSettings::from_config(&w).lock_wait, Duration::from_secs(2));
    }

    /// A log in `s` whose appends wait at most `wait`, and its lock held through another
    /// open file description (as another process would hold it).
    fn log_behind_held_lock(s: &Scratch, wait: Duration) -> (AuditLog, nix::fcntl::Flock<File>) {
        let mut settings = AuditSettings::at(&s.log());
        settings.lock_wait = wait;
        let log = AuditLog::open(settings.clone()).unwrap();
        let f = File::options().read(true).write(true).create(true).truncate(false).open(settings.lock_path()).unwrap();
        (log, nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).unwrap())
    }

    /// A record before a gate that could not even be appended (here: the log's lock held by
    /// a stuck process past the wait) fails the thread's gate once the lock is free again —
    /// the executor must not run without its receipt on record — and only that gate.
    #[test]
    fn a_gate_fails_when_a_record_before_it_could_not_be_written() {
        let s = Scratch::new("gate-lost");
        let (log, held) = log_behind_held_lock(&s, Duration::from_millis(200));
        let log = Arc::new(log);
        let sink = || Some(log.clone());
        record_before_gate_to(sink(), "command_received", &[]);
        assert_eq!(BEFORE_GATE.with(|b| b.borrow().len()), 0, "nothing was appended");
        drop(held);
        let gate = try_record_to(sink(), "executor_start", &[]).unwrap_err();
        assert!(gate.to_string().contains("before a gate (command_received) could not be written"), "{gate}");
        let text = std::fs::read_to_string(s.log()).unwrap_or_default();
        assert!(!text.contains("executor_start"), "the failed gate's own record was not written: {text}");
        // The next command on the thread is not held by it.
        record_before_gate_to(sink(), "command_received", &[]);
        try_record_to(sink(), "executor_start", &[]).unwrap();
        settle().unwrap();
    }

    #[test]
    fn an_append_waits_for_a_holder_that_lets_go() {
        let s = Scratch::new("lockwait");
        let (log, held) = log_behind_held_lock(&s, Duration::from_secs(20));
        let (tx, rx) = std::sync::mpsc::channel();
        let appender = std::thread::spawn(move || {
            let r = log.append("x", &Map::new());
            tx.send(()).unwrap();
            r
        });
        // Still waiting while the lock is held (the append cannot have finished)...
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "appended under another's lock");
        drop(held);
        // ...and done once it is released.
        let a = appender.join().unwrap().unwrap();
        assert_eq!(a.seq, 1);
    }

    #[test]
    fn an_append_behind_a_stuck_holder_fails_and_names_it() {
        let s = Scratch::new("lockstuck");
        let (log, held) = log_behind_held_lock(&s, Duration::from_secs(1));
        let before = std::fs::read(s.log()).unwrap_or_default();
        // Other signals arriving meanwhile (a signal with a handler and no SA_RESTART: the
        // audit module's own) do not end the wait early or make it fail differently.
        lock::install_handler().unwrap();
        // A caller that blocks every signal (as the agent's threads block the stop signals)
        // still gets its wait ended.
        // SAFETY: sigset_t is plain data filled by sigfillset; this thread's mask only.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            assert_eq!(libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut()), 0);
        }
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let poker = std::thread::spawn(move || {
            for _ in 0..5 {
                std::thread::sleep(Duration::from_millis(100));
                // SAFETY: signals a thread of this process, whose handler for it does nothing.
                unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, lock::wake_signal()) };
            }
        });
        let started = std::time::Instant::now();
        let e = log.append("x", &Map::new()).unwrap_err();
        poker.join().unwrap();
        assert!(started.elapsed() >= Duration::from_secs(1), "gave up early: {:?}", started.elapsed());
        let me = format!("pid {}", std::process::id());
        assert!(e.message.contains("held by") && e.message.contains(&me), "{e}");
        assert_eq!(std::fs::read(s.log()).unwrap_or_default(), before, "nothing appended");
        drop(held);
        assert_eq!(log.append("x", &Map::new()).unwrap().seq, 1, "appends go on once it is released");
    }

    /// The oldest kept file may begin with a torn line its second line repairs (a writer
    /// died mid-write as the file was started): the rotation's claim of where the kept
    /// history begins is then that repair's seq, as `verify` counts it. Before, only the
    /// first line was read, the claim was left out, and removing every rotated file went
    /// unnoticed.
    #[test]
    fn a_torn_first_line_of_the_oldest_file_still_gives_the_rotation_its_claim() {
        let s = Scratch::new("torn-oldest");
        let mut settings = AuditSettings::at(&s.log());
        settings.max_bytes = 1024;
        settings.keep = 1;
        let log = AuditLog::open(settings.clone()).unwrap();
        append(&log, 3);
        std::fs::rename(s.log(), settings.rotated(1)).unwrap();
        std::fs::write(s.log(), b"{\"seq\":4,\"ts").unwrap();
        let a = log.append("repair", &Map::new()).unwrap();
        assert!(a.repaired && a.seq == 4, "{a:?}");
        let mut rotations = 0;
        for _ in 0..40 {
            rotations += usize::from(log.append("x", &Map::new()).unwrap().rotated);
            if rotations == 1 {
                break;
            }
        }
        assert_eq!(rotations, 1, "rotated once");
        assert!(lines(&settings.rotated(1))[0].starts_with("{\"seq\":4,\"ts"), "the torn-start file is .1");
        assert!(!settings.rotated(2).exists(), "keep 1");
        let first = parse_record(lines(&s.log())[0].as_bytes()).unwrap();
        assert_eq!(first.oldest_kept, Some(4), "the claim is the seq of the oldest file's first record");
        let verify_all = || verify::verify_all(&verify::chain_files(&s.log()).unwrap()).unwrap();
        assert!(verify_all().intact, "{:?}", verify_all().problem);
        std::fs::remove_file(settings.rotated(1)).unwrap();
        let r = verify_all();
        assert_eq!(r.problem.map(|p| p.kind), Some(verify::Kind::Removed), "the removed file is found");
    }

    /// The seq after the last record's is computed, not wrapped: a last record claiming
    /// seq u64::MAX (with a correct prev) fails the append and nothing is written — before,
    /// a release build wrote seq 0 after it.
    #[test]
    fn no_record_follows_the_largest_seq() {
        let s = Scratch::new("seq-max");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        let a = append(&log, 2);
        let forged = format!(
            "{{\"seq\":{},\"ts\":\"t\",\"host\":\"h\",\"pid\":1,\"event\":\"e\",\"fields\":{{}},\"prev\":\"{}\"}}\n",
            u64::MAX,
            a[1].sha256
        );
        std::fs::OpenOptions::new().append(true).open(s.log()).unwrap().write_all(forged.as_bytes()).unwrap();
        assert_eq!(parse_record(forged.trim_end().as_bytes()).unwrap().seq, u64::MAX);
        let before = std::fs::read(s.log()).unwrap();
        let e = log.append("next", &Map::new()).unwrap_err();
        assert!(e.message.contains("the largest there is"), "{e}");
        assert_eq!(std::fs::read(s.log()).unwrap(), before, "nothing written");
    }
}
