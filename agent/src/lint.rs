//! `opservant executor lint DIR`: every finding `opservant run` would stop on (errors) or
//! warn about (warnings), without running anything — all broken manifest rules at once. It uses exactly the checks `run` uses —
//! manifest rules, entry point inside the package, Python requirement, installed packages,
//! and the agent's sandbox policy — so lint and run cannot disagree.

use std::path::Path;

use serde::Serialize;

use crate::executor_run::Executor;
use crate::manifest::{Manifest, ManifestError};
use crate::policy::AgentPolicy;

#[derive(Debug, Default, Serialize)]
pub struct LintReport {
    pub errors: Vec<String>,
    pub warnings: Vec<String>,
}

/// `Err` when `DIR/manifest.json` cannot be read as manifest text at all (missing, too
/// large, not UTF-8, nested too deep, unreadable): there is nothing to lint, as `run` could
/// not run it (exit 2, DESIGN.md §5's unreadable manifest).
pub fn lint(dir: &Path, policy: &AgentPolicy) -> Result<LintReport, ManifestError> {
    let mut r = LintReport::default();
    // Every manifest rule broken, not only the first `run` would stop on.
    let text = crate::manifest::read_in_package(dir)?;
    let (_, errors, warnings) = Manifest::check(&text);
    // Seed 000's layout has one; nothing reads it (a package's requirements are the
    // manifest's, installed from wheels into `.deps`): said, so that no one thinks them in.
    if std::fs::symlink_metadata(dir.join("requirements.txt")).is_ok() {
        r.warnings.push(
            "requirements.txt: not read — list the packages in the manifest's requirements.packages \
             (`executor install` installs them from wheels into .deps)"
                .into(),
        );
    }
    if !errors.is_empty() {
        r.errors.extend(errors.iter().map(|e| e.to_string()));
        r.warnings.extend(warnings.iter().map(|w| w.to_string()));
        // The entry point, the installed requirements and the sandbox policy are checked
        // once the manifest's own rules hold (they need a manifest to read).
        return Ok(r);
    }
    match Executor::load(dir) {
        Err(e) => r.errors.push(e.0),
        Ok(ex) => {
            r.warnings.extend(ex.warnings.iter().cloned());
            if let Err(e) = policy.spec_for(Some(&ex.manifest), "/bin/true", vec![]) {
                r.errors.push(e.to_string());
            }
            let limits = policy.limits.resolve(&ex.manifest.resource_limits);
            for c in &limits.clamped {
                r.warnings.push(format!(
                    "resource_limits.{}: {} will be clamped to {} ({})",
                    c.field, c.requested, c.applied, c.reason
                ));
            }
            let net = &ex.manifest.permissions.network;
            if net.outbound && net.allowed_hosts.is_none() {
                r.warnings.push(
                    "permissions.network: outbound without allowed_hosts reaches any host not denied (specify allowed_hosts)"
                        .into(),
                );
            }
            if !net.outbound
                && (net.allowed_hosts.is_some() || !net.allowed_ports.is_empty() || !net.denied_hosts.is_empty())
            {
                r.warnings.push("permissions.network: hosts and ports are declared but outbound is false, so the executor has no network".into());
            }
            if ex.manifest.author.is_none() {
                r.warnings.push("author: not set (recommended)".into());
            }
        }
    }
    Ok(r)
}

impl LintReport {
    pub fn render(&self, dir: &Path) -> String {
        let mut s = String::new();
        // The package's own text (manifest values, file names) in one line each, control
        // characters escaped: it cannot forge a line or drive the terminal.
        for e in &self.errors {
            s.push_str(&format!("{}: error: {}\n", dir.display(), crate::one_terminal_line(&e.to_string())));
        }
        for w in &self.warnings {
            s.push_str(&format!("{}: warning: {}\n", dir.display(), crate::one_terminal_line(&w.to_string())));
        }
        if self.errors.is_empty() {
            s.push_str(&format!(
                "{}: ok ({} warning{})\n",
                dir.display(),
                self.warnings.len(),
                if self.warnings.len() == 1 { "" } else { "s" }
            ));
        }
        s
    }
}
