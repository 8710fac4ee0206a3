"""The serving step through :mod:`.owners`' rules against batch-ordered state: the rows of the last
accepted batch again (steady decode, MTP with rejected drafts), kept in a :class:`BatchView` so a step
costs a few whole-batch compares plus work on what changed (rows that rewound, windows that crossed a
block). Anything else, or any doubt, returns None and the other paths decide (and name the culprit).

Which steps: an incremental plan (:mod:`.steady`, ``plan.steady``: every run's slot is a batch row, its
group non-circular) with no slot freed or new, no replay, only one-id appends (``w_other is None``: each
run puts one id at the row's end, ``start == blocks held``), replicated groups and plain blocks, and the
batch's slots those of the view (else the view is rebuilt from the slot-keyed state).

Why it is the same answer as :mod:`.ownership_fast` and the general rules, per rule of :mod:`.owners`:

* no jump: ``nc <= frontier`` (one compare with ``mark = max(frontier, replay_mark) >= frontier`` first:
  ``nc == mark`` everywhere proves both no jump and no rewound row);
* rule 4 (rows writing below their frontier / mark): only rows with ``nc < mark`` (``low``); their
  rewritten old blocks are gathered and must have holder count 1 and not be acquired in this step;
* sliding windows: the window block ``lo = max(nc - W + 1, 0) // bs`` passes the floor exactly when
  ``nc >= nxt = (floor + 1) * bs + W - 1``; it falls below it exactly when ``floor > 0`` and
  ``nc < prv = floor * bs + W - 1`` (declined: blocks held again). A row with ``nc >= frontier`` never
  falls back (``prv <= frontier``: checked when the view is built, kept since ``lo * bs + W - 1 <= nc``),
  so ``prv`` is compared only when a row rewound. A crossing by one block releases the floor block
  (its mirror index ``fidx`` kept per cell; the row holds it: ``blocks * bs >= frontier``, checked at
  build, kept by coverage); a crossing by more is declined;
* rule 3 (fills): every appended id lands where the row writes, so it must have no holder after the
  releases and be appended once (a sort);
* rule 1 (ring low-water): ``ring_lo <= floor <= lo`` (a commit stores ``floor >= ring_lo``; appends keep
  ``ring_lo``);
* ``"full"``: the held-null scan has nothing below the checked marks (``min(blocks, checked) <= floor``
  at build; the first commit stores ``checked = floor`` on every batch cell, later ones on moved cells).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .ownership_rules import Step, bump, count_in, old_keys

__all__ = ["BatchView", "plan_batch", "commit_batch"]

_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)
_BIG = 1 << 62
_count = np.count_nonzero
_RETRY = 8  # NOTE: a batch whose view could not be built is retried after this many steps


class BatchView:
    """Batch-ordered copies of :class:`~.owners.BlockOwners` state for the rows of the last accepted batch.

    Attributes (``B`` rows, ``Gs`` sliding groups, cells ``j * B + row``)
    ----------
    key : bytes of the batch's slots; b : int64 ``[B]`` slots.
    front, mark : int64 ``[B]`` frontier and ``max(frontier, replay_mark)`` (``mark is front`` when equal).
    kb, floor, nxt, prv, fidx, bs, g, row, pb, rmod : int64 ``[Gs * B]`` per cell: pair key, floor, the
    ``nc`` thresholds of the module docstring, mirror index of the floor block, block size, gid, batch
    row, mirror index of column 0, ring modulus.
    """

    def __init__(self, o, b: np.ndarray):
        t, Gs, B = o.tables, o.S.size, b.shape[0]
        self.key, self.b, self.B = b.tobytes(), b.copy(), B
        self.front = o.frontier.take(b)
        self.rmark = o.replay_mark.take(b)
        self.has_mark = bool(_count(self.rmark > self.front))
        self.mark = np.maximum(self.front, self.rmark) if self.has_mark else self.front
        self.kb = (o.S_key + b[None, :]).reshape(-1)
        self.floor = o.floor.reshape(-1).take(self.kb)
        self.bs, self.g = np.repeat(o.bs_S.reshape(-1), B), np.repeat(o.S, B)
        wm1 = np.repeat(o.wm1_S.reshape(-1), B)
        self.nxt = (self.floor + 1) * self.bs + wm1
        self.prv = np.where(self.floor > 0, self.floor * self.bs + wm1, -_BIG)
        self.row = np.tile(np.arange(B, dtype=np.int64), Gs)
        self.pb = o.pair_base.take(self.kb)
        self.rmod = np.repeat(o.ring_mod_S, B)
        self.fidx = self.pb + self.floor % self.rmod
        self.nxt2, self.prv2 = self.nxt.reshape(Gs, B), self.prv.reshape(Gs, B)
        self.nc, self.ne = np.empty(B, dtype=np.int64), np.empty(B, dtype=bool)
        self.mv = np.empty(Gs * B, dtype=bool)
        self.mv2 = self.mv.reshape(Gs, B)
        self.ck_all = o.full  # NOTE: the first commit stores checked = floor on every cell
        nb = t.num_blocks.reshape(-1).take(self.kb)
        front = np.tile(self.front, Gs)
        self.ok = not (_count(self.prv > front) or _count(nb * self.bs < front))
        if self.ok and o.full:
            self.ok = not _count(np.minimum(nb, o.checked.reshape(-1).take(self.kb)) > self.floor)


def _view(o, plan) -> Optional[BatchView]:
    """The view of ``plan``'s batch (built when the slots changed), or None."""
    v, b = o.view, plan.slots
    if v is not None and v.B == b.shape[0] and v.key == b.tobytes():
        return v if v.ok else None
    if o.view_retry > 0 and v is not None and not v.ok:
        o.view_retry -= 1
        return None
    o.view = v = BatchView(o, b)
    if not v.ok:
        o.view_retry = _RETRY
        return None
    return v


def plan_batch(o, plan) -> Optional[Step]:
    """The step of ``plan`` proved on the batch view, or None."""
    if (not plan.steady or plan.w_other is not None or plan.free_slots.size or plan.new_slots.size
            or o.slow_geometry or not o.S.size or plan.all_slots.shape[0] != plan.slots.shape[0]):
        return None
    v = _view(o, plan)
    if v is None:
        return None
    seq = plan.seq_lens
    nc = np.subtract(seq, plan.num_scheduled, out=v.nc)
    low = None
    if _count(np.not_equal(nc, v.mark, out=v.ne)):
        if _count(np.greater(nc, v.front, out=v.ne)):
            return None                                  # NOTE: a jump (the general path names it)
        low = np.flatnonzero(np.less(nc, v.mark, out=v.ne))
        if _count(np.less(nc, v.prv2, out=v.mv2)):
            return None                                  # NOTE: a window moved back: blocks held again
    st = Step()
    st.fast, st.view = "batch", v
    cells = np.flatnonzero(np.greater_equal(nc, v.nxt2, out=v.mv2))
    st.cells, st.rel = cells, None
    if cells.size:
        nxt_c = v.nxt.take(cells)
        nx2 = nxt_c + v.bs.take(cells)
        if _count(nc.take(v.row.take(cells)) >= nx2):
            return None                                  # NOTE: a window crossed more than one block
        ids = o.tables.mirror.take(v.fidx.take(cells))
        if ids.item(ids.argmin()) < 1:
            return None                                  # NOTE: a null block left behind (the other paths)
        rel = ids.astype(_I64)
        rel *= o.G
        rel += v.g.take(cells)
        st.rel, st.nxt_c, st.nx2 = rel, nxt_c, nx2
    st.acq = acq_sorted = None
    if plan.w_gid.shape[0]:
        ids = plan.w_ids
        if ids.item(ids.argmin()) < 1:
            return None
        keys = ids * o.G
        keys += plan.w_gid
        o.grow(keys.view(_U64).item(keys.argmax()))
        base = o.count.take(keys)
        if _count(base):
            if st.rel is None:
                return None
            if _count(base - count_in(np.sort(st.rel), keys)):
                return None                              # NOTE: held by someone: the general path judges it
        if keys.shape[0] > 1:
            acq_sorted = np.sort(keys)
            if _count(acq_sorted[1:] == acq_sorted[:-1]):
                return None                              # NOTE: two runs append one id
        st.acq = keys
    if low is not None and not _rewinds_clear(o, v, plan, low, nc, st.acq, acq_sorted):
        return None
    st.seq = seq
    return st


def _rewinds_clear(o, v: BatchView, plan, low, nc, acq, acq_sorted) -> bool:
    """Rule 4 on the rows that rewound: their old blocks at positions ``[nc, min(seq, mark))`` (non-full
    groups: ``frontier``) have one holder and are not acquired in this step."""
    t, k = o.tables, low.shape[0]
    b = v.b.take(low)
    ncl, seql = nc.take(low), plan.seq_lens.take(low)
    top = np.where(o.nc_full, np.minimum(seql, v.mark.take(low)), np.minimum(seql, v.front.take(low)))
    key = o.nc_key + b                                    # [Gn, k] pair keys
    lo = np.maximum(ncl // o.nc_bs, o.floor.reshape(-1).take(key))
    hi = np.minimum(-(-top // o.nc_bs), t.num_blocks.reshape(-1).take(key))
    keys = old_keys(o, np.repeat(o.NC, k), np.tile(b, o.NC.size), lo.reshape(-1), hi.reshape(-1))
    if not keys.size:
        return True
    if _count(o.count.take(keys) > 1):
        return False
    if acq is None:
        return True
    srt = acq_sorted if acq_sorted is not None else acq
    return not _count(count_in(srt, keys))


def commit_batch(o, st: Step) -> None:
    """Apply a batch step (the view and the slot-keyed state together)."""
    v, cells = st.view, st.cells
    if st.rel is not None:
        bump(o.count, st.rel, -1)
    if st.acq is not None:
        o.count[st.acq] += 1                              # NOTE: distinct keys (checked)
    if cells.size:
        lo = v.floor.take(cells)
        lo += 1
        kc = v.kb.take(cells)
        o.floor.reshape(-1)[kc] = lo
        v.floor[cells] = lo
        v.prv[cells] = st.nxt_c
        v.nxt[cells] = st.nx2
        lo %= v.rmod.take(cells)
        v.fidx[cells] = v.pb.take(cells) + lo
        if o.full and not v.ck_all:
            o.checked.reshape(-1)[kc] = v.floor.take(cells)
    if v.ck_all:
        o.checked.reshape(-1)[v.kb] = v.floor
        v.ck_all = False
    np.maximum(v.front, st.seq, out=v.front)
    o.frontier[v.b] = v.front
    if v.has_mark:
        np.maximum(v.front, v.rmark, out=v.mark)
