# over 400 lines: the compiled checks, "safe" in one pass and "full" in another, each in its definition's order
"""The step checks of ``checks="safe"`` as one compiled pass (the definition: :mod:`.naive`).

:func:`check_step` reads the step's arrays (int64, C-contiguous; ``is_new`` bool), the occupancy and the
block counts, and the tables' geometry stacked in one array; it writes only ``out`` (a fresh buffer per step:
the plan's arrays are views of it). ``out[:6]`` = ``(code, i, j, k, v, w)`` (code 0: accepted; else an index into
:data:`CODES`, worded by ``checks/__init__.py`` from :mod:`~dsv4_index.state.messages`), then the plan. The
checks run in the order of the definition, each finding the first offending entry, so a step with several
faults gets the same message from both. Every index the pass reads through is range
checked by an earlier check of the same pass (slots before occupancy, groups before geometry, ``write_cu``
before ``write_ids``).

``geo`` int64 ``[G, 8]``: per group (block size, window, ring width or 0, circular, logical blocks, kernel
blocks per allocation block ``f``, largest kernel-block id, sharded under DCP). ``comp`` int64 ``[C, 3]``:
(gid, compress ratio, rows per block) of the compressed channels. ``lim`` int64 ``[15]``: see :data:`LIM`.
"""

from __future__ import annotations

import numpy as np

from ..._numba import njit, pin, ro, rw
from .._index import cp_owned_at, window_start_at

__all__ = ["check_step", "full_step", "CODES", "FULL_CODES", "LIM", "GEO", "FGEO", "OUT", "HEAD", "out_size"]

CODES = ("", "out_of_range", "negative", "beyond_model_len", "too_many_tokens", "slot_twice", "free_twice",
         "free_not_held", "new_held", "not_held", "pad_to", "replay_start", "replay_end_negative", "replay_end_int32",
         "write_slot_free", "write_cu", "two_runs", "hole", "run_too_long", "id_negative", "id_int32", "ring_short",
         "blocks_missing", "too_many_staged", "deferred", "lengths")
(_RANGE, _NEG, _MML, _TOKENS, _SLOT2, _FREE2, _FREE_HELD, _NEW_HELD, _NOT_HELD, _PAD, _RS, _RE_NEG, _RE_32, _W_FREE,
 _CU, _RUNS2, _HOLE, _LONG, _ID_NEG, _ID_32, _RING, _MISSING, _STAGED, _DEFER, _LENGTHS) = range(1, 26)
# NOTE: lim: slots, max_model_len, max_num_tokens, max_writes, pad_to, next_n, cp world, rank, interleave, fmax,
# smallest id_max, has replay_start / replay_end / runs (1, 0: none, -1: deferred), pad_to given (0 no, 1 int, 2 bad)
LIM = ("slots", "max_model_len", "max_num_tokens", "max_writes", "pad_to", "next_n", "world", "rank", "interleave",
       "fmax", "id_max_min", "has_rs", "has_re", "has_runs", "pad_kind")
GEO = ("bs", "window", "ring", "circular", "logical", "f", "id_max", "sharded")
APPEND = -1  # NOTE: batch.APPEND (a kernel imports no package module but _numba and _index)
INT32_MAX = 2 ** 31 - 1


@njit
def _fail(err, code, i, j, k, v):
    err[0], err[1], err[2], err[3], err[4] = code, i, j, k, v


@njit
def _first_out(x, hi):
    for i in range(x.shape[0]):
        if x[i] < 0 or x[i] >= hi:
            return i
    return -1


@njit
def _lengths(lim, req_slots, nc, q, is_new, rs, re, gid, slot, start, cu):
    """The per-row arrays have one entry per row, the run arrays one per run (``write_cu`` one more): false
    sends the caller to its converting path (``checks/__init__.py``), which names the field."""
    n, N = req_slots.shape[0], gid.shape[0]
    ok = nc.shape[0] == n and q.shape[0] == n and is_new.shape[0] == n
    ok = ok and (lim[11] <= 0 or rs.shape[0] == n) and (lim[12] <= 0 or re.shape[0] == n)
    return ok and (lim[13] <= 0 or (slot.shape[0] == N and start.shape[0] == N and cu.shape[0] == N + 1))


@njit
def _rows(err, occupied, lim, req_slots, nc, q, is_new, free):
    """Rows and freed slots (slots in range and distinct, counts bounded, occupancy): the occupancy after."""
    S, n = lim[0], req_slots.shape[0]
    occ = occupied.copy()
    bad = False  # NOTE: one pass finds whether any check below fails; they then find the first culprit in order
    for i in range(n):
        bad |= (req_slots[i] < 0) | (req_slots[i] >= S) | (nc[i] < 0) | (q[i] < 0) | (nc[i] > lim[1]) | (q[i] > lim[2])
    if bad:
        i = _first_out(req_slots, S)
        if i >= 0:
            return _fail(err, _RANGE, i, req_slots[i], 0, S)
        for i in range(n):
            if nc[i] < 0:
                return _fail(err, _NEG, i, nc[i], 0, 0)
        for i in range(n):
            if q[i] < 0:
                return _fail(err, _NEG, i, q[i], 1, 0)
        for i in range(n):
            if nc[i] > lim[1]:
                return _fail(err, _MML, i, nc[i], 0, lim[1])
        return _fail(err, _TOKENS, -1, 0, 0, lim[2])  # NOTE: the one check left: some q > max_num_tokens
    if n:
        seen = np.zeros(S, dtype=np.bool_)
        twice = False
        for i in range(n):
            twice |= seen[req_slots[i]]
            seen[req_slots[i]] = True
        if twice:
            count = np.zeros(S, dtype=np.int64)
            for i in range(n):
                count[req_slots[i]] += 1
            s = np.argmax(count)
            return _fail(err, _SLOT2, s, count[s], 0, 0)
    if free.shape[0]:
        i = _first_out(free, S)
        if i >= 0:
            return _fail(err, _RANGE, i, free[i], 1, S)
        seen = np.zeros(S, dtype=np.bool_)
        for i in range(free.shape[0]):
            if seen[free[i]]:
                return _fail(err, _FREE2, 0, 0, 0, 0)
            seen[free[i]] = True
        for i in range(free.shape[0]):
            if not occ[free[i]]:
                return _fail(err, _FREE_HELD, i, free[i], 0, 0)
        for i in range(free.shape[0]):
            occ[free[i]] = False
    for i in range(n):
        if occ[req_slots[i]] == is_new[i]:
            return _fail(err, _NEW_HELD if is_new[i] else _NOT_HELD, i, req_slots[i], 0, 0)
    for i in range(n):
        if is_new[i]:
            occ[req_slots[i]] = True
    return occ


@njit
def _order(err, lim, q, order):
    """The device batch (rows with tokens, decode first, stable) into ``order[:B]``: ``(B, num_decodes, T,
    T_pad)``."""
    n, next_n = q.shape[0], lim[5]
    T = 0
    for i in range(n):
        T += q[i]
    if T > lim[2]:
        _fail(err, _TOKENS, 0, T, 0, lim[2])
    elif lim[14] == 2 or (lim[14] == 1 and not T <= lim[4] <= lim[2]):
        _fail(err, _PAD, 0, T, 0, lim[2])
    B = nd = 0
    for i in range(n):
        if 0 < q[i] <= next_n:
            order[B] = i
            B += 1
    nd = B
    for i in range(n):
        if q[i] > next_n:
            order[B] = i
            B += 1
    return B, nd, T, (T if lim[14] == 0 else lim[4])


@njit
def _replay(err, lim, b_slots, b_nc, rs_b, re_b):
    """Replay bounds in device order: ``0 <= replay_start <= nc``, ``0 <= replay_end <= INT32_MAX``."""
    if lim[11] < 0:
        return _fail(err, _DEFER, 0, 0, 0, 0)
    for i in range(rs_b.shape[0]):
        if rs_b[i] < 0 or rs_b[i] > b_nc[i]:
            return _fail(err, _RS, b_slots[i], rs_b[i], 0, b_nc[i])
    if lim[12] < 0:
        return _fail(err, _DEFER, 1, 0, 0, 0)
    for i in range(re_b.shape[0]):
        if re_b[i] < 0:
            return _fail(err, _RE_NEG, b_slots[i], re_b[i], 0, 0)
    for i in range(re_b.shape[0]):
        if re_b[i] > INT32_MAX:
            return _fail(err, _RE_32, b_slots[i], re_b[i], 0, 0)


@njit
def _run_shapes(err, lim, G, occ, gid, slot, cu, ids):
    """Groups and slots in range, slots held after the step, ``write_cu`` rising to ``len(write_ids)``,
    one run per (group, slot)."""
    S, N = lim[0], gid.shape[0]
    i = _first_out(gid, G)
    if i >= 0:
        return _fail(err, _RANGE, i, gid[i], 2, G)
    i = _first_out(slot, S)
    if i >= 0:
        return _fail(err, _RANGE, i, slot[i], 3, S)
    for i in range(N):
        if not occ[slot[i]]:
            return _fail(err, _W_FREE, i, slot[i], 0, 0)
    if cu[0] != 0 or cu[N] != ids.shape[0]:
        return _fail(err, _CU, 0, 0, 0, ids.shape[0])
    for i in range(N + 1):
        if cu[i] < 0 or cu[i] > ids.shape[0]:
            return _fail(err, _CU, 0, 0, 0, ids.shape[0])
    for i in range(N):
        if cu[i + 1] < cu[i]:
            return _fail(err, _CU, 0, 0, 0, ids.shape[0])
    if N > 1:
        seen = np.zeros(G * S, dtype=np.bool_)
        dup = -1
        for i in range(N):
            key = gid[i] * S + slot[i]
            if seen[key] and (dup < 0 or key < dup):
                dup = key
            seen[key] = True
        if dup >= 0:
            return _fail(err, _RUNS2, dup // S, dup % S, 0, 0)


@njit
def _run_bounds(err, lim, geo, num_blocks, is_fresh, gid, slot, start, cu, ids, start_k, end_k):
    """No hole, inside the logical width, ids that keep slots in int32: ``start_k``, ``end_k`` in kernel blocks."""
    N = gid.shape[0]
    for i in range(N):
        g, f = gid[i], geo[gid[i], 5]
        have = 0 if is_fresh[slot[i]] else num_blocks[g, slot[i]]
        if start[i] < APPEND or start[i] > have // f:
            _fail(err, _HOLE, i, start[i], g, slot[i])
            err[5] = have // f
            return
        start_k[i] = have if start[i] == APPEND else start[i] * f
        end_k[i] = start_k[i] + (cu[i + 1] - cu[i]) * f
    for i in range(N):
        if end_k[i] > geo[gid[i], 4]:
            _fail(err, _LONG, i, slot[i], gid[i], end_k[i])
            return
    for j in range(ids.shape[0]):
        if ids[j] < 0:
            _fail(err, _ID_NEG, j, ids[j], 0, 0)
            return
    for r in range(N):  # NOTE: run by run: write_ids in order (write_cu rises, checked before)
        g = gid[r]
        f = geo[g, 5]
        lim_g = (geo[g, 6] - (f - 1)) // f
        for j in range(cu[r], cu[r + 1]):
            if ids[j] > lim_g:
                _fail(err, _ID_32, j, ids[j], g, lim_g)
                return


@njit
def _expand(lim, geo, gid, cu, ids, cu_k):
    """Allocation-block ids -> kernel-block ids (``f > 1``; the pass keeps the step's ``cu`` and ``ids`` when
    ``fmax == 1``): fills ``cu_k``, returns ``ids_k``."""
    N = gid.shape[0]
    cu_k[0] = 0
    for i in range(N):
        cu_k[i + 1] = cu_k[i] + (cu[i + 1] - cu[i]) * geo[gid[i], 5]
    ids_k = np.empty(cu_k[N], dtype=np.int64)
    for i in range(N):
        f, p = geo[gid[i], 5], cu_k[i]
        for j in range(cu[i], cu[i + 1]):
            for x in range(f):
                ids_k[p] = ids[j] * f + x
                p += 1
    return ids_k


@njit
def _need(lim, geo, comp, g, seq):
    """Kernel blocks a row of ``seq`` tokens needs in group ``g`` (DCP: rank-local; circular: the ring)."""
    if geo[g, 3]:
        return geo[g, 4] if seq > 0 else 0
    n = seq
    if geo[g, 7]:
        n = cp_owned_at(seq, lim[6], lim[7], lim[8])
    need = (n + geo[g, 0] - 1) // geo[g, 0]
    if geo[g, 7]:
        for c in range(comp.shape[0]):
            if comp[c, 0] == g:
                rows = cp_owned_at(seq // comp[c, 1], lim[6], lim[7], lim[8])
                need = max(need, (rows + comp[c, 2] - 1) // comp[c, 2])
    return need


@njit
def _coverage(err, lim, geo, comp, nb, b_slots, b_nc, seq, rs_b):
    """Every scheduled token's blocks present (``nb`` ``[G, B]``: blocks after the runs); ring tables
    holding what a row reads from its window start: the lowest block read, ``lo`` ``[G, B]``."""
    G, B = nb.shape[0], nb.shape[1]
    for g in range(G):
        bs, circ, logical, sharded = geo[g, 0], geo[g, 3], geo[g, 4], geo[g, 7]
        for i in range(B):
            if sharded:
                need = _need(lim, geo, comp, g, seq[i])
            elif circ:
                need = logical if seq[i] > 0 else 0
            elif nb[g, i] * bs >= seq[i]:  # NOTE: nb >= cdiv(seq, bs) without a division (the hot loop)
                continue
            else:
                need = (seq[i] + bs - 1) // bs
            if nb[g, i] < need:
                _fail(err, _MISSING, g, b_slots[i], seq[i], need)
                err[5] = nb[g, i]
                return np.zeros((0, 0), dtype=np.int64)
    lo = np.zeros((G, B), dtype=np.int64)
    has_rs = rs_b.shape[0] > 0
    bad_g, bad_i = G, B  # NOTE: the first (group, row) whose ring is short, in (group, row) order
    for g in range(G):
        if geo[g, 2] > 0 and not geo[g, 3]:
            W, bs, sharded, ring = geo[g, 1], geo[g, 0], geo[g, 7], geo[g, 2]
            sh = 0
            while (1 << sh) < bs:
                sh += 1
            pow2 = (1 << sh) == bs  # NOTE: s >= 0: a shift is the floor division (the hot loop)
            for i in range(B):
                s = window_start_at(b_nc[i], W, rs_b[i] if has_rs else 0)
                if sharded:
                    s = cp_owned_at(s, lim[6], lim[7], lim[8])
                lo[g, i] = s >> sh if pow2 else s // bs
                if nb[g, i] - lo[g, i] > ring and bad_g == G:
                    bad_g, bad_i = g, i
    if bad_g < G:
        _fail(err, _RING, bad_g, b_slots[bad_i], nb[bad_g, bad_i], lo[bad_g, bad_i])
    return lo


@njit
def _keep(err, lim, geo, gid, start_k, end_k, row, cu_k, lo, keep):
    """Ids a run stores (rings: from the lowest block still read), within ``max_writes``: ``keep`` (``w_keep``)."""
    N = gid.shape[0]
    keep[:] = start_k
    for i in range(N):
        g = gid[i]
        if geo[g, 2] > 0 and not geo[g, 3] and lo.shape[0]:
            keep[i] = max(start_k[i], end_k[i] - geo[g, 2])
            if row[i] >= 0:
                keep[i] = max(keep[i], lo[g, row[i]])
    if N and cu_k[N] > lim[3]:
        staged = 0
        for i in range(N):
            if geo[gid[i], 2] > 0:
                keep[i] = max(keep[i], end_k[i] - geo[gid[i], 2])
            staged += max(min(end_k[i] - keep[i], cu_k[i + 1] - cu_k[i]), 0)
        if staged > lim[3]:
            _fail(err, _STAGED, 0, staged, 0, lim[3])


def check_step(occupied, num_blocks, geo, comp, lim, req_slots, nc, q, is_new, free, rs, re, gid, slot, start, cu,
               ids, out):
    """Every ``"safe"`` check of one step (module docstring), into ``out`` (int64, :func:`out_size`; see
    :data:`OUT`): ``err`` and the counts in its head, then the device batch (``b_*``: rows with tokens, decode
    first) and the write runs in kernel blocks (``cu_k`` when ``fmax > 1``). Returns ``ids_k`` (empty when
    ``fmax == 1``: the step's own ids)."""
    err = out[:6]
    e = np.zeros(0, dtype=np.int64)
    err[0] = 0
    if not _lengths(lim, req_slots, nc, q, is_new, rs, re, gid, slot, start, cu):
        _fail(err, _LENGTHS, 0, 0, 0, 0)
        return e
    occ = _rows(err, occupied, lim, req_slots, nc, q, is_new, free)
    if err[0]:
        return e
    n, G, S, N = req_slots.shape[0], geo.shape[0], lim[0], gid.shape[0]
    at, ra = HEAD, HEAD + 7 * n  # NOTE: the plan is written in place (layout OUT)
    B, nd, T, T_pad = _order(err, lim, q, out[at:at + n])
    if err[0]:
        return e
    order, b_slots, b_q, seq = out[at:at + B], out[at + n:at + n + B], out[at + 2 * n:at + 2 * n + B], \
        out[at + 3 * n:at + 3 * n + B]
    b_nc = np.empty(B, dtype=np.int64)
    ndt = 0
    for i in range(B):
        j = order[i]
        b_slots[i], b_q[i], b_nc[i], seq[i] = req_slots[j], q[j], nc[j], nc[j] + q[j]
        ndt += q[j] if i < nd else 0
    rs_b = out[at + 5 * n:at + 5 * n + B] if lim[11] > 0 else e
    re_b = out[at + 6 * n:at + 6 * n + B] if lim[12] > 0 else e
    for i in range(rs_b.shape[0]):
        rs_b[i] = rs[order[i]]
    for i in range(re_b.shape[0]):
        re_b[i] = re[order[i]]
    _replay(err, lim, b_slots, b_nc, rs_b, re_b)
    if err[0]:
        return e
    K = 0
    for i in range(n):
        if is_new[i]:
            out[at + 4 * n + K] = req_slots[i]
            K += 1
    if lim[13] < 0:
        _fail(err, _DEFER, 2, 0, 0, 0)
        return e
    _run_shapes(err, lim, G, occ, gid, slot, cu, ids)
    if err[0]:
        return e
    is_fresh = np.zeros(S, dtype=np.bool_)
    for i in range(K):
        is_fresh[out[at + 4 * n + i]] = True
    start_k, end_k, keep, row = out[ra:ra + N], out[ra + N:ra + 2 * N], out[ra + 2 * N:ra + 3 * N], \
        out[ra + 3 * N:ra + 4 * N]
    _run_bounds(err, lim, geo, num_blocks, is_fresh, gid, slot, start, cu, ids, start_k, end_k)
    if err[0]:
        return e
    ids_k = _expand(lim, geo, gid, cu, ids, out[ra + 4 * N:ra + 5 * N + 1]) if lim[9] > 1 else e
    row_of = np.full(S, -1, dtype=np.int64)
    for i in range(B):
        row_of[b_slots[i]] = i
    for r in range(N):
        row[r] = row_of[slot[r]]
    lo = np.zeros((0, 0), dtype=np.int64)
    if B and G:
        nb = np.empty((G, B), dtype=np.int64)
        for g in range(G):
            for i in range(B):
                nb[g, i] = 0 if is_fresh[b_slots[i]] else num_blocks[g, b_slots[i]]
        for r in range(N):
            if row[r] >= 0:
                nb[gid[r], row[r]] = end_k[r]
        lo = _coverage(err, lim, geo, comp, nb, b_slots, b_nc, seq, rs_b)
        if err[0]:
            return e
    _keep(err, lim, geo, gid, start_k, end_k, row, out[ra + 4 * N:ra + 5 * N + 1] if lim[9] > 1 else cu, lo, keep)
    if err[0]:
        return e
    out[6], out[7], out[8], out[9], out[10], out[11] = nd, ndt, T, T_pad, B, K
    return ids_k


HEAD = 16
# NOTE: out: err [6], (num_decodes, num_decode_tokens, T, T_pad, B, K new), 4 spare; then 7 row arrays of n entries
# (order, b_slots, b_q, seq, new_slots, rs_b, re_b), 4 run arrays of N (start_k, end_k, keep, row), cu_k [N + 1]
OUT = ("err", "counts", "rows", "runs", "cu_k")


def out_size(n: int, N: int) -> int:
    """Entries of ``out`` for ``n`` StepBatch rows and ``N`` write runs."""
    return HEAD + 7 * n + 5 * N + 1


_I = ro("int64")
check_step = pin(check_step, (ro("bool"), ro("int64", 2), ro("int64", 2), ro("int64", 2)) + (_I,) * 4 + (ro("bool"),)
                 + (_I,) * 8 + (rw("int64"),))


# ----------------------------------------------------------------------------------------------
# checks="full": the definition is checks/naive.py full_checks (same order, same first culprit)
# ----------------------------------------------------------------------------------------------
FULL_CODES = ("", "null_block", "id_twice", "ring_shared")
# NOTE: fgeo int64 [G, 9]: full, circular, sliding, base, cols, f, bs, window, sharded (under DCP)
FGEO = ("full", "circular", "sliding", "base", "cols", "f", "bs", "window", "sharded")


@njit
def _null_blocks(err, fgeo, lim, seq, q, rs, gid, slot, start, row, cu, ids, raw_cu):
    """No null id among a step's write ids where a row reads (sliding: from its window start on):
    ``err`` = (1, g, slot, batch row, logical block, raw index, count of bad ids)."""
    G, B = fgeo.shape[0], seq.shape[0]
    lo = np.zeros((G, B), dtype=np.int64)
    for g in range(G):
        if fgeo[g, 2]:
            for i in range(B):
                s = window_start_at(seq[i] - q[i], fgeo[g, 7], rs[i] if rs.shape[0] else 0)
                if fgeo[g, 8]:
                    s = cp_owned_at(s, lim[6], lim[7], lim[8])
                lo[g, i] = s // fgeo[g, 6]
    count = 0
    for r in range(gid.shape[0]):
        g = gid[r]
        for j in range(cu[r], cu[r + 1]):
            if ids[j] >= fgeo[g, 5]:
                continue
            logical = start[r] + j - cu[r]
            if fgeo[g, 2] and (row[r] < 0 or (B > 0 and logical < lo[g, row[r]])):
                continue
            if count == 0:
                err[0], err[1], err[2], err[3], err[4] = 1, g, slot[r], row[r], logical
                err[5] = raw_cu[r] + (j - cu[r]) // fgeo[g, 5]
            count += 1
    err[6] = count


@njit
def _duplicates(err, fgeo, mirror, gid, slot, start, cu, ids):
    """No id twice in a row of a full or circular group, nor an id the row already holds (its columns
    before the run's start): ``err`` = (2, run, smallest such id, g, slot)."""
    for r in range(gid.shape[0]):
        g = gid[r]
        if not (fgeo[g, 0] or fgeo[g, 1]) or cu[r + 1] == cu[r]:
            continue
        held = min(max(start[r], 0), fgeo[g, 4])
        both = np.empty(held + cu[r + 1] - cu[r], dtype=np.int64)
        at = fgeo[g, 3] + slot[r] * fgeo[g, 4]
        for c in range(held):
            both[c] = mirror[at + c]
        both[held:] = ids[cu[r]:cu[r + 1]]
        both.sort()
        for k in range(1, both.shape[0]):
            if both[k] == both[k - 1]:
                err[0], err[1], err[2], err[3], err[4] = 2, r, both[k], g, slot[r]
                return


@njit
def _shared_rings(err, fgeo, mirror, num_blocks, free, new, gid, slot, start, cu, ids):
    """No positive block id in the rings of two live rows of a circular group after the step's runs:
    ``err`` = (3, id, lower slot, next slot, g) of the smallest such id."""
    G, S = fgeo.shape[0], num_blocks.shape[1]
    for g in range(G):
        if not fgeo[g, 1]:
            continue
        nr = 0
        for r in range(gid.shape[0]):
            nr += gid[r] == g
        if nr == 0:
            continue
        nb = num_blocks[g].copy()
        nb[free] = 0
        nb[new] = 0
        for r in range(gid.shape[0]):
            if gid[r] == g:
                nb[slot[r]] = min(nb[slot[r]], start[r])
        cols = fgeo[g, 4]
        n = 0
        for s in range(S):
            n += min(max(nb[s], 0), cols)
        for r in range(gid.shape[0]):
            if gid[r] == g:
                n += cu[r + 1] - cu[r]
        key = np.empty(n, dtype=np.int64)  # NOTE: id * S + owner slot: sorted = (id, owner) order
        k = 0
        for s in range(S):
            for c in range(min(max(nb[s], 0), cols)):
                v = np.int64(mirror[fgeo[g, 3] + s * cols + c])
                if v > 0:
                    key[k] = v * S + s
                    k += 1
        for r in range(gid.shape[0]):
            if gid[r] == g:
                for j in range(cu[r], cu[r + 1]):
                    if ids[j] > 0:
                        key[k] = ids[j] * S + slot[r]
                        k += 1
        key = np.sort(key[:k])
        for j in range(1, k):
            if key[j] // S == key[j - 1] // S and key[j] != key[j - 1]:
                err[0], err[1], err[2], err[3], err[4] = 3, key[j] // S, key[j - 1] % S, key[j] % S, g
                return


def full_step(err, fgeo, lim, mirror, num_blocks, seq, q, rs, free, new, gid, slot, start, row, cu, ids, raw_cu):
    """Every ``"full"`` check of a planned step (kernel-block runs ``gid .. ids``; ``raw_cu`` the step's
    ``write_cu`` in allocation ids) into ``err`` int64 ``[8]`` (code of :data:`FULL_CODES`, then fields)."""
    err[0] = 0
    _null_blocks(err, fgeo, lim, seq, q, rs, gid, slot, start, row, cu, ids, raw_cu)
    if err[0]:
        return
    _duplicates(err, fgeo, mirror, gid, slot, start, cu, ids)
    if err[0]:
        return
    if gid.shape[0]:
        _shared_rings(err, fgeo, mirror, num_blocks, free, new, gid, slot, start, cu, ids)


full_step = pin(full_step, (rw("int64"), ro("int64", 2), _I, ro("int32"), ro("int64", 2)) + (_I,) * 12)
