//! `opservant audit verify [FILE…] [--json]` and `opservant audit tail [-n N] [--follow]
//! [--json]`: the operator's view of the log. Both only read it, without a lock, so neither
//! delays an append — except that `verify` confirms a problem it found by a second pass under
//! a shared lock (an append or rotation running meanwhile must not be reported as tampering);
//! `--config` (default `$OPSERVANT_CONFIG`, else `/etc/opservant/config.yaml` when it exists)
//! says where the log is.
//!
//! Guarantees: `verify` exits 0 only when every given file verifies as one chain — and, for
//! the configured log, when its end is where its lock file's high-water marks say
//! ([`super::verify::against_marks`]; a lock file it cannot read is a note) —, 1 with the
//! first problem as `FILE:LINE: KIND …` on stdout's first line (or in the JSON's `problem`,
//! or `gaps` for records missing),
//! and 2 (an error returned to the caller) when a file cannot be read. `tail` prints only
//! complete lines; an unfinished last line waits for its `\n` under `--follow`. Memory is
//! bounded on any log: both refuse a file larger than [`MAX_FILE_BYTES`] before reading it
//! (exit 2), neither builds a list of a file's lines, and `tail --follow` reads a chunk at a
//! time and holds at most [`MAX_PENDING`] bytes of a line still waiting for its `\n`.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use serde_json::Value;
use thiserror::Error;

use super::verify::{against_marks, chain_files, lines_of, marks_of, too_large, verify, verify_all, MAX_FILE_BYTES};
use super::{summary, AuditError, AuditSettings};
use crate::config::{Config, ConfigError};

#[derive(Debug, clap::Subcommand)]
pub enum AuditCommand {
    /// Check the hash chain of the audit log. Exit 0 when intact, 1 with the first broken,
    /// removed or reordered record (FILE:LINE: KIND), 2 when a file cannot be read.
    Verify {
        /// Log files in chain order, oldest first (default: the configured log and its rotated
        /// files, e.g. audit.jsonl.2 audit.jsonl.1 audit.jsonl).
        files: Vec<PathBuf>,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
        /// Agent configuration naming the log (default $OPSERVANT_CONFIG, else
        /// /etc/opservant/config.yaml when it exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print the last records of the audit log.
    Tail {
        /// How many records.
        #[arg(short = 'n', long = "lines", default_value_t = 10)]
        lines: usize,
        /// Keep printing records as they are appended (across rotations).
        #[arg(short = 'f', long)]
        follow: bool,
        /// Print the stored JSON lines as they are: to a pipe or a file byte for byte; to a
        /// terminal with their control characters (which no line the agent writes holds) escaped.
        #[arg(long)]
        json: bool,
        /// Agent configuration naming the log (default $OPSERVANT_CONFIG, else
        /// /etc/opservant/config.yaml when it exists).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[derive(Debug, Error)]
pub enum CliError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Audit(#[from] AuditError),
    #[error("{0}")]
    Output(String),
}

pub fn main(command: AuditCommand) -> Result<ExitCode, CliError> {
    match command {
        AuditCommand::Verify { files, json, config } => {
            let configured_settings = if files.is_empty() { Some(settings(config.as_deref())?) } else { None };
            let lock_wait = configured_settings
                .as_ref()
                .map_or(std::time::Duration::from_secs(super::DEFAULT_LOCK_WAIT_SECONDS), |s| s.lock_wait);
            let configured = configured_settings.map(|s| s.path);
            // The configured log is checked whole (its oldest file must begin where the
            // last rotation said); files given by name may be any consecutive part of it.
            // Its end is checked against the lock file's high-water marks too, read before
            // the files are listed: a mark then names only records already in them (an
            // append landing while the files are read would otherwise send every verify of
            // a busy log to the locked pass below).
            let check = || match &configured {
                Some(path) => {
                    let marks = marks_of(path);
                    let mut r = verify_all(&chain_files(path)?)?;
                    against_marks(&mut r, path, marks);
                    Ok(r)
                }
                None => verify(&files),
            };
            let first = check();
            // Verification takes no lock, so an append or a rotation running meanwhile can
            // look like a torn line, a missing record or a vanished file. A problem is
            // therefore confirmed by a second pass under a shared lock (appenders wait for
            // it; only a broken or unreadable log costs it).
            let live = configured.clone().or_else(|| files.last().cloned()).map(|p| super::lock_path(&p));
            let report = match (first, live.filter(|l| l.exists())) {
                (Ok(r), _) if r.intact => r,
                (first, None) => first?,
                (_, Some(lock)) => {
                    // Opened as the writers open it: a regular file, never through a link,
                    // never blocking on a FIFO.
                    let f = crate::bounded::open_regular_nofollow(&lock, std::fs::OpenOptions::new().read(true))
                        .map_err(|e| AuditError::new(&lock, e))?;
                    let _shared = super::lock::shared(f, &lock, lock_wait).map_err(|e| {
                        AuditError::new(&lock, format!("{e}; the problem found could not be confirmed"))
                    })?;
                    check()?
                }
            };
            let text = if json {
                serde_json::to_string(&report).map_err(|e| CliError::Output(e.to_string()))? + "\n"
            } else {
                report.render()
            };
            // A reader that went away does not change the verdict; a failing stdout is an error.
            crate::stdout::print(&text).map_err(|e| CliError::Output(e.to_string()))?;
            Ok(if report.intact { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        AuditCommand::Tail { lines, follow, json, config } => {
            tail(&settings(config.as_deref())?.path, lines, follow, json)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn settings(config: Option<&Path>) -> Result<AuditSettings, CliError> {
    Ok(AuditSettings::from_config(&Config::load(config)?))
}

/// One stored line for a terminal: the line (`--json`) or `TS  #SEQ  EVENT k=v…`. Never a
/// raw control character (ESC, BEL, DEL, a C1 control such as CSI, a newline, …): whatever
/// the line holds — its event, a field's key, `ts`, `continues.file` of a tampered record,
/// or a line that is not JSON at all — is written as one line with control characters
/// escaped (`\u{1b}`; a newline becomes a space; [`crate::one_terminal_line`]), so a log
/// cannot drive the reader's terminal. JSON escapes C0 controls inside strings but not DEL
/// or C1, so a line holding those is shown changed; `--json` into a pipe or a file is the
/// stored bytes instead ([`emit`]).
fn render(line: &[u8], json: bool) -> String {
    if json {
        return crate::one_terminal_line(&String::from_utf8_lossy(line));
    }
    let v: Value = serde_json::from_slice(line).unwrap_or(Value::Null);
    let (Some(ts), Some(seq), Some(event), Some(fields)) =
        (v["ts"].as_str(), v["seq"].as_u64(), v["event"].as_str(), v["fields"].as_object())
    else {
        return format!("(not an audit record: {} bytes)", line.len());
    };
    let mut s = format!("{ts}  #{seq}  {}", summary(event, fields));
    if let (Some(f), Some(n)) = (v["continues"]["file"].as_str(), v["continues"]["seq"].as_u64()) {
        s.push_str(&format!("  [continues {f} #{n}]"));
    }
    if let (Some(from), Some(to)) = (v["gap"]["from"].as_u64(), v["gap"]["to"].as_u64()) {
        s.push_str(&format!("  [RECORDS MISSING before it: #{from}..#{to}]"));
    }
    if let Some(n) = v["repaired"]["bytes"].as_u64() {
        s.push_str(&format!("  [repaired a torn line of {n} bytes]"));
    }
    crate::one_terminal_line(&s)
}

/// `Ok(false)` when the reader is gone (a closed pipe ends `tail` quietly); another write
/// error (e.g. a full disk behind stdout) is an error.
fn emit(out: &mut impl Write, lines: &[&[u8]], json: bool) -> Result<bool, CliError> {
    let failed = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::BrokenPipe => Ok(false),
        _ => Err(CliError::Output(crate::stdout::StdoutError(e).to_string())),
    };
    // `--json` for a program (stdout not a terminal): the stored bytes, so that a line can
    // be hashed and compared with journald's copy; for a terminal, rendered safe.
    let as_stored = json && !std::io::IsTerminal::is_terminal(&std::io::stdout());
    for l in lines {
        let written = if as_stored {
            out.write_all(l).and_then(|()| out.write_all(b"\n"))
        } else {
            writeln!(out, "{}", render(l, json))
        };
        if let Err(e) = written {
            return failed(e);
        }
    }
    out.flush().map_or_else(failed, |()| Ok(true))
}

fn io_at(p: &Path) -> impl FnOnce(std::io::Error) -> AuditError + '_ {
    move |e| AuditError::new(p, e)
}

/// The most of a line without its `\n` that `tail --follow` holds while it waits for the
/// rest: far more than any record (see [`super::MAX_RECORD_BYTES`]); a longer one is not a
/// line the agent writes, and ends `tail` with an error.
const MAX_PENDING: u64 = super::MAX_RECORD_BYTES;
/// How much `tail --follow` reads at a time.
const CHUNK: u64 = 1 << 20;

/// Append at most `max` bytes of what `f` holds past `offset` to `pending`; how many.
fn read_more(f: &mut std::fs::File, offset: &mut u64, pending: &mut Vec<u8>, max: u64) -> std::io::Result<u64> {
    use std::io::{Read, Seek, SeekFrom};
    f.seek(SeekFrom::Start(*offset))?;
    let n = f.take(max).read_to_end(pending)? as u64;
    *offset += n;
    Ok(n)
}

/// The last `n` complete lines of `bytes` (a last piece without `\n` is not one), oldest
/// first, found from the end without a list of them all.
fn last_lines(bytes: &[u8], n: usize) -> Vec<Vec<u8>> {
    let l = lines_of(bytes);
    let mut out: Vec<Vec<u8>> = l.lines.rev().skip(usize::from(!l.terminated)).take(n).map(<[u8]>::to_vec).collect();
    out.reverse();
    out
}

/// Print the complete lines `f` holds past `offset`, a chunk at a time ([`CHUNK`]); a line
/// still without its `\n` stays in `pending`, at most [`MAX_PENDING`] bytes (more is an
/// error). `Ok(false)` when the reader is gone.
fn print_new(
    out: &mut impl Write,
    f: &mut std::fs::File,
    offset: &mut u64,
    pending: &mut Vec<u8>,
    json: bool,
    path: &Path,
) -> Result<bool, CliError> {
    loop {
        let n = read_more(f, offset, pending, CHUNK).map_err(io_at(path))?;
        let lines = take_complete(pending);
        let refs: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
        if !emit(out, &refs, json)? {
            return Ok(false);
        }
        if pending.len() as u64 > MAX_PENDING {
            let m = format!(
                "a line of more than {MAX_PENDING} bytes without its newline at byte {}: not one the agent writes",
                *offset - pending.len() as u64
            );
            return Err(AuditError::new(path, m).into());
        }
        if n < CHUNK {
            return Ok(true);
        }
    }
}

/// The complete lines at the front of `pending` (removed from it).
fn take_complete(pending: &mut Vec<u8>) -> Vec<Vec<u8>> {
    match pending.iter().rposition(|b| *b == b'\n') {
        Some(end) => {
            let done: Vec<u8> = pending.drain(..=end).collect();
            done[..done.len() - 1].split(|b| *b == b'\n').map(<[u8]>::to_vec).collect()
        }
        None => vec![],
    }
}

/// The current log file; `None` when there is none (yet). Anything but a regular file is
/// an error: a FIFO would block the read, or make `--follow` reopen it for ever.
fn open_current(path: &Path) -> Result<Option<std::fs::File>, CliError> {
    match crate::bounded::open_regular(path) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_at(path)(e).into()),
    }
}

fn tail(path: &Path, n: usize, follow: bool, json: bool) -> Result<(), CliError> {
    let mut stdout = std::io::stdout().lock();
    let files = chain_files(path)?;
    // The current file through one handle, so --follow goes on exactly where this read ended.
    let mut current: Option<(std::fs::File, u64)> = None;
    let mut pending = Vec::new();
    let mut picked: Vec<Vec<u8>> = Vec::new();
    if let Some(f) = open_current(path)? {
        // Refused before it is read when larger than any file the agent writes, as by
        // `verify`; read capped in case it grew since.
        let len = f.metadata().map_err(io_at(path))?.len();
        if len > MAX_FILE_BYTES {
            return Err(too_large(path, Some(len)).into());
        }
        let read = f.try_clone().and_then(|c| crate::bounded::read_capped(c, MAX_FILE_BYTES));
        pending = read.map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => too_large(path, None),
            _ => io_at(path)(e),
        })?;
        let offset = pending.len() as u64;
        let end = pending.iter().rposition(|b| *b == b'\n').map_or(0, |e| e + 1);
        picked = last_lines(&pending[..end], n);
        pending.drain(..end);
        current = Some((f, offset));
    }
    // Older files for the rest.
    for f in files.iter().rev().filter(|f| f.as_path() != path) {
        if picked.len() >= n {
            break;
        }
        let bytes = crate::bounded::read_regular(f, MAX_FILE_BYTES).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => too_large(f, None),
            _ => io_at(f)(e),
        })?;
        let mut older = last_lines(&bytes, n - picked.len());
        older.append(&mut picked);
        picked = older;
    }
    let refs: Vec<&[u8]> = picked.iter().map(Vec::as_slice).collect();
    if !emit(&mut stdout, &refs, json)? || !follow {
        return Ok(());
    }
    // Follow: print complete lines as they arrive; when the path names a new file (a
    // rotation), finish the old file first, then read the new one from its beginning.
    loop {
        if let Some((f, offset)) = current.as_mut() {
            if !print_new(&mut stdout, f, offset, &mut pending, json, path)? {
                return Ok(());
            }
        }
        let replaced = match (&current, std::fs::metadata(path)) {
            (Some((f, _)), Ok(m)) => f.metadata().is_ok_and(|o| o.ino() != m.ino() || o.dev() != m.dev()),
            (None, Ok(_)) => true,
            // Mid-rotation (renamed, not yet recreated): keep reading the old file.
            (_, Err(_)) => false,
        };
        if replaced {
            if let Some((mut f, mut offset)) = current.take() {
                // Anything written to the old file after the read above, then its last
                // line even without a `\n` (now never completed).
                if !print_new(&mut stdout, &mut f, &mut offset, &mut pending, json, path)? {
                    return Ok(());
                }
                pending.push(b'\n');
                let lines: Vec<Vec<u8>> = take_complete(&mut pending).into_iter().filter(|l| !l.is_empty()).collect();
                let refs: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
                if !emit(&mut stdout, &refs, json)? {
                    return Ok(());
                }
            }
            current = open_current(path)?.map(|f| (f, 0));
            continue;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tampered record's event, field key, `ts` and `continues.file` (JSON-escaped, so
    /// the line parses) reach the terminal escaped — before, they were printed raw.
    #[test]
    fn rendered_lines_hold_no_raw_control_characters() {
        let osc = r"\u001b]0;x\u0007";
        let line = format!(
            r#"{{"seq":7,"ts":"{osc}","event":"{osc}","fields":{{"{osc}":"v","k":"{osc}"}},"continues":{{"file":"{osc}","seq":6}},"prev":"00"}}"#
        );
        for json in [false, true] {
            let shown = render(line.as_bytes(), json);
            assert!(!shown.chars().any(char::is_control), "json {json}: {shown:?}");
        }
        let shown = render(line.as_bytes(), false);
        assert!(shown.contains("#7") && shown.contains(r"\u{1b}]0;x\u{7}"), "{shown}");
        // Raw control bytes in a line that is not JSON (printed as is with --json).
        let raw = b"{\"seq\":1,\x1b]0;x\x07\xc2\x9b}";
        assert!(!render(raw, true).chars().any(char::is_control));
        // A line the agent wrote, with none of DEL or C1, is unchanged with --json.
        let ok = r#"{"seq":1,"ts":"t","event":"e","fields":{"k":"a\u001bb"},"prev":"00"}"#;
        assert_eq!(render(ok.as_bytes(), true), ok);
        // Into a pipe (a test's stdout is not a terminal), --json writes the stored bytes,
        // a C1 control (U+009B, raw in JSON) included.
        let c1 = "{\"seq\":1,\"ts\":\"t\",\"event\":\"e\",\"fields\":{\"k\":\"a\u{9b}b\"},\"prev\":\"00\"}";
        assert_ne!(render(c1.as_bytes(), true), c1);
        if !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
            let mut out = Vec::new();
            assert!(emit(&mut out, &[c1.as_bytes()], true).unwrap());
            assert_eq!(out, format!("{c1}\n").into_bytes());
        }
    }
}
