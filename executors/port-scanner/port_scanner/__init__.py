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
