"""The staging write pass (state/staging/kernel.py) equals the format's definition (state/staging/naive.py)
byte for byte on every step of randomized serving streams and scheduler traces (outputs poisoned
beforehand, the host mirror included), and refuses an index out of range naming the field, before it
writes anything."""

import dataclasses

import numpy as np
import pytest

from dsv4_index import MetadataPipeline
from dsv4_index.state.staging import stage_args
from dsv4_index.state.staging import kernel, naive
from dsv4_index.testing.scheduler import random_trace

from helpers.batches import R, SPEC, T_MAX, Serve
from helpers.rejections import VARIANTS, layout

POISON = -0x5A5A5A5B


def _both(p, plan, mirror_before):
    """(h, mirror) after the kernel and after the naive pass, from the same poisoned start."""
    lay = p.staging.layout(plan.num_tokens_padded)
    out = []
    for fn in (kernel.stage_step, naive.stage_step):
        h = np.full(p.staging.capacity, POISON, dtype=np.int32)
        vec = p.staging.vector(lay.t_pad, p.ctx.staged_inputs)  # NOTE: the staged inputs the pass computes too
        args = list(stage_args(plan, p.tables, vec, np.zeros(5, dtype=np.int64)))
        args[0] = mirror_before.copy()
        got = fn(h, *args)
        assert got[1:] == (0, 0) and got[0] == p.last_step_stats.num_writes
        out.append((h, args[0]))
    return out


def _steps(variant, seed):
    lay = layout(variant)
    if seed % 2:
        work = Serve(lay, seed)
        return lay, [(work.step(), None) for _ in range(40)]
    steps = [s for s, _ in random_trace(lay, 40, max_num_batched_tokens=T_MAX, max_num_seqs=R,
                                        num_speculative_tokens=SPEC, prompt_len=(1, 90), max_new_tokens=(2, 20),
                                        arrival_prob=0.8, max_arrivals=2, seed=seed, num_blocks=200)]
    return lay, [(s, None if i % 3 == 0 else min(T_MAX, s.total_tokens + i % 3)) for i, s in enumerate(steps)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_kernel_stages_the_bytes_of_the_format(variant, seed):
    lay, steps = _steps(variant, seed)
    p = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, backend="reference")
    writes = 0
    for step, pad in steps:
        before = p.tables.mirror.copy()
        try:
            p.update(step, pad_to=pad)
        except ValueError:
            continue
        plan = p.last_plan
        (hk, mk), (hn, mn) = _both(p, plan, before)
        assert np.array_equal(hk, hn), np.flatnonzero(hk != hn)[:10]
        assert np.array_equal(mk, mn) and np.array_equal(mk, p.tables.mirror)
        n = p.last_step_stats.h2d_bytes // 4
        assert np.array_equal(p.staging.dev.numpy()[:n][hk[:n] != POISON], hk[:n][hk[:n] != POISON])
        writes += p.last_step_stats.num_writes
    assert writes > 20


@pytest.mark.parametrize("field,bad", [("w_gid", 99), ("w_slot", -1), ("w_row", R + 5), ("w_cu", 10 ** 6),
                                       ("w_start", -3), ("w_end", 10 ** 9), ("num_scheduled", -1)])
def test_an_index_out_of_range_is_named_and_nothing_is_written(field, bad):
    lay, steps = _steps("ring", 2)
    p = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, backend="reference")
    for step, pad in steps[:6]:
        p.update(step, pad_to=pad)
    plan = p.last_plan
    assert plan.w_gid.size
    arr = getattr(plan, field).copy()
    arr[-1] = bad
    if field == "w_start":  # NOTE: a consistent run that starts below block 0
        n = plan.w_end - plan.w_start
        plan = dataclasses.replace(plan, w_keep=arr.copy(), w_end=arr + n)
    plan = dataclasses.replace(plan, **{field: arr})
    lay_ = p.staging.layout(plan.num_tokens_padded)
    h = np.full(p.staging.capacity, POISON, dtype=np.int32)
    args = list(stage_args(plan, p.tables, lay_.vector(), np.zeros(5, dtype=np.int64)))
    mirror = args[0] = p.tables.mirror.copy()
    n, code, _ = kernel.stage_step(h, *args)
    assert n == -1 and kernel.FIELDS[code] == field
    assert (h == POISON).all() and np.array_equal(mirror, p.tables.mirror)
