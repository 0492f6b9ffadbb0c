//! What the sandbox reports: which restrictions were actually enforced, how the payload
//! ended, and what it used. Nothing here is inferred from the spec — each field is filled by
//! the step that applied it, so a restriction that did not take effect cannot be reported as
//! enforced.

use serde::{Deserialize, Serialize};

/// How a process ended.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitInfo {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl ExitInfo {
    pub fn from_wait_status(status: i32) -> Self {
        if libc::WIFEXITED(status) {
            Self { code: Some(libc::WEXITSTATUS(status)), signal: None }
        } else if libc::WIFSIGNALED(status) {
            Self { code: None, signal: Some(libc::WTERMSIG(status)) }
        } else {
            Self::default()
        }
    }

    /// Exit code a shell would show (128+N for signal N).
    pub fn shell_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            _ => 255,
        }
    }
}

/// Landlock enforcement level.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LandlockStatus {
    FullyEnforced,
    PartiallyEnforced,
    NotEnforced,
}

impl LandlockStatus {
    /// The name the report serializes it as.
    pub fn as_str(self) -> &'static str {
        match self {
            LandlockStatus::FullyEnforced => "fully_enforced",
            LandlockStatus::PartiallyEnforced => "partially_enforced",
            LandlockStatus::NotEnforced => "not_enforced",
        }
    }
}

/// Exactly which Landlock rights and scopes the kernel enforced.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LandlockReport {
    /// The kernel's Landlock ABI (0 = unavailable).
    pub abi: u32,
    pub status: LandlockStatus,
    /// Filesystem access rights the ruleset handles (denied unless a rule grants them).
    pub fs_enforced: Vec<String>,
    /// Rights requested but unknown to this kernel (not enforced).
    pub fs_unsupported: Vec<String>,
    /// IPC scopes enforced (`abstract_unix_socket`, `signal`).
    pub scopes_enforced: Vec<String>,
    /// Scopes requested but unknown to this kernel.
    pub scopes_unsupported: Vec<String>,
}

/// Seccomp state of the payload.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SeccompReport {
    /// `enforced` or `disabled`.
    pub status: String,
    pub profile: Option<String>,
    pub filters: usize,
}

/// Everything the payload process verified about itself just before `execve`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EnforcementReport {
    pub namespaces: Vec<String>,
    pub landlock: LandlockReport,
    pub seccomp: SeccompReport,
    /// All capability sets (effective, permitted, inheritable, ambient, bounding) are empty.
    pub capabilities_dropped: bool,
    pub no_new_privs: bool,
    /// `fresh` when a new read-only sysfs is mounted, `none` when `/sys` is an empty directory.
    pub sysfs: String,
    pub uid: u32,
    pub gid: u32,
    /// The private network namespace was made beforehand ([`crate::netns_stash`]) and
    /// joined, rather than created by the sandbox.
    #[serde(default)]
    pub net_prepared: bool,
}

/// Resource usage of the whole sandbox.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResourceUsage {
    pub wall_ms: u64,
    /// User + system CPU time of every process in the sandbox.
    pub cpu_ms: u64,
    pub peak_memory_bytes: Option<u64>,
    /// OOM kills inside the sandbox's memory cgroup.
    pub oom_kills: u64,
    /// Forks refused by the pids limit.
    pub pids_limit_hits: u64,
    /// CFS periods in which the sandbox was throttled.
    pub cpu_throttled_periods: u64,
    pub cpu_throttled_ms: u64,
}

/// Which cgroup limits are in force.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CgroupReport {
    /// `v2`, `v1`, or `none` when no controller could be used (degraded mode only).
    pub version: String,
    /// Sandbox cgroup path(s), relative to each hierarchy root.
    pub paths: Vec<String>,
    pub memory: bool,
    pub cpu: bool,
    pub pids: bool,
    /// Limits requested but not enforced (degraded mode), with the reason.
    pub degraded: Vec<String>,
}

impl CgroupReport {
    /// The report of a sandbox without cgroups (degraded mode only).
    pub fn none() -> CgroupReport {
        CgroupReport { version: "none".into(), paths: vec![], memory: false, cpu: false, pids: false, degraded: vec![] }
    }
}

/// Why the payload was stopped by the sandbox (as opposed to exiting on its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KilledBy {
    Oom,
    Timeout,
    Pids,
    Signal(i32),
}

impl std::fmt::Display for KilledBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KilledBy::Oom => f.write_str("oom"),
            KilledBy::Timeout => f.write_str("timeout"),
            KilledBy::Pids => f.write_str("pids"),
            KilledBy::Signal(n) => write!(f, "signal:{n}"),
        }
    }
}

impl Serialize for KilledBy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Captured output of one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Captured {
    /// The first `cap` bytes.
    pub bytes: Vec<u8>,
    /// Total bytes the payload wrote.
    pub total: u64,
}

impl Captured {
    pub fn truncated(&self) -> bool {
        self.total > self.bytes.len() as u64
    }
}

/// The outcome of one sandbox run.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// How the payload ended; `None` when it was killed together with the sandbox init.
    pub exit: Option<ExitInfo>,
    pub timed_out: bool,
    /// Ended by [`crate::StopHandle::stop`].
    pub stopped: bool,
    pub killed_by: Option<KilledBy>,
    /// When `killed_by` is [`KilledBy::Oom`]: `Some(false)` if the sandbox's own memory limit
    /// was not reached — the host or a parent cgroup ran out of memory and the kernel chose
    /// a victim in the sandbox. `None` when it cannot be told (or no OOM kill).
    pub oom_at_limit: Option<bool>,
    pub stdout: Captured,
    pub stderr: Captured,
    pub usage: ResourceUsage,
    pub enforcement: EnforcementReport,
    pub cgroup: CgroupReport,
    /// How the sandbox was started: `"exec"`, `"fork"` or `"zygote"`.
    pub launch: &'static str,
    /// The host uid the sandbox ran as when it had one of its own ([`crate::host_uid`]);
    /// `None`: the identity's, shared with every other sandbox of it.
    pub host_uid: Option<u32>,
    /// Declared paths bound without the sandbox's idmapping, each with the reason
    /// ([`crate::idmap`]).
    pub not_idmapped: Vec<String>,
    /// When this process learnt of the payload's exit (its init's report): where a run's
    /// time goes (`opservant bench`).
    pub payload_exited_at: Option<std::time::Instant>,
    /// The sandbox was ended from outside: its init (or monitor) ended while the payload ran,
    /// without a timeout, a stop or an out-of-memory kill of this process's making — the
    /// kernel then kills every process of the PID namespace, the payload with it. `None`
    /// whenever the payload's own exit was reported.
    pub ended_from_outside: Option<EndedFromOutside>,
}

/// Which process of a sandbox ended it from outside ([`Outcome::ended_from_outside`]), and by
/// which signal when that is known: init's wait status comes from its monitor, the monitor's
/// from this process when it is its child; a sandbox a zygote started directly (no monitor),
/// or a monitor that is the zygote's child, leaves it unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndedFromOutside {
    /// `"init"` or `"monitor"`.
    pub process: &'static str,
    pub signal: Option<i32>,
}

impl std::fmt::Display for EndedFromOutside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.signal {
            Some(n) => write!(f, "the sandbox's {} was killed by signal {n}", self.process),
            None => write!(f, "the sandbox's {} ended", self.process),
        }?;
        f.write_str(
            " before its payload's exit was reported (ended from outside the sandbox; the payload went with it)",
        )
    }
}

impl Outcome {
    /// The payload exited on its own with status 0.
    pub fn success(&self) -> bool {
        !self.timed_out && !self.stopped && self.killed_by.is_none() && self.exit.is_some_and(|e| e.code == Some(0))
    }
}
