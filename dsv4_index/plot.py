"""Moved to :mod:`dsv4_index.tools.plot`; this name stays importable."""

from .tools.plot import *  # noqa: F401,F403
from .tools.plot import __all__  # noqa: F401
