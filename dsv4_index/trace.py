"""Moved to :mod:`dsv4_index.tools.trace` (recording) and :mod:`dsv4_index.tools.replay`; these names
stay importable."""

from .tools.replay import Problem, ReplayResult, replay_trace  # noqa: F401
from .tools.trace import *  # noqa: F401,F403
from .tools.trace import __all__ as _recording

__all__ = list(_recording) + ["replay_trace", "ReplayResult", "Problem"]
