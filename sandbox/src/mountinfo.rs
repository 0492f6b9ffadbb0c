//! `/proc/self/mountinfo`, parsed: the mounts of the caller's mount namespace, with their
//! paths unescaped byte for byte (mountinfo writes space, tab, newline and backslash as
//! `\ooo`; any other byte, UTF-8 or not, is kept as it is) — and what they say about where
//! a filesystem's files are shown: a bind mount on the host, or a filesystem mounted twice,
//! shows the same files at more than one path, so a path is also known by what it is in its
//! filesystem ([`MountTable::own_tree`]), and a recursive bind of a path shows every mount
//! beneath it ([`MountTable::shown_by`]).

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// One line of mountinfo, reduced to what its readers use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The mount's id, and that of the mount it is mounted on.
    pub id: u32,
    pub parent: u32,
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

/// The caller's mounts, in mountinfo's order (not the mount tree's: a mount moved onto
/// another keeps its older, smaller id).
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
            let number = |i: usize| std::str::from_utf8(pre.get(i)?).ok()?.parse::<u32>().ok();
            Some(Mount {
                id: number(0)?,
                parent: number(1)?,
                device: String::from_utf8_lossy(pre.get(2)?).into_owned(),
                root: path(pre.get(3)?),
                mount_point: path(pre.get(4)?),
                fstype,
                super_opts,
            })
        })
        .collect()
}

/// One place where a host path shows files: at host path `at`, the tree of filesystem
/// `device` from its directory `root`. Two of them with the same device, one's `root` at or
/// beneath the other's, show the same files, wherever each is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    pub at: PathBuf,
    pub device: String,
    pub root: PathBuf,
}

impl Shown {
    /// The host path at which this shows the root of `other`, when `other` shows its
    /// filesystem at or beneath what this shows.
    pub fn place_of(&self, other: &Shown) -> Option<PathBuf> {
        if other.device != self.device {
            return None;
        }
        other.root.strip_prefix(&self.root).ok().map(|rel| join_rel(&self.at, rel))
    }

    /// Whether everything this shows is shown by `other` too (its root at or beneath
    /// `other`'s).
    pub fn is_within(&self, other: &Shown) -> bool {
        other.device == self.device && self.root.starts_with(&other.root)
    }

    /// Whether this and `other` show any file in common.
    pub fn overlaps(&self, other: &Shown) -> bool {
        self.is_within(other) || other.is_within(self)
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

/// A mount table indexed for the questions above: which mount a path is on costs the
/// depth of the path, and which mounts lie beneath it a scan of the table only when any
/// does (a host may have thousands of mounts, and a declared path is checked against every
/// listed path).
///
/// Which mount a path is on follows the mount tree by ids (a mount stacked on another has it
/// as parent; one on an ancestor hides those beneath it), not mountinfo's order. A mount
/// whose `root` does not say which directory it shows — NFS writes `/` for a bind of any
/// directory of an export, and a root ending in `//deleted` names a file or directory since
/// replaced — counts as a filesystem of its own, alias of nothing (so it is judged by its
/// paths alone, as before). Kernels since 4.11 keep one mount per (parent, mount point)
/// (mounts propagated under another are tucked beneath it); every kernel Landlock runs on is
/// one.
#[derive(Debug, Default)]
pub struct MountTable {
    mounts: Vec<Mount>,
    /// Per mount: the filesystem it shows, as compared (its device, or unique: see above).
    fs: Vec<String>,
    /// (parent id, mount point) → the mounts there on that parent.
    children: HashMap<(u32, PathBuf), Vec<usize>>,
    /// Every directory with a mount point strictly beneath it.
    above_a_mount: HashSet<PathBuf>,
    /// The mount on top at `/`.
    root: Option<usize>,
}

impl MountTable {
    pub fn new(mounts: Vec<Mount>) -> MountTable {
        let mut children: HashMap<(u32, PathBuf), Vec<usize>> = HashMap::new();
        let mut above_a_mount = HashSet::new();
        let mut fs = Vec::with_capacity(mounts.len());
        for (i, m) in mounts.iter().enumerate() {
            let unknown_root = matches!(m.fstype.as_str(), "nfs" | "nfs4")
                || m.root.as_os_str().as_encoded_bytes().ends_with(b"//deleted");
            fs.push(if unknown_root { format!("{}@{}", m.device, m.id) } else { m.device.clone() });
            children.entry((m.parent, m.mount_point.clone())).or_default().push(i);
            for a in m.mount_point.ancestors().skip(1) {
                if !above_a_mount.insert(a.to_path_buf()) {
                    break;
                }
            }
        }
        let mut table = MountTable { mounts, fs, children, above_a_mount, root: None };
        // The bottom mount at `/` is the one not mounted on another mount at `/`.
        let at_root: Vec<usize> =
            (0..table.mounts.len()).filter(|&i| table.mounts[i].mount_point == Path::new("/")).collect();
        let bottom = at_root.iter().copied().find(|&i| {
            let parent = table.mounts[i].parent;
            !at_root.iter().any(|&j| table.mounts[j].id == parent && j != i)
        });
        table.root = bottom.map(|i| table.climb(i));
        table
    }

    /// The caller's mount table now.
    pub fn read() -> std::io::Result<MountTable> {
        Ok(MountTable::new(read()?))
    }

    pub fn mounts(&self) -> &[Mount] {
        &self.mounts
    }

    /// Whether the table says which mount `/` is. It does not in a chroot into a directory
    /// that is not a mount point (the kernel lists only mounts reachable from the root), and
    /// then no path's own tree is known.
    pub fn places_root(&self) -> bool {
        self.root.is_some()
    }

    /// The mount on top of the stack that mount `i` begins at its mount point.
    fn climb(&self, mut i: usize) -> usize {
        // Bounded: a stack is at most the table (ids cannot loop in a real table; a forged
        // one stops here).
        for _ in 0..self.mounts.len() {
            let m = &self.mounts[i];
            match self.children.get(&(m.id, m.mount_point.clone())).and_then(|c| c.last()) {
                Some(&up) if up != i => i = up,
                _ => break,
            }
        }
        i
    }

    /// The mount `path` (absolute, without links, `.` or `..`) lies on: from the mount on top
    /// at `/`, down the mount tree through each of its ancestors that has a mount on the
    /// mount it is on.
    fn mount_of(&self, path: &Path) -> Option<usize> {
        let mut cur = self.root?;
        let mut at = PathBuf::from("/");
        for c in path.components().skip(1) {
            at.push(c);
            if let Some(&child) = self.children.get(&(self.mounts[cur].id, at.clone())).and_then(|v| v.last()) {
                cur = self.climb(child);
            }
        }
        Some(cur)
    }

    /// What `path` (absolute, without links, `.` or `..`; it need not exist) is in its
    /// filesystem: the tree its own mount shows from it.
    pub fn own_tree(&self, path: &Path) -> Option<Shown> {
        let i = self.mount_of(path)?;
        let m = &self.mounts[i];
        let rel = path.strip_prefix(&m.mount_point).ok()?;
        Some(Shown { at: path.to_path_buf(), device: self.fs[i].clone(), root: join_rel(&m.root, rel) })
    }

    /// Every mount strictly beneath `path` — also one another mount covers (so the answer is
    /// never smaller than what is shown). A scan of the table only when there is any.
    pub fn mounts_beneath(&self, path: &Path) -> Vec<Shown> {
        if !self.above_a_mount.contains(path) {
            return Vec::new();
        }
        (0..self.mounts.len())
            .filter(|&i| self.mounts[i].mount_point != path && self.mounts[i].mount_point.starts_with(path))
            .map(|i| Shown {
                at: self.mounts[i].mount_point.clone(),
                device: self.fs[i].clone(),
                root: self.mounts[i].root.clone(),
            })
            .collect()
    }

    /// Everything `path` (absolute, without links, `.` or `..`) shows, as a recursive bind of
    /// it does: its [`Self::own_tree`] first, then [`Self::mounts_beneath`] it.
    pub fn shown_by(&self, path: &Path) -> Vec<Shown> {
        let mut shown: Vec<Shown> = self.own_tree(path).into_iter().collect();
        shown.extend(self.mounts_beneath(path));
        shown
    }
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
        assert_eq!((m[0].id, m[0].parent, m[0].device.as_str()), (22, 1, "8:1"));
        assert_eq!(m[0].super_opts, vec!["rw", "errors=remount-ro"]);
        assert_eq!(m[1].mount_point, PathBuf::from("/srv/my data/proc"));
        assert_eq!(m[1].fstype, "proc");
        assert_eq!(m[2].root, PathBuf::from("/sub"));
        assert_eq!(m[2].fstype, "tmpfs");
    }

    /// A host with `/srv` a filesystem of its own (with a bind of its `/other` stacked on
    /// it), `/mnt/alias` a bind of its `/data`, and `/mnt/alias/deep` a tmpfs — `/proc`
    /// listed before `/`, as on real hosts.
    fn aliased() -> Vec<Mount> {
        parse(
            b"21 22 0:21 / /proc rw - proc proc rw\n\
              22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
              30 22 8:2 / /srv rw - ext4 /dev/sda2 rw\n\
              31 22 8:2 /data /mnt/alias rw - ext4 /dev/sda2 rw\n\
              32 31 0:40 / /mnt/alias/deep rw - tmpfs none rw\n\
              33 30 8:2 /other /srv rw - ext4 /dev/sda2 rw\n",
        )
    }

    fn shown(at: &str, device: &str, root: &str) -> Shown {
        Shown { at: at.into(), device: device.into(), root: root.into() }
    }

    #[test]
    fn a_path_is_known_by_what_it_is_in_its_filesystem() {
        let m = MountTable::new(aliased());
        let own = |p: &str| m.own_tree(Path::new(p)).unwrap();
        assert_eq!(own("/etc/shadow"), shown("/etc/shadow", "8:1", "/etc/shadow"));
        assert_eq!(own("/mnt/alias/secret"), shown("/mnt/alias/secret", "8:2", "/data/secret"));
        assert_eq!(own("/mnt/alias"), shown("/mnt/alias", "8:2", "/data"));
        // A mount stacked on another (its parent) is the one on top.
        assert_eq!(own("/srv/x"), shown("/srv/x", "8:2", "/other/x"));
        assert_eq!(own("/mnt/alias/deep/f"), shown("/mnt/alias/deep/f", "0:40", "/f"));
        assert_eq!(own("/mnt"), shown("/mnt", "8:1", "/mnt"));
    }

    /// Which mount a path is on follows the tree, not the listing: a mount moved onto a
    /// mount point keeps its older id (listed first, on top), and a mount on an ancestor
    /// hides what is mounted beneath it.
    #[test]
    fn the_mount_on_top_is_found_by_the_tree_not_the_listing() {
        // `/etc` bound at `/mnt/stage` (39), a tmpfs on `/srv/x` (40), the bind moved onto it.
        let moved = MountTable::new(parse(
            b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
              39 40 8:1 /etc /srv/x rw - ext4 /dev/sda1 rw\n\
              40 22 0:50 / /srv/x rw - tmpfs t rw\n",
        ));
        assert_eq!(moved.own_tree(Path::new("/srv/x/ssh")), Some(shown("/srv/x/ssh", "8:1", "/etc/ssh")));
        // A tmpfs on `/srv/ssh` (30), then `/etc` bound on `/srv` (40): `/srv/ssh` is `/etc/ssh`.
        let hidden = MountTable::new(parse(
            b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
              30 22 0:40 / /srv/ssh rw - tmpfs t rw\n\
              40 22 8:1 /etc /srv rw - ext4 /dev/sda1 rw\n",
        ));
        assert_eq!(hidden.own_tree(Path::new("/srv/ssh")), Some(shown("/srv/ssh", "8:1", "/etc/ssh")));
        // The hidden tmpfs still counts as shown beneath `/srv` (never less than is shown).
        assert_eq!(
            hidden.shown_by(Path::new("/srv")),
            vec![shown("/srv", "8:1", "/etc"), shown("/srv/ssh", "0:40", "/")]
        );
        // A mount stacked on `/` itself (a service's namespace: its root bound onto `/`,
        // the parent not listed) is the root.
        let stacked = MountTable::new(parse(
            b"21 22 0:21 / /proc rw - proc proc rw\n\
              22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
              23 22 8:1 /sysroot / rw - ext4 /dev/sda1 rw\n",
        ));
        assert_eq!(stacked.own_tree(Path::new("/etc")), Some(shown("/etc", "8:1", "/sysroot/etc")));
        // NFS's roots and replaced ones say nothing: each such mount is a filesystem of its own.
        let nfs = MountTable::new(parse(
            b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
              50 22 0:53 / /mnt/nfs rw - nfs4 server:/export rw\n\
              51 22 0:53 / /var/lib/app rw - nfs4 server:/export/app rw\n\
              52 22 8:1 /srv/key//deleted /run/key rw - ext4 /dev/sda1 rw\n",
        ));
        let a = nfs.own_tree(Path::new("/mnt/nfs/x")).unwrap();
        let b = nfs.own_tree(Path::new("/var/lib/app/x")).unwrap();
        assert_eq!((a.device.as_str(), a.root.to_str().unwrap()), ("0:53@50", "/x"));
        assert!(!a.overlaps(&b), "{a:?} {b:?}");
        let key = nfs.own_tree(Path::new("/run/key")).unwrap();
        assert!(!key.overlaps(&nfs.own_tree(Path::new("/srv/key")).unwrap()));
        // A chroot into a directory that is not a mount point: `/` is not placed, which its
        // readers must treat as an error (no path's own tree is known).
        let chroot = MountTable::new(parse(b"70 48 0:40 / /proc rw - proc proc rw\n"));
        assert!(!chroot.places_root());
        assert_eq!(chroot.own_tree(Path::new("/etc")), None);
        assert!(nfs.places_root());
        // A forged table whose stack at `/` loops ends.
        let looped = MountTable::new(parse(
            b"22 21 8:1 / / rw - ext4 /dev/sda1 rw\n\
              23 22 8:1 /a / rw - ext4 /dev/sda1 rw\n\
              22 23 8:1 /b / rw - ext4 /dev/sda1 rw\n",
        ));
        assert!(looped.own_tree(Path::new("/x")).is_some());
    }

    #[test]
    fn a_bind_shows_its_own_tree_and_every_mount_beneath_it() {
        let m = MountTable::new(aliased());
        let all = m.shown_by(Path::new("/mnt"));
        assert_eq!(
            all,
            vec![
                shown("/mnt", "8:1", "/mnt"),
                shown("/mnt/alias", "8:2", "/data"),
                shown("/mnt/alias/deep", "0:40", "/")
            ]
        );
        let secret = shown("/srv/data/secret", "8:2", "/data/secret");
        assert_eq!(all[1].place_of(&secret), Some(PathBuf::from("/mnt/alias/secret")));
        assert_eq!(all[0].place_of(&secret), None, "another device");
        assert!(all[1].overlaps(&secret) && secret.overlaps(&all[1]));
        assert!(!all[1].is_within(&secret), "it shows more than the secret");
        assert!(secret.is_within(&all[1]));
        let data = shown("/srv/data", "8:2", "/data");
        assert_eq!(all[1].place_of(&data), Some(PathBuf::from("/mnt/alias")));
        assert!(all[1].is_within(&data));
        assert!(!all[0].overlaps(&data) && !all[2].overlaps(&data));
        // A path not beneath `/mnt` is not shown by it; `/mnt2` is not beneath `/mnt`.
        assert_eq!(m.shown_by(Path::new("/mnt2")), vec![shown("/mnt2", "8:1", "/mnt2")]);
        assert_eq!(m.mounts_beneath(Path::new("/etc")), vec![]);
        assert_eq!(m.mounts_beneath(Path::new("/mnt/alias")), vec![shown("/mnt/alias/deep", "0:40", "/")]);
    }

    #[test]
    fn reads_this_namespace() {
        let mounts = read().expect("mountinfo");
        assert!(mounts.iter().any(|m| m.mount_point == std::path::Path::new("/proc") && m.fstype == "proc"));
    }
}
