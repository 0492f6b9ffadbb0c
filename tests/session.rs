//! `opservant session start|exec|stop|list` (seed 002): globals kept between calls, sessions
//! isolated from each other, the import allowlist, per-call timeout and memory exhaustion
//! ending the session, idle expiry, and access limited to root.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use common::{opservant, require_root};
use serde_json::{json, Value};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A session that is stopped (if still running) when the test ends.
struct Session {
    name: String,
}

/// A session name no other test of this run uses.
fn fresh_name() -> String {
    format!("t{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed))
}

impl Session {
    fn start(args: &[&str]) -> (Session, Value) {
        let name = fresh_name();
        let out = common::command().args(["session", "start", &name]).args(args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "start: {stdout} {}", String::from_utf8_lossy(&out.stderr));
        let json: Value = serde_json::from_str(stdout.trim()).unwrap();
        (Session { name }, json)
    }

    fn exec(&self, code: &str, extra: &[&str]) -> (i32, Value) {
        let out = common::command().args(["session", "exec", &self.name, "--code", code]).args(extra).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let code = out.status.code().unwrap_or(-1);
        if code == 2 {
            return (2, Value::String(String::from_utf8_lossy(&out.stderr).into_owned()));
        }
        (code, serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}")))
    }

    fn stop(&self) -> (i32, String) {
        let out = common::command().args(["session", "stop", &self.name]).output().unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn socket(&self) -> String {
        format!("/run/opservant/sessions/{}.sock", self.name)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.stop();
        // The daemon keeps its log (audit lines) after the session ends; a test's is litter.
        let _ = std::fs::remove_file(format!("/run/opservant/sessions/{}.log", self.name));
    }
}

#[test]
fn state_persists_between_calls() {
    if !require_root() {
        return;
    }
    let (s, started) = Session::start(&["--allow-import", "json", "--default-import", "m=math"]);
    assert_eq!(started["status"], "started");
    assert_eq!(started["allow_imports"], serde_json::json!(["json", "math"]));
    // What the session's sandbox enforces, as a run's result reports it (DESIGN.md §4).
    let sb = &started["sandbox"];
    assert_eq!(
        sb["namespaces"],
        serde_json::json!(["user", "mount", "pid", "net", "ipc", "uts", "cgroup"]),
        "{started}"
    );
    assert_eq!(sb["seccomp"], "enforced", "{started}");
    assert!(sb["landlock"]["abi"].as_u64().is_some_and(|a| a > 0), "{started}");
    assert_eq!(sb["capabilities"], "none", "{started}");
    assert_eq!(sb["no_new_privs"], true, "{started}");
    assert_eq!(sb["launch"], "cold", "{started}");
    assert_eq!(sb["uid"], 65534, "{started}");
    assert!(!sb["cgroup_paths"].as_array().unwrap().is_empty(), "{started}");

    let (code, r) = s.exec("counter = 1\ndef bump(n):\n    return n + 1\nclass Box:\n    pass\nprint('first')", &[]);
    assert_eq!(code, 0, "{r}");
    assert_eq!((r["success"].clone(), r["stdout"].clone()), (Value::Bool(true), "first\n".into()));
    assert_eq!(r["status"], "completed", "{r}");

    let (code, r) = s.exec(
        "counter = bump(counter) + offset\nimport json\nout = json.dumps({'c': counter})\nroot = m.sqrt(81)",
        &["--globals", r#"{"offset": 40}"#, "--return", "counter,out,root,missing,Box"],
    );
    assert_eq!(code, 0, "{r}");
    let g = &r["globals"];
    assert_eq!(g["counter"], 42);
    assert_eq!(g["out"], r#"{"c": 42}"#);
    assert_eq!(g["root"], 9.0);
    assert!(g.get("missing").is_none(), "undefined names are left out: {g}");
    assert!(g["Box"].as_str().unwrap().contains("class"), "non-JSON values come back as repr: {g}");

    // An error does not end the session, and earlier state survives it.
    let (code, r) = s.exec("counter += 1\n1/0", &[]);
    assert_eq!(code, 1);
    assert!(r["error"].as_str().unwrap().contains("ZeroDivisionError"), "{r}");
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["session_ended"], false);
    let (_, r) = s.exec("pass", &["--return", "counter"]);
    assert_eq!(r["globals"]["counter"], 43);

    // Stop: the socket goes away and later calls cannot run (exit 2).
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
    assert!(!std::path::Path::new(&s.socket()).exists());
    let (code, msg) = s.exec("counter", &[]);
    assert_eq!(code, 2);
    assert!(msg.as_str().unwrap().contains("no session"), "{msg}");
}

#[test]
fn imports_are_allowlisted() {
    if !require_root() {
        return;
    }
    // No allowlist: every import is refused.
    let (s, _) = Session::start(&[]);
    let (code, r) = s.exec("import json", &[]);
    assert_eq!(code, 1);
    assert!(r["error"].as_str().unwrap().contains("not allowed"), "{r}");
    drop(s);

    let (s, _) = Session::start(&["--allow-import", "json,collections"]);
    for code in [
        "import os",
        "import subprocess",
        "import ctypes",
        "import socket",
        "from os import path",
        "import importlib",
        "__import__('os')",
        "open('/etc/passwd')",
        "import jsonx",
        // A str whose own == says yes to every name.
        "class S(str):\n    __eq__ = lambda s, o: True\n    __hash__ = str.__hash__\n__import__(S('os'))",
        "class S(str):\n    startswith = lambda s, p: True\n__import__(S('os'))",
    ] {
        let (status, r) = s.exec(code, &[]);
        assert_eq!(status, 1, "{code}: {r}");
        let err = r["error"].as_str().unwrap();
        assert!(err.contains("not allowed") || err.contains("NameError"), "{code}: {err}");
    }
    // Allowed modules and their submodules work.
    let (status, r) =
        s.exec("import json.decoder\nfrom collections import OrderedDict\nx = json.loads('[1]')", &["--return", "x"]);
    assert_eq!(status, 0, "{r}");
    assert_eq!(r["globals"]["x"], serde_json::json!([1]));
    // exec() of a fresh namespace gets the restricted builtins too.
    let (status, r) = s.exec("exec('import os', {})", &[]);
    assert_eq!(status, 1, "{r}");
    assert!(r["error"].as_str().unwrap().contains("not allowed"), "{r}");
    drop(s);

    // A submodule allowed alone is imported in either form (seed 002's `matplotlib.pyplot`
    // is written `from matplotlib import pyplot`); nothing else of its package is.
    let (s, _) = Session::start(&["--allow-import", "xml.etree.ElementTree"]);
    let (status, r) = s.exec(
        "from xml.etree import ElementTree\nimport xml.etree.ElementTree as ET\nx = ElementTree.fromstring('<a>1</a>').text + ET.tostring(ET.Element('b')).decode()",
        &["--return", "x"],
    );
    assert_eq!((status, r["globals"]["x"].clone()), (0, serde_json::json!("1<b />")), "{r}");
    for code in [
        "from xml.etree import ElementPath",
        "from xml.etree import ElementTree, cElementTree",
        "import xml.etree",
        "from xml import dom",
        "from xml.etree import *",
    ] {
        let (status, r) = s.exec(code, &[]);
        assert_eq!(status, 1, "{code}: {r}");
        assert!(r["error"].as_str().unwrap().contains("not allowed"), "{code}: {r}");
    }
}

#[test]
fn a_default_import_never_implies_os() {
    if !require_root() {
        return;
    }
    for flag in ["o=os", "p=os.path", "sp=subprocess", "c=ctypes", "s=socket"] {
        let out =
            common::command().args(["session", "start", "never-implied", "--default-import", flag]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("never implied"), "{flag}");
    }
}

#[test]
fn sessions_are_isolated_from_each_other() {
    if !require_root() {
        return;
    }
    let (a, _) = Session::start(&[]);
    let (b, _) = Session::start(&[]);
    let (_, r) = a.exec("secret = 'only-in-a'", &[]);
    assert_eq!(r["success"], true);
    let (_, r) = b.exec("x = secret", &[]);
    assert!(r["error"].as_str().unwrap().contains("NameError"), "{r}");
    // Different sandboxes, each held by its own daemon.
    let daemon_of = |s: &Session| -> u64 {
        let out = common::command().args(["session", "list"]).output().unwrap();
        let list: Value = serde_json::from_slice(&out.stdout).unwrap();
        list["sessions"].as_array().unwrap().iter().find(|x| x["session"] == s.name.as_str()).unwrap()["pid"]
            .as_u64()
            .unwrap()
    };
    assert_ne!(daemon_of(&a), daemon_of(&b));
}

#[test]
fn a_call_that_times_out_ends_the_session() {
    if !require_root() {
        return;
    }
    let (s, started) = Session::start(&["--timeout", "2"]);
    let marker = format!("opservant-sb-{}-", started["pid"]);
    let mine = || -> Vec<std::path::PathBuf> {
        common::sandbox_cgroups().into_iter().filter(|p| p.to_string_lossy().contains(&marker)).collect()
    };
    assert!(!mine().is_empty(), "the session's cgroups exist while it runs");
    let (_, r) = s.exec("x = 1", &[]);
    assert_eq!(r["success"], true);
    let (code, r) = s.exec("while True:\n    pass", &[]);
    assert_eq!(code, 1);
    assert_eq!(r["success"], false);
    assert_eq!(r["session_ended"], true);
    assert_eq!(r["killed_by"], "timeout");
    assert_eq!(r["status"], "timeout", "{r}");
    assert!(r["error"].as_str().unwrap().contains("timed out after 2 s"), "{r}");
    // The session is gone: its socket, its processes and its cgroups.
    let (code, _) = s.exec("x", &[]);
    assert_eq!(code, 2);
    assert!(!std::path::Path::new(&s.socket()).exists());
    assert!(mine().is_empty(), "cgroups left behind: {:?}", mine());
}

#[test]
fn a_per_call_timeout_cannot_exceed_the_sessions() {
    if !require_root() {
        return;
    }
    // (3 s: a call's clock holds its audit record's flush, slow on a busy machine.)
    let (s, _) = Session::start(&["--timeout", "3"]);
    // Shortened, and said so.
    let (code, r) = s.exec("x = 1", &["--timeout", "100"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["clamped"],
        serde_json::json!([{"field": "timeout_seconds", "requested": 100, "applied": 3, "reason": "the session's call timeout"}]),
        "{r}"
    );
    assert!(s.exec("x = 2", &["--timeout", "3"]).1.get("clamped").is_none());
    // A timeout of 0 sent straight to the socket (the CLI refuses it) is refused too, not
    // raised to 1 s without a word.
    use std::io::{Read, Write};
    let mut c = std::os::unix::net::UnixStream::connect(s.socket()).unwrap();
    c.write_all(br#"{"op": "exec", "code": "x = 3", "globals": {}, "return": [], "timeout_s": 0}"#).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = String::new();
    c.read_to_string(&mut reply).unwrap();
    let reply: serde_json::Value = serde_json::from_str(reply.trim()).unwrap();
    assert!(reply["refused"].as_str().unwrap().contains("timeout_s must be at least 1"), "{reply}");
    let (code, r) = s.exec("y = x", &["--return", "y"]);
    assert_eq!((code, &r["globals"]["y"]), (0, &serde_json::json!(2)), "the refused call did not run: {r}");
    let (_, r) = s.exec("while True:\n    pass", &["--timeout", "100"]);
    assert_eq!(r["killed_by"], "timeout");
    assert!(r["error"].as_str().unwrap().contains("after 3 s"), "{r}");
    assert_eq!(r["clamped"][0]["applied"], 3, "{r}");
}

#[test]
fn a_call_runs_at_most_the_agents_timeout_ceiling() {
    if !require_root() {
        return;
    }
    // `resource_limits.max_timeout_seconds` bounds a call as it bounds a run: the session's
    // `--timeout` above it is clamped, reported and audited.
    let dir = common::HostDir::new();
    let audit = dir.path.join("audit.jsonl");
    let config = dir.path.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "resource_limits:\n  default_timeout_seconds: 2\n  max_timeout_seconds: 2\naudit:\n  path: {}\n  journald: false\n",
            audit.display()
        ),
    )
    .unwrap();
    let (s, started) = Session::start(&["--timeout", "30", "--config", config.to_str().unwrap()]);
    assert_eq!(started["call_timeout_seconds"], 2, "{started}");
    let clamp = started["limits"]["clamped"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["field"] == "call_timeout_seconds")
        .unwrap_or_else(|| panic!("no clamp reported: {started}"))
        .clone();
    assert_eq!((clamp["requested"].as_u64(), clamp["applied"].as_u64()), (Some(30), Some(2)), "{clamp}");
    let records: Vec<Value> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|r: &Value| r["event"] == "limit_clamped")
        .collect();
    assert!(
        records
            .iter()
            .any(|r| r["fields"]["session"] == s.name.as_str() && r["fields"]["field"] == "call_timeout_seconds"),
        "no limit_clamped record: {records:?}"
    );
    let (_, r) = s.exec("while True:\n    pass", &["--timeout", "20"]);
    assert_eq!(r["killed_by"], "timeout", "{r}");
    assert!(r["error"].as_str().unwrap().contains("after 2 s"), "{r}");
}

/// A session's timeouts past their maxima (a call 300 s, idle a day, a lifetime 7 days) are
/// clamped and reported, as a script's `--timeout` is — not refused.
#[test]
fn timeouts_past_their_maxima_are_clamped_and_reported() {
    if !require_root() {
        return;
    }
    let (s, started) =
        Session::start(&["--timeout", "301", "--idle-timeout", "86401", "--max-lifetime", "999999999999"]);
    let clamps = started["limits"]["clamped"].as_array().unwrap().clone();
    for (field, requested, applied) in [
        ("call_timeout_seconds", 301u64, 300u64),
        ("idle_timeout_seconds", 86_401, 86_400),
        ("max_lifetime_seconds", 999_999_999_999, 7 * 86_400),
    ] {
        assert_eq!(started[field], applied, "{started}");
        let c = clamps.iter().find(|c| c["field"] == field).unwrap_or_else(|| panic!("no clamp of {field}: {started}"));
        assert_eq!((c["requested"].as_u64(), c["applied"].as_u64()), (Some(requested), Some(applied)), "{c}");
    }
    let (code, r) = s.exec("x = 1", &["--return", "x"]);
    assert_eq!((code, r["globals"]["x"].clone()), (0, serde_json::json!(1)), "{r}");
}

#[test]
fn session_logs_are_rotated_and_stale_ones_swept() {
    if !require_root() {
        return;
    }
    // `/run` is memory: a log over 1 MiB is rotated when a session of its name starts, and a
    // log no session can still be writing (untouched for longer than the longest lifetime,
    // 7 days) is removed by any start.
    let dir = std::path::Path::new("/run/opservant/sessions");
    // A first session makes sure the directory exists, as sessions create it.
    drop(Session::start(&[]));
    let (stale, recent) = (dir.join(format!("{}.log", fresh_name())), dir.join(format!("{}.log", fresh_name())));
    for log in [&stale, &recent] {
        std::fs::write(log, "an old session's lines\n").unwrap();
    }
    let eight_days_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(8 * 86_400);
    std::fs::File::options().write(true).open(&stale).unwrap().set_modified(eight_days_ago).unwrap();
    let name = fresh_name();
    let log = dir.join(format!("{name}.log"));
    std::fs::write(&log, vec![b'x'; (1 << 20) + 1]).unwrap();
    let out = common::command().args(["session", "start", &name]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let s = Session { name };
    let rotated = dir.join(format!("{}.log.1", s.name));
    let rotated_len = std::fs::metadata(&rotated).map(|m| m.len());
    let recent_kept = recent.exists();
    let _ = std::fs::remove_file(&rotated);
    let _ = std::fs::remove_file(&recent);
    assert!(recent_kept, "a recent log was removed");
    assert_eq!(rotated_len.ok(), Some((1 << 20) + 1), "the large log was not rotated");
    assert!(std::fs::metadata(&log).unwrap().len() < 1 << 20, "the new session wrote to the old log");
    assert!(!stale.exists(), "a log untouched for 8 days was kept");
    drop(s);
}

/// A session that lives for days rotates its own log once it is over 1 MiB (after a
/// request), and goes on writing to the new one.
#[test]
fn a_running_session_rotates_its_own_log() {
    if !require_root() {
        return;
    }
    let dir = std::path::Path::new("/run/opservant/sessions");
    let (s, _) = Session::start(&[]);
    let log = dir.join(format!("{}.log", s.name));
    let rotated = dir.join(format!("{}.log.1", s.name));
    // Its log is its stderr, opened for appending: grown from outside as its own lines would.
    std::fs::OpenOptions::new().append(true).open(&log).unwrap().write_all(&vec![b'x'; (1 << 20) + 1]).unwrap();
    let (code, r) = s.exec("a = 1", &[]);
    assert_eq!(code, 0, "{r}");
    // Rotated once the request is answered (the reply can reach this test first): the old
    // log renamed, then a new one in its place.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let rotated_len = loop {
        let len = std::fs::metadata(&rotated).map(|m| m.len()).unwrap_or(0);
        let replaced = std::fs::metadata(&log).is_ok_and(|m| m.len() < 1 << 20);
        if (len > 0 && replaced) || std::time::Instant::now() > deadline {
            break len;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(rotated_len > 1 << 20, "not rotated: {rotated_len}");
    assert!(std::fs::metadata(&log).unwrap().len() < 1 << 20, "a new log in its place");
    // Later lines go to the new log: a refused client is logged there.
    let (code, r) = s.exec("b = 2", &[]);
    assert_eq!(code, 0, "{r}");
    let _ = std::fs::remove_file(&rotated);
    assert!(std::fs::metadata(&log).unwrap().len() > 0, "the session writes to its new log");
    drop(s);
}

#[test]
fn memory_exhaustion_ends_the_session() {
    if !require_root() {
        return;
    }
    let dir = common::HostDir::new();
    let m = common::manifest(&dir, "{}", r#"{"max_memory_mb": 64}"#);
    let (s, _) = Session::start(&["--manifest", m.to_str().unwrap()]);
    let (code, r) = s.exec("blocks = []\nwhile True:\n    blocks.append(bytearray(8 << 20))", &[]);
    assert_eq!(code, 1);
    assert_eq!(r["session_ended"], true, "{r}");
    assert_eq!(r["killed_by"], "oom", "{r}");
    assert!(r["error"].as_str().unwrap().contains("out of memory (limit 64 MB)"), "{r}");
    assert_eq!(s.exec("1", &[]).0, 2);
}

/// A call whose child is killed for memory while its parent replies: the reply would come
/// before the sandbox's monitor ends the rest (v1: after its notification and a settle
/// time), so a call that ran out of memory answered `success: true` and the session died
/// after it. The call is the session's last now, and says so. (Racy on the old code — 9 of
/// 10 in the review — so several rounds.)
#[test]
fn a_call_whose_child_runs_out_of_memory_ends_the_session() {
    if !require_root() {
        return;
    }
    let dir = common::HostDir::new();
    let m = common::manifest(&dir, "{}", r#"{"max_memory_mb": 64, "max_cpu_percent": 100}"#);
    let code = "b = print.__self__\nos = b.__import__('os')\npid = os.fork()\n\
                if pid == 0:\n    x = b'\\x01' * (80 << 20)\n    os._exit(0)\nelse:\n    print(os.waitpid(pid, 0))";
    for round in 0..3 {
        let (s, _) = Session::start(&["--manifest", m.to_str().unwrap(), "--allow-import", "os"]);
        assert_eq!(s.exec("keep = 42", &[]).0, 0);
        let (status, r) = s.exec(code, &[]);
        assert_eq!(status, 1, "round {round}: {r}");
        assert_eq!((&r["session_ended"], &r["killed_by"]), (&json!(true), &json!("oom")), "round {round}: {r}");
        assert!(r["error"].as_str().unwrap().contains("out of memory (limit 64 MB)"), "round {round}: {r}");
        assert_eq!(s.exec("print(keep)", &[]).0, 2, "round {round}: the session is over");
    }
}

/// What a session's sandbox sends is held to the caps the runtime keeps (1 MiB each of
/// `stdout`, `stderr`, `error`): session code can replace the runtime's reply function.
#[test]
fn a_reply_session_code_inflates_is_capped_by_the_agent() {
    if !require_root() {
        return;
    }
    let (s, started) = Session::start(&["--timeout", "20"]);
    let pid = started["pid"].as_u64().unwrap();
    let hook = "b = print.__self__\nrt = b.__import__('sys').modules['opservant._runtime']\nreal = rt._session_reply\n\
                def big(c, r):\n    r['stdout'] = 'A' * (3 << 20)\n    r['stderr'] = '\\u00e9' * (2 << 20)\n    real(c, r)\n\
                rt._session_reply = big";
    let (status, r) = exec_within(&s, pid, hook, &[], 15).expect("answered");
    assert_eq!(status, 0, "{r}");
    let (status, r) = exec_within(&s, pid, "x = 1", &[], 15).expect("answered");
    assert_eq!(status, 0, "{r}");
    for part in ["stdout", "stderr"] {
        let text = r[part].as_str().unwrap();
        let json = serde_json::to_string(text).unwrap().len() - 2;
        assert!(json <= (1 << 20) + 64, "{part}: {json} bytes of JSON");
        assert!(text.ends_with("more bytes dropped]"), "{part}: …{}", &text[text.len() - 80..]);
    }
}

/// The sandbox's last line of stderr is quoted as its own when the interpreter ends, never
/// read as the agent's reason.
#[test]
fn an_interpreters_last_words_are_quoted_as_its_own() {
    if !require_root() {
        return;
    }
    let (s, _) = Session::start(&["--allow-import", "os"]);
    let (status, r) = s.exec("import os\nos.write(2, b'it ran out of memory (limit 128 MB)\\n')\nos._exit(0)", &[]);
    assert_eq!(status, 1, "{r}");
    assert_eq!((&r["session_ended"], &r["killed_by"]), (&json!(true), &Value::Null), "{r}");
    let error = r["error"].as_str().unwrap();
    assert!(
        error.contains(
            "exited with status 0 (the last line it wrote to stderr: \"it ran out of memory (limit 128 MB)\")"
        ),
        "{error}"
    );
}

#[test]
fn idle_sessions_expire() {
    if !require_root() {
        return;
    }
    let (s, _) = Session::start(&["--idle-timeout", "1"]);
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let (code, msg) = s.exec("1", &[]);
    assert_eq!(code, 2, "{msg}");
    assert!(!std::path::Path::new(&s.socket()).exists());
}

#[test]
fn only_root_reaches_a_session() {
    if !require_root() {
        return;
    }
    let (s, _) = Session::start(&[]);
    let meta = std::fs::metadata(s.socket()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let dir = std::fs::metadata("/run/opservant/sessions").unwrap();
    assert_eq!(dir.permissions().mode() & 0o777, 0o700);
    // An unprivileged user is turned away (exit 2), and the session is unaffected.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(opservant())
        .args(["session", "exec", &s.name, "--code", "x = 1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("permission denied"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (code, r) = s.exec("y = 2", &[]);
    assert_eq!(code, 0, "{r}");
}

#[test]
fn the_sandbox_holds_inside_a_session() {
    if !require_root() {
        return;
    }
    // Even with os explicitly allowed (defence in depth is the OS sandbox), the session
    // cannot see host files, reach the network or write outside its scratch.
    let (s, started) = Session::start(&["--allow-import", "os,socket"]);
    assert!(!started["warnings"].as_array().unwrap().is_empty(), "allowing os is warned about: {started}");
    // Control: a listener on the host's loopback, which the host reaches.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("control: the host reaches its listener");
    let code = r#"
import os, socket
res = {"uid": os.getuid(), "root": os.path.exists("/root"), "home": os.listdir("/home") if os.path.exists("/home") else []}
res["net"] = []
for addr in [("127.0.0.1", {port}), ("192.0.2.1", 53)]:
    try:
        socket.create_connection(addr, timeout=2); res["net"].append("CONNECTED")
    except OSError as e:
        res["net"].append(e.errno)
res["ifaces"] = [l.split(":")[0].strip() for l in os.read(os.open("/proc/net/dev", os.O_RDONLY), 1 << 16).decode().splitlines()[2:]]
try:
    os.open("/usr/x", os.O_CREAT | os.O_WRONLY); res["usr_write"] = True
except OSError:
    res["usr_write"] = False
"#
    .replace("{port}", &port.to_string());
    let (status, r) = s.exec(&code, &["--return", "res"]);
    assert_eq!(status, 0, "{r}");
    let res = &r["globals"]["res"];
    assert_ne!(res["uid"], 0);
    assert_eq!(res["root"], false);
    assert_eq!(res["home"], serde_json::json!([]));
    // Its own loopback has no listener (ECONNREFUSED); nothing else is routed (ENETUNREACH,
    // 192.0.2.1 being a documentation address that nothing would answer anyway).
    assert_eq!(res["net"], serde_json::json!([111, 101]), "{r}");
    assert_eq!(res["ifaces"], serde_json::json!(["lo"]), "{r}");
    assert_eq!(res["usr_write"], false);
}

#[test]
fn bad_input_is_exit_2() {
    if !require_root() {
        return;
    }
    for args in [
        vec!["session", "start", "../escape"],
        vec!["session", "start", "ok-name", "--allow-import", "json;os"],
        vec!["session", "start", "ok-name", "--timeout", "0"],
        vec!["session", "exec", "no-such-session", "--code", "1"],
        vec!["session", "exec", "no-such-session", "--code", "1", "--globals", "[1]"],
        vec!["session", "stop", "no-such-session"],
    ] {
        let out = common::command().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(!out.stderr.is_empty(), "{args:?}");
    }
}

#[test]
fn third_party_packages_come_from_python_path() {
    if !require_root() {
        return;
    }
    let lib = common::HostDir::new();
    lib.file("mylib.py", "def answer():\n    return 42\n", 0o644);
    let (s, _) =
        Session::start(&["--python-path", lib.str(), "--allow-import", "mylib", "--default-import", "ml=mylib"]);
    let (code, r) = s.exec("import mylib\nx = mylib.answer() + ml.answer()", &["--return", "x"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["globals"]["x"], 84);
    // On sys.path, but still behind the allowlist.
    let (t, _) = Session::start(&["--python-path", lib.str()]);
    let (code, r) = t.exec("import mylib", &[]);
    assert_eq!(code, 1);
    assert!(r["error"].as_str().unwrap().contains("not allowed"), "{r}");
}

/// The session's CPU quota is written when the runtime reports ready; code a default import
/// runs before that (a package from --python-path) cannot report the start itself and have
/// the session run without one.
#[test]
fn a_start_reported_before_ready_fails_the_start() {
    if !require_root() {
        return;
    }
    let lib = common::HostDir::new();
    lib.file("early.py", "import _opservant\n_opservant.session_reply({'success': True})\n", 0o644);
    // Stopped (and its log removed) should it have started after all.
    let session = Session { name: fresh_name() };
    let out = common::command()
        .args(["session", "start", &session.name, "--python-path", lib.str(), "--allow-import", "early"])
        .args(["--default-import", "e=early"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "started: {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains("reported its start before it was ready"), "{stderr}");
}

/// An interrupt meant for a call whose client went, arriving only during the next call
/// (init forwards it from the session's CPU-throttled cgroup), is not that call's: the next
/// caller's code must not fail with `KeyboardInterrupt`. Made certain here by a call that
/// blocks SIGINT until its end and a next call that unblocks it.
#[test]
fn a_late_interrupt_for_an_earlier_call_does_not_interrupt_the_next() {
    if !require_root() {
        return;
    }
    let (s, started) = Session::start(&["--allow-import", "signal,time"]);
    let daemon_pid = started["pid"].as_u64().unwrap();
    let log = format!("/run/opservant/sessions/{}.log", s.name);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let blocking = "import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\ntime.sleep(2)";
    let mut client = common::command()
        .args(["session", "exec", &s.name, "--code", blocking])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while read_log().matches("session_exec\"").count() < 1 {
        assert!(std::time::Instant::now() < deadline, "the call never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    client.kill().unwrap();
    client.wait().unwrap();
    while !read_log().contains("session_exec_interrupted") {
        assert!(std::time::Instant::now() < deadline, "the call was not interrupted");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Served once the first call has slept its time; the SIGINT, pending, lands here.
    let unblock = "import signal\nsignal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\nx = 1";
    let (code, r) = exec_within(&s, daemon_pid, unblock, &["--return", "x"], 20).expect("the next call is answered");
    assert_eq!((code, &r["globals"]["x"]), (0, &Value::from(1)), "{r}");
    // Interrupts of this call's own still raise.
    let (code, r) = s.exec("import signal\nsignal.raise_signal(signal.SIGINT)\ny = 1", &["--return", "y"]);
    assert_eq!(code, 1, "{r}");
    assert!(r["error"].as_str().unwrap().contains("KeyboardInterrupt"), "{r}");
}

/// A start that loses to a concurrent start of the same name keeps the log it created when
/// its daemon failed on the name's lock: the winner's daemon takes the lock at once but
/// makes its socket only once its interpreter is up (up to 30 s), and writes to that log —
/// the loser checked the socket alone and unlinked the winner's log.
#[test]
fn a_start_that_loses_the_name_keeps_the_winners_log() {
    if !require_root() {
        return;
    }
    // The sessions' directory, as a start makes it.
    let (first, _) = Session::start(&[]);
    drop(first);
    let name = fresh_name();
    let lock = format!("/run/opservant/sessions/{name}.lock");
    let log = format!("/run/opservant/sessions/{name}.log");
    // The winner's daemon, holding the lock while its interpreter starts (held here: a
    // flock(1) holder left its `sleep` running for ten minutes after the test).
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lock).unwrap();
    let holder =
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, e)| e).unwrap();
    let out = common::command().args(["session", "start", &name]).output().unwrap();
    let kept = std::path::Path::new(&log).exists();
    drop(holder);
    let _ = std::fs::remove_file(&lock);
    let _ = std::fs::remove_file(&log);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already running"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(kept, "the log was removed while the name's lock was held");
}

/// Whoever started a session may be gone before its report (Ctrl-C, `timeout`): the
/// daemon's report goes to a closed pipe, and the session runs on (it used to abort).
#[test]
fn a_session_whose_starter_is_gone_runs_on() {
    if !require_root() {
        return;
    }
    let lib = common::HostDir::new();
    lib.file("slow.py", "import time\ntime.sleep(1.5)\n", 0o644);
    let name = fresh_name();
    let mut starter = common::command()
        .args(["session", "start", &name, "--python-path", lib.str(), "--allow-import", "slow,time"])
        .args(["--default-import", "s=slow"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // While the default import sleeps: once the session's daemon holds its name's lock
    // (taken at once, before its interpreter starts), by the lock file's inode in /proc/locks.
    let lock = format!("/run/opservant/sessions/{name}.lock");
    let held = || {
        use std::os::unix::fs::MetadataExt;
        let Ok(meta) = std::fs::metadata(&lock) else { return false };
        let inode = format!(":{} ", meta.ino());
        std::fs::read_to_string("/proc/locks").unwrap().lines().any(|l| l.contains(&inode))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !held() {
        assert!(std::time::Instant::now() < deadline, "the session's daemon never took its lock");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    starter.kill().unwrap();
    starter.wait().unwrap();
    // Stopped (and its log removed) whatever the outcome.
    let session = Session { name };
    // The session is up once its import is done (1.5 s); it used to abort instead.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let (code, out) = loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let (code, out) = session.stop();
        if code == 0 || std::time::Instant::now() > deadline {
            break (code, out);
        }
    };
    assert_eq!(code, 0, "the session is gone: {out}");
}

#[test]
fn a_python_path_never_shows_key_material() {
    if !require_root() {
        return;
    }
    // The systemd credentials directory holds the agent's keys: naming it (or a directory
    // beneath it, or a link to it) as a session's --python-path is refused like a manifest
    // declaring it, before anything starts.
    let creds = common::HostDir::new();
    creds.file("opservant-secrets-key", "not for sandboxes\n", 0o644);
    std::fs::create_dir(creds.path.join("sub")).unwrap();
    let link = common::HostDir::new();
    std::os::unix::fs::symlink(&creds.path, link.path.join("lib")).unwrap();
    for path in [creds.path.clone(), creds.path.join("sub"), link.path.join("lib")] {
        let name = fresh_name();
        let out = common::command()
            .args(["session", "start", &name, "--python-path"])
            .arg(&path)
            .env("CREDENTIALS_DIRECTORY", &creds.path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let _ = common::command().args(["session", "stop", &name]).output();
        assert_eq!(out.status.code(), Some(2), "{path:?}: {stderr}");
        assert!(stderr.contains("--python-path") && stderr.contains("key material"), "{path:?}: {stderr}");
        for ext in ["sock", "lock", "log"] {
            let left = std::path::Path::new(&format!("/run/opservant/sessions/{name}.{ext}")).exists();
            assert!(!left, "{path:?}: {ext} left behind by a refused start");
        }
    }
    // Without the credential, the same directory is an ordinary python path.
    let name = fresh_name();
    let out = common::command()
        .args(["session", "start", &name, "--python-path"])
        .arg(&creds.path)
        .env_remove("CREDENTIALS_DIRECTORY")
        .output()
        .unwrap();
    let _ = common::command().args(["session", "stop", &name]).output();
    let _ = std::fs::remove_file(format!("/run/opservant/sessions/{name}.log"));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_failed_start_leaves_nothing_behind() {
    if !require_root() {
        return;
    }
    let name = format!("t{}-failed", std::process::id());
    let out = common::command()
        .args(["session", "start", &name, "--default-import", "x=no_such_module_here"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_module_here"));
    for ext in ["sock", "lock", "log"] {
        assert!(!std::path::Path::new(&format!("/run/opservant/sessions/{name}.{ext}")).exists(), "{ext} left behind");
    }
    // The name is free again: a valid start succeeds.
    let out = common::command().args(["session", "start", &name]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = common::command().args(["session", "stop", &name]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let _ = std::fs::remove_file(format!("/run/opservant/sessions/{name}.log"));
}

/// `session exec` that must answer within `secs`: `None` (the client killed) when it does
/// not. A daemon that wedged is killed by pid (SIGKILL: its sandbox dies with it).
fn exec_within(s: &Session, daemon_pid: u64, code: &str, extra: &[&str], secs: u64) -> Option<(i32, Value)> {
    let child = common::command()
        .args(["session", "exec", &s.name, "--code", code])
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let client = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    let out = match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: kill(2) on processes this test started.
            unsafe {
                libc::kill(client as i32, libc::SIGKILL);
                libc::kill(daemon_pid as i32, libc::SIGKILL);
            }
            let _ = std::fs::remove_file(s.socket());
            let _ = std::fs::remove_file(format!("/run/opservant/sessions/{}.lock", s.name));
            return None;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let code = out.status.code().unwrap_or(-1);
    if code == 2 {
        return Some((2, Value::String(String::from_utf8_lossy(&out.stderr).into_owned())));
    }
    Some((code, serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))))
}

#[test]
fn an_oversize_reply_does_not_wedge_the_session() {
    if !require_root() {
        return;
    }
    // JSON writes "\0" as 6 bytes: a megabyte of NULs printed and two in an exception's
    // message once made an ~18 MiB reply, over the channel's 16 MiB cap. The parts are capped
    // by their encoded size now: the reply comes, and the session goes on.
    let (s, started) = Session::start(&["--timeout", "20"]);
    let pid = started["pid"].as_u64().unwrap();
    let code = "print('\\0' * (1 << 20))\nraise ValueError('\\0' * (2 << 20))";
    let (status, r) = exec_within(&s, pid, code, &[], 15).expect("the call must be answered, not hang");
    assert_eq!(status, 1, "{r}");
    assert_eq!(r["session_ended"], false, "{r}");
    let error = r["error"].as_str().unwrap();
    assert!(error.starts_with("Traceback") && error.contains("characters dropped"), "{}", &error[..200]);
    let stdout = r["stdout"].as_str().unwrap();
    assert!(serde_json::to_string(stdout).unwrap().len() < (1 << 20) + 100, "stdout is capped by its JSON size");
    assert!(stdout.contains("characters dropped"));
    let (status, r) = exec_within(&s, pid, "x = 1", &["--return", "x"], 15).expect("the session goes on");
    assert_eq!((status, &r["globals"]["x"]), (0, &Value::from(1)), "{r}");

    // A runtime that breaks the protocol (here: code writing to its channel, os allowed)
    // ends the session at once, and `stop` finds nothing left to wait for.
    let (t, started) = Session::start(&["--allow-import", "os,time", "--timeout", "20"]);
    let pid = started["pid"].as_u64().unwrap();
    let code = "import os, time\nos.write(4, b'\\0not json')\ntime.sleep(30)";
    let (status, r) = exec_within(&t, pid, code, &[], 10).expect("the call must be answered, not hang");
    assert_eq!(status, 1, "{r}");
    assert_eq!(r["session_ended"], true, "{r}");
    assert!(r["error"].as_str().unwrap().contains("broke the protocol"), "{r}");
    let begun = std::time::Instant::now();
    let (_, out) = t.stop();
    assert!(begun.elapsed() < std::time::Duration::from_secs(10), "stop took {:?}: {out}", begun.elapsed());
    assert!(!std::path::Path::new(&t.socket()).exists());
}

#[test]
fn a_stalled_message_or_a_stop_signal_ends_a_call_at_once() {
    if !require_root() {
        return;
    }
    // Session code that sends the first packet of a message ("more follows") and stalls
    // held the daemon in its read until the sandbox's lifetime ended: the call's time limit,
    // `stop` and SIGTERM all waited (checked: this call was not answered). The whole message
    // must now come by the call's deadline: one that has not is the call timing out.
    let (t, started) = Session::start(&["--allow-import", "os,time", "--timeout", "20"]);
    let pid = started["pid"].as_u64().unwrap();
    let code = "import os, time\nos.write(4, b'\\x01' + b'{' * 100)\ntime.sleep(60)";
    let (status, r) =
        exec_within(&t, pid, code, &["--timeout", "2"], 30).expect("the call must be answered at its limit, not hang");
    assert_eq!(status, 1, "{r}");
    assert_eq!(r["session_ended"], true, "{r}");
    assert_eq!(r["killed_by"], "timeout", "{r}");
    assert!(r["error"].as_str().unwrap().contains("timed out after 2 s"), "{r}");
    assert!(!std::path::Path::new(&t.socket()).exists());

    // A stop signal during a call (the daemon's only thread waits for the call): the call
    // ends now, its reply says why, and the session is torn down — not after the call.
    let (u, started) = Session::start(&["--allow-import", "time", "--timeout", "120"]);
    let pid = started["pid"].as_u64().unwrap();
    let log = format!("/run/opservant/sessions/{}.log", u.name);
    std::thread::spawn(move || {
        // The call is recorded (`session_exec`) before it is sent to the interpreter.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !std::fs::read_to_string(&log).unwrap_or_default().contains("session_exec") {
            if std::time::Instant::now() > deadline {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        // SAFETY: kill(2) on the session daemon this test started (alive: its call runs).
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    });
    let (status, r) = exec_within(&u, pid, "import time\ntime.sleep(100)", &[], 60)
        .expect("the call must end at the signal, not after its 100 s");
    assert_eq!(status, 1, "{r}");
    assert_eq!(r["session_ended"], true, "{r}");
    assert!(r["error"].as_str().unwrap().contains("signalled"), "{r}");
    let gone = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::path::Path::new(&u.socket()).exists() {
        assert!(std::time::Instant::now() < gone, "the signalled session's socket is still there");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Idle means without a call: the status requests of `session list` kept every session
/// from expiring, each living to its maximum lifetime (checked: the old
/// daemon answered the call below).
#[test]
fn status_requests_do_not_keep_a_session_from_expiring() {
    if !require_root() {
        return;
    }
    let (s, _) = Session::start(&["--idle-timeout", "2"]);
    let until = std::time::Instant::now() + std::time::Duration::from_millis(3500);
    while std::time::Instant::now() < until {
        // What `session list` sends each session (straight to this one: a list waits for
        // every other session's daemon too).
        use std::io::{Read, Write};
        let Ok(mut c) = std::os::unix::net::UnixStream::connect(s.socket()) else { break };
        c.write_all(br#"{"op": "status"}"#).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut reply = String::new();
        let _ = c.read_to_string(&mut reply);
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    let (code, msg) = s.exec("1", &[]);
    assert_eq!(code, 2, "the session outlived its idle limit: {msg}");
    assert!(!std::path::Path::new(&s.socket()).exists());
}

#[test]
fn a_message_outside_the_protocol_ends_the_session_unlogged() {
    if !require_root() {
        return;
    }
    // Session code reaching the runtime's module can send what a call never sends: a log
    // record of up to 16 MiB. It was logged in full, each one, to the daemon's log on tmpfs
    // (/run), and the call went on; now the first ends the session, named, not logged.
    let (s, started) = Session::start(&["--allow-import", "_opservant"]);
    let pid = started["pid"].as_u64().unwrap();
    let log = format!("/run/opservant/sessions/{}.log", s.name);
    let code = "import _opservant\nfor i in range(16):\n    _opservant.log('info', 'x' * (1 << 20), {})";
    let (status, r) = exec_within(&s, pid, code, &[], 30).expect("the call must be answered");
    let size = std::fs::metadata(&log).unwrap().len();
    assert!(size < 64 << 10, "the session's log grew to {size} bytes");
    assert_eq!(status, 1, "{r}");
    assert_eq!(r["session_ended"], true, "{r}");
    assert!(r["error"].as_str().unwrap().contains("a log message during a call"), "{r}");
    assert_eq!(s.exec("1", &[]).0, 2, "the session is gone");
}

/// Session code that sends a reply of its own (reaching the runtime's module) answers its
/// own call — but the runtime's real reply then arrives during the next call, which took it
/// as its answer: every later caller got the reply before its own, and a call looping for
/// ever got a stale reply at once and ran on past its timeout. Replies carry their call's
/// number; one to another call ends the session.
#[test]
fn a_reply_session_code_sends_itself_ends_the_session_at_the_next_call() {
    if !require_root() {
        return;
    }
    let (s, _) = Session::start(&["--allow-import", "_opservant"]);
    let forge = "import _opservant\n_opservant.session_reply({'call': 1, 'success': True, 'error': None, \
                 'stdout': 'forged', 'stderr': '', 'globals': {}})";
    let (code, r) = s.exec(forge, &[]);
    assert_eq!((code, &r["stdout"]), (0, &Value::from("forged")), "{r}");
    let (code, r) = s.exec("y = 2", &["--return", "y"]);
    assert_eq!(code, 1, "{r}");
    assert_eq!(r["session_ended"], true, "{r}");
    assert!(r["error"].as_str().unwrap().contains("a reply to call 1 during call 2"), "{r}");
    assert_eq!(s.exec("1", &[]).0, 2, "the session is gone");
}

/// `__builtins__` deleted or replaced by one call is restored for the next: `exec` of a
/// namespace without it fills in the runtime's own, unrestricted builtins (`open`).
#[test]
fn a_call_cannot_hand_the_next_one_the_runtimes_builtins() {
    if !require_root() {
        return;
    }
    let (s, _) = Session::start(&[]);
    for undo in ["del __builtins__", "__builtins__ = {}", "__builtins__ = __import__"] {
        let (code, r) = s.exec(undo, &[]);
        assert!(code == 0 || code == 1, "{undo}: {r}");
        let (code, r) = s.exec("f = open('/etc/hostname')", &[]);
        assert_eq!(code, 1, "{undo}: {r}");
        assert!(r["error"].as_str().unwrap().contains("NameError: name 'open' is not defined"), "{undo}: {r}");
    }
}

#[test]
fn values_json_cannot_carry_do_not_end_the_session() {
    if !require_root() {
        return;
    }
    // An integer beyond 64 bits, or text with a lone surrogate (undecodable bytes), could
    // not be sent: the runtime failed and the session ended. README: an exception gives
    // success false and the session goes on — and these are not even exceptions.
    let (s, _) = Session::start(&[]);
    let code =
        "x = 2**64\ny = -2**63 - 1\nz = 2**63\nbig = 7**6000\nt = '\\udcff'\nd = {'k\\udcff': [t]}\nprint('\\udcff')";
    let (status, r) = s.exec(code, &["--return", "x,y,z,big,t,d"]);
    assert_eq!(status, 0, "{r}");
    let g = &r["globals"];
    assert_eq!(g["x"], "18446744073709551616", "{r}");
    assert_eq!(g["y"], "-9223372036854775809", "{r}");
    assert_eq!(g["z"], 9223372036854775808u64, "{r}");
    assert!(g["big"].as_str().is_some_and(|b| b.starts_with("0x")), "past the decimal digit limit: {r}");
    assert_eq!(g["t"], "\\udcff", "{r}");
    assert_eq!(g["d"], serde_json::json!({"k\\udcff": ["\\udcff"]}), "{r}");
    assert_eq!(r["stdout"], "\\udcff\n", "{r}");
    let code = "class S(str):\n    def encode(self, *a, **k):\n        return b''\nq = S('\\udcff')\nprint(q)";
    let (status, r) = s.exec(code, &["--return", "q"]);
    assert_eq!(
        (status, &r["globals"]["q"], &r["stdout"]),
        (0, &Value::from("\\udcff"), &Value::from("\\udcff\n")),
        "{r}"
    );
    let (status, r) = s.exec("raise ValueError('\\udcff')", &[]);
    assert_eq!(status, 1, "{r}");
    assert_eq!(r["session_ended"], false, "{r}");
    assert!(r["error"].as_str().unwrap().contains("ValueError: \\udcff"), "{r}");
    let (status, r) = s.exec("w = x + 1", &["--return", "w"]);
    assert_eq!(status, 0, "the session goes on: {r}");
    assert_eq!(r["globals"]["w"], "18446744073709551617", "{r}");
}

#[test]
fn a_call_whose_client_is_gone_before_it_starts_never_runs() {
    if !require_root() {
        return;
    }
    let (s, _) = Session::start(&["--allow-import", "time"]);
    let (code, r) = s.exec("n = 0", &[]);
    assert_eq!(code, 0, "{r}");
    let log = format!("/run/opservant/sessions/{}.log", s.name);
    let calls_recorded = || std::fs::read_to_string(&log).unwrap_or_default().matches("session_exec\"").count();
    // A long call holds the daemon, which serves one client at a time.
    let long = common::command()
        .args(["session", "exec", &s.name, "--code", "import time\ntime.sleep(12)"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while calls_recorded() < 2 {
        assert!(std::time::Instant::now() < deadline, "the long call never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // A call queued behind it whose client gives up (killed here; a client that times out
    // exits the same way): it was told nothing ran, so nothing may run.
    let mut queued = common::command()
        .args(["session", "exec", &s.name, "--code", "n += 1"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(1));
    queued.kill().unwrap();
    queued.wait().unwrap();
    // Meanwhile `session list` names the busy session instead of leaving it out.
    let out = common::command().args(["session", "list"]).output().unwrap();
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed = list["sessions"].as_array().unwrap().iter().find(|x| x["session"] == s.name.as_str()).cloned();
    assert_eq!(listed.map(|x| x["status"].clone()), Some("busy".into()), "{list}");
    let long = long.wait_with_output().unwrap();
    assert_eq!(long.status.code(), Some(0));
    let (code, r) = s.exec("pass", &["--return", "n"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["globals"]["n"], 0, "the abandoned call ran: {r}");
    assert!(std::fs::read_to_string(&log).unwrap().contains("session_exec_abandoned"), "not audited");
}

/// A session keeps the source of its recent calls for tracebacks, not of every call: its
/// memory would otherwise grow with every call's code.
#[test]
fn only_recent_calls_sources_are_kept_for_tracebacks() {
    if !require_root() {
        return;
    }
    let (s, _) = Session::start(&[]);
    let (code, r) = s.exec("def f():\n    raise ValueError('from call one')\n", &[]);
    assert_eq!(code, 0, "{r}");
    let traceback = |s: &Session| {
        let (code, r) = s.exec("f()", &[]);
        assert_eq!(code, 1, "{r}");
        r["error"].as_str().unwrap().to_string()
    };
    let recent = traceback(&s);
    assert!(recent.contains("<session call 1>") && recent.contains("raise ValueError('from call one')"), "{recent}");
    // Five calls of 1 MiB of code each: past the 4 MiB kept, call 1's source is forgotten.
    let dir = common::HostDir::new();
    let big = dir.file("big.py", &format!("x = 1\n# {}\n", "a".repeat(1 << 20)), 0o600);
    for _ in 0..5 {
        let (code, r) = s.exec(&format!("@{}", big.display()), &[]);
        assert_eq!(code, 0, "{r}");
    }
    let old = traceback(&s);
    assert!(old.contains("<session call 1>\", line 2, in f"), "{old}");
    assert!(!old.contains("raise ValueError"), "call 1's source is still kept: {old}");
}

/// A call whose client goes while it runs (killed, Ctrl-C, gave up) is interrupted —
/// KeyboardInterrupt in the session's code, as Ctrl-C in a terminal — and the session goes
/// on with what the call left; it does not hold the session until the call's timeout.
#[test]
fn a_call_whose_client_goes_while_it_runs_is_interrupted_and_the_session_goes_on() {
    if !require_root() {
        return;
    }
    let (s, started) = Session::start(&["--allow-import", "time"]);
    let daemon_pid = started["pid"].as_u64().unwrap();
    let (code, r) = s.exec("n = 0\nslept = False", &[]);
    assert_eq!(code, 0, "{r}");
    let log = format!("/run/opservant/sessions/{}.log", s.name);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    for (call, calls_before) in [("while True:\n    n += 1\n", 2), ("import time\ntime.sleep(50)\nslept = True", 4)] {
        let mut client = common::command()
            .args(["session", "exec", &s.name, "--code", call, "--timeout", "55"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while read_log().matches("session_exec\"").count() < calls_before {
            assert!(std::time::Instant::now() < deadline, "the call never started");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        client.kill().unwrap();
        client.wait().unwrap();
        // The next call is served at once, by the same session.
        let (code, r) = exec_within(&s, daemon_pid, "pass", &["--return", "n,slept"], 20)
            .expect("the session was held by the call whose client went");
        assert_eq!(code, 0, "{r}");
        assert!(r["globals"]["n"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["globals"]["slept"], false, "{r}");
    }
    let log = read_log();
    assert_eq!(log.matches("session_exec_interrupted").count(), 2, "{log}");
    assert!(log.contains("client_gone"), "{log}");
}

/// A session says which limits hold and which degraded mode let go, as a run's result does
/// (`limits.enforced`, `limits.degraded`): in its start report and in `session list`, and the
/// `session_start` record names what was let go. Before, a session whose limits degraded
/// mode had let go reported `max_memory_mb: 128` everywhere and then used 400 MB (a review).
/// Degraded here: `strace` fails every open of `/proc/self/cgroup`, so no controller is found.
#[test]
fn a_sessions_report_says_which_limits_hold_and_which_were_let_go() {
    use std::io::BufRead;
    if !require_root() {
        return;
    }
    let (s, started) = Session::start(&[]);
    let all = serde_json::json!({"memory": true, "cpu": true, "pids": true, "disk": true, "timeout": true});
    assert_eq!(
        (&started["limits"]["enforced"], &started["limits"]["degraded"]),
        (&all, &serde_json::json!([])),
        "{started}"
    );
    let out = common::command().args(["session", "list"]).output().unwrap();
    let listed: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    let mine = listed["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["session"] == s.name.as_str())
        .unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(mine["limits"]["enforced"], all, "{mine}");
    drop(s);

    let Some(_) = common::under_strace(&[], &["-V"], &[]) else { return };
    let config = common::config_with("session-degraded", "sandbox:\n  allow_degraded: true\n");
    let name = fresh_name();
    let mut child = Command::new("strace")
        .args(["-qq", "-f", "-o", "/dev/null", "-P", "/proc/self/cgroup", "-e", "inject=openat:error=EACCES"])
        .arg(common::opservant())
        .args(["session", "start", &name])
        .env("OPSERVANT_CONFIG", &*config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let s = Session { name };
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let started: Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {line}"));
    let enforced = &started["limits"]["enforced"];
    assert_eq!(
        (&enforced["memory"], &enforced["pids"]),
        (&serde_json::json!(false), &serde_json::json!(false)),
        "{started}"
    );
    let degraded = started["limits"]["degraded"].to_string();
    assert!(degraded.contains("memory"), "{started}");
    // The tests' audit log (every configuration of theirs names it).
    let log = std::fs::read_to_string(common::tests_state().join("audit/audit.jsonl")).unwrap();
    let record: Value = log
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|e| e["event"] == "session_start" && e["fields"]["session"] == s.name.as_str())
        .unwrap_or_else(|| panic!("no session_start record of {}", s.name));
    assert!(record["fields"]["degraded"].as_str().unwrap_or_default().contains("memory"), "{record}");
    drop(s);
    child.wait().unwrap();
}

/// A session whose sandbox is ended from outside — its init killed on the host between
/// two calls — ends at once, and its `session_end` record names init and the signal (it
/// said "the interpreter ended").
#[test]
fn a_session_killed_from_outside_says_which_process_and_signal_ended_it() {
    if !require_root() {
        return;
    }
    let (s, started) = Session::start(&[]);
    let daemon = started["pid"].as_i64().unwrap() as i32;
    let (_, r) = s.exec("x = 1", &[]);
    assert_eq!(r["status"], "completed", "{r}");
    // The daemon → the monitor → init (PID 1 of the session's namespace).
    let init = common::procs::at_depth(daemon, 2);
    assert_eq!(init.len(), 1, "the session's init: {init:?}");
    let nspid = std::fs::read_to_string(format!("/proc/{}/status", init[0])).unwrap();
    assert!(
        nspid.lines().any(|l| l.starts_with("NSpid:") && l.split_whitespace().last() == Some("1")),
        "not PID 1 of a namespace: {nspid}"
    );
    // SAFETY: signalling the init of the session this test started (checked above).
    assert_eq!(unsafe { libc::kill(init[0], libc::SIGKILL) }, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::fs::metadata(format!("/proc/{daemon}")).is_ok() {
        assert!(std::time::Instant::now() < deadline, "the session's daemon outlived its sandbox");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let log = std::fs::read_to_string(common::tests_state().join("audit/audit.jsonl")).unwrap();
    let end: Value = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .rfind(|r| r["event"] == "session_end" && r["fields"]["session"] == s.name.as_str())
        .expect("the session's end is audited");
    let reason = end["fields"]["reason"].as_str().unwrap();
    assert!(reason.starts_with("the sandbox's init was killed by signal 9"), "{end}");
    let (code, _) = s.exec("x", &[]);
    assert_eq!(code, 2, "the session is gone");
}
