"""Id-keyed front ends: the conversions of a :class:`~dsv4_index.step.StepInput`
(:func:`batch_from_step`) or of a vLLM-style ``SchedulerOutput`` (:func:`batch_from_scheduler_output`)
into a :class:`~dsv4_index.batch.StepBatch`, through a request-id -> slot map
(:class:`~dsv4_index.slot_map.SlotMap`).

The rules of an id-keyed step live in :mod:`dsv4_index.step_rules` (the stateless part, which
``StepInput.validate_static`` runs too); :func:`_convert` adds the slot-map part. Errors name the
scheduler's field and the request id, e.g. ``running_requests: new_block_ids of 'a' gid 1 has a bad
block id 2147483648 at new_block_ids[1][0]``; a finished or preempted id the map never saw is a no-op.

Speed (``benchmarks/FRONTEND.md``): a step without resumed requests or replay bounds (a steady decode,
or one with a few new / finished requests) takes :func:`dsv4_index.steady_step._fast`: C-level passes
over the scheduler's columns, the slots of the last committed batch reused when the request order
repeats, no Python loop over requests. Anything unusual goes to :func:`_convert`, which gives the
same batch or names the culprit (``tests/test_convert_bulk.py`` compares the two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress
from operator import attrgetter, countOf
from typing import List, Optional, Tuple

import numpy as np

from .batch import APPEND, StepBatch
from .slot_map import SlotMap, SlotMapDelta, _frozen, gone, lowest_free
from .steady_step import _fast
from .step import NewRequest, RunningRequest, StepInput, StepTypeError
from .step_rules import (APPENDS, LIMIT, NEW, RESUMED, SCHED, STEP, _id_set, _new_of, _rows, _running_of, _Src,
                         check_step, explain)

__all__ = ["SlotMap", "SlotMapDelta", "batch_from_step", "batch_from_scheduler_output", "check_step", "explain",
           "LIMIT"]


def _convert(sm: SlotMap, num_groups: Optional[int], src: _Src, new, running, nst, finished, preempted,
             replay_start, replay_end) -> Tuple[StepBatch, SlotMapDelta]:
    """Any step, row by row (the general path): the rules, then the slots."""
    c = _rows(src, num_groups, new, running, nst, finished, preempted, replay_start, replay_end)
    G = c.num_groups
    d = SlotMapDelta()
    gone(sm, c.finished, c.preempted, d)
    free = lowest_free(sm, [sm.slot_of[r] for r in d.freed], len(c.rows))
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
# the two front ends
# ----------------------------------------------------------------------------------------------
_REQ_ID, _NEW_BLOCKS, _COMPUTED, _RESUMED = (attrgetter(a) for a in ("req_id", "new_block_ids",
                                                                      "num_computed_tokens", "resumed"))


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
        trusted = countOf(map(type, run), RunningRequest) == len(run) and \
            countOf(map(type, step.new_requests), NewRequest) == len(step.new_requests)
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


