"""Bounded arithmetic (issue 18 item 4, DESIGN §5): every count of a step is range-checked before any
sum, product or ``np.repeat``, so no int64 wrap can pass a check.

Huge, negative and mixed-sign counts (INT64_MAX, 2**62, -2**63, ...) are fed through ``update()`` in
both forms (``StepBatch`` and the id-keyed ``StepInput``), with and without ``pad_to``, between real
steps of a reference-scheduler trace. Each must raise a ``ValueError`` naming its field, leave every
state of the pipeline as it was (tables, host mirror, block counts, request state, slot map, staging
bytes, build context), and the later outputs must equal those of a pipeline that never saw it.
Before the fix, INT64_MAX tokens wrapped the sum and crashed the process in ``np.repeat``; with
``pad_to`` the step raised after the commit and corrupted ``host_query_start_loc``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from dsv4_index.batch import StepBatch
from dsv4_index.frontend import batch_from_step
from dsv4_index.pipeline import MetadataPipeline
from dsv4_index.frontend import StepInput

from helpers.layouts import tiny_layout
from helpers.rejections import T_MAX, clean_run, diff as _diff, make_pipe, outputs, state, trace

I64 = np.iinfo(np.int64).max
VARIANT = "ring"


def _set(b: StepBatch, field: str, i: int, v) -> StepBatch:
    x = np.asarray(getattr(b, field), dtype=np.int64).copy()
    x[i] = v
    return dataclasses.replace(b, **{field: x})


def _all(b: StepBatch, field: str, v) -> StepBatch:
    return dataclasses.replace(b, **{field: np.full(b.num_rows, v, dtype=np.int64)})


# name -> (applies(batch), make(batch) -> bad batch, regex the message must match)
BATCH_CASES = {
    "q_all_int64_max": (lambda b: b.num_rows >= 1, lambda b: _all(b, "num_scheduled_tokens", I64),
                        r"num_scheduled_tokens.*more than max_num_batched_tokens"),
    "q_two_rows_int64_max": (lambda b: b.num_rows >= 2,
                             lambda b: _set(_set(b, "num_scheduled_tokens", 0, I64), "num_scheduled_tokens", 1, I64),
                             r"num_scheduled_tokens.*more than max_num_batched_tokens"),
    "q_2_62": (lambda b: b.num_rows >= 1, lambda b: _set(b, "num_scheduled_tokens", 0, 2**62),
               rf"num_scheduled_tokens: the step schedules \d+ tokens, more than max_num_batched_tokens = {T_MAX}"),
    "q_mixed_sign": (lambda b: b.num_rows >= 2,
                     lambda b: _set(_set(b, "num_scheduled_tokens", 0, I64), "num_scheduled_tokens", 1, -I64),
                     r"num_scheduled_tokens\[1\] = -\d+ is negative"),
    "q_int64_min": (lambda b: b.num_rows >= 1, lambda b: _set(b, "num_scheduled_tokens", 0, -2**63),
                    r"num_scheduled_tokens\[0\] = -\d+ is negative"),
    "q_uint64_huge": (lambda b: b.num_rows >= 1, lambda b: dataclasses.replace(
        b, num_scheduled_tokens=np.full(b.num_rows, 2**64 - 1, dtype=np.uint64)), r"num_scheduled_tokens"),
    "nc_int64_max": (lambda b: b.num_rows >= 1, lambda b: _set(b, "num_computed_tokens", 0, I64),
                     r"num_computed_tokens\[0\] = \d+ is beyond max_model_len = 256"),
    "nc_2_62": (lambda b: b.num_rows >= 1, lambda b: _set(b, "num_computed_tokens", 0, 2**62),
                r"num_computed_tokens\[0\] = \d+ is beyond max_model_len"),
    "nc_wraps_with_q": (lambda b: b.num_rows >= 1,  # NOTE: INT64_MAX + 1 wraps to INT64_MIN
                        lambda b: _set(_set(b, "num_computed_tokens", 0, I64), "num_scheduled_tokens", 0, 1),
                        r"num_computed_tokens\[0\] = \d+ is beyond max_model_len"),
    "nc_negative_huge": (lambda b: b.num_rows >= 1, lambda b: _set(b, "num_computed_tokens", 0, -2**63),
                         r"num_computed_tokens\[0\] = -\d+ is negative"),
    "slot_int64_max": (lambda b: b.num_rows >= 1, lambda b: _set(b, "req_slots", 0, I64), r"req_slots\[0\]"),
    "free_slot_int64_min": (lambda b: True, lambda b: dataclasses.replace(
        b, free_slots=np.array([-2**63], dtype=np.int64)), r"free_slots\[0\]"),
    "write_cu_int64_max": (lambda b: b.num_runs >= 2, lambda b: _set(b, "write_cu", 1, I64),
                           r"write_cu must rise from 0 to len\(write_ids\)"),
    "write_cu_mixed_sign": (lambda b: b.num_runs >= 2,
                            lambda b: _set(_set(b, "write_cu", 1, I64), "write_cu", 2, -I64 + 5),
                            r"write_cu must rise from 0 to len\(write_ids\)"),
    "write_start_2_62": (lambda b: b.num_runs >= 1, lambda b: _set(b, "write_starts", 0, 2**62),
                         r"write_starts\[0\] = \d+ leaves a hole"),
    "write_start_int64_max": (lambda b: b.num_runs >= 1, lambda b: _set(b, "write_starts", 0, I64),
                              r"write_starts\[0\] = \d+ leaves a hole"),
    "write_start_int64_min": (lambda b: b.num_runs >= 1, lambda b: _set(b, "write_starts", 0, -2**63),
                              r"write_starts\[0\] = -\d+ leaves a hole"),
    "write_id_int64_max": (lambda b: b.num_runs >= 1 and len(b.write_ids) >= 1,
                           lambda b: _set(b, "write_ids", 0, I64), r"write_ids\[0\] = \d+ in gid \d+ .*beyond int32"),
    "write_id_int64_min": (lambda b: b.num_runs >= 1 and len(b.write_ids) >= 1,
                           lambda b: _set(b, "write_ids", 0, -2**63), r"write_ids\[0\] = -\d+ is negative"),
    "write_gid_2_62": (lambda b: b.num_runs >= 1, lambda b: _set(b, "write_gids", 0, 2**62), r"write_gids\[0\]"),
    "write_slot_int64_min": (lambda b: b.num_runs >= 1, lambda b: _set(b, "write_slots", 0, -2**63),
                             r"write_slots\[0\]"),
    "replay_start_int64_max": (lambda b: b.num_rows >= 1 and b.num_scheduled_tokens[0] > 0, lambda b: _set(
        dataclasses.replace(b, replay_start=np.zeros(b.num_rows, np.int64)), "replay_start", 0, I64),
        r"replay_start of slot \d+ = \d+ is outside"),
    "replay_end_int64_max": (lambda b: b.num_rows >= 1 and b.num_scheduled_tokens[0] > 0, lambda b: _set(
        dataclasses.replace(b, replay_end=np.zeros(b.num_rows, np.int64)), "replay_end", 0, I64),
        r"replay_end of slot \d+ = \d+ does not fit int32"),
}


def _id_cases(step: StepInput):
    """The id-keyed form: the same values through ``StepInput`` (the converter's checks, then the
    array form's)."""
    rid = next(iter(step.num_scheduled_tokens), None)
    if rid is None:
        return {}
    nst = dict(step.num_scheduled_tokens)
    out = {"id_q_int64_max": (dataclasses.replace(step, num_scheduled_tokens={**nst, rid: I64}),
                              r"num_scheduled_tokens"),
           "id_q_2_62": (dataclasses.replace(step, num_scheduled_tokens={**nst, rid: 2**62}), r"num_scheduled_tokens")}
    if len(nst) >= 2:
        other = [k for k in nst if k != rid][0]
        out["id_q_two_int64_max"] = (dataclasses.replace(step, num_scheduled_tokens={**nst, rid: I64, other: I64}),
                                     r"num_scheduled_tokens")
    run = next((r for r in step.running_requests if not r.resumed), None)
    if run is not None:
        big = dataclasses.replace(run, num_computed_tokens=I64)
        out["id_nc_int64_max"] = (dataclasses.replace(
            step, running_requests=[big if r is run else r for r in step.running_requests]), r"num_computed_tokens")
    return out


def _reject(pipe, step, pad_to, pattern, name):
    before = state(pipe)
    with pytest.raises(ValueError) as e:
        pipe.update(step, pad_to=pad_to)
    assert re.search(pattern, str(e.value)), f"{name}: message {str(e.value)!r} does not match {pattern!r}"
    changed = _diff(before, state(pipe))
    assert not changed, f"{name} (pad_to={pad_to}): the rejected step changed {changed}"


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_huge_counts_are_rejected_and_change_nothing():
    steps, pads = trace(VARIANT)
    want = clean_run(VARIANT, "safe", False)
    a = make_pipe(VARIANT)
    hit = set()
    for i, (step, pad) in enumerate(zip(steps, pads)):
        if i:
            batch = batch_from_step(step, a.slot_map, len(a.layout.groups))[0]
            for name, (applies, make, pattern) in BATCH_CASES.items():
                if applies(batch):
                    for pad_to in (None, T_MAX):
                        _reject(a, make(batch), pad_to, pattern, name)
                    hit.add(name)
            for name, (bad, pattern) in _id_cases(step).items():
                for pad_to in (None, T_MAX):
                    _reject(a, bad, pad_to, pattern, name)
                hit.add(name)
        a.update(step, pad_to=pad)
        assert not _diff(state(a, ids=False), want[i][0]), f"state after update {i} differs"
        d = _diff(outputs(a.build()), want[i][2])
        assert not d, f"outputs of step {i} differ after the rejections: {d}"
    missing = set(BATCH_CASES) - hit
    assert not missing, f"the trace offered no point for {sorted(missing)}"
    assert {"id_q_int64_max", "id_q_two_int64_max", "id_nc_int64_max"} <= hit


@pytest.mark.parametrize("bad", [0, -1, 2**31, 10**15, 1.5, True, "8"])
def test_max_staged_blocks_is_bounded_before_allocation(bad):
    """A capacity the pipeline would allocate pinned buffers for is checked first (10**15 ids would be
    16 PB of staging)."""
    with pytest.raises(ValueError, match="max_staged_blocks must be an int"):
        MetadataPipeline(tiny_layout(), 4, 16, "cpu", max_staged_blocks=bad)


def test_max_staged_blocks_never_exceeds_the_tables():
    pipe = MetadataPipeline(tiny_layout(), 4, 16, "cpu", max_staged_blocks=1 << 26)
    assert pipe.max_staged_blocks == pipe.tables.total
