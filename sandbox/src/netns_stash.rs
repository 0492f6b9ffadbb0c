//! A stash of fresh network namespaces, made ahead of time on a background thread, so that a
//! sandbox started through a zygote joins one instead of creating its own on its start path.
//! Creating a network namespace (`setup_net`: every per-namespace subsystem, the loopback
//! device, the sysctl tables) is the largest single kernel step of a sandbox's start —
//! about 0.5–0.7 ms of the zygote path on the development VM (issue 6).
//!
//! Guarantees:
//! - every namespace is new: made by `unshare(CLONE_NEWNET)` for the stash, and nothing has
//!   been in it but the stash's thread, which did one thing there — bring `lo` up — and
//!   left. [`NetnsStash::take`] moves the only descriptor out, so a namespace is handed out
//!   at most once and never comes back;
//! - a namespace is owned by the user namespace of the process that made the stash (the
//!   agent's), not by the sandbox's: the sandbox's processes hold no capability over it,
//!   not even before they drop theirs, so they can neither reconfigure `lo`, add
//!   interfaces, change its sysctls nor load nftables rules in it (a namespace a sandbox
//!   creates itself is owned by the sandbox's user namespace);
//! - a stash that cannot make namespaces (no `CAP_SYS_ADMIN`, a seccomp filter, a kernel
//!   without network namespaces) stops, says why in [`StashStatus::broken`] and the log, and
//!   hands out nothing more; a sandbox then creates its own namespace, as without a stash.
//!   An empty stash never makes a sandbox wait.
//!
//! What a prepared namespace cannot be used for: a fresh sysfs (mounting one needs
//! `CAP_SYS_ADMIN` over the network namespace's owner) — see
//! [`crate::SandboxSpec::can_join_prepared_net`].

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use nix::sched::CloneFlags;

/// A stash of up to `target` fresh network namespaces, refilled in the background.
pub struct NetnsStash {
    shared: Arc<Shared>,
    filler: Option<JoinHandle<()>>,
}

struct Shared {
    target: usize,
    state: Mutex<State>,
    /// Signalled when a namespace was taken or the stash is stopping.
    wake: Condvar,
}

#[derive(Default)]
struct State {
    ready: Vec<OwnedFd>,
    stopping: bool,
    broken: Option<String>,
    made: u64,
    taken: u64,
}

/// What [`NetnsStash::status`] reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StashStatus {
    pub target: usize,
    pub ready: usize,
    /// Namespaces made and handed out since the stash started.
    pub made: u64,
    pub taken: u64,
    /// Why the stash stopped making namespaces, if it did.
    pub broken: Option<String>,
}

impl std::fmt::Debug for NetnsStash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetnsStash").field("status", &self.status()).finish()
    }
}

impl NetnsStash {
    /// Start the stash's thread, which makes namespaces until `target` are ready.
    pub fn start(target: usize) -> std::io::Result<NetnsStash> {
        let shared = Arc::new(Shared { target, state: Mutex::new(State::default()), wake: Condvar::new() });
        let filler = {
            let shared = shared.clone();
            std::thread::Builder::new().name("netns-stash".into()).spawn(move || fill(&shared))?
        };
        Ok(NetnsStash { shared, filler: Some(filler) })
    }

    /// A fresh network namespace, if one is ready; the stash makes another in the background.
    pub fn take(&self) -> Option<OwnedFd> {
        let mut state = self.shared.lock();
        let fd = state.ready.pop()?;
        state.taken += 1;
        self.shared.wake.notify_all();
        Some(fd)
    }

    pub fn status(&self) -> StashStatus {
        let state = self.shared.lock();
        StashStatus {
            target: self.shared.target,
            ready: state.ready.len(),
            made: state.made,
            taken: state.taken,
            broken: state.broken.clone(),
        }
    }

    /// Wait until the stash is full or broken (tests and benchmarks: a deterministic start).
    pub fn wait_full(&self) -> StashStatus {
        let mut state = self.shared.lock();
        while state.ready.len() < self.shared.target && state.broken.is_none() && !state.stopping {
            state = self.shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        drop(state);
        self.status()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a thread panicked while holding it; the state (a list
        // of descriptors and counters) is consistent after every statement.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for NetnsStash {
    fn drop(&mut self) {
        self.shared.lock().stopping = true;
        self.shared.wake.notify_all();
        if let Some(filler) = self.filler.take() {
            let _ = filler.join();
        }
    }
}

/// The stash's thread: make namespaces while fewer than `target` are ready.
fn fill(shared: &Shared) {
    // Signals are for the threads of the program that made the stash: one that blocks a
    // signal in order to wait for it (the agent's SIGTERM) must not see it delivered here,
    // with its default action, instead.
    if let Err(e) = nix::sys::signal::SigSet::all().thread_block() {
        return stop(shared, format!("block signals: {}", e.desc()));
    }
    // The thread's own namespace, to return to after making each one (a thread left inside
    // a namespace would keep it alive after its sandbox ended).
    let home = match File::open("/proc/thread-self/ns/net") {
        Ok(f) => f,
        Err(e) => return stop(shared, format!("open /proc/thread-self/ns/net: {e}")),
    };
    loop {
        {
            let mut state = shared.lock();
            while !state.stopping && state.ready.len() >= shared.target {
                state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.stopping {
                return;
            }
        }
        match make(&home) {
            Ok(ns) => {
                let mut state = shared.lock();
                state.ready.push(ns);
                state.made += 1;
                shared.wake.notify_all();
            }
            Err(e) => return stop(shared, e),
        }
    }
}

fn stop(shared: &Shared, why: String) {
    tracing::warn!(error = %why, "network namespace stash stopped; sandboxes create their own");
    shared.lock().broken = Some(why);
    shared.wake.notify_all();
}

/// One fresh namespace with `lo` up; the calling thread is back in `home` afterwards (or
/// the error says it could not return, and the thread must stop).
fn make(home: &File) -> Result<OwnedFd, String> {
    nix::sched::unshare(CloneFlags::CLONE_NEWNET).map_err(|e| format!("unshare(CLONE_NEWNET): {}", e.desc()))?;
    let made = File::open("/proc/thread-self/ns/net").map_err(|e| format!("open the new namespace: {e}"));
    let lo = crate::namespaces::loopback_up().map_err(|e| e.to_string());
    nix::sched::setns(home.as_fd(), CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("return to the stash thread's namespace: {}", e.desc()))?;
    lo?;
    Ok(made?.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn inode(fd: &OwnedFd) -> u64 {
        File::from(fd.try_clone().unwrap()).metadata().unwrap().ino()
    }

    /// The interfaces of `ns` and whether each is up, seen from a thread that joins it.
    fn interfaces_in(ns: &OwnedFd) -> Vec<(String, bool)> {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).unwrap();
                let dev = std::fs::read_to_string("/proc/thread-self/net/dev").unwrap();
                dev.lines()
                    .skip(2)
                    .filter_map(|l| l.split(':').next())
                    .map(|name| {
                        let name = name.trim().to_string();
                        let up = is_up(&name);
                        (name, up)
                    })
                    .collect()
            })
            .join()
            .unwrap()
        })
    }

    fn is_up(name: &str) -> bool {
        use std::os::fd::AsRawFd;
        let sock = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet,
            nix::sys::socket::SockType::Datagram,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        // SAFETY: ifreq is plain old data; all-zero is a valid value.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes().chain([0])) {
            *dst = src as libc::c_char;
        }
        // SAFETY: SIOCGIFFLAGS writes into the ifreq we own.
        assert_eq!(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) }, 0);
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        (unsafe { ifr.ifr_ifru.ifru_flags } & libc::IFF_UP as libc::c_short) != 0
    }

    #[test]
    fn namespaces_are_fresh_distinct_and_refilled() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var_os("CI").is_none(), "CI runs the tests as root");
            return;
        }
        let home = std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino();
        let stash = NetnsStash::start(2).unwrap();
        assert_eq!(stash.wait_full().ready, 2);
        // Kept open so that the kernel cannot reuse an inode number for a later namespace.
        let mut taken: Vec<OwnedFd> = Vec::new();
        for _ in 0..5 {
            stash.wait_full();
            let ns = stash.take().expect("a ready namespace");
            let ino = inode(&ns);
            assert_ne!(ino, home, "the caller's own namespace was handed out");
            assert!(taken.iter().all(|t| inode(t) != ino), "namespace {ino} handed out twice");
            assert_eq!(interfaces_in(&ns), vec![("lo".to_string(), true)]);
            taken.push(ns);
        }
        let status = stash.wait_full();
        assert_eq!((status.ready, status.taken, status.broken), (2, 5, None));
        assert!(status.made >= 7);
        // The stash thread went home each time: this thread never moved either.
        assert_eq!(std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino(), home);
        // The stash's thread blocks SIGTERM (and every other signal): a program that waits
        // for SIGTERM with it blocked would otherwise be killed by its default action.
        let stash_thread = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .find(|t| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default().trim() == "netns-stash")
            .expect("the stash's thread");
        let status = std::fs::read_to_string(stash_thread.path().join("status")).unwrap();
        let blocked = status.lines().find_map(|l| l.strip_prefix("SigBlk:")).unwrap().trim();
        let blocked = u64::from_str_radix(blocked, 16).unwrap();
        assert_ne!(blocked & (1 << (libc::SIGTERM - 1)), 0, "SigBlk {blocked:x}");
        drop(stash);
        drop(taken);
    }
}
