"""``causal_compressed_indices``: every visible compressed row of each token, as slots (``c128a``).

Checks and dispatch live here; the Triton kernel in :mod:`.kernel`, the PyTorch reference in
:mod:`.naive` (they never import each other).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check_batch, check_cp, check_int, needs_value_checks, use_triton
from .._args import (check_block_table, check_per_request, check_slots_fit_int32, check_values,
                     prefix_blocks_used, resolve_rows, table_rows, token_out)
from . import kernel, naive

__all__ = ["causal_compressed_indices"]


def causal_compressed_indices(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              block_table: torch.Tensor, rows_per_block: int, compress_ratio: int,
                              width: int, *, cp_world_size: int = 1, cp_rank: int = 0,
                              cp_interleave: int = 1, idx_mapping: Optional[torch.Tensor] = None,
                              num_tokens: Optional[int] = None, out: Optional[torch.Tensor] = None,
                              out_lens: Optional[torch.Tensor] = None, validate: bool = False,
                              backend: Optional[str] = None):
    """Slots of every visible compressed row of each token (``c128a``, no indexer).

    Parameters
    ----------
    query_start_loc : int32 ``[B + 1]``
    seq_lens : int32 ``[B]``
    block_table : int32 ``[rows, cols]``
        Block ids of the compressed channel's group; request ``b`` reads row ``idx_mapping[b]``
        (or row ``b``).
    rows_per_block : int
        ``S = block_size // R``.
    compress_ratio : int
        ``R``.
    width : int
        Row width, fixed at capacity (``round_up(ceil(max_model_len / R), 128)``); ``out.shape[1]``
        when ``out=`` is given (it must be ``>= width``).
    cp_world_size, cp_rank, cp_interleave : int
        DCP: list only the rows this rank owns (local slots, ascending, packed).
    idx_mapping : int32 ``[B]``, optional
        Table row of each request (tables indexed by request slot, e.g. the pipeline's).
    num_tokens : int, optional
        Host-known live token count; rows of the result when ``out=`` is None (read from
        ``query_start_loc[-1]`` otherwise: one host sync on CUDA).
    out, out_lens : int32 ``[T_out, >= width]`` and ``[T_out]``, optional (same rows)
    validate : bool
        Run the value checks on CUDA inputs too (always on CPU): every live token's visible rows
        must fit the row width (else ``ValueError`` naming ``width``) and the table's rows
        ``cols * S`` (naming ``block_table``), and every listed slot must fit int32.
    backend : {None, "triton", "reference"}

    Returns
    -------
    (indices int32 ``[T_out, width]``, lens int32 ``[T_out]``)
        ``lens[t] = n_c(pos_t) = (pos_t + 1) // R`` (the owned count under DCP, docs/DESIGN.md §4);
        ``indices[t, j] = bt[j // S] * S + j % S`` for ``j < lens[t]`` (local rows), ``-1`` after.
        Padded tokens (``t >= query_start_loc[B]``) get ``-1`` rows and length 0. Unchecked CUDA
        inputs never read outside the table: rows are clamped to ``min(width, cols * S)``.

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import causal_compressed_indices
    >>> qsl = torch.tensor([0, 1, 4], dtype=torch.int32)    # request 0: 1 token, request 1: 3 tokens
    >>> seq = torch.tensor([10, 3], dtype=torch.int32)      # positions 9 and 0, 1, 2
    >>> bt = torch.tensor([[4, 9, 2], [7, 0, 0]], dtype=torch.int32)   # block ids per request
    >>> idx, lens = causal_compressed_indices(qsl, seq, bt, 4, 2, 8, num_tokens=4)   # S 4, R 2, width 8
    >>> idx[0].tolist(), lens.tolist()                  # rows 0..4 of request 0
    ([16, 17, 18, 19, 36, -1, -1, -1], [5, 0, 1, 1])
    """
    B, device = check_batch(query_start_loc, seq_lens)
    check_block_table(block_table, device)
    check_int("rows_per_block", rows_per_block, lo=1)
    check_int("compress_ratio", compress_ratio, lo=1)
    check_int("width", width, lo=1)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    idx_mapping = check_per_request("idx_mapping", idx_mapping, B, device)
    T_out = resolve_rows(query_start_loc, num_tokens, {"out": out, "out_lens": out_lens})
    out = token_out("out", out, T_out, num_tokens, torch.int32, device, cols=width)
    out_lens = token_out("out_lens", out_lens, T_out, num_tokens, torch.int32, device)
    width = out.shape[1]
    check = needs_value_checks(device, validate)
    rows = table_rows(block_table, idx_mapping, B, check)
    if check:
        check_values(query_start_loc, seq_lens, num_tokens, T_out)
        req, valid, n = naive.visible(query_start_loc.cpu(), seq_lens.cpu(), int(query_start_loc[-1]),
                                      compress_ratio, cp_world_size, cp_rank, cp_interleave)
        most = int(n.max()) if n.numel() else 0
        if most > width:
            t = int(torch.nonzero(n > width)[0])
            raise ValueError(f"width = {width} is narrower than the {int(n[t])} visible compressed rows "
                             f"of token {t} (request {int(req[t])}); rows are never cut")
        if most > block_table.shape[1] * rows_per_block:
            t = int(torch.nonzero(n > block_table.shape[1] * rows_per_block)[0])
            raise ValueError(f"block_table has {block_table.shape[1]} columns ({block_table.shape[1]} * "
                             f"{rows_per_block} rows), but token {t} (request {int(req[t])}) sees "
                             f"{int(n[t])} compressed rows")
        used = prefix_blocks_used(req, n, valid, B, block_table.shape[1], rows_per_block)
        check_slots_fit_int32("block_table", block_table, rows, used, rows_per_block)
    if use_triton(device, backend):
        return kernel.launch(query_start_loc, seq_lens, block_table, idx_mapping, rows_per_block,
                             compress_ratio, cp_world_size, cp_rank, cp_interleave, out, out_lens)
    idx, lens = naive.causal_compressed_indices(query_start_loc, seq_lens, block_table, rows_per_block,
                                                compress_ratio, rows, cp_world_size, cp_rank,
                                                cp_interleave, T_out, width)
    out.copy_(idx)
    out_lens.copy_(lens)
    return out, out_lens
