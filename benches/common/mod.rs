//! Helpers shared by the benchmarks (included with `mod common;`).
#![allow(dead_code)]

use std::ffi::CStr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

pub fn kernel_release() -> String {
    // SAFETY: utsname is plain data; uname fills it with NUL-terminated fields.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut uts) } != 0 {
        return "unknown".into();
    }
    // SAFETY: uname succeeded, so `release` is NUL-terminated within the array.
    unsafe { CStr::from_ptr(uts.release.as_ptr()) }.to_string_lossy().into_owned()
}

pub fn utc_iso8601(secs: u64) -> String {
    let t = secs as libc::time_t;
    // SAFETY: tm is plain data; gmtime_r only writes through the pointers it is given.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::gmtime_r(&t, &mut tm) }.is_null() {
        return String::new();
    }
    let (y, mo, d, h, mi, s) = (tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

pub fn ms3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

pub fn round2(x: f64) -> f64 {
    (x * 1e2).round() / 1e2
}
