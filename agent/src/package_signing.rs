//! Package signatures: a detached Ed25519 signature over the bytes of an executor archive.
//!
//! Format of `PKG.tar.gz.sig`: one line, the standard base64 (with padding) of the 64-byte
//! Ed25519 signature of the archive file's bytes exactly as they are (pure Ed25519, RFC 8032,
//! no pre-hash, no context) — what `openssl pkeyutl -sign -rawin -inkey KEY -in PKG.tar.gz |
//! base64 -w0` writes, so a platform can sign with stock tools. Surrounding whitespace is
//! ignored; anything else in the file is an error. The signature names no key: it is checked
//! against every trusted key ([`Trust`]) and the one that verifies is reported (audited).
//!
//! Guarantees:
//! - verification is strict (the same checks as `verify_strict`: a small-order public key or
//!   `R` and a non-canonical `R` or `S` are refused) and streamed — the archive is hashed once
//!   while it is copied into a root-only staging file, and only that copy is unpacked, so what
//!   was verified is what is installed (no time-of-check/time-of-use window on the original);
//! - a signature that is present is never ignored: bad, malformed or not checkable (no trusted
//!   key) refuses the package even when signatures are not required;
//! - with `executors.require_signature: true` an archive without a valid signature from a
//!   trusted key is refused, and so is a directory (a directory has no bytes to sign).

use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine;
use ed25519_dalek::{Signature, Signer, SigningKey, StreamVerifier, VerifyingKey};
use sha2::Digest;

use crate::config::Config;

/// The largest archive that is signed or checked (also the cap of a checked install).
pub const MAX_ARCHIVE_BYTES: u64 = 256 * 1024 * 1024;
/// The largest signature file read.
const MAX_SIG_FILE: u64 = 4096;

/// A public key packages may be signed with, and where it came from (for messages and audit).
#[derive(Clone)]
pub struct TrustedKey {
    pub label: String,
    pub key: VerifyingKey,
}

/// The signature rules of `executors:` — whether a signature is required, and the keys.
#[derive(Clone, Default)]
pub struct Trust {
    pub required: bool,
    pub keys: Vec<TrustedKey>,
}

impl Trust {
    /// `executors.require_signature` and `executors.trusted_keys` (default: the platform key
    /// `agent.platform_public_key`, when set). Unreadable or weak keys are errors naming the
    /// key path; `require_signature` without any key is an error.
    pub fn from_config(c: &Config) -> Result<Trust, String> {
        let e = &c.executors;
        let paths: Vec<(String, PathBuf)> = match &e.trusted_keys {
            Some(list) => {
                list.iter().enumerate().map(|(i, p)| (format!("executors.trusted_keys[{i}]"), p.clone())).collect()
            }
            None => c
                .agent
                .platform_public_key
                .iter()
                .map(|p| ("agent.platform_public_key".to_string(), p.clone()))
                .collect(),
        };
        let mut keys = Vec::new();
        for (what, path) in paths {
            crate::config::check_trust_file(&what, &path)?;
            let key = crate::signing::load_verifying_key(&path).map_err(|err| format!("{what}: {err}"))?;
            if key.is_weak() {
                return Err(format!("{what}: {}: a small-order (weak) key is refused", path.display()));
            }
            keys.push(TrustedKey { label: path.display().to_string(), key });
        }
        if e.require_signature && keys.is_empty() {
            return Err(
                "executors.require_signature: no trusted key (set executors.trusted_keys or agent.platform_public_key)"
                    .into(),
            );
        }
        Ok(Trust { required: e.require_signature, keys })
    }
}

/// `PKG` + `.sig`.
pub fn sig_path(package: &Path) -> PathBuf {
    let mut s = package.as_os_str().to_owned();
    s.push(".sig");
    PathBuf::from(s)
}

pub fn encode(sig: &Signature) -> String {
    base64::engine::general_purpose::STANDARD.encode(sig.to_bytes())
}

/// A signature from its base64 text (one line; surrounding whitespace ignored).
pub fn decode(text: &str) -> Result<Signature, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("the signature is empty".into());
    }
    if t.contains(char::is_whitespace) {
        return Err("the signature must be one line of base64".into());
    }
    let raw =
        base64::engine::general_purpose::STANDARD.decode(t).map_err(|_| "the signature is not base64".to_string())?;
    let bytes = <[u8; 64]>::try_from(raw.as_slice())
        .map_err(|_| format!("the signature is {} bytes, not the 64 of an Ed25519 signature", raw.len()))?;
    Ok(Signature::from_bytes(&bytes))
}

/// A signature file's text (at most 4 KiB). Bytes that are not UTF-8 are kept as U+FFFD:
/// such a file is a bad signature (refused by [`decode`]), not an unreadable file.
pub fn read_signature_file(path: &Path) -> Result<String, String> {
    let bytes = crate::bounded::read_regular(path, MAX_SIG_FILE).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => format!("{}: too large for a signature file", path.display()),
        _ => format!("{}: {e}", path.display()),
    })?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Sign an archive file (pure Ed25519 over its bytes).
pub fn sign_file(path: &Path, key: &SigningKey) -> Result<Signature, String> {
    let bytes = crate::bounded::read_regular(path, MAX_ARCHIVE_BYTES).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidInput => format!("{}: not a file (only archives can be signed)", path.display()),
        std::io::ErrorKind::InvalidData => format!("{}: larger than {MAX_ARCHIVE_BYTES} bytes", path.display()),
        _ => format!("{}: {e}", path.display()),
    })?;
    if !is_archive(&bytes) {
        return Err(format!(
            "{}: not a gzip or tar archive — only package archives are signed (the key may be the platform's, and its signature over other bytes, a command's canonical JSON say, would be that command's signature)",
            path.display()
        ));
    }
    Ok(key.sign(&bytes))
}

/// Whether `bytes` begin as a gzip stream or a tar archive: a first header with the NUL
/// bytes every tar header has, and `ustar` magic (POSIX, GNU, pax) or a valid checksum (old
/// v7 archives). Neither can be a command's canonical JSON — it starts with `{` and holds
/// no raw NUL — so a package signature can never double as a command signature made with
/// the same key.
fn is_archive(bytes: &[u8]) -> bool {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        return true;
    }
    let Some(header) = bytes.get(..512) else { return false };
    header.contains(&0) && (&header[257..262] == b"ustar" || tar_checksum_holds(header))
}

/// A tar header's checksum field (octal, bytes 148–155) equals the sum of its bytes with
/// that field counted as spaces.
fn tar_checksum_holds(header: &[u8]) -> bool {
    let field = &header[148..156];
    let digits: Vec<u8> = field.iter().copied().skip_while(|b| *b == b' ').take_while(u8::is_ascii_digit).collect();
    let Some(stated) = std::str::from_utf8(&digits).ok().and_then(|d| u32::from_str_radix(d, 8).ok()) else {
        return false;
    };
    let sum: u32 =
        header.iter().enumerate().map(|(i, b)| if (148..156).contains(&i) { 0x20 } else { u32::from(*b) }).sum();
    stated == sum
}

/// The outcome for the signature part of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Verified with the trusted key labelled so.
    Valid(String),
    /// No signature given.
    Missing,
    /// A signature that did not verify with any trusted key, or could not be checked.
    Bad(String),
}

impl Verdict {
    /// For the audit log.
    pub fn as_str(&self) -> &str {
        match self {
            Verdict::Valid(_) => "valid",
            Verdict::Missing => "missing",
            Verdict::Bad(_) => "bad",
        }
    }
}

/// Hashes an archive (SHA-256) and checks its signature, chunk by chunk.
pub struct Checker {
    sha: sha2::Sha256,
    /// One streaming verifier per trusted key the signature could be from.
    verifiers: Vec<(String, StreamVerifier)>,
    /// Decided before any byte: missing, or bad (malformed, no key to check with).
    early: Option<Verdict>,
    pub bytes: u64,
}

/// `R` of a signature must be a valid point of large order (as `verify_strict` demands).
fn strict_r(sig: &Signature) -> bool {
    VerifyingKey::from_bytes(sig.r_bytes()).is_ok_and(|r| !r.is_weak())
}

impl Checker {
    pub fn new(signature: Option<&str>, trust: &Trust) -> Checker {
        let mut verifiers = Vec::new();
        let early = match signature.map(decode) {
            None => Some(Verdict::Missing),
            Some(Err(e)) => Some(Verdict::Bad(e)),
            Some(Ok(_)) if trust.keys.is_empty() => Some(Verdict::Bad(
                "there is no trusted key to check the signature with (executors.trusted_keys or agent.platform_public_key)"
                    .into(),
            )),
            Some(Ok(sig)) if !strict_r(&sig) => Some(Verdict::Bad("bad signature (non-canonical or small-order R)".into())),
            Some(Ok(sig)) => {
                for k in &trust.keys {
                    // Err: a non-canonical S, which no key verifies.
                    if let Ok(v) = k.key.verify_stream(&sig) {
                        verifiers.push((k.label.clone(), v));
                    }
                }
                None
            }
        };
        Checker { sha: sha2::Sha256::new(), verifiers, early, bytes: 0 }
    }

    pub fn update(&mut self, chunk: &[u8]) {
        self.sha.update(chunk);
        for (_, v) in &mut self.verifiers {
            v.update(chunk);
        }
        self.bytes += chunk.len() as u64;
    }

    /// The SHA-256 (lowercase hex) and the verdict.
    pub fn finish(self) -> (String, Verdict) {
        let sha: String = self.sha.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if let Some(v) = self.early {
            return (sha, v);
        }
        let n = self.verifiers.len();
        for (label, v) in self.verifiers {
            if v.finalize_and_verify().is_ok() {
                return (sha, Verdict::Valid(label));
            }
        }
        let why = if n == 1 {
            "bad signature: it does not verify with the trusted key (tampered package, or signed by an untrusted key)"
                .to_string()
        } else {
            format!("bad signature: it verifies with none of the {n} trusted keys (tampered package, or signed by an untrusted key)")
        };
        (sha, Verdict::Bad(why))
    }
}

/// Check a file without keeping a copy (`verify --package`, `agent --check-config`).
pub fn check_file(
    path: &Path,
    signature: Option<&str>,
    trust: &Trust,
    max_bytes: u64,
) -> Result<(String, Verdict), String> {
    let mut f = crate::bounded::open_regular(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut c = Checker::new(signature, trust);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = f.read(&mut buf).map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        c.update(&buf[..n]);
        if c.bytes > max_bytes {
            return Err(format!("{}: larger than {max_bytes} bytes", path.display()));
        }
    }
    Ok(c.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trust(keys: &[&SigningKey]) -> Trust {
        Trust {
            required: true,
            keys: keys
                .iter()
                .enumerate()
                .map(|(i, k)| TrustedKey { label: format!("k{i}"), key: k.verifying_key() })
                .collect(),
        }
    }

    fn check(data: &[u8], sig: Option<&str>, t: &Trust) -> Verdict {
        let mut c = Checker::new(sig, t);
        // Uneven chunks: streaming must equal one-shot signing.
        for chunk in data.chunks(7) {
            c.update(chunk);
        }
        c.finish().1
    }

    #[test]
    fn streamed_verification_matches_one_shot_signing() {
        let (a, b) = (SigningKey::from_bytes(&[1; 32]), SigningKey::from_bytes(&[2; 32]));
        let data = b"\x1f\x8b pretend this is an archive of some length".repeat(50);
        let sig = encode(&a.sign(&data));
        assert_eq!(check(&data, Some(&sig), &trust(&[&a])), Verdict::Valid("k0".into()));
        assert_eq!(check(&data, Some(&sig), &trust(&[&b, &a])), Verdict::Valid("k1".into()));
        assert!(matches!(check(&data, Some(&sig), &trust(&[&b])), Verdict::Bad(_)));
        let mut tampered = data.clone();
        tampered[10] ^= 1;
        assert!(matches!(check(&tampered, Some(&sig), &trust(&[&a])), Verdict::Bad(_)));
        assert_eq!(check(&data, None, &trust(&[&a])), Verdict::Missing);
        assert!(matches!(check(&data, Some(&sig), &trust(&[])), Verdict::Bad(m) if m.contains("no trusted key")));
        assert!(matches!(check(&data, Some("!!"), &trust(&[&a])), Verdict::Bad(m) if m.contains("base64")));
        assert!(matches!(check(&data, Some("AAAA"), &trust(&[&a])), Verdict::Bad(m) if m.contains("3 bytes")));
        assert!(matches!(check(&data, Some(&format!("{sig}\n{sig}")), &trust(&[&a])), Verdict::Bad(_)));
        assert_eq!(check(&data, Some(&format!("  {sig}\n")), &trust(&[&a])), Verdict::Valid("k0".into()));
        // An all-zero signature (R = identity, small order) is refused.
        let zero = encode(&Signature::from_bytes(&[0; 64]));
        assert!(matches!(check(&data, Some(&zero), &trust(&[&a])), Verdict::Bad(_)));
    }
}
