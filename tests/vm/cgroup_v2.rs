//! The cgroup-v2 kernel suite (see `tests/vm/README.md`).
//!
//! This development host is cgroup v1 hybrid, so real cgroup v2 enforcement is tested in a VM:
//! on the host this binary checks the prerequisites and re-runs itself inside one throw-away
//! QEMU guest (`tests/vm/vm-exec.sh`, booted once for the whole suite); inside the guest
//! (`OPSERVANT_IN_VM=1`) it runs every check in sequence against the real `opservant` binary.
//!
//! Without the prerequisites (virtme-ng, QEMU, a 6.1 kernel image) the suite prints
//! `SKIPPED: ...` and succeeds — unless `CI=true`, where a missing prerequisite is a failure.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "guest.rs"]
#[macro_use]
mod guest;
#[path = "host.rs"]
mod host;

use guest::{output_within, spawn};

const OPSERVANT: &str = env!("CARGO_BIN_EXE_opservant");
const PYTHON: &str = "/usr/bin/python3";
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const DELEG: &str = "/sys/fs/cgroup/opservant-test-deleg";

fn main() -> ExitCode {
    host::suite(in_vm, on_host)
}

// ------------------------------------------------------------------------------------------
// Host side: prerequisites, then one VM for the whole suite.
// ------------------------------------------------------------------------------------------

/// `VM_SUITE_VERBOSE=1`: print every result JSON the checks read.
fn verbose() -> bool {
    std::env::var_os("VM_SUITE_VERBOSE").is_some_and(|v| !v.is_empty() && v != "0")
}

fn on_host() -> ExitCode {
    if let Some(exit) = host::unless_ready("vm_cgroup_v2", "cgroup-v2 VM suite", &host::missing_prerequisites(false)) {
        return exit;
    }
    let guest_env: &[&str] = if verbose() { &["VM_SUITE_VERBOSE=1"] } else { &[] };
    host::boot_and_run(
        "vm_cgroup_v2",
        "booting the cgroup-v2 VM (QEMU/TCG, ~15-35 s) and running the suite inside",
        &[],
        guest_env,
    )
}

// ------------------------------------------------------------------------------------------
// Guest side: a minimal test runner.
// ------------------------------------------------------------------------------------------

/// Shared state of the checks: a fresh scratch directory for manifests.
struct Ctx {
    dir: PathBuf,
}

fn in_vm() -> ExitCode {
    let checks: [(&str, guest::Check<Ctx>); 10] = [
        ("cgroup_v2_reported", cgroup_v2_reported),
        ("memory_oom", memory_oom),
        ("cpu_throttled", cpu_throttled),
        ("pids_limit", pids_limit),
        ("cgroup_kill_daemon", cgroup_kill_daemon),
        ("delegated_subtree", delegated_subtree),
        ("delegated_session", delegated_session),
        ("parent_oom", parent_oom),
        ("landlock_abi2_partial", landlock_abi2_partial),
        ("no_leaks", no_leaks),
    ];
    let dir = std::env::temp_dir().join(format!("opservant-vm-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir(&dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    let ctx = Ctx { dir };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("\nrunning {} cgroup-v2 checks in the VM (kernel {})", checks.len(), kernel.trim());
    let exit = guest::run_checks(&checks, &ctx, false, String::new);
    let _ = std::fs::remove_dir_all(&ctx.dir);
    exit
}

// ------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------

/// One `opservant sandbox --json` run.
struct Run {
    code: i32,
    json: Value,
    stderr: String,
}

impl Run {
    /// The field at a dotted path (`usage.oom_kills`), or an error naming it.
    fn get(&self, path: &str) -> Result<&Value, String> {
        let mut v = &self.json;
        for key in path.split('.') {
            v = v.get(key).ok_or_else(|| format!("result has no `{path}`\n{}", self.dump()))?;
        }
        Ok(v)
    }

    fn u64(&self, path: &str) -> Result<u64, String> {
        self.get(path)?.as_u64().ok_or_else(|| format!("`{path}` is not a number\n{}", self.dump()))
    }

    fn str(&self, path: &str) -> Result<&str, String> {
        self.get(path)?.as_str().ok_or_else(|| format!("`{path}` is not a string\n{}", self.dump()))
    }

    fn strings(&self, path: &str) -> Result<Vec<&str>, String> {
        self.get(path)?
            .as_array()
            .ok_or_else(|| format!("`{path}` is not an array\n{}", self.dump()))?
            .iter()
            .map(|v| v.as_str().ok_or_else(|| format!("`{path}` holds a non-string\n{}", self.dump())))
            .collect()
    }

    /// Everything about the run, for failure messages.
    fn dump(&self) -> String {
        format!("exit code {}\nresult: {}\nstderr: {}", self.code, self.json, self.stderr.trim_end())
    }
}

fn parse_run(out: std::process::Output, what: &str) -> Result<Run, String> {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let code = out.status.code().unwrap_or(-1);
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    let json = serde_json::from_str(last).map_err(|e| {
        format!(
            "{what}: no result JSON on stdout ({e}); exit status {}\nstdout: {stdout}\nstderr: {stderr}",
            out.status
        )
    })?;
    if verbose() {
        println!("\n  [{what}] exit {code}: {json}");
    }
    Ok(Run { code, json, stderr })
}

/// `opservant sandbox [--manifest M] --json -- PROG...`
fn sandbox(manifest: Option<&Path>, prog: &[&str]) -> Result<Run, String> {
    let mut cmd = Command::new(OPSERVANT);
    cmd.arg("sandbox");
    if let Some(m) = manifest {
        cmd.arg("--manifest").arg(m);
    }
    cmd.arg("--json").arg("--").args(prog);
    let what = format!("opservant sandbox -- {}", prog.join(" "));
    let out = output_within(spawn(cmd, OPSERVANT)?, &what)?;
    parse_run(out, &what)
}

/// Write a manifest with these resource limits; returns its path.
fn manifest(ctx: &Ctx, name: &str, limits: Value) -> Result<PathBuf, String> {
    let m = json!({
        "name": "t",
        "version": "1.0.0",
        "description": "d",
        "supported_actions": ["a"],
        "entry_point": "m.C",
        "permissions": {},
        "resource_limits": limits,
    });
    let path = ctx.dir.join(format!("{name}.json"));
    std::fs::write(&path, m.to_string()).map_err(|e| format!("write {}: {e}", path.display()))?;
    Ok(path)
}

fn python(script: &str) -> Vec<&str> {
    vec![PYTHON, "-I", "-S", "-c", script]
}

/// Every directory named `opservant-sb-*` anywhere under /sys/fs/cgroup.
fn sandbox_cgroups() -> Vec<PathBuf> {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let p = e.path();
            if e.file_name().to_string_lossy().starts_with("opservant-sb-") {
                found.push(p.clone());
            }
            walk(&p, found);
        }
    }
    let mut found = Vec::new();
    walk(Path::new(CGROUP_ROOT), &mut found);
    found
}

/// Pids (other than this process) whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(marker) {
            found.push((pid, cmdline.trim_end().to_string()));
        }
    }
    found
}

fn no_sandbox_cgroups() -> Result<(), String> {
    let left = sandbox_cgroups();
    ensure!(left.is_empty(), "sandbox cgroups left behind: {left:?}");
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The checks
// ------------------------------------------------------------------------------------------

/// A trivial run reports cgroup v2 with every limit enforced, in cgroups under /sys/fs/cgroup.
fn cgroup_v2_reported(_: &Ctx) -> Result<(), String> {
    let r = sandbox(None, &["true"])?;
    ensure!(r.code == 0 && r.str("status")? == "completed", "trivial run did not complete\n{}", r.dump());
    ensure!(r.str("sandbox.cgroup")? == "v2", "sandbox.cgroup is not v2\n{}", r.dump());
    for c in ["memory", "cpu", "pids"] {
        let v = r.get(&format!("limits.enforced.{c}"))?;
        ensure!(v == &Value::Bool(true), "limits.enforced.{c} is {v}, not true\n{}", r.dump());
    }
    let paths = r.strings("sandbox.cgroup_paths")?;
    ensure!(!paths.is_empty(), "no sandbox.cgroup_paths\n{}", r.dump());
    for p in &paths {
        ensure!(p.starts_with("/sys/fs/cgroup/"), "cgroup path {p} is not under /sys/fs/cgroup\n{}", r.dump());
        ensure!(
            Path::new(p).file_name().is_some_and(|n| n.to_string_lossy().starts_with("opservant-sb-")),
            "cgroup path {p} is not an opservant-sb-* cgroup\n{}",
            r.dump()
        );
        ensure!(!Path::new(p).exists(), "sandbox cgroup {p} still exists after the run");
    }
    ensure!(r.get("sandbox.cgroup_paths")?.as_array().is_some_and(|a| a.len() == 1), "v2 uses exactly one cgroup");
    Ok(())
}

/// A memory bomb is OOM-killed inside a 32 MB cgroup.
fn memory_oom(ctx: &Ctx) -> Result<(), String> {
    let m = manifest(
        ctx,
        "oom",
        json!({"max_memory_mb": 32, "max_cpu_percent": 50, "timeout_seconds": 120, "max_disk_mb": 16, "max_pids": 16}),
    )?;
    // b'\x01' * n touches every page (a zero-filled bytearray might not).
    let script = "import sys\na = []\nfor i in range(200):\n    a.append(b'\\x01' * (1 << 20))\n\
                  print('survived', len(a), flush=True)\n";
    let r = sandbox(Some(&m), &python(script))?;
    ensure!(r.str("status")? == "failed", "status is not failed\n{}", r.dump());
    ensure!(r.code == 1, "exit code is not 1\n{}", r.dump());
    ensure!(r.get("killed_by")? == "oom", "killed_by is not oom\n{}", r.dump());
    ensure!(r.u64("usage.oom_kills")? >= 1, "usage.oom_kills < 1\n{}", r.dump());
    ensure!(!r.str("stdout")?.contains("survived"), "the payload survived the memory bomb\n{}", r.dump());
    ensure!(
        r.str("error")?.ends_with("out of memory (limit 32 MB)"),
        "the error does not name the limit\n{}",
        r.dump()
    );
    no_sandbox_cgroups()
}

/// An OOM kill a parent cgroup caused (the delegated subtree allowed 64 MB, the sandbox 512
/// MB) ends the sandbox as a whole, and is not blamed on the sandbox's limit: its
/// `memory.events` counts no `oom` of its own.
fn parent_oom(ctx: &Ctx) -> Result<(), String> {
    let m = manifest(
        ctx,
        "parent-oom",
        json!({"max_memory_mb": 512, "max_cpu_percent": 50, "timeout_seconds": 120, "max_disk_mb": 16, "max_pids": 16}),
    )?;
    in_delegated_cgroup(|| {
        let limit = Path::new(DELEG).join("memory.max");
        std::fs::write(&limit, (64u64 << 20).to_string()).map_err(|e| format!("write {}: {e}", limit.display()))?;
        // b'\x01' * n touches every page.
        let payload = format!("{PYTHON} -I -S -c \"b'\\x01' * (256 << 20)\"; sleep 3; echo survived; exit 0");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &format!("echo $$ > {DELEG}/cgroup.procs && exec \"$0\" \"$@\""), OPSERVANT, "sandbox"])
            .arg("--manifest")
            .arg(&m)
            .args(["--json", "--", "/bin/sh", "-c", &payload]);
        let what = "opservant sandbox in a 64 MB parent";
        let r = parse_run(output_within(spawn(cmd, "sh")?, what)?, what)?;
        ensure!(r.str("status")? == "failed", "status is not failed\n{}", r.dump());
        ensure!(r.get("killed_by")? == "oom", "killed_by is not oom\n{}", r.dump());
        ensure!(!r.str("stdout")?.contains("survived"), "the shell went on\n{}", r.dump());
        ensure!(
            r.str("error")?.contains("a parent cgroup ran out; the sandbox's limit of 512 MB was not reached"),
            "the error blames the sandbox's limit\n{}",
            r.dump()
        );
        no_sandbox_cgroups()
    })
}

/// A busy loop at 10 % CPU is throttled: the kernel's CPU accounting stays near the quota.
fn cpu_throttled(ctx: &Ctx) -> Result<(), String> {
    let m = manifest(
        ctx,
        "cpu",
        json!({"max_memory_mb": 128, "max_cpu_percent": 10, "timeout_seconds": 120, "max_disk_mb": 16, "max_pids": 16}),
    )?;
    let script = "import time\nt = time.monotonic()\nn = 0\nwhile time.monotonic() - t < 2.0:\n    n += 1\nprint(n)\n";
    let r = sandbox(Some(&m), &python(script))?;
    ensure!(r.code == 0 && r.str("status")? == "completed", "busy loop did not complete\n{}", r.dump());
    let throttled = r.u64("usage.cpu_throttled_periods")?;
    let cpu = r.u64("usage.cpu_ms")?;
    let wall = r.u64("usage.wall_ms")?;
    ensure!(throttled > 0, "usage.cpu_throttled_periods is 0\n{}", r.dump());
    // cpu <= wall * 0.10 * 1.5 + 50, in integers: 20 * cpu <= 3 * wall + 1000.
    let bound = (3 * wall + 1000) / 20;
    ensure!(20 * cpu <= 3 * wall + 1000, "cpu_ms {cpu} > wall_ms {wall} * 0.10 * 1.5 + 50 = {bound}\n{}", r.dump());
    no_sandbox_cgroups()
}

/// A fork bomb stops at max_pids: fork fails with EAGAIN and pids.events counts it.
fn pids_limit(ctx: &Ctx) -> Result<(), String> {
    let m = manifest(
        ctx,
        "pids",
        json!({"max_memory_mb": 128, "max_cpu_percent": 50, "timeout_seconds": 120, "max_disk_mb": 16, "max_pids": 8}),
    )?;
    let script = "import os, time\nn = 0\nerr = None\nwhile n < 100:\n    try:\n        pid = os.fork()\n    \
                  except OSError as e:\n        err = e.errno\n        break\n    if pid == 0:\n        \
                  time.sleep(60)\n        os._exit(0)\n    n += 1\nprint('forked', n, 'errno', err, flush=True)\n";
    let r = sandbox(Some(&m), &python(script))?;
    let out = r.str("stdout")?;
    let line =
        out.lines().find(|l| l.starts_with("forked ")).ok_or_else(|| format!("no count printed\n{}", r.dump()))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let count: u64 = words.get(1).and_then(|w| w.parse().ok()).ok_or_else(|| format!("bad line {line:?}"))?;
    let errno = words.get(3).copied().unwrap_or("?");
    ensure!(count >= 1, "no fork succeeded at all\n{}", r.dump());
    ensure!(count <= 8, "forked {count} children with max_pids 8\n{}", r.dump());
    ensure!(errno == libc::EAGAIN.to_string(), "fork failed with errno {errno}, not EAGAIN\n{}", r.dump());
    ensure!(r.u64("usage.pids_limit_hits")? > 0, "usage.pids_limit_hits is 0\n{}", r.dump());
    no_sandbox_cgroups()
}

/// A SIGTERM-ignoring payload with a double-forked, setsid'd, SIGTERM-ignoring daemon is
/// killed at the timeout, daemon included, and its cgroup is removed.
fn cgroup_kill_daemon(ctx: &Ctx) -> Result<(), String> {
    let m = manifest(
        ctx,
        "daemon",
        json!({"max_memory_mb": 64, "max_cpu_percent": 50, "timeout_seconds": 8, "max_disk_mb": 16, "max_pids": 16}),
    )?;
    let marker = format!("opservant-vm-daemon-{}", std::process::id());
    // The daemon: a shell (argv[0] = the marker) that ignores SIGTERM and waits on a sleep
    // that inherits the ignored SIGTERM; `; true` keeps the shell from exec'ing the sleep.
    // The ( ... & ) subshell exits at once, so the daemon is re-parented (double fork).
    let script =
        format!("trap '' TERM; ( setsid sh -c 'trap \"\" TERM; sleep 1000; true' {marker} & ); sleep 1000; true");
    let mut cmd = Command::new(OPSERVANT);
    cmd.args(["sandbox", "--manifest"]).arg(&m).args(["--json", "--", "sh", "-c", &script]);
    let child = spawn(cmd, OPSERVANT)?;
    // Positive control: the daemon must really run before the timeout hits, or this check
    // would prove nothing. Only the daemon's own argv is "... {marker}" at its end.
    let daemon_tail = format!("true {marker}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while Instant::now() < deadline && seen.is_empty() {
        seen = processes_with(&daemon_tail);
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = output_within(child, "daemon run")?;
    let r = parse_run(out, "daemon run")?;
    ensure!(!seen.is_empty(), "the daemon was never seen running; the check proves nothing\n{}", r.dump());
    // DESIGN.md §4: a plain program's status is `completed` or `failed`; `killed_by` says why.
    ensure!(r.str("status")? == "failed", "status is not failed\n{}", r.dump());
    ensure!(r.code == 1, "exit code is not 1\n{}", r.dump());
    ensure!(r.get("killed_by")? == "timeout", "killed_by is not timeout\n{}", r.dump());
    let left = processes_with(&marker);
    ensure!(left.is_empty(), "processes survived the sandbox: {left:?} (daemon was {seen:?})\n{}", r.dump());
    no_sandbox_cgroups()
}

/// Run opservant inside a delegated subtree: it moves itself into a leaf and creates the
/// sandbox cgroup beside it, never above; the sandbox sees its cgroup as the root.
fn delegated_subtree(_: &Ctx) -> Result<(), String> {
    in_delegated_cgroup(delegated_subtree_inner)
}

/// Run `check` with [`DELEG`] made (the controllers enabled at the root), then remove it and
/// opservant's leaf in it — even on failure, waiting a little for processes to leave;
/// a cleanup failure is reported only if the check passed.
fn in_delegated_cgroup(check: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    let root_ctl = Path::new(CGROUP_ROOT).join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&root_ctl).map_err(|e| format!("read {}: {e}", root_ctl.display()))?;
    for c in ["memory", "cpu", "pids"] {
        if !enabled.split_whitespace().any(|e| e == c) {
            std::fs::write(&root_ctl, format!("+{c}")).map_err(|e| format!("enable +{c} at the root: {e}"))?;
        }
    }
    if !Path::new(DELEG).exists() {
        std::fs::create_dir(DELEG).map_err(|e| format!("mkdir {DELEG}: {e}"))?;
    }
    let result = check();
    let leaf = Path::new(DELEG).join("opservant-agent");
    let mut cleanup = Ok(());
    for d in [leaf.as_path(), Path::new(DELEG)] {
        let deadline = Instant::now() + Duration::from_secs(5);
        while d.exists() {
            match std::fs::remove_dir(d) {
                Ok(()) => {}
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => {
                    cleanup = Err(format!("cannot remove {}: {e}", d.display()));
                    break;
                }
            }
        }
    }
    result.and(cleanup)
}

/// A session started from a delegated cgroup: its daemon creates the sandbox's cgroups
/// while the `session start` that spawned it still waits in the same cgroup. Before the
/// starter moved itself into its leaf first, the daemon found a process it had not started
/// in its cgroup and refused the v2 controllers (every start failed, or ran with no limit
/// under `allow_degraded`).
fn delegated_session(ctx: &Ctx) -> Result<(), String> {
    // Half a CPU (the ceiling): at the default 10 % the interpreter's start under TCG, which
    // takes ~2 s of a whole CPU, came close to the session's 30 s start limit and once, on a
    // busy host, passed it.
    let m = manifest(ctx, "deleg-session", json!({"max_cpu_percent": 50}))?;
    in_delegated_cgroup(|| delegated_session_inner(&m))
}

fn delegated_session_inner(manifest: &Path) -> Result<(), String> {
    let name = format!("vm-deleg-{}", std::process::id());
    let script = format!(
        "echo $$ > {DELEG}/cgroup.procs && exec {OPSERVANT} session start {name} --manifest {}",
        manifest.display()
    );
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &script]);
    let out = output_within(spawn(cmd, "sh")?, "delegated session start")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let started: Value = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
    ensure!(
        out.status.success() && started["status"] == "started",
        "the session did not start: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let prefix = format!("{DELEG}/opservant-sb-");
    let in_deleg = sandbox_cgroups().iter().filter(|p| p.to_string_lossy().starts_with(&prefix)).count();
    let exec =
        Command::new(OPSERVANT).args(["session", "exec", &name, "--code", "x = 6 * 7", "--return", "x"]).output();
    let stop = Command::new(OPSERVANT).args(["session", "stop", &name]).output();
    ensure!(in_deleg == 1, "the session's sandbox cgroup is not in {DELEG}: {:?}", sandbox_cgroups());
    let exec = exec.map_err(|e| format!("session exec: {e}"))?;
    ensure!(
        String::from_utf8_lossy(&exec.stdout).contains("\"x\":42"),
        "session exec: {} {}",
        String::from_utf8_lossy(&exec.stdout),
        String::from_utf8_lossy(&exec.stderr)
    );
    let stop = stop.map_err(|e| format!("session stop: {e}"))?;
    ensure!(stop.status.success(), "session stop: {}", String::from_utf8_lossy(&stop.stderr));
    no_sandbox_cgroups()
}

fn delegated_subtree_inner() -> Result<(), String> {
    let script = format!("echo $$ > {DELEG}/cgroup.procs && exec {OPSERVANT} sandbox --json -- cat /proc/self/cgroup");
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &script]);
    let out = output_within(spawn(cmd, "sh")?, "delegated run")?;
    let r = parse_run(out, "delegated run")?;
    ensure!(r.code == 0 && r.str("status")? == "completed", "delegated run did not complete\n{}", r.dump());
    ensure!(r.str("stdout")? == "0::/\n", "the sandbox does not see its cgroup as the root\n{}", r.dump());
    let paths = r.strings("sandbox.cgroup_paths")?;
    let prefix = format!("{DELEG}/opservant-sb-");
    ensure!(
        paths.first().is_some_and(|p| p.starts_with(&prefix)),
        "sandbox.cgroup_paths[0] does not start with {prefix}\n{}",
        r.dump()
    );
    ensure!(r.str("sandbox.cgroup")? == "v2", "sandbox.cgroup is not v2\n{}", r.dump());
    let leaf = Path::new(DELEG).join("opservant-agent");
    ensure!(leaf.is_dir(), "{} does not exist: opservant did not move into its leaf\n{}", leaf.display(), r.dump());
    for p in &paths {
        ensure!(!Path::new(p).exists(), "sandbox cgroup {p} still exists after the run");
    }
    // The controllers were enabled in the delegated cgroup, not only inherited.
    let ctl = std::fs::read_to_string(Path::new(DELEG).join("cgroup.subtree_control")).unwrap_or_default();
    for c in ["memory", "cpu", "pids"] {
        ensure!(
            ctl.split_whitespace().any(|e| e == c),
            "{c} is not enabled in {DELEG}/cgroup.subtree_control: {ctl:?}"
        );
    }
    no_sandbox_cgroups()
}

/// Landlock ABI 2: enforced rights are reported, newer ones listed as unsupported; doctor
/// agrees, and reports the v2 controllers.
fn landlock_abi2_partial(_: &Ctx) -> Result<(), String> {
    let r = sandbox(None, &["true"])?;
    ensure!(r.code == 0, "trivial run failed\n{}", r.dump());
    ensure!(r.u64("sandbox.landlock.abi")? == 2, "landlock abi is not 2\n{}", r.dump());
    ensure!(r.str("sandbox.landlock.status")? == "partially_enforced", "landlock not partially_enforced\n{}", r.dump());
    let fs_unsupported = r.strings("sandbox.landlock.fs_unsupported")?;
    for right in ["truncate", "ioctl_dev", "resolve_unix"] {
        ensure!(fs_unsupported.contains(&right), "fs_unsupported lacks {right}\n{}", r.dump());
    }
    let scopes = r.strings("sandbox.landlock.scopes_unsupported")?;
    for scope in ["signal", "abstract_unix_socket"] {
        ensure!(scopes.contains(&scope), "scopes_unsupported lacks {scope}\n{}", r.dump());
    }
    let fs_enforced = r.strings("sandbox.landlock.fs_enforced")?;
    ensure!(fs_enforced.contains(&"refer"), "fs_enforced lacks refer (ABI 2)\n{}", r.dump());
    for right in ["truncate", "ioctl_dev", "resolve_unix"] {
        ensure!(!fs_enforced.contains(&right), "fs_enforced claims {right} on ABI 2\n{}", r.dump());
    }

    let mut cmd = Command::new(OPSERVANT);
    cmd.args(["doctor", "--json"]);
    let out = output_within(spawn(cmd, OPSERVANT)?, "opservant doctor")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let doc: Value = serde_json::from_str(text.trim()).map_err(|e| {
        format!("doctor --json is not JSON ({e}); {}\n{text}\n{}", out.status, String::from_utf8_lossy(&out.stderr))
    })?;
    let abi = doc.pointer("/probe/landlock/abi").and_then(Value::as_u64);
    ensure!(abi == Some(2), "doctor: probe.landlock.abi is {abi:?}, not 2\n{doc}");
    for c in ["memory", "cpu", "pids"] {
        let v = doc.pointer(&format!("/probe/cgroup/{c}/version")).and_then(Value::as_str);
        ensure!(v == Some("v2"), "doctor: probe.cgroup.{c}.version is {v:?}, not v2\n{doc}");
    }
    // Linux 6.1 has cgroup.kill, even though the root cgroup (where the suite runs) lacks the file.
    let kill = doc.pointer("/probe/cgroup/cgroup_kill").and_then(Value::as_bool);
    ensure!(kill == Some(true), "doctor: probe.cgroup.cgroup_kill is {kill:?}, not true on Linux 6.1\n{doc}");
    Ok(())
}

/// Nothing the suite ran left a sandbox cgroup behind.
fn no_leaks(_: &Ctx) -> Result<(), String> {
    no_sandbox_cgroups()?;
    ensure!(!Path::new(DELEG).exists(), "{DELEG} was not cleaned up");
    Ok(())
}
