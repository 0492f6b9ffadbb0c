//! Network egress for a sandbox: a veth pair, addresses from a pool, NAT through the
//! agent's own nftables table, and an egress ruleset inside the sandbox's namespace.
//!
//! Without egress a sandbox's network namespace holds only loopback (see [`crate::init`]);
//! nothing here runs. With egress, [`attach`] wires a sandbox whose namespaces exist but
//! whose payload has not started, in this order — [`reserve`] before the sandbox is
//! spawned (steps 1–3), [`Reservation::attach`] from the parent's namespace hook (4–5):
//!
//! 1. forwarding: IPv4 forwarding must be on in the agent's namespace (or the plan may
//!    switch it on); IPv6 is used only where IPv6 forwarding is on — otherwise the sandbox
//!    gets no IPv6 address and the report says why;
//! 2. a shared lease on the host table (`table inet opservant`), created if absent; the last
//!    lease holder to leave deletes it, at once or through a deferred collector
//!    ([`HostTableRelease`]);
//! 3. a pool slot: an exclusive lock file per slot, and a host interface `opsv<slot>` that
//!    must not exist yet (a pair of an ended sandbox may still be being reclaimed by the
//!    kernel; such a slot is skipped, never waited for); only a holder of the slot's lock
//!    creates that interface, so the name stays free until `attach`;
//! 4. the veth pair: the host end `opsv<slot>` here, the peer `eth0` created directly inside
//!    the sandbox's namespace; addresses (IPv6 without DAD), link up, default routes, a
//!    token-bucket qdisc on both ends when a bandwidth cap is set;
//! 5. the sandbox's egress ruleset ([`nft`]), one atomic batch.
//!
//! Any failure is an error: the sandbox does not start with less network isolation than
//! asked. Teardown never deletes the veth (that costs 12–60 ms): dropping [`Egress`] closes
//! the sockets that keep the sandbox's namespace alive, and the kernel reclaims the pair
//! with the namespace.

mod link;
mod netlink;
pub mod nft;

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use thiserror::Error;

use netlink::Netlink;

/// The TCP port of the agent's forward proxy on each sandbox link's IPv4 gateway (with
/// `network.proxy`): the sandbox's ruleset and the host table let a sandbox reach it, and
/// nothing else of the host but DNS. Fixed, because the host table, shared by every run,
/// names it; outside the ephemeral range and away from the usual proxy ports, so that a
/// proxy on the host itself (3128, 8080) does not hold it.
pub const PROXY_PORT: u16 = 13128;

/// A network failure, naming the operation and the kernel's answer.
#[derive(Debug, Error)]
pub enum NetError {
    #[error("{what} {op}: {source}")]
    Io { what: &'static str, op: String, source: std::io::Error },
    #[error("{what} {op}: {}{}", std::io::Error::from_raw_os_error(*errno), if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    Kernel { what: &'static str, op: String, errno: i32, detail: String },
    #[error("{what} {op}: {message}")]
    Protocol { what: &'static str, op: String, message: String },
    #[error("{0}")]
    Unavailable(String),
    #[error("the address pool {0} has no free slot")]
    PoolExhausted(String),
}

impl NetError {
    pub(crate) fn io(what: &'static str, op: &str, source: std::io::Error) -> Self {
        NetError::Io { what, op: op.into(), source }
    }
}

/// An IPv4 or IPv6 network: an address and a prefix length (a host has the full length).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct IpNet {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl IpNet {
    pub fn host(addr: IpAddr) -> Self {
        Self { addr, prefix: if addr.is_ipv4() { 32 } else { 128 } }
    }

    fn bits(&self) -> u8 {
        if self.addr.is_ipv4() {
            32
        } else {
            128
        }
    }

    fn as_u128(a: IpAddr) -> u128 {
        match a {
            IpAddr::V4(a) => u128::from(u32::from(a)),
            IpAddr::V6(a) => u128::from(a),
        }
    }

    fn mask(&self) -> u128 {
        let bits = u32::from(self.bits());
        let host_bits = bits - u32::from(self.prefix);
        let all = if bits == 128 { u128::MAX } else { (1u128 << bits) - 1 };
        if host_bits == 0 {
            all
        } else if host_bits >= 128 {
            0
        } else {
            all & !((1u128 << host_bits) - 1)
        }
    }

    pub(crate) fn mask_bytes(&self) -> Vec<u8> {
        self.bytes_of(self.mask())
    }

    pub(crate) fn network_bytes(&self) -> Vec<u8> {
        self.bytes_of(Self::as_u128(self.addr) & self.mask())
    }

    fn bytes_of(&self, v: u128) -> Vec<u8> {
        if self.addr.is_ipv4() {
            (v as u32).to_be_bytes().to_vec()
        } else {
            v.to_be_bytes().to_vec()
        }
    }

    /// Whether `a` lies within this network.
    pub fn contains(&self, a: IpAddr) -> bool {
        a.is_ipv4() == self.addr.is_ipv4()
            && (Self::as_u128(a) & self.mask()) == (Self::as_u128(self.addr) & self.mask())
    }

    /// Whether all of `other` lies within this network.
    pub fn covers(&self, other: &IpNet) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }

    /// The `n`-th address of this network (0 is the network address).
    fn nth(&self, n: u128) -> IpAddr {
        let v = (Self::as_u128(self.addr) & self.mask()) + n;
        match self.addr {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(v as u32)),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(v)),
        }
    }
}

impl FromStr for IpNet {
    type Err = String;

    /// `ADDR` or `ADDR/PREFIX`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a.parse().map_err(|_| format!("'{s}' is not an IP address or CIDR"))?;
        let mut net = IpNet::host(addr);
        if let Some(p) = p {
            let prefix: u8 = p.parse().map_err(|_| format!("'{s}': prefix length is not a number"))?;
            if prefix > net.bits() {
                return Err(format!("'{s}': prefix length above {}", net.bits()));
            }
            net.prefix = prefix;
        }
        Ok(net)
    }
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// What the sandbox may reach (see [`nft`] for the chain it becomes).
#[derive(Debug, Clone, Default)]
pub struct Firewall {
    /// DNS (udp/tcp 53) to the gateway, where the agent's forwarder answers.
    pub dns: bool,
    /// Always blocked (the manifest's deny list); checked first.
    pub deny: Vec<IpNet>,
    /// Reachable on the allowed ports.
    pub allow: Vec<IpNet>,
    /// Dynamic allow sets exist: addresses obtained through allowed names ([`DynamicAllow`]).
    pub dynamic: bool,
    /// Blocked unless covered by `allow` or the dynamic sets (link-local, metadata, …).
    pub always_denied: Vec<IpNet>,
    /// Without an allow list: any other address on the allowed ports.
    pub allow_any: bool,
    /// Allowed destination port ranges for TCP and UDP; empty means every port.
    pub ports: Vec<(u16, u16)>,
    /// The agent's forward proxy ([`PROXY_PORT`] on the IPv4 gateway, TCP) is reachable,
    /// whatever the allow list and ports say: it judges each request by them itself.
    pub proxy: bool,
    /// The address pools: never reachable (the other links' gateways are the host's), but
    /// for the sandbox's own gateway's DNS and proxy.
    pub pool: Vec<IpNet>,
    /// New connections (anything but loopback) are blocked while the sandbox has this many
    /// tracked: each is also an entry in the host's conntrack table, shared by the host.
    pub max_connections: u32,
    /// New connections (any packet but loopback, replies and related ones) past this many
    /// per second, with a burst of as many, are blocked: a closed connection stays in the
    /// host's conntrack table (TIME_WAIT) after it stops counting towards `max_connections`.
    pub max_new_per_second: u32,
}

/// The address pool sandboxes take their point-to-point links from.
#[derive(Debug, Clone)]
pub struct Pool {
    /// Carved into /30s: `.1` the host end (gateway), `.2` the sandbox.
    pub v4: IpNet,
    /// Carved into /126s the same way, when IPv6 forwarding is on.
    pub v6: Option<IpNet>,
    /// Where slot and host-table lock files live (root-only).
    pub lock_dir: PathBuf,
}

impl Pool {
    fn slots(&self) -> u32 {
        let n = 1u64 << (30u32.saturating_sub(u32::from(self.v4.prefix))).min(16);
        let n6 = self.v6.map_or(u64::MAX, |v6| 1u64 << (126u32.saturating_sub(u32::from(v6.prefix))).min(16));
        n.min(n6) as u32
    }

    /// Check the pool's shape: IPv4 prefix ≤ 30, IPv6 prefix ≤ 126.
    pub fn validate(&self) -> Result<(), String> {
        if !self.v4.addr.is_ipv4() || self.v4.prefix > 30 {
            return Err(format!("{}: needs an IPv4 network of /30 or larger", self.v4));
        }
        if let Some(v6) = self.v6 {
            if !v6.addr.is_ipv6() || v6.prefix > 126 {
                return Err(format!("{v6}: needs an IPv6 network of /126 or larger"));
            }
        }
        Ok(())
    }
}

/// Everything [`attach`] needs.
#[derive(Debug, Clone)]
pub struct EgressPlan {
    pub pool: Pool,
    pub firewall: Firewall,
    /// Shape traffic in each direction to this many bytes per second.
    pub bandwidth_bytes: Option<u64>,
    /// Switch IPv4 forwarding on if it is off, instead of refusing (IPv6 forwarding is only
    /// read: see [`check_forwarding`]).
    pub manage_forwarding: bool,
    /// What the last sandbox to leave does with the host table.
    pub release: HostTableRelease,
}

/// A wired sandbox network. Dropping it lets the kernel reclaim the pair with the namespace.
pub struct Egress {
    pub host_if: String,
    pub address4: Ipv4Addr,
    pub gateway4: Ipv4Addr,
    pub address6: Option<Ipv6Addr>,
    pub gateway6: Option<Ipv6Addr>,
    /// Why there is no IPv6, when there is none.
    pub ipv6_unavailable: Option<String>,
    nf: Arc<Mutex<Netlink>>,
    /// [`DynamicAllow::until`], shared by every handle on this sandbox's sets.
    allowed_until: Arc<Mutex<std::collections::HashMap<IpAddr, std::time::Instant>>>,
    // Field order is drop order: the sockets first (the namespace may go), then the slot,
    // then the lease (whose last holder deletes the host table).
    _slot: File,
    _lease: HostLease,
}

/// Adds addresses to a sandbox's dynamic allow sets (the DNS forwarder holds one).
#[derive(Clone)]
pub struct DynamicAllow {
    nf: Arc<Mutex<Netlink>>,
    /// Until when each address is in the sets, as far as this sandbox's allows put it there
    /// (the sets are the sandbox's own). Entries are dropped at each allow once 2 s past
    /// their time, so this may name addresses the kernel has let go of — and holds at most
    /// the set's size of others.
    until: Arc<Mutex<std::collections::HashMap<IpAddr, std::time::Instant>>>,
}

impl DynamicAllow {
    /// Allow each address for (at least) its time in milliseconds: an address allowed for
    /// longer already keeps its later expiry, one allowed for less is renewed — so an
    /// address stays allowed for as long as any answer that gave it lets a resolver cache it.
    /// Connections already established outlive it.
    pub fn allow(&self, addrs: &[(IpAddr, u64)]) -> Result<(), NetError> {
        // An address is remembered a while past its expiry: the kernel's own expiry comes a
        // little later than ours (it starts counting when it gets the element, rounded up
        // to its tick), and an address it may still hold must be renewed (deleted and added
        // again), never just added — before kernel 6.10 that leaves its old timeout.
        const GRACE: std::time::Duration = std::time::Duration::from_secs(2);
        let mut until = self.until.lock().unwrap_or_else(|p| p.into_inner());
        let mut nl = self.nf.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        until.retain(|_, t| *t + GRACE > now);
        // One entry per address, for its longest time in this answer (an upstream's answer
        // may repeat one thousands of times).
        let mut wanted: std::collections::HashMap<IpAddr, u64> = std::collections::HashMap::new();
        for &(addr, ms) in addrs {
            let w = wanted.entry(addr).or_insert(ms);
            *w = (*w).max(ms);
        }
        let mut added: Vec<(IpAddr, u64)> = Vec::new();
        let mut renewed: Vec<(IpAddr, u64)> = Vec::new();
        for (addr, ms) in wanted {
            match until.get(&addr) {
                Some(t) if *t >= now + std::time::Duration::from_millis(ms) => {}
                Some(_) => renewed.push((addr, ms)),
                None => added.push((addr, ms)),
            }
        }
        if added.is_empty() && renewed.is_empty() {
            return Ok(());
        }
        // Recorded as soon as the kernel has it, whatever fails after.
        let record = |until: &mut std::collections::HashMap<IpAddr, std::time::Instant>, done: &[(IpAddr, u64)]| {
            for &(addr, ms) in done {
                until.insert(addr, now + std::time::Duration::from_millis(ms));
            }
        };
        match nft::add_dynamic(&mut nl, &added, &renewed) {
            // A renewed address the kernel no longer holds (the transaction was refused as a
            // whole): the new ones first, then each renewed one on its own — deleted and
            // added, or only added when the kernel has none to delete.
            Err(NetError::Kernel { errno, .. }) if errno == libc::ENOENT && !renewed.is_empty() => {
                nft::add_dynamic(&mut nl, &added, &[])?;
                record(&mut until, &added);
                for one in renewed.chunks(1) {
                    match nft::add_dynamic(&mut nl, &[], one) {
                        Err(NetError::Kernel { errno, .. }) if errno == libc::ENOENT => {
                            nft::add_dynamic(&mut nl, one, &[])?
                        }
                        other => other?,
                    }
                    record(&mut until, one);
                }
            }
            other => {
                other?;
                record(&mut until, &added);
                record(&mut until, &renewed);
            }
        }
        Ok(())
    }
}

impl Egress {
    pub fn dynamic_allow(&self) -> DynamicAllow {
        DynamicAllow { nf: self.nf.clone(), until: self.allowed_until.clone() }
    }

    /// Packets the ruleset rejected so far (each refused connection attempt counts once).
    pub fn blocked(&self) -> Result<u64, NetError> {
        let mut nl = self.nf.lock().unwrap_or_else(|p| p.into_inner());
        nft::blocked_packets(&mut nl)
    }
}

/// What the last sandbox to leave does with the host table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostTableRelease {
    /// Leave it (a long-running agent deletes it at shutdown: [`delete_idle_host_table`]).
    Keep,
    /// Delete it at once (costs 10–15 ms: the kernel waits for an RCU grace period).
    DeleteNow,
    /// Start `program args…` detached unless such a collector is already pending — it
    /// should call [`collect_idle_host_table`], so a burst of short runs reuses one table
    /// instead of paying for it each time.
    Deferred { program: PathBuf, args: Vec<String> },
}

/// A shared lease on the host table of this network namespace: present while any sandbox
/// with egress runs.
struct HostLease {
    lock: File,
    release: HostTableRelease,
    lock_dir_for_gc: PathBuf,
}

/// The lease lock of the current network namespace (keyed by the namespace's inode, so
/// agents in different namespaces never share one).
fn host_lock_path(lock_dir: &Path) -> Result<PathBuf, NetError> {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata("/proc/thread-self/ns/net")
        .map_err(|e| NetError::io("netns", "stat /proc/thread-self/ns/net", e))?
        .ino();
    Ok(lock_dir.join(format!("host-table-{ino}.lock")))
}

impl HostLease {
    fn acquire(pool: &Pool, release: HostTableRelease, host: &mut Netlink) -> Result<Self, NetError> {
        reap_collectors();
        let lock = open_lock(&host_lock_path(&pool.lock_dir)?)?;
        flock(&lock, libc::LOCK_SH).map_err(|e| NetError::io("lock", "host table lease", e))?;
        let want = nft::host_table_tag(&pool.v4, pool.v6.as_ref());
        let found = match nft::host_table(host)? {
            Some(tag) => Some(tag),
            None if nft::create_host_table(host, &pool.v4, pool.v6.as_ref())? => {
                // Its collector starts with it, not only when a run ends: a run killed
                // (SIGKILL) never ends, and the table would stay until the next one.
                // One that cannot start is reported; this run's end tries again.
                if let HostTableRelease::Deferred { program, args } = &release {
                    if let Err(e) = start_collector(program, args, &pool.lock_dir) {
                        tracing::error!(error = %e, "host table collector: cannot start one at creation");
                    }
                }
                None
            }
            None => nft::host_table(host)?,
        };
        if let Some(tag) = found.filter(|t| *t != want) {
            // Made for other pools (it would not masquerade this sandbox's traffic), or by
            // another version of opservant, with other rules: replaced, once no run holds it
            // (no lease but this one: the exclusive lock keeps newcomers out until the new
            // table is there). One for other pools was refused even unused, and one left by
            // an agent killed together with its collector then refused every egress run of
            // an agent configured with new pools until a clean stop of the old.
            if flock(&lock, libc::LOCK_EX | libc::LOCK_NB).is_err() {
                return Err(NetError::Unavailable(if nft::serves_pools(&tag, &pool.v4, pool.v6.as_ref()) {
                    format!(
                        "the host table `inet {}` was made by another version of opservant ({tag}; this one needs \
                         {want}) and runs still use it; it is replaced once they end",
                        nft::TABLE
                    )
                } else {
                    format!(
                        "the host table `inet {}` serves other pools ({tag}) and runs still use it; this \
                         configuration needs {want}: it is replaced once they end",
                        nft::TABLE
                    )
                }));
            }
            nft::delete_host_table(host)?;
            nft::create_host_table(host, &pool.v4, pool.v6.as_ref())?;
            // As at a creation: the collector starts with the table.
            if let HostTableRelease::Deferred { program, args } = &release {
                if let Err(e) = start_collector(program, args, &pool.lock_dir) {
                    tracing::error!(error = %e, "host table collector: cannot start one at the replacement");
                }
            }
            flock(&lock, libc::LOCK_SH).map_err(|e| NetError::io("lock", "host table lease", e))?;
            // The downgrade is not atomic: an idle-table collector may have deleted the new
            // table in between.
            if nft::host_table(host)?.is_none() && nft::create_host_table(host, &pool.v4, pool.v6.as_ref())? {
                if let HostTableRelease::Deferred { program, args } = &release {
                    if let Err(e) = start_collector(program, args, &pool.lock_dir) {
                        tracing::error!(error = %e, "host table collector: cannot start one at the re-creation");
                    }
                }
            }
            tracing::info!(old = %tag, new = %want, "host table of another version or other pools, unused, replaced");
        }
        Ok(Self { lock, release, lock_dir_for_gc: pool.lock_dir.clone() })
    }
}

impl Drop for HostLease {
    fn drop(&mut self) {
        if self.release == HostTableRelease::Keep {
            return;
        }
        // Only the last holder acts. Converting to exclusive is not atomic, but a newcomer
        // only checks for the table after its shared lock is granted, which cannot happen
        // while this exclusive lock is held.
        if flock(&self.lock, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            return;
        }
        match &self.release {
            HostTableRelease::Keep => {}
            HostTableRelease::DeleteNow => {
                if let Err(e) = Netlink::netfilter().and_then(|mut nl| nft::delete_host_table(&mut nl)) {
                    tracing::warn!(error = %e, "could not remove the host nftables table");
                }
            }
            HostTableRelease::Deferred { program, args } => {
                // The last lease holder: nothing uses the table; without a collector it goes now.
                if let Err(e) = start_collector(program, args, &self.lock_dir_for_gc) {
                    tracing::error!(error = %e, "host table collector: cannot start one; removing the table now");
                    if let Err(e) = Netlink::netfilter().and_then(|mut nl| nft::delete_host_table(&mut nl)) {
                        tracing::error!(error = %e, "could not remove the host nftables table");
                    }
                }
            }
        }
    }
}

/// Collectors this process started and has not reaped yet. A long-running agent is their
/// parent: each is reaped by the next start or lease (a finished one stays a zombie only
/// until then), so they cannot pile up; a one-shot command exits before it matters.
static COLLECTORS: Mutex<Vec<std::process::Child>> = Mutex::new(Vec::new());

/// Reap the collectors that have ended (`try_wait`, never blocking).
fn reap_collectors() {
    let mut children = COLLECTORS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    children.retain_mut(|c| matches!(c.try_wait(), Ok(None)));
}

/// Start the deferred collector (`program args…`, detached in its own process group)
/// unless one is pending. One collector per namespace at a time: it holds the pending lock
/// until it has deleted the table, so a burst of runs starts one collector, not one each.
fn start_collector(program: &Path, args: &[String], lock_dir: &Path) -> Result<(), String> {
    reap_collectors();
    let pending = host_lock_path(lock_dir)
        .map(|p| p.with_extension("gc"))
        .and_then(|p| open_lock(&p))
        .map_err(|e| e.to_string())?;
    if flock(&pending, libc::LOCK_EX | libc::LOCK_NB).is_err() {
        return Ok(());
    }
    drop(pending);
    use std::os::unix::process::CommandExt;
    std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .map(|child| COLLECTORS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(child))
        .map_err(|e| format!("{}: {e}", program.display()))
}

/// The deferred collector: take the pending lock (or leave it to the collector that holds
/// it), then every `interval` try to delete this namespace's host table while no sandbox
/// holds a lease on it. Returns once it is deleted (`true`) or another collector is pending
/// (`false`).
///
/// Ordering: the pending lock is released *before* the lease lock, so a sandbox that ends
/// after the deletion always finds no collector pending and starts a new one.
pub fn collect_idle_host_table(lock_dir: &Path, interval: std::time::Duration) -> Result<bool, NetError> {
    let lease_path = host_lock_path(lock_dir)?;
    let pending = open_lock(&lease_path.with_extension("gc"))?;
    if flock(&pending, libc::LOCK_EX | libc::LOCK_NB).is_err() {
        return Ok(false);
    }
    let lease = open_lock(&lease_path)?;
    loop {
        std::thread::sleep(interval);
        if flock(&lease, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
            let mut nl = Netlink::netfilter()?;
            let deleted = nft::delete_host_table(&mut nl);
            drop(pending);
            drop(lease);
            return deleted.map(|()| true);
        }
    }
}

/// Whether the kernel answers nftables requests (a read-only query of the ruleset's
/// generation; nothing is created).
pub fn nftables_available() -> Result<(), NetError> {
    let mut nl = Netlink::netfilter()?;
    nft::generation(&mut nl).map(|_| ())
}

/// Delete this namespace's host table now unless a sandbox holds a lease on it — for an
/// agent that stops: the collector it started would be killed with it (a service's
/// processes end with the service), leaving the table. `Ok(false)` when there is no table or
/// a lease is held (that run's own release then deals with it).
pub fn delete_idle_host_table(lock_dir: &Path) -> Result<bool, NetError> {
    let mut nl = Netlink::netfilter()?;
    if nft::host_table(&mut nl)?.is_none() {
        return Ok(false);
    }
    // Held exclusively while the table goes: a newcomer's shared lock waits for it and then
    // finds no table, and makes a new one.
    let lease = open_lock(&host_lock_path(lock_dir)?)?;
    if flock(&lease, libc::LOCK_EX | libc::LOCK_NB).is_err() {
        return Ok(false);
    }
    nft::delete_host_table(&mut nl)?;
    Ok(true)
}

fn open_lock(path: &Path) -> Result<File, NetError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| NetError::io("lock", &format!("create {}", dir.display()), e))?;
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| NetError::io("lock", &format!("open {}", path.display()), e))
}

fn flock(f: &File, op: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor this File owns; no memory is passed.
        let rc = unsafe { libc::flock(f.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn read_sysctl(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// IPv4 forwarding on (or switched on, with `manage`), and whether IPv6 can be used (or why
/// not). IPv6 forwarding is only ever read: switching it on for the whole host stops router
/// advertisements being accepted where `accept_ra` is 1, so a SLAAC host would lose its IPv6
/// default route — an operator's decision, never the agent's.
fn check_forwarding(manage: bool) -> Result<Option<String>, NetError> {
    const V4: &str = "/proc/sys/net/ipv4/ip_forward";
    const V6: &str = "/proc/sys/net/ipv6/conf/all/forwarding";
    if read_sysctl(V4).as_deref() != Some("1") {
        if !manage {
            return Err(NetError::Unavailable(
                "IPv4 forwarding is off (net.ipv4.ip_forward=0): install the shipped sysctl drop-in (systemd/sysctl.d/60-opservant.conf) or set network.egress.manage_forwarding".into(),
            ));
        }
        std::fs::write(V4, "1").map_err(|e| NetError::io("sysctl", "switch on net.ipv4.ip_forward", e))?;
    }
    match read_sysctl(V6).as_deref() {
        None => Ok(Some("IPv6 is disabled on this host".into())),
        Some("1") => Ok(None),
        Some(_) => Ok(Some("IPv6 forwarding is off (net.ipv6.conf.all.forwarding=0)".into())),
    }
}

/// Netlink sockets bound inside the network namespace `ns` (made on a short-lived thread
/// that joins it; the sockets stay in that namespace and keep it alive).
fn sockets_in(ns: &OwnedFd) -> Result<(Netlink, Netlink), NetError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| NetError::io("setns", "join the sandbox's network namespace", e.into()))?;
            Ok((Netlink::route()?, Netlink::netfilter()?))
        })
        .join()
        .unwrap_or_else(|_| {
            Err(NetError::Protocol { what: "setns", op: "join".into(), message: "helper thread panicked".into() })
        })
    })
}

/// A pool slot reserved for one sandbox, before the sandbox exists: its addresses are known
/// (for the sandbox's `/etc/resolv.conf`), its lock is held and its host interface name is
/// free. [`Reservation::attach`] wires it once the sandbox's namespaces exist.
pub struct Reservation {
    pub host_if: String,
    pub address4: Ipv4Addr,
    pub gateway4: Ipv4Addr,
    pub address6: Option<Ipv6Addr>,
    pub gateway6: Option<Ipv6Addr>,
    /// Why there is no IPv6, when there is none.
    pub ipv6_unavailable: Option<String>,
    plan: EgressPlan,
    slot: File,
    lease: HostLease,
}

/// Check forwarding, take the host-table lease and reserve a slot (steps 1–3).
pub fn reserve(plan: &EgressPlan) -> Result<Reservation, NetError> {
    plan.pool.validate().map_err(NetError::Unavailable)?;
    let v6_unavailable = check_forwarding(plan.manage_forwarding)?;
    let pool6 = if v6_unavailable.is_none() { plan.pool.v6 } else { None };
    let ipv6_unavailable = match (&v6_unavailable, plan.pool.v6) {
        (_, None) => Some("no IPv6 pool is configured".into()),
        (Some(why), _) => Some(why.clone()),
        (None, Some(_)) => None,
    };
    let pool = Pool { v6: pool6, ..plan.pool.clone() };
    let mut host_nf = Netlink::netfilter()?;
    let lease = HostLease::acquire(&pool, plan.release.clone(), &mut host_nf)?;
    drop(host_nf);

    for slot in 0..pool.slots() {
        let lock = open_lock(&pool.lock_dir.join(format!("slot-{slot}")))?;
        if flock(&lock, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            continue;
        }
        let host_if = format!("{}{slot}", nft::HOST_IF_PREFIX);
        // The pair of a sandbox that just ended may still be being reclaimed; skip it.
        if nix::net::if_::if_nametoindex(host_if.as_str()).is_ok() {
            continue;
        }
        let base4 = IpNet { addr: pool.v4.nth(u128::from(slot) * 4), prefix: 30 };
        let (IpAddr::V4(gateway4), IpAddr::V4(address4)) = (base4.nth(1), base4.nth(2)) else {
            unreachable!("an IPv4 pool yields IPv4 addresses")
        };
        let v6 = pool6.map(|p| {
            let base = IpNet { addr: p.nth(u128::from(slot) * 4), prefix: 126 };
            match (base.nth(1), base.nth(2)) {
                (IpAddr::V6(g), IpAddr::V6(a)) => (g, a),
                _ => unreachable!("an IPv6 pool yields IPv6 addresses"),
            }
        });
        return Ok(Reservation {
            host_if,
            address4,
            gateway4,
            address6: v6.map(|(_, a)| a),
            gateway6: v6.map(|(g, _)| g),
            ipv6_unavailable,
            plan: EgressPlan { pool, ..plan.clone() },
            slot: lock,
            lease,
        });
    }
    Err(NetError::PoolExhausted(pool.v4.to_string()))
}

impl Reservation {
    /// Wire the network of the sandbox whose monitor `monitor` is (steps 4–5). Call from
    /// the parent's namespace hook, before the payload starts.
    pub fn attach(self, monitor: &crate::MonitorProc<'_>) -> Result<Egress, NetError> {
        let ns: OwnedFd =
            monitor.namespace("net").map_err(|e| NetError::io("netns", "open the sandbox's network namespace", e))?;
        let (mut inner_route, mut inner_nf) = sockets_in(&ns)?;
        let mut host = Netlink::route()?;
        let plan = &self.plan;
        let v6 = self.gateway6.zip(self.address6);

        // Host end.
        link::add_veth(&mut host, &self.host_if, "eth0", ns.as_fd())?;
        let host_index = link::index_of(&mut host, &self.host_if)?;
        let mut ops =
            vec![link::no_ipv6_autoconf(host_index), link::add_address(host_index, IpAddr::V4(self.gateway4), 30)];
        if let Some((g, _)) = v6 {
            ops.push(link::add_address(host_index, IpAddr::V6(g), 126));
        }
        if let Some(rate) = plan.bandwidth_bytes {
            ops.push(link::add_tbf(host_index, rate));
        }
        ops.push(link::set_up(host_index));
        link::apply(&mut host, ops, "configure the host end")?;

        // Sandbox end (the order matters: routes need the link up).
        let inner_index = link::index_of(&mut inner_route, "eth0")?;
        let mut ops =
            vec![link::no_ipv6_autoconf(inner_index), link::add_address(inner_index, IpAddr::V4(self.address4), 30)];
        if let Some((_, a)) = v6 {
            ops.push(link::add_address(inner_index, IpAddr::V6(a), 126));
        }
        if let Some(rate) = plan.bandwidth_bytes {
            ops.push(link::add_tbf(inner_index, rate));
        }
        ops.push(link::set_up(inner_index));
        ops.push(link::add_default_route(inner_index, IpAddr::V4(self.gateway4)));
        if let Some((g, _)) = v6 {
            ops.push(link::add_default_route(inner_index, IpAddr::V6(g)));
        }
        link::apply(&mut inner_route, ops, "configure the sandbox end")?;
        nft::load_sandbox_ruleset(
            &mut inner_nf,
            &plan.firewall,
            (self.address4, self.gateway4),
            v6.map(|(g, a)| (a, g)),
        )?;
        tracing::debug!(host_if = self.host_if, address = %self.address4, "egress attached");
        Ok(Egress {
            host_if: self.host_if,
            address4: self.address4,
            gateway4: self.gateway4,
            address6: self.address6,
            gateway6: self.gateway6,
            ipv6_unavailable: self.ipv6_unavailable,
            nf: Arc::new(Mutex::new(inner_nf)),
            allowed_until: Arc::default(),
            _slot: self.slot,
            _lease: self.lease,
        })
    }
}

#[cfg(test)]
mod tests {
    /// Held by the tests that start or reap collectors: a lease's `reap_collectors` in one
    /// test would reap the zombie another test waits to see.
    static COLLECTOR_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn an_ended_collector_is_reaped_by_the_next_start() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var_os("CI").is_none(), "CI runs the tests as root");
            return;
        }
        let _serial = COLLECTOR_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::temp_dir().join(format!("opservant-gc-test-{}", std::process::id()));
        let state = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next().map(str::to_string)))
        };
        super::start_collector(Path::new("/bin/true"), &[], &dir).unwrap();
        let pid = super::COLLECTORS.lock().unwrap().last().map(std::process::Child::id).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while state(pid).as_deref() != Some("Z") {
            assert!(std::time::Instant::now() < deadline, "the collector did not end: {:?}", state(pid));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // The next start reaps it (and starts one more, reaped in turn).
        super::start_collector(Path::new("/bin/true"), &[], &dir).unwrap();
        assert_eq!(state(pid), None, "the ended collector is reaped, not left a zombie");
        let next = super::COLLECTORS.lock().unwrap().last().map(std::process::Child::id).unwrap();
        while state(next).as_deref() != Some("Z") {
            assert!(std::time::Instant::now() < deadline, "the collector did not end");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        super::reap_collectors();
        assert_eq!(state(next), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    use super::*;

    /// Run `test` (as root; else a skip, a failure under CI) on a thread in a network
    /// namespace of its own (unshare affects the calling thread), with a lock directory of
    /// its own named by `tag`, removed afterwards.
    fn in_private_netns(tag: &str, test: impl FnOnce(&Path) + Send + 'static) {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var_os("CI").is_none(), "CI runs the tests as root");
            return;
        }
        let dir = std::env::temp_dir().join(format!("opservant-{tag}-test-{}", std::process::id()));
        std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            std::fs::create_dir_all(&dir).unwrap();
            test(&dir);
            let _ = std::fs::remove_dir_all(&dir);
        })
        .join()
        .unwrap();
    }

    /// A host table an earlier version made (its tag without the rules' version), or one for
    /// other pools, is replaced when no run holds it, refused while one does.
    #[test]
    fn a_host_table_of_another_version_is_replaced_once_unused() {
        let _serial = COLLECTOR_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        in_private_netns("hosttable", |dir| {
            let dir = dir.to_path_buf();
            let pool = Pool { v4: "10.213.0.0/16".parse().unwrap(), v6: None, lock_dir: dir.clone() };
            let mut nl = Netlink::netfilter().unwrap();
            let old_tag = "opservant pools 10.213.0.0/16";
            assert!(nft::create_host_table_tagged(&mut nl, old_tag, &pool.v4, None).unwrap());

            // A run of the old version still holds it: refused, left alone.
            let holder = open_lock(&host_lock_path(&dir).unwrap()).unwrap();
            flock(&holder, libc::LOCK_SH).unwrap();
            let err = HostLease::acquire(&pool, HostTableRelease::Keep, &mut nl).err().expect("refused while held");
            assert!(err.to_string().contains("made by another version of opservant"), "{err}");
            assert_eq!(nft::host_table(&mut nl).unwrap().as_deref(), Some(old_tag));
            drop(holder);

            let lease = HostLease::acquire(&pool, HostTableRelease::Keep, &mut nl).expect("replaced");
            let want = nft::host_table_tag(&pool.v4, None);
            assert_eq!(nft::host_table(&mut nl).unwrap(), Some(want.clone()));
            assert!(want.ends_with(&format!(" rules {}", nft::HOST_RULES_VERSION)), "{want}");
            drop(lease);

            // Other pools: refused while a run holds the table, replaced once none does
            // (a table an agent left when it was killed with its collector had refused every
            // egress run of an agent with new pools).
            let other = Pool { v4: "10.214.0.0/16".parse().unwrap(), v6: None, lock_dir: dir.clone() };
            let holder = open_lock(&host_lock_path(&dir).unwrap()).unwrap();
            flock(&holder, libc::LOCK_SH).unwrap();
            let err = HostLease::acquire(&other, HostTableRelease::Keep, &mut nl).err().expect("other pools, held");
            assert!(err.to_string().contains("serves other pools"), "{err}");
            assert_eq!(nft::host_table(&mut nl).unwrap(), Some(want));
            drop(holder);
            let lease = HostLease::acquire(&other, HostTableRelease::Keep, &mut nl).expect("replaced once unused");
            assert_eq!(nft::host_table(&mut nl).unwrap(), Some(nft::host_table_tag(&other.v4, None)));
            drop(lease);
        });
    }

    #[test]
    fn an_idle_host_table_is_deleted_and_a_held_one_kept() {
        in_private_netns("idletable", |dir| {
            let mut nl = Netlink::netfilter().unwrap();
            assert!(!delete_idle_host_table(dir).unwrap(), "no table: nothing to delete");
            let pool4: IpNet = "10.215.0.0/16".parse().unwrap();
            assert!(nft::create_host_table(&mut nl, &pool4, None).unwrap());
            // A run holds a lease: kept.
            let holder = open_lock(&host_lock_path(dir).unwrap()).unwrap();
            flock(&holder, libc::LOCK_SH).unwrap();
            assert!(!delete_idle_host_table(dir).unwrap());
            assert!(nft::host_table(&mut nl).unwrap().is_some(), "a held table was deleted");
            drop(holder);
            assert!(delete_idle_host_table(dir).unwrap());
            assert_eq!(nft::host_table(&mut nl).unwrap(), None);
        });
    }

    /// An address's time in the allow set is renewed by a later, longer answer, also once
    /// the kernel has let it go but the forwarder still remembers it, and never cut short by
    /// a later, shorter one.
    #[test]
    fn an_allowed_address_is_renewed_never_cut_short() {
        in_private_netns("renew", |_| {
            let nft = |args: &[&str], stdin: &str| {
                let mut child = std::process::Command::new("nft")
                    .args(args)
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .expect("nft");
                std::io::Write::write_all(&mut child.stdin.take().unwrap(), stdin.as_bytes()).unwrap();
                let out = child.wait_with_output().unwrap();
                assert!(out.status.success(), "nft {args:?}");
                String::from_utf8(out.stdout).unwrap()
            };
            nft(
                &["-f", "-"],
                &format!(
                    "table inet {} {{\n set {} {{ type ipv4_addr; flags timeout; }}\n set {} {{ type ipv6_addr; flags timeout; }}\n}}\n",
                    nft::TABLE,
                    nft::DYN4,
                    nft::DYN6
                ),
            );
            // Seconds until `addr` leaves the set, if it is there.
            let expires = |addr: &str| -> Option<u64> {
                let listed: serde_json::Value =
                    serde_json::from_str(&nft(&["-j", "list", "set", "inet", nft::TABLE, nft::DYN4], "")).unwrap();
                listed["nftables"].as_array()?.iter().find_map(|o| {
                    o["set"]["elem"]
                        .as_array()?
                        .iter()
                        .find_map(|e| (e["elem"]["val"] == addr).then(|| e["elem"]["expires"].as_u64().unwrap_or(0)))
                })
            };
            let allow = DynamicAllow { nf: Arc::new(Mutex::new(Netlink::netfilter().unwrap())), until: Arc::default() };
            let (x, y): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
            allow.allow(&[(x, 60_000)]).unwrap();
            allow.allow(&[(x, 1_000), (x, 2_000)]).unwrap();
            assert!(expires("192.0.2.1").is_some_and(|s| s >= 50), "cut short: {:?}", expires("192.0.2.1"));
            allow.allow(&[(y, 1_000)]).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1_300));
            assert_eq!(expires("192.0.2.2"), None, "the kernel let it go");
            allow.allow(&[(y, 30_000)]).unwrap();
            assert!(expires("192.0.2.2").is_some_and(|s| s >= 25), "not renewed: {:?}", expires("192.0.2.2"));
        });
    }

    #[test]
    fn nets_parse_and_match() {
        let n: IpNet = "10.1.2.0/24".parse().unwrap();
        assert!(n.contains("10.1.2.200".parse().unwrap()));
        assert!(!n.contains("10.1.3.1".parse().unwrap()));
        assert_eq!(n.mask_bytes(), vec![255, 255, 255, 0]);
        assert_eq!("10.1.2.3/8".parse::<IpNet>().unwrap().network_bytes(), vec![10, 0, 0, 0]);
        let h: IpNet = "192.0.2.7".parse().unwrap();
        assert_eq!(h.prefix, 32);
        assert_eq!(h.mask_bytes(), vec![255; 4]);
        let z: IpNet = "0.0.0.0/0".parse().unwrap();
        assert!(z.contains("8.8.8.8".parse().unwrap()));
        assert!(!z.contains("::1".parse().unwrap()));
        let v6: IpNet = "fd00:1::/32".parse().unwrap();
        assert!(v6.contains("fd00:1:ffff::1".parse().unwrap()));
        assert_eq!(v6.mask_bytes()[..5], [255, 255, 255, 255, 0]);
        assert!("10.0.0.0/33".parse::<IpNet>().is_err());
        assert!("host.example".parse::<IpNet>().is_err());
        assert!(v6.covers(&"fd00:1:2::/48".parse().unwrap()));
        assert!(!v6.covers(&"fd00::/16".parse().unwrap()));
    }

    #[test]
    fn pool_slots_are_point_to_point_links() {
        let p = Pool { v4: "10.213.0.0/16".parse().unwrap(), v6: None, lock_dir: "/nonexistent".into() };
        assert_eq!(p.slots(), 16384);
        let base = IpNet { addr: p.v4.nth(3 * 4), prefix: 30 };
        assert_eq!(base.nth(1).to_string(), "10.213.0.13");
        assert_eq!(base.nth(2).to_string(), "10.213.0.14");
        assert!(Pool { v4: "10.0.0.0/31".parse().unwrap(), ..p.clone() }.validate().is_err());
    }
}
