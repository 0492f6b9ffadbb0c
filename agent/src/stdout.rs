//! The command line's output on stdout. A write that fails (e.g. `>/dev/full`: ENOSPC) is an
//! error the binary reports on stderr, naming stdout, with exit status 2 — never a panic nor
//! a silent exit 0. A reader that went away (EPIPE, e.g. `| head -1`) is not: the rest of the
//! output is dropped and the exit status is the command's own. A closed descriptor 1 (EBADF)
//! is likewise ignored (the standard library treats it as a sink).
//!
//! Messages on stderr ([`eprint`]) never fail the command: there is nowhere left to report
//! a stderr that cannot be written, so the message is dropped and the exit status stays
//! the command's own (the standard library's `eprintln!` panics instead).

use std::io::Write;

#[derive(Debug, thiserror::Error)]
#[error("stdout: {0}")]
pub struct StdoutError(#[source] pub std::io::Error);

/// Write `text` to stdout and flush it.
pub fn print(text: &str) -> Result<(), StdoutError> {
    write_to(&mut std::io::stdout().lock(), text)
}

/// Write `text` to stderr; a failure is ignored (see the module comment).
pub fn eprint(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Write `text` to `out` and flush it; a broken pipe counts as written.
pub fn write_to(out: &mut impl Write, text: &str) -> Result<(), StdoutError> {
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.map_err(StdoutError),
    }
}
