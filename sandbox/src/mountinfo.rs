//! `/proc/self/mountinfo`, parsed: the mounts of the caller's mount namespace, with their
//! paths unescaped byte for byte (mountinfo writes space, tab, newline and backslash as
//! `\ooo`; any other byte, UTF-8 or not, is kept as it is) — and what they say about where
//! a filesystem's files are shown: a bind mount on the host, or a filesystem mounted twice,
//! shows the same files at more than one path, so a path is also known by what it is in its
//! filesystem ([`FsPath`]), and a recursive bind of a path shows every mount beneath it
//! ([`shown_by`]).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// One line of mountinfo, reduced to what its readers use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The filesystem's device (`major:minor`): mounts with the same one show the same
    /// files.
    pub device: String,
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
            Some(Mount {
                device: String::from_utf8_lossy(pre.get(2)?).into_owned(),
                root: path(pre.get(3)?),
                mount_point: path(pre.get(4)?),
                fstype,
                super_opts,
            })
        })
        .collect()
}

/// What a host path is in its filesystem: the device of the mount it lies on and its path
/// from that filesystem's root. Two paths of one device, one `path` at or beneath the
/// other's, are the same files, wherever each is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsPath {
    pub device: String,
    pub path: PathBuf,
}

/// One place where a bind of a host path shows files: at host path `at`, the tree of
/// filesystem `device` from its directory `root`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    pub at: PathBuf,
    pub device: String,
    pub root: PathBuf,
}

impl Shown {
    /// The host path at which this shows `target`, when `target` is at or beneath what it
    /// shows.
    pub fn place_of(&self, target: &FsPath) -> Option<PathBuf> {
        if target.device != self.device {
            return None;
        }
        target.path.strip_prefix(&self.root).ok().map(|rel| join_rel(&self.at, rel))
    }

    /// Whether everything this shows is `target` or beneath it.
    pub fn is_within(&self, target: &FsPath) -> bool {
        target.device == self.device && self.root.starts_with(&target.path)
    }
}

/// `base` joined with `rel`, where an empty `rel` is `base` itself (no trailing `/`).
fn join_rel(base: &Path, rel: &Path) -> PathBuf {
    if rel.as_os_str().is_empty() {
        base.to_path_buf()
    } else {
        base.join(rel)
    }
}

/// The mount `path` (absolute, without links, `.` or `..`) lies on: of the mounts whose
/// mount point is its longest prefix, the last listed (one stacked on a mount point comes
/// after the one it covers).
pub fn mount_of<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    mounts
        .iter()
        .enumerate()
        .filter(|(_, m)| path.starts_with(&m.mount_point))
        .max_by_key(|(i, m)| (m.mount_point.components().count(), *i))
        .map(|(_, m)| m)
}

/// What `path` (absolute, without links, `.` or `..`; it need not exist) is in its
/// filesystem.
pub fn fs_path(mounts: &[Mount], path: &Path) -> Option<FsPath> {
    let m = mount_of(mounts, path)?;
    let rel = path.strip_prefix(&m.mount_point).ok()?;
    Some(FsPath { device: m.device.clone(), path: join_rel(&m.root, rel) })
}

/// What a recursive bind of `path` (absolute, without links, `.` or `..`) shows: the tree
/// of its own filesystem from `path`, and every mount beneath it — also one a later mount
/// covers (so the answer is never smaller than what is shown).
pub fn shown_by(mounts: &[Mount], path: &Path) -> Vec<Shown> {
    let mut shown = Vec::new();
    if let Some(own) = fs_path(mounts, path) {
        shown.push(Shown { at: path.to_path_buf(), device: own.device, root: own.path });
    }
    for m in mounts.iter().filter(|m| m.mount_point != path && m.mount_point.starts_with(path)) {
        shown.push(Shown { at: m.mount_point.clone(), device: m.device.clone(), root: m.root.clone() });
    }
    shown
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
        assert_eq!(m[0].device, "8:1");
        assert_eq!(m[0].super_opts, vec!["rw", "errors=remount-ro"]);
        assert_eq!(m[1].mount_point, PathBuf::from("/srv/my data/proc"));
        assert_eq!(m[1].fstype, "proc");
        assert_eq!(m[2].root, PathBuf::from("/sub"));
        assert_eq!(m[2].fstype, "tmpfs");
    }

    /// A host with `/srv` a filesystem of its own, `/mnt/alias` a bind of its `/data`, and
    /// `/mnt/alias/deep` a tmpfs.
    fn aliased() -> Vec<Mount> {
        parse(
            b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
              30 22 8:2 / /srv rw - ext4 /dev/sda2 rw\n\
              31 22 8:2 /data /mnt/alias rw - ext4 /dev/sda2 rw\n\
              32 31 0:40 / /mnt/alias/deep rw - tmpfs none rw\n\
              33 30 8:2 /other /srv rw - ext4 /dev/sda2 rw\n",
        )
    }

    #[test]
    fn a_path_is_known_by_what_it_is_in_its_filesystem() {
        let m = aliased();
        let fs = |p: &str| fs_path(&m, Path::new(p)).unwrap();
        assert_eq!(fs("/etc/shadow"), FsPath { device: "8:1".into(), path: "/etc/shadow".into() });
        assert_eq!(fs("/mnt/alias/secret"), FsPath { device: "8:2".into(), path: "/data/secret".into() });
        assert_eq!(fs("/mnt/alias"), FsPath { device: "8:2".into(), path: "/data".into() });
        // The later of two mounts on one mount point is the one on top.
        assert_eq!(fs("/srv/x"), FsPath { device: "8:2".into(), path: "/other/x".into() });
        assert_eq!(fs("/mnt/alias/deep/f"), FsPath { device: "0:40".into(), path: "/f".into() });
        assert_eq!(fs("/mnt"), FsPath { device: "8:1".into(), path: "/mnt".into() });
    }

    #[test]
    fn a_bind_shows_its_own_tree_and_every_mount_beneath_it() {
        let m = aliased();
        let shown = shown_by(&m, Path::new("/mnt"));
        let places: Vec<(&str, &str, &str)> =
            shown.iter().map(|s| (s.at.to_str().unwrap(), s.device.as_str(), s.root.to_str().unwrap())).collect();
        assert_eq!(
            places,
            vec![("/mnt", "8:1", "/mnt"), ("/mnt/alias", "8:2", "/data"), ("/mnt/alias/deep", "0:40", "/")]
        );
        let secret = FsPath { device: "8:2".into(), path: "/data/secret".into() };
        assert_eq!(shown[1].place_of(&secret), Some(PathBuf::from("/mnt/alias/secret")));
        assert_eq!(shown[0].place_of(&secret), None, "another device");
        let data = FsPath { device: "8:2".into(), path: "/data".into() };
        assert_eq!(shown[1].place_of(&data), Some(PathBuf::from("/mnt/alias")));
        assert!(shown[1].is_within(&data));
        assert!(!shown[1].is_within(&secret), "it shows more than the secret");
        // A path not beneath `/mnt` is not shown by it; `/mnt2` is not beneath `/mnt`.
        assert!(shown_by(&m, Path::new("/mnt2")).iter().all(|s| s.at == Path::new("/mnt2")));
    }

    #[test]
    fn reads_this_namespace() {
        let mounts = read().expect("mountinfo");
        assert!(mounts.iter().any(|m| m.mount_point == std::path::Path::new("/proc") && m.fstype == "proc"));
    }
}
