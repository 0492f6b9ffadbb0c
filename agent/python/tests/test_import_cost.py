"""The package is imported by every sandboxed run: it must not pull in heavy modules."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ["json", "re", "traceback", "inspect", "typing", "dataclasses", "logging",
         "importlib.util", "socket", "subprocess", "os", "shutil"]


@pytest.mark.parametrize("modules", [
    "opservant.executor, opservant._lifecycle",
    "opservant",
    "s4e_agent.executor",
    "s4e_agent.testing, opservant.testing",
])
def test_no_heavy_imports(modules):
    code = (
        "import sys; sys.path.insert(0, %r); before = set(sys.modules); import %s; "
        "print(' '.join(sorted(set(sys.modules) - before)))" % (ROOT, modules)
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", code],
                         capture_output=True, text=True, check=True).stdout.split()
    assert not set(out) & set(HEAVY), out
    assert all(m.split(".")[0] in ("opservant", "s4e_agent") for m in out), out
