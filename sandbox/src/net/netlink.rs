//! A synchronous netlink transport for rtnetlink and nfnetlink requests.
//!
//! The kernel processes route and netfilter requests in the sender's context, inside
//! `sendmsg`, so every acknowledgement is queued on the socket when `send` returns. A
//! request is therefore one `sendmsg` followed by draining the replies; a failed message's
//! error is returned, never dropped. Dumps are read until `NLMSG_DONE`.

use netlink_packet_core::{
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable, NLM_F_ACK, NLM_F_DUMP,
    NLM_F_REQUEST,
};
use netlink_sys::Socket;

use super::NetError;

/// One netlink socket, bound in the network namespace that was current when it was made.
pub(crate) struct Netlink {
    sock: Socket,
    seq: u32,
    what: &'static str,
}

impl Netlink {
    pub(crate) fn route() -> Result<Self, NetError> {
        Self::open(netlink_sys::constants::NETLINK_ROUTE, "rtnetlink")
    }

    pub(crate) fn netfilter() -> Result<Self, NetError> {
        Self::open(netlink_sys::constants::NETLINK_NETFILTER, "nfnetlink")
    }

    /// A socket of `protocol` (netlink-sys creates it close-on-exec).
    fn open(protocol: isize, what: &'static str) -> Result<Self, NetError> {
        let mut sock = Socket::new(protocol).map_err(|e| NetError::io(what, "socket", e))?;
        sock.bind_auto().map_err(|e| NetError::io(what, "bind", e))?;
        // Extended acks carry the kernel's reason string; best effort (old kernels lack it).
        let _ = sock.set_ext_ack(true);
        Ok(Self { sock, seq: 1, what })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    /// Serialise `msgs` into one buffer (each with `flags | NLM_F_REQUEST`), send it in one
    /// `sendmsg`, and wait for the reply to every message whose flags ask for an ACK; the
    /// first error wins. After an error the remaining replies are read without blocking (a
    /// failed nfnetlink batch is aborted, so fewer may come).
    pub(crate) fn transact<I>(&mut self, msgs: Vec<(I, u16)>, op: &str) -> Result<(), NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
    {
        let mut buf = Vec::new();
        let mut pending = Vec::new();
        for (inner, flags) in msgs {
            let seq = self.next_seq();
            let mut header = NetlinkHeader::default();
            header.flags = flags | NLM_F_REQUEST;
            header.sequence_number = seq;
            if flags & NLM_F_ACK != 0 {
                pending.push(seq);
            }
            let mut m = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(inner));
            m.finalize();
            let start = buf.len();
            buf.resize(start + m.buffer_len(), 0);
            m.serialize(&mut buf[start..]);
        }
        self.sock.send(&buf, 0).map_err(|e| NetError::io(self.what, op, e))?;
        let mut first_error: Option<NetError> = None;
        while !pending.is_empty() {
            let data = self.recv(op, first_error.is_none())?;
            let Some(data) = data else { break };
            for (seq, result) in parse_acks(&data, op, self.what)? {
                pending.retain(|s| *s != seq);
                if let Err(e) = result {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// One request with an ACK.
    pub(crate) fn request<I>(&mut self, msg: I, flags: u16, op: &str) -> Result<(), NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
    {
        self.transact(vec![(msg, flags | NLM_F_ACK)], op)
    }

    /// A dump request; returns every message until `NLMSG_DONE`.
    pub(crate) fn dump<I>(&mut self, msg: I, op: &str) -> Result<Vec<I>, NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
    {
        self.get(msg, NLM_F_DUMP, op)
    }

    /// A get request (`flags` may add `NLM_F_DUMP`); returns the replies.
    pub(crate) fn get<I>(&mut self, msg: I, flags: u16, op: &str) -> Result<Vec<I>, NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
    {
        let seq = self.next_seq();
        let mut header = NetlinkHeader::default();
        header.flags = flags | NLM_F_REQUEST;
        header.sequence_number = seq;
        let mut m = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        m.finalize();
        let mut buf = vec![0; m.buffer_len()];
        m.serialize(&mut buf);
        self.sock.send(&buf, 0).map_err(|e| NetError::io(self.what, op, e))?;
        let multipart = flags & NLM_F_DUMP == NLM_F_DUMP;
        let mut out = Vec::new();
        loop {
            let Some(data) = self.recv(op, true)? else {
                return Err(NetError::Protocol { what: self.what, op: op.into(), message: "no reply".into() });
            };
            let mut offset = 0;
            while offset < data.len() {
                let msg = NetlinkMessage::<I>::deserialize(&data[offset..]).map_err(|e| NetError::Protocol {
                    what: self.what,
                    op: op.into(),
                    message: format!("undecodable reply: {e}"),
                })?;
                let len = msg.header.length as usize;
                offset += len.max(16).next_multiple_of(4);
                if msg.header.sequence_number != seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Done(_) => return Ok(out),
                    NetlinkPayload::Error(e) => match e.code {
                        None if !multipart => return Ok(out),
                        None => {}
                        Some(code) => {
                            return Err(NetError::Kernel {
                                what: self.what,
                                op: op.into(),
                                errno: -code.get(),
                                detail: String::new(),
                            })
                        }
                    },
                    NetlinkPayload::InnerMessage(inner) => {
                        out.push(inner);
                        if !multipart {
                            return Ok(out);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Receive one datagram; `None` when `block` is false and nothing is queued.
    fn recv(&self, op: &str, block: bool) -> Result<Option<Vec<u8>>, NetError> {
        let mut buf = vec![0u8; 64 * 1024];
        let flags = if block { 0 } else { libc::MSG_DONTWAIT };
        loop {
            let mut slice = &mut buf[..];
            match self.sock.recv(&mut slice, flags) {
                Ok(n) => {
                    buf.truncate(n);
                    return Ok(Some(buf));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(NetError::io(self.what, op, e)),
            }
        }
    }
}

/// The (sequence, verdict) of every ACK or error in one datagram.
/// One acknowledgement: the request's sequence number and the kernel's verdict.
type Ack = (u32, Result<(), NetError>);

fn parse_acks(data: &[u8], op: &str, what: &'static str) -> Result<Vec<Ack>, NetError> {
    let mut out = Vec::new();
    let mut offset = 0;
    while offset + 16 <= data.len() {
        let len = u32::from_ne_bytes([data[offset], data[offset + 1], data[offset + 2], data[offset + 3]]) as usize;
        let kind = u16::from_ne_bytes([data[offset + 4], data[offset + 5]]);
        let seq = u32::from_ne_bytes([data[offset + 8], data[offset + 9], data[offset + 10], data[offset + 11]]);
        if len < 16 || offset + len > data.len() {
            return Err(NetError::Protocol { what, op: op.into(), message: "truncated reply".into() });
        }
        // NLMSG_ERROR (2): i32 error, then the offending header (+ extended-ack attributes).
        if kind == 2 && len >= 20 {
            let code = i32::from_ne_bytes([data[offset + 16], data[offset + 17], data[offset + 18], data[offset + 19]]);
            let verdict = if code == 0 {
                Ok(())
            } else {
                Err(NetError::Kernel {
                    what,
                    op: op.into(),
                    errno: -code,
                    detail: ext_ack_message(&data[offset..offset + len]),
                })
            };
            out.push((seq, verdict));
        }
        offset += len.next_multiple_of(4);
    }
    Ok(out)
}

/// NLMSGERR_ATTR_MSG (1) from an error message's extended-ack attributes, if present.
fn ext_ack_message(msg: &[u8]) -> String {
    // header (16) + error (4) + the offending message's header (16), then (capped) its
    // payload unless NLM_F_CAPPED (0x100) — with NLM_F_ACK_TLVS (0x200) the TLVs follow.
    let flags = u16::from_ne_bytes([msg[6], msg[7]]);
    if flags & 0x200 == 0 || msg.len() < 36 {
        return String::new();
    }
    let inner_len = u32::from_ne_bytes([msg[20], msg[21], msg[22], msg[23]]) as usize;
    let mut off = if flags & 0x100 != 0 { 36 } else { 20 + inner_len.next_multiple_of(4) };
    while off + 4 <= msg.len() {
        let alen = u16::from_ne_bytes([msg[off], msg[off + 1]]) as usize;
        let akind = u16::from_ne_bytes([msg[off + 2], msg[off + 3]]) & 0x3fff;
        if alen < 4 || off + alen > msg.len() {
            break;
        }
        if akind == 1 {
            let text = &msg[off + 4..off + alen];
            let text = text.split(|b| *b == 0).next().unwrap_or_default();
            return String::from_utf8_lossy(text).into_owned();
        }
        off += alen.next_multiple_of(4);
    }
    String::new()
}
