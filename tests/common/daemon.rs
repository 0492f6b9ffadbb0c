//! A real `opservant agent` for the tests: keys, a configuration, installed executors and
//! the daemon on a socket in a scratch directory (tests/agent_local.rs, tests/load_soak.rs).

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, HostDir};
use serde_json::{json, Value};

pub struct Agent {
    pub dir: HostDir,
    pub config: PathBuf,
    pub socket: PathBuf,
    pub key: PathBuf,
    pub child: Option<Child>,
}

const SLOW_PY: &str = r#"import time
from opservant.executor import BaseExecutor, ExecutorResult


class Slow(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        time.sleep(params.get("seconds", 1))
        output = {"slept": params.get("seconds", 1)}
        if params.get("pad"):
            output["pad"] = "x" * params["pad"]
        return ExecutorResult(status="completed", output=output)
"#;

pub fn op(args: &[&str]) -> std::process::Output {
    common::command().args(args).stdin(Stdio::null()).output().expect("spawn opservant")
}

/// [`op`] for a command that must end on its own — an agent whose configuration must be
/// refused at start: one still running after 30 s is killed and the test fails, rather than
/// waiting on an agent that started.
#[allow(dead_code)] // each test file uses its part
pub fn op_ending(args: &[&str]) -> std::process::Output {
    let child = common::command()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn opservant");
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(out) => out.expect("wait for opservant"),
        Err(_) => {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
            panic!("opservant {args:?} was still running after 30 s");
        }
    }
}

#[allow(dead_code)] // each test file uses its part
impl Agent {
    /// Keys, config, the seed's port scanner and a slow executor installed; not started.
    pub fn new(max_concurrent: usize) -> Agent {
        Self::with_network(max_concurrent, "")
    }

    /// As [`Agent::new`], with `network` (YAML, indented under `network:`) in the config.
    pub fn with_network(max_concurrent: usize, network: &str) -> Agent {
        Self::build(max_concurrent, "", network, |_| String::new())
    }

    /// As [`Agent::new`], with more keys (YAML lines indented by two) in the `agent:` section.
    pub fn with_agent_keys(max_concurrent: usize, agent_keys: &str) -> Agent {
        Self::build(max_concurrent, agent_keys, "", |_| String::new())
    }

    /// As [`Agent::with_network`], with `agent_keys` in the `agent:` section; `executors(dir)`
    /// gives more `executors:` keys (YAML lines indented two spaces), in force after the port
    /// scanner and the slow executor were installed.
    pub fn build(max_concurrent: usize, agent_keys: &str, network: &str, executors: impl Fn(&Path) -> String) -> Agent {
        let dir = HostDir::new();
        let p = |s: &str| dir.path.join(s);
        assert!(op(&["keygen", "--out", p("keys").to_str().unwrap()]).status.success());
        let socket = p("run/agent.sock");
        let config = p("config.yaml");
        let write_config = |extra: &str| {
            std::fs::write(
                &config,
                format!(
                    "agent:\n  platform_public_key: {}\n  state_dir: {}\n  socket: {}\n  max_concurrent: {max_concurrent}\n{agent_keys}\
                     executors:\n  dir: {}\n{extra}audit:\n  path: {}\n{network}",
                    p("keys/signing.pub").display(),
                    p("state").display(),
                    socket.display(),
                    p("executors").display(),
                    p("audit/audit.jsonl").display()
                ),
            )
            .unwrap()
        };
        write_config("");
        let slow = p("slow");
        std::fs::create_dir_all(slow.join("slow")).unwrap();
        std::fs::write(slow.join("slow/__init__.py"), "").unwrap();
        std::fs::write(slow.join("slow/main.py"), SLOW_PY).unwrap();
        std::fs::write(
            slow.join("manifest.json"),
            r#"{"name": "slow", "version": "1.0.0", "description": "sleeps", "author": "t",
                "supported_actions": ["act-sleep"], "entry_point": "slow.main.Slow", "permissions": {},
                "resource_limits": {"timeout_seconds": 30}}"#,
        )
        .unwrap();
        let scanner = Path::new(env!("CARGO_MANIFEST_DIR")).join("../executors/port-scanner");
        let c = config.to_str().unwrap();
        for pkg in [scanner.as_path(), slow.as_path()] {
            let out = op(&["executor", "install", pkg.to_str().unwrap(), "--config", c]);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        }
        write_config(&executors(&dir.path));
        let key = p("keys/signing.key");
        Agent { dir, config, socket, key, child: None }
    }

    /// Install an executor `name` whose `main.py` is `code` with class `class` (action
    /// `act-NAME`, no permissions, these `resource_limits`), as an operator would.
    pub fn install(&self, name: &str, class: &str, code: &str, limits: Value) {
        self.install_with_permissions(name, class, code, limits, json!({}))
    }

    /// As [`Agent::install`], with these `permissions`.
    pub fn install_with_permissions(&self, name: &str, class: &str, code: &str, limits: Value, permissions: Value) {
        let pkg = self.dir.path.join(format!("pkg-{name}"));
        let module = name.replace('-', "_");
        std::fs::create_dir_all(pkg.join(&module)).unwrap();
        std::fs::write(pkg.join(&module).join("__init__.py"), "").unwrap();
        std::fs::write(pkg.join(&module).join("main.py"), code).unwrap();
        let manifest = json!({"name": name, "version": "1.0.0", "description": "test executor", "author": "t",
            "supported_actions": [format!("act-{name}")], "entry_point": format!("{module}.main.{class}"),
            "permissions": permissions, "resource_limits": limits});
        std::fs::write(pkg.join("manifest.json"), manifest.to_string()).unwrap();
        let out = op(&["executor", "install", pkg.to_str().unwrap(), "--config", self.config.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn start(&mut self) {
        self.start_with_env(&[]);
    }

    /// As [`Agent::start`], with these variables added to the agent's environment.
    pub fn start_with_env(&mut self, env: &[(&str, &str)]) {
        let mut cmd = common::command();
        cmd.envs(env.iter().copied());
        self.spawn(cmd);
    }

    /// As [`Agent::start`], the agent started with the file mode creation mask `mask` (this
    /// process's own is left as it is).
    pub fn start_with_umask(&mut self, mask: libc::mode_t) {
        use std::os::unix::process::CommandExt;
        let mut cmd = common::command();
        // SAFETY: umask(2) is async-signal-safe and has no preconditions; it changes only the
        // child's mask, between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::umask(mask);
                Ok(())
            })
        };
        self.spawn(cmd);
    }

    /// As [`Agent::start`], the agent placed in the cgroup whose `cgroup.procs` is `procs`
    /// before it runs.
    pub fn start_in_cgroup(&mut self, procs: &Path) {
        let mut cmd = common::command();
        common::in_cgroup(&mut cmd, procs);
        self.spawn(cmd);
    }

    /// As [`Agent::start`], the agent's log (its stderr) written to `log`.
    pub fn start_logging_to(&mut self, log: std::fs::File) {
        self.spawn_with_stderr(common::command(), log.into());
    }

    fn spawn(&mut self, cmd: std::process::Command) {
        self.spawn_with_stderr(cmd, Stdio::null());
    }

    fn spawn_with_stderr(&mut self, mut cmd: std::process::Command, stderr: Stdio) {
        let child = cmd
            .args(["agent", "--config", self.config.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start the agent");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            assert!(Instant::now() < deadline, "the agent did not start listening");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on the pid of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().expect("wait for the agent")
    }

    pub fn sign(&self, cmd: &Value) -> Vec<u8> {
        let mut c = common::command()
            .args(["sign", "--key", self.key.to_str().unwrap(), "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        c.stdin.take().unwrap().write_all(cmd.to_string().as_bytes()).unwrap();
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success());
        out.stdout
    }

    /// `opservant submit -` with these bytes: (exit code, reply). A reply that takes five
    /// minutes fails the test instead of hanging it.
    pub fn submit(&self, bytes: &[u8]) -> (i32, Value) {
        self.submit_within(bytes, Duration::from_secs(300))
    }

    /// As [`Agent::submit`], failing the test unless the reply comes within `limit`.
    pub fn submit_within(&self, bytes: &[u8], limit: Duration) -> (i32, Value) {
        let mut c = common::command()
            .args(["submit", "-", "--socket", self.socket.to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        let _ = c.stdin.take().unwrap().write_all(bytes);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(c.wait_with_output()));
        // On a panic the agent is killed (Drop), which ends the waiting `submit` too.
        let out =
            rx.recv_timeout(limit).unwrap_or_else(|_| panic!("no reply within {limit:?}: the agent hangs")).unwrap();
        let code = out.status.code().unwrap_or(-1);
        let reply = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| json!({"stderr": String::from_utf8_lossy(&out.stderr)}));
        (code, reply)
    }

    /// The `sandboxes` of a `ping` reply (launch, zygote, warm pool), which must succeed.
    pub fn ping_sandboxes(&self) -> Value {
        let (code, pong) =
            self.submit(&self.sign(&json!({"command_id": format!("ping-{:?}", Instant::now()), "action": "ping"})));
        assert_eq!(code, 0, "{pong}");
        pong["output"]["sandboxes"].clone()
    }

    /// Wait (up to 20 s) until a ping says the warm pool holds `n` ready sandboxes.
    pub fn await_pool_ready(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.ping_sandboxes()["warm_pool"]["ready"].as_u64().unwrap_or(0) < n {
            assert!(Instant::now() < deadline, "the ping's warm pool never showed {n} ready sandboxes");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn audit_verify(&self) {
        let out = op(&["audit", "verify", "--config", self.config.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    }

    pub fn audit_events(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.path.join("audit/audit.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The zygote the agent starts at start-up (its pid), waiting up to 10 s for it.
#[allow(dead_code)] // tests/agent_local.rs only
pub fn started_zygote(agent: u32) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(pid) = zygote_pid(agent) {
            return pid;
        }
        assert!(Instant::now() < deadline, "the agent starts its zygote at start-up");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The agent's zygote: its child running `opservant-runtime --zygote`.
pub fn zygote_pid(agent: u32) -> Option<i32> {
    // By PPid (the parent's thread-group id), not /proc/AGENT/task/*/children: a child
    // started by a connection thread moves to another thread's list when that thread ends,
    // and a reader walking the lists can miss it in between.
    let ppid = |pid: i32| -> Option<u32> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status.lines().find_map(|l| l.strip_prefix("PPid:")).and_then(|v| v.trim().parse().ok())
    };
    std::fs::read_dir("/proc").ok()?.flatten().filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok()).find(
        |&pid| {
            ppid(pid) == Some(agent)
                && std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"--zygote"))
        },
    )
}

/// The payloads of the agent's zygote sandboxes ([`common::procs::payloads_below`]): pooled
/// ones waiting for their runs, and those of runs in progress.
#[allow(dead_code)] // tests/agent_local.rs only
pub fn zygote_payloads(agent: u32) -> Vec<i32> {
    zygote_pid(agent).map_or(vec![], common::procs::payloads_below)
}
