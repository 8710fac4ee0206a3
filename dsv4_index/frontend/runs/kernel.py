"""The write runs of a step's appended blocks, compiled (:mod:`dsv4_index.frontend.runs`; definition:
:mod:`.naive`). One call per id-keyed step that repeats the last batch's rows."""

from __future__ import annotations

from ..._numba import numba, pin, ro, rw
from ..rules import LIMIT

__all__ = ["runs_of", "BAD_VALUE", "BAD_LAYOUT"]

BAD_VALUE, BAD_LAYOUT = -1, -2  # NOTE: a scheduler value out of [0, LIMIT]; the packed layout inconsistent


def runs_of(a, n_checked, at_lens, n_lens, at_rows, n_rows, G, req_slots, w_g, w_s, w_cu):
    """Fill ``w_g[:N]``, ``w_s[:N]``, ``w_cu[:N + 1]`` with the write runs of the non-empty lists; return ``N``.

    ``a`` int64: ``a[:n_checked]`` values that must lie in ``[0, LIMIT]``; ``a[at_lens:at_lens + n_lens]``
    the list lengths, ``G`` per row; ``a[at_rows:at_rows + n_rows]`` the batch row of each such row
    (``n_rows == 0``: row ``k // G``). ``req_slots`` int64 ``[B]``: the request slot of each batch row.
    Returns :data:`BAD_VALUE` when a checked value is out of range, :data:`BAD_LAYOUT` when an offset, a length
    or a row is (the outputs then hold scratch); nothing is read or written out of bounds.
    """
    size, B = a.shape[0], req_slots.shape[0]
    if G <= 0 or n_checked < 0 or n_checked > size or at_lens < 0 or n_lens < 0 or at_lens + n_lens > size \
            or n_lens % G or at_rows < 0 or n_rows < 0 or at_rows + n_rows > size \
            or (n_rows and n_rows * G != n_lens) or w_g.shape[0] < n_lens or w_s.shape[0] < n_lens \
            or w_cu.shape[0] < n_lens + 1:
        return BAD_LAYOUT
    for i in range(n_checked):
        if a[i] < 0 or a[i] > LIMIT:
            return BAD_VALUE
    w_cu[0] = 0
    N, acc = 0, 0
    for k in range(n_lens):
        n = a[at_lens + k]
        if n < 0:
            return BAD_LAYOUT
        if n:
            r = a[at_rows + k // G] if n_rows else k // G
            if r < 0 or r >= B:
                return BAD_LAYOUT
            w_g[N] = k % G
            w_s[N] = req_slots[r]
            acc += n
            N += 1
            w_cu[N] = acc
    return N


_I, _N = ro("int64"), numba.types.int64
runs_of = pin(runs_of, (_I, _N, _N, _N, _N, _N, _N, _I, rw("int64"), rw("int64"), rw("int64")))
