//! Memory figures from `/proc`: a process's resident set (`VmRSS`) and proportional set
//! (`Pss` of `smaps_rollup`: shared pages divided among the processes that map them, so the
//! figures of a zygote and its forked children add up to what they really occupy).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Resident and proportional set of one process, in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Mem {
    pub rss_kib: u64,
    pub pss_kib: u64,
}

impl std::ops::Add for Mem {
    type Output = Mem;
    fn add(self, o: Mem) -> Mem {
        Mem { rss_kib: self.rss_kib + o.rss_kib, pss_kib: self.pss_kib + o.pss_kib }
    }
}

fn field_kib(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|rest| rest.trim_start_matches(':').split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// `None` when the process is gone (or not readable).
pub fn of_process(pid: i32) -> Option<Mem> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    Some(Mem { rss_kib: field_kib(&status, "VmRSS")?, pss_kib: field_kib(&rollup, "Pss")? })
}

/// Parent pid of every process, from `/proc/*/stat`.
fn parents() -> HashMap<i32, i32> {
    let mut map = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return map };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The command name is in parentheses and may hold anything; the fields after the
        // last ')' are: state, ppid, …
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
        if let Some(ppid) = ppid {
            map.insert(pid, ppid);
        }
    }
    map
}

/// `root`'s descendants (not `root` itself), breadth first.
pub fn descendants(root: i32) -> Vec<i32> {
    let map = parents();
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (&child, _) in map.iter().filter(|(_, &pp)| pp == p) {
            out.push(child);
            frontier.push(child);
        }
    }
    out
}

/// `root`'s descendants exactly `depth` generations below it (1: its children).
pub fn descendants_at_depth(root: i32, depth: usize) -> Vec<i32> {
    let map = parents();
    let mut level = vec![root];
    for _ in 0..depth {
        level = map.iter().filter(|(_, pp)| level.contains(pp)).map(|(&c, _)| c).collect();
    }
    level
}

/// Is the process blocked receiving (`read`, `recvfrom`, `recvmsg`)? From
/// `/proc/PID/syscall` (root).
pub fn receiving(pid: i32) -> bool {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/syscall")) else { return false };
    let nr = text.split_whitespace().next().and_then(|n| n.parse::<i64>().ok());
    nr.is_some_and(|n| n == libc::SYS_read || n == libc::SYS_recvfrom || n == libc::SYS_recvmsg)
}

/// Is the process blocked in a sleep system call (`nanosleep` or `clock_nanosleep`)? Read
/// from `/proc/PID/syscall` (root).
pub fn sleeping(pid: i32) -> bool {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/syscall")) else { return false };
    let nr = text.split_whitespace().next().and_then(|n| n.parse::<i64>().ok());
    nr.is_some_and(|n| n == libc::SYS_nanosleep || n == libc::SYS_clock_nanosleep)
}

/// Wait (polling, at most `limit`) until one of `root`'s descendants sleeps; that process
/// and all of `root`'s descendants then.
pub fn wait_for_sleeper(root: i32, limit: Duration) -> Option<(i32, Vec<i32>)> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let all = descendants(root);
        if let Some(&s) = all.iter().find(|&&p| sleeping(p)) {
            return Some((s, all));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_has_memory() {
        let m = of_process(std::process::id() as i32).unwrap();
        assert!(m.rss_kib > 0 && m.pss_kib > 0);
    }

    #[test]
    fn parses_kib_fields() {
        assert_eq!(field_kib("Name:\tx\nVmRSS:\t  1234 kB\n", "VmRSS"), Some(1234));
        assert_eq!(field_kib("Rss:  10 kB\nPss:   7 kB\n", "Pss"), Some(7));
        assert_eq!(field_kib("", "Pss"), None);
    }

    #[test]
    fn finds_a_sleeping_child() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let me = std::process::id() as i32;
        let found = wait_for_sleeper(me, Duration::from_secs(5));
        let _ = child.kill();
        let _ = child.wait();
        let (pid, all) = found.unwrap();
        assert!(all.contains(&pid));
    }
}
