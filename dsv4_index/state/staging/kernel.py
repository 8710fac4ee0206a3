"""The one write pass of a step (compiled): every region of the staging format (:mod:`.format`) and the
host mirror of the block tables, in one call, loops over rows, tokens, runs and ids.

A run ``i`` sets logical blocks ``[start[i], end[i])`` with ``end[i] - start[i]`` ids (checked) and
stores those from ``max(keep[i], start[i])`` on. It range-checks every index it reads or writes through
before writing anything (a plan that was not checked cannot corrupt memory): it returns ``(N, 0, 0)``
(``N`` ids staged) or ``(-1, field, i)`` with ``field`` an index into :data:`FIELDS` and ``i`` the
offending entry, the buffers untouched.
"""

from __future__ import annotations

from ..._numba import njit, pin, ro, rw
from .._index import cp_owned_at

__all__ = ["stage_step", "FIELDS"]

# NOTE: what a failed range check names (field 0: none)
FIELDS = ("", "num_scheduled", "seq_lens", "replay_start", "replay_end", "w_gid", "w_slot", "w_start", "w_row",
          "w_cu", "w_end", "write_ids", "lay")
_Q, _SEQ, _RS, _RE, _GID, _SLOT, _START, _ROW, _CU, _END, _IDS, _LAY = range(1, 13)


@njit
def _check(h, mirror, geo, lay, scal, slots, q, seq, rs, re, gid, slot, start, end, keep, row, cu, ids):
    """``(N, field, i)``: the ids the step stages, or the first index out of range (module docstring)."""
    B, T, num_slots = slots.shape[0], scal[0], scal[4]
    R, G = lay[8], geo.shape[0]
    if B > R or T > lay[9] or lay[7] > h.shape[0] or lay[6] + 3 * G * R > lay[7]:
        return -1, _LAY, B
    if q.shape[0] != B:
        return -1, _Q, q.shape[0]
    if seq.shape[0] != B:
        return -1, _SEQ, seq.shape[0]
    if scal[2] and rs.shape[0] != B:
        return -1, _RS, rs.shape[0]
    if scal[3] and re.shape[0] != B:
        return -1, _RE, re.shape[0]
    acc = 0
    for b in range(B):
        if q[b] < 0 or acc + q[b] > T:
            return -1, _Q, b
        acc += q[b]
    if acc != T:
        return -1, _Q, B
    n_runs = gid.shape[0]
    for a in (slot, start, end, keep, row):
        if a.shape[0] != n_runs:
            return -1, _GID, a.shape[0]
    if cu.shape[0] != n_runs + 1 or cu[0] < 0:
        return -1, _CU, 0
    N = 0
    for i in range(n_runs):
        g, s, r = gid[i], slot[i], row[i]
        if g < 0 or g >= G:
            return -1, _GID, i
        if s < 0 or s >= num_slots:
            return -1, _SLOT, i
        if r < -1 or r >= R:
            return -1, _ROW, i
        if cu[i + 1] < cu[i] or cu[i + 1] > ids.shape[0]:
            return -1, _CU, i + 1
        if end[i] != start[i] + cu[i + 1] - cu[i]:
            return -1, _END, i
        first, stop = max(keep[i], start[i]), end[i]
        if stop > first:
            if start[i] < 0:
                return -1, _START, i
            ring, cols = geo[g, 2], geo[g, 1]
            if ring == 0 and stop > cols:
                return -1, _END, i
            if ring > cols or geo[g, 0] + num_slots * cols > mirror.shape[0]:
                return -1, _LAY, g
            N += stop - first
    if lay[7] + 2 * N > h.shape[0]:
        return -1, _IDS, N
    ne = lay[11] if lay.shape[0] > 11 else 0
    if lay.shape[0] < 12 + 5 * ne:
        return -1, _LAY, 11
    for e in range(ne):
        k, ratio, world, inter, rank = lay[12 + 5 * e], lay[13 + 5 * e], lay[14 + 5 * e], lay[16 + 5 * e], \
            lay[15 + 5 * e]
        if k < 0 or lay[10] + (k + 1) * (R + 1) > lay[6] or ratio < 1 or world < 1 or inter < 1 or rank < 0:
            return -1, _LAY, 12 + 5 * e
    return N, 0, 0


@njit
def _extra(h, lay, seq):
    """The staged per-request inputs the pass computes (``lay[11]`` of them, each ``(k, compress ratio, world,
    rank, interleave)``): extra array ``k`` = ``0``, then the running sum of the rank's rows of ``seq // ratio``
    (:func:`dsv4_index.ops.indexer_lengths.naive.staged_cu`)."""
    ne = lay[11] if lay.shape[0] > 11 else 0
    for e in range(ne):
        x = 12 + 5 * e
        k, ratio, world, rank, inter = lay[x], lay[x + 1], lay[x + 2], lay[x + 3], lay[x + 4]
        at = lay[10] + k * (lay[8] + 1)
        h[at] = 0
        acc = 0
        for b in range(seq.shape[0]):
            rows = seq[b] // ratio
            acc += cp_owned_at(rows, world, rank, inter) if world > 1 else rows
            h[at + 1 + b] = acc


def stage_step(h, mirror, geo, lay, scal, slots, q, seq, rs, re, gid, slot, start, end, keep, row, cu, ids):
    """Stage one checked step into host buffer ``h`` and the host mirror.

    h : int32 ``[capacity]`` — the staging buffer (format of :mod:`.format`).
    mirror : int32 ``[total]`` — the host mirror of the flat block-table buffer.
    geo : int64 ``[G, 3]`` — per group (flat base, stored columns, ring width or 0).
    lay : int64 — :meth:`StageLayout.vector`, then (optional) the count of the staged inputs the pass computes
        and ``(k, compress ratio, world, rank, interleave)`` of each (:meth:`StepStaging.vector`).
    scal : int64 ``[5]`` — (T, num_decodes, has_replay_start, has_replay_end, num_slots).
    slots, q, seq : int64 ``[B]`` — batch rows (decode first): slot, scheduled tokens, seq_lens.
    rs, re : int64 ``[B]`` (or ``[0]`` when absent) — replay bounds.
    gid, slot, start, end, keep, row : int64 ``[N_runs]`` — the plan's write runs (kernel blocks).
    cu : int64 ``[N_runs + 1]``; ids : int64 ``[n]`` — each run's ids.

    Returns ``(N, 0, 0)`` or ``(-1, field, i)`` (nothing written).
    """
    N, bad, at = _check(h, mirror, geo, lay, scal, slots, q, seq, rs, re, gid, slot, start, end, keep, row, cu, ids)
    if bad:
        return N, bad, at
    B, T = slots.shape[0], scal[0]
    o_qsl, o_seq, o_slots, o_rs, o_re, o_tok, o_ov, w0, R = lay[0], lay[1], lay[2], lay[3], lay[4], lay[5], lay[6], \
        lay[7], lay[8]
    h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7] = B, T, scal[1], N, scal[2], scal[3], 0, 0
    h[o_qsl] = 0
    p = 0
    for b in range(B):
        h[o_tok + p:o_tok + p + q[b]] = b
        p += q[b]
        h[o_qsl + 1 + b] = p
        h[o_seq + b] = seq[b]
        h[o_slots + b] = slots[b]
    if scal[2]:
        for b in range(B):
            h[o_rs + b] = rs[b]
    if scal[3]:
        for b in range(B):
            h[o_re + b] = re[b]
    _extra(h, lay, seq)
    G = geo.shape[0]
    h[o_ov:o_ov + 3 * G * R] = 0  # NOTE: a slice fill (a memset), 2-3x the element loop
    p = 0
    for i in range(gid.shape[0]):
        g = gid[i]
        base, cols, ring = geo[g, 0], geo[g, 1], geo[g, 2]
        first, stop = max(keep[i], start[i]), end[i]
        if row[i] >= 0:
            at = o_ov + 3 * (g * R + row[i])
            h[at], h[at + 1], h[at + 2] = first, end[i], w0 + p
        row0 = base + slot[i] * cols
        src = cu[i] - start[i]
        for lb in range(first, stop):
            v = ids[src + lb]
            d = row0 + (lb % ring if ring > 0 else lb)
            h[w0 + p] = v
            h[w0 + N + p] = d
            mirror[d] = v
            p += 1
    return N, 0, 0


stage_step = pin(stage_step, (rw("int32"), rw("int32"), ro("int64", 2)) + (ro("int64"),) * 15)
