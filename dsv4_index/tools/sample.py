"""Sample steps for pictures and demos: :func:`sample_step_batch` (a synthetic serving step) and
:func:`sample_step` (a pipeline and one built step of a config; ``python -m dsv4_index inspect``)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .._common import cdiv
from ..batch import StepBatch
from ..specs import ratio_kinds

__all__ = ["sample_step", "sample_step_batch", "indexed_channels", "ratio_label"]


def indexed_channels(layout) -> list:
    """The compressed channels a top-k converts into (``c4a``; V4.1: ``c1a``, ``c2a``), present in ``layout``."""
    return [k.main for k in ratio_kinds(layout.compress_ratios) if k.kind == "c4" and k.main in layout.channels]


def ratio_label(layout) -> str:
    """The layout's compress ratios, ascending (``"4/128"``; V4.1 ``"1/2"``; ``"none"``)."""
    return "/".join(str(k.ratio) for k in ratio_kinds(layout.compress_ratios)) or "none"


def sample_step_batch(layout, num_requests: int, *, max_num_reqs: Optional[int] = None,
                      max_num_batched_tokens: int = 4096, num_speculative_tokens: int = 1,
                      prefill_chunk: int = 512, num_prefills: Optional[int] = None, min_context: Optional[int] = None,
                      seed: int = 0) -> StepBatch:
    """A synthetic serving step: ``num_requests`` new rows (~85 % decodes, ~10 % speculative decodes
    of ``1 + num_speculative_tokens`` tokens, the rest prefill chunks), contexts log-uniform up to
    ``layout.max_model_len``, in shuffled request slots and batch order, with every block they need (sliding
    groups: null ids below the window, as a scheduler frees them). ``min_context`` (default
    ``max_model_len // 64``) is the shortest context.

    Returns
    -------
    StepBatch (int64 arrays)
    """
    rng = np.random.default_rng(seed)
    B = int(num_requests)
    num_slots = max_num_reqs or B
    if not 1 <= B <= num_slots:
        raise ValueError(f"num_requests must be in [1, max_num_reqs = {num_slots}], got {num_requests!r}")
    n_pre = num_prefills if num_prefills is not None else max(1, B // 100) if B >= 3 else 0
    n_verify = max(int(B - n_pre >= 2), (B - n_pre) // 10) if num_speculative_tokens else 0
    q: np.ndarray = np.ones(B, dtype=np.int64)
    q[n_pre:n_pre + n_verify] = 1 + num_speculative_tokens
    budget = max_num_batched_tokens - int(q[n_pre:].sum())
    for i in range(n_pre):
        q[i] = max(num_speculative_tokens + 2, min(prefill_chunk, budget // (n_pre - i)))
        budget -= int(q[i])
    if budget < 0:
        raise ValueError(f"max_num_batched_tokens = {max_num_batched_tokens} is too small for {B} requests")
    L = layout.max_model_len
    hi = np.maximum(L - q - num_speculative_tokens - 1, 1)
    lo = np.minimum(hi, max(1, min_context or L // 64))
    nc = np.minimum(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))).astype(np.int64), hi)
    order = rng.permutation(B)
    q, nc = q[order], nc[order]
    req_slots = rng.permutation(num_slots)[:B].astype(np.int64)
    next_id = 1 + rng.integers(0, 1000)
    gids, wslots, cu, ids = [], [], [0], []
    for b in range(B):
        seq = int(nc[b] + q[b])
        for g in layout.groups:
            bs = g.alloc_block_size
            n = g.blocks_for(seq)
            first = 0 if g.kind != "sliding" else max(int(nc[b]) - g.window + 1, 0) // bs
            fresh = np.arange(next_id, next_id + n - first, dtype=np.int64)
            next_id += n - first + int(rng.integers(0, 3))   # NOTE: gaps: ids are not consecutive rows
            ids.append(np.concatenate([np.zeros(first, dtype=np.int64), fresh]))
            gids.append(g.gid)
            wslots.append(req_slots[b])
            cu.append(cu[-1] + n)
    return StepBatch(req_slots=req_slots, num_computed_tokens=nc, num_scheduled_tokens=q,
                     is_new=np.ones(B, dtype=bool), write_gids=np.asarray(gids, dtype=np.int64),
                     write_slots=np.asarray(wslots, dtype=np.int64), write_starts=np.zeros(len(gids), dtype=np.int64),
                     write_cu=np.asarray(cu, dtype=np.int64), write_ids=np.concatenate(ids))


# the picture


def sample_step(config="flash", num_requests: Optional[int] = None, *, max_model_len: Optional[int] = None,
                device="cpu", seed: int = 0):
    """A pipeline and one built sample step of a shipped (or given) config, for pictures and demos.

    ``"tiny"`` (and any config with a window below 64): 128-token contexts, mla / swa blocks of 32 / 4,
    6 requests, 64 batched tokens. Anything else: V4-Flash-like, 32K contexts, 300 requests, 4096
    batched tokens. The pipeline runs the Triton kernels on CUDA, the PyTorch reference on the CPU.
    Returns ``(pipe, meta)``.
    """
    from ..geometry import DSV4Layout
    from ..pipeline import MetadataPipeline

    probe = DSV4Layout.from_config(config, max_model_len=max_model_len or 1024)
    small = probe.sliding_window < 64
    kw: dict = {}
    if small:
        L, kw, n, T, chunk = max_model_len or 128, dict(mla_block_size=32, swa_block_size=4), 6, 64, 13
    else:
        L, kw, n, T, chunk = max_model_len or 32768, {}, 300, 4096, 512
    layout = DSV4Layout.from_config(config, max_model_len=L, **kw)
    n = num_requests or n
    device = torch.device(device)
    # NOTE: on the CPU the reference (the Triton interpreter would take minutes at Flash scale)
    pipe = MetadataPipeline(layout, max_num_reqs=max(n, 8), max_num_batched_tokens=max(T, 4 * n),
                            device=device, num_speculative_tokens=1,
                            backend=None if device.type == "cuda" else "reference")
    batch = sample_step_batch(layout, n, max_num_reqs=pipe.max_num_reqs, max_num_batched_tokens=pipe.max_num_tokens,
                              prefill_chunk=chunk, min_context=L // 4 if small else None, seed=seed)
    pipe.update(batch, pad_to=min(pipe.max_num_tokens, cdiv(batch.num_tokens, 8) * 8))
    return pipe, pipe.build()
