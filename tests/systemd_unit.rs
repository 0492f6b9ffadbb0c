//! The shipped systemd unit: `systemd-analyze verify` is clean, and its exposure score stays
//! where systemd/README.md says (a regression guard: a hardening option removed by mistake
//! raises it). The unit's ExecStart points at /usr/bin/opservant; a copy pointing at the
//! built binary is verified.

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
    assert!(score <= 4.7, "exposure {score} is above the documented 4.7:\n{text}");
}
