"""Helpers shared by the compressed-row ops (causal indices, top-k -> slots, indexer lengths).

Triton device functions (request lookup by binary search, ``n_c``, DCP owned counts) and the host
helpers their wrappers share with the references (``out=`` row count, int32 slot range check).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dsv4_index._common import cp_owned_count, resolve_num_tokens

# NOTE: one request search and one DCP count for every kernel (defined next to token_to_req)
from .token_to_req import find_request, owned_count  # noqa: F401
from .token_to_req import search_iters as num_search_iters  # noqa: F401

INT32_MIN = -(2 ** 31)
INT32_MAX = 2 ** 31 - 1


# ----------------------------------------------------------------------------------------------
# host helpers
# ----------------------------------------------------------------------------------------------
def resolve_rows(query_start_loc: torch.Tensor, num_tokens: Optional[int], outs: dict) -> int:
    """Rows ``T_out`` of the per-token outputs.

    The rows of the given ``out=`` buffers (all given ones must agree), else ``num_tokens``, else
    ``query_start_loc[-1]`` read back (one host sync on CUDA).
    """
    rows = None
    for name, buf in outs.items():
        if buf is None:
            continue
        if not isinstance(buf, torch.Tensor) or buf.dim() < 1:
            raise ValueError(f"{name} must be a torch.Tensor with at least one dimension")
        if rows is None:
            rows, first = buf.shape[0], name
        elif buf.shape[0] != rows:
            raise ValueError(f"{name} has {buf.shape[0]} rows but {first} has {rows}; "
                             "they must agree")
    if rows is not None:
        if num_tokens is not None:
            resolve_num_tokens(query_start_loc, num_tokens)  # type / sign check only
        return rows
    return resolve_num_tokens(query_start_loc, num_tokens)


def check_slots_fit_int32(seq_lens: torch.Tensor, block_table: torch.Tensor, rows_per_block: int,
                          compress_ratio: int, cp_world_size: int, cp_rank: int, cp_interleave: int,
                          max_rows: Optional[int] = None) -> None:
    """Value check: every slot a compressed-row list of this batch can hold fits int32.

    NOTE: index lists are int32 (DESIGN §4); slots are computed in int64 and stored as int32. The
    blocks a request can reach are ``0 .. cdiv(min(owned(seq_len // R), max_rows), S) - 1``.
    """
    B, width = seq_lens.numel(), block_table.shape[1]
    if B == 0 or width == 0:
        return
    S = rows_per_block
    n = cp_owned_count(seq_lens.detach().cpu().long().clamp(min=0) // compress_ratio,
                       cp_world_size, cp_rank, cp_interleave)
    if max_rows is not None:
        n = n.clamp(max=max_rows)
    used = torch.arange(width)[None, :] < (-(-n // S))[:, None]
    bt = block_table[:B].detach().cpu().long()
    bad = used & ((bt * S < INT32_MIN) | (bt * S + (S - 1) > INT32_MAX))
    if bool(bad.any()):
        b, k = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"block_table[{b}, {k}] = {int(bt[b, k])} gives slots beyond int32 with "
                         f"rows_per_block = {S} (index lists are int32)")


def token_tile(cols: int, budget: int = 4096) -> int:
    """Token rows per program so that a tile holds about ``budget`` elements."""
    return max(1, min(128, budget // max(cols, 1)))


# ----------------------------------------------------------------------------------------------
# Triton device functions
# ----------------------------------------------------------------------------------------------
@triton.jit
def token_rows(qsl_ptr, seq_lens_ptr, t, T_out, num_reqs, n_iter, compress_ratio,
               world, rank, interleave):
    """Per token ``t`` (int32): (request, live mask, owned visible-row count int64).

    Live iff ``t < T_out`` and ``t < qsl[B]`` (the device value). ``n_c = max(pos + 1, 0) // R``
    with ``pos = seq_lens[b] - qsl[b+1] + t`` in int64; the count is 0 for tokens that are not live.
    """
    n_live = tl.load(qsl_ptr + num_reqs)
    b = find_request(qsl_ptr, t, num_reqs, n_iter)
    live = (t < T_out) & (t < n_live) & (b < num_reqs)  # NOTE: b < num_reqs is False iff B == 0
    sl = tl.load(seq_lens_ptr + b, mask=live, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + b + 1, mask=live, other=0).to(tl.int64)
    n_c = tl.maximum(sl - end + t + 1, 0) // compress_ratio
    cnt = owned_count(n_c, world, rank, interleave)
    return b, live, tl.where(live, cnt, 0)
