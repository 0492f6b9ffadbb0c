"""pytest plugin of `opservant executor test`: counts the outcomes the way pytest's own
summary does (passed, failed, skipped, errors, xfailed, xpassed) and sends them, with pytest's
exit status, as one JSON message (a single packet of the channel's framing) on the sandbox's application channel (fd 4).

The counts come from inside the sandbox, where the executor's tests run: the agent takes them
as the test session's own report (a test can lie about its own results), never as a decision
about isolation.
"""

import json
import socket

_APP_FD = 4
_config = None
_counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "xfailed": 0, "xpassed": 0}
# The session was ended by an interrupt or `pytest.exit()` (whose status is the caller's:
# `pytest.exit(returncode=4)` is no usage error).
_interrupted = False
_CATEGORY = {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "errors",
             "xfailed": "xfailed", "xpassed": "xpassed"}


def pytest_configure(config):
    global _config
    _config = config


def _count(report):
    if _config is None:
        return
    category = _config.hook.pytest_report_teststatus(report=report, config=_config)[0]
    key = _CATEGORY.get(category)
    if key is not None:
        _counts[key] += 1


def pytest_runtest_logreport(report):
    _count(report)


def pytest_collectreport(report):
    # A module that fails to import is an error; one skipped at import is a skip.
    if report.failed:
        _counts["errors"] += 1
    elif report.skipped:
        _counts["skipped"] += 1


def pytest_keyboard_interrupt(excinfo):
    global _interrupted
    # Said at once: an interrupt or `pytest.exit()` during the configuration or the
    # session's start ends pytest without `pytest_sessionfinish`.
    if not _interrupted:
        send_message({"type": "pytest_interrupted"})
    _interrupted = True


def pytest_sessionfinish(session, exitstatus):
    message = dict(_counts)
    message["type"] = "pytest_result"
    message["exitstatus"] = int(exitstatus)
    message["interrupted"] = _interrupted
    try:
        import pytest

        message["pytest_version"] = pytest.__version__
    except Exception:
        pass
    send_message(message)


def send_message(message):
    """One message to the agent on the application channel (fd 4), if it is there."""
    try:
        chan = socket.socket(fileno=_APP_FD)
    except OSError:
        return
    try:
        # One packet: flag byte 0 ("last packet"), then the JSON (sandbox::channel framing).
        chan.send(b"\x00" + json.dumps(message).encode("utf-8"))
    except OSError:
        pass
    finally:
        chan.detach()
