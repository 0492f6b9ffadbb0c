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

/// Write `text` to stdout and flush it. To a terminal, the C1 control characters
/// (U+0080–U+009F, which serde_json leaves raw in a string and some terminals act on) are
/// written as JSON escapes (`\u009b`): a result line cannot drive the terminal with a value
/// the sandbox wrote.
pub fn print(text: &str) -> Result<(), StdoutError> {
    static TERMINAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *TERMINAL.get_or_init(|| std::io::IsTerminal::is_terminal(&std::io::stdout())) && text.chars().any(is_c1) {
        let escaped: String =
            text.chars().map(|c| if is_c1(c) { format!("\\u{:04x}", u32::from(c)) } else { c.to_string() }).collect();
        return write_to(&mut std::io::stdout().lock(), &escaped);
    }
    write_to(&mut std::io::stdout().lock(), text)
}

fn is_c1(c: char) -> bool {
    ('\u{80}'..='\u{9f}').contains(&c)
}

/// Output of the sandbox's on its way to a terminal, chunk by chunk: control characters but
/// newline and tab written as `\xNN` — the C0 bytes and DEL, and the C1 characters as UTF-8
/// writes them (`0xC2 0x80`–`0xC2 0x9F`, held over a chunk's end) — so that it cannot hide
/// or overwrite what follows it, or drive the terminal. Everything else, all other UTF-8
/// text included, is passed as it is.
#[derive(Debug, Default)]
pub struct TerminalEscaper {
    /// A chunk ended with 0xC2: the start of a C1 character, or of other text.
    held: bool,
}

impl TerminalEscaper {
    pub fn escape(&mut self, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len() + 16);
        let mut bytes = data.iter().copied().peekable();
        let mut lead = std::mem::take(&mut self.held);
        loop {
            let b = if lead {
                lead = false;
                0xC2
            } else {
                match bytes.next() {
                    Some(b) => b,
                    None => break,
                }
            };
            match b {
                0xC2 => match bytes.peek() {
                    None => self.held = true,
                    Some(&next @ 0x80..=0x9F) => {
                        bytes.next();
                        out.extend_from_slice(format!("\\xc2\\x{next:02x}").as_bytes());
                    }
                    Some(_) => out.push(b),
                },
                b'\n' | b'\t' => out.push(b),
                b if b < 0x20 || b == 0x7f => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
                b => out.push(b),
            }
        }
        out
    }

    /// What is held at the end of the output (a lone 0xC2), written as an escape.
    pub fn finish(&mut self) -> Vec<u8> {
        if std::mem::take(&mut self.held) {
            b"\\xc2".to_vec()
        } else {
            Vec::new()
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_are_escaped_across_chunks_and_text_is_kept() {
        let mut e = TerminalEscaper::default();
        assert_eq!(e.escape(b"a\x1b[8m\rb\tc\n\x7f"), b"a\\x1b[8m\\x0db\tc\n\\x7f".to_vec());
        // C1 as UTF-8 (CSI, OSC), also split between two chunks; other two-byte text kept.
        assert_eq!(e.escape("x\u{9b}8m \u{a9}".as_bytes()), b"x\\xc2\\x9b8m \xc2\xa9".to_vec());
        assert_eq!(e.escape(b"end\xc2"), b"end".to_vec());
        assert_eq!(e.escape(b"\x9dtitle"), b"\\xc2\\x9dtitle".to_vec());
        assert_eq!(e.escape(b"\xc2"), b"".to_vec());
        assert_eq!(e.escape(b"\xa9"), "\u{a9}".as_bytes().to_vec());
        assert_eq!(e.escape(b"\xc2"), b"".to_vec());
        assert_eq!(e.finish(), b"\\xc2".to_vec());
        assert_eq!(e.finish(), b"".to_vec());
        // Multi-byte text whose later bytes are in 0x80-0x9F stays whole.
        assert_eq!(e.escape("€ é".as_bytes()), "€ é".as_bytes().to_vec());
    }
}
