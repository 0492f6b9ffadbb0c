//! The HashiCorp Vault secrets provider (`secrets.provider: vault`): KV version 2 read with an
//! AppRole login, the token renewed while it is used.
//!
//! # Configuration (`secrets:`)
//!
//! ```yaml
//! secrets:
//!   provider: vault
//!   vault_address: https://vault.internal.example.com:8200   # https only
//!   vault_ca: /etc/opservant/vault-ca.pem                    # the CA the server must chain to
//!   vault_crl: /etc/opservant/vault-ca.crl                   # optional: its revocation lists
//!   vault_path: secret/data/opservant                        # KV v2 mount, data/, a prefix
//!   auth_method: approle                                     # the only method (the default)
//!   role_id: "opservant-role"
//!   secret_id_file: /etc/opservant/vault-secret-id           # root-owned, mode 0600
//!   vault_namespace: team-a                                  # optional: X-Vault-Namespace
//! ```
//!
//! - `vault_path` is `MOUNT/data/PREFIX`: everything before the first `data` segment is the KV
//!   v2 mount (it may have several segments), everything after it the prefix (may be empty).
//!   Without a `data` segment the first segment is the mount and `data/` is inserted after it
//!   (`secret/opservant` means `secret/data/opservant`).
//! - The secret_id comes from the systemd credential `opservant-vault-secret-id` in
//!   `$CREDENTIALS_DIRECTORY` when present, else from `secret_id_file`; either must be a regular
//!   file owned by root (or the running user) with no group or other access. It is read at each
//!   login (so a rotated secret_id is picked up), one trailing newline ignored.
//! - The system trust store is never used: the server certificate must chain to `vault_ca`
//!   (TLS 1.3 only, see [`crate::tls`]). Vault traffic goes through `network.proxy.https` (an
//!   HTTP `CONNECT` proxy, TLS end to end) unless `network.proxy.no_proxy` names Vault's host,
//!   as the platform's does, and redirects are not followed (a standby node's redirect is an
//!   error: point `vault_address` at the active node or the load balancer).
//!
//! # Protocol
//!
//! - Login: `POST /v1/auth/approle/login` `{"role_id", "secret_id"}` → `auth.client_token`,
//!   `auth.lease_duration` (seconds, 0 = no expiry), `auth.renewable`. The token goes in
//!   `X-Vault-Token`.
//! - Secret `NAME`: `GET /v1/{mount}/data/{prefix}/{NAME}` and the **string field `value`** of
//!   the secret's data (`{"data": {"data": {"value": "…"}, "metadata": {…}}}`). A 404 means "no
//!   such secret"; a secret without a `value` field, or a non-string one, is an error naming
//!   the secret. Store secrets with `vault kv put secret/opservant/api_key value=…`.
//! - Renewal: a cached token past 2/3 of its lease is renewed (`POST
//!   /v1/auth/token/renew-self`) when it is renewable and not yet expired; when renewal fails,
//!   the token is not renewable or has expired, the client logs in again. A renewal that comes
//!   back with a shorter lease than before (the token's max TTL is near) is the last one: the
//!   next refresh logs in. A 403 on a read drops the token, logs in again and retries once.
//!
//! # Guarantees
//!
//! - Fail closed: `http://` addresses, unknown auth methods, a missing CA, an exposed
//!   secret_id file are configuration errors naming the key (`secrets.vault_address`, …);
//!   a TLS failure never falls back to anything weaker.
//! - A secret name must be one path segment of `[A-Za-z0-9_.-]`, not `.` or `..`, and nothing
//!   else: it can never add path segments, a query, a fragment or an escape to the URL.
//!   (Undeclared names are refused by the caller before this module is asked.)
//! - Every request has a 5 s connect and a 10 s total timeout; response bodies are capped at
//!   [`MAX_RESPONSE`] bytes.
//! - The token, the secret_id, request and response bodies and delivered values are held in
//!   [`Zeroizing`] buffers; parsed responses have their strings wiped before they are dropped.
//!   Errors and log records never contain the token, the secret_id or a value (Vault's own
//!   error messages are included, cut short, with those scrubbed out).
//! - One client per process and configuration ([`shared`]): a one-shot `opservant run` logs
//!   in at most once, the agent daemon keeps its token across runs. Nothing is contacted
//!   until a run asks for a secret; [`check`] (used by `--check-config` and before a run)
//!   contacts nothing.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::Value;
use thiserror::Error;
use zeroize::{Zeroize, Zeroizing};

use crate::config::{ConfigError, SecretsSection};

/// The systemd credential holding the AppRole secret_id (`LoadCredential=opservant-vault-secret-id:…`).
pub const SECRET_ID_CREDENTIAL: &str = "opservant-vault-secret-id";
/// The field of a KV v2 secret's data that holds the value.
pub const VALUE_FIELD: &str = "value";
/// Largest response body read from Vault.
pub const MAX_RESPONSE: u64 = 1024 * 1024;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_SECRET_ID: u64 = 4096;
const MAX_NAME: usize = 128;
/// Longest excerpt of Vault's own error messages kept in an error.
const MAX_DETAIL: usize = 200;

/// A checked `secrets:` section for `provider: vault`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VaultSettings {
    /// `https://HOST[:PORT]`, no trailing slash.
    pub address: String,
    pub ca: PathBuf,
    /// Revocation lists the server's chain is checked against (`secrets.vault_crl`).
    pub crl: Option<PathBuf>,
    /// KV v2 mount and prefix (segments joined by `/`; the prefix may be empty).
    pub mount: String,
    pub prefix: String,
    pub role_id: String,
    pub secret_id_file: Option<PathBuf>,
    pub namespace: Option<String>,
    /// The HTTP `CONNECT` proxy Vault is reached through (`network.proxy.https`, unless
    /// `network.proxy.no_proxy` names Vault's host — as for the platform); `None`: directly.
    pub proxy: Option<String>,
}

/// One path segment Vault sees as such: `[A-Za-z0-9_.-]`, not `.` or `..`.
fn valid_segment(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && s.bytes().all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(&c))
}

fn config_err(path: &str, message: impl Into<String>) -> ConfigError {
    ConfigError { path: path.into(), message: message.into() }
}

/// `https://HOST[:PORT][/]` → `https://HOST[:PORT]`.
fn parse_address(a: &str) -> Result<String, String> {
    if a.get(..7).is_some_and(|p| p.eq_ignore_ascii_case("http://")) {
        return Err("plain http is refused: use https://".into());
    }
    let rest = a.strip_prefix("https://").ok_or("must be an https:// URL")?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty()
        || authority.contains(['/', '?', '#', '@', '\\', '%'])
        || authority.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err("must be https://HOST[:PORT], without a path, query or user info".into());
    }
    Ok(format!("https://{authority}"))
}

/// The host of a checked address (`https://HOST[:PORT]`; an IPv6 address in its brackets).
fn address_host(address: &str) -> &str {
    let authority = address.strip_prefix("https://").unwrap_or(address);
    if authority.starts_with('[') {
        return authority.split_inclusive(']').next().unwrap_or(authority);
    }
    authority
        .rsplit_once(':')
        .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
        .map_or(authority, |(h, _)| h)
}

/// `MOUNT/data/PREFIX` (or `MOUNT/PREFIX`) → (mount, prefix).
fn parse_kv_path(p: &str) -> Result<(String, String), String> {
    let segs: Vec<&str> = p.trim_matches('/').split('/').collect();
    if let Some(bad) = segs.iter().find(|s| !valid_segment(s)) {
        return Err(format!(
            "segment '{}' is not a plain path segment (use A-Z a-z 0-9 _ . -; e.g. secret/data/opservant)",
            bad.escape_debug()
        ));
    }
    match segs.iter().position(|s| *s == "data") {
        Some(0) => Err("must start with the KV v2 mount (e.g. secret/data/opservant)".into()),
        Some(i) => Ok((segs[..i].join("/"), segs[i + 1..].join("/"))),
        None => Ok((segs[0].to_string(), segs[1..].join("/"))),
    }
}

impl VaultSettings {
    /// Check the `secrets:` keys for `provider: vault` (no file is read, nothing contacted).
    pub fn from_config(s: &SecretsSection) -> Result<VaultSettings, ConfigError> {
        const REQUIRED: &str = "is required with provider: vault";
        let address = s.vault_address.as_deref().ok_or_else(|| config_err("secrets.vault_address", REQUIRED))?;
        let address = parse_address(address).map_err(|m| config_err("secrets.vault_address", m))?;
        let ca = s.vault_ca.clone().ok_or_else(|| {
            config_err(
                "secrets.vault_ca",
                "is required with provider: vault (the PEM CA the Vault server's certificate must chain to)",
            )
        })?;
        let vault_path = s.vault_path.as_deref().ok_or_else(|| config_err("secrets.vault_path", REQUIRED))?;
        let (mount, prefix) = parse_kv_path(vault_path).map_err(|m| config_err("secrets.vault_path", m))?;
        match s.auth_method.as_deref() {
            None | Some("approle") => {}
            Some(other) => {
                return Err(config_err(
                    "secrets.auth_method",
                    format!("'{}' is not supported (only approle)", other.escape_debug()),
                ))
            }
        }
        let role_id = s.role_id.clone().ok_or_else(|| config_err("secrets.role_id", REQUIRED))?;
        if role_id.is_empty() || role_id.len() > 256 || role_id.chars().any(char::is_control) {
            return Err(config_err("secrets.role_id", "must be 1-256 printable characters"));
        }
        for (key, p) in [
            ("secrets.vault_ca", Some(&ca)),
            ("secrets.vault_crl", s.vault_crl.as_ref()),
            ("secrets.secret_id_file", s.secret_id_file.as_ref()),
        ] {
            if p.is_some_and(|p| !p.is_absolute()) {
                return Err(config_err(key, "must be an absolute path"));
            }
        }
        if let Some(ns) = &s.vault_namespace {
            if ns.len() > 256 || !ns.trim_matches('/').split('/').all(valid_segment) {
                return Err(config_err(
                    "secrets.vault_namespace",
                    "must be a namespace path of A-Z a-z 0-9 _ . - segments (e.g. team-a or parent/child)",
                ));
            }
        }
        Ok(VaultSettings {
            address,
            ca,
            crl: s.vault_crl.clone(),
            mount,
            prefix,
            role_id,
            secret_id_file: s.secret_id_file.clone(),
            namespace: s.vault_namespace.as_ref().map(|n| n.trim_matches('/').to_string()),
            proxy: None,
        })
    }

    /// [`VaultSettings::from_config`] of `config.secrets`, reached through `config`'s
    /// `network.proxy` as the platform is ([`VaultSettings::proxy`]).
    pub fn for_config(config: &crate::config::Config) -> Result<VaultSettings, ConfigError> {
        let mut settings = VaultSettings::from_config(&config.secrets)?;
        settings.proxy = config
            .network
            .proxy
            .as_ref()
            .filter(|p| !crate::platform::bypasses_proxy(address_host(&settings.address), &p.no_proxy))
            .and_then(|p| p.https.clone());
        Ok(settings)
    }

    /// The KV v2 API path of secret `name` (below `/v1/`).
    fn kv_path(&self, name: &str) -> String {
        match self.prefix.as_str() {
            "" => format!("{}/data/{name}", self.mount),
            prefix => format!("{}/data/{prefix}/{name}", self.mount),
        }
    }

    /// Where the secret_id comes from: the systemd credential when present, else the file.
    fn secret_id_source(&self) -> Result<(&'static str, PathBuf), String> {
        if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY").filter(|d| !d.is_empty()) {
            let p = Path::new(&dir).join(SECRET_ID_CREDENTIAL);
            if std::fs::symlink_metadata(&p).is_ok() {
                return Ok(("systemd credential", p));
            }
        }
        match &self.secret_id_file {
            Some(p) => Ok(("secrets.secret_id_file", p.clone())),
            None => Err(format!(
                "secrets.secret_id_file: is required with provider: vault (or the systemd credential \
                 {SECRET_ID_CREDENTIAL} in $CREDENTIALS_DIRECTORY)"
            )),
        }
    }

    /// Read the secret_id (see the module documentation for the rules).
    fn read_secret_id(&self) -> Result<Zeroizing<String>, String> {
        let (key, path) = self.secret_id_source()?;
        let f = crate::secrets_store::open_private("vault secret_id", &path).map_err(|e| format!("{key}: {e}"))?;
        let mut raw = Zeroizing::new(Vec::with_capacity(256));
        f.take(MAX_SECRET_ID + 1).read_to_end(&mut raw).map_err(|e| format!("{key}: {}: {e}", path.display()))?;
        let bad = |what: &str| format!("{key}: {}: {what}", path.display());
        if raw.len() as u64 > MAX_SECRET_ID {
            return Err(bad("longer than 4096 bytes"));
        }
        let text = std::str::from_utf8(&raw).map_err(|_| bad("not UTF-8 text"))?;
        let text = text.strip_suffix('\n').unwrap_or(text);
        let text = text.strip_suffix('\r').unwrap_or(text);
        if text.is_empty() {
            return Err(bad("is empty"));
        }
        if text.chars().any(char::is_control) {
            return Err(bad("holds control characters (one secret_id, one trailing newline at most)"));
        }
        Ok(Zeroizing::new(text.to_string()))
    }
}

/// Check what can be checked without contacting Vault: the settings, the CA file, and that
/// the secret_id is present and private.
pub fn check(settings: &VaultSettings) -> Result<(), String> {
    let roots = crate::tls::read_ca(&settings.ca, "secrets.vault_ca")?;
    let crl = settings.crl.as_deref().map(|path| ("secrets.vault_crl", path));
    crate::tls::ClientTls::new(("secrets.vault_ca", &settings.ca, &roots), None, crl).map_err(|e| {
        if e.starts_with("secrets.") {
            e
        } else {
            format!("secrets.vault_ca: {e}")
        }
    })?;
    if let Some(url) = &settings.proxy {
        ureq::Proxy::new(url).map_err(|e| format!("network.proxy.https: {e}"))?;
    }
    settings.read_secret_id().map(drop)
}

/// What went wrong talking to Vault. No variant carries the token, the secret_id or a value.
#[derive(Debug, Error)]
pub enum VaultError {
    #[error("vault: secret name {0:?} is not one Vault path segment (use A-Z a-z 0-9 _ . -, not '.' or '..')")]
    BadName(String),
    #[error("vault: {0}")]
    SecretId(String),
    #[error("vault {what}: {detail}")]
    Transport { what: &'static str, detail: String },
    #[error("vault {what}: HTTP {status}{detail}")]
    Http { what: &'static str, status: u16, detail: String },
    #[error("vault {what}: malformed response: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("vault: secret '{name}' ({path}): {detail}")]
    Field { name: String, path: String, detail: String },
}

/// A cached token.
struct Token {
    value: Zeroizing<String>,
    obtained: Instant,
    /// The lease; zero: it does not expire.
    ttl: Duration,
    renewable: bool,
}

impl Token {
    /// Past 2/3 of its lease (never, for a token without expiry).
    fn due(&self) -> bool {
        // Saturating: a lease Vault gave is its input, however large.
        !self.ttl.is_zero() && self.obtained.elapsed().saturating_mul(3) >= self.ttl.saturating_mul(2)
    }

    fn expired(&self) -> bool {
        !self.ttl.is_zero() && self.obtained.elapsed() >= self.ttl
    }
}

/// A Vault client: the TLS agent and the cached token.
pub struct VaultClient {
    settings: VaultSettings,
    http: ureq::Agent,
    token: Mutex<Option<Token>>,
}

impl std::fmt::Debug for VaultClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VaultClient({})", self.settings.address)
    }
}

/// The process's client for `settings`, created on first use (see the module documentation).
pub fn shared(settings: &VaultSettings) -> Result<Arc<VaultClient>, String> {
    static CLIENTS: Mutex<Vec<Arc<VaultClient>>> = Mutex::new(Vec::new());
    let mut clients = CLIENTS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(c) = clients.iter().find(|c| c.settings == *settings) {
        return Ok(c.clone());
    }
    let c = Arc::new(VaultClient::new(settings.clone())?);
    clients.push(c.clone());
    Ok(c)
}

enum Method {
    Get,
    Post(Zeroizing<Vec<u8>>),
}

/// Wipe every string of a parsed response before it is dropped.
fn wipe(v: &mut Value) {
    match v {
        Value::String(s) => s.zeroize(),
        Value::Array(a) => a.iter_mut().for_each(wipe),
        Value::Object(o) => o.values_mut().for_each(wipe),
        _ => {}
    }
}

/// A parsed response body that is wiped when dropped.
struct Parsed(Value);

impl Drop for Parsed {
    fn drop(&mut self) {
        wipe(&mut self.0);
    }
}

impl Parsed {
    fn new(what: &'static str, body: &[u8]) -> Result<Parsed, VaultError> {
        serde_json::from_slice(body)
            .map(Parsed)
            .map_err(|e| VaultError::Malformed { what, detail: format!("not JSON ({e})") })
    }

    /// Move the string at `pointer` out into a zeroizing buffer.
    fn take_string(&mut self, pointer: &str) -> Option<Zeroizing<String>> {
        match self.0.pointer_mut(pointer) {
            Some(Value::String(s)) => Some(Zeroizing::new(std::mem::take(s))),
            _ => None,
        }
    }
}

/// Vault's `{"errors": [...]}`, as `": msg; msg"` (cut short, `scrub` strings removed), or "".
fn vault_errors(body: &[u8], scrub: &[&str]) -> String {
    let Ok(parsed) = Parsed::new("error", body) else { return String::new() };
    let Some(list) = parsed.0.get("errors").and_then(Value::as_array) else { return String::new() };
    let mut text = list.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("; ");
    for s in scrub.iter().filter(|s| !s.is_empty()) {
        text = text.replace(s, "[REDACTED]");
    }
    let mut text: String = text.chars().filter(|c| !c.is_control()).collect();
    if text.len() > MAX_DETAIL {
        let mut cut = MAX_DETAIL;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    if text.is_empty() {
        text
    } else {
        format!(": {text}")
    }
}

impl VaultClient {
    /// The TLS agent for `settings` (reads the CA; contacts nothing).
    pub fn new(settings: VaultSettings) -> Result<VaultClient, String> {
        let roots = crate::tls::read_ca(&settings.ca, "secrets.vault_ca")?;
        let crl = settings.crl.as_deref().map(|path| ("secrets.vault_crl", path));
        let tls = crate::tls::ClientTls::new(("secrets.vault_ca", &settings.ca, &roots), None, crl).map_err(|e| {
            if e.starts_with("secrets.") {
                e
            } else {
                format!("secrets.vault_ca: {e}")
            }
        })?;
        let proxy = match &settings.proxy {
            Some(url) => Some(ureq::Proxy::new(url).map_err(|e| format!("network.proxy.https: {e}"))?),
            None => None,
        };
        let config = ureq::Agent::config_builder()
            .https_only(true)
            .proxy(proxy)
            .max_redirects(0)
            .http_status_as_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .timeout_global(Some(REQUEST_TIMEOUT))
            .build();
        let http =
            ureq::Agent::with_parts(config, tls.connector(), ureq::unversioned::resolver::DefaultResolver::default());
        Ok(VaultClient { settings, http, token: Mutex::new(None) })
    }

    /// One request: (status, body). `token` goes in `X-Vault-Token`.
    fn call(
        &self,
        what: &'static str,
        path: &str,
        token: Option<&str>,
        method: Method,
    ) -> Result<(u16, Zeroizing<Vec<u8>>), VaultError> {
        let url = format!("{}/v1/{path}", self.settings.address);
        let transport = |e: ureq::Error| VaultError::Transport { what, detail: e.to_string() };
        let ns = self.settings.namespace.as_deref();
        let mut resp = match method {
            Method::Get => {
                let mut r = self.http.get(&url);
                if let Some(t) = token {
                    r = r.header("X-Vault-Token", t);
                }
                if let Some(ns) = ns {
                    r = r.header("X-Vault-Namespace", ns);
                }
                r.call()
            }
            Method::Post(body) => {
                let mut r = self.http.post(&url).header("content-type", "application/json");
                if let Some(t) = token {
                    r = r.header("X-Vault-Token", t);
                }
                if let Some(ns) = ns {
                    r = r.header("X-Vault-Namespace", ns);
                }
                r.send(&body[..])
            }
        }
        .map_err(transport)?;
        let status = resp.status().as_u16();
        let body = resp.body_mut().with_config().limit(MAX_RESPONSE).read_to_vec().map_err(transport)?;
        Ok((status, Zeroizing::new(body)))
    }

    /// `auth` of a login or renewal response.
    fn token_of(what: &'static str, body: &[u8], fallback: Option<&str>) -> Result<Token, VaultError> {
        let mut p = Parsed::new(what, body)?;
        let value = match (p.take_string("/auth/client_token"), fallback) {
            (Some(t), _) if !t.is_empty() => t,
            (None, Some(f)) => Zeroizing::new(f.to_string()),
            _ => return Err(VaultError::Malformed { what, detail: "no auth.client_token".into() }),
        };
        let auth = &p.0["auth"];
        let ttl = auth["lease_duration"]
            .as_u64()
            .ok_or_else(|| VaultError::Malformed { what, detail: "no auth.lease_duration".into() })?;
        let renewable = auth["renewable"].as_bool().unwrap_or(false);
        Ok(Token { value, obtained: Instant::now(), ttl: Duration::from_secs(ttl), renewable })
    }

    fn login(&self) -> Result<Token, VaultError> {
        const WHAT: &str = "approle login";
        let secret_id = self.settings.read_secret_id().map_err(VaultError::SecretId)?;
        #[derive(serde::Serialize)]
        struct Login<'a> {
            role_id: &'a str,
            secret_id: &'a str,
        }
        let body = serde_json::to_vec(&Login { role_id: &self.settings.role_id, secret_id: &secret_id })
            .map_err(|e| VaultError::Malformed { what: WHAT, detail: e.to_string() })?;
        let (status, resp) = self.call(WHAT, "auth/approle/login", None, Method::Post(Zeroizing::new(body)))?;
        if status != 200 {
            let detail = vault_errors(&resp, &[&secret_id]);
            tracing::warn!(status, detail = %detail, "vault: approle login refused");
            return Err(VaultError::Http { what: WHAT, status, detail });
        }
        let t = Self::token_of(WHAT, &resp, None)?;
        tracing::info!(ttl_seconds = t.ttl.as_secs(), renewable = t.renewable, "vault: logged in with approle");
        Ok(t)
    }

    fn renew(&self, old: &Token) -> Result<Token, VaultError> {
        const WHAT: &str = "token renewal";
        let body = Zeroizing::new(b"{}".to_vec());
        let (status, resp) = self.call(WHAT, "auth/token/renew-self", Some(&old.value), Method::Post(body))?;
        if status != 200 {
            return Err(VaultError::Http { what: WHAT, status, detail: vault_errors(&resp, &[&old.value]) });
        }
        let mut t = Self::token_of(WHAT, &resp, Some(&old.value))?;
        if t.ttl.is_zero() {
            return Err(VaultError::Malformed { what: WHAT, detail: "renewed with a zero lease".into() });
        }
        // A shorter lease than before: the max TTL is near, the next refresh logs in.
        if t.ttl < old.ttl {
            t.renewable = false;
        }
        tracing::info!(ttl_seconds = t.ttl.as_secs(), renewable = t.renewable, "vault: token renewed");
        Ok(t)
    }

    /// A usable token: the cached one, renewed or replaced when due.
    fn token(&self) -> Result<Zeroizing<String>, VaultError> {
        let mut cached = self.token.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = cached.as_ref() {
            if !t.due() {
                return Ok(t.value.clone());
            }
            if t.renewable && !t.expired() {
                match self.renew(t) {
                    Ok(new) => {
                        let value = new.value.clone();
                        *cached = Some(new);
                        return Ok(value);
                    }
                    Err(e) => tracing::warn!(error = %e, "vault: renewal failed, logging in again"),
                }
            }
        }
        *cached = None;
        let t = self.login()?;
        let value = t.value.clone();
        *cached = Some(t);
        Ok(value)
    }

    /// Drop the cached token if it is `token`.
    fn forget(&self, token: &str) {
        let mut cached = self.token.lock().unwrap_or_else(PoisonError::into_inner);
        if cached.as_ref().is_some_and(|t| t.value.as_str() == token) {
            *cached = None;
        }
    }

    /// The value of secret `name`: `Ok(None)` when Vault has no such secret.
    pub fn get(&self, name: &str) -> Result<Option<Zeroizing<String>>, VaultError> {
        if name.len() > MAX_NAME || !valid_segment(name) {
            return Err(VaultError::BadName(name.to_string()));
        }
        const WHAT: &str = "read";
        let path = self.settings.kv_path(name);
        let mut token = self.token()?;
        let mut retried = false;
        loop {
            let (status, body) = self.call(WHAT, &path, Some(&token), Method::Get)?;
            match status {
                200 => return self.value_of(name, &path, &body).map(Some),
                404 => return Ok(None),
                403 if !retried => {
                    tracing::info!(secret = name, "vault: permission denied, logging in again");
                    self.forget(&token);
                    token = self.token()?;
                    retried = true;
                }
                status => return Err(VaultError::Http { what: WHAT, status, detail: vault_errors(&body, &[&token]) }),
            }
        }
    }

    fn value_of(&self, name: &str, path: &str, body: &[u8]) -> Result<Zeroizing<String>, VaultError> {
        let mut p = Parsed::new("read", body)?;
        let field = |detail: String| VaultError::Field { name: name.into(), path: path.into(), detail };
        match p.0.pointer("/data/data") {
            Some(Value::Object(data)) => match data.get(VALUE_FIELD) {
                Some(Value::String(_)) => {}
                Some(_) => return Err(field(format!("field '{VALUE_FIELD}' is not a string"))),
                None => return Err(field(format!("has no field '{VALUE_FIELD}' (store it as {VALUE_FIELD}=…)"))),
            },
            _ => {
                return Err(VaultError::Malformed {
                    what: "read",
                    detail: "no data.data object (is the mount KV version 2?)".into(),
                })
            }
        }
        p.take_string(&format!("/data/data/{VALUE_FIELD}"))
            .ok_or_else(|| field(format!("has no field '{VALUE_FIELD}'")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(yaml: &str) -> SecretsSection {
        serde_saphyr::from_str(yaml).unwrap()
    }

    const GOOD: &str = "provider: vault\nvault_address: https://vault.example.com:8200\n\
                        vault_ca: /etc/opservant/vault-ca.pem\nvault_path: secret/data/opservant\n\
                        auth_method: approle\nrole_id: opservant-role\n\
                        secret_id_file: /etc/opservant/vault-secret-id\n";

    #[test]
    fn vault_goes_through_the_proxy_unless_no_proxy_names_its_host() {
        assert_eq!(address_host("https://vault.example.com:8200"), "vault.example.com");
        assert_eq!(address_host("https://vault.example.com"), "vault.example.com");
        assert_eq!(address_host("https://[fd00::1]:8200"), "[fd00::1]");
        assert_eq!(address_host("https://10.1.2.3"), "10.1.2.3");
        let settings = |address: &str, network: &str| {
            let secrets: String = GOOD.lines().map(|l| format!("  {l}\n")).collect();
            let text =
                format!("secrets:\n{secrets}network:\n{network}").replace("https://vault.example.com:8200", address);
            VaultSettings::for_config(&crate::config::Config::parse(&text).unwrap()).unwrap().proxy
        };
        let proxy =
            "  proxy:\n    https: http://proxy.example.com:3128\n    no_proxy: [\"10.0.0.0/8\", \".internal\"]\n";
        let via = Some("http://proxy.example.com:3128".to_string());
        assert_eq!(settings("https://vault.example.com:8200", proxy), via);
        assert_eq!(settings("https://10.1.2.3:8200", proxy), None);
        assert_eq!(settings("https://vault.internal:8200", proxy), None);
        assert_eq!(settings("https://[fd00::1]:8200", proxy), via);
        assert_eq!(settings("https://vault.example.com:8200", "  proxy:\n    http: http://p:3128\n"), None);
        assert_eq!(settings("https://vault.example.com:8200", "  executor_defaults: {outbound: false}\n"), None);
    }

    fn err_of(yaml: &str) -> ConfigError {
        VaultSettings::from_config(&section(yaml)).unwrap_err()
    }

    #[test]
    fn seed_config_parses() {
        let s = VaultSettings::from_config(&section(GOOD)).unwrap();
        assert_eq!(s.address, "https://vault.example.com:8200");
        assert_eq!((s.mount.as_str(), s.prefix.as_str()), ("secret", "opservant"));
        assert_eq!(s.kv_path("api_key"), "secret/data/opservant/api_key");
        assert_eq!(s.namespace, None);
    }

    #[test]
    fn kv_paths() {
        for (p, mount, prefix) in [
            ("secret/data/opservant", "secret", "opservant"),
            ("secret/opservant", "secret", "opservant"),
            ("/secret/data/", "secret", ""),
            ("secret", "secret", ""),
            ("team/kv/data/a/b", "team/kv", "a/b"),
        ] {
            assert_eq!(parse_kv_path(p).unwrap(), (mount.to_string(), prefix.to_string()), "{p}");
        }
        for p in ["data/x", "secret/../x", "secret//x", "secret/a?b", "secret/a%2f", "secret/a#b", ""] {
            assert!(parse_kv_path(p).is_err(), "{p}");
        }
    }

    #[test]
    fn every_config_error_names_its_key() {
        let cases: &[(&str, &str, &str)] = &[
            ("vault_address: https://vault.example.com:8200\n", "", "secrets.vault_address"),
            (
                "vault_address: https://vault.example.com:8200\n",
                "vault_address: http://vault:8200\n",
                "secrets.vault_address",
            ),
            (
                "vault_address: https://vault.example.com:8200\n",
                "vault_address: https://u@vault/x\n",
                "secrets.vault_address",
            ),
            ("vault_address: https://vault.example.com:8200\n", "vault_address: vault:8200\n", "secrets.vault_address"),
            ("vault_ca: /etc/opservant/vault-ca.pem\n", "", "secrets.vault_ca"),
            ("vault_ca: /etc/opservant/vault-ca.pem\n", "vault_ca: ca.pem\n", "secrets.vault_ca"),
            ("vault_path: secret/data/opservant\n", "", "secrets.vault_path"),
            ("vault_path: secret/data/opservant\n", "vault_path: secret/../x\n", "secrets.vault_path"),
            ("auth_method: approle\n", "auth_method: token\n", "secrets.auth_method"),
            ("role_id: opservant-role\n", "", "secrets.role_id"),
            ("role_id: opservant-role\n", "role_id: \"\"\n", "secrets.role_id"),
            (
                "secret_id_file: /etc/opservant/vault-secret-id\n",
                "secret_id_file: vault-secret-id\n",
                "secrets.secret_id_file",
            ),
        ];
        for (from, to, key) in cases {
            let yaml = GOOD.replace(from, to);
            assert_eq!(err_of(&yaml).path, *key, "{yaml}");
        }
        let e = err_of(&GOOD.replace("vault_address: https://vault.example.com:8200", "vault_address: http://v:8200"));
        assert!(e.message.contains("http"), "{e}");
        let e = err_of(&GOOD.replace("approle", "kubernetes"));
        assert!(e.message.contains("kubernetes") && e.message.contains("approle"), "{e}");
        let e = err_of(&format!("{GOOD}vault_namespace: \"a\\nX-Injected: 1\"\n"));
        assert_eq!(e.path, "secrets.vault_namespace");
        let ok = VaultSettings::from_config(&section(&format!("{GOOD}vault_namespace: team-a/sub\n"))).unwrap();
        assert_eq!(ok.namespace.as_deref(), Some("team-a/sub"));
        // No auth_method means approle.
        assert!(VaultSettings::from_config(&section(&GOOD.replace("auth_method: approle\n", ""))).is_ok());
    }

    #[test]
    fn secret_names_never_add_path_segments() {
        let c = VaultClient {
            settings: VaultSettings::from_config(&section(GOOD)).unwrap(),
            http: ureq::Agent::new_with_defaults(),
            token: Mutex::new(None),
        };
        for name in ["..", ".", "a/b", "../x", "a?b", "a#b", "a%2fb", "", "a b", &"x".repeat(129)] {
            assert!(matches!(c.get(name), Err(VaultError::BadName(_))), "{name}");
        }
    }

    #[test]
    fn secret_id_file_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("opservant-vault-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("secret-id");
        std::fs::write(&f, "s3cret-id\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let mut s = VaultSettings::from_config(&section(GOOD)).unwrap();
        s.secret_id_file = Some(f.clone());
        let e = s.read_secret_id().unwrap_err();
        assert!(e.starts_with("secrets.secret_id_file:") && e.contains("mode 0600"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(s.read_secret_id().unwrap().as_str(), "s3cret-id");
        std::fs::write(&f, "\n").unwrap();
        assert!(s.read_secret_id().unwrap_err().contains("empty"));
        s.secret_id_file = None;
        if std::env::var_os("CREDENTIALS_DIRECTORY").is_none() {
            assert!(s.read_secret_id().unwrap_err().starts_with("secrets.secret_id_file: is required"));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn vault_errors_are_short_and_scrubbed() {
        let body = br#"{"errors":["invalid secret id tok-123 given","second"]}"#;
        assert_eq!(vault_errors(body, &["tok-123"]), ": invalid secret id [REDACTED] given; second");
        assert_eq!(vault_errors(b"not json", &[]), "");
        let long = serde_json::json!({"errors": ["é".repeat(300)]}).to_string();
        assert!(vault_errors(long.as_bytes(), &[]).len() <= MAX_DETAIL + 8);
    }
}
