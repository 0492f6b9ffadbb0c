import pytest

from opservant._lifecycle import run_lifecycle
from opservant.executor import BaseExecutor, ExecutorResult, ValidationError
from opservant.testing import RecordingLogger

KEYS = {"status", "output", "error", "artifacts"}


def make(validate=lambda self, p: True, execute=None, cleanup=None, init=None):
    """Build an executor class that records the calls made on it in cls.calls."""
    calls = []

    def _validate(self, params):
        calls.append("validate")
        return validate(self, params)

    def _execute(self, params, context):
        calls.append("execute")
        if execute is None:
            return ExecutorResult(output={"params": params})
        return execute(self, params, context)

    def _cleanup(self, context):
        calls.append("cleanup")
        if cleanup is not None:
            cleanup(self, context)

    def _init(self):
        calls.append("init")
        if init is not None:
            init(self)

    cls = type(
        "Exec", (BaseExecutor,),
        {"validate": _validate, "execute": _execute, "cleanup": _cleanup, "__init__": _init},
    )
    cls.calls = calls
    return cls


def ctx():
    return {"agent_id": "a", "logger": RecordingLogger(), "config": {}}


def raise_(exc):
    def f(*args):
        raise exc
    return f


def test_completed():
    cls = make()
    res = run_lifecycle(cls, {"x": 1}, ctx())
    assert res == {"status": "completed", "output": {"params": {"x": 1}}, "error": None, "artifacts": []}
    assert cls.calls == ["init", "validate", "execute", "cleanup"]


def test_partial_result_passed_through():
    cls = make(execute=lambda s, p, c: ExecutorResult("partial", {"n": 1}, "half", ["/tmp/a"]))
    res = run_lifecycle(cls, {}, ctx())
    assert res == {"status": "partial", "output": {"n": 1}, "error": "half", "artifacts": ["/tmp/a"]}


def test_validate_value_error_rejects_without_execute():
    cls = make(validate=raise_(ValueError("Missing required parameter: ports")))
    res = run_lifecycle(cls, {}, ctx())
    assert res == {"status": "rejected", "output": None,
                   "error": "Missing required parameter: ports", "artifacts": []}
    assert cls.calls == ["init", "validate", "cleanup"]


def test_validate_value_error_subclasses_reject():
    cls = make(validate=raise_(ValidationError("bad host")))
    res = run_lifecycle(cls, {}, ctx())
    assert (res["status"], res["error"]) == ("rejected", "bad host")
    assert "execute" not in cls.calls


def test_validate_empty_value_error_has_a_message():
    res = run_lifecycle(make(validate=raise_(ValueError())), {}, ctx())
    assert res["status"] == "rejected" and res["error"] == "ValueError"


def test_validate_false_rejects():
    cls = make(validate=lambda s, p: False)
    res = run_lifecycle(cls, {}, ctx())
    assert res == {"status": "rejected", "output": None, "error": "validate() returned False", "artifacts": []}
    assert cls.calls == ["init", "validate", "cleanup"]


@pytest.mark.parametrize("value", [None, 0, "", [], {}])
def test_validate_other_falsy_rejects(value):
    cls = make(validate=lambda s, p: value)
    res = run_lifecycle(cls, {}, ctx())
    assert res["status"] == "rejected"
    assert res["error"].startswith("validate() returned False")
    assert type(value).__name__ in res["error"]
    assert cls.calls == ["init", "validate", "cleanup"]


def test_validate_truthy_non_bool_accepts():
    res = run_lifecycle(make(validate=lambda s, p: "yes"), {}, ctx())
    assert res["status"] == "completed"


def test_validate_other_exception_fails_with_traceback():
    cls = make(validate=raise_(KeyError("target_host")))
    res = run_lifecycle(cls, {}, ctx())
    assert res["status"] == "failed" and res["output"] is None
    assert res["error"].startswith("Traceback (most recent call last):")
    assert "KeyError: 'target_host'" in res["error"]
    assert cls.calls == ["init", "validate", "cleanup"]


def test_validate_result_whose_truth_raises_fails():
    class Ambiguous:
        def __bool__(self):
            raise RuntimeError("ambiguous truth value")

    cls = make(validate=lambda s, p: Ambiguous())
    res = run_lifecycle(cls, {}, ctx())
    assert res["status"] == "failed" and "ambiguous truth value" in res["error"]
    assert cls.calls == ["init", "validate", "cleanup"]


def test_validate_result_whose_truth_raises_value_error_fails_not_rejects():
    class ArrayLike:  # numpy raises ValueError from bool(array)
        def __bool__(self):
            raise ValueError("The truth value of an array is ambiguous")

    cls = make(validate=lambda s, p: ArrayLike())
    res = run_lifecycle(cls, {}, ctx())
    assert res["status"] == "failed" and res["error"].startswith("Traceback")
    assert cls.calls == ["init", "validate", "cleanup"]


def test_execute_exception_fails_with_traceback():
    def boom(self, params, context):
        raise ConnectionRefusedError("port 22 refused")

    cls = make(execute=boom)
    res = run_lifecycle(cls, {}, ctx())
    assert set(res) == KEYS
    assert res["status"] == "failed"
    assert res["output"] is None
    assert res["artifacts"] == []
    assert res["error"].startswith("Traceback (most recent call last):")
    assert "ConnectionRefusedError: port 22 refused" in res["error"]
    assert "in boom" in res["error"]  # the executor's own frame is in the traceback
    assert cls.calls == ["init", "validate", "execute", "cleanup"]


@pytest.mark.parametrize("value, name", [(None, "NoneType"), ({"status": "completed"}, "dict"), ("ok", "str")])
def test_execute_non_result_fails(value, name):
    cls = make(execute=lambda s, p, c: value)
    res = run_lifecycle(cls, {}, ctx())
    assert res == {"status": "failed", "output": None,
                   "error": "execute() returned %s, not an ExecutorResult" % name, "artifacts": []}
    assert cls.calls == ["init", "validate", "execute", "cleanup"]


def test_execute_result_subclass_accepted():
    class MyResult(ExecutorResult):
        __slots__ = ()

    res = run_lifecycle(make(execute=lambda s, p, c: MyResult(output={"a": 1})), {}, ctx())
    assert res["status"] == "completed" and res["output"] == {"a": 1}


def test_execute_result_mutated_into_invalid_shape_fails():
    def mutate(self, params, context):
        r = ExecutorResult()
        r.output = ["not", "a", "dict"]
        return r

    res = run_lifecycle(make(execute=mutate), {}, ctx())
    assert res["status"] == "failed"
    assert res["error"].startswith("execute() returned an invalid ExecutorResult: ")
    assert "output must be a dict" in res["error"]


def test_execute_cannot_claim_runtime_status():
    res = run_lifecycle(make(execute=lambda s, p, c: ExecutorResult._internal("timeout", {}, None, [])), {}, ctx())
    assert res["status"] == "failed" and "status must be one of" in res["error"]


def test_constructor_exception_fails_without_cleanup():
    cls = make(init=raise_(OSError("no device")))
    res = run_lifecycle(cls, {}, ctx())
    assert res["status"] == "failed" and res["output"] is None
    assert "OSError: no device" in res["error"]
    assert cls.calls == ["init"]


def test_constructor_requiring_arguments_fails():
    class NeedsArgs(BaseExecutor):
        def __init__(self, x):
            pass

    res = run_lifecycle(NeedsArgs, {}, ctx())
    assert res["status"] == "failed" and "TypeError" in res["error"]


@pytest.mark.parametrize("variant", ["completed", "rejected", "falsy", "validate-error", "execute-error", "bad-return"])
def test_cleanup_runs_exactly_once(variant):
    counter = []

    def ex(s, p, c):
        if variant == "execute-error":
            raise RuntimeError("x")
        if variant == "bad-return":
            return 42
        return ExecutorResult()

    def va(s, p):
        if variant == "rejected":
            raise ValueError("no")
        if variant == "validate-error":
            raise RuntimeError("x")
        return variant != "falsy"

    cls = make(validate=va, execute=ex, cleanup=lambda s, c: counter.append(c))
    context = ctx()
    run_lifecycle(cls, {}, context)
    assert len(counter) == 1 and counter[0] is context
    assert cls.calls.count("cleanup") == 1 and cls.calls[-1] == "cleanup"


@pytest.mark.parametrize("validate, status", [(lambda s, p: True, "completed"), (lambda s, p: False, "rejected")])
def test_cleanup_exception_is_logged_and_result_unchanged(validate, status):
    cls = make(validate=validate, cleanup=raise_(RuntimeError("socket already closed")))
    context = ctx()
    res = run_lifecycle(cls, {"a": 1}, context)
    assert res["status"] == status
    if status == "completed":
        assert res == {"status": "completed", "output": {"params": {"a": 1}}, "error": None, "artifacts": []}
    records = context["logger"].records
    assert len(records) == 1
    assert records[0]["level"] == "error" and records[0]["msg"] == "cleanup failed"
    assert "RuntimeError: socket already closed" in records[0]["fields"]["error"]
    assert records[0]["fields"]["error"].startswith("Traceback")


def test_cleanup_exception_after_execute_failure_keeps_execute_error():
    cls = make(execute=raise_(RuntimeError("first")), cleanup=raise_(RuntimeError("second")))
    context = ctx()
    res = run_lifecycle(cls, {}, context)
    assert res["status"] == "failed" and "first" in res["error"] and "second" not in res["error"]
    assert "second" in context["logger"].records[0]["fields"]["error"]


def test_cleanup_exception_without_logger_goes_to_stderr(capsys):
    cls = make(cleanup=raise_(RuntimeError("nolog")))
    res = run_lifecycle(cls, {}, {})
    assert res["status"] == "completed"
    assert "cleanup failed" in capsys.readouterr().err


def test_cleanup_exception_with_broken_logger_is_contained(capsys):
    class BadLogger:
        def error(self, *a, **k):
            raise RuntimeError("logger down")

    cls = make(cleanup=raise_(RuntimeError("c")))
    res = run_lifecycle(cls, {}, {"logger": BadLogger()})
    assert res["status"] == "completed"
    assert "cleanup failed" in capsys.readouterr().err


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()])
def test_base_exceptions_propagate_after_cleanup(exc):
    cls = make(execute=raise_(exc))
    with pytest.raises(type(exc)):
        run_lifecycle(cls, {}, ctx())
    assert cls.calls == ["init", "validate", "execute", "cleanup"]


def test_system_exit_in_validate_propagates():
    cls = make(validate=raise_(SystemExit(0)))
    with pytest.raises(SystemExit):
        run_lifecycle(cls, {}, ctx())
    assert cls.calls[-1] == "cleanup"


def test_duck_typed_executor_without_cleanup():
    class Duck:
        def validate(self, params):
            return True

        def execute(self, params, context):
            return ExecutorResult(output={"duck": True})

    assert run_lifecycle(Duck, {}, ctx())["output"] == {"duck": True}


def test_base_executor_not_overridden_fails_clearly():
    class Lazy(BaseExecutor):
        pass

    res = run_lifecycle(Lazy, {}, ctx())
    assert res["status"] == "failed"
    assert "NotImplementedError: Lazy.validate(params) is not implemented" in res["error"]


def test_params_and_context_passed_through():
    seen = {}

    def ex(self, params, context):
        seen["p"], seen["c"] = params, context
        return ExecutorResult()

    p, c = {"k": [1]}, ctx()
    run_lifecycle(make(execute=ex), p, c)
    assert seen["p"] is p and seen["c"] is c
