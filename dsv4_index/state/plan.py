"""Every check of one step, before anything changes: :func:`plan_step` turns a :class:`StepBatch`
into a :class:`StepPlan` or raises ``ValueError`` naming the culprit.

Check levels (docs/DESIGN.md §5):

* ``"safe"`` (always): what keeps memory and other requests' KV intact — array shapes and integer
  dtypes; slots in range, distinct, occupied (new rows: free); counts ``>= 0``; capacities (rows,
  tokens, staged ids); write runs: group and slot in range, one per (group, slot), no hole before
  the run, inside the logical width, ids ``>= 0`` and small enough that every slot fits int32;
  every scheduled token's blocks present (coverage) in every group; ring tables holding the blocks a
  step reads; circular groups holding a step's tokens (all ``capacity // block_size`` blocks of the
  ring); replay bounds.
* ``"full"`` (``validate=True`` or ``checks="full"``): the contract checks of :mod:`.contract` — no
  id twice in a row of a full group (nor an id already in the row); no null block (id 0) where the
  step reads or writes: anywhere in a full or circular group, and in a sliding group from the window
  start of the row's first token on (blocks wholly behind the window may be null, as vLLM frees them).

Nothing here mutates its inputs; :meth:`MetadataPipeline.update` commits the plan afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from .._common import INT32_MAX
from ..batch import StepBatch
from ._index import cp_owned, window_start
from .contract import full_checks
from .plan_runs import arr, check_counts, check_runs, first, in_range, seen_distinct

__all__ = ["StepPlan", "plan_step", "plans_equal", "CHECK_LEVELS"]

CHECK_LEVELS = ("safe", "full")


@dataclass
class StepPlan:
    """A checked step. Device batch = the rows with tokens, decode first; ``B`` rows, ``T`` tokens."""

    rows: np.ndarray            # int64 [B]: StepBatch row of each device batch row
    slots: np.ndarray           # int64 [B]
    num_scheduled: np.ndarray   # int64 [B]
    seq_lens: np.ndarray        # int64 [B]
    replay_start: Optional[np.ndarray]  # int64 [B] or None
    replay_end: Optional[np.ndarray]    # int64 [B] or None
    num_decodes: int
    num_decode_tokens: int
    num_tokens: int
    num_tokens_padded: int
    # state changes
    free_slots: np.ndarray      # int64 [F]
    new_slots: np.ndarray       # int64 [K]
    all_slots: np.ndarray       # int64 [rows]: every StepBatch row's slot
    all_computed: np.ndarray    # int64 [rows]
    # kernel-block write runs (validated); ids of logical blocks below w_keep are not stored
    w_gid: np.ndarray           # int64 [N]
    w_slot: np.ndarray
    w_start: np.ndarray
    w_end: np.ndarray
    w_keep: np.ndarray
    w_cu: np.ndarray            # int64 [N + 1]
    w_ids: np.ndarray           # int64 [n]
    w_row: np.ndarray           # int64 [N]: device batch row of each run's slot, -1 when not in the batch
    w_key: Optional[np.ndarray] = None  # int64 [N] ``gid * max_num_reqs + slot`` (fast path) or None
    w_other: Optional[np.ndarray] = None  # int64 [k] runs that are not one-id appends (fast path), or None
    w_app: Optional[np.ndarray] = None    # int64 [N - k] the one-id appends when w_other is set
    steady: bool = False        # NOTE: planned by the fast (incremental) path of state/steady.py
    drafts: Optional[np.ndarray] = None  # int64 [B] draft tokens per device row (owners.drafts_of), None: default


_EMPTY = np.zeros(0, dtype=np.int64)
_HOW = ("w_key", "w_other", "w_app", "steady")  # NOTE: fields that say how a plan was made, not what it is


def plans_equal(a: StepPlan, b: StepPlan) -> list:
    """Names of the fields in which two plans differ (values, dtypes and shapes), ``[]`` when equal;
    the fields of :data:`_HOW` are not compared."""
    out = []
    for name in StepPlan.__dataclass_fields__:
        if name in _HOW:
            continue
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            same = (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
                    and x.shape == y.shape and bool((x == y).all()))
        else:
            same = x == y
        if not same:
            out.append(name)
    return out


_ROW_MAPS: Dict[int, np.ndarray] = {}


def _row_map(num_slots: int) -> np.ndarray:
    """A slot -> batch row scratch map, all -1 between calls (each user resets what it set)."""
    got = _ROW_MAPS.get(num_slots)
    if got is None:
        got = _ROW_MAPS[num_slots] = np.full(num_slots, -1, dtype=np.int64)
    return got


def plan_step(batch: StepBatch, *, occupied: np.ndarray, tables, cp=(1, 0, 1),
              max_num_tokens: int, max_writes: int, pad_to: Optional[int], next_n: int,
              level: str = "safe") -> StepPlan:
    """Check ``batch`` against the pipeline state; return the plan or raise ``ValueError``.

    Parameters
    ----------
    occupied : bool ``[num_slots]`` slots holding a request before the step.
    tables : the pipeline's :class:`BlockTables` (geometry and block counts; read only).
    cp : (world, rank, interleave) of the sharded groups.
    max_num_tokens, max_writes : capacities (tokens per step, staged ids per step).
    pad_to : padded token count or None.
    next_n : query tokens of a decode row (``1 + num_speculative_tokens``): a row with
        ``1 <= q <= next_n`` tokens is a decode.
    level : ``"safe"`` or ``"full"``.
    """
    if not isinstance(batch, StepBatch):
        raise ValueError(f"step must be a StepInput or a StepBatch, got {type(batch).__name__}")
    num_slots = occupied.shape[0]
    slots, nc, q, is_new, free, occ, new_slots = _rows(batch, occupied, tables.max_model_len, max_num_tokens)
    order, nd, T, T_pad = _order(q, max_num_tokens, pad_to, next_n)
    if order is None:
        b_slots, b_q, b_nc, b_new = slots, q, nc, is_new
    else:
        b_slots, b_q, b_nc, b_new = slots[order], q[order], nc[order], is_new[order]
    seq = b_nc + b_q
    rs, re = _replay(batch, order, b_slots, b_nc, slots.shape[0])
    runs = check_runs(batch, num_slots, len(tables.groups), occ, new_slots, tables)
    w_gid, w_slot, w_start, w_end, w_cu, w_ids = runs
    w_keep, w_row = _coverage(tables, cp, b_slots, b_new, b_nc, seq, rs, runs, num_slots)
    if w_gid.size and int(w_cu[-1]) > max_writes:
        w_keep = _staged(tables, w_gid, w_end, w_keep, w_cu, max_writes)
    plan = object.__new__(StepPlan)  # NOTE: a template fill, not a 28-keyword dataclass call
    plan.__dict__.update(
        rows=np.arange(slots.shape[0]) if order is None else order, slots=b_slots, num_scheduled=b_q,
        seq_lens=seq, replay_start=rs, replay_end=re, num_decodes=nd,
        num_decode_tokens=int(b_q[:nd].sum()) if nd else 0, num_tokens=T, num_tokens_padded=int(T_pad),
        free_slots=free, new_slots=new_slots, all_slots=slots, all_computed=nc, w_gid=w_gid, w_slot=w_slot,
        w_start=w_start, w_end=w_end, w_keep=w_keep, w_cu=w_cu, w_ids=w_ids, w_row=w_row, w_key=None,
        w_other=None, w_app=None, steady=False)
    if level == "full":
        raw_cu = np.asarray(batch.write_cu, dtype=np.int64) if w_gid.size else w_cu
        full_checks(tables, plan, cp, raw_cu)
    return plan


def _rows(batch: StepBatch, occupied: np.ndarray, max_model_len: int, max_num_tokens: int):
    """The rows and freed slots, checked: ``(req_slots, nc, q, is_new, free, occ after, new slots)``."""
    num_slots = occupied.shape[0]
    req_slots = arr("req_slots", batch.req_slots)
    n_rows = req_slots.shape[0]
    nc = arr("num_computed_tokens", batch.num_computed_tokens, n_rows)
    q = arr("num_scheduled_tokens", batch.num_scheduled_tokens, n_rows)
    is_new = (np.zeros(n_rows, dtype=bool) if batch.is_new is None
              else arr("is_new", batch.is_new, n_rows, dtype_kind="b"))
    free = _EMPTY if batch.free_slots is None else arr("free_slots", batch.free_slots)
    if n_rows:
        in_range("req_slots", req_slots, num_slots, "a slot")
        check_counts(nc, q, max_model_len, max_num_tokens)
        if not seen_distinct(req_slots, num_slots):
            count = np.bincount(req_slots, minlength=num_slots)  # NOTE: only for the message
            s = int(np.argmax(count))
            raise ValueError(f"req_slots: slot {s} appears in {int(count[s])} batch rows")
    occ = occupied.copy()
    if free.size:
        in_range("free_slots", free, num_slots, "a slot")
        if not seen_distinct(free, num_slots):
            raise ValueError("free_slots lists a slot twice")
        held = occ.take(free)
        if np.count_nonzero(held) != free.shape[0]:
            i = first(~held)
            raise ValueError(f"free_slots[{i}] = {int(free[i])} does not hold a request")
        occ[free] = False
    if n_rows:
        bad = occ.take(req_slots) == is_new
        if np.count_nonzero(bad):
            i = first(bad)
            if is_new[i]:
                raise ValueError(f"req_slots[{i}] = {int(req_slots[i])} is new but still holds a request "
                                 f"(free it first)")
            raise ValueError(f"req_slots[{i}] = {int(req_slots[i])} holds no request (mark it is_new)")
    new_slots = req_slots[is_new]
    occ[new_slots] = True
    return req_slots, nc, q, is_new, free, occ, new_slots


def _order(q: np.ndarray, max_num_tokens: int, pad_to, next_n: int):
    """The device batch: rows with tokens, decode first (stable): ``(order or None, num_decodes, T, T_pad)``."""
    n_rows = q.shape[0]
    T = int(q.sum()) if n_rows else 0
    if T > max_num_tokens:
        raise ValueError(f"num_scheduled_tokens: the step schedules {T} tokens, more than "
                         f"max_num_batched_tokens = {max_num_tokens}")
    T_pad = T if pad_to is None else pad_to
    if isinstance(T_pad, bool) or not isinstance(T_pad, (int, np.integer)) or not T <= T_pad <= max_num_tokens:
        raise ValueError(f"pad_to must be an int in [{T}, {max_num_tokens}], got {pad_to!r}")
    if not n_rows:
        return None, 0, T, T_pad
    qmin, qmax = q.item(q.argmin()), q.item(q.argmax())
    if qmin > 0 and qmax <= next_n:
        return None, n_rows, T, T_pad
    dec = q <= next_n
    order = None
    if qmin == 0:
        live = np.flatnonzero(q > 0)
        order = np.concatenate([live[dec[live]], live[~dec[live]]])
    else:
        k = int(np.argmin(dec))  # NOTE: first prefill row (0 when every row is a decode)
        if not dec[k] and np.count_nonzero(dec[k:]):
            order = np.concatenate([np.flatnonzero(dec), np.flatnonzero(~dec)])
    b_q = q if order is None else q[order]
    return order, np.count_nonzero(b_q <= next_n) if b_q.shape[0] else 0, T, T_pad


def _replay(batch: StepBatch, order, b_slots, b_nc, n_rows: int):
    """Replay bounds in device order, checked: ``(replay_start or None, replay_end or None)``."""
    rs = re = None
    B = b_slots.shape[0]
    if batch.replay_start is not None:
        rs = arr("replay_start", batch.replay_start, n_rows)
        rs = rs if order is None else rs[order]
        if B and (rs.min() < 0 or (rs > b_nc).any()):
            i = first((rs < 0) | (rs > b_nc))
            raise ValueError(f"replay_start of slot {int(b_slots[i])} = {int(rs[i])} is outside "
                             f"[0, num_computed_tokens = {int(b_nc[i])}]")
    if batch.replay_end is not None:
        re = arr("replay_end", batch.replay_end, n_rows)
        re = re if order is None else re[order]
        if B and re.min() < 0:
            i = first(re < 0)
            raise ValueError(f"replay_end of slot {int(b_slots[i])} = {int(re[i])} is negative")
        if B and re.max() > INT32_MAX:  # NOTE: staged as int32: a wrapped value would let replayed
            i = first(re > INT32_MAX)  # tokens overwrite prefix-shared full-group KV
            raise ValueError(f"replay_end of slot {int(b_slots[i])} = {int(re[i])} does not fit int32")
    return rs, re


def _coverage(tables, cp, b_slots, b_new, b_nc, seq, rs, runs, num_slots: int):
    """Coverage of every scheduled token in every group, ring tables holding what a step reads, circular
    groups holding their ring; ``(w_keep, w_row)`` (ring runs trimmed to the blocks still read)."""
    w_gid, w_slot, w_start, w_end, _, _ = runs
    B, G = b_slots.shape[0], len(tables.groups)
    if not (B and G):
        return w_start, (_EMPTY if not w_gid.size else np.full(w_gid.shape[0], -1, dtype=np.int64))
    nb = tables.num_blocks[:, b_slots]
    if np.count_nonzero(b_new):
        nb[:, b_new] = 0
    r = m = None
    if w_gid.size:
        row_of = _row_map(num_slots)
        row_of[b_slots] = np.arange(B)
        r = row_of.take(w_slot)
        row_of[b_slots] = -1
        m = r >= 0
        nb[w_gid[m], r[m]] = w_end[m]
    sharded = tables.sharded & (cp[0] > 1)
    _covered(tables, cp, sharded, nb, seq, b_slots)
    w_keep = w_start
    rg = tables.ring_groups
    if rg.size:
        # NOTE: the lowest block a row reads from now on: its first token's window start
        start = window_start(b_nc[None, :], tables.window[rg, None], None if rs is None else rs[None, :])
        if sharded[rg].any():
            start[sharded[rg]] = cp_owned(start[sharded[rg]], cp)
        lo = start // tables.bs[rg, None]
        over = nb[rg] - lo > tables.ring[rg, None]
        if np.count_nonzero(over):
            j, i = (int(x) for x in np.argwhere(over)[0])
            g = int(rg[j])
            raise ValueError(f"gid {g} ({tables.groups[g].name}) is a ring of {int(tables.ring[g])} blocks, "
                             f"but slot {int(b_slots[i])} holds blocks up to {int(nb[g, i])} and reads "
                             f"from block {int(lo[j, i])} this step")
        if w_gid.size:
            ring_run = (tables.ring[w_gid] > 0) & ~tables.circular[w_gid]
            if np.count_nonzero(ring_run):
                assert r is not None and m is not None  # NOTE: set above whenever w_gid.size
                gpos = np.full(G, -1, dtype=np.int64)
                gpos[rg] = np.arange(rg.size)
                w_keep = np.maximum(w_start, np.where(ring_run, w_end - tables.ring[w_gid], 0))
                sel = ring_run & m
                w_keep[sel] = np.maximum(w_keep[sel], lo[gpos[w_gid[sel]], r[sel]])
    # NOTE: circular groups take any chunk (vLLM's ring): window reads before the chunk start come from
    # the ring, those inside it from the step's own rows; only each request's last `capacity` tokens write
    return w_keep, (_EMPTY if r is None else r)


def _covered(tables, cp, sharded, nb, seq, b_slots) -> None:
    """Every scheduled token's block present in every group (``nb``: blocks after the step's runs)."""
    G = nb.shape[0]
    bs = tables.bs[:, None]
    if sharded.any():
        local = np.repeat(seq[None, :], G, axis=0)
        local[sharded] = cp_owned(seq, cp)
        need = (local + bs - 1) // bs
        # NOTE: under DCP a rank's compressed rows may need more blocks than its raw tokens
        for g, ratio, S in tables.compressed:
            if sharded[g]:
                need[g] = np.maximum(need[g], -(-cp_owned(seq // ratio, cp) // S))
        if tables.circular.any():
            need[tables.circular] = (seq > 0) * tables.logical[tables.circular, None]
        short = nb < need
    else:
        # NOTE: nb < cdiv(seq, bs) <=> nb * bs < seq (no division over G x B; `need` only for the message)
        need = None
        short = nb * bs < seq[None, :]
        if tables.circular.any():
            short[tables.circular] = nb[tables.circular] < (seq > 0) * tables.logical[tables.circular, None]
    if np.count_nonzero(short):
        if need is None:
            need = (seq[None, :] + bs - 1) // bs
            need[tables.circular] = (seq > 0) * tables.logical[tables.circular, None]
        g, i = (int(x) for x in np.argwhere(short)[0])
        raise ValueError(f"block ids missing for gid {g} ({tables.groups[g].name}) of slot "
                         f"{int(b_slots[i])}: {int(seq[i])} tokens need {int(need[g, i])} blocks, "
                         f"the row has {int(nb[g, i])}")


def _staged(tables, w_gid, w_end, w_keep, w_cu, max_writes: int) -> np.ndarray:
    """The ids a step stages (after ring trimming, every ring group's runs: the new ``w_keep``) fit
    the staging buffer."""
    ring_run = tables.ring[w_gid] > 0
    if ring_run.any():
        w_keep = np.maximum(w_keep, np.where(ring_run, w_end - tables.ring[w_gid], 0))
    staged = int(np.minimum(w_end - w_keep, np.diff(w_cu)).clip(min=0).sum())
    if staged > max_writes:
        raise ValueError(f"write_ids: the step stages {staged} block ids, more than "
                         f"max_staged_blocks = {max_writes}")
    return w_keep
