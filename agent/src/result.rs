//! The result JSON (DESIGN.md §4), one object per run.

use serde::Serialize;

use crate::limits::{Clamp, EffectiveLimits};

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Completed,
    Failed,
    Partial,
    Timeout,
    Rejected,
}

impl Status {
    /// As the result JSON spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Partial => "partial",
            Status::Timeout => "timeout",
            Status::Rejected => "rejected",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ExecutorRef {
    pub name: String,
    pub version: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct LimitsReport {
    pub max_memory_mb: u64,
    pub max_cpu_percent: u64,
    pub timeout_seconds: u64,
    pub max_disk_mb: u64,
    pub max_pids: u64,
    /// `null` when the sandbox has no network.
    pub max_bandwidth_mbps: Option<u64>,
    pub clamped: Vec<Clamp>,
    /// Which limits the kernel is enforcing.
    pub enforced: EnforcedLimits,
    /// Limits requested but not enforced (degraded mode only).
    pub degraded: Vec<String>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct EnforcedLimits {
    pub memory: bool,
    pub cpu: bool,
    pub pids: bool,
    pub disk: bool,
    pub timeout: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct SandboxSummary {
    pub namespaces: Vec<String>,
    pub landlock: sandbox::LandlockReport,
    pub seccomp: String,
    pub seccomp_profile: Option<String>,
    pub cgroup: String,
    pub cgroup_paths: Vec<String>,
    pub network: String,
    /// The sandbox's network namespace: `created` by the sandbox (owned by its user
    /// namespace), `prepared` (made beforehand by the agent's zygote and joined — owned by
    /// the agent's user namespace, so the sandbox holds no capability over it), or `host`.
    pub netns: &'static str,
    /// With egress: addresses, bandwidth, blocked attempts, the DNS forwarder's counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<serde_json::Value>,
    pub capabilities: String,
    pub no_new_privs: bool,
    pub sysfs: String,
    pub uid: u32,
    pub gid: u32,
    /// The host uid the payload ran as: one of its own for the sandbox's lifetime, or the
    /// identity's, shared with every other sandbox (`host_uid_shared`).
    pub host_uid: u32,
    pub host_uid_shared: bool,
    /// Declared paths bound without the sandbox's idmapping (the identity's files there are
    /// not the sandbox's own), each with the reason.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_idmapped: Vec<String>,
    /// `cold` (a fresh process) or `zygote` (a fork of the pre-initialised runtime).
    pub launch: &'static str,
    /// Why the sandbox was abandoned — processes of it outlived SIGKILL (stuck in the kernel)
    /// and were left behind — after the run's result came (an executor's result stands).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub abandoned: Option<String>,
}

impl SandboxSummary {
    /// What a sandbox enforces, from its payload's report (`e`) and its cgroups' (`cg`); the
    /// rest as its [`sandbox::Outcome`] (or the running [`sandbox::Sandbox`]) says.
    pub fn new(
        e: &sandbox::EnforcementReport,
        cg: &sandbox::CgroupReport,
        launch: &str,
        host_uid: Option<u32>,
        not_idmapped: &[String],
    ) -> SandboxSummary {
        let has_net = e.namespaces.iter().any(|n| n == "net");
        SandboxSummary {
            namespaces: e.namespaces.clone(),
            landlock: e.landlock.clone(),
            seccomp: e.seccomp.status.clone(),
            seccomp_profile: e.seccomp.profile.clone(),
            cgroup: cg.version.clone(),
            cgroup_paths: cg.paths.clone(),
            network: if has_net { "none".into() } else { "host".into() },
            netns: match (has_net, e.net_prepared) {
                (false, _) => "host",
                (true, false) => "created",
                (true, true) => "prepared",
            },
            egress: None,
            capabilities: if e.capabilities_dropped { "none".into() } else { "retained".into() },
            no_new_privs: e.no_new_privs,
            sysfs: e.sysfs.clone(),
            uid: e.uid,
            gid: e.gid,
            host_uid: host_uid.unwrap_or(e.uid),
            host_uid_shared: host_uid.is_none(),
            not_idmapped: not_idmapped.to_vec(),
            launch: match launch {
                "zygote" => "zygote",
                "pool" => "pool",
                _ => "cold",
            },
            abandoned: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub status: Status,
    pub output: serde_json::Value,
    pub error: Option<String>,
    pub artifacts: Vec<serde_json::Value>,
    pub executor: Option<ExecutorRef>,
    pub action: Option<String>,
    pub command_id: Option<String>,
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub exit_code: Option<i32>,
    pub killed_by: Option<String>,
    /// Records from `context["logger"]` (executor runs).
    pub logs: Vec<serde_json::Value>,
    pub limits: LimitsReport,
    pub usage: sandbox::ResourceUsage,
    pub sandbox: SandboxSummary,
}

impl RunResult {
    /// The result of running a plain program with `opservant sandbox` (DESIGN.md §4):
    /// `completed` when it exits 0, `failed` otherwise — a program the wall-clock limit
    /// stopped too, its `killed_by` (`timeout`) and `error` saying so.
    pub fn for_plain_program(outcome: &sandbox::Outcome, limits: &EffectiveLimits) -> RunResult {
        let mut result = RunResult::for_program(outcome, limits);
        if result.status == Status::Timeout {
            result.status = Status::Failed;
        }
        result
    }

    /// The base every run's result starts from: `completed` when the sandbox's program
    /// exits 0, `timeout` when the wall-clock limit fired (the status of an executor run, a
    /// script or a session call so stopped, DESIGN.md §3), `failed` otherwise.
    pub fn for_program(outcome: &sandbox::Outcome, limits: &EffectiveLimits) -> RunResult {
        let status = if outcome.timed_out {
            Status::Timeout
        } else if outcome.success() {
            Status::Completed
        } else {
            Status::Failed
        };
        let error = match (status, outcome.killed_by, outcome.exit) {
            (Status::Completed, _, _) => None,
            _ if outcome.stopped && !outcome.timed_out && outcome.killed_by != Some(sandbox::KilledBy::Oom) => {
                Some("stopped before it finished (its caller stopped the sandbox)".into())
            }
            (_, None | Some(sandbox::KilledBy::Signal(_)), _) if outcome.ended_from_outside.is_some() => {
                outcome.ended_from_outside.map(|e| e.to_string())
            }
            (_, Some(k), _) => Some(match k {
                sandbox::KilledBy::Oom if outcome.oom_at_limit == Some(false) => format!(
                    "killed: out of memory (the host or a parent cgroup ran out; the sandbox's limit of {} MB was not reached)",
                    limits.max_memory_mb
                ),
                sandbox::KilledBy::Oom => format!("killed: out of memory (limit {} MB)", limits.max_memory_mb),
                sandbox::KilledBy::Timeout => format!("timed out after {} s", limits.timeout_seconds),
                sandbox::KilledBy::Pids => format!("failed after hitting the process limit ({})", limits.max_pids),
                sandbox::KilledBy::Signal(n) => format!("killed by signal {n}"),
            }),
            (_, None, Some(x)) => Some(format!("exited with status {}", x.shell_code())),
            (_, None, None) => Some("ended without an exit status".into()),
        };
        let e = &outcome.enforcement;
        let cg = &outcome.cgroup;
        RunResult {
            status,
            output: serde_json::json!({}),
            error,
            artifacts: vec![],
            executor: None,
            action: None,
            command_id: None,
            stdout: String::from_utf8_lossy(&outcome.stdout.bytes).into_owned(),
            stderr: String::from_utf8_lossy(&outcome.stderr.bytes).into_owned(),
            stdout_truncated: outcome.stdout.truncated(),
            stderr_truncated: outcome.stderr.truncated(),
            exit_code: outcome.exit.and_then(|x| x.code),
            killed_by: outcome.killed_by.map(|k| k.to_string()),
            logs: Vec::new(),
            limits: LimitsReport {
                max_memory_mb: limits.max_memory_mb,
                max_cpu_percent: limits.max_cpu_percent,
                timeout_seconds: limits.timeout_seconds,
                max_disk_mb: limits.max_disk_mb,
                max_pids: limits.max_pids,
                max_bandwidth_mbps: None,
                clamped: limits.clamped.clone(),
                enforced: EnforcedLimits { memory: cg.memory, cpu: cg.cpu, pids: cg.pids, disk: true, timeout: true },
                degraded: cg.degraded.clone(),
            },
            usage: outcome.usage,
            sandbox: SandboxSummary::new(e, cg, outcome.launch, outcome.host_uid, &outcome.not_idmapped),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Status;

    #[test]
    fn status_names_are_the_result_jsons() {
        for s in [Status::Completed, Status::Failed, Status::Partial, Status::Timeout, Status::Rejected] {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
    }
}
