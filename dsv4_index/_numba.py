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
import numpy as np

__all__ = ["njit", "njit_inline", "signatures", "numba", "pin", "compile_pinned", "ro", "rw", "ready"]

_PINNED: list = []  # NOTE: (dispatcher, argument types) of every pass compiled for one signature
_READY = [False]


def njit(fn):
    """``numba.njit(cache=True, nogil=True)(fn)``: the one decorator of a compiled host pass."""
    return numba.njit(cache=True, nogil=True)(fn)


def njit_inline(fn):
    """:func:`njit` inlined into its callers at numba's IR level (``inline="always"``): for the small helpers
    of a pass (bounds, cells, table lookups) that run once a row and group."""
    return numba.njit(cache=True, nogil=True, inline="always")(fn)


def signatures(fn) -> int:
    """How many signatures ``fn`` (an :func:`njit` pass) has compiled in this process (0 under
    ``NUMBA_DISABLE_JIT=1``, where passes are plain functions): tests assert serving adds none."""
    return len(getattr(fn, "signatures", ()))


def ro(dtype, ndim: int = 1):
    """A read-only C-contiguous array type (a writable array converts to it; one signature takes both)."""
    return numba.types.Array(numba.from_dtype(np.dtype(dtype)), ndim, "C", readonly=True)


def rw(dtype, ndim: int = 1):
    """A writable C-contiguous array type (an output of a pass)."""
    return numba.types.Array(numba.from_dtype(np.dtype(dtype)), ndim, "C")


def pin(fn, argtypes: tuple):
    """``njit(fn)`` with exactly one signature ``argtypes`` (:func:`ro` inputs, :func:`rw` outputs), compiled by
    :func:`compile_pinned` (``warmup()``, or the first use); nothing else is ever compiled: a call with other
    types raises ``TypeError``."""
    d = njit(fn)
    _PINNED.append((d, argtypes))
    return d


def compile_pinned() -> None:
    """Compile (or load from the cache) every pinned pass for its one signature, then forbid other compiles
    (once per process)."""
    if _READY[0]:
        return
    for d, sig in _PINNED:
        if hasattr(d, "compile"):  # NOTE: a plain function under NUMBA_DISABLE_JIT=1
            d.compile(sig)
            d.disable_compile()
    _READY[0] = True


def ready() -> bool:
    """True once :func:`compile_pinned` ran in this process."""
    return _READY[0]
