"""The common serving step through the ownership rules of :mod:`.owners` in a few array operations:
no slot freed or new, no replay bounds, replicated groups and plain blocks, every write run appending
one non-null id to a batch row (rejected drafts and window moves included). Any other step, and any
doubt (a block that may be shared, a window that moved back, a stale column), returns None: the general
checks of :mod:`.ownership_rules` then decide and name the culprit.

Why it is the same answer: an id appended at a row's end (``start == blocks held``) lands at a block
position the row writes (coverage: ``blocks * block_size >= seq_len > write start``), so it is a fill:
legal when no live row holds it after the step's releases and no other run appends it (the counts);
the plan's ring check bounds ``blocks - window block <= ring``, so an append keeps ``ring_lo`` below
the window block; releases are the blocks a batch row's window left behind (``[floor, window block)``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .ownership_batch import plan_batch
from .ownership_checks import rewind_suspects
from .ownership_rules import Step, begin, count_in, old_keys, release

__all__ = ["plan_fast", "commit_fast"]


def plan_fast(o, plan, st: Optional[Step] = None) -> Optional[Step]:
    """The step of ``plan`` on a fast path (:mod:`.ownership_batch`'s first, then this module's, ``st``
    being :func:`~.ownership_rules.begin`'s when given), or None: the general rules decide."""
    if st is None:
        got = plan_batch(o, plan)
        if got is not None:
            return got
        st = begin(o, plan)
    got = _plan(o, plan, st)
    if got is None or rewind_suspects(o, st) is not None:
        return None
    return got


def _plan(o, plan, st: Step) -> Optional[Step]:
    """``st`` (its no-jump part done) completed for the fast path, or None."""
    N, b = plan.w_gid.shape[0], st.b
    if (st.fresh is not None or st.free.size or plan.replay_start is not None or plan.replay_end is not None
            or o.slow_geometry or not b.size or (N and int(plan.w_cu[-1]) != N)):
        return None
    if N > 1 and int((plan.w_cu[1:] - plan.w_cu[:-1]).min()) != 1:
        return None                                     # NOTE: not one id per run (ids[i] is not run i's)
    num_slots = o.num_slots
    st.N, st.fast = N, True
    lo = np.subtract(st.nc_b, o.wm1_S)             # [Gs, B]: the window block of each batch row
    np.maximum(lo, 0, out=lo)
    lo //= o.bs_S
    kb = o.S_key + b
    # NOTE: ring_lo <= floor always (a commit stores floor = the window block >= ring_lo), so a window that
    # did not move back reads nothing below ring_lo
    F0b = o.floor.reshape(-1).take(kb)
    moved = lo != F0b
    rel = None
    if moved.any():
        if (lo < F0b).any():
            return None                                 # NOTE: a window moved back: held again (general path)
        j, i = np.nonzero(moved)
        rel = _left_behind(o, j, kb[j, i], F0b[j, i], lo[j, i])
        if rel is None:
            rel = old_keys(o, o.S[j], b[i], F0b[j, i],
                            np.minimum(lo[j, i], o.tables.num_blocks.reshape(-1).take(kb[j, i])))
    st.rel = rel if rel is not None else np.zeros(0, dtype=np.int64)
    st.rel_sorted = np.sort(st.rel) if st.rel.size > 1 else st.rel
    st.kb, st.lo, st.F1b = kb, lo, lo
    if N and not _appends(o, plan, st, lo, num_slots):
        return None
    if not N:
        st.acq = np.zeros(0, dtype=np.int64)
    if o.full and not _no_held_null_to_scan(o, st):
        return None
    return st


def _appends(o, plan, st: Step, lo: np.ndarray, num_slots: int) -> bool:
    gid, slot, s, ids, row = plan.w_gid, plan.w_slot, plan.w_start, plan.w_ids, plan.w_row
    kr = gid * num_slots + slot
    if (s != o.tables.num_blocks.reshape(-1).take(kr)).any() or int(ids.min()) < 1 or int(row.min()) < 0:
        return False
    # NOTE: never behind the window (lo * bs <= nc < seq <= (s + 1) * bs); ring_lo stays (state/owners.py)
    keys = ids * o.G
    keys += gid
    o.grow(int(keys.max()))
    base = o.count.take(keys)
    if st.rel.size:
        base = base - count_in(st.rel_sorted, keys)
    if base.any():
        return False                                    # NOTE: held by someone: the general path judges it
    if _has_duplicate(keys):
        return False
    st.acq, st.kr, st.s = keys, kr, s
    return True


def _left_behind(o, j, k, f0, lo) -> Optional[np.ndarray]:
    """Id keys of the one block each moved pair leaves behind (the common case: every window moved by one
    block, none beyond the row's end); None otherwise."""
    if int((lo - f0).max()) != 1 or (o.tables.num_blocks.reshape(-1).take(k) <= f0).any():
        return None
    ids = o.tables.mirror.take(o.pair_base.take(k) + f0 % o.ring_mod_S.take(j)).astype(np.int64)
    live = ids >= 1  # NOTE: plain blocks (fmax == 1): the null block is id 0
    keys = ids * o.G
    keys += o.S.take(j)
    return keys if live.all() else keys[live]


def _has_duplicate(keys: np.ndarray) -> bool:
    """Two runs append one id (a sort)."""
    if keys.shape[0] < 2:
        return False
    srt = np.sort(keys)
    return bool((srt[1:] == srt[:-1]).any())


def _no_held_null_to_scan(o, st: Step) -> bool:
    """``checks="full"``: the held-null scan of :mod:`.contract` has nothing below the checked marks."""
    upto = np.minimum(o.tables.num_blocks.reshape(-1).take(st.kb), o.checked.reshape(-1).take(st.kb))
    return not (upto > st.lo).any()


def commit_fast(o, st: Step) -> None:
    """Apply a fast step (after the no-jump check's frontier update of the caller)."""
    if st.rel.size:
        release(o.count, st.rel)
    if st.acq.size:
        o.count[st.acq] += 1                            # NOTE: distinct keys (checked)
    o.floor.reshape(-1)[st.kb] = st.lo
    if o.full:
        o.checked.reshape(-1)[st.kb] = st.lo
