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

from ._index import cp_owned, flat_offset, ring_col, window_start

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
    if B:
        # held blocks [lo, upto) of each sliding group: upto = blocks held before the step, cut at the
        # start of a run on that row; one [B, widest] gather per group (the ring check bounds the width)
        fresh = np.isin(plan.slots, plan.new_slots) if plan.new_slots.size else None
        for g in np.flatnonzero(sliding).tolist():
            upto = tables.num_blocks[g].take(plan.slots)
            if fresh is not None:
                upto[fresh] = 0
            m = (gid == g) & (row >= 0)
            if m.any():
                upto[row[m]] = np.minimum(upto[row[m]], plan.w_start[m])
            n = upto - lo[g]
            width = int(n.max())
            if width <= 0:
                continue
            k = np.arange(width, dtype=np.int64)
            ring, cols = int(tables.ring[g]), int(tables.cols[g])
            first = ring_col(lo[g], ring)
            col = np.add.outer(flat_offset(int(tables.base[g]), cols, plan.slots, first), k)
            if ring and int(first.max()) + width > ring:  # NOTE: rows whose range wraps (at most once)
                w = np.flatnonzero(first + width > ring)
                col[w] -= ring * (first[w, None] + k >= ring)
            # NOTE: entries past a row's n may lie outside it (clip keeps them in the mirror): masked below
            bad = tables.mirror.take(col, mode="clip") < int(tables.f[g])
            if bad.any():
                bad &= k < n[:, None]
            nbad = int(np.count_nonzero(bad))
            if nbad and not hits:
                b, j = (int(x) for x in np.argwhere(bad)[0])
                hits.append((g, int(plan.slots[b]), b, int(lo[g, b]) + j, None))
            count += nbad
    if hits:
        g, slot, b, logical, raw = hits[0]
        b_lo = int(lo_pos[g, b]) if b >= 0 else None
        seq = int(plan.seq_lens[b]) if b >= 0 else None
        raise ValueError(_message(tables, g, slot, b, logical, raw, b_lo, seq, bool(sharded[g]), count - 1))


def _message(tables, g, slot, b, logical, raw, lo_pos, seq, sharded, more) -> str:
    grp = tables.groups[g]
    f = int(tables.f[g])
    name = grp.name if grp.role in (None, grp.name) else f"{grp.name}, role {grp.role}"
    where = f"slot {slot}" + (f" (batch row {b})" if b >= 0 else "")
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
    return f"the null block 0 in {grp.kind} group gid {g} ({name}) of {where}: {what}, {src}; {why}{tail}"


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
            raise ValueError(f"write run {r}: block id {int(u[c > 1][0])} twice in gid {g} of slot "
                             f"{int(slot[r])}")


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
            raise ValueError(f"block id {int(ids[j])} is in the rings of slots {int(owner[j])} and "
                             f"{int(owner[j + 1])} of circular group gid {g} ({grp.name}): two requests "
                             f"would write the same ring rows")
