"""Shared helpers of test_validate / test_adversarial / test_fuzz_pipeline: the tiny layout, a
block-id allocator for hand-written steps, and a deep copy of one step's metadata."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index._common import cdiv
from dsv4_index.step import NewRequest, RunningRequest, StepInput

TINY = Path(__file__).resolve().parents[1] / "dsv4_index" / "configs" / "tiny.json"


def tiny_layout(**kw) -> DSV4Layout:
    args = dict(max_model_len=256, mla_block_size=32, swa_block_size=4, indexer_causal_indices=True)
    args.update(kw)
    return DSV4Layout.from_config(TINY, **args)


class Pool:
    """Hands out fresh block ids (never 0) for hand-written steps; ``blocks(n)`` covers ``n`` tokens
    in every group (``alloc_block_size`` each, kernel-block ids with hybrid blocks)."""

    def __init__(self, layout, start: int = 1):
        self.layout, self.next = layout, itertools.count(start)

    def blocks(self, n_tokens: int, have=None):
        out = []
        for g, old in zip(self.layout.groups, have or [[] for _ in self.layout.groups]):
            f = g.blocks_per_kv_block
            need = cdiv(n_tokens, g.alloc_block_size) - len(old) // f
            ids = [next(self.next) for _ in range(max(need, 0))]
            out.append([b * f + j for b in ids for j in range(f)])
        return tuple(out)


def two_steps(layout, pool=None):
    """Two hand-written steps: prefills, then decodes (1 and 2 tokens) + a chunked prefill + a new
    request with bounded replay (replay_start 6, floor of its swa window)."""
    pool = pool or Pool(layout)
    a, b = pool.blocks(70), pool.blocks(40)
    s1 = StepInput([NewRequest("a", a, 0), NewRequest("b", b, 0)], [], {"a": 62, "b": 20})
    d = pool.blocks(30)
    s2 = StepInput([NewRequest("d", d, 10)],
                   [RunningRequest("a", tuple([] for _ in a), 62), RunningRequest("b", tuple([] for _ in b), 20)],
                   {"a": 2, "b": 17, "d": 13}, replay_start={"d": 6})
    return s1, s2


def make_pipeline(layout, **kw):
    args = dict(max_num_reqs=4, max_num_batched_tokens=96, device="cpu", num_speculative_tokens=1)
    args.update(kw)
    return MetadataPipeline(layout, **args)


def clone_meta(meta):
    """Deep copy of the tensors of one step's metadata (corrupt the copy, not the pipeline's buffers).
    NOTE: c4a / c4i share one compressed-slot tensor in the pipeline; the copy gives each its own."""
    def c(x):
        return x.clone() if isinstance(x, torch.Tensor) else x

    chans = {n: dataclasses.replace(ch, **{f.name: c(getattr(ch, f.name)) for f in dataclasses.fields(ch)})
             for n, ch in meta.channels.items()}
    top = {f.name: c(getattr(meta, f.name)) for f in dataclasses.fields(meta)
           if f.name not in ("channels", "_pipeline")}
    top["block_tables"] = [bt.clone() for bt in meta.block_tables]
    top["req_ids"] = list(meta.req_ids)
    return dataclasses.replace(meta, channels=chans, **top)
