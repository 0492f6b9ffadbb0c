//! A test platform: an HTTPS server on 127.0.0.1 that requires client certificates (rustls,
//! TLS 1.3), serves queued signed commands on `GET /v1/agents/{id}/commands` and collects
//! `POST …/results` and `…/heartbeat`, and serves executor packages on
//! `GET …/packages/{name}` (404 for an unknown name). Certificates come from [`Pki`] (rcgen): a CA, a server
//! certificate for 127.0.0.1 and a client certificate, all signed by that CA.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "https.rs"]
pub mod https;

/// A CA and the server and client certificates it signed (PEM).
pub struct Pki {
    pub ca: String,
    pub server_cert: String,
    pub server_key: String,
    pub client_cert: String,
    pub client_key: String,
    /// The CA, to sign revocation lists with ([`Pki::crl`]).
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// With [`Pki::with_intermediate`]: the intermediate CA that signed the server's
    /// certificate.
    intermediate: Option<rcgen::Issuer<'static, rcgen::KeyPair>>,
}

/// The serial number of [`Pki::with_intermediate`]'s intermediate CA.
pub const INTERMEDIATE_SERIAL: u64 = 0x1a7;

/// The serial numbers of [`Pki`]'s server and client certificates.
pub const SERVER_SERIAL: u64 = 0x5e1;
pub const CLIENT_SERIAL: u64 = 0xc11;

impl Pki {
    pub fn new(name: &str) -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
        let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = |cn: &str, san: Option<SanType>, serial: u64| {
            let key = KeyPair::generate().expect("key");
            let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
            p.serial_number = Some(serial.into());
            p.distinguished_name.push(DnType::CommonName, cn);
            p.subject_alt_names = san.into_iter().collect();
            let cert = p.signed_by(&key, &issuer).expect("certificate");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) =
            leaf("platform", Some(SanType::IpAddress("127.0.0.1".parse().unwrap())), SERVER_SERIAL);
        let (client_cert, client_key) = leaf("agent", None, CLIENT_SERIAL);
        Pki { ca: ca.pem(), server_cert, server_key, client_cert, client_key, issuer, intermediate: None }
    }

    /// As [`Pki::new`], but the server's certificate is signed by an intermediate CA the
    /// root signed (the server sends both); the client's is the root's.
    pub fn with_intermediate(name: &str) -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
        let mut pki = Pki::new(name);
        let key = KeyPair::generate().expect("intermediate key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("intermediate params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.serial_number = Some(INTERMEDIATE_SERIAL.into());
        params.distinguished_name.push(DnType::CommonName, format!("{name} intermediate CA"));
        let cert = params.signed_by(&key, &pki.issuer).expect("intermediate certificate");
        let intermediate = Issuer::new(params, key);
        let leaf_key = KeyPair::generate().expect("key");
        let mut leaf = CertificateParams::new(Vec::<String>::new()).expect("params");
        leaf.serial_number = Some(SERVER_SERIAL.into());
        leaf.distinguished_name.push(DnType::CommonName, "platform");
        leaf.subject_alt_names = vec![SanType::IpAddress("127.0.0.1".parse().unwrap())];
        let leaf = leaf.signed_by(&leaf_key, &intermediate).expect("certificate");
        pki.server_cert = format!("{}{}", leaf.pem(), cert.pem());
        pki.server_key = leaf_key.serialize_pem();
        pki.intermediate = Some(intermediate);
        pki
    }

    /// As [`Pki::crl`], signed by the intermediate CA of [`Pki::with_intermediate`].
    pub fn intermediate_crl(&self, revoked: &[u64], next_update_year: i32) -> String {
        crl_by(self.intermediate.as_ref().expect("an intermediate CA"), revoked, (next_update_year, 1, 1))
    }

    /// A revocation list (PEM) signed by this CA, revoking the certificates with `revoked`
    /// serial numbers, issued in 2020 with its next update in `next_update_year`.
    pub fn crl(&self, revoked: &[u64], next_update_year: i32) -> String {
        crl_by(&self.issuer, revoked, (next_update_year, 1, 1))
    }

    /// A revocation list (PEM) of this CA revoking nothing, its next update at midnight of
    /// `(year, month, day)`.
    pub fn crl_until(&self, next_update: (i32, u8, u8)) -> String {
        crl_by(&self.issuer, &[], next_update)
    }

    /// Write the agent's side (CA, client certificate, client key 0600) into `dir`.
    pub fn write_agent_files(&self, dir: &Path) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("ca.pem"), &self.ca).unwrap();
        std::fs::write(dir.join("agent.crt"), &self.client_cert).unwrap();
        std::fs::write(dir.join("agent.key"), &self.client_key).unwrap();
        std::fs::set_permissions(dir.join("agent.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
}

/// A revocation list (PEM) signed by `issuer`, revoking `revoked` serial numbers, issued in
/// 2020 with its next update at midnight of `next_update` (year, month, day).
fn crl_by(issuer: &rcgen::Issuer<'static, rcgen::KeyPair>, revoked: &[u64], next_update: (i32, u8, u8)) -> String {
    let params = rcgen::CertificateRevocationListParams {
        this_update: rcgen::date_time_ymd(2020, 1, 1),
        next_update: rcgen::date_time_ymd(next_update.0, next_update.1, next_update.2),
        crl_number: 1u64.into(),
        issuing_distribution_point: None,
        revoked_certs: revoked
            .iter()
            .map(|serial| rcgen::RevokedCertParams {
                serial_number: (*serial).into(),
                revocation_time: rcgen::date_time_ymd(2020, 1, 1),
                reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                invalidity_date: None,
            })
            .collect(),
        key_identifier_method: rcgen::KeyIdMethod::Sha256,
    };
    params.signed_by(issuer).expect("CRL").pem().expect("CRL PEM")
}

#[derive(Default)]
pub struct State {
    pub queue: VecDeque<Value>,
    pub results: Vec<Value>,
    pub heartbeats: Vec<Value>,
    /// "METHOD path" of every request that completed a TLS handshake.
    pub requests: Vec<String>,
    /// Files served on `GET /v1/agents/{id}/packages/{name}` (packages and `.sig` files).
    pub packages: std::collections::HashMap<String, Vec<u8>>,
    /// Send packages without `Content-Length` (the body ends when the connection closes), so
    /// only the agent's own read bound can stop an oversize one.
    pub packages_without_length: bool,
    /// Answer `GET commands` at once instead of holding the long poll (as a proxy that does
    /// not hold requests would).
    pub no_long_poll: bool,
    /// Answer every `POST` with `303 See Other` to this location (a misconfigured front end).
    pub redirect_posts: Option<String>,
    /// Bodies served as they are, one per `GET commands`, before the queue is looked at.
    pub raw_batches: VecDeque<String>,
    /// Hold every `GET commands` (as long as this is set, up to 60 s) before answering it.
    pub hold_polls: bool,
    /// When each `GET commands` arrived.
    pub polls_at: Vec<Instant>,
    /// When each result (in `results`) arrived.
    pub results_at: Vec<Instant>,
    /// Keep connections open for further requests (`Connection: keep-alive`).
    pub keep_alive: bool,
    /// Answer `POST results` with `503` (counted in `results_refused`), keeping none.
    pub refuse_results: bool,
    pub results_refused: usize,
}

pub struct TestPlatform {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<State>>,
    /// Connections whose TLS handshake failed (no or wrong client certificate, …).
    pub handshake_failures: Arc<AtomicUsize>,
    /// Connections that brought a request (each one handshake).
    pub connections: Arc<AtomicUsize>,
    /// Stops accepting when dropped.
    _server: https::Server,
}

fn certs(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes()).map(|c| c.expect("PEM certificate")).collect()
}

impl TestPlatform {
    /// Serve with `server` (certificate and key) and require client certificates signed by
    /// `client_ca`.
    pub fn start(server: &Pki, client_ca: &Pki) -> TestPlatform {
        use rustls::pki_types::pem::PemObject;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(&client_ca.ca) {
            roots.add(c).unwrap();
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .unwrap();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(server.server_key.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs(&server.server_cert), key)
            .unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let handler_state = state.clone();
        let server = https::Server::start(config, true, move |req| handle(req, &handler_state));
        TestPlatform {
            addr: server.addr,
            state,
            handshake_failures: server.handshake_failures.clone(),
            connections: server.connections.clone(),
            _server: server,
        }
    }

    /// Serve `bytes` as `GET …/packages/{name}`.
    pub fn serve_package(&self, name: &str, bytes: Vec<u8>) {
        self.state.lock().unwrap().packages.insert(name.to_string(), bytes);
    }

    pub fn queue(&self, cmd: Value) {
        self.state.lock().unwrap().queue.push_back(cmd);
    }

    /// Wait until `pred` holds on the state (or panic after `secs`).
    pub fn wait_for(&self, secs: u64, what: &str, pred: impl Fn(&State) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if pred(&self.state.lock().unwrap()) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn handle(req: https::Request, state: &Mutex<State>) -> https::Response {
    let mut r = answer(req, state);
    r.keep_alive = state.lock().unwrap().keep_alive;
    r
}

fn answer(req: https::Request, state: &Mutex<State>) -> https::Response {
    let (method, path) = (req.method.as_str(), req.path());
    state.lock().unwrap().requests.push(format!("{method} {path}"));
    if let (Some(name), "GET") = (path.split("/packages/").nth(1), method) {
        let st = state.lock().unwrap();
        let (status, body) = match st.packages.get(name) {
            Some(b) => ("200 OK", b.clone()),
            None => ("404 Not Found", b"no such package".to_vec()),
        };
        let length = !(status == "200 OK" && st.packages_without_length);
        return https::Response {
            status: status.into(),
            content_type: "application/octet-stream",
            body,
            length,
            location: None,
            keep_alive: false,
        };
    }
    if let (Some(to), "POST") = (state.lock().unwrap().redirect_posts.clone(), method) {
        let mut r = https::Response::json("303 See Other", &json!({}));
        r.location = Some(to);
        return r;
    }
    if (method, path.rsplit('/').next().unwrap_or("")) == ("GET", "commands") {
        state.lock().unwrap().polls_at.push(Instant::now());
        let held = Instant::now();
        while state.lock().unwrap().hold_polls && held.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let reply = match (method, path.rsplit('/').next().unwrap_or("")) {
        ("GET", "commands") if !state.lock().unwrap().raw_batches.is_empty() => {
            let body = state.lock().unwrap().raw_batches.pop_front().unwrap_or_default();
            return https::Response {
                status: "200 OK".into(),
                content_type: "application/json",
                body: body.into_bytes(),
                length: true,
                location: None,
                keep_alive: false,
            };
        }
        ("GET", "commands") => {
            // A short long-poll: up to 500 ms for something to be queued.
            let hold = if state.lock().unwrap().no_long_poll { 0 } else { 500 };
            let deadline = Instant::now() + Duration::from_millis(hold);
            loop {
                let batch: Vec<Value> = state.lock().unwrap().queue.drain(..).collect();
                if !batch.is_empty() || Instant::now() >= deadline {
                    break json!({ "commands": batch });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        ("POST", "results") => {
            let mut st = state.lock().unwrap();
            if st.refuse_results {
                st.results_refused += 1;
                return https::Response::json("503 Service Unavailable", &json!({"error": "try later"}));
            }
            st.results.push(serde_json::from_slice(&req.body).unwrap_or(Value::Null));
            st.results_at.push(Instant::now());
            json!({"ok": true})
        }
        ("POST", "heartbeat") => {
            state.lock().unwrap().heartbeats.push(serde_json::from_slice(&req.body).unwrap_or(Value::Null));
            json!({"ok": true})
        }
        _ => json!({"error": "not found"}),
    };
    https::Response::json("200 OK", &reply)
}
