"""The array and write-run checks of :func:`~.plan.plan_step` (``checks="safe"``): dtypes and shapes,
ranges, counts, and every write run (group and slot in range, one per (group, slot), no hole, inside
the logical width, ids that keep every slot in int32). Each raises ``ValueError`` naming the field."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ..batch import APPEND, StepBatch

__all__ = ["arr", "first", "in_range", "check_counts", "umax", "seen_distinct", "check_runs"]

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


def first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def in_range(name: str, x: np.ndarray, hi: int, what: str) -> None:
    """``0 <= x < hi`` (one pass: negatives wrap to huge unsigned values)."""
    if x.size and umax(x) >= hi:
        i = first((x < 0) | (x >= hi))
        raise ValueError(f"{name}[{i}] = {int(x[i])} is not {what} in [0, {hi})")


def check_counts(nc: np.ndarray, q: np.ndarray, max_model_len: int, max_num_tokens: int) -> None:
    """Bound every count before any sum or product (no int64 wrap can pass a later check).

    ``0 <= num_computed_tokens <= max_model_len`` and ``0 <= num_scheduled_tokens <= max_num_tokens``
    elementwise (one unsigned max each: negatives view as huge); then ``seq_lens`` and ``T`` fit
    easily in int64 (rows <= max_num_reqs).
    """
    for name, x in (("num_computed_tokens", nc), ("num_scheduled_tokens", q)):
        if x.item(x.argmin()) < 0:
            i = first(x < 0)
            raise ValueError(f"{name}[{i}] = {int(x[i])} is negative")
    if umax(nc) > max_model_len:
        i = first(nc > max_model_len)
        raise ValueError(f"num_computed_tokens[{i}] = {int(nc[i])} is beyond max_model_len = {max_model_len}")
    if umax(q) > max_num_tokens:
        total = sum(q.tolist())  # NOTE: Python ints: exact, no wrap
        raise ValueError(f"num_scheduled_tokens: the step schedules {total} tokens, more than "
                         f"max_num_batched_tokens = {max_num_tokens}")


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
        raise ValueError(f"write_slots[{i}] = {int(slot[i])} holds no request after this step")
    # NOTE: bound cu before differencing it (huge values would wrap the differences)
    if cu[0] != 0 or cu[-1] != ids.shape[0] or umax(cu) > ids.shape[0]:
        raise ValueError(f"write_cu must rise from 0 to len(write_ids) = {ids.shape[0]}")
    n = cu[1:] - cu[:-1]
    if n.item(n.argmin()) < 0:
        raise ValueError(f"write_cu must rise from 0 to len(write_ids) = {ids.shape[0]}")
    key = gid * num_slots + slot
    if N > 1 and not seen_distinct(key, G * num_slots):
        k = np.sort(key)  # NOTE: only for the message
        dup = k[1:] == k[:-1]
        if dup.any():
            kk = int(k[1:][dup][0])
            raise ValueError(f"two write runs for gid {kk // num_slots}, slot {kk % num_slots} "
                             f"(one run per (group, slot))")
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
        raise ValueError(f"write_starts[{i}] = {int(start[i])} leaves a hole: gid {int(gid[i])} of slot "
                         f"{int(slot[i])} holds {int(have[i] // tables.f[gid[i]])} blocks")
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
        raise ValueError(f"write run {i}: slot {int(slot[i])} would hold {int(end_k[i])} blocks in gid "
                         f"{g.gid} ({g.name}), the table holds {int(tables.logical[gid[i]])} "
                         f"({'the circular ring' if g.kind == 'circular' else 'max_model_len'})")
    if ids.size:
        fmax = tables.fmax
        if umax(ids) * fmax + fmax - 1 > tables.id_max_min:
            if ids.item(ids.argmin()) < 0:
                raise ValueError(f"write_ids[{first(ids < 0)}] = {int(ids[ids < 0][0])} is negative")
            per = np.repeat(gid, n)
            lim = (tables.id_max[per] - (tables.f[per] - 1)) // tables.f[per]
            bad = ids > lim
            if bad.any():
                j = first(bad)
                g = int(per[j])
                raise ValueError(f"write_ids[{j}] = {int(ids[j])} in gid {g} ({tables.groups[g].name}) "
                                 f"gives slots beyond int32 (largest id {int(lim[j])})")
    # NOTE: start_k is already in kernel blocks; expand() only turns the ids into kernel-block ids
    _, cu_k, ids_k = tables.expand(gid, start_k // tables.f[gid], cu, ids)
    return gid, slot, start_k, end_k, cu_k, ids_k

