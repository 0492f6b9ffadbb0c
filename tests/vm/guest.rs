//! Guest side of the VM suites (`tests/vm/README.md`): running a command of a check under a
//! deadline, and, past it, showing where every process of the guest waits — so a hang
//! fails with a diagnosis instead of running into the VM's own timeout silently. A watchdog
//! thread backs that up for a runner that is stuck itself (see [`start_watchdog`]).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
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

/// The runner's last sign of progress: what it went on to do, and when.
static PROGRESS: Mutex<Option<(String, Instant)>> = Mutex::new(None);

/// Note that the runner has gone on to `what` (a check's start, a command's wait, its end).
fn progress(what: String) {
    if let Ok(mut p) = PROGRESS.lock() {
        *p = Some((what, Instant::now()));
    }
}

/// The first words of the watchdog's report: `tests/vm/host.rs` boots once more on them.
pub const WATCHDOG_REPORT: &str = "[watchdog: no progress";

/// Write `text` to fd 1 directly, past std's stdout lock: a stuck thread may hold that lock.
fn say(text: &str) {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    // SAFETY: fd 1 is open for the life of the process; ManuallyDrop never closes it, so the
    // File only borrows the descriptor.
    let mut out = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(1) });
    let _ = out.write_all(text.as_bytes());
}

/// The backstop for a runner that is stuck itself, where [`output_within`]'s deadline cannot
/// fire: in `Command::spawn` (which waits for the child's `exec`), in a check's own file or
/// cgroup access, in a write to the console. Once the runner has shown no progress for the
/// command deadline plus a minute, the watchdog thread prints (straight to fd 1) what it was
/// doing and where every process of the guest waits, then powers the guest off (sysrq `o`):
/// a thread stuck in the kernel can keep the process from ever exiting. The run then fails
/// with that diagnosis ("the VM died without reporting a status") well before the VM's own
/// timeout, which a CI run once reached in its first check without printing anything.
fn start_watchdog() {
    let spawned = std::thread::Builder::new().name("watchdog".into()).spawn(|| {
        let limit = command_deadline() + Duration::from_secs(60);
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let stuck = PROGRESS.lock().ok().and_then(|p| p.clone()).filter(|(_, since)| since.elapsed() > limit);
            let Some((what, since)) = stuck else { continue };
            say(&format!(
                "\n{WATCHDOG_REPORT} for {}s since the runner went on to {what}; the runner itself \
                 is stuck; gathering where the guest's processes wait]\n",
                since.elapsed().as_secs()
            ));
            say(&where_processes_wait_within(Duration::from_secs(30)));
            say("\ntest result: FAILED. the runner was stuck (above); powering the guest off\n");
            // Let the console take the text before the guest goes away.
            std::thread::sleep(Duration::from_secs(2));
            if let Err(e) = std::fs::write("/proc/sysrq-trigger", "o") {
                say(&format!("(sysrq o: {e}; the VM's own timeout ends the run)\n"));
            }
            return;
        }
    });
    if let Err(e) = spawned {
        println!("(no watchdog thread: {e}; a stuck runner ends in the VM's timeout)");
    }
}

/// Start `cmd` with stdin from /dev/null and stdout/stderr captured.
pub fn spawn(mut cmd: Command, name: &str) -> Result<std::process::Child, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {name}: {e}"))
}

/// `sh -c CMD` under the command deadline: (exit code, stdout, stderr); a command past the
/// deadline gives -1 and the diagnosis as its stderr.
#[allow(dead_code)] // each suite uses its part
pub fn sh(cmd: &str) -> (i32, String, String) {
    let mut command = Command::new("sh");
    command.args(["-c", cmd]);
    match spawn(command, "sh").and_then(|child| output_within(child, &format!("`{cmd}`"))) {
        Ok(o) => (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        ),
        Err(e) => (-1, String::new(), e),
    }
}

/// `sh -c CMD`, which must succeed; its stdout.
#[allow(dead_code)] // each suite uses its part
pub fn sh_ok(cmd: &str) -> Result<String, String> {
    let (code, out, err) = sh(cmd);
    ensure!(code == 0, "`{cmd}` exited {code}\nstdout: {out}\nstderr: {err}");
    Ok(out)
}

/// `argv` with `input` on its stdin, under the command deadline: (exit code, stdout, stderr).
#[allow(dead_code)] // each suite uses its part
pub fn pipe(argv: &[&str], input: &[u8]) -> Result<(i32, String, String), String> {
    use std::io::Write;
    let mut child = Command::new(argv[0])
        .args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", argv[0]))?;
    let stdin = child.stdin.take().ok_or("no stdin pipe")?;
    { stdin }.write_all(input).map_err(|e| format!("write to {}: {e}", argv[0]))?;
    let o = output_within(child, &argv.join(" "))?;
    Ok((
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    ))
}

/// Sign `cmd` with the private key at `key` (`opservant sign`) and hand it to `submit` (an
/// `opservant submit -` command line, with its socket if not the default): (exit code, reply).
/// `context` is added to the error when the reply is not JSON (the agent's log, say).
#[allow(dead_code)] // each suite uses its part
pub fn sign_and_submit(
    key: &str,
    submit: &[&str],
    cmd: &serde_json::Value,
    context: impl FnOnce() -> String,
) -> Result<(i32, serde_json::Value), String> {
    let (code, signed, err) =
        pipe(&[env!("CARGO_BIN_EXE_opservant"), "sign", "--key", key, "-"], cmd.to_string().as_bytes())?;
    ensure!(code == 0, "opservant sign exited {code}: {err}");
    let (code, out, err) = pipe(submit, signed.as_bytes())?;
    let reply = serde_json::from_str(out.trim())
        .map_err(|e| format!("submit: no JSON reply ({e}): {out}\n{err}\n{}", context()))?;
    Ok((code, reply))
}

/// A Python executor package `name` at `version` in the directory `dir` (made): `prelude`
/// runs when its module is imported, class `Exec` in `pkg/main.py` runs `body` (lines
/// indented by eight) as its `execute`.
#[allow(dead_code)] // each suite uses its part
pub fn executor_package(
    dir: &std::path::Path,
    name: &str,
    version: &str,
    prelude: &str,
    permissions: serde_json::Value,
    limits: serde_json::Value,
    body: &str,
) -> Result<PathBuf, String> {
    let pkg = dir.join(name.replace('-', "_"));
    let io = |e: std::io::Error| format!("write executor {name}: {e}");
    std::fs::create_dir_all(&pkg).map_err(io)?;
    std::fs::write(pkg.join("__init__.py"), "").map_err(io)?;
    let code = format!(
        "{prelude}from opservant.executor import BaseExecutor, ExecutorResult\n\n\nclass Exec(BaseExecutor):\n    \
         def validate(self, params):\n        return True\n\n    def execute(self, params, context):\n{body}"
    );
    std::fs::write(pkg.join("main.py"), code).map_err(io)?;
    let manifest = serde_json::json!({
        "name": name, "version": version, "description": "VM test", "author": "tests",
        "supported_actions": [format!("act-{name}")],
        "entry_point": format!("{}.main.Exec", name.replace('-', "_")),
        "permissions": permissions, "resource_limits": limits,
    });
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).map_err(io)?;
    Ok(dir.to_path_buf())
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
    progress(format!("wait for {what}"));
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
            progress(format!("what follows {what}"));
            return Err(format!("{what}: {state} after {}s; killed\nstderr: {stderr}\n{diagnosis}", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    progress(format!("what follows {what}"));
    let status = status.ok_or_else(|| format!("{what}: no exit status"))?;
    Ok(std::process::Output {
        status,
        stdout: out.join().map_err(|_| format!("{what}: stdout reader panicked"))?,
        stderr: err.join().map_err(|_| format!("{what}: stderr reader panicked"))?,
    })
}

/// A request to the gatherer thread: the text to fill, and a channel to say it is done.
type GatherJob = (Arc<Mutex<String>>, mpsc::Sender<()>);

/// The gatherer thread's queue, once [`start_gatherer`] has run.
static GATHERER: Mutex<Option<mpsc::Sender<GatherJob>>> = Mutex::new(None);

/// Start the thread that gathers [`where_processes_wait_within`]'s report, ahead of any
/// need: when the runner is stuck, starting a thread may be stuck too (`clone` waits for
/// the cgroup core's fork lock, which a stuck cgroup migration can hold).
fn start_gatherer() {
    let (tx, rx) = mpsc::channel::<GatherJob>();
    let spawned = std::thread::Builder::new().name("gatherer".into()).spawn(move || {
        for (text, done) in rx {
            where_processes_wait_into(&text);
            let _ = done.send(());
        }
    });
    match spawned {
        Ok(_) => {
            if let Ok(mut g) = GATHERER.lock() {
                *g = Some(tx);
            }
        }
        Err(e) => println!("(no gatherer thread: {e}; a diagnosis is gathered on the thread that needs it)"),
    }
}

/// Where every process of the guest waits, gathered on the gatherer thread, for at most
/// `limit`: reading a process's `/proc` files can itself block (its `cmdline` needs the
/// address space's lock, which a process stuck in the kernel may hold), so what was gathered
/// by then is returned, naming the file being read. A gatherer still stuck in an earlier
/// report answers nothing; the text says so.
pub fn where_processes_wait_within(limit: Duration) -> String {
    let text = Arc::new(Mutex::new(String::new()));
    let (done_tx, done_rx) = mpsc::channel();
    let queued = GATHERER
        .lock()
        .ok()
        .and_then(|g| g.as_ref().map(|tx| tx.send((Arc::clone(&text), done_tx)).is_ok()))
        .unwrap_or(false);
    let finished = if queued {
        done_rx.recv_timeout(limit).is_ok()
    } else {
        where_processes_wait_into(&text);
        true
    };
    let mut gathered = text.lock().map(|t| t.clone()).unwrap_or_default();
    if !finished && gathered.is_empty() {
        gathered.push_str("(nothing: the gatherer is still stuck in an earlier report)\n");
    } else if !finished {
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
    push(&format!(
        "kernel log since the runner started, ending with sysrq w (blocked tasks):\n{}",
        blocked_tasks_from_kernel_log()
    ));
}

/// When the runner started, in the kernel log's clock (µs since boot; see [`run_checks`]).
static RUNNER_START_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Microseconds since boot (`CLOCK_MONOTONIC`, which the kernel log's timestamps follow).
fn monotonic_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

/// Ask the kernel to log every task in uninterruptible sleep (sysrq `w`) and return what it
/// logged since the runner started (`/dev/kmsg`, read without blocking; at most the last 500
/// lines): the blocked tasks, and before them what the kernel reported meanwhile — hung
/// tasks, RCU stalls, lockups, 9p errors, OOM kills.
fn blocked_tasks_from_kernel_log() -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut kmsg = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open("/dev/kmsg") {
        Ok(f) => f,
        Err(e) => return format!("(/dev/kmsg: {e})\n"),
    };
    if let Err(e) = std::fs::write("/proc/sysrq-trigger", "w") {
        return format!("(sysrq-trigger: {e})\n");
    }
    // The boot log is left out (with a second's margin for the clocks).
    let since = RUNNER_START_US.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(1_000_000);
    let mut lines = std::collections::VecDeque::new();
    let mut record = [0u8; 8192];
    // Each read returns one record; EAGAIN at the end, EPIPE for a record overwritten meanwhile.
    loop {
        match kmsg.read(&mut record) {
            Ok(0) => break,
            Ok(n) => {
                let line = String::from_utf8_lossy(&record[..n]);
                // "level,seq,microseconds,flags;message": keep the time, as dmesg shows it.
                let message = match line.split_once(';') {
                    Some((head, m)) => match head.split(',').nth(2).and_then(|us| us.parse::<u64>().ok()) {
                        Some(us) if us < since => continue, // the boot log
                        Some(us) => format!("[{:5}.{:06}] {}", us / 1_000_000, us % 1_000_000, m.trim_end()),
                        None => m.trim_end().to_string(),
                    },
                    None => line.trim_end().to_string(),
                };
                lines.push_back(message);
                if lines.len() > 500 {
                    lines.pop_front();
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    lines.into_iter().map(|l| l + "\n").collect()
}

/// Lock every page of this runner in memory, now and later (`mlockall`): the guest reads
/// its files — this binary included — over 9p, and code that never ran before (the deadline's
/// diagnosis) would otherwise be paged in from there when it is first needed. Were 9p the
/// thing that hangs, the diagnosis would hang with it and the VM would time out silently,
/// which a CI run once did in the first check. Not inherited by the commands it starts.
fn keep_this_runner_in_memory() {
    // SAFETY: mlockall only changes how this process's pages are kept; no memory is touched.
    if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) } != 0 {
        println!("(mlockall: {}; a 9p hang could hide the diagnosis)", std::io::Error::last_os_error());
    }
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
    RUNNER_START_US.store(monotonic_us(), std::sync::atomic::Ordering::Relaxed);
    keep_this_runner_in_memory();
    start_gatherer();
    start_watchdog();
    let start = Instant::now();
    let mut failed: Vec<(&str, String)> = Vec::new();
    let mut passed = 0;
    for (name, check) in checks {
        if stop_at_first_failure && !failed.is_empty() {
            break;
        }
        print!("test {name} ... ");
        let _ = std::io::stdout().flush();
        progress(format!("check {name}"));
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
