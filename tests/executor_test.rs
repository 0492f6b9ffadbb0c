//! `opservant executor test DIR|NAME`: the real binary, as root, running executor packages'
//! pytest suites inside the sandbox with the repository's `.ci/venv` pytest. The shipped
//! examples pass; a failing package is counted and exits 1; a hostile test suite cannot write
//! /etc, reach a host listener on 127.0.0.1, read /root, write its own package or see the
//! agent's environment (the attempts are asserted inside, the effects checked on the host);
//! bad input (no tests/, invalid manifest, no pytest) exits 2; an installed executor is
//! tested by name.

mod common;

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::HostDir;
use serde_json::Value;

/// The pytest interpreter of the repository (created by `.ci/run`).
fn venv_python() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.ci/venv/bin/python"))
}

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Root and pytest in .ci/venv (a failure under CI, a visible skip otherwise).
#[must_use]
fn ready() -> bool {
    if !common::require_root() {
        return false;
    }
    let ok = Command::new(venv_python())
        .args(["-c", "import pytest"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    common::require("pytest in .ci/venv (run .ci/run)", ok)
}

struct Out {
    code: i32,
    json: Value,
    stdout: String,
    stderr: String,
}

fn executor_test(target: &Path, extra: &[&str]) -> Out {
    let _view = common::host_view();
    let out = common::command()
        .args(["executor", "test"])
        .arg(target)
        .arg("--python")
        .arg(venv_python())
        .args(extra)
        .env("HOSTILE_CANARY", "agent-environment-must-not-leak")
        .stdin(Stdio::null())
        .output()
        .expect("spawn opservant");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    Out {
        code: out.status.code().unwrap_or(-1),
        json: serde_json::from_str(stdout.trim()).unwrap_or(Value::Null),
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A package `name` in `parent` with `tests/test_it.py` = `tests` (None: no tests/).
fn package(parent: &Path, name: &str, tests: Option<&str>) -> PathBuf {
    let dir = parent.join(name);
    let module = name.replace('-', "_");
    std::fs::create_dir_all(dir.join(&module)).unwrap();
    std::fs::write(
        dir.join(&module).join("__init__.py"),
        "from opservant.executor import BaseExecutor, ExecutorResult\n\n\nclass Echo(BaseExecutor):\n    \
         def validate(self, params):\n        return True\n\n    def execute(self, params, context):\n        \
         return ExecutorResult(status=\"completed\", output=dict(params))\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("manifest.json"),
        format!(
            r#"{{"name": "{name}", "version": "1.0.0", "description": "test", "author": "t",
                 "supported_actions": ["act-echo"], "entry_point": "{module}.Echo", "permissions": {{}}}}"#
        ),
    )
    .unwrap();
    if let Some(t) = tests {
        std::fs::create_dir_all(dir.join("tests")).unwrap();
        std::fs::write(dir.join("tests/test_it.py"), t).unwrap();
    }
    dir
}

#[test]
fn shipped_examples_pass() {
    if !ready() {
        return;
    }
    for name in ["port-scanner", "config-check", "disk-usage"] {
        let out = executor_test(&repo().join("executors").join(name), &["--", "-rs"]);
        assert_eq!(out.code, 0, "{name}: {}\n{}", out.stdout, out.stderr);
        let j = &out.json;
        assert_eq!(j["status"], "completed", "{name}: {j}");
        assert_eq!(j["executor"]["name"], name);
        assert!(j["tests"]["passed"].as_u64().unwrap() >= 3, "{name}: {j}");
        assert_eq!(j["tests"]["failed"], 0);
        assert_eq!(j["tests"]["errors"], 0);
        // The sandboxed=True tests are skipped, with the reason.
        assert!(j["tests"]["skipped"].as_u64().unwrap() >= 1, "{name}: {j}");
        assert!(out.stderr.contains("no nested sandbox can be built"), "{name}: {}", out.stderr);
        assert_eq!(j["sandbox"]["network"], "none");
        assert_eq!(j["sandbox"]["seccomp"], "enforced");
        assert_ne!(j["sandbox"]["uid"], 0);
        assert_eq!(j["exit_code"], 0);
        // stdout is the result line alone; pytest's summary is on stderr.
        assert_eq!(out.stdout.trim().lines().count(), 1, "{}", out.stdout);
        assert!(out.stderr.contains(" passed"), "{}", out.stderr);
    }
}

#[test]
fn failures_and_errors_are_counted() {
    if !ready() {
        return;
    }
    let dir = HostDir::new();
    let pkg = package(
        &dir.path,
        "flaky",
        Some(
            r#"import os, pytest
from opservant.testing import ExecutorTestHarness

HARNESS = ExecutorTestHarness(os.path.join(os.path.dirname(__file__), "..", "manifest.json"))

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_passes(tmp_path):
    (tmp_path / "f").write_text("x")
    assert HARNESS.run(params={"a": 1}).output == {"a": 1}

def test_fails():
    assert HARNESS.run(params={"a": 1}).output == {"a": 2}

def test_errors(broken):
    pass

@pytest.mark.skip(reason="not today")
def test_skipped():
    pass
"#,
        ),
    );
    let out = executor_test(&pkg, &[]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let t = &out.json["tests"];
    assert_eq!((t["passed"].as_u64(), t["failed"].as_u64()), (Some(1), Some(1)), "{}", out.json);
    assert_eq!((t["errors"].as_u64(), t["skipped"].as_u64()), (Some(1), Some(1)), "{}", out.json);
    assert_eq!(out.json["status"], "failed");
    assert_eq!(out.json["exit_code"], 1);
    assert!(out.json["error"].as_str().unwrap().contains("1 failed"), "{}", out.json);
    assert!(out.stderr.contains("FAILED") && out.stderr.contains("fixture broke"), "{}", out.stderr);

    // A suite that stops itself with a zero status has not passed: the tests after never ran.
    let bail = package(
        &dir.path,
        "bails",
        Some("import pytest\n\ndef test_bails():\n    pytest.exit('bye', returncode=0)\n\ndef test_never_runs():\n    assert False\n"),
    );
    let out = executor_test(&bail, &[]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.json["status"], "failed", "{}", out.json);
    assert!(out.json["error"].as_str().unwrap().contains("interrupted"), "{}", out.json);

    // Extra pytest arguments reach pytest: only the passing test selected.
    let out = executor_test(&pkg, &["--", "-k", "passes"]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.json["tests"]["passed"], 1);
}

#[test]
fn hostile_tests_stay_in_the_sandbox() {
    if !ready() {
        return;
    }
    let pwned = Path::new("/etc/opservant-pwned");
    let _ = std::fs::remove_file(pwned);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let connected = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (connected, stop) = (connected.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok((mut s, _)) = listener.accept() {
                    connected.store(true, Ordering::Relaxed);
                    let _ = s.read(&mut [0u8; 16]);
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        })
    };
    let dir = HostDir::new();
    let tests = format!(
        r#"import os, socket, subprocess, pytest

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def test_cannot_write_etc():
    with pytest.raises(OSError):
        with open("/etc/opservant-pwned", "w") as f:
            f.write("pwned")

def test_cannot_reach_the_hosts_loopback():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(3)
    with pytest.raises(OSError):
        s.connect(("127.0.0.1", {port}))

def test_no_route_out():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with pytest.raises(OSError):
        s.connect(("192.0.2.1", 53))
        s.send(b"x")

def test_cannot_read_root():
    with pytest.raises(OSError):
        os.listdir("/root")

def test_cannot_write_the_package():
    with pytest.raises(OSError):
        open(os.path.join(PKG, "planted.py"), "w")

def test_unprivileged_and_clean_environment(tmp_path):
    assert os.getuid() != 0 and os.geteuid() != 0
    assert "HOSTILE_CANARY" not in os.environ
    assert not os.path.exists("/etc/opservant")
    (tmp_path / "scratch-is-writable").write_text("ok")

def test_no_nested_sandbox():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.unshare(0x10000000) == -1  # CLONE_NEWUSER
    assert ctypes.get_errno() != 0
"#
    );
    let pkg = package(&dir.path, "hostile", Some(&tests));
    let out = executor_test(&pkg, &["--", "-rA"]);
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    assert_eq!(out.code, 0, "every escape attempt must fail inside: {}\n{}", out.stdout, out.stderr);
    assert_eq!(out.json["tests"]["passed"], 7, "{}", out.json);
    assert!(!pwned.exists(), "{} was written on the host", pwned.display());
    assert!(!connected.load(Ordering::Relaxed), "the sandboxed test reached the host's 127.0.0.1:{port}");
    assert!(!pkg.join("planted.py").exists());
}

/// The test session's output is the package's code's: on the operator's terminal its
/// control characters (an escape sequence retitling the window, a carriage return) are shown
/// escaped, never sent. `script` gives the command a terminal.
#[test]
fn the_sessions_output_reaches_a_terminal_without_its_control_characters() {
    if !ready() {
        return;
    }
    let dir = HostDir::new();
    let tests = "import os\n\ndef test_x():\n    os.write(2, b'before\\x1b]2;owned\\x07\\rafter\\n')\n";
    let pkg = package(&dir.path, "noisy", Some(tests));
    let command =
        format!("{} executor test {} --python {} -- -s", common::opservant(), pkg.display(), venv_python().display());
    let _view = common::host_view();
    let out = Command::new("script")
        .args(["-qefc", &command, "/dev/null"])
        .env("OPSERVANT_CONFIG", common::test_config())
        .stdin(Stdio::null())
        .output()
        .expect("script (util-linux)");
    let seen = String::from_utf8_lossy(&out.stdout);
    assert!(seen.contains("before\\x1b]2;owned\\x07\\x0dafter"), "{seen}");
    assert!(!seen.contains("\u{1b}]2;owned") && !seen.contains("owned\u{7}"), "{seen}");
}

/// What the session prints reaches stderr up to 16 MiB, then a note of what was left out
/// (a suite printing without end had filled a CI log's disk at 300 MB a second).
#[test]
fn the_sessions_output_shown_is_bounded() {
    if !ready() {
        return;
    }
    let dir = HostDir::new();
    let pkg = package(
        &dir.path,
        "chatty",
        Some("import os\n\ndef test_chatty():\n    for _ in range(24):\n        os.write(2, b'x' * (1 << 20))\n"),
    );
    // `-s`: pytest's capture off, so the test's writes reach the session's stderr.
    let out = executor_test(&pkg, &["--", "-s"]);
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert!(out.stderr.len() < (16 << 20) + (64 << 10), "{} bytes shown", out.stderr.len());
    assert!(out.stderr.contains("output past 16 MiB is not shown"), "{}", &out.stderr[out.stderr.len() - 300..]);
    assert_eq!(out.json["stderr_truncated"], true, "{}", out.json);
}

#[test]
fn bad_input_exits_2() {
    if !ready() {
        return;
    }
    let dir = HostDir::new();
    // No tests/ directory.
    let pkg = package(&dir.path, "untested", None);
    let out = executor_test(&pkg, &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("no tests/ directory"), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "{}", out.stdout);

    // An invalid manifest.
    let pkg = package(&dir.path, "broken", Some("def test_x():\n    pass\n"));
    std::fs::write(pkg.join("manifest.json"), r#"{"name": "Broken!", "version": "one"}"#).unwrap();
    let out = executor_test(&pkg, &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("manifest"), "{}", out.stderr);

    // An interpreter without pytest (Debian's own, under -I).
    let pkg = package(&dir.path, "fine", Some("def test_x():\n    pass\n"));
    let out =
        common::command().args(["executor", "test"]).arg(&pkg).args(["--python", "/usr/bin/python3"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let has_pytest = Command::new("/usr/bin/python3").args(["-I", "-c", "import pytest"]).status().unwrap().success();
    if has_pytest {
        assert!(!stderr.contains("without pytest"), "Debian's python3 has pytest here: {stderr}");
    } else {
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("without pytest") && stderr.contains("--python PATH"), "{stderr}");
    }
    // A name that is neither a directory nor installed.
    let out = executor_test(Path::new("no-such-executor"), &[]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    // A zero timeout, whatever the interpreter.
    let out = executor_test(&pkg, &["--timeout", "0"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("--timeout: must be at least 1 second"), "{}", out.stderr);

    // pytest that cannot be imported inside the sandbox (here a `.deps/pytest.py` that
    // fails): it could not run (exit 2), and its start has its end record all the same.
    let pkg = package(&dir.path, "no-pytest", Some("def test_x():\n    pass\n"));
    std::fs::create_dir_all(pkg.join(".deps")).unwrap();
    std::fs::write(pkg.join(".deps/pytest.py"), "raise ImportError('a broken pytest')\n").unwrap();
    let out = executor_test(&pkg, &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    let end = out.stderr.lines().find(|l| l.contains(r#"event="executor_test_end""#));
    assert!(out.stderr.contains(r#"event="executor_test_start""#), "{}", out.stderr);
    assert!(
        end.is_some_and(|l| l.contains(r#""status":"error""#)
            && l.contains("pytest is not importable")
            && l.contains("a broken pytest")),
        "{}",
        out.stderr
    );

    // Arguments after -- that pytest refuses: could not run (exit 2), pytest's reason named.
    let pkg = package(&dir.path, "bad-args", Some("def test_x():\n    pass\n"));
    let out = executor_test(&pkg, &["--", "--no-such-pytest-option"]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    // The reason is pytest's own line (not the rootdir it prints after it), in the error
    // and in the audit record.
    let error = out.stderr.lines().find(|l| l.contains("pytest refused its arguments")).unwrap_or_default();
    assert!(error.contains("--no-such-pytest-option") && !error.contains("rootdir"), "{}", out.stderr);
    let end = out.stderr.lines().find(|l| l.contains(r#"event="executor_test_end""#)).unwrap_or_default();
    assert!(end.contains("--no-such-pytest-option"), "{}", out.stderr);

    // `pytest.exit(returncode=4)` from a test is the test's status, not a usage error: the
    // session ended (exit 1, a result line with pytest's status).
    let pkg =
        package(&dir.path, "exit-4", Some("import pytest\n\ndef test_x():\n    pytest.exit('bye', returncode=4)\n"));
    let out = executor_test(&pkg, &[]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.json["exit_code"], 4, "{}", out.stdout);
    // So is one from the tests' configuration, which ends pytest before its session finishes.
    let pkg = package(&dir.path, "exit-4-early", Some("def test_x():\n    pass\n"));
    std::fs::write(
        pkg.join("tests/conftest.py"),
        "import pytest\n\ndef pytest_configure(config):\n    pytest.exit('early', returncode=4)\n",
    )
    .unwrap();
    let out = executor_test(&pkg, &[]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.json["exit_code"], 4, "{}", out.stdout);

    // Test code that exits as those would (121, 4) says nothing on the channel: the session
    // ended without completing (exit 1, a result line), not "could not run".
    for status in [121, 4] {
        let pkg = package(&dir.path, &format!("exits-{status}"), Some("def test_x():\n    pass\n"));
        std::fs::write(pkg.join("tests/conftest.py"), format!("import os\nos._exit({status})\n")).unwrap();
        let out = executor_test(&pkg, &[]);
        assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
        assert_eq!(out.json["status"], "failed", "{}", out.stdout);
        assert_eq!(out.json["exit_code"], status, "{}", out.stdout);
        let error = out.json["error"].as_str().unwrap_or_default();
        assert!(error.contains(&format!("without a pytest report (exit status {status})")), "{}", out.stdout);
        let end = out.stderr.lines().find(|l| l.contains(r#"event="executor_test_end""#));
        assert!(end.is_some_and(|l| l.contains(r#""status":"failed""#)), "{}", out.stderr);
    }
}

#[test]
fn installed_executor_by_name() {
    if !ready() {
        return;
    }
    let dir = HostDir::new();
    let root = dir.path.join("executors");
    let config = dir.path.join("config.yaml");
    // `executor install` appends to the audit log: keep it in the scratch directory.
    std::fs::write(
        &config,
        format!("executors:\n  dir: {}\naudit:\n  path: {}\n", root.display(), dir.path.join("audit.jsonl").display()),
    )
    .unwrap();
    let src = repo().join("executors/port-scanner");
    let st = common::command()
        .args(["executor", "install"])
        .arg(&src)
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    assert!(root.join("port-scanner/current/tests/test_port_scanner.py").is_file(), "install keeps tests/");
    let out = executor_test(Path::new("port-scanner"), &["--config", config.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.json["executor"]["name"], "port-scanner");
    assert_eq!(out.json["tests"]["failed"], 0);
}
