//! `opservant sandbox` and `opservant doctor`: the command-line contract of DESIGN.md §4–§5
//! (exit status, output layout, result shape, errors on bad input).

mod common;

use common::sha256_hex;

use std::process::{Command, Stdio};

use common::{manifest, require_root, sandbox, sh, try_sandbox, HostDir};

fn run_cli(args: &[&str]) -> (i32, String, String) {
    let out = common::command().args(args).stdin(Stdio::null()).output().expect("spawn opservant");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn reading_shadow_fails_and_the_json_says_so() {
    if !require_root() {
        return;
    }
    let (code, stdout, _) = run_cli(&["sandbox", "--", "/bin/sh", "-c", "cat /etc/shadow"]);
    assert_eq!(code, 1, "ran but did not complete → exit 1");
    let last = stdout.lines().last().expect("result line");
    let json: serde_json::Value = serde_json::from_str(last).expect("last line is the result JSON");
    assert_eq!(json["status"], "failed");
    assert_eq!(json["exit_code"], 1);
    assert!(json["stderr"].as_str().unwrap().contains("/etc/shadow: Permission denied"), "{json}");
    assert!(json["error"].as_str().unwrap().contains("status 1"));
}

#[test]
fn program_output_then_json_on_the_last_line() {
    if !require_root() {
        return;
    }
    // No trailing newline from the program: the JSON must still be a line of its own.
    let (code, stdout, _) = run_cli(&["sandbox", "--", "/bin/sh", "-c", "echo first; printf partial"]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "first");
    assert_eq!(lines[1], "partial");
    let json: serde_json::Value = serde_json::from_str(lines[2]).expect("JSON line");
    assert_eq!(json["status"], "completed");
    assert_eq!(json["stdout"], "first\npartial");
    assert_eq!(lines.len(), 3);
}

/// The program's output reaches a terminal with its control characters but newline and tab
/// escaped: it cannot hide the result line that follows (`ESC[8m`), overwrite it, or drive
/// the terminal. Into a pipe it goes byte for byte. `script` gives the command a terminal.
#[test]
fn program_output_reaches_a_terminal_without_its_control_characters() {
    if !require_root() {
        return;
    }
    let program =
        r"printf 'before\033[8m\rafter\tend\n'; printf 'err\033]2;owned\007\n' >&2; printf 'c1:\302\2338m \302\251\n'";
    let command = format!("{} sandbox -- /bin/sh -c \"{program}\"", common::opservant());
    let out = Command::new("script")
        .args(["-qefc", &command, "/dev/null"])
        .env("OPSERVANT_CONFIG", common::test_config())
        .env_remove("OPSERVANT_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("script (util-linux)");
    let seen = String::from_utf8_lossy(&out.stdout);
    assert!(seen.contains("before\\x1b[8m\\x0dafter\tend"), "{seen}");
    assert!(seen.contains("err\\x1b]2;owned\\x07"), "{seen}");
    // C1 controls as UTF-8 writes them (CSI here), escaped too; other text (©) kept.
    assert!(seen.contains("c1:\\xc2\\x9b8m \u{a9}"), "{seen}");
    assert!(!seen.contains('\u{9b}'), "{seen}");
    // (The agent's own log lines, coloured on a terminal, are not the program's.)
    let program_lines = seen
        .lines()
        .filter(|l| !l.starts_with('{') && (l.contains("before") || l.contains("owned") || l.contains("c1:")));
    assert!(program_lines.clone().count() == 3, "{seen}");
    assert!(program_lines.clone().all(|l| !l.contains('\u{1b}') && !l.contains('\u{7}')), "{seen}");
    // The result itself has the bytes as they were written.
    let last = seen.lines().rev().find(|l| l.starts_with('{')).expect("result line");
    let json: serde_json::Value = serde_json::from_str(last.trim_end()).expect("result JSON");
    assert_eq!(json["stdout"], "before\u{1b}[8m\rafter\tend\nc1:\u{9b}8m \u{a9}\n", "{json}");
    // Into a pipe, byte for byte.
    let (code, stdout, stderr) = run_cli(&["sandbox", "--", "/bin/sh", "-c", program]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.starts_with("before\u{1b}[8m\rafter\tend\n"), "{stdout}");
    assert!(stderr.contains("err\u{1b}]2;owned\u{7}"), "{stderr}");
}

/// The sandbox's PID 1 (its init) does not show the command line that started it: a cold
/// monitor is a fork of the CLI, whose arguments (here a marker) would otherwise be
/// readable by every process in the sandbox as `/proc/1/cmdline`.
#[test]
fn the_cli_arguments_are_not_pid_1s_command_line() {
    if !require_root() {
        return;
    }
    let dir = HostDir::new();
    let m = manifest(&dir, "{}", "{}");
    let marker = m.to_str().unwrap();
    let (code, stdout, stderr) =
        run_cli(&["sandbox", "--json", "--manifest", marker, "--", "/bin/cat", "/proc/1/cmdline"]);
    assert_eq!(code, 0, "{stdout} {stderr}");
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    let cmdline = json["stdout"].as_str().unwrap();
    assert!(cmdline.starts_with("opservant: sandbox\0"), "{cmdline:?}");
    assert!(!cmdline.contains(marker) && !cmdline.contains("--json"), "{cmdline:?}");
}

#[test]
fn json_flag_prints_only_the_result() {
    if !require_root() {
        return;
    }
    let (code, stdout, _) = run_cli(&["sandbox", "--json", "--", "/bin/echo", "hello"]);
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).expect("stdout is exactly one JSON object");
    assert_eq!(json["stdout"], "hello\n");
}

#[test]
fn result_has_the_design_shape() {
    if !require_root() {
        return;
    }
    let r = sandbox(None, &["/bin/true"]);
    assert_eq!(r.code, 0);
    let j = &r.json;
    for key in [
        "status",
        "output",
        "error",
        "artifacts",
        "executor",
        "action",
        "command_id",
        "stdout",
        "stderr",
        "exit_code",
        "killed_by",
        "limits",
        "usage",
        "sandbox",
    ] {
        assert!(j.get(key).is_some(), "missing {key}: {j}");
    }
    assert_eq!(j["status"], "completed");
    assert!(j["output"].is_object() && j["output"].as_object().unwrap().is_empty());
    assert!(j["error"].is_null() && j["killed_by"].is_null());
    assert!(j["limits"]["clamped"].is_array());
    for key in ["wall_ms", "cpu_ms", "peak_memory_bytes"] {
        assert!(j["usage"].get(key).is_some(), "usage.{key}");
    }
    let s = &j["sandbox"];
    let ns: Vec<&str> = s["namespaces"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(ns, ["user", "mount", "pid", "net", "ipc", "uts", "cgroup"]);
    assert!(s["landlock"]["abi"].as_u64().unwrap() >= 1);
    assert_eq!(s["seccomp"], "enforced");
    assert!(s["cgroup"] == "v1" || s["cgroup"] == "v2", "{s}");
    assert_eq!(s["network"], "none");
    assert_eq!(s["capabilities"], "none");
    assert_eq!(s["no_new_privs"], true);
}

#[test]
fn clamped_limits_are_reported() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let m = manifest(&d, "{}", r#"{"max_memory_mb": 4096, "max_cpu_percent": 50, "timeout_seconds": 30}"#);
    let r = sandbox(Some(&m), &["/bin/true"]);
    assert_eq!(r.json["limits"]["max_memory_mb"], 512, "clamped to the ceiling");
    let clamped = r.json["limits"]["clamped"].as_array().unwrap();
    let c = clamped.iter().find(|c| c["field"] == "max_memory_mb").expect("clamp recorded");
    assert_eq!(c["requested"], 4096);
    assert_eq!(c["applied"], 512);
    assert_eq!(r.json["limits"]["timeout_seconds"], 30);
}

/// `opservant sandbox` reads the configuration as `run` does: its limits and ceilings apply
/// (a clamp of a manifest's request to a ceiling set there is reported), and a minimum
/// Landlock ABI above the kernel's fails closed, exit 2.
#[test]
fn the_configuration_applies_to_a_sandbox() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let config = |text: &str| {
        let path = d.path.join("config.yaml");
        std::fs::write(
            &path,
            format!("{text}audit:\n  path: {}\n  journald: false\n", d.path.join("audit.jsonl").display()),
        )
        .unwrap();
        path.display().to_string()
    };
    let limits = config("resource_limits:\n  max_memory_mb: 64\n  max_timeout_seconds: 30\n");
    let (code, out, err) = run_cli(&["sandbox", "--json", "--config", &limits, "--", "/bin/true"]);
    assert_eq!(code, 0, "{out}{err}");
    let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!((r["limits"]["max_memory_mb"].as_u64(), r["limits"]["timeout_seconds"].as_u64()), (Some(64), Some(30)));
    // The defaults followed the ceilings down (the scratch with the memory): nothing clamped.
    assert_eq!(r["limits"]["clamped"], serde_json::json!([]), "{r}");
    let m = manifest(&d, "{}", r#"{"max_memory_mb": 256}"#);
    let (code, out, err) =
        run_cli(&["sandbox", "--json", "--config", &limits, "--manifest", m.to_str().unwrap(), "--", "/bin/true"]);
    assert_eq!(code, 0, "{out}{err}");
    let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let clamp = r["limits"]["clamped"].as_array().unwrap().iter().find(|c| c["field"] == "max_memory_mb").cloned();
    assert_eq!(clamp.map(|c| (c["requested"].clone(), c["applied"].clone())), Some((256.into(), 64.into())), "{r}");
    // The kernel's ABI is at most 63 anywhere for years; 64 is the most a config may ask.
    let abi = config("sandbox:\n  landlock_min_abi: 64\n");
    let (code, out, err) = run_cli(&["sandbox", "--json", "--config", &abi, "--", "/bin/true"]);
    assert_eq!((code, out.as_str()), (2, ""), "{err}");
    assert!(err.contains("below the required minimum 64"), "{err}");
}

#[test]
fn bad_input_exits_2_with_one_line_naming_the_problem() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    // A misspelt restriction must not be ignored.
    let m = manifest(&d, r#"{"filesystem": {"reed": ["/etc"]}}"#, "{}");
    let (code, stdout, stderr) = run_cli(&["sandbox", "--manifest", m.to_str().unwrap(), "--", "/bin/true"]);
    assert_eq!(code, 2);
    assert!(stdout.is_empty(), "nothing on stdout: {stdout}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("permissions.filesystem") && stderr.contains("reed"), "{stderr}");

    let (code, _, stderr) = run_cli(&["sandbox", "--manifest", "/nonexistent/manifest.json", "--", "/bin/true"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("cannot read"), "{stderr}");

    std::fs::write(&m, "{ not json").unwrap();
    let (code, _, stderr) = run_cli(&["sandbox", "--manifest", m.to_str().unwrap(), "--", "/bin/true"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("not valid JSON"), "{stderr}");

    let m = manifest(&d, r#"{"filesystem": {"write": ["/etc/cron.d"]}}"#, "{}");
    let (code, _, stderr) = run_cli(&["sandbox", "--manifest", m.to_str().unwrap(), "--", "/bin/true"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("permissions.filesystem.write[0]") && stderr.contains("system directories"), "{stderr}");

    let m = manifest(&d, r#"{"network": {"outbound": true}}"#, "{}");
    let (code, _, stderr) = run_cli(&["sandbox", "--manifest", m.to_str().unwrap(), "--", "/bin/true"]);
    assert_eq!(code, 2, "egress is refused, never silently dropped: {stderr}");
    assert!(stderr.contains("permissions.network.outbound"), "{stderr}");

    let (code, _, stderr) = run_cli(&["sandbox", "--"]);
    assert_eq!(code, 2, "{stderr}");
    let (code, stdout, stderr) = run_cli(&["sandbox", "--no-such-flag", "--", "/bin/true"]);
    assert_eq!((code, stdout.as_str()), (2, ""));
    // The argument parser's errors too: one line (not its usage block), naming what is wrong.
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("unexpected argument '--no-such-flag'"), "{stderr}");
    let (code, _, stderr) = run_cli(&["run"]);
    assert_eq!(code, 2);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("required arguments were not provided: <DIR>"), "{stderr}");
}

#[test]
fn a_missing_program_cannot_run() {
    if !require_root() {
        return;
    }
    let err = try_sandbox(None, &["/no/such/program"]).expect_err("exit 2, no result");
    assert_eq!(err.0, 2);
    assert!(err.1.contains("/no/such/program") && err.1.contains("No such file"), "{}", err.1);
    let err = try_sandbox(None, &["no-such-command-anywhere"]).expect_err("exit 2");
    assert!(err.1.contains("not found in PATH"), "{}", err.1);
}

#[test]
fn runaway_output_is_capped_and_marked() {
    if !require_root() {
        return;
    }
    let r = sh(None, "head -c 3000000 /dev/zero | tr '\\0' x; echo done >&2");
    assert_eq!(r.status(), "completed");
    assert_eq!(r.stdout().len(), 1 << 20, "stdout capped at 1 MiB");
    assert_eq!(r.json["stdout_truncated"], true);
    assert_eq!(r.json["stderr_truncated"], false);
    assert_eq!(r.err(), "done\n");
}

#[test]
fn works_without_a_config_file_and_with_a_declared_path() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    d.file("data.txt", "declared-data", 0o644);
    let m = manifest(&d, &format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, d.str()), "{}");
    let r = sh(Some(&m), &format!("cat {}/data.txt", d.str()));
    assert_eq!(r.status(), "completed", "{}", r.err());
    assert_eq!(r.stdout(), "declared-data");
}

#[test]
fn doctor_describes_this_host() {
    if !require_root() {
        return;
    }
    let (code, stdout, _) = run_cli(&["doctor", "--json"]);
    let j: serde_json::Value = serde_json::from_str(&stdout).expect("doctor --json");
    // Independent probes of the same facts.
    // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) only returns the ABI.
    let abi = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) };
    assert_eq!(j["probe"]["landlock"]["abi"].as_i64().unwrap(), abi.max(0));
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let has_v1 = mountinfo.contains(" - cgroup ");
    let has_v2 = mountinfo.contains(" - cgroup2 ");
    let mode = match (has_v1, has_v2) {
        (true, true) => "hybrid",
        (false, true) => "unified",
        (true, false) => "legacy",
        _ => "none",
    };
    assert_eq!(j["probe"]["cgroup_mode"], mode);
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let memory_v1 = own.lines().any(|l| l.split(':').nth(1).is_some_and(|c| c.split(',').any(|c| c == "memory")));
    assert_eq!(j["probe"]["cgroup"]["memory"]["version"], if memory_v1 { "v1" } else { "v2" });
    assert_eq!(
        code,
        if j["findings"].as_array().unwrap().iter().any(|f| f["required"] == true && f["ok"] == false) { 1 } else { 0 }
    );

    // The identity sandboxes run as: their own user, or — reported as a degradation unless
    // each sandbox runs as a host uid of its own (the tests' configuration gives them one) —
    // the host's shared nobody.
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let own_user = passwd.lines().any(|l| l.starts_with("opservant-executor:"));
    let finding = |name: &str| j["findings"].as_array().unwrap().iter().find(|f| f["feature"] == name).cloned();
    // The clock: a degradation exactly when the kernel says no time service keeps it.
    let clock = finding("clock").expect("clock");
    assert_eq!(clock["ok"], !common::clock_unsynchronised(), "{clock}");
    let clock_degraded = j["degraded"].as_array().unwrap().iter().any(|d| d == &clock["detail"]);
    assert_eq!(clock_degraded, common::clock_unsynchronised(), "{j}");
    let identity = finding("identity").expect("identity");
    assert_eq!(identity["ok"], own_user, "{identity}");
    let uids = finding("host uids").expect("host uids");
    assert_eq!(uids["ok"], true, "the tests' configuration gives each sandbox a host uid: {uids}");
    assert!(uids["detail"].as_str().unwrap().contains("from 1900000000-1900065535 (65536 at once)"), "{uids}");
    let shared = j["degraded"].as_array().unwrap().iter().any(|d| d.as_str().unwrap().contains("run as nobody"));
    assert!(!shared, "{j}");
    // Root's inotify allowance: untouched with a host uid per sandbox (it owns the sandbox's
    // user namespace, and pays for its instances)...
    let inotify = finding("root's inotify headroom").expect("root's inotify headroom");
    assert_eq!(inotify["ok"], true, "{inotify}");
    assert!(inotify["detail"].as_str().unwrap().contains("owned by its leased host uid"), "{inotify}");
    if !own_user {
        assert!(identity["detail"].as_str().unwrap().ends_with("each on a host uid of its own (sandbox.host_uids)"));
    }
    // Without a range, both are degradations.
    let shared_config = common::config_with("doctor-shared", "sandbox:\n  host_uids: shared\n");
    let (_, text, _) = run_cli(&["doctor", "--json", "--config", shared_config.to_str().unwrap()]);
    let shared_report: serde_json::Value = serde_json::from_str(&text).unwrap();
    let degraded: Vec<&str> =
        shared_report["degraded"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()).collect();
    assert!(degraded.iter().any(|d| d.starts_with("every sandbox runs as the identity's host uid")), "{degraded:?}");
    assert_eq!(degraded.iter().any(|d| d.contains("run as nobody")), !own_user, "{degraded:?}");
    // ... and sharing one, every sandbox's instances count against root's: the number of
    // sandboxes at their cap of 16 that exhaust it, from this host's sysctl.
    let host: u64 = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances").unwrap().trim().parse().unwrap();
    let inotify = shared_report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["feature"] == "root's inotify headroom")
        .expect("root's inotify headroom");
    let detail = inotify["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!("({host} here): {} sandboxes at their cap of 16", host.div_ceil(16))),
        "{inotify}"
    );
    assert_eq!(inotify["ok"], host >= 8192, "{inotify}");
    assert_eq!(degraded.contains(&detail), host < 8192, "{degraded:?}");

    // Credential changes and dumpability, from this host's sysctl.
    let dumpable = std::fs::read_to_string("/proc/sys/fs/suid_dumpable").unwrap();
    let finding_dumpable = finding("fs.suid_dumpable").expect("fs.suid_dumpable");
    assert_eq!(finding_dumpable["ok"], dumpable.trim() != "1", "{finding_dumpable}");
    assert!(finding_dumpable["detail"].as_str().unwrap().starts_with(&format!("{}: ", dumpable.trim())));

    let (_, text, _) = run_cli(&["doctor"]);
    assert!(text.contains(&format!("ABI {}", abi.max(0))), "{text}");
    if mode == "hybrid" {
        assert!(text.contains("cgroup v1 hybrid"), "{text}");
    }

    // What the configuration requires: a Landlock floor above this kernel's ABI fails every
    // run, so doctor fails it too.
    let dir = common::HostDir::new();
    let conf = dir.file("config.yaml", &format!("sandbox:\n  landlock_min_abi: {}\n", abi + 1), 0o600);
    let (code, stdout, _) = run_cli(&["doctor", "--json", "--config", conf.to_str().unwrap()]);
    assert_eq!(code, 1, "{stdout}");
    let j: serde_json::Value = serde_json::from_str(&stdout).expect("doctor --json");
    let ll = j["findings"].as_array().unwrap().iter().find(|f| f["feature"] == "landlock").expect("landlock");
    assert_eq!((ll["ok"].clone(), ll["required"].clone()), (serde_json::json!(false), serde_json::json!(true)), "{ll}");
    let bad = dir.file("bad.yaml", "sandbox:\n  landlock_min_abi: 65\n", 0o600);
    let (code, _, stderr) = run_cli(&["doctor", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("sandbox.landlock_min_abi"), "{stderr}");
}

/// An account that NSS gives but `/etc/passwd` does not hold (a directory service's) inside
/// the configured range: the configuration check passes it (it reads `/etc/passwd` only),
/// `doctor` names it. The account is a systemd user record (`nss-systemd` lists the records
/// of `/run/userdb`), put there on a tmpfs of a private mount namespace that `doctor` runs
/// in: no other process of the host sees it.
#[test]
fn doctor_names_a_directory_account_inside_the_host_uid_range() {
    if !require_root() {
        return;
    }
    let nsswitch = std::fs::read_to_string("/etc/nsswitch.conf").unwrap_or_default();
    let passwd_line = nsswitch.lines().find(|l| l.trim_start().starts_with("passwd:")).unwrap_or_default();
    assert!(
        passwd_line.split_whitespace().any(|s| s == "systemd"),
        "this test needs nss-systemd in /etc/nsswitch.conf's passwd line (Debian's default): {passwd_line:?}"
    );
    let (first, count) = (1_900_100_000u32, 16u32);
    let config =
        common::config_with("doctor-nss", &format!("sandbox:\n  host_uids: {{first: {first}, count: {count}}}\n"));
    let made_dir = !std::path::Path::new("/run/userdb").exists();
    if made_dir {
        std::fs::create_dir("/run/userdb").unwrap();
    }
    let uid = first + 5;
    let record = format!(r#"{{"userName":"opservant-nss-test","uid":{uid},"gid":{uid}}}"#);
    let script = format!(
        "mount -t tmpfs -o mode=0755 opservant-test /run/userdb && printf '%s' '{record}' > /run/userdb/opservant-nss-test.user \
         && ln -s opservant-nss-test.user /run/userdb/{uid}.user && getent passwd {uid} >&2 && exec \"$0\" \"$@\""
    );
    let doctor = |with_account: bool| {
        let mut cmd = if with_account {
            let mut c = std::process::Command::new("unshare");
            c.args(["--mount", "--propagation", "private", "sh", "-c", &script, common::opservant()]);
            c
        } else {
            common::command()
        };
        cmd.args(["doctor", "--json", "--config", config.to_str().unwrap()]).stdin(Stdio::null());
        let out = cmd.output().expect("run doctor");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
        (j, stderr)
    };
    let (with, stderr) = doctor(true);
    let (without, _) = doctor(false);
    if made_dir {
        let _ = std::fs::remove_dir("/run/userdb");
    }
    assert!(stderr.contains(&format!("opservant-nss-test:x:{uid}:")), "NSS never gave the account: {stderr}");
    let uids = |j: &serde_json::Value| {
        j["findings"].as_array().unwrap().iter().find(|f| f["feature"] == "host uids").cloned().expect("host uids")
    };
    let found = uids(&with);
    assert_eq!(found["ok"], false, "{found}");
    let detail = found["detail"].as_str().unwrap();
    assert!(
        detail.starts_with(&format!("1900100000-1900100015 holds the uid of opservant-nss-test ({uid})")),
        "{detail}"
    );
    assert!(with["degraded"].as_array().unwrap().iter().any(|d| d == detail), "{with}");
    // Without the record (the host as it is), the same range is fine.
    assert_eq!(uids(&without)["ok"], true, "{without}");
}

/// A terminal signal to the command (Ctrl-C to its process group, or SIGTERM/SIGHUP to it
/// alone) stops the sandbox: the payload and its cgroups are gone, the result says it was
/// stopped, and the command exits 128 + the signal. (Killed outright, it left its cgroups.)
#[test]
fn a_terminal_signal_stops_the_sandbox_and_leaves_nothing() {
    if !require_root() {
        return;
    }
    use std::os::unix::process::CommandExt;
    // A sleep with a duration no other process has.
    let marker = format!("60.{}", std::process::id());
    for (sig, group) in [(libc::SIGINT, true), (libc::SIGTERM, false), (libc::SIGHUP, false)] {
        let child = common::command()
            .args(["sandbox", "--json", "--", "/bin/sleep", &marker])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let running = || {
            std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
                std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == format!("/bin/sleep\0{marker}\0").as_bytes())
            })
        };
        while !running() {
            assert!(std::time::Instant::now() < deadline, "the payload never started");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(!common::cgroups_of(pid).is_empty());
        // SAFETY: signalling the process (group) this test started.
        assert_eq!(unsafe { libc::kill(if group { -(pid as i32) } else { pid as i32 }, sig) }, 0);
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(128 + sig),
            "signal {sig}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: serde_json::Value = serde_json::from_str(stdout.trim()).expect("the result");
        assert_eq!(r["status"], "failed", "{r}");
        assert!(r["error"].as_str().unwrap().contains("stopped"), "{r}");
        assert_eq!(common::cgroups_of(pid), Vec::<std::path::PathBuf>::new(), "signal {sig}: cgroups left");
        assert!(!running(), "signal {sig}: the payload outlived the command");
    }
}

/// A second terminal signal ends the command at once when the first one's stop cannot
/// finish — here the sandbox is frozen (in life, stuck in the kernel), so the stop would
/// wait until the sandbox is abandoned and then print that failure. With the second signal
/// the command exits 128 + the signal at once, printing nothing: `_exit`, not the signal's
/// default action (SIGQUIT's would dump the core of a process that may hold secrets). The
/// sandbox's cgroups, left behind, are reaped by the next opservant process.
#[test]
fn a_second_terminal_signal_ends_the_command_at_once() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    for sig in [libc::SIGTERM, libc::SIGQUIT] {
        let child = common::command()
            .args(["sandbox", "--json", "--", "/bin/sleep", "600"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let (freezer, dirs) = common::freezer::freeze_sandbox_below(pid);
        let first = std::time::Instant::now();
        // SAFETY: signalling the process this test started.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        // The first signal taken (two of one kind pending would be one), its stop under way
        // and unable to end: the sandbox is frozen.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while signal_pending(pid) {
            assert!(std::time::Instant::now() < deadline, "signal {sig}: the first signal was never taken");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        // SAFETY: as above; the command has not been reaped, so the pid is still its own.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        let out = child.wait_with_output().unwrap();
        let took = first.elapsed();
        let thawed = freezer.thaw();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(128 + sig), "signal {sig}: {stdout} {stderr}");
        // Not the end of the first signal's stop: that prints why it ended ("stopped by", the
        // abandoned sandbox) and comes no sooner than 6 s after it (1 s before the backstop's
        // SIGKILL, then 5 s before the frozen sandbox is abandoned).
        // (Log lines, such as a stale cgroup's removal at start, may be there.)
        let said = stderr.lines().any(|l| l.starts_with("opservant:"));
        assert!(stdout.trim().is_empty() && !said, "signal {sig}: {stdout} {stderr}");
        assert!(took < std::time::Duration::from_secs(6), "signal {sig}: ended {took:?} after the first signal");
        assert!(thawed, "signal {sig}: the thawed sandbox processes never died");
        let (code, _, stderr) = run_cli(&["sandbox", "--json", "--", "/bin/true"]);
        assert_eq!(code, 0, "{stderr}");
        for d in &dirs {
            assert!(!d.exists(), "signal {sig}: {} left after the next opservant process", d.display());
        }
    }
}

/// Whether `pid` has a signal pending that its handler has not taken yet.
fn signal_pending(pid: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .filter(|l| l.starts_with("ShdPnd:") || l.starts_with("SigPnd:"))
        .any(|l| u64::from_str_radix(l.split_whitespace().nth(1).unwrap_or("0"), 16).unwrap_or(0) != 0)
}

/// Start time of `pid` (`/proc/PID/stat` field 22).
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(19).unwrap().parse().unwrap()
}

/// A new `opservant` process removes the sandbox cgroups of creators that are gone, beside
/// its own: a creator is a pid *and* its start time, so a cgroup whose pid now belongs to
/// another process (an agent restarted with its predecessor's pid) is stale too. What is
/// still in a stale cgroup is killed (through pidfds) first. Cgroups of a live creator —
/// also in the older `<pid>-<seq>` form — are left alone.
#[test]
fn stale_sandbox_cgroups_are_reaped_by_creator_pid_and_start_time() {
    if !require_root() {
        return;
    }
    let (code, stdout, stderr) = run_cli(&["sandbox", "--json", "--", "/bin/true"]);
    assert_eq!(code, 0, "{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let own: Vec<std::path::PathBuf> = json["sandbox"]["cgroup_paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| std::path::PathBuf::from(p.as_str().unwrap()))
        .collect();
    let name = own[0].file_name().unwrap().to_string_lossy().into_owned();
    let parts: Vec<&str> = name.trim_start_matches("opservant-sb-").split('-').collect();
    assert_eq!(parts.len(), 3, "<pid>-<start time>-<seq>: {name}");
    assert!(parts.iter().all(|p| p.parse::<u64>().is_ok()), "{name}");
    let bases: Vec<std::path::PathBuf> = own.iter().map(|p| p.parent().unwrap().to_path_buf()).collect();
    // A pid no process has any more: a child of ours, reaped.
    let mut gone = Command::new("/bin/true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    let init_start = start_time(1);
    // A sequence number no creator reaches, unique to this test process.
    let seq = 4_000_000_000u64 + u64::from(std::process::id());
    let stale =
        [format!("{dead}-{init_start}-{seq}"), format!("1-{}-{seq}", init_start + 12345), format!("{dead}-{seq}")];
    // Live creators' (also in the older form), and a name this crate does not make.
    let live = [format!("1-{init_start}-{seq}"), format!("1-{seq}"), format!("{dead}-x-{seq}")];
    let dirs = |names: &[String]| -> Vec<std::path::PathBuf> {
        bases.iter().flat_map(|b| names.iter().map(move |n| b.join(format!("opservant-sb-{n}")))).collect()
    };
    let (stale_dirs, live_dirs) = (dirs(&stale), dirs(&live));
    for d in stale_dirs.iter().chain(&live_dirs) {
        std::fs::create_dir_all(d).unwrap();
    }
    // A process left behind in a stale cgroup (of the dead creator with a start time).
    let mut left = Command::new("/bin/sleep").arg("600").spawn().unwrap();
    for b in &bases {
        let d = b.join(format!("opservant-sb-{}", stale[0]));
        std::fs::write(d.join("cgroup.procs"), left.id().to_string()).unwrap();
    }
    // (Were the dead pid taken by a new process meanwhile, the older-form name would be live.)
    assert!(!std::path::Path::new(&format!("/proc/{dead}")).exists(), "pid {dead} was reused; run again");
    let (code, _, stderr) = run_cli(&["sandbox", "--json", "--", "/bin/true"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(s) = left.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = left.kill();
            let _ = left.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let remaining_stale: Vec<_> = stale_dirs.iter().filter(|d| d.exists()).cloned().collect();
    let remaining_live: Vec<_> = live_dirs.iter().filter(|d| d.exists()).cloned().collect();
    for d in remaining_stale.iter().chain(&remaining_live) {
        let _ = std::fs::remove_dir(d);
    }
    assert_eq!(code, 0, "{stderr}");
    let status = status.expect("the process left in a stale cgroup still ran 10 s later");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "the process left in a stale cgroup was killed"
    );
    assert!(remaining_stale.is_empty(), "stale cgroups left: {remaining_stale:?}");
    assert_eq!(remaining_live, live_dirs, "cgroups of a live creator were removed");
}

/// A Landlock ruleset that applies less than the kernel's ABI promises fails the run. The
/// `landlock` crate asks the kernel for its ABI again when it builds the ruleset; a failed
/// query made it build an empty ruleset that "applied" nothing, and the run completed with
/// `landlock.status: not_enforced` although `sandbox.landlock_min_abi` (1 by default) had
/// been checked (a review reproduced it). `strace` fails init's second
/// `landlock_create_ruleset` — the crate's query; the first is the sandbox's own measurement,
/// the third the ruleset itself (failing that one fails the run with the kernel's error,
/// which the message below tells apart).
#[test]
fn a_landlock_ruleset_that_does_not_apply_fails_the_run() {
    if !require_root() {
        return;
    }
    let fail_call = |n: &str| {
        common::under_strace(
            &[],
            &[
                "-f",
                "-o",
                "/dev/null",
                "-e",
                "trace=landlock_create_ruleset",
                "-e",
                &format!("inject=landlock_create_ruleset:error=ENOSYS:when={n}"),
            ],
            &["sandbox", "--launch", "cold", "--json", "--", "/bin/true"],
        )
    };
    let Some(out) = fail_call("2") else { return };
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // The sandbox could not be built: exit 2, the reason on stderr, no result.
    assert_eq!(out.status.code(), Some(2), "{stdout} {stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(
        stderr.contains(
            "sandbox setup failed at landlock: the ruleset was not_enforced although the kernel's Landlock ABI"
        ),
        "{stderr}"
    );
    // Control: the ruleset's own creation failing is the kernel's error, not this check's.
    let out = fail_call("3").unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("sandbox setup failed at landlock") && !stderr.contains("although"), "{stderr}");
}

/// A `sandbox.host_uids` range is checked against other users' subordinate uids in
/// `/etc/subuid`; a file that cannot be read is an error naming it, not an empty file (a
/// review saw the range taken unchecked).
#[test]
fn an_unreadable_subuid_file_fails_the_host_uid_range_check() {
    if !require_root() {
        return;
    }
    let Some(out) = common::under_strace(
        &[],
        &["-f", "-o", "/dev/null", "-P", "/etc/subuid", "-e", "inject=openat:error=EIO"],
        &["sandbox", "--json", "--", "/bin/true"],
    ) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        stderr.contains("sandbox.host_uids")
            && stderr.contains("cannot read /etc/subuid")
            && stderr.contains("Input/output error"),
        "{stderr}"
    );
}

/// A read grant is bound as the file the policy checked: its device and inode are taken with
/// its type check, and the bind compares them. A review swapped a granted file for a Unix
/// socket between the check and the bind (with `host_uids: shared`, where the socket was
/// then reachable) and the sandbox talked to the host's listener. `strace` holds the first
/// `openat2` of each process for 3 s (the view's binds open their sources with it); once a
/// process of the run is held there — after the policy's checks — the file is replaced by a
/// socket, and the run fails at the bind naming the replacement.
#[test]
fn a_read_grant_replaced_after_its_check_is_not_bound() {
    if !require_root() {
        return;
    }
    if !common::require("strace (holds the bind's openat2)", Command::new("strace").arg("-V").output().is_ok()) {
        return;
    }
    let dir = HostDir::new();
    let data = dir.path.join("data");
    std::fs::write(&data, "checked file\n").unwrap();
    let m = manifest(&dir, &format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, data.display()), "{}");
    let shared = common::config_with("swap-shared", "sandbox:\n  host_uids: shared\n");
    let child = Command::new("strace")
        .args([
            "-qq",
            "-f",
            "-o",
            "/dev/null",
            "-e",
            "trace=openat2",
            "-e",
            "inject=openat2:delay_enter=3000000:when=1",
        ])
        .arg(common::opservant())
        .args(["sandbox", "--config", shared.to_str().unwrap(), "--launch", "cold", "--manifest"])
        .arg(&m)
        .args(["--json", "--", "/bin/cat"])
        .arg(&data)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A process the run started (below strace's child, the opservant command, which checks
    // the policy before it starts any) held at its first openat2.
    let held = |root: u32| {
        let mut tree = vec![(root as i32, 0)];
        let mut i = 0;
        while i < tree.len() {
            let (parent, depth) = tree[i];
            for e in std::fs::read_dir("/proc").unwrap().flatten() {
                let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<i32>().ok());
                if ppid == Some(parent) && !tree.iter().any(|(p, _)| *p == pid) {
                    tree.push((pid, depth + 1));
                }
            }
            i += 1;
        }
        tree.iter().filter(|(_, depth)| *depth >= 2).any(|(pid, _)| {
            std::fs::read_to_string(format!("/proc/{pid}/syscall"))
                .is_ok_and(|s| s.split_whitespace().next() == Some(&libc::SYS_openat2.to_string()))
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !held(child.id()) {
        assert!(std::time::Instant::now() < deadline, "no process of the run reached openat2");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::fs::rename(&data, data.with_extension("old")).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(&data).unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(2), "{stdout} {stderr}");
    assert!(stderr.contains("not the file the caller checked") && stderr.contains("replaced since"), "{stderr}");
}

/// A sandbox ended from outside — its init (PID 1 of its namespace) or its monitor killed by
/// someone on the host while the payload runs — is reported as such: `failed`, with the
/// process and the signal named in `error` and `killed_by: "signal:9"` where the signal is
/// known (cold start: the monitor reaps init, the command reaps the monitor). A zygote's
/// direct start leaves init's status with no one who can report it: the error still says
/// init ended, and `killed_by` stays null rather than guess. (It said "ended without an
/// exit status", `killed_by: null`, in every case.)
#[test]
fn a_sandbox_killed_from_outside_says_which_process_and_signal_ended_it() {
    if !require_root() {
        return;
    }
    let ppid = |pid: i32| common::procs::ppid(pid).expect("a process of the sandbox");
    for (launch, victim, expected_error, killed_by) in [
        ("cold", "init", "the sandbox's init was killed by signal 9 before its payload's exit", Some("signal:9")),
        ("cold", "monitor", "the sandbox's monitor was killed by signal 9 before its payload's exit", Some("signal:9")),
        ("zygote", "init", "the sandbox's init ended before its payload's exit was reported", None),
    ] {
        let marker = format!("61.{}{}", std::process::id(), victim.len() + launch.len());
        let mut child = common::command()
            .args(["sandbox", "--json", "--launch", launch, "--", "/bin/sleep", &marker])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let cmdline = format!("/bin/sleep\0{marker}\0");
        let payload =
            common::procs::wait_for(&mut child, std::time::Duration::from_secs(30), "the payload started", || {
                common::procs::by_cmdline(cmdline.as_bytes())
            });
        let command = child.id();
        let init = ppid(payload);
        let target = if victim == "init" { init } else { ppid(init) };
        if launch == "cold" {
            // The chain is the one the test means: command → monitor → init → payload.
            let monitor = ppid(init);
            assert_eq!(ppid(monitor), command as i32, "{launch}: not the command's monitor");
        }
        // SAFETY: signalling a process of the sandbox this test started (checked above).
        assert_eq!(unsafe { libc::kill(target, libc::SIGKILL) }, 0);
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{launch} {victim}: {stdout} {}", String::from_utf8_lossy(&out.stderr));
        let r: serde_json::Value = serde_json::from_str(stdout.trim()).expect("the result");
        assert_eq!(r["status"], "failed", "{launch} {victim}: {r}");
        assert_eq!(r["sandbox"]["launch"], launch, "{r}");
        // A zygote that could not start it directly went through a monitor, which reports
        // init's signal as a cold start's does.
        let (expected_error, killed_by) = match (launch, r["killed_by"].as_str()) {
            ("zygote", Some("signal:9")) => {
                ("the sandbox's init was killed by signal 9 before its payload's exit", Some("signal:9"))
            }
            _ => (expected_error, killed_by),
        };
        assert!(r["error"].as_str().unwrap().contains(expected_error), "{launch} {victim}: {r}");
        assert_eq!(r["killed_by"].as_str(), killed_by, "{launch} {victim}: {r}");
        assert_eq!(r["exit_code"], serde_json::Value::Null, "{r}");
        assert_eq!(common::cgroups_of(command), Vec::<std::path::PathBuf>::new(), "{launch} {victim}: cgroups left");
        assert!(std::fs::metadata(format!("/proc/{payload}")).is_err(), "{launch} {victim}: the payload survived");
    }
}

/// A program that ended while a process it left cannot die (frozen here; in life, stuck in
/// the kernel) keeps its result — `completed`, its output — with the abandon in
/// `sandbox.abandoned`; its cgroups are left for a later opservant process. Twice: the
/// leftover holding the output pipes (the sandbox is given up on 5 s after its SIGKILL),
/// and with them closed (its cgroups cannot be removed). The time limit passes while the
/// rest is reaped, and is moot: the program had ended; so is a Ctrl-C then (the command
/// says it came after the run ended, and exits 0). (The command failed with "had not
/// exited 5 s after SIGKILL" only once the program's whole time limit had passed — init
/// waited for that process before reporting the program's exit — and the review of the
/// first fix found the time limit still overriding the result, and a cgroup error instead
/// of the result where the leftover had closed its pipes.)
#[test]
fn a_program_that_ended_keeps_its_result_when_what_it_left_is_abandoned() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    for (variant, redirect) in [("holding the pipes", ""), ("pipes closed", " >/dev/null 2>&1")] {
        let flags = HostDir::new();
        let flag = flags.path.join("go");
        let m = manifest(
            &flags,
            &format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, flags.path.display()),
            r#"{"timeout_seconds": 10}"#,
        );
        let marker = format!("63.{}{}", std::process::id(), redirect.len());
        let script =
            format!("sleep {marker}{redirect} & while [ ! -e {} ]; do sleep 0.02; done; echo ended", flag.display());
        // A log of its own: the abandon is on record beside the run's end.
        let log = flags.path.join("audit/audit.jsonl");
        let config = flags.path.join("config.yaml");
        std::fs::write(&config, format!("audit:\n  path: {}\n  journald: false\n", log.display())).unwrap();
        let view = common::host_view();
        let mut child = common::command()
            .args(["sandbox", "--json", "--config", config.to_str().unwrap(), "--manifest", m.to_str().unwrap()])
            .args(["--", "/bin/sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let cmdline = format!("sleep\0{marker}\0");
        let sleeper = common::procs::wait_for(
            &mut child,
            std::time::Duration::from_secs(30),
            &format!("{variant}: the program's child started"),
            || common::procs::by_cmdline(cmdline.as_bytes()),
        );
        let dirs = common::freezer::sandbox_cgroups_of_process(sleeper);
        assert!(!dirs.is_empty(), "{variant}: the child is in the sandbox's cgroups");
        let freezer = common::freezer::Freezer::new(format!("program-abandoned-{}", redirect.len()));
        freezer.freeze(&[sleeper]);
        std::fs::write(&flag, b"").unwrap();
        if redirect.is_empty() {
            // Ctrl-C while the rest is reaped (at least 5 s from the program's end, which
            // follows the flag within milliseconds): it ends nothing of the program.
            std::thread::sleep(std::time::Duration::from_secs(1));
            // SAFETY: signalling the command this test started.
            assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
        }
        // A hang detector, not a timing assertion.
        let out = common::procs::end_within(child, std::time::Duration::from_secs(50), variant);
        drop(freezer);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{variant}: {stdout}\n{stderr}");
        if redirect.is_empty() {
            assert!(stderr.contains("SIGINT came after the run ended: it completed"), "{variant}: {stderr}");
        }
        let r: serde_json::Value = serde_json::from_str(stdout.trim()).expect("the result");
        assert_eq!(r["status"], "completed", "{variant}: {r}");
        assert_eq!(r["stdout"], "ended\n", "{variant}: {r}");
        let why = r["sandbox"]["abandoned"].as_str().unwrap_or("");
        assert!(why.contains("stuck in the kernel"), "{variant}: {r}");
        let records: Vec<serde_json::Value> =
            std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let events: Vec<&str> = records.iter().map(|r| r["event"].as_str().unwrap()).collect();
        assert_eq!(events, ["sandbox_start", "sandbox_abandoned", "sandbox_end"], "{variant}: {records:?}");
        assert_eq!(records[1]["fields"]["reason"].as_str(), Some(why), "{variant}");
        assert_eq!(records[2]["fields"]["status"], "completed", "{variant}");
        drop(view);
        let r = sandbox(None, &["/bin/true"]);
        assert_eq!(r.status(), "completed", "{}", r.err());
        for d in &dirs {
            assert!(!d.exists(), "{variant}: {} still there after a later opservant process started", d.display());
        }
    }
}

/// `opservant sandbox` keeps the audit trail `run` and `script` keep: a refusal, the start
/// (what ran, with which manifest, how it was launched) before the program runs, clamps,
/// limits enforced and the end, each with its outcome; none of it on stderr, which is the
/// program's. A start that cannot be recorded runs nothing (exit 2).
#[test]
fn a_sandbox_run_is_audited_from_start_to_end() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let log = d.path.join("audit/audit.jsonl");
    let config = d.path.join("config.yaml");
    std::fs::write(&config, format!("audit:\n  path: {}\n  journald: false\n  lock_wait_seconds: 1\n", log.display()))
        .unwrap();
    let config = config.to_str().unwrap();
    let records = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log).unwrap_or_default().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let fields = |r: &serde_json::Value| (r["event"].as_str().unwrap().to_string(), r["fields"].clone());

    // A program that fails, under a manifest whose memory request is clamped, named by a
    // path relative to the working directory.
    let m = manifest(&d, "{}", r#"{"max_memory_mb": 1000000, "timeout_seconds": 20}"#);
    let m_abs = m.to_str().unwrap();
    let out = common::command()
        .current_dir(&d.path)
        .args(["sandbox", "--config", config, "--manifest", "manifest.json", "--"])
        .args(["/bin/sh", "-c", "echo out; exit 3"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (code, out, err) =
        (out.status.code(), String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.starts_with("out\n{"), "the program's output, then the result: {out}");
    assert!(!err.contains("sandbox_start"), "the audit lines are not on the program's stderr: {err}");
    let got: Vec<_> = records().iter().map(fields).collect();
    let events: Vec<&str> = got.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(events, ["sandbox_start", "limit_clamped", "sandbox_end"], "{got:?}");
    let args = r#"["-c","echo out; exit 3"]"#;
    assert_eq!(
        got[0].1,
        serde_json::json!({"program": "/bin/sh", "args": args, "args_sha256": sha256_hex(args.as_bytes()),
                           "manifest": m_abs, "launch": "cold"})
    );
    assert_eq!((got[1].1["program"].as_str(), got[1].1["field"].as_str()), (Some("/bin/sh"), Some("max_memory_mb")));
    assert_eq!(
        got[2].1,
        serde_json::json!({"program": "/bin/sh", "status": "failed", "exit_code": "3", "killed_by": "",
                           "error": "exited with status 3"})
    );

    // A time limit enforced, through a zygote.
    let m = manifest(&d, "{}", r#"{"timeout_seconds": 1}"#);
    let (code, out, err) = run_cli(&[
        "sandbox",
        "--config",
        config,
        "--launch",
        "zygote",
        "--manifest",
        m.to_str().unwrap(),
        "--json",
        "--",
        "/bin/sleep",
        "30",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    let result: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((result["status"].as_str(), result["killed_by"].as_str()), (Some("failed"), Some("timeout")), "{out}");
    let got: Vec<_> = records().iter().skip(3).map(fields).collect();
    let events: Vec<&str> = got.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(events, ["sandbox_start", "limit_enforced", "sandbox_end"], "{got:?}");
    assert_eq!(got[0].1["launch"], "zygote", "{got:?}");
    assert_eq!(got[1].1, serde_json::json!({"program": "/bin/sleep", "limit": "timeout"}));
    assert_eq!((got[2].1["status"].as_str(), got[2].1["killed_by"].as_str()), (Some("failed"), Some("timeout")));

    // A manifest the sandbox refuses: the refusal is on record, no start.
    let m = manifest(&d, r#"{"network": {"outbound": true}}"#, "{}");
    let (code, _, err) =
        run_cli(&["sandbox", "--config", config, "--manifest", m.to_str().unwrap(), "--", "/bin/true"]);
    assert_eq!(code, 2, "{err}");
    let got: Vec<_> = records().iter().skip(6).map(fields).collect();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, "sandbox_refused");
    assert_eq!(got[0].1["program"], "/bin/true");
    assert!(got[0].1["reason"].as_str().unwrap().contains("permissions.network.outbound"), "{got:?}");

    // The log's lock held by another process past its wait: the log cannot even be opened,
    // nothing runs.
    let lock = std::fs::File::options().read(true).write(true).open(d.path.join("audit/audit.jsonl.lock")).unwrap();
    let held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock).unwrap();
    let (code, out, err) = run_cli(&["sandbox", "--config", config, "--", "/bin/sh", "-c", "echo ran"]);
    drop(held);
    assert_eq!((code, out.as_str()), (2, ""), "{err}");
    assert!(err.contains("audit log") && err.contains("lock"), "{err}");
    assert_eq!(records().len(), 7, "nothing recorded, nothing run");

    // The log opens but the start's record cannot be written (a file-size limit, as a full
    // disk): the gate holds, the program never starts — its output would be on stdout.
    let size = std::fs::metadata(&log).unwrap().len();
    let out = Command::new("prlimit")
        .arg(format!("--fsize={}", size + 40))
        .arg("--")
        .arg(common::opservant())
        .args(["sandbox", "--config", config, "--", "/bin/sh", "-c", "echo ran"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!((out.status.code(), out.stdout.as_slice()), (Some(2), &b""[..]), "{err}");
    assert!(err.contains("audit log") && err.contains("File too large"), "{err}");
    assert_eq!(records().len(), 7, "nothing recorded, nothing run");
    let (code, _, err) = run_cli(&["audit", "verify", "--config", config]);
    assert_eq!(code, 0, "{err}");
}
