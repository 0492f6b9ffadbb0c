//! Egress start-up cost: `opservant run` on a no-op executor with `outbound: true` (an
//! allow list of one address, DNS allowed, so the forwarder starts too) against the same
//! executor with `outbound: false`, interleaved in one process. The difference of the
//! medians (and the median of the per-round differences) is what egress adds to a start:
//! the slot and host-table lease, the veth pair, addresses, routes, two token-bucket qdiscs,
//! the sandbox's ruleset, the DNS forwarder, and the teardown. Target: ≤ 3 ms.
//!
//! Both run inside a network namespace this benchmark creates (its "host"), so the machine's
//! own network configuration is never touched; no packet is sent anywhere.
//!
//! `cargo build --release && cargo bench --bench egress_start`; `OPSERVANT_BENCH_ROUNDS`
//! overrides the 60 measured rounds, `OPSERVANT_BIN` the `opservant` binary. Writes
//! `target/bench/egress_start.json`. Without `--bench` (as under `cargo test --benches`) it
//! is a smoke test: one round, no JSON.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

mod common;
use common::{kernel_release, ms3, percentile, round2, utc_iso8601};

const WARMUP_ROUNDS: usize = 5;
const DEFAULT_ROUNDS: usize = 60;
const TARGET_MS: f64 = 3.0;
const OPSERVANT: &str = env!("CARGO_BIN_EXE_opservant");

use agent::bench::NOOP_PY as EXECUTOR_PY;

/// The scratch directory and the benchmark's network namespace; both removed on drop.
struct Scratch {
    dir: PathBuf,
    netns: String,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.netns]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("egress_start: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let smoke = !std::env::args().any(|a| a == "--bench");
    let (warmup, rounds) = if smoke { (0, 1) } else { (WARMUP_ROUNDS, common::rounds(DEFAULT_ROUNDS)?) };
    let opservant = std::env::var_os("OPSERVANT_BIN").map_or_else(|| PathBuf::from(OPSERVANT), PathBuf::from);
    let runtime = opservant.with_file_name("opservant-runtime");
    if !opservant.is_file() || !runtime.is_file() {
        return Err(format!(
            "{} and opservant-runtime beside it must exist (`cargo build --release`)",
            opservant.display()
        ));
    }
    let scratch = make_scratch()?;
    // Installed copies, as in the other benchmarks (benches/README.md, "Installed copies").
    let bin = scratch.dir.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| e.to_string())?;
    for src in [&opservant, &runtime] {
        let name = src.file_name().ok_or("binary without a name")?;
        std::fs::copy(src, bin.join(name)).map_err(|e| format!("install {}: {e}", src.display()))?;
    }
    let op = bin.join("opservant");
    let ns = std::fs::File::open(format!("/run/netns/{}", scratch.netns)).map_err(|e| e.to_string())?;
    let config = scratch.dir.join("config.yaml");

    let variants = ["no-egress", "egress"];
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(), Vec::new()];
    for round in 0..warmup + rounds {
        for i in 0..2 {
            let v = (round + i) % 2;
            let d = scratch.dir.join(variants[v]);
            let elapsed = time_once(&op, &d, &config, &ns)?;
            if round >= warmup {
                samples[v].push(elapsed);
            }
        }
    }
    let per_round: Vec<f64> =
        samples[1].iter().zip(&samples[0]).map(|(e, n)| (e.as_secs_f64() - n.as_secs_f64()) * 1e3).collect();
    let mut sorted_rounds = per_round.clone();
    sorted_rounds.sort_unstable_by(f64::total_cmp);
    let stats: Vec<(f64, f64, f64)> = samples.iter().map(|s| summarize(s)).collect();
    let added = stats[1].0 - stats[0].0;
    let paired = percentile(&sorted_rounds, 50).unwrap_or(f64::NAN);

    println!("{:<10} {:>10} {:>10} {:>10}", "variant", "median ms", "p90 ms", "p99 ms");
    for (name, (m, p90, p99)) in variants.iter().zip(&stats) {
        println!("{name:<10} {m:>10.3} {p90:>10.3} {p99:>10.3}");
    }
    println!(
        "egress adds {added:.3} ms to the median start (per-round median {paired:.3} ms; target <= {TARGET_MS:.1} ms)"
    );
    if smoke {
        return Ok(());
    }
    let report = json!({
        "benchmark": "egress_start",
        "rounds": rounds,
        "timestamp": utc_iso8601(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())),
        "kernel": kernel_release(),
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "variants": variants.iter().zip(&stats).map(|(n, (m, p90, p99))| json!({
            "name": n, "median_ms": ms3(*m), "p90_ms": ms3(*p90), "p99_ms": ms3(*p99),
        })).collect::<Vec<Value>>(),
        "egress_added_ms": ms3(added),
        "egress_added_per_round_median_ms": ms3(paired),
        "target_ms": round2(TARGET_MS),
    });
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    std::fs::write(out.join("egress_start.json"), serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn make_scratch() -> Result<Scratch, String> {
    let pid = std::process::id();
    let dir = PathBuf::from(format!("/var/tmp/opservant-bench-egress-{pid}"));
    let netns = format!("opsvbench-{pid}");
    let sh = |args: &[&str]| -> Result<(), String> {
        let st = Command::new(args[0])
            .args(&args[1..])
            .stderr(Stdio::inherit())
            .status()
            .map_err(|e| format!("{}: {e}", args[0]))?;
        if st.success() {
            Ok(())
        } else {
            Err(format!("{args:?} failed"))
        }
    };
    sh(&["ip", "netns", "add", &netns])?;
    let scratch = Scratch { dir: dir.clone(), netns: netns.clone() };
    sh(&["ip", "-n", &netns, "link", "set", "lo", "up"])?;
    sh(&["ip", "netns", "exec", &netns, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"])?;
    for (sub, network) in [
        ("no-egress", json!({"outbound": false})),
        ("egress", json!({"outbound": true, "allowed_hosts": ["192.0.2.10"], "allowed_ports": [443]})),
    ] {
        let pkg = dir.join(sub).join("noop");
        std::fs::create_dir_all(&pkg).map_err(|e| e.to_string())?;
        std::fs::write(pkg.join("__init__.py"), "").map_err(|e| e.to_string())?;
        std::fs::write(pkg.join("main.py"), EXECUTOR_PY).map_err(|e| e.to_string())?;
        let manifest = json!({
            "name": "noop", "version": "1.0.0", "description": "no-op", "supported_actions": ["noop"],
            "entry_point": "noop.main.NoopExecutor", "permissions": {"network": network},
        });
        std::fs::write(dir.join(sub).join("manifest.json"), manifest.to_string()).map_err(|e| e.to_string())?;
    }
    // An upstream resolver is required with DNS allowed; none is ever asked here.
    std::fs::write(dir.join("config.yaml"), "network:\n  egress:\n    dns_upstream: [\"192.0.2.53\"]\n")
        .map_err(|e| e.to_string())?;
    Ok(scratch)
}

fn time_once(op: &Path, dir: &Path, config: &Path, ns: &std::fs::File) -> Result<Duration, String> {
    use std::os::fd::AsRawFd;
    let ns_fd = ns.as_raw_fd();
    let mut cmd = Command::new(op);
    cmd.arg("run")
        .arg(dir)
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setns is async-signal-safe; the closure touches nothing but the inherited fd.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns_fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let start = Instant::now();
    let out = cmd.output().map_err(|e| e.to_string())?;
    let elapsed = start.elapsed();
    let result: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    if !out.status.success() || result["status"] != "completed" {
        return Err(format!(
            "{} run {}: {:?}: {}",
            op.display(),
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or_default()
        ));
    }
    Ok(elapsed)
}

/// (median, p90, p99) in milliseconds, nearest-rank (as every benchmark reports them:
/// `sorted[ceil(p/100 * n) - 1]`, the median the lower middle sample when n is even).
fn summarize(samples: &[Duration]) -> (f64, f64, f64) {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_unstable_by(f64::total_cmp);
    let at = |p: usize| percentile(&ms, p).unwrap_or(f64::NAN);
    (at(50), at(90), at(99))
}
