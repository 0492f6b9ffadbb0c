"""Entry of an `opservant executor test` session, run by the operator's interpreter inside
the sandbox as ``python -I -B boot.py PACKAGE_DIR TESTS_DIR DEPS_DIR [PYTEST_ARG...]``.

Puts opservant's Python package (and the executor's installed requirements) on sys.path,
imports pytest and runs it on the tests directory with the reporting plugin.

It tells the agent how pytest ended on the application channel (fd 4): ``no_pytest`` when
pytest cannot be imported (then exit status 121), ``pytest_exit`` with the status
``pytest.main`` returned. With those the agent tells "no pytest here" and "pytest refused its
arguments" (status 4) from test code that exits 121 or 4 itself, which sends neither.
"""

import sys

NO_PYTEST = 121


def main():
    package_dir, tests_dir, deps_dir = sys.argv[1:4]
    extra = sys.argv[4:]
    paths = ["/run/executor-test/python"]
    if deps_dir:
        paths.append(deps_dir)
    sys.path[:0] = paths
    # The reporting plugin's module (the same one pytest loads with `-p`) sends the messages.
    from opservant_executor_test import send_message as tell

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
