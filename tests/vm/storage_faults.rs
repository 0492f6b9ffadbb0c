//! The storage-fault suite (see `tests/vm/README.md`): what the agent does when the disk
//! under its replay store, audit log or executors refuses writes.
//!
//! This development host's kernel has no device-mapper and no fault injection, so the suite
//! runs in one throw-away QEMU guest (`tests/vm/vm-exec.sh`, the Debian kernel, whose
//! `dm-flakey` makes a mounted ext4 filesystem's disk refuse every write while reads go on:
//! `fdatasync`, `fsync` and `syncfs` then fail with `EIO`, as on a failing disk). Each check
//! gets a fresh 64 MiB loop device behind such a target, mounted where the check puts one
//! of the agent's files, and turns the writes off part-way. The promises tried:
//! - a command whose `command_id` cannot be recorded durably is rejected and nothing of its
//!   executor runs (the replay store fails closed);
//! - a run whose `executor_start` record cannot be made durable never imports its executor,
//!   through the daemon and through `opservant run`;
//! - an install whose files, or whose switch of `current`, cannot be written to the disk
//!   fails (exit 2) saying what a restart may find, and the version installed before stays
//!   the one that runs; the marker of a switch that did not reach the disk switches nothing
//!   later; so does an install on a release before Linux 5.8 (`setarch --uname-2.6`),
//!   which `fsync`s each file instead of a `syncfs` that did not report write-back errors
//!   then; a removal that cannot be written fails, saying the executor may come back;
//! - a secret whose new value cannot be written leaves the value stored before, and a store
//!   key that cannot be written is never used.
//!
//! Where a claim is about what survives, the check then unmounts the filesystem, heals the
//! disk and mounts it again — what a crash would have left — and looks.
//!
//! Without the prerequisites the suite prints `SKIPPED: ...` and succeeds — unless
//! `CI=true`, where a missing prerequisite is a failure.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "guest.rs"]
#[macro_use]
mod guest;
#[path = "host.rs"]
mod host;

use guest::{pipe, sh, sh_ok};

const OPSERVANT: &str = env!("CARGO_BIN_EXE_opservant");

fn main() -> ExitCode {
    host::suite(in_vm, on_host)
}

// ------------------------------------------------------------------------------------------
// Host side: prerequisites, then one VM for the whole suite.
// ------------------------------------------------------------------------------------------

fn on_host() -> ExitCode {
    let mut missing = host::missing_prerequisites(false);
    // The guest runs the host's tools (its root filesystem is the host's).
    for (tool, package) in [
        ("dmsetup", "dmsetup"),
        ("mkfs.ext4", "e2fsprogs"),
        ("losetup", "mount"),
        ("blockdev", "util-linux"),
        ("strace", "strace"),
        ("setarch", "util-linux"),
    ] {
        if host::on_path(tool).is_none() && !Path::new("/usr/sbin").join(tool).is_file() {
            missing.push(format!("{tool}: apt-get install -y {package}"));
        }
    }
    if let Some(exit) = host::unless_ready("vm_storage_faults", "storage-fault VM suite", &missing) {
        return exit;
    }
    host::boot_and_run(
        "vm_storage_faults",
        "booting a VM (QEMU/TCG, ~15-35 s) and failing the agent's disks inside",
        &[],
        &[],
    )
}

// ------------------------------------------------------------------------------------------
// Guest side
// ------------------------------------------------------------------------------------------

struct Ctx {
    /// Scratch directory: keys, configurations, logs, disk images, test packages.
    dir: PathBuf,
    /// The mark executor's package (version 1.0.0): its module writes its version to
    /// [`Ctx::mark`] when imported — whether any of it ran.
    mark_pkg: PathBuf,
    mark: PathBuf,
}

fn in_vm() -> ExitCode {
    let checks: [(&str, guest::Check<Ctx>); 10] = [
        ("replay_store_write_error_rejects_the_command", replay_store_write_error_rejects_the_command),
        ("audit_write_error_keeps_the_executor_from_running", audit_write_error_keeps_the_executor_from_running),
        ("cli_run_audit_write_error_keeps_the_executor_from_running", cli_run_audit_write_error),
        ("install_write_error_keeps_the_installed_version", install_write_error_keeps_the_installed_version),
        ("install_on_overlayfs_write_error_keeps_the_installed_version", install_on_overlayfs_write_error),
        ("install_before_5_8_write_error_keeps_the_installed_version", install_before_5_8_write_error),
        (
            "install_switch_write_error_says_what_a_restart_may_find",
            install_switch_write_error_says_what_a_restart_may_find,
        ),
        ("remove_write_error_fails_the_removal", remove_write_error_fails_the_removal),
        ("secrets_write_error_keeps_the_stored_value", secrets_write_error_keeps_the_stored_value),
        ("secrets_key_write_error_leaves_no_key", secrets_key_write_error_leaves_no_key),
    ];
    let ctx = match setup() {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("setting up the storage-fault suite failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("\nrunning {} storage-fault checks in the VM (kernel {})", checks.len(), kernel.trim());
    let exit = guest::run_checks(&checks, &ctx, false, String::new);
    let _ = std::fs::remove_dir_all(&ctx.dir);
    exit
}

/// The modules, keys, the mark directory (writable by the sandbox's user alone: a directory
/// every user may write to is refused as a grant) and the mark executor.
fn setup() -> Result<Ctx, String> {
    sh_ok("modprobe loop && modprobe dm_mod && modprobe dm_flakey")?;
    let dir = PathBuf::from(format!("/var/tmp/opservant-vm-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    sh_ok(&format!("{OPSERVANT} keygen --out {}", dir.join("keys").display()))?;
    let marks = dir.join("marks");
    std::fs::create_dir(&marks).map_err(|e| format!("create {}: {e}", marks.display()))?;
    let id = sandbox::Identity::default_executor().map_err(|e| format!("executor identity: {e}"))?;
    std::os::unix::fs::chown(&marks, Some(id.host_uid), Some(id.host_gid)).map_err(|e| format!("chown marks: {e}"))?;
    let mark = marks.join("mark");
    let mark_pkg = mark_package(&dir, &marks, &mark, "1.0.0")?;
    Ok(Ctx { dir, mark_pkg, mark })
}

/// The mark executor at `version`, in its own directory below `dir`.
fn mark_package(dir: &Path, marks: &Path, mark: &Path, version: &str) -> Result<PathBuf, String> {
    guest::executor_package(
        &dir.join(format!("mark-{version}")),
        "mark",
        version,
        &format!("open({:?}, 'w').write({version:?})\n", mark.display().to_string()),
        json!({"filesystem": {"write": [marks]}}),
        json!({"timeout_seconds": 60}),
        "        return ExecutorResult(status=\"completed\", output={})\n",
    )
}

/// Whether the mark executor's module was imported since the last call (the mark is removed).
fn marked(ctx: &Ctx) -> Option<String> {
    let text = std::fs::read_to_string(&ctx.mark).ok();
    let _ = std::fs::remove_file(&ctx.mark);
    text
}

/// An ext4 filesystem on a loop device behind a device-mapper target, mounted at `mount`:
/// `linear` (a healthy disk) until [`FaultyDisk::fail_writes`] swaps in `flakey` with
/// `error_writes` (every write fails with `EIO`; reads go on). Removed on drop.
struct FaultyDisk {
    name: String,
    image: PathBuf,
    loop_dev: String,
    mount: PathBuf,
}

const DISK_SECTORS: u64 = 64 << 11; // 64 MiB in 512-byte sectors

impl FaultyDisk {
    fn new(ctx: &Ctx, name: &str) -> Result<FaultyDisk, String> {
        let image = ctx.dir.join(format!("{name}.img"));
        let f = std::fs::File::create(&image).map_err(|e| format!("create {}: {e}", image.display()))?;
        f.set_len(DISK_SECTORS * 512).map_err(|e| format!("size {}: {e}", image.display()))?;
        let loop_dev = sh_ok(&format!("losetup -f --show {}", image.display()))?.trim().to_string();
        let disk = FaultyDisk { name: format!("opservant-{name}"), image, loop_dev, mount: ctx.dir.join(name) };
        sh_ok(&format!("mkfs.ext4 -q -F {}", disk.loop_dev))?;
        sh_ok(&format!(
            "dmsetup create --noudevsync {n} --table '{t}' && dmsetup mknodes {n}",
            n = disk.name,
            t = disk.table("linear")
        ))?;
        std::fs::create_dir_all(&disk.mount).map_err(|e| format!("create {}: {e}", disk.mount.display()))?;
        // A long journal commit interval: nothing reaches the disk on a timer during a check,
        // only through the flushes the agent asks for (and the write-back of old dirty pages).
        sh_ok(&format!("mount -o commit=300 /dev/mapper/{} {}", disk.name, disk.mount.display()))?;
        Ok(disk)
    }

    fn table(&self, target: &str) -> String {
        match target {
            "linear" => format!("0 {DISK_SECTORS} linear {} 0", self.loop_dev),
            // Up 0 s, down 1 s: always down; while down, every write fails and reads go on.
            _ => format!("0 {DISK_SECTORS} flakey {} 0 0 1 1 error_writes", self.loop_dev),
        }
    }

    /// From now on every write to the disk fails (`EIO`). `dmsetup suspend` freezes the filesystem first, so
    /// what was written before is on the disk (as after a `sync`): the fault covers what
    /// follows, as a disk that failed at that moment.
    fn fail_writes(&self) -> Result<(), String> {
        self.load(&self.table("flakey"))
    }

    fn load(&self, table: &str) -> Result<(), String> {
        sh_ok(&format!(
            "dmsetup suspend --noudevsync {n} && dmsetup load {n} --table '{table}' && dmsetup resume --noudevsync {n}",
            n = self.name
        ))
        .map(drop)
    }

    /// What a restart would find: the filesystem unmounted (what was only in memory goes),
    /// the disk healed and mounted again (ext4 replays the journal's committed transactions).
    /// Nothing may be using the mount.
    fn remount_healed(&self) -> Result<(), String> {
        sh_ok(&format!("umount {} && blockdev --flushbufs /dev/mapper/{}", self.mount.display(), self.name))?;
        self.load(&self.table("linear"))?;
        sh_ok(&format!("mount -o commit=300 /dev/mapper/{} {}", self.name, self.mount.display())).map(drop)
    }
}

impl Drop for FaultyDisk {
    fn drop(&mut self) {
        // Each check's device has a name of its own: one left behind (a killed agent's
        // sandbox still holding the mount) is only reported.
        let (code, out, err) = sh(&format!(
            "umount -l {m}; dmsetup remove --noudevsync --retry {n} && losetup -d {l} && rm -f {i}",
            m = self.mount.display(),
            n = self.name,
            l = self.loop_dev,
            i = self.image.display()
        ));
        if code != 0 {
            println!("\n  (the disk {} was not removed: exit {code}: {out}{err})", self.name);
        }
    }
}

/// Where a check's agent keeps its files: one scratch directory per check, with the state
/// directory, the audit log or the executors placed on a faulty disk instead.
struct Places {
    base: PathBuf,
    state: PathBuf,
    audit: PathBuf,
    executors: PathBuf,
    /// The built-in secrets store's directory (`secrets.enc`).
    secrets: PathBuf,
    /// The directory of the store's key (`secrets.key`).
    secrets_key: PathBuf,
}

impl Places {
    fn new(ctx: &Ctx, check: &str) -> Places {
        let base = ctx.dir.join(check);
        Places {
            state: base.join("state"),
            audit: base.join("audit/audit.jsonl"),
            executors: base.join("executors"),
            secrets: base.join("secrets"),
            secrets_key: base.join("secrets"),
            base,
        }
    }

    fn config(&self) -> PathBuf {
        self.base.join("config.yaml")
    }

    fn socket(&self) -> PathBuf {
        self.base.join("agent.sock")
    }

    /// The configuration file, then the mark executor installed.
    fn write(&self, ctx: &Ctx) -> Result<(), String> {
        for dir in [&self.base, &self.secrets, &self.secrets_key] {
            std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        }
        std::fs::write(
            self.config(),
            format!(
                "agent:\n  platform_public_key: {}\n  state_dir: {}\n  socket: {}\n  max_concurrent: 2\n\
                 executors:\n  dir: {}\naudit:\n  path: {}\n\
                 secrets:\n  provider: builtin\n  store: {}/secrets.enc\n  key_file: {}/secrets.key\n",
                ctx.dir.join("keys/signing.pub").display(),
                self.state.display(),
                self.socket().display(),
                self.executors.display(),
                self.audit.display(),
                self.secrets.display(),
                self.secrets_key.display()
            ),
        )
        .map_err(|e| format!("write the config: {e}"))?;
        self.op_ok(&["executor", "install", &ctx.mark_pkg.display().to_string()]).map(drop)
    }

    /// `opservant ARGS --config CONFIG`: (exit code, stdout, stderr).
    fn op(&self, args: &[&str]) -> Result<(i32, String, String), String> {
        self.op_with_input(args, b"")
    }

    /// [`Places::op`] with `input` on its stdin.
    fn op_with_input(&self, args: &[&str], input: &[u8]) -> Result<(i32, String, String), String> {
        self.op_under(&[], args, input)
    }

    /// [`Places::op_with_input`] as `WRAPPER… opservant ARGS`.
    fn op_under(&self, wrapper: &[&str], args: &[&str], input: &[u8]) -> Result<(i32, String, String), String> {
        let mut argv = wrapper.to_vec();
        argv.push(OPSERVANT);
        argv.extend_from_slice(args);
        let config = self.config().display().to_string();
        argv.extend_from_slice(&["--config", &config]);
        pipe(&argv, input)
    }

    fn op_ok(&self, args: &[&str]) -> Result<String, String> {
        let (code, out, err) = self.op(args)?;
        ensure!(code == 0, "opservant {args:?} exited {code}\nstdout: {out}\nstderr: {err}");
        Ok(out)
    }

    /// The audit log's events for `command_id`.
    fn audited(&self, command_id: &str) -> Vec<String> {
        std::fs::read_to_string(&self.audit)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e.to_string().contains(&format!("\"{command_id}\"")))
            .filter_map(|e| e["event"].as_str().map(str::to_string))
            .collect()
    }
}

/// A running `opservant agent` (killed on drop), its log in the check's directory.
struct Agent {
    child: Child,
    socket: PathBuf,
    key: PathBuf,
    log: PathBuf,
}

impl Agent {
    fn start(ctx: &Ctx, places: &Places) -> Result<Agent, String> {
        let log = places.base.join("agent.log");
        let out = std::fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(OPSERVANT)
            .args(["agent", "--config", &places.config().display().to_string()])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("start the agent: {e}"))?;
        let mut agent = Agent { child, socket: places.socket(), key: ctx.dir.join("keys/signing.key"), log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(&agent.socket).is_err() {
            ensure!(agent.running(), "the agent exited at start\n{}", agent.log_text());
            ensure!(Instant::now() < deadline, "the agent did not listen within 60 s\n{}", agent.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(agent)
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn log_text(&self) -> String {
        format!("agent log:\n{}", std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// Sign an `execute` of the mark executor as `command_id` and submit it: (exit code, reply).
    fn execute_mark(&self, command_id: &str) -> Result<(i32, Value), String> {
        self.submit(&json!({"command_id": command_id, "action": "execute", "executor": "mark", "parameters": {}}))
    }

    /// Sign `cmd` and submit it: (exit code, reply).
    fn submit(&self, cmd: &Value) -> Result<(i32, Value), String> {
        let socket = self.socket.display().to_string();
        let submit = [OPSERVANT, "submit", "-", "--socket", &socket];
        guest::sign_and_submit(&self.key.display().to_string(), &submit, cmd, || self.log_text())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A check's places, one of them moved by `place` onto a new faulty disk (given its mount
/// point), then written: the configuration, the mark executor installed.
fn on_a_faulty_disk(ctx: &Ctx, check: &str, place: fn(&mut Places, &Path)) -> Result<(Places, FaultyDisk), String> {
    let mut places = Places::new(ctx, check);
    let disk = FaultyDisk::new(ctx, &format!("{check}-disk"))?;
    place(&mut places, &disk.mount);
    places.write(ctx)?;
    Ok((places, disk))
}

/// The mark executor runs through the agent: the disk works before it is failed.
fn runs_first(ctx: &Ctx, agent: &Agent, command_id: &str) -> Result<(), String> {
    let (code, r) = agent.execute_mark(command_id)?;
    ensure!(code == 0 && r["status"] == "completed", "before the fault: exit {code}, {r}\n{}", agent.log_text());
    ensure!(marked(ctx).as_deref() == Some("1.0.0"), "before the fault the mark executor did not run: {r}");
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Checks
// ------------------------------------------------------------------------------------------

/// The replay store (in the state directory) cannot make a command's id durable: the command
/// is rejected, nothing of its executor runs, and the agent goes on answering.
fn replay_store_write_error_rejects_the_command(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "replay", |p, disk| p.state = disk.join("state"))?;
    let mut agent = Agent::start(ctx, &places)?;
    runs_first(ctx, &agent, "replay-before")?;
    disk.fail_writes()?;
    for id in ["replay-after-1", "replay-after-2"] {
        let (code, r) = agent.execute_mark(id)?;
        ensure!(code != 0 && r["status"] == "rejected", "{id}: exit {code}, {r}\n{}", agent.log_text());
        let error = r["error"].as_str().unwrap_or_default();
        ensure!(error.contains("replay store"), "{id}: the rejection does not name the replay store: {r}");
        ensure!(marked(ctx).is_none(), "{id}: the mark executor ran though its id was not recorded: {r}");
        let events = places.audited(id);
        ensure!(events.iter().any(|e| e == "command_rejected"), "{id}: no command_rejected record: {events:?}");
        ensure!(!events.iter().any(|e| e == "executor_start"), "{id}: an executor_start record: {events:?}");
        ensure!(agent.running(), "the agent exited\n{}", agent.log_text());
    }
    Ok(())
}

/// The audit log cannot make a run's `executor_start` durable: the run fails and its
/// executor is never imported (its runtime waits for a `proceed` that never comes).
fn audit_write_error_keeps_the_executor_from_running(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "audit", |p, disk| p.audit = disk.join("audit/audit.jsonl"))?;
    let mut agent = Agent::start(ctx, &places)?;
    runs_first(ctx, &agent, "audit-before")?;
    disk.fail_writes()?;
    for id in ["audit-after-1", "audit-after-2"] {
        let (code, r) = agent.execute_mark(id)?;
        ensure!(
            code != 0 && r["status"] == "rejected" && r["reason"] == "cannot_run",
            "{id}: exit {code}, {r}\n{}",
            agent.log_text()
        );
        let error = r["error"].as_str().unwrap_or_default();
        let log = format!("audit log {}", places.audit.display());
        ensure!(error.contains(&log), "{id}: the rejection does not name the audit log: {r}");
        ensure!(marked(ctx).is_none(), "{id}: the mark executor ran though its start was not audited: {r}");
        ensure!(agent.running(), "the agent exited\n{}", agent.log_text());
    }
    // `ping` says so: failing since the first refusal, and a flush failed.
    let (code, pong) = agent.submit(&json!({"command_id": "audit-ping", "action": "ping"}))?;
    let health = &pong["output"]["audit"];
    ensure!(code == 0 && health["ok"] == false, "ping after the fault: exit {code}, {pong}");
    let said = |key: &str| health[key].as_str().is_some_and(|e| e.contains("Input/output error"));
    ensure!(said("error") && said("flush_failed"), "ping does not say the log's disk fails: {health}");
    Ok(())
}

/// As above, through `opservant run` (no daemon): it could not run, exit status 2.
fn cli_run_audit_write_error(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "cli", |p, disk| p.audit = disk.join("audit/audit.jsonl"))?;
    let (code, out, err) = places.op(&["run", "mark"])?;
    ensure!(code == 0, "before the fault: exit {code}\n{out}\n{err}");
    ensure!(marked(ctx).as_deref() == Some("1.0.0"), "before the fault the mark executor did not run: {out}");
    disk.fail_writes()?;
    let (code, out, err) = places.op(&["run", "mark"])?;
    ensure!(code == 2, "after the fault: exit {code}, not 2\nstdout: {out}\nstderr: {err}");
    let log = format!("audit log {}", places.audit.display());
    ensure!(err.contains(&log), "the error does not name the audit log: {err}");
    ensure!(marked(ctx).is_none(), "the mark executor ran though its start was not audited: {out}");
    Ok(())
}

/// The executors' disk refuses writes: installing version 2 fails (exit 2), saying its files
/// are not on the disk and nothing was switched; version 1 stays the one listed and run, and
/// is what a restart finds.
fn install_write_error_keeps_the_installed_version(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "install", |p, disk| p.executors = disk.join("executors"))?;
    installing_2_fails_and_1_runs(ctx, &places, &disk, "", &[])?;
    disk.remount_healed()?;
    let current = std::fs::read_link(places.executors.join("mark/current")).map_err(|e| format!("current: {e}"))?;
    ensure!(current == Path::new("1.0.0"), "after a restart `current` names {}", current.display());
    Ok(())
}

/// The disk fails; installing mark 2.0.0 (as `WRAPPER… opservant executor install`) then
/// exits 2 saying the executors' filesystem reported a write error (`how` follows those
/// words) and nothing was switched; `executor list` shows 1.0.0 alone and 1.0.0 is what
/// runs.
fn installing_2_fails_and_1_runs(
    ctx: &Ctx,
    places: &Places,
    disk: &FaultyDisk,
    how: &str,
    wrapper: &[&str],
) -> Result<(), String> {
    let marks = ctx.mark.parent().ok_or("the mark has no directory")?;
    let v2 = mark_package(&places.base, marks, &ctx.mark, "2.0.0")?;
    disk.fail_writes()?;
    let (code, out, err) = places.op_under(wrapper, &["executor", "install", &v2.display().to_string()], b"")?;
    ensure!(
        code == 2,
        "installing 2.0.0 on a disk that refuses writes: exit {code}, not 2\nstdout: {out}\nstderr: {err}"
    );
    ensure!(
        err.contains(&format!("the executors' filesystem reported a write error{how}"))
            && err.contains("mark 2.0.0 is not on the disk; nothing was switched"),
        "the install's error does not say the disk refused its files: {err}"
    );
    let list = places.op_ok(&["executor", "list"])?;
    ensure!(list.contains("1.0.0") && !list.contains("2.0.0"), "executor list after the failed install: {list}");
    let (code, out, err) = places.op(&["run", "mark"])?;
    ensure!(code == 0, "running the installed version: exit {code}\n{out}\n{err}");
    let ran = marked(ctx);
    ensure!(ran.as_deref() == Some("1.0.0"), "the version that ran is {ran:?}, not 1.0.0");
    Ok(())
}

/// As [`install_write_error_keeps_the_installed_version`], on a kernel release before 5.8 as
/// `uname` reports it (`setarch --uname-2.6`): `syncfs` did not report write-back errors
/// then, so the install `fsync`s each file and directory of the package instead, and the
/// first of those the disk refuses fails it, named. A restart finds 1.0.0 current.
fn install_before_5_8_write_error(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "pre58", |p, disk| p.executors = disk.join("executors"))?;
    let as_2_6 = ["setarch", std::env::consts::ARCH, "--uname-2.6"];
    let staged = format!(" (fsync {}/.staging-", places.executors.display());
    installing_2_fails_and_1_runs(ctx, &places, &disk, &staged, &as_2_6)?;
    disk.remount_healed()?;
    let current = std::fs::read_link(places.executors.join("mark/current")).map_err(|e| format!("current: {e}"))?;
    ensure!(current == Path::new("1.0.0"), "after a restart `current` names {}", current.display());
    Ok(())
}

/// As [`install_write_error_keeps_the_installed_version`], with the executors on an overlay
/// filesystem whose upper layer is on the failing disk (a container's or an image-based
/// host's root): the install's `syncfs` goes through the overlay, which must report the
/// upper filesystem's write-back errors for the install to fail.
fn install_on_overlayfs_write_error(ctx: &Ctx) -> Result<(), String> {
    let mut places = Places::new(ctx, "overlay");
    let disk = FaultyDisk::new(ctx, "overlay-disk")?;
    // The lower layer on a tmpfs of its own (not the guest's shared root), upper and work
    // directories on the disk.
    let (lower, merged) = (places.base.join("lower"), places.base.join("merged"));
    let (upper, work) = (disk.mount.join("upper"), disk.mount.join("work"));
    for d in [&lower, &merged, &upper, &work] {
        std::fs::create_dir_all(d).map_err(|e| format!("create {}: {e}", d.display()))?;
    }
    struct Unmount(Vec<PathBuf>);
    impl Drop for Unmount {
        fn drop(&mut self) {
            for m in &self.0 {
                let _ = sh(&format!("umount -l {}", m.display()));
            }
        }
    }
    sh_ok(&format!("mount -t tmpfs -o size=1m tmpfs {}", lower.display()))?;
    let mut mounted = Unmount(vec![lower.clone()]);
    sh_ok(&format!(
        "mount -t overlay overlay -o lowerdir={},upperdir={},workdir={} {}",
        lower.display(),
        upper.display(),
        work.display(),
        merged.display()
    ))?;
    mounted.0.insert(0, merged.clone());
    places.executors = merged.join("executors");
    places.write(ctx)?;
    ensure!(upper.join("executors/mark/1.0.0/manifest.json").is_file(), "1.0.0 is not in the overlay's upper layer");
    // Through the overlay's own `syncfs`.
    installing_2_fails_and_1_runs(ctx, &places, &disk, " (syncfs", &[])?;
    drop(mounted);
    Ok(())
}

/// The disk starts refusing writes during an install's switch — its package on the disk,
/// the marker of its switch on the disk, the package moved into place, `current` being
/// switched —: the install fails (exit 2), saying the new version is in place now but may
/// not be after a restart, and what then. A restart finds what a crash there leaves:
/// version 1 current, version 2 in place beside it, and the marker naming it. The agent's
/// start completes the switch, audited, and version 2 runs. `strace` stops the install
/// (SIGSTOP) just after it makes the new link and before it renames it over `current`, and
/// the disk fails meanwhile.
fn install_switch_write_error_says_what_a_restart_may_find(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "switch", |p, disk| p.executors = disk.join("executors"))?;
    let marks = ctx.mark.parent().ok_or("the mark has no directory")?;
    let v2 = mark_package(&places.base, marks, &ctx.mark, "2.0.0")?;
    let trace = places.base.join("install.strace");
    let mut cmd = Command::new("strace");
    cmd.args(["-qq", "-o", &trace.display().to_string(), "-e", "trace=?symlink,symlinkat"])
        .args(["-e", "inject=?symlink,symlinkat:signal=STOP", OPSERVANT])
        .args(["executor", "install", &v2.display().to_string(), "--config", &places.config().display().to_string()]);
    let install = guest::spawn(cmd, "strace opservant executor install")?;
    // Should the check fail before the install ends, strace and the install it holds stopped
    // are killed: they would keep the disk's mount busy.
    struct KillOnFailure(Vec<i32>);
    impl Drop for KillOnFailure {
        fn drop(&mut self) {
            for pid in &self.0 {
                // SAFETY: kill(2) with a signal number, on this check's own processes.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
        }
    }
    let mut on_failure = KillOnFailure(vec![install.id() as i32]);
    // Linting and precompiling the package in a sandbox take seconds under TCG first.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(&trace).unwrap_or_default().contains("stopped by SIGSTOP") {
        ensure!(Instant::now() < deadline, "the install never reached its switch");
        std::thread::sleep(Duration::from_millis(20));
    }
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", install.id()))
        .map_err(|e| format!("the install's pid: {e}"))?;
    let tracee: i32 = children.split_whitespace().next().and_then(|p| p.parse().ok()).ok_or("no traced install")?;
    on_failure.0.push(tracee);
    let marker = places.executors.join(".switch-mark");
    let named = std::fs::read_to_string(&marker).map_err(|e| format!("the switch marker: {e}"))?;
    let named: Value = serde_json::from_str(&named).map_err(|e| format!("the switch marker {named:?}: {e}"))?;
    ensure!(
        (&named["to"], &named["from"], &named["version"]) == (&json!("2.0.0"), &json!("1.0.0"), &json!("2.0.0")),
        "the switch marker says {named}"
    );
    ensure!(places.executors.join("mark/2.0.0").is_dir(), "2.0.0 was not moved into place before the switch");
    disk.fail_writes()?;
    // SAFETY: kill(2) with a signal number; `tracee` is the install strace started.
    ensure!(unsafe { libc::kill(tracee, libc::SIGCONT) } == 0, "SIGCONT the install");
    let out = guest::output_within(install, "strace opservant executor install")?;
    on_failure.0.clear();
    let (code, err) = (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned());
    ensure!(code == 2, "the install whose switch could not be flushed: exit {code}, not 2\nstderr: {err}");
    ensure!(
        err.contains("mark's `current` names 2.0.0 now but may not after a restart")
            && err.contains("the agent's start after it then completes the switch"),
        "the install's error does not say what a restart may find: {err}"
    );
    // As it says: 2.0.0 is what runs now…
    let current = || std::fs::read_link(places.executors.join("mark/current")).map_err(|e| format!("current: {e}"));
    ensure!(current()? == Path::new("2.0.0"), "before a restart `current` names {}", current()?.display());
    // …and a restart finds 1.0.0, the package and the marker — flushed before the fault
    // (see `FaultyDisk::fail_writes`), the marker's removal not —: what a crash in the
    // switch leaves.
    disk.remount_healed()?;
    ensure!(current()? == Path::new("1.0.0"), "after a restart `current` names {}", current()?.display());
    ensure!(marker.is_file(), "after a restart the switch marker is gone");
    ensure!(places.executors.join("mark/2.0.0/manifest.json").is_file(), "after a restart 2.0.0 is not in place");
    // The agent's start completes the switch, audited, before it takes a command: 2.0.0 runs.
    let agent = Agent::start(ctx, &places)?;
    ensure!(current()? == Path::new("2.0.0"), "after the agent's start `current` names {}", current()?.display());
    ensure!(!marker.exists(), "the switch marker stays after the agent's start");
    let (code, reply) = agent.execute_mark("switch-1")?;
    ensure!(code == 0 && reply["status"] == "completed", "running mark after the start: {code} {reply}");
    let ran = marked(ctx);
    ensure!(ran.as_deref() == Some("2.0.0"), "the version that ran is {ran:?}, not 2.0.0");
    let audit = std::fs::read_to_string(&places.audit).map_err(|e| format!("the audit log: {e}"))?;
    let events: Vec<Value> = audit.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let at = |pred: &dyn Fn(&Value) -> bool| events.iter().rposition(pred);
    let completed = at(&|e| e["event"] == "executor_installed" && e["fields"]["source"] == "recovery");
    let started = at(&|e| e["event"] == "agent_start");
    ensure!(
        matches!((completed, started), (Some(c), Some(s)) if c < s),
        "the completion is not audited before the agent's start: {completed:?}, {started:?}"
    );
    Ok(())
}

/// The executors' disk refuses writes: removing the executor fails (exit 2), saying it may
/// come back after a restart — and a restart finds it.
fn remove_write_error_fails_the_removal(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "remove", |p, disk| p.executors = disk.join("executors"))?;
    disk.fail_writes()?;
    let (code, out, err) = places.op(&["executor", "remove", "mark"])?;
    ensure!(code == 2, "removing on a disk that refuses writes: exit {code}, not 2\nstdout: {out}\nstderr: {err}");
    ensure!(err.contains("may come back after a restart"), "the removal's error does not say so: {err}");
    disk.remount_healed()?;
    let list = places.op_ok(&["executor", "list"])?;
    ensure!(list.contains("mark") && list.contains("1.0.0"), "after a restart the executor is not back: {list}");
    Ok(())
}

/// The secrets store's disk refuses writes: replacing a value fails, and the value stored
/// before is still the one read.
fn secrets_write_error_keeps_the_stored_value(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "secrets", |p, disk| {
        p.secrets = disk.to_path_buf();
        p.secrets_key = disk.to_path_buf();
    })?;
    let (code, out, err) = places.op_with_input(&["secrets", "set", "api_key"], b"value-one\n")?;
    ensure!(code == 0, "before the fault: secrets set exited {code}\n{out}\n{err}");
    disk.fail_writes()?;
    let (code, out, err) = places.op_with_input(&["secrets", "set", "api_key"], b"value-two\n")?;
    ensure!(
        code == 2,
        "replacing a value on a disk that refuses writes: exit {code}, not 2\nstdout: {out}\nstderr: {err}"
    );
    ensure!(err.contains("Input/output error"), "the error does not say the disk refused: {err}");
    let (code, out, err) = places.op(&["secrets", "get", "api_key"])?;
    ensure!(code == 0 && out == "value-one", "secrets get after the failed set: exit {code}, {out:?}\n{err}");
    disk.remount_healed()?;
    let (code, out, err) = places.op(&["secrets", "get", "api_key"])?;
    ensure!(code == 0 && out == "value-one", "secrets get after a restart: exit {code}, {out:?}\n{err}");
    Ok(())
}

/// The store's key on a disk that refuses writes, the store on a healthy one: the first
/// `secrets set` fails creating the key, and so does the next — a key that may not be on the
/// disk never encrypts a store that is. After a restart there is neither key nor store.
/// (Here the key's own `fsync` is what fails; its directory's failing alone, which
/// `secrets_store::write_new` also answers by taking the key back, cannot be placed with a
/// disk that refuses every write.)
fn secrets_key_write_error_leaves_no_key(ctx: &Ctx) -> Result<(), String> {
    let (places, disk) = on_a_faulty_disk(ctx, "secrets-key", |p, disk| p.secrets_key = disk.to_path_buf())?;
    disk.fail_writes()?;
    for attempt in ["first", "second"] {
        let (code, out, err) = places.op_with_input(&["secrets", "set", "api_key"], b"value-one\n")?;
        ensure!(code == 2, "the {attempt} set with the key's disk refusing writes: exit {code}, not 2\n{out}\n{err}");
        ensure!(err.contains("Input/output error"), "the {attempt} set's error does not say the disk refused: {err}");
        let key = places.secrets_key.join("secrets.key");
        ensure!(!key.exists(), "the {attempt} set left {} in place", key.display());
    }
    ensure!(!places.secrets.join("secrets.enc").exists(), "a store was written without a durable key");
    disk.remount_healed()?;
    ensure!(!places.secrets_key.join("secrets.key").exists(), "after a restart a key is there");
    Ok(())
}
