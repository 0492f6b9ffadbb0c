//! The hash-chained audit log end to end, with the real binary as root: `opservant run`,
//! `script` and `session` append their records to the log named by `--config` (`audit:
//! {path: …}` in a temporary directory — never the real /var/log); `opservant audit verify`
//! passes an intact chain and reports the first edited, removed, reordered or truncated
//! record by file, line and kind (exit 1), across rotated files too; concurrent writers
//! (8 `opservant run`s and in-process appenders at once) keep one chain; a log that cannot
//! be written stops a run before anything of it executes (exit 2), and so does a log whose
//! lock another writer holds past `audit.lock_wait_seconds`; a record written only in part
//! is cut back off; `audit tail` shows the last records and follows new ones.

mod common;

use common::sha256_hex;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{require_root, HostDir};
use serde_json::{json, Value};

#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn opservant(args: &[&str]) -> Out {
    let _view = common::host_view();
    let out = common::command()
        .args(args)
        .env_remove("OPSERVANT_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("spawn opservant");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Write `rel` below `root`, readable by everyone (the sandbox runs as an unprivileged uid).
fn put(root: &Path, rel: &str, content: &str) -> PathBuf {
    let p = root.join(rel);
    let parent = p.parent().expect("parent");
    std::fs::create_dir_all(parent).expect("mkdir");
    std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::write(&p, content).expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    p
}

const EXECUTOR: &str = r#"
from opservant.executor import BaseExecutor, ExecutorResult


class TestExecutor(BaseExecutor):
    name = "audit-test"
    version = "1.0.0"

    def validate(self, params):
        return True

    def execute(self, params, context):
        return ExecutorResult(status="completed", output={"ok": True})
"#;

/// An executor package (completes) in a fresh host directory.
fn executor() -> HostDir {
    let d = HostDir::new();
    let manifest = json!({
        "name": "audit-test", "version": "1.0.0", "description": "audit log test", "author": "tests",
        "supported_actions": ["act-test"], "entry_point": "test_executor.TestExecutor",
        "requirements": {"python": ">=3.9", "packages": []},
        "permissions": {}, "resource_limits": {"max_cpu_percent": 50, "timeout_seconds": 60}
    });
    put(&d.path, "manifest.json", &manifest.to_string());
    put(&d.path, "test_executor/__init__.py", EXECUTOR);
    d
}

/// A configuration whose audit log lives in its own temporary directory.
struct Log {
    _dir: HostDir,
    config: PathBuf,
    path: PathBuf,
}

impl Log {
    fn new(extra: &str) -> Log {
        let dir = HostDir::new();
        let path = dir.path.join("log/audit.jsonl");
        let config = dir.path.join("config.yaml");
        std::fs::write(&config, format!("audit:\n  path: {}\n  journald: false\n{extra}", path.display())).unwrap();
        Log { _dir: dir, config, path }
    }

    fn conf(&self) -> &str {
        self.config.to_str().unwrap()
    }

    fn run(&self, exec: &HostDir) -> Out {
        let out = opservant(&["run", exec.str(), "--config", self.conf()]);
        assert_eq!(out.code, 0, "{out:?}");
        out
    }

    fn lines(&self) -> Vec<String> {
        read_lines(&self.path)
    }

    fn records(&self) -> Vec<Value> {
        self.lines().iter().map(|l| serde_json::from_str(l).unwrap()).collect()
    }

    fn verify(&self, files: &[&Path]) -> Out {
        let mut args = vec!["audit", "verify", "--config", self.conf()];
        args.extend(files.iter().map(|f| f.to_str().unwrap()));
        opservant(&args)
    }

    fn rotated(&self, n: u32) -> PathBuf {
        PathBuf::from(format!("{}.{n}", self.path.display()))
    }
}

fn read_lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p).unwrap().lines().map(str::to_string).collect()
}

fn write_lines(p: &Path, lines: &[String]) {
    std::fs::write(p, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
}

/// `audit verify` found a problem: exit 1, its first line `FILE:LINE: KIND …`.
fn assert_problem(out: &Out, file: &Path, line: usize, kind: &str) {
    assert_eq!(out.code, 1, "{out:?}");
    let first = out.stdout.lines().next().unwrap_or("");
    let want = format!("{}:{line}: {kind}", file.display());
    assert!(first.starts_with(&want), "want {want:?}, got {first:?}\n{}", out.stdout);
}

#[test]
fn a_run_appends_chained_start_and_complete_records() {
    if !require_root() {
        return;
    }
    let log = Log::new("");
    let exec = executor();
    let out = log.run(&exec);
    // The tracing line on stderr names the record's seq.
    assert!(out.stderr.contains("event=\"executor_start\"") && out.stderr.contains("seq=1"), "{}", out.stderr);

    let lines = log.lines();
    let recs = log.records();
    let events: Vec<&str> = recs.iter().map(|r| r["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["executor_start", "executor_complete"], "{lines:?}");
    assert_eq!(recs[0]["seq"], 1);
    assert_eq!(recs[0]["prev"], "0".repeat(64), "the genesis");
    assert_eq!(recs[1]["seq"], 2);
    assert_eq!(recs[1]["prev"], sha256_hex(lines[0].as_bytes()), "prev = SHA-256 of the previous line");
    assert_eq!(recs[0]["fields"]["executor"], "audit-test");
    // Which package ran (a copy elsewhere under the same manifest name is told apart).
    assert_eq!(recs[0]["fields"]["package"], exec.str(), "{}", recs[0]);
    assert_eq!(recs[1]["fields"]["status"], "completed");
    let host = nix::unistd::gethostname().unwrap().into_string().unwrap();
    assert_eq!(recs[0]["host"], host.as_str());
    assert!(recs[0]["pid"].as_u64().is_some_and(|p| p > 1));
    let ts = recs[0]["ts"].as_str().unwrap();
    assert!(ts.len() == 27 && ts.ends_with('Z') && ts.as_bytes()[10] == b'T', "{ts}");
    // Root-only: directory 0700, file 0600.
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(log.path.parent().unwrap()), 0o700);
    assert_eq!(mode(&log.path), 0o600);

    let v = log.verify(&[]);
    assert_eq!(v.code, 0, "{v:?}");
    assert!(v.stdout.starts_with("chain intact: 2 records in 1 file (seq 1..2)"), "{}", v.stdout);
    assert!(v.stdout.contains(&format!("head: {}", sha256_hex(lines[1].as_bytes()))), "{}", v.stdout);
    let v = log.verify(&[&log.path]);
    assert_eq!(v.code, 0, "{v:?}");
    let out = opservant(&["audit", "verify", "--json", "--config", log.conf()]);
    let j: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!((j["intact"].clone(), j["records"].clone(), j["problem"].clone()), (json!(true), json!(2), Value::Null));
}

#[test]
fn script_and_session_are_audited_in_the_same_chain() {
    if !require_root() {
        return;
    }
    let log = Log::new("");
    let dir = HostDir::new();
    let script = put(&dir.path, "hello.py", "print('hi')\n");
    let out = opservant(&["script", "python", script.to_str().unwrap(), "--config", log.conf()]);
    assert_eq!(out.code, 0, "{out:?}");
    let name = format!("audit{}", std::process::id());
    let out = opservant(&["session", "start", &name, "--config", log.conf()]);
    assert_eq!(out.code, 0, "{out:?}");
    let exec = opservant(&["session", "exec", &name, "--code", "x = 1"]);
    let stop = opservant(&["session", "stop", &name]);
    let _ = std::fs::remove_file(format!("/run/opservant/sessions/{name}.log"));
    assert_eq!((exec.code, stop.code), (0, 0), "{exec:?} {stop:?}");
    // The daemon writes session_end as it exits, just after answering `stop`.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !log.records().iter().any(|r| r["event"] == "session_end") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let events: Vec<String> = log.records().iter().map(|r| r["event"].as_str().unwrap().to_string()).collect();
    assert_eq!(
        events,
        ["script_start", "script_end", "session_start", "session_exec", "session_exec_end", "session_end"]
    );
    // What ran: the script's absolute path and the SHA-256 of its text.
    let start = &log.records()[0];
    assert_eq!(start["fields"]["path"], script.to_str().unwrap(), "{start}");
    assert_eq!(start["fields"]["sha256"], sha256_hex(b"print('hi')\n"), "{start}");
    assert_eq!(log.verify(&[]).code, 0);
}

#[test]
fn hostile_audit_files_are_reported_not_crashed() {
    let dir = HostDir::new();
    let path = dir.path.join("audit.jsonl");
    let log = agent::audit::AuditLog::open(agent::audit::AuditSettings::at(&path)).unwrap();
    for i in 0..3 {
        let fields = serde_json::Map::from_iter([("i".to_string(), json!(i.to_string()))]);
        log.append("test", &fields).unwrap();
    }
    drop(log);
    let good = std::fs::read(&path).unwrap();
    let p = path.to_str().unwrap();
    assert_eq!(opservant(&["audit", "verify", p]).code, 0);
    // A line of invalid UTF-8 and one nested 100 000 deep: the chain is broken at that line
    // (exit 1, FILE:LINE: not_json), no crash.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    for line in [&b"\xff\xfe{\"seq\":4}"[..], deep.as_bytes()] {
        std::fs::write(&path, [&good[..], line, b"\n"].concat()).unwrap();
        let out = opservant(&["audit", "verify", p]);
        assert_problem(&out, &path, 4, "not_json");
        assert!(out.stderr.is_empty(), "{out:?}");
    }
    // A file larger than any the agent writes is refused unread (exit 2, one line).
    let f = std::fs::OpenOptions::new().write(true).truncate(true).open(&path).unwrap();
    f.set_len(agent::audit::verify::MAX_FILE_BYTES + 1).unwrap(); // sparse
    let out = opservant(&["audit", "verify", p]);
    assert_eq!(out.code, 2, "{out:?}");
    assert_eq!(out.stderr.lines().count(), 1, "{out:?}");
    assert!(out.stderr.contains("more than the") && out.stderr.contains("audit.jsonl"), "{out:?}");
}

/// A log of `runs` × 2 records.
fn log_with_runs(runs: usize) -> (Log, HostDir) {
    let log = Log::new("");
    let exec = executor();
    for _ in 0..runs {
        log.run(&exec);
    }
    (log, exec)
}

#[test]
fn tampering_is_reported_at_the_first_broken_record() {
    if !require_root() {
        return;
    }
    let (log, exec) = log_with_runs(3);
    let orig = log.lines();
    assert_eq!(orig.len(), 6);
    let copy = log.path.with_file_name("copy.jsonl");

    // An edited field: reported at the edited record.
    let mut l = orig.clone();
    l[2] = l[2].replace("\"executor\":\"audit-test\"", "\"executor\":\"innocent\"");
    assert_ne!(l[2], orig[2]);
    write_lines(&copy, &l);
    assert_problem(&log.verify(&[&copy]), &copy, 3, "edited (seq 3)");
    let out = opservant(&["audit", "verify", "--json", copy.to_str().unwrap()]);
    let j: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(j["intact"], false);
    assert_eq!(j["problem"]["kind"], "edited");
    assert_eq!(j["problem"]["line"], 3);
    assert_eq!(j["problem"]["seq"], 3);
    assert_eq!(j["problem"]["file"], copy.to_str().unwrap());

    // A deleted record: reported where it was, as removed.
    let mut l = orig.clone();
    l.remove(2);
    write_lines(&copy, &l);
    let out = log.verify(&[&copy]);
    assert_problem(&out, &copy, 3, "removed (seq 4)");
    assert!(out.stdout.contains("seq 3 missing"), "{}", out.stdout);

    // Two records swapped: reordered, at the first one out of place.
    let mut l = orig.clone();
    l.swap(2, 3);
    write_lines(&copy, &l);
    assert_problem(&log.verify(&[&copy]), &copy, 3, "reordered (seq 4)");

    // The first record removed: the file no longer starts at the genesis.
    write_lines(&copy, &orig[1..]);
    assert_problem(&log.verify(&[&copy]), &copy, 1, "removed (seq 2)");

    // A line that is not JSON.
    let mut l = orig.clone();
    l.insert(4, "not json".into());
    write_lines(&copy, &l);
    assert_problem(&log.verify(&[&copy]), &copy, 5, "not_json");

    // A torn last line (a crash mid-write: the start of a record that was never
    // acknowledged): reported, exit 1 ...
    let text = std::fs::read_to_string(&log.path).unwrap();
    let torn = &text[text.len() - 120..text.len() - 30];
    std::fs::write(&log.path, format!("{text}{torn}")).unwrap();
    assert_problem(&log.verify(&[]), &log.path, 7, "truncated");
    // ... and the next append repairs it: the chain continues from the last complete
    // record with the next seq, the torn line stays, bound by its hash, and verify notes it.
    log.run(&exec);
    let l = log.lines();
    assert_eq!(l.len(), 9);
    let repair: Value = serde_json::from_str(&l[7]).unwrap();
    assert_eq!(repair["seq"], 7);
    assert_eq!(repair["prev"], sha256_hex(l[5].as_bytes()));
    assert_eq!(repair["repaired"]["bytes"], l[6].len());
    assert_eq!(repair["repaired"]["sha256"], sha256_hex(l[6].as_bytes()));
    assert_eq!(repair.get("gap"), None, "{repair}");
    let out = log.verify(&[]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains(&format!("note: {}:7: torn line", log.path.display())), "{}", out.stdout);

    // A record that was durable cut into a "torn" line (its end cut off): the repair alone
    // would hide it — the log's durable mark is past it, so the next record says it is
    // missing (since the twenty-fifth session), and verify reports it.
    let text = std::fs::read_to_string(&log.path).unwrap();
    std::fs::write(&log.path, &text[..text.len() - 30]).unwrap();
    log.run(&exec);
    let l = log.lines();
    let next: Value = serde_json::from_str(&l[9]).unwrap();
    assert_eq!((&next["seq"], &next["gap"]["from"], &next["gap"]["to"]), (&json!(9), &json!(8), &json!(8)), "{next}");
    assert_eq!(next["repaired"]["sha256"], sha256_hex(l[8].as_bytes()));
    assert_problem(&log.verify(&[]), &log.path, 10, "removed (seq 9): seq 8 missing");

    // Unreadable input and bad arguments: exit 2 with one line.
    let out = opservant(&["audit", "verify", "/nonexistent/audit.jsonl"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stdout.is_empty() && out.stderr.lines().count() == 1 && out.stderr.starts_with("opservant: "),
        "{out:?}"
    );
    assert_eq!(opservant(&["audit", "verify", "--bogus"]).code, 2);
}

/// Whole records cut off the end of the log: the chain alone cannot show it (the file given
/// by name verifies), but `verify` of the configured log checks its end against the lock
/// file's durable mark and reports it at once; the next append records the gap, numbered
/// after the records cut off.
#[test]
fn records_cut_off_the_end_are_reported_at_once_and_recorded_by_the_next_append() {
    if !require_root() {
        return;
    }
    let (log, exec) = log_with_runs(3);
    let l = log.lines();
    write_lines(&log.path, &l[..4]);
    assert_eq!(log.verify(&[&log.path]).code, 0, "a cut tail is a valid chain");
    let out = log.verify(&[]);
    assert_problem(&out, &log.path, 4, "removed: seq 5..6 missing at the end of the log");
    assert!(out.stdout.contains("durable"), "{}", out.stdout);
    log.run(&exec);
    let r = log.records();
    assert_eq!((&r[4]["seq"], &r[4]["gap"]["from"], &r[4]["gap"]["to"]), (&json!(7), &json!(5), &json!(6)), "{r:?}");
    assert_eq!(r[4]["gap"]["sha256"], sha256_hex(l[5].as_bytes()));
    assert_problem(&log.verify(&[]), &log.path, 5, "removed (seq 7): seq 5..6 missing");
}

#[test]
fn rotation_carries_the_chain_across_files() {
    if !require_root() {
        return;
    }
    let log = Log::new("  max_bytes: 1024\n  keep: 20\n");
    let exec = executor();
    for _ in 0..6 {
        log.run(&exec);
    }
    let (r1, r2, r3) = (log.rotated(1), log.rotated(2), log.rotated(3));
    assert!(r3.exists(), "at least 4 files from 12 records at 1024 bytes a file");
    for p in [&r1, &r2, &r3, &log.path] {
        assert!(std::fs::metadata(p).unwrap().len() <= 1024, "{}", p.display());
    }
    // The first record of a file continues the last one of the file rotated before it.
    let first: Value = serde_json::from_str(&log.lines()[0]).unwrap();
    let last_of_1 = read_lines(&r1).pop().unwrap();
    let prev: Value = serde_json::from_str(&last_of_1).unwrap();
    assert_eq!(first["prev"], sha256_hex(last_of_1.as_bytes()));
    // (`oldest`: where the history kept after the rotation begins — the genesis, keep 20.)
    assert_eq!(first["continues"], json!({"file": "audit.jsonl.1", "seq": prev["seq"], "oldest": 1}));

    // All files, found from the configuration, oldest first.
    let out = log.verify(&[]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.starts_with("chain intact: 12 records in"), "{}", out.stdout);
    // Given explicitly, in chain order.
    let out = log.verify(&[&r3, &r2, &r1, &log.path]);
    assert_eq!(out.code, 0, "{out:?}");
    // One file alone: intact, with a note that its first record continues an unseen file.
    let out = log.verify(&[&r1]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("note:") && out.stdout.contains("continues seq"), "{}", out.stdout);
    // Out of chain order: reported.
    assert_eq!(log.verify(&[&r1, &r2]).code, 1);
    // A copy named `audit.jsonl.01` is no rotated file (the writer never names one so, nor
    // reads it as one): verify leaves it out too — it had taken it for a second `.1` and
    // reported the chain reordered, naming the wrong file.
    std::fs::copy(&r1, log.path.with_file_name("audit.jsonl.01")).unwrap();
    let out = log.verify(&[]);
    assert_eq!(out.code, 0, "{out:?}");
    std::fs::remove_file(log.path.with_file_name("audit.jsonl.01")).unwrap();
    // What a record names is shown escaped: a continuation whose file name carries terminal
    // control sequences (set a title, clear the screen, print a fake verdict) cannot drive
    // the terminal of whoever verifies the log (the note had printed them raw).
    let mut first_of_1: Value = serde_json::from_str(&read_lines(&r1)[0]).unwrap();
    first_of_1["continues"]["file"] = json!("x\u{1b}]0;PWNED\u{7}\u{1b}[2J\u{1b}[32mchain intact\u{1b}[0m\u{9b}8m");
    let forged = log.path.with_file_name("forged.jsonl");
    write_lines(&forged, &[first_of_1.to_string()]);
    let out = log.verify(&[&forged]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("continues seq"), "{}", out.stdout);
    assert!(
        !out.stdout.chars().any(|c| c.is_control() && c != '\n'),
        "control characters reached the terminal: {:?}",
        out.stdout
    );
    assert!(out.stdout.contains("x\\u{1b}]0;PWNED\\u{7}"), "{}", out.stdout);

    // A smaller `keep`: the next rotation drops the files numbered past it too (kept, they
    // would lie beyond a gap, reported as a removed file).
    let conf = std::fs::read_to_string(&log.config).unwrap().replace("keep: 20", "keep: 2");
    std::fs::write(&log.config, conf).unwrap();
    for _ in 0..2 {
        log.run(&exec);
    }
    assert!(log.rotated(2).exists() && !log.rotated(3).exists() && !log.rotated(4).exists());
    let out = log.verify(&[]);
    assert_eq!(out.code, 0, "{out:?}");

    // A middle file removed: its records are missing where the next file starts.
    std::fs::remove_file(&r1).unwrap();
    let out = log.verify(&[]);
    assert_problem(&out, &log.path, 1, "removed");
    assert!(out.stdout.contains("missing"), "{}", out.stdout);
}

#[test]
fn concurrent_writers_keep_one_chain() {
    if !require_root() {
        return;
    }
    let log = Log::new("");
    let exec = executor();
    let started = Instant::now();
    // 8 runs at once, and 4 appenders in this process (each its own lock description, as
    // separate processes have) appending to the same log until the runs are done.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let appenders: Vec<_> = (0..4)
        .map(|t| {
            let (path, done) = (log.path.clone(), done.clone());
            std::thread::spawn(move || {
                let l = agent::audit::AuditLog::open(agent::audit::AuditSettings::at(&path)).unwrap();
                let mut n = 0u64;
                while n < 20 || !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let f = agent::audit::fields_object(&[("thread", &t.to_string()), ("i", &n.to_string())]);
                    l.append("test_append", &f).unwrap();
                    n += 1;
                }
                n
            })
        })
        .collect();
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let (exec, conf) = (exec.str().to_string(), log.conf().to_string());
            std::thread::spawn(move || opservant(&["run", &exec, "--config", &conf]))
        })
        .collect();
    for r in runs {
        let out = r.join().unwrap();
        assert_eq!(out.code, 0, "{out:?}");
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let appended: u64 = appenders.into_iter().map(|a| a.join().unwrap()).sum();
    eprintln!("8 runs + {appended} appends in {:?}", started.elapsed());
    let recs = log.records();
    assert_eq!(recs.len() as u64, 8 * 2 + appended);
    let seqs: Vec<u64> = recs.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=recs.len() as u64).collect::<Vec<u64>>());
    let pids: std::collections::HashSet<u64> =
        recs.iter().filter(|r| r["event"] == "executor_complete").map(|r| r["pid"].as_u64().unwrap()).collect();
    assert_eq!(pids.len(), 8, "one complete record from each run");
    // The writers really interleaved: appends landed between some run's start and end.
    let first_start = recs.iter().position(|r| r["event"] == "executor_start").unwrap();
    let last_end = recs.iter().rposition(|r| r["event"] == "executor_complete").unwrap();
    assert!(recs[first_start..last_end].iter().any(|r| r["event"] == "test_append"), "no interleaving");
    let out = log.verify(&[]);
    assert_eq!(out.code, 0, "{out:?}");
}

#[test]
fn verify_during_appends_and_rotations_reports_no_false_problem() {
    if !require_root() {
        return;
    }
    let log = Log::new("  max_bytes: 2048\n  keep: 3\n");
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (path, done) = (log.path.clone(), done.clone());
        std::thread::spawn(move || {
            let mut s = agent::audit::AuditSettings::at(&path);
            (s.max_bytes, s.keep) = (2048, 3);
            let l = agent::audit::AuditLog::open(s).unwrap();
            let mut n = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                l.append("busy", &agent::audit::fields_object(&[("n", &n.to_string())])).unwrap();
                n += 1;
            }
            n
        })
    };
    // At least 30 verifies, and on until three of them had the log rotate under them (each
    // append is fdatasynced, so on a loaded machine the writer may need many more verifies'
    // time to fill 2 KiB); bounded, so a writer that never rotates fails below.
    let (mut rotated_under_us, mut verifies) = (0, 0);
    let give_up = std::time::Instant::now() + Duration::from_secs(120);
    while verifies < 30 || (rotated_under_us < 3 && std::time::Instant::now() < give_up) {
        let before = log.rotated(1).metadata().map(|m| m.ino()).ok();
        let out = log.verify(&[]);
        assert_eq!(out.code, 0, "{out:?}");
        rotated_under_us += usize::from(log.rotated(1).metadata().map(|m| m.ino()).ok() != before);
        verifies += 1;
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = writer.join().unwrap();
    eprintln!("{n} appends; rotations during a verify: {rotated_under_us}/{verifies}");
    assert!(rotated_under_us > 0, "the log rotated while verify ran");
}

/// A run refused before it starts — its manifest asks to write a system directory, which is
/// never granted — is audited `executor_refused` (a script, `script_refused`), naming the
/// executor, its package and why:
/// a check that said no is an event (it left no record before the twenty-first session).
#[test]
fn a_run_refused_before_it_starts_is_audited() {
    if !require_root() {
        return;
    }
    let log = Log::new("");
    let exec = executor();
    let manifest = exec.path.join("manifest.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    m["permissions"] = json!({"filesystem": {"write": ["/etc/opservant-test"]}});
    std::fs::write(&manifest, m.to_string()).unwrap();
    let out = opservant(&["run", exec.str(), "--config", log.conf()]);
    assert_eq!(out.code, 2, "{out:?}");
    let recs = log.records();
    let refused: Vec<&Value> = recs.iter().filter(|r| r["event"] == "executor_refused").collect();
    assert_eq!(refused.len(), 1, "{recs:?}");
    let f = &refused[0]["fields"];
    assert_eq!((f["executor"].as_str(), f["package"].as_str()), (Some("audit-test"), Some(exec.str())), "{f}");
    assert!(f["reason"].as_str().unwrap().contains("/etc"), "{f}");
    assert!(!recs.iter().any(|r| r["event"] == "executor_start"), "it never started: {recs:?}");
    // A script under the same manifest: `script_refused`.
    let dir = HostDir::new();
    let script = put(&dir.path, "s.py", "print(1)\n");
    let out = opservant(&[
        "script",
        "python",
        script.to_str().unwrap(),
        "--manifest",
        manifest.to_str().unwrap(),
        "--config",
        log.conf(),
    ]);
    assert_eq!(out.code, 2, "{out:?}");
    let recs = log.records();
    let refused: Vec<&Value> = recs.iter().filter(|r| r["event"] == "script_refused").collect();
    assert_eq!(refused.len(), 1, "{recs:?}");
    assert!(refused[0]["fields"]["reason"].as_str().unwrap().contains("/etc"), "{}", refused[0]);
    assert!(!recs.iter().any(|r| r["event"] == "script_start"), "it never started: {recs:?}");
    assert_eq!(log.verify(&[]).code, 0);
}

#[test]
fn an_unwritable_log_stops_the_run_before_it_starts() {
    if !require_root() {
        return;
    }
    let exec = executor();
    let cannot_run = |out: &Out, needle: &str| {
        assert_eq!(out.code, 2, "{out:?}");
        assert!(out.stdout.is_empty(), "no result: {out:?}");
        let last = out.stderr.lines().last().unwrap_or("");
        assert!(last.starts_with("opservant: ") && last.contains(needle), "{out:?}");
    };
    // The log's directory cannot be created (a file is in the way).
    let dir = HostDir::new();
    std::fs::write(dir.path.join("blocker"), "").unwrap();
    let conf = dir.path.join("config.yaml");
    std::fs::write(&conf, format!("audit:\n  path: {}/blocker/audit.jsonl\n", dir.str())).unwrap();
    let out = opservant(&["run", exec.str(), "--config", conf.to_str().unwrap()]);
    cannot_run(&out, "audit log");
    assert_eq!(out.stderr.lines().count(), 1, "{out:?}");

    // A log whose end is damaged beyond repair: the log opens, but executor_start cannot be
    // appended — the run stops at that gate (its sandbox is torn down; nothing of the
    // executor ran) and the same goes for a script.
    let log = Log::new("");
    log.run(&exec);
    let mut f = std::fs::OpenOptions::new().append(true).open(&log.path).unwrap();
    std::io::Write::write_all(&mut f, b"garbage\nmore garbage\n").unwrap();
    let before = std::fs::read(&log.path).unwrap();
    let out = opservant(&["run", exec.str(), "--config", log.conf()]);
    cannot_run(&out, "not audit records");
    assert!(!out.stderr.contains("executor_complete"), "{out:?}");
    let script = put(&log._dir.path, "s.py", "print(1)\n");
    cannot_run(&opservant(&["script", "python", script.to_str().unwrap(), "--config", log.conf()]), "audit log");
    assert_eq!(std::fs::read(&log.path).unwrap(), before, "nothing appended to a damaged log");
    assert_problem(&log.verify(&[]), &log.path, 3, "not_json");

    // The operator does what the error says and moves the damaged file aside: runs go on,
    // and the log says which records went with it — the next record is numbered after them
    // (none reused) and names the last one's hash — so `verify` reports them (exit 1) rather
    // than "intact", as it did before the twenty-fifth session.
    let last_written = sha256_hex(read_lines(&log.path)[1].as_bytes());
    std::fs::rename(&log.path, log.path.with_file_name("audit.jsonl.damaged")).unwrap();
    log.run(&exec);
    let records = log.records();
    let seqs: Vec<_> = records.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, [3, 4], "{records:?}");
    assert_eq!(records[0]["gap"], json!({"from": 1, "to": 2, "sha256": last_written}));
    let out = log.verify(&[]);
    assert_problem(&out, &log.path, 1, "removed (seq 3): seq 1..2 missing");
    assert!(out.stdout.contains("(a gap: NOT INTACT): 2 records"), "{}", out.stdout);
    let out = opservant(&["audit", "verify", "--json", "--config", log.conf()]);
    assert_eq!(out.code, 1, "{out:?}");
    let j: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!((&j["intact"], &j["problem"], &j["gaps"][0]["kind"]), (&json!(false), &Value::Null, &json!("removed")));
    let out = opservant(&["audit", "tail", "-n", "2", "--config", log.conf()]);
    let first = out.stdout.lines().next().unwrap_or_default();
    assert!(first.contains("#3  executor_start") && first.ends_with("[RECORDS MISSING before it: #1..#2]"), "{out:?}");
}

#[test]
fn a_record_that_cannot_be_written_whole_is_not_left_half_written() {
    if !require_root() {
        return;
    }
    // A short write (here a file-size limit, as a full disk or a quota would) fails the
    // run at its first record and leaves the log as it was: twice in a row, then the next
    // run appends to an intact chain. Before, the torn line stayed, its repair tore too,
    // and two lines no writer may guess at stopped every later append. The limit is met
    // with SIGXFSZ at its default (it kills): opservant ignores it itself, so that the write
    // fails with EFBIG and is cut back — before the twenty-first session this test ignored
    // it for opservant, and an agent under `LimitFSIZE=` died at the limit, a torn line left.
    let exec = executor();
    let log = Log::new("");
    log.run(&exec);
    let before = std::fs::read_to_string(&log.path).unwrap();
    for _ in 0..2 {
        let limit = before.len() + 40;
        let mut cmd = Command::new("prlimit");
        cmd.arg(format!("--fsize={limit}"))
            .arg("--")
            .arg(common::opservant())
            .args(["run", exec.str(), "--config", log.conf()])
            .env_remove("OPSERVANT_LOG")
            .stdin(Stdio::null());
        // SIGXFSZ at its default (it kills) whatever this test process inherited — a shell's
        // `trap -` cannot undo a disposition ignored when it started — so that only
        // opservant's own ignoring of it keeps it alive.
        // SAFETY: signal(2) with SIG_DFL and sigprocmask(2) are async-signal-safe; the set
        // is a local the calls only read.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::signal(libc::SIGXFSZ, libc::SIG_DFL);
                // Nor blocked (a blocked signal would let the test pass as an ignored one).
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGXFSZ);
                libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("audit log"), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(std::fs::read_to_string(&log.path).unwrap(), before, "the log was left as it was");
    }
    log.run(&exec);
    let v = log.verify(&[]);
    assert_eq!(v.code, 0, "{v:?}");
    assert!(v.stdout.starts_with("chain intact: 4 records"), "{}", v.stdout);
}

#[test]
fn the_logs_directory_must_be_the_agents_alone() {
    if !require_root() {
        return;
    }
    let exec = executor();
    let dir = HostDir::new();
    let logs = dir.path.join("logs");
    std::fs::create_dir(&logs).unwrap();
    let conf = dir.path.join("config.yaml");
    std::fs::write(&conf, format!("audit:\n  path: {}/audit.jsonl\n", logs.display())).unwrap();
    let conf = conf.to_str().unwrap();
    let refused = |out: &Out, needle: &str| {
        assert_eq!(out.code, 2, "{out:?}");
        assert!(out.stdout.is_empty(), "no result: {out:?}");
        assert!(out.stderr.contains(needle) && out.stderr.contains("audit"), "{out:?}");
        assert!(!logs.join("audit.jsonl").exists() && !logs.join("audit.jsonl.lock").exists(), "nothing created");
    };
    // Writable by others (sticky or not), by its group, or owned by another user: whoever
    // can write it could rename the log away and start a new chain. Refused before the log
    // or its lock is created, for runs and scripts alike.
    let script = put(&dir.path, "s.py", "print(1)\n");
    // The daemon's --check-config too (it checks what the agent would be refused at start).
    assert_eq!(opservant(&["keygen", "--out", dir.path.join("keys").to_str().unwrap()]).code, 0);
    let daemon_conf = dir.path.join("daemon.yaml");
    std::fs::write(
        &daemon_conf,
        format!(
            "agent:\n  platform_public_key: {}\n  state_dir: {}\naudit:\n  path: {}/audit.jsonl\n",
            dir.path.join("keys/signing.pub").display(),
            dir.path.join("state").display(),
            logs.display()
        ),
    )
    .unwrap();
    let check_config = || opservant(&["agent", "--check-config", "--config", daemon_conf.to_str().unwrap()]);
    for mode in [0o777, 0o1777, 0o775] {
        std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(mode)).unwrap();
        refused(&opservant(&["run", exec.str(), "--config", conf]), "writable by group or others");
        refused(&opservant(&["script", "python", script.to_str().unwrap(), "--config", conf]), "writable by group");
        refused(&check_config(), "writable by group");
    }
    std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&logs, Some(65534), None).unwrap();
    refused(&opservant(&["run", exec.str(), "--config", conf]), "owned by uid 65534");
    // The agent's own, group- and world-readable: the run goes ahead and is logged.
    std::os::unix::fs::chown(&logs, Some(0), None).unwrap();
    let out = check_config();
    assert_eq!(out.code, 0, "{out:?}");
    let out = opservant(&["run", exec.str(), "--config", conf]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(std::fs::read_to_string(logs.join("audit.jsonl")).unwrap().contains("executor_complete"));

    // The log file (and its lock) must be the agent's alone too: owned by it, writable by
    // no one else, one name. Each was appended to before the twenty-first session. The
    // log is left as it was by each refusal.
    let log_file = logs.join("audit.jsonl");
    let before = std::fs::read(&log_file).unwrap();
    let refused_file = |needle: &str| {
        let out = opservant(&["run", exec.str(), "--config", conf]);
        assert_eq!(out.code, 2, "{out:?}");
        assert!(out.stderr.contains(needle) && out.stderr.contains("audit.jsonl"), "{needle}: {out:?}");
        assert_eq!(std::fs::read(&log_file).unwrap(), before, "nothing appended");
    };
    std::fs::set_permissions(&log_file, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused_file("writable by group or others (mode 0666");
    std::fs::set_permissions(&log_file, std::fs::Permissions::from_mode(0o620)).unwrap();
    refused_file("writable by group or others");
    std::fs::set_permissions(&log_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&log_file, Some(65534), None).unwrap();
    refused_file("owned by uid 65534");
    std::os::unix::fs::chown(&log_file, Some(0), None).unwrap();
    let second_name = dir.path.join("copy-of-the-log");
    std::fs::hard_link(&log_file, &second_name).unwrap();
    refused_file("has 2 names");
    std::fs::remove_file(&second_name).unwrap();
    std::fs::set_permissions(logs.join("audit.jsonl.lock"), std::fs::Permissions::from_mode(0o646)).unwrap();
    refused_file("audit.jsonl.lock: writable by group or others");
    std::fs::set_permissions(logs.join("audit.jsonl.lock"), std::fs::Permissions::from_mode(0o600)).unwrap();
    // Readable by a group (a log shipper's): the operator's choice.
    std::fs::set_permissions(&log_file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = opservant(&["run", exec.str(), "--config", conf]);
    assert_eq!(out.code, 0, "{out:?}");

    // So must every directory above it be: whoever can write one could rename the log's
    // directory away and put one of their own in its place (a sticky one, `/tmp`, is fine).
    let above = dir.path.join("above");
    let nested = above.join("logs");
    std::fs::create_dir_all(&nested).unwrap();
    std::fs::set_permissions(&nested, std::fs::Permissions::from_mode(0o700)).unwrap();
    let nested_conf = dir.path.join("nested.yaml");
    std::fs::write(&nested_conf, format!("audit:\n  path: {}/audit.jsonl\n", nested.display())).unwrap();
    let run = || opservant(&["run", exec.str(), "--config", nested_conf.to_str().unwrap()]);
    let refused_above = |out: &Out, needle: &str| {
        assert_eq!(out.code, 2, "{out:?}");
        assert!(out.stderr.contains(needle) && out.stderr.contains(&format!("{} (above", above.display())), "{out:?}");
        assert!(!nested.join("audit.jsonl").exists(), "nothing created");
    };
    std::fs::set_permissions(&above, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused_above(&run(), "writable by others without the sticky bit");
    // A system group that may write it is an administrator's choice (Ubuntu's `/var/log` is
    // `root:syslog` 0775): accepted above the directory, never for the directory itself; a
    // group of ordinary users is not.
    std::fs::set_permissions(&above, std::fs::Permissions::from_mode(0o775)).unwrap();
    std::os::unix::fs::chown(&above, None, Some(4242)).unwrap();
    refused_above(&run(), "writable by its group, gid 4242, which is not a system group");
    std::os::unix::fs::chown(&above, None, Some(4)).unwrap();
    let out = run();
    assert_eq!(out.code, 0, "{out:?}");
    std::os::unix::fs::chown(&above, None, Some(0)).unwrap();
    for f in ["audit.jsonl", "audit.jsonl.lock"] {
        std::fs::remove_file(nested.join(f)).unwrap();
    }
    std::fs::set_permissions(&above, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&above, Some(65534), None).unwrap();
    refused_above(&run(), "owned by uid 65534");
    // Through a link, the directories on the resolved path count too.
    let link = dir.path.join("link");
    std::os::unix::fs::symlink(&nested, &link).unwrap();
    std::fs::write(&nested_conf, format!("audit:\n  path: {}/audit.jsonl\n", link.display())).unwrap();
    refused_above(&run(), "owned by uid 65534");
    // A link on the way owned by another user, who could point it elsewhere.
    std::os::unix::fs::chown(&above, Some(0), None).unwrap();
    std::os::unix::fs::lchown(&link, Some(65534), None).unwrap();
    let out = run();
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains(&format!("{} (a link on the way to", link.display())) && out.stderr.contains("uid 65534"),
        "{out:?}"
    );
    std::os::unix::fs::lchown(&link, Some(0), None).unwrap();
    std::fs::set_permissions(&above, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let out = run();
    assert_eq!(out.code, 0, "{out:?}");
    assert!(std::fs::read_to_string(nested.join("audit.jsonl")).unwrap().contains("executor_complete"));
    // A link part-way along a chain of links lies in another user's directory, which the
    // path as written and the path resolved both skip: whoever owns it can repoint the chain.
    let bob = dir.path.join("bob");
    std::fs::create_dir(&bob).unwrap();
    std::os::unix::fs::symlink(&nested, bob.join("l")).unwrap();
    std::os::unix::fs::chown(&bob, Some(65534), None).unwrap();
    let chain = dir.path.join("chain");
    std::os::unix::fs::symlink(bob.join("l"), &chain).unwrap();
    std::fs::write(&nested_conf, format!("audit:\n  path: {}/audit.jsonl\n", chain.display())).unwrap();
    let out = run();
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains(&format!("{} (above", bob.display())) && out.stderr.contains("uid 65534"), "{out:?}");
}

#[test]
fn a_held_lock_stops_the_run_after_the_configured_wait_and_names_its_holder() {
    if !require_root() {
        return;
    }
    let exec = executor();
    let log = Log::new("  lock_wait_seconds: 1\n");
    log.run(&exec);
    let before = log.lines();
    // Another writer holds the log's lock and never lets go (here: this test process).
    let lock = std::fs::File::open(format!("{}.lock", log.path.display())).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) }, 0);
    let out = opservant(&["run", exec.str(), "--config", log.conf()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stdout.is_empty(), "no result: {out:?}");
    let last = out.stderr.lines().last().unwrap_or("");
    let holder = format!("held by pid {}", std::process::id());
    assert!(last.contains(&holder) && last.contains("more than 1 s"), "{out:?}");
    assert_eq!(log.lines(), before, "nothing appended");
    // `audit verify` confirms a problem under a shared lock: bounded the same way.
    let intact = std::fs::read(&log.path).unwrap();
    let mut f = std::fs::OpenOptions::new().append(true).open(&log.path).unwrap();
    std::io::Write::write_all(&mut f, b"{\"torn").unwrap();
    let out = log.verify(&[]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains(&holder) && out.stderr.contains("could not be confirmed"), "{out:?}");
    std::fs::write(&log.path, intact).unwrap();
    // Released: runs append again, on the same chain.
    drop(lock);
    log.run(&exec);
    assert_eq!(log.lines().len(), before.len() + 2);
    assert_eq!(log.verify(&[]).code, 0);
}

#[test]
fn tail_shows_the_last_records_and_follows() {
    if !require_root() {
        return;
    }
    let (log, _exec) = log_with_runs(3);
    let lines = log.lines();
    let out = opservant(&["audit", "tail", "-n", "3", "--json", "--config", log.conf()]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.stdout.lines().collect::<Vec<_>>(), lines[3..].iter().map(String::as_str).collect::<Vec<_>>());
    let out = opservant(&["audit", "tail", "-n", "2", "--config", log.conf()]);
    let shown: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(shown.len(), 2, "{}", out.stdout);
    assert!(shown[0].contains("Z  #5  executor_start ") && shown[0].contains(" executor=audit-test"), "{}", out.stdout);
    assert!(shown[1].contains("#6  executor_complete"), "{}", out.stdout);
    // More than there are: all of them.
    let out = opservant(&["audit", "tail", "-n", "100", "--json", "--config", log.conf()]);
    assert_eq!(out.stdout.lines().count(), 6);

    // --follow prints records appended after it started.
    let mut child = common::command()
        .args(["audit", "tail", "-n", "1", "--follow", "--json", "--config", log.conf()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    assert_eq!(first.trim_end(), lines[5]);
    let appender = agent::audit::AuditLog::open(agent::audit::AuditSettings::at(&log.path)).unwrap();
    let a = appender.append("followed", &agent::audit::fields_object(&[("k", "v")])).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut next = String::new();
        let _ = reader.read_line(&mut next);
        let _ = tx.send(next);
    });
    let next = rx.recv_timeout(Duration::from_secs(10));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(next.expect("tail --follow printed the new record").trim_end(), a.line);
}

/// `audit tail` bounds what it holds as `verify` does: a current file larger than any the
/// agent writes is refused unread (exit 2, naming the bound) — before, it was read whole
/// into memory —, and under `--follow` a line that never gets its newline ends it with an
/// error once past the bound — before, it was held, growing, for ever.
#[test]
fn tail_refuses_what_no_agent_writes_instead_of_reading_it_whole() {
    let log = Log::new("");
    std::fs::create_dir_all(log.path.parent().unwrap()).unwrap();
    let f = std::fs::File::create(&log.path).unwrap();
    f.set_len(agent::audit::verify::MAX_FILE_BYTES + 1).unwrap(); // sparse
    drop(f);
    let out = opservant(&["audit", "tail", "-n", "1", "--config", log.conf()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert_eq!(out.stderr.lines().count(), 1, "{out:?}");
    let bound = agent::audit::verify::MAX_FILE_BYTES.to_string();
    assert!(out.stderr.contains(&format!("more than the {bound} bytes")), "{out:?}");

    std::fs::write(&log.path, vec![b'x'; 2 << 20]).unwrap();
    let mut child = common::command()
        .args(["audit", "tail", "-n", "1", "--follow", "--config", log.conf()])
        .env_remove("OPSERVANT_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "tail --follow held the line: {stderr}");
    assert!(stderr.contains("without its newline"), "{stderr}");
}

#[test]
fn verify_and_tail_report_a_full_stdout_instead_of_exiting_0() {
    if !require_root() {
        return;
    }
    let (log, _exec) = log_with_runs(1);
    let path = log.path.to_str().unwrap().to_string();
    for args in [
        vec!["audit", "verify", &path],
        vec!["audit", "verify", "--json", &path],
        vec!["audit", "tail", "--config", log.conf()],
        vec!["audit", "tail", "--json", "--config", log.conf()],
    ] {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let out = common::command().args(&args).stdin(Stdio::null()).stdout(full).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("stdout") && stderr.contains("No space left"), "{args:?}: {stderr}");
    }
}

/// Without `--config`, `OPSERVANT_CONFIG` names the configuration (it must exist);
/// `--config` wins over it.
#[test]
fn the_configuration_named_by_the_environment_is_read_without_config() {
    if !require_root() {
        return;
    }
    let exec = executor();
    let dir = HostDir::new();
    let [by_env, by_flag] = ["env", "flag"].map(|n| {
        let conf = dir.path.join(format!("{n}.yaml"));
        std::fs::write(&conf, format!("audit:\n  path: {}/{n}/audit.jsonl\n", dir.path.display())).unwrap();
        conf
    });
    let with_env = |conf: &Path, args: &[&str]| {
        let _view = common::host_view();
        common::command().args(args).env("OPSERVANT_CONFIG", conf).stdin(Stdio::null()).output().unwrap()
    };
    let out = with_env(&by_env, &["run", exec.str()]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read_to_string(dir.path.join("env/audit.jsonl")).unwrap().contains("executor_complete"));
    let out = with_env(&by_env, &["run", exec.str(), "--config", by_flag.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read_to_string(dir.path.join("flag/audit.jsonl")).unwrap().contains("executor_complete"));
    assert_eq!(
        std::fs::read_to_string(dir.path.join("env/audit.jsonl")).unwrap().matches("executor_complete").count(),
        1
    );
    // Named, it must exist: a typo is not the defaults.
    let missing = dir.path.join("missing.yaml");
    let out = with_env(&missing, &["run", exec.str()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(missing.to_str().unwrap()) && stderr.contains("No such file"), "{stderr}");
}
