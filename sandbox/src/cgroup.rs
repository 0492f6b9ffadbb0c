//! Per-sandbox cgroups on cgroup v2 (primary) and v1/hybrid hosts.
//!
//! Guarantees:
//! - Sandbox cgroups are only ever created beneath the cgroup this process is in, for each
//!   hierarchy — never at a hierarchy root we were not placed at. On v2 this process first
//!   moves itself (with any of its descendants already there) into a leaf `opservant-agent`
//!   (the no-internal-process rule) and creates sandbox cgroups beside it,
//!   `opservant-sb-<creator pid>-<creator start time>-<seq>`; a process there that is not ours
//!   is an error.
//! - A requested limit that cannot be applied is an error, unless the caller allowed degraded
//!   mode; then it is listed in [`CgroupReport::degraded`]. Enabling a controller is verified
//!   by reading `cgroup.subtree_control` back.
//! - Teardown kills everything left (`cgroup.kill` on v2 when the kernel has it, a SIGKILL
//!   sweep otherwise) and removes the directories; cgroups of crashed creators are reaped.
//!   A creator is alive only if a process has its pid *and* its start time (a restarted
//!   agent that got its predecessor's pid reaps the predecessor's cgroups). The sweep
//!   signals a process through a pidfd opened while it was still listed in the cgroup,
//!   never a pid number that may have been reused meanwhile. A cgroup this process could
//!   not remove in time (a process in it that cannot exit yet: stuck in the kernel, frozen)
//!   is logged and tried again, one `rmdir` each, whenever this process creates a sandbox
//!   cgroup — its creator being alive, no sweep for stale ones would ever take it.
//!
//! Written in-house rather than with `cgroups-rs` 0.5: that crate ignores failures when
//! enabling controllers, does not read `oom_kill` from v2 `memory.events`, and pulls in zbus.

use std::fs;
use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::CgroupError;
use crate::report::CgroupReport;
use crate::spec::Limits;

/// The kernel's default CFS period (`cpu.cfs_period_us` of a fresh v1 cgroup; the period
/// `cpu.max` assumes on v2), used unless `Limits::cpu_period_us` asks for another window.
pub const DEFAULT_CPU_PERIOD_US: u64 = 100_000;
/// The sandbox init (PID 1 inside), added on top of the payload's pids budget (the monitor
/// stays outside the sandbox cgroup).
pub const HELPER_TASKS: u32 = 1;
const SANDBOX_PREFIX: &str = "opservant-sb-";
const AGENT_LEAF: &str = "opservant-agent";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Controller {
    Memory,
    Cpu,
    Pids,
}

impl Controller {
    const ALL: [Controller; 3] = [Controller::Memory, Controller::Cpu, Controller::Pids];

    fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Cpu => "cpu",
            Controller::Pids => "pids",
        }
    }
}

/// Where a controller can be used from this process.
#[derive(Debug, Clone)]
enum Place {
    /// v1 hierarchy: the directory of this process's own cgroup in it.
    V1(PathBuf),
    /// The v2 base directory (sandbox cgroups are created in it).
    V2(PathBuf),
    Missing(String),
}

/// The cgroup layout seen by this process, discovered (and on v2 prepared) once.
#[derive(Debug)]
struct Layout {
    places: [Place; 3],
    has_cgroup_kill: bool,
}

impl Layout {
    fn place(&self, c: Controller) -> &Place {
        &self.places[c as usize]
    }
}

static LAYOUT: OnceLock<Layout> = OnceLock::new();
static SEQ: AtomicU64 = AtomicU64::new(0);
/// How long teardown waits for a sandbox's cgroups to empty once what is left in them was
/// killed.
const REMOVE_PATIENCE: Duration = Duration::from_secs(5);
/// Sandbox cgroups of this process whose removal timed out, tried again at every create;
/// each with the host uid lease of its sandbox, held until the cgroup is gone — its
/// processes, stuck in the kernel, still run as that uid ([`SandboxCgroup::hold_until_removed`]).
type LeftBehind = (PathBuf, Option<Arc<crate::host_uid::Lease>>);
static LEFT_BEHIND: Mutex<Vec<LeftBehind>> = Mutex::new(Vec::new());

/// Note a sandbox cgroup directory whose removal failed, to try again later.
fn remember_left_behind(dir: PathBuf, hold: Option<Arc<crate::host_uid::Lease>>) {
    // A poisoned list is still a list of paths: nothing half-updated matters here.
    let mut left = LEFT_BEHIND.lock().unwrap_or_else(|e| e.into_inner());
    if !left.iter().any(|(d, _)| d == &dir) {
        // The lease's marker names this cgroup: after this process has ended too, its uid
        // is not leased while the cgroup holds a process.
        left.push((dir, hold));
    }
}

/// Try once more to remove the sandbox cgroups left behind (one `rmdir` each: what is in
/// them was killed when they were first removed).
fn retry_left_behind() {
    let mut left = LEFT_BEHIND.lock().unwrap_or_else(|e| e.into_inner());
    left.retain(|(dir, _)| match fs::remove_dir(dir) {
        Ok(()) => {
            tracing::info!(cgroup = %dir.display(), "sandbox cgroup left behind earlier removed");
            false
        }
        Err(e) if e.kind() == ErrorKind::NotFound => false,
        Err(_) => true,
    });
}

fn layout() -> &'static Layout {
    LAYOUT.get_or_init(|| {
        let layout = discover(true);
        reap_stale(&layout);
        layout
    })
}

/// A cgroup mount of `/proc/self/mountinfo`, reduced to what we need.
struct CgroupMount {
    root: String,
    mount_point: PathBuf,
    fstype: String,
    super_opts: Vec<String>,
}

fn cgroup_mounts() -> std::io::Result<Vec<CgroupMount>> {
    Ok(crate::mountinfo::read()?
        .into_iter()
        .filter(|m| m.fstype == "cgroup" || m.fstype == "cgroup2")
        .map(|m| CgroupMount {
            root: m.root.to_string_lossy().into_owned(),
            mount_point: m.mount_point,
            fstype: m.fstype,
            super_opts: m.super_opts,
        })
        .collect())
}

/// Resolve `own` (a path from /proc/self/cgroup) inside a mount of that hierarchy.
fn dir_in_mount(m: &CgroupMount, own: &str) -> Option<PathBuf> {
    let rel = if m.root == "/" { own } else { own.strip_prefix(m.root.as_str())? };
    Some(m.mount_point.join(rel.trim_start_matches('/')))
}

/// Find where each controller can be used. With `prepare`, a v2 base is made usable (this
/// process may move into its leaf and controllers get enabled); without, nothing is changed
/// and the answer says what preparing would give.
fn discover(prepare: bool) -> Layout {
    // What this process could not read is the reason, not "no hierarchy" (the layout is
    // discovered once per process: a restart reads again).
    let (own_text, mounts, why) = match (fs::read_to_string("/proc/self/cgroup"), cgroup_mounts()) {
        (Ok(own), Ok(mounts)) => (own, mounts, "no cgroup hierarchy offers it".to_string()),
        (Err(e), _) => (String::new(), Vec::new(), format!("cannot read /proc/self/cgroup: {e}")),
        (_, Err(e)) => (String::new(), Vec::new(), format!("cannot read /proc/self/mountinfo: {e}")),
    };
    let mut places = [Place::Missing(why.clone()), Place::Missing(why.clone()), Place::Missing(why)];
    let mut v2_own: Option<String> = None;

    for line in own_text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if ctrls.is_empty() {
            v2_own = Some(path.to_string());
            continue;
        }
        for c in Controller::ALL {
            if !ctrls.split(',').any(|x| x == c.name()) {
                continue;
            }
            let mount = mounts.iter().find(|m| m.fstype == "cgroup" && m.super_opts.iter().any(|o| o == c.name()));
            places[c as usize] = match mount.and_then(|m| dir_in_mount(m, path)) {
                Some(dir) if dir.is_dir() => Place::V1(dir),
                Some(dir) => Place::Missing(format!("v1 {} cgroup {} does not exist", c.name(), dir.display())),
                None => {
                    Place::Missing(format!("v1 {} hierarchy is not mounted where this process can reach it", c.name()))
                }
            };
        }
    }

    let mut has_cgroup_kill = false;
    if let Some(own) = v2_own {
        let wanted: Vec<Controller> =
            Controller::ALL.into_iter().filter(|c| matches!(places[*c as usize], Place::Missing(_))).collect();
        if let Some(m) = mounts.iter().find(|m| m.fstype == "cgroup2") {
            if !wanted.is_empty() {
                match dir_in_mount(m, &own) {
                    Some(dir) => {
                        let root = m.mount_point.clone();
                        match prepare_v2(&root, &dir, &wanted, prepare) {
                            Ok((base, enabled)) => {
                                has_cgroup_kill = base.join("cgroup.kill").exists()
                                    || base.join(AGENT_LEAF).join("cgroup.kill").exists()
                                    || (base == root && kernel_has_cgroup_kill());
                                for c in wanted {
                                    places[c as usize] = if enabled.contains(&c) {
                                        Place::V2(base.clone())
                                    } else {
                                        Place::Missing(format!(
                                            "v2 controller '{}' is not available in {}",
                                            c.name(),
                                            base.display()
                                        ))
                                    };
                                }
                            }
                            Err(reason) => {
                                for c in wanted {
                                    places[c as usize] = Place::Missing(reason.clone());
                                }
                            }
                        }
                    }
                    None => {
                        for c in wanted {
                            places[c as usize] = Place::Missing("own v2 cgroup is outside the cgroup2 mount".into());
                        }
                    }
                }
            }
        }
    }
    Layout { places, has_cgroup_kill }
}

/// Make `own` usable as a v2 delegation base: when it is not the root and holds this
/// process, move this process into the leaf `own/opservant-agent` and enable the wanted
/// controllers in `own`. When this process already sits in such a leaf, its parent is the
/// base. Returns the base and the controllers enabled in it (verified by reading back).
fn prepare_v2(
    root: &Path,
    own: &Path,
    wanted: &[Controller],
    prepare: bool,
) -> Result<(PathBuf, Vec<Controller>), String> {
    let base = if own.file_name().is_some_and(|n| n == AGENT_LEAF) {
        own.parent().map(Path::to_path_buf).unwrap_or_else(|| own.to_path_buf())
    } else if own == root {
        own.to_path_buf()
    } else {
        // Our own descendants may already be here: the layout is discovered on first use,
        // which is after the monitor of the first sandbox was started (and a program using
        // this crate may have other children). They move into the leaf with us — where they
        // would be had we moved before starting them; anyone else makes the cgroup unusable.
        let me = std::process::id();
        let ours = own_processes(own, me)?;
        if prepare {
            let leaf = own.join(AGENT_LEAF);
            mkdir_ok_if_exists(&leaf).map_err(|e| format!("cannot create {}: {e}", leaf.display()))?;
            // This process first; then re-list, since a child may fork while we move.
            let mut batch = vec![me];
            batch.extend(ours.into_iter().filter(|p| *p != me));
            for _ in 0..5 {
                if batch.is_empty() {
                    break;
                }
                for pid in &batch {
                    match write_raw(&leaf.join("cgroup.procs"), &pid.to_string()) {
                        Ok(()) => {}
                        // Exited meanwhile.
                        Err(e) if *pid != me && e.raw_os_error() == Some(libc::ESRCH) => {}
                        Err(e) => return Err(format!("cannot move pid {pid} into {}: {e}", leaf.display())),
                    }
                }
                batch = own_processes(own, me)?;
            }
        }
        own.to_path_buf()
    };
    let available = fs::read_to_string(base.join("cgroup.controllers")).unwrap_or_default();
    if !prepare {
        let enabled = wanted.iter().copied().filter(|c| available.split_whitespace().any(|a| a == c.name())).collect();
        return Ok((base, enabled));
    }
    let request: Vec<String> = wanted
        .iter()
        .filter(|c| available.split_whitespace().any(|a| a == c.name()))
        .map(|c| format!("+{}", c.name()))
        .collect();
    if !request.is_empty() {
        // Each controller separately so that one refusal does not hide the others.
        for r in &request {
            let _ = fs::write(base.join("cgroup.subtree_control"), r);
        }
    }
    let enabled_text = fs::read_to_string(base.join("cgroup.subtree_control")).unwrap_or_default();
    let enabled = wanted.iter().copied().filter(|c| enabled_text.split_whitespace().any(|e| e == c.name())).collect();
    Ok((base, enabled))
}

/// The processes in v2 cgroup `dir`, all of which must be `me` or its descendants.
fn own_processes(dir: &Path, me: u32) -> Result<Vec<u32>, String> {
    let procs = fs::read_to_string(dir.join("cgroup.procs"))
        .map_err(|e| format!("cannot read {}/cgroup.procs: {e}", dir.display()))?;
    let pids: Vec<u32> = procs.lines().filter_map(|l| l.trim().parse().ok()).collect();
    let others: Vec<String> = pids.iter().filter(|p| !descends_from(**p, me)).map(u32::to_string).collect();
    if !others.is_empty() {
        return Err(format!(
            "v2 cgroup {} also holds processes {} — run opservant in its own delegated cgroup \
             (systemd Delegate=yes, or systemd-run --scope -p Delegate=yes)",
            dir.display(),
            others.join(",")
        ));
    }
    Ok(pids)
}

/// `pid` is `ancestor` or a descendant of it (following the parent pids in /proc). A
/// process that is gone counts as not ours.
fn descends_from(pid: u32, ancestor: u32) -> bool {
    let mut p = pid;
    for _ in 0..1024 {
        if p == ancestor {
            return true;
        }
        if p <= 1 {
            return false;
        }
        match parent_pid(p) {
            Some(pp) => p = pp,
            None => return false,
        }
    }
    false
}

fn parent_pid(pid: u32) -> Option<u32> {
    stat_field(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?, 4)?.parse().ok()
}

/// Field `n` (1-based, as in proc(5): 4 is the ppid, 22 the start time) of a `/proc/PID/stat`
/// line. The command name (field 2) may hold spaces and parentheses, so fields are counted
/// from its closing parenthesis.
fn stat_field(stat: &str, n: usize) -> Option<&str> {
    stat[stat.rfind(')')? + 1..].split_whitespace().nth(n.checked_sub(3)?)
}

/// cgroup.kill exists in every non-root v2 cgroup since Linux 5.14. The root has none, so
/// when this process sits at the root the kernel version has to tell.
fn kernel_has_cgroup_kill() -> bool {
    crate::probe::kernel_at_least((5, 14))
}

/// Whether a move into a cgroup through `cgroup.procs` or `tasks` is checked with the
/// credentials of the process that opened the file, not of the one writing it (Linux 5.16,
/// "cgroup: Use open-time credentials for process migraton perm checks"): then a process
/// running as another uid moves itself with a descriptor host root opened.
pub fn open_time_credentials() -> bool {
    crate::probe::kernel_at_least((5, 16))
}

fn mkdir_ok_if_exists(p: &Path) -> std::io::Result<()> {
    match fs::create_dir(p) {
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        r => r,
    }
}

/// A process's start time (clock ticks after boot, `/proc/PID/stat` field 22): with its pid,
/// it names one process for the life of the system.
fn start_time(pid: u32) -> Option<u64> {
    stat_field(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?, 22)?.parse().ok()
}

/// This process's `<pid>-<start time>`, the creator part of its sandbox cgroups' names; just
/// `<pid>` when its start time cannot be read (the older form, judged by the pid alone —
/// never a start time that would make a live creator's cgroups look stale).
fn creator_tag() -> &'static str {
    static TAG: OnceLock<String> = OnceLock::new();
    TAG.get_or_init(|| {
        let me = std::process::id();
        match start_time(me) {
            Some(t) => format!("{me}-{t}"),
            None => me.to_string(),
        }
    })
}

/// Whether the creator a sandbox cgroup's name (after the prefix) gives is still running:
/// `<pid>-<start time>-<seq>` names it by pid and start time; `<pid>-<seq>` (the older form,
/// or a creator without a readable start time) by the pid alone. Anything else — a part that
/// is not plain ASCII digits — is not a name this crate makes and is left alone. A creator
/// counts as gone only when its `/proc` entry is absent or names another process; any other
/// failure to look (descriptors exhausted, say) keeps the cgroup. A creator this process
/// cannot see in its `/proc` at all (`hidepid=invisible` hiding another user's processes, or
/// one in another PID namespace) counts as gone: sandbox cgroups are shared only between
/// creators that see each other (the agent and `opservant` commands run by root).
fn creator_alive(rest: &str) -> bool {
    let parts: Vec<&str> = rest.split('-').collect();
    if parts.iter().any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit())) {
        return true;
    }
    let Some(pid) = parts.first().and_then(|p| p.parse::<u32>().ok()) else { return true };
    if pid == std::process::id() {
        // Ours exactly when it carries this process's tag (a name of the other form, or of
        // another start time, is a predecessor's that had this pid).
        return rest.rsplit_once('-').is_some_and(|(tag, _)| tag == creator_tag());
    }
    let stat = match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s,
        Err(e) if e.kind() == ErrorKind::NotFound => return false,
        Err(_) => return true,
    };
    match parts.len() {
        2 => true,
        3 => match (stat_field(&stat, 22).and_then(|t| t.parse::<u64>().ok()), parts[1].parse::<u64>()) {
            (Some(now), Ok(named)) => now == named,
            _ => true,
        },
        _ => true,
    }
}

/// Remove sandbox cgroups whose creating process no longer exists.
fn reap_stale(layout: &Layout) {
    let mut seen = Vec::new();
    let mut stale: Vec<PathBuf> = Vec::new();
    for p in &layout.places {
        let base = match p {
            Place::V1(d) | Place::V2(d) => d,
            Place::Missing(_) => continue,
        };
        if seen.contains(base) {
            continue;
        }
        seen.push(base.clone());
        let Ok(entries) = fs::read_dir(base) else { continue };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(SANDBOX_PREFIX) else { continue };
            if creator_alive(rest) {
                continue;
            }
            tracing::warn!(cgroup = %e.path().display(), "removing stale sandbox cgroup");
            stale.push(e.path());
        }
    }
    if stale.is_empty() {
        return;
    }
    // All of them at once — their processes killed together, then one wait for them all. One
    // at a time, each cgroup of a sandbox stuck in the kernel (a hung file system) cost about
    // a second before the agent served: 17 s for six sandboxes at a review, and some ninety
    // would outlast systemd's start timeout, a restart loop just when the host is in trouble.
    kill_sweep_all(&stale);
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut pause = Duration::from_micros(200);
    loop {
        stale.retain(|dir| match fs::remove_dir(dir) {
            Ok(()) => false,
            Err(e) => e.kind() != ErrorKind::NotFound,
        });
        if stale.is_empty() || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
    // Still busy (what is in them is stuck in the kernel): tried again at every sandbox
    // start, as this process's own are — not left for the next process's start.
    for dir in stale {
        tracing::warn!(
            cgroup = %dir.display(),
            "stale sandbox cgroup still busy (processes stuck in the kernel?): its removal is tried again at every sandbox start"
        );
        remember_left_behind(dir, None);
    }
}

/// An eventfd the kernel signals when the v1 memory cgroup `dir` runs out of memory.
fn oom_eventfd(dir: &Path) -> std::io::Result<nix::sys::eventfd::EventFd> {
    use nix::sys::eventfd::{EfdFlags, EventFd};
    use std::os::fd::AsRawFd;
    let control = fs::File::open(dir.join("memory.oom_control"))?;
    let event = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
    // The registration holds its own references: `control` may be closed once it is made.
    write_raw(&dir.join("cgroup.event_control"), &format!("{} {}", event.as_raw_fd(), control.as_raw_fd()))?;
    Ok(event)
}

/// How far below its limit a v1 memory cgroup's high-water mark may stay when its own limit
/// OOM-kills: the failed charge (a page, or a huge page: 2 MiB on x86-64, up to 512 MiB on
/// arm64 with 64 KiB pages) was not counted, and a little more for rounding.
fn v1_oom_slack() -> u64 {
    const AT_LEAST: u64 = 4 << 20;
    let huge = read_u64(Path::new("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")).unwrap_or(0);
    AT_LEAST.max(huge.saturating_mul(2))
}

/// Whether swap is in use now, asked only of a sandbox whose swap limit could not be set:
/// swap turned on after this process started counts too. A kernel without swap support has
/// no `/proc/swaps` (none); any other failure to read it counts as active.
fn swap_active() -> bool {
    match fs::read_to_string("/proc/swaps") {
        Ok(s) => s.lines().count() > 1,
        Err(e) => e.kind() != ErrorKind::NotFound,
    }
}

/// Usage figures read from the sandbox cgroup.
#[derive(Debug, Clone, Copy, Default)]
pub struct CgroupUsage {
    /// CPU time of everything in the sandbox (v2 `cpu.stat` `usage_usec`).
    pub cpu_ms: Option<u64>,
    pub peak_memory_bytes: Option<u64>,
    pub oom_kills: u64,
    /// After an OOM kill: whether the sandbox's own memory limit was reached (v2: its
    /// `memory.events` counts an `oom` of its own; v1: its high-water mark came within
    /// [`v1_oom_slack`] of the limit). `Some(false)`: the host or a parent cgroup ran out.
    /// `None` without an OOM kill, or when it cannot be told.
    pub memory_limit_reached: Option<bool>,
    pub pids_limit_hits: u64,
    pub cpu_throttled_periods: u64,
    pub cpu_throttled_ms: u64,
}

/// A sandbox cgroup's name and directories, chosen before it is created
/// ([`SandboxCgroup::plan`]).
#[derive(Debug)]
pub struct CgroupPlan {
    name: String,
    dirs: Vec<PathBuf>,
}

impl CgroupPlan {
    /// The directories the cgroup will have (each once).
    pub fn dirs(&self) -> Vec<&Path> {
        self.dirs.iter().map(PathBuf::as_path).collect()
    }
}

/// The cgroup(s) of one sandbox. Dropping it kills what is left and removes the directories.
#[derive(Debug)]
pub struct SandboxCgroup {
    layout: &'static Layout,
    dirs: [Option<PathBuf>; 3],
    report: CgroupReport,
    v2: bool,
    has_cgroup_kill: bool,
    removed: bool,
    /// CPU percent still to be written (see `apply_cpu_limit`).
    /// (percent, period in µs) of the CPU quota still to be written.
    cpu_pending: Option<(u32, Option<u64>)>,
    /// v1 only: signalled by the kernel when the sandbox's memory cgroup runs out of memory
    /// (`cgroup.event_control` on `memory.oom_control`). v1 has no `memory.oom.group`: the
    /// kernel kills one victim and the rest runs on (a shell whose child was killed exits
    /// 0), where v2 kills the whole sandbox; the caller kills the rest when this fires.
    oom_event: Option<nix::sys::eventfd::EventFd>,
    /// The sandbox's host uid lease, kept with any cgroup left behind (see [`LEFT_BEHIND`]).
    hold: Option<Arc<crate::host_uid::Lease>>,
}

impl SandboxCgroup {
    /// Keep `lease` until these cgroups are removed: a cgroup left behind holds it until a
    /// later try removes it, so no other sandbox gets the uid while processes of this one
    /// (stuck in the kernel) may still run as it.
    pub fn hold_until_removed(&mut self, lease: Arc<crate::host_uid::Lease>) {
        self.hold = Some(lease);
    }

    /// Create the sandbox cgroup(s) and write the limits.
    pub fn create(limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        Self::create_planned(Self::plan(), limits)
    }

    /// The name, and the directories, of a sandbox cgroup not created yet — what a host uid
    /// lease taken before it names in its marker ([`crate::host_uid::lease`]). Created with
    /// [`SandboxCgroup::create_planned`] in these directories, or in fewer of them (a
    /// controller missing in degraded mode). The cgroups left behind earlier are tried once
    /// more first: their removal releases the host uids they hold, before the lease.
    pub fn plan() -> CgroupPlan {
        retry_left_behind();
        Self::plan_in(layout())
    }

    fn plan_in(layout: &'static Layout) -> CgroupPlan {
        let name = format!("{SANDBOX_PREFIX}{}-{}", creator_tag(), SEQ.fetch_add(1, Ordering::Relaxed));
        let mut dirs: Vec<PathBuf> = Vec::new();
        for c in Controller::ALL {
            if let Place::V1(parent) | Place::V2(parent) = layout.place(c) {
                let dir = parent.join(&name);
                if !dirs.contains(&dir) {
                    dirs.push(dir);
                }
            }
        }
        CgroupPlan { name, dirs }
    }

    /// Create the sandbox cgroup(s) of `plan` and write the limits.
    pub fn create_planned(plan: CgroupPlan, limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        Self::create_named(layout(), plan.name, limits)
    }

    #[cfg(test)]
    fn create_in(layout: &'static Layout, limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        Self::create_named(layout, Self::plan_in(layout).name, limits)
    }

    fn create_named(layout: &'static Layout, name: String, limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        let requested = [limits.memory_bytes.is_some(), limits.cpu_percent.is_some(), limits.pids.is_some()];
        let mut cg = SandboxCgroup {
            layout,
            dirs: [None, None, None],
            report: CgroupReport {
                version: "none".into(),
                paths: Vec::new(),
                memory: false,
                cpu: false,
                pids: false,
                degraded: Vec::new(),
            },
            v2: false,
            has_cgroup_kill: layout.has_cgroup_kill,
            removed: false,
            cpu_pending: None,
            oom_event: None,
            hold: None,
        };
        let (mut any_v1, mut any_v2) = (false, false);
        for c in Controller::ALL {
            let parent = match layout.place(c) {
                Place::V1(d) => {
                    any_v1 = true;
                    d
                }
                Place::V2(d) => {
                    any_v2 = true;
                    d
                }
                Place::Missing(reason) => {
                    if requested[c as usize] {
                        cg.degrade(limits, format!("{} limit not enforced: {reason}", c.name()))?;
                    }
                    continue;
                }
            };
            let dir = parent.join(&name);
            if !cg.dirs.iter().flatten().any(|d| d == &dir) {
                fs::create_dir(&dir).map_err(|e| CgroupError::Io {
                    action: "create",
                    path: dir.display().to_string(),
                    source: e,
                })?;
                cg.report.paths.push(dir.display().to_string());
            }
            cg.dirs[c as usize] = Some(dir);
        }
        cg.v2 = any_v2;
        cg.report.version = match (any_v1, any_v2) {
            (true, false) => "v1",
            (false, true) => "v2",
            (true, true) => "hybrid",
            (false, false) => "none",
        }
        .into();
        cg.apply_limits(limits)?;
        Ok(cg)
    }

    fn degrade(&mut self, limits: &Limits, what: String) -> Result<(), CgroupError> {
        if limits.allow_degraded {
            tracing::warn!(reason = %what, "running with a degraded limit");
            self.report.degraded.push(what);
            Ok(())
        } else {
            Err(CgroupError::Unavailable(what))
        }
    }

    fn dir(&self, c: Controller) -> Option<&PathBuf> {
        self.dirs[c as usize].as_ref()
    }

    fn apply_limits(&mut self, limits: &Limits) -> Result<(), CgroupError> {
        if let (Some(bytes), Some(dir)) = (limits.memory_bytes, self.dir(Controller::Memory).cloned()) {
            if self.v2_for(Controller::Memory) {
                write(&dir.join("memory.max"), &bytes.to_string())?;
                if !write_optional(&dir.join("memory.swap.max"), "0")? && swap_active() {
                    self.degrade(
                        limits,
                        "memory: swap is active but memory.swap.max is missing (swap accounting off)".into(),
                    )?;
                }
                // Kill the whole payload tree on OOM (processes with oom_score_adj -1000 are
                // exempt, which the monitor and init get where the host allows).
                if !write_optional(&dir.join("memory.oom.group"), "1")? {
                    self.degrade(
                        limits,
                        "memory: an OOM kill ends only its victim, not the sandbox (memory.oom.group is missing)"
                            .into(),
                    )?;
                }
            } else {
                write(&dir.join("memory.limit_in_bytes"), &bytes.to_string())?;
                match oom_eventfd(&dir) {
                    Ok(event) => self.oom_event = Some(event),
                    Err(e) => self.degrade(
                        limits,
                        format!(
                            "memory: an OOM kill ends only its victim, not the sandbox (cgroup.event_control: {e})"
                        ),
                    )?,
                }
                if !write_optional(&dir.join("memory.memsw.limit_in_bytes"), &bytes.to_string())? && swap_active() {
                    self.degrade(limits, "memory: swap is active but memory.memsw is missing (swapaccount=0)".into())?;
                }
                // v1 charges TCP socket buffers to a memory cgroup only once its own TCP limit
                // is set (v2 charges them to memory.current by default): without it, sockets
                // inside the sandbox's network namespace could hold far more kernel memory
                // than the limit (54 loopback connections held 588 MB under 128 MB).
                let tcp = dir.join("memory.kmem.tcp.limit_in_bytes");
                match write_raw(&tcp, &bytes.to_string()) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => self.degrade(
                        limits,
                        "memory: TCP socket buffers are not limited (memory.kmem.tcp.limit_in_bytes is missing)".into(),
                    )?,
                    Err(e) => self.degrade(
                        limits,
                        format!("memory: TCP socket buffers are not limited (writing {}: {e})", tcp.display()),
                    )?,
                }
            }
            self.report.memory = true;
        }
        if limits.cpu_percent.is_some() && self.dir(Controller::Cpu).is_some() {
            // Written by `apply_cpu_limit` when the payload is about to start.
            self.cpu_pending = limits.cpu_percent.map(|p| (p, limits.cpu_period_us));
        }
        if let (Some(n), Some(dir)) = (limits.pids, self.dir(Controller::Pids).cloned()) {
            write(&dir.join("pids.max"), &(n.saturating_add(HELPER_TASKS)).to_string())?;
            self.report.pids = true;
        }
        Ok(())
    }

    fn v2_for(&self, c: Controller) -> bool {
        matches!(self.layout.place(c), Place::V2(_))
    }

    /// The control-file writes that apply the CPU quota (empty when none was requested or
    /// the controller is missing). The parent makes them before any process joins the
    /// cgroup, or — a deferred quota — when the payload's trusted start-up is over (see
    /// `parent::CpuLimiter`); memory and pids limits are in force from creation.
    pub fn cpu_writes(&self) -> Vec<(PathBuf, String)> {
        let (Some((pct, period)), Some(dir)) = (self.cpu_pending, self.dir(Controller::Cpu)) else {
            return Vec::new();
        };
        let period_us = period.unwrap_or(DEFAULT_CPU_PERIOD_US);
        let quota = (u64::from(pct) * period_us / 100).max(1000);
        if self.v2_for(Controller::Cpu) {
            vec![(dir.join("cpu.max"), format!("{quota} {period_us}"))]
        } else {
            let mut writes = Vec::with_capacity(2);
            // A fresh v1 cgroup already has the default period: one write fewer.
            if period_us != DEFAULT_CPU_PERIOD_US {
                writes.push((dir.join("cpu.cfs_period_us"), period_us.to_string()));
            }
            writes.push((dir.join("cpu.cfs_quota_us"), quota.to_string()));
            writes
        }
    }

    /// Record that the CPU quota is in force.
    pub(crate) fn mark_cpu_enforced(&mut self) {
        self.report.cpu = true;
    }

    /// Write one control file (for `parent::CpuLimiter`).
    pub(crate) fn write_control(path: &Path, value: &str) -> Result<(), CgroupError> {
        write(path, value)
    }

    /// Files the sandbox's monitor writes `0` to, joining every sandbox cgroup itself.
    ///
    /// On v1 this is each hierarchy's `tasks` file: a single-threaded process moving itself
    /// that way skips the global `cgroup_threadgroup_rwsem` write lock, whose RCU grace
    /// period otherwise costs ~10 ms per sandbox. On v2 (threads cannot cross domains) it
    /// is `cgroup.procs`.
    pub fn join_files(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = Vec::new();
        for (i, dir) in self.dirs.iter().enumerate() {
            let Some(dir) = dir else { continue };
            let file = if matches!(self.layout.places[i], Place::V2(_)) {
                dir.join("cgroup.procs")
            } else {
                dir.join("tasks")
            };
            if !files.contains(&file) {
                files.push(file);
            }
        }
        files
    }

    /// The sandbox's cgroup directories, each once.
    pub fn dirs(&self) -> Vec<&Path> {
        let mut dirs: Vec<&Path> = Vec::new();
        for dir in self.dirs.iter().flatten() {
            if !dirs.contains(&dir.as_path()) {
                dirs.push(dir);
            }
        }
        dirs
    }

    pub fn report(&self) -> &CgroupReport {
        &self.report
    }

    /// The v1 OOM notification: readable once the sandbox's memory cgroup has run out of
    /// memory. `None` on v2 (the kernel kills the whole sandbox itself) and without a
    /// memory limit.
    pub fn oom_event(&self) -> Option<&nix::sys::eventfd::EventFd> {
        self.oom_event.as_ref()
    }

    /// A reader of the OOM kills in the sandbox's memory cgroup, usable from any thread
    /// while the sandbox lives; `None` without a memory cgroup.
    pub fn oom_counter(&self) -> Option<OomCounter> {
        let dir = self.dir(Controller::Memory)?;
        let file = if self.v2_for(Controller::Memory) { "memory.events" } else { "memory.oom_control" };
        Some(OomCounter { file: dir.join(file) })
    }

    /// Read the accounting files. Missing files leave the figure at its default.
    pub fn usage(&self) -> CgroupUsage {
        let mut u = CgroupUsage::default();
        if let Some(dir) = self.dir(Controller::Memory) {
            if self.v2_for(Controller::Memory) {
                u.peak_memory_bytes = read_u64(&dir.join("memory.peak"));
                let events = read_small(&dir.join("memory.events"));
                u.oom_kills = events.as_deref().and_then(|e| keyed(e, "oom_kill")).unwrap_or(0);
                if u.oom_kills > 0 {
                    // `oom` counts the times this cgroup's own limit (or a descendant's: it
                    // has none) left an allocation to fail; an ancestor's goes to the
                    // ancestor's file, the victim's `oom_kill` wherever it was.
                    u.memory_limit_reached = events.as_deref().and_then(|e| keyed(e, "oom")).map(|n| n > 0);
                }
            } else {
                u.peak_memory_bytes = read_u64(&dir.join("memory.max_usage_in_bytes"));
                u.oom_kills = read_keyed(&dir.join("memory.oom_control"), "oom_kill").unwrap_or(0);
                if u.oom_kills > 0 {
                    // v1 has no such count (`memory.failcnt` stays 0 on 6.18 even when the
                    // limit OOM-kills): a charge fails only with usage within its own size
                    // (at most a huge page) of the limit, and that usage was a high-water
                    // mark. Swap's counter likewise.
                    let slack = v1_oom_slack();
                    let near = |usage: &str, limit: &str| match (read_u64(&dir.join(usage)), read_u64(&dir.join(limit)))
                    {
                        (Some(peak), Some(limit)) => Some(peak.saturating_add(slack) >= limit),
                        _ => None,
                    };
                    u.memory_limit_reached = match (
                        near("memory.max_usage_in_bytes", "memory.limit_in_bytes"),
                        near("memory.memsw.max_usage_in_bytes", "memory.memsw.limit_in_bytes"),
                    ) {
                        (Some(true), _) | (_, Some(true)) => Some(true),
                        (Some(false), Some(false) | None) => Some(false),
                        (None, _) => None,
                    };
                }
            }
        }
        if let Some(dir) = self.dir(Controller::Pids) {
            u.pids_limit_hits = read_keyed(&dir.join("pids.events"), "max").unwrap_or(0);
        }
        if let Some(stat) = self.dir(Controller::Cpu).and_then(|d| read_small(&d.join("cpu.stat"))) {
            u.cpu_throttled_periods = keyed(&stat, "nr_throttled").unwrap_or(0);
            u.cpu_throttled_ms = if self.v2_for(Controller::Cpu) {
                u.cpu_ms = keyed(&stat, "usage_usec").map(|us| us / 1000);
                keyed(&stat, "throttled_usec").unwrap_or(0) / 1000
            } else {
                keyed(&stat, "throttled_time").unwrap_or(0) / 1_000_000
            };
        }
        u
    }

    /// SIGKILL everything still in the sandbox cgroups.
    pub fn kill_all(&self) {
        for dir in self.dirs.iter().flatten() {
            if self.v2 && self.has_cgroup_kill && write_raw(&dir.join("cgroup.kill"), "1").is_ok() {
                continue;
            }
            kill_sweep(dir);
        }
    }

    /// Kill what is left, wait for the cgroups to empty, and remove them.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.remove_inner()
    }

    /// Kill what is left and remove the cgroups that are empty already; the others are
    /// left behind, to be tried again at later creates, without waiting for them (their
    /// processes are known not to exit yet: stuck in the kernel).
    pub fn leave_behind(mut self) {
        self.removed = true;
        for dir in self.dirs.iter().flatten() {
            if self.v2 && self.has_cgroup_kill {
                let _ = write_raw(&dir.join("cgroup.kill"), "1");
            }
            match fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::error!(cgroup = %dir.display(), error = %e, "sandbox cgroup left behind");
                    remember_left_behind(dir.clone(), self.hold.clone());
                }
            }
        }
    }

    fn remove_inner(&mut self) -> Result<(), CgroupError> {
        if self.removed {
            return Ok(());
        }
        self.removed = true;
        let mut first_err = None;
        let dirs: Vec<PathBuf> = {
            let mut v: Vec<PathBuf> = Vec::new();
            for d in self.dirs.iter().flatten() {
                if !v.contains(d) {
                    v.push(d.clone());
                }
            }
            v
        };
        // One patience for all hierarchies (a process that cannot exit keeps every one of
        // them busy), and one sweep.
        let mut deadline: Option<Instant> = None;
        for dir in &dirs {
            // Normally empty by now: try at once, and sweep only if something is left.
            match fs::remove_dir(dir) {
                Ok(()) => continue,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(_) => {}
            }
            let until = *deadline.get_or_insert_with(|| {
                self.kill_all();
                Instant::now() + REMOVE_PATIENCE
            });
            if let Err(e) = remove_when_empty(dir, until.saturating_duration_since(Instant::now())) {
                remember_left_behind(dir.clone(), self.hold.clone());
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for SandboxCgroup {
    fn drop(&mut self) {
        if let Err(e) = self.remove_inner() {
            tracing::error!(error = %e, "sandbox cgroup left behind");
        }
    }
}

fn kill_sweep(dir: &Path) {
    kill_sweep_all(&[dir.to_path_buf()]);
}

/// SIGKILL every process listed in the cgroups `dirs`, again and again (what forked meanwhile
/// too) until none lists one or 200 rounds of 2 ms have passed — for all of them together.
fn kill_sweep_all(dirs: &[PathBuf]) {
    for _ in 0..200 {
        let mut any = false;
        for dir in dirs {
            let listed = || listed_pids(&dir.join("cgroup.procs"));
            let Some(pids) = listed() else { continue };
            if pids.is_empty() {
                continue;
            }
            any = true;
            // A pidfd names the process that has the pid when it is opened; the pids still
            // listed afterwards are therefore those processes (a pid cannot be reused while
            // its process lives), and only they are signalled — never a process that took
            // over the number of one that exited in between.
            let opened: Vec<(i32, std::os::fd::OwnedFd)> = pids
                .into_iter()
                .filter_map(|pid| crate::zygote::pidfd_open(nix::unistd::Pid::from_raw(pid)).ok().map(|fd| (pid, fd)))
                .collect();
            let Some(still) = listed() else { continue };
            for (pid, fd) in &opened {
                if still.contains(pid) {
                    crate::zygote::pidfd_signal(fd, nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
        if !any {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The pids a `cgroup.procs` file lists: all of it (hundreds of pids do not fit a page),
/// and only lines that end — a line cut short would parse as another process's pid, which
/// the sweep would then kill.
fn listed_pids(path: &Path) -> Option<Vec<i32>> {
    let text = fs::read_to_string(path).ok()?;
    Some(text.split_inclusive('\n').filter(|l| l.ends_with('\n')).filter_map(|l| l.trim().parse().ok()).collect())
}

fn remove_when_empty(dir: &Path, patience: Duration) -> Result<(), CgroupError> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(200);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) if start.elapsed() < patience && e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(e) => return Err(CgroupError::Io { action: "remove", path: dir.display().to_string(), source: e }),
        }
    }
}

/// Write a control file (cgroupfs files exist or not; no create, no truncate, no stat).
fn write_raw(path: &Path, value: &str) -> std::io::Result<()> {
    use std::io::Write;
    fs::OpenOptions::new().write(true).open(path)?.write_all(value.as_bytes())
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    write_raw(path, value).map_err(|e| CgroupError::Io {
        action: "write",
        path: format!("{} ({value})", path.display()),
        source: e,
    })
}

/// Write when the file exists; `Ok(false)` when it does not.
fn write_optional(path: &Path, value: &str) -> Result<bool, CgroupError> {
    match write_raw(path, value) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(CgroupError::Io { action: "write", path: format!("{} ({value})", path.display()), source: e }),
    }
}

/// Read a small control file into a fixed buffer (no stat, one read).
fn read_small(path: &Path) -> Option<String> {
    let mut f = fs::File::open(path).ok()?;
    let mut buf = [0u8; 4096];
    let mut len = 0;
    loop {
        match f.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => {
                len += n;
                if len == buf.len() {
                    break;
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return None,
        }
    }
    String::from_utf8(buf[..len].to_vec()).ok()
}

fn read_u64(path: &Path) -> Option<u64> {
    read_small(path)?.trim().parse().ok()
}

/// Value of `key N` in a flat-keyed cgroup file.
/// How many processes the kernel's OOM killer has killed in one sandbox (its memory
/// cgroup's `oom_kill`: v2 `memory.events`, v1 `memory.oom_control`).
#[derive(Debug, Clone)]
pub struct OomCounter {
    file: PathBuf,
}

impl OomCounter {
    /// The count so far; `None` when the file cannot be read (the cgroup is gone).
    pub fn kills(&self) -> Option<u64> {
        read_keyed(&self.file, "oom_kill")
    }
}

fn read_keyed(path: &Path, key: &str) -> Option<u64> {
    keyed(&read_small(path)?, key)
}

fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Where one controller comes from, for `doctor`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ControllerProbe {
    /// `v1`, `v2`, or `None` when unusable.
    pub version: Option<&'static str>,
    /// The cgroup under which sandbox cgroups would be created, or why none can be.
    pub detail: String,
}

/// What the host offers, for `doctor`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CgroupProbe {
    pub memory: ControllerProbe,
    pub cpu: ControllerProbe,
    pub pids: ControllerProbe,
    pub cgroup_kill: bool,
}

/// Discover (and on v2 prepare) the cgroup layout now. Sandbox creation does this on first
/// use; calling it before any sandbox process exists keeps this process's own cgroup free
/// of children when it moves into its leaf.
pub fn prepare() {
    let _ = layout();
}

/// Describe where each controller would come from, without changing anything.
pub fn probe() -> CgroupProbe {
    let owned;
    let l = match LAYOUT.get() {
        Some(l) => l,
        None => {
            owned = discover(false);
            &owned
        }
    };
    let describe = |c: Controller| match l.place(c) {
        Place::V1(d) => ControllerProbe { version: Some("v1"), detail: d.display().to_string() },
        Place::V2(d) => ControllerProbe { version: Some("v2"), detail: d.display().to_string() },
        Place::Missing(r) => ControllerProbe { version: None, detail: r.clone() },
    };
    CgroupProbe {
        memory: describe(Controller::Memory),
        cpu: describe(Controller::Cpu),
        pids: describe(Controller::Pids),
        cgroup_kill: l.has_cgroup_kill,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_kill_sweep_reads_whole_lines_of_the_whole_list() {
        // A list longer than a page whose 4096th byte ends inside a line: the cut line's
        // first digits are a live process's pid (a `sleep`), the whole line is no pid at all
        // (above any pid_max). The sweep must not take the fragment for a pid.
        let mut victim = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = victim.id().to_string();
        let dir = std::env::temp_dir().join(format!("opservant-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut list = String::new();
        while list.len() + 8 + pid.len() <= 4096 {
            list.push_str("9999999\n");
        }
        let pad = 4096 - pid.len() - list.len();
        if pad > 0 {
            // `pad` bytes: its digits and a newline (an empty line when 1).
            list.push_str(&format!("{}\n", "9".repeat(pad - 1)));
        }
        assert_eq!(list.len() + pid.len(), 4096, "the live pid's digits end at byte 4096");
        list.push_str(&format!("{pid}999\n8888888\n"));
        std::fs::write(dir.join("cgroup.procs"), &list).unwrap();
        super::kill_sweep(&dir);
        assert!(victim.try_wait().unwrap().is_none(), "a process outside the cgroup was killed");
        assert_eq!(
            super::listed_pids(&dir.join("cgroup.procs")).unwrap().last(),
            Some(&8888888),
            "the whole list is read"
        );
        // A last line without its newline is not taken either.
        std::fs::write(dir.join("cgroup.procs"), format!("9999999\n{pid}")).unwrap();
        assert_eq!(super::listed_pids(&dir.join("cgroup.procs")).unwrap(), vec![9999999]);
        victim.kill().unwrap();
        victim.wait().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    use super::*;

    #[test]
    fn stat_fields_count_from_the_commands_closing_parenthesis() {
        let stat = "4242 (a b) c)) S 17 4242 4242 0 -1 4194560 1 2 3 4 5 6 7 8 20 0 1 0 987654 1 2";
        assert_eq!(stat_field(stat, 3), Some("S"));
        assert_eq!(stat_field(stat, 4), Some("17"));
        assert_eq!(stat_field(stat, 22), Some("987654"));
        assert_eq!(stat_field(stat, 2), None);
        assert_eq!(stat_field("no parenthesis", 4), None);
        let me = std::process::id();
        assert!(start_time(me).is_some_and(|t| t > 0), "this process has a start time");
    }

    /// A v1-style layout over plain directories: memory and pids "hierarchies" exist, cpu is
    /// missing. Plain directories have no control files, so writing a limit fails.
    fn fake_layout(root: &Path) -> &'static Layout {
        let (mem, pids) = (root.join("memory"), root.join("pids"));
        fs::create_dir_all(&mem).unwrap();
        fs::create_dir_all(&pids).unwrap();
        Box::leak(Box::new(Layout {
            places: [Place::V1(mem), Place::Missing("no cpu controller (test)".into()), Place::V1(pids)],
            has_cgroup_kill: false,
        }))
    }

    fn scratch_root(tag: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("opservant-cgtest-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        root
    }

    #[test]
    fn cpu_quota_writes_follow_the_requested_window() {
        let root = scratch_root("cpuwin");
        let (mem, cpu, pids) = (root.join("memory"), root.join("cpu"), root.join("pids"));
        for d in [&mem, &cpu, &pids] {
            fs::create_dir_all(d).unwrap();
        }
        let layout: &'static Layout = Box::leak(Box::new(Layout {
            places: [Place::V1(mem), Place::V1(cpu), Place::V1(pids)],
            has_cgroup_kill: false,
        }));
        let names = |cg: &SandboxCgroup| -> Vec<(String, String)> {
            cg.cpu_writes()
                .into_iter()
                .map(|(p, v)| (p.file_name().unwrap().to_string_lossy().into_owned(), v))
                .collect()
        };
        // The kernel's default window: only the quota is written (10 % of 100 ms).
        let cg = SandboxCgroup::create_in(layout, &Limits { cpu_percent: Some(10), ..Limits::default() }).unwrap();
        assert_eq!(names(&cg), [("cpu.cfs_quota_us".to_string(), "10000".to_string())]);
        cg.remove().unwrap();
        // A 500 ms window: the period, then 10 % of it.
        let limits = Limits { cpu_percent: Some(10), cpu_period_us: Some(500_000), ..Limits::default() };
        let cg = SandboxCgroup::create_in(layout, &limits).unwrap();
        assert_eq!(
            names(&cg),
            [
                ("cpu.cfs_period_us".to_string(), "500000".to_string()),
                ("cpu.cfs_quota_us".to_string(), "50000".to_string())
            ]
        );
        cg.remove().unwrap();
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_missing_controller_is_an_error_unless_degraded_mode_is_allowed() {
        let root = scratch_root("degrade");
        let layout = fake_layout(&root);
        let limits = Limits { cpu_percent: Some(10), ..Limits::default() };
        let err = SandboxCgroup::create_in(layout, &limits).expect_err("fail closed");
        assert!(err.to_string().contains("cpu limit not enforced: no cpu controller (test)"), "{err}");
        assert_eq!(fs::read_dir(root.join("memory")).unwrap().count(), 0, "nothing left behind");

        let degraded = Limits { allow_degraded: true, ..limits };
        let cg = SandboxCgroup::create_in(layout, &degraded).expect("degraded mode runs");
        let r = cg.report().clone();
        assert!(!r.cpu, "the CPU limit is not reported as enforced");
        assert_eq!(r.degraded.len(), 1);
        assert!(r.degraded[0].starts_with("cpu limit not enforced"));
        assert_eq!(r.version, "v1");
        cg.remove().unwrap();
        assert_eq!(fs::read_dir(root.join("memory")).unwrap().count(), 0);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_limit_that_cannot_be_written_is_an_error_and_cleans_up() {
        let root = scratch_root("write");
        let layout = fake_layout(&root);
        // memory.limit_in_bytes does not exist in a plain directory: the write fails.
        let limits = Limits { memory_bytes: Some(1 << 20), allow_degraded: true, ..Limits::default() };
        let err = SandboxCgroup::create_in(layout, &limits).expect_err("a failed write is never degraded");
        assert!(err.to_string().contains("memory.limit_in_bytes"), "{err}");
        assert_eq!(fs::read_dir(root.join("memory")).unwrap().count(), 0, "created cgroups removed again");
        assert_eq!(fs::read_dir(root.join("pids")).unwrap().count(), 0);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn dir_in_mount_respects_root() {
        let m = CgroupMount {
            root: "/a".into(),
            mount_point: "/sys/fs/cgroup".into(),
            fstype: "cgroup2".into(),
            super_opts: vec![],
        };
        assert_eq!(dir_in_mount(&m, "/a/b"), Some(PathBuf::from("/sys/fs/cgroup/b")));
        assert_eq!(dir_in_mount(&m, "/c"), None);
    }

    #[test]
    fn descendants() {
        let me = std::process::id();
        assert!(descends_from(me, me));
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        assert_eq!(parent_pid(child.id()), Some(me));
        assert!(descends_from(child.id(), me));
        assert!(!descends_from(me, child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!descends_from(u32::MAX, me));
    }

    #[test]
    fn keyed_files() {
        let dir = std::env::temp_dir().join(format!("opservant-keyed-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let f = dir.join("events");
        fs::write(&f, "low 0\nhigh 3\noom_kill 2\n").unwrap();
        assert_eq!(read_keyed(&f, "oom_kill"), Some(2));
        assert_eq!(read_keyed(&f, "oom"), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
