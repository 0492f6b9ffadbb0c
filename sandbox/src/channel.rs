//! The parent ⇄ sandbox channel: a `SOCK_SEQPACKET` socketpair carrying one JSON message per
//! packet. Message boundaries are preserved by the kernel, so a message is never split or
//! merged; end-of-file means every process holding the sandbox end has exited (the payload's
//! copy is close-on-exec), which is how the parent learns that the sandbox is gone.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use zeroize::Zeroizing;

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, MsgFlags, SockFlag, SockType};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::error::StepError;
use crate::report::{EnforcementReport, ExitInfo};
use crate::spec::SandboxSpec;

/// The fd number the channel has in the sandbox init process.
pub const CHILD_FD: RawFd = 3;
/// The fd number of the application channel in the sandbox processes and the payload.
pub const APP_FD: RawFd = 4;
/// The message that releases a held payload ([`crate::spec::CommandSpec::held`]).
pub const GO: &[u8] = b"go";

/// Most descriptors one message carries (the kernel's limit, `SCM_MAX_FD`, is 253).
pub const MAX_FDS: usize = 200;

/// Largest message accepted (a spec with many paths and three seccomp filters is ~40 KiB).
const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// Parent → sandbox.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToSandbox {
    /// The sandbox to build (first message; a forked monitor already has it).
    Spec(Box<SandboxSpec>),
    /// The host uid leased for the sandbox ([`crate::host_uid`]), sent right after the spec
    /// when it has a range: the owner of the sandbox's user namespace, which the monitor
    /// creates once it has this (see [`crate::namespaces::enter_user_namespace_owned_by`]).
    Owner { uid: u32 },
    /// The cgroup files the monitor writes `0` to, joining the sandbox cgroups before it
    /// creates the cgroup namespace.
    Cgroups { join: Vec<PathBuf> },
    /// Detached mounts of declared paths, prepared by the parent (bound with the sandbox's
    /// user namespace as their idmapping, see [`crate::idmap`]), carried with the message as
    /// descriptors (`SCM_RIGHTS`), one per index of `filesystem.paths` listed, in order. Sent
    /// between the id maps and `Proceed`, possibly several times (a message carries at most
    /// [`MAX_FDS`]).
    Binds { paths: Vec<usize> },
    /// Id maps are written and the namespaces are wired: go on.
    Proceed,
}

/// The namespaces a monitor hands over with [`FromSandbox::Unshared`] when its user
/// namespace is owned by a leased host uid, in this order (`/proc/self/ns/NAME`).
pub const UNSHARED_NAMESPACES: [&str; 3] = ["user", "mnt", "net"];

/// Sandbox → parent.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromSandbox {
    /// Monitor: namespaces exist; write the id maps now. Carries the monitor's namespaces
    /// ([`UNSHARED_NAMESPACES`]) when a leased host uid owns its user namespace.
    Unshared,
    /// Monitor: host pid of the sandbox init (PID 1 inside).
    InitForked { pid: i32 },
    /// Payload: every restriction is in place; `execve` follows.
    Started(Box<EnforcementReport>),
    /// Any process: a step failed; the sandbox is being torn down.
    Failed(StepError),
    /// Init: the payload ended; init now kills and reaps every other process of the
    /// sandbox, and `PayloadExited` follows once they are gone — unless one is stuck in the
    /// kernel, which the parent then learns of by the wait, not by the payload's run time.
    PayloadEnded(ExitInfo),
    /// Init: the payload ended, and every other process of the sandbox is reaped.
    PayloadExited(ExitInfo),
    /// Init, after `PayloadExited`: every other process of the sandbox is reaped and init
    /// holds no output pipe any more; resource usage of the whole tree (init's own and that
    /// of every process it reaped). Init exits right after. The outcome is complete here:
    /// what follows is teardown.
    TreeUsage { cpu_ms: u64, peak_rss_bytes: u64 },
    /// Monitor: init has been reaped (every sandbox process is gone); resource usage of the
    /// whole tree, and how init itself ended (a signal there, before the payload's exit was
    /// reported, is what ended the sandbox from outside). The monitor exits right after
    /// (tearing down the namespaces).
    InitExited {
        cpu_ms: u64,
        peak_rss_bytes: u64,
        /// (Unknown — both fields `None` — from a monitor that does not send it.)
        #[serde(default)]
        init_exit: ExitInfo,
    },
}

/// One end of the channel.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
}

impl Channel {
    /// A connected pair, both ends close-on-exec.
    pub fn pair() -> Result<(Channel, Channel), Errno> {
        let (a, b) = socket::socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
        Ok((Channel { fd: a }, Channel { fd: b }))
    }

    /// Adopt an inherited descriptor and make it close-on-exec (`dup2` onto the inherited
    /// number cleared the flag; without it the payload would inherit the channel).
    ///
    /// # Safety
    /// `fd` must be an open descriptor owned by nobody else in this process.
    pub unsafe fn from_raw(fd: RawFd) -> Result<Channel, Errno> {
        // SAFETY: guaranteed by the caller.
        let chan = Channel { fd: unsafe { OwnedFd::from_raw_fd(fd) } };
        chan.set_cloexec()?;
        Ok(chan)
    }

    fn set_cloexec(&self) -> Result<(), Errno> {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag};
        fcntl(&self.fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).map(drop)
    }

    /// Let an `execve`d program inherit this descriptor.
    pub fn set_inheritable(&self) -> Result<(), Errno> {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag};
        fcntl(&self.fd, FcntlArg::F_SETFD(FdFlag::empty())).map(drop)
    }

    /// The descriptor will be closed by `execve`.
    pub fn is_cloexec(&self) -> bool {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag};
        fcntl(&self.fd, FcntlArg::F_GETFD).is_ok_and(|f| FdFlag::from_bits_truncate(f).contains(FdFlag::FD_CLOEXEC))
    }

    pub fn send<T: Serialize>(&self, msg: &T) -> Result<(), Errno> {
        let bytes = Zeroizing::new(serde_json::to_vec(msg).map_err(|_| Errno::EINVAL)?);
        loop {
            match socket::send(self.fd.as_raw_fd(), &bytes, MsgFlags::MSG_NOSIGNAL) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e),
                Ok(_) => return Ok(()),
            }
        }
    }

    /// The size of the next message (peeked, not taken); `None` at end-of-file.
    fn next_len(&self) -> Result<Option<usize>, String> {
        let len = loop {
            let mut probe = [0u8; 1];
            match socket::recv(self.fd.as_raw_fd(), &mut probe, MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(format!("recv: {}", e.desc())),
                Ok(0) => return Ok(None),
                Ok(n) => break n,
            }
        };
        if len > MAX_MESSAGE {
            return Err(format!("message of {len} bytes exceeds {MAX_MESSAGE}"));
        }
        Ok(Some(len))
    }

    /// Send one message with `fds` attached (`SCM_RIGHTS`; at most [`MAX_FDS`]).
    pub fn send_with_fds<T: Serialize>(&self, msg: &T, fds: &[RawFd]) -> Result<(), Errno> {
        if fds.len() > MAX_FDS {
            return Err(Errno::E2BIG);
        }
        let bytes = Zeroizing::new(serde_json::to_vec(msg).map_err(|_| Errno::EINVAL)?);
        let iov = [std::io::IoSlice::new(&bytes)];
        let cmsg = [socket::ControlMessage::ScmRights(fds)];
        let cmsgs: &[socket::ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
        loop {
            match socket::sendmsg::<()>(self.fd.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e),
                Ok(_) => return Ok(()),
            }
        }
    }

    /// Receive one message and the descriptors attached to it (close-on-exec); `Ok(None)`
    /// on end-of-file. A message whose descriptors did not all arrive (`MSG_CTRUNC`) is an
    /// error; those that did are closed.
    pub fn recv_with_fds<T: DeserializeOwned>(&self) -> Result<Option<(T, Vec<OwnedFd>)>, String> {
        let Some(len) = self.next_len()? else { return Ok(None) };
        let mut buf = Zeroizing::new(vec![0u8; len]);
        let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
        let (n, fds, truncated) = loop {
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            match socket::recvmsg::<()>(self.fd.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(format!("recvmsg: {}", e.desc())),
                Ok(msg) => {
                    let mut fds = Vec::new();
                    for c in msg.cmsgs().map_err(|e| format!("recvmsg: {}", e.desc()))? {
                        if let socket::ControlMessageOwned::ScmRights(raw) = c {
                            // SAFETY: the kernel just installed these descriptors in this
                            // process for this message; nothing else owns them.
                            fds.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                        }
                    }
                    break (msg.bytes, fds, msg.flags.contains(MsgFlags::MSG_CTRUNC));
                }
            }
        };
        if truncated {
            return Err("a message's descriptors were cut off".into());
        }
        serde_json::from_slice(&buf[..n]).map(|m| Some((m, fds))).map_err(|e| format!("malformed message: {e}"))
    }

    /// Receive one message; `Ok(None)` on end-of-file.
    pub fn recv<T: DeserializeOwned>(&self) -> Result<Option<T>, String> {
        let Some(len) = self.next_len()? else { return Ok(None) };
        let mut buf = Zeroizing::new(vec![0u8; len]);
        let n = loop {
            match socket::recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(format!("recv: {}", e.desc())),
                Ok(n) => break n,
            }
        };
        serde_json::from_slice(&buf[..n]).map(Some).map_err(|e| format!("malformed message: {e}"))
    }

    /// Send `data` of any size as a sequence of packets (one SEQPACKET message is bounded by
    /// the socket buffer): each packet starts with a flag byte, 1 = more follow, 0 = last.
    pub fn send_bytes(&self, data: &[u8]) -> Result<(), Errno> {
        self.send_bytes_by(data, None)
    }

    /// As [`Channel::send_bytes`], the whole message by `deadline` (when given): a peer that
    /// stops reading, or reads a packet now and then, fails it (`ETIMEDOUT`) once the
    /// deadline has passed.
    pub fn send_bytes_by(&self, data: &[u8], deadline: Option<std::time::Instant>) -> Result<(), Errno> {
        const PACKET: usize = 32 * 1024;
        let mut chunks = data.chunks(PACKET).peekable();
        let mut packet = Vec::with_capacity(PACKET + 1);
        loop {
            let chunk = chunks.next().unwrap_or(&[]);
            packet.clear();
            packet.push(u8::from(chunks.peek().is_some()));
            packet.extend_from_slice(chunk);
            loop {
                if let Some(deadline) = deadline {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
                    let mut pfd = [nix::poll::PollFd::new(self.fd.as_fd(), nix::poll::PollFlags::POLLOUT)];
                    match nix::poll::poll(&mut pfd, nix::poll::PollTimeout::from(ms)) {
                        Ok(0) if left.as_millis() <= u128::from(u16::MAX) => return Err(Errno::ETIMEDOUT),
                        Ok(0) | Err(Errno::EINTR) => continue,
                        Err(e) => return Err(e),
                        Ok(_) => {}
                    }
                }
                // Without a deadline, blocking; with one, never past what `poll` allowed.
                let flags = if deadline.is_some() { MsgFlags::MSG_DONTWAIT } else { MsgFlags::empty() };
                match socket::send(self.fd.as_raw_fd(), &packet, MsgFlags::MSG_NOSIGNAL | flags) {
                    Err(Errno::EINTR | Errno::EAGAIN) => continue,
                    Err(e) => return Err(e),
                    Ok(_) => break,
                }
            }
            if chunks.peek().is_none() {
                return Ok(());
            }
        }
    }

    /// Receive one [`Channel::send_bytes`] message of at most `max` bytes; `Ok(None)` on
    /// end-of-file. A longer or malformed message is an error (the peer may be hostile).
    pub fn recv_bytes(&self, max: usize) -> Result<Option<Vec<u8>>, String> {
        self.recv_bytes_by(max, None)
    }

    /// As [`Channel::recv_bytes`], the whole message by `deadline` (when given): a peer that
    /// sends part of a message and stalls, or trickles packets, fails it once the deadline
    /// has passed.
    pub fn recv_bytes_by(&self, max: usize, deadline: Option<std::time::Instant>) -> Result<Option<Vec<u8>>, String> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 32 * 1024 + 1];
        let mut reset = false;
        loop {
            if let Some(deadline) = deadline {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                // Rounded up: poll's milliseconds, rounded down, woke it before the deadline,
                // and a caller that then found time left took the message for broken rather
                // than late (a session's stalled call reported as a protocol break).
                let ms = u16::try_from(left.as_micros().div_ceil(1000)).unwrap_or(u16::MAX);
                let mut pfd = [nix::poll::PollFd::new(self.fd.as_fd(), nix::poll::PollFlags::POLLIN)];
                match nix::poll::poll(&mut pfd, nix::poll::PollTimeout::from(ms)) {
                    Ok(0) if std::time::Instant::now() >= deadline => {
                        return Err("no complete message within the time limit".into())
                    }
                    Ok(0) | Err(Errno::EINTR) => continue,
                    Err(e) => return Err(format!("poll: {}", e.desc())),
                    Ok(_) => {}
                }
            }
            let n = loop {
                match socket::recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                    Err(Errno::EINTR) => continue,
                    // The peer closed its end with a message of ours unread: the kernel says
                    // so once, before what the peer sent is read. That is still its own (a
                    // result sent before it ended), and end of file follows it.
                    Err(Errno::ECONNRESET) if !reset => reset = true,
                    Err(e) => return Err(format!("recv: {}", e.desc())),
                    Ok(n) => break n,
                }
            };
            if n == 0 {
                return if out.is_empty() { Ok(None) } else { Err("end of file inside a message".into()) };
            }
            if out.len() + n - 1 > max {
                return Err(format!("message exceeds {max} bytes"));
            }
            out.extend_from_slice(&buf[1..n]);
            match buf[0] {
                0 => return Ok(Some(out)),
                // The sender's continuation packets are full: an empty one only stalls.
                1 if n == 1 => return Err("an empty continuation packet".into()),
                1 => continue,
                f => return Err(format!("bad packet flag {f}")),
            }
        }
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// A handle that shuts this channel's socket down from another thread, waking a reader
    /// or writer blocked on it — for a sandbox abandoned with its processes stuck, whose end
    /// never closes. It holds a duplicate of this end: the peer sees end of file only once
    /// the handle is dropped too.
    pub fn shutdown_handle(&self) -> Result<ShutdownHandle, Errno> {
        let fd = self.fd.try_clone().map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
        Ok(ShutdownHandle(fd))
    }

    /// Shut the socket down both ways, as [`ShutdownHandle::shutdown`]: the peer's sends fail
    /// and its receives reach end of file, whatever other descriptors of this end stay open.
    pub fn shutdown(&self) {
        let _ = socket::shutdown(self.fd.as_raw_fd(), socket::Shutdown::Both);
    }

    pub fn into_owned_fd(self) -> OwnedFd {
        self.fd
    }
}

/// See [`Channel::shutdown_handle`].
#[derive(Debug)]
pub struct ShutdownHandle(OwnedFd);

impl ShutdownHandle {
    /// Shut the socket down both ways: a blocked receive returns end of file, a send fails.
    pub fn shutdown(&self) {
        let _ = socket::shutdown(self.0.as_raw_fd(), socket::Shutdown::Both);
    }
}

impl AsFd for Channel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_received_whole_by_its_deadline_or_not_at_all() {
        let raw_send = |c: &Channel, packet: &[u8]| {
            socket::send(c.fd.as_raw_fd(), packet, MsgFlags::MSG_NOSIGNAL).unwrap();
        };
        // Part of a message, then nothing: an error at the deadline, not a wait for ever.
        let (a, b) = Channel::pair().unwrap();
        raw_send(&a, b"\x01part");
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(200);
        let err = b.recv_bytes_by(1024, Some(deadline)).unwrap_err();
        assert!(err.contains("time limit"), "{err}");
        // Empty continuation packets (a trickle that adds nothing): refused at once.
        let (a, b) = Channel::pair().unwrap();
        raw_send(&a, b"\x01");
        assert!(b.recv_bytes(1024).unwrap_err().contains("empty continuation"));
        // A whole message in time is received.
        let (a, b) = Channel::pair().unwrap();
        a.send_bytes(b"hello").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        assert_eq!(b.recv_bytes_by(1024, Some(deadline)).unwrap().as_deref(), Some(&b"hello"[..]));
    }

    #[test]
    fn roundtrip_and_eof() {
        let (a, b) = Channel::pair().unwrap();
        a.send(&FromSandbox::InitForked { pid: 42 }).unwrap();
        a.send(&FromSandbox::Unshared).unwrap();
        match b.recv::<FromSandbox>().unwrap() {
            Some(FromSandbox::InitForked { pid }) => assert_eq!(pid, 42),
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(b.recv::<FromSandbox>().unwrap(), Some(FromSandbox::Unshared)));
        drop(a);
        assert!(b.recv::<FromSandbox>().unwrap().is_none());
    }

    #[test]
    fn large_messages_are_framed_and_bounded() {
        let (a, b) = Channel::pair().unwrap();
        let big: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let writer = std::thread::spawn(move || {
            a.send_bytes(&big).unwrap();
            a.send_bytes(b"").unwrap();
            a.send_bytes(&[7u8; 100]).unwrap();
            big
        });
        let got = b.recv_bytes(1 << 20).unwrap().unwrap();
        let big = writer.join().unwrap();
        assert_eq!(got, big);
        assert_eq!(b.recv_bytes(10).unwrap().unwrap(), b"");
        assert!(b.recv_bytes(10).unwrap_err().contains("exceeds"));
    }

    #[test]
    fn adopted_channel_is_close_on_exec() {
        let (a, b) = Channel::pair().unwrap();
        let raw = nix::unistd::dup(&b).unwrap();
        use std::os::fd::IntoRawFd;
        let raw = raw.into_raw_fd();
        // SAFETY: `raw` is a fresh duplicate owned by nobody else.
        let adopted = unsafe { Channel::from_raw(raw) }.unwrap();
        assert!(adopted.is_cloexec());
        drop((a, b));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let (a, b) = Channel::pair().unwrap();
        socket::send(a.raw_fd(), b"{not json", MsgFlags::empty()).unwrap();
        assert!(b.recv::<FromSandbox>().is_err());
    }
}
