//! Resource-limit policy: defaults and ceilings (DESIGN.md §3), loaded from the declarative
//! `policies/limits.json`. A request above a ceiling is clamped and the clamp is recorded —
//! the caller reports it in the result and the audit log; it is never silent.

use serde::{Deserialize, Serialize};

use crate::manifest::ResourceLimits;

/// The built-in policy file.
pub const LIMITS_JSON: &str = include_str!("../../policies/limits.json");

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LimitTable {
    pub max_memory_mb: u64,
    pub max_cpu_percent: u64,
    pub timeout_seconds: u64,
    pub max_disk_mb: u64,
    pub max_bandwidth_mbps: u64,
    pub max_pids: u64,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LimitPolicy {
    pub defaults: LimitTable,
    pub ceilings: LimitTable,
}

/// The largest value any configuration (defaults and ceilings) or manifest may give each
/// limit: beyond them a value is an error naming its key and the maximum, never converted
/// (MB to bytes, seconds to ms) with a chance of overflowing into a tiny limit.
pub const MAXIMA: LimitTable = LimitTable {
    // 1 TiB.
    max_memory_mb: 1 << 20,
    max_cpu_percent: 100,
    // 7 days.
    timeout_seconds: 7 * 86_400,
    // 1 TiB.
    max_disk_mb: 1 << 20,
    // 100 Gbit/s.
    max_bandwidth_mbps: 100_000,
    // The kernel's own pid_max limit.
    max_pids: 4_194_304,
};

impl LimitTable {
    /// The maximum for a field of this table (by its name), from [`MAXIMA`].
    pub fn maximum(field: &str) -> Option<u64> {
        let m = &MAXIMA;
        Some(match field {
            "max_memory_mb" => m.max_memory_mb,
            "max_cpu_percent" => m.max_cpu_percent,
            "timeout_seconds" => m.timeout_seconds,
            "max_disk_mb" => m.max_disk_mb,
            "max_bandwidth_mbps" => m.max_bandwidth_mbps,
            "max_pids" => m.max_pids,
            _ => return None,
        })
    }
}

/// `Some(message)` when `value` is above the maximum of `field` ([`MAXIMA`]).
pub fn above_maximum(field: &str, value: u64) -> Option<String> {
    let max = LimitTable::maximum(field)?;
    (value > max).then(|| {
        let unit = match field {
            "max_memory_mb" | "max_disk_mb" => " (1 TiB)",
            "timeout_seconds" => " (7 days)",
            _ => "",
        };
        format!("{value} is above the maximum {max}{unit}")
    })
}

/// A request that was lowered to a ceiling.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Clamp {
    pub field: &'static str,
    pub requested: u64,
    pub applied: u64,
    pub reason: String,
}

/// The limits a run gets.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct EffectiveLimits {
    pub max_memory_mb: u64,
    pub max_cpu_percent: u64,
    pub timeout_seconds: u64,
    pub max_disk_mb: u64,
    pub max_bandwidth_mbps: u64,
    pub max_pids: u64,
    pub clamped: Vec<Clamp>,
}

impl EffectiveLimits {
    /// Audit each clamp (`limit_clamped`), naming what ran by `subject` (`("executor",
    /// name)`, `("script", path)`).
    pub fn audit_clamps(&self, subject: (&str, &str)) {
        for c in &self.clamped {
            let (requested, applied) = (c.requested.to_string(), c.applied.to_string());
            crate::audit::record(
                "limit_clamped",
                &[subject, ("field", c.field), ("requested", &requested), ("applied", &applied), ("reason", &c.reason)],
            );
        }
    }
}

impl LimitPolicy {
    /// The policy shipped in `policies/limits.json`.
    pub fn builtin() -> Self {
        // The file is compiled in and covered by a unit test; failing here would be a build
        // defect, not user input.
        serde_json::from_str(LIMITS_JSON).expect("policies/limits.json is valid (checked by tests)")
    }

    /// Apply defaults, then ceilings, to a manifest's request.
    pub fn resolve(&self, req: &ResourceLimits) -> EffectiveLimits {
        let mut clamped = Vec::new();
        let mut pick = |field: &'static str, requested: Option<u64>, default: u64, ceiling: u64| -> u64 {
            let want = requested.unwrap_or(default);
            if want > ceiling {
                clamped.push(Clamp {
                    field,
                    requested: want,
                    applied: ceiling,
                    reason: "above the agent's ceiling".into(),
                });
                ceiling
            } else {
                want
            }
        };
        let (d, c) = (&self.defaults, &self.ceilings);
        let max_memory_mb = pick("max_memory_mb", req.max_memory_mb, d.max_memory_mb, c.max_memory_mb);
        let max_cpu_percent = pick("max_cpu_percent", req.max_cpu_percent, d.max_cpu_percent, c.max_cpu_percent);
        let timeout_seconds = pick("timeout_seconds", req.timeout_seconds, d.timeout_seconds, c.timeout_seconds);
        let mut max_disk_mb = pick("max_disk_mb", req.max_disk_mb, d.max_disk_mb, c.max_disk_mb);
        let max_bandwidth_mbps =
            pick("max_bandwidth_mbps", req.max_bandwidth_mbps, d.max_bandwidth_mbps, c.max_bandwidth_mbps);
        let max_pids = pick("max_pids", req.max_pids, d.max_pids, c.max_pids);
        // The scratch tmpfs lives in RAM and its pages are charged to the sandbox's memory
        // cgroup: a scratch larger than the memory limit would turn "disk full" into an OOM kill.
        // Reported only when asked for: the default (100 MB) shrinking to a smaller memory
        // limit is no request clamped (every run under 100 MB listed one that nobody made).
        if max_disk_mb > max_memory_mb {
            if req.max_disk_mb.is_some() {
                clamped.push(Clamp {
                    field: "max_disk_mb",
                    requested: max_disk_mb,
                    applied: max_memory_mb,
                    reason: "scratch is RAM-backed and counts against max_memory_mb".into(),
                });
            }
            max_disk_mb = max_memory_mb;
        }
        EffectiveLimits {
            max_memory_mb,
            max_cpu_percent,
            timeout_seconds,
            max_disk_mb,
            max_bandwidth_mbps,
            max_pids,
            clamped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_policy_matches_design() {
        let p = LimitPolicy::builtin();
        assert_eq!((p.defaults.max_cpu_percent, p.ceilings.max_cpu_percent), (10, 50));
        assert_eq!((p.defaults.max_memory_mb, p.ceilings.max_memory_mb), (128, 512));
        assert_eq!((p.defaults.timeout_seconds, p.ceilings.timeout_seconds), (60, 3600));
        assert_eq!((p.defaults.max_disk_mb, p.ceilings.max_disk_mb), (100, 1024));
        assert_eq!((p.defaults.max_bandwidth_mbps, p.ceilings.max_bandwidth_mbps), (10, 100));
        assert_eq!(p.defaults.max_pids, 64);
    }

    #[test]
    fn defaults_apply_and_ceilings_clamp_loudly() {
        let p = LimitPolicy::builtin();
        let e = p.resolve(&ResourceLimits::default());
        assert_eq!(e.max_memory_mb, 128);
        assert!(e.clamped.is_empty());
        let e =
            p.resolve(&ResourceLimits { max_memory_mb: Some(4096), max_cpu_percent: Some(90), ..Default::default() });
        assert_eq!(e.max_memory_mb, 512);
        assert_eq!(e.max_cpu_percent, 50);
        let fields: Vec<_> = e.clamped.iter().map(|c| c.field).collect();
        assert_eq!(fields, vec!["max_memory_mb", "max_cpu_percent"]);
    }

    #[test]
    fn scratch_never_exceeds_memory() {
        let p = LimitPolicy::builtin();
        // The default scratch (100 MB) fits itself to the memory limit: no clamp reported,
        // nothing was asked for.
        let e = p.resolve(&ResourceLimits { max_memory_mb: Some(64), ..Default::default() });
        assert_eq!(e.max_disk_mb, 64);
        assert!(e.clamped.is_empty(), "{:?}", e.clamped);
        // Asked for: clamped, and reported.
        let e = p.resolve(&ResourceLimits { max_memory_mb: Some(64), max_disk_mb: Some(80), ..Default::default() });
        assert_eq!(e.max_disk_mb, 64);
        assert_eq!((e.clamped[0].field, e.clamped[0].requested), ("max_disk_mb", 80));
    }
}
