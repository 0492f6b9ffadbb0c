import json
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture
def clean_imports():
    """Restore sys.path and drop modules imported by the test afterwards."""
    saved_path = sys.path[:]
    saved_modules = set(sys.modules)
    yield
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        del sys.modules[name]


@pytest.fixture
def make_executor(tmp_path):
    """Write an executor package: make_executor(files={relpath: source}, entry_point=..., **manifest)."""

    def make(files, entry_point, dirname="executor", **manifest_fields):
        root = tmp_path / dirname
        root.mkdir(parents=True, exist_ok=True)
        for rel, source in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
        manifest = {
            "name": "test-executor",
            "version": "1.0.0",
            "description": "test",
            "supported_actions": ["act-test"],
            "entry_point": entry_point,
            "permissions": {},
        }
        manifest.update(manifest_fields)
        (root / "manifest.json").write_text(json.dumps(manifest))
        return root

    return make
