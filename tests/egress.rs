//! Network egress end to end: the real `opservant run`, as root, inside a private network
//! laboratory (tests/common/netlab.rs): opservant runs in the lab's HOST namespace, whose only
//! uplink leads to the lab's OUTSIDE namespace, where the test's own TCP and DNS servers run.
//! No packet ever leaves the namespaces the tests create; each test builds and removes its own
//! lab, so the tests can run in parallel.
//!
//! One probe executor ([`PROBE`]) does whatever its `steps` parameter lists (connect, resolve,
//! raw DNS over UDP, download, read a file, list interfaces, read the environment) and returns
//! one outcome per step; the manifests vary. Every test ends by checking that the agent left
//! nothing behind in HOST (interfaces, pool addresses and routes, nft tables, processes).
//!
//! The hostile probes at the end try to break the policy; a packet sniffer (AF_PACKET) in
//! the lab's HOST records every marker (`OSVTM<nn>X`) that crossed it, so a datagram the
//! sandbox's ruleset rejected is known never to have left. Found and fixed with them: a DNS
//! label holding a dot passed a `*.domain` wildcard (the forwarder now reads names label by
//! label), NAT64 forms of special addresses were not treated as rebinding, and a run killed
//! with SIGKILL left the host table until the next run (its collector starts with the table).

mod common;

use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::netlab::{self, Lab, DNS_SERVER, HOST_V4, HOST_V6};
use common::{require_root, HostDir};
use serde_json::{json, Value};

/// The agent's default address pools (agent config `network.egress.pool_v4`/`pool_v6`).
const POOL_PREFIXES: [&str; 2] = ["10.213.", "fd6f:7073:7276:"];

/// A blocked connection must be rejected well under this (never left to time out).
const FAST_FAIL_MS: f64 = 1000.0;

/// Root, `ip` and `nft`: skip visibly without them, fail under CI.
fn prerequisites() -> bool {
    require_root() && netlab::require_lab_tools()
}

// ---------------------------------------------------------------------------------------
// Running opservant inside the lab
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
struct Out {
    pid: u32,
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    /// The result JSON (the whole of stdout, one line); panics with everything otherwise.
    fn json(&self) -> Value {
        let text = self.stdout.trim_end_matches('\n');
        assert!(!text.is_empty() && !text.contains('\n'), "stdout must be exactly one JSON line: {self:#?}");
        serde_json::from_str(text).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"))
    }

    /// Ran to a result: exit status 0 exactly when the status is "completed".
    fn result(&self) -> Value {
        let j = self.json();
        let want = if j["status"] == "completed" { 0 } else { 1 };
        assert_eq!(self.code, want, "exit status for status {}: {}\nstderr: {}", j["status"], j, self.stderr);
        j
    }

    /// A completed run's result.
    fn completed(&self) -> Value {
        let r = self.result();
        assert_eq!(r["status"], "completed", "{r}\nstderr: {}", self.stderr);
        r
    }
}

/// `opservant ARGS…` started inside the lab's HOST namespace (setns before exec, nothing
/// else changes); killed and reported if it has not finished after three minutes.
fn opservant_in(lab: &Lab, args: &[&std::ffi::OsStr]) -> Out {
    let _view = common::host_view();
    let mut child = lab
        .host_command(common::opservant())
        .args(args)
        .env_remove("OPSERVANT_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn opservant in HOST");
    let pid = child.id();
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut so, &mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut se, &mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait opservant") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let (o, e) = (t_out.join().unwrap_or_default(), t_err.join().unwrap_or_default());
            panic!("opservant (pid {pid}) still running after 180 s; killed.\nstdout: {o}\nstderr: {e}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Out {
        pid,
        code: status.code().unwrap_or(-1),
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    }
}

/// `opservant run DIR ARGS…` inside HOST, launched as `OPSERVANT_TEST_LAUNCH` says (through
/// a zygote, a run with egress is wired into a network namespace the zygote prepared).
fn run_in(lab: &Lab, dir: &Path, args: &[&str]) -> Out {
    let launch = common::launch_args();
    let mut all: Vec<&std::ffi::OsStr> = vec!["run".as_ref(), dir.as_os_str()];
    all.extend(launch.iter().map(std::ffi::OsStr::new));
    all.extend(args.iter().map(|a| std::ffi::OsStr::new(*a)));
    let out = opservant_in(lab, &all);
    if let Ok(r) = serde_json::from_str::<Value>(out.stdout.lines().last().unwrap_or_default()) {
        common::assert_launch(&r);
    }
    out
}

/// Write `rel` below `root` readable by everyone (the sandbox runs as an unprivileged uid).
fn put(root: &Path, rel: &str, content: &[u8]) -> PathBuf {
    let p = root.join(rel);
    let parent = p.parent().expect("parent");
    std::fs::create_dir_all(parent).expect("mkdir");
    let mut d = parent;
    while d.starts_with(root) {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
        match d.parent() {
            Some(up) => d = up,
            None => break,
        }
    }
    std::fs::write(&p, content).expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod file");
    p
}

/// An agent config file (in a host directory the sandbox cannot see) pointing the egress
/// DNS forwarder at the lab's DNS server; `extra` is YAML indented under `network:`.
struct Conf {
    _dir: HostDir,
    path: PathBuf,
}

impl Conf {
    fn new(extra_network: &str) -> Conf {
        Self::with_upstream(DNS_SERVER, extra_network)
    }

    /// As [`Conf::new`], with another upstream resolver.
    fn with_upstream(upstream: &str, extra_network: &str) -> Conf {
        let dir = HostDir::new();
        // The tests' audit log unless the test names one.
        let audit = if extra_network.lines().any(|l| l.starts_with("audit:")) {
            String::new()
        } else {
            common::audit_section()
        };
        let text = format!("{audit}network:\n  egress:\n    dns_upstream: [\"{upstream}\"]\n{extra_network}");
        let path = dir.path.join("config.yaml");
        std::fs::write(&path, text).expect("write config");
        Conf { _dir: dir, path }
    }

    fn arg(&self) -> &str {
        self.path.to_str().expect("utf-8")
    }
}

/// The probe executor: `params["steps"]` is a list of `[op, args…]`; the output is
/// `{"steps": [outcome…], "network": context["network"]}`. Every failing outcome is
/// `{"ok": false, "error": class name, "errno": …, "msg": …, "ms": elapsed}`.
///
/// - `["connect", host, port, timeout?]`: `socket.create_connection`, then read to EOF:
///   `{"ok": true, "banner", "peer", "local", "ms"}` (ms = connect time)
/// - `["connect_gw", port]`: the same to the default gateway (from /proc/net/route)
/// - `["resolve", name]`: `socket.getaddrinfo`: `{"ok": true, "addrs": [...]}`
/// - `["udp_dns", server, port, name, timeout]`: one raw A query: `{"ok": true, "rcode", "answers"}`
/// - `["download", host, port, seconds]`: bytes received in `seconds` from the first byte on
/// - `["read", path]`: `{"ok": true, "text"}`
/// - `["ifaces"]`: `{"ok": true, "if_nameindex": [...], "proc_net_dev": [...]}`
/// - `["netlink", PROTOCOL]`: `{"ok": true}` when a netlink socket of it opens, else `{"ok": false, "errno": N}`
/// - `["env", [names]]`: `{"ok": true, "env": {name: value or null}}`
/// - `["env_password", name]`: the password of the URL in `name`, percent-decoded: `{"ok": true, "password"}`
/// - `["proxy", env_name, request, tunnel?]`: `request` to the proxy the variable names; with
///   `tunnel` and a 200, those bytes through and back: `{"ok": true, "status", "head", "body", "stars", "echo"}`
/// - hostile probes (tests at the end): `udp`, `udp_gw`, `udp_gw6`, `sock`, `ping`,
///   `dns_raw`, `multi_download`, `sleep`, `dns_tcp_abuse`, `hold`, `flow` — see `_step_extra`
const PROBE: &str = r#"
import os
import socket
import struct
import time

from opservant.executor import BaseExecutor, ExecutorResult


def _ms(t0):
    return round((time.monotonic() - t0) * 1000, 1)


def _fail(e, t0, **extra):
    r = {"ok": False, "error": type(e).__name__, "errno": getattr(e, "errno", None), "msg": str(e), "ms": _ms(t0)}
    r.update(extra)
    return r


def _connect(host, port, timeout=3):
    t0 = time.monotonic()
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except Exception as e:
        return _fail(e, t0)
    ms = _ms(t0)
    try:
        peer, local = s.getpeername()[0], s.getsockname()[0]
        data = b""
        while len(data) < 4096:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return {"ok": True, "banner": data.decode("utf-8", "replace"), "peer": peer, "local": local, "ms": ms}
    except Exception as e:
        return _fail(e, t0, connected=True)
    finally:
        s.close()


def _gateway():
    with open("/proc/net/route") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if fields[1] == "00000000" and int(fields[3], 16) & 2:
                return socket.inet_ntoa(struct.pack("<I", int(fields[2], 16)))
    raise OSError("no default gateway in /proc/net/route")


def _resolve(name):
    t0 = time.monotonic()
    try:
        infos = socket.getaddrinfo(name, None, 0, socket.SOCK_STREAM)
    except Exception as e:
        return _fail(e, t0)
    addrs = []
    for info in infos:
        if info[4][0] not in addrs:
            addrs.append(info[4][0])
    return {"ok": True, "addrs": addrs, "ms": _ms(t0)}


def _udp_dns(server, port, name, timeout):
    t0 = time.monotonic()
    q = struct.pack(">HHHHHH", 0x5151, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    q += b"\x00" + struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET6 if ":" in server else socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.connect((server, port))
        s.send(q)
        data = s.recv(4096)
        return {"ok": True, "rcode": data[3] & 0x0F, "answers": struct.unpack(">H", data[6:8])[0], "ms": _ms(t0)}
    except Exception as e:
        return _fail(e, t0)
    finally:
        s.close()


def _tcp_dns(name):
    """A DNS query over TCP to the sandbox's resolver (the gateway)."""
    t0 = time.monotonic()
    q = struct.pack(">HHHHHH", 0x5252, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    q += b"\x00" + struct.pack(">HH", 1, 1)
    try:
        s = socket.create_connection((_gateway(), 53), timeout=3)
    except Exception as e:
        return _fail(e, t0)
    try:
        s.sendall(struct.pack(">H", len(q)) + q)
        data = b""
        while len(data) < 2 or len(data) < 2 + struct.unpack(">H", data[:2])[0]:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        msg = data[2:]
        return {"ok": True, "rcode": msg[3] & 0x0F, "answers": struct.unpack(">H", msg[6:8])[0], "ms": _ms(t0)}
    except Exception as e:
        return _fail(e, t0)
    finally:
        s.close()


def _download(host, port, seconds):
    t0 = time.monotonic()
    try:
        s = socket.create_connection((host, port), timeout=3)
    except Exception as e:
        return _fail(e, t0)
    try:
        # The first data may wait: behind a shaped link shared by several flows a flow's
        # first segments can be dropped a few times in a row (TCP's retransmission timer
        # doubles from 1 s), and a busy machine is slow to start the source's side.
        s.settimeout(20)
        first = len(s.recv(65536))
        start = time.monotonic()
        end = start + seconds
        total, halves = 0, [0, 0]
        while True:
            now = time.monotonic()
            if now >= end:
                break
            s.settimeout(max(end - now, 0.01))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            total += len(chunk)
            halves[0 if now - start < seconds / 2 else 1] += len(chunk)
        elapsed = time.monotonic() - start
        # Everything received since the connection began, and when that was: a flow whose
        # thread starts late finds data queued since then in its socket buffer.
        return {"ok": True, "bytes": total, "seconds": elapsed, "bytes_per_second": total / elapsed,
                "halves_bytes": halves, "since_connect_bytes": first + total, "connected_at": t0,
                "ended_at": time.monotonic()}
    except Exception as e:
        return _fail(e, t0, connected=True)
    finally:
        s.close()


def _marker(n):
    return ("OSVTM%02dX" % n).encode()


def _udp(host, port, mark, opts=None):
    """One datagram carrying marker `mark` (the test sniffs HOST for it)."""
    opts = opts or {}
    t0 = time.monotonic()
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        s = socket.socket(fam, socket.SOCK_DGRAM, opts.get("proto", 0))
    except Exception as e:
        return _fail(e, t0, stage="socket")
    try:
        s.settimeout(opts.get("timeout", 0.3))
        if opts.get("broadcast"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        if opts.get("ttl"):
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, opts["ttl"])
        if opts.get("mcast_ttl"):
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, opts["mcast_ttl"])
        if opts.get("ip_options"):
            s.setsockopt(socket.IPPROTO_IP, socket.IP_OPTIONS, bytes(opts["ip_options"]))
        if opts.get("rthdr"):
            # IPV6_RTHDR (57): a type 4 segment routing header with these segments (the last
            # is the first hop), which an unprivileged socket may set.
            segs = opts["rthdr"]
            n = len(segs)
            srh = struct.pack("BBBBBBH", 0, 2 * n, 4, n - 1, n - 1, 0, 0)
            srh += b"".join(socket.inet_pton(socket.AF_INET6, a) for a in segs)
            s.setsockopt(socket.IPPROTO_IPV6, 57, srh)
        if opts.get("bind"):
            # IP_FREEBIND (15) / IPV6_FREEBIND (78): bind a foreign address, no privilege needed.
            if fam == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, 78, 1)
            else:
                s.setsockopt(socket.IPPROTO_IP, 15, 1)
            bind = opts["bind"]
            if bind == "neighbour-slot":
                # The same address in the next /30 of the pool: another sandbox's.
                own = struct.unpack(">I", socket.inet_aton(_own_address()))[0]
                bind = socket.inet_ntoa(struct.pack(">I", own ^ 4))
            s.bind((bind, 0))
        if fam == socket.AF_INET6 and "%" in host:
            addr = socket.getaddrinfo(host, port, fam, socket.SOCK_DGRAM)[0][4]
        else:
            addr = (host, port)
        s.sendto(_marker(mark) + b" hostile probe", addr)
        try:
            data = s.recv(4096)
            return {"ok": True, "sent": True, "reply": data.decode("utf-8", "replace"), "ms": _ms(t0)}
        except socket.timeout:
            return {"ok": True, "sent": True, "reply": None, "ms": _ms(t0)}
        except Exception as e:
            return _fail(e, t0, sent=True)
    except Exception as e:
        return _fail(e, t0)
    finally:
        s.close()


def _sock(family, type_, proto):
    t0 = time.monotonic()
    try:
        s = socket.socket(family, type_, proto)
        s.close()
        return {"ok": True, "ms": _ms(t0)}
    except Exception as e:
        return _fail(e, t0)


def _ping(host, mark):
    """An ICMP echo through an unprivileged ping socket, if the kernel lets us have one."""
    t0 = time.monotonic()
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    except Exception as e:
        return _fail(e, t0, stage="socket")
    try:
        s.settimeout(0.5)
        s.sendto(struct.pack(">BBHHH", 8, 0, 0, 0x4242, 1) + _marker(mark), (host, 0))
        data = s.recv(4096)
        return {"ok": True, "reply": len(data), "ms": _ms(t0)}
    except Exception as e:
        return _fail(e, t0, stage="send")
    finally:
        s.close()


def _gateway6():
    with open("/proc/net/ipv6_route") as f:
        for line in f.read().split("\n"):
            p = line.split()
            if len(p) >= 10 and p[0] == "0" * 32 and p[1] == "00" and p[4] != "0" * 32:
                h = p[4]
                a = ":".join(h[i:i + 4] for i in range(0, 32, 4))
                return a + "%" + p[9] if h.startswith("fe8") else a
    raise OSError("no IPv6 default gateway")


def _own_address():
    import fcntl
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ifr = struct.pack("256s", b"eth0")
    addr = fcntl.ioctl(s.fileno(), 0x8915, ifr)[20:24]  # SIOCGIFADDR
    s.close()
    return socket.inet_ntoa(addr)


def _own_broadcast():
    a = struct.unpack(">I", socket.inet_aton(_own_address()))[0] | 3
    return socket.inet_ntoa(struct.pack(">I", a))


def _skip_name(msg, at):
    while msg[at] != 0:
        if msg[at] & 0xC0 == 0xC0:
            return at + 2
        at += 1 + msg[at]
    return at + 1


def _answer_ttls(msg):
    """The TTL of every record in a reply's answer section."""
    questions, answers = struct.unpack(">HH", msg[4:8])
    at = 12
    for _ in range(questions):
        at = _skip_name(msg, at) + 4
    ttls = []
    for _ in range(answers):
        at = _skip_name(msg, at)
        ttl, length = struct.unpack(">IH", msg[at + 4:at + 10])
        ttls.append(ttl)
        at += 10 + length
    return ttls


def _dns_raw(proto, labels, qtype, qid=0x6161):
    """A query for the wire name `labels` (each label verbatim, dots and all) to the gateway."""
    t0 = time.monotonic()
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in labels:
        b = label.encode()
        q += bytes([len(b)]) + b
    q += b"\x00" + struct.pack(">HH", qtype, 1)
    try:
        gw = _gateway()
        if proto == "udp":
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(4)
            s.connect((gw, 53))
            s.send(q)
            msg = s.recv(4096)
        else:
            s = socket.create_connection((gw, 53), timeout=4)
            s.sendall(struct.pack(">H", len(q)) + q)
            data = b""
            while len(data) < 2 or len(data) < 2 + struct.unpack(">H", data[:2])[0]:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            msg = data[2:]
        s.close()
        return {"ok": True, "rcode": msg[3] & 0x0F, "answers": struct.unpack(">H", msg[6:8])[0],
                "id": struct.unpack(">H", msg[0:2])[0], "ttls": _answer_ttls(msg), "ms": _ms(t0)}
    except Exception as e:
        return _fail(e, t0)


def _dns_tcp_abuse(mode, name):
    """A DNS-over-TCP client that misbehaves towards the sandbox's resolver (the gateway):
    `silent` connects and sends nothing; `trickle` sends one query a byte every half second;
    `flood` sends 17 queries at once. Reports whether the resolver closed the connection
    (end of file or reset), what it answered, and how much of the trickled query it took."""
    t0 = time.monotonic()
    q = struct.pack(">HHHHHH", 0x5353, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    q += b"\x00" + struct.pack(">HH", 1, 1)
    framed = struct.pack(">H", len(q)) + q
    try:
        s = socket.create_connection((_gateway(), 53), timeout=3)
    except Exception as e:
        return _fail(e, t0)
    closed, sent, answers, data = False, 0, 0, b""
    try:
        if mode == "trickle":
            import select
            s.sendall(framed[:2])
            for b in framed[2:]:
                r, _, _ = select.select([s], [], [], 0.5)
                if r:
                    if not s.recv(4096):
                        closed = True
                        break
                s.sendall(bytes([b]))
                sent += 1
            else:
                # Every byte went out: wait for the answer, or for the close.
                s.settimeout(15)
                closed = not s.recv(4096)
        else:
            if mode == "flood":
                s.sendall(framed * 17)
            s.settimeout(15)
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    closed = True
                    break
                data += chunk
                while len(data) >= 2 and len(data) >= 2 + struct.unpack(">H", data[:2])[0]:
                    answers += 1
                    data = data[2 + struct.unpack(">H", data[:2])[0]:]
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    except Exception as e:
        return _fail(e, t0, sent=sent, answers=answers)
    finally:
        s.close()
    return {"ok": True, "closed": closed, "sent": sent, "of": len(q), "answers": answers, "ms": _ms(t0)}


def _multi_download(host, port, n, seconds):
    import threading
    res = [None] * n
    def one(i):
        res[i] = _download(host, port, seconds)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ok = all(r and r.get("ok") for r in res)
    if not ok:
        return {"ok": False, "flows": res}
    # Every byte received crossed the shaper after the first connection began and before the
    # last flow ended: over that window the total is bounded by the rate (plus its burst).
    total = sum(r["since_connect_bytes"] for r in res)
    window = max(r["ended_at"] for r in res) - min(r["connected_at"] for r in res)
    return {"ok": True, "bytes": total, "bytes_per_second": total / window, "window_s": window, "flows": res}


def _hold(host, port, n, udp_ports):
    """`n` TCP connections to host:port held open at once, then closed; then one datagram
    to each of `udp_ports` (each a flow of its own). Outcomes are errno names or "ok"."""
    import errno as _errno
    held, tcp = [], []
    for _ in range(n):
        try:
            held.append(socket.create_connection((host, port), timeout=3))
            tcp.append("ok")
        except OSError as e:
            tcp.append(_errno.errorcode.get(e.errno, str(e)))
    for s in held:
        s.close()
    time.sleep(0.5)
    udp = []
    for p in udp_ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.sendto(b"x", (host, p))
            udp.append("ok")
        except OSError as e:
            udp.append(_errno.errorcode.get(e.errno, str(e)))
        finally:
            s.close()
    return {"ok": True, "tcp": tcp, "udp": udp}


def _flow(host, port, n):
    """`n` datagrams of one flow (one socket, one destination) no reply comes back to."""
    import errno as _errno
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    out = []
    for _ in range(n):
        try:
            s.sendto(b"x", (host, port))
            out.append("ok")
        except OSError as e:
            out.append(_errno.errorcode.get(e.errno, str(e)))
    s.close()
    return {"ok": True, "sent": out.count("ok"), "errors": sorted(set(o for o in out if o != "ok"))}


def _to(find_host, send, *args):
    """`send(host, *args)` to the host `find_host()` names, recorded as `host`."""
    t0 = time.monotonic()
    try:
        host = find_host()
    except Exception as e:
        return _fail(e, t0)
    r = send(host, *args)
    r["host"] = host
    return r


def _step_extra(op, args):
    if op == "udp":
        return _udp(*args)
    if op == "udp_gw":
        return _to(_gateway, _udp, *args)
    if op == "udp_gw6":
        return _to(_gateway6, _udp, *args)
    if op == "udp_bcast_own":
        return _to(_own_broadcast, _udp, args[0], args[1], {"broadcast": True})
    if op == "socket":
        return _sock(*args)
    if op == "ping":
        return _ping(*args)
    if op == "dns_raw":
        return _dns_raw(*args)
    if op == "multi_download":
        return _multi_download(*args)
    if op == "dns_tcp_abuse":
        return _dns_tcp_abuse(*args)
    if op == "sleep":
        time.sleep(args[0])
        return {"ok": True}
    if op == "hold":
        return _hold(*args)
    if op == "flow":
        return _flow(*args)
    return None


def _proxy(env_name, request, tunnel=None):
    """`request` (text) to the proxy `env_name` names; with `tunnel` and a 200, those bytes
    through the tunnel and as many read back; then everything to the end."""
    import urllib.parse
    t0 = time.monotonic()
    url = urllib.parse.urlsplit(os.environ.get(env_name, ""))
    try:
        s = socket.create_connection((url.hostname, url.port), timeout=5)
    except Exception as e:
        return _fail(e, t0, url=os.environ.get(env_name))
    try:
        s.sendall(request.encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        head = head.decode("utf-8", "replace")
        status = int(head.split(" ")[1]) if head.startswith("HTTP/") else None
        echo = None
        if tunnel is not None and status == 200:
            s.sendall(tunnel.encode())
            got = body
            while len(got) < len(tunnel):
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            echo, body = got.decode("utf-8", "replace"), b""
            s.shutdown(socket.SHUT_WR)
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            body += chunk
        return {"ok": True, "status": status, "head": head, "body": body.decode("utf-8", "replace"),
                "stars": body.count(b"*"), "echo": echo, "ms": _ms(t0)}
    except Exception as e:
        return _fail(e, t0)
    finally:
        s.close()


def _step(step):
    op, args = step[0], step[1:]
    t0 = time.monotonic()
    extra = _step_extra(op, args)
    if extra is not None:
        return extra
    if op == "connect":
        return _connect(*args)
    if op == "connect_gw":
        return _to(_gateway, _connect, *args)
    if op == "resolve":
        return _resolve(*args)
    if op == "udp_dns":
        return _udp_dns(*args)
    if op == "tcp_dns":
        return _tcp_dns(*args)
    if op == "download":
        return _download(*args)
    if op == "read":
        try:
            with open(args[0]) as f:
                return {"ok": True, "text": f.read()}
        except Exception as e:
            return _fail(e, t0)
    if op == "netlink":
        try:
            socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, args[0]).close()
            return {"ok": True}
        except OSError as e:
            return {"ok": False, "errno": e.errno}
    if op == "ifaces":
        try:
            names = [n for _, n in socket.if_nameindex()]
        except Exception as e:
            names = [repr(e)]
        try:
            with open("/proc/net/dev") as f:
                dev = [l.split(":")[0].strip() for l in f.read().splitlines()[2:]]
        except Exception as e:
            dev = [repr(e)]
        return {"ok": True, "if_nameindex": names, "proc_net_dev": dev}
    if op == "env":
        return {"ok": True, "env": {k: os.environ.get(k) for k in args[0]}}
    if op == "proxy":
        return _proxy(*args)
    if op == "env_password":
        import urllib.parse
        password = urllib.parse.urlsplit(os.environ.get(args[0], "")).password
        return {"ok": True, "password": urllib.parse.unquote(password) if password else None}
    return {"ok": False, "error": "unknown op " + repr(op)}


class TestExecutor(BaseExecutor):
    name = "egress-probe"
    version = "1.0.0"

    def validate(self, params):
        return True

    def execute(self, params, context):
        if "resolve_secret" in params:
            # The secret's value queried as a DNS label, below `suffix`.
            name, suffix = params["resolve_secret"]
            r = _step(["resolve", context["vault"].get_secret(name) + "." + suffix])
            return ExecutorResult(status="completed", output={"resolved": r["ok"]})
        out = [_step(s) for s in params.get("steps", [])]
        return ExecutorResult(status="completed", output={"steps": out, "network": context["network"]})
"#;

/// A probe package whose manifest has these `permissions.network` and `resource_limits`.
fn probe_package(network: &Value, limits: &Value) -> HostDir {
    let d = HostDir::new();
    let m = json!({
        "name": "egress-probe",
        "version": "1.0.0",
        "description": "egress integration test probe",
        "author": "tests",
        "supported_actions": ["act-test"],
        "entry_point": "test_executor.TestExecutor",
        "requirements": {"python": ">=3.9", "packages": []},
        "permissions": {"network": network},
        "resource_limits": limits,
    });
    put(&d.path, "manifest.json", m.to_string().as_bytes());
    put(&d.path, "test_executor/__init__.py", PROBE.as_bytes());
    d
}

/// One completed probe run.
struct Probe {
    r: Value,
}

impl Probe {
    fn steps(&self) -> &Vec<Value> {
        self.r["output"]["steps"].as_array().unwrap_or_else(|| panic!("no steps in output: {}", self.r))
    }
    fn step(&self, i: usize) -> &Value {
        &self.steps()[i]
    }
    fn egress(&self) -> &Value {
        &self.r["sandbox"]["egress"]
    }
    fn blocked(&self) -> u64 {
        self.egress()["blocked"].as_u64().unwrap_or_else(|| panic!("sandbox.egress.blocked: {}", self.r["sandbox"]))
    }
}

/// Run the probe with `network` permissions, `limits`, agent config `conf`, and `steps`;
/// it must complete and report the expected `sandbox.network`.
fn probe(lab: &Lab, conf: &Conf, network: Value, limits: Value, steps: Value) -> Probe {
    let pkg = probe_package(&network, &limits);
    let params = json!({ "steps": steps }).to_string();
    let out = run_in(lab, &pkg.path, &["--config", conf.arg(), "--params", &params]);
    let r = out.completed();
    let want = if network["outbound"] == true { "egress" } else { "none" };
    assert_eq!(r["sandbox"]["network"], want, "{}", r["sandbox"]);
    let n = steps.as_array().map_or(0, Vec::len);
    assert_eq!(r["output"]["steps"].as_array().map(Vec::len), Some(n), "one outcome per step: {r}");
    if want == "egress" {
        let e = &r["sandbox"]["egress"];
        assert!(e["blocked"].is_u64(), "sandbox.egress.blocked must be a count: {}", r["sandbox"]);
        // Always an object with counts (zero when DNS is off and no forwarder runs).
        {
            assert!(e["dns"]["queries"].is_u64(), "sandbox.egress.dns.queries must be a count: {}", r["sandbox"]);
            assert!(e["dns"]["refused"].is_u64(), "sandbox.egress.dns.refused must be a count: {}", r["sandbox"]);
        }
    }
    Probe { r }
}

fn limits() -> Value {
    json!({"max_cpu_percent": 50, "timeout_seconds": 60})
}

// ---------------------------------------------------------------------------------------
// Assertions on step outcomes
// ---------------------------------------------------------------------------------------

/// The connection reached the lab server at `addr` ("198.51.100.10:80", "[2001:db8:2::10]:80").
fn assert_connected(step: &Value, addr: &str) {
    assert_eq!(step["ok"], true, "connecting to {addr} should work: {step}");
    assert_eq!(step["banner"], format!("hello {addr}\n"), "banner from {addr}: {step}");
}

/// The connection was refused by policy: an error that is not a timeout, and fast.
fn assert_blocked(step: &Value, what: &str) {
    if let Some(problem) = not_blocked(step, what) {
        panic!("{problem}");
    }
}

/// Why `step` is not a fast policy rejection, if it is not.
fn not_blocked(step: &Value, what: &str) -> Option<String> {
    if step["ok"] != false {
        return Some(format!("{what} should be blocked: {step}"));
    }
    if !step["connected"].is_null() {
        return Some(format!("{what}: the connection was established before failing: {step}"));
    }
    let err = step["error"].as_str().unwrap_or("");
    if matches!(err, "TimeoutError" | "timeout" | "gaierror") {
        return Some(format!("{what}: a blocked connection must be rejected at once (RST / ICMP), not {err}: {step}"));
    }
    let ms = step["ms"].as_f64().unwrap_or(f64::MAX);
    if ms >= FAST_FAIL_MS {
        return Some(format!("{what}: rejected after {ms} ms; blocked connections must fail fast: {step}"));
    }
    None
}

/// [`assert_blocked`] for several steps, reporting every one that is not.
fn assert_all_blocked(cases: &[(&Value, &str)]) {
    let problems: Vec<String> = cases.iter().filter_map(|(s, w)| not_blocked(s, w)).collect();
    assert!(
        problems.is_empty(),
        "{} of {} not blocked as they should be:\n{}",
        problems.len(),
        cases.len(),
        problems.join("\n")
    );
}

/// Name resolution failed (socket.gaierror: NXDOMAIN / REFUSED / no DNS).
fn assert_unresolved(step: &Value, name: &str) {
    assert_eq!(step["ok"], false, "{name} must not resolve: {step}");
    assert_eq!(step["error"], "gaierror", "{name}: {step}");
}

fn assert_resolved(step: &Value, name: &str, addrs: &[&str]) {
    assert_eq!(step["ok"], true, "{name} should resolve: {step}");
    let mut got: Vec<&str> = step["addrs"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    got.sort_unstable();
    let mut want = addrs.to_vec();
    want.sort_unstable();
    assert_eq!(got, want, "{name} resolves to: {step}");
}

/// Every connection the server saw came from HOST's uplink address (masquerade).
fn assert_masqueraded(stats: &netlab::ServerStats) {
    for ip in stats.peer_ips() {
        let s = ip.to_string();
        assert!(s == HOST_V4 || s == HOST_V6, "OUTSIDE saw source {s}; sandbox traffic must be masqueraded");
    }
}

/// How long a leftover may take to go after opservant exits: the kernel destroys a dead
/// sandbox's network namespace (and with it the host end of its veth) asynchronously, on a
/// workqueue that takes seconds when many namespaces go at once, and the host table's
/// collector looks every 2 s. Waits end as soon as HOST is clean; a real leak never is.
const SETTLE: Duration = Duration::from_secs(20);

/// What is left in HOST once it is clean or `within` has passed, whichever is first.
fn leftovers_within(lab: &Lab, within: Duration) -> Vec<String> {
    let t0 = Instant::now();
    loop {
        let left = lab.host_leftovers(&POOL_PREFIXES);
        if left.is_empty() || t0.elapsed() >= within {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The agent left nothing behind in HOST (allowing [`SETTLE`] for the kernel's asynchronous
/// namespace teardown). Returns how long it took to be clean.
fn assert_host_clean(lab: &Lab) -> Duration {
    let t0 = Instant::now();
    let mut first: Option<Vec<String>> = None;
    loop {
        let left = lab.host_leftovers(&POOL_PREFIXES);
        if left.is_empty() {
            let waited = t0.elapsed();
            if let Some(first) = first.filter(|_| waited > Duration::from_millis(100)) {
                eprintln!(
                    "note: HOST became clean only {} ms after the run ended; left at first:\n  {}",
                    waited.as_millis(),
                    first.join("\n  ")
                );
            }
            return waited;
        }
        first.get_or_insert_with(|| left.clone());
        assert!(
            t0.elapsed() < SETTLE,
            "left behind in the agent's network namespace {} s after the runs:\n{}",
            SETTLE.as_secs(),
            left.join("\n")
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Run [`PROBE`]'s `execute` directly (root, no sandbox) with the host's Python in namespace
/// `ns`, importing `opservant.executor` from the source tree: checks the probe and the
/// assertion helpers against the lab without the product.
fn run_probe_directly(ns: &netlab::Netns, steps: &Value) -> Value {
    let pkg = probe_package(&json!({}), &json!({}));
    let driver = "import json, sys\nsys.path.insert(0, sys.argv[1])\nfrom test_executor import TestExecutor\n\
                  r = TestExecutor().execute({'steps': json.loads(sys.argv[2])}, {'network': None})\n\
                  print(json.dumps(r.output))\n";
    let pypath = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let out = ns
        .command("/usr/bin/python3")
        .args(["-c", driver, pkg.str(), &steps.to_string()])
        .env("PYTHONPATH", pypath)
        .env("OSVT_PROBE", "yes")
        .stdin(Stdio::null())
        .output()
        .expect("run python3");
    assert!(out.status.success(), "probe: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("probe output ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

// ---------------------------------------------------------------------------------------
// The lab itself
// ---------------------------------------------------------------------------------------

/// The laboratory works without opservant: from HOST every server answers, DNS answers per
/// its table (UDP and TCP) and counts queries; and a fake sandbox namespace behind HOST,
/// masqueraded by a test-made nft table, reaches OUTSIDE over IPv4 and IPv6 (so HOST
/// forwards), with OUTSIDE seeing only HOST's uplink addresses.
#[test]
fn lab_self_test() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    assert_eq!(lab.host.links(), vec!["lo".to_string(), netlab::HOST_IF.to_string()]);
    let addrs = [
        "198.51.100.10:80",
        "198.51.100.11:3128",
        "198.51.100.12:80",
        "203.0.113.5:80",
        "[2001:db8:2::10]:80",
        "[2001:db8:2::11]:80",
    ];
    let stats = lab.banners(&addrs);
    let source = lab.source("198.51.100.10:9000", 10);
    let sink = lab.sink("198.51.100.10:9001");

    let read_banner = |addr: &str| -> String {
        let sa: std::net::SocketAddr = addr.parse().unwrap();
        let mut s = std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut s, &mut text).unwrap();
        text
    };

    lab.in_host(|| {
        for a in addrs {
            assert_eq!(read_banner(a), format!("hello {a}\n"));
        }
        // Nothing listens on 198.51.100.10:81: refused at once.
        let e = std::net::TcpStream::connect_timeout(&"198.51.100.10:81".parse().unwrap(), Duration::from_secs(2))
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
        // DNS over UDP and TCP.
        let q = |name, ty| netlab::dns_query_udp(DNS_SERVER, name, ty).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(q("allowed.test", netlab::QTYPE_A), (0, vec!["198.51.100.10".parse().unwrap()]));
        assert_eq!(q("ALLOWED.test", netlab::QTYPE_A), (0, vec!["198.51.100.10".parse().unwrap()]));
        assert_eq!(q("v6.test", netlab::QTYPE_AAAA), (0, vec!["2001:db8:2::10".parse().unwrap()]));
        assert_eq!(q("v6.test", netlab::QTYPE_A), (0, vec![]), "NOERROR, no data");
        assert_eq!(q("rebind.test", netlab::QTYPE_A), (0, vec!["127.0.0.1".parse().unwrap()]));
        assert_eq!(q("nothing.test", netlab::QTYPE_A), (netlab::RCODE_NXDOMAIN, vec![]));
        let t = netlab::dns_query_tcp(DNS_SERVER, "bad.example.test", netlab::QTYPE_A).unwrap();
        assert_eq!(t, (0, vec!["198.51.100.12".parse().unwrap()]));
        // Bandwidth source and sink.
        let mut s = std::net::TcpStream::connect("198.51.100.10:9000").unwrap();
        let mut buf = vec![0u8; 1 << 20];
        std::io::Read::read_exact(&mut s, &mut buf).unwrap();
        drop(s);
        let mut s = std::net::TcpStream::connect("198.51.100.10:9001").unwrap();
        std::io::Write::write_all(&mut s, &buf).unwrap();
    });
    assert_eq!(lab.dns.queries(), 7);
    assert!(lab.dns.asked("bad.example.test") && !lab.dns.asked("other.test"));
    lab.dns.set("late.test", &["203.0.113.5"]);
    let late = lab.in_host(|| netlab::dns_query_udp(DNS_SERVER, "late.test", netlab::QTYPE_A).unwrap());
    assert_eq!(late, (0, vec!["203.0.113.5".parse().unwrap()]));
    assert!(source.bytes() >= 1 << 20);
    let deadline = Instant::now() + Duration::from_secs(30);
    while sink.bytes() < 1 << 20 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(sink.bytes(), 1 << 20);
    for s in &stats {
        assert_eq!(s.accepted(), 1);
        assert_masqueraded(s);
    }

    // A fake sandbox behind HOST, like the agent will make: veth, private addresses,
    // masquerade out of the uplink.
    let base = lab.host.name.trim_end_matches("-h").to_string();
    let sb = netlab::Netns::new(&base, "s");
    lab.host.ip(&["link", "add", "sbx0", "type", "veth", "peer", "name", "eth0", "netns", &sb.name]);
    lab.host.ip(&["addr", "add", "10.99.0.1/30", "dev", "sbx0"]);
    lab.host.ip(&["-6", "addr", "add", "fd00:99::1/64", "dev", "sbx0", "nodad"]);
    lab.host.ip(&["link", "set", "sbx0", "up"]);
    sb.ip(&["addr", "add", "10.99.0.2/30", "dev", "eth0"]);
    sb.ip(&["-6", "addr", "add", "fd00:99::2/64", "dev", "eth0", "nodad"]);
    sb.ip(&["link", "set", "eth0", "up"]);
    sb.ip(&["route", "add", "default", "via", "10.99.0.1"]);
    sb.ip(&["-6", "route", "add", "default", "via", "fd00:99::1"]);
    // Masquerade out of the uplink; and the ways a policy can answer: RST, ICMP
    // admin-prohibited, silent drop (which the tests must never accept as "blocked").
    let ruleset = "table inet osvt_selftest {
 chain post { type nat hook postrouting priority srcnat; policy accept; oifname \"labup\" masquerade; }
 chain filter_fw {
  type filter hook forward priority filter; policy accept;
  iifname \"sbx0\" ip daddr 203.0.113.5 meta l4proto tcp reject with tcp reset
  iifname \"sbx0\" ip daddr 198.51.100.12 reject with icmpx type admin-prohibited
  iifname \"sbx0\" ip6 daddr 2001:db8:2::11 meta l4proto tcp reject with tcp reset
  iifname \"sbx0\" ip daddr 198.51.100.11 drop
 }
}
";
    lab.host.nft_apply(ruleset);
    sb.run(|| {
        assert_eq!(read_banner("198.51.100.10:80"), "hello 198.51.100.10:80\n");
        assert_eq!(read_banner("[2001:db8:2::10]:80"), "hello [2001:db8:2::10]:80\n");
        let a = netlab::dns_query_udp(DNS_SERVER, "other.test", netlab::QTYPE_A).unwrap();
        assert_eq!(a, (0, vec!["198.51.100.11".parse().unwrap()]));
    });

    // The probe executor's code, run directly (no opservant) in the fake sandbox, against the
    // assertion helpers the product tests use. Only IP literals: no name is ever resolved here.
    let steps = json!([
        ["connect", "198.51.100.10", 80],
        ["connect", "203.0.113.5", 80],
        ["connect", "198.51.100.12", 80],
        ["connect", "2001:db8:2::11", 80],
        ["connect", "198.51.100.11", 80, 1],
        ["connect", "198.51.100.10", 81],
        ["udp_dns", "198.51.100.53", 53, "allowed.test", 2],
        ["udp_dns", "198.51.100.53", 53, "nothing.test", 2],
        ["download", "198.51.100.10", 9000, 1],
        ["ifaces"],
        ["env", ["OSVT_PROBE"]],
        ["read", "/proc/net/route"],
        ["connect_gw", 2222],
    ]);
    let o = run_probe_directly(&sb, &steps);
    let st = o["steps"].as_array().unwrap();
    assert_connected(&st[0], "198.51.100.10:80");
    assert_blocked(&st[1], "TCP reset");
    assert_eq!(st[1]["error"], "ConnectionRefusedError", "{}", st[1]);
    assert_blocked(&st[2], "ICMP admin-prohibited");
    // (Over veth, an ICMPv6 admin-prohibited answer to a SYN takes ~1 s to fail connect():
    // the first one arrives while connect() still holds the socket and is only a soft error.)
    assert_blocked(&st[3], "TCP reset over IPv6");
    assert_eq!(st[4]["ok"], false, "{}", st[4]);
    assert!(not_blocked(&st[4], "drop").is_some(), "a timeout is not 'blocked': {}", st[4]);
    assert_eq!(st[5]["error"], "ConnectionRefusedError", "nothing listens on :81: {}", st[5]);
    assert_eq!(
        (st[6]["ok"].clone(), st[6]["rcode"].clone(), st[6]["answers"].clone()),
        (json!(true), json!(0), json!(1))
    );
    assert_eq!((st[7]["rcode"].clone(), st[7]["answers"].clone()), (json!(3), json!(0)), "{}", st[7]);
    assert_eq!(st[8]["ok"], true, "{}", st[8]);
    assert!(st[8]["bytes"].as_u64().unwrap() > 1 << 20, "unshaped download: {}", st[8]);
    assert_eq!(st[9]["if_nameindex"], json!(["lo", "eth0"]), "{}", st[9]);
    assert_eq!(st[9]["proc_net_dev"], json!(["lo", "eth0"]), "{}", st[9]);
    assert_eq!(st[10]["env"]["OSVT_PROBE"], "yes");
    assert!(st[11]["text"].as_str().unwrap().contains("eth0\t00000000\t0100630A"), "{}", st[11]);
    assert_eq!(st[12]["host"], "10.99.0.1");
    assert_eq!(st[12]["error"], "ConnectionRefusedError", "{}", st[12]);
    // Rejected connections never reached their servers (each still has HOST's one).
    assert_eq!((stats[2].accepted(), stats[3].accepted(), stats[5].accepted()), (1, 1, 1));
    assert_eq!(stats[0].accepted(), 3);
    assert_eq!(stats[4].accepted(), 2);
    assert_masqueraded(&stats[0]);
    assert_masqueraded(&stats[4]);
    assert_masqueraded(&source);
    assert_eq!(lab.dns.queries(), 11);
    // The leak check sees what the fake sandbox left until it is removed.
    let left = lab.host_leftovers(&["10.99.", "fd00:99:"]);
    assert!(left.iter().any(|l| l == "interface sbx0"), "{left:?}");
    assert!(left.iter().any(|l| l == "nft table inet osvt_selftest"), "{left:?}");
    assert!(left.iter().any(|l| l.starts_with("address:") && l.contains("10.99.0.1/30")), "{left:?}");
    lab.host.output("nft", &["delete", "table", "inet", "osvt_selftest"]);
    drop(sb); // removes eth0, and with it sbx0
    let deadline = Instant::now() + Duration::from_secs(5);
    while lab.host.links().len() > 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_host_clean(&lab);
    let (h, o) = (lab.host.name.clone(), lab.outside.name.clone());
    drop(lab);
    assert!(!Path::new(&format!("/run/netns/{h}")).exists() && !Path::new(&format!("/run/netns/{o}")).exists());
}

// ---------------------------------------------------------------------------------------
// Egress policy
// ---------------------------------------------------------------------------------------

/// (1) An allowed IP literal and port are reachable; the sandbox has eth0 with a pool address,
/// a default route via the host end, and resolv.conf naming that host end (the forwarder).
#[test]
fn allowed_host_and_port_are_reachable() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let srv = lab.banner("198.51.100.10:80");
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": [80]}),
        limits(),
        json!([
            ["connect", "198.51.100.10", 80],
            ["read", "/etc/resolv.conf"],
            ["read", "/proc/net/route"],
            ["ifaces"],
            ["netlink", 15],
            ["netlink", 0]
        ]),
    );
    assert_connected(p.step(0), "198.51.100.10:80");
    // No netlink with egress either (what a netlink socket queues is charged to no memory
    // cgroup): uevents and NETLINK_ROUTE alike are refused (EAFNOSUPPORT).
    for step in [4, 5] {
        assert_eq!((&p.step(step)["ok"], &p.step(step)["errno"]), (&json!(false), &json!(97)), "{}", p.step(step));
    }
    assert_eq!(srv.accepted(), 1);
    assert_masqueraded(&srv);

    let net = &p.r["output"]["network"];
    let local_ip = net["local_ip"].as_str().unwrap_or_else(|| panic!("context network.local_ip: {net}"));
    assert!(local_ip.starts_with(POOL_PREFIXES[0]), "local_ip {local_ip} from pool 10.213.0.0/16: {net}");
    assert_eq!(p.step(0)["local"], local_ip, "connections leave from eth0's address: {}", p.step(0));
    let ifaces = &p.step(3);
    let names: Vec<&str> = ifaces["proc_net_dev"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(names.contains(&"eth0") && names.contains(&"lo"), "{ifaces}");
    assert!(
        ifaces["if_nameindex"].to_string().contains("OSError(97"),
        "glibc's if_nameindex asks over netlink: {ifaces}"
    );
    let in_context: Vec<&str> =
        net["interfaces"].as_array().unwrap().iter().map(|i| i["name"].as_str().unwrap()).collect();
    assert_eq!(in_context, ["eth0", "lo"], "context network.interfaces, read without netlink: {net}");

    let route = p.step(2)["text"].as_str().unwrap_or_else(|| panic!("/proc/net/route: {}", p.step(2)));
    let gw = route
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 3 && f[1] == "00000000")
        .map(|f| {
            assert_eq!(f[0], "eth0", "default route via eth0: {route}");
            Ipv4Addr::from(u32::from_str_radix(f[2], 16).unwrap().to_le_bytes())
        })
        .unwrap_or_else(|| panic!("no default route in the sandbox: {route}"));
    let resolv = p.step(1)["text"].as_str().unwrap_or_else(|| panic!("/etc/resolv.conf: {}", p.step(1)));
    let servers: Vec<&str> =
        resolv.lines().filter_map(|l| l.trim().strip_prefix("nameserver")).map(str::trim).collect();
    assert_eq!(servers, vec![gw.to_string()], "resolv.conf names the host end ({gw}) only: {resolv}");
    assert_eq!(p.r["limits"]["max_bandwidth_mbps"], 10, "default bandwidth: {}", p.r["limits"]);
    assert_host_clean(&lab);
}

/// (2) Another port on the allowed host, and other hosts, are refused at once (and never
/// reach the servers); port ranges in both notations.
#[test]
fn other_ports_and_hosts_are_refused_fast() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banners(&[
        "198.51.100.10:80",
        "198.51.100.10:8080",
        "198.51.100.10:443",
        "203.0.113.5:80",
        "198.51.100.11:80",
    ]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": [80]}),
        limits(),
        json!([
            ["connect", "198.51.100.10", 8080],
            ["connect", "203.0.113.5", 80],
            ["connect", "198.51.100.11", 80],
            ["connect", "198.51.100.10", 80],
        ]),
    );
    assert_blocked(p.step(0), "198.51.100.10:8080 (port not allowed)");
    assert_blocked(p.step(1), "203.0.113.5:80 (host not allowed)");
    assert_blocked(p.step(2), "198.51.100.11:80 (host not allowed)");
    assert_connected(p.step(3), "198.51.100.10:80");
    assert_eq!((s[1].accepted(), s[3].accepted(), s[4].accepted()), (0, 0, 0), "blocked traffic reached a server");
    assert!(p.blocked() >= 3, "3 blocked connections, egress.blocked = {}", p.egress());

    // Ranges: "low-high" and [low, high].
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": ["8000-8100", [79, 81]]}),
        limits(),
        json!([
            ["connect", "198.51.100.10", 80],
            ["connect", "198.51.100.10", 8080],
            ["connect", "198.51.100.10", 443]
        ]),
    );
    assert_connected(p.step(0), "198.51.100.10:80");
    assert_connected(p.step(1), "198.51.100.10:8080");
    assert_blocked(p.step(2), "198.51.100.10:443 (outside the ranges)");
    assert_eq!(s[2].accepted(), 0);
    assert_host_clean(&lab);
}

/// CIDR entries: allow a /24, deny one /32 inside it.
#[test]
fn cidr_allow_with_cidr_deny() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banners(&["198.51.100.10:80", "198.51.100.11:80", "198.51.100.12:80", "203.0.113.5:80"]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.0/24"], "denied_hosts": ["198.51.100.12/32"]}),
        limits(),
        json!([
            ["connect", "198.51.100.10", 80],
            ["connect", "198.51.100.11", 80],
            ["connect", "198.51.100.12", 80],
            ["connect", "203.0.113.5", 80],
        ]),
    );
    assert_connected(p.step(0), "198.51.100.10:80");
    assert_connected(p.step(1), "198.51.100.11:80");
    assert_blocked(p.step(2), "198.51.100.12 (denied CIDR)");
    assert_blocked(p.step(3), "203.0.113.5 (outside the allowed CIDR)");
    assert_eq!((s[2].accepted(), s[3].accepted()), (0, 0));
    assert_host_clean(&lab);
}

/// (3) Deny wins over a wildcard allow: bad.example.test neither resolves nor is reachable by
/// its address; good.example.test resolves and connects.
#[test]
fn denied_host_wins_over_wildcard_allow() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    lab.dns.set("evilexample.test", &["198.51.100.11"]);
    let s = lab.banners(&["198.51.100.10:80", "198.51.100.11:80", "198.51.100.12:80"]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["*.example.test"], "denied_hosts": ["bad.example.test"]}),
        limits(),
        json!([
            ["resolve", "good.example.test"],
            ["connect", "good.example.test", 80],
            ["resolve", "bad.example.test"],
            ["connect", "bad.example.test", 80],
            ["connect", "198.51.100.12", 80],
            ["connect", "evilexample.test", 80],
        ]),
    );
    assert_resolved(p.step(0), "good.example.test", &["198.51.100.10"]);
    assert_connected(p.step(1), "198.51.100.10:80");
    assert_unresolved(p.step(2), "bad.example.test");
    assert_unresolved(p.step(3), "bad.example.test");
    assert_blocked(p.step(4), "198.51.100.12 (bad.example.test's address)");
    // "*.example.test" is a label wildcard, not a suffix match on "example.test".
    assert_eq!(p.step(5)["ok"], false, "evilexample.test must not match *.example.test: {}", p.step(5));
    assert_eq!((s[1].accepted(), s[2].accepted()), (0, 0));
    assert!(p.egress()["dns"]["refused"].as_u64().unwrap() >= 1, "bad.example.test refused: {}", p.egress());
    assert!(p.egress()["dns"]["queries"].as_u64().unwrap() >= 2, "{}", p.egress());
    assert_host_clean(&lab);
}

/// The records of `event` in the audit log at `log`.
fn audit_records(log: &Path, event: &str) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["event"] == event)
        .collect()
}

/// Refused names are audited once each, for the first 20: a sandbox that queries ever new
/// names gets every query refused and counted, but cannot write the audit log without
/// bound (one more record says the rest are counted only).
#[test]
fn refused_dns_names_cannot_flood_the_audit_log() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let log_dir = HostDir::new();
    let log = log_dir.path.join("audit.jsonl");
    let conf = Conf::new(&format!("audit:\n  path: {}\n  journald: false\n", log.display()));
    let names: Vec<String> = (0..40).map(|i| format!("n{i}.flood.test")).collect();
    let steps: Vec<Value> = names.iter().map(|n| json!(["resolve", n])).collect();
    let p =
        probe(&lab, &conf, json!({"outbound": true, "allowed_hosts": ["good.example.test"]}), limits(), json!(steps));
    for (i, n) in names.iter().enumerate() {
        assert_unresolved(p.step(i), n);
    }
    let dns = &p.egress()["dns"];
    assert!(dns["refused"].as_u64().unwrap() >= 40, "every query counted: {dns}");
    assert_eq!(dns["refused_names"].as_array().map(Vec::len), Some(20), "{dns}");
    let records = audit_records(&log, "dns_refused");
    assert_eq!(records.len(), 21, "20 names and one record saying the rest are counted only");
    assert_eq!(records.iter().filter(|r| r["fields"]["further_names_counted_only_after"] == "20").count(), 1);
    // Each names its run's command (empty for a command-line run): concurrent runs of one
    // executor are told apart.
    assert!(records.iter().all(|r| r["fields"]["command_id"] == ""), "{records:?}");
    assert_host_clean(&lab);
}

/// A secret value the executor queries as a DNS name (exfiltration through the resolver):
/// the refused name is audited as the query comes, and reported in the result, with the
/// value redacted — in whatever case it was queried (the forwarder folds names to lower
/// case, as DNS matches them).
#[test]
fn a_secret_queried_as_a_dns_name_is_redacted_from_the_audit_and_the_result() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let dir = HostDir::new();
    let log = dir.path.join("audit.jsonl");
    let value = format!("s3cr3t-VALUE-{}-zq", std::process::id());
    let secrets = dir.path.join("secrets.yaml");
    std::fs::write(&secrets, format!("api_key: {value}\n")).unwrap();
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o600)).unwrap();
    let conf = Conf::new(&format!(
        "audit:\n  path: {}\n  journald: false\nsecrets:\n  provider: file\n  file: {}\n",
        log.display(),
        secrets.display()
    ));
    let pkg = probe_package(&json!({"outbound": true, "allowed_hosts": ["good.example.test"]}), &limits());
    let manifest = pkg.path.join("manifest.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    m["permissions"]["secrets"] = json!(["api_key"]);
    std::fs::write(&manifest, m.to_string()).unwrap();
    let params = json!({"resolve_secret": ["api_key", "leak.test"]}).to_string();
    let out = run_in(&lab, &pkg.path, &["--config", conf.arg(), "--params", &params]);
    let r = out.completed();
    assert_eq!(r["output"]["resolved"], false, "{r}");
    let refused = &r["sandbox"]["egress"]["dns"]["refused_names"];
    assert!(refused.as_array().is_some_and(|a| a.iter().any(|n| n["name"] == "[REDACTED].leak.test")), "{refused}");
    let audit = std::fs::read_to_string(&log).unwrap();
    let records = audit_records(&log, "dns_refused");
    assert!(records.iter().any(|r| r["fields"]["name"] == "[REDACTED].leak.test"), "{records:?}");
    for (what, text) in [("audit log", &audit), ("result", &out.stdout), ("stderr", &out.stderr)] {
        let text = text.to_ascii_lowercase();
        assert!(!text.contains(&value.to_ascii_lowercase()), "the value in the {what}: {text}");
    }
    assert_host_clean(&lab);
}

/// A literal denied name must be resolved to deny its addresses too: when the resolver does
/// not answer (here a host whose port 53 is closed), the run is refused (exit 2, naming the
/// name) instead of running with the name's addresses reachable by IP.
#[test]
fn a_denied_name_that_cannot_be_resolved_refuses_the_run() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let _s = lab.banners(&["198.51.100.10:80"]);
    let conf = Conf::with_upstream("198.51.100.10:53", "");
    let pkg = probe_package(&json!({"outbound": true, "denied_hosts": ["bad.example.test"]}), &limits());
    let out = run_in(&lab, &pkg.path, &["--config", conf.arg(), "--params", r#"{"steps": []}"#]);
    assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{out:#?}");
    assert!(out.stderr.contains("cannot resolve bad.example.test"), "{}", out.stderr);
    assert_host_clean(&lab);
}

/// A denied name with more addresses than a 512-byte UDP answer holds: the upstream
/// truncates it (TC), the agent asks again over TCP, and every address is denied — the last
/// one too, which a truncated answer leaves out.
#[test]
fn a_denied_name_with_a_truncated_answer_is_resolved_in_full() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    // 39 addresses without a server, then the lab's server .12 last.
    let mut addrs: Vec<String> = (100..139).map(|i| format!("198.51.100.{i}")).collect();
    addrs.push("198.51.100.12".into());
    lab.dns.set("big.example.test", &addrs.iter().map(String::as_str).collect::<Vec<_>>());
    let s = lab.banners(&["198.51.100.12:80", "198.51.100.11:80"]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "denied_hosts": ["big.example.test"]}),
        limits(),
        json!([["connect", "198.51.100.12", 80], ["connect", "198.51.100.11", 80]]),
    );
    assert_blocked(p.step(0), "198.51.100.12 (big.example.test's last address)");
    assert_connected(p.step(1), "198.51.100.11:80");
    assert_eq!(s[0].accepted(), 0);
    assert_host_clean(&lab);
}

/// Deny wins through a CNAME too: an allowed name that is a CNAME of a denied one is
/// refused, and the denied name's address is not allowed by the way.
#[test]
fn an_allowed_name_that_is_a_cname_of_a_denied_one_is_refused() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    lab.dns.set_cname("alias.example.test", "bad.example.test");
    lab.dns.set("bad.example.test", &["198.51.100.11"]);
    let s = lab.banners(&["198.51.100.10:80", "198.51.100.11:80"]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["*.example.test"], "denied_hosts": ["bad.example.test"]}),
        limits(),
        json!([
            ["resolve", "alias.example.test"],
            ["connect", "alias.example.test", 80],
            ["connect", "198.51.100.11", 80],
            ["connect", "good.example.test", 80],
        ]),
    );
    assert_unresolved(p.step(0), "alias.example.test");
    assert_unresolved(p.step(1), "alias.example.test");
    assert_blocked(p.step(2), "198.51.100.11 (bad.example.test's address, reached through a CNAME)");
    assert_connected(p.step(3), "198.51.100.10:80");
    assert_eq!(s[1].accepted(), 0);
    let refused = p.egress()["dns"]["refused_names"].to_string();
    assert!(refused.contains("bad.example.test"), "{refused}");
    assert_host_clean(&lab);
}

/// (4) A hostname allow list works through DNS: the name connects; an address never obtained
/// through an allowed name does not (even after resolving a non-allowed name to it); the
/// allowed name's address works by IP once resolved.
#[test]
fn hostname_allow_list_follows_dns() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banners(&["198.51.100.10:80", "198.51.100.11:80"]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["allowed.test"]}),
        limits(),
        json!([
            ["connect", "198.51.100.11", 80],
            ["connect", "allowed.test", 80],
            ["connect", "198.51.100.10", 80],
            ["resolve", "other.test"],
            ["connect", "198.51.100.11", 80],
            ["connect", "other.test", 80],
        ]),
    );
    assert_blocked(p.step(0), "198.51.100.11 (never resolved through an allowed name)");
    assert_connected(p.step(1), "198.51.100.10:80");
    assert_connected(p.step(2), "198.51.100.10:80");
    assert_blocked(p.step(4), "198.51.100.11 after resolving the non-allowed other.test");
    assert_eq!(p.step(5)["ok"], false, "other.test is not allowed: {}", p.step(5));
    assert_eq!(s[1].accepted(), 0, "198.51.100.11 was reached");
    assert_eq!(s[0].accepted(), 2);
    assert!(lab.dns.asked("allowed.test"), "the forwarder asks the configured upstream: {:?}", lab.dns.log());
    assert_host_clean(&lab);
}

/// DNS over TCP (what resolvers fall back to for large answers) follows the same policy: an
/// allowed name is answered (through the upstream over TCP), a denied one is refused.
#[test]
fn dns_over_tcp_follows_the_same_policy() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banners(&["198.51.100.10:80"]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["*.example.test"], "denied_hosts": ["bad.example.test"]}),
        limits(),
        json!([
            ["tcp_dns", "good.example.test"],
            ["tcp_dns", "bad.example.test"],
            ["tcp_dns", "other.test"],
            ["connect", "198.51.100.10", 80],
        ]),
    );
    assert_eq!(
        (p.step(0)["ok"].clone(), p.step(0)["rcode"].clone(), p.step(0)["answers"].clone()),
        (json!(true), json!(0), json!(1)),
        "{}",
        p.step(0)
    );
    assert_eq!(p.step(1)["rcode"], 5, "bad.example.test REFUSED over TCP: {}", p.step(1));
    assert_eq!(p.step(2)["rcode"], 5, "other.test REFUSED over TCP: {}", p.step(2));
    // The address came through an allowed name over TCP, so it is reachable.
    assert_connected(p.step(3), "198.51.100.10:80");
    assert_eq!(s[0].accepted(), 1);
    assert!(
        !lab.dns.asked("other.test"),
        "a name outside the allow list never reaches the upstream: {:?}",
        lab.dns.log()
    );
    assert_host_clean(&lab);
}

/// The resolver's DNS-over-TCP bounds hold against a hostile client in the sandbox (the
/// forwarder serves TCP on its only thread, so a client must not hold it): a connection that
/// sends nothing is closed (idle limit, 2 s), one that trickles a query byte by byte is
/// closed before the query is complete (connection limit, 5 s), one that sends 17 queries
/// gets 16 answers and is closed; after each, names resolve over UDP again. (The bounds are
/// checked with wide margins: a silent connection closed within 10 s, a trickle cut off
/// within 24 of its half-second bytes. The flood asks a name the policy refuses, which the
/// forwarder answers itself, so no upstream lookup paces it.)
#[test]
fn dns_over_tcp_bounds_hold_against_a_hostile_client() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["*.example.test"]}),
        limits(),
        json!([
            ["dns_tcp_abuse", "silent", "good.example.test"],
            ["resolve", "good.example.test"],
            ["dns_tcp_abuse", "trickle", "good.example.test"],
            ["resolve", "good.example.test"],
            ["dns_tcp_abuse", "flood", "other.test"],
            ["resolve", "good.example.test"],
        ]),
    );
    let silent = p.step(0);
    assert_eq!((silent["ok"].clone(), silent["closed"].clone()), (json!(true), json!(true)), "{silent}");
    assert_eq!(silent["answers"], 0, "{silent}");
    assert!(silent["ms"].as_f64().unwrap() < 10_000.0, "a silent connection held the resolver: {silent}");
    let trickle = p.step(2);
    assert_eq!((trickle["ok"].clone(), trickle["closed"].clone()), (json!(true), json!(true)), "{trickle}");
    assert!(
        trickle["sent"].as_u64().unwrap() < trickle["of"].as_u64().unwrap(),
        "the trickled query was taken whole: {trickle}"
    );
    assert!(trickle["sent"].as_u64().unwrap() <= 24, "a trickle held the resolver: {trickle}");
    let flood = p.step(4);
    assert_eq!(
        (flood["ok"].clone(), flood["closed"].clone(), flood["answers"].clone()),
        (json!(true), json!(true), json!(16)),
        "{flood}"
    );
    for i in [1, 3, 5] {
        assert_resolved(p.step(i), "good.example.test", &["198.51.100.10"]);
    }
    assert_host_clean(&lab);
}

/// (5a) dns_allowed: false: getaddrinfo fails and nothing reaches the lab's DNS server;
/// egress itself still works.
#[test]
fn dns_disallowed_blocks_resolution() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let _s = lab.banner("198.51.100.10:80");
    let conf = Conf::new("");
    let steps = json!([["resolve", "allowed.test"], ["connect", "allowed.test", 80], ["connect", "198.51.100.10", 80]]);
    let p = probe(&lab, &conf, json!({"outbound": true, "dns_allowed": false}), limits(), steps);
    assert_unresolved(p.step(0), "allowed.test");
    assert_unresolved(p.step(1), "allowed.test");
    assert_connected(p.step(2), "198.51.100.10:80");
    assert_eq!(lab.dns.queries(), 0, "the lab DNS server was asked: {:?}", lab.dns.log());

    // Control: the same probe with DNS allowed resolves through the forwarder.
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "dns_allowed": true}),
        limits(),
        json!([["resolve", "allowed.test"]]),
    );
    assert_resolved(p.step(0), "allowed.test", &["198.51.100.10"]);
    assert!(lab.dns.asked("allowed.test"), "{:?}", lab.dns.log());
    assert!(p.egress()["dns"]["queries"].as_u64().unwrap() >= 1, "{}", p.egress());
    assert_host_clean(&lab);
}

/// (5b) dns_allowed: false also blocks DNS sent straight to a server (UDP and TCP port 53),
/// even when any host is allowed.
#[test]
fn dns_disallowed_blocks_direct_queries() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let _s = lab.banner("198.51.100.10:80");
    let conf = Conf::new("");
    let steps = json!([
        ["udp_dns", "198.51.100.53", 53, "allowed.test", 1],
        ["connect", "198.51.100.53", 53],
        ["connect", "198.51.100.10", 80],
    ]);
    let p = probe(&lab, &conf, json!({"outbound": true, "dns_allowed": false}), limits(), steps);
    assert_connected(p.step(2), "198.51.100.10:80");
    assert!(
        p.step(0)["ok"] == false && p.step(1)["ok"] == false && lab.dns.queries() == 0,
        "DNS straight to a server must fail with dns_allowed: false:\nUDP query: {}\nTCP connect to :53: {}\nlab DNS server log: {:?}",
        p.step(0),
        p.step(1),
        lab.dns.log()
    );
    assert_host_clean(&lab);
}

/// (5c) The agent config's `network.executor_defaults.dns_allowed: false` applies when the
/// manifest does not say.
#[test]
fn dns_allowed_default_comes_from_the_agent_config() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let conf_off = Conf::new("  executor_defaults:\n    dns_allowed: false\n");
    let p = probe(&lab, &conf_off, json!({"outbound": true}), limits(), json!([["resolve", "allowed.test"]]));
    assert_unresolved(p.step(0), "allowed.test");
    assert_eq!(lab.dns.queries(), 0, "the lab DNS server was asked: {:?}", lab.dns.log());
    // The manifest's own dns_allowed: true wins over the default.
    let p = probe(
        &lab,
        &conf_off,
        json!({"outbound": true, "dns_allowed": true}),
        limits(),
        json!([["resolve", "allowed.test"]]),
    );
    assert_resolved(p.step(0), "allowed.test", &["198.51.100.10"]);
    assert_host_clean(&lab);
}

/// (6) DNS rebinding: names answering with loopback, private (RFC 1918, ULA) or link-local
/// (the metadata service) addresses are refused, whether the name is explicitly allowed or
/// any host is.
#[test]
fn dns_rebinding_to_loopback_is_refused() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let conf = Conf::new("");
    let private = ["private10.test", "private192.test", "ula.test", "metadata.test"];
    let steps = json!([
        ["resolve", "rebind.test"],
        ["resolve", "rebind6.test"],
        ["resolve", "allowed.test"],
        ["resolve", "wireserver.test"],
        ["resolve", private[0]],
        ["resolve", private[1]],
        ["resolve", private[2]],
        ["resolve", private[3]]
    ]);
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["rebind.test", "rebind6.test", "allowed.test", "wireserver.test",
            private[0], private[1], private[2], private[3]]}),
        limits(),
        steps.clone(),
    );
    for (i, name) in private.iter().enumerate() {
        assert_unresolved(p.step(4 + i), name);
    }
    assert_unresolved(p.step(0), "rebind.test (-> 127.0.0.1)");
    assert_unresolved(p.step(1), "rebind6.test (-> ::1)");
    assert_resolved(p.step(2), "allowed.test", &["198.51.100.10"]);
    // Azure's metadata service outside link-local (it would enter the allow set).
    assert_unresolved(p.step(3), "wireserver.test (-> 168.63.129.16)");
    let p = probe(&lab, &conf, json!({"outbound": true}), limits(), steps);
    assert_unresolved(p.step(0), "rebind.test (-> 127.0.0.1), any host allowed");
    assert_unresolved(p.step(1), "rebind6.test (-> ::1), any host allowed");
    assert_resolved(p.step(2), "allowed.test", &["198.51.100.10"]);
    assert_unresolved(p.step(3), "wireserver.test (-> 168.63.129.16), any host allowed");
    for (i, name) in private.iter().enumerate() {
        assert_unresolved(p.step(4 + i), &format!("{name}, any host allowed"));
    }
    let refused = p.r["sandbox"]["egress"]["dns"]["refused_names"].to_string();
    assert!(private.iter().all(|n| refused.contains(n)) && refused.contains("rebinding"), "{refused}");
    assert_host_clean(&lab);
}

/// One sandbox cannot fill the host's conntrack table: with `max_connections: 5` its sixth
/// tracked connection is blocked (and counted), TCP or UDP; closed TCP connections stop
/// counting.
#[test]
fn a_sandbox_cannot_track_more_connections_than_allowed() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let srv = lab.sink("198.51.100.10:80");
    let conf = Conf::new("    max_connections: 5\n");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": [80, "9000-9009"], "dns_allowed": false}),
        limits(),
        json!([["hold", "198.51.100.10", 80, 8, [9000, 9001, 9002, 9003, 9004, 9005, 9006, 9007]]]),
    );
    let step = p.step(0);
    assert_eq!(
        step["tcp"],
        json!(["ok", "ok", "ok", "ok", "ok", "ECONNREFUSED", "ECONNREFUSED", "ECONNREFUSED"]),
        "{step}"
    );
    assert_eq!(step["udp"], json!(["ok", "ok", "ok", "ok", "ok", "EPERM", "EPERM", "EPERM"]), "{step}");
    assert_eq!(srv.accepted(), 5);
    assert!(p.r["sandbox"]["egress"]["blocked"].as_u64().unwrap_or(0) >= 6, "{}", p.r["sandbox"]["egress"]);
    assert_host_clean(&lab);
}

/// The forwarder allows only the addresses of the name asked for (and of the names its
/// CNAME chain leads to): an upstream's A record for another owner name beside the answer
/// allows nothing. Zone transfers and `ANY` are refused; upstream never sees the sandbox's
/// own query id, and the sandbox gets its id back.
#[test]
fn only_the_asked_names_addresses_are_allowed() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banners(&["198.51.100.10:80", "198.51.100.11:80"]);
    lab.dns.set_extra("allowed.test", "other.test", "198.51.100.11");
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["allowed.test"], "allowed_ports": [80]}),
        limits(),
        json!([
            ["dns_raw", "udp", ["allowed", "test"], 1, 0x4242], // 0: answered with the extra record
            ["connect", "198.51.100.10", 80],                   // 1
            ["connect", "198.51.100.11", 80],                   // 2: the extra record's address
            ["dns_raw", "udp", ["allowed", "test"], 255],       // 3: ANY
            ["dns_raw", "tcp", ["allowed", "test"], 252],       // 4: AXFR
            ["dns_raw", "udp", ["allowed", "test"], 251],       // 5: IXFR
        ]),
    );
    assert_eq!(p.step(0)["rcode"], 0, "{}", p.step(0));
    assert_eq!(p.step(0)["answers"], 2, "{}", p.step(0));
    assert_eq!(p.step(0)["id"], 0x4242, "the sandbox gets its own id back: {}", p.step(0));
    assert_connected(p.step(1), "198.51.100.10:80");
    assert_blocked(p.step(2), "198.51.100.11 (an A record of other.test beside allowed.test's answer)");
    assert_eq!(s[1].accepted(), 0);
    for i in [3, 4, 5] {
        assert_eq!(p.step(i)["rcode"], 5, "REFUSED: {}", p.step(i));
    }
    assert!(
        !lab.dns.log().iter().any(|(_, qtype)| [251, 252, 255].contains(qtype)),
        "a zone transfer or ANY reached upstream: {:?}",
        lab.dns.log()
    );
    let ids = lab.dns.ids();
    assert!(!ids.is_empty());
    assert!(!ids.contains(&0x4242), "upstream saw the sandbox's query id: {ids:?}");
    let refused = p.egress()["dns"]["refused_names"].to_string();
    assert!(refused.contains("query_type"), "{refused}");
    assert_host_clean(&lab);
}

/// An address stays allowed for as long as a resolver in the sandbox may cache any answer
/// that gave it: answers' TTLs are clamped to the hour the allow set keeps an address at
/// most, a later answer with a shorter TTL does not cut an address's time short, and one
/// with a longer TTL renews it.
#[test]
fn an_address_is_allowed_as_long_as_its_answers_may_be_cached() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let _s = lab.banners(&["198.51.100.10:80", "198.51.100.11:80", "198.51.100.12:80"]);
    for (name, addr, ttl) in [
        ("long.test", "198.51.100.10", 86_400),
        ("short.test", "198.51.100.10", 1),
        ("brief.test", "198.51.100.11", 1),
        ("later.test", "198.51.100.11", 120),
        ("again.test", "198.51.100.12", 1),
    ] {
        lab.dns.set(name, &[addr]);
        lab.dns.set_ttl(name, ttl);
    }
    let conf = Conf::new("");
    let names = ["long.test", "short.test", "brief.test", "later.test", "again.test"];
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": names, "allowed_ports": [80]}),
        limits(),
        json!([
            ["dns_raw", "udp", ["long", "test"], 1],  // 0: TTL 86400 → 3600
            ["dns_raw", "udp", ["short", "test"], 1], // 1: the same address, TTL 1 (kept 10 s)
            ["dns_raw", "udp", ["brief", "test"], 1], // 2: kept 10 s …
            ["dns_raw", "udp", ["later", "test"], 1], // 3: … renewed for 120 s
            ["dns_raw", "udp", ["again", "test"], 1], // 4: kept 10 s …
            ["sleep", 11],
            ["dns_raw", "udp", ["again", "test"], 1], // 6: … asked again once the kernel let it go
            ["connect", "198.51.100.10", 80],         // 7: still allowed by the first answer
            ["connect", "198.51.100.11", 80],         // 8: allowed by the renewal
            ["connect", "198.51.100.12", 80],         // 9: allowed again
        ]),
    );
    assert_eq!(p.step(0)["ttls"], json!([3600]), "{}", p.step(0));
    assert_eq!(p.step(1)["ttls"], json!([1]), "{}", p.step(1));
    assert_eq!(p.step(3)["ttls"], json!([120]), "{}", p.step(3));
    // 198.51.100.10: a later, shorter answer must not cut its time short; 198.51.100.11: a
    // later, longer answer must renew it; 198.51.100.12: an address the kernel has already
    // let go of, which the forwarder still remembers, is added again.
    assert_eq!(p.step(6)["rcode"], 0, "{}", p.step(6));
    assert_connected(p.step(7), "198.51.100.10:80");
    assert_connected(p.step(8), "198.51.100.11:80");
    assert_connected(p.step(9), "198.51.100.12:80");
    assert_host_clean(&lab);
}

/// The dynamic allow set has a size: an executor allowed a wildcard whose DNS answers with
/// thousands of addresses cannot have the kernel hold them all (outside its cgroup). An
/// answer that would overflow the set is refused (SERVFAIL) and nothing of it allowed.
#[test]
fn the_dynamic_allow_set_is_bounded() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let many = |base: u32| -> Vec<String> { (0..2100u32).map(|i| Ipv4Addr::from(base + i).to_string()).collect() };
    let (first, second) = (many(u32::from(Ipv4Addr::new(11, 0, 0, 1))), many(u32::from(Ipv4Addr::new(11, 1, 0, 1))));
    lab.dns.set("many1.test", &first.iter().map(String::as_str).collect::<Vec<_>>());
    lab.dns.set("many2.test", &second.iter().map(String::as_str).collect::<Vec<_>>());
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["*.test"], "allowed_ports": [80]}),
        limits(),
        json!([["tcp_dns", "many1.test"], ["tcp_dns", "many2.test"]]),
    );
    assert_eq!((&p.step(0)["rcode"], &p.step(0)["answers"]), (&json!(0), &json!(2100)), "{}", p.step(0));
    assert_eq!(p.step(1)["rcode"], 2, "SERVFAIL: 4200 addresses do not fit the set of 4096: {}", p.step(1));
    assert_host_clean(&lab);
}

/// A closed connection stops counting towards `max_connections` but stays in the host's
/// conntrack table (TIME_WAIT, 120 s): new connections are rate-limited too. With 5 per
/// second (a burst of 5), 39 new flows sent at once do not all go out — but every packet
/// of one flow that no reply comes back to (each `ct state new`) does.
#[test]
fn new_connections_are_rate_limited() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let conf = Conf::new("    max_new_connections_per_second: 5\n");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": ["9000-9039"], "dns_allowed": false}),
        limits(),
        json!([
            ["flow", "198.51.100.10", 9039, 200],
            ["hold", "198.51.100.10", 80, 0, (9000..9039).collect::<Vec<u16>>()]
        ]),
    );
    assert_eq!(p.step(0)["sent"], 200, "one flow's packets are not new connections: {}", p.step(0));
    let udp: Vec<&str> = p.step(1)["udp"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let sent = udp.iter().filter(|u| **u == "ok").count();
    // The burst (the flow above took one), and 5 more for each second the sends take.
    assert!((4..39).contains(&sent), "{sent} of 39 new flows went out: {udp:?}");
    assert!(udp.iter().all(|u| *u == "ok" || *u == "EPERM"), "{udp:?}");
    assert!(
        p.r["sandbox"]["egress"]["blocked"].as_u64().unwrap_or(0) >= (39 - sent) as u64,
        "{}",
        p.r["sandbox"]["egress"]
    );
    assert_host_clean(&lab);
}

/// (7) max_bandwidth_mbps: a 2-second download runs at 10 Mbit/s ± 20 %.
#[test]
fn bandwidth_is_limited() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let src = lab.source("198.51.100.10:9000", 30);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": [9000]}),
        json!({"max_cpu_percent": 50, "timeout_seconds": 60, "max_bandwidth_mbps": 10}),
        json!([["download", "198.51.100.10", 9000, 2]]),
    );
    let d = p.step(0);
    assert_eq!(d["ok"], true, "{d}");
    assert_eq!(p.r["limits"]["max_bandwidth_mbps"], 10, "{}", p.r["limits"]);
    let bps = d["bytes_per_second"].as_f64().unwrap();
    let want = 10.0 * 1_000_000.0 / 8.0;
    assert!(
        (bps - want).abs() <= want * 0.2,
        "download at {:.2} Mbit/s, want 10 ± 20 %: {d} (source sent {} bytes)",
        bps * 8.0 / 1e6,
        src.bytes()
    );
    assert_masqueraded(&src);
    assert_host_clean(&lab);
}

/// (8) IPv6: an allowed v6 address connects, another is refused; an allowed name with an
/// AAAA record connects over IPv6.
#[test]
fn ipv6_egress() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banners(&["[2001:db8:2::10]:80", "[2001:db8:2::11]:80"]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["2001:db8:2::10"]}),
        limits(),
        json!([["connect", "2001:db8:2::10", 80], ["connect", "2001:db8:2::11", 80]]),
    );
    assert_connected(p.step(0), "[2001:db8:2::10]:80");
    let local = p.step(0)["local"].as_str().unwrap();
    assert!(local.starts_with(POOL_PREFIXES[1]), "IPv6 source {local} from pool fd6f:7073:7276::/48");
    assert_blocked(p.step(1), "2001:db8:2::11 (not allowed)");
    assert_eq!(s[1].accepted(), 0);
    assert_masqueraded(&s[0]);

    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["v6.test"]}),
        limits(),
        json!([["resolve", "v6.test"], ["connect", "v6.test", 80], ["connect", "2001:db8:2::11", 80]]),
    );
    assert_resolved(p.step(0), "v6.test", &["2001:db8:2::10"]);
    assert_connected(p.step(1), "[2001:db8:2::10]:80");
    assert_blocked(p.step(2), "2001:db8:2::11 (not obtained through v6.test)");
    assert_eq!(s[1].accepted(), 0);
    assert_host_clean(&lab);
}

/// `manage_forwarding` switches IPv4 forwarding on when it is off, never IPv6's: switching
/// that on for the whole host stops router advertisements being accepted (a SLAAC host loses
/// its IPv6 default route). A run on a host with IPv6 forwarding off goes ahead on IPv4 and
/// says why it has no IPv6; the host's setting is untouched (the old code switched it on).
#[test]
fn manage_forwarding_never_switches_on_ipv6_forwarding() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banners(&["198.51.100.10:80"]);
    let forwarding = |key: &str| lab.host.output("cat", &[&format!("/proc/sys/net/{key}")]).trim().to_string();
    lab.host.output(
        "sh",
        &["-c", "echo 0 > /proc/sys/net/ipv4/ip_forward; echo 0 > /proc/sys/net/ipv6/conf/all/forwarding"],
    );
    assert_eq!((forwarding("ipv4/ip_forward"), forwarding("ipv6/conf/all/forwarding")), ("0".into(), "0".into()));
    let conf = Conf::new("    manage_forwarding: true\n");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"]}),
        limits(),
        json!([["connect", "198.51.100.10", 80]]),
    );
    assert_connected(p.step(0), "198.51.100.10:80");
    assert_masqueraded(&s[0]);
    assert_eq!(forwarding("ipv4/ip_forward"), "1", "manage_forwarding switches IPv4 forwarding on");
    assert_eq!(forwarding("ipv6/conf/all/forwarding"), "0", "IPv6 forwarding was switched on");
    let why = p.egress()["ipv6_unavailable"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("IPv6 forwarding is off"), "{}", p.egress());
    assert_host_clean(&lab);
}

/// OUTSIDE routes the address pool through HOST, whose `rp_filter` is loose: a neighbour
/// that reaches the sandboxes' gateway addresses (the host's own) from another interface.
fn route_outside_to_the_pool(lab: &Lab) {
    lab.outside.ip(&["route", "add", "10.213.0.0/16", "via", HOST_V4]);
    for conf in ["all", "default", netlab::HOST_IF] {
        netlab::sysctl_in(&lab.host.name, &format!("net.ipv4.conf.{conf}.rp_filter"), "0");
    }
}

/// The gateway address of the run under way in HOST, once its link is there (30 s at most,
/// and never after the run ended).
fn gateway_of_the_run<T>(lab: &Lab, run: &std::thread::ScopedJoinHandle<'_, T>) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let addrs = lab.host.output("ip", &["-4", "-o", "addr", "show"]);
        let gateway = addrs.lines().filter(|l| l.contains(" opsv")).find_map(|l| {
            let cidr = l.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
            Some(cidr.split('/').next()?.to_string())
        });
        if let Some(g) = gateway {
            return g;
        }
        assert!(Instant::now() < deadline && !run.is_finished(), "the run's veth never appeared in HOST");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The DNS forwarder answers its sandbox only. It listens on the gateway's address, which is
/// the host's own: a neighbour that routes to it through another interface (here OUTSIDE,
/// given a route to the pool via HOST) reaches that address — the control, another port of
/// it — and got answers too, the agent resolving for anyone (checked on the old code). UDP
/// queries from anyone but the sandbox are dropped and TCP connections closed unanswered;
/// and the forwarder's sockets are bound to the sandbox link, so a query from OUTSIDE that
/// forges the sandbox's own address (accepted by a host whose `rp_filter` is loose, as
/// HOST's is made here) never reaches it either.
#[test]
fn the_dns_forwarder_answers_only_its_sandbox() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    route_outside_to_the_pool(&lab);
    // The control: a listener of HOST's own on every address, the gateway's included.
    let control = lab.host.run(|| std::net::TcpListener::bind("0.0.0.0:5300")).expect("control listener");
    let conf = Conf::new("");
    std::thread::scope(|scope| {
        let run = scope.spawn(|| {
            probe(
                &lab,
                &conf,
                json!({"outbound": true, "dns_allowed": true}),
                limits(),
                json!([["sleep", 2], ["resolve", "allowed.test"], ["sleep", 6]]),
            )
        });
        let gateway = gateway_of_the_run(&lab, &run);
        let server = format!("{gateway}:53");
        let gw: Ipv4Addr = gateway.parse().unwrap();
        let client = Ipv4Addr::from(u32::from(gw) + 1);
        let (reached, udp, tcp, spoofed) = lab.outside.run(|| {
            let reached = std::net::TcpStream::connect_timeout(
                &format!("{gateway}:5300").parse().unwrap(),
                Duration::from_secs(2),
            )
            .map(|_| ());
            // The run resolves after 2 s: its forwarder listens by then.
            std::thread::sleep(Duration::from_millis(2500));
            (
                reached,
                netlab::dns_query_udp(&server, "allowed.test", 1),
                netlab::dns_query_tcp(&server, "allowed.test", 1),
                netlab::send_spoofed_udp(
                    std::net::SocketAddrV4::new(client, 40000),
                    std::net::SocketAddrV4::new(gw, 53),
                    &netlab::dns_query_message(0x7357, "spoofed.test", 1),
                ),
            )
        });
        let p = run.join().unwrap();
        assert_resolved(p.step(1), "allowed.test", &["198.51.100.10"]);
        assert!(reached.is_ok(), "control: OUTSIDE reaches {gateway}:5300 (HOST's own listener): {reached:?}");
        assert!(udp.is_err(), "a UDP query from OUTSIDE to {server} was answered: {udp:?}");
        assert!(tcp.is_err(), "a TCP query from OUTSIDE to {server} was answered: {tcp:?}");
        assert!(spoofed.is_ok(), "the spoofed query was sent: {spoofed:?}");
        assert!(!lab.dns.asked("spoofed.test"), "a query forging the sandbox's address was resolved");
        let asked = lab.dns.log();
        assert!(
            asked.iter().all(|(n, _)| n == "allowed.test"),
            "upstream was asked for more than the sandbox's name: {asked:?}"
        );
    });
    drop(control);
    assert_host_clean(&lab);
}

/// The agent's proxy, like the DNS forwarder, serves only its sandbox: OUTSIDE, routing to the
/// gateway address (the host's own), gets no answer from it while the run uses it — the
/// proxy's socket is bound to the sandbox's link — and the configured proxy sees only the
/// sandbox's request. In allow-any mode, the configured proxy itself (configured by name) and
/// the proxy port of other addresses stay unreachable, directly and through the agent's
/// proxy, and so does the agent's host; a denied network covering the address pool leaves
/// the sandbox its DNS and its proxy.
#[test]
fn the_agents_proxy_serves_only_its_sandbox() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    route_outside_to_the_pool(&lab);
    let upstream = lab.proxy("198.51.100.11:3128");
    lab.dns.set("proxy.lab.test", &["198.51.100.11"]);
    let conf = Conf::new("  proxy:\n    https: \"http://proxy.lab.test:3128\"\n");
    let request = "CONNECT api.allowed.test:443 HTTP/1.1\r\n\r\n";
    std::thread::scope(|scope| {
        let run = scope.spawn(|| {
            probe(
                &lab,
                &conf,
                // Allow-any, with a denied network covering the address pool (its gateway:
                // the agent's DNS and proxy are reached all the same).
                json!({"outbound": true, "denied_hosts": ["10.0.0.0/8"]}),
                limits(),
                json!([
                    ["sleep", 2],
                    ["proxy", "HTTPS_PROXY", request, "x"],
                    ["sleep", 4],
                    ["connect", "198.51.100.11", 3128],
                    ["connect", "198.51.100.10", 13128],
                    ["resolve", "allowed.test"],
                    ["proxy", "HTTPS_PROXY", "CONNECT proxy.lab.test:3128 HTTP/1.1\r\n\r\n"],
                    ["proxy", "HTTPS_PROXY", "CONNECT 198.51.100.11:3128 HTTP/1.1\r\n\r\n"],
                    ["proxy", "HTTPS_PROXY", format!("CONNECT {HOST_V4}:22 HTTP/1.1\r\n\r\n")],
                    ["connect", "10.1.2.3", 80]
                ]),
            )
        });
        let gateway = gateway_of_the_run(&lab, &run);
        let answer = lab.outside.run(|| {
            // The run's proxy listens by the time its sandbox uses it, 2 s in.
            std::thread::sleep(Duration::from_millis(2500));
            let addr = format!("{gateway}:13128").parse().unwrap();
            let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            std::io::Write::write_all(&mut s, request.as_bytes())?;
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut s, &mut got)?;
            Ok::<_, std::io::Error>(got)
        });
        let p = run.join().unwrap();
        assert_eq!((p.step(1)["status"].as_u64(), p.step(1)["echo"].as_str()), (Some(200), Some("x")), "{}", p.r);
        assert!(
            answer.as_ref().map_or(true, |got| got.is_empty()),
            "OUTSIDE was answered by the agent's proxy on {gateway}:13128: {:?}",
            answer.map(|g| String::from_utf8_lossy(&g).to_string())
        );
        assert_eq!(upstream.lock().unwrap().len(), 1, "the configured proxy saw more than the sandbox's request");
        // Allow-any reaches every other address, but not the configured proxy's, nor the
        // proxy port anywhere but its own gateway's.
        assert_blocked(p.step(3), "198.51.100.11:3128 (the configured proxy, directly, in allow-any mode)");
        assert_blocked(p.step(4), "198.51.100.10:13128 (the proxy port elsewhere)");
        assert_resolved(p.step(5), "allowed.test", &["198.51.100.10"]);
        // Through the agent's proxy: the configured proxy (by name, by address) and the
        // agent's host are no targets either.
        for (i, reason) in [(6, "unreachable"), (7, "denied"), (8, "unreachable")] {
            let s = p.step(i);
            assert_eq!(s["status"], 403, "step {i}: {s}");
            assert!(s["body"].as_str().unwrap_or_default().contains(reason), "step {i}: {s}");
        }
        assert_blocked(p.step(9), "10.1.2.3:80 (a denied network)");
    });
    assert_host_clean(&lab);
}

/// (9) The seed's port scanner with a real allow list: only allowed ports that listen are open.
#[test]
fn seed_port_scanner_reports_only_allowed_open_ports() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banners(&["198.51.100.10:22", "198.51.100.10:80", "198.51.100.10:8080", "198.51.100.10:9000"]);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../executors/port-scanner");
    let pkg = HostDir::new();
    let code = std::fs::read(src.join("port_scanner/__init__.py")).expect("read port scanner");
    put(&pkg.path, "port_scanner/__init__.py", &code);
    let mut m: Value = serde_json::from_slice(&std::fs::read(src.join("manifest.json")).unwrap()).unwrap();
    m["permissions"]["network"] =
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": [22, 80, 443]});
    put(&pkg.path, "manifest.json", m.to_string().as_bytes());
    let conf = Conf::new("");
    let params = json!({"target_host": "198.51.100.10", "ports": [22, 80, 443, 8080, 9000]}).to_string();
    let out = run_in(&lab, &pkg.path, &["--config", conf.arg(), "--params", &params, "--action", "act-port-scan"]);
    let r = out.completed();
    assert_eq!(r["sandbox"]["network"], "egress", "{}", r["sandbox"]);
    let ports = &r["output"]["ports"];
    let open: Vec<u64> = ports
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["status"] == "open")
        .map(|p| p["port"].as_u64().unwrap())
        .collect();
    assert_eq!(open, vec![22, 80], "{}", r["output"]);
    assert_eq!(ports.as_array().unwrap().len(), 5, "{}", r["output"]);
    assert_eq!((s[2].accepted(), s[3].accepted()), (0, 0), "8080/9000 are not allowed: never reached");
    assert_host_clean(&lab);
}

/// (10) outbound: false: only a loopback, nothing outside is reachable.
#[test]
fn outbound_false_has_only_loopback() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s = lab.banner("198.51.100.10:80");
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": false}),
        limits(),
        json!([["ifaces"], ["connect", "198.51.100.10", 80], ["resolve", "allowed.test"]]),
    );
    // No netlink (what it queues is charged to no memory cgroup): the interfaces are still
    // listed in /proc/net/dev.
    let names = p.step(0)["if_nameindex"].to_string();
    assert!(names.contains("Errno 97") || names.contains("Address family not supported"), "{}", p.step(0));
    assert_eq!(p.step(0)["proc_net_dev"], json!(["lo"]), "{}", p.step(0));
    assert_eq!(p.step(1)["ok"], false, "{}", p.step(1));
    assert!(p.step(1)["ms"].as_f64().unwrap() < FAST_FAIL_MS, "{}", p.step(1));
    assert_unresolved(p.step(2), "allowed.test");
    assert_eq!(s.accepted(), 0);
    assert_eq!(lab.dns.queries(), 0);
    assert!(p.r["sandbox"]["egress"].is_null(), "no egress report without egress: {}", p.r["sandbox"]);
    assert_eq!(p.r["sandbox"]["network"], "none", "{}", p.r["sandbox"]);
    assert_eq!(p.r["output"]["network"]["local_ip"], "127.0.0.1");
    assert_host_clean(&lab);
}

/// The agent's host itself is not "the internet": with any host allowed, the sandbox still
/// cannot open connections to services of the agent's host (neither the host end of its
/// link nor the host's uplink address); the DNS forwarder on the host end still answers.
#[test]
fn sandbox_cannot_reach_the_agent_host() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    // A service on the agent's host, on every address.
    let l = lab.in_host(|| std::net::TcpListener::bind("0.0.0.0:2222")).expect("bind in HOST");
    let l6 = lab.in_host(|| std::net::TcpListener::bind("[::]:2223")).expect("bind v6 in HOST");
    l.set_nonblocking(true).unwrap();
    l6.set_nonblocking(true).unwrap();
    // A port the host forwards to another machine (a published container port, a NodePort).
    let _srv = lab.banner("198.51.100.10:80");
    lab.host.nft_apply(
        "table ip opsvtest_dnat {\n chain pre {\n  type nat hook prerouting priority -100;\n  \
         ip daddr 192.0.2.1 tcp dport 8080 dnat to 198.51.100.10:80\n }\n}\n",
    );
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true}),
        limits(),
        json!([
            ["connect_gw", 2222],
            ["connect", HOST_V4, 2222],
            ["connect", HOST_V6, 2223],
            ["resolve", "allowed.test"],
            ["connect", HOST_V4, 8080],
            ["connect", "198.51.100.10", 80],
        ]),
    );
    assert!(l.accept().is_err() && l6.accept().is_err(), "a connection reached the host's service");
    assert_resolved(p.step(3), "allowed.test", &["198.51.100.10"]);
    assert_connected(p.step(5), "198.51.100.10:80");
    assert_all_blocked(&[
        (p.step(0), "the host end of the sandbox link, port 2222"),
        (p.step(1), "the host's uplink address 192.0.2.1:2222"),
        (p.step(2), "the host's uplink address [2001:db8:1::1]:2223"),
        (p.step(4), "the host's port 8080, forwarded by its DNAT rule to 198.51.100.10:80"),
    ]);
    drop((l, l6));
    lab.host.output("nft", &["delete", "table", "ip", "opsvtest_dnat"]);
    assert_host_clean(&lab);
}

/// With `network.proxy`, the executor's proxy is the agent's own, on its gateway: it passes
/// to the configured proxy only what the executor's network policy allows, and adds the
/// proxy's credentials itself. Its environment names the agent's proxy, without the password;
/// the configured proxy is not reachable directly. Tried and refused: a name the allow list
/// does not hold, a denied name below an allowed wildcard, a port not allowed, the metadata
/// address, a `Host` header and a second request pipelined behind an allowed plain request
/// (never forwarded), and the client's own `Proxy-Authorization` (dropped).
#[test]
fn the_proxy_passes_only_what_the_policy_allows() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let upstream = lab.proxy("198.51.100.11:3128");
    let direct = lab.banners(&["198.51.100.10:80"]);
    let log_dir = HostDir::new();
    let log = log_dir.path.join("audit.jsonl");
    let conf = Conf::new(&format!(
        "  proxy:\n    http: \"http://agent:pr0xy%2Fs3cret@198.51.100.11:3128\"\n    https: \"http://agent:pr0xy%2Fs3cret@198.51.100.11:3128\"\n    no_proxy: [\"10.0.0.0/8\"]\naudit:\n  path: {}\n  journald: false\n",
        log.display()
    ));
    let names = ["HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"];
    let connect = |target: &str| format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["*.allowed.test", "198.51.100.10"],
               "denied_hosts": ["bad.allowed.test"], "allowed_ports": [80, 443, 8080]}),
        limits(),
        json!([
            ["env", names],
            ["proxy", "HTTPS_PROXY", connect("api.allowed.test:443"), "ping through the tunnel"],
            ["proxy", "HTTPS_PROXY", connect("example.test:443")],
            ["proxy", "HTTPS_PROXY", connect("bad.allowed.test:443")],
            ["proxy", "HTTPS_PROXY", connect("api.allowed.test:22")],
            ["proxy", "HTTPS_PROXY", connect("169.254.169.254:80")],
            ["proxy", "HTTP_PROXY", "GET http://www.allowed.test/a HTTP/1.1\r\nHost: evil.test\r\nProxy-Authorization: Basic Zm9vOmJhcg==\r\n\r\nGET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n"],
            ["connect", "198.51.100.11", 3128],
            ["connect", "198.51.100.10", 80],
            ["proxy", "HTTPS_PROXY", "CONNECT evil.test:443@api.allowed.test:443 HTTP/1.1\r\n\r\n"],
            ["proxy", "HTTPS_PROXY", "CONNECT refused.allowed.test:443 HTTP/1.1\r\n\r\nGET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n"],
            ["proxy", "HTTP_PROXY", "GET http://www.allowed.test/echo-headers HTTP/1.1\r\n\r\n"],
            ["proxy", "HTTP_PROXY", "TRACE http://www.allowed.test/ HTTP/1.1\r\nMax-Forwards: 0\r\n\r\n"]
        ]),
    );
    let gateway = p.egress()["gateway"].as_str().unwrap_or_else(|| panic!("no gateway: {}", p.r)).to_string();
    let ours = format!("http://{gateway}:13128");
    let env = &p.step(0)["env"];
    for n in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"] {
        assert_eq!(env[n], ours.as_str(), "{n}: {env}");
    }
    for n in ["NO_PROXY", "no_proxy"] {
        let v = env[n].as_str().unwrap_or_else(|| panic!("{n} unset: {env}"));
        assert!(v.split(',').any(|e| e.trim() == "10.0.0.0/8"), "{n}={v}");
    }
    let tunnel = p.step(1);
    assert_eq!(
        (tunnel["status"].as_u64(), tunnel["echo"].as_str()),
        (Some(200), Some("ping through the tunnel")),
        "{tunnel}"
    );
    for (i, reason) in [(2, "not_allowed"), (3, "denied"), (4, "port_not_allowed"), (5, "unreachable")] {
        let s = p.step(i);
        assert_eq!(s["status"], 403, "step {i}: {s}");
        assert!(s["body"].as_str().unwrap_or_default().contains(reason), "step {i}: {s}");
    }
    let plain = p.step(6);
    assert_eq!(plain["status"], 200, "{plain}");
    assert_eq!(plain["body"], "proxied GET http://www.allowed.test/a HTTP/1.1", "{plain}");
    assert_blocked(p.step(7), "198.51.100.11:3128 (the configured proxy, directly)");
    assert_connected(p.step(8), "198.51.100.10:80");
    assert_eq!(p.step(9)["status"], 400, "a target with user information: {}", p.step(9));
    // A CONNECT the upstream refuses: its status, not its page (which quotes the request).
    let refused_upstream = p.step(10);
    assert_eq!(refused_upstream["status"], 502, "{refused_upstream}");
    assert!(refused_upstream["body"].as_str().unwrap_or_default().contains("with 403"), "{refused_upstream}");
    // A page quoting the request's headers: the credentials overwritten, the framing kept.
    let echoed = p.step(11);
    assert_eq!(echoed["status"], 200, "{echoed}");
    // (The result's own redaction would hide the token too: the payload counts the stars.)
    assert_eq!(echoed["stars"], 24, "the 24 characters of the token overwritten: {echoed}");
    assert!(echoed["body"].as_str().unwrap_or_default().ends_with("\r\n\r\n"), "{echoed}");
    assert_eq!(p.step(12)["status"], 405, "TRACE: {}", p.step(12));
    assert_eq!(direct[0].accepted(), 1);

    // What the configured proxy saw: the two allowed requests, written anew.
    let seen: Vec<String> = upstream.lock().unwrap().iter().map(|b| String::from_utf8_lossy(b).to_string()).collect();
    assert_eq!(seen.len(), 4, "{seen:#?}");
    let find =
        |start: &str| seen.iter().find(|c| c.starts_with(start)).unwrap_or_else(|| panic!("no {start:?} in {seen:#?}"));
    let (tunnelled, plain) = (find("CONNECT api."), find("GET http://www.allowed.test/a "));
    // Nothing of what followed the refused CONNECT reached the upstream.
    assert!(find("CONNECT refused.").ends_with("\r\n\r\n") && !find("CONNECT refused.").contains("evil"), "{seen:#?}");
    // base64("agent:pr0xy/s3cret"): the URL's password, decoded.
    let credentials = "Proxy-Authorization: Basic YWdlbnQ6cHIweHkvczNjcmV0\r\n";
    assert!(
        tunnelled.starts_with("CONNECT api.allowed.test:443 HTTP/1.1\r\nHost: api.allowed.test:443\r\n"),
        "{tunnelled}"
    );
    assert!(tunnelled.contains(credentials), "{tunnelled}");
    assert!(tunnelled.ends_with("\r\n\r\nping through the tunnel"), "{tunnelled}");
    assert!(plain.starts_with("GET http://www.allowed.test/a HTTP/1.1\r\nHost: www.allowed.test\r\n"), "{plain}");
    assert!(plain.contains("Connection: close\r\n"), "{plain}");
    assert!(plain.contains(credentials), "{plain}");
    assert!(!plain.contains("evil") && !plain.contains("Zm9v"), "{plain}");

    let report = &p.egress()["proxy"];
    let counts = ["forwarded", "refused", "upstream_failed"].map(|k| report[k].as_u64());
    assert_eq!(counts, [Some(3), Some(6), Some(1)], "{report}");
    let refused: Vec<(String, String)> = report["refused_targets"]
        .as_array()
        .unwrap_or_else(|| panic!("{report}"))
        .iter()
        .map(|r| {
            (r["target"].as_str().unwrap_or_default().to_string(), r["reason"].as_str().unwrap_or_default().to_string())
        })
        .collect();
    for want in [
        ("example.test:443", "not_allowed"),
        ("bad.allowed.test:443", "denied"),
        ("api.allowed.test:22", "port_not_allowed"),
        ("169.254.169.254:80", "unreachable"),
    ] {
        assert!(refused.contains(&(want.0.to_string(), want.1.to_string())), "{want:?} in {refused:?}");
    }
    let audited = audit_records(&log, "proxy_refused");
    assert_eq!(audited.len(), 6, "{audited:?}");
    let whole = p.r.to_string() + &std::fs::read_to_string(&log).unwrap();
    assert!(!whole.contains("pr0xy") && !whole.contains("s3cret") && !whole.contains("YWdlbnQ6"), "{whole}");
    assert_host_clean(&lab);
}

// ---------------------------------------------------------------------------------------
// Leaks
// ---------------------------------------------------------------------------------------

/// Many sequential egress runs leave nothing behind: no interfaces, pool addresses or routes,
/// nft tables, processes or cgroups. 1000 runs (`OPSERVANT_LEAK_RUNS` lowers it locally; under
/// CI the full count always runs).
#[test]
fn no_leaks_after_many_egress_runs() {
    if !prerequisites() {
        return;
    }
    let runs: usize = match std::env::var("OPSERVANT_LEAK_RUNS").ok().and_then(|v| v.parse().ok()) {
        Some(n) if !common::in_ci() => n,
        Some(_) => {
            eprintln!("CI=true: OPSERVANT_LEAK_RUNS ignored, running 1000");
            1000
        }
        None => 1000,
    };
    let lab = Lab::new();
    let srv = lab.banner("198.51.100.10:80");
    let conf = Conf::new("");
    let pkg =
        probe_package(&json!({"outbound": true, "allowed_hosts": ["allowed.test"], "allowed_ports": [80]}), &limits());
    let params = json!({"steps": [["connect", "allowed.test", 80]]}).to_string();
    let mut pids = Vec::with_capacity(runs);
    let started = Instant::now();
    for i in 0..runs {
        let out = run_in(&lab, &pkg.path, &["--config", conf.arg(), "--params", &params]);
        let r = out.completed();
        assert_eq!(r["sandbox"]["network"], "egress", "run {i}: {}", r["sandbox"]);
        assert_connected(&r["output"]["steps"][0], "198.51.100.10:80");
        pids.push(out.pid);
        if (i + 1) % 100 == 0 || i + 1 == runs {
            let waited = assert_host_clean(&lab);
            eprintln!(
                "leak check: {} runs, {:.1} s (clean after {} ms)",
                i + 1,
                started.elapsed().as_secs_f64(),
                waited.as_millis()
            );
        }
    }
    assert_eq!(srv.accepted(), runs as u64);
    assert_host_clean(&lab);
    let cgroups: Vec<PathBuf> = pids.iter().flat_map(|p| common::cgroups_of(*p)).collect();
    assert!(cgroups.is_empty(), "sandbox cgroups left: {cgroups:?}");
    let procs = common::host_processes_with(pkg.str());
    assert!(procs.is_empty(), "processes of the runs left: {procs:?}");
}

// ---------------------------------------------------------------------------------------
// A sniffer in HOST: which markers crossed it
// ---------------------------------------------------------------------------------------

/// Every frame seen on any interface of HOST (AF_PACKET, ETH_P_ALL) is searched for markers
/// `OSVTM<nn>X`; [`Sniffer::seen`] lists the numbers found.
struct Sniffer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    seen: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<u32>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sniffer {
    fn start(lab: &Lab) -> Sniffer {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let fd: OwnedFd = lab.in_host(|| {
            let proto = (libc::ETH_P_ALL as u16).to_be() as i32;
            // SAFETY: socket(2) with constant arguments; the result is checked below.
            let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
            assert!(fd >= 0, "AF_PACKET socket in HOST: {}", std::io::Error::last_os_error());
            // SAFETY: a fresh descriptor (checked above) that nothing else owns.
            unsafe { OwnedFd::from_raw_fd(fd) }
        });
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
        let (st, sn) = (stop.clone(), seen.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 70000];
            while !st.load(std::sync::atomic::Ordering::SeqCst) {
                let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd for a descriptor this thread owns.
                if unsafe { libc::poll(&mut pfd, 1, 100) } <= 0 {
                    continue;
                }
                // SAFETY: `buf` is valid for `buf.len()` bytes and outlives the call.
                let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
                if n <= 0 {
                    continue;
                }
                let frame = &buf[..n as usize];
                for w in frame.windows(8) {
                    if &w[..5] == b"OSVTM" && w[7] == b'X' && w[5].is_ascii_digit() && w[6].is_ascii_digit() {
                        let v = u32::from(w[5] - b'0') * 10 + u32::from(w[6] - b'0');
                        sn.lock().unwrap().insert(v);
                    }
                }
            }
        });
        Sniffer { stop, seen, thread: Some(thread) }
    }

    fn seen(&self) -> std::collections::BTreeSet<u32> {
        std::thread::sleep(Duration::from_millis(300));
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Sniffer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Markers (with what they were) that must not have reached HOST; returns the problems.
fn leaked(seen: &std::collections::BTreeSet<u32>, cases: &[(u32, &str)]) -> Vec<String> {
    cases.iter().filter(|(m, _)| seen.contains(m)).map(|(m, w)| format!("marker {m}: {w} left the sandbox")).collect()
}

// ---------------------------------------------------------------------------------------
// Probes
// ---------------------------------------------------------------------------------------

const AF_INET: i32 = 2;
const AF_INET6: i32 = 10;
const AF_PACKET: i32 = 17;
const SOCK_RAW: i32 = 3;

/// Allow list 198.51.100.10 port 80: UDP to a non-allowed port or host, UDP-Lite (another L4
/// protocol) to the allowed port, a TTL-1 datagram, a datagram carrying an IP option (record
/// route: the rule that rejects every option also stops loose source routing through the
/// host), ICMP (raw, ping socket), packet sockets, and datagrams with a forged source address
/// (a socket may bind one with IP_FREEBIND).
/// README: allowed_ports apply to TCP and UDP, "everything else rejected".
#[test]
fn udp_icmp_raw_respect_ports_and_protocols() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let sniff = Sniffer::start(&lab);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": [80]}),
        limits(),
        json!([
            ["udp", "198.51.100.10", 80, 1],                                  // 0 control
            ["udp", "198.51.100.10", 5353, 2],                                // 1
            ["udp", "198.51.100.11", 80, 3],                                  // 2
            ["udp", "198.51.100.10", 80, 4, {"proto": 136}],                  // 3 UDP-Lite
            ["udp", "198.51.100.10", 5353, 5, {"ttl": 1}],                    // 4
            ["udp", "198.51.100.10", 80, 6, {"ip_options": [7, 7, 4, 0, 0, 0, 0]}], // 5 record route, allowed port
            ["socket", AF_INET, SOCK_RAW, 1],                                 // 6
            ["socket", AF_INET6, SOCK_RAW, 58],                               // 7
            ["socket", AF_PACKET, SOCK_RAW, 768],                             // 8
            ["ping", "198.51.100.10", 9],                                     // 9
            ["udp", "203.0.113.5", 53, 10],                                   // 10 DNS elsewhere
            // Forged sources (IP_FREEBIND) to the allowed host and port: another address,
            // another sandbox's pool address (the kernel refuses to route them, ENETUNREACH;
            // the ruleset would reject them too).
            ["udp", "198.51.100.10", 80, 11, {"bind": "192.0.2.77"}],         // 11
            ["udp", "198.51.100.10", 80, 12, {"bind": "neighbour-slot"}],     // 12
        ]),
    );
    let seen = sniff.seen();
    assert!(
        seen.contains(&1),
        "control: UDP to the allowed host and port must leave the sandbox: {seen:?} {}",
        p.r["output"]
    );
    let mut problems = leaked(
        &seen,
        &[
            (2, "UDP to the allowed host on a non-allowed port"),
            (3, "UDP to a non-allowed host"),
            (4, "UDP-Lite to the allowed host and port"),
            (5, "TTL-1 UDP to a non-allowed port"),
            (6, "UDP with an IP option (record route) to the allowed host and port"),
            (9, "ICMP echo"),
            (10, "UDP to port 53 of another resolver"),
            (11, "UDP with a forged source address (IP_FREEBIND)"),
            (12, "UDP with another sandbox's pool address as its source"),
        ],
    );
    for (i, what) in [(6, "raw IPv4 socket"), (7, "raw ICMPv6 socket"), (8, "packet socket")] {
        if p.step(i)["ok"] != false {
            problems.push(format!("{what} could be created: {}", p.step(i)));
        }
    }
    assert!(problems.is_empty(), "{}\nsteps: {}", problems.join("\n"), p.r["output"]["steps"]);
    drop(sniff);
    assert_host_clean(&lab);
}

/// The sandbox's ruleset is the second wall against a forged source: the kernel does not
/// route one an unprivileged socket binds (steps 11 and 12 above are refused there first,
/// `ENETUNREACH`), so this test goes past that wall. Host root enters the running sandbox's
/// network namespace and sends raw IPv4 datagrams (`IPPROTO_RAW`, the header as given) to
/// the allowed host and port: with the sandbox's own address as the source (the control) the
/// datagram leaves the sandbox; with another address, or a neighbouring sandbox's pool
/// address, it must not — a datagram with a foreign source would leave the host
/// unmasqueraded — and neither may anything quoting it: the ruleset used to reject these,
/// and the reject's ICMP error, addressed to the forged source and related to the datagram,
/// left the sandbox through the established/related rule with the datagram's first bytes
/// (the host table's invalid-state rule dropped it there). IPv4 and IPv6; failed on the old
/// ruleset for all four forged datagrams.
#[test]
fn a_forged_source_is_stopped_by_the_sandboxs_ruleset() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let sniff = Sniffer::start(&lab);
    let conf = Conf::new("");
    std::thread::scope(|scope| {
        let run = scope.spawn(|| {
            probe(
                &lab,
                &conf,
                json!({"outbound": true, "allowed_hosts": ["198.51.100.10", "2001:db8:2::10"], "allowed_ports": [80]}),
                limits(),
                json!([["sleep", 10]]),
            )
        });
        // The host end of the run's veth: its index and the gateway address on it (the
        // sandbox's address is the next one of the /30).
        let deadline = Instant::now() + Duration::from_secs(30);
        let (host_ifindex, gateway) = loop {
            let addrs = lab.host.output("ip", &["-4", "-o", "addr", "show"]);
            let found = addrs.lines().filter(|l| l.contains(" opsv")).find_map(|l| {
                let index = l.split(':').next()?.trim().to_string();
                let cidr = l.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
                Some((index, cidr.split('/').next()?.parse::<Ipv4Addr>().ok()?))
            });
            if let Some(f) = found {
                break f;
            }
            assert!(Instant::now() < deadline && !run.is_finished(), "the run's veth never appeared in HOST");
            std::thread::sleep(Duration::from_millis(20));
        };
        let own = Ipv4Addr::from(u32::from(gateway) + 1);
        let neighbour = Ipv4Addr::from(u32::from(own) ^ 4);
        // The sandbox's network namespace: a process of this test's whose namespace has an
        // `eth0` that is the peer of that veth and carries the sandbox's address.
        let ns_path = loop {
            if let Some(p) = sandbox_netns_of(&host_ifindex, own) {
                break p;
            }
            assert!(Instant::now() < deadline && !run.is_finished(), "the sandbox's network namespace was not found");
            std::thread::sleep(Duration::from_millis(50));
        };
        let dst = std::net::SocketAddrV4::new(Ipv4Addr::new(198, 51, 100, 10), 80);
        let dst6 = std::net::SocketAddrV6::new("2001:db8:2::10".parse().unwrap(), 80, 0, 0);
        let sent = std::thread::spawn(move || {
            let ns = std::fs::File::open(&ns_path).expect("open the sandbox's netns");
            // SAFETY: setns(2) of this thread only, to a namespace descriptor we hold open.
            let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns into {ns_path}: {}", std::io::Error::last_os_error());
            // The sandbox's own global IPv6 address, and its neighbour's in the pool.
            let addrs = std::process::Command::new("ip")
                .args(["-o", "-6", "addr", "show", "dev", "eth0", "scope", "global"])
                .output()
                .expect("ip in the sandbox's netns");
            let own6: std::net::Ipv6Addr = String::from_utf8_lossy(&addrs.stdout)
                .split_whitespace()
                .skip_while(|w| *w != "inet6")
                .nth(1)
                .and_then(|c| c.split('/').next()?.parse().ok())
                .unwrap_or_else(|| panic!("no global IPv6 address on the sandbox's eth0: {addrs:?}"));
            let neighbour6 = std::net::Ipv6Addr::from(u128::from(own6) ^ 4);
            let v4 = [(own, 41u8), (Ipv4Addr::new(192, 0, 2, 77), 42), (neighbour, 43)].map(|(src, mark)| {
                let payload = format!("OSVTM{mark:02}X forged-source probe");
                netlab::send_spoofed_udp(std::net::SocketAddrV4::new(src, 40000), dst, payload.as_bytes())
            });
            let v6 = [(own6, 44u8), ("2001:db8:77::1".parse().unwrap(), 45), (neighbour6, 46)].map(|(src, mark)| {
                let payload = format!("OSVTM{mark:02}X forged-source probe");
                netlab::send_spoofed_udp6(std::net::SocketAddrV6::new(src, 40000, 0, 0), dst6, payload.as_bytes())
            });
            [v4, v6]
        })
        .join()
        .expect("the sending thread");
        for (family, results) in ["IPv4", "IPv6"].iter().zip(&sent) {
            assert!(results[0].is_ok(), "control: the raw {family} datagram could not be sent: {sent:?}");
            // A datagram the output hook drops fails its `sendto` with EPERM; the sniffer decides.
            for r in &results[1..] {
                assert!(
                    r.as_ref().is_ok() || r.as_ref().is_err_and(|e| e.raw_os_error() == Some(libc::EPERM)),
                    "raw {family} datagram: {sent:?}"
                );
            }
        }
        let p = run.join().expect("the run");
        let seen = sniff.seen();
        for (mark, family) in [(41, "IPv4"), (44, "IPv6")] {
            assert!(
                seen.contains(&mark),
                "control: a raw {family} datagram with the sandbox's own source must leave: {seen:?}"
            );
        }
        let problems = leaked(
            &seen,
            &[
                (42, "UDP with a forged source (192.0.2.77)"),
                (43, "UDP with a neighbouring sandbox's pool address as its source"),
                (45, "UDP over IPv6 with a forged source (2001:db8:77::1)"),
                (46, "UDP over IPv6 with a neighbouring sandbox's pool address as its source"),
            ],
        );
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        let blocked = p.r["sandbox"]["egress"]["blocked"].as_u64().unwrap_or(0);
        assert!(blocked >= 4, "the four forged datagrams must be counted as blocked: {}", p.r["sandbox"]["egress"]);
    });
    drop(sniff);
    assert_host_clean(&lab);
}

/// The network namespace (as a `/proc/PID/ns/net` path) of a descendant of this process
/// whose `eth0` is the peer of HOST's interface `host_ifindex` and carries `address`.
fn sandbox_netns_of(host_ifindex: &str, address: Ipv4Addr) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let own_ns = std::fs::metadata("/proc/self/ns/net").ok()?.ino();
    let mut tried = std::collections::BTreeSet::new();
    for pid in common::procs::descendants(std::process::id() as i32) {
        let path = format!("/proc/{pid}/ns/net");
        let Ok(ino) = std::fs::metadata(&path).map(|m| m.ino()) else { continue };
        if ino == own_ns || !tried.insert(ino) {
            continue;
        }
        let ip_in = |args: &[&str]| -> String {
            std::process::Command::new("nsenter")
                .arg(format!("--net={path}"))
                .arg("ip")
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        let peer_of_ours = ip_in(&["-o", "link", "show", "dev", "eth0"]).contains(&format!("eth0@if{host_ifindex}:"));
        if peer_of_ours && ip_in(&["-o", "-4", "addr", "show", "dev", "eth0"]).contains(&format!("inet {address}/")) {
            return Some(path);
        }
    }
    None
}

/// An IPv6 routing header — a type 4 segment routing header, which any unprivileged socket
/// may set — names its real destination in its segment list, past the first hop its
/// destination address shows: through an allowed first hop it reached hosts neither allowed
/// nor denied (and left the host unmasqueraded). No packet carrying one leaves the sandbox.
#[test]
fn ipv6_routing_headers_do_not_leave_the_sandbox() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let sniff = Sniffer::start(&lab);
    let conf = Conf::new("");
    let through_allowed = json!({"rthdr": ["::", "2001:db8:2::10"]});
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["2001:db8:2::10"], "dns_allowed": false}),
        limits(),
        json!([
            ["udp", "2001:db8:2::10", 80, 21],                                // 0 control
            ["udp", "2001:db8:2::11", 80, 22],                                // 1 not allowed
            ["udp", "2001:db8:2::11", 80, 23, through_allowed],               // 2 via the allowed
            ["udp", "2001:db8:2::10", 80, 24, {"rthdr": ["::", "2001:db8:2::10"]}], // 3 to it, routed
        ]),
    );
    let seen = sniff.seen();
    assert!(seen.contains(&21), "control: UDP to the allowed host must leave the sandbox: {seen:?} {}", p.r["output"]);
    let problems = leaked(
        &seen,
        &[
            (22, "UDP to a host not allowed"),
            (23, "UDP to a host not allowed, routed through the allowed one (segment routing header)"),
            (24, "UDP with a segment routing header to the allowed host"),
        ],
    );
    assert!(problems.is_empty(), "{}\nsteps: {}", problems.join("\n"), p.r["output"]["steps"]);
    drop(sniff);
    assert_host_clean(&lab);
}

/// Allow-any mode (no allowed_hosts): metadata, broadcast (limited and the sandbox's own /30),
/// multicast v4/v6, the gateway's other UDP ports (v4 and v6), HOST's uplink addresses over
/// UDP, other sandboxes' pool addresses (v4 and v6) — none may leave the sandbox.
#[test]
fn allow_any_mode_special_destinations_over_udp() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let u4 = lab.in_host(|| std::net::UdpSocket::bind("0.0.0.0:9999")).expect("udp in HOST");
    let u6 = lab.in_host(|| std::net::UdpSocket::bind("[::]:9998")).expect("udp6 in HOST");
    u4.set_nonblocking(true).unwrap();
    u6.set_nonblocking(true).unwrap();
    let sniff = Sniffer::start(&lab);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true}),
        limits(),
        json!([
            ["udp", "198.51.100.10", 5353, 1],                       // 0 control
            ["udp", "169.254.169.254", 80, 2],                       // 1
            ["udp", "255.255.255.255", 9999, 3, {"broadcast": true}],// 2
            ["udp_bcast_own", 9999, 4],                              // 3
            ["udp", "224.0.0.251", 5353, 5],                         // 4
            ["udp", "ff02::1%eth0", 5353, 6],                        // 5
            ["udp_gw", 123, 7],                                      // 6
            ["udp_gw", 9999, 8],                                     // 7
            ["udp_gw6", 9998, 9],                                    // 8
            ["udp", HOST_V4, 9999, 10],                              // 9
            ["udp", HOST_V6, 9998, 11],                              // 10
            ["udp", "10.213.0.1", 9999, 12],                         // 11
            ["udp", "10.213.0.6", 80, 13],                           // 12
            ["udp", "fd6f:7073:7276::1", 9998, 14],                  // 13
            ["udp", "fd6f:7073:7276::6", 80, 15],                    // 14
            ["udp", "239.255.255.250", 1900, 16, {"mcast_ttl": 8}],  // 15
            ["connect", "169.254.169.254", 80, 2],                   // 16
            ["connect", "10.213.0.6", 80, 2],                        // 17
            ["udp", "::ffff:169.254.169.254", 80, 19],               // 18 v4-mapped through AF_INET6
            ["udp", "::ffff:192.0.2.1", 9999, 20],                   // 19
            ["udp", "100.100.100.200", 80, 21],                      // 20 metadata outside 169.254/16
            ["udp", "168.63.129.16", 80, 22],                        // 21
            ["udp", "fd00:ec2::254", 80, 23],                        // 22
            ["udp_gw6", 53, 24],                                     // 23 DNS is the IPv4 forwarder's
        ]),
    );
    let seen = sniff.seen();
    let mut got = [0u8; 64];
    let host_got = u4.recv_from(&mut got).is_ok() || u6.recv_from(&mut got).is_ok();
    assert!(seen.contains(&1), "control: UDP to an outside host must leave the sandbox: {seen:?} {}", p.r["output"]);
    let mut problems = leaked(
        &seen,
        &[
            (2, "UDP to 169.254.169.254 (metadata)"),
            (3, "limited broadcast 255.255.255.255"),
            (4, "broadcast of the sandbox's own /30"),
            (5, "multicast 224.0.0.251"),
            (6, "IPv6 all-nodes multicast ff02::1"),
            (7, "UDP to the gateway port 123"),
            (8, "UDP to the gateway port 9999"),
            (9, "UDP to the IPv6 default gateway port 9998"),
            (12, "UDP to pool 10.213.0.1"),
            (13, "UDP to pool 10.213.0.6"),
            (14, "UDP to pool fd6f:7073:7276::1"),
            (15, "UDP to pool fd6f:7073:7276::6"),
            (16, "SSDP multicast 239.255.255.250"),
            (19, "UDP to ::ffff:169.254.169.254"),
            (21, "UDP to 100.100.100.200 (Alibaba metadata)"),
            (22, "UDP to 168.63.129.16 (Azure WireServer)"),
            (23, "UDP to fd00:ec2::254 (AWS IPv6 metadata)"),
            (24, "UDP to the IPv6 gateway's port 53 (a host resolver there answers any name)"),
        ],
    );
    // Markers 10, 11, 20 (HOST's uplink addresses) do reach HOST's veth in allow-any mode: the
    // sandbox ruleset only knows the gateway; the host table's input chain rejects them there.
    // What matters is that no socket on the host receives them.
    if host_got {
        problems.push("a UDP datagram reached a socket on the agent's host".into());
    }
    eprintln!(
        "reached HOST's veth (rejected by the host table): {:?}",
        seen.intersection(&[10, 11, 20].into()).collect::<Vec<_>>()
    );
    for (i, what) in [(16, "TCP to 169.254.169.254:80"), (17, "TCP to pool 10.213.0.6:80")] {
        if let Some(pr) = not_blocked(p.step(i), what) {
            problems.push(pr);
        }
    }
    assert!(problems.is_empty(), "{}\nsteps: {}", problems.join("\n"), p.r["output"]["steps"]);
    drop(sniff);
    assert_host_clean(&lab);
}

const QTYPE_TXT: u16 = 16;
const QTYPE_ANY: u16 = 255;
const QTYPE_NULL: u16 = 10;
const REFUSED: u64 = 5;

/// The forwarder against hostile queries: names outside the allow list in every type, over UDP
/// and TCP, must be REFUSED without reaching the upstream (no exfiltration through the
/// resolver); a wire name whose label contains a dot ("x.example" + "test": a child of "test",
/// not of example.test) must not pass for `*.example.test`; answers pointing at
/// ::ffff:127.0.0.1, ::ffff:169.254.169.254, 0.0.0.0, CGNAT or the NAT64 image of the
/// metadata address must be refused as rebinding.
#[test]
fn dns_forwarder_hostile_queries() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let s11 = lab.banner("198.51.100.11:80");
    lab.dns.set("x.example.test", &["198.51.100.11"]);
    lab.dns.set("mapped.test", &["::ffff:127.0.0.1"]);
    lab.dns.set("mapped2.test", &["::ffff:169.254.169.254"]);
    lab.dns.set("zero.test", &["0.0.0.0"]);
    lab.dns.set("cgnat.test", &["100.64.0.1"]);
    lab.dns.set("nat64.test", &["64:ff9b::a9fe:a9fe"]);
    lab.dns.set("exfil-secret.other.test", &["198.51.100.11"]);
    let conf = Conf::new("");
    let allowed =
        ["allowed.test", "*.example.test", "mapped.test", "mapped2.test", "zero.test", "cgnat.test", "nat64.test"];
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": allowed, "denied_hosts": ["bad.example.test"], "allowed_ports": [80]}),
        limits(),
        json!([
            ["dns_raw", "udp", ["other", "test"], QTYPE_TXT],                 // 0
            ["dns_raw", "udp", ["other", "test"], QTYPE_ANY],                 // 1
            ["dns_raw", "udp", ["other", "test"], QTYPE_NULL],                // 2
            ["dns_raw", "tcp", ["exfil-secret", "other", "test"], QTYPE_TXT], // 3
            ["dns_raw", "udp", ["exfil-secret", "other", "test"], 1],         // 4
            ["dns_raw", "udp", ["x.example", "test"], 1],                     // 5 escaped-dot label
            ["connect", "198.51.100.11", 80, 2],                              // 6 after 5
            ["dns_raw", "udp", ["mapped", "test"], 28],                       // 7
            ["dns_raw", "udp", ["mapped2", "test"], 28],                      // 8
            ["dns_raw", "udp", ["zero", "test"], 1],                          // 9
            ["dns_raw", "udp", ["cgnat", "test"], 1],                         // 10
            ["dns_raw", "udp", ["nat64", "test"], 28],                        // 11
            ["dns_raw", "udp", ["BAD", "Example", "TEST"], 1],                // 12 case
            ["dns_raw", "tcp", ["allowed", "test"], 1],                       // 13 control
            ["dns_raw", "udp", ["allowed.test"], 1],                          // 14 one label "allowed.test" at the root
        ]),
    );
    let mut problems = Vec::new();
    for (i, what) in [
        (0, "TXT other.test (not allowed)"),
        (1, "ANY other.test"),
        (2, "NULL other.test"),
        (3, "TXT exfil-secret.other.test over TCP"),
        (4, "A exfil-secret.other.test"),
        (5, "A for wire name [x.example][test] under allow *.example.test"),
        (7, "AAAA mapped.test -> ::ffff:127.0.0.1"),
        (8, "AAAA mapped2.test -> ::ffff:169.254.169.254"),
        (9, "A zero.test -> 0.0.0.0"),
        (10, "A cgnat.test -> 100.64.0.1"),
        (12, "A BAD.Example.TEST (denied, other case)"),
        (14, "A for the single label 'allowed.test'"),
    ] {
        if p.step(i)["rcode"].as_u64() != Some(REFUSED) {
            problems.push(format!("{what}: want REFUSED, got {}", p.step(i)));
        }
    }
    assert_eq!(p.step(13)["rcode"], 0, "control: allowed.test over TCP: {}", p.step(13));
    for name in ["other.test", "exfil-secret.other.test"] {
        if lab.dns.asked(name) {
            problems.push(format!("the upstream was asked about {name} (not in allowed_hosts)"));
        }
    }
    if lab.dns.asked("x.example.test") {
        problems.push("the upstream was asked about wire name [x.example][test] (not below example.test)".into());
    }
    if let Some(pr) = not_blocked(p.step(6), "198.51.100.11:80 after the escaped-label lookup") {
        problems.push(pr);
    }
    if s11.accepted() > 0 {
        problems.push(format!(
            "198.51.100.11:80 (never the address of an allowed name) accepted {} connection(s)",
            s11.accepted()
        ));
    }
    eprintln!("upstream log: {:?}", lab.dns.log());
    eprintln!("nat64.test (64:ff9b::a9fe:a9fe): {}", p.step(11));
    assert!(
        problems.is_empty(),
        "{}\nsteps: {}\nsandbox: {}",
        problems.join("\n"),
        p.r["output"]["steps"],
        p.r["sandbox"]
    );
    assert_host_clean(&lab);
}

/// An AAAA answer in the NAT64 well-known prefix (RFC 6052) embedding the metadata address:
/// behind a NAT64 gateway 64:ff9b::a9fe:a9fe *is* 169.254.169.254. README: answers pointing
/// into link-local are refused as rebinding. (Hardening: the lab has no NAT64 to go through.)
#[test]
fn dns_rebinding_via_nat64_prefix() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    lab.dns.set("nat64.test", &["64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1"]);
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["nat64.test"]}),
        limits(),
        json!([["dns_raw", "udp", ["nat64", "test"], 28]]),
    );
    assert_eq!(
        p.step(0)["rcode"].as_u64(),
        Some(REFUSED),
        "AAAA 64:ff9b::a9fe:a9fe / 64:ff9b::7f00:1 accepted: {}",
        p.step(0)
    );
    assert_host_clean(&lab);
}

/// The network's own NAT64 prefix (`network.egress.nat64_prefixes`), here in RFC 8215's
/// local-use /48: an answer in it is judged by the IPv4 address it embeds — a public one is
/// passed on, the metadata service refused — where without the setting every answer in the
/// /48 is refused (README: DNS rebinding).
#[test]
fn dns_answers_in_the_networks_own_nat64_prefix_are_judged_by_the_address_they_embed() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    lab.dns.set("public.test", &["64:ff9b:1:2::c633:640a"]);
    lab.dns.set("meta.test", &["64:ff9b:1:2::a9fe:a9fe"]);
    let steps = json!([["dns_raw", "udp", ["public", "test"], 28], ["dns_raw", "udp", ["meta", "test"], 28]]);
    let manifest = json!({"outbound": true, "allowed_hosts": ["public.test", "meta.test"]});
    let named = Conf::new("    nat64_prefixes: [\"64:ff9b:1:2::/96\"]\n");
    let p = probe(&lab, &named, manifest.clone(), limits(), steps.clone());
    assert_eq!(p.step(0)["rcode"].as_u64(), Some(0), "a public address through the named prefix: {}", p.step(0));
    assert_eq!(p.step(1)["rcode"].as_u64(), Some(REFUSED), "the metadata service through it: {}", p.step(1));
    let unnamed = Conf::new("");
    let p = probe(&lab, &unnamed, manifest, limits(), steps);
    assert_eq!(p.step(0)["rcode"].as_u64(), Some(REFUSED), "the /48 without the setting: {}", p.step(0));
    assert_host_clean(&lab);
}

/// A bandwidth cap of 10 Mbit/s with eight parallel flows: the token bucket is per link, so
/// the total must stay at the cap (README: each direction shaped).
#[test]
fn bandwidth_limit_with_many_flows() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let _src = lab.source("198.51.100.10:9000", 30);
    let sink = lab.sink("198.51.100.11:9001");
    let conf = Conf::new("");
    let p = probe(
        &lab,
        &conf,
        json!({"outbound": true, "allowed_hosts": ["198.51.100.10"], "allowed_ports": [9000]}),
        json!({"max_cpu_percent": 50, "timeout_seconds": 60, "max_bandwidth_mbps": 10}),
        json!([["multi_download", "198.51.100.10", 9000, 8, 3]]),
    );
    let d = p.step(0);
    let bps = d["bytes_per_second"].as_f64().unwrap_or(0.0);
    let want = 10.0 * 1_000_000.0 / 8.0;
    assert!(bps > 0.0, "{d}");
    assert!(bps <= want * 1.25, "8 flows together at {:.2} Mbit/s over a 10 Mbit/s cap", bps * 8.0 / 1e6);
    let _ = sink;
    assert_host_clean(&lab);
}

/// SIGKILL of `opservant run` while a sandbox with egress runs: the sandbox must not survive
/// and HOST must be clean again (veth, pool addresses, nft table `inet opservant`) within the
/// settle time plus the collector's 2 s linger — or at the latest after the next run.
#[test]
fn sigkill_mid_run_leaves_nothing_behind() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let conf = Conf::new("");
    let pkg = probe_package(&json!({"outbound": true, "allowed_hosts": ["198.51.100.10"]}), &limits());
    let params = json!({"steps": [["sleep", 20]]}).to_string();
    let launch = common::launch_args();
    let mut args: Vec<String> = vec!["run".into(), pkg.str().into()];
    args.extend(launch.iter().cloned());
    args.extend(["--config".into(), conf.arg().into(), "--params".into(), params]);
    let mut child = {
        let _view = common::host_view();
        lab.host_command(common::opservant())
            .args(&args)
            .env_remove("OPSERVANT_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn opservant in HOST")
    };
    // Wait for the host end of the sandbox's veth.
    let t0 = Instant::now();
    while !lab.host.links().iter().any(|l| l.starts_with("opsv")) {
        assert!(t0.elapsed() < Duration::from_secs(30), "no opsv link appeared in HOST");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let before = lab.host_leftovers(&POOL_PREFIXES);
    // SAFETY: kill(2) on the pid of our own child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
    let after_kill = leftovers_within(&lab, SETTLE);
    // The sandbox's processes die with it, as the kernel gets to them.
    let t0 = Instant::now();
    let survivors = loop {
        let survivors = common::host_processes_with(pkg.str());
        if survivors.is_empty() || t0.elapsed() >= SETTLE {
            break survivors;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Clean up what we started if it survived (by pid).
    for pid in &survivors {
        // SAFETY: kill(2) on a pid this test's run started (found by its package path).
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    // The next run.
    let params2 = json!({"steps": [["udp", "198.51.100.10", 80, 1]]}).to_string();
    let out = run_in(&lab, &pkg.path, &["--config", conf.arg(), "--params", &params2]);
    let _ = out.completed();
    let after_next = leftovers_within(&lab, SETTLE);
    eprintln!("while running: {before:?}\nafter SIGKILL: {after_kill:?}\nsurvivors: {survivors:?}\nafter next run: {after_next:?}");
    let mut problems = Vec::new();
    if !survivors.is_empty() {
        problems.push(format!("sandbox processes survived the agent's SIGKILL: {survivors:?}"));
    }
    if !after_kill.is_empty() {
        problems.push(format!("left in HOST {} s after SIGKILL: {after_kill:?}", SETTLE.as_secs()));
    }
    if !after_next.is_empty() {
        problems.push(format!("still left in HOST after the next complete run: {after_next:?}"));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// An agent that stops removes the host table when no run holds it: under systemd the
/// collector a run started is killed with the service (`KillMode=mixed`), and the table —
/// the host's forwarding and NAT rules for sandboxes — would stay until the next run.
#[test]
fn a_stopping_agent_removes_the_idle_host_table() {
    if !prerequisites() {
        return;
    }
    let lab = Lab::new();
    let dir = HostDir::new();
    let p = |s: &str| dir.path.join(s);
    let keygen = common::command().args(["keygen", "--out"]).arg(p("keys")).output().unwrap();
    assert!(keygen.status.success(), "{}", String::from_utf8_lossy(&keygen.stderr));
    let socket = p("agent.sock");
    let config = p("config.yaml");
    std::fs::write(
        &config,
        format!(
            "agent:\n  platform_public_key: {}\n  state_dir: {}\n  socket: {}\naudit:\n  path: {}\n\
             network:\n  egress:\n    dns_upstream: [\"{DNS_SERVER}\"]\n",
            p("keys/signing.pub").display(),
            p("state").display(),
            socket.display(),
            p("audit/audit.jsonl").display()
        ),
    )
    .unwrap();
    let mut agent = lab
        .host_command(common::opservant())
        .args(["agent", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the agent in HOST");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "the agent did not start listening");
        std::thread::sleep(Duration::from_millis(20));
    }
    // What a service's stop leaves: the table, and no collector pending to remove it (the
    // lease directory exists once any run with egress has happened since boot).
    std::fs::create_dir_all("/run/opservant/net").unwrap();
    lab.host.nft_apply("table inet opservant {\n}\n");
    assert!(lab.host.nft_tables().iter().any(|t| t == "table inet opservant"));
    // SAFETY: kill(2) on the pid of our own child, not yet reaped.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let status = agent.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(lab.host.nft_tables(), Vec::<String>::new(), "the idle host table outlived the agent");
}
