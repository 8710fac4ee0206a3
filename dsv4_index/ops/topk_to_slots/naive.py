"""Reference math of ``topk_to_slots`` (docs/DESIGN.md §4 "Top-k -> physical slots", DCP, compact form):
plain PyTorch, the spec."""

from __future__ import annotations

import torch

from ..._common import cp_local, cp_owner, no_block, token_positions, token_table_rows


def token_rows(query_start_loc, seq_lens, rows: torch.Tensor, table_rows: int, compress_ratio: int,
               num_rows: int):
    """Per token slot: (table row int64, ``-1`` for padded tokens; visible rows ``n_c = (pos + 1) //
    R`` int64, 0 for padded tokens): what the pipeline's step build precomputes for
    :func:`topk_to_slots_rows`. ``n_c`` counts every row (picks are global row ids, DCP or not)."""
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_rows)
    row, valid = token_table_rows(rows, req, valid, table_rows)
    n_c = (pos + 1).clamp(min=0) // compress_ratio
    return torch.where(valid, row, -1), torch.where(valid, n_c, 0)


def topk_to_slots_rows(topk: torch.Tensor, token_rows: torch.Tensor, token_nc: torch.Tensor,
                       block_table: torch.Tensor, rows_per_block: int, compress_ratio: int,
                       table_width: int, cp_world_size: int, cp_rank: int, cp_interleave: int,
                       compact: bool, num_rows: int):
    """(int32 ``[num_rows, K]``, int32 ``[num_rows]``) from per-token table rows and ``n_c`` (the
    arguments of ``kernel.launch_rows``, outputs returned; ``compress_ratio`` is folded into
    ``token_nc``).

    Pick ``l = topk[t, k]`` of a token with row ``r = token_rows[t]`` inside the table is valid iff
    ``0 <= l < token_nc[t]``, this rank owns row ``l`` and its local block ``lc // S`` lies inside
    ``[0, table_width)``; it becomes ``bt[r][lc // S] * S + lc % S``, anything else ``-1``;
    ``compact`` moves the valid entries to the front in their order. ``lens`` = valid count.
    Compares are int64, so any pick value is safe.
    """
    K = topk.shape[1]
    device = topk.device
    r = token_rows[:num_rows].long()
    valid = (r >= 0) & (r < block_table.shape[0])
    pick = torch.full((num_rows, K), -1, dtype=torch.long, device=device)
    m = min(num_rows, topk.shape[0])
    pick[:m] = topk[:m].long()
    ok = valid[:, None] & (pick >= 0) & (pick < token_nc[:num_rows].long()[:, None])
    pick = torch.where(ok, pick, 0)
    ok &= cp_owner(pick, cp_world_size, cp_interleave) == cp_rank
    lc = cp_local(pick, cp_world_size, cp_interleave)
    blk = lc // rows_per_block
    ok &= blk < min(table_width, block_table.shape[1])
    slots = torch.full((num_rows, K), -1, dtype=torch.long, device=device)
    if bool(ok.any()):
        rr = torch.where(valid, r, 0)[:, None].expand(ok.shape)
        slots[ok] = no_block(block_table[rr[ok], blk[ok]].long() * rows_per_block + lc[ok] % rows_per_block)
        ok &= slots >= 0  # NOTE: a pick in a negative block id (no block) is not valid
    if compact:  # valid first, original order kept (stable sort)
        order = torch.argsort((~ok).to(torch.int8), dim=1, stable=True)
        slots = slots.gather(1, order)
    return slots.to(torch.int32), ok.sum(1).to(torch.int32)


def topk_to_slots(topk, query_start_loc, seq_lens, block_table, rows_per_block: int,
                  compress_ratio: int, rows: torch.Tensor, cp_world_size: int, cp_rank: int,
                  cp_interleave: int, compact: bool, num_rows: int):
    """The public op's reference: :func:`token_rows` of the batch, then :func:`topk_to_slots_rows`."""
    trow, nc = token_rows(query_start_loc, seq_lens, rows, block_table.shape[0], compress_ratio, num_rows)
    return topk_to_slots_rows(topk, trow, nc, block_table, rows_per_block, compress_ratio,
                              block_table.shape[1], cp_world_size, cp_rank, cp_interleave, compact,
                              num_rows)
