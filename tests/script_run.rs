//! `opservant script {python|bash} FILE`: validation inside the sandbox before anything
//! runs, seed 003's result fields, the timeout default and clamp, and the same sandbox as
//! every other payload (no network, scratch only, no host files).

mod common;

use std::path::Path;

use common::{require_root, HostDir};
use serde_json::Value;

struct Out {
    code: i32,
    json: Value,
    stderr: String,
}

fn script(language: &str, file: &Path, extra: &[&str]) -> Out {
    let out =
        common::command().arg("script").arg(language).arg(file).args(extra).output().expect("run opservant script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = if out.status.code() == Some(2) {
        assert!(stdout.trim().is_empty(), "exit 2 must print nothing on stdout: {stdout}");
        Value::Null
    } else {
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("result JSON: {e}\n{stdout}\n{stderr}"))
    };
    Out { code: out.status.code().unwrap_or(-1), json, stderr }
}

fn write(dir: &HostDir, name: &str, text: &str) -> std::path::PathBuf {
    dir.file(name, text, 0o644)
}

#[test]
fn python_runs_with_seed_fields() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let f = write(&d, "hello.py", "import sys, json\nprint(json.dumps({'argv': sys.argv, 'name': __name__}))\nprint('to stderr', file=sys.stderr)\n");
    let r = script("python", &f, &[]);
    assert_eq!(r.code, 0, "{:?} {}", r.json, r.stderr);
    let j = &r.json;
    assert_eq!(j["success"], true);
    assert_eq!(j["timeout"], false);
    assert_eq!(j["validation_error"], Value::Null);
    assert_eq!(j["exit_code"], 0);
    let printed: Value = serde_json::from_str(j["stdout"].as_str().unwrap().trim()).unwrap();
    assert_eq!(printed["name"], "__main__");
    assert_eq!(printed["argv"][0], "/run/script/hello.py");
    assert_eq!(j["stderr"], "to stderr\n");
    assert!(j["duration_ms"].as_u64().is_some());
    assert_eq!(j["language"], "python");
    assert_eq!(j["sandbox"]["network"], "none");
    assert_eq!(j["sandbox"]["seccomp"], "enforced");
    assert_eq!(j["limits"]["timeout_seconds"], 60, "the default timeout is 60 s");
    // DESIGN.md §4's keys too, after the seed's: a consumer reading every run's result the
    // same way finds its status (a review found them missing).
    assert_eq!(j["status"], "completed");
    assert_eq!((j["output"].clone(), j["artifacts"].clone()), (Value::Null, serde_json::json!([])));
    for key in ["executor", "action", "command_id"] {
        assert_eq!(j.get(key), Some(&Value::Null), "{key}: {j}");
    }
}

#[test]
fn python_text_is_utf8() {
    if !require_root() {
        return;
    }
    // The sandbox's environment has no locale: the interpreter still speaks UTF-8 (PEP 540).
    let d = HostDir::new();
    let f = write(
        &d,
        "utf8.py",
        "import sys\nprint(sys.stdout.encoding, sys.getfilesystemencoding())\nprint('caf\u{e9} \u{2713}')\n",
    );
    let r = script("python", &f, &[]);
    assert_eq!(r.code, 0, "{:?}", r.json);
    assert_eq!(r.json["stdout"], "utf-8 utf-8\ncaf\u{e9} \u{2713}\n");
}

#[test]
fn output_of_c_code_is_not_lost_at_exit() {
    if !require_root() {
        return;
    }
    // C stdio buffers a pipe fully: the runtime must end in a way that flushes it (`exit`).
    let d = HostDir::new();
    let f =
        write(&d, "cprint.py", "import ctypes\nctypes.CDLL(None).printf(b'from C stdio\\n')\nprint('from Python')\n");
    let r = script("python", &f, &[]);
    assert_eq!(r.code, 0, "{:?} {}", r.json, r.stderr);
    assert_eq!(r.json["stdout"], "from Python\nfrom C stdio\n");
}

#[test]
fn non_daemon_threads_are_waited_for() {
    if !require_root() {
        return;
    }
    // As `python3 FILE` does: the main module's end waits for non-daemon threads (before
    // atexit handlers run); the runtime ended the process under them.
    let d = HostDir::new();
    let text = "import atexit, threading, time\n\
def work():\n    time.sleep(0.3)\n    print('done', flush=True)\n\
atexit.register(lambda: print('atexit'))\n\
threading.Thread(target=work).start()\n";
    let r = script("python", &write(&d, "thread.py", text), &[]);
    assert_eq!(r.code, 0, "{:?} {}", r.json, r.stderr);
    assert_eq!(r.json["stdout"], "done\natexit\n");
}

#[test]
fn python_exit_status_and_exception() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let r = script("python", &write(&d, "exit.py", "import sys\nsys.exit(7)\n"), &[]);
    assert_eq!((r.code, r.json["success"].clone(), r.json["exit_code"].clone()), (1, Value::Bool(false), 7.into()));
    assert_eq!(r.json["status"], "failed");
    assert_eq!(r.json["validation_error"], Value::Null);

    let r = script("python", &write(&d, "boom.py", "def f():\n    raise RuntimeError('boom')\nf()\n"), &[]);
    assert_eq!(r.json["exit_code"], 1);
    let stderr = r.json["stderr"].as_str().unwrap();
    assert!(stderr.contains("RuntimeError: boom"), "{stderr}");
    assert!(stderr.contains("/run/script/boom.py"), "traceback names the script: {stderr}");
    assert!(!stderr.contains("_runtime.py"), "the runtime's own frames are not shown: {stderr}");
}

/// A Python script runs as `python3 -I FILE` would (the README's word): `exit()`/`quit()`
/// exist, the system's site-packages directories are on `sys.path` as the host's
/// `python3 -I` has them, an uncaught `KeyboardInterrupt` is 130 and unflushable output at
/// the end is 120. The runtime's interpreter skips `site`: before, `exit(0)` failed with a
/// NameError, a Debian-packaged module was not found, Ctrl-C was 1 and lost output was 0.
#[test]
fn python_scripts_run_as_python3_dash_i_would() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let r = script("python", &write(&d, "exit0.py", "print('done')\nexit(0)\nprint('not reached')\n"), &[]);
    assert_eq!(
        (r.code, r.json["exit_code"].clone(), r.json["stdout"].clone()),
        (0, 0.into(), "done\n".into()),
        "{}",
        r.json
    );
    let r = script("python", &write(&d, "quit3.py", "quit(3)\n"), &[]);
    assert_eq!(r.json["exit_code"], 3, "{}", r.json);
    let r = script("python", &write(&d, "ki.py", "raise KeyboardInterrupt\n"), &[]);
    assert_eq!(r.json["exit_code"], 130, "{}", r.json);
    assert!(r.json["stderr"].as_str().unwrap().contains("KeyboardInterrupt"), "{}", r.json);
    let full = "import os\nos.dup2(os.open('/dev/full', os.O_WRONLY), 1)\nprint('lost output')\n";
    let r = script("python", &write(&d, "full.py", full), &[]);
    assert_eq!(r.json["exit_code"], 120, "{}", r.json);
    assert_eq!(r.json["success"], false, "{}", r.json);

    // The site-packages directories: those the host's `python3 -I` (the interpreter the
    // runtime embeds) puts on sys.path after its standard library.
    let host = std::process::Command::new("/usr/bin/python3.11")
        .args(["-I", "-c", "import sys, json; print(json.dumps([p for p in sys.path if 'packages' in p]))"])
        .output()
        .expect("run the host's python3.11");
    let want: Value = serde_json::from_slice(&host.stdout).expect("host sys.path");
    assert!(!want.as_array().unwrap().is_empty(), "the host's python3 -I has site-packages: {want}");
    let probe = "import sys, json\nprint(json.dumps([p for p in sys.path if 'packages' in p]))\n";
    let r = script("python", &write(&d, "path.py", probe), &[]);
    let got: Value = serde_json::from_str(r.json["stdout"].as_str().unwrap().trim()).expect("script's sys.path");
    assert_eq!(got, want, "site-packages on sys.path: {}", r.json);
}

#[test]
fn python_validation_runs_nothing() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    // A side effect before the syntax error would be visible on stdout if anything ran.
    let f = write(&d, "bad.py", "print('ran')\ndef broken(:\n    pass\n");
    let r = script("python", &f, &[]);
    assert_eq!(r.code, 1);
    let j = &r.json;
    assert_eq!(j["success"], false);
    let v = j["validation_error"].as_str().expect("validation_error set");
    assert!(v.contains("SyntaxError") && v.contains("line 2"), "{v}");
    assert_eq!(j["stdout"], "", "nothing ran");
    assert_eq!(j["exit_code"], Value::Null);
    assert_eq!(j["status"], "rejected", "nothing ran: {j}");
}

#[test]
fn a_script_cannot_claim_it_failed_validation() {
    if !require_root() {
        return;
    }
    // The script's code ran holding the runtime's channel: it could send a validation error
    // after doing anything, and the result said "validation failed, nothing was run". The
    // channel is closed before the script runs, as a Bash script's is.
    let d = HostDir::new();
    let text = "import _opservant, os\n\
try:\n    _opservant.validation_error('fake')\n    print('claimed')\n\
except OSError:\n    print('refused')\n\
try:\n    os.fstat(4)\n    print('fd 4 open')\n\
except OSError:\n    print('fd 4 closed')\n\
print('side effect')\n";
    let r = script("python", &write(&d, "liar.py", text), &[]);
    let j = &r.json;
    assert_eq!(j["validation_error"], Value::Null, "{j}");
    assert_eq!(j["stdout"], "refused\nfd 4 closed\nside effect\n", "{j}");
    assert_eq!((r.code, &j["success"], &j["exit_code"]), (0, &Value::Bool(true), &Value::from(0)), "{j}");
}

#[test]
fn bash_runs_and_validates_inside_the_sandbox() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let f = write(
        &d,
        "ok.sh",
        "echo \"uid=$(id -u) host=$(hostname)\"\nls /run/script\ntest -e /root/.bashrc && echo SEES-ROOT\nexit 3\n",
    );
    let r = script("bash", &f, &[]);
    assert_eq!(r.code, 1);
    let j = &r.json;
    assert_eq!(j["exit_code"], 3);
    assert_eq!(j["validation_error"], Value::Null);
    let out = j["stdout"].as_str().unwrap();
    assert!(out.contains("host=opservant"), "{out}");
    assert!(out.contains("ok.sh"), "{out}");
    assert!(!out.contains("SEES-ROOT"), "{out}");
    assert!(!out.contains("uid=0"), "runs unprivileged: {out}");

    // A syntax error: bash -n rejects it, and the line before it never runs.
    let f = write(&d, "bad.sh", "touch /tmp/opservant/scratch/ran; echo ran\nif then fi\n");
    let r = script("bash", &f, &[]);
    assert_eq!(r.code, 1);
    let v = r.json["validation_error"].as_str().expect("validation_error");
    assert!(v.contains("syntax error"), "{v}");
    assert_eq!(r.json["stdout"], "");
    assert_eq!(r.json["exit_code"], Value::Null);
    assert_eq!(r.json["success"], false);
}

#[test]
fn bash_check_is_bash_n_in_the_sandbox_not_on_the_host() {
    if !require_root() {
        return;
    }
    // `bash -n` inside the sandbox sees the sandbox's view: the validation error names the
    // path the script has in there.
    let d = HostDir::new();
    let f = write(&d, "where.sh", "case x in\n");
    let r = script("bash", &f, &[]);
    let v = r.json["validation_error"].as_str().expect("validation_error");
    assert!(v.contains("/run/script/where.sh"), "{v}");
}

#[test]
fn timeout_default_clamp_and_enforcement() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let f = write(&d, "sleep.sh", "echo start; sleep 30; echo never\n");
    let r = script("bash", &f, &["--timeout", "3"]);
    assert_eq!(r.code, 1);
    let j = &r.json;
    assert_eq!(j["timeout"], true);
    assert_eq!(j["success"], false);
    assert_eq!(j["killed_by"], "timeout");
    assert_eq!(j["status"], "timeout");
    assert_eq!(j["stdout"], "start\n");
    assert!(j["duration_ms"].as_u64().unwrap() < 20_000);

    // Above 300 s: clamped, and the clamp is reported.
    let f = write(&d, "quick.py", "print('ok')\n");
    let r = script("python", &f, &["--timeout", "900"]);
    assert_eq!(r.code, 0);
    assert_eq!(r.json["limits"]["timeout_seconds"], 300);
    let clamp = &r.json["limits"]["clamped"][0];
    assert_eq!(
        (clamp["field"].as_str(), clamp["requested"].as_u64(), clamp["applied"].as_u64()),
        (Some("timeout_seconds"), Some(900), Some(300))
    );
}

/// A script whose sandbox cannot die (init and payload frozen in a v1 freezer cgroup once
/// the script runs; in life, stuck in the kernel) ends its run with an error naming why —
/// the sandbox gives up on it 5 s after the last SIGKILL — and its cgroups are reaped by
/// the next opservant process. (The runtime closes the application channel before the
/// script's code runs, so here its server has already ended; `script_run` shuts the channel
/// down for a sandbox stuck before that. The limit here is a hang detector.)
#[test]
fn a_script_whose_sandbox_is_stuck_in_the_kernel_ends() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    let d = HostDir::new();
    for (language, file, text) in
        [("python", "stuck.py", "import time\ntime.sleep(120)\n"), ("bash", "stuck.sh", "sleep 120\n")]
    {
        let f = write(&d, file, text);
        let mut cmd = common::command();
        // Time for the freezer to find the sandbox before the timeout: it must be frozen while
        // the payload runs, or the timeout ends the run the ordinary way.
        cmd.args(["script", language]).arg(&f).args(["--timeout", "15"]).env_remove("OPSERVANT_LOG");
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let (out, dirs) = common::freezer::run_with_frozen_sandbox(cmd, std::time::Duration::from_secs(90), language);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{language}: {stdout}\n{stderr}");
        assert!(
            stdout.contains("had not exited 5 s after SIGKILL") || stderr.contains("had not exited 5 s after SIGKILL"),
            "{language}: the error names why: {stdout}\n{stderr}"
        );
        // Left behind by a process that is gone: the next opservant process reaps them.
        let r = script("python", &write(&d, "ok.py", "print('ok')\n"), &[]);
        assert_eq!(r.code, 0, "{:?} {}", r.json, r.stderr);
        for dir in &dirs {
            assert!(!dir.exists(), "{language}: {} still there after a later opservant process", dir.display());
        }
    }
}

/// The configuration's `default_timeout_seconds` is a script's default too (seed 001's own
/// example key), and a default the caps lower is no clamp: nothing was asked for.
#[test]
fn the_configurations_default_timeout_is_a_scripts_default() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let f = write(&d, "ok.py", "print('ok')\n");
    let audit = d.path.join("audit.jsonl").display().to_string();
    for (limits, timeout) in [("default_timeout_seconds: 20", 20), ("max_timeout_seconds: 30", 30)] {
        let config = write(&d, "config.yaml", &format!("resource_limits:\n  {limits}\naudit:\n  path: {audit}\n"));
        let r = script("python", &f, &["--config", config.to_str().unwrap()]);
        assert_eq!(r.code, 0, "{:?} {}", r.json, r.stderr);
        assert_eq!(r.json["limits"]["timeout_seconds"], timeout, "{limits}: {}", r.json);
        assert_eq!(r.json["limits"]["clamped"], serde_json::json!([]), "{limits}: {}", r.json);
    }
}

#[test]
fn no_network_and_scratch_only_without_a_manifest() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    // Control: a listener on the host's loopback, which the host reaches.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("control: the host reaches its listener");
    let code = r#"
import socket, os
for addr in [("127.0.0.1", PORT), ("192.0.2.1", 53)]:
    try:
        socket.create_connection(addr, timeout=2)
        print("NET-OK")
    except OSError as e:
        print("net:", e.errno)
open("/tmp/opservant/scratch/x", "w").write("fine")
print("scratch ok")
for p in ("/usr/x", "/etc/x", "/x"):
    try:
        open(p, "w")
        print("WROTE", p)
    except OSError:
        pass
print("home" if os.path.exists("/home") and os.listdir("/home") else "no-home")
"#
    .replace("PORT", &port.to_string());
    let r = script("python", &write(&d, "net.py", &code), &[]);
    let out = r.json["stdout"].as_str().unwrap();
    assert!(!out.contains("NET-OK"), "{out}");
    // Its own loopback has no listener (ECONNREFUSED); nothing else is routed (ENETUNREACH).
    assert!(out.starts_with("net: 111\nnet: 101\n"), "{out}");
    assert!(out.contains("scratch ok"), "{out}");
    assert!(!out.contains("WROTE"), "{out}");
    assert!(out.contains("no-home"), "{out}");
}

#[test]
fn manifest_shapes_the_sandbox() {
    if !require_root() {
        return;
    }
    let data = HostDir::new();
    data.file("data.txt", "declared\n", 0o644);
    let mdir = HostDir::new();
    let m = common::manifest(
        &mdir,
        &format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, data.str()),
        r#"{"max_memory_mb": 64, "timeout_seconds": 10}"#,
    );
    let f = write(&mdir, "read.sh", &format!("cat {}/data.txt\n", data.str()));
    let r = script("bash", &f, &["--manifest", m.to_str().unwrap()]);
    assert_eq!(r.code, 0, "{:?}", r.json);
    assert_eq!(r.json["stdout"], "declared\n");
    assert_eq!(r.json["limits"]["max_memory_mb"], 64);
    assert_eq!(r.json["limits"]["timeout_seconds"], 10, "the manifest's timeout applies without --timeout");
    // Without the manifest the same path is invisible.
    let r = script("bash", &f, &[]);
    assert_eq!(r.json["success"], false);
    assert!(r.json["stderr"].as_str().unwrap().contains("No such file"), "{:?}", r.json);
}

/// A manifest that declares what a script cannot get — secrets (its channel to the agent is
/// closed before it starts), installed packages, a Python the runtime does not embed — is
/// refused with exit 2 naming the field, as network egress already was; before, the script
/// ran without them and said nothing. A Bash script's manifest may name a Python version.
#[test]
fn a_manifest_declaring_what_a_script_cannot_get_is_refused() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let f = write(&d, "x.py", "print('ran')\n");
    let sh = write(&d, "x.sh", "echo ran\n");
    let manifest = |name: &str, permissions: &str, requirements: &str| -> String {
        let text = format!(
            r#"{{"name":"script-test","version":"1.0.0","description":"t","supported_actions":["act-t"],
                "entry_point":"t.T","permissions":{permissions},"requirements":{requirements}}}"#
        );
        let p = d.path.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    for (m, file, field) in [
        (manifest("secrets.json", r#"{"secrets":["db_password"]}"#, "{}"), &f, "permissions.secrets"),
        (manifest("packages.json", "{}", r#"{"packages":["requests==2.31.0"]}"#), &f, "requirements.packages"),
        (manifest("python.json", "{}", r#"{"python":">=3.99"}"#), &f, "requirements.python"),
    ] {
        let r = script("python", file, &["--manifest", &m]);
        assert_eq!(r.code, 2, "{m}: {}", r.stderr);
        assert!(r.stderr.contains(field), "{m}: {}", r.stderr);
        assert_eq!(r.stderr.trim_end().lines().count(), 1, "one line: {}", r.stderr);
    }
    // Controls: a Python requirement the runtime meets, and a Bash script (no Python).
    let r = script("python", &f, &["--manifest", &manifest("met.json", "{}", r#"{"python":">=3.9"}"#)]);
    assert_eq!((r.code, r.json["stdout"].clone()), (0, "ran\n".into()), "{}", r.stderr);
    let r = script("bash", &sh, &["--manifest", &d.path.join("python.json").to_string_lossy()]);
    assert_eq!((r.code, r.json["stdout"].clone()), (0, "ran\n".into()), "{}", r.stderr);
}

#[test]
fn bad_input_is_exit_2() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let f = write(&d, "x.py", "print(1)\n");
    for (args, needle) in [
        (vec!["python", "/nonexistent/x.py"], "/nonexistent/x.py"),
        (vec!["python", f.to_str().unwrap(), "--timeout", "0"], "--timeout"),
        (vec!["python", f.to_str().unwrap(), "--manifest", "/nonexistent/manifest.json"], "manifest"),
        (vec!["ruby", f.to_str().unwrap()], "ruby"),
    ] {
        let out = common::command().arg("script").args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    // Not UTF-8.
    let p = d.path.join("latin1.sh");
    std::fs::write(&p, b"echo caf\xe9\n").unwrap();
    let r = script("bash", &p, &[]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("UTF-8"), "{}", r.stderr);
}

/// A script that ended while a process it left cannot die (frozen here; in life, stuck in
/// the kernel) keeps its result — `success`, its output — with the abandon in
/// `sandbox.abandoned` and a `sandbox_abandoned` audit record. (It failed with "had not
/// exited 5 s after SIGKILL" once its whole time limit had passed.)
#[test]
fn a_script_that_ended_keeps_its_result_when_what_it_left_is_abandoned() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    let d = HostDir::new();
    let flag = d.path.join("go");
    let manifest = write(
        &d,
        "manifest.json",
        &format!(
            r#"{{"name":"t","version":"1.0.0","description":"d","supported_actions":["a"],"entry_point":"m.C",
                "permissions":{{"filesystem":{{"read":["{}"]}}}}}}"#,
            d.path.display()
        ),
    );
    let marker = format!("64.{}", std::process::id());
    let f = write(
        &d,
        "leaves.sh",
        &format!("sleep {marker} &\nwhile [ ! -e {} ]; do sleep 0.02; done\necho ended\n", flag.display()),
    );
    let mut child = common::command()
        .args(["script", "bash"])
        .arg(&f)
        .arg("--manifest")
        .arg(&manifest)
        .args(["--timeout", "60"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let cmdline = format!("sleep\0{marker}\0");
    let sleeper =
        common::procs::wait_for(&mut child, std::time::Duration::from_secs(30), "the script's child started", || {
            common::procs::by_cmdline(cmdline.as_bytes())
        });
    let dirs = common::freezer::sandbox_cgroups_of_process(sleeper);
    assert!(!dirs.is_empty(), "the child is in the sandbox's cgroups");
    let freezer = common::freezer::Freezer::new("script-abandoned");
    freezer.freeze(&[sleeper]);
    std::fs::write(&flag, b"").unwrap();
    // A hang detector, not a timing assertion (the script's time limit is 60 s).
    let out = common::procs::end_within(child, std::time::Duration::from_secs(50), "the script's run");
    drop(freezer);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let r: Value = serde_json::from_str(stdout.trim()).expect("the result");
    assert_eq!(
        (&r["success"], &r["status"], &r["stdout"]),
        (&Value::Bool(true), &"completed".into(), &"ended\n".into()),
        "{r}"
    );
    assert!(r["sandbox"]["abandoned"].as_str().unwrap_or("").contains("had not exited 5 s after SIGKILL"), "{r}");
    assert!(stderr.contains("event=\"sandbox_abandoned\""), "{stderr}");
    let r = script("python", &write(&d, "ok.py", "print('ok')\n"), &[]);
    assert_eq!(r.code, 0, "{:?} {}", r.json, r.stderr);
    for dir in &dirs {
        assert!(!dir.exists(), "{} still there after a later opservant process", dir.display());
    }
}
