"""The array-form step (:class:`StepBatch`) and the front ends that build it.

A serving engine keeps each request in a persistent *slot* (a row of every block table, like vLLM's
model runner v2 ``RequestState``) from arrival to finish; a step is then a handful of arrays::

    batch row i (the engine's order)   req_slots[i], num_computed_tokens[i], num_scheduled_tokens[i]
    block writes (one run per (group, slot))   write_gids[r], write_slots[r], write_starts[r],
                                               write_ids[write_cu[r]:write_cu[r + 1]]
    slots released before the step     free_slots

:meth:`MetadataPipeline.update` takes a ``StepBatch`` directly (the fast path). Two front ends build
one from id-keyed inputs and own the request-id -> slot map (:class:`SlotMap`):

* :func:`batch_from_step` converts a :class:`~dsv4_index.step.StepInput`;
* :func:`batch_from_scheduler_output` reads the lists a vLLM-style ``SchedulerOutput`` already holds
  (``scheduled_new_reqs``, ``scheduled_cached_reqs``, ``num_scheduled_tokens``, ``finished_req_ids``,
  ``preempted_req_ids``).

Both are pure: they return the batch and a :class:`SlotMapDelta` that the caller commits only after
the pipeline accepted the batch, so a rejected step changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from .step import StepInput

__all__ = ["StepBatch", "SlotMap", "SlotMapDelta", "batch_from_step", "batch_from_scheduler_output",
           "APPEND"]

APPEND = -1  # NOTE: a write run starting at APPEND continues the row where it ends (the slot's block count)


@dataclass
class StepBatch:
    """One scheduler step as arrays (all 1-D numpy integer arrays; int32 or int64).

    Attributes
    ----------
    req_slots : int [B]
        Request slot (block-table row, ``0 <= slot < max_num_reqs``) of each batch row, distinct.
        The pipeline orders the device batch decode-first itself (stable), so any order is accepted.
    num_computed_tokens : int [B]
        Tokens of the row's request whose KV is cached before this step; the step schedules
        positions ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``.
    num_scheduled_tokens : int [B]
        Tokens scheduled per row (speculative tokens included), ``>= 0``. Rows with 0 tokens update
        the request's state and blocks but are not part of the device batch.
    is_new : bool [B], optional
        The row's request starts in this step (new, or back after preemption): its slot must be
        free (after ``free_slots``) and its block lists start empty. Default: no new rows.
    free_slots : int [F], optional
        Slots released before this step (finished and preempted requests).
    write_gids, write_slots, write_starts : int [N], optional
        Block writes, one run per (group, slot): the run sets the slot's logical blocks
        ``[start, start + n)`` of group ``gid`` to its ids and cuts the row there. ``start`` is in
        allocation blocks (the scheduler's unit); ``APPEND`` (-1) continues the row. A run may not
        leave a hole (``start <= `` the row's current length).
    write_cu : int [N + 1], optional
        Offsets of each run's ids in ``write_ids`` (``write_cu[0] == 0``).
    write_ids : int [write_cu[-1]], optional
        Allocation block ids (expanded to kernel-block ids by the tables for hybrid blocks).
    replay_start, replay_end : int [B], optional
        Bounded replay (DESIGN §4): window lists of a row start at ``replay_start`` at the earliest;
        tokens at ``pos < replay_end`` write nothing into prefix-cacheable groups.
    """

    req_slots: np.ndarray
    num_computed_tokens: np.ndarray
    num_scheduled_tokens: np.ndarray
    is_new: Optional[np.ndarray] = None
    free_slots: Optional[np.ndarray] = None
    write_gids: Optional[np.ndarray] = None
    write_slots: Optional[np.ndarray] = None
    write_starts: Optional[np.ndarray] = None
    write_cu: Optional[np.ndarray] = None
    write_ids: Optional[np.ndarray] = None
    replay_start: Optional[np.ndarray] = None
    replay_end: Optional[np.ndarray] = None

    @property
    def num_rows(self) -> int:
        return len(self.req_slots)

    @property
    def num_tokens(self) -> int:
        return int(np.sum(self.num_scheduled_tokens)) if len(self.num_scheduled_tokens) else 0

    @property
    def num_runs(self) -> int:
        return 0 if self.write_gids is None else len(self.write_gids)

    def to_json(self) -> dict:
        """Plain-list form (for traces); inverse of :meth:`from_json`."""
        return {k: (None if v is None else np.asarray(v).tolist()) for k, v in self.__dict__.items()}

    @classmethod
    def from_json(cls, d: dict) -> "StepBatch":
        def arr(k, dtype=np.int64):
            v = d.get(k)
            return None if v is None else np.asarray(v, dtype=dtype)
        return cls(**{k: arr(k, bool if k == "is_new" else np.int64) for k in cls.__dataclass_fields__})


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


class SlotMap:
    """Request id -> slot, for the id-keyed front ends. Free slots are taken lowest first.

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


def _id_set(name: str, ids) -> Sequence[str]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must be a set or list of request ids, got the bare string {ids!r}")
    try:
        ids = list(ids)
    except TypeError:
        raise ValueError(f"{name} must be a set or list of request ids, got {type(ids).__name__}") from None
    for rid in ids:
        if not isinstance(rid, str):
            raise ValueError(f"{name} must hold str request ids, got {rid!r}")
    return ids


_INT = {int}


def _convert_bulk(slots: SlotMap, num_groups: Optional[int], rids: list, lists: list, ncs: list, nst: dict
                  ) -> Optional[Tuple[StepBatch, SlotMapDelta]]:
    """The common step (running requests only: no new, resumed, finished or preempted request, no
    replay) in C-level passes over the request lists. Returns None whenever anything is unusual;
    then :func:`_convert` decides (and names the culprit).

    NOTE: it accepts only steps that :func:`_convert` accepts, with the same result
    (``tests/test_convert_bulk.py`` compares the two on random steps).
    """
    try:
        S = len(rids)
        if S == 0 or type(nst) is not dict or len(nst) != S or len(set(rids)) != S \
                or not set(map(type, rids)) <= {str} or nst.keys() != set(rids):
            return None
        sl = list(map(slots.slot_of.get, rids))
        if None in sl:
            return None
        qs = list(map(nst.__getitem__, rids))
        if not set(map(type, ncs)) <= _INT or not set(map(type, qs)) <= _INT or min(ncs) < 0 or min(qs) < 0:
            return None
        widths = set(map(len, lists))
        if len(widths) != 1 or not set(map(type, lists)) <= {tuple}:
            return None
        G = widths.pop()
        if num_groups is not None and G != num_groups:
            return None
        flat = list(chain.from_iterable(lists))
        if not set(map(type, flat)) <= {list}:
            return None
        lens = np.fromiter(map(len, flat), dtype=np.int64, count=S * G)
        ids = list(chain.from_iterable(flat))
        if ids and (not set(map(type, ids)) <= _INT or min(ids) < 0):
            return None
    except (TypeError, KeyError, AttributeError):
        return None
    nz = np.flatnonzero(lens)
    slot_arr = np.asarray(sl, dtype=np.int64)
    cu = np.zeros(nz.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens[nz], out=cu[1:])
    batch = StepBatch(
        req_slots=slot_arr, num_computed_tokens=np.asarray(ncs, dtype=np.int64),
        num_scheduled_tokens=np.asarray(qs, dtype=np.int64), is_new=np.zeros(S, dtype=bool),
        free_slots=np.zeros(0, dtype=np.int64), write_gids=nz % G, write_slots=slot_arr[nz // G],
        write_starts=np.full(nz.shape[0], APPEND, dtype=np.int64), write_cu=cu,
        write_ids=np.asarray(ids, dtype=np.int64))
    return batch, SlotMapDelta(order=rids)


_REQ_ID, _NEW_BLOCKS, _COMPUTED, _RESUMED = (attrgetter(a) for a in ("req_id", "new_block_ids",
                                                                      "num_computed_tokens", "resumed"))


def _convert(slots: SlotMap, num_groups: Optional[int], new, running, nst: dict, finished, preempted,
             replay_start: dict, replay_end: dict) -> Tuple[StepBatch, SlotMapDelta]:
    """Core of both front ends. ``new``: [(rid, lists, nc)]; ``running``: [(rid, lists, nc, resumed)]."""
    finished = _id_set("finished_req_ids", finished)
    preempted = _id_set("preempted_req_ids", preempted)
    if not isinstance(nst, dict):
        raise ValueError(f"num_scheduled_tokens must be a dict, got {type(nst).__name__}")
    d = SlotMapDelta()
    gone = set()
    for rid in (*finished, *preempted):
        if rid in gone:
            continue
        gone.add(rid)
        if rid in slots.slot_of:
            d.freed.append(rid)
    d.preempted = [r for r in preempted if r in slots.slot_of or r in slots.preempted]
    d.forgotten = [r for r in finished if r in slots.preempted]
    free_set = set(slots._free) | {slots.slot_of[r] for r in d.freed}
    free = sorted(free_set, reverse=True)

    rows: List[Tuple[str, int, int, bool]] = []   # (rid, slot, nc, is_new)
    runs_g, runs_s, runs_st, runs_ids, cu = [], [], [], [], [0]
    seen: Set[str] = set()

    def add_runs(rid, slot, lists, start, field):
        # NOTE: `field` names the culprit: "new_requests: block_ids" or "running_requests: new_block_ids"
        if isinstance(lists, (str, bytes)) or not isinstance(lists, (tuple, list)):
            raise ValueError(f"{field} of {rid!r} must be a tuple with one list per gid, got {type(lists).__name__}")
        if num_groups is not None and len(lists) != num_groups:
            raise ValueError(f"{field} of {rid!r} has {len(lists)} per-gid block lists, expected {num_groups}")
        for gid, ids in enumerate(lists):
            if ids is None or (start == APPEND and len(ids) == 0):
                continue
            if not isinstance(ids, (list, tuple, np.ndarray)):
                raise ValueError(f"{field} of {rid!r} gid {gid} must be a list, got {type(ids).__name__}")
            for b in ids:
                if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0:
                    raise ValueError(f"{field} of {rid!r} gid {gid} has a bad block id {b!r}")
            runs_g.append(gid)
            runs_s.append(slot)
            runs_st.append(start)
            runs_ids.extend(ids)
            cu.append(len(runs_ids))

    def check_common(what, rid, nc):
        if not isinstance(rid, str):
            raise ValueError(f"{what}: request ids must be str, got {rid!r}")
        if rid in seen:
            raise ValueError(f"{what}: request {rid!r} is listed more than once")
        seen.add(rid)
        if rid in gone:
            raise ValueError(f"{what}: request {rid!r} is also in finished_req_ids / preempted_req_ids")
        if isinstance(nc, bool) or not isinstance(nc, (int, np.integer)) or nc < 0:
            raise ValueError(f"{what}: num_computed_tokens of {rid!r} must be an int >= 0, got {nc!r}")
        if rid not in nst:
            raise ValueError(f"{what}: request {rid!r} has no entry in num_scheduled_tokens")

    for rid, lists, nc in new:
        check_common("new_requests", rid, nc)
        if rid in slots.slot_of and rid not in d.freed:
            raise ValueError(f"new_requests: request {rid!r} already holds a slot (send it as running, "
                             f"or finish / preempt it first)")
        if not free:
            raise ValueError(f"new_requests: no free request slot for {rid!r} "
                             f"(max_num_reqs = {slots.max_num_reqs})")
        slot = free.pop()
        d.taken[rid] = slot
        rows.append((rid, slot, nc, True))
        add_runs(rid, slot, lists, 0, "new_requests: block_ids")
    for rid, lists, nc, resumed in running:
        check_common("running_requests", rid, nc)
        held = rid in slots.slot_of and rid not in d.freed
        if held:
            slot = slots.slot_of[rid]
            rows.append((rid, slot, nc, False))
            add_runs(rid, slot, lists, 0 if resumed else APPEND, "running_requests: new_block_ids")
        elif resumed and rid in slots.preempted:
            if not free:
                raise ValueError(f"running_requests: no free request slot to resume {rid!r}")
            slot = free.pop()
            d.taken[rid] = slot
            rows.append((rid, slot, nc, True))
            add_runs(rid, slot, lists, 0, "running_requests: new_block_ids")
        elif resumed:
            raise ValueError(f"running_requests: request {rid!r} is resumed but was never preempted "
                             f"(unknown to the pipeline)")
        else:
            raise ValueError(f"running_requests: request {rid!r} is not in the batch (send it as a "
                             f"NewRequest, or as resumed after preemption)")
    for rid, n in nst.items():
        if rid not in seen:
            raise ValueError(f"num_scheduled_tokens lists {rid!r}, which is in neither new_requests "
                             f"nor running_requests")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"num_scheduled_tokens[{rid!r}] must be an int >= 0, got {n!r}")

    def per_row(name, mapping):
        if not mapping:
            return None
        if not isinstance(mapping, dict):
            raise ValueError(f"{name} must be a dict of request id -> int, got {type(mapping).__name__}")
        for rid, v in mapping.items():
            if rid not in seen:
                raise ValueError(f"{name} lists {rid!r}, which is not scheduled in this step")
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name}[{rid!r}] must be an int >= 0, got {v!r}")
        return np.fromiter((mapping.get(r[0], 0) for r in rows), dtype=np.int64, count=len(rows))

    d.order = [r[0] for r in rows]
    batch = StepBatch(
        req_slots=np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows)),
        num_computed_tokens=np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows)),
        num_scheduled_tokens=np.fromiter((nst[r[0]] for r in rows), dtype=np.int64, count=len(rows)),
        is_new=np.fromiter((r[3] for r in rows), dtype=bool, count=len(rows)),
        free_slots=np.fromiter((slots.slot_of[r] for r in d.freed), dtype=np.int64, count=len(d.freed)),
        write_gids=np.asarray(runs_g, dtype=np.int64), write_slots=np.asarray(runs_s, dtype=np.int64),
        write_starts=np.asarray(runs_st, dtype=np.int64), write_cu=np.asarray(cu, dtype=np.int64),
        write_ids=np.asarray(runs_ids, dtype=np.int64),
        replay_start=per_row("replay_start", replay_start), replay_end=per_row("replay_end", replay_end))
    return batch, d


def batch_from_step(step: StepInput, slots: SlotMap, num_groups: Optional[int] = None
                    ) -> Tuple[StepBatch, SlotMapDelta]:
    """Convert a :class:`StepInput` (pure: ``slots`` is not changed; commit the delta after the
    pipeline accepted the batch).

    Raises ValueError naming the field for anything a scheduler could get wrong: unknown running
    requests, duplicate ids, a bare string for an id set, negative counts, bad block ids, ...
    """
    if not isinstance(step, StepInput):
        raise ValueError(f"step must be a StepInput, got {type(step).__name__}")
    run = step.running_requests
    if not step.new_requests and not step.finished_req_ids and not step.preempted_req_ids \
            and not step.replay_start and not getattr(step, "replay_end", None) and not any(map(_RESUMED, run)):
        done = _convert_bulk(slots, num_groups, list(map(_REQ_ID, run)), list(map(_NEW_BLOCKS, run)),
                             list(map(_COMPUTED, run)), step.num_scheduled_tokens)
        if done is not None:
            return done
    new = [(r.req_id, r.block_ids, r.num_computed_tokens) for r in step.new_requests]
    running = [(r.req_id, r.new_block_ids, r.num_computed_tokens, bool(r.resumed))
               for r in step.running_requests]
    return _convert(slots, num_groups, new, running, step.num_scheduled_tokens, step.finished_req_ids,
                    step.preempted_req_ids, step.replay_start, getattr(step, "replay_end", None) or {})


def batch_from_scheduler_output(out, slots: SlotMap, num_groups: Optional[int] = None, *,
                                replay_start: Optional[dict] = None, replay_end: Optional[dict] = None
                                ) -> Tuple[StepBatch, SlotMapDelta]:
    """Build a :class:`StepBatch` from a vLLM-style ``SchedulerOutput`` (duck-typed).

    Reads ``out.scheduled_new_reqs`` (``req_id``, ``block_ids`` per group, ``num_computed_tokens``),
    ``out.scheduled_cached_reqs`` (``req_ids``, ``new_block_ids`` (per request: a tuple per group or
    None), ``num_computed_tokens``, and ``resumed_req_ids`` (a set) or ``resumed_from_preemption``
    (a list of bools)), ``out.num_scheduled_tokens`` (dict), ``out.finished_req_ids`` and, when
    present, ``out.preempted_req_ids``. A resumed request carries its whole block lists.
    """
    c = out.scheduled_cached_reqs
    ids = list(c.req_ids)
    resumed_set = getattr(c, "resumed_req_ids", None)
    if resumed_set is not None:
        resumed = [rid in resumed_set for rid in ids] if resumed_set else [False] * len(ids)
    else:
        resumed = list(getattr(c, "resumed_from_preemption", [False] * len(ids)))
    finished = getattr(out, "finished_req_ids", ())
    preempted = getattr(out, "preempted_req_ids", ()) or ()
    if not out.scheduled_new_reqs and not finished and not preempted and not replay_start and not replay_end \
            and not any(resumed) and None not in c.new_block_ids:
        done = _convert_bulk(slots, num_groups, ids, [tuple(x) for x in c.new_block_ids], list(c.num_computed_tokens),
                             dict(out.num_scheduled_tokens))
        if done is not None:
            return done
    new = [(r.req_id, tuple(r.block_ids), r.num_computed_tokens) for r in out.scheduled_new_reqs]
    empty = (None,) * (num_groups or 0)
    running = [(rid, tuple(nb) if nb is not None else empty, nc, rs)
               for rid, nb, nc, rs in zip(ids, c.new_block_ids, c.num_computed_tokens, resumed)]
    return _convert(slots, num_groups, new, running, dict(out.num_scheduled_tokens), finished, preempted,
                    replay_start or {}, replay_end or {})
