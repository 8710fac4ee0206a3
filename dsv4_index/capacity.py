"""Upper bounds of a pipeline's capacities, checked before anything is allocated, and the memory a
pipeline will allocate, computed without allocating it (:meth:`MetadataPipeline.memory_estimate`).

Every bound has its reason in :data:`BOUNDS`; a value beyond one is a ``ValueError`` naming the
argument, the largest allowed value and the reason. Besides the per-argument bounds, two products are
bounded: the block-table entries (``max_num_reqs × Σ columns``: the flat table and the staged write
destinations use int32 offsets) and the entries of each per-token buffer (``max_num_batched_tokens ×
width`` at most ``2**31 - 1``, 8 GiB of int32; V4-Flash at ``max_model_len`` 2**20 with 8192 tokens
needs 2**26), so ``max_model_len`` is bounded through the widths it gives.

The per-token buffers are the builders' own: each builder's ``allocate`` runs against a context on
PyTorch's ``meta`` device (shapes only, no memory), so the estimate and the check read the shapes the
real allocation will use, not a second copy of every builder's formula.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ._common import INT32_MAX, check_cp, check_int

__all__ = ["BOUNDS", "check_capacities", "check_arguments", "check_flags", "memory_estimate"]

BOUNDS: Dict[str, Tuple[int, str]] = {
    "max_num_reqs": (1 << 16, "request slots (rows of every block table); the trace format's bound too, and "
                     "far beyond any engine's batch"),
    "max_num_batched_tokens": (1 << 20, "token capacity of every per-token buffer (allocated at capacity); "
                               "the trace format's bound too"),
    "num_speculative_tokens": (1 << 10, "every decode row holds 1 + this many columns in the indexer's decode_lens; "
                               "the trace format's bound too"),
    "block_size": (1 << 20, "tokens per block of a group (DeepSeek-V4 uses 4 to 256); the trace format's bound too"),
    "max_staged_blocks": (1 << 26, "2 pinned host buffers and a device buffer of 2 ids per staged block: 1 GiB "
                          "at this bound"),
}
"""Argument -> (largest allowed value, why)."""


def _bound(name: str, v, lo: int) -> int:
    v = check_int(name, v, lo=lo)
    hi, why = BOUNDS[name]
    if v > hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}] (at most {hi}: {why}), got {v}")
    return v


def _table_columns(layout, max_num_batched_tokens: int) -> List[int]:
    return [g.columns(max_num_batched_tokens)[0] for g in layout.groups]


def _meta_builders(layout, max_num_reqs: int, max_num_batched_tokens: int, num_speculative_tokens: int,
                   cp: Tuple[int, int, int]):
    """``(context, builders)`` allocated on the ``meta`` device: the shapes, no memory."""
    from .channels import BuildContext, builder_for

    T, meta, i32 = max_num_batched_tokens, torch.device("meta"), torch.int32
    cols = [g.columns(T) for g in layout.groups]

    def empty(n: int, dtype=i32) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=meta)

    ctx = BuildContext(
        layout=layout, device=meta, max_num_reqs=max_num_reqs, max_num_tokens=T, next_n=1 + num_speculative_tokens,
        cp_world_size=cp[0], cp_rank=cp[1], cp_interleave=cp[2],
        tables=tuple(torch.empty((max_num_reqs, c), dtype=i32, device=meta) for c, _ in cols),
        ring_cols=tuple(r for _, r in cols), query_start_loc=empty(T + 1), seq_lens=empty(T + 1),
        idx_mapping=empty(T + 1), replay_start=empty(T + 1), replay_end=empty(T + 1), token_to_req=empty(T),
        positions=empty(T, torch.int64), is_valid_token=empty(T, torch.bool))
    builders = {name: builder_for(spec, layout) for name, spec in layout.channels.items()}
    for b in builders.values():
        b.allocate(ctx)
    return ctx, builders


def _buffers(ctx, builders) -> Dict[str, torch.Tensor]:
    """Every persistent tensor of the context and the builders, named (shared buffers once)."""
    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for owner, d in [("ctx", vars(ctx)), ("ctx.shared", ctx._shared)] + [(n, vars(b)) for n, b in builders.items()]:
        for k, v in d.items():
            if isinstance(v, torch.Tensor) and id(v) not in seen and k != "tables":
                seen.add(id(v))
                out[f"{owner}.{k}"] = v
    return out


def check_capacities(layout, max_num_reqs: int, max_num_batched_tokens: int, num_speculative_tokens: int = 0,
                     max_staged_blocks: Optional[int] = None, cp: Tuple[int, int, int] = (1, 0, 1)) -> None:
    """Every capacity within its bound (:data:`BOUNDS`), the block tables and each per-token buffer
    within int32 offsets; ``ValueError`` naming the argument, the largest allowed value and why. Runs
    before the pipeline allocates anything (the per-token shapes come from the builders on ``meta``)."""
    num_slots = _bound("max_num_reqs", max_num_reqs, 1)
    T = _bound("max_num_batched_tokens", max_num_batched_tokens, 1)
    _bound("num_speculative_tokens", num_speculative_tokens, 0)
    if max_staged_blocks is not None:
        _bound("max_staged_blocks", max_staged_blocks, 1)
    hi, why = BOUNDS["block_size"]
    for g in layout.groups:
        if g.alloc_block_size > hi:
            raise ValueError(f"layout group {g.name!r}: block_size must be at most {hi} ({why}), got "
                             f"{g.alloc_block_size}")
    per_slot = sum(_table_columns(layout, T))
    if num_slots * per_slot > INT32_MAX:
        raise ValueError(f"max_num_reqs must be at most {INT32_MAX // per_slot} for this layout (max_model_len "
                         f"{layout.max_model_len}: {per_slot} block-table columns per request, int32 table offsets "
                         f"in the kernels), got {num_slots}")
    ctx, builders = _meta_builders(layout, num_slots, T, num_speculative_tokens, cp)
    for name, t in _buffers(ctx, builders).items():
        if t.numel() > INT32_MAX:
            per_token = max(1, t.numel() // T)
            raise ValueError(f"max_num_batched_tokens must be at most {INT32_MAX // per_token} for this layout "
                             f"({name} holds {per_token} entries per token; one per-token buffer is bounded at "
                             f"2**31 - 1 entries, 8 GiB of int32: no DeepSeek-V4 shape needs more), got {T}")


def check_arguments(layout, max_num_reqs: int, max_num_batched_tokens: int, num_speculative_tokens: int,
                    max_staged_blocks: Optional[int], cp: Tuple[int, int, int], checks: str) -> None:
    """The constructor's checks, before anything is allocated: the layout's type, DCP, every capacity bounded
    (largest value and reason), the check level, and DCP against the layout's sharded groups."""
    from .geometry import DSV4Layout
    from .state import CHECK_LEVELS

    if not isinstance(layout, DSV4Layout):
        raise TypeError(f"layout must be a DSV4Layout (DSV4Layout.from_config(...)), got {type(layout).__name__}")
    cp_world_size, cp_rank, cp_interleave = cp
    check_cp(cp_world_size, cp_rank, cp_interleave)
    check_capacities(layout, max_num_reqs, max_num_batched_tokens, num_speculative_tokens, max_staged_blocks, cp)
    if checks not in CHECK_LEVELS:
        raise ValueError(f"checks must be one of {CHECK_LEVELS}, got {checks!r}")
    for g in layout.groups:
        if cp_world_size > 1 and g.sharded and g.alloc_block_size % cp_interleave:
            raise ValueError(f"cp_interleave={cp_interleave} must divide the allocation block size "
                             f"{g.alloc_block_size} of sharded group {g.name!r}")
    if cp_world_size != layout.cp_world_size and cp_world_size > 1:
        raise ValueError(f"cp_world_size={cp_world_size} differs from the layout's "
                         f"cp_world_size={layout.cp_world_size} (its tables were sized for that)")


def check_flags(**flags) -> None:
    """Each of the constructor's on/off arguments (``fused``, ``validate``, ``cuda_graphs``) a bool
    (numpy's too): ``TypeError`` naming it (a string such as ``"no"`` would otherwise read as on)."""
    import numpy as np

    for name, v in flags.items():
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {v!r}")


def memory_estimate(layout, max_num_reqs: int, max_num_batched_tokens: int, device="cpu",
                    num_speculative_tokens: int = 0, *, cp_world_size: int = 1, cp_rank: int = 0,
                    cp_interleave: int = 1, max_staged_blocks: Optional[int] = None) -> Dict[str, object]:
    """Bytes a ``MetadataPipeline`` of these arguments allocates at construction, computed without
    allocating (the capacities are checked first, as the constructor does).

    Returns ``{"device": bytes, "host": bytes, "pinned": bytes, "parts": {name: (where, bytes)}}``:
    ``device`` on the pipeline's device (block tables, per-token and per-request buffers, the staging
    buffer; every tensor the build context and the builders allocate, by name: V4.1's candidate buffers
    ``<channel>.cand_*`` and the query batch's ``ctx.query_start_loc_q`` / ``token_to_req_q`` / ``q_to_src``
    included, ``tests/v41/test_candidate_memory.py``), ``host`` numpy / CPU arrays (the table mirror,
    per-slot state, unpinned staging), ``pinned`` page-locked host staging (CUDA only). On a CPU pipeline
    ``device`` is host memory too.
    Small fixed buffers (under 1 KiB each) and Python objects (about 40 bytes per request slot) are not
    counted; the steps themselves add working memory of O(groups × max_num_reqs) on the host. Takes the
    capacities only: :meth:`MetadataPipeline.memory_estimate` checks every constructor argument first.
    """
    from .state.owners import first_sizes
    from .state.owners.pack import first_entries
    from .state.staging import StageLayout

    cp = (cp_world_size, cp_rank, cp_interleave)
    check_capacities(layout, max_num_reqs, max_num_batched_tokens, num_speculative_tokens, max_staged_blocks, cp)
    num_slots, T, G = max_num_reqs, max_num_batched_tokens, len(layout.groups)
    dev = torch.device(device)
    cols = _table_columns(layout, T)
    total = num_slots * sum(cols)
    ctx, builders = _meta_builders(layout, num_slots, T, num_speculative_tokens, cp)
    staged = min(total, 1 << 20 if max_staged_blocks is None else max_staged_blocks)
    capacity = StageLayout.for_tokens(T, G, len(ctx.staged_inputs), num_slots).writes + 2 * max(int(staged), 1)
    pinned = dev.type == "cuda"
    records, lists = first_sizes(G, max(total, 1))
    parts: Dict[str, Tuple[str, int]] = {
        "block tables": ("device", 4 * max(total, 1)),
        "block table mirror": ("host", 4 * max(total, 1)),
        "per-slot table state": ("host", 8 * (4 * G * num_slots + 1) + 12 * (max(cols, default=0) + 1)),
        "request slots": ("host", num_slots),
        # NOTE: state/owners (BlockOwners.__init__): per-slot and per-(group, slot) state, the step's scratch (X,
        # run_of; F4, seen_l and the three lists L at their first length), one int64 per mirror entry (seen), and the
        # (group, id) hash table of 64-byte records at its first size, plus 2 rows (first_sizes: from the groups and
        # the mirror; it grows with the records in use, not with the ids), and the buffer of the step's arrays (pack.py)
        "ownership state": ("host", 8 * (10 * G + 3 + 4 * num_slots + 1 + 5 * G * num_slots + (4 + 3 * G) * num_slots
                                         + 13 * lists + 16 + 8 * (records + 2) + first_entries(G, num_slots) + 4)
                                    + 8 * max(total, 1)),
        "staging": ("device", 4 * capacity),
        "staging (host)": ("pinned" if pinned else "host", 4 * capacity * (2 if pinned else 1)
                           + 8 * (max(T, num_slots) + 1)),
    }
    for name, t in _buffers(ctx, builders).items():
        parts[name] = ("device", t.numel() * t.element_size())
    out: Dict[str, object] = {k: sum(b for w, b in parts.values() if w == k) for k in ("device", "host", "pinned")}
    out["parts"] = parts
    return out

