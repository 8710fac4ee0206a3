"""``candidate_topk_to_slots``: a V4.1 candidate consumer's sparse columns -> physical slots.

Checks and dispatch live here; the Triton kernel in :mod:`.kernel`, the column expansion in :mod:`.naive`;
the reference composes it with ``topk_to_slots``'s (the definition, docs/DESIGN.md §4 "Candidate blocks").
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check_batch, check_cp, check_int, check_tensor, needs_value_checks, use_triton
from .._args import (check_block_table, check_compressed_reads, check_per_request, check_token_inputs, resolve_rows,
                     table_rows, token_out)
from ..topk_to_slots import naive as topk_naive
from . import kernel, naive

__all__ = ["candidate_topk_to_slots", "candidate_topk_to_slots_rows", "check_candidate_args"]


def check_candidate_args(blocks, rows_per_block: int, candidate_block_size: int, device) -> None:
    """``blocks`` int32 ``[rows, nb]`` on ``device`` (unit column stride), ``C >= 1`` dividing ``S``
    (docs/DESIGN.md §4: a candidate block lies inside one cache block) and ``nb * C < 2**31``."""
    check_tensor("blocks", blocks, dtypes=(torch.int32,), ndim=2, device=device)
    check_int("rows_per_block", rows_per_block, lo=1)
    check_int("candidate_block_size", candidate_block_size, lo=1)
    if rows_per_block % candidate_block_size:
        raise ValueError(f"candidate_block_size = {candidate_block_size} does not divide rows_per_block = "
                         f"{rows_per_block} (a candidate block must lie inside one cache block)")
    if blocks.shape[1] * candidate_block_size >= 2 ** 31:
        raise ValueError(f"blocks has {blocks.shape[1]} columns of {candidate_block_size} rows: more than int32 "
                         f"sparse columns")


def candidate_topk_to_slots(blocks: torch.Tensor, cols: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, block_table: torch.Tensor, rows_per_block: int,
                            compress_ratio: int, candidate_block_size: int, *, cp_world_size: int = 1,
                            cp_rank: int = 0, cp_interleave: int = 1, compact: bool = False,
                            idx_mapping: Optional[torch.Tensor] = None, num_tokens: Optional[int] = None,
                            out: Optional[torch.Tensor] = None, out_lens: Optional[torch.Tensor] = None,
                            validate: bool = False, backend: Optional[str] = None):
    """Convert a candidate consumer's sparse columns to physical slots (docs/DESIGN.md §4 "Candidate blocks").

    Parameters
    ----------
    blocks : int32 ``[>= T, nb]``
        The candidate source's request-local candidate blocks of each token (``-1`` = none).
    cols : int32 or int64 ``[>= T, K]``
        The consumer's sparse columns: column ``j`` is row ``j % C`` of block ``blocks[t, j // C]``
        (``-1`` = none). Any value is safe.
    query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio, cp_world_size, cp_rank,
    cp_interleave, compact, idx_mapping, num_tokens, out, out_lens, validate, backend
        As in :func:`dsv4_index.topk_to_slots`.
    candidate_block_size : int
        ``C`` (``layout.candidate_block_size``); must divide ``rows_per_block``.

    Returns
    -------
    (slots int32 ``[T_out, K]``, lens int32 ``[T_out]``): exactly ``topk_to_slots(rows, ...)`` for
    ``rows[t, k] = blocks[t, j // C] * C + j % C`` (``-1`` where ``j < 0``, ``j // C >= nb`` or the block is
    ``-1``).

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import candidate_topk_to_slots
    >>> qsl, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    >>> bt = torch.tensor([[4, 9, 7]], dtype=torch.int32)              # S = 4 rows per block, R = 1
    >>> blocks = torch.tensor([[1, 5, -1]], dtype=torch.int32)         # C = 2: rows 2-3, rows 10-11, none
    >>> cols = torch.tensor([[0, 1, 2, 3, 4, -1]], dtype=torch.int32)
    >>> slots, lens = candidate_topk_to_slots(blocks, cols, qsl, seq, bt, 4, 1, 2)
    >>> slots.tolist(), lens.tolist()                                  # rows 2, 3, 10, 11 -> slots
    ([[18, 19, 30, 31, -1, -1]], [4])
    """
    B, device = check_batch(query_start_loc, seq_lens)
    check_block_table(block_table, device)
    check_candidate_args(blocks, rows_per_block, candidate_block_size, device)
    check_tensor("cols", cols, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
    check_int("compress_ratio", compress_ratio, lo=1)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    idx_mapping = check_per_request("idx_mapping", idx_mapping, B, device)
    outs = {"out": out, "out_lens": out_lens}
    T_out = resolve_rows(query_start_loc, num_tokens, outs)
    check_token_inputs({"blocks": blocks, "cols": cols}, num_tokens, T_out, outs)
    K = cols.shape[1]
    out = token_out("out", out, T_out, num_tokens, torch.int32, device, cols=K, exact_cols=True)
    out_lens = token_out("out_lens", out_lens, T_out, num_tokens, torch.int32, device)
    check = needs_value_checks(device, validate)
    rows = table_rows(block_table, idx_mapping, B, check)
    cp = (cp_world_size, cp_rank, cp_interleave)
    if check:
        check_compressed_reads({"blocks": blocks, "cols": cols}, query_start_loc, seq_lens, num_tokens, T_out,
                               block_table, rows, rows_per_block, compress_ratio, cp)
    if use_triton(device, backend):
        return kernel.launch(blocks, cols, (query_start_loc, seq_lens, idx_mapping), None, block_table,
                             rows_per_block, compress_ratio, candidate_block_size, block_table.shape[1], cp,
                             bool(compact), out, out_lens, T_out)
    trow, nc = topk_naive.token_rows(query_start_loc, seq_lens, rows, block_table.shape[0], compress_ratio, T_out)
    slots, lens = _reference(blocks, cols, trow, nc, block_table, rows_per_block, compress_ratio,
                             candidate_block_size, block_table.shape[1], cp, bool(compact), T_out)
    out.copy_(slots)
    out_lens.copy_(lens)
    return out, out_lens


def _reference(blocks, cols, token_rows, token_nc, block_table, rows_per_block, compress_ratio, C, table_width,
               cp, compact, num_rows):
    """The definition: expand the columns (:func:`.naive.expand_rows`), then the top-k reference."""
    picks = naive.expand_rows(blocks, cols, C, num_rows)
    return topk_naive.topk_to_slots_rows(picks, token_rows, token_nc, block_table, rows_per_block, compress_ratio,
                                         table_width, cp[0], cp[1], cp[2], compact, num_rows)


def candidate_topk_to_slots_rows(blocks: torch.Tensor, cols: torch.Tensor, token_rows: torch.Tensor,
                                 token_nc: torch.Tensor, block_table: torch.Tensor, rows_per_block: int,
                                 compress_ratio: int, candidate_block_size: int, num_rows: int, *,
                                 table_width: Optional[int] = None, cp_world_size: int = 1, cp_rank: int = 0,
                                 cp_interleave: int = 1, compact: bool = False,
                                 out: Optional[torch.Tensor] = None, out_lens: Optional[torch.Tensor] = None,
                                 backend: Optional[str] = None):
    """Pipeline form of :func:`candidate_topk_to_slots` (per-token table rows and ``n_c`` from the step build,
    no request search, no value check), as :func:`dsv4_index.ops.topk_to_slots.topk_to_slots_rows`.

    Returns ``(out int32 [>= num_rows, K], out_lens int32 [>= num_rows])``; rows past ``num_rows`` are left
    alone.
    """
    device = token_rows.device
    check_tensor("token_rows", token_rows, dtypes=(torch.int32,), ndim=1)
    check_tensor("token_nc", token_nc, dtypes=(torch.int32,), ndim=1, device=device)
    check_candidate_args(blocks, rows_per_block, candidate_block_size, device)
    check_tensor("cols", cols, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
    check_block_table(block_table, device)
    check_int("compress_ratio", compress_ratio, lo=1)
    check_int("num_rows", num_rows, lo=0)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    for name, x in (("token_rows", token_rows), ("token_nc", token_nc)):
        if x.numel() < num_rows:
            raise ValueError(f"{name} has {x.numel()} entries, needs num_rows = {num_rows}")
    table_width = block_table.shape[1] if table_width is None else check_int("table_width", table_width, lo=0)
    if table_width > block_table.shape[1]:
        raise ValueError(f"table_width = {table_width} exceeds block_table's {block_table.shape[1]} columns")
    K = cols.shape[1]
    out = token_out("out", out, num_rows, num_rows, torch.int32, device, cols=K, exact_cols=True)
    out_lens = token_out("out_lens", out_lens, num_rows, num_rows, torch.int32, device)
    cp = (cp_world_size, cp_rank, cp_interleave)
    if use_triton(device, backend):
        return kernel.launch(blocks, cols, None, (token_rows, token_nc), block_table, rows_per_block,
                             compress_ratio, candidate_block_size, table_width, cp, bool(compact), out, out_lens,
                             num_rows)
    slots, lens = _reference(blocks, cols, token_rows, token_nc, block_table, rows_per_block, compress_ratio,
                             candidate_block_size, table_width, cp, bool(compact), num_rows)
    out[:num_rows].copy_(slots)
    out_lens[:num_rows].copy_(lens)
    return out, out_lens
