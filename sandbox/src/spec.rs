//! The sandbox specification: everything the isolation engine needs to build one sandbox.
//!
//! A [`SandboxSpec`] is plain data (serde) so it can cross the channel to the freshly exec'd
//! init process, be logged, and be produced by any policy layer. [`SandboxSpec::validate`]
//! rejects specs the engine cannot honour *before* any process is started; every error names
//! the offending field.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::SpecError;

/// Where the scratch directory lives inside every sandbox.
pub const SCRATCH_DIR: &str = "/tmp/opservant/scratch";

/// Paths hidden from every sandbox unless a rule re-declares them (files are replaced by an
/// inaccessible file, directories by an inaccessible empty directory). Only paths that the
/// read-only system view could otherwise expose need to be listed; everything outside the
/// view is already absent.
///
/// The `/proc` and `/sys` entries (which no rule can re-declare: the sandbox provides those
/// trees itself) are the host-wide ones container runtimes mask too — hardware and kernel
/// state a sandbox has no use for: interrupt and softirq counts per CPU (a side channel
/// on other processes' activity), the kernel's keyrings, timers and scheduler debugging,
/// ACPI, sound and SCSI devices, firmware tables and power-capping energy counters (the
/// RAPL side channel). Those the running kernel does not have are skipped.
pub const DEFAULT_MASKED_PATHS: &[&str] = &[
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/security/opasswd",
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/key-users",
    "/proc/latency_stats",
    "/proc/locks",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/softirqs",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// System directories shown read-only (and granted read/execute by Landlock) by default.
/// Missing ones are skipped. On merged-/usr systems `/bin` etc. are symlinks and are
/// recreated as symlinks.
pub const DEFAULT_SYSTEM_PATHS: &[&str] = &["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"];

/// Complete description of one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// What runs inside.
    pub command: CommandSpec,
    /// Which namespaces are created.
    #[serde(default)]
    pub namespaces: Namespaces,
    /// The unprivileged identity the payload runs as.
    pub identity: Identity,
    /// Run as a host uid of this range, one no other sandbox holds while this one lives,
    /// instead of `identity.host_uid` (see [`crate::host_uid`]). `None`: every sandbox of
    /// the identity shares its host uid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_uids: Option<HostUids>,
    /// The filesystem view.
    #[serde(default)]
    pub filesystem: Filesystem,
    /// Landlock policy.
    #[serde(default)]
    pub landlock: LandlockPolicy,
    /// Seccomp filters, already compiled to BPF (see [`crate::seccomp`]).
    pub seccomp: SeccompPolicy,
    /// Resource limits.
    #[serde(default)]
    pub limits: Limits,
    /// Hostname inside the UTS namespace.
    #[serde(default = "default_hostname")]
    pub hostname: String,
}

fn default_hostname() -> String {
    "opservant".to_string()
}

/// The payload program.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CommandSpec {
    /// Program to execute: an absolute path, or a bare name looked up in the payload's `PATH`.
    pub program: String,
    /// Arguments after `argv[0]`.
    #[serde(default)]
    pub args: Vec<String>,
    /// The payload's complete environment. Nothing is inherited from the caller.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Working directory inside the sandbox.
    #[serde(default = "default_cwd")]
    pub cwd: PathBuf,
    /// Give the program an *application channel*: a socketpair to the caller, inherited as
    /// fd 4 ([`crate::channel::APP_FD`]), whose protocol is the caller's (see
    /// [`crate::Sandbox::take_app_channel`]). The sandbox's own control channel is never
    /// inherited.
    #[serde(default)]
    pub app_channel: bool,
    /// Start *held*: the payload, with every restriction in place (its `started` report
    /// sent), waits for [`crate::Sandbox::start_pooled`]'s go — one message on a hold
    /// channel at fd 4 — before it `execve`s (or returns, [`crate::PayloadEnd::Return`]).
    /// How a warm pool starts a program's sandbox ahead of its work. The hold channel is the
    /// application channel when the spec asks for one, and is closed before `execve`
    /// otherwise. A payload whose caller goes away without the go exits without running
    /// anything.
    #[serde(default)]
    pub held: bool,
}

impl CommandSpec {
    /// Whether the sandbox processes get fd 4 ([`crate::channel::APP_FD`]): as the
    /// application channel, or as a held payload's hold channel.
    pub fn uses_app_fd(&self) -> bool {
        self.app_channel || self.held
    }
}

fn default_cwd() -> PathBuf {
    PathBuf::from(SCRATCH_DIR)
}

/// Namespace selection. User, mount and PID namespaces are mandatory: the filesystem view,
/// the unprivileged identity and whole-tree teardown are built on them.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Namespaces {
    pub user: bool,
    pub mount: bool,
    pub pid: bool,
    pub net: bool,
    pub ipc: bool,
    pub uts: bool,
    pub cgroup: bool,
}

impl Default for Namespaces {
    fn default() -> Self {
        Self { user: true, mount: true, pid: true, net: true, ipc: true, uts: true, cgroup: true }
    }
}

impl Namespaces {
    /// Names of the enabled namespaces, in the order they are reported.
    pub fn enabled(&self) -> Vec<&'static str> {
        let all = [
            (self.user, "user"),
            (self.mount, "mount"),
            (self.pid, "pid"),
            (self.net, "net"),
            (self.ipc, "ipc"),
            (self.uts, "uts"),
            (self.cgroup, "cgroup"),
        ];
        all.iter().filter(|(on, _)| *on).map(|(_, n)| *n).collect()
    }
}

/// Identity: a single-id map from `inside_uid`/`inside_gid` to an unprivileged host id.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    pub host_uid: u32,
    pub host_gid: u32,
    pub inside_uid: u32,
    pub inside_gid: u32,
}

/// A range of host uids that sandboxes run as, one per sandbox alive at a time, and the
/// lock file through which every process starting sandboxes on the host shares it out
/// ([`crate::host_uid`]). No account may use these uids; they are leased by byte-range
/// locks at their own offsets in `lock`, so ranges of several configurations that overlap
/// still never hand one uid out twice.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HostUids {
    pub first: u32,
    pub count: u32,
    pub lock: PathBuf,
}

impl HostUids {
    /// The last uid of the range (`count` ≥ 1 and no overflow, as [`SandboxSpec::validate`]
    /// checks).
    pub fn last(&self) -> u32 {
        self.first.saturating_add(self.count.saturating_sub(1))
    }

    /// Why `first` and `count` are not a range of host uids (at least one, none of them root
    /// or -1); `None` when they are. The one check of a range, wherever it comes from.
    pub fn bounds_error(first: u32, count: u32) -> Option<String> {
        (count == 0 || first == 0 || u64::from(first) + u64::from(count) > u64::from(u32::MAX)).then(|| {
            format!("first {first} count {count}: a range of at least one uid within 1-4294967294 (not root, not -1)")
        })
    }

    fn validate(&self, identity: &Identity) -> Result<(), SpecError> {
        if let Some(e) = Self::bounds_error(self.first, self.count) {
            return Err(SpecError::new("host_uids", e));
        }
        if (self.first..=self.last()).contains(&identity.host_uid) {
            return Err(SpecError::new(
                "host_uids",
                format!(
                    "{}-{} holds the identity's own host uid {}: the range must be uids no account uses",
                    self.first,
                    self.last(),
                    identity.host_uid
                ),
            ));
        }
        check_abs("host_uids.lock", &self.lock)
    }
}

impl Identity {
    /// Map `host_uid:host_gid` to the same numbers inside.
    pub fn same_inside(host_uid: u32, host_gid: u32) -> Self {
        Self { host_uid, host_gid, inside_uid: host_uid, inside_gid: host_gid }
    }

    /// The default executor identity: the local user `opservant-executor` if it exists,
    /// otherwise `nobody`.
    pub fn default_executor() -> Result<Self, SpecError> {
        let passwd = std::fs::read_to_string("/etc/passwd")
            .map_err(|e| SpecError::new("identity", format!("cannot read /etc/passwd: {e}")))?;
        for name in ["opservant-executor", "nobody"] {
            if let Some((uid, gid)) = local_user(&passwd, name) {
                return Ok(Self::same_inside(uid, gid));
            }
        }
        Err(SpecError::new("identity", "neither user 'opservant-executor' nor 'nobody' exists in /etc/passwd"))
    }

    /// Look `name` up in the local `/etc/passwd` (not NSS: the identity untrusted code runs
    /// as must not be redirectable by a directory service, and NSS misses cost ~0.5 ms).
    pub fn local(name: &str) -> Result<Self, SpecError> {
        let passwd = std::fs::read_to_string("/etc/passwd")
            .map_err(|e| SpecError::new("identity", format!("cannot read /etc/passwd: {e}")))?;
        local_user(&passwd, name)
            .map(|(u, g)| Self::same_inside(u, g))
            .ok_or_else(|| SpecError::new("identity", format!("no local user '{name}' in /etc/passwd")))
    }
}

/// `(uid, gid)` of `name` in passwd(5)-formatted text.
fn local_user(passwd: &str, name: &str) -> Option<(u32, u32)> {
    passwd.lines().find_map(|line| {
        let mut f = line.split(':');
        if f.next()? != name {
            return None;
        }
        let _password = f.next()?;
        Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
    })
}

/// Access granted to a declared path.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    /// Read and execute.
    Read,
    /// Read, execute, create, write, remove.
    ReadWrite,
}

/// A declared path.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PathRule {
    pub path: PathBuf,
    pub access: Access,
    /// Skip the rule when the path does not exist on the host (used for defaults such as
    /// `/lib32`). Declared paths are not optional: a missing one is an error.
    #[serde(default)]
    pub optional: bool,
    /// The host path to bind at `path`, exactly: bound only when no component of it is a
    /// symlink (`RESOLVE_NO_SYMLINKS`), so that what a caller checked — a manifest's
    /// declaration, resolved and checked by the agent — is what is bound; one swapped in
    /// later fails the build. `None`: `path` itself, symlinks followed inside the host root.
    #[serde(default)]
    pub source: Option<PathBuf>,
    /// The file the caller checked, by identity: the host path is bound only when what it
    /// opens is that file (device and inode), so one replaced since the caller looked at it —
    /// an executor's package removed and installed again at the same version, its manifest
    /// read from the old one — fails the build instead of showing other files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<FileId>,
}

/// A file's identity on the host: its device and inode numbers (`stat`'s `st_dev`,
/// `st_ino`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl FileId {
    /// The identity of an open file.
    pub fn of(meta: &std::fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        FileId { dev: meta.dev(), ino: meta.ino() }
    }
}

/// A file whose content is supplied by the caller (e.g. `/etc/hosts`), shown read-only.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SyntheticFile {
    pub path: PathBuf,
    pub content: String,
}

/// The filesystem view: a read-only tmpfs root holding only `system` paths and declared
/// `paths`, a fresh read-only `/proc`, a minimal `/dev`, a size-limited scratch tmpfs on `/tmp`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Filesystem {
    /// System directories shown read-only with read/execute rights.
    pub system: Vec<PathRule>,
    /// Declared paths (read-only or read-write bind mounts).
    pub paths: Vec<PathRule>,
    /// Paths replaced by inaccessible placeholders unless re-declared in `paths`.
    pub masked: Vec<PathBuf>,
    /// Caller-supplied read-only files.
    #[serde(default)]
    pub synthetic: Vec<SyntheticFile>,
    /// Size of the scratch tmpfs mounted on `/tmp`, which `/dev/shm` is a directory of: the
    /// limit of both together.
    pub scratch_bytes: u64,
    /// Mount a fresh read-only sysfs on `/sys` (needs the network namespace). Off by
    /// default: it exposes host hardware detail most payloads never read, and costs a mount.
    #[serde(default)]
    pub sysfs: bool,
}

impl Default for Filesystem {
    fn default() -> Self {
        Self {
            system: DEFAULT_SYSTEM_PATHS
                .iter()
                .map(|p| PathRule {
                    source: None,
                    path: PathBuf::from(p),
                    access: Access::Read,
                    optional: true,
                    identity: None,
                })
                .collect(),
            paths: Vec::new(),
            masked: DEFAULT_MASKED_PATHS.iter().map(PathBuf::from).collect(),
            synthetic: Vec::new(),
            scratch_bytes: 100 * 1024 * 1024,
            sysfs: false,
        }
    }
}

/// Landlock policy. Rules mirror the filesystem view; this only says how strict to be.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LandlockPolicy {
    /// Refuse to start when the kernel's Landlock ABI is below this (0 = Landlock optional;
    /// its absence is then reported as `not_enforced`).
    pub min_abi: u32,
}

impl Default for LandlockPolicy {
    fn default() -> Self {
        Self { min_abi: 1 }
    }
}

/// Seccomp policy: BPF programs installed in order just before `execve`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum SeccompPolicy {
    /// No filter. Reported as `disabled`; never chosen implicitly.
    Disabled,
    /// Compiled filters (see [`crate::seccomp::CompiledProfile`]).
    Enforced {
        /// Profile name, for the report.
        profile: String,
        /// Each filter as raw `sock_filter` instructions packed into `u64`.
        filters: Vec<Vec<u64>>,
    },
}

/// Resource limits. `None` means "no limit requested".
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    /// Percent of one CPU (1–100 per CPU; values above 100 allow several CPUs).
    pub cpu_percent: Option<u32>,
    /// Apply the CPU quota when the caller says the payload's trusted start-up is over
    /// ([`crate::parent::CpuLimiter`]), at the latest [`crate::parent::CPU_DEFER_MAX`] after
    /// the payload started, instead of when the cgroup is made (before any process joins it).
    #[serde(default)]
    pub cpu_deferred: bool,
    /// The window (CFS period, µs) over which `cpu_percent` is enforced; `None`: the
    /// kernel's 100 ms. A longer window keeps the same average rate but lets a short burst —
    /// an interpreter importing a module, a session call — finish within one window's quota
    /// instead of stalling until the next window for a few milliseconds over it.
    #[serde(default)]
    pub cpu_period_us: Option<u64>,
    /// Tasks the payload may run (the sandbox init, PID 1 inside, is added on top).
    pub pids: Option<u32>,
    /// Wall-clock limit, from spawn.
    pub timeout_ms: Option<u64>,
    /// The longest setup may take, from spawn to the payload's start report; `None`:
    /// [`crate::parent::SETUP_LIMIT`]. Past it the run fails and everything is killed.
    #[serde(default)]
    pub setup_timeout_ms: Option<u64>,
    /// Time between SIGTERM and SIGKILL when the timeout fires.
    pub kill_grace_ms: u64,
    /// `RLIMIT_NOFILE` for the payload.
    pub nofile: u64,
    /// `RLIMIT_SIGPENDING` for the payload: signals queued by the sandbox's uid. The
    /// sandbox's user namespace is created by root, so the kernel charges them to root's
    /// host-wide pending-signal count as well; this bounds what one sandbox can take.
    #[serde(default = "default_sigpending")]
    pub sigpending: u64,
    /// `max_inotify_instances` of the sandbox's user namespace (written by its init before
    /// it drops its capabilities): inotify instances are charged to the namespace's owner
    /// too — the leased host uid with `host_uids`, else host root, whose host-wide
    /// `fs.inotify.max_user_instances` (128) one sandbox could otherwise take whole.
    #[serde(default = "default_inotify_instances")]
    pub inotify_instances: u32,
    /// `max_inotify_watches` of the sandbox's user namespace (as above).
    #[serde(default = "default_inotify_watches")]
    pub inotify_watches: u32,
    /// Accept missing cgroup controllers and report them instead of failing.
    pub allow_degraded: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_bytes: None,
            cpu_percent: None,
            cpu_period_us: None,
            cpu_deferred: false,
            pids: None,
            timeout_ms: None,
            setup_timeout_ms: None,
            kill_grace_ms: 2000,
            nofile: 1024,
            sigpending: default_sigpending(),
            inotify_instances: default_inotify_instances(),
            inotify_watches: default_inotify_watches(),
            allow_degraded: false,
        }
    }
}

fn default_sigpending() -> u64 {
    1024
}

fn default_inotify_instances() -> u32 {
    16
}

fn default_inotify_watches() -> u32 {
    8192
}

impl SandboxSpec {
    /// A spec with default namespaces, view and limits for `program args…`.
    pub fn new(program: impl Into<String>, args: Vec<String>, identity: Identity) -> Self {
        Self {
            command: CommandSpec {
                program: program.into(),
                args,
                env: vec![
                    ("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()),
                    ("HOME".into(), SCRATCH_DIR.into()),
                    ("TMPDIR".into(), SCRATCH_DIR.into()),
                    ("LANG".into(), "C.UTF-8".into()),
                ],
                cwd: default_cwd(),
                app_channel: false,
                held: false,
            },
            namespaces: Namespaces::default(),
            identity,
            host_uids: None,
            filesystem: Filesystem::default(),
            landlock: LandlockPolicy::default(),
            seccomp: SeccompPolicy::Disabled,
            limits: Limits::default(),
            hostname: default_hostname(),
        }
    }

    /// Whether the sandbox may join a network namespace made beforehand (a
    /// [`crate::netns_stash::NetnsStash`]'s) instead of creating one: it wants a private
    /// network namespace and no fresh sysfs (mounting one needs `CAP_SYS_ADMIN` over the
    /// network namespace's owner, which a prepared namespace's is not).
    pub fn can_join_prepared_net(&self) -> bool {
        self.namespaces.net && !self.filesystem.sysfs
    }

    /// Check everything that can be checked before a process exists.
    pub fn validate(&self) -> Result<(), SpecError> {
        let ns = &self.namespaces;
        for (on, name) in [(ns.user, "user"), (ns.mount, "mount"), (ns.pid, "pid")] {
            if !on {
                return Err(SpecError::new(
                    format!("namespaces.{name}"),
                    "is mandatory (the view, the identity and teardown depend on it)",
                ));
            }
        }
        if self.command.program.is_empty() || self.command.program.contains('\0') {
            return Err(SpecError::new("command.program", "must be a non-empty string without NUL"));
        }
        for (i, a) in self.command.args.iter().enumerate() {
            if a.contains('\0') {
                return Err(SpecError::new(format!("command.args[{i}]"), "contains NUL"));
            }
        }
        for (i, (k, v)) in self.command.env.iter().enumerate() {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(SpecError::new(
                    format!("command.env[{i}]"),
                    "name must be non-empty without '=' or NUL, value without NUL",
                ));
            }
        }
        check_abs("command.cwd", &self.command.cwd)?;

        let id = &self.identity;
        if id.host_uid == 0 || id.host_gid == 0 {
            return Err(SpecError::new("identity", "the payload may not run as host root (uid/gid 0)"));
        }
        if id.inside_uid == 0 || id.inside_gid == 0 {
            return Err(SpecError::new("identity", "the payload must be unprivileged inside too (uid/gid 0)"));
        }
        if id.host_uid == u32::MAX || id.host_gid == u32::MAX {
            return Err(SpecError::new("identity", "uid/gid 4294967295 is not a valid id"));
        }
        if let Some(range) = &self.host_uids {
            range.validate(id)?;
        }

        let fs = &self.filesystem;
        for (i, r) in fs.system.iter().enumerate() {
            check_abs(&format!("filesystem.system[{i}]"), &r.path)?;
            if r.access != Access::Read {
                return Err(SpecError::new(format!("filesystem.system[{i}]"), "system paths are read-only"));
            }
        }
        for (i, r) in fs.paths.iter().enumerate() {
            let field = format!("filesystem.paths[{i}]");
            check_abs(&field, &r.path)?;
            if r.path == Path::new("/") {
                return Err(SpecError::new(field, "'/' cannot be declared; declare the directories you need"));
            }
            for reserved in ["/proc", "/dev", "/sys"] {
                if r.path.starts_with(reserved) {
                    return Err(SpecError::new(field, format!("{reserved} is provided by the sandbox itself")));
                }
            }
        }
        for (i, m) in fs.masked.iter().enumerate() {
            check_abs(&format!("filesystem.masked[{i}]"), m)?;
        }
        for (i, s) in fs.synthetic.iter().enumerate() {
            let field = format!("filesystem.synthetic[{i}]");
            check_abs(&field, &s.path)?;
            if s.path.starts_with("/tmp") || s.path.starts_with("/proc") || s.path.starts_with("/dev") {
                return Err(SpecError::new(field, "must not be under /tmp, /proc or /dev"));
            }
        }
        if fs.scratch_bytes < 1024 * 1024 {
            return Err(SpecError::new("filesystem.scratch_bytes", "must be at least 1 MiB"));
        }

        if self.landlock.min_abi > crate::landlock::MAX_PLAUSIBLE_ABI {
            return Err(SpecError::new("landlock.min_abi", "is not a plausible Landlock ABI"));
        }
        if let SeccompPolicy::Enforced { filters, .. } = &self.seccomp {
            if filters.is_empty() || filters.iter().any(|f| f.is_empty() || f.len() > 4096) {
                return Err(SpecError::new("seccomp.filters", "each filter must hold 1..=4096 instructions"));
            }
        }

        let l = &self.limits;
        if l.memory_bytes == Some(0) {
            return Err(SpecError::new("limits.memory_bytes", "must be positive"));
        }
        if matches!(l.cpu_percent, Some(0)) || l.cpu_percent.is_some_and(|p| p > 100 * 1024) {
            return Err(SpecError::new("limits.cpu_percent", "must be between 1 and 102400"));
        }
        if l.cpu_period_us.is_some_and(|p| !(1_000..=1_000_000).contains(&p)) {
            return Err(SpecError::new("limits.cpu_period_us", "must be between 1000 and 1000000 (1 ms to 1 s)"));
        }
        // The kernel's smallest quota is 1 ms: a smaller share of the window cannot be
        // expressed there, and rounding it up would grant more than was asked.
        if let Some(pct) = l.cpu_percent {
            let period = l.cpu_period_us.unwrap_or(crate::cgroup::DEFAULT_CPU_PERIOD_US);
            if u64::from(pct) * period / 100 < 1_000 {
                return Err(SpecError::new(
                    "limits.cpu_percent",
                    format!("{pct} % of a {period} µs window is under the kernel's 1 ms minimum quota (use a longer cpu_period_us)"),
                ));
            }
        }
        if l.pids == Some(0) {
            return Err(SpecError::new("limits.pids", "must be positive"));
        }
        if l.setup_timeout_ms == Some(0) {
            return Err(SpecError::new("limits.setup_timeout_ms", "must be positive"));
        }
        if l.timeout_ms == Some(0) {
            return Err(SpecError::new("limits.timeout_ms", "must be positive"));
        }
        if l.nofile < 16 {
            return Err(SpecError::new("limits.nofile", "must be at least 16"));
        }
        if !(1..=1 << 20).contains(&l.sigpending) {
            return Err(SpecError::new("limits.sigpending", "must be between 1 and 1048576"));
        }
        if !(1..=1024).contains(&l.inotify_instances) {
            return Err(SpecError::new("limits.inotify_instances", "must be between 1 and 1024"));
        }
        if !(1..=1 << 20).contains(&l.inotify_watches) {
            return Err(SpecError::new("limits.inotify_watches", "must be between 1 and 1048576"));
        }
        if self.hostname.is_empty()
            || self.hostname.len() > 64
            || !self.hostname.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        {
            return Err(SpecError::new("hostname", "must be 1–64 characters of [A-Za-z0-9.-]"));
        }
        Ok(())
    }
}

/// Absolute, and free of `.`/`..` components (so that prefix checks mean what they say).
fn check_abs(field: &str, p: &Path) -> Result<(), SpecError> {
    if !p.is_absolute() {
        return Err(SpecError::new(field, format!("{} is not an absolute path", p.display())));
    }
    if p.components().any(|c| matches!(c, Component::ParentDir | Component::CurDir)) {
        return Err(SpecError::new(field, format!("{} contains '.' or '..'", p.display())));
    }
    if p.as_os_str().as_encoded_bytes().contains(&0) {
        return Err(SpecError::new(field, "contains NUL"));
    }
    // The view builder's own names at the root of the view (`crate::mounts`).
    if let Some(Component::Normal(first)) = p.components().nth(1) {
        let first = first.to_string_lossy();
        if first == ".oldroot" || first.starts_with(".inaccessible") || first.starts_with(".synthetic-") {
            return Err(SpecError::new(
                field,
                format!("{}: /{first} is a name the view builder uses for itself", p.display()),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_builders_own_names_cannot_be_declared() {
        for p in [
            "/.oldroot",
            "/.oldroot/etc",
            "/.inaccessible",
            "/.inaccessible-dir",
            "/.inaccessible-dir/x",
            "/.synthetic-0",
            "/.synthetic-x/y",
        ] {
            let e = check_abs("filesystem.paths[0]", Path::new(p)).unwrap_err().to_string();
            assert!(e.contains("the view builder uses for itself"), "{p}: {e}");
        }
        for p in ["/srv/.oldroot", "/.oldroots", "/.synthetic", "/etc"] {
            assert!(check_abs("filesystem.paths[0]", Path::new(p)).is_ok(), "{p}");
        }
    }

    fn spec() -> SandboxSpec {
        SandboxSpec::new("/bin/true", vec![], Identity::same_inside(65534, 65534))
    }

    #[test]
    fn default_spec_is_valid_and_roundtrips() {
        let s = spec();
        s.validate().unwrap();
        let json = serde_json::to_string(&s).unwrap();
        let back: SandboxSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(s, back);
    }

    #[test]
    fn a_cpu_share_below_the_kernels_minimum_quota_is_refused() {
        // 10 % of 1 ms is 100 µs: the kernel's floor is 1 ms, which would be 100 %.
        let mut s = spec();
        s.limits.cpu_percent = Some(10);
        s.limits.cpu_period_us = Some(1_000);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("limits.cpu_percent") && e.contains("minimum quota"), "{e}");
        s.limits.cpu_period_us = Some(10_000);
        s.validate().unwrap();
        s.limits.cpu_period_us = None;
        s.limits.cpu_percent = Some(1);
        s.validate().unwrap();
    }

    #[test]
    fn rejects_root_identity() {
        let mut s = spec();
        s.identity = Identity::same_inside(0, 0);
        assert!(s.validate().unwrap_err().to_string().contains("identity"));
    }

    #[test]
    fn rejects_relative_and_dotdot_paths() {
        let mut s = spec();
        s.filesystem.paths.push(PathRule {
            source: None,
            path: "data".into(),
            access: Access::Read,
            optional: false,
            identity: None,
        });
        assert!(s.validate().unwrap_err().to_string().contains("filesystem.paths[0]"));
        s.filesystem.paths[0].path = "/data/../etc".into();
        assert!(s.validate().unwrap_err().to_string().contains("'..'"));
    }

    #[test]
    fn rejects_reserved_and_root_paths() {
        let mut s = spec();
        s.filesystem.paths.push(PathRule {
            source: None,
            path: "/proc/1".into(),
            access: Access::ReadWrite,
            optional: false,
            identity: None,
        });
        assert!(s.validate().is_err());
        s.filesystem.paths[0].path = "/".into();
        assert!(s.validate().is_err());
    }

    #[test]
    fn mandatory_namespaces() {
        let mut s = spec();
        s.namespaces.pid = false;
        assert!(s.validate().unwrap_err().to_string().contains("namespaces.pid"));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let mut v = serde_json::to_value(spec()).unwrap();
        v["limits"]["memroy_bytes"] = serde_json::json!(1);
        assert!(serde_json::from_value::<SandboxSpec>(v).is_err());
    }

    #[test]
    fn passwd_lookup() {
        let text = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\nbad:x:zz:1::/:\n";
        assert_eq!(local_user(text, "nobody"), Some((65534, 65534)));
        assert_eq!(local_user(text, "nobod"), None);
        assert_eq!(local_user(text, "bad"), None);
        assert_eq!(local_user(text, "missing"), None);
    }

    #[test]
    fn env_names_checked() {
        let mut s = spec();
        s.command.env.push(("A=B".into(), "x".into()));
        assert!(s.validate().is_err());
    }
}
