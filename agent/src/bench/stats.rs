//! Order statistics of timing samples: nearest-rank percentiles (always an observed sample,
//! never an interpolation), as in benches/README.md.

use std::time::Duration;

/// Order statistics of one row's samples, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Summary {
    pub samples: usize,
    pub min_ms: f64,
    pub median_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Nearest-rank percentile of sorted, non-empty samples: `sorted[ceil(p/100 * n) - 1]`.
/// The median is the 50th percentile in this sense (the lower middle sample when n is even).
pub fn percentile<T: Copy>(sorted: &[T], p: usize) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted.get(rank - 1).copied()
}

/// `None` when there are no samples.
pub fn summarize(samples: &[Duration]) -> Option<Summary> {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let ms = |d: Duration| round3(d.as_secs_f64() * 1e3);
    Some(Summary {
        samples: sorted.len(),
        min_ms: ms(*sorted.first()?),
        median_ms: ms(percentile(&sorted, 50)?),
        p90_ms: ms(percentile(&sorted, 90)?),
        p99_ms: ms(percentile(&sorted, 99)?),
        max_ms: ms(*sorted.last()?),
    })
}

pub fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

pub fn round2(x: f64) -> f64 {
    (x * 1e2).round() / 1e2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<u32> = (1..=200).collect();
        assert_eq!(percentile(&v, 50), Some(100));
        assert_eq!(percentile(&v, 90), Some(180));
        assert_eq!(percentile(&v, 99), Some(198));
        assert_eq!(percentile(&[7u32], 99), Some(7));
        assert_eq!(percentile::<u32>(&[], 50), None);
    }

    #[test]
    fn summary_of_unsorted_samples() {
        let d = |ms: u64| Duration::from_millis(ms);
        let s = summarize(&[d(3), d(1), d(2), d(4)]).unwrap();
        assert_eq!((s.samples, s.min_ms, s.median_ms, s.p90_ms, s.max_ms), (4, 1.0, 2.0, 4.0, 4.0));
        assert!(summarize(&[]).is_none());
    }
}
