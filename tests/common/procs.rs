//! The host's process table, read from `/proc`, for tests that look for what a run left
//! behind. A process that exits while the table is read is simply missing from it.
#![allow(dead_code)] // not every test binary that includes this module uses all of it

/// `(pid, ppid)` of every process.
pub fn table() -> Vec<(i32, i32)> {
    let mut table = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return table };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // The fields after the last ')' (the command name may hold anything): state, ppid, ...
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
        if let Some(ppid) = ppid {
            table.push((pid, ppid));
        }
    }
    table
}

/// Every process below `root` (not `root` itself), parents before their children.
pub fn descendants(root: i32) -> Vec<i32> {
    let table = table();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(table.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    found.remove(0);
    found
}

/// The processes exactly `depth` generations below `pid`.
pub fn at_depth(pid: i32, depth: usize) -> Vec<i32> {
    let table = table();
    let mut level = vec![pid];
    for _ in 0..depth {
        level = table.iter().filter(|(_, pp)| level.contains(pp)).map(|(p, _)| *p).collect();
    }
    level
}

/// The payloads of the sandboxes a zygote started: the first process each sandbox's init
/// forked, pid 2 of its PID namespace — two generations below the zygote when it started
/// the sandbox directly (zygote → init → payload), three with a monitor (zygote → monitor →
/// init → payload).
pub fn payloads_below(zygote: i32) -> Vec<i32> {
    let innermost = |pid: i32| -> Option<String> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status.lines().find(|l| l.starts_with("NSpid:"))?.split_whitespace().last().map(str::to_string)
    };
    (2..=3).flat_map(|depth| at_depth(zygote, depth)).filter(|&p| innermost(p).as_deref() == Some("2")).collect()
}

/// KiB of `pid`'s private writable mappings (`rw-p`) that are resident and still shared
/// with another process (`Shared_Clean` + `Shared_Dirty` in `/proc/PID/smaps`): for a
/// zygote's child, the pages its first writes would copy. `None` if the process is gone.
pub fn shared_writable_kib(pid: i32) -> Option<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let mut writable = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let Some(first) = fields.next() else { continue };
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: "start-end perms offset dev inode [path]".
            writable = fields.next() == Some("rw-p");
        } else if writable && (first == "Shared_Clean:" || first == "Shared_Dirty:") {
            kib += fields.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    Some(kib)
}

/// The parent of `pid` (`None` once it is gone).
pub fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the last ')' (the command name may hold anything): state, ppid, ...
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// The process whose command line is exactly `cmdline` (its arguments, each ended by NUL),
/// if one runs now.
pub fn by_cmdline(cmdline: &[u8]) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
        (std::fs::read(e.path().join("cmdline")).ok()? == cmdline).then_some(pid)
    })
}

/// Wait (polling) until `found` gives a value; panics after `within`, or once `child` (the
/// command that should make it appear) has ended, naming `what`.
pub fn wait_for<T>(
    child: &mut std::process::Child,
    within: std::time::Duration,
    what: &str,
    mut found: impl FnMut() -> Option<T>,
) -> T {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(v) = found() {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "{what} within {within:?}");
        assert!(child.try_wait().unwrap().is_none(), "the command ended before {what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Wait for `child` to end, at most `within` (a hang detector, not a timing assertion):
/// killed and a panic naming `what` after that.
pub fn end_within(child: std::process::Child, within: std::time::Duration, what: &str) -> std::process::Output {
    let mut child = child;
    let deadline = std::time::Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} did not end within {within:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}
