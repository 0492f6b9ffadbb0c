//! nftables over nfnetlink: the sandbox's egress ruleset, the host's NAT table, the dynamic
//! allow sets and the blocked-attempt counter. No `nft` process runs.
//!
//! Every ruleset is loaded as one nfnetlink batch, which the kernel applies atomically: it
//! is either wholly in place or not at all.
//!
//! The sandbox ruleset (`table inet opservant` inside the sandbox's own network namespace,
//! which only the agent can change — the sandbox has no capabilities):
//!
//! ```text
//! chain output  (hook output, policy drop)
//!     oif lo accept
//!     meta nfproto ipv4, ip hdrlength != 5         goto blocked   (no IPv4 options)
//!     meta nfproto ipv6, exthdr rt|dst exists      goto blocked   (no routing, dest. options)
//!     ct state established,related accept
//!     ct state new ct status != confirmed
//!         limit rate over max_new_per_second/second goto blocked   (the host's conntrack)
//!     ct state new ct count over max_connections    goto blocked
//!     meta nfproto ipv4 goto out4 · meta nfproto ipv6 goto out6 · goto blocked
//! chain out4 / out6 — first match wins
//!     (v4) saddr != the sandbox's                   goto blocked
//!     (v4) daddr == gateway, udp|tcp dport 53       accept         (dns_allowed only)
//!     (v4) daddr == gateway, tcp dport PROXY_PORT   accept         (the agent's proxy, with network.proxy)
//!     daddr in a denied net                         goto blocked   (deny wins over everything else)
//!     (v6) ICMPv6 neighbour discovery, MLD          accept · saddr != the sandbox's goto blocked
//!     daddr == gateway, daddr in the pool           goto blocked   (never the host, nor another link)
//!     udp|tcp dport 53                              goto blocked   (no other resolver)
//!     daddr in an allowed net                       goto ports
//!     daddr @dyn4 / @dyn6 (from allowed names)      goto ports
//!     daddr in an always-denied range               goto blocked
//!     (allow list absent) any                       goto ports
//!     goto blocked
//! chain ports   meta l4proto tcp|udp, dport in an allowed range → accept · goto blocked
//! chain blocked counter · tcp → reject with tcp reset · other → reject with icmpx admin-prohibited
//! ```
//!
//! The host table (`table inet opservant` in the agent's namespace) masquerades the pool's
//! traffic, drops what sandboxes send that conntrack calls invalid (it would leave
//! unmasqueraded) or that carries an IPv6 routing or destination-options header, rejects
//! sandbox-to-sandbox forwarding, drops unsolicited traffic towards
//! sandboxes, and lets sandboxes reach the host itself only for DNS on port 53 and the
//! agent's forward proxy on [`super::PROXY_PORT`] (anything else is rejected, so it fails at
//! once).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{DefaultNla, Nla, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_netfilter::nftables::{
    Bitwise, ChainAttribute, ChainMessage, Cmp, DataAttribute, ExpressionAttribute, Expressions, Hook, HookNumber,
    Immediate, InetHookNumber, ListAttribute, Lookup, Meta, MetaKey, NfTablesMessage, Operator, Payload, Register,
    RuleAttribute, RuleMessage, SetAttribute, SetDescription, SetElementAttribute, SetElementList, SetElementMessage,
    SetFlags, SetMessage, TableAttribute, TableFlags, TableMessage, Verdict, VerdictAttribute,
};
use netlink_packet_netfilter::none::ControlMessage;
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};

use super::netlink::Netlink;
use super::{Firewall, IpNet, NetError};

/// The one table name the agent owns, in the host namespace and in every sandbox's.
pub const TABLE: &str = "opservant";
/// Host-side interface names start with this; the host table matches on it.
pub const HOST_IF_PREFIX: &str = "opsv";

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMPV6: u8 = 58;
const NFT_DATATYPE_IPADDR: u32 = 7;
const NFT_DATATYPE_IP6ADDR: u32 = 8;
/// Set ids of the dynamic sets within the ruleset's batch.
const DYN4_ID: u32 = 1;
const DYN6_ID: u32 = 2;
/// The most addresses each dynamic allow set holds at once: the kernel keeps them outside
/// the sandbox's memory cgroup, and an executor allowed a wildcard whose authoritative
/// server it controls could otherwise have it hold one per answer record. An answer that
/// would overflow it is not added (the forwarder answers SERVFAIL).
pub(crate) const DYNAMIC_SET_SIZE: u32 = 4096;
pub(crate) const DYN4: &str = "dyn4";
pub(crate) const DYN6: &str = "dyn6";

type Expr = ListAttribute<ExpressionAttribute>;

// ---------------------------------------------------------------------------------------
// Expressions
// ---------------------------------------------------------------------------------------

fn meta(key: MetaKey) -> Expr {
    Expressions::Meta(vec![Meta::DestinationRegister(Register::Reg1), Meta::Key(key)]).into()
}

fn cmp(op: Operator, data: Vec<u8>) -> Expr {
    Expressions::Cmp(vec![Cmp::SourceRegister(Register::Reg1), Cmp::Op(op), Cmp::Data(DataAttribute::Value(data))])
        .into()
}

fn payload(base: u32, offset: u32, len: u32) -> Expr {
    Expressions::Payload(vec![
        Payload::DestinationRegister(Register::Reg1),
        Payload::Base(base),
        Payload::Offset(offset),
        Payload::Len(len),
    ])
    .into()
}

fn mask(len: u32, mask: Vec<u8>) -> Expr {
    Expressions::Bitwise(vec![
        Bitwise::SourceRegister(Register::Reg1),
        Bitwise::DestinationRegister(Register::Reg1),
        Bitwise::Length(len),
        Bitwise::Mask(DataAttribute::Value(mask)),
        Bitwise::Xor(DataAttribute::Value(vec![0; len as usize])),
    ])
    .into()
}

fn lookup(set: &str, id: u32) -> Expr {
    Expressions::Lookup(vec![Lookup::Set(set.into()), Lookup::SetId(id), Lookup::SourceRegister(Register::Reg1)]).into()
}

fn verdict(code: Verdict, chain: Option<&str>) -> Expr {
    let mut v = vec![VerdictAttribute::Code(code)];
    if let Some(c) = chain {
        v.push(VerdictAttribute::Chain(c.into()));
    }
    Expressions::Immediate(vec![
        Immediate::DestinationRegister(Register::Verdict),
        Immediate::Data(DataAttribute::Verdict(v)),
    ])
    .into()
}

fn accept() -> Expr {
    verdict(Verdict::Other(NF_ACCEPT), None)
}

fn drop_() -> Expr {
    verdict(Verdict::Other(NF_DROP), None)
}

fn goto(chain: &str) -> Expr {
    verdict(Verdict::Goto, Some(chain))
}

fn other(name: &str, attributes: Vec<DefaultNla>) -> Expr {
    Expressions::Other { expression_type: name.into(), attributes }.into()
}

fn counter() -> Expr {
    other("counter", vec![])
}

fn masquerade() -> Expr {
    other("masq", vec![])
}

/// `reject with tcp reset` (type 1) or `reject with icmpx admin-prohibited` (type 2, code 3).
fn reject(tcp_reset: bool) -> Expr {
    const NFTA_REJECT_TYPE: u16 = 1;
    const NFTA_REJECT_ICMP_CODE: u16 = 2;
    if tcp_reset {
        other("reject", vec![DefaultNla::new(NFTA_REJECT_TYPE, 1u32.to_be_bytes().to_vec())])
    } else {
        other(
            "reject",
            vec![
                DefaultNla::new(NFTA_REJECT_TYPE, 2u32.to_be_bytes().to_vec()),
                DefaultNla::new(NFTA_REJECT_ICMP_CODE, vec![3]),
            ],
        )
    }
}

/// `ct count over limit`: matches while the connections this expression has seen, still
/// tracked (closed TCP ones are not counted), number more than `limit` — the packet's own
/// included.
fn ct_count_over(limit: u32) -> Expr {
    const NFTA_CONNLIMIT_COUNT: u16 = 1;
    const NFTA_CONNLIMIT_FLAGS: u16 = 2;
    const NFT_CONNLIMIT_F_INV: u32 = 1;
    other(
        "connlimit",
        vec![
            DefaultNla::new(NFTA_CONNLIMIT_COUNT, limit.to_be_bytes().to_vec()),
            DefaultNla::new(NFTA_CONNLIMIT_FLAGS, NFT_CONNLIMIT_F_INV.to_be_bytes().to_vec()),
        ],
    )
}

/// `limit rate over rate/second burst rate packets`: matches the packets past the rate.
fn limit_over_per_second(rate: u32) -> Expr {
    const NFTA_LIMIT_RATE: u16 = 1;
    const NFTA_LIMIT_UNIT: u16 = 2;
    const NFTA_LIMIT_BURST: u16 = 3;
    const NFTA_LIMIT_TYPE: u16 = 4;
    const NFTA_LIMIT_FLAGS: u16 = 5;
    const NFT_LIMIT_PKTS: u32 = 0;
    const NFT_LIMIT_F_INV: u32 = 1;
    other(
        "limit",
        vec![
            DefaultNla::new(NFTA_LIMIT_RATE, u64::from(rate).to_be_bytes().to_vec()),
            DefaultNla::new(NFTA_LIMIT_UNIT, 1u64.to_be_bytes().to_vec()),
            DefaultNla::new(NFTA_LIMIT_BURST, rate.to_be_bytes().to_vec()),
            DefaultNla::new(NFTA_LIMIT_TYPE, NFT_LIMIT_PKTS.to_be_bytes().to_vec()),
            DefaultNla::new(NFTA_LIMIT_FLAGS, NFT_LIMIT_F_INV.to_be_bytes().to_vec()),
        ],
    )
}

/// `ct status & confirmed == 0`: the packet creates its conntrack entry (confirmed once it
/// leaves the last hook).
fn ct_unconfirmed() -> Vec<Expr> {
    const NFT_CT_STATUS: u32 = 2;
    const IPS_CONFIRMED: u32 = 1 << 3;
    ct_bits(NFT_CT_STATUS, IPS_CONFIRMED, Operator::Equal)
}

/// `ct state new`.
fn ct_new() -> Vec<Expr> {
    const NFT_CT_STATE: u32 = 0;
    const NEW: u32 = 1 << 3;
    ct_any_of(NFT_CT_STATE, NEW)
}

/// `ct state established,related` → register 1 holds a non-zero value.
fn ct_established() -> Vec<Expr> {
    const NFT_CT_STATE: u32 = 0;
    const ESTABLISHED_RELATED: u32 = (1 << 1) | (1 << 2);
    ct_any_of(NFT_CT_STATE, ESTABLISHED_RELATED)
}

/// `ct status dnat`: the connection's destination was rewritten (a DNAT rule of the host's,
/// such as a published container port or a NodePort).
fn ct_dnat() -> Vec<Expr> {
    const NFT_CT_STATUS: u32 = 2;
    const IPS_DST_NAT: u32 = 1 << 5;
    ct_any_of(NFT_CT_STATUS, IPS_DST_NAT)
}

/// The conntrack field `key` (a 32-bit set of flags) has any of `bits`.
fn ct_any_of(key: u32, bits: u32) -> Vec<Expr> {
    ct_bits(key, bits, Operator::NotEqual)
}

/// The conntrack field `key` masked with `bits`, compared (`op`) with zero.
fn ct_bits(key: u32, bits: u32, op: Operator) -> Vec<Expr> {
    const NFTA_CT_DREG: u16 = 1;
    const NFTA_CT_KEY: u16 = 2;
    vec![
        other(
            "ct",
            vec![
                DefaultNla::new(
                    NFTA_CT_DREG,
                    1u32.to_be_bytes() /* NFT_REG_1 */
                        .to_vec(),
                ),
                DefaultNla::new(NFTA_CT_KEY, key.to_be_bytes().to_vec()),
            ],
        ),
        mask(4, bits.to_ne_bytes().to_vec()),
        cmp(op, vec![0; 4]),
    ]
}

/// `exthdr <type> exists` for IPv6: register 1 holds 1 when the packet carries an extension
/// header of `header_type` (43 routing, 60 destination options), 0 otherwise.
fn ipv6_exthdr_exists(header_type: u8) -> Vec<Expr> {
    const NFTA_EXTHDR_DREG: u16 = 1;
    const NFTA_EXTHDR_TYPE: u16 = 2;
    const NFTA_EXTHDR_OFFSET: u16 = 3;
    const NFTA_EXTHDR_LEN: u16 = 4;
    const NFTA_EXTHDR_FLAGS: u16 = 5;
    const NFTA_EXTHDR_OP: u16 = 6;
    const NFT_EXTHDR_F_PRESENT: u32 = 1;
    const NFT_EXTHDR_OP_IPV6: u32 = 0;
    vec![
        other(
            "exthdr",
            vec![
                DefaultNla::new(
                    NFTA_EXTHDR_DREG,
                    1u32.to_be_bytes() /* NFT_REG_1 */
                        .to_vec(),
                ),
                DefaultNla::new(NFTA_EXTHDR_TYPE, vec![header_type]),
                DefaultNla::new(NFTA_EXTHDR_OFFSET, 0u32.to_be_bytes().to_vec()),
                DefaultNla::new(NFTA_EXTHDR_LEN, 1u32.to_be_bytes().to_vec()),
                DefaultNla::new(NFTA_EXTHDR_FLAGS, NFT_EXTHDR_F_PRESENT.to_be_bytes().to_vec()),
                DefaultNla::new(NFTA_EXTHDR_OP, NFT_EXTHDR_OP_IPV6.to_be_bytes().to_vec()),
            ],
        ),
        cmp(Operator::Equal, vec![1]),
    ]
}

/// IPv6 extension headers that route a packet past its destination address, or carry
/// options for it: a routing header (a type 4 segment routing header any unprivileged
/// socket may set, `IPV6_RTHDR`) names the real destination in its segment list, which
/// no rule on `ip6 daddr` sees; destination options need no sandbox.
const IPV6_REFUSED_EXTHDRS: [u8; 2] = [43, 60];

/// `ct state invalid` (or no conntrack entry at all).
fn ct_invalid() -> Vec<Expr> {
    const NFT_CT_STATE: u32 = 0;
    const INVALID: u32 = 1 << 0;
    ct_any_of(NFT_CT_STATE, INVALID)
}

fn nfproto(p: u8) -> Vec<Expr> {
    vec![meta(MetaKey::Nfproto), cmp(Operator::Equal, vec![p])]
}

fn l4proto(p: u8) -> Vec<Expr> {
    vec![meta(MetaKey::L4Proto), cmp(Operator::Equal, vec![p])]
}

/// `ip daddr` / `ip6 daddr` (or saddr) within `net`.
fn addr_in(net: &IpNet, source: bool) -> Vec<Expr> {
    let (offset, len, bytes) = match net.addr {
        IpAddr::V4(a) => (if source { 12 } else { 16 }, 4, a.octets().to_vec()),
        IpAddr::V6(a) => (if source { 8 } else { 24 }, 16, a.octets().to_vec()),
    };
    let mut v = vec![payload(NFT_PAYLOAD_NETWORK_HEADER, offset, len)];
    if usize::from(net.prefix) < bytes.len() * 8 {
        v.push(mask(len, net.mask_bytes()));
    }
    v.push(cmp(Operator::Equal, net.network_bytes()));
    v
}

fn dport_range(lo: u16, hi: u16) -> Vec<Expr> {
    let mut v = vec![payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2)];
    if lo == hi {
        v.push(cmp(Operator::Equal, lo.to_be_bytes().to_vec()));
    } else {
        v.push(cmp(Operator::GreatherThanEqual, lo.to_be_bytes().to_vec()));
        v.push(cmp(Operator::LessThanEqual, hi.to_be_bytes().to_vec()));
    }
    v
}

/// `iifname`/`oifname` starting with the host interface prefix.
fn ifname_prefix(out: bool) -> Vec<Expr> {
    vec![
        meta(if out { MetaKey::Oifname } else { MetaKey::Iifname }),
        cmp(Operator::Equal, HOST_IF_PREFIX.as_bytes().to_vec()),
    ]
}

/// `MATCH reject`: a TCP reset for TCP (a connect fails at once), ICMP admin-prohibited
/// for the rest — two rules.
fn rejecting(matcher: Vec<Expr>) -> Vec<Vec<Expr>> {
    vec![
        join(vec![matcher.clone(), l4proto(IPPROTO_TCP), vec![reject(true)]]),
        join(vec![matcher, vec![reject(false)]]),
    ]
}

// ---------------------------------------------------------------------------------------
// Batches
// ---------------------------------------------------------------------------------------

/// One nfnetlink transaction being assembled.
struct Batch {
    msgs: Vec<(NetfilterMessage, u16)>,
}

impl Batch {
    fn new() -> Self {
        Self { msgs: vec![(control(ControlMessage::BatchBegin), 0)] }
    }

    fn push(&mut self, m: NfTablesMessage, flags: u16) {
        self.msgs.push((
            NetfilterMessage::new(NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0), m),
            flags | NLM_F_ACK,
        ));
    }

    /// The table, created exclusively; `tag` is kept as its user data.
    fn table(&mut self, tag: Option<&str>) {
        let mut attributes = vec![TableAttribute::Name(TABLE.into()), TableAttribute::Flags(TableFlags::default())];
        if let Some(t) = tag {
            attributes.push(TableAttribute::UserData(t.as_bytes().to_vec()));
        }
        self.push(NfTablesMessage::NewTable(TableMessage { attributes }), NLM_F_CREATE | NLM_F_EXCL);
    }

    fn chain(&mut self, name: &str, hook: Option<(InetHookNumber, i32, &str, u32)>) {
        let mut attributes = vec![ChainAttribute::Table(TABLE.into()), ChainAttribute::Name(name.into())];
        if let Some((number, priority, kind, policy)) = hook {
            attributes.push(ChainAttribute::Hook(vec![
                Hook::Number(HookNumber::Inet(number)),
                Hook::Priority(priority as u32),
            ]));
            attributes.push(ChainAttribute::Policy(policy));
            attributes.push(ChainAttribute::Type(kind.into()));
        }
        self.push(NfTablesMessage::NewChain(ChainMessage { attributes }), NLM_F_CREATE);
    }

    fn rule(&mut self, chain: &str, exprs: Vec<Expr>) {
        self.push(
            NfTablesMessage::NewRule(RuleMessage {
                attributes: vec![
                    RuleAttribute::Table(TABLE.into()),
                    RuleAttribute::Chain(chain.into()),
                    RuleAttribute::Expressions(exprs),
                ],
            }),
            NLM_F_CREATE | NLM_F_APPEND,
        );
    }

    fn timeout_set(&mut self, name: &str, id: u32, v6: bool) {
        self.push(
            NfTablesMessage::NewSet(SetMessage {
                attributes: vec![
                    SetAttribute::Table(TABLE.into()),
                    SetAttribute::Name(name.into()),
                    SetAttribute::Flags(SetFlags::Timeout),
                    SetAttribute::KeyType(if v6 { NFT_DATATYPE_IP6ADDR } else { NFT_DATATYPE_IPADDR }),
                    SetAttribute::KeyLen(if v6 { 16 } else { 4 }),
                    SetAttribute::Description(vec![SetDescription::Size(DYNAMIC_SET_SIZE)]),
                    SetAttribute::Id(id),
                ],
            }),
            NLM_F_CREATE,
        );
    }

    fn commit(mut self, nl: &mut Netlink, op: &str) -> Result<(), NetError> {
        self.msgs.push((control(ControlMessage::BatchEnd), 0));
        nl.transact(self.msgs, op)
    }
}

fn control(c: ControlMessage) -> NetfilterMessage {
    NetfilterMessage::new(NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES), c)
}

fn join(parts: Vec<Vec<Expr>>) -> Vec<Expr> {
    parts.into_iter().flatten().collect()
}

/// `ip saddr` / `ip6 saddr` is not exactly `addr`.
fn source_is_not(addr: IpAddr) -> Vec<Expr> {
    source_outside(&IpNet::host(addr))
}

/// `fe80::/10`.
const IPV6_LINK_LOCAL: IpNet = IpNet { addr: IpAddr::V6(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0)), prefix: 10 };

/// `ip6 saddr` (or `ip saddr`) is outside `net`.
fn source_outside(net: &IpNet) -> Vec<Expr> {
    let mut v = addr_in(net, true);
    if let Some(last) = v.last_mut() {
        *last = cmp(Operator::NotEqual, net.network_bytes());
    }
    v
}

/// Load the sandbox's egress ruleset (through a socket in the sandbox's namespace).
/// `address4`/`address6`: the sandbox's own addresses, the only sources its packets may
/// carry. The kernel does not route a foreign source an unprivileged socket bound with
/// `IP_FREEBIND` (raw sockets and `IP_TRANSPARENT` are out of the sandbox's reach); this
/// is the second wall: a packet with a forged source would leave the host unmasqueraded.
pub(crate) fn load_sandbox_ruleset(
    nl: &mut Netlink,
    fw: &Firewall,
    (address4, gateway4): (Ipv4Addr, Ipv4Addr),
    v6_addrs: Option<(Ipv6Addr, Ipv6Addr)>,
) -> Result<(), NetError> {
    let gateway6 = v6_addrs.map(|(_, g)| g);
    let mut b = Batch::new();
    b.table(None);
    b.chain("output", Some((InetHookNumber::LocalOut, 0, "filter", NF_DROP)));
    for c in ["out4", "out6", "ports", "blocked"] {
        b.chain(c, None);
    }
    if fw.dynamic {
        b.timeout_set(DYN4, DYN4_ID, false);
        b.timeout_set(DYN6, DYN6_ID, true);
    }
    b.rule("output", vec![meta(MetaKey::Oif), cmp(Operator::Equal, 1u32.to_ne_bytes().to_vec()), accept()]);
    // IPv4 options, on any packet of any flow: none that a sandbox needs, and a loose source
    // route through the host's address is forwarded by a host that accepts source routes
    // (`accept_source_route`) after its input chain could have rejected it.
    b.rule(
        "output",
        join(vec![
            nfproto(NFPROTO_IPV4),
            vec![
                payload(NFT_PAYLOAD_NETWORK_HEADER, 0, 1),
                mask(1, vec![0x0f]),
                cmp(Operator::NotEqual, vec![5]),
                goto("blocked"),
            ],
        ]),
    );
    // IPv6 routing and destination-options headers, on any packet of any flow (a socket may
    // add one to a connection already established): a segment routing header reached hosts
    // neither allowed nor denied through an allowed one, and left the host unmasqueraded.
    for header in IPV6_REFUSED_EXTHDRS {
        b.rule("output", join(vec![nfproto(NFPROTO_IPV6), ipv6_exthdr_exists(header), vec![goto("blocked")]]));
    }
    b.rule("output", join(vec![ct_established(), vec![accept()]]));
    // New connections only: the link's own housekeeping (IPv6 neighbour discovery, not
    // tracked) must neither use up the rate nor count as connections.
    // The packet that creates a connection only (its conntrack entry not yet confirmed):
    // every packet of a flow no reply has come back to is `new`.
    b.rule(
        "output",
        join(vec![ct_new(), ct_unconfirmed(), vec![limit_over_per_second(fw.max_new_per_second), goto("blocked")]]),
    );
    b.rule("output", join(vec![ct_new(), vec![ct_count_over(fw.max_connections), goto("blocked")]]));
    b.rule("output", join(vec![nfproto(NFPROTO_IPV4), vec![goto("out4")]]));
    b.rule("output", join(vec![nfproto(NFPROTO_IPV6), vec![goto("out6")]]));
    b.rule("output", vec![goto("blocked")]);

    for v6 in [false, true] {
        let chain = if v6 { "out6" } else { "out4" };
        let family = |n: &&IpNet| n.addr.is_ipv6() == v6;
        if !v6 {
            b.rule(chain, join(vec![source_is_not(IpAddr::V4(address4)), vec![goto("blocked")]]));
            // The agent's own services on the IPv4 gateway, before the deny list (a denied
            // network covering the pool — `10.0.0.0/8` — would otherwise cut them off while
            // resolv.conf and the proxy environment name them; both judge every query and
            // request by the policy themselves): DNS to the forwarder (the sandbox's
            // resolv.conf names it; port 53 of the IPv6 gateway could be a host resolver
            // that answers for any name), and the forward proxy (its environment names it).
            let gw_net = IpNet::host(IpAddr::V4(gateway4));
            if fw.dns {
                for proto in [IPPROTO_UDP, IPPROTO_TCP] {
                    b.rule(
                        chain,
                        join(vec![addr_in(&gw_net, false), l4proto(proto), dport_range(53, 53), vec![accept()]]),
                    );
                }
            }
            if fw.proxy {
                b.rule(
                    chain,
                    join(vec![
                        addr_in(&gw_net, false),
                        l4proto(IPPROTO_TCP),
                        dport_range(super::PROXY_PORT, super::PROXY_PORT),
                        vec![accept()],
                    ]),
                );
            }
        }
        for net in fw.deny.iter().filter(family) {
            b.rule(chain, join(vec![addr_in(net, false), vec![goto("blocked")]]));
        }
        if v6 {
            // Multicast listener reports (130-132, 143) and neighbour discovery (133-137)
            // are the link's own housekeeping: without ND nothing on the link resolves,
            // and neither may count as a blocked attempt.
            for (lo, hi) in [(130u8, 137u8), (143, 143)] {
                b.rule(
                    chain,
                    join(vec![
                        l4proto(IPPROTO_ICMPV6),
                        vec![
                            payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1),
                            cmp(Operator::GreatherThanEqual, vec![lo]),
                            cmp(Operator::LessThanEqual, vec![hi]),
                            accept(),
                        ],
                    ]),
                );
            }
            // After the link's housekeeping (link-local and unspecified sources).
            match v6_addrs {
                Some((address6, _)) => {
                    b.rule(chain, join(vec![source_is_not(IpAddr::V6(address6)), vec![goto("blocked")]]))
                }
                None => b.rule(chain, vec![goto("blocked")]),
            }
        }
        // Never the host (its gateway address), nor any other address of the pool: the
        // other links' gateways are the host's too, where the host table lets DNS and the
        // proxy port through (to another link's agent services, which would not answer, or
        // to a listener of the host's own on every address), and the other sandboxes are
        // never reachable. Whatever an allow list covers.
        let gateway: Option<IpAddr> = if v6 { gateway6.map(IpAddr::V6) } else { Some(IpAddr::V4(gateway4)) };
        if let Some(gw) = gateway {
            b.rule(chain, join(vec![addr_in(&IpNet::host(gw), false), vec![goto("blocked")]]));
        }
        for net in fw.pool.iter().filter(family) {
            b.rule(chain, join(vec![addr_in(net, false), vec![goto("blocked")]]));
        }
        // DNS goes to the agent's forwarder only, never straight to another resolver.
        for proto in [IPPROTO_UDP, IPPROTO_TCP] {
            b.rule(chain, join(vec![l4proto(proto), dport_range(53, 53), vec![goto("blocked")]]));
        }
        for net in fw.allow.iter().filter(family) {
            b.rule(chain, join(vec![addr_in(net, false), vec![goto("ports")]]));
        }
        if fw.dynamic {
            let (set, id, offset, len) = if v6 { (DYN6, DYN6_ID, 24, 16) } else { (DYN4, DYN4_ID, 16, 4) };
            b.rule(chain, vec![payload(NFT_PAYLOAD_NETWORK_HEADER, offset, len), lookup(set, id), goto("ports")]);
        }
        for net in fw.always_denied.iter().filter(family) {
            b.rule(chain, join(vec![addr_in(net, false), vec![goto("blocked")]]));
        }
        if fw.allow_any {
            b.rule(chain, vec![goto("ports")]);
        }
        b.rule(chain, vec![goto("blocked")]);
    }

    for proto in [IPPROTO_TCP, IPPROTO_UDP] {
        if fw.ports.is_empty() {
            b.rule("ports", join(vec![l4proto(proto), vec![accept()]]));
        }
        for (lo, hi) in &fw.ports {
            b.rule("ports", join(vec![l4proto(proto), dport_range(*lo, *hi), vec![accept()]]));
        }
    }
    b.rule("ports", vec![goto("blocked")]);

    b.rule("blocked", vec![counter()]);
    // A packet whose source is not the sandbox's own is dropped, never rejected: the reject's
    // ICMP error or TCP reset would go to that source, and being related to the packet it
    // passes the established/related rule above — a packet out of the sandbox, to an address
    // nothing allowed, quoting the forged one (the host table's invalid-state rule stopped it
    // there; `egress::a_forged_source_is_stopped_by_the_sandboxs_ruleset`). IPv6 link-local
    // sources stay rejected: their answer stays on the link, with the host.
    b.rule("blocked", join(vec![nfproto(NFPROTO_IPV4), source_is_not(IpAddr::V4(address4)), vec![drop_()]]));
    if let Some((address6, _)) = v6_addrs {
        b.rule(
            "blocked",
            join(vec![
                nfproto(NFPROTO_IPV6),
                source_is_not(IpAddr::V6(address6)),
                source_outside(&IPV6_LINK_LOCAL),
                vec![drop_()],
            ]),
        );
    }
    b.rule("blocked", join(vec![l4proto(IPPROTO_TCP), vec![reject(true)]]));
    b.rule("blocked", vec![reject(false)]);
    b.commit(nl, "load sandbox ruleset")
}

/// The version of the host table's rules ([`create_host_table`]): raise it with every change
/// to them, so that a table an earlier version made is replaced rather than reused.
pub(crate) const HOST_RULES_VERSION: u32 = 4;

/// What the host table records about the pools it serves and its rules' version (its user
/// data). Tables of versions before 2 record only the pools.
pub(crate) fn host_table_tag(pool4: &IpNet, pool6: Option<&IpNet>) -> String {
    format!("{} rules {HOST_RULES_VERSION}", pools_tag(pool4, pool6))
}

fn pools_tag(pool4: &IpNet, pool6: Option<&IpNet>) -> String {
    match pool6 {
        Some(p6) => format!("opservant pools {pool4} {p6}"),
        None => format!("opservant pools {pool4}"),
    }
}

/// Whether a host table tagged `tag` serves `pool4`/`pool6`, whatever its rules' version.
pub(crate) fn serves_pools(tag: &str, pool4: &IpNet, pool6: Option<&IpNet>) -> bool {
    let pools = pools_tag(pool4, pool6);
    tag == pools || tag.strip_prefix(pools.as_str()).is_some_and(|rest| rest.starts_with(" rules "))
}

/// Create the host table for `pool4`/`pool6` unless it exists. `Ok(false)` when another
/// process created it first (the batch is exclusive, so rules are never doubled).
pub(crate) fn create_host_table(nl: &mut Netlink, pool4: &IpNet, pool6: Option<&IpNet>) -> Result<bool, NetError> {
    create_host_table_tagged(nl, &host_table_tag(pool4, pool6), pool4, pool6)
}

/// [`create_host_table`] with the tag `tag` (tests make an earlier version's table).
pub(crate) fn create_host_table_tagged(
    nl: &mut Netlink,
    tag: &str,
    pool4: &IpNet,
    pool6: Option<&IpNet>,
) -> Result<bool, NetError> {
    let mut b = Batch::new();
    b.table(Some(tag));
    b.chain("postrouting", Some((InetHookNumber::PostRouting, 100, "nat", NF_ACCEPT)));
    b.chain("forward", Some((InetHookNumber::Forward, 0, "filter", NF_ACCEPT)));
    b.chain("input", Some((InetHookNumber::LocalIn, 0, "filter", NF_ACCEPT)));
    let pools: Vec<(&IpNet, u8)> =
        std::iter::once((pool4, NFPROTO_IPV4)).chain(pool6.map(|p| (p, NFPROTO_IPV6))).collect();
    // From sandboxes: nothing conntrack calls invalid (it is not masqueraded, and would leave
    // with a pool address: an IPv6 packet whose checksum covers a routing header's final
    // destination did), and no IPv6 routing or destination-options header (the sandbox's own
    // ruleset refuses them first).
    b.rule("forward", join(vec![ifname_prefix(false), ct_invalid(), vec![drop_()]]));
    for header in IPV6_REFUSED_EXTHDRS {
        b.rule(
            "forward",
            join(vec![ifname_prefix(false), nfproto(NFPROTO_IPV6), ipv6_exthdr_exists(header), vec![drop_()]]),
        );
    }
    for (pool, proto) in &pools {
        // Sandbox to sandbox: never.
        for rule in rejecting(join(vec![ifname_prefix(false), nfproto(*proto), addr_in(pool, false)])) {
            b.rule("forward", rule);
        }
        b.rule(
            "postrouting",
            join(vec![nfproto(*proto), addr_in(pool, true), ifname_prefix(true), vec![verdict(Verdict::Return, None)]]),
        );
        b.rule("postrouting", join(vec![nfproto(*proto), addr_in(pool, true), vec![masquerade()]]));
    }
    // Nothing the host's own DNAT rules redirect (a published container port, a NodePort
    // on one of its addresses): to the sandbox that is the host, which it may not reach.
    for rule in rejecting(join(vec![ifname_prefix(false), ct_dnat()])) {
        b.rule("forward", rule);
    }
    // Towards sandboxes only replies; nothing unsolicited.
    b.rule("forward", join(vec![ifname_prefix(true), ct_established(), vec![accept()]]));
    b.rule("forward", join(vec![ifname_prefix(true), vec![drop_()]]));
    // The host itself: replies, DNS to the agent's forwarder and TCP to its forward proxy
    // (`network.proxy`), on a sandbox link's IPv4 gateway (an address of `pool4`); nothing
    // else — not port 53 of the host's other addresses, where a resolver of the host's own
    // may answer.
    b.rule("input", join(vec![ifname_prefix(false), ct_established(), vec![accept()]]));
    for (proto, port) in [(IPPROTO_UDP, 53), (IPPROTO_TCP, 53), (IPPROTO_TCP, super::PROXY_PORT)] {
        b.rule(
            "input",
            join(vec![
                ifname_prefix(false),
                nfproto(NFPROTO_IPV4),
                addr_in(pool4, false),
                l4proto(proto),
                dport_range(port, port),
                vec![accept()],
            ]),
        );
    }
    // ICMPv6 neighbour discovery towards the host end.
    b.rule(
        "input",
        join(vec![
            ifname_prefix(false),
            l4proto(IPPROTO_ICMPV6),
            vec![
                payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1),
                cmp(Operator::GreatherThanEqual, vec![133]),
                cmp(Operator::LessThanEqual, vec![137]),
                accept(),
            ],
        ]),
    );
    for rule in rejecting(ifname_prefix(false)) {
        b.rule("input", rule);
    }
    match b.commit(nl, "create host table") {
        Ok(()) => Ok(true),
        Err(NetError::Kernel { errno, .. }) if errno == libc::EEXIST => Ok(false),
        Err(e) => Err(e),
    }
}

/// The ruleset generation (any answer proves nf_tables is there).
pub(crate) fn generation(nl: &mut Netlink) -> Result<(), NetError> {
    let msg = NetfilterMessage::new(
        NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, 0),
        NfTablesMessage::GetGen(netlink_packet_netfilter::nftables::GenMessage { attributes: vec![] }),
    );
    nl.get(msg, 0, "get ruleset generation").map(|_| ())
}

/// The host table's tag ([`host_table_tag`]) if it exists in `nl`'s namespace.
pub(crate) fn host_table(nl: &mut Netlink) -> Result<Option<String>, NetError> {
    let msg = NetfilterMessage::new(
        NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0),
        NfTablesMessage::GetTable(TableMessage { attributes: vec![TableAttribute::Name(TABLE.into())] }),
    );
    match nl.get(msg, 0, "get host table") {
        Ok(replies) => {
            let tag = replies.into_iter().find_map(|r| match r.inner {
                netlink_packet_netfilter::NetfilterMessageInner::NfTables(NfTablesMessage::NewTable(t)) => {
                    t.attributes.into_iter().find_map(|a| match a {
                        TableAttribute::UserData(d) => Some(String::from_utf8_lossy(&d).into_owned()),
                        _ => None,
                    })
                }
                _ => None,
            });
            Ok(Some(tag.unwrap_or_default()))
        }
        Err(NetError::Kernel { errno, .. }) if errno == libc::ENOENT => Ok(None),
        Err(e) => Err(e),
    }
}

pub(crate) fn delete_host_table(nl: &mut Netlink) -> Result<(), NetError> {
    let mut b = Batch::new();
    b.push(NfTablesMessage::DeleteTable(TableMessage { attributes: vec![TableAttribute::Name(TABLE.into())] }), 0);
    match b.commit(nl, "delete host table") {
        Err(NetError::Kernel { errno, .. }) if errno == libc::ENOENT => Ok(()),
        other => other,
    }
}

/// Add addresses to the sandbox's dynamic allow sets, each expiring after its milliseconds.
/// The `renewed` ones are in the sets already and get their new timeout: deleted and added
/// again in the same transaction (a kernel before 6.10 keeps an element's timeout when it is
/// added again; nothing sees the set without them in between).
pub(crate) fn add_dynamic(
    nl: &mut Netlink,
    added: &[(IpAddr, u64)],
    renewed: &[(IpAddr, u64)],
) -> Result<(), NetError> {
    let mut b = Batch::new();
    let key = |a: &IpAddr| match a {
        IpAddr::V4(x) => x.octets().to_vec(),
        IpAddr::V6(x) => x.octets().to_vec(),
    };
    let message = |set: &str, elements| SetElementMessage {
        attributes: vec![
            SetElementList::Table(TABLE.into()),
            SetElementList::Set(set.into()),
            SetElementList::Elements(elements),
        ],
    };
    for (set, v6) in [(DYN4, false), (DYN6, true)] {
        let old: Vec<ListAttribute<SetElementAttribute>> = renewed
            .iter()
            .filter(|(a, _)| a.is_ipv6() == v6)
            .map(|(a, _)| ListAttribute::Element(vec![SetElementAttribute::Key(DataAttribute::Value(key(a)))]))
            .collect();
        if !old.is_empty() {
            b.push(NfTablesMessage::DeleteSetElement(message(set, old)), 0);
        }
        let elements: Vec<ListAttribute<SetElementAttribute>> = added
            .iter()
            .chain(renewed)
            .filter(|(a, _)| a.is_ipv6() == v6)
            .map(|(a, timeout_ms)| {
                ListAttribute::Element(vec![
                    SetElementAttribute::Key(DataAttribute::Value(key(a))),
                    SetElementAttribute::Timeout((*timeout_ms).max(1)),
                ])
            })
            .collect();
        if elements.is_empty() {
            continue;
        }
        // Without EXCL, an element already present is not an error (its timeout stays
        // before kernel 6.10 and is replaced since).
        b.push(NfTablesMessage::NewSetElement(message(set, elements)), NLM_F_CREATE);
    }
    b.commit(nl, "add allowed addresses")
}

/// Packets that reached the `blocked` chain so far.
pub(crate) fn blocked_packets(nl: &mut Netlink) -> Result<u64, NetError> {
    const NFTA_COUNTER_PACKETS: u16 = 2;
    let msg = NetfilterMessage::new(
        NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0),
        NfTablesMessage::GetRule(RuleMessage {
            attributes: vec![RuleAttribute::Table(TABLE.into()), RuleAttribute::Chain("blocked".into())],
        }),
    );
    let replies = nl.dump(msg, "read blocked counter")?;
    for reply in replies {
        let netlink_packet_netfilter::NetfilterMessageInner::NfTables(NfTablesMessage::NewRule(rule)) = reply.inner
        else {
            continue;
        };
        for attr in rule.attributes {
            let RuleAttribute::Expressions(exprs) = attr else { continue };
            for e in exprs {
                let ListAttribute::Element(parts) = e else { continue };
                for p in parts {
                    if let ExpressionAttribute::Data(Expressions::Other { expression_type, attributes }) = p {
                        if expression_type == "counter" {
                            for a in attributes {
                                if a.kind() & 0x3fff == NFTA_COUNTER_PACKETS && a.value_len() == 8 {
                                    let mut b = [0u8; 8];
                                    a.emit_value(&mut b);
                                    return Ok(u64::from_be_bytes(b));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Err(NetError::Protocol { what: "nfnetlink", op: "read blocked counter".into(), message: "no counter found".into() })
}
