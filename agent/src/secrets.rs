//! Secrets for executors: the provider lookup and the redaction of delivered values.
//!
//! Executors reach secrets only through `context["vault"].get_secret(name)`, an RPC over the
//! sandbox's application channel answered here: granted only for names the manifest declares
//! under `permissions.secrets`, every grant and refusal audited, never placed in the
//! environment or a file. Providers: `builtin`, the AES-256-GCM store of
//! [`crate::secrets_store`] (a value is decrypted only when a run asks for it); `vault`,
//! HashiCorp Vault's KV v2 with an AppRole login ([`crate::secrets_vault`]: one client per
//! process, its token renewed while in use, nothing contacted until a run asks for a secret);
//! and `file`, a development file (a root-owned, mode-0600 YAML map).
//!
//! Guarantees: values held here (a delivered value, the development file's map) are wiped
//! from memory when dropped; [`Redactor`] replaces every value a run obtained, and the common
//! credential patterns of [`crate::redact`], with `[REDACTED]`.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use zeroize::{Zeroize, Zeroizing};

use crate::config::Config;
use crate::secrets_store::{Location, Store};
use crate::secrets_vault::{VaultClient, VaultSettings};

/// Where secrets come from.
pub enum Provider {
    None,
    File(BTreeMap<String, String>),
    /// The built-in store; `None` when its file does not exist yet (no secrets).
    Builtin(Option<Store>),
    /// HashiCorp Vault: the process's shared client.
    Vault(std::sync::Arc<VaultClient>),
}

impl Drop for Provider {
    fn drop(&mut self) {
        if let Provider::File(map) = self {
            map.values_mut().for_each(Zeroize::zeroize);
        }
    }
}

impl Provider {
    /// The provider the configuration names. A development file that others could read is
    /// refused (fail closed), as is one that is not a flat map of strings; a built-in store
    /// that is exposed, altered or sealed with another key is refused.
    pub fn from_config(config: &Config) -> Result<Provider, String> {
        match (config.secrets.provider.as_deref(), &config.secrets.file) {
            (Some("file"), Some(path)) => Self::load_file(path).map(Provider::File),
            (Some("builtin"), _) => Location::from_config(&config.secrets)
                .open_existing()
                .map(Provider::Builtin)
                .map_err(|e| format!("secrets.provider builtin: {e}")),
            (Some("vault"), _) => {
                let settings = VaultSettings::for_config(config).map_err(|e| e.to_string())?;
                crate::secrets_vault::shared(&settings).map(Provider::Vault)
            }
            _ => Ok(Provider::None),
        }
    }

    /// Check the configured provider without reading any secret value (the built-in store is
    /// opened and verified with its key, and nothing is decrypted; for Vault the settings, the
    /// CA file and the secret_id file are checked and Vault is not contacted).
    pub fn check_config(config: &Config) -> Result<(), String> {
        match (config.secrets.provider.as_deref(), &config.secrets.file) {
            (Some("file"), Some(path)) => Self::check_file(path),
            (Some("builtin"), _) => Self::from_config(config).map(drop),
            (Some("vault"), _) => {
                let settings = VaultSettings::for_config(config).map_err(|e| e.to_string())?;
                crate::secrets_vault::check(&settings)
            }
            _ => Ok(()),
        }
    }

    fn check_file(path: &Path) -> Result<(), String> {
        Self::open_file(path).map(drop)
    }

    /// `secrets.file`, opened: a regular file owned by root without group or other access,
    /// checked on the open descriptor (not by path before a second open).
    fn open_file(path: &Path) -> Result<std::fs::File, String> {
        let file = crate::bounded::open_regular(path).map_err(|e| format!("secrets.file {}: {e}", path.display()))?;
        let meta = file.metadata().map_err(|e| format!("secrets.file {}: {e}", path.display()))?;
        if meta.uid() != 0 || meta.mode() & 0o077 != 0 {
            return Err(format!(
                "secrets.file {}: must be owned by root with mode 0600 (is uid {}, mode {:o})",
                path.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ));
        }
        Ok(file)
    }

    fn load_file(path: &Path) -> Result<BTreeMap<String, String>, String> {
        let file = Self::open_file(path)?;
        let bytes = Zeroizing::new(
            crate::bounded::read_capped(file, MAX_SECRETS_FILE)
                .map_err(|e| format!("secrets.file {}: {e}", path.display()))?,
        );
        let text = std::str::from_utf8(&bytes).map_err(|_| format!("secrets.file {}: not UTF-8", path.display()))?;
        // Only where: the parser's message may quote the text around the error (its source
        // excerpt) or the value it could not take — secret values, which would then reach
        // the run's error, the audit log and the platform's reply.
        let mut options = crate::config::yaml_options();
        options.with_snippet = false;
        serde_saphyr::from_str_with_options(text, options).map_err(|e| {
            let at = e.location().map(|l| format!(" at line {}, column {}", l.line(), l.column())).unwrap_or_default();
            format!(
                "secrets.file {}: not a map of names to strings{at} (the parser's message is withheld: it may quote a value)",
                path.display()
            )
        })
    }

    /// The value of `name`: `Ok(None)` when the provider has no such secret, `Err` when it
    /// cannot say (e.g. a store entry that does not authenticate).
    pub fn get(&self, name: &str) -> Result<Option<Zeroizing<String>>, String> {
        match self {
            Provider::None | Provider::Builtin(None) => Ok(None),
            Provider::File(map) => Ok(map.get(name).map(|v| Zeroizing::new(v.clone()))),
            Provider::Builtin(Some(store)) => store.get(name).map_err(|e| e.to_string()),
            Provider::Vault(client) => client.get(name).map_err(|e| e.to_string()),
        }
    }
}

/// The secret values delivered during one run, replaced by `[REDACTED]` in everything the
/// result carries — together with the common credential patterns of [`crate::redact`].
/// The values are wiped from memory when the redactor is dropped.
#[derive(Default, Clone)]
pub struct Redactor {
    values: Vec<Zeroizing<String>>,
    /// The values that read as numbers (at least [`MIN_DERIVED`] characters, 3 significant
    /// digits), as numbers: a JSON number equal to one is the value whatever its text
    /// (`int("0815")` is 815, a 24-digit value an `f64` printed with an exponent).
    numbers: Zeroizing<Vec<f64>>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Redactor({} values)", self.values.len())
    }
}

/// A run's [`Redactor`] read by another thread while the run goes on (the DNS forwarder,
/// which audits refused names as they come): values are added as they are delivered, before
/// the executor has them.
#[derive(Debug, Default, Clone)]
pub struct LiveRedactor(std::sync::Arc<std::sync::Mutex<Redactor>>);

impl LiveRedactor {
    pub fn add(&self, value: &str) {
        self.lock().add(value);
    }

    /// See [`Redactor::dns_name`].
    pub fn dns_name(&self, name: &str) -> String {
        self.lock().dns_name(name)
    }

    /// The values added so far, as a redactor of its own.
    pub fn snapshot(&self) -> Redactor {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Redactor> {
        // A panic while holding it cannot leave the list half-changed in a way that matters:
        // a value is pushed whole, or not at all.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub const REDACTED: &str = "[REDACTED]";

/// The largest `secrets.file` read (a map of names to values).
const MAX_SECRETS_FILE: u64 = 1 << 20;

/// How far past a cap [`Redactor::text_capped`] scans at least (a PEM private key of 4096
/// bits is ~3.3 KB).
const CAP_MARGIN: usize = 64 * 1024;

/// The shortest form derived from a value (trimmed, escaped) that is redacted too: shorter
/// ones would redact ordinary text.
const MIN_DERIVED: usize = 4;

/// `s` as the content of a JSON string, escaped as serde_json and Python's `json.dumps`
/// write it (`"`, `\\`, `\b \f \n \r \t`, other control characters as `\u00xx`); with
/// `ascii`, every character outside printable ASCII as `\uxxxx` (UTF-16, as
/// `json.dumps`' default). Written into memory reserved up front and wiped on drop: the
/// escaped form is the secret too.
fn json_escaped(s: &str, ascii: bool) -> Zeroizing<String> {
    use std::fmt::Write;
    // At most 6 bytes per byte of `s` (a control character as `\u00xx`): never reallocated.
    let mut out = Zeroizing::new(String::with_capacity(s.len() * 6));
    for c in s.chars() {
        let _ = match c {
            '"' => out.write_str("\\\""),
            '\\' => out.write_str("\\\\"),
            '\u{8}' => out.write_str("\\b"),
            '\u{c}' => out.write_str("\\f"),
            '\n' => out.write_str("\\n"),
            '\r' => out.write_str("\\r"),
            '\t' => out.write_str("\\t"),
            c if (c as u32) < 0x20 || (ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                c.encode_utf16(&mut units).iter().try_for_each(|u| write!(out, "\\u{u:04x}"))
            }
            c => out.write_char(c),
        };
    }
    out
}

/// The inside of Python's `repr(s)` (without its quotes): backslash and the quote it
/// chose escaped, `\t \n \r`, other unprintable characters as `\xhh`, `\uhhhh` or
/// `\Uhhhhhhhh`; with `ascii`, every character outside ASCII so too (`ascii(s)`). Python
/// quotes with `'` unless the text holds `'` and no `"`.
fn python_repr(s: &str, ascii: bool) -> Zeroizing<String> {
    use std::fmt::Write;
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = Zeroizing::new(String::with_capacity(s.len() * 10));
    for c in s.chars() {
        let _ = match c {
            '\\' => out.write_str("\\\\"),
            '\t' => out.write_str("\\t"),
            '\n' => out.write_str("\\n"),
            '\r' => out.write_str("\\r"),
            c if c == quote => write!(out, "\\{c}"),
            c if (c.is_ascii() || !ascii) && crate::python_printable::is_printable(c) => out.write_char(c),
            c if (c as u32) < 0x100 => write!(out, "\\x{:02x}", c as u32),
            c if (c as u32) < 0x10000 => write!(out, "\\u{:04x}", c as u32),
            c => write!(out, "\\U{:08x}", c as u32),
        };
    }
    out
}

/// The inside of Python's `repr(s.encode())` (`b'…'` without `b` and quotes): printable
/// ASCII as it is (backslash and the quote escaped), `\t \n \r`, every other byte `\xhh`.
fn python_bytes_repr(s: &str) -> Zeroizing<String> {
    use std::fmt::Write;
    let quote = if s.contains('\'') && !s.contains('"') { b'"' } else { b'\'' };
    let mut out = Zeroizing::new(String::with_capacity(s.len() * 4));
    for &b in s.as_bytes() {
        let _ = match b {
            b'\\' => out.write_str("\\\\"),
            b'\t' => out.write_str("\\t"),
            b'\n' => out.write_str("\\n"),
            b'\r' => out.write_str("\\r"),
            b if b == quote => write!(out, "\\{}", b as char),
            0x20..=0x7e => out.write_char(b as char),
            b => write!(out, "\\x{b:02x}"),
        };
    }
    out
}

/// `s` percent-encoded as Python's `urllib.parse.quote(s, safe)` does (`quote_plus` with
/// `plus`: spaces as `+`, `/` encoded); hex digits upper- or lower-case.
fn percent_encoded(s: &str, safe: &str, plus: bool, upper: bool) -> Zeroizing<String> {
    use std::fmt::Write;
    let mut out = Zeroizing::new(String::with_capacity(s.len() * 3));
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || b"_.-~".contains(&b) || safe.as_bytes().contains(&b) {
            out.push(b as char);
        } else if plus && b == b' ' {
            out.push('+');
        } else if upper {
            let _ = write!(out, "%{b:02X}");
        } else {
            let _ = write!(out, "%{b:02x}");
        }
    }
    out
}

impl Redactor {
    /// Redact `value` from now on — and the forms code commonly turns it into: without its
    /// surrounding whitespace (a value stored from a file ends with a newline, code strips
    /// it), as a JSON string's content (`"` and `\` escaped; Python's `json.dumps` also
    /// escapes every non-ASCII character), and percent-encoded as in a URL (Python's
    /// `urllib.parse.quote`, `quote(safe="")` and `quote_plus`, hex digits in either case):
    /// a token in a query string reaches an error message whole.
    pub fn add(&mut self, value: &str) {
        let trimmed = value.trim();
        // Python's `str.strip()` also takes the information separators \x1c-\x1f.
        let stripped = value.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c));
        let mut forms = vec![Zeroizing::new(value.to_string())];
        for base in [value, trimmed, stripped] {
            forms.push(Zeroizing::new(base.to_string()));
            forms.push(json_escaped(base, false));
            forms.push(json_escaped(base, true));
            // How Python shows it: repr() (tracebacks, printed containers, %r, a log
            // field the runtime could not send as JSON), ascii(), and its UTF-8 bytes.
            forms.push(python_repr(base, false));
            forms.push(python_repr(base, true));
            forms.push(python_bytes_repr(base));
            for (safe, plus) in [("/", false), ("", false), ("", true)] {
                for upper in [true, false] {
                    forms.push(percent_encoded(base, safe, plus, upper));
                }
            }
        }
        for (i, form) in forms.into_iter().enumerate() {
            let derived = i > 0;
            if form.is_empty() || (derived && form.len() < MIN_DERIVED) {
                continue;
            }
            if !self.values.iter().any(|v| v.as_str() == form.as_str()) {
                self.values.push(form);
            }
        }
        // Longest first, so a secret containing another is replaced whole.
        self.values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        if trimmed.len() >= MIN_DERIVED {
            // At least 3 significant digits: a value such as "0001" or "0.00" is not matched
            // as the number 1 or 0, which would take every such number out of a result.
            let significant = |n: f64| {
                let digits: String = format!("{n}").chars().filter(char::is_ascii_digit).collect();
                digits.trim_start_matches('0').len()
            };
            if let Some(n) = trimmed.parse::<f64>().ok().filter(|n| n.is_finite() && significant(*n) >= 3) {
                if !self.numbers.contains(&n) {
                    self.numbers.push(n);
                }
            }
        }
    }

    /// No value was delivered (the credential patterns still apply to [`Redactor::text`]).
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// `s` with every delivered value, then every recognised credential pattern, redacted.
    pub fn text(&self, s: &str) -> String {
        // Every place any value (or form) occurs in the text as it is, merged where they
        // overlap, each replaced once: two values that overlap leave no part of either
        // (replacing one value at a time, the second was no longer whole), and the
        // replacement's own letters are never matched (a one-letter value in `[REDACTED]`
        // had the text grow with every value: 1729 times for the letters of `[REDACTED]`;
        // now at most `[REDACTED]`'s length per byte).
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for v in &self.values {
            spans.extend(s.match_indices(v.as_str()).map(|(at, m)| (at, at + m.len())));
        }
        if spans.is_empty() {
            return match crate::redact::credentials(s) {
                std::borrow::Cow::Borrowed(_) => s.to_string(),
                std::borrow::Cow::Owned(o) => o,
            };
        }
        spans.sort_unstable();
        let mut out = String::with_capacity(s.len());
        let mut at = 0;
        let mut iter = spans.into_iter().peekable();
        while let Some((start, mut end)) = iter.next() {
            while let Some(&(next, next_end)) = iter.peek() {
                if next >= end {
                    break;
                }
                end = end.max(next_end);
                iter.next();
            }
            out.push_str(&s[at..start]);
            out.push_str(REDACTED);
            at = end;
        }
        out.push_str(&s[at..]);
        match crate::redact::credentials(&out) {
            std::borrow::Cow::Borrowed(_) => out,
            std::borrow::Cow::Owned(o) => o,
        }
    }

    /// `s` redacted and cut to at most `max` bytes (saying so, with its whole length). Only
    /// what can reach the result is scanned: a window whose redacted form reaches a margin
    /// past `max` — room for a value or a credential block (a PEM key) that begins before the
    /// cut — not the rest of a text of up to the channel's 16 MiB. Redaction shrinks text,
    /// so the window grows (doubling) until its redacted form is that long: the window's
    /// own end, where a value may be cut in two, always lies past the cut.
    pub fn text_capped(&self, s: &str, max: usize) -> String {
        if s.len() <= max {
            return self.text(s);
        }
        // `values` is sorted longest first.
        let margin = CAP_MARGIN.max(self.values.first().map_or(0, |v| v.len()));
        let want = max.saturating_add(margin);
        let mut window = want;
        let (end, redacted) = loop {
            let mut end = window.min(s.len());
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            let redacted = self.text(&s[..end]);
            if end == s.len() || redacted.len() >= want {
                break (end, redacted);
            }
            window = window.saturating_mul(2);
        };
        if end == s.len() && redacted.len() <= max {
            return redacted;
        }
        let mut cut = max.min(redacted.len());
        while !redacted.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{} [cut: {} bytes, over the {max} byte cap]", &redacted[..cut], s.len())
    }

    /// As [`Redactor::text`], for text cut at a size limit: a value the cut went through
    /// would not match whole, so a tail that is the start of a value is redacted as well.
    pub fn text_cut(&self, s: &str) -> String {
        // A cut inside a multi-byte character left a replacement character at the end.
        let mut out = self.text(s.trim_end_matches('\u{FFFD}'));
        let cut = self
            .values
            .iter()
            .filter_map(|v| {
                // The longest proper prefix of `v` that `out` ends with.
                (1..v.len()).rev().find(|&n| v.is_char_boundary(n) && out.ends_with(&v[..n]))
            })
            .max();
        if let Some(n) = cut {
            out.truncate(out.len() - n);
            out.push_str(REDACTED);
        }
        out
    }

    pub fn contains_secret(&self, bytes: &[u8]) -> bool {
        self.values.iter().any(|v| bytes.windows(v.len()).any(|w| w == v.as_bytes()))
    }

    /// A DNS name as the forwarder holds it (ASCII, lower case: DNS names match whatever
    /// their case, so a value queried as a name comes in any case) with every value it
    /// holds, compared without regard to ASCII case, redacted; then as [`Redactor::text`].
    pub fn dns_name(&self, name: &str) -> String {
        let mut out = name.to_string();
        for v in &self.values {
            let v = Zeroizing::new(v.to_ascii_lowercase());
            // Past each replacement, so a value that "[REDACTED]" contains is replaced once.
            let mut from = 0;
            while let Some(i) = (!v.is_empty()).then(|| out[from..].to_ascii_lowercase().find(v.as_str())).flatten() {
                // ASCII case folding keeps every byte where it was: `at` is a char boundary
                // of `out` as of its lower-case copy.
                let at = from + i;
                out.replace_range(at..at + v.len(), REDACTED);
                from = at + REDACTED.len();
            }
        }
        self.text(&out)
    }

    /// Redact every string (keys included) in a JSON value, and every number whose text
    /// holds a value (a secret returned as `int(value)`): that number becomes the redacted
    /// string.
    pub fn json(&self, v: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::String(s) => Value::String(self.text(s)),
            Value::Number(n) => {
                if n.as_f64().is_some_and(|x| self.numbers.contains(&x)) {
                    return Value::String(REDACTED.into());
                }
                let text = n.to_string();
                let redacted = self.text(&text);
                if redacted == text {
                    v.clone()
                } else {
                    Value::String(redacted)
                }
            }
            Value::Array(a) => Value::Array(a.iter().map(|x| self.json(x)).collect()),
            Value::Object(o) => Value::Object(o.iter().map(|(k, x)| (self.text(k), self.json(x))).collect()),
            other => other.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_secrets_file_is_refused_without_quoting_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("opservant-secrets-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secrets.yaml");
        // (An unterminated quote is found at the end of the text.)
        for (text, line) in [
            ("api_key: s3cr3t-value-1\ndb: [x, s3cr3t-value-2]\n", 2),
            ("api_key: s3cr3t-value-1\ndb: \"s3cr3t-value-2\n", 3),
            ("s3cr3t-value-1\n", 1),
            ("a: s3cr3t-value-1\na: s3cr3t-value-2\n", 2),
        ] {
            std::fs::write(&file, text).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
            let e = Provider::load_file(&file).unwrap_err();
            assert!(!e.contains("s3cr3t"), "{text:?}: {e}");
            assert!(
                e.contains("not a map of names to strings") && e.contains(&format!("line {line}")),
                "{text:?}: {e}"
            );
        }
        std::fs::write(&file, "api_key: s3cr3t-value-1\n").unwrap();
        assert_eq!(Provider::load_file(&file).unwrap()["api_key"], "s3cr3t-value-1");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_dns_name_is_redacted_whatever_the_case_and_only_once() {
        let mut r = Redactor::default();
        r.add("s3cr3t-VALUE");
        assert_eq!(r.dns_name("a.s3cr3t-value.x.S3CR3T-Value"), "a.[REDACTED].x.[REDACTED]");
        // Redacting a redacted name again leaves it as it is.
        assert_eq!(r.dns_name(&r.dns_name("s3cr3t-value.test")), "[REDACTED].test");
        assert_eq!(r.dns_name("example.test"), "example.test");
        // A value that the replacement itself contains (in another case) ends.
        let mut r = Redactor::default();
        r.add("Redacted");
        assert_eq!(r.dns_name("redacted.test"), "[REDACTED].test");
    }

    #[test]
    fn a_capped_text_that_redaction_shrinks_shows_no_part_of_a_value() {
        // 6000 copies of a 23-byte value: the first window's copies shrink to "[REDACTED]",
        // which used to bring the window's cut-off copy under the cap, in clear.
        let mut r = Redactor::default();
        let v = "s3cr3t-value-0123456789";
        r.add(v);
        for max in [65536, 4096, 100] {
            let out = r.text_capped(&v.repeat(6000), max);
            assert!(!out.contains("s3cr3t"), "{max}: {}", &out[out.len().saturating_sub(120)..]);
            let note = format!(" [cut: {} bytes, over the {max} byte cap]", 6000 * v.len());
            // Redacted whole, 60 000 bytes fit under 64 KiB: then nothing is cut.
            assert_eq!(out.ends_with(&note), max < 60_000, "{max}");
            assert!(out.len() <= max + note.len(), "{max}");
        }
        // Short values grow the text instead: still nothing of them.
        let mut r = Redactor::default();
        r.add("k3y9");
        let out = r.text_capped(&"k3y9".repeat(100_000), 65536);
        assert!(!out.contains("k3y") && !out.contains("3y9"), "{}", &out[out.len() - 80..]);
    }

    #[test]
    fn a_value_cut_at_the_size_limit_is_redacted_too() {
        let r = Redactor { values: vec![Zeroizing::new("s3cr3t-value".to_string())], ..Default::default() };
        assert_eq!(r.text_cut("out: s3cr3t-va"), "out: [REDACTED]");
        assert_eq!(r.text_cut("out: s3cr3t-value and more"), "out: [REDACTED] and more");
        assert_eq!(r.text_cut("plain text"), "plain text");
        let r = Redactor { values: vec![Zeroizing::new("pässwörd".to_string())], ..Default::default() };
        assert_eq!(r.text_cut("out: p\u{e4}ssw\u{FFFD}"), "out: [REDACTED]");
    }

    #[test]
    fn the_forms_code_turns_a_value_into_are_redacted_too() {
        let mut r = Redactor::default();
        r.add("s3cr3t-value\n");
        assert_eq!(r.text("token=s3cr3t-value;"), "token=[REDACTED];");
        let mut r = Redactor::default();
        r.add("pa\"ss\\wörd-1");
        // serde_json / json.dumps(ensure_ascii=False), and json.dumps' default.
        assert_eq!(r.text(r#"{"p": "pa\"ss\\wörd-1"}"#), r#"{"p": "[REDACTED]"}"#);
        assert_eq!(r.text(r#"{"p": "pa\"ss\\w\u00f6rd-1"}"#), r#"{"p": "[REDACTED]"}"#);
        let mut r = Redactor::default();
        r.add("wörd\tand\u{1}🔑");
        assert_eq!(r.text(r#""w\u00f6rd\tand\u0001\ud83d\udd11""#), r#""[REDACTED]""#);
        assert_eq!(r.text(&serde_json::json!("wörd\tand\u{1}🔑").to_string()), r#""[REDACTED]""#);
        // Python's strip() also removes \x1c-\x1f, which Rust's trim() keeps.
        let mut r = Redactor::default();
        r.add("s3cr3t-value\u{1f}");
        assert_eq!(r.text("token=s3cr3t-value;"), "token=[REDACTED];");
        // A value whose trimmed form is too short to redact alone.
        let mut r = Redactor::default();
        r.add(" ab ");
        assert_eq!(r.text("a b-ab-abc"), "a b-ab-abc");
        // Percent-encoded into a URL: quote (safe "/"), quote(safe=""), quote_plus; hex
        // digits in either case.
        let mut r = Redactor::default();
        r.add("Ab+cd/Ef=gh 9XYZ");
        for url in [
            "https://x/?token=Ab%2Bcd/Ef%3Dgh%209XYZ&a=1",
            "https://x/?token=Ab%2Bcd%2FEf%3Dgh%209XYZ&a=1",
            "https://x/?token=Ab%2Bcd%2FEf%3Dgh+9XYZ&a=1",
            "https://x/?token=Ab%2bcd%2fEf%3dgh+9XYZ&a=1",
        ] {
            assert_eq!(r.text(url), "https://x/?token=[REDACTED]&a=1", "{url}");
        }
    }

    #[test]
    fn overlapping_values_leave_no_part_and_short_values_do_not_compound() {
        let mut r = Redactor::default();
        r.add("abcdef1234");
        r.add("1234wxyz");
        assert_eq!(r.text("x abcdef1234wxyz y"), "x [REDACTED] y");
        assert_eq!(r.text("1234wxyz and abcdef1234"), "[REDACTED] and [REDACTED]");
        // One-letter values, some of them letters of the replacement: one replacement per
        // run, never applied to the replacement itself.
        let mut r = Redactor::default();
        r.add("E");
        r.add("D");
        assert_eq!(r.text("EE-DE-x"), "[REDACTED][REDACTED]-[REDACTED][REDACTED]-x");
        let text = "E".repeat(1 << 16);
        assert_eq!(r.text(&text).len(), REDACTED.len() << 16);
    }

    #[test]
    fn pythons_repr_ascii_and_bytes_forms_are_redacted_too() {
        // (value, repr() inside its quotes, ascii(), repr(value.encode())), as Python 3.11
        // prints them.
        let cases = [
            (r#"p"a\s$^.*(x)"#, r#"p"a\\s$^.*(x)"#, r#"p"a\\s$^.*(x)"#, r#"p"a\\s$^.*(x)"#),
            (
                "pässwörd-ﬁx-Å",
                "pässwörd-ﬁx-Å",
                r"p\xe4ssw\xf6rd-\ufb01x-\xc5",
                r"p\xc3\xa4ssw\xc3\xb6rd-\xef\xac\x81x-\xc3\x85",
            ),
            ("tab\there\u{1}", r"tab\there\x01", r"tab\there\x01", r"tab\there\x01"),
            (r#"both'"q"#, r#"both\'"q"#, r#"both\'"q"#, r#"both\'"q"#),
            ("emoji😀\u{200b}", r"emoji😀\u200b", r"emoji\U0001f600\u200b", r"emoji\xf0\x9f\x98\x80\xe2\x80\x8b"),
        ];
        for (value, repr, ascii, bytes) in cases {
            assert_eq!(python_repr(value, false).as_str(), repr, "{value:?}");
            assert_eq!(python_repr(value, true).as_str(), ascii, "{value:?}");
            assert_eq!(python_bytes_repr(value).as_str(), bytes, "{value:?}");
            let mut r = Redactor::default();
            r.add(value);
            for form in [repr, ascii, bytes] {
                assert_eq!(r.text(&format!("KeyError: '{form}'")), "KeyError: '[REDACTED]'", "{value:?}: {form}");
            }
        }
    }

    /// The three forms as Debian's `/usr/bin/python3` (the interpreter the runtime embeds)
    /// prints them, for values with characters of every category `repr()` escapes: private
    /// use (Co), unassigned (Cn), format (Cf) beyond the common ones, separators.
    #[test]
    fn pythons_forms_are_the_embedded_interpreters() {
        let values = [
            "pua\u{e000}x",
            "unassigned\u{378}\u{40000}",
            "arabic\u{600}\u{61c}\u{6dd}mongolian\u{180e}tag\u{e0001}\u{e007f}",
            "nbsp\u{a0}ideographic\u{3000}line\u{2028}para\u{2029}soft\u{ad}",
            "plain-ascii 'q'",
            "mixed\u{1f600}é\u{fb01}\u{10ffff}",
        ];
        let script = "import json, sys\n\
                      for v in json.load(sys.stdin):\n \
                      print(json.dumps([repr(v)[1:-1], ascii(v)[1:-1], repr(v.encode())[2:-1]]))";
        let mut child = std::process::Command::new("/usr/bin/python3")
            .args(["-I", "-S", "-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        {
            use std::io::Write;
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(serde_json::to_string(&values).unwrap().as_bytes()).unwrap();
        }
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let lines: Vec<Vec<String>> =
            String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), values.len());
        for (value, theirs) in values.iter().zip(&lines) {
            let ours = [
                python_repr(value, false).to_string(),
                python_repr(value, true).to_string(),
                python_bytes_repr(value).to_string(),
            ];
            assert_eq!(ours.as_slice(), theirs.as_slice(), "{value:?}");
            let mut r = Redactor::default();
            r.add(value);
            for form in theirs {
                assert_eq!(r.text(&format!("KeyError: '{form}'")), "KeyError: '[REDACTED]'", "{value:?}: {form}");
            }
        }
    }

    #[test]
    fn a_capped_text_is_redacted_where_it_is_cut_and_scanned_no_further() {
        let mut r = Redactor::default();
        r.add("s3cr3t-value");
        let cut = r.text_capped(&format!("{}s3cr3t-value{}", "x".repeat(95), "y".repeat(1 << 20)), 100);
        assert_eq!(cut, format!("{}[REDA [cut: {} bytes, over the 100 byte cap]", "x".repeat(95), 95 + 12 + (1 << 20)));
        assert_eq!(r.text_capped("short s3cr3t-value", 100), "short [REDACTED]");
        // Shorter than the cap once redacted, but cut before: still says so.
        let long = format!("{}s3cr3t-value", "x".repeat(95));
        assert_eq!(
            r.text_capped(&long, 100),
            format!("{}[REDA [cut: 107 bytes, over the 100 byte cap]", "x".repeat(95))
        );
    }

    #[test]
    fn redaction_reaches_every_string() {
        let mut r = Redactor::default();
        r.add("s3cr3t");
        r.add("s3cr3t-longer");
        r.add("");
        assert_eq!(r.text("a s3cr3t-longer and s3cr3t"), "a [REDACTED] and [REDACTED]");
        let v = serde_json::json!({"k": ["x s3cr3t", {"s3cr3t": 1}], "n": 2});
        assert_eq!(r.json(&v), serde_json::json!({"k": ["x [REDACTED]", {"[REDACTED]": 1}], "n": 2}));
        r.add("90210");
        let v = serde_json::json!({"zip": 90210, "more": 1902107, "f": 90210.5, "other": 9021});
        assert_eq!(
            r.json(&v),
            serde_json::json!({"zip": "[REDACTED]", "more": "1[REDACTED]7", "f": "[REDACTED].5", "other": 9021})
        );
        // Numbers whose text differs from the value's: leading zeros, an integer too large
        // for 64 bits (an f64 printed with an exponent), a float of many digits.
        r.add("0815\n");
        r.add("123456789012345678901234");
        r.add("3.14159265358979323846");
        let v: serde_json::Value =
            serde_json::from_str(r#"{"pin": 815, "big": 123456789012345678901234, "pi": 3.141592653589793, "n": 816}"#)
                .unwrap();
        assert_eq!(
            r.json(&v),
            serde_json::json!({"pin": "[REDACTED]", "big": "[REDACTED]", "pi": "[REDACTED]", "n": 816})
        );
        // Values that are small numbers are not matched by value: every 1 or 0 would go.
        r.add("0001");
        r.add("0.00");
        let v = serde_json::json!({"one": 1, "zero": 0, "f": 0.0});
        assert_eq!(r.json(&v), v);
        assert!(r.contains_secret(b"..s3cr3t.."));
        assert!(!r.contains_secret(b"secret"));
        // Credential patterns too, with or without delivered values.
        let aws = "key AKIAIOSFODNN7EXAMPLE";
        assert_eq!(r.text(aws), "key [REDACTED]");
        assert_eq!(Redactor::default().text(aws), "key [REDACTED]");
        assert!(!format!("{r:?}").contains("s3cr3t"), "Debug never shows values");
    }

    #[test]
    fn an_exposed_secrets_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("opservant-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("secrets.yaml");
        std::fs::write(&f, "api_key: abc\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(Provider::load_file(&f).unwrap_err().contains("mode 0600"));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(Provider::load_file(&f).unwrap().get("api_key").map(String::as_str), Some("abc"));
            let p = Provider::File(Provider::load_file(&f).unwrap());
            assert_eq!(p.get("api_key").unwrap().as_deref().map(String::as_str), Some("abc"));
            assert!(p.get("other").unwrap().is_none());
            // A FIFO (root's, 0600) is refused, not waited on; so is a file past the cap.
            let fifo = dir.join("fifo.yaml");
            nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
            assert!(Provider::load_file(&fifo).unwrap_err().contains("not a regular file"));
            std::fs::File::create(&f).unwrap().set_len(MAX_SECRETS_FILE + 1).unwrap();
            assert!(Provider::load_file(&f).unwrap_err().contains("larger than"));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
