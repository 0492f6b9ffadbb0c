//! Hostile tests: every isolation promise of the sandbox, attacked from inside. Each test
//! also checks, where it can, that the host itself would have allowed the access (a
//! control), so a pass means the sandbox stopped it — not that the test could not succeed.

mod common;

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use common::{executor_ids, manifest, python, require_root, sandbox, sh, HostDir};

/// Generous CPU so the Python-based probes are not slowed by the 10 % default.
fn fast() -> (HostDir, std::path::PathBuf) {
    common::limits_manifest(r#"{"max_cpu_percent": 50}"#)
}

/// Wait (at most a minute: a hang detector, not a timing) until a sandbox made `path`.
fn wait_for_file(path: &std::path::Path, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !path.exists() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A mount the test made, detached when dropped.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// True when uid `uid` could read `path` on the host by plain DAC (no capabilities).
fn host_readable_by(path: &std::path::Path, uid: u32) -> bool {
    let out = Command::new("setpriv")
        .args(["--reuid", &uid.to_string(), "--regid", &uid.to_string(), "--clear-groups", "cat"])
        .arg(path)
        .output()
        .expect("setpriv");
    out.status.success()
}

/// A writable grant is a host directory, whose mount on the host need not be `nosuid`: a
/// set-user-ID file the payload left there would run as the executor's uid for any local
/// user who runs it (and that uid can trace every sandbox). No way of giving a file that bit
/// — `chmod`, `fchmod`, a mode at creation (`open`, `creat`), `mknod` — works; the same calls
/// with ordinary modes do, and so does set-group-ID (a filter cannot tell a file from a
/// directory, where `chmod g+w` of a group-shared one keeps it).
#[test]
fn a_payload_cannot_leave_setuid_files_on_the_host() {
    if !require_root() {
        return;
    }
    let rw = HostDir::new();
    rw.chown_to_executor();
    let m = manifest(&rw, &format!(r#"{{"filesystem": {{"write": ["{}"]}}}}"#, rw.str()), "{}");
    let code = format!(
        r#"import os, shutil, stat
d = {d:?}
shutil.copy("/usr/bin/id", d + "/id")
def tried(what, f):
    try:
        f()
        print(what, "done")
    except OSError as e:
        print(what, "refused", e.errno)
tried("chmod-suid", lambda: os.chmod(d + "/id", 0o4755))
fd = os.open(d + "/f", os.O_CREAT | os.O_WRONLY, 0o644)
tried("fchmod-suid", lambda: os.fchmod(fd, 0o4755))
os.close(fd)
tried("open-suid", lambda: os.close(os.open(d + "/o", os.O_CREAT | os.O_WRONLY, 0o4755)))
tried("mknod-suid", lambda: os.mknod(d + "/n", stat.S_IFREG | 0o4755))
tried("chmod-plain", lambda: os.chmod(d + "/id", 0o755))
os.mkdir(d + "/shared", 0o775)
tried("chmod-sgid-dir", lambda: os.chmod(d + "/shared", 0o2775))
"#,
        d = rw.str()
    );
    let r = python(Some(&m), &code);
    let out = r.stdout();
    for what in ["chmod-suid", "fchmod-suid", "open-suid", "mknod-suid"] {
        assert!(out.contains(&format!("{what} refused 1\n")), "{what}: {out} {}", r.err());
    }
    assert!(out.contains("chmod-plain done\n") && out.contains("chmod-sgid-dir done\n"), "{out} {}", r.err());
    for e in std::fs::read_dir(&rw.path).unwrap().flatten() {
        let mode = e.metadata().unwrap().permissions().mode();
        assert_eq!(mode & 0o4000, 0, "{} is {mode:o} on the host", e.path().display());
    }
    assert_eq!(std::fs::metadata(rw.path.join("id")).unwrap().permissions().mode() & 0o7777, 0o755);
}

/// Kernel allowances the kernel counts per host uid — here pipe buffer pages
/// (`fs.pipe-user-pages-soft`: past it, a user's new pipes get two pages and none may grow)
/// — are not shared between sandboxes: each runs as a host uid of its own while it lives
/// (`sandbox.host_uids`), so one that uses up its allowance leaves another's intact. The
/// control runs the same two sandboxes sharing the identity's uid (`host_uids: shared`):
/// there the second one's pipes shrink. The second sandbox's file in their write grant is
/// the identity's on the host — not its leased uid's — through the grant's idmapping.
#[test]
fn sandboxes_do_not_share_per_uid_kernel_allowances() {
    if !require_root() {
        return;
    }
    let soft: u64 = std::fs::read_to_string("/proc/sys/fs/pipe-user-pages-soft").unwrap().trim().parse().unwrap();
    let max: u64 = std::fs::read_to_string("/proc/sys/fs/pipe-max-size").unwrap().trim().parse().unwrap();
    assert!(soft > 0 && max >= 1 << 20, "this test needs fs.pipe-user-pages-soft > 0 and 1 MiB pipes");
    let shared = common::config_with("shared-uids", "sandbox:\n  host_uids: shared\n");
    let (uid, gid) = executor_ids();
    for per_sandbox in [true, false] {
        let dir = HostDir::new();
        dir.chown_to_executor();
        let m = manifest(
            &dir,
            &format!(r#"{{"filesystem": {{"write": ["{}"]}}}}"#, dir.str()),
            r#"{"max_cpu_percent": 50}"#,
        );
        let hog = format!(
            r#"import fcntl, os, time
d = {d:?}
pipes, refused = [], None
for i in range({n}):
    r, w = os.pipe()
    pipes.append((r, w))
    try:
        fcntl.fcntl(w, 1031, 1 << 20)
    except OSError as e:
        refused = e.errno
        break
open(d + "/ready", "w").close()
for _ in range(600):
    if os.path.exists(d + "/done"):
        break
    time.sleep(0.05)
print("hog", len(pipes), refused)
"#,
            d = dir.str(),
            n = soft / 256 + 8
        );
        let probe = format!(
            r#"import fcntl, os
d = {d:?}
r, w = os.pipe()
size = fcntl.fcntl(w, 1032)
try:
    fcntl.fcntl(w, 1031, 1 << 20)
    grown = "grown"
except OSError as e:
    grown = "refused %d" % e.errno
open(d + "/probe-file", "w").close()
open(d + "/done", "w").close()
print("probe", size, grown)
"#,
            d = dir.str()
        );
        let argv =
            |code: &str| ["/usr/bin/python3".to_string(), "-I".into(), "-S".into(), "-c".into(), code.to_string()];
        let run = |code: String, m: std::path::PathBuf, config: Option<std::path::PathBuf>| {
            std::thread::spawn(move || {
                let a = argv(&code);
                let a: Vec<&str> = a.iter().map(String::as_str).collect();
                match config {
                    Some(c) => common::try_sandbox_configured(&c, Some(&m), &a).unwrap(),
                    None => common::try_sandbox(Some(&m), &a).unwrap(),
                }
            })
        };
        let config = (!per_sandbox).then(|| shared.clone());
        let hog = run(hog, m.clone(), config.clone());
        wait_for_file(&dir.path.join("ready"), "the first sandbox never got its pipes");
        let probe = run(probe, m.clone(), config).join().unwrap();
        let hog = hog.join().unwrap();
        assert_eq!(hog.status(), "completed", "{}", hog.err());
        assert!(hog.stdout().ends_with(" 1\n"), "the first sandbox did not use up its allowance: {}", hog.stdout());
        let (a, b) = (&hog.json["sandbox"], &probe.json["sandbox"]);
        let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(dir.path.join("probe-file")).unwrap());
        assert_eq!(owner, uid, "a file the sandbox made in its write grant is not the identity's on the host");
        if per_sandbox {
            assert_eq!(probe.stdout(), "probe 65536 grown\n", "{}", probe.err());
            assert_eq!((a["host_uid_shared"].as_bool(), b["host_uid_shared"].as_bool()), (Some(false), Some(false)));
            assert_ne!(a["host_uid"], b["host_uid"]);
            for s in [a, b] {
                let h = s["host_uid"].as_u64().unwrap();
                assert!((1_900_000_000..1_900_065_536).contains(&h) && h != u64::from(uid), "{s}");
                assert_eq!((s["uid"].as_u64(), s["gid"].as_u64()), (Some(u64::from(uid)), Some(u64::from(gid))));
            }
        } else {
            assert_eq!(probe.stdout(), "probe 8192 refused 1\n", "the control did not share: {}", probe.err());
            assert_eq!((b["host_uid_shared"].as_bool(), b["host_uid"].as_u64()), (Some(true), Some(u64::from(uid))));
        }
    }
}

/// A declared path whose filesystem cannot be idmapped (ramfs): read-only, it is bound
/// without the sandbox's idmapping and the result says so — the identity's owner-only file
/// there is not the sandbox's (less access, never more); writable, the run is refused (exit
/// 2, naming the path): what the sandbox made there would be its leased uid's on disk, and
/// so the next sandbox's that leases the uid.
#[test]
fn a_path_that_cannot_be_idmapped_is_reported_and_grants_no_more() {
    if !require_root() {
        return;
    }
    let dir = HostDir::new();
    let ram = dir.path.join("ram");
    std::fs::create_dir(&ram).unwrap();
    nix::mount::mount(Some("ramfs"), &ram, Some("ramfs"), nix::mount::MsFlags::empty(), None::<&str>).unwrap();
    let _unmount = Unmount(ram.clone());
    let (uid, gid) = executor_ids();
    std::os::unix::fs::chown(&ram, Some(uid), Some(gid)).unwrap();
    std::fs::set_permissions(&ram, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(ram.join("own"), "mine").unwrap();
    std::os::unix::fs::chown(ram.join("own"), Some(uid), Some(gid)).unwrap();
    std::fs::set_permissions(ram.join("own"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let m = manifest(&dir, &format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, ram.display()), "{}");
    let r = sh(Some(&m), &format!("cat {r}/own; echo; ls {r}; echo rc=$?", r = ram.display()));
    assert_eq!(r.status(), "completed", "{}", r.err());
    let sb = &r.json["sandbox"];
    let listed = sb["not_idmapped"].as_array().cloned().unwrap_or_default();
    assert!(listed.len() == 1 && listed[0].as_str().unwrap().starts_with(&format!("{}: ", ram.display())), "{sb}");
    assert!(r.err().contains("Permission denied"), "the identity's file was readable: {} {}", r.stdout(), r.err());
    assert!(r.stdout().contains("own\nrc=0"), "the directory (others may read it) was not: {} {}", r.stdout(), r.err());
    let m = manifest(&dir, &format!(r#"{{"filesystem": {{"write": ["{}"]}}}}"#, ram.display()), "{}");
    let (code, err) = common::try_sandbox(Some(&m), &["/bin/true"]).unwrap_err();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("declared path {}", ram.display())) && err.contains("must be idmappable"), "{err}");
}

/// A path declared writable whose mount is read-only where the sandbox is built (under the
/// shipped systemd unit, any path outside its `ReadWritePaths=`: `ProtectSystem=strict`) is
/// refused, naming it — exit 2 — whether the agent prepares the bind (a host uid per
/// sandbox) or the sandbox's init makes it (`shared`); it was bound read-only, and the run
/// went on with its writes failing. Control: the same path, its mount writable, runs. A
/// socket granted for writing there is still connected to (a read-only mount does not stop
/// that), so its grant runs.
#[test]
fn a_write_grant_on_a_read_only_mount_is_refused_not_bound_read_only() {
    if !require_root() {
        return;
    }
    let dir = HostDir::new();
    let data = dir.path.join("data");
    std::fs::create_dir(&data).unwrap();
    let (uid, gid) = executor_ids();
    std::os::unix::fs::chown(&data, Some(uid), Some(gid)).unwrap();
    let m = manifest(&dir, &format!(r#"{{"filesystem": {{"write": ["{}"]}}}}"#, data.display()), "{}");
    let shared = common::config_with("ro-grant-shared", "sandbox:\n  host_uids: shared\n");
    // The tests' configuration (a host uid per sandbox: the agent prepares the bind), then
    // `shared` (init binds it).
    let configs = [None, Some(&shared)];
    let run = |config: Option<&common::TestConfig>, m: &std::path::Path, argv: &[&str]| match config {
        None => common::try_sandbox(Some(m), argv),
        Some(c) => common::try_sandbox_configured(c, Some(m), argv),
    };
    let write = ["/bin/sh", "-c", "echo x > \"$0\"/f && echo wrote", &data.join("").display().to_string()];
    for config in configs {
        let r =
            run(config, &m, &write).unwrap_or_else(|(code, err)| panic!("control ({config:?}): exit {code}: {err}"));
        assert!(r.stdout().contains("wrote"), "control ({config:?}): {} {}", r.stdout(), r.err());
    }
    let sock = data.join("sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    std::os::unix::fs::chown(&sock, Some(uid), Some(gid)).unwrap();
    let flags = nix::mount::MsFlags::MS_BIND;
    nix::mount::mount(Some(&data), &data, None::<&str>, flags, None::<&str>).unwrap();
    let _unmount = Unmount(data.clone());
    let ro = flags | nix::mount::MsFlags::MS_REMOUNT | nix::mount::MsFlags::MS_RDONLY;
    nix::mount::mount(None::<&str>, &data, None::<&str>, ro, None::<&str>).unwrap();
    for config in configs {
        let (code, err) = match run(config, &m, &write) {
            Err(e) => e,
            Ok(r) => panic!("a write grant on a read-only mount ran ({config:?}): {} {}", r.stdout(), r.err()),
        };
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains(&format!("declared path {} is writable in the manifest but read-only here", data.display())),
            "{err}"
        );
    }
    let m = manifest(&dir, &format!(r#"{{"filesystem": {{"write": ["{}"]}}}}"#, sock.display()), "{}");
    let code = format!("import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})\nprint('connected')", sock);
    let connect = ["/usr/bin/python3", "-I", "-S", "-c", code.as_str()];
    for config in configs {
        let r = run(config, &m, &connect).unwrap_or_else(|(code, err)| {
            panic!("a socket's grant on a read-only mount ({config:?}): exit {code}: {err}")
        });
        assert!(r.stdout().contains("connected"), "({config:?}): {} {}", r.stdout(), r.err());
    }
}

/// A sandbox abandoned with processes that cannot die (frozen here; in life stuck in the
/// kernel) keeps its host uid after the command that started it has given up and exited:
/// the next command is refused the range's only uid, and gets it once those processes are
/// gone and their cgroups removed.
#[test]
fn an_abandoned_sandboxs_uid_is_not_leased_while_its_processes_live() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    // Time for the freezer to find the sandbox asleep before the timeout.
    let said = stuck_sandboxs_uid_stays_held("abandoned-uid", 1_900_200_000, 10, |child| {
        let out = child.wait_with_output().unwrap();
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    });
    assert!(said.contains("had not exited 5 s after SIGKILL"), "{said}");
}

/// The same when the command holding the uid is killed outright (SIGKILL) while its
/// sandbox's processes cannot die: nothing of the command is left to hold the lease, but the
/// lease's marker names the sandbox's cgroups, and the uid is not leased while they hold a
/// process.
#[test]
fn a_killed_commands_uid_is_not_leased_while_its_sandboxs_processes_live() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    stuck_sandboxs_uid_stays_held("killed-uid", 1_900_300_000, 60, |mut child| {
        child.kill().unwrap();
        child.wait().unwrap();
        String::new()
    });
}

/// Start `opservant sandbox` (cold in every suite: the freezer finds a sandbox among the
/// command's descendants, and what is tested — the lease outliving the command — is the
/// same whatever started it) with a range of one uid from `base` and a timeout of
/// `timeout_seconds`, freeze its sandbox once asleep, and let `end` end the command (its
/// output returned). Then: the sandbox's cgroups are still there, the next command is
/// refused the uid while the frozen processes live, and gets it once they are thawed and
/// gone.
fn stuck_sandboxs_uid_stays_held(
    name: &str,
    base: u32,
    timeout_seconds: u32,
    end: impl FnOnce(std::process::Child) -> String,
) -> String {
    let first = base + std::process::id() % 1000;
    let one = common::config_with(name, &format!("sandbox:\n  host_uids: {{first: {first}, count: 1}}\n"));
    let (_d, m) = common::limits_manifest(&format!(r#"{{"timeout_seconds": {timeout_seconds}}}"#));
    let mut cmd = common::command();
    cmd.env("OPSERVANT_CONFIG", &one).arg("sandbox").arg("--manifest").arg(&m).args(["--launch", "cold"]);
    cmd.args(["--json", "--", "/bin/sleep", "60"]);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let (freezer, dirs) = common::freezer::freeze_sandbox_below_once_asleep(child.id() as i32);
    let said = end(child);
    let left: Vec<bool> = dirs.iter().map(|d| d.exists()).collect();
    let refused = common::try_sandbox_configured(&one, None, &["/bin/true"]);
    let thawed = freezer.thaw();
    assert!(left.iter().all(|l| *l), "control: the cgroups were not left behind: {dirs:?} {left:?}\n{said}");
    let err = match refused {
        Err((_, err)) => err,
        Ok(r) => panic!("the stuck sandbox's uid was leased again while its processes lived: {}\n{said}", r.json),
    };
    assert!(err.contains(&format!("every host uid of {first}-{first} is held")), "{err}");
    assert!(thawed, "the thawed sandbox processes never died");
    // Gone now: the next command removes the cgroups its dead starter left, and the uid is free.
    let again = common::try_sandbox_configured(&one, None, &["/bin/true"]).unwrap();
    assert_eq!((again.status(), again.json["sandbox"]["host_uid"].as_u64()), ("completed", Some(u64::from(first))));
    said
}

/// The view's mounts never propagate to the host, nor the host's into the view, even where
/// a declared path is on a shared mount (every mount of a systemd host is): a declared path
/// beneath another is a mount made inside the first one's bind, and must not appear on the
/// host (where each run would have copied all earlier ones: 1, 3, 7 … mounts); a mount the
/// host makes beneath a declared path while the sandbox runs is not in its view.
#[test]
fn mounts_never_propagate_between_the_view_and_a_shared_host_mount() {
    if !require_root() {
        return;
    }
    let dir = HostDir::new();
    let shared = dir.path.join("shared");
    std::fs::create_dir(&shared).unwrap();
    nix::mount::mount(Some("opsv-prop"), &shared, Some("tmpfs"), nix::mount::MsFlags::empty(), Some("size=1m"))
        .unwrap();
    let _unmount = Unmount(shared.clone());
    nix::mount::mount(None::<&str>, &shared, None::<&str>, nix::mount::MsFlags::MS_SHARED, None::<&str>).unwrap();
    let (outer, inner, later) = (shared.join("a"), shared.join("a/b"), shared.join("a/later"));
    for d in [&outer, &inner, &later] {
        std::fs::create_dir_all(d).unwrap();
    }
    let (uid, gid) = executor_ids();
    std::os::unix::fs::chown(&outer, Some(uid), Some(gid)).unwrap();
    let m = manifest(
        &dir,
        &format!(r#"{{"filesystem": {{"write": ["{}"], "read": ["{}"]}}}}"#, outer.display(), inner.display()),
        "{}",
    );
    let host_mounts = || {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.split(' ').nth(4).is_some_and(|p| p.starts_with(shared.to_str().unwrap())))
            .count()
    };
    let before = host_mounts();
    for _ in 0..3 {
        let r = sh(Some(&m), "true");
        assert_eq!(r.status(), "completed", "{}", r.err());
    }
    assert_eq!(host_mounts(), before, "the view's mounts reached the host");
    // Inward: a mount the host makes beneath the declared path once the sandbox runs.
    let ready = outer.join("ready");
    let script = format!(
        "touch {ready}; i=0; while [ ! -e {o}/go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; ls {l}",
        ready = ready.display(),
        o = outer.display(),
        l = later.display()
    );
    let mm = m.clone();
    let t = std::thread::spawn(move || sh(Some(&mm), &script));
    wait_for_file(&ready, "the sandbox never started");
    nix::mount::mount(Some("opsv-later"), &later, Some("tmpfs"), nix::mount::MsFlags::empty(), Some("size=1m"))
        .unwrap();
    std::fs::write(later.join("from-the-host"), "").unwrap();
    std::fs::write(outer.join("go"), "").unwrap();
    let r = t.join().unwrap();
    let _ = nix::mount::umount2(&later, nix::mount::MntFlags::MNT_DETACH);
    assert_eq!(r.status(), "completed", "{}", r.err());
    assert!(!r.stdout().contains("from-the-host"), "a host mount appeared in the view: {}", r.stdout());
}

/// A sandbox's host uid is its own only while no other sandbox holds it: with every uid of
/// the range held, a run is refused (no fall back to a shared uid), naming the range.
#[test]
fn a_sandbox_never_runs_on_a_host_uid_another_holds() {
    if !require_root() {
        return;
    }
    let one = common::config_with("one-uid", "sandbox:\n  host_uids: {first: 1900100000, count: 1}\n");
    let dir = HostDir::new();
    dir.chown_to_executor();
    let m = manifest(&dir, &format!(r#"{{"filesystem": {{"write": ["{}"]}}}}"#, dir.str()), "{}");
    let ready = dir.path.join("ready");
    let script = format!(
        "touch {r}; i=0; while [ ! -e {d}/done ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done",
        r = ready.display(),
        d = dir.str()
    );
    let (c, mm) = (one.clone(), m.clone());
    let holder = std::thread::spawn(move || common::try_sandbox_configured(&c, Some(&mm), &["/bin/sh", "-c", &script]));
    wait_for_file(&ready, "the first sandbox never started");
    let refused = common::try_sandbox_configured(&one, Some(&m), &["/bin/true"]);
    std::fs::write(dir.path.join("done"), "").unwrap();
    let held = holder.join().unwrap().unwrap();
    assert_eq!((held.status(), held.json["sandbox"]["host_uid"].as_u64()), ("completed", Some(1_900_100_000)));
    let err = match refused {
        Err((_, err)) => err,
        Ok(r) => r.json["error"].to_string(),
    };
    assert!(err.contains("every host uid of 1900100000-1900100000 is held by a running sandbox"), "{err}");
    // Released with its sandbox.
    let again = common::try_sandbox_configured(&one, Some(&m), &["/bin/true"]).unwrap();
    assert_eq!((again.status(), again.json["sandbox"]["host_uid"].as_u64()), ("completed", Some(1_900_100_000)));
}

/// A read grant never opens a channel to the host: a read-only bind stops writes to files,
/// not a `connect()` to a Unix socket nor opening a FIFO for writing (and this kernel's
/// Landlock lacks `resolve_unix`), so a host socket or FIFO declared readable — or the
/// host's runtime directory, where its daemons keep theirs — is refused before anything
/// runs. Declared writable, the socket is reachable, as granted.
#[test]
fn a_read_grant_does_not_reach_host_sockets_or_fifos() {
    if !require_root() {
        return;
    }
    let dir = HostDir::new();
    let sock_path = dir.path.join("s.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock_path).unwrap();
    std::fs::set_permissions(&sock_path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let fifo = dir.path.join("f.fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap();
    std::fs::set_permissions(&dir.path, std::fs::Permissions::from_mode(0o755)).unwrap();
    for (path, why) in [
        (sock_path.to_str().unwrap(), "is a Unix socket"),
        (fifo.to_str().unwrap(), "is a FIFO"),
        ("/run", "a directory of the host's runtime directory"),
        ("/var/run/dbus", "a directory of the host's runtime directory"),
    ] {
        let m = manifest(&dir, &format!(r#"{{"filesystem": {{"read": ["{path}"]}}}}"#), "{}");
        let (code, err) = common::try_sandbox(Some(&m), &["/bin/true"]).unwrap_err();
        assert_eq!(code, 2, "{path}: {err}");
        assert!(err.contains("permissions.filesystem.read[0]") && err.contains(why), "{path}: {err}");
    }
    // A regular file of the runtime directory is readable (a pidfile, `/run/utmp`).
    let file = std::path::PathBuf::from(format!("/run/opservant-test-{}.txt", std::process::id()));
    std::fs::write(&file, "run-file").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let m = manifest(&dir, &format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, file.display()), "{}");
    let r = sandbox(Some(&m), &["/bin/cat", file.to_str().unwrap()]);
    std::fs::remove_file(&file).unwrap();
    assert_eq!((r.status(), r.stdout()), ("completed", "run-file"), "{}", r.err());
    // Granted as a write (the socket the executor's user's alone, not every user's): the
    // payload talks to it.
    let (uid, gid) = executor_ids();
    std::os::unix::fs::chown(&sock_path, Some(uid), Some(gid)).unwrap();
    std::fs::set_permissions(&sock_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let server = std::thread::spawn(move || {
        let (mut c, _) = listener.accept().unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).unwrap();
        got
    });
    let m = manifest(&dir, &format!(r#"{{"filesystem": {{"write": ["{}"]}}}}"#, sock_path.display()), "{}");
    let script = format!(
        "import socket; s = socket.socket(socket.AF_UNIX); s.connect({:?}); s.sendall(b'hello'); s.close()",
        sock_path.to_str().unwrap()
    );
    let r = sandbox(Some(&m), &["/usr/bin/python3", "-I", "-S", "-c", &script]);
    assert_eq!(r.status(), "completed", "{}", r.err());
    assert_eq!(server.join().unwrap(), "hello");
}

/// A payload starts with every signal at its default and none blocked, in every launch mode —
/// including glibc's internal 32 and 33, which its `posix_spawn` (how the daemon starts a
/// zygote or a monitor) leaves ignored in the child, and an `execve` keeps ignored.
#[test]
fn a_payload_starts_with_no_signal_ignored_or_blocked() {
    if !require_root() {
        return;
    }
    let r = common::sandbox(None, &["/bin/grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"]);
    assert_eq!(r.status(), "completed", "{}", r.err());
    assert_eq!(r.stdout(), "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n", "{}", r.err());
}

#[test]
fn host_secrets_are_unreadable() {
    if !require_root() {
        return;
    }
    let (uid, _) = executor_ids();
    // Secrets in places a plain unprivileged user could read on the host.
    let tmp = HostDir::new_in("/tmp");
    let in_tmp = tmp.file("secret", "TOPSECRET-tmp", 0o644);
    let var = HostDir::new();
    let in_var = var.file("secret", "TOPSECRET-var", 0o644);
    let home = HostDir::new_in("/home");
    let in_home = home.file("secret", "TOPSECRET-home", 0o644);
    let root_file = std::path::PathBuf::from(format!("/root/opservant-test-{}", std::process::id()));
    std::fs::write(&root_file, "TOPSECRET-root").unwrap();
    std::fs::set_permissions(&root_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    // The agent's own configuration directory is masked even though /etc is visible. Other
    // tests' sandboxes must not start while /etc/opservant comes and goes.
    let view = common::HOST_VIEW.write().unwrap_or_else(|e| e.into_inner());
    let created_etc = !std::path::Path::new("/etc/opservant").exists();
    std::fs::create_dir_all("/etc/opservant").unwrap();
    let cfg = std::path::PathBuf::from(format!("/etc/opservant/test-secret-{}", std::process::id()));
    std::fs::write(&cfg, "TOPSECRET-config").unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions("/etc/opservant", std::fs::Permissions::from_mode(0o755)).unwrap();

    for p in [&in_tmp, &in_var, &in_home, &cfg] {
        assert!(host_readable_by(p, uid), "control: {} must be readable by uid {uid} on the host", p.display());
    }
    let script = [&in_tmp, &in_var, &in_home, &root_file, &cfg]
        .iter()
        .map(|p| format!("cat {} 2>&1 || true;", p.display()))
        .collect::<String>()
        + "cat /etc/shadow /etc/gshadow 2>&1 || true; ls /etc/opservant 2>&1 || true";
    drop(view);
    let r = sh(None, &script);
    let view = common::HOST_VIEW.write().unwrap_or_else(|e| e.into_inner());
    let _ = std::fs::remove_file(&root_file);
    let _ = std::fs::remove_file(&cfg);
    if created_etc {
        let _ = std::fs::remove_dir("/etc/opservant");
    }
    drop(view);
    assert!(!r.stdout().contains("TOPSECRET"), "a host secret leaked: {}", r.stdout());
    assert!(r.stdout().contains("/etc/shadow: Permission denied"), "{}", r.stdout());
    assert!(r.stdout().contains("cannot open directory '/etc/opservant': Permission denied"), "{}", r.stdout());
}

#[test]
fn declared_paths_get_exactly_the_declared_access() {
    if !require_root() {
        return;
    }
    let ro = HostDir::new();
    ro.file("in.txt", "readable", 0o666);
    let rw = HostDir::new();
    rw.chown_to_executor();
    let m =
        manifest(&rw, &format!(r#"{{"filesystem": {{"read": ["{}"], "write": ["{}"]}}}}"#, ro.str(), rw.str()), "{}");
    let r = sh(
        Some(&m),
        &format!(
            "cat {ro}/in.txt; echo; echo x > {ro}/in.txt 2>&1 || echo ro-write-refused; \
             touch {ro}/new 2>&1 || echo ro-create-refused; echo written > {rw}/out.txt && echo rw-ok",
            ro = ro.str(),
            rw = rw.str()
        ),
    );
    assert!(r.stdout().starts_with("readable\n"), "{}", r.stdout());
    assert!(r.stdout().contains("ro-write-refused") && r.stdout().contains("ro-create-refused"), "{}", r.stdout());
    assert!(r.stdout().contains("rw-ok"), "{} {}", r.stdout(), r.err());
    assert_eq!(std::fs::read_to_string(rw.path.join("out.txt")).unwrap(), "written\n");
    assert_eq!(std::fs::read_to_string(ro.path.join("in.txt")).unwrap(), "readable");
    assert!(!ro.path.join("new").exists());
}

/// A declaration cannot reach a path the policy refuses through a symlink: `/var/run` (a
/// link to `/run` on Debian) for writing, a link to `/etc/shadow` or to the masked
/// `/etc/ssh` for reading — each refused at validation (exit 2), naming the real path; and
/// declaring `/etc` itself keeps `/etc/shadow` and `/etc/ssh` covered.
#[test]
fn declarations_cannot_reach_refused_or_masked_paths_through_symlinks_or_parents() {
    if !require_root() {
        return;
    }
    let links = HostDir::new();
    std::os::unix::fs::symlink("/etc/shadow", links.path.join("shadow")).unwrap();
    std::os::unix::fs::symlink("/etc", links.path.join("etc")).unwrap();
    let mut cases = vec![
        (format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, links.path.join("shadow").display()), "/etc/shadow"),
        (format!(r#"{{"filesystem": {{"read": ["{}/ssh"]}}}}"#, links.path.join("etc").display()), "/etc/ssh"),
    ];
    if std::fs::read_link("/var/run").is_ok() {
        cases.push((r#"{"filesystem": {"write": ["/var/run"]}}"#.to_string(), "/run"));
    }
    for (perms, real) in cases {
        let m = manifest(&links, &perms, "{}");
        let (code, err) = common::try_sandbox(Some(&m), &["/bin/true"]).unwrap_err();
        assert_eq!(code, 2, "{perms}: {err}");
        assert!(err.contains("symlink") && err.contains(real), "{perms}: {err}");
    }
    // Declaring a parent does not uncover what is masked beneath it.
    let m = manifest(&links, r#"{"filesystem": {"read": ["/etc"]}}"#, "{}");
    let r = sh(
        Some(&m),
        "cat /etc/shadow 2>&1 | head -c 200; ls -A /etc/ssh 2>&1; cat /etc/hostname >/dev/null && echo etc-readable",
    );
    assert!(r.stdout().contains("etc-readable"), "{} {}", r.stdout(), r.err());
    assert!(!r.stdout().contains("root:"), "{}", r.stdout());
    assert!(!r.stdout().contains("ssh_config"), "{}", r.stdout());
}

#[test]
fn home_is_hidden_unless_declared() {
    if !require_root() {
        return;
    }
    let home = HostDir::new_in("/home");
    home.file("notes.txt", "declared-home", 0o644);
    let r = sh(None, &format!("cat {}/notes.txt 2>&1; ls /home 2>&1", home.str()));
    assert!(!r.stdout().contains("declared-home"), "{}", r.stdout());
    let m = manifest(&home, &format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, home.str()), "{}");
    let r = sh(Some(&m), &format!("cat {}/notes.txt", home.str()));
    assert_eq!(r.stdout(), "declared-home", "{}", r.err());
}

#[test]
fn system_directories_are_not_writable() {
    if !require_root() {
        return;
    }
    let targets = [
        "/etc/opservant-test",
        "/usr/opservant-test",
        "/usr/local/opservant-test",
        "/bin/opservant-test",
        "/opservant-test",
        "/run/opservant-test",
        "/proc/sys/kernel/hostname",
        "/proc/self/oom_score_adj",
        "/sys/kernel/opservant-test",
        "/dev/opservant-test",
        "/etc/passwd",
    ];
    let script: String =
        targets.iter().map(|t| format!("if echo x > {t} 2>/dev/null; then echo WROTE {t}; fi;")).collect();
    let r = sh(None, &script);
    assert_eq!(r.status(), "completed", "{}", r.err());
    assert!(!r.stdout().contains("WROTE"), "{}", r.stdout());
    assert!(!std::path::Path::new("/etc/opservant-test").exists() && !std::path::Path::new("/opservant-test").exists());
    // The agent binary is not even visible.
    let r = sh(None, &format!("ls {} 2>&1", common::opservant()));
    assert!(r.stdout().contains("No such file"), "{}", r.stdout());
}

/// The view's `/proc` is mounted read-only, so nothing there is written from inside —
/// refused by the mount (EROFS) before Landlock is even asked, so also where Landlock is not
/// enforced: not the payload's OOM score (which it could otherwise lower back to the floor
/// a privileged monitor set), not the user namespace's limits, not a sysctl. The sandbox's
/// own writes (the score at its maximum, the limits) went through a descriptor of the old
/// root's /proc, which is mounted nowhere in the view.
#[test]
fn proc_is_read_only_and_the_payload_is_the_first_oom_victim() {
    if !require_root() {
        return;
    }
    let (_d, m) = fast();
    let code = r#"import errno, os
print('score', open('/proc/self/oom_score_adj').read().strip())
print('userns', open('/proc/sys/user/max_user_namespaces').read().strip())
for path, value in [('self/oom_score_adj', '-1000'), ('self/oom_score_adj', '1000'),
                    ('sys/user/max_user_namespaces', '5'), ('sys/kernel/hostname', 'x'),
                    ('self/comm', 'x'), ('self/attr/current', 'x')]:
    try:
        fd = os.open('/proc/' + path, os.O_WRONLY)
        os.write(fd, value.encode())
        print('write', path, 'WROTE')
    except OSError as e:
        print('write', path, errno.errorcode.get(e.errno, e.errno))
procs = [l.split() for l in open('/proc/self/mountinfo') if ' - proc ' in l]
print('proc mounts', [(p[4], p[5].split(',')[0]) for p in procs])
"#;
    let r = python(Some(&m), code);
    assert_eq!(r.status(), "completed", "{}", r.err());
    let out = r.stdout();
    assert!(out.contains("score 1000\n"), "the payload is the OOM killer's first victim: {out}");
    assert!(out.contains("userns 0\n"), "the user namespace's limits were written: {out}");
    let writes: Vec<&str> = out.lines().filter(|l| l.starts_with("write ")).collect();
    assert_eq!(writes.len(), 6, "{out}");
    for w in writes {
        assert!(w.ends_with(" EROFS"), "refused by the read-only mount: {w}\n{out}");
    }
    assert!(out.contains("proc mounts [('/proc', 'ro')]"), "one procfs in the view, read-only: {out}");
}

/// Host-wide `/proc` entries a sandbox has no use for are masked (the sandbox's default
/// masked paths): per-CPU interrupt and softirq counts (a side channel on other processes'
/// activity), the kernel's keyrings, every file lock on the host (`locks`: the other
/// sandboxes' host uid leases, and a channel between sandboxes that share nothing), ACPI. Each is tried by its name and by ways around
/// it through the same procfs (`/proc/self/..`, the process's `root` link); everything else
/// of `/proc` stays readable. Control: each file is readable by the sandbox identity on the
/// host, and at least two of them are (nothing passes because nothing was tried).
#[test]
fn host_wide_proc_entries_are_masked() {
    if !require_root() {
        return;
    }
    let (uid, _) = executor_ids();
    // Every masked /proc file the sandbox identity could read on the host (the others need
    // no mask to stay unread): here interrupts, softirqs, keys, key-users and locks.
    let files: Vec<&str> = sandbox::spec::DEFAULT_MASKED_PATHS
        .iter()
        .filter_map(|p| p.strip_prefix("/proc/"))
        .filter(|f| !std::path::Path::new("/proc").join(f).is_dir())
        .filter(|f| host_readable_by(&std::path::Path::new("/proc").join(f), uid))
        .collect();
    assert!(files.len() >= 2, "control: host-readable masked /proc files: {files:?}");
    let acpi = std::path::Path::new("/proc/acpi").is_dir();
    let mut tries: Vec<String> = Vec::new();
    for f in &files {
        for prefix in ["/proc/", "/proc/self/../", "/proc/self/root/proc/", "/proc/thread-self/../../../"] {
            tries.push(format!("{prefix}{f}"));
        }
    }
    let code = format!(
        r#"import errno, os
for path in {tries:?}:
    try:
        open(path, 'rb').read(64)
        print('READ', path)
    except OSError as e:
        print(path, errno.errorcode.get(e.errno, e.errno))
if {acpi}:
    try:
        print('LISTED /proc/acpi', os.listdir('/proc/acpi'))
    except OSError as e:
        print('/proc/acpi', errno.errorcode.get(e.errno, e.errno))
for path in ['/proc/cpuinfo', '/proc/self/status', '/proc/meminfo']:
    print('control', path, len(open(path).read()) > 0)
"#,
        acpi = if acpi { "True" } else { "False" },
    );
    let (_d, m) = fast();
    let r = python(Some(&m), &code);
    assert_eq!(r.status(), "completed", "{}", r.err());
    let out = r.stdout();
    let lines: Vec<&str> = out.lines().collect();
    for t in &tries {
        assert!(lines.contains(&format!("{t} EACCES").as_str()), "{t} must be masked:\n{out}");
    }
    if acpi {
        assert!(lines.contains(&"/proc/acpi EACCES"), "/proc/acpi must be masked:\n{out}");
    }
    assert!(!out.contains("READ") && !out.contains("LISTED"), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("control ") && l.ends_with(" True")).count(), 3, "{out}");
}

#[test]
fn host_loopback_tcp_is_unreachable() {
    if !require_root() {
        return;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Control: reachable from the host.
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("control connect");
    let (_d, m) = fast();
    let r = python(
        Some(&m),
        &format!(
            "import socket\ns=socket.socket()\ntry:\n s.connect(('127.0.0.1',{port})); print('CONNECTED')\n\
             except OSError as e: print('refused', e.errno)\n\
             print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))"
        ),
    );
    assert!(r.stdout().contains("refused 111"), "ECONNREFUSED expected: {} {}", r.stdout(), r.err());
    assert!(r.stdout().contains("['lo']"), "only loopback exists: {}", r.stdout());
}

#[test]
fn network_namespace_is_fresh_with_only_a_working_loopback_and_not_the_sandboxs_to_configure() {
    if !require_root() {
        return;
    }
    let host_netns = std::fs::read_link("/proc/self/ns/net").unwrap();
    let (_d, m) = fast();
    // NS_GET_USERNS: the user namespace that owns the network namespace. A namespace the
    // sandbox created is its own user namespace's; one a zygote prepared is the host's, which
    // is outside the sandbox's scope (EPERM) — the sandbox never held a capability over it.
    let r = python(
        Some(&m),
        "import fcntl, os, socket\n\
         print('netns', os.readlink('/proc/self/ns/net'))\n\
         fd = os.open('/proc/self/ns/net', os.O_RDONLY)\n\
         try:\n owner = fcntl.ioctl(fd, 0xb701); print('owner', os.readlink('/proc/self/fd/%d' % owner) == os.readlink('/proc/self/ns/user'))\n\
         except OSError as e: print('owner-errno', e.errno)\n\
         print('ifaces', sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n\
         srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)\n\
         c = socket.create_connection(srv.getsockname()); a, _ = srv.accept(); c.sendall(b'ping'); print('loopback', a.recv(4).decode())\n\
         s6 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         try:\n s6.connect(('192.0.2.1', 9)); print('ROUTED')\n\
         except OSError as e: print('unroutable', e.errno)",
    );
    let out = r.stdout();
    assert_eq!(r.status(), "completed", "{out} {}", r.err());
    let netns = out.lines().find_map(|l| l.strip_prefix("netns ")).unwrap_or_default();
    assert!(netns.starts_with("net:[") && netns != host_netns.to_string_lossy(), "{netns} vs host {host_netns:?}");
    assert!(out.contains("ifaces ['lo']\n"), "only loopback: {out}");
    assert!(out.contains("loopback ping\n"), "loopback is up and carries traffic: {out}");
    assert!(out.contains("unroutable 101\n"), "no route anywhere but loopback (ENETUNREACH): {out}");
    let expected = match r.json["sandbox"]["netns"].as_str() {
        Some("created") => "owner True\n",
        Some("prepared") => "owner-errno 1\n",
        other => panic!("a private network namespace is expected, got {other:?}: {}", r.json),
    };
    assert!(out.contains(expected), "owner of the network namespace: expected {expected:?} in {out}");
}

#[test]
fn host_unix_sockets_are_unreachable() {
    if !require_root() {
        return;
    }
    let name = format!("opservant-test-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let _abstract = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    std::os::unix::net::UnixStream::connect_addr(&addr).expect("control: abstract socket reachable on the host");
    let dir = HostDir::new();
    let path = dir.path.join("sock");
    let _named = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
    let run_sock = format!("/run/{name}.sock");
    let _run = std::os::unix::net::UnixListener::bind(&run_sock).unwrap();
    std::fs::set_permissions(&run_sock, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (_d, m) = fast();
    let r = python(
        Some(&m),
        &format!(
            "import socket\nfor a in ['\\0{name}', '{}', '{run_sock}']:\n s=socket.socket(socket.AF_UNIX)\n \
             try:\n  s.connect(a); print('CONNECTED', repr(a))\n except OSError as e: print('refused', e.errno)",
            path.display()
        ),
    );
    let _ = std::fs::remove_file(&run_sock);
    assert!(!r.stdout().contains("CONNECTED"), "{}", r.stdout());
    assert_eq!(r.stdout().matches("refused").count(), 3, "{} {}", r.stdout(), r.err());
}

/// Landlock's abstract-socket scope, where nothing else stops the connection: the test binds
/// an abstract socket *inside the sandbox's own network namespace* (abstract names are per
/// network namespace, so one on the host is out of reach anyway) and the payload connects
/// to it — refused (`EPERM`) because the listener is outside its Landlock domain. Control: a
/// process outside Landlock in the same namespace connects.
#[test]
fn landlock_alone_refuses_an_abstract_socket_in_the_sandboxs_own_namespace() {
    if !require_root() {
        return;
    }
    let marker = format!("opservant-llabs-{}", std::process::id());
    let name = format!("opservant-llabs-{}", std::process::id());
    let (_d, m) = fast();
    let code = format!(
        r#"# {marker}
import signal, socket
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
print("waited", signal.sigtimedwait([signal.SIGUSR2], 60) is not None, flush=True)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\0{name}"); print("CONNECTED")
except OSError as e:
    print("refused", e.errno)
"#
    );
    let held = std::thread::spawn(move || python(Some(&m), &code));
    let Some(payload) = common::payload_waiting_for_a_signal(&marker, &held) else {
        panic!("the payload never waited: {:?}", held.join().map(|r| r.json));
    };
    // A listener in the sandbox's network namespace (root, no Landlock), and a control client
    // there; the listener accepts until it is told to stop.
    let netns = format!("--net=/proc/{payload}/ns/net");
    let listener = format!(
        "import socket, sys\ns = socket.socket(socket.AF_UNIX); s.bind('\\0{name}'); s.listen(8)\n\
         print('listening', flush=True)\nwhile True:\n c, _ = s.accept(); c.close()"
    );
    let mut server = Command::new("nsenter")
        .args([netns.as_str(), "/usr/bin/python3", "-I", "-S", "-c", &listener])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(server.stdout.take().unwrap()), &mut first).unwrap();
    assert_eq!(first, "listening\n");
    let control = Command::new("nsenter")
        .args([
            netns.as_str(),
            "/usr/bin/python3",
            "-I",
            "-S",
            "-c",
            &format!("import socket\ns = socket.socket(socket.AF_UNIX); s.connect('\\0{name}'); print('control-ok')"),
        ])
        .output()
        .unwrap();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(payload), nix::sys::signal::Signal::SIGUSR2);
    let r = held.join().unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(
        String::from_utf8_lossy(&control.stdout),
        "control-ok\n",
        "{}",
        String::from_utf8_lossy(&control.stderr)
    );
    assert_eq!(r.status(), "completed", "{} {}", r.stdout(), r.err());
    assert_eq!(r.stdout(), "waited True\nrefused 1\n", "Landlock's abstract-socket scope: {}", r.json);
    assert!(
        r.json["sandbox"]["landlock"]["scopes_enforced"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s == "abstract_unix_socket"),
        "{}",
        r.json
    );
}

#[test]
fn inherited_descriptors_are_closed() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let d = HostDir::new();
    let secret = d.file("fd-secret", "TOPSECRET-fd", 0o600);
    let file = std::fs::File::open(&secret).unwrap();
    use std::os::fd::AsRawFd;
    let raw = file.as_raw_fd();
    let mut cmd = common::command();
    cmd.arg("sandbox").args(common::launch_args()).args([
        "--json",
        "--",
        "/bin/sh",
        "-c",
        "ls -l /proc/self/fd; cat /proc/self/fd/7 2>&1; cat <&7 2>&1",
    ]);
    // SAFETY: dup2 is async-signal-safe; it puts the secret on fd 7 (without close-on-exec)
    // in the child only.
    unsafe {
        cmd.pre_exec(move || if libc::dup2(raw, 7) < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) });
    }
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    common::assert_launch(&j);
    let stdout = j["stdout"].as_str().unwrap();
    assert!(!stdout.contains("TOPSECRET"), "{stdout}");
    // `ls -l` lines end in "N -> target"; the sandbox's own channel (a socket) must not be
    // there either: a payload holding it could forge the sandbox's reports.
    let fds: Vec<(&str, &str)> =
        stdout.lines().filter_map(|l| l.split_once(" -> ")).map(|(a, t)| (a.rsplit(' ').next().unwrap(), t)).collect();
    let numbers: Vec<&str> = fds.iter().map(|(n, _)| *n).collect();
    assert_eq!(numbers, ["0", "1", "2", "3"], "stdio plus ls's own directory fd only: {stdout}");
    assert!(fds.iter().all(|(_, t)| !t.starts_with("socket:")), "no socket may be inherited: {stdout}");
    assert!(fds[3].1.ends_with("/fd"), "fd 3 is ls reading /proc/self/fd: {stdout}");
}

#[test]
fn host_processes_are_invisible() {
    if !require_root() {
        return;
    }
    // The probe assembles the marker at run time so its own command line does not contain it.
    let marker = format!("opservant-marker-{}", std::process::id());
    let (head, tail) = marker.split_at(10);
    let mut host = Command::new("/bin/sh").args(["-c", "sleep 30", &marker]).spawn().unwrap();
    // Control: visible on the host (once the child has exec'd).
    let visible = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(5));
        !common::host_processes_with(&marker).is_empty()
    });
    assert!(visible, "control: visible on the host");
    let (_d, m) = fast();
    let r = python(
        Some(&m),
        &format!(
            "import os\npids=[p for p in os.listdir('/proc') if p.isdigit()]\nprint(len(pids))\n\
             m='{head}'+'{tail}'\nseen=[p for p in pids if m in open('/proc/'+p+'/cmdline').read()]\nprint('seen', seen)\n\
             try:\n os.kill({host}, 0); print('SIGNALLED')\nexcept OSError as e: print('kill', e.errno)\n\
             for f in ('/proc/1/environ', '/proc/1/mem', '/proc/1/root/etc/hostname'):\n try:\n  open(f,'rb').read(1); print('READ', f)\n except OSError as e: print(f, e.errno)",
            host = host.id()
        ),
    );
    let _ = host.kill();
    let _ = host.wait();
    let lines: Vec<&str> = r.stdout().lines().collect();
    assert!(lines[0].parse::<u32>().unwrap() <= 3, "only init, the payload and its own processes: {}", r.stdout());
    assert_eq!(lines[1], "seen []");
    assert_eq!(lines[2], "kill 3", "ESRCH: the host pid does not exist inside");
    // The sandbox init (forked from opservant) is not readable by the payload.
    assert_eq!(&lines[3..], ["/proc/1/environ 13", "/proc/1/mem 13", "/proc/1/root/etc/hostname 13"], "{}", r.stdout());
}

#[test]
fn privileges_are_gone() {
    if !require_root() {
        return;
    }
    let r = sh(None, "ulimit -c; ulimit -n; cat /proc/self/status; cat /proc/self/uid_map /proc/self/gid_map; cat /proc/self/setgroups");
    let s = r.stdout();
    assert!(s.starts_with("0\n1024\n"), "no core dumps, bounded descriptors: {s}");
    for key in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        let line = s.lines().find(|l| l.starts_with(key)).unwrap();
        assert!(line.ends_with("0000000000000000"), "{line}");
    }
    assert!(s.contains("NoNewPrivs:\t1"));
    assert!(s.contains("Seccomp:\t2"));
    let (uid, gid) = executor_ids();
    assert!(s.contains(&format!("Uid:\t{uid}\t{uid}\t{uid}\t{uid}")), "{s}");
    assert!(s.contains(&format!("Gid:\t{gid}\t{gid}\t{gid}\t{gid}")), "{s}");
    let groups = s.lines().find(|l| l.starts_with("Groups:")).unwrap();
    assert_eq!(groups.trim_start_matches("Groups:").trim(), "", "no supplementary groups: {s}");
    let maps: Vec<String> = s
        .lines()
        .filter(|l| l.split_whitespace().count() == 3)
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert!(
        maps.contains(&format!("{uid} {uid} 1")) && maps.contains(&format!("{gid} {gid} 1")),
        "single-id maps: {maps:?}"
    );
    assert!(s.trim_end().ends_with("deny"), "setgroups denied");
}

#[test]
fn setuid_binaries_and_setuid_calls_gain_nothing() {
    if !require_root() {
        return;
    }
    let d = HostDir::new();
    let id = d.path.join("suid-id");
    std::fs::copy("/usr/bin/id", &id).unwrap();
    std::fs::set_permissions(&id, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let (uid, _) = executor_ids();
    // Control: on the host the setuid bit makes an unprivileged user root.
    let out = Command::new("setpriv")
        .args(["--reuid", &uid.to_string(), "--regid", &uid.to_string(), "--clear-groups"])
        .arg(&id)
        .arg("-u")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0", "control: setuid works on the host");
    let m = manifest(&d, &format!(r#"{{"filesystem": {{"read": ["{}"]}}}}"#, d.str()), r#"{"max_cpu_percent": 50}"#);
    let r = sandbox(Some(&m), &[id.to_str().unwrap(), "-u"]);
    assert_eq!(r.stdout().trim(), uid.to_string(), "setuid bit ignored inside");
    let r = python(
        Some(&m),
        "import os\nfor f,a in [(os.setuid,0),(os.setgid,0),(os.setgroups,[0]),(os.seteuid,0)]:\n try:\n  f(a); print('GAINED')\n except OSError as e: print(e.errno)",
    );
    assert!(!r.stdout().contains("GAINED"), "{}", r.stdout());
    // uid/gid 0 are not mapped in the user namespace (EINVAL); setgroups is denied (EPERM).
    assert_eq!(r.stdout().lines().collect::<Vec<_>>(), ["22", "22", "1", "22"], "{} {}", r.stdout(), r.err());
}

#[test]
fn only_harmless_device_nodes_exist() {
    if !require_root() {
        return;
    }
    let (_d, m) = fast();
    let r = python(
        Some(&m),
        "import os, stat\nprint(sorted(os.listdir('/dev')))\n\
         for kind in (stat.S_IFCHR, stat.S_IFBLK):\n try:\n  os.mknod('/tmp/opservant/scratch/dev', kind|0o666, os.makedev(1, 1)); print('MADE')\n except OSError as e: print(e.errno)\n\
         print(open('/dev/zero','rb').read(4), open('/dev/null','w').write('x'))",
    );
    let mut lines = r.stdout().lines();
    assert_eq!(
        lines.next().unwrap(),
        "['fd', 'full', 'null', 'random', 'shm', 'stderr', 'stdin', 'stdout', 'urandom', 'zero']",
        "{}",
        r.err()
    );
    assert_eq!(lines.next(), Some("1"), "mknod char: EPERM");
    assert_eq!(lines.next(), Some("1"), "mknod block: EPERM");
    assert_eq!(lines.next(), Some("b'\\x00\\x00\\x00\\x00' 1"), "the allowed devices work");
}

#[test]
fn hostname_is_private_and_fixed() {
    if !require_root() {
        return;
    }
    let before = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let (_d, m) = fast();
    let r = python(
        Some(&m),
        "import socket\nprint(socket.gethostname())\ntry:\n socket.sethostname('pwned'); print('SET')\nexcept OSError as e: print(e.errno)",
    );
    assert_eq!(r.stdout(), "opservant\n1\n", "{}", r.err());
    assert_eq!(std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(), before);
}

#[test]
fn environment_is_an_explicit_allowlist() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let out = common::command()
        .arg("sandbox")
        .args(common::launch_args())
        .args(["--json", "--", "/usr/bin/env"])
        .env("OPSERVANT_TEST_SECRET", "TOPSECRET-env")
        .env("AWS_SECRET_ACCESS_KEY", "TOPSECRET-aws")
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    common::assert_launch(&j);
    let mut keys: Vec<&str> = j["stdout"].as_str().unwrap().lines().map(|l| l.split('=').next().unwrap()).collect();
    keys.sort();
    assert_eq!(keys, ["HOME", "LANG", "PATH", "TMPDIR"]);
}

#[test]
fn landlock_refuses_what_the_mount_view_alone_would_allow() {
    if !require_root() {
        return;
    }
    // Control: an unprivileged process may rename itself through /proc/self/comm and signal
    // another process of its own uid.
    let (uid, _) = executor_ids();
    let out = Command::new("setpriv")
        .args(["--reuid", &uid.to_string(), "--regid", &uid.to_string(), "--clear-groups", "/bin/sh", "-c"])
        .arg("echo renamed > /proc/self/comm && echo comm-ok; sleep 5 & kill -0 $! && echo signal-ok; kill $!")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "comm-ok\nsignal-ok\n", "control");
    let (_d, m) = fast();
    let r = python(
        Some(&m),
        "import os\ntry:\n open('/proc/self/comm','w').write('renamed'); print('WROTE')\nexcept OSError as e: print('comm', e.errno)\n\
         try:\n os.kill(1, 0); print('SIGNALLED')\nexcept OSError as e: print('init', e.errno)",
    );
    let ll = &r.json["sandbox"]["landlock"];
    // The view's /proc is read-only (see `proc_is_read_only_and_the_payload_is_the_first_oom_victim`),
    // so the mount refuses the rename first (EROFS); Landlock, whose /proc rule is read-only,
    // refused it with EACCES while that mount was read-write. Signalling the sandbox's init
    // stays Landlock's alone (its signal scope): nothing else in the view stops it.
    assert_eq!(r.stdout().lines().next(), Some("comm 30"), "EROFS from the /proc mount: {}", r.stdout());
    // Without the signal scope (Landlock ABI < 6) the result must say so, and then nothing
    // else in the view stops the signal.
    let scoped = ll["scopes_enforced"].as_array().unwrap().iter().any(|s| s == "signal");
    let expected = if scoped { "init 1" } else { "SIGNALLED" };
    assert_eq!(r.stdout().lines().nth(1), Some(expected), "signal scoping ({ll})");
    assert_eq!(scoped, sandbox::landlock::probe().abi >= 6, "the scope is enforced wherever the kernel has it: {ll}");
}

/// The privileges and process rows' promises, from inside: the securebits that keep root
/// from regaining capabilities are set and locked (`PR_GET_SECUREBITS`: 0xef — NOROOT,
/// NO_SETUID_FIXUP and NO_CAP_AMBIENT_RAISE with their locks, KEEP_CAPS off and locked);
/// `RLIMIT_MEMLOCK` is 0, so `mlock`, `mlockall` and `MAP_LOCKED` fail; the payload leads a
/// session of its own, with no controlling terminal. Control: the same probe on the host
/// (root) sees no securebits and locks memory.
#[test]
fn securebits_memory_locks_and_the_session_hold_from_inside() {
    if !require_root() {
        return;
    }
    let probe = r#"import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
print('securebits', hex(libc.prctl(27, 0, 0, 0, 0)))
buf = ctypes.create_string_buffer(4096)
print('mlock', libc.mlock(buf, 4096), ctypes.get_errno())
print('mlockall', libc.mlockall(1), ctypes.get_errno())
libc.munlockall()
libc.mmap.restype = ctypes.c_void_p
p = libc.mmap(None, 4096, 3, 0x22 | 0x2000, -1, 0)
print('map_locked', p == ctypes.c_void_p(-1).value, ctypes.get_errno())
print('leader', os.getsid(0) == os.getpid())
try:
    open('/dev/tty'); print('tty open')
except OSError as e:
    print('tty', e.errno)
"#;
    let host = Command::new("/usr/bin/python3").args(["-I", "-S", "-c", probe]).stdin(Stdio::null()).output().unwrap();
    let (host, host_err) = (String::from_utf8_lossy(&host.stdout), String::from_utf8_lossy(&host.stderr));
    assert!(
        host.starts_with("securebits 0x0\nmlock 0 0\nmlockall 0 0\nmap_locked False"),
        "control: {host} {host_err}"
    );
    let (_d, m) = fast();
    let r = python(Some(&m), probe);
    assert_eq!(r.status(), "completed", "{} {}", r.stdout(), r.err());
    // EPERM (1) or ENOMEM (12) for a zero RLIMIT_MEMLOCK, by call; EAGAIN (11) for MAP_LOCKED.
    let out = r.stdout();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "securebits 0xef", "{out}");
    assert!(matches!(lines[1], "mlock -1 1" | "mlock -1 12"), "{out}");
    assert!(matches!(lines[2], "mlockall -1 1" | "mlockall -1 12"), "{out}");
    assert!(matches!(lines[3], "map_locked True 11" | "map_locked True 1"), "{out}");
    assert_eq!(lines[4], "leader True", "{out}");
    assert!(lines[5] == "tty 6" || lines[5] == "tty 2", "no controlling terminal: {out}");
}

#[test]
fn ipc_objects_of_the_host_are_invisible() {
    if !require_root() {
        return;
    }
    let out = Command::new("ipcmk").args(["-Q"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let qid = text.split_whitespace().last().unwrap().to_string();
    let host = Command::new("ipcs").arg("-q").output().unwrap();
    assert!(String::from_utf8_lossy(&host.stdout).contains(&format!(" {qid} ")), "control: the queue exists");
    let r = sh(None, "ipcs -q");
    let _ = Command::new("ipcrm").args(["-q", &qid]).output();
    assert_eq!(r.status(), "completed", "{} {}", r.stdout(), r.err());
    assert!(r.stdout().contains("------ Message Queues"), "ipcs ran: {}", r.stdout());
    assert!(!r.stdout().contains(&format!(" {qid} ")), "{}", r.stdout());
}

#[test]
fn scratch_is_private_per_run_and_destroyed() {
    if !require_root() {
        return;
    }
    let r = sh(
        None,
        "echo leftover > /tmp/opservant/scratch/file && echo wrote-scratch; echo shm > /dev/shm/x && echo wrote-shm; pwd; echo $HOME",
    );
    assert_eq!(r.stdout(), "wrote-scratch\nwrote-shm\n/tmp/opservant/scratch\n/tmp/opservant/scratch\n", "{}", r.err());
    let r = sh(None, "ls -A /tmp/opservant/scratch /dev/shm");
    assert_eq!(r.stdout(), "/dev/shm:\n\n/tmp/opservant/scratch:\n", "nothing survives between runs");
}

#[test]
fn stdin_is_empty_and_no_terminal_is_reachable() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let mut child = common::command()
        .arg("sandbox")
        .args(common::launch_args())
        .args(["--json", "--", "/bin/sh", "-c", "cat; ls -d /dev/tty 2>&1; ls -d /dev/pts 2>&1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"SHOULD-NOT-ARRIVE").unwrap();
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    child.wait().unwrap();
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    common::assert_launch(&j);
    let s = j["stdout"].as_str().unwrap();
    assert!(!s.contains("SHOULD-NOT-ARRIVE"), "{s}");
    assert_eq!(s.lines().filter(|l| l.contains("No such file")).count(), 2, "neither /dev/tty nor /dev/pts: {s}");
}

/// What the kernel queues on a netlink socket — a route dump's replies, up to the receive
/// buffer of each of 1024 descriptors per process — is charged to no memory cgroup: a
/// review held ~100 MB of the host's kernel memory from 500 sockets under a 64 MB limit,
/// reported as a 5 MB peak (with `net.core.rmem_max` at 4 MB, 40 sockets held 212 MB). No
/// sandbox has a netlink socket at all; `egress::allowed_host_and_port_are_reachable` checks
/// a run with network egress.
#[test]
fn netlink_sockets_cannot_hold_memory_outside_the_limit() {
    if !require_root() {
        return;
    }
    let (_d, m) = fast();
    let probe = "import socket\n\
         for proto in (0, 4, 15):\n\
         \x20   try:\n\
         \x20       socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, proto); print('opened', proto)\n\
         \x20   except OSError as e:\n\
         \x20       print('refused', proto, e.errno)";
    let r = common::python(Some(&m), probe);
    let out = r.stdout();
    assert_eq!(r.status(), "completed", "{out} {}", r.err());
    for proto in [0, 4, 15] {
        assert!(out.contains(&format!("refused {proto} 97\n")), "netlink protocol {proto} must be refused: {out}");
    }
}

/// A network namespace prepared by a zygote (or pool) is owned by the host user namespace,
/// and the kernel broadcasts device uevents (`NETLINK_KOBJECT_UEVENT`) into every such
/// namespace: the seccomp profile refuses that protocol in every launch mode. Control: a
/// host socket receives the uevents of a loop device attached and detached meanwhile.
#[test]
fn host_device_uevents_are_not_received() {
    if !require_root() {
        return;
    }
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let (_d, m) = fast();
    let probe = "import socket, sys, time\n\
         try:\n s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)\n\
         except OSError as e:\n print('socket-errno', e.errno); sys.exit(0)\n\
         s.bind((0, 1)); s.settimeout(0.2); print('OPENED', flush=True)\n\
         n = 0; end = time.time() + 4\n\
         while time.time() < end:\n try: s.recv(8192); n += 1\n except socket.timeout: pass\n\
         print('received', n)\n\
         r = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0); print('route-ok')";
    let sandboxed = std::thread::spawn(move || python(Some(&m), probe));
    // Host control: a uevent listener of our own, then a loop device attach/detach.
    // SAFETY: socket(2) returns a new descriptor or -1; we own it from here.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 15) };
    assert!(fd >= 0, "host uevent socket: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let host = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_nl is plain old data; all-zero is valid.
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    sa.nl_groups = 1;
    // SAFETY: `sa` is a valid sockaddr_nl of the given length.
    let rc = unsafe {
        libc::bind(
            host.as_raw_fd(),
            std::ptr::addr_of!(sa).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "bind host uevent socket: {}", std::io::Error::last_os_error());
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let dir = HostDir::new();
    let img = dir.file("loop.img", "", 0o600);
    std::fs::File::options().write(true).open(&img).unwrap().set_len(1 << 20).unwrap();
    let out = Command::new("losetup").args(["-f", "--show"]).arg(&img).output().expect("losetup");
    assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let _ = Command::new("losetup").args(["-d", &dev]).status();
    let mut buf = [0u8; 8192];
    // SAFETY: `buf` is a writable buffer of the given length; MSG_DONTWAIT never blocks.
    let n = unsafe { libc::recv(host.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    assert!(n > 0, "control: the host receives a uevent of {dev}");
    let r = sandboxed.join().unwrap();
    let out = r.stdout();
    assert_eq!(r.status(), "completed", "{out} {}", r.err());
    // EAFNOSUPPORT from the filter that refuses netlink altogether (the last filter's errno
    // is the one seen; the default profile alone says EPERM to every protocol but
    // NETLINK_ROUTE).
    assert!(out.contains("socket-errno 97\n"), "NETLINK_KOBJECT_UEVENT must be refused: {out}");
}
