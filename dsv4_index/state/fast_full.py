"""``checks="full"`` on the incremental path (:mod:`.steady`): the contract checks of :mod:`.contract`
on what a step changes only. True when they pass; False when they do not or are not proven here (the
general path then runs :func:`~.contract.full_checks` over the whole step and raises its message).

What a row already held was checked when it was admitted: a row keeps ``nc_chk`` (:class:`.steady.BatchCache`),
and a step whose ``num_computed_tokens`` falls below it is declined, so its window start never moves
below blocks already checked. What remains per step:

* one-id appends: no null id (each lands at or past its row's window start), and in a full group no
  id the row already holds (one mirror-row compare per full group);
* the runs of a new row (they start at 0, the row held nothing): no null id in a full group nor in a
  sliding group from the window start of the row's first token on; no id twice in a full group's run;
* anything else (a run on a row that held blocks, a row back in the batch): the general contract
  checks on a plan of those rows and runs only.
"""

from __future__ import annotations

import numpy as np

from ._index import window_start
from .contract import full_checks
from .plan import StepPlan

__all__ = ["full_ok"]

_EMPTY = np.zeros(0, dtype=np.int64)
_count = np.count_nonzero


def full_ok(tables, batch_rows, fresh, runs, other, app, write_cu) -> bool:
    """The full checks of a fast plan's changes (module docstring).

    Parameters
    ----------
    batch_rows : (b_slots, b_q, seq, b_nc, new_slots or None, free_slots) — device batch order.
    fresh : int64 — batch rows not in the last batch (new, or back).
    runs : (gid, slot, start, end, keep, cu, ids, row) — the checked kernel-block runs.
    other, app : int64 or None — runs that are not one-id appends, and the one-id appends (when ``other``).
    write_cu : the step's ``write_cu`` (names ``write_ids[j]`` in the general messages).
    """
    gid, slot, start, end, keep, cu, ids, row = runs
    if gid.size and not _appends_ok(tables, gid, slot, start, ids, cu, app):
        return False
    if not fresh.shape[0] and other is None:
        return True
    b_slots, b_q, seq, b_nc, new_slots, free = batch_rows
    new = set() if new_slots is None else set(new_slots.tolist())
    rest = []
    if other is not None:
        for i, g, s, st, r in zip(other.tolist(), gid.take(other).tolist(), slot.take(other).tolist(),
                                  start.take(other).tolist(), row.take(other).tolist()):
            if s not in new:
                rest.append(i)
            elif not _new_run_ok(tables, g, st, ids[cu[i]:cu[i + 1]], int(b_nc[r])):
                return False
    back = [r for r in fresh.tolist() if int(b_slots[r]) not in new]
    if not rest and not back:
        return True
    o = np.asarray(rest, dtype=np.int64)
    sub = np.union1d(np.asarray(back, dtype=np.int64), row.take(o))
    sub_cu = np.zeros(o.shape[0] + 1, dtype=np.int64)
    np.cumsum(cu.take(o + 1) - cu.take(o), out=sub_cu[1:])
    sub_ids = np.concatenate([ids[cu[i]:cu[i + 1]] for i in rest]) if rest else _EMPTY
    plan = object.__new__(StepPlan)
    plan.__dict__.update(
        slots=b_slots.take(sub), num_scheduled=b_q.take(sub), seq_lens=seq.take(sub), replay_start=None,
        replay_end=None, new_slots=_EMPTY if new_slots is None else new_slots, free_slots=free,
        w_gid=gid.take(o), w_slot=slot.take(o), w_start=start.take(o), w_end=end.take(o), w_keep=keep.take(o),
        w_cu=sub_cu, w_ids=sub_ids, w_row=np.searchsorted(sub, row.take(o)))
    try:
        full_checks(tables, plan, (1, 0, 1), write_cu.take(o))
    except ValueError:
        return False
    return True


def _new_run_ok(tables, g: int, start: int, run: np.ndarray, nc: int) -> bool:
    """A new row's run (it held nothing): no null id where read, no id twice in a full group."""
    if not run.size:
        return True
    if tables.full[g]:
        if run.item(run.argmin()) < 1:  # NOTE: plain blocks (f == 1): the null block is id 0
            return False
        srt = np.sort(run)
        return not _count(srt[1:] == srt[:-1])
    if tables.circular[g]:
        return False  # NOTE: not on the fast path (its runs are declined); the general path decides
    bs, W = int(tables.bs[g]), int(tables.window[g])
    tail = run[max(window_start(nc, W) // bs - start, 0):]
    return not tail.size or tail.item(tail.argmin()) >= 1


def _appends_ok(tables, gid, slot, have, ids, cu, a) -> bool:
    """One-id appends (all runs, or those at ``a``): no null id, and in a full group no id already in
    the row's held blocks."""
    if a is not None:
        gid, slot, have, ids = gid.take(a), slot.take(a), have.take(a), ids.take(cu.take(a))
    if _count(ids) != ids.shape[0]:  # NOTE: plain blocks on this path (f == 1): the null block is id 0
        return False
    for g in tables.full_gids:
        m = (gid == g).nonzero()[0]
        if not m.shape[0]:
            continue
        rows = tables.mirrors[g][slot.take(m)]                       # int32 [k, cols]
        held = tables.iota_cols[:rows.shape[1]] < have.take(m)[:, None]
        if _count((rows == ids.take(m)[:, None]) & held):
            return False
    return True
