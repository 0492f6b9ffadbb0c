//! What the sandbox's seccomp filters cost a system call: no filter, the default profile
//! (`policies/seccomp/default.json`, two filters) and the default profile with the agent's
//! `no-netlink` filter stacked (three), the filters exactly as a sandbox installs them
//! (`sandbox::seccomp::install`). See benches/README.md.
//!
//! Each sample is a forked child that installs one configuration's filters (timed), then
//! times three loops: `getppid` (a call the kernel's seccomp action cache allows without
//! running any filter), `openat` + `close` of `/dev/null` (`openat`'s rule checks its flags,
//! so every filter runs) and `socket(AF_INET, SOCK_DGRAM)` + `close` (the one call the
//! `no-netlink` filter inspects). Configurations are interleaved round-robin, the first one
//! rotating from round to round, so the machine's drift hits each alike; the result is each
//! configuration's median against no filter's, measured side by side.
//!
//! `cargo bench --bench seccomp_filters` (as root or not: filters need only `no_new_privs`);
//! `OPSERVANT_BENCH_ROUNDS` overrides the 60 measured rounds. Writes
//! `target/bench/seccomp_filters.json`. Without `--bench` (as under `cargo test --benches`) it
//! is a smoke test: one short round, no JSON.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::ExitCode;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use sandbox::seccomp::{default_policy, install, refusing_netlink};
use sandbox::SeccompPolicy;
use serde_json::json;

mod common;
use common::{kernel_release, percentile, round2, utc_iso8601};

const WARMUP_ROUNDS: usize = 3;
const DEFAULT_ROUNDS: usize = 60;
/// `getppid` calls per sample; the two loops that open a descriptor run a tenth as many.
const CALLS: usize = 200_000;
const SMOKE_CALLS: usize = 2_000;
/// What a child reports: nanoseconds for the install, and per call of each loop.
const FIGURES: [&str; 4] = ["install_us", "getppid_ns", "openat_close_ns", "socket_close_ns"];

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("seccomp_filters: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let smoke = !std::env::args().any(|a| a == "--bench");
    let (warmup, rounds, calls) =
        if smoke { (0, 1, SMOKE_CALLS) } else { (WARMUP_ROUNDS, common::rounds(DEFAULT_ROUNDS)?, CALLS) };
    let default = default_policy()?;
    let stacked = refusing_netlink(&default)?;
    let configs: [(&str, SeccompPolicy); 3] =
        [("none", SeccompPolicy::Disabled), ("default", default), ("default+no-netlink", stacked)];
    let mut samples: Vec<Vec<[f64; 4]>> = vec![Vec::new(); configs.len()];
    for round in 0..warmup + rounds {
        for i in 0..configs.len() {
            let c = (round + i) % configs.len();
            let figures = sample(&configs[c].1, calls)?;
            if round >= warmup {
                samples[c].push(figures);
            }
        }
    }

    let medians: Vec<[f64; 4]> = samples
        .iter_mut()
        .map(|s| {
            let mut m = [0.0; 4];
            for (f, slot) in m.iter_mut().enumerate() {
                let mut v: Vec<f64> = s.iter().map(|x| x[f]).collect();
                v.sort_by(f64::total_cmp);
                *slot = percentile(&v, 50).unwrap_or(f64::NAN);
            }
            m
        })
        .collect();
    if smoke {
        println!("smoke run (no --bench argument, as under `cargo test --benches`): one short round, no JSON written");
    }
    println!(
        "seccomp filters, kernel {}; {rounds} measured rounds after {warmup} warm-up, interleaved; {calls} getppid calls per sample",
        kernel_release()
    );
    println!(
        "{:<20} {:>8} {:>11} {:>16} {:>16}   ratios to none (getppid, openat, socket)",
        "filters", "filters", "install µs", "getppid ns", "openat+close ns"
    );
    let mut rows = Vec::new();
    for ((name, policy), m) in configs.iter().zip(&medians) {
        let n = match policy {
            SeccompPolicy::Enforced { filters, .. } => filters.len(),
            SeccompPolicy::Disabled => 0,
        };
        let ratios: Vec<f64> = (1..4).map(|f| m[f] / medians[0][f]).collect();
        println!(
            "{name:<20} {n:>8} {:>11.1} {:>16.1} {:>16.1}   {:.3} {:.3} {:.3}  (socket+close {:.1} ns)",
            m[0], m[1], m[2], ratios[0], ratios[1], ratios[2], m[3]
        );
        let mut row = json!({"name": name, "filters": n, "samples": samples[0].len()});
        for (f, label) in FIGURES.iter().enumerate() {
            row[*label] = json!(round2(m[f]));
        }
        row["ratio_to_none"] = json!({
            "getppid": round2(ratios[0]), "openat_close": round2(ratios[1]), "socket_close": round2(ratios[2])
        });
        rows.push(row);
    }
    if smoke {
        return Ok(());
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_err(|e| e.to_string())?.as_secs();
    let report = json!({
        "benchmark": "seccomp_filters",
        "timestamp_utc": utc_iso8601(now),
        "kernel": kernel_release(),
        "rounds": rounds,
        "warmup_rounds": warmup,
        "getppid_calls_per_sample": calls,
        "configurations": rows,
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("seccomp_filters.json");
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// One forked child: install `policy`, run the loops, report the figures over a pipe.
fn sample(policy: &SeccompPolicy, calls: usize) -> Result<[f64; 4], String> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a writable array of two ints, as pipe2(2) requires.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe2: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded: both descriptors are new and owned by nothing else.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: this benchmark is single-threaded, so the child may allocate (the filter install
    // does) and run ordinary code until it exits with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        drop(read_end);
        let figures = child(policy, calls);
        let bytes: Vec<u8> = figures.iter().flat_map(|f| f.to_ne_bytes()).collect();
        // SAFETY: `bytes` is a readable buffer of its length; `_exit` ends the child without
        // running the parent's exit handlers or destructors.
        unsafe {
            libc::write(write_end.as_raw_fd(), bytes.as_ptr().cast(), bytes.len());
            libc::_exit(0)
        }
    }
    drop(write_end);
    let mut buf = Vec::new();
    std::fs::File::from(read_end).read_to_end(&mut buf).map_err(|e| format!("read the child's figures: {e}"))?;
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a writable int.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if buf.len() != 32 || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Err(format!("the child failed (status {status:#x}, {} bytes)", buf.len()));
    }
    let mut out = [0.0; 4];
    for (i, chunk) in buf.chunks_exact(8).enumerate() {
        out[i] = f64::from_ne_bytes(chunk.try_into().map_err(|_| "short figure")?);
    }
    if out.iter().any(|f| !f.is_finite() || *f < 0.0) {
        return Err(format!("the child reported {out:?}"));
    }
    Ok(out)
}

/// In the child: the figures, or negative ones when a step failed (the parent refuses them).
fn child(policy: &SeccompPolicy, calls: usize) -> [f64; 4] {
    let t = Instant::now();
    if install(policy).is_err() {
        return [-1.0; 4];
    }
    let install_us = t.elapsed().as_secs_f64() * 1e6;
    let t = Instant::now();
    for _ in 0..calls {
        // SAFETY: getppid has no preconditions.
        unsafe { libc::syscall(libc::SYS_getppid) };
    }
    let getppid_ns = t.elapsed().as_secs_f64() * 1e9 / calls as f64;
    let fewer = (calls / 10).max(1);
    let t = Instant::now();
    for _ in 0..fewer {
        // SAFETY: a NUL-terminated path; the descriptor, if any, is closed at once.
        let fd = unsafe { libc::openat(libc::AT_FDCWD, c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return [-1.0; 4];
        }
        // SAFETY: `fd` is ours.
        unsafe { libc::close(fd) };
    }
    let openat_ns = t.elapsed().as_secs_f64() * 1e9 / fewer as f64;
    let t = Instant::now();
    for _ in 0..fewer {
        // SAFETY: socket(2) takes integers; the descriptor, if any, is closed at once.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return [-1.0; 4];
        }
        // SAFETY: `fd` is ours.
        unsafe { libc::close(fd) };
    }
    let socket_ns = t.elapsed().as_secs_f64() * 1e9 / fewer as f64;
    [install_us, getppid_ns, openat_ns, socket_ns]
}
