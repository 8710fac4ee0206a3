"""Moved to :mod:`dsv4_index.tools.trace`; this name stays importable."""

from .tools.trace import *  # noqa: F401,F403
from .tools.trace import __all__  # noqa: F401
