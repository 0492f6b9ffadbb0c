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
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::platform::Pki;

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
    stop: Arc<AtomicBool>,
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
        let config = Arc::new(config);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
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
        let failures = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (state, failures, stop) = (state.clone(), failures.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((tcp, _)) => {
                            let (config, state, failures) = (config.clone(), state.clone(), failures.clone());
                            std::thread::spawn(move || handle(tcp, config, &state, &failures));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            });
        }
        TestVault { addr, state, handshake_failures: failures, stop }
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

impl Drop for TestVault {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
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

fn handle(tcp: std::net::TcpStream, config: Arc<rustls::ServerConfig>, state: &Mutex<State>, failures: &AtomicUsize) {
    let _ = tcp.set_nonblocking(false);
    let _ = tcp.set_read_timeout(Some(Duration::from_secs(10)));
    let conn = rustls::ServerConnection::new(config).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        match tls.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => {
                if tls.conn.is_handshaking() {
                    failures.fetch_add(1, Ordering::SeqCst);
                }
                return;
            }
        }
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.lines();
    let first = lines.next().unwrap_or_default().to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let header = |name: &str| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let len: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    while buf.len() < head_end + len {
        match tls.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let body = &buf[head_end..head_end + len];
    let mut parts = first.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let token = header("x-vault-token");
    let (status, reply) = {
        let mut st = state.lock().unwrap();
        let (status, reply) = route(method, target, token.as_deref(), body, &mut st);
        st.log.push(Logged {
            method: method.into(),
            path: target.into(),
            status,
            namespace: header("x-vault-namespace"),
        });
        (status, reply)
    };
    let text = reply.to_string();
    let resp = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        match status {
            200 => "OK",
            400 => "Bad Request",
            403 => "Forbidden",
            _ => "Not Found",
        },
        text.len()
    );
    let _ = tls.write_all(resp.as_bytes());
    tls.conn.send_close_notify();
    let _ = tls.flush();
}
