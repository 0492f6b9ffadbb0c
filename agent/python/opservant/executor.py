"""The executor interface: ``BaseExecutor`` and ``ExecutorResult``.

An executor is a class with ``validate(params)``, ``execute(params, context)`` and, optionally,
``cleanup(context)``.  The runtime (``opservant._lifecycle.run_lifecycle``) instantiates it with
no arguments, calls ``validate``, then ``execute``, then always ``cleanup``.  Subclassing
``BaseExecutor`` is recommended but not required.

This module is imported by every sandboxed run: it imports nothing at module level.
"""

__all__ = ["BaseExecutor", "ExecutorResult", "ExecutorError", "ValidationError", "STATUSES"]

#: The statuses an executor may report.  The runtime itself also uses "rejected" (validate()
#: refused the parameters) and "timeout" (the run was killed at its wall-time limit).
STATUSES = ("completed", "failed", "partial")


def _check(status, output, error, artifacts):
    """Validate the four fields; return the artifacts as a new list (path-likes made str)."""
    if status not in STATUSES:
        raise ValueError(
            "ExecutorResult status must be one of 'completed', 'failed', 'partial', not %r" % (status,)
        )
    if not isinstance(output, dict):
        raise TypeError("ExecutorResult output must be a dict, not %s" % type(output).__name__)
    if error is not None and not isinstance(error, str):
        raise TypeError("ExecutorResult error must be a str or None, not %s" % type(error).__name__)
    if not isinstance(artifacts, list):
        raise TypeError("ExecutorResult artifacts must be a list, not %s" % type(artifacts).__name__)
    out = []
    for i, item in enumerate(artifacts):
        if isinstance(item, (bytes, bytearray, memoryview)):
            item = bytes(item)  # binary data, copied: later changes to a buffer do not count
        elif not isinstance(item, (str, dict)):
            fspath = getattr(type(item), "__fspath__", None)
            if fspath is not None:
                item = fspath(item)
            if not isinstance(item, (str, dict)):
                raise TypeError(
                    "ExecutorResult artifacts[%d] must be a str path, bytes or a dict, not %s"
                    % (i, type(item).__name__)
                )
        out.append(item)
    return out


class ExecutorResult:
    """The outcome of ``execute()``.

    ``status``    "completed", "failed" or "partial" (anything else raises ValueError);
    ``output``    a dict of structured, JSON-serialisable output (default ``{}``; TypeError if not a dict);
    ``error``     an error message, or None;
    ``artifacts`` a list of file paths (str; ``os.PathLike`` objects are converted), binary
                  data (bytes, bytearray, memoryview: copied as bytes), or dicts (default ``[]``).
    """

    __slots__ = ("status", "output", "error", "artifacts")

    def __init__(self, status="completed", output=None, error=None, artifacts=None):
        if output is None:
            output = {}
        if artifacts is None:
            artifacts = []
        self.artifacts = _check(status, output, error, artifacts)
        self.status = status
        self.output = output
        self.error = error

    @classmethod
    def _internal(cls, status, output=None, error=None, artifacts=None):
        """Build a result without validating ``status`` (runtime statuses such as "rejected",
        "timeout").  For the runtime and the test harness, not for executors."""
        self = cls.__new__(cls)
        self.status = status
        self.output = output
        self.error = error
        self.artifacts = [] if artifacts is None else artifacts
        return self

    def to_dict(self):
        """``{"status", "output", "error", "artifacts"}`` (the objects themselves, not copies)."""
        return {
            "status": self.status,
            "output": self.output,
            "error": self.error,
            "artifacts": self.artifacts,
        }

    def __repr__(self):
        return "%s(status=%r, output=%r, error=%r, artifacts=%r)" % (
            type(self).__name__, self.status, self.output, self.error, self.artifacts,
        )

    def __eq__(self, other):
        if not isinstance(other, ExecutorResult):
            return NotImplemented
        return (
            self.status == other.status
            and self.output == other.output
            and self.error == other.error
            and self.artifacts == other.artifacts
        )

    __hash__ = None  # mutable


class ExecutorError(Exception):
    """Base class for errors an executor may raise.  Raised from ``execute()`` it is treated like
    any other unhandled exception (status "failed", traceback in ``error``)."""


class ValidationError(ExecutorError, ValueError):
    """Invalid parameters.  Being a ``ValueError``, raising it from ``validate()`` rejects the run
    (status "rejected", ``error`` = the message)."""


class BaseExecutor:
    """Base class for executors (seed 000 interface).

    Set ``name`` and ``version`` to the manifest's values and override ``validate`` and
    ``execute``; override ``cleanup`` when there is something to release.  The class is
    instantiated with no arguments, once per run.
    """

    name = ""
    version = ""

    def validate(self, params):
        """Check the task parameters (a dict decoded from JSON) before execution.

        Return True to accept them.  Raise ``ValueError`` (or ``ValidationError``) with a message
        to reject them: the run ends with status "rejected", ``error`` = the message, and
        ``execute()`` is not called.  Returning a falsy value also rejects the run.
        Required.
        """
        raise NotImplementedError("%s.validate(params) is not implemented" % type(self).__name__)

    def execute(self, params, context):
        """Run the executor logic and return an ``ExecutorResult``.

        ``context`` holds ``agent_id`` (str), ``network`` (dict: ``local_ip``, ``subnet``
        "a.b.c.d/prefix", ``interfaces`` [{"name", "addresses"}]), ``vault``
        (``vault.get_secret(name)``, only for names declared in ``permissions.secrets``),
        ``logger`` (``logger.info(msg, **fields)``, debug/warning/error), ``config`` (dict of
        agent configuration values), ``action`` and ``command_id`` (str or None).

        Handle expected errors and return ``ExecutorResult(status="failed", error=...)``, with
        partial output where there is some.  An unhandled exception is reported as "failed"
        with the traceback in ``error`` and no output.  Required.
        """
        raise NotImplementedError(
            "%s.execute(params, context) is not implemented" % type(self).__name__
        )

    def cleanup(self, context):
        """Release resources.  Called once after every run in which the executor was
        instantiated, whatever the outcome (rejected, failed, completed).  An exception here is
        logged and does not change the result.  Optional; the default does nothing."""
