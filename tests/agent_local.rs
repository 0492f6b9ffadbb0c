//! `opservant agent` and `opservant submit` end to end, as root: a real daemon on a socket in
//! a scratch directory, real signed commands, real sandboxes. Every rejection of the
//! verification pipeline (unsigned, bad signature, tampered parameters, a timestamp six
//! minutes old or ahead, a replayed `command_id` — also after a restart —, an unknown
//! executor, a request beyond the manifest), overload, a graceful SIGTERM that lets a running
//! command finish, root-only access, and an audit chain that verifies afterwards; a dead
//! zygote replaced, the warm pool, and sandboxes forked from one zygote drawing different
//! random numbers (the C library's and Python's generators reseeded in each). Then the
//! platform side against a test HTTPS platform (tests/common/platform.rs): commands pulled
//! over mutual TLS and results posted; a client certificate from another CA refused by the
//! server; a server certificate from another CA refused by the agent. Executor packages:
//! `install_executor` downloads over the same mutual TLS, refused (and audited) on a SHA-256
//! mismatch, an oversize package (by `Content-Length`, by the declared size, and by the read
//! bound when the server sends no length), a missing or untrusted signature; and
//! `executors.install` installed at start, once, with failing entries skipped and audited.

mod common;

use common::sha256_hex;
#[path = "common/daemon.rs"]
mod daemon;
#[path = "common/platform.rs"]
mod platform;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::HostDir;
use daemon::{op, Agent};
use serde_json::{json, Value};

/// Submit and expect a rejection with `reason` (exit status 1).
fn rejected(a: &Agent, bytes: Vec<u8>, reason: &str) {
    let (code, r) = a.submit(&bytes);
    assert_eq!(code, 1, "{reason}: {r}");
    assert_eq!(r["status"], "rejected", "{reason}: {r}");
    assert_eq!(r["reason"], reason, "{r}");
}

fn scan(id: &str) -> Value {
    json!({"command_id": id, "action": "execute", "executor": "port-scanner",
           "parameters": {"target_host": "127.0.0.1", "ports": [22]}})
}

fn ts(offset: i64) -> String {
    agent::signing::format_rfc3339(agent::signing::now() + offset)
}

#[test]
fn hostile_configs_are_refused_cleanly_by_check_config() {
    let dir = common::HostDir::new();
    let aliases = format!("network:\n  proxy:\n    no_proxy: [&a x{}]\n", ", *a".repeat(5_000));
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (format!("{}{}\n", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(), "recursion limit exceeded"),
        (format!("agent: {}{}\n", "{a: ".repeat(100_000), "}".repeat(100_000)).into_bytes(), "line 1"),
        (format!("agent:\n  id: x\n{}", "#".repeat(5 << 20)).into_bytes(), "larger than the 1048576 bytes"),
        (b"agent:\n  id: \xff\xfe\n".to_vec(), "not UTF-8"),
        (aliases.into_bytes(), "alias"),
        (b"agent:\n  id: a\n  id: b\n".to_vec(), "duplicate"),
        // Part of the platform's URLs: nothing that ends or changes the path.
        (b"agent:\n  id: web 1\n".to_vec(), "agent.id"),
        (b"agent:\n  id: web#1\n".to_vec(), "agent.id"),
        (b"agent:\n  id: ../x\n".to_vec(), "agent.id"),
        (b"agent:\n  id: ..\n".to_vec(), "agent.id"),
    ];
    for (text, needle) in cases {
        let path = dir.path.join("config.yaml");
        std::fs::write(&path, &text).unwrap();
        let out = op(&["agent", "--check-config", "--config", path.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{needle}: {stderr}");
        assert!(out.stdout.is_empty());
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(needle) && stderr.contains("config.yaml"), "{needle}: {stderr}");
    }
    // A pipe (`<(…)`) is not a regular file, said so — not a missing `/proc/…/pipe:[…]`
    // its /dev/fd link names.
    let path = dir.path.join("config.yaml");
    std::fs::write(&path, "agent:\n  id: a\n").unwrap();
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("exec {} agent --check-config --config <(cat {})", common::opservant(), path.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("/dev/fd/") && stderr.contains("not a regular file"), "{stderr}");
}

/// `agent --check-config` refuses (exit 2, one line naming the key) what the agent itself
/// would refuse only as it started or at the first command: an audit log that is not a
/// regular file, an executors directory that is a file or others may write to, a socket
/// path longer than a Unix socket's.
#[test]
fn check_config_refuses_what_the_agent_would_refuse_later() {
    if !common::require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = common::HostDir::new();
    assert!(op(&["keygen", "--out", dir.path.join("keys").to_str().unwrap()]).status.success());
    let (file, open) = (dir.path.join("a-file"), dir.path.join("everyones"));
    std::fs::write(&file, "").unwrap();
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let long = dir.path.join(format!("{}.sock", "s".repeat(120)));
    let audit = dir.path.join("audit/audit.jsonl");
    let cases = [
        ("audit:\n  path: /dev/null\n".to_string(), "not a regular file"),
        (format!("executors:\n  dir: {}\naudit:\n  path: {}\n", file.display(), audit.display()), "not a directory"),
        (format!("executors:\n  dir: {}\naudit:\n  path: {}\n", open.display(), audit.display()), "executors.dir"),
        (format!("audit:\n  path: {}\n", audit.display()), "agent.socket"),
    ];
    for (i, (rest, needle)) in cases.iter().enumerate() {
        let socket = if i == 3 { long.clone() } else { dir.path.join("agent.sock") };
        let config = dir.path.join("config.yaml");
        let keys = dir.path.join("keys/signing.pub");
        std::fs::write(
            &config,
            format!(
                "agent:\n  platform_public_key: {}\n  socket: {}\n  state_dir: {}\n{rest}",
                keys.display(),
                socket.display(),
                dir.path.join("state").display()
            ),
        )
        .unwrap();
        let out = op(&["agent", "--check-config", "--config", config.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{needle}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(needle), "{needle}: {stderr}");
    }
}

/// A command whose run fails after its runtime was told to proceed — here its sandbox stuck
/// in the kernel (frozen in a v1 freezer cgroup once its executor sleeps) and given up 5 s after
/// the last SIGKILL — is answered `failed`, not `rejected`: the executor ran, and a platform
/// told it was refused would send it again. Audited as started and failed, never rejected.
#[test]
fn a_command_that_fails_after_its_start_is_failed_not_rejected() {
    if !common::require_root() || !common::freezer::available() {
        return;
    }
    let mut a = Agent::new(4);
    a.start();
    let agent_pid = a.child.as_ref().unwrap().id() as i32;
    // Time for the executor to start and sleep on a loaded machine before the timeout (the
    // freezer waits for that sleep).
    let cmd = a.sign(&json!({"command_id": "stuck-1", "action": "execute", "executor": "slow",
                             "parameters": {"seconds": 120}, "resource_limits": {"timeout_seconds": 15}}));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let _ = tx.send(a.submit_within(&cmd, Duration::from_secs(90)));
        });
        let (freezer, _dirs) = common::freezer::freeze_sandbox_below_once_asleep(agent_pid);
        let reply = rx.recv_timeout(Duration::from_secs(100));
        assert!(freezer.thaw(), "the thawed sandbox processes never died");
        let (code, r) = reply.expect("no reply: the command hung on its stuck sandbox");
        assert_eq!(code, 1, "submit exits 1 for a run that did not complete: {r}");
        assert_eq!(r["status"], "failed", "{r}");
        assert_eq!((r["command_id"].clone(), r["executor"]["name"].clone()), (json!("stuck-1"), json!("slow")), "{r}");
        assert!(r["error"].as_str().unwrap_or("").contains("had not exited 5 s after SIGKILL"), "{r}");
    });
    let events = a.audit_events();
    let of =
        |kind: &str| events.iter().filter(|e| e["event"] == kind && e["fields"]["command_id"] == "stuck-1").count();
    assert_eq!((of("executor_start"), of("executor_fail"), of("command_rejected")), (1, 1, 0), "{events:?}");
    assert!(a.stop().success());
}

/// A command whose sandbox cannot be set up — its executor's directory out of the sandbox
/// user's reach — failed before its runtime was told to proceed: nothing of the executor
/// ran, so it is `rejected`, `cannot_run`, saying why (not `failed`: a platform may send it
/// again). Audited as started, ended `status: rejected`, and rejected.
#[test]
fn a_command_whose_sandbox_cannot_be_set_up_is_rejected_as_cannot_run() {
    if !common::require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mut a = Agent::new(4);
    a.start();
    let name_dir = a.dir.path.join("executors/slow");
    let set_mode = |mode| std::fs::set_permissions(&name_dir, std::fs::Permissions::from_mode(mode)).unwrap();
    set_mode(0o700);
    let slow =
        |id: &str| json!({"command_id": id, "action": "execute", "executor": "slow", "parameters": {"seconds": 0}});
    let (code, r) = a.submit(&a.sign(&slow("unreachable-1")));
    set_mode(0o755);
    assert_eq!((code, r["status"].clone(), r["reason"].clone()), (1, json!("rejected"), json!("cannot_run")), "{r}");
    let error = r["error"].as_str().unwrap_or_default();
    assert!(error.contains("sandbox setup failed at mounts") && error.contains("searchable"), "{r}");
    let events = a.audit_events();
    let of = |kind: &str| {
        events
            .iter()
            .filter(|e| e["event"] == kind && e["fields"]["command_id"] == "unreachable-1")
            .map(|e| e["fields"].clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(of("executor_start").len(), 1, "{events:?}");
    assert_eq!(of("executor_fail").iter().map(|f| f["status"].clone()).collect::<Vec<_>>(), [json!("rejected")]);
    assert_eq!(of("command_rejected").iter().map(|f| f["reason"].clone()).collect::<Vec<_>>(), [json!("cannot_run")]);
    // Within reach again, it runs.
    let (code, r) = a.submit(&a.sign(&slow("unreachable-2")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    assert!(a.stop().success());
}

/// The state directory the agent creates is searchable by all (0711, as systemd's
/// `StateDirectoryMode=0711` makes it), whatever the umask: the default executors root lies
/// beneath it, and every run of an executor installed there after the agent's start would
/// otherwise fail at its set-up (its sandbox's user could not reach the package).
#[test]
fn executors_installed_beneath_the_state_directory_the_agent_made_run() {
    if !common::require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mut a = Agent::new(4);
    let (state, beneath) = (a.dir.path.join("state"), a.dir.path.join("state/executors"));
    assert!(!state.exists());
    let config = std::fs::read_to_string(&a.config).unwrap();
    let moved = config.replace(
        &format!("dir: {}\n", a.dir.path.join("executors").display()),
        &format!("dir: {}\n", beneath.display()),
    );
    assert_ne!(config, moved);
    std::fs::write(&a.config, moved).unwrap();
    a.start_with_umask(0o077);
    assert_eq!(std::fs::metadata(&state).unwrap().permissions().mode() & 0o7777, 0o711);
    let pkg = a.dir.path.join("slow");
    let out = op(&["executor", "install", pkg.to_str().unwrap(), "--config", a.config.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("not searchable"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cmd =
        json!({"command_id": "beneath-state-1", "action": "execute", "executor": "slow", "parameters": {"seconds": 0}});
    let (code, r) = a.submit(&a.sign(&cmd));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    assert!(a.stop().success());
}

/// A configuration for `agent --check-config` in `dir`: a new command key there, state and
/// audit log beneath it, and `extra` (YAML of its own sections); its path.
fn check_config_file(dir: &Path, extra: &str) -> PathBuf {
    assert!(op(&["keygen", "--out", dir.join("keys").to_str().unwrap()]).status.success());
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "agent:\n  platform_public_key: {0}/keys/signing.pub\n  state_dir: {0}/state\naudit:\n  path: {0}/audit.log\n{extra}",
            dir.display()
        ),
    )
    .unwrap();
    config
}

/// `network.agent_to_platform` for [`check_config_file`], with the TLS files of
/// [`platform::Pki::write_agent_files`] in `dir` (port 9: nothing is contacted).
fn platform_section(dir: &Path) -> String {
    format!(
        "network:\n  agent_to_platform:\n    protocol: https\n    host: 127.0.0.1\n    port: 9\n    ca: {0}/ca.pem\n    cert: {0}/agent.crt\n    key: {0}/agent.key\n",
        dir.display()
    )
}

/// A valid configuration this host cannot meet (a Landlock ABI no kernel has) is still
/// valid — `configuration ok`, exit 0 — but `--check-config` says every run would be refused.
#[test]
fn check_config_says_when_the_host_cannot_meet_the_configuration() {
    let dir = common::HostDir::new();
    let config = check_config_file(&dir.path, "sandbox:\n  landlock_min_abi: 64\n");
    let out = op(&["agent", "--check-config", "--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        (out.status.code(), String::from_utf8_lossy(&out.stdout).trim()),
        (Some(0), "configuration ok"),
        "{stderr}"
    );
    assert!(
        stderr.contains("this host lacks what the configuration requires") && stderr.contains("landlock"),
        "{stderr}"
    );
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("landlock_min_abi: 64", "landlock_min_abi: 1")).unwrap();
    let out = op(&["agent", "--check-config", "--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("lacks"), "{stderr}");
    // The journald mirror is on by default: without journald's socket the log has no copy
    // off its own file, and `--check-config` says so (this host has none; one with journald
    // gets no warning); with `audit.journald: false` the configuration says it, no warning.
    let journald = Path::new("/run/systemd/journal/socket").exists();
    assert_eq!(stderr.contains("audit.journald is on but"), !journald, "journald {journald}: {stderr}");
    let dir = common::HostDir::new();
    let config = check_config_file(&dir.path, "  journald: false\n");
    let out = op(&["agent", "--check-config", "--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("audit.journald"), "{stderr}");
}

/// A client key that is not the certificate's, or that the TLS provider cannot sign with
/// (P-521), is a configuration error `--check-config` names — not a panic of the HTTPS
/// client at the agent's first connection to the platform, which builds its TLS context
/// only then.
#[test]
fn a_client_key_the_tls_client_cannot_use_is_refused_by_check_config() {
    use std::os::unix::fs::PermissionsExt;
    let dir = common::HostDir::new();
    let (good, other) = (platform::Pki::new("good"), platform::Pki::new("other"));
    good.write_agent_files(&dir.path);
    let config = check_config_file(&dir.path, &platform_section(&dir.path));
    let check = || op(&["agent", "--check-config", "--config", config.to_str().unwrap()]);
    let out = check();
    assert!(out.status.success(), "the matching pair: {}", String::from_utf8_lossy(&out.stderr));
    // (And a host that is not a host: a URL, a path.)
    let text = std::fs::read_to_string(&config).unwrap();
    for bad in ["https://127.0.0.1", "127.0.0.1/api", "a b", "::1x"] {
        std::fs::write(&config, text.replace("host: 127.0.0.1", &format!("host: \"{bad}\""))).unwrap();
        let out = check();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(stderr.contains("network.agent_to_platform.host"), "{bad}: {stderr}");
    }
    std::fs::write(&config, text.replace("host: 127.0.0.1", "host: \"::1\"")).unwrap();
    assert!(check().status.success(), "an IPv6 address is a host");
    std::fs::write(&config, &text).unwrap();

    // Another certificate's key.
    std::fs::write(dir.path.join("agent.key"), &other.client_key).unwrap();
    let out = check();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("network.agent_to_platform.key") && stderr.contains("is not the key of the certificate"),
        "{stderr}"
    );

    // A P-521 key with its own certificate: valid, but not one ring signs with.
    let openssl = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-521", "-nodes", "-subj", "/CN=agent"])
        .arg("-keyout")
        .arg(dir.path.join("agent.key"))
        .arg("-out")
        .arg(dir.path.join("agent.crt"))
        .output()
        .expect("openssl");
    assert!(openssl.status.success(), "{}", String::from_utf8_lossy(&openssl.stderr));
    std::fs::set_permissions(dir.path.join("agent.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = check();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("network.agent_to_platform.key") && stderr.contains("unusable"), "{stderr}");
}

#[test]
fn signed_commands_run_and_every_rejection_is_audited() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(4);
    let out = op(&["agent", "--config", a.config.to_str().unwrap(), "--check-config"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    a.start();

    // Runs: by name, and by action ID.
    let (code, r) = a.submit(&a.sign(&scan("cmd-1")));
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["command_id"], "cmd-1");
    assert_eq!(r["output"]["ports"][0]["status"], "closed", "{r}");
    assert_eq!(r["sandbox"]["launch"], "zygote", "the daemon starts sandboxes from its zygote: {r}");
    let mut by_action = scan("cmd-2");
    by_action.as_object_mut().unwrap().remove("executor");
    by_action["action_id"] = json!("act-port-scan");
    let (code, r) = a.submit(&a.sign(&by_action));
    assert_eq!((code, r["executor"]["name"].clone()), (0, json!("port-scanner")), "{r}");
    let (code, r) = a.submit(&a.sign(&json!({"command_id": "cmd-ping", "action": "ping"})));
    assert_eq!(code, 0);
    assert!(r["output"]["executors"].as_array().unwrap().iter().any(|e| e == "port-scanner@1.0.0"), "{r}");

    // Unsigned; signed by another key; tampered parameters.
    rejected(&a, scan("cmd-3").to_string().into_bytes(), "unsigned");
    let other = HostDir::new();
    assert!(op(&["keygen", "--out", other.path.join("k").to_str().unwrap()]).status.success());
    let forged = common::command()
        .args(["sign", "--key", other.path.join("k/signing.key").to_str().unwrap(), "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(scan("cmd-4").to_string().as_bytes())?;
            c.wait_with_output()
        })
        .unwrap()
        .stdout;
    rejected(&a, forged, "bad_signature");
    let mut tampered: Value = serde_json::from_slice(&a.sign(&scan("cmd-5"))).unwrap();
    tampered["parameters"]["ports"] = json!([22, 80]);
    rejected(&a, tampered.to_string().into_bytes(), "bad_signature");
    // Six minutes old, six minutes ahead.
    for (i, off) in [(6, -360), (7, 360)] {
        let mut c = scan(&format!("cmd-{i}"));
        c["timestamp"] = json!(ts(off));
        rejected(&a, a.sign(&c), "clock_skew");
    }
    // The refusal says when this host's own clock is the likelier culprit.
    let mut c = scan("cmd-6a");
    c["timestamp"] = json!(ts(-360));
    let (_, r) = a.submit(&a.sign(&c));
    let error = r["error"].as_str().unwrap();
    assert!(error.contains("behind the agent's clock"), "{r}");
    assert_eq!(
        error.contains("this host's clock is not synchronised"),
        common::clock_unsynchronised(),
        "the hint is there exactly when the kernel says the clock is not synchronised: {r}"
    );
    // Replay of an accepted command.
    rejected(&a, a.sign(&scan("cmd-1")), "replay");
    // Unknown executor; request beyond the manifest; malformed and duplicate keys.
    let mut unknown = scan("cmd-8");
    unknown["executor"] = json!("no-such-executor");
    rejected(&a, a.sign(&unknown), "unknown_executor");
    // Named but not installed: never another executor that supports the action ID.
    let mut other = scan("cmd-8b");
    other["executor"] = json!("no-such-executor");
    other["action_id"] = json!("act-port-scan");
    rejected(&a, a.sign(&other), "unknown_executor");
    // An executor or action ID that is not a string is not taken for a missing one.
    for (key, value) in [("executor", json!(["port-scanner"])), ("action_id", json!(7))] {
        let mut typed = scan(&format!("cmd-8-{key}"));
        typed[key] = value;
        rejected(&a, a.sign(&typed), "malformed");
    }
    let mut beyond = scan("cmd-9");
    beyond["resource_limits"] = json!({"timeout_seconds": 3600});
    rejected(&a, a.sign(&beyond), "permission_denied");
    let mut wrong_action = scan("cmd-10");
    wrong_action["action_id"] = json!("act-sleep");
    rejected(&a, a.sign(&wrong_action), "permission_denied");
    rejected(&a, br#"{"command_id":"x","command_id":"y"}"#.to_vec(), "malformed");
    rejected(&a, b"not json".to_vec(), "malformed");
    // A tighter limit is fine.
    let mut tighter = scan("cmd-11");
    tighter["resource_limits"] = json!({"timeout_seconds": 10});
    let (code, r) = a.submit(&a.sign(&tighter));
    assert_eq!((code, r["limits"]["timeout_seconds"].clone()), (0, json!(10)), "{r}");

    // Replays are still refused after a restart.
    assert!(a.stop().success());
    assert!(!a.socket.exists(), "the socket is removed on stop");
    a.start();
    rejected(&a, a.sign(&scan("cmd-1")), "replay");
    assert!(a.stop().success());

    a.audit_verify();
    let events = a.audit_events();
    let reasons: Vec<&str> = events.iter().filter_map(|e| e["fields"]["reason"].as_str()).collect();
    for want in ["unsigned", "bad_signature", "clock_skew", "replay", "unknown_executor", "malformed"] {
        assert!(reasons.contains(&want), "{want} audited: {reasons:?}");
    }
    assert!(events.iter().any(|e| e["event"] == "permission_denied"));
    assert!(events.iter().any(|e| e["event"] == "command_received" && e["fields"]["signature"] == "valid"));
    assert!(events.iter().any(|e| e["event"] == "executor_complete" && e["fields"]["command_id"] == "cmd-1"));
}

/// A command's receipt names its source — the socket, with its client's pid and uid — and
/// the SHA-256 of the bytes as received: a local root submission is told from a platform
/// command, and what ran from what was signed.
#[test]
fn a_receipt_names_the_commands_source_and_digest() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(1);
    a.start();
    let bytes = a.sign(&json!({"command_id": "receipt-1", "action": "ping"}));
    let (code, r) = a.submit(&bytes);
    assert_eq!(code, 0, "{r}");
    // A ping (as every heartbeat) carries the newest record the agent made durable, an
    // anchor off the host: its seq and the SHA-256 of its line as the log holds it.
    let (code, pong) = a.submit(&a.sign(&json!({"command_id": "receipt-2", "action": "ping"})));
    assert_eq!(code, 0, "{pong}");
    let head = &pong["output"]["audit"]["head"];
    let seq = head["seq"].as_u64().unwrap_or_else(|| panic!("audit.head in a ping: {pong}"));
    let text = std::fs::read_to_string(a.dir.path.join("audit/audit.jsonl")).unwrap();
    let line = text
        .lines()
        .find(|l| serde_json::from_str::<Value>(l).is_ok_and(|r| r["seq"] == seq))
        .unwrap_or_else(|| panic!("no record {seq} in the log"));
    assert_eq!(head["sha256"], sha256_hex(line.as_bytes()), "{head} against {line}");
    // It was the receipt of the ping that carries it, or a later record.
    let receipt: Value = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|r| r["event"] == "command_received" && r["fields"]["command_id"] == "receipt-2")
        .expect("the second ping's receipt");
    assert!(seq >= receipt["seq"].as_u64().unwrap(), "{head} {receipt}");
    assert!(a.stop().success());
    let events = a.audit_events();
    let received = events
        .iter()
        .find(|e| e["event"] == "command_received" && e["fields"]["command_id"] == "receipt-1")
        .expect("the receipt");
    let source = received["fields"]["source"].as_str().unwrap();
    assert!(source.starts_with("socket (pid ") && source.ends_with(", uid 0)"), "{received}");
    assert_eq!(received["fields"]["sha256"], sha256_hex(&bytes), "{received}");
}

/// The log's newest file set aside under a running agent (what an append's error says to
/// do with a damaged tail): its next record says which records went with it, numbered
/// after them, and every ping and heartbeat then reports the gap — the platform hears of it
/// without reading the log.
#[test]
fn a_newest_file_set_aside_under_a_running_agent_is_recorded_and_reported() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(1);
    a.start();
    let log = a.dir.path.join("audit/audit.jsonl");
    let (code, pong) = a.submit(&a.sign(&json!({"command_id": "aside-1", "action": "ping"})));
    assert_eq!((code, &pong["output"]["audit"]["gap"]), (0, &Value::Null), "{pong}");
    let last = |text: &str| -> Value { serde_json::from_str(text.lines().last().unwrap()).unwrap() };
    let aside = log.with_file_name("audit.jsonl.aside");
    std::fs::rename(&log, &aside).unwrap();
    let (code, pong) = a.submit(&a.sign(&json!({"command_id": "aside-2", "action": "ping"})));
    assert_eq!(code, 0, "{pong}");
    // The set-aside file as it ended (a record the agent made as the file was moved — its
    // binaries' digests — may be its last); the log's first record now says its records
    // are missing, and is numbered after them.
    let to = last(&std::fs::read_to_string(&aside).unwrap())["seq"].as_u64().unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(
        (first["gap"]["from"].as_u64(), first["gap"]["to"].as_u64(), first["seq"].as_u64()),
        (Some(1), Some(to), Some(to + 1)),
        "{first}"
    );
    let gap = &pong["output"]["audit"]["gap"];
    assert_eq!((&gap["from"], &gap["to"], &gap["seq"]), (&json!(1), &first["gap"]["to"], &first["seq"]), "{pong}");
    assert!(a.stop().success());
    let out = Command::new(env!("CARGO_BIN_EXE_opservant"))
        .args(["audit", "verify", log.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains(&format!("{}:1: removed", log.display())), "{stdout}");
}

/// Seed 001's "agent binary integrity verification": the agent hashes the binary it runs
/// from and the runtime it starts sandboxes with — off its start path —, records the
/// digests in the audit log (`agent_binaries`) and reports them in every ping, for a
/// platform that holds the shipped builds' digests to compare.
#[test]
fn the_agents_binaries_are_hashed_recorded_and_reported() {
    if !common::require_root() {
        return;
    }
    let exe = Path::new(common::opservant()).to_path_buf();
    let runtime = exe.with_file_name("opservant-runtime");
    let want = |p: &Path| sha256_hex(&std::fs::read(p).unwrap());
    let (exe_sha, runtime_sha) = (want(&exe), want(&runtime));
    let mut a = Agent::new(1);
    a.start();
    let deadline = Instant::now() + Duration::from_secs(120);
    let binaries = (1..)
        .map(|n| {
            let (code, pong) = a.submit(&a.sign(&json!({"command_id": format!("bin-{n}"), "action": "ping"})));
            assert_eq!(code, 0, "{pong}");
            assert!(Instant::now() < deadline, "still pending: {pong}");
            std::thread::sleep(Duration::from_millis(100));
            pong["output"]["binaries"].clone()
        })
        .find(|b| b.get("pending").is_none())
        .unwrap();
    assert_eq!(binaries["opservant"]["sha256"], exe_sha, "{binaries}");
    assert_eq!(binaries["opservant_runtime"]["sha256"], runtime_sha, "{binaries}");
    assert_eq!(binaries["opservant_runtime"]["path"], runtime.to_str().unwrap(), "{binaries}");
    assert_eq!(
        (&binaries["opservant"]["replaced_since"], &binaries["opservant_runtime"]["replaced_since"]),
        (&json!(false), &json!(false)),
        "{binaries}"
    );
    assert!(a.stop().success());
    let events = a.audit_events();
    let recorded = events.iter().find(|e| e["event"] == "agent_binaries").expect("agent_binaries recorded");
    assert_eq!(
        (&recorded["fields"]["opservant_sha256"], &recorded["fields"]["runtime_sha256"], &recorded["fields"]["build"]),
        (&json!(exe_sha), &json!(runtime_sha), &json!(agent::app::BUILD)),
        "{recorded}"
    );
}

#[test]
fn the_daemon_writes_no_core_dump() {
    if !common::require_root() {
        return;
    }
    // Its memory holds keys and secret values: no core file size, soft and hard, inherited
    // by everything it starts (the zygote included).
    let mut a = Agent::new(2);
    a.start();
    let limits = |pid: u32| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let line = text.lines().find(|l| l.starts_with("Max core file size")).unwrap().to_string();
        line.split_whitespace().skip(4).take(2).map(str::to_string).collect::<Vec<_>>()
    };
    let agent = a.child.as_ref().unwrap().id();
    assert_eq!(limits(agent), ["0", "0"]);
    let zygote = daemon::started_zygote(agent);
    assert_eq!(limits(zygote as u32), ["0", "0"]);
    assert!(a.stop().success());
}

/// Sandbox cgroups a dead creator left (a crashed agent's, its processes killed or not)
/// are swept as an agent starts, not at its first sandbox: until then they hold their
/// processes, memory and pids. The agent runs in a v1 memory cgroup of the test's own, where
/// nothing but it (and what it starts) would sweep: no other test's sandbox can do it first.
#[test]
fn an_agent_sweeps_left_over_sandbox_cgroups_as_it_starts() {
    if !common::require_root() {
        return;
    }
    let Some(home) = common::MemoryCgroup::new("sweep") else { return };
    if !common::freezer::available() {
        return;
    }
    // Named as sandbox cgroups are; its creator's pid is above any `pid_max`.
    let stale = home.0.join("opservant-sb-4000000000-1-0");
    std::fs::create_dir(&stale).unwrap();
    // A second one whose process is stuck (frozen: SIGKILL takes effect only once thawed):
    // it cannot be removed at start, and is not waited for there — its removal is tried
    // again at every sandbox start, not left for the agent's whole life (before the
    // twenty-first session a busy stale cgroup was swept only at the next agent's start).
    let busy = home.0.join("opservant-sb-4000000000-2-0");
    std::fs::create_dir(&busy).unwrap();
    let mut stuck = std::process::Command::new("sleep").arg("600").spawn().unwrap();
    std::fs::write(busy.join("cgroup.procs"), stuck.id().to_string()).unwrap();
    let freezer = common::freezer::Freezer::new("sweep");
    freezer.freeze(&[stuck.id() as i32]);
    let mut a = Agent::new(2);
    a.start_in_cgroup(&home.procs());
    let left = stale.exists();
    let busy_at_start = busy.exists();
    // Released (killed at start, it dies once thawed): the next sandbox start removes it.
    assert!(freezer.thaw(), "the stuck process died once thawed");
    let _ = stuck.wait();
    let (code, r) = a.submit(&a.sign(&scan("after-thaw")));
    assert_eq!(code, 0, "{r}");
    let busy_after = busy.exists();
    assert!(a.stop().success());
    assert!(!left, "{} was still there once the agent listened", stale.display());
    assert!(busy_at_start, "control: a cgroup whose process is frozen cannot be removed");
    assert!(!busy_after, "{} was still there after a sandbox start, its process gone", busy.display());
}

#[test]
fn an_install_cut_short_at_its_switch_is_completed_as_the_agent_starts() {
    if !common::require_root() {
        return;
    }
    // The agent's own runs resolve `current`: an upgrade it was making when it was killed,
    // cut short between the copy and the switch, is completed before it takes commands
    // (executor_install's test covers the next install or removal completing it).
    let mut a = Agent::new(1);
    let pkg = a.dir.path.join("slow");
    let manifest = pkg.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap().replace(r#""version": "1.0.0""#, r#""version": "2.0.0""#);
    std::fs::write(&manifest, text).unwrap();
    let install = ["executor", "install", pkg.to_str().unwrap(), "--config", a.config.to_str().unwrap()];
    if common::install_killed_at_its_switch(&install).is_none() {
        return;
    }
    let current = a.dir.path.join("executors/slow/current");
    assert_eq!(std::fs::read_link(&current).unwrap(), PathBuf::from("1.0.0"));
    // Precompiled before its switch: the start's bytecode pass takes no lock for it, so the
    // completion below is the start's own settling.
    assert!(a.dir.path.join("executors/slow/2.0.0/slow/__pycache__").is_dir());
    a.start();
    assert_eq!(std::fs::read_link(&current).unwrap(), PathBuf::from("2.0.0"));
    assert!(!a.dir.path.join("executors/.switch-slow").exists());
    let (code, reply) = a.submit(&a.sign(
        &json!({"command_id": "cut-short-1", "action": "execute", "executor": "slow", "parameters": {"seconds": 0}}),
    ));
    assert_eq!(code, 0, "{reply}");
    assert_eq!(reply["executor"]["version"], "2.0.0", "{reply}");
    let events = a.audit_events();
    let completed = events
        .iter()
        .position(|e| e["event"] == "executor_installed" && e["fields"]["source"] == "recovery")
        .expect("the completion is audited");
    let started = events.iter().position(|e| e["event"] == "agent_start").expect("agent_start");
    assert!(completed < started, "completed after the agent started taking commands");
    a.stop();
    a.audit_verify();
}

#[test]
fn a_command_for_another_agent_is_refused() {
    if !common::require_root() {
        return;
    }
    // A signed command is valid on every agent that trusts the key: one naming another
    // agent is refused here (a copy replayed across the fleet), without using up its id.
    let mut a = Agent::with_agent_keys(2, "  id: ag-here\n");
    a.start();
    let mut elsewhere = scan("for-there");
    elsewhere["agent_id"] = json!("ag-there");
    rejected(&a, a.sign(&elsewhere), "wrong_agent");
    let mut typed = scan("typed-agent");
    typed["agent_id"] = json!(["ag-here"]);
    rejected(&a, a.sign(&typed), "wrong_agent");
    let mut here = scan("for-here");
    here["agent_id"] = json!("ag-here");
    let (code, r) = a.submit(&a.sign(&here));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    let (code, r) = a.submit(&a.sign(&scan("for-anyone")));
    assert_eq!(code, 0, "a command naming no agent runs when agent_id is not required: {r}");
    assert!(a.stop().success());
    a.audit_verify();
    let events = a.audit_events();
    let refused = events
        .iter()
        .find(|e| e["event"] == "security_event" && e["fields"]["command_id"] == "for-there")
        .expect("the refusal is audited");
    assert_eq!(refused["fields"]["reason"], "wrong_agent", "{refused}");

    // Required: a command naming no agent is refused too.
    let mut b = Agent::with_agent_keys(2, "  id: ag-here\n  require_agent_id: true\n");
    b.start();
    rejected(&b, b.sign(&scan("for-anyone")), "wrong_agent");
    let (code, r) = b.submit(&b.sign(&here));
    assert_eq!(code, 0, "{r}");
    assert!(b.stop().success());
}

/// Submit a port scan (waiting at most a minute) and expect it completed through `launch`.
fn scan_through(a: &Agent, id: &str, launch: &str, why: &str) {
    let (code, r) = a.submit_within(&a.sign(&scan(id)), Duration::from_secs(60));
    assert_eq!((code, r["sandbox"]["launch"].clone()), (0, json!(launch)), "{why}: {r}");
}

/// Stop the agent, verify its audit chain and return its `zygote_fallback` records.
fn stop_and_list_fallbacks(mut a: Agent) -> Vec<Value> {
    assert!(a.stop().success());
    a.audit_verify();
    a.audit_events().into_iter().filter(|e| e["event"] == "zygote_fallback").collect()
}

#[test]
fn a_dead_zygote_costs_one_cold_start_and_is_replaced() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(2);
    a.start();
    let agent = a.child.as_ref().unwrap().id();
    let first = daemon::started_zygote(agent);
    scan_through(&a, "z-1", "zygote", "the first run");
    // SAFETY: kill(2) on a pid we just read as our agent's child.
    unsafe { libc::kill(first, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(200));
    scan_through(&a, "z-2", "cold", "falls back to the cold path");
    scan_through(&a, "z-3", "zygote", "a new zygote");
    let second = daemon::zygote_pid(agent).expect("a new zygote runs");
    assert_ne!(first, second);
    let fallbacks = stop_and_list_fallbacks(a);
    assert!(std::fs::metadata(format!("/proc/{second}")).is_err(), "the zygote ends with the agent");
    assert_eq!(fallbacks.len(), 1, "{fallbacks:?}");
}

#[test]
fn a_stalled_zygote_is_replaced_and_its_run_starts_cold() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(2);
    a.start();
    let first = daemon::started_zygote(a.child.as_ref().unwrap().id());
    // Serving (a zygote stopped before its start-up ends is the start limit's case, 30 s)…
    scan_through(&a, "stall-0", "zygote", "the first run");
    // …then alive but never answering, as a zygote stuck in the kernel or frozen would be.
    // SAFETY: kill(2) on a pid we just read as our agent's child.
    unsafe { libc::kill(first, libc::SIGSTOP) };
    scan_through(&a, "stall-1", "cold", "falls back to the cold path");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(format!("/proc/{first}")).is_ok() {
        assert!(Instant::now() < deadline, "the stalled zygote is killed and reaped");
        std::thread::sleep(Duration::from_millis(20));
    }
    scan_through(&a, "stall-2", "zygote", "a new zygote");
    let fallbacks = stop_and_list_fallbacks(a);
    assert_eq!(fallbacks.len(), 1, "{fallbacks:?}");
    assert!(fallbacks[0]["fields"]["error"].as_str().unwrap().contains("no reply"), "{fallbacks:?}");
}

/// A process holding `a`'s audit log lock, stopped: util-linux `flock` holding it around a
/// sleep that does not inherit it (`-o`), in a process group of its own (kill the group).
fn stopped_audit_lock_holder(a: &Agent) -> std::process::Child {
    let lock = a.dir.path.join("audit/audit.jsonl.lock");
    let holder = std::os::unix::process::CommandExt::process_group(
        Command::new("flock").arg("-o").arg(&lock).args(["sleep", "600"]),
        0,
    )
    .spawn()
    .expect("flock(1)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string("/proc/locks").unwrap().lines().any(|l| l.contains(&format!(" {} ", holder.id()))) {
        assert!(Instant::now() < deadline, "flock(1) did not take the lock");
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(holder.id() as i32, libc::SIGSTOP) };
    holder
}

#[test]
fn a_stopped_audit_lock_holder_fails_runs_instead_of_stalling_the_agent() {
    if !common::require_root() {
        return;
    }
    // The last argument is YAML appended after the `audit:` section's path: its own key.
    let mut a = Agent::build(2, "", "  lock_wait_seconds: 1\n", |_| String::new());
    // An executor whose module, once imported, leaves a mark: whether any of it ran.
    let marks = HostDir::new();
    // Writable by the sandbox's user only (a directory every user may write to is refused).
    marks.chown_to_executor();
    let mark = marks.path.join("mark");
    let marking = format!(
        "open({:?}, 'w').write('imported')\n{}",
        mark.display().to_string(),
        "from opservant.executor import BaseExecutor, ExecutorResult\n\n\nclass Mark(BaseExecutor):\n    \
         def validate(self, params):\n        return True\n\n    def execute(self, params, context):\n        \
         return ExecutorResult(status=\"completed\", output={})\n"
    );
    a.install_with_permissions("mark", "Mark", &marking, json!({}), json!({"filesystem": {"write": [marks.str()]}}));
    let mark_cmd = |id: &str| json!({"command_id": id, "action": "execute", "executor": "mark", "parameters": {}});
    a.start();
    let (code, r) = a.submit(&a.sign(&scan("lock-0")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    let (code, r) = a.submit(&a.sign(&mark_cmd("mark-0")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    assert!(mark.exists(), "the marking executor's module was imported");
    std::fs::remove_file(&mark).unwrap();
    // A writer that holds the log's lock and is then stopped (an `opservant` command
    // suspended mid-append would be one).
    let mut holder = stopped_audit_lock_holder(&a);
    let before = a.audit_events().len();
    // Each gated run fails closed, naming the holder, instead of waiting for ever; the
    // agent keeps answering. The runtime had its arguments while the agent waited for the
    // lock, but the answer to its `ready` comes only once the start is audited: nothing of
    // the executor ran.
    for cmd in [scan("lock-1"), mark_cmd("lock-2")] {
        let (code, r) = a.submit_within(&a.sign(&cmd), Duration::from_secs(60));
        assert_eq!(
            (code, r["status"].clone(), r["reason"].clone()),
            (1, json!("rejected"), json!("cannot_run")),
            "{r}"
        );
        let error = r["error"].as_str().unwrap_or_default();
        assert!(error.contains(&format!("held by pid {} (flock, stopped) for more than 1 s", holder.id())), "{r}");
    }
    assert_eq!(a.audit_events().len(), before, "nothing appended while the lock is held");
    assert!(!mark.exists(), "the executor's module ran although its start was never audited");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(-(holder.id() as i32), libc::SIGKILL) };
    holder.wait().unwrap();
    let (code, r) = a.submit_within(&a.sign(&scan("lock-3")), Duration::from_secs(60));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "runs go on once it lets go: {r}");
    // The log says it was failing, and since when, though a command's own records ended the
    // failures (before, only the idle retry of a ping wrote this: a command first, no trace).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.audit_events().iter().any(|e| e["event"] == "audit_resumed") {
        assert!(Instant::now() < deadline, "no audit_resumed after the log took records again");
        std::thread::sleep(Duration::from_millis(20));
    }
    let resumed = a.audit_events().into_iter().find(|e| e["event"] == "audit_resumed").unwrap();
    assert!(resumed["fields"]["last_error"].as_str().unwrap().contains("held by pid"), "{resumed}");
    assert!(a.stop().success());
    a.audit_verify();
    let resumed = a.audit_events().iter().filter(|e| e["event"] == "audit_resumed").count();
    assert_eq!(resumed, 1, "once");
}

#[test]
fn the_warm_pool_serves_repeat_runs_and_leaves_nothing_behind() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::with_agent_keys(2, "  warm_pool: 2\n");
    a.start();
    let agent = a.child.as_ref().unwrap().id();
    // Pre-warmed at start: one sandbox for each installed executor (port-scanner and slow),
    // their payloads forked from the zygote's sandbox processes (zygote → init → payload).
    let deadline = Instant::now() + Duration::from_secs(20);
    let payloads = || daemon::zygote_payloads(agent).len();
    while payloads() < 2 {
        assert!(Instant::now() < deadline, "the warm pool was not pre-warmed: {} payloads", payloads());
        std::thread::sleep(Duration::from_millis(20));
    }
    // Each waiting payload is warmed up: its resident writable memory is its own, no longer
    // shared copy-on-write with the zygote (a payload just forked shares megabytes of it).
    let shared = || -> Vec<u64> {
        let zygote = daemon::zygote_pid(agent).unwrap();
        let payloads = common::procs::payloads_below(zygote);
        payloads.iter().filter_map(|&p| common::procs::shared_writable_kib(p)).collect()
    };
    while shared().len() < 2 || shared().iter().any(|&kib| kib > 256) {
        assert!(Instant::now() < deadline, "pooled payloads not warmed up: shared writable KiB {:?}", shared());
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every thread of the agent blocks the stop signals (they are read from a signalfd): one
    // that did not would take SIGTERM with its default action and kill the agent undrained.
    for task in std::fs::read_dir(format!("/proc/{agent}/task")).unwrap().flatten() {
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let Some(blocked) = status.lines().find_map(|l| l.strip_prefix("SigBlk:")) else { continue };
        let blocked = u64::from_str_radix(blocked.trim(), 16).unwrap();
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            assert_ne!(
                blocked & (1 << (sig - 1)),
                0,
                "thread {:?} leaves signal {sig} unblocked: {status}",
                task.path()
            );
        }
    }
    // A ping says so too (as heartbeats do): on-host automation can wait for a full pool.
    let sandboxes = a.ping_sandboxes();
    assert_eq!((&sandboxes["launch"], &sandboxes["warm_pool"]["size"]), (&json!("zygote"), &json!(2)), "{sandboxes}");
    a.await_pool_ready(2);
    // So the very first run takes a pooled sandbox.
    let (code, r) = a.submit(&a.sign(&scan("pool-1")));
    assert_eq!((code, r["sandbox"]["launch"].clone()), (0, json!("pool")), "{r}");
    let mut launches = vec![];
    for i in 2..6 {
        // A refill may still be on its way (a run that misses starts its own sandbox): each
        // run waits for it, the slow executor's pooled sandbox being the other one.
        a.await_pool_ready(2);
        let (code, r) = a.submit(&a.sign(&scan(&format!("pool-{i}"))));
        assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
        assert_eq!(r["output"]["ports"][0]["status"], "closed", "{r}");
        assert_eq!(r["sandbox"]["namespaces"].as_array().unwrap().len(), 7, "{r}");
        assert_eq!(r["sandbox"]["seccomp"], "enforced", "{r}");
        launches.push(r["sandbox"]["launch"].as_str().unwrap().to_string());
    }
    assert!(launches.iter().all(|l| l == "pool"), "repeat runs take pooled sandboxes: {launches:?}");
    // A pooled sandbox whose payload was killed while it waited (the OOM killer's first
    // victim) is not handed out: the run starts its own and completes.
    a.await_pool_ready(2);
    let zygote = daemon::zygote_pid(agent).unwrap();
    let waiting = common::procs::payloads_below(zygote);
    assert!(!waiting.is_empty(), "a refilled sandbox waits");
    for p in &waiting {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p), nix::sys::signal::SIGKILL);
    }
    std::thread::sleep(Duration::from_millis(100));
    let (code, r) = a.submit(&a.sign(&scan("pool-killed")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    assert_eq!(r["output"]["ports"][0]["status"], "closed", "{r}");
    // The executor removed and installed again at the same version (the same path, other
    // files): the sandbox pooled before shows the deleted files, so it is not handed out.
    std::thread::sleep(Duration::from_millis(300));
    let c = a.config.to_str().unwrap().to_string();
    let scanner = Path::new(env!("CARGO_MANIFEST_DIR")).join("../executors/port-scanner");
    for args in [
        vec!["executor", "remove", "port-scanner", "--config", &c],
        vec!["executor", "install", scanner.to_str().unwrap(), "--config", &c],
    ] {
        let out = common::command().args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let (code, r) = a.submit(&a.sign(&scan("pool-reinstalled")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    assert_eq!(r["sandbox"]["launch"], "zygote", "{r}");
    // Tighter limits are another spec: not from the pool.
    let mut tighter = scan("pool-tight");
    tighter["resource_limits"] = json!({"timeout_seconds": 10});
    let (code, r) = a.submit(&a.sign(&tighter));
    assert_eq!((code, r["sandbox"]["launch"].clone()), (0, json!("zygote")), "{r}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!common::cgroups_of(agent).is_empty(), "pooled sandboxes wait in their cgroups");
    assert!(a.stop().success());
    assert!(common::cgroups_of(agent).is_empty(), "the pool's cgroups are removed when the agent stops");
    assert!(common::host_processes_with("opservant-runtime").iter().all(|p| {
        std::fs::read_to_string(format!("/proc/{p}/status")).map_or(true, |s| !s.contains(&format!("PPid:\t{agent}")))
    }));
    a.audit_verify();
}

/// A run's refill waits for the run's outcome, but not for a long run: 50 ms into it
/// (`warm_pool::REFILL_DELAY`) the pool starts its replacement, ready for the next command
/// of the spec while the run goes on.
#[test]
fn a_long_runs_refill_does_not_wait_for_its_end() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::with_agent_keys(2, "  warm_pool: 2\n");
    a.start();
    let ready = || a.ping_sandboxes()["warm_pool"]["ready"].as_u64().unwrap_or(0);
    // Pre-warmed: the port scanner's sandbox and the slow executor's.
    a.await_pool_ready(2);
    std::thread::scope(|s| {
        let run = s.spawn(|| {
            let cmd =
                json!({"command_id": "long-1", "action": "execute", "executor": "slow", "parameters": {"seconds": 15}});
            a.submit(&a.sign(&cmd))
        });
        // Once the run has taken the slow executor's sandbox (its start is audited after
        // the take), the replacement comes long before the run's end.
        let deadline = Instant::now() + Duration::from_secs(12);
        let started =
            || a.audit_events().iter().any(|e| e["event"] == "executor_start" && e["fields"]["command_id"] == "long-1");
        while !started() {
            assert!(Instant::now() < deadline, "the long run did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        while ready() < 2 {
            assert!(Instant::now() < deadline, "no refill while the long run went on");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!run.is_finished(), "the run ended before the check: nothing shown");
        let (code, r) = run.join().unwrap();
        assert_eq!((code, &r["status"], &r["sandbox"]["launch"]), (0, &json!("completed"), &json!("pool")), "{r}");
    });
    assert!(a.stop().success());
}

/// Concurrent commands of one executor on a pool of 2: every run completes, each run's
/// refill (which waits for its run's outcome, several of a spec at once) never leaves more
/// than the pool's size waiting, and the agent's stop leaves no sandbox, cgroup or process.
#[test]
fn a_busy_warm_pool_stays_within_its_size_and_leaves_nothing_behind() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::with_agent_keys(4, "  warm_pool: 2\n");
    a.install("quick", "NoopExecutor", agent::bench::NOOP_PY, json!({"timeout_seconds": 30}));
    a.start();
    let agent = a.child.as_ref().unwrap().id();
    // Pre-warmed (as its ping says) before the burst, so that its first runs find it.
    a.await_pool_ready(2);
    let launches: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let a = &a;
                s.spawn(move || {
                    (0..6)
                        .map(|n| {
                            let cmd = json!({"command_id": format!("busy-{t}-{n}"), "action": "execute",
                                "executor": "quick", "parameters": {}});
                            let (code, r) = a.submit(&a.sign(&cmd));
                            assert_eq!((code, &r["status"]), (0, &json!("completed")), "{r}");
                            r["sandbox"]["launch"].as_str().unwrap().to_string()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert!(launches.iter().any(|l| l == "pool"), "no run found a pooled sandbox: {launches:?}");
    // Once the refills are done — every payload below the zygote ready in the pool, the same
    // two reads in a row — at most the pool's size of sandboxes wait (an over-fill stays).
    let settled = Instant::now() + Duration::from_secs(30);
    let mut last = (usize::MAX, u64::MAX);
    let waiting = loop {
        let waiting = daemon::zygote_payloads(agent);
        let ready = a.ping_sandboxes()["warm_pool"]["ready"].as_u64().unwrap_or(0);
        let now = (waiting.len(), ready);
        if now == last && waiting.len() as u64 == ready {
            break waiting;
        }
        assert!(Instant::now() < settled, "the pool never settled: {waiting:?} payloads, {ready} ready");
        last = now;
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(!waiting.is_empty() && waiting.len() <= 2, "pooled payloads waiting: {waiting:?}");
    let zygote = daemon::zygote_pid(agent).unwrap();
    assert!(a.stop().success());
    assert!(common::cgroups_of(agent).is_empty(), "the pool's cgroups are removed when the agent stops");
    let deadline = Instant::now() + Duration::from_secs(10);
    let alive = |p: &i32| Path::new(&format!("/proc/{p}")).exists();
    while alive(&zygote) || waiting.iter().any(alive) {
        assert!(Instant::now() < deadline, "the zygote or a pooled payload outlived the agent");
        std::thread::sleep(Duration::from_millis(20));
    }
    a.audit_verify();
}

/// A pooled sandbox that waits past `agent.warm_pool_idle_seconds` is discarded by the
/// daemon on its own (killed, its cgroups removed), not only when a run would take it; the
/// agent goes on serving runs.
#[test]
fn pooled_sandboxes_idle_past_their_limit_are_discarded() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::with_agent_keys(2, "  warm_pool: 2\n  warm_pool_idle_seconds: 3\n");
    a.start();
    let agent = a.child.as_ref().unwrap().id();
    let payloads = || daemon::zygote_payloads(agent);
    let deadline = Instant::now() + Duration::from_secs(20);
    // At least one (under load the first may already be discarded before the second is ready).
    while payloads().is_empty() {
        assert!(Instant::now() < deadline, "the warm pool was not pre-warmed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!common::cgroups_of(agent).is_empty(), "pooled sandboxes wait in their cgroups");
    // Discarded within a few of the daemon's expiry checks (half the idle limit apart).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !payloads().is_empty() || !common::cgroups_of(agent).is_empty() {
        assert!(
            Instant::now() < deadline,
            "idle pooled sandboxes were kept: payloads {:?}, cgroups {:?}",
            payloads(),
            common::cgroups_of(agent)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Runs go on (from the zygote, or from a refill the first run's spec starts).
    let (code, r) = a.submit(&a.sign(&scan("after-expiry")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    assert!(a.stop().success());
    assert!(common::cgroups_of(agent).is_empty());
    a.audit_verify();
}

/// Reads the random generators a sandbox inherits: the C library's (`rand`, `random`) and
/// Python's `random`, as an executor would use them.
const ENTROPY_PY: &str = r#"import ctypes
import random

from opservant.executor import BaseExecutor, ExecutorResult


class Entropy(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        libc = ctypes.CDLL(None)
        return ExecutorResult(status="completed", output={
            "rand": libc.rand(), "random": libc.random(), "python": random.getrandbits(64)})
"#;

#[test]
fn sandboxes_forked_from_one_zygote_do_not_share_random_state() {
    if !common::require_root() {
        return;
    }
    // Every sandbox of the daemon is a fork of one zygote: without a reseed in each child,
    // all would draw the same numbers from the generator state they inherit.
    let mut a = Agent::with_agent_keys(2, "  warm_pool: 4\n");
    a.install("entropy", "Entropy", ENTROPY_PY, json!({"timeout_seconds": 30}));
    a.start();
    let agent = a.child.as_ref().unwrap().id();
    // Pre-warmed at start, one sandbox per installed executor.
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon::zygote_payloads(agent).len() < 3 {
        assert!(Instant::now() < deadline, "the warm pool was not pre-warmed");
        std::thread::sleep(Duration::from_millis(20));
    }
    // And ready, so that the first run takes its pooled sandbox.
    a.await_pool_ready(3);
    let mut draws: Vec<(String, Value)> = Vec::new();
    for i in 0..6 {
        let mut cmd = json!({"command_id": format!("entropy-{i}"), "action": "execute", "executor": "entropy",
                             "parameters": {}});
        if i % 2 == 1 {
            // Tighter limits are another spec, not pre-warmed.
            cmd["resource_limits"] = json!({"timeout_seconds": 10});
        }
        let (code, r) = a.submit(&a.sign(&cmd));
        assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
        draws.push((r["sandbox"]["launch"].as_str().unwrap().to_string(), r["output"].clone()));
        // The pool's refill for the next pooled run.
        std::thread::sleep(Duration::from_millis(300));
    }
    let launches: Vec<&str> = draws.iter().map(|(l, _)| l.as_str()).collect();
    // Both kinds of child: the first run of the tighter spec finds no pooled sandbox for it
    // (the pool learns it from that run and serves the next ones).
    assert_eq!(launches[1], "zygote", "{draws:?}");
    assert!(launches.contains(&"pool"), "{draws:?}");
    for generator in ["rand", "random", "python"] {
        let values: std::collections::BTreeSet<String> =
            draws.iter().map(|(_, out)| out[generator].to_string()).collect();
        assert_eq!(values.len(), draws.len(), "{generator}: sandboxes drew the same numbers: {draws:?}");
    }
    assert!(a.stop().success());
}

#[test]
fn overload_is_rejected_and_sigterm_lets_running_commands_finish() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(1);
    a.start();
    let slow =
        a.sign(&json!({"command_id": "slow-1", "action": "execute", "executor": "slow", "parameters": {"seconds": 3}}));
    let socket = a.socket.clone();
    let first = std::thread::spawn(move || {
        let out = common::command()
            .args(["submit", "-", "--socket", socket.to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(&slow)?;
                c.wait_with_output()
            })
            .unwrap();
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    });
    // Wait until the slow command is running (its executor_start is audited).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.audit_events().iter().any(|e| e["event"] == "executor_start") {
        assert!(Instant::now() < deadline, "the slow command did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, r) = a.submit(&a.sign(&scan("while-busy")));
    assert_eq!(code, 1);
    assert_eq!((r["status"].clone(), r["reason"].clone()), (json!("rejected"), json!("overloaded")), "{r}");
    // SIGHUP is no stop (there is no reload): logged and ignored — the running command goes
    // on, and the agent still answers. At its default it had killed the agent unaudited.
    let pid = a.child.as_ref().unwrap().id() as i32;
    // SAFETY: kill(2) of the agent this test started, not yet reaped.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    std::thread::sleep(Duration::from_millis(300));
    let (code, r) = a.submit(&a.sign(&scan("after-sighup")));
    assert_eq!((code, r["reason"].clone()), (1, json!("overloaded")), "the agent answers after SIGHUP: {r}");
    // SIGTERM now: the running command still completes and gets its reply.
    let status = a.stop();
    let r = first.join().unwrap();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["output"]["slept"], 3);
    assert!(status.success(), "{status:?}");
    assert!(a.audit_events().iter().any(|e| e["event"] == "security_event" && e["fields"]["reason"] == "overloaded"));
    a.audit_verify();
}

/// A command running when the agent is killed (SIGKILL: no drain) is not lost: the next
/// agent audits it as failed, `interrupted`, naming the dead agent's pid, and answers its id
/// sent again with that outcome — `failed`, `interrupted` — rather than refusing it as a
/// replay (a security event), which is all it got before the twenty-first session, its
/// start left without an end.
#[test]
fn a_command_running_when_the_agent_died_is_reported_interrupted() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(2);
    a.start();
    let slow = a
        .sign(&json!({"command_id": "died-1", "action": "execute", "executor": "slow", "parameters": {"seconds": 30}}));
    let first_pid = a.child.as_ref().unwrap().id();
    std::thread::scope(|scope| {
        let first = scope.spawn(|| a.submit_within(&slow, Duration::from_secs(60)));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !a.audit_events().iter().any(|e| e["event"] == "executor_start" && e["fields"]["command_id"] == "died-1")
        {
            assert!(Instant::now() < deadline, "the slow command did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: kill(2) of the agent this test started, not yet reaped.
        unsafe { libc::kill(first_pid as i32, libc::SIGKILL) };
        let (code, _) = first.join().unwrap();
        assert_eq!(code, 2, "the client got no reply");
    });
    let _ = a.child.take().unwrap().wait();
    a.start();
    // Its id sent again: what became of it, not a replay refusal.
    let (code, r) = a.submit(&slow);
    assert_eq!(code, 1, "{r}");
    assert_eq!((r["status"].clone(), r["reason"].clone()), (json!("failed"), json!("interrupted")), "{r}");
    assert!(r["error"].as_str().unwrap().contains(&format!("pid {first_pid}")), "{r}");
    let events = a.audit_events();
    let fail = events
        .iter()
        .find(|e| e["event"] == "executor_fail" && e["fields"]["command_id"] == "died-1")
        .unwrap_or_else(|| panic!("no executor_fail for the interrupted command: {events:?}"));
    assert_eq!(fail["fields"]["reason"], "interrupted", "{fail}");
    assert_eq!(fail["fields"]["agent_pid"], first_pid.to_string(), "{fail}");
    assert_eq!(fail["fields"]["executor"], "slow", "{fail}");
    // Recorded before the new agent took anything: before its agent_start.
    let at = |pred: &dyn Fn(&Value) -> bool| events.iter().rposition(pred).unwrap();
    assert!(at(&|e| e == fail) < at(&|e| e["event"] == "agent_start"), "{events:?}");
    assert!(
        !events.iter().any(|e| e["event"] == "security_event" && e["fields"]["command_id"] == "died-1"),
        "{events:?}"
    );
    // Nothing is left to report at the next start.
    assert!(a.stop().success());
    a.start();
    let fails = a
        .audit_events()
        .iter()
        .filter(|e| e["event"] == "executor_fail" && e["fields"]["command_id"] == "died-1")
        .count();
    assert_eq!(fails, 1, "reported once");
    // A command that ends normally leaves nothing behind (its record goes once its reply is
    // written); nor did the recovered one.
    let (code, r) = a.submit(&a.sign(&scan("after-recovery")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    let running = PathBuf::from(format!("{}.running", a.socket.display()));
    let records: Vec<_> =
        std::fs::read_dir(&running).unwrap().flatten().filter(|e| e.file_name() != "lock").map(|e| e.path()).collect();
    assert!(records.is_empty(), "{records:?}");
    assert!(a.stop().success());
}

/// Connections cannot exhaust the agent: with `max_concurrent` 1 it serves 1 + 64
/// connections at once; the next is answered `overloaded` without being read (audited) —
/// also through `opservant submit`, whose command the agent then never reads —, the held
/// ones cost nothing once closed, and a client trickling its command a byte a second is cut
/// off at the read deadline (10 s for the whole command, not per read).
#[test]
fn silent_and_trickling_connections_cannot_exhaust_the_agent() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(1);
    a.start();
    // Held connections the agent serves (waiting for their commands). `start`'s readiness
    // connection may still hold its worker for a moment, so one made meanwhile can be
    // refused (answered and closed at once): such a one is replaced.
    let mut held: Vec<UnixStream> = (0..65).map(|_| UnixStream::connect(&a.socket).unwrap()).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let before = held.len();
        held.retain(|s| {
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            let served = matches!((&*s).read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            s.set_nonblocking(false).unwrap();
            served
        });
        if held.len() == before {
            break;
        }
        assert!(Instant::now() < deadline, "the agent kept refusing held connections");
        while held.len() < 65 {
            held.push(UnixStream::connect(&a.socket).unwrap());
        }
    }
    let mut probe = UnixStream::connect(&a.socket).unwrap();
    probe.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut reply = String::new();
    probe.read_to_string(&mut reply).unwrap();
    let r: Value = serde_json::from_str(reply.trim()).unwrap_or_else(|e| panic!("{e}: {reply:?}"));
    assert_eq!((r["status"].clone(), r["reason"].clone()), (json!("rejected"), json!("overloaded")), "{r}");
    assert!(r["error"].as_str().unwrap().contains("65 connections are open"), "{r}");
    let (code, r) = a.submit_within(&a.sign(&scan("while-held")), Duration::from_secs(60));
    assert_eq!((code, r["reason"].clone()), (1, json!("overloaded")), "{r}");
    drop(held);
    // The held connections' threads see the end of their input and go; then commands run.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, r) = a.submit_within(
            &a.sign(&scan(&format!("after-{}", deadline.elapsed().as_nanos()))),
            Duration::from_secs(60),
        );
        if code == 0 {
            assert_eq!(r["status"], "completed", "{r}");
            break;
        }
        assert_eq!(r["reason"], "overloaded", "{r}");
        assert!(Instant::now() < deadline, "the closed connections still count: {r}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A trickle: one byte a second. Cut off (reset or closed) at the 10 s deadline, well
    // before these 60 bytes are sent; unanswered.
    let mut trickle = UnixStream::connect(&a.socket).unwrap();
    let started = Instant::now();
    let mut cut_off = false;
    for _ in 0..60 {
        if trickle.write_all(b" ").is_err() {
            cut_off = true;
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    assert!(cut_off, "a trickling client held its connection for {:?}", started.elapsed());
    let mut rest = String::new();
    let _ = trickle.read_to_string(&mut rest);
    assert!(rest.is_empty(), "{rest}");
    assert!(a.stop().success());
    let refusals = a
        .audit_events()
        .into_iter()
        .filter(|e| e["event"] == "security_event" && e["fields"]["reason"] == "overloaded")
        .count();
    assert!(refusals >= 2, "{refusals}");
    a.audit_verify();
}

/// A client that sends a command and never reads its reply cannot hold the agent's worker —
/// and with it the agent's shutdown, which waits for its workers — for ever: a reply larger
/// than the socket's buffer (2 MB of output here) is given up after the write deadline
/// (10 s). Without the deadline the SIGTERM'd agent waits for the client (checked; the
/// limit here is a hang detector).
#[test]
fn a_client_that_never_reads_its_reply_does_not_hold_the_shutdown() {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(1);
    a.start();
    let big = a.sign(&json!({"command_id": "unread-1", "action": "execute", "executor": "slow",
        "parameters": {"seconds": 0, "pad": 2_000_000}}));
    let mut client = UnixStream::connect(&a.socket).unwrap();
    client.write_all(&big).unwrap();
    client.shutdown(std::net::Shutdown::Write).unwrap();
    // Answered (its completion audited): the reply is being written, and blocks.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !a.audit_events().iter().any(|e| e["event"] == "executor_complete" && e["fields"]["command_id"] == "unread-1")
    {
        assert!(Instant::now() < deadline, "the command was never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut child = a.child.take().expect("running");
    let pid = child.id() as i32;
    // SAFETY: kill(2) on the pid of our own child, not yet reaped.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(status) => status.expect("wait for the agent"),
        Err(_) => {
            // SAFETY: as above (the waiting thread has not reaped it: it has not returned).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the agent's shutdown waited for a client that never reads its reply");
        }
    };
    assert!(status.success(), "{status:?}");
    drop(client);
    a.audit_verify();
}

/// Connections beyond the limit are answered `overloaded` off the accept loop: with the
/// audit log's lock held by a stopped process, their answers wait for their audit records
/// (and past the refusal queue a connection is closed unanswered, counted in the next
/// refusal's record), while the accept loop goes on feeding the watchdog. Before, the
/// accepting thread wrote each refusal's record itself and stalled with it: two refusals in
/// a row outlasted systemd's `WatchdogSec=60s`.
#[test]
fn refusals_wait_for_a_held_audit_lock_off_the_accept_loop() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    if !common::require_root() {
        return;
    }
    let mut a = Agent::build(1, "", "  lock_wait_seconds: 20\n", |_| String::new());
    let notify_path = a.dir.path.join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    // Read as they come (a sender blocks once `net.unix.max_dgram_qlen` are queued): the
    // moment of every ping.
    let pinged = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let pings_seen = pinged.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n) = notify.recv(&mut buf) {
            if &buf[..n] == b"WATCHDOG=1" {
                pings_seen.lock().unwrap().push(Instant::now());
            }
        }
    });
    // WATCHDOG_USEC 400 ms: the agent pings every 200 ms.
    a.start_with_env(&[("NOTIFY_SOCKET", notify_path.to_str().unwrap()), ("WATCHDOG_USEC", "400000")]);
    let idle = take_every_place(&a);
    let answer = |mut c: UnixStream| {
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).unwrap();
        text
    };
    // The log's lock, held by a stopped process.
    let mut holder = stopped_audit_lock_holder(&a);
    let refused: Vec<UnixStream> = (0..20).map(|_| UnixStream::connect(&a.socket).unwrap()).collect();
    // The pings go on while the refusals wait for the lock.
    let watched = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let pings = pinged.lock().unwrap().iter().filter(|&&t| t > watched).count();
    assert!(pings >= 4, "watchdog pings in 2 s with refusals waiting for the audit lock: {pings}");
    // SAFETY: kill(2) on our own child's process group.
    unsafe { libc::kill(-(holder.id() as i32), libc::SIGKILL) };
    holder.wait().unwrap();
    let answers: Vec<String> = refused.into_iter().map(answer).collect();
    let unanswered = answers.iter().filter(|t| t.is_empty()).count();
    assert!(answers.iter().all(|t| t.is_empty() || t.contains("overloaded")), "{answers:?}");
    // One refusal being audited and `REFUSAL_QUEUE` (16) waiting: the rest closed unanswered.
    assert!((3..=4).contains(&unanswered), "{answers:?}");
    drop(idle);
    assert!(a.stop().success());
    let overloaded: Vec<String> = a
        .audit_events()
        .iter()
        .filter(|e| e["fields"]["reason"] == "overloaded")
        .map(|e| e["fields"]["detail"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(overloaded.len(), 1 + 20 - unanswered, "{overloaded:?}");
    let counted: usize = overloaded
        .iter()
        .filter_map(|d| d.split_once(" (")?.1.split_once(" more closed unanswered")?.0.parse::<usize>().ok())
        .sum();
    assert_eq!(counted, unanswered, "{overloaded:?}");
    a.audit_verify();
}

/// Every place of an agent with `max_concurrent` 1 taken (1 + 64 connections): clients that
/// send nothing hold theirs for the read deadline (10 s). One more at a time until one is
/// refused at once (the start-up probe's connection may still hold a place). The idle
/// connections, to be dropped when done.
fn take_every_place(a: &Agent) -> Vec<std::os::unix::net::UnixStream> {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    let mut idle: Vec<UnixStream> = (0..64).map(|_| UnixStream::connect(&a.socket).unwrap()).collect();
    loop {
        assert!(idle.len() < 70, "no connection refused with {} open", idle.len());
        let mut c = UnixStream::connect(&a.socket).unwrap();
        // A refusal is answered after its audit record is durable: time for that on a busy
        // machine, well within the idle ones' 10 s.
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut text = String::new();
        match c.read_to_string(&mut text) {
            Ok(_) => {
                assert!(text.contains("overloaded"), "{text}");
                // Another connection counted with ours — `Agent::start`'s probe, whose worker
                // had not ended yet — leaves a place free once it has: take that one too
                // (seen in CI: a test's refusal then went to a worker instead).
                let open = text
                    .split_once(" connections are open")
                    .and_then(|(before, _)| before.rsplit(|c: char| !c.is_ascii_digit()).next()?.parse::<usize>().ok());
                if open.is_some_and(|n| n > idle.len()) {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                return idle;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => idle.push(c),
            Err(e) => panic!("{e}"),
        }
    }
}

/// The refusals still queued when the agent stops are closed unanswered and counted in one
/// record before `agent_stop`: audited one by one, each could wait `audit.lock_wait_seconds`
/// for a log lock held by a stuck process, and the stop with them (17 × the wait).
#[test]
fn a_stopping_agent_counts_its_queued_refusals_in_one_record() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    if !common::require_root() {
        return;
    }
    let mut a = Agent::build(1, "", "  lock_wait_seconds: 20\n", |_| String::new());
    a.start();
    let idle = take_every_place(&a);
    let mut holder = stopped_audit_lock_holder(&a);
    // One refusal waits for the lock, `REFUSAL_QUEUE` (16) are queued, the last three are
    // closed at once — which tells that the accept loop has taken all twenty.
    let refused: Vec<UnixStream> = (0..20).map(|_| UnixStream::connect(&a.socket).unwrap()).collect();
    for c in &refused {
        c.set_nonblocking(true).unwrap();
    }
    let closed = |c: &UnixStream| matches!((&*c).read(&mut [0u8; 1]), Ok(0));
    let deadline = Instant::now() + Duration::from_secs(10);
    while refused.iter().filter(|c| closed(c)).count() < 3 {
        assert!(Instant::now() < deadline, "the refusal queue never filled");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(idle);
    let mut agent = a.child.take().unwrap();
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    // The socket is removed once the queue is closed; then the lock is let go.
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.socket.exists() {
        assert!(Instant::now() < deadline, "the agent did not stop taking connections");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on our own child's process group.
    unsafe { libc::kill(-(holder.id() as i32), libc::SIGKILL) };
    holder.wait().unwrap();
    assert!(agent.wait().unwrap().success());
    let answers: Vec<String> = refused
        .into_iter()
        .map(|mut c| {
            c.set_nonblocking(false).unwrap();
            let mut text = String::new();
            c.read_to_string(&mut text).unwrap();
            text
        })
        .collect();
    // Only the refusal that was waiting for the lock is answered.
    assert_eq!(answers.iter().filter(|t| t.contains("overloaded")).count(), 1, "{answers:?}");
    assert_eq!(answers.iter().filter(|t| t.is_empty()).count(), 19, "{answers:?}");
    // Every one of them counted before `agent_stop`: those closed before the refusal thread
    // took the first from the queue in its record, the rest in one record at the stop.
    let events = a.audit_events();
    let stopped = events.iter().position(|e| e["event"] == "agent_stop").expect("agent_stop");
    let count = |e: &Value| -> usize {
        let detail = e["fields"]["detail"].as_str().unwrap_or_default();
        let number =
            |before: &str| detail.split_once(before).and_then(|(n, _)| n.rsplit(['(', ' ']).next()?.parse().ok());
        number(" more closed unanswered").or_else(|| number(" connections closed unanswered")).unwrap_or(0)
    };
    let counted: usize = events[..stopped].iter().filter(|e| e["fields"]["reason"] == "overloaded").map(count).sum();
    assert_eq!(counted, 19, "{events:?}");
    assert!(events[stopped..].iter().all(|e| e["fields"]["reason"] != "overloaded"), "{events:?}");
    a.audit_verify();
}

/// A reader of `$NOTIFY_SOCKET` that falls behind does not stall the agent: the accept loop
/// sends the watchdog pings, and one that finds the reader's queue full
/// (`net.unix.max_dgram_qlen`) is dropped, not waited for.
#[test]
fn a_notify_socket_nobody_reads_does_not_stall_the_agent() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(1);
    let notify_path = a.dir.path.join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // WATCHDOG_USEC 100 ms: the agent pings every 50 ms.
    a.start_with_env(&[("NOTIFY_SOCKET", notify_path.to_str().unwrap()), ("WATCHDOG_USEC", "100000")]);
    let mut buf = [0u8; 256];
    loop {
        let n = notify.recv(&mut buf).expect("READY=1");
        if &buf[..n] == b"READY=1" {
            break;
        }
    }
    // From now on nothing is read, and the queue is full at once (`net.unix.max_dgram_qlen`
    // datagrams, whatever the host's setting).
    let filler = std::os::unix::net::UnixDatagram::unbound().unwrap();
    filler.set_nonblocking(true).unwrap();
    while filler.send_to(b"X", &notify_path).is_ok() {}
    // A few pings meet the full queue.
    std::thread::sleep(Duration::from_millis(500));
    let (code, r) = a.submit_within(&a.sign(&scan("notify-1")), Duration::from_secs(60));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    // `STOPPING=1` waits for room: read from now on.
    let read = std::thread::spawn(move || {
        notify.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 256];
        let mut stopping = false;
        while let Ok(n) = notify.recv(&mut buf) {
            stopping |= &buf[..n] == b"STOPPING=1";
        }
        stopping
    });
    assert!(a.stop().success());
    assert!(read.join().unwrap(), "STOPPING=1 was not sent");
}

/// systemd keeps the watchdog armed while a unit stops: a drain that stopped pinging was
/// killed with SIGABRT after `WatchdogSec` (found by the boot test, tests/vm/systemd_boot.rs).
#[test]
fn the_watchdog_is_fed_while_draining() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(1);
    let notify_path = a.dir.path.join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    // WATCHDOG_USEC 400 ms: the agent pings every 200 ms.
    a.start_with_env(&[("NOTIFY_SOCKET", notify_path.to_str().unwrap()), ("WATCHDOG_USEC", "400000")]);
    let slow =
        a.sign(&json!({"command_id": "wd-1", "action": "execute", "executor": "slow", "parameters": {"seconds": 3}}));
    let socket = a.socket.clone();
    let running = std::thread::spawn(move || {
        let out = common::command()
            .args(["submit", "-", "--socket", socket.to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(&slow)?;
                c.wait_with_output()
            })
            .unwrap();
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.audit_events().iter().any(|e| e["event"] == "executor_start") {
        assert!(Instant::now() < deadline, "the slow command did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut child = a.child.take().unwrap();
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    // Every notification until the agent has exited, with the time it arrived.
    let sent = Instant::now();
    let mut after_stopping = Vec::new();
    let mut stopping = false;
    let mut buf = [0u8; 256];
    let status = loop {
        if let Ok(n) = notify.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            if msg == "STOPPING=1" {
                stopping = true;
            } else if stopping && msg == "WATCHDOG=1" {
                after_stopping.push(sent.elapsed());
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(sent.elapsed() < Duration::from_secs(20), "the agent did not exit after SIGTERM");
    };
    assert!(status.success(), "{status:?}");
    let r = running.join().unwrap();
    assert_eq!(r["status"], "completed", "{r}");
    assert!(stopping, "no STOPPING=1");
    // The drain lasted about 2 s or more; pings every 200 ms, so well over 4 of them.
    assert!(after_stopping.len() >= 4, "watchdog pings while draining: {after_stopping:?}");
}

/// The agent logs at start what `opservant doctor` reports as it sees the host — under a
/// unit's filters and capabilities, which a shell's `doctor` does not share: a summary, and
/// each degradation. Here the agent and `doctor` run alike, so the lists are the same.
#[test]
fn the_agent_logs_doctors_view_of_the_host_at_start() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(1);
    let log_path = a.config.with_file_name("agent.log");
    a.start_logging_to(std::fs::File::create(&log_path).unwrap());
    a.stop();
    let log = std::fs::read_to_string(&log_path).unwrap();
    let out = op(&["doctor", "--json", "--config", a.config.to_str().unwrap()]);
    let report: Value = serde_json::from_slice(&out.stdout).expect("doctor --json");
    let degraded: Vec<&str> = report["degraded"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()).collect();
    let missing =
        report["findings"].as_array().unwrap().iter().filter(|f| f["required"] == true && f["ok"] == false).count();
    // (A host where nothing is missing or degraded gets an info line, below the default level.)
    assert!(
        missing + degraded.len() == 0
            || log.contains(&format!(
                "doctor, as the service sees this host: {missing} required features missing, {} degradations",
                degraded.len()
            )),
        "{log}"
    );
    for d in &degraded {
        assert!(log.contains(&format!("degraded (as the service sees this host): {d}")), "{d}: {log}");
    }
}

/// A state directory the agent cannot write (here on a file system mounted read-only) stops
/// it at start, exit 2 naming it — before the twenty-first session the agent started and
/// then refused every command (`replay store: … Read-only file system`), nothing at start
/// saying why.
#[test]
fn a_state_directory_that_cannot_be_written_stops_the_agent_at_start() {
    if !common::require_root() {
        return;
    }
    let dir = common::HostDir::new();
    let mnt = dir.path.join("ro");
    std::fs::create_dir(&mnt).unwrap();
    let mount = |args: &[&str]| {
        let st = Command::new("mount").args(args).status().expect("mount");
        assert!(st.success(), "mount {args:?}");
    };
    mount(&["-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", mnt.to_str().unwrap()]);
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let state = mnt.join("state");
    std::fs::create_dir(&state).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o711)).unwrap();
    mount(&["-o", "remount,ro", mnt.to_str().unwrap()]);
    assert!(op(&["keygen", "--out", dir.path.join("keys").to_str().unwrap()]).status.success());
    let config = dir.path.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "agent:\n  platform_public_key: {0}/keys/signing.pub\n  state_dir: {1}\n  socket: {0}/run/agent.sock\n\
             executors:\n  dir: {0}/executors\naudit:\n  path: {0}/audit/audit.jsonl\n",
            dir.path.display(),
            state.display()
        ),
    )
    .unwrap();
    // The agent must not start: it is killed (and the test fails) if it is still running.
    let mut child = common::command()
        .args(["agent", "--config", config.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the agent started with a state directory it cannot write");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot be written") && stderr.contains(state.to_str().unwrap()), "{stderr}");
}

#[test]
fn only_root_may_talk_to_the_agent_and_one_agent_per_socket() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(2);
    a.start();
    // A second agent with the same configuration is refused first thing, by the state
    // directory's lock, naming its holder — before it installs, compiles or starts anything.
    // (Two started at once had both found the socket stale; the second replaced the
    // first's socket, and stopping it took the socket from the agent that went on running.)
    let out = op(&["agent", "--config", a.config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let pid = a.child.as_ref().unwrap().id();
    assert!(
        stderr.contains("another agent runs with this state directory") && stderr.contains(&format!("pid {pid} ")),
        "{stderr}"
    );
    // One on the same socket with a state directory of its own: refused too, by the lock on
    // the socket's record of running commands, before it reads any (it would have taken the
    // running agent's commands for ones a dead agent left).
    let text = std::fs::read_to_string(&a.config).unwrap();
    let state = a.dir.path.join("state");
    let other = a.dir.path.join("other.yaml");
    let other_state = a.dir.path.join("other-state");
    std::fs::write(&other, text.replace(state.to_str().unwrap(), other_state.to_str().unwrap())).unwrap();
    let out = op(&["agent", "--config", other.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("another agent runs on this socket") && stderr.contains(&format!("pid {pid} ")),
        "{stderr}"
    );
    // The socket is root-only.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&a.socket).unwrap().permissions().mode() & 0o777, 0o600);
    let bytes = a.sign(&json!({"command_id": "nobody-1", "action": "ping"}));
    let as_nobody = || {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.args([
            "-c",
            &format!(
                "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({:?})\nexcept OSError as e:\n    print('refused', e.errno); sys.exit(0)\n\
                 try:\n    s.sendall(sys.stdin.buffer.read()); s.shutdown(socket.SHUT_WR); n = len(s.recv(65536))\nexcept OSError:\n    n = 0\nprint('reply', n)",
                a.socket.to_str().unwrap()
            ),
        ]);
        // SAFETY: setgid/setuid are async-signal-safe and affect only this child.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut c = cmd.spawn().unwrap();
        use std::io::Write;
        c.stdin.take().unwrap().write_all(&bytes).unwrap();
        String::from_utf8_lossy(&c.wait_with_output().unwrap().stdout).into_owned()
    };
    // The 0700 directory stops nobody at connect() …
    assert!(as_nobody().starts_with("refused 13"), "permission denied at connect");
    // … and were the socket reachable, the peer credentials would: no reply, audited.
    let dir = a.socket.parent().unwrap().to_path_buf();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&a.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(as_nobody().trim(), "reply 0");
    assert!(a.audit_events().iter().any(|e| e["fields"]["reason"] == "non_root_client"));
    assert!(a.audit_events().iter().all(|e| e["fields"]["command_id"] != "nobody-1"), "never handled");
    assert!(a.stop().success());
}

/// The socket's name cannot be taken by another user: a socket directory anyone may write
/// (here sticky and world-writable, as `/tmp`) is refused at start, and `opservant submit`
/// sends nothing to a listener that is neither root's nor the submitter's — one another user
/// bound first would have had the signed command and answered it "completed".
#[test]
fn the_socket_cannot_be_taken_by_another_user() {
    if !common::require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let a = Agent::new(1);
    let shared = a.config.with_file_name("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let text = std::fs::read_to_string(&a.config).unwrap();
    let config = a.config.with_file_name("shared.yaml");
    let socket = shared.join("agent.sock");
    std::fs::write(&config, text.replace(a.socket.to_str().unwrap(), socket.to_str().unwrap())).unwrap();
    for args in [vec!["agent", "--check-config"], vec!["agent"]] {
        let out = op(&[args.as_slice(), &["--config", config.to_str().unwrap()]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("the socket's directory must be the agent's alone"), "{args:?}: {stderr}");
        assert!(stderr.contains("writable by group or others"), "{args:?}: {stderr}");
    }
    assert!(!socket.exists(), "nothing bound");

    // A listener of nobody's, there first: it is sent nothing.
    let mut squatter = Command::new("/usr/bin/python3");
    squatter.args([
        "-c",
        &format!(
            "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind({:?})\ns.listen(1)\nprint('ready', flush=True)\n\
             c, _ = s.accept()\ndata = b''\nwhile True:\n    b = c.recv(65536)\n    if not b: break\n    data += b\n\
             print('got', len(data), flush=True)\ntry:\n    c.sendall(b'{{\"status\":\"completed\"}}')\nexcept OSError:\n    pass",
            socket.to_str().unwrap()
        ),
    ]);
    // SAFETY: setgid/setuid are async-signal-safe and affect only this child.
    unsafe {
        squatter.pre_exec(|| {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut squatter = squatter.stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(squatter.stdout.take().unwrap()));
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    let signed = a.config.with_file_name("squat.json");
    std::fs::write(&signed, a.sign(&json!({"command_id": "squat-1", "action": "ping"}))).unwrap();
    let out = op(&["submit", signed.to_str().unwrap(), "--socket", socket.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("runs as uid 65534") && stderr.contains("not an agent; nothing was sent"), "{stderr}");
    assert_eq!(lines.next().unwrap().unwrap(), "got 0", "the squatter was sent the command");
    let _ = squatter.wait();
}

/// The configuration file is held to the rule of the files it names (the keys commands are
/// checked with, …): whoever could write it could point the agent at a key, a socket or a
/// Vault server of their own. Refused (exit 2, naming it) for the agent and every root
/// command, when others may write it or another user owns it.
#[test]
fn a_configuration_file_others_could_change_is_refused() {
    if !common::require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let a = Agent::new(1);
    let c = a.config.to_str().unwrap();
    assert_eq!(op(&["agent", "--check-config", "--config", c]).status.code(), Some(0));
    let (uid, _) = common::executor_ids();
    for (what, change, needle) in [
        ("writable by others", 0o666u32, "is writable by others (mode 0666; chmod o-w)"),
        ("owned by another user", 0o644, &*format!("is owned by uid {uid}, not by root or the agent")),
    ] {
        std::fs::set_permissions(&a.config, std::fs::Permissions::from_mode(change)).unwrap();
        if what == "owned by another user" {
            std::os::unix::fs::chown(&a.config, Some(uid), None).unwrap();
        }
        for args in [vec!["agent", "--check-config", "--config", c], vec!["executor", "list", "--config", c]] {
            let out = op(&args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{what}: {args:?}: {stderr}");
            assert!(
                stderr.contains(&format!("{c}: the configuration file: {c} {needle}")),
                "{what}: {args:?}: {stderr}"
            );
        }
        std::os::unix::fs::chown(&a.config, Some(0), None).unwrap();
    }
    std::fs::set_permissions(&a.config, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(op(&["agent", "--check-config", "--config", c]).status.code(), Some(0));
}

/// The agent's `network:` section for `platform`, with its TLS files (from `agent_pki` for
/// the client certificate and `ca_pki` for the CA it trusts) in `dir`.
fn platform_network(
    dir: &Path,
    addr: std::net::SocketAddr,
    ca_pki: &platform::Pki,
    agent_pki: &platform::Pki,
) -> String {
    std::fs::create_dir_all(dir).unwrap();
    agent_pki.write_agent_files(dir);
    std::fs::write(dir.join("ca.pem"), &ca_pki.ca).unwrap();
    format!(
        "network:\n  agent_to_platform:\n    protocol: https\n    host: 127.0.0.1\n    port: {}\n    ca: {}\n    cert: {}\n    key: {}\n    poll_seconds: 1\n    heartbeat_seconds: 1\n",
        addr.port(),
        dir.join("ca.pem").display(),
        dir.join("agent.crt").display(),
        dir.join("agent.key").display()
    )
}

/// A test platform (one CA for both sides) and an agent, not started, that polls it
/// running `max_concurrent` commands at once; the directory holds the agent's TLS files.
fn platform_agent(max_concurrent: usize) -> (platform::TestPlatform, HostDir, Agent) {
    let pki = platform::Pki::new("good");
    let p = platform::TestPlatform::start(&pki, &pki);
    let tls = HostDir::new();
    let a = Agent::with_network(max_concurrent, &platform_network(&tls.path, p.addr, &pki, &pki));
    (p, tls, a)
}

/// A platform command whose run finished but whose result could not be posted before the
/// agent was killed (the platform answering 503, the agent retrying) is not lost either:
/// the next agent audits `result_undelivered` with the run's status and posts the platform
/// that status with reason `result_lost` — the record of the running command is kept until
/// its result is delivered, not only until its run ends (a review of the first version).
#[test]
fn a_platform_commands_result_lost_with_the_agent_is_reported() {
    if !common::require_root() {
        return;
    }
    let (p, _tls, mut a) = platform_agent(2);
    p.state.lock().unwrap().refuse_results = true;
    p.queue(serde_json::from_slice(&a.sign(&scan("lost-result-1"))).unwrap());
    a.start();
    p.wait_for(60, "a refused result post", |s| s.results_refused >= 1);
    assert!(
        a.audit_events()
            .iter()
            .any(|e| e["event"] == "executor_complete" && e["fields"]["command_id"] == "lost-result-1"),
        "the run ended before its result was posted"
    );
    let first_pid = a.child.as_ref().unwrap().id();
    // SAFETY: kill(2) of the agent this test started, not yet reaped.
    unsafe { libc::kill(first_pid as i32, libc::SIGKILL) };
    let _ = a.child.take().unwrap().wait();
    p.state.lock().unwrap().refuse_results = false;
    a.start();
    p.wait_for(60, "the lost result's report", |s| s.results.iter().any(|r| r["command_id"] == "lost-result-1"));
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    let r = st.results.iter().find(|r| r["command_id"] == "lost-result-1").unwrap();
    assert_eq!(
        (r["result"]["status"].clone(), r["result"]["reason"].clone()),
        (json!("completed"), json!("result_lost")),
        "{r}"
    );
    let events = a.audit_events();
    let undelivered = events
        .iter()
        .find(|e| e["event"] == "result_undelivered" && e["fields"]["command_id"] == "lost-result-1")
        .unwrap_or_else(|| panic!("no result_undelivered: {events:?}"));
    assert_eq!(undelivered["fields"]["status"], "completed", "{undelivered}");
    assert_eq!(undelivered["fields"]["agent_pid"], first_pid.to_string(), "{undelivered}");
    assert!(
        !events.iter().any(|e| e["event"] == "executor_fail" && e["fields"]["command_id"] == "lost-result-1"),
        "a run that finished is not reported as failed: {events:?}"
    );
}

/// A platform host `network.proxy.no_proxy` names is reached directly, not through
/// `network.proxy.https` (here a port nothing listens on: through it, every poll would fail).
#[test]
fn the_platform_is_reached_directly_when_no_proxy_names_it() {
    if !common::require_root() {
        return;
    }
    let pki = platform::Pki::new("good");
    let p = platform::TestPlatform::start(&pki, &pki);
    let tls = HostDir::new();
    let network = platform_network(&tls.path, p.addr, &pki, &pki)
        + "  proxy:\n    https: http://127.0.0.1:9\n    no_proxy: [\"192.0.2.0/24\", \"127.0.0.0/8\"]\n";
    let mut a = Agent::with_network(2, &network);
    p.queue(serde_json::from_slice(&a.sign(&scan("direct-1"))).unwrap());
    a.start();
    p.wait_for(60, "the command's result", |s| !s.results.is_empty());
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    assert_eq!(st.results[0]["result"]["status"], "completed", "{}", st.results[0]);
}

/// While the socket's commands fill every place (`agent.max_concurrent`), the agent takes
/// no command from the platform — one taken then could only be rejected as `overloaded`
/// (an audit record and a post each, and the platform may send it straight back) — and
/// takes it once a place is free.
#[test]
fn platform_commands_wait_while_socket_commands_fill_every_place() {
    if !common::require_root() {
        return;
    }
    let (p, _tls, mut a) = platform_agent(1);
    a.start();
    let slow = a.sign(
        &json!({"command_id": "sock-slow", "action": "execute", "executor": "slow", "parameters": {"seconds": 3}}),
    );
    std::thread::scope(|scope| {
        let first = scope.spawn(|| a.submit_within(&slow, Duration::from_secs(60)));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !a.audit_events().iter().any(|e| e["event"] == "executor_start") {
            assert!(Instant::now() < deadline, "the slow command did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Polled (every second) while the place is taken.
        p.queue(serde_json::from_slice(&a.sign(&scan("plat-while-busy"))).unwrap());
        let (code, r) = first.join().unwrap();
        assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    });
    p.wait_for(60, "the platform command's result", |s| !s.results.is_empty());
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    let r = &st.results[0]["result"];
    assert_eq!((r["command_id"].clone(), r["status"].clone()), (json!("plat-while-busy"), json!("completed")), "{r}");
    assert!(
        !a.audit_events().iter().any(|e| e["fields"]["reason"] == "overloaded"),
        "nothing was rejected as overloaded"
    );
}

/// A batch that arrives after the socket's commands took some of the places it was asked
/// for starts what fits at once, and the rest as places free up — not the whole batch once
/// all of it fits. Here: a poll asked for two commands with both places free, a slow socket
/// command took one while the poll was held, and the batch of two came back: the first
/// platform command runs while the slow one still does.
#[test]
fn a_platform_batch_starts_what_fits_at_once() {
    if !common::require_root() {
        return;
    }
    let (p, _tls, mut a) = platform_agent(2);
    p.state.lock().unwrap().hold_polls = true;
    a.start();
    let polls = || p.state.lock().unwrap().requests.iter().filter(|r| r.ends_with("/commands")).count();
    let deadline = Instant::now() + Duration::from_secs(10);
    while polls() == 0 {
        assert!(Instant::now() < deadline, "no poll");
        std::thread::sleep(Duration::from_millis(20));
    }
    let slow = a.sign(
        &json!({"command_id": "sock-slow", "action": "execute", "executor": "slow", "parameters": {"seconds": 4}}),
    );
    std::thread::scope(|scope| {
        let first = scope.spawn(|| a.submit_within(&slow, Duration::from_secs(60)));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !a.audit_events().iter().any(|e| e["event"] == "executor_start") {
            assert!(Instant::now() < deadline, "the slow command did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The poll held since before the slow command, asked for two: both come back now.
        let batch: Vec<Value> =
            ["plat-a", "plat-b"].iter().map(|id| serde_json::from_slice(&a.sign(&scan(id))).unwrap()).collect();
        {
            let mut st = p.state.lock().unwrap();
            st.raw_batches.push_back(json!({"commands": batch}).to_string());
            st.hold_polls = false;
        }
        let (code, r) = first.join().unwrap();
        assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    });
    p.wait_for(60, "both platform commands' results", |s| s.results.len() >= 2);
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    for r in st.results.iter().take(2) {
        assert_eq!(r["result"]["status"], "completed", "{r}");
    }
    // A platform command started while the slow one still ran (the old code started none
    // before the slow one had ended).
    let events = a.audit_events();
    let at = |event: &str, ids: &[&str]| {
        events.iter().position(|e| e["event"] == event && ids.iter().any(|id| e["fields"]["command_id"] == *id))
    };
    let (platform_start, slow_end) =
        (at("executor_start", &["plat-a", "plat-b"]), at("executor_complete", &["sock-slow"]));
    assert!(
        platform_start.is_some() && slow_end.is_some() && platform_start < slow_end,
        "the platform's commands waited for the slow socket command: {platform_start:?} {slow_end:?}"
    );
    assert!(
        !a.audit_events().iter().any(|e| e["fields"]["reason"] == "overloaded"),
        "nothing was rejected as overloaded"
    );
    drop(st);
    a.audit_verify();
}

#[test]
fn commands_pulled_from_the_platform_over_mutual_tls() {
    if !common::require_root() {
        return;
    }
    let (p, _tls, mut a) = platform_agent(4);
    let good = a.sign(&scan("plat-1"));
    let mut tampered: Value = serde_json::from_slice(&a.sign(&scan("plat-2"))).unwrap();
    tampered["parameters"]["ports"] = json!([22, 23]);
    p.queue(serde_json::from_slice(&good).unwrap());
    p.queue(tampered);
    a.start();
    p.wait_for(60, "two results", |s| s.results.len() >= 2);
    p.wait_for(10, "a heartbeat", |s| !s.heartbeats.is_empty());
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    let by_id = |id: &str| st.results.iter().find(|r| r["command_id"] == id).cloned().unwrap_or(Value::Null);
    let r1 = by_id("plat-1");
    assert_eq!(r1["result"]["status"], "completed", "{r1}");
    assert_eq!(r1["result"]["output"]["ports"][0]["status"], "closed");
    let r2 = by_id("plat-2");
    assert_eq!(
        (r2["result"]["status"].clone(), r2["result"]["reason"].clone()),
        (json!("rejected"), json!("bad_signature")),
        "{r2}"
    );
    let hb = &st.heartbeats[0];
    assert_eq!(hb["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(hb["build"], agent::app::BUILD, "{hb}");
    assert!(hb["executors"].as_array().unwrap().iter().any(|e| e == "port-scanner@1.0.0"), "{hb}");
    assert_eq!(hb["install_failures"], json!([]), "{hb}");
    let head = hb["audit"]["head"].clone();
    assert_eq!(
        hb["audit"],
        json!({"ok": true, "error": null, "since": null, "flush_failed": null, "head": head, "gap": null}),
        "the audit log's health: {hb}"
    );
    // The heartbeat carries the log's newest durable record as the agent made it (seq and
    // the SHA-256 of its line): the platform's copy of it is the log's anchor off the host.
    assert!(
        head["seq"].as_u64().is_some_and(|s| s >= 1) && head["sha256"].as_str().is_some_and(|h| h.len() == 64),
        "{hb}"
    );
    let sb = &hb["sandboxes"];
    assert_eq!(
        (&sb["launch"], &sb["zygote_running"], &sb["zygote_paused_s"], &sb["warm_pool"]),
        (&json!("zygote"), &json!(true), &Value::Null, &Value::Null),
        "{hb}"
    );
    // One prepared network namespace per command the agent runs at once; none failed.
    let stash = &sb["netns_stash"];
    assert!(stash["target"].as_u64().is_some_and(|t| t > 0) && stash["broken"].is_null(), "{hb}");
    assert!(stash["ready"].as_u64() <= stash["target"].as_u64(), "{hb}");
    assert!(st.requests.iter().all(|r| r.contains("/v1/agents/")), "{:?}", st.requests);
    drop(st);
    a.audit_verify();
}

#[test]
fn a_platform_that_does_not_hold_the_long_poll_is_not_polled_in_a_busy_loop() {
    if !common::require_root() {
        return;
    }
    let (p, _tls, mut a) = platform_agent(4);
    p.state.lock().unwrap().no_long_poll = true;
    a.start();
    let polls = || p.state.lock().unwrap().requests.iter().filter(|r| r.ends_with("/commands")).count();
    p.wait_for(30, "a first poll", |s| s.requests.iter().any(|r| r.ends_with("/commands")));
    let (first, since) = (polls(), Instant::now());
    std::thread::sleep(Duration::from_secs(3));
    let n = polls() - first;
    // At most one poll a second that brings nothing (before: one per round trip, hundreds).
    assert!(n <= since.elapsed().as_secs() as usize + 1, "{n} polls in {:?}", since.elapsed());
    // Commands still come through.
    p.queue(serde_json::from_slice(&a.sign(&scan("plat-nohold"))).unwrap());
    p.wait_for(30, "the result", |s| !s.results.is_empty());
    assert!(a.stop().success());
}

/// A connection that answers as the platform without its key (a compromised proxy or front
/// end) sends commands the agent refuses: each is audited, so as fast as they were refused
/// they would rotate every earlier record out of the log. Past 8 in a row the agent polls it
/// less and less often, one command at a time (and says so once per count), a command that
/// passes the checks resets that, and what such a command claims (id, action, executor: up
/// to 4 KiB each before) is recorded short.
#[test]
fn a_platform_connection_sending_commands_the_agent_refuses_is_polled_less_and_less() {
    if !common::require_root() {
        return;
    }
    let (p, _tls, mut a) = platform_agent(1);
    let long = |c: &str| c.repeat(3000);
    let tampered = |id: &str| {
        let mut t: Value = serde_json::from_slice(&a.sign(&scan(id))).unwrap();
        t["parameters"]["ports"] = json!([23]);
        t
    };
    let mut forged: Value = serde_json::from_slice(&a.sign(
        &json!({"command_id": format!("f1-{}", long("i")), "action": long("a"), "executor": long("e"), "parameters": {}}),
    ))
    .unwrap();
    forged["parameters"]["x"] = json!(1);
    let unsigned = json!({"command_id": "f2", "action": "execute", "executor": "port-scanner", "timestamp": ts(0)});
    let mut stale = scan("f3");
    stale["timestamp"] = json!(ts(-3600));
    let stale: Value = serde_json::from_slice(&a.sign(&stale)).unwrap();
    let mut elsewhere = scan("f4");
    elsewhere["agent_id"] = json!("another-agent");
    let elsewhere: Value = serde_json::from_slice(&a.sign(&elsewhere)).unwrap();
    let mut refused = vec![forged, unsigned, stale, elsewhere];
    refused.extend((5..=9).map(|i| tampered(&format!("f{i}"))));
    let issued: Value = serde_json::from_slice(&a.sign(&scan("plat-issued"))).unwrap();
    for c in refused.iter().chain([&issued, &tampered("f10")]) {
        p.state.lock().unwrap().raw_batches.push_back(json!({ "commands": [c] }).to_string());
    }
    a.start();
    // The poll after the last refused command: its count is settled.
    p.wait_for(120, "twelve polls", |s| s.results.len() >= 11 && s.polls_at.len() >= 12);
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    let reasons: Vec<_> =
        st.results.iter().map(|r| r["result"]["reason"].as_str().unwrap_or("-").to_string()).collect();
    assert_eq!(
        reasons,
        [
            "bad_signature",
            "unsigned",
            "clock_skew",
            "wrong_agent",
            "bad_signature",
            "bad_signature",
            "bad_signature",
            "bad_signature",
            "bad_signature",
            "-",
            "bad_signature"
        ],
        "{:?}",
        st.results
    );
    assert_eq!(st.results[9]["result"]["status"], "completed", "{}", st.results[9]);
    // One place: each poll comes after the previous command's result. After 8 refused
    // commands in a row the agent waits at least 1 s (2 s ± 50 %), after 9 at least 2 s;
    // before, it polled again at once.
    let waited = |k: usize| st.polls_at[k + 1].duration_since(st.results_at[k]);
    assert!(waited(7) >= Duration::from_secs(1), "polled again {:?} after 8 refused commands", waited(7));
    assert!(waited(8) >= Duration::from_secs(2), "polled again {:?} after 9 refused commands", waited(8));
    drop(st);
    let events = a.audit_events();
    let counts: Vec<_> = events
        .iter()
        .filter(|e| e["event"] == "security_event" && e["fields"]["reason"] == "platform_commands_refused")
        .map(|e| e["fields"]["in_a_row"].as_str().unwrap().to_string())
        .collect();
    // Said once per count; the issued command started the count again (the last refused
    // command is the first of a new run, below the backoff: not "10").
    assert_eq!(counts, ["8", "9"], "{events:?}");
    let claimed = |e: &Value, key: &str| e["fields"][key].as_str().unwrap().len();
    let received = events
        .iter()
        .find(|e| e["event"] == "command_received" && e["fields"]["command_id"].as_str().unwrap().starts_with("f1-"))
        .expect("the forged command's receipt");
    assert!(
        claimed(received, "command_id") < 300
            && claimed(received, "action") < 100
            && claimed(received, "executor") < 100,
        "{received}"
    );
    assert!(received["fields"]["executor"].as_str().unwrap().ends_with("bytes cut]"), "{received}");
    // The receipt says where it came from (what it says of itself is anyone's words).
    assert_eq!(received["fields"]["source"], "platform", "{received}");
    assert_eq!(received["fields"]["sha256"].as_str().unwrap().len(), 64, "{received}");
    let refusal = events
        .iter()
        .find(|e| e["event"] == "security_event" && e["fields"]["command_id"].as_str().unwrap().starts_with("f1-"))
        .expect("the forged command's rejection");
    assert!(claimed(refusal, "command_id") < 300, "{refusal}");
    a.audit_verify();
}

#[test]
fn a_platform_batch_is_taken_only_as_far_as_there_is_room() {
    if !common::require_root() {
        return;
    }
    // A batch of 200 entries (a 16 MiB body can hold millions) to an agent that runs 2
    // commands at once: 2 are taken and answered, the rest left for the platform to send
    // again, said once in the audit log — not a thread, a result and a security record each.
    let (p, _tls, mut a) = platform_agent(2);
    for _ in 0..200 {
        p.queue(json!(0));
    }
    a.start();
    p.wait_for(60, "the batch's first results", |s| s.results.len() >= 2);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(p.state.lock().unwrap().results.len(), 2);
    let events = a.audit_events();
    let refused = |reason: &str| {
        events.iter().filter(|e| e["event"] == "security_event" && e["fields"]["reason"] == reason).count()
    };
    assert_eq!(refused("malformed"), 2, "{events:?}");
    let batch =
        |e: &&Value| e["event"] == "platform_error" && e["fields"]["detail"].as_str().unwrap().contains("a batch");
    let left = events.iter().find(batch).expect("the batch's record");
    assert!(
        left["fields"]["detail"].as_str().unwrap().contains("a batch of 200 commands, 198 more than the 2"),
        "{left}"
    );
    // The next command still comes through.
    p.queue(serde_json::from_slice(&a.sign(&scan("plat-after-batch"))).unwrap());
    p.wait_for(60, "the next result", |s| s.results.iter().any(|r| r["command_id"] == "plat-after-batch"));
    assert!(a.stop().success());
    a.audit_verify();
}

#[test]
fn a_malformed_entry_in_a_platform_batch_is_refused_alone() {
    if !common::require_root() {
        return;
    }
    // One entry the strict parser refuses (a duplicate key) among signed commands: that
    // one is answered `malformed`, the others run — the old code refused the whole batch.
    let (p, _tls, mut a) = platform_agent(4);
    let (first, second) = (a.sign(&scan("batch-first")), a.sign(&scan("batch-second")));
    let body = format!(
        r#"{{"commands": [{}, {{"command_id": "dup", "command_id": "dup2", "action": "ping"}}, {}]}}"#,
        String::from_utf8(first).unwrap(),
        String::from_utf8(second).unwrap()
    );
    p.state.lock().unwrap().raw_batches.push_back(body);
    a.start();
    p.wait_for(60, "three results", |s| s.results.len() >= 3);
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    let status = |id: &str| {
        let r = st.results.iter().find(|r| r["command_id"] == id).unwrap_or_else(|| panic!("{id}: {:?}", st.results));
        r["result"]["status"].clone()
    };
    assert_eq!((status("batch-first"), status("batch-second")), (json!("completed"), json!("completed")));
    let refused =
        st.results.iter().find(|r| r["result"]["reason"] == "malformed").expect("the malformed entry's reply");
    assert_eq!(refused["result"]["status"], "rejected", "{refused}");
    drop(st);
    a.audit_verify();
}

#[test]
fn a_redirect_from_the_platform_is_not_followed() {
    if !common::require_root() {
        return;
    }
    // A front end that answers POST with 303 would turn the result into a GET of another
    // URL (ureq follows redirects by default): the result lost, yet counted as posted. The
    // agent follows no redirect: the post fails and is retried, and nothing else is asked.
    let (p, _tls, mut a) = platform_agent(2);
    p.state.lock().unwrap().redirect_posts = Some("/elsewhere".into());
    a.start();
    p.queue(serde_json::from_slice(&a.sign(&scan("plat-redirected"))).unwrap());
    let posts = |s: &platform::State| s.requests.iter().filter(|r| r.ends_with("/results")).count();
    let followed = |s: &platform::State| s.requests.iter().any(|r| r.contains("elsewhere"));
    p.wait_for(60, "the result posted twice", |s| posts(s) >= 2 || followed(s));
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    assert!(!followed(&st), "a redirect was followed: {:?}", st.requests);
    assert!(st.results.is_empty());
    drop(st);
    a.audit_verify();
}

#[test]
fn the_platform_refuses_a_client_certificate_from_another_ca() {
    if !common::require_root() {
        return;
    }
    let (pki, stranger) = (platform::Pki::new("good"), platform::Pki::new("stranger"));
    let p = platform::TestPlatform::start(&pki, &pki);
    p.queue(json!({"command_id": "never", "action": "ping"}));
    let tls = HostDir::new();
    // The agent trusts the right CA but presents a certificate the platform did not issue.
    let mut a = Agent::with_network(4, &platform_network(&tls.path, p.addr, &pki, &stranger));
    a.start();
    let deadline = Instant::now() + Duration::from_secs(20);
    while p.handshake_failures.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "no refused handshake seen");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The server sees the refusal before the agent has audited its side of it.
    while !a.audit_events().iter().any(|e| e["event"] == "platform_error") {
        assert!(Instant::now() < deadline, "the agent did not audit the refused handshake");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    assert!(st.requests.is_empty(), "no request got through: {:?}", st.requests);
    assert_eq!(st.queue.len(), 1, "the command was not handed out");
    drop(st);
    assert!(a.audit_events().iter().any(|e| e["event"] == "platform_error"));
    // And a client without any certificate (openssl s_client) is refused too.
    if common::require("openssl binary", Command::new("openssl").arg("version").output().is_ok()) {
        let before = p.handshake_failures.load(std::sync::atomic::Ordering::SeqCst);
        let out = Command::new("openssl")
            .args(["s_client", "-connect", &p.addr.to_string(), "-tls1_3", "-quiet"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let _ = out;
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.handshake_failures.load(std::sync::atomic::Ordering::SeqCst) == before {
            assert!(Instant::now() < deadline, "a client without a certificate was not refused");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(p.state.lock().unwrap().requests.is_empty());
    }
}

#[test]
fn the_agent_refuses_a_server_certificate_from_another_ca() {
    if !common::require_root() {
        return;
    }
    let (pki, impostor) = (platform::Pki::new("good"), platform::Pki::new("impostor"));
    // The server presents the impostor's certificate; it would accept the agent's.
    let p = platform::TestPlatform::start(&impostor, &pki);
    p.queue(json!({"command_id": "never", "action": "ping"}));
    let tls = HostDir::new();
    let mut a = Agent::with_network(4, &platform_network(&tls.path, p.addr, &pki, &pki));
    a.start();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !a.audit_events().iter().any(|e| e["event"] == "platform_error") {
        assert!(Instant::now() < deadline, "the agent did not report the bad certificate");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    assert!(st.requests.is_empty(), "the agent sent nothing to an unverified server: {:?}", st.requests);
    assert_eq!(st.queue.len(), 1);
    let detail = a.audit_events().into_iter().find(|e| e["event"] == "platform_error").unwrap();
    assert!(detail.to_string().to_lowercase().contains("certificate"), "{detail}");
}

/// The agent's view of the platform with `network.agent_to_platform.crl` at `crl`.
fn platform_network_with_crl(dir: &Path, p: &platform::TestPlatform, pki: &platform::Pki, crl: &Path) -> String {
    platform_network(dir, p.addr, pki, pki) + &format!("    crl: {}\n", crl.display())
}

/// Waits for an audited `platform_error` whose text holds `what` (lowercase); its text.
fn wait_for_platform_error(a: &Agent, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(e) = a
            .audit_events()
            .into_iter()
            .map(|e| e.to_string().to_lowercase())
            .find(|e| e.contains("platform_error") && e.contains(what))
        {
            return e;
        }
        let seen: Vec<Value> = a.audit_events().into_iter().filter(|e| e["event"] == "platform_error").collect();
        assert!(Instant::now() < deadline, "no platform_error saying {what:?}: {seen:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// With `network.agent_to_platform.crl`, a platform certificate its CA has revoked is
/// refused, and the file is read again when it changes — a connection checked against the
/// old file is not reused: the next poll after the platform's certificate is revoked fails
/// its handshake, and no command reaches the agent from then on.
#[test]
fn a_revoked_platform_certificate_is_refused_and_a_new_revocation_list_is_read_without_a_restart() {
    if !common::require_root() {
        return;
    }
    let pki = platform::Pki::new("good");
    let p = platform::TestPlatform::start(&pki, &pki);
    let tls = HostDir::new();
    let crl = tls.path.join("platform.crl");
    // Current, revoking another certificate (the agent's own: not the server's concern here).
    std::fs::write(&crl, pki.crl(&[platform::CLIENT_SERIAL], 2099)).unwrap();
    // No heartbeats after the first: the polls alone, one at a time, reuse their connection.
    let network =
        platform_network_with_crl(&tls.path, &p, &pki, &crl).replace("heartbeat_seconds: 1", "heartbeat_seconds: 3600");
    let mut a = Agent::with_network(2, &network);
    p.state.lock().unwrap().keep_alive = true;
    p.queue(serde_json::from_slice(&a.sign(&scan("crl-1"))).unwrap());
    a.start();
    p.wait_for(60, "the command's result", |s| !s.results.is_empty());
    assert_eq!(p.state.lock().unwrap().results[0]["result"]["status"], "completed");
    // Connections are kept alive and reused: the revoked certificate below is met only
    // because a connection checked against the old file is not reused.
    p.wait_for(20, "connections reused", |s| {
        s.requests.len() > p.connections.load(std::sync::atomic::Ordering::SeqCst) + 3
    });

    // The CA revokes the platform's certificate; the file is replaced as a refresh would.
    std::fs::write(tls.path.join("crl.new"), pki.crl(&[platform::CLIENT_SERIAL, platform::SERVER_SERIAL], 2099))
        .unwrap();
    std::fs::rename(tls.path.join("crl.new"), &crl).unwrap();
    let e = wait_for_platform_error(&a, "is revoked by a revocation list of network.agent_to_platform.crl");
    assert!(e.contains("certificate"), "{e}");
    p.queue(serde_json::from_slice(&a.sign(&scan("crl-2"))).unwrap());
    let requests = p.state.lock().unwrap().requests.len();
    std::thread::sleep(Duration::from_secs(4));
    assert!(a.stop().success());
    let st = p.state.lock().unwrap();
    assert_eq!((st.results.len(), st.queue.len()), (1, 1), "nothing more was taken from a revoked platform");
    assert_eq!(st.requests.len(), requests, "no request reached a revoked platform: {:?}", st.requests);
    drop(st);
    a.audit_verify();
}

/// A revocation list past its next update, or one of another CA (so the platform's
/// certificate's status is unknown), fails every connection; a file that is not a list, or
/// that another user could change, is a configuration error naming the key (exit 2).
#[test]
fn a_stale_foreign_or_bad_revocation_list_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    if !common::require_root() {
        return;
    }
    let (pki, other) = (platform::Pki::new("good"), platform::Pki::new("other"));
    let p = platform::TestPlatform::start(&pki, &pki);
    for (name, list, says) in [
        ("stale", pki.crl(&[], 2021), "revocation list is expired"),
        ("another CA's", other.crl(&[], 2099), "chain is not covered"),
    ] {
        let tls = HostDir::new();
        let crl = tls.path.join("platform.crl");
        std::fs::write(&crl, list).unwrap();
        let mut a = Agent::with_network(2, &platform_network_with_crl(&tls.path, &p, &pki, &crl));
        let log = tls.path.join("agent.log");
        a.start_logging_to(std::fs::File::create(&log).unwrap());
        let e = wait_for_platform_error(&a, says);
        assert!(a.stop().success(), "{name}");
        assert!(e.contains("certificate"), "{name}: {e}");
        // The stale list is in the agent's log from its start, not only in each failure.
        let log = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            log.contains("a certificate revocation list is stale, nearly so, or unreadable"),
            name == "stale",
            "{name}: {log}"
        );
    }
    assert!(p.state.lock().unwrap().requests.is_empty(), "{:?}", p.state.lock().unwrap().requests);

    let dir = HostDir::new();
    pki.write_agent_files(&dir.path);
    let crl = dir.path.join("platform.crl");
    let config =
        check_config_file(&dir.path, &(platform_section(&dir.path) + &format!("    crl: {}\n", crl.display())));
    let check = || op(&["agent", "--check-config", "--config", config.to_str().unwrap()]);
    std::fs::write(&crl, pki.crl(&[platform::SERVER_SERIAL], 2099)).unwrap();
    let out = check();
    assert!(out.status.success(), "a list: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("crl"), "{}", String::from_utf8_lossy(&out.stderr));
    // A list past its nextUpdate, or within a day of it, is a valid configuration that will
    // fail (or soon fail) every connection: said, exit 0.
    let (y, m, d) = agent::rfc3339::civil_from_days(agent::rfc3339::now().div_euclid(86_400) + 1);
    let tomorrow = format!("{y}-{m:02}-{d:02}T00:00:00Z");
    for (what, list, says) in [
        ("stale", pki.crl(&[], 2021), "revocation list was due to be replaced at 2021-01-01T00:00:00Z".to_string()),
        (
            "due tomorrow",
            pki.crl_until((y as i32, m as u8, d as u8)),
            format!("revocation list is due to be replaced at {tomorrow}"),
        ),
    ] {
        std::fs::write(&crl, list).unwrap();
        let out = check();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{what}: {stderr}");
        assert!(
            stderr.contains("warning: network.agent_to_platform.crl") && stderr.contains(&says),
            "{what}: {stderr}"
        );
    }
    let garbled = pki.crl(&[], 2099).replace("\nM", "\nX");
    // An older list left before a newer one (appended): the checker would use the first.
    let appended = pki.crl(&[], 2099) + &pki.crl(&[platform::SERVER_SERIAL], 2099);
    for (what, text, says) in [
        ("missing", None, "No such file"),
        ("two of one issuer", Some(appended), "revocation lists 1 and 2 are of the same issuer and scope"),
        ("a certificate", Some(pki.ca.clone()), "no certificate revocation list"),
        ("garbled", Some(garbled), "network.agent_to_platform.crl"),
    ] {
        let _ = std::fs::remove_file(&crl);
        if let Some(text) = text {
            std::fs::write(&crl, text).unwrap();
        }
        let out = check();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
        assert!(stderr.contains("network.agent_to_platform.crl") && stderr.contains(says), "{what}: {stderr}");
    }
    std::fs::write(&crl, pki.crl(&[], 2099)).unwrap();
    std::fs::set_permissions(&crl, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = check();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("network.agent_to_platform.crl"), "writable by others: {stderr}");
}

/// Revocation is checked for the whole chain below the CA: with the platform's certificate
/// signed by an intermediate CA, the root's list must cover (and not revoke) the
/// intermediate, and the intermediate's list the platform's certificate.
#[test]
fn revocation_is_checked_for_every_certificate_of_the_chain() {
    if !common::require_root() {
        return;
    }
    let pki = platform::Pki::with_intermediate("chain");
    let p = platform::TestPlatform::start(&pki, &pki);
    let both = pki.crl(&[], 2099) + &pki.intermediate_crl(&[], 2099);
    let intermediate_revoked = pki.crl(&[platform::INTERMEDIATE_SERIAL], 2099) + &pki.intermediate_crl(&[], 2099);
    for (what, list, says) in [
        ("the intermediate revoked", intermediate_revoked, Some("is revoked by a revocation list")),
        // The platform's certificate is covered, the intermediate is not: an end-entity-only
        // check would pass.
        ("no list of the root", pki.intermediate_crl(&[], 2099), Some("chain is not covered")),
        ("both lists, nothing revoked", both, None),
    ] {
        let tls = HostDir::new();
        let crl = tls.path.join("platform.crl");
        std::fs::write(&crl, list).unwrap();
        let mut a = Agent::with_network(2, &platform_network_with_crl(&tls.path, &p, &pki, &crl));
        match says {
            Some(says) => {
                a.start();
                wait_for_platform_error(&a, says);
                assert!(a.stop().success(), "{what}");
                assert!(p.state.lock().unwrap().requests.is_empty(), "{what}: {:?}", p.state.lock().unwrap().requests);
            }
            None => {
                p.queue(serde_json::from_slice(&a.sign(&scan("chain-1"))).unwrap());
                a.start();
                p.wait_for(60, "the command's result", |s| !s.results.is_empty());
                assert!(a.stop().success(), "{what}");
                assert_eq!(p.state.lock().unwrap().results[0]["result"]["status"], "completed", "{what}");
            }
        }
    }
}

/// `network.proxy.https` carries the platform connection (HTTP `CONNECT`), mutual TLS
/// end to end through it.
#[test]
fn the_platform_is_reached_through_the_configured_proxy() {
    if !common::require_root() {
        return;
    }
    let pki = platform::Pki::new("good");
    let p = platform::TestPlatform::start(&pki, &pki);
    let (proxy_port, connects) = common::connect_proxy();
    let tls = HostDir::new();
    let network = platform_network(&tls.path, p.addr, &pki, &pki)
        + &format!("  proxy:\n    https: http://127.0.0.1:{proxy_port}\n    no_proxy: [\"192.0.2.0/24\"]\n");
    let mut a = Agent::with_network(2, &network);
    p.queue(serde_json::from_slice(&a.sign(&scan("proxied-1"))).unwrap());
    a.start();
    p.wait_for(60, "the command's result", |s| !s.results.is_empty());
    assert!(a.stop().success());
    assert_eq!(p.state.lock().unwrap().results[0]["result"]["status"], "completed");
    let connects = connects.lock().unwrap();
    assert!(!connects.is_empty(), "nothing went through the proxy");
    assert!(connects.iter().all(|c| c == &format!("CONNECT 127.0.0.1:{} HTTP/1.1", p.addr.port())), "{connects:?}");
}

const HELLO_PY: &str = r#"from opservant.executor import BaseExecutor, ExecutorResult


class Hello(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        return ExecutorResult(status="completed", output={"version": VERSION})
"#;

/// A `hello` package of `version` packed as `parent/name` (tar.gz); its path.
fn hello_archive(parent: &Path, version: &str, name: &str) -> PathBuf {
    let dir = parent.join(format!("src-{name}"));
    std::fs::create_dir_all(dir.join("hello/hello")).unwrap();
    std::fs::write(dir.join("hello/hello/__init__.py"), "").unwrap();
    std::fs::write(dir.join("hello/hello/main.py"), format!("VERSION = {version:?}\n{HELLO_PY}")).unwrap();
    std::fs::write(
        dir.join("hello/manifest.json"),
        format!(
            r#"{{"name": "hello", "version": "{version}", "description": "test", "author": "t",
                 "supported_actions": ["act-hello"], "entry_point": "hello.main.Hello", "permissions": {{}}}}"#
        ),
    )
    .unwrap();
    let out = parent.join(name);
    let st = Command::new("tar")
        .args(["czf", out.to_str().unwrap(), "-C", dir.to_str().unwrap(), "hello"])
        .status()
        .unwrap();
    assert!(st.success());
    out
}

/// `opservant sign --key KEY --package PKG` (writes PKG.sig).
fn sign_package(key: &Path, pkg: &Path) {
    let out = op(&["sign", "--key", key.to_str().unwrap(), "--package", pkg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn install_cmd(id: &str, parameters: Value) -> Value {
    json!({"command_id": id, "action": "install_executor", "parameters": parameters})
}

#[test]
fn install_executor_downloads_over_mutual_tls_and_checks_before_unpacking() {
    if !common::require_root() {
        return;
    }
    let pki = platform::Pki::new("good");
    let p = platform::TestPlatform::start(&pki, &pki);
    let tls = HostDir::new();
    // Signatures required; the trusted key defaults to the platform key.
    let mut a = Agent::build(4, "", &platform_network(&tls.path, p.addr, &pki, &pki), |_| {
        "  require_signature: true\n  max_package_mb: 1\n".into()
    });
    let work = HostDir::new();
    let good = hello_archive(&work.path, "2.0.0", "hello-2.0.0.tar.gz");
    sign_package(&a.key, &good);
    let good_bytes = std::fs::read(&good).unwrap();
    let good_sha = sha256_hex(&good_bytes);
    p.serve_package("hello-2.0.0.tar.gz", good_bytes.clone());
    p.serve_package("hello-2.0.0.tar.gz.sig", std::fs::read(work.path.join("hello-2.0.0.tar.gz.sig")).unwrap());
    // Unsigned; signed by a key the agent does not trust; 2 MiB with max_package_mb: 1.
    let unsigned = std::fs::read(hello_archive(&work.path, "3.0.0", "unsigned.tar.gz")).unwrap();
    p.serve_package("unsigned.tar.gz", unsigned.clone());
    let stranger_keys = HostDir::new();
    assert!(op(&["keygen", "--out", stranger_keys.path.to_str().unwrap()]).status.success());
    let stranger = hello_archive(&work.path, "3.0.0", "stranger.tar.gz");
    sign_package(&stranger_keys.path.join("signing.key"), &stranger);
    let stranger_bytes = std::fs::read(&stranger).unwrap();
    p.serve_package("stranger.tar.gz", stranger_bytes.clone());
    p.serve_package("stranger.tar.gz.sig", std::fs::read(work.path.join("stranger.tar.gz.sig")).unwrap());
    let big: Vec<u8> = (0..2u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    p.serve_package("big.tar.gz", big.clone());
    a.start();

    // The genuine package, by a command pulled from the platform.
    p.queue(
        serde_json::from_slice(&a.sign(&install_cmd(
            "inst-1",
            json!({"name": "hello-2.0.0.tar.gz", "sha256": good_sha, "size": good_bytes.len()}),
        )))
        .unwrap(),
    );
    p.wait_for(60, "the install result", |s| s.results.iter().any(|r| r["command_id"] == "inst-1"));
    let r = p.state.lock().unwrap().results.iter().find(|r| r["command_id"] == "inst-1").cloned().unwrap();
    assert_eq!(r["result"]["status"], "completed", "{r}");
    assert_eq!(r["result"]["output"]["name"], "hello", "{r}");
    assert_eq!(r["result"]["output"]["version"], "2.0.0", "{r}");
    assert!(r["result"]["output"]["signed_by"].as_str().unwrap().ends_with("keys/signing.pub"), "{r}");
    let (code, run) = a.submit(&a.sign(&json!({"command_id": "run-1", "action": "execute", "executor": "hello"})));
    assert_eq!(code, 0, "{run}");
    assert_eq!(run["output"]["version"], "2.0.0", "{run}");

    // Refusals (through the socket; the download is the same mutual-TLS one).
    let refused = |id: &str, params: Value, reason: &str| {
        let (code, r) = a.submit(&a.sign(&install_cmd(id, params)));
        assert_eq!(code, 1, "{id}: {r}");
        assert_eq!((r["status"].as_str(), r["reason"].as_str()), (Some("rejected"), Some(reason)), "{id}: {r}");
        assert!(!r["error"].as_str().unwrap_or("").is_empty(), "{id}: a reason is given: {r}");
    };
    let zeros = "0".repeat(64);
    refused("bad-sha", json!({"name": "hello-2.0.0.tar.gz", "sha256": zeros}), "checksum");
    refused("big", json!({"name": "big.tar.gz", "sha256": sha256_hex(&big)}), "too_large");
    refused("declared-smaller", json!({"name": "hello-2.0.0.tar.gz", "sha256": good_sha, "size": 100}), "too_large");
    refused(
        "declared-larger",
        json!({"name": "hello-2.0.0.tar.gz", "sha256": good_sha, "size": good_bytes.len() + 1}),
        "invalid_package",
    );
    refused("unsigned", json!({"name": "unsigned.tar.gz", "sha256": sha256_hex(&unsigned)}), "unsigned_package");
    refused(
        "stranger",
        json!({"name": "stranger.tar.gz", "sha256": sha256_hex(&stranger_bytes)}),
        "bad_package_signature",
    );
    refused("absent", json!({"name": "absent.tar.gz", "sha256": zeros}), "download");
    refused("traversal", json!({"name": "../commands", "sha256": zeros}), "malformed");
    refused("no-sha", json!({"name": "hello-2.0.0.tar.gz"}), "malformed");
    refused("extra", json!({"name": "hello-2.0.0.tar.gz", "sha256": good_sha, "path": "/tmp/x"}), "malformed");
    // The same version again: refused, unless the command says `force` (a boolean).
    refused("again", json!({"name": "hello-2.0.0.tar.gz", "sha256": good_sha}), "already_installed");
    refused("force-text", json!({"name": "hello-2.0.0.tar.gz", "sha256": good_sha, "force": "yes"}), "malformed");
    let (code, r) = a.submit(
        &a.sign(&install_cmd("force", json!({"name": "hello-2.0.0.tar.gz", "sha256": good_sha, "force": true}))),
    );
    assert_eq!((code, r["status"].as_str()), (0, Some("completed")), "{r}");
    assert_eq!(
        (r["output"]["version"].as_str(), r["output"]["previous"].as_str()),
        (Some("2.0.0"), Some("2.0.0")),
        "{r}"
    );
    // Without Content-Length only the agent's read bound stops an oversize body.
    p.state.lock().unwrap().packages_without_length = true;
    refused("unbounded", json!({"name": "big.tar.gz", "sha256": sha256_hex(&big)}), "too_large");
    refused("unbounded-declared", json!({"name": "hello-2.0.0.tar.gz", "sha256": good_sha, "size": 100}), "too_large");
    assert!(a.stop().success());

    // Nothing of the refused ones installed or left behind; 2.0.0 current (installed again
    // by `force`, beside the first copy).
    let mut entries: Vec<String> = std::fs::read_dir(a.dir.path.join("executors"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    assert_eq!(entries, ["hello", "port-scanner", "slow"]);
    assert_eq!(std::fs::read_link(a.dir.path.join("executors/hello/current")).unwrap(), PathBuf::from("2.0.0~1"));
    let requests = p.state.lock().unwrap().requests.clone();
    assert!(requests.iter().any(|r| r.starts_with("GET /v1/agents/") && r.ends_with("/packages/hello-2.0.0.tar.gz")));
    assert!(!requests.iter().any(|r| r.contains("commands/packages") || r.contains("..")), "{requests:?}");

    // Each refusal audited with its reason; the chain verifies.
    let events = a.audit_events();
    let failed: Vec<(String, String)> = events
        .iter()
        .filter(|e| e["event"] == "executor_install_failed")
        .map(|e| (e["fields"]["command_id"].as_str().unwrap().into(), e["fields"]["reason"].as_str().unwrap().into()))
        .collect();
    for (id, reason) in [
        ("bad-sha", "checksum"),
        ("big", "too_large"),
        ("declared-smaller", "too_large"),
        ("unsigned", "unsigned_package"),
        ("stranger", "bad_package_signature"),
        ("absent", "download"),
        ("traversal", "malformed"),
        ("unbounded", "too_large"),
    ] {
        assert!(failed.contains(&(id.into(), reason.into())), "{id}: {failed:?}");
    }
    assert!(events.iter().any(|e| e["event"] == "executor_installed"
        && e["fields"]["command_id"] == "inst-1"
        && e["fields"]["source"] == "command"));
    assert!(events.iter().any(|e| e["event"] == "package_signature"
        && e["fields"]["command_id"] == "stranger"
        && e["fields"]["signature"] == "bad"));
    a.audit_verify();
}

/// A directory listed in `executors.install` is installed unattended at every start: each
/// of its entries must be root's or the agent's and writable by no one else, or the entry
/// fails (audited, reported) and the agent starts without it.
#[test]
fn a_configured_directory_another_user_could_change_is_not_installed() {
    if !common::require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mut a = Agent::build(1, "", "", |dir| {
        let pkgs = dir.join("pkgs");
        std::fs::create_dir_all(&pkgs).unwrap();
        hello_archive(&pkgs, "1.0.0", "ok.tar.gz");
        hello_archive(&pkgs, "2.0.0", "open.tar.gz");
        let open = pkgs.join("src-open.tar.gz/hello/hello/main.py");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        format!(
            "  install:\n    - {}\n    - {}\n",
            pkgs.join("src-ok.tar.gz/hello").display(),
            pkgs.join("src-open.tar.gz/hello").display()
        )
    });
    a.start();
    let (code, pong) = a.submit(&a.sign(&json!({"command_id": "p1", "action": "ping"})));
    assert!(a.stop().success());
    assert_eq!(code, 0, "{pong}");
    assert!(pong["output"]["executors"].as_array().unwrap().iter().any(|e| e == "hello@1.0.0"), "{pong}");
    let failures = pong["output"]["install_failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1, "{pong}");
    assert_eq!(failures[0]["entry"], "executors.install[1]", "{pong}");
    let error = failures[0]["error"].as_str().unwrap();
    assert!(error.contains("hello/main.py: owned by uid 0 with mode 0666: another user could change it"), "{pong}");
}

#[test]
fn install_executor_without_a_platform_is_refused() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(2);
    a.start();
    let (code, r) = a.submit(&a.sign(&install_cmd("np", json!({"name": "x.tar.gz", "sha256": "a".repeat(64)}))));
    assert_eq!((code, r["reason"].as_str()), (1, Some("no_platform")), "{r}");
    assert!(a.stop().success());
}

#[test]
fn executors_listed_in_the_config_are_installed_at_start_once() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::build(2, "", "", |dir| {
        let pkgs = dir.join("pkgs");
        std::fs::create_dir_all(&pkgs).unwrap();
        let signed = hello_archive(&pkgs, "1.0.0", "hello-1.0.0.tar.gz");
        sign_package(&dir.join("keys/signing.key"), &signed);
        // A directory (cannot be signed), a missing archive, and a signed archive others may
        // write (they would choose what the agent installs at every start): each refused,
        // audited, skipped.
        std::fs::create_dir_all(pkgs.join("plain")).unwrap();
        let open = hello_archive(&pkgs, "1.1.0", "open-1.1.0.tar.gz");
        sign_package(&dir.join("keys/signing.key"), &open);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        format!(
            "  require_signature: true\n  install:\n    - {}\n    - {}\n    - {}\n    - {}\n",
            signed.display(),
            pkgs.join("plain").display(),
            pkgs.join("absent.tar.gz").display(),
            open.display()
        )
    });
    let c = a.config.to_str().unwrap().to_string();
    // --check-config: usable (exit 0), the two bad entries named as warnings.
    let out = op(&["agent", "--check-config", "--config", &c]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("executors.install[1]") && stderr.contains("a directory cannot be signed"), "{stderr}");
    assert!(stderr.contains("executors.install[2]"), "{stderr}");
    assert!(stderr.contains("executors.install[3]") && stderr.contains("is writable by others (mode 0666"), "{stderr}");
    assert!(!stderr.contains("executors.install[0]"), "{stderr}");

    let count = |a: &Agent, event: &str| a.audit_events().iter().filter(|e| e["event"] == event).count();
    a.start();
    let (code, pong) = a.submit(&a.sign(&json!({"command_id": "p1", "action": "ping"})));
    assert_eq!(code, 0, "{pong}");
    assert!(pong["output"]["executors"].as_array().unwrap().iter().any(|e| e == "hello@1.0.0"), "{pong}");
    // The entries that failed are reported (in heartbeats too), not only logged and audited.
    let failures = pong["output"]["install_failures"].as_array().unwrap();
    assert_eq!(failures.len(), 3, "{pong}");
    assert!(failures[2]["error"].as_str().unwrap().contains("is writable by others"), "{pong}");
    assert_eq!(
        (failures[0]["entry"].as_str(), failures[1]["entry"].as_str()),
        (Some("executors.install[1]"), Some("executors.install[2]"))
    );
    assert!(failures[0]["error"].as_str().unwrap().contains("a directory cannot be signed"), "{pong}");
    assert_eq!(count(&a, "executor_installed"), 3, "two by hand, one from the config");
    let failed: Vec<Value> = a.audit_events().into_iter().filter(|e| e["event"] == "executor_install_failed").collect();
    assert_eq!(failed.len(), 3, "{failed:?}");
    assert_eq!(failed[0]["fields"]["entry"], "executors.install[1]");
    assert_eq!(failed[1]["fields"]["entry"], "executors.install[2]");
    assert_eq!(failed[2]["fields"]["entry"], "executors.install[3]");
    assert!(a.stop().success());

    // Installed with its bytecode; one installed by an older agent, without it, gets it at
    // the next start, in place.
    let pyc = a.dir.path.join("executors/hello/1.0.0/hello/__pycache__/main.cpython-311.pyc");
    assert!(pyc.is_file());
    std::fs::remove_dir_all(pyc.parent().unwrap()).unwrap();
    // Started again: the same version with the same content is left alone.
    a.start();
    assert!(a.stop().success());
    assert!(pyc.is_file(), "bytecode not precompiled at start");
    assert_eq!(count(&a, "executor_installed"), 3, "nothing reinstalled");
    assert_eq!(count(&a, "executor_install_failed"), 6);
    let hello_dir = a.dir.path.join("executors/hello");
    let versions = || {
        let mut v: Vec<String> = std::fs::read_dir(&hello_dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(versions(), ["1.0.0", "current"]);

    // A newer version installed since (by hand here) is never downgraded by the config.
    let v2 = hello_archive(&a.dir.path.join("pkgs"), "2.0.0", "hello-2.0.0.tar.gz");
    sign_package(&a.key, &v2);
    let out = op(&["executor", "install", v2.to_str().unwrap(), "--config", &c]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    a.start();
    assert!(a.stop().success());
    assert_eq!(std::fs::read_link(a.dir.path.join("executors/hello/current")).unwrap(), PathBuf::from("2.0.0"));
    assert_eq!(count(&a, "executor_installed"), 4, "only the one by hand");

    // Nor when the newer version no longer loads (its manifest broken since): it is judged
    // by its directory's name. (1.0.0 is gone by now: an install keeps the previous version.)
    let v3 = hello_archive(&a.dir.path.join("pkgs"), "3.0.0", "hello-3.0.0.tar.gz");
    sign_package(&a.key, &v3);
    let out = op(&["executor", "install", v3.to_str().unwrap(), "--config", &c]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(versions(), ["2.0.0", "3.0.0", "current"]);
    std::fs::write(a.dir.path.join("executors/hello/3.0.0/manifest.json"), "{").unwrap();
    a.start();
    assert!(a.stop().success());
    assert_eq!(std::fs::read_link(a.dir.path.join("executors/hello/current")).unwrap(), PathBuf::from("3.0.0"));
    assert_eq!(versions(), ["2.0.0", "3.0.0", "current"]);
    assert_eq!(count(&a, "executor_installed"), 5, "only the ones by hand");
    a.audit_verify();
}

/// The audit log's disk fills up: runs are refused (their start cannot be recorded), `ping`
/// and heartbeats say the log is failing, since when and why; once there is room again the
/// idle agent's heartbeats say so (it tries the log itself, recording the outage) and runs
/// go on. (A disk that refuses writes outright is `vm_storage_faults`' part.)
#[test]
fn a_full_audit_disk_refuses_runs_is_reported_and_an_idle_agent_sees_it_recover() {
    if !common::require_root() {
        return;
    }
    // Heartbeats to a test platform every second: what an idle agent reports.
    let (p, _tls, mut a) = platform_agent(2);
    // The log on a small filesystem of its own (the installs' records stay beneath it).
    let audit = a.dir.path.join("audit");
    let st = Command::new("mount").args(["-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs"]).arg(&audit).status();
    assert!(st.unwrap().success(), "mount a tmpfs");
    // Lazily: on a failure it goes before the agent, which still holds the log open.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(audit.clone());
    let health = |a: &Agent, id: &str| {
        let (code, pong) = a.submit(&a.sign(&json!({"command_id": id, "action": "ping"})));
        assert_eq!(code, 0, "{pong}");
        pong["output"]["audit"].clone()
    };
    a.start();
    let (code, r) = a.submit(&a.sign(&scan("full-before")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    let ok = health(&a, "full-ping-1");
    assert_eq!(
        (ok["ok"].clone(), ok["error"].clone(), ok["flush_failed"].clone()),
        (json!(true), Value::Null, Value::Null)
    );
    // Filled to the last block.
    let filler = audit.join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    use std::io::Write;
    while f.write_all(&[0u8; 4096]).is_ok() {}
    let _ = f.write_all(&[0u8; 1]);
    drop(f);
    // The log's last page may still hold a few records (tmpfs allocates whole pages): runs
    // go on until it is full, then every one is refused.
    let first_refused = (1..=40)
        .find(|n| a.submit(&a.sign(&scan(&format!("full-fill-{n}")))).1["status"] != "completed")
        .expect("a run refused once the log's last page is full");
    for id in ["full-1", "full-2"] {
        let (code, r) = a.submit(&a.sign(&scan(id)));
        assert_ne!(code, 0, "{id} (after {first_refused} runs): {r}");
        assert_eq!((r["status"].as_str(), r["reason"].as_str()), (Some("rejected"), Some("cannot_run")), "{id}: {r}");
        assert!(r["error"].as_str().unwrap().contains("No space left on device"), "{id}: {r}");
    }
    let failing = health(&a, "full-ping-2");
    assert_eq!(failing["ok"], false, "{failing}");
    assert!(failing["error"].as_str().unwrap().contains("No space left on device"), "{failing}");
    let since = failing["since"].as_str().unwrap().to_string();
    assert!(since.ends_with('Z'), "{failing}");
    // Still the same run of failures: `since` stays.
    let (_, r) = a.submit(&a.sign(&scan("full-3")));
    assert_eq!(r["reason"], "cannot_run", "{r}");
    assert_eq!(health(&a, "full-ping-3")["since"].as_str(), Some(since.as_str()));
    // Room again: an idle agent finds out by itself — no command comes, yet within ten
    // seconds of the last failure its heartbeats say the log is well, the outage recorded.
    std::fs::remove_file(&filler).unwrap();
    let beats = p.state.lock().unwrap().heartbeats.len();
    p.wait_for(60, "a heartbeat saying the log is well again", |s| {
        s.heartbeats[beats..].iter().any(|hb| hb["audit"]["ok"] == true)
    });
    let st = p.state.lock().unwrap();
    let first_ok = st.heartbeats[beats..].iter().position(|hb| hb["audit"]["ok"] == true).unwrap();
    for hb in &st.heartbeats[beats..beats + first_ok] {
        assert_eq!(hb["audit"]["since"].as_str(), Some(since.as_str()), "{hb}");
    }
    drop(st);
    let resumed: Vec<Value> = a.audit_events().into_iter().filter(|e| e["event"] == "audit_resumed").collect();
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    assert_eq!(resumed[0]["fields"]["failing_since"].as_str(), Some(since.as_str()), "{resumed:?}");
    assert!(resumed[0]["fields"]["last_error"].as_str().unwrap().contains("No space left on device"), "{resumed:?}");
    let (code, r) = a.submit(&a.sign(&scan("full-after")));
    assert_eq!((code, r["status"].clone()), (0, json!("completed")), "{r}");
    let ok = health(&a, "full-ping-4");
    assert_eq!((ok["ok"].clone(), ok["error"].clone()), (json!(true), Value::Null), "{ok}");
    assert!(a.stop().success());
    a.audit_verify();
}

/// The files the agent trusts for what it lets in — the key commands are verified with, the
/// keys packages are, the platform's CA and the agent's own certificate — must be changeable
/// by root or the agent alone: whoever else could replace the command key could sign
/// commands of their own, `install_executor` included. A file another user owns, one a group
/// of users or everyone may write, one in a directory everyone may write: each refused at
/// start and by `--check-config` (exit 2, naming the setting and the file), and left as it is.
#[test]
fn files_the_agent_trusts_must_be_changeable_by_root_alone() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !common::require_root() {
        return;
    }
    let (_platform, tls, a) = platform_agent(2);
    let c = a.config.to_str().unwrap().to_string();
    let check = || op(&["agent", "--check-config", "--config", &c]);
    let refused = |what: &str, needle: &str, path: &Path| {
        for args in [vec!["agent", "--check-config", "--config", &c], vec!["agent", "--config", &c]] {
            let out = daemon::op_ending(&args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{what}: {args:?}: {stderr}");
            assert!(
                stderr.contains(what) && stderr.contains(needle) && stderr.contains(path.to_str().unwrap()),
                "{what}: {stderr}"
            );
        }
    };
    let out = check();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Packages checked with the command key (no executors.trusted_keys): said.
    let shared = "packages are checked with the key commands are verified with";
    assert!(String::from_utf8_lossy(&out.stderr).contains(shared), "{}", String::from_utf8_lossy(&out.stderr));
    let mode = |f: &Path| std::fs::metadata(f).unwrap().mode() & 0o7777;
    // Another user and a group of users (any group but root's may not write these files).
    let (uid, gid) = (4242, 4242);
    let public = a.dir.path.join("keys/signing.pub");
    let trusted = a.dir.file("package.pub", &std::fs::read_to_string(&public).unwrap(), 0o644);
    let text = std::fs::read_to_string(&a.config).unwrap();
    std::fs::write(
        &a.config,
        text.replacen("executors:\n", &format!("executors:\n  trusted_keys: [{}]\n", trusted.display()), 1),
    )
    .unwrap();
    assert!(check().status.success(), "{}", String::from_utf8_lossy(&check().stderr));
    for (what, file) in [
        ("agent.platform_public_key", public.clone()),
        ("executors.trusted_keys[0]", trusted.clone()),
        ("network.agent_to_platform.ca", tls.path.join("ca.pem")),
        ("network.agent_to_platform.cert", tls.path.join("agent.crt")),
    ] {
        let was = mode(&file);
        for (bits, needle) in [(0o002, "writable by others"), (0o020, "writable by its group")] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(was | bits)).unwrap();
            if bits == 0o020 {
                // Root's group may write it (as a system group may); a group of users may not.
                assert!(check().status.success(), "{what}: {}", String::from_utf8_lossy(&check().stderr));
                std::os::unix::fs::chown(&file, None, Some(gid)).unwrap();
            }
            refused(what, needle, &file);
            assert_eq!(mode(&file), was | bits, "{what}: left as it is");
            std::os::unix::fs::chown(&file, None, Some(0)).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(was)).unwrap();
        }
        std::os::unix::fs::chown(&file, Some(uid), None).unwrap();
        refused(what, "owned by uid", &file);
        std::os::unix::fs::chown(&file, Some(0), None).unwrap();
    }
    // An access ACL letting another user write (mode 0664 shows only its mask, root's group):
    // user::rw-, user:4242:rw-, group::r--, mask::rw-, other::r-- in the kernel's xattr form.
    let mut acl = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in
        [(0x01u16, 6u16, u32::MAX), (0x02, 6, 4242), (0x04, 4, u32::MAX), (0x10, 6, u32::MAX), (0x20, 4, u32::MAX)]
    {
        acl.extend(tag.to_le_bytes());
        acl.extend(perm.to_le_bytes());
        acl.extend(id.to_le_bytes());
    }
    let c_public = std::ffi::CString::new(public.to_str().unwrap()).unwrap();
    // SAFETY: NUL-terminated names and a buffer of `acl.len()` bytes, all alive for the call.
    let set = unsafe {
        libc::setxattr(c_public.as_ptr(), c"system.posix_acl_access".as_ptr(), acl.as_ptr().cast(), acl.len(), 0)
    };
    assert_eq!(set, 0, "setxattr: {}", std::io::Error::last_os_error());
    assert_eq!(mode(&public), 0o664, "the ACL's mask as the group bits");
    refused("agent.platform_public_key", "access ACL", &public);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::removexattr(c_public.as_ptr(), c"system.posix_acl_access".as_ptr()) }, 0);
    std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o644)).unwrap();
    // A directory on the way that everyone may write, without the sticky bit.
    let keys = a.dir.path.join("keys");
    let was = mode(&keys);
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused("agent.platform_public_key", "writable by others without the sticky bit", &keys);
    // One that a group of users may write: below gid 1000, but every user's (`users`, gid
    // 100 on Debian; openSUSE makes it each user's own group).
    let users = nix::unistd::Group::from_name("users").unwrap().expect("a group named users").gid;
    std::os::unix::fs::chown(&keys, None, Some(users.as_raw())).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o775)).unwrap();
    refused("agent.platform_public_key", "which is not a system group", &keys);
    std::os::unix::fs::chown(&keys, None, Some(0)).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(was)).unwrap();
    assert!(check().status.success(), "{}", String::from_utf8_lossy(&check().stderr));
    // A package key of its own: no warning.
    let own = a.dir.path.join("package-keys");
    assert!(op(&["keygen", "--out", own.to_str().unwrap()]).status.success());
    let text = std::fs::read_to_string(&a.config).unwrap();
    std::fs::write(&a.config, text.replace(trusted.to_str().unwrap(), own.join("signing.pub").to_str().unwrap()))
        .unwrap();
    let out = check();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stderr).contains(shared), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn the_agent_never_deletes_a_non_socket_nor_chmods_a_directory_it_did_not_create() {
    use std::os::unix::fs::PermissionsExt;
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(2);
    let text = std::fs::read_to_string(&a.config).unwrap();
    let c = a.config.to_str().unwrap().to_string();
    let socket_line = format!("socket: {}", a.socket.display());
    assert!(text.contains(&socket_line));
    let refused = |what: &str, needle: &str, path: &Path| {
        for args in [vec!["agent", "--check-config", "--config", &c], vec!["agent", "--config", &c]] {
            let out = daemon::op_ending(&args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{what}: {args:?}: {stderr}");
            assert!(stderr.contains(needle) && stderr.contains(path.to_str().unwrap()), "{what}: {stderr}");
        }
    };

    // agent.socket naming a regular file: refused, the file kept.
    let precious = a.dir.file("precious.txt", "keep me\n", 0o644);
    std::fs::write(&a.config, text.replace(&socket_line, &format!("socket: {}", precious.display()))).unwrap();
    refused("a regular file", "not a socket", &precious);
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep me\n");

    // agent.state_dir naming a regular file: refused before the agent starts.
    let state_line = format!("state_dir: {}", a.dir.path.join("state").display());
    assert!(text.contains(&state_line));
    std::fs::write(&a.config, text.replace(&state_line, &format!("state_dir: {}", precious.display()))).unwrap();
    refused("state_dir", "agent.state_dir", &precious);
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep me\n");

    // A state directory others can write (who could then delete the replay index, or plant
    // a link at its name) or that another user owns: refused, left as it is.
    let state = a.dir.path.join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(&a.config, &text).unwrap();
    for mode in [0o777, 0o1777, 0o770] {
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(mode)).unwrap();
        refused("a state dir others can write", "writable by group or others", &state);
        assert_eq!(std::fs::metadata(&state).unwrap().permissions().mode() & 0o7777, mode);
    }
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (uid, gid) = common::executor_ids();
    std::os::unix::fs::chown(&state, Some(uid), Some(gid)).unwrap();
    refused("a state dir another user owns", "owned by uid", &state);
    std::os::unix::fs::chown(&state, Some(0), Some(0)).unwrap();

    // A socket in a directory that exists and others may write (shared, like /tmp):
    // refused, and its mode left alone (`the_socket_cannot_be_taken_by_another_user`).
    let shared = a.dir.path.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::write(&a.config, text.replace(&socket_line, &format!("socket: {}", shared.join("agent.sock").display())))
        .unwrap();
    refused("a shared socket directory", "writable by group or others", &shared);
    assert_eq!(std::fs::metadata(&shared).unwrap().permissions().mode() & 0o7777, 0o1777);
    // One that exists and is the agent's: used, its mode left alone.
    let own = a.dir.path.join("own");
    std::fs::create_dir(&own).unwrap();
    std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o755)).unwrap();
    a.socket = own.join("agent.sock");
    std::fs::write(&a.config, text.replace(&socket_line, &format!("socket: {}", a.socket.display()))).unwrap();
    a.start();
    assert_eq!(std::fs::metadata(&a.socket).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(a.stop().success());
    assert_eq!(std::fs::metadata(&own).unwrap().permissions().mode() & 0o7777, 0o755);

    // A directory the agent creates is 0700.
    a.socket = a.dir.path.join("fresh/run/agent.sock");
    std::fs::write(&a.config, text.replace(&socket_line, &format!("socket: {}", a.socket.display()))).unwrap();
    a.start();
    assert_eq!(std::fs::metadata(a.socket.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
    assert!(a.stop().success());
}
