//! `opservant run`: one executor execution in a fresh sandbox, with the embedded runtime as
//! its payload, and the agent's side of the application protocol (logs, secrets, result).
//!
//! Guarantees: an invalid manifest, an entry point outside the package, an unsupported
//! action or Python requirement stop the run before any sandbox exists (exit status 2);
//! secrets are delivered only for names the manifest declares, each grant and refusal is
//! audited, and every delivered value (and every common credential pattern, see
//! [`crate::redact`]) is redacted from everything the result carries and from the log;
//! the result's status follows the lifecycle (completed/failed/partial/rejected), the
//! limits (OOM → failed + `killed_by: "oom"`; wall time → timeout), or the sandbox.

use std::path::{Path, PathBuf};
use std::thread;

use serde_json::Value;

use crate::app::{self, FromPayload, RuntimeArgs, ToPayload};
use crate::audit;
use crate::config::Config;
use crate::limits::EffectiveLimits;
use crate::manifest::Manifest;
use crate::policy::AgentPolicy;
use crate::result::{ExecutorRef, RunResult, Status};
use crate::secrets::{Provider, Redactor};

/// The interpreter embedded in this binary (major, minor, patch).
pub fn embedded_python() -> (u32, u32, u32) {
    let v: Vec<u32> = env!("OPSERVANT_EMBEDDED_PYTHON").split('.').filter_map(|p| p.parse().ok()).collect();
    (v.first().copied().unwrap_or(3), v.get(1).copied().unwrap_or(0), v.get(2).copied().unwrap_or(0))
}

/// Does `version` satisfy a PEP 440-style specifier list such as `">=3.9, <3.13"`?
pub fn python_requirement_ok(spec: &str, version: (u32, u32, u32)) -> Result<bool, String> {
    let mut ok = true;
    for clause in spec.split(',').map(str::trim).filter(|c| !c.is_empty()) {
        let op_len = clause.find(|c: char| c.is_ascii_digit()).ok_or_else(|| format!("'{clause}' has no version"))?;
        let (op, ver) = clause.split_at(op_len);
        let parts: Vec<u32> = ver
            .trim()
            .split('.')
            .map(|p| if p == "*" { Ok(u32::MAX) } else { p.parse().map_err(|_| format!("'{clause}': bad version")) })
            .collect::<Result<_, _>>()?;
        if parts.is_empty() || parts.len() > 3 {
            return Err(format!("'{clause}': bad version"));
        }
        let have = [version.0, version.1, version.2];
        // Compare only as many components as the clause names ("3.9" means 3.9.*).
        let cmp = |n: usize| -> std::cmp::Ordering {
            for i in 0..n {
                if parts[i] == u32::MAX {
                    return std::cmp::Ordering::Equal;
                }
                match have[i].cmp(&parts[i]) {
                    std::cmp::Ordering::Equal => continue,
                    o => return o,
                }
            }
            std::cmp::Ordering::Equal
        };
        let o = cmp(parts.len());
        use std::cmp::Ordering::*;
        ok &= match op.trim() {
            ">=" => o != Less,
            ">" => o == Greater,
            "<=" => o != Greater,
            "<" => o == Less,
            "==" | "" => o == Equal,
            "!=" => o != Equal,
            "~=" if parts.len() >= 2 => o != Less && cmp(parts.len() - 1) == Equal,
            other => return Err(format!("'{clause}': unsupported operator '{other}'")),
        };
    }
    Ok(ok)
}

/// Name of the runtime binary, installed beside `opservant`.
pub const RUNTIME_BINARY: &str = "opservant-runtime";

/// Where the runtime binary is: beside the running `opservant`, else `/usr/lib/opservant`.
pub fn runtime_binary() -> Result<PathBuf, CannotRun> {
    let beside = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join(RUNTIME_BINARY)));
    beside
        .into_iter()
        .chain([PathBuf::from("/usr/lib/opservant").join(RUNTIME_BINARY)])
        .find(|p| p.is_file())
        .ok_or_else(|| CannotRun(format!("{RUNTIME_BINARY} not found beside opservant or in /usr/lib/opservant")))
}

/// What goes wrong before anything runs (exit status 2).
#[derive(Debug)]
pub struct CannotRun(pub String);

/// The runtime's arguments could not be sent: its end of the channel is gone, most likely
/// because its sandbox's set-up failed — whose reason, not the broken pipe, is what the run
/// reports (a race: "runtime arguments: Broken pipe" had hidden "sandbox setup failed at
/// mounts: … not searchable" on a loaded host). The sandbox is stopped and its outcome read.
pub(crate) fn arguments_not_taken(sb: sandbox::Sandbox, e: nix::errno::Errno) -> CannotRun {
    sb.stop_handle().stop();
    match sb.wait(sandbox::OutputOptions::default()) {
        Err(setup) => CannotRun(setup.to_string()),
        Ok(_) => CannotRun(format!("runtime arguments: {}", e.desc())),
    }
}

impl<E: std::fmt::Display> From<E> for CannotRun {
    fn from(e: E) -> Self {
        CannotRun(e.to_string())
    }
}

/// A validated executor directory.
pub struct Executor {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub warnings: Vec<String>,
    /// Installed requirements (`<dir>/.deps`), when present.
    pub deps: Option<PathBuf>,
    /// The identity of `dir` as it was opened and its manifest read through it, and of
    /// `deps`: a run binds them only as long as they are these files (an executor removed
    /// and installed again at the same version meanwhile fails the run, never runs the new
    /// files under the manifest read here).
    pub dir_id: sandbox::FileId,
    pub deps_id: Option<sandbox::FileId>,
    /// `dir` and `deps` held open as long as this value lives, whether or not the in-use lock
    /// was taken: a directory removed meanwhile keeps its inode, so its number cannot be
    /// reused by a new one and pass for it.
    _held: (std::fs::File, Option<std::os::fd::OwnedFd>),
    /// A shared `flock` on `dir`, held as long as this value lives (a run holds its
    /// executor to the end): an install never removes an old version that a run still uses
    /// ([`crate::executor_install`] tries the lock exclusively, without waiting). `None`
    /// when another process held it exclusively (see [`hold_in_use`]).
    _in_use: Option<nix::fcntl::Flock<std::fs::File>>,
}

impl Executor {
    /// Load and check everything that can be checked without running it.
    pub fn load(dir: &Path) -> Result<Executor, CannotRun> {
        let dir = dir.canonicalize().map_err(|e| CannotRun(format!("{}: {e}", dir.display())))?;
        let (opened, in_use) = hold_in_use(&dir)?;
        let dir_id = opened
            .metadata()
            .map(|m| sandbox::FileId::of(&m))
            .map_err(|e| CannotRun(format!("{}: {e}", dir.display())))?;
        // Read through the directory opened (and identified) above, not its name.
        let (manifest, warnings) = Manifest::load_in(&opened, &dir)?;
        let module = manifest.entry_point.rsplit_once('.').map(|(m, _)| m).unwrap_or_default();
        let rel = PathBuf::from(module.replace('.', "/"));
        let candidates = [dir.join(&rel).with_extension("py"), dir.join(&rel).join("__init__.py")];
        let found = candidates.iter().find(|p| p.is_file());
        if let Some(real) = found.and_then(|p| p.canonicalize().ok()).filter(|r| !r.starts_with(&dir)) {
            // A symlink out of the package (e.g. to the standard library) is not "inside it".
            return Err(CannotRun(format!(
                "entry_point: module '{module}' resolves to {}, outside the executor package {}",
                real.display(),
                dir.display()
            )));
        }
        if found.is_none() {
            return Err(CannotRun(format!(
                "entry_point: module '{module}' is not in the executor package {} (looked for {}.py and {}/__init__.py)",
                dir.display(),
                rel.display(),
                rel.display()
            )));
        }
        if let Some(req) = &manifest.requirements.python {
            let v = embedded_python();
            match python_requirement_ok(req, v) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(CannotRun(format!(
                        "requirements.python: '{req}' is not satisfied by the embedded Python {}.{}.{}",
                        v.0, v.1, v.2
                    )))
                }
                Err(e) => return Err(CannotRun(format!("requirements.python: {e}"))),
            }
        }
        let deps_held = openat_dir(&opened, ".deps").map_err(|e| {
            CannotRun(format!(
                "{}/.deps: {} (installed requirements are a directory of the package's own, never a link)",
                dir.display(),
                if e == nix::errno::Errno::ENOTDIR || e == nix::errno::Errno::ELOOP {
                    "not a directory, or a symbolic link".to_string()
                } else {
                    e.desc().to_string()
                }
            ))
        })?;
        let deps_id = deps_held.as_ref().map(|(_, m)| sandbox::FileId::of(m));
        let deps = deps_id.map(|_| dir.join(".deps"));
        if !manifest.requirements.packages.is_empty() && deps.is_none() {
            return Err(CannotRun(format!(
                "requirements.packages: {} declared but not installed (expected them in {}/.deps)",
                manifest.requirements.packages.join(", "),
                dir.display()
            )));
        }
        Ok(Executor {
            warnings: warnings.iter().map(|w| w.to_string()).collect(),
            dir,
            manifest,
            deps,
            dir_id,
            deps_id,
            _held: (opened, deps_held.map(|(fd, _)| fd)),
            _in_use: in_use,
        })
    }
}

/// A shared lock on the executor directory `dir` (see [`Executor`]), tried without waiting.
/// The directory is world-readable, so any host user can open it and hold an exclusive
/// `flock` on it: waiting would let them stall every run. Held exclusively, the lock is
/// left (`None`, logged): the run goes on, unprotected only against an upgrade that
/// removes an old version meanwhile. An install that removed the directory while it was
/// being loaded is an error.
/// Returns the directory opened, and the lock.
fn hold_in_use(dir: &Path) -> Result<(std::fs::File, Option<nix::fcntl::Flock<std::fs::File>>), CannotRun> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    // A directory only, never waiting on a FIFO named as one.
    let open = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| CannotRun(format!("{}: {e}", dir.display())))?;
    // A duplicate (the same open file description): the lock lasts until the returned lock
    // is dropped, whatever happens to the directory handle.
    let for_lock = open.try_clone().map_err(|e| CannotRun(format!("{}: {e}", dir.display())))?;
    let lock = match nix::fcntl::Flock::lock(for_lock, nix::fcntl::FlockArg::LockSharedNonblock) {
        Ok(lock) => Some(lock),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            tracing::warn!(dir = %dir.display(), "the executor directory is locked by another process: run without the in-use lock");
            None
        }
        Err((_, e)) => return Err(CannotRun(format!("{}: {e}", dir.display()))),
    };
    if open.metadata().map(|m| m.nlink() == 0).unwrap_or(true) {
        return Err(CannotRun(format!("{}: removed by an install while it was being loaded", dir.display())));
    }
    Ok((open, lock))
}

/// The directory `name` in the opened directory `dir`, opened `O_PATH` without following a
/// link, and its metadata; `None` when there is none, `Err` when it is anything but a
/// directory (`ENOTDIR`: a symbolic link or a file) or cannot be opened.
#[allow(clippy::type_complexity)]
fn openat_dir(
    dir: &std::fs::File,
    name: &str,
) -> Result<Option<(std::os::fd::OwnedFd, std::fs::Metadata)>, nix::errno::Errno> {
    use nix::fcntl::OFlag;
    let fd = match nix::fcntl::openat(
        dir,
        name,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(nix::errno::Errno::ENOENT) => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = std::fs::File::from(
        fd.try_clone().map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?,
    )
    .metadata()
    .map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    Ok(Some((fd, meta)))
}

/// A request to run an executor.
pub struct RunRequest<'a> {
    pub executor: &'a Executor,
    pub params: Value,
    pub action: Option<String>,
    pub command_id: Option<String>,
    pub config: &'a Config,
    pub policy: &'a AgentPolicy,
    /// How to start the sandbox's monitor.
    pub launcher: sandbox::Launcher,
    /// The runtime binary (see [`runtime_binary`]).
    pub runtime: PathBuf,
    /// A warm pool to take the sandbox from (and refill) when it holds one for this spec.
    pub pool: Option<std::sync::Arc<crate::warm_pool::WarmPool>>,
    /// Return the result as soon as the outcome is complete and leave the sandbox's teardown
    /// (its init's and monitor's exits, its cgroups' removal) to a background thread
    /// ([`sandbox::Sandbox::teardown_in_background`]): for the daemon, which answers sooner
    /// and waits for the teardowns when it stops — never a command-line run, which exits.
    /// Runs with network egress tear down before returning (their network is unwired once
    /// the sandbox is over).
    pub background_teardown: bool,
    /// Where the run's time goes, when asked (`opservant bench`): see [`Timeline`].
    pub timeline: Option<&'a Timeline>,
}

/// The moments one run passed its steps ([`TIMELINE_STEPS`], in that order), as this
/// process saw them: what `opservant bench` reports of where a run's time goes. Reading
/// the clock is all it costs the run.
#[derive(Debug, Default)]
pub struct Timeline(std::sync::Mutex<Vec<(&'static str, std::time::Instant)>>);

impl Timeline {
    fn at(&self, step: &'static str, when: std::time::Instant) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((step, when));
    }

    /// The steps passed since the last call, each with its moment.
    pub fn take(&self) -> Vec<(&'static str, std::time::Instant)> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// A run's steps, in order, as [`Timeline`] names them, and what each one's moment is.
pub const TIMELINE_STEPS: &[(&str, &str)] = &[
    (
        "sandbox",
        "its spec built and its sandbox there: taken from the pool (view built, runtime waiting), or through \
         the zygote its namespaces made and cgroups joined (view, Landlock, seccomp and the payload's start \
         to come)",
    ),
    (
        "start_audited",
        "its executor_start record is durable (meanwhile the sandbox goes on with its set-up, or the runtime \
         reads its arguments)",
    ),
    (
        "ready",
        "the runtime's ready is read: the sandbox's set-up and the runtime's own start-up are over (answered \
         with proceed)",
    ),
    ("result", "the runtime's result is read (the executor imported and run)"),
    ("payload_exited", "init reports the payload's exit"),
    ("outcome", "the outcome is complete (the tree's usage, the output read to its end)"),
    ("complete_audited", "its executor_complete record is durable (the run returns)"),
];

/// The runtime's `result` message: status, output, error, artifacts.
type ReportedResult = (String, Option<Value>, Option<String>, Vec<Value>);

/// Log records kept per run, in bytes of their JSON (besides the `app::MAX_LOGS` count): a
/// payload's records are each up to `app::MAX_MESSAGE`, and the agent must not hold (or print)
/// an unbounded amount of them.
pub const MAX_LOG_BYTES: usize = 1024 * 1024;

/// Log records past the caps are only counted, but each is still received and looked at by
/// the agent — its CPU, not the sandbox's: a payload throttled to 10 % kept an agent core
/// busy sending 16 MiB records. A run that sends more than this many records, or bytes of
/// them, past the caps is stopped as broken (a log loop, or an attack on the agent).
pub const MAX_DROPPED_LOGS: u64 = 100_000;
pub const MAX_DROPPED_LOG_BYTES: usize = 256 * 1024 * 1024;

/// Why a run that flooded the agent with log records was stopped.
fn log_flood() -> String {
    format!(
        "log flood: more than {MAX_DROPPED_LOGS} log records or {} MiB of them past the caps ({} records, {} MiB kept); \
         the run was stopped",
        MAX_DROPPED_LOG_BYTES >> 20,
        app::MAX_LOGS,
        MAX_LOG_BYTES >> 20
    )
}

/// Everything the application channel delivered.
#[derive(Default)]
struct AppOutcome {
    result: Option<ReportedResult>,
    logs: Vec<Value>,
    logs_dropped: u64,
    /// Records the runtime did not send, past the same caps (its result says how many).
    logs_dropped_by_runtime: u64,
    /// The runtime said it began keeping records back (whether or not a result follows).
    logs_held: bool,
    /// Bytes of the messages of the records dropped, bounded by [`MAX_DROPPED_LOG_BYTES`].
    dropped_log_bytes: usize,
    /// Bytes of the records kept in `logs` (JSON), bounded by [`MAX_LOG_BYTES`].
    log_bytes: usize,
    redactor: Redactor,
    protocol_error: Option<String>,
    secrets_audit: SecretsAudit,
    /// When the runtime's `ready` and its result were read ([`Timeline`]).
    ready_at: Option<std::time::Instant>,
    /// Whether `proceed` was sent (or its sending tried): before it, the runtime imports
    /// nothing of the executor.
    proceeded: bool,
    result_at: Option<std::time::Instant>,
}

/// Secret requests refused in one run and audited: each name and reason once, for the
/// first [`MAX_AUDITED_SECRET_DENIALS`] — past that, one record says the rest are only
/// counted, so an executor asking for ever new names cannot write the audit log without
/// bound (and roll its older records away). Grants are audited once per name and run.
const MAX_AUDITED_SECRET_DENIALS: usize = 20;

/// Provider requests per run; a name not yet answered is refused past them.
const MAX_SECRET_REQUESTS: usize = 1000;

#[derive(Default)]
struct SecretsAudit {
    denied: Vec<(String, &'static str)>,
    cap_recorded: bool,
    /// Refusals neither audited nor already represented by an audited (name, reason).
    unaudited: u64,
    granted: Vec<String>,
}

impl SecretsAudit {
    /// Audit a refusal of `name` for `reason` (with `extra` fields), within the cap; with the
    /// run's `command_id`, so that concurrent runs of one executor are told apart.
    fn denied(&mut self, executor: &str, command_id: &str, name: &str, reason: &'static str, extra: &[(&str, &str)]) {
        if self.denied.iter().any(|(n, r)| n == name && *r == reason) {
            return;
        }
        let mut fields = vec![("executor", executor), ("secret", name), ("reason", reason), ("command_id", command_id)];
        fields.extend_from_slice(extra);
        let cap = MAX_AUDITED_SECRET_DENIALS.to_string();
        if self.denied.len() < MAX_AUDITED_SECRET_DENIALS {
            self.denied.push((name.to_string(), reason));
        } else if !self.cap_recorded {
            self.cap_recorded = true;
            fields.push(("further_denials_counted_only_after", &cap));
        } else {
            self.unaudited += 1;
            return;
        }
        audit::record("secret_denied", &fields);
    }
}

/// Why a run has no result.
#[derive(Debug)]
pub enum RunError {
    /// Refused, or failed before its runtime was told to proceed (its `executor_start`
    /// record not durable, its sandbox's set-up failed): nothing of the executor ran (the
    /// CLI's exit status 2; the daemon's `rejected`). A run whose start was audited has its
    /// `executor_fail` record, `status: rejected`.
    NotStarted(CannotRun),
    /// Failed after its runtime was told to proceed (its sandbox abandoned as stuck, its
    /// channel broken): the executor may have run, and its `executor_fail` record says how
    /// the run ended. Never to be reported as refused — a platform would send the command
    /// again.
    Started(CannotRun),
}

impl RunError {
    pub fn message(&self) -> &str {
        match self {
            RunError::NotStarted(e) | RunError::Started(e) => &e.0,
        }
    }

    /// The reply for a run that failed after its start ([`RunError::Started`]): `failed`, with
    /// the error and what ran; `None` for one that never started.
    pub fn failed_reply(&self, executor: &Executor, action: Option<&str>, command_id: Option<&str>) -> Option<Value> {
        match self {
            RunError::NotStarted(_) => None,
            RunError::Started(e) => Some(serde_json::json!({
                "status": "failed",
                "command_id": command_id,
                "executor": {"name": executor.manifest.name, "version": executor.manifest.version},
                "action": action,
                "error": e.0,
            })),
        }
    }
}

/// Run one executor.
pub fn run(req: RunRequest) -> Result<RunResult, RunError> {
    let mut may_have_run = false;
    run_steps(req, &mut may_have_run).map_err(
        |e| {
            if may_have_run {
                RunError::Started(e)
            } else {
                RunError::NotStarted(e)
            }
        },
    )
}

/// [`run`]'s steps; `may_have_run` is set once the runtime may have been told to proceed
/// (the executor's code is imported only after that).
fn run_steps(req: RunRequest, may_have_run: &mut bool) -> Result<RunResult, CannotRun> {
    let m = &req.executor.manifest;
    if let Some(a) = &req.action {
        if !m.supported_actions.iter().any(|s| s == a) {
            return Err(CannotRun(format!(
                "--action {a}: not in the executor's supported_actions ({})",
                // At most the first ten: a manifest may list thousands (a 789 KB line).
                match m.supported_actions.len() {
                    n if n > 10 => format!("{}, … {} more", m.supported_actions[..10].join(", "), n - 10),
                    _ => m.supported_actions.join(", "),
                }
            )));
        }
    }
    if !req.params.is_object() {
        return Err(CannotRun("--params: must be a JSON object".into()));
    }
    let (mut spec, limits) = executor_spec(&req)?;
    let dir = req.executor.dir.to_string_lossy().into_owned();
    let args = RuntimeArgs::Executor {
        package_dir: dir,
        entry_point: m.entry_point.clone(),
        paths: req.executor.deps.iter().map(|d| d.to_string_lossy().into_owned()).collect(),
        params: req.params.clone(),
        agent_id: req.config.agent_id(),
        action: req.action.clone(),
        command_id: req.command_id.clone(),
        config: req.config.public_view(),
        proceed: true,
        log_caps: true,
    };
    spec.validate()?;
    let args = crate::app::encode_args(&args);
    if args.len() > crate::app::MAX_MESSAGE {
        return Err(CannotRun(format!(
            "parameters: the run's arguments take {} bytes, more than the {} a run accepts",
            args.len(),
            crate::app::MAX_MESSAGE
        )));
    }
    // Fail early on an unusable secrets file, but read the values only once the sandbox
    // processes exist, so no copy of them is forked into the sandbox's monitor or init.
    Provider::check_config(req.config).map_err(CannotRun)?;

    // Network egress: a slot reserved now (the sandbox's resolv.conf names its gateway),
    // wired from the namespace hook, before anything of the executor runs.
    let net_policy =
        crate::egress::NetworkPolicy::from_manifest(&m.permissions.network, req.config, limits.max_bandwidth_mbps)?;
    // The secret values delivered, as they are, for the DNS forwarder's live audit records.
    let live_redactor = crate::secrets::LiveRedactor::default();
    let mut net = match &net_policy {
        None => None,
        Some(np) => Some(crate::egress::EgressRun::prepare(np, req.config, &mut spec, live_redactor.clone())?),
    };
    let mut hook = |monitor: &sandbox::MonitorProc<'_>| -> Result<(), String> {
        match net.as_mut() {
            Some(n) => n.attach(monitor, &m.name, req.command_id.as_deref().unwrap_or("")),
            None => Ok(()),
        }
    };
    // The pool only for runs without egress (their network is wired per run, by the hook).
    let pool = req.pool.as_ref().filter(|_| net_policy.is_none());
    let mut sb = match pool.and_then(|p| p.take(&spec)) {
        Some(sb) => sb,
        None => crate::launch::spawn_with_fallback(&spec, &req.launcher, Some(&mut hook))?,
    };
    let mark = |step: &'static str, when: Option<std::time::Instant>| {
        if let (Some(t), Some(when)) = (req.timeline, when) {
            t.at(step, when);
        }
    };
    mark("sandbox", Some(std::time::Instant::now()));
    // The pool learns from the run (see `warm_pool`): its refill starts when this is dropped
    // — the run has its outcome, or ended early — or after `warm_pool::REFILL_DELAY`. Not at
    // once: the refill's start of a sandbox through the zygote, milliseconds of CPU, would
    // compete with the run it replaces (about 1 ms per pooled daemon command on 2 CPUs,
    // benches/README item 23).
    let _refill = pool.map(|p| p.refill_after(spec.clone()));
    if req.background_teardown && net.is_none() {
        sb.teardown_in_background();
    }
    // The arguments go out first, so the payload's runtime reads them and builds the run's
    // context while the start record below is made durable (its `fdatasync` is most of an
    // audit append). Nothing of the executor runs before the agent answers the runtime's
    // `ready` with `proceed`, and the channel server that answers it starts only once the
    // start is audited: a run whose start cannot be audited never runs executor code
    // (dropping `sb` kills the sandbox, its payload still waiting for `proceed`).
    let app_chan = sb.take_app_channel().ok_or_else(|| CannotRun("no application channel".into()))?;
    if let Err(e) = app_chan.send_bytes(&args) {
        return Err(arguments_not_taken(sb, e));
    }
    let provider = Provider::from_config(req.config).map_err(CannotRun)?;
    // Audited only now: a run refused before this point (exit status 2) never started.
    limits.audit_clamps(("executor", &m.name));
    let command_id = req.command_id.clone().unwrap_or_default();
    // The package directory too: a name and version alone do not tell an installed
    // executor from a copy of it run from elsewhere under the same manifest name.
    let package = std::path::absolute(&req.executor.dir).unwrap_or_else(|_| req.executor.dir.clone());
    audit::try_record(
        "executor_start",
        &[
            ("executor", &m.name),
            ("version", &m.version),
            ("action", req.action.as_deref().unwrap_or("")),
            ("command_id", &command_id),
            ("package", &package.to_string_lossy()),
        ],
    )?;
    mark("start_audited", Some(std::time::Instant::now()));
    // From here on, a run that cannot finish is audited as failed (or, if its runtime was
    // never told to proceed, as not run): every start has an end.
    let started = || -> Result<RunResult, CannotRun> {
        let declared: Vec<String> = m.permissions.secrets.clone();
        let executor_name = m.name.clone();
        let cpu = sb.cpu_limiter();
        let cpu_limiter = cpu.clone();
        let cid = command_id.clone();
        let unblock =
            app_chan.shutdown_handle().map_err(|e| CannotRun(format!("application channel: {}", e.desc())))?;
        let live = live_redactor.clone();
        let stop = sb.stop_handle();
        let server =
            thread::spawn(move || serve(app_chan, &declared, &provider, &executor_name, &cid, &cpu, &live, &stop));
        let outcome = sb.wait(sandbox::OutputOptions::default());
        let waited = std::time::Instant::now();
        // Every process of the sandbox is gone now (or abandoned, stuck): what they sent is
        // queued, and the server reads it to the end and then end of file. The channel's
        // other end need not be closed yet — a payload may have passed it to a process of
        // another sandbox (SCM_RIGHTS through a shared write grant), which could hold this
        // run, its slot and the agent's drain for as long as it lives, and write into it.
        unblock.shutdown();
        let Ok(app) = server.join() else {
            *may_have_run = true;
            return Err(CannotRun("application channel server panicked".into()));
        };
        *may_have_run |= app.proceeded;
        if app.secrets_audit.unaudited > 0 {
            tracing::warn!(
                executor = %m.name,
                command_id = %command_id,
                unaudited = app.secrets_audit.unaudited,
                "secret requests refused past the audit cap (counted only)"
            );
        }
        // A sandbox abandoned with processes stuck in the kernel after the executor's result
        // came: the result stands (the executor's work is done), the abandon said beside it.
        // Without a result the run fails with the reason, as before.
        let mut abandoned = None;
        let outcome = match outcome {
            Err(sandbox::SandboxError::Abandoned { reason, outcome }) if app.result.is_some() => {
                abandoned = Some(reason);
                *outcome
            }
            other => other?,
        };
        mark("ready", app.ready_at);
        mark("result", app.result_at);
        mark("payload_exited", outcome.payload_exited_at);
        mark("outcome", Some(waited));
        // For what is added to the result after it was assembled (and redacted).
        let redactor = app.redactor.clone();
        let mut result = assemble(&outcome, &limits, app, req.executor, req.action.clone(), req.command_id.clone());
        if let Some(why) = abandoned {
            audit::record("sandbox_abandoned", &[("executor", &m.name), ("command_id", &command_id), ("reason", &why)]);
            result.logs.push(serde_json::json!({
                "level": "error",
                "msg": format!("the sandbox was abandoned after the executor's result: {why}"),
                "fields": {},
            }));
            result.sandbox.abandoned = Some(why);
        }
        // A deferred quota is applied by the channel server on the payload's `ready`, before it
        // answers `proceed`; or by the sandbox a second after the start, should `ready` never
        // come. Either way it is counted as enforced.
        result.limits.enforced.cpu |= cpu_limiter.enforced();
        if let Some(n) = net.take() {
            n.finish(&mut result, &m.name, &redactor);
            // The refused names are the payload's queries: a secret can be one.
            if let Some(egress) = result.sandbox.egress.as_mut() {
                *egress = redactor.json(egress);
            }
        }
        drop(redactor);
        let killed_by = result.killed_by.as_deref().unwrap_or("");
        if matches!(killed_by, "oom" | "timeout" | "pids") {
            audit::record(
                "limit_enforced",
                &[("executor", &m.name), ("limit", killed_by), ("command_id", &command_id)],
            );
        }
        audit::record(
            match result.status {
                Status::Completed => "executor_complete",
                _ => "executor_fail",
            },
            &[
                ("executor", &m.name),
                ("status", result.status.as_str()),
                ("killed_by", killed_by),
                ("command_id", &command_id),
            ],
        );
        mark("complete_audited", Some(std::time::Instant::now()));
        Ok(result)
    };
    let finished = started();
    if let Err(e) = &finished {
        audit::record(
            "executor_fail",
            &[
                ("executor", &m.name),
                ("status", if *may_have_run { "error" } else { "rejected" }),
                ("killed_by", ""),
                ("command_id", &command_id),
                ("error", &e.0),
            ],
        );
    }
    finished
}

/// The sandbox spec of an executor run (before egress adds its part).
fn executor_spec(req: &RunRequest) -> Result<(sandbox::SandboxSpec, crate::limits::EffectiveLimits), CannotRun> {
    let runtime = req.runtime.to_string_lossy().into_owned();
    let (mut spec, limits) = req.policy.spec_for(Some(&req.executor.manifest), &runtime, vec![])?;
    crate::policy::runtime_payload(&mut spec, &req.runtime);
    crate::policy::interpreter_view(&mut spec);
    spec.filesystem.paths.push(sandbox::PathRule {
        source: None,
        path: req.executor.dir.clone(),
        access: sandbox::Access::Read,
        optional: false,
        identity: Some(req.executor.dir_id),
    });
    if let Some(d) = &req.executor.deps {
        spec.filesystem.paths.push(sandbox::PathRule {
            source: None,
            path: d.clone(),
            access: sandbox::Access::Read,
            optional: false,
            identity: req.executor.deps_id,
        });
    }
    Ok((spec, limits))
}

/// Start, in `req.pool`, a sandbox for exactly the run `req` describes (so that the run
/// takes it). Runs with network egress do not use the pool.
pub fn warm(req: &RunRequest) -> Result<(), CannotRun> {
    let Some((pool, spec)) = pooled_spec(req)? else { return Ok(()) };
    pool.fill(spec).map_err(|e| CannotRun(e.to_string()))
}

/// As [`warm`], in the background (a refill of `req.pool`). The daemon pre-warms its pool
/// with it at start.
pub fn prewarm(req: &RunRequest) -> Result<(), CannotRun> {
    let Some((pool, spec)) = pooled_spec(req)? else { return Ok(()) };
    pool.refill(spec);
    Ok(())
}

/// The pool and the validated spec of a pooled sandbox for `req`; `None` without a pool.
fn pooled_spec<'a>(
    req: &'a RunRequest,
) -> Result<Option<(&'a std::sync::Arc<crate::warm_pool::WarmPool>, sandbox::SandboxSpec)>, CannotRun> {
    let Some(pool) = req.pool.as_ref() else { return Ok(None) };
    if req.executor.manifest.permissions.network.outbound {
        return Err(CannotRun("runs with network egress do not use the warm pool".into()));
    }
    let (spec, _) = executor_spec(req)?;
    spec.validate()?;
    Ok(Some((pool, spec)))
}

/// Provider errors on one name within a run before it is no longer asked (each a request,
/// with Vault after a 403 a fresh login and token).
const MAX_PROVIDER_ERRORS_PER_NAME: u32 = 3;

/// Serve the application channel until end-of-file, or until the payload breaks the
/// protocol: the channel is then shut down (nothing more of it is read or parsed), the
/// sandbox stopped (`stop`), and the run fails with the error, whatever result came before.
#[allow(clippy::too_many_arguments)]
fn serve(
    chan: sandbox::channel::Channel,
    declared: &[String],
    provider: &Provider,
    executor: &str,
    command_id: &str,
    cpu: &sandbox::CpuLimiter,
    live: &crate::secrets::LiveRedactor,
    stop: &sandbox::StopHandle,
) -> AppOutcome {
    let broken = |mut out: AppOutcome, error: String| {
        out.protocol_error = Some(error);
        chan.shutdown();
        stop.stop();
        out
    };
    // What the run can reach before any secret is delivered (a proxy's credentials in its
    // environment) is redacted from the start.
    let mut out = AppOutcome { redactor: live.snapshot(), ..AppOutcome::default() };
    let mut ready = false;
    // What the provider answered this run, per declared name: a value delivered (wiped at
    // the run's end), or that it has none. A loop on a name asks the provider once; only its
    // errors are asked again (a transient one may pass), up to MAX_PROVIDER_ERRORS_PER_NAME
    // times a name and MAX_SECRET_REQUESTS provider calls a run — each a request, with Vault
    // after a 403 a fresh login and token.
    let mut answered: std::collections::HashMap<String, Option<zeroize::Zeroizing<String>>> =
        std::collections::HashMap::new();
    let mut provider_calls = 0usize;
    // Why a reply could not be sent, for a run that then ends without a result.
    let mut unsent: Option<String> = None;
    let mut errors: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    loop {
        let bytes = match app::recv_raw_by(&chan, None) {
            Ok(Some(bytes)) => bytes,
            // End of file: the payload is gone. A reply it never got and no result after it
            // say why the run has none.
            Ok(None) => {
                if out.result.is_none() && out.protocol_error.is_none() {
                    out.protocol_error = unsent.take();
                }
                return out;
            }
            // A channel error the payload's end gave (the reset of a payload gone with a
            // reply of ours unread is read past, `Channel::recv_bytes_by`): nothing to stop.
            // After its result, an end like any other; before it, what the run's end reports.
            Err(e) if e.starts_with("recv: ") => {
                if out.result.is_none() {
                    out.protocol_error = Some(e);
                }
                return out;
            }
            Err(e) => return broken(out, e),
        };
        // Past the cap a log record is only counted: not built, only told from its type.
        if (out.logs.len() >= app::MAX_LOGS || out.log_bytes >= MAX_LOG_BYTES) && app::is_log(&bytes) {
            out.logs_dropped += 1;
            out.dropped_log_bytes = out.dropped_log_bytes.saturating_add(bytes.len());
            if out.logs_dropped > MAX_DROPPED_LOGS || out.dropped_log_bytes > MAX_DROPPED_LOG_BYTES {
                return broken(out, log_flood());
            }
            continue;
        }
        let msg = match app::parse(&bytes) {
            Ok(msg) => msg,
            Err(e) => return broken(out, e),
        };
        drop(bytes);
        match msg {
            FromPayload::Log { level, msg, fields } => {
                let record = serde_json::json!({"level": level, "msg": msg, "fields": fields});
                let size = record.to_string().len();
                if out.logs.len() >= app::MAX_LOGS || out.log_bytes + size > MAX_LOG_BYTES {
                    out.logs_dropped += 1;
                    out.dropped_log_bytes = out.dropped_log_bytes.saturating_add(size);
                    if out.logs_dropped > MAX_DROPPED_LOGS || out.dropped_log_bytes > MAX_DROPPED_LOG_BYTES {
                        return broken(out, log_flood());
                    }
                    continue;
                }
                out.log_bytes += size;
                // Into the agent's own log: secrets delivered so far redacted, and escaped so
                // a record cannot forge lines (audit events) of the agent's log.
                let fields_text = out.redactor.json(&record["fields"]).to_string();
                let msg = out.redactor.text(&msg);
                let level = out.redactor.text(&level);
                tracing::info!(target: "opservant::executor", executor, command_id, level = %level.escape_debug(), fields = %fields_text, "{}", msg.escape_debug());
                out.logs.push(record);
            }
            FromPayload::SecretRequest { name } => {
                let mut reply = if !declared.iter().any(|d| d == &name) {
                    // The name is the payload's text: a value it obtained, passed as a name by
                    // mistake or on purpose, must not reach the audit log.
                    out.secrets_audit.denied(executor, command_id, &out.redactor.text(&name), "not declared", &[]);
                    ToPayload::SecretDenied {
                        reason: format!("secret '{name}' is not declared in permissions.secrets"),
                    }
                } else if !answered.contains_key(&name) && provider_calls >= MAX_SECRET_REQUESTS {
                    out.secrets_audit.denied(executor, command_id, &name, "request cap", &[]);
                    ToPayload::SecretDenied {
                        reason: format!(
                            "secret '{name}' refused: {MAX_SECRET_REQUESTS} provider requests made in this run"
                        ),
                    }
                } else if !answered.contains_key(&name)
                    && errors.get(&name).is_some_and(|n| *n >= MAX_PROVIDER_ERRORS_PER_NAME)
                {
                    out.secrets_audit.denied(executor, command_id, &name, "provider error", &[]);
                    ToPayload::SecretDenied {
                        reason: format!(
                            "secret '{name}' could not be read from the configured provider ({MAX_PROVIDER_ERRORS_PER_NAME} tries in this run)"
                        ),
                    }
                } else {
                    let got = match answered.get(&name) {
                        Some(Some(value)) => Ok(Some(value.clone())),
                        Some(None) => Ok(None),
                        None => {
                            provider_calls += 1;
                            let got = provider.get(&name);
                            match &got {
                                Ok(v) => {
                                    answered.insert(name.clone(), v.clone());
                                }
                                Err(_) => *errors.entry(name.clone()).or_default() += 1,
                            }
                            got
                        }
                    };
                    match got {
                        Ok(Some(value)) => {
                            let fields =
                                [("executor", executor), ("secret", name.as_str()), ("command_id", command_id)];
                            // A grant that cannot be audited is refused (fail closed); a
                            // name granted before in this run was audited then.
                            let audited = if out.secrets_audit.granted.contains(&name) {
                                Ok(())
                            } else {
                                audit::try_record("secret_access", &fields)
                            };
                            match audited {
                                Ok(()) => {
                                    if !out.secrets_audit.granted.contains(&name) {
                                        out.secrets_audit.granted.push(name.clone());
                                    }
                                    out.redactor.add(&value);
                                    live.add(&value);
                                    ToPayload::Secret { value: value.to_string() }
                                }
                                Err(e) => {
                                    tracing::error!(executor, secret = %name, "secret refused: {e}");
                                    ToPayload::SecretDenied {
                                        reason: format!("secret '{name}' refused: its access could not be audited"),
                                    }
                                }
                            }
                        }
                        Ok(None) => {
                            out.secrets_audit.denied(executor, command_id, &name, "unknown", &[]);
                            ToPayload::SecretDenied {
                                reason: format!("secret '{name}' is not available from the configured provider"),
                            }
                        }
                        Err(e) => {
                            // Provider errors never carry values, tokens or credentials.
                            tracing::error!(executor, secret = %name, "{e}");
                            out.secrets_audit.denied(executor, command_id, &name, "provider error", &[("detail", &e)]);
                            ToPayload::SecretDenied {
                                reason: format!("secret '{name}' could not be read from the configured provider"),
                            }
                        }
                    }
                };
                // The encoded message and the reply's own copy of the value are wiped once
                // sent (not the channel's framing buffer, nor what the provider's HTTP client
                // or serde reallocated: README, Not done yet).
                let bytes = zeroize::Zeroizing::new(app::encode(&reply));
                if let ToPayload::Secret { value } = &mut reply {
                    zeroize::Zeroize::zeroize(value);
                }
                // A reply that cannot be sent: the payload is gone (or its end of the channel
                // is). What it sent before it went is still to be read — its result among
                // it — and then end of file; without a result, this says why.
                if let Err(e) = chan.send_bytes(&bytes) {
                    tracing::warn!(executor, command_id, "a reply to the runtime could not be sent: {}", e.desc());
                    unsent.get_or_insert_with(|| format!("a reply to the runtime could not be sent: {}", e.desc()));
                }
            }
            // Answered once; a second `ready` (written by executor code) is a protocol error.
            FromPayload::Ready if !ready => {
                ready = true;
                out.ready_at = Some(std::time::Instant::now());
                out.proceeded = true;
                // A failed write stops the sandbox (fail closed); the payload, waiting for
                // the answer, then never reaches executor code.
                if app::proceed(&chan, cpu).is_err() {
                    return out;
                }
            }
            // Its first message, before any executor code had the channel (see `app::BUILD`).
            FromPayload::WrongBuild { build } if !ready => return broken(out, app::wrong_build_error(&build)),
            FromPayload::Result { .. } if out.result.is_some() => return broken(out, "a second result".into()),
            FromPayload::LogsHeld => out.logs_held = true,
            FromPayload::Result { status, output, error, artifacts, logs_dropped } => {
                out.logs_dropped_by_runtime = logs_dropped;
                out.result = Some((status, output, error, artifacts));
                out.result_at = Some(std::time::Instant::now());
            }
            other => return broken(out, format!("unexpected {} message for an executor run", other.kind())),
        }
    }
}

fn assemble(
    outcome: &sandbox::Outcome,
    limits: &EffectiveLimits,
    app: AppOutcome,
    executor: &Executor,
    action: Option<String>,
    command_id: Option<String>,
) -> RunResult {
    let mut r = RunResult::for_program(outcome, limits);
    r.executor = Some(ExecutorRef { name: executor.manifest.name.clone(), version: executor.manifest.version.clone() });
    r.action = action;
    r.command_id = command_id;
    r.logs = app.logs;
    let dropped = app.logs_dropped.saturating_add(app.logs_dropped_by_runtime);
    if dropped > 0 {
        r.logs.push(serde_json::json!({"level": "warning", "msg": format!("{dropped} more log records dropped (cap {} records, {} bytes)", app::MAX_LOGS, MAX_LOG_BYTES), "fields": {}}));
    } else if app.logs_held {
        r.logs.push(serde_json::json!({"level": "warning", "msg": format!("more log records dropped (cap {} records, {} bytes; how many is unknown: the run ended without its result)", app::MAX_LOGS, MAX_LOG_BYTES), "fields": {}}));
    }
    // The sandbox's verdict comes first: a timeout or an OOM kill is what happened, whatever
    // the runtime said before.
    // A limit's kill is what happened; a stop that came after the payload broke the protocol
    // (see `serve`) is not: the broken protocol is.
    let stopped_for_protocol =
        app.protocol_error.is_some() && outcome.stopped && !matches!(outcome.killed_by, Some(sandbox::KilledBy::Oom));
    // (A sandbox ended from outside is a kill too, whether or not its signal is known; it is
    // never one this process stopped.)
    if outcome.timed_out
        || (outcome.killed_by.is_some() && !stopped_for_protocol)
        || outcome.ended_from_outside.is_some()
    {
        r.output = Value::Object(Default::default());
    } else if let Some(e) = &app.protocol_error {
        // A channel that broke the protocol, before or after a result (a second result, a
        // second `ready`, a malformed message: executor code writing to it), is not the
        // runtime's report: whatever result came is not taken for one.
        if stopped_for_protocol {
            // Killed by that stop, not by a limit or a signal of its own.
            r.killed_by = None;
        }
        r.status = Status::Failed;
        r.output = Value::Null;
        r.error = Some(app::misbehaved("executor", e));
    } else if let Some((status, output, error, artifacts)) = app.result {
        let status = match status.as_str() {
            "completed" => Status::Completed,
            "failed" => Status::Failed,
            "partial" => Status::Partial,
            "rejected" => Status::Rejected,
            _ => {
                r.status = Status::Failed;
                r.error = Some(format!("the runtime reported an unknown status '{status}'"));
                return finish(r, &app.redactor);
            }
        };
        r.status = status;
        // What the payload sent is untrusted: the runtime's caps are checked again here
        // (executor code can write its own result message to the channel).
        // Redacted before it is cut: a secret the cut would split is still whole here.
        r.error = error.map(|e| app.redactor.text_capped(&e, app::MAX_ERROR));
        let output_size = output.as_ref().map_or(0, |o| serde_json::to_vec(o).map_or(usize::MAX, |v| v.len()));
        if output_size > app::MAX_OUTPUT {
            r.status = Status::Failed;
            r.error = Some(format!("output is {output_size} bytes of JSON, over the {} byte cap", app::MAX_OUTPUT));
            r.output = Value::Null;
            return finish(r, &app.redactor);
        }
        r.output = match (status, output) {
            // An unhandled exception or a refusal has no output; a failure the executor
            // returned keeps the partial results it chose to report (seed 000).
            (Status::Rejected, _) | (Status::Failed, None | Some(Value::Null)) => Value::Null,
            (_, Some(Value::Object(o))) => Value::Object(o),
            (_, None | Some(Value::Null)) => Value::Object(Default::default()),
            (_, Some(other)) => {
                r.status = Status::Failed;
                r.error = Some(format!("output must be a JSON object, got {}", kind(&other)));
                Value::Null
            }
        };
        r.artifacts = checked_artifacts(artifacts, &app.redactor)
            .into_iter()
            .map(|a| {
                let content = a.get("content_base64").and_then(Value::as_str).unwrap_or("");
                if !app.redactor.is_empty() && !content.is_empty() {
                    use base64::Engine;
                    let raw = base64::engine::general_purpose::STANDARD.decode(content).unwrap_or_default();
                    if app.redactor.contains_secret(&raw) {
                        return serde_json::json!({"path": a.get("path"), "error": "withheld: the artifact contains a secret value"});
                    }
                }
                a
            })
            .collect();
    } else {
        r.status = Status::Failed;
        r.output = Value::Null;
        r.error = Some(match (&app.protocol_error, outcome.exit) {
            (Some(e), _) => app::misbehaved("executor", e),
            (None, Some(x)) if x.code == Some(70) => {
                let stderr = String::from_utf8_lossy(&outcome.stderr.bytes);
                let line = stderr.lines().last().unwrap_or("see stderr");
                // Before `ready` only the runtime's own code wrote that line (see
                // `app::could_not_start`); after it, executor code may have.
                match app.ready_at {
                    None => app::could_not_start("executor", line),
                    Some(_) => format!("the executor runtime could not start: {line}"),
                }
            }
            (None, Some(x)) => format!("the executor runtime ended without a result (exit status {})", x.shell_code()),
            (None, None) => "the executor runtime ended without a result".to_string(),
        });
    }
    finish(r, &app.redactor)
}

/// The artifact entries a payload reported, as the agent passes them on: each either
/// `{path, size, sha256, content_base64}` — size and digest computed here from the content,
/// within the per-file and per-run caps — or `{path, error}`; at most
/// [`app::MAX_ARTIFACT_ENTRIES`]. Anything else (executor code can write its own result
/// message) becomes an error entry.
fn checked_artifacts(reported: Vec<Value>, redactor: &Redactor) -> Vec<Value> {
    use base64::Engine;
    use sha2::Digest;
    const MAX_TEXT: usize = 4096;
    let mut total: u64 = 0;
    let mut out = Vec::new();
    let count = reported.len();
    for a in reported.into_iter().take(app::MAX_ARTIFACT_ENTRIES) {
        // Redacted before they are cut (a cut secret would no longer be found).
        let path = a.get("path").and_then(Value::as_str).map(|p| redactor.text_capped(p, MAX_TEXT));
        let refused = |path: Option<String>, why: &str| serde_json::json!({"path": path, "error": why});
        let Some(path) = path else {
            out.push(refused(None, "refused: an artifact entry without a path"));
            continue;
        };
        if let Some(e) = a.get("error") {
            let e = e.as_str().map_or_else(|| "refused: an error that is not a string".to_string(), str::to_string);
            out.push(refused(Some(path), &redactor.text_capped(&e, MAX_TEXT)));
            continue;
        }
        if path.is_empty() || path.contains('\0') || path.starts_with('/') || path.split('/').any(|c| c == "..") {
            out.push(refused(Some(path), "refused: not a path beneath the scratch directory"));
            continue;
        }
        // (The text passed on is the one given: it decoded, so it is the content's encoding.)
        let Some((encoded, content)) = a.get("content_base64").and_then(Value::as_str).and_then(|c| {
            base64::engine::general_purpose::STANDARD.decode(c).ok().map(|content| (c.to_string(), content))
        }) else {
            out.push(refused(Some(path), "refused: no valid content"));
            continue;
        };
        let size = content.len() as u64;
        if size > app::MAX_ARTIFACT {
            out.push(refused(
                Some(path),
                &format!("{size} bytes, over the {} byte cap per artifact", app::MAX_ARTIFACT),
            ));
            continue;
        }
        total += size;
        if total > app::MAX_ARTIFACTS_TOTAL {
            out.push(refused(Some(path), &format!("the run's artifacts exceed {} bytes", app::MAX_ARTIFACTS_TOTAL)));
            continue;
        }
        let sha256: String = sha2::Sha256::digest(&content).iter().map(|b| format!("{b:02x}")).collect();
        out.push(serde_json::json!({
            "path": path,
            "size": size,
            "sha256": sha256,
            "content_base64": encoded,
        }));
    }
    if count > app::MAX_ARTIFACT_ENTRIES {
        out.push(serde_json::json!({"path": null, "error": format!("{} more artifact entries dropped (cap {})", count - app::MAX_ARTIFACT_ENTRIES, app::MAX_ARTIFACT_ENTRIES)}));
    }
    out
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Redact every delivered secret, and every common credential pattern, from everything the
/// result carries.
fn finish(mut r: RunResult, redactor: &Redactor) -> RunResult {
    r.stdout = if r.stdout_truncated { redactor.text_cut(&r.stdout) } else { redactor.text(&r.stdout) };
    r.stderr = if r.stderr_truncated { redactor.text_cut(&r.stderr) } else { redactor.text(&r.stderr) };
    // An error can quote the end of (cut) stderr.
    r.error = r.error.map(|e| if r.stderr_truncated { redactor.text_cut(&e) } else { redactor.text(&e) });
    r.output = redactor.json(&r.output);
    r.logs = r.logs.iter().map(|l| redactor.json(l)).collect();
    // An artifact's path and error are text the executor chose (its content, when it holds
    // a secret, is withheld in `assemble`).
    for a in &mut r.artifacts {
        for key in ["path", "error"] {
            if let Some(Value::String(text)) = a.get_mut(key) {
                *text = redactor.text(text);
            }
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_specifiers() {
        let v = (3, 11, 2);
        for (spec, want) in [
            (">=3.9", true),
            (">=3.12", false),
            ("<3.11", false),
            ("<=3.11", true),
            ("==3.11", true),
            ("==3.11.2", true),
            ("==3.11.3", false),
            ("!=3.11", false),
            ("~=3.10", true),
            ("~=3.11.1", true),
            ("~=3.12.0", false),
            (">=3.8, <3.13", true),
            ("==3.*", true),
            ("", true),
        ] {
            assert_eq!(python_requirement_ok(spec, v).unwrap(), want, "{spec}");
        }
        assert!(python_requirement_ok(">= three", v).is_err());
        assert!(python_requirement_ok("=>3.9", v).is_err());
    }

    /// A run binds the package directory its manifest was read from, by identity: one
    /// removed and installed again at the same path after the load (here: renamed away and
    /// made again, with another manifest) is not what the spec asks the sandbox to bind
    /// (the sandbox then refuses the path, `tests/library.rs`).
    #[test]
    fn a_run_binds_the_directory_its_manifest_was_read_from() {
        let root = std::env::temp_dir().join(format!("opservant-executor-identity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let make = |dir: &Path, version: &str| {
            std::fs::create_dir_all(dir.join(".deps")).unwrap();
            std::fs::write(dir.join("noop.py"), "class Noop: pass\n").unwrap();
            std::fs::write(
                dir.join("manifest.json"),
                serde_json::json!({"name": "noop", "version": version, "description": "d", "author": "a",
                    "supported_actions": ["act"], "entry_point": "noop.Noop", "permissions": {},
                    "resource_limits": {}})
                .to_string(),
            )
            .unwrap();
        };
        let dir = root.join("pkg");
        make(&dir, "1.0.0");
        let loaded = Executor::load(&dir).unwrap();
        let id = |p: &Path| sandbox::FileId::of(&std::fs::metadata(p).unwrap());
        std::fs::rename(&dir, root.join("removed")).unwrap();
        make(&dir, "2.0.0");
        assert_eq!(loaded.manifest.version, "1.0.0");
        assert_eq!(loaded.dir_id, id(&root.join("removed")));
        assert_eq!(loaded.deps_id, Some(id(&root.join("removed/.deps"))));
        assert_ne!(loaded.dir_id, id(&dir));

        let config = Config::parse("{}").unwrap();
        let policy = AgentPolicy::from_config(&config).unwrap();
        let req = RunRequest {
            executor: &loaded,
            params: Value::Null,
            action: None,
            command_id: None,
            config: &config,
            policy: &policy,
            launcher: sandbox::Launcher::Fork,
            runtime: PathBuf::from("/usr/bin/true"),
            pool: None,
            background_teardown: false,
            timeline: None,
        };
        let (spec, _) = executor_spec(&req).unwrap();
        let bound = |p: &Path| spec.filesystem.paths.iter().find(|r| r.path == p).map(|r| r.identity);
        assert_eq!(bound(&loaded.dir), Some(Some(loaded.dir_id)));
        assert_eq!(bound(&loaded.dir.join(".deps")), Some(loaded.deps_id));
        let _ = std::fs::remove_dir_all(&root);
    }
}
