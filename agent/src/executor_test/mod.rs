//! `opservant executor test DIR|NAME`: run an executor package's own pytest suite (its
//! `tests/` directory) with the operator's pytest and opservant's Python package
//! (`opservant`, `s4e_agent`, `ExecutorTestHarness`), inside the sandbox.
//!
//! Why in the sandbox: the test files are executor-supplied code, as untrusted as the
//! executor itself, and would otherwise run as root on the host. The session is built from
//! the same steps as `opservant run` ([`AgentPolicy::spec_for`], [`interpreter_view`]): user,
//! mount, PID, network, IPC, UTS and cgroup namespaces, the executor identity
//! (`opservant-executor` or `nobody`), Landlock, seccomp and the cgroup limits — with
//! - **no network**: a private loopback only, even when the manifest declares egress;
//! - the package **read-only** at its host path (the working directory), its installed
//!   requirements (`.deps`) read-only, and the paths its manifest declares under
//!   `permissions.filesystem` (the in-process harness runs the executor there);
//! - a **scratch** `/tmp` (HOME and TMPDIR, so pytest's `tmp_path` works) sized by the
//!   manifest's `max_disk_mb`;
//! - the interpreter view plus the chosen interpreter: its executable, `pyvenv.cfg`, the
//!   entries of its `sys.path` (standard library, site-packages with pytest) and its
//!   `LIBDIR`, all read-only; none that overlaps a masked path (agent config and state,
//!   credentials) is shown;
//! - opservant's Python package, the boot script and the reporting plugin as synthetic
//!   read-only files under [`TEST_DIR`] (from this binary: no checkout needed).
//!
//! Harness runs with `sandboxed=True` would start `opservant run` inside the sandbox — an
//! unprivileged process without capabilities, under seccomp, cannot build another sandbox —
//! so the harness skips them (`pytest.skip`) with the reason in `OPSERVANT_SANDBOXED_SKIP`;
//! `OPSERVANT_BIN` is not set, so tests that guard on it skip themselves first (the shipped
//! examples' guard also gives that reason). They are counted as skipped. The alternative —
//! the whole pytest on the host as an unprivileged user — was rejected: it would give
//! executor-supplied code the host's network and every world-readable file.
//!
//! Limits: a session runs pytest and the executor many times, so it gets the agent's
//! ceilings for memory and CPU, `--timeout` (default [`DEFAULT_TIMEOUT_S`], clamped to the
//! ceiling and reported) for wall time, and the manifest's disk and pids limits.
//!
//! The interpreter: `--python PATH`, else the first `python3` on PATH that can import
//! pytest. Each candidate is probed with `python -I -c …` — which looks pytest up without
//! importing it — as the executor identity (not root), with an empty environment, bounded by
//! [`PROBE_TIMEOUT`]; this probe happens before any sandbox exists and is not part of the
//! sandbox's start, whose only process is the payload.
//!
//! Output: pytest's own output streams to stderr while it runs; stdout carries exactly one
//! result JSON line (DESIGN.md §4's fields that apply: status, error, executor, exit_code,
//! killed_by, limits, usage, sandbox; plus `tests` counts and `python`). Exit status (the
//! caller's): 0 all passed (skips allowed), 1 some failed or the session did not complete,
//! 2 could not run (bad manifest, no `tests/`, no pytest, pytest refusing its arguments).
//!
//! "No pytest" and "pytest refused its arguments" are the boot script's word, not an exit
//! status alone: it sends `no_pytest`, or `pytest_exit` once `pytest.main` has returned, on
//! the application channel. Test code that exits 121 or 4 itself is a session that ended
//! without completing (exit status 1), not one that could not run.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::audit;
use crate::executor_run::{CannotRun, Executor};
use crate::manifest::{NetworkPermissions, ResourceLimits};
use crate::policy::{interpreter_view, AgentPolicy};
use crate::result::{ExecutorRef, LimitsReport, RunResult, SandboxSummary, Status};

/// Where the session's synthetic files live inside the sandbox.
pub const TEST_DIR: &str = "/run/executor-test";
/// The directory put first on `sys.path` inside (opservant, s4e_agent, the plugin).
pub const PYTHON_DIR: &str = "/run/executor-test/python";
/// Default wall-clock limit of a whole test session, in seconds.
pub const DEFAULT_TIMEOUT_S: u64 = 600;
/// Longest an interpreter probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(30);
/// Exit status of the boot script when pytest cannot be imported inside the sandbox.
const EXIT_NO_PYTEST: i32 = 121;
/// pytest's exit status for a usage error (its arguments, ini file or plugins).
const EXIT_USAGE: i32 = 4;
/// Largest report the plugin may send.
const MAX_REPORT: usize = 64 * 1024;
/// Why `sandboxed=True` harness runs are skipped (shown by pytest).
pub const SANDBOXED_SKIP_REASON: &str = "sandboxed=True needs the opservant binary with root privileges; \
     `opservant executor test` runs the tests inside a sandbox, where no nested sandbox can be \
     built (run pytest with OPSERVANT_BIN as root to include these tests)";

/// The files of the session, from this binary (path below [`TEST_DIR`], content).
const FILES: &[(&str, &str)] = &[
    ("boot.py", include_str!("boot.py")),
    ("python/opservant_executor_test.py", include_str!("opservant_executor_test.py")),
    ("python/opservant/__init__.py", include_str!("../../python/opservant/__init__.py")),
    ("python/opservant/executor.py", include_str!("../../python/opservant/executor.py")),
    ("python/opservant/_lifecycle.py", include_str!("../../python/opservant/_lifecycle.py")),
    ("python/opservant/testing.py", include_str!("../../python/opservant/testing.py")),
    ("python/s4e_agent/__init__.py", include_str!("../../python/s4e_agent/__init__.py")),
    ("python/s4e_agent/executor.py", include_str!("../../python/s4e_agent/executor.py")),
    ("python/s4e_agent/testing.py", include_str!("../../python/s4e_agent/testing.py")),
];

/// What the probe learnt about an interpreter that can import pytest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PythonInfo {
    /// `sys.executable` (unresolved: a virtualenv's `bin/python` stays one).
    pub executable: PathBuf,
    pub version: String,
    pub pytest_version: String,
    /// `sys.prefix`.
    #[serde(skip_serializing)]
    pub prefix: PathBuf,
    /// `sys.path` under `-I`.
    #[serde(skip_serializing)]
    pub path: Vec<PathBuf>,
    /// `sysconfig.get_config_var("LIBDIR")`, when set.
    #[serde(skip_serializing)]
    pub libdir: Option<PathBuf>,
}

/// The probe's answer (pytest absent: `pytest_version` null).
#[derive(Deserialize)]
struct ProbeReply {
    executable: String,
    version: String,
    prefix: String,
    path: Vec<String>,
    libdir: Option<String>,
    pytest_version: Option<String>,
}

/// Looks pytest up (find_spec, no import) and reports the interpreter's layout.
const PROBE: &str = r#"
import importlib.util, json, sys, sysconfig
found = importlib.util.find_spec("pytest") is not None
version = None
if found:
    try:
        import importlib.metadata
        version = importlib.metadata.version("pytest")
    except Exception:
        version = "unknown"
print(json.dumps({"executable": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3],
                  "prefix": sys.prefix, "path": [p for p in sys.path if p],
                  "libdir": sysconfig.get_config_var("LIBDIR"), "pytest_version": version}))
"#;

/// How to get pytest, for the "no pytest" message.
const GET_PYTEST: &str = "install pytest for a Python 3 interpreter (Debian: apt install python3-pytest; or a \
     virtualenv: python3 -m venv /opt/pytest && /opt/pytest/bin/pip install pytest) and pass it with \
     --python PATH (e.g. --python /opt/pytest/bin/python); it must be readable by the executor user";

/// Probe `python` as `identity` (when running as root). `Err` says why it cannot be used.
pub fn probe(python: &Path, identity: sandbox::Identity) -> Result<PythonInfo, String> {
    let mut cmd = Command::new(python);
    cmd.args(["-I", "-c", PROBE])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("LANG", "C.UTF-8")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // std drops the supplementary groups (setgroups(0)) before setuid when it runs as root.
        cmd.uid(identity.host_uid).gid(identity.host_gid);
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot run it: {e}"))?;
    let reader = |r: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(r) = r {
                let _ = r.take(1 << 20).read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = reader(child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let err = reader(child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let deadline = Instant::now() + PROBE_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("did not answer within {} s", PROBE_TIMEOUT.as_secs()));
            }
            Err(e) => return Err(format!("cannot wait for it: {e}")),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    if !status.success() {
        let text = String::from_utf8_lossy(&stderr);
        let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message");
        return Err(format!("it failed as the executor user (uid {}): {last}", identity.host_uid));
    }
    let reply: ProbeReply = serde_json::from_slice(&stdout)
        .map_err(|e| format!("unexpected answer (is it a Python 3 interpreter?): {e}"))?;
    let Some(pytest_version) = reply.pytest_version else {
        return Err(format!("Python {} without pytest", reply.version));
    };
    let executable = PathBuf::from(&reply.executable);
    if !executable.is_absolute() {
        return Err(format!("sys.executable '{}' is not an absolute path", reply.executable));
    }
    Ok(PythonInfo {
        executable,
        version: reply.version,
        pytest_version,
        prefix: PathBuf::from(reply.prefix),
        path: reply.path.into_iter().map(PathBuf::from).filter(|p| p.is_absolute()).collect(),
        libdir: reply.libdir.map(PathBuf::from).filter(|p| p.is_absolute()),
    })
}

/// The interpreter to use: `--python` (a path, or a name looked up on PATH), else the first
/// `python3` on PATH that can import pytest. `Err` lists what was tried and how to get pytest.
pub fn find_python(requested: Option<&Path>, identity: sandbox::Identity) -> Result<PythonInfo, CannotRun> {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let on_path = |name: &Path| -> Vec<PathBuf> {
        std::env::split_paths(&path_var).map(|d| d.join(name)).filter(|p| p.is_file()).collect()
    };
    let candidates: Vec<PathBuf> = match requested {
        // Relative to our working directory (the probe runs in /); not resolved, so that a
        // virtualenv's bin/python stays one.
        Some(p) if p.components().count() > 1 || p.is_absolute() => {
            vec![std::env::current_dir().map(|d| d.join(p)).unwrap_or_else(|_| p.to_path_buf())]
        }
        Some(name) => on_path(name).into_iter().take(1).collect(),
        None => {
            // The same interpreter twice (e.g. /usr/bin and /bin on merged-/usr hosts) is
            // probed once.
            let mut v: Vec<PathBuf> = Vec::new();
            let mut seen: Vec<PathBuf> = Vec::new();
            for p in on_path(Path::new("python3")) {
                let real = p.canonicalize().unwrap_or_else(|_| p.clone());
                if !seen.contains(&real) {
                    seen.push(real);
                    v.push(p);
                }
            }
            v
        }
    };
    if candidates.is_empty() {
        return Err(CannotRun(match requested {
            Some(p) => format!("--python {}: not found on PATH; {GET_PYTEST}", p.display()),
            None => format!("no python3 on PATH; {GET_PYTEST}"),
        }));
    }
    let mut tried = Vec::new();
    for c in &candidates {
        match probe(c, identity) {
            Ok(info) => return Ok(info),
            Err(why) => tried.push(format!("{} ({why})", c.display())),
        }
    }
    Err(CannotRun(match requested {
        Some(_) => format!("--python {}: cannot run pytest: {}; {GET_PYTEST}", candidates[0].display(), tried.join("")),
        None => format!("no python3 on PATH can import pytest (tried {}); {GET_PYTEST}", tried.join(", ")),
    }))
}

/// Receives the session's output as it arrives (stream, bytes).
pub type Tee<'a> = &'a mut dyn FnMut(sandbox::Stream, &[u8]);

/// A request to test an executor.
pub struct TestRequest<'a> {
    pub executor: &'a Executor,
    pub python: &'a PythonInfo,
    /// `--timeout` (seconds) for the whole session.
    pub timeout_s: Option<u64>,
    /// Extra pytest arguments (after `--`).
    pub pytest_args: Vec<String>,
    pub policy: &'a AgentPolicy,
    pub launcher: sandbox::Launcher,
}

/// Outcome counts, as pytest's summary line has them.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TestCounts {
    pub passed: u64,
    pub failed: u64,
    pub skipped: u64,
    pub errors: u64,
    pub xfailed: u64,
    pub xpassed: u64,
}

/// A message of the test session on the application channel: the plugin's report, or the
/// boot script's word on how pytest ended (each at most once).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum SessionMessage {
    /// The plugin's counts, sent when pytest's session finishes.
    PytestResult {
        #[serde(flatten)]
        counts: TestCounts,
        exitstatus: i32,
        /// Ended by an interrupt or `pytest.exit()`, whose status is the caller's.
        #[serde(default)]
        interrupted: bool,
    },
    /// The boot script could not import pytest (it then exits [`EXIT_NO_PYTEST`]).
    NoPytest,
    /// `pytest.main` returned this status to the boot script.
    PytestExit { exitstatus: i32 },
    /// The plugin saw an interrupt or `pytest.exit()` (whose status is the caller's).
    PytestInterrupted,
}

/// What the session said: the plugin's report and the boot script's word.
#[derive(Debug, Default)]
struct SessionReport {
    /// The plugin's counts and pytest's exit status.
    counts: Option<(TestCounts, i32)>,
    /// The plugin saw the session ended by an interrupt or `pytest.exit()`.
    interrupted: bool,
    /// Its own message said so (at most once).
    interrupt_said: bool,
    /// The boot script could not import pytest.
    no_pytest: bool,
    /// The status `pytest.main` returned, when it did.
    pytest_exit: Option<i32>,
}

/// The result line of `opservant executor test`.
#[derive(Debug, Clone, Serialize)]
pub struct TestResult {
    /// `completed` (every test passed or was skipped), `failed` or `timeout`.
    pub status: Status,
    pub error: Option<String>,
    pub executor: ExecutorRef,
    /// `null` when pytest sent no report (it did not get that far).
    pub tests: Option<TestCounts>,
    pub python: PythonInfo,
    /// pytest's exit status (0 passed, 1 failures, 2 interrupted, 3 internal error, 4 usage
    /// error, 5 no tests collected).
    pub exit_code: Option<i32>,
    pub killed_by: Option<String>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub limits: LimitsReport,
    pub usage: sandbox::ResourceUsage,
    pub sandbox: SandboxSummary,
}

/// The package's `tests/` directory, inside the package. `Err` (exit status 2) otherwise.
pub fn tests_dir(executor: &Executor) -> Result<PathBuf, CannotRun> {
    let tests = executor.dir.join("tests");
    let real = tests.canonicalize().map_err(|e| {
        CannotRun(format!(
            "{}: no tests/ directory ({e}); an executor package keeps its pytest tests in tests/test_*.py",
            executor.dir.display()
        ))
    })?;
    if !real.is_dir() {
        return Err(CannotRun(format!("{}: not a directory", tests.display())));
    }
    if !real.starts_with(&executor.dir) {
        return Err(CannotRun(format!(
            "{}: resolves to {}, outside the executor package",
            tests.display(),
            real.display()
        )));
    }
    Ok(real)
}

/// `a` and `b` overlap: one is at or beneath the other.
fn overlaps(a: &Path, b: &Path) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// The interpreter's own files as read-only rules; entries that are `/`, under the
/// sandbox's own trees, or overlap a masked path (they would unmask it) are left out.
fn interpreter_rules(py: &PythonInfo, masked: &[PathBuf]) -> Vec<sandbox::PathRule> {
    let mut wanted: Vec<(PathBuf, bool)> = vec![(py.executable.clone(), false)];
    let cfg = py.prefix.join("pyvenv.cfg");
    if cfg.is_file() {
        wanted.push((cfg, false));
    }
    wanted.extend(py.path.iter().map(|p| (p.clone(), true)));
    if let Some(l) = py.libdir.as_ref().filter(|l| !l.starts_with("/usr")) {
        wanted.push((l.clone(), true));
    }
    let mut rules: Vec<sandbox::PathRule> = Vec::new();
    for (path, optional) in wanted {
        let reserved = ["/proc", "/dev", "/sys", "/tmp", TEST_DIR].iter().any(|r| path.starts_with(r));
        if path == Path::new("/") || reserved || masked.iter().any(|m| overlaps(&path, m)) {
            tracing::warn!(path = %path.display(), "not shown to the test session (overlaps a protected or reserved path)");
            continue;
        }
        // sys.path lists entries that may not exist (e.g. pythonNN.zip).
        if optional && std::fs::symlink_metadata(&path).is_err() {
            continue;
        }
        if !rules.iter().any(|r| r.path == path) {
            rules.push(sandbox::PathRule {
                source: None,
                path,
                access: sandbox::Access::Read,
                optional,
                identity: None,
            });
        }
    }
    rules
}

/// Run the executor's tests. `Err` means they could not run at all (exit status 2).
pub fn run(req: TestRequest, tee: Option<Tee>) -> Result<TestResult, CannotRun> {
    let ex = req.executor;
    let tests = tests_dir(ex)?;
    // The session's manifest: the executor's filesystem permissions, no network, test limits.
    let mut manifest = ex.manifest.clone();
    manifest.permissions.network = NetworkPermissions::default();
    let ceilings = req.policy.limits.ceilings;
    manifest.resource_limits = ResourceLimits {
        max_memory_mb: Some(ceilings.max_memory_mb),
        max_cpu_percent: Some(ceilings.max_cpu_percent),
        timeout_seconds: Some(req.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S)),
        max_bandwidth_mbps: None,
        ..ex.manifest.resource_limits
    };
    check_timeout(req.timeout_s)?;
    let program = req.python.executable.to_string_lossy().into_owned();
    let deps = ex.deps.as_ref().map(|d| d.to_string_lossy().into_owned()).unwrap_or_default();
    let mut args = vec![
        "-I".to_string(),
        "-B".to_string(),
        format!("{TEST_DIR}/boot.py"),
        ex.dir.to_string_lossy().into_owned(),
        tests.to_string_lossy().into_owned(),
        deps,
    ];
    args.extend(req.pytest_args.iter().cloned());
    let (mut spec, limits) = req.policy.spec_for(Some(&manifest), &program, args)?;
    interpreter_view(&mut spec);
    let rules = interpreter_rules(req.python, &spec.filesystem.masked);
    spec.filesystem.paths.extend(rules);
    spec.filesystem.paths.push(sandbox::PathRule {
        source: None,
        path: ex.dir.clone(),
        access: sandbox::Access::Read,
        optional: false,
        identity: Some(ex.dir_id),
    });
    if let Some(d) = &ex.deps {
        spec.filesystem.paths.push(sandbox::PathRule {
            source: None,
            path: d.clone(),
            access: sandbox::Access::Read,
            optional: false,
            identity: ex.deps_id,
        });
    }
    for (rel, content) in FILES {
        spec.filesystem
            .synthetic
            .push(sandbox::SyntheticFile { path: Path::new(TEST_DIR).join(rel), content: (*content).to_string() });
    }
    spec.command.app_channel = true;
    spec.command.cwd = ex.dir.clone();
    spec.command.env.extend([
        ("OPSERVANT_EXECUTOR_TEST".to_string(), "1".to_string()),
        ("OPSERVANT_SANDBOXED_SKIP".to_string(), SANDBOXED_SKIP_REASON.to_string()),
    ]);
    spec.validate()?;

    let python = req.python.executable.display().to_string();
    // Fail closed: a session whose start cannot be audited does not start.
    audit::try_record(
        "executor_test_start",
        &[("executor", &ex.manifest.name), ("version", &ex.manifest.version), ("python", &python)],
    )?;
    limits.audit_clamps(("executor", &ex.manifest.name));
    // From here on every start has its end record: how the session ended, or why it could
    // not run or finish.
    let session = || -> Result<TestResult, CannotRun> {
        let mut sb = sandbox::Sandbox::spawn(&spec, &req.launcher, None)?;
        let chan = sb.take_app_channel().ok_or_else(|| CannotRun("no application channel".into()))?;
        let unblock = chan.shutdown_handle().map_err(|e| CannotRun(format!("application channel: {}", e.desc())))?;
        let server = thread::spawn(move || serve(&chan));
        let outcome = sb.wait(sandbox::OutputOptions { tee, ..Default::default() });
        // The session's processes are gone (or abandoned): the server reads what they sent
        // and then end of file, whoever else holds the other end (see `executor_run`).
        unblock.shutdown();
        let report = server.join().map_err(|_| CannotRun("application channel server panicked".into()))?;
        assemble(&outcome?, &limits, report, &req)
    };
    let ended = session();
    let (status, killed_by, error) = match &ended {
        Ok(r) => (if r.status == Status::Completed { "completed" } else { "failed" }, r.killed_by.as_deref(), ""),
        Err(e) => ("error", None, e.0.as_str()),
    };
    audit::record(
        "executor_test_end",
        &[
            ("executor", &ex.manifest.name),
            ("status", status),
            ("killed_by", killed_by.unwrap_or("")),
            ("error", error),
        ],
    );
    ended
}

/// `--timeout` as a session takes it: none (the default) or at least one second. The CLI
/// checks it before it looks for pytest, as bad input whatever the host has.
pub fn check_timeout(timeout_s: Option<u64>) -> Result<(), CannotRun> {
    match timeout_s {
        Some(0) => Err(CannotRun("--timeout: must be at least 1 second".into())),
        _ => Ok(()),
    }
}

/// The session's messages; any message that is malformed or repeated is an error text.
fn serve(chan: &sandbox::channel::Channel) -> Result<SessionReport, String> {
    let mut report = SessionReport::default();
    let mut problem = None;
    loop {
        match chan.recv_bytes(MAX_REPORT) {
            Ok(None) => break,
            Ok(Some(bytes)) => {
                let repeated = match serde_json::from_slice::<SessionMessage>(&bytes) {
                    Ok(SessionMessage::PytestResult { counts, exitstatus, interrupted }) => {
                        report.interrupted |= interrupted;
                        report.counts.replace((counts, exitstatus)).is_some()
                    }
                    Ok(SessionMessage::NoPytest) => std::mem::replace(&mut report.no_pytest, true),
                    Ok(SessionMessage::PytestExit { exitstatus }) => report.pytest_exit.replace(exitstatus).is_some(),
                    Ok(SessionMessage::PytestInterrupted) => {
                        report.interrupted = true;
                        std::mem::replace(&mut report.interrupt_said, true)
                    }
                    Err(e) => {
                        problem.get_or_insert_with(|| format!("malformed report from the test session: {e}"));
                        false
                    }
                };
                if repeated {
                    problem.get_or_insert_with(|| "more than one report from the test session".to_string());
                }
            }
            Err(e) => {
                problem.get_or_insert(e);
                break;
            }
        }
    }
    match problem {
        Some(p) => Err(p),
        None => Ok(report),
    }
}

/// The last line of the session's stderr that is not blank, for a "could not run" message.
fn last_stderr_line(outcome: &sandbox::Outcome) -> String {
    let stderr = String::from_utf8_lossy(&outcome.stderr.bytes);
    stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message").trim().to_string()
}

/// pytest's own reason for a usage error: its last `error:` line (argparse's `pytest: error:
/// unrecognized arguments: …`, its `ERROR: file or directory not found: …`), not the
/// `rootdir:` and `inifile:` lines it prints after it.
fn usage_error_line(outcome: &sandbox::Outcome) -> String {
    let stderr = String::from_utf8_lossy(&outcome.stderr.bytes);
    stderr
        .lines()
        .rev()
        .find(|l| l.to_ascii_lowercase().contains("error:"))
        .map(|l| l.trim().to_string())
        .unwrap_or_else(|| last_stderr_line(outcome))
}

fn assemble(
    outcome: &sandbox::Outcome,
    limits: &crate::limits::EffectiveLimits,
    report: Result<SessionReport, String>,
    req: &TestRequest,
) -> Result<TestResult, CannotRun> {
    let base = RunResult::for_program(outcome, limits);
    let exit = outcome.exit.and_then(|x| x.code);
    let killed = outcome.timed_out || outcome.killed_by.is_some();
    // Could not run: the boot script said so, and the session's exit status agrees.
    if let (false, Ok(said)) = (killed, &report) {
        if said.no_pytest && exit == Some(EXIT_NO_PYTEST) {
            return Err(CannotRun(format!(
                "{}: pytest is not importable inside the sandbox: {}; {GET_PYTEST}",
                req.python.executable.display(),
                last_stderr_line(outcome)
            )));
        }
        if said.pytest_exit == Some(EXIT_USAGE) && exit == Some(EXIT_USAGE) && !said.interrupted {
            return Err(CannotRun(format!(
                "pytest refused its arguments or the tests' configuration (its usage error, exit status 4): {}; \
                 check the arguments after --",
                usage_error_line(outcome)
            )));
        }
    }
    let interrupted = report.as_ref().is_ok_and(|r| r.interrupted);
    let (tests, report_error) = match report {
        Ok(r) => (r.counts.filter(|(_, status)| Some(*status) == exit || killed).map(|(c, _)| c), None),
        Err(e) => (None, Some(e)),
    };
    let mut status = base.status;
    let error = if killed {
        base.error.clone()
    } else if let Some(e) = report_error {
        status = Status::Failed;
        Some(e)
    } else if tests.is_none() {
        status = Status::Failed;
        Some(format!(
            "the test session ended without a pytest report (exit status {}); see its output above",
            exit.map(|c| c.to_string()).unwrap_or_else(|| "unknown".into())
        ))
    } else if interrupted && exit != Some(2) {
        // `pytest.exit(returncode=0)` (or a KeyboardInterrupt a hook turned into another
        // status): the suite stopped before every test ran — not a pass.
        status = Status::Failed;
        Some(format!(
            "the test session was interrupted (pytest.exit() or a KeyboardInterrupt) before every test ran (exit status {})",
            exit.map(|c| c.to_string()).unwrap_or_else(|| "unknown".into())
        ))
    } else {
        match exit {
            Some(0) => None,
            Some(1) => {
                let t = tests.unwrap_or_default();
                Some(format!("{} failed, {} errors", t.failed, t.errors))
            }
            Some(2) => Some("pytest was interrupted (errors while collecting the tests?)".into()),
            Some(3) => Some("pytest hit an internal error".into()),
            Some(EXIT_USAGE) => Some("pytest usage error (exit status 4) after its session started".into()),
            Some(5) => Some("pytest collected no tests in tests/".into()),
            _ => base.error.clone(),
        }
    };
    if error.is_some() && status == Status::Completed {
        status = Status::Failed;
    }
    Ok(TestResult {
        status,
        error,
        executor: ExecutorRef {
            name: req.executor.manifest.name.clone(),
            version: req.executor.manifest.version.clone(),
        },
        tests,
        python: req.python.clone(),
        exit_code: exit,
        killed_by: base.killed_by,
        stdout_truncated: base.stdout_truncated,
        stderr_truncated: base.stderr_truncated,
        limits: base.limits,
        usage: base.usage,
        sandbox: base.sandbox,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(path: &[&str]) -> PythonInfo {
        PythonInfo {
            executable: "/usr/bin/python3".into(),
            version: "3.11.2".into(),
            pytest_version: "8".into(),
            prefix: "/usr".into(),
            path: path.iter().map(PathBuf::from).collect(),
            libdir: Some("/usr/lib".into()),
        }
    }

    #[test]
    fn protected_paths_stay_hidden() {
        let masked = vec![PathBuf::from("/etc/opservant"), PathBuf::from("/etc/shadow")];
        let rules =
            interpreter_rules(&info(&["/", "/etc", "/etc/opservant/py", "/proc/x", "/usr/lib/python3.11"]), &masked);
        let paths: Vec<&Path> = rules.iter().map(|r| r.path.as_path()).collect();
        assert!(paths.contains(&Path::new("/usr/lib/python3.11")), "{paths:?}");
        assert!(paths.contains(&Path::new("/usr/bin/python3")), "{paths:?}");
        for hidden in ["/", "/etc", "/etc/opservant/py", "/proc/x"] {
            assert!(!paths.contains(&Path::new(hidden)), "{hidden} shown: {paths:?}");
        }
    }

    #[test]
    fn embedded_files_are_under_the_test_dir() {
        for (rel, content) in FILES {
            assert!(!rel.starts_with('/') && !rel.contains(".."), "{rel}");
            assert!(!content.is_empty(), "{rel}");
        }
        assert!(FILES.iter().any(|(r, _)| *r == "python/opservant/testing.py"));
    }
}
