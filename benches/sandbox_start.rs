//! Sandbox start-up benchmark: `opservant sandbox --json -- /bin/true` against
//! `bwrap --unshare-all --die-with-parent --ro-bind / / /bin/true`, with bare `/bin/true` and a
//! plain `unshare` of the same seven namespaces as reference points. See benches/README.md.
//!
//! All commands run in one process, interleaved round-robin (every round runs each command
//! once, the starting command rotating from round to round), so drift of a shared, noisy
//! machine hits every command alike. The result is the ratio of medians measured in the same
//! run, never an absolute timing.
//!
//! `cargo bench --bench sandbox_start`; `OPSERVANT_BENCH_ROUNDS` overrides the 200 measured
//! rounds. Writes `target/bench/sandbox_start.json`. Without `--bench` on the command line
//! (as under `cargo test --benches`) it is a smoke test: one round, no JSON.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

mod common;
use common::{in_ci, kernel_release, ms3, round2, utc_iso8601, which};

const WARMUP_ROUNDS: usize = 10;
const DEFAULT_ROUNDS: usize = 200;
const TARGET_RATIO: f64 = 1.50;
const OPSERVANT: &str = env!("CARGO_BIN_EXE_opservant");

/// A scratch directory with a configuration whose audit log is in it; removed on drop.
struct AuditScratch {
    dir: PathBuf,
    config: PathBuf,
}

impl AuditScratch {
    fn new() -> Result<AuditScratch, String> {
        let dir = PathBuf::from(format!("/var/tmp/opservant-bench-sandbox-start-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let scratch = AuditScratch { config: dir.join("config.yaml"), dir };
        let text = format!("audit:\n  path: {}\n  journald: false\n", scratch.dir.join("audit/audit.jsonl").display());
        std::fs::write(&scratch.config, text).map_err(|e| format!("writing {}: {e}", scratch.config.display()))?;
        Ok(scratch)
    }
}

impl Drop for AuditScratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One command under measurement.
struct Bench {
    name: &'static str,
    argv: Vec<String>,
    samples: Vec<Duration>,
}

/// Order statistics of one command's samples, in milliseconds.
struct Summary {
    min: f64,
    median: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sandbox_start: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not (and builds unoptimised).
    let smoke = !std::env::args().any(|a| a == "--bench");
    let (warmup, rounds) = if smoke { (0, 1) } else { (WARMUP_ROUNDS, common::rounds(DEFAULT_ROUNDS)?) };

    let mut benches = vec![bench("true", &["/bin/true"])];
    let mut skipped = Vec::new();
    let unshare = ["--user", "--map-root-user", "--mount", "--pid", "--fork", "--net", "--ipc", "--uts", "--cgroup"];
    let bwrap = ["--unshare-all", "--die-with-parent", "--ro-bind", "/", "/"];
    for (name, args) in [("unshare", &unshare[..]), ("bwrap", &bwrap[..])] {
        match which(name) {
            Some(path) => {
                let mut argv = vec![path.to_string_lossy().into_owned()];
                argv.extend(args.iter().map(|a| a.to_string()));
                argv.push("/bin/true".into());
                benches.push(Bench { name, argv, samples: Vec::new() });
            }
            None if name == "bwrap" && in_ci() => {
                return Err("bwrap not found in PATH; the opservant/bwrap ratio is the headline and CI must \
                            measure it (apt-get install bubblewrap)"
                    .into());
            }
            None => {
                println!("SKIPPED {name}: not found in PATH");
                skipped.push(json!({ "name": name, "reason": "not found in PATH" }));
            }
        }
    }
    if !Path::new(OPSERVANT).exists() {
        return Err(format!("{OPSERVANT} does not exist; build it with `cargo build --release`"));
    }
    // Measure the binary as a package installs it (copied), like bwrap and unshare; see
    // benches/README.md ("Installed copies").
    let installed = Installed::new(Path::new(OPSERVANT))?;
    let op = installed.path().to_string_lossy().into_owned();
    // A configuration of its own: `opservant sandbox` records its start and end (each
    // flushed, as a run's), in a scratch audit log rather than the host's.
    let config = AuditScratch::new()?;
    let config_arg = config.config.to_string_lossy().into_owned();
    benches.push(bench("opservant", &[&op, "sandbox", "--json", "--config", &config_arg, "--", "/bin/true"]));

    let n = benches.len();
    for round in 0..warmup + rounds {
        for i in 0..n {
            let b = &mut benches[(round + i) % n];
            let elapsed = time_once(&b.argv)?;
            if round >= warmup {
                b.samples.push(elapsed);
            }
        }
    }

    let summaries: Vec<Summary> = benches.iter_mut().map(|b| summarize(&mut b.samples)).collect();
    let median_of = |name: &str| benches.iter().zip(&summaries).find(|(b, _)| b.name == name).map(|(_, s)| s.median);
    let bwrap_median = median_of("bwrap");
    let headline = bwrap_median.zip(median_of("opservant")).map(|(bw, op)| op / bw);
    let kernel = kernel_release();

    if smoke {
        println!("smoke run (no --bench argument, as under `cargo test --benches`): one round, no JSON written");
    }
    println!(
        "sandbox start-up, kernel {kernel}; rounds: {rounds} measured after {warmup} warm-up, interleaved round-robin"
    );
    println!("percentiles are nearest-rank; ratio = command median / bwrap median");
    println!("{:<10} {:>10} {:>10} {:>10} {:>8}", "command", "median ms", "p90 ms", "p99 ms", "/ bwrap");
    for (b, s) in benches.iter().zip(&summaries) {
        let ratio = bwrap_median.map_or("n/a".into(), |bw| format!("{:.2}", s.median / bw));
        println!("{:<10} {:>10.3} {:>10.3} {:>10.3} {:>8}", b.name, s.median, s.p90, s.p99, ratio);
    }
    match headline {
        Some(r) => println!("opservant/bwrap median ratio: {r:.2} (target <= {TARGET_RATIO:.2})"),
        None => println!("opservant/bwrap median ratio: n/a, bwrap missing (target <= {TARGET_RATIO:.2})"),
    }
    if smoke {
        return Ok(());
    }

    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_err(|e| e.to_string())?.as_secs();
    let commands: Vec<Value> = benches
        .iter()
        .zip(&summaries)
        .map(|(b, s)| {
            json!({
                "name": b.name,
                "argv": b.argv,
                "samples": b.samples.len(),
                "min_ms": ms3(s.min),
                "median_ms": ms3(s.median),
                "p90_ms": ms3(s.p90),
                "p99_ms": ms3(s.p99),
                "max_ms": ms3(s.max),
                "median_ratio_to_bwrap": bwrap_median.map(|bw| round2(s.median / bw)),
            })
        })
        .collect();
    let report = json!({
        "benchmark": "sandbox_start",
        "timestamp_unix": now,
        "timestamp_utc": utc_iso8601(now),
        "kernel_release": kernel,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "rounds": rounds,
        "warmup_rounds": warmup,
        "percentile_method": "nearest-rank: sorted[ceil(p/100 * n) - 1]",
        "commands": commands,
        "skipped": skipped,
        "opservant_bwrap_median_ratio": headline.map(round2),
        "target_ratio": TARGET_RATIO,
    });
    // target/release/opservant -> target/bench/sandbox_start.json (honours CARGO_TARGET_DIR).
    let target_dir = Path::new(OPSERVANT).parent().and_then(Path::parent).ok_or("cannot locate target dir")?;
    let out = target_dir.join("bench").join("sandbox_start.json");
    std::fs::create_dir_all(out.parent().unwrap()).map_err(|e| format!("creating {}: {e}", out.display()))?;
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())? + "\n";
    std::fs::write(&out, text).map_err(|e| format!("writing {}: {e}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

fn bench(name: &'static str, argv: &[&str]) -> Bench {
    Bench { name, argv: argv.iter().map(|a| a.to_string()).collect(), samples: Vec::new() }
}

/// Wall time of one spawn-and-wait, output discarded. A non-zero exit aborts the benchmark.
fn time_once(argv: &[String]) -> Result<Duration, String> {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    let start = Instant::now();
    let status = cmd.status().map_err(|e| format!("cannot start `{}`: {e}", argv.join(" ")))?;
    let elapsed = start.elapsed();
    if !status.success() {
        // Run it once more with stderr captured so the abort says why.
        let why = Command::new(&argv[0]).args(&argv[1..]).stdin(Stdio::null()).output().map_or(String::new(), |o| {
            String::from_utf8_lossy(&o.stderr).trim().lines().last().unwrap_or("").to_string()
        });
        return Err(format!("`{}` failed ({status}); aborting the benchmark. stderr: {why}", argv.join(" ")));
    }
    Ok(elapsed)
}

fn summarize(samples: &mut [Duration]) -> Summary {
    samples.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Summary {
        min: ms(samples[0]),
        median: ms(percentile(samples, 50)),
        p90: ms(percentile(samples, 90)),
        p99: ms(percentile(samples, 99)),
        max: ms(samples[samples.len() - 1]),
    }
}

/// Nearest-rank percentile of sorted, non-empty samples: the smallest sample that at least
/// `p` percent of the samples are less than or equal to, i.e. `sorted[ceil(p/100 * n) - 1]`.
/// Always an observed value, never interpolated; the median is the 50th percentile in this
/// sense (the lower of the two middle samples when n is even). With n = 200, p99 is the
/// 198th smallest sample, so it is above all but two samples.
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    common::percentile(sorted, p).expect("percentile of no samples (rounds are at least 1)")
}

/// A copy of the binary under test in a fresh directory, removed on drop (or the binary
/// itself with `OPSERVANT_BENCH_IN_PLACE`).
struct Installed {
    dir: Option<PathBuf>,
    path: PathBuf,
}

impl Installed {
    fn new(binary: &Path) -> Result<Installed, String> {
        if std::env::var_os("OPSERVANT_BENCH_IN_PLACE").is_some() {
            return Ok(Installed { dir: None, path: binary.to_path_buf() });
        }
        let dir = std::env::temp_dir().join(format!("opservant-bench-install-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join("opservant");
        std::fs::copy(binary, &path).map_err(|e| format!("install {}: {e}", binary.display()))?;
        Ok(Installed { dir: Some(dir), path })
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
