"""The one place numba is imported: ``from .._numba import njit`` in every compiled host pass.

Every host pass is ``@njit`` = ``numba.njit(cache=True, nogil=True)``: compiled once per argument
signature (pin the dtypes and layouts of what you pass; :meth:`MetadataPipeline.warmup` compiles every
pass a pipeline uses), cached on disk (``__pycache__`` or ``NUMBA_CACHE_DIR``), and releasing the GIL.
Never ``parallel=True``: vLLM forks its engine process, and numba's OpenMP / TBB layers do not survive a
fork. ``NUMBA_DISABLE_JIT=1`` runs the same source as plain Python (slow; for debugging, and one CI rerun
of ``tests/state``). Compiled code does not bounds-check: a pass range-checks every index it reads
through before it reads (``NUMBA_BOUNDSCHECK=1`` turns numba's own checks on for the fuzz tests).
"""

from __future__ import annotations

import numba

__all__ = ["njit", "signatures", "numba"]


def njit(fn):
    """``numba.njit(cache=True, nogil=True)(fn)``: the one decorator of a compiled host pass."""
    return numba.njit(cache=True, nogil=True)(fn)


def signatures(fn) -> int:
    """How many signatures ``fn`` (an :func:`njit` pass) has compiled in this process (0 under
    ``NUMBA_DISABLE_JIT=1``, where passes are plain functions): tests assert serving adds none."""
    return len(getattr(fn, "signatures", ()))
