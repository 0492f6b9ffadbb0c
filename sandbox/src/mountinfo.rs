//! `/proc/self/mountinfo`, parsed: the mounts of the caller's mount namespace, with their
//! paths unescaped byte for byte (mountinfo writes space, tab, newline and backslash as
//! `\ooo`; any other byte, UTF-8 or not, is kept as it is).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

/// One line of mountinfo, reduced to what its readers use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The directory of its filesystem mounted here (`/` for a whole filesystem).
    pub root: PathBuf,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// The filesystem type (`proc`, `cgroup2`, …).
    pub fstype: String,
    /// The superblock's options.
    pub super_opts: Vec<String>,
}

/// The caller's mounts, in mountinfo's order (parents before what is mounted on them).
pub fn read() -> std::io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read("/proc/self/mountinfo")?))
}

/// Lines that do not have mountinfo's shape are skipped.
pub fn parse(text: &[u8]) -> Vec<Mount> {
    text.split(|&b| b == b'\n')
        .filter_map(|line| {
            let sep = line.windows(3).position(|w| w == b" - ")?;
            let pre: Vec<&[u8]> = line[..sep].split(|&b| b == b' ').collect();
            let mut post = line[sep + 3..].split(|&b| b == b' ');
            let fstype = String::from_utf8_lossy(post.next()?).into_owned();
            let _source = post.next();
            let super_opts = post
                .next()
                .map(|o| o.split(|&b| b == b',').map(|s| String::from_utf8_lossy(s).into_owned()).collect())
                .unwrap_or_default();
            Some(Mount { root: path(pre.get(3)?), mount_point: path(pre.get(4)?), fstype, super_opts })
        })
        .collect()
}

fn path(field: &[u8]) -> PathBuf {
    PathBuf::from(OsString::from_vec(unescape(field)))
}

/// `\ooo` (three octal digits) → that byte; anything else as it is.
pub fn unescape(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'\\' && i + 4 <= s.len() && s[i + 1..i + 4].iter().all(|d| (b'0'..=b'7').contains(d)) {
            let v = s[i + 1..i + 4].iter().fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
            if let Ok(b) = u8::try_from(v) {
                out.push(b);
                i += 4;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_paths_byte_for_byte() {
        assert_eq!(unescape(b"/a\\040b"), b"/a b");
        assert_eq!(unescape(b"/plain"), b"/plain");
        assert_eq!(unescape(b"/x\\"), b"/x\\");
        assert_eq!(unescape(b"/\\777"), b"/\\777", "not a byte");
        assert_eq!(unescape(b"/\\134n\xff"), b"/\\n\xff");
    }

    #[test]
    fn parses_lines_with_and_without_optional_fields() {
        let text = b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro\n\
            35 22 0:5 / /srv/my\\040data/proc rw,nosuid - proc proc rw\n\
            garbage\n\
            40 22 0:33 /sub /mnt ro master:7 shared:9 - tmpfs none ro,size=4k\n";
        let m = parse(text);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].mount_point, PathBuf::from("/"));
        assert_eq!(m[0].fstype, "ext4");
        assert_eq!(m[0].super_opts, vec!["rw", "errors=remount-ro"]);
        assert_eq!(m[1].mount_point, PathBuf::from("/srv/my data/proc"));
        assert_eq!(m[1].fstype, "proc");
        assert_eq!(m[2].root, PathBuf::from("/sub"));
        assert_eq!(m[2].fstype, "tmpfs");
    }

    #[test]
    fn reads_this_namespace() {
        let mounts = read().expect("mountinfo");
        assert!(mounts.iter().any(|m| m.mount_point == std::path::Path::new("/proc") && m.fstype == "proc"));
    }
}
