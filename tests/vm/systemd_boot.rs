//! The boot test of the shipped systemd unit (see `tests/vm/README.md`).
//!
//! On the host this binary checks the prerequisites and re-runs itself inside one QEMU guest
//! booted with systemd as PID 1 (`VM_SYSTEMD=1 tests/vm/vm-exec.sh`, virtme-ng `--systemd`,
//! one boot). Inside the guest (`OPSERVANT_IN_VM=1`) it installs what a package would —
//! the built binaries linked into /usr/bin, `systemd/opservant.service`, the sysusers.d, tmpfiles.d and
//! sysctl.d files —, writes a minimal config (the platform key, nothing else: the agent runs
//! with its local socket only), starts the unit and drives it through `opservant submit`:
//! READY, a signed port scan with the full isolation report, network egress, an OOM kill and
//! a timeout under the unit's restrictions, watchdog pings, then `systemctl stop` while a
//! command runs (it must finish, and the agent exit cleanly).
//!
//! Without the prerequisites the test prints `SKIPPED: ...` and succeeds — unless `CI=true`,
//! where a missing prerequisite is a failure.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "guest.rs"]
#[macro_use]
mod guest;
#[path = "host.rs"]
mod host;

use guest::{sh, sh_ok as run};

const OPSERVANT: &str = env!("CARGO_BIN_EXE_opservant");
const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const CONFIG: &str = "/etc/opservant/config.yaml";
const KEYS: &str = "/etc/opservant/keys";
/// The agent's own cgroup: the unit's, in system.slice (the unit's ReadWritePaths= name it).
const UNIT_CGROUP: &str = "/sys/fs/cgroup/system.slice/opservant.service";
/// A drop-in shortens the watchdog so that a missing ping kills the agent during the test.
const WATCHDOG_SEC: u64 = 4;

fn main() -> ExitCode {
    host::suite(in_vm, on_host)
}

// ------------------------------------------------------------------------------------------
// Host side: prerequisites, then one VM.
// ------------------------------------------------------------------------------------------

fn on_host() -> ExitCode {
    if let Some(exit) = host::unless_ready("vm_systemd", "systemd boot test", &host::missing_prerequisites(true)) {
        return exit;
    }
    host::boot_and_run(
        "vm_systemd",
        "booting a VM with systemd as PID 1 (QEMU/TCG, ~80-120 s) and testing the unit inside",
        &[("VM_SYSTEMD", "1".into()), ("VM_TIMEOUT", std::env::var("VM_TIMEOUT").unwrap_or_else(|_| "900".into()))],
        &[],
    )
}

// ------------------------------------------------------------------------------------------
// Guest side: the checks run in order and stop at the first failure (each builds on the last).
// ------------------------------------------------------------------------------------------

struct Ctx {
    /// Scratch directory for the test executors.
    dir: PathBuf,
}

fn in_vm() -> ExitCode {
    let checks: [(&str, guest::Check<Ctx>); 11] = [
        ("pid1_is_systemd", pid1_is_systemd),
        ("install", install),
        ("start_reaches_ready", start_reaches_ready),
        ("binaries_hashed_under_the_unit", binaries_hashed_under_the_unit),
        ("port_scan_fully_isolated", port_scan_fully_isolated),
        ("declared_path_readable", declared_path_readable),
        ("egress_wired", egress_wired),
        ("oom_and_timeout_enforced", oom_and_timeout_enforced),
        ("watchdog_pinged", watchdog_pinged),
        ("stop_drains_and_exits_cleanly", stop_drains_and_exits_cleanly),
        ("audit_chain_verifies", audit_chain_verifies),
    ];
    let dir = PathBuf::from(format!("/var/lib/opservant-vm-test-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    let ctx = Ctx { dir };
    println!("\nrunning {} checks of systemd/opservant.service in the VM", checks.len());
    guest::run_checks(&checks, &ctx, true, || {
        format!(
            "\n---- journalctl -u opservant ----\n{}",
            sh("journalctl -u opservant --no-pager -o cat | tail -n 40").1
        )
    })
}

// ------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------

/// One property of a unit (`systemctl show -P`).
fn prop(unit: &str, name: &str) -> Result<String, String> {
    Ok(run(&format!("systemctl show -P {name} {unit}"))?.trim().to_string())
}

/// Sign `cmd` with the platform key and submit it to the agent's socket: (exit code, result).
fn submit(cmd: &Value) -> Result<(i32, Value), String> {
    guest::sign_and_submit(&format!("{KEYS}/signing.key"), &["/usr/bin/opservant", "submit", "-"], cmd, String::new)
}

fn field<'a>(r: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(r, |v, k| &v[k])
}

/// A Python executor package `name` in the scratch directory (class `Exec` in `pkg/main.py`).
fn executor(ctx: &Ctx, name: &str, permissions: Value, limits: Value, body: &str) -> Result<PathBuf, String> {
    guest::executor_package(&ctx.dir.join(name), name, "1.0.0", "", permissions, limits, body)
}

fn execute(id: &str, executor: &str, parameters: Value) -> Value {
    json!({"command_id": id, "action": "execute", "executor": executor, "parameters": parameters})
}

// ------------------------------------------------------------------------------------------
// Checks
// ------------------------------------------------------------------------------------------

fn pid1_is_systemd(_: &Ctx) -> Result<(), String> {
    let comm = std::fs::read_to_string("/proc/1/comm").unwrap_or_default();
    ensure!(comm.trim() == "systemd", "PID 1 is {comm:?}, not systemd");
    let state = sh("systemctl is-system-running").1;
    ensure!(["running", "degraded", "starting"].contains(&state.trim()), "systemctl is-system-running: {state:?}");
    let fs = run("stat -f -c %T /sys/fs/cgroup")?;
    ensure!(fs.trim() == "cgroup2fs", "/sys/fs/cgroup is {fs:?}, not the unified hierarchy");
    Ok(())
}

/// What a package would do: binaries, unit, sysusers, tmpfiles, sysctl; then keys and a
/// config naming the executors the agent installs at start. A drop-in shortens the watchdog.
/// The binaries are linked, not copied, unless the build is hidden from the unit (below
/// /tmp): debug builds are large and the guest's /usr is an overlay in RAM (the runtime is
/// found beside the resolved /proc/self/exe either way). virtme-ng binds its own /etc/shadow over the
/// guest's, which systemd-sysusers cannot replace: that bind goes first.
fn install(ctx: &Ctx) -> Result<(), String> {
    let bin = Path::new(OPSERVANT).parent().ok_or("no binary directory")?;
    // The unit's PrivateTmp= hides /tmp and /var/tmp from the agent: a build below them is
    // copied instead, stripped (a debug build is ~260 MB; /usr is an overlay in RAM).
    let place = if ["/tmp", "/var/tmp"].iter().any(|d| bin.starts_with(d)) {
        "install -s -m 0755 {b}/opservant {b}/opservant-runtime /usr/bin/"
    } else {
        "ln -sf {b}/opservant {b}/opservant-runtime /usr/bin/"
    };
    run(&format!(
        "{} \
         && install -m 0644 {r}/systemd/opservant.service /etc/systemd/system/ \
         && install -D -m 0644 {r}/systemd/sysusers.d/opservant.conf /etc/sysusers.d/opservant.conf \
         && install -D -m 0644 {r}/systemd/tmpfiles.d/opservant.conf /etc/tmpfiles.d/opservant.conf \
         && install -D -m 0644 {r}/systemd/sysctl.d/60-opservant.conf /etc/sysctl.d/60-opservant.conf \
         && {{ ! mountpoint -q /etc/shadow || umount /etc/shadow; }} \
         && systemd-sysusers /etc/sysusers.d/opservant.conf \
         && echo opservant-executor:1879048192:65536 >> /etc/subuid \
         && systemd-tmpfiles --create /etc/tmpfiles.d/opservant.conf \
         && /lib/systemd/systemd-sysctl /etc/sysctl.d/60-opservant.conf",
        place.replace("{b}", &bin.display().to_string()),
        r = REPO
    ))?;
    ensure!(sh("getent passwd opservant-executor").0 == 0, "systemd-sysusers did not create opservant-executor");
    run(&format!("/usr/bin/opservant keygen --out {KEYS}"))?;

    let slow = executor(
        ctx,
        "slow",
        json!({}),
        // Not throttled to the default 10 % of a CPU: under TCG the runtime's start alone
        // took up to ~1.4 s of CPU, so at 10 % the 6 s timeout could come before the handler
        // below was installed (the check that the SIGTERM arrived then failed).
        json!({"timeout_seconds": 30, "max_cpu_percent": 100}),
        // A stop or a timeout's SIGTERM is noted and the sleep goes on (to the SIGKILL).
        "        import signal, sys, time\n        \
         signal.signal(signal.SIGTERM, lambda *_: (sys.stderr.write(\"SIGTERM\\n\"), sys.stderr.flush()))\n        \
         time.sleep(params.get(\"seconds\", 1))\n        \
         return ExecutorResult(status=\"completed\", output={\"slept\": params.get(\"seconds\", 1)})\n",
    )?;
    let hog = executor(
        ctx,
        "memhog",
        json!({}),
        json!({"max_memory_mb": 32, "timeout_seconds": 60}),
        "        blocks = []\n        for _ in range(200):\n            blocks.append(bytearray(1 << 20))\n        \
         return ExecutorResult(status=\"completed\", output={\"allocated_mb\": len(blocks)})\n",
    )?;
    // An executor declaring a read path (bound from the exact real path the agent checked:
    // under the unit's former RestrictSUIDSGID=, which answered openat2 with ENOSYS, resolved
    // one component at a time — until the fifteenth session such a run failed there), and
    // making a set-group-ID directory in its scratch, which its profile allows (that filter
    // refused it with EPERM here only).
    let data = ctx.dir.join("data");
    std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
    std::fs::write(data.join("hello.txt"), "hello from the host\n").map_err(|e| e.to_string())?;
    run(&format!("chmod 0755 {d} {d}/.. && chmod 0644 {d}/hello.txt", d = data.display()))?;
    let reader = executor(
        ctx,
        "reader",
        json!({"filesystem": {"read": [data]}}),
        json!({"timeout_seconds": 30}),
        &format!(
            "        with open({:?}) as f:\n            text = f.read()\n        \
             import os\n        os.mkdir(\"/tmp/shared\", 0o2775)\n        os.chmod(\"/tmp/shared\", 0o2775)\n        \
             setgid = bool(os.stat(\"/tmp/shared\").st_mode & 0o2000)\n        \
             return ExecutorResult(status=\"completed\", output={{\"text\": text, \"setgid\": setgid}})\n",
            data.join("hello.txt")
        ),
    )?;
    let net = executor(
        ctx,
        "egress-probe",
        json!({"network": {"outbound": true, "allowed_hosts": ["192.0.2.10"], "allowed_ports": [80]}}),
        json!({"timeout_seconds": 30}),
        "        return ExecutorResult(status=\"completed\", output={\"ok\": True})\n",
    )?;
    // The agent installs the executors itself when it starts (`executors.install`), under the
    // unit's UMask=0077: the sandboxes must still be able to read them.
    // A copy of the example (the checkout may be below /tmp, hidden from the unit).
    let scanner = ctx.dir.join("port-scanner");
    run(&format!("cp -r {REPO}/executors/port-scanner {}", scanner.display()))?;
    let install: String = [scanner.as_path(), &slow, &hog, &net, &reader]
        .iter()
        .map(|p| format!("  - {}\n", std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()).display()))
        .collect();
    std::fs::write(
        CONFIG,
        format!(
            "agent:\n  platform_public_key: {KEYS}/signing.pub\n  max_concurrent: 2\nexecutors:\n  install:\n{install}"
        ),
    )
    .map_err(|e| format!("write {CONFIG}: {e}"))?;
    run(&format!("/usr/bin/opservant agent --config {CONFIG} --check-config"))?;
    ensure!(!Path::new("/var/lib/opservant/executors").exists(), "executors installed before the agent ran");
    std::fs::create_dir_all("/etc/systemd/system/opservant.service.d").map_err(|e| e.to_string())?;
    std::fs::write(
        "/etc/systemd/system/opservant.service.d/10-vm-test.conf",
        format!("[Service]\nWatchdogSec={WATCHDOG_SEC}s\n"),
    )
    .map_err(|e| e.to_string())?;
    run("systemctl daemon-reload")?;
    Ok(())
}

/// The agent hashes its binaries under the unit's restrictions (`/proc/self/exe`, the
/// runtime beside it): pings carry the digests `sha256sum` gives, and the log records them.
fn binaries_hashed_under_the_unit(_: &Ctx) -> Result<(), String> {
    let digest = |p: &str| -> Result<String, String> {
        Ok(run(&format!("sha256sum {p}"))?.split_whitespace().next().unwrap_or_default().to_string())
    };
    let (opservant, runtime) = (digest("/usr/bin/opservant")?, digest("/usr/bin/opservant-runtime")?);
    // Hashing ~300 MB of debug binaries under TCG takes a while: pings say `pending` meanwhile.
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut n = 0;
    let binaries = loop {
        n += 1;
        let (code, r) = submit(&json!({"command_id": format!("boot-binaries-{n}"), "action": "ping"}))?;
        ensure!(code == 0, "ping: exit {code}: {r}");
        let b = r["output"]["binaries"].clone();
        if b.get("pending").is_none() {
            break b;
        }
        ensure!(Instant::now() < deadline, "binaries still pending after 240 s: {r}");
        std::thread::sleep(Duration::from_secs(2));
    };
    ensure!(binaries["opservant"]["sha256"] == opservant.as_str(), "opservant: {binaries} (sha256sum: {opservant})");
    ensure!(
        binaries["opservant_runtime"]["sha256"] == runtime.as_str(),
        "opservant-runtime: {binaries} (sha256sum: {runtime})"
    );
    Ok(())
}

fn start_reaches_ready(_: &Ctx) -> Result<(), String> {
    // Type=notify: `systemctl start` returns once the agent has sent READY=1 (or failed).
    run("systemctl start opservant.service")?;
    let state = sh("systemctl is-active opservant.service").1;
    ensure!(state.trim() == "active", "is-active: {state:?}");
    ensure!(prop("opservant.service", "Type")? == "notify", "Type is not notify");
    ensure!(prop("opservant.service", "NotifyAccess")? == "main", "NotifyAccess is not main");
    ensure!(Path::new("/run/opservant/agent.sock").exists(), "no /run/opservant/agent.sock");
    // The agent has openat2 under the unit (it warns of its absence at start: the former
    // RestrictSUIDSGID= answered it with ENOSYS).
    let journal = sh("journalctl -u opservant --no-pager -o cat").1;
    ensure!(!journal.contains("openat2 answers ENOSYS"), "openat2 is refused under the unit:\n{journal}");
    // sysctl.d raised root's inotify allowance, which a sandbox's instances count against
    // when sandboxes share the identity's uid (the agent then warns below 8192; here each has
    // a uid of its own, which owns its user namespace and pays for them).
    let instances = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances").map_err(|e| e.to_string())?;
    ensure!(instances.trim() == "8192", "sysctl.d did not raise fs.inotify.max_user_instances: {instances}");
    ensure!(!journal.contains("leave none for root's own processes"), "root's inotify allowance is short:\n{journal}");
    // The agent logs doctor's view from inside the unit (a shell's doctor does not share
    // the unit's filters and capabilities): nothing required is missing there.
    // (The summary is a warning when anything is degraded, else below the log level.)
    ensure!(
        journal.contains("doctor, as the service sees this host: 0 required features missing")
            || !journal.contains("degraded (as the service sees this host)"),
        "no doctor summary, or a required feature missing under the unit:\n{journal}"
    );
    ensure!(
        !journal.contains("missing (as the service sees this host)"),
        "a required feature is missing under the unit:\n{journal}"
    );
    Ok(())
}

/// An executor declaring a read path runs under the unit and reads it, through a bind
/// idmapped for its host uid of its own.
fn declared_path_readable(_: &Ctx) -> Result<(), String> {
    let (code, r) = submit(&execute("boot-read-1", "reader", json!({})))?;
    ensure!(code == 0 && r["status"] == "completed", "reader: exit {code}: {r}");
    ensure!(r["output"]["text"] == "hello from the host\n", "reader output: {r}");
    ensure!(r["output"]["setgid"] == true, "a set-group-ID directory was refused under the unit: {r}");
    ensure!(r["sandbox"]["host_uid_shared"] == false, "host uid: {}", r["sandbox"]);
    Ok(())
}

fn port_scan_fully_isolated(_: &Ctx) -> Result<(), String> {
    let (code, r) = submit(&json!({"command_id": "boot-scan-1", "action": "execute", "executor": "port-scanner",
                                   "parameters": {"target_host": "127.0.0.1", "ports": [22]}}))?;
    ensure!(code == 0 && r["status"] == "completed", "port scan: exit {code}: {r}");
    ensure!(r["output"]["ports"][0]["status"] == "closed", "port scan output: {r}");
    let sb = &r["sandbox"];
    let ns: Vec<&str> =
        sb["namespaces"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    for want in ["user", "mount", "pid", "net", "ipc", "uts", "cgroup"] {
        ensure!(ns.contains(&want), "namespace {want} missing: {sb}");
    }
    ensure!(sb["seccomp"] == "enforced", "seccomp: {sb}");
    ensure!(sb["no_new_privs"] == true, "no_new_privs: {sb}");
    ensure!(sb["capabilities"] == "none", "capabilities: {sb}");
    ensure!(sb["cgroup"] == "v2", "cgroup: {sb}");
    // The daemon's default: the sandbox came from its zygote, itself running under the unit.
    ensure!(sb["launch"] == "zygote", "launch: {sb}");
    // A host uid of its own, from opservant-executor's /etc/subuid range (`host_uids: auto`),
    // leased through the lock the unit may write.
    let host_uid = sb["host_uid"].as_u64().unwrap_or(0);
    ensure!(sb["host_uid_shared"] == false && (1879048192..1879048192 + 65536).contains(&host_uid), "host uid: {sb}");
    ensure!(
        ["enforced", "partially_enforced"].contains(&sb["landlock"]["status"].as_str().unwrap_or("")),
        "landlock: {sb}"
    );
    let paths = sb["cgroup_paths"].as_array().cloned().unwrap_or_default();
    ensure!(
        !paths.is_empty()
            && paths.iter().all(|p| p.as_str().is_some_and(|p| p.starts_with(&format!("{UNIT_CGROUP}/opservant-sb-")))),
        "sandbox cgroups not below the unit's delegated cgroup: {sb}"
    );
    // The agent moved itself into the leaf of its delegated (and, despite
    // ProtectControlGroups=, writable) cgroup to create the sandbox's beside it.
    let pid = prop("opservant.service", "MainPID")?;
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    ensure!(
        cgroup.trim() == "0::/system.slice/opservant.service/opservant-agent",
        "the agent is not in the leaf of its delegated cgroup: {cgroup:?}"
    );
    let uid = run("id -u opservant-executor")?;
    ensure!(
        sb["uid"].as_u64().map(|u| u.to_string()) == Some(uid.trim().to_string()),
        "uid is not opservant-executor's: {sb}"
    );
    Ok(())
}

fn egress_wired(_: &Ctx) -> Result<(), String> {
    // Veth, addresses and nftables over netlink, the DNS forwarder on port 53: the run only
    // starts when all of that worked.
    let (code, r) = submit(&execute("boot-egress-1", "egress-probe", json!({})))?;
    ensure!(code == 0 && r["status"] == "completed", "egress run: exit {code}: {r}");
    ensure!(field(&r, "sandbox.network") == "egress", "network: {}", r["sandbox"]);
    Ok(())
}

fn oom_and_timeout_enforced(_: &Ctx) -> Result<(), String> {
    let (_, r) = submit(&execute("boot-oom-1", "memhog", json!({})))?;
    ensure!(r["status"] == "failed" && r["killed_by"] == "oom", "memory hog: {r}");
    let (_, r) = submit(&json!({"command_id": "boot-timeout-1", "action": "execute", "executor": "slow",
                                "parameters": {"seconds": 20}, "resource_limits": {"timeout_seconds": 6}}))?;
    ensure!(r["status"] == "timeout" && r["killed_by"] == "timeout", "timeout: {r}");
    // The timeout's SIGTERM reached the payload, through the sandbox's init: the agent signals
    // init, which runs as the sandbox's leased host uid in a user namespace that uid owns —
    // without CAP_KILL in the unit it cannot (the run still ends, by the backstop's SIGKILL of
    // the monitor a second later, without the grace period or the tree's accounting).
    ensure!(r["stderr"].as_str().is_some_and(|e| e.contains("SIGTERM")), "the timeout's SIGTERM never arrived: {r}");
    // Nothing of either is left in the unit's cgroup. The agent replies before a finished
    // run's teardown (init's exit, the cgroups' removal) is done in the background, which
    // may take up to its monitor's and its cgroups' patience (5 s each); slower under TCG.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = run(&format!(
            "for d in {UNIT_CGROUP}/opservant-sb-*; do [ -d \"$d\" ] && echo \"$d: $(cat $d/cgroup.procs | tr '\\n' ' ')\"; done; true"
        ))?;
        if left.trim().is_empty() {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "sandbox cgroups left behind 30 s after the runs (with their processes):\n{left}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn watchdog_pinged(_: &Ctx) -> Result<(), String> {
    ensure!(prop("opservant.service", "WatchdogUSec")? == format!("{WATCHDOG_SEC}s"), "watchdog not configured");
    // By now the agent has lived for several watchdog periods: a missed ping would have
    // killed it (SIGABRT) and Restart=on-failure would show.
    let first = prop("opservant.service", "WatchdogTimestampMonotonic")?;
    std::thread::sleep(Duration::from_secs(WATCHDOG_SEC));
    let second = prop("opservant.service", "WatchdogTimestampMonotonic")?;
    ensure!(first != "0" && second != first, "no watchdog pings seen ({first} then {second})");
    ensure!(prop("opservant.service", "NRestarts")? == "0", "the agent was restarted");
    ensure!(sh("systemctl is-active opservant.service").1.trim() == "active", "the agent is no longer active");
    Ok(())
}

fn stop_drains_and_exits_cleanly(_: &Ctx) -> Result<(), String> {
    let running = std::thread::spawn(|| submit(&execute("boot-drain-1", "slow", json!({"seconds": 4}))));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let audit = std::fs::read_to_string("/var/log/opservant/audit.jsonl").unwrap_or_default();
        if audit.lines().any(|l| l.contains("executor_start") && l.contains("boot-drain-1")) {
            break;
        }
        ensure!(Instant::now() < deadline, "the slow command did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let t = Instant::now();
    run("systemctl stop opservant.service")?;
    let stop_secs = t.elapsed().as_secs_f64();
    let (code, r) = running.join().map_err(|_| "submit thread panicked")??;
    ensure!(code == 0 && r["status"] == "completed" && r["output"]["slept"] == 4, "drained command: exit {code}: {r}");
    let waited = stop_secs >= 1.0;
    ensure!(waited, "systemctl stop returned after {stop_secs:.1}s: it did not wait for the command");
    ensure!(prop("opservant.service", "Result")? == "success", "Result: {}", prop("opservant.service", "Result")?);
    ensure!(
        prop("opservant.service", "ExecMainStatus")? == "0",
        "exit status {}",
        prop("opservant.service", "ExecMainStatus")?
    );
    ensure!(prop("opservant.service", "ActiveState")? == "inactive", "not inactive after stop");
    ensure!(!Path::new("/run/opservant/agent.sock").exists(), "the socket outlived the agent");
    // Kept (RuntimeDirectoryPreserve=): command-line sessions and egress runs share it.
    ensure!(Path::new("/run/opservant").is_dir(), "/run/opservant was removed with the service");
    Ok(())
}

fn audit_chain_verifies(_: &Ctx) -> Result<(), String> {
    let out = run(&format!("/usr/bin/opservant audit verify --config {CONFIG}"))?;
    let audit = std::fs::read_to_string("/var/log/opservant/audit.jsonl").unwrap_or_default();
    for id in ["boot-scan-1", "boot-egress-1", "boot-oom-1", "boot-timeout-1", "boot-drain-1"] {
        ensure!(audit.contains(id), "{id} not audited\n{out}");
    }
    // The online assessment of the running system agrees with the offline one.
    let (_, text, _) = sh("systemd-analyze security opservant.service --no-pager");
    let score = text
        .lines()
        .find_map(|l| l.split("exposure level for opservant.service:").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<f64>().ok());
    println!("\n  online exposure: {score:?}");
    ensure!(score.is_some_and(|s| s <= 4.3), "online exposure {score:?} above 4.3:\n{text}");
    Ok(())
}
