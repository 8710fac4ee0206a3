"""The id-keyed conversions: a :class:`~dsv4_index.frontend.step_input.StepInput`
(:func:`batch_from_step`) or a vLLM-style ``SchedulerOutput`` (:func:`batch_from_scheduler_output`)
into a :class:`~dsv4_index.batch.StepBatch` and a :class:`~dsv4_index.state.requests.SlotMapDelta`,
through the request-id -> slot map (:class:`~dsv4_index.state.requests.SlotMap`).

The rules of an id-keyed step live in :mod:`dsv4_index.frontend.rules` (the stateless part, which
``StepInput.validate_static`` runs too); :func:`convert` adds the slot-map part. Errors name the
scheduler's field and the request id, e.g. ``running_requests: new_block_ids of 'a' gid 1 has a bad
block id 2147483648 at new_block_ids[1][0]``; a finished or preempted id the map never saw is a no-op.
:func:`explain` names the pipeline's array-level errors (``write_ids[j]``, ``slot s``) the same way.

Batch rows are in vLLM's order: the running requests as listed, then the new requests (vLLM appends
admitted requests to its running list, so the next step lists them in that order). A new (or
resumed) request takes the lowest free slot, in the order the step lists them.

Speed (``benchmarks/FRONTEND.md``): a step without resumed requests or replay bounds (a steady decode,
or one with a few new / finished requests) takes :func:`dsv4_index.frontend.fast.convert_repeat`:
C-level passes over the scheduler's columns, the request slots of the last committed batch reused when the
request order repeats, no Python loop over requests. Anything unusual goes to :func:`convert`, which
gives the same batch or names the culprit (``tests/frontend/test_convert_bulk.py`` compares the two).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from itertools import compress
from operator import attrgetter, countOf
from typing import Optional, Tuple

import numpy as np

from ..batch import APPEND, StepBatch
from ..state.messages import Rejection
from ..state.requests import SlotMap, SlotMapDelta, frozen
from .fast import convert_repeat, convert_requests
from .rules import APPENDS, NEW, RESUMED, SCHED, STEP, Src, StepTypeError, check_rows, id_set
from .step_input import NewRequest, RunningRequest, StepInput, new_of, running_of

__all__ = ["batch_from_step", "batch_from_scheduler_output", "convert", "explain"]


def convert(sm: SlotMap, num_groups: Optional[int], src: Src, new, running, nst, finished, preempted,
            replay_start, replay_end) -> Tuple[StepBatch, SlotMapDelta]:
    """Any step, row by row (the general path): the rules, then the slots. Pure (``sm`` unchanged)."""
    c = check_rows(src, num_groups, new, running, nst, finished, preempted, replay_start, replay_end)
    G = c.num_groups
    d = SlotMapDelta()
    sm.gone(c.finished, c.preempted, d)
    for r in c.rows:  # NOTE: the slot-map rules, in the order the step lists the requests
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
    rows = [r for r in c.rows if r.kind != NEW] + [r for r in c.rows if r.kind == NEW]  # NOTE: vLLM's order
    free = sm.lowest_free([sm.slot_of[r] for r in d.freed], len(rows))
    slot_of = {}
    for r in rows:  # NOTE: a request without a slot takes the lowest free one, in row order
        if r.rid in sm.slot_of:
            slot_of[r.rid] = sm.slot_of[r.rid]
        else:
            if len(d.taken) == len(free):
                raise ValueError(f"{r.where}: no free request slot for {r.rid!r} (max_num_reqs = {sm.max_num_reqs})")
            slot_of[r.rid] = d.taken[r.rid] = free[len(d.taken)]
    runs_g, runs_s, runs_st, runs_ids, cu = [], [], [], [], [0]
    for r in rows:
        slot = slot_of[r.rid]
        for gid, ids in enumerate(r.lists if r.lists is not None else tuple([] for _ in range(G or 0))):
            if r.kind == APPENDS and not ids:
                continue
            runs_g.append(gid)
            runs_s.append(slot)
            runs_st.append(APPEND if r.kind == APPENDS else 0)
            runs_ids.extend(ids)
            cu.append(len(runs_ids))
    d.order = [r.rid for r in rows]
    d.new = [r.rid for r in rows if r.kind == NEW]
    n = len(rows)

    def per_row(mapping):
        return np.fromiter((mapping.get(rid, 0) for rid in d.order), dtype=np.int64, count=n) if mapping else None
    d.slots = frozen(np.fromiter((slot_of[rid] for rid in d.order), dtype=np.int64, count=n))
    batch = StepBatch(
        req_slots=d.slots, num_computed_tokens=np.fromiter((r.nc for r in rows), dtype=np.int64, count=n),
        num_scheduled_tokens=np.fromiter((nst[rid] for rid in d.order), dtype=np.int64, count=n),
        is_new=np.fromiter((rid in d.taken for rid in d.order), dtype=bool, count=n),
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


def batch_from_step(step: StepInput, slot_map: SlotMap, num_groups: Optional[int] = None
                    ) -> Tuple[StepBatch, SlotMapDelta]:
    """Convert a :class:`StepInput` (pure: ``slot_map`` is not changed; commit the delta after the
    pipeline accepted the batch).

    Raises ValueError naming the request and field for anything a scheduler could get wrong (the
    rules in the module docstring).
    """
    if not isinstance(step, StepInput):
        raise StepTypeError(f"step must be a StepInput, got {type(step).__name__}")
    done = with_drafts(_batch_from_step(step, slot_map, num_groups), step.drafts, "drafts")
    return with_row_counts(done, step.query_lens, "query_lens", "query_lens", "decoder query token count")


def with_drafts(done: Tuple[StepBatch, SlotMapDelta], drafts, where: str) -> Tuple[StepBatch, SlotMapDelta]:
    """``done`` with ``StepBatch.drafts`` from ``drafts`` (``{req_id: count}``; rows not listed: -1,
    the default rule); unchanged when ``drafts`` is empty. A key that is not a row of the step is refused."""
    return with_row_counts(done, drafts, where, "drafts", "draft token count")


def with_row_counts(done: Tuple[StepBatch, SlotMapDelta], counts, where: str, name: str,
                    what: str) -> Tuple[StepBatch, SlotMapDelta]:
    """``done`` with the per-row ``StepBatch`` field ``name`` from ``counts`` (``{req_id: count}``); rows not
    listed: -1 for ``drafts`` (the default rule), the row's scheduled tokens for ``query_lens`` (every token
    queries); unchanged when ``counts`` is empty. A key that is not a row of the step is refused."""
    if not counts:
        return done
    batch, delta = done
    if not isinstance(counts, Mapping):
        raise StepTypeError(f"{where} must be a dict of request id -> {what}, got {type(counts).__name__}")
    rows = set(delta.order)
    for rid, v in counts.items():
        if rid not in rows:
            raise ValueError(f"{where}[{rid!r}]: request {rid!r} is not scheduled in this step")
        if type(v) is not int and not isinstance(v, np.integer):
            raise StepTypeError(f"{where}[{rid!r}] must be an int, got {type(v).__name__}")
    default = np.full(len(delta.order), -1, dtype=np.int64) if name == "drafts" else \
        np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
    d = np.fromiter((counts.get(rid, int(default[i])) for i, rid in enumerate(delta.order)), dtype=np.int64,
                    count=len(delta.order))
    return dataclasses.replace(batch, **{name: d}), delta


def _batch_from_step(step: StepInput, slot_map: SlotMap, num_groups: Optional[int]) -> Tuple[StepBatch, SlotMapDelta]:
    run, new = step.running_requests, step.new_requests
    if not step.replay_start and not step.replay_end:
        done = None
        if countOf(map(type, run), RunningRequest) == len(run):
            # NOTE: the library's own (frozen) request types: the block tuples' shape is trusted (None when a
            # request is resumed)
            done = convert_requests(slot_map, num_groups, new_of(step), run, step.num_scheduled_tokens,
                                    step.finished_req_ids, step.preempted_req_ids,
                                    countOf(map(type, new), NewRequest) == len(new))
        elif not any(map(_RESUMED, run)):
            done = convert_repeat(slot_map, num_groups, new_of(step), list(map(_REQ_ID, run)),
                                  list(map(_NEW_BLOCKS, run)), list(map(_COMPUTED, run)), step.num_scheduled_tokens,
                                  step.finished_req_ids, step.preempted_req_ids, False)
        if done is not None:
            return done
    return convert(slot_map, num_groups, STEP, new_of(step), running_of(step), step.num_scheduled_tokens,
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


def _replay_starts(new: Sequence, new_rows: list) -> dict:
    """``{req_id: replay_start}`` of the new requests that carry a nonzero ``replay_start`` (vLLM's V4.1
    ``NewRequestData`` field; absent before it, 0 = no replay). Values are checked with the step's rules."""
    out = {}
    for r, row in zip(new, new_rows):
        v = getattr(r, "replay_start", 0)
        if v is not None and v != 0:
            out[row[0]] = v
    return out


def batch_from_scheduler_output(out, slot_map: SlotMap, num_groups: Optional[int] = None, *,
                                replay_start: Optional[dict] = None, replay_end: Optional[dict] = None
                                ) -> Tuple[StepBatch, SlotMapDelta]:
    """Build a :class:`StepBatch` from a vLLM-style ``SchedulerOutput`` (duck-typed; pure: commit
    the delta after the pipeline accepted the batch).

    Reads ``out.scheduled_new_reqs`` (``req_id``, ``block_ids`` per group, ``num_computed_tokens``),
    ``out.scheduled_cached_reqs`` (``req_ids``, ``new_block_ids`` (per request: a tuple per group or
    None), ``num_computed_tokens``, and ``resumed_req_ids`` (a set) or ``resumed_from_preemption``
    (a list of bools, older vLLM)), ``out.num_scheduled_tokens`` (dict), ``out.finished_req_ids`` and,
    when present, ``out.preempted_req_ids`` and ``out.scheduled_spec_decode_tokens`` (each request's draft count,
    ``StepBatch.drafts``). A resumed request carries its whole block lists. Every other field
    (``new_token_ids``, ``num_output_tokens``, ...) is ignored. A new request's ``replay_start`` (vLLM's V4.1
    bounded replay, ``NewRequestData.replay_start``; absent in older vLLM, 0 = none) becomes the batch row's
    replay start in this step, and its ``replay_end`` is ``replay_start + W`` (``W`` =
    ``slot_map.replay_window``, vLLM's ``prefix_replay_tokens``: vLLM's model runner V2 pads the
    prefix-cacheable slots of positions ``[replay_start, replay_start + W)``). vLLM sends
    ``replay_start`` only in the step that admits a request: the slot map remembers it (committed with the
    step) and applies both bounds to the request's later steps while they need them (``num_computed_tokens <
    replay_start + max(replay_reach, W)``). ``replay_start`` / ``replay_end`` (dicts by request id) give
    other bounds (README "vLLM integration"): the dict's entry wins over the object's, and a request whose
    ``replay_start`` the caller gives gets no derived ``replay_end``.
    """
    return with_drafts(_from_scheduler_output(out, slot_map, num_groups, replay_start, replay_end),
                       _spec_counts(out), "scheduled_spec_decode_tokens")


def _spec_counts(out) -> dict:
    """``{req_id: len(scheduled_spec_decode_tokens[req_id])}`` for every scheduled request (0 when not listed),
    or ``{}`` when the SchedulerOutput has no such field (the default rule then)."""
    spec = getattr(out, "scheduled_spec_decode_tokens", None)
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise StepTypeError(f"scheduled_spec_decode_tokens must be a dict of request id -> token list, got "
                            f"{type(spec).__name__}")
    nst = getattr(out, "num_scheduled_tokens", None) or {}
    for rid in spec:
        if rid not in nst:
            raise ValueError(f"scheduled_spec_decode_tokens[{rid!r}]: request {rid!r} is not scheduled in this step")
    return {rid: len(spec[rid]) if rid in spec else 0 for rid in nst}


def _from_scheduler_output(out, slot_map: SlotMap, num_groups: Optional[int], replay_start: Optional[dict],
                           replay_end: Optional[dict]) -> Tuple[StepBatch, SlotMapDelta]:
    c = _field(out, "scheduled_cached_reqs", "SchedulerOutput")
    ids = _field(c, "req_ids", "scheduled_cached_reqs")
    if type(ids) is not list and (isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence)):
        raise StepTypeError(f"scheduled_cached_reqs.req_ids must be a list of request ids, got {type(ids).__name__}")
    S = len(ids)
    ids = ids if type(ids) is list else list(ids)
    nbs = _column(c, "new_block_ids", S, "scheduled_cached_reqs")
    ncs = _column(c, "num_computed_tokens", S, "scheduled_cached_reqs")
    if hasattr(c, "resumed_req_ids"):
        resumed = id_set("scheduled_cached_reqs.resumed_req_ids", c.resumed_req_ids)
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
    carried = _replay_starts(new, new_rows)
    remembered, spent = _remembered_replays(slot_map, ids, ncs) if slot_map.replay else ({}, [])
    if carried or remembered:  # NOTE: the caller's dicts, when given, win for the requests they list
        replay_end = _derived_ends(slot_map.replay_window, {**remembered, **carried}, replay_start, replay_end)
        replay_start = {**remembered, **carried, **(replay_start or {})}
    if not replay_start and not replay_end and not resumed:
        done = convert_repeat(slot_map, num_groups, new_rows, ids, nbs, ncs, nst, finished, preempted, False)
        if done is not None:
            done[1].replay_done = spent
            return done
    back = set(resumed)
    running = [(rid, nb, nc, rid in back) for rid, nb, nc in zip(ids, nbs, ncs, strict=True)]
    batch, delta = convert(slot_map, num_groups, SCHED, new_rows, running, nst, finished, preempted,
                           replay_start or {}, replay_end or {})
    given = replay_start or {}
    delta.replay, delta.replay_done = {rid: given[rid] for rid in carried}, spent
    return batch, delta


def _derived_ends(W: int, sched: dict, start: Optional[dict], end: Optional[dict]) -> Optional[dict]:
    """The step's ``replay_end`` dict: ``replay_start + W`` for each scheduler-sent ``replay_start`` in
    ``sched`` whose request the caller's ``start`` does not list, under the caller's ``end`` entries."""
    if not W:
        return end
    own = start if isinstance(start, Mapping) else {}  # NOTE: a bad dict is the step rules' to name
    derived = {rid: rs + W for rid, rs in sched.items() if rid not in own and type(rs) is int}
    if not derived:
        return end
    return {**derived, **end} if isinstance(end, Mapping) else (derived if end is None else end)


def _remembered_replays(slot_map: SlotMap, ids: list, ncs: Sequence) -> Tuple[dict, list]:
    """``({req_id: replay_start}, spent ids)`` of the scheduled running requests admitted with a
    ``replay_start`` (:attr:`SlotMap.replay`): it applies while the request's first token's windows reach
    below it or the token is replayed (``num_computed_tokens < replay_start + max(replay_reach,
    replay_window)``), then it is dropped."""
    live, spent = {}, []
    reach, replay = max(slot_map.replay_reach, slot_map.replay_window), slot_map.replay
    for rid, nc in zip(ids, ncs):
        rs = replay.get(rid)
        if rs is None or type(nc) is not int:  # NOTE: a bad count is the step rules' to name
            continue
        if nc < rs + reach:
            live[rid] = rs
        else:
            spent.append(rid)
    return live, spent
# ----------------------------------------------------------------------------------------------
# the pipeline's array-level errors, in the scheduler's terms
# ----------------------------------------------------------------------------------------------
_POS = re.compile(r"write_ids\[(\d+)\]|write run (\d+)|\bslot (\d+)")


def explain(error: ValueError, batch: StepBatch, delta: SlotMapDelta, src: str = "step") -> ValueError:
    """``error`` (raised by the pipeline for a converted ``batch``) with its array positions named as
    the scheduler's requests and fields, appended so the message keeps its words:
    ``... write_ids[5] = 2147483647 in gid 0 ... [write_ids[5] = running_requests['a'].new_block_ids[0][0]]``,
    ``write run r = new_requests['a'].block_ids[g]``, ``slot s = request 'a'``.

    ``src``: ``"step"`` (a StepInput) or ``"scheduler_output"``. Returns a new exception of the same
    type (raise it ``from error``), or ``error`` itself when it names no position it can map.
    """
    order, req_slots = delta.order, np.asarray(batch.req_slots).tolist()
    if len(order) != len(req_slots):
        return error
    rid_of = dict(zip(req_slots, order, strict=True))
    new_where, run_where = (STEP if src == "step" else SCHED)
    fresh = set(delta.new)

    def run_field(r: int) -> Optional[str]:
        if batch.write_gids is None or batch.write_slots is None or not 0 <= r < len(batch.write_gids):
            return None
        rid = rid_of.get(int(batch.write_slots[r]))
        if rid is None:
            return None
        g = int(batch.write_gids[r])
        return (f"{new_where}[{rid!r}].block_ids[{g}]" if rid in fresh else
                f"{run_where}[{rid!r}].new_block_ids[{g}]")

    def name(kind: str, v: int) -> Optional[str]:
        if kind == "j":
            if batch.write_cu is None:
                return None
            cu = np.asarray(batch.write_cu)
            r = int(np.searchsorted(cu, v, side="right")) - 1
            f = run_field(r)
            return None if f is None else f"{f}[{v - int(cu[r])}]"
        if kind == "r":
            return run_field(v)
        return f"request {rid_of[v]!r}" if v in rid_of else None

    if isinstance(error, Rejection):  # NOTE: the fields of the message (state/messages.py)
        found = error.positions()
    else:  # NOTE: a rejection not (yet) in the table: its positions read from the text
        found = [(m.group(0), k, int(v)) for m in _POS.finditer(str(error))
                 for k, v in zip(("j", "r", "slot"), m.groups()) if v is not None]
    names: dict = {}
    for text, kind, v in found:
        n = name(kind, v)
        if n is not None:
            names.setdefault(text, n)
    if not names:
        return error
    text = f"{error} [{'; '.join(f'{k} = {v}' for k, v in names.items())}]"
    return Rejection(error.code, error.fields, text) if isinstance(error, Rejection) else type(error)(text)
