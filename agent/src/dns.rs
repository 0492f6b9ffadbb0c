//! The sandbox's resolver: a DNS forwarder on the host end of its veth that enforces the
//! executor's hostname policy, and a small stub resolver for the agent's own lookups.
//!
//! Guarantees, per query (UDP, and TCP for answers too large for a datagram — the policy is
//! the same; one forwarder thread per sandbox):
//! - a denied name, or a name outside a hostname allow list, gets REFUSED and is audited;
//! - anything but a single standard query gets REFUSED;
//! - a permitted name is forwarded to the configured upstream resolvers; an answer carrying
//!   an address in a special range (loopback, private, link-local, …) that the allow list
//!   does not cover explicitly is refused as DNS rebinding;
//! - the answer's addresses are added to the sandbox's allow set *before* the answer is
//!   returned, so the connection that follows the lookup is already permitted; if that
//!   fails the client gets SERVFAIL, never an address it cannot use.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use serde::Serialize;

use crate::egress::{NameVerdict, NetworkPolicy, MAX_TTL_S, MIN_TTL_S};

const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Names kept in the report (the counts are complete).
const MAX_REPORTED_NAMES: usize = 20;

/// What the forwarder did, for the result and the audit log.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DnsReport {
    pub queries: u64,
    pub answered: u64,
    pub refused: u64,
    /// Refused names: reason (`denied`, `not_allowed`, `rebinding`, `malformed`) and how
    /// often (resolvers retry, so one lookup is often several queries).
    pub refused_names: Vec<RefusedName>,
    /// Whether the record saying that further names are not audited was written.
    #[serde(skip)]
    unlisted_audited: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct RefusedName {
    pub name: String,
    pub reason: String,
    pub count: u64,
}

/// Whose queries a forwarder answers: the executor its audit records name, and the run's
/// secret values delivered so far — a queried name can carry one, so names are redacted
/// before they are counted, reported or audited.
pub struct Querier {
    pub executor: String,
    /// The run's command id (empty for a command-line run), in its audit records.
    pub command_id: String,
    pub redactor: crate::secrets::LiveRedactor,
}

/// A running forwarder; [`Forwarder::stop`] ends it and returns its report.
pub struct Forwarder {
    stop_tx: std::os::fd::OwnedFd,
    thread: JoinHandle<DnsReport>,
}

impl Forwarder {
    /// Bind `listen` (the gateway address, port 53) on the sandbox link's host end `device`
    /// and serve `client` (the sandbox's address) until stopped. Queries from any other
    /// address, or arriving on any other interface, are dropped unanswered: the gateway's
    /// address is the host's own, so whatever can route to it (a neighbour on another
    /// interface, one spoofing the sandbox's address where the host's `rp_filter` is loose)
    /// would otherwise have the agent resolve for it.
    pub fn spawn(
        listen: SocketAddr,
        device: &str,
        client: std::net::IpAddr,
        policy: Arc<NetworkPolicy>,
        upstreams: Vec<SocketAddr>,
        allow: Option<sandbox::net::DynamicAllow>,
        who: Querier,
    ) -> std::io::Result<Forwarder> {
        use nix::sys::socket::{setsockopt, sockopt::BindToDevice};
        let device = std::ffi::OsString::from(device);
        let sock = UdpSocket::bind(listen)?;
        setsockopt(&sock, BindToDevice, &device)?;
        let tcp = std::net::TcpListener::bind(listen)?;
        setsockopt(&tcp, BindToDevice, &device)?;
        tcp.set_nonblocking(true)?;
        let (stop_rx, stop_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)?;
        let thread = std::thread::Builder::new().name("dns-forwarder".into()).spawn(move || {
            let mut report = DnsReport::default();
            let mut buf = [0u8; 4096];
            loop {
                let mut fds = [
                    nix::poll::PollFd::new(sock.as_fd(), nix::poll::PollFlags::POLLIN),
                    nix::poll::PollFd::new(stop_rx.as_fd(), nix::poll::PollFlags::POLLIN),
                    nix::poll::PollFd::new(tcp.as_fd(), nix::poll::PollFlags::POLLIN),
                ];
                match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => return report,
                }
                let ready = |i: usize| fds[i].revents().is_some_and(|r| !r.is_empty());
                if ready(1) {
                    return report;
                }
                if ready(2) {
                    match tcp.accept() {
                        Ok((stream, peer)) if peer.ip() == client => {
                            serve_tcp(stream, &policy, &upstreams, allow.as_ref(), &mut report, &who);
                        }
                        // Not the sandbox: closed at once.
                        Ok(_) | Err(_) => {}
                    }
                }
                if !ready(0) {
                    continue;
                }
                let Ok((n, peer)) = sock.recv_from(&mut buf) else { continue };
                if peer.ip() != client {
                    continue;
                }
                report.queries += 1;
                let reply = answer(&buf[..n], &policy, &upstreams, allow.as_ref(), &mut report, &who, false);
                if let Some(reply) = reply {
                    let _ = sock.send_to(&reply, peer);
                }
            }
        })?;
        Ok(Forwarder { stop_tx, thread })
    }

    pub fn stop(self) -> DnsReport {
        let _ = nix::unistd::write(&self.stop_tx, b"x");
        self.thread.join().unwrap_or_default()
    }
}

/// DNS over TCP (RFC 7766): length-prefixed queries on one connection, answered in order;
/// at most [`TCP_QUERIES`] per connection (then the end of file: every answer written is
/// delivered, the client's further queries go unanswered), each read and write within
/// [`TCP_IDLE`], and no read, write or new query after [`TCP_CONNECTION`] (an upstream
/// lookup already begun takes up to its own timeout) (served on the forwarder's only
/// thread: a client trickling bytes or never reading must not keep it from the UDP queries
/// and its stop for long).
fn serve_tcp(
    mut stream: std::net::TcpStream,
    policy: &NetworkPolicy,
    upstreams: &[SocketAddr],
    allow: Option<&sandbox::net::DynamicAllow>,
    report: &mut DnsReport,
    who: &Querier,
) {
    use std::io::{Read, Write};
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let deadline = Instant::now() + TCP_CONNECTION;
    // Reads up to `buf.len()` bytes, each within the idle limit and all by the deadline.
    let read_exact = |stream: &mut std::net::TcpStream, buf: &mut [u8]| -> bool {
        let mut got = 0;
        while got < buf.len() {
            let Some(left) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
                return false;
            };
            if stream.set_read_timeout(Some(left.min(TCP_IDLE))).is_err() {
                return false;
            }
            match stream.read(&mut buf[got..]) {
                Ok(0) | Err(_) => return false,
                Ok(n) => got += n,
            }
        }
        true
    };
    for _ in 0..TCP_QUERIES {
        let mut len = [0u8; 2];
        if !read_exact(&mut stream, &mut len) {
            return;
        }
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        if !read_exact(&mut stream, &mut msg) {
            return;
        }
        report.queries += 1;
        let Some(reply) = answer(&msg, policy, upstreams, allow, report, who, true) else { return };
        let Ok(n) = u16::try_from(reply.len()) else { return };
        let mut out = n.to_be_bytes().to_vec();
        out.extend_from_slice(&reply);
        // Written by the same deadline (a client reading slowly renews no timeout).
        let mut sent = 0;
        while sent < out.len() {
            let Some(left) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
                return;
            };
            if stream.set_write_timeout(Some(left.min(TCP_IDLE))).is_err() {
                return;
            }
            match stream.write(&out[sent..]) {
                Ok(0) | Err(_) => return,
                Ok(k) => sent += k,
            }
        }
        if Instant::now() >= deadline {
            return;
        }
    }
    // The query limit reached. Closed with the client's next queries unread, the connection
    // would be reset — and what is still queued to send (the last answers) dropped. So the
    // answers are followed by the end of file, and what the client sent meanwhile is read and
    // discarded until it closes too: briefly, and by the connection's deadline.
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let until = deadline.min(Instant::now() + TCP_DRAIN);
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < TCP_DRAIN_BYTES {
        let Some(left) = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else { break };
        if stream.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

const TCP_QUERIES: usize = 16;
/// After the last answer of a connection, how long and how much of the client's input is
/// read and discarded (see [`serve_tcp`]).
const TCP_DRAIN: Duration = Duration::from_millis(250);
const TCP_DRAIN_BYTES: usize = 64 * 1024;
const TCP_IDLE: Duration = Duration::from_secs(2);
const TCP_CONNECTION: Duration = Duration::from_secs(5);

/// Count a refused query; audit it once per name and reason, for the first
/// [`MAX_REPORTED_NAMES`] of them — past that, one record says that the rest are only counted,
/// so a sandbox querying ever new names cannot write the audit log without bound. `true`
/// when this name and reason were audited now (first seen).
fn refuse(report: &mut DnsReport, who: &Querier, name: &str, reason: &str) -> bool {
    let redacted = who.redactor.dns_name(name);
    let (executor, name, command_id) = (who.executor.as_str(), redacted.as_str(), who.command_id.as_str());
    report.refused += 1;
    if let Some(r) = report.refused_names.iter_mut().find(|r| r.name == name && r.reason == reason) {
        r.count += 1;
        return false;
    }
    if report.refused_names.len() < MAX_REPORTED_NAMES {
        report.refused_names.push(RefusedName { name: name.into(), reason: reason.into(), count: 1 });
        crate::audit::record(
            "dns_refused",
            &[("executor", executor), ("name", name), ("reason", reason), ("command_id", command_id)],
        );
        return true;
    }
    if !report.unlisted_audited {
        report.unlisted_audited = true;
        let cap = MAX_REPORTED_NAMES.to_string();
        crate::audit::record(
            "dns_refused",
            &[
                ("executor", executor),
                ("name", name),
                ("reason", reason),
                ("command_id", command_id),
                ("further_names_counted_only_after", &cap),
            ],
        );
    }
    false
}

fn error_reply(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut m = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    m.metadata.recursion_desired = query.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    for q in &query.queries {
        m.add_query(q.clone());
    }
    m.to_vec().ok()
}

/// The reply to one query from the sandbox (`None`: drop it).
fn answer(
    raw: &[u8],
    policy: &NetworkPolicy,
    upstreams: &[SocketAddr],
    allow: Option<&sandbox::net::DynamicAllow>,
    report: &mut DnsReport,
    who: &Querier,
    tcp: bool,
) -> Option<Vec<u8>> {
    let (query, name) = match screen_query(raw, policy) {
        Screened::Drop => return None,
        Screened::Refused { name, reason, reply } => {
            refuse(report, who, &name, reason);
            return reply;
        }
        Screened::Forward { query, name } => (query, name),
    };
    // Upstream sees an id of the forwarder's own, never the sandbox's: the sandbox knows
    // nothing of the upstream exchange it could use to forge an answer.
    let up_id = upstream_id(query.metadata.id);
    let mut up_raw = raw.to_vec();
    up_raw[..2].copy_from_slice(&up_id.to_be_bytes());
    let Some(mut reply_raw) = forward(&up_raw, up_id, upstreams, tcp) else {
        return error_reply(&query, ResponseCode::ServFail);
    };
    reply_raw[..2].copy_from_slice(&query.metadata.id.to_be_bytes());
    let (reply_raw, found) = match screen_reply(&name, reply_raw, policy) {
        Answer::Pass { reply, found } => (reply, found),
        Answer::ServFail => return error_reply(&query, ResponseCode::ServFail),
        Answer::Refused { name: refused, reason, rebinding } => {
            if refuse(report, who, &refused, reason) {
                if let Some(addr) = rebinding {
                    crate::audit::record(
                        "dns_rebinding_refused",
                        &[
                            ("executor", &who.executor),
                            ("name", &who.redactor.dns_name(&refused)),
                            ("address", &addr.to_string()),
                        ],
                    );
                }
            }
            return error_reply(&query, ResponseCode::Refused);
        }
    };
    if let Some(allow) = allow {
        if !found.is_empty() {
            if let Err(e) = allow.allow(&found) {
                tracing::warn!(error = %e, name = who.redactor.dns_name(&name), "could not allow resolved addresses");
                return error_reply(&query, ResponseCode::ServFail);
            }
        }
    }
    report.answered += 1;
    Some(reply_raw)
}

/// A query from the sandbox, judged before anything goes upstream.
enum Screened {
    /// Not a query: dropped unanswered.
    Drop,
    /// Refused for `reason` (`name` as far as it is known), with this reply.
    Refused { name: String, reason: &'static str, reply: Option<Vec<u8>> },
    /// To be asked upstream: the parsed query and the name it asks, as the policy matches it.
    Forward { query: Message, name: String },
}

/// Judge the sandbox's query `raw` against `policy` (no I/O, nothing recorded).
fn screen_query(raw: &[u8], policy: &NetworkPolicy) -> Screened {
    let Ok(query) = Message::from_vec(raw) else { return Screened::Drop };
    if query.metadata.message_type != MessageType::Query {
        return Screened::Drop;
    }
    let refused = |query: &Message, name: String, reason| Screened::Refused {
        name,
        reason,
        reply: error_reply(query, ResponseCode::Refused),
    };
    if query.metadata.op_code != OpCode::Query || query.queries.len() != 1 {
        return refused(&query, String::new(), "malformed");
    }
    // Zone transfers and `ANY`: whole zones or every record of a name, nothing a lookup
    // needs (RFC 8482 lets servers refuse ANY).
    if matches!(
        query.queries[0].query_type(),
        RecordType::AXFR | RecordType::IXFR | RecordType::ANY | RecordType::Unknown(253 | 254)
    ) {
        return refused(&query, plain_name(query.queries[0].name()), "query_type");
    }
    // The name from its labels, each of hostname characters only: hickory's text form
    // escapes a dot inside a label (`x\.example.test`), which a suffix match would take for
    // a name below `example.test` although it is a sibling of it.
    let mut labels: Vec<String> = Vec::new();
    for label in query.queries[0].name().iter() {
        if label.is_empty() || !label.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_')) {
            return refused(&query, String::new(), "malformed");
        }
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
    }
    let name = labels.join(".");
    match policy.name_verdict(&name) {
        NameVerdict::Allowed => Screened::Forward { query, name },
        NameVerdict::Denied => refused(&query, name, "denied"),
        NameVerdict::NotAllowed => refused(&query, name, "not_allowed"),
    }
}

/// An upstream's reply, judged.
enum Answer {
    /// Passed on as `reply` (its TTLs lowered), once `found` (address, milliseconds to
    /// allow it) is in the sandbox's allow set.
    Pass { reply: Vec<u8>, found: Vec<(IpAddr, u64)> },
    /// Refused for `reason`, naming `name`; `rebinding` is the address that made it so.
    Refused { name: String, reason: &'static str, rebinding: Option<IpAddr> },
    /// Answered SERVFAIL: the reply did not parse.
    ServFail,
}

/// Judge upstream's reply `reply_raw` to a query for `name` (no I/O, nothing recorded).
fn screen_reply(name: &str, mut reply_raw: Vec<u8>, policy: &NetworkPolicy) -> Answer {
    let Ok(reply) = Message::from_vec(&reply_raw) else { return Answer::ServFail };
    // The names the answer's addresses may belong to: the query's, and those its CNAME
    // chain in the answer leads to. An A or AAAA record of any other owner name (one an
    // upstream added beside the answer) allows nothing.
    let owners = chain_owners(name, &reply.answers);
    let mut found: Vec<(IpAddr, u64)> = Vec::new();
    for r in &reply.answers {
        // An allowed name that leads, through a CNAME, to a denied one: the denied name's
        // addresses are not allowed by the way (deny always wins).
        let mut chained = vec![&r.name];
        if let RData::CNAME(target) = &r.data {
            chained.push(&target.0);
        }
        if let Some(denied) =
            chained.into_iter().map(plain_name).find(|n| policy.name_verdict(n) == NameVerdict::Denied)
        {
            return Answer::Refused { name: denied, reason: "denied", rebinding: None };
        }
        let addr = match &r.data {
            RData::A(a) => IpAddr::V4(a.0),
            RData::AAAA(a) => IpAddr::V6(a.0),
            _ => continue,
        };
        if !owners.contains(&plain_name(&r.name)) {
            continue;
        }
        if policy.is_special(addr) && !policy.explicitly_allows(addr) {
            return Answer::Refused { name: name.to_string(), reason: "rebinding", rebinding: Some(addr) };
        }
        found.push((addr, u64::from(r.ttl).clamp(MIN_TTL_S, MAX_TTL_S) * 1000));
    }
    // No resolver in the sandbox may cache an address longer than the allow set keeps it;
    // checked before anything is allowed.
    if clamp_answer_ttls(&mut reply_raw, MAX_TTL_S as u32).is_none() {
        return Answer::ServFail;
    }
    Answer::Pass { reply: reply_raw, found }
}

/// What the forwarder passes on: the reply the sandbox gets and the addresses (with
/// milliseconds) its allow set gets ([`screen_for_fuzzing`]).
#[doc(hidden)]
pub struct Passed {
    pub reply: Vec<u8>,
    pub found: Vec<(IpAddr, u64)>,
}

/// For the fuzz target (`fuzz/fuzz_targets/dns.rs`): what the forwarder makes of a sandbox's
/// `query` under `policy`, and of `reply` as upstream's answer to it, without the network —
/// `None` when the query is not forwarded or the reply not passed on.
#[doc(hidden)]
pub fn screen_for_fuzzing(query: &[u8], reply: &[u8], policy: &NetworkPolicy) -> Option<Passed> {
    let Screened::Forward { name, .. } = screen_query(query, policy) else { return None };
    match screen_reply(&name, reply.to_vec(), policy) {
        Answer::Pass { reply, found } => Some(Passed { reply, found }),
        _ => None,
    }
}

/// Lower every TTL of `msg`'s answer section above `max` to `max`, in place (the message
/// is otherwise passed on as upstream sent it). `None` when the message does not parse
/// that far (it has parsed whole before: never, in practice).
fn clamp_answer_ttls(msg: &mut [u8], max: u32) -> Option<()> {
    /// The offset after the (possibly compressed) name at `at`.
    fn skip_name(msg: &[u8], mut at: usize) -> Option<usize> {
        loop {
            let len = *msg.get(at)?;
            match len & 0xC0 {
                0 if len == 0 => return Some(at + 1),
                0 => at += 1 + usize::from(len),
                // A pointer ends the name.
                0xC0 => return msg.get(at + 1).map(|_| at + 2),
                _ => return None,
            }
        }
    }
    let u16_at = |msg: &[u8], at: usize| Some(u16::from_be_bytes([*msg.get(at)?, *msg.get(at + 1)?]));
    let (questions, answers) = (u16_at(msg, 4)?, u16_at(msg, 6)?);
    let mut at = 12;
    for _ in 0..questions {
        at = skip_name(msg, at)? + 4;
    }
    for _ in 0..answers {
        at = skip_name(msg, at)?;
        // type (2), class (2), TTL (4), data length (2), data.
        let ttl = msg.get_mut(at + 4..at + 8)?;
        let value = u32::from_be_bytes([ttl[0], ttl[1], ttl[2], ttl[3]]);
        if value > max {
            ttl.copy_from_slice(&max.to_be_bytes());
        }
        at += 10 + usize::from(u16_at(msg, at + 8)?);
    }
    (at <= msg.len()).then_some(())
}

/// `name` in the form the policy matches: lower-case labels joined by dots, no root dot.
fn plain_name(name: &Name) -> String {
    name.iter().map(|l| String::from_utf8_lossy(l).to_ascii_lowercase()).collect::<Vec<_>>().join(".")
}

/// Send `raw` to each upstream in turn (over TCP when `tcp`); the first reply with the same
/// id wins.
fn forward(raw: &[u8], id: u16, upstreams: &[SocketAddr], tcp: bool) -> Option<Vec<u8>> {
    for up in upstreams {
        let reply = if tcp { forward_tcp(raw, up) } else { forward_udp(raw, id, up) };
        if let Some(r) = reply.filter(|r| r.len() >= 2 && u16::from_be_bytes([r[0], r[1]]) == id) {
            return Some(r);
        }
    }
    None
}

fn forward_udp(raw: &[u8], id: u16, up: &SocketAddr) -> Option<Vec<u8>> {
    let bind: SocketAddr = if up.is_ipv4() { "0.0.0.0:0".parse().ok()? } else { "[::]:0".parse().ok()? };
    let sock = UdpSocket::bind(bind).ok()?;
    sock.connect(up).ok()?;
    sock.send(raw).ok()?;
    let deadline = Instant::now() + UPSTREAM_TIMEOUT;
    let mut buf = vec![0u8; 4096];
    while let Some(left) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) {
        sock.set_read_timeout(Some(left)).ok()?;
        match sock.recv(&mut buf) {
            Ok(n) if n >= 2 && u16::from_be_bytes([buf[0], buf[1]]) == id => {
                buf.truncate(n);
                return Some(buf);
            }
            Ok(_) => continue,
            Err(_) => return None,
        }
    }
    None
}

/// `name` and the names its CNAME chain in `answers` leads to. One pass over the records and
/// one over the chain, whatever their order: an upstream's answer of thousands of CNAMEs
/// listed backwards costs the agent no more than one in order.
fn chain_owners(name: &str, answers: &[hickory_proto::rr::Record]) -> std::collections::HashSet<String> {
    let mut cnames: std::collections::HashMap<String, Vec<String>> = std::collections::HashMap::new();
    for r in answers {
        if let RData::CNAME(target) = &r.data {
            cnames.entry(plain_name(&r.name)).or_default().push(plain_name(&target.0));
        }
    }
    let mut owners = std::collections::HashSet::from([name.to_string()]);
    let mut to_follow = vec![name.to_string()];
    while let Some(from) = to_follow.pop() {
        for to in cnames.get(&from).into_iter().flatten() {
            if owners.insert(to.clone()) {
                to_follow.push(to.clone());
            }
        }
    }
    owners
}

/// One query over TCP, the whole exchange within [`UPSTREAM_TIMEOUT`] of its start: an
/// upstream that trickles its answer (or never reads the query) cannot hold the forwarder,
/// whose end the run's end waits for.
fn forward_tcp(raw: &[u8], up: &SocketAddr) -> Option<Vec<u8>> {
    use std::io::{Read, Write};
    let deadline = Instant::now() + UPSTREAM_TIMEOUT;
    let left = || deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero());
    let mut s = std::net::TcpStream::connect_timeout(up, UPSTREAM_TIMEOUT).ok()?;
    let mut out = u16::try_from(raw.len()).ok()?.to_be_bytes().to_vec();
    out.extend_from_slice(raw);
    s.set_write_timeout(Some(left()?)).ok()?;
    s.write_all(&out).ok()?;
    let mut read_within = |buf: &mut [u8]| -> Option<()> {
        let mut done = 0;
        while done < buf.len() {
            s.set_read_timeout(Some(left()?)).ok()?;
            match s.read(&mut buf[done..]) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(0) | Err(_) => return None,
                Ok(n) => done += n,
            }
        }
        Some(())
    };
    let mut len = [0u8; 2];
    read_within(&mut len)?;
    let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
    read_within(&mut reply)?;
    Some(reply)
}

/// Resolve `name` (A and AAAA) through `upstreams` — for the agent's own lookups (the proxy
/// host, denied names). An error when no upstream answered.
pub fn resolve(name: &str, upstreams: &[SocketAddr]) -> Result<Vec<IpAddr>, String> {
    resolve_with(name, upstreams, false)
}

/// As [`resolve`], but every query (A and AAAA) must be answered, with an address list or
/// "no such name/record": for addresses that must be *denied*, where a partial answer would
/// leave some of them reachable.
pub fn resolve_every(name: &str, upstreams: &[SocketAddr]) -> Result<Vec<IpAddr>, String> {
    resolve_with(name, upstreams, true)
}

fn resolve_with(name: &str, upstreams: &[SocketAddr], every: bool) -> Result<Vec<IpAddr>, String> {
    let fqdn = Name::from_ascii(format!("{}.", name.trim_end_matches('.'))).map_err(|e| format!("{name}: {e}"))?;
    let mut out = Vec::new();
    let mut answered = false;
    for rtype in [RecordType::A, RecordType::AAAA] {
        let id: u16 = rand_id();
        let mut q = Message::new(id, MessageType::Query, OpCode::Query);
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(fqdn.clone(), rtype));
        let raw = q.to_vec().map_err(|e| e.to_string())?;
        let mut reply = forward(&raw, id, upstreams, false);
        // A truncated answer (more records than a 512-byte UDP reply holds) lists only some
        // addresses, or none: asked again over TCP, which carries them all.
        let truncated = |r: &Option<Vec<u8>>| {
            r.as_deref().and_then(|r| Message::from_vec(r).ok()).is_some_and(|m| m.metadata.truncation)
        };
        if truncated(&reply) {
            // Without a TCP answer the partial one stays: enough for a lookup that needs no
            // complete answer, refused below for one that does.
            if let Some(full) = forward(&raw, id, upstreams, true) {
                reply = Some(full);
            }
        }
        let Some(reply) = reply else {
            if every {
                return Err(format!("no {rtype} answer from {upstreams:?}"));
            }
            continue;
        };
        answered = true;
        let parsed = Message::from_vec(&reply);
        if every {
            match &parsed {
                Ok(m) if m.metadata.truncation => {
                    return Err(format!("{rtype} answer truncated, even over TCP"));
                }
                Ok(m) if matches!(m.metadata.response_code, ResponseCode::NoError | ResponseCode::NXDomain) => {}
                Ok(m) => return Err(format!("{rtype} answer {}", m.metadata.response_code)),
                Err(e) => return Err(format!("{rtype} answer unreadable: {e}")),
            }
        }
        if let Ok(m) = parsed {
            for r in &m.answers {
                match &r.data {
                    RData::A(a) => out.push(IpAddr::V4(a.0)),
                    RData::AAAA(a) => out.push(IpAddr::V6(a.0)),
                    _ => {}
                }
            }
        }
    }
    if !answered {
        return Err(format!("no answer from {upstreams:?}"));
    }
    Ok(out)
}

/// A random id for an upstream query, never the sandbox's own `id`.
fn upstream_id(id: u16) -> u16 {
    let up = rand_id();
    if up == id {
        up ^ 1
    } else {
        up
    }
}

fn rand_id() -> u16 {
    let mut b = [0u8; 2];
    if crate::random::fill(&mut b).is_err() {
        // Only predictability of the id is lost (the upstream answer is still matched by id).
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return t.subsec_nanos() as u16;
    }
    u16::from_ne_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::clamp_answer_ttls;

    #[test]
    fn a_cname_chain_is_followed_in_any_order_and_only_from_the_name_asked() {
        use hickory_proto::rr::{rdata, Name, RData, Record};
        use std::str::FromStr;
        let cname = |from: &str, to: &str| {
            Record::from_rdata(
                Name::from_str(from).unwrap(),
                60,
                RData::CNAME(rdata::CNAME(Name::from_str(to).unwrap())),
            )
        };
        // 4000 links listed backwards (each pass of the old loop took one more), a record of
        // another owner beside them, and a loop back to the start.
        let mut answers: Vec<Record> =
            (0..4000).rev().map(|i| cname(&format!("n{i}.test."), &format!("n{}.test.", i + 1))).collect();
        answers.push(cname("other.test.", "elsewhere.test."));
        answers.push(cname("n4000.test.", "n0.test."));
        let owners = super::chain_owners("n0.test", &answers);
        assert_eq!(owners.len(), 4001);
        assert!(owners.contains("n4000.test") && !owners.contains("other.test") && !owners.contains("elsewhere.test"));
    }

    /// A reply to `a.test` A with two answers — the first owned through a pointer, the
    /// second by a name written out — with these TTLs.
    fn reply(ttls: [u32; 2]) -> Vec<u8> {
        let mut m = vec![0x12, 0x34, 0x81, 0x80, 0, 1, 0, 2, 0, 0, 0, 0];
        m.extend_from_slice(b"\x01a\x04test\x00\x00\x01\x00\x01");
        for (i, ttl) in ttls.into_iter().enumerate() {
            if i == 0 {
                m.extend_from_slice(&[0xC0, 0x0C]);
            } else {
                m.extend_from_slice(b"\x01b\x04test\x00");
            }
            m.extend_from_slice(&[0, 1, 0, 1]);
            m.extend_from_slice(&ttl.to_be_bytes());
            m.extend_from_slice(&[0, 4, 192, 0, 2, 1 + i as u8]);
        }
        m
    }

    #[test]
    fn answer_ttls_are_clamped_in_place() {
        let mut m = reply([86_400, 30]);
        clamp_answer_ttls(&mut m, 3600).unwrap();
        assert_eq!(m, reply([3600, 30]));
        let mut m = reply([u32::MAX, 3600]);
        clamp_answer_ttls(&mut m, 3600).unwrap();
        assert_eq!(m, reply([3600, 3600]));
        // Cut short anywhere: refused, never read past the end.
        let whole = reply([86_400, 30]);
        for len in 12..whole.len() {
            let mut m = whole[..len].to_vec();
            assert!(clamp_answer_ttls(&mut m, 3600).is_none(), "{len}");
        }
    }
}
