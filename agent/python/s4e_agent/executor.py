"""Alias of ``opservant.executor``: ``from s4e_agent.executor import BaseExecutor, ExecutorResult``."""

from opservant.executor import *  # noqa: F401,F403
from opservant.executor import __all__  # noqa: F401
