"""The executor runtime inside the sandbox (not part of the public API).

Runs in the sandbox's embedded interpreter, after every OS restriction is in place. It talks
to the agent only through the native `_opservant` module, which owns the application
channel: arguments come in, logs, secret requests and the result go out. Nothing here is
trusted by the agent; it only spares executors from knowing the protocol.
"""

import sys

import _opservant


class _Vault:
    """`context["vault"]`: secrets by name, granted by the agent only for declared names."""

    __slots__ = ()

    def get_secret(self, name):
        return _opservant.secret(str(name))


class _Logger:
    """`context["logger"]`: structured records forwarded to the agent."""

    __slots__ = ()

    def _log(self, level, msg, fields):
        _opservant.log(level, str(msg), {str(k): _plain(v) for k, v in fields.items()})

    def debug(self, msg, **fields):
        self._log("debug", msg, fields)

    def info(self, msg, **fields):
        self._log("info", msg, fields)

    def warning(self, msg, **fields):
        self._log("warning", msg, fields)

    warn = warning

    def error(self, msg, **fields):
        self._log("error", msg, fields)

    def exception(self, msg, **fields):
        import traceback

        fields.setdefault("traceback", traceback.format_exc())
        self._log("error", msg, fields)


def _plain(value):
    """A JSON-representable version of a log field."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _failed(error):
    return {"status": "failed", "output": None, "error": error, "artifacts": []}


def _traceback():
    import traceback

    return traceback.format_exc()


def _collect_artifacts(items):
    out = []
    for item in items or []:
        path = item if isinstance(item, str) else (item.get("path") if isinstance(item, dict) else None)
        if not isinstance(path, str):
            out.append({"path": repr(item), "error": "an artifact is a path string or a dict with 'path'"})
            continue
        try:
            out.append(_opservant.artifact(path))
        except OSError as e:
            out.append({"path": path, "error": str(e)})
    return out


def run_executor():
    args = _opservant.args()
    context = {
        "agent_id": args["agent_id"],
        "network": _opservant.network(),
        "vault": _Vault(),
        "logger": _Logger(),
        "config": args["config"],
        "action": args["action"],
        "command_id": args["command_id"],
    }
    from opservant._lifecycle import load_executor_class, run_lifecycle

    try:
        cls = load_executor_class(args["entry_point"], args["package_dir"])
    except Exception:
        result = _failed("cannot load entry point %r:\n%s" % (args["entry_point"], _traceback()))
    else:
        try:
            result = run_lifecycle(cls, args["params"], context)
        except BaseException as e:  # SystemExit / KeyboardInterrupt raised by the executor
            result = _failed("the executor raised %s:\n%s" % (type(e).__name__, _traceback()))
    result["artifacts"] = _collect_artifacts(result.get("artifacts"))
    try:
        _opservant.send_result(result)
    except (TypeError, ValueError) as e:
        _opservant.send_result(_failed("the result cannot be represented as JSON: %s" % e))


def main():
    mode = _opservant.mode()
    try:
        if mode == "executor":
            run_executor()
        else:
            raise RuntimeError("unknown runtime mode %r" % mode)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
