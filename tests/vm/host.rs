//! The host side shared by the VM tests (`vm_cgroup_v2`, `vm_systemd`): their prerequisites,
//! and one boot through `tests/vm/vm-exec.sh` that runs this same test binary in the guest
//! (with `OPSERVANT_IN_VM=1`). Included with `#[path = "host.rs"] mod host;`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

/// A VM suite's `main`: inside the guest (`OPSERVANT_IN_VM` set) its checks, on the host the
/// boot that runs them.
pub fn suite(in_vm: fn() -> ExitCode, on_host: fn() -> ExitCode) -> ExitCode {
    if std::env::var_os("OPSERVANT_IN_VM").is_some() {
        in_vm()
    } else {
        on_host()
    }
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

pub fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// The kernel `vm-exec.sh` boots: `VM_KERNEL`, else the newest `/boot/vmlinuz-6.1*`.
fn vm_kernel() -> Option<PathBuf> {
    if let Some(k) = std::env::var_os("VM_KERNEL") {
        return Some(PathBuf::from(k));
    }
    let mut kernels: Vec<PathBuf> = std::fs::read_dir("/boot")
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-6.1")))
        .collect();
    kernels.sort();
    kernels.pop()
}

/// What is missing to boot the VM (each with how to get it); `systemd`: the guest boots the
/// host's systemd as PID 1.
pub fn missing_prerequisites(systemd: bool) -> Vec<String> {
    let mut missing = Vec::new();
    // vng is installed with pip; a pyenv shim may exist on PATH even when the active Python
    // lacks the package, so ask it to run.
    let vng_runs = on_path("vng").is_some_and(|vng| {
        Command::new(vng)
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if !vng_runs {
        missing.push("vng (virtme-ng) on PATH: python3 -m pip install virtme-ng".to_string());
    }
    for (tool, package) in [("qemu-system-x86_64", "qemu-system-x86"), ("busybox", "busybox-static")] {
        if on_path(tool).is_none() {
            missing.push(format!("{tool} on PATH: apt-get install -y {package}"));
        }
    }
    if systemd && !Path::new("/lib/systemd/systemd").is_file() {
        missing.push("systemd on the host root (the guest boots it): apt-get install -y systemd".to_string());
    }
    match vm_kernel() {
        None => missing.push("a /boot/vmlinuz-6.1* kernel: apt-get install -y linux-image-amd64".to_string()),
        Some(k) if std::fs::File::open(&k).is_err() => missing.push(format!("a readable kernel image {}", k.display())),
        Some(k) => {
            let release = k.file_name().map(|n| n.to_string_lossy().trim_start_matches("vmlinuz-").to_string());
            if let Some(r) = release {
                if !Path::new("/lib/modules").join(&r).is_dir() {
                    missing.push(format!("/lib/modules/{r} (the modules of {})", k.display()));
                }
            }
        }
    }
    missing
}

/// `None` when nothing is missing; else the test's exit: a failure under CI (naming what is
/// missing), a visible skip otherwise.
pub fn unless_ready(test: &str, what: &str, missing: &[String]) -> Option<ExitCode> {
    if missing.is_empty() {
        return None;
    }
    let list = missing.join("; ");
    if in_ci() {
        eprintln!("{test}: FAILED: CI=true but the {what} cannot run; missing: {list}");
        return Some(ExitCode::FAILURE);
    }
    println!("SKIPPED: {what} needs {list}");
    Some(ExitCode::SUCCESS)
}

/// The first words of the guest watchdog's report: the runner itself was stuck, outside any
/// command of a check, and the watchdog powered the guest off.
const RUNNER_STUCK: &[u8] = crate::guest::WATCHDOG_REPORT.as_bytes();

/// What the guest's runner prints after a check that failed (`test NAME ... FAILED (SECS s)`).
const CHECK_FAILED: &[u8] = b" ... FAILED (";

/// Boot the VM with `vm-exec.sh` (its variables `env`), run this test binary inside with
/// `OPSERVANT_IN_VM=1` and `guest_env`, and report: the guest's output streams through as it
/// comes; the exit status of `vm-exec.sh` is the test's.
///
/// One exception: when the guest's watchdog reports that the runner itself was stuck (in
/// starting a command, in the guest's file transport — not in a check's assertion, nor in a
/// command under its deadline) and no check had failed before, the diagnosis stays in the
/// output and the VM is booted once more, saying so. Twice stuck fails.
pub fn boot_and_run(test: &str, announce: &str, env: &[(&str, String)], guest_env: &[&str]) -> ExitCode {
    println!("{test}: {announce}");
    match boot_once(test, env, guest_env) {
        Boot::RunnerStuck => {
            println!(
                "{test}: RETRY: the runner in the guest was stuck outside the checks (diagnosis above); \
                 booting the VM once more"
            );
            match boot_once(test, env, guest_env) {
                Boot::Done(code) => code,
                Boot::RunnerStuck => {
                    eprintln!("{test}: FAILED: the runner in the guest was stuck in both boots (diagnoses above)");
                    ExitCode::FAILURE
                }
            }
        }
        Boot::Done(code) => code,
    }
}

/// How long the guest may print nothing before the host gives up on it: its own watchdog
/// reports after the command deadline plus 60 s without progress; beyond that and a
/// margin for a slow boot, the guest is frozen whole (seen in CI: the first check's line,
/// then nothing until the VM's 600 s timeout).
fn silence_limit() -> std::time::Duration {
    let deadline = std::env::var("VM_COMMAND_DEADLINE").ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(150);
    std::time::Duration::from_secs(deadline + 60 + 120)
}

enum Boot {
    Done(ExitCode),
    RunnerStuck,
}

fn boot_once(test: &str, env: &[(&str, String)], guest_env: &[&str]) -> Boot {
    use std::io::Read;
    let script = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("tests/vm/vm-exec.sh");
    let me = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{test}: cannot locate this test binary: {e}");
            return Boot::Done(ExitCode::FAILURE);
        }
    };
    let _ = std::io::stdout().flush();
    let start = Instant::now();
    // The guest's per-command deadline (tests/vm/guest.rs), when set here.
    let deadline = std::env::var("VM_COMMAND_DEADLINE").ok().map(|s| format!("VM_COMMAND_DEADLINE={s}"));
    use std::os::unix::process::CommandExt;
    let child = Command::new(&script)
        // Its own process group: a silent VM is killed whole (the script, its timeout, QEMU).
        .process_group(0)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args(["env", "OPSERVANT_IN_VM=1"])
        .args(guest_env)
        .args(deadline)
        .arg(&me)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{test}: cannot run {}: {e}", script.display());
            return Boot::Done(ExitCode::FAILURE);
        }
    };
    // Pass the guest's output on as it comes (read on a thread, so that silence can be
    // timed), watching for the watchdog's report (which may straddle two reads: the tail of
    // the last one is kept).
    let (mut stuck, mut check_failed) = (false, false);
    if let Some(mut out) = child.stdout.take() {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            loop {
                match out.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx.send(buf[..n].to_vec()).is_err() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        });
        let silence = silence_limit();
        let mut window: Vec<u8> = Vec::new();
        loop {
            let chunk = match rx.recv_timeout(silence) {
                Ok(c) => c,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    // Not even the guest's watchdog (deadline + 60 s) spoke: the guest is
                    // frozen whole, or its console is. Nothing more can be learnt from it.
                    println!(
                        "\n{test}: the guest has been silent for {}s, past its own watchdog: killing the VM",
                        silence.as_secs()
                    );
                    // SIGTERM to our child's process group (process_group(0)): vm-exec.sh's trap
                    // passes it on to `timeout`, which takes QEMU's own group down (and kills
                    // it 15 s later if need be). SIGKILL if that has not ended it in 30 s.
                    let group = -(child.id() as i32);
                    // SAFETY: kill(2) on the process group of our own, not yet reaped child.
                    unsafe { libc::kill(group, libc::SIGTERM) };
                    let until = Instant::now() + std::time::Duration::from_secs(30);
                    while matches!(child.try_wait(), Ok(None)) && Instant::now() < until {
                        std::thread::sleep(std::time::Duration::from_millis(200));
                    }
                    if matches!(child.try_wait(), Ok(None)) {
                        // SAFETY: as above; the child is still running, so not reaped.
                        unsafe { libc::kill(group, libc::SIGKILL) };
                    }
                    let _ = child.wait();
                    return if check_failed { Boot::Done(ExitCode::FAILURE) } else { Boot::RunnerStuck };
                }
            };
            let mut stdout = std::io::stdout().lock();
            let _ = stdout.write_all(&chunk);
            let _ = stdout.flush();
            window.extend_from_slice(&chunk);
            let holds = |marker: &[u8]| window.windows(marker.len()).any(|w| w == marker);
            // A check's failure counts only before the watchdog's report.
            check_failed |= !stuck && holds(CHECK_FAILED);
            stuck |= holds(RUNNER_STUCK);
            let keep = window.len().saturating_sub(RUNNER_STUCK.len().max(CHECK_FAILED.len()));
            window.drain(..keep);
        }
    }
    let status = child.wait();
    let secs = start.elapsed().as_secs_f64();
    match status {
        Ok(s) if s.success() => {
            println!("{test}: passed ({secs:.1}s including boot)");
            Boot::Done(ExitCode::SUCCESS)
        }
        Ok(_) if stuck && !check_failed => {
            eprintln!("{test}: the runner in the guest was stuck after {secs:.1}s");
            Boot::RunnerStuck
        }
        Ok(s) => {
            let why = match s.code() {
                Some(124) => "the VM timed out".to_string(),
                Some(255) => "the VM died without reporting a status".to_string(),
                Some(2) => "vm-exec.sh could not start the VM (or the test could not start)".to_string(),
                Some(c) => format!("exit status {c}"),
                None => format!("{s}"),
            };
            eprintln!("{test}: FAILED after {secs:.1}s: {why}");
            Boot::Done(ExitCode::FAILURE)
        }
        Err(e) => {
            eprintln!("{test}: cannot wait for {}: {e}", script.display());
            Boot::Done(ExitCode::FAILURE)
        }
    }
}
