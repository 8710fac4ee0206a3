"""The repeat conversion of the id-keyed front door (:func:`convert_repeat`; :func:`convert_requests` for a
StepInput's ``RunningRequest`` rows): a step that repeats the last accepted batch's rows, plus a few new,
finished or preempted requests and any appended blocks, converted in C-level passes over the scheduler's
columns (vLLM's ``CachedRequestData`` is already columnar: ``req_ids``, ``new_block_ids``,
``num_computed_tokens``) and one compiled pass (:mod:`.runs`).

It returns None whenever anything is unusual; :func:`dsv4_index.frontend.convert.convert` (row by
row) then gives the same batch or names the culprit (``tests/frontend/test_convert_bulk.py`` compares
the two). So every shortcut here only has to be *sufficient*:

* rows are in vLLM's order: the running requests as listed, the new ones appended (as vLLM appends
  admitted requests to its running list), so the step after an arrival repeats the committed order;
* the request order of the last committed batch (kept by the :class:`~dsv4_index.state.requests.SlotMap`)
  repeats, or repeats without the rows of finished / preempted requests (a list comparison): the request slots
  come from the cached array, distinct and held by construction; otherwise one lookup per request
  (:meth:`SlotMap.held_slots`);
* ``num_scheduled_tokens`` is read in dict order when its keys are the rows (running first, as vLLM
  fills it, or new first), else looked up per id;
* counts and block ids: one type pass, one int64 conversion (an error past int64), range-checked against
  ``LIMIT`` by the runs pass (:func:`dsv4_index.frontend.rules.pack`); a new request's ids are checked once,
  with the step's other new ids;
* write runs: ``None`` entries skipped by ``list.count`` / ``compress`` (a StepInput's rows of ``G`` empty
  lists by one tuple comparison each), the per-gid lists flattened in C, their lengths converted with the
  counts, and the runs (gid, slot, offsets) of the non-empty ones made by the runs pass (:mod:`.runs`).
"""

from __future__ import annotations

from functools import reduce
from itertools import compress
from operator import countOf, iconcat, itemgetter
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..batch import APPEND, StepBatch
from ..state.requests import EMPTY, SlotMap, SlotMapDelta, frozen
from .rules import LISTS, gone_ids, ints_of_lists, pack
from .runs import runs_of

__all__ = ["convert_repeat", "convert_requests"]

_CU0 = frozen(np.zeros(1, dtype=np.int64))
_NO_RUNS = (EMPTY, EMPTY, EMPTY, _CU0, EMPTY)
_STR = {str}
_NOT_NEW, _APPENDS = 0, 1
_SIZED: Dict[Tuple[int, int], np.ndarray] = {}
_EMPTIES: Dict[int, tuple] = {}


def _sized(kind: int, n: int) -> np.ndarray:
    """A frozen array of length ``n``, shared between steps: no new rows (bool zeros) or ``APPEND`` starts."""
    a = _SIZED.get((kind, n))
    if a is None:
        if len(_SIZED) > 192:
            _SIZED.clear()
        a = np.zeros(n, dtype=bool) if kind == _NOT_NEW else np.full(n, APPEND, dtype=np.int64)
        a = _SIZED[(kind, n)] = frozen(a)
    return a


def _scheduled(nst: dict, ids: list, new_ids: list, all_ids: list):
    """``num_scheduled_tokens`` in row order (``all_ids``: running, then new), a list or the dict's
    values (KeyError when a row has no entry)."""
    keys = list(nst)
    if keys == all_ids:  # NOTE: vLLM fills it running first, then the admitted requests
        return nst.values()
    K = len(new_ids)
    if K and keys[:K] == new_ids and keys[K:] == ids:
        v = list(nst.values())
        return v[K:] + v[:K]
    return list(map(nst.__getitem__, all_ids))


def _ids_of(sm: SlotMap, ids: list, new: list, finished, preempted, d: SlotMapDelta):
    """``(request slots of the running rows, new ids)``; None when unusual (raises TypeError / KeyError /
    ValueError for bad input, which the caller turns into None)."""
    away = sm.gone(*gone_ids(finished, preempted), d) if finished or preempted else ()
    req_slots = sm.held_slots(ids, d.freed) if ids else EMPTY
    if req_slots is None:
        return None
    new_ids = [r[0] for r in new]
    if new_ids:
        # NOTE: the running rows are held and no new id is, so the two lists cannot overlap
        if not set(map(type, new_ids)) <= _STR or len(set(new_ids)) != len(new_ids) \
                or (away and not away.isdisjoint(new_ids)) or any(map(sm.slot_of.__contains__, new_ids)):
            return None
    return req_slots, new_ids


def convert_repeat(sm: SlotMap, G: Optional[int], new: list, ids: list, lists: list, ncs: list, nst, finished,
                   preempted, trusted: bool) -> Optional[Tuple[StepBatch, SlotMapDelta]]:
    """A step without resumed requests or replay bounds; None whenever anything is unusual.

    ``new``: [(rid, block_ids, nc)]; ``ids`` / ``lists`` / ``ncs``: the running rows' ids, new block
    lists (per request a tuple per gid, or None) and computed tokens; ``trusted``: the block tuples
    and their entries' types were fixed at construction (``NewRequest`` / ``RunningRequest``), only
    the ids are checked. Batch rows: the running requests, then the new ones.
    """
    try:
        if len(lists) != len(ids):
            return None
    except TypeError:
        return None
    appended = _appended(G, lists, trusted)
    return None if appended is None else _convert(sm, new, ids, appended, ncs, nst, finished, preempted, trusted)


def convert_requests(sm: SlotMap, G: Optional[int], new: list, run, nst, finished, preempted,
                     trusted_new: bool) -> Optional[Tuple[StepBatch, SlotMapDelta]]:
    """:func:`convert_repeat` of running rows that are ``RunningRequest`` objects (their block tuples trusted);
    None when one is resumed. Each field is read by one comprehension (3.11 specializes the attribute reads:
    faster than ``attrgetter``), and only the rows whose ``new_block_ids`` is not ``G`` empty lists (or that are
    resumed) are looked at further. ``trusted_new``: the new requests are ``NewRequest`` objects."""
    if G:
        empty = _empty_lists(G)
        other = [i for i, r in enumerate(run) if r.new_block_ids != empty or r.resumed]
        sub = [run[i] for i in other]
        if [r for r in sub if r.resumed]:
            return None
        appended = _appended_rows(G, other, [r.new_block_ids for r in sub])
    else:
        if [r for r in run if r.resumed]:
            return None
        appended = _appended(G, [r.new_block_ids for r in run], True)
    if appended is None:
        return None
    return _convert(sm, new, [r.req_id for r in run], appended, [r.num_computed_tokens for r in run], nst, finished,
                    preempted, trusted_new)


def _convert(sm: SlotMap, new: list, ids: list, appended: tuple, ncs: list, nst, finished, preempted,
             trusted: bool) -> Optional[Tuple[StepBatch, SlotMapDelta]]:
    """The repeat conversion once the running rows' appended blocks are known (``appended``: :func:`_appended`)."""
    d = SlotMapDelta()
    try:
        S, K = len(ids), len(new)
        if not S + K or type(nst) is not dict or len(nst) != S + K or type(ids) is not list \
                or type(ncs) is not list or len(ncs) != S:
            return None
        got = _ids_of(sm, ids, new, finished, preempted, d)
        if got is None:
            return None
        req_slots, new_ids = got
        all_ids = ids + new_ids if K else ids
        qs = _scheduled(nst, ids, new_ids, all_ids)
    except (TypeError, KeyError, ValueError):
        return None
    G, rows, lens, ids_ = appended
    n, M, L = S + K, len(ids_), len(lens)
    # NOTE: one conversion for the counts, the ids and (unchecked: ours) the list lengths and rows; the runs pass
    # range-checks the counts and ids
    a = pack(ncs, [r[2] for r in new], qs, ids_, lens, rows)
    if a is None:
        return None
    out = np.empty(L, dtype=np.int64), np.empty(L, dtype=np.int64), np.empty(L + 1, dtype=np.int64)
    N = runs_of(a, 2 * n + M, 2 * n + M, L, 2 * n + M + L, len(rows), G or 1, req_slots, *out)
    if N < 0:
        return None
    runs = (out[0][:N], out[1][:N], _sized(_APPENDS, N), out[2][:N + 1], a[2 * n:2 * n + M]) if N else _NO_RUNS
    is_new = _sized(_NOT_NEW, S)
    free_slots = np.array([sm.slot_of[r] for r in d.freed], dtype=np.int64) if d.freed else EMPTY
    if K:
        free = sm.lowest_free(free_slots.tolist(), K)
        if len(free) < K:
            return None
        new_runs = _new_runs(G, new, free, trusted)
        if new_runs is None:
            return None
        d.taken = dict(zip(new_ids, free, strict=True))
        d.new = new_ids
        req_slots = frozen(np.concatenate([req_slots, np.array(free, dtype=np.int64)]))
        is_new = np.concatenate([is_new, np.ones(K, dtype=bool)])
        runs = tuple(np.concatenate([a_, b_]) for a_, b_ in zip(runs[:3], new_runs[:3], strict=True)) + \
            (np.concatenate([runs[3], new_runs[3][1:] + runs[3][-1]]), np.concatenate([runs[4], new_runs[4]]))
    w_g, w_s, w_st, w_cu, w_ids = runs
    batch = StepBatch(req_slots=req_slots, num_computed_tokens=a[:n], num_scheduled_tokens=a[n:2 * n],
                      is_new=is_new, free_slots=free_slots, write_gids=w_g, write_slots=w_s, write_starts=w_st,
                      write_cu=w_cu, write_ids=w_ids)
    d.order, d.slots = all_ids, req_slots  # NOTE: SlotMap.commit copies the ids
    return batch, d


def _appended(G: Optional[int], lists: list, trusted: bool):
    """What the running rows append, as Python lists: ``(G, rows, lens, ids)`` (``G`` the number of per-gid
    lists, ``rows`` the rows with a tuple (``[]``: all), ``lens`` the length of each of their lists, ``G`` per
    row, ``ids`` the lists' ids end to end); None when anything is unusual. ``trusted``: the tuples and their
    entries' types were fixed at construction.
    """
    if trusted and G:
        empty = _empty_lists(G)
        other = [i for i, x in enumerate(lists) if x != empty]
        return _appended_rows(G, other, list(map(lists.__getitem__, other)))
    S = len(lists)
    n_none = lists.count(None)
    if n_none == S:
        return G, [], [], []
    if n_none:
        sel = list(compress(range(S), lists))
        if len(sel) + n_none != S:
            return None  # NOTE: a falsy entry that is not None (e.g. "" or ())
        chosen = itemgetter(*sel)(lists) if len(sel) > 1 else (lists[sel[0]],)
    else:
        sel, chosen = [], lists
    if not trusted and countOf(map(type, chosen), tuple) != len(chosen) and not set(map(type, chosen)) <= LISTS:
        return None
    if G is None or countOf(map(len, chosen), G) != len(chosen):
        widths = set(map(len, chosen))
        if len(widths) != 1 or (G is not None and G not in widths):
            return None
        G = widths.pop()
    flat: list = reduce(iconcat, chosen, [])  # NOTE: faster than chain.from_iterable on short tuples
    if not trusted and countOf(map(type, flat), list) != len(flat) and not set(map(type, flat)) <= LISTS:
        return None
    return G, sel, list(map(len, flat)), reduce(iconcat, filter(None, flat), [])


def _empty_lists(G: int) -> tuple:
    """A tuple of ``G`` empty lists, shared (compared with, never changed): a trusted row equal to it appends
    nothing and has ``G`` lists (a tuple equals it only with ``G`` entries, each an empty list)."""
    e = _EMPTIES.get(G)
    return e if e is not None else _EMPTIES.setdefault(G, tuple([] for _ in range(G)))


def _appended_rows(G: int, other: list, sub: list):
    """:func:`_appended` of trusted rows (entries fixed at construction), ``G`` known, from the rows ``other`` that
    are not ``G`` empty lists and their block tuples (or None) ``sub``; None when one has another width (``()``
    included)."""
    if not other:
        return G, [], [], []
    if None in sub:
        other = [i for i, x in zip(other, sub) if x is not None]
        sub = [x for x in sub if x is not None]
    if countOf(map(len, sub), G) != len(sub):
        return None
    flat: list = reduce(iconcat, sub, [])
    return G, other, list(map(len, flat)), reduce(iconcat, filter(None, flat), [])


def _new_runs(G: Optional[int], new: list, free: Sequence[int], trusted: bool):
    """Write runs of new rows (one per gid from block 0, empty ones included); None when unusual.
    The ids: one conversion per block list, checked over the new ids only."""
    g_: list = []
    s_: list = []
    every: list = []
    for (_rid, lists, _), slot in zip(new, free, strict=True):
        if not trusted and (type(lists) not in LISTS or not set(map(type, lists)) <= LISTS):
            return None
        if G is None:
            G = len(lists)
        if len(lists) != G:
            return None
        g_.extend(range(G))
        s_.extend([slot] * G)
        every.extend(lists)
    w_ids = ints_of_lists(every)
    if w_ids is None:
        return None
    N = len(g_)
    cu = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, every), dtype=np.int64, count=N), out=cu[1:])
    return (np.array(g_, dtype=np.int64), np.array(s_, dtype=np.int64), np.zeros(N, dtype=np.int64), cu, w_ids)
