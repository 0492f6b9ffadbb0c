"""Compatibility alias of ``opservant`` under the name used by seed 000 (``s4e_agent``)."""

from opservant import *  # noqa: F401,F403
from opservant import __all__, __version__  # noqa: F401
