//! Load and soak against a real daemon, as root (issue 6): 8 concurrent clients submitting
//! signed no-op executions for `OPSERVANT_LOAD_SECONDS` (default 60), then
//! `OPSERVANT_SOAK_RUNS` (default 1000) sequential executions with memory and fork bombs
//! mixed in. Afterwards nothing may be left behind — sandbox cgroups, namespaces, mounts,
//! descriptors, zombies, interfaces, scratch entries — and the agent's and its zygote's
//! memory must be back within 10 % of where they were after warming up. The figures
//! (executions per second, memory) are printed; nothing here asserts a duration.

mod common;
#[path = "common/daemon.rs"]
mod daemon;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use daemon::Agent;
use serde_json::{json, Value};

use agent::bench::NOOP_PY;

/// `kind`: `memory` allocates until the OOM killer stops it; `fork` forks sleeping children
/// until the pids limit refuses (and reports how many it got).
const BOMB_PY: &str = r#"import os, time
from opservant.executor import BaseExecutor, ExecutorResult


class Bomb(BaseExecutor):
    def validate(self, params):
        return params.get("kind") in ("memory", "fork")

    def execute(self, params, context):
        if params["kind"] == "memory":
            chunks = []
            while True:
                chunks.append(bytearray(1 << 20))
        n = 0
        while True:
            try:
                pid = os.fork()
            except OSError as e:
                return ExecutorResult(status="completed", output={"forked": n, "errno": e.errno})
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            n += 1
"#;

/// `name`'s number, to shorten a local run; under CI the full `default` always runs.
fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name).ok().and_then(|v| v.parse().ok()) {
        Some(n) if !common::in_ci() => n,
        Some(_) => {
            eprintln!("CI=true: {name} ignored, using {default}");
            default
        }
        None => default,
    }
}

/// Signs in this process (the load must not be the cost of spawning `opservant sign`) and
/// submits on the agent's socket.
struct Client {
    key: ed25519_dalek::SigningKey,
    socket: std::path::PathBuf,
}

impl Client {
    fn run(&self, id: &str, executor: &str, parameters: Value) -> Value {
        let mut cmd = json!({"command_id": id, "action": "execute", "executor": executor, "parameters": parameters})
            .as_object()
            .unwrap()
            .clone();
        agent::signing::sign(&mut cmd, &self.key, agent::signing::now()).unwrap();
        let bytes = serde_json::to_vec(&cmd).unwrap();
        agent::daemon::submit(&self.socket, &bytes).unwrap_or_else(|e| panic!("{id}: {}", e.0))
    }
}

fn entries(dir: &str, prefix: &str) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

fn count(dir: String) -> usize {
    std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or_else(|e| panic!("{dir}: {e}"))
}

fn namespaces(pid: i32) -> BTreeSet<String> {
    ["cgroup", "ipc", "mnt", "net", "pid", "user", "uts"]
        .iter()
        .filter_map(|ns| std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .collect()
}

fn rss_kb(pid: i32) -> u64 {
    status_kb(pid, "VmRSS:")
}

fn status_kb(pid: i32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// What the agent holds and what it could leave behind.
#[derive(Debug, PartialEq)]
struct Footprint {
    agent_fds: usize,
    zygote_fds: usize,
    /// Processes below the agent other than its zygote (sandboxes, zombies).
    stray_processes: Vec<String>,
    sandbox_cgroups: usize,
    /// The host's mount table (mount points).
    host_mounts: BTreeSet<String>,
    /// Namespaces held by the agent and the zygote.
    namespaces: BTreeSet<String>,
    interfaces: BTreeSet<String>,
    tmp: BTreeSet<String>,
    run: BTreeSet<String>,
}

fn footprint(agent: i32, zygote: i32) -> Footprint {
    let stray_processes = common::procs::descendants(agent)
        .into_iter()
        .filter(|p| *p != zygote)
        .map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default())
        .collect();
    let host_mounts = std::fs::read_to_string(format!("/proc/{agent}/mountinfo"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .collect();
    Footprint {
        agent_fds: count(format!("/proc/{agent}/fd")),
        zygote_fds: count(format!("/proc/{zygote}/fd")),
        stray_processes,
        sandbox_cgroups: common::cgroups_of(agent as u32).len(),
        host_mounts,
        namespaces: namespaces(agent).union(&namespaces(zygote)).cloned().collect(),
        interfaces: entries("/sys/class/net", ""),
        tmp: entries("/tmp", "opservant"),
        run: entries("/run/opservant", ""),
    }
}

/// The lines of the two footprints' debug forms that differ.
fn changes(before: &Footprint, after: &Footprint) -> String {
    let (b, a) = (format!("{before:#?}"), format!("{after:#?}"));
    let (b, a): (BTreeSet<&str>, BTreeSet<&str>) = (b.lines().collect(), a.lines().collect());
    let gone = b.difference(&a).map(|l| format!("- {}", l.trim()));
    let new = a.difference(&b).map(|l| format!("+ {}", l.trim()));
    gone.chain(new).collect::<Vec<_>>().join("\n")
}

/// Poll until `f` holds (the daemon replies before its last sandbox process is reaped).
fn settle(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn load_and_soak_leave_nothing_behind() {
    if !common::require_root() {
        return;
    }
    let mut a = Agent::new(8);
    a.install("noop", "NoopExecutor", NOOP_PY, json!({"timeout_seconds": 30}));
    a.install("bomb", "Bomb", BOMB_PY, json!({"timeout_seconds": 30, "max_memory_mb": 48, "max_pids": 8}));
    a.start();
    let agent = a.child.as_ref().unwrap().id() as i32;
    let client = Client { key: agent::signing::load_signing_key(&a.key).unwrap(), socket: a.socket.clone() };
    let mut zygote = None;
    settle(|| {
        zygote = daemon::zygote_pid(agent as u32);
        zygote.is_some()
    });
    let zygote = zygote.expect("the agent runs a zygote");
    // The agent hashes its binaries on a thread as it starts (its files open meanwhile):
    // done, and recorded, before the baseline is taken.
    let hashed = || a.audit_events().iter().any(|e| e["event"] == "agent_binaries");
    settle(hashed);
    assert!(hashed(), "the agent's binaries were not hashed and recorded within 10 s");

    // Warm up, concurrently like the load, so allocator arenas and thread stacks exist.
    std::thread::scope(|s| {
        for t in 0..8 {
            let client = &client;
            s.spawn(move || {
                for n in 0..5 {
                    let r = client.run(&format!("warm-{t}-{n}"), "noop", json!({}));
                    assert_eq!(r["status"], "completed", "{r}");
                }
            });
        }
    });
    let before = footprint(agent, zygote);
    let settle_footprint = |want: &Footprint| {
        let mut now = footprint(agent, zygote);
        settle(|| {
            now = footprint(agent, zygote);
            now == *want
        });
        now
    };
    let before = {
        // The last warm-up sandboxes may still be tearing down.
        let mut f = before;
        settle(|| {
            f = footprint(agent, zygote);
            f.stray_processes.is_empty() && f.sandbox_cgroups == 0
        });
        f
    };
    assert!(before.stray_processes.is_empty() && before.sandbox_cgroups == 0, "{before:#?}");
    let (rss_agent, rss_zygote) = (rss_kb(agent), rss_kb(zygote));
    let (anon0, file0, thr0) =
        (status_kb(agent, "RssAnon:"), status_kb(agent, "RssFile:"), status_kb(agent, "Threads:"));

    // Load: 8 clients for the given time.
    let seconds = env_number("OPSERVANT_LOAD_SECONDS", 60);
    let done = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..8 {
            let (client, done, a) = (&client, &done, &a);
            s.spawn(move || {
                let mut n = 0;
                while started.elapsed() < Duration::from_secs(seconds) {
                    let r = client.run(&format!("load-{t}-{n}"), "noop", json!({}));
                    assert_eq!(r["status"], "completed", "{r}");
                    if r["sandbox"]["launch"] != "zygote" {
                        let fallbacks: Vec<Value> =
                            a.audit_events().into_iter().filter(|e| e["event"] == "zygote_fallback").collect();
                        panic!("started {}, not from the zygote: {fallbacks:?}", r["sandbox"]["launch"]);
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    n += 1;
                }
            });
        }
    });
    let loaded = done.load(Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    println!("load: {loaded} executions by 8 clients in {elapsed:.1} s = {:.1}/s", loaded as f64 / elapsed);
    let after_load = settle_footprint(&before);
    assert!(after_load == before, "after the load:\n{}", changes(&before, &after_load));

    // Soak: sequential, with bombs.
    let runs = env_number("OPSERVANT_SOAK_RUNS", 1000);
    let (mut ooms, mut fork_bombs) = (0, 0);
    let started = Instant::now();
    for i in 0..runs {
        let id = format!("soak-{i}");
        let r = match i % 50 {
            10 => {
                let r = client.run(&id, "bomb", json!({"kind": "memory"}));
                assert_eq!((r["status"].as_str(), r["killed_by"].as_str()), (Some("failed"), Some("oom")), "{r}");
                ooms += 1;
                r
            }
            35 => {
                let r = client.run(&id, "bomb", json!({"kind": "fork"}));
                assert_eq!(r["status"], "completed", "{r}");
                assert_eq!(r["output"]["errno"], 11, "EAGAIN from the pids limit: {r}");
                fork_bombs += 1;
                r
            }
            _ => client.run(&id, "noop", json!({})),
        };
        assert!(r["status"] == "completed" || r["killed_by"] == "oom", "{r}");
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "soak: {runs} sequential executions ({ooms} memory bombs, {fork_bombs} fork bombs) in {elapsed:.1} s = {:.1}/s",
        runs as f64 / elapsed
    );
    // Every 50 runs one of each bomb: the full soak (always under CI) has 20 of each.
    if common::in_ci() {
        assert_eq!((loaded > 0, ooms, fork_bombs), (true, 20, 20), "the full load and soak under CI");
    }
    let after = settle_footprint(&before);
    assert!(after == before, "after the soak:\n{}", changes(&before, &after));
    let (end_agent, end_zygote) = (rss_kb(agent), rss_kb(zygote));
    println!("memory: agent VmRSS {rss_agent} → {end_agent} kB, zygote {rss_zygote} → {end_zygote} kB");
    println!(
        "memory detail: agent RssAnon {anon0} → {} kB, RssFile {file0} → {} kB, threads {thr0} → {}",
        status_kb(agent, "RssAnon:"),
        status_kb(agent, "RssFile:"),
        status_kb(agent, "Threads:")
    );
    assert!(end_agent * 10 <= rss_agent * 11, "agent RSS {rss_agent} → {end_agent} kB");
    assert!(end_zygote * 10 <= rss_zygote * 11, "zygote RSS {rss_zygote} → {end_zygote} kB");

    assert!(a.stop().success());
    assert!(Path::new(&format!("/proc/{zygote}")).metadata().is_err(), "the zygote ends with the agent");
    assert!(common::cgroups_of(agent as u32).is_empty());
    a.audit_verify();
}
