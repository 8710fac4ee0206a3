"""Transactional ``update()`` (issue 11 "Transactional updates", DESIGN §5): a rejected step raises
``ValueError`` naming the culprit and leaves the pipeline exactly as it was.

A reference-scheduler trace runs through pipeline A and pipeline B. At several points A is fed a bad
step, built by mutating the real next step (``StepInput`` or its ``StepBatch`` form), either right
after a ``build()`` or between an ``update()`` and its ``build()`` (a staged, unbuilt step). Then:

* the error is a ``ValueError`` whose message names the field / request id / slot at fault;
* every attribute of A (tables, host mirror, block counts, request state and its steady-step cache,
  slot map, staging buffers, the last plan and stats, build context) is unchanged (identity included);
* A and B (which never saw a bad step) hold equal state after every later ``update()`` and equal
  outputs (every metadata tensor, device tables, a top-k conversion) after every later ``build()``.

Kinds (``KINDS``, one test id each): id / count / request confusion, block ids, the three leaks of
the issue (a finished or preempted request dropped before a late failure; an earlier group's append
kept when the last group's run is rejected; a block id past its own group's int32 limit), coverage
per group, rings, circular capacity, ``checks="full"`` contract checks, and the ``StepBatch`` forms.
Two layouts: tiny with ring sliding tables, and the same with a circular ``c4_state`` group.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from dsv4_index import MetadataPipeline
from dsv4_index.batch import APPEND, StepBatch
from dsv4_index.frontend import batch_from_step
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput

from helpers.rejections import R, STAGED, T_MAX, VARIANTS, clean_run, diff as _diff, make_pipe, outputs, state, trace

MAX_POINTS = 3
INTERP = bool(os.environ.get("TRITON_INTERPRET")) or torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------
# rejection kinds: make(ctx) mutates the real next step into (bad step, pad_to, regex the message
# must match), or returns None where this step offers no such mutation
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Ctx:
    step: StepInput      # the real next step
    pipe: MetadataPipeline

    @property
    def G(self) -> int:
        return len(self.pipe.layout.groups)

    def batch(self) -> StepBatch:
        return batch_from_step(self.step, self.pipe.slot_map, self.G)[0]


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[Ctx], Optional[tuple]]
    variant: str = "ring"
    checks: str = "safe"
    min_points: int = 2


KINDS = {}
esc, rep = re.escape, dataclasses.replace


def K(name, make, **kw):
    KINDS[name] = Kind(name, make, **kw)


def KB(name, make, **kw):
    """A StepBatch kind: ``make(ctx, batch)`` mutates the batch form of the real step."""
    K(name, lambda c: make(c, c.batch()), **kw)


def _on(x, f):
    return None if x is None or x is False else f(x)


def _reqs(step):
    return [*step.new_requests, *step.running_requests]


def _lists(r):
    return [list(x) for x in (r.block_ids if isinstance(r, NewRequest) else r.new_block_ids)]


def _with(r, lists=None, nc=None):
    kw = {} if lists is None else {"block_ids" if isinstance(r, NewRequest) else "new_block_ids": tuple(lists)}
    return rep(r, **kw) if nc is None else rep(r, num_computed_tokens=nc, **kw)


def _swap(step, old, new, **kw):
    return rep(step, new_requests=[new if r is old else r for r in step.new_requests],
               running_requests=[new if r is old else r for r in step.running_requests], **kw)


def _pick(step, pred=lambda r: True, running=None):
    return next((r for r in _reqs(step) if (running is None or isinstance(r, RunningRequest) == running)
                 and pred(r)), None)


def _appending(r):
    return isinstance(r, RunningRequest) and not r.resumed


def _nst(step, **kw):
    return {**step.num_scheduled_tokens, **kw}


def _fresh(n, base=5000):
    return list(range(base, base + n))


def _fresh_lists(c, tokens):
    return tuple(_fresh(1 if g.kind == "circular" else -(-tokens // g.alloc_block_size)) for g in c.pipe.layout.groups)


def _add(c, new=(), running=(), **nst):
    return rep(c.step, new_requests=[*c.step.new_requests, *new], running_requests=[*c.step.running_requests, *running],
               num_scheduled_tokens=_nst(c.step, **nst))


def _edit(c, r, g, fn):
    """The step with ``fn(list)`` as ``r``'s block list of group ``g``."""
    lists = _lists(r)
    lists[g] = fn(lists[g])
    return _swap(c.step, r, _with(r, lists))


def _width_error(c, g):
    grp, t = c.pipe.layout.groups[g], c.pipe.tables
    return rf"would hold \d+ blocks in gid {g} \({grp.name}\), the table holds {int(t.logical[g])} \(max_model_len\)"


def _bloat_last(c, r):  # the last group's run past the table width (the last check of the last run)
    return _edit(c, r, c.G - 1, lambda ids: ids + _fresh(int(c.pipe.tables.logical[-1]) + 1))


# -- StepInput: ids, counts, request confusion ---------------------------------------------------
for _f in ("finished_req_ids", "preempted_req_ids"):
    K(f"{_f[:-8]}_ids_bare_string", lambda c, f=_f: (rep(c.step, **{f: "ab"}), None, esc(
        f"{f} must be a set or list of request ids, got the bare string 'ab'")))
K("duplicate_running_req_id", lambda c: _on(_pick(c.step, running=True), lambda r: (
    rep(c.step, running_requests=[*c.step.running_requests, r]), None,
    esc(f"request {r.req_id!r} is listed more than once"))))
K("duplicate_new_req_id", lambda c: _on(_pick(c.step, running=False), lambda r: (
    rep(c.step, new_requests=[*c.step.new_requests, r]), None, esc(f"request {r.req_id!r} is listed more than once"))))
K("unknown_running_request", lambda c: (_add(c, running=[RunningRequest("zz", tuple([] for _ in range(c.G)), 5)], zz=1),
                                        None, esc("request 'zz' is not in the batch")))
K("resumed_request_never_preempted", lambda c: (
    _add(c, running=[RunningRequest("zz", _fresh_lists(c, 8), 0, resumed=True)], zz=8), None,
    esc("request 'zz' is resumed but was never preempted")))
K("running_request_also_finished", lambda c: _on(_pick(c.step, running=True), lambda r: (
    rep(c.step, finished_req_ids=[*c.step.finished_req_ids, r.req_id]), None,
    esc(f"request {r.req_id!r} is also in finished_req_ids"))))
K("scheduled_request_not_listed", lambda c: (rep(c.step, num_scheduled_tokens=_nst(c.step, zz=1)), None,
                                             esc("num_scheduled_tokens lists 'zz'")))
K("negative_num_scheduled_tokens", lambda c: _on(next(iter(c.step.num_scheduled_tokens), None), lambda rid: (
    rep(c.step, num_scheduled_tokens=_nst(c.step, **{rid: -1})), None,
    esc(f"num_scheduled_tokens[{rid!r}] must be an int >= 0, got -1"))))
K("negative_num_computed_tokens", lambda c: _on(_pick(c.step, running=True), lambda r: (
    _swap(c.step, r, _with(r, nc=-1)), None, esc(f"num_computed_tokens of {r.req_id!r} must be an int >= 0, got -1"))))
K("wrong_number_of_block_lists", lambda c: _on(_pick(c.step, running=True), lambda r: (
    _swap(c.step, r, _with(r, _lists(r)[:-1])), None,
    esc(f"new_block_ids of {r.req_id!r} has {c.G - 1} per-gid block lists, expected {c.G}"))))
K("negative_replay_end", lambda c: _on(_pick(c.step), lambda r: (
    rep(c.step, replay_end={**c.step.replay_end, r.req_id: -1}), None,
    esc(f"replay_end[{r.req_id!r}] must be an int >= 0, got -1"))))
K("replay_end_beyond_int32", lambda c: _on(  # NOTE: a wrapped value lets replayed tokens overwrite shared KV
    _pick(c.step, lambda r: _appending(r) and c.step.num_scheduled_tokens[r.req_id] > 0), lambda r: (
        rep(c.step, replay_end={**c.step.replay_end, r.req_id: 2**32}), None,
        esc(f"replay_end[{r.req_id!r}] must be an int >= 0 and <= {2**31 - 1} (int32), got {2**32}"))))
K("too_many_tokens", lambda c: _on(next(iter(c.step.num_scheduled_tokens), None), lambda rid: (
    rep(c.step, num_scheduled_tokens=_nst(c.step, **{rid: c.step.num_scheduled_tokens[rid] + T_MAX + 1
                                                     - c.step.total_tokens})), None,
    esc(f"schedules {T_MAX + 1} tokens, more than max_num_batched_tokens = {T_MAX}"))))
K("pad_to_below_num_tokens", lambda c: _on(c.step.total_tokens or None, lambda T: (
    c.step, T - 1, esc(f"pad_to must be an int in [{T}, {T_MAX}], got {T - 1}"))))
K("pad_to_above_capacity", lambda c: (c.step, T_MAX + 1, esc(f"in [{c.step.total_tokens}, {T_MAX}], got {T_MAX + 1}")))
K("pad_to_not_an_int", lambda c: (c.step, float(T_MAX), esc(f"pad_to must be an int in [{c.step.total_tokens}, "
                                                            f"{T_MAX}], got {float(T_MAX)}")))


def _new_holding_slot(c):
    gone = {*c.step.finished_req_ids, *c.step.preempted_req_ids}
    held = [rid for rid in c.pipe.slot_map.slot_of if rid not in gone]
    idle = [rid for rid in held if rid not in c.step.num_scheduled_tokens]
    msg = "request {!r} already holds a slot"
    if idle:
        return _add(c, new=[NewRequest(idle[0], _fresh_lists(c, 4), 0)], **{idle[0]: 4}), None, esc(msg.format(idle[0]))
    r = _pick(c.step, lambda r: _appending(r) and r.req_id in held)  # NOTE: send it as new instead
    back = NewRequest(r.req_id, _lists(r), r.num_computed_tokens) if r else None
    return r and (rep(c.step, new_requests=[*c.step.new_requests, back],
                      running_requests=[x for x in c.step.running_requests if x is not r]), None,
                  esc(msg.format(r.req_id)))


def _too_many_requests(c):
    sm = c.pipe.slot_map
    freed = {r for r in (*c.step.finished_req_ids, *c.step.preempted_req_ids) if r in sm.slot_of}
    free = R - len(sm.slot_of) + len(freed) - len(c.step.new_requests)
    zz = [NewRequest(f"zz{k}", _fresh_lists(c, 1), 0) for k in range(free + 1)]
    return (_add(c, new=zz, **{r.req_id: 1 for r in zz}), None,
            esc(f"no free request slot for 'zz{free}' (max_num_reqs = {R})"))


def _replay_start_beyond(c):
    r = _pick(c.step, lambda r: _appending(r) and c.step.num_scheduled_tokens[r.req_id] > 0)
    if r is None:
        return None
    nc = r.num_computed_tokens
    return (rep(c.step, replay_start={**c.step.replay_start, r.req_id: nc + 1}), None,
            esc(f"replay_start[{r.req_id!r}] = {nc + 1} is outside [0, num_computed_tokens = {nc}]"))


K("new_request_already_holding_slot", _new_holding_slot)
K("too_many_requests", _too_many_requests)
K("replay_start_beyond_num_computed", _replay_start_beyond)

# -- StepInput: block ids --------------------------------------------------------------------------
_HAS_IDS = lambda r: any(_lists(r))  # noqa: E731
_FIRST_G = lambda r: next(g for g, ids in enumerate(_lists(r)) if ids)  # noqa: E731
K("non_int_block_id", lambda c: _on(_pick(c.step, _HAS_IDS), lambda r: (
    _edit(c, r, _FIRST_G(r), lambda ids: ids[:-1] + [7.5]), None,
    esc(f"{r.req_id!r} gid {_FIRST_G(r)} has a bad block id 7.5"))))
K("negative_block_id", lambda c: _on(_pick(c.step, _HAS_IDS), lambda r: (
    _edit(c, r, _FIRST_G(r), lambda ids: ids[:-1] + [-3]), None,
    esc(f"{r.req_id!r} gid {_FIRST_G(r)} has a bad block id -3"))))


def _int32_late(c):  # issue leak 3: the earlier groups' appends of the same request are valid
    r = _pick(c.step, lambda r: _appending(r) and any(_lists(r)[:-1]) and _lists(r)[-1])
    t, g = c.pipe.tables, c.G - 1
    big = int(t.id_max[g]) + 1
    assert big <= int(t.id_max[0])  # NOTE: the same id is fine in gid 0: the limit is the group's
    return r and (_edit(c, r, g, lambda ids: ids[:-1] + [big]), None,
                  rf"= {big} in gid {g} \({c.pipe.layout.groups[g].name}\) gives slots beyond int32")


def _dropped_then_late_failure(c, field):  # issue leak 1: the dropped request must stay
    gone = [rid for rid in getattr(c.step, field) if rid in c.pipe.slot_map.slot_of]
    r = _pick(c.step)
    return gone and r and (_bloat_last(c, r), None, _width_error(c, c.G - 1))


K("block_id_beyond_int32_of_its_group", _int32_late)
K("table_width_overflow_last_group", lambda c: _on(  # issue leak 2: an earlier group's append must not stay
    _pick(c.step, lambda r: _appending(r) and any(_lists(r)[:-1])), lambda r: (_bloat_last(c, r), None,
                                                                               _width_error(c, c.G - 1))))
K("finished_request_then_late_failure", lambda c: _dropped_then_late_failure(c, "finished_req_ids"))
K("preempted_request_then_late_failure", lambda c: _dropped_then_late_failure(c, "preempted_req_ids"),
  variant="circular")


def _need(layout, g, seq):
    """Blocks group ``g`` must hold for ``seq`` tokens (DESIGN §4, from the layout's channels)."""
    grp = layout.groups[g]
    if grp.kind == "circular":
        return int(seq > 0)
    return max(-(-(seq // ch.compress_ratio) // ch.rows_per_block) if ch.compress_ratio > 1
               else -(-seq // grp.block_size) for ch in layout.channels.values() if ch.gid == g)


def _missing(c, g):
    """A request's last block of group ``g`` dropped, where the step needs it."""
    lay, t = c.pipe.layout, c.pipe.tables
    for r in _reqs(c.step):
        n = len(_lists(r)[g])
        have = int(t.num_blocks[g, c.pipe.slot_of(r.req_id)]) if _appending(r) else 0
        if n and have + n - 1 < _need(lay, g, r.num_computed_tokens + c.step.num_scheduled_tokens[r.req_id]):
            return (_edit(c, r, g, lambda ids: ids[:-1]), None,
                    esc(f"block ids missing for gid {g} ({lay.groups[g].name}) of slot"))
    return None


def _ring_overrun(c):
    """A swa append so long that the ring would overwrite blocks the step still reads."""
    t = c.pipe.tables
    ring = int(t.ring[1])
    for r in filter(_appending, c.step.running_requests):
        if int(t.num_blocks[1, c.pipe.slot_of(r.req_id)]) + len(_lists(r)[1]) + ring + 1 <= int(t.logical[1]):
            return (_edit(c, r, 1, lambda ids: ids + _fresh(ring + 1)), None,
                    esc(f"gid 1 (swa) is a ring of {ring} blocks"))
    return None


def _null_circular_block(c):
    """A new request's circular block is the null block 0 (its ring would overwrite the shared null block)."""
    for r in c.step.new_requests:
        if _lists(r)[2]:
            return _edit(c, r, 2, lambda ids: [0]), None, esc("the null block 0 in circular group gid 2")
    return None


for _g in range(4):
    K(f"missing_block_ids_gid{_g}", lambda c, g=_g: _missing(c, g))
K("missing_circular_block_gid2", lambda c: _missing(c, 2), variant="circular")
K("ring_holds_fewer_blocks_than_the_step_reads", _ring_overrun)
K("full_check_null_block_in_circular_group", _null_circular_block, variant="circular", checks="full")


# -- checks="full" only ----------------------------------------------------------------------------
def _id_already_in_row(c):
    for r in filter(_appending, c.step.running_requests):
        s = c.pipe.slot_of(r.req_id)
        row = c.pipe.tables.row(0, s)
        if _lists(r)[0] and row.size:  # NOTE: its last block: its own (a prefix-shared one is a "safe" rejection)
            return (_edit(c, r, 0, lambda ids, row=row: [int(row[-1])] + ids[1:]), None,
                    esc(f"block id {int(row[-1])} twice in gid 0 of slot {s}"))
    return None


K("full_check_block_id_already_in_row", _id_already_in_row, checks="full")
K("full_check_block_id_twice_in_new_request", lambda c: _on(
    _pick(c.step, lambda r: len(_lists(r)[0]) >= 2, running=False), lambda r: (
        _edit(c, r, 0, lambda ids: ids[:-2] + ids[-1:] * 2), None,  # NOTE: its own last block, not a shared one
        rf"block id {_lists(r)[0][-1]} twice in gid 0 of slot")),
  checks="full")
K("full_check_null_block_in_full_group", lambda c: _on(_pick(c.step, lambda r: bool(_lists(r)[0])), lambda r: (
    _edit(c, r, 0, lambda ids: ids[:-1] + [0]), None, esc("the null block 0 in full group gid 0"))), checks="full")


def _null_in_window(c, g, running):
    """A sliding block the step reads or writes is the null block: a running request's first appended
    block (at or past its window start), or a new request's last block (it holds the last token)."""
    r = _pick(c.step, lambda r: (_appending(r) if running else not isinstance(r, RunningRequest))
              and bool(_lists(r)[g]) and _lists(r)[g][0 if running else -1] != 0)
    if r is None:
        return None
    k = 0 if running else len(_lists(r)[g]) - 1
    field = (f"running_requests[{r.req_id!r}].new_block_ids" if running else f"new_requests[{r.req_id!r}].block_ids")
    return (_edit(c, r, g, lambda ids: ids[:k] + [0] + ids[k + 1:]), None,
            rf"^the null block 0 in sliding group gid {g} \({c.pipe.layout.groups[g].name}\) of slot \d+ \(batch row "
            rf"\d+\): block \d+ \(positions \d+\.\.\d+(, rank-local)?\), from write_ids\[\d+\]; the step reads .*"
            + esc(f"= {field}[{g}][{k}]"))


K("full_check_null_block_in_window_of_running_request", lambda c: _null_in_window(c, 1, True), checks="full")
K("full_check_null_block_in_window_of_new_request", lambda c: _null_in_window(c, 3, False), checks="full")


# -- StepBatch ---------------------------------------------------------------------------------------
def _set(b, **arrays):
    return rep(b, **{k: np.asarray(v) for k, v in arrays.items()})


def _patch(b, field, i, value):
    a = np.array(getattr(b, field))
    a[i] = value
    return _set(b, **{field: a})


def _runs(b):
    return [[int(g), int(s), int(st), [int(x) for x in b.write_ids[b.write_cu[i]:b.write_cu[i + 1]]]]
            for i, (g, s, st) in enumerate(zip(b.write_gids, b.write_slots, b.write_starts))]


def _pack(b, runs):
    return _set(b, write_gids=[r[0] for r in runs], write_slots=[r[1] for r in runs], write_starts=[r[2] for r in runs],
                write_cu=np.cumsum([0] + [len(r[3]) for r in runs]),
                write_ids=np.asarray([x for r in runs for x in r[3]], dtype=np.int64))


def _row(b, pred):
    return next((i for i in range(b.num_rows) if pred(i)), None)


def _free_slot(c, b):  # a slot holding no request, not taken by this step
    return next((s for s in range(R) if not c.pipe.requests.occupied[s] and s not in b.req_slots[b.is_new]), None)


def _hole(c, b):
    runs = _runs(b)
    g, s = runs[0][:2]
    have = 0 if s in b.req_slots[b.is_new] else int(c.pipe.tables.num_blocks[g, s])
    runs[0][2] = have + 1
    return _pack(b, runs), None, esc(f"write_starts[0] = {have + 1} leaves a hole")


def _too_many_staged(c, b):
    width = int(c.pipe.tables.logical[0])
    if b.num_rows * width <= STAGED:
        return None
    slots = {int(s) for s in b.req_slots}
    runs = [r for r in _runs(b) if r[0] != 0 or r[1] not in slots]
    runs += [[0, s, 0, _fresh(width)] for s in sorted(slots)]  # NOTE: rewrite the full group's row of every slot
    return _pack(b, runs), None, rf"the step stages \d+ block ids, more than max_staged_blocks = {STAGED}"


def _late_run(c, b, fn, pattern):
    """``fn`` applied to the ids of a last-group run whose slot also appends to an earlier group."""
    runs = _runs(b)
    early = {r[1] for r in runs if r[0] < c.G - 1 and r[3]}
    i = next((i for i, r in enumerate(runs) if r[0] == c.G - 1 and r[1] in early and r[3]), None)
    if i is None:
        return None
    runs[i][3] = fn(runs[i][3])
    return _pack(b, runs), None, pattern


KB("batch_slot_out_of_range", lambda c, b: b.num_rows and (
    _patch(b, "req_slots", 0, R), None, esc(f"req_slots[0] = {R} is not a slot in [0, {R})")))
KB("batch_slot_negative", lambda c, b: b.num_rows and (
    _patch(b, "req_slots", -1, -1), None, esc(f"req_slots[{b.num_rows - 1}] = -1 is not a slot in [0, {R})")))
KB("batch_duplicate_slots", lambda c, b: b.num_rows >= 2 and (
    _patch(b, "req_slots", 1, b.req_slots[0]), None, esc(f"req_slots: slot {b.req_slots[0]} appears in 2 batch rows")))
KB("batch_is_new_on_occupied_slot", lambda c, b: _on(_row(b, lambda i: not b.is_new[i]), lambda i: (
    _patch(b, "is_new", i, True), None, esc(f"req_slots[{i}] = {b.req_slots[i]} is new but still holds a request"))))
KB("batch_non_new_row_on_free_slot", lambda c, b: _on(_row(b, lambda i: b.is_new[i]), lambda i: (
    _patch(b, "is_new", i, False), None, esc(f"req_slots[{i}] = {b.req_slots[i]} holds no request (mark it is_new)"))))
KB("batch_free_a_free_slot", lambda c, b: _on(_free_slot(c, b), lambda s: (
    _set(b, free_slots=[*b.free_slots, s]), None,
    esc(f"free_slots[{len(b.free_slots)}] = {s} does not hold a request"))))
KB("batch_free_slot_twice", lambda c, b: _on(next(
    (s for s in range(R) if c.pipe.requests.occupied[s] and s not in b.free_slots), None), lambda s: (
    _set(b, free_slots=[*b.free_slots, s, s]), None, esc("free_slots lists a slot twice"))))
KB("batch_two_runs_for_one_group_slot", lambda c, b: b.num_runs and (
    _pack(b, _runs(b) + [[int(b.write_gids[0]), int(b.write_slots[0]), APPEND, _fresh(1)]]), None,
    esc(f"two write runs for gid {b.write_gids[0]}, slot {b.write_slots[0]}")))
KB("batch_write_run_hole", lambda c, b: b.num_runs and _hole(c, b))
KB("batch_write_to_slot_without_request", lambda c, b: b.num_runs and _on(_free_slot(c, b), lambda s: (
    _patch(b, "write_slots", 0, s), None, esc(f"write_slots[0] = {s} holds no request after this step"))))
KB("batch_write_cu_past_the_ids", lambda c, b: b.num_runs and (
    _patch(b, "write_cu", -1, b.write_cu[-1] + 1), None, esc("write_cu must rise from 0 to len(write_ids)")))
KB("batch_negative_block_id", lambda c, b: b.num_runs and len(b.write_ids) and (
    _patch(b, "write_ids", 0, -3), None, esc("write_ids[0] = -3 is negative")))
KB("batch_write_gid_out_of_range", lambda c, b: b.num_runs and (
    _patch(b, "write_gids", 0, c.G), None, esc(f"write_gids[0] = {c.G} is not a group in [0, {c.G})")))
KB("batch_float_array", lambda c, b: b.num_rows and (
    rep(b, num_computed_tokens=b.num_computed_tokens.astype(np.float64)), None,
    esc("num_computed_tokens must be a 1-D integer array, got dtype float64")))
KB("batch_wrong_array_length", lambda c, b: b.num_rows and (
    rep(b, num_scheduled_tokens=b.num_scheduled_tokens[:-1]), None,
    esc(f"num_scheduled_tokens has {b.num_rows - 1} entries, expected {b.num_rows}")))
KB("batch_write_slots_wrong_length", lambda c, b: b.num_runs and (
    rep(b, write_slots=b.write_slots[:-1]), None,
    esc(f"write_slots has {b.num_runs - 1} entries, expected {b.num_runs}")))
KB("batch_negative_num_scheduled", lambda c, b: b.num_rows and (
    _patch(b, "num_scheduled_tokens", 0, -1), None, esc("num_scheduled_tokens[0] = -1 is negative")))
KB("batch_negative_replay_end", lambda c, b: _on(_row(b, lambda i: b.num_scheduled_tokens[i] > 0), lambda i: (
    _set(b, replay_end=np.where(np.arange(b.num_rows) == i, -1, 0 if b.replay_end is None else b.replay_end)), None,
    esc(f"replay_end of slot {b.req_slots[i]} = -1 is negative"))))
KB("batch_staged_ids_beyond_max_staged_blocks", _too_many_staged)
KB("batch_block_id_beyond_int32_last_group", lambda c, b: _late_run(
    c, b, lambda ids: ids[:-1] + [int(c.pipe.tables.id_max[-1]) + 1],
    rf"= {int(c.pipe.tables.id_max[-1]) + 1} in gid {c.G - 1} \(c128_state\) gives slots beyond int32"))
KB("batch_width_overflow_last_group", lambda c, b: _late_run(
    c, b, lambda ids: ids + _fresh(int(c.pipe.tables.logical[-1]) + 1), _width_error(c, c.G - 1)))



# ----------------------------------------------------------------------------------------------
# the acceptance test
# ----------------------------------------------------------------------------------------------
def _reject(pipe, kind, ctx) -> bool:
    bad = kind.make(ctx)
    if not bad:  # NOTE: None / False / 0: not applicable here
        return False
    step, pad_to, pattern = bad
    before = state(pipe)
    with pytest.raises(ValueError) as e:
        pipe.update(step, pad_to=pad_to)
    assert re.search(pattern, str(e.value)), f"{kind.name}: message {str(e.value)!r} does not match {pattern!r}"
    changed = _diff(before, state(pipe))
    assert not changed, f"{kind.name}: the rejected step changed {changed}"
    return True


CASES = [(k.name, k.variant, False) for k in KINDS.values()]
CASES += [(name, "circular", False) for name in (  # NOTE: a few kinds on the other layout too
    "table_width_overflow_last_group", "finished_request_then_late_failure", "batch_block_id_beyond_int32_last_group",
    "batch_duplicate_slots")]
CASES += [(name, "ring", True) for name in (  # NOTE: the fused launch applies staged writes itself
    "table_width_overflow_last_group", "batch_block_id_beyond_int32_last_group")]


@pytest.mark.parametrize("name,variant,fused", CASES, ids=[
    n + ("-fused" if f else "") + ("-circular" if v != KINDS[n].variant else "") for n, v, f in CASES])
@pytest.mark.slow  # ./dev quick skips it
def test_rejected_step_changes_nothing(name, variant, fused):
    if fused and not INTERP:
        pytest.skip("the fused pipeline needs CUDA or TRITON_INTERPRET=1")
    kind = KINDS[name]
    steps, pads = trace(variant, fused)
    want = clean_run(variant, kind.checks, fused)
    a = make_pipe(variant, kind.checks, fused)
    points, last = [], -9
    for i, (step, pad) in enumerate(zip(steps, pads)):
        # NOTE: alternate where the bad step lands: after a build, or between update and build
        staged = len(points) % 2 == 1
        ctx = Ctx(step, a)
        if i and staged and len(points) < MAX_POINTS and i - last >= 2 and _reject(a, kind, ctx):
            points.append((i, "staged"))
            last = i
        if i:
            d = _diff(outputs(a.build()), want[i - 1][2])
            assert not d, f"{name}: outputs of step {i - 1} differ after rejections at {points}: {d}"
            d = _diff(state(a, ids=False), want[i - 1][1])
            assert not d, f"{name}: state after build {i - 1} differs after rejections at {points}: {d}"
        if i and not staged and len(points) < MAX_POINTS and i - last >= 2 and _reject(a, kind, ctx):
            points.append((i, "built"))
            last = i
        a.update(step, pad_to=pad)
        d = _diff(state(a, ids=False), want[i][0])
        assert not d, f"{name}: state after update {i} differs after rejections at {points}: {d}"
    assert not _diff(outputs(a.build()), want[-1][2])
    assert len(points) >= kind.min_points, f"{name}: injected only at {points} (trace has too few chances)"


def test_at_least_30_kinds_and_the_issue_cases():
    assert len(KINDS) >= 30
    for must in ("finished_request_then_late_failure", "preempted_request_then_late_failure",
                 "table_width_overflow_last_group", "block_id_beyond_int32_of_its_group",
                 "finished_ids_bare_string"):
        assert must in KINDS


# ----------------------------------------------------------------------------------------------
# the full-check kinds pass the safe level (the split is real), and a preempted request may come
# back as a NewRequest (DESIGN §5)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [k.name for k in KINDS.values() if k.checks == "full"])
def test_full_only_rejections_pass_safe_checks(name):
    kind = KINDS[name]
    steps, pads = trace(kind.variant)
    safe = make_pipe(kind.variant, "safe")
    for i, (step, pad) in enumerate(zip(steps, pads)):
        bad = kind.make(Ctx(step, safe)) if i else None
        if bad:
            safe.update(bad[0], pad_to=bad[1])  # accepted: only checks="full" looks for this
            return
        safe.update(step, pad_to=pad)
        safe.build()
    pytest.fail(f"{name}: no point of the trace to inject at")


def _as_new(step: StepInput) -> StepInput:
    """Every resumed request sent back as a NewRequest instead (same id, blocks, computed tokens)."""
    back = [NewRequest(r.req_id, r.new_block_ids, r.num_computed_tokens) for r in step.running_requests if r.resumed]
    return rep(step, new_requests=[*back, *step.new_requests],
               running_requests=[r for r in step.running_requests if not r.resumed])


def _resumed_last(step: StepInput) -> StepInput:
    """The same step with resumed requests last among the running ones (the batch order of _as_new: the
    running requests, then the new ones)."""
    return rep(step, running_requests=sorted(step.running_requests, key=lambda r: r.resumed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_preempted_request_may_come_back_as_new(variant):
    steps, pads = trace(variant)
    a, b = make_pipe(variant), make_pipe(variant)
    n = 0
    for i, (step, pad) in enumerate(zip(steps, pads)):
        alt = _as_new(step)
        n += len(alt.new_requests) - len(step.new_requests)
        a.update(alt, pad_to=pad)
        b.update(_resumed_last(step), pad_to=pad)
        assert not _diff(state(a, ids=False), state(b, ids=False)), i
        assert not _diff(outputs(a.build()), outputs(b.build())), i
    assert n >= 1, "the trace has no preempted request that comes back"
