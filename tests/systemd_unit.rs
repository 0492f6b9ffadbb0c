//! The shipped systemd unit: `systemd-analyze verify` is clean, its exposure score stays
//! where systemd/README.md says (a regression guard: a hardening option removed by mistake
//! raises it), and the options the agent depends on are there. The unit's ExecStart points at
//! /usr/bin/opservant; a copy pointing at the built binary is verified. The unit is
//! boot-tested under systemd as PID 1 by tests/vm/systemd_boot.rs.

mod common;

use std::process::Command;

#[test]
fn unit_verifies_and_keeps_its_exposure() {
    if !common::require("systemd-analyze", Command::new("systemd-analyze").arg("--version").output().is_ok()) {
        return;
    }
    let dir = common::HostDir::new();
    let unit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../systemd/opservant.service")).unwrap();
    let path = dir.path.join("opservant.service");
    std::fs::write(&path, unit.replace("/usr/bin/opservant", common::opservant())).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&path).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.trim().is_empty(), "systemd-analyze verify: {stderr}");

    let out = Command::new("systemd-analyze").args(["security", "--offline=true"]).arg(&path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let score: f64 = text
        .lines()
        .find_map(|l| l.split("exposure level for opservant.service:").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure score in: {text}"));
    assert!(score <= 4.3, "exposure {score} is above the documented 4.3:\n{text}");
}

/// The options the agent's contract with systemd rests on, and those that break every sandbox:
/// ProtectKernelLogs=/ProtectKernelTunables=/ProcSubset= cover or hide files below /proc, and
/// the kernel then refuses the sandbox's own /proc inside its user namespace;
/// ProtectHostname= comes with a seccomp filter that refuses the sandbox's sethostname.
#[test]
fn unit_keeps_what_the_agent_depends_on() {
    let unit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../systemd/opservant.service")).unwrap();
    let lines: Vec<&str> = unit.lines().map(str::trim).filter(|l| !l.starts_with('#')).collect();
    for want in [
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=60s",
        "Delegate=yes",
        "KillMode=mixed",
        "LimitCORE=0",
        "ProtectControlGroups=yes",
        "RuntimeDirectoryPreserve=yes",
        "ReadWritePaths=-/sys/fs/cgroup/system.slice/opservant.service -/sys/fs/cgroup/unified/system.slice/opservant.service",
    ] {
        assert!(lines.contains(&want), "{want} missing from the unit");
    }
    for never in [
        "ProtectKernelLogs",
        "ProtectKernelTunables",
        "ProtectHostname",
        "RestrictSUIDSGID",
        "ProcSubset",
        "RestrictNamespaces",
        "PrivateUsers",
    ] {
        assert!(!lines.iter().any(|l| l.starts_with(never)), "{never}= must not be set (see systemd/README.md)");
    }
}
