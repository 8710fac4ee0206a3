"""``candidate_blocks_to_physical``: a V4.1 candidate source's blocks -> physical candidate blocks + counts.

Checks and dispatch live here; the Triton kernel in :mod:`.kernel`, the PyTorch reference in :mod:`.naive`
(they never import each other).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check_batch, check_int, check_tensor, needs_value_checks, use_triton
from .._args import (check_block_table, check_compressed_reads, check_per_request, check_token_inputs, resolve_rows,
                     table_rows, token_out)
from ..candidate_topk_to_slots import check_candidate_args
from ..topk_to_slots import naive as topk_naive
from . import kernel, naive

__all__ = ["candidate_blocks_to_physical", "candidate_blocks_to_physical_rows"]


def candidate_blocks_to_physical(blocks: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                 block_table: torch.Tensor, rows_per_block: int, compress_ratio: int,
                                 candidate_block_size: int, *, idx_mapping: Optional[torch.Tensor] = None,
                                 num_tokens: Optional[int] = None, out: Optional[torch.Tensor] = None,
                                 out_counts: Optional[torch.Tensor] = None, validate: bool = False,
                                 backend: Optional[str] = None):
    """Physical candidate blocks (docs/DESIGN.md §4 "Candidate blocks"; SGLang's ``phys_blocks``).

    Parameters
    ----------
    blocks : int32 ``[>= T, nb]``
        Request-local candidate block ids of each token (``-1`` = none); rows of padded tokens are not read.
    query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio, idx_mapping, num_tokens, validate,
    backend
        As in :func:`dsv4_index.topk_to_slots` (no DCP: a candidate block is one rank's).
    candidate_block_size : int
        ``C``; must divide ``rows_per_block``.
    out, out_counts : int32 ``[T_out, nb]`` and ``[T_out]``, optional

    Returns
    -------
    (phys int32 ``[T_out, nb]``, counts int32 ``[T_out]``): ``phys[t, i]`` = the physical slot of compressed
    row ``blocks[t, i] * C`` divided by ``C``, ``-1`` for a ``-1`` block, a block whose first row token ``t``
    cannot see yet (``blocks[t, i] * C >= n_c(pos_t)``) or one outside the table; ``counts`` the valid
    entries (0 for padded tokens). Entries keep their columns (column ``i`` is block ``i`` of the consumers'
    sparse columns ``i * C .. i * C + C - 1``).

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import candidate_blocks_to_physical
    >>> qsl, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    >>> bt = torch.tensor([[4, 9, 7]], dtype=torch.int32)              # S = 4, R = 1: rows 0-11 visible
    >>> blocks = torch.tensor([[1, 5, -1, 6]], dtype=torch.int32)      # C = 2; block 6 (rows 12-13) is not
    >>> phys, counts = candidate_blocks_to_physical(blocks, qsl, seq, bt, 4, 1, 2)
    >>> phys.tolist(), counts.tolist()                                 # slots 18 and 30, divided by 2
    ([[9, 15, -1, -1]], [2])
    """
    B, device = check_batch(query_start_loc, seq_lens)
    check_block_table(block_table, device)
    check_candidate_args(blocks, rows_per_block, candidate_block_size, device)
    check_int("compress_ratio", compress_ratio, lo=1)
    idx_mapping = check_per_request("idx_mapping", idx_mapping, B, device)
    outs = {"out": out, "out_counts": out_counts}
    T_out = resolve_rows(query_start_loc, num_tokens, outs)
    check_token_inputs({"blocks": blocks}, num_tokens, T_out, outs)
    nb = blocks.shape[1]
    out = token_out("out", out, T_out, num_tokens, torch.int32, device, cols=nb, exact_cols=True)
    out_counts = token_out("out_counts", out_counts, T_out, num_tokens, torch.int32, device)
    check = needs_value_checks(device, validate)
    rows = table_rows(block_table, idx_mapping, B, check)
    if check:
        check_compressed_reads({"blocks": blocks}, query_start_loc, seq_lens, num_tokens, T_out, block_table, rows,
                               rows_per_block, compress_ratio)
    if use_triton(device, backend):
        return kernel.launch(blocks, (query_start_loc, seq_lens, idx_mapping), None, block_table, rows_per_block,
                             compress_ratio, candidate_block_size, block_table.shape[1], out, out_counts, T_out)
    trow, nc = topk_naive.token_rows(query_start_loc, seq_lens, rows, block_table.shape[0], compress_ratio, T_out)
    phys, counts = naive.blocks_to_physical_rows(blocks, trow, nc, block_table, rows_per_block,
                                                 candidate_block_size, block_table.shape[1], T_out)
    out.copy_(phys)
    out_counts.copy_(counts)
    return out, out_counts


def candidate_blocks_to_physical_rows(blocks: torch.Tensor, token_rows: torch.Tensor, token_nc: torch.Tensor,
                                      block_table: torch.Tensor, rows_per_block: int, compress_ratio: int,
                                      candidate_block_size: int, num_rows: int, *,
                                      table_width: Optional[int] = None, out: Optional[torch.Tensor] = None,
                                      out_counts: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """Pipeline form of :func:`candidate_blocks_to_physical` (per-token table rows and ``n_c`` from the step
    build, no request search, no value check). Returns ``(out int32 [>= num_rows, nb], out_counts int32
    [>= num_rows])``; rows past ``num_rows`` are left alone."""
    device = token_rows.device
    check_tensor("token_rows", token_rows, dtypes=(torch.int32,), ndim=1)
    check_tensor("token_nc", token_nc, dtypes=(torch.int32,), ndim=1, device=device)
    check_candidate_args(blocks, rows_per_block, candidate_block_size, device)
    check_block_table(block_table, device)
    check_int("compress_ratio", compress_ratio, lo=1)
    check_int("num_rows", num_rows, lo=0)
    for name, x in (("token_rows", token_rows), ("token_nc", token_nc)):
        if x.numel() < num_rows:
            raise ValueError(f"{name} has {x.numel()} entries, needs num_rows = {num_rows}")
    table_width = block_table.shape[1] if table_width is None else check_int("table_width", table_width, lo=0)
    if table_width > block_table.shape[1]:
        raise ValueError(f"table_width = {table_width} exceeds block_table's {block_table.shape[1]} columns")
    nb = blocks.shape[1]
    out = token_out("out", out, num_rows, num_rows, torch.int32, device, cols=nb, exact_cols=True)
    out_counts = token_out("out_counts", out_counts, num_rows, num_rows, torch.int32, device)
    if use_triton(device, backend):
        return kernel.launch(blocks, None, (token_rows, token_nc), block_table, rows_per_block, compress_ratio,
                             candidate_block_size, table_width, out, out_counts, num_rows)
    phys, counts = naive.blocks_to_physical_rows(blocks, token_rows, token_nc, block_table, rows_per_block,
                                                 candidate_block_size, table_width, num_rows)
    out[:num_rows].copy_(phys)
    out_counts[:num_rows].copy_(counts)
    return out, out_counts
