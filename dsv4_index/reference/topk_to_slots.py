"""Reference: top-k -> physical slots (DESIGN §4, INTERFACES.md)."""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_index._common import cp_local, cp_owner, table_slots, token_positions
from dsv4_index.kernels.topk_to_slots import TopkArgs, check_topk_to_slots_args


def compute(topk, query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
            cp_world_size, cp_rank, cp_interleave, compact: bool, a: TopkArgs):
    """Fill ``a.out`` / ``a.out_lens`` from checked arguments."""
    req, pos, valid = token_positions(query_start_loc, seq_lens, a.rows)
    n_c = (pos + 1).clamp(min=0) // compress_ratio
    K = topk.shape[1]
    l = torch.full((a.rows, K), -1, dtype=torch.long, device=topk.device)
    m = min(a.rows, topk.shape[0])
    l[:m] = topk[:m].long()                   # NOTE: int64 compares: no overflow for any value
    ok = valid[:, None] & (l >= 0) & (l < n_c[:, None])
    l = torch.where(ok, l, 0)
    ok &= cp_owner(l, cp_world_size, cp_interleave) == cp_rank
    lc = cp_local(l, cp_world_size, cp_interleave)
    ok &= lc // rows_per_block < block_table.shape[1]
    slots = table_slots(block_table, req[:, None], lc, rows_per_block, ok)
    if compact:                               # valid first, original order kept (stable sort)
        order = torch.argsort((~ok).to(torch.int8), dim=1, stable=True)
        slots = slots.gather(1, order)
    a.out.copy_(slots.to(torch.int32))
    a.out_lens.copy_(ok.sum(1).to(torch.int32))
    return a.out, a.out_lens


def topk_to_slots(topk: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, rows_per_block: int, compress_ratio: int, *,
                  cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                  compact: bool = False, num_tokens: Optional[int] = None,
                  out: Optional[torch.Tensor] = None, out_lens: Optional[torch.Tensor] = None,
                  validate: bool = False, backend: Optional[str] = None):
    """Pure-PyTorch :func:`dsv4_index.topk_to_slots` (``backend`` is ignored)."""
    a = check_topk_to_slots_args(topk, query_start_loc, seq_lens, block_table, rows_per_block,
                                 compress_ratio, cp_world_size, cp_rank, cp_interleave,
                                 num_tokens, out, out_lens, validate)
    return compute(topk, query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                   cp_world_size, cp_rank, cp_interleave, bool(compact), a)

