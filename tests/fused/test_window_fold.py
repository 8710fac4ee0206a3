"""Folded window programs (``TileConfig.fold``): a window unit of one-chunk lists runs ``fold`` of its
sliding groups' tasks in one program (every table read before any store). The large tiles fold by
default; the fused build must still equal the per-op kernels and the reference bit for bit, and the
grid shrinks by the folded programs."""

from __future__ import annotations

import dataclasses

import pytest

from dsv4_index import DSV4Layout
from dsv4_index.fused import tasks
from dsv4_index.fused.tasks import TileConfig, token_units
from dsv4_index.pipeline import MetadataPipeline
from dsv4_index.validate import check_metadata

from helpers.layouts import tiny_layout
from helpers.pipelines import DEVICE, HAS_TRITON, compare_over_trace, eventful_trace, three_pipelines


def _units(plan, cfg):
    tok, t_super, p_super = token_units(plan._tok_specs, plan._tok_tasks, cfg)
    nf = int(tasks.NF)
    return [tok[i:i + nf] for i in range(0, len(tok), nf)], t_super, p_super


@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fold_packs_the_sliding_groups_of_a_unit():
    lay = DSV4Layout.from_config("flash", max_model_len=8192, groups="vllm")
    plan = MetadataPipeline(lay, 4, 256, DEVICE).fused_plan
    base = TileConfig(bt1=128, bt2=8, bc=128, whole_row=True, block_loads=True)
    off, _, p_off = _units(plan, base)
    on, _, p_on = _units(plan, dataclasses.replace(base, fold=2))
    win = [u for u in on if u[tasks.S_KIND] == tasks.KINDS["window"] and u[tasks.S_REP] == 2]
    assert len(win) == 1 and win[0][tasks.S_FOLD] == 2  # the two SWA groups: one program per row tile
    assert p_off - p_on == win[0][tasks.S_NPROG]
    assert all(u[tasks.S_FOLD] == 0 for u in off)
    # every program of the super tile belongs to exactly one unit
    starts = sorted((u[tasks.S_START], u[tasks.S_NPROG] * (u[tasks.S_REP] // max(u[tasks.S_FOLD], 1))) for u in on)
    assert [s for s, _ in starts] == [sum(n for _, n in starts[:i]) for i in range(len(starts))]
    assert sum(n for _, n in starts) == p_on
    # a fold that does not divide the unit's tasks runs them one per program (still loads first)
    odd, _, _ = _units(plan, dataclasses.replace(base, fold=3))
    assert [u[tasks.S_FOLD] for u in odd if u[tasks.S_KIND] == tasks.KINDS["window"]] == [1] * 3


CASES = {
    # name: (layout, fold): three SWA groups folded three to a program; V4.1's six folded two to a program
    "vllm_groups_fold3": (lambda: tiny_layout(groups="vllm", swa_block_size=16), 3),
    "v41_per_layer_fold2": (lambda: DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16,
                                                           swa_group_per_layer=True), 2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.slow  # ./dev quick skips it
def test_folded_large_tiles_equal_the_reference(case, monkeypatch):
    from dsv4_index.fused import plan as plan_mod
    make, fold = CASES[case]
    monkeypatch.setenv("DSV4_INDEX_LARGE_FROM", "1")
    for name in ("INTERP_LARGE", "LARGE"):
        monkeypatch.setattr(plan_mod, name, dataclasses.replace(getattr(plan_mod, name), fold=fold))
    layout = make()
    pipes = three_pipelines(layout, 4, 40, num_speculative_tokens=2)
    plan = pipes["fused"].fused_plan
    units, _, _ = _units(plan, plan.configs[2])
    assert any(u[tasks.S_FOLD] == fold for u in units), "no unit folded"
    trace = eventful_trace(layout, 6, need=("preempted", "resumed", "finished", "spec"), num_blocks=40,
                           seeds=range(200))
    seen = compare_over_trace(pipes, trace, pad=(0, 3), check=lambda m: check_metadata(m, num_blocks=40))
    assert seen["steps"] == 6 and seen["prefills"] and seen["decodes"]
