//! Shared helpers for the integration tests: they run the real `opservant` binary as root
//! against the real kernel. Under `CI=true` a missing privilege or feature is a failure,
//! never a silent skip.
#![allow(dead_code)]

pub mod freezer;
pub mod netlab;
pub mod procs;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::Value;

pub fn opservant() -> &'static str {
    env!("CARGO_BIN_EXE_opservant")
}

/// Where the tests' own configuration and audit log live, 0700: for root, in `/run` — not in
/// the checkout, whose directories need not be root's (the audit log's ancestors must be:
/// `config::check_agents_own_dir`), and not in `/var/tmp`, which tests declare to sandboxes
/// (the agent refuses a declared path holding its own files); `tests/run` makes the same for
/// pytest. Another user's tests (which skip what needs root) keep it in the build's tmp.
pub fn tests_state() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    match unsafe { libc::geteuid() } {
        0 => PathBuf::from("/run/opservant-tests"),
        _ => Path::new(env!("CARGO_TARGET_TMPDIR")).join("opservant-tests"),
    }
}

/// The configuration `opservant` reads when a test gives it no `--config`
/// (`OPSERVANT_CONFIG`): the defaults, but the audit log in [`tests_state`] — a test run
/// appends nothing to the host's `/var/log/opservant` — and a host uid per sandbox
/// ([`TEST_HOST_UIDS`]: this host has no `opservant-executor` with a `/etc/subuid` range),
/// so every suite runs its sandboxes as they run in production. Written once per test
/// process.
pub fn test_config() -> &'static Path {
    static CONFIG: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    CONFIG.get_or_init(|| {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
        let dir = tests_state();
        let _ = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir);
        // Not the user's alone (made by someone else first, or with other rights): not used.
        let meta = std::fs::symlink_metadata(&dir).expect("the tests' state directory");
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert!(
            meta.is_dir() && meta.uid() == me && meta.mode() & 0o077 == 0,
            "{} must be a directory of uid {me}'s alone (mode 0700); remove it",
            dir.display()
        );
        let path = dir.join("config.yaml");
        // The same text from every test process, written aside (a new file, never through a
        // link) and renamed over it: a reader never sees it half-written.
        let part = dir.join(format!("config.yaml.{}", std::process::id()));
        let _ = std::fs::remove_file(&part);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&part)
            .expect("write the tests' configuration");
        let text = format!("{}sandbox:\n  host_uids: {TEST_HOST_UIDS}\n", audit_section());
        std::io::Write::write_all(&mut f, text.as_bytes()).expect("write the tests' configuration");
        std::fs::rename(&part, &path).expect("put the tests' configuration in place");
        path
    })
}

/// The host uids of the tests' sandboxes (`sandbox.host_uids` of [`test_config`]; `tests/run`
/// writes the same).
pub const TEST_HOST_UIDS: &str = "{first: 1900000000, count: 65536}";

/// The `audit:` section of [`test_config`], for a test's own configuration that has none.
pub fn audit_section() -> String {
    format!("audit:\n  path: {}/audit/audit.jsonl\n", tests_state().display())
}

/// `opservant` as the tests start it: [`test_config`] unless the test passes `--config`.
pub fn command() -> Command {
    let mut cmd = Command::new(opservant());
    cmd.env("OPSERVANT_CONFIG", test_config());
    cmd
}

/// Runs `opservant ARGS` (the tests' configuration unless `--config` is among them) under
/// `strace`, which kills it (SIGKILL) as it makes its first symbolic link: an install's is
/// its new `current` link, made after the new version was moved into place — the crash
/// window between an install's copy and its switch. Asserts that it was killed there. `None`:
/// no `strace` here (a visible skip; a failure under CI).
pub fn install_killed_at_its_switch(args: &[&str]) -> Option<std::process::Output> {
    let out = with_symlinks_failing("error=EIO:signal=KILL", args)?;
    // strace ends with the signal that killed its tracee, as a shell reports it.
    assert_eq!(
        out.status.code().or(std::os::unix::process::ExitStatusExt::signal(&out.status).map(|s| 128 + s)),
        Some(137),
        "not killed at its switch: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(out)
}

/// Runs `opservant ARGS` under `strace`, which fails its symbolic links with `EIO` (the
/// syscall not made): an install's switch fails outright. `None`: no `strace` here.
pub fn install_whose_switch_fails(args: &[&str]) -> Option<std::process::Output> {
    with_symlinks_failing("error=EIO", args)
}

/// `opservant ARGS` under `strace -e inject=symlink,symlinkat:HOW` (the tests'
/// configuration unless `--config` is among them). `None`: no `strace` here (a visible skip;
/// a failure under CI).
fn with_symlinks_failing(how: &str, args: &[&str]) -> Option<std::process::Output> {
    let inject = format!("inject=?symlink,symlinkat:{how}");
    under_strace(&[], &["-o", "/dev/null", "-e", "trace=?symlink,symlinkat", "-e", &inject], args)
}

/// `opservant ARGS` as on a Linux release before 5.8 (`setarch --uname-2.6`: `uname`
/// reports 2.6.N), under `strace STRACE_ARGS`. `None`: no `strace` or `setarch` here (a
/// visible skip; a failure under CI).
pub fn on_linux_2_6_under_strace(strace_args: &[&str], args: &[&str]) -> Option<std::process::Output> {
    let present = Command::new("setarch").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if !require("setarch (util-linux: a kernel release before 5.8 as uname reports it)", present) {
        return None;
    }
    under_strace(&["setarch", std::env::consts::ARCH, "--uname-2.6"], strace_args, args)
}

/// `WRAPPER… strace -qq STRACE_ARGS opservant ARGS` (the tests' configuration unless
/// `--config` is among them). `None`: no `strace` here (a visible skip; a failure under CI).
pub fn under_strace(wrapper: &[&str], strace_args: &[&str], args: &[&str]) -> Option<std::process::Output> {
    let present = Command::new("strace").arg("-V").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if !require("strace (fails or watches an install's system calls)", present) {
        return None;
    }
    let argv: Vec<&str> = wrapper.iter().copied().chain(["strace", "-qq"]).chain(strace_args.iter().copied()).collect();
    Some(
        Command::new(argv[0])
            .args(&argv[1..])
            .arg(opservant())
            .args(args)
            .env("OPSERVANT_CONFIG", test_config())
            .stdin(Stdio::null())
            .output()
            .expect("spawn strace"),
    )
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// True when the test may run. Not root: a failure under CI, a visible skip otherwise.
#[must_use]
pub fn require_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if in_ci() {
        panic!("this test needs root (CAP_SYS_ADMIN, CAP_SETUID, cgroup writes); CI must run it as root");
    }
    eprintln!("SKIPPED: needs root");
    false
}

/// Fail under CI, skip visibly otherwise, when a host feature is missing.
#[must_use]
pub fn require(feature: &str, present: bool) -> bool {
    if present {
        return true;
    }
    if in_ci() {
        panic!("required host feature missing under CI: {feature}");
    }
    eprintln!("SKIPPED: host lacks {feature}");
    false
}

/// `--launch MODE` for `opservant sandbox` and `run`, from `OPSERVANT_TEST_LAUNCH`
/// (`cold`, the default, or `zygote`): `tests/run` runs the hostile, limit and executor
/// suites in both modes.
pub fn launch_mode() -> String {
    std::env::var("OPSERVANT_TEST_LAUNCH").unwrap_or_else(|_| "cold".into())
}

pub fn launch_args() -> [String; 2] {
    ["--launch".into(), launch_mode()]
}

/// Panic unless a result object says it was started the way the suite asked (a zygote
/// that silently fell back to the cold path would prove nothing about zygote mode).
/// Likewise its network namespace: through a zygote (or a pool, which starts sandboxes
/// through one), a sandbox with a private network namespace and no fresh sysfs joins one
/// the zygote's stash made beforehand — the command line waits for the stash — so the
/// suites run every isolation test against that namespace too.
pub fn assert_launch(result: &Value) {
    // A result without a sandbox (refused before one started) has nothing to check; one with
    // a sandbox always says how it started.
    if !result["sandbox"].is_null() {
        let launch = result["sandbox"]["launch"].as_str().unwrap_or_else(|| panic!("no sandbox.launch: {result}"));
        assert_eq!(launch, launch_mode(), "started {launch}, expected {}: {result}", launch_mode());
    }
    if let Some(netns) = result["sandbox"]["netns"].as_str() {
        let sandbox = &result["sandbox"];
        let private = sandbox["namespaces"].as_array().is_some_and(|n| n.iter().any(|n| n == "net"));
        let expected = match (private, sandbox["sysfs"] == "fresh", launch_mode().as_str()) {
            (false, _, _) => "host",
            (true, true, _) | (true, false, "cold") => "created",
            (true, false, _) => "prepared",
        };
        assert_eq!(netns, expected, "network namespace {netns}, expected {expected}: {result}");
    }
}

/// One `opservant sandbox --json` run.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub json: Value,
    pub stderr: String,
}

impl Run {
    pub fn status(&self) -> &str {
        self.json["status"].as_str().unwrap_or("")
    }
    pub fn stdout(&self) -> &str {
        self.json["stdout"].as_str().unwrap_or("")
    }
    pub fn err(&self) -> &str {
        self.json["stderr"].as_str().unwrap_or("")
    }
    pub fn exit_code(&self) -> Option<i64> {
        self.json["exit_code"].as_i64()
    }
    pub fn killed_by(&self) -> Option<&str> {
        self.json["killed_by"].as_str()
    }
    pub fn usage(&self, key: &str) -> u64 {
        self.json["usage"][key].as_u64().unwrap_or(0)
    }
}

/// `opservant sandbox [--manifest M] --json -- argv…`; panics with everything printed when
/// the output is not a result object (exit status 2).
pub fn sandbox(manifest: Option<&Path>, argv: &[&str]) -> Run {
    try_sandbox(manifest, argv)
        .unwrap_or_else(|(code, err)| panic!("opservant sandbox could not run (exit {code}): {err}"))
}

/// Tests that change host paths every sandbox sees (e.g. create /etc/opservant) hold this
/// for writing; every sandbox run holds it for reading, so runs never see a half-made host.
pub static HOST_VIEW: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Hold while starting `opservant` directly (see [`HOST_VIEW`]).
pub fn host_view() -> std::sync::RwLockReadGuard<'static, ()> {
    HOST_VIEW.read().unwrap_or_else(|e| e.into_inner())
}

/// Like [`sandbox`] but returns `Err((exit code, stderr))` when no result JSON was printed.
pub fn try_sandbox(manifest: Option<&Path>, argv: &[&str]) -> Result<Run, (i32, String)> {
    try_sandbox_with(manifest, argv, command())
}

/// [`sandbox`], `opservant` placed in the cgroup whose `cgroup.procs` is `procs` before it
/// runs (its sandbox cgroups are then made beneath that one).
#[allow(dead_code)] // tests/limits.rs only
pub fn sandbox_in_cgroup(manifest: Option<&Path>, argv: &[&str], procs: &Path) -> Run {
    let mut cmd = command();
    in_cgroup(&mut cmd, procs);
    try_sandbox_with(manifest, argv, cmd)
        .unwrap_or_else(|(code, err)| panic!("opservant sandbox could not run (exit {code}): {err}"))
}

/// Have `cmd` place itself in the cgroup whose `cgroup.procs` is `procs` before it runs.
#[allow(dead_code)] // tests/limits.rs and tests/agent_local.rs only
pub fn in_cgroup(cmd: &mut Command, procs: &Path) {
    use std::os::unix::process::CommandExt;
    let procs = procs.to_owned();
    // SAFETY: the hook only opens, writes and closes a file between fork and exec ("0" is
    // the writing process).
    unsafe { cmd.pre_exec(move || std::fs::write(&procs, "0")) };
}

fn try_sandbox_with(manifest: Option<&Path>, argv: &[&str], mut cmd: Command) -> Result<Run, (i32, String)> {
    let _view = host_view();
    cmd.arg("sandbox");
    if let Some(m) = manifest {
        cmd.arg("--manifest").arg(m);
    }
    cmd.args(launch_args()).arg("--json").arg("--").args(argv);
    let out = cmd.stdin(Stdio::null()).output().expect("spawn opservant");
    let code = out.status.code().unwrap_or(-1);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    match serde_json::from_str::<Value>(stdout.trim()) {
        Ok(json) => {
            assert_launch(&json);
            Ok(Run { code, json, stderr })
        }
        Err(_) => Err((code, format!("{stderr}\nstdout: {stdout}"))),
    }
}

/// [`try_sandbox`] with the configuration `config` instead of [`test_config`].
pub fn try_sandbox_configured(config: &Path, manifest: Option<&Path>, argv: &[&str]) -> Result<Run, (i32, String)> {
    let mut cmd = command();
    cmd.env("OPSERVANT_CONFIG", config);
    try_sandbox_with(manifest, argv, cmd)
}

/// A configuration of the tests' own, [`test_config`]'s audit section and `extra` (YAML
/// sections), written in [`tests_state`] as `NAME.yaml`.
pub fn config_with(name: &str, extra: &str) -> TestConfig {
    test_config();
    let path = tests_state().join(format!("{name}.{}.yaml", std::process::id()));
    std::fs::write(&path, format!("{}{extra}", audit_section())).expect("write a test configuration");
    TestConfig(path)
}

/// A test's own configuration file, removed when the test is done with it.
#[derive(Debug)]
pub struct TestConfig(PathBuf);

impl std::ops::Deref for TestConfig {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl AsRef<Path> for TestConfig {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TestConfig {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TestConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `/bin/sh -c script` in the sandbox.
pub fn sh(manifest: Option<&Path>, script: &str) -> Run {
    sandbox(manifest, &["/bin/sh", "-c", script])
}

/// `python3 -c code` in the sandbox (Debian's interpreter; it lives under /usr).
pub fn python(manifest: Option<&Path>, code: &str) -> Run {
    sandbox(manifest, &["/usr/bin/python3", "-I", "-S", "-c", code])
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A directory on the host, removed on drop.
pub struct HostDir {
    pub path: PathBuf,
}

impl HostDir {
    /// A fresh directory below `parent` (created if needed), mode 0755.
    pub fn new_in(parent: &str) -> HostDir {
        let path = PathBuf::from(parent).join(format!(
            "opservant-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create test dir");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod test dir");
        HostDir { path }
    }

    /// A fresh directory below /var/tmp (outside every default sandbox view).
    pub fn new() -> HostDir {
        Self::new_in("/var/tmp")
    }

    /// Make the directory `name` (a relative path: each missing component mode 0755,
    /// whatever the umask) and return its path.
    pub fn dir(&self, name: &str) -> PathBuf {
        let mut p = self.path.clone();
        for c in Path::new(name).components() {
            p.push(c);
            if !p.is_dir() {
                std::fs::create_dir(&p).expect("create test dir");
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod test dir");
            }
        }
        p
    }

    /// Write `name` (mode `mode`) and return its path.
    pub fn file(&self, name: &str, content: &str, mode: u32) -> PathBuf {
        let p = self.path.join(name);
        std::fs::write(&p, content).expect("write test file");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod test file");
        p
    }

    /// Make the directory owned by the executor identity (so the sandbox can write into it).
    pub fn chown_to_executor(&self) {
        let id = sandbox::Identity::default_executor().expect("executor identity");
        std::os::unix::fs::chown(&self.path, Some(id.host_uid), Some(id.host_gid)).expect("chown test dir");
    }

    pub fn str(&self) -> &str {
        self.path.to_str().expect("utf-8 test path")
    }
}

impl Drop for HostDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Write a manifest with the given `permissions` and `resource_limits` JSON objects.
pub fn manifest(dir: &HostDir, permissions: &str, resource_limits: &str) -> PathBuf {
    let text = format!(
        r#"{{"name":"test-executor","version":"1.0.0","description":"integration test","supported_actions":["act-test"],
            "entry_point":"test_executor.TestExecutor","permissions":{permissions},"resource_limits":{resource_limits}}}"#
    );
    let p = dir.path.join("manifest.json");
    std::fs::write(&p, text).expect("write manifest");
    p
}

/// Manifest with default permissions and these limits, in a fresh directory.
pub fn limits_manifest(resource_limits: &str) -> (HostDir, PathBuf) {
    let d = HostDir::new();
    let m = manifest(&d, "{}", resource_limits);
    (d, m)
}

/// The executor uid/gid on this host.
pub fn executor_ids() -> (u32, u32) {
    let id = sandbox::Identity::default_executor().expect("executor identity");
    (id.host_uid, id.host_gid)
}

/// Sandbox cgroups currently present under this machine's hierarchies (leak checks).
pub fn sandbox_cgroups() -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![PathBuf::from("/sys/fs/cgroup")];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let Ok(ft) = e.file_type() else { continue };
            if !ft.is_dir() {
                continue;
            }
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("opservant-sb-") {
                found.push(e.path());
            } else if stack.len() < 10_000 {
                stack.push(e.path());
            }
        }
    }
    found
}

/// Sandbox cgroups created by a given opservant process (pid in the name).
/// The processes of the sandbox that command `pid` started: those in its pids cgroup (the
/// cgroups are named by the command's pid whatever the launch mode).
pub fn sandbox_members(pid: u32) -> Vec<i32> {
    cgroups_of(pid)
        .iter()
        .filter(|d| d.to_string_lossy().contains("/pids/"))
        .flat_map(|d| {
            std::fs::read_to_string(d.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

pub fn cgroups_of(pid: u32) -> Vec<PathBuf> {
    sandbox_cgroups()
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("opservant-sb-{pid}-"))))
        .collect()
}

/// Host processes whose command line contains `marker`.
/// The sandbox payload — the `python3` whose command line holds `marker` — once it waits in
/// `rt_sigtimedwait` (kernel state, not time: SigBlk is no help, the kernel unblocks the
/// awaited signal for the wait itself; the sandbox's own processes may carry the marker too —
/// a forking launcher — and its init waits in rt_sigtimedwait as well). `None` when `held`,
/// the thread running the sandbox, ended first or a minute passed.
pub fn payload_waiting_for_a_signal<T>(marker: &str, held: &std::thread::JoinHandle<T>) -> Option<i32> {
    let waiting = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "python3")
            && std::fs::read_to_string(format!("/proc/{pid}/syscall"))
                .is_ok_and(|s| s.split_whitespace().next() == Some(&libc::SYS_rt_sigtimedwait.to_string()))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(pid) = host_processes_with(marker).into_iter().find(|p| waiting(*p)) {
            return Some(pid);
        }
        if std::time::Instant::now() > deadline || held.is_finished() {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

pub fn host_processes_with(marker: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(marker) {
                pids.push(pid);
            }
        }
    }
    pids
}

/// A v1 memory cgroup of a test's own, beneath the one the test process is in: what runs in
/// it makes its sandbox cgroups beneath it, where no other test's run sweeps or charges.
/// Dropping it removes what cgroups are left in it, and it, waiting up to 10 s for what ran
/// in it to exit.
#[allow(dead_code)] // each test file uses its part
pub struct MemoryCgroup(pub PathBuf);

#[allow(dead_code)]
impl MemoryCgroup {
    /// A new one named by `label`, or `None` (skipped, outside CI only) on a host without a
    /// v1 memory hierarchy.
    pub fn new(label: &str) -> Option<MemoryCgroup> {
        let root = Path::new("/sys/fs/cgroup/memory");
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap().lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            controllers.split(',').any(|c| c == "memory").then(|| path.to_string())
        });
        let Some(own) = own.filter(|_| root.join("cgroup.procs").exists()) else {
            assert!(!in_ci(), "CI runs on a host with a v1 memory hierarchy");
            eprintln!("SKIPPED: no v1 memory hierarchy");
            return None;
        };
        let dir = root.join(own.trim_start_matches('/')).join(format!("opservant-test-{label}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Some(MemoryCgroup(dir))
    }

    /// Its `cgroup.procs`.
    pub fn procs(&self) -> PathBuf {
        self.0.join("cgroup.procs")
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            for e in std::fs::read_dir(&self.0).into_iter().flatten().flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    let _ = std::fs::remove_dir(e.path());
                }
            }
            if std::fs::remove_dir(&self.0).is_ok() || std::time::Instant::now() > deadline {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

/// A minimal HTTP `CONNECT` proxy on 127.0.0.1 (a thread per client, for the test process's
/// life): it records each request line (`CONNECT HOST:PORT HTTP/1.1`) and relays bytes both
/// ways. Returns its port and the request lines seen.
pub fn connect_proxy() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, Write};
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = proxy.local_addr().unwrap().port();
    let connects = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = connects.clone();
    std::thread::spawn(move || {
        for client in proxy.incoming().flatten() {
            let seen = seen.clone();
            std::thread::spawn(move || {
                let mut reader = std::io::BufReader::new(client.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let target = line.split_whitespace().nth(1).unwrap_or_default().to_string();
                seen.lock().unwrap().push(line.trim().to_string());
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                }
                let Ok(upstream) = std::net::TcpStream::connect(&target) else { return };
                let mut client = client;
                client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").unwrap();
                let (mut up_read, mut up_write) = (upstream.try_clone().unwrap(), upstream);
                let mut down = client.try_clone().unwrap();
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut up_read, &mut down);
                    let _ = down.shutdown(std::net::Shutdown::Both);
                });
                // What the client sent after the CONNECT's headers (none: it waits for 200).
                let _ = up_write.write_all(reader.buffer());
                let _ = std::io::copy(&mut reader.into_inner(), &mut up_write);
                let _ = up_write.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (port, connects)
}

/// The kernel's word that the system clock is not synchronised (`adjtimex`'s maximum error at
/// 16 s, where the kernel puts it once no time service disciplines the clock — systemd's
/// `ntp_synced()` criterion), asked here without the code under test.
pub fn clock_unsynchronised() -> bool {
    // SAFETY: `timex` is plain data, valid all zeros; with `modes` 0 the call only reads.
    let mut t: libc::timex = unsafe { std::mem::zeroed() };
    // SAFETY: `t` is a valid, exclusive pointer for the call's duration.
    let state = unsafe { libc::adjtimex(&mut t) };
    assert!(state >= 0, "adjtimex: {}", std::io::Error::last_os_error());
    t.maxerror >= 16_000_000
}

/// Lowercase hex SHA-256 of `data` (computed here, not by the code under test).
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}
