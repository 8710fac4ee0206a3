"""The numpy twin of the device index formulas for the host state (``_device.table_entry`` /
``window_len`` in the kernels, DESIGN §4): one home for each of

* :func:`ring_col` — the column of logical block ``i`` in a table of ring width ``ring`` (0: a plain
  table, the column is ``i``); :func:`col_modulus` the modulus that gives it with one ``%``;
* :func:`flat_offset` — the offset of ``(group, slot, column)`` in the flat table buffer;
* :func:`window_start` — the lowest position a row reads: ``max(nc - W + 1, 0)``, at least the
  replay start, then rank-local under DCP;
* :func:`cp_owned` — how many of positions ``0 .. n - 1`` a rank owns (DCP interleave).

Every function takes Python ints or numpy arrays (broadcasting), and computes what the device reads.
The ``*_at`` functions are the same formulas on int64 scalars, compiled (:func:`~dsv4_index._numba.njit`),
for the compiled host passes (``state/<pass>/kernel.py``) and callable from Python alike.
"""

from __future__ import annotations

import numpy as np

from .._common import cp_owned_count
from .._numba import njit

__all__ = ["ring_col", "col_modulus", "flat_offset", "window_start", "cp_owned", "ring_col_at", "window_start_at",
           "cp_owned_at"]

_NO_RING = np.iinfo(np.int64).max  # NOTE: a modulus no column reaches (plain tables)


def ring_col(i, ring):
    """Column of logical block ``i``: ``i % ring`` for a ring, ``i`` for a plain table (``ring == 0``)."""
    if isinstance(ring, (int, np.integer)):
        return i % ring if ring else i
    return np.where(ring > 0, i % np.maximum(ring, 1), i)


def col_modulus(ring):
    """The modulus ``m`` with ``ring_col(i, ring) == i % m`` (huge for plain tables)."""
    return np.where(np.asarray(ring) > 0, ring, _NO_RING)


def flat_offset(base, cols, slot, col):
    """Offset of column ``col`` of ``slot``'s row in the flat buffer (``base``, ``cols``: the group's)."""
    return base + slot * cols + col


def cp_owned(n, cp):
    """How many of positions ``0 .. n - 1`` rank ``cp[1]`` owns (``cp = (world, rank, interleave)``)."""
    return cp_owned_count(n, *cp)


def window_start(nc, window, replay_start=None, cp=None):
    """The lowest position a row whose first token is at ``nc`` reads in a window of ``window`` tokens:
    ``max(nc - window + 1, 0)``, at least ``replay_start``; rank-local (:func:`cp_owned`) when ``cp`` is
    given. Ints give an int."""
    if isinstance(nc, (int, np.integer)) and isinstance(window, (int, np.integer)) and replay_start is None \
            and cp is None:
        return max(nc - window + 1, 0)
    s = np.maximum(nc - window + 1, 0)
    if replay_start is not None:
        s = np.maximum(s, replay_start)
    return s if cp is None else cp_owned(s, cp)


@njit
def ring_col_at(i, ring):
    """:func:`ring_col` of one logical block (``ring == 0``: a plain table)."""
    return i % ring if ring > 0 else i


@njit
def window_start_at(nc, window, replay_start):
    """:func:`window_start` of one row: ``max(nc - window + 1, 0, replay_start)`` (``replay_start`` 0: none)."""
    return max(nc - window + 1, 0, replay_start)


@njit
def cp_owned_at(n, world, rank, interleave):
    """:func:`cp_owned` of one count ``n >= 0``."""
    cycle = interleave * world
    return (n // cycle) * interleave + min(max(n % cycle - rank * interleave, 0), interleave)
