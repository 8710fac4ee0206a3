"""Every check of one step, before anything changes: :func:`plan_step` turns a :class:`StepBatch`
into a :class:`StepPlan` or raises ``ValueError`` naming the culprit.

Check levels (DESIGN §5):

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
from typing import Optional

import numpy as np

from .._common import INT32_MAX
from ..batch import APPEND, StepBatch
from .contract import full_checks
from .tables import BlockTables

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


def _arr(name: str, x, n: Optional[int] = None, *, dtype_kind="iu") -> np.ndarray:
    if type(x) is np.ndarray and x.ndim == 1 and (n is None or x.shape[0] == n) and \
            (x.dtype == np.int64 if dtype_kind == "iu" else x.dtype == np.bool_):
        return x  # NOTE: fast path (the array form's native dtypes)
    if type(x) is not np.ndarray:
        try:
            x = np.asarray(x)
        except Exception:
            raise ValueError(f"{name} must be a 1-D integer array, got {type(x).__name__}") from None
        if x.size == 0:
            x = x.astype(np.int64)
    if x.ndim != 1 or x.dtype.kind not in dtype_kind:
        raise ValueError(f"{name} must be a 1-D {'bool' if dtype_kind == 'b' else 'integer'} array, "
                         f"got dtype {x.dtype} and shape {x.shape}")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} has {x.shape[0]} entries, expected {n}")
    return x.astype(np.int64, copy=False) if dtype_kind == "iu" else x


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _in_range(name: str, x: np.ndarray, hi: int, what: str) -> None:
    """``0 <= x < hi`` (one pass: negatives wrap to huge unsigned values)."""
    if x.size and int(x.view(np.uint64).max()) >= hi:
        i = _first((x < 0) | (x >= hi))
        raise ValueError(f"{name}[{i}] = {int(x[i])} is not {what} in [0, {hi})")


def _check_counts(nc: np.ndarray, q: np.ndarray, max_model_len: int, max_num_tokens: int) -> None:
    """Bound every count before any sum or product (no int64 wrap can pass a later check).

    ``0 <= num_computed_tokens <= max_model_len`` and ``0 <= num_scheduled_tokens <= max_num_tokens``
    elementwise (one unsigned max each: negatives view as huge); then ``seq_lens`` and ``T`` fit
    easily in int64 (rows <= max_num_reqs).
    """
    for name, x in (("num_computed_tokens", nc), ("num_scheduled_tokens", q)):
        if int(x.min()) < 0:
            i = _first(x < 0)
            raise ValueError(f"{name}[{i}] = {int(x[i])} is negative")
    if int(nc.view(np.uint64).max()) > max_model_len:
        i = _first(nc > max_model_len)
        raise ValueError(f"num_computed_tokens[{i}] = {int(nc[i])} is beyond max_model_len = {max_model_len}")
    if int(q.view(np.uint64).max()) > max_num_tokens:
        total = sum(q.tolist())  # NOTE: Python ints: exact, no wrap
        raise ValueError(f"num_scheduled_tokens: the step schedules {total} tokens, more than "
                         f"max_num_batched_tokens = {max_num_tokens}")


def _owned(n: np.ndarray, cp) -> np.ndarray:
    world, rank, inter = cp
    cycle = inter * world
    return (n // cycle) * inter + np.clip(n % cycle - rank * inter, 0, inter)


def plan_step(batch: StepBatch, *, occupied: np.ndarray, tables: BlockTables, cp=(1, 0, 1),
              max_num_tokens: int, max_writes: int, pad_to: Optional[int], decode_threshold: int,
              level: str = "safe") -> StepPlan:
    """Check ``batch`` against the pipeline state; return the plan or raise ``ValueError``.

    Parameters
    ----------
    occupied : bool ``[num_slots]`` slots holding a request before the step.
    tables : the pipeline's :class:`BlockTables` (geometry and block counts; read only).
    cp : (world, rank, interleave) of the sharded groups.
    max_num_tokens, max_writes : capacities (tokens per step, staged ids per step).
    pad_to : padded token count or None.
    decode_threshold : a row with ``1 <= q <= decode_threshold`` tokens is a decode.
    level : ``"safe"`` or ``"full"``.
    """
    if not isinstance(batch, StepBatch):
        raise ValueError(f"step must be a StepInput or a StepBatch, got {type(batch).__name__}")
    num_slots = occupied.shape[0]
    G = len(tables.groups)
    slots = _arr("req_slots", batch.req_slots)
    n_rows = slots.shape[0]
    nc = _arr("num_computed_tokens", batch.num_computed_tokens, n_rows)
    q = _arr("num_scheduled_tokens", batch.num_scheduled_tokens, n_rows)
    is_new = (np.zeros(n_rows, dtype=bool) if batch.is_new is None
              else _arr("is_new", batch.is_new, n_rows, dtype_kind="b"))
    free = _EMPTY if batch.free_slots is None else _arr("free_slots", batch.free_slots)
    if n_rows:
        _in_range("req_slots", slots, num_slots, "a slot")
        _check_counts(nc, q, tables.max_model_len, max_num_tokens)
        count = np.bincount(slots, minlength=num_slots)
        if count.max() > 1:
            s = int(np.argmax(count))
            raise ValueError(f"req_slots: slot {s} appears in {int(count[s])} batch rows")
    # -- slots freed, then taken ------------------------------------------------------------
    occ = occupied.copy()
    if free.size:
        _in_range("free_slots", free, num_slots, "a slot")
        if np.bincount(free, minlength=num_slots).max() > 1:
            raise ValueError("free_slots lists a slot twice")
        if not occ[free].all():
            i = _first(~occ[free])
            raise ValueError(f"free_slots[{i}] = {int(free[i])} does not hold a request")
        occ[free] = False
    if n_rows:
        bad = occ[slots] == is_new
        if bad.any():
            i = _first(bad)
            if is_new[i]:
                raise ValueError(f"req_slots[{i}] = {int(slots[i])} is new but still holds a request "
                                 f"(free it first)")
            raise ValueError(f"req_slots[{i}] = {int(slots[i])} holds no request (mark it is_new)")
    new_slots = slots[is_new]
    occ[new_slots] = True
    # -- device batch: rows with tokens, decode first (stable) --------------------------------
    T = int(q.sum()) if n_rows else 0
    if T > max_num_tokens:
        raise ValueError(f"num_scheduled_tokens: the step schedules {T} tokens, more than "
                         f"max_num_batched_tokens = {max_num_tokens}")
    T_pad = T if pad_to is None else pad_to
    if isinstance(T_pad, bool) or not isinstance(T_pad, (int, np.integer)) or not T <= T_pad <= max_num_tokens:
        raise ValueError(f"pad_to must be an int in [{T}, {max_num_tokens}], got {pad_to!r}")
    order = None
    all_decode = False
    if n_rows:
        qmin, qmax = int(q.min()), int(q.max())
        all_decode = qmin > 0 and qmax <= decode_threshold
        if not all_decode:
            dec = q <= decode_threshold
            if qmin == 0:
                live = np.flatnonzero(q > 0)
                order = np.concatenate([live[dec[live]], live[~dec[live]]])
            else:
                k = int(np.argmin(dec))  # NOTE: first prefill row (0 when every row is a decode)
                if not dec[k] and dec[k:].any():
                    order = np.concatenate([np.flatnonzero(dec), np.flatnonzero(~dec)])
    if order is None:
        b_slots, b_q, b_nc, b_new = slots, q, nc, is_new
    else:
        b_slots, b_q, b_nc, b_new = slots[order], q[order], nc[order], is_new[order]
    B = b_slots.shape[0]
    nd = B if all_decode else (int((b_q <= decode_threshold).sum()) if B else 0)
    seq = b_nc + b_q
    rs = re = None
    if batch.replay_start is not None:
        rs = _arr("replay_start", batch.replay_start, n_rows)
        rs = rs if order is None else rs[order]
        if B and (rs.min() < 0 or (rs > b_nc).any()):
            i = _first((rs < 0) | (rs > b_nc))
            raise ValueError(f"replay_start of slot {int(b_slots[i])} = {int(rs[i])} is outside "
                             f"[0, num_computed_tokens = {int(b_nc[i])}]")
    if batch.replay_end is not None:
        re = _arr("replay_end", batch.replay_end, n_rows)
        re = re if order is None else re[order]
        if B and re.min() < 0:
            i = _first(re < 0)
            raise ValueError(f"replay_end of slot {int(b_slots[i])} = {int(re[i])} is negative")
        if B and re.max() > INT32_MAX:  # NOTE: staged as int32: a wrapped value would let replayed
            i = _first(re > INT32_MAX)  # tokens overwrite prefix-shared full-group KV
            raise ValueError(f"replay_end of slot {int(b_slots[i])} = {int(re[i])} does not fit int32")
    # -- write runs ---------------------------------------------------------------------------
    w_gid, w_slot, w_start, w_end, w_cu, w_ids = _runs(batch, num_slots, G, occ, new_slots, tables)
    w_keep = w_start
    # -- coverage, rings, circular groups (per group x batch row) -----------------------------
    if B and G:
        nb = tables.num_blocks[:, b_slots]
        if b_new.any():
            nb = nb.copy()
            nb[:, b_new] = 0
        row_of = None
        if w_gid.size:
            row_of = np.full(num_slots, -1, dtype=np.int64)
            row_of[b_slots] = np.arange(B)
            r = row_of[w_slot]
            m = r >= 0
            nb = nb.copy() if nb.base is tables.num_blocks else nb
            nb[w_gid[m], r[m]] = w_end[m]
        sharded = tables.sharded & (cp[0] > 1)
        bs = tables.bs[:, None]
        if sharded.any():
            local = np.repeat(seq[None, :], G, axis=0)
            local[sharded] = _owned(seq, cp)
            need = (local + bs - 1) // bs
            # NOTE: under DCP a rank's compressed rows may need more blocks than its raw tokens
            for g, ratio, S in tables.compressed:
                if sharded[g]:
                    need[g] = np.maximum(need[g], -(-_owned(seq // ratio, cp) // S))
            if tables.circular.any():
                need[tables.circular] = (seq > 0) * tables.logical[tables.circular, None]
            short = nb < need
        else:
            # NOTE: nb < cdiv(seq, bs) <=> nb * bs < seq (no division over G x B; `need` only for the message)
            need = None
            short = nb * bs < seq[None, :]
            if tables.circular.any():
                short[tables.circular] = nb[tables.circular] < (seq > 0) * tables.logical[tables.circular, None]
        if short.any():
            if need is None:
                need = (seq[None, :] + bs - 1) // bs
                need[tables.circular] = (seq > 0) * tables.logical[tables.circular, None]
            g, i = (int(x) for x in np.argwhere(short)[0])
            raise ValueError(f"block ids missing for gid {g} ({tables.groups[g].name}) of slot "
                             f"{int(b_slots[i])}: {int(seq[i])} tokens need {int(need[g, i])} blocks, "
                             f"the row has {int(nb[g, i])}")
        rg = tables.ring_groups
        if rg.size:
            # NOTE: the lowest block a row reads from now on: its first token's window start
            start = np.maximum(b_nc[None, :] - tables.window[rg, None] + 1, 0)
            if rs is not None:
                start = np.maximum(start, rs[None, :])
            if sharded[rg].any():
                start[sharded[rg]] = _owned(start[sharded[rg]], cp)
            lo = start // tables.bs[rg, None]
            over = nb[rg] - lo > tables.ring[rg, None]
            if over.any():
                j, i = (int(x) for x in np.argwhere(over)[0])
                g = int(rg[j])
                raise ValueError(f"gid {g} ({tables.groups[g].name}) is a ring of {int(tables.ring[g])} blocks, "
                                 f"but slot {int(b_slots[i])} holds blocks up to {int(nb[g, i])} and reads "
                                 f"from block {int(lo[j, i])} this step")
            if w_gid.size:
                ring_run = (tables.ring[w_gid] > 0) & ~tables.circular[w_gid]
                if ring_run.any():
                    gpos = np.full(G, -1, dtype=np.int64)
                    gpos[rg] = np.arange(rg.size)
                    w_keep = np.maximum(w_start, np.where(ring_run, w_end - tables.ring[w_gid], 0))
                    sel = ring_run & m
                    w_keep[sel] = np.maximum(w_keep[sel], lo[gpos[w_gid[sel]], r[sel]])
        # NOTE: circular groups take any chunk (vLLM's ring): window reads before the chunk start come from
        # the ring, those inside it from the step's own rows; only each request's last `capacity` tokens write
    if not w_gid.size:
        w_row = _EMPTY
    elif B and G:
        w_row = r
    else:
        w_row = np.full(w_gid.shape[0], -1, dtype=np.int64)
    if w_gid.size and int(w_cu[-1]) > max_writes:
        ring_run = tables.ring[w_gid] > 0
        if ring_run.any():
            w_keep = np.maximum(w_keep, np.where(ring_run, w_end - tables.ring[w_gid], 0))
        staged = int(np.minimum(w_end - w_keep, np.diff(w_cu)).clip(min=0).sum())
        if staged > max_writes:
            raise ValueError(f"write_ids: the step stages {staged} block ids, more than "
                             f"max_staged_blocks = {max_writes}")
    plan = StepPlan(
        rows=np.arange(n_rows) if order is None else order, slots=b_slots, num_scheduled=b_q,
        seq_lens=seq, replay_start=rs, replay_end=re, num_decodes=nd,
        num_decode_tokens=int(b_q[:nd].sum()) if nd else 0, num_tokens=T, num_tokens_padded=int(T_pad),
        free_slots=free, new_slots=new_slots, all_slots=slots, all_computed=nc,
        w_gid=w_gid, w_slot=w_slot, w_start=w_start, w_end=w_end, w_keep=w_keep, w_cu=w_cu, w_ids=w_ids,
        w_row=w_row)
    if level == "full":
        raw_cu = np.asarray(batch.write_cu, dtype=np.int64) if w_gid.size else w_cu
        full_checks(tables, plan, cp, raw_cu)
    return plan


def _runs(batch: StepBatch, num_slots: int, G: int, occ: np.ndarray, new_slots: np.ndarray, tables: BlockTables):
    """Validated kernel-block write runs: (gid, slot, start, end, cu, ids), int64."""
    if batch.write_gids is None or len(batch.write_gids) == 0:
        return _EMPTY, _EMPTY, _EMPTY, _EMPTY, np.zeros(1, dtype=np.int64), _EMPTY
    gid = _arr("write_gids", batch.write_gids)
    N = gid.shape[0]
    slot = _arr("write_slots", batch.write_slots, N)
    start = _arr("write_starts", batch.write_starts, N)
    cu = _arr("write_cu", batch.write_cu, N + 1)
    ids = _arr("write_ids", batch.write_ids)
    _in_range("write_gids", gid, G, "a group")
    _in_range("write_slots", slot, num_slots, "a slot")
    if not occ[slot].all():
        i = _first(~occ[slot])
        raise ValueError(f"write_slots[{i}] = {int(slot[i])} holds no request after this step")
    # NOTE: bound cu before differencing it (huge values would wrap the differences)
    if cu[0] != 0 or cu[-1] != ids.shape[0] or int(cu.view(np.uint64).max()) > ids.shape[0]:
        raise ValueError(f"write_cu must rise from 0 to len(write_ids) = {ids.shape[0]}")
    n = cu[1:] - cu[:-1]
    if (n < 0).any():
        raise ValueError(f"write_cu must rise from 0 to len(write_ids) = {ids.shape[0]}")
    key = gid * num_slots + slot
    if N > 1:
        k = np.sort(key)
        dup = k[1:] == k[:-1]
        if dup.any():
            kk = int(k[1:][dup][0])
            raise ValueError(f"two write runs for gid {kk // num_slots}, slot {kk % num_slots} "
                             f"(one run per (group, slot))")
    have = tables.num_blocks[gid, slot]                  # kernel blocks held now
    if new_slots.size:
        fresh = np.zeros(num_slots, dtype=bool)
        fresh[new_slots] = True
        have = np.where(fresh[slot], 0, have)
    # NOTE: the hole check runs in allocation blocks, before any product (start * f could wrap)
    f = tables.f[gid] if tables.fmax > 1 else None
    hole = (start < APPEND) | (start > (have if f is None else have // f))
    if hole.any():
        i = _first(hole)
        raise ValueError(f"write_starts[{i}] = {int(start[i])} leaves a hole: gid {int(gid[i])} of slot "
                         f"{int(slot[i])} holds {int(have[i] // tables.f[gid[i]])} blocks")
    if f is None:
        start_k = np.where(start == APPEND, have, start)
        end_k = start_k + n
    else:
        start_k = np.where(start == APPEND, have, start * f)
        end_k = start_k + n * f
    over = end_k > tables.logical[gid]
    if over.any():
        i = _first(over)
        g = tables.groups[int(gid[i])]
        raise ValueError(f"write run {i}: slot {int(slot[i])} would hold {int(end_k[i])} blocks in gid "
                         f"{g.gid} ({g.name}), the table holds {int(tables.logical[gid[i]])} "
                         f"({'the circular ring' if g.kind == 'circular' else 'max_model_len'})")
    if ids.size:
        fmax = tables.fmax
        if int(ids.view(np.uint64).max()) * fmax + fmax - 1 > tables.id_max_min:
            if ids.min() < 0:
                raise ValueError(f"write_ids[{_first(ids < 0)}] = {int(ids[ids < 0][0])} is negative")
            per = np.repeat(gid, n)
            lim = (tables.id_max[per] - (tables.f[per] - 1)) // tables.f[per]
            bad = ids > lim
            if bad.any():
                j = _first(bad)
                g = int(per[j])
                raise ValueError(f"write_ids[{j}] = {int(ids[j])} in gid {g} ({tables.groups[g].name}) "
                                 f"gives slots beyond int32 (largest id {int(lim[j])})")
    # NOTE: start_k is already in kernel blocks; expand() only turns the ids into kernel-block ids
    _, cu_k, ids_k = tables.expand(gid, start_k // tables.f[gid], cu, ids)
    return gid, slot, start_k, end_k, cu_k, ids_k

