"""Tests of the port-scanner executor (seed 000's PortScanExecutor).

    PYTHONPATH=/path/to/opservant/agent/python python -m pytest -q
    OPSERVANT_BIN=/path/to/target/release/opservant python -m pytest -q   # + the sandboxed test (root)
"""

import os
import socket
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


@pytest.fixture
def ports():
    """(open_port, closed_port) on 127.0.0.1: a listening socket, and a socket bound but not
    listening (so nobody else can take the port while the test runs; connecting is refused)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserved.bind(("127.0.0.1", 0))
    try:
        yield listener.getsockname()[1], reserved.getsockname()[1]
    finally:
        listener.close()
        reserved.close()


def test_open_and_closed_port(harness, ports):
    open_port, closed_port = ports
    result = harness.run(
        params={"target_host": "127.0.0.1", "ports": [open_port, closed_port]},
        mock_context={"agent_id": "ag-test-001"},
    )
    assert result.status == "completed", result.error
    assert result.error is None
    assert result.output == {
        "host": "127.0.0.1",
        "ports": [
            {"port": open_port, "status": "open"},
            {"port": closed_port, "status": "closed"},
        ],
    }


@pytest.mark.parametrize("missing", ["target_host", "ports"])
def test_missing_parameter_is_rejected(harness, missing):
    params = {"target_host": "127.0.0.1", "ports": [22]}
    del params[missing]
    result = harness.run(params=params)
    assert result.status == "rejected"
    assert result.error == f"Missing required parameter: {missing}"
    assert result.output == {}


def test_sandboxed_loopback_is_private(harness, ports):
    """In the sandbox only a private loopback exists: the host's listener is not reachable."""
    require_opservant_bin()
    open_port, closed_port = ports
    result = harness.run(
        params={"target_host": "127.0.0.1", "ports": [open_port, closed_port]},
        sandboxed=True,
        action="act-port-scan",
        timeout=120,
    )
    assert result.status == "completed", result.raw
    assert [p["status"] for p in result.output["ports"]] == ["closed", "closed"]
    assert result.raw["exit_code"] == 0
    assert result.raw["sandbox"]["network"] == "none"
    assert result.raw["action"] == "act-port-scan"
