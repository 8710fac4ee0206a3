"""The serving step through :mod:`.owners`' rules against batch-ordered state: the rows of the last
accepted batch (steady decode, MTP with rejected drafts, and churn: rows that finish and join), kept in a
:class:`BatchView` so that a step costs a few whole-batch compares plus work on what changed (rows that
rewound, windows that crossed a block, freed and new rows: :mod:`.ownership_churn`). Anything else, or any
doubt, returns None and the other paths decide (and name the culprit).

Which steps: an incremental plan (:mod:`.steady`, ``plan.steady``: every run's slot is a batch row, its
group non-circular) with no replay, replicated groups and plain blocks, every row of the step in the batch;
the runs of kept rows one-id appends (``start == blocks held``), any runs for new rows. The view is kept
across steps of one batch; a churn step builds the next one (carrying what it knows of the kept rows) and
installs it at commit; a general commit drops it.

Why it is the same answer as the general rules, per rule of :mod:`.owners`:

* no jump: ``nc <= frontier`` (one compare with ``mark = max(frontier, replay_mark) >= frontier`` first:
  ``nc == mark`` everywhere proves both no jump and no rewound row; new rows have ``front = nc``);
* rule 4 (rows writing below their frontier / mark): only rows with ``nc < mark`` (``low``); every old
  block they rewrite lies at or above ``nc // bs``; ``priv`` per (non-circular group, row) is a position
  from which every block the row holds has it as its only holder (a row's fills, a clean gather; reset
  when a new row takes a held id as a prefix hit), so a rewound row with ``nc // bs >= priv`` in every
  group is clear; other rows are gathered (holder count 1, not acquired in this step);
* sliding windows: the window block ``lo = max(nc - W + 1, 0) // bs`` of every cell, against its floor,
  in one pass over the batch: ``lo < floor`` declines (a window moved back: blocks held again; a row with
  ``nc >= frontier`` never does, ``floor * bs + W - 1 <= frontier`` being checked when the view is built);
  ``lo > floor`` is a crossing, which releases ``[floor, lo)`` (one block: the floor block, at mirror index
  ``pb + floor % ring``; the row holds it: ``blocks * bs >= frontier``, checked at build, kept by coverage)
  and commits ``floor = lo``;
* rule 3 (fills): an append lands where the row writes, and so does every block of a new row from the
  block of its write start on: each must have no holder after the releases; no id is acquired twice
  (a sort; a same-step prefix share of a fresh block is left to the general rules);
* rule 1 (ring low-water): ``ring_lo <= floor <= lo`` for kept rows (a commit stores ``floor >= ring_lo``;
  appends keep ``ring_lo``); a new row's ring run stores from ``keep <= lo``;
* ``"full"``: the held-null scan has nothing below the checked marks (``min(blocks, checked) <= floor``
  at build; the first commit stores ``checked = floor`` on every batch cell, later ones on moved cells),
  and a new row's acquisitions are distinct.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .ownership_churn import commit_rows, freed_keys, fresh_runs
from .ownership_rules import Step, count_in, old_keys, release

__all__ = ["BatchView", "plan_batch", "commit_batch"]

_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)
_BIG = 1 << 62
_CAP = 1 << 40  # NOTE: above every position; _CAP * block size stays below 2**63
_EMPTY = np.zeros(0, dtype=np.int64)
_count = np.count_nonzero
_RETRY = 8  # NOTE: a batch whose view could not be built is retried after this many steps


class BatchView:
    """Batch-ordered copies of :class:`~.owners.BlockOwners` state for the rows of the last accepted batch.

    Attributes (``B`` rows, ``Gs`` sliding groups, cells ``j * B + row``)
    ----------
    key : bytes of the batch's slots; b : int64 ``[B]`` slots.
    front, mark : int64 ``[B]`` frontier and ``max(frontier, replay_mark)`` (``mark is front`` when equal).
    cell : int64 ``[3, Gs, B]`` — every per-cell field stacked (rows: floor, pb, kb), so that a churn step
        moves them with one gather; ``floor``, ``pb``, ``kb`` (``[Gs * B]``) and ``floor2`` (``[Gs, B]``) are
        views of it: the floor block, the mirror index of column 0, the pair key.
    bs, g, row, rmod : int64 ``[Gs * B]`` per cell: block size, gid, batch row, ring modulus.
    """

    ok: bool
    priv: np.ndarray
    privmax: Optional[np.ndarray] = None  # NOTE: [B] max over groups of priv * bs, None when priv changed

    def __init__(self, o, b: np.ndarray, fresh: Optional[np.ndarray] = None, nc: Optional[np.ndarray] = None,
                 prev: Optional["BatchView"] = None):
        t, B = o.tables, b.shape[0]
        self._common(o, b)
        self.front = o.frontier.take(b)
        self.rmark = o.replay_mark.take(b)
        cell = self.cell = np.empty((_K, o.S.size, B), dtype=np.int64)
        fl2 = cell[_FLOOR]
        kb2 = np.add(o.S_key, b[None, :], out=cell[_KB])
        o.floor.reshape(-1).take(kb2, out=fl2)
        nb2 = t.num_blocks.reshape(-1).take(kb2)
        ck2 = o.checked.reshape(-1).take(kb2) if o.full else None
        if fresh is not None:  # NOTE: new rows hold nothing yet: front = nc (no jump, no rewind), floor = lo
            assert nc is not None, "BatchView: fresh rows need nc"
            fr = np.flatnonzero(fresh)
            ncf = nc.take(fr)
            self.front[fr] = ncf
            self.rmark[fr] = 0
            lo = ncf - o.wm1_S
            np.maximum(lo, 0, out=lo)
            lo //= o.bs_S
            fl2[:, fr] = lo
            nb2[:, fr] = _BIG // 64
            if ck2 is not None:
                ck2[:, fr] = 0
        o.pair_base.take(kb2, out=cell[_PB])
        self._views()
        # NOTE: priv: every block a row holds from this position on has this row as its only holder (kept
        # until a step gives a held id another holder: then reset); carried over from the last view for its
        # rows, else the block count (none known); new rows: set at commit
        priv = t.num_blocks.reshape(-1).take(o.nc_key + b)
        if prev is not None and prev.ok:
            pos = prev.row_of.take(b)
            priv = np.where(pos >= 0, np.take(prev.priv, pos, axis=1, mode="clip"), priv)
        if fresh is not None:
            priv[:, fr] = _BIG
        self.priv = priv
        p2 = fl2 * o.bs_S
        p2 += o.wm1_S                                     # NOTE: floor * bs + W - 1: lo(front) < floor when above
        self.ok = not (_count((p2 > self.front) & (fl2 > 0)) or _count(nb2 * o.bs_S < self.front))
        if self.ok and ck2 is not None:
            self.ok = not _count(np.minimum(nb2, ck2) > fl2)

    def _common(self, o, b: np.ndarray) -> None:
        """Geometry, scratch, the slot map and the batch key of a view of batch slots ``b``."""
        B = b.shape[0]
        geo = _geometry(o, B)
        self.bs, self.g, self.row, self.rmod = geo["bs"], geo["g"], geo["row"], geo["rmod"]
        self.nc, self.ne = geo["nc"], geo["ne"]
        self.key, self.b, self.B = b.tobytes(), b.copy(), B
        self.ck_all = o.full  # NOTE: the first commit stores checked = floor on every cell
        self.row_of = np.full(o.num_slots, -1, dtype=np.int64)
        self.row_of[b] = self.row[:B]

    def _views(self) -> None:
        """Per-field views of the stacked ``cell`` array (one gather moves every field of a row)."""
        c = self.cell
        self.floor2 = c[_FLOOR]
        self.floor, self.pb, self.kb = (c[k].reshape(-1) for k in (_FLOOR, _PB, _KB))
        self.has_mark = bool(_count(self.rmark > self.front))
        self.mark = np.maximum(self.front, self.rmark) if self.has_mark else self.front

    @classmethod
    def patched(cls, o, prev: "BatchView", b: np.ndarray, fresh_rows: list, nc: np.ndarray) -> Optional["BatchView"]:
        """The view of batch slots ``b`` from ``prev`` (an accepted view, kept in step with the slot-keyed
        state): its rows moved with one gather per array, the few ``fresh_rows`` (batch rows of new
        requests) filled in Python ints; None when a row is neither in ``prev`` nor fresh (a full build
        then reads the slot-keyed state). Same fields as the full build."""
        pos = prev.row_of.take(b)
        outside = _count(pos < 0)
        if outside and outside != sum(1 for r in fresh_rows if pos.item(r) < 0):
            return None
        v = object.__new__(cls)
        v._common(o, b)
        v.cell = np.take(prev.cell, pos, axis=2, mode="clip")
        v.front = prev.front.take(pos, mode="clip")
        v.rmark = prev.rmark.take(pos, mode="clip")
        v.priv = np.take(prev.priv, pos, axis=1, mode="clip")
        cell, priv, front, rmark = v.cell, v.priv, v.front, v.rmark
        for r in fresh_rows:
            n, slot = int(nc.item(r)), int(b.item(r))
            front[r], rmark[r] = n, 0
            priv[:, r] = _BIG
            for j, (g, w1, bs, _) in enumerate(o.S_geo):
                kb = g * o.num_slots + slot
                cell[:, j, r] = (max(n - w1, 0) // bs, o.pair_base.item(kb), kb)
        v._views()
        v.ok = True  # NOTE: kept rows as in ``prev`` (accepted); fresh rows: floor = lo(nc), front = nc, no blocks
        return v


_K, _FLOOR, _PB, _KB = 3, 0, 1, 2


def _geometry(o, B: int) -> dict:
    """Per-cell constants and scratch of a ``B``-row view (cached per ``B``)."""
    got = o.batch_geometry.get(B)
    if got is None:
        Gs = o.S.size
        got = o.batch_geometry[B] = dict(
            bs=np.repeat(o.bs_S.reshape(-1), B), g=np.repeat(o.S, B), row=np.tile(np.arange(B, dtype=np.int64), Gs),
            rmod=np.repeat(o.ring_mod_S, B), nc=np.empty(B, dtype=np.int64), ne=np.empty(B, dtype=bool))
    return got


def _view(o, plan) -> Optional[BatchView]:
    """The view of ``plan``'s batch (built when the slots changed), or None."""
    v, b = o.view, plan.slots
    if v is not None and v.B == b.shape[0] and v.key == b.tobytes():
        return v if v.ok else None
    if o.view_retry > 0 and v is not None and not v.ok:
        o.view_retry -= 1
        return None
    o.view = v = BatchView(o, b, prev=v)
    if not v.ok:
        o.view_retry = _RETRY
        return None
    return v


def plan_batch(o, plan) -> Optional[Step]:
    """The step of ``plan`` proved on the batch view, or None."""
    if (not plan.steady or o.slow_geometry or not o.S.size or plan.all_slots.shape[0] != plan.slots.shape[0]
            or plan.replay_start is not None or plan.replay_end is not None):
        return None
    st = Step()
    st.fast, st.churn, st.fresh_b = "batch", bool(plan.free_slots.size or plan.new_slots.size), None
    st.acq, st.acq_sorted, st.fr_runs = _EMPTY, None, None  # NOTE: empty key arrays: nothing acquired / released
    st.shared_hit = False
    if st.churn:
        nc = plan.seq_lens - plan.num_scheduled
        if plan.new_slots.size:
            o.fresh_map[plan.new_slots] = True
            st.fresh_b = o.fresh_map.take(plan.slots)
            o.fresh_map[plan.new_slots] = False
        prev, v = o.view, None
        if prev is not None and prev.ok:
            rows = [] if st.fresh_b is None else np.flatnonzero(st.fresh_b).tolist()
            v = BatchView.patched(o, prev, plan.slots, rows, nc)
        if v is None:
            v = BatchView(o, plan.slots, st.fresh_b, nc, prev)
        st.view_nc = nc
        if not v.ok:
            return None
    else:
        if plan.w_other is not None:
            return None
        v = _view(o, plan)
        if v is None:
            return None
        nc = np.subtract(plan.seq_lens, plan.num_scheduled, out=v.nc)
    st.view, seq = v, plan.seq_lens
    low = None
    if _count(np.not_equal(nc, v.mark, out=v.ne)):
        if _count(np.greater(nc, v.front, out=v.ne)):
            return None                                  # NOTE: a jump (the general path names it)
        low = np.flatnonzero(np.less(nc, v.mark, out=v.ne))
    if not _releases(o, v, st, nc, plan):
        return None
    if plan.w_gid.shape[0] and not _acquisitions(o, v, st, plan, nc):
        return None
    if low is not None and not _rewinds_clear(o, v, plan, low, nc, st):
        return None
    st.seq, st.view_plan = seq, plan
    return st


def _releases(o, v: BatchView, st: Step, nc, plan) -> bool:
    """The window block ``lo`` of every cell against its floor: a cell whose window moved back declines
    (blocks held again); the blocks every cell whose window crossed a block boundary leaves (the floor
    block; or, when one crossed more, ``[floor, min(lo, blocks))``), and every id of the freed slots."""
    lo2 = nc - o.wm1_S                                    # NOTE: [Gs, B] window blocks lo = max(nc - W + 1, 0) // bs
    np.maximum(lo2, 0, out=lo2)
    lo2 //= o.bs_S
    d2 = lo2 - v.floor2
    cells = np.flatnonzero(d2)
    st.cells, st.lo2, st.rel = cells, lo2, _EMPTY
    parts = []
    if cells.size:
        dc = d2.reshape(-1).take(cells)
        if dc.item(dc.argmin()) < 0:
            return False                                 # NOTE: a window moved back: blocks held again
        if dc.item(dc.argmax()) > 1:  # NOTE: cells whose window crossed more than one block (a prefill's
            far = dc > 1             # last chunk): [floor, min(lo, blocks)) left, the others below
            fc, cells1 = cells[far], cells[~far]
            parts.append(old_keys(o, v.g.take(fc), v.b.take(v.row.take(fc)), v.floor.take(fc),
                                  np.minimum(lo2.reshape(-1).take(fc),
                                             o.tables.num_blocks.reshape(-1).take(v.kb.take(fc)))))
        else:
            cells1 = cells
        if cells1.size:                                  # NOTE: one block left: the floor block
            f0 = v.floor.take(cells1)
            if o.S_ring:
                f0 %= v.rmod.take(cells1)
            f0 += v.pb.take(cells1)                      # NOTE: the floor block's mirror index
            ids = o.tables.mirror.take(f0)
            rel = ids.astype(_I64)
            rel *= o.G
            rel += v.g.take(cells1)
            parts.append(rel if ids.item(ids.argmin()) >= 1 else rel[ids >= 1])  # NOTE: the null block is id 0
    if plan.free_slots.size:
        parts.append(freed_keys(o, plan.free_slots))
    if parts:
        st.rel = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return True


def _acquisitions(o, v: BatchView, st: Step, plan, nc) -> bool:
    """Rule 3 on every id the runs acquire (all fills but a new row's prefix hits): no holder after the
    releases, no id acquired twice; a new row's ring run keeps its ring low-water at or below its window."""
    gid, ids = plan.w_gid, plan.w_ids
    if st.fresh_b is None and plan.w_other is None:
        if ids.item(ids.argmin()) < 1:
            return False
        keys = ids * o.G
        keys += gid
        fills, st.fr_runs = keys, None
    else:
        keys, fills = fresh_runs(o, v, st, plan, nc)
        if keys is None:
            return False
    o.grow(keys.view(_U64).item(keys.argmax()))
    base = o.count.take(fills)
    if _count(base):
        if not st.rel.size or _count(base - count_in(np.sort(st.rel), fills)):
            return False                                 # NOTE: held by someone: the general path judges it
    st.acq_sorted = None
    if keys.shape[0] > 1:
        st.acq_sorted = srt = np.sort(keys)
        if _count(srt[1:] == srt[:-1]):
            return False                                 # NOTE: one id acquired twice
    st.acq = keys
    return True


def _rewinds_clear(o, v: BatchView, plan, low, nc, st) -> bool:
    """Rule 4 on the rows that rewound: their old blocks at positions ``[nc, min(seq, mark))`` (non-full
    groups: ``frontier``) have one holder and are not acquired in this step: at or above ``priv`` (no
    other holder, and no acquisition of this step takes a held id: fills have none, and a step with a hit
    on a held id gathers), or gathered."""
    if not st.shared_hit:
        pm = v.privmax
        if pm is None:  # NOTE: priv > nc // bs  <=>  priv * bs > nc (both sides integers; priv capped)
            pm = np.minimum(v.priv, _CAP)
            pm *= o.nc_bs
            pm = v.privmax = pm.max(axis=0)
        bad = pm.take(low) > nc.take(low)
        if not _count(bad):
            return True
        low = low.take(np.flatnonzero(bad))
    return _rewinds_gather(o, v, plan, low, nc, st.acq, st.acq_sorted)


def _rewinds_gather(o, v: BatchView, plan, low, nc, acq, acq_sorted) -> bool:
    """Rule 4 by gathering the ids of the rewound rows from their rewrite start to their last block (the
    blocks past ``min(seq, mark)`` are not written: one with another holder declines, the general rules
    then decide); when all have one holder, ``priv`` of those rows moves down to the rewrite start."""
    t, k = o.tables, low.shape[0]
    b = v.b.take(low)
    key = o.nc_key + b                                    # [Gn, k] pair keys
    lo = np.maximum(nc.take(low) // o.nc_bs, o.floor.reshape(-1).take(key))
    keys = old_keys(o, np.repeat(o.NC, k), np.tile(b, o.NC.size), lo.reshape(-1),
                    t.num_blocks.reshape(-1).take(key).reshape(-1))
    if keys.size:
        if _count(o.count.take(keys) > 1):
            return False
        if acq.size and _count(count_in(acq_sorted if acq_sorted is not None else acq, keys)):
            return False
    v.priv[:, low] = np.minimum(np.take(v.priv, low, axis=1), lo)
    v.privmax = None
    return True


def commit_batch(o, st: Step) -> None:
    """Apply a batch step (the view and the slot-keyed state together)."""
    v, cells = st.view, st.cells
    if st.rel.size:
        release(o.count, st.rel)
    if st.acq.size:
        o.count[st.acq] += 1                              # NOTE: distinct keys (checked)
    if st.churn:
        commit_rows(o, v, st)
    if cells.size:
        np.copyto(v.floor2, st.lo2)                      # NOTE: lo == floor on every other cell
        o.floor.reshape(-1)[v.kb] = v.floor
    if o.full and (cells.size or v.ck_all):              # NOTE: checked == floor on every batch cell
        o.checked.reshape(-1)[v.kb] = v.floor
        v.ck_all = False
    np.maximum(v.front, st.seq, out=v.front)
    o.frontier[v.b] = v.front
    if v.has_mark:
        np.maximum(v.front, v.rmark, out=v.mark)
