"""Tests of the disk-usage executor.

    PYTHONPATH=/path/to/opservant/agent/python python -m pytest -q
    OPSERVANT_BIN=/path/to/target/release/opservant python -m pytest -q   # + the sandboxed test (root)
"""

import json
import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXECUTOR_DIR = os.path.dirname(HERE)

try:
    import s4e_agent  # noqa: F401
except ImportError:  # running from the opservant repository without PYTHONPATH
    sys.path.insert(0, os.path.join(EXECUTOR_DIR, "..", "..", "agent", "python"))

from s4e_agent.testing import ExecutorTestHarness  # noqa: E402


def require_opservant_bin():
    """The sandboxed test runs only with OPSERVANT_BIN set; under CI=true its absence fails.
    Under `opservant executor test` (already inside a sandbox) it is skipped with the reason."""
    if os.environ.get("OPSERVANT_SANDBOXED_SKIP"):
        pytest.skip(os.environ["OPSERVANT_SANDBOXED_SKIP"])
    if not os.environ.get("OPSERVANT_BIN"):
        if os.environ.get("CI") in ("true", "1"):
            pytest.fail("CI=true but OPSERVANT_BIN is not set (e.g. OPSERVANT_BIN=target/release/opservant)")
        pytest.skip("set OPSERVANT_BIN=/path/to/opservant to run the sandboxed test")


@pytest.fixture
def harness():
    return ExecutorTestHarness(os.path.join(EXECUTOR_DIR, "manifest.json"))


def blob(path, size):
    with open(path, "wb") as f:
        f.write(b"x" * size)


@pytest.fixture
def tree(tmp_path):
    """root/
         big/a.bin (3000), big/a-link.bin (hard link to a.bin), big/sub/b.bin (2000),
             big/sub/up -> ..  (a loop)
         small/c.bin (100)
         file.txt (500)
         loop -> .            (a loop to the root itself)
         outside -> ../outside (a directory holding 10 MB, outside the tree)
         outside-file -> ../outside/huge.bin
       outside/huge.bin (10 MB, sparse)
    """
    root = tmp_path / "root"
    (root / "big" / "sub").mkdir(parents=True)
    (root / "small").mkdir()
    blob(root / "big" / "a.bin", 3000)
    os.link(root / "big" / "a.bin", root / "big" / "a-link.bin")
    blob(root / "big" / "sub" / "b.bin", 2000)
    os.symlink("..", root / "big" / "sub" / "up")
    blob(root / "small" / "c.bin", 100)
    blob(root / "file.txt", 500)
    os.symlink(".", root / "loop")
    outside = tmp_path / "outside"
    outside.mkdir()
    with open(outside / "huge.bin", "wb") as f:
        f.truncate(10 * 1000 * 1000)
    os.symlink(str(outside), root / "outside")
    os.symlink(str(outside / "huge.bin"), root / "outside-file")
    return root


def test_directory_top_children_without_following_symlinks(harness, tree):
    result = harness.run(params={"paths": [str(tree)], "top": 3})
    assert result.status == "completed", result
    [entry] = result.output["paths"]
    assert entry["path"] == str(tree)
    assert entry["type"] == "directory"
    assert entry["top"] == [
        {"name": "big", "type": "directory", "size_bytes": 5000},   # the hard link counted once
        {"name": "file.txt", "type": "file", "size_bytes": 500},
        {"name": "small", "type": "directory", "size_bytes": 100},
    ]
    assert entry["size_bytes"] == 5600                               # nothing from outside/
    assert entry["children"] == 6
    assert entry["truncated"] is False
    assert entry["unreadable_directories"] == 0
    assert entry["partial"] is False
    # root: 6 entries; big: a.bin, a-link.bin, sub; sub: b.bin, up; small: c.bin
    assert entry["entries_scanned"] == 12
    # file.txt, a.bin (a-link.bin is the same file), b.bin, c.bin; big, sub, small
    assert entry["files"] == 4
    assert entry["directories"] == 3


def test_symlinks_are_listed_with_size_zero(harness, tree):
    result = harness.run(params={"paths": [str(tree)], "top": 10})
    top = {c["name"]: c for c in result.output["paths"][0]["top"]}
    for name in ("loop", "outside", "outside-file"):
        assert top[name] == {"name": name, "type": "symlink", "size_bytes": 0}
    assert len(top) == 6


def test_filesystem_figures(harness, tree):
    result = harness.run(params={"paths": [str(tree), str(tree / "file.txt")]})
    assert result.status == "completed"
    directory, file = result.output["paths"]
    fs = os.statvfs(str(tree))
    assert directory["total_bytes"] == fs.f_blocks * fs.f_frsize
    for e in (directory, file):
        assert 0 <= e["used_bytes"] <= e["total_bytes"]
        assert 0 <= e["free_bytes"] <= e["total_bytes"]
        assert 0.0 <= e["percent_used"] <= 100.0
    assert len(directory["top"]) == 5                                 # the default top
    assert file["type"] == "file" and file["size_bytes"] == 500 and "top" not in file
    assert "files" not in file and "partial" not in file


def test_top_zero(harness, tree):
    result = harness.run(params={"paths": [str(tree)], "top": 0})
    assert result.status == "completed"
    assert result.output["paths"][0]["top"] == []
    assert result.output["paths"][0]["size_bytes"] == 5600


def test_unreadable_path_gives_an_error_entry_and_partial(harness, tree, tmp_path):
    missing = str(tmp_path / "nope")
    result = harness.run(params={"paths": [missing, str(tree)]})
    assert result.status == "partial"
    assert result.error is None
    first, second = result.output["paths"]
    assert first == {"path": missing, "error": f"cannot read {missing}: No such file or directory (errno 2)"}
    assert second["size_bytes"] == 5600
    assert [r["level"] for r in result.logs] == ["warning", "info"]


def test_walk_stops_after_max_entries(harness, tree, monkeypatch):
    sys.path.insert(0, EXECUTOR_DIR)
    try:
        import disk_usage
    finally:
        sys.path.remove(EXECUTOR_DIR)
    monkeypatch.setattr(disk_usage, "MAX_ENTRIES", 8)
    result = harness.run(params={"paths": [str(tree)]})
    assert result.status == "partial"
    entry = result.output["paths"][0]
    assert entry["truncated"] is True and entry["partial"] is True
    assert entry["entries_scanned"] == 8
    assert entry["size_bytes"] <= 5600
    assert entry["files"] + entry["directories"] <= 8


def test_unreadable_subdirectory_makes_the_entry_partial(harness, tree, monkeypatch):
    """A subdirectory that cannot be listed is skipped and counted; the entry's sizes are lower
    bounds ("partial": true) and the run is partial. (os.scandir is made to refuse big/sub:
    a chmod would not stop root.)"""
    real_scandir = os.scandir
    refused = str(tree / "big" / "sub")

    def scandir(path="."):
        if os.fspath(path) == refused:
            raise PermissionError(13, "Permission denied", refused)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    result = harness.run(params={"paths": [str(tree)]})
    assert result.status == "partial"
    assert result.error is None
    entry = result.output["paths"][0]
    assert entry["unreadable_directories"] == 1
    assert entry["partial"] is True and entry["truncated"] is False
    assert entry["size_bytes"] == 3600                              # b.bin not counted
    assert entry["files"] == 3 and entry["directories"] == 3        # sub is met, not listed


@pytest.mark.parametrize("params, message", [
    ({}, "Missing required parameter: paths"),
    ({"paths": []}, "Missing required parameter: paths"),
    ({"paths": "/usr"}, "Missing required parameter: paths"),
    ({"paths": ["usr/share"]}, "paths[0] must be an absolute path"),
    ({"paths": ["/usr", 3]}, "paths[1] must be an absolute path"),
    ({"paths": ["/usr"], "top": -1}, "top must be an integer"),
    ({"paths": ["/usr"], "top": "5"}, "top must be an integer"),
    ({"paths": ["/usr"], "top": True}, "top must be an integer"),
])
def test_bad_params_are_rejected(harness, params, message):
    result = harness.run(params=params)
    assert result.status == "rejected"
    assert result.error.startswith(message), result.error


def test_sandboxed_declared_and_undeclared_paths(harness):
    """The declared /usr/share/doc is measured; /var/lib exists on the host but is not in the
    sandbox's view, so it is an error entry and the run is partial."""
    require_opservant_bin()
    assert os.path.isdir("/usr/share/doc") and os.path.isdir("/var/lib")
    result = harness.run(params={"paths": ["/usr/share/doc", "/var/lib"], "top": 3}, sandboxed=True,
                         action="act-disk-usage", timeout=300)
    assert result.status == "partial", result.raw
    doc, var = result.output["paths"]
    assert doc["type"] == "directory" and "error" not in doc
    assert 0 < len(doc["top"]) <= 3
    sizes = [c["size_bytes"] for c in doc["top"]]
    assert sizes == sorted(sizes, reverse=True)
    assert doc["files"] > 0 and doc["directories"] >= 0
    assert var == {"path": "/var/lib", "error": "cannot read /var/lib: No such file or directory (errno 2)"}
    assert result.raw["sandbox"]["network"] == "none"


def test_sandboxed_var_log(harness):
    """The declared /var/log is walked; subdirectories the executor's unprivileged user cannot
    list (such as systemd's /var/log/private, mode 0700) make its entry partial."""
    require_opservant_bin()
    assert os.path.isdir("/var/log")
    result = harness.run(params={"paths": ["/var/log"], "top": 3}, sandboxed=True, timeout=300)
    [log] = result.output["paths"]
    assert "error" not in log and log["type"] == "directory", result.raw
    assert log["partial"] == (log["unreadable_directories"] > 0 or log["truncated"])
    assert result.status == ("partial" if log["partial"] else "completed"), result.raw


@pytest.fixture
def shared_tmp():
    """A temporary directory the sandbox can reach: the executor runs as an unprivileged user,
    and pytest's tmp_path lies under a 0700 directory."""
    import pathlib
    import tempfile

    path = tempfile.mkdtemp(prefix="opservant-disk-usage-")
    os.chmod(path, 0o755)
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_sandboxed_unreadable_directory(shared_tmp):
    """A 0700 directory of another user is unreadable for the executor's unprivileged user even
    when declared: it is counted in unreadable_directories and the entry and run are partial.
    The package is copied so its manifest can declare this test's directory."""
    require_opservant_bin()
    package = shared_tmp / "disk-usage"
    shutil.copytree(EXECUTOR_DIR, package, ignore=shutil.ignore_patterns("__pycache__", "tests", ".pytest_cache"))
    data = shared_tmp / "data"
    (data / "open").mkdir(parents=True)
    (data / "closed").mkdir()
    blob(data / "open" / "a.bin", 1000)
    blob(data / "closed" / "b.bin", 2000)
    os.chmod(data / "closed", 0o700)
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["permissions"]["filesystem"]["read"] = [str(data)]
    (package / "manifest.json").write_text(json.dumps(manifest))

    result = ExecutorTestHarness(str(package)).run(params={"paths": [str(data)]}, sandboxed=True, timeout=120)
    assert result.status == "partial", result.raw
    [entry] = result.output["paths"]
    assert entry["unreadable_directories"] == 1 and entry["partial"] is True
    assert entry["size_bytes"] == 1000 and entry["files"] == 1 and entry["directories"] == 2
    assert entry["top"] == [{"name": "open", "type": "directory", "size_bytes": 1000},
                            {"name": "closed", "type": "directory", "size_bytes": 0}]
