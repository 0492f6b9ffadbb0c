"""The executor runtime inside the sandbox (not part of the public API).

Runs in the sandbox's embedded interpreter, after every OS restriction is in place. It talks
to the agent only through the native `_opservant` module, which owns the application
channel: arguments come in, logs, secret requests and the result go out. Nothing here is
trusted by the agent; it only spares executors from knowing the protocol.
"""

import sys

import _opservant

# Imported here, not per run: in a zygote this runs once, before the fork (each run then
# finds the module loaded instead of executing it again in every sandbox).
from opservant._lifecycle import load_executor_class, run_lifecycle


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


_BINARY = (bytes, bytearray, memoryview)


def _collect_artifacts(items):
    out = []
    for index, item in enumerate(items or []):
        try:
            out.append(_artifact(item, index))
        except Exception as e:  # one artifact's failure is reported with it: the result stands
            out.append(
                {"path": _artifact_name(item, index), "error": _safe_text("%s: %s" % (type(e).__name__, e))}
            )
    return out


def _artifact(item, index):
    # Binary data (seed 000: "file paths or binary data"): bytes, named data-INDEX, or a dict
    # with "data" (bytes, or str as UTF-8) named by its "path" or "name".
    if isinstance(item, _BINARY):
        return _data_artifact("data-%d" % index, item)
    if isinstance(item, dict) and "data" in item:
        name = item.get("path", item.get("name", "data-%d" % index))
        data = item["data"]
        if not isinstance(name, str):
            return {"path": _artifact_name(item, index), "error": "an artifact's 'path' or 'name' must be a str"}
        if not isinstance(data, (str,) + _BINARY):
            return {"path": _safe_text(name), "error": "an artifact's 'data' must be bytes or str"}
        return _data_artifact(name, data)
    path = item if isinstance(item, str) else (item.get("path") if isinstance(item, dict) else None)
    if not isinstance(path, str):
        return {
            "path": _artifact_name(item, index),
            "error": "an artifact is a path string, bytes, or a dict with 'path' or 'data'",
        }
    try:
        str.encode(path, "utf-8")
    except UnicodeEncodeError:
        return {"path": _safe_text(path), "error": "the path is not valid UTF-8 (it has undecodable bytes)"}
    try:
        return _opservant.artifact(path)
    except OSError as e:
        return {"path": path, "error": _safe_text(str(e))}


def _data_artifact(name, data):
    try:
        str.encode(name, "utf-8")
    except UnicodeEncodeError:
        return {"path": _safe_text(name), "error": "the name is not valid UTF-8 (it has undecodable bytes)"}
    # Measured before anything is copied: an over-sized buffer is one refused entry, not a
    # copy that could take the run's memory.
    size = len(data) if isinstance(data, str) else memoryview(data).nbytes
    cap = _opservant.artifact_cap()
    if size > cap:
        return {"path": name, "error": "%s: %d bytes, over the %d byte cap per artifact" % (name, size, cap)}
    if isinstance(data, str):
        data = data.encode("utf-8")
    try:
        return _opservant.data_artifact(name, data if isinstance(data, bytes) else bytes(data))
    except OSError as e:
        return {"path": name, "error": _safe_text(str(e))}


def _artifact_name(item, index):
    """How an artifact entry is named in its error: its path or name, data-INDEX for binary
    data, else its ``repr()``."""
    try:
        if isinstance(item, _BINARY):
            return "data-%d" % index
        if isinstance(item, dict):
            for key in ("path", "name"):
                if isinstance(item.get(key), str):
                    return _safe_text(item[key])
        return _safe_text(item if isinstance(item, str) else repr(item))
    except Exception:
        return "<unrepresentable %s>" % type(item).__name__


class TimeLimitReached(BaseException):
    """Raised in the executor when the agent ends the run (its wall-clock limit): SIGTERM,
    then a grace period before SIGKILL, which ``cleanup(context)`` gets to run in."""


def _on_sigterm(signum, frame):
    import _signal

    # One notice only: a second SIGTERM must not interrupt cleanup().
    _signal.signal(signum, _signal.SIG_IGN)
    raise TimeLimitReached("the run was terminated (time limit reached)")


def run_executor():
    import _signal  # the C module: `signal` would import enum on every run

    _signal.signal(_signal.SIGTERM, _on_sigterm)
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
    # Everything above is the runtime's own (trusted) start-up, done before the executor's
    # package is on sys.path (nothing of it can be shadowed); the executor's module comes
    # next, so the CPU quota applies from here.
    sys.path[0:0] = _opservant.paths()
    _ready()
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


def _exit_status(code):
    """The process exit status for ``SystemExit(code)``, as the ``python`` command does it."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def run_script():
    """Seed 003: compile the script (a failure is a validation error and nothing runs), then
    run it as ``__main__`` the way ``python FILE`` would. Returns the exit status."""
    path = _opservant.args()["path"]
    _ready()
    try:
        with open(path, "rb") as f:
            source = f.read()
        code = compile(source, path, "exec", dont_inherit=True)
    except Exception as e:
        import traceback

        _opservant.validation_error("".join(traceback.format_exception_only(type(e), e)).rstrip())
        return 65

    import builtins
    import types

    # The script's code must not hold the channel (a Bash script never does): it could
    # claim a validation error — "nothing was run" — after doing anything at all.
    _opservant.close_channel()
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv[:] = [path]
    _as_site_would()
    try:
        exec(code, main.__dict__)
        status = 0
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException as e:
        # As `python FILE` would print it, without the runtime's own frames.
        try:
            print(_format_user_exception(e), file=sys.stderr)
        except Exception:
            pass
        # An uncaught Ctrl-C ends `python3` by SIGINT, which a shell reports as 130.
        status = 130 if isinstance(e, KeyboardInterrupt) else 1
    # As the interpreter's finalisation does: wait for non-daemon threads, then atexit.
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            pass
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        pass
    # As the interpreter's finalisation does: output that cannot be flushed at the end is an
    # error, exit status 120 (the script's output was lost; `python3` says so, and so do we).
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        try:
            if stream is not None:
                stream.flush()
        except Exception as e:
            try:
                print(f"Exception ignored on flushing sys.{name}: {type(e).__name__}: {e}", file=sys.__stderr__)
            except Exception:
                pass
            status = 120
    return status


def _as_site_would():
    """What ``python3 -I`` has from its ``site`` step, which the runtime's interpreter skips:
    the system's site-packages directories on ``sys.path`` (their ``.pth`` files read) and
    ``exit``/``quit``, ``help``, ``copyright``, ``credits`` and ``license`` in builtins, so a
    script ending with ``exit(0)`` or importing a Debian-packaged module runs as it would
    there. (No ``sitecustomize``: Debian's installs apport's crash hook, of no use here.)"""
    import os
    import site

    for directory in site.getsitepackages():
        if os.path.isdir(directory):
            site.addsitedir(directory)
    site.setquit()
    site.setcopyright()
    site.sethelper()


# Session output kept per stream and call, and of an error's text: bytes of its JSON
# encoding (the rest is counted and dropped). With the globals' cap (4 MiB, checked in
# `_opservant.session_reply`) a reply stays well under the channel's message cap (16 MiB).
_SESSION_OUTPUT_CAP = 1 << 20
# Builtins a session's code does not get: files, the debugger, the console, help.
_SESSION_REMOVED_BUILTINS = ("open", "breakpoint", "input", "help", "exit", "quit", "copyright", "credits", "license")


def _safe_text(text):
    """``text`` as valid Unicode: lone surrogates (undecodable bytes, ``"\\udcff"``) are
    written as backslash escapes (JSON, and the agent, take only valid Unicode)."""
    text = str.__str__(text)  # a subclass's own methods are its code's
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class _Capture:
    """A text stream keeping the first ``_SESSION_OUTPUT_CAP`` bytes (of JSON) written."""

    def __init__(self):
        self._parts = []
        self._size = 0
        self.dropped = 0

    def write(self, text):
        text = str(text)
        n = len(text)
        room = _SESSION_OUTPUT_CAP - self._size
        if room <= 0:
            self.dropped += n
            return n
        # Each character costs bytes of its own in JSON (1 to 7: UTF-8, escapes), so at most
        # `room` of them fit; the head is cut in proportion until it fits.
        head = text[:room]
        cost = _json_size(_safe_text(head))
        while cost > room:
            head = head[: min(len(head) - 1, len(head) * room // cost)]
            cost = _json_size(_safe_text(head))
        self._parts.append(_safe_text(head))
        self._size += cost
        self.dropped += n - len(head)
        return n

    def flush(self):
        pass

    def isatty(self):
        return False

    def value(self):
        text = "".join(self._parts)
        if self.dropped:
            text += "\n[opservant: %d more characters dropped]" % self.dropped
        return text


def _json_size(text):
    """Bytes of ``text``'s JSON string (without the quotes), as the agent's encoder writes
    it: control characters, quote and backslash escaped, the rest as UTF-8."""
    return len(_encode_json_string(text).encode("utf-8", "surrogatepass")) - 2


def _encode_json_string(text):
    # Replaced by json's C encoder at the first use (sessions only: an executor's run does
    # not import json).
    global _encode_json_string
    from json.encoder import encode_basestring

    _encode_json_string = encode_basestring
    return encode_basestring(text)


def _capped(text):
    """``text`` within ``_SESSION_OUTPUT_CAP`` bytes of JSON, as a ``_Capture`` keeps it."""
    c = _Capture()
    c.write(text)
    return c.value()


# The integers JSON carries here (the agent's decoder: 64-bit signed or unsigned).
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def _jsonable(value, depth=0):
    """``value`` as JSON data; anything else (or too deep) as its ``repr()``. Integers
    beyond 64 bits are their decimal text (hexadecimal past the interpreter's limit on
    decimal digits); text that is not valid Unicode has its lone surrogates escaped."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        value = int(value)  # a subclass's own comparisons and text are its code's
        if _INT_MIN <= value <= _INT_MAX:
            return value
        try:
            return str(value)
        except ValueError:  # over sys.get_int_max_str_digits()
            return hex(value)
    if isinstance(value, str):
        return _safe_text(value)
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if depth < 64:
        if isinstance(value, (list, tuple)):
            return [_jsonable(v, depth + 1) for v in value]
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {_safe_text(k): _jsonable(v, depth + 1) for k, v in value.items()}
    try:
        return _safe_text(repr(value))
    except Exception as e:
        return "<unrepresentable %s: %s>" % (type(value).__name__, type(e).__name__)


def _session_namespace(allowed):
    """Globals for session code: builtins without files or the console, and an
    ``__import__`` that refuses every module outside the allowlist."""
    import builtins

    real_import = builtins.__import__
    allowed = tuple(allowed)

    def permitted(name):
        # Only a plain str: a subclass's own ``==`` and ``startswith`` are its code's (one
        # that equals everything named any module).
        return type(name) is str and any(name == a or name.startswith(a + ".") for a in allowed)

    def submodules_permitted(name, fromlist):
        # ``from pkg import sub`` with ``pkg.sub`` allowed: importing ``pkg.sub`` imports
        # ``pkg`` anyway, and the statement binds only the names listed — each of them an
        # allowed submodule (checked again below once imported). ``__import__`` itself still
        # returns ``pkg``, as ``import pkg.sub`` binds it: the allowlist is defence in depth,
        # by top-level package, not a boundary (README, Sessions).
        return (
            type(name) is str and bool(fromlist) and all(type(i) is str and permitted(name + "." + i) for i in fromlist)
        )

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level:
            raise ImportError("relative imports are not available in a session")
        if not permitted(name) and not submodules_permitted(name, fromlist):
            raise ImportError(
                "import of %r is not allowed in this session (allowed: %s)" % (name, ", ".join(allowed) or "none"),
                name=name,
            )
        module = real_import(name, globals, locals, fromlist, level)
        for item in fromlist or ():
            sub = getattr(module, item, None)
            if type(sub) is type(sys) and not permitted(getattr(sub, "__name__", "")):
                raise ImportError("import of %r is not allowed in this session" % sub.__name__, name=sub.__name__)
            if not permitted(name) and type(sub) is not type(sys):
                # Of a package allowed only for its submodules, no other name is imported.
                raise ImportError("import of %r is not allowed in this session" % (name + "." + str(item)), name=name)
        return module

    safe = {k: v for k, v in vars(builtins).items() if k not in _SESSION_REMOVED_BUILTINS}
    safe["__import__"] = guarded_import
    return {"__name__": "__session__", "__builtins__": safe}, guarded_import


def _format_user_exception(e):
    """The traceback of user code's exception without the runtime's own frames."""
    import traceback

    te = traceback.TracebackException(type(e), e, e.__traceback__)
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if not f.filename.startswith("<opservant>")])
    return "".join(te.format()).rstrip()


# Sources of session calls kept for tracebacks (`linecache`), oldest first, and what they
# cost: the oldest are forgotten past _SESSION_SOURCES_MAX bytes (each call counted as its
# UTF-8 size plus _SESSION_SOURCE_OVERHEAD for the cache entry and its lines) or
# _SESSION_SOURCES_MAX_CALLS calls — a traceback through a function an old call defined then
# shows no source line — so a long-lived session's memory does not grow with every call.
_SESSION_SOURCES = None  # a deque of (filename, cost), made at the first call
_SESSION_SOURCES_COST = 0
_SESSION_SOURCES_MAX = 4 << 20
_SESSION_SOURCES_MAX_CALLS = 1024
_SESSION_SOURCE_OVERHEAD = 512


def _keep_session_source(filename, source):
    global _SESSION_SOURCES, _SESSION_SOURCES_COST
    import collections
    import linecache

    if _SESSION_SOURCES is None:
        _SESSION_SOURCES = collections.deque()
    lines = source.splitlines(True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    cost = len(source.encode("utf-8", "surrogatepass")) + _SESSION_SOURCE_OVERHEAD + 64 * len(lines)
    _SESSION_SOURCES.append((filename, cost))
    _SESSION_SOURCES_COST += cost
    while len(_SESSION_SOURCES) > 1 and (
        _SESSION_SOURCES_COST > _SESSION_SOURCES_MAX or len(_SESSION_SOURCES) > _SESSION_SOURCES_MAX_CALLS
    ):
        old, old_cost = _SESSION_SOURCES.popleft()
        linecache.cache.pop(old, None)
        _SESSION_SOURCES_COST -= old_cost


# Whether session code is running: the daemon interrupts a call whose client has gone
# (SIGINT, forwarded by the sandbox's init), and only the call may see it as
# KeyboardInterrupt — one arriving a moment late, between calls, must not end the session.
_SESSION_IN_CALL = False
# SIGINTs received, and how many of them are not the running call's: each call is told how
# many interrupts the daemon sent before it, so that one meant for an earlier call that
# arrives late (init forwards it from a CPU-throttled cgroup) does not interrupt the next
# caller's code.
_SESSION_SIGINTS = 0
_SESSION_NOT_OURS = 0
# The previous call's count: interrupts sent before it are taken as delivered by now (or
# merged with a later one — standard signals do not queue), so that a lost one cannot keep
# later calls from being interrupted for more than a call or two.
_SESSION_PREVIOUS_SENT = 0


def _on_session_sigint(signum, frame):
    global _SESSION_SIGINTS
    _SESSION_SIGINTS += 1
    if _SESSION_IN_CALL and _SESSION_SIGINTS > _SESSION_NOT_OURS:
        raise KeyboardInterrupt


def _session_call(namespace, request, number, builtins):
    global _SESSION_IN_CALL, _SESSION_NOT_OURS, _SESSION_SIGINTS, _SESSION_PREVIOUS_SENT

    out, err = _Capture(), _Capture()
    saved = sys.stdout, sys.stderr
    filename = "<session call %d>" % number
    success, error = True, None
    try:
        sys.stdout, sys.stderr = out, err
        namespace.update(request.get("globals") or {})
        # Put back before every call: code that deleted or replaced `__builtins__` would
        # otherwise have the next call's `exec` fill in the runtime's own, unrestricted ones.
        namespace["__builtins__"] = builtins
        source = request["code"]
        code = compile(source, filename, "exec", dont_inherit=True)
        _keep_session_source(filename, source)
        sent = request.get("interrupts", 0)
        _SESSION_SIGINTS = max(_SESSION_SIGINTS, _SESSION_PREVIOUS_SENT)
        _SESSION_NOT_OURS = max(sent, _SESSION_SIGINTS)
        _SESSION_PREVIOUS_SENT = sent
        _SESSION_IN_CALL = True
        exec(code, namespace)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the session goes on
        _SESSION_IN_CALL = False
        success = False
        try:
            error = _format_user_exception(e)
        except Exception as f:
            error = "%s (its traceback could not be formatted: %s)" % (type(e).__name__, type(f).__name__)
    finally:
        _SESSION_IN_CALL = False
        sys.stdout, sys.stderr = saved
    values = {}
    for name in request.get("return") or ():
        if name in namespace:
            try:
                values[name] = _jsonable(namespace[name])
            except Exception as e:
                values[name] = "<unrepresentable: %s>" % type(e).__name__
    if error is not None:
        error = _capped(error)
    return {"success": success, "error": error, "stdout": out.value(), "stderr": err.value(), "globals": values}


def _session_reply(call, reply):
    """Send call number ``call``'s reply; one that cannot be sent as JSON becomes an error
    reply (the session goes on: only a broken channel ends it)."""
    reply["call"] = call
    try:
        _opservant.session_reply(reply)
        return
    except (TypeError, ValueError) as e:
        why = _safe_text("the reply cannot be sent as JSON: %s: %s" % (type(e).__name__, e))[:4096]
    _opservant.session_reply({"call": call, "success": False, "error": why, "stdout": "", "stderr": "", "globals": {}})


def run_session():
    """Seed 002: one interpreter, globals kept between calls, imports allowlisted."""
    args = _opservant.args()
    sys.path[0:0] = _opservant.paths()
    namespace, guarded_import = _session_namespace(args["allow_imports"])
    safe_builtins = namespace["__builtins__"]
    import _signal

    _signal.signal(_signal.SIGINT, _on_session_sigint)
    error = None
    for alias, module in args["default_imports"]:
        try:
            guarded_import(module)
            namespace[alias] = sys.modules[module]
        except BaseException as e:
            error = _safe_text("default import %s=%s failed: %s: %s" % (alias, module, type(e).__name__, e))
            break
    _encode_json_string("")  # json's encoder, for the output caps, before session code runs
    # The default imports are the operator's choice (trusted start-up); session code is not.
    _ready()
    _opservant.session_reply({"call": 0, "success": error is None, "error": error})
    if error is not None:
        return 1
    number = 0
    while True:
        request = _opservant.session_next()
        if request is None:
            return 0
        number += 1
        try:
            reply = _session_call(namespace, request, number, safe_builtins)
        except BaseException as e:  # the runtime's own failure: the call fails, not the session
            reply = {"success": False, "error": "the call's reply could not be made: %s" % type(e).__name__}
        _session_reply(request["call"], reply)


def _ready():
    """The runtime's start-up is over: turn the garbage collector back on (the start-up's
    objects frozen out of it), tell the agent, which applies the CPU quota, and wait for its
    answer that the quota is in force."""
    import gc

    gc.freeze()
    gc.enable()
    _opservant.ready()


def run_compile():
    """Installation: compile each file to the timestamp-checked bytecode its import would
    produce (``compile`` runs none of it) and report it; a file that does not compile is
    reported with its error. Returns the exit status."""
    import os

    import _frozen_importlib_external as bootstrap

    for path in _opservant.compile_files():
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                source = f.read()
            # As the import system's source_to_code does it.
            code = compile(source, path, "exec", dont_inherit=True)
            pyc = bytes(bootstrap._code_to_timestamp_pyc(code, stat.st_mtime, stat.st_size))
        except Exception as e:  # SyntaxError, RecursionError, MemoryError, OSError...
            _opservant.compiled(path, None, "%s: %s" % (type(e).__name__, e))
            continue
        _opservant.compiled(path, pyc)
    return 0


def main():
    """Run the mode the agent asked for; returns the process exit status."""
    mode = _opservant.mode()
    try:
        if mode == "executor":
            run_executor()
            return 0
        if mode == "compile":
            return run_compile()
        if mode == "script":
            return run_script()
        if mode == "session":
            return run_session()
        raise RuntimeError("unknown runtime mode %r" % mode)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
