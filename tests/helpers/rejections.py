"""The transactional-update harness (``tests/pipeline/test_rejections.py`` and the ownership tests): two tiny
layouts (ring sliding tables; a circular ``c4_state`` group), a reference-scheduler trace on each, the pipelines,
and every state and output of a pipeline frozen for comparison (:func:`state`, :func:`outputs`, :func:`diff`)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.testing.scheduler import random_trace

from helpers.pipelines import DEVICE

R, T_MAX, SPEC, STAGED = 6, 64, 2, 24        # slots, token capacity, spec tokens, max_staged_blocks
VARIANTS = {  # layout kwargs, trace kwargs (prefix hits, finishes, a preemption in each)
    "ring": (dict(), dict(seed=4, num_blocks=28)),
    # NOTE: chunks of up to 12 tokens: longer than the ring holds beside its window (12 - 8 + 1)
    "circular": (dict(circular={"c4_state": 12}), dict(seed=1, num_blocks=32, long_prefill_threshold=12)),
}
N_STEPS, N_FUSED = 16, 10  # NOTE: the interpreter is slow: fused runs are shorter


@functools.lru_cache(maxsize=None)
def layout(variant: str) -> DSV4Layout:
    """``tiny``: mla blocks of 16, swa blocks of 8, causal indexer indices; ring tables, or a circular c4_state."""
    return DSV4Layout.from_config("tiny", max_model_len=256, mla_block_size=16, swa_block_size=8,
                                  indexer_causal_indices=True, **VARIANTS[variant][0])


@functools.lru_cache(maxsize=None)
def trace(variant: str, fused: bool = False):
    """(steps, pad_to per step) of a reference-scheduler trace on ``layout(variant)``; shorter when ``fused``."""
    steps = [s for s, _ in random_trace(layout(variant), N_STEPS, max_num_batched_tokens=48, max_num_seqs=R,
                                        num_speculative_tokens=SPEC, prompt_len=(1, 60),
                                        max_new_tokens=(2, 10), arrival_prob=0.8, max_arrivals=2,
                                        **VARIANTS[variant][1])]
    pads = [None if i % 3 == 0 else min(T_MAX, s.total_tokens + i % 3) for i, s in enumerate(steps)]
    n = N_FUSED if fused else N_STEPS
    return steps[:n], pads[:n]


def make_pipe(variant: str, checks: str = "safe", fused: bool = False) -> MetadataPipeline:
    """A pipeline on ``layout(variant)``: the fused launch when ``fused``, else the reference backend."""
    p = MetadataPipeline(layout(variant), R, T_MAX, DEVICE, SPEC, checks=checks, max_staged_blocks=STAGED,
                         backend=None if fused else "reference")
    assert (p.fused_plan is not None) == fused
    return p


# ----------------------------------------------------------------------------------------------
# state and outputs, frozen for comparison
# ----------------------------------------------------------------------------------------------
_BY_VALUE = ("StepPlan", "StepStats", "ChannelMetadata")


def _freeze(x, ids: bool):
    """Hashable deep copy; objects without value semantics compare by identity (``ids``) or type."""
    if isinstance(x, np.ndarray):
        return ("np", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, torch.Tensor):
        return ("t", str(x.dtype), tuple(x.shape), x.detach().cpu().contiguous().numpy().tobytes())
    if x is None or isinstance(x, (bool, int, float, str, np.integer, np.floating)):
        return x
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v, ids) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((str(k), _freeze(v, ids)) for k, v in x.items()))
    if isinstance(x, (set, frozenset)):
        return ("set", tuple(sorted(map(str, x))))
    key = ("obj", id(x)) if ids else ("obj", type(x).__name__)
    if type(x).__name__ in _BY_VALUE:  # NOTE: per-step records: their values too
        return key + tuple(_freeze(getattr(x, f.name), ids) for f in dataclasses.fields(x))
    return key


def state(pipe: MetadataPipeline, ids: bool = True) -> dict:
    """Every attribute of the pipeline and of its tables, slot map, staging and build context."""
    out = {}
    owners = [("pipe", pipe), ("tables", pipe.tables), ("slot_map", pipe.slot_map), ("staging", pipe.staging),
              ("ctx", pipe.ctx), ("requests", pipe.requests)]
    for owner, obj in owners:
        for k, v in vars(obj).items():
            out[f"{owner}.{k}"] = _freeze(v, ids)
    return out


def outputs(meta) -> dict:
    """Every output of one build: metadata fields, every channel field, device tables, a top-k
    conversion of fixed picks."""
    out = {}
    for f in dataclasses.fields(meta):
        if f.name not in ("channels", "layout", "builders", "_converters"):
            out[f.name] = _freeze(getattr(meta, f.name), False)
    for name, ch in meta.channels.items():
        for f in dataclasses.fields(ch):
            out[f"{name}.{f.name}"] = _freeze(getattr(ch, f.name), False)
    g = torch.Generator().manual_seed(meta.num_tokens * 31 + meta.num_reqs)
    picks = torch.randint(-2, 24, (meta.num_tokens_padded, 4), generator=g, dtype=torch.int32).to(meta.seq_lens.device)
    out["topk_to_slots(c4a)"] = _freeze(meta.topk_to_slots("c4a", picks), False)
    return out


def diff(a: dict, b: dict) -> list:
    """The keys whose values differ (or that only one side has), sorted."""
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


@functools.lru_cache(maxsize=None)
def clean_run(variant: str, checks: str, fused: bool):
    """Pipeline B: per step, (state after update, state after build, outputs of build)."""
    steps, pads = trace(variant, fused)
    b, rec = make_pipe(variant, checks, fused), []
    for step, pad in zip(steps, pads):
        b.update(step, pad_to=pad)
        after_update = state(b, ids=False)
        out = outputs(b.build())
        rec.append((after_update, state(b, ids=False), out))
    return rec
