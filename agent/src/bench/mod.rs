//! `opservant bench`: the sandbox overhead report (issue 6, item 3).
//!
//! Every row runs in this one process, interleaved — each round runs each row once, in an
//! order shuffled per round from a recorded seed — so drift of a shared, noisy machine, and
//! what a row leaves behind for the next, hits every row alike; ratios are against bubblewrap measured in the same run. Percentiles are
//! nearest-rank ([`stats::percentile`]).
//!
//! Rows that start a command measure the wall time from spawning it (stdin on `/dev/null`,
//! stdout and stderr captured) to having reaped it; the binaries under test are installed
//! copies (benches/README.md, "Installed copies"). The `*-zygote` rows run in this process
//! through the library, with a zygote this process holds — what a daemon holding a zygote
//! does per execution. Every sample is checked (exit status, result JSON, the launch mode: a
//! zygote row that fell back to the cold path aborts the benchmark).
//!
//! Guarantees: nothing outside a scratch directory in `/var/tmp` and (for the egress rows) a
//! network namespace of its own is touched, and both are removed at the end; a failure of
//! any measured command aborts with the reason — a timing never does.

pub mod chart;
mod daemon;
pub mod memory;
pub mod stats;

use std::ffi::CStr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::config::Config;
use crate::executor_run::{Executor, RunRequest};
use crate::policy::AgentPolicy;
use crate::result::Status;
use stats::{round2, round3, Summary};

/// Why the benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Bad options (exit status 2).
    #[error("{0}")]
    Usage(String),
    /// Something could not be set up or a measured command failed.
    #[error("{0}")]
    Failed(String),
    /// Stopped by this signal (SIGINT, SIGTERM or SIGHUP) after the sample in progress;
    /// everything the benchmark made was removed (exit status 1: ran, did not complete).
    #[error("interrupted by signal {0}; stopped and cleaned up")]
    Interrupted(i32),
}

/// The stop signal a running benchmark received (0: none). Caught rather than left to kill
/// the process, so that the scratch directory, the network namespace and the zygote are
/// removed as on a normal end.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    // Async-signal-safe: a store to a lock-free atomic.
    STOP_SIGNAL.store(signal, Ordering::Relaxed);
}

/// Catch SIGINT, SIGTERM and SIGHUP for the rest of the process (see [`STOP_SIGNAL`]).
fn catch_stop_signals() -> Result<(), BenchError> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(SigHandler::Handler(on_stop_signal), SaFlags::SA_RESTART, SigSet::empty());
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores to a lock-free atomic, which is async-signal-safe;
        // no other handler of these signals exists in this process to be replaced.
        unsafe { sigaction(signal, &action) }.map_err(|e| failed(format!("sigaction {signal}: {e}")))?;
    }
    Ok(())
}

/// `Err(Interrupted)` once a stop signal arrived.
fn check_stop() -> Result<(), BenchError> {
    match STOP_SIGNAL.load(Ordering::Relaxed) {
        0 => Ok(()),
        signal => Err(BenchError::Interrupted(signal)),
    }
}

/// `e`, or `Interrupted` when a stop signal arrived meanwhile (a measured command that the
/// terminal's Ctrl-C also reached fails because of it, not on its own).
fn or_stopped(e: BenchError) -> BenchError {
    check_stop().err().unwrap_or(e)
}

fn failed(e: impl std::fmt::Display) -> BenchError {
    BenchError::Failed(e.to_string())
}

/// Debian's interpreter, the one `opservant-runtime` embeds (not whatever is first in PATH).
pub const PYTHON: &str = "/usr/bin/python3";

/// Which bubblewrap row a row's ratio is against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// `/bin/true` rows, against `bwrap-true`.
    True,
    /// Python rows (an interpreter or the runtime starts), against `bwrap-python3`.
    Python,
}

/// Every row: name, family, what it measures.
pub const ROWS: &[(&str, Family, &str)] = &[
    ("true", Family::True, "/bin/true, bare"),
    ("python3", Family::Python, "/usr/bin/python3 -I -S -c pass, bare"),
    ("unshare", Family::True, "unshare of the 7 namespaces (user, mount, pid, net, ipc, uts, cgroup) /bin/true"),
    ("bwrap-true", Family::True, "bwrap --unshare-all --die-with-parent --ro-bind / / /bin/true (reference)"),
    (
        "bwrap-python3",
        Family::Python,
        "bwrap --unshare-all --die-with-parent --ro-bind / / python3 -I -S -c pass (reference)",
    ),
    ("sandbox-cold", Family::True, "opservant sandbox --json --config CONFIG -- /bin/true (subprocess)"),
    (
        "sandbox-zygote",
        Family::True,
        "sandbox /bin/true through a zygote held by this process (library; its network namespace made \
         beforehand, its mount namespace released after the sample)",
    ),
    ("run-cold", Family::Python, "opservant run NOOP (subprocess, cold)"),
    (
        "run-zygote",
        Family::Python,
        "no-op executor through a zygote held by this process (library: the daemon's run path, without its \
         per-command signature check, receipt and replay records; timed to the complete outcome, the \
         sandbox's last exits and cgroup removal left to a background thread as the daemon does)",
    ),
    (
        "run-pool",
        Family::Python,
        "no-op executor taking a sandbox of the warm pool, started beforehand through the zygote (library, \
         as run-zygote)",
    ),
    (
        "run-agent",
        Family::Python,
        "no-op executor as a signed execute command on the socket of an opservant agent (installed copy, default \
         zygote launch, the executor installed with opservant executor install): the daemon's whole command path — \
         signature check, replay and receipt records, the run, its completion record, the reply; signed beforehand, \
         timed from connecting to the reply",
    ),
    (
        "run-agent-pool",
        Family::Python,
        "as run-agent, on a second agent with agent.warm_pool: 1; before each sample (untimed) pings until its pooled \
         sandbox is ready; the refill the run starts begins as the run ends, as in a daemon",
    ),
    ("run-cold-egress", Family::Python, "opservant run NOOP-EGRESS (subprocess, cold, outbound allowed)"),
    ("run-zygote-egress", Family::Python, "no-op executor with egress through the held zygote (library)"),
    (
        "run-pool-egress",
        Family::Python,
        "no-op executor with egress from the warm pool: never measured, such runs never use the pool",
    ),
];

/// Why `run-pool-egress` is always reported skipped ([`crate::warm_pool`]'s guarantees).
pub const POOL_EGRESS_SKIP: &str =
    "not applicable: runs with network egress never use the warm pool (their network is wired per run)";

/// Reference rows.
const BWRAP_TRUE: &str = "bwrap-true";
const BWRAP_PYTHON: &str = "bwrap-python3";

/// Targets of issue 6.
pub const TARGET_COLD_RATIO: f64 = 1.2;
pub const TARGET_ZYGOTE_MS: f64 = 2.0;
pub const TARGET_POOL_MS: f64 = 0.3;
pub const TARGET_THROUGHPUT: f64 = 300.0;
pub const TARGET_AGENT_RSS_MIB: f64 = 30.0;
pub const TARGET_SANDBOX_MIB: f64 = 5.0;

/// Options of `opservant bench`.
#[derive(Debug, Clone)]
pub struct Options {
    pub rounds: usize,
    pub warmup: usize,
    /// Rows to run (all when `None`); validated by [`Options::rows`].
    pub only: Option<Vec<String>>,
    /// Threads of the throughput test.
    pub threads: usize,
    /// How long the throughput test runs.
    pub duration: Duration,
    /// Skip the throughput and memory sections.
    pub timings_only: bool,
}

impl Options {
    /// The selected rows, in table order; an unknown name or an empty selection is a usage
    /// error.
    pub fn rows(&self) -> Result<Vec<&'static str>, BenchError> {
        const MAX_ROUNDS: usize = 1_000_000;
        // A million rounds of the fastest row take minutes; more is a mistake (and their sum
        // must not wrap: it once did, to a report of no samples).
        if self.rounds == 0 || self.rounds > MAX_ROUNDS {
            return Err(BenchError::Usage(format!("--rounds: must be 1-{MAX_ROUNDS}")));
        }
        if self.warmup > MAX_ROUNDS {
            return Err(BenchError::Usage(format!("--warmup: must be 0-{MAX_ROUNDS}")));
        }
        if self.threads == 0 || self.threads > 256 {
            // The throughput through an agent runs as many commands at once: its
            // `agent.max_concurrent` range.
            return Err(BenchError::Usage("--threads: must be 1-256".into()));
        }
        let Some(only) = &self.only else { return Ok(ROWS.iter().map(|r| r.0).collect()) };
        let names: Vec<&str> = ROWS.iter().map(|r| r.0).collect();
        for o in only {
            if !names.contains(&o.as_str()) {
                return Err(BenchError::Usage(format!("--only: unknown row '{o}' (rows: {})", names.join(", "))));
            }
        }
        if only.is_empty() {
            return Err(BenchError::Usage("--only: no rows given".into()));
        }
        Ok(names.into_iter().filter(|n| only.iter().any(|o| o == n)).collect())
    }
}

/// Whether this runs under CI (`CI=true` or `1`), where a missing reference tool is an error.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The first executable file `name` in `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// `uname -r`.
pub fn kernel_release() -> String {
    // SAFETY: utsname is plain data; uname fills it with NUL-terminated fields.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uname only writes into the struct it is given.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return "unknown".into();
    }
    // SAFETY: uname succeeded, so `release` is NUL-terminated within the array.
    unsafe { CStr::from_ptr(uts.release.as_ptr()) }.to_string_lossy().into_owned()
}

fn git_rev() -> Option<String> {
    if let Ok(r) = std::env::var("OPSERVANT_GIT_REV") {
        return Some(r);
    }
    let out = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).stderr(Stdio::null()).output().ok()?;
    let rev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !rev.is_empty()).then_some(rev)
}

fn python_version() -> Option<String> {
    let out = Command::new(PYTHON).arg("--version").output().ok()?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The no-op executor's module: class `NoopExecutor`, `validate` returns True, `execute` an
/// empty completed result (also used by the benchmarks in `benches/` and the load test).
pub const NOOP_PY: &str = r#"from opservant.executor import BaseExecutor, ExecutorResult


class NoopExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        return ExecutorResult(status="completed", output={})
"#;

const SLEEP_PY: &str = r#"import time
from opservant.executor import BaseExecutor, ExecutorResult


class SleepExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        time.sleep(params.get("seconds", 1))
        return ExecutorResult(status="completed", output={})
"#;

/// The benchmark's scratch directory (`/var/tmp`: host `/tmp` is not in a sandbox's view)
/// and network namespace; both removed on drop.
struct Scratch {
    dir: PathBuf,
    netns: Option<String>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(ns) = &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).stderr(Stdio::null()).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn write(path: &Path, text: &str) -> Result<(), BenchError> {
    std::fs::write(path, text).map_err(|e| failed(format!("{}: {e}", path.display())))
}

/// An executor package in `dir`: manifest with `network`, class `Class` in `pkg/main.py`.
fn write_executor(dir: &Path, name: &str, class: &str, source: &str, network: Value) -> Result<(), BenchError> {
    let pkg = dir.join(name);
    std::fs::create_dir_all(&pkg).map_err(|e| failed(format!("{}: {e}", pkg.display())))?;
    write(&pkg.join("__init__.py"), "")?;
    write(&pkg.join("main.py"), source)?;
    let manifest = json!({
        "name": name, "version": "1.0.0", "description": "benchmark executor", "author": "opservant bench",
        "supported_actions": [format!("act-{name}")], "entry_point": format!("{name}.main.{class}"),
        "permissions": {"network": network},
    });
    write(&dir.join("manifest.json"), &manifest.to_string())
}

/// The executor packages [`make_scratch`] writes.
const EXECUTOR_DIRS: [&str; 3] = ["noop", "noop-egress", "sleep"];

/// Remove the scratch directories of benchmarks that were killed before they could (their
/// process is gone; a directory whose pid is alive again is left alone).
fn remove_stale_scratch() {
    let Ok(entries) = std::fs::read_dir("/var/tmp") else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("opservant-bench-")) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The `sandbox:` section of every configuration the bench writes: the host uids this host's
/// agent configuration gives sandboxes (`sandbox.host_uids`, resolved: `auto` as the agent
/// resolves it), so the rows measure sandboxes as this host runs them. Set once per run.
static SANDBOX_SECTION: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// What [`SANDBOX_SECTION`] says, for the report.
fn host_uids_of_this_host() -> Result<(String, Value), BenchError> {
    let config = crate::config::Config::load(None).map_err(|e| BenchError::Usage(e.to_string()))?;
    let uids = crate::policy::host_uids(
        config.sandbox.host_uids.as_ref(),
        &crate::policy::AgentPolicy::from_config(&config).map_err(failed)?.identity,
    )
    .map_err(BenchError::Usage)?;
    Ok(match uids {
        Some(r) => (
            format!("sandbox:\n  host_uids: {{first: {}, count: {}}}\n", r.first, r.count),
            json!({"per_sandbox": true, "first": r.first, "count": r.count}),
        ),
        None => ("sandbox:\n  host_uids: shared\n".into(), json!({"per_sandbox": false})),
    })
}

fn sandbox_section() -> &'static str {
    SANDBOX_SECTION.get().map_or("", String::as_str)
}

fn make_scratch() -> Result<Scratch, BenchError> {
    remove_stale_scratch();
    let dir = PathBuf::from(format!("/var/tmp/opservant-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // `create_dir`, not `create_dir_all`: `/var/tmp` is world-writable, and a directory
    // someone else made there (between the removal and now) must not be used — the
    // benchmark runs as root from a configuration it writes into this directory.
    std::fs::create_dir(&dir).map_err(|e| failed(format!("{}: {e}", dir.display())))?;
    let scratch = Scratch { dir: dir.clone(), netns: None };
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).map_err(failed)?;
    write_executor(&dir.join("noop"), "noop", "NoopExecutor", NOOP_PY, json!({"outbound": false}))?;
    write_executor(
        &dir.join("noop-egress"),
        "noop",
        "NoopExecutor",
        NOOP_PY,
        json!({"outbound": true, "allowed_hosts": ["192.0.2.10"], "allowed_ports": [443]}),
    )?;
    write_executor(&dir.join("sleep"), "sleep", "SleepExecutor", SLEEP_PY, json!({"outbound": false}))?;
    // An upstream resolver is required with DNS allowed; none is ever asked here. The audit
    // log goes to the scratch directory.
    write(
        &dir.join("config.yaml"),
        &format!(
            "network:\n  egress:\n    dns_upstream: [\"192.0.2.53\"]\naudit:\n  path: {}\n  journald: false\n{}",
            dir.join("audit/audit.jsonl").display(),
            sandbox_section()
        ),
    )?;
    Ok(scratch)
}

/// A network namespace for the egress rows (their "host"), joined by this thread, so the
/// machine's own network configuration is never touched; no packet leaves it.
fn enter_netns(scratch: &mut Scratch) -> Result<(), BenchError> {
    let ns = format!("opsvbench-{}", std::process::id());
    let sh = |args: &[&str]| -> Result<(), BenchError> {
        let st = Command::new(args[0]).args(&args[1..]).status().map_err(|e| failed(format!("{}: {e}", args[0])))?;
        if st.success() {
            Ok(())
        } else {
            Err(failed(format!("`{}` failed ({st})", args.join(" "))))
        }
    };
    sh(&["ip", "netns", "add", &ns])?;
    scratch.netns = Some(ns.clone());
    sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
    sh(&["ip", "netns", "exec", &ns, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"])?;
    let f = std::fs::File::open(format!("/run/netns/{ns}")).map_err(failed)?;
    // SAFETY: setns on an open namespace file; it changes this thread's network namespace
    // only, and every thread and process this benchmark starts afterwards inherits it.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(failed(format!("setns {ns}: {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

/// Copies of `opservant` and `opservant-runtime` in `dir/bin`, as a package installs them.
fn install(dir: &Path) -> Result<(PathBuf, PathBuf), BenchError> {
    let exe = std::env::current_exe().map_err(failed)?;
    let runtime = crate::executor_run::runtime_binary().map_err(|e| failed(e.0))?;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).map_err(failed)?;
    let (op, rt) = (bin.join("opservant"), bin.join(crate::executor_run::RUNTIME_BINARY));
    std::fs::copy(&exe, &op).map_err(|e| failed(format!("install {}: {e}", exe.display())))?;
    std::fs::copy(&runtime, &rt).map_err(|e| failed(format!("install {}: {e}", runtime.display())))?;
    Ok((op, rt))
}

/// How a row runs one sample.
enum Kind {
    /// Spawn `argv`, wait; exit status 0 required, and with `expect_completed` a result JSON
    /// with `"status": "completed"` as the last line of stdout.
    Command { argv: Vec<String>, expect_completed: bool },
    /// `/bin/true` in a sandbox through the held zygote.
    SandboxZygote,
    /// The executor in `dir` through the held zygote.
    RunZygote { dir: PathBuf },
    /// The executor in `dir` taking a sandbox the warm pool started (untimed) beforehand.
    RunPool { dir: PathBuf },
    /// A signed `execute` of the no-op executor on the socket of the benchmark's agent
    /// without a pool (`pooled: false`) or with one, its pooled sandbox ready beforehand.
    RunAgent { pooled: bool },
}

struct Row {
    name: &'static str,
    family: Family,
    description: &'static str,
    kind: Kind,
    samples: Vec<Duration>,
    /// The library executor rows' steps ([`crate::executor_run::TIMELINE_STEPS`]): for each
    /// sample, each step's moment after the sample's start.
    steps: Vec<Vec<(&'static str, Duration)>>,
}

/// One timed sample: how long it took, and when its run passed its steps (library
/// executor rows only).
struct Sample {
    elapsed: Duration,
    steps: Vec<(&'static str, Duration)>,
}

impl Sample {
    fn timed(elapsed: Duration) -> Sample {
        Sample { elapsed, steps: Vec::new() }
    }
}

/// What the in-process rows share.
struct Env {
    config: Config,
    policy: AgentPolicy,
    runtime: PathBuf,
    zygote: Arc<sandbox::zygote::Zygote>,
    /// A pool of one sandbox, filled before each `run-pool` sample.
    pool: Arc<crate::warm_pool::WarmPool>,
    program_spec: sandbox::SandboxSpec,
    /// The agents of the `run-agent` (no pool) and `run-agent-pool` rows, when selected.
    agent_zygote: Option<daemon::BenchAgent>,
    agent_pool: Option<daemon::BenchAgent>,
}

impl Env {
    fn request<'a>(
        &'a self,
        executor: &'a Executor,
        params: Value,
        pooled: bool,
        timeline: Option<&'a crate::executor_run::Timeline>,
    ) -> RunRequest<'a> {
        RunRequest {
            executor,
            params,
            action: None,
            command_id: None,
            config: &self.config,
            policy: &self.policy,
            launcher: crate::launch::for_runtime(&self.zygote),
            runtime: self.runtime.clone(),
            pool: pooled.then(|| self.pool.clone()),
            background_teardown: true,
            timeline,
        }
    }

    fn run_executor(&self, dir: &Path, params: Value) -> Result<(), BenchError> {
        self.run_checked(dir, params, false, None)
    }

    /// One run (the manifest loaded as a run would); `pooled`: from the warm pool.
    fn run_checked(
        &self,
        dir: &Path,
        params: Value,
        pooled: bool,
        timeline: Option<&crate::executor_run::Timeline>,
    ) -> Result<(), BenchError> {
        let executor = Executor::load(dir).map_err(|e| failed(format!("{}: {}", dir.display(), e.0)))?;
        let result = crate::executor_run::run(self.request(&executor, params, pooled, timeline))
            .map_err(|e| failed(format!("run {}: {}", dir.display(), e.message())))?;
        let want = if pooled { "pool" } else { "zygote" };
        if result.status != Status::Completed || result.sandbox.launch != want {
            return Err(failed(format!(
                "run {} ({want}): status {:?}, launch {}, error {}",
                dir.display(),
                result.status,
                result.sandbox.launch,
                result.error.as_deref().unwrap_or("-")
            )));
        }
        Ok(())
    }

    /// Fill the pool with a sandbox for the run of `dir` and let it finish its set-up (its
    /// payload blocked waiting for the run's arguments), as a daemon's pool sandbox is by
    /// the time a command arrives. Untimed.
    fn warm(&self, dir: &Path) -> Result<(), BenchError> {
        let executor = Executor::load(dir).map_err(|e| failed(format!("{}: {}", dir.display(), e.0)))?;
        crate::executor_run::warm(&self.request(&executor, json!({}), true, None))
            .map_err(|e| failed(format!("warm pool: {}", e.0)))?;
        let zpid = self.zygote.pid().ok_or_else(|| failed("the zygote is not running"))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        // zygote → init → payload (a sandbox the zygote started directly), or zygote →
        // monitor → init → payload.
        let waiting =
            || (2..=3).any(|depth| memory::descendants_at_depth(zpid, depth).iter().any(|&p| memory::receiving(p)));
        while !waiting() {
            if Instant::now() >= deadline {
                // A sample would include an unfinished start.
                return Err(failed("warm pool: the pooled sandbox's payload was not waiting for its run within 5 s"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    fn sandbox_true(&self) -> Result<(), BenchError> {
        let launcher = crate::launch::for_program(&self.zygote);
        let outcome = crate::launch::spawn_with_fallback(&self.program_spec, &launcher, None)
            .and_then(|sb| sb.wait(sandbox::OutputOptions::default()))
            .map_err(|e| failed(format!("sandbox /bin/true through the zygote: {e}")))?;
        if !outcome.success() || outcome.launch != "zygote" {
            return Err(failed(format!(
                "sandbox /bin/true through the zygote: exit {:?}, launch {}, stderr {}",
                outcome.exit,
                outcome.launch,
                String::from_utf8_lossy(&outcome.stderr.bytes).trim()
            )));
        }
        Ok(())
    }
}

fn time_command(argv: &[String], expect_completed: bool) -> Result<Duration, BenchError> {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let out = cmd.output().map_err(|e| failed(format!("cannot start `{}`: {e}", argv.join(" "))))?;
    let elapsed = start.elapsed();
    let completed = || {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let last = stdout.trim_end().lines().last().unwrap_or("");
        serde_json::from_str::<Value>(last).is_ok_and(|v| v["status"] == "completed")
    };
    if !out.status.success() || (expect_completed && !completed()) {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(failed(format!(
            "`{}` failed ({}); aborting the benchmark. stderr: {}",
            argv.join(" "),
            out.status,
            stderr.trim().lines().last().unwrap_or("")
        )));
    }
    Ok(elapsed)
}

impl Row {
    fn once(&self, env: &Env) -> Result<Sample, BenchError> {
        // A library executor run, timed, with its steps.
        let run = |dir: &Path, pooled: bool| -> Result<Sample, BenchError> {
            let timeline = crate::executor_run::Timeline::default();
            let start = Instant::now();
            env.run_checked(dir, json!({}), pooled, Some(&timeline))?;
            let elapsed = start.elapsed();
            let steps = timeline.take().into_iter().map(|(step, at)| (step, at.saturating_duration_since(start)));
            Ok(Sample { elapsed, steps: steps.collect() })
        };
        match &self.kind {
            Kind::Command { argv, expect_completed } => time_command(argv, *expect_completed).map(Sample::timed),
            Kind::SandboxZygote => {
                let start = Instant::now();
                env.sandbox_true()?;
                Ok(Sample::timed(start.elapsed()))
            }
            Kind::RunZygote { dir } => run(dir, false),
            Kind::RunPool { dir } => {
                env.warm(dir)?;
                run(dir, true)
            }
            Kind::RunAgent { pooled: false } => env
                .agent_zygote
                .as_ref()
                .ok_or_else(|| failed("run-agent: no agent started"))?
                .execute("zygote")
                .map(Sample::timed),
            Kind::RunAgent { pooled: true } => {
                let agent = env.agent_pool.as_ref().ok_or_else(|| failed("run-agent-pool: no agent started"))?;
                agent.await_pool()?;
                agent.execute("pool").map(Sample::timed)
            }
        }
    }

    /// Each step's median moment after the sample's start, in step order; `Null` for a row
    /// without steps.
    fn steps_json(&self) -> Value {
        if self.steps.is_empty() {
            return Value::Null;
        }
        let steps: Vec<Value> = crate::executor_run::TIMELINE_STEPS
            .iter()
            .map(|&(step, meaning)| {
                let at: Vec<Duration> =
                    self.steps.iter().filter_map(|s| s.iter().find(|(n, _)| *n == step).map(|(_, d)| *d)).collect();
                let median = stats::summarize(&at).map(|s| s.median_ms);
                json!({"step": step, "median_ms": median, "samples": at.len(), "meaning": meaning})
            })
            .collect();
        json!(steps)
    }
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Run the benchmark; `progress` gets the lines printed while it runs (SKIPPED lines, the
/// header). The report holds every figure; [`render_table`] prints it. Installs handlers
/// for SIGINT, SIGTERM and SIGHUP for the rest of the process (a CLI's: see
/// [`BenchError::Interrupted`]).
pub fn run(opts: &Options, progress: &mut dyn FnMut(&str)) -> Result<Value, BenchError> {
    let selected = opts.rows()?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(BenchError::Usage("opservant bench needs root (cgroups, namespaces)".into()));
    }
    catch_stop_signals()?;
    let (section, host_uids) = host_uids_of_this_host()?;
    let _ = SANDBOX_SECTION.set(section);
    let mut scratch = make_scratch()?;
    let dir = scratch.dir.clone();
    let (op, runtime) = install(&dir)?;
    let op_s = op.to_string_lossy().into_owned();
    let wants_egress = selected.iter().any(|r| r.ends_with("-egress"));
    if wants_egress {
        enter_netns(&mut scratch)?;
    }
    let config = Config::load(Some(&dir.join("config.yaml"))).map_err(failed)?;
    crate::audit::init(&config).map_err(failed)?;
    let policy = AgentPolicy::from_config(&config).map_err(failed)?;
    // As installed executors are: their bytecode precompiled in a sandbox, as `executor
    // install` does, so the run rows import it instead of compiling the module every run.
    for pkg in EXECUTOR_DIRS {
        check_stop()?;
        let done = crate::bytecode::precompile(&dir.join(pkg), &policy)
            .map_err(|e| failed(format!("precompile {pkg}: {e}")))?;
        if let Some(f) = done.failed.first() {
            return Err(failed(format!("precompile {pkg}: {f}")));
        }
    }
    let (program_spec, _) = policy.spec_for(None, "/bin/true", vec![]).map_err(failed)?;
    // As the agent's daemon: one prepared network namespace per command it runs at once.
    let zygote = crate::launch::zygote(&runtime, crate::daemon::DEFAULT_MAX_CONCURRENT);
    zygote.start().map_err(|e| failed(format!("zygote: {e}")))?;
    let pool = crate::warm_pool::WarmPool::single_use(crate::launch::for_runtime(&zygote))
        .map_err(|e| failed(format!("warm pool: {e}")))?;
    // The agents of the run-agent rows, started (and their executor installed) now, untimed.
    let agent_zygote = selected
        .contains(&"run-agent")
        .then(|| daemon::BenchAgent::start("zygote", &dir, &op, 0, true, opts.threads))
        .transpose()?;
    let agent_pool = selected
        .contains(&"run-agent-pool")
        .then(|| daemon::BenchAgent::start("pool", &dir, &op, 1, true, opts.threads))
        .transpose()?;
    let mut env =
        Env { config, policy, runtime: runtime.clone(), zygote, pool, program_spec, agent_zygote, agent_pool };

    let bwrap_args = ["--unshare-all", "--die-with-parent", "--ro-bind", "/", "/"];
    let mut skipped: Vec<Value> = Vec::new();
    let mut rows: Vec<Row> = Vec::new();
    let python_ok = Path::new(PYTHON).is_file();
    for &(name, family, description) in ROWS {
        if !selected.contains(&name) {
            continue;
        }
        let mut skip = |reason: String| {
            progress(&format!("SKIPPED {name}: {reason}"));
            skipped.push(json!({"name": name, "reason": reason}));
        };
        let py = strings(&[PYTHON, "-I", "-S", "-c", "pass"]);
        let cmd = |argv: Vec<String>| Kind::Command { argv, expect_completed: false };
        let cfg = dir.join("config.yaml").to_string_lossy().into_owned();
        let kind = match name {
            "true" => cmd(strings(&["/bin/true"])),
            "python3" | "bwrap-python3" if !python_ok => {
                skip(format!("{PYTHON} not found"));
                continue;
            }
            "python3" => cmd(py),
            "unshare" => match which("unshare") {
                Some(p) => {
                    let mut argv = vec![p.to_string_lossy().into_owned()];
                    argv.extend(strings(&[
                        "--user",
                        "--map-root-user",
                        "--mount",
                        "--pid",
                        "--fork",
                        "--net",
                        "--ipc",
                        "--uts",
                        "--cgroup",
                        "/bin/true",
                    ]));
                    cmd(argv)
                }
                None => {
                    skip("unshare not found in PATH".into());
                    continue;
                }
            },
            "bwrap-true" | "bwrap-python3" => match which("bwrap") {
                Some(p) => {
                    let mut argv = vec![p.to_string_lossy().into_owned()];
                    argv.extend(strings(&bwrap_args));
                    if name == "bwrap-true" {
                        argv.push("/bin/true".into());
                    } else {
                        argv.extend(py);
                    }
                    cmd(argv)
                }
                None if in_ci() => {
                    return Err(failed(
                        "bwrap not found in PATH; the ratios against bubblewrap are the headline and CI must \
                         measure them (apt-get install bubblewrap)",
                    ))
                }
                None => {
                    skip("bwrap not found in PATH".into());
                    continue;
                }
            },
            "sandbox-cold" => Kind::Command {
                // The benchmark's configuration, as the run rows': its audit log is the
                // scratch one (a sandbox's start and end are records too).
                argv: strings(&[&op_s, "sandbox", "--json", "--config", &cfg, "--", "/bin/true"]),
                expect_completed: true,
            },
            "sandbox-zygote" => Kind::SandboxZygote,
            "run-cold" | "run-cold-egress" => {
                let sub = if name == "run-cold" { "noop" } else { "noop-egress" };
                let d = dir.join(sub).to_string_lossy().into_owned();
                Kind::Command { argv: strings(&[&op_s, "run", &d, "--config", &cfg]), expect_completed: true }
            }
            "run-zygote" => Kind::RunZygote { dir: dir.join("noop") },
            "run-pool" => Kind::RunPool { dir: dir.join("noop") },
            "run-zygote-egress" => Kind::RunZygote { dir: dir.join("noop-egress") },
            "run-agent" => Kind::RunAgent { pooled: false },
            "run-agent-pool" => Kind::RunAgent { pooled: true },
            "run-pool-egress" => {
                skip(POOL_EGRESS_SKIP.into());
                continue;
            }
            _ => continue,
        };
        rows.push(Row { name, family, description, kind, samples: Vec::new(), steps: Vec::new() });
    }
    progress(&format!(
        "opservant bench: kernel {}, {} CPUs, {} measured rounds after {} warm-up, interleaved (each round in a shuffled order); {}",
        kernel_release(),
        cpus(),
        opts.rounds,
        opts.warmup,
        python_version().map_or("python3 missing".into(), |v| format!(
            "python3 = {PYTHON} ({v}), the interpreter opservant-runtime embeds"
        )),
    ));

    // Each round runs the rows in an order of its own (shuffled, from a seed the report
    // records): a row's leftovers (a deferred teardown, a namespace being destroyed) land on
    // every other row alike, not always on the one after it.
    let seed = order_seed();
    let mut order = Shuffle::new(seed);
    let mut indices: Vec<usize> = (0..rows.len()).collect();
    for round in 0..opts.warmup + opts.rounds {
        order.shuffle(&mut indices);
        for &i in &indices {
            check_stop()?;
            let sample = rows[i].once(&env).map_err(or_stopped)?;
            if round >= opts.warmup {
                rows[i].samples.push(sample.elapsed);
                if !sample.steps.is_empty() {
                    rows[i].steps.push(sample.steps);
                }
            }
        }
    }

    // The same executions through the run-agent row's agent: the daemon's whole command
    // path, at its concurrency.
    let throughput_agent = match env.agent_zygote.as_ref().filter(|_| !opts.timings_only) {
        Some(agent) => agent_throughput(agent, opts.threads, opts.duration).map_err(or_stopped)?,
        None => Value::Null,
    };
    // The agents stop before the library's throughput and the memory sections, which they
    // would share the machine with.
    drop(env.agent_zygote.take());
    drop(env.agent_pool.take());

    let summaries: Vec<Option<Summary>> = rows.iter().map(|r| stats::summarize(&r.samples)).collect();
    let median = |name: &str| {
        rows.iter().zip(&summaries).find(|(r, _)| r.name == name).and_then(|(_, s)| s.map(|s| s.median_ms))
    };
    let (bw_true, bw_py) = (median(BWRAP_TRUE), median(BWRAP_PYTHON));
    let row_json: Vec<Value> = rows
        .iter()
        .zip(&summaries)
        .map(|(r, s)| {
            let reference = match r.family {
                Family::True => (BWRAP_TRUE, bw_true),
                Family::Python => (BWRAP_PYTHON, bw_py),
            };
            let argv = match &r.kind {
                Kind::Command { argv, .. } => json!(argv),
                _ => Value::Null,
            };
            json!({
                "name": r.name, "family": r.family, "description": r.description, "argv": argv,
                "summary": s, "reference": reference.0,
                "median_ratio_to_reference": reference.1.zip(s.map(|s| s.median_ms)).map(|(b, m)| round2(m / b)),
                "steps": r.steps_json(),
            })
        })
        .collect();

    let throughput = if opts.timings_only || !selected.contains(&"run-zygote") {
        Value::Null
    } else {
        throughput(&env, &dir.join("noop"), opts.threads, opts.duration)?
    };
    // The executor rows return, as the daemon's runs do, before their sandboxes are torn
    // down: those teardowns end before the memory is measured (and the bench exits).
    if !sandbox::parent::await_background_teardown(Duration::from_secs(30)) {
        return Err(failed("sandbox teardowns still under way 30 s after the last run"));
    }
    check_stop()?;
    let memory = if opts.timings_only { Value::Null } else { memory(&env, &dir, &op).map_err(or_stopped)? };
    check_stop()?;

    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut report = json!({
        "benchmark": "opservant bench",
        "timestamp_unix": now,
        "timestamp_utc": crate::rfc3339::format(now as i64),
        "kernel": kernel_release(),
        "cpus": cpus(),
        "rounds": opts.rounds,
        "warmup_rounds": opts.warmup,
        "order": {"method": "every row once per round, in an order shuffled per round (Fisher-Yates, xorshift64*)", "seed": format!("{seed:#018x}")},
        "git_rev": git_rev(),
        "python": {"path": PYTHON, "version": python_version()},
        "percentile_method": "nearest-rank: sorted[ceil(p/100 * n) - 1]",
        "rows": row_json,
        "skipped": skipped,
        "executors": "written to the scratch directory, their bytecode precompiled (in a sandbox) as `opservant executor install` does",
        "pool": {"built": true, "method": "run-pool: before each sample (untimed) the warm pool starts a sandbox for the run through the zygote and the bench waits until its payload waits for arguments; the sample is the run that takes it (sandbox.launch pool)"},
        "throughput": throughput,
        "throughput_agent": throughput_agent,
        "memory": memory,
        "netns_stash": env.zygote.netns_stash().map(|s| s.status()),
        "host_uids": host_uids,
    });
    let targets = targets(&report);
    report["targets"] = targets;
    Ok(report)
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

/// `threads` threads running the no-op executor through the one shared zygote for
/// `duration`. [`sandbox::zygote::Zygote`] serialises its requests internally (a mutex held
/// for the fork request and reply), so one zygote is safe to share.
fn throughput(env: &Env, noop: &Path, threads: usize, duration: Duration) -> Result<Value, BenchError> {
    let (n, elapsed) = executions_for(threads, duration, &|| env.run_executor(noop, json!({})))?;
    Ok(json!({
        "threads": threads, "zygotes": 1, "seconds": round3(elapsed), "executions": n,
        "per_second": round2(n as f64 / elapsed),
        "executor": "no-op, no egress, default limits, through one shared zygote (library)",
        "zygote_spawn_concurrency": "Zygote::spawn serialises requests with a mutex (fork request and reply only); one zygote is shared",
    }))
}

/// `threads` clients sending signed `execute` commands of the no-op executor to `agent`
/// for `duration`, each signing its next command after the last reply (in this process,
/// sharing the CPUs with the agent, as a local client does).
fn agent_throughput(agent: &daemon::BenchAgent, threads: usize, duration: Duration) -> Result<Value, BenchError> {
    let (n, elapsed) = executions_for(threads, duration, &|| agent.execute("zygote").map(|_| ()))?;
    Ok(json!({
        "threads": threads, "seconds": round3(elapsed), "executions": n,
        "per_second": round2(n as f64 / elapsed),
        "executor": "no-op, no egress, default limits: signed execute commands on the socket of the run-agent row's opservant agent (its zygote), each client waiting for its reply before the next",
    }))
}

/// Run `one` on `threads` threads until `duration` has passed: how many ran, in how many
/// seconds. The first failure (or a stop signal) ends every thread and is returned.
fn executions_for(
    threads: usize,
    duration: Duration,
    one: &(dyn Fn() -> Result<(), BenchError> + Sync),
) -> Result<(u64, f64), BenchError> {
    let done = AtomicU64::new(0);
    // The first failure, as it happened: the others are usually its consequences.
    let first: std::sync::Mutex<Option<BenchError>> = std::sync::Mutex::new(None);
    let fail = |e: BenchError| {
        first.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
    };
    let start = Instant::now();
    let deadline = start + duration;
    let stopped = || first.lock().unwrap_or_else(|p| p.into_inner()).is_some();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    while Instant::now() < deadline && !stopped() {
                        match check_stop().and_then(|()| one()) {
                            Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                            Err(e) => return fail(or_stopped(e)),
                        };
                    }
                })
            })
            .collect();
        for h in handles {
            if h.join().is_err() {
                fail(failed("throughput thread panicked"));
            }
        }
    });
    let elapsed = start.elapsed().as_secs_f64();
    match first.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok((done.load(Ordering::Relaxed), elapsed)),
    }
}

fn mib(kib: u64) -> f64 {
    round2(kib as f64 / 1024.0)
}

fn mem_json(m: memory::Mem) -> Value {
    json!({"rss_mib": mib(m.rss_kib), "pss_mib": mib(m.pss_kib)})
}

fn sum(pids: &[i32]) -> memory::Mem {
    pids.iter().filter_map(|&p| memory::of_process(p)).fold(memory::Mem::default(), |a, b| a + b)
}

/// Zygote, per-sandbox and idle-agent memory.
fn memory(env: &Env, dir: &Path, op: &Path) -> Result<Value, BenchError> {
    let zpid = env.zygote.pid().ok_or_else(|| failed("the zygote is not running"))?;
    let zygote = memory::of_process(zpid).ok_or_else(|| failed("cannot read the zygote's memory"))?;
    let wait = Duration::from_secs(20);

    // A plain program (`sleep`) through the zygote: its init (and its monitor, where it has
    // one) are the overhead.
    let (spec, _) = env.policy.spec_for(None, "/bin/sleep", vec!["30".into()]).map_err(failed)?;
    let sb = crate::launch::spawn_with_fallback(&spec, &crate::launch::for_program(&env.zygote), None)
        .map_err(|e| failed(format!("sandbox sleep: {e}")))?;
    let monitor = sb.monitor_pid();
    let found = memory::wait_for_sleeper(monitor, wait);
    let program = found.map(|(payload, rest)| {
        let machinery: Vec<i32> = std::iter::once(monitor).chain(rest.into_iter().filter(|&p| p != payload)).collect();
        (sum(&machinery), machinery.len(), sum(&[payload]))
    });
    sb.stop_handle().stop();
    let _ = sb.wait(sandbox::OutputOptions::default());
    let (prog_machinery, prog_procs, prog_payload) =
        program.ok_or_else(|| failed("sandboxed sleep never reached its sleep"))?;

    // The sleeping executor through the zygote (in a thread): every process the zygote
    // forked for it.
    let sleep_dir = dir.join("sleep");
    let executor = std::thread::scope(|s| {
        let h = s.spawn(|| env.run_executor(&sleep_dir, json!({"seconds": 2})));
        let found = memory::wait_for_sleeper(zpid, wait);
        let m = found.map(|(payload, all)| {
            let machinery: Vec<i32> = all.iter().copied().filter(|&p| p != payload).collect();
            (sum(&machinery), machinery.len(), sum(&[payload]))
        });
        let joined = h.join().unwrap_or_else(|_| Err(failed("executor thread panicked")));
        joined.map(|()| m)
    })?;
    let (ex_machinery, ex_procs, ex_payload) =
        executor.ok_or_else(|| failed("the sleeping executor never reached its sleep"))?;

    let agent = idle_agent(dir, op)?;
    Ok(json!({
        "method": "VmRSS of /proc/PID/status and Pss of /proc/PID/smaps_rollup; kernel memory (namespaces, page tables, cgroups) is not included",
        "zygote_idle": mem_json(zygote),
        "sandbox_program": {
            "payload": "/bin/sleep through the zygote",
            "machinery_processes": prog_procs, "machinery": mem_json(prog_machinery), "payload_mem": mem_json(prog_payload),
        },
        "sandbox_executor": {
            "payload": "a sleeping executor through the zygote",
            "machinery_processes": ex_procs, "machinery": mem_json(ex_machinery), "payload_mem": mem_json(ex_payload),
            "total": mem_json(ex_machinery + ex_payload),
        },
        "agent_idle": agent,
    }))
}

/// `opservant agent` with a minimal local-socket configuration (no executor installed, the
/// default launch), idle for a second: its memory, alone and with its own processes.
fn idle_agent(dir: &Path, op: &Path) -> Result<Value, BenchError> {
    let agent = daemon::BenchAgent::start("idle", dir, op, 0, false, crate::daemon::DEFAULT_MAX_CONCURRENT)?;
    std::thread::sleep(Duration::from_secs(1));
    let pid = agent.pid();
    let m = memory::of_process(pid).ok_or_else(|| failed("cannot read the idle agent's memory"))?;
    // The daemon's own processes (its zygote, by default) besides it.
    let helpers = memory::descendants(pid);
    let with_helpers = m + sum(&helpers);
    drop(agent);
    Ok(json!({
        "config": "local socket only, no platform, default launch",
        "rss_mib": mib(m.rss_kib), "pss_mib": mib(m.pss_kib),
        "with_children": {"processes": 1 + helpers.len(), "rss_mib": mib(with_helpers.rss_kib), "pss_mib": mib(with_helpers.pss_kib)},
    }))
}

fn row_median(report: &Value, name: &str) -> Option<f64> {
    report["rows"].as_array()?.iter().find(|r| r["name"] == name)?["summary"]["median_ms"].as_f64()
}

fn target(name: &str, goal: String, measured: Option<f64>, unit: &str, met: Option<bool>, note: &str) -> Value {
    json!({"target": name, "goal": goal, "measured": measured.map(round3), "unit": unit, "met": met, "note": note})
}

/// The issue's targets, each met (true), missed (false) or not measured (null).
fn targets(report: &Value) -> Value {
    let cold = row_median(report, "run-cold").zip(row_median(report, BWRAP_PYTHON)).map(|(c, b)| c / b);
    let zyg = row_median(report, "run-zygote");
    let pool = row_median(report, "run-pool");
    let tput = report["throughput"]["per_second"].as_f64();
    let agent = report["memory"]["agent_idle"]["rss_mib"].as_f64();
    let per_sb = report["memory"]["sandbox_executor"]["machinery"]["pss_mib"].as_f64();
    json!([
        target(
            "cold run",
            format!("run-cold median <= {TARGET_COLD_RATIO} x bwrap-python3 median"),
            cold,
            "x",
            cold.map(|r| r <= TARGET_COLD_RATIO),
            ""
        ),
        target(
            "zygote, full isolation, fresh netns",
            format!("run-zygote median <= {TARGET_ZYGOTE_MS} ms"),
            zyg,
            "ms",
            zyg.map(|m| m <= TARGET_ZYGOTE_MS),
            "every sandbox has a fresh network namespace (no egress)"
        ),
        target(
            "warm pool",
            format!("run-pool median <= {TARGET_POOL_MS} ms per execution"),
            pool,
            "ms",
            pool.map(|m| m <= TARGET_POOL_MS),
            "the sandbox was isolated before the run (untimed)"
        ),
        target(
            "throughput",
            format!(">= {TARGET_THROUGHPUT} no-op executions/s"),
            tput,
            "1/s",
            tput.map(|t| t >= TARGET_THROUGHPUT),
            ""
        ),
        target(
            "idle agent RSS",
            format!("<= {TARGET_AGENT_RSS_MIB} MiB"),
            agent,
            "MiB",
            agent.map(|m| m <= TARGET_AGENT_RSS_MIB),
            "VmRSS of the `opservant agent` process (its zygote apart, see memory.agent_idle.with_children)"
        ),
        target(
            "per-sandbox overhead",
            format!("<= {TARGET_SANDBOX_MIB} MiB"),
            per_sb,
            "MiB",
            per_sb.map(|m| m <= TARGET_SANDBOX_MIB),
            "Pss of a zygote-started executor sandbox's own processes: its init (and monitor, where it has one; the payload interpreter is reported apart)"
        ),
    ])
}

/// The human-readable report.
pub fn render_table(report: &Value) -> String {
    let mut s = String::new();
    let f = |v: &Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.3}"));
    s.push_str(&format!(
        "{:<18} {:>10} {:>10} {:>10} {:>8}  {}\n",
        "row", "median ms", "p90 ms", "p99 ms", "/ bwrap", "reference"
    ));
    for r in report["rows"].as_array().into_iter().flatten() {
        let sm = &r["summary"];
        let ratio = r["median_ratio_to_reference"].as_f64().map_or("n/a".into(), |x| format!("{x:.2}"));
        s.push_str(&format!(
            "{:<18} {:>10} {:>10} {:>10} {:>8}  {}\n",
            r["name"].as_str().unwrap_or(""),
            f(&sm["median_ms"]),
            f(&sm["p90_ms"]),
            f(&sm["p99_ms"]),
            ratio,
            r["reference"].as_str().unwrap_or("")
        ));
    }
    let uids = &report["host_uids"];
    if uids["per_sandbox"] == true {
        s.push_str(&format!(
            "sandboxes ran as a host uid of their own each (sandbox.host_uids: {} + {})\n",
            uids["first"], uids["count"]
        ));
    } else if uids["per_sandbox"] == false {
        s.push_str("sandboxes shared the identity's host uid (sandbox.host_uids: shared, or auto without a range)\n");
    }
    for sk in report["skipped"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "SKIPPED {}: {}\n",
            sk["name"].as_str().unwrap_or(""),
            sk["reason"].as_str().unwrap_or("")
        ));
    }
    let stepped: Vec<&Value> =
        report["rows"].as_array().into_iter().flatten().filter(|r| r["steps"].is_array()).collect();
    if !stepped.is_empty() {
        s.push_str("where a library run's time goes (median ms after the sample's start, each step's own median):\n");
        s.push_str(&format!("{:<18}", "row"));
        for (step, _) in crate::executor_run::TIMELINE_STEPS {
            s.push_str(&format!(" {step:>w$}", w = step.len().max(8)));
        }
        s.push('\n');
        for r in stepped {
            s.push_str(&format!("{:<18}", r["name"].as_str().unwrap_or("")));
            for (step, _) in crate::executor_run::TIMELINE_STEPS {
                let found = r["steps"].as_array().into_iter().flatten().find(|st| st["step"] == *step);
                let median = found.map_or(&Value::Null, |st| &st["median_ms"]);
                s.push_str(&format!(" {:>w$}", f(median), w = step.len().max(8)));
            }
            s.push('\n');
        }
        for (step, meaning) in crate::executor_run::TIMELINE_STEPS {
            s.push_str(&format!("  {step}: {meaning}\n"));
        }
    }
    let n = &report["netns_stash"];
    if !n.is_null() {
        s.push_str(&format!(
            "network namespace stash (zygote rows): {} made ahead, {} taken by sandboxes{}\n",
            n["made"],
            n["taken"],
            n["broken"].as_str().map(|b| format!("; stopped: {b}")).unwrap_or_default()
        ));
    }
    for (key, label, what, by) in [
        ("throughput", "throughput", "executions", "threads through one zygote"),
        ("throughput_agent", "throughput through an agent", "signed execute commands", "clients"),
    ] {
        let t = &report[key];
        if !t.is_null() {
            s.push_str(&format!(
                "{label}: {} {what} in {:.1} s by {} {by} = {:.1}/s\n",
                t["executions"],
                t["seconds"].as_f64().unwrap_or(0.0),
                t["threads"],
                t["per_second"].as_f64().unwrap_or(0.0)
            ));
        }
    }
    let m = &report["memory"];
    if !m.is_null() {
        let pair = |v: &Value| {
            format!(
                "RSS {:.2} MiB, Pss {:.2} MiB",
                v["rss_mib"].as_f64().unwrap_or(0.0),
                v["pss_mib"].as_f64().unwrap_or(0.0)
            )
        };
        s.push_str(&format!("memory: zygote idle {}\n", pair(&m["zygote_idle"])));
        s.push_str(&format!(
            "memory: executor sandbox via zygote: init (+ monitor) ({} processes) {}; payload {}\n",
            m["sandbox_executor"]["machinery_processes"],
            pair(&m["sandbox_executor"]["machinery"]),
            pair(&m["sandbox_executor"]["payload_mem"])
        ));
        s.push_str(&format!(
            "memory: /bin/sleep sandbox via zygote: init (+ monitor) ({} processes) {}; payload {}\n",
            m["sandbox_program"]["machinery_processes"],
            pair(&m["sandbox_program"]["machinery"]),
            pair(&m["sandbox_program"]["payload_mem"])
        ));
        s.push_str(&format!(
            "memory: idle opservant agent {}; with its {} child process(es) RSS {:.2} MiB, Pss {:.2} MiB\n",
            pair(&m["agent_idle"]),
            m["agent_idle"]["with_children"]["processes"].as_u64().unwrap_or(1).saturating_sub(1),
            m["agent_idle"]["with_children"]["rss_mib"].as_f64().unwrap_or(0.0),
            m["agent_idle"]["with_children"]["pss_mib"].as_f64().unwrap_or(0.0)
        ));
    }
    for t in report["targets"].as_array().into_iter().flatten() {
        let verdict = match t["met"].as_bool() {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "NOT MEASURED",
        };
        let measured =
            t["measured"].as_f64().map_or("-".into(), |x| format!("{x} {}", t["unit"].as_str().unwrap_or("")));
        s.push_str(&format!(
            "target {}: {verdict} — {} (measured {measured})\n",
            t["target"].as_str().unwrap_or(""),
            t["goal"].as_str().unwrap_or("")
        ));
    }
    s
}

/// The chart of `report`'s rows.
pub fn render_svg(report: &Value, path: &Path) -> Result<(), BenchError> {
    let rows: Vec<&Value> = report["rows"].as_array().into_iter().flatten().collect();
    let bars: Vec<chart::Bar> = rows
        .iter()
        .map(|r| chart::Bar {
            name: r["name"].as_str().unwrap_or(""),
            median_ms: r["summary"]["median_ms"].as_f64().unwrap_or(0.0),
            p90_ms: r["summary"]["p90_ms"].as_f64().unwrap_or(0.0),
            reference: r["name"] == BWRAP_TRUE || r["name"] == BWRAP_PYTHON,
        })
        .collect();
    let title = format!(
        "opservant bench: {} rounds, kernel {}, {} CPUs, {}",
        report["rounds"],
        report["kernel"].as_str().unwrap_or(""),
        report["cpus"],
        report["timestamp_utc"].as_str().unwrap_or("")
    );
    let marks = [chart::Mark { ms: TARGET_ZYGOTE_MS, label: "target: zygote run <= 2 ms" }];
    let svg = chart::render(&title, &bars, &marks)?;
    crate::whole_file::replace(path, svg.as_bytes(), 0o644).map_err(|e| failed(format!("{}: {e}", path.display())))
}

/// A seed for the rows' order: the kernel's random bytes (the time, should they fail).
fn order_seed() -> u64 {
    let mut b = [0u8; 8];
    match crate::random::fill(&mut b) {
        Ok(()) => u64::from_ne_bytes(b),
        Err(_) => SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64),
    }
}

/// The rows' order per round: xorshift64* (enough for an order; nothing secret depends on it).
struct Shuffle(u64);

impl Shuffle {
    fn new(seed: u64) -> Shuffle {
        // xorshift needs a state other than 0.
        Shuffle(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Fisher-Yates.
    fn shuffle(&mut self, v: &mut [usize]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(only: Option<&[&str]>) -> Options {
        Options {
            rounds: 1,
            warmup: 0,
            only: only.map(strings),
            threads: 1,
            duration: Duration::from_secs(1),
            timings_only: true,
        }
    }

    /// Every round is a permutation of the rows, and over the rounds each row follows each
    /// other row: no row's leftovers always land on the same neighbour.
    #[test]
    fn rounds_run_every_row_once_in_shuffled_orders() {
        let mut order = Shuffle::new(0);
        let mut v: Vec<usize> = (0..5).collect();
        let mut follows = std::collections::HashSet::new();
        for _ in 0..200 {
            order.shuffle(&mut v);
            let mut sorted = v.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..5).collect::<Vec<_>>());
            follows.extend(v.windows(2).map(|w| (w[0], w[1])));
        }
        assert_eq!(follows.len(), 5 * 4, "{follows:?}");
    }

    #[test]
    fn row_selection() {
        assert_eq!(opts(None).rows().unwrap().len(), ROWS.len());
        assert_eq!(opts(Some(&["run-zygote", "true"])).rows().unwrap(), vec!["true", "run-zygote"]);
        assert!(matches!(opts(Some(&["nope"])).rows(), Err(BenchError::Usage(_))));
        assert!(matches!(opts(Some(&["pool"])).rows(), Err(BenchError::Usage(_))));
        assert!(matches!(opts(Some(&[])).rows(), Err(BenchError::Usage(_))));
        let mut o = opts(None);
        o.rounds = 0;
        assert!(matches!(o.rows(), Err(BenchError::Usage(_))));
    }

    #[test]
    fn targets_follow_the_figures() {
        let report = json!({
            "rows": [
                {"name": "run-cold", "summary": {"median_ms": 24.0}},
                {"name": "bwrap-python3", "summary": {"median_ms": 20.0}},
                {"name": "run-zygote", "summary": {"median_ms": 3.0}},
            ],
            "throughput": {"per_second": 350.0},
            "memory": {"agent_idle": {"rss_mib": 12.0}, "sandbox_executor": {"machinery": {"pss_mib": 1.5}}},
        });
        let t = targets(&report);
        let met: Vec<Value> = t.as_array().unwrap().iter().map(|t| t["met"].clone()).collect();
        assert_eq!(met, vec![json!(true), json!(false), Value::Null, json!(true), json!(true), json!(true)]);
    }
}
