"""Split window programs (``TileConfig.split``, ``fused/rows.py``): a one-chunk window unit of the large tiles runs its
per-row chain one row per lane, stores its rows' words to a scratch allocated once by the plan, then writes its
tiles in slabs. The build must equal the per-op kernels and the reference bit for bit: over a trace, with several
slabs per program, folded or not, and with negative block ids in the sliding tables (the slow path, each block's own
limit)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dsv4_index import DSV4Layout
from dsv4_index.fused import tasks
from dsv4_index.fused.tasks import TileConfig, token_units
from dsv4_index.pipeline import MetadataPipeline

from helpers.pipelines import DEVICE, HAS_TRITON, compare_step, eventful_trace, three_pipelines

SPLIT = TileConfig(bt1=64, bt2=8, bc=128, whole_row=True, block_loads=True, fold=1, split=32)


def _units(plan, cfg):
    tok, t_super, p_super = token_units(plan._tok_specs, plan._tok_tasks, cfg)
    nf = int(tasks.NF)
    return [tok[i:i + nf] for i in range(0, len(tok), nf)], t_super, p_super


@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_split_units_and_their_scratch():
    lay = DSV4Layout.from_config("flash", max_model_len=8192, groups="vllm")
    plan = MetadataPipeline(lay, 4, 256, DEVICE).fused_plan
    units, t_super, p_super = _units(plan, SPLIT)
    split = [u for u in units if u[tasks.S_SPLIT]]
    # NOTE: the SWA unit (blocks of 64, 128 columns) and c4_state's (blocks of 4, 8 columns); not c128_state's
    # (blocks of 8 under 128 columns: more than three blocks a chunk)
    assert sorted((u[tasks.S_BLOCK_SIZE], u[tasks.S_BC]) for u in split) == [(4, 8), (64, 128)]
    for u in split:  # NOTE: at least `split` rows (SWA: 8 -> 32), or the unit's own (c4_state: 64 rows of 8 columns)
        assert u[tasks.S_FOLD] >= 1 and u[tasks.S_BT] == {128: 32, 8: 64}[u[tasks.S_BC]]
        assert u[tasks.S_NPROG] == t_super // u[tasks.S_BT]
    starts = sorted((u[tasks.S_START], u[tasks.S_NPROG] * (u[tasks.S_REP] // max(u[tasks.S_FOLD], 1))) for u in units)
    assert [s for s, _ in starts] == [sum(n for _, n in starts[:i]) for i in range(len(starts))]
    assert sum(n for _, n in starts) == p_super
    off, _, _ = _units(plan, dataclasses.replace(SPLIT, split=0))
    assert not any(u[tasks.S_SPLIT] for u in off)
    # every split task of the shipped large tiles owns SPLIT_WORDS words a token row, disjoint
    outs = plan._outs.cpu().numpy()
    lens = {i: plan.tasks[i].outputs[1].numel() for i in range(len(plan.tasks)) if outs[i, tasks.O_SCRATCH]}
    assert lens and plan.scratch.numel() >= sum(lens.values()) * int(tasks.SPLIT_WORDS)


def _poke_negative(pipes, rng, gids, n: int = 12) -> None:
    """``-1`` (no block) at the same ``n`` random entries of the tables of groups ``gids`` in every pipeline."""
    p0 = next(iter(pipes.values()))
    picks = [(g, int(rng.integers(p0.tables.tables[g].shape[0])), int(rng.integers(p0.tables.tables[g].shape[1])))
             for g in gids for _ in range(n)]
    for p in pipes.values():
        for g, r, c in picks:
            p.tables.tables[g][r, c] = -1
            p.tables.mirror[int(p.tables.base[g]) + r * int(p.tables.cols[g]) + c] = -1


CASES = {
    # name: (layout, fold, negative ids): Flash's SWA lists (blocks of 64, one 128-column chunk) in 32-row programs
    # of four 8-row slabs; the 5-group layout's two SWA groups folded into one program; negative ids
    "flash_vllm": (lambda: DSV4Layout.from_config("flash", max_model_len=4096, groups="vllm"), 1, False),
    "flash_vllm_fold2_negative": (lambda: DSV4Layout.from_config("flash", max_model_len=4096, groups="vllm"), 2, True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.slow  # ./dev quick skips it
def test_split_large_tiles_equal_the_reference(case, monkeypatch):
    from dsv4_index.fused import plan as plan_mod
    make, fold, negative = CASES[case]
    monkeypatch.setenv("DSV4_INDEX_LARGE_FROM", "1")
    for name in ("INTERP_LARGE", "LARGE"):
        monkeypatch.setattr(plan_mod, name, dataclasses.replace(SPLIT, fold=fold))
    layout = make()
    pipes = three_pipelines(layout, 4, 96, num_speculative_tokens=1)
    units, _, _ = _units(pipes["fused"].fused_plan, pipes["fused"].fused_plan.configs[2])
    assert any(u[tasks.S_SPLIT] and u[tasks.S_FOLD] == fold and u[tasks.S_BT] * u[tasks.S_BC] > 1024 for u in units)
    sliding = [g for g, grp in enumerate(layout.groups) if grp.window]
    trace = eventful_trace(layout, 5, need=("finished", "spec"), max_num_batched_tokens=96, max_num_seqs=4)
    rng = np.random.default_rng(0)
    for i, (step, _) in enumerate(trace):
        if negative:
            _poke_negative(pipes, rng, sliding)
        compare_step(pipes, step, min(96, step.total_tokens + i % 3), tag=i)
