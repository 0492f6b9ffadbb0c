//! The agent's connection to the platform (seed 001 `network.agent_to_platform`): outbound
//! only, HTTPS with a client certificate, TLS 1.3 only, the server verified against the
//! platform CA from the configuration (the system trust store is never consulted).
//!
//! - `GET /v1/agents/{id}/commands` long-polls for `{"commands": [signed command, …]}`; at
//!   most `agent.max_concurrent` platform commands are in hand at once — the poll waits for
//!   room and takes no more of a batch than there is, the rest left for the platform to send
//!   again (one `platform_error` record says how many), never a thread each. The batch is
//!   read without building it ([`read_batch`]): the entries taken are kept as the exact text
//!   they arrived as, those past the room are only counted, so a 16 MiB batch of tiny
//!   entries costs no more memory than its body. Each entry taken goes through
//!   [`crate::command::Pipeline`] like a command from the socket — parsed strictly there, so
//!   an entry the parser refuses (a duplicate key, too deep) is one `malformed` rejection
//!   posted back, not the whole batch refused;
//! - `POST /v1/agents/{id}/results` carries each reply (`{"agent_id", "command_id",
//!   "result"}`), rejections included;
//! - `POST /v1/agents/{id}/heartbeat` every `heartbeat_seconds` with the version, the
//!   installed executors, the number of running commands, the `executors.install` entries
//!   that failed at start (`install_failures`: entry, package, error), how sandboxes start
//!   (`sandboxes`: launch mode, whether the zygote runs, the warm pool's size and ready
//!   sandboxes), the audit log's health (`audit`: see [`crate::audit::health`]) and
//!   `doctor`'s findings;
//! - failures back off exponentially (1 s doubling to 60 s, ±50 % jitter) and are logged;
//!   a TLS failure (wrong CA, no certificate) never falls back to anything weaker;
//! - with `network.proxy.https` set, platform traffic goes through that proxy;
//! - `GET /v1/agents/{id}/packages/{name}` (and `{name}.sig`) downloads an executor package
//!   for an `install_executor` command over the same mutual-TLS connection ([`Packages`]);
//!   anything but `200` is an error (`404` on the `.sig` means "no signature"), a
//!   `Content-Length` above the cap is refused before the body is read, and the body is read
//!   through a bound one byte past the cap, so an oversize package is never taken whole.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::command::Pipeline;

/// `network.agent_to_platform`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PlatformSection {
    /// `https` (the only protocol accepted).
    pub protocol: Option<String>,
    pub host: Option<String>,
    pub port: Option<u16>,
    /// The CA (PEM) the platform's server certificate must chain to.
    pub ca: Option<PathBuf>,
    /// This agent's client certificate chain (PEM) and private key (PEM, root-only).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Certificate revocation lists (PEM) the platform's chain is checked against, read
    /// again when the file changes.
    pub crl: Option<PathBuf>,
    /// Long-poll wait the agent asks for (default 25 s).
    pub poll_seconds: Option<u64>,
    /// Heartbeat period (default 60 s).
    pub heartbeat_seconds: Option<u64>,
}

/// A usable platform connection: endpoint and the TLS agent.
pub struct Platform {
    base: String,
    agent_id: String,
    http: ureq::Agent,
    poll: Duration,
    heartbeat: Duration,
}

/// A certificate or key file the configuration names: a regular file of at most
/// [`crate::tls::MAX_CERT_FILE`] bytes.
fn read(p: &std::path::Path, what: &str) -> Result<Vec<u8>, String> {
    crate::bounded::read_regular(p, crate::tls::MAX_CERT_FILE)
        .map_err(|e| format!("network.agent_to_platform.{what}: {}: {e}", p.display()))
}

impl Platform {
    /// `Ok(None)` when no platform is configured.
    pub fn from_config(c: &crate::config::Config) -> Result<Option<Platform>, String> {
        let Some(p) = &c.network.agent_to_platform else { return Ok(None) };
        let field = |name: &str| format!("network.agent_to_platform.{name}: required");
        if p.protocol.as_deref().is_some_and(|v| v != "https") {
            return Err("network.agent_to_platform.protocol: only https".into());
        }
        let host = p.host.clone().ok_or_else(|| field("host"))?;
        // A name or an address only: the scheme, the port and the path are the agent's.
        if host.is_empty()
            || host.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b"/?#@\\".contains(&b))
            || (host.contains(':')
                && host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::Ipv6Addr>().is_err())
        {
            return Err(format!(
                "network.agent_to_platform.host: {host:?}: a host name or address, without scheme, port or path (the port is `port`)"
            ));
        }
        let (ca, cert, key) = (
            p.ca.clone().ok_or_else(|| field("ca"))?,
            p.cert.clone().ok_or_else(|| field("cert"))?,
            p.key.clone().ok_or_else(|| field("key"))?,
        );
        for (name, path) in [("cert", &cert), ("key", &key)] {
            crate::config::check_trust_file(&format!("network.agent_to_platform.{name}"), path)?;
        }
        {
            use std::os::unix::fs::MetadataExt;
            let meta = std::fs::metadata(&key)
                .map_err(|e| format!("network.agent_to_platform.key: {}: {e}", key.display()))?;
            if meta.mode() & 0o077 != 0 {
                return Err(format!(
                    "network.agent_to_platform.key: {}: must not be readable by group or others (chmod 600)",
                    key.display()
                ));
            }
        }
        let roots = crate::tls::read_ca(&ca, "network.agent_to_platform.ca")?;
        let chain = crate::tls::pem_certificates(&read(&cert, "cert")?);
        if chain.is_empty() {
            return Err(format!("network.agent_to_platform.cert: {}: no certificate in it", cert.display()));
        }
        let key_pem = zeroize::Zeroizing::new(read(&key, "key")?);
        crate::tls::check_client_key(&chain, &key_pem)
            .map_err(|e| format!("network.agent_to_platform.key: {}: {e} (cert: {})", key.display(), cert.display()))?;
        // TLS 1.3 only, the platform CA only, its revocation lists when configured.
        let crl = p.crl.as_deref().map(|path| ("network.agent_to_platform.crl", path));
        let tls = crate::tls::ClientTls::new(
            ("network.agent_to_platform.ca", &ca, &roots),
            Some(("network.agent_to_platform.key", &chain, &key_pem)),
            crl,
        )
        .map_err(|e| if e.starts_with("network.") { e } else { format!("network.agent_to_platform: {e}") })?;
        let poll = Duration::from_secs(p.poll_seconds.unwrap_or(25).clamp(1, 300));
        let no_proxy = c.network.proxy.as_ref().is_some_and(|x| bypasses_proxy(&host, &x.no_proxy));
        let proxy = match c.network.proxy.as_ref().and_then(|x| x.https.clone()) {
            Some(url) if !no_proxy => Some(ureq::Proxy::new(&url).map_err(|e| format!("network.proxy.https: {e}"))?),
            _ => None,
        };
        let config = ureq::Agent::config_builder()
            .https_only(true)
            .proxy(proxy)
            // The platform's API does not move: a redirect would turn a POSTed result into a
            // GET of another URL (lost, yet counted as sent). A 3xx is an error like a 5xx.
            .max_redirects(0)
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(10)))
            .timeout_global(Some(poll + Duration::from_secs(15)))
            .build();
        let http =
            ureq::Agent::with_parts(config, tls.connector(), ureq::unversioned::resolver::DefaultResolver::default());
        let base = format!("https://{}:{}", bracket(&host), p.port.unwrap_or(443));
        Ok(Some(Platform {
            base,
            agent_id: c.agent_id(),
            http,
            poll,
            heartbeat: Duration::from_secs(p.heartbeat_seconds.unwrap_or(60).clamp(1, 3600)),
        }))
    }

    fn url(&self, what: &str) -> String {
        format!("{}/v1/agents/{}/{what}", self.base, path_segment(&self.agent_id))
    }

    /// The package downloads of `install_executor`, over this connection.
    pub fn packages(&self) -> Packages {
        Packages { base: self.base.clone(), agent_id: self.agent_id.clone(), http: self.http.clone() }
    }

    /// One long poll: the raw bytes of at most `room` of the commands it brought, and how
    /// many more it brought (left for the platform to send again).
    fn poll_once(&self, room: usize) -> Result<(Vec<Vec<u8>>, usize), String> {
        let mut resp = self
            .http
            .get(&self.url("commands"))
            .query("wait", self.poll.as_secs().to_string())
            .call()
            .map_err(|e| format!("GET commands: {e}"))?;
        let status = resp.status().as_u16();
        if status == 204 {
            return Ok((vec![], 0));
        }
        if status != 200 {
            return Err(format!("GET commands: HTTP {status}"));
        }
        let body = resp
            .body_mut()
            .with_config()
            .limit(16 * crate::signing::MAX_COMMAND_BYTES as u64)
            .read_to_vec()
            .map_err(|e| format!("GET commands: {e}"))?;
        read_batch(&body, room).map_err(|e| format!("GET commands: {e}"))
    }

    fn post(&self, what: &str, body: &Value) -> Result<(), String> {
        let resp = self
            .http
            .post(&self.url(what))
            .header("content-type", "application/json")
            .send(body.to_string())
            .map_err(|e| format!("POST {what}: {e}"))?;
        match resp.status().as_u16() {
            200..=299 => Ok(()),
            s => Err(format!("POST {what}: HTTP {s}")),
        }
    }
}

/// How long one package download may take in all.
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(600);

/// Downloads of executor packages from the platform (mutual TLS, like the rest).
#[derive(Clone)]
pub struct Packages {
    base: String,
    agent_id: String,
    http: ureq::Agent,
}

/// A package name as it may appear in the URL: 1-128 of `A-Z a-z 0-9 . _ -`, not starting
/// with a dot (no `/`, no `..`, nothing to escape).
pub fn valid_package_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Packages {
    fn get(&self, file: &str) -> Result<ureq::http::Response<ureq::Body>, String> {
        if !valid_package_name(file.trim_end_matches(".sig")) {
            return Err(format!("{file:?}: not a valid package name"));
        }
        let url = format!("{}/v1/agents/{}/packages/{file}", self.base, path_segment(&self.agent_id));
        self.http
            .get(&url)
            .config()
            .timeout_global(Some(DOWNLOAD_TIMEOUT))
            .build()
            .call()
            .map_err(|e| format!("GET packages/{file}: {e}"))
    }

    /// `GET …/packages/{name}`: the body, to be read at most `max` bytes (plus one, to tell
    /// an oversize package). A `Content-Length` above `max` is refused here.
    pub fn open(&self, name: &str, max: u64) -> Result<PackageBody, PackageError> {
        let resp = self.get(name).map_err(PackageError::Download)?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(PackageError::Download(format!("GET packages/{name}: HTTP {status}")));
        }
        if let Some(len) = resp.body().content_length().filter(|l| *l > max) {
            return Err(PackageError::TooLarge(format!(
                "{name}: the platform announces {len} bytes, more than the {max} allowed"
            )));
        }
        Ok(PackageBody(Box::new(std::io::Read::take(resp.into_body().into_reader(), max + 1))))
    }

    /// `GET …/packages/{name}.sig`: the detached signature's text; `None` on `404`.
    pub fn signature(&self, name: &str) -> Result<Option<String>, String> {
        let file = format!("{name}.sig");
        let mut resp = self.get(&file)?;
        match resp.status().as_u16() {
            200 => resp
                .body_mut()
                .with_config()
                .limit(4096)
                .read_to_string()
                .map(Some)
                .map_err(|e| format!("GET packages/{file}: {e}")),
            404 => Ok(None),
            s => Err(format!("GET packages/{file}: HTTP {s}")),
        }
    }
}

/// A package download's body (already bounded).
pub struct PackageBody(Box<dyn std::io::Read + Send>);

impl std::io::Read for PackageBody {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

/// Why a package could not be downloaded.
#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    #[error("{0}")]
    Download(String),
    #[error("{0}")]
    TooLarge(String),
}

/// Whether `network.proxy.no_proxy` names `host` (the platform's, Vault's): `*`; the host itself; a
/// domain it is in (`example.com` or `.example.com` for `api.example.com`); or, for an
/// address, a network containing it (`10.0.0.0/8`) or the address. Case-insensitive; a
/// port in an entry is ignored.
pub(crate) fn bypasses_proxy(host: &str, no_proxy: &[String]) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.').to_ascii_lowercase();
    let addr = host.parse::<std::net::IpAddr>().ok();
    no_proxy.iter().any(|entry| {
        let entry = entry.trim().to_ascii_lowercase();
        if entry == "*" {
            return true;
        }
        if let Some(a) = addr {
            let entry = entry.trim_start_matches('[').trim_end_matches(']');
            // `ADDR` or `ADDR/PREFIX`.
            return entry.parse::<sandbox::net::IpNet>().is_ok_and(|net| net.contains(a));
        }
        // A name: the entry without a port, without its leading dot.
        let name =
            entry.rsplit_once(':').filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())).map_or(&*entry, |(n, _)| n);
        let name = name.trim_start_matches('.').trim_end_matches('.');
        !name.is_empty() && (host == name || host.ends_with(&format!(".{name}")))
    })
}

/// A byte RFC 3986 allows as is in a URL path segment (`pchar`: unreserved, sub-delims, `:`
/// and `@`).
pub fn is_path_segment_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b)
}

/// `id` as one URL path segment: other bytes percent-encoded (a configured `agent.id` has
/// none; the default's hostname part might).
fn path_segment(id: &str) -> String {
    id.bytes().map(|b| if is_path_segment_char(b) { (b as char).to_string() } else { format!("%{b:02X}") }).collect()
}

fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// 1 s doubling to 60 s, with ±50 % jitter.
fn backoff(failures: u32) -> Duration {
    let base = 1u64 << failures.min(6);
    let mut r = [0u8; 2];
    let _ = crate::random::fill(&mut r);
    let jitter = 0.5 + f64::from(u16::from_ne_bytes(r)) / f64::from(u16::MAX);
    Duration::from_secs_f64((base.min(60) as f64) * jitter)
}

/// A poll's body, `{"commands": [entry, …], …}`: the exact text of the first `room` entries
/// and how many more there were. Only the envelope is parsed here — one object, `commands`
/// once, an array — and the rest must be well-formed JSON (walked without recursion, so
/// no depth costs stack here); each entry taken is parsed strictly by the pipeline, as a
/// socket's command is (its depth limit included). Other keys
/// are skipped. Entries past the room are skipped unparsed beyond their syntax, so the
/// memory used is the body's and `room` slices, whatever the number of entries.
pub fn read_batch(body: &[u8], room: usize) -> Result<(Vec<Vec<u8>>, usize), String> {
    use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use serde_json::value::RawValue;

    struct Envelope(usize);
    struct List(usize);
    type Taken = (Vec<Vec<u8>>, usize);

    impl<'de> Visitor<'de> for Envelope {
        type Value = Taken;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object {\"commands\": [...]}")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Taken, A::Error> {
            let mut commands = None;
            while let Some(key) = map.next_key::<String>()? {
                if key != "commands" {
                    map.next_value::<IgnoredAny>()?;
                } else if commands.is_some() {
                    return Err(de::Error::duplicate_field("commands"));
                } else {
                    commands = Some(map.next_value_seed(List(self.0))?);
                }
            }
            commands.ok_or_else(|| de::Error::missing_field("commands"))
        }
    }
    impl<'de> DeserializeSeed<'de> for Envelope {
        type Value = Taken;
        fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Taken, D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'de> Visitor<'de> for List {
        type Value = Taken;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an array of commands")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Taken, A::Error> {
            let (mut taken, mut left) = (Vec::new(), 0usize);
            while taken.len() < self.0 {
                match seq.next_element::<&'de RawValue>()? {
                    Some(raw) => taken.push(raw.get().as_bytes().to_vec()),
                    None => return Ok((taken, 0)),
                }
            }
            while seq.next_element::<IgnoredAny>()?.is_some() {
                left += 1;
            }
            Ok((taken, left))
        }
    }
    impl<'de> DeserializeSeed<'de> for List {
        type Value = Taken;
        fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Taken, D::Error> {
            d.deserialize_seq(self)
        }
    }

    // All of it UTF-8, skipped entries too (serde_json does not check the strings it skips).
    let text = std::str::from_utf8(body).map_err(|e| format!("not UTF-8 ({e})"))?;
    let mut de = serde_json::Deserializer::from_str(text);
    let taken = Envelope(room).deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(taken)
}

/// Run the poller and the heartbeat until `stop`; commands run on their own threads, at most
/// `max_concurrent` of the platform's at once (a batch's commands past the room left are not
/// taken, and the platform sends them again), and within the same places as the socket's:
/// each starts once it has reserved one ([`Pipeline::reserve`]), so none is answered
/// `overloaded`.
///
/// `taken` counts the commands taken and not yet answered, for the caller's drain: it is
/// raised before `stop` is checked and a batch that arrives after the stop is dropped
/// unseen (the platform sends it again, to this agent's successor), so a drain that has set
/// `stop` and then finds `taken` at zero can never be followed by a command starting.
pub fn run(
    platform: Platform,
    pipeline: Arc<Pipeline>,
    stop: Arc<AtomicBool>,
    taken: Arc<std::sync::atomic::AtomicUsize>,
) -> Vec<std::thread::JoinHandle<()>> {
    let platform = Arc::new(platform);
    let refused_in_a_row = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut threads = Vec::new();
    // The answers for the platform's commands a dead predecessor left running: what became
    // of them (`failed`, `interrupted`), posted as their results would have been.
    let interrupted: Vec<_> = std::mem::take(
        &mut *pipeline.interrupted_for_platform.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    if !interrupted.is_empty() {
        let (platform, pipeline) = (platform.clone(), pipeline.clone());
        threads.push(std::thread::spawn(move || {
            for entry in interrupted {
                let reply = crate::inflight::reply(&entry);
                let body = json!({"agent_id": platform.agent_id, "command_id": entry.command_id, "result": reply});
                for attempt in 0..5 {
                    match platform.post("results", &body) {
                        Ok(()) => {
                            // Posted: its record goes (until then the next start posts it).
                            if let Some(f) = &pipeline.inflight {
                                f.posted(&entry.command_id);
                            }
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, attempt, "posting an interrupted command's result failed");
                            std::thread::sleep(backoff(attempt));
                        }
                    }
                }
            }
        }));
    }
    {
        let (platform, stop) = (platform.clone(), stop.clone());
        let pipeline = pipeline.clone();
        threads.push(std::thread::spawn(move || {
            let mut failures = 0u32;
            // Commands in a row from the platform connection that failed the checks of steps
            // 1–6 (counted by the commands' threads, reset by one that passed), and the count
            // last recorded in the audit log.
            let (refused, mut refused_recorded) = (refused_in_a_row, 0u32);
            // Failed polls: when one was last audited, and how many since were not.
            let (mut poll_error_recorded, mut poll_errors_unrecorded) = (None::<std::time::Instant>, 0u32);
            while !stop.load(Ordering::SeqCst) {
                // At most `max_concurrent` of the platform's commands in hand at once (running,
                // or posting their results): the poll waits for room and takes no more than
                // there is, so a platform cannot make the agent start a thread, and write an
                // audit record, for each of the millions of entries a 16 MiB batch can hold.
                // Commands from the socket take the same places: a platform command taken while
                // they fill them would only be rejected as `overloaded` (an audit record and a
                // post each), and the platform may send it straight back. (Waited for first:
                // the commands in hand are counted once answered.)
                let Some(mut room) = room_for_commands(&stop, &taken, || pipeline.running(), pipeline.max_concurrent()) else {
                    break;
                };
                // A connection that answers as the platform without its key (a compromised
                // proxy or front end) could otherwise send commands that fail the checks as
                // fast as they are refused — each one audited, until rotation has dropped
                // every earlier record. Past a few in a row (a platform's own slip: a replay
                // after a lost result post, a stale command), it is polled less and less
                // often (as after failed polls, up to a minute), for one command at a time,
                // and said so once per count.
                let in_a_row = refused.load(Ordering::SeqCst);
                if in_a_row < REFUSED_BEFORE_BACKOFF {
                    refused_recorded = 0;
                } else {
                    let wait = backoff(in_a_row + 1 - REFUSED_BEFORE_BACKOFF);
                    if in_a_row != refused_recorded {
                        refused_recorded = in_a_row;
                        let detail = format!(
                            "{in_a_row} commands in a row from the platform connection failed the checks (unreadable, unsigned, badly signed, stale, addressed to another agent or replayed): polling again in {:.1} s, for one command, and less often while it goes on",
                            wait.as_secs_f64()
                        );
                        tracing::warn!(in_a_row, wait_s = wait.as_secs_f64(), "platform: refused commands in a row; polling less often");
                        crate::audit::record(
                            "security_event",
                            &[("reason", "platform_commands_refused"), ("in_a_row", &in_a_row.to_string()), ("detail", &detail)],
                        );
                    }
                    sleep_unless(&stop, wait);
                    // One command at a time, in the room there is after the wait.
                    match room_for_commands(&stop, &taken, || pipeline.running(), pipeline.max_concurrent()) {
                        Some(_) => room = 1,
                        None => break,
                    }
                }
                let polled = std::time::Instant::now();
                let commands = match platform.poll_once(room) {
                    Ok((c, 0)) => {
                        failures = 0;
                        c
                    }
                    Ok((c, left)) => {
                        failures = 0;
                        let detail = format!(
                            "a batch of {} commands, {left} more than the {room} the agent could take (agent.max_concurrent {} in hand at once): those are left for the platform to send again",
                            c.len() + left,
                            pipeline.max_concurrent()
                        );
                        tracing::warn!(taken = c.len(), left, "platform batch larger than the agent takes at once");
                        crate::audit::record("platform_error", &[("detail", &detail)]);
                        c
                    }
                    Err(e) => {
                        // A reply's error may quote what the connection sent (serde quotes a
                        // string of the wrong type whole, up to the 16 MiB body): recorded
                        // short, and audited at most once a minute (with how many were not),
                        // since an empty poll between two bad ones starts the backoff again.
                        let e = crate::audit::cut(&e, POLL_ERROR_BYTES);
                        tracing::warn!(error = %e, "platform poll failed");
                        if poll_error_recorded.is_none_or(|t| t.elapsed() >= POLL_ERROR_RECORD_EVERY) {
                            let detail = match poll_errors_unrecorded {
                                0 => e.to_string(),
                                n => format!("{e} ({n} more failed polls since the last one recorded)"),
                            };
                            crate::audit::record("platform_error", &[("detail", &detail)]);
                            (poll_error_recorded, poll_errors_unrecorded) = (Some(std::time::Instant::now()), 0);
                        } else {
                            poll_errors_unrecorded += 1;
                        }
                        failures += 1;
                        sleep_unless(&stop, backoff(failures));
                        continue;
                    }
                };
                if commands.is_empty() {
                    // A platform (or a proxy) that answers at once instead of holding the
                    // long poll is not asked again in a busy loop.
                    sleep_unless(&stop, MIN_POLL_INTERVAL.saturating_sub(polled.elapsed()));
                    continue;
                }
                taken.fetch_add(commands.len(), Ordering::SeqCst);
                // The long poll may have lasted while the socket's commands took the places
                // that were free when it began: each command starts as soon as a place is
                // free — its place taken here, before its thread starts, so that neither the
                // socket nor the next of these can take it meanwhile.
                let mut left = commands.into_iter();
                while let Some(bytes) = left.next() {
                    let place = loop {
                        if stop.load(Ordering::SeqCst) {
                            break None;
                        }
                        if let Some(place) = pipeline.reserve() {
                            break Some(place);
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    };
                    // Stopping: this command and the rest are left (the poll loop then ends:
                    // `stop` stays set).
                    let Some(place) = place else {
                        let not_taken = 1 + left.len();
                        taken.fetch_sub(not_taken, Ordering::SeqCst);
                        tracing::info!(commands = not_taken, "stopping: commands left to the platform to send again");
                        crate::audit::record(
                            "platform_error",
                            &[(
                                "detail",
                                &format!(
                                    "stopping: {not_taken} commands the platform delivered were not taken (not read, nothing run); left for it to send again"
                                ),
                            )],
                        );
                        break;
                    };
                    let (platform, counter, refused) = (platform.clone(), taken.clone(), refused.clone());
                    let spawned = std::thread::Builder::new().name("platform-command".into()).spawn(move || {
                        let taken = counter;
                        // Answered (or given up) whatever happens below.
                        struct Done(Arc<std::sync::atomic::AtomicUsize>);
                        impl Drop for Done {
                            fn drop(&mut self) {
                                self.0.fetch_sub(1, Ordering::SeqCst);
                            }
                        }
                        let _done = Done(taken);
                        let crate::command::Handled { reply, passed_checks, delivery } =
                            place.submit(&bytes, "platform");
                        // Counted before the result is posted (and so before this command's
                        // place in `taken` is given back to the poll).
                        if passed_checks {
                            refused.store(0, Ordering::SeqCst);
                        } else {
                            refused.fetch_add(1, Ordering::SeqCst);
                        }
                        let body =
                            json!({"agent_id": platform.agent_id, "command_id": reply["command_id"], "result": reply});
                        // Results are retried a few times; the audit log holds them regardless.
                        for attempt in 0..5 {
                            match platform.post("results", &body) {
                                Ok(()) => break,
                                Err(e) => {
                                    tracing::warn!(error = %e, attempt, "posting a result failed");
                                    std::thread::sleep(backoff(attempt));
                                }
                            }
                        }
                        // Posted (or given up on): the command's record in `running/` goes
                        // only now — an agent that dies while posting says so at its start.
                        drop(delivery);
                    });
                    if let Err(e) = spawned {
                        // Never taken (not seen: the platform sends it again): counted out; its
                        // place, in the closure, given back.
                        taken.fetch_sub(1, Ordering::SeqCst);
                        tracing::error!(error = %e, "cannot start a thread for a platform command");
                    }
                }
            }
        }));
    }
    {
        let (platform, stop) = (platform.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let executors: Vec<String> = crate::executor_install::list(&pipeline.executors)
                    .map(|l| l.into_iter().map(|e| format!("{}@{}", e.name, e.version)).collect())
                    .unwrap_or_default();
                let doctor = crate::doctor::examine(
                    pipeline.policy.landlock_min_abi,
                    pipeline.policy.allow_degraded,
                    pipeline.policy.host_uids.as_ref(),
                );
                let body = json!({
                    "agent_id": platform.agent_id,
                    "version": env!("CARGO_PKG_VERSION"),
                    "build": crate::app::BUILD,
                    "time": crate::rfc3339::format(crate::signing::now()),
                    "executors": executors,
                    "running": pipeline.running(),
                    "install_failures": pipeline.install_failures,
                    "sandboxes": pipeline.launch_status(),
                    "audit": crate::audit::health(),
                    "binaries": crate::integrity::report(),
                    "doctor": {"ok": !doctor.failed(), "degraded": doctor.degraded},
                });
                if let Err(e) = platform.post("heartbeat", &body) {
                    tracing::warn!(error = %e, "heartbeat failed");
                }
                sleep_unless(&stop, platform.heartbeat);
            }
        }));
    }
    threads
}

/// How many more platform commands may be taken, once there is room for one (`None` once
/// `stop` is set): `max` less those `taken` and not yet answered, or less every command
/// `running` now (the socket's too), whichever leaves less.
fn room_for_commands(
    stop: &AtomicBool,
    taken: &std::sync::atomic::AtomicUsize,
    running: impl Fn() -> usize,
    max: usize,
) -> Option<usize> {
    loop {
        if stop.load(Ordering::SeqCst) {
            return None;
        }
        let busy = taken.load(Ordering::SeqCst).max(running());
        if busy < max {
            return Some(max - busy);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A failed poll's error is recorded within this many bytes, and audited at most once in
/// this long.
const POLL_ERROR_BYTES: usize = 512;
const POLL_ERROR_RECORD_EVERY: Duration = Duration::from_secs(60);

/// Commands in a row that failed the checks (steps 1–6) before the platform connection is
/// polled less often.
const REFUSED_BEFORE_BACKOFF: u32 = 8;

/// The shortest time between two polls that brought no command.
const MIN_POLL_INTERVAL: Duration = Duration::from_secs(1);

fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let step = Duration::from_millis(100);
    let mut left = d;
    while !left.is_zero() && !stop.load(Ordering::SeqCst) {
        let s = left.min(step);
        std::thread::sleep(s);
        left -= s;
    }
}

#[cfg(test)]
mod tests {
    use super::{bypasses_proxy, read_batch};

    #[test]
    fn no_proxy_entries_name_hosts_domains_and_networks() {
        let list = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let seed = list(&["10.0.0.0/8", "172.16.0.0/12"]);
        assert!(bypasses_proxy("10.1.2.3", &seed));
        assert!(bypasses_proxy("172.31.0.1", &seed));
        assert!(!bypasses_proxy("172.32.0.1", &seed));
        assert!(!bypasses_proxy("platform.example.com", &seed));
        let names = list(&["example.com", ".corp.internal", "Other.Example.NET:8443", "fd00::/8", "192.0.2.7"]);
        for yes in [
            "example.com",
            "api.example.com",
            "API.EXAMPLE.COM.",
            "x.corp.internal",
            "other.example.net",
            "fd00::1",
            "[fd00::1]",
            "192.0.2.7",
        ] {
            assert!(bypasses_proxy(yes, &names), "{yes}");
        }
        for no in ["badexample.com", "corp.internal.evil", "example.net", "fe80::1", "192.0.2.8"] {
            assert!(!bypasses_proxy(no, &names), "{no}");
        }
        assert!(bypasses_proxy("anything", &list(&["*"])));
        assert!(!bypasses_proxy("anything", &[]));
    }

    fn texts(body: &str, room: usize) -> Result<(Vec<String>, usize), String> {
        read_batch(body.as_bytes(), room)
            .map(|(t, left)| (t.into_iter().map(|b| String::from_utf8(b).unwrap()).collect(), left))
    }

    #[test]
    fn a_batch_is_taken_up_to_the_room_as_its_exact_text() {
        assert_eq!(
            texts(r#"{"commands":[1, {"b":2,"a":1} ,3]}"#, 2),
            Ok((vec!["1".into(), r#"{"b":2,"a":1}"#.into()], 1))
        );
        assert_eq!(texts(r#"{"commands":[1]}"#, 4), Ok((vec!["1".into()], 0)));
        assert_eq!(texts(r#"{"commands":[]}"#, 4), Ok((vec![], 0)));
        // An entry's duplicate key is the pipeline's to refuse, per command: kept verbatim.
        assert_eq!(texts(r#"{"commands":[{"a":1,"a":2}]}"#, 1), Ok((vec![r#"{"a":1,"a":2}"#.into()], 0)));
        assert_eq!(texts(r#"{"next":{"x":[1]},"commands":[true]}"#, 1), Ok((vec!["true".into()], 0)));
        // Entries past the room are counted, not kept.
        let many = format!(r#"{{"commands":[{}]}}"#, vec!["0"; 100_000].join(","));
        assert_eq!(texts(&many, 3).map(|(t, left)| (t.len(), left)), Ok((3, 99_997)));
    }

    #[test]
    fn a_batch_that_is_not_one_is_refused() {
        for bad in [
            r#"{"commands":[],"commands":[]}"#,
            r#"{}"#,
            r#"[]"#,
            r#"{"commands":{}}"#,
            r#"{"commands":[1]} 2"#,
            r#"{"commands":[1,]}"#,
            r#"{"commands":[1, {"a":}]}"#,
            "",
        ] {
            assert!(texts(bad, 1).is_err(), "{bad:?} accepted");
        }
        // Invalid UTF-8 in an entry, taken or skipped.
        assert!(read_batch(b"{\"commands\":[\"\xff\"]}", 1).is_err());
        assert!(read_batch(b"{\"commands\":[1, \"\xff\"]}", 1).is_err());
        // Deep nesting is skipped without recursion, and an entry taken is the pipeline's to
        // refuse (its strict parse has a depth limit): no stack is spent on it here.
        let deep = format!(r#"{{"commands":[1, {}{}]}}"#, "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(texts(&deep, 2).map(|(t, left)| (t[1].len(), left)), Ok((200_000, 0)));
        assert_eq!(texts(&deep, 1).map(|(t, left)| (t.len(), left)), Ok((1, 1)));
        let unbalanced = format!(r#"{{"commands":[1, {}]}}"#, "[".repeat(100_000));
        assert!(texts(&unbalanced, 1).is_err() && texts(&unbalanced, 2).is_err());
    }
}
