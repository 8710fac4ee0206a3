"""Reference math of ``causal_compressed_indices`` (docs/DESIGN.md §4 "Causal compressed indices", DCP):
plain PyTorch, the spec."""

from __future__ import annotations

import torch

from ..._common import cp_owned_count, table_slots, token_positions, token_table_rows


def visible(query_start_loc, seq_lens, num_rows: int, compress_ratio: int, cp_world_size: int,
            cp_rank: int, cp_interleave: int):
    """(req, valid, n) ``[num_rows]``: the compressed rows a token sees, ``n_c(pos) = (pos + 1) // R``
    (the count this rank owns under DCP; 0 for padded tokens)."""
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_rows)
    n = cp_owned_count((pos + 1).clamp(min=0) // compress_ratio, cp_world_size, cp_rank, cp_interleave)
    return req, valid, torch.where(valid, n, 0)


def causal_compressed_indices(query_start_loc, seq_lens, block_table, rows_per_block: int,
                              compress_ratio: int, rows: torch.Tensor, cp_world_size: int, cp_rank: int,
                              cp_interleave: int, num_rows: int, width: int):
    """(int32 ``[num_rows, width]``, int32 ``[num_rows]``): entry ``j < n`` of a token is local row
    ``j``'s slot ``bt[rows[req]][j // S] * S + j % S`` (the owned rows, ascending, are local rows
    ``0 .. n - 1``), ``-1`` after; ``lens = n``.

    NOTE: ``n`` is clamped to ``width`` and to the table's rows (``cols * S``) so that unchecked
    inputs never read outside the table; inputs that pass the value checks never hit the clamp.
    """
    req, valid, n = visible(query_start_loc, seq_lens, num_rows, compress_ratio, cp_world_size,
                            cp_rank, cp_interleave)
    row, valid = token_table_rows(rows, req, valid, block_table.shape[0])
    lens = torch.where(valid, n.clamp(max=min(width, block_table.shape[1] * rows_per_block)), 0)
    j = torch.arange(width, device=lens.device)[None, :]
    slots = table_slots(block_table, row[:, None], j, rows_per_block, j < lens[:, None])
    return slots.to(torch.int32), lens.to(torch.int32)
