//! The `run-agent*` rows: a real `opservant agent`, started by the benchmark from its
//! installed copy, with the no-op executor installed as an operator installs it, taking
//! signed `execute` commands on its socket — the daemon's whole command path (signature
//! check, replay and receipt records, policy, the run, its completion record, the reply),
//! which the library rows leave out.
//!
//! Guarantees: everything an agent uses (keys, configuration, state, audit log — not
//! mirrored to journald —, socket, installed executors, its log) lives in the benchmark's
//! scratch directory; dropping a [`BenchAgent`] stops the agent (SIGTERM, then SIGKILL after
//! 10 s) and reaps it, and an agent whose benchmark died without that (SIGKILL, an abort)
//! gets SIGTERM from the kernel (`PR_SET_PDEATHSIG`); a sample is checked (status
//! `completed`, the launch the row promises) and a failed one aborts the benchmark with the
//! agent's reply; an agent that does not answer within [`REPLY_LIMIT`] fails the benchmark
//! rather than hanging it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{check_stop, failed, write, BenchError};

/// How long an agent may take to listen on its socket after it was started.
const START_LIMIT: Duration = Duration::from_secs(20);

/// How long a pool agent may take to have a pooled sandbox ready again after a run took
/// one (a refill starts a sandbox through the zygote and warms it up; the pool's own limit
/// for the warm-up is [`crate::warm_pool::WARM_LIMIT`]).
const REFILL_LIMIT: Duration = Duration::from_secs(15);

/// How long a command's reply may take (a no-op run or a ping: milliseconds).
const REPLY_LIMIT: Duration = Duration::from_secs(30);

/// A running `opservant agent` of the benchmark.
pub struct BenchAgent {
    name: &'static str,
    child: Mutex<Child>,
    socket: PathBuf,
    key: ed25519_dalek::SigningKey,
    log: PathBuf,
    /// Commands sent (their ids: `bench-NAME-N`).
    sent: AtomicU64,
}

impl BenchAgent {
    /// Keys, a configuration (`agent.warm_pool: warm_pool`, `agent.max_concurrent`: at least
    /// the agent's default and `clients`, the default zygote launch), with `noop` the executor
    /// package `scratch/noop` installed with `op executor install`, and the agent started and
    /// listening. Untimed.
    pub fn start(
        name: &'static str,
        scratch: &Path,
        op: &Path,
        warm_pool: usize,
        noop: bool,
        clients: usize,
    ) -> Result<BenchAgent, BenchError> {
        let a = scratch.join(format!("agent-{name}"));
        crate::signing::keygen(&a.join("keys")).map_err(failed)?;
        let socket = a.join("run/agent.sock");
        let config = a.join("config.yaml");
        write(
            &config,
            &format!(
                "agent:\n  platform_public_key: {}\n  state_dir: {}\n  socket: {}\n  max_concurrent: {}\n  \
                 warm_pool: {warm_pool}\nexecutors:\n  dir: {}\naudit:\n  path: {}\n  journald: false\n{}",
                a.join("keys/signing.pub").display(),
                a.join("state").display(),
                socket.display(),
                clients.max(crate::daemon::DEFAULT_MAX_CONCURRENT),
                a.join("executors").display(),
                a.join("audit/audit.jsonl").display(),
                super::sandbox_section()
            ),
        )?;
        if noop {
            let installed = Command::new(op)
                .arg("executor")
                .arg("install")
                .arg(scratch.join("noop"))
                .arg("--config")
                .arg(&config)
                .stdin(Stdio::null())
                .output()
                .map_err(|e| failed(format!("opservant executor install: {e}")))?;
            if !installed.status.success() {
                return Err(failed(format!(
                    "agent {name}: installing the no-op executor failed: {}",
                    String::from_utf8_lossy(&installed.stderr).trim()
                )));
            }
        }
        let key = crate::signing::load_signing_key(&a.join("keys/signing.key")).map_err(failed)?;
        let log = a.join("agent.log");
        let log_file = std::fs::File::create(&log).map_err(|e| failed(format!("{}: {e}", log.display())))?;
        let mut cmd = Command::new(op);
        cmd.arg("agent").arg("--config").arg(&config).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log_file);
        // The agent stops (SIGTERM: it drains and removes its sandboxes) when the thread that
        // started it ends — this benchmark's main thread, alive until the process exits —
        // even if the benchmark is killed before it could stop the agent itself.
        let bench = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec and makes only
        // async-signal-safe calls (signal, prctl, getppid); it allocates nothing.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                // Until the exec the child has the benchmark's own SIGTERM handler, which
                // would only note the signal: a parent-death signal arriving before the exec
                // must end the child instead.
                if libc::signal(libc::SIGTERM, libc::SIG_DFL) == libc::SIG_ERR
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // The benchmark died between the fork and the prctl: no signal will come.
                if libc::getppid() != bench {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|e| failed(format!("start opservant agent: {e}")))?;
        let agent = BenchAgent { name, child: Mutex::new(child), socket, key, log, sent: AtomicU64::new(0) };
        let deadline = Instant::now() + START_LIMIT;
        while std::os::unix::net::UnixStream::connect(&agent.socket).is_err() {
            check_stop()?;
            let exited = agent.child().try_wait().ok().flatten();
            if exited.is_some() || Instant::now() >= deadline {
                return Err(failed(format!(
                    "agent {name} did not start listening on {} ({}): {}",
                    agent.socket.display(),
                    exited.map_or("still starting after 20 s".into(), |s| s.to_string()),
                    agent.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(agent)
    }

    /// The agent's process id.
    pub fn pid(&self) -> i32 {
        self.child().id() as i32
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Child> {
        // Only `try_wait`, `kill` and `wait` run under the lock: a panic cannot leave the
        // child half-changed.
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn log_tail(&self) -> String {
        std::fs::read_to_string(&self.log)
            .ok()
            .and_then(|t| t.trim().lines().last().map(str::to_string))
            .unwrap_or_else(|| format!("(see {})", self.log.display()))
    }

    /// A signed command of `action` with `fields` added, ready to send (signed now, so
    /// within the agent's clock window).
    fn signed(&self, action: &str, fields: Value) -> Result<Vec<u8>, BenchError> {
        let n = self.sent.fetch_add(1, Ordering::Relaxed);
        let mut cmd = serde_json::Map::new();
        cmd.insert("command_id".into(), json!(format!("bench-{}-{n}", self.name)));
        cmd.insert("action".into(), json!(action));
        if let Value::Object(f) = fields {
            cmd.extend(f);
        }
        crate::signing::sign(&mut cmd, &self.key, crate::signing::now()).map_err(failed)?;
        serde_json::to_vec(&cmd).map_err(failed)
    }

    /// Send `bytes` and read the whole reply, as `opservant submit` does
    /// ([`crate::daemon::submit`]), with [`REPLY_LIMIT`] on each read and write.
    fn submit(&self, bytes: &[u8]) -> Result<Value, BenchError> {
        use std::io::{Read, Write};
        let fail = |what: String| failed(format!("agent {}: {what} ({})", self.name, self.log_tail()));
        let mut stream = std::os::unix::net::UnixStream::connect(&self.socket)
            .map_err(|e| fail(format!("{}: {e}", self.socket.display())))?;
        stream
            .set_read_timeout(Some(REPLY_LIMIT))
            .and_then(|()| stream.set_write_timeout(Some(REPLY_LIMIT)))
            .map_err(|e| fail(format!("socket timeouts: {e}")))?;
        stream
            .write_all(bytes)
            .and_then(|()| stream.shutdown(std::net::Shutdown::Write))
            .map_err(|e| fail(format!("send: {e}")))?;
        let mut reply = String::new();
        stream.read_to_string(&mut reply).map_err(|e| fail(format!("reply: {e}")))?;
        serde_json::from_str(reply.trim()).map_err(|e| fail(format!("reply is not JSON ({e}): {}", reply.trim())))
    }

    /// Wait until the agent's warm pool has a sandbox ready (asked with `ping`, whose reply
    /// carries the pool's state). Untimed.
    pub fn await_pool(&self) -> Result<(), BenchError> {
        let deadline = Instant::now() + REFILL_LIMIT;
        loop {
            check_stop()?;
            let reply = self.submit(&self.signed("ping", json!({}))?)?;
            let pool = &reply["output"]["sandboxes"]["warm_pool"];
            if pool["ready"].as_u64().is_some_and(|n| n > 0) {
                return Ok(());
            }
            if reply["status"] != "completed" || pool.is_null() {
                return Err(failed(format!("agent {}: ping without a warm pool's state: {reply}", self.name)));
            }
            if Instant::now() >= deadline {
                return Err(failed(format!(
                    "agent {}: no pooled sandbox ready {} s after the last run took one",
                    self.name,
                    REFILL_LIMIT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// One `execute` of the no-op executor: signed beforehand, timed from connecting to the
    /// agent's socket to its whole reply. The reply must say `completed`, started by
    /// `launch` (`zygote` or `pool`).
    pub fn execute(&self, launch: &str) -> Result<Duration, BenchError> {
        let bytes = self.signed("execute", json!({"executor": "noop", "parameters": {}}))?;
        let start = Instant::now();
        let reply = self.submit(&bytes)?;
        let elapsed = start.elapsed();
        if reply["status"] != "completed" || reply["sandbox"]["launch"] != launch {
            return Err(failed(format!("agent {}: a run not completed from the {launch}: {reply}", self.name)));
        }
        Ok(elapsed)
    }
}

impl Drop for BenchAgent {
    fn drop(&mut self) {
        let mut child = self.child();
        // Only a child not reaped yet: a reaped one's pid may belong to another process now.
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
