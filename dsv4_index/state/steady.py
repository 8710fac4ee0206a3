"""The incremental path of the checks (DESIGN §5 "the serving step is not steady"): every step is
checked against the batch-ordered state of the last accepted step, patched for what changed; any step or
doubt it does not prove goes to the general checks of :mod:`.plan` (which also produce every error message). The plan is
then identical to the general one (``validate=True`` runs both and compares them).

The state kept after every accepted step (:class:`BatchCache`), per device batch row: its slot, its
``seq_len`` and, per (non-circular group, batch row), the slack ``x = blocks * block_size - seq_len``;
and a slot -> batch-row map. A step with any ``num_computed_tokens`` (rejected drafts:
``x' = x - (seq - seq_old)``), rows that finish, join or move (one gather of the kept columns, the fresh
rows' columns from the tables' block counts), one-id appends (vectorised: ``x'[cell] += bs``) and a few
other runs (a joining request's lists, a row cut back: one by one in Python ints, ``x'[cell]`` set)
costs what changed, not the batch or the table width.

Why it is sufficient: coverage is exactly ``x' >= 0``; the ring bound ``blocks - lowest_read_block <=
ring`` is implied by ``x' <= ring * bs - W - bs + 2 - q_max`` for any ``num_computed_tokens`` (the lowest
block a row reads is ``floor(max(nc - W + 1, 0) / bs)`` and ``seq = nc + q``); the table width by
``x' <= min(logical * bs) - max(seq')``. One unsigned compare (negative slack views as huge) proves all
three; on failure the exact per-group bounds run, then the general path. A one-id append keeps its id
(coverage puts it at or past the lowest block read, and ``ring >= 1``). Circular groups: a row of the
last batch holds its whole ring and no run touches it (runs on circular groups are declined); a fresh
row's ring is read from the block counts.

The checks of :mod:`.plan` and how this path treats each are :data:`FAST_CHECKS` (a test parses
``plan.py`` and requires every check there to be listed).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..batch import StepBatch
from .fast_full import full_ok
from .fast_runs import bounds_ok, check_runs
from .plan import StepPlan

__all__ = ["FAST_CHECKS", "FastGeometry", "BatchCache", "plan_fast"]

# NOTE: every check of plan.py (its message, formatted values as {}) -> how the fast path handles it:
# "proved" (by the state and the inequality of the module docstring) or "declined" (the general path runs)
FAST_CHECKS = (
    ("step must be a StepInput or a StepBatch, got {}", "declined: anything but a StepBatch"),
    ("{} must be a 1-D integer array, got {}", "declined: not int64 1-D numpy arrays"),
    ("{} must be a 1-D {} array, got dtype {} and shape {}", "declined: not int64 / bool 1-D numpy arrays"),
    ("{} has {} entries, expected {}", "declined: shapes differ"),
    ("{}[{}] = {} is not {} in [0, {})", "proved: unsigned argmax of slots, free slots, gids, write slots"),
    ("{}[{}] = {} is negative", "proved: unsigned argmax of the counts"),
    ("num_computed_tokens[{}] = {} is beyond max_model_len = {}", "proved: unsigned argmax"),
    ("num_scheduled_tokens: the step schedules {} tokens, more than max_num_batched_tokens = {}",
     "proved: q max and T"),
    ("req_slots: slot {} appears in {} batch rows", "proved: seen-mask count, or the last batch's bytes"),
    ("free_slots lists a slot twice", "proved: seen-mask count"),
    ("free_slots[{}] = {} does not hold a request", "proved: occupancy gather"),
    ("req_slots[{}] = {} is new but still holds a request (free it first)", "proved: occupancy after freeing"),
    ("req_slots[{}] = {} holds no request (mark it is_new)", "proved: occupancy after freeing"),
    ("pad_to must be an int in [{}, {}], got {}", "proved: same test"),
    ("replay_start of slot {} = {} is outside [0, num_computed_tokens = {}]", "declined: replay bounds"),
    ("replay_end of slot {} = {} is negative", "declined: replay bounds"),
    ("replay_end of slot {} = {} does not fit int32", "declined: replay bounds"),
    ("block ids missing for gid {} ({}) of slot {}: {} tokens need {} blocks, the row has {}",
     "proved: x' >= 0 (circular: the fresh rows' counts)"),
    ("gid {} ({}) is a ring of {} blocks, but slot {} holds blocks up to {} and reads from block {} this step",
     "proved: the ring inequality"),
    ("write_ids: the step stages {} block ids, more than max_staged_blocks = {}", "proved: len(ids) bound"),
    ("write_slots[{}] = {} holds no request after this step", "proved: occupancy gather"),
    ("write_cu must rise from 0 to len(write_ids) = {}", "proved: ends and minimum difference"),
    ("two write runs for gid {}, slot {} (one run per (group, slot))", "proved: seen-mask count"),
    ("write_starts[{}] = {} leaves a hole: gid {} of slot {} holds {} blocks", "proved: per other run"),
    ("write run {}: slot {} would hold {} blocks in gid {} ({}), the table holds {} ({})",
     "proved: the width inequality, or per run"),
    ("write_ids[{}] = {} is negative", "proved: unsigned argmax of the ids"),
    ("write_ids[{}] = {} in gid {} ({}) gives slots beyond int32 (largest id {})", "proved: unsigned argmax"),
)

_I64, _U64, _BOOL = np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.bool_)
_EMPTY = np.zeros(0, dtype=np.int64)
_count = np.count_nonzero
_BIG = np.iinfo(np.int64).max
_APPEND = -1
_OUT = -(1 << 40)  # NOTE: "no batch row" in the slot -> row map and "no slack row" per group: any cell
                   # gpos[g] * B + row built from one of them is negative


def _umax(x: np.ndarray) -> int:
    """Largest entry as unsigned (negatives view as huge): argmax + item, no numpy wrapper."""
    u = x.view(_U64)
    return u.item(u.argmax())


class FastGeometry:
    """What the fast path needs of the tables, computed once per pipeline: the non-circular groups
    ``groups`` (``gpos[g]`` their index, -1 for circular), block sizes, the ring bound before ``q_max``
    (``bound0 = ring * bs - W - bs + 2``, huge for plain tables), widths and ring lowest-block inputs."""

    def __init__(self, tables):
        G, num_slots = len(tables.groups), tables.max_num_reqs
        self.num_groups, self.num_slots = G, num_slots
        self.groups = np.flatnonzero(~tables.circular)
        self.gpos = np.full(max(G, num_slots), _OUT, dtype=np.int64)  # NOTE: indexable by any gid < num_slots
        self.gpos[self.groups] = np.arange(self.groups.size)
        bs = tables.bs[self.groups]
        self.bs_x = bs[:, None]
        ring, win = tables.ring[self.groups], tables.window[self.groups]
        self.bound0 = np.where(ring > 0, ring * bs - win - bs + 2, _BIG // 4)
        self.bound0_min = int(self.bound0.min()) if bs.size else _BIG // 4
        self.covered_min = int((tables.logical[self.groups] * bs).min()) if bs.size else _BIG // 4
        self.width = np.where(tables.circular, 0, tables.logical)
        self.circ = np.flatnonzero(tables.circular)
        self.circ_need = tables.logical[self.circ][:, None]
        self.key_base = (np.arange(G, dtype=np.int64) * num_slots)[:, None]
        self.arange = np.arange(max(G * num_slots, num_slots) + 1, dtype=np.int64)
        self.arange_bytes = self.arange.tobytes()
        self.append_bytes = np.full(G * num_slots, _APPEND, dtype=np.int64).tobytes()
        self.bs_of = tables.bs.copy()
        self.num_slots_0d = np.array(num_slots, dtype=np.int64)
        self._cell_base = {}
        # Python-int per-group geometry (the other runs)
        self.bs_list, self.ring_list = tables.bs.tolist(), tables.ring.tolist()
        self.window_list, self.logical_list = tables.window.tolist(), tables.logical.tolist()

    def cell_base(self, B: int) -> np.ndarray:
        """``gpos * B`` (first slack cell of each group for ``B`` batch rows; ``_OUT`` stays negative)."""
        got = self._cell_base.get(B)
        if got is None:
            got = self._cell_base[B] = np.where(self.gpos >= 0, self.gpos * B, _OUT)
        return got


class _Scratch:
    """Buffers a fast plan writes before it is accepted (not state: overwritten each step)."""

    def __init__(self, geo: FastGeometry):
        n = geo.groups.size * geo.num_slots + 1
        self.flats = [np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)]
        self.seen = np.zeros(geo.num_groups * geo.num_slots + 1, dtype=bool)
        self.row_map = np.full(geo.num_slots, _OUT, dtype=np.int64)
        self.occ: Optional[np.ndarray] = None        # NOTE: occupancy after the step's frees and joins
        self.plan: Optional[StepPlan] = None         # NOTE: the fast plan checked last, and what accepting it stores
        self.pending: Optional[tuple] = None


class BatchCache:
    """The last accepted batch in device order (built by :meth:`from_plan` after a general plan,
    advanced by :meth:`advance` after a fast one).

    Attributes (``G'`` non-circular groups, ``B`` batch rows)
    ----------
    b_slots, seq : int64 ``[B]`` — slot and ``seq_len`` of each batch row.
    nc_chk : int64 ``[B]`` — ``num_computed_tokens`` of the step whose full checks last scanned the row's
        held blocks (``checks="full"``: a row whose window start moves below it is declined).
    x : int64 ``[G', B]`` — slack ``blocks * block_size - seq_len`` (a view of one of two flat buffers).
    row_of : int64 ``[num_slots]`` — batch row of each slot, ``_OUT`` (hugely negative) outside the batch.
    order : ``(order or None, num_decodes, T)`` of the batch (kept while slots and counts repeat).
    slots_bytes, q_bytes : bytes of the StepBatch-order slots and counts (None: a row without tokens).
    generation : int — changes whenever the batch's slots, counts or order change (staging signature).
    geo, scratch : the pipeline's :class:`FastGeometry` and the fast plan's :class:`_Scratch` buffers.
    flat : int64 — the buffer ``x`` is a view of.
    """

    geo: FastGeometry
    scratch: "_Scratch"
    generation: int
    row_of: np.ndarray
    flat: np.ndarray

    @classmethod
    def from_plan(cls, plan: StepPlan, geo: FastGeometry, tables, prev: Optional["BatchCache"],
                  generation: int) -> Optional["BatchCache"]:
        """The cache after accepting a general ``plan`` (the tables already committed)."""
        B = plan.slots.shape[0]
        if B == 0:
            return None
        c = prev if prev is not None else cls()
        if prev is None:
            c.geo, c.scratch = geo, _Scratch(geo)
            c.row_of = np.full(geo.num_slots, _OUT, dtype=np.int64)
            c.flat = np.zeros(geo.groups.size * geo.num_slots + 1, dtype=np.int64)
        else:
            c.row_of[c.b_slots] = _OUT
        c.b_slots, c.seq = plan.slots.copy(), plan.seq_lens.copy()
        c.nc_chk = plan.seq_lens - plan.num_scheduled
        c.row_of[c.b_slots] = geo.arange[:B]
        x = c.flat[:geo.groups.size * B].reshape(geo.groups.size, B)
        kx = geo.key_base[geo.groups] + c.b_slots[None, :]
        np.subtract(tables.num_blocks.ravel().take(kx) * geo.bs_x, c.seq, out=x)
        c.x = x
        if plan.all_slots.shape[0] == B:
            q_all = np.empty(B, dtype=np.int64)
            q_all[plan.rows] = plan.num_scheduled
            c.slots_bytes, c.q_bytes = plan.all_slots.tobytes(), q_all.tobytes()
        else:
            c.slots_bytes = c.q_bytes = None
        c.order = (None if (plan.rows == geo.arange[:B]).all() else plan.rows, plan.num_decodes, plan.num_tokens,
                   plan.num_decode_tokens, plan.num_scheduled.item(plan.num_scheduled.argmax()))
        c.generation = generation
        return c

    def advance(self, plan: StepPlan) -> None:
        """Accept a fast ``plan`` (its pending state is in the scratch)."""
        s = self.scratch
        assert s.pending is not None, "BatchCache.advance: no fast plan is pending"
        (x, flat, seq, b_slots, nc_chk, row_map, slots_bytes, q_bytes, same, order) = s.pending
        if row_map is not None:  # NOTE: the batch changed: swap in the new slot -> row map
            s.row_map, self.row_of = self.row_of, row_map
        if flat is not self.flat:
            s.flats[s.flats.index(flat)] = self.flat
            self.flat = flat
        self.x, self.seq, self.b_slots, self.nc_chk = x, seq, b_slots, nc_chk
        self.slots_bytes, self.q_bytes, self.order = slots_bytes, q_bytes, order
        if not same:
            self.generation += 1
        s.plan = s.pending = None


def _rows(batch, c: BatchCache, occupied: np.ndarray, n: int, slots_bytes: bytes):
    """Rows of the step: ``(is_new or None, free, occ_after or None, same slots as the last batch)``;
    None when not proved."""
    req_slots, new, free = batch.req_slots, batch.is_new, batch.free_slots
    if new is not None:
        if type(new) is not np.ndarray or new.dtype is not _BOOL or new.shape != (n,):
            return None
        if not _count(new):
            new = None
    if free is None:
        free = _EMPTY
    elif type(free) is not np.ndarray or free.dtype is not _I64 or free.ndim != 1:
        return None
    if new is None and not free.size and slots_bytes == c.slots_bytes:
        return new, free, None, True, None  # NOTE: the last batch's slots: range, distinct, occupied
    num_slots, seen = c.geo.num_slots, c.scratch.seen
    if _umax(req_slots) >= num_slots:
        return None
    seen[req_slots] = True
    distinct = _count(seen)
    seen[req_slots] = False
    if distinct != n:
        return None
    if not free.size and new is None:
        return (new, free, None, False, None) if _count(occupied.take(req_slots)) == n else None
    occ = c.scratch.occ = np.copy(occupied)
    if free.size:
        if _umax(free) >= num_slots:
            return None
        seen[free] = True
        distinct = _count(seen)
        seen[free] = False
        if distinct != free.shape[0] or _count(occ.take(free)) != free.shape[0]:
            return None
        occ[free] = False
    held = occ.take(req_slots)
    if new is None:
        if _count(held) != n:
            return None
    elif _count(held != new) != n:
        return None
    else:
        new_slots = req_slots[new]
        occ[new_slots] = True
        return new, free, occ, False, new_slots
    return new, free, occ, False, None


def _pad(T: int, pad_to, max_num_tokens: int):
    if pad_to is None:
        return T
    if isinstance(pad_to, bool) or not isinstance(pad_to, (int, np.integer)) or not T <= pad_to <= max_num_tokens:
        return None
    return int(pad_to)


def _order(q: np.ndarray, n: int, thr: int, max_num_tokens: int):
    """``(order or None, num_decodes, T, num_decode_tokens, q_max)`` of counts ``q`` (all ``>= 1``), or None."""
    if q.view(_U64).item(q.argmin()) < 1 or _umax(q) > max_num_tokens:
        return None
    T = int(q.sum())
    if T > max_num_tokens:
        return None
    q_max = q.item(q.argmax())
    if q_max <= thr:
        return None, n, T, T, q_max
    dec = q <= thr
    nd = _count(dec)
    k = int(dec.argmin())  # NOTE: first prefill row
    if nd and _count(dec[k:]):
        order = np.concatenate([dec.nonzero()[0], (~dec).nonzero()[0]])
        return order, nd, T, int(q.take(order[:nd]).sum()), q.item(q.argmax())
    return None, nd, T, int(q[:nd].sum()) if nd else 0, q.item(q.argmax())


def plan_fast(batch, c: BatchCache, tables, occupied: np.ndarray, pad_to, max_num_tokens: int,
              max_writes: int, next_n: int, level: str) -> Optional[StepPlan]:
    """The plan of a step on the incremental path, or None (a check not proven here: the general
    checks decide). Writes only the cache's scratch buffers."""
    if type(batch) is not StepBatch or batch.replay_start is not None or batch.replay_end is not None:
        return None
    req_slots, nc, q = batch.req_slots, batch.num_computed_tokens, batch.num_scheduled_tokens
    if (type(req_slots) is not np.ndarray or req_slots.dtype is not _I64 or req_slots.ndim != 1
            or not req_slots.shape[0]):
        return None
    n = req_slots.shape[0]
    for x in (nc, q):
        if type(x) is not np.ndarray or x.dtype is not _I64 or x.shape != req_slots.shape:
            return None
    slots_bytes = req_slots.tobytes()
    rows = _rows(batch, c, occupied, n, slots_bytes)
    if rows is None or _umax(nc) > tables.max_model_len:
        return None
    new, free, occ, same, new_slots = rows
    q_bytes = q.tobytes()
    same = same and q_bytes == c.q_bytes  # NOTE: the last batch again (any nc): its order and T
    got = c.order if same else _order(q, n, next_n, max_num_tokens)
    if got is None:
        return None
    order, nd, T, ndt, q_max = got
    T_pad = T if pad_to is None else _pad(T, pad_to, max_num_tokens)
    if T_pad is None:
        return None
    if order is None:
        b_slots, b_q, b_nc, b_new = req_slots, q, nc, new
    else:
        b_slots, b_q, b_nc = req_slots.take(order), q.take(order), nc.take(order)
        b_new = None if new is None else new.take(order)
    seq = b_nc + b_q
    step = _remap(c, b_slots, b_nc, b_new, seq, tables, level, same)
    if step is None:
        return None
    x, flat, row_map, nc_chk, fresh = step
    runs = check_runs(batch, c, tables, flat, row_map if row_map is not None else c.row_of,
                 occupied if occ is None else occ, new_slots, seq, b_nc, max_writes)
    if runs is None:
        return None
    gid, wslot, start, end, keep, cu, ids, row, key, other, app = runs
    if not bounds_ok(c.geo, x, seq, q_max, gid, end):
        return None
    if level == "full" and not full_ok(tables, (b_slots, b_q, seq, b_nc, new_slots, free), fresh,
                                       (gid, wslot, start, end, keep, cu, ids, row), other, app, batch.write_cu):
        return None
    c.scratch.pending = (x, flat, seq, b_slots, nc_chk, row_map, slots_bytes, q_bytes, same, got)
    plan = object.__new__(StepPlan)
    plan.__dict__.update(
        rows=c.geo.arange[:n] if order is None else order, slots=b_slots, num_scheduled=b_q, seq_lens=seq,
        replay_start=None, replay_end=None, num_decodes=nd,
        num_decode_tokens=ndt, num_tokens=T,
        num_tokens_padded=T_pad, free_slots=free, new_slots=_EMPTY if new_slots is None else new_slots,
        all_slots=req_slots, all_computed=nc, w_gid=gid, w_slot=wslot, w_start=start, w_end=end, w_keep=keep,
        w_cu=cu, w_ids=ids, w_row=row, w_key=key, w_other=other, w_app=app, steady=True)
    c.scratch.plan = plan
    return plan


def _remap(c: BatchCache, b_slots, b_nc, b_new, seq, tables, level, same: bool):
    """The slack of the new batch before its runs: ``(x, flat, row_map or None, nc_chk)``, or None."""
    geo, s = c.geo, c.scratch
    B, Gx = b_slots.shape[0], geo.groups.size
    flat = s.flats[0] if s.flats[0] is not c.flat else s.flats[1]
    x = flat[:Gx * B].reshape(Gx, B)
    if same or (b_new is None and B == c.b_slots.shape[0] and b_slots.tobytes() == c.b_slots.tobytes()):
        np.add(c.x, c.seq - seq, out=x)  # NOTE: x' = x - (seq - seq_old)
        if level == "full" and _count(b_nc < c.nc_chk):
            return None
        return x, flat, None, c.nc_chk, _EMPTY
    rm = s.row_map
    rm[:] = c.row_of
    rm[c.b_slots] = _OUT
    pos = c.row_of.take(b_slots)
    # NOTE: every column from the last batch (fresh rows clip to row 0), then the fresh ones overwritten
    np.take(c.x, pos, axis=1, out=x, mode="clip")
    d = c.seq.take(pos, mode="clip")
    d -= seq
    x += d
    fresh = pos < 0
    if b_new is not None:
        fresh |= b_new
    fr = fresh.nonzero()[0]
    nc_chk = c.nc_chk
    if level == "full":
        nc_chk = c.nc_chk.take(pos, mode="clip")
        nc_chk[fr] = b_nc.take(fr)
        if _count(b_nc < nc_chk):
            return None
    if fr.shape[0]:
        if b_new is None or _count(b_new) != fr.shape[0]:  # NOTE: a row back in the batch: its block counts
            fs = b_slots.take(fr)
            nb = tables.num_blocks[:, fs]
            if b_new is not None:
                nb[:, b_new.take(fr)] = 0
            if geo.circ.size and _count(nb[geo.circ] < geo.circ_need):
                return None  # NOTE: a fresh row without its whole ring (the general path decides)
            x[:, fr] = nb[geo.groups] * geo.bs_x - seq.take(fr)
        elif geo.circ.size:
            return None  # NOTE: a new row holds no ring yet (its circular runs take the general path)
        elif fr.shape[0] == 1:
            i = fr.item(0)
            x[:, i] = -seq.item(i)  # NOTE: a new row holds no block before its runs
        else:
            x[:, fr] = -seq.take(fr)
    rm[b_slots] = geo.arange[:B]
    return x, flat, rm, nc_chk, fr
