//! Network egress policy: from a manifest's `permissions.network` and the agent's
//! configuration to the sandbox's firewall ([`sandbox::net::Firewall`]), its DNS forwarder
//! ([`crate::dns`]) and the proxy environment.
//!
//! Rules (seed 001, DESIGN.md §3):
//! - `outbound: false` (the default): no egress at all — the sandbox keeps loopback only;
//! - `allowed_hosts` entries are IPv4/IPv6 addresses, CIDRs, hostnames (`api.example.com`)
//!   or wildcards (`*.example.com`: any name below example.com, not example.com itself);
//!   without `allowed_hosts`, any host that is not denied;
//! - `denied_hosts` (same forms) always wins: denied names are refused by the forwarder,
//!   denied networks are dropped first, and literal denied names are resolved when the
//!   sandbox starts so their addresses are dropped too;
//! - hostnames are enforced through DNS: the forwarder resolves only permitted names and adds
//!   their addresses to the sandbox's allow set for the record's TTL (at least
//!   [`MIN_TTL_S`], at most [`MAX_TTL_S`], to which the answer's own TTLs are lowered; a
//!   later answer renews an address, never shortens its time); with only hostnames allowed,
//!   an address not obtained that way is unreachable;
//! - answers pointing at loopback, private, link-local, CGNAT, multicast or reserved ranges
//!   are refused (DNS rebinding) unless an `allowed_hosts` entry covers them;
//! - link-local (cloud metadata), loopback, multicast, reserved and the agent's own pool are
//!   unreachable unless an `allowed_hosts` entry covers them;
//! - `allowed_ports` apply to TCP and UDP; empty means every port;
//! - `dns_allowed` (default from `network.executor_defaults`, else true): DNS only to the
//!   agent's forwarder, never to another resolver;
//! - the bandwidth cap (`resource_limits.max_bandwidth_mbps`) shapes each direction.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use sandbox::net::{EgressPlan, Firewall, IpNet, Pool};

use crate::config::{Config, ConfigError};
use crate::manifest::NetworkPermissions;
use crate::policy::PolicyError;

pub const DEFAULT_POOL_V4: &str = "10.213.0.0/16";
/// `network.egress.max_connections` by default.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;
/// `network.egress.max_new_connections_per_second` by default.
pub const DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND: u32 = 100;
pub const DEFAULT_POOL_V6: &str = "fd6f:7073:7276::/48";
/// Where the slot and host-table locks live.
pub const LOCK_DIR: &str = "/run/opservant/net";
/// Floor and ceiling of the time an address obtained through DNS stays allowed.
pub const MIN_TTL_S: u64 = 10;
pub const MAX_TTL_S: u64 = 3600;

/// One `allowed_hosts` / `denied_hosts` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    Net(IpNet),
    /// A lower-case name without the trailing dot.
    Name(String),
    /// `*.suffix`: any name strictly below `suffix`.
    Below(String),
}

impl HostPattern {
    pub fn parse(s: &str) -> Result<HostPattern, String> {
        let t = s.trim();
        if t.is_empty() {
            return Err("empty host".into());
        }
        if t.contains(':') || t.contains('/') || t.parse::<IpAddr>().is_ok() {
            return t.parse::<IpNet>().map(|net| HostPattern::Net(ipv4_if_mapped(net)));
        }
        if t.chars().all(|c| c.is_ascii_digit() || c == '.') {
            return Err(format!("'{s}' is not an IPv4 address"));
        }
        let lower = t.trim_end_matches('.').to_ascii_lowercase();
        let (wild, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, lower.clone()),
        };
        valid_hostname(&name).map_err(|why| format!("'{s}': {why}"))?;
        Ok(if wild { HostPattern::Below(name) } else { HostPattern::Name(name) })
    }

    /// Whether the (lower-case, dotless) `name` matches.
    pub fn matches_name(&self, name: &str) -> bool {
        match self {
            HostPattern::Net(_) => false,
            HostPattern::Name(n) => n == name,
            HostPattern::Below(suffix) => {
                name.len() > suffix.len() + 1 && name.ends_with(suffix.as_str()) && {
                    let cut = name.len() - suffix.len();
                    name.as_bytes()[cut - 1] == b'.'
                }
            }
        }
    }
}

/// An IPv4-mapped IPv6 network (`::ffff:a.b.c.d`, prefix 96 or longer) as the IPv4 network
/// it is: a connection to it leaves as IPv4 (an `AF_INET6` socket's mapped address is sent
/// as IPv4) and is matched by the IPv4 rules — as an IPv6 network it would match nothing,
/// and a denied entry would deny nothing.
fn ipv4_if_mapped(net: IpNet) -> IpNet {
    match net.addr {
        IpAddr::V6(a) if net.prefix >= 96 => match a.to_ipv4_mapped() {
            Some(v4) => IpNet { addr: IpAddr::V4(v4), prefix: net.prefix - 96 },
            None => net,
        },
        _ => net,
    }
}

pub(crate) fn valid_hostname(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 253 {
        return Err("not a hostname (1-253 characters)");
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err("not a hostname (empty or over-long label)");
        }
        if !label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err("not a hostname (letters, digits, '-' and '_' only; use *.domain for a wildcard)");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("not a hostname (a label starts or ends with '-')");
        }
    }
    Ok(())
}

/// The network policy of one executor with `outbound: true`.
#[derive(Debug, Clone)]
pub struct NetworkPolicy {
    /// `None`: any host not denied.
    pub allow: Option<Vec<HostPattern>>,
    pub deny: Vec<HostPattern>,
    pub ports: Vec<(u16, u16)>,
    pub dns: bool,
    pub bandwidth_mbps: u64,
    /// The NAT64 prefixes an IPv6 address may embed an IPv4 one in ([`nat64_prefixes`]).
    pub nat64: Vec<IpNet>,
}

/// Why the forwarder refuses a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameVerdict {
    Allowed,
    Denied,
    NotAllowed,
}

impl NetworkPolicy {
    /// `Ok(None)` for `outbound: false`. Errors name the manifest field.
    pub fn from_manifest(
        net: &NetworkPermissions,
        config: &Config,
        bandwidth_mbps: u64,
    ) -> Result<Option<NetworkPolicy>, PolicyError> {
        let parse = |field: &str, list: &[String]| -> Result<Vec<HostPattern>, PolicyError> {
            list.iter()
                .enumerate()
                .map(|(i, h)| HostPattern::parse(h).map_err(|e| PolicyError::new(format!("{field}[{i}]"), e)))
                .collect()
        };
        let allow = net.allowed_hosts.as_deref().map(|l| parse("permissions.network.allowed_hosts", l)).transpose()?;
        let deny = parse("permissions.network.denied_hosts", &net.denied_hosts)?;
        let mut ports = Vec::new();
        for (i, p) in net.allowed_ports.iter().enumerate() {
            ports.push(p.range().map_err(|e| PolicyError::new(format!("permissions.network.allowed_ports[{i}]"), e))?);
        }
        if !net.outbound {
            return Ok(None);
        }
        let dns = net.dns_allowed.or(config.network.executor_defaults.dns_allowed).unwrap_or(true);
        let nat64 = nat64_prefixes(config).map_err(|e| PolicyError::new(e.path, e.message))?;
        Ok(Some(NetworkPolicy { allow, deny, ports, dns, bandwidth_mbps, nat64 }))
    }

    /// Whether a DNS answer may not point at `addr` unless an allow entry covers it: an
    /// address in a [`special_ranges`] range or, in one of the network's NAT64 prefixes, one
    /// embedding an IPv4 address that is (`64:ff9b::a9fe:a9fe` is the metadata service
    /// behind a NAT64 gateway).
    pub fn is_special(&self, addr: IpAddr) -> bool {
        let addr = match addr {
            IpAddr::V6(a) => embedded_ipv4(&self.nat64, a).map_or(addr, IpAddr::V4),
            IpAddr::V4(_) => addr,
        };
        special_ranges().iter().any(|n| n.contains(addr))
    }

    pub fn name_verdict(&self, name: &str) -> NameVerdict {
        if self.deny.iter().any(|p| p.matches_name(name)) {
            return NameVerdict::Denied;
        }
        match &self.allow {
            None => NameVerdict::Allowed,
            Some(list) if list.iter().any(|p| p.matches_name(name)) => NameVerdict::Allowed,
            Some(_) => NameVerdict::NotAllowed,
        }
    }

    /// An `allowed_hosts` name or wildcard matches `name` (an allow list names it).
    pub fn names_explicitly(&self, name: &str) -> bool {
        self.allow.iter().flatten().any(|p| p.matches_name(name))
    }

    /// An `allowed_hosts` network covers `addr`.
    pub fn explicitly_allows(&self, addr: IpAddr) -> bool {
        self.allow.iter().flatten().any(|p| matches!(p, HostPattern::Net(n) if n.contains(addr)))
    }

    /// Hostnames are in the allow list (or there is no list): the forwarder feeds the
    /// dynamic sets only when there is a list with names.
    pub fn has_allowed_names(&self) -> bool {
        self.allow.iter().flatten().any(|p| !matches!(p, HostPattern::Net(_)))
    }

    /// Literal denied names (resolved at start so their addresses are dropped too).
    pub fn denied_names(&self) -> Vec<String> {
        self.deny
            .iter()
            .filter_map(|p| match p {
                HostPattern::Name(n) => Some(n.clone()),
                _ => None,
            })
            .collect()
    }
}

/// RFC 6052's well-known NAT64 prefix, always one of [`nat64_prefixes`]: denying through it
/// costs nothing where no NAT64 gateway answers it.
const WELL_KNOWN_NAT64: IpNet = IpNet { addr: IpAddr::V6(Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0)), prefix: 96 };

/// The NAT64 prefixes in which an IPv6 address is the IPv4 address of its last 32 bits: the
/// well-known `64:ff9b::/96` and the network's own (`network.egress.nat64_prefixes`, each an
/// IPv6 /96 without host bits — RFC 6052's shorter prefixes place the IPv4 address around
/// bits 64–71 and are not supported).
pub fn nat64_prefixes(c: &Config) -> Result<Vec<IpNet>, ConfigError> {
    let mut out = vec![WELL_KNOWN_NAT64];
    for (i, text) in c.network.egress.nat64_prefixes.iter().enumerate() {
        let err = |message: String| ConfigError { path: format!("network.egress.nat64_prefixes[{i}]"), message };
        let net: IpNet = text.parse().map_err(err)?;
        let IpAddr::V6(a) = net.addr else {
            return Err(err(format!("{text}: a NAT64 prefix is an IPv6 network")));
        };
        if net.prefix != 96 {
            return Err(err(format!(
                "{text}: only /96 NAT64 prefixes are supported (RFC 6052's shorter ones place the IPv4 address around bits 64-71)"
            )));
        }
        if u128::from(a) & 0xffff_ffff != 0 {
            return Err(err(format!(
                "{text}: the prefix has bits set past its 96th (write it as {}/96)",
                Ipv6Addr::from(u128::from(a) & !0xffff_ffff)
            )));
        }
        if !out.contains(&net) {
            out.push(net);
        }
    }
    Ok(out)
}

/// The IPv4 address `a` embeds, when it lies in one of the NAT64 `prefixes` (/96s).
fn embedded_ipv4(prefixes: &[IpNet], a: Ipv6Addr) -> Option<Ipv4Addr> {
    prefixes.iter().any(|p| p.contains(IpAddr::V6(a))).then(|| Ipv4Addr::from((u128::from(a) & 0xffff_ffff) as u32))
}

/// The ranges `v4` and, for the IPv4 ones, the same as reached through each NAT64 prefix
/// (/96s: `PREFIX::a.b.c.d` reaches `a.b.c.d` through a NAT64 gateway, wherever the host
/// has one) and through 6to4: such an address is as special, or as unreachable, or as
/// denied, as the IPv4 address it embeds.
fn with_nat64(v4: &[IpNet], prefixes: &[IpNet]) -> Vec<IpNet> {
    let mut out = v4.to_vec();
    for net in v4 {
        if let IpAddr::V4(a) = net.addr {
            for p in prefixes {
                let IpAddr::V6(base) = p.addr else { continue };
                let embedded = Ipv6Addr::from(u128::from(base) | u128::from(u32::from(a)));
                out.push(IpNet { addr: IpAddr::V6(embedded), prefix: 96 + net.prefix });
            }
            // 6to4 (`2002:AABB:CCDD::/48` is `A.B.C.D`, through a host's 6to4 tunnel).
            let embedded = Ipv6Addr::from((0x2002u128 << 112) | (u128::from(u32::from(a)) << 80));
            out.push(IpNet { addr: IpAddr::V6(embedded), prefix: 16 + net.prefix });
        }
    }
    out
}

/// Address ranges a DNS answer may not point into unless an allow entry covers them (parsed
/// once). An address in a NAT64 prefix is judged by the IPv4 address it embeds
/// ([`NetworkPolicy::is_special`]); other NAT64 addresses stay ordinary (they are how an
/// IPv6-only host reaches IPv4).
pub fn special_ranges() -> &'static [IpNet] {
    static RANGES: std::sync::OnceLock<Vec<IpNet>> = std::sync::OnceLock::new();
    RANGES.get_or_init(|| {
        [
            "0.0.0.0/8",
            "10.0.0.0/8",
            "100.64.0.0/10",
            "127.0.0.0/8",
            "169.254.0.0/16",
            // Azure's WireServer (metadata outside 169.254/16; the others are in 100.64/10
            // and fc00::/7 above and below).
            "168.63.129.16/32",
            "172.16.0.0/12",
            // IETF protocol assignments (192.0.0.170/171: NAT64 discovery) and the
            // benchmarking range, which some networks and fake-IP proxies use inside.
            "192.0.0.0/24",
            "198.18.0.0/15",
            "192.168.0.0/16",
            "224.0.0.0/4",
            "240.0.0.0/4",
            // IPv4-compatible (`::169.254.169.254`; loopback and unspecified with it).
            "::/96",
            "::ffff:0:0/96",
            // 6to4 and Teredo, which embed IPv4 addresses (`2002:a9fe:a9fe::1` is 6to4's
            // 169.254.169.254) reached through a host's tunnel, and deprecated site-local.
            "2002::/16",
            "2001::/32",
            "fec0::/10",
            // RFC 8215's local-use NAT64 prefix: where in it an IPv4 address is embedded is
            // the operator's choice, so none of it is taken from a DNS answer unless allowed —
            // or named as the network's NAT64 prefix (`network.egress.nat64_prefixes`).
            "64:ff9b:1::/48",
            "fc00::/7",
            "fe80::/10",
            "ff00::/8",
        ]
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect()
    })
}

/// Ranges never reachable by IP unless allowed explicitly (private ranges are reachable in
/// allow-any mode; only DNS answers into them are refused) — among them the cloud instance
/// metadata services: link-local (AWS, GCP, Azure IMDS, OpenStack), and those elsewhere:
/// Alibaba's `100.100.100.200`, Azure's WireServer `168.63.129.16`, AWS's IPv6 IMDS
/// `fd00:ec2::254`.
fn unreachable_ranges(pool: &Pool, nat64: &[IpNet]) -> Vec<IpNet> {
    let mut v: Vec<IpNet> = [
        "0.0.0.0/8",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "100.100.100.200/32",
        "168.63.129.16/32",
        "fd00:ec2::254/128",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::/128",
        "::1/128",
        "::ffff:0:0/96",
        // IPv4-compatible addresses (a host's automatic `sit` tunnel sends them as IPv4);
        // the IPv4 ranges' 6to4 forms come with their NAT64 ones below.
        "::/96",
        "fe80::/10",
        "ff00::/8",
    ]
    .iter()
    .filter_map(|s| s.parse().ok())
    .collect();
    v.push(pool.v4);
    v.extend(pool.v6);
    with_nat64(&v, nat64)
}

/// One proxy URL of `network.proxy`.
#[derive(Debug, Clone)]
pub struct ProxyUrl {
    pub url: String,
    pub scheme: String,
    pub host: String,
    pub port: u16,
}

/// The proxy of seed 001: executors reach it through the agent's own proxy
/// ([`crate::egress_proxy`]), which judges each request by their network policy.
#[derive(Debug, Clone, Default)]
pub struct ProxySettings {
    pub http: Option<ProxyUrl>,
    pub https: Option<ProxyUrl>,
    pub no_proxy: Vec<String>,
}

impl ProxySettings {
    pub fn is_configured(&self) -> bool {
        self.http.is_some() || self.https.is_some()
    }

    /// The sandbox's environment: the agent's proxy on `gateway` for each configured scheme
    /// (upper- and lower-case names), and `NO_PROXY`.
    pub fn env(&self, gateway: Ipv4Addr) -> Vec<(String, String)> {
        let mut env = Vec::new();
        let ours = format!("http://{gateway}:{}", sandbox::net::PROXY_PORT);
        for (key, url) in [("http", &self.http), ("https", &self.https)] {
            if url.is_some() {
                env.push((format!("{}_PROXY", key.to_uppercase()), ours.clone()));
                env.push((format!("{key}_proxy"), ours.clone()));
            }
        }
        if !self.no_proxy.is_empty() {
            let list = self.no_proxy.join(",");
            env.push(("NO_PROXY".into(), list.clone()));
            env.push(("no_proxy".into(), list));
        }
        env
    }

    /// The configured proxies, resolved through `resolvers` (as before the sandbox's start:
    /// a proxy that cannot be resolved refuses the run), with their credentials.
    pub fn upstreams(&self, resolvers: &[SocketAddr]) -> Result<crate::egress_proxy::Upstreams, String> {
        let resolve = |key: &str, p: &ProxyUrl| -> Result<crate::egress_proxy::Upstream, String> {
            if p.scheme != "http" {
                return Err(format!(
                    "network.proxy.{key}: executors reach the proxy through the agent's own, which speaks plain HTTP to it: an {}:// proxy URL is not supported for runs with egress",
                    p.scheme
                ));
            }
            let addrs = match p.host.parse::<IpAddr>() {
                Ok(a) => vec![a],
                // Every address (A and AAAA answered in full), or no run: the sandbox is
                // denied the proxy's addresses, and one a partial answer missed stays open.
                Err(_) => crate::dns::resolve_every(&p.host, resolvers)
                    .map_err(|e| format!("network.proxy: cannot resolve {}: {e}", p.host))?,
            };
            if addrs.is_empty() {
                return Err(format!("network.proxy: {} has no address", p.host));
            }
            let credentials = proxy_credentials(&p.url).map(|(user, password)| {
                let decoded = |t: &str| percent_decoded(t).unwrap_or_else(|| t.to_string());
                (decoded(user), decoded(password))
            });
            Ok(crate::egress_proxy::Upstream::with_credentials(
                format!("{}:{}", p.host, p.port),
                addrs.into_iter().map(|a| SocketAddr::new(a, p.port)).collect(),
                credentials,
            ))
        };
        let names = [&self.http, &self.https]
            .into_iter()
            .flatten()
            .filter(|p| p.host.parse::<IpAddr>().is_err())
            .map(|p| p.host.trim_end_matches('.').to_ascii_lowercase())
            .collect();
        Ok(crate::egress_proxy::Upstreams {
            http: self.http.as_ref().map(|p| resolve("http", p)).transpose()?,
            https: self.https.as_ref().map(|p| resolve("https", p)).transpose()?,
            names,
        })
    }
}

/// The agent-wide egress settings (`network.egress`, `network.proxy`).
#[derive(Debug, Clone)]
pub struct EgressSettings {
    pub pool: Pool,
    pub manage_forwarding: bool,
    /// Connections one sandbox may have tracked at once (`network.egress.max_connections`).
    pub max_connections: u32,
    /// New connections per second (`network.egress.max_new_connections_per_second`).
    pub max_new_connections_per_second: u32,
    pub upstream: Vec<SocketAddr>,
    pub proxy: ProxySettings,
    /// [`nat64_prefixes`].
    pub nat64: Vec<IpNet>,
}

impl EgressSettings {
    pub fn from_config(c: &Config) -> Result<EgressSettings, ConfigError> {
        let err = |path: &str, message: String| ConfigError { path: path.into(), message };
        let e = &c.network.egress;
        let v4: IpNet =
            e.pool_v4.as_deref().unwrap_or(DEFAULT_POOL_V4).parse().map_err(|m| err("network.egress.pool_v4", m))?;
        let v6: Option<IpNet> = match e.pool_v6.as_deref() {
            Some("none") => None,
            other => Some(other.unwrap_or(DEFAULT_POOL_V6).parse().map_err(|m| err("network.egress.pool_v6", m))?),
        };
        let pool = Pool { v4, v6, lock_dir: PathBuf::from(LOCK_DIR) };
        pool.validate().map_err(|m| err("network.egress.pool", m))?;
        let mut upstream = Vec::new();
        for (i, u) in e.dns_upstream.iter().enumerate() {
            upstream.push(parse_endpoint(u, 53).map_err(|m| err(&format!("network.egress.dns_upstream[{i}]"), m))?);
        }
        let mut proxy = ProxySettings::default();
        if let Some(p) = &c.network.proxy {
            for (key, url, slot) in [("http", &p.http, &mut proxy.http), ("https", &p.https, &mut proxy.https)] {
                let Some(url) = url else { continue };
                let (host, port) = parse_proxy_url(url).map_err(|m| err(&format!("network.proxy.{key}"), m))?;
                let scheme = url.split_once("://").map(|(s, _)| s.to_string()).unwrap_or_default();
                *slot = Some(ProxyUrl { url: url.clone(), scheme, host, port });
            }
            proxy.no_proxy = p.no_proxy.clone();
        }
        // A per-sandbox limit: its default when absent, else within `1..=max`.
        let limit = |value: Option<u32>, default: u32, max: u32, path: &str| match value {
            None => Ok(default),
            Some(n) if (1..=max).contains(&n) => Ok(n),
            Some(n) => Err(err(path, format!("{n} is not within 1-{max}"))),
        };
        let max_connections =
            limit(e.max_connections, DEFAULT_MAX_CONNECTIONS, 65_536, "network.egress.max_connections")?;
        let max_new_connections_per_second = limit(
            e.max_new_connections_per_second,
            DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND,
            10_000,
            "network.egress.max_new_connections_per_second",
        )?;
        Ok(EgressSettings {
            pool,
            manage_forwarding: e.manage_forwarding,
            max_connections,
            max_new_connections_per_second,
            upstream,
            proxy,
            nat64: nat64_prefixes(c)?,
        })
    }

    /// The configured upstreams, or the nameservers of /etc/resolv.conf.
    pub fn upstreams(&self) -> Vec<SocketAddr> {
        if !self.upstream.is_empty() {
            return self.upstream.clone();
        }
        std::fs::read_to_string("/etc/resolv.conf")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("nameserver"))
            .filter_map(|a| a.trim().split('%').next()?.parse::<IpAddr>().ok())
            .map(|ip| SocketAddr::new(ip, 53))
            .collect()
    }
}

fn parse_endpoint(s: &str, default_port: u16) -> Result<SocketAddr, String> {
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok(sa);
    }
    s.parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, default_port))
        .map_err(|_| format!("'{s}' is not ADDR, ADDR:PORT or [V6]:PORT"))
}

/// `http://host:port[/]` → (host, port).
fn parse_proxy_url(url: &str) -> Result<(String, u16), String> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| format!("'{url}' is not a URL (scheme://host:port)"))?;
    let default_port = match scheme {
        "http" => 80,
        "https" => 443,
        _ => return Err(format!("'{url}': scheme must be http or https")),
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let authority = authority.rsplit('@').next().unwrap_or_default();
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or_else(|| format!("'{url}': unclosed ["))?;
        (h.to_string(), after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (authority.to_string(), None),
        }
    };
    if host.is_empty() {
        return Err(format!("'{url}': no host"));
    }
    let port = match port {
        Some(p) => p.parse::<u16>().map_err(|_| format!("'{url}': bad port"))?,
        None => default_port,
    };
    Ok((host.to_ascii_lowercase(), port))
}

/// The user and password of a proxy URL's user information (`http://USER:PASSWORD@host`),
/// if it has one — its authority read as [`parse_proxy_url`] reads it (to the first `/`, the
/// host after the last `@`), so a `?` or `#` left unencoded in the password is part of it.
fn proxy_credentials(url: &str) -> Option<(&str, &str)> {
    let (_, rest) = url.split_once("://")?;
    let authority = rest.split('/').next()?;
    let (userinfo, _) = authority.rsplit_once('@')?;
    Some(userinfo.split_once(':').unwrap_or((userinfo, "")))
}

/// The password of a proxy URL's user information, if it has one ([`proxy_credentials`]).
fn proxy_password(url: &str) -> Option<&str> {
    proxy_credentials(url).map(|(_, p)| p).filter(|p| !p.is_empty())
}

/// The shortest proxy password redacted as a value wherever it shows: a shorter one (or a
/// number such as `8080`) would take that text out of every egress run's result. In a URL's
/// user information any password is redacted ([`crate::redact`]).
pub const MIN_REDACTED_PROXY_PASSWORD: usize = 8;

/// `text` with its `%XX` escapes decoded, when it has any and they decode to UTF-8.
fn percent_decoded(text: &str) -> Option<String> {
    if !text.contains('%') {
        return None;
    }
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).and_then(|&c| hex(c)), b.get(i + 2).and_then(|&c| hex(c))) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// How long an idle host table outlives the last `opservant run` that used it.
pub const HOST_TABLE_LINGER_MS: u64 = 2000;

/// One-shot commands leave the host table to a collector (`opservant __net-gc`) that removes
/// it [`HOST_TABLE_LINGER_MS`] after the last sandbox with egress ended, unless another has
/// started meanwhile: deleting it costs 10–15 ms, which a burst of runs then pays once.
fn release_for_cli() -> sandbox::net::HostTableRelease {
    match std::env::current_exe() {
        Ok(program) => sandbox::net::HostTableRelease::Deferred {
            program,
            args: vec!["__net-gc".into(), HOST_TABLE_LINGER_MS.to_string()],
        },
        Err(_) => sandbox::net::HostTableRelease::DeleteNow,
    }
}

/// At the agent's shutdown, once its runs are over: delete the host table unless a run
/// (another process's) still holds it. Its collector would not outlive a service's stop.
pub fn release_host_table_at_shutdown() {
    // No egress run has happened on this host since boot (`/run` is memory): no table.
    if !std::path::Path::new(LOCK_DIR).exists() {
        return;
    }
    match sandbox::net::delete_idle_host_table(std::path::Path::new(LOCK_DIR)) {
        Ok(true) => tracing::info!("host nftables table removed"),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, "could not remove the host nftables table"),
    }
}

/// `opservant __net-gc DELAY_MS`: every DELAY_MS, delete the host table once nothing uses it.
pub fn collect_host_table(delay_ms: u64) -> Result<bool, String> {
    sandbox::net::collect_idle_host_table(std::path::Path::new(LOCK_DIR), std::time::Duration::from_millis(delay_ms))
        .map_err(|e| e.to_string())
}

/// Build the egress plan for `policy`: resolves literal denied names through the upstream
/// resolvers.
/// `also_deny`: addresses the sandbox may not reach whatever its policy says (the configured
/// proxy's: the agent's own proxy reaches it for the sandbox).
pub fn plan(policy: &NetworkPolicy, settings: &EgressSettings, also_deny: &[IpAddr]) -> Result<EgressPlan, String> {
    let mut allow = Vec::new();
    let mut deny = Vec::new();
    for p in policy.allow.iter().flatten() {
        if let HostPattern::Net(n) = p {
            allow.push(*n);
        }
    }
    for p in &policy.deny {
        if let HostPattern::Net(n) = p {
            deny.push(*n);
        }
    }
    let upstreams = settings.upstreams();
    for name in policy.denied_names() {
        // Every address of it, or no run: a lookup that failed (a timeout, SERVFAIL, an
        // unanswered AAAA) would leave the addresses it missed reachable by IP. A name
        // that does not exist has none to deny.
        let addrs = crate::dns::resolve_every(&name, &upstreams).map_err(|e| {
            format!("permissions.network.denied_hosts: cannot resolve {name} to deny its addresses: {e}")
        })?;
        deny.extend(addrs.into_iter().map(IpNet::host));
    }
    deny.extend(also_deny.iter().map(|a| IpNet::host(*a)));
    // A denied IPv4 network is denied through the NAT64 prefixes too, as the special ranges
    // are: behind a NAT64 gateway `64:ff9b::a.b.c.d` is `a.b.c.d`, and an allowed name's
    // DNS64 answer may be one.
    let deny = with_nat64(&deny, &settings.nat64);
    let always_denied: Vec<IpNet> = unreachable_ranges(&settings.pool, &settings.nat64)
        .into_iter()
        .filter(|r| !allow.iter().any(|a| a.covers(r)))
        .collect();
    Ok(EgressPlan {
        pool: settings.pool.clone(),
        firewall: Firewall {
            dns: policy.dns,
            deny,
            allow,
            dynamic: policy.has_allowed_names(),
            always_denied,
            allow_any: policy.allow.is_none(),
            ports: policy.ports.clone(),
            proxy: settings.proxy.is_configured(),
            pool: std::iter::once(settings.pool.v4).chain(settings.pool.v6).collect(),
            max_connections: settings.max_connections,
            max_new_per_second: settings.max_new_connections_per_second,
        },
        bandwidth_bytes: Some(policy.bandwidth_mbps * 1_000_000 / 8),
        manage_forwarding: settings.manage_forwarding,
        release: release_for_cli(),
    })
}

/// The egress of one executor run: reserved before the spawn, attached from the namespace
/// hook, reported after the run.
pub struct EgressRun {
    policy: std::sync::Arc<crate::egress::NetworkPolicy>,
    upstreams: Vec<std::net::SocketAddr>,
    reservation: Option<sandbox::net::Reservation>,
    egress: Option<sandbox::net::Egress>,
    forwarder: Option<crate::dns::Forwarder>,
    /// With `network.proxy`: the proxies the agent's own passes allowed requests to, and the
    /// address rules it judges targets written as addresses by.
    proxy_upstreams: Option<(crate::egress_proxy::Upstreams, crate::egress_proxy::AddressRules)>,
    proxy: Option<crate::egress_proxy::ProxyFilter>,
    /// The run's secret values as they are delivered (for the forwarder's records).
    redactor: crate::secrets::LiveRedactor,
}

impl EgressRun {
    /// Reserve a slot and add the sandbox's resolver configuration and proxy environment to
    /// `spec`.
    pub(crate) fn prepare(
        policy: &crate::egress::NetworkPolicy,
        config: &Config,
        spec: &mut sandbox::SandboxSpec,
        redactor: crate::secrets::LiveRedactor,
    ) -> Result<EgressRun, crate::executor_run::CannotRun> {
        let settings = crate::egress::EgressSettings::from_config(config)
            .map_err(|e| crate::executor_run::CannotRun(e.to_string()))?;
        let upstreams = settings.upstreams();
        if policy.dns && upstreams.is_empty() {
            return Err(crate::executor_run::CannotRun(
                "network: dns_allowed needs an upstream resolver (network.egress.dns_upstream or a nameserver in /etc/resolv.conf)".into(),
            ));
        }
        let proxies = match settings.proxy.is_configured() {
            true => Some(settings.proxy.upstreams(&upstreams).map_err(crate::executor_run::CannotRun)?),
            false => None,
        };
        // The configured proxy is the agent's proxy's to reach: directly (allow-any, an
        // allowed network or name covering it), the sandbox could ask it for anything.
        let proxy_addrs: Vec<IpAddr> = proxies
            .iter()
            .flat_map(|p| p.http.iter().chain(p.https.iter()))
            .flat_map(|u| u.addrs.iter().map(SocketAddr::ip))
            .collect();
        let plan = crate::egress::plan(policy, &settings, &proxy_addrs).map_err(crate::executor_run::CannotRun)?;
        let proxy_upstreams = match proxies {
            Some(p) => {
                let host = crate::egress_proxy::host_addresses()
                    .map_err(|e| crate::executor_run::CannotRun(format!("network egress: {e}")))?;
                let mut never: Vec<IpNet> = host.into_iter().map(IpNet::host).collect();
                never.push(settings.pool.v4);
                never.extend(settings.pool.v6);
                let rules = crate::egress_proxy::AddressRules::of(&plan.firewall)
                    .with_never(with_nat64(&never, &settings.nat64), p.names.clone());
                Some((p, rules))
            }
            None => None,
        };
        let reservation =
            sandbox::net::reserve(&plan).map_err(|e| crate::executor_run::CannotRun(format!("network egress: {e}")))?;
        spec.filesystem.synthetic.push(sandbox::SyntheticFile {
            path: "/etc/resolv.conf".into(),
            content: format!("nameserver {}\noptions timeout:2 attempts:2\n", reservation.gateway4),
        });
        spec.command.env.extend(settings.proxy.env(reservation.gateway4));
        // The proxy's credentials stay with the agent (its proxy adds them upstream); they
        // are still redacted from all that leaves the agent, as a delivered secret is
        // (DESIGN.md §4), should they show anywhere.
        for upstream in proxy_upstreams.iter().flat_map(|(p, _)| p.http.iter().chain(p.https.iter())) {
            if let Some(token) = upstream.authorization.as_deref().and_then(|a| a.strip_prefix("Basic ")) {
                if token.len() >= MIN_REDACTED_PROXY_PASSWORD {
                    redactor.add(token);
                }
            }
        }
        let urls = [&settings.proxy.http, &settings.proxy.https];
        for password in urls.into_iter().flatten().filter_map(|p| proxy_password(&p.url)) {
            let decoded = percent_decoded(password);
            for value in [Some(password), decoded.as_deref()].into_iter().flatten() {
                if value.chars().count() >= MIN_REDACTED_PROXY_PASSWORD {
                    redactor.add(value);
                }
            }
        }
        Ok(EgressRun {
            policy: std::sync::Arc::new(policy.clone()),
            upstreams,
            reservation: Some(reservation),
            egress: None,
            forwarder: None,
            proxy_upstreams,
            proxy: None,
            redactor,
        })
    }

    pub(crate) fn attach(
        &mut self,
        monitor: &sandbox::MonitorProc<'_>,
        executor: &str,
        command_id: &str,
    ) -> Result<(), String> {
        let r = self.reservation.take().ok_or("network egress: attached twice")?;
        let (gateway, client) = (r.gateway4, r.address4);
        let egress = r.attach(monitor).map_err(|e| format!("network egress: {e}"))?;
        let querier = || crate::dns::Querier {
            executor: executor.to_string(),
            command_id: command_id.to_string(),
            redactor: self.redactor.clone(),
        };
        if self.policy.dns {
            let allow = self.policy.has_allowed_names().then(|| egress.dynamic_allow());
            let fwd = crate::dns::Forwarder::spawn(
                std::net::SocketAddr::new(gateway.into(), 53),
                &egress.host_if,
                client.into(),
                self.policy.clone(),
                self.upstreams.clone(),
                allow,
                querier(),
            )
            .map_err(|e| format!("network egress: DNS forwarder on {gateway}:53: {e}"))?;
            self.forwarder = Some(fwd);
        }
        if let Some((upstreams, rules)) = self.proxy_upstreams.take() {
            let port = sandbox::net::PROXY_PORT;
            let proxy = crate::egress_proxy::ProxyFilter::spawn(
                std::net::SocketAddr::new(gateway.into(), port),
                &egress.host_if,
                client.into(),
                self.policy.clone(),
                rules,
                upstreams,
                querier(),
            )
            .map_err(|e| format!("network egress: the agent's proxy on {gateway}:{port}: {e}"))?;
            self.proxy = Some(proxy);
        }
        self.egress = Some(egress);
        Ok(())
    }

    /// Stop the forwarder, read the blocked counter, report, and let the network go.
    /// `redactor` holds every value the run was given: the refused names are the payload's
    /// queries, and a value can be one (in any case).
    pub(crate) fn finish(
        mut self,
        result: &mut crate::result::RunResult,
        executor: &str,
        redactor: &crate::secrets::Redactor,
    ) {
        let mut dns = self.forwarder.take().map(|f| f.stop()).unwrap_or_default();
        for r in &mut dns.refused_names {
            r.name = redactor.dns_name(&r.name);
        }
        let mut proxy = self.proxy.take().map(|p| p.stop());
        for r in proxy.iter_mut().flat_map(|p| p.refused_targets.iter_mut()) {
            r.target = redactor.dns_name(&r.target);
        }
        let Some(egress) = self.egress.take() else { return };
        let blocked = egress.blocked();
        if let Ok(n) = &blocked {
            if *n > 0 {
                crate::audit::record("network_blocked", &[("executor", executor), ("attempts", &n.to_string())]);
            }
        }
        result.limits.max_bandwidth_mbps = Some(self.policy.bandwidth_mbps);
        result.sandbox.network = "egress".into();
        result.sandbox.egress = Some(serde_json::json!({
            "interface": "eth0",
            "address": egress.address4.to_string(),
            "gateway": egress.gateway4.to_string(),
            "address6": egress.address6.map(|a| a.to_string()),
            "ipv6_unavailable": egress.ipv6_unavailable,
            "bandwidth_mbps": self.policy.bandwidth_mbps,
            "dns_allowed": self.policy.dns,
            "blocked": blocked.as_ref().ok(),
            "blocked_error": blocked.as_ref().err().map(|e| e.to_string()),
            "dns": dns,
            "proxy": proxy,
        }));
        drop(egress);
    }
}

impl Drop for EgressRun {
    /// On a path that never reached [`EgressRun::finish`] (a run that failed to start): the
    /// forwarder is stopped, its thread joined and its sockets closed before the link's
    /// slot is released — the next run to take the slot binds the same gateway address.
    fn drop(&mut self) {
        if let Some(f) = self.forwarder.take() {
            f.stop();
        }
        if let Some(p) = self.proxy.take() {
            p.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_patterns() {
        assert_eq!(HostPattern::parse("10.0.0.0/8").unwrap(), HostPattern::Net("10.0.0.0/8".parse().unwrap()));
        assert_eq!(HostPattern::parse("2001:db8::1").unwrap(), HostPattern::Net("2001:db8::1".parse().unwrap()));
        assert_eq!(HostPattern::parse("API.Example.com.").unwrap(), HostPattern::Name("api.example.com".into()));
        let w = HostPattern::parse("*.external.com").unwrap();
        assert!(w.matches_name("a.external.com") && w.matches_name("a.b.external.com"));
        assert!(!w.matches_name("external.com") && !w.matches_name("evilexternal.com"));
        for bad in ["", "a..b", "*", "ex ample.com", "-a.com", "1.2.3", "10.0.0.0/40", "a*.b.com"] {
            assert!(HostPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn deny_wins_and_lists_restrict_names() {
        let policy = NetworkPolicy {
            allow: Some(vec![
                HostPattern::parse("*.example.test").unwrap(),
                HostPattern::parse("10.1.0.0/16").unwrap(),
            ]),
            deny: vec![HostPattern::parse("bad.example.test").unwrap()],
            ports: vec![],
            dns: true,
            bandwidth_mbps: 10,
            nat64: nat64_prefixes(&Config::default()).unwrap(),
        };
        assert_eq!(policy.name_verdict("good.example.test"), NameVerdict::Allowed);
        assert_eq!(policy.name_verdict("bad.example.test"), NameVerdict::Denied);
        assert_eq!(policy.name_verdict("other.test"), NameVerdict::NotAllowed);
        assert!(policy.explicitly_allows("10.1.2.3".parse().unwrap()));
        assert!(!policy.explicitly_allows("10.2.0.1".parse().unwrap()));
        assert!(policy.has_allowed_names());
    }

    #[test]
    fn denied_ipv4_stays_denied_through_nat64_and_mapped_forms() {
        // A mapped address is the IPv4 one (it leaves as IPv4), in either list.
        assert_eq!(
            HostPattern::parse("::ffff:198.51.100.11").unwrap(),
            HostPattern::Net("198.51.100.11".parse().unwrap())
        );
        assert_eq!(
            HostPattern::parse("::ffff:203.0.113.0/120").unwrap(),
            HostPattern::Net("203.0.113.0/24".parse().unwrap())
        );
        assert_eq!(HostPattern::parse("::/64").unwrap(), HostPattern::Net("::/64".parse().unwrap()));
        let policy = NetworkPolicy {
            allow: None,
            deny: vec![
                HostPattern::parse("198.51.100.11").unwrap(),
                HostPattern::parse("::ffff:203.0.113.0/120").unwrap(),
            ],
            ports: vec![],
            dns: false,
            bandwidth_mbps: 10,
            nat64: nat64_prefixes(&Config::default()).unwrap(),
        };
        let plan = plan(&policy, &EgressSettings::from_config(&Config::default()).unwrap(), &[]).unwrap();
        for net in ["198.51.100.11/32", "64:ff9b::c633:640b/128", "203.0.113.0/24", "64:ff9b::cb00:7100/120"] {
            let net: IpNet = net.parse().unwrap();
            assert!(plan.firewall.deny.contains(&net), "{net:?} not denied: {:?}", plan.firewall.deny);
        }
        // No DNS answer into the local-use NAT64 prefix, wherever it embeds an address.
        let local_use: IpNet = "64:ff9b:1::a9fe:a9fe".parse().unwrap();
        assert!(special_ranges().iter().any(|r| r.covers(&local_use)));
        assert!(policy.is_special("64:ff9b:1:2::a9fe:a9fe".parse().unwrap()));
        assert!(policy.is_special("64:ff9b:1:2::c000:221".parse().unwrap()), "not named: all of the /48");
        // Through the well-known prefix an address is the IPv4 one it embeds.
        assert!(policy.is_special("64:ff9b::a9fe:a9fe".parse().unwrap()));
        assert!(!policy.is_special("64:ff9b::c000:221".parse().unwrap()));
        // Answers a review found accepted: the metadata address in 6to4, IPv4-compatible and
        // Teredo forms, the benchmarking range, IETF assignments, site-local.
        for special in
            ["2002:a9fe:a9fe::1", "::169.254.169.254", "2001:0:a9fe:a9fe::1", "198.18.0.1", "192.0.0.170", "fec0::1"]
        {
            assert!(policy.is_special(special.parse().unwrap()), "{special} is not special");
        }
        // An ordinary global address is not.
        assert!(!policy.is_special("2001:db8:2::10".parse().unwrap()));
        assert!(!policy.is_special("2a00:1450::1".parse().unwrap()));
        // Never reachable by address either: IPv4-compatible, and 6to4's forms of the
        // unreachable IPv4 ranges (metadata: link-local, Alibaba's, Azure's WireServer).
        for net in ["::/96", "2002:a9fe::/32", "2002:6464:64c8::/48", "2002:a83f:8110::/48", "2002:e000::/20"] {
            let net: IpNet = net.parse().unwrap();
            assert!(plan.firewall.always_denied.contains(&net), "{net:?}: {:?}", plan.firewall.always_denied);
        }
    }

    /// `network.egress.nat64_prefixes` names the network's own NAT64 prefixes: denied and
    /// special IPv4 addresses stay so through them, and an answer in one in the local-use
    /// /48 is judged by the IPv4 address it embeds instead of refused whatever it embeds.
    #[test]
    fn the_networks_own_nat64_prefixes_are_known() {
        let mut c = Config::default();
        c.network.egress.nat64_prefixes = vec!["2001:db8:64::/96".into(), "64:ff9b:1:2::/96".into()];
        let settings = EgressSettings::from_config(&c).unwrap();
        let net = crate::manifest::NetworkPermissions {
            outbound: true,
            denied_hosts: vec!["198.51.100.11".into()],
            ..Default::default()
        };
        let policy = NetworkPolicy::from_manifest(&net, &c, 10).unwrap().unwrap();
        let plan = plan(&policy, &settings, &[]).unwrap();
        for denied in
            ["198.51.100.11/32", "64:ff9b::c633:640b/128", "2001:db8:64::c633:640b/128", "64:ff9b:1:2::c633:640b/128"]
        {
            let denied: IpNet = denied.parse().unwrap();
            assert!(plan.firewall.deny.contains(&denied), "{denied} not denied: {:?}", plan.firewall.deny);
        }
        // The metadata service, unreachable however it is written.
        for metadata in ["169.254.169.254", "2001:db8:64::a9fe:a9fe", "64:ff9b:1:2::a9fe:a9fe"] {
            let metadata = IpNet::host(metadata.parse().unwrap());
            assert!(
                plan.firewall.always_denied.iter().any(|r| r.covers(&metadata)),
                "{metadata} reachable: {:?}",
                plan.firewall.always_denied
            );
            assert!(policy.is_special(metadata.addr), "{metadata}");
        }
        // A public IPv4 address through the network's prefixes is an ordinary answer; the
        // rest of the local-use /48 stays refused.
        for public in ["2001:db8:64::c000:221", "64:ff9b:1:2::c000:221", "64:ff9b::c000:221"] {
            assert!(!policy.is_special(public.parse().unwrap()), "{public}");
        }
        assert!(policy.is_special("64:ff9b:1:3::c000:221".parse().unwrap()));
        // Only IPv6 /96s without host bits.
        for (bad, says) in [
            ("10.0.0.0/8", "an IPv6 network"),
            ("2001:db8::/64", "only /96"),
            ("2001:db8::a9fe:a9fe/96", "write it as 2001:db8::/96"),
            ("2001:db8::/96x", "not a number"),
        ] {
            c.network.egress.nat64_prefixes = vec!["2001:db8:64::/96".into(), bad.into()];
            let e = EgressSettings::from_config(&c).unwrap_err();
            assert_eq!(e.path, "network.egress.nat64_prefixes[1]", "{bad}");
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn proxy_passwords_and_their_decoded_form() {
        assert_eq!(proxy_password("http://agent:s3cret@proxy:3128"), Some("s3cret"));
        assert_eq!(proxy_password("http://agent:p%40ss:w@[2001:db8::1]:8080/x@y"), Some("p%40ss:w"));
        // As parse_proxy_url reads the authority: the host after the last @, before the first /.
        assert_eq!(proxy_password("http://u:p?x#y@proxy:3128"), Some("p?x#y"));
        assert_eq!(parse_proxy_url("http://u:p?x#y@proxy:3128").unwrap(), ("proxy".into(), 3128));
        assert_eq!(proxy_password("http://u:p@ss@proxy:3128"), Some("p@ss"));
        for none in ["http://proxy:3128", "http://agent@proxy:3128", "http://agent:@proxy", "10.0.0.0/8,.internal"] {
            assert_eq!(proxy_password(none), None, "{none}");
        }
        assert_eq!(percent_decoded("p%40ss%3aw"), Some("p@ss:w".into()));
        assert_eq!(percent_decoded("plain"), None);
        assert_eq!(percent_decoded("100%"), Some("100%".into()));
        assert_eq!(percent_decoded("%ff"), None, "not UTF-8");
    }

    #[test]
    fn proxy_urls() {
        assert_eq!(
            parse_proxy_url("http://proxy.internal.example.com:3128").unwrap(),
            ("proxy.internal.example.com".into(), 3128)
        );
        assert_eq!(parse_proxy_url("http://user:pw@[2001:db8::1]:8080/").unwrap(), ("2001:db8::1".into(), 8080));
        assert_eq!(parse_proxy_url("https://p.example").unwrap(), ("p.example".into(), 443));
        assert!(parse_proxy_url("socks5://p:1").is_err());
        assert!(parse_proxy_url("p:1").is_err());
    }

    #[test]
    fn max_connections_is_bounded() {
        let c = Config::default();
        let settings = EgressSettings::from_config(&c).unwrap();
        assert_eq!(settings.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(settings.max_new_connections_per_second, DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND);
        type Set = fn(&mut Config, u32);
        let cases: [(&str, Set, u32); 2] = [
            ("network.egress.max_connections", |c, n| c.network.egress.max_connections = Some(n), 65_536),
            (
                "network.egress.max_new_connections_per_second",
                |c, n| c.network.egress.max_new_connections_per_second = Some(n),
                10_000,
            ),
        ];
        for (path, set, max) in cases {
            for (n, ok) in [(0, false), (1, true), (max, true), (max + 1, false)] {
                let mut c = Config::default();
                set(&mut c, n);
                let r = EgressSettings::from_config(&c);
                assert_eq!(r.is_ok(), ok, "{path} {n}");
                if let Err(e) = r {
                    assert_eq!(e.path, path);
                }
            }
        }
    }
}
