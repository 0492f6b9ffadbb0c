//! Guest side of the VM suites (`tests/vm/README.md`): running a command of a check under a
//! deadline, and, past it, showing where every process of the guest waits — so a hang
//! fails with a diagnosis instead of running into the VM's own timeout silently.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../common/procs.rs"]
mod procs;

/// `ensure!(condition, "message {}", args)`: fail the check with the message unless it holds.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// How long one command of a check may take (TCG is slow, but no check needs a minute): a
/// hang becomes a failure that shows where every process waits, not a silent VM timeout.
/// `VM_COMMAND_DEADLINE=SECS` (passed on to the guest) changes it.
pub fn command_deadline() -> Duration {
    let secs = std::env::var("VM_COMMAND_DEADLINE").ok().and_then(|s| s.parse().ok()).unwrap_or(150);
    Duration::from_secs(secs)
}

/// Start `cmd` with stdin from /dev/null and stdout/stderr captured.
pub fn spawn(mut cmd: Command, name: &str) -> Result<std::process::Child, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {name}: {e}"))
}

/// Wait for `child` to exit and its output pipes to close, or, past [`command_deadline`],
/// report where every process of the guest waits (state, wchan, syscall, kernel stack), kill
/// the child and its descendants, and fail. (A process left holding a pipe after the child
/// exited counts as a hang too: `Command::output` would wait for it forever.)
pub fn output_within(mut child: std::process::Child, what: &str) -> Result<std::process::Output, String> {
    use std::io::Read;
    fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    }
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let limit = command_deadline();
    let deadline = Instant::now() + limit;
    let mut status = None;
    loop {
        if status.is_none() {
            status = child.try_wait().map_err(|e| format!("{what}: wait: {e}"))?;
        }
        if status.is_some() && out.is_finished() && err.is_finished() {
            break;
        }
        if Instant::now() >= deadline {
            let diagnosis = where_processes_wait();
            let state = match status {
                None => "still running".to_string(),
                Some(s) => format!("exited ({s}), but its output pipes are still held open"),
            };
            for pid in procs::descendants(child.id() as i32) {
                // SAFETY: kill(2) with a pid read from /proc; a pid reused meanwhile by
                // another guest process would be killed too, which the throw-away VM allows.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = child.kill();
            let _ = child.wait();
            // The readers are left behind if something still holds a pipe.
            let stderr = match err.is_finished() {
                true => String::from_utf8_lossy(&err.join().unwrap_or_default()).into_owned(),
                false => "(not closed)".into(),
            };
            return Err(format!("{what}: {state} after {}s; killed\nstderr: {stderr}\n{diagnosis}", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = status.ok_or_else(|| format!("{what}: no exit status"))?;
    Ok(std::process::Output {
        status,
        stdout: out.join().map_err(|_| format!("{what}: stdout reader panicked"))?,
        stderr: err.join().map_err(|_| format!("{what}: stderr reader panicked"))?,
    })
}

/// For every user-space process: pid, ppid, state, wchan, current syscall and kernel stack.
pub fn where_processes_wait() -> String {
    let mut text = String::from("processes of the guest (pid ppid state wchan | cmdline | syscall | stack):\n");
    for (pid, ppid) in procs::table() {
        let dir = PathBuf::from(format!("/proc/{pid}"));
        let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
        if cmdline.is_empty() {
            continue; // a kernel thread
        }
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default().trim().to_string();
        let state = read("stat").rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next().map(String::from));
        text.push_str(&format!(
            "{pid} {ppid} {} {} | {} | {}\n{}\n",
            state.unwrap_or_default(),
            read("wchan"),
            String::from_utf8_lossy(&cmdline).replace('\0', " ").trim_end(),
            read("syscall"),
            read("stack")
        ));
    }
    text
}

/// A check of a suite: it passes, or says why not.
pub type Check<C> = fn(&C) -> Result<(), String>;

/// Run the checks in order (`test NAME ... ok|FAILED (secs)`), a panic counting as a failure;
/// with `stop_at_first_failure` the rest are not run (each builds on the last). Then print
/// each failure, whatever `on_failure` adds (logs of the unit under test), and a summary.
pub fn run_checks<C: std::panic::RefUnwindSafe>(
    checks: &[(&str, Check<C>)],
    ctx: &C,
    stop_at_first_failure: bool,
    on_failure: impl Fn() -> String,
) -> std::process::ExitCode {
    use std::io::Write;
    let start = Instant::now();
    let mut failed: Vec<(&str, String)> = Vec::new();
    let mut passed = 0;
    for (name, check) in checks {
        if stop_at_first_failure && !failed.is_empty() {
            break;
        }
        print!("test {name} ... ");
        let _ = std::io::stdout().flush();
        let t = Instant::now();
        let result = std::panic::catch_unwind(|| check(ctx)).unwrap_or_else(|p| {
            Err(format!(
                "panicked: {}",
                p.downcast_ref::<String>().map(String::as_str).or(p.downcast_ref::<&str>().copied()).unwrap_or("?")
            ))
        });
        let secs = t.elapsed().as_secs_f64();
        match result {
            Ok(()) => {
                println!("ok ({secs:.1}s)");
                passed += 1;
            }
            Err(msg) => {
                println!("FAILED ({secs:.1}s)");
                failed.push((name, msg));
            }
        }
    }
    for (name, msg) in &failed {
        println!("\n---- {name} ----\n{msg}");
    }
    if !failed.is_empty() {
        println!("{}", on_failure());
    }
    println!(
        "\ntest result: {}. {passed} passed; {} failed; {} not run; finished in {:.1}s",
        if failed.is_empty() { "ok" } else { "FAILED" },
        failed.len(),
        checks.len() - passed - failed.len(),
        start.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
