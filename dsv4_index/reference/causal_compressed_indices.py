"""Reference: causal compressed index lists (DESIGN §4, INTERFACES.md)."""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_index._common import cp_owned_count, table_slots, token_positions
from dsv4_index.kernels.causal_compressed_indices import (CausalArgs,
                                                          check_causal_compressed_indices_args)


def compute(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
            cp_world_size, cp_rank, cp_interleave, a: CausalArgs):
    """Fill ``a.out`` / ``a.out_lens`` from checked arguments."""
    req, pos, valid = token_positions(query_start_loc, seq_lens, a.rows)
    n_c = (pos + 1).clamp(min=0) // compress_ratio
    owned = cp_owned_count(n_c, cp_world_size, cp_rank, cp_interleave)
    # NOTE: the owned rows, ascending, are local rows 0 .. owned-1: list that prefix, truncated.
    limit = min(a.width, block_table.shape[1] * rows_per_block)
    lens = torch.where(valid, owned.clamp(max=limit), 0)
    j = torch.arange(a.width, device=lens.device)
    slots = table_slots(block_table, req[:, None], j[None, :], rows_per_block,
                        j[None, :] < lens[:, None])
    a.out.copy_(slots.to(torch.int32))
    a.out_lens.copy_(lens.to(torch.int32))
    return a.out, a.out_lens


def causal_compressed_indices(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              block_table: torch.Tensor, rows_per_block: int, compress_ratio: int,
                              width: int, *, cp_world_size: int = 1, cp_rank: int = 0,
                              cp_interleave: int = 1, num_tokens: Optional[int] = None,
                              out: Optional[torch.Tensor] = None,
                              out_lens: Optional[torch.Tensor] = None, validate: bool = False,
                              backend: Optional[str] = None):
    """Pure-PyTorch :func:`dsv4_index.causal_compressed_indices` (``backend`` is ignored)."""
    a = check_causal_compressed_indices_args(
        query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio, width,
        cp_world_size, cp_rank, cp_interleave, num_tokens, out, out_lens, validate)
    return compute(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                   cp_world_size, cp_rank, cp_interleave, a)
