"""Alias of ``opservant.testing``: ``from s4e_agent.testing import ExecutorTestHarness``."""

from opservant.testing import *  # noqa: F401,F403
from opservant.testing import __all__  # noqa: F401
