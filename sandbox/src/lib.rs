//! `sandbox` — runs a payload in a fresh, isolated process built from kernel primitives:
//! user, mount, PID, network, IPC, UTS and cgroup namespaces; a read-only allowlisted
//! filesystem view; Landlock; seccomp-bpf; no capabilities; cgroup limits; a wall-clock timeout.
//!
//! No Python, no async runtime, no policy: the caller decides what a [`SandboxSpec`] holds.
//!
//! ```no_run
//! # fn main() -> Result<(), sandbox::SandboxError> {
//! use sandbox::{Identity, Launcher, OutputOptions, SandboxSpec};
//! // In main(), before anything else:  if argv[1] == "__sandbox-init" { sandbox::init::main() }
//! let mut spec = SandboxSpec::new("/bin/true", vec![], Identity::default_executor()?);
//! spec.seccomp = sandbox::seccomp::default_policy().expect("default profile compiles");
//! let outcome = sandbox::run(&spec, &Launcher::reexec("__sandbox-init"), OutputOptions::default())?;
//! assert!(outcome.success());
//! # Ok(()) }
//! ```
//!
//! The isolation steps and their order are listed in one place: [`init`]. Network egress
//! (a veth pair, NAT and an nftables ruleset inside the sandbox's namespace) is [`net`],
//! wired from the parent's namespace hook.

pub mod cgroup;
pub mod channel;
pub mod error;
pub mod host_uid;
pub mod idmap;
pub mod init;
pub mod landlock;
pub mod mountinfo;
pub mod mounts;
pub mod namespaces;
pub mod net;
pub mod netns_stash;
pub mod parent;
pub mod privileges;
pub mod probe;
pub mod process;
pub mod report;
pub mod seccomp;
pub mod spec;
pub mod zygote;

pub use error::{CgroupError, SandboxError, SpecError, Stage, StepError};
pub use init::{Handoff, PayloadEnd};
pub use parent::{run, CpuLimiter, Launcher, MonitorProc, NamespaceHook, OutputOptions, Sandbox, StopHandle, Stream};
pub use report::{
    Captured, CgroupReport, EndedFromOutside, EnforcementReport, ExitInfo, KilledBy, LandlockReport, LandlockStatus,
    Outcome, ResourceUsage,
};
pub use spec::{
    Access, FileId, Filesystem, HostUids, Identity, Limits, Namespaces, PathRule, SandboxSpec, SeccompPolicy,
    SyntheticFile,
};
