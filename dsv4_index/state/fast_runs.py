"""The write runs and bounds of the incremental path (:mod:`.steady`): one-id appends vectorised, up to
:data:`MAX_OTHER_RUNS` (or two per group) other runs (a joining request's lists, a row cut back) one by one in Python
ints; the slack of each run's (group, batch row) cell updated; then one unsigned compare proving
coverage, every ring bound and the table width (the inequality of :mod:`.steady`'s docstring)."""

from __future__ import annotations

import numpy as np

from ._index import window_start

__all__ = ["check_runs", "bounds_ok", "MAX_OTHER_RUNS"]

_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)
_EMPTY = np.zeros(0, dtype=np.int64)
_ZERO1 = np.zeros(1, dtype=np.int64)
_count = np.count_nonzero
_APPEND = -1
MAX_OTHER_RUNS = 32  # NOTE: runs that are not one-id appends, checked one by one in Python ints (or two per
                     # group: two joining requests' lists)


def _umax(x: np.ndarray) -> int:
    """Largest entry as unsigned (negatives view as huge): argmax + item, no numpy wrapper."""
    u = x.view(_U64)
    return u.item(u.argmax())


def _arrays(batch):
    """The write-run arrays when all are int64 1-D numpy arrays of matching sizes, else None."""
    gid, slot, start, cu, ids = (batch.write_gids, batch.write_slots, batch.write_starts, batch.write_cu,
                                 batch.write_ids)
    for x in (gid, slot, start, cu, ids):
        if type(x) is not np.ndarray or x.dtype is not _I64 or x.ndim != 1:
            return None
    N = gid.shape[0]
    if slot.shape[0] != N or start.shape[0] != N or cu.shape[0] != N + 1:
        return None
    return gid, slot, start, cu, ids


def check_runs(batch, c, tables, flat, row_map, occ, new_slots, seq, b_nc, max_writes):
    """The checked runs, their slack cells applied to ``flat``:
    ``(gid, slot, start, end, keep, cu, ids, row, key, other)`` (kernel blocks; ``other``: indices of
    the runs that are not one-id appends, or None), or None when not proved.

    A run's slot must be a batch row (so it is occupied after the step) and its group non-circular:
    ``gpos[gid] * B + row[slot]`` is then its slack cell, negative otherwise (``_OUT``)."""
    if batch.write_gids is None or len(batch.write_gids) == 0:
        return _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _ZERO1, _EMPTY, _EMPTY, _EMPTY, None, None
    got = _arrays(batch)
    if got is None:
        return None
    gid, slot, start, cu, ids = got
    geo, N, L = c.geo, gid.shape[0], ids.shape[0]
    appends = L == N and cu.tobytes() == geo.arange_bytes[:8 * N + 8] and start.tobytes() == geo.append_bytes[:8 * N]
    if not appends:
        if cu[0] != 0 or cu[-1] != L or _umax(cu) > L:
            return None
        n = cu[1:] - cu[:-1]
        if n.item(n.argmin()) < 0:
            return None
    both = gid | slot
    if L > max_writes or _umax(both) >= geo.num_slots or (L and _umax(ids) > tables.id_max_min):
        return None  # NOTE: gid < num_slots indexes gpos (_OUT past the groups)
    key = np.multiply(gid, geo.num_slots_0d)  # NOTE: a 0-d operand: a Python int costs a conversion
    key += slot
    row = row_map.take(slot)
    cells = geo.cell_base(seq.shape[0]).take(gid)
    cells += row
    if cells.item(cells.argmin()) < 0:
        return None  # NOTE: a gid past the groups, a circular group, a run outside the batch
    seen = c.scratch.seen
    seen[key] = True
    distinct = _count(seen)
    seen[key] = False
    if distinct != N:
        return None  # NOTE: two runs for one (group, slot)
    have = tables.num_blocks.ravel().take(key)
    if new_slots is not None:
        fresh = np.zeros(geo.num_slots, dtype=bool)
        fresh[new_slots] = True
        have[fresh.take(slot)] = 0
    if appends:
        flat[cells] += geo.bs_of.take(gid)
        return gid, slot, have, have + 1, have, cu, ids, row, key, None, None
    app = start == _APPEND
    app &= n == 1
    other = (~app).nonzero()[0]
    if other.shape[0] > max(MAX_OTHER_RUNS, 2 * len(tables.groups)):
        return None  # NOTE: at least the lists of two joining requests (one run per group each)
    a = app.nonzero()[0]
    if a.shape[0]:
        flat[cells.take(a)] += geo.bs_of.take(gid.take(a))
    begin, end = have.copy(), have + n
    keep = have.copy()
    if not _other_runs(geo, other, gid, start, have, n, row, cells, seq, b_nc, flat, begin, end, keep):
        return None
    return gid, slot, begin, end, keep, cu, ids, row, key, other, a


def _other_runs(geo, other, gid, start, have, n, row, cells, seq, b_nc, flat, begin, end, keep) -> bool:
    """Check the runs ``other`` one by one (Python ints): hole, width, ring trim, slack cell set."""
    for i, g, st, hv, k, r, cell in zip(other.tolist(), gid.take(other).tolist(), start.take(other).tolist(),
                                        have.take(other).tolist(), n.take(other).tolist(),
                                        row.take(other).tolist(), cells.take(other).tolist()):
        if st < _APPEND or st > hv:
            return False  # NOTE: a hole (plain blocks: allocation = kernel blocks)
        sk = hv if st == _APPEND else st
        ek = sk + k
        if ek > geo.logical_list[g]:
            return False
        kp = sk
        ring = geo.ring_list[g]
        if ring:
            bs = geo.bs_list[g]
            lo = window_start(int(b_nc[r]), geo.window_list[g]) // bs
            kp = max(sk, ek - ring, lo)
        begin[i], end[i], keep[i] = sk, ek, kp
        flat[cell] = ek * geo.bs_list[g] - int(seq[r])
    return True


def bounds_ok(geo, x: np.ndarray, seq: np.ndarray, q_max: int, gid, end) -> bool:
    """Coverage, every ring bound and the table width of every row (module docstring)."""
    if not x.size:
        return True
    lim = min(geo.bound0_min - q_max, geo.covered_min - seq.item(seq.argmax()))
    if lim >= 0 and _umax(x) <= lim:
        return True
    # NOTE: the scalar bound failed: the table width of each run, then the exact per-group bounds
    if gid.size and _count(end > geo.width.take(gid)):
        return False
    U = geo.bound0 - q_max
    if U.item(U.argmin()) < 0:
        return False
    return not _count(x.view(_U64) > U.astype(_U64)[:, None])
