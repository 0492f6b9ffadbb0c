//! A test HashiCorp Vault: an HTTPS server on 127.0.0.1 (rustls, TLS 1.3, a certificate from
//! [`crate::platform::Pki`]) implementing just the API the agent uses:
//!
//! - `POST /v1/auth/approle/login` `{"role_id","secret_id"}`: the configured pair → a new token
//!   (`auth.client_token`, `auth.lease_duration` = the configured TTL, `auth.renewable`);
//!   anything else → 400 `{"errors":["invalid role or secret ID"]}`;
//! - `POST /v1/auth/token/renew-self` (`X-Vault-Token`): a live token's lease starts again;
//! - `GET /v1/{mount}/data/{path}`: KV v2 `{"data":{"data":{…},"metadata":{…}}}`, 404 when
//!   absent;
//! - a missing, unknown or expired token → 403 `{"errors":["permission denied"]}`.
//!
//! Every request is logged (`"METHOD /v1/…"` and its status) so tests can assert what was
//! called; `deny_reads` makes the next N reads answer 403 whatever the token.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::platform::{https, Pki};

/// One logged request.
#[derive(Debug, Clone)]
pub struct Logged {
    pub method: String,
    pub path: String,
    pub status: u16,
    pub namespace: Option<String>,
}

pub struct State {
    pub role_id: String,
    pub secret_id: String,
    /// Lease of new and renewed tokens.
    pub ttl: Duration,
    pub renewable: bool,
    /// KV v2 data by API path (e.g. `secret/data/opservant/api_key`).
    pub kv: HashMap<String, Value>,
    /// Live tokens and when they expire.
    pub tokens: HashMap<String, Instant>,
    pub log: Vec<Logged>,
    /// Answer this many reads with 403 whatever the token.
    pub deny_reads: usize,
}

impl State {
    pub fn count(&self, method: &str, path: &str) -> usize {
        self.log.iter().filter(|l| l.method == method && l.path == path).count()
    }
    pub fn logins(&self) -> usize {
        self.count("POST", "/v1/auth/approle/login")
    }
    pub fn renewals(&self) -> usize {
        self.count("POST", "/v1/auth/token/renew-self")
    }
    /// Requests whose path starts with `prefix`.
    pub fn under(&self, prefix: &str) -> Vec<Logged> {
        self.log.iter().filter(|l| l.path.starts_with(prefix)).cloned().collect()
    }
}

pub struct TestVault {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<State>>,
    /// Connections whose TLS handshake failed.
    pub handshake_failures: Arc<AtomicUsize>,
    /// Stops accepting when dropped.
    _server: https::Server,
}

static TOKENS: AtomicUsize = AtomicUsize::new(0);

impl TestVault {
    /// Serve with `pki`'s server certificate; AppRole `role_id`/`secret_id`, tokens of `ttl`.
    pub fn start(pki: &Pki, role_id: &str, secret_id: &str, ttl: Duration) -> TestVault {
        use rustls::pki_types::pem::PemObject;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain: Vec<_> = rustls::pki_types::CertificateDer::pem_slice_iter(pki.server_cert.as_bytes())
            .map(|c| c.expect("PEM certificate"))
            .collect();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(pki.server_key.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        let state = Arc::new(Mutex::new(State {
            role_id: role_id.into(),
            secret_id: secret_id.into(),
            ttl,
            renewable: true,
            kv: HashMap::new(),
            tokens: HashMap::new(),
            log: Vec::new(),
            deny_reads: 0,
        }));
        let handler_state = state.clone();
        let server = https::Server::start(config, false, move |req| handle(req, &handler_state));
        TestVault { addr: server.addr, state, handshake_failures: server.handshake_failures.clone(), _server: server }
    }

    pub fn address(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Store a KV v2 secret's data at `path` (e.g. `secret/data/opservant/api_key`).
    pub fn put(&self, path: &str, data: Value) {
        self.state.lock().unwrap().kv.insert(path.into(), data);
    }

    pub fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap())
    }
}

fn auth(token: &str, ttl: Duration, renewable: bool) -> Value {
    json!({"request_id": "test", "lease_id": "", "renewable": false, "lease_duration": 0, "data": null,
           "auth": {"client_token": token, "accessor": "acc", "policies": ["default", "opservant"],
                    "lease_duration": ttl.as_secs(), "renewable": renewable}})
}

fn route(method: &str, path: &str, token: Option<&str>, body: &[u8], st: &mut State) -> (u16, Value) {
    let denied = (403, json!({"errors": ["permission denied"]}));
    let now = Instant::now();
    let live = token.is_some_and(|t| st.tokens.get(t).is_some_and(|exp| *exp > now));
    match (method, path) {
        ("POST", "/v1/auth/approle/login") => {
            let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            if req["role_id"] == st.role_id.as_str() && req["secret_id"] == st.secret_id.as_str() {
                let token = format!("hvs.test-{}-{}", std::process::id(), TOKENS.fetch_add(1, Ordering::SeqCst));
                st.tokens.insert(token.clone(), now + st.ttl);
                (200, auth(&token, st.ttl, st.renewable))
            } else {
                (400, json!({"errors": ["invalid role or secret ID"]}))
            }
        }
        ("POST", "/v1/auth/token/renew-self") if live => {
            let token = token.unwrap_or_default().to_string();
            st.tokens.insert(token.clone(), now + st.ttl);
            (200, auth(&token, st.ttl, st.renewable))
        }
        ("GET", p) if p.starts_with("/v1/") && p.contains("/data/") => {
            if st.deny_reads > 0 {
                st.deny_reads -= 1;
                return denied;
            }
            if !live {
                return denied;
            }
            match st.kv.get(&p["/v1/".len()..]) {
                Some(data) => (
                    200,
                    json!({"request_id": "test", "lease_id": "", "renewable": false, "lease_duration": 0,
                           "data": {"data": data, "metadata": {"created_time": "2026-01-01T00:00:00Z",
                                    "deletion_time": "", "destroyed": false, "version": 1}}}),
                ),
                None => (404, json!({"errors": []})),
            }
        }
        _ => denied,
    }
}

fn handle(req: https::Request, state: &Mutex<State>) -> https::Response {
    let (status, reply) = {
        let mut st = state.lock().unwrap();
        let (status, reply) = route(&req.method, &req.target, req.header("x-vault-token"), &req.body, &mut st);
        st.log.push(Logged {
            method: req.method.clone(),
            path: req.target.clone(),
            status,
            namespace: req.header("x-vault-namespace").map(str::to_string),
        });
        (status, reply)
    };
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        _ => "Not Found",
    };
    https::Response::json(&format!("{status} {reason}"), &reply)
}
