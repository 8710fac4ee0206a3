"""Id-keyed front ends: the request-id -> slot map (:class:`SlotMap`) and the conversions of a
:class:`~dsv4_index.step.StepInput` (:func:`batch_from_step`) or of a vLLM-style ``SchedulerOutput``
(:func:`batch_from_scheduler_output`) into a :class:`~dsv4_index.batch.StepBatch`.

The rules of an id-keyed step (one set: :func:`_rows` holds the stateless part, which
``StepInput.validate_static`` runs too, :func:`_convert` the slot-map part):

* request ids are ``str``, each listed once (new or running) and not also finished / preempted;
  the keys of ``num_scheduled_tokens`` are exactly the scheduled ids;
* every count (``num_computed_tokens``, ``num_scheduled_tokens``, ``replay_start``, ``replay_end``)
  and every block id is a Python ``int`` (not a ``bool``, ``float`` or numpy scalar) in
  ``[0, 2**31 - 1]``, checked before any sum or array conversion, so no wrap can pass; the pipeline
  then bounds them by ``max_model_len`` and its capacities;
* a request's block lists are a tuple (or list) with one list (or tuple) per gid; a running request's
  ``new_block_ids`` may be None (no new block; vLLM's form);
* a running request holds a slot, or is resumed after a preemption this map saw; a new request takes
  the lowest free slot;
* a finished or preempted id the map never saw is a no-op (vLLM reports requests aborted while
  waiting).

Errors are ``ValueError`` (:class:`~dsv4_index.step.StepTypeError`, also a ``TypeError``, for a wrong
type) naming the scheduler's field and the request id, e.g. ``running_requests: new_block_ids of 'a'
gid 1 has a bad block id 2147483648 at new_block_ids[1][0]``.

Speed (``benchmarks/FRONTEND.md``): a step of running requests only (a steady decode) takes
:func:`_fast`: C-level passes over the scheduler's columns, the slots of the last committed batch
reused when the request order repeats (the map keeps them), no Python loop over requests.
Anything unusual goes to :func:`_convert`, which gives the same batch or names the culprit
(``tests/test_convert_bulk.py`` compares the two).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import attrgetter
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np

from ._common import INT32_MAX
from .batch import APPEND, StepBatch
from .step import StepInput, StepTypeError

__all__ = ["SlotMap", "SlotMapDelta", "batch_from_step", "batch_from_scheduler_output", "check_step", "explain",
           "LIMIT"]

LIMIT = INT32_MAX  # NOTE: every count and block id of an id-keyed step is in [0, LIMIT]
_INT = {int}
_LISTS = {list, tuple}
NEW, RESUMED, APPENDS = 0, 1, 2  # row kinds


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_EMPTY = _frozen(np.zeros(0, dtype=np.int64))
_CU0 = _frozen(np.zeros(1, dtype=np.int64))
_NO_RUNS = (_EMPTY, _EMPTY, _EMPTY, _CU0, _EMPTY)


# ----------------------------------------------------------------------------------------------
# request id -> slot
# ----------------------------------------------------------------------------------------------
@dataclass
class SlotMapDelta:
    """What a converted step changes in the :class:`SlotMap` (applied by :meth:`SlotMap.commit`)."""

    freed: List[str] = field(default_factory=list)          # ids releasing their slot
    preempted: List[str] = field(default_factory=list)      # ids remembered as preempted
    forgotten: List[str] = field(default_factory=list)      # finished ids dropped from `preempted`
    taken: Dict[str, int] = field(default_factory=dict)     # id -> slot it takes
    order: List[str] = field(default_factory=list)          # ids of the batch rows
    new: List[str] = field(default_factory=list)            # ids sent as new requests (for error messages)
    slots: Optional[np.ndarray] = field(default=None, compare=False, repr=False)  # their slots


class SlotMap:
    """Request id -> slot, for the id-keyed front ends. Free slots are taken lowest first.

    Change it only through :meth:`commit` (it keeps the last batch's rows and slots to convert the
    next steady step without a lookup per request).

    Parameters
    ----------
    max_num_reqs : int
        Number of slots.
    """

    def __init__(self, max_num_reqs: int):
        self.max_num_reqs = max_num_reqs
        self.slot_of: Dict[str, int] = {}
        self.preempted: Set[str] = set()
        self._free = list(range(max_num_reqs - 1, -1, -1))  # NOTE: a stack; pop() gives the lowest
        self._order: List[str] = []    # NOTE: rows of the last committed batch and their slots
        self._order_slots = _EMPTY

    def commit(self, d: SlotMapDelta) -> None:
        for rid in d.freed:
            self._free.append(self.slot_of.pop(rid))
        if d.freed:
            self._free.sort(reverse=True)
        self.preempted.difference_update(d.forgotten)
        self.preempted.update(d.preempted)
        taken = set(d.taken.values())
        if taken:
            self._free = [s for s in self._free if s not in taken]
        for rid, slot in d.taken.items():
            self.slot_of[rid] = slot
            self.preempted.discard(rid)
        if d.slots is not None and len(d.slots) == len(d.order):
            self._order, self._order_slots = list(d.order), d.slots
        else:
            self._order, self._order_slots = [], _EMPTY


# ----------------------------------------------------------------------------------------------
# the rules
# ----------------------------------------------------------------------------------------------
class _Src(NamedTuple):
    new: str   # where new requests are listed
    run: str   # where running requests are listed


STEP = _Src("new_requests", "running_requests")
SCHED = _Src("scheduled_new_reqs", "scheduled_cached_reqs")


def _bad_int(name: str, v) -> None:
    """Raise for a count or id ``v`` outside the rules (called only when one is bad)."""
    if type(v) is not int:
        raise StepTypeError(f"{name} must be an int >= 0, got {v!r} (a {type(v).__name__}; counts are Python ints)")
    if v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if v > LIMIT:
        raise ValueError(f"{name} must be an int >= 0 and <= {LIMIT} (int32), got {v!r}")


def _ok(v) -> bool:
    return type(v) is int and 0 <= v <= LIMIT


def _ints(vals) -> Optional[np.ndarray]:
    """Python ints in ``[0, LIMIT]`` -> int64 array; None when any is not (the caller names it).

    NOTE: the types first (``np.array`` would truncate floats and take bools), then an overflow-safe
    conversion (OverflowError beyond int64), then one unsigned max (negatives are huge as uint64).
    """
    if not set(map(type, vals)) <= _INT:
        return None
    try:
        a = np.array(vals, dtype=np.int64)
    except OverflowError:
        return None
    if a.shape[0] and a.view(np.uint64).max() > LIMIT:
        return None
    return a


def _id_set(name: str, ids) -> Sequence[str]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)):
        raise StepTypeError(f"{name} must be a set or list of request ids, got the bare string {ids!r}")
    if isinstance(ids, Mapping):
        raise StepTypeError(f"{name} must be a set or list of request ids, got {type(ids).__name__}")
    try:
        ids = list(ids)
    except TypeError:
        raise StepTypeError(f"{name} must be a set or list of request ids, got {type(ids).__name__}") from None
    for rid in ids:
        if not isinstance(rid, str):
            raise StepTypeError(f"{name} must hold str request ids, got {rid!r}")
    return ids


class _Row(NamedTuple):
    where: str
    field: str
    rid: str
    lists: Optional[tuple]
    nc: int
    kind: int


class _Checked(NamedTuple):
    rows: List[_Row]
    finished: Sequence[str]
    preempted: Sequence[str]
    num_groups: Optional[int]


def _rows(src: _Src, num_groups: Optional[int], new, running, nst, finished, preempted, replay_start,
          replay_end) -> _Checked:
    """Every rule that needs no slot map; raise naming the field and request.

    ``new``: [(rid, block_ids, nc)]; ``running``: [(rid, new_block_ids or None, nc, resumed)].
    """
    finished = _id_set("finished_req_ids", finished)
    preempted = _id_set("preempted_req_ids", preempted)
    if not isinstance(nst, Mapping):
        raise StepTypeError(f"num_scheduled_tokens must be a dict of request id -> int, got {type(nst).__name__}")
    gone = set(finished) | set(preempted)
    width = num_groups
    seen: Dict[str, int] = {}
    rows: List[_Row] = []
    all_ids: List[int] = []
    entries = chain(((src.new, "block_ids", rid, lists, nc, NEW) for rid, lists, nc in new),
                    ((src.run, "new_block_ids", rid, lists, nc, RESUMED if rs else APPENDS)
                     for rid, lists, nc, rs in running))
    for where, fld, rid, lists, nc, kind in entries:
        if not isinstance(rid, str):
            raise StepTypeError(f"{where}: request ids must be str, got {rid!r}")
        if rid in seen:
            raise ValueError(f"{where}: request {rid!r} is listed more than once "
                             f"(in {src.new} and/or {src.run})")
        seen[rid] = nc
        if rid in gone:
            raise ValueError(f"{where}: request {rid!r} is also in finished_req_ids / preempted_req_ids")
        if not _ok(nc):
            _bad_int(f"{where}: num_computed_tokens of {rid!r}", nc)
        if rid not in nst:
            raise ValueError(f"{where}: request {rid!r} has no entry in num_scheduled_tokens")
        if lists is not None or kind == NEW:
            if isinstance(lists, (str, bytes)) or not isinstance(lists, (tuple, list)):
                raise StepTypeError(f"{where}: {fld} of {rid!r} must be a tuple with one list per gid, "
                                    f"got {type(lists).__name__}")
            if width is None:
                width = len(lists)
            if len(lists) != width:
                raise ValueError(f"{where}: {fld} of {rid!r} has {len(lists)} per-gid block lists, expected "
                                 f"{width if num_groups is not None else f'{width} (as other requests)'}")
            for g, ids in enumerate(lists):
                if type(ids) not in _LISTS:
                    raise StepTypeError(f"{where}: {fld} of {rid!r} gid {g} must be a list of block ids, "
                                        f"got {type(ids).__name__}")
                all_ids.extend(ids)
        rows.append(_Row(where, fld, rid, None if lists is None else tuple(lists), nc, kind))
    if all_ids and _ints(all_ids) is None:
        for r in rows:
            for g, ids in enumerate(r.lists or ()):
                for k, b in enumerate(ids):
                    if not _ok(b):
                        msg = (f"{r.where}: {r.field} of {r.rid!r} gid {g} has a bad block id {b!r} at "
                               f"{r.field}[{g}][{k}] (block ids are Python ints in [0, {LIMIT}])")
                        raise (StepTypeError if type(b) is not int else ValueError)(msg)
    for rid, n in nst.items():
        if rid not in seen:
            raise ValueError(f"num_scheduled_tokens lists {rid!r}, which is in neither {src.new} nor {src.run}")
        if not _ok(n):
            _bad_int(f"num_scheduled_tokens[{rid!r}]", n)
    for name, mapping in (("replay_start", replay_start), ("replay_end", replay_end)):
        if not mapping:
            continue
        if not isinstance(mapping, Mapping):
            raise StepTypeError(f"{name} must be a dict of request id -> int, got {type(mapping).__name__}")
        for rid, v in mapping.items():
            if rid not in seen:
                raise ValueError(f"{name} lists {rid!r}, which is not scheduled in this step")
            if not _ok(v):
                _bad_int(f"{name}[{rid!r}]", v)
            if name == "replay_start" and nst[rid] > 0 and v > seen[rid]:
                raise ValueError(f"replay_start[{rid!r}] = {v} is outside [0, num_computed_tokens = {seen[rid]}]")
    return _Checked(rows, finished, preempted, width)


def check_step(step: StepInput, num_groups: Optional[int] = None) -> None:
    """The stateless rules of ``step`` (what ``StepInput.validate_static`` runs)."""
    if not isinstance(step, StepInput):
        raise StepTypeError(f"step must be a StepInput, got {type(step).__name__}")
    _rows(STEP, num_groups, _new_of(step), _running_of(step), step.num_scheduled_tokens, step.finished_req_ids,
          step.preempted_req_ids, step.replay_start, step.replay_end)


def _convert(sm: SlotMap, num_groups: Optional[int], src: _Src, new, running, nst, finished, preempted,
             replay_start, replay_end) -> Tuple[StepBatch, SlotMapDelta]:
    """Any step, row by row (the general path): the rules, then the slots."""
    c = _rows(src, num_groups, new, running, nst, finished, preempted, replay_start, replay_end)
    G = c.num_groups
    d = SlotMapDelta()
    _gone(sm, c.finished, c.preempted, d)
    free = _lowest_free(sm, [sm.slot_of[r] for r in d.freed], len(c.rows))
    slots: List[int] = []
    runs_g, runs_s, runs_st, runs_ids, cu = [], [], [], [], [0]
    for r in c.rows:
        rid, kind = r.rid, r.kind
        held = rid in sm.slot_of
        if kind == NEW and held:
            raise ValueError(f"{r.where}: request {rid!r} already holds a slot (send it as running, "
                             f"or finish / preempt it first)")
        if kind == APPENDS and not held:
            raise ValueError(f"{r.where}: request {rid!r} is not in the batch (send it as a new request, "
                             f"or as resumed after preemption)")
        if kind == RESUMED and not held and rid not in sm.preempted:
            raise ValueError(f"{r.where}: request {rid!r} is resumed but was never preempted "
                             f"(unknown to the pipeline)")
        if held:
            slot = sm.slot_of[rid]
        else:
            if not free:
                raise ValueError(f"{r.where}: no free request slot for {rid!r} (max_num_reqs = {sm.max_num_reqs})")
            slot = free.pop()
            d.taken[rid] = slot
        slots.append(slot)
        lists = r.lists if r.lists is not None else tuple([] for _ in range(G or 0))
        for gid, ids in enumerate(lists):
            if kind == APPENDS and not ids:
                continue
            runs_g.append(gid)
            runs_s.append(slot)
            runs_st.append(APPEND if kind == APPENDS else 0)
            runs_ids.extend(ids)
            cu.append(len(runs_ids))
    d.order = [r.rid for r in c.rows]
    d.new = [r.rid for r in c.rows if r.kind == NEW]
    n = len(c.rows)

    def per_row(mapping):
        return np.fromiter((mapping.get(rid, 0) for rid in d.order), dtype=np.int64, count=n) if mapping else None
    d.slots = _frozen(np.array(slots, dtype=np.int64))
    batch = StepBatch(
        req_slots=d.slots, num_computed_tokens=np.fromiter((r.nc for r in c.rows), dtype=np.int64, count=n),
        num_scheduled_tokens=np.fromiter((nst[rid] for rid in d.order), dtype=np.int64, count=n),
        is_new=np.fromiter((r.rid in d.taken for r in c.rows), dtype=bool, count=n),
        free_slots=np.fromiter((sm.slot_of[r] for r in d.freed), dtype=np.int64, count=len(d.freed)),
        write_gids=np.array(runs_g, dtype=np.int64), write_slots=np.array(runs_s, dtype=np.int64),
        write_starts=np.array(runs_st, dtype=np.int64), write_cu=np.array(cu, dtype=np.int64),
        write_ids=np.array(runs_ids, dtype=np.int64),
        replay_start=per_row(replay_start), replay_end=per_row(replay_end))
    return batch, d


# ----------------------------------------------------------------------------------------------
# the steady step
# ----------------------------------------------------------------------------------------------
_ZEROS = [_frozen(np.zeros(0, dtype=bool))]


def _no_new(S: int) -> np.ndarray:
    z = _ZEROS[0]
    if z.shape[0] != S:
        z = _ZEROS[0] = _frozen(np.zeros(S, dtype=bool))
    return z


def _append_runs(G: Optional[int], lists: list, slots: np.ndarray, trusted: bool):
    """Write runs of running requests appending ``lists`` (per request a tuple per gid, or None);
    None when anything is unusual. ``trusted``: the tuples and their entries' types were fixed at
    construction (``RunningRequest``), only the ids are checked."""
    S = len(lists)
    n_none = lists.count(None)
    if n_none == S:
        return _NO_RUNS
    if n_none:
        sel = list(compress(range(S), lists))
        if len(sel) + n_none != S:
            return None  # NOTE: a falsy entry that is not None (e.g. "" or ())
        chosen = list(map(lists.__getitem__, sel))
    else:
        sel, chosen = None, lists
    if not trusted and not set(map(type, chosen)) <= _LISTS:
        return None
    widths = set(map(len, chosen))
    if len(widths) != 1 or (G is not None and G not in widths):
        return None
    G = widths.pop()
    flat = list(chain.from_iterable(chosen))
    if not trusted and not set(map(type, flat)) <= _LISTS:
        return None
    nz = list(compress(range(len(flat)), flat))
    if not nz:
        return _NO_RUNS
    runs = list(map(flat.__getitem__, nz))
    ids = list(chain.from_iterable(runs))
    w_ids = _ints(ids)
    if w_ids is None:
        return None
    k = np.array(nz, dtype=np.int64)
    row = k // G
    gids = k - row * G
    if sel is not None:
        row = np.array(sel, dtype=np.int64)[row]
    N = k.shape[0]
    if len(ids) == N:
        cu = np.arange(N + 1, dtype=np.int64)
    else:
        cu = np.zeros(N + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, runs), dtype=np.int64, count=N), out=cu[1:])
    return gids, slots[row], np.full(N, APPEND, dtype=np.int64), cu, w_ids


def _lowest_free(sm: SlotMap, freed_slots: List[int], k: int) -> List[int]:
    """The ``k`` lowest free slots after ``freed_slots`` are released, in descending order (a stack).

    NOTE: ``sm._free`` is kept sorted descending, so its lowest ``k`` are its last ``k``.
    """
    if not freed_slots:
        return sm._free[-k:] if k else []
    return sorted(sm._free[-k:] + freed_slots)[:k][::-1] if k else []


def _gone(sm: SlotMap, finished, preempted, d: SlotMapDelta) -> Set[str]:
    """Fill the delta's freed / preempted / forgotten ids; return the finished or preempted ids."""
    gone = set()
    for rid in chain(finished, preempted):
        if rid not in gone:
            gone.add(rid)
            if rid in sm.slot_of:
                d.freed.append(rid)
    d.preempted = [r for r in preempted if r in sm.slot_of or r in sm.preempted]
    d.forgotten = [r for r in finished if r in sm.preempted]
    return gone


def _fast(sm: SlotMap, G: Optional[int], new: list, ids: list, lists: list, ncs: list, nst, finished, preempted,
          trusted: bool) -> Optional[Tuple[StepBatch, SlotMapDelta]]:
    """A step without resumed requests or replay bounds: running requests in C-level passes over the
    scheduler's columns, the few new ones row by row; None whenever anything is unusual (then
    :func:`_convert` gives the same batch or names the culprit).

    ``new``: [(rid, block_ids, nc)]; ``trusted``: the block tuples and their entries' types were fixed
    at construction (``NewRequest`` / ``RunningRequest``), only the ids are checked.
    """
    d = SlotMapDelta()
    try:
        S, K = len(ids), len(new)
        if not S + K or type(nst) is not dict or len(nst) != S + K or len(lists) != S or len(ncs) != S \
                or type(ncs) is not list:
            return None
        gone = _gone(sm, _id_set("finished_req_ids", finished), _id_set("preempted_req_ids", preempted), d) \
            if finished or preempted else ()
        if type(ids) is list and ids == sm._order and not gone:
            slots = sm._order_slots  # NOTE: same rows as the last committed batch: distinct, held
        elif S:
            sl = list(map(sm.slot_of.get, ids))
            if None in sl or len(set(ids)) != S or (gone and not gone.isdisjoint(ids)):
                return None
            slots = np.array(sl, dtype=np.int64)
        else:
            slots = _EMPTY
        if K:
            new_ids = [r[0] for r in new]
            all_ids = new_ids + ids
            if not set(map(type, new_ids)) <= {str} or len(set(all_ids)) != S + K \
                    or (gone and not gone.isdisjoint(new_ids)) or any(map(sm.slot_of.__contains__, new_ids)):
                return None
        else:
            all_ids = ids
        qs = list(nst.values()) if list(nst) == all_ids else list(map(nst.__getitem__, all_ids))
    except (TypeError, KeyError):
        return None
    counts = _ints([r[2] for r in new] + ncs + qs if K else ncs + qs)  # NOTE: one pass (type, overflow, range)
    if counts is None:
        return None
    runs = _append_runs(G, lists, slots, trusted)
    if runs is None:
        return None
    is_new = _no_new(S)
    free_slots = _EMPTY
    if d.freed:
        free_slots = np.array([sm.slot_of[r] for r in d.freed], dtype=np.int64)
    if K:
        free = _lowest_free(sm, free_slots.tolist(), K)
        if len(free) < K:
            return None
        new_runs = _new_runs(G, new, free, trusted)
        if new_runs is None:
            return None
        for r, slot in zip(new, reversed(free)):
            d.taken[r[0]] = slot
        d.new = new_ids
        slots = np.concatenate([np.array(free[::-1], dtype=np.int64), slots])
        is_new = np.concatenate([np.ones(K, dtype=bool), is_new])
        runs = tuple(np.concatenate([a, b]) for a, b in zip(new_runs[:3], runs[:3])) + \
            (np.concatenate([new_runs[3], runs[3][1:] + new_runs[3][-1]]), np.concatenate([new_runs[4], runs[4]]))
    w_g, w_s, w_st, w_cu, w_ids = runs
    n = S + K
    batch = StepBatch(req_slots=_frozen(slots) if K or slots is not sm._order_slots else slots,
                      num_computed_tokens=counts[:n], num_scheduled_tokens=counts[n:], is_new=is_new,
                      free_slots=free_slots, write_gids=w_g, write_slots=w_s, write_starts=w_st, write_cu=w_cu,
                      write_ids=w_ids)
    d.order, d.slots = list(all_ids), batch.req_slots
    return batch, d


def _new_runs(G: Optional[int], new: list, free: List[int], trusted: bool):
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


# ----------------------------------------------------------------------------------------------
# the two front ends
# ----------------------------------------------------------------------------------------------
_REQ_ID, _NEW_BLOCKS, _COMPUTED, _RESUMED = (attrgetter(a) for a in ("req_id", "new_block_ids",
                                                                      "num_computed_tokens", "resumed"))


def _new_of(step: StepInput):
    return [(r.req_id, r.block_ids, r.num_computed_tokens) for r in step.new_requests]


def _running_of(step: StepInput):
    return [(r.req_id, r.new_block_ids, r.num_computed_tokens, bool(r.resumed)) for r in step.running_requests]


def batch_from_step(step: StepInput, slots: SlotMap, num_groups: Optional[int] = None
                    ) -> Tuple[StepBatch, SlotMapDelta]:
    """Convert a :class:`StepInput` (pure: ``slots`` is not changed; commit the delta after the
    pipeline accepted the batch).

    Raises ValueError naming the request and field for anything a scheduler could get wrong (the
    rules in the module docstring).
    """
    if not isinstance(step, StepInput):
        raise StepTypeError(f"step must be a StepInput, got {type(step).__name__}")
    run = step.running_requests
    if not step.replay_start and not step.replay_end and not any(map(_RESUMED, run)):
        done = _fast(slots, num_groups, _new_of(step), list(map(_REQ_ID, run)), list(map(_NEW_BLOCKS, run)),
                     list(map(_COMPUTED, run)), step.num_scheduled_tokens, step.finished_req_ids,
                     step.preempted_req_ids, True)
        if done is not None:
            return done
    return _convert(slots, num_groups, STEP, _new_of(step), _running_of(step), step.num_scheduled_tokens,
                    step.finished_req_ids, step.preempted_req_ids, step.replay_start, step.replay_end)


def _field(obj, name: str, where: str):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise StepTypeError(f"{where} has no field {name!r} (a vLLM-style SchedulerOutput is expected)") from None


def _column(obj, name: str, n: int, where: str) -> list:
    v = _field(obj, name, where)
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Sequence):
        raise StepTypeError(f"{where}.{name} must be a list (one entry per request), got {type(v).__name__}")
    if len(v) != n:
        raise ValueError(f"{where}.{name} has {len(v)} entries, {where}.req_ids has {n}")
    return v if type(v) is list else list(v)


def batch_from_scheduler_output(out, slots: SlotMap, num_groups: Optional[int] = None, *,
                                replay_start: Optional[dict] = None, replay_end: Optional[dict] = None
                                ) -> Tuple[StepBatch, SlotMapDelta]:
    """Build a :class:`StepBatch` from a vLLM-style ``SchedulerOutput`` (duck-typed; pure: commit
    the delta after the pipeline accepted the batch).

    Reads ``out.scheduled_new_reqs`` (``req_id``, ``block_ids`` per group, ``num_computed_tokens``),
    ``out.scheduled_cached_reqs`` (``req_ids``, ``new_block_ids`` (per request: a tuple per group or
    None), ``num_computed_tokens``, and ``resumed_req_ids`` (a set) or ``resumed_from_preemption``
    (a list of bools, older vLLM)), ``out.num_scheduled_tokens`` (dict), ``out.finished_req_ids`` and,
    when present, ``out.preempted_req_ids``. A resumed request carries its whole block lists. Every
    other field (``scheduled_spec_decode_tokens``, ``new_token_ids``, ``num_output_tokens``, ...) is
    ignored. vLLM has no replay bounds: pass ``replay_start`` / ``replay_end`` (dicts by request id)
    for prefix hits (README "vLLM integration").
    """
    c = _field(out, "scheduled_cached_reqs", "SchedulerOutput")
    ids = _field(c, "req_ids", "scheduled_cached_reqs")
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence):
        raise StepTypeError(f"scheduled_cached_reqs.req_ids must be a list of request ids, got {type(ids).__name__}")
    S = len(ids)
    ids = ids if type(ids) is list else list(ids)
    nbs = _column(c, "new_block_ids", S, "scheduled_cached_reqs")
    ncs = _column(c, "num_computed_tokens", S, "scheduled_cached_reqs")
    if hasattr(c, "resumed_req_ids"):
        resumed = _id_set("scheduled_cached_reqs.resumed_req_ids", c.resumed_req_ids)
        if resumed and not set(ids).issuperset(resumed):
            rid = next(r for r in resumed if r not in set(ids))
            raise ValueError(f"scheduled_cached_reqs.resumed_req_ids lists {rid!r}, which is not in "
                             f"scheduled_cached_reqs.req_ids")
    elif hasattr(c, "resumed_from_preemption"):
        flags = _column(c, "resumed_from_preemption", S, "scheduled_cached_reqs")
        bad = [f for f in flags if type(f) is not bool]
        if bad:
            raise StepTypeError(f"scheduled_cached_reqs.resumed_from_preemption must hold bools, got {bad[0]!r}")
        resumed = list(compress(ids, flags))
    else:
        raise StepTypeError("scheduled_cached_reqs has neither 'resumed_req_ids' nor 'resumed_from_preemption'")
    new = _field(out, "scheduled_new_reqs", "SchedulerOutput")
    if isinstance(new, (str, bytes, Mapping)) or not isinstance(new, Sequence):
        raise StepTypeError(f"scheduled_new_reqs must be a list of NewRequestData, got {type(new).__name__}")
    nst = _field(out, "num_scheduled_tokens", "SchedulerOutput")
    finished = _field(out, "finished_req_ids", "SchedulerOutput")
    preempted = getattr(out, "preempted_req_ids", None)  # NOTE: absent before vLLM's model runner v2
    new_rows = [(_field(r, "req_id", f"scheduled_new_reqs[{i}]"), _field(r, "block_ids", f"scheduled_new_reqs[{i}]"),
                 _field(r, "num_computed_tokens", f"scheduled_new_reqs[{i}]")) for i, r in enumerate(new)]
    if not replay_start and not replay_end and not resumed:
        done = _fast(slots, num_groups, new_rows, ids, nbs, ncs, nst, finished, preempted, False)
        if done is not None:
            return done
    resumed = set(resumed)
    running = [(rid, nb, nc, rid in resumed) for rid, nb, nc in zip(ids, nbs, ncs)]
    return _convert(slots, num_groups, SCHED, new_rows, running, nst, finished, preempted,
                    replay_start or {}, replay_end or {})


# ----------------------------------------------------------------------------------------------
# the pipeline's array-level errors, in the scheduler's terms
# ----------------------------------------------------------------------------------------------
_POS = re.compile(r"write_ids\[(\d+)\]|write run (\d+)|\bslot (\d+)")


def explain(error: ValueError, batch: StepBatch, delta: SlotMapDelta, src: str = "step") -> ValueError:
    """``error`` (raised by the pipeline for a converted ``batch``) with its array positions named
    as the scheduler's requests and fields: ``write_ids[j]`` -> ``running_requests['a'].new_block_ids[g][k]``,
    ``write run r`` -> ``new_requests['a'].block_ids[g]``, ``slot s`` -> ``request 'a' (slot s)``.

    ``src``: ``"step"`` (a StepInput) or ``"scheduler_output"``. Returns a new exception of the same
    type (raise it ``from error``), or ``error`` itself when it names no position it can map.
    """
    order, slots = delta.order, np.asarray(batch.req_slots).tolist()
    if len(order) != len(slots):
        return error
    rid_of = dict(zip(slots, order))
    new_where, run_where = (STEP if src == "step" else SCHED)
    fresh = set(delta.new)

    def run_field(r: int) -> Optional[str]:
        if batch.write_gids is None or not 0 <= r < len(batch.write_gids):
            return None
        rid = rid_of.get(int(batch.write_slots[r]))
        if rid is None:
            return None
        g = int(batch.write_gids[r])
        return (f"{new_where}[{rid!r}].block_ids[{g}]" if rid in fresh else
                f"{run_where}[{rid!r}].new_block_ids[{g}]")

    def sub(m: re.Match) -> str:
        if m.group(1) is not None and batch.write_cu is not None:
            j = int(m.group(1))
            cu = np.asarray(batch.write_cu)
            r = int(np.searchsorted(cu, j, side="right")) - 1
            f = run_field(r)
            return m.group(0) if f is None else f"{f}[{j - int(cu[r])}]"
        if m.group(2) is not None:
            f = run_field(int(m.group(2)))
            return m.group(0) if f is None else f
        s = int(m.group(3))
        return f"request {rid_of[s]!r} (slot {s})" if s in rid_of else m.group(0)

    msg = _POS.sub(sub, str(error))
    return error if msg == str(error) else type(error)(msg)
