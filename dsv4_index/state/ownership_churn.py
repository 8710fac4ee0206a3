"""The churn half of :mod:`.ownership_batch`: the ids freed slots release, a new row's runs (fills and
prefix hits), and what a churn step's commit stores for its freed and new rows. Plain blocks only (the
batch path declines other geometry): the null block is id 0.
"""

from __future__ import annotations

import numpy as np

from .ownership_rules import count_in, old_keys

__all__ = ["freed_keys", "fresh_runs", "commit_rows"]

_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)
_BIG = 1 << 62
_count = np.count_nonzero


def freed_keys(o, free: np.ndarray) -> np.ndarray:
    """Id keys of every block the freed slots hold (``[floor, blocks)`` per group; plain blocks: the null
    block is id 0): one mirror slice per (group, slot), a ring's held columns as one or two slices."""
    t, G = o.tables, o.G
    fl, nb = o.floor[:, free].tolist(), t.num_blocks[:, free].tolist()
    mirror, segs, gs = t.mirror, [], []
    for g in range(G):
        ring, cols, base = o.ring_list[g], o.cols_list[g], o.base_list[g]
        for j, slot in enumerate(free.tolist()):
            lo, hi = fl[g][j], nb[g][j]
            if hi <= lo:
                continue
            row = base + slot * cols
            if not ring:
                segs.append(mirror[row + lo:row + hi])
            elif hi - lo > ring:
                return _freed_slow(o, free)  # NOTE: columns read twice (old_keys' answer)
            else:
                a, b = lo % ring, hi % ring
                if a < b:
                    segs.append(mirror[row + a:row + b])
                else:
                    segs += [mirror[row + a:row + ring], mirror[row:row + b]]
                    gs.append(g)
            gs.append(g)
    if not segs:
        return np.zeros(0, dtype=_I64)
    ids = np.concatenate(segs).astype(_I64)
    gk = np.repeat(np.asarray(gs, dtype=_I64), [x.shape[0] for x in segs])
    live = ids >= 1
    ids *= G
    ids += gk
    return ids if _count(live) == ids.shape[0] else ids[live]


def _freed_slow(o, free: np.ndarray) -> np.ndarray:
    g = np.repeat(np.arange(o.G), free.shape[0])
    f = np.tile(free, o.G)
    return old_keys(o, g, f, o.floor[g, f], o.tables.num_blocks[g, f])


def fresh_runs(o, v, st, plan, nc):
    """``(keys, fill keys)`` of a churn step's runs (appends of kept rows, a new row's lists from its window
    block on), or ``(None, None)``; the new rows' ring low-water marks in ``st.fr_runs``. A new row's runs
    are cut in Python ints (they are few) and their ids gathered with one concatenation per kind."""
    gid, slot, s, keep, cu, ids, row = (plan.w_gid, plan.w_slot, plan.w_start, plan.w_keep, plan.w_cu,
                                        plan.w_ids, plan.w_row)
    run_fresh = st.fresh_b.take(row) if st.fresh_b is not None else np.zeros(gid.shape[0], dtype=bool)
    A, R = np.flatnonzero(~run_fresh), np.flatnonzero(run_fresh)
    other = plan.w_other
    if other is not None and _count(run_fresh.take(other)) != other.shape[0]:
        return None, None                                # NOTE: a kept row's run that is not an append
    ida = ids.take(cu.take(A))
    if ida.size and ida.item(ida.argmin()) < 1:
        return None, None
    ka = ida * o.G
    ka += gid.take(A)
    st.fr_runs = None
    if not R.size:
        return ka, ka
    B, num_slots, floor = v.B, o.num_slots, v.floor
    fill_segs, fill_g, hit_segs, hit_g, pk, lrs = [], [], [], [], [], []
    for g, r, s0, kp, c0, c1, sl_ in zip(*(x.take(R).tolist() for x in (gid, row, s, keep, cu[:-1], cu[1:], slot))):
        sliding = o.sliding_list[g]
        F1 = floor.item(o.gpos_list[g] * B + r) if sliding else 0
        a0 = c0 + max(F1 - s0, 0)
        cut = min(max(c0 + nc.item(r) // o.bs_list[g] - s0, a0), c1)  # NOTE: fills from the write start's block on
        if cut > a0:
            hit_segs.append(ids[a0:cut])
            hit_g.append(g)
        if c1 > cut:
            fill_segs.append(ids[cut:c1])
            fill_g.append(g)
        if sliding and o.ring_list[g] and kp != s0:
            if kp > F1:
                return None, None                        # NOTE: a ring read below its low-water (general)
            pk.append(g * num_slots + sl_)
            lrs.append(kp)
    if pk:
        st.fr_runs = (np.asarray(pk, dtype=_I64), np.asarray(lrs, dtype=_I64))
    fk = np.concatenate([ka, _keys(o, fill_segs, fill_g)]) if fill_segs else ka
    if not hit_segs:
        return fk, fk
    hk = _keys(o, hit_segs, hit_g)
    if not hk.size:
        return fk, fk
    o.grow(hk.view(_U64).item(hk.argmax()))
    held = o.count.take(hk)
    if _count(held) and st.rel.size:  # NOTE: holders after this step's releases (a freed id handed on)
        held -= count_in(np.sort(st.rel), hk)
    st.shared_hit = bool(_count(held))
    return np.concatenate([fk, hk]), fk


def _keys(o, segs, gs) -> np.ndarray:
    """Id keys ``id * G + g`` of the non-null ids of id slices ``segs`` of groups ``gs``."""
    ids = np.concatenate(segs) if len(segs) > 1 else segs[0]
    gk = np.repeat(np.asarray(gs, dtype=_I64), [x.shape[0] for x in segs]) if len(segs) > 1 else gs[0]
    keys = ids * o.G
    keys += gk
    if ids.shape[0] and ids.item(ids.argmin()) < 1:
        keys = keys[ids >= 1]
    return keys


def commit_rows(o, v, st) -> None:
    """A churn step's row changes: freed and new slots start empty; a new row's floors, checked marks
    and ring low-water marks; the step's view becomes the kept one."""
    plan = st.view_plan
    sl = plan.free_slots if not plan.new_slots.size else (
        plan.new_slots if not plan.free_slots.size else np.concatenate([plan.free_slots, plan.new_slots]))
    o.floor[:, sl] = 0
    o.ring_lo[:, sl] = 0
    o.checked[:, sl] = 0
    o.frontier[sl] = 0
    o.replay_mark[sl] = 0
    if st.fresh_b is not None:
        rows = np.flatnonzero(st.fresh_b)
        kf = o.S_key + v.b.take(rows)
        fl = np.take(v.floor.reshape(o.S.size, v.B), rows, axis=1)
        o.floor.reshape(-1)[kf] = fl
        o.checked.reshape(-1)[kf] = fl
    if st.fr_runs is not None:
        o.ring_lo.reshape(-1)[st.fr_runs[0]] = st.fr_runs[1]
    if st.shared_hit:
        v.priv.fill(_BIG)  # NOTE: a new row shares a held block: whose is not known here
    if st.fresh_b is not None:  # NOTE: a new row's blocks from its write start on are its fills (private)
        v.priv[:, rows] = st.view_nc.take(rows) // o.nc_bs
    v.privmax = None
    o.view, o.view_retry = v, 0
