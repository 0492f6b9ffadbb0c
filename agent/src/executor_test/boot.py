"""Entry of an `opservant executor test` session, run by the operator's interpreter inside
the sandbox as ``python -I -B boot.py PACKAGE_DIR TESTS_DIR DEPS_DIR [PYTEST_ARG...]``.

Puts opservant's Python package (and the executor's installed requirements) on sys.path,
imports pytest — exit status 121 when it cannot, so the agent can tell "no pytest here"
from a test failure — and runs pytest on the tests directory with the reporting plugin.
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
    try:
        import pytest
    except Exception as exc:  # ImportError, or a broken installation
        sys.stderr.write("opservant executor test: cannot import pytest inside the sandbox: %r\n" % (exc,))
        return NO_PYTEST
    args = [
        "-p", "opservant_executor_test",
        "-p", "no:cacheprovider",
        "--rootdir", package_dir,
        tests_dir,
    ] + extra
    return pytest.main(args)


if __name__ == "__main__":
    sys.exit(main())
