//! `opservant run` end to end: the real binary, as root, on the real kernel. Each test builds
//! an executor package in a host directory (below /var/tmp: the host's /tmp is invisible in
//! the sandbox), runs it, and checks the exit status (0 completed, 1 ran but did not
//! complete, 2 could not run: one line on stderr, nothing on stdout) and the result JSON.
//!
//! Covers the seed 000 executor unmodified, every lifecycle branch, every manifest error
//! class, `executor lint`, secrets (denied + audited, delivered + redacted everywhere),
//! output caps, artifacts (sha256, symlinks never followed, size caps), limits (OOM,
//! timeout, clamps), the context, and the interpreter's isolation.

mod common;

use common::sha256_hex;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{require_root, HostDir};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// One `opservant` invocation.
#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    /// The result JSON (the whole of stdout, one line); panics with everything otherwise.
    fn json(&self) -> Value {
        let text = self.stdout.trim_end_matches('\n');
        assert!(!text.contains('\n'), "stdout must be exactly one JSON line: {self:?}");
        serde_json::from_str(text).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:?}"))
    }

    /// Ran to a result: exit status 0 exactly when the status is "completed".
    fn result(&self) -> Value {
        let j = self.json();
        common::assert_launch(&j);
        let want = if j["status"] == "completed" { 0 } else { 1 };
        assert_eq!(self.code, want, "exit status for status {}: {}\nstderr: {}", j["status"], j, self.stderr);
        j
    }

    /// Could not run: exit 2, nothing on stdout, exactly one stderr line naming `needles`.
    fn cannot_run(&self, needles: &[&str]) {
        assert_eq!(self.code, 2, "{self:?}");
        assert!(self.stdout.is_empty(), "nothing on stdout when the run cannot start: {self:?}");
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stderr: {self:?}");
        assert!(lines[0].starts_with("opservant: "), "{self:?}");
        for n in needles {
            assert!(lines[0].contains(n), "stderr should mention {n:?}: {}", lines[0]);
        }
    }
}

/// `opservant ARGS…` as the tests start it: no log level from the environment, no stdin.
fn opservant_command(args: &[&std::ffi::OsStr]) -> Command {
    let mut cmd = common::command();
    cmd.args(args).env_remove("OPSERVANT_LOG").stdin(Stdio::null());
    cmd
}

fn invoke(args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> Out {
    output_of(opservant_command(args).envs(env.iter().copied()))
}

/// Run `cmd` to its end (holding the host view for reading, see `common::HOST_VIEW`).
fn output_of(cmd: &mut Command) -> Out {
    let _view = common::host_view();
    let out = cmd.output().expect("spawn opservant");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `opservant run DIR [launch args] args…`, not started.
fn run_command(dir: &Path, args: &[&str]) -> Command {
    let launch = common::launch_args();
    let mut all: Vec<&std::ffi::OsStr> = vec!["run".as_ref(), dir.as_os_str()];
    all.extend(launch.iter().map(std::ffi::OsStr::new));
    all.extend(args.iter().map(|a| std::ffi::OsStr::new(*a)));
    opservant_command(&all)
}

/// `opservant run DIR args…` with extra environment variables.
fn run_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Out {
    output_of(run_command(dir, args).envs(env.iter().copied()))
}

fn run(dir: &Path, args: &[&str]) -> Out {
    run_env(dir, args, &[])
}

/// `opservant run DIR --params PARAMS` (no action).
fn run_params(dir: &Path, params: &Value) -> Out {
    run(dir, &["--params", &params.to_string()])
}

fn lint(dir: &Path, json: bool) -> Out {
    let mut all: Vec<&std::ffi::OsStr> = vec!["executor".as_ref(), "lint".as_ref(), dir.as_os_str()];
    if json {
        all.push("--json".as_ref());
    }
    invoke(&all, &[])
}

/// Write `rel` below `root` readable by everyone (the sandbox runs as an unprivileged uid).
fn put(root: &Path, rel: &str, content: &[u8]) -> PathBuf {
    let p = root.join(rel);
    let parent = p.parent().expect("parent");
    std::fs::create_dir_all(parent).expect("mkdir");
    let mut d = parent;
    while d.starts_with(root) {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
        match d.parent() {
            Some(up) => d = up,
            None => break,
        }
    }
    std::fs::write(&p, content).expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod file");
    p
}

/// A valid manifest for the `test_executor.TestExecutor` entry point.
fn base_manifest() -> Value {
    json!({
        "name": "test-executor",
        "version": "1.0.0",
        "description": "integration test executor",
        "author": "tests",
        "supported_actions": ["act-test", "act-other"],
        "entry_point": "test_executor.TestExecutor",
        "requirements": {"python": ">=3.9", "packages": []},
        "permissions": {},
        "resource_limits": {"max_cpu_percent": 50, "timeout_seconds": 60}
    })
}

/// Merge `patch` into `base` (objects recursively; `null` deletes a key).
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    b.remove(k);
                } else if v.is_object() && b.get(k).is_some_and(Value::is_object) {
                    merge(b.get_mut(k).expect("key"), v);
                } else {
                    b.insert(k.clone(), v.clone());
                }
            }
        }
        (b, p) => *b = p.clone(),
    }
}

/// An executor package: base manifest patched with `patch`, `test_executor/__init__.py` = `code`.
fn executor(patch: Value, code: &str) -> HostDir {
    let d = HostDir::new();
    let mut m = base_manifest();
    merge(&mut m, &patch);
    put(&d.path, "manifest.json", m.to_string().as_bytes());
    put(&d.path, "test_executor/__init__.py", code.as_bytes());
    d
}

/// An executor package with a raw manifest text.
fn executor_text(manifest: &str, code: &str) -> HostDir {
    let d = HostDir::new();
    put(&d.path, "manifest.json", manifest.as_bytes());
    put(&d.path, "test_executor/__init__.py", code.as_bytes());
    d
}

fn b64(data: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(data).expect("base64")
}

fn log_msgs(r: &Value) -> Vec<String> {
    r["logs"].as_array().expect("logs").iter().map(|l| l["msg"].as_str().unwrap_or("").to_string()).collect()
}

/// A config file (and optionally a secrets file) in their own host directory, which the
/// sandbox cannot see.
struct Conf {
    dir: HostDir,
    config: PathBuf,
    secrets: Option<PathBuf>,
}

fn config(yaml: &str, secrets: Option<&str>) -> Conf {
    let dir = HostDir::new();
    let secrets = secrets.map(|s| {
        let p = dir.path.join("secrets.yaml");
        std::fs::write(&p, s).expect("write secrets");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod secrets");
        p
    });
    let mut text = yaml.to_string();
    if !text.lines().any(|l| l.starts_with("audit:")) {
        text.push_str(&common::audit_section());
    }
    if let Some(p) = &secrets {
        text.push_str(&format!("secrets:\n  provider: file\n  file: {}\n", p.display()));
    }
    let config = dir.path.join("config.yaml");
    std::fs::write(&config, text).expect("write config");
    Conf { dir, config, secrets }
}

impl Conf {
    fn arg(&self) -> &str {
        self.config.to_str().expect("utf-8")
    }
}

/// One executor whose behaviour the `mode` parameter picks, covering every lifecycle branch.
/// `execute` leaves a log record and a stdout marker; `cleanup` leaves a log record.
const LIFECYCLE: &str = r#"
import os
import sys

from opservant.executor import BaseExecutor, ExecutorResult


class TestExecutor(BaseExecutor):
    name = "test-executor"
    version = "1.0.0"

    def validate(self, params):
        self.mode = params.get("mode", "ok")
        if self.mode == "reject":
            raise ValueError("Missing required parameter: target_host")
        if self.mode == "validate_false":
            return False
        if self.mode == "validate_none":
            return None
        if self.mode == "validate_typeerror":
            raise TypeError("validate is broken")
        return True

    def execute(self, params, context):
        context["logger"].info("execute called", mode=self.mode)
        print("EXECUTE-MARKER")
        sys.stdout.flush()
        mode = self.mode
        if mode == "raise":
            raise RuntimeError("boom from execute")
        if mode == "dict":
            return {"status": "completed", "output": {}}
        if mode == "none":
            return None
        if mode == "partial":
            return ExecutorResult(status="partial", output={"scanned": 2, "unreachable": ["10.0.0.3"]},
                                  error="1 of 3 hosts unreachable")
        if mode == "failed_with_output":
            return ExecutorResult(status="failed", output={"partial_results": [22]},
                                  error="Connection refused: 10.0.0.1")
        if mode == "sys_exit":
            sys.exit(3)
        if mode == "system_exit_zero":
            raise SystemExit(0)
        if mode == "os_exit":
            os._exit(0)
        if mode == "int_key":
            return ExecutorResult(output={1: "a"})
        if mode == "bytes":
            return ExecutorResult(output={"b": b"\\x00"})
        if mode == "object":
            return ExecutorResult(output={"o": object()})
        if mode == "mutated":
            r = ExecutorResult(output={"a": 1})
            r.status = "done"
            return r
        return ExecutorResult(status="completed", output={"answer": 42, "params": params})

    def cleanup(self, context):
        context["logger"].info("cleanup ran", mode=self.mode)
        if self.mode in ("cleanup_raises", "raise"):
            raise RuntimeError("cleanup exploded")
"#;

fn lifecycle(mode: &str) -> (HostDir, Value) {
    let d = executor(json!({}), LIFECYCLE);
    let out = run_params(&d.path, &json!({"mode": mode}));
    let r = out.result();
    (d, r)
}

fn assert_execute_not_called(r: &Value) {
    assert!(!log_msgs(r).iter().any(|m| m == "execute called"), "execute must not run: {r}");
    assert!(!r["stdout"].as_str().unwrap().contains("EXECUTE-MARKER"), "execute must not run: {r}");
}

fn assert_cleanup_ran(r: &Value) {
    let n = log_msgs(r).iter().filter(|m| *m == "cleanup ran").count();
    assert_eq!(n, 1, "cleanup runs exactly once: {}", r["logs"]);
}

// ---------------------------------------------------------------------------------------
// Seed 000
// ---------------------------------------------------------------------------------------

fn port_scanner_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../executors/port-scanner")
}

#[test]
fn seed_000_port_scanner_runs_unmodified() {
    if !require_root() {
        return;
    }
    let dir = port_scanner_dir();
    let src = std::fs::read_to_string(dir.join("port_scanner/__init__.py")).unwrap();
    // The seed's text: the s4e_agent import and the class exactly as written there.
    assert!(src.starts_with("from s4e_agent.executor import BaseExecutor, ExecutorResult\n"), "{src}");
    assert!(src.contains("status = \"open\" if sock.connect_ex((target, port)) == 0 else \"closed\""));
    let out =
        run(&dir, &["--params", r#"{"target_host": "127.0.0.1", "ports": [22, 80]}"#, "--action", "act-port-scan"]);
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    // The sandbox has a private loopback: nothing listens there, whatever the host runs.
    assert_eq!(
        r["output"],
        json!({"host": "127.0.0.1", "ports": [{"port": 22, "status": "closed"}, {"port": 80, "status": "closed"}]})
    );
    assert_eq!(r["error"], Value::Null);
    assert_eq!(r["executor"], json!({"name": "port-scanner", "version": "1.0.0"}));
    assert_eq!(r["action"], "act-port-scan");
    assert_eq!(r["exit_code"], 0);
    assert_eq!(r["killed_by"], Value::Null);
    assert_eq!(r["sandbox"]["network"], "none");
    assert_eq!(r["limits"]["max_memory_mb"], 256);
    assert!(out.stderr.contains("event=\"executor_start\""), "{}", out.stderr);
    assert!(out.stderr.contains("event=\"executor_complete\""), "{}", out.stderr);

    // Its own validate() rejects missing parameters.
    let r = run(&dir, &["--params", r#"{"target_host": "127.0.0.1"}"#, "--action", "act-service-discovery"]).result();
    assert_eq!(r["status"], "rejected");
    assert_eq!(r["error"], "Missing required parameter: ports");
    assert_eq!(r["output"], Value::Null);
}

// ---------------------------------------------------------------------------------------
// Lifecycle
// ---------------------------------------------------------------------------------------

#[test]
fn completed_run_passes_params_and_output_through() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), LIFECYCLE);
    let pfile = put(&d.path, "params.json", br#"{"mode": "ok", "list": [1, "two", null], "nested": {"k": true}}"#);
    let out = run(&d.path, &["--params", &format!("@{}", pfile.display()), "--action", "act-other"]);
    let r = out.result();
    assert_eq!(r["status"], "completed");
    assert_eq!(
        r["output"],
        json!({"answer": 42, "params": {"mode": "ok", "list": [1, "two", null], "nested": {"k": true}}})
    );
    assert_eq!(r["action"], "act-other");
    assert_eq!(r["stdout"], "EXECUTE-MARKER\n");
    assert_eq!(r["artifacts"], json!([]));
    assert_cleanup_ran(&r);
    assert_eq!(log_msgs(&r), vec!["execute called", "cleanup ran"], "order: execute, then cleanup");

    // No --params and no --action: {} and null.
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "completed");
    assert_eq!(r["output"]["params"], json!({}));
    assert_eq!(r["action"], Value::Null);
}

/// Arguments larger than the runtime accepts (16 MiB) are refused before the run starts
/// (exit 2, naming the limit; before, 16 MiB failed inside the runtime and 32 MiB broke the
/// channel with "Connection reset by peer"); a read path under /tmp that does not exist is
/// refused at validation like any other (before, it passed and the sandbox failed).
#[test]
fn oversized_parameters_and_a_missing_tmp_read_path_are_refused_before_the_run_starts() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), LIFECYCLE);
    let big = format!(r#"{{"blob": "{}"}}"#, "x".repeat(17 << 20));
    let pfile = put(&d.path, "big.json", big.as_bytes());
    run(&d.path, &["--params", &format!("@{}", pfile.display())]).cannot_run(&["--params @", "16777216"]);
    // Small enough to read, too large once the run's other arguments are added.
    let big = format!(r#"{{"blob": "{}"}}"#, "x".repeat((16 << 20) - 16));
    let pfile = put(&d.path, "big.json", big.as_bytes());
    run(&d.path, &["--params", &format!("@{}", pfile.display())]).cannot_run(&["parameters", "16777216"]);
    let d = executor(json!({"permissions": {"filesystem": {"read": ["/tmp/opservant-surely-missing"]}}}), LIFECYCLE);
    run(&d.path, &[]).cannot_run(&["permissions.filesystem.read[0]", "does not exist"]);
}

#[test]
fn validate_value_error_rejects_without_execute() {
    if !require_root() {
        return;
    }
    let (_d, r) = lifecycle("reject");
    assert_eq!(r["status"], "rejected");
    assert_eq!(r["error"], "Missing required parameter: target_host", "the message, not a traceback");
    assert_eq!(r["output"], Value::Null);
    assert_execute_not_called(&r);
    assert_cleanup_ran(&r);
}

#[test]
fn validate_returning_false_rejects_without_execute() {
    if !require_root() {
        return;
    }
    // Seed 000: validate() returns a bool. False refuses the parameters like a ValueError.
    let (_d, r) = lifecycle("validate_false");
    assert_eq!(r["status"], "rejected");
    assert_eq!(r["error"], "validate() returned False");
    assert_execute_not_called(&r);
    assert_cleanup_ran(&r);
    // A validate() that forgets to return anything is refused too (falsy), with a hint.
    let (_d, r) = lifecycle("validate_none");
    assert_eq!(r["status"], "rejected");
    assert!(r["error"].as_str().unwrap().contains("falsy NoneType"), "{r}");
    assert_execute_not_called(&r);
}

#[test]
fn validate_raising_another_exception_fails() {
    if !require_root() {
        return;
    }
    let (_d, r) = lifecycle("validate_typeerror");
    assert_eq!(r["status"], "failed");
    let err = r["error"].as_str().unwrap();
    assert!(err.starts_with("Traceback (most recent call last):"), "{err}");
    assert!(err.contains("TypeError: validate is broken"), "{err}");
    assert_execute_not_called(&r);
    assert_cleanup_ran(&r);
}

#[test]
fn execute_raising_fails_with_traceback_and_no_output() {
    if !require_root() {
        return;
    }
    let (_d, r) = lifecycle("raise");
    assert_eq!(r["status"], "failed");
    assert_eq!(r["output"], Value::Null, "no structured output from an unhandled exception");
    let err = r["error"].as_str().unwrap();
    assert!(err.starts_with("Traceback (most recent call last):"), "{err}");
    assert!(err.contains("in execute"), "{err}");
    assert!(err.contains("RuntimeError: boom from execute"), "{err}");
    // cleanup ran even though execute raised, and its own exception did not mask the result.
    assert_cleanup_ran(&r);
    assert!(!err.contains("cleanup exploded"), "{err}");
    let cleanup_failed: Vec<&Value> =
        r["logs"].as_array().unwrap().iter().filter(|l| l["msg"] == "cleanup failed").collect();
    assert_eq!(cleanup_failed.len(), 1, "{}", r["logs"]);
}

#[test]
fn execute_returning_a_non_result_fails_clearly() {
    if !require_root() {
        return;
    }
    let (_d, r) = lifecycle("dict");
    assert_eq!(r["status"], "failed");
    assert_eq!(r["error"], "execute() returned dict, not an ExecutorResult");
    assert_eq!(r["output"], Value::Null);
    assert_cleanup_ran(&r);
    let (_d, r) = lifecycle("none");
    assert_eq!(r["error"], "execute() returned NoneType, not an ExecutorResult");
    // A result whose status was changed after construction is checked again.
    let (_d, r) = lifecycle("mutated");
    assert_eq!(r["status"], "failed");
    assert!(r["error"].as_str().unwrap().contains("invalid ExecutorResult"), "{r}");
    assert!(r["error"].as_str().unwrap().contains("'done'"), "{r}");
}

#[test]
fn output_that_is_not_json_fails_clearly() {
    if !require_root() {
        return;
    }
    for (mode, needle) in [
        ("int_key", "'int' object is not an instance of 'str'"),
        ("bytes", "byte array"),
        ("object", "unsupported type object"),
    ] {
        let (_d, r) = lifecycle(mode);
        assert_eq!(r["status"], "failed", "{mode}: {r}");
        assert_eq!(r["output"], Value::Null);
        let err = r["error"].as_str().unwrap();
        assert!(err.starts_with("the result cannot be represented as JSON: "), "{mode}: {err}");
        assert!(err.contains(needle), "{mode}: {err}");
        assert_cleanup_ran(&r);
    }
}

#[test]
fn cleanup_runs_on_success_and_its_exception_does_not_mask_the_result() {
    if !require_root() {
        return;
    }
    let (_d, r) = lifecycle("ok");
    assert_eq!(r["status"], "completed");
    assert_cleanup_ran(&r);
    assert!(!log_msgs(&r).iter().any(|m| m == "cleanup failed"));

    let (_d, r) = lifecycle("cleanup_raises");
    assert_eq!(r["status"], "completed", "a failing cleanup does not change the result: {r}");
    assert_eq!(r["output"]["answer"], 42);
    assert_eq!(r["error"], Value::Null);
    assert_cleanup_ran(&r);
    let rec =
        r["logs"].as_array().unwrap().iter().find(|l| l["msg"] == "cleanup failed").expect("cleanup failure logged");
    assert_eq!(rec["level"], "error");
    let tb = rec["fields"]["error"].as_str().unwrap();
    assert!(tb.contains("RuntimeError: cleanup exploded"), "{tb}");
}

#[test]
fn partial_status_passes_through_with_output() {
    if !require_root() {
        return;
    }
    let (_d, r) = lifecycle("partial");
    assert_eq!(r["status"], "partial");
    assert_eq!(r["output"], json!({"scanned": 2, "unreachable": ["10.0.0.3"]}));
    assert_eq!(r["error"], "1 of 3 hosts unreachable");
    assert_cleanup_ran(&r);
}

#[test]
fn a_returned_failure_keeps_its_partial_output() {
    if !require_root() {
        return;
    }
    // Seed 000 "Error Handling": return failures gracefully, with the partial results.
    let (_d, r) = lifecycle("failed_with_output");
    assert_eq!(r["status"], "failed");
    assert_eq!(r["error"], "Connection refused: 10.0.0.1");
    assert_eq!(r["output"], json!({"partial_results": [22]}));
}

#[test]
fn system_exit_and_hard_exit_are_failures() {
    if !require_root() {
        return;
    }
    for mode in ["sys_exit", "system_exit_zero"] {
        let (_d, r) = lifecycle(mode);
        assert_eq!(r["status"], "failed", "{mode}: {r}");
        assert_eq!(r["output"], Value::Null);
        let err = r["error"].as_str().unwrap();
        assert!(err.contains("SystemExit"), "{mode}: {err}");
        assert_cleanup_ran(&r);
    }
    // os._exit skips everything: no result reached the agent, whatever the exit status.
    let (_d, r) = lifecycle("os_exit");
    assert_eq!(r["status"], "failed");
    assert_eq!(r["error"], "the executor runtime ended without a result (exit status 0)");
    assert!(!log_msgs(&r).iter().any(|m| m == "cleanup ran"));
}

/// What `signal` reports for every signal, beside what the kernel says (`/proc/self/status`).
const SIGNAL_VIEW: &str = r#"
import signal
from opservant.executor import BaseExecutor, ExecutorResult


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        masks = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("SigIgn", "SigCgt"):
                    masks[key] = int(value.strip(), 16)
        wrong = []
        for signum in range(1, signal.NSIG):
            bit = 1 << (signum - 1)
            kernel = "ignored" if masks["SigIgn"] & bit else "caught" if masks["SigCgt"] & bit else "default"
            h = signal.getsignal(signum)
            python = "ignored" if h == signal.SIG_IGN else "default" if h == signal.SIG_DFL else "caught"
            if h is None:
                python = "none"
            if python != kernel and not (python == "none" and signum in (32, 33)):
                wrong.append("%d: python %s, kernel %s" % (signum, python, kernel))
        named = {
            "SIGINT": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "SIGPIPE": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
            "SIGXFSZ": signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN,
            "SIGHUP": signal.getsignal(signal.SIGHUP) == signal.SIG_DFL,
            "SIGCHLD": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
        }
        # glibc's two internal signals, which its posix_spawn leaves ignored: a payload
        # starts with them at their default, as after a fork and exec.
        internal_ignored = [s for s in (32, 33) if masks["SigIgn"] & (1 << (s - 1))]
        return ExecutorResult(status="completed", output={"wrong": wrong, "named": named, "internal_ignored": internal_ignored})
"#;

#[test]
fn the_interpreter_sees_the_signal_dispositions_the_process_has() {
    if !require_root() {
        return;
    }
    // Through a zygote the `signal` module is imported before the fork, so what it read is
    // the zygote's; each sandbox must see its own (a fresh interpreter's) instead.
    let d = executor(json!({}), SIGNAL_VIEW);
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["output"]["wrong"], json!([]), "signal's view differs from the process: {r}");
    assert_eq!(r["output"]["internal_ignored"], json!([]), "signals 32, 33 inherited ignored: {r}");
    let named = r["output"]["named"].as_object().unwrap();
    for (name, ok) in named {
        assert_eq!(ok, &json!(true), "{name} is not as a fresh interpreter has it: {r}");
    }
}

const MEMORY_SCAN: &str = r#"
import re
from opservant.executor import BaseExecutor, ExecutorResult

# The sandbox spec's JSON as the channel carries it: a key and its colon, which the
# binaries' serde tables (bare names) do not hold. A character class keeps each pattern's
# own text from matching itself.
PATTERNS = [rb'"memory_byte[s]":', rb'"cpu_deferre[d]":', rb'"seccom[p]":\{', rb'"synthet[i]c":']


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        found, scanned = [], 0
        mem = open("/proc/self/mem", "rb", 0)
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
        for line in maps:
            fields = line.split(None, 5)
            if "r" not in fields[1] or (len(fields) > 5 and fields[5].startswith("[v")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except OSError:
                continue
            scanned += len(data)
            for p in PATTERNS:
                for m in re.finditer(p, data):
                    found.append(data[max(0, m.start() - 40):m.end() + 40].decode("latin1"))
        return ExecutorResult(status="completed", output={"found": found, "scanned": scanned})
"#;

/// A payload started through a zygote is a fork of the sandbox's init, which read the sandbox
/// spec from its channel: without an `execve` in between, what init's memory held is the
/// payload's. The channel's buffers are wiped when dropped, so the spec's JSON — its limits,
/// seccomp filters, masked paths, synthetic files — is not there to find (a review found it
/// whole in zygote and pool runs, never in cold ones).
#[test]
fn the_sandbox_spec_is_not_left_in_the_payloads_memory() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), MEMORY_SCAN);
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "completed", "{r}");
    assert!(r["output"]["scanned"].as_u64().unwrap() > 1 << 20, "the scan read the process's memory: {r}");
    assert_eq!(r["output"]["found"], json!([]), "{r}");
}

/// An executor directory the sandbox's user cannot reach (a directory on the way searchable
/// by root alone): the sandbox's set-up fails before its runtime is told to proceed, so the
/// run could not run — exit 2, one line saying why — not a `failed` result. (The tests'
/// configuration gives each sandbox a host uid of its own; with `host_uids: shared` the
/// sandbox's init finds the path out of reach, later, with the same words.)
#[test]
fn an_executor_out_of_the_sandbox_users_reach_cannot_run() {
    if !require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let d = executor(json!({}), LIFECYCLE);
    let private = HostDir::new();
    std::fs::set_permissions(&private.path, std::fs::Permissions::from_mode(0o700)).unwrap();
    let inside = private.path.join("noop");
    std::fs::rename(&d.path, &inside).unwrap();
    let out = run(&inside, &[]);
    assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{out:?}");
    // One line of its own (the audit records' mirror in the log aside: the run's start was
    // recorded, and its end as not run).
    let said: Vec<&str> = out.stderr.lines().filter(|l| !l.contains("opservant::audit")).collect();
    assert_eq!(said.len(), 1, "{out:?}");
    let reason = said[0];
    assert!(reason.starts_with("opservant: ") && reason.contains("sandbox setup failed at mounts: host path "));
    assert!(reason.contains(&inside.display().to_string()) && reason.contains("searchable"), "{reason}");
    // Refused before it started, so never recorded as started: the agent resolves declared
    // paths itself (as the sandbox's identity) while it builds the sandbox, before any record
    // (until the fifteenth session the sandbox's init found out after the start record, and
    // the run was recorded as started and not run; `--launch pool` failed before any record
    // already, filling the pool).
    assert!(!out.stderr.contains(r#"event="executor_start""#), "{out:?}");
    // Searchable, it runs.
    std::fs::set_permissions(&private.path, std::fs::Permissions::from_mode(0o711)).unwrap();
    assert_eq!(run(&inside, &[]).result()["status"], "completed");
    std::fs::rename(&inside, &d.path).unwrap();
}

#[test]
fn unimportable_executor_fails_clearly() {
    if !require_root() {
        return;
    }
    let d = executor(
        json!({}),
        "from opservant.executor import BaseExecutor\n\nclass TestExecutor(BaseExecutor:\n    pass\n",
    );
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "failed");
    assert_eq!(r["output"], Value::Null);
    let err = r["error"].as_str().unwrap();
    assert!(err.starts_with("cannot load entry point 'test_executor.TestExecutor'"), "{err}");
    assert!(err.contains("SyntaxError"), "{err}");
    assert!(err.contains("test_executor/__init__.py"), "names the file: {err}");

    // A missing dependency of the module.
    let d = executor(json!({}), "import requests_that_do_not_exist\n");
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "failed");
    assert!(r["error"].as_str().unwrap().contains("No module named 'requests_that_do_not_exist'"), "{r}");

    // The class is not in the module.
    let d = executor(json!({"entry_point": "test_executor.Missing"}), LIFECYCLE);
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "failed");
    assert!(r["error"].as_str().unwrap().contains("has no attribute 'Missing'"), "{r}");

    // The entry point names something that is not a class.
    let d = executor(json!({"entry_point": "test_executor.helper"}), "def helper():\n    pass\n");
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "failed");
    assert!(r["error"].as_str().unwrap().contains("is a function, not a class"), "{r}");
}

// ---------------------------------------------------------------------------------------
// Manifest errors: exit 2, one line naming the field, nothing on stdout
// ---------------------------------------------------------------------------------------

/// Run an executor whose manifest is the base manifest patched with `patch`.
fn run_patched(patch: Value) -> Out {
    let d = executor(patch, LIFECYCLE);
    run(&d.path, &[])
}

#[test]
fn missing_required_fields_are_refused() {
    if !require_root() {
        return;
    }
    for field in ["name", "version", "description", "supported_actions", "entry_point", "permissions"] {
        let mut patch = json!({});
        patch[field] = Value::Null;
        run_patched(patch).cannot_run(&["missing field", field]);
    }
}

#[test]
fn bad_field_values_are_refused_naming_the_field() {
    if !require_root() {
        return;
    }
    for (patch, needles) in [
        (json!({"version": "1.0"}), vec!["version:", "semantic version"]),
        (json!({"version": "latest"}), vec!["version:"]),
        (json!({"name": "Port_Scanner"}), vec!["name:", "[a-z0-9]"]),
        (json!({"name": "-leading-dash"}), vec!["name:"]),
        (json!({"entry_point": "test_executor"}), vec!["entry_point:", "module.Class"]),
        (json!({"entry_point": "test_executor.Test-Executor"}), vec!["entry_point:", "module.Class"]),
        (json!({"entry_point": "..test_executor.TestExecutor"}), vec!["entry_point:", "module.Class"]),
        (json!({"supported_actions": []}), vec!["supported_actions:"]),
        (json!({"supported_actions": "act-test"}), vec!["supported_actions:", "sequence"]),
        (json!({"description": "  "}), vec!["description:"]),
        (json!({"permissions": {"secrets": ["bad name!"]}}), vec!["permissions.secrets[0]:"]),
        (
            json!({"permissions": {"network": {"allowed_ports": ["80-20"]}}}),
            vec!["permissions.network.allowed_ports[0]:"],
        ),
        (
            json!({"permissions": {"network": {"allowed_ports": [70000]}}}),
            vec!["permissions.network.allowed_ports[0]:"],
        ),
        (json!({"permissions": {"filesystem": {"read": ["relative/path"]}}}), vec!["permissions.filesystem.read[0]:"]),
        (
            json!({"permissions": {"filesystem": {"read": ["/definitely/not/here"]}}}),
            vec!["permissions.filesystem.read[0]:", "does not exist"],
        ),
        (
            json!({"permissions": {"filesystem": {"read": ["/etc/shadow"]}}}),
            vec!["permissions.filesystem.read[0]:", "never readable"],
        ),
    ] {
        run_patched(patch).cannot_run(&needles);
    }
}

#[test]
fn entry_point_module_must_be_in_the_package() {
    if !require_root() {
        return;
    }
    // Not there at all.
    run_patched(json!({"entry_point": "nothere.Executor"}))
        .cannot_run(&["entry_point:", "module 'nothere' is not in the executor package"]);
    // Standard-library modules are never looked up: the package directory is the only place.
    for ep in ["os.system", "json.JSONDecoder", "subprocess.Popen"] {
        let module = ep.rsplit_once('.').unwrap().0;
        run_patched(json!({"entry_point": ep}))
            .cannot_run(&["entry_point:", &format!("module '{module}' is not in the executor package")]);
    }
    // The runtime's own packages: refused by the manifest's rules, whatever the package holds
    // (a package directory named `opservant` would never be imported: the runtime's is).
    for ep in ["opservant.executor.BaseExecutor", "s4e_agent.E"] {
        run_patched(json!({"entry_point": ep})).cannot_run(&["entry_point:", "is the runtime's own"]);
    }
    // A module file inside the package that is a symlink to the standard library.
    let d = executor(json!({"entry_point": "shadow.JSONDecoder"}), LIFECYCLE);
    let json_init = std::fs::read_dir("/usr/lib")
        .unwrap()
        .flatten()
        .map(|e| e.path().join("json/decoder.py"))
        .find(|p| p.is_file())
        .expect("a python3 json/decoder.py under /usr/lib");
    std::os::unix::fs::symlink(&json_init, d.path.join("shadow.py")).unwrap();
    run(&d.path, &[]).cannot_run(&["entry_point:", "shadow"]);
    // A package directory that is a symlink out of the package.
    let d = executor(json!({"entry_point": "jsonpkg.JSONDecoder"}), LIFECYCLE);
    std::os::unix::fs::symlink(json_init.parent().unwrap(), d.path.join("jsonpkg")).unwrap();
    run(&d.path, &[]).cannot_run(&["entry_point:", "jsonpkg"]);
}

#[test]
fn a_package_module_named_like_the_stdlib_is_the_one_loaded() {
    if !require_root() {
        return;
    }
    // entry point `json.Executor` with json.py in the package: resolved inside the package.
    let code = "from opservant.executor import BaseExecutor, ExecutorResult\n\
                class Executor(BaseExecutor):\n    \
                    def validate(self, p):\n        return True\n    \
                    def execute(self, p, c):\n        return ExecutorResult(output={'file': __file__})\n";
    let d = executor(json!({"entry_point": "json.Executor"}), LIFECYCLE);
    put(&d.path, "json.py", code.as_bytes());
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "completed", "{r}");
    let real = d.path.canonicalize().unwrap().join("json.py");
    assert_eq!(r["output"]["file"], real.to_str().unwrap());
}

/// The runtime's own check, after the import (the agent's static one cannot see this): a
/// module that, while imported, puts another module under its own name resolves outside
/// the package, and is refused — by the native `realpath` the sandbox's runtime uses (see
/// the next test for its answers).
#[test]
fn a_module_that_resolves_outside_the_package_at_import_is_refused() {
    if !require_root() {
        return;
    }
    let code = "import sys\nimport json.decoder\n\nclass Executor:\n    pass\n\nsys.modules[__name__] = json.decoder\n";
    let d = executor(json!({"entry_point": "swap.Executor"}), LIFECYCLE);
    put(&d.path, "swap.py", code.as_bytes());
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "failed", "{r}");
    let error = r["error"].as_str().unwrap_or_default();
    let real = d.path.canonicalize().unwrap();
    for part in [
        "cannot load entry point 'swap.Executor'".to_string(),
        "resolves to /usr/lib/python3".to_string(),
        format!("/json/decoder.py, outside the executor package {}", real.display()),
    ] {
        assert!(error.contains(&part), "{part:?} not in {error}");
    }
}

/// The runtime places the executor's package and module with a native `realpath`: inside a
/// sandbox it is the one in use, and it answers as Python's `os.path.realpath` does —
/// through a symlink (merged /usr's `/lib`), `..` after one, the package directory, `.`.
#[test]
fn the_runtimes_native_realpath_answers_as_pythons() {
    if !require_root() {
        return;
    }
    let code = r#"
import os

import opservant._lifecycle as lc
from opservant.executor import BaseExecutor, ExecutorResult


class Probe(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        here = os.path.dirname(os.path.abspath(__file__))
        paths = [
            here,
            here + "/../" + os.path.basename(here),
            "/lib/python3.11/json/decoder.py",
            "/lib/python3.11/json/../json",
            ".",
        ]
        out = {"native": lc._native_realpath is not None, "paths": {}}
        for p in paths:
            if os.path.lexists(p):
                out["paths"][p] = [lc._native_realpath(p), os.path.realpath(p), os.path.abspath(p)]
        return ExecutorResult(status="completed", output=out)
"#;
    let d = executor(json!({"entry_point": "test_executor.Probe"}), code);
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["output"]["native"], true, "{r}");
    let paths = r["output"]["paths"].as_object().expect("paths");
    assert!(paths.len() >= 4, "{r}");
    let mut through_a_link = 0;
    for (p, answers) in paths {
        let (native, python, absolute) = (&answers[0], &answers[1], &answers[2]);
        assert_eq!(native, python, "{p}: the native realpath differs from os.path.realpath");
        if native != absolute && !p.contains("..") {
            through_a_link += 1;
        }
    }
    assert!(through_a_link > 0, "no path went through a symlink: {r}");
}

#[test]
fn unknown_permission_keys_are_errors() {
    if !require_root() {
        return;
    }
    for (patch, path, key) in [
        (json!({"permissions": {"filesytem": {"read": []}}}), "permissions.filesytem:", "filesytem"),
        (json!({"permissions": {"network": {"outbond": false}}}), "permissions.network.outbond:", "outbond"),
        (json!({"permissions": {"filesystem": {"wirte": ["/tmp/x"]}}}), "permissions.filesystem.wirte:", "wirte"),
        (json!({"permissions": {"secret": ["api_key"]}}), "permissions.secret:", "secret"),
        (json!({"resource_limits": {"max_memroy_mb": 64}}), "resource_limits.max_memroy_mb:", "max_memroy_mb"),
        (json!({"requirements": {"pyhton": ">=3.9"}}), "requirements.pyhton:", "pyhton"),
    ] {
        run_patched(patch).cannot_run(&[path, &format!("unknown field `{key}`")]);
    }
}

#[test]
fn unknown_top_level_key_is_only_a_warning() {
    if !require_root() {
        return;
    }
    let out = run_patched(json!({"homepage": "https://example.com"}));
    let r = out.result();
    assert_eq!(r["status"], "completed");
    let warn = out.stderr.lines().find(|l| l.contains("WARN")).unwrap_or_else(|| panic!("{}", out.stderr));
    assert!(warn.contains("homepage") && warn.contains("unknown top-level key"), "{warn}");
}

#[test]
fn limit_types_and_ranges_are_checked() {
    if !require_root() {
        return;
    }
    for (limits, needles) in [
        (json!({"max_memory_mb": "lots"}), vec!["resource_limits.max_memory_mb:", "invalid type"]),
        (json!({"timeout_seconds": 1.5}), vec!["resource_limits.timeout_seconds:", "invalid type"]),
        (json!({"max_pids": -1}), vec!["resource_limits.max_pids:"]),
        (json!({"max_memory_mb": 0}), vec!["resource_limits.max_memory_mb:", "positive"]),
        (json!({"timeout_seconds": 0}), vec!["resource_limits.timeout_seconds:", "positive"]),
        (json!({"max_cpu_percent": 0}), vec!["resource_limits.max_cpu_percent:", "positive"]),
        (json!({"max_cpu_percent": 150}), vec!["resource_limits.max_cpu_percent:", "maximum 100"]),
        (json!({"max_cpu_percent": 101}), vec!["resource_limits.max_cpu_percent:"]),
    ] {
        run_patched(json!({"resource_limits": limits})).cannot_run(&needles);
    }
}

#[test]
fn limits_above_the_ceiling_are_clamped_and_reported() {
    if !require_root() {
        return;
    }
    let out =
        run_patched(json!({"resource_limits": {"max_memory_mb": 4096, "max_cpu_percent": 90, "timeout_seconds": 30}}));
    let r = out.result();
    assert_eq!(r["status"], "completed", "a clamp is not an error: {r}");
    let l = &r["limits"];
    assert_eq!(l["max_memory_mb"], 512);
    assert_eq!(l["max_cpu_percent"], 50);
    assert_eq!(l["timeout_seconds"], 30);
    let clamped = l["clamped"].as_array().unwrap();
    assert_eq!(clamped.len(), 2, "{l}");
    assert_eq!(clamped[0]["field"], "max_memory_mb");
    assert_eq!(clamped[0]["requested"], 4096);
    assert_eq!(clamped[0]["applied"], 512);
    assert_eq!(clamped[1]["field"], "max_cpu_percent");
    assert_eq!(clamped[1]["applied"], 50);
    // ... and audited (DESIGN.md §3: "in the result and the audit log — never silent").
    let audits: Vec<&str> = out.stderr.lines().filter(|l| l.contains("event=\"limit_clamped\"")).collect();
    assert_eq!(audits.len(), 2, "{}", out.stderr);
    assert!(
        audits[0].contains("max_memory_mb") && audits[0].contains("4096") && audits[0].contains("512"),
        "{}",
        audits[0]
    );

    // A configuration can lower the ceiling.
    let c = config("resource_limits:\n  max_memory_mb: 200\n", None);
    let d = executor(json!({"resource_limits": {"max_memory_mb": 256}}), LIFECYCLE);
    let r = run(&d.path, &["--config", c.arg()]).result();
    assert_eq!(r["limits"]["max_memory_mb"], 200);
    assert_eq!(r["limits"]["clamped"][0]["requested"], 256);
}

#[test]
fn host_proc_reads_and_writes_shared_with_every_user_are_refused() {
    if !require_root() {
        return;
    }
    // `/etc/mtab` is `../proc/self/mounts`: bound, the agent's mount table; `/proc/1/…` a host
    // process's files. The sandbox has a /proc of its own.
    for path in ["/etc/mtab", "/proc/1/mounts", "/proc/self/cmdline"] {
        run_patched(json!({"permissions": {"filesystem": {"read": [path]}}}))
            .cannot_run(&["permissions.filesystem.read[0]:", "in the host's /proc"]);
    }
    // A procfs mounted elsewhere is the host's /proc too.
    let elsewhere = HostDir::new();
    let st = Command::new("mount").args(["-t", "proc", "proc", elsewhere.str()]).status().unwrap();
    assert!(st.success(), "mount -t proc");
    let out = run_patched(json!({"permissions": {"filesystem": {"read": [format!("{}/self", elsewhere.str())]}}}));
    let _ = Command::new("umount").arg(elsewhere.str()).status();
    out.cannot_run(&["permissions.filesystem.read[0]:", "a procfs of the host"]);
    // A directory every host user may write to (`/var/tmp`, mode 1777; one made 0777) is
    // never bound writable; the same directory made 0755 is.
    let shared = HostDir::new();
    std::fs::set_permissions(&shared.path, std::fs::Permissions::from_mode(0o777)).unwrap();
    for path in ["/var/tmp", shared.path.to_str().unwrap()] {
        run_patched(json!({"permissions": {"filesystem": {"write": [path]}}}))
            .cannot_run(&["permissions.filesystem.write[0]:", "every user of the host may write there"]);
    }
    std::fs::set_permissions(&shared.path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = run_patched(json!({"permissions": {"filesystem": {"write": [shared.path.to_str().unwrap()]}}})).result();
    assert_eq!(r["status"], "completed", "{r}");

    // A procfs mounted beneath a declared directory would be bound along with it (binds
    // are recursive); so would the host's /proc beneath a declared `/`.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let holder = HostDir::new();
    let beneath = holder.path.join("srv/proc");
    std::fs::create_dir_all(&beneath).unwrap();
    let st = Command::new("mount").args(["-t", "proc", "proc"]).arg(&beneath).status().unwrap();
    assert!(st.success(), "mount -t proc");
    let _unmount = Unmount(beneath.clone());
    for kind in ["read", "write"] {
        run_patched(json!({"permissions": {"filesystem": {kind: [holder.str()]}}})).cannot_run(&[
            &format!("permissions.filesystem.{kind}[0]:"),
            &format!("a procfs of the host is mounted beneath it, on {}", beneath.display()),
        ]);
    }
    run_patched(json!({"permissions": {"filesystem": {"read": ["/"]}}}))
        .cannot_run(&["permissions.filesystem.read[0]:", "a procfs of the host is mounted beneath it, on /proc"]);
    // So would a kernel interface (tracefs here) beneath one; and one is never bound itself.
    let tracing_holder = HostDir::new();
    let tracefs = tracing_holder.path.join("t");
    std::fs::create_dir(&tracefs).unwrap();
    let st = Command::new("mount").args(["-t", "tracefs", "nodev"]).arg(&tracefs).status().unwrap();
    assert!(st.success(), "mount -t tracefs");
    let _unmount_tracefs = Unmount(tracefs.clone());
    run_patched(json!({"permissions": {"filesystem": {"read": [tracing_holder.str()]}}})).cannot_run(&[
        "permissions.filesystem.read[0]:",
        &format!("the host's tracefs (a kernel interface) is mounted beneath it, on {}", tracefs.display()),
    ]);
    run_patched(json!({"permissions": {"filesystem": {"read": [tracefs.to_str().unwrap()]}}}))
        .cannot_run(&["permissions.filesystem.read[0]:", "is in the host's tracefs, a kernel interface"]);

    // A write path in a directory every user may write to, without the sticky bit: any user
    // could rename it away and put a directory of theirs in its place before the bind.
    let outer = HostDir::new();
    let inner = outer.path.join("out");
    std::fs::create_dir(&inner).unwrap();
    std::fs::set_permissions(&outer.path, std::fs::Permissions::from_mode(0o777)).unwrap();
    run_patched(json!({"permissions": {"filesystem": {"write": [inner.to_str().unwrap()]}}})).cannot_run(&[
        "permissions.filesystem.write[0]:",
        &format!("every user of the host may rename it away and put another in its place ({} is writable by all, without the sticky bit)", outer.str()),
    ]);
    // With the sticky bit only the owner may rename it.
    std::fs::set_permissions(&outer.path, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let r = run_patched(json!({"permissions": {"filesystem": {"write": [inner.to_str().unwrap()]}}})).result();
    assert_eq!(r["status"], "completed", "{r}");
}

#[test]
fn writes_to_system_and_agent_paths_are_refused() {
    if !require_root() {
        return;
    }
    let bin_dir = Path::new(common::opservant()).parent().unwrap().to_str().unwrap().to_string();
    let runtime = format!("{bin_dir}/opservant-runtime");
    for path in
        ["/etc", "/etc/opservant", "/etc/opservant/", "/usr", "/usr/local/bin", "/var/lib/opservant", "/", "/root"]
    {
        run_patched(json!({"permissions": {"filesystem": {"write": [path]}}}))
            .cannot_run(&["permissions.filesystem.write[0]:", "never granted"]);
    }
    // The agent binary's directory, and the runtime binary beside it — unless they were built
    // under /tmp, where a declared write is the sandbox's own scratch, never the host's.
    for path in
        [bin_dir.as_str(), common::opservant(), runtime.as_str()].into_iter().filter(|p| !p.starts_with("/tmp/"))
    {
        run_patched(json!({"permissions": {"filesystem": {"write": ["/tmp/opservant/", path]}}}))
            .cannot_run(&["permissions.filesystem.write[1]:", "agent's own files"]);
    }
    // No manifest to read: lint, like run, could not run (exit 2), naming the file.
    let d = executor(json!({}), LIFECYCLE);
    std::fs::remove_file(d.path.join("manifest.json")).unwrap();
    for out in [lint(&d.path, false), run(&d.path, &[])] {
        assert_eq!(out.code, 2, "{out:?}");
        assert!(out.stderr.contains("manifest.json"), "{out:?}");
        assert!(out.stdout.is_empty(), "{out:?}");
    }
    // lint agrees with run.
    let d = executor(json!({"permissions": {"filesystem": {"write": ["/usr/local"]}}}), LIFECYCLE);
    let out = lint(&d.path, false);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stdout.contains("error: permissions.filesystem.write[0]: /usr/local"), "{out:?}");
    // A manifest's own text reaches the terminal with its control characters escaped.
    let d = executor(json!({"version": "1\u{1b}]2;owned\u{7}\n/forged: ok"}), LIFECYCLE);
    let out = lint(&d.path, false);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stdout.contains("'1\\u{1b}]2;owned\\u{7}\\n/forged: ok' is not a semantic version"), "{out:?}");
    assert!(!out.stdout.contains('\u{1b}') && !out.stdout.contains('\u{7}'), "{out:?}");
    assert!(!out.stdout.lines().any(|l| l.starts_with("/forged")), "{out:?}");
}

const PEEK: &str = r#"
import os
from opservant.executor import BaseExecutor, ExecutorResult


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        seen = {}
        for path in params["paths"]:
            try:
                if os.path.isdir(path):
                    seen[path] = "dir:" + ",".join(sorted(os.listdir(path)))
                else:
                    with open(path) as f:
                        seen[path] = "file:" + f.read()
            except OSError as e:
                seen[path] = "error:" + type(e).__name__
        return ExecutorResult(status="completed", output=seen)
"#;

/// The agent's own files that its configuration places outside `/etc/opservant` and the
/// state directories — here a state directory, the audit log (with its rotated file), a
/// trusted key, an install source and the platform TLS key, all world-readable so that
/// only the view can hide them — are masked in a sandbox that declares the directory
/// holding them; declaring them for writing, or the key material for reading, is refused.
#[test]
fn the_agents_configured_files_are_masked_and_never_writable() {
    if !require_root() {
        return;
    }
    let site = HostDir::new();
    let put_site = |rel: &str, text: &str| put(&site.path, rel, text.as_bytes());
    let public = put_site("public.txt", "public");
    let seen = put_site("state/commands-seen", "seen");
    let rotated = put_site("audit/audit.jsonl.2", "old records");
    let trusted = put_site("keys/trusted.pub", "pub");
    let package = put_site("packages/pkg.tar.gz", "pkg");
    // The TLS key inside the state directory: a declaration beneath the (masked) state
    // directory must not show it.
    let tls_key = put_site("state/tls/agent.key", "tls key");
    let ca = put_site("tls/ca.pem", "public CA");
    // A key in a directory only root can search (like /etc/ssl/private): the view cannot
    // even look for it there, and that must not fail the run.
    let store_key = site.path.join("private/secrets.key");
    std::fs::create_dir(site.path.join("private")).unwrap();
    std::fs::write(&store_key, "store key").unwrap();
    std::fs::set_permissions(site.path.join("private"), std::fs::Permissions::from_mode(0o700)).unwrap();
    let c = config(
        &format!(
            "agent:\n  state_dir: {}\naudit:\n  path: {}\n  journald: false\nexecutors:\n  trusted_keys: [{}]\n  install: [{}]\nnetwork:\n  agent_to_platform:\n    key: {}\n    ca: {}\nsecrets:\n  key_file: {}/private/../private/secrets.key\n",
            site.path.join("state").display(),
            site.path.join("audit/audit.jsonl").display(),
            trusted.display(),
            package.display(),
            tls_key.display(),
            ca.display(),
            site.path.display(),
        ),
        None,
    );
    let paths: Vec<String> = [&public, &ca, &trusted, &package, &seen, &site.path.join("state"), &rotated, &tls_key]
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let d = executor(
        json!({"permissions": {"filesystem": {"read": [site.str(), site.path.join("state/tls").display().to_string()]}}}),
        PEEK,
    );
    let r = run(&d.path, &["--config", c.arg(), "--params", &json!({ "paths": paths }).to_string()]).result();
    assert_eq!(r["status"], "completed", "{r}");
    let out = &r["output"];
    // Public files (a CA, a trusted key, an install source) are shown, never writable.
    for (p, want) in paths[..4].iter().zip(["file:public", "file:public CA", "file:pub", "file:pkg"]) {
        assert_eq!(out[p], want, "{p} is public: {r}");
    }
    for p in &paths[4..] {
        assert!(out[p].as_str().is_some_and(|v| v.starts_with("error:")), "{p} is not masked: {r}");
    }
    // The run's own audit record went to the configured log, which the sandbox could not read.
    let log = std::fs::read_to_string(site.path.join("audit/audit.jsonl")).unwrap();
    assert!(log.contains("executor_start"), "{log}");
    // Without the configuration the same files are ordinary files of the declared directory.
    let r = run(&d.path, &["--params", &json!({ "paths": paths }).to_string()]).result();
    assert_eq!(r["output"][&paths[4]], "file:seen", "{r}");
    assert_eq!(r["output"][&paths[7]], "file:tls key", "{r}");
    // Writing at or above them, or reading the key material, is refused at validation.
    for (perms, says) in [
        (json!({"write": [site.path.join("state").display().to_string()]}), "agent's own files"),
        (json!({"write": [site.str()]}), "agent's own files"),
        (json!({"write": [ca.display().to_string()]}), "agent's own files"),
        (json!({"read": [tls_key.display().to_string()]}), "key material (network.agent_to_platform.key)"),
        (json!({"read": [store_key.display().to_string()]}), "key material (secrets.key_file)"),
    ] {
        let d = executor(json!({"permissions": {"filesystem": perms}}), PEEK);
        run(&d.path, &["--config", c.arg()]).cannot_run(&["permissions.filesystem.", says]);
    }
}

/// `opservant run DIR args…` in a mount namespace of its own where each `(source, target)`
/// is bind-mounted first (recursively): a host whose mount table shows some files at two
/// places, without changing this host's.
fn run_with_binds(dir: &Path, args: &[&str], binds: &[(&Path, &Path)]) -> Out {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).unwrap();
    let binds: Vec<(CString, CString)> = binds.iter().map(|(s, t)| (c(s), c(t))).collect();
    let mut cmd = run_command(dir, args);
    // SAFETY: between fork and exec the hook makes only system calls, on strings made
    // before the fork; the new mount namespace is the child's alone (private: nothing
    // propagates back to the host's).
    unsafe {
        cmd.pre_exec(move || {
            let fail = || Err(std::io::Error::last_os_error());
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return fail();
            }
            let flags = libc::MS_REC | libc::MS_PRIVATE;
            if libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), flags, std::ptr::null()) != 0 {
                return fail();
            }
            for (s, t) in &binds {
                let flags = libc::MS_BIND | libc::MS_REC;
                if libc::mount(s.as_ptr(), t.as_ptr(), std::ptr::null(), flags, std::ptr::null()) != 0 {
                    return fail();
                }
            }
            Ok(())
        })
    };
    output_of(&mut cmd)
}

/// Masks, write protection and key material hold for the files, not only for the paths
/// naming them: a declared path that reaches them through another mount of the same files
/// (a bind mount on the host) is refused — the bind shown beneath a declared directory too —
/// and so is a write grant reaching a system directory so.
#[test]
fn the_agents_files_and_system_directories_are_protected_through_other_mounts_of_them() {
    if !require_root() {
        return;
    }
    let site = HostDir::new();
    let public = put(&site.path, "public.txt", b"public");
    put(&site.path, "state/seen", b"seen");
    let key = put(&site.path, "private/secrets.key", b"store key");
    let c = config(
        &format!(
            "agent:\n  state_dir: {}\nsecrets:\n  key_file: {}\n",
            site.path.join("state").display(),
            key.display()
        ),
        None,
    );
    // `mirror/site` shows `site` (a bind mount), `mirror/etc` the host's `/etc`.
    let mirror = HostDir::new();
    for d in ["site", "etc"] {
        std::fs::create_dir(mirror.path.join(d)).unwrap();
    }
    let alias = mirror.path.join("site");
    let etc = mirror.path.join("etc");
    let binds: [(&Path, &Path); 2] = [(&site.path, &alias), (Path::new("/etc"), &etc)];
    let at =
        |rel: &str| if rel.is_empty() { alias.display().to_string() } else { alias.join(rel).display().to_string() };
    let peek = |perms: Value, paths: &[String]| {
        let d = executor(json!({"permissions": {"filesystem": perms}}), PEEK);
        run_with_binds(&d.path, &["--config", c.arg(), "--params", &json!({ "paths": paths }).to_string()], &binds)
    };
    // What the second mount shows is there: without the agent's configuration its files
    // are ordinary files, shown through it.
    let d = executor(json!({"permissions": {"filesystem": {"read": [alias.display().to_string()]}}}), PEEK);
    let paths = vec![at("state/seen"), at("public.txt")];
    let r = run_with_binds(&d.path, &["--params", &json!({ "paths": paths }).to_string()], &binds).result();
    assert_eq!(r["output"][&paths[0]], "file:seen", "{r}");
    // With it, a public file is still shown through the second mount …
    let paths = vec![at("public.txt")];
    let r = peek(json!({"read": [at("public.txt")]}), &paths).result();
    assert_eq!(r["output"][&paths[0]], "file:public", "{r}");
    assert_eq!(std::fs::read_to_string(&public).unwrap(), "public");
    // … and nothing private is, whether declared itself, through a directory holding it, or
    // through a directory holding the second mount.
    for (perms, says) in [
        (json!({"read": [at("")]}), format!("the masked {}", site.path.join("state").display())),
        (json!({"read": [mirror.str()]}), "would be shown at".to_string()),
        (json!({"read": [at("state")]}), format!("the masked {}", site.path.join("state").display())),
        (json!({"read": [at("private/secrets.key")]}), "key material (secrets.key_file".to_string()),
        (json!({"write": [at("state")]}), "the agent's own files".to_string()),
        (json!({"write": [at("")]}), "the agent's own files".to_string()),
        (json!({"write": [etc.display().to_string()]}), "the host's /etc is a system directory".to_string()),
        (json!({"read": [etc.join("shadow").display().to_string()]}), "/etc/shadow holds host credentials".to_string()),
        (json!({"read": [etc.display().to_string()]}), "the masked /etc/shadow would be shown at".to_string()),
    ] {
        peek(perms.clone(), &[]).cannot_run(&["permissions.filesystem.", &says]);
    }
    // A write grant beneath the second mount of `/etc` is `/etc` too (the first directory
    // there, whatever the host has).
    let sub = std::fs::read_dir("/etc")
        .unwrap()
        .filter_map(Result::ok)
        .find(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .expect("a directory in /etc");
    let beneath = etc.join(sub.file_name()).display().to_string();
    peek(json!({"write": [beneath]}), &[]).cannot_run(&["the host's /etc is a system directory", "never granted"]);
}

/// A write grant takes what is mounted beneath it along: a directory every host user may
/// write to, mounted there (a bind of `/var/tmp`, a mode-1777 tmpfs), is as shared as the
/// declared path itself would be, and refused the same way.
#[test]
fn a_write_grant_holding_a_mount_every_user_may_write_to_is_refused() {
    if !require_root() {
        return;
    }
    let work = HostDir::new();
    let beneath = work.path.join("shared");
    std::fs::create_dir(&beneath).unwrap();
    let everyones = HostDir::new();
    std::fs::set_permissions(&everyones.path, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let d = executor(json!({"permissions": {"filesystem": {"write": [work.str()]}}}), LIFECYCLE);
    // Without the mount the grant is an ordinary one.
    let r = run_with_binds(&d.path, &[], &[]).result();
    assert_eq!(r["status"], "completed", "{r}");
    run_with_binds(&d.path, &[], &[(&everyones.path, &beneath)]).cannot_run(&[
        "permissions.filesystem.write[0]:",
        &format!("{} is mounted beneath it, and every user of the host may write there", beneath.display()),
    ]);
}

#[test]
fn command_line_errors_are_refused() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), LIFECYCLE);
    run(&d.path, &["--action", "act-nope"]).cannot_run(&["--action act-nope", "act-test, act-other"]);
    run(&d.path, &["--params", "[1, 2]"]).cannot_run(&["--params", "JSON object"]);
    run(&d.path, &["--params", "\"text\""]).cannot_run(&["--params", "JSON object"]);
    run(&d.path, &["--params", "{\"a\": "]).cannot_run(&["--params", "not valid JSON"]);
    // As strict as a signed command's parameters: no duplicate keys, no inexact integers.
    run(&d.path, &["--params", r#"{"a": 1, "a": 2}"#]).cannot_run(&["--params", "duplicate"]);
    run(&d.path, &["--params", r#"{"a": 9007199254740993}"#]).cannot_run(&["--params", "exactly"]);
    run(&d.path, &["--params", "@/nonexistent/params.json"]).cannot_run(&["--params @/nonexistent/params.json"]);
    let missing = d.path.join("no-such-executor");
    run(&missing, &[]).cannot_run(&["no-such-executor"]);
    // A directory without a manifest, or with a broken one.
    let empty = HostDir::new();
    run(&empty.path, &[]).cannot_run(&["manifest.json", "cannot read"]);
    let bad = executor_text("{\"name\": ", LIFECYCLE);
    run(&bad.path, &[]).cannot_run(&["manifest.json: not valid JSON"]);
    // A value quoted in the error cannot drive the terminal: control characters are escaped.
    let mut m = base_manifest();
    m["entry_point"] = json!("m.C\u{1b}[31m");
    let esc = executor_text(&m.to_string(), LIFECYCLE);
    let out = run(&esc.path, &[]);
    out.cannot_run(&["entry_point", "m.C\\u{1b}[31m"]);
    assert!(!out.stderr.contains('\u{1b}'), "{out:?}");
    let arr = executor_text("[]", LIFECYCLE);
    run(&arr.path, &[]).cannot_run(&["manifest.json: must be a JSON object"]);
}

#[test]
fn unsatisfied_requirements_are_refused() {
    if !require_root() {
        return;
    }
    run_patched(json!({"requirements": {"python": ">=4"}}))
        .cannot_run(&["requirements.python:", "'>=4' is not satisfied by the embedded Python 3."]);
    run_patched(json!({"requirements": {"python": "<3.0"}})).cannot_run(&["requirements.python:"]);
    run_patched(json!({"requirements": {"python": "=>3.9"}})).cannot_run(&["requirements.python:", "operator"]);
    run_patched(json!({"requirements": {"packages": ["requests==2.31"]}})).cannot_run(&[
        "requirements.packages:",
        "requests==2.31",
        "not installed",
    ]);
}

#[test]
fn invalid_config_is_refused() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), LIFECYCLE);
    let c = config("agent:\n  idd: typo\n", None);
    run(&d.path, &["--config", c.arg()]).cannot_run(&["idd"]);
    let c = config("resource_limits:\n  default_memory_mb: 600\n", None);
    run(&d.path, &["--config", c.arg()]).cannot_run(&["resource_limits.default_memory_mb", "ceiling"]);
    for idle in ["0", "86401"] {
        let c = config(&format!("agent:\n  warm_pool_idle_seconds: {idle}\n"), None);
        run(&d.path, &["--config", c.arg()]).cannot_run(&["agent.warm_pool_idle_seconds", "1-86400"]);
    }
    let c = config("agent: [unclosed\n", None);
    run(&d.path, &["--config", c.arg()]).cannot_run(&[c.arg()]);
    let c = config("secrets:\n  provider: hsm\n", None);
    run(&d.path, &["--config", c.arg()]).cannot_run(&["secrets.provider"]);
    run(&d.path, &["--config", "/nonexistent/config.yaml"]).cannot_run(&["/nonexistent/config.yaml", "cannot read"]);
    // A secrets file others can read is refused (fail closed).
    let c = config("", Some("api_key: abc\n"));
    std::fs::set_permissions(c.secrets.as_ref().unwrap(), std::fs::Permissions::from_mode(0o644)).unwrap();
    run(&d.path, &["--config", c.arg()]).cannot_run(&["secrets.file", "mode 0600"]);
    let c = config("", Some("- not\n- a map\n"));
    let d2 = executor(json!({"permissions": {"secrets": ["api_key"]}}), LIFECYCLE);
    run(&d2.path, &["--config", c.arg()]).cannot_run(&["secrets.file", "not a map"]);
}

// ---------------------------------------------------------------------------------------
// executor lint
// ---------------------------------------------------------------------------------------

#[test]
fn lint_reports_ok_errors_and_warnings() {
    if !require_root() {
        return;
    }
    let good = executor(json!({}), LIFECYCLE);
    let out = lint(&good.path, false);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.stdout, format!("{}: ok (0 warnings)\n", good.path.display()));

    let bad = executor(json!({"version": "one"}), LIFECYCLE);
    let out = lint(&bad.path, false);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stdout.contains(&format!("{}: error: version: 'one' is not a semantic version", bad.path.display())),
        "{out:?}"
    );
    assert!(!out.stdout.contains(": ok"), "{out:?}");

    // Every broken rule is listed at once (run stops at the first).
    let many = executor(
        json!({"name": "Bad_Name", "version": "one", "resource_limits": {"max_cpu_percent": 500, "timeout_seconds": 0}}),
        LIFECYCLE,
    );
    let out = lint(&many.path, false);
    assert_eq!(out.code, 1, "{out:?}");
    for field in ["name", "version", "resource_limits.max_cpu_percent", "resource_limits.timeout_seconds"] {
        assert!(out.stdout.contains(&format!("error: {field}: ")), "{field}: {out:?}");
    }

    let warn = executor(
        json!({"homepage": "x", "permissions": {"network": {"outbound": false, "allowed_ports": [1, 65535]}},
               "resource_limits": {"max_memory_mb": 1024}}),
        LIFECYCLE,
    );
    let out = lint(&warn.path, false);
    assert_eq!(out.code, 0, "warnings only: {out:?}");
    assert!(out.stdout.contains("warning: homepage: unknown top-level key"), "{out:?}");
    assert!(
        out.stdout.contains("warning: permissions.network.allowed_ports: two bare numbers are two single ports"),
        "{out:?}"
    );
    assert!(out.stdout.contains("warning: resource_limits.max_memory_mb: 1024 will be clamped to 512"), "{out:?}");
    assert!(
        out.stdout.contains("warning: permissions.network: hosts and ports are declared but outbound is false"),
        "{out:?}"
    );
    assert!(out.stdout.ends_with("ok (4 warnings)\n"), "{out:?}");

    let out = lint(&warn.path, true);
    assert_eq!(out.code, 0);
    let j: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(j["errors"], json!([]));
    assert_eq!(j["warnings"].as_array().unwrap().len(), 4);

    let out = lint(&bad.path, true);
    assert_eq!(out.code, 1);
    let j: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(j["errors"].as_array().unwrap().len(), 1);

    // Installed requirements are a directory of the package's own: a `.deps` that is a
    // link (here to the host's root) is an error for lint as for run, never followed.
    let linked = executor(json!({}), LIFECYCLE);
    std::os::unix::fs::symlink("/", linked.path.join(".deps")).unwrap();
    let out = lint(&linked.path, false);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stdout.contains(".deps: not a directory, or a symbolic link"), "{out:?}");

    // A package's manifest is a file of its own: a link out of the package (to a root-only
    // file, whose values lint quoted) is refused, never followed — by lint and run alike.
    let outside = executor(json!({}), LIFECYCLE);
    let linked = executor(json!({}), LIFECYCLE);
    std::fs::remove_file(linked.path.join("manifest.json")).unwrap();
    std::os::unix::fs::symlink(outside.path.join("manifest.json"), linked.path.join("manifest.json")).unwrap();
    let out = lint(&linked.path, false);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("manifest.json: a symbolic link"), "{out:?}");
    let out = run(&linked.path, &[]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("manifest.json: a symbolic link"), "{out:?}");

    // Seed 000's layout has a requirements.txt; nothing reads it, and lint says so.
    let reqs = executor(json!({}), LIFECYCLE);
    std::fs::write(reqs.path.join("requirements.txt"), "requests\n").unwrap();
    let out = lint(&reqs.path, false);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("warning: requirements.txt: not read"), "{out:?}");
    assert!(out.stdout.ends_with("ok (1 warning)\n"), "{out:?}");

    // The seed executor lints clean.
    let out = lint(&port_scanner_dir(), false);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains(": ok ("), "{out:?}");
}

#[test]
fn hostile_manifests_are_refused_cleanly_by_lint_and_run() {
    let good = base_manifest().to_string();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        // 5 MiB (valid JSON padded with spaces): refused unread past the limit.
        (format!("{good}{}", " ".repeat(5 << 20)).into_bytes(), "larger than the 1048576 bytes a manifest may have"),
        (
            [&good.as_bytes()[..good.len() - 1], &b",\"author\": \"\xc3\x28\"}"[..]].concat(),
            "not UTF-8 (invalid bytes at offset",
        ),
        (
            format!("{{\"name\": {}{}}}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
            "nested more than 32 deep",
        ),
    ];
    for (manifest, needle) in cases {
        let d = HostDir::new();
        put(&d.path, "manifest.json", &manifest);
        put(&d.path, "test_executor/__init__.py", LIFECYCLE.as_bytes());
        for out in [lint(&d.path, false), run(&d.path, &[])] {
            assert_eq!(out.code, 2, "{needle}: {out:?}");
            assert!(out.stdout.is_empty(), "{out:?}");
            assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
            assert!(out.stderr.contains(needle) && out.stderr.contains("manifest.json"), "{needle}: {}", out.stderr);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Secrets
// ---------------------------------------------------------------------------------------

const SECRETS: &str = r#"
import hashlib
import os
import sys

from opservant.executor import BaseExecutor, ExecutorResult

SCRATCH = "/tmp/opservant/scratch"


def proc_hits(value):
    # Every environment and command line this sandbox can see.
    hits = []
    for pid in os.listdir("/proc"):
        if not (pid.isdigit() or pid in ("self", "thread-self")):
            continue
        for f in ("environ", "cmdline"):
            try:
                with open("/proc/%s/%s" % (pid, f), "rb") as fh:
                    if value.encode() in fh.read():
                        hits.append("/proc/%s/%s" % (pid, f))
            except OSError:
                pass
    return hits


def file_hits(value, roots):
    hits, scanned = [], 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in filenames:
                p = os.path.join(dirpath, name)
                try:
                    if os.path.islink(p) or os.path.getsize(p) > (1 << 20):
                        continue
                    with open(p, "rb") as fh:
                        data = fh.read()
                    scanned += 1
                    if value.encode() in data:
                        hits.append(p)
                except OSError:
                    pass
    return hits, scanned


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        vault, log, mode = context["vault"], context["logger"], params["mode"]
        if mode == "ask":
            out = {}
            for name in params["names"]:
                try:
                    vault.get_secret(name)
                    out[name] = "granted"
                except PermissionError as e:
                    out[name] = "PermissionError: %s" % e
            return ExecutorResult(output=out)
        if mode == "number":
            # A numeric secret returned as a number, not as text.
            pin = vault.get_secret("pin")
            return ExecutorResult(output={"n": int(pin), "f": float(pin), "in": [int(pin) * 10 + 7], "other": 42})
        value = vault.get_secret("api_key")
        digest = hashlib.sha256(value.encode()).hexdigest()
        if mode == "misuse":
            # The value passed where a name goes, and as a log record's level.
            try:
                vault.get_secret(value)
            except PermissionError as e:
                refused = str(e)
            log._log(value, "level misuse", {})
            return ExecutorResult(output={"refused": refused})
        if mode == "raise":
            raise RuntimeError("upstream refused key " + value)
        if mode == "cut":
            # The error is cut at 64 KiB: here inside the secret.
            return ExecutorResult(status="failed", error="x" * 65531 + value)
        if mode == "scan":
            files, scanned = file_hits(value, ["/tmp", "/etc", "/run", "/var", "/home", "/dev/shm",
                                               os.path.dirname(os.path.dirname(__file__))])
            fds = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    fds.append(os.readlink("/proc/self/fd/" + fd))
                except OSError:  # the descriptor listdir itself used
                    pass
            return ExecutorResult(output={
                "sha256": digest,
                "proc_hits": proc_hits(value),
                "file_hits": files,
                "scanned": scanned,
                "fds": fds,
                "secrets_file_visible": os.path.exists(params["secrets_file"]),
                "config_dir_visible": os.path.exists(params["config_file"]),
                "in_os_environ": any(value in v for v in os.environ.values()),
            })
        # mode == "leak": put the value everywhere the result carries.
        print("stdout leak:", value)
        sys.stderr.write("stderr leak: %s\n" % value)
        log.info("log leak " + value, token=value, nested={"k": [value]})
        with open(os.path.join(SCRATCH, "clean.txt"), "w") as f:
            f.write("nothing to see")
        with open(os.path.join(SCRATCH, "leak.txt"), "w") as f:
            f.write("key=" + value)
        return ExecutorResult(
            status="partial",
            output={"sha256": digest, "echo": "value=" + value, value: "as a key"},
            error="error leak " + value,
            artifacts=[SCRATCH + "/clean.txt", SCRATCH + "/leak.txt"],
        )
"#;

/// A numeric secret (`pin` in the store).
const PIN: &str = "4815162342";

fn secret_value() -> String {
    format!("s3cr3t-VALUE-{}-zq", std::process::id())
}

fn secrets_setup(declared: Value) -> (HostDir, Conf) {
    let d = executor(json!({"permissions": {"secrets": declared}}), SECRETS);
    let c = config(
        "agent:\n  id: ag-secrets\n",
        Some(&format!("api_key: {}\nother_key: other-{}\npin: \"{PIN}\"\n", secret_value(), std::process::id())),
    );
    (d, c)
}

#[test]
fn undeclared_secret_is_denied_inside_and_audited() {
    if !require_root() {
        return;
    }
    let (d, c) = secrets_setup(json!(["api_key", "not_in_store"]));
    let out = run(
        &d.path,
        &["--config", c.arg(), "--params", r#"{"mode": "ask", "names": ["other_key", "not_in_store", "api_key"]}"#],
    );
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["output"]["other_key"], "PermissionError: secret 'other_key' is not declared in permissions.secrets");
    assert_eq!(
        r["output"]["not_in_store"],
        "PermissionError: secret 'not_in_store' is not available from the configured provider"
    );
    assert_eq!(r["output"]["api_key"], "granted");
    let denied: Vec<&str> = out.stderr.lines().filter(|l| l.contains("event=\"secret_denied\"")).collect();
    assert_eq!(denied.len(), 2, "{}", out.stderr);
    assert!(denied[0].contains("\"secret\":\"other_key\"") && denied[0].contains("not declared"), "{}", denied[0]);
    assert!(denied[0].contains("\"executor\":\"test-executor\""), "{}", denied[0]);
    // With the run's command id (empty from the command line), whatever the reason.
    assert!(denied.iter().all(|d| d.contains("\"command_id\":\"\"")), "{denied:?}");
    assert!(denied[1].contains("\"secret\":\"not_in_store\""), "{}", denied[1]);
    let granted: Vec<&str> = out.stderr.lines().filter(|l| l.contains("event=\"secret_access\"")).collect();
    assert_eq!(granted.len(), 1, "{}", out.stderr);
    assert!(granted[0].contains("\"secret\":\"api_key\""));
    assert!(!out.stderr.contains(&secret_value()), "the audit names secrets, never values");
    assert!(!out.stdout.contains(&secret_value()));

    // No provider configured at all: a declared secret is simply unavailable.
    let r = run(&d.path, &["--params", r#"{"mode": "ask", "names": ["api_key"]}"#]).result();
    assert_eq!(
        r["output"]["api_key"],
        "PermissionError: secret 'api_key' is not available from the configured provider"
    );
}

#[test]
fn a_secret_value_passed_as_a_name_or_a_log_level_is_redacted() {
    if !require_root() {
        return;
    }
    let (d, c) = secrets_setup(json!(["api_key"]));
    let out =
        run_env(&d.path, &["--config", c.arg(), "--params", r#"{"mode": "misuse"}"#], &[("OPSERVANT_LOG", "info")]);
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    assert!(r["output"]["refused"].as_str().unwrap().contains("is not declared"), "{r}");
    let denied: Vec<&str> = out.stderr.lines().filter(|l| l.contains("event=\"secret_denied\"")).collect();
    assert_eq!(denied.len(), 1, "{}", out.stderr);
    assert!(denied[0].contains("[REDACTED]"), "{}", denied[0]);
    assert!(out.stderr.contains("level misuse"), "the executor's log reaches the agent's log: {}", out.stderr);
    assert!(!out.stderr.contains(&secret_value()), "{}", out.stderr);
    assert!(!out.stdout.contains(&secret_value()), "{}", out.stdout);
}

/// An executor asking for ever new names cannot write the audit log without bound: each
/// refused name is audited once, the first 20, then one record says the rest are counted
/// only; a declared secret asked for again is audited once per run.
#[test]
fn secret_requests_cannot_flood_the_audit_log() {
    if !require_root() {
        return;
    }
    let (d, c) = secrets_setup(json!(["api_key"]));
    let mut names: Vec<String> = (0..40).map(|i| format!("undeclared_{i}")).collect();
    names.extend(names.clone());
    names.extend(["api_key".to_string(), "api_key".to_string(), "api_key".to_string()]);
    let params = json!({"mode": "ask", "names": names}).to_string();
    let out = run(&d.path, &["--config", c.arg(), "--params", &params]);
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(
        r["output"]["undeclared_39"],
        "PermissionError: secret 'undeclared_39' is not declared in permissions.secrets"
    );
    assert_eq!(r["output"]["api_key"], "granted");
    let denied: Vec<&str> = out.stderr.lines().filter(|l| l.contains("event=\"secret_denied\"")).collect();
    assert_eq!(denied.len(), 21, "{}", denied.join("\n"));
    assert!(denied[19].contains("undeclared_19") && !denied[19].contains("further_denials"), "{}", denied[19]);
    assert!(
        denied[20].contains("undeclared_20") && denied[20].contains("further_denials_counted_only_after"),
        "{}",
        denied[20]
    );
    let granted = out.stderr.lines().filter(|l| l.contains("event=\"secret_access\"")).count();
    assert_eq!(granted, 1, "{}", out.stderr);
}

/// A run asks its secret provider about each name once — a loop on a granted or unknown
/// name is answered from what it said — and at most 1000 times: past that a name not yet
/// answered is refused without asking (each provider request is a request, with Vault
/// after a 403 a fresh login and token).
#[test]
fn secret_requests_are_bounded_per_run() {
    if !require_root() {
        return;
    }
    let many: Vec<String> = (0..1000).map(|i| format!("s{i}")).collect();
    let mut declared = many.clone();
    declared.extend(["api_key".to_string(), "other_key".to_string()]);
    let (d, c) = secrets_setup(json!(declared));
    let mut names = vec!["api_key".to_string(); 1500];
    names.extend(many.iter().cloned());
    names.extend(["s0".to_string(), "api_key".to_string(), "other_key".to_string()]);
    let params = json!({"mode": "ask", "names": names}).to_string();
    let out = run(&d.path, &["--config", c.arg(), "--params", &params]);
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    // 1500 requests for one granted name: one provider request.
    assert_eq!(r["output"]["api_key"], "granted", "{r}");
    assert_eq!(r["output"]["s0"], "PermissionError: secret 's0' is not available from the configured provider");
    assert_eq!(
        r["output"]["other_key"],
        "PermissionError: secret 'other_key' refused: 1000 provider requests made in this run",
        "{r}"
    );
    // Every refusal audited or counted: 21 of the 1000 unavailable names audited (the 21st
    // saying that the rest are counted only), 979 counted, and the capped request too.
    assert!(
        out.stderr.contains("unaudited=980"),
        "{}",
        out.stderr.lines().filter(|l| l.contains("unaudited")).collect::<String>()
    );
}

/// A secret returned as a JSON number (`int(value)`) is redacted as its text would be: the
/// number becomes the redacted string.
#[test]
fn a_numeric_secret_returned_as_a_number_is_redacted() {
    if !require_root() {
        return;
    }
    let (d, c) = secrets_setup(json!(["pin"]));
    let out = run(&d.path, &["--config", c.arg(), "--params", r#"{"mode": "number"}"#]);
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    assert!(!out.stdout.contains(PIN), "the secret in the result: {}", out.stdout);
    // `f` equals the value as a number (its text `4815162342.0` holds it too).
    assert_eq!(r["output"], json!({"n": "[REDACTED]", "f": "[REDACTED]", "in": ["[REDACTED]7"], "other": 42}));
}

#[test]
fn declared_secret_is_delivered_and_redacted_everywhere() {
    if !require_root() {
        return;
    }
    let value = secret_value();
    let (d, c) = secrets_setup(json!(["api_key"]));
    // OPSERVANT_LOG=info: the executor's log records also go to the agent's own stderr.
    let out = run_env(&d.path, &["--config", c.arg(), "--params", r#"{"mode": "leak"}"#], &[("OPSERVANT_LOG", "info")]);
    let r = out.result();
    assert_eq!(r["status"], "partial", "{r}");
    // The executor got the right value.
    assert_eq!(r["output"]["sha256"], sha256_hex(value.as_bytes()));
    // ... and it appears nowhere in what leaves the agent.
    assert!(!out.stdout.contains(&value), "secret value in the result: {}", out.stdout);
    assert!(!out.stderr.contains(&value), "secret value in the agent's stderr: {}", out.stderr);
    assert_eq!(r["output"]["echo"], "value=[REDACTED]");
    assert_eq!(r["output"]["[REDACTED]"], "as a key");
    assert_eq!(r["error"], "error leak [REDACTED]");
    assert_eq!(r["stdout"], "stdout leak: [REDACTED]\n");
    assert_eq!(r["stderr"], "stderr leak: [REDACTED]\n");
    let rec = r["logs"].as_array().unwrap().iter().find(|l| l["msg"] == "log leak [REDACTED]").expect("log record");
    assert_eq!(rec["fields"], json!({"token": "[REDACTED]", "nested": {"k": ["[REDACTED]"]}}));
    // Artifacts: the clean one comes back, the one holding the secret is withheld.
    let arts = r["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 2, "{}", r["artifacts"]);
    assert_eq!(b64(arts[0]["content_base64"].as_str().unwrap()), b"nothing to see");
    assert_eq!(arts[1]["content_base64"], Value::Null);
    assert!(arts[1]["error"].as_str().unwrap().contains("contains a secret"), "{}", arts[1]);

    // An exception carrying the value: the traceback is redacted too.
    let out = run(&d.path, &["--config", c.arg(), "--params", r#"{"mode": "raise"}"#]);
    let r = out.result();
    assert_eq!(r["status"], "failed");
    assert!(!out.stdout.contains(&value), "{}", out.stdout);
    assert!(r["error"].as_str().unwrap().contains("RuntimeError: upstream refused key [REDACTED]"), "{r}");

    // An error cut at its cap inside the secret: redacted before the cut, no prefix shows.
    let out = run(&d.path, &["--config", c.arg(), "--params", r#"{"mode": "cut"}"#]);
    let r = out.result();
    let error = r["error"].as_str().unwrap();
    assert!(error.contains("byte cap]") && !error.contains(&value[..5]), "{}", &error[65000..]);
}

#[test]
fn secrets_never_reach_the_environment_or_files() {
    if !require_root() {
        return;
    }
    let value = secret_value();
    let (d, c) = secrets_setup(json!(["api_key"]));
    let params = json!({"mode": "scan", "secrets_file": c.secrets.as_ref().unwrap(), "config_file": c.config});
    let out = run(&d.path, &["--config", c.arg(), "--params", &params.to_string()]);
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    let o = &r["output"];
    assert_eq!(o["sha256"], sha256_hex(value.as_bytes()), "the executor did get the secret");
    assert_eq!(o["proc_hits"], json!([]), "no environ/cmdline in the sandbox holds the value");
    assert_eq!(o["in_os_environ"], false);
    assert_eq!(o["file_hits"], json!([]), "no file in the sandbox holds the value");
    assert!(o["scanned"].as_u64().unwrap() > 10, "the scan looked at files: {o}");
    assert_eq!(o["secrets_file_visible"], false);
    assert_eq!(o["config_dir_visible"], false);
    let secrets_path = c.secrets.as_ref().unwrap().to_str().unwrap().to_string();
    for fd in o["fds"].as_array().unwrap() {
        assert!(!fd.as_str().unwrap().contains(&secrets_path), "open descriptor on the secrets file: {o}");
    }
    assert!(!out.stdout.contains(c.dir.str()), "no config paths in the result");
}

// ---------------------------------------------------------------------------------------
// Output caps
// ---------------------------------------------------------------------------------------

const CAPS: &str = r#"
import sys

from opservant.executor import BaseExecutor, ExecutorResult


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        mode, log = params["mode"], context["logger"]
        if mode == "streams":
            sys.stdout.write("o" * (2 << 20))
            sys.stdout.flush()
            sys.stderr.write("e" * (3 << 20))
            sys.stderr.flush()
            return ExecutorResult(output={"ok": True})
        if mode == "output":
            return ExecutorResult(output={"blob": "y" * (5 << 20)})
        if mode == "output_just_under":
            return ExecutorResult(output={"blob": "y" * ((4 << 20) - 100)})
        if mode == "many_logs":
            for i in range(1500):
                log.info("record %d" % i, i=i)
            return ExecutorResult(output={"ok": True})
        if mode == "chatty_then_gone":
            import os
            for i in range(1100):
                log.info("item", i=i)
            os._exit(3)
        if mode == "chatty":
            for i in range(101001):
                log.info("item", i=i)
            return ExecutorResult(output={"ok": True})
        if mode == "big_logs":
            big = "z" * (1 << 20)
            for i in range(64):
                log.info(big, i=i)
            return ExecutorResult(output={"ok": True})
        raise ValueError(mode)
"#;

#[test]
fn stdout_and_stderr_are_capped_and_marked() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), CAPS);
    let r = run_params(&d.path, &json!({"mode": "streams"})).result();
    assert_eq!(r["status"], "completed", "truncation is not a failure");
    assert_eq!(r["output"], json!({"ok": true}));
    assert_eq!(r["stdout_truncated"], true);
    assert_eq!(r["stderr_truncated"], true);
    let (so, se) = (r["stdout"].as_str().unwrap(), r["stderr"].as_str().unwrap());
    assert_eq!(so.len(), 1 << 20, "stdout kept up to the 1 MiB cap");
    assert_eq!(se.len(), 1 << 20, "stderr kept up to the 1 MiB cap");
    assert!(so.bytes().all(|b| b == b'o') && se.bytes().all(|b| b == b'e'));

    // Small output is not marked.
    let r = run_params(&d.path, &json!({"mode": "output_just_under"})).result();
    assert_eq!(r["stdout_truncated"], false);
}

#[test]
fn output_over_four_mib_fails_clearly() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), CAPS);
    let r = run_params(&d.path, &json!({"mode": "output"})).result();
    assert_eq!(r["status"], "failed");
    assert_eq!(r["output"], Value::Null);
    let err = r["error"].as_str().unwrap();
    assert!(err.contains("over the 4194304 byte cap"), "{err}");
    // Just under the cap is fine.
    let r = run_params(&d.path, &json!({"mode": "output_just_under"})).result();
    assert_eq!(r["status"], "completed");
    assert_eq!(r["output"]["blob"].as_str().unwrap().len(), (4 << 20) - 100);
}

#[test]
fn logs_are_capped_by_count_and_size() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), CAPS);
    let r = run_params(&d.path, &json!({"mode": "many_logs"})).result();
    assert_eq!(r["status"], "completed");
    let logs = r["logs"].as_array().unwrap();
    assert_eq!(logs.len(), 1001, "1000 records and a note");
    assert_eq!(logs[0], json!({"level": "info", "msg": "record 0", "fields": {"i": 0}}));
    assert_eq!(logs[999]["msg"], "record 999");
    assert_eq!(logs[1000]["level"], "warning");
    assert!(logs[1000]["msg"].as_str().unwrap().starts_with("500 more log records dropped"), "{}", logs[1000]);

    // A chatty executor — more records than the agent stops a flood at — is no flood: the
    // runtime stops sending at the caps and counts the rest.
    let d = executor(json!({"resource_limits": {"max_cpu_percent": 50}}), CAPS);
    let r = run_params(&d.path, &json!({"mode": "chatty"})).result();
    assert_eq!(r["status"], "completed", "{r}");
    let logs = r["logs"].as_array().unwrap();
    assert_eq!(logs.len(), 1001, "1000 records and a note");
    assert!(logs[1000]["msg"].as_str().unwrap().starts_with("100001 more log records dropped"), "{}", logs[1000]);
    // A run that ends without its result (where the runtime's count travels) still says
    // records were dropped.
    let r = run_params(&d.path, &json!({"mode": "chatty_then_gone"})).result();
    assert_eq!(r["status"], "failed", "{r}");
    let logs = r["logs"].as_array().unwrap();
    assert_eq!(logs.len(), 1001, "1000 records and a note");
    assert!(logs[1000]["msg"].as_str().unwrap().contains("how many is unknown"), "{}", logs[1000]);

    // 64 records of 1 MiB: the agent does not keep (or print) 64 MiB of logs.
    let out = run_params(&d.path, &json!({"mode": "big_logs"}));
    let r = out.result();
    assert_eq!(r["status"], "completed", "{}", out.stderr);
    let logs = r["logs"].as_array().unwrap();
    let kept_bytes: usize = logs.iter().map(|l| l.to_string().len()).sum();
    assert!(kept_bytes <= 2 << 20, "log records kept in the result: {kept_bytes} bytes");
    let note = logs.last().unwrap()["msg"].as_str().unwrap();
    assert!(note.contains("more log records dropped"), "{note}");
    assert!(out.stdout.len() < 4 << 20, "result is {} bytes", out.stdout.len());
}

// ---------------------------------------------------------------------------------------
// Artifacts
// ---------------------------------------------------------------------------------------

const ARTIFACTS: &str = r#"
import os

from opservant.executor import BaseExecutor, ExecutorResult

SCRATCH = "/tmp/opservant/scratch"
PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        mode = params["mode"]
        if mode == "good":
            os.makedirs(SCRATCH + "/sub", exist_ok=True)
            with open(SCRATCH + "/report.bin", "wb") as f:
                f.write(bytes(range(256)) * 3 + b"\x00end")
            with open(SCRATCH + "/sub/notes.txt", "w") as f:
                f.write("hello artifacts\n")
            return ExecutorResult(output={}, artifacts=[SCRATCH + "/report.bin", "sub/notes.txt",
                                                         {"path": SCRATCH + "/sub/notes.txt"}])
        if mode == "symlinks":
            os.symlink(PKG + "/manifest.json", SCRATCH + "/manifest-link.json")
            os.symlink(PKG, SCRATCH + "/pkg")
            os.makedirs(SCRATCH + "/real", exist_ok=True)
            os.symlink(SCRATCH + "/real", SCRATCH + "/alias")
            with open(SCRATCH + "/real/data.txt", "w") as f:
                f.write("data")
            readable = open(SCRATCH + "/manifest-link.json").read()  # the link itself works
            return ExecutorResult(output={"via_link": len(readable)}, artifacts=[
                SCRATCH + "/manifest-link.json",
                SCRATCH + "/pkg/manifest.json",
                SCRATCH + "/alias/data.txt",
                SCRATCH + "/real/data.txt",
                PKG + "/manifest.json",
                "/etc/passwd",
                SCRATCH + "/../../../etc/passwd",
                SCRATCH + "/real",
                SCRATCH + "/missing.txt",
                {"name": "no path here"},
            ])
        if mode == "sizes":
            names = []
            for i, mib in enumerate([5, 3, 3, 3]):
                p = "%s/f%d.bin" % (SCRATCH, i)
                with open(p, "wb") as f:
                    f.write(b"a" * (mib << 20))
                names.append(p)
            return ExecutorResult(output={}, artifacts=names)
        if mode == "data":
            blob = bytes(range(256)) + b"\x00end"
            return ExecutorResult(output={}, artifacts=[
                blob,
                {"path": "reports/summary.txt", "data": "résumé\n"},
                {"name": "raw.bin", "data": bytearray(b"\x01\x02")},
                {"path": "../escape.bin", "data": b"x"},
                {"path": "big.bin", "data": bytearray(5 << 20)},
                {"name": "no data", "data": 7},
            ])
        if mode == "data_total":
            return ExecutorResult(output={}, artifacts=[b"a" * (3 << 20), {"data": "x" * (3 << 20)}, bytearray(3 << 20)])
        if mode == "undecodable":
            # A file name that is not UTF-8, as os.listdir gives it (surrogate escapes).
            with open(os.fsdecode(SCRATCH.encode() + b"/bad\xff.txt"), "w") as f:
                f.write("x")
            with open(SCRATCH + "/good.txt", "w") as f:
                f.write("good")
            names = sorted(os.listdir(SCRATCH))
            return ExecutorResult(output={"kept": True}, artifacts=[SCRATCH + "/" + n for n in names])
        raise ValueError(mode)
"#;

#[test]
fn artifacts_come_back_with_sha256_and_content() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), ARTIFACTS);
    let r = run_params(&d.path, &json!({"mode": "good"})).result();
    assert_eq!(r["status"], "completed", "{r}");
    let arts = r["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 3, "{}", r["artifacts"]);
    let mut report: Vec<u8> = (0..=255u8).collect::<Vec<u8>>().repeat(3);
    report.extend_from_slice(b"\x00end");
    assert_eq!(arts[0]["path"], "report.bin");
    assert_eq!(arts[0]["size"], report.len());
    assert_eq!(arts[0]["sha256"], sha256_hex(&report));
    assert_eq!(b64(arts[0]["content_base64"].as_str().unwrap()), report);
    for a in &arts[1..] {
        assert_eq!(a["path"], "sub/notes.txt");
        assert_eq!(a["sha256"], sha256_hex(b"hello artifacts\n"));
        assert_eq!(b64(a["content_base64"].as_str().unwrap()), b"hello artifacts\n");
    }
}

/// Seed 000: artifacts are "file paths or binary data". Bytes come back named `data-INDEX`,
/// a dict's `data` under its `path` or `name`, held to a file's name rules and caps.
#[test]
fn binary_data_comes_back_as_artifacts() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), ARTIFACTS);
    let r = run_params(&d.path, &json!({"mode": "data"})).result();
    assert_eq!(r["status"], "completed", "{r}");
    let arts = r["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 6, "{}", r["artifacts"]);
    let mut blob: Vec<u8> = (0..=255u8).collect();
    blob.extend_from_slice(b"\x00end");
    let summary = "résumé\n".as_bytes();
    for (a, path, content) in [
        (&arts[0], "data-0", &blob[..]),
        (&arts[1], "reports/summary.txt", summary),
        (&arts[2], "raw.bin", &b"\x01\x02"[..]),
    ] {
        assert_eq!(a["path"], path, "{a}");
        assert_eq!(a["size"], content.len(), "{a}");
        assert_eq!(a["sha256"], sha256_hex(content), "{a}");
        assert_eq!(b64(a["content_base64"].as_str().unwrap()), content, "{a}");
    }
    assert_eq!(arts[3]["content_base64"], Value::Null, "{}", arts[3]);
    assert!(arts[3]["error"].as_str().unwrap().contains("without '..'"), "{}", arts[3]);
    assert_eq!(arts[4]["path"], "big.bin");
    // The runtime's refusal (the agent's own names no artifact first), before any copy.
    assert!(arts[4]["error"].as_str().unwrap().starts_with("big.bin: 5242880 bytes, over the"), "{}", arts[4]);
    assert_eq!(arts[5]["path"], "no data");
    assert!(arts[5]["error"].as_str().unwrap().contains("'data' must be bytes or str"), "{}", arts[5]);

    // Data counts against the run's total as files do: the third 3 MiB piece is refused.
    let r = run_params(&d.path, &json!({"mode": "data_total"})).result();
    assert_eq!(r["status"], "completed", "{r}");
    let arts = r["artifacts"].as_array().unwrap();
    assert_eq!((arts[0]["size"].as_u64(), arts[1]["size"].as_u64()), (Some(3 << 20), Some(3 << 20)), "{r}");
    assert_eq!(arts[1]["path"], "data-1");
    assert!(arts[2]["error"].as_str().unwrap().starts_with("data-2: the run's artifacts exceed"), "{}", arts[2]);
}

#[test]
fn artifact_symlinks_are_never_followed() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), ARTIFACTS);
    let r = run_params(&d.path, &json!({"mode": "symlinks"})).result();
    assert_eq!(r["status"], "completed", "{r}");
    assert!(r["output"]["via_link"].as_u64().unwrap() > 0, "the manifest is readable through the link");
    let arts = r["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 10, "{}", r["artifacts"]);
    let err = |i: usize| -> String {
        assert_eq!(arts[i]["content_base64"], Value::Null, "artifact {i} has content: {}", arts[i]);
        assert_eq!(arts[i]["sha256"], Value::Null, "artifact {i}: {}", arts[i]);
        arts[i]["error"].as_str().unwrap_or_else(|| panic!("artifact {i}: {}", arts[i])).to_string()
    };
    assert!(err(0).contains("symbolic links are not followed"), "{}", err(0));
    assert!(err(1).contains("symbolic links are not followed"), "directory component: {}", err(1));
    assert!(err(2).contains("symbolic links are not followed"), "directory component: {}", err(2));
    assert_eq!(arts[3]["path"], "real/data.txt");
    assert_eq!(b64(arts[3]["content_base64"].as_str().unwrap()), b"data");
    assert!(err(4).contains("artifacts must be in /tmp/opservant/scratch"), "{}", err(4));
    assert!(err(5).contains("artifacts must be in /tmp/opservant/scratch"), "{}", err(5));
    assert!(err(6).contains("not a path beneath the scratch directory"), "{}", err(6));
    assert!(err(7).contains("not a regular file"), "{}", err(7));
    assert!(!err(8).is_empty());
    assert!(err(9).contains("path string"), "{}", err(9));
    // Nothing of the executor's manifest leaked into the result through the links.
    assert!(!r.to_string().contains("integration test executor"), "{r}");
}

#[test]
fn an_undecodable_artifact_path_does_not_lose_the_result() {
    if !require_root() {
        return;
    }
    // The path could not be passed to the native side (UnicodeEncodeError, not the OSError
    // caught): the runtime exited and the executor's result was lost.
    let d = executor(json!({}), ARTIFACTS);
    let r = run_params(&d.path, &json!({"mode": "undecodable"})).result();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["output"], json!({"kept": true}), "{r}");
    let arts = r["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 2, "{}", r["artifacts"]);
    assert_eq!(arts[0]["path"], "/tmp/opservant/scratch/bad\\udcff.txt", "{}", arts[0]);
    assert!(arts[0]["error"].as_str().unwrap().contains("not valid UTF-8"), "{}", arts[0]);
    assert_eq!(arts[1]["path"], "good.txt");
    assert_eq!(b64(arts[1]["content_base64"].as_str().unwrap()), b"good");
}

#[test]
fn oversize_artifacts_are_refused() {
    if !require_root() {
        return;
    }
    let d = executor(json!({"resource_limits": {"max_memory_mb": 256}}), ARTIFACTS);
    let r = run_params(&d.path, &json!({"mode": "sizes"})).result();
    assert_eq!(r["status"], "completed", "{}", r["error"]);
    let arts = r["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 4);
    let e0 = arts[0]["error"].as_str().unwrap();
    assert!(e0.contains("5242880 bytes, over the 4194304 byte cap per artifact"), "{e0}");
    assert_eq!(arts[0]["content_base64"], Value::Null);
    // 3 + 3 MiB fit in the 8 MiB run total; the third does not.
    assert_eq!(arts[1]["sha256"], sha256_hex(&[b'a'].repeat(3 << 20)));
    assert_eq!(arts[2]["size"], 3 << 20);
    assert!(arts[3]["error"].as_str().unwrap().contains("exceed 8388608 bytes"), "{}", arts[3]);
}

const FORGED: &str = r#"
import json, os, socket
import _opservant
from opservant.executor import BaseExecutor, ExecutorResult


def _raw(*messages):
    """Each message (bytes) straight to the application channel (fd 4), in the channel's
    framing: packets of 32 KiB after a flag byte, 1 for "more follows", 0 for the last."""
    chan = socket.socket(fileno=4)
    try:
        for msg in messages:
            chunks = [msg[i:i + 32768] for i in range(0, len(msg), 32768)]
            for i, c in enumerate(chunks):
                chan.send(bytes([1 if i + 1 < len(chunks) else 0]) + c)
    finally:
        chan.detach()


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        if params["mode"] == "raw":
            # A result message written straight to the application channel (fd 4), past
            # the runtime's own output cap.
            _raw(json.dumps({"type": "result", "status": "completed", "output": {"x": "a" * (5 << 20)}}).encode())
            # Ended before the runtime sends its own result: the forged one is the only one.
            os._exit(0)
        if params["mode"] == "nested_accepted":
            # Nested one-element arrays, as many as the estimate accepts (each array's smallest
            # vector outweighs its text): parsed whole, it must stay near the estimate.
            unit = b"[" * 120 + b"0" + b"]" * 120
            _raw(b'{"type":"result","status":"completed","output":{"a":[' + b",".join([unit] * 8000) + b"]}}")
            os._exit(0)
        if params["mode"] == "nested":
            # ~10 MB of nested one-key objects straight to the channel: parsed, it took the
            # agent 1.3 GB (2 Mi values, within the old count of values).
            unit = b'{"":' * 120 + b"0" + b"}" * 120
            _raw(b'{"type":"result","status":"completed","output":[' + b",".join([unit] * 17000) + b"]}")
            os._exit(0)
        if params["mode"] == "log_flood":
            # Records of 1 MiB without end, written straight to the channel (the runtime's
            # own logger stops sending at the caps): each costs the agent a copy and a parse,
            # its CPU and not the sandbox's.
            msg = json.dumps({"type": "log", "level": "info", "msg": "z" * (1 << 20), "fields": {}}).encode()
            while True:
                _raw(msg)
        if params["mode"] == "reset":
            # A secret asked for and its answer never read, then records and a result, and
            # an end: the agent hears of the unread answer (a reset) before the rest.
            logs = [{"type": "log", "level": "info", "msg": "m%d" % i, "fields": {"pad": "p" * 200}} for i in range(600)]
            result = {"type": "result", "status": "completed", "output": {"mine": True}}
            _raw(*[json.dumps(m).encode() for m in [{"type": "secret_request", "name": "undeclared"}] + logs + [result]])
            os._exit(0)
        if params["mode"] == "twice":
            # A result of its own, and then the runtime's: a second result.
            _opservant.send_result({"status": "completed", "output": {"forged": True}})
            return ExecutorResult(output={"honest": True})
        fake = {"path": "/etc/passwd", "size": 1, "sha256": "00", "content_base64": "aGVsbG8="}
        wrong = {"path": "ok.txt", "size": 999, "sha256": "00", "content_base64": "aGVsbG8="}
        _opservant.send_result({"status": "failed", "output": {}, "error": "e" * 200000,
                                "artifacts": [fake, wrong, {"path": "x"}] + [{"path": "n", "error": "e"}] * 1200})
        os._exit(0)
"#;

/// What the payload sends is untrusted: a result written straight to the channel, or through
/// the runtime's own function, is held to the caps and shapes the runtime keeps; a second
/// result (executor code's own, then the runtime's) breaks the protocol and fails the run,
/// whatever the first one said.
#[test]
fn a_forged_result_is_held_to_the_caps() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), FORGED);
    let r = run_params(&d.path, &json!({"mode": "raw"})).result();
    assert_eq!(r["status"], "failed", "{}", r["error"]);
    assert!(r["error"].as_str().unwrap().contains("over the 4194304 byte cap"), "{}", r["error"]);
    assert_eq!(r["output"], Value::Null);

    let r = run_params(&d.path, &json!({"mode": "runtime"})).result();
    assert_eq!(r["status"], "failed", "{}", r["status"]);
    let error = r["error"].as_str().unwrap();
    assert!(error.len() < 66 * 1024 && error.ends_with("over the 65536 byte cap]"), "{} bytes", error.len());
    let arts = r["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 1001, "1000 entries and one saying the rest were dropped");
    assert!(arts[0]["error"].as_str().unwrap().contains("not a path beneath"), "{}", arts[0]);
    assert_eq!((arts[1]["path"].clone(), arts[1]["size"].clone()), (json!("ok.txt"), json!(5)), "{}", arts[1]);
    assert_eq!(arts[1]["sha256"], sha256_hex(b"hello"));
    assert!(arts[2]["error"].as_str().unwrap().contains("no valid content"), "{}", arts[2]);
    assert!(arts[1000]["error"].as_str().unwrap().contains("203 more artifact entries dropped"), "{}", arts[1000]);

    let r = run_params(&d.path, &json!({"mode": "twice"})).result();
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["error"], "the executor runtime misbehaved: a second result", "{r}");
    assert_eq!(r["output"], Value::Null, "{r}");

    // A payload that ends with an answer of the agent's unread: its result, sent before it
    // ended, is still its result (the reset the kernel reports first lost it).
    let r = run_params(&d.path, &json!({"mode": "reset"})).result();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["output"], json!({"mine": true}), "{r}");
}

const FD_PASSING: &str = r#"
import array, os, socket, sys, time
from opservant.executor import BaseExecutor, ExecutorResult


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        path = params["shared"] + "/sock"
        if params["mode"] == "hold":
            # Takes the descriptors another run hands it, holds them until told to let go,
            # and writes into them meanwhile.
            # Listening before its name appears: the giver connects as soon as it sees it.
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path + ".tmp")
            s.listen(1)
            os.rename(path + ".tmp", path)
            c, _ = s.accept()
            _, anc, _, _ = c.recvmsg(16, socket.CMSG_SPACE(3 * 4))
            fds = array.array("i")
            for _, _, data in anc:
                fds.frombytes(data[: len(data) - len(data) % 4])
            open(params["shared"] + "/held", "w").close()
            while not os.path.exists(params["shared"] + "/release"):
                try:
                    os.write(fds[1], b"written by another sandbox\n")
                except OSError:
                    pass
                time.sleep(0.05)
            return ExecutorResult(output={"held": len(fds)})
        # give: its application channel and both output pipes, then a result of its own.
        while not os.path.exists(path):
            time.sleep(0.05)
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)
        c.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [4, 1, 2]).tobytes())])
        c.close()
        while not os.path.exists(params["shared"] + "/held"):
            time.sleep(0.05)
        print("the giver's own output")
        return ExecutorResult(output={"gave": 3})
"#;

/// A payload that hands its application channel and output pipes to a process of another
/// sandbox (over a socket in a write grant both share) does not hold its run open: once the
/// giver's processes are gone its run ends with its own result and output, while the holder
/// still holds — and writes into — them. The agent's slot, its drain on SIGTERM, and the
/// giver's result were otherwise the holder's for as long as it lived.
#[test]
fn descriptors_passed_to_another_sandbox_do_not_hold_a_run_open() {
    if !require_root() {
        return;
    }
    let shared = HostDir::new();
    shared.chown_to_executor();
    let manifest =
        json!({"permissions": {"filesystem": {"write": [shared.str()]}}, "resource_limits": {"timeout_seconds": 60}});
    let d = executor(manifest, FD_PASSING);
    let params = |mode: &str| json!({"mode": mode, "shared": shared.str()}).to_string();
    // Killed should the test fail before it lets the holder go.
    struct Holder(Option<std::process::Child>);
    impl Drop for Holder {
        fn drop(&mut self) {
            if let Some(mut c) = self.0.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let mut holder = Holder(Some({
        let _view = common::host_view();
        run_command(&d.path, &["--params", &params("hold")]).stdout(Stdio::piped()).spawn().expect("spawn holder")
    }));
    let gave = output_of(&mut run_command(&d.path, &["--params", &params("give")]));
    let held = holder.0.as_mut().unwrap().try_wait().unwrap().is_none();
    std::fs::write(shared.path.join("release"), "").unwrap();
    let holder = holder.0.take().unwrap().wait_with_output().unwrap();
    assert!(held, "the giver's run ended only once the holder had: {gave:?}");
    let r = gave.result();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["output"], json!({"gave": 3}), "{r}");
    assert!(r["stdout"].as_str().unwrap().contains("the giver's own output"), "{r}");
    let h: Value = serde_json::from_slice(&holder.stdout).unwrap();
    assert_eq!(h["status"], "completed", "{h}");
    assert_eq!(h["output"], json!({"held": 3}), "{h}");
}

/// `opservant run` to its end, with the most memory it (or a process it waited for) held.
fn run_with_peak_rss(dir: &Path, params: &Value) -> (Out, u64) {
    let _view = common::host_view();
    let mut child = run_command(dir, &["--params", &params.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn opservant");
    let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let stdout = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut so, &mut s).unwrap();
        s
    });
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut se, &mut s).unwrap();
        s
    });
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: a child of this process, waited for once (std's handle is not used again).
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32);
    std::mem::forget(child);
    let out = Out {
        code: if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { -1 },
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    };
    (out, usage.ru_maxrss as u64 * 1024)
}

/// What a payload sends costs the agent its own memory and CPU, not the sandbox's: a message
/// that would take more than 160 MiB parsed is refused unparsed, and records past the log
/// caps without end stop the run — both as a broken protocol, the run failed, not left to
/// run on.
#[test]
fn messages_that_would_cost_the_agent_too_much_stop_the_run() {
    if !require_root() {
        return;
    }
    let d = executor(json!({"resource_limits": {"timeout_seconds": 120, "max_cpu_percent": 50}}), FORGED);
    let (out, peak) = run_with_peak_rss(&d.path, &json!({"mode": "nested"}));
    let r = out.result();
    assert_eq!(r["status"], "failed", "{r}");
    let error = r["error"].as_str().unwrap();
    assert!(error.contains("would take the agent more than 160 MiB"), "{error}");
    assert_eq!(r["output"], Value::Null, "{r}");
    // The old agent peaked at 1.3 GB here; the payload's own message is ~10 MB.
    assert!(peak < 256 << 20, "opservant run peaked at {} MiB", peak >> 20);
    // A message just within the estimate is parsed, and costs about what was estimated (it
    // was buffered whole before it was parsed: 408 MiB for 4 MB of this shape).
    let (out, peak) = run_with_peak_rss(&d.path, &json!({"mode": "nested_accepted"}));
    let r = out.result();
    assert_eq!(r["status"], "completed", "{}", r["error"]);
    assert_eq!(r["output"]["a"].as_array().map(Vec::len), Some(8000));
    assert!(peak < 256 << 20, "opservant run peaked at {} MiB", peak >> 20);

    let r = run_params(&d.path, &json!({"mode": "log_flood"})).result();
    assert_eq!(r["status"], "failed", "{r}");
    let error = r["error"].as_str().unwrap();
    assert!(error.contains("log flood: more than 100000 log records or 256 MiB of them past the caps"), "{error}");
    assert_ne!(r["killed_by"], "timeout", "stopped, not left to its timeout: {r}");
}

// ---------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------

#[test]
fn memory_hog_is_oom_killed() {
    if !require_root() {
        return;
    }
    let code = r#"
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        context["logger"].info("allocating")
        chunks = []
        while True:
            chunks.append(bytearray(1 << 20))
"#;
    let d = executor(json!({"resource_limits": {"max_memory_mb": 48}}), code);
    let r = run(&d.path, &[]).result();
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["killed_by"], "oom");
    assert_eq!(r["limits"]["max_memory_mb"], 48);
    assert!(r["error"].as_str().unwrap().contains("out of memory (limit 48 MB)"), "{}", r["error"]);
    assert!(r["usage"]["oom_kills"].as_u64().unwrap() >= 1);
    assert_eq!(log_msgs(&r), vec!["allocating"], "records sent before the kill are kept");
}

#[test]
fn sleeper_times_out() {
    if !require_root() {
        return;
    }
    let code = r#"
import time
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        context["logger"].info("going to sleep")
        time.sleep(120)
        return ExecutorResult(output={"woke": True})

    def cleanup(self, context):
        # Seed 000: cleanup runs after execution, success or failure — a timeout included
        # (SIGTERM, then the grace period before SIGKILL).
        context["logger"].info("cleanup ran")
"#;
    let d = executor(json!({"resource_limits": {"timeout_seconds": 2}}), code);
    let started = std::time::Instant::now();
    let out = run(&d.path, &[]);
    let r = out.result();
    assert_eq!(r["status"], "timeout", "{r}");
    assert_eq!(r["killed_by"], "timeout");
    assert_eq!(r["limits"]["timeout_seconds"], 2);
    assert_eq!(r["error"], "timed out after 2 s");
    assert_ne!(r["output"]["woke"], true);
    assert_eq!(log_msgs(&r), vec!["going to sleep", "cleanup ran"]);
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "the run did not wait for the sleeper");
    assert!(
        out.stderr.contains("event=\"executor_fail\"") && out.stderr.contains("\"killed_by\":\"timeout\""),
        "{}",
        out.stderr
    );
}

/// An executor whose sandbox processes cannot die (stuck in the kernel; here frozen in a v1
/// freezer cgroup once its executor sleeps) ends its run with an error naming why, instead of
/// waiting forever: the sandbox gives up on them 5 s after the last SIGKILL, and the run's
/// application channel server, whose peer (the payload) never closes, is shut down. The old
/// code hung in `wait`, and then in the server. (The limit here is a hang detector.)
#[test]
fn a_run_whose_sandbox_is_stuck_in_the_kernel_ends() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    let code = r#"
import time
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        time.sleep(120)
        return ExecutorResult(output={"woke": True})
"#;
    // Time for the freezer to find the sandbox before the timeout (see script_run's test).
    let d = executor(json!({"resource_limits": {"timeout_seconds": 15}}), code);
    let view = common::host_view();
    let launch = common::launch_args();
    let mut args: Vec<&std::ffi::OsStr> = vec!["run".as_ref(), d.path.as_os_str()];
    args.extend(launch.iter().map(std::ffi::OsStr::new));
    let mut cmd = opservant_command(&args);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let (out, dirs) = common::freezer::run_with_frozen_sandbox(cmd, std::time::Duration::from_secs(90), "run");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // The executor ran: a `failed` result (exit 1), not "cannot run" (exit 2, which says
    // nothing ran — the daemon's `rejected`).
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let r: Value = serde_json::from_str(stdout.trim()).expect("a result on stdout");
    assert_eq!(r["status"], "failed", "{r}");
    assert!(r["error"].as_str().unwrap_or("").contains("had not exited 5 s after SIGKILL"), "the error names why: {r}");
    // Left behind by a process that is gone: the next opservant process reaps them.
    drop(view);
    let r = common::sandbox(None, &["/bin/true"]);
    assert_eq!(r.status(), "completed", "{}", r.err());
    for d in &dirs {
        assert!(!d.exists(), "{} still there after a later opservant process started", d.display());
    }
}

/// A sandbox abandoned after its executor's result came — here a child the executor left
/// running is frozen (in life, stuck in the kernel) before the executor returns, so the
/// sandbox cannot end — keeps that result: `completed` with the executor's output, the
/// abandon in `sandbox.abandoned`, a log record and a `sandbox_abandoned` audit record. (The
/// result was lost: `failed`, "had not exited 5 s after SIGKILL", no output.)
#[test]
fn a_result_that_came_before_the_sandbox_was_abandoned_stands() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    let code = r#"
import os
import time
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        if os.fork() == 0:
            time.sleep(120)
            os._exit(0)
        while not os.path.exists(params["flag"]):
            time.sleep(0.02)
        return ExecutorResult(output={"done": True})
"#;
    let flags = HostDir::new();
    let d = executor(json!({"permissions": {"filesystem": {"read": [flags.path]}}}), code);
    let flag = flags.path.join("go");
    let params = json!({"flag": flag}).to_string();
    let view = common::host_view();
    let launch = common::launch_args();
    let mut args: Vec<&std::ffi::OsStr> =
        vec!["run".as_ref(), d.path.as_os_str(), "--params".as_ref(), params.as_ref()];
    args.extend(launch.iter().map(std::ffi::OsStr::new));
    let mut child = opservant_command(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    use common::procs::ppid;
    let id = child.id();
    let sleeper =
        common::procs::wait_for(&mut child, std::time::Duration::from_secs(60), "the executor's child started", || {
            // The sandbox's processes: init, the payload, and the payload's child — the one two
            // generations below another of them.
            let members = common::sandbox_members(id);
            members.iter().copied().find(|&m| {
                ppid(m).is_some_and(|p| members.contains(&p) && ppid(p).is_some_and(|pp| members.contains(&pp)))
            })
        });
    let dirs = common::freezer::sandbox_cgroups_of_process(sleeper);
    assert!(!dirs.is_empty(), "the child is in the sandbox's cgroups");
    let freezer = common::freezer::Freezer::new("abandoned-after-result");
    freezer.freeze(&[sleeper]);
    std::fs::write(&flag, b"").unwrap();
    // A hang detector, not a timing assertion: the sandbox gives up 5 s after its SIGKILL.
    let out = common::procs::end_within(child, std::time::Duration::from_secs(90), "the run");
    drop(freezer);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let r: Value = serde_json::from_str(stdout.trim()).expect("a result on stdout");
    common::assert_launch(&r);
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["output"], json!({"done": true}), "{r}");
    let why = r["sandbox"]["abandoned"].as_str().unwrap_or("");
    assert!(why.contains("had not exited 5 s after SIGKILL"), "{r}");
    assert!(log_msgs(&r).iter().any(|m| m.starts_with("the sandbox was abandoned after the executor's result")), "{r}");
    assert!(stderr.contains("event=\"sandbox_abandoned\""), "{stderr}");
    // Left behind by a process that is gone: the next opservant process reaps them.
    drop(view);
    let r = common::sandbox(None, &["/bin/true"]);
    assert_eq!(r.status(), "completed", "{}", r.err());
    for d in &dirs {
        assert!(!d.exists(), "{} still there after a later opservant process started", d.display());
    }
}

/// An executor whose sandbox is ended from outside — its init killed on the host while the
/// executor runs — fails with that said: `failed`, output `{}`, the error naming init (and
/// the signal, with `killed_by`, where it is known: not for a zygote's direct start). (The
/// error said "the executor runtime ended without a result", and a zygote's sandbox killed
/// after its result came kept that result.)
#[test]
fn an_executor_whose_sandbox_is_killed_from_outside_fails_saying_so() {
    if !require_root() {
        return;
    }
    let code = r#"
import time
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        time.sleep(120)
        return ExecutorResult(output={"woke": True})
"#;
    let d = executor(json!({}), code);
    let view = common::host_view();
    let launch = common::launch_args();
    let mut args: Vec<&std::ffi::OsStr> = vec!["run".as_ref(), d.path.as_os_str()];
    args.extend(launch.iter().map(std::ffi::OsStr::new));
    let mut child = opservant_command(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    use common::procs::ppid;
    let id = child.id();
    let init = common::procs::wait_for(&mut child, std::time::Duration::from_secs(60), "the executor slept", || {
        // The sandbox's processes: init is the one whose parent is not among them, once the
        // payload (its child) sleeps.
        let members = common::sandbox_members(id);
        let asleep = members.iter().any(|&m| {
            let call = std::fs::read_to_string(format!("/proc/{m}/syscall")).unwrap_or_default();
            let nr = call.split_whitespace().next().and_then(|n| n.parse::<libc::c_long>().ok());
            nr.is_some_and(|nr| nr == libc::SYS_clock_nanosleep || nr == libc::SYS_nanosleep)
        });
        members.iter().copied().find(|&m| ppid(m).is_some_and(|p| !members.contains(&p))).filter(|_| asleep)
    });
    let nspid = std::fs::read_to_string(format!("/proc/{init}/status")).unwrap();
    assert!(
        nspid.lines().any(|l| l.starts_with("NSpid:") && l.split_whitespace().last() == Some("1")),
        "not PID 1 of a namespace: {nspid}"
    );
    // SAFETY: signalling the init of the sandbox this test started (checked above).
    assert_eq!(unsafe { libc::kill(init, libc::SIGKILL) }, 0);
    let out = child.wait_with_output().unwrap();
    drop(view);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let r: Value = serde_json::from_str(stdout.trim()).expect("a result on stdout");
    common::assert_launch(&r);
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["output"], json!({}), "{r}");
    let error = r["error"].as_str().unwrap_or("");
    match r["killed_by"].as_str() {
        Some("signal:9") => assert!(error.starts_with("the sandbox's init was killed by signal 9"), "{r}"),
        None => assert!(error.starts_with("the sandbox's init ended before its payload's exit"), "{r}"),
        Some(other) => panic!("killed_by {other}: {r}"),
    }
}

// ---------------------------------------------------------------------------------------
// Context
// ---------------------------------------------------------------------------------------

const CONTEXT: &str = r#"
from opservant.executor import BaseExecutor, ExecutorResult


class Opaque:
    def __repr__(self):
        return "<Opaque thing>"


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        log = context["logger"]
        log.debug("dbg")
        log.info("hello", count=3, tags=["a", "b"], nested={"x": None, "y": 1.5}, obj=Opaque())
        log.warning("careful", code="W1")
        log.warn("careful again")
        log.error("bad", ok=False)
        if params.get("forge"):
            log.info("first line\n2026-01-01T00:00:00Z  INFO opservant::audit: audit event=\"FORGED\"", x="\nFORGED")
        return ExecutorResult(output={
            "keys": sorted(context),
            "agent_id": context["agent_id"],
            "network": context["network"],
            "config": context["config"],
            "action": context["action"],
            "command_id": context["command_id"],
            "vault_type": type(context["vault"]).__name__,
        })
"#;

#[test]
fn context_carries_agent_id_network_config_and_logger() {
    if !require_root() {
        return;
    }
    let d = executor(
        json!({"permissions": {"secrets": ["api_key"]}, "resource_limits": {"timeout_seconds": null}}),
        CONTEXT,
    );
    let c =
        config("agent:\n  id: ag-test-42\nresource_limits:\n  default_timeout_seconds: 120\n", Some("api_key: v\n"));
    let out = run(&d.path, &["--config", c.arg(), "--action", "act-test"]);
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    let o = &r["output"];
    assert_eq!(o["keys"], json!(["action", "agent_id", "command_id", "config", "logger", "network", "vault"]));
    assert_eq!(o["agent_id"], "ag-test-42");
    assert_eq!(o["action"], "act-test");
    assert_eq!(o["command_id"], Value::Null);
    // The sandbox's own network: a private loopback only.
    assert_eq!(o["network"]["local_ip"], "127.0.0.1");
    assert_eq!(o["network"]["subnet"], "127.0.0.0/8");
    let ifaces = o["network"]["interfaces"].as_array().unwrap();
    assert_eq!(ifaces.len(), 1, "{ifaces:?}");
    assert_eq!(ifaces[0]["name"], "lo");
    assert!(ifaces[0]["addresses"].as_array().unwrap().contains(&json!("127.0.0.1/8")));
    // The configuration's public view: values, but nothing about where secrets live.
    let cfg = &o["config"];
    assert_eq!(cfg["agent"]["id"], "ag-test-42");
    assert_eq!(cfg["resource_limits"]["default_timeout_seconds"], 120);
    assert_eq!(cfg["secrets"], json!({"provider": "file"}));
    let cfg_text = cfg.to_string();
    assert!(!cfg_text.contains(c.dir.path.to_str().unwrap()), "{cfg_text}");
    assert!(!cfg_text.contains("secrets.yaml"), "{cfg_text}");
    assert_eq!(r["limits"]["timeout_seconds"], 120, "the configured default applies");
    // Logger records, in order, with their levels and fields.
    assert_eq!(
        r["logs"],
        json!([
            {"level": "debug", "msg": "dbg", "fields": {}},
            {"level": "info", "msg": "hello",
             "fields": {"count": 3, "tags": ["a", "b"], "nested": {"x": null, "y": 1.5}, "obj": "<Opaque thing>"}},
            {"level": "warning", "msg": "careful", "fields": {"code": "W1"}},
            {"level": "warning", "msg": "careful again", "fields": {}},
            {"level": "error", "msg": "bad", "fields": {"ok": false}},
        ])
    );

    // Without a config: agent id local-<hostname>, no provider.
    let r = run(&d.path, &[]).result();
    let host = nix::unistd::gethostname().unwrap().into_string().unwrap();
    assert_eq!(r["output"]["agent_id"], format!("local-{host}"));
    assert_eq!(r["output"]["config"]["secrets"], json!({"provider": null}));

    // The agent forwards the records to its own log with the executor's name.
    let out = run_env(&d.path, &[], &[("OPSERVANT_LOG", "info")]);
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("opservant::executor") && l.contains("hello"))
        .unwrap_or_else(|| panic!("{}", out.stderr));
    assert!(line.contains("executor=\"test-executor\"") || line.contains("executor=test-executor"), "{line}");
    assert!(line.contains("count"), "{line}");
    // A record cannot forge lines of the agent's log (its audit events are lines there).
    let out = run_env(&d.path, &["--params", r#"{"forge": true}"#], &[("OPSERVANT_LOG", "info")]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("FORGED"), "the record is logged: {}", out.stderr);
    for l in out.stderr.lines() {
        assert!(!l.starts_with("2026-01-01") && !l.starts_with("FORGED"), "forged log line: {l}\n{}", out.stderr);
    }
}

// ---------------------------------------------------------------------------------------
// Isolation, as the interpreter sees it
// ---------------------------------------------------------------------------------------

const ISOLATION: &str = r#"
import os
import sys

from opservant.executor import BaseExecutor, ExecutorResult

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def attempt(fn):
    try:
        fn()
        return "ok"
    except BaseException as e:
        return type(e).__name__


def read(path):
    with open(path, "rb") as f:
        return f.read()


def write(path):
    with open(path, "w") as f:
        f.write("x")


class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        import builtins
        return ExecutorResult(output={
            "isolated": sys.flags.isolated,
            "no_user_site": sys.flags.no_user_site,
            "ignore_environment": sys.flags.ignore_environment,
            "safe_path": bool(sys.flags.safe_path),
            "dont_write_bytecode": sys.flags.dont_write_bytecode,
            "inspect": sys.flags.inspect,
            "verbose": sys.flags.verbose,
            "path": sys.path,
            "cwd": os.getcwd(),
            "site_imported": "site" in sys.modules,
            "sitecustomized": getattr(builtins, "SITECUSTOMIZED", False),
            "evil_import": attempt(lambda: __import__("evilmod")),
            "env": dict(os.environ),
            "proc_environ": read("/proc/self/environ").decode(),
            "warnings_filters": [str(f[0]) for f in __import__("warnings").filters if f[0] == "error"],
            "read_shadow": attempt(lambda: read("/etc/shadow")),
            "read_root_bashrc": attempt(lambda: read("/root/.bashrc")),
            "list_root": attempt(lambda: os.listdir("/root")),
            "read_other_hostdir": attempt(lambda: read(params["other"])),
            "other_visible": os.path.exists(params["other"]),
            "write_pkg": attempt(lambda: write(PKG + "/written-by-executor")),
            "write_pkg_module": attempt(lambda: write(PKG + "/test_executor/__init__.py")),
            "mkdir_pkg": attempt(lambda: os.mkdir(PKG + "/newdir")),
            "write_etc": attempt(lambda: write("/etc/opservant-test")),
            "write_usr": attempt(lambda: write("/usr/lib/opservant-test")),
            "write_scratch": attempt(lambda: write("/tmp/opservant/scratch/ok")),
            "uid": os.getuid(),
        })
"#;

#[test]
fn interpreter_is_isolated_from_host_python_settings_and_files() {
    if !require_root() {
        return;
    }
    let d = executor(json!({}), ISOLATION);
    let evil = d.path.join("evil");
    put(&d.path, "evil/evilmod.py", b"X = 1\n");
    put(&d.path, "evil/sitecustomize.py", b"import builtins\nbuiltins.SITECUSTOMIZED = True\n");
    put(&d.path, "evil/usercustomize.py", b"import builtins\nbuiltins.SITECUSTOMIZED = True\n");
    put(&d.path, "evil/startup.py", b"import builtins\nbuiltins.SITECUSTOMIZED = True\n");
    // The package is writable for everyone on the host: only the sandbox stops the writes.
    for (p, mode) in [("", 0o777), ("test_executor", 0o777), ("test_executor/__init__.py", 0o666)] {
        std::fs::set_permissions(d.path.join(p), std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let other = HostDir::new();
    let other_file = put(&other.path, "host-only.txt", b"host data");
    let evil_s = evil.to_str().unwrap();
    let startup = format!("{evil_s}/startup.py");
    let out = run_env(
        &d.path,
        &["--params", &json!({"other": other_file}).to_string()],
        &[
            ("PYTHONPATH", evil_s),
            ("PYTHONSTARTUP", &startup),
            ("PYTHONUSERBASE", evil_s),
            ("PYTHONHOME", "/nonexistent-python-home"),
            ("PYTHONINSPECT", "1"),
            ("PYTHONVERBOSE", "1"),
            ("PYTHONWARNINGS", "error"),
            ("PYTHONSAFEPATH", ""),
            ("PYTHONDONTWRITEBYTECODE", ""),
        ],
    );
    let r = out.result();
    assert_eq!(r["status"], "completed", "{r}");
    let o = &r["output"];
    assert_eq!(o["isolated"], 1);
    assert_eq!(o["no_user_site"], 1);
    assert_eq!(o["ignore_environment"], 1);
    assert_eq!(o["safe_path"], true);
    assert_eq!(o["dont_write_bytecode"], 1);
    assert_eq!(o["inspect"], 0);
    assert_eq!(o["verbose"], 0);
    assert_eq!(o["site_imported"], false);
    assert_eq!(o["sitecustomized"], false);
    assert_eq!(o["evil_import"], "ModuleNotFoundError", "PYTHONPATH had no effect");
    assert_eq!(o["warnings_filters"], json!([]), "PYTHONWARNINGS had no effect");
    let path: Vec<String> = o["path"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_string()).collect();
    assert_eq!(path[0], d.path.canonicalize().unwrap().to_str().unwrap(), "the package comes first: {path:?}");
    for p in &path {
        assert!(!p.is_empty() && p != "." && *p != o["cwd"].as_str().unwrap(), "cwd on sys.path: {path:?}");
        assert!(!p.contains("site-packages") && !p.contains("dist-packages") && !p.contains(".local"), "{path:?}");
        assert!(!p.starts_with(evil_s), "{path:?}");
    }
    let env = o["env"].as_object().unwrap();
    assert!(env.keys().all(|k| !k.starts_with("PYTHON")), "{env:?}");
    assert!(!o["proc_environ"].as_str().unwrap().contains("PYTHON"), "{}", o["proc_environ"]);
    assert_eq!(r["stderr"], "", "PYTHONVERBOSE had no effect");
    assert_eq!(r["stdout"], "");
    // Host files.
    // Not even present: the interpreter view shows no /etc beyond a few files.
    assert!(o["read_shadow"] == "FileNotFoundError" || o["read_shadow"] == "PermissionError", "{}", o["read_shadow"]);
    assert_ne!(o["read_root_bashrc"], "ok");
    assert_ne!(o["list_root"], "ok");
    assert_eq!(o["other_visible"], false, "the host's /var/tmp is not visible");
    assert_eq!(o["read_other_hostdir"], "FileNotFoundError");
    // Writes.
    for k in ["write_pkg", "write_pkg_module", "mkdir_pkg", "write_etc", "write_usr"] {
        assert!(o[k] == "OSError" || o[k] == "PermissionError", "{k}: {}", o[k]);
    }
    assert_eq!(o["write_scratch"], "ok");
    assert_ne!(o["uid"], 0);
    assert!(!d.path.join("written-by-executor").exists());
    assert!(!d.path.join("newdir").exists());
    assert_eq!(std::fs::read_to_string(d.path.join("test_executor/__init__.py")).unwrap(), ISOLATION);
    // No bytecode was written into the package either.
    assert!(!d.path.join("test_executor/__pycache__").exists());
}

/// The executor sees an interpreter view: the standard library, shared libraries and a few
/// /etc files — not /usr or /etc as a whole — plus what its manifest declares.
#[test]
fn executors_see_only_the_interpreter_view_and_declared_paths() {
    if !require_root() {
        return;
    }
    let data = HostDir::new();
    put(&data.path, "visible.txt", b"declared");
    let code = r#"
import os
from opservant.executor import BaseExecutor, ExecutorResult

def ls(p):
    try:
        return sorted(os.listdir(p))
    except OSError as e:
        return type(e).__name__

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        return ExecutorResult(status="completed", output={
            "etc": ls("/etc"), "usr": ls("/usr"), "usr_bin": ls("/usr/bin"), "home": ls("/home"),
            "declared": open(params["data"] + "/visible.txt").read(),
            "passwd": open("/etc/passwd").read(),
        })
"#;
    let d = executor(json!({"permissions": {"filesystem": {"read": [data.str()]}}}), code);
    let r = run_params(&d.path, &json!({"data": data.str()}));
    let r = r.result();
    assert_eq!(r["status"], "completed", "{r}");
    let o = &r["output"];
    assert_eq!(o["declared"], "declared");
    assert_eq!(o["usr_bin"], "FileNotFoundError", "no /usr/bin in an executor's view: {o}");
    assert_eq!(o["home"], "FileNotFoundError");
    let etc: Vec<&str> = o["etc"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for absent in ["shadow", "passwd-", "ssh", "sudoers", "opservant", "os-release", "crontab"] {
        assert!(!etc.contains(&absent), "/etc/{absent} visible: {etc:?}");
    }
    assert!(etc.contains(&"resolv.conf") && etc.contains(&"hosts"), "{etc:?}");
    let usr: Vec<&str> = o["usr"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(!usr.contains(&"bin") && !usr.contains(&"sbin") && !usr.contains(&"local"), "{usr:?}");
    // /etc/passwd is synthetic: no host account is listed.
    let passwd = o["passwd"].as_str().unwrap();
    let host_passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let host_only = host_passwd.lines().map(|l| l.split(':').next().unwrap()).find(|u| !["root", "nobody"].contains(u));
    if let Some(user) = host_only {
        assert!(!passwd.contains(&format!("{user}:")), "host account {user} listed: {passwd}");
    }
    assert!(passwd.contains("nobody:x:65534"), "{passwd}");
    assert_eq!(r["sandbox"]["network"], "none");
}

/// Executor sandboxes enforce the CPU percentage over a 500 ms window: 15 ms of CPU after the
/// runtime's start-up fits in one window's 50 ms at the default 10 % and is never stalled
/// (with the kernel's 100 ms window it would exceed 10 ms and be throttled every time). The
/// rest of the window is left for what else the run spends (the import, `validate`, the
/// result), which a busy machine's caches make slower.
#[test]
fn a_short_burst_fits_in_the_cpu_window() {
    if !require_root() {
        return;
    }
    let code = r#"
import time
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        end = time.process_time() + 0.015
        while time.process_time() < end:
            pass
        return ExecutorResult(status="completed", output={})
"#;
    let d = executor(json!({"resource_limits": {"max_cpu_percent": 10}}), code);
    let r = run_params(&d.path, &json!({}));
    let r = r.result();
    assert_eq!(r["status"], "completed", "{r}");
    assert!(r["usage"]["cpu_ms"].as_u64().unwrap() >= 15, "{}", r["usage"]);
    assert_eq!(r["usage"]["cpu_throttled_periods"], 0, "{}", r["usage"]);
    assert_eq!(r["limits"]["enforced"]["cpu"], true);
}

/// `ready` is answered once: executor code that writes it again and again on the
/// application channel (fd 4) and never reads gets no answers — answers would fill the
/// channel until the agent's reader blocked and the run hung to its timeout. The second
/// `ready` breaks the protocol: the agent shuts the channel down and stops the sandbox, and
/// the run fails, promptly.
#[test]
fn a_repeated_ready_from_executor_code_is_not_answered() {
    if !require_root() {
        return;
    }
    let code = r#"
import os
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        for _ in range(20000):
            os.write(4, b'\x00{"type": "ready"}')
        return ExecutorResult(status="completed", output={"sent": 20000})
"#;
    let d = executor(json!({"resource_limits": {"timeout_seconds": 20}}), code);
    let r = run_params(&d.path, &json!({}));
    let r = r.result();
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["error"], "the executor runtime misbehaved: unexpected ready message for an executor run", "{r}");
    assert_eq!(r["output"], Value::Null, "{r}");
}

/// Executor code that answers like a runtime of another build (`wrong_build`) breaks the
/// protocol like any other late message: the run does not read as an upgrade that never
/// happened.
#[test]
fn a_wrong_build_from_executor_code_is_a_protocol_break() {
    if !require_root() {
        return;
    }
    let code = r#"
import os
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        os.write(4, b'\x00{"type": "wrong_build", "build": "0.0.1+0000000000000000"}')
        return ExecutorResult(status="completed", output={})
"#;
    let d = executor(json!({"resource_limits": {"timeout_seconds": 20}}), code);
    let r = run_params(&d.path, &json!({})).result();
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(
        r["error"], "the executor runtime misbehaved: unexpected wrong_build message for an executor run",
        "{r}"
    );
}

/// A payload that breaks the protocol and then carries on (here: a second `ready`, then a
/// long sleep) is stopped at once, and its run fails naming the break — not a timeout 30 s
/// later that would hide why. (The wall-time bound is a hang detector, not a benchmark.)
#[test]
fn a_payload_that_breaks_the_protocol_is_stopped() {
    if !require_root() {
        return;
    }
    let code = r#"
import os, time
from opservant.executor import BaseExecutor, ExecutorResult

class TestExecutor(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        os.write(4, b'\x00{"type": "ready"}')
        time.sleep(120)
        return ExecutorResult(status="completed", output={})
"#;
    let d = executor(json!({"resource_limits": {"timeout_seconds": 30}}), code);
    let r = run_params(&d.path, &json!({})).result();
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["error"], "the executor runtime misbehaved: unexpected ready message for an executor run", "{r}");
    assert!(r["usage"]["wall_ms"].as_u64().unwrap() < 20_000, "stopped, not left to its timeout: {r}");
}

/// Start `opservant-runtime` outside a sandbox, its application channel on fd 4; returns the
/// agent's end of the channel and the child.
fn runtime_on_channel() -> (sandbox::channel::Channel, std::process::Child) {
    use std::os::unix::process::CommandExt;
    let (agent_end, runtime_end) = sandbox::channel::Channel::pair().unwrap();
    let fd = runtime_end.raw_fd();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_opservant-runtime"));
    cmd.env_clear().stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    // SAFETY: only dup2 and fcntl (async-signal-safe) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // dup2 onto itself would leave close-on-exec set.
            let r = if fd == 4 { libc::fcntl(4, libc::F_SETFD, 0) } else { libc::dup2(fd, 4) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(runtime_end);
    (agent_end, child)
}

/// A message of arguments as this build's agent sends it (`agent::app::encode_args`).
fn args_message(args: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({"build": agent::app::BUILD, "args": args})).unwrap()
}

/// The runtime keeps log records past the agent's caps back and counts them — only for an
/// agent that says it takes the count (`log_caps`): it says so once (`logs_held`) and gives
/// the count with the result. An agent from before gets every record, as it did then (it
/// would refuse the result's unknown `logs_dropped`). Driven directly over the channel.
#[test]
fn the_runtime_keeps_log_records_back_only_for_an_agent_that_takes_the_count() {
    let d = HostDir::new();
    let package = PathBuf::from(d.str()).join("pkg");
    std::fs::create_dir(&package).unwrap();
    std::fs::write(
        package.join("chatty.py"),
        "from opservant.executor import BaseExecutor, ExecutorResult\n\
         class Chatty(BaseExecutor):\n    def validate(self, params):\n        return True\n\
         \n    def execute(self, params, context):\n        for i in range(1100):\n            \
         context['logger'].info('item', i=i)\n        return ExecutorResult(status='completed', output={})\n",
    )
    .unwrap();
    let args = |log_caps: Option<bool>| {
        let mut a = json!({
            "mode": "executor", "package_dir": package, "entry_point": "chatty.Chatty", "paths": [],
            "params": {}, "agent_id": "test", "action": null, "command_id": null, "config": {},
            "proceed": true
        });
        if let Some(c) = log_caps {
            a["log_caps"] = json!(c);
        }
        args_message(&a)
    };
    for log_caps in [Some(true), None] {
        let (agent_end, child) = runtime_on_channel();
        agent_end.send_bytes(&args(log_caps)).unwrap();
        let mut kinds: Vec<Value> = Vec::new();
        while let Some(bytes) = agent_end.recv_bytes(1 << 20).unwrap() {
            let msg: Value = serde_json::from_slice(&bytes).unwrap();
            if msg["type"] == "ready" {
                agent_end.send_bytes(br#"{"type":"proceed"}"#).unwrap();
            }
            let last = msg["type"] == "result";
            kinds.push(msg);
            if last {
                break;
            }
        }
        drop(agent_end);
        assert!(child.wait_with_output().unwrap().status.success());
        let logs = kinds.iter().filter(|m| m["type"] == "log").count();
        let held = kinds.iter().filter(|m| m["type"] == "logs_held").count();
        let result = kinds.last().unwrap();
        assert_eq!(result["type"], "result", "{result}");
        if log_caps == Some(true) {
            assert_eq!((logs, held, &result["logs_dropped"]), (1000, 1, &json!(100)), "{result}");
        } else {
            assert_eq!((logs, held), (1100, 0), "every record for an agent from before");
            assert!(result.get("logs_dropped").is_none(), "{result}");
        }
    }
}

/// An executor package in `d` whose module, as it is imported, creates the file returned
/// (executor code ran), and the runtime's arguments for it (an agent that answers `ready`).
fn probe_package(d: &HostDir) -> (PathBuf, Value) {
    let marker = PathBuf::from(d.str()).join("imported");
    let package = PathBuf::from(d.str()).join("pkg");
    std::fs::create_dir(&package).unwrap();
    std::fs::write(
        package.join("probe.py"),
        format!(
            "from opservant.executor import BaseExecutor, ExecutorResult\n\
             open({:?}, 'w').close()\n\
             class Probe(BaseExecutor):\n    def validate(self, params):\n        return True\n\
             \n    def execute(self, params, context):\n        return ExecutorResult(status='completed', output={{}})\n",
            marker.to_str().unwrap()
        ),
    )
    .unwrap();
    let args = json!({
        "mode": "executor", "package_dir": package, "entry_point": "probe.Probe", "paths": [],
        "params": {}, "agent_id": "test", "action": null, "command_id": null, "config": {},
        "proceed": true
    });
    (marker, args)
}

/// The runtime reports `ready` (the agent then writes the deferred CPU quota) and — when the
/// arguments say the agent answers — waits for the agent's `proceed` before any executor
/// code runs: an executor whose module writes a
/// marker as it is imported leaves none when the agent answers `ready` by closing the
/// channel (the quota was never confirmed), and one — with a result — after `proceed`.
/// Driven directly, outside a sandbox, over the application channel on fd 4.
#[test]
fn the_runtime_runs_no_executor_code_before_the_agent_confirms_the_cpu_quota() {
    let d = HostDir::new();
    let (marker, mut args) = probe_package(&d);
    let old_args = {
        let mut a = args.clone();
        a.as_object_mut().unwrap().remove("proceed");
        args_message(&a)
    };
    let args = args_message(&args.take());
    let ready = |chan: &sandbox::channel::Channel| -> Value {
        serde_json::from_slice(&chan.recv_bytes(1 << 20).unwrap().expect("a message")).unwrap()
    };

    // The agent never confirms: the executor's module is not imported.
    let (agent_end, child) = runtime_on_channel();
    agent_end.send_bytes(&args).unwrap();
    assert_eq!(ready(&agent_end)["type"], "ready");
    drop(agent_end);
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("before the CPU quota was in force"), "{out:?}");
    assert!(!marker.exists(), "executor code ran before the agent confirmed the CPU quota");

    // Confirmed: it is imported and the run completes.
    let (agent_end, child) = runtime_on_channel();
    agent_end.send_bytes(&args).unwrap();
    assert_eq!(ready(&agent_end)["type"], "ready");
    assert!(!marker.exists());
    agent_end.send_bytes(br#"{"type":"proceed"}"#).unwrap();
    let result = ready(&agent_end);
    assert_eq!(result["type"], "result", "{result}");
    assert_eq!(result["status"], "completed", "{result}");
    assert!(marker.exists(), "the executor's module was imported after proceed");
    drop(agent_end);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");

    // Arguments of an agent from before `proceed` existed (no such field): the runtime does
    // not wait for an answer that would never come.
    std::fs::remove_file(&marker).unwrap();
    let (agent_end, child) = runtime_on_channel();
    agent_end.send_bytes(&old_args).unwrap();
    assert_eq!(ready(&agent_end)["type"], "ready");
    let result = ready(&agent_end);
    assert_eq!(result["status"], "completed", "{result}");
    assert!(marker.exists());
    drop(agent_end);
    assert!(child.wait_with_output().unwrap().status.success());
}

/// The runtime's warm-up (a warm pool's sandbox is asked for it while it waits for a run):
/// answered once with what it populated, refused the second time before any run exists.
/// Driven directly, outside a sandbox, over the application channel on fd 4.
#[test]
fn the_runtime_warms_up_once_and_only_before_its_arguments() {
    let (agent_end, child) = runtime_on_channel();
    let warm = args_message(&json!({"mode": "warm"}));
    agent_end.send_bytes(&warm).unwrap();
    let reply: Value = serde_json::from_slice(&agent_end.recv_bytes(1 << 20).unwrap().unwrap()).unwrap();
    assert_eq!(reply["type"], "warmed", "{reply}");
    // A process of its own shares nothing, but its resident writable pages are populated
    // all the same: zero would mean the mechanism does not work here (maps, mincore, madvise).
    assert!(reply["prefaulted_kib"].as_u64().unwrap() > 0, "{reply}");
    agent_end.send_bytes(&warm).unwrap();
    assert_eq!(agent_end.recv_bytes(1 << 20).unwrap(), None, "the runtime ends");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(70), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("a second warm-up request"), "{out:?}");
}

/// The runtime reads arguments only from an agent of its own build: arguments of an older
/// agent (no build, the format before the check) or of another build are answered with
/// `wrong_build` naming the runtime's own build, nothing of them is run, and the runtime
/// exits 70 saying which builds met. Driven directly, outside a sandbox, over the channel.
#[test]
fn the_runtime_reads_no_arguments_from_an_agent_of_another_build() {
    let d = HostDir::new();
    let (marker, args) = probe_package(&d);
    let other = "0.0.1+00000000000000ff";
    assert_ne!(other, agent::app::BUILD);
    let cases = [
        (serde_json::to_vec(&args).unwrap(), "started by an older opservant".to_string()),
        (
            serde_json::to_vec(&json!({"build": other, "args": args})).unwrap(),
            format!("started by an opservant of build {other}"),
        ),
        // Not even a warm-up is served.
        (serde_json::to_vec(&json!({"build": other, "args": {"mode": "warm"}})).unwrap(), format!("build {other}")),
    ];
    for (message, said) in cases {
        let (agent_end, child) = runtime_on_channel();
        agent_end.send_bytes(&message).unwrap();
        let reply: Value = serde_json::from_slice(&agent_end.recv_bytes(1 << 20).unwrap().expect("a reply")).unwrap();
        assert_eq!(reply, json!({"type": "wrong_build", "build": agent::app::BUILD}));
        assert_eq!(agent_end.recv_bytes(1 << 20).unwrap(), None, "the runtime ends");
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(70), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(&format!("opservant-runtime is build {}", agent::app::BUILD)), "{stderr}");
        assert!(stderr.contains(&said) && stderr.contains("restart the agent"), "{stderr}");
        assert!(!marker.exists(), "executor code ran on arguments of another build");
    }
    // The same arguments from this build run.
    let (agent_end, child) = runtime_on_channel();
    agent_end.send_bytes(&args_message(&args)).unwrap();
    let reply: Value = serde_json::from_slice(&agent_end.recv_bytes(1 << 20).unwrap().unwrap()).unwrap();
    assert_eq!(reply["type"], "ready", "{reply}");
    agent_end.send_bytes(br#"{"type":"proceed"}"#).unwrap();
    let reply: Value = serde_json::from_slice(&agent_end.recv_bytes(1 << 20).unwrap().unwrap()).unwrap();
    assert_eq!(reply["status"], "completed", "{reply}");
    drop(agent_end);
    assert!(child.wait_with_output().unwrap().status.success());
    assert!(marker.exists());
}

/// `doctor`'s runtime check ends, and leaves nothing running, whatever sits where the
/// runtime should be: a program that never answers, or one that answers and leaves a process
/// holding its output (which had kept the check — and so the heartbeat — waiting for it).
#[test]
fn doctor_gives_up_on_a_runtime_that_does_not_answer_and_leaves_nothing_behind() {
    if !require_root() {
        return;
    }
    let bin = HostDir::new();
    let opservant = bin.path.join("opservant");
    std::fs::copy(common::opservant(), &opservant).unwrap();
    // A sleep long enough to outlive the test, named by its argument.
    let secs = 3000 + std::process::id() % 1000;
    let cases = [
        (format!("#!/bin/sh\nexec sleep {secs}.1\n"), format!("sleep\0{secs}.1\0")),
        (
            format!("#!/bin/sh\nsleep {secs}.2 &\necho opservant-runtime {}\n", agent::app::BUILD),
            format!("sleep\0{secs}.2\0"),
        ),
    ];
    for (script, left) in cases {
        let new = bin.path.join("opservant-runtime.new");
        std::fs::write(&new, &script).unwrap();
        std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&new, bin.path.join("opservant-runtime")).unwrap();
        let child = Command::new(&opservant)
            .args(["doctor", "--json"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = common::procs::end_within(child, std::time::Duration::from_secs(60), "opservant doctor");
        let report: Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("doctor --json ({e}): {out:?}"));
        let finding =
            report["findings"].as_array().unwrap().iter().find(|f| f["feature"] == "executor runtime").unwrap();
        assert_eq!(finding["ok"], false, "{script}: {finding}");
        assert!(finding["detail"].as_str().unwrap().contains("--version did not answer within 2 s"), "{finding}");
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        assert!(common::procs::by_cmdline(left.as_bytes()).is_none(), "{script}: its process was left running");
    }
}

/// `opservant` and `opservant-runtime` copied into `dir`, the runtime's copy made another
/// build: every copy of this build's identity in it rewritten (same length, another hash) —
/// what an upgrade that replaced the runtime beside a running agent leaves. Returns the
/// copied `opservant` and the runtime's build.
fn binaries_of_two_builds(dir: &Path) -> (PathBuf, String) {
    let opservant = dir.join("opservant");
    let runtime = dir.join("opservant-runtime");
    std::fs::copy(common::opservant(), &opservant).unwrap();
    let build = agent::app::BUILD;
    let (version, hash) = build.split_once('+').expect("VERSION+HASH");
    let other_hash: String = hash.chars().map(|c| if c == 'f' { '0' } else { 'f' }).collect();
    let other = format!("{version}+{other_hash}");
    let mut bytes = std::fs::read(env!("CARGO_BIN_EXE_opservant-runtime")).unwrap();
    let mut replaced = 0;
    let mut at = 0;
    while let Some(i) = bytes[at..].windows(build.len()).position(|w| w == build.as_bytes()) {
        bytes[at + i..at + i + build.len()].copy_from_slice(other.as_bytes());
        at += i + build.len();
        replaced += 1;
    }
    assert!(replaced > 0, "the runtime binary carries its build");
    std::fs::write(&runtime, bytes).unwrap();
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o755)).unwrap();
    let version_out = Command::new(&runtime).arg("--version").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&version_out.stdout), format!("opservant-runtime {other}\n"));
    (opservant, other)
}

/// An `opservant` whose `opservant-runtime` is another build (replaced by an upgrade while
/// an agent ran) runs nothing of an executor, and says why: cold, the runtime answers its
/// arguments with its build and the run fails naming both builds; through a zygote, the
/// zygote's ready message names its build, so no zygote serves (audited `zygote_fallback`
/// with both builds) and the run starts cold — to the same end.
#[test]
fn a_runtime_of_another_build_runs_nothing_and_says_so() {
    if !require_root() {
        return;
    }
    let bin = HostDir::new();
    let (opservant, other) = binaries_of_two_builds(&bin.path);
    // Imported, the executor's module says so on stdout.
    let d = executor(
        json!({}),
        "from opservant.executor import BaseExecutor, ExecutorResult\n\
         print('imported', flush=True)\n\
         class TestExecutor(BaseExecutor):\n    def validate(self, params):\n        return True\n\
         \n    def execute(self, params, context):\n        return ExecutorResult(status='completed', output={})\n",
    );
    let wrong = format!("opservant-runtime is build {other}, not this opservant's build {}", agent::app::BUILD);
    for launch in ["cold", "zygote"] {
        let out = output_of(
            Command::new(&opservant)
                .args(["run".as_ref(), d.path.as_os_str(), "--launch".as_ref(), launch.as_ref()])
                .env("OPSERVANT_CONFIG", common::test_config())
                .env_remove("OPSERVANT_LOG")
                .stdin(Stdio::null()),
        );
        let r = out.json();
        assert_eq!(out.code, 1, "{out:?}");
        assert_eq!(r["status"], "failed", "{r}");
        let error = r["error"].as_str().unwrap();
        assert!(error.starts_with(&wrong) && error.ends_with("restart the agent"), "{launch}: {error}");
        assert_eq!(r["sandbox"]["launch"], "cold", "{r}");
        if launch == "zygote" {
            let zygote = format!(
                "the zygote {} is build {other}, not build {}",
                bin.path.join("opservant-runtime").display(),
                agent::app::BUILD
            );
            assert!(out.stderr.lines().any(|l| l.contains("zygote_fallback") && l.contains(&zygote)), "{}", out.stderr);
        }
        assert!(!r["stdout"].as_str().unwrap().contains("imported"), "{launch}: executor code ran: {r}");
    }
    // `doctor` (and so the agent's heartbeat) names the two builds.
    let runtime_finding = || {
        let out = output_of(Command::new(&opservant).args(["doctor", "--json"]).stdin(Stdio::null()));
        let report: Value =
            serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("doctor --json ({e}): {out:?}"));
        let finding = report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["feature"] == "executor runtime")
            .cloned()
            .unwrap_or_else(|| panic!("no executor runtime finding: {report}"));
        (out.code, finding)
    };
    let (code, finding) = runtime_finding();
    let detail = finding["detail"].as_str().unwrap();
    assert_eq!((code, &finding["ok"], &finding["required"]), (1, &json!(false), &json!(true)), "{finding}");
    assert!(detail.contains(&format!("is build {other}, this opservant is build {}", agent::app::BUILD)), "{detail}");
    // The same copies, the runtime this build again (put in place as a package does: a new
    // file renamed over the old): the executor runs.
    let new = bin.path.join("opservant-runtime.new");
    std::fs::copy(env!("CARGO_BIN_EXE_opservant-runtime"), &new).unwrap();
    std::fs::rename(&new, bin.path.join("opservant-runtime")).unwrap();
    let out = output_of(
        Command::new(&opservant)
            .args(["run".as_ref(), d.path.as_os_str(), "--launch".as_ref(), "zygote".as_ref()])
            .env("OPSERVANT_CONFIG", common::test_config())
            .env_remove("OPSERVANT_LOG")
            .stdin(Stdio::null()),
    );
    let r = out.json();
    assert_eq!((out.code, &r["status"], &r["sandbox"]["launch"]), (0, &json!("completed"), &json!("zygote")), "{r}");
    assert!(r["stdout"].as_str().unwrap().contains("imported"), "{r}");
    let (_, finding) = runtime_finding();
    assert_eq!(finding["ok"], true, "{finding}");
}
