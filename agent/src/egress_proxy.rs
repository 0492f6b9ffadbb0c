//! The sandbox's forward proxy (`network.proxy`): the sandbox's `HTTP_PROXY`/`HTTPS_PROXY`
//! name this proxy, on the sandbox link's IPv4 gateway ([`sandbox::net::PROXY_PORT`]), and it
//! passes what the executor's network policy allows to the configured proxy. Without it the
//! sandbox reached the configured proxy directly, and through it whatever the proxy let
//! through: the allow and deny lists, enforced at the sandbox's firewall, saw only the
//! connection to the proxy.
//!
//! Guarantees, per connection (one request; a thread each, at most [`MAX_ACTIVE`] per
//! sandbox and [`MAX_ACTIVE_TOTAL`] in the process at once, `503` past them; the head read
//! whole within [`HEAD_TIMEOUT`]):
//! - served only for the sandbox's own address, arriving on its link (the listening socket
//!   is bound to the link before it listens; as the DNS forwarder);
//! - the request is judged before anything reaches the upstream proxy: a `CONNECT
//!   host:port`, or an absolute-form `http://` request of [`PLAIN_METHODS`] (not `TRACE`).
//!   The host by name — the deny list first, then the allow list, as the forwarder judges
//!   a query — or, written as an address, by the firewall's address rules (denied networks,
//!   the allowed ones, the always-denied ranges, allow-any); the port by `allowed_ports`. A
//!   refusal is answered `403` (`400`/`405`/`431`/`501` for a request it does not pass on
//!   as written) and counted in the run's report; the first [`MAX_REPORTED_TARGETS`]
//!   targets are audited (`proxy_refused`), as refused DNS names are;
//! - what reaches the upstream proxy is what was judged: the request line and `Host` are
//!   written anew from the parsed target (never the client's text), `Max-Forwards` is
//!   dropped (with `0` a proxy answers `TRACE`/`OPTIONS` itself, quoting the headers); a
//!   plain request carries `Connection: close` and its body by `Content-Length` only (a
//!   chunked body is refused), and nothing the client sends after that body is forwarded —
//!   a second request on the connection would otherwise pass unjudged; nothing the client
//!   sends behind a `CONNECT` is forwarded before the upstream accepted it (a refusing
//!   upstream that keeps the connection open would read it as a request of its own);
//! - the upstream proxy's credentials are added here (`Proxy-Authorization`) and do not
//!   reach the sandbox: a client's own `Proxy-Authorization` is dropped, the upstream's
//!   answer to a `CONNECT` is not passed on (a 2xx becomes the tunnel, anything else a `502`
//!   naming its status), and in its answers to plain requests the credentials (the token,
//!   `user:password`, the password; 8 characters or more), as written, percent-encoded any
//!   way or with `/` JSON-escaped, are overwritten with as many `*` ([`Scrubber`]) — a
//!   proxy's error page can quote the request's headers (an answer compressed, chunked
//!   across a form or in HTML entities is not recognised);
//! - names are judged as names: the upstream proxy resolves them, and where they lead from
//!   there is its to judge (a name is never resolved here: one inside a denied network, or
//!   pointing at a metadata address, passes unless a name rule refuses it). Names that are
//!   addresses in another form (`0x7f.1`, `2130706433`), which a resolver would read as one,
//!   are refused, and so is `localhost` (and names below it) unless the allow list names it;
//! - never a target: the agent host's own addresses (the host table refuses the sandbox the
//!   host; through the proxy it would be reached from outside), the address pools (other
//!   sandboxes, other links' gateways), whatever an allow list covers, and the configured proxies,
//!   by name or address — asked for itself, a proxy would carry requests unjudged. Their
//!   addresses (every A and AAAA at the run's start) are denied to the sandbox too
//!   (`egress::plan`): a proxy is reached only through here (another name of it, or an
//!   address it takes later, is not known).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::dns::Querier;
use crate::egress::{NameVerdict, NetworkPolicy};
use sandbox::net::IpNet;

/// Connections one sandbox's proxy serves at once, and all of the process's proxies
/// together (each costs two threads and six descriptors); one more is answered `503`.
pub const MAX_ACTIVE: usize = 16;
pub const MAX_ACTIVE_TOTAL: usize = 128;
static ACTIVE_TOTAL: AtomicUsize = AtomicUsize::new(0);
/// The methods of plain requests passed on: not `TRACE`, which a proxy answers itself with
/// the request's headers.
pub const PLAIN_METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];
/// How long the upstream proxy has to answer a `CONNECT`.
const UPSTREAM_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Targets kept in the report and audited (the counts are complete).
pub const MAX_REPORTED_TARGETS: usize = 20;
/// The request head: at most this long, read within [`HEAD_TIMEOUT`].
const MAX_HEAD: usize = 16 * 1024;
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// One configured proxy, resolved.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// `host:port` as configured (for messages).
    pub label: String,
    pub addrs: Vec<SocketAddr>,
    /// `Basic …`, from the URL's user information.
    pub authorization: Option<String>,
    /// The credentials' forms (the token, `user:password`, the password; each also
    /// percent-encoded) overwritten in what the upstream answers a plain request
    /// ([`Scrubber`]): a proxy's error page can quote the request's headers.
    pub scrub: Vec<Vec<u8>>,
}

impl Upstream {
    /// `user`/`password` (decoded) as this upstream's credentials.
    pub fn with_credentials(label: String, addrs: Vec<SocketAddr>, credentials: Option<(String, String)>) -> Upstream {
        let Some((user, password)) = credentials else {
            return Upstream { label, addrs, authorization: None, scrub: Vec::new() };
        };
        use base64::Engine as _;
        let pair = format!("{user}:{password}");
        let token = base64::engine::general_purpose::STANDARD.encode(&pair);
        let mut scrub = Vec::new();
        for form in [token.as_str(), pair.as_str(), password.as_str()] {
            // Short ones would overwrite ordinary text (see MIN_REDACTED_PROXY_PASSWORD).
            if form.len() >= crate::egress::MIN_REDACTED_PROXY_PASSWORD && !scrub.contains(&form.as_bytes().to_vec()) {
                scrub.push(form.as_bytes().to_vec());
            }
        }
        Upstream { label, addrs, authorization: Some(format!("Basic {token}")), scrub }
    }
}

/// Overwrites each of its forms, wherever they occur in a stream — each byte as itself or
/// percent-encoded (`%2F`, `%2f`: an encoder's choice of which bytes to encode, and its
/// case, makes no difference) — with as many `*` (the response's framing is kept), holding
/// back the tail of what it has seen while it may begin a form.
pub struct Scrubber {
    forms: Vec<Vec<u8>>,
    held: Vec<u8>,
}

/// The byte `%XX` at `b[0..3]` encodes.
fn percent_byte(b: &[u8]) -> Option<u8> {
    match b {
        [b'%', h, l, ..] => {
            let hex = |c: u8| (c as char).to_digit(16);
            Some((hex(*h)? * 16 + hex(*l)?) as u8)
        }
        _ => None,
    }
}

/// How `form` matches `buf` from `at`.
enum Match {
    /// Whole, ending before this index.
    Whole(usize),
    /// Matching so far, up to the end of `buf`.
    Partial,
    No,
}

/// How `form` matches `buf` from `at`: each of its bytes as itself, percent-encoded
/// (`%2F`, `%2f`) or, for `/`, JSON-escaped (`\/`). Where a byte could be read two ways
/// (a form's `%`: itself, or the start of `%25`) both are tried; the best answer wins.
fn match_at(buf: &[u8], at: usize, form: &[u8]) -> Match {
    let Some((&want, rest)) = form.split_first() else { return Match::Whole(at) };
    let Some(&c) = buf.get(at) else { return Match::Partial };
    let mut best = Match::No;
    let mut consider = |m: Match| {
        best = match (&best, m) {
            (Match::Whole(_), _) => return,
            (_, m @ Match::Whole(_)) => m,
            (Match::No, m) => m,
            (_, _) => Match::Partial,
        }
    };
    if c == want {
        consider(match_at(buf, at + 1, rest));
    }
    if c == b'%' {
        let tail = &buf[at + 1..];
        match percent_byte(&buf[at..]) {
            Some(decoded) if decoded == want => consider(match_at(buf, at + 3, rest)),
            Some(_) => {}
            // `%` or `%X` at the end: it may yet be this byte.
            None if tail.len() < 2 && tail.iter().all(u8::is_ascii_hexdigit) => consider(Match::Partial),
            None => {}
        }
    }
    if c == b'\\' && want == b'/' {
        match buf.get(at + 1) {
            Some(b'/') => consider(match_at(buf, at + 2, rest)),
            None => consider(Match::Partial),
            Some(_) => {}
        }
    }
    best
}

impl Scrubber {
    pub fn new(forms: Vec<Vec<u8>>) -> Scrubber {
        Scrubber { forms: forms.into_iter().filter(|f| !f.is_empty()).collect(), held: Vec::new() }
    }

    /// What can be passed on now of what has come, `chunk` last.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<u8> {
        self.held.extend_from_slice(chunk);
        self.pass_on()
    }

    /// At a pause: all but a tail that may begin a form (passing that on would let the
    /// rest of the form through unmatched when it comes).
    pub fn pause(&mut self) -> Vec<u8> {
        self.pass_on()
    }

    /// The rest, at the end of the stream.
    pub fn finish(&mut self) -> Vec<u8> {
        self.overwrite();
        std::mem::take(&mut self.held)
    }

    /// Overwrite every whole form, then give up to the first position where a form may
    /// still begin.
    fn pass_on(&mut self) -> Vec<u8> {
        let keep_from = self.overwrite();
        let rest = self.held.split_off(keep_from);
        std::mem::replace(&mut self.held, rest)
    }

    /// Overwrite the whole forms in `held`; the first position where one matches partly,
    /// up to its end (`held.len()` when none does).
    fn overwrite(&mut self) -> usize {
        let mut first_partial = self.held.len();
        let mut i = 0;
        while i < self.held.len() {
            let mut next = i + 1;
            for form in &self.forms {
                match match_at(&self.held, i, form) {
                    Match::Whole(end) => {
                        self.held[i..end].fill(b'*');
                        next = next.max(end);
                    }
                    Match::Partial => first_partial = first_partial.min(i),
                    Match::No => {}
                }
            }
            i = next;
        }
        first_partial
    }
}

/// `network.proxy.http` and `.https`: plain requests go to the first, `CONNECT` to the
/// second — each to the other when only one is configured.
#[derive(Debug, Clone, Default)]
pub struct Upstreams {
    pub http: Option<Upstream>,
    pub https: Option<Upstream>,
    /// The configured proxies' host names (lower-case): a target naming one is refused —
    /// asked for itself, the proxy would carry the sandbox's requests unjudged.
    pub names: Vec<String>,
}

/// The firewall's address rules ([`sandbox::net::Firewall`]), for targets written as
/// addresses.
#[derive(Debug, Clone, Default)]
pub struct AddressRules {
    pub deny: Vec<IpNet>,
    pub allow: Vec<IpNet>,
    pub always_denied: Vec<IpNet>,
    pub allow_any: bool,
    /// Never a target, whatever the allow list says: the agent host's own addresses (the
    /// host table refuses the sandbox the host; through the proxy it would be reached from
    /// outside) and the address pools (other sandboxes, other links' gateways) — with
    /// their NAT64 and 6to4 forms.
    pub never: Vec<IpNet>,
    /// Names never a target: the configured proxies' ([`Upstreams::names`]).
    pub names: Vec<String>,
}

impl AddressRules {
    pub fn of(fw: &sandbox::net::Firewall) -> AddressRules {
        AddressRules {
            deny: fw.deny.clone(),
            allow: fw.allow.clone(),
            always_denied: fw.always_denied.clone(),
            allow_any: fw.allow_any,
            never: Vec::new(),
            names: Vec::new(),
        }
    }

    /// With the addresses never a target ([`AddressRules::never`]) and the names
    /// ([`AddressRules::names`]).
    pub fn with_never(mut self, never: Vec<IpNet>, names: Vec<String>) -> AddressRules {
        self.never = never;
        self.names = names;
        self
    }
}

/// The agent host's own addresses, every interface's.
pub fn host_addresses() -> Result<Vec<IpAddr>, String> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| format!("cannot list the host's addresses: {e}"))?;
    let mut out = Vec::new();
    for a in addrs.filter_map(|i| i.address) {
        let ip = match (a.as_sockaddr_in(), a.as_sockaddr_in6()) {
            (Some(v4), _) => IpAddr::V4(v4.ip()),
            (_, Some(v6)) => IpAddr::V6(v6.ip()),
            _ => continue,
        };
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    Ok(out)
}

/// What the proxy did, for the result.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyReport {
    pub requests: u64,
    pub forwarded: u64,
    pub refused: u64,
    /// Allowed, but the upstream proxy could not be reached, or did not accept a `CONNECT`.
    pub upstream_failed: u64,
    /// Refused targets (`host:port`): reason (`denied`, `not_allowed`, `unreachable`,
    /// `port_not_allowed`, `method_not_allowed`, `malformed`) and how often.
    pub refused_targets: Vec<RefusedTarget>,
    #[serde(skip)]
    unlisted_audited: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct RefusedTarget {
    pub target: String,
    pub reason: String,
    pub count: u64,
}

/// The host of a target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// Lower-case, without a trailing dot.
    Name(String),
    Addr(IpAddr),
}

impl std::fmt::Display for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Addr(IpAddr::V6(a)) => write!(f, "[{a}]"),
            Host::Addr(a) => write!(f, "{a}"),
        }
    }
}

/// A request as judged and as it is passed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub host: Host,
    pub port: u16,
    /// `None` for `CONNECT`; the path and query of a plain request.
    pub path: Option<String>,
    pub version: String,
    /// Headers passed on (hop-by-hop and proxy headers, `Host` and the body's framing
    /// removed).
    pub headers: Vec<(String, String)>,
    /// A plain request's body length.
    pub content_length: u64,
}

/// Why a request is answered without being passed on: status and reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub reason: &'static str,
    pub detail: String,
}

fn malformed(detail: impl Into<String>) -> Refusal {
    Refusal { status: 400, reason: "malformed", detail: detail.into() }
}

impl Request {
    /// Parse a request head (without its final empty line's `\r\n\r\n`).
    pub fn parse(head: &[u8]) -> Result<Request, Refusal> {
        let text = std::str::from_utf8(head).map_err(|_| malformed("the request head is not UTF-8"))?;
        let mut lines = text.split("\r\n");
        let line = lines.next().unwrap_or_default();
        if text.contains(['\0']) || lines.clone().chain([line]).any(|l| l.contains(['\r', '\n'])) {
            return Err(malformed("a bare CR or LF, or a NUL, in the request head"));
        }
        let parts: Vec<&str> = line.split(' ').collect();
        let [method, target, version] = parts[..] else {
            return Err(malformed("the request line is not METHOD TARGET VERSION"));
        };
        if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(malformed("the method is not an upper-case token"));
        }
        if version != "HTTP/1.1" && version != "HTTP/1.0" {
            return Err(malformed("not HTTP/1.0 or HTTP/1.1"));
        }
        let (host, port, path) = if method == "CONNECT" {
            let (host, port) = authority(target, None)?;
            (host, port, None)
        } else {
            if !PLAIN_METHODS.contains(&method) {
                return Err(Refusal {
                    status: 405,
                    reason: "method_not_allowed",
                    detail: format!("{method} is not passed on (one of {})", PLAIN_METHODS.join(", ")),
                });
            }
            // By bytes: the target is UTF-8, and its 7th byte need not end a character.
            let Some(rest) = target
                .as_bytes()
                .get(..7)
                .filter(|scheme| scheme.eq_ignore_ascii_case(b"http://"))
                .and_then(|_| target.get(7..))
            else {
                return Err(malformed(
                    "a plain request's target must be an absolute http:// URL (use CONNECT for anything else)",
                ));
            };
            let end = rest.find(['/', '?']).unwrap_or(rest.len());
            let (auth, tail) = rest.split_at(end);
            if tail.contains('#') {
                return Err(malformed("a fragment in the request target"));
            }
            let (host, port) = authority(auth, Some(80))?;
            let path = if tail.starts_with('/') { tail.to_string() } else { format!("/{tail}") };
            (host, port, Some(path))
        };
        let mut headers = Vec::new();
        let mut content_length: Option<u64> = None;
        for l in lines {
            if l.is_empty() {
                continue;
            }
            if l.starts_with([' ', '\t']) {
                return Err(malformed("a folded header line"));
            }
            let (name, value) = l.split_once(':').ok_or_else(|| malformed("a header line without ':'"))?;
            if name.is_empty() || !name.bytes().all(is_token_byte) {
                return Err(malformed("a header name that is not a token"));
            }
            let value = value.trim_matches([' ', '\t']);
            match name.to_ascii_lowercase().as_str() {
                "host"
                | "proxy-authorization"
                | "proxy-connection"
                | "connection"
                | "keep-alive"
                | "te"
                | "trailer"
                | "upgrade"
                // Max-Forwards: 0 would have the proxy answer itself (TRACE and OPTIONS echo
                // the request's headers, the credentials added here among them).
                | "max-forwards" => {}
                "transfer-encoding" if path.is_some() => {
                    return Err(Refusal {
                        status: 501,
                        reason: "malformed",
                        detail: "a request body in chunks (Transfer-Encoding) is not passed on; send Content-Length"
                            .into(),
                    })
                }
                "transfer-encoding" => {}
                "content-length" => {
                    let n = (!value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()))
                        .then(|| value.parse::<u64>().ok())
                        .flatten()
                        .ok_or_else(|| malformed("Content-Length is not a number"))?;
                    if content_length.is_some_and(|m| m != n) {
                        return Err(malformed("two different Content-Lengths"));
                    }
                    content_length = Some(n);
                }
                _ => headers.push((name.to_string(), value.to_string())),
            }
        }
        Ok(Request {
            method: method.to_string(),
            host,
            port,
            content_length: if path.is_some() { content_length.unwrap_or(0) } else { 0 },
            path,
            version: version.to_string(),
            headers,
        })
    }

    /// `host:port`.
    pub fn target(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The head passed to the upstream proxy, written from what was judged.
    pub fn head_for_upstream(&self, authorization: Option<&str>) -> Vec<u8> {
        let mut out = match &self.path {
            None => format!("CONNECT {} {}\r\nHost: {}\r\n", self.target(), self.version, self.target()),
            Some(path) => {
                let authority =
                    if self.port == 80 { self.host.to_string() } else { format!("{}:{}", self.host, self.port) };
                let mut h =
                    format!("{} http://{authority}{path} {}\r\nHost: {authority}\r\n", self.method, self.version);
                for (name, value) in &self.headers {
                    h.push_str(&format!("{name}: {value}\r\n"));
                }
                if self.content_length > 0 || matches!(self.method.as_str(), "POST" | "PUT" | "PATCH") {
                    h.push_str(&format!("Content-Length: {}\r\n", self.content_length));
                }
                h.push_str("Connection: close\r\n");
                h
            }
        };
        if self.path.is_none() {
            for (name, value) in &self.headers {
                out.push_str(&format!("{name}: {value}\r\n"));
            }
        }
        if let Some(a) = authorization {
            out.push_str(&format!("Proxy-Authorization: {a}\r\n"));
        }
        out.push_str("\r\n");
        out.into_bytes()
    }
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `host:port` (`[v6]:port`); the port may be left out only where `default` is given.
fn authority(text: &str, default: Option<u16>) -> Result<(Host, u16), Refusal> {
    if text.contains('@') {
        return Err(malformed("user information in the request target"));
    }
    let (host, port) = if let Some(v6) = text.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or_else(|| malformed("an unclosed [ in the target"))?;
        let a: std::net::Ipv6Addr = h.parse().map_err(|_| malformed("not an IPv6 address between [ and ]"))?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return Err(malformed("text after ] that is not :port")),
        };
        (Host::Addr(IpAddr::V6(a)), port)
    } else {
        let (h, p) = match text.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (text, None),
        };
        (host_of(h)?, p)
    };
    let port = match (port, default) {
        (Some(p), _) if !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()) => {
            p.parse::<u16>().ok().filter(|&n| n != 0).ok_or_else(|| malformed("a port outside 1-65535"))?
        }
        (Some(_), _) => return Err(malformed("a port that is not a number")),
        (None, Some(d)) => d,
        (None, None) => return Err(malformed("CONNECT needs host:port")),
    };
    Ok((host, port))
}

/// A host written as a name or an IPv4 address: dotted-decimal only, and a name that a
/// resolver would read as an address (every label digits, or `0x` and hex digits) refused.
fn host_of(text: &str) -> Result<Host, Refusal> {
    if text.is_empty() {
        return Err(malformed("no host in the target"));
    }
    if let Ok(a) = text.parse::<std::net::Ipv4Addr>() {
        return Ok(Host::Addr(IpAddr::V4(a)));
    }
    let name = text.strip_suffix('.').unwrap_or(text).to_ascii_lowercase();
    let numeric = |l: &str| {
        l.bytes().all(|b| b.is_ascii_digit())
            || l.strip_prefix("0x").is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    if name.split('.').all(numeric) {
        return Err(malformed("an address written other than as dotted-decimal IPv4 or [IPv6]"));
    }
    crate::egress::valid_hostname(&name).map_err(malformed)?;
    Ok(Host::Name(name))
}

/// Judge a target as the firewall and the DNS forwarder would: `Err(reason)` to refuse.
pub fn judge(policy: &NetworkPolicy, rules: &AddressRules, host: &Host, port: u16) -> Result<(), &'static str> {
    if !policy.ports.is_empty() && !policy.ports.iter().any(|(lo, hi)| (*lo..=*hi).contains(&port)) {
        return Err("port_not_allowed");
    }
    match host {
        Host::Name(name) if rules.names.iter().any(|n| n == name) => Err("unreachable"),
        Host::Name(name) => match policy.name_verdict(name) {
            NameVerdict::Denied => Err("denied"),
            NameVerdict::NotAllowed => Err("not_allowed"),
            // The resolver's own names (RFC 6761): the upstream proxy's loopback.
            NameVerdict::Allowed
                if (name == "localhost" || name.ends_with(".localhost")) && !policy.names_explicitly(name) =>
            {
                Err("unreachable")
            }
            NameVerdict::Allowed => Ok(()),
        },
        Host::Addr(a) => {
            let a = match a {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(*a, IpAddr::V4),
                IpAddr::V4(_) => *a,
            };
            if rules.deny.iter().any(|n| n.contains(a)) {
                Err("denied")
            } else if rules.never.iter().any(|n| n.contains(a)) {
                Err("unreachable")
            } else if rules.allow.iter().any(|n| n.contains(a)) {
                Ok(())
            } else if rules.always_denied.iter().any(|n| n.contains(a)) {
                Err("unreachable")
            } else if rules.allow_any {
                Ok(())
            } else {
                Err("not_allowed")
            }
        }
    }
}

/// Everything a connection's thread needs.
struct Context {
    policy: Arc<NetworkPolicy>,
    rules: AddressRules,
    upstreams: Upstreams,
    who: Querier,
    report: Mutex<ProxyReport>,
    /// Live connections' sockets, shut down at the stop.
    live: Mutex<HashMap<u64, Vec<TcpStream>>>,
    next_id: AtomicU64,
    active: AtomicUsize,
    stopping: AtomicBool,
}

impl Context {
    fn report(&self) -> std::sync::MutexGuard<'_, ProxyReport> {
        // A panicking connection thread leaves counters, never a half-changed list entry.
        self.report.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Vec<TcpStream>>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keep a clone of `s` to shut down at the stop (`false`: stopping already).
    fn track(&self, id: u64, s: &TcpStream) -> bool {
        let Ok(clone) = s.try_clone() else { return false };
        let mut live = self.live();
        if self.stopping.load(Ordering::SeqCst) {
            return false;
        }
        live.entry(id).or_default().push(clone);
        true
    }

    /// Count and (for the first targets) audit a refusal.
    fn refuse(&self, target: &str, reason: &str) {
        let target = self.who.redactor.dns_name(target);
        let (executor, command_id) = (self.who.executor.as_str(), self.who.command_id.as_str());
        let mut report = self.report();
        report.refused += 1;
        if let Some(r) = report.refused_targets.iter_mut().find(|r| r.target == target && r.reason == reason) {
            r.count += 1;
            return;
        }
        if report.refused_targets.len() < MAX_REPORTED_TARGETS {
            report.refused_targets.push(RefusedTarget { target: target.clone(), reason: reason.into(), count: 1 });
            crate::audit::record(
                "proxy_refused",
                &[("executor", executor), ("target", &target), ("reason", reason), ("command_id", command_id)],
            );
        } else if !report.unlisted_audited {
            report.unlisted_audited = true;
            let cap = MAX_REPORTED_TARGETS.to_string();
            crate::audit::record(
                "proxy_refused",
                &[
                    ("executor", executor),
                    ("target", &target),
                    ("reason", reason),
                    ("command_id", command_id),
                    ("further_targets_counted_only_after", &cap),
                ],
            );
        }
    }
}

/// A running proxy; [`ProxyFilter::stop`] ends it and returns its report.
pub struct ProxyFilter {
    stop_tx: OwnedFd,
    thread: Option<JoinHandle<()>>,
    context: Arc<Context>,
}

impl ProxyFilter {
    /// Listen on `listen` (the gateway, [`sandbox::net::PROXY_PORT`]) on the sandbox link's
    /// host end `device`, and serve `client` (the sandbox's address) until stopped.
    pub fn spawn(
        listen: SocketAddr,
        device: &str,
        client: IpAddr,
        policy: Arc<NetworkPolicy>,
        rules: AddressRules,
        upstreams: Upstreams,
        who: Querier,
    ) -> std::io::Result<ProxyFilter> {
        let listener = listen_on_device(listen, device)?;
        let (stop_rx, stop_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)?;
        let context = Arc::new(Context {
            policy,
            rules,
            upstreams,
            who,
            report: Mutex::new(ProxyReport::default()),
            live: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
        });
        let ctx = context.clone();
        let thread = std::thread::Builder::new().name("egress-proxy".into()).spawn(move || loop {
            let mut fds = [
                nix::poll::PollFd::new(listener.as_fd(), nix::poll::PollFlags::POLLIN),
                nix::poll::PollFd::new(stop_rx.as_fd(), nix::poll::PollFlags::POLLIN),
            ];
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => return,
            }
            if fds[1].revents().is_some_and(|r| !r.is_empty()) {
                return;
            }
            let (stream, peer) = match listener.accept() {
                Ok(accepted) => accepted,
                // Out of descriptors (or another passing failure): the connection stays
                // queued, and polling again at once would spin.
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            // Not the sandbox: closed at once.
            if peer.ip() != client || stream.set_nonblocking(false).is_err() {
                continue;
            }
            let Some(slot) = Slot::take(&ctx) else {
                let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                answer(&stream, 503, "too many connections through the proxy at once");
                continue;
            };
            let spawned = std::thread::Builder::new().name("egress-proxy-conn".into()).spawn(move || {
                serve(stream, &slot);
            });
            // A thread that could not start dropped its slot with its closure.
            drop(spawned);
        })?;
        Ok(ProxyFilter { stop_tx, thread: Some(thread), context })
    }

    /// Stop accepting, cut every live connection, and report (once the connections' threads
    /// are done, or after [`STOP_WAIT`]: a thread still connecting upstream forwards nothing
    /// once stopped).
    pub fn stop(mut self) -> ProxyReport {
        self.halt();
        let deadline = std::time::Instant::now() + STOP_WAIT;
        while self.context.active.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let report = self.context.report().clone();
        report
    }

    fn halt(&mut self) {
        let _ = nix::unistd::write(&self.stop_tx, b"x");
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let live = {
            let mut live = self.context.live();
            self.context.stopping.store(true, Ordering::SeqCst);
            std::mem::take(&mut *live)
        };
        for s in live.values().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for ProxyFilter {
    fn drop(&mut self) {
        self.halt();
    }
}

/// How long [`ProxyFilter::stop`] waits for the connections' threads.
const STOP_WAIT: Duration = Duration::from_millis(500);

/// A listening socket on `listen`, bound to `device` before it listens: nothing arriving on
/// another interface is ever queued on it.
fn listen_on_device(listen: SocketAddr, device: &str) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{bind, listen as listen_on, setsockopt, socket, sockopt, AddressFamily, Backlog};
    use nix::sys::socket::{SockFlag, SockType, SockaddrStorage};
    let family = if listen.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)?;
    setsockopt(&fd, sockopt::BindToDevice, &std::ffi::OsString::from(device))?;
    bind(fd.as_raw_fd(), &SockaddrStorage::from(listen))?;
    let backlog = Backlog::new(32).map_err(std::io::Error::from)?;
    listen_on(&fd, backlog)?;
    Ok(TcpListener::from(fd))
}

/// A connection's place among the [`MAX_ACTIVE`] of its proxy and the [`MAX_ACTIVE_TOTAL`]
/// of the process; given back, with the connection's sockets forgotten, when dropped —
/// however its thread ends.
struct Slot {
    ctx: Arc<Context>,
    id: u64,
}

impl Slot {
    fn take(ctx: &Arc<Context>) -> Option<Slot> {
        if ctx.active.fetch_add(1, Ordering::SeqCst) >= MAX_ACTIVE {
            ctx.active.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        if ACTIVE_TOTAL.fetch_add(1, Ordering::SeqCst) >= MAX_ACTIVE_TOTAL {
            ACTIVE_TOTAL.fetch_sub(1, Ordering::SeqCst);
            ctx.active.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Slot { ctx: ctx.clone(), id: ctx.next_id.fetch_add(1, Ordering::SeqCst) })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.ctx.live().remove(&self.id);
        ACTIVE_TOTAL.fetch_sub(1, Ordering::SeqCst);
        self.ctx.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A short answer of the proxy's own, then the end of the connection.
fn answer(mut stream: &TcpStream, status: u16, text: &str) {
    let phrase = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let body = format!("opservant: {text}\n");
    let head = format!(
        "HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body.as_bytes());
    let _ = stream.shutdown(Shutdown::Write);
}

/// [`answer`], then [`drain`]: on a connection's own thread only (never the listener's).
fn answer_and_drain(stream: &TcpStream, status: u16, text: &str) {
    answer(stream, status, text);
    drain(stream);
}

/// How long [`drain`] reads at most, and how much.
const DRAIN_FOR: Duration = Duration::from_millis(500);
const DRAIN_BYTES: usize = 64 * 1024;

/// Read what the client still sends, briefly ([`DRAIN_FOR`], [`DRAIN_BYTES`] at most),
/// before the socket is closed: closed with unread bytes (a request body, a request
/// pipelined behind) it would send a reset, and the client could lose the answer written
/// just before.
fn drain(mut stream: &TcpStream) {
    let deadline = Instant::now() + DRAIN_FOR;
    let mut sink = [0u8; 4096];
    let mut left = DRAIN_BYTES;
    while left > 0 {
        let time = deadline.saturating_duration_since(Instant::now());
        if time.is_zero() || stream.set_read_timeout(Some(time)).is_err() {
            return;
        }
        match stream.read(&mut sink) {
            Ok(0) => return,
            Ok(n) => left -= n.min(left),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Read up to the end of a head by `deadline`: `(head without "\r\n\r\n", what followed
/// it)`; `Err(None)` when the peer closed, failed or ran out of time.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> Result<(Vec<u8>, Vec<u8>), Option<Refusal>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return Err(None);
        }
        let n = match stream.read(&mut chunk) {
            Ok(0) => return Err(None),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(None),
        };
        let searched_from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf[searched_from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let end = searched_from + i;
            let rest = buf[end + 4..].to_vec();
            buf.truncate(end);
            return Ok((buf, rest));
        }
        if buf.len() > MAX_HEAD {
            return Err(Some(Refusal {
                status: 431,
                reason: "malformed",
                detail: format!("a request head over {MAX_HEAD} bytes"),
            }));
        }
    }
}

/// The status code of a response head (`HTTP/1.x NNN …`), 0 when it has none.
fn status_of(head: &[u8]) -> u16 {
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    match (parts.next(), parts.next()) {
        (Some(v), Some(code)) if v.starts_with(b"HTTP/1.") && code.len() == 3 => {
            std::str::from_utf8(code).ok().and_then(|c| c.parse().ok()).unwrap_or(0)
        }
        _ => 0,
    }
}

/// `from` to `to` through a [`Scrubber`] of `forms`, to the end of `from`. After a second
/// without more, what is held back is passed on but for a tail that may begin a form.
fn copy_scrubbed(from: &mut TcpStream, to: &mut TcpStream, forms: &[Vec<u8>]) {
    let mut scrubber = Scrubber::new(forms.to_vec());
    let _ = from.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 16 * 1024];
    loop {
        let out = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => scrubber.feed(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                scrubber.pause()
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if to.write_all(&out).is_err() {
            return;
        }
    }
    let _ = to.write_all(&scrubber.finish());
}

fn serve(mut client: TcpStream, slot: &Slot) {
    let (ctx, id) = (&*slot.ctx, slot.id);
    if !ctx.track(id, &client) {
        return;
    }
    let _ = client.set_write_timeout(Some(HEAD_TIMEOUT));
    let (head, rest) = match read_head(&mut client, Instant::now() + HEAD_TIMEOUT) {
        Ok(v) => v,
        Err(None) => return,
        Err(Some(r)) => {
            ctx.report().requests += 1;
            ctx.refuse("(unreadable request)", r.reason);
            answer_and_drain(&client, r.status, &r.detail);
            return;
        }
    };
    ctx.report().requests += 1;
    let request = match Request::parse(&head) {
        Ok(r) => r,
        Err(r) => {
            ctx.refuse("(unreadable request)", r.reason);
            answer_and_drain(&client, r.status, &r.detail);
            return;
        }
    };
    let target = request.target();
    if let Err(reason) = judge(&ctx.policy, &ctx.rules, &request.host, request.port) {
        ctx.refuse(&target, reason);
        let shown = ctx.who.redactor.dns_name(&target);
        answer_and_drain(&client, 403, &format!("{shown} is refused by the executor's network policy ({reason})"));
        return;
    }
    let connect = request.path.is_none();
    let upstream = if connect {
        ctx.upstreams.https.as_ref().or(ctx.upstreams.http.as_ref())
    } else {
        ctx.upstreams.http.as_ref().or(ctx.upstreams.https.as_ref())
    };
    let Some(upstream) = upstream else {
        answer_and_drain(&client, 502, "no upstream proxy is configured");
        return;
    };
    let Some(mut up) = upstream.addrs.iter().find_map(|a| TcpStream::connect_timeout(a, UPSTREAM_CONNECT_TIMEOUT).ok())
    else {
        ctx.report().upstream_failed += 1;
        answer_and_drain(&client, 502, &format!("the upstream proxy {} cannot be reached", upstream.label));
        return;
    };
    if !ctx.track(id, &up) {
        return;
    }
    let _ = up.set_write_timeout(Some(UPSTREAM_ANSWER_TIMEOUT));
    if up.write_all(&request.head_for_upstream(upstream.authorization.as_deref())).is_err() {
        ctx.report().upstream_failed += 1;
        answer_and_drain(&client, 502, &format!("the upstream proxy {} closed the connection", upstream.label));
        return;
    }
    if connect {
        // The upstream's answer before anything more of the client's: bytes sent behind a
        // CONNECT the upstream refuses (and keeps the connection open after, as HTTP
        // allows) would be read as a request of their own, never judged. Its answer is
        // not passed on (a proxy's page can quote the request's headers, the credentials
        // among them): a 2xx becomes the tunnel, anything else a 502 naming its status.
        let (status, early) = match read_head(&mut up, Instant::now() + UPSTREAM_ANSWER_TIMEOUT) {
            // What followed the head is the tunnel's (a server that speaks first).
            Ok((answer_head, early)) if (200..300).contains(&status_of(&answer_head)) => {
                (status_of(&answer_head), early)
            }
            Ok((answer_head, _)) => {
                ctx.report().upstream_failed += 1;
                let status = status_of(&answer_head);
                answer_and_drain(
                    &client,
                    502,
                    &format!("the upstream proxy answered the CONNECT to {target} with {status}"),
                );
                return;
            }
            Err(_) => {
                ctx.report().upstream_failed += 1;
                answer_and_drain(&client, 502, &format!("the upstream proxy did not answer the CONNECT to {target}"));
                return;
            }
        };
        let established = format!("HTTP/1.1 {status} Connection established\r\n\r\n");
        if client.write_all(established.as_bytes()).is_err() || client.write_all(&early).is_err() {
            return;
        }
    }
    ctx.report().forwarded += 1;
    for s in [&client, &up] {
        let _ = s.set_read_timeout(None);
        let _ = s.set_write_timeout(None);
    }
    // Client to upstream: a tunnel's bytes, or exactly the plain request's body.
    let body_left = request.content_length;
    let (Ok(mut from_client), Ok(mut to_up)) = (client.try_clone(), up.try_clone()) else { return };
    let upward = std::thread::Builder::new().name("egress-proxy-up".into()).spawn(move || {
        if connect {
            let _ = to_up.write_all(&rest);
            let _ = std::io::copy(&mut from_client, &mut to_up);
            let _ = to_up.shutdown(Shutdown::Write);
        } else {
            let first = rest.len().min(usize::try_from(body_left).unwrap_or(usize::MAX));
            let _ = to_up.write_all(&rest[..first]);
            let _ = std::io::copy(&mut (&mut from_client).take(body_left - first as u64), &mut to_up);
            // Nothing after the body: the client's further bytes stay unread.
        }
    });
    if connect {
        let _ = std::io::copy(&mut up, &mut client);
    } else {
        copy_scrubbed(&mut up, &mut client, &upstream.scrub);
    }
    let _ = client.shutdown(Shutdown::Write);
    if !connect {
        // The response is complete (the upstream closed): the request's upload is over too
        // (a body still coming is cut: its reader is woken by the end of reading).
        let _ = up.shutdown(Shutdown::Both);
        if upward.as_ref().is_ok_and(|t| !t.is_finished()) {
            let _ = client.shutdown(Shutdown::Read);
        }
    }
    if let Ok(t) = upward {
        let _ = t.join();
    }
    if !connect {
        drain(&client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::HostPattern;

    fn policy(allow: Option<&[&str]>, deny: &[&str], ports: &[(u16, u16)]) -> NetworkPolicy {
        NetworkPolicy {
            allow: allow.map(|l| l.iter().map(|p| HostPattern::parse(p).unwrap()).collect()),
            deny: deny.iter().map(|p| HostPattern::parse(p).unwrap()).collect(),
            ports: ports.to_vec(),
            dns: true,
            bandwidth_mbps: 10,
            nat64: vec![],
        }
    }

    fn parse(head: &str) -> Result<Request, Refusal> {
        Request::parse(head.as_bytes())
    }

    #[test]
    fn requests_are_parsed_strictly_and_written_anew() {
        let r = parse("CONNECT API.Example.test.:443 HTTP/1.1\r\nHost: evil.test:443\r\nProxy-Authorization: Basic eA==\r\nUser-Agent: x").unwrap();
        assert_eq!((r.host.clone(), r.port, r.path.clone()), (Host::Name("api.example.test".into()), 443, None));
        let up = String::from_utf8(r.head_for_upstream(Some("Basic dTpw"))).unwrap();
        assert_eq!(
            up,
            "CONNECT api.example.test:443 HTTP/1.1\r\nHost: api.example.test:443\r\nUser-Agent: x\r\nProxy-Authorization: Basic dTpw\r\n\r\n"
        );

        let r =
            parse("GET http://[2001:db8::1]:8080?q=1 HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 3").unwrap();
        assert_eq!(
            (r.host.clone(), r.port, r.path.as_deref()),
            (Host::Addr("2001:db8::1".parse().unwrap()), 8080, Some("/?q=1"))
        );
        assert_eq!(r.content_length, 3);
        let up = String::from_utf8(r.head_for_upstream(None)).unwrap();
        assert_eq!(
            up,
            "GET http://[2001:db8::1]:8080/?q=1 HTTP/1.0\r\nHost: [2001:db8::1]:8080\r\nContent-Length: 3\r\nConnection: close\r\n\r\n"
        );
        let r = parse("GET HTTP://a.test/x HTTP/1.1").unwrap();
        assert_eq!(
            String::from_utf8(r.head_for_upstream(None)).unwrap(),
            "GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
        );

        for bad in [
            "CONNECT a.test HTTP/1.1",
            "CONNECT a.test:0 HTTP/1.1",
            "CONNECT a.test:65536 HTTP/1.1",
            "CONNECT a.test:+443 HTTP/1.1",
            "CONNECT evil.test:443@a.test:443 HTTP/1.1",
            "CONNECT a.test:443  HTTP/1.1",
            "CONNECT a.test:443 HTTP/2",
            "connect a.test:443 HTTP/1.1",
            "GET /local HTTP/1.1",
            "GET https://a.test/ HTTP/1.1",
            "GET http://u:p@a.test/ HTTP/1.1",
            "GET http://a.test/#f HTTP/1.1",
            "GET http://a test/ HTTP/1.1",
            "GET http://a.test/ HTTP/1.1\r\n folded: x",
            "GET http://a.test/ HTTP/1.1\r\nBad Name: x",
            "GET http://a.test/ HTTP/1.1\r\nX: a\nY: b",
            "GET http://a.test/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2",
            "GET http://a.test/ HTTP/1.1\r\nContent-Length: -1",
            "POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked",
            "CONNECT 2130706433:443 HTTP/1.1",
            "CONNECT 0x7f.1:443 HTTP/1.1",
            "CONNECT 127.0.0.01:443 HTTP/1.1",
            "CONNECT [::1:443 HTTP/1.1",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed: {:?}", parse(bad));
        }
        assert_eq!(parse("POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked").unwrap_err().status, 501);
    }

    #[test]
    fn no_request_text_panics_and_proxies_answer_nothing_themselves() {
        // The 7th byte inside a character (a slice there would abort the agent).
        for head in ["GET http:/\u{e9}x HTTP/1.1", "GET http:\u{e9} HTTP/1.1", "GET \u{e9}\u{e9}\u{e9}\u{e9} HTTP/1.1"]
        {
            assert!(parse(head).is_err(), "{head:?}");
        }
        assert_eq!(parse("TRACE http://a.test/ HTTP/1.1").unwrap_err().status, 405);
        assert_eq!(parse("PROPFIND http://a.test/ HTTP/1.1").unwrap_err().reason, "method_not_allowed");
        let r = parse("OPTIONS http://a.test/ HTTP/1.1\r\nMax-Forwards: 0\r\nAccept: */*").unwrap();
        assert_eq!(r.headers, vec![("Accept".to_string(), "*/*".to_string())]);
        assert_eq!(status_of(b"HTTP/1.1 200 Connection established"), 200);
        assert_eq!(status_of(b"HTTP/1.0 407 Proxy Authentication Required\r\nX: y"), 407);
        for junk in [&b""[..], b"HTTP/1.1", b"HTTP/1.1 20", b"SSH-2.0-x 200", b"HTTP/1.1 2x0"] {
            assert_eq!(status_of(junk), 0, "{junk:?}");
        }
    }

    #[test]
    fn credentials_are_overwritten_wherever_the_stream_splits_or_pauses_them() {
        let up = Upstream::with_credentials(
            "p:3128".into(),
            vec![],
            Some(("agent".to_string(), "pr0xy/s3cret".to_string())),
        );
        assert_eq!(up.authorization.as_deref(), Some("Basic YWdlbnQ6cHIweHkvczNjcmV0"));
        // As written, and percent-encoded any way (all, some, upper or lower case).
        let page = "<a href=\"mailto:x?body=Proxy-Authorization%3A%20Basic%20YWdlbnQ6cHIweHkvczNjcmV0%0D%0A\">\
            agent:pr0xy/s3cret pr0xy%2fs3cret pr0xy%2Fs3cret agent%3Apr0xy%2Fs3cret %59%57dlbnQ6cHIweHkvczNjcmV0 \
            YWdlbnQ6cHIweHkvczNjcmV0</a>";
        let check = |out: Vec<u8>, how: &str| {
            let out = String::from_utf8(out).unwrap();
            assert_eq!(out.len(), page.len(), "{how}: the framing is kept");
            for gone in ["YWdlbnQ6", "dlbnQ6", "s3cret", "pr0xy"] {
                assert!(!out.contains(gone), "{how}: {out}");
            }
            assert!(out.starts_with("<a href=\"mailto:x?body=Proxy-Authorization%3A%20Basic%20*"), "{how}: {out}");
            assert!(out.ends_with("*</a>"), "{how}: {out}");
        };
        for split in 0..page.len() {
            let (a, b) = page.as_bytes().split_at(split);
            let mut s = Scrubber::new(up.scrub.clone());
            let mut out = s.feed(a);
            out.extend(s.feed(b));
            out.extend(s.finish());
            check(out, &format!("split at {split}"));
            // A pause between the two halves (the upstream idle for a second).
            let mut s = Scrubber::new(up.scrub.clone());
            let mut out = s.feed(a);
            out.extend(s.pause());
            out.extend(s.feed(b));
            out.extend(s.finish());
            check(out, &format!("pause at {split}"));
        }
        // A `%` of the credentials' own, written as `%25`, and a `/` JSON-escaped.
        let pct = Upstream::with_credentials("p:1".into(), vec![], Some(("agent".into(), "pa%ss1234/x".into())));
        let text = b"pa%25ss1234%2Fx agent%3Apa%25ss1234/x pa%ss1234/x pa%ss1234\\/x pa%25ss1234\\/x".to_vec();
        for split in 0..text.len() {
            let mut s = Scrubber::new(pct.scrub.clone());
            let mut out = s.feed(&text[..split]);
            out.extend(s.pause());
            out.extend(s.feed(&text[split..]));
            out.extend(s.finish());
            assert_eq!(out.len(), text.len());
            assert!(out.iter().all(|&b| b == b'*' || b == b' '), "split at {split}: {}", String::from_utf8_lossy(&out));
        }
        // Nothing is held back that cannot begin a form.
        let mut s = Scrubber::new(up.scrub.clone());
        assert_eq!(s.feed(b"plain text, no credentials"), b"plain text, no credentials");
        assert_eq!(s.feed(b"ends with YWdl"), b"ends with ");
        assert_eq!(s.pause(), b"", "a tail that may begin the token waits");
        assert_eq!(s.finish(), b"YWdl");
        // Short credentials are passed on (overwriting them would take ordinary text out).
        let short = Upstream::with_credentials("p:1".into(), vec![], Some(("u".into(), "p".into())));
        assert!(short.scrub.is_empty() && short.authorization.is_some());
        let mut none = Scrubber::new(vec![]);
        assert_eq!(none.feed(b"abc%"), b"abc%");
    }

    #[test]
    fn targets_are_judged_as_the_firewall_and_the_forwarder_judge_them() {
        let rules = AddressRules {
            deny: vec!["203.0.113.99/32".parse().unwrap()],
            allow: vec!["203.0.113.0/24".parse().unwrap()],
            always_denied: vec!["169.254.0.0/16".parse().unwrap(), "127.0.0.0/8".parse().unwrap()],
            allow_any: false,
            never: vec![],
            names: vec![],
        };
        let p = policy(Some(&["api.example.test", "*.cdn.test", "203.0.113.0/24"]), &["bad.cdn.test"], &[(443, 443)]);
        let name = |n: &str| Host::Name(n.into());
        let addr = |a: &str| Host::Addr(a.parse().unwrap());
        assert_eq!(judge(&p, &rules, &name("api.example.test"), 443), Ok(()));
        assert_eq!(judge(&p, &rules, &name("x.cdn.test"), 443), Ok(()));
        assert_eq!(judge(&p, &rules, &name("bad.cdn.test"), 443), Err("denied"));
        assert_eq!(judge(&p, &rules, &name("example.test"), 443), Err("not_allowed"));
        assert_eq!(judge(&p, &rules, &name("api.example.test"), 80), Err("port_not_allowed"));
        assert_eq!(judge(&p, &rules, &addr("203.0.113.5"), 443), Ok(()));
        assert_eq!(judge(&p, &rules, &addr("::ffff:203.0.113.5"), 443), Ok(()));
        assert_eq!(judge(&p, &rules, &addr("203.0.113.99"), 443), Err("denied"));
        assert_eq!(judge(&p, &rules, &addr("198.51.100.1"), 443), Err("not_allowed"));
        assert_eq!(judge(&p, &rules, &addr("169.254.169.254"), 443), Err("unreachable"));

        // Allow-any: anything but the denied, the always-denied and localhost.
        let any = policy(None, &["*.bad.test"], &[]);
        let rules = AddressRules { allow_any: true, allow: vec![], ..rules };
        assert_eq!(judge(&any, &rules, &name("example.test"), 22), Ok(()));
        assert_eq!(judge(&any, &rules, &name("x.bad.test"), 443), Err("denied"));
        assert_eq!(judge(&any, &rules, &name("localhost"), 443), Err("unreachable"));
        assert_eq!(judge(&any, &rules, &name("a.localhost"), 443), Err("unreachable"));
        assert_eq!(judge(&any, &rules, &addr("198.51.100.1"), 443), Ok(()));
        assert_eq!(judge(&any, &rules, &addr("127.0.0.1"), 443), Err("unreachable"));
        assert_eq!(judge(&any, &rules, &addr("::ffff:127.0.0.1"), 443), Err("unreachable"));
        // Named in the allow list, localhost is the operator's choice.
        let named = policy(Some(&["localhost"]), &[], &[]);
        assert_eq!(judge(&named, &rules, &name("localhost"), 443), Ok(()));
        // The host's own addresses, and the configured proxy by name: never.
        let rules = AddressRules {
            never: vec!["192.0.2.1/32".parse().unwrap(), "10.213.0.0/16".parse().unwrap()],
            names: vec!["proxy.corp.test".into()],
            ..rules
        };
        assert_eq!(judge(&any, &rules, &addr("192.0.2.1"), 22), Err("unreachable"));
        assert_eq!(judge(&any, &rules, &addr("::ffff:192.0.2.1"), 22), Err("unreachable"));
        assert_eq!(judge(&any, &rules, &name("proxy.corp.test"), 3128), Err("unreachable"));
        assert_eq!(judge(&any, &rules, &name("www.corp.test"), 443), Ok(()));
        // The pools, whatever the allow list covers.
        let wide = policy(Some(&["10.0.0.0/8"]), &[], &[]);
        let wide_rules = AddressRules { allow: vec!["10.0.0.0/8".parse().unwrap()], allow_any: false, ..rules };
        assert_eq!(judge(&wide, &wide_rules, &addr("10.213.0.6"), 80), Err("unreachable"));
        assert_eq!(judge(&wide, &wide_rules, &addr("10.1.0.6"), 80), Ok(()));
    }
}
