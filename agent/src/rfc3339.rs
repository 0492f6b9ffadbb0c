//! RFC 3339 date-times in UTC, without a calendar crate: what command timestamps and audit
//! records are written in. Guarantees: `parse(format(t)) == Some(t)` for every `t`; parsing
//! accepts only `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)` with fields in range.

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds since the epoch of an RFC 3339 date-time (`2026-04-28T12:00:00Z`, optional
/// fraction, `Z` or `±HH:MM`).
pub fn parse(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        t.bytes().all(|c| c.is_ascii_digit()).then(|| t.parse().ok()).flatten()
    };
    let (y, mo, d, h, mi, se) = (num(0..4)?, num(5..7)?, num(8..10)?, num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=days_in_month(y, mo)).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let mut rest = &s[19..];
    if let Some(frac) = rest.strip_prefix('.') {
        let n = frac.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return None;
        }
        rest = &frac[n..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ => {
            let rb = rest.as_bytes();
            if rb.len() != 6 || !matches!(rb[0], b'+' | b'-') || rb[3] != b':' {
                return None;
            }
            let digits = |r: std::ops::Range<usize>| -> Option<i64> {
                let t = rest.get(r)?;
                t.bytes().all(|c| c.is_ascii_digit()).then(|| t.parse().ok()).flatten()
            };
            let (oh, om) = (digits(1..3)?, digits(4..6)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let sign = if rb[0] == b'-' { -1 } else { 1 };
            sign * (oh * 3600 + om * 60)
        }
    };
    Some(days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + se - offset)
}

/// Days in month `m` (1–12) of year `y`, proleptic Gregorian.
fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// `2026-04-28T12:00:00Z` for seconds since the epoch.
pub fn format(t: i64) -> String {
    let (y, m, d) = civil_from_days(t.div_euclid(86_400));
    let secs = t.rem_euclid(86_400);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

/// `2026-04-28T12:00:00.123456Z` (microseconds) for a system time.
pub fn format_micros(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (y, m, day) = civil_from_days(secs.div_euclid(86_400));
    let rem = secs.rem_euclid(86_400);
    format!("{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z", rem / 3600, rem % 3600 / 60, rem % 60, d.subsec_micros())
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (the inverse of
/// [`days_from_civil`]).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

pub fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trip() {
        for t in [0i64, 951_782_400, 1_777_377_600, 4_102_444_799, -1] {
            assert_eq!(parse(&format(t)), Some(t), "{t}");
        }
        assert_eq!(parse("2026-04-28T14:00:00+02:00"), parse("2026-04-28T12:00:00Z"));
        assert_eq!(parse("2026-04-28T12:00:00.123Z"), parse("2026-04-28T12:00:00Z"));
        for good in
            ["2024-02-29T00:00:00Z", "2000-02-29T00:00:00Z", "2026-12-31T23:59:60Z", "2026-01-31T00:00:00-23:59"]
        {
            assert!(parse(good).is_some(), "{good}");
        }
        for bad in [
            "2026-04-28",
            "2026-13-01T00:00:00Z",
            "2026-04-28T12:00:00",
            "x026-04-28T12:00:00Z",
            "2026-04-28T12:00:00+2:00",
            "2026-02-30T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2100-02-29T00:00:00Z",
            "2026-04-31T00:00:00Z",
            "2026-04-28T12:00:00+99:00",
            "2026-04-28T12:00:00+01:60",
            "2026-04-28T12:00:00+-1:00",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn micros() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_micros(1_795_355_101_123_456);
        assert_eq!(format_micros(t), "2026-11-22T13:45:01.123456Z");
    }
}
