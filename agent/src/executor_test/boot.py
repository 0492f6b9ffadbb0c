"""Entry of an `opservant executor test` session, run by the operator's interpreter inside
the sandbox as ``python -I -B boot.py PACKAGE_DIR TESTS_DIR DEPS_DIR [PYTEST_ARG...]``.

Puts opservant's Python package (and the executor's installed requirements) on sys.path,
imports pytest and runs it on the tests directory with the reporting plugin.

It tells the agent how pytest ended on the application channel (fd 4): ``no_pytest`` when
pytest cannot be imported (then exit status 121), ``pytest_exit`` with the status
``pytest.main`` returned. With those the agent tells "no pytest here" and "pytest refused its
arguments" (status 4) from test code that exits 121 or 4 itself, which sends neither.
"""

import json
import socket
import sys

NO_PYTEST = 121
_APP_FD = 4


def tell(message):
    """Send one message on the application channel (one packet: flag byte 0, then JSON)."""
    try:
        chan = socket.socket(fileno=_APP_FD)
    except OSError:
        return
    try:
        chan.send(b"\x00" + json.dumps(message).encode("utf-8"))
    except OSError:
        pass
    finally:
        chan.detach()


def main():
    package_dir, tests_dir, deps_dir = sys.argv[1:4]
    extra = sys.argv[4:]
    paths = ["/run/executor-test/python"]
    if deps_dir:
        paths.append(deps_dir)
    sys.path[:0] = paths
    try:
        import pytest
    except Exception as exc:  # ImportError, or a broken installation
        sys.stderr.write("opservant executor test: cannot import pytest inside the sandbox: %r\n" % (exc,))
        tell({"type": "no_pytest"})
        return NO_PYTEST
    args = [
        "-p", "opservant_executor_test",
        "-p", "no:cacheprovider",
        "--rootdir", package_dir,
        tests_dir,
    ] + extra
    status = int(pytest.main(args))
    tell({"type": "pytest_exit", "exitstatus": status})
    return status


if __name__ == "__main__":
    sys.exit(main())
