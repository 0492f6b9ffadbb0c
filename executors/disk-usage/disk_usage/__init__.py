"""disk-usage: filesystem usage of paths, and the largest entries of directories.

params: {"paths": ["/abs", ...], "top": 5}

For each path: the filesystem's total, used and free bytes and percent used (``os.statvfs``,
computed as ``df`` does), and for a directory the ``top`` largest immediate children by
recursive size and how many files and directories the walk counted.  Sizes are apparent sizes
(``st_size``) of regular files only; symbolic links are never followed (a link counts 0),
hard-linked files are counted once per path, and a walk stops after ``MAX_ENTRIES`` directory
entries with ``"truncated": true``.  A directory entry has ``"partial": true`` when its walk
was truncated or met subdirectories it could not list (sizes and counts are then lower
bounds).  A path that cannot be read gives an entry with ``"error"``.  Status "partial" when
any entry has an error or is partial.
"""

from s4e_agent.executor import BaseExecutor, ExecutorResult

#: Directory entries examined per path before the walk stops ("truncated": true).
MAX_ENTRIES = 100000

DEFAULT_TOP = 5
MAX_TOP = 1000
MAX_PATHS = 64


class DiskUsageExecutor(BaseExecutor):
    """Reports disk usage of paths and the largest children of directories."""

    name = "disk-usage"
    version = "1.0.0"

    def validate(self, params: dict) -> bool:
        import os

        paths = params.get("paths")
        if not isinstance(paths, list) or not paths:
            raise ValueError("Missing required parameter: paths (a non-empty list of absolute paths)")
        if len(paths) > MAX_PATHS:
            raise ValueError(f"paths: at most {MAX_PATHS} paths, got {len(paths)}")
        for i, p in enumerate(paths):
            if not isinstance(p, str) or not os.path.isabs(p) or "\0" in p:
                raise ValueError(f"paths[{i}] must be an absolute path, not {p!r}")
        top = params.get("top", DEFAULT_TOP)
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP:
            raise ValueError(f"top must be an integer from 0 to {MAX_TOP}, not {top!r}")
        return True

    def execute(self, params: dict, context: dict) -> ExecutorResult:
        log = context["logger"]
        top = params.get("top", DEFAULT_TOP)
        entries = []
        for path in params["paths"]:
            entry = _usage(path, top)
            if "error" in entry:
                log.warning("cannot read path", path=path, error=entry["error"])
            entries.append(entry)
        errors = sum(1 for e in entries if "error" in e)
        partial = sum(1 for e in entries if e.get("partial"))
        log.info("disk usage measured", paths=len(entries), errors=errors, partial=partial)
        status = "partial" if errors or partial else "completed"
        return ExecutorResult(status=status, output={"paths": entries})

    def cleanup(self, context: dict):
        pass


def _error(exc):
    return f"{exc.strerror or exc} (errno {exc.errno})" if isinstance(exc, OSError) else str(exc)


def _usage(path, top):
    """The entry for one path (see the module docstring)."""
    import os
    import stat

    entry = {"path": path}
    try:
        st = os.stat(path)  # the path itself is followed: the caller named it
        fs = os.statvfs(path)
    except OSError as exc:
        entry["error"] = f"cannot read {path}: {_error(exc)}"
        return entry
    used = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
    free = fs.f_bavail * fs.f_frsize  # available to unprivileged users, as df reports it
    entry.update(
        total_bytes=fs.f_blocks * fs.f_frsize,
        used_bytes=used,
        free_bytes=free,
        percent_used=round(100.0 * used / (used + free), 1) if used + free else 0.0,
    )
    if stat.S_ISREG(st.st_mode):
        entry.update(type="file", size_bytes=st.st_size)
        return entry
    if not stat.S_ISDIR(st.st_mode):
        entry["type"] = "other"
        return entry

    entry["type"] = "directory"
    walk = _Walk()
    try:
        children = walk.children(path)
    except OSError as exc:
        entry["error"] = f"cannot list {path}: {_error(exc)}"
        return entry
    sizes = []
    for name, kind, size, child in children:
        if kind == "directory" and not walk.truncated:
            size = walk.tree_size(child)
        sizes.append({"name": name, "type": kind, "size_bytes": size})
    sizes.sort(key=lambda c: (-c["size_bytes"], c["name"]))
    entry.update(
        size_bytes=sum(c["size_bytes"] for c in sizes),
        children=len(sizes),
        files=walk.files,
        directories=walk.directories,
        entries_scanned=walk.entries,
        unreadable_directories=walk.unreadable,
        truncated=walk.truncated,
        partial=walk.truncated or walk.unreadable > 0,
        top=sizes[:top],
    )
    return entry


class _Walk:
    """A walk over directory trees sharing one entry budget (MAX_ENTRIES) and one set of
    hard-linked inodes already counted.  Never follows symbolic links.  ``files`` counts the
    regular files whose sizes are summed (a hard-linked file once), ``directories`` the
    subdirectories met (listable or not)."""

    def __init__(self):
        self.entries = 0
        self.files = 0
        self.directories = 0
        self.truncated = False
        self.unreadable = 0
        self.seen = set()

    def _file_size(self, dirent):
        st = dirent.stat(follow_symlinks=False)
        if st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            if key in self.seen:
                return 0
            self.seen.add(key)
        self.files += 1
        return st.st_size

    def children(self, path):
        """[(name, kind, size, path)] of ``path``'s entries; a directory's size is 0 (measured
        later).  OSError when ``path`` cannot be listed."""
        import os

        out = []
        with os.scandir(path) as it:
            for d in it:
                if self.entries >= MAX_ENTRIES:
                    self.truncated = True
                    break
                self.entries += 1
                try:
                    if d.is_symlink():
                        out.append((d.name, "symlink", 0, d.path))
                    elif d.is_dir(follow_symlinks=False):
                        self.directories += 1
                        out.append((d.name, "directory", 0, d.path))
                    elif d.is_file(follow_symlinks=False):
                        out.append((d.name, "file", self._file_size(d), d.path))
                    else:
                        out.append((d.name, "other", 0, d.path))
                except OSError:
                    out.append((d.name, "other", 0, d.path))
        return out

    def tree_size(self, top):
        """Total size of the regular files below ``top`` (iterative, symlinks not followed)."""
        import os

        total = 0
        stack = [top]
        while stack and not self.truncated:
            directory = stack.pop()
            try:
                it = os.scandir(directory)
            except OSError:
                self.unreadable += 1
                continue
            with it:
                for d in it:
                    if self.entries >= MAX_ENTRIES:
                        self.truncated = True
                        break
                    self.entries += 1
                    try:
                        if d.is_dir(follow_symlinks=False):
                            self.directories += 1
                            stack.append(d.path)
                        elif d.is_file(follow_symlinks=False):
                            total += self._file_size(d)
                    except OSError:
                        pass  # vanished or unreadable entry: not counted
        return total
