"""Local test harness for executors (seed 000: ``from s4e_agent.testing import ExecutorTestHarness``).

    harness = ExecutorTestHarness("./manifest.json")
    result = harness.run(params={...}, mock_context={"agent_id": "ag-test-001"})
    assert result.status == "completed"

``run()`` runs the executor in this process with a mock context (``RecordingLogger``,
``MockVault``) by default, or in the real sandbox through the ``opservant`` binary with
``sandboxed=True``.
"""

import sys

from .executor import ExecutorResult

__all__ = ["ExecutorTestHarness", "HarnessResult", "MockVault", "RecordingLogger"]


class RecordingLogger:
    """A structured logger that records every call: ``logger.info("msg", key=value)`` appends
    ``{"level": "info", "msg": "msg", "fields": {"key": value}}`` to ``records``."""

    def __init__(self):
        self.records = []

    def log(self, level, msg, **fields):
        self.records.append({"level": str(level), "msg": str(msg), "fields": fields})

    def debug(self, msg, **fields):
        self.log("debug", msg, **fields)

    def info(self, msg, **fields):
        self.log("info", msg, **fields)

    def warning(self, msg, **fields):
        self.log("warning", msg, **fields)

    warn = warning

    def error(self, msg, **fields):
        self.log("error", msg, **fields)

    def exception(self, msg, **fields):
        """Like ``error``, with the current exception's traceback in ``fields["traceback"]``."""
        import traceback

        fields.setdefault("traceback", traceback.format_exc())
        self.log("error", msg, **fields)

    def messages(self, level=None):
        """The recorded messages, optionally only those of one level."""
        return [r["msg"] for r in self.records if level is None or r["level"] == level]

    def __repr__(self):
        return "RecordingLogger(%d records)" % len(self.records)


class MockVault:
    """A vault holding ``secrets`` (name → value).  With ``allowed`` (the manifest's
    ``permissions.secrets``) not None, reading any other name raises PermissionError, as the
    real vault does.  ``accessed`` lists the names successfully read."""

    def __init__(self, secrets=None, allowed=None):
        self._secrets = dict(secrets or {})
        self.allowed = None if allowed is None else list(allowed)
        self.accessed = []

    def get_secret(self, name):
        if self.allowed is not None and name not in self.allowed:
            raise PermissionError("secret %r is not declared in permissions.secrets" % (name,))
        try:
            value = self._secrets[name]
        except KeyError:
            raise KeyError(
                "secret %r is not set in the mock vault (pass it in mock_context['secrets'])" % (name,)
            ) from None
        self.accessed.append(name)
        return value

    def __repr__(self):
        # Never show the values.
        return "MockVault(names=%r, allowed=%r)" % (sorted(self._secrets), self.allowed)


class HarnessResult(ExecutorResult):
    """An ``ExecutorResult`` as returned by the harness, plus ``logs`` (the logger's records) and
    ``raw`` (the complete result dict: the lifecycle's in process, the CLI's JSON when
    sandboxed).  ``status`` may also be "rejected" (or, sandboxed, "timeout")."""

    __slots__ = ("logs", "raw")


def _default_network():
    # The shape the runtime reports inside a sandbox without egress (loopback only).
    return {
        "local_ip": "127.0.0.1",
        "subnet": "127.0.0.0/8",
        "interfaces": [{"name": "lo", "addresses": ["127.0.0.1/8", "::1"]}],
    }


# Top-level module name -> real package dir the harness last imported it from, so that two
# executors using the same module name can be tested in one process.
_LOADED_FROM = {}


class ExecutorTestHarness:
    """Runs the executor described by ``manifest_path`` (a manifest.json, or the directory
    holding one; that directory is the executor package)."""

    def __init__(self, manifest_path):
        import json
        import os

        path = os.fspath(manifest_path)
        if os.path.isdir(path):
            path = os.path.join(path, "manifest.json")
        def no_duplicates(pairs):
            # As the agent: a key given twice is an error, never resolved.
            seen = {}
            for key, value in pairs:
                if key in seen:
                    raise ValueError("%s: duplicate key %r in the manifest" % (path, key))
                seen[key] = value
            return seen

        with open(path, encoding="utf-8") as f:
            manifest = json.load(f, object_pairs_hook=no_duplicates)
        if not isinstance(manifest, dict):
            raise ValueError("%s: the manifest must be a JSON object" % path)
        entry_point = manifest.get("entry_point")
        if not isinstance(entry_point, str) or not entry_point:
            raise ValueError("%s: the manifest has no entry_point ('module.ClassName')" % path)
        self.manifest_path = os.path.abspath(path)
        self.package_dir = os.path.dirname(self.manifest_path)
        self.manifest = manifest

    def run(self, params, mock_context=None, sandboxed=False, action=None, timeout=None):
        """Run the executor once and return a ``HarnessResult``.

        In process (default): ``params`` are passed through a JSON round trip (as the runtime
        delivers them), and the context is ``agent_id`` "test-agent", a loopback-only
        ``network`` (as in a sandbox without egress), a ``MockVault`` of
        ``mock_context["secrets"]`` restricted to the manifest's ``permissions.secrets``, a
        ``RecordingLogger``, ``config`` {}, ``action`` and ``command_id`` None; any other key of
        ``mock_context`` overrides the default of the same name.  ``timeout`` is not
        enforced in process.  Errors loading the entry point are raised.

        ``sandboxed=True``: runs ``opservant run PACKAGE_DIR --params JSON [--action A]`` (binary
        from ``$OPSERVANT_BIN`` or ``opservant`` on PATH) with the real sandbox, limits and
        context; ``mock_context`` is ignored; ``timeout`` (seconds) bounds the whole command
        (``subprocess.TimeoutExpired``).  Raises RuntimeError when the binary is missing or
        could not run the executor (exit status 2).  With ``OPSERVANT_SANDBOXED_SKIP`` set (as
        ``opservant executor test`` does: its tests already run in a sandbox) the calling test
        is skipped with that reason (``pytest.skip``).
        """
        if sandboxed:
            return self._run_sandboxed(params, action, timeout)
        return self._run_in_process(params, mock_context, action)

    def _run_in_process(self, params, mock_context, action):
        import importlib
        import json
        import os

        from ._lifecycle import load_executor_class, run_lifecycle

        try:
            params = json.loads(json.dumps(params))
        except (TypeError, ValueError) as exc:
            raise TypeError("params must be JSON-serialisable (the runtime receives JSON): %s" % exc) from None
        mock_context = dict(mock_context or {})
        permissions = self.manifest.get("permissions") or {}
        allowed = (permissions.get("secrets") or []) if isinstance(permissions, dict) else []
        logger = RecordingLogger()
        context = {
            "agent_id": "test-agent",
            "network": _default_network(),
            "vault": MockVault(mock_context.pop("secrets", {}), allowed),
            "logger": logger,
            "config": {},
            "action": action,
            "command_id": None,
        }
        context.update(mock_context)

        entry_point = self.manifest["entry_point"]
        top = entry_point.split(".", 1)[0]
        pkg_real = os.path.realpath(self.package_dir)
        previous = _LOADED_FROM.get(top)
        if previous is not None and previous != pkg_real:
            # The same module name was imported from another executor package: forget it.
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
        saved_path = sys.path[:]
        try:
            while self.package_dir in sys.path:
                sys.path.remove(self.package_dir)
            sys.path.insert(0, self.package_dir)
            importlib.invalidate_caches()
            cls = load_executor_class(entry_point, self.package_dir)
            _LOADED_FROM[top] = pkg_real
            raw = run_lifecycle(cls, params, context)
        finally:
            sys.path[:] = saved_path

        log = context.get("logger")
        logs = log.records if isinstance(log, RecordingLogger) else []
        return _make_result(raw, logs)

    def _run_sandboxed(self, params, action, timeout):
        import json
        import os
        import shutil
        import subprocess

        # Under `opservant executor test` the tests already run inside a sandbox, which
        # cannot build another one: the test is skipped, with the reason the agent gives.
        skip_reason = os.environ.get("OPSERVANT_SANDBOXED_SKIP")
        if skip_reason:
            import pytest

            pytest.skip(skip_reason)
        binary = os.environ.get("OPSERVANT_BIN") or shutil.which("opservant")
        if not binary:
            raise RuntimeError(
                "sandboxed=True needs the opservant binary: set OPSERVANT_BIN=/path/to/opservant "
                "(e.g. target/release/opservant) or put opservant on PATH"
            )
        cmd = [binary, "run", self.package_dir, "--params", json.dumps(params)]
        if action is not None:
            cmd += ["--action", action]
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout)
        stderr = proc.stderr.decode("utf-8", "replace").strip()
        if proc.returncode == 2:
            raise RuntimeError(
                "opservant could not run the executor (exit status 2): %s" % (stderr or "(no message)")
            )
        stdout = proc.stdout.decode("utf-8", "replace").strip()
        result = None
        for candidate in (stdout, stdout.rpartition("\n")[2]):
            try:
                result = json.loads(candidate)
                break
            except ValueError:
                continue
        if not isinstance(result, dict):
            raise RuntimeError(
                "opservant exited with status %d without a result JSON on stdout; stderr: %s"
                % (proc.returncode, stderr or "(empty)")
            )
        return _make_result(result, result.get("logs", []))


def _make_result(raw, logs):
    output = raw.get("output")
    res = HarnessResult._internal(
        raw.get("status"),
        output if output is not None else {},
        raw.get("error"),
        raw.get("artifacts") or [],
    )
    res.logs = logs
    res.raw = raw
    return res
