//! Command signing (DESIGN.md §6, seed 001): Ed25519 over the RFC 8785 (JCS) canonical JSON
//! of a command without its `signature` field.
//!
//! Guarantees:
//! - a command is parsed strictly before anything else: at most [`MAX_COMMAND_BYTES`],
//!   UTF-8, a JSON object, nesting at most [`MAX_DEPTH`] deep, and **no duplicate keys at any
//!   depth** — a duplicate is an error, never resolved (two parsers picking different values
//!   is how signed-JSON checks get bypassed) —, and every number exactly what its canonical
//!   form says (no integer a double cannot hold: see [`MAX_EXACT_INTEGER`]);
//! - verification is strict Ed25519 (`verify_strict`: no small-order keys, canonical `S`);
//! - the verdict has two independent parts, the signature and the clock skew (the
//!   `timestamp` must be within [`MAX_SKEW_S`] of the verifier's clock); a command is
//!   acceptable only when both pass.
//!
//! Keys are files: the private key as PKCS#8 PEM (`signing.key`, mode 0600), the public key
//! as SubjectPublicKeyInfo PEM (`signing.pub`) — the formats `openssl genpkey -algorithm
//! ed25519` and `openssl pkey -pubout` use. A bare base64 string of the 32 raw bytes is
//! accepted too.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use base64::Engine;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use thiserror::Error;

pub use crate::rfc3339::{format as format_rfc3339, now, parse as parse_rfc3339};

/// The largest command accepted, in bytes.
pub const MAX_COMMAND_BYTES: usize = 1024 * 1024;
/// The deepest nesting accepted.
pub const MAX_DEPTH: usize = 64;
/// The largest difference between a command's `timestamp` and the verifier's clock.
pub const MAX_SKEW_S: i64 = 300;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SigningError {
    #[error("command is {0} bytes, more than the {MAX_COMMAND_BYTES} accepted")]
    TooLarge(usize),
    #[error("command is not valid JSON: {0}")]
    Parse(String),
    #[error("command must be a JSON object")]
    NotAnObject,
    #[error("{0}")]
    Key(String),
    #[error("cannot canonicalise the command: {0}")]
    Canonical(String),
    #[error("timestamp {0}: not an RFC 3339 date-time (YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)); the command could never verify")]
    Timestamp(String),
}

// ---------------------------------------------------------------------------------------
// Strict parsing
// ---------------------------------------------------------------------------------------

/// 2^53 − 1: every integer up to this is exact as an IEEE 754 double (I-JSON, RFC 7493 §2.2).
pub const MAX_EXACT_INTEGER: u64 = (1 << 53) - 1;

fn inexact(v: impl fmt::Display) -> String {
    format!(
        "the number {v} is not exactly representable as an IEEE 754 double \
         (RFC 8785 signs numbers as doubles: write it as a string)"
    )
}

/// Whether the integer literal `literal` is exactly how RFC 8785 writes the double `f` (its
/// nearest double): the shortest digits that round-trip, e.g. `33333336303333210` for the
/// double 33333336303333208. Such a literal is what a canonical form itself contains, so it
/// denotes that double and nothing else — unlike `9007199254740993`, which RFC 8785 would
/// sign as `9007199254740992`.
fn is_canonical_text(f: f64, literal: impl fmt::Display) -> bool {
    serde_json::Number::from_f64(f)
        .and_then(|n| serde_json_canonicalizer::to_string(&Value::Number(n)).ok())
        .is_some_and(|text| text == literal.to_string())
}

/// A JSON value parsed with duplicate keys rejected and nesting bounded.
///
/// Numbers are held as RFC 8785 signs them, as IEEE 754 doubles: an integer that a double
/// cannot hold exactly (e.g. 9007199254740993) is refused — the signature would cover a
/// different number than the one acted on —, integral values up to 2^53 − 1 are integers
/// (`1.0` is `1`, as canonicalised) and larger ones doubles. So a parsed command is exactly
/// the command its canonical form (the signed bytes) parses to.
struct Strict(Value);

struct StrictVisitor {
    depth: usize,
}

impl<'de> de::DeserializeSeed<'de> for StrictVisitor {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        if v.unsigned_abs() <= MAX_EXACT_INTEGER {
            return Ok(Value::from(v));
        }
        let f = v as f64;
        let exact = (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&f) && f as i64 == v;
        if exact || is_canonical_text(f, v) {
            return self.visit_f64(f);
        }
        Err(E::custom(inexact(v)))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        if v <= MAX_EXACT_INTEGER {
            return Ok(Value::from(v));
        }
        let f = v as f64;
        if (f < 18_446_744_073_709_551_616.0 && f as u64 == v) || is_canonical_text(f, v) {
            return self.visit_f64(f);
        }
        Err(E::custom(inexact(v)))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        // An integral value within the exact range is the integer RFC 8785 writes for it.
        if v.fract() == 0.0 && v.abs() <= MAX_EXACT_INTEGER as f64 {
            return Ok(Value::from(v as i64));
        }
        serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("number out of range"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        if self.depth >= MAX_DEPTH {
            return Err(de::Error::custom(format!("nested more than {MAX_DEPTH} deep")));
        }
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictVisitor { depth: self.depth + 1 })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        if self.depth >= MAX_DEPTH {
            return Err(de::Error::custom(format!("nested more than {MAX_DEPTH} deep")));
        }
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key {key:?}")));
            }
            let v = map.next_value_seed(StrictVisitor { depth: self.depth + 1 })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

impl<'de> de::Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor { depth: 0 }).map(Strict)
    }
}

/// Parse a command: size, UTF-8, JSON, no duplicate keys, bounded depth, an object.
pub fn parse_command(bytes: &[u8]) -> Result<Map<String, Value>, SigningError> {
    if bytes.len() > MAX_COMMAND_BYTES {
        return Err(SigningError::TooLarge(bytes.len()));
    }
    let text = std::str::from_utf8(bytes).map_err(|e| SigningError::Parse(format!("not UTF-8 ({e})")))?;
    let mut de = serde_json::Deserializer::from_str(text);
    // serde_json's own recursion guard stays on; ours is lower and names the limit.
    let Strict(v) = de::Deserialize::deserialize(&mut de).map_err(|e| SigningError::Parse(e.to_string()))?;
    de.end().map_err(|e| SigningError::Parse(e.to_string()))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(SigningError::NotAnObject),
    }
}

/// Parse any JSON value strictly (the same rules as [`parse_command`], any top level).
pub fn parse_strict(bytes: &[u8]) -> Result<Value, SigningError> {
    let text = std::str::from_utf8(bytes).map_err(|e| SigningError::Parse(format!("not UTF-8 ({e})")))?;
    let mut de = serde_json::Deserializer::from_str(text);
    let Strict(v) = de::Deserialize::deserialize(&mut de).map_err(|e| SigningError::Parse(e.to_string()))?;
    de.end().map_err(|e| SigningError::Parse(e.to_string()))?;
    Ok(v)
}

/// The bytes that are signed: the RFC 8785 canonical form of `cmd` without `signature`.
pub fn signed_bytes(cmd: &Map<String, Value>) -> Result<Vec<u8>, SigningError> {
    let mut unsigned = cmd.clone();
    unsigned.remove("signature");
    serde_json_canonicalizer::to_vec(&Value::Object(unsigned)).map_err(|e| SigningError::Canonical(e.to_string()))
}

// ---------------------------------------------------------------------------------------
// Sign and verify
// ---------------------------------------------------------------------------------------

/// Sign `cmd` in place: add `timestamp` (now) when absent, replace any `signature`.
pub fn sign(cmd: &mut Map<String, Value>, key: &SigningKey, now: i64) -> Result<(), SigningError> {
    match cmd.get("timestamp") {
        None => {
            cmd.insert("timestamp".into(), Value::String(format_rfc3339(now)));
        }
        Some(Value::String(t)) if parse_rfc3339(t).is_some() => {}
        Some(other) => return Err(SigningError::Timestamp(other.to_string())),
    }
    let sig = key.sign(&signed_bytes(cmd)?);
    cmd.insert("signature".into(), Value::String(base64::engine::general_purpose::STANDARD.encode(sig.to_bytes())));
    Ok(())
}

/// The two parts of a verification.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Verdict {
    /// `Ok` when the signature verifies; else why not (missing, malformed, bad).
    pub signature: Result<(), String>,
    /// `Ok(skew)` (command time minus verifier time, seconds) when within the window; else why not.
    pub timestamp: Result<i64, String>,
}

impl Verdict {
    pub fn valid(&self) -> bool {
        self.signature.is_ok() && self.timestamp.is_ok()
    }
}

pub fn verify(cmd: &Map<String, Value>, key: &VerifyingKey, now: i64) -> Result<Verdict, SigningError> {
    let signature = match cmd.get("signature") {
        None => Err("missing signature".to_string()),
        Some(Value::String(s)) => match base64::engine::general_purpose::STANDARD.decode(s) {
            Err(_) => Err("signature is not base64".to_string()),
            Ok(raw) => match <[u8; 64]>::try_from(raw.as_slice()) {
                Err(_) => Err(format!("signature is {} bytes, not 64", raw.len())),
                Ok(bytes) => key
                    .verify_strict(&signed_bytes(cmd)?, &Signature::from_bytes(&bytes))
                    .map_err(|_| "bad signature".to_string()),
            },
        },
        Some(_) => Err("signature is not a string".to_string()),
    };
    let timestamp = match cmd.get("timestamp") {
        None => Err("missing timestamp".to_string()),
        Some(Value::String(t)) => match parse_rfc3339(t) {
            None => Err(format!("timestamp {t:?} is not an RFC 3339 date-time")),
            Some(at) => {
                let skew = at - now;
                if skew.abs() > MAX_SKEW_S {
                    Err(format!(
                        "timestamp is {}s {} the agent's clock (more than {MAX_SKEW_S}s)",
                        skew.abs(),
                        if skew > 0 { "ahead of" } else { "behind" }
                    ))
                } else {
                    Ok(skew)
                }
            }
        },
        Some(_) => Err("timestamp is not a string".to_string()),
    };
    Ok(Verdict { signature, timestamp })
}

// ---------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------

/// The most a key file may hold (a PEM Ed25519 key is under 200 bytes).
pub const MAX_KEY_FILE_BYTES: u64 = 64 * 1024;

/// A key file's text: a regular file (a FIFO would block, a device like /dev/zero never
/// ends) of at most [`MAX_KEY_FILE_BYTES`], read with that cap whatever its size claims.
fn read_key_text(path: &Path, what: &str) -> Result<String, SigningError> {
    use std::io::ErrorKind;
    let bytes = crate::bounded::read_regular(path, MAX_KEY_FILE_BYTES).map_err(|e| {
        SigningError::Key(match e.kind() {
            ErrorKind::InvalidInput => format!("{}: not a regular file; a {what} must be one", path.display()),
            ErrorKind::InvalidData => {
                format!("{}: too large for a {what} (more than {MAX_KEY_FILE_BYTES} bytes)", path.display())
            }
            _ => format!("{}: {e}", path.display()),
        })
    })?;
    String::from_utf8(bytes).map_err(|e| {
        // A private key's bytes are wiped, whatever they hold.
        zeroize::Zeroize::zeroize(&mut e.into_bytes());
        SigningError::Key(format!("{}: not UTF-8 text", path.display()))
    })
}

fn raw32(text: &str) -> Option<[u8; 32]> {
    let raw = base64::engine::general_purpose::STANDARD.decode(text.trim()).ok()?;
    <[u8; 32]>::try_from(raw.as_slice()).ok()
}

/// A private key file: PKCS#8 PEM or base64 of the 32-byte seed. Refused unless only its
/// owner can read it.
pub fn load_signing_key(path: &Path) -> Result<SigningKey, SigningError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| SigningError::Key(format!("{}: {e}", path.display())))?;
    if meta.mode() & 0o077 != 0 {
        return Err(SigningError::Key(format!(
            "{}: a private key must not be readable by group or others (mode {:o}; chmod 600)",
            path.display(),
            meta.mode() & 0o777
        )));
    }
    let text = zeroize::Zeroizing::new(read_key_text(path, "private key")?);
    if let Some(seed) = raw32(&text) {
        return Ok(SigningKey::from_bytes(&seed));
    }
    SigningKey::from_pkcs8_pem(&text).map_err(|e| {
        SigningError::Key(format!("{}: not an Ed25519 private key (PKCS#8 PEM or base64): {e}", path.display()))
    })
}

/// A public key file: SubjectPublicKeyInfo PEM or base64 of the 32 bytes.
pub fn load_verifying_key(path: &Path) -> Result<VerifyingKey, SigningError> {
    let text = read_key_text(path, "public key")?;
    if let Some(raw) = raw32(&text) {
        return VerifyingKey::from_bytes(&raw)
            .map_err(|e| SigningError::Key(format!("{}: not a valid Ed25519 public key: {e}", path.display())));
    }
    VerifyingKey::from_public_key_pem(&text)
        .map_err(|e| SigningError::Key(format!("{}: not an Ed25519 public key (PEM or base64): {e}", path.display())))
}

/// Write a new key pair to `dir/signing.key` (0600) and `dir/signing.pub`; never overwrites.
pub fn keygen(dir: &Path) -> Result<(PathBuf, PathBuf), SigningError> {
    let err = |p: &Path, e: std::io::Error| SigningError::Key(format!("{}: {e}", p.display()));
    std::fs::create_dir_all(dir).map_err(|e| err(dir, e))?;
    let (key_path, pub_path) = (dir.join("signing.key"), dir.join("signing.pub"));
    for p in [&key_path, &pub_path] {
        if p.exists() {
            return Err(SigningError::Key(format!("{}: exists; refusing to overwrite a key", p.display())));
        }
    }
    let mut seed = zeroize::Zeroizing::new([0u8; 32]);
    crate::random::fill(&mut seed[..]).map_err(|e| SigningError::Key(format!("random bytes: {e}")))?;
    let key = SigningKey::from_bytes(&seed);
    // PKCS#8 v1 (no embedded public key): the form OpenSSL writes and reads.
    let pem = ed25519_dalek::pkcs8::KeypairBytes { secret_key: *seed, public_key: None }
        .to_pkcs8_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)
        .map_err(|e| SigningError::Key(format!("encode the private key: {e}")))?;
    let public = key
        .verifying_key()
        .to_public_key_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)
        .map_err(|e| SigningError::Key(format!("encode the public key: {e}")))?;
    // Each file is written whole to a temporary name in the same directory, synced, then
    // hard-linked to its name (which fails when the name exists: never an overwrite) and
    // the temporary name removed, and the directory synced. A full disk or any other
    // failure leaves no partial key behind, so a retry is not refused.
    let write = |p: &Path, mode: u32, data: &[u8]| -> Result<(), SigningError> {
        let mut tmp = p.as_os_str().to_owned();
        tmp.push(format!(".tmp-{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let mut f =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp).map_err(|e| err(p, e))?;
        let done = f.write_all(data).and_then(|()| f.sync_all()).and_then(|()| std::fs::hard_link(&tmp, p));
        drop(f);
        let _ = std::fs::remove_file(&tmp);
        done.map_err(|e| err(p, e))?;
        // The new name on the disk too, or no key: one the disk may lose is taken back, so
        // that a retry is not refused.
        if let Err(e) = std::fs::File::open(dir).and_then(|d| d.sync_all()) {
            let _ = std::fs::remove_file(p);
            return Err(err(p, e));
        }
        Ok(())
    };
    write(&key_path, 0o600, pem.as_bytes())?;
    if let Err(e) = write(&pub_path, 0o644, public.as_bytes()) {
        let _ = std::fs::remove_file(&key_path);
        return Err(e);
    }
    Ok((key_path, pub_path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> String {
        let m = parse_command(text.as_bytes()).unwrap();
        String::from_utf8(serde_json_canonicalizer::to_vec(&Value::Object(m)).unwrap()).unwrap()
    }

    #[test]
    fn rfc8785_vectors() {
        // RFC 8785 §3.2.2 (the example of the specification).
        let input = r#"{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
            "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
            "literals": [null, true, false]}"#;
        assert_eq!(
            canon(input),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
        // Key order by UTF-16 code units (RFC 8785 §3.2.3).
        let input = r#"{"\u20ac": "Euro Sign", "\r": "Carriage Return", "\ufb33": "Hebrew Letter Dalet With Dagesh",
            "1": "One", "\ud83d\ude00": "Emoji: Grinning Face", "\u0080": "Control", "\u00f6": "Latin Small Letter O With Diaeresis"}"#;
        assert_eq!(
            canon(input),
            "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\"😀\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
        // Number forms (RFC 8785 appendix B).
        for (n, want) in [
            ("0", "0"),
            ("-0", "0"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("0.000001", "0.000001"),
            ("1e-7", "1e-7"),
            ("9007199254740992", "9007199254740992"),
            ("-1.5", "-1.5"),
            ("5e-324", "5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ] {
            assert_eq!(canon(&format!("{{\"n\":{n}}}")), format!("{{\"n\":{want}}}"), "{n}");
        }
        // Nested objects are sorted too; whitespace disappears.
        assert_eq!(
            canon(r#"{ "b": {"z": 1, "a": [ {"y":2,"x":1} ]}, "a": "" }"#),
            r#"{"a":"","b":{"a":[{"x":1,"y":2}],"z":1}}"#
        );
    }

    #[test]
    fn strict_parsing_rejects_duplicates_depth_size_and_non_objects() {
        let e = parse_command(br#"{"a": 1, "a": 2}"#).unwrap_err();
        assert!(e.to_string().contains("duplicate key \"a\""), "{e}");
        let e = parse_command(br#"{"p": {"x": {"k": 1, "k": 1}}}"#).unwrap_err();
        assert!(e.to_string().contains("duplicate key \"k\""), "{e}");
        let deep = format!("{{\"a\":{}1{}}}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(parse_command(deep.as_bytes()).unwrap_err().to_string().contains("deep"));
        assert_eq!(parse_command(b"[1]").unwrap_err(), SigningError::NotAnObject);
        assert!(matches!(parse_command(&[b'{', 0xff, b'}']).unwrap_err(), SigningError::Parse(_)));
        assert!(matches!(parse_command(b"{} {}").unwrap_err(), SigningError::Parse(_)));
        let big = vec![b' '; MAX_COMMAND_BYTES + 1];
        assert!(matches!(parse_command(&big).unwrap_err(), SigningError::TooLarge(_)));
    }

    /// Found by the `command` fuzz target: 9007199254740993 parsed as that integer, but the
    /// canonical form (what is signed) wrote the nearest double, 9007199254740992 — the
    /// signature covered a different number than the one the executor would get. And `1.0`
    /// parsed as a double whose canonical form `1` parses back as an integer. And (2026-11-23)
    /// 33333336303333208, an exact double whose canonical form `33333336303333210` is not
    /// itself an exact double and was refused: the canonical form of an accepted command did
    /// not parse. Digits that are neither a double's exact value nor its canonical text stay
    /// refused.
    #[test]
    fn numbers_are_what_the_canonical_form_says() {
        for n in [
            "9007199254740993",
            "-9007199254740993",
            "18446744073709551615",
            "-9223372036854775807",
            "33333336303333209",
            "33333336303333211",
        ] {
            let e = parse_command(format!("{{\"n\":{n}}}").as_bytes()).unwrap_err();
            assert!(e.to_string().contains("not exactly representable"), "{n}: {e}");
        }
        for (n, canonical) in [
            ("9007199254740991", "9007199254740991"),
            ("-9007199254740991", "-9007199254740991"),
            ("9007199254740992", "9007199254740992"),
            ("10000000000000000000", "10000000000000000000"),
            ("-9223372036854775808", "-9223372036854776000"),
            ("1.0", "1"),
            ("-0.0", "0"),
            ("1e2", "100"),
            ("1.5", "1.5"),
            ("1e300", "1e+300"),
            ("33333336303333208", "33333336303333210"),
            ("33333336303333210", "33333336303333210"),
            ("-33333336303333210", "-33333336303333210"),
            ("18014398509481988", "18014398509481988"),
        ] {
            let cmd = parse_command(format!("{{\"n\":{n}}}").as_bytes()).unwrap();
            let bytes = signed_bytes(&cmd).unwrap();
            assert_eq!(String::from_utf8_lossy(&bytes), format!("{{\"n\":{canonical}}}"), "{n}");
            assert_eq!(parse_command(&bytes).unwrap(), cmd, "{n}: the canonical form is the same command");
        }
    }

    #[test]
    fn sign_then_verify_and_tamper() {
        let key = SigningKey::from_bytes(&[7u8; 32]);
        let vk = key.verifying_key();
        let now = parse_rfc3339("2026-04-28T12:00:00Z").unwrap();
        let mut cmd = parse_command(
            br#"{"command_id":"cmd-8821","action":"execute","executor":"port-scanner","parameters":{"target_host":"10.0.1.5","ports":[22,80]}}"#,
        )
        .unwrap();
        sign(&mut cmd, &key, now).unwrap();
        assert_eq!(cmd["timestamp"], "2026-04-28T12:00:00Z");
        let v = verify(&cmd, &vk, now + 10).unwrap();
        assert!(v.valid(), "{v:?}");
        assert_eq!(v.timestamp, Ok(-10));
        // Tampered parameters.
        let mut bad = cmd.clone();
        bad["parameters"]["ports"] = serde_json::json!([22, 80, 443]);
        assert_eq!(verify(&bad, &vk, now).unwrap().signature, Err("bad signature".into()));
        // Key order and whitespace do not matter (canonical form).
        let reordered = r#"{"signature":"SIG","timestamp":"2026-04-28T12:00:00Z","parameters":{"ports":[22,80],"target_host":"10.0.1.5"},"executor":"port-scanner","action":"execute","command_id":"cmd-8821"}"#
            .replace("SIG", cmd["signature"].as_str().unwrap());
        assert!(verify(&parse_command(reordered.as_bytes()).unwrap(), &vk, now).unwrap().valid());
        // Skew: 6 minutes either way.
        assert!(verify(&cmd, &vk, now + 360).unwrap().timestamp.unwrap_err().contains("behind"));
        assert!(verify(&cmd, &vk, now - 360).unwrap().timestamp.unwrap_err().contains("ahead"));
        // Another key.
        let other = SigningKey::from_bytes(&[8u8; 32]).verifying_key();
        assert!(verify(&cmd, &other, now).unwrap().signature.is_err());
        // Missing or malformed signature.
        let mut none = cmd.clone();
        none.remove("signature");
        assert_eq!(verify(&none, &vk, now).unwrap().signature, Err("missing signature".into()));
        none.insert("signature".into(), Value::from("!!"));
        assert_eq!(verify(&none, &vk, now).unwrap().signature, Err("signature is not base64".into()));
    }
}
