//! `opservant bench` end to end, as root: one round of every row, the throughput and memory
//! sections, the JSON report and the SVG chart. Structure only — every row present or
//! explicitly skipped, every figure positive, the chart well-formed — never a timing.

mod common;

use std::path::Path;
use std::process::Stdio;

use common::HostDir;
use serde_json::Value;

/// Every row `opservant bench` knows (agent::bench::ROWS).
const ROWS: &[&str] = &[
    "true",
    "python3",
    "unshare",
    "bwrap-true",
    "bwrap-python3",
    "sandbox-cold",
    "sandbox-zygote",
    "run-cold",
    "run-zygote",
    "run-pool",
    "run-agent",
    "run-agent-pool",
    "run-cold-egress",
    "run-zygote-egress",
    "run-pool-egress",
];

fn bench(args: &[&str]) -> std::process::Output {
    common::command().arg("bench").args(args).stdin(Stdio::null()).output().expect("spawn opservant")
}

fn positive(v: &Value) -> bool {
    v.as_f64().is_some_and(|x| x > 0.0)
}

/// A minimal well-formedness check: every element closed in order; comments, the XML
/// declaration and self-closing elements allowed.
fn well_formed(svg: &str) -> Result<(), String> {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = svg;
    while let Some(i) = rest.find('<') {
        rest = &rest[i..];
        if rest.starts_with("<!--") {
            let end = rest.find("-->").ok_or("unterminated comment")?;
            rest = &rest[end + 3..];
            continue;
        }
        let end = rest.find('>').ok_or("unterminated tag")?;
        let tag = &rest[1..end];
        rest = &rest[end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') || tag.ends_with('/') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().ok_or_else(|| format!("</{name}> closes nothing"))?;
            if open != name.trim() {
                return Err(format!("</{name}> closes <{open}>"));
            }
        } else {
            stack.push(tag.split_whitespace().next().unwrap_or("").to_string());
        }
    }
    if stack.is_empty() {
        Ok(())
    } else {
        Err(format!("unclosed: {stack:?}"))
    }
}

#[test]
fn one_round_writes_a_complete_report_and_chart() {
    if !common::require_root() {
        return;
    }
    let dir = HostDir::new();
    let (json_path, svg_path) = (dir.path.join("bench.json"), dir.path.join("bench.svg"));
    // The scratch directory of a benchmark that was killed: its pid is not running.
    let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max").unwrap().trim().parse().unwrap();
    let dead = (2..pid_max).rev().find(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()).unwrap();
    let stale = std::path::PathBuf::from(format!("/var/tmp/opservant-bench-{dead}"));
    std::fs::create_dir_all(stale.join("noop")).unwrap();
    let out = bench(&[
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--duration",
        "1",
        "--json",
        json_path.to_str().unwrap(),
        "--svg",
        svg_path.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{:?}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );

    assert!(!stale.exists(), "a dead benchmark's scratch directory was left");
    let report: Value = serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
    assert_eq!(report["rounds"], 1);
    // Measured as this host's configuration runs sandboxes (the tests' gives a host uid each).
    assert_eq!(
        report["host_uids"],
        serde_json::json!({"per_sandbox": true, "first": 1_900_000_000u32, "count": 65536})
    );
    assert!(stdout.contains("sandboxes ran as a host uid of their own each"), "{stdout}");
    assert!(positive(&report["cpus"]) && report["kernel"].as_str().is_some_and(|k| !k.is_empty()));
    assert!(report["timestamp_utc"].as_str().is_some_and(|t| t.ends_with('Z')));
    assert_eq!(report["python"]["path"], "/usr/bin/python3");

    let rows = report["rows"].as_array().unwrap();
    let skipped = report["skipped"].as_array().unwrap();
    for name in ROWS {
        let row = rows.iter().find(|r| r["name"] == *name);
        let skip = skipped.iter().find(|s| s["name"] == *name);
        match (row, skip) {
            (Some(r), None) => {
                let s = &r["summary"];
                assert_eq!(s["samples"], 1, "{name}");
                for k in ["min_ms", "median_ms", "p90_ms", "p99_ms", "max_ms"] {
                    assert!(positive(&s[k]), "{name}: {k} = {}", s[k]);
                }
                assert!(r["reference"].as_str().is_some_and(|b| b.starts_with("bwrap-")), "{name}");
                assert!(stdout.lines().any(|l| l.split_whitespace().next() == Some(name)), "{name} not in the table");
                // The library executor rows say where the run's time went: every step, in
                // the order a run passes them (one sample: the medians are its moments).
                if ["run-zygote", "run-pool", "run-zygote-egress"].contains(name) {
                    let steps = r["steps"].as_array().unwrap_or_else(|| panic!("{name}: no steps: {r}"));
                    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
                    let want: Vec<&str> = agent::executor_run::TIMELINE_STEPS.iter().map(|(n, _)| *n).collect();
                    assert_eq!(names, want, "{name}");
                    let at = |step: &str| {
                        let st = steps.iter().find(|s| s["step"] == step).unwrap();
                        assert_eq!(st["samples"], 1, "{name}: {st}");
                        assert!(positive(&st["median_ms"]), "{name}: {st}");
                        st["median_ms"].as_f64().unwrap()
                    };
                    // Steps one thread passes in turn (the result and the payload's exit are
                    // read by two threads: either may come first).
                    for pair in [
                        ["sandbox", "start_audited"],
                        ["start_audited", "ready"],
                        ["ready", "result"],
                        ["payload_exited", "outcome"],
                        ["outcome", "complete_audited"],
                    ] {
                        assert!(at(pair[0]) <= at(pair[1]), "{name}: {} after {}: {steps:?}", pair[0], pair[1]);
                    }
                    assert!(at("complete_audited") <= s["median_ms"].as_f64().unwrap(), "{name}: {r}");
                    assert!(stdout.contains("where a library run's time goes"), "{stdout}");
                } else {
                    assert!(r["steps"].is_null(), "{name}: {r}");
                }
            }
            (None, Some(s)) => {
                assert!(s["reason"].as_str().is_some_and(|r| !r.is_empty()), "{name}");
                assert!(stdout.contains(&format!("SKIPPED {name}:")), "{name}: no SKIPPED line");
                // The one row that cannot apply is always skipped; under CI nothing else is.
                if *name == "run-pool-egress" {
                    assert_eq!(s["reason"], agent::bench::POOL_EGRESS_SKIP);
                } else {
                    assert!(!common::in_ci(), "{name} skipped under CI: {s}");
                }
            }
            _ => panic!("{name}: neither measured nor skipped exactly once"),
        }
    }
    assert_eq!(rows.len() + skipped.len(), ROWS.len());

    assert_eq!(report["pool"]["built"], true);
    let t = &report["throughput"];
    assert!(positive(&t["executions"]) && positive(&t["per_second"]) && positive(&t["threads"]), "{t}");
    let t = &report["throughput_agent"];
    assert!(positive(&t["executions"]) && positive(&t["per_second"]) && positive(&t["threads"]), "{t}");
    assert!(stdout.contains("throughput through an agent: "), "{stdout}");
    let m = &report["memory"];
    for path in [
        &m["zygote_idle"],
        &m["sandbox_program"]["machinery"],
        &m["sandbox_executor"]["machinery"],
        &m["sandbox_executor"]["payload_mem"],
        &m["agent_idle"],
        &m["agent_idle"]["with_children"],
    ] {
        assert!(positive(&path["rss_mib"]) && positive(&path["pss_mib"]), "{m}");
    }

    let targets = report["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 6);
    for t in targets {
        assert!(t["met"].is_boolean() && positive(&t["measured"]), "{t}");
    }
    assert_eq!(stdout.lines().filter(|l| l.starts_with("target ")).count(), 6);

    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(svg.trim_start().starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    well_formed(&svg).unwrap();
    for r in rows {
        assert!(svg.contains(r["name"].as_str().unwrap()), "{} not in the chart", r["name"]);
    }
}

#[test]
fn bad_options_exit_2() {
    for args in [
        &["--rounds", "0"][..],
        &["--rounds", "x"],
        &["--only", "nope"],
        &["--only", "run-zygote,"],
        &["--duration", "0"],
        &["--threads", "0"],
        &["--threads", "257"],
        &["--frobnicate"],
        // Their sum wrapped to no rounds at all (a report of nothing, exit 0).
        &["--rounds", "18446744073709551615", "--warmup", "1"],
        &["--rounds", "1", "--warmup", "18446744073709551615"],
    ] {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!out.stderr.is_empty(), "{args:?}: no reason given");
    }
    // Where the report would go is checked before anything is measured: a missing directory,
    // a device, a FIFO (which blocked the write for ever).
    let dir = HostDir::new();
    let fifo = dir.path.join("report.fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let missing = dir.path.join("no/such/dir/report.json");
    // A link (root writing through a link another user planted in /tmp): not followed.
    let link = dir.path.join("report.json");
    std::os::unix::fs::symlink(dir.path.join("victim"), &link).unwrap();
    for (flag, path) in [
        ("--json", missing.as_path()),
        ("--svg", Path::new("/dev/full")),
        ("--json", fifo.as_path()),
        ("--svg", link.as_path()),
    ] {
        let args = ["--only", "true", "--rounds", "1", flag, path.to_str().unwrap()];
        let out = bench(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&format!("{flag} {}", path.display())), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}: measured first: {}", String::from_utf8_lossy(&out.stdout));
    }
}

#[test]
fn svg_check_catches_broken_documents() {
    assert!(well_formed("<?xml v?><svg a='1'><g><rect/></g><!-- x --><text>t</text></svg>").is_ok());
    assert!(well_formed("<svg><g></svg>").is_err());
    assert!(well_formed("<svg>").is_err());
}

/// A benchmark of `rows` for as many rounds as it takes, once it has printed its header —
/// when everything is set up (scratch directory, network namespace, zygote, pool, agents)
/// and the samples start; with its stdout, kept open.
fn started_bench(rows: &str) -> (std::process::Child, std::io::BufReader<std::process::ChildStdout>) {
    use std::io::BufRead;
    let mut child = common::command()
        .args(["bench", "--only", rows, "--rounds", "100000", "--timings-only"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn opservant");
    let Some(out) = child.stdout.take() else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("no stdout");
    };
    let mut stdout = std::io::BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        if !matches!(stdout.read_line(&mut line), Ok(n) if n > 0) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the benchmark ended before its first sample");
        }
        if line.starts_with("opservant bench:") {
            return (child, stdout);
        }
    }
}

/// The command lines of the processes running from the scratch directory of the benchmark
/// `pid` (its installed copies: agents, zygotes).
fn processes_of_bench(pid: u32) -> Vec<String> {
    let marker = format!("opservant-bench-{pid}/");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&marker))
        .collect()
}

#[test]
fn a_stop_signal_ends_the_run_and_removes_what_it_made() {
    if !common::require_root() {
        return;
    }
    let (mut child, _stdout) = started_bench("run-zygote-egress,run-pool,run-agent-pool");
    let pid = child.id();
    let scratch = std::path::PathBuf::from(format!("/var/tmp/opservant-bench-{pid}"));
    let netns = std::path::PathBuf::from(format!("/run/netns/opsvbench-{pid}"));
    assert!(scratch.is_dir() && netns.exists(), "nothing to clean up: {} {}", scratch.display(), netns.display());
    std::thread::sleep(std::time::Duration::from_millis(300));
    // SAFETY: kill(2) on the child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(std::time::Instant::now() < deadline, "still running 60 s after SIGTERM");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    // Ran but did not complete: 1 (the command line's contract), not death by the signal.
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("interrupted by signal 15"), "{stderr}");
    assert!(!scratch.exists(), "scratch directory left");
    assert!(!netns.exists(), "network namespace left");
    // The zygote (started from the scratch directory's copy of the runtime) ends when its
    // control socket closes with the benchmark; the agent of `run-agent-pool` (the scratch
    // directory's copy of opservant), its zygote and its pooled sandbox are stopped by it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = processes_of_bench(pid);
        if left.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "processes left: {left:?}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A benchmark killed outright (SIGKILL: no handler, no destructor) leaves no agent of its
/// `run-agent*` rows running: the kernel sends each SIGTERM (`PR_SET_PDEATHSIG`), and it
/// stops. Its scratch directory is left for the next benchmark (removed here).
#[test]
fn a_killed_benchmark_leaves_no_agent_running() {
    if !common::require_root() {
        return;
    }
    let (mut child, _stdout) = started_bench("run-agent,run-agent-pool");
    let pid = child.id();
    // Distinct command lines: a fork of an agent not yet exec'd (its zygote starting) has its
    // parent's, and is not another agent (CI once counted three here).
    let agents = || -> std::collections::BTreeSet<String> {
        processes_of_bench(pid).into_iter().filter(|c| c.contains(" agent ")).collect()
    };
    assert_eq!(agents().len(), 2, "both agents run: {:?}", agents());
    child.kill().unwrap();
    child.wait().unwrap();
    // The agents stop; their zygotes go with them (each ends when its agent's control socket
    // closes).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !processes_of_bench(pid).is_empty() {
        assert!(std::time::Instant::now() < deadline, "processes left running: {:?}", processes_of_bench(pid));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(format!("/var/tmp/opservant-bench-{pid}"));
    // No egress row ran, so no network namespace of its own was made; removed should one be.
    if std::path::Path::new(&format!("/run/netns/opsvbench-{pid}")).exists() {
        let _ = std::process::Command::new("ip").args(["netns", "del", &format!("opsvbench-{pid}")]).status();
        panic!("the benchmark made a network namespace without an egress row");
    }
}
