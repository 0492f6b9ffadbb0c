//! Links, addresses, routes and the bandwidth qdisc, over rtnetlink (no `ip`, no `tc`).
//!
//! Guarantees: every request is acknowledged by the kernel or its error is returned; IPv6
//! addresses are added without duplicate address detection, so they are usable at once.

use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::{DefaultNla, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage};
use netlink_packet_route::link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::tc::{TcAttribute, TcHandle, TcMessage, TcOption};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::netlink::Netlink;
use super::NetError;

/// `ip link add HOST type veth peer name PEER netns FD` — the host end stays in the
/// namespace of `nl`; the peer is created directly inside the namespace `peer_ns`.
pub(crate) fn add_veth(nl: &mut Netlink, host: &str, peer: &str, peer_ns: BorrowedFd<'_>) -> Result<(), NetError> {
    let mut peer_msg = LinkMessage::default();
    peer_msg.attributes.push(LinkAttribute::IfName(peer.into()));
    peer_msg.attributes.push(LinkAttribute::NetNsFd(peer_ns.as_raw_fd()));
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(host.into()));
    msg.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Veth),
        LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_msg))),
    ]));
    nl.request(RouteNetlinkMessage::NewLink(msg), NLM_F_CREATE | NLM_F_EXCL, "create veth")
}

/// The index of interface `name` in `nl`'s namespace.
pub(crate) fn index_of(nl: &mut Netlink, name: &str) -> Result<u32, NetError> {
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(name.into()));
    let replies = nl.get(RouteNetlinkMessage::GetLink(msg), 0, "get link")?;
    replies
        .into_iter()
        .find_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => Some(l.header.index),
            _ => None,
        })
        .ok_or_else(|| NetError::Protocol {
            what: "rtnetlink",
            op: "get link".into(),
            message: format!("no link {name}"),
        })
}

/// One rtnetlink request (message and flags) of a [`apply`] batch.
pub(crate) type Op = (RouteNetlinkMessage, u16);

/// Send `ops` in one `sendmsg`; the kernel applies them in order. The first error is returned.
pub(crate) fn apply(nl: &mut Netlink, ops: Vec<Op>, what: &str) -> Result<(), NetError> {
    nl.transact(ops.into_iter().map(|(m, f)| (m, f | NLM_F_ACK)).collect(), what)
}

/// No IPv6 link-local address for this link (`addr_gen_mode none`): the pair only needs the
/// addresses we give it, and the kernel then skips the per-link address generation and
/// duplicate-address detection work. Set while the link is down.
pub(crate) fn no_ipv6_autoconf(index: u32) -> Op {
    use netlink_packet_route::link::{AfSpecInet6, AfSpecUnspec, In6AddrGenMode};
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.attributes.push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(vec![AfSpecInet6::AddrGenMode(
        In6AddrGenMode::None,
    )])]));
    (RouteNetlinkMessage::SetLink(msg), 0)
}

pub(crate) fn set_up(index: u32) -> Op {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.header.flags = LinkFlags::Up;
    msg.header.change_mask = LinkFlags::Up;
    (RouteNetlinkMessage::SetLink(msg), 0)
}

/// `ip addr add ADDR/PREFIX dev INDEX [nodad]`.
pub(crate) fn add_address(index: u32, addr: IpAddr, prefix: u8) -> Op {
    let mut msg = AddressMessage::default();
    msg.header.index = index;
    msg.header.prefix_len = prefix;
    msg.header.family = family(addr);
    msg.attributes.push(AddressAttribute::Local(addr));
    msg.attributes.push(AddressAttribute::Address(addr));
    if addr.is_ipv6() {
        msg.header.flags = AddressHeaderFlags::Nodad;
        msg.attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    (RouteNetlinkMessage::NewAddress(msg), NLM_F_CREATE | NLM_F_EXCL)
}

/// `ip route add default via GATEWAY dev INDEX`.
pub(crate) fn add_default_route(index: u32, gateway: IpAddr) -> Op {
    let mut msg = RouteMessage::default();
    msg.header.address_family = family(gateway);
    msg.header.table = RouteHeader::RT_TABLE_MAIN;
    msg.header.protocol = RouteProtocol::Static;
    msg.header.scope = RouteScope::Universe;
    msg.header.kind = RouteType::Unicast;
    msg.attributes.push(RouteAttribute::Gateway(match gateway {
        IpAddr::V4(a) => RouteAddress::Inet(a),
        IpAddr::V6(a) => RouteAddress::Inet6(a),
    }));
    msg.attributes.push(RouteAttribute::Oif(index));
    (RouteNetlinkMessage::NewRoute(msg), NLM_F_CREATE | NLM_F_EXCL)
}

/// A token-bucket filter as the root qdisc of `index`: traffic leaving through that
/// interface is shaped to `rate_bytes` per second (queued, not policed, so TCP converges on
/// the rate instead of collapsing under drops).
pub(crate) fn add_tbf(index: u32, rate_bytes: u64) -> Op {
    // struct tc_ratespec { u8 cell_log; u8 linklayer; u16 overhead; s16 cell_align; u16 mpu; u32 rate; }
    // struct tc_tbf_qopt { tc_ratespec rate; tc_ratespec peakrate; u32 limit; u32 buffer; u32 mtu; }
    let rate32 = u32::try_from(rate_bytes).unwrap_or(u32::MAX);
    // 10 ms worth of tokens, never below two full-size frames.
    let burst = u32::try_from((rate_bytes / 100).max(2 * 1514)).unwrap_or(u32::MAX);
    // Queue 50 ms of traffic beyond the burst; more only adds latency.
    let limit = u32::try_from(rate_bytes / 20).unwrap_or(u32::MAX).saturating_add(burst);
    let mut qopt = Vec::with_capacity(36);
    qopt.extend_from_slice(&[0, 1 /* TC_LINKLAYER_ETHERNET */]);
    qopt.extend_from_slice(&[0; 6]);
    qopt.extend_from_slice(&rate32.to_ne_bytes());
    qopt.extend_from_slice(&[0; 12]); // no peak rate
    qopt.extend_from_slice(&limit.to_ne_bytes());
    qopt.extend_from_slice(&0u32.to_ne_bytes()); // buffer: given as TCA_TBF_BURST instead
    qopt.extend_from_slice(&0u32.to_ne_bytes()); // mtu
    const TCA_TBF_PARMS: u16 = 1;
    const TCA_TBF_BURST: u16 = 6;
    let mut msg = TcMessage::default();
    msg.header.family = AddressFamily::Unspec;
    msg.header.index = index as i32;
    msg.header.parent = TcHandle { major: 0xffff, minor: 0xffff }; // TC_H_ROOT
    msg.header.handle = TcHandle { major: 1, minor: 0 };
    msg.attributes.push(TcAttribute::Kind("tbf".into()));
    msg.attributes.push(TcAttribute::Options(vec![
        TcOption::Other(DefaultNla::new(TCA_TBF_PARMS, qopt)),
        TcOption::Other(DefaultNla::new(TCA_TBF_BURST, burst.to_ne_bytes().to_vec())),
    ]));
    (RouteNetlinkMessage::NewQueueDiscipline(msg), NLM_F_CREATE | NLM_F_EXCL)
}

fn family(a: IpAddr) -> AddressFamily {
    match a {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}
