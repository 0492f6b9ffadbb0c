//! A network laboratory for the egress tests, built from two network namespaces that the
//! test creates and removes (nothing outside them is ever touched or sent to):
//!
//! ```text
//!   HOST  (osvt-<pid>-<n>-h)                      OUTSIDE (osvt-<pid>-<n>-o): the "internet"
//!   the agent's host: opservant runs here          servers on lo: 198.51.100.10/.11/.12/.53,
//!   lo, labup 192.0.2.1/24 2001:db8:1::1/64 <-veth-> labdown 192.0.2.2/24 2001:db8:1::2/64
//!   default via 192.0.2.2 / 2001:db8:1::2            203.0.113.5, 2001:db8:2::10, 2001:db8:2::11
//!   ip_forward=1, ipv6 forwarding=1
//! ```
//!
//! Servers are threads of the test process using sockets created (by a thread that `setns`-ed
//! into OUTSIDE) in OUTSIDE's namespace: TCP banner servers (`hello <addr>:<port>\n`), a
//! bandwidth source and sink, and a DNS server (UDP and TCP) on 198.51.100.53:53 that answers
//! from a per-lab table and counts what it was asked. Dropping the [`Lab`] stops the threads
//! and deletes both namespaces (which removes the veth pair and everything configured in them).
#![allow(dead_code)]

use std::collections::HashMap;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// HOST's address on the uplink (what OUTSIDE sees as the source of masqueraded traffic).
pub const HOST_V4: &str = "192.0.2.1";
pub const HOST_V6: &str = "2001:db8:1::1";
/// OUTSIDE's end of the uplink (HOST's default gateways).
pub const GW_V4: &str = "192.0.2.2";
pub const GW_V6: &str = "2001:db8:1::2";
/// HOST's uplink interface name (the only interface besides `lo` in HOST).
pub const HOST_IF: &str = "labup";
pub const OUTSIDE_IF: &str = "labdown";
/// The lab's DNS server (UDP and TCP).
pub const DNS_ADDR: &str = "198.51.100.53";
pub const DNS_SERVER: &str = "198.51.100.53:53";
/// Server addresses present in OUTSIDE (on its `lo`).
pub const SERVERS_V4: [&str; 5] = ["198.51.100.10", "198.51.100.11", "198.51.100.12", "198.51.100.53", "203.0.113.5"];
pub const SERVERS_V6: [&str; 2] = ["2001:db8:2::10", "2001:db8:2::11"];

/// The DNS table every lab starts with (TTL 60; NXDOMAIN for anything else).
pub const DEFAULT_ZONE: &[(&str, &[&str])] = &[
    ("allowed.test", &["198.51.100.10"]),
    ("other.test", &["198.51.100.11"]),
    ("bad.example.test", &["198.51.100.12"]),
    ("good.example.test", &["198.51.100.10"]),
    ("rebind.test", &["127.0.0.1"]),
    ("rebind6.test", &["::1"]),
    ("wireserver.test", &["168.63.129.16"]),
    ("private10.test", &["10.1.2.3"]),
    ("private192.test", &["192.168.1.1"]),
    ("ula.test", &["fd00::1"]),
    ("metadata.test", &["169.254.169.254"]),
    ("v6.test", &["2001:db8:2::10"]),
    ("dual.test", &["198.51.100.10", "2001:db8:2::10"]),
];

pub const DNS_TTL: u32 = 60;

// ---------------------------------------------------------------------------------------
// Prerequisites and small process helpers
// ---------------------------------------------------------------------------------------

/// True when `prog` is an executable on PATH (or the usual sbin directories).
pub fn have_program(prog: &str) -> bool {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path.split(':').chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"]).any(|d| {
        let p = Path::new(d).join(prog);
        std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
    });
    found
}

/// The lab's prerequisites (root is checked separately): `ip` and `nft`. Under `CI=true` a
/// missing one panics (via [`super::require`]); otherwise the test is skipped visibly.
#[must_use]
pub fn require_lab_tools() -> bool {
    super::require("ip (iproute2) binary", have_program("ip")) && super::require("nft binary", have_program("nft"))
}

/// Run a command; panic with its output unless it succeeded. Returns stdout.
fn checked(cmd: &mut Command, what: &str) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    if !out.status.success() {
        panic!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip(args: &[&str]) -> String {
    checked(Command::new("ip").args(args), &format!("ip {}", args.join(" ")))
}

fn netns_path(name: &str) -> String {
    format!("/run/netns/{name}")
}

/// Run `f` on a fresh thread that has joined network namespace `ns` (only that thread moves;
/// sockets it creates stay in `ns` wherever they are used afterwards).
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let file = File::open(netns_path(ns)).unwrap_or_else(|e| panic!("open netns {ns}: {e}"));
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: setns on a valid namespace fd; affects only this thread.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns into {ns}: {}", std::io::Error::last_os_error());
            drop(file);
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// A `Command` whose child joins network namespace `ns` before exec (and nothing else: unlike
/// `ip netns exec` it keeps the caller's mounts, so /sys/fs/cgroup stays visible).
pub fn command_in(ns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let file = File::open(netns_path(ns)).unwrap_or_else(|e| panic!("open netns {ns}: {e}"));
    let mut cmd = Command::new(program);
    // SAFETY: the closure only calls async-signal-safe setns on an fd it owns (O_CLOEXEC, so
    // it is gone after exec).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Output of `program args…` run in namespace `ns`; panics unless it succeeded.
pub fn output_in(ns: &str, program: &str, args: &[&str]) -> String {
    checked(command_in(ns, program).args(args), &format!("[{ns}] {program} {}", args.join(" ")))
}

/// Write a sysctl (`net.ipv4.ip_forward`) in namespace `ns` and read it back.
pub fn sysctl_in(ns: &str, key: &str, value: &str) {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    output_in(ns, "sh", &["-c", &format!("echo {value} > {path}")]);
    let got = output_in(ns, "cat", &[&path]);
    assert_eq!(got.trim(), value, "sysctl {key} in {ns}");
}

static SEQ: AtomicU32 = AtomicU32::new(0);

// ---------------------------------------------------------------------------------------
// Namespaces
// ---------------------------------------------------------------------------------------

/// A named network namespace this test created; deleted on drop (with everything in it).
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Create `osvt-<pid>-<n>-<suffix>`; panics if the name exists (never adopt a stranger's).
    pub fn new(base: &str, suffix: &str) -> Netns {
        let name = format!("{base}-{suffix}");
        assert!(!Path::new(&netns_path(&name)).exists(), "netns {name} already exists: refusing to reuse it");
        ip(&["netns", "add", &name]);
        let ns = Netns { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// The namespace's identity (device, inode) as /proc/*/ns/net shows it.
    pub fn id(&self) -> (u64, u64) {
        let m = std::fs::metadata(netns_path(&self.name)).expect("stat netns");
        (m.dev(), m.ino())
    }

    pub fn ip(&self, args: &[&str]) -> String {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all)
    }

    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        command_in(&self.name, program)
    }

    pub fn output(&self, program: &str, args: &[&str]) -> String {
        output_in(&self.name, program, args)
    }

    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_netns(&self.name, f)
    }

    /// Interface names (without the `@peer` suffix).
    pub fn links(&self) -> Vec<String> {
        self.ip(&["-o", "link", "show"])
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .collect()
    }

    /// `nft list tables` in this namespace (one `table FAMILY NAME` per line).
    pub fn nft_tables(&self) -> Vec<String> {
        self.output("nft", &["list", "tables"])
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    }

    /// Load `ruleset` with `nft -f -` in this namespace; panics with nft's message on error.
    pub fn nft_apply(&self, ruleset: &str) {
        let mut child = self
            .command("nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nft");
        child.stdin.take().expect("stdin").write_all(ruleset.as_bytes()).expect("write ruleset");
        let out = child.wait_with_output().expect("wait nft");
        assert!(out.status.success(), "nft -f in {}: {}\n{ruleset}", self.name, String::from_utf8_lossy(&out.stderr));
    }

    /// Pids of processes with at least one thread in this namespace.
    pub fn processes(&self) -> Vec<i32> {
        let id = self.id();
        let mut pids = Vec::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
            for t in tasks {
                if let Ok(m) = std::fs::metadata(t.path().join("ns/net")) {
                    if (m.dev(), m.ino()) == id {
                        pids.push(pid);
                        break;
                    }
                }
            }
        }
        pids
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let out = Command::new("ip").args(["netns", "del", &self.name]).stdin(Stdio::null()).output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!("netlab: ip netns del {}: {}", self.name, String::from_utf8_lossy(&o.stderr)),
            Err(e) => eprintln!("netlab: ip netns del {}: {e}", self.name),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Servers
// ---------------------------------------------------------------------------------------

/// What a TCP server saw.
#[derive(Default)]
pub struct ServerStats {
    pub accepted: AtomicU64,
    pub bytes: AtomicU64,
    pub peers: Mutex<Vec<SocketAddr>>,
}

impl ServerStats {
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }
    /// Source addresses of accepted connections.
    pub fn peer_ips(&self) -> Vec<IpAddr> {
        self.peers.lock().unwrap().iter().map(SocketAddr::ip).collect()
    }
}

/// Wait up to `ms` for `fd` to become readable.
fn wait_readable(fd: RawFd, ms: i32) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, ms) };
}

type Threads = Arc<Mutex<Vec<JoinHandle<()>>>>;

/// Accept until `stop`, handing each connection to `on_conn`.
fn accept_loop(listener: TcpListener, stop: Arc<AtomicBool>, mut on_conn: impl FnMut(TcpStream, SocketAddr)) {
    listener.set_nonblocking(true).expect("nonblocking listener");
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, peer)) => {
                let _ = s.set_nonblocking(false);
                on_conn(s, peer);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => wait_readable(listener.as_raw_fd(), 100),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The banner a [`Lab::banner`] server at `addr` writes.
pub fn banner_text(addr: &SocketAddr) -> String {
    format!("hello {addr}\n")
}

// ---------------------------------------------------------------------------------------
// DNS
// ---------------------------------------------------------------------------------------

pub const QTYPE_A: u16 = 1;
pub const QTYPE_AAAA: u16 = 28;
pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_NXDOMAIN: u8 = 3;

/// The lab's DNS server state: its table and what it was asked.
#[derive(Default)]
pub struct Dns {
    table: Mutex<HashMap<String, Vec<IpAddr>>>,
    /// name → the name it is a CNAME of (answered with the CNAME and the target's records).
    cnames: Mutex<HashMap<String, String>>,
    /// name → records of other owner names added to its answers (owner, address).
    extras: Mutex<HashMap<String, Vec<(String, IpAddr)>>>,
    /// name → the TTL of its answers' records (else [`DNS_TTL`]).
    ttls: Mutex<HashMap<String, u32>>,
    log: Mutex<Vec<(String, u16)>>,
    /// The id of every query received.
    ids: Mutex<Vec<u16>>,
}

impl Dns {
    fn with_default_zone() -> Dns {
        let d = Dns::default();
        for (name, addrs) in DEFAULT_ZONE {
            d.set(name, addrs);
        }
        d
    }

    /// Answer `name` with `addrs` (A and AAAA records by family); an empty list makes it
    /// NOERROR/no data.
    pub fn set(&self, name: &str, addrs: &[&str]) {
        let addrs = addrs.iter().map(|a| a.parse().unwrap_or_else(|e| panic!("bad address {a}: {e}"))).collect();
        self.table.lock().unwrap().insert(name.trim_end_matches('.').to_ascii_lowercase(), addrs);
    }

    /// Make `name` a CNAME of `target`: answered with the CNAME record, then `target`'s
    /// addresses under `target`'s name.
    pub fn set_cname(&self, name: &str, target: &str) {
        let key = |n: &str| n.trim_end_matches('.').to_ascii_lowercase();
        self.cnames.lock().unwrap().insert(key(name), key(target));
    }

    /// Add an A/AAAA record of `owner` (another name) to every answer for `name`, as a
    /// hostile upstream could.
    pub fn set_extra(&self, name: &str, owner: &str, addr: &str) {
        let key = |n: &str| n.trim_end_matches('.').to_ascii_lowercase();
        let addr = addr.parse().unwrap_or_else(|e| panic!("bad address {addr}: {e}"));
        self.extras.lock().unwrap().entry(key(name)).or_default().push((key(owner), addr));
    }

    /// Answer `name` with records of this TTL.
    pub fn set_ttl(&self, name: &str, ttl: u32) {
        self.ttls.lock().unwrap().insert(name.trim_end_matches('.').to_ascii_lowercase(), ttl);
    }

    /// The id of every query received, in order.
    pub fn ids(&self) -> Vec<u16> {
        self.ids.lock().unwrap().clone()
    }

    /// Forget `name` (NXDOMAIN from now on).
    pub fn remove(&self, name: &str) {
        self.table.lock().unwrap().remove(&name.trim_end_matches('.').to_ascii_lowercase());
    }

    /// Number of queries received (UDP and TCP).
    pub fn queries(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    /// Every (name, qtype) received, in order.
    pub fn log(&self) -> Vec<(String, u16)> {
        self.log.lock().unwrap().clone()
    }

    /// Whether `name` was asked about (any type).
    pub fn asked(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        self.log.lock().unwrap().iter().any(|(n, _)| *n == name)
    }

    /// The response to one query message, or None when it is not a query we can parse.
    pub fn answer(&self, q: &[u8]) -> Option<Vec<u8>> {
        let (name, qtype, qend) = parse_question(q)?;
        self.log.lock().unwrap().push((name.clone(), qtype));
        self.ids.lock().unwrap().push(u16::from_be_bytes([q[0], q[1]]));
        let extras: Vec<(String, IpAddr)> = self.extras.lock().unwrap().get(&name).cloned().unwrap_or_default();
        let cname = self.cnames.lock().unwrap().get(&name).cloned();
        let ttl = self.ttls.lock().unwrap().get(&name).copied().unwrap_or(DNS_TTL);
        let table = self.table.lock().unwrap();
        let (rcode, addrs) = match table.get(cname.as_ref().unwrap_or(&name)) {
            None => (RCODE_NXDOMAIN, Vec::new()),
            Some(all) => (
                RCODE_NOERROR,
                all.iter()
                    .filter(|a| matches!((qtype, a), (QTYPE_A, IpAddr::V4(_)) | (QTYPE_AAAA, IpAddr::V6(_)) | (255, _)))
                    .copied()
                    .collect(),
            ),
        };
        drop(table);
        let mut r = Vec::with_capacity(qend + addrs.len() * 28);
        r.extend_from_slice(&q[0..2]); // id
        let rd = q[2] & 0x01;
        r.push(0x80 | 0x04 | rd); // QR, AA, RD copied
        r.push(0x80 | rcode); // RA, rcode
        r.extend_from_slice(&1u16.to_be_bytes()); // qdcount
        let ancount = addrs.len() + usize::from(cname.is_some()) + extras.len();
        r.extend_from_slice(&(ancount as u16).to_be_bytes()); // ancount
        r.extend_from_slice(&[0, 0, 0, 0]); // nscount, arcount
        r.extend_from_slice(&q[12..qend]); // the question, verbatim
        let encoded = |n: &str| {
            let mut e = Vec::new();
            for label in n.split('.') {
                e.push(label.len() as u8);
                e.extend_from_slice(label.as_bytes());
            }
            e.push(0);
            e
        };
        if let Some(target) = &cname {
            let data = encoded(target);
            r.extend_from_slice(&[0xC0, 0x0C]);
            r.extend_from_slice(&5u16.to_be_bytes()); // CNAME
            r.extend_from_slice(&1u16.to_be_bytes());
            r.extend_from_slice(&ttl.to_be_bytes());
            r.extend_from_slice(&(data.len() as u16).to_be_bytes());
            r.extend_from_slice(&data);
        }
        // One A or AAAA record: its owner name (encoded, or a pointer), then the address.
        let address_record = |r: &mut Vec<u8>, owner: &[u8], a: IpAddr| {
            r.extend_from_slice(owner);
            let (ty, data): (u16, Vec<u8>) = match a {
                IpAddr::V4(v) => (QTYPE_A, v.octets().to_vec()),
                IpAddr::V6(v) => (QTYPE_AAAA, v.octets().to_vec()),
            };
            r.extend_from_slice(&ty.to_be_bytes());
            r.extend_from_slice(&1u16.to_be_bytes()); // class IN
            r.extend_from_slice(&ttl.to_be_bytes());
            r.extend_from_slice(&(data.len() as u16).to_be_bytes());
            r.extend_from_slice(&data);
        };
        // The target's own records after a CNAME, else a pointer to the question's name.
        let owner = cname.as_deref().map_or_else(|| vec![0xC0, 0x0C], encoded);
        for a in addrs {
            address_record(&mut r, &owner, a);
        }
        for (other_owner, a) in extras {
            address_record(&mut r, &encoded(&other_owner), a);
        }
        Some(r)
    }
}

/// A UDP reply as a server without EDNS sends it: one longer than 512 bytes is cut to the
/// header and question with TC set (the client asks again over TCP).
fn truncate_for_udp(r: Vec<u8>, q: &[u8]) -> Vec<u8> {
    if r.len() <= 512 {
        return r;
    }
    let Some((_, _, qend)) = parse_question(q) else { return r };
    let mut t = r[..qend].to_vec();
    t[2] |= 0x02; // TC
    t[6..8].copy_from_slice(&0u16.to_be_bytes()); // no answers
    t
}

/// A UDP header (checksum left zero) and `payload`.
fn udp_datagram(src_port: u16, dst_port: u16, payload: &[u8]) -> Vec<u8> {
    let mut d = Vec::with_capacity(8 + payload.len());
    d.extend_from_slice(&src_port.to_be_bytes());
    d.extend_from_slice(&dst_port.to_be_bytes());
    d.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    d.extend_from_slice(&[0, 0]);
    d.extend_from_slice(payload);
    d
}

/// Send `packet`, its IP header included, on a raw `IPPROTO_RAW` socket of `family` to the
/// socket address `to` (a `sockaddr_in` or `sockaddr_in6`).
fn send_raw<A>(family: i32, to: &A, packet: &[u8]) -> std::io::Result<()> {
    // SAFETY: plain socket calls on a descriptor this function owns; `to` is a socket
    // address of `size_of::<A>()` bytes and, with the buffer, outlives the calls.
    unsafe {
        let fd = libc::socket(family, libc::SOCK_RAW, libc::IPPROTO_RAW);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = libc::sendto(
            fd,
            packet.as_ptr().cast(),
            packet.len(),
            0,
            (to as *const A).cast(),
            std::mem::size_of::<A>() as libc::socklen_t,
        );
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if n < 0 {
            return Err(err);
        }
    }
    Ok(())
}

/// Send one UDP datagram from `src` to `dst` with a forged source address (a raw socket:
/// the caller's namespace must route `dst`).
pub fn send_spoofed_udp(
    src: std::net::SocketAddrV4,
    dst: std::net::SocketAddrV4,
    payload: &[u8],
) -> std::io::Result<()> {
    let udp = udp_datagram(src.port(), dst.port(), payload); // no UDP checksum (optional in IPv4)
    let mut p = Vec::with_capacity(20 + udp.len());
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&((20 + udp.len()) as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]); // id (kernel), DF, TTL, UDP, checksum (kernel)
    p.extend_from_slice(&src.ip().octets());
    p.extend_from_slice(&dst.ip().octets());
    p.extend_from_slice(&udp);
    let to = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(dst.ip().octets()) },
        sin_zero: [0; 8],
    };
    send_raw(libc::AF_INET, &to, &p)
}

/// Send one UDP datagram over IPv6 from `src` to `dst` with a forged source address (a raw
/// `IPPROTO_RAW` socket: the header as given; the UDP checksum is left zero, so a receiver
/// drops it, but it crosses the links on its way).
pub fn send_spoofed_udp6(
    src: std::net::SocketAddrV6,
    dst: std::net::SocketAddrV6,
    payload: &[u8],
) -> std::io::Result<()> {
    let udp = udp_datagram(src.port(), dst.port(), payload);
    let mut p = Vec::with_capacity(40 + udp.len());
    p.extend_from_slice(&[0x60, 0, 0, 0]); // version 6, no class or flow label
    p.extend_from_slice(&(udp.len() as u16).to_be_bytes());
    p.extend_from_slice(&[17, 64]); // UDP, hop limit
    p.extend_from_slice(&src.ip().octets());
    p.extend_from_slice(&dst.ip().octets());
    p.extend_from_slice(&udp);
    let to = libc::sockaddr_in6 {
        sin6_family: libc::AF_INET6 as libc::sa_family_t,
        sin6_port: 0,
        sin6_flowinfo: 0,
        sin6_addr: libc::in6_addr { s6_addr: dst.ip().octets() },
        sin6_scope_id: 0,
    };
    send_raw(libc::AF_INET6, &to, &p)
}

/// (lower-case name without the root dot, qtype, end offset of the question section).
fn parse_question(q: &[u8]) -> Option<(String, u16, usize)> {
    if q.len() < 12 || q[2] & 0x80 != 0 || u16::from_be_bytes([q[4], q[5]]) < 1 {
        return None;
    }
    let mut i = 12;
    let mut labels = Vec::new();
    loop {
        let len = *q.get(i)? as usize;
        i += 1;
        if len == 0 {
            break;
        }
        if len & 0xC0 != 0 {
            return None; // no compression in questions we parse
        }
        labels.push(String::from_utf8_lossy(q.get(i..i + len)?).to_ascii_lowercase());
        i += len;
    }
    let qtype = u16::from_be_bytes([*q.get(i)?, *q.get(i + 1)?]);
    q.get(i + 2..i + 4)?;
    Some((labels.join("."), qtype, i + 4))
}

/// A query message for `name`/`qtype` with id `id` (RD set).
pub fn dns_query_message(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    m
}

/// Parse a response: (id, rcode, A/AAAA addresses in the answer section).
pub fn parse_dns_response(r: &[u8]) -> Option<(u16, u8, Vec<IpAddr>)> {
    if r.len() < 12 || r[2] & 0x80 == 0 {
        return None;
    }
    let id = u16::from_be_bytes([r[0], r[1]]);
    let rcode = r[3] & 0x0F;
    let qd = u16::from_be_bytes([r[4], r[5]]);
    let an = u16::from_be_bytes([r[6], r[7]]);
    let mut i = 12;
    let skip_name = |mut i: usize| -> Option<usize> {
        loop {
            let len = *r.get(i)? as usize;
            if len & 0xC0 == 0xC0 {
                return Some(i + 2);
            }
            i += 1 + len;
            if len == 0 {
                return Some(i);
            }
        }
    };
    for _ in 0..qd {
        i = skip_name(i)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        i = skip_name(i)?;
        let ty = u16::from_be_bytes([*r.get(i)?, *r.get(i + 1)?]);
        let len = u16::from_be_bytes([*r.get(i + 8)?, *r.get(i + 9)?]) as usize;
        let data = r.get(i + 10..i + 10 + len)?;
        match (ty, len) {
            (QTYPE_A, 4) => addrs.push(IpAddr::from(<[u8; 4]>::try_from(data).ok()?)),
            (QTYPE_AAAA, 16) => addrs.push(IpAddr::from(<[u8; 16]>::try_from(data).ok()?)),
            _ => {}
        }
        i += 10 + len;
    }
    Some((id, rcode, addrs))
}

/// One UDP query to `server` from the calling thread's namespace.
pub fn dns_query_udp(server: &str, name: &str, qtype: u16) -> std::io::Result<(u8, Vec<IpAddr>)> {
    let server: SocketAddr = server.parse().expect("server address");
    let bind: SocketAddr = if server.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().unwrap();
    let s = UdpSocket::bind(bind)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.connect(server)?;
    let id = 0x4242;
    s.send(&dns_query_message(id, name, qtype))?;
    let mut buf = [0u8; 1500];
    let n = s.recv(&mut buf)?;
    let (rid, rcode, addrs) =
        parse_dns_response(&buf[..n]).ok_or_else(|| std::io::Error::other("unparsable DNS response"))?;
    if rid != id {
        return Err(std::io::Error::other("DNS response id mismatch"));
    }
    Ok((rcode, addrs))
}

/// One TCP query to `server` from the calling thread's namespace.
pub fn dns_query_tcp(server: &str, name: &str, qtype: u16) -> std::io::Result<(u8, Vec<IpAddr>)> {
    let server: SocketAddr = server.parse().expect("server address");
    let mut s = TcpStream::connect_timeout(&server, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let q = dns_query_message(0x4343, name, qtype);
    let mut msg = (q.len() as u16).to_be_bytes().to_vec();
    msg.extend_from_slice(&q);
    s.write_all(&msg)?;
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
    s.read_exact(&mut buf)?;
    let (_, rcode, addrs) = parse_dns_response(&buf).ok_or_else(|| std::io::Error::other("unparsable DNS response"))?;
    Ok((rcode, addrs))
}

// ---------------------------------------------------------------------------------------
// The lab
// ---------------------------------------------------------------------------------------

/// HOST + OUTSIDE, the uplink between them, and OUTSIDE's servers. Drop tears it all down.
pub struct Lab {
    /// Stops every server thread; set first on drop.
    stop: Arc<AtomicBool>,
    threads: Threads,
    /// The lab's DNS server (198.51.100.53:53, UDP and TCP).
    pub dns: Arc<Dns>,
    /// Declared last: the namespaces go after the threads have stopped.
    pub host: Netns,
    pub outside: Netns,
}

impl Lab {
    /// Build the topology and start the DNS server (no TCP servers yet: see [`Lab::banner`]).
    pub fn new() -> Lab {
        let base = format!("osvt-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::SeqCst));
        // Each Netns is a drop guard from the moment it exists: a failure below removes both.
        let host = Netns::new(&base, "h");
        let outside = Netns::new(&base, "o");
        let lab = Lab {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Arc::new(Mutex::new(Vec::new())),
            dns: Arc::new(Dns::with_default_zone()),
            host,
            outside,
        };
        let (h, o) = (&lab.host, &lab.outside);
        h.ip(&["link", "add", HOST_IF, "type", "veth", "peer", "name", OUTSIDE_IF, "netns", &o.name]);
        h.ip(&["addr", "add", &format!("{HOST_V4}/24"), "dev", HOST_IF]);
        h.ip(&["-6", "addr", "add", &format!("{HOST_V6}/64"), "dev", HOST_IF, "nodad"]);
        h.ip(&["link", "set", HOST_IF, "up"]);
        o.ip(&["addr", "add", &format!("{GW_V4}/24"), "dev", OUTSIDE_IF]);
        o.ip(&["-6", "addr", "add", &format!("{GW_V6}/64"), "dev", OUTSIDE_IF, "nodad"]);
        o.ip(&["link", "set", OUTSIDE_IF, "up"]);
        for a in SERVERS_V4 {
            o.ip(&["addr", "add", &format!("{a}/32"), "dev", "lo"]);
        }
        for a in SERVERS_V6 {
            o.ip(&["-6", "addr", "add", &format!("{a}/128"), "dev", "lo", "nodad"]);
        }
        h.ip(&["route", "add", "default", "via", GW_V4, "dev", HOST_IF]);
        h.ip(&["-6", "route", "add", "default", "via", GW_V6, "dev", HOST_IF]);
        sysctl_in(&h.name, "net.ipv4.ip_forward", "1");
        sysctl_in(&h.name, "net.ipv6.conf.all.forwarding", "1");
        sysctl_in(&h.name, "net.ipv6.conf.default.forwarding", "1");
        lab.start_dns();
        lab
    }

    fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) {
        let h = std::thread::Builder::new().name(name.into()).spawn(f).expect("spawn lab thread");
        self.threads.lock().unwrap().push(h);
    }

    /// A TCP listener bound to `addr` inside OUTSIDE.
    fn listen(&self, addr: &str) -> (TcpListener, SocketAddr) {
        let sa: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("bad server address {addr}: {e}"));
        let l = self.outside.run(|| TcpListener::bind(sa)).unwrap_or_else(|e| panic!("bind {sa} in OUTSIDE: {e}"));
        (l, sa)
    }

    /// A server at `addr` ("198.51.100.10:80", "[2001:db8:2::10]:80") that writes
    /// `hello <addr>\n` to each connection and closes it.
    pub fn banner(&self, addr: &str) -> Arc<ServerStats> {
        let (l, sa) = self.listen(addr);
        let stats = Arc::new(ServerStats::default());
        let (st, stop) = (stats.clone(), self.stop.clone());
        let text = banner_text(&sa);
        self.spawn(&format!("banner {sa}"), move || {
            accept_loop(l, stop, |mut s, peer| {
                st.accepted.fetch_add(1, Ordering::SeqCst);
                st.peers.lock().unwrap().push(peer);
                let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                let _ = s.write_all(text.as_bytes());
                let _ = s.shutdown(std::net::Shutdown::Write);
                // Drain briefly so the close is a FIN, not an RST over unread data.
                let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
                let mut sink = [0u8; 512];
                let _ = s.read(&mut sink);
            })
        });
        stats
    }

    /// Banner servers on every address in `addrs`.
    pub fn banners(&self, addrs: &[&str]) -> Vec<Arc<ServerStats>> {
        addrs.iter().map(|a| self.banner(a)).collect()
    }

    /// A server at `addr` that sends bytes as fast as it can to each connection until the
    /// peer goes away (at most `max_seconds`).
    pub fn source(&self, addr: &str, max_seconds: u64) -> Arc<ServerStats> {
        let (l, sa) = self.listen(addr);
        let stats = Arc::new(ServerStats::default());
        let (st, stop, threads) = (stats.clone(), self.stop.clone(), self.threads.clone());
        self.spawn(&format!("source {sa}"), move || {
            accept_loop(l, stop.clone(), |mut s, peer| {
                st.accepted.fetch_add(1, Ordering::SeqCst);
                st.peers.lock().unwrap().push(peer);
                let (st, stop) = (st.clone(), stop.clone());
                let h = std::thread::spawn(move || {
                    let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                    let chunk = vec![0x5Au8; 64 * 1024];
                    let end = Instant::now() + Duration::from_secs(max_seconds);
                    while !stop.load(Ordering::SeqCst) && Instant::now() < end {
                        match s.write(&chunk) {
                            Ok(0) => break,
                            Ok(n) => {
                                st.bytes.fetch_add(n as u64, Ordering::SeqCst);
                            }
                            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                            Err(_) => break,
                        }
                    }
                });
                threads.lock().unwrap().push(h);
            })
        });
        stats
    }

    /// A server at `addr` that reads and counts everything sent to it.
    pub fn sink(&self, addr: &str) -> Arc<ServerStats> {
        let (l, sa) = self.listen(addr);
        let stats = Arc::new(ServerStats::default());
        let (st, stop, threads) = (stats.clone(), self.stop.clone(), self.threads.clone());
        self.spawn(&format!("sink {sa}"), move || {
            accept_loop(l, stop.clone(), |mut s, peer| {
                st.accepted.fetch_add(1, Ordering::SeqCst);
                st.peers.lock().unwrap().push(peer);
                let (st, stop) = (st.clone(), stop.clone());
                let h = std::thread::spawn(move || {
                    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
                    let mut buf = vec![0u8; 64 * 1024];
                    while !stop.load(Ordering::SeqCst) {
                        match s.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => {
                                st.bytes.fetch_add(n as u64, Ordering::SeqCst);
                            }
                            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                            Err(_) => break,
                        }
                    }
                });
                threads.lock().unwrap().push(h);
            })
        });
        stats
    }

    /// An upstream HTTP proxy at `addr`: a `CONNECT` is answered 200 and its tunnel echoes
    /// what it receives — one to a host `refused.*` is answered 403 quoting the request, and
    /// its connection read on; a plain request is answered 200 with `proxied <request line>`
    /// (to a path `/echo-headers`: the request head), its connection read on for a moment to
    /// see what else arrives. Every byte each connection
    /// brought is kept, in order of arrival.
    pub fn proxy(&self, addr: &str) -> Arc<Mutex<Vec<Vec<u8>>>> {
        let (l, sa) = self.listen(addr);
        let seen: Arc<Mutex<Vec<Vec<u8>>>> = Arc::new(Mutex::new(Vec::new()));
        let (log, stop, threads) = (seen.clone(), self.stop.clone(), self.threads.clone());
        self.spawn(&format!("proxy {sa}"), move || {
            accept_loop(l, stop, |mut s, _peer| {
                let log = log.clone();
                let h = std::thread::spawn(move || {
                    let index = {
                        let mut all = log.lock().unwrap();
                        all.push(Vec::new());
                        all.len() - 1
                    };
                    let keep = |b: &[u8]| log.lock().unwrap()[index].extend_from_slice(b);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf) {
                            Ok(n) if n > 0 => {
                                keep(&buf[..n]);
                                head.extend_from_slice(&buf[..n]);
                            }
                            _ => return,
                        }
                    }
                    // After an answer: what else arrives within `ms`, kept.
                    let read_on = |s: &mut TcpStream, buf: &mut [u8], ms: u64| {
                        let _ = s.set_read_timeout(Some(Duration::from_millis(ms)));
                        while let Ok(n) = s.read(buf) {
                            if n == 0 {
                                break;
                            }
                            keep(&buf[..n]);
                        }
                    };
                    let text = String::from_utf8_lossy(&head).to_string();
                    let line = text.split("\r\n").next().unwrap_or_default().to_string();
                    if line.starts_with("CONNECT refused.") {
                        // A refusal quoting the request, the connection kept open after it.
                        let reply = format!("HTTP/1.1 403 Forbidden\r\nContent-Length: {}\r\n\r\n{text}", text.len());
                        let _ = s.write_all(reply.as_bytes());
                        read_on(&mut s, &mut buf, 500);
                    } else if line.starts_with("CONNECT ") {
                        let _ = s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n");
                        loop {
                            match s.read(&mut buf) {
                                Ok(n) if n > 0 => {
                                    keep(&buf[..n]);
                                    let _ = s.write_all(&buf[..n]);
                                }
                                _ => break,
                            }
                        }
                    } else {
                        // `/echo-headers`: the request head quoted back, as a proxy's page can.
                        let body =
                            if line.contains("/echo-headers") { text.clone() } else { format!("proxied {line}") };
                        let reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
                        let _ = s.write_all(reply.as_bytes());
                        read_on(&mut s, &mut buf, 300);
                    }
                    let _ = s.shutdown(std::net::Shutdown::Both);
                });
                threads.lock().unwrap().push(h);
            })
        });
        seen
    }

    fn start_dns(&self) {
        let sa: SocketAddr = DNS_SERVER.parse().unwrap();
        let udp = self.outside.run(|| UdpSocket::bind(sa)).unwrap_or_else(|e| panic!("bind udp {sa}: {e}"));
        udp.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let (dns, stop) = (self.dns.clone(), self.stop.clone());
        self.spawn("dns udp", move || {
            let mut buf = [0u8; 4096];
            while !stop.load(Ordering::SeqCst) {
                let Ok((n, peer)) = udp.recv_from(&mut buf) else { continue };
                if let Some(r) = dns.answer(&buf[..n]) {
                    let _ = udp.send_to(&truncate_for_udp(r, &buf[..n]), peer);
                }
            }
        });
        let (tcp, _) = self.listen(DNS_SERVER);
        let (dns, stop) = (self.dns.clone(), self.stop.clone());
        self.spawn("dns tcp", move || {
            accept_loop(tcp, stop, |mut s, _peer| {
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                loop {
                    let mut len = [0u8; 2];
                    if s.read_exact(&mut len).is_err() {
                        break;
                    }
                    let mut q = vec![0u8; u16::from_be_bytes(len) as usize];
                    if s.read_exact(&mut q).is_err() {
                        break;
                    }
                    let Some(r) = dns.answer(&q) else { break };
                    let mut msg = (r.len() as u16).to_be_bytes().to_vec();
                    msg.extend_from_slice(&r);
                    if s.write_all(&msg).is_err() {
                        break;
                    }
                }
            })
        });
    }

    /// Run `f` on a thread inside HOST (the agent's host view of the network).
    pub fn in_host<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        self.host.run(f)
    }

    /// A command that runs inside HOST (see [`command_in`]).
    pub fn host_command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = self.host.command(program);
        // For `opservant` (see `common::test_config`); nothing else reads it.
        cmd.env("OPSERVANT_CONFIG", super::test_config());
        cmd
    }

    /// Everything left in HOST that the lab did not put there: interfaces other than `lo`
    /// and the uplink, addresses/routes from the given prefixes, nft tables, processes.
    /// Empty when HOST is as the lab built it.
    pub fn host_leftovers(&self, prefixes: &[&str]) -> Vec<String> {
        let mut left = Vec::new();
        for l in self.host.links() {
            if l != "lo" && l != HOST_IF {
                left.push(format!("interface {l}"));
            }
        }
        let addrs = self.host.ip(&["-o", "addr", "show"]);
        let routes4 = self.host.ip(&["-4", "route", "show", "table", "all"]);
        let routes6 = self.host.ip(&["-6", "route", "show", "table", "all"]);
        let rules = self.host.ip(&["rule", "show"]) + &self.host.ip(&["-6", "rule", "show"]);
        let neigh = self.host.ip(&["neigh", "show"]) + &self.host.ip(&["-6", "neigh", "show"]);
        for (what, text) in
            [("address", &addrs), ("route", &routes4), ("route", &routes6), ("rule", &rules), ("neighbour", &neigh)]
        {
            for line in text.lines() {
                if prefixes.iter().any(|p| line.contains(p)) {
                    left.push(format!("{what}: {}", line.trim()));
                }
            }
        }
        for t in self.host.nft_tables() {
            left.push(format!("nft {t}"));
        }
        for pid in self.host.processes() {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if pid as u32 == std::process::id() {
                left.push(format!("a thread of the test process ({pid}) is still in HOST"));
            } else {
                left.push(format!("process {pid} in HOST: {cmd}"));
            }
        }
        left
    }
}

impl Default for Lab {
    fn default() -> Self {
        Lab::new()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Per-connection threads are added while servers run: join until none are left.
        loop {
            let batch: Vec<JoinHandle<()>> = std::mem::take(&mut *self.threads.lock().unwrap());
            if batch.is_empty() {
                break;
            }
            for h in batch {
                let _ = h.join();
            }
        }
        // `host` and `outside` drop next (field order): `ip netns del` for both.
    }
}
