# over 400 lines: the rule's compiled pass in one file (geometry, each check, the count filter, the commit lists)
"""The ownership rule (:mod:`dsv4_index.state.owners`) as compiled passes: :func:`check_pass` (scratch only:
the decision, and the lists the commit applies) and :func:`commit_pass`. Same decisions, same order, same
fields as :mod:`.naive`, by another algorithm: the holders of a block come from a holder count per
(group, id) kept across steps (the committed rows' held ranges), corrected for what the step releases and
acquires; only a block the corrected count says another row may hold is looked up by scanning the group's
table rows as the step leaves them.

Arrays (``G`` groups, ``S`` slots, ``K`` id keys ``kid * G + gid``, ``M`` mirror cells):

* ``geo`` int64 ``[G, 10]``: base, cols, ring, bs, f, window, full, circular, sliding, sharded; ``cp`` int64 ``[3]``.
* ``slot_st`` int64 ``[4, S]``: live, frontier, replay_mark, the step its reads were last verified;
  ``cell_st`` rows 3, 4: the block position a row filled last itself, and that step (a write there skips the
  fill lookup while no write into a shared block happened since);
  ``meta`` int64 ``[1]``: the last step with a write into a block another row may still hold after that step
  (``err[11]`` in the step; :func:`_reads` says why a block whose holders all release it in the step is not one);
  ``cell_st`` int64 ``[5, G, S]``: floor, hold, ring_lo, ...
* ``fill`` int64 ``[cap + 2, 8]``: an open-addressing table of ``cap`` records (a power of two; linear
  probing, :func:`_rec`), one cache line each, keyed by ``kid * G + gid``: 0-2 slot, block position, step of the
  block's last fill (slot -1: none); 3 this step's fill (scratch, 0: none, else its ``F4`` row + 1); 4 committed
  holders; 5 the step's acquisitions - releases (scratch, zero between steps); 6 the key (-1: empty). Row
  ``cap``: records used, more than half used, full; row ``cap + 1``: spare. The table holds the keys the passes
  touched (held, or filled once: a fill record is kept for the prefix-hit position check), not the id range:
  the wrapper rebuilds it at four times the records in use, dropping records with neither a fill nor a holder.
  ``seen`` int64 ``[M]``: ``2 * step + own`` per mirror cell (one cache line for both, :func:`_seen_step`):
  the step of the fill the cell's row last wrote or took, and whether the row filled the block itself (1) or
  took it as a hit (0).
* the step (``P`` int64 ``[7, B]``: slots, seq, scheduled, replay start, replay end, drafts, replay flag;
  ``R`` int64 ``[6, N]``: gid, slot, start, end, keep, cu start; ``w_ids``; ``A`` int64 ``[2, rows]``: slots,
  nc; ``FN`` int64 ``[1, F]``: freed then new slots, ``nf`` freed).
* scratch kept by the wrapper between steps: ``X`` int64 ``[4 + 2G, S]`` (batch row, fresh, nc, live after,
  blocks after per group, ring marks after per group), ``run_of`` int64 ``[G * S]`` (all -1 between passes),
  ``F4`` / ``seen_l`` (this step's fills and cells seen), ``L`` int64 ``[3, n]`` (released records, acquired
  records, records the count filter touched), ``E`` int64 ``[16]`` (the error, a holder found).

A failed check leaves its error in ``E`` (``E[0]``: a code of :data:`CODES`, then its fields, :mod:`.messages`
words them); every index a pass reads through was range-checked by the planner (slots, groups, run bounds) and is
checked again here before use (``E[0] = -1``: an index out of range).
"""

from __future__ import annotations

import numpy as np

from ..._numba import njit, njit_inline, numba, pin, ro, rw

__all__ = ["check_pass", "commit_pass", "rehash", "CODES"]

CODES = ("", "own.jump", "own.ring", "own.again", "own.fill_held", "own.rewind_held", "own.write_held",
         "own.stale_read", "own.hit_position", "own.twice", "own.twice_sliding", "own.held_null")
BASE, COLS, RING, BS, F, WIN, FULL, CIRC, SLID, SHARD = range(10)
HASH_MUL = 2654435761  # NOTE: Knuth's multiplicative hash; keys < 2**28, so key * HASH_MUL < 2**60 (no wrap)
SKIP_VERIFIED = True  # NOTE: a verified row's reads skipped while no fill of a held key changed (see _reads)


@njit_inline
def _owned(x, g, geo, cp):
    if x < 0:
        x = 0
    if geo[g, SHARD] == 0:
        return x
    cyc = cp[2] * cp[0]
    part = x % cyc - cp[1] * cp[2]
    part = min(max(part, 0), cp[2])
    return (x // cyc) * cp[2] + part


@njit_inline
def _cell(g, s, p, geo):
    ring = geo[g, RING]
    return geo[g, BASE] + s * geo[g, COLS] + (p % ring if ring > 0 else p)


@njit_inline
def _lo_block(g, nc, rs, geo, cp):
    pos = max(nc - geo[g, WIN] + 1, 0, rs)
    return _owned(pos, g, geo, cp) // geo[g, BS]


@njit_inline
def _read_lo(g, i, P, geo, cp):
    return _lo_block(g, P[1, i] - P[2, i], P[3, i], geo, cp)


@njit_inline
def _ws(g, i, P, geo, cp):
    nc = P[1, i] - P[2, i]
    ws = max(nc, P[4, i]) if geo[g, FULL] else nc
    return _owned(ws, g, geo, cp), _owned(P[1, i], g, geo, cp)


@njit_inline
def _bounds(g, s, X, P, geo, cp, cell_st):
    """(lowest held, lowest certainly read, blocks) of slot ``s`` in group ``g`` after the step."""
    nb, ring = X[4 + g, s], geo[g, RING]
    if geo[g, SLID] == 0:
        lo = max(nb - ring, 0) if ring > 0 else 0
        return lo, lo, nb
    i = X[0, s]
    if i >= 0:
        lo = _read_lo(g, i, P, geo, cp)
        cert = lo
    elif X[1, s] == 1:
        lo = _lo_block(g, X[2, s], 0, geo, cp)
        cert = lo
    else:
        lo, cert = cell_st[0, g, s], cell_st[1, g, s]
    if ring > 0:
        low = max(X[4 + geo.shape[0] + g, s], nb - ring)
        lo, cert = max(lo, low), max(cert, low)
    return lo, cert, nb


@njit_inline
def _id_after(g, s, q, X, R, w_ids, mirror, geo, run_of, S):
    r = run_of[g * S + s]
    if r >= 0 and max(R[2, r], R[4, r]) <= q < R[3, r]:
        return w_ids[R[5, r] + q - R[2, r]]
    return np.int64(mirror[_cell(g, s, q, geo)])


@njit_inline
def _row_writes(g, s, X, P, geo, cp, slot_st):
    i = X[0, s]
    if i >= 0:
        return _ws(g, i, P, geo, cp)
    if X[1, s] == 1:
        ws = _owned(X[2, s], g, geo, cp)
    else:
        f = slot_st[1, s]
        ws = _owned(max(f, slot_st[2, s]) if geo[g, FULL] else f, g, geo, cp)
    return ws, ws


@njit_inline
def _acq_kind(g, s, q, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S):
    """0: (g, s, q) not acquired in this step; 1: a fill; 2: a hit."""
    r = run_of[g * S + s]
    if r < 0:
        return 0
    lo = _bounds(g, s, X, P, geo, cp, cell_st)[0]
    if not (max(R[2, r], R[4, r], lo) <= q < R[3, r]):
        return 0
    if w_ids[R[5, r] + q - R[2, r]] < geo[g, F]:
        return 0
    ws = _row_writes(g, s, X, P, geo, cp, slot_st)[0]
    return 1 if (geo[g, CIRC] or (q + 1) * geo[g, BS] > ws) else 2


@njit
def _scan(g, kid, s0, q0, mode, whole, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S, out):
    """The first holder of ``kid`` in group ``g`` after the step that ``mode`` asks for (slots in order, then
    table columns in order), into ``out`` (slot, position); False when none. mode 0: another row certainly
    reading (a same-step hit at ``q0`` of a block written whole aside); 1: ``s0`` itself at another
    position, not its own hit of this step; 2: ``s0`` at another position; 3: any other row. Each row's held
    positions only are read (a ring's in column order: from the one in column 0 on, then those before it)."""
    ring = geo[g, RING]
    for s in range(s0 if mode == 1 or mode == 2 else 0, s0 + 1 if mode == 1 or mode == 2 else S):
        if X[3, s] == 0 or ((mode == 0 or mode == 3) and s == s0):
            continue
        lo, cert, nb = _bounds(g, s, X, P, geo, cp, cell_st)
        p0, p1 = lo, min(nb, geo[g, COLS])
        w = p1
        if ring > 0:
            p0, p1 = max(lo, nb - ring), nb
            w = min(max(-(-p0 // ring) * ring, p0), p1)
        for k in range(2):
            a, e = (w, p1) if k == 0 else (p0, w)
            for pos in range(a, e):
                if _holds(g, s, pos, kid, s0, q0, mode, whole, cert, X, P, R, w_ids, mirror, geo, cp, cell_st,
                          slot_st, run_of, S, out):
                    return True
    return False


@njit
def _holds(g, s, pos, kid, s0, q0, mode, whole, cert, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of,
           S, out):
    """Row ``s`` holds ``kid`` at ``pos`` the way ``mode`` of :func:`_scan` asks for (into ``out``)."""
    if _id_after(g, s, pos, X, R, w_ids, mirror, geo, run_of, S) != kid:
        return False
    if mode == 0:
        if pos < cert:
            return False
        k = _acq_kind(g, s, pos, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S)
        if k == 2 and pos == q0 and whole:
            return False
        out[0], out[1], out[2] = s, pos, 1 if k == 1 else 0
        return True
    if mode == 1 or mode == 2:
        if pos == q0:
            return False
        if mode == 1 and _acq_kind(g, s, pos, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S) == 2:
            return False
    out[0], out[1] = s, pos
    return True


@njit
def _committed(g, s, geo, cell_st, num_blocks, slot_st):
    """The committed held range ``(lo, nb)`` of slot ``s`` in group ``g`` (empty when not live)."""
    if slot_st[0, s] == 0:
        return 0, 0
    nb, ring = num_blocks[g, s], geo[g, RING]
    lo = cell_st[0, g, s] if geo[g, SLID] else 0
    if ring > 0:
        lo = max(lo, cell_st[2, g, s], nb - ring)
    return lo, nb


@njit_inline
def _push(buf, n, v):
    if n < buf.shape[0]:
        buf[n] = v
    return n + 1


@njit_inline
def _seen_step(v):
    """The step of a ``seen`` entry (``2 * step + own``)."""
    return v >> 1


@njit
def _prepare(X, P, R, A, FN, nf, geo, num_blocks, cell_st, slot_st, run_of, S):
    """The step's scratch rows ``X`` (module docstring of the wrapper); False on an index out of range."""
    G = geo.shape[0]
    for s in range(S):  # NOTE: row by row (every array here is [.., S]): contiguous reads and writes
        X[0, s], X[1, s], X[2, s] = -1, 0, 0
        X[3, s] = slot_st[0, s]
    for g in range(G):
        for s in range(S):
            X[4 + g, s] = num_blocks[g, s]
        for s in range(S):
            X[4 + G + g, s] = cell_st[2, g, s]
    for j in range(A.shape[1]):
        s = A[0, j]
        if not (0 <= s < S):
            return False
        X[2, s] = A[1, j]
    for j in range(FN.shape[1]):
        s = FN[0, j]
        if not (0 <= s < S):
            return False
        X[3, s] = 0 if j < nf else 1
        X[1, s] = 0 if j < nf else 1
        for g in range(G):
            X[4 + g, s] = 0
            if j >= nf:
                X[4 + G + g, s] = 0
    for i in range(P.shape[1]):
        s = P[0, i]
        if not (0 <= s < S):
            return False
        X[0, s] = i
    for r in range(R.shape[1]):
        g, s = R[0, r], R[1, r]
        if not (0 <= g < G and 0 <= s < S):
            return False
        run_of[g * S + s] = r
        X[4 + g, s] = R[3, r]
    return True


@njit
def _rings(X, P, R, geo, cp, cell_st, num_blocks, run_of, S, err):
    G = geo.shape[0]
    for r in range(R.shape[1]):
        g, s = R[0, r], R[1, r]
        if not (geo[g, SLID] and geo[g, RING] > 0):
            continue
        ring, a, keep = geo[g, RING], R[2, r], R[4, r]
        n0 = 0 if X[1, s] == 1 else num_blocks[g, s]
        true_old = max(X[4 + G + g, s], n0 - ring)
        if not (a == n0 and keep == a):
            X[4 + G + g, s] = true_old if (keep == a and a >= true_old) else keep
    for i in range(P.shape[1]):
        s = P[0, i]
        for g in range(G):
            if not (geo[g, SLID] and geo[g, RING] > 0):
                continue
            lo = _read_lo(g, i, P, geo, cp)
            if lo < X[4 + G + g, s]:
                nc = P[1, i] - P[2, i]
                err[0], err[1], err[2], err[3], err[4] = 2, s, g, lo, nc
                err[5] = max(nc - geo[g, WIN] + 1, 0, P[3, i])
                err[6], err[7] = X[4 + G + g, s], 1 if run_of[g * S + s] >= 0 else 0
                return False
    return True


@njit
def _no_jump(A, X, slot_st, err):
    for j in range(A.shape[1]):
        s, nc = A[0, j], A[1, j]
        if X[1, s] == 0 and nc > slot_st[1, s]:
            err[0], err[1], err[2], err[3], err[4] = 1, j, nc, s, slot_st[1, s]
            return False
    return True


@njit_inline
def _rec(fill, key):
    """The record of id key ``key`` in the open-addressing table ``fill`` (linear probing; inserted, empty,
    when absent). Header row ``cap``: records used, more than half used (the wrapper grows the table before
    the next step), full (then the spare row ``cap + 1`` is returned and the wrapper grows the table and
    checks the step again)."""
    cap = fill.shape[0] - 2
    h = ((key * HASH_MUL) >> 16) & (cap - 1)
    while fill[h, 6] >= 0:
        if fill[h, 6] == key:
            return h
        h = (h + 1) & (cap - 1)
    if fill[cap, 0] >= cap - 1:
        fill[cap, 2] = 1
        return cap + 1
    fill[cap, 0] += 1
    if 2 * fill[cap, 0] > cap:
        fill[cap, 1] = 1
    fill[h, 6] = key
    return h


@njit_inline
def _touch(key, d, log, n):
    """Log a touch of id key ``key`` by ``d`` (+1 or -1) as ``2 * key + (d > 0)`` (:func:`_to_records`)."""
    return _push(log, n, 2 * key + (1 if d > 0 else 0))


@njit
def _to_records(fill, log, n, signed):
    """Each of the first ``n`` keys of ``log`` replaced by its record (:func:`_rec`), in their order; ``signed``:
    :func:`_touch`'s keys, whose sign goes to ``fill[h, 5]``. One tight loop after the keys are gathered, so that
    the lookups' cache misses overlap (a pass that looks each key up where it finds it waits for every one)."""
    for j in range(min(n, log.shape[0])):
        v = log[j]
        if signed:
            h = _rec(fill, v >> 1)
            fill[h, 5] += 1 if v & 1 else -1
        else:
            h = _rec(fill, v)
        log[j] = h


@njit
def _filter(X, P, R, w_ids, FN, nf, mirror, geo, cp, cell_st, slot_st, num_blocks, fill, G, run_of, S, log):
    """``fill[key, 5]`` = the step's acquisitions - releases per key (the count filter); the records touched
    go to ``log`` (the pass zeroes them from there). Returns whether a batch row's window moved back below
    its floor (then every suspect is scanned), and the number of touches (when beyond ``log``, only the logged
    ones were counted, the verdict is void, and the wrapper grows ``log`` and runs the pass again)."""
    moved = False
    n = 0
    for r in range(R.shape[1]):
        g, s = R[0, r], R[1, r]
        lo = _bounds(g, s, X, P, geo, cp, cell_st)[0]
        for q in range(max(R[2, r], R[4, r], lo), R[3, r]):
            kid = w_ids[R[5, r] + q - R[2, r]]
            if kid >= geo[g, F]:
                n = _touch(kid * G + g, 1, log, n)
        lo0, nb0 = _committed(g, s, geo, cell_st, num_blocks, slot_st)
        if X[1, s] == 0:
            for q in range(max(lo0, R[2, r]), nb0):
                kid = np.int64(mirror[_cell(g, s, q, geo)])
                if kid >= geo[g, F]:
                    n = _touch(kid * G + g, -1, log, n)
    for j in range(nf):
        s = FN[0, j]
        for g in range(G):
            lo0, nb0 = _committed(g, s, geo, cell_st, num_blocks, slot_st)
            for q in range(lo0, nb0):
                kid = np.int64(mirror[_cell(g, s, q, geo)])
                if kid >= geo[g, F]:
                    n = _touch(kid * G + g, -1, log, n)
    for i in range(P.shape[1]):
        s = P[0, i]
        if X[1, s] == 1 or X[3, s] == 0:
            continue
        for g in range(G):
            if not geo[g, SLID]:
                continue
            lo0, nb0 = _committed(g, s, geo, cell_st, num_blocks, slot_st)
            rl = _read_lo(g, i, P, geo, cp)
            if rl < cell_st[0, g, s]:
                moved = True
            r = run_of[g * S + s]
            for q in range(lo0, min(rl, nb0, R[2, r] if r >= 0 else nb0)):
                kid = np.int64(mirror[_cell(g, s, q, geo)])
                if kid >= geo[g, F]:
                    n = _touch(kid * G + g, -1, log, n)
    _to_records(fill, log, n, True)
    return moved, n


@njit_inline
def _fill_rec(h, fill, F4, nF):
    """The last fill of record ``h``: this step's (``F4`` rows: record, slot, pos, step; ``nF`` of them so
    far) or the committed one; (slot, pos, step, from this step), slot -1 when none."""
    j = fill[h, 3] if nF > 0 else 0
    if j > 0:
        return F4[j - 1, 1], F4[j - 1, 2], F4[j - 1, 3], True
    return fill[h, 0], fill[h, 1], fill[h, 2], False


@njit_inline
def _add_fill(h, s, q, step, fill, F4, nF):
    if nF < F4.shape[0]:
        F4[nF, 0], F4[nF, 1], F4[nF, 2], F4[nF, 3] = h, s, q, step
        fill[h, 3] = nF + 1
    return nF + 1


@njit_inline
def _suspect(h, fill, moved):
    """Another row may hold record ``h``'s block after the step (beyond one holding: the row's own)."""
    return moved or fill[h, 4] + fill[h, 5] >= 2


@njit
def _acquisitions(X, P, R, w_ids, raw0, mirror, geo, cp, cell_st, slot_st, run_of, S, fill, moved, full,
                  F4, nF, step, seen_l, nS, err, out):
    """Fills (prevention) before hits (block position); returns (ok, nF, nS)."""
    G = geo.shape[0]
    for phase in range(2):
        for r in range(R.shape[1]):
            g, s, a = R[0, r], R[1, r], R[2, r]
            lo = _bounds(g, s, X, P, geo, cp, cell_st)[0]
            ws, we = _row_writes(g, s, X, P, geo, cp, slot_st)
            bs, f = geo[g, BS], geo[g, F]
            for q in range(max(a, R[4, r], lo), R[3, r]):
                kid = w_ids[R[5, r] + q - a]
                if kid < f:
                    continue
                fl = geo[g, CIRC] or (q + 1) * bs > ws
                raw = raw0[r] + (q - a) // f
                if phase == 0 and fl:
                    whole = geo[g, CIRC] or (q * bs >= ws and (q + 1) * bs <= we)
                    h = _rec(fill, kid * G + g)
                    if _suspect(h, fill, moved):
                        err[11] = 1  # NOTE: a write into a block someone else may hold: reads are checked in full
                        if _scan(g, kid, s, q, 0, whole, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st,
                                 run_of, S, out):
                            err[0], err[1], err[2], err[3], err[4] = 4, raw, kid // f, s, q // f
                            err[5], err[6], err[7], err[8] = g, out[0], out[1] // f, out[2]
                            return False, nF, nS
                        if full and _scan(g, kid, s, q, 1, whole, X, P, R, w_ids, mirror, geo, cp, cell_st,
                                          slot_st, run_of, S, out):
                            err[0], err[1], err[2], err[3], err[4] = 9, raw, kid // f, s, q // f
                            err[5], err[6] = g, out[1] // f
                            return False, nF, nS
                    nF = _add_fill(h, s, q, step, fill, F4, nF)
                    nS = _push_seen(seen_l, nS, _cell(g, s, q, geo), step, 1, g, s, q)
                elif phase == 1 and not fl:
                    h = _rec(fill, kid * G + g)
                    fs, fp, fst, now = _fill_rec(h, fill, F4, nF)
                    own = fs == s and now
                    if fs >= 0 and fp != q and not own:
                        err[0], err[1], err[2], err[3], err[4] = 8, raw, kid // f, s, q // f
                        err[5], err[6], err[7], err[8] = g, fp // f, fs, fst
                        return False, nF, nS
                    if full and geo[g, SLID] and _suspect(h, fill, moved) and \
                            _scan(g, kid, s, q, 2, False, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st,
                                  run_of, S, out):
                        err[0], err[1], err[2], err[3] = 10, kid // f, g, s
                        return False, nF, nS
                    if (fs < 0 and (fill[h, 4] >= 1 or fill[h, 5] >= 2)) or (own and fp != q):
                        err[11] = 1  # NOTE: a fill record made for a held block, or a cell that fails its own
                    if fs < 0:
                        nF = _add_fill(h, s, q, step, fill, F4, nF)
                        fst = step
                    nS = _push_seen(seen_l, nS, _cell(g, s, q, geo), fst, 0, g, s, q)
    return True, nF, nS


@njit
def _push_seen(seen_l, n, c, v, own, g, s, q):
    if n < seen_l.shape[0]:
        seen_l[n, 0], seen_l[n, 1], seen_l[n, 2] = c, v, own
        seen_l[n, 3], seen_l[n, 4], seen_l[n, 5] = g, s, q
    return n + 1


@njit
def _writes(X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S, fill, moved, seen,
            F4, nF, step, seen_l, nS, err, out, meta):
    """Old blocks a batch row writes: its own fill extended, or a write anew no other row certainly reads."""
    G = geo.shape[0]
    for i in range(P.shape[1]):
        s = P[0, i]
        if X[1, s] == 1:
            continue
        for g in range(G):
            if geo[g, CIRC]:
                continue
            ws, we = _ws(g, i, P, geo, cp)
            bs, f = geo[g, BS], geo[g, F]
            front = slot_st[1, s]
            mark = _owned(max(front, slot_st[2, s]) if geo[g, FULL] else front, g, geo, cp)
            if we <= ws:
                continue
            for q in range(ws // bs, -(-we // bs)):
                rewind = ws < min(we, mark) and q * bs < min(we, mark)
                last = q == cell_st[3, g, s] and cell_st[4, g, s] > meta[0] and err[11] == 0 and \
                    run_of[g * S + s] < 0  # NOTE: the block it filled last, no write into a shared block since
                if last and not rewind:
                    continue
                if q >= X[4 + g, s] or _acq_kind(g, s, q, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st,
                                                 run_of, S) != 0:
                    continue
                c = _cell(g, s, q, geo)
                kid = _id_after(g, s, q, X, R, w_ids, mirror, geo, run_of, S)
                if kid < f:
                    continue
                sc = seen[c]
                if not rewind and err[11] == 0 and sc & 1 and _seen_step(sc) > meta[0]:
                    continue  # NOTE: its own fill, which no write into a shared block can have changed since
                h = _rec(fill, kid * G + g)
                fs, fp, fst, now = _fill_rec(h, fill, F4, nF)
                if not rewind and fs == s and fp == q and fst == _seen_step(sc):
                    continue  # NOTE: its own fill (a rewind is a new fill either way: seen[c], a miss, not read)
                sus = _suspect(h, fill, moved)
                if sus or fill[h, 4] >= 2 or fill[h, 5] != 0:
                    err[11] = 1
                # NOTE: a rewrite of its own fill is a new fill even when nobody else holds the block now: a row
                # that took it as a hit and released it may read it again (a window moved back), and must see
                # that it changed (tests/state/test_owners_rule.py)
                if sus and _scan(g, kid, s, q, 0, False, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st,
                                 run_of, S, out):
                    err[1], err[2], err[3], err[4] = s, g, ws, kid // f
                    err[5], err[6], err[7] = q // f, out[0], out[1] // f
                    if rewind:
                        err[0], err[8], err[9] = 5, mark, P[1, i] - P[2, i]
                    else:
                        err[0] = 6
                    return False, nF, nS
                nF = _add_fill(h, s, q, step, fill, F4, nF)
                nS = _push_seen(seen_l, nS, c, step, 1, g, s, q)
    return True, nF, nS


@njit
def _moved_back(X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S, err, out):
    G = geo.shape[0]
    for i in range(P.shape[1]):
        s = P[0, i]
        if X[1, s] == 1:
            continue
        for g in range(G):
            if not geo[g, SLID]:
                continue
            f = geo[g, F]
            for q in range(_read_lo(g, i, P, geo, cp), min(cell_st[0, g, s], X[4 + g, s])):
                if _acq_kind(g, s, q, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S) != 0:
                    continue
                kid = _id_after(g, s, q, X, R, w_ids, mirror, geo, run_of, S)
                if kid < f:
                    continue
                if _scan(g, kid, s, q, 3, False, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S,
                         out):
                    err[0], err[1], err[2], err[3], err[4], err[5] = 3, s, g, q // f, out[0], kid // f
                    return False
    return True


@njit
def _reads(X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S, fill, seen, F4, nF, err, meta):
    """Detection: a sliding block a batch row reads below its write start holds the fill the row saw. A row
    verified in a step after which no write touched a block another row may still hold after that write's step
    (``meta[0]``: the last step with one; ``err[11]``: this step has one), whose window did not move below its
    floor, reads what it was verified to read: skipped (the same verdict). A write into a block whose every
    holder releases it in the same step (a scheduler handing on a draft band by the true acceptance, each step
    of ``benchmarks/flash_host.py``) is not such a write and keeps the skip: after it no row holds the block but
    its writer, so a row reads it again only through a new acquisition (checked as one) or a window moved below
    the floor it had when it released it (``back`` below, and the filter's ``moved``: checked in full). The
    same argument keeps :func:`_writes`' shortcuts of a row's own fill."""
    G = geo.shape[0]
    for i in range(P.shape[1]):
        s = P[0, i]
        if SKIP_VERIFIED and err[11] == 0 and X[1, s] == 0 and meta[0] < slot_st[3, s]:
            back = False
            for g in range(G):
                if geo[g, SLID] and _read_lo(g, i, P, geo, cp) < cell_st[0, g, s]:
                    back = True
            if not back:
                continue
        for g in range(G):
            if not geo[g, SLID]:
                continue
            ws = _ws(g, i, P, geo, cp)[0]
            bs, f = geo[g, BS], geo[g, F]
            for q in range(_read_lo(g, i, P, geo, cp), min(-(-ws // bs), X[4 + g, s])):
                if _acq_kind(g, s, q, X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S) != 0:
                    continue
                c = _cell(g, s, q, geo)
                kid = _id_after(g, s, q, X, R, w_ids, mirror, geo, run_of, S)
                if kid < f:
                    continue
                fs, fp, fst, now = _fill_rec(_rec(fill, kid * G + g), fill, F4, nF)
                if fs < 0:
                    continue
                ok = (fs == s and fp == q) if now else (fst == _seen_step(seen[c]) and fp == q)
                if not ok:
                    err[0], err[1], err[2], err[3], err[4] = 7, s, g, kid // f, q // f
                    err[5], err[6], err[7], err[8] = P[1, i] - P[2, i], fs, fp // f, fst
                    return False
    return True


@njit
def _held_nulls(X, P, R, w_ids, mirror, geo, cp, run_of, S, err):
    G = geo.shape[0]
    for i in range(P.shape[1]):
        s = P[0, i]
        for g in range(G):
            if not geo[g, SLID]:
                continue
            lo, f = _read_lo(g, i, P, geo, cp), geo[g, F]
            r = run_of[g * S + s]
            hi = X[4 + g, s] if r < 0 else min(X[4 + g, s], R[2, r])
            first, n = -1, 0
            for q in range(lo, hi):  # NOTE: below the row's run, if any: the ids are the mirror's (_id_after)
                if mirror[_cell(g, s, q, geo)] < f:
                    if first < 0:
                        first = q
                    n += 1
            if n:
                err[0], err[1], err[2], err[3], err[4], err[5] = 11, g, s, i, first, n - 1
                err[6] = max(P[1, i] - P[2, i] - geo[g, WIN] + 1, 0, P[3, i])
                err[7] = P[1, i] - 1
                return False
    return True


@njit
def _new_range(g, s, X, P, geo, cp, cell_st):
    """The committed held range ``(lo, nb)`` of slot ``s`` in group ``g`` after the step."""
    if X[3, s] == 0:
        return 0, 0
    nb, ring = X[4 + g, s], geo[g, RING]
    G = geo.shape[0]
    lo = 0
    if geo[g, SLID]:
        i = X[0, s]
        if i >= 0:
            lo = _lo_block(g, P[1, i] - P[5, i], P[3, i], geo, cp)
        elif X[1, s] == 1:
            lo = _lo_block(g, X[2, s], 0, geo, cp)
        else:
            lo = cell_st[0, g, s]
    if ring > 0:
        lo = max(lo, X[4 + G + g, s] if geo[g, SLID] else 0, nb - ring)
    return lo, nb


@njit
def _dec(dec, nd, g, s, q, mirror, geo, G):
    kid = np.int64(mirror[_cell(g, s, q, geo)])
    return _push(dec, nd, kid * G + g) if kid >= geo[g, F] else nd


@njit
def _inc(inc, ni, g, s, q, X, R, w_ids, mirror, geo, run_of, S, G):
    kid = _id_after(g, s, q, X, R, w_ids, mirror, geo, run_of, S)
    return _push(inc, ni, kid * G + g) if kid >= geo[g, F] else ni


@njit
def _cells_moved(X, P, R, FN, geo, cell_st, slot_st, num_blocks, run_of, S):
    """The (group, slot) cells whose committed held range the step may change, in :func:`_deltas`' order (slots
    as the step names them, groups in order): rows ``(g * S + s, known, lo0, nb0, lo1, nb1)``. Every cell of a
    freed, new or run slot (``known`` 0: the ranges are :func:`_committed` and :func:`_new_range`'s), and a batch
    row's cells whose range moves (``known`` 1: those ranges, spelled out for a batch row live before and after,
    not new, no run in ``g``, unsharded: no helper call here); most cells of a decode step keep their range."""
    G = geo.shape[0]
    nP, nFN = P.shape[1], FN.shape[1]
    out = np.empty(((nP + nFN + R.shape[1]) * G, 6), dtype=np.int64)
    done = np.zeros(S, dtype=np.int8)
    n = 0
    for j in range(nP + nFN + R.shape[1]):  # NOTE: the slots a step can touch: batch rows, freed / new, runs
        s = P[0, j] if j < nP else (FN[0, j - nP] if j < nP + nFN else R[1, j - nP - nFN])
        if done[s]:
            continue
        done[s] = 1
        i = X[0, s]
        touched = i >= 0 or X[1, s] == 1 or (slot_st[0, s] == 1 and X[3, s] == 0)
        kept = i >= 0 and X[1, s] == 0 and X[3, s] == 1 and slot_st[0, s] == 1
        for g in range(G):
            r = run_of[g * S + s]
            if not (touched or r >= 0):
                continue
            out[n, 0], out[n, 1] = g * S + s, 0
            if kept and r < 0 and geo[g, SHARD] == 0:
                nb0, nb1, ring = num_blocks[g, s], X[4 + g, s], geo[g, RING]
                lo0 = lo1 = 0
                if geo[g, SLID]:
                    lo0 = cell_st[0, g, s]
                    lo1 = max(P[1, i] - P[5, i] - geo[g, WIN] + 1, 0, P[3, i]) // geo[g, BS]
                if ring > 0:
                    lo0 = max(lo0, cell_st[2, g, s], nb0 - ring)
                    lo1 = max(lo1, X[4 + G + g, s] if geo[g, SLID] else 0, nb1 - ring)
                if (lo0 == lo1 and nb0 == nb1) or (lo0 >= nb0 and lo1 >= nb1):
                    continue  # NOTE: no block enters or leaves: the loops of _deltas would run empty
                out[n, 1], out[n, 2], out[n, 3], out[n, 4], out[n, 5] = 1, lo0, nb0, lo1, nb1
            n += 1
    return out[:n]


@njit
def _deltas(X, P, R, FN, w_ids, mirror, geo, cp, cell_st, slot_st, num_blocks, run_of, S, dec, inc, fill):
    """The id keys leaving (``dec``) and entering (``inc``) the committed held ranges of every affected
    (group, slot) (:func:`_cells_moved`); returns their numbers (only counted when the buffers are too small)."""
    G = geo.shape[0]
    nd = ni = 0
    todo = _cells_moved(X, P, R, FN, geo, cell_st, slot_st, num_blocks, run_of, S)
    for k in range(todo.shape[0]):
        g, s = todo[k, 0] // S, todo[k, 0] % S
        r = run_of[g * S + s]
        if todo[k, 1]:
            lo0, nb0, lo1, nb1 = todo[k, 2], todo[k, 3], todo[k, 4], todo[k, 5]
        else:
            lo0, nb0 = _committed(g, s, geo, cell_st, num_blocks, slot_st)
            lo1, nb1 = _new_range(g, s, X, P, geo, cp, cell_st)
        u0, u1 = max(lo0, lo1), min(nb0, nb1, R[2, r] if r >= 0 else nb0)
        if X[1, s] == 1:
            u0, u1 = 0, 0
        for q in range(lo0, min(nb0, max(u0, lo0))):
            nd = _dec(dec, nd, g, s, q, mirror, geo, G)
        for q in range(max(lo0, u1, min(nb0, max(u0, lo0))), nb0):
            nd = _dec(dec, nd, g, s, q, mirror, geo, G)
        for q in range(lo1, min(nb1, max(u0, lo1))):
            ni = _inc(inc, ni, g, s, q, X, R, w_ids, mirror, geo, run_of, S, G)
        for q in range(max(lo1, u1, min(nb1, max(u0, lo1))), nb1):
            ni = _inc(inc, ni, g, s, q, X, R, w_ids, mirror, geo, run_of, S, G)
    _to_records(fill, dec, nd, False)
    _to_records(fill, inc, ni, False)
    return nd, ni


@njit
def _unrun(R, run_of, G, S):
    for r in range(R.shape[1]):
        g, s = R[0, r], R[1, r]
        if 0 <= g < G and 0 <= s < S:
            run_of[g * S + s] = -1


def check_pass(geo, cp, P, R, w_ids, raw0, A, FN, nf, full, step, mirror, num_blocks, slot_st, cell_st, fill,
               seen, meta, X, run_of, F4, seen_l, L, E):
    """The rule on one step, into the preallocated scratch ``X``, ``F4`` (fills), ``seen_l`` (cells seen),
    ``L`` (rows: released records, acquired records, records the count filter touched) and ``E`` (0-11: the
    error, 12-14: a holder found); ``run_of`` is all -1 before and after. Returns ``(nF, nS, nd, ni, nt)``:
    the lengths of the lists (a length beyond its buffer: the wrapper grows it and checks again)."""
    G, S = geo.shape[0], slot_st.shape[1]
    err, out = E[:12], E[12:15]
    E[:] = 0
    nF = nS = nd = ni = 0
    if not _prepare(X, P, R, A, FN, nf, geo, num_blocks, cell_st, slot_st, run_of, S):
        err[0] = -1
        _unrun(R, run_of, G, S)
        return nF, nS, nd, ni, 0
    moved, nt = _filter(X, P, R, w_ids, FN, nf, mirror, geo, cp, cell_st, slot_st, num_blocks, fill, G, run_of,
                        S, L[2])
    if fill[fill.shape[0] - 2, 2]:  # NOTE: the table is full: the wrapper rebuilds it and runs the pass again
        _unrun(R, run_of, G, S)
        return nF, nS, nd, ni, nt
    ok = _no_jump(A, X, slot_st, err) and _rings(X, P, R, geo, cp, cell_st, num_blocks, run_of, S, err)
    if ok:
        ok, nF, nS = _acquisitions(X, P, R, w_ids, raw0, mirror, geo, cp, cell_st, slot_st, run_of, S, fill,
                                   moved, full, F4, nF, step, seen_l, nS, err, out)
    if ok:
        ok, nF, nS = _writes(X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S, fill, moved,
                             seen, F4, nF, step, seen_l, nS, err, out, meta)
    ok = ok and _moved_back(X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S, err, out)
    ok = ok and _reads(X, P, R, w_ids, mirror, geo, cp, cell_st, slot_st, run_of, S, fill, seen, F4, nF,
                       err, meta)
    if ok and full:
        ok = _held_nulls(X, P, R, w_ids, mirror, geo, cp, run_of, S, err)
    for j in range(min(nt, L.shape[1])):
        fill[L[2, j], 5] = 0
    for j in range(min(nF, F4.shape[0])):
        fill[F4[j, 0], 3] = 0
    if ok:
        nd, ni = _deltas(X, P, R, FN, w_ids, mirror, geo, cp, cell_st, slot_st, num_blocks, run_of, S, L[0], L[1],
                         fill)
    _unrun(R, run_of, G, S)
    if nF > F4.shape[0] or nS > seen_l.shape[0]:
        err[0] = -2
    return nF, nS, nd, ni, nt


def commit_pass(geo, cp, P, R, A, FN, nf, slot_st, cell_st, fill, seen, X, F4, nF, seen_l, nS, L, nd, ni,
                meta, step, handover):
    """Apply a checked step (the lists of :func:`check_pass`)."""
    G = geo.shape[0]
    if handover:
        meta[0] = step
    for j in range(nd):
        fill[L[0, j], 4] -= 1
    for j in range(ni):
        fill[L[1, j], 4] += 1
    for j in range(nF):
        k = F4[j, 0]
        fill[k, 0], fill[k, 1], fill[k, 2] = F4[j, 1], F4[j, 2], F4[j, 3]
    for j in range(FN.shape[1]):
        s = FN[0, j]
        for g in range(G):
            cell_st[3, g, s], cell_st[4, g, s] = -1, 0
    for j in range(nS):
        seen[seen_l[j, 0]] = 2 * seen_l[j, 1] + seen_l[j, 2]
        g, s, q = seen_l[j, 3], seen_l[j, 4], seen_l[j, 5]
        if seen_l[j, 2]:
            cell_st[3, g, s], cell_st[4, g, s] = q, seen_l[j, 1]
        elif cell_st[3, g, s] == q:
            cell_st[3, g, s] = -1
    for j in range(FN.shape[1]):
        s = FN[0, j]
        slot_st[1, s] = slot_st[2, s] = slot_st[3, s] = 0
        for g in range(G):
            cell_st[0, g, s] = cell_st[1, g, s] = 0
    nFN = FN.shape[1]
    for j in range(nFN + R.shape[1]):  # NOTE: liveness and ring marks change only in freed, new and run slots
        s = FN[0, j] if j < nFN else R[1, j - nFN]
        slot_st[0, s] = X[3, s]
        for g in range(G):
            cell_st[2, g, s] = X[4 + G + g, s] if X[3, s] else 0
    for i in range(P.shape[1]):
        s, seq = P[0, i], P[1, i]
        slot_st[1, s] = max(slot_st[1, s], seq)
        slot_st[3, s] = step
        if P[6, i]:
            slot_st[2, s] = max(slot_st[2, s], P[4, i])
        for g in range(G):
            if geo[g, SLID]:
                cell_st[0, g, s] = _lo_block(g, seq - P[5, i], P[3, i], geo, cp)
                cell_st[1, g, s] = _lo_block(g, seq, P[3, i], geo, cp)
    for j in range(A.shape[1]):
        s, nc = A[0, j], A[1, j]
        if X[0, s] < 0:
            slot_st[1, s] = max(slot_st[1, s], nc)
            if X[1, s] == 1:
                for g in range(G):
                    if geo[g, SLID]:
                        cell_st[0, g, s] = cell_st[1, g, s] = _lo_block(g, nc, 0, geo, cp)
    return True


def rehash(old, new):
    """Move every record of ``old`` that holds something (a fill or a holder) into the empty table ``new``."""
    n = 0
    for h in range(old.shape[0] - 2):
        if old[h, 6] >= 0 and (old[h, 0] >= 0 or old[h, 4] != 0):
            j = _rec(new, old[h, 6])
            new[j, 0], new[j, 1], new[j, 2], new[j, 4] = old[h, 0], old[h, 1], old[h, 2], old[h, 4]
            n += 1
    return n


_I2, _I1, _N = ro("int64", 2), ro("int64"), numba.types.int64
check_pass = pin(check_pass, (_I2, _I1, _I2, _I2, _I1, _I1, _I2, _I2, _N, numba.types.boolean, _N, ro("int32"), _I2,
                              ro("int64", 2), ro("int64", 3), rw("int64", 2), ro("int64"), ro("int64"), rw("int64", 2),
                              rw("int64"), rw("int64", 2), rw("int64", 2), rw("int64", 2), rw("int64")))
commit_pass = pin(commit_pass, (_I2, _I1, _I2, _I2, _I2, _I2, _N, rw("int64", 2), rw("int64", 3), rw("int64", 2),
                                rw("int64"), _I2, _I2, _N, _I2, _N, _I2, _N, _N, rw("int64"), _N, numba.types.boolean))
rehash = pin(rehash, (ro("int64", 2), rw("int64", 2)))
