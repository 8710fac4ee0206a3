"""The contract checks of ``checks="full"`` (``validate=True`` implies it; docs/DESIGN.md §5), on a plan that
passed every ``"safe"`` check of :mod:`.plan`:

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

NOTE: the incremental path (:mod:`.steady`) checks only what a step changes (:mod:`.fast_full`): held
blocks from the window start on were checked when the row was admitted or last scanned.
"""

from __future__ import annotations

import numpy as np

from ._index import cp_owned, window_start
from .messages import reject

__all__ = ["full_checks"]


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
        raise _message(tables, g, slot, b, logical, raw, b_lo, seq, bool(sharded[g]), count - 1)


def _message(tables, g, slot, b, logical, raw, lo_pos, seq, sharded, more):
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


# ----------------------------------------------------------------------------------------------
# the incremental part of "full", run by state/owners.py with its per-row marks
# ----------------------------------------------------------------------------------------------
def held_and_duplicates(o, st) -> None:
    """``checks="full"`` on sliding rows, incrementally (``o``: :class:`~.owners.BlockOwners`, ``st``: its
    checked :class:`~.ownership_rules.Step`): no null block among the held blocks a batch row reads
    from its window start on, scanned only below the row's ``checked`` mark (positions there were
    verified by an earlier step; a row's window only moves up); no block id twice in a sliding row."""
    if st.kb is not None:
        _held_nulls(o, st)
    _sliding_duplicates(o, st)


def _held_nulls(o, st) -> None:
    t, num_slots = o.tables, o.num_slots
    kb = st.kb
    upto = np.minimum(st.N0b, o.checked.reshape(-1).take(kb))
    if st.kr_s.size:  # NOTE: a run's own ids were checked as write ids: held ones below its start only
        sl = np.flatnonzero(st.sl)
        cut = np.full(o.G * num_slots, np.iinfo(np.int64).max, dtype=np.int64)
        cut[st.kr_s] = st.s[sl]
        upto = np.minimum(upto, cut.take(kb))
    n = upto - st.lo
    if not (n > 0).any():
        return
    j, i = np.nonzero(n > 0)
    g, slot, lo = o.S[j], st.b[i], st.lo[j, i]
    rep, k = _ragged(n[j, i])
    gg, pos = g[rep], lo[rep] + k
    ring = t.ring.take(gg)
    col = np.where(ring > 0, pos % np.maximum(ring, 1), pos)
    ids = t.mirror.take(t.base.take(gg) + slot[rep] * t.cols.take(gg) + col)
    bad = np.flatnonzero(ids < t.f.take(gg))
    if bad.size:
        x = int(bad[0])
        r, gx = int(rep[x]), int(gg[x])
        b = int(i[r])
        raise _message(t, gx, int(slot[r]), b, int(pos[x]), None, int(st.lo_pos[j[r], b]),
                       int(st.seq[b]), bool(o.sharded[gx]), bad.size - 1)


def _sliding_duplicates(o, st) -> None:
    """No id twice among a sliding row's acquisitions, nor a hit already held by the row (own fills
    are judged by the ownership check)."""
    if not st.acq.size:
        return
    sl = o.sliding.take(st.acq % o.G)
    if not sl.any():
        return
    key2 = st.acq[sl] * o.num_slots + st.acq_slot[sl]
    srt = np.sort(key2)
    d = np.flatnonzero(srt[1:] == srt[:-1])
    if d.size:
        k2 = int(srt[d[0]])
        key, slot = k2 // o.num_slots, k2 % o.num_slots
        _twice(o, key, slot)
    hits = np.flatnonzero(sl & ~st.acq_fill)
    hits = hits[st.N0r.take(st.acq_run.take(hits)) > 0]  # NOTE: rows that held blocks before the step
    held = o.holders_by_key(st.acq.take(hits), st) if hits.size else {}
    for h in hits.tolist():
        key, slot = int(st.acq[h]), int(st.acq_slot[h])
        if any(s == slot for s, _, how in held[key] if how == "held"):
            _twice(o, key, slot)


def _twice(o, key: int, slot: int) -> None:
    g = key % o.G
    f = int(o.tables.f[g])
    raise reject("sliding_twice", value=key // o.G // f, g=g, name=o.tables.groups[g].name, slot=slot)
