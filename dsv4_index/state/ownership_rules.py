"""The planning half of :mod:`.owners` on one step: what the step releases and acquires, floors and write
starts (:mod:`.ownership_checks` judges them). Nothing here changes :class:`~.owners.BlockOwners` state except its
scratch buffers; :meth:`BlockOwners.commit` applies the returned :class:`Step`.

Arrays: ``N`` write runs (``plan.w_*``, kernel blocks), ``B`` batch rows, ``Gs`` sliding groups; pair key
``gid * num_slots + slot`` (``num_slots`` slots), id key ``kernel_id * G + gid``.
"""

from __future__ import annotations

from typing import Any, Collection, List, Optional, Tuple, Union

import numpy as np

__all__ = ["Step", "begin", "plan_general", "old_keys", "count_in", "bump", "release"]

_EMPTY = np.zeros(0, dtype=np.int64)


class Step:
    """One checked step's ownership changes (``rel`` / ``acq``: id keys released / acquired, with
    repetition) and the values the commit stores. Every path sets the fields it uses (int64 arrays
    unless said): the general path (:func:`begin`, :func:`plan_general`), the batch path
    (:mod:`.ownership_batch`) and the one-append path (:mod:`.ownership_fast`)."""

    F0b: np.ndarray
    F0r: np.ndarray
    F1b: np.ndarray
    F1r: np.ndarray
    F1r_s: np.ndarray
    La: np.ndarray
    Lr_s: np.ndarray
    N0b: np.ndarray
    N0r: np.ndarray
    acq_fill: np.ndarray
    acq_fresh: np.ndarray
    acq_pos: np.ndarray
    acq_run: np.ndarray
    acq_slot: np.ndarray
    all_nc: np.ndarray
    all_slots: np.ndarray
    b: np.ndarray
    back: List[Tuple[np.ndarray, ...]]  # (gid, slot, lo, hi) of the old positions a row holds again
    cells: np.ndarray
    e: np.ndarray
    e_s: np.ndarray
    free: np.ndarray
    gid: np.ndarray
    inb_s: np.ndarray
    khi: np.ndarray
    klo: np.ndarray
    kr: np.ndarray
    kr_s: np.ndarray
    lo: np.ndarray
    lo2: np.ndarray
    lo_pos: np.ndarray
    nc_b: np.ndarray
    new: np.ndarray
    reacq: np.ndarray
    rel_sorted: np.ndarray
    s: np.ndarray
    seq: np.ndarray
    sl: np.ndarray
    slot: np.ndarray
    view_nc: np.ndarray
    ws_full: np.ndarray
    acq: np.ndarray
    rel: np.ndarray
    acq_sorted: Optional[np.ndarray]
    fresh: Optional[np.ndarray]
    fresh_b: Optional[np.ndarray]
    kb: Optional[np.ndarray]
    re: Optional[np.ndarray]
    fast: Union[bool, str]        # False (general), True (one-append path) or "batch"
    churn: bool                   # batch path: a slot freed or new
    shared_hit: bool              # batch path: a new row takes a held id as a prefix hit
    N: int                        # write runs
    num_slots: int
    gone_set: Collection[int]     # slots whose old rows this step releases
    fr_runs: Optional[Tuple[np.ndarray, np.ndarray]]  # new rows' ring low-water marks: (pair keys, marks)
    plan: Any                     # the StepPlan being checked (state/plan.py; not imported: a cycle)
    view_plan: Any
    view: Any                     # batch path: the BatchView (state/ownership_batch.py imports this module)

    def gone(self, slot: int) -> bool:
        """The slot's old rows are released in this step (freed, or taken by a new request)."""
        return bool(slot in self.gone_set)

    def kept(self, g: int, slot: int, lo: int, hi: int) -> Tuple[int, int]:
        """Old block positions ``[lo, hi)`` of ``(g, slot)`` still held after the step."""
        key = g * self.num_slots + slot
        hit = np.flatnonzero(self.kr == key)
        if hit.size:
            i = int(hit[0])
            return int(self.klo[i]), int(self.khi[i])
        if self.kb is not None:
            where = np.argwhere(self.kb == key)
            if where.size:
                j, b = (int(x) for x in where[0])
                return int(self.F1b[j, b]), hi
        return lo, hi

    def acquirers(self, key: int) -> List[Tuple[int, int, str]]:
        """``(slot, block position, "fill" | "hit")`` of this step's acquisitions of id key ``key``."""
        m = np.flatnonzero(self.acq == key)
        return [(int(self.acq_slot[i]), int(self.acq_pos[i]), "fill" if self.acq_fill[i] else "hit")
                for i in m.tolist()]


def begin(o, plan) -> Step:
    """What every path needs of ``plan`` (slots, this step's ``nc`` by slot, write starts); raises on a jump."""
    st, num_slots = Step(), o.num_slots
    st.num_slots, st.plan = num_slots, plan
    st.free, st.new = plan.free_slots, plan.new_slots
    st.fresh = None
    if st.new.size:
        st.fresh = np.zeros(num_slots, dtype=bool)
        st.fresh[st.new] = True
    st.gone_set = set(st.free.tolist()) | set(st.new.tolist()) if (st.free.size or st.new.size) else ()
    st.all_slots, st.all_nc = plan.all_slots, plan.all_computed
    if st.all_slots.size:
        o.nc[st.all_slots] = st.all_nc
        _no_jump(o, st)
    st.b, st.seq = plan.slots, plan.seq_lens
    st.nc_b = o.nc.take(st.b) if st.b.size else _EMPTY
    st.re = re = plan.replay_end if st.b.size else None
    st.ws_full = st.nc_b if re is None else np.maximum(st.nc_b, re)
    st.fast = False
    return st


def plan_general(o, plan, st: Step) -> Step:
    """Releases, acquisitions and floors of any step (after :func:`begin`); raises on a stale read."""
    st.fast = False
    _runs(o, st, plan)
    _batch_floors(o, st, plan)
    _releases(o, st)
    _acquisitions(o, st, plan)
    return st


def _no_jump(o, st: Step) -> None:
    lim = o.frontier.take(st.all_slots)
    if st.fresh is not None:
        lim = np.where(st.fresh.take(st.all_slots), np.iinfo(np.int64).max, lim)
    bad = st.all_nc > lim
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        nc, f = int(st.all_nc[i]), int(lim[i])
        raise ValueError(f"num_computed_tokens[{i}] = {nc} of slot {int(st.all_slots[i])} jumps past what its "
                         f"steps wrote: positions {f}..{nc - 1} were never written (a running request may "
                         f"rewind, never skip ahead)")


def _runs(o, st: Step, plan) -> None:
    t, num_slots = o.tables, o.num_slots
    gid = plan.w_gid
    st.N = N = gid.shape[0]
    if not N:
        st.kr = st.kr_s = st.F1r_s = st.Lr_s = _EMPTY
        st.inb_s = np.zeros(0, dtype=bool)
        st.e_s = _EMPTY
        return
    slot, s, e, keep = plan.w_slot, plan.w_start, plan.w_end, plan.w_keep
    st.gid, st.slot, st.s, st.e = gid, slot, s, e
    st.kr = kr = gid * num_slots + slot
    F0r, N0r = o.floor.reshape(-1).take(kr), t.num_blocks.reshape(-1).take(kr)
    L0r = o.ring_lo.reshape(-1).take(kr)
    if st.fresh is not None:
        f = st.fresh.take(slot)
        if f.any():
            F0r, N0r, L0r = np.where(f, 0, F0r), np.where(f, 0, N0r), np.where(f, 0, L0r)
    st.F0r, st.N0r = F0r, N0r
    st.sl = sl = o.sliding.take(gid)
    ring = t.ring.take(gid)
    rr = sl & (ring > 0)
    Lr = L0r
    if rr.any():
        # NOTE: stored: the cut floor; the columns hold [max(ring_lo, blocks - ring), blocks) (the plan's ring
        # check bounds the second term). An append keeps it; a cut back to s keeps the old valid blocks below s
        # when it stores from s and s is not below them, else the ring holds [max(keep, e - ring), e) only
        true_old = np.maximum(L0r, N0r - ring)
        kept_old = (keep == s) & (s >= true_old)
        append = (s == N0r) & (keep == s)
        Lr = np.where(rr & ~append, np.where(kept_old, true_old, keep), L0r)
    st.kr_s, st.Lr_s = kr[sl], Lr[sl]
    st.F1r_s = np.maximum(F0r[sl], st.Lr_s)  # NOTE: rows outside the batch: what the columns still hold
    st.inb_s, st.e_s = plan.w_row[sl] >= 0, e[sl]


def _batch_floors(o, st: Step, plan) -> None:
    t, S, b = o.tables, o.S, st.b
    st.kb = None
    if not (b.size and S.size):
        return
    kb = o.S_key + b[None, :]
    F0b, N0b = o.floor.reshape(-1).take(kb), t.num_blocks.reshape(-1).take(kb)
    L0b = o.ring_lo.reshape(-1).take(kb)
    if st.fresh is not None:
        fb = st.fresh.take(b)
        if fb.any():
            F0b[:, fb] = 0
            N0b[:, fb] = 0
            L0b[:, fb] = 0
    la = o.fa
    la[kb] = L0b
    if st.kr_s.size:
        la[st.kr_s] = st.Lr_s
    La = la.take(kb)
    lo_pos = np.maximum(st.nc_b[None, :] - t.window[S, None] + 1, 0)
    if plan.replay_start is not None:
        lo_pos = np.maximum(lo_pos, plan.replay_start[None, :])
    lo = o.owned(lo_pos, S[:, None]) // t.bs[S, None]
    bad = lo < La
    if bad.any():
        j, i = (int(x) for x in np.argwhere(bad)[0])
        g = int(S[j])
        run = st.kr_s.size and (st.kr_s == kb[j, i]).any()
        why = "a write run of this step rewrote them" if run else "earlier write runs rewrote them"
        raise ValueError(f"slot {int(b[i])} reads gid {g} ({t.groups[g].name}) from block {int(lo[j, i])} "
                         f"(position {int(lo_pos[j, i])}, num_computed_tokens {int(st.nc_b[i])}), but its ring "
                         f"columns hold blocks {int(La[j, i])} and up only ({why}; write_starts): the window "
                         f"lists would read columns that now hold later blocks")
    if st.kr_s.size:
        fa = o.fa
        fa[kb] = lo
        st.F1r_s = np.where(st.inb_s, fa.take(st.kr_s), st.F1r_s)
    st.kb, st.F0b, st.N0b, st.F1b, st.La, st.lo, st.lo_pos = kb, F0b, N0b, lo, La, lo, lo_pos


def _releases(o, st: Step) -> None:
    """Old ids no longer held (cut back, behind the window, freed slots), and old ids held again (a
    row whose window moved back: ``reacq``)."""
    t, num_slots = o.tables, o.num_slots
    # (gid, slot, lo, hi) int64 arrays of old block positions released / held again
    parts: List[Tuple[np.ndarray, ...]] = []
    back: List[Tuple[np.ndarray, ...]] = []
    if st.N:
        F1r = np.zeros(st.N, dtype=np.int64)
        F1r[st.sl] = st.F1r_s
        st.F1r = F1r
        st.klo = klo = np.maximum(st.F0r, F1r)
        st.khi = khi = np.maximum(np.minimum(st.s, st.N0r), klo)
        parts += [(st.gid, st.slot, st.F0r, np.minimum(klo, st.N0r)), (st.gid, st.slot, khi, st.N0r)]
        if (F1r < st.F0r).any():
            st.klo = np.minimum(klo, np.maximum(F1r, 0))
            back.append((st.gid, st.slot, F1r, np.minimum(np.minimum(st.F0r, st.s), st.N0r)))
    if st.kb is not None:
        moved = st.F1b != st.F0b
        if moved.any() and st.kr_s.size:
            hasrun = np.zeros(o.G * num_slots, dtype=bool)
            hasrun[st.kr_s] = True
            moved &= ~hasrun.take(st.kb)
        if moved.any():
            j, i = np.nonzero(moved)
            g, slot, f0, f1, n0 = o.S[j], st.b[i], st.F0b[j, i], st.F1b[j, i], st.N0b[j, i]
            parts.append((g, slot, f0, np.minimum(f1, n0)))
            back.append((g, slot, f1, np.minimum(f0, n0)))
    if st.free.size:
        G, k = o.G, st.free.shape[0]
        g = np.repeat(np.arange(G), k)
        f = np.tile(st.free, G)
        parts.append((g, f, o.floor[g, f], t.num_blocks[g, f]))
    st.rel = _keys_of(o, parts)
    st.rel_sorted = np.sort(st.rel) if st.rel.size > 1 else st.rel
    st.reacq, st.back = _keys_of(o, back), back


def _keys_of(o, parts) -> np.ndarray:
    """:func:`old_keys` of several ``(gid, slot, lo, hi)`` interval lists at once."""
    if not parts:
        return _EMPTY
    if len(parts) == 1:
        return old_keys(o, *parts[0])
    return old_keys(o, *(np.concatenate(x) for x in zip(*parts)))


def _ragged(n: np.ndarray):
    """(owner, offset) of every entry of ragged lengths ``n >= 0``."""
    rep = np.repeat(np.arange(n.shape[0]), n)
    start = np.cumsum(n) - n
    return rep, np.arange(rep.shape[0], dtype=np.int64) - start[rep]


def old_keys(o, g, slot, lo, hi, detail: bool = False):
    """Id keys of the non-null ids at block positions ``[lo, hi)`` of each ``(g, slot)``, from the mirror
    (``detail``: also their slots and block positions)."""
    n = np.maximum(hi - lo, 0)
    if not n.any():
        return (_EMPTY, _EMPTY, _EMPTY) if detail else _EMPTY
    t = o.tables
    rep, k = _ragged(n)
    gg = g[rep]
    pos = lo[rep] + k
    ring = t.ring.take(gg)
    col = np.where(ring > 0, pos % np.maximum(ring, 1), pos)
    ids = t.mirror.take(t.base.take(gg) + slot[rep] * t.cols.take(gg) + col).astype(np.int64)
    live = ids >= t.f.take(gg)
    if detail:
        return ids[live] * o.G + gg[live], slot[rep][live], pos[live]
    return ids[live] * o.G + gg[live]


def _acquisitions(o, st: Step, plan) -> None:
    """Ids the runs put at held positions, and whether each is a fill (the row writes there)."""
    t = o.tables
    if not st.N:
        st.acq = st.acq_slot = st.acq_pos = st.acq_run = _EMPTY
        st.acq_fill = st.acq_fresh = np.zeros(0, dtype=bool)
        return
    gid, slot, s, cu = st.gid, st.slot, st.s, plan.w_cu
    n = cu[1:] - cu[:-1]
    off = np.maximum(st.F1r - s, 0)
    rep, k = _ragged(np.maximum(n - off, 0))
    if off.any():
        k = k + off[rep]
    ids = plan.w_ids.take(cu[:-1].take(rep) + k)
    gg = gid.take(rep)
    live = ids >= t.f.take(gg)
    if not live.all():
        rep, k, ids, gg = rep[live], k[live], ids[live], gg[live]
    pos = s.take(rep) + k
    key = ids * o.G + gg
    if key.size:
        o.grow(int(key.max()))
    # write start of each run's row in its group: this step's (batch rows, new rows) or the committed floor
    full = t.full.take(gid)
    front = o.frontier.take(slot)
    ws = np.where(t.full.take(gid), np.maximum(front, o.replay_mark.take(slot)), front)
    if st.fresh is not None:
        ws = np.where(st.fresh.take(slot), o.nc.take(slot), ws)
    row = plan.w_row
    inb = row >= 0
    if inb.any():
        r = row[inb]
        ws[inb] = np.where(full[inb], st.ws_full.take(r), st.nc_b.take(r))
    we = np.zeros(row.shape[0], dtype=np.int64)  # NOTE: the write end; a row outside the batch writes nothing
    if inb.any():
        we[inb] = st.seq.take(row[inb])
    ws, we = o.owned(ws, gid).take(rep), o.owned(we, gid).take(rep)
    circ, bs = t.circular.take(gg), t.bs.take(gg)
    fill = circ | ((pos + 1) * bs > ws)
    st.acq, st.acq_slot, st.acq_pos, st.acq_run, st.acq_fill = key, slot.take(rep), pos, rep, fill
    # NOTE: the row writes the whole block in this step (a fresh allocation, filled now: vLLM registers a block
    # for prefix hits once the step's tokens cover it)
    st.acq_fresh = circ | ((pos * bs >= ws) & ((pos + 1) * bs <= we))


def count_in(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    return np.searchsorted(sorted_keys, keys, side="right") - np.searchsorted(sorted_keys, keys, side="left")


def release(count: np.ndarray, keys: np.ndarray) -> None:
    """``bump(count, keys, -1)`` for held keys. A key's count is its number of holdings and a release
    gives up one holding, so a key listed ``m`` times has count ``>= m``: when every key has count 1
    they are distinct, and one gather and one fancy write do it (no sort)."""
    if keys.shape[0] > 1:
        c = count.take(keys)
        if c.item(c.argmax()) <= 1:
            c -= 1
            count[keys] = c
            return
    bump(count, keys, -1)


def bump(count: np.ndarray, keys: np.ndarray, d: int) -> None:
    """``np.add.at(count, keys, d)`` without its cost: distinct keys in one fancy update, repeated ones
    through their multiplicities (one sort)."""
    n = keys.shape[0]
    if n < 2:
        if n:
            count[keys] += d
        return
    srt = np.sort(keys)
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(srt[1:], srt[:-1], out=first[1:])
    if np.count_nonzero(first) == n:
        count[srt] += d
        return
    at = np.flatnonzero(first)
    mult = np.diff(np.append(at, n))
    count[srt.take(at)] += mult * d
