"""Loading an executor class and running its lifecycle (used by the runtime and the harness).

Imported by every sandboxed run: only ``sys``, the package's ``executor`` module and (in the
runtime) ``_opservant`` are imported at module level; ``os`` and ``traceback`` where needed.
"""

import sys

from .executor import ExecutorResult, _check

__all__ = ["load_executor_class", "run_lifecycle"]

try:  # the sandbox's runtime: a native realpath (outside it, the harness uses Python's)
    from _opservant import realpath as _native_realpath
except ImportError:
    _native_realpath = None


def _realpath(path):
    """``os.path.realpath(path)``; natively in the runtime when the path resolves."""
    if _native_realpath is not None:
        try:
            return _native_realpath(path)
        except OSError:
            pass
    import os

    return os.path.realpath(path)


def load_executor_class(entry_point, package_dir):
    """Import and return the executor class named by ``entry_point`` ("module.path.ClassName").

    ``package_dir`` (the directory holding manifest.json) is put at ``sys.path[0]`` unless it is
    already on ``sys.path``.  The module must be a file inside ``package_dir``: an entry point
    that resolves to a standard-library or other installed module (or to a module of the same
    name already imported from elsewhere) is refused with ``ImportError``.  A missing module
    raises ``ImportError``, a missing class ``AttributeError``; ``TypeError`` when the attribute
    is not a class or lacks callable ``validate`` and ``execute`` (duck typing is accepted).
    Errors raised by the module's own code (including its missing dependencies) propagate.
    """
    import os

    ep = entry_point
    if not isinstance(ep, str) or "." not in ep or not all(p.isidentifier() for p in ep.split(".")):
        raise ImportError("invalid entry_point %r: expected 'module.ClassName' (the module may be dotted)" % (ep,))
    modname, _, clsname = ep.rpartition(".")
    pkg_real = _realpath(package_dir)
    if not os.path.isdir(pkg_real):
        raise ImportError("executor package directory %r does not exist" % (package_dir,))
    pkg_abs = os.path.abspath(package_dir)
    if pkg_abs not in sys.path and package_dir not in sys.path:
        sys.path.insert(0, pkg_abs)

    module = sys.modules.get(modname)
    if module is None:
        try:
            __import__(modname)
        except ModuleNotFoundError as exc:
            # Rewritten only when the entry point's module (or a parent) is what is missing.
            if not exc.name or not (modname + ".").startswith(exc.name + "."):
                raise
            raise ImportError(
                "entry_point %r: module %r not found in executor package %s" % (ep, modname, pkg_abs),
                name=modname,
            ) from exc
        module = sys.modules[modname]

    filename = getattr(module, "__file__", None)
    where = _realpath(filename) if filename else "a built-in or namespace module"
    if not where.startswith(pkg_real.rstrip("/") + "/"):
        raise ImportError(
            "entry_point %r: module %r resolves to %s, outside the executor package %s; entry "
            "points resolve only inside the executor package (rename a module that shadows a "
            "standard-library or installed module)" % (ep, modname, where, pkg_real),
            name=modname,
        )

    try:
        cls = getattr(module, clsname)
    except AttributeError:
        raise AttributeError("entry_point %r: module %r (%s) has no attribute %r" % (ep, modname, where, clsname)) from None
    if not isinstance(cls, type):
        raise TypeError("entry_point %r is a %s, not a class" % (ep, type(cls).__name__))
    missing = [m for m in ("validate", "execute") if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(
            "entry_point %r: class %s lacks callable %s (an executor needs validate(params) and "
            "execute(params, context))" % (ep, cls.__name__, " and ".join(missing))
        )
    return cls


def _tb():
    import traceback

    return traceback.format_exc()


def _result(status, error=None, output=None, artifacts=None):
    return {"status": status, "output": output, "error": error, "artifacts": artifacts or []}


def run_lifecycle(cls, params, context):
    """Instantiate ``cls``, validate, execute, always clean up; return the result dict
    ``{"status", "output", "error", "artifacts"}``:

    "failed"   — the constructor, ``validate`` (other than ValueError) or ``execute`` raised
                 (``error`` = the traceback, ``output`` None), or ``execute`` returned something
                 other than a valid ExecutorResult;
    "rejected" — ``validate`` raised ValueError (``error`` = its message) or returned a falsy
                 value; ``execute`` is not called;
    otherwise  — the ExecutorResult's fields.
    ``cleanup(context)`` runs once whenever the instance exists; an exception it raises is logged
    with ``context["logger"].error("cleanup failed", error=traceback)`` and ignored.  Only
    ``Exception`` is caught: SystemExit and KeyboardInterrupt propagate (after cleanup).
    """
    try:
        instance = cls()
    except Exception:
        return _result("failed", _tb())
    try:
        return _validate_and_execute(instance, params, context)
    finally:
        _cleanup(instance, context)


def _validate_and_execute(instance, params, context):
    try:
        accepted = instance.validate(params)
    except ValueError as exc:
        return _result("rejected", str(exc) or type(exc).__name__)
    except Exception:
        return _result("failed", _tb())
    try:
        ok = bool(accepted)
    except Exception:
        return _result("failed", _tb())
    if not ok:
        if accepted is False:
            return _result("rejected", "validate() returned False")
        return _result(
            "rejected",
            "validate() returned False (a falsy %s; return True to accept)" % type(accepted).__name__,
        )

    try:
        result = instance.execute(params, context)
    except Exception:
        return _result("failed", _tb())
    if not isinstance(result, ExecutorResult):
        return _result("failed", "execute() returned %s, not an ExecutorResult" % type(result).__name__)
    # The attributes are plain and may have been changed after construction: check them again.
    status, output, error = result.status, result.output, result.error
    try:
        artifacts = _check(status, output, error, result.artifacts)
    except (TypeError, ValueError) as exc:
        return _result("failed", "execute() returned an invalid ExecutorResult: %s" % exc)
    return _result(status, error, output, artifacts)


def _cleanup(instance, context):
    cleanup = getattr(instance, "cleanup", None)
    if cleanup is None:  # a duck-typed executor without cleanup()
        return
    try:
        cleanup(context)
    except Exception:
        text = _tb()
        try:
            context["logger"].error("cleanup failed", error=text)
        except Exception:
            sys.stderr.write("opservant: cleanup failed\n" + text)
