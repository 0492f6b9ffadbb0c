//! Executor-runtime benchmark: `opservant run DIR` on a no-op executor against
//! `bwrap --unshare-all --die-with-parent --ro-bind / / python3 -I -S noop.py`, where `noop.py`
//! imports `json` and prints `{}`; bare `python3 -I -S noop.py` (no sandbox) is a reference
//! point, and the same executor with `max_cpu_percent: 50` shows what the default CPU quota
//! costs. See benches/README.md.
//!
//! All commands run in one process, interleaved round-robin (every round runs each command
//! once, the starting command rotating from round to round), so drift of a shared, noisy
//! machine hits every command alike. The result is the ratio of medians measured in the same
//! run (and the median of the per-round ratios), never an absolute timing.
//!
//! `cargo build --release && cargo bench --bench executor_run`; `OPSERVANT_BENCH_ROUNDS`
//! overrides the 60 measured rounds, `OPSERVANT_BIN` the `opservant` binary (default the
//! release build's `CARGO_BIN_EXE_opservant`; `opservant-runtime` must be beside it). Writes
//! `target/bench/executor_run.json`. Without `--bench` on the command line (as under
//! `cargo test --benches`) it is a smoke test: one round, no JSON.

use std::fs::Permissions;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

mod common;
use common::{in_ci, kernel_release, ms3, round2, utc_iso8601, which};

const WARMUP_ROUNDS: usize = 5;
const DEFAULT_ROUNDS: usize = 60;
const TARGET_RATIO: f64 = 1.30;
const OPSERVANT: &str = env!("CARGO_BIN_EXE_opservant");
/// Debian's CPython 3.11: the interpreter `opservant-runtime` embeds (PYO3_PYTHON), not
/// whatever `python3` comes first in PATH (a pyenv shim, say).
const PYTHON: &str = "/usr/bin/python3";
/// The version `opservant-runtime` embeds, from agent/build.rs (when cargo passes it on).
const EMBEDDED_PYTHON: Option<&str> = option_env!("OPSERVANT_EMBEDDED_PYTHON");

/// The executor's module: the class imports `json`, like the script bwrap runs.
const EXECUTOR_PY: &str = r#"from opservant.executor import BaseExecutor, ExecutorResult


class NoopExecutor(BaseExecutor):
    """Does nothing: the cost of `opservant run` itself."""

    name = "noop"
    version = "1.0.0"

    def validate(self, params):
        return True

    def execute(self, params, context):
        import json

        json.dumps({})
        return ExecutorResult(status="completed", output={})
"#;

/// What bwrap and bare python3 run.
const SCRIPT_PY: &str = "import json\n\nprint(json.dumps({}))\n";

/// How a run is checked.
#[derive(Clone, Copy, PartialEq)]
enum Expect {
    /// Exit status 0 and stdout `{}`.
    EmptyObject,
    /// Exit status 0 and a result JSON with status "completed" and output `{}`.
    Completed,
}

/// One command under measurement.
struct Bench {
    name: &'static str,
    argv: Vec<String>,
    expect: Expect,
    /// Wall times, in round order.
    samples: Vec<Duration>,
    /// For `opservant run`: the result JSON's `usage`, in round order.
    usage: Vec<Value>,
}

/// Order statistics of one command's samples, in milliseconds.
struct Summary {
    min: f64,
    median: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

/// The scratch directory holding the executors and the script; removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("executor_run: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not (and builds unoptimised).
    let smoke = !std::env::args().any(|a| a == "--bench");
    let (warmup, rounds) = if smoke { (0, 1) } else { (WARMUP_ROUNDS, common::rounds(DEFAULT_ROUNDS)?) };

    let opservant = std::env::var_os("OPSERVANT_BIN").map_or_else(|| PathBuf::from(OPSERVANT), PathBuf::from);
    if !opservant.is_file() {
        return Err(format!("{} does not exist; build it with `cargo build --release`", opservant.display()));
    }
    let runtime = opservant.with_file_name("opservant-runtime");
    if !runtime.is_file() {
        return Err(format!(
            "{} does not exist: opservant-runtime must be beside opservant (`cargo build --release` builds both)",
            runtime.display()
        ));
    }
    if !Path::new(PYTHON).is_file() {
        return Err(format!("{PYTHON} does not exist (apt-get install python3)"));
    }
    let python_version = python_version()?;

    let scratch = make_scratch()?;
    let dir = |sub: &str| scratch.0.join(sub).to_string_lossy().into_owned();
    let script = scratch.0.join("script").join("noop.py").to_string_lossy().into_owned();
    // Measure the binaries as a package installs them (copied), like bwrap and python3; see
    // benches/README.md ("Installed copies").
    let installed = if std::env::var_os("OPSERVANT_BENCH_IN_PLACE").is_some() {
        None
    } else {
        let root = scratch.0.join("bin");
        for src in [&opservant, &runtime] {
            let name = src.file_name().ok_or("binary without a name")?;
            std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
            std::fs::copy(src, root.join(name)).map_err(|e| format!("install {}: {e}", src.display()))?;
        }
        Some(root.join(opservant.file_name().ok_or("binary without a name")?))
    };
    let op = installed.as_ref().unwrap_or(&opservant).to_string_lossy().into_owned();

    let mut benches = vec![bench("python3", &[PYTHON, "-I", "-S", &script], Expect::EmptyObject)];
    match which("bwrap") {
        Some(path) => {
            let mut argv = vec![path.to_string_lossy().into_owned()];
            argv.extend(
                ["--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", PYTHON, "-I", "-S", &script]
                    .map(String::from),
            );
            benches.push(Bench {
                name: "bwrap",
                argv,
                expect: Expect::EmptyObject,
                samples: Vec::new(),
                usage: Vec::new(),
            });
        }
        None if in_ci() => {
            return Err("bwrap not found in PATH; the opservant/bwrap ratio is the headline and CI must measure it \
                        (apt-get install bubblewrap)"
                .into());
        }
        None => println!("SKIPPED bwrap: not found in PATH"),
    }
    benches.push(bench("opservant", &[&op, "run", &dir("noop")], Expect::Completed));
    benches.push(bench("op-cpu50", &[&op, "run", &dir("noop-cpu50")], Expect::Completed));

    let n = benches.len();
    for round in 0..warmup + rounds {
        for i in 0..n {
            let b = &mut benches[(round + i) % n];
            let (elapsed, usage) = time_once(&b.argv, b.expect)?;
            if round >= warmup {
                b.samples.push(elapsed);
                b.usage.extend(usage);
            }
        }
    }
    drop(scratch);

    // Per-round ratios against bwrap need the samples in round order: take them before sorting.
    let bwrap_rounds = benches.iter().find(|b| b.name == "bwrap").map(|b| b.samples.clone());
    let pairwise: Vec<Option<f64>> = benches
        .iter()
        .map(|b| {
            let bw = bwrap_rounds.as_ref()?;
            let mut r: Vec<f64> = b.samples.iter().zip(bw).map(|(s, w)| s.as_secs_f64() / w.as_secs_f64()).collect();
            r.sort_unstable_by(f64::total_cmp);
            Some(percentile(&r, 50))
        })
        .collect();
    let summaries: Vec<Summary> = benches.iter().map(|b| summarize(&b.samples)).collect();
    let median_of = |name: &str| benches.iter().zip(&summaries).find(|(b, _)| b.name == name).map(|(_, s)| s.median);
    let bwrap_median = median_of("bwrap");
    let headline = bwrap_median.zip(median_of("opservant")).map(|(bw, op)| op / bw);
    let headline_pairwise = benches.iter().zip(&pairwise).find(|(b, _)| b.name == "opservant").and_then(|(_, p)| *p);
    let kernel = kernel_release();

    if smoke {
        println!("smoke run (no --bench argument, as under `cargo test --benches`): one round, no JSON written");
    }
    println!(
        "no-op executor run, kernel {kernel}; rounds: {rounds} measured after {warmup} warm-up, interleaved round-robin"
    );
    println!(
        "python: {PYTHON} {python_version} (opservant-runtime embeds {})",
        EMBEDDED_PYTHON.unwrap_or("an unknown version")
    );
    println!("percentiles are nearest-rank; / bwrap = median / bwrap median; pair = median of per-round ratios");
    println!("{:<10} {:>9} {:>10} {:>9} {:>8} {:>7}", "command", "min ms", "median ms", "p90 ms", "/ bwrap", "pair");
    for ((b, s), p) in benches.iter().zip(&summaries).zip(&pairwise) {
        let ratio = bwrap_median.map_or("n/a".into(), |bw| format!("{:.2}", s.median / bw));
        let pair = p.map_or("n/a".into(), |p| format!("{p:.2}"));
        println!("{:<10} {:>9.2} {:>10.2} {:>9.2} {:>8} {:>7}", b.name, s.min, s.median, s.p90, ratio, pair);
    }
    for b in benches.iter().filter(|b| !b.usage.is_empty()) {
        let u = usage_summary(&b.usage);
        println!(
            "{} result JSON usage, medians: wall_ms {}, cpu_ms {}, cpu_throttled_ms {} (throttled in {} of {} runs)",
            b.name, u["wall_ms"], u["cpu_ms"], u["cpu_throttled_ms"], u["throttled_runs"], u["runs"]
        );
    }
    match (headline, headline_pairwise) {
        (Some(r), Some(p)) => {
            println!("opservant/bwrap median ratio: {r:.2}, pair-wise {p:.2} (target <= {TARGET_RATIO:.2})")
        }
        _ => println!("opservant/bwrap median ratio: n/a, bwrap missing (target <= {TARGET_RATIO:.2})"),
    }
    if smoke {
        return Ok(());
    }

    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_err(|e| e.to_string())?.as_secs();
    let commands: Vec<Value> = benches
        .iter()
        .zip(&summaries)
        .zip(&pairwise)
        .map(|((b, s), p)| {
            let mut c = json!({
                "name": b.name,
                "argv": b.argv,
                "samples": b.samples.len(),
                "min_ms": ms3(s.min),
                "median_ms": ms3(s.median),
                "p90_ms": ms3(s.p90),
                "p99_ms": ms3(s.p99),
                "max_ms": ms3(s.max),
                "median_ratio_to_bwrap": bwrap_median.map(|bw| round2(s.median / bw)),
                "pairwise_median_ratio_to_bwrap": p.map(round2),
            });
            if !b.usage.is_empty() {
                c["result_usage_medians"] = usage_summary(&b.usage);
            }
            c
        })
        .collect();
    let report = json!({
        "benchmark": "executor_run",
        "timestamp_unix": now,
        "timestamp_utc": utc_iso8601(now),
        "kernel_release": kernel,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "python": { "path": PYTHON, "version": python_version, "embedded": EMBEDDED_PYTHON },
        "rounds": rounds,
        "warmup_rounds": warmup,
        "percentile_method": "nearest-rank: sorted[ceil(p/100 * n) - 1]",
        "commands": commands,
        "opservant_bwrap_median_ratio": headline.map(round2),
        "opservant_bwrap_pairwise_median_ratio": headline_pairwise.map(round2),
        "target_ratio": TARGET_RATIO,
    });
    // target/release/opservant -> target/bench/executor_run.json (honours CARGO_TARGET_DIR).
    let target_dir = Path::new(OPSERVANT).parent().and_then(Path::parent).ok_or("cannot locate target dir")?;
    let out = target_dir.join("bench").join("executor_run.json");
    std::fs::create_dir_all(out.parent().unwrap()).map_err(|e| format!("creating {}: {e}", out.display()))?;
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())? + "\n";
    std::fs::write(&out, text).map_err(|e| format!("writing {}: {e}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

fn bench(name: &'static str, argv: &[&str], expect: Expect) -> Bench {
    Bench { name, argv: argv.iter().map(|a| a.to_string()).collect(), expect, samples: Vec::new(), usage: Vec::new() }
}

/// The executors and the script, in a fresh directory under /var/tmp: host /tmp is not in the
/// sandbox's view (`opservant run` binds the executor directory itself), and the directory is
/// world-readable because the executor runs as an unprivileged user.
///
/// ```text
/// DIR/noop/{manifest.json,noop.py}        the no-op executor, default limits
/// DIR/noop-cpu50/{manifest.json,noop.py}  the same with max_cpu_percent 50 (the default ceiling)
/// DIR/script/noop.py                      import json; print(json.dumps({}))
/// ```
fn make_scratch() -> Result<Scratch, String> {
    let root = PathBuf::from(format!("/var/tmp/opservant-bench-executor-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let scratch = Scratch(root.clone());
    let write = |path: PathBuf, text: &str| -> Result<(), String> {
        std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
        std::fs::set_permissions(&path, Permissions::from_mode(0o644)).map_err(|e| format!("{}: {e}", path.display()))
    };
    let mkdir = |path: &Path| -> Result<(), String> {
        std::fs::create_dir(path).map_err(|e| format!("creating {}: {e}", path.display()))?;
        std::fs::set_permissions(path, Permissions::from_mode(0o755)).map_err(|e| format!("{}: {e}", path.display()))
    };
    mkdir(&root)?;
    for (sub, limits) in [("noop", None), ("noop-cpu50", Some(json!({ "max_cpu_percent": 50 })))] {
        let dir = root.join(sub);
        mkdir(&dir)?;
        let mut manifest = json!({
            "name": "noop",
            "version": "1.0.0",
            "description": "Does nothing: measures the cost of running an executor.",
            "supported_actions": ["act-noop"],
            "entry_point": "noop.NoopExecutor",
            "permissions": {},
        });
        if let Some(l) = limits {
            manifest["resource_limits"] = l;
        }
        write(dir.join("manifest.json"), &(serde_json::to_string_pretty(&manifest).unwrap() + "\n"))?;
        write(dir.join("noop.py"), EXECUTOR_PY)?;
    }
    mkdir(&root.join("script"))?;
    write(root.join("script").join("noop.py"), SCRIPT_PY)?;
    Ok(scratch)
}

/// Wall time of one spawn-and-wait with stdout and stderr captured, and for `opservant run`
/// the result's `usage`. A failed or wrong run aborts the benchmark.
fn time_once(argv: &[String], expect: Expect) -> Result<(Duration, Option<Value>), String> {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let out = cmd.output().map_err(|e| format!("cannot start `{}`: {e}", argv.join(" ")))?;
    let elapsed = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let fail = |why: String| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.trim().lines().last().unwrap_or("").to_string();
        format!("`{}` {why}; aborting the benchmark. stderr: {last}", argv.join(" "))
    };
    if !out.status.success() {
        return Err(fail(format!("failed ({}), stdout: {}", out.status, stdout.trim())));
    }
    match expect {
        Expect::EmptyObject if stdout.trim() == "{}" => Ok((elapsed, None)),
        Expect::EmptyObject => Err(fail(format!("printed {:?}, not {{}}", stdout.trim()))),
        Expect::Completed => {
            let result: Value = serde_json::from_str(stdout.trim())
                .map_err(|e| fail(format!("printed no result JSON ({e}): {:?}", stdout.trim())))?;
            if result["status"] != "completed" || result["output"] != json!({}) {
                return Err(fail(format!(
                    "returned status {} output {} (error: {})",
                    result["status"], result["output"], result["error"]
                )));
            }
            Ok((elapsed, Some(result["usage"].clone())))
        }
    }
}

/// Medians of what `opservant run` measured itself, and how many runs the CPU quota throttled.
fn usage_summary(usage: &[Value]) -> Value {
    let median = |key: &str| {
        let mut v: Vec<u64> = usage.iter().filter_map(|u| u[key].as_u64()).collect();
        v.sort_unstable();
        (!v.is_empty()).then(|| percentile(&v, 50))
    };
    let throttled = usage.iter().filter(|u| u["cpu_throttled_periods"].as_u64().unwrap_or(0) > 0).count();
    json!({
        "runs": usage.len(),
        "wall_ms": median("wall_ms"),
        "cpu_ms": median("cpu_ms"),
        "cpu_throttled_ms": median("cpu_throttled_ms"),
        "throttled_runs": throttled,
    })
}

fn summarize(samples: &[Duration]) -> Summary {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Summary {
        min: ms(sorted[0]),
        median: ms(percentile(&sorted, 50)),
        p90: ms(percentile(&sorted, 90)),
        p99: ms(percentile(&sorted, 99)),
        max: ms(sorted[sorted.len() - 1]),
    }
}

/// Nearest-rank percentile of sorted, non-empty values (`sorted[ceil(p/100 * n) - 1]`, always
/// an observed value; the median is the lower of the two middle values when n is even).
fn percentile<T: Copy>(sorted: &[T], p: usize) -> T {
    common::percentile(sorted, p).expect("percentile of no samples (rounds are at least 1)")
}

fn python_version() -> Result<String, String> {
    let out = Command::new(PYTHON)
        .args(["-I", "-S", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"])
        .output()
        .map_err(|e| format!("cannot run {PYTHON}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{PYTHON} failed ({})", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
