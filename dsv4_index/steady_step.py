"""The steady step of the id-keyed front ends (:func:`_fast`): a step of running requests, plus a few
new, finished or preempted ones, converted in C-level passes over the scheduler's columns (vLLM's
``CachedRequestData`` is already columnar: ``req_ids``, ``new_block_ids``, ``num_computed_tokens``).

It returns None whenever anything is unusual; :func:`dsv4_index.frontend._convert` (row by row) then
gives the same batch or names the culprit (``tests/test_convert_bulk.py`` compares the two). So every
shortcut here only has to be *sufficient*:

* the request order of the last committed batch (kept by the :class:`~dsv4_index.slot_map.SlotMap`)
  repeats, or repeats without the rows of finished / preempted requests (a list comparison): the slots
  come from the cached array, distinct and held by construction; otherwise one lookup per request;
* ``num_scheduled_tokens`` is read in dict order when its keys are the rows (new first, or running
  first as vLLM fills it), else looked up per id;
* counts and block ids: one type pass, one int64 conversion (OverflowError past int64), one unsigned
  max against ``LIMIT`` (:func:`dsv4_index.step_rules._ints`);
* write runs: ``None`` entries skipped by ``list.count`` / ``compress``, the per-gid lists flattened
  in C, positions -> (row, gid) by one ``divmod``.
"""

from __future__ import annotations

from functools import reduce
from itertools import compress
from operator import countOf, iconcat, itemgetter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .batch import APPEND, StepBatch
from .slot_map import _EMPTY, SlotMap, SlotMapDelta, _frozen, gone, lowest_free
from .step_rules import _LISTS, _id_set, _ints, _pack

__all__ = ["_fast"]

_CU0 = _frozen(np.zeros(1, dtype=np.int64))
_NO_RUNS = (_EMPTY, _EMPTY, _EMPTY, _CU0, _EMPTY)
_STR = {str}
_NOT_NEW, _APPENDS, _ARANGE = 0, 1, 2
_SIZED: Dict[Tuple[int, int], np.ndarray] = {}


def _sized(kind: int, n: int) -> np.ndarray:
    """A frozen array of length ``n``, shared between steps: no new rows (bool zeros), ``APPEND``
    starts, or ``arange(n)`` (the offsets of runs of one id each)."""
    a = _SIZED.get((kind, n))
    if a is None:
        if len(_SIZED) > 192:
            _SIZED.clear()
        a = (np.zeros(n, dtype=bool) if kind == _NOT_NEW else
             np.full(n, APPEND, dtype=np.int64) if kind == _APPENDS else np.arange(n, dtype=np.int64))
        a = _SIZED[(kind, n)] = _frozen(a)
    return a


def _held_slots(sm: SlotMap, ids: list, freed: List[str]) -> Optional[np.ndarray]:
    """Slots of the running rows ``ids``; None unless all are held, distinct and not ``freed``.

    NOTE: every id of ``sm._order`` holds the slot at its position in ``sm._order_slots`` (committed
    together), so ``ids`` equal to the last rows, less those of freed ids, needs no lookup.
    """
    order = sm._order
    pos = []
    if len(freed) <= 8:
        for rid in freed:  # NOTE: only a held id can be a row of the last batch
            try:
                pos.append(order.index(rid))
            except ValueError:
                pass
        if not pos:
            if ids == order:
                return sm._order_slots
        elif len(order) - len(pos) == len(ids):
            pos.sort()
            kept = order[:pos[0]]
            for a, b in zip(pos, pos[1:] + [len(order)]):
                kept += order[a + 1:b]
            if ids == kept:
                o = sm._order_slots
                return _frozen(np.concatenate([o[:pos[0]], o[pos[0] + 1:]]) if len(pos) == 1 else np.delete(o, pos))
    sl = list(map(sm.slot_of.get, ids))
    if None in sl or len(set(ids)) != len(ids) or (freed and not set(freed).isdisjoint(ids)):
        return None
    return _frozen(np.array(sl, dtype=np.int64))


def _scheduled(nst: dict, ids: list, new_ids: list, all_ids: list):
    """``num_scheduled_tokens`` in row order, a list or the dict's values (KeyError when a row has no
    entry)."""
    keys = list(nst)
    if keys == all_ids:
        return nst.values()
    S = len(ids)
    if new_ids and keys[:S] == ids and keys[S:] == new_ids:  # NOTE: vLLM fills it running first
        v = list(nst.values())
        return v[S:] + v[:S]
    return list(map(nst.__getitem__, all_ids))


def _fast(sm: SlotMap, G: Optional[int], new: list, ids: list, lists: list, ncs: list, nst, finished, preempted,
          trusted: bool) -> Optional[Tuple[StepBatch, SlotMapDelta]]:
    """A step without resumed requests or replay bounds; None whenever anything is unusual.

    ``new``: [(rid, block_ids, nc)]; ``ids`` / ``lists`` / ``ncs``: the running rows' ids, new block
    lists (per request a tuple per gid, or None) and computed tokens; ``trusted``: the block tuples
    and their entries' types were fixed at construction (``NewRequest`` / ``RunningRequest``), only
    the ids are checked.
    """
    d = SlotMapDelta()
    try:
        S, K = len(ids), len(new)
        if not S + K or type(nst) is not dict or len(nst) != S + K or type(ids) is not list \
                or type(ncs) is not list or len(lists) != S or len(ncs) != S:
            return None
        away = gone(sm, _id_set("finished_req_ids", finished), _id_set("preempted_req_ids", preempted), d) \
            if finished or preempted else ()
        slots = _held_slots(sm, ids, d.freed) if S else _EMPTY
        if slots is None:
            return None
        if K:
            # NOTE: the running rows are held and no new id is, so the two lists cannot overlap
            new_ids = [r[0] for r in new]
            if not set(map(type, new_ids)) <= _STR or len(set(new_ids)) != K \
                    or (away and not away.isdisjoint(new_ids)) or any(map(sm.slot_of.__contains__, new_ids)):
                return None
            all_ids = new_ids + ids
        else:
            new_ids, all_ids = [], ids
        qs = _scheduled(nst, ids, new_ids, all_ids)
    except (TypeError, KeyError):
        return None
    appended = _appended(G, lists, trusted)
    if appended is None:
        return None
    G, sel, nz, runs, ids_ = appended
    n = S + K
    head = [r[2] for r in new]
    if nz:
        M, N = len(ids_), len(nz)
        # NOTE: one conversion for the counts, the ids and (unchecked: ours) the runs' positions
        a = _pack(head, ncs, qs, ids_, nz, sel, list(map(len, runs)) if M != N else ())
        if a is None:
            return None
        row, w_g = np.divmod(a[2 * n + M:2 * n + M + N], G)
        if sel:
            row = a[2 * n + M + N:2 * n + M + N + len(sel)][row]
        if M == N:
            w_cu = _sized(_ARANGE, N + 1)
        else:
            w_cu = np.zeros(N + 1, dtype=np.int64)
            np.cumsum(a[2 * n + M + N + len(sel):], out=w_cu[1:])
        runs = (w_g, slots[row], _sized(_APPENDS, N), w_cu, a[2 * n:2 * n + M])
    else:
        a = _pack(head, ncs, qs, ())
        if a is None:
            return None
        runs = _NO_RUNS
    is_new = _sized(_NOT_NEW, S)
    free_slots = np.array([sm.slot_of[r] for r in d.freed], dtype=np.int64) if d.freed else _EMPTY
    if K:
        free = lowest_free(sm, free_slots.tolist(), K)
        if len(free) < K:
            return None
        new_runs = _new_runs(G, new, free, trusted)
        if new_runs is None:
            return None
        d.taken = dict(zip(new_ids, reversed(free)))
        d.new = new_ids
        slots = _frozen(np.concatenate([np.array(free[::-1], dtype=np.int64), slots]))
        is_new = np.concatenate([np.ones(K, dtype=bool), is_new])
        runs = tuple(np.concatenate([a_, b_]) for a_, b_ in zip(new_runs[:3], runs[:3])) + \
            (np.concatenate([new_runs[3], runs[3][1:] + new_runs[3][-1]]), np.concatenate([new_runs[4], runs[4]]))
    w_g, w_s, w_st, w_cu, w_ids = runs
    batch = StepBatch(req_slots=slots, num_computed_tokens=a[:n], num_scheduled_tokens=a[n:2 * n],
                      is_new=is_new, free_slots=free_slots, write_gids=w_g, write_slots=w_s, write_starts=w_st,
                      write_cu=w_cu, write_ids=w_ids)
    d.order, d.slots = all_ids, slots  # NOTE: SlotMap.commit copies the ids
    return batch, d


def _appended(G: Optional[int], lists: list, trusted: bool):
    """What the running rows append, as Python lists: ``(G, sel, nz, runs, ids)`` (``G`` the number
    of per-gid lists, ``sel`` the rows with a tuple (``[]``: all), ``nz`` the positions of the
    non-empty lists ``runs`` among those rows' lists, ``ids`` their ids); None when anything is
    unusual. ``trusted``: the tuples and their entries' types were fixed at construction.
    """
    S = len(lists)
    n_none = lists.count(None)
    if n_none == S:
        return G, [], [], (), []
    if n_none:
        sel = list(compress(range(S), lists))
        if len(sel) + n_none != S:
            return None  # NOTE: a falsy entry that is not None (e.g. "" or ())
        chosen = itemgetter(*sel)(lists) if len(sel) > 1 else (lists[sel[0]],)
    else:
        sel, chosen = [], lists
    if not trusted and countOf(map(type, chosen), tuple) != len(chosen) and not set(map(type, chosen)) <= _LISTS:
        return None
    if G is None or countOf(map(len, chosen), G) != len(chosen):
        widths = set(map(len, chosen))
        if len(widths) != 1 or (G is not None and G not in widths):
            return None
        G = widths.pop()
    if trusted:
        # NOTE: entries are lists / tuples (fixed at construction): any() finds the requests with ids
        has = list(compress(range(len(chosen)), map(any, chosen)))
        if not has:
            return G, [], [], (), []
        if len(has) < len(chosen):
            sel = has if not sel else list(map(sel.__getitem__, has))
            chosen = list(map(chosen.__getitem__, has))
    flat = reduce(iconcat, chosen, [])  # NOTE: faster than chain.from_iterable on short tuples
    if not trusted and countOf(map(type, flat), list) != len(flat) and not set(map(type, flat)) <= _LISTS:
        return None
    nz = list(compress(range(len(flat)), flat))
    if not nz:
        return G, [], [], (), []
    runs = itemgetter(*nz)(flat) if len(nz) > 1 else (flat[nz[0]],)
    return G, sel, nz, runs, reduce(iconcat, runs, [])


def _new_runs(G: Optional[int], new: list, free: Sequence[int], trusted: bool):
    """Write runs of new rows (one per gid from block 0, empty ones included); None when unusual."""
    g_, s_, cu, ids = [], [], [0], []
    for (rid, lists, _), slot in zip(new, reversed(free)):
        if not trusted and (type(lists) not in _LISTS or not set(map(type, lists)) <= _LISTS):
            return None
        if G is None:
            G = len(lists)
        if len(lists) != G:
            return None
        g_.extend(range(G))
        s_.extend([slot] * G)
        for x in lists:
            ids.extend(x)
            cu.append(len(ids))
    w_ids = _ints(ids)
    if w_ids is None:
        return None
    N = len(g_)
    return (np.array(g_, dtype=np.int64), np.array(s_, dtype=np.int64), np.zeros(N, dtype=np.int64),
            np.array(cu, dtype=np.int64), w_ids)
