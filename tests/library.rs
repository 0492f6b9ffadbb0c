//! The `sandbox` library as a multi-threaded program (the agent) uses it: the monitor is a
//! fresh `execve` of the opservant binary (`Launcher::Exec`), not a fork of the caller.
//! Covers what the CLI does not: the exec launcher, the namespace hook, an opt-in fresh
//! sysfs, and teardown when a running sandbox is dropped; and, through a zygote, who holds
//! the sandbox's mount namespace at its end.

mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::require_root;
use sandbox::{Identity, Launcher, OutputOptions, Sandbox, SandboxSpec};

fn launcher() -> Launcher {
    Launcher::new(common::opservant(), &[OsStr::new("__sandbox-init")]).unwrap()
}

/// A zygote of the built `opservant-runtime` (not yet started).
fn runtime_zygote() -> sandbox::zygote::Zygote {
    let runtime = Path::new(common::opservant()).with_file_name("opservant-runtime");
    sandbox::zygote::Zygote::new(
        std::ffi::CString::new(runtime.as_os_str().as_encoded_bytes()).unwrap(),
        vec![std::ffi::CString::new("--zygote").unwrap()],
    )
    .expecting(agent::app::BUILD.as_bytes().to_vec())
}

/// `sb.wait()` on a thread of its own: the test waits for the outcome (`Debug` text, or the
/// error's) with a hang detector.
fn wait_elsewhere(sb: Sandbox) -> std::sync::mpsc::Receiver<Result<String, String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(sb.wait(OutputOptions::default()).map(|o| format!("{o:?}")).map_err(|e| e.to_string()));
    });
    rx
}

/// The next sandbox this process makes removes the sandbox cgroups `dirs` left behind.
fn assert_removed_by_the_next_sandbox(dirs: &[std::path::PathBuf]) {
    let o = sandbox::run(&spec(&["/bin/true"]), &launcher(), OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
    for d in dirs {
        assert!(!d.exists(), "{} still left behind after a later sandbox was made", d.display());
    }
}

fn spec(argv: &[&str]) -> SandboxSpec {
    let mut s = SandboxSpec::new(
        argv[0],
        argv[1..].iter().map(|a| a.to_string()).collect(),
        Identity::default_executor().unwrap(),
    );
    s.seccomp = sandbox::seccomp::default_policy().unwrap();
    s.limits.memory_bytes = Some(128 << 20);
    s.limits.pids = Some(64);
    s.limits.cpu_percent = Some(50);
    s.limits.timeout_ms = Some(30_000);
    s
}

fn stdout(o: &sandbox::Outcome) -> String {
    String::from_utf8_lossy(&o.stdout.bytes).into_owned()
}

#[test]
fn exec_launcher_runs_a_fully_isolated_payload() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let o = sandbox::run(
        &spec(&["/bin/sh", "-c", "id -u; cat /proc/self/status | grep -E '^(Seccomp|NoNewPrivs):'; ls /proc/self/fd"]),
        &launcher(),
        OutputOptions::default(),
    )
    .unwrap();
    assert!(o.success(), "{o:?}");
    let (uid, _) = common::executor_ids();
    assert_eq!(stdout(&o), format!("{uid}\nNoNewPrivs:\t1\nSeccomp:\t2\n0\n1\n2\n3\n"));
    assert_eq!(o.enforcement.namespaces.len(), 7);
    assert!(o.enforcement.capabilities_dropped && o.enforcement.no_new_privs);
    assert_eq!(o.enforcement.sysfs, "none");
}

#[test]
fn namespace_hook_sees_the_sandbox_namespaces() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let own_net = std::fs::read_link("/proc/self/ns/net").unwrap();
    let mut seen = None;
    let mut hook = |monitor: &sandbox::MonitorProc<'_>| -> Result<(), String> {
        let pid = monitor.pid();
        let net = std::fs::read_link(format!("/proc/{pid}/ns/net")).map_err(|e| e.to_string())?;
        let held = monitor.namespace("net").map_err(|e| e.to_string())?;
        let through_dir = std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&held)))
            .map_err(|e| e.to_string())?;
        assert_eq!(through_dir, net, "the namespace opened through the monitor's /proc/PID");
        let uid_map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).map_err(|e| e.to_string())?;
        seen = Some((net, uid_map));
        Ok(())
    };
    let sb = Sandbox::spawn(&spec(&["/bin/true"]), &launcher(), Some(&mut hook)).unwrap();
    let o = sb.wait(OutputOptions::default()).unwrap();
    assert!(o.success());
    let (net, uid_map) = seen.expect("hook called");
    assert_ne!(net, own_net, "the hook runs with the sandbox's own network namespace in place");
    let (uid, _) = common::executor_ids();
    assert_eq!(
        uid_map.split_whitespace().collect::<Vec<_>>(),
        [uid.to_string(), uid.to_string(), "1".into()],
        "maps are written before the hook"
    );
}

#[test]
fn a_failing_hook_aborts_the_sandbox() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let mut hook = |_: &sandbox::MonitorProc<'_>| -> Result<(), String> { Err("wiring failed".into()) };
    match Sandbox::spawn(&spec(&["/bin/true"]), &launcher(), Some(&mut hook)) {
        Err(sandbox::SandboxError::Hook(m)) => assert_eq!(m, "wiring failed"),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("a failed hook must stop the sandbox"),
    }
}

#[test]
fn fresh_sysfs_on_request_is_private_and_read_only() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    // Control: the host has firmware tables in its sysfs; the sandbox's are masked.
    assert!(std::fs::read_dir("/sys/firmware").unwrap().next().is_some(), "control: /sys/firmware");
    let mut s = spec(&[
        "/bin/sh",
        "-c",
        "ls /sys/class/net; echo x > /sys/kernel/uevent_helper 2>&1 || echo refused; \
         ls /sys/firmware >/dev/null 2>&1 && echo FIRMWARE-LISTED; ls -d /sys/kernel >/dev/null && echo sysfs-readable",
    ]);
    s.filesystem.sysfs = true;
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    assert_eq!(o.enforcement.sysfs, "fresh");
    assert_eq!(stdout(&o).lines().next(), Some("lo"), "only the sandbox's own interfaces: {}", stdout(&o));
    assert!(stdout(&o).contains("refused"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("FIRMWARE-LISTED"), "/sys/firmware is masked: {}", stdout(&o));
    assert!(stdout(&o).contains("sysfs-readable"), "{}", stdout(&o));
}

/// Declared paths are bound only when no component is a symlink (a link swapped in after
/// the agent's policy checked the path fails the run), and masks hold beneath a declared
/// parent: a masked directory and a masked file under a declared directory stay covered
/// (the mask was applied first, then bound over).
#[test]
fn declared_paths_are_never_bound_through_symlinks_and_masks_hold_beneath_them() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let dir = common::HostDir::new_in("/var/tmp");
    let d = |p: &str| dir.path.join(p);
    dir.dir("tree/hidden");
    dir.dir("tree/shown/inner");
    dir.file("tree/hidden/secret", "s3cret", 0o644);
    dir.file("tree/secret-file", "s3cret", 0o644);
    dir.file("tree/shown/inner/visible", "ok", 0o644);
    std::os::unix::fs::symlink(d("tree"), d("link")).unwrap();
    let read = |path: std::path::PathBuf| sandbox::PathRule {
        source: Some(path.clone()),
        path,
        access: sandbox::Access::Read,
        optional: false,
        identity: None,
    };

    // An exact source with a symlink in it fails the build; the same path as a plain rule
    // (no source) follows the link inside the host root.
    let mut s = spec(&["/bin/true"]);
    s.filesystem.paths.push(read(d("link/shown")));
    let e = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap_err().to_string();
    assert!(e.contains("symlink") && e.contains("link/shown"), "{e}");
    let mut s = spec(&["/bin/cat", &d("link/shown/inner/visible").display().to_string()]);
    s.filesystem.paths.push(sandbox::PathRule { source: None, ..read(d("link/shown")) });
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    assert_eq!(stdout(&o), "ok");
    // A source bound at another path: its content, there.
    let mut s = spec(&["/bin/cat", &d("elsewhere/inner/visible").display().to_string()]);
    s.filesystem.paths.push(sandbox::PathRule { path: d("elsewhere"), ..read(d("tree/shown")) });
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    assert_eq!(stdout(&o), "ok");

    let mut s = spec(&[
        "/bin/sh",
        "-c",
        &format!(
            "cd {}; cat hidden/secret secret-file linked-secret 2>/dev/null; ls hidden 2>&1 | head -1; cat shown/inner/visible",
            d("tree").display()
        ),
    ]);
    s.filesystem.paths.push(read(d("tree")));
    s.filesystem.paths.push(read(d("tree/shown/inner")));
    // A masked path that is a symlink in the view masks what it leads to.
    dir.file("tree/linked-secret", "s3cret", 0o644);
    std::os::unix::fs::symlink("linked-secret", d("tree/secret-link")).unwrap();
    s.filesystem.masked.extend([d("tree/hidden"), d("tree/secret-file"), d("tree/secret-link")]);
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    let out = stdout(&o);
    assert!(!out.contains("s3cret"), "a mask beneath a declared directory was uncovered: {out}");
    assert!(out.contains("Permission denied"), "{out}");
    assert!(out.ends_with("ok"), "{out}");
}

/// A declared path with the identity the caller checked is bound only while it names that
/// file: a package directory removed and made again at the same path (as a remove and a
/// reinstall of the same version do) between the caller's check and the build fails the
/// build, naming the path; with the new directory's identity, the new files are shown.
#[test]
fn a_path_replaced_since_the_caller_checked_it_is_not_bound() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let dir = common::HostDir::new_in("/var/tmp");
    let d = |p: &str| dir.path.join(p);
    dir.dir("pkg");
    dir.file("pkg/code", "old", 0o644);
    let id = |p: &std::path::Path| sandbox::FileId::of(&std::fs::metadata(p).unwrap());
    let checked = id(&d("pkg"));
    std::fs::rename(d("pkg"), d("pkg.removed")).unwrap();
    dir.dir("pkg");
    dir.file("pkg/code", "new", 0o644);
    let rule = |identity| sandbox::PathRule {
        source: None,
        path: d("pkg"),
        access: sandbox::Access::Read,
        optional: false,
        identity: Some(identity),
    };
    let mut s = spec(&["/bin/cat", &d("pkg/code").display().to_string()]);
    s.filesystem.paths.push(rule(checked));
    let e = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap_err().to_string();
    assert!(e.contains("replaced since") && e.contains(&d("pkg").display().to_string()), "{e}");
    s.filesystem.paths[0] = rule(id(&d("pkg")));
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    assert_eq!(stdout(&o), "new");
}

/// The view never creates anything on the host: a declared path that does not exist in
/// the view beneath a writable host directory bound there (here: bound at another path
/// than its source) fails the build instead of having its mount point made in the host
/// directory, as does one reached through a symlink a payload left there.
/// A declared path: the host's `source` (exactly, no symlink in it) at `path` in the view.
fn rule(source: &std::path::Path, path: std::path::PathBuf, access: sandbox::Access) -> sandbox::PathRule {
    sandbox::PathRule { source: Some(source.to_path_buf()), path, access, optional: false, identity: None }
}

#[test]
fn mount_points_are_never_created_in_host_directories() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let dir = common::HostDir::new_in("/var/tmp");
    let d = |p: &str| dir.path.join(p);
    let rw = common::HostDir::new_in("/var/tmp");
    rw.chown_to_executor();
    std::fs::create_dir_all(d("src")).unwrap();
    std::fs::set_permissions(d("src"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let listing = |p: &std::path::Path| {
        let mut names: Vec<String> =
            std::fs::read_dir(p).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    };

    let mut s = spec(&["/bin/true"]);
    s.filesystem.paths.push(rule(&rw.path, rw.path.clone(), sandbox::Access::ReadWrite));
    s.filesystem.paths.push(rule(&d("src"), rw.path.join("new/deeper"), sandbox::Access::Read));
    let e = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap_err().to_string();
    assert!(e.contains("new") && e.contains("on the host"), "{e}");
    assert_eq!(listing(&rw.path), Vec::<String>::new(), "the view created its mount point on the host");

    // A symlink in the writable directory that leads (in the half-built view) into the old root.
    std::os::unix::fs::symlink("/.oldroot/var/tmp", rw.path.join("escape")).unwrap();
    let mut s = spec(&["/bin/true"]);
    s.filesystem.paths.push(rule(&rw.path, rw.path.clone(), sandbox::Access::ReadWrite));
    let planted = format!("opservant-test-planted-{}", std::process::id());
    s.filesystem.paths.push(rule(&d("src"), rw.path.join("escape").join(&planted), sandbox::Access::Read));
    let e = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap_err().to_string();
    let host = std::path::Path::new("/var/tmp").join(&planted);
    let created = host.exists();
    let _ = std::fs::remove_dir(&host);
    assert!(!created, "the view created {} on the host", host.display());
    assert!(e.contains("on the host"), "{e}");
}

/// A mount target is never reached through a symlink in a host directory: a link that
/// another sandbox sharing a writable directory swaps in (here: planted before the run)
/// would otherwise place a declared bind elsewhere in the view — here on `/tmp/planted`.
#[test]
fn a_mount_target_is_never_reached_through_a_symlink_in_a_host_directory() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let dir = common::HostDir::new_in("/var/tmp");
    let rw = common::HostDir::new_in("/var/tmp");
    rw.chown_to_executor();
    let src = dir.path.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::set_permissions(&src, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::write(src.join("marker"), "declared").unwrap();
    std::os::unix::fs::symlink("/tmp", rw.path.join("link")).unwrap();
    let mut s = spec(&["/bin/sh", "-c", "cat /tmp/planted/marker"]);
    s.filesystem.paths.push(rule(&rw.path, rw.path.clone(), sandbox::Access::ReadWrite));
    s.filesystem.paths.push(rule(&src, rw.path.join("link/planted"), sandbox::Access::Read));
    let r = sandbox::run(&s, &launcher(), OutputOptions::default());
    let e = match r {
        Ok(o) => panic!("the view was built through the symlink: {:?}", stdout(&o)),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("is a symlink in a host directory"), "{e}");

    // Nor through one in a directory the sandbox identity owns but has made read-only for
    // itself (with a group the sandbox's user namespace does not map, so no capability of
    // init's applies to it): its owner can make it writable again at any moment.
    let owned_dir = rw.path.join("mine");
    std::fs::create_dir(&owned_dir).unwrap();
    std::os::unix::fs::symlink("/tmp", owned_dir.join("link")).unwrap();
    let id = sandbox::Identity::default_executor().unwrap();
    std::os::unix::fs::chown(&owned_dir, Some(id.host_uid), Some(0)).unwrap();
    std::fs::set_permissions(&owned_dir, std::os::unix::fs::PermissionsExt::from_mode(0o555)).unwrap();
    let mut s = spec(&["/bin/sh", "-c", "cat /tmp/planted/marker"]);
    s.filesystem.paths.push(rule(&rw.path, rw.path.clone(), sandbox::Access::ReadWrite));
    s.filesystem.paths.push(rule(&src, owned_dir.join("link/planted"), sandbox::Access::Read));
    let r = sandbox::run(&s, &launcher(), OutputOptions::default());
    std::fs::set_permissions(&owned_dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let e = match r {
        Ok(o) => panic!("the view was built through a link in a directory the sandbox owns: {:?}", stdout(&o)),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("is a symlink in a host directory"), "{e}");
}

/// A symlink in a host directory no sandbox can change (root's, mode 0755) is followed on
/// the way to a mount target (a distribution's `/etc/ssl/certs -> /etc/pki/tls/certs`, say).
#[test]
fn a_mount_target_is_reached_through_a_symlink_only_root_can_change() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let dir = common::HostDir::new_in("/var/tmp");
    let host = common::HostDir::new_in("/var/tmp");
    std::fs::create_dir_all(host.path.join("real/sub")).unwrap();
    std::os::unix::fs::symlink("real", host.path.join("link")).unwrap();
    let src = dir.path.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("marker"), "declared").unwrap();
    for p in [&dir.path, &host.path, &src, &host.path.join("real"), &host.path.join("real/sub")] {
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(src.join("marker"), std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let shown = host.path.join("real/sub/marker");
    let mut s = spec(&["/bin/cat", shown.to_str().unwrap()]);
    s.filesystem.paths.push(rule(&host.path, host.path.clone(), sandbox::Access::Read));
    s.filesystem.paths.push(rule(&src, host.path.join("link/sub"), sandbox::Access::Read));
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
    assert_eq!(stdout(&o), "declared");
}

/// Every bind of the view carries its flags from the start: a declared read path and a
/// synthetic file read-only, nosuid, nodev; a declared read-write path nosuid, nodev (they are
/// set on the detached clone before it is attached, so no path is resolved in between).
#[test]
fn binds_are_nosuid_nodev_and_read_only_as_declared() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let ro = common::HostDir::new_in("/var/tmp");
    let rw = common::HostDir::new_in("/var/tmp");
    rw.chown_to_executor();
    let synthetic = std::path::PathBuf::from(format!("/opservant-test-{}/synthetic.conf", std::process::id()));
    // Masks beneath the writable directory (a directory and a file), and a declared path
    // beneath the masked directory (its mount point made in the mask's own tmpfs).
    // A masked directory nothing is placed beneath is covered by a sealed clone of the
    // view's empty cover directory instead.
    let (hidden, hidden_file, shown) =
        (rw.path.join("hidden"), rw.path.join("hidden-file"), rw.path.join("hidden/shown"));
    let hidden_bare = rw.path.join("hidden-bare");
    std::fs::create_dir_all(&shown).unwrap();
    std::fs::create_dir_all(&hidden_bare).unwrap();
    std::fs::write(&hidden_file, "s3cret").unwrap();
    let mut s = spec(&["/bin/cat", "/proc/self/mountinfo"]);
    s.filesystem.paths.push(rule(&ro.path, ro.path.clone(), sandbox::Access::Read));
    s.filesystem.paths.push(rule(&rw.path, rw.path.clone(), sandbox::Access::ReadWrite));
    s.filesystem.paths.push(rule(&ro.path, shown.clone(), sandbox::Access::Read));
    s.filesystem.masked.extend([hidden.clone(), hidden_file.clone(), hidden_bare.clone()]);
    s.filesystem.synthetic.push(sandbox::SyntheticFile { path: synthetic.clone(), content: "x\n".into() });
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
    let info = stdout(&o);
    let line = |mount_point: &std::path::Path| -> &str {
        info.lines()
            .find(|l| l.split(' ').nth(4) == mount_point.to_str())
            .unwrap_or_else(|| panic!("{} is not a mount point in the view:\n{info}", mount_point.display()))
    };
    let options = |mount_point: &std::path::Path| -> Vec<String> {
        line(mount_point).split(' ').nth(5).unwrap().split(',').map(String::from).collect()
    };
    for (path, mode) in [
        (&ro.path, "ro"),
        (&rw.path, "rw"),
        (&synthetic, "ro"),
        (&hidden, "ro"),
        (&hidden_file, "ro"),
        (&hidden_bare, "ro"),
        (&shown, "ro"),
    ] {
        let o = options(path);
        assert!(
            o.contains(&mode.to_string()) && o.contains(&"nosuid".to_string()) && o.contains(&"nodev".to_string()),
            "{}: {o:?}",
            path.display()
        );
    }
    assert!(options(&hidden).contains(&"noexec".to_string()), "{info}");
    assert!(options(&hidden_bare).contains(&"noexec".to_string()), "{info}");
    let source = |mount_point: &std::path::Path| {
        line(mount_point).split(" - ").nth(1).unwrap().split(' ').take(2).collect::<Vec<_>>().join(" ")
    };
    assert_eq!(source(&hidden), "tmpfs opservant-mask", "{info}");
    // Kernels before 5.12 (no `mount_setattr`) give every masked directory a tmpfs.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse::<u32>().ok());
    if (numbers.next().unwrap(), numbers.next().unwrap()) >= (5, 12) {
        assert_eq!(source(&hidden_bare), "tmpfs opservant-root", "{info}");
        assert_eq!(line(&hidden_bare).split(' ').nth(3), Some("/.inaccessible-dir//deleted"), "{info}");
    } else {
        assert_eq!(source(&hidden_bare), "tmpfs opservant-mask", "{info}");
    }
}

/// A mask is placed as a mount target is: through a symlink only where no sandbox can have
/// put it. A link in a host directory a sandbox can change (planted here before the run; a
/// sandbox sharing the directory could swap one in while another builds its view) fails the
/// view instead of moving the mask onto whatever the link leads to — here the view's own
/// `/usr`, which the old code covered with the mask's empty directory.
#[test]
fn a_mask_is_never_placed_through_a_symlink_in_a_host_directory() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let rw = common::HostDir::new_in("/var/tmp");
    rw.chown_to_executor();
    std::os::unix::fs::symlink("/usr", rw.path.join("link")).unwrap();
    for masked in [rw.path.join("link/lib"), rw.path.join("link")] {
        let mut s = spec(&["/bin/true"]);
        s.filesystem.paths.push(rule(&rw.path, rw.path.clone(), sandbox::Access::ReadWrite));
        s.filesystem.masked.push(masked.clone());
        let e = match sandbox::run(&s, &launcher(), OutputOptions::default()) {
            Ok(o) => panic!("the mask {} was placed through the symlink: {o:?}", masked.display()),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("is a symlink in a host directory"), "{e}");
    }
}

/// A mask reached through a link no sandbox can have put there (a root-owned, mode-0755
/// host directory) covers what the link leads to with a tmpfs of its own, so a declared
/// path beneath the link's target is shown on top of it — and reached through it: the
/// mask's tmpfs is search-only. Which declared paths lie beneath a linked mask cannot be
/// told from their names (covered by the shared read-only cover directory, the view failed:
/// the mount point could not be made there); with a mode-000 mask the declared path was
/// mounted but no path led to it.
#[test]
fn a_mask_through_a_fixed_link_still_shows_declared_paths_beneath_its_target() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let dir = common::HostDir::new_in("/var/tmp");
    dir.dir("real/shown");
    let hidden = dir.file("real/hidden", "s3cret", 0o644);
    let visible = dir.file("real/shown/visible", "ok", 0o644);
    std::os::unix::fs::symlink("real", dir.path.join("link")).unwrap();
    let script = format!("cat {} 2>&1; cat {}", hidden.display(), visible.display());
    let mut s = spec(&["/bin/sh", "-c", &script]);
    s.filesystem.paths.push(rule(&dir.path, dir.path.clone(), sandbox::Access::Read));
    s.filesystem.paths.push(rule(&dir.path.join("real/shown"), dir.path.join("real/shown"), sandbox::Access::Read));
    s.filesystem.masked.push(dir.path.join("link"));
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
    let out = stdout(&o);
    assert!(
        !out.contains("s3cret") && (out.contains("No such file") || out.contains("Permission denied")),
        "the link's target is masked: {out}"
    );
    assert!(out.ends_with("ok"), "the declared path beneath it is shown: {out}");
}

/// A synthetic file at a path the view holds as a symlink copied from the host (as a
/// systemd-resolved host's /etc/resolv.conf) replaces the link; the bind never follows it.
#[test]
fn a_synthetic_file_replaces_a_copied_symlink() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let dir = common::HostDir::new_in("/var/tmp");
    std::os::unix::fs::symlink("../elsewhere/stub.conf", dir.path.join("resolv.conf")).unwrap();
    let path = dir.path.join("resolv.conf");
    let mut s = spec(&["/bin/cat", path.to_str().unwrap()]);
    s.filesystem.system.push(sandbox::PathRule {
        source: None,
        path: path.clone(),
        access: sandbox::Access::Read,
        optional: false,
        identity: None,
    });
    s.filesystem.synthetic.push(sandbox::SyntheticFile { path, content: "nameserver 10.0.0.1\n".into() });
    let o = sandbox::run(&s, &launcher(), OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
    assert_eq!(stdout(&o), "nameserver 10.0.0.1\n");
}

#[test]
fn dropping_a_running_sandbox_tears_it_down() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let marker = format!("opservant-drop-{}", std::process::id());
    let sb = Sandbox::spawn(&spec(&["/bin/sh", "-c", "sleep 1000; :", &marker]), &launcher(), None).unwrap();
    let monitor = sb.monitor_pid();
    let start = Instant::now();
    while common::host_processes_with(&marker).is_empty() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!common::host_processes_with(&marker).is_empty(), "payload started");
    drop(sb);
    assert!(common::host_processes_with(&marker).is_empty(), "payload killed on drop");
    assert!(!std::path::Path::new(&format!("/proc/{monitor}")).exists(), "monitor reaped, no zombie");
}

/// The first child of `pid` (its main thread's), if any.
fn first_child(pid: i32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?.split_whitespace().next()?.parse().ok()
}

#[test]
fn a_sandbox_whose_monitor_dies_dies_with_it() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    // The monitor killed alone (as a terminal's Ctrl-C or hangup does to the CLI's process
    // group, with the CLI gone before its cleanup): init, and with it every process of the
    // sandbox, dies too — also a payload that ignores every signal it can. Init's death
    // signal was cleared by its change of ids, and the sandbox ran on unsupervised.
    let s = spec(&["/bin/sh", "-c", "trap '' INT HUP TERM QUIT; while :; do sleep 1; done"]);
    let sb = Sandbox::spawn(&s, &launcher(), None).unwrap();
    let monitor = sb.monitor_pid();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (init, payload) = loop {
        if let Some(init) = first_child(monitor) {
            if let Some(payload) = first_child(init) {
                break (init, payload);
            }
        }
        assert!(std::time::Instant::now() < deadline, "the sandbox did not start");
        std::thread::sleep(Duration::from_millis(5));
    };
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(monitor), nix::sys::signal::SIGKILL).unwrap();
    let gone = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map_or(true, |st| st.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !(gone(init) && gone(payload)) {
        assert!(std::time::Instant::now() < deadline, "init {init} or payload {payload} outlived the monitor");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(sb);
}

/// Bits of `/proc/PID/status`'s `field` (a hex signal mask), or 0.
fn signal_mask(pid: i32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| u64::from_str_radix(l.strip_prefix(field)?.strip_prefix(':')?.trim(), 16).ok())
        .unwrap_or(0)
}

/// One sandbox whose init is held (SIGSTOP) while it builds the sandbox, and stopped — by
/// its stop handle, or by its timeout — meanwhile. `None` when init could not be caught
/// before it forked the payload; otherwise the outcome (`Debug` text, or the error's).
fn stopped_during_setup(by_timeout: bool) -> Option<Result<String, String>> {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let marker = format!("opservant-early-stop-{}", std::process::id());
    let mut s = spec(&["/bin/sh", "-c", "echo ran; sleep 1000; :", &marker]);
    if by_timeout {
        s.limits.timeout_ms = Some(300);
    }
    let sb = Sandbox::spawn(&s, &launcher(), None).unwrap();
    let monitor = sb.monitor_pid();
    let stop = sb.stop_handle();
    let outcome = wait_elsewhere(sb);
    let deadline = Instant::now() + Duration::from_secs(10);
    // (A timeout that expired before init was forked ends the sandbox without one: this
    // attempt does not count.)
    let init = loop {
        if let Some(init) = first_child(monitor) {
            break Some(init);
        }
        if !std::path::Path::new(&format!("/proc/{monitor}")).exists() {
            break None;
        }
        assert!(Instant::now() < deadline, "the monitor forked no init");
    };
    let Some(init) = init.filter(|&i| kill(Pid::from_raw(i), Signal::SIGSTOP).is_ok()) else {
        let _ = outcome.recv_timeout(Duration::from_secs(30));
        return None;
    };
    // Held before its step 8, or too late for this attempt?
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{init}/stat")).unwrap_or_default().contains(") T ") {
        assert!(Instant::now() < deadline, "init {init} did not stop");
        std::thread::yield_now();
    }
    let early = first_child(init).is_none();
    // The waiting thread takes init's pid from the monitor's report; then the stop (or the
    // timeout's SIGTERM) goes to init, which is to keep it pending.
    std::thread::sleep(Duration::from_millis(100));
    let sent = if by_timeout { Signal::SIGTERM } else { sandbox::init::KILL_ALL };
    if !by_timeout {
        stop.stop();
    }
    // Bounded below the 1 s backstop after a stop, which would kill the held init outright.
    let deadline = Instant::now() + Duration::from_millis(600);
    while signal_mask(init, "ShdPnd") & (1 << (sent as i32 - 1)) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    kill(Pid::from_raw(init), Signal::SIGCONT).unwrap();
    let outcome = outcome.recv_timeout(Duration::from_secs(30)).expect("the sandbox ended");
    assert!(common::host_processes_with(&marker).is_empty(), "nothing of the sandbox survives");
    early.then_some(outcome)
}

#[test]
fn a_stop_or_a_timeout_during_setup_is_kept_and_the_payload_never_starts() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    // PID 1 of a namespace drops a signal it neither handles nor blocks. Init blocks the
    // signals it acts on from its fork on, so one sent while it builds the sandbox stays
    // pending; before, it was dropped, the payload started and ran until the backstop.
    for by_timeout in [false, true] {
        let expected = if by_timeout {
            "the timeout expired before the payload started"
        } else {
            "the sandbox was stopped before the payload started"
        };
        let mut caught = 0;
        for _ in 0..20 {
            if let Some(outcome) = stopped_during_setup(by_timeout) {
                caught += 1;
                match outcome {
                    Err(e) => assert!(e.contains(expected), "{e}"),
                    Ok(o) => panic!("the payload started after a stop during setup: {o}"),
                }
                if caught == 3 {
                    break;
                }
            }
        }
        assert!(caught > 0, "init was never caught before its payload's fork (by_timeout {by_timeout})");
    }
}

#[test]
fn a_held_payload_runs_only_after_the_go() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let mut s = spec(&["/bin/sh", "-c", "echo ran; ls /proc/self/fd"]);
    s.command.held = true;
    let zygote = std::sync::Arc::new(runtime_zygote());
    let through_zygote = Launcher::Zygote { zygote, end: sandbox::PayloadEnd::Exec };
    // Pooled, a sandbox reports `pool` however it was started — but one its caller had to
    // start cold because its zygote could not keeps its launcher's name (`exec`, which
    // results report as `cold`).
    for (launcher, fallback, launch) in
        [(launcher(), false, "pool"), (launcher(), true, "exec"), (through_zygote, false, "pool")]
    {
        let mut sb = Sandbox::spawn(&s, &launcher, None).unwrap();
        if fallback {
            sb.mark_zygote_fallback();
        }
        // The hold channel is not the caller's to take (the spec asks for no application channel).
        assert!(sb.take_app_channel().is_none());
        sb.start_pooled().unwrap();
        let o = sb.wait(OutputOptions::default()).unwrap();
        assert!(o.success(), "{o:?}");
        assert_eq!(o.launch, launch);
        // Released, it runs with every restriction, and the hold channel (fd 4) is closed.
        assert_eq!(stdout(&o), "ran\n0\n1\n2\n3\n");
        assert!(o.enforcement.no_new_privs && o.enforcement.capabilities_dropped);
    }
}

#[test]
fn a_pooled_sandbox_whose_payload_ended_is_not_handed_out() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let state = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next().map(str::to_string)))
    };
    // The first child of `pid`, once it has one (a sandbox is built after its spawn returns).
    let first_child = |pid: i32| -> i32 {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
            if let Some(k) = kids.split_whitespace().next() {
                return k.parse().unwrap();
            }
            assert!(std::time::Instant::now() < deadline, "{pid} has no child");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    // Held, or waiting on its application channel as a pooled runtime does: a payload that
    // ends while it waits (in a pool, the OOM killer's first victim) ends its sandbox, and
    // the release fails, so the caller starts a sandbox of its own instead.
    for held in [true, false] {
        let mut s = spec(&["/bin/sh", "-c", "exit 0"]);
        s.command.held = held;
        s.command.app_channel = !held;
        let mut sb = Sandbox::spawn(&s, &launcher(), None).unwrap();
        let monitor = sb.monitor_pid();
        if held {
            let payload = first_child(first_child(monitor));
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(payload), nix::sys::signal::SIGKILL).unwrap();
        }
        // The monitor (this process's child) exits once the payload and init are gone.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while state(monitor).as_deref() != Some("Z") {
            assert!(std::time::Instant::now() < deadline, "the sandbox did not end: {:?}", state(monitor));
            std::thread::sleep(Duration::from_millis(5));
        }
        let err = sb.start_pooled().expect_err("a sandbox whose payload ended is not released");
        assert!(err.to_string().contains("has ended"), "{err}");
    }
}

/// A masked file the host replaces by a rename (as `passwd` writes `/etc/shadow`) loses its
/// cover in every mount namespace: the new file shows unmasked in a sandbox built before;
/// so does a masked path created after the build. The old code handed such a pooled
/// sandbox out (once its build had finished before the rename, it printed `NEW-SECRET`). A
/// pooled sandbox whose masked paths changed since the pool looked at them (just before
/// starting it) is now discarded when a run would take it; a fresh one masks the new files.
#[test]
fn a_pooled_sandbox_built_before_a_masked_file_was_replaced_is_not_handed_out() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let dir = common::HostDir::new_in("/var/tmp");
    let d = |p: &str| dir.path.join(p);
    dir.file("secret", "old-secret", 0o644);
    let mut s =
        spec(&["/bin/sh", "-c", &format!("cat {} {} 2>&1; true", d("secret").display(), d("created").display())]);
    s.filesystem.paths.push(sandbox::PathRule {
        source: None,
        path: dir.path.clone(),
        access: sandbox::Access::Read,
        optional: false,
        identity: None,
    });
    s.filesystem.masked.extend([d("secret"), d("created")]);
    s.command.held = true;
    let pool = agent::warm_pool::WarmPool::new(1, Duration::from_secs(600), launcher()).unwrap();
    let run = |sb: Sandbox| stdout(&sb.wait(OutputOptions::default()).unwrap());
    // Nothing changed: handed out, and the file is masked.
    pool.fill(s.clone()).unwrap();
    let out = run(pool.take(&s).expect("a pooled sandbox"));
    assert!(!out.contains("secret") || out.contains("Permission denied"), "{out}");
    assert!(!out.contains("old-secret"), "{out}");

    // Replaced by a rename while a sandbox waits: not handed out.
    pool.fill(s.clone()).unwrap();
    dir.file("secret.new", "NEW-SECRET", 0o644);
    std::fs::rename(d("secret.new"), d("secret")).unwrap();
    if let Some(sb) = pool.take(&s) {
        panic!("a pooled sandbox built before the masked file was replaced was handed out; it shows: {}", run(sb));
    }
    // Created while a sandbox waits: not handed out either.
    pool.fill(s.clone()).unwrap();
    dir.file("created", "CREATED-SECRET", 0o644);
    if let Some(sb) = pool.take(&s) {
        panic!("a pooled sandbox built before a masked path existed was handed out; it shows: {}", run(sb));
    }
    // A fresh sandbox masks both.
    pool.fill(s.clone()).unwrap();
    let out = run(pool.take(&s).expect("a pooled sandbox built after the changes"));
    assert!(!out.contains("NEW-SECRET") && !out.contains("CREATED-SECRET"), "{out}");
    assert_eq!(out.matches("Permission denied").count(), 2, "{out}");
    pool.shutdown();
}

/// A stop ends a warm pool's warm-up under way: the sandbox being warmed up (here a payload
/// that never answers it) is discarded — killed, its cgroups removed — when the pool shuts
/// down, not when the warm-up's 10 s limit runs out after the agent has gone.
#[test]
fn a_pool_shutdown_ends_a_warm_up_under_way() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    // A unique argument, to find the payload among the host's processes.
    let secs = format!("61.{}", std::process::id());
    let mut s = spec(&["/bin/sleep", &secs]);
    s.command.app_channel = true;
    let pool = agent::warm_pool::WarmPool::new(1, Duration::from_secs(600), launcher()).unwrap();
    let filling = {
        let (pool, s) = (pool.clone(), s.clone());
        std::thread::spawn(move || pool.fill(s).map_err(|e| e.to_string()))
    };
    let payload = || {
        std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            (cmdline == format!("/bin/sleep\0{secs}\0").as_bytes()).then(|| e.path())
        })
    };
    // Started: its payload runs, and the pool's warm-up is about to wait, or waits, for it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let proc_dir = loop {
        if let Some(p) = payload() {
            break p;
        }
        assert!(!filling.is_finished(), "the fill ended before its payload ran: {:?}", filling.join());
        assert!(Instant::now() < deadline, "the pooled sandbox did not start");
        std::thread::sleep(Duration::from_millis(5));
    };
    pool.shutdown();
    let filled = filling.join().unwrap();
    let err = filled.expect_err("a sandbox whose warm-up was cut short is not offered");
    assert!(err.contains("the pool is shutting down"), "{err}");
    assert_eq!(pool.ready(), 0);
    // Discarded with it: killed and reaped.
    let deadline = Instant::now() + Duration::from_secs(10);
    while proc_dir.exists() {
        assert!(Instant::now() < deadline, "the payload outlived its discarded sandbox");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_held_payload_refuses_anything_but_the_go() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let mut s = spec(&["/bin/sh", "-c", "echo ran"]);
    s.command.held = true;
    s.command.app_channel = true;
    let mut sb = Sandbox::spawn(&s, &launcher(), None).unwrap();
    // With an application channel the hold channel is that channel: its first message must
    // be the go, and anything else ends the payload before the program runs.
    let chan = sb.take_app_channel().expect("application channel");
    chan.send_bytes(b"run it").unwrap();
    let err = sb.wait(OutputOptions::default()).unwrap_err();
    assert!(err.to_string().contains("held: expected the go"), "{err}");
}

#[test]
fn a_setup_that_overruns_its_limit_fails_and_leaves_nothing() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let marker = format!("opservant-setup-{}", std::process::id());
    let mut s = spec(&["/bin/sh", "-c", "sleep 1000; :", &marker]);
    s.limits.setup_timeout_ms = Some(500);
    // The hook stands in for a setup step stuck in the kernel: the payload cannot have
    // started when the limit expires.
    let mut hook = |_: &sandbox::MonitorProc<'_>| -> Result<(), String> {
        std::thread::sleep(Duration::from_millis(700));
        Ok(())
    };
    let sb = Sandbox::spawn(&s, &launcher(), Some(&mut hook)).unwrap();
    let monitor = sb.monitor_pid();
    let err = sb.wait(OutputOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("sandbox setup did not finish within 500 ms (waiting for the payload's start report)"),
        "{err}"
    );
    assert!(common::host_processes_with(&marker).is_empty(), "nothing of the sandbox survives");
    assert!(!std::path::Path::new(&format!("/proc/{monitor}")).exists(), "monitor reaped, no zombie");
}

#[test]
fn a_monitor_that_never_unshares_fails_the_spawn_at_the_limit() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    // A monitor that takes a second to start stands in for one stuck before it reports its
    // namespaces; the channel (fd 3) and stdio survive the shell's exec.
    let script = format!("sleep 1; exec {} __sandbox-init", common::opservant());
    let slow = Launcher::new("/bin/sh", &[OsStr::new("-c"), OsStr::new(&script)]).unwrap();
    let mut s = spec(&["/bin/true"]);
    s.limits.setup_timeout_ms = Some(300);
    match Sandbox::spawn(&s, &slow, None) {
        Err(e) => assert!(
            e.to_string().contains("sandbox setup did not finish within 300 ms (waiting for the namespaces)"),
            "{e}"
        ),
        // (Had the spawn waited for the monitor, its setup would have succeeded.)
        Ok(_) => panic!("a setup past its limit must fail"),
    }
}

#[test]
fn a_zero_setup_limit_is_refused() {
    let mut s = spec(&["/bin/true"]);
    s.limits.setup_timeout_ms = Some(0);
    let err = s.validate().unwrap_err();
    assert!(err.to_string().contains("limits.setup_timeout_ms"), "{err}");
}

#[test]
fn a_start_report_waiting_for_a_late_caller_is_not_overdue() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let mut s = spec(&["/bin/true"]);
    s.limits.setup_timeout_ms = Some(2000);
    let sb = Sandbox::spawn(&s, &launcher(), None).unwrap();
    // The payload starts (and reports) within milliseconds; the caller comes to `wait` only
    // after the setup limit: the report already waiting counts.
    std::thread::sleep(Duration::from_millis(2500));
    let o = sb.wait(OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
}

/// A zygote started by a shell that runs `prelude` first, then becomes the runtime's zygote.
fn zygote_after(prelude: &str) -> std::sync::Arc<sandbox::zygote::Zygote> {
    let runtime = std::path::Path::new(common::opservant()).with_file_name("opservant-runtime");
    let script = format!("{prelude}; exec {} --zygote", runtime.display());
    std::sync::Arc::new(
        sandbox::zygote::Zygote::new(
            std::ffi::CString::new("/bin/sh").unwrap(),
            vec![std::ffi::CString::new("-c").unwrap(), std::ffi::CString::new(script).unwrap()],
        )
        .expecting(agent::app::BUILD.as_bytes().to_vec()),
    )
}

#[test]
fn waiting_for_a_slow_zygote_does_not_use_up_the_setup_limit() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    // A zygote that takes 1.5 s to start (a loaded machine, an emulated one), and a setup
    // limit of 1 s: the sandbox's setup is counted from its monitor's start, so the run goes
    // ahead. Before, the wait used up the limit and the run failed (no cold fallback).
    let zygote = zygote_after("/bin/sleep 1.5");
    let launcher = Launcher::Zygote { zygote, end: sandbox::PayloadEnd::Exec };
    let mut s = spec(&["/bin/true"]);
    s.limits.setup_timeout_ms = Some(1000);
    let sb = Sandbox::spawn(&s, &launcher, None).expect("the setup limit counts from the monitor's start");
    let o = sb.wait(OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
}

#[test]
fn a_zygote_whose_children_cannot_start_is_a_zygote_failure_and_is_replaced() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    // With at most 10 descriptors, the zygote serves, but each child it forks fails to move
    // the received descriptors above 9 and exits before it unshares. That is the zygote's
    // failure (so the caller starts the sandbox cold: `SandboxError::Zygote`), not the
    // sandbox's, and the zygote is replaced rather than failing every request alike.
    let zygote = zygote_after("ulimit -n 10");
    zygote.start().unwrap();
    let launcher = Launcher::Zygote { zygote: zygote.clone(), end: sandbox::PayloadEnd::Exec };
    let first = zygote.pid();
    let err = Sandbox::spawn(&spec(&["/bin/true"]), &launcher, None).map(drop).expect_err("no sandbox starts");
    assert!(matches!(err, sandbox::SandboxError::Zygote(_)), "{err:?}");
    assert!(first.is_some() && zygote.pid().is_none(), "the zygote is discarded: {first:?} → {:?}", zygote.pid());
}

/// A zygote's monitor is not our child: once it dies the zygote reaps it and its pid may
/// name another process. What the parent does by pid — the id maps, the namespace hook —
/// is checked against the monitor's pidfd: a monitor gone by the end of the hook fails the
/// sandbox as such, whatever the pid now names.
#[test]
fn a_zygote_monitor_that_ends_during_the_hook_fails_the_sandbox_by_its_pidfd() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let zygote = std::sync::Arc::new(runtime_zygote());
    let launcher = Launcher::Zygote { zygote, end: sandbox::PayloadEnd::Exec };
    let mut hook = |monitor: &sandbox::MonitorProc<'_>| -> Result<(), String> {
        let pid = monitor.pid();
        // SAFETY: kill(2) on the monitor's pid, which the zygote has not reaped yet.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        // Until the zygote has reaped it, its pid is free for anyone.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            assert!(std::time::Instant::now() < deadline, "the zygote did not reap its monitor");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        Ok(())
    };
    match Sandbox::spawn(&spec(&["/bin/true"]), &launcher, Some(&mut hook)) {
        Err(e) => assert!(e.to_string().contains("ended during the namespace hook"), "{e}"),
        Ok(_) => panic!("a sandbox whose monitor is gone must fail"),
    }
}

/// The namespace links (`mnt:[N]`) among this process's descriptors.
fn held_mount_namespaces() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .filter(|l| l.starts_with("mnt:["))
        .collect()
}

#[test]
fn a_zygote_sandbox_s_mount_namespace_is_held_by_the_parent_and_released_after_the_run() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let zygote = std::sync::Arc::new(runtime_zygote());
    let launcher = Launcher::Zygote { zygote, end: sandbox::PayloadEnd::Exec };
    for round in 0..3 {
        let sb = Sandbox::spawn(&spec(&["/bin/true"]), &launcher, None).unwrap();
        // From the handshake on the parent holds the sandbox's mount namespace, so that the
        // monitor's exit is not where the namespace (its mounts) is destroyed.
        let sandbox_ns = std::fs::read_link(format!("/proc/{}/ns/mnt", sb.monitor_pid())).unwrap();
        let sandbox_ns = sandbox_ns.to_string_lossy().into_owned();
        assert_ne!(sandbox_ns, std::fs::read_link("/proc/self/ns/mnt").unwrap().to_string_lossy());
        assert!(held_mount_namespaces().contains(&sandbox_ns), "round {round}: {:?}", held_mount_namespaces());
        let o = sb.wait(OutputOptions::default()).unwrap();
        assert!(o.success() && o.launch == "zygote", "{o:?}");
        // … and lets go of it once the sandbox is gone (on a background thread: not at once).
        let start = Instant::now();
        while held_mount_namespaces().contains(&sandbox_ns) && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!held_mount_namespaces().contains(&sandbox_ns), "round {round}: {sandbox_ns} still held");
    }
}

/// The CPU quota's control file of the sandbox cgroup `pid` is in (this host's v1 `cpu`
/// hierarchy, or a unified v2 tree at /sys/fs/cgroup), or `None` while it is in none.
fn sandbox_cpu_quota_of(pid: i32) -> Option<String> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let file = cgroups.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if !path.contains("opservant-sb-") {
            None
        } else if controllers.split(',').any(|c| c == "cpu") {
            Some(format!("/sys/fs/cgroup/{controllers}{path}/cpu.cfs_quota_us"))
        } else if controllers.is_empty() && std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            Some(format!("/sys/fs/cgroup{path}/cpu.max"))
        } else {
            None
        }
    })?;
    Some(std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file}: {e}")).trim().to_string())
}

/// A CPU quota that is not deferred is in force before any process of the sandbox runs in
/// its cgroup: it is written as the cgroup is made, not when the payload's start is
/// reported — read here as soon as init has joined, before `wait` has read any report.
#[test]
fn a_cpu_quota_is_in_force_before_the_sandbox_runs() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let sb = Sandbox::spawn(&spec(&["/bin/sleep", "1"]), &launcher(), None).unwrap();
    let monitor = sb.monitor_pid();
    let give_up = Instant::now() + Duration::from_secs(10);
    let quota = loop {
        // Init: the monitor's only child.
        let children = std::fs::read_to_string(format!("/proc/{monitor}/task/{monitor}/children")).unwrap_or_default();
        if let Some(quota) = children.split_whitespace().find_map(|c| sandbox_cpu_quota_of(c.parse().ok()?)) {
            break quota;
        }
        assert!(Instant::now() < give_up, "init never joined its cgroup");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(quota == "50000" || quota == "50000 100000", "50 % of a 100 ms period: {quota}");
    let o = sb.wait(OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
    assert!(o.cgroup.cpu, "reported as enforced: {o:?}");
}

/// A sandbox cgroup whose removal timed out — a process in it could not exit yet (here
/// frozen by a v1 freezer cgroup the test makes; in life, stuck in the kernel) — is tried
/// again when this process next creates a sandbox: its creator is alive, so no sweep for
/// stale cgroups would ever remove it. The old code left it for the rest of the agent's life.
#[test]
fn a_sandbox_cgroup_left_behind_is_removed_by_a_later_sandbox() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    let _view = common::host_view();
    let sb = Sandbox::spawn(&spec(&["/bin/sleep", "1000"]), &launcher(), None).unwrap();
    let (freezer, sandbox_dirs) = common::freezer::freeze_sandbox_below(sb.monitor_pid());
    // Teardown kills, waits its patience out (5 s) and leaves the cgroups behind.
    drop(sb);
    for d in &sandbox_dirs {
        assert!(d.exists(), "control: {} could not be removed with a frozen process in it", d.display());
    }
    assert!(freezer.thaw(), "the thawed sandbox processes never died");
    // The next sandbox this process makes removes them (before its own cgroups are made).
    assert_removed_by_the_next_sandbox(&sandbox_dirs);
}

/// A sandbox whose processes survive SIGKILL (stuck in the kernel; here frozen) fails its
/// run a bounded time after the last SIGKILL instead of `wait` waiting for their output
/// pipes forever: the old code never returned. (The bound checked here is a hang detector
/// of a minute, not a timing: the run's own bound is timeout + grace + 1 s + 5 s, and the
/// cgroups' removal 5 s.)
#[test]
fn a_sandbox_stuck_in_the_kernel_fails_its_run_instead_of_hanging_it() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    let _view = common::host_view();
    let mut s = spec(&["/bin/sleep", "1000"]);
    s.limits.timeout_ms = Some(300);
    s.limits.kill_grace_ms = 100;
    // A host uid of its own, the only one of its range: held while its processes live.
    let range = sandbox::HostUids {
        first: 1_900_400_000 + std::process::id() % 1000,
        count: 1,
        lock: common::tests_state().join(format!("stuck-uid-{}", std::process::id())).join("lock"),
    };
    s.host_uids = Some(range.clone());
    let sb = Sandbox::spawn(&s, &launcher(), None).unwrap();
    let (freezer, sandbox_dirs) = common::freezer::freeze_sandbox_below(sb.monitor_pid());
    let result = wait_elsewhere(sb).recv_timeout(Duration::from_secs(60));
    // The run is over, its processes are not: their uid is not another sandbox's yet.
    let held = sandbox::host_uid::lease(&range, &[]).map(|l| l.uid());
    let thawed = freezer.thaw();
    let err = result.expect("wait hung on a sandbox whose processes cannot exit").unwrap_err();
    assert!(err.contains("had not exited 5 s after SIGKILL"), "{err}");
    assert!(thawed, "the thawed sandbox processes never died");
    let held = held.expect_err("the stuck sandbox's uid was leased again while its processes lived").to_string();
    assert!(held.contains("is held by a running sandbox"), "{held}");
    // Left behind, and removed by the next sandbox — and with them goes the uid: the next
    // sandbox of the same one-uid range gets it (the left-behind cgroups are tried before
    // its lease, which would otherwise find the uid still held by them).
    let mut next = spec(&["/bin/true"]);
    next.host_uids = Some(range.clone());
    let o = sandbox::run(&next, &launcher(), OutputOptions::default()).expect("the next sandbox of the range");
    assert!(o.success(), "{o:?}");
    for d in &sandbox_dirs {
        assert!(!d.exists(), "{} still left behind after a later sandbox was made", d.display());
    }
    assert_eq!(sandbox::host_uid::lease(&range, &[]).map(|l| l.uid()).ok(), Some(range.first));
    let _ = std::fs::remove_dir_all(range.lock.parent().unwrap());
}

/// A monitor that cannot exit (frozen here; in life, stuck in the kernel) does not hang its
/// run: the sandbox's init and payload end, the monitor never reports or closes the channel,
/// and the run fails once it has not exited 5 s after SIGKILL — without then waiting for it
/// without bound (the old code did: checked). Once it can die, a monitor that is this
/// process's child is reaped by this process's next sandbox (no zombie is left), a
/// zygote's by its zygote.
#[test]
fn a_monitor_stuck_in_the_kernel_does_not_hang_its_run() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    let _view = common::host_view();
    let zygote = std::sync::Arc::new(runtime_zygote());
    let zygote_launcher = Launcher::Zygote { zygote: zygote.clone(), end: sandbox::PayloadEnd::Exec };
    for (name, launcher) in [("exec", launcher()), ("zygote", zygote_launcher)] {
        let mut s = spec(&["/bin/sleep", "1000"]);
        s.limits.timeout_ms = Some(500);
        s.limits.kill_grace_ms = 100;
        let sb = Sandbox::spawn(&s, &launcher, None).unwrap();
        let monitor = sb.monitor_pid();
        let give_up = Instant::now() + Duration::from_secs(10);
        while common::procs::descendants(monitor).len() < 2 {
            assert!(Instant::now() < give_up, "{name}: no init and payload below the monitor {monitor}");
            std::thread::sleep(Duration::from_millis(10));
        }
        let freezer = common::freezer::Freezer::new(format!("monitor-{name}"));
        freezer.freeze(&[monitor]);
        let result = wait_elsewhere(sb).recv_timeout(Duration::from_secs(60));
        let thawed = freezer.thaw();
        let err = result.unwrap_or_else(|_| panic!("{name}: wait hung on a monitor that cannot exit")).unwrap_err();
        assert!(err.contains("had not exited 5 s after SIGKILL"), "{name}: {err}");
        assert!(thawed, "{name}: the thawed monitor never died");
        if name == "exec" {
            // Left behind unreaped (a zombie now), and reaped by the next sandbox.
            let o = sandbox::run(&spec(&["/bin/true"]), &launcher, OutputOptions::default()).unwrap();
            assert!(o.success(), "{o:?}");
            let reaped = nix::sys::wait::waitpid(
                nix::unistd::Pid::from_raw(monitor),
                Some(nix::sys::wait::WaitPidFlag::WNOHANG),
            );
            assert_eq!(reaped, Err(nix::errno::Errno::ECHILD), "the left-behind monitor {monitor} was not reaped");
        } else {
            // The zygote, its parent, reaps it.
            let give_up = Instant::now() + Duration::from_secs(10);
            while Path::new(&format!("/proc/{monitor}")).exists() {
                assert!(Instant::now() < give_up, "the zygote never reaped its left-behind monitor {monitor}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Output still being read when the sandbox's processes are long gone — a caller's slow
/// consumer (`opservant sandbox … | less`) working through a full pipe — is progress, not a
/// sandbox stuck in the kernel: the run completes with all of it. The payload enlarges its
/// stdout pipe to 1 MiB, fills it and exits; the tee takes 0.5 s per 64 KiB read, so the
/// reads go on ~8 s after the payload's end, past the 6 s after which a sandbox whose
/// processes make no progress is abandoned (the first version of that bound failed this run).
#[test]
fn a_slow_output_consumer_is_not_taken_for_a_stuck_sandbox() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let code = "import fcntl, os\nfcntl.fcntl(1, 1031, 1 << 20)\ndata = b'x' * (1 << 20)\nn = 0\nwhile n < len(data):\n    n += os.write(1, data[n:])\n";
    let s = spec(&["/usr/bin/python3", "-I", "-S", "-c", code]);
    let mut chunks = 0;
    let mut tee = |_: sandbox::Stream, _: &[u8]| {
        chunks += 1;
        std::thread::sleep(Duration::from_millis(500));
    };
    let out = OutputOptions { tee: Some(&mut tee), ..OutputOptions::default() };
    let o = sandbox::run(&s, &launcher(), out).unwrap();
    assert!(o.success(), "{o:?}");
    assert_eq!(o.stdout.total, 1 << 20, "{o:?}");
    assert!(chunks >= 14, "control: the consumer read the output in {chunks} chunks");
}

/// Dropping a zygote that cannot die (frozen here; in life, stuck in the kernel) — as the
/// agent does at shutdown — kills it, waits a bounded time and leaves it to a reaper thread
/// instead of hanging; once it can die, that thread reaps it (no zombie is left). Checked to
/// hang with an unbounded wait.
#[test]
fn dropping_a_zygote_that_cannot_die_does_not_hang() {
    if !require_root() || !common::freezer::available() {
        return;
    }
    let zygote = runtime_zygote();
    zygote.start().unwrap();
    let pid = zygote.pid().expect("a started zygote has a pid");
    let freezer = common::freezer::Freezer::new(pid);
    freezer.freeze(&[pid]);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(zygote);
        let _ = tx.send(());
    });
    let dropped = rx.recv_timeout(Duration::from_secs(60));
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let thawed = freezer.thaw();
    dropped.expect("dropping a zygote that cannot die hung");
    assert!(
        !state.is_empty() && !state.contains(") Z "),
        "control: the zygote was still alive when the drop returned: {state:?}"
    );
    assert!(thawed, "the thawed zygote never died");
    let give_up = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(Instant::now() < give_up, "the zygote was never reaped once it could die");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// With the teardown in the background (the agent's runs), `wait` returns once the outcome
/// is complete: the payload's exit, every other process of the sandbox killed and reaped
/// (nothing of it is left running on the host when `wait` returns), the output read to its
/// end and the tree's resource usage — and the cgroups and the monitor go afterwards, so
/// that nothing is left once the background teardown is done. Through a zygote too.
#[test]
fn a_background_teardown_returns_the_whole_outcome_and_then_leaves_nothing() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let zygote = std::sync::Arc::new(runtime_zygote());
    let launchers = [launcher(), Launcher::Zygote { zygote, end: sandbox::PayloadEnd::Exec }];
    for (n, l) in launchers.iter().enumerate() {
        let marker = format!("3{n}.1415926");
        let script = format!("echo out; sleep {marker} & echo err >&2; head -c 300000 /dev/zero | tr '\\0' x; exit 3");
        let mut sb = Sandbox::spawn(&spec(&["/bin/sh", "-c", &script]), l, None).unwrap();
        sb.teardown_in_background();
        let monitor = sb.monitor_pid();
        let o = sb.wait(OutputOptions::default()).unwrap();
        assert!(common::host_processes_with(&marker).is_empty(), "the payload's child outlived the outcome");
        assert_eq!(o.exit.and_then(|e| e.code), Some(3), "{o:?}");
        assert!(o.stdout.bytes.starts_with(b"out\n") && o.stdout.total == 4 + 300_000, "{}", o.stdout.total);
        assert_eq!(String::from_utf8_lossy(&o.stderr.bytes), "err\n");
        assert!(o.usage.peak_memory_bytes.is_some_and(|b| b > 0), "{o:?}");
        assert!(!o.cgroup.paths.is_empty(), "{o:?}");
        assert!(sandbox::parent::await_background_teardown(Duration::from_secs(30)), "teardown still under way");
        let left: Vec<_> = common::sandbox_cgroups()
            .into_iter()
            .filter(|d| o.cgroup.paths.iter().any(|p| d.ends_with(p.trim_start_matches('/'))))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // Exited (a zygote's monitor is its zygote's to reap, which it does at once).
        let gone = Instant::now() + Duration::from_secs(5);
        while Path::new(&format!("/proc/{monitor}")).exists() && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!Path::new(&format!("/proc/{monitor}")).exists(), "the monitor {monitor} is still there");
    }
}

/// The pids of `pid`'s `NSpid` line: its pid in each PID namespace it is in, outermost first.
fn ns_pids(pid: i32) -> Vec<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("NSpid:")).unwrap().to_string();
    line.split_whitespace().skip(1).map(str::to_string).collect()
}

/// A zygote's stash filled: its next sandbox can join a prepared network namespace.
fn stash_ready(zygote: &sandbox::zygote::Zygote) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while zygote.netns_stash().unwrap().status().ready == 0 {
        assert!(Instant::now() < deadline, "the stash made no namespace");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A zygote with a prepared network namespace to hand over starts the sandbox directly: the
/// process it forks is the sandbox's PID 1 (its init), not a monitor — and without one, a
/// monitor as before. A sandbox started directly outlives its zygote: killing the zygote
/// ends none of its sandboxes, which still complete and report.
#[test]
fn a_zygote_starts_sandboxes_directly_and_its_death_ends_none_of_them() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let zygote = std::sync::Arc::new(runtime_zygote().with_netns_stash(1));
    let l = Launcher::Zygote { zygote: zygote.clone(), end: sandbox::PayloadEnd::Exec };
    stash_ready(&zygote);
    let sb = Sandbox::spawn(&spec(&["/bin/sh", "-c", "sleep 1; echo done"]), &l, None).unwrap();
    let init = ns_pids(sb.monitor_pid());
    assert_eq!((init.len(), init.last().map(String::as_str)), (2, Some("1")), "not the sandbox's init: {init:?}");
    // SAFETY: kill(2) on the zygote this test started.
    assert_eq!(unsafe { libc::kill(zygote.pid().unwrap(), libc::SIGKILL) }, 0);
    let o = sb.wait(OutputOptions::default()).unwrap();
    assert!(o.success(), "{o:?}");
    assert_eq!(stdout(&o), "done\n");
    assert!(o.usage.peak_memory_bytes.is_some(), "{o:?}");

    // Without a prepared namespace (a spec with a fresh sysfs cannot join one): a monitor.
    let zygote = std::sync::Arc::new(runtime_zygote().with_netns_stash(1));
    stash_ready(&zygote);
    let l = Launcher::Zygote { zygote, end: sandbox::PayloadEnd::Exec };
    let mut fresh_sysfs = spec(&["/bin/true"]);
    fresh_sysfs.filesystem.sysfs = true;
    let sb = Sandbox::spawn(&fresh_sysfs, &l, None).unwrap();
    assert_eq!(ns_pids(sb.monitor_pid()).len(), 1, "a monitor is in the host's PID namespace");
    assert!(sb.wait(OutputOptions::default()).unwrap().success());
}

/// With no monitor, a sandbox started directly is watched by its own init: when its caller
/// dies outright (SIGKILL, no chance to stop it), every process of the sandbox is killed —
/// as the monitor does for a sandbox that has one. The caller here is `opservant sandbox
/// --launch zygote`, whose one-shot zygote has a prepared namespace: the sandbox's init is
/// the zygote's child, and the zygote the caller's.
#[test]
fn a_sandbox_started_directly_dies_with_its_caller() {
    if !require_root() {
        return;
    }
    let marker = "41.3141592";
    let mut caller = common::command()
        .args(["sandbox", "--launch", "zygote", "--", "/bin/sh", "-c", &format!("sleep {marker}")])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let sleeper = loop {
        if let Some(p) = common::host_processes_with(marker).into_iter().find(|&p| ns_pids(p).len() == 2) {
            break p;
        }
        assert!(Instant::now() < deadline, "the sandbox did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    let parent = |pid: i32| -> i32 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        stat.rsplit_once(')').unwrap().1.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    // The payload (and what it started) ← init ← the zygote ← the caller, no monitor between;
    // the caller drops its one-shot zygote once the sandbox has started, and init is then the
    // host's init's.
    let mut init = sleeper;
    while ns_pids(init).last().map(String::as_str) != Some("1") {
        init = parent(init);
    }
    let above = parent(init);
    assert!(above == 1 || parent(above) == caller.id() as i32, "init {init}'s parent {above} is a monitor");
    caller.kill().unwrap();
    caller.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !common::host_processes_with(marker).is_empty() {
        assert!(Instant::now() < deadline, "the sandbox outlived its caller");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A sandbox with a host uid leased for it lives in a user namespace that uid owns, and the
/// kernel charges what the namespace's processes use of the per-user allowances kept with
/// user namespaces (here inotify instances) to the owner at the level above: to the leased
/// uid, never to host root. Before, root owned every sandbox's namespace, and a sandbox
/// allowed as many instances as the host allows one user took root's whole allowance —
/// `inotify_init1` then failed for every root process of the host (systemd, udev). The
/// payload (allowed 1024 in its namespace) makes instances until refused and stops itself;
/// meanwhile its namespace's owner is read from the host (`NS_GET_OWNER_UID`) and root makes
/// an instance. Through a cold monitor, a zygote's, and a zygote's direct start (no monitor:
/// the zygote's `clone` creates the namespace, and the parent puts init in its cgroups).
#[test]
fn a_leased_uid_owns_its_sandboxs_user_namespace_and_pays_for_its_inotify_instances() {
    if !require_root() {
        return;
    }
    let _view = common::host_view();
    let host_max: usize =
        std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances").unwrap().trim().parse().unwrap();
    let zygote = std::sync::Arc::new(runtime_zygote());
    let zygote_launcher = Launcher::Zygote { zygote, end: sandbox::PayloadEnd::Exec };
    let stashing = std::sync::Arc::new(runtime_zygote().with_netns_stash(1));
    stash_ready(&stashing);
    let direct_launcher = Launcher::Zygote { zygote: stashing, end: sandbox::PayloadEnd::Exec };
    for (name, launcher) in [("exec", launcher()), ("zygote", zygote_launcher), ("direct", direct_launcher)] {
        let marker = format!("opservant-owner-{name}-{}", std::process::id());
        let range = sandbox::HostUids {
            first: 1_900_500_000 + std::process::id() % 1000,
            count: 1,
            lock: common::tests_state().join(format!("owner-uid-{}", std::process::id())).join("lock"),
        };
        let code = "import ctypes, os, signal, sys\n\
                    libc = ctypes.CDLL(None, use_errno=True)\n\
                    fds = []\n\
                    while len(fds) < 2000:\n fd = libc.inotify_init1(0)\n if fd < 0: break\n fds.append(fd)\n\
                    err = ctypes.get_errno()\n\
                    os.kill(os.getpid(), signal.SIGSTOP)\n\
                    print(len(fds), err)\n";
        let mut s = spec(&["/usr/bin/python3", "-I", "-S", "-c", code, &marker]);
        s.host_uids = Some(range.clone());
        s.limits.inotify_instances = 1024;
        let sb = Sandbox::spawn(&s, &launcher, None).unwrap();
        // A sandbox started directly has no monitor: what started it is its init.
        let direct = ns_pids(sb.monitor_pid()).len() == 2;
        assert_eq!(direct, name == "direct", "{name}: started directly: {direct}");
        let (tx, result) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(sb.wait(OutputOptions::default()).map(|o| (o.success(), stdout(&o), format!("{o:?}"))));
        });
        // The payload, once it has stopped itself (kernel state, not time).
        let deadline = Instant::now() + Duration::from_secs(30);
        let payload = loop {
            let stopped = common::host_processes_with(&marker).into_iter().find(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|st| st.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('T')))
            });
            if let Some(pid) = stopped {
                break pid;
            }
            assert!(Instant::now() < deadline, "{name}: the payload did not stop itself");
            std::thread::sleep(Duration::from_millis(20));
        };
        let userns = std::fs::File::open(format!("/proc/{payload}/ns/user")).unwrap();
        let mut owner: libc::uid_t = u32::MAX;
        // SAFETY: NS_GET_OWNER_UID (_IO(0xb7, 4)) writes one uid_t to the address given.
        let rc = unsafe {
            libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&userns), 0xb704 as _, &mut owner as *mut libc::uid_t)
        };
        assert_eq!(rc, 0, "{name}: NS_GET_OWNER_UID: {}", std::io::Error::last_os_error());
        // SAFETY: inotify_init1 returns a new descriptor or -1; closed right after.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        let root_err = std::io::Error::last_os_error();
        if fd >= 0 {
            // SAFETY: `fd` is ours.
            unsafe { libc::close(fd) };
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(payload), nix::sys::signal::Signal::SIGCONT);
        let (success, out, outcome) = result.recv_timeout(Duration::from_secs(60)).expect("the run hung").unwrap();
        assert_eq!(owner, range.first, "{name}: the sandbox's user namespace is owned by uid {owner}");
        assert!(fd >= 0, "{name}: host root's inotify_init1 while the sandbox held its instances: {root_err}");
        // Every instance the leased uid may have, up to its namespace's own limit (root's
        // own instances, the host's services', no longer count against the sandbox either).
        assert!(success, "{name}: {outcome}");
        assert_eq!(out, format!("{} 24\n", host_max.min(1024)), "{name}: {outcome}");
    }
    let _ = std::fs::remove_dir_all(common::tests_state().join(format!("owner-uid-{}", std::process::id())));
}
