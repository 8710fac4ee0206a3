"""Id-keyed front ends: the request-id -> slot map (:class:`SlotMap`) and the conversions of a
:class:`~dsv4_index.step.StepInput` (:func:`batch_from_step`) or of a vLLM-style ``SchedulerOutput``
(:func:`batch_from_scheduler_output`) into a :class:`~dsv4_index.batch.StepBatch`.

The rules of an id-keyed step live in :mod:`dsv4_index.step_rules` (the stateless part, which
``StepInput.validate_static`` runs too); :func:`_convert` adds the slot-map part. Errors name the
scheduler's field and the request id, e.g. ``running_requests: new_block_ids of 'a' gid 1 has a bad
block id 2147483648 at new_block_ids[1][0]``; a finished or preempted id the map never saw is a no-op.

Speed (``benchmarks/FRONTEND.md``): a step of running requests only (a steady decode) takes
:func:`_fast`: C-level passes over the scheduler's columns, the slots of the last committed batch
reused when the request order repeats (the map keeps them), no Python loop over requests.
Anything unusual goes to :func:`_convert`, which gives the same batch or names the culprit
(``tests/test_convert_bulk.py`` compares the two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import attrgetter
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from .batch import APPEND, StepBatch
from .step import NewRequest, RunningRequest, StepInput, StepTypeError
from .step_rules import (_LISTS, APPENDS, LIMIT, NEW, RESUMED, SCHED, STEP, _id_set, _ints, _new_of, _rows,  # noqa: F401
                         _running_of, _Src, check_step, explain)

__all__ = ["SlotMap", "SlotMapDelta", "batch_from_step", "batch_from_scheduler_output", "check_step", "explain",
           "LIMIT"]


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
    if trusted:
        # NOTE: entries are lists / tuples (fixed at construction): any() finds the requests with ids
        has = list(compress(range(len(chosen)), map(any, chosen)))
        if not has:
            return _NO_RUNS
        sel = has if sel is None else list(map(sel.__getitem__, has))
        chosen = list(map(chosen.__getitem__, has))
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


_RUNNING, _NEW = {RunningRequest}, {NewRequest}


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
        # NOTE: the block tuples' shape is trusted only from the library's own (frozen) request types
        trusted = set(map(type, run)) <= _RUNNING and set(map(type, step.new_requests)) <= _NEW
        done = _fast(slots, num_groups, _new_of(step), list(map(_REQ_ID, run)), list(map(_NEW_BLOCKS, run)),
                     list(map(_COMPUTED, run)), step.num_scheduled_tokens, step.finished_req_ids,
                     step.preempted_req_ids, trusted)
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
    if type(v) is list and len(v) == n:
        return v
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
    if type(ids) is not list and (isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence)):
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
    if type(new) is not list and (isinstance(new, (str, bytes, Mapping)) or not isinstance(new, Sequence)):
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


