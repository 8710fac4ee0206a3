# over 400 lines: the definition of every step check (safe and full) in one place, read top to bottom
"""The step checks by their definition, whole-step numpy (docs/DESIGN.md §5): :func:`plan_step` is the
planner the compiled pass (:mod:`.kernel`) must equal, plan for plan and message for message
(``validate=True`` runs both on every step; ``tests/state/test_planners.py`` compares them on randomized
streams). Also the array conversions (:func:`arr`) the pass's wrapper uses, and ``checks="full"``.

Check levels:

* ``"safe"`` (always): what keeps memory and other requests' KV intact — array shapes and integer
  dtypes; slots in range, distinct, occupied (new rows: free); counts ``>= 0``; capacities (rows,
  tokens, staged ids); write runs: group and slot in range, one per (group, slot), no hole before
  the run, inside the logical width, ids ``>= 0`` and small enough that every slot fits int32;
  every scheduled token's blocks present (coverage) in every group; ring tables holding the blocks a
  step reads; circular groups holding a step's tokens (all ``capacity // block_size`` blocks of the
  ring); replay bounds.
* ``"full"`` (``validate=True`` or ``checks="full"``): :func:`full_checks` —

* **no null block where a step reads or writes.** The null block (allocation id 0, the scheduler's
  placeholder; kernel ids ``0 .. f - 1`` under hybrid blocks) may stand only for blocks nobody reads:
  in a sliding group, blocks wholly before the window of the row's first token
  (``max(num_computed - W + 1, replay_start)``, as vLLM frees them behind the window); never in a
  full group (every block is read by the compressed / causal lists) nor in a circular one (its ring
  blocks are read and written every step). Checked on the ids a step writes and, for the rows of the
  step, on the sliding blocks they already hold from the window start on (a row's stale held ids are
  in the host mirror);
* **no id twice in a row** of a full or circular group (nor an id the row already holds);
* **no ring block of a circular group in two live rows** (both requests would write it), checked on
  the steps that write a circular group.

Errors are one line naming the slot (and batch row), the group (gid, name, role), the block column
and its positions, and where the id came from (``write_ids[j]``: the id-keyed front end names the
request's field from it; or held since an earlier step).
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ..._common import INT32_MAX
from ...batch import APPEND, StepBatch
from .._index import cp_owned, window_start
from ..messages import reject
from ..plan import StepPlan

__all__ = ["plan_step", "full_checks", "null_block_message", "arr"]


# ----------------------------------------------------------------------------------------------
# arrays and write runs
# ----------------------------------------------------------------------------------------------
_EMPTY = np.zeros(0, dtype=np.int64)
_U64 = np.dtype(np.uint64)
_SEEN: Dict[int, np.ndarray] = {}


def umax(x: np.ndarray) -> int:
    """Largest entry as unsigned (negatives view as huge): argmax + item, no numpy wrapper."""
    u = x.view(_U64)
    return u.item(u.argmax())


def seen_distinct(x: np.ndarray, size: int) -> bool:
    """True when the entries of ``x`` (all in ``[0, size)``) are distinct (a seen-mask, no sort)."""
    seen = _SEEN.get(size)
    if seen is None:
        seen = _SEEN[size] = np.zeros(size, dtype=bool)
    seen[x] = True
    n = np.count_nonzero(seen)
    seen[x] = False
    return n == x.shape[0]


def arr(name: str, x, n: Optional[int] = None, *, dtype_kind="iu") -> np.ndarray:
    if type(x) is np.ndarray and x.ndim == 1 and (n is None or x.shape[0] == n) and \
            (x.dtype == np.int64 if dtype_kind == "iu" else x.dtype == np.bool_) and x.flags.c_contiguous:
        return x  # NOTE: fast path (the array form's native dtypes; contiguous: one compiled signature)
    if type(x) is not np.ndarray:
        try:
            x = np.asarray(x)
        except Exception:
            raise reject("not_array", name=name, type=type(x).__name__) from None
        if x.size == 0:
            x = x.astype(np.int64)
    if x.ndim != 1 or x.dtype.kind not in dtype_kind:
        raise reject("bad_dtype", name=name, kind='bool' if dtype_kind == 'b' else 'integer', dtype=x.dtype,
                     shape=x.shape)
    if n is not None and x.shape[0] != n:
        raise reject("bad_length", name=name, n=x.shape[0], expected=n)
    return np.ascontiguousarray(x, dtype=np.int64 if dtype_kind == "iu" else np.bool_)


def first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def in_range(name: str, x: np.ndarray, hi: int, what: str) -> None:
    """``0 <= x < hi`` (one pass: negatives wrap to huge unsigned values)."""
    if x.size and umax(x) >= hi:
        i = first((x < 0) | (x >= hi))
        raise reject("out_of_range", name=name, i=i, value=int(x[i]), what=what, hi=hi)


def check_counts(nc: np.ndarray, q: np.ndarray, max_model_len: int, max_num_tokens: int) -> None:
    """Bound every count before any sum or product (no int64 wrap can pass a later check).

    ``0 <= num_computed_tokens <= max_model_len`` and ``0 <= num_scheduled_tokens <= max_num_tokens``
    elementwise (one unsigned max each: negatives view as huge); then ``seq_lens`` and ``T`` fit
    easily in int64 (rows <= max_num_reqs).
    """
    for name, x in (("num_computed_tokens", nc), ("num_scheduled_tokens", q)):
        if x.item(x.argmin()) < 0:
            i = first(x < 0)
            raise reject("negative", name=name, i=i, value=int(x[i]))
    if umax(nc) > max_model_len:
        i = first(nc > max_model_len)
        raise reject("beyond_model_len", i=i, value=int(nc[i]), limit=max_model_len)
    if umax(q) > max_num_tokens:
        total = sum(q.tolist())  # NOTE: Python ints: exact, no wrap
        raise reject("too_many_tokens", total=total, limit=max_num_tokens)


def check_runs(batch: StepBatch, num_slots: int, G: int, occ: np.ndarray, new_slots: np.ndarray, tables):
    """Validated kernel-block write runs: (gid, slot, start, end, cu, ids), int64."""
    if batch.write_gids is None or len(batch.write_gids) == 0:
        return _EMPTY, _EMPTY, _EMPTY, _EMPTY, np.zeros(1, dtype=np.int64), _EMPTY
    gid = arr("write_gids", batch.write_gids)
    N = gid.shape[0]
    slot = arr("write_slots", batch.write_slots, N)
    start = arr("write_starts", batch.write_starts, N)
    cu = arr("write_cu", batch.write_cu, N + 1)
    ids = arr("write_ids", batch.write_ids)
    in_range("write_gids", gid, G, "a group")
    in_range("write_slots", slot, num_slots, "a slot")
    held = occ.take(slot)
    if np.count_nonzero(held) != N:
        i = first(~held)
        raise reject("write_slot_free", i=i, value=int(slot[i]))
    # NOTE: bound cu before differencing it (huge values would wrap the differences)
    if cu[0] != 0 or cu[-1] != ids.shape[0] or umax(cu) > ids.shape[0]:
        raise reject("write_cu", n=ids.shape[0])
    n = cu[1:] - cu[:-1]
    if n.item(n.argmin()) < 0:
        raise reject("write_cu", n=ids.shape[0])
    key = gid * num_slots + slot
    if N > 1 and not seen_distinct(key, G * num_slots):
        k = np.sort(key)  # NOTE: only for the message
        dup = k[1:] == k[:-1]
        if dup.any():
            kk = int(k[1:][dup][0])
            raise reject("two_runs", g=kk // num_slots, slot=kk % num_slots)
    have = tables.num_blocks.ravel().take(key)           # kernel blocks held now
    if new_slots.size:
        fresh = np.zeros(num_slots, dtype=bool)
        fresh[new_slots] = True
        have = np.where(fresh[slot], 0, have)
    # NOTE: the hole check runs in allocation blocks, before any product (start * f could wrap)
    f = tables.f[gid] if tables.fmax > 1 else None
    hole = (start < APPEND) | (start > (have if f is None else have // f))
    if np.count_nonzero(hole):
        i = first(hole)
        raise reject("hole", i=i, value=int(start[i]), g=int(gid[i]), slot=int(slot[i]),
                     have=int(have[i] // tables.f[gid[i]]))
    if f is None:
        start_k = np.where(start == APPEND, have, start)
        end_k = start_k + n
    else:
        start_k = np.where(start == APPEND, have, start * f)
        end_k = start_k + n * f
    over = end_k > tables.logical.take(gid)
    if np.count_nonzero(over):
        i = first(over)
        g = tables.groups[int(gid[i])]
        raise reject("run_too_long", r=i, slot=int(slot[i]), end=int(end_k[i]), g=g.gid, name=g.name,
                     limit=int(tables.logical[gid[i]]),
                     why='the circular ring' if g.kind == 'circular' else 'max_model_len')
    if ids.size:
        fmax = tables.fmax
        if umax(ids) * fmax + fmax - 1 > tables.id_max_min:
            if ids.item(ids.argmin()) < 0:
                raise reject("id_negative", j=first(ids < 0), value=int(ids[ids < 0][0]))
            per = np.repeat(gid, n)
            lim = (tables.id_max[per] - (tables.f[per] - 1)) // tables.f[per]
            bad = ids > lim
            if bad.any():
                j = first(bad)
                g = int(per[j])
                raise reject("id_int32", j=j, value=int(ids[j]), g=g, name=tables.groups[g].name, limit=int(lim[j]))
    # NOTE: start_k is already in kernel blocks; expand() only turns the ids into kernel-block ids
    _, cu_k, ids_k = tables.expand(gid, start_k // tables.f[gid], cu, ids)
    return gid, slot, start_k, end_k, cu_k, ids_k


# ----------------------------------------------------------------------------------------------
# the planner
# ----------------------------------------------------------------------------------------------
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
        raise reject("step_type", type=type(batch).__name__)
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
        w_start=w_start, w_end=w_end, w_keep=w_keep, w_cu=w_cu, w_ids=w_ids, w_row=w_row, drafts=None)
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
            raise reject("slot_twice", slot=s, count=int(count[s]))
    occ = occupied.copy()
    if free.size:
        in_range("free_slots", free, num_slots, "a slot")
        if not seen_distinct(free, num_slots):
            raise reject("free_twice")
        held = occ.take(free)
        if np.count_nonzero(held) != free.shape[0]:
            i = first(~held)
            raise reject("free_not_held", i=i, value=int(free[i]))
        occ[free] = False
    if n_rows:
        bad = occ.take(req_slots) == is_new
        if np.count_nonzero(bad):
            i = first(bad)
            if is_new[i]:
                raise reject("new_held", i=i, value=int(req_slots[i]))
            raise reject("not_held", i=i, value=int(req_slots[i]))
    new_slots = req_slots[is_new]
    occ[new_slots] = True
    return req_slots, nc, q, is_new, free, occ, new_slots


def _order(q: np.ndarray, max_num_tokens: int, pad_to, next_n: int):
    """The device batch: rows with tokens, decode first (stable): ``(order or None, num_decodes, T, T_pad)``."""
    n_rows = q.shape[0]
    T = int(q.sum()) if n_rows else 0
    if T > max_num_tokens:
        raise reject("too_many_tokens", total=T, limit=max_num_tokens)
    T_pad = T if pad_to is None else pad_to
    if isinstance(T_pad, bool) or not isinstance(T_pad, (int, np.integer)) or not T <= T_pad <= max_num_tokens:
        raise reject("pad_to", lo=T, hi=max_num_tokens, pad_to=repr(pad_to))
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
            raise reject("replay_start", slot=int(b_slots[i]), value=int(rs[i]), nc=int(b_nc[i]))
    if batch.replay_end is not None:
        re = arr("replay_end", batch.replay_end, n_rows)
        re = re if order is None else re[order]
        if B and re.min() < 0:
            i = first(re < 0)
            raise reject("replay_end_negative", slot=int(b_slots[i]), value=int(re[i]))
        if B and re.max() > INT32_MAX:  # NOTE: staged as int32: a wrapped value would let replayed
            i = first(re > INT32_MAX)  # tokens overwrite prefix-shared full-group KV
            raise reject("replay_end_int32", slot=int(b_slots[i]), value=int(re[i]))
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
            raise reject("ring_short", g=g, name=tables.groups[g].name, ring=int(tables.ring[g]), slot=int(b_slots[i]),
                         have=int(nb[g, i]), lo=int(lo[j, i]))
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
        raise reject("blocks_missing", g=g, name=tables.groups[g].name, slot=int(b_slots[i]), seq=int(seq[i]),
                     need=int(need[g, i]), have=int(nb[g, i]))


def _staged(tables, w_gid, w_end, w_keep, w_cu, max_writes: int) -> np.ndarray:
    """The ids a step stages (after ring trimming, every ring group's runs: the new ``w_keep``) fit
    the staging buffer."""
    ring_run = tables.ring[w_gid] > 0
    if ring_run.any():
        w_keep = np.maximum(w_keep, np.where(ring_run, w_end - tables.ring[w_gid], 0))
    staged = int(np.minimum(w_end - w_keep, np.diff(w_cu)).clip(min=0).sum())
    if staged > max_writes:
        raise reject("too_many_staged", staged=staged, limit=max_writes)
    return w_keep


# ----------------------------------------------------------------------------------------------
# checks="full"
# ----------------------------------------------------------------------------------------------
def full_checks(tables, plan, cp, write_cu: np.ndarray) -> None:
    """Raise ``ValueError`` when ``plan`` breaks a ``checks="full"`` contract rule (nothing changes).

    Parameters
    ----------
    tables : BlockTables — geometry, block counts and host mirror (read only).
    plan : StepPlan — the checked step (kernel-block write runs, device batch rows).
    cp : (world, rank, interleave) of the sharded groups.
    write_cu : int64 ``[N + 1]`` — the step's ``write_cu`` in allocation ids (names ``write_ids[j]``).
    """
    _null_blocks(tables, plan, cp, write_cu)
    _duplicates(tables, plan)
    _shared_rings(tables, plan)


def _ragged(n: np.ndarray):
    """(owner index, offset) of every entry of ragged lengths ``n``."""
    owner = np.repeat(np.arange(n.shape[0]), n)
    start = np.cumsum(n) - n
    return owner, np.arange(owner.shape[0], dtype=np.int64) - start[owner]


def _null_blocks(tables, plan, cp, write_cu) -> None:
    B = plan.slots.shape[0]
    sliding = ~tables.full & ~tables.circular
    sharded = tables.sharded & (cp[0] > 1)
    # NOTE: the lowest position each (group, batch row) reads: the ring check's formula (plan.py)
    nc = plan.seq_lens - plan.num_scheduled
    lo_pos = window_start(nc[None, :], tables.window[:, None],
                          None if plan.replay_start is None else plan.replay_start[None, :])
    if sharded.any():
        lo_pos[sharded] = cp_owned(lo_pos[sharded], cp)
    lo = lo_pos // tables.bs[:, None]
    hits = []  # (group, slot, batch row, kernel logical block, raw write_ids index or None)
    gid, row, cu = plan.w_gid, plan.w_row, plan.w_cu
    n_runs = cu[1:] - cu[:-1]
    if plan.w_ids.size:
        run, k = _ragged(n_runs)
        g = gid[run]
        null = plan.w_ids < tables.f[g]
        if null.any():
            r = row[run]
            logical = plan.w_start[run] + k
            # NOTE: sliding nulls below the window are fine; rows outside the device batch read nothing
            # now (their stored ids are checked from the mirror once they do)
            below = lo[g, np.maximum(r, 0)] if B else np.zeros_like(logical)
            ok = sliding[g] & ((r < 0) | (logical < below))
            bad = np.flatnonzero(null & ~ok)
            for j in bad[:1].tolist():
                i = int(run[j])
                raw = int(write_cu[i]) + int(k[j]) // int(tables.f[g[j]])
                hits.append((int(g[j]), int(plan.w_slot[i]), int(row[i]), int(logical[j]), raw))
            count = bad.shape[0]
        else:
            count = 0
    else:
        count = 0
    if hits:
        g, slot, b, logical, raw = hits[0]
        b_lo = int(lo_pos[g, b]) if b >= 0 else None
        seq = int(plan.seq_lens[b]) if b >= 0 else None
        raise null_block_message(tables, g, slot, b, logical, raw, b_lo, seq, bool(sharded[g]), count - 1)


def null_block_message(tables, g, slot, b, logical, raw, lo_pos, seq, sharded, more):
    """The ``null_block`` rejection (:mod:`.messages`)."""
    grp = tables.groups[g]
    f = int(tables.f[g])
    name = grp.name if grp.role in (None, grp.name) else f"{grp.name}, role {grp.role}"
    if grp.kind == "circular":
        what = f"ring block {logical} of {grp.ring_blocks}"
        why = "every block of a circular group's ring is read and written"
    else:
        col, size = logical // f, grp.alloc_block_size
        what = (f"block {col} (positions {col * size}..{(col + 1) * size - 1}"
                f"{', rank-local' if sharded else ''})")
        why = ("every block of a full group is read" if grp.kind == "full" else
               f"the step reads positions {lo_pos}..{seq - 1} of this group (only blocks wholly before "
               f"position {lo_pos} may be null)")
    src = f"from write_ids[{raw}]" if raw is not None else "held since an earlier step"
    tail = f"; {more} more null entr{'y' if more == 1 else 'ies'} in this step" if more > 0 else ""
    return reject("null_block", kind=grp.kind, g=g, name=name, slot=slot, row=f" (batch row {b})" if b >= 0 else "",
                  what=what, src=src, why=why, tail=tail, src_j=raw)


def _duplicates(tables, plan) -> None:
    """No id twice in a row of a full or circular group (nor an id already in the row)."""
    gid, slot, start, cu, ids = plan.w_gid, plan.w_slot, plan.w_start, plan.w_cu, plan.w_ids
    for r in np.flatnonzero((tables.full | tables.circular)[gid]).tolist():
        g = int(gid[r])
        run = ids[cu[r]:cu[r + 1]]
        if not run.size:
            continue
        old = tables.mirrors[g][int(slot[r]), :int(start[r])]
        both = np.concatenate([old, run])
        if np.unique(both).size != both.size:
            u, c = np.unique(both, return_counts=True)
            raise reject("id_twice", r=r, value=int(u[c > 1][0]), g=g, slot=int(slot[r]))


def _shared_rings(tables, plan) -> None:
    """No block id in the rings of two live rows of a circular group (after this step's runs)."""
    if not plan.w_gid.size:
        return
    for g in np.flatnonzero(tables.circular).tolist():
        runs = np.flatnonzero(plan.w_gid == g)
        if not runs.size:
            continue
        nb = tables.num_blocks[g].copy()  # NOTE: what each slot holds before the step
        nb[plan.free_slots] = 0
        nb[plan.new_slots] = 0
        nb[plan.w_slot[runs]] = np.minimum(nb[plan.w_slot[runs]], plan.w_start[runs])  # NOTE: kept before the run
        rows = np.flatnonzero(nb > 0)
        held = tables.mirrors[g][rows]
        keep = tables.iota_cols[None, :held.shape[1]] < nb[rows, None]
        owner = [np.broadcast_to(rows[:, None], held.shape)[keep]]
        ids = [held[keep].astype(np.int64)]
        for r in runs.tolist():
            run = plan.w_ids[plan.w_cu[r]:plan.w_cu[r + 1]]
            owner.append(np.full(run.shape[0], plan.w_slot[r], dtype=np.int64))
            ids.append(run.astype(np.int64))
        owner, ids = np.concatenate(owner), np.concatenate(ids)
        live = ids > 0  # NOTE: null / negative ids are the null-block check's
        owner, ids = owner[live], ids[live]
        order = np.lexsort((owner, ids))
        owner, ids = owner[order], ids[order]
        clash = np.flatnonzero((ids[1:] == ids[:-1]) & (owner[1:] != owner[:-1]))
        if clash.size:
            j = int(clash[0])
            grp = tables.groups[g]
            raise reject("ring_shared", value=int(ids[j]), a=int(owner[j]), b=int(owner[j + 1]), g=g, name=grp.name)

