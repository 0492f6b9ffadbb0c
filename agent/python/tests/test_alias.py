import socket

import pytest

pytestmark = pytest.mark.usefixtures("clean_imports")

# Seed 000's example executor, verbatim.
PORT_SCANNER = '''
from s4e_agent.executor import BaseExecutor, ExecutorResult
class PortScanExecutor(BaseExecutor):
    """Scans specified ports on a target host."""
    name = "port-scanner"
    version = "1.0.0"
    def validate(self, params: dict) -> bool:
        """Validate input parameters before execution."""
        required = ["target_host", "ports"]
        for field in required:
            if field not in params:
                raise ValueError(f"Missing required parameter: {field}")
        return True
    def execute(self, params: dict, context: dict) -> ExecutorResult:
        """Run the executor logic."""
        import socket
        target = params["target_host"]
        ports = params["ports"]
        results = []
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(2)
            status = "open" if sock.connect_ex((target, port)) == 0 else "closed"
            results.append({"port": port, "status": status})
            sock.close()
        return ExecutorResult(
            status="completed",
            output={"host": target, "ports": results}
        )
    def cleanup(self, context: dict):
        """Release resources after execution."""
        pass
'''

SEED_MANIFEST = {
    "author": "security-team",
    "requirements": {"python": ">=3.9", "packages": []},
    "permissions": {
        "network": {"outbound": True, "allowed_ports": [1, 65535]},
        "filesystem": {"read": ["/etc/opservant/config.yaml"], "write": ["/tmp/opservant/"]},
    },
    "resource_limits": {"max_memory_mb": 256, "max_cpu_percent": 25, "timeout_seconds": 300},
}


def test_alias_exports_the_same_objects():
    import opservant
    import opservant.executor
    import opservant.testing
    import s4e_agent
    import s4e_agent.executor
    import s4e_agent.testing

    assert s4e_agent.BaseExecutor is opservant.BaseExecutor
    assert s4e_agent.__version__ == opservant.__version__
    for name in opservant.executor.__all__:
        assert getattr(s4e_agent.executor, name) is getattr(opservant.executor, name)
    for name in opservant.testing.__all__:
        assert getattr(s4e_agent.testing, name) is getattr(opservant.testing, name)
    assert s4e_agent.executor.__all__ == opservant.executor.__all__


def test_seed_000_executor_through_the_harness(make_executor):
    from s4e_agent.testing import ExecutorTestHarness

    d = make_executor({"port_scanner.py": PORT_SCANNER}, "port_scanner.PortScanExecutor",
                      name="port-scanner", **SEED_MANIFEST)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    open_port = listener.getsockname()[1]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]  # bound, not listening: refused
    try:
        harness = ExecutorTestHarness(str(d / "manifest.json"))
        result = harness.run(
            params={"target_host": "127.0.0.1", "ports": [open_port, closed_port]},
            mock_context={"agent_id": "ag-test-001"},
        )
    finally:
        listener.close()
        closed.close()
    assert result.status == "completed"
    assert len(result.output["ports"]) == 2
    assert result.output == {"host": "127.0.0.1", "ports": [
        {"port": open_port, "status": "open"}, {"port": closed_port, "status": "closed"}]}

    rejected = harness.run(params={"target_host": "127.0.0.1"})
    assert rejected.status == "rejected"
    assert rejected.error == "Missing required parameter: ports"


def test_seed_000_result_isinstance_check(make_executor):
    # An executor importing the alias returns a result the runtime accepts.
    from opservant._lifecycle import load_executor_class, run_lifecycle

    d = make_executor({"port_scanner_b.py": PORT_SCANNER}, "port_scanner_b.PortScanExecutor")
    cls = load_executor_class("port_scanner_b.PortScanExecutor", str(d))
    res = run_lifecycle(cls, {"target_host": "127.0.0.1", "ports": []}, {})
    assert res == {"status": "completed", "output": {"host": "127.0.0.1", "ports": []},
                   "error": None, "artifacts": []}
