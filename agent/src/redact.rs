//! Redaction of common credential patterns from text that leaves the agent (results, logs,
//! audit text), in addition to the values a run actually obtained (`secrets::Redactor`).
//!
//! Recognised, and replaced by `[REDACTED]`:
//! - PEM private-key blocks: `-----BEGIN <…>PRIVATE KEY<…>-----` through the matching
//!   `-----END …-----` line, whole (to the end of the text when the end line is missing);
//!   public keys and certificates are left alone;
//! - the token after `bearer` (any case, after a space or tab) when it looks like one: at
//!   least 16 token characters, or 8 with a digit — so prose ("the bearer of …") survives;
//! - the credentials of an `Authorization` header or field (`Authorization: Basic …`,
//!   `{'Authorization': 'token …'}`, or a bare `authorization=…` of 8 or more characters
//!   that are not all letters);
//! - AWS access key ids (`AKIA`/`ASIA` and 16 of `[A-Z0-9]`, as a whole word);
//! - the value after `aws_secret_access_key`, `SecretAccessKey`, `aws_session_token` or
//!   `SessionToken` and `=` or `:` (any case, optional quotes), as in credentials files,
//!   environment variables and STS JSON;
//! - the password of a URL's user information, `scheme://user:PASSWORD@host` (a proxy's, a
//!   database's), the user name kept: the authority is read up to [`MAX_USERINFO`] bytes
//!   after `://`, to white space, a quote, `<`, `>`, `\`, `/`, `?` or `#`; its user
//!   information ends at its last `@` (as Python's `urlsplit` reads it: `p@ss` in
//!   `app:p@ss@db`).
//!
//! Guarantees: only the matched spans change (the rest of the text, including non-ASCII, is
//! kept byte for byte); applying it twice gives the same text as once; no regular-expression
//! engine and no allocation when nothing matches; never panics, and runs in time linear in
//! the text times the (short, fixed) pattern lengths.

use std::borrow::Cow;

use crate::secrets::REDACTED;

/// `text` with every recognised credential replaced by `[REDACTED]`.
pub fn credentials(text: &str) -> Cow<'_, str> {
    let b = text.as_bytes();
    let mut spans = Vec::new();
    pem_private_keys(b, &mut spans);
    bearer_tokens(b, &mut spans);
    authorization_fields(b, &mut spans);
    aws_access_key_ids(b, &mut spans);
    aws_secret_values(b, &mut spans);
    url_passwords(b, &mut spans);
    if spans.is_empty() {
        return Cow::Borrowed(text);
    }
    spans.sort_unstable();
    let mut out = String::with_capacity(text.len());
    let mut pos = 0;
    for (mut start, mut end) in spans {
        // Spans start and end next to ASCII bytes by construction; widen to character
        // boundaries anyway, so slicing can never panic.
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        while end < text.len() && !text.is_char_boundary(end) {
            end += 1;
        }
        if end <= pos {
            continue; // inside a span already replaced
        }
        if start >= pos {
            out.push_str(&text[pos..start]);
            out.push_str(REDACTED);
        } // else it overlaps the previous span: that replacement now reaches `end`
        pos = end.min(text.len());
    }
    out.push_str(&text[pos..]);
    Cow::Owned(out)
}

fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Case-insensitive search for an ASCII, lowercase `needle` in `hay` from `from`.
fn find_ci(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| hay[i..i + needle.len()].eq_ignore_ascii_case(needle))
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if from > hay.len() {
        return None;
    }
    hay[from..].windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

fn skip(b: &[u8], mut i: usize, set: &[u8]) -> usize {
    while i < b.len() && set.contains(&b[i]) {
        i += 1;
    }
    i
}

fn skip_while(b: &[u8], mut i: usize, f: impl Fn(u8) -> bool) -> usize {
    while i < b.len() && f(b[i]) {
        i += 1;
    }
    i
}

fn pem_private_keys(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    const BEGIN: &[u8] = b"-----BEGIN ";
    let mut i = 0;
    while let Some(p) = find(b, BEGIN, i) {
        let label_start = p + BEGIN.len();
        let label_end = skip_while(b, label_start, |c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == b' ');
        let label = &b[label_start..label_end];
        i = label_end;
        if label.len() > 64 || !b[label_end..].starts_with(b"-----") || find(label, b"PRIVATE KEY", 0).is_none() {
            continue;
        }
        let mut end_marker = b"-----END ".to_vec();
        end_marker.extend_from_slice(label);
        end_marker.extend_from_slice(b"-----");
        let end = find(b, &end_marker, label_end + 5).map_or(b.len(), |e| e + end_marker.len());
        spans.push((p, end));
        i = end;
    }
}

/// RFC 6750 `b64token` characters (the trailing `=` padding is taken separately).
fn is_token(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"-._~+/".contains(&c)
}

fn bearer_tokens(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    let mut i = 0;
    while let Some(p) = find_ci(b, b"bearer", i) {
        i = p + 6;
        if p > 0 && is_word(b[p - 1]) {
            continue;
        }
        let t = skip(b, i, b" \t");
        if t == i {
            continue;
        }
        let end = skip(b, skip_while(b, t, is_token), b"=");
        let token = &b[t..end];
        if token.len() >= 16 || (token.len() >= 8 && token.iter().any(u8::is_ascii_digit)) {
            spans.push((t, end));
            i = end;
        }
    }
}

/// After a field name: optional closing quote, spaces, `:` or `=`, spaces, optional opening
/// quote. The position of the value, if the separator is there.
fn after_separator(b: &[u8], i: usize) -> Option<usize> {
    let j = skip(b, skip(b, i, b"\"'"), b" \t");
    if j < b.len() && (b[j] == b':' || b[j] == b'=') {
        Some(skip(b, skip(b, j + 1, b" \t"), b"\"'"))
    } else {
        None
    }
}

fn authorization_fields(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    let is_cred = |c: u8| !c.is_ascii_whitespace() && !b"\"',;".contains(&c);
    let mut i = 0;
    while let Some(p) = find_ci(b, b"authorization", i) {
        i = p + 13;
        if (p > 0 && is_word(b[p - 1])) || b.get(i).is_some_and(|&c| is_word(c)) {
            continue;
        }
        let Some(v) = after_separator(b, i) else { continue };
        let first_end = skip_while(b, v, is_cred);
        if first_end == v {
            continue;
        }
        let second = skip(b, first_end, b" \t");
        let second_end = skip_while(b, second, is_cred);
        if b[v..first_end].iter().all(u8::is_ascii_alphabetic) && second > first_end && second_end > second {
            // `Scheme credentials`: keep the scheme.
            spans.push((second, second_end));
            i = second_end;
        } else if first_end - v >= 8 && !b[v..first_end].iter().all(u8::is_ascii_alphabetic) {
            // A bare credential (a plain word such as "required" is not one).
            spans.push((v, first_end));
            i = first_end;
        }
    }
}

fn aws_access_key_ids(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    let mut i = 0;
    while i + 20 <= b.len() {
        let w = &b[i..i + 20];
        if (w.starts_with(b"AKIA") || w.starts_with(b"ASIA"))
            && (i == 0 || !b[i - 1].is_ascii_alphanumeric())
            && w[4..].iter().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
            && b.get(i + 20).is_none_or(|c| !c.is_ascii_alphanumeric())
        {
            spans.push((i, i + 20));
            i += 20;
        } else {
            i += 1;
        }
    }
}

fn aws_secret_values(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    for name in [&b"aws_secret_access_key"[..], b"secretaccesskey", b"aws_session_token", b"sessiontoken"] {
        let mut i = 0;
        while let Some(p) = find_ci(b, name, i) {
            i = p + name.len();
            if (p > 0 && is_word(b[p - 1])) || b.get(i).is_some_and(|&c| is_word(c)) {
                continue;
            }
            let Some(v) = after_separator(b, i) else { continue };
            let end = skip_while(b, v, |c| c.is_ascii_alphanumeric() || b"/+=".contains(&c));
            if end > v {
                spans.push((v, end));
                i = end;
            }
        }
    }
}

/// The most of a URL's user information looked at for a password (user name, `:`,
/// password): a longer one is not taken for one, and the scan stays linear.
pub const MAX_USERINFO: usize = 512;

fn url_passwords(b: &[u8], spans: &mut Vec<(usize, usize)>) {
    let mut i = 0;
    while let Some(p) = find(b, b"://", i) {
        i = p + 3;
        // A scheme ends right before (`http`, `postgres+psycopg`, …).
        if p == 0 || !(b[p - 1].is_ascii_alphanumeric() || b"+.-".contains(&b[p - 1])) {
            continue;
        }
        let in_authority = |c: u8| c > b' ' && c != 0x7f && !b"/?#\"'<>\\".contains(&c);
        let limit = (i + MAX_USERINFO).min(b.len());
        let authority_end = skip_while(&b[..limit], i, in_authority);
        if authority_end == limit && b.get(limit).is_some_and(|&c| in_authority(c)) {
            continue; // longer than the bound: not taken for an authority
        }
        let Some(at) = b[i..authority_end].iter().rposition(|&c| c == b'@').map(|p| i + p) else {
            continue;
        };
        if let Some(colon) = b[i..at].iter().position(|&c| c == b':') {
            let v = i + colon + 1;
            if at > v {
                spans.push((v, at));
            }
        }
        i = at + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_passwords_keep_the_user_and_host() {
        assert_eq!(r("HTTPS_PROXY=http://agent:s3cret@proxy:3128"), "HTTPS_PROXY=http://agent:[REDACTED]@proxy:3128");
        assert_eq!(
            r(r#"{"dsn": "postgres+psycopg://app:p%40ss@db/x"}"#),
            r#"{"dsn": "postgres+psycopg://app:[REDACTED]@db/x"}"#
        );
        assert_eq!(r("a http://u:1@h b https://v:2@i"), "a http://u:[REDACTED]@h b https://v:[REDACTED]@i");
        // The user information ends at the authority's last @.
        assert_eq!(r("postgres://app:p@ss@db/x"), "postgres://app:[REDACTED]@db/x");
        for keep in [
            "http://proxy:3128/path@x",
            "http://user@host",
            "http://user:@host",
            "mailto:someone@example.com",
            "see ://x:y@z",
            "http://a b:c@d",
            "http://host/?q=a:b@c",
        ] {
            assert_eq!(r(keep), keep);
        }
        let long = format!("http://u:{}@h", "p".repeat(MAX_USERINFO));
        assert_eq!(r(&long), long, "past the bound: not taken for user information");
        let once = r("http://u:pw@h");
        assert_eq!(r(&once), once);
        // Many schemes without an `@`: each scan stops at its bound.
        let many = "x://".repeat(10_000);
        assert_eq!(r(&many), many);
    }

    fn r(s: &str) -> String {
        credentials(s).into_owned()
    }

    #[test]
    fn pem_private_key_blocks() {
        for label in
            ["RSA PRIVATE KEY", "PRIVATE KEY", "EC PRIVATE KEY", "OPENSSH PRIVATE KEY", "ENCRYPTED PRIVATE KEY"]
        {
            let text = format!("before\n-----BEGIN {label}-----\nMIIEow\nAbC+/=\n-----END {label}-----\nafter");
            assert_eq!(r(&text), "before\n[REDACTED]\nafter", "{label}");
        }
        // JSON-escaped newlines, two blocks.
        let j = r#"{"k": "-----BEGIN PRIVATE KEY-----\nAAA\n-----END PRIVATE KEY-----", "k2": "-----BEGIN EC PRIVATE KEY-----\nBBB\n-----END EC PRIVATE KEY-----"}"#;
        assert_eq!(r(j), r#"{"k": "[REDACTED]", "k2": "[REDACTED]"}"#);
        // No end line (truncated output): redacted to the end.
        assert_eq!(r("x -----BEGIN RSA PRIVATE KEY-----\nMIIE..."), "x [REDACTED]");
        // Public material stays.
        for keep in [
            "-----BEGIN PUBLIC KEY-----\nMFkw\n-----END PUBLIC KEY-----",
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",
            "-----BEGIN nothing",
        ] {
            assert_eq!(r(keep), keep);
        }
    }

    #[test]
    fn bearer_tokens_and_authorization() {
        assert_eq!(r("Authorization: Bearer eyJhbGciOi.eyJzdWIi.sig-_x"), "Authorization: Bearer [REDACTED]");
        assert_eq!(r("curl -H 'authorization: bearer abc123def456'"), "curl -H 'authorization: bearer [REDACTED]'");
        assert_eq!(r("token: BEARER\tdGhpcyBpcyBhIHRva2Vu=="), "token: BEARER\t[REDACTED]");
        assert_eq!(r("{'Authorization': 'Basic dXNlcjpwYXNz'}"), "{'Authorization': 'Basic [REDACTED]'}");
        assert_eq!(r("\"authorization\":\"token ghp_abcdef\""), "\"authorization\":\"token [REDACTED]\"");
        assert_eq!(r("authorization=sk_live_0123456789"), "authorization=[REDACTED]");
        // Prose and short words survive.
        for keep in [
            "the bearer of this letter",
            "Bearer authentication is used",
            "bearer short",
            "token_type: bearer",
            "authorization failed",
            "Authorization: required",
            "unauthorization: x",
        ] {
            assert_eq!(r(keep), keep);
        }
    }

    #[test]
    fn aws_keys() {
        assert_eq!(r("id=AKIAIOSFODNN7EXAMPLE,"), "id=[REDACTED],");
        assert_eq!(r("ASIAABCDEFGHIJKLMNOP"), "[REDACTED]");
        for keep in ["AKIAIOSFODNN7EXAMPL", "XAKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLEX", "akiaiosfodnn7example"] {
            assert_eq!(r(keep), keep);
        }
        assert_eq!(
            r("[default]\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\nregion = eu-west-1"),
            "[default]\naws_secret_access_key = [REDACTED]\nregion = eu-west-1"
        );
        assert_eq!(r("export AWS_SECRET_ACCESS_KEY=abc/def+ghi"), "export AWS_SECRET_ACCESS_KEY=[REDACTED]");
        assert_eq!(
            r(r#"{"AccessKeyId": "ASIAABCDEFGHIJKLMNOP", "SecretAccessKey": "s3cr3t+/=", "SessionToken": "FwoG=="}"#),
            r#"{"AccessKeyId": "[REDACTED]", "SecretAccessKey": "[REDACTED]", "SessionToken": "[REDACTED]"}"#
        );
        assert_eq!(r("my_aws_secret_access_key_name = x"), "my_aws_secret_access_key_name = x");
    }

    #[test]
    fn untouched_text_and_idempotence() {
        let plain = "nothing here: é ü 漢字 — AKIA short";
        assert!(matches!(credentials(plain), Cow::Borrowed(_)));
        let mixed = "é Bearer abcdefgh12345678 漢字 AKIAIOSFODNN7EXAMPLE ü";
        let once = r(mixed);
        assert_eq!(once, "é Bearer [REDACTED] 漢字 [REDACTED] ü");
        assert_eq!(r(&once), once);
        // Overlapping matches (a bearer token inside an Authorization header) give one marker.
        assert_eq!(r("Authorization: Bearer 0123456789abcdef"), "Authorization: Bearer [REDACTED]");
        assert_eq!(r(""), "");
        assert_eq!(r("-----BEGIN "), "-----BEGIN ");
    }
}
