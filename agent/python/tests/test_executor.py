import pathlib

import pytest

import opservant
from opservant.executor import BaseExecutor, ExecutorError, ExecutorResult, ValidationError


def test_defaults():
    r = ExecutorResult()
    assert r.status == "completed"
    assert r.output == {}
    assert r.error is None
    assert r.artifacts == []
    assert r.to_dict() == {"status": "completed", "output": {}, "error": None, "artifacts": []}


def test_defaults_are_not_shared():
    a, b = ExecutorResult(), ExecutorResult()
    a.output["x"] = 1
    a.artifacts.append("/tmp/f")
    assert b.output == {} and b.artifacts == []


@pytest.mark.parametrize("status", ["completed", "failed", "partial"])
def test_valid_statuses(status):
    assert ExecutorResult(status=status).status == status


@pytest.mark.parametrize("status", ["rejected", "timeout", "ok", "", None, "COMPLETED", 1, ["completed"]])
def test_invalid_status(status):
    with pytest.raises(ValueError, match="status must be one of"):
        ExecutorResult(status=status)


@pytest.mark.parametrize("output", [[], "x", 1, ("a", 1)])
def test_output_must_be_dict(output):
    with pytest.raises(TypeError, match="output must be a dict"):
        ExecutorResult(output=output)


def test_error_must_be_str_or_none():
    assert ExecutorResult(status="failed", error="boom").error == "boom"
    with pytest.raises(TypeError, match="error must be a str"):
        ExecutorResult(status="failed", error=ValueError("boom"))


def test_artifacts():
    r = ExecutorResult(artifacts=["/tmp/a.txt", {"name": "report", "data": "…"}])
    assert r.artifacts == ["/tmp/a.txt", {"name": "report", "data": "…"}]
    with pytest.raises(TypeError, match="artifacts must be a list"):
        ExecutorResult(artifacts=("/tmp/a",))
    with pytest.raises(TypeError, match=r"artifacts\[1\] must be a str path, bytes or a dict"):
        ExecutorResult(artifacts=["/tmp/a", 3])


def test_binary_artifacts_are_copied_as_bytes():
    buf = bytearray(b"\x00\x01")
    r = ExecutorResult(artifacts=[b"raw", buf, memoryview(b"mv")])
    buf[0] = 0xFF
    assert r.artifacts == [b"raw", b"\x00\x01", b"mv"]
    assert all(type(a) is bytes for a in r.artifacts)


def test_pathlike_artifacts_become_str():
    r = ExecutorResult(artifacts=[pathlib.Path("/tmp/x")])
    assert r.artifacts == ["/tmp/x"] and type(r.artifacts[0]) is str


def test_repr_and_eq():
    r = ExecutorResult(status="partial", output={"a": 1}, error="e", artifacts=["/x"])
    assert repr(r) == "ExecutorResult(status='partial', output={'a': 1}, error='e', artifacts=['/x'])"
    assert r == ExecutorResult(status="partial", output={"a": 1}, error="e", artifacts=["/x"])
    assert r != ExecutorResult(status="partial", output={"a": 2}, error="e", artifacts=["/x"])
    assert r != {"status": "partial"}
    with pytest.raises(TypeError):
        hash(r)


def test_internal_skips_status_validation():
    r = ExecutorResult._internal("rejected", None, "bad params", [])
    assert isinstance(r, ExecutorResult)
    assert r.to_dict() == {"status": "rejected", "output": None, "error": "bad params", "artifacts": []}
    assert ExecutorResult._internal("timeout").artifacts == []


def test_slots():
    r = ExecutorResult()
    with pytest.raises(AttributeError):
        r.something = 1


def test_base_executor_defaults():
    assert BaseExecutor.name == "" and BaseExecutor.version == ""
    e = BaseExecutor()
    with pytest.raises(NotImplementedError, match="validate"):
        e.validate({})
    with pytest.raises(NotImplementedError, match="execute"):
        e.execute({}, {})
    assert e.cleanup({}) is None


def test_error_types():
    assert issubclass(ValidationError, ValueError)
    assert issubclass(ValidationError, ExecutorError)
    assert issubclass(ExecutorError, Exception)


def test_package_exports():
    assert opservant.BaseExecutor is BaseExecutor
    assert opservant.ExecutorResult is ExecutorResult
    assert opservant.__version__ == "0.1.0"
