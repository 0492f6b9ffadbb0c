//! Error types. Every error says which step or field failed and why; none is swallowed.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A spec field that cannot be honoured.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{field}: {message}")]
pub struct SpecError {
    pub field: String,
    pub message: String,
}

impl SpecError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }
}

/// The isolation step that failed inside the sandbox (reported over the channel).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Protocol,
    Cgroup,
    Groups,
    Unshare,
    Fork,
    Identity,
    Mounts,
    Hostname,
    Loopback,
    Ucounts,
    Landlock,
    Capabilities,
    Rlimits,
    Seccomp,
    Exec,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = serde_json::to_value(self).ok().and_then(|v| v.as_str().map(str::to_owned));
        f.write_str(s.as_deref().unwrap_or("unknown"))
    }
}

/// A failure while setting up a step inside the sandbox.
#[derive(Debug, Clone, Error, Serialize, Deserialize, PartialEq, Eq)]
#[error("{stage}: {message}")]
pub struct StepError {
    pub stage: Stage,
    pub message: String,
}

impl StepError {
    pub fn new(stage: Stage, message: impl Into<String>) -> Self {
        Self { stage, message: message.into() }
    }

    /// `context: errno-description`.
    pub fn errno(stage: Stage, context: impl std::fmt::Display, err: nix::errno::Errno) -> Self {
        Self::new(stage, format!("{context}: {}", err.desc()))
    }

    pub fn io(stage: Stage, context: impl std::fmt::Display, err: std::io::Error) -> Self {
        Self::new(stage, format!("{context}: {err}"))
    }
}

/// Errors from cgroup setup or teardown.
#[derive(Debug, Error)]
pub enum CgroupError {
    #[error("cgroup: {0}")]
    Unavailable(String),
    #[error("cgroup: cannot {action} {path}: {source}")]
    Io { action: &'static str, path: String, source: std::io::Error },
}

/// Everything that can stop a sandbox from running.
#[derive(Debug, Error)]
pub enum SandboxError {
    #[error("invalid sandbox spec: {0}")]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error("landlock: kernel ABI {found} is below the required minimum {required}")]
    LandlockTooOld { found: u32, required: u32 },
    #[error("cannot start the sandbox init process {program}: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("sandbox setup failed at {0}")]
    Step(#[from] StepError),
    #[error("sandbox channel: {0}")]
    Channel(String),
    #[error("cannot write {what} of pid {pid}: {source}")]
    IdMap { what: &'static str, pid: i32, source: std::io::Error },
    #[error("namespace hook failed: {0}")]
    Hook(String),
    /// No host uid could be leased for the sandbox ([`crate::host_uid`]).
    #[error("host uid: {0}")]
    HostUid(String),
    /// The zygote could not start the sandbox (it is gone or refused the request); nothing
    /// of the sandbox ran, so the caller may start it another way.
    #[error("zygote: {0}")]
    Zygote(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    /// The payload started, but processes of the sandbox outlived SIGKILL (stuck in the
    /// kernel) and were left behind ([`crate::Sandbox::wait`]): the outcome up to then, for a
    /// caller that already holds what the payload produced (an executor's result).
    #[error("sandbox abandoned: {reason}")]
    Abandoned { reason: String, outcome: Box<crate::report::Outcome> },
}

impl SandboxError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io { context: context.into(), source }
    }
}
