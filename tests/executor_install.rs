//! `opservant executor install | list | remove` and `opservant run NAME`: the real binary,
//! as root, with the executors directory in a host scratch directory (never
//! /var/lib/opservant). Packages come as directories and as archives, including hostile
//! archives built here with Python's `tarfile` (a path escaping with `..`, an absolute path,
//! a symbolic link, a hard link, a device): each is refused as a whole and leaves nothing.
//! Package signatures (`executors.require_signature`): signed archives install; unsigned,
//! untrusted, tampered or garbled signatures and directories are refused, audited, and leave
//! nothing; a signature that is present is checked even when not required.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::HostDir;
use serde_json::Value;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

struct Env {
    dir: HostDir,
    root: PathBuf,
    config: PathBuf,
}

impl Env {
    fn new() -> Env {
        Env::with_executors("")
    }

    /// With more `executors:` keys (YAML, each line indented two spaces).
    fn with_executors(extra: &str) -> Env {
        let dir = HostDir::new();
        let root = dir.path.join("executors");
        Env::with_root(dir, root, extra)
    }

    /// With the executors root at `root` (below `dir` or not) and more `executors:` keys.
    fn with_root(dir: HostDir, root: PathBuf, extra: &str) -> Env {
        let config = dir.path.join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "executors:\n  dir: {}\n{extra}audit:\n  path: {}\n  journald: false\n",
                root.display(),
                dir.path.join("audit/audit.jsonl").display()
            ),
        )
        .unwrap();
        Env { dir, root, config }
    }

    fn audit_events(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.path.join("audit/audit.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn op(&self, args: &[&str]) -> Out {
        self.op_in(Path::new("/"), args)
    }

    /// [`Env::op`] in the working directory `cwd`.
    fn op_in(&self, cwd: &Path, args: &[&str]) -> Out {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--config", self.config.to_str().unwrap()]);
        let out = common::command().args(&all).current_dir(cwd).stdin(Stdio::null()).output().expect("spawn opservant");
        Out {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// The entries of the `hello` executor's directory (its versions, `current`), sorted.
    fn versions(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.root.join("hello"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Nothing but installed executors below the root: no staging or removal leftovers.
    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = match std::fs::read_dir(&self.root) {
            Ok(rd) => rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
            Err(_) => vec![],
        };
        v.sort();
        v
    }
}

const EXECUTOR_PY: &str = r#"from opservant.executor import BaseExecutor, ExecutorResult


class Hello(BaseExecutor):
    def validate(self, params):
        return True

    def execute(self, params, context):
        import time
        time.sleep(params.get("sleep", 0))
        out = {"version": VERSION}
        try:
            import tinydep
            out["dep"] = tinydep.VALUE
        except ImportError:
            pass
        return ExecutorResult(status="completed", output=out)
"#;

/// A package directory `hello` of `version`, optionally requiring `tinydep`.
fn package(parent: &Path, version: &str, requires: bool) -> PathBuf {
    let dir = parent.join(format!("hello-{version}"));
    std::fs::create_dir_all(dir.join("hello")).unwrap();
    std::fs::write(dir.join("hello/__init__.py"), "").unwrap();
    std::fs::write(dir.join("hello/main.py"), format!("VERSION = {version:?}\n{EXECUTOR_PY}")).unwrap();
    let packages = if requires { r#"["tinydep"]"# } else { "[]" };
    std::fs::write(
        dir.join("manifest.json"),
        format!(
            r#"{{"name": "hello", "version": "{version}", "description": "test", "author": "t",
                 "supported_actions": ["act-hello"], "entry_point": "hello.main.Hello",
                 "requirements": {{"packages": {packages}}}, "permissions": {{}}}}"#
        ),
    )
    .unwrap();
    dir
}

fn python(script: &str) {
    let st = Command::new("/usr/bin/python3").args(["-c", script]).status().expect("python3");
    assert!(st.success(), "python3 failed: {script}");
}

/// `tinydep-1.0-py3-none-any.whl` (a minimal pure-Python wheel) in `dir`.
fn wheel(dir: &Path) {
    wheel_of(dir, "tinydep", &[]);
}

/// `NAME-1.0-py3-none-any.whl`, a minimal pure-Python wheel whose module has `VALUE = 42`
/// and whose metadata lists `requires` (`Requires-Dist`), in `dir`.
fn wheel_of(dir: &Path, name: &str, requires: &[&str]) {
    std::fs::create_dir_all(dir).unwrap();
    let requires: String = requires.iter().map(|r| format!("Requires-Dist: {r}\\n")).collect();
    python(&format!(
        r#"
import zipfile
n = {name:?}
with zipfile.ZipFile({:?} + f"/{{n}}-1.0-py3-none-any.whl", "w") as z:
    z.writestr(f"{{n}}/__init__.py", "VALUE = 42\n")
    z.writestr(f"{{n}}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {{n}}\nVersion: 1.0\n{requires}")
    z.writestr(f"{{n}}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{{n}}-1.0.dist-info/RECORD", f"{{n}}/__init__.py,,\n{{n}}-1.0.dist-info/METADATA,,\n{{n}}-1.0.dist-info/WHEEL,,\n{{n}}-1.0.dist-info/RECORD,,\n")
"#,
        dir.to_str().unwrap()
    ));
}

fn run_output(env: &Env, name: &str) -> Value {
    let out = env.op(&["run", name]);
    assert_eq!(out.code, 0, "{} {}", out.stdout, out.stderr);
    let r: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    r["output"].clone()
}

#[test]
fn install_list_run_upgrade_and_remove() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let v1 = package(&env.dir.path, "1.0.0", false);
    let out = env.op(&["executor", "install", v1.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0");

    let out = env.op(&["executor", "list", "--json"]);
    let list: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(list[0]["name"], "hello");
    assert_eq!(list[0]["version"], "1.0.0");
    assert_eq!(env.op(&["executor", "list"]).stdout, "hello\t1.0.0\tact-hello\n");
    assert_eq!(list[0]["supported_actions"][0], "act-hello");

    // The same version again: refused unless forced.
    let out = env.op(&["executor", "install", v1.to_str().unwrap()]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("already installed"), "{}", out.stderr);
    assert_eq!(env.op(&["executor", "install", "--force", v1.to_str().unwrap()]).code, 0);
    // Forced twice: `1.0.0` itself is gone (two copies kept), and 1.0.0 is still installed.
    assert_eq!(env.op(&["executor", "install", "--force", v1.to_str().unwrap()]).code, 0);
    assert!(!env.root.join("hello/1.0.0").exists());
    let out = env.op(&["executor", "install", v1.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("already installed"), "{}", out.stderr);
    // A forced reinstall's directory never takes a name a later version could have.
    let rc = package(&env.dir.path, "1.0.1-rc", false);
    assert_eq!(env.op(&["executor", "install", rc.to_str().unwrap()]).code, 0);
    assert_eq!(env.op(&["executor", "install", "--force", rc.to_str().unwrap()]).code, 0);
    let rc1 = package(&env.dir.path, "1.0.1-rc.1", false);
    let out = env.op(&["executor", "install", rc1.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["version"], "1.0.1-rc.1");

    // Upgrades switch `current`; the previous version stays, older ones go.
    for v in ["1.1.0", "1.2.0"] {
        let p = package(&env.dir.path, v, false);
        assert_eq!(env.op(&["executor", "install", p.to_str().unwrap()]).code, 0);
        assert_eq!(run_output(&env, "hello")["version"], v);
    }
    assert_eq!(env.versions(), ["1.1.0", "1.2.0", "current"]);
    assert_eq!(std::fs::read_link(env.root.join("hello/current")).unwrap(), PathBuf::from("1.2.0"));

    // A bare name is the installed executor, even beside a directory of that name (one
    // planted where root runs the command), with a warning; `./hello` names the directory.
    let cwd = env.dir.path.join("cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let planted = package(&cwd, "9.9.9", false);
    std::fs::rename(&planted, cwd.join("hello")).unwrap();
    let run_in_cwd = |name: &str| {
        let out = common::command()
            .args(["run", name, "--config", env.config.to_str().unwrap()])
            .current_dir(&cwd)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        (r["output"]["version"].clone(), stderr.contains("not the directory hello here (`./hello` runs the directory)"))
    };
    // Not silently: the command warns that the directory here is not what runs.
    assert_eq!(run_in_cwd("hello"), ("1.2.0".into(), true));
    assert_eq!(run_in_cwd("./hello"), ("9.9.9".into(), false));

    assert_eq!(env.op(&["executor", "remove", "hello"]).code, 0);
    assert_eq!(env.entries(), Vec::<String>::new(), "nothing left after remove");
    assert_eq!(env.op(&["executor", "remove", "hello"]).code, 1);
    let out = env.op(&["run", "hello"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("not a directory, nor an executor installed"), "{}", out.stderr);
}

/// Installs and removals lock the executors root exclusively and wait for the lock: no
/// other user may be able to take it (it would stall them all), so the root is searchable,
/// not readable, by others — also one an older version made 0755. A root another user may
/// write to decides what runs, so installs, runs and lists refuse it.
#[test]
fn no_other_user_can_hold_the_executors_root_or_write_to_it() {
    if !common::require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let v1 = package(&env.dir.path, "1.0.0", false);
    let out = env.op(&["executor", "install", v1.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(mode(&env.root), 0o711);
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0", "the executor user still reaches the package");
    let hold = |path: &Path| {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "flock", "-n", "-x"])
            .arg(path)
            .arg("true")
            .output()
            .unwrap()
    };
    let held = hold(&env.root);
    assert!(!held.status.success(), "another user locked the executors root");
    assert!(String::from_utf8_lossy(&held.stderr).contains("Permission denied"), "{:?}", held);

    // A root left readable by an older version is tightened by the next install.
    std::fs::set_permissions(&env.root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let v2 = package(&env.dir.path, "1.1.0", false);
    let out = env.op(&["executor", "install", v2.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(mode(&env.root), 0o711);

    // Writable by others: nothing from it is installed, listed or run.
    std::fs::set_permissions(&env.root, std::fs::Permissions::from_mode(0o777)).unwrap();
    let v3 = package(&env.dir.path, "1.2.0", false);
    for args in [
        vec!["executor", "install", v3.to_str().unwrap()],
        vec!["executor", "list"],
        vec!["executor", "remove", "hello"],
        vec!["run", "hello"],
    ] {
        let out = env.op(&args);
        assert_eq!(out.code, 2, "{args:?}: {} {}", out.stdout, out.stderr);
        assert!(
            out.stderr.contains("executors.dir") && out.stderr.contains("writable by group or others"),
            "{args:?}: {}",
            out.stderr
        );
        // Refused before anything was written there (no staging directory was made).
        assert_eq!(env.entries(), vec!["hello".to_string()], "{args:?}");
    }
    std::fs::set_permissions(&env.root, std::fs::Permissions::from_mode(0o711)).unwrap();
    assert_eq!(std::fs::read_link(env.root.join("hello/current")).unwrap(), PathBuf::from("1.1.0"));
}

/// An install in another PID namespace names its staging directory with a pid that means
/// nothing here: the sweep of abandoned ones leaves a staging directory that someone holds
/// locked (every install holds its own), and removes it once it is free.
#[test]
fn a_locked_staging_directory_of_an_unknown_pid_is_not_swept() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let v1 = package(&env.dir.path, "1.0.0", false);
    assert_eq!(env.op(&["executor", "install", v1.to_str().unwrap()]).code, 0);
    // No such pid here (pid_max is at most 2^22).
    let foreign = env.root.join(".staging-99999999-0");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("unpacked"), "x").unwrap();
    // Older than the sweep's minute of grace: only the lock keeps it.
    let two_minutes_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(120);
    std::fs::File::open(&foreign).unwrap().set_modified(two_minutes_ago).unwrap();
    let held = nix::fcntl::Flock::lock(std::fs::File::open(&foreign).unwrap(), nix::fcntl::FlockArg::LockExclusive)
        .unwrap_or_else(|(_, e)| panic!("lock: {e}"));
    let v2 = package(&env.dir.path, "1.1.0", false);
    assert_eq!(env.op(&["executor", "install", v2.to_str().unwrap()]).code, 0);
    assert!(foreign.join("unpacked").exists(), "a staging directory in use was swept");
    drop(held);
    // A newly made one (an install between its `mkdir` and its lock) is left a minute too.
    let young = env.root.join(".staging-99999998-0");
    std::fs::create_dir(&young).unwrap();
    let v3 = package(&env.dir.path, "1.2.0", false);
    assert_eq!(env.op(&["executor", "install", v3.to_str().unwrap()]).code, 0);
    assert!(!foreign.exists(), "an abandoned staging directory was kept");
    assert!(young.exists(), "a staging directory made a moment ago was swept");
}

#[test]
fn an_old_version_a_run_still_uses_is_kept_until_a_later_install() {
    if !common::require_root() {
        return;
    }
    // Two versions are kept; the third install removes the oldest — but not while a run
    // that started on it is still going (its files would vanish under it).
    let env = Env::new();
    let install = |version: &str| {
        let p = package(&env.dir.path.join(version), version, false);
        let out = env.op(&["executor", "install", p.to_str().unwrap()]);
        assert_eq!(out.code, 0, "{version}: {}", out.stderr);
    };
    install("1.0.0");
    // A run of `hello` sleeping 10 s (the installs below take about a second each), returned
    // once it has loaded its executor (its start is audited: the `n`th `executor_start`
    // record).
    let start_run = |n: usize| {
        let run = common::command()
            .args(["run", "hello", "--params", r#"{"sleep": 10}"#, "--config", env.config.to_str().unwrap()])
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while env.audit_events().iter().filter(|e| e["event"] == "executor_start").count() < n {
            assert!(started.elapsed() < std::time::Duration::from_secs(60), "the run never started");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        run
    };
    let version_of = |run: std::process::Child| {
        let out = run.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let result: Value = serde_json::from_slice(&out.stdout).unwrap();
        result["output"]["version"].clone()
    };
    let run = start_run(1);
    install("1.1.0");
    install("1.2.0");
    let versions = || env.versions().into_iter().filter(|n| !n.starts_with('.')).collect::<Vec<_>>();
    let mut run = run;
    assert!(run.try_wait().unwrap().is_none(), "the run ended before the installs did: nothing was tested");
    assert_eq!(versions(), ["1.0.0", "1.1.0", "1.2.0", "current"], "the version in use was removed");
    assert_eq!(version_of(run), "1.0.0");
    // Once the run is over, the next install removes it.
    install("1.3.0");
    assert_eq!(versions(), ["1.2.0", "1.3.0", "current"]);

    // Removed while a run uses it: gone by name at once, its files kept until the run is
    // over and a later install or removal sweeps them.
    let run = start_run(2);
    let out = env.op(&["executor", "remove", "hello"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(env.op(&["run", "hello"]).code, 2);
    let leftovers = env.entries();
    let mut run = run;
    assert!(run.try_wait().unwrap().is_none(), "the run ended before the removal did: nothing was tested");
    assert!(leftovers.len() == 1 && leftovers[0].starts_with(".removing-"), "{leftovers:?}");
    assert_eq!(version_of(run), "1.3.0");
    install("1.4.0");
    assert_eq!(env.entries(), vec!["hello".to_string()]);
}

#[test]
fn concurrent_installs_of_one_executor_each_complete_and_leave_it_runnable() {
    if !common::require_root() {
        return;
    }
    // Two installs of new versions at once (two commands on the daemon's threads, or an
    // operator's beside one): each completes, `current` names one of them, and neither
    // removed the other's version under it.
    let env = Env::new();
    let base = package(&env.dir.path, "1.0.0", false);
    assert_eq!(env.op(&["executor", "install", base.to_str().unwrap()]).code, 0);
    for round in 0..6 {
        let versions = [format!("2.{round}.1"), format!("2.{round}.2")];
        let packages: Vec<PathBuf> = versions.iter().map(|v| package(&env.dir.path, v, false)).collect();
        let children: Vec<_> = packages
            .iter()
            .map(|p| {
                common::command()
                    .args(["executor", "install", p.to_str().unwrap(), "--config", env.config.to_str().unwrap()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "round {round}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let current = std::fs::read_link(env.root.join("hello/current")).unwrap();
        let current = current.to_string_lossy().into_owned();
        assert!(versions.contains(&current), "round {round}: current is {current}");
        assert!(env.root.join("hello").join(&current).is_dir(), "round {round}: {current} was removed");
        for v in &versions {
            assert!(env.root.join("hello").join(v).is_dir(), "round {round}: {v} was removed");
        }
    }
    let ran = run_output(&env, "hello")["version"].as_str().unwrap_or_default().to_string();
    assert!(ran.starts_with("2.5."), "{ran}");
}

/// Installing and removing change what can run: neither happens unless its record reaches
/// the audit log first (a damaged log — its last two lines not records — refuses appends).
/// Both audit records, the intent and the outcome, are there when the log works.
#[test]
fn installs_and_removals_are_refused_when_they_cannot_be_audited() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let v1 = package(&env.dir.path, "1.0.0", false);
    assert_eq!(env.op(&["executor", "install", v1.to_str().unwrap()]).code, 0);
    let events: Vec<String> = env.audit_events().iter().map(|e| e["event"].as_str().unwrap().to_string()).collect();
    assert!(events.ends_with(&["executor_install".into(), "executor_installed".into()]), "{events:?}");

    let log = env.dir.path.join("audit/audit.jsonl");
    let good = std::fs::read(&log).unwrap();
    let mut damaged = good.clone();
    damaged.extend_from_slice(b"garbage one\ngarbage two\n");
    std::fs::write(&log, &damaged).unwrap();
    let v2 = package(&env.dir.path, "2.0.0", false);
    let out = env.op(&["executor", "install", v2.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{} {}", out.stdout, out.stderr);
    assert!(out.stderr.contains("audit log") && out.stderr.contains("nothing was changed"), "{}", out.stderr);
    assert_eq!(std::fs::read_link(env.root.join("hello/current")).unwrap(), PathBuf::from("1.0.0"), "still the first");
    let out = env.op(&["executor", "remove", "hello"]);
    assert_eq!(out.code, 2, "{} {}", out.stdout, out.stderr);
    assert!(out.stderr.contains("audit log"), "{}", out.stderr);
    assert_eq!(env.entries(), vec!["hello".to_string()], "not removed");

    std::fs::write(&log, &good).unwrap();
    assert_eq!(env.op(&["executor", "remove", "hello"]).code, 0);
    let events: Vec<String> = env.audit_events().iter().map(|e| e["event"].as_str().unwrap().to_string()).collect();
    assert!(events.ends_with(&["executor_remove".into(), "executor_removed".into()]), "{events:?}");
}

#[test]
fn archives_install_and_hostile_archives_are_refused_whole() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let src = package(&env.dir.path, "2.0.0", false);
    let good = env.dir.path.join("hello.tar.gz");
    let st = Command::new("tar")
        .args(["czf", good.to_str().unwrap(), "-C", env.dir.path.to_str().unwrap(), "hello-2.0.0"])
        .status()
        .unwrap();
    assert!(st.success());
    let out = env.op(&["executor", "install", good.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["version"], "2.0.0");
    assert_eq!(env.op(&["executor", "remove", "hello"]).code, 0);
    // With a PAX global header, as `git archive` writes (the commit id): installed.
    let pax = env.dir.path.join("hello-pax.tar.gz");
    python(&format!(
        "import tarfile\nwith tarfile.open({:?}, 'w:gz', format=tarfile.PAX_FORMAT, pax_headers={{'comment': 'c0ffee'}}) as t: t.add({:?}, arcname='hello-2.0.0')",
        pax.to_str().unwrap(),
        src.to_str().unwrap()
    ));
    let out = env.op(&["executor", "install", pax.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(env.op(&["executor", "remove", "hello"]).code, 0);

    let base = env.dir.path.to_str().unwrap().to_string();
    let src = src.to_str().unwrap().to_string();
    for (name, member, needle) in [
        ("dotdot", "i = tarfile.TarInfo('hello/../../escape.py'); i.size = 1; t.addfile(i, io.BytesIO(b'x'))", "'..'"),
        ("absolute", "i = tarfile.TarInfo('/tmp/opservant-escape.py'); i.size = 1; t.addfile(i, io.BytesIO(b'x'))", "absolute"),
        ("symlink", "i = tarfile.TarInfo('hello/hello/shadow'); i.type = tarfile.SYMTYPE; i.linkname = '/etc/shadow'; t.addfile(i)", "symbolic link"),
        ("hardlink", "i = tarfile.TarInfo('hello/hello/hard'); i.type = tarfile.LNKTYPE; i.linkname = 'hello/manifest.json'; t.addfile(i)", "hard link"),
        ("device", "i = tarfile.TarInfo('hello/hello/null'); i.type = tarfile.CHRTYPE; i.devmajor = 1; i.devminor = 3; t.addfile(i)", "device"),
        ("fifo", "i = tarfile.TarInfo('hello/hello/fifo'); i.type = tarfile.FIFOTYPE; t.addfile(i)", "FIFO"),
        // Named by the entry, not as the staging directory's "File exists".
        ("twice", "i = tarfile.TarInfo('hello/manifest.json'); i.size = 2; t.addfile(i, io.BytesIO(b'{}'))", "hello/manifest.json: given twice"),
        ("beneath-a-file", "i = tarfile.TarInfo('hello/manifest.json/x'); i.size = 1; t.addfile(i, io.BytesIO(b'x'))", "beneath hello/manifest.json"),
    ] {
        let archive = format!("{base}/{name}.tar.gz");
        // A valid package plus one hostile member: the whole archive must be refused.
        python(&format!(
            "import tarfile, io\nwith tarfile.open({archive:?}, 'w:gz') as t:\n    t.add({src:?}, arcname='hello')\n    {member}\n"
        ));
        let out = env.op(&["executor", "install", &archive]);
        assert_eq!(out.code, 2, "{name}: {} {}", out.stdout, out.stderr);
        assert!(out.stderr.contains(needle), "{name}: {}", out.stderr);
        assert_eq!(env.entries(), Vec::<String>::new(), "{name}: nothing left behind");
    }
    assert!(!Path::new("/tmp/opservant-escape.py").exists());
    assert!(!env.dir.path.join("escape.py").exists());

    // Not an archive, a broken archive, an invalid manifest.
    std::fs::write(env.dir.path.join("junk.tar.gz"), b"not gzip").unwrap();
    let out = env.op(&["executor", "install", &format!("{base}/junk.tar.gz")]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(env.dir.path.join("cut.tar.gz"), &bytes[..bytes.len() / 2]).unwrap();
    let out = env.op(&["executor", "install", &format!("{base}/cut.tar.gz")]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("truncated or corrupt") && !out.stderr.contains(".staging"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new());
    let bad = package(&env.dir.path, "3.0.0", false);
    std::fs::write(bad.join("manifest.json"), r#"{"name": "Bad Name", "version": "x"}"#).unwrap();
    let out = env.op(&["executor", "install", bad.to_str().unwrap()]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("manifest.json"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new());

    // A failed install into a root that did not exist leaves no root behind either.
    let fresh = Env::new();
    assert!(!fresh.root.exists());
    let out = fresh.op(&["executor", "install", &format!("{base}/cut.tar.gz")]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(!fresh.root.exists(), "the failed install's root is removed");
}

/// Python that defines `pad`, `pax(records)` (a PAX header entry holding `records`, keys
/// repeated as given), `member(name, data)` (a ustar file entry) and `package(root)` (the
/// entries of the package directory `root` under `hello/`), for hand-made tar streams.
const TAR_PIECES_PY: &str = r#"
import io, os, tarfile
def pad(b):
    return b + bytes(-len(b) % 512)
def pax(records, kind=tarfile.XHDTYPE):
    body = b""
    for k, v in records:
        r = f" {k}={v}\n".encode()
        n = len(r)
        while len(str(n)) + len(r) != n:
            n = len(str(n)) + len(r)
        body += str(n).encode() + r
    i = tarfile.TarInfo("././@PaxHeader")
    i.type = kind
    i.size = len(body)
    return i.tobuf(tarfile.USTAR_FORMAT) + pad(body)
def member(name, data):
    i = tarfile.TarInfo(name)
    i.size = len(data)
    return i.tobuf(tarfile.USTAR_FORMAT) + pad(data)
def link(name, target, kind=tarfile.SYMTYPE):
    i = tarfile.TarInfo(name)
    i.type = kind
    i.linkname = target
    return i.tobuf(tarfile.USTAR_FORMAT)
def gnu_member(name, data):
    i = tarfile.TarInfo(name)
    i.size = len(data)
    return i.tobuf(tarfile.GNU_FORMAT) + pad(data)
def prefixed(header, prefix):
    b = bytearray(header)
    b[345:345 + len(prefix)] = prefix
    b[148:156] = b" " * 8
    b[148:156] = ("%06o\0 " % sum(b[:512])).encode()
    return bytes(b)
def versioned(header, version):
    b = bytearray(header)
    b[263:265] = version
    b[148:156] = b" " * 8
    b[148:156] = ("%06o\0 " % sum(b[:512])).encode()
    return bytes(b)
def patched(header, start, value):
    b = bytearray(header)
    b[start:start + len(value)] = value
    b[148:156] = b" " * 8
    b[148:156] = ("%06o\0 " % sum(b[:512])).encode()
    return bytes(b)
def package(root):
    out = b""
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            p = os.path.join(d, f)
            out += member("hello/" + os.path.relpath(p, root), open(p, "rb").read())
    return out
"#;

#[test]
fn an_archive_installs_as_tar_reads_it_or_not_at_all() {
    if !common::require_root() {
        return;
    }
    // What is installed must be what a reviewer's `tar` lists, or nothing.
    let env = Env::new();
    let src = package(&env.dir.path, "2.0.0", false);
    let src = src.to_str().unwrap();
    let base = env.dir.path.to_str().unwrap().to_string();

    // A gzip file of two members: `gzip -d` reads both, so `tar -tzf` lists the second's
    // entries too — installed with the rest.
    let multi = format!("{base}/multi.tar.gz");
    python(&format!(
        "{TAR_PIECES_PY}\nimport gzip\nbody = package({src:?})\nrest = member('hello/hello/second.py', b'SECOND = 1\\n') + bytes(1024)\nopen({multi:?}, 'wb').write(gzip.compress(body) + gzip.compress(rest))\n"
    ));
    let listed = Command::new("tar").args(["-tzf", &multi]).output().unwrap();
    assert!(String::from_utf8_lossy(&listed.stdout).contains("hello/hello/second.py"));
    let out = env.op(&["executor", "install", &multi]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(env.root.join("hello/current/hello/second.py").is_file(), "the second gzip member was not installed");
    assert_eq!(run_output(&env, "hello")["version"], "2.0.0");
    assert_eq!(env.op(&["executor", "remove", "hello"]).code, 0);

    // Names two tar readers read differently (GNU tar: the PAX path over a GNU long name,
    // the last of two PAX paths; a global header's path applies to every later entry), and
    // sourceless bytecode outside `__pycache__`: refused whole.
    let long = format!("hello/{}.py", "l".repeat(120));
    for (name, entries, needle) in [
        (
            "longname-and-pax",
            format!("tarfile.TarInfo._create_gnu_long_header({long:?}, tarfile.GNUTYPE_LONGNAME, 'utf-8', 'surrogateescape') + pax([('path', 'hello/hello/other.py')]) + member('hello/x.py', b'X = 1\\n')"),
            "named twice",
        ),
        ("two-pax-paths", "pax([('path', 'hello/a.py'), ('path', 'hello/b.py')]) + member('hello/x.py', b'X = 1\\n')".into(), "named twice"),
        ("global-path", "pax([('path', 'hello/g.py')], tarfile.XGLTYPE) + member('hello/x.py', b'X = 1\\n')".into(), "PAX global header setting `path`"),
        // The reader attaches a pending local header or long name to a global header; GNU
        // tar applies the global one's records and keeps the pending one for the next file.
        (
            "local-then-global",
            "pax([('comment', 'a')]) + pax([('path', 'hello/g.py')], tarfile.XGLTYPE) + member('hello/x.py', b'X = 1\\n')".into(),
            "a PAX global header after a local header",
        ),
        (
            "longname-then-global",
            "tarfile.TarInfo._create_gnu_long_header('hello/hello/main.py', tarfile.GNUTYPE_LONGNAME, 'utf-8', 'surrogateescape') + pax([('comment', 'x')], tarfile.XGLTYPE) + member('hello/hello/benign.py', b'X = 1\\n')".into(),
            "a PAX global header after a local header or a GNU long name",
        ),
        // A PAX `size` record frames the next entry differently for a reader of the raw
        // headers (the first pass, which bounds what is read into memory): refused, as is a
        // GNU sparse file, whose extension headers follow its own.
        ("pax-size", "pax([('size', '6')]) + member('hello/x.py', b'X = 1\\n')".into(), "a PAX `size` record is refused"),
        // A POSIX magic with another version: GNU tar and `tarfile` join the name prefix
        // (here `zz/`), the `tar` crate does not — it would install this as hello/hello/main.py.
        (
            "ustar-version",
            "versioned(member('zz/' + 'p' * 152 + '/../../hello/hello/main.py', b'EVIL = 1\\n'), b'\\0\\0')".into(),
            "a ustar header of version",
        ),
        // The same prefix bytes in a GNU header: `tarfile` joins them, GNU tar does not.
        ("gnu-prefix", "prefixed(gnu_member('hello/hello/z.py', b'Z = 1\\n'), b'zz')".into(), "a name prefix in a header outside the ustar format"),
        ("ustar-version-short", "versioned(member('hello/hello/y.py', b'Y = 1\\n'), b'\\0\\0')".into(), "a ustar header of version"),
        // A file named with a trailing `/`: a directory to GNU tar, a file to this reader.
        ("file-with-slash", "member('hello/hello/evil.py/', b'X = 1\\n')".into(), "a file entry whose name ends in '/'"),
        ("two-pax-sizes", "pax([('size', '6'), ('size', '0')]) + member('hello/x.py', b'X = 1\\n')".into(), "a PAX `size` record is refused"),
        ("gnu-sparse", "link('hello/sparse.py', '', tarfile.GNUTYPE_SPARSE)".into(), "a GNU sparse file is refused"),
        // A directory whose header claims a size: GNU tar skips no data after it, this
        // reader would skip the size — the next entry (here the hidden module) would be
        // data to one and a file to the other.
        (
            "dir-with-size",
            "patched(link('hello/docs/', '', tarfile.DIRTYPE), 124, b'00000001000\\0') + member('hello/hello/hidden.py', b'EVIL = 1\\n')".into(),
            "hello/docs/: an entry without data (a directory, a link, a device) whose header claims 512 bytes is refused",
        ),
        // A size GNU tar reads as its obsolete base-64 (`+…`), the tar crate as octal.
        (
            "plus-size",
            "patched(member('hello/hello/p.py', b'P = 1\\n'), 124, b'+0000000006\\0')".into(),
            "hello/hello/p.py: a size field that is not plain octal digits is refused",
        ),
        ("plus-mode", "patched(member('hello/hello/p.py', b'P = 1\\n'), 100, b'+000644\\0')".into(), "a mode field that is not plain octal digits"),
        // Deeper than any package needs: only there to exhaust (the directories it makes,
        // the recursive walks over the installed tree, a command thread's stack).
        ("deep", "member('hello/' + 'a/' * 64 + 'x.py', b'X = 1\\n')".into(), "more than 64 names deep"),
        // The directories a file's path implies count as entries: 400 files, 56 new
        // directories each, in a few hundred kilobytes.
        (
            "implied-directories",
            "b''.join(member(f'hello/d{i}/' + 'a/' * 55 + 'f.py', b'') for i in range(400))".into(),
            "the package has more than 20000 entries",
        ),
        ("gnu-sparse-name", "pax([('GNU.sparse.name', 'hello/hello/main.py')]) + member('hello/x.py', b'X = 1\\n')".into(), "a GNU sparse PAX record"),
        ("loose-pyc", "member('hello/hello/sneaky.pyc', b'\\0' * 16)".into(), "hello/hello/sneaky.pyc: compiled bytecode outside __pycache__"),
        // In a bytecode cache too, which is otherwise skipped (the agent compiles its own).
        ("cache-symlink", "link('hello/hello/__pycache__/main.cpython-311.pyc', '/etc/shadow')".into(), "__pycache__/main.cpython-311.pyc: a symbolic link is refused"),
        (
            "cache-fifo",
            "link('hello/__pycache__/x', '', tarfile.FIFOTYPE)".into(),
            "hello/__pycache__/x: a FIFO is refused",
        ),
        (
            "native-module",
            "member('hello/hello/main.cpython-311-x86_64-linux-gnu.so', b'\\x7fELF')".into(),
            "hello/hello/main.cpython-311-x86_64-linux-gnu.so: a native module in the package is refused",
        ),
    ] {
        let archive = format!("{base}/{name}.tar");
        python(&format!(
            "{TAR_PIECES_PY}\nopen({archive:?}, 'wb').write(package({src:?}) + {entries} + bytes(1024))\n"
        ));
        let out = env.op(&["executor", "install", &archive]);
        assert_eq!(out.code, 2, "{name}: {} {}", out.stdout, out.stderr);
        assert!(out.stderr.contains(needle), "{name}: {}", out.stderr);
        assert_eq!(env.entries(), Vec::<String>::new(), "{name}: nothing left behind");
    }

    // A gzip stream is read to its end: a wrong checksum, or bytes after it that are not
    // another member, are refused (`gzip -d`, and so `tar -xzf`, fails on both).
    for (name, tail, needle) in [
        (
            "bad-crc",
            "z = gzip.compress(body); z = z[:-8] + bytes(4) + z[-4:]",
            "not a valid gzip stream after the archive's end",
        ),
        (
            "trailing-garbage",
            "z = gzip.compress(body) + b'garbage after the stream'",
            "not a valid gzip stream after the archive's end",
        ),
    ] {
        let archive = format!("{base}/{name}.tar.gz");
        python(&format!(
            "{TAR_PIECES_PY}\nimport gzip\nbody = package({src:?}) + bytes(1024)\n{tail}\nopen({archive:?}, 'wb').write(z)\n"
        ));
        assert!(
            !Command::new("tar").args(["-tzf", &archive]).output().unwrap().status.success(),
            "{name}: tar reads it"
        );
        let out = env.op(&["executor", "install", &archive]);
        assert_eq!(out.code, 2, "{name}: {} {}", out.stdout, out.stderr);
        assert!(out.stderr.contains(needle), "{name}: {}", out.stderr);
        assert_eq!(env.entries(), Vec::<String>::new(), "{name}: nothing left behind");
    }

    // A package directory with sourceless bytecode: refused too (a cache in `__pycache__` is
    // left out, as always).
    let dir = package(&env.dir.path.join("d"), "2.1.0", false);
    std::fs::create_dir_all(dir.join("hello/__pycache__")).unwrap();
    std::fs::write(dir.join("hello/__pycache__/main.cpython-311.pyc"), b"\0").unwrap();
    let out = env.op(&["executor", "install", dir.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(env.op(&["executor", "remove", "hello"]).code, 0);
    std::fs::write(dir.join("hello/util.pyc"), b"\0").unwrap();
    let out = env.op(&["executor", "install", dir.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("util.pyc: compiled bytecode outside __pycache__"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new());
    // So is a native module, which `import hello.util` would load before `util.py`.
    std::fs::remove_file(dir.join("hello/util.pyc")).unwrap();
    std::fs::write(dir.join("hello/util.abi3.so"), b"\x7fELF").unwrap();
    let out = env.op(&["executor", "install", dir.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("util.abi3.so: a native module in the package is refused"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new());
}

#[test]
fn an_archive_header_cannot_make_the_agent_read_gigabytes_into_memory() {
    if !common::require_root() {
        return;
    }
    // Headers the tar reader reads into memory whole — a GNU long name, a PAX header —
    // claiming more than their limit: refused by the size they claim, before any of it is
    // read (without the check the reader held up to the stream's cap, ~320 MiB, as one
    // "name"). A file entry claiming 1 GiB of zeros (a ~1 MB gzip): the stream is cut at its
    // cap while the headers are checked, before anything is unpacked.
    let env = Env::new();
    let gib = 1u64 << 30;
    for (kind, name, claimed, written, needle) in [
        ("L", "././@LongLink", gib, 4 << 20, "a GNU long name of 1073741824 bytes is refused (at most 4096)"),
        ("L", "././@LongLink", 4097, 4097, "a GNU long name of 4097 bytes is refused (at most 4096)"),
        ("K", "././@LongLink", gib, 4 << 20, "a GNU long link of 1073741824 bytes is refused (at most 4096)"),
        ("x", "././@PaxHeader", gib, 4 << 20, "a PAX header of 1073741824 bytes is refused (at most 1048576)"),
        ("g", "pax_global_header", 2 << 20, 2 << 20, "a PAX header of 2097152 bytes is refused (at most 1048576)"),
        ("0", "hello/big.bin", gib, gib, "unpacks to more than"),
    ] {
        let archive = env.dir.path.join(format!("bomb-{kind}-{claimed}.tar.gz"));
        python(&format!(
            r#"
import gzip
h = bytearray(512)
h[0:{name_len}] = {name:?}.encode()
h[100:108] = b"0000644\0"; h[108:116] = b"0000000\0"; h[116:124] = b"0000000\0"
h[124:136] = ("%011o" % {claimed}).encode() + b"\0"
h[136:148] = b"00000000000\0"
h[156:157] = {kind:?}.encode()
h[257:263] = b"ustar "; h[263:265] = b" \0"
h[148:156] = b"        "
h[148:156] = ("%06o" % sum(h)).encode() + b"\0 "
with gzip.open({archive:?}, "wb", compresslevel=1) as g:
    g.write(bytes(h))
    left = {written}
    chunk = bytes(1 << 20)
    while left > 0:
        g.write(chunk[:min(left, len(chunk))])
        left -= len(chunk)
"#,
            name_len = name.len(),
            archive = archive.to_str().unwrap()
        ));
        let out = env.op(&["executor", "install", archive.to_str().unwrap()]);
        assert_eq!(out.code, 2, "{kind} {claimed}: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{kind} {claimed}: {}", out.stderr);
        assert!(out.stderr.contains(r#""reason":"too_large""#), "{kind} {claimed}: {}", out.stderr);
        assert_eq!(env.entries(), Vec::<String>::new(), "{kind} {claimed}: nothing left behind");
    }
}

/// What pip writes is bounded: a package's wheel of ~300 KB that expands to 300 MiB (a zip
/// bomb of zeros) is unpacked into pip's own size-limited tmpfs (512 MiB), not the host's
/// disk, and the install is refused `too_large` — before anything of it is copied into the
/// package (at most 256 MiB) — with nothing left behind. Before, pip unpacked it into the
/// staging directory on disk, whatever its size.
#[test]
fn a_wheel_that_expands_past_the_bound_is_refused() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let p = package(&env.dir.path, "1.0.0", true);
    let wheels = p.join("wheels");
    std::fs::create_dir_all(&wheels).unwrap();
    python(&format!(
        r#"
import zipfile
n = "tinydep"
with zipfile.ZipFile({:?} + f"/{{n}}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    z.writestr(f"{{n}}/__init__.py", "VALUE = 42\n")
    with z.open(f"{{n}}/zeros.bin", "w") as f:
        chunk = bytes(1 << 20)
        for _ in range(300):
            f.write(chunk)
    z.writestr(f"{{n}}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {{n}}\nVersion: 1.0\n")
    z.writestr(f"{{n}}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{{n}}-1.0.dist-info/RECORD", "")
"#,
        wheels.to_str().unwrap()
    ));
    assert!(std::fs::metadata(wheels.join("tinydep-1.0-py3-none-any.whl")).unwrap().len() < 1 << 20);
    let out = env.op(&["executor", "install", p.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("what pip installed for tinydep is more than 268435456 bytes or 20000 files"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains(r#""reason":"too_large""#), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new(), "nothing left behind");
    // The same package with an honest wheel installs, its requirement copied in from pip's tmpfs.
    std::fs::remove_dir_all(&wheels).unwrap();
    wheel(&wheels);
    let out = env.op(&["executor", "install", p.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["dep"], 42);
}

#[test]
fn requirements_come_from_wheels_only() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let p = package(&env.dir.path, "1.0.0", true);
    // No wheels anywhere: refused, with the remedy.
    let out = env.op(&["executor", "install", p.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("no wheels"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new());
    // With the wheel in the package's wheels/ directory.
    wheel(&p.join("wheels"));
    let out = env.op(&["executor", "install", p.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["dep"], 42);
    // From --find-links, for a package without its own wheels.
    let q = package(&env.dir.path.join("q"), "1.1.0", true);
    let links = env.dir.path.join("links");
    wheel(&links);
    let out = env.op(&["executor", "install", q.to_str().unwrap(), "--find-links", links.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["dep"], 42);
    // A requirement no wheel satisfies.
    let r = package(&env.dir.path.join("r"), "1.2.0", true);
    std::fs::write(
        r.join("manifest.json"),
        std::fs::read_to_string(r.join("manifest.json")).unwrap().replace("tinydep", "nosuchdep"),
    )
    .unwrap();
    let out = env.op(&["executor", "install", r.to_str().unwrap(), "--find-links", links.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("pip could not install nosuchdep"), "{}", out.stderr);
    // A URL or a path is not a requirement: refused before pip runs, naming the entry.
    for req in ["tinydep @ file:///etc", "./wheels/tinydep-1.0-py3-none-any.whl"] {
        let u = package(&env.dir.path.join("u"), "1.3.0", true);
        let text =
            std::fs::read_to_string(u.join("manifest.json")).unwrap().replace("\"tinydep\"", &format!("{req:?}"));
        std::fs::write(u.join("manifest.json"), text).unwrap();
        let out = env.op(&["executor", "install", u.to_str().unwrap(), "--find-links", links.to_str().unwrap()]);
        assert_eq!(out.code, 2, "{req}: {}", out.stderr);
        assert!(out.stderr.contains("requirements.packages[0]"), "{req}: {}", out.stderr);
        std::fs::remove_dir_all(u).unwrap();
    }
}

#[test]
fn pip_is_offered_only_the_wheels_in_the_package() {
    if !common::require_root() {
        return;
    }
    // pip reads a `--find-links` directory as an index: an HTML page in the package's
    // `wheels/` could point it (root) at a wheel anywhere on the host or the network, which
    // the package's signature does not cover.
    let env = Env::new();
    let elsewhere = env.dir.path.join("elsewhere");
    wheel(&elsewhere);
    let page = format!(
        r#"<html><body><a href="file://{0}/tinydep-1.0-py3-none-any.whl">tinydep-1.0-py3-none-any.whl</a></body></html>"#,
        elsewhere.display()
    );
    let p = package(&env.dir.path, "1.0.0", true);
    std::fs::create_dir_all(p.join("wheels/sub")).unwrap();
    std::fs::write(p.join("wheels/index.html"), &page).unwrap();
    std::fs::write(p.join("wheels/sub/index.html"), &page).unwrap();
    let out = env.op(&["executor", "install", p.to_str().unwrap()]);
    assert_eq!(out.code, 2, "a wheel outside the package was installed: {}", out.stderr);
    assert!(out.stderr.contains("no wheels"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new());
    // With the wheel itself in `wheels/`, the page is left out and named in a warning.
    wheel(&p.join("wheels"));
    let out = env.op(&["executor", "install", "--json", p.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let report: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let warnings = report["warnings"].to_string();
    assert!(warnings.contains("wheels/index.html: not a wheel, not offered to pip"), "{warnings}");
    assert!(warnings.contains("wheels/sub: not a wheel"), "{warnings}");
    assert_eq!(run_output(&env, "hello")["dep"], 42);
    assert_eq!(env.entries(), vec!["hello".to_string()]);
}

#[test]
fn a_wheels_dependencies_are_never_resolved_by_pip() {
    if !common::require_root() {
        return;
    }
    // pip 23 fetches and prepares a wheel's direct-reference dependency (`boom @ file:///…`)
    // whatever `--only-binary` says — running its build backend, the package's code, as
    // root. Dependencies are not resolved: every distribution must be listed, and the
    // installed wheels' metadata is checked.
    let env = Env::new();
    let pwned = env.dir.path.join("pwned");
    let boom = env.dir.path.join("boom");
    std::fs::create_dir_all(boom.join("boombackend")).unwrap();
    std::fs::write(
        boom.join("pyproject.toml"),
        "[build-system]\nrequires = []\nbuild-backend = \"boombackend\"\nbackend-path = [\".\"]\n",
    )
    .unwrap();
    std::fs::write(
        boom.join("boombackend/__init__.py"),
        format!(
            "open({:?}, 'w').write('built')\ndef get_requires_for_build_wheel(config_settings=None):\n    return []\n",
            pwned.to_str().unwrap()
        ),
    )
    .unwrap();
    let install = |requires: &[&str], wheels: &[(&str, &[&str])]| {
        let p = package(&env.dir.path.join("p"), "1.0.0", true);
        let list = serde_json::to_string(requires).unwrap();
        let text = std::fs::read_to_string(p.join("manifest.json")).unwrap().replace(r#"["tinydep"]"#, &list);
        std::fs::write(p.join("manifest.json"), text).unwrap();
        for (name, deps) in wheels {
            wheel_of(&p.join("wheels"), name, deps);
        }
        let out = env.op(&["executor", "install", p.to_str().unwrap(), "--force"]);
        std::fs::remove_dir_all(env.dir.path.join("p")).unwrap();
        out
    };
    let direct = format!("boom @ file://{}", boom.display());
    let out = install(&["tinyurl"], &[("tinyurl", &[direct.as_str()])]);
    assert!(!pwned.exists(), "the dependency's build backend ran as root");
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("requires boom by a direct reference"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new());

    // A dependency that is not listed, or listed at another version: refused, named.
    let out = install(&["tinyuses"], &[("tinyuses", &["tinydep>=1.0"]), ("tinydep", &[])]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("tinyuses 1.0 requires tinydep>=1.0, which is not in requirements.packages"),
        "{}",
        out.stderr
    );
    let out = install(&["tinyuses", "tinydep"], &[("tinyuses", &["tinydep>=2"]), ("tinydep", &[])]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("requires tinydep>=2, but requirements.packages installs 1.0"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new());

    // An extra's dependencies are followed however the extra is spelled.
    let out = install(
        &["tinyuses[Foo_Bar]", "tinydep"],
        &[("tinyuses", &["tinydep>=1.0", "tinyextra; extra == 'foo-bar'"]), ("tinydep", &[])],
    );
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("tinyuses 1.0 requires tinyextra, which is not in requirements.packages"),
        "{}",
        out.stderr
    );
    // Listed whole (a dependency for another interpreter or an extra not asked for is not
    // needed): installed.
    let out = install(
        &["tinyuses", "tinydep"],
        &[("tinyuses", &["tinydep>=1.0", "absent; python_version < '3'", "other; extra == 'x'"]), ("tinydep", &[])],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["dep"], 42);
    assert!(!pwned.exists());
}

#[test]
fn an_executors_dir_reached_through_a_link_and_relative_find_links_work() {
    if !common::require_root() {
        return;
    }
    // `executors.dir` below a symbolic link (state moved to another disk): installed
    // executors were installed but never found (`run`, `list`), as their real path did not
    // begin with the configured one.
    let dir = HostDir::new();
    std::fs::create_dir(dir.path.join("disk")).unwrap();
    std::os::unix::fs::symlink(dir.path.join("disk"), dir.path.join("state")).unwrap();
    let root = dir.path.join("state/executors");
    let env = Env::with_root(dir, root, "");
    let p = package(&env.dir.path, "1.0.0", true);
    wheel(&env.dir.path.join("links"));
    // A relative `--find-links`, from where the operator is (pip runs in `/`).
    let out = env.op_in(&env.dir.path, &["executor", "install", p.to_str().unwrap(), "--find-links", "links"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["dep"], 42);
    let out = env.op(&["executor", "list", "--json"]);
    let list: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(list[0]["name"], "hello", "{list}");
    // One that is not a directory: named, exit 2, before anything.
    let out = env.op_in(&env.dir.path, &["executor", "install", p.to_str().unwrap(), "--find-links", "nowhere"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("--find-links nowhere: not a directory"), "{}", out.stderr);
    // Nor is an --index-url that is not a URL pip could use, though this package has no
    // requirements to install with it.
    let plain = package(&env.dir.path.join("plain"), "3.0.0", false);
    for url in ["ftp://x y", "index.example", "https://", "https://a\tb"] {
        let out = env.op(&["executor", "install", plain.to_str().unwrap(), "--index-url", url]);
        assert_eq!(out.code, 2, "{url}: {}", out.stderr);
        assert!(out.stderr.contains("--index-url") && out.stderr.contains("not an https://"), "{url}: {}", out.stderr);
    }
    assert!(!env.root.join("hello/3.0.0").exists());
}

#[test]
fn what_an_interrupted_install_left_behind_is_removed_by_the_next() {
    if !common::require_root() {
        return;
    }
    // An install killed part-way (SIGKILL, a power cut) leaves its staging directory — or a
    // removal its renamed executor — behind; the next install or removal removes those of
    // processes that are gone, and never a staging directory of a live process (a removal's
    // is emptied whatever its process, but for the versions runs hold: see
    // `an_old_version_a_run_still_uses_is_kept_until_a_later_install`).
    let env = Env::new();
    let v1 = package(&env.dir.path, "1.0.0", false);
    assert_eq!(env.op(&["executor", "install", v1.to_str().unwrap()]).code, 0);
    let mut dead = Command::new("true").spawn().unwrap();
    dead.wait().unwrap();
    let mut live = Command::new("sleep").arg("60").spawn().unwrap();
    let stale: Vec<PathBuf> =
        [".staging", ".download", ".removing"].iter().map(|p| env.root.join(format!("{p}-{}-0", dead.id()))).collect();
    // Left more than a minute ago (a staging directory changed within the last minute is
    // spared: see `a_locked_staging_directory_of_an_unknown_pid_is_not_swept`).
    let two_minutes_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(120);
    for d in &stale {
        std::fs::create_dir_all(d.join("pkg/hello")).unwrap();
        std::fs::write(d.join("pkg/hello/main.py"), "x").unwrap();
        std::fs::File::open(d).unwrap().set_modified(two_minutes_ago).unwrap();
    }
    let kept = env.root.join(format!(".staging-{}-0", live.id()));
    std::fs::create_dir(&kept).unwrap();
    std::fs::File::open(&kept).unwrap().set_modified(two_minutes_ago).unwrap();
    let v2 = package(&env.dir.path, "1.1.0", false);
    let out = env.op(&["executor", "install", v2.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    for d in &stale {
        assert!(!d.exists(), "{} left", d.display());
    }
    assert!(kept.exists(), "a live process's staging directory was removed");
    live.kill().unwrap();
    live.wait().unwrap();
    std::fs::remove_dir(&kept).unwrap();
    assert_eq!(env.entries(), vec!["hello".to_string()]);
}

/// The package `pkg` under the executor name `name`.
fn renamed(pkg: PathBuf, name: &str) -> PathBuf {
    let manifest = pkg.join("manifest.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    m["name"] = name.into();
    std::fs::write(&manifest, m.to_string()).unwrap();
    pkg
}

#[test]
fn an_install_cut_short_between_its_copy_and_its_switch_is_completed_by_the_next() {
    if !common::require_root() {
        return;
    }
    // An install killed (SIGKILL, a power cut, the daemon's unit stopped hard) after moving
    // its new version into place and before switching `current` to it. Without a record of
    // the switch in progress, the copy could not be told from the previous version every
    // install keeps: a first install cut short there left an executor that never ran (the
    // next install of it was "already installed"). The next holder of the root lock
    // completes it.
    let env = Env::new();
    let config = env.config.to_str().unwrap();
    let marker = env.root.join(".switch-hello");
    let current = || std::fs::read_link(env.root.join("hello/current")).ok();
    let v1 = package(&env.dir.path, "1.0.0", false);
    let install = ["executor", "install", v1.to_str().unwrap(), "--config", config];
    if common::install_killed_at_its_switch(&install).is_none() {
        return;
    }
    let named: Value = serde_json::from_str(&std::fs::read_to_string(&marker).unwrap()).unwrap();
    assert_eq!(
        (&named["to"], &named["from"], &named["version"], &named["source"]),
        (&Value::from("1.0.0"), &Value::Null, &Value::from("1.0.0"), &Value::from("cli")),
        "{named}"
    );
    assert!(env.root.join("hello/1.0.0/manifest.json").is_file());
    assert_eq!(current(), None);
    let out = env.op(&["run", "hello"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("nor an executor installed"), "{}", out.stderr);

    // The next install, of another executor, completes it first, audited.
    let other = renamed(package(&env.dir.path.join("other"), "3.0.0", false), "other");
    let out = env.op(&["executor", "install", other.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(current(), Some(PathBuf::from("1.0.0")));
    assert!(!marker.exists());
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0");
    let events = env.audit_events();
    let at = |pred: &dyn Fn(&Value) -> bool| events.iter().position(pred);
    let completed = at(&|e| {
        e["event"] == "executor_installed"
            && e["fields"]["source"] == "recovery"
            && e["fields"]["executor"] == "hello"
            && e["fields"]["version"] == "1.0.0"
    })
    .expect("the completion is audited");
    let began = at(&|e| e["event"] == "executor_install" && e["fields"]["executor"] == "other").unwrap();
    assert!(completed < began, "completed after the next install began");

    // An upgrade cut short the same way: the old version runs until the next lock holder (a
    // removal here) completes the switch — also from a `current` an operator pointed by an
    // absolute link (compared as written).
    let absolute = env.root.join("hello/1.0.0");
    std::fs::remove_file(env.root.join("hello/current")).unwrap();
    std::os::unix::fs::symlink(&absolute, env.root.join("hello/current")).unwrap();
    let v2 = package(&env.dir.path, "2.0.0", false);
    let install = ["executor", "install", v2.to_str().unwrap(), "--config", config];
    common::install_killed_at_its_switch(&install).unwrap();
    assert_eq!(current(), Some(absolute.clone()));
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0");
    assert_eq!(env.op(&["executor", "remove", "other"]).code, 0);
    assert_eq!(run_output(&env, "hello")["version"], "2.0.0");
    assert!(!marker.exists());
    // The version before, named by that absolute link, is kept by the next install.
    let v3 = package(&env.dir.path, "3.0.0", false);
    std::fs::remove_file(env.root.join("hello/current")).unwrap();
    std::os::unix::fs::symlink(env.root.join("hello/2.0.0"), env.root.join("hello/current")).unwrap();
    assert_eq!(env.op(&["executor", "install", v3.to_str().unwrap()]).code, 0);
    assert!(env.root.join("hello/2.0.0").is_dir(), "the previous version was removed");
    assert!(!env.root.join("hello/1.0.0").exists());
    assert_eq!(current(), Some(PathBuf::from("3.0.0")));

    // Markers that switch nothing and go: one naming a version never moved into place (the
    // install was cut short before its copy was); one written part-way; one of an install
    // that began from another `current` than today's (switched since, by hand or by an agent
    // that knows no markers) — although the version it names, 2.0.0, is there; one naming a
    // version whose manifest no longer loads, from today's `current`.
    std::fs::create_dir_all(env.root.join("hello/4.0.0")).unwrap();
    std::fs::write(env.root.join("hello/4.0.0/manifest.json"), "{").unwrap();
    for text in [
        r#"{"to": "9.9.9", "from": "3.0.0"}"#,
        r#"{"to": "1.0"#,
        r#"{"to": "2.0.0", "from": "2.5.0"}"#,
        r#"{"to": "4.0.0", "from": "3.0.0"}"#,
    ] {
        std::fs::write(&marker, text).unwrap();
        assert_eq!(env.op(&["executor", "install", "--force", other.to_str().unwrap()]).code, 0, "{text}");
        assert_eq!(current(), Some(PathBuf::from("3.0.0")), "{text}");
        assert!(!marker.exists(), "{text}");
    }
    assert!(env.root.join("hello/2.0.0").is_dir());
    // A marker for no executor name (none is ever written) goes too.
    let stray = env.root.join(".switch-Not_A_Name");
    std::fs::write(&stray, r#"{"to": "1.0.0", "from": null}"#).unwrap();
    assert_eq!(env.op(&["executor", "install", "--force", other.to_str().unwrap()]).code, 0);
    assert!(!stray.exists());
    let recovered = |event: &str| {
        env.audit_events().iter().filter(|e| e["event"] == event && e["fields"]["source"] == "recovery").count()
    };
    assert_eq!(recovered("executor_installed"), 2, "only the two cut-short installs were completed");
    // The three readable markers that were not completed end their installs in the log.
    assert_eq!(recovered("executor_install_failed"), 3);
}

#[test]
fn an_install_whose_switch_fails_leaves_nothing_and_the_version_before() {
    if !common::require_root() {
        return;
    }
    // The link that switches `current` cannot be made (`strace` fails it with EIO): the
    // install exits 2, its new version goes back into staging and with it, the marker goes,
    // and the version before still runs — nothing for a later lock holder to complete.
    let env = Env::new();
    let v1 = package(&env.dir.path, "1.0.0", false);
    assert_eq!(env.op(&["executor", "install", v1.to_str().unwrap()]).code, 0);
    let v2 = package(&env.dir.path, "2.0.0", false);
    let Some(out) = common::install_whose_switch_fails(&[
        "executor",
        "install",
        v2.to_str().unwrap(),
        "--config",
        env.config.to_str().unwrap(),
    ]) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("Input/output error"), "{stderr}");
    assert_eq!(env.entries(), vec!["hello".to_string()], "no marker, staging or version left");
    assert_eq!(env.versions(), ["1.0.0", "current"]);
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0");
    // And the next install finds nothing to complete: 2.0.0 installs as usual.
    assert_eq!(env.op(&["executor", "install", v2.to_str().unwrap()]).code, 0);
    assert_eq!(run_output(&env, "hello")["version"], "2.0.0");
    assert!(env.audit_events().iter().all(|e| e["fields"]["source"] != "recovery"));
}

#[test]
fn on_a_kernel_before_5_8_an_install_fsyncs_each_file_and_fails_on_an_fsync_error() {
    if !common::require_root() {
        return;
    }
    // Before Linux 5.8 `syncfs` did not report write-back errors, so an install there
    // `fsync`s every file and directory of the package, and the directories of the switch,
    // instead. `setarch --uname-2.6` makes `uname` report such a release; `strace` shows the
    // calls and fails them.
    let env = Env::new();
    let [v1, v2, v3] = ["1.0.0", "2.0.0", "3.0.0"].map(|v| package(&env.dir.path, v, false).display().to_string());
    let install = |pkg| ["executor", "install", pkg, "--config", env.config.to_str().unwrap()];
    let trace = env.dir.path.join("install.strace");
    let watch = ["-y", "-o", trace.to_str().unwrap(), "-e", "trace=syncfs,fsync"];
    let traced = || std::fs::read_to_string(&trace).unwrap();
    // On this kernel: one `syncfs`, no file's `fsync`.
    let Some(out) = common::under_strace(&[], &watch, &install(&v1)) else {
        return;
    };
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(traced().contains("syncfs("), "{}", traced());
    assert!(!traced().contains("/hello/main.py>"), "{}", traced());
    // As on 2.6: no `syncfs`; an `fsync` of each file and directory of the package (in
    // staging), then of the name's directory and the root after the switch.
    let Some(out) = common::on_linux_2_6_under_strace(&watch, &install(&v2)) else {
        return;
    };
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let calls = traced();
    assert!(!calls.contains("syncfs("), "{calls}");
    let installed = env.root.join("hello/2.0.0");
    let mut walked = 0;
    let mut stack = vec![installed.clone()];
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().flatten().map(|e| e.path()));
        }
        let rel = p.strip_prefix(&installed).unwrap().to_str().unwrap().to_string();
        let staged = if rel.is_empty() { "/pkg>) = 0".to_string() } else { format!("/pkg/{rel}>) = 0") };
        assert!(calls.lines().any(|l| l.contains("fsync(") && l.contains(&staged)), "no fsync of {rel:?}:\n{calls}");
        walked += 1;
    }
    assert!(walked >= 5, "the package holds {walked} entries: {calls}");
    for dir in [env.root.join("hello"), env.root.clone()] {
        let after = format!("<{}>) = 0", dir.display());
        assert!(
            calls.lines().any(|l| l.starts_with("fsync(") && l.contains(&after)),
            "no fsync of {}:\n{calls}",
            dir.display()
        );
    }
    assert_eq!(run_output(&env, "hello")["version"], "2.0.0");
    // An `fsync` of the package fails: exit 2, the file named, nothing switched or left.
    let fail = |only: &[&str]| {
        let mut args = vec!["-o", "/dev/null", "-e", "trace=fsync", "-e", "inject=fsync:error=EIO"];
        args.extend_from_slice(only);
        common::on_linux_2_6_under_strace(&args, &install(&v3)).unwrap()
    };
    let out = fail(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("the executors' filesystem reported a write error (fsync ")
            && stderr.contains("/pkg/")
            && stderr.contains("Input/output error")
            && stderr.contains("hello 3.0.0 is not on the disk; nothing was switched"),
        "{stderr}"
    );
    assert_eq!(env.entries(), vec!["hello".to_string()], "no marker or staging left");
    assert_eq!(env.versions(), ["1.0.0", "2.0.0", "current"]);
    assert_eq!(run_output(&env, "hello")["version"], "2.0.0");
    // The `fsync` of the name's directory after the switch fails: exit 2, saying `current`
    // names 3.0.0 now but may not after a restart.
    let name_dir = env.root.join("hello");
    let out = fail(&["-P", name_dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("(fsync {}: Input/output error", name_dir.display()))
            && stderr.contains("hello's `current` names 3.0.0 now but may not after a restart"),
        "{stderr}"
    );
    assert_eq!(run_output(&env, "hello")["version"], "3.0.0");
}

#[test]
fn an_executors_root_out_of_the_sandbox_users_reach_is_warned_of_and_its_runs_cannot_run() {
    if !common::require_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    // The executors' root below a directory only root may search (as below /root): each
    // install and `--check-config` warn, and a run exits 2 saying which path and why.
    let dir = HostDir::new();
    let private = dir.path.join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let env = Env::with_root(dir, private.join("executors"), "");
    let keys = env.dir.path.join("keys");
    let (_, public) = keygen(&keys);
    let mut config = std::fs::read_to_string(&env.config).unwrap();
    config.push_str(&format!("agent:\n  platform_public_key: {public}\n"));
    std::fs::write(&env.config, config).unwrap();
    let v1 = package(&env.dir.path, "1.0.0", false);
    let out = env.op(&["executor", "install", v1.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let warned = format!("{} (mode 0700) is not searchable by the sandboxes' user", private.display());
    assert!(out.stderr.contains(&warned), "{}", out.stderr);
    let out = env.op(&["agent", "--check-config"]);
    assert!(out.stderr.contains(&warned), "{}", out.stderr);
    let out = env.op(&["run", "hello"]);
    assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{}", out.stderr);
    assert!(
        out.stderr.contains("sandbox setup failed at mounts") && out.stderr.contains("searchable"),
        "{}",
        out.stderr
    );
    // Searchable by all, no warning, and it runs.
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o711)).unwrap();
    let out = env.op(&["agent", "--check-config"]);
    assert!(!out.stderr.contains("not searchable"), "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0");
}

#[test]
fn a_package_holding_the_executors_directory_is_refused() {
    if !common::require_root() {
        return;
    }
    // The directory holding the executors root, or the root itself, given as a package:
    // refused at once (it was copied into its own staging directory until the names grew
    // too long), one line naming the package once, nothing left.
    let env = Env::new();
    let v1 = package(&env.dir.path, "1.0.0", false);
    assert_eq!(env.op(&["executor", "install", v1.to_str().unwrap()]).code, 0);
    for pkg in [env.dir.path.clone(), env.root.clone()] {
        let out = env.op(&["executor", "install", pkg.to_str().unwrap(), "--force"]);
        assert_eq!(out.code, 2, "{}", out.stderr);
        let line = format!("opservant: {}: it holds the executors directory {}", pkg.display(), env.root.display());
        assert!(out.stderr.lines().any(|l| l.starts_with(&line)), "{}", out.stderr);
        assert_eq!(env.entries(), vec!["hello".to_string()]);
        assert_eq!(env.versions(), ["1.0.0", "current"]);
    }
    // A first install, the root not there yet (inside the package): refused too, and the
    // root it made for the install removed again.
    let dir = HostDir::new();
    let pkg = package(&dir.path, "1.0.0", false);
    let first = Env::with_root(dir, pkg.join("executors"), "");
    let out = first.op(&["executor", "install", pkg.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("it holds the executors directory"), "{}", out.stderr);
    assert!(!first.root.exists(), "the root made for the refused install is left");
}

#[test]
fn pip_reads_no_configuration_of_the_package() {
    if !common::require_root() {
        return;
    }
    // pip runs as root: a package's own pip configuration (found through HOME when HOME was
    // the package) could have it write a log or report anywhere, or read any file into its
    // errors. It is not read.
    let env = Env::new();
    let p = package(&env.dir.path, "1.0.0", true);
    wheel(&p.join("wheels"));
    let escape = env.dir.path.join("pip-wrote-this.log");
    let report = env.dir.path.join("pip-report.json");
    for dir in [".config/pip", ".pip"] {
        std::fs::create_dir_all(p.join(dir)).unwrap();
    }
    let conf = format!("[global]\nlog = {}\n[install]\nreport = {}\n", escape.display(), report.display());
    std::fs::write(p.join(".config/pip/pip.conf"), &conf).unwrap();
    std::fs::write(p.join(".pip/pip.conf"), &conf).unwrap();
    let out = env.op(&["executor", "install", p.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["dep"], 42);
    assert!(!escape.exists() && !report.exists(), "pip followed the package's configuration");
}

/// `opservant keygen --out DIR`: (private, public) key paths.
fn keygen(dir: &Path) -> (String, String) {
    let out = common::command().args(["keygen", "--out", dir.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (dir.join("signing.key").to_str().unwrap().into(), dir.join("signing.pub").to_str().unwrap().into())
}

/// `tar czf PARENT/NAME -C PARENT DIR` for a package directory.
fn tar_gz(pkg: &Path, name: &str) -> String {
    let parent = pkg.parent().unwrap();
    let out = parent.join(name);
    let st = Command::new("tar")
        .args([
            "czf",
            out.to_str().unwrap(),
            "-C",
            parent.to_str().unwrap(),
            pkg.file_name().unwrap().to_str().unwrap(),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    out.to_str().unwrap().into()
}

fn sign_package(key: &str, pkg: &str, out: Option<&str>) {
    let mut args = vec!["sign", "--key", key, "--package", pkg];
    if let Some(o) = out {
        args.extend(["--out", o]);
    }
    let out = common::command().args(&args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn with_require_signature_only_archives_signed_by_a_trusted_key_install() {
    if !common::require_root() {
        return;
    }
    let keys = HostDir::new();
    let (key, public) = keygen(&keys.path.join("trusted"));
    let (stranger, _) = keygen(&keys.path.join("stranger"));
    let env = Env::with_executors(&format!("  require_signature: true\n  trusted_keys: [{public}]\n"));
    let src = package(&env.dir.path, "1.0.0", false);
    let pkg = tar_gz(&src, "hello.tar.gz");

    let refused = |args: &[&str], needle: &str| {
        let out = env.op(args);
        assert_eq!(out.code, 2, "{args:?}: {} {}", out.stdout, out.stderr);
        // One line of reason (audit records are mirrored to stderr as log lines too).
        let reasons: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("opservant: ")).collect();
        assert_eq!(reasons.len(), 1, "one reason: {}", out.stderr);
        assert!(reasons[0].contains(needle), "{args:?}: {}", out.stderr);
        assert_eq!(env.entries(), Vec::<String>::new(), "{args:?}: nothing installed, nothing left");
    };
    // No signature; a directory; a signature by a key that is not trusted.
    refused(&["executor", "install", &pkg], "no signature");
    refused(&["executor", "install", src.to_str().unwrap()], "a directory cannot be signed");
    sign_package(&stranger, &pkg, None);
    refused(&["executor", "install", &pkg], "bad signature");
    // A garbled signature file.
    std::fs::write(format!("{pkg}.sig"), "not a signature\n").unwrap();
    refused(&["executor", "install", &pkg], "signature");
    // Signed by the trusted key, then tampered with (the same signature beside it).
    sign_package(&key, &pkg, None);
    let tampered = env.dir.path.join("tampered.tar.gz");
    let mut bytes = std::fs::read(&pkg).unwrap();
    bytes.extend_from_slice(&[0; 512]);
    std::fs::write(&tampered, &bytes).unwrap();
    std::fs::copy(format!("{pkg}.sig"), format!("{}.sig", tampered.display())).unwrap();
    refused(&["executor", "install", tampered.to_str().unwrap()], "bad signature");
    // An explicit signature file that does not exist.
    refused(&["executor", "install", &pkg, "--signature", "/nonexistent/x.sig"], "/nonexistent/x.sig");

    // The genuine one installs and runs; the JSON names the key.
    let out = env.op(&["executor", "install", &pkg, "--json"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let installed: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(installed["signed_by"], public.as_str(), "{installed}");
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0");
    // A signature kept elsewhere, given with --signature.
    let v2 = tar_gz(&package(&env.dir.path.join("v2"), "2.0.0", false), "hello2.tar.gz");
    let elsewhere = env.dir.path.join("elsewhere.sig");
    sign_package(&key, &v2, Some(elsewhere.to_str().unwrap()));
    assert!(!Path::new(&format!("{v2}.sig")).exists());
    let out = env.op(&["executor", "install", &v2, "--signature", elsewhere.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["version"], "2.0.0");

    // Every verdict is audited, every refusal too, and the chain holds.
    let events = env.audit_events();
    let verdicts: Vec<&str> = events
        .iter()
        .filter(|e| e["event"] == "package_signature")
        .map(|e| e["fields"]["signature"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(verdicts, ["missing", "missing", "bad", "bad", "bad", "valid", "valid"], "{events:?}");
    let failures: Vec<&str> = events
        .iter()
        .filter(|e| e["event"] == "executor_install_failed")
        .map(|e| e["fields"]["reason"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        failures,
        [
            "unsigned_package",
            "unsigned_package",
            "bad_package_signature",
            "bad_package_signature",
            "bad_package_signature",
            "bad_package_signature"
        ],
        "{events:?}"
    );
    let out = env.op(&["audit", "verify"]);
    assert_eq!(out.code, 0, "{} {}", out.stdout, out.stderr);
}

#[test]
fn a_signature_that_is_present_is_checked_even_when_not_required() {
    if !common::require_root() {
        return;
    }
    let keys = HostDir::new();
    let (key, public) = keygen(&keys.path.join("k"));
    let env = Env::with_executors(&format!("  trusted_keys: [{public}]\n"));
    let pkg = tar_gz(&package(&env.dir.path, "1.0.0", false), "hello.tar.gz");
    // Unsigned: fine without require_signature (audited as missing).
    let out = env.op(&["executor", "install", &pkg]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    // A bad signature beside it: refused all the same.
    let v2 = tar_gz(&package(&env.dir.path.join("v2"), "2.0.0", false), "hello2.tar.gz");
    std::fs::write(format!("{v2}.sig"), "AAAA\n").unwrap();
    let out = env.op(&["executor", "install", &v2]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0", "still the first");
    sign_package(&key, &v2, None);
    let out = env.op(&["executor", "install", &v2]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(run_output(&env, "hello")["version"], "2.0.0");
    // require_signature without any key is a configuration error naming the key.
    let bad = Env::with_executors("  require_signature: true\n");
    let out = bad.op(&["executor", "install", &pkg]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("executors.require_signature"), "{}", out.stderr);
    // An unreadable trusted key, too.
    let bad = Env::with_executors("  trusted_keys: [/nonexistent/k.pub]\n");
    let out = bad.op(&["executor", "install", &pkg]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("executors.trusted_keys[0]"), "{}", out.stderr);
}

/// The installed package carries bytecode compiled in a sandbox: one timestamp-checked
/// `.pyc` per source (the requirements' included), which runs use — and a source changed
/// afterwards is compiled again, not shadowed; a source that does not compile is a warning
/// naming it; bytecode shipped in an archive is never installed.
#[test]
fn installed_packages_carry_bytecode_the_runs_use() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let src = HostDir::new();
    let links = src.path.join("links");
    wheel(&links);
    let pkg = package(&src.path, "1.0.0", true);
    std::fs::write(pkg.join("hello/broken.py"), "def f(:\n").unwrap();
    // Compiled, never run: its top level would leave a file on the host.
    let marker = src.path.join("imported-at-install");
    std::fs::write(pkg.join("hello/side_effect.py"), format!("open({:?}, 'w').close()\n", marker.to_str().unwrap()))
        .unwrap();
    // Bytecode in the archive: dropped at unpacking, whatever it holds.
    std::fs::create_dir_all(pkg.join("hello/__pycache__")).unwrap();
    std::fs::write(pkg.join("hello/__pycache__/shipped.cpython-311.pyc"), b"not bytecode").unwrap();
    let archive = src.path.join("hello.tar.gz");
    python(&format!(
        "import tarfile\nwith tarfile.open({:?}, 'w:gz') as t: t.add({:?}, arcname='hello-1.0.0')",
        archive.to_str().unwrap(),
        pkg.to_str().unwrap()
    ));
    // Under the systemd unit's umask (0077): the caches must still be readable by the
    // executor user (0644 in 0755 directories).
    let out = {
        use std::os::unix::process::CommandExt;
        let mut cmd = common::command();
        cmd.args(["executor", "install", archive.to_str().unwrap(), "--find-links", links.to_str().unwrap()])
            .args(["--config", env.config.to_str().unwrap()])
            .stdin(Stdio::null());
        // SAFETY: umask is async-signal-safe and touches no memory.
        unsafe {
            cmd.pre_exec(|| {
                libc::umask(0o077);
                Ok(())
            });
        }
        let o = cmd.output().unwrap();
        Out {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    };
    assert_eq!(out.code, 0, "{} {}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("bytecode not precompiled") && out.stderr.contains("broken.py: SyntaxError"),
        "{}",
        out.stderr
    );
    let installed = env.root.join("hello/1.0.0");
    assert!(!installed.join("hello/__pycache__/shipped.cpython-311.pyc").exists(), "shipped bytecode installed");
    assert!(!installed.join("hello/__pycache__/broken.cpython-311.pyc").exists());
    assert!(installed.join("hello/__pycache__/side_effect.cpython-311.pyc").exists());
    assert!(!marker.exists(), "a module ran at installation");
    // The runtime embeds Debian's 3.11 (the build pins it): cache tag cpython-311.
    for source in ["hello/__init__.py", "hello/main.py", ".deps/tinydep/__init__.py"] {
        let source = installed.join(source);
        let stem = source.file_stem().unwrap().to_str().unwrap();
        let pyc = source.parent().unwrap().join(format!("__pycache__/{stem}.cpython-311.pyc"));
        let bytes = std::fs::read(&pyc).unwrap_or_else(|e| panic!("{}: {e}", pyc.display()));
        let meta = std::fs::metadata(&source).unwrap();
        use std::os::unix::fs::MetadataExt;
        let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap());
        assert_eq!(&bytes[2..4], b"\r\n", "{}: magic", pyc.display());
        assert_eq!(word(4), 0, "{}: timestamp-checked", pyc.display());
        assert_eq!(word(8), meta.mtime() as u32, "{}: the source's mtime", pyc.display());
        assert_eq!(word(12), meta.size() as u32, "{}: the source's size", pyc.display());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&pyc).unwrap().permissions().mode() & 0o777, 0o644);
        let cache_dir = pyc.parent().unwrap();
        assert_eq!(std::fs::metadata(cache_dir).unwrap().permissions().mode() & 0o777, 0o755);
    }
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0");

    // Runs import the bytecode: replaced by code compiled from another source (the header,
    // which matches the installed source, kept), the run reports that code's version.
    let main = installed.join("hello/main.py");
    let main_pyc = installed.join("hello/__pycache__/main.cpython-311.pyc");
    python(&format!(
        "import marshal\nsrc = open({main:?}).read().replace('VERSION = \"1.0.0\"', 'VERSION = \"from-bytecode\"')\n\
         head = open({pyc:?}, 'rb').read()[:16]\n\
         open({pyc:?}, 'wb').write(head + marshal.dumps(compile(src, {main:?}, 'exec')))",
        main = main.to_str().unwrap(),
        pyc = main_pyc.to_str().unwrap()
    ));
    assert_eq!(run_output(&env, "hello")["version"], "from-bytecode");
    // A source changed after installation is compiled again (its size differs from the header's).
    let text = std::fs::read_to_string(&main).unwrap().replace("VERSION = \"1.0.0\"", "VERSION = \"edited-source\"");
    std::fs::write(&main, text).unwrap();
    assert_eq!(run_output(&env, "hello")["version"], "edited-source");
}

#[test]
fn a_source_that_kills_the_compiler_is_skipped_and_the_rest_compiled() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let pkg = package(&env.dir.path, "1.0.0", false);
    // ~3 MB of source whose syntax tree needs ~1 GB: over the compiling sandbox's memory
    // limit (the default 128 MiB). Were it compiled outside a limited sandbox, it would
    // get bytecode.
    std::fs::write(pkg.join("hello/big.py"), format!("x = [{}]\n", "0,".repeat(1_500_000))).unwrap();
    std::fs::write(pkg.join("hello/zz_after.py"), "VALUE = 1\n").unwrap();
    let out = env.op(&["executor", "install", pkg.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{} {}", out.stdout, out.stderr);
    assert!(
        out.stderr
            .contains("bytecode not precompiled: hello/big.py: the compiling sandbox was killed (oom) compiling it"),
        "{}",
        out.stderr
    );
    let installed = env.root.join("hello/1.0.0/hello");
    assert!(!installed.join("__pycache__/big.cpython-311.pyc").exists());
    // The files after it were compiled by a fresh sandbox.
    for stem in ["__init__", "main", "zz_after"] {
        let pyc = installed.join(format!("__pycache__/{stem}.cpython-311.pyc"));
        assert!(pyc.is_file(), "{} missing: {}", pyc.display(), out.stderr);
    }
    assert_eq!(run_output(&env, "hello")["version"], "1.0.0");
}

/// A package directory is copied by descriptors, never following a link: a FIFO or a
/// symbolic link in it is refused (exit 2, naming it; the FIFO is not waited on), and a file
/// swapped for a link to a file outside the package while the copy runs is never copied
/// through the link. The swap is `renameat2(RENAME_EXCHANGE)` in a tight loop on another
/// thread; before the copy went by descriptors (a type check by path, then an open by path
/// that followed links) the secret came through within a few installs.
#[test]
fn a_package_directory_is_copied_without_following_links_or_waiting_on_fifos() {
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let pkg = package(&env.dir.path, "1.0.0", false);
    let entry = pkg.join("hello/data.txt");
    let fifo = pkg.join("hello/pipe");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let out = Command::new("timeout")
        .args(["-k", "5", "60", common::opservant(), "executor", "install", pkg.to_str().unwrap(), "--config"])
        .arg(&env.config)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("hello/pipe") && stderr.contains("FIFOs"), "{stderr}");
    std::fs::remove_file(&fifo).unwrap();

    let secret = env.dir.file("secret", "SECRET-CONTENT\n", 0o600);
    std::os::unix::fs::symlink(&secret, &entry).unwrap();
    let out = env.op(&["executor", "install", pkg.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("hello/data.txt") && out.stderr.contains("symbolic links"), "{}", out.stderr);
    assert_eq!(env.entries(), Vec::<String>::new(), "nothing installed");

    // The race: `data.txt` is a regular file or the link, exchanged as fast as possible.
    let aside = env.dir.path.join("aside");
    std::fs::rename(&entry, &aside).unwrap();
    std::fs::write(&entry, "benign\n").unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let (stop, entry, aside) = (stop.clone(), entry.clone(), aside.clone());
        std::thread::spawn(move || {
            let (a, b) = (
                std::ffi::CString::new(entry.to_str().unwrap()).unwrap(),
                std::ffi::CString::new(aside.to_str().unwrap()).unwrap(),
            );
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: two valid NUL-terminated paths; renameat2 only reads them.
                let r = unsafe {
                    libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE)
                };
                assert_eq!(r, 0, "renameat2: {}", std::io::Error::last_os_error());
            }
        })
    };
    let (mut installed, mut refused) = (0, 0);
    for _ in 0..40 {
        let out = env.op(&["executor", "install", "--force", pkg.to_str().unwrap()]);
        match out.code {
            0 => {
                installed += 1;
                let copied = std::fs::read_to_string(env.root.join("hello/current/hello/data.txt")).unwrap();
                assert_eq!(copied, "benign\n", "the copy followed the swapped-in link");
            }
            2 => {
                refused += 1;
                assert!(out.stderr.contains("data.txt") && out.stderr.contains("symbolic links"), "{}", out.stderr);
            }
            _ => panic!("{}", out.stderr),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    swapper.join().unwrap();
    // Both outcomes seen: the swapper was at work while the copies ran (each is 2^-40 to miss).
    assert!(installed > 0 && refused > 0, "{installed} installed, {refused} refused");

    // A hard link (to a file outside the package) is refused, as in an archive.
    std::fs::remove_file(&entry).unwrap();
    std::fs::hard_link(&secret, &entry).unwrap();
    let out = env.op(&["executor", "install", "--force", pkg.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("hello/data.txt") && out.stderr.contains("hard link"), "{}", out.stderr);
}

/// SIGTERM (a service stop, `kill`) or a terminal's Ctrl-C (SIGINT to the whole process
/// group) stops an install part-way: its pip is stopped, what it staged is removed, nothing
/// is installed or recorded as installed, the failure is audited, and the exit status is
/// 128 + the signal. pip is held here by an index on loopback that accepts and never answers.
#[test]
fn a_stop_signal_ends_an_install_and_leaves_nothing() {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    if !common::require_root() {
        return;
    }
    let env = Env::new();
    let p = package(&env.dir.path, "1.0.0", true);
    let index = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/simple", index.local_addr().unwrap());
    for (sig, group) in [(libc::SIGTERM, false), (libc::SIGINT, true)] {
        let child = common::command()
            .args(["executor", "install", p.to_str().unwrap(), "--index-url", &url])
            .args(["--config", env.config.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        // pip asks the index: the install is under way, staged.
        let (mut held, _) = index.accept().unwrap();
        assert!(
            std::fs::read_dir(&env.root)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(".staging-")),
            "nothing staged while pip runs"
        );
        let target = if group { -(child.id() as i32) } else { child.id() as i32 };
        // SAFETY: kill(2) on the process (group) this test started.
        assert_eq!(unsafe { libc::kill(target, sig) }, 0);
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(128 + sig), "signal {sig}: {stderr}");
        assert!(stderr.contains("nothing was installed"), "{stderr}");
        // pip is gone (its connection closed, with or without its request sent), not left
        // waiting on the index.
        held.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let mut request = Vec::new();
        assert!(held.read_to_end(&mut request).is_ok(), "signal {sig}: pip still runs");
        assert_eq!(env.entries(), Vec::<String>::new(), "signal {sig}: left behind");
    }
    let events = env.audit_events();
    let failed: Vec<&Value> = events.iter().filter(|e| e["event"] == "executor_install_failed").collect();
    assert_eq!(failed.len(), 2, "{events:?}");
    assert!(failed.iter().all(|e| e["fields"]["reason"] == "interrupted"), "{failed:?}");
    assert!(!events.iter().any(|e| e["event"] == "executor_install"), "{events:?}");
}
