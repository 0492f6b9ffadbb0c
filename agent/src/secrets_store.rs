//! The built-in encrypted secrets store (DESIGN.md §6): `/etc/opservant/secrets.enc`, sealed
//! with AES-256-GCM under a 256-bit key read from a root-only file or a systemd credential.
//!
//! # The file (version 1)
//!
//! ```json
//! {"format": "opservant-secrets", "version": 1, "cipher": "aes-256-gcm", "key_id": "<16 hex>",
//!  "entries": {"api_key": {"nonce": "<base64, 12 bytes>", "ct": "<base64, ciphertext ‖ tag>"}},
//!  "seal": {"nonce": "<base64, 12 bytes>", "tag": "<base64, 16 bytes>"}}
//! ```
//!
//! Why this shape:
//! - **Each value is encrypted on its own**, with a fresh random 96-bit nonce and the entry's
//!   name in the associated data. `secrets get` and an executor's `get_secret(name)` decrypt
//!   exactly the one value asked for, when it is asked for; no other plaintext ever exists in
//!   memory. A ciphertext moved under another name does not authenticate.
//! - **Names are not secret** — manifests declare them and the audit log records them — so they
//!   are kept in the clear and `secrets list` decrypts no value at all.
//! - **The whole file is still authenticated.** `seal` is a GCM tag over an empty message whose
//!   associated data is the format version, the key id and every entry (name, nonce,
//!   ciphertext) in order. Deleting, adding, renaming, reordering or swapping entries, or
//!   splicing in entries of another file sealed with the same key, is detected by every command
//!   that opens the store — `list` included, which is why `list` needs the key too. (Putting an
//!   older but complete copy of the whole file back cannot be detected from the file alone.)
//! - `key_id` (the first 8 bytes of SHA-256 over a domain label and the key) lets an error say
//!   "this is not the key the store was written with" rather than "the file was altered". It
//!   reveals nothing usable about a random 256-bit key.
//! - No KDF: the key is 32 random bytes, never a passphrase.
//!
//! # The key
//!
//! `$CREDENTIALS_DIRECTORY/opservant-secrets-key` when systemd provides that credential
//! (`LoadCredential=`/`LoadCredentialEncrypted=`), else `secrets.key_file` (default
//! `/etc/opservant/secrets.key`). Either must be a regular file owned by root (or by the user
//! opservant runs as) with no group or other access, holding 32 raw bytes, 64 hexadecimal
//! digits or the base64 of 32 bytes. `secrets set` creates the key file (64 hex digits, mode
//! 0600, from the kernel's random generator) only when no credential is present, no key file
//! exists *and no store exists* — a new key could not read an existing store.
//!
//! # Guarantees
//!
//! - Plaintext values live only in [`Zeroizing`] buffers, wiped when dropped; they are never
//!   written anywhere. The key is held the same way.
//! - Every change is written atomically: a temporary file in the store's directory (mode 0600),
//!   fsync, rename over the store, fsync of the directory. An error before the rename leaves
//!   the previous store exactly as it was; one in the directory's fsync after it leaves the
//!   new store in place but not known to be on the disk (reported as an error all the same).
//!   The key file is created the same way and never overwritten.
//! - A wrong key, an altered or truncated file, an unknown version or malformed JSON is a
//!   [`StoreError`] naming the store — never garbage, never a panic — and nothing is written.
//! - The store and key must be owned by root (or the running user) with mode 0600 or stricter;
//!   anything more open is refused.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions, Permissions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use aes_gcm::aead::{AeadInOut, Key, KeyInit};
use aes_gcm::Aes256Gcm;
use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;
use zeroize::{Zeroize, Zeroizing};

use crate::config::SecretsSection;

pub const DEFAULT_STORE: &str = "/etc/opservant/secrets.enc";
pub const DEFAULT_KEY_FILE: &str = "/etc/opservant/secrets.key";
/// The systemd credential holding the key (`LoadCredential=opservant-secrets-key:…`).
pub const CREDENTIAL_NAME: &str = "opservant-secrets-key";
/// Largest value, in bytes.
pub const MAX_VALUE: usize = 64 * 1024;
/// Longest name, in bytes.
pub const MAX_NAME: usize = 128;

const FORMAT: &str = "opservant-secrets";
const VERSION: u64 = 1;
const CIPHER: &str = "aes-256-gcm";
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
const MAX_STORE_FILE: u64 = 64 * 1024 * 1024;
const MAX_KEY_FILE: u64 = 4096;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error(
        "{what} {}: must be a regular file owned by root with mode 0600 or stricter (is uid {uid}, mode {mode:04o})",
        path.display()
    )]
    Exposed { what: &'static str, path: PathBuf, uid: u32, mode: u32 },
    #[error("{what} {}: {message}", path.display())]
    BadKey { what: &'static str, path: PathBuf, message: String },
    #[error(
        "secrets store {} exists but has no key: {} does not exist and $CREDENTIALS_DIRECTORY holds no {CREDENTIAL_NAME} credential",
        store.display(), key_file.display()
    )]
    NoKey { store: PathBuf, key_file: PathBuf },
    #[error("secrets store {}: {message}", path.display())]
    Malformed { path: PathBuf, message: String },
    #[error(
        "secrets store {}: wrong key — the store was written with key id {store_key_id}, {key} has key id {key_id}",
        path.display()
    )]
    WrongKey { path: PathBuf, store_key_id: String, key: String, key_id: String },
    #[error("secrets store {}: {message}: the file was altered or damaged (left as it is)", path.display())]
    Tampered { path: PathBuf, message: String },
    #[error("secret '{name}' is not in the secrets store {}", path.display())]
    NotFound { name: String, path: PathBuf },
    #[error("invalid secret name {0:?}: use 1-{MAX_NAME} characters of A-Z a-z 0-9 _ . / -")]
    BadName(String),
    #[error("secret value: {0}")]
    BadValue(String),
    #[error("random numbers: {0}")]
    Random(std::io::Error),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { what, path: path.to_path_buf(), source }
}

/// The same rule as a manifest's `permissions.secrets` names (`[A-Za-z0-9_./-]`), at most
/// [`MAX_NAME`] long. Names never contain NUL or a line break, which the seal relies on.
pub fn check_name(name: &str) -> Result<(), StoreError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.bytes().all(|c| c.is_ascii_alphanumeric() || b"_./-".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(StoreError::BadName(name.to_string()))
    }
}

/// Where the store and its key file are, from the `secrets` section of the configuration.
#[derive(Debug, Clone)]
pub struct Location {
    pub store: PathBuf,
    pub key_file: PathBuf,
}

/// Where the key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `$CREDENTIALS_DIRECTORY/opservant-secrets-key` (systemd).
    Credential(PathBuf),
    /// `secrets.key_file`.
    File(PathBuf),
}

impl KeySource {
    /// The systemd credential when it is present, else the key file.
    pub fn locate(key_file: &Path) -> KeySource {
        if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY").filter(|d| !d.is_empty()) {
            let p = Path::new(&dir).join(CREDENTIAL_NAME);
            if std::fs::symlink_metadata(&p).is_ok() {
                return KeySource::Credential(p);
            }
        }
        KeySource::File(key_file.to_path_buf())
    }

    fn what(&self) -> &'static str {
        match self {
            KeySource::Credential(_) => "systemd credential",
            KeySource::File(_) => "secrets key",
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            KeySource::Credential(p) | KeySource::File(p) => p,
        }
    }

    /// "secrets key /etc/opservant/secrets.key", for messages.
    pub fn describe(&self) -> String {
        format!("{} {}", self.what(), self.path().display())
    }
}

impl Location {
    pub fn from_config(s: &SecretsSection) -> Location {
        Location {
            store: s.store.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_STORE)),
            key_file: s.key_file.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_KEY_FILE)),
        }
    }

    pub fn key_source(&self) -> KeySource {
        KeySource::locate(&self.key_file)
    }

    fn store_exists(&self) -> Result<bool, StoreError> {
        match std::fs::symlink_metadata(&self.store) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(StoreError::Io { what: "secrets store", path: self.store.clone(), source: e }),
        }
    }

    /// The store, opened and verified with its key; `None` when there is no store file (then
    /// no key is needed: there is nothing to read).
    pub fn open_existing(&self) -> Result<Option<Store>, StoreError> {
        if !self.store_exists()? {
            return Ok(None);
        }
        let source = self.key_source();
        if let KeySource::File(p) = &source {
            if !p.exists() {
                return Err(StoreError::NoKey { store: self.store.clone(), key_file: p.clone() });
            }
        }
        let key = SecretKey::load(&source)?;
        Store::open(&self.store, key).map(Some)
    }

    /// The store for a change: the existing one, or a new empty one — with a new key file when
    /// there is neither a key nor a store. Returns the path of a key file it created.
    pub fn open_or_create(&self) -> Result<(Store, Option<PathBuf>), StoreError> {
        if let Some(store) = self.open_existing()? {
            return Ok((store, None));
        }
        let source = self.key_source();
        match &source {
            KeySource::File(p) if !p.exists() => {
                let key = SecretKey::create(p)?;
                Ok((Store::empty(&self.store, key), Some(p.clone())))
            }
            _ => Ok((Store::empty(&self.store, SecretKey::load(&source)?), None)),
        }
    }

    /// Serialise changes to the store (an exclusive `flock` on its directory, created mode
    /// 0700 when missing); released when dropped. Readers need no lock: the store is only
    /// ever replaced whole, by rename.
    pub fn lock(&self) -> Result<StoreLock, StoreError> {
        let dir = parent_dir(&self.store);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err("secrets store directory", dir))?;
        let f = File::open(dir).map_err(io_err("secrets store directory", dir))?;
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
            .map(StoreLock)
            .map_err(|(_, e)| StoreError::Io { what: "locking", path: dir.to_path_buf(), source: e.into() })
    }
}

/// Held while a store is changed (see [`Location::lock`]).
pub struct StoreLock(#[allow(dead_code)] nix::fcntl::Flock<File>);

/// The 256-bit store key, wiped when dropped.
pub struct SecretKey {
    bytes: Zeroizing<[u8; 32]>,
    /// Where it came from, for messages.
    origin: String,
}

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretKey({}, id {})", self.origin, self.id())
    }
}

impl SecretKey {
    /// Read and check a key file or credential (see the module documentation).
    pub fn load(source: &KeySource) -> Result<SecretKey, StoreError> {
        let (what, path) = (source.what(), source.path());
        let f = open_private(what, path)?;
        let mut raw = Zeroizing::new(Vec::with_capacity(MAX_KEY_FILE as usize + 1));
        f.take(MAX_KEY_FILE + 1).read_to_end(&mut raw).map_err(io_err(what, path))?;
        let bytes = parse_key(&raw).ok_or_else(|| StoreError::BadKey {
            what,
            path: path.to_path_buf(),
            message: "must hold a 256-bit key: 32 raw bytes, 64 hexadecimal digits or the base64 of 32 bytes".into(),
        })?;
        Ok(SecretKey { bytes, origin: source.describe() })
    }

    /// A new random key, written to `path` (64 hex digits, mode 0600) — never over an existing
    /// file.
    pub fn create(path: &Path) -> Result<SecretKey, StoreError> {
        let mut bytes = Zeroizing::new([0u8; 32]);
        crate::random::fill(&mut bytes[..]).map_err(StoreError::Random)?;
        let mut text = Zeroizing::new(String::with_capacity(65));
        for b in bytes.iter() {
            text.push(char::from(HEX[usize::from(b >> 4)]));
            text.push(char::from(HEX[usize::from(b & 15)]));
        }
        text.push('\n');
        let dir = parent_dir(path);
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io_err("secrets key", path))?;
        write_new(path, text.as_bytes()).map_err(io_err("secrets key", path))?;
        Ok(SecretKey { bytes, origin: KeySource::File(path.to_path_buf()).describe() })
    }

    /// A key from its bytes (tests, and callers that hold the key some other way).
    pub fn from_bytes(bytes: [u8; 32], origin: &str) -> SecretKey {
        let mut b = bytes;
        let key = SecretKey { bytes: Zeroizing::new(b), origin: origin.to_string() };
        b.zeroize();
        key
    }

    /// First 8 bytes of SHA-256("opservant-secrets key id\0" ‖ key), hex.
    pub fn id(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"opservant-secrets key id\0");
        h.update(&self.bytes[..]);
        h.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    fn cipher(&self) -> Aes256Gcm {
        let key: &Key<Aes256Gcm> = (&*self.bytes).into();
        Aes256Gcm::new(key)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// 32 raw bytes, 64 hex digits or base64 of 32 bytes (the text forms may end in a newline).
fn parse_key(raw: &[u8]) -> Option<Zeroizing<[u8; 32]>> {
    let mut key = Zeroizing::new([0u8; 32]);
    if raw.len() == 32 {
        key.copy_from_slice(raw);
        return Some(key);
    }
    let text = raw.trim_ascii();
    if text.len() == 64 {
        for (i, pair) in text.chunks_exact(2).enumerate() {
            key[i] = (hex_val(pair[0])? << 4) | hex_val(pair[1])?;
        }
        return Some(key);
    }
    if text.len() == 44 {
        let mut out = Zeroizing::new([0u8; 33]);
        if B64.decode_slice(text, &mut out[..]).ok()? == 32 {
            key.copy_from_slice(&out[..32]);
            return Some(key);
        }
    }
    None
}

/// One sealed value.
#[derive(Clone)]
struct Sealed {
    nonce: [u8; NONCE_LEN],
    /// Ciphertext followed by the 16-byte tag.
    ct: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileV1 {
    format: String,
    version: u64,
    cipher: String,
    key_id: String,
    entries: BTreeMap<String, EntryJson>,
    seal: SealJson,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryJson {
    nonce: String,
    ct: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SealJson {
    nonce: String,
    tag: String,
}

fn entry_aad(name: &str) -> Vec<u8> {
    let mut a = b"opservant-secrets\0v1\0entry\0".to_vec();
    a.extend_from_slice(name.as_bytes());
    a
}

/// Associated data of the seal: the version, the key id and every entry, unambiguously (names
/// hold no NUL; nonces have a fixed length; ciphertexts are length-prefixed).
fn seal_aad(key_id: &str, entries: &BTreeMap<String, Sealed>) -> Vec<u8> {
    let mut a = b"opservant-secrets\0v1\0aes-256-gcm\0seal\0".to_vec();
    a.extend_from_slice(key_id.as_bytes());
    a.push(0);
    for (name, s) in entries {
        a.extend_from_slice(name.as_bytes());
        a.push(0);
        a.extend_from_slice(&s.nonce);
        a.extend_from_slice(&(s.ct.len() as u64).to_be_bytes());
        a.extend_from_slice(&s.ct);
    }
    a
}

/// An opened, verified store. Values stay encrypted until [`Store::get`].
pub struct Store {
    path: PathBuf,
    key: SecretKey,
    entries: BTreeMap<String, Sealed>,
}

impl Store {
    /// A store with no entries yet, to be written to `path`.
    pub fn empty(path: &Path, key: SecretKey) -> Store {
        Store { path: path.to_path_buf(), key, entries: BTreeMap::new() }
    }

    /// Read `path` and verify it with `key` (no value is decrypted). A missing file is an
    /// empty store.
    pub fn open(path: &Path, key: SecretKey) -> Result<Store, StoreError> {
        let mut f = match open_private("secrets store", path) {
            Ok(f) => f,
            Err(StoreError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Store::empty(path, key))
            }
            Err(e) => return Err(e),
        };
        let mut text = Vec::new();
        (&mut f).take(MAX_STORE_FILE + 1).read_to_end(&mut text).map_err(io_err("secrets store", path))?;
        if text.len() as u64 > MAX_STORE_FILE {
            return Err(malformed(path, format!("larger than {MAX_STORE_FILE} bytes")));
        }
        Self::parse(path, &text, key)
    }

    fn parse(path: &Path, text: &[u8], key: SecretKey) -> Result<Store, StoreError> {
        let v: serde_json::Value = serde_json::from_slice(text)
            .map_err(|e| malformed(path, format!("not an opservant secrets store (not JSON: {e})")))?;
        if v.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(malformed(path, format!("not an opservant secrets store (no \"format\": \"{FORMAT}\")")));
        }
        match v.get("version").and_then(|x| x.as_u64()) {
            Some(VERSION) => {}
            Some(other) => {
                return Err(malformed(
                    path,
                    format!("format version {other} is not supported by this opservant (it reads version {VERSION})"),
                ))
            }
            None => return Err(malformed(path, "no format version".into())),
        }
        let file: FileV1 = serde_json::from_value(v).map_err(|e| malformed(path, e.to_string()))?;
        if file.cipher != CIPHER {
            return Err(malformed(path, format!("cipher '{}' is not supported (only {CIPHER})", file.cipher)));
        }
        let key_id = key.id();
        if file.key_id != key_id {
            return Err(StoreError::WrongKey {
                path: path.to_path_buf(),
                store_key_id: file.key_id.chars().filter(char::is_ascii_alphanumeric).take(32).collect(),
                key: key.origin.clone(),
                key_id,
            });
        }
        let mut entries = BTreeMap::new();
        for (name, e) in file.entries {
            if check_name(&name).is_err() {
                return Err(malformed(path, format!("invalid entry name {name:?}")));
            }
            let nonce = decode_exact::<NONCE_LEN>(&e.nonce)
                .ok_or_else(|| malformed(path, format!("entry '{name}': bad nonce")))?;
            let ct = B64.decode(&e.ct).ok().filter(|c| c.len() >= TAG_LEN);
            let ct = ct.ok_or_else(|| malformed(path, format!("entry '{name}': bad ciphertext")))?;
            entries.insert(name, Sealed { nonce, ct });
        }
        let seal_nonce = decode_exact::<NONCE_LEN>(&file.seal.nonce);
        let tag = decode_exact::<TAG_LEN>(&file.seal.tag);
        let (Some(seal_nonce), Some(tag)) = (seal_nonce, tag) else {
            return Err(malformed(path, "bad seal".into()));
        };
        let mut buf = tag.to_vec();
        key.cipher().decrypt_in_place((&seal_nonce).into(), &seal_aad(&key_id, &entries), &mut buf).map_err(|_| {
            StoreError::Tampered { path: path.to_path_buf(), message: "the seal does not verify".into() }
        })?;
        Ok(Store { path: path.to_path_buf(), key, entries })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Decrypt one value. `Ok(None)`: no such entry.
    pub fn get(&self, name: &str) -> Result<Option<Zeroizing<String>>, StoreError> {
        let Some(s) = self.entries.get(name) else { return Ok(None) };
        let mut buf = Zeroizing::new(s.ct.clone());
        self.key.cipher().decrypt_in_place((&s.nonce).into(), &entry_aad(name), &mut *buf).map_err(|_| {
            StoreError::Tampered { path: self.path.clone(), message: format!("entry '{name}' does not authenticate") }
        })?;
        match String::from_utf8(std::mem::take(&mut *buf)) {
            Ok(s) => Ok(Some(Zeroizing::new(s))),
            Err(e) => {
                e.into_bytes().zeroize();
                Err(StoreError::Tampered { path: self.path.clone(), message: format!("entry '{name}' is not UTF-8") })
            }
        }
    }

    /// Add or replace a value (in memory; [`Store::save`] writes it). Returns whether it
    /// replaced one.
    pub fn set(&mut self, name: &str, value: &str) -> Result<bool, StoreError> {
        check_name(name)?;
        check_value(value.as_bytes())?;
        let mut nonce = [0u8; NONCE_LEN];
        crate::random::fill(&mut nonce).map_err(StoreError::Random)?;
        // Room for the tag up front, so the plaintext copy is never reallocated (and left
        // behind unwiped); it is encrypted in place and wiped if anything fails.
        let mut buf = Zeroizing::new(Vec::with_capacity(value.len() + TAG_LEN));
        buf.extend_from_slice(value.as_bytes());
        self.key
            .cipher()
            .encrypt_in_place((&nonce).into(), &entry_aad(name), &mut *buf)
            .map_err(|_| StoreError::BadValue("too long to encrypt".into()))?;
        let ct = std::mem::take(&mut *buf);
        Ok(self.entries.insert(name.to_string(), Sealed { nonce, ct }).is_some())
    }

    /// Remove an entry (in memory). Returns whether it existed.
    pub fn remove(&mut self, name: &str) -> bool {
        self.entries.remove(name).is_some()
    }

    /// The file's bytes: every entry, and a fresh seal over them.
    fn render(&self) -> Result<Vec<u8>, StoreError> {
        let key_id = self.key.id();
        let mut seal_nonce = [0u8; NONCE_LEN];
        crate::random::fill(&mut seal_nonce).map_err(StoreError::Random)?;
        let mut tag = Vec::with_capacity(TAG_LEN);
        self.key
            .cipher()
            .encrypt_in_place((&seal_nonce).into(), &seal_aad(&key_id, &self.entries), &mut tag)
            .map_err(|_| malformed(&self.path, "too large to seal".into()))?;
        let file = FileV1 {
            format: FORMAT.into(),
            version: VERSION,
            cipher: CIPHER.into(),
            key_id,
            entries: self
                .entries
                .iter()
                .map(|(n, s)| (n.clone(), EntryJson { nonce: B64.encode(s.nonce), ct: B64.encode(&s.ct) }))
                .collect(),
            seal: SealJson { nonce: B64.encode(seal_nonce), tag: B64.encode(&tag) },
        };
        let mut out = serde_json::to_vec_pretty(&file).map_err(|e| malformed(&self.path, e.to_string()))?;
        out.push(b'\n');
        Ok(out)
    }

    /// Write the store atomically (see the module documentation).
    pub fn save(&self) -> Result<(), StoreError> {
        let bytes = self.render()?;
        write_replace(&self.path, &bytes).map_err(io_err("secrets store", &self.path))
    }
}

/// A value the store accepts: 1 to [`MAX_VALUE`] bytes of UTF-8 (executors receive strings).
pub fn check_value(value: &[u8]) -> Result<(), StoreError> {
    if value.is_empty() {
        return Err(StoreError::BadValue("empty".into()));
    }
    if value.len() > MAX_VALUE {
        return Err(StoreError::BadValue(format!("longer than {MAX_VALUE} bytes")));
    }
    if std::str::from_utf8(value).is_err() {
        return Err(StoreError::BadValue("not UTF-8 text".into()));
    }
    Ok(())
}

fn malformed(path: &Path, message: String) -> StoreError {
    StoreError::Malformed { path: path.to_path_buf(), message }
}

fn decode_exact<const N: usize>(b64: &str) -> Option<[u8; N]> {
    B64.decode(b64).ok()?.try_into().ok()
}

/// Open for reading a file that must be private: a regular file, owned by root or the running
/// user, no group or other access. Checked on the open descriptor (no check-then-open race).
pub(crate) fn open_private(what: &'static str, path: &Path) -> Result<File, StoreError> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err(what, path))?;
    let meta = f.metadata().map_err(io_err(what, path))?;
    let euid = nix::unistd::geteuid().as_raw();
    if !meta.is_file() || (meta.uid() != 0 && meta.uid() != euid) || meta.mode() & 0o077 != 0 {
        return Err(StoreError::Exposed {
            what,
            path: path.to_path_buf(),
            uid: meta.uid(),
            mode: meta.mode() & 0o7777,
        });
    }
    Ok(f)
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Write `bytes` to a new temporary file (mode 0600) beside `path`, fsynced.
fn write_temp(path: &Path, bytes: &[u8]) -> std::io::Result<PathBuf> {
    let mut r = [0u8; 8];
    crate::random::fill(&mut r)?;
    let suffix: String = r.iter().map(|b| format!("{b:02x}")).collect();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = parent_dir(path).join(format!(".{name}.tmp-{}-{suffix}", std::process::id()));
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.set_permissions(Permissions::from_mode(0o600))?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    match written {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    File::open(parent_dir(path))?.sync_all()
}

/// Replace `path` with `bytes` atomically: temporary file, fsync, rename, fsync directory.
fn write_replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = write_temp(path, bytes)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(path)
}

/// Create `path` with `bytes` atomically, failing if it exists: temporary file, fsync, hard
/// link (which never replaces), fsync directory. A file whose name may not be on the disk
/// is taken back: a key a crash could lose must not go on to encrypt a store that survives
/// it (the key and the store may be on different filesystems).
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = write_temp(path, bytes)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked?;
    sync_dir(path).inspect_err(|_| {
        let _ = std::fs::remove_file(path);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> SecretKey {
        SecretKey::from_bytes([b; 32], "test key")
    }

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!("opservant-store-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn json_of(s: &Store) -> serde_json::Value {
        serde_json::from_slice(&s.render().unwrap()).unwrap()
    }

    fn reparse(v: &serde_json::Value, k: SecretKey) -> Result<Store, StoreError> {
        Store::parse(Path::new("/test/secrets.enc"), v.to_string().as_bytes(), k)
    }

    #[test]
    fn round_trip_and_format() {
        let mut s = Store::empty(Path::new("/test/secrets.enc"), key(1));
        assert!(!s.set("api_key", "v1").unwrap());
        assert!(s.set("api_key", "plaintext-value-two").unwrap());
        s.set("db/password", "pässwörd").unwrap();
        let v = json_of(&s);
        assert_eq!(v["format"], "opservant-secrets");
        assert_eq!(v["version"], 1);
        assert_eq!(v["cipher"], "aes-256-gcm");
        assert_eq!(v["key_id"], key(1).id());
        // (Long plaintexts: a short one such as "v2" can occur in base64 by chance.)
        assert!(!v.to_string().contains("plaintext-value-two") && !v.to_string().contains("pässwörd"));
        let s2 = reparse(&v, key(1)).unwrap();
        assert_eq!(s2.names().collect::<Vec<_>>(), ["api_key", "db/password"]);
        assert_eq!(s2.get("api_key").unwrap().as_deref().map(String::as_str), Some("plaintext-value-two"));
        assert_eq!(s2.get("db/password").unwrap().as_deref().map(String::as_str), Some("pässwörd"));
        assert!(s2.get("nope").unwrap().is_none());
    }

    #[test]
    fn wrong_key_and_tampering_are_errors() {
        let mut s = Store::empty(Path::new("/test/secrets.enc"), key(1));
        s.set("a", "alpha-value").unwrap();
        s.set("b", "beta-value").unwrap();
        let v = json_of(&s);
        assert!(matches!(reparse(&v, key(2)), Err(StoreError::WrongKey { .. })));
        // A forged key id with the wrong key: the seal does not verify.
        let mut forged = v.clone();
        forged["key_id"] = key(2).id().into();
        assert!(matches!(reparse(&forged, key(2)), Err(StoreError::Tampered { .. })));
        // A flipped ciphertext bit, a dropped entry, swapped entries: all detected by the seal.
        let mut flipped = v.clone();
        let mut ct = B64.decode(flipped["entries"]["a"]["ct"].as_str().unwrap()).unwrap();
        ct[0] ^= 1;
        flipped["entries"]["a"]["ct"] = B64.encode(&ct).into();
        assert!(matches!(reparse(&flipped, key(1)), Err(StoreError::Tampered { .. })));
        let mut dropped = v.clone();
        dropped["entries"].as_object_mut().unwrap().remove("b");
        assert!(matches!(reparse(&dropped, key(1)), Err(StoreError::Tampered { .. })));
        let mut swapped = v.clone();
        let (a, b) = (v["entries"]["a"].clone(), v["entries"]["b"].clone());
        swapped["entries"]["a"] = b;
        swapped["entries"]["b"] = a;
        let e = reparse(&swapped, key(1)).err().unwrap();
        assert!(e.to_string().contains("altered"), "{e}");
        // Even with a valid seal over swapped entries, each value is bound to its name.
        let mut s3 = reparse(&v, key(1)).unwrap();
        let (sa, sb) = (s3.entries["a"].clone(), s3.entries["b"].clone());
        s3.entries.insert("a".into(), sb);
        s3.entries.insert("b".into(), sa);
        let resealed = reparse(&json_of(&s3), key(1)).unwrap();
        assert!(matches!(resealed.get("a"), Err(StoreError::Tampered { .. })));
        // Malformed files and future versions are named errors, never panics.
        for bad in ["", "{}", "[]", "{\"format\":\"opservant-secrets\",\"version\":2}", "null"] {
            let e = Store::parse(Path::new("/test/secrets.enc"), bad.as_bytes(), key(1)).err().unwrap();
            assert!(e.to_string().starts_with("secrets store /test/secrets.enc: "), "{e}");
        }
        let mut short = v.clone();
        short["seal"]["tag"] = "AAAA".into();
        assert!(matches!(reparse(&short, key(1)), Err(StoreError::Malformed { .. })));
    }

    #[test]
    fn names_values_and_key_formats() {
        for ok in ["a", "API_KEY", "db/password", "x.y-z", &"n".repeat(MAX_NAME)] {
            check_name(ok).unwrap();
        }
        for bad in ["", "a b", "a\nb", "a\0b", "é", &"n".repeat(MAX_NAME + 1)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_value(b"").is_err());
        assert!(check_value(&[0xff, 0xfe]).is_err());
        assert!(check_value(&vec![b'a'; MAX_VALUE + 1]).is_err());
        check_value(&vec![b'a'; MAX_VALUE]).unwrap();

        let raw = [7u8; 32];
        let hex: String = raw.iter().map(|b| format!("{b:02X}")).collect();
        let b64 = B64.encode(raw);
        for text in [raw.to_vec(), format!("{hex}\n").into_bytes(), format!("{b64}\n").into_bytes()] {
            assert_eq!(*parse_key(&text).unwrap(), raw);
        }
        for bad in [&b"short"[..], &[b'g'; 64], &[7u8; 31], B64.encode([1u8; 33]).as_bytes()] {
            assert!(parse_key(bad).is_none());
        }
    }

    #[test]
    fn files_are_written_atomically_and_privately() {
        let d = TempDir::new("files");
        let kp = d.0.join("k/secrets.key");
        let k = SecretKey::create(&kp).unwrap();
        let text = std::fs::read_to_string(&kp).unwrap();
        assert_eq!(text.len(), 65);
        assert_eq!(std::fs::metadata(&kp).unwrap().mode() & 0o7777, 0o600);
        assert!(SecretKey::create(&kp).is_err(), "an existing key is never replaced");
        let id = k.id();
        let sp = d.0.join("secrets.enc");
        let mut s = Store::empty(&sp, k);
        s.set("x", "value-x").unwrap();
        s.save().unwrap();
        assert_eq!(std::fs::metadata(&sp).unwrap().mode() & 0o7777, 0o600);
        let names: Vec<_> = std::fs::read_dir(&d.0).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "no temporary files left: {names:?}");
        let loaded = SecretKey::load(&KeySource::File(kp.clone())).unwrap();
        assert_eq!(loaded.id(), id);
        if nix::unistd::geteuid().is_root() {
            let s = Store::open(&sp, loaded).unwrap();
            assert_eq!(s.get("x").unwrap().as_deref().map(String::as_str), Some("value-x"));
        }
        std::fs::set_permissions(&kp, Permissions::from_mode(0o640)).unwrap();
        let e = SecretKey::load(&KeySource::File(kp)).unwrap_err();
        assert!(e.to_string().contains("mode 0600 or stricter"), "{e}");
        assert!(Store::open(&d.0.join("missing.enc"), key(1)).unwrap().names().next().is_none());
    }
}
