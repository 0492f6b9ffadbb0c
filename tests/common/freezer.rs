//! A v1 freezer cgroup of a test's, to hold a sandbox's processes as if they were stuck in
//! the kernel (uninterruptible I/O): SIGKILL takes effect only once they are thawed. Made
//! beneath the freezer hierarchy's root, which the test process must be in; removed again.
#![allow(dead_code)] // not every test binary that includes this module uses all of it

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const ROOT: &str = "/sys/fs/cgroup/freezer";
/// A test's freezer cgroup: this prefix, the test process's pid, `-`, a label.
const PREFIX: &str = "opservant-test-freeze-";

/// Whether this host has a v1 freezer hierarchy this process is at the root of. Skips
/// (false) only outside CI. Freezers a killed run of these tests left behind (their test
/// process gone) are thawed and removed first.
pub fn available() -> bool {
    let in_root = std::fs::read_to_string("/proc/self/cgroup").unwrap().lines().any(|l| l.ends_with(":freezer:/"));
    if Path::new(ROOT).join("cgroup.procs").exists() && in_root {
        for e in std::fs::read_dir(ROOT).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(PREFIX) else { continue };
            let owner = rest.split('-').next().unwrap_or_default();
            if !Path::new(&format!("/proc/{owner}")).exists() {
                drop(Freezer(e.path()));
            }
        }
        return true;
    }
    // A v2-only host has no v1 freezer to hold processes in a cgroup with.
    assert!(!super::in_ci(), "CI runs on a host with the v1 freezer");
    eprintln!("SKIPPED: no v1 freezer hierarchy this process is at the root of");
    false
}

/// A freezer cgroup; dropping it thaws it, waits for what is in it to exit (killed
/// processes die once thawed) and removes it.
pub struct Freezer(pub PathBuf);

impl Freezer {
    /// A new freezer cgroup for this test process, named by `label`.
    pub fn new(label: impl std::fmt::Display) -> Freezer {
        let dir = Path::new(ROOT).join(format!("{PREFIX}{}-{label}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Freezer(dir)
    }

    /// Move `pids` into it and freeze them.
    pub fn freeze(&self, pids: &[i32]) {
        self.try_move(pids).unwrap();
        self.freeze_members();
    }

    /// Move `pids` into it (`Err` when one is gone).
    fn try_move(&self, pids: &[i32]) -> std::io::Result<()> {
        pids.iter().try_for_each(|pid| std::fs::write(self.0.join("cgroup.procs"), pid.to_string()))
    }

    /// Freeze what was moved in, and wait until it is frozen.
    fn freeze_members(&self) {
        std::fs::write(self.0.join("freezer.state"), "FROZEN").unwrap();
        let give_up = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(self.0.join("freezer.state")).unwrap().trim() != "FROZEN" {
            assert!(Instant::now() < give_up, "the freezer {} never froze", self.0.display());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Thaw, and wait (up to 10 s) until nothing is left in it; whether it emptied.
    pub fn thaw(&self) -> bool {
        let _ = std::fs::write(self.0.join("freezer.state"), "THAWED");
        let give_up = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(self.0.join("cgroup.procs")).unwrap_or_default().trim().is_empty() {
            if Instant::now() >= give_up {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }
}

impl Drop for Freezer {
    fn drop(&mut self) {
        self.thaw();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The sandbox cgroup directories `pid` is in (none once it left them or exited).
pub fn sandbox_cgroups_of_process(pid: i32) -> Vec<PathBuf> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            if !path.contains("opservant-sb-") {
                None
            } else if controllers.is_empty() {
                Some(PathBuf::from(format!("/sys/fs/cgroup{path}")))
            } else {
                Some(PathBuf::from(format!("/sys/fs/cgroup/{}{path}", controllers.split(',').next().unwrap())))
            }
        })
        .collect()
}

/// Freeze the sandbox running below `root` (a process that started it: its monitor, the
/// CLI running it): its init and payload — the processes below `root` in a sandbox cgroup —
/// once both exist (within 10 s). Returns the freezer and the sandbox's cgroup directories.
pub fn freeze_sandbox_below(root: i32) -> (Freezer, Vec<PathBuf>) {
    freeze_below(root, "no sandbox init and payload", Duration::from_secs(10), |_| true)
}

/// As [`freeze_sandbox_below`], once one of the sandbox's processes sleeps (`nanosleep`,
/// `clock_nanosleep`: `time.sleep`, `sleep`): an executor or script that sleeps is then
/// running its own code, every start-up step behind it (an executor's runtime was told to
/// proceed). Within 30 s.
pub fn freeze_sandbox_below_once_asleep(root: i32) -> (Freezer, Vec<PathBuf>) {
    let asleep = |pids: &[i32]| {
        pids.iter().any(|p| {
            let call = std::fs::read_to_string(format!("/proc/{p}/syscall")).unwrap_or_default();
            let nr = call.split_whitespace().next().and_then(|n| n.parse::<libc::c_long>().ok());
            nr.is_some_and(|nr| nr == libc::SYS_clock_nanosleep || Some(nr) == nanosleep())
        })
    };
    freeze_below(root, "no sandbox process asleep", Duration::from_secs(30), asleep)
}

/// `nanosleep`'s number, on the architectures that have one.
fn nanosleep() -> Option<libc::c_long> {
    #[cfg(target_arch = "x86_64")]
    return Some(libc::SYS_nanosleep);
    #[cfg(not(target_arch = "x86_64"))]
    return None;
}

/// Freeze the processes below `root` in a sandbox cgroup once there are two or more and
/// `ready` holds for them, within `patience`; `what` says what was missing when it gives up.
fn freeze_below(root: i32, what: &str, patience: Duration, ready: impl Fn(&[i32]) -> bool) -> (Freezer, Vec<PathBuf>) {
    let give_up = Instant::now() + patience;
    let freezer = Freezer::new(root);
    loop {
        let inside: Vec<i32> = super::procs::descendants(root)
            .into_iter()
            .filter(|&p| !sandbox_cgroups_of_process(p).is_empty())
            .collect();
        if inside.len() >= 2 && ready(&inside) {
            let dirs = sandbox_cgroups_of_process(inside[0]);
            // A process listed may have ended since (a short-lived one of the sandbox's
            // start): list again.
            if freezer.try_move(&inside).is_ok() && !dirs.is_empty() {
                freezer.freeze_members();
                return (freezer, dirs);
            }
        }
        assert!(Instant::now() < give_up, "{what} below {root}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Start `cmd` (an opservant command that runs one sandbox, its output piped), freeze that
/// sandbox once its payload sleeps ([`freeze_sandbox_below_once_asleep`]), and wait for the command to end — at most
/// `limit`, a hang detector: past it the command is killed and the test fails. Thaws the
/// sandbox (asserting its processes then die); returns the command's output and the
/// sandbox's cgroup directories.
pub fn run_with_frozen_sandbox(
    mut cmd: std::process::Command,
    limit: Duration,
    what: &str,
) -> (std::process::Output, Vec<PathBuf>) {
    let child = cmd.spawn().expect("spawn opservant");
    let pid = child.id() as i32;
    let (freezer, dirs) = freeze_sandbox_below_once_asleep(pid);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let ended = rx.recv_timeout(limit);
    let thawed = freezer.thaw();
    let out = match ended {
        Ok(out) => out.expect("wait for opservant"),
        Err(_) => {
            // SAFETY: kill(2) on our own child, not reaped (its waiting thread has not returned).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{what}: the command hung on a sandbox whose processes cannot exit");
        }
    };
    assert!(thawed, "{what}: the thawed sandbox processes never died");
    (out, dirs)
}
