//! `opservant audit verify`: walk the hash chain of one or more log files given in chain order
//! (oldest first) and report the *first* problem — its file, line and kind — or a summary
//! when the chain is intact.
//!
//! Guarantees: every rule of the parent module's chain is checked (seq steps of exactly 1,
//! each `prev` equal to the SHA-256 of the previous record's stored line, a file's first
//! record is the genesis or a continuation, a non-record line is accepted only as a torn line
//! the next record repairs, exactly); nothing is skipped silently — continuations of files not
//! given and repairs are notes in the report. Records the log itself says are missing (a
//! record with a `gap`: the newest file set aside, removed, emptied or cut short, or the log
//! put back to an older copy) are reported as `removed` in `gaps`, every one, and the log is
//! not intact — but the check goes on past them, so a recorded gap never hides a later
//! problem. Files are read one at a time, so memory is bounded by the largest file, not the
//! whole log.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::{parse_record, rotated_path, sha256_hex, AuditError, Record, GENESIS_PREV};

/// What is wrong, in the order of the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A record's bytes changed after it was written: its SHA-256 no longer matches the
    /// `prev` of the record after it (reported at the changed record).
    Edited,
    /// Records are missing: a seq gap, or a file's first record that is neither the genesis
    /// nor a rotation continuation (reported at the first record after the gap).
    Removed,
    /// Records are out of order: seq goes backwards or repeats, or a missing seq appears
    /// later (reported at the first record out of place).
    Reordered,
    /// The last line of a file is incomplete (no `\n`): an interrupted write not yet
    /// repaired, or a cut.
    Truncated,
    /// A line that is not JSON.
    NotJson,
    /// JSON, but not an audit record (a required key is missing or has the wrong type).
    Malformed,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Edited => "edited",
            Kind::Removed => "removed",
            Kind::Reordered => "reordered",
            Kind::Truncated => "truncated",
            Kind::NotJson => "not_json",
            Kind::Malformed => "malformed",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    pub file: String,
    pub line: usize,
    /// The seq of the record at that line, when it has one.
    pub seq: Option<u64>,
    pub kind: Kind,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Note {
    pub file: String,
    pub line: usize,
    pub message: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct FileSummary {
    pub path: String,
    pub lines: usize,
    pub records: u64,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    pub intact: bool,
    /// Records checked (up to the problem, when there is one).
    pub records: u64,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
    /// SHA-256 of the last record's line: compare with `OPSERVANT_AUDIT_SHA256` in journald
    /// (or any other copy) to see that nothing was cut off the end.
    pub head: Option<String>,
    pub files: Vec<FileSummary>,
    pub notes: Vec<Note>,
    /// Records the log says are missing (`removed`, at the record that says so), oldest
    /// first: the log is not intact, but the chain was checked on past them.
    pub gaps: Vec<Problem>,
    pub problem: Option<Problem>,
}

impl VerifyReport {
    /// The text `opservant audit verify` prints: the problem first when there is one. What a
    /// record or a file name supplies (a continuation's file name, a detail quoting a line)
    /// is shown with its control characters escaped: a tampered log cannot drive the
    /// terminal of whoever verifies it (print "chain intact" over a problem, clear the screen).
    pub fn render(&self) -> String {
        let shown = crate::one_terminal_line;
        let mut out = String::new();
        let range = match (self.first_seq, self.last_seq) {
            (Some(a), Some(b)) => format!(" (seq {a}..{b})"),
            _ => String::new(),
        };
        let problem_line = |p: &Problem| {
            let seq = p.seq.map(|s| format!(" (seq {s})")).unwrap_or_default();
            format!("{}:{}: {}{seq}: {}\n", shown(&p.file), p.line, p.kind.as_str(), shown(&p.detail))
        };
        for g in &self.gaps {
            out.push_str(&problem_line(g));
        }
        match &self.problem {
            Some(p) => {
                out.push_str(&problem_line(p));
                out.push_str(&format!("chain BROKEN; {} verified before it{range}\n", records(self.records)));
            }
            None => {
                let files = self.files.len();
                let s = if files == 1 { "" } else { "s" };
                let but = match self.gaps.len() {
                    0 => String::new(),
                    1 => " but for the records missing above (a gap: NOT INTACT)".to_string(),
                    n => format!(" but for the records missing above ({n} gaps: NOT INTACT)"),
                };
                out.push_str(&format!("chain intact{but}: {} in {files} file{s}{range}\n", records(self.records)));
            }
        }
        for f in &self.files {
            let seqs = match (f.first_seq, f.last_seq) {
                (Some(a), Some(b)) => format!("seq {a}..{b}"),
                _ => "no records".into(),
            };
            out.push_str(&format!("  {}: {}, {seqs}\n", shown(&f.path), records(f.records)));
        }
        for n in &self.notes {
            out.push_str(&format!("note: {}:{}: {}\n", shown(&n.file), n.line, shown(&n.message)));
        }
        if let Some(h) = &self.head {
            out.push_str(&format!("head: {}\n", shown(h)));
        }
        out
    }
}

fn records(n: u64) -> String {
    format!("{n} record{}", if n == 1 { "" } else { "s" })
}

/// The configured log and its rotated files, oldest first: every `NAME.<n>` beside it
/// ([`super::rotated_number`]: no leading zeros, up to [`super::MAX_ROTATED_NUMBER`]) (a missing number in between is left for the chain
/// check to report), then the log.
pub fn chain_files(path: &Path) -> Result<Vec<PathBuf>, AuditError> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default();
    let mut numbered: Vec<u32> = Vec::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) => return Err(AuditError::new(path, format!("cannot list {}: {e}", dir.display()))),
    };
    for e in rd.flatten() {
        // The writer's own reading of the names (no leading zeros, nothing numbered past
        // any rotation's): a copy named `NAME.01` is not taken for `NAME.1`.
        numbered.extend(super::rotated_number(name, &e.file_name()));
    }
    numbered.sort_unstable_by(|a, b| b.cmp(a));
    let mut files: Vec<PathBuf> = numbered.into_iter().map(|n| rotated_path(path, n)).collect();
    if path.exists() {
        files.push(path.to_path_buf());
    }
    if files.is_empty() {
        return Err(AuditError::new(path, "no audit log (nor rotated files) here"));
    }
    Ok(files)
}

/// One file's lines as the writer sees them: pieces between `\n`; a last piece without `\n`
/// is unterminated. Lazy — no list of the lines is built (a file of 1 GiB of `\n` would make
/// one of 16 GiB) — with the number of lines (counted, not collected) and whether the last
/// one is terminated (an empty file: no lines, terminated).
pub(super) struct Lines<'a> {
    pub(super) lines: std::slice::Split<'a, u8, fn(&u8) -> bool>,
    pub(super) count: usize,
    pub(super) terminated: bool,
}

pub(super) fn lines_of(bytes: &[u8]) -> Lines<'_> {
    let newline: fn(&u8) -> bool = |b| *b == b'\n';
    let terminated = bytes.last().is_none_or(|b| *b == b'\n');
    let body = if terminated && !bytes.is_empty() { &bytes[..bytes.len() - 1] } else { bytes };
    let mut lines = body.split(newline);
    let count = if bytes.is_empty() {
        // `split` of nothing yields one empty piece; an empty file has no line.
        lines.next();
        0
    } else {
        body.iter().filter(|b| **b == b'\n').count() + 1
    };
    Lines { lines, count, terminated }
}

/// The last record accepted.
struct Last {
    seq: u64,
    /// The seq of the record before it in the log (`seq - 1`, or before its recorded gap).
    follows: u64,
    /// Its recorded gap is the last one in the report's `gaps`.
    gap: bool,
    hash: String,
    file: String,
    line: usize,
}

/// The largest file `verify` reads: a log rotates before it grows past `audit.max_bytes`
/// (at most [`super::MAX_MAX_BYTES`]), plus room for one record. Anything larger is not a
/// file the agent wrote, and is refused before it is read (memory is bounded by this).
pub const MAX_FILE_BYTES: u64 = super::MAX_MAX_BYTES + (1 << 20);

/// The error for a file larger than [`MAX_FILE_BYTES`] (`len` when known), refused by
/// `verify` and `tail` before it is read.
pub(super) fn too_large(f: &Path, len: Option<u64>) -> AuditError {
    let size = len.map(|l| format!("{l} bytes, ")).unwrap_or_default();
    AuditError::new(
        f,
        format!(
            "{size}more than the {MAX_FILE_BYTES} bytes an audit log file can hold (audit.max_bytes is at most {})",
            super::MAX_MAX_BYTES
        ),
    )
}

/// Verify `files`, oldest first. `Err` only when a file cannot be read (or is larger than
/// [`MAX_FILE_BYTES`]).
pub fn verify(files: &[PathBuf]) -> Result<VerifyReport, AuditError> {
    verify_files(files, false)
}

/// Verify the whole log, `files` from [`chain_files`]: as [`verify`], and the oldest file
/// must begin where the newest rotation said the kept history begins (`continues.oldest`),
/// so a rotated file removed other than by a rotation is found.
pub fn verify_all(files: &[PathBuf]) -> Result<VerifyReport, AuditError> {
    verify_files(files, true)
}

fn verify_files(files: &[PathBuf], complete: bool) -> Result<VerifyReport, AuditError> {
    if files.is_empty() {
        return Err(AuditError { path: "-".into(), message: "no files to verify".into() });
    }
    for f in files {
        let meta = std::fs::metadata(f).map_err(|e| AuditError::new(f, e))?;
        if meta.len() > MAX_FILE_BYTES {
            return Err(too_large(f, Some(meta.len())));
        }
    }
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    verify_with(&names, complete, |i| {
        let f = &files[i];
        let buf = crate::bounded::read_regular(f, MAX_FILE_BYTES).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => too_large(f, None),
            _ => AuditError::new(f, e),
        })?;
        Ok(std::borrow::Cow::Owned(buf))
    })
}

/// Verify the contents of log files held in memory, `(name, bytes)`, oldest first: the same
/// checks as [`verify`] (which reads files and calls the same code), for any bytes.
pub fn verify_bytes(files: &[(&str, &[u8])]) -> VerifyReport {
    let names: Vec<String> = files.iter().map(|(n, _)| n.to_string()).collect();
    match verify_with(&names, false, |i| Ok::<_, std::convert::Infallible>(std::borrow::Cow::Borrowed(files[i].1))) {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

/// The chain check over `names.len()` files whose contents `read(i)` gives, oldest first;
/// `complete`: they are all the log's files (see [`verify_all`]).
fn verify_with<'a, E>(
    names: &[String],
    complete: bool,
    read: impl Fn(usize) -> Result<std::borrow::Cow<'a, [u8]>, E>,
) -> Result<VerifyReport, E> {
    let mut report = VerifyReport {
        intact: true,
        records: 0,
        first_seq: None,
        last_seq: None,
        head: None,
        files: vec![],
        notes: vec![],
        gaps: vec![],
        problem: None,
    };
    let mut last: Option<Last> = None;
    // The head before the last record's (an edited last record is not verified).
    let mut head_before: Option<String> = None;
    // The newest rotation's claim of where the kept history begins: (seq, file, line).
    let mut oldest_kept: Option<(u64, String, usize)> = None;
    for (fi, name) in names.iter().enumerate() {
        let bytes = read(fi)?;
        let name = name.clone();
        // The lines one at a time (memory: the file, never a list of its lines).
        let Lines { lines, count, terminated } = lines_of(&bytes);
        let mut lines = lines.peekable();
        let mut summary = FileSummary { path: name.clone(), lines: count, records: 0, first_seq: None, last_seq: None };
        if count == 0 {
            report.notes.push(Note { file: name.clone(), line: 0, message: "empty file".into() });
        }
        let complete = |i: usize| i + 1 < count || terminated;
        // The torn line just before the current one, which the current record must repair.
        let mut torn: Option<(usize, &[u8])> = None;
        let mut first_in_file = true;
        let mut i = 0;
        while let Some(line) = lines.next() {
            let ln = i + 1;
            let problem = |kind: Kind, seq: Option<u64>, detail: String| Problem {
                file: name.clone(),
                line: ln,
                seq,
                kind,
                detail,
            };
            // A line the next line repairs is a torn write: skipped, noted.
            if let Some(next) = lines.peek().filter(|_| complete(i + 1)) {
                if let Ok(next) = parse_record(next) {
                    if next.repaired.as_ref().is_some_and(|(n, h)| *n == line.len() as u64 && *h == sha256_hex(line)) {
                        torn = Some((ln, line));
                        i += 1;
                        continue;
                    }
                }
            }
            let parsed = parse_record(line);
            let rec: Record = match parsed {
                Ok(r) if complete(i) => r,
                other => {
                    let p = if !complete(i) {
                        problem(
                            Kind::Truncated,
                            other.ok().map(|r| r.seq),
                            format!(
                                "the last line has no newline ({} bytes): an interrupted write (the next append repairs it) or a cut",
                                line.len()
                            ),
                        )
                    } else {
                        let why = other.err().unwrap_or_default();
                        let kind = if serde_json::from_slice::<serde_json::Value>(line).is_err() {
                            Kind::NotJson
                        } else {
                            Kind::Malformed
                        };
                        problem(kind, None, format!("not an audit record: {why}"))
                    };
                    return Ok(fail(report, summary, p));
                }
            };
            let seq = Some(rec.seq);
            if let Some((n, h)) = &rec.repaired {
                match torn.take() {
                    Some((tl, _)) => report.notes.push(Note {
                        file: name.clone(),
                        line: tl,
                        message: format!(
                            "torn line ({n} bytes, an interrupted write) repaired by line {ln}; sha256 {h}"
                        ),
                    }),
                    None => {
                        let p = problem(
                            Kind::Edited,
                            seq,
                            "the record claims to repair a torn line, but the line before it is not that line".into(),
                        );
                        return Ok(fail(report, summary, p));
                    }
                }
            }
            // A recorded gap is numbered past the records missing.
            if let Some(g) = rec.gap.as_ref().filter(|g| g.to.checked_add(1) != Some(rec.seq)) {
                let d = format!("says seq {}..{} are missing before it, yet is seq {}", g.from, g.to, rec.seq);
                return Ok(fail(report, summary, problem(Kind::Edited, seq, d)));
            }
            // The seq this record follows in the log: its own minus one, or — after a
            // recorded gap — the one before the records missing.
            let follows = rec.gap.as_ref().map_or(rec.seq - 1, |g| g.from - 1);
            match &last {
                None => {
                    let genesis = follows == 0 && rec.prev == GENESIS_PREV && rec.continues.is_none();
                    match &rec.continues {
                        _ if genesis => {}
                        Some((file, cseq)) if *cseq == follows => report.notes.push(Note {
                            file: name.clone(),
                            line: ln,
                            message: format!(
                                "continues seq {cseq}, the last record of the file rotated before it (named {file} \
                                 then), which was not given: verify the files together to check that link"
                            ),
                        }),
                        Some((file, cseq)) => {
                            let p = problem(
                                Kind::Edited,
                                seq,
                                format!("claims to continue seq {cseq} of {file}, yet is seq {}", rec.seq),
                            );
                            return Ok(fail(report, summary, p));
                        }
                        None => {
                            let p = problem(
                                Kind::Removed,
                                seq,
                                "the first record is neither the genesis (seq 1) nor the first record of a rotated \
                                 file: the records before it were removed"
                                    .into(),
                            );
                            return Ok(fail(report, summary, p));
                        }
                    }
                }
                Some(p) => {
                    let at = format!("{}:{}", p.file, p.line);
                    if let Some(g) = rec.gap.as_ref().filter(|g| p.seq.checked_add(1) != Some(g.from)) {
                        let d = format!(
                            "says seq {}..{} are missing before it, but the record before it ({at}) is seq {}",
                            g.from, g.to, p.seq
                        );
                        return Ok(fail(report, summary, problem(Kind::Edited, seq, d)));
                    }
                    if follows < p.seq {
                        let d = format!("seq {} comes after seq {} ({at}): seq must go up by 1", rec.seq, p.seq);
                        return Ok(fail(report, summary, problem(Kind::Reordered, seq, d)));
                    }
                    if follows > p.seq {
                        let (lo, hi) = (p.seq + 1, rec.seq - 1);
                        let gap = if lo == hi { format!("seq {lo}") } else { format!("seq {lo}..{hi}") };
                        let (kind, d) = match seq_later(lines.clone(), fi + 1..names.len(), &read, lo, hi) {
                            Some(s) => (
                                Kind::Reordered,
                                format!(
                                    "seq {} follows seq {} ({at}), but seq {s} comes later in the log",
                                    rec.seq, p.seq
                                ),
                            ),
                            None => {
                                let rotated =
                                    if first_in_file && fi > 0 { " (a whole file may be missing)" } else { "" };
                                (Kind::Removed, format!("{gap} missing between {at} and this record{rotated}"))
                            }
                        };
                        return Ok(fail(report, summary, problem(kind, seq, d)));
                    }
                    if rec.prev != p.hash {
                        let d = format!(
                            "its SHA-256 does not match the prev of the next record ({name}:{ln}): the record (or that \
                             prev) was changed after it was written"
                        );
                        let edited = Problem {
                            file: p.file.clone(),
                            line: p.line,
                            seq: Some(p.seq),
                            kind: Kind::Edited,
                            detail: d,
                        };
                        // The edited record was counted when it was read: it is the problem,
                        // not one of the records verified before it (nor is a gap it records).
                        uncount_last(&mut report, &mut summary, &p.file, p.file == name, p.follows);
                        if p.gap {
                            report.gaps.pop();
                        }
                        report.head = head_before.take();
                        return Ok(fail(report, summary, edited));
                    }
                }
            }
            if let Some(g) = &rec.gap {
                let span = if g.from == g.to { format!("seq {}", g.from) } else { format!("seq {}..{}", g.from, g.to) };
                report.gaps.push(problem(
                    Kind::Removed,
                    seq,
                    format!(
                        "{span} missing: when this record was appended, records up to seq {} had been written (the \
                         last with sha256 {}), but the log no longer held them — its newest file set aside, removed, \
                         emptied or cut short, or the log put back to an older copy",
                        g.to, g.sha256
                    ),
                ));
                report.intact = false;
            }
            // Each rotation's claim replaces the one before; one that makes none (written
            // by an older agent, or the oldest file was unreadable) clears it.
            if rec.continues.is_some() {
                oldest_kept = rec.oldest_kept.map(|n| (n, name.clone(), ln));
            }
            first_in_file = false;
            report.records += 1;
            report.first_seq.get_or_insert(rec.seq);
            report.last_seq = Some(rec.seq);
            summary.records += 1;
            summary.first_seq.get_or_insert(rec.seq);
            summary.last_seq = Some(rec.seq);
            let hash = sha256_hex(line);
            head_before = report.head.replace(hash.clone());
            last = Some(Last { seq: rec.seq, follows, gap: rec.gap.is_some(), hash, file: name.clone(), line: ln });
            i += 1;
        }
        report.files.push(summary);
    }
    if let (true, Some((n, file, line)), Some(first)) = (complete, oldest_kept, report.first_seq) {
        if first > n {
            report.intact = false;
            report.problem = Some(Problem {
                file,
                line,
                seq: None,
                kind: Kind::Removed,
                detail: format!(
                    "the last rotation kept the records from seq {n} on, but the oldest file begins at seq {first}: \
                     seq {n}..{} missing (a rotated file was removed other than by a rotation)",
                    first - 1
                ),
            });
        }
    }
    Ok(report)
}

/// The high-water marks in the lock file of the log at `path` ([`super::high_water`]), or
/// why they cannot be read.
pub fn marks_of(path: &Path) -> Result<super::high_water::Marks, String> {
    let lock = super::lock_path(path);
    crate::bounded::open_regular_nofollow(&lock, std::fs::OpenOptions::new().read(true))
        .map(|f| super::high_water::read(&f))
        .map_err(|e| format!("{}: {e}", lock.display()))
}

/// Check the end of the configured log (`path`, whose files `report` verified whole) against
/// its lock file's high-water `marks`, read before its files were listed (so that they name
/// only records already written to them): records a mark names past the log's last are
/// missing from its end — cut off, the newest file set aside, removed or emptied, or the log
/// put back to an older copy — before any append has recorded the gap. Judged by the rule
/// the appender records it by ([`super::high_water::Marks::missing_after`]) and reported as
/// it will record it (`removed`, in `gaps`; not intact), at the last line of the newest file
/// verified. Only on a chain otherwise intact:
/// a problem's report stops before the log's end. Marks that cannot be read are a note.
pub fn against_marks(report: &mut VerifyReport, path: &Path, marks: Result<super::high_water::Marks, String>) {
    if report.problem.is_some() {
        return;
    }
    let (file, lines) = report.files.last().map_or((String::new(), 0), |s| (s.path.clone(), s.lines));
    let marks = match marks {
        Ok(m) => m,
        Err(e) => {
            return report.notes.push(Note {
                file,
                line: lines,
                message: format!("the log's end was not checked against its high-water marks: {e}"),
            })
        }
    };
    let newest_holds_records =
        report.files.last().is_some_and(|s| s.path == path.display().to_string() && s.records > 0);
    let last = report.last_seq.unwrap_or(0);
    let Some(m) = marks.missing_after(last, newest_holds_records) else { return };
    let from = last + 1;
    let span = if from == m.seq { format!("seq {from}") } else { format!("seq {from}..{}", m.seq) };
    report.gaps.push(Problem {
        file,
        line: lines,
        seq: None,
        kind: Kind::Removed,
        detail: format!(
            "{span} missing at the end of the log: its lock file's high-water marks say records up to seq {} were \
             written (the last with sha256 {}{}), but the log ends at seq {last} — cut off its end, its newest file \
             ({}) set aside, removed or emptied, or the log put back to an older copy; the next append records the gap",
            m.seq,
            m.sha256,
            marks.durable.as_ref().map(|d| format!("; up to seq {} durable", d.seq)).unwrap_or_default(),
            path.display()
        ),
    });
    report.intact = false;
}

/// Take the last record counted — in `file` — back out of the report's counts, and out of
/// that file's summary (`summary` when `in_summary`): the record counted before it is seq
/// `follows` (seqs go up by one across what was counted, but for a recorded gap).
fn uncount_last(report: &mut VerifyReport, summary: &mut FileSummary, file: &str, in_summary: bool, follows: u64) {
    let back = |records: &mut u64, first: &mut Option<u64>, last: &mut Option<u64>| {
        *records = records.saturating_sub(1);
        if *records == 0 {
            (*first, *last) = (None, None);
        } else {
            *last = Some(follows);
        }
    };
    back(&mut report.records, &mut report.first_seq, &mut report.last_seq);
    if in_summary {
        back(&mut summary.records, &mut summary.first_seq, &mut summary.last_seq);
    } else if let Some(f) = report.files.iter_mut().rev().find(|f| f.path == file) {
        // The file that holds it (an empty file may lie between it and this one).
        back(&mut f.records, &mut f.first_seq, &mut f.last_seq);
    }
}

fn fail(mut report: VerifyReport, summary: FileSummary, problem: Problem) -> VerifyReport {
    report.files.push(summary);
    report.intact = false;
    report.problem = Some(problem);
    report
}

/// A seq in `lo..=hi` among the rest of this file's lines or in the later files.
fn seq_later<'a, 'r, E>(
    mut rest: impl Iterator<Item = &'r [u8]>,
    later: std::ops::Range<usize>,
    read: &impl Fn(usize) -> Result<std::borrow::Cow<'a, [u8]>, E>,
    lo: u64,
    hi: u64,
) -> Option<u64> {
    let find = |lines: &mut dyn Iterator<Item = &[u8]>| {
        lines.filter_map(|l| parse_record(l).ok()).map(|r| r.seq).find(|s| (lo..=hi).contains(s))
    };
    if let Some(s) = find(&mut rest) {
        return Some(s);
    }
    for f in later {
        let Ok(bytes) = read(f) else { continue };
        if let Some(s) = find(&mut lines_of(&bytes).lines) {
            return Some(s);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::tests::{append, Scratch};
    use super::super::{AuditLog, AuditSettings};
    use super::*;

    fn log_with(n: usize) -> (Scratch, PathBuf) {
        let s = Scratch::new("verify");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        append(&log, n);
        let p = s.log();
        (s, p)
    }

    fn lines(p: &Path) -> Vec<String> {
        std::fs::read_to_string(p).unwrap().lines().map(str::to_string).collect()
    }

    fn write(p: &Path, lines: &[String]) {
        std::fs::write(p, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    }

    fn problem(p: &Path) -> Problem {
        let r = verify(&[p.to_path_buf()]).unwrap();
        assert!(!r.intact);
        r.problem.unwrap()
    }

    #[test]
    fn a_rotated_file_removed_other_than_by_a_rotation_is_found() {
        let s = Scratch::new("oldest");
        let mut settings = AuditSettings::at(&s.log());
        (settings.max_bytes, settings.keep) = (1024, 3);
        let log = AuditLog::open(settings).unwrap();
        // Enough rotations that some files were dropped by rotation (retention).
        append(&log, 60);
        let files = chain_files(&s.log()).unwrap();
        assert_eq!(files.len(), 4, "{files:?}");
        let r = verify_all(&files).unwrap();
        assert!(r.intact, "{r:?}");
        assert!(r.first_seq.unwrap() > 1, "retention dropped the first records: {r:?}");
        // The oldest kept file removed: the chain of the rest is intact, but the last
        // rotation's claim of where the kept history begins is not met.
        std::fs::remove_file(&files[0]).unwrap();
        let rest = chain_files(&s.log()).unwrap();
        assert!(verify(&rest).unwrap().intact, "a part of the log verifies on its own");
        let r = verify_all(&rest).unwrap();
        let p = r.problem.expect("removed");
        assert_eq!(p.kind, Kind::Removed, "{p:?}");
        assert!(p.detail.contains("rotated file was removed"), "{}", p.detail);
    }

    #[test]
    fn a_continuation_of_the_largest_seq_is_a_problem_not_an_overflow() {
        let (_s, p) = log_with(1);
        let mut rec: serde_json::Value = serde_json::from_str(&lines(&p)[0]).unwrap();
        rec["continues"] = serde_json::json!({"file": "audit.jsonl.1", "seq": u64::MAX});
        rec["prev"] = serde_json::json!("ab".repeat(32));
        let text = format!("{rec}\n");
        let r = verify_bytes(&[("audit.jsonl", text.as_bytes())]);
        assert!(!r.intact, "{r:?}");
    }

    /// A file of newlines only is `not_json` at line 1, found without first making a list of
    /// its lines: before, 16 bytes were allocated per line (1 GiB of `\n` → 16 GiB). Checked
    /// in a child process of this test binary whose data (heap, private mappings) is capped
    /// at 1 GiB by `RLIMIT_DATA`: 128 MiB of `\n` fits, a list of its lines (2 GiB) does not.
    #[test]
    fn a_file_of_newlines_is_not_json_at_line_1_without_a_list_of_its_lines() {
        const CHILD: &str = "OPSERVANT_TEST_NEWLINES_CHILD";
        const NAME: &str = "audit::verify::tests::a_file_of_newlines_is_not_json_at_line_1_without_a_list_of_its_lines";
        if std::env::var_os(CHILD).is_some() {
            let bytes = vec![b'\n'; 128 << 20];
            let r = verify_bytes(&[("audit.jsonl", &bytes)]);
            let p = r.problem.expect("broken");
            assert_eq!((p.line, p.kind), (1, Kind::NotJson), "{p:?}");
            assert_eq!(r.files[0].lines, 128 << 20);
            return;
        }
        use std::os::unix::process::CommandExt;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child.args(["--exact", NAME, "--test-threads", "1"]).env(CHILD, "1");
        // SAFETY: between fork and exec only setrlimit runs, a system call (async-signal-safe).
        unsafe {
            child.pre_exec(|| {
                let limit = libc::rlimit { rlim_cur: 1 << 30, rlim_max: 1 << 30 };
                match libc::setrlimit(libc::RLIMIT_DATA, &limit) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            });
        }
        let out = child.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{:?}: {stdout}{}", out.status, String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("1 passed"), "the child ran this test: {stdout}");
    }

    /// A recorded gap (the writer's, [`super::super::Gap`]) makes the log not intact, is
    /// reported where it is recorded, and the check goes on past it: a problem after it is
    /// still found. A gap record the writer could not have written is a problem itself.
    #[test]
    fn a_recorded_gap_is_reported_and_the_chain_is_checked_past_it() {
        let s = Scratch::new("verify-gap");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        let before = append(&log, 3);
        std::fs::rename(s.log(), s.0.join("set-aside")).unwrap();
        append(&log, 4);
        let p = s.log();
        let r = verify(std::slice::from_ref(&p)).unwrap();
        assert!(!r.intact && r.problem.is_none(), "{r:?}");
        assert_eq!((r.records, r.first_seq, r.last_seq), (4, Some(4), Some(7)));
        assert_eq!(r.gaps.len(), 1, "{r:?}");
        let g = &r.gaps[0];
        assert_eq!((g.kind, g.line, g.seq), (Kind::Removed, 1, Some(4)), "{g:?}");
        assert!(g.detail.starts_with("seq 1..3 missing"), "{}", g.detail);
        assert!(g.detail.contains(&before[2].sha256), "{}", g.detail);
        let text = r.render();
        assert!(text.starts_with(&format!("{}:1: removed (seq 4): seq 1..3 missing", p.display())), "{text}");
        assert!(
            text.contains("chain intact but for the records missing above (a gap: NOT INTACT): 4 records"),
            "{text}"
        );
        // An edit after the gap is found, with the gap still reported.
        let good = lines(&p);
        let mut l = good.clone();
        l[2] = l[2].replace("\"i\":\"2\"", "\"i\":\"9\"");
        assert_ne!(l[2], good[2]);
        write(&p, &l);
        let r = verify(std::slice::from_ref(&p)).unwrap();
        let pr = r.problem.clone().expect("the edit after the gap");
        assert_eq!((pr.kind, pr.line, r.gaps.len()), (Kind::Edited, 3, 1), "{r:?}");
        // Forged gaps: numbered other than after the records they say are missing; not
        // following the record before them.
        let forge = |line: usize, gap: serde_json::Value| {
            let mut l = good.clone();
            let mut rec: serde_json::Value = serde_json::from_str(&l[line]).unwrap();
            rec["gap"] = gap;
            l[line] = rec.to_string();
            verify_bytes(&[("audit.jsonl", l.iter().map(|x| format!("{x}\n")).collect::<String>().as_bytes())])
        };
        let h = "ab".repeat(32);
        for (line, gap, want) in [
            (1, serde_json::json!({"from": 5, "to": 4, "sha256": h}), "'gap' is not"),
            (1, serde_json::json!({"from": 5, "to": 5, "sha256": h}), "yet is seq 5"),
            (1, serde_json::json!({"from": 4, "to": 4, "sha256": h}), "the record before it"),
            (0, serde_json::json!({"from": 1, "to": 2, "sha256": h}), "yet is seq 4"),
            (0, serde_json::json!({"from": 2, "to": 3, "sha256": h}), "neither the genesis"),
        ] {
            let r = forge(line, gap.clone());
            let pr = r.problem.unwrap_or_else(|| panic!("{gap}: {:?}", r.gaps));
            assert!(pr.detail.contains(want), "{gap}: {pr:?}");
        }
    }

    /// An edited record that recorded a gap: the problem is the edit, the gap it claims is
    /// not reported, and the records verified before it end at the one before the gap.
    #[test]
    fn an_edited_gap_record_is_uncounted_with_its_gap() {
        let s = Scratch::new("verify-edited-gap");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        append(&log, 6);
        let p = s.log();
        write(&p, &lines(&p)[..3]);
        append(&log, 3);
        let good = lines(&p);
        assert!(good[3].contains("\"gap\":{\"from\":4,\"to\":6,"), "{}", good[3]);
        let mut l = good.clone();
        l[3] = l[3].replace("\"i\":\"0\"", "\"i\":\"9\"");
        assert_ne!(l[3], good[3]);
        write(&p, &l);
        let r = verify(std::slice::from_ref(&p)).unwrap();
        let pr = r.problem.clone().expect("the edit");
        assert_eq!((pr.kind, pr.line, pr.seq), (Kind::Edited, 4, Some(7)), "{r:?}");
        assert!(r.gaps.is_empty(), "{r:?}");
        assert_eq!((r.records, r.first_seq, r.last_seq), (3, Some(1), Some(3)), "{r:?}");
        assert_eq!((r.files[0].records, r.files[0].last_seq), (3, Some(3)), "{r:?}");
    }

    /// The configured log's end against its lock file's marks: records cut off its end, or
    /// its newest file set aside, are missing before any append records the gap; an intact
    /// log, and a rotation cut short, are not.
    #[test]
    fn the_logs_end_is_checked_against_its_marks() {
        let whole = |p: &Path| {
            let marks = marks_of(p);
            let mut r = verify_all(&chain_files(p).unwrap()).unwrap();
            against_marks(&mut r, p, marks);
            r
        };
        let (s, p) = log_with(5);
        let r = whole(&p);
        assert!(r.intact && r.gaps.is_empty(), "{r:?}");
        // Marks read before the files name only records in them: an append in between (a
        // busy log) is no gap.
        let log = AuditLog::open(AuditSettings::at(&p)).unwrap();
        let marks = marks_of(&p);
        append(&log, 1);
        let mut r = verify_all(&chain_files(&p).unwrap()).unwrap();
        against_marks(&mut r, &p, marks);
        assert!(r.intact, "{r:?}");
        // Marks that cannot be read: a note, and the chain's verdict stands.
        let mut r = verify_all(&chain_files(&p).unwrap()).unwrap();
        against_marks(&mut r, &p, Err("no lock file".into()));
        assert!(r.intact && r.notes.iter().any(|n| n.message.contains("not checked against its high-water marks")));
        write(&p, &lines(&p)[..3]);
        assert!(verify(std::slice::from_ref(&p)).unwrap().intact, "the chain alone does not show the cut");
        let r = whole(&p);
        assert!(!r.intact && r.problem.is_none(), "{r:?}");
        let g = &r.gaps[0];
        assert_eq!((g.kind, g.line, &g.file), (Kind::Removed, 3, &p.display().to_string()), "{g:?}");
        assert!(
            g.detail.starts_with("seq 4..6 missing at the end of the log") && g.detail.contains("durable"),
            "{g:?}"
        );
        drop(s);

        // A rotated log: its newest file set aside; then a rotation cut short (no gap).
        let s = Scratch::new("marks-rotated");
        let mut settings = AuditSettings::at(&s.log());
        (settings.max_bytes, settings.keep) = (1024, 4);
        let log = AuditLog::open(settings.clone()).unwrap();
        while !settings.rotated(1).exists() || lines(&s.log()).len() < 2 {
            append(&log, 1);
        }
        let aside = s.0.join("aside");
        std::fs::rename(s.log(), &aside).unwrap();
        let r = whole(&s.log());
        assert_eq!(r.gaps.len(), 1, "{r:?}");
        assert!(r.gaps[0].detail.contains("missing at the end of the log") && r.gaps[0].detail.contains("written"));
        std::fs::rename(&aside, s.log()).unwrap();
        assert!(whole(&s.log()).intact);
        log.rotate().unwrap();
        assert!(!s.log().exists());
        let r = whole(&s.log());
        assert!(r.intact, "a rotation cut short after its rename: {r:?}");
    }

    #[test]
    fn intact_log_verifies() {
        let (_s, p) = log_with(5);
        let r = verify(std::slice::from_ref(&p)).unwrap();
        assert!(r.intact, "{}", r.render());
        assert_eq!((r.records, r.first_seq, r.last_seq), (5, Some(1), Some(5)));
        assert_eq!(r.head.as_deref(), Some(sha256_hex(lines(&p)[4].as_bytes()).as_str()));
        assert!(r.render().starts_with("chain intact: 5 records in 1 file (seq 1..5)"), "{}", r.render());
    }

    #[test]
    fn an_edited_field_is_reported_at_the_edited_line() {
        let (_s, p) = log_with(5);
        let mut l = lines(&p);
        l[2] = l[2].replace("\"i\":\"2\"", "\"i\":\"9\"");
        write(&p, &l);
        let pr = problem(&p);
        assert_eq!((pr.kind, pr.line, pr.seq), (Kind::Edited, 3, Some(3)), "{pr:?}");
        // What was verified before it: records 1 and 2, the head is record 2's (the edited
        // record had been counted among them, "3 records verified before it (seq 1..3)").
        let r = verify(std::slice::from_ref(&p)).unwrap();
        assert_eq!((r.records, r.first_seq, r.last_seq), (2, Some(1), Some(2)), "{}", r.render());
        assert_eq!((r.files[0].records, r.files[0].last_seq), (2, Some(2)));
        assert_eq!(r.head.as_deref(), Some(sha256_hex(l[1].as_bytes()).as_str()));
        assert!(r.render().contains("chain BROKEN; 2 records verified before it (seq 1..2)"), "{}", r.render());
        // The first record edited: none verified before it.
        let mut l = lines(&p);
        l[2] = l[2].replace("\"i\":\"9\"", "\"i\":\"2\"");
        l[0] = l[0].replace("\"i\":\"0\"", "\"i\":\"7\"");
        write(&p, &l);
        let r = verify(std::slice::from_ref(&p)).unwrap();
        assert_eq!(r.problem.as_ref().map(|p| (p.kind, p.line)), Some((Kind::Edited, 1)), "{}", r.render());
        assert_eq!((r.records, r.first_seq, r.last_seq, r.head.as_deref()), (0, None, None, None), "{}", r.render());
    }

    #[test]
    fn a_deleted_record_is_reported_where_it_was() {
        let (_s, p) = log_with(5);
        let mut l = lines(&p);
        l.remove(1);
        write(&p, &l);
        let pr = problem(&p);
        assert_eq!((pr.kind, pr.line, pr.seq), (Kind::Removed, 2, Some(3)), "{pr:?}");
        assert!(pr.detail.contains("seq 2 missing"), "{}", pr.detail);
    }

    #[test]
    fn swapped_records_are_reordered() {
        let (_s, p) = log_with(5);
        let mut l = lines(&p);
        l.swap(2, 3);
        write(&p, &l);
        let pr = problem(&p);
        assert_eq!((pr.kind, pr.line, pr.seq), (Kind::Reordered, 3, Some(4)), "{pr:?}");
        // The last two swapped: seq goes backwards at the last line.
        let (_s, p) = log_with(5);
        let mut l = lines(&p);
        l.swap(3, 4);
        write(&p, &l);
        let pr = problem(&p);
        assert_eq!((pr.kind, pr.line), (Kind::Reordered, 4), "{pr:?}");
    }

    #[test]
    fn truncated_and_garbage_lines() {
        let (_s, p) = log_with(3);
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, &text[..text.len() - 20]).unwrap();
        let pr = problem(&p);
        assert_eq!((pr.kind, pr.line), (Kind::Truncated, 3), "{pr:?}");
        // Only the newline gone: still an unacknowledged write.
        std::fs::write(&p, &text[..text.len() - 1]).unwrap();
        assert_eq!(problem(&p).kind, Kind::Truncated);
        let mut l = lines(&p);
        l.insert(1, "hello".into());
        write(&p, &l);
        assert_eq!((problem(&p).kind, problem(&p).line), (Kind::NotJson, 2));
        let mut l = lines(&p);
        l[1] = "{\"seq\":2}".into();
        write(&p, &l);
        assert_eq!((problem(&p).kind, problem(&p).line), (Kind::Malformed, 2));
    }

    #[test]
    fn a_removed_head_is_reported() {
        let (_s, p) = log_with(4);
        let mut l = lines(&p);
        l.remove(0);
        write(&p, &l);
        let pr = problem(&p);
        assert_eq!((pr.kind, pr.line, pr.seq), (Kind::Removed, 1, Some(2)), "{pr:?}");
    }

    #[test]
    fn a_repair_verifies_and_is_noted_but_cannot_hide_a_deletion() {
        let s = Scratch::new("repair");
        let log = AuditLog::open(AuditSettings::at(&s.log())).unwrap();
        append(&log, 3);
        std::fs::OpenOptions::new()
            .append(true)
            .open(s.log())
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"seq\":4,\"ts"))
            .unwrap();
        assert_eq!(problem(&s.log()).kind, Kind::Truncated);
        append(&log, 2);
        let r = verify(&[s.log()]).unwrap();
        assert!(r.intact, "{}", r.render());
        assert_eq!((r.records, r.last_seq), (5, Some(5)));
        assert!(r.notes.iter().any(|n| n.line == 4 && n.message.contains("torn line")), "{:?}", r.notes);

        // Turning a complete middle record into a "torn" one needs the next record rewritten
        // as its repair, which breaks the record after that.
        let mut l = lines(&s.log());
        let victim = l[1].clone(); // seq 2
        let rec3 = parse_record(l[2].as_bytes()).unwrap();
        let forged = l[2]
            .replace(&format!("\"prev\":\"{}\"", rec3.prev), &format!("\"prev\":\"{}\"", sha256_hex(l[0].as_bytes())))
            .replace("\"seq\":3,", "\"seq\":2,")
            .replace(
                ",\"prev\"",
                &format!(
                    ",\"repaired\":{{\"bytes\":{},\"sha256\":\"{}\"}},\"prev\"",
                    victim.len(),
                    sha256_hex(victim.as_bytes())
                ),
            );
        l[2] = forged;
        write(&s.log(), &l);
        let pr = problem(&s.log());
        assert!(matches!(pr.kind, Kind::Edited | Kind::Reordered | Kind::Removed), "{pr:?}");
        assert!(pr.line >= 3, "{pr:?}");

        // A repair marker with no torn line before it is an edit.
        let (_s2, p) = log_with(3);
        let mut l = lines(&p);
        l[2] = l[2].replace(
            ",\"prev\"",
            &format!(",\"repaired\":{{\"bytes\":3,\"sha256\":\"{}\"}},\"prev\"", "ab".repeat(32)),
        );
        write(&p, &l);
        let pr = problem(&p);
        assert_eq!((pr.kind, pr.line), (Kind::Edited, 3), "{pr:?}");
    }

    /// 30 records in a log rotated at 1 KiB (several files, 10 kept): the scratch, the
    /// settings and the chain's files, oldest first.
    fn rotated_log(name: &str) -> (Scratch, AuditSettings, Vec<PathBuf>) {
        let s = Scratch::new(name);
        let mut settings = AuditSettings::at(&s.log());
        settings.max_bytes = 1024;
        settings.keep = 10;
        let log = AuditLog::open(settings.clone()).unwrap();
        append(&log, 30);
        let files = chain_files(&s.log()).unwrap();
        (s, settings, files)
    }

    #[test]
    fn rotated_files_verify_together_and_alone_with_a_note() {
        let (s, settings, files) = rotated_log("rot");
        assert!(files.len() >= 4, "{files:?}");
        assert_eq!(files.last(), Some(&s.log()));
        let r = verify(&files).unwrap();
        assert!(r.intact, "{}", r.render());
        assert_eq!((r.records, r.first_seq, r.last_seq), (30, Some(1), Some(30)));
        // One rotated file alone: a note, not an error.
        let r = verify(&[s.log()]).unwrap();
        assert!(r.intact, "{}", r.render());
        assert!(r.notes[0].message.contains("continues seq"), "{:?}", r.notes);
        // A middle file removed: its records are missing at the next file's first line.
        std::fs::remove_file(settings.rotated(2)).unwrap();
        let files = chain_files(&s.log()).unwrap();
        let r = verify(&files).unwrap();
        let pr = r.problem.unwrap();
        assert_eq!((pr.kind, pr.line), (Kind::Removed, 1), "{pr:?}");
        assert_eq!(pr.file, settings.rotated(1).display().to_string());
        // Files given out of order: reordered.
        let mut files = chain_files(&s.log()).unwrap();
        files.swap(0, 1);
        let pr = verify(&files).unwrap().problem.unwrap();
        assert!(matches!(pr.kind, Kind::Reordered | Kind::Removed), "{pr:?}");
    }

    /// The last record of a rotated file edited, found at the next non-empty file's first
    /// line, with an empty file given between them: the edited record is taken out of its own
    /// file's count (the empty file's summary, the last one pushed, holds nothing to take).
    #[test]
    fn an_edited_last_record_is_uncounted_from_its_own_file_across_an_empty_one() {
        let (s, _, files) = rotated_log("rotedit");
        assert!(files.len() >= 3, "{files:?}");
        let intact = verify(&files).unwrap();
        let in_oldest = intact.files[0].records;
        assert!(in_oldest >= 2, "{}", intact.render());
        let mut l = lines(&files[0]);
        let last = l.len() - 1;
        l[last] = l[last].replacen("\"i\":\"", "\"i\":\"9", 1);
        assert_ne!(l[last], lines(&files[0])[last], "the record was edited");
        write(&files[0], &l);
        let empty = s.log().with_file_name("empty.jsonl");
        std::fs::write(&empty, b"").unwrap();
        let given = [files[0].clone(), empty.clone(), files[1].clone()];
        let r = verify(&given).unwrap();
        let pr = r.problem.as_ref().unwrap();
        assert_eq!(
            (pr.kind, pr.file.as_str(), pr.line),
            (Kind::Edited, files[0].display().to_string().as_str(), last + 1),
            "{}",
            r.render()
        );
        assert_eq!(r.records, in_oldest - 1, "{}", r.render());
        assert_eq!((r.files[0].records, r.files[1].records), (in_oldest - 1, 0), "{}", r.render());
        assert_eq!(r.files[0].last_seq, intact.files[0].last_seq.map(|s| s - 1), "{}", r.render());
    }

    #[test]
    fn bytes_and_files_verify_alike() {
        let (_s, p) = log_with(4);
        let bytes = std::fs::read(&p).unwrap();
        let from_file = verify(std::slice::from_ref(&p)).unwrap();
        let name = p.display().to_string();
        let from_bytes = verify_bytes(&[(&name, &bytes)]);
        assert!(from_bytes.intact, "{}", from_bytes.render());
        assert_eq!(from_bytes.render(), from_file.render());
        // Split into a rotated file and the live one, as the records go.
        let cut = bytes.iter().enumerate().filter(|(_, b)| **b == b'\n').nth(1).unwrap().0 + 1;
        let two = verify_bytes(&[("a.1", &bytes[..cut]), ("a", &bytes[cut..])]);
        assert!(two.intact && two.records == 4, "{}", two.render());
        // Hostile lines are problems at their line, not crashes.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        for line in [deep.as_bytes(), &b"\xff\xfe{}"[..]] {
            let mut b = bytes.clone();
            b.extend_from_slice(line);
            b.push(b'\n');
            let r = verify_bytes(&[("a", &b)]);
            let pr = r.problem.unwrap();
            assert_eq!((pr.kind, pr.line), (Kind::NotJson, 5), "{pr:?}");
        }
    }

    #[test]
    fn a_file_larger_than_any_log_is_refused_unread() {
        let s = Scratch::new("huge");
        let f = std::fs::File::create(s.log()).unwrap();
        f.set_len(MAX_FILE_BYTES + 1).unwrap(); // sparse: nothing is written
        let e = verify(&[s.log()]).unwrap_err();
        assert!(e.message.contains("more than the"), "{e}");
    }
}
