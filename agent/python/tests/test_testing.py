import json
import stat
import sys

import pytest

from opservant.executor import ExecutorResult
from opservant.testing import ExecutorTestHarness, HarnessResult, MockVault, RecordingLogger

pytestmark = pytest.mark.usefixtures("clean_imports")

CONTEXT_ECHO = """
from opservant.executor import BaseExecutor, ExecutorResult

class Echo(BaseExecutor):
    name = "echo"
    version = "1.0.0"

    def validate(self, params):
        if "fail" in params and not isinstance(params["fail"], str):
            raise ValueError("fail must be a string")
        return params.get("accept", True)

    def execute(self, params, context):
        context["logger"].info("executing", keys=sorted(params))
        if params.get("fail") == "raise":
            raise RuntimeError("asked to raise")
        if params.get("fail") == "return":
            return ExecutorResult(status="failed", error="asked to fail", output={"partial": 1})
        secret = None
        if "secret" in params:
            secret = context["vault"].get_secret(params["secret"])
        return ExecutorResult(output={
            "params": params,
            "agent_id": context["agent_id"],
            "network": context["network"],
            "config": context["config"],
            "action": context["action"],
            "secret": secret,
            "context_keys": sorted(context),
        })

    def cleanup(self, context):
        context["logger"].debug("cleaned up")
"""


# --- RecordingLogger ----------------------------------------------------------------------------

def test_recording_logger_levels():
    log = RecordingLogger()
    log.debug("d", a=1)
    log.info("i")
    log.warning("w", b="x")
    log.warn("w2")
    log.error(ValueError("boom"), code=3)
    assert log.records == [
        {"level": "debug", "msg": "d", "fields": {"a": 1}},
        {"level": "info", "msg": "i", "fields": {}},
        {"level": "warning", "msg": "w", "fields": {"b": "x"}},
        {"level": "warning", "msg": "w2", "fields": {}},
        {"level": "error", "msg": "boom", "fields": {"code": 3}},
    ]
    assert log.messages("warning") == ["w", "w2"]
    assert log.messages() == ["d", "i", "w", "w2", "boom"]


def test_recording_logger_exception():
    log = RecordingLogger()
    try:
        raise OSError("disk gone")
    except OSError:
        log.exception("write failed", path="/tmp/x")
    (rec,) = log.records
    assert rec["level"] == "error" and rec["msg"] == "write failed" and rec["fields"]["path"] == "/tmp/x"
    assert "OSError: disk gone" in rec["fields"]["traceback"]


def test_harness_network_default_is_fresh_per_run(make_executor):
    src = """
from opservant.executor import BaseExecutor, ExecutorResult
class E(BaseExecutor):
    def validate(self, params):
        return True
    def execute(self, params, context):
        context["network"]["interfaces"].append({"name": "eth9", "addresses": []})
        return ExecutorResult(output={"n": len(context["network"]["interfaces"])})
"""
    d = make_executor({"h_net.py": src}, "h_net.E")
    h = ExecutorTestHarness(str(d))
    assert h.run({}).output == {"n": 2}
    assert h.run({}).output == {"n": 2}


# --- MockVault ----------------------------------------------------------------------------------

def test_mock_vault_returns_allowed_secret():
    v = MockVault({"api_key": "s3cr3t"}, ["api_key"])
    assert v.get_secret("api_key") == "s3cr3t"
    assert v.accessed == ["api_key"]


def test_mock_vault_refuses_undeclared_secret():
    v = MockVault({"api_key": "s3cr3t", "other": "x"}, ["api_key"])
    with pytest.raises(PermissionError) as info:
        v.get_secret("other")
    assert str(info.value) == "secret 'other' is not declared in permissions.secrets"
    assert v.accessed == []


def test_mock_vault_empty_allowed_refuses_everything():
    with pytest.raises(PermissionError):
        MockVault({"a": "b"}, []).get_secret("a")


def test_mock_vault_unknown_secret():
    with pytest.raises(KeyError, match="'missing' is not set in the mock vault"):
        MockVault({}, ["missing"]).get_secret("missing")
    with pytest.raises(KeyError):
        MockVault({}).get_secret("missing")


def test_mock_vault_without_allowlist_and_repr():
    v = MockVault({"a": "value-never-shown"})
    assert v.get_secret("a") == "value-never-shown"
    assert "value-never-shown" not in repr(v)


# --- the harness in process -----------------------------------------------------------------

def test_harness_completed_with_default_context(make_executor):
    d = make_executor({"h_echo.py": CONTEXT_ECHO}, "h_echo.Echo")
    result = ExecutorTestHarness(str(d / "manifest.json")).run({"x": [1, 2]})
    assert isinstance(result, ExecutorResult) and isinstance(result, HarnessResult)
    assert result.status == "completed" and result.error is None and result.artifacts == []
    out = result.output
    assert out["params"] == {"x": [1, 2]}
    assert out["agent_id"] == "test-agent"
    assert out["network"] == {"local_ip": "127.0.0.1", "subnet": "127.0.0.0/8",
                              "interfaces": [{"name": "lo", "addresses": ["127.0.0.1/8", "::1"]}]}
    assert out["config"] == {} and out["action"] is None
    assert out["context_keys"] == ["action", "agent_id", "command_id", "config", "logger", "network", "vault"]
    assert result.logs == [
        {"level": "info", "msg": "executing", "fields": {"keys": ["x"]}},
        {"level": "debug", "msg": "cleaned up", "fields": {}},
    ]
    assert result.raw == {"status": "completed", "output": out, "error": None, "artifacts": []}


def test_harness_mock_context_overrides(make_executor):
    d = make_executor({"h_over.py": CONTEXT_ECHO}, "h_over.Echo")
    result = ExecutorTestHarness(str(d / "manifest.json")).run(
        {}, mock_context={"agent_id": "ag-test-001", "config": {"k": "v"},
                          "network": {"local_ip": "10.0.0.5"}, "extra": 1},
        action="act-test",
    )
    out = result.output
    assert out["agent_id"] == "ag-test-001"
    assert out["config"] == {"k": "v"}
    assert out["network"] == {"local_ip": "10.0.0.5"}
    assert out["action"] == "act-test"
    assert "extra" in out["context_keys"] and "secrets" not in out["context_keys"]


def test_harness_custom_logger(make_executor):
    d = make_executor({"h_log.py": CONTEXT_ECHO}, "h_log.Echo")
    mine = RecordingLogger()
    result = ExecutorTestHarness(str(d)).run({}, mock_context={"logger": mine})
    assert result.logs is mine.records and len(mine.records) == 2


def test_harness_secrets_respect_manifest(make_executor):
    d = make_executor({"h_sec.py": CONTEXT_ECHO}, "h_sec.Echo",
                      permissions={"secrets": ["firewall_api_key"]})
    h = ExecutorTestHarness(str(d / "manifest.json"))
    ctx = {"secrets": {"firewall_api_key": "k-123", "db_password": "pw"}}
    ok = h.run({"secret": "firewall_api_key"}, mock_context=ctx)
    assert ok.status == "completed" and ok.output["secret"] == "k-123"
    denied = h.run({"secret": "db_password"}, mock_context=ctx)
    assert denied.status == "failed" and denied.output == {}
    assert "PermissionError: secret 'db_password' is not declared in permissions.secrets" in denied.error
    assert denied.raw["output"] is None


def test_harness_no_declared_secrets_denies(make_executor):
    d = make_executor({"h_nosec.py": CONTEXT_ECHO}, "h_nosec.Echo")
    r = ExecutorTestHarness(str(d)).run({"secret": "a"}, mock_context={"secrets": {"a": "b"}})
    assert r.status == "failed" and "PermissionError" in r.error


def test_harness_rejected_failed_and_returned_failure(make_executor):
    d = make_executor({"h_paths.py": CONTEXT_ECHO}, "h_paths.Echo")
    h = ExecutorTestHarness(str(d / "manifest.json"))
    rej = h.run({"fail": 3})
    assert (rej.status, rej.error, rej.output) == ("rejected", "fail must be a string", {})
    assert rej.logs == [{"level": "debug", "msg": "cleaned up", "fields": {}}]
    falsy = h.run({"accept": False})
    assert falsy.status == "rejected" and falsy.error == "validate() returned False"
    raised = h.run({"fail": "raise"})
    assert raised.status == "failed" and "RuntimeError: asked to raise" in raised.error
    assert raised.error.startswith("Traceback")
    returned = h.run({"fail": "return"})
    assert returned == ExecutorResult(status="failed", error="asked to fail", output={"partial": 1})


def test_harness_params_go_through_json(make_executor):
    d = make_executor({"h_json.py": CONTEXT_ECHO}, "h_json.Echo")
    h = ExecutorTestHarness(str(d))
    params = {"ports": (22, 80)}
    assert h.run(params).output["params"] == {"ports": [22, 80]}
    assert params == {"ports": (22, 80)}
    with pytest.raises(TypeError, match="JSON-serialisable"):
        h.run({"s": {1, 2}})


def test_harness_restores_sys_path(make_executor):
    d = make_executor({"h_path.py": CONTEXT_ECHO}, "h_path.Echo")
    before = list(sys.path)
    ExecutorTestHarness(str(d)).run({})
    assert sys.path == before


def test_harness_two_packages_with_the_same_module_name(make_executor):
    src = """
from opservant.executor import BaseExecutor, ExecutorResult
class E(BaseExecutor):
    def validate(self, params):
        return True
    def execute(self, params, context):
        return ExecutorResult(output={"which": %r})
"""
    one = make_executor({"h_same/__init__.py": src % "one"}, "h_same.E", dirname="one")
    two = make_executor({"h_same/__init__.py": src % "two"}, "h_same.E", dirname="two")
    assert ExecutorTestHarness(str(one)).run({}).output == {"which": "one"}
    assert ExecutorTestHarness(str(two)).run({}).output == {"which": "two"}
    assert ExecutorTestHarness(str(one)).run({}).output == {"which": "one"}


def test_harness_lazy_sibling_import_inside_execute(make_executor):
    d = make_executor({
        "h_lazy.py": """
from opservant.executor import BaseExecutor, ExecutorResult
class E(BaseExecutor):
    def validate(self, params):
        return True
    def execute(self, params, context):
        import h_lazy_helper
        return ExecutorResult(output={"v": h_lazy_helper.VALUE})
""",
        "h_lazy_helper.py": "VALUE = 7\n",
    }, "h_lazy.E")
    assert ExecutorTestHarness(str(d)).run({}).output == {"v": 7}


def test_harness_entry_point_outside_package_raises(make_executor):
    d = make_executor({}, "json.JSONDecoder")
    with pytest.raises(ImportError, match="outside the executor package"):
        ExecutorTestHarness(str(d)).run({})


def test_harness_load_errors_raise(make_executor):
    d = make_executor({"h_err.py": "X = 1\n"}, "h_err.Missing")
    with pytest.raises(AttributeError, match="Missing"):
        ExecutorTestHarness(str(d)).run({})


def test_harness_manifest_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        ExecutorTestHarness(str(tmp_path / "manifest.json"))
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="no entry_point"):
        ExecutorTestHarness(str(tmp_path / "manifest.json"))
    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(ValueError, match="JSON object"):
        ExecutorTestHarness(str(tmp_path))
    # A key given twice, at any depth, is refused as the agent refuses it.
    (tmp_path / "manifest.json").write_text('{"entry_point": "a.B", "permissions": {"secrets": [], "secrets": ["x"]}}')
    with pytest.raises(ValueError, match="duplicate key 'secrets'"):
        ExecutorTestHarness(str(tmp_path))


def test_harness_relative_manifest_path(make_executor, monkeypatch):
    d = make_executor({"h_rel.py": CONTEXT_ECHO}, "h_rel.Echo")
    monkeypatch.chdir(str(d))
    h = ExecutorTestHarness("./manifest.json")
    assert h.package_dir == str(d)
    monkeypatch.chdir("/")
    assert h.run({}).status == "completed"


# --- sandboxed: error paths only (the real path is covered by the Rust integration tests) ------

def test_sandboxed_without_binary(make_executor, monkeypatch, tmp_path):
    d = make_executor({"h_sb.py": CONTEXT_ECHO}, "h_sb.Echo")
    monkeypatch.delenv("OPSERVANT_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="OPSERVANT_BIN"):
        ExecutorTestHarness(str(d)).run({}, sandboxed=True)


def _fake_binary(tmp_path, script):
    path = tmp_path / "fake-opservant"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_sandboxed_exit_2_raises_with_stderr(make_executor, monkeypatch, tmp_path):
    d = make_executor({"h_sb2.py": CONTEXT_ECHO}, "h_sb2.Echo")
    monkeypatch.setenv("OPSERVANT_BIN", _fake_binary(tmp_path, 'echo "invalid manifest: bad" >&2\nexit 2\n'))
    with pytest.raises(RuntimeError, match="invalid manifest: bad"):
        ExecutorTestHarness(str(d)).run({}, sandboxed=True)


def test_sandboxed_no_result_json_raises(make_executor, monkeypatch, tmp_path):
    d = make_executor({"h_sb3.py": CONTEXT_ECHO}, "h_sb3.Echo")
    monkeypatch.setenv("OPSERVANT_BIN", _fake_binary(tmp_path, "echo garbage\nexit 1\n"))
    with pytest.raises(RuntimeError, match="without a result JSON"):
        ExecutorTestHarness(str(d)).run({}, sandboxed=True)


def test_sandboxed_command_line_and_result(make_executor, monkeypatch, tmp_path):
    # A stand-in for the binary that records its arguments and prints a result; it checks the
    # harness's side of the contract only.
    d = make_executor({"h_sb4.py": CONTEXT_ECHO}, "h_sb4.Echo")
    args_file = tmp_path / "args"
    result = {"status": "timeout", "output": None, "error": "killed", "artifacts": [],
              "logs": [{"level": "info", "msg": "m", "fields": {}}], "exit_code": None,
              "killed_by": "timeout"}
    script = 'for a in "$@"; do printf "%%s\\n" "$a"; done > %s\necho \'%s\'\nexit 1\n' % (
        args_file, json.dumps(result))
    monkeypatch.setenv("OPSERVANT_BIN", _fake_binary(tmp_path, script))
    r = ExecutorTestHarness(str(d)).run({"a": 1}, sandboxed=True, action="act-test", timeout=30)
    assert args_file.read_text().splitlines() == [
        "run", str(d), "--params", json.dumps({"a": 1}), "--action", "act-test"]
    assert r.status == "timeout" and r.output == {} and r.error == "killed"
    assert r.logs == result["logs"] and r.raw == result
