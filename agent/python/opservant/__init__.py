"""opservant: the Python side of the opservant executor runtime.

Executors subclass ``opservant.executor.BaseExecutor`` (also importable as
``s4e_agent.executor``) and return ``ExecutorResult``; ``opservant.testing`` holds the local
test harness.
"""

from .executor import BaseExecutor, ExecutorResult, ExecutorError, ValidationError

__version__ = "0.1.0"
__all__ = ["BaseExecutor", "ExecutorResult", "ExecutorError", "ValidationError"]
