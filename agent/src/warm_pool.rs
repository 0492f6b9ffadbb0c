//! A warm pool (off by default; `agent.warm_pool: N`): executor sandboxes started ahead of
//! their work, each waiting for its runtime arguments, so that a run finds its sandbox
//! already isolated.
//!
//! Guarantees:
//! - A pooled sandbox serves only a run whose complete sandbox spec — namespaces, view,
//!   Landlock rules, seccomp profile, limits, identity, environment and the executor's
//!   resolved package directory — equals the spec it was started with: the pool changes when
//!   the isolation is built, never what it is. A run that differs in anything (another
//!   executor or version, tightened limits) starts its own sandbox.
//! - Nothing of an executor runs before its sandbox is taken: the payload blocks reading its
//!   arguments, which only the run sends. The run's clock (timeout, wall time) starts when it
//!   takes the sandbox ([`sandbox::Sandbox::start_pooled`]).
//! - Runs with network egress never use the pool (their network is wired per run).
//! - A pooled sandbox whose host paths were replaced since it was built (an executor
//!   removed and installed again at the same version; a system path — the shared libraries'
//!   cache, the resolver's configuration, the time zone link — replaced or re-pointed), or
//!   whose payload has ended (the OOM killer's first victim), is discarded when a run would
//!   take it; the run starts its own. So is one built before a masked path beneath the
//!   paths it shows was replaced or created (a new file renamed over a masked one, as
//!   `passwd` writes `/etc/shadow`, shows unmasked in a sandbox built before — the kernel
//!   detaches the cover with the old file): a pooled sandbox masks what a fresh one would.
//!   (What a path holds is not compared: a file changed in place shows in every sandbox,
//!   pooled or not.)
//! - The pool holds at most its size; a sandbox idle for longer than its idle limit
//!   (`agent.warm_pool_idle_seconds`, default [`DEFAULT_MAX_IDLE`]) is discarded; dropping
//!   a pooled sandbox kills it and removes its cgroups. Refills run on background threads,
//!   at most the pool's size at a time per spec.
//! - A pooled sandbox with an application channel is a runtime waiting for its arguments:
//!   the pool asks it to warm up ([`crate::app::RuntimeArgs::Warm`]: break copy-on-write
//!   sharing with the zygote, read the network facts — the runtime's own code only) and
//!   offers it only once it has replied; one that does not reply within [`WARM_LIMIT`], or
//!   replies anything else, is discarded. This moves ~470 page faults per run (the
//!   interpreter's first writes to pages it shares with the zygote) off the run's path, for
//!   about the zygote's resident writable memory (~3 MiB) held privately by each waiting
//!   payload.
//!
//! The pool learns from the runs: after a run of spec S it starts a sandbox for S, evicting
//! the longest-idle one when full — once the run has its outcome or has gone on for
//! [`REFILL_DELAY`], whichever comes first: the refill's start of a sandbox (milliseconds of
//! CPU) does not compete with a short run for the CPUs, and a long run's refill is not held
//! back for other commands of its spec ([`WarmPool::refill_after`]). The daemon pre-warms it
//! at start with one sandbox for each installed executor without egress (by name, up to the
//! pool's size), each for a run without tightened limits
//! ([`crate::command::Pipeline::prewarm_pool`]).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sandbox::{Launcher, Sandbox, SandboxSpec};

/// A pooled sandbox idle for longer than this is discarded rather than used, by default.
pub const DEFAULT_MAX_IDLE: Duration = Duration::from_secs(600);

/// The smallest idle limit (`agent.warm_pool_idle_seconds`).
pub const MIN_IDLE_LIMIT: Duration = Duration::from_secs(1);

/// The largest idle limit (`agent.warm_pool_idle_seconds`).
pub const MAX_IDLE_LIMIT: Duration = Duration::from_secs(86_400);

/// The largest `agent.warm_pool`.
pub const MAX_SIZE: usize = 64;

/// How long a pooled runtime may take to warm up before its sandbox is discarded.
pub const WARM_LIMIT: Duration = Duration::from_secs(10);

/// How long a run's refill waits for the run to end ([`WarmPool::refill_after`]).
pub const REFILL_DELAY: Duration = Duration::from_millis(50);

struct Warm {
    spec: SandboxSpec,
    /// The identity of every host path the spec binds, taken before the sandbox was built.
    sources: Vec<Source>,
    sandbox: Sandbox,
    since: Instant,
}

/// What a host path the view shows was when a sandbox was built.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    Missing,
    /// A symlink the view recreates (a system path on a merged-/usr host, a host's
    /// `/etc/localtime`): its target.
    Link(PathBuf),
    /// Anything else, bound: its device, inode and when that inode was made (a freed inode
    /// number comes back at once on ext4, so the pair alone could name a later file).
    Bound(u64, u64, Born),
    /// The host's mounts at or beneath the declared paths, in mountinfo's order: id, parent,
    /// device, root and mount point. A declared path is bound with every mount beneath it,
    /// as they were then (the sandbox's mount namespace is private): a mount made over part
    /// of it later (one hiding a directory) is not in a sandbox built before, and one
    /// unmounted since is still there.
    Mounts(Vec<(u32, u32, String, PathBuf, PathBuf)>),
    /// The mount table could not be read: never equal to another (the sandbox is discarded).
    MountsUnknown(u64),
}

/// When an inode was made: its birth time where the filesystem keeps one; else, for a file,
/// its status change time (a file written in place then counts as changed too: a needless
/// discard, never a missed one); nothing for a directory without one (whose status changes
/// with every entry made in it).
type Born = Option<(i64, i64)>;

/// `m`'s identity as a [`Source::Bound`].
fn bound(m: &std::fs::Metadata) -> Source {
    use std::os::unix::fs::MetadataExt;
    let born = match m.created().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()) {
        Some(d) => Some((d.as_secs() as i64, i64::from(d.subsec_nanos()))),
        None if m.is_dir() => None,
        None => Some((m.ctime(), m.ctime_nsec())),
    };
    Source::Bound(m.dev(), m.ino(), born)
}

/// What every host path `spec` shows was, now — its declared paths and its system paths
/// (the shared libraries' cache, `/etc/resolv.conf`, the time zone, the standard library…).
/// A pooled sandbox shows the files that were there when it was built: one whose package
/// directory (or any other path it shows) has since been replaced — an executor removed and
/// installed again at the same version, `ldconfig`, a new time zone or resolver
/// configuration — would run with the old files, so it is discarded instead of handed out.
/// A declared writable path under `/tmp` is made in the sandbox's own scratch, never taken
/// from the host: not looked at (anyone can create or remove the host's).
fn sources(spec: &SandboxSpec) -> Vec<Source> {
    let system = spec.filesystem.system.iter().map(|r| {
        match std::fs::symlink_metadata(&r.path) {
            Ok(m) if m.file_type().is_symlink() => std::fs::read_link(&r.path).map_or(Source::Missing, Source::Link),
            // Bound as the host root resolves it (links in its parents followed).
            Ok(_) => std::fs::metadata(&r.path).map_or(Source::Missing, |m| bound(&m)),
            Err(_) => Source::Missing,
        }
    });
    let declared: Vec<&sandbox::spec::PathRule> =
        spec.filesystem.paths.iter().filter(|r| !made_in_scratch(r)).collect();
    let identities = declared
        .iter()
        .map(|r| std::fs::metadata(r.source.as_ref().unwrap_or(&r.path)).map_or(Source::Missing, |m| bound(&m)));
    let mounts = (!declared.is_empty()).then(|| mounts_beneath(&declared));
    system.chain(identities).chain(masked_sources(spec)).chain(mounts).collect()
}

/// [`Source::Mounts`] of `declared`'s host sources (as the host root resolves them).
fn mounts_beneath(declared: &[&sandbox::spec::PathRule]) -> Source {
    static UNKNOWN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    // This thread's (the process's) mount namespace, as the sandbox's view is made in.
    let Ok(text) = std::fs::read("/proc/thread-self/mountinfo") else {
        return Source::MountsUnknown(UNKNOWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    };
    let table = sandbox::mountinfo::parse(&text);
    let roots: Vec<PathBuf> =
        declared.iter().filter_map(|r| std::fs::canonicalize(r.source.as_ref().unwrap_or(&r.path)).ok()).collect();
    Source::Mounts(
        table
            .into_iter()
            .filter(|m| roots.iter().any(|root| m.mount_point.starts_with(root)))
            .map(|m| (m.id, m.parent, m.device, m.root, m.mount_point))
            .collect(),
    )
}

/// What each masked path the view shows from the host is now (a masked path beneath a
/// system or declared path): a sandbox covers what the path held when it was built. A host
/// that renames a new file over a masked one (`passwd` replaces `/etc/shadow` so) detaches
/// the cover in every mount namespace — the new file shows unmasked in a sandbox built
/// before —, so a pooled sandbox built before such a rename is discarded, not handed out;
/// so is one built before a masked path that was missing then was created (`/etc/shadow-`
/// at the first password change), which it never covered.
fn masked_sources(spec: &SandboxSpec) -> impl Iterator<Item = Source> + '_ {
    let shown: Vec<&sandbox::spec::PathRule> =
        spec.filesystem.system.iter().chain(&spec.filesystem.paths).filter(|r| !made_in_scratch(r)).collect();
    spec.filesystem.masked.iter().flat_map(move |masked| {
        // The deepest shown path it lies beneath, and where that comes from on the host.
        let Some(rule) =
            shown.iter().filter(|r| masked.starts_with(&r.path)).max_by_key(|r| r.path.components().count())
        else {
            return Vec::new();
        };
        let Ok(rel) = masked.strip_prefix(&rule.path) else { return Vec::new() };
        let host = rule.source.as_ref().unwrap_or(&rule.path).join(rel);
        // A masked link covers what it leads to: the link and its target both count.
        let followed = || std::fs::metadata(&host).map_or(Source::Missing, |m| bound(&m));
        match std::fs::symlink_metadata(&host) {
            Ok(m) if m.file_type().is_symlink() => {
                vec![std::fs::read_link(&host).map_or(Source::Missing, Source::Link), followed()]
            }
            Ok(m) => vec![bound(&m)],
            Err(_) => vec![Source::Missing],
        }
    })
}

/// A declared writable path under `/tmp`: made in the sandbox's own scratch, never taken
/// from the host (anyone can create or remove the host's), so not looked at.
fn made_in_scratch(r: &sandbox::spec::PathRule) -> bool {
    r.source.is_none() && r.path.starts_with("/tmp") && r.access == sandbox::spec::Access::ReadWrite
}

/// Whether `pooled` is `spec` but for the identities of the files it binds (an executor's
/// package directory removed and installed again): never asked for again.
fn superseded(pooled: &SandboxSpec, spec: &SandboxSpec) -> bool {
    let paths = (&pooled.filesystem.paths, &spec.filesystem.paths);
    if paths.0.len() != paths.1.len() || paths.0.iter().zip(paths.1).all(|(a, b)| a.identity == b.identity) {
        return false;
    }
    let without_identity = |s: &SandboxSpec| {
        let mut s = s.clone();
        s.filesystem.paths.iter_mut().for_each(|r| r.identity = None);
        s
    };
    without_identity(pooled) == without_identity(spec)
}

#[derive(Default)]
struct State {
    ready: VecDeque<Warm>,
    /// Specs being started now.
    filling: Vec<SandboxSpec>,
    /// After [`WarmPool::shutdown`]: nothing is started or kept any more.
    closed: bool,
}

pub struct WarmPool {
    size: usize,
    /// Readable once [`WarmPool::shutdown`] has begun (it writes to `stopping.1`): a warm-up
    /// under way polls it, so that a stop does not wait out [`WARM_LIMIT`].
    stopping: (std::os::fd::OwnedFd, std::os::fd::OwnedFd),
    /// How long a sandbox may wait for its run.
    max_idle: Duration,
    launcher: Launcher,
    /// Whether runs refill the pool (not for a one-shot command, which would exit with a
    /// sandbox half-started).
    refills: bool,
    state: Mutex<State>,
}

/// Held by a run that took (or wanted) a pooled sandbox: its refill starts when this is
/// dropped ([`WarmPool::refill_after`]).
pub struct RefillTrigger {
    _run: std::sync::mpsc::Sender<()>,
}

/// A spec being started by a refill thread: taken out of [`State::filling`] when dropped.
struct Filling {
    pool: Arc<WarmPool>,
    spec: SandboxSpec,
}

impl Drop for Filling {
    fn drop(&mut self) {
        let mut st = self.pool.state();
        if let Some(i) = st.filling.iter().position(|s| *s == self.spec) {
            st.filling.remove(i);
        }
    }
}

impl WarmPool {
    /// A pool of at most `size` sandboxes, started with `launcher`, each discarded once it has
    /// waited longer than `max_idle`.
    pub fn new(size: usize, max_idle: Duration, launcher: Launcher) -> Result<Arc<WarmPool>, nix::Error> {
        Ok(Arc::new(WarmPool {
            size: size.min(MAX_SIZE),
            stopping: stop_pipe()?,
            max_idle: max_idle.clamp(MIN_IDLE_LIMIT, MAX_IDLE_LIMIT),
            launcher,
            refills: true,
            state: Mutex::default(),
        }))
    }

    /// A pool of one sandbox that [`WarmPool::fill`] starts and one run takes; never refilled.
    pub fn single_use(launcher: Launcher) -> Result<Arc<WarmPool>, nix::Error> {
        Ok(Arc::new(WarmPool {
            size: 1,
            stopping: stop_pipe()?,
            max_idle: DEFAULT_MAX_IDLE,
            launcher,
            refills: false,
            state: Mutex::default(),
        }))
    }

    /// Stop refilling, kill and remove every ready sandbox, end the warm-ups under way, and
    /// wait (up to 10 s) for the sandboxes being started, which are then discarded too.
    pub fn shutdown(&self) {
        let ready: Vec<Warm> = {
            let mut st = self.state();
            st.closed = true;
            st.ready.drain(..).collect()
        };
        // One byte, never read: the read end stays readable for every warm-up from now on.
        if let Err(e) = nix::unistd::write(&self.stopping.1, b"s") {
            tracing::warn!(error = %e, "warm pool: cannot tell the warm-ups under way to stop");
        }
        drop(ready);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.state().filling.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves the queue consistent (every change is one
        // push or remove), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long a sandbox may wait for its run before it is discarded.
    pub fn max_idle(&self) -> Duration {
        self.max_idle
    }

    /// Discard the sandboxes idle for longer than the pool's idle limit (killed and removed outside
    /// the lock). A long-running agent calls it now and then, so that idle ones do not wait
    /// for a run of their spec to be discarded.
    pub fn expire(&self) {
        let expired: Vec<Warm> = {
            let mut st = self.state();
            let (old, fresh): (Vec<Warm>, Vec<Warm>) =
                st.ready.drain(..).partition(|w| w.since.elapsed() > self.max_idle);
            st.ready = fresh.into();
            old
        };
        if !expired.is_empty() {
            tracing::debug!(expired = expired.len(), "warm pool: idle sandboxes discarded");
        }
        drop(expired);
    }

    /// A ready sandbox started with exactly `spec`, if there is one.
    pub fn take(&self, spec: &SandboxSpec) -> Option<Sandbox> {
        let now = sources(spec);
        let (found, expired) = {
            let mut st = self.state();
            // Expired, built over host files that have since been replaced, or for files a
            // run no longer asks for (its executor installed again): discarded.
            let expired: Vec<Warm> = {
                let (old, fresh): (Vec<Warm>, Vec<Warm>) = st.ready.drain(..).partition(|w| {
                    let changed = w.spec == *spec && w.sources != now;
                    if changed {
                        // Which one: the first that differs, by its place in `sources`.
                        let at = w.sources.iter().zip(&now).position(|(a, b)| a != b);
                        tracing::info!(?at, "warm pool: a ready sandbox discarded: a host path it shows (or a mask beneath one) changed since it was built");
                    }
                    w.since.elapsed() > self.max_idle || changed || superseded(&w.spec, spec)
                });
                st.ready = fresh.into();
                old
            };
            let found = st.ready.iter().position(|w| w.spec == *spec).and_then(|i| st.ready.remove(i));
            (found, expired)
        };
        // Killed and reaped outside the lock.
        drop(expired);
        let mut sb = found?.sandbox;
        match sb.start_pooled() {
            Ok(()) => Some(sb),
            Err(e) => {
                // Dropped (killed and removed); the run starts a sandbox of its own.
                tracing::warn!(error = %e, "warm pool: a ready sandbox could not be released");
                None
            }
        }
    }

    /// Start a sandbox for `spec` on a background thread (unless the pool's size of them are
    /// being started).
    pub fn refill(self: &Arc<Self>, spec: SandboxSpec) {
        self.refill_when(spec, None);
    }

    /// As [`WarmPool::refill`], for the run that just took (or wanted) a sandbox of `spec`:
    /// the refill starts when the returned trigger is dropped — the run has its outcome, or
    /// ended early — or after [`REFILL_DELAY`], whichever comes first. It counts as being
    /// started from now on.
    pub fn refill_after(self: &Arc<Self>, spec: SandboxSpec) -> RefillTrigger {
        let (tx, rx) = std::sync::mpsc::channel();
        self.refill_when(spec, Some(rx));
        RefillTrigger { _run: tx }
    }

    fn refill_when(self: &Arc<Self>, spec: SandboxSpec, run_ends: Option<std::sync::mpsc::Receiver<()>>) {
        if self.size == 0 || !self.refills {
            return;
        }
        {
            let mut st = self.state();
            // At most the pool's size per spec at once: concurrent runs of one spec each get
            // their refill (a refill now waits for its run), a burst does not start more.
            if st.closed || st.filling.iter().filter(|s| **s == spec).count() >= self.size {
                return;
            }
            st.filling.push(spec.clone());
        }
        // Out of `filling` whatever happens: after the fill, if `fill` panics, and if the
        // thread cannot be started (the closure, and with it the guard, is dropped) — a spec
        // left there would never be refilled again and would hold `shutdown` for its 10 s.
        let filling = Filling { pool: Arc::clone(self), spec };
        let spawned = std::thread::Builder::new().name("warm-pool".into()).spawn(move || {
            if let Some(rx) = run_ends {
                // Nothing is ever sent: the trigger's drop (or the delay) ends the wait.
                let _ = rx.recv_timeout(REFILL_DELAY);
            }
            if let Err(e) = filling.pool.fill(filling.spec.clone()) {
                tracing::warn!(error = %e, "warm pool: could not start a sandbox");
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "warm pool: no refill thread");
        }
    }

    /// Start a sandbox for `spec` now and add it to the pool.
    pub fn fill(&self, spec: SandboxSpec) -> Result<(), sandbox::SandboxError> {
        if self.size == 0 || self.state().closed {
            return Ok(());
        }
        let sources = sources(&spec);
        let sandbox = crate::launch::spawn_with_fallback(&spec, &self.launcher, None)?;
        if sandbox.app_channel().is_some() {
            // Ended on failure: the pool offers only warmed runtimes.
            let prefaulted_kib = match warm_up(&sandbox, &self.stopping.0) {
                Ok(kib) => kib,
                Err(e) => {
                    // A sandbox whose set-up failed (a path out of its user's reach) has no
                    // runtime to answer: its own error says why. Stopped first, so the wait
                    // is short whatever the runtime was doing.
                    sandbox.stop_handle().stop();
                    return Err(match sandbox.wait(sandbox::OutputOptions::default()) {
                        // A step of the set-up that failed, not the stop above ending it.
                        Err(sandbox::SandboxError::Step(step)) if step.stage != sandbox::Stage::Protocol => {
                            sandbox::SandboxError::Step(step)
                        }
                        _ => sandbox::SandboxError::Channel(format!("warm-up: {e}")),
                    });
                }
            };
            tracing::debug!(prefaulted_kib, "warm pool: a sandbox is warmed up");
        }
        let evicted = {
            let mut st = self.state();
            if st.closed {
                Some(Warm { spec, sources, sandbox, since: Instant::now() })
            } else {
                let evicted = if st.ready.len() >= self.size { st.ready.pop_front() } else { None };
                st.ready.push_back(Warm { spec, sources, sandbox, since: Instant::now() });
                evicted
            }
        };
        // Killed, reaped and its cgroups removed outside the lock.
        drop(evicted);
        Ok(())
    }

    /// The most sandboxes the pool holds.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Sandboxes ready now.
    pub fn ready(&self) -> usize {
        self.state().ready.len()
    }
}

/// A close-on-exec pipe (read end, write end) for [`WarmPool::stopping`].
fn stop_pipe() -> Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd), nix::Error> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
}

/// Ask the runtime waiting in `sandbox` to warm up and wait (up to [`WARM_LIMIT`], or until
/// `stopping` is readable: the pool is shutting down) for its reply; returns the KiB it
/// populated. Everything read comes from the sandbox.
fn warm_up(sandbox: &Sandbox, stopping: &std::os::fd::OwnedFd) -> Result<u64, String> {
    use crate::app::{self, FromPayload, RuntimeArgs};
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let chan = sandbox.app_channel().ok_or("no application channel")?;
    chan.send_bytes(&app::encode_args(&RuntimeArgs::Warm)).map_err(|e| format!("send: {}", e.desc()))?;
    let deadline = Instant::now() + WARM_LIMIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = [PollFd::new(chan.as_fd(), PollFlags::POLLIN), PollFd::new(stopping.as_fd(), PollFlags::POLLIN)];
        match poll(&mut pfd, PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX)) {
            Ok(0) => return Err(format!("no reply within {} s", WARM_LIMIT.as_secs())),
            Ok(_) if pfd[1].any().unwrap_or(true) => return Err("the pool is shutting down".into()),
            Ok(_) => break,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(format!("poll: {}", e.desc())),
        }
    }
    // The rest of the reply within the same limit: a runtime that sent part of it and
    // stalled, or trickles packets, must not hold the refill thread (and its spec's refills).
    let reply = app::recv_by(chan, Some(deadline));
    match reply? {
        Some(FromPayload::Warmed { prefaulted_kib }) => Ok(prefaulted_kib),
        Some(FromPayload::WrongBuild { build }) => Err(app::wrong_build_error(&build)),
        // Untrusted and up to 16 MiB: named, not printed.
        Some(other) => Err(format!("unexpected reply {}", other.kind())),
        None => Err("the runtime ended".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox::{Access, Identity, PathRule};
    use std::path::Path;

    /// A pooled sandbox for the files a run no longer asks for — its spec the same but for the
    /// identities of what it binds (an executor installed again) — is discarded by the take.
    #[test]
    fn a_spec_differing_only_in_identity_is_superseded() {
        let mut old = SandboxSpec::new("/bin/true", vec![], Identity::same_inside(65534, 65534));
        let rule = |ino| PathRule {
            path: PathBuf::from("/var/lib/x"),
            access: Access::Read,
            optional: false,
            source: None,
            identity: Some(sandbox::FileId { dev: 1, ino }),
        };
        old.filesystem.paths = vec![rule(1)];
        let mut new = old.clone();
        assert!(!superseded(&old, &new), "the same spec");
        new.filesystem.paths = vec![rule(2)];
        assert!(superseded(&old, &new));
        new.command.args = vec!["x".into()];
        assert!(!superseded(&old, &new), "another spec altogether");
    }

    /// What a pooled sandbox is checked against before it is handed out: every path it shows
    /// from the host — system paths (a file replaced, a link pointed elsewhere) and declared
    /// ones — but not a writable `/tmp` path, which the sandbox makes in its own scratch.
    #[test]
    fn sources_cover_the_system_paths_and_not_the_sandboxs_own_tmp() {
        let dir = std::env::temp_dir().join(format!("opservant-pool-sources-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (file, link, declared) = (dir.join("ld.so.cache"), dir.join("localtime"), dir.join("pkg"));
        std::fs::write(&file, b"old").unwrap();
        std::os::unix::fs::symlink("/usr/share/zoneinfo/Etc/UTC", &link).unwrap();
        std::fs::create_dir(&declared).unwrap();
        let tmp = PathBuf::from(format!("/tmp/opservant-pool-scratch-{}", std::process::id()));
        let _ = std::fs::remove_dir(&tmp);
        let rule = |path: &PathBuf, access| PathRule {
            path: path.clone(),
            access,
            optional: true,
            source: None,
            identity: None,
        };
        let mut spec = SandboxSpec::new("/bin/true", vec![], Identity::same_inside(65534, 65534));
        spec.filesystem.system = vec![rule(&file, Access::Read), rule(&link, Access::Read)];
        spec.filesystem.paths = vec![rule(&declared, Access::Read), rule(&tmp, Access::ReadWrite)];

        let before = sources(&spec);
        assert_eq!(before.len(), 4, "system and declared paths, not the scratch /tmp one, and mounts: {before:?}");
        assert!(matches!(before[3], Source::Mounts(_)), "{before:?}");
        assert!(matches!(before[1], Source::Link(ref t) if t == Path::new("/usr/share/zoneinfo/Etc/UTC")));
        std::fs::create_dir(&tmp).unwrap();
        assert_eq!(sources(&spec), before, "the host's /tmp path is not what the sandbox shows");
        std::fs::remove_dir(&tmp).unwrap();

        // A system file replaced (a new inode, as `ldconfig` writes it), a link re-pointed.
        std::fs::write(dir.join("new"), b"new").unwrap();
        std::fs::rename(dir.join("new"), &file).unwrap();
        assert_ne!(sources(&spec)[0], before[0]);
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink("/usr/share/zoneinfo/Europe/Paris", &link).unwrap();
        assert_ne!(sources(&spec)[1], before[1]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Masked paths beneath a shown host path count (where a declared path comes from
    /// elsewhere on the host, there); masked paths of the sandbox's own `/proc` do not.
    #[test]
    fn sources_cover_the_masked_paths_the_view_shows_from_the_host() {
        let dir = std::env::temp_dir().join(format!("opservant-pool-masks-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("etc")).unwrap();
        std::fs::create_dir_all(dir.join("host-data")).unwrap();
        std::fs::write(dir.join("etc/shadow"), b"old").unwrap();
        let mut spec = SandboxSpec::new("/bin/true", vec![], Identity::same_inside(65534, 65534));
        spec.filesystem.system = vec![PathRule {
            path: dir.join("etc"),
            access: Access::Read,
            optional: true,
            source: None,
            identity: None,
        }];
        spec.filesystem.paths = vec![PathRule {
            path: PathBuf::from("/data"),
            access: Access::Read,
            optional: true,
            source: Some(dir.join("host-data")),
            identity: None,
        }];
        spec.filesystem.masked =
            vec![dir.join("etc/shadow"), dir.join("etc/shadow-"), "/data/key".into(), "/proc/kcore".into()];
        let before = sources(&spec);
        assert_eq!(before.len(), 2 + 3 + 1, "two shown paths, three masks beneath them, mounts: {before:?}");
        assert_eq!(before[3], Source::Missing);
        // Replaced by a rename, as `passwd` does: another inode.
        std::fs::write(dir.join("new"), b"new").unwrap();
        std::fs::rename(dir.join("new"), dir.join("etc/shadow")).unwrap();
        let after = sources(&spec);
        assert_ne!(after[2], before[2]);
        // Created since: no longer missing; under a declared path, at its host source.
        std::fs::write(dir.join("etc/shadow-"), b"x").unwrap();
        std::fs::write(dir.join("host-data/key"), b"x").unwrap();
        let created = sources(&spec);
        assert_ne!(created[3], Source::Missing);
        assert_ne!(created[4], Source::Missing);
        // A masked link: its text and what it leads to (the cover is on the target).
        std::os::unix::fs::symlink("shadow", dir.join("etc/linked")).unwrap();
        spec.filesystem.masked.push(dir.join("etc/linked"));
        let linked = sources(&spec);
        assert_eq!((linked.len(), &linked[5]), (8, &Source::Link("shadow".into())));
        assert_eq!(linked[6], linked[2], "the link's target is the masked file");
        std::fs::write(dir.join("new"), b"newer").unwrap();
        std::fs::rename(dir.join("new"), dir.join("etc/shadow")).unwrap();
        assert_ne!(sources(&spec)[6], linked[6]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A mount made beneath a declared path after a sandbox was built — one hiding a
    /// directory — or one unmounted since changes what the path shows: a pooled sandbox
    /// holds the mounts as they were (a review read a covered secret through one).
    #[test]
    fn sources_cover_the_mounts_beneath_the_declared_paths() {
        // SAFETY: geteuid has no preconditions. (Mounting needs root; as another user the
        // mount namespace is not this test's to make.)
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let dir = std::env::temp_dir().join(format!("opservant-pool-mounts-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data/private")).unwrap();
        let mut spec = SandboxSpec::new("/bin/true", vec![], Identity::same_inside(65534, 65534));
        spec.filesystem.paths = vec![PathRule {
            path: dir.join("data"),
            access: Access::Read,
            optional: false,
            source: None,
            identity: None,
        }];
        // In a mount namespace of this thread's own, private: nothing reaches the host's.
        let inside = dir.clone();
        let probe = std::thread::spawn(move || {
            let dir = inside;
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).unwrap();
            nix::mount::mount(
                None::<&str>,
                "/",
                None::<&str>,
                nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .unwrap();
            let before = sources(&spec);
            let cover = dir.join("data/private");
            nix::mount::mount(Some("tmpfs"), &cover, Some("tmpfs"), nix::mount::MsFlags::empty(), None::<&str>)
                .unwrap();
            let covered = sources(&spec);
            nix::mount::umount(&cover).unwrap();
            let uncovered = sources(&spec);
            (before, covered, uncovered)
        });
        let (before, covered, uncovered) = probe.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_ne!(covered, before, "a mount made beneath a declared path");
        assert_ne!(covered, uncovered, "the same mount gone again");
        assert_eq!(uncovered, before);
    }
}
