"""Moved to :mod:`dsv4_index.testing.scheduler`; this name stays importable."""

from .testing.scheduler import *  # noqa: F401,F403
from .testing.scheduler import __all__  # noqa: F401
