//! Helpers shared by the benchmarks (included with `mod common;`): the ones `opservant
//! bench` uses too, from the agent library, under the names the benchmarks use.
#![allow(unused_imports)]

pub use agent::bench::stats::{percentile, round2, round3 as ms3};
pub use agent::bench::{in_ci, kernel_release, which};

/// `2026-04-28T12:00:00Z` for seconds since the epoch.
pub fn utc_iso8601(secs: u64) -> String {
    agent::rfc3339::format(i64::try_from(secs).unwrap_or(i64::MAX))
}

/// Measured rounds: `OPSERVANT_BENCH_ROUNDS` when set (a positive integer), else `default`.
pub fn rounds(default: usize) -> Result<usize, String> {
    match std::env::var("OPSERVANT_BENCH_ROUNDS") {
        Err(_) => Ok(default),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("OPSERVANT_BENCH_ROUNDS must be a positive integer, got {v:?}")),
        },
    }
}
