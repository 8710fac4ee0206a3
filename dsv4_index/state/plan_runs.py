"""The array and write-run checks of :func:`~.plan.plan_step` (``checks="safe"``): dtypes and shapes,
ranges, counts, and every write run (group and slot in range, one per (group, slot), no hole, inside
the logical width, ids that keep every slot in int32). Each raises ``ValueError`` naming the field."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ..batch import APPEND, StepBatch
from .messages import reject

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

