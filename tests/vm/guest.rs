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
            // Say so at once: if gathering the diagnosis blocks too, this line is all there is.
            println!("\n[{what}: past the {}s deadline; gathering where the guest's processes wait]", limit.as_secs());
            let _ = std::io::Write::flush(&mut std::io::stdout());
            let diagnosis = where_processes_wait_within(Duration::from_secs(30));
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
            // A process stuck in the kernel may not die: wait for it a while, not forever.
            let reaped = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < reaped {
                std::thread::sleep(Duration::from_millis(20));
            }
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

/// Where every process of the guest waits, gathered on a thread, for at most `limit`: reading a process's `/proc`
/// files can itself block (its `cmdline` needs the address space's lock, which a process
/// stuck in the kernel may hold), so what was gathered by then is returned, naming the file
/// being read.
pub fn where_processes_wait_within(limit: Duration) -> String {
    use std::sync::{Arc, Mutex};
    let text = Arc::new(Mutex::new(String::new()));
    let writer = Arc::clone(&text);
    let gatherer = std::thread::spawn(move || where_processes_wait_into(&writer));
    let until = Instant::now() + limit;
    while !gatherer.is_finished() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut gathered = text.lock().map(|t| t.clone()).unwrap_or_default();
    if !gatherer.is_finished() {
        gathered.push_str(&format!("\n(incomplete: still reading after {}s, see the last line)\n", limit.as_secs()));
    }
    gathered
}

/// For every user-space process: pid, ppid, state, wchan, current syscall and kernel stack;
/// then the kernel's list of blocked tasks (sysrq `w`) from its log.
fn where_processes_wait_into(text: &std::sync::Mutex<String>) {
    let push = |s: &str| {
        if let Ok(mut t) = text.lock() {
            t.push_str(s);
        }
    };
    push("processes of the guest (pid ppid state wchan | cmdline | syscall | stack):\n");
    for (pid, ppid) in procs::table() {
        let dir = PathBuf::from(format!("/proc/{pid}"));
        // While a file is read, the text ends with its name: if the read blocks, the
        // text returned names it.
        let read = |f: &str| {
            let mark = text.lock().map(|mut t| {
                let mark = t.len();
                t.push_str(&format!("[blocked reading /proc/{pid}/{f}]"));
                mark
            });
            let content = std::fs::read(dir.join(f)).unwrap_or_default();
            if let (Ok(mark), Ok(mut t)) = (mark, text.lock()) {
                t.truncate(mark);
            }
            content
        };
        let as_text = |b: Vec<u8>| String::from_utf8_lossy(&b).trim().to_string();
        let stat = as_text(read("stat"));
        let state = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next().map(String::from));
        let cmdline = read("cmdline");
        if cmdline.is_empty() {
            continue; // a kernel thread
        }
        let (wchan, syscall, stack) = (as_text(read("wchan")), as_text(read("syscall")), as_text(read("stack")));
        push(&format!(
            "{pid} {ppid} {} {wchan} | {} | {syscall}\n{stack}\n",
            state.unwrap_or_default(),
            String::from_utf8_lossy(&cmdline).replace('\0', " ").trim_end(),
        ));
    }
    push(&format!("kernel log after sysrq w (blocked tasks):\n{}", blocked_tasks_from_kernel_log()));
}

/// Ask the kernel to log every task in uninterruptible sleep (sysrq `w`) and return what it
/// logged from then on (`/dev/kmsg`, read without blocking; at most the last 300 lines).
fn blocked_tasks_from_kernel_log() -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut kmsg = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open("/dev/kmsg") {
        Ok(f) => f,
        Err(e) => return format!("(/dev/kmsg: {e})\n"),
    };
    // Only what the kernel logs from now on: the blocked tasks.
    // SAFETY: lseek on a descriptor we own; SEEK_END on /dev/kmsg skips the logged records.
    unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&kmsg), 0, libc::SEEK_END) };
    if let Err(e) = std::fs::write("/proc/sysrq-trigger", "w") {
        return format!("(sysrq-trigger: {e})\n");
    }
    let mut lines = std::collections::VecDeque::new();
    let mut record = [0u8; 8192];
    // Each read returns one record; EAGAIN at the end, EPIPE for a record overwritten meanwhile.
    loop {
        match kmsg.read(&mut record) {
            Ok(0) => break,
            Ok(n) => {
                let line = String::from_utf8_lossy(&record[..n]);
                let message = line.split_once(';').map_or(&*line, |(_, m)| m).trim_end().to_string();
                lines.push_back(message);
                if lines.len() > 300 {
                    lines.pop_front();
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    lines.into_iter().map(|l| l + "\n").collect()
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
