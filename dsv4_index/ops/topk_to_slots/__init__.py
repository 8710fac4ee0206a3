"""``topk_to_slots``: indexer top-k picks (request-local compressed row ids) -> physical slots (``c4a``).

Checks and dispatch live here; the Triton kernels in :mod:`.kernel` (the public op and the
pipeline's ``launch_rows``), the PyTorch reference in :mod:`.naive` (they never import each other).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check_batch, check_cp, check_int, check_tensor, needs_value_checks, use_triton
from .._args import (check_block_table, check_compressed_reads, check_per_request, check_token_inputs, resolve_rows,
                     table_rows, token_out)
from . import kernel, naive

__all__ = ["topk_to_slots", "topk_to_slots_rows"]


def topk_to_slots(topk: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, rows_per_block: int, compress_ratio: int, *,
                  cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                  compact: bool = False, idx_mapping: Optional[torch.Tensor] = None,
                  num_tokens: Optional[int] = None, out: Optional[torch.Tensor] = None,
                  out_lens: Optional[torch.Tensor] = None, validate: bool = False,
                  backend: Optional[str] = None):
    """Convert indexer top-k (request-local compressed row ids) to physical slots.

    Parameters
    ----------
    topk : int32 or int64 ``[>= T, K]``
        Row ``t`` holds compressed row ids of token ``t``'s request (``-1`` = none); only the rows
        of live tokens are read (rows of padded tokens are not read at all). Any value is safe.
    query_start_loc : int32 ``[B + 1]``
    seq_lens : int32 ``[B]``
    block_table : int32 ``[rows, cols]``
        Block ids of the channel's group; request ``b`` reads row ``idx_mapping[b]`` (or row ``b``).
    rows_per_block, compress_ratio : int
        ``S`` and ``R`` of the channel.
    cp_world_size, cp_rank, cp_interleave : int
        DCP: rows owned by other ranks are invalid; owned rows use their local row.
    compact : bool
        Pack the valid entries to the front of each row (original order kept).
    idx_mapping : int32 ``[B]``, optional
        Table row of each request (tables indexed by request slot, e.g. the pipeline's).
    num_tokens : int, optional
        Host-known live token count; rows of the result when ``out=`` is None.
    out, out_lens : int32 ``[T_out, K]`` and ``[T_out]``, optional (same rows)
    validate : bool
        Run the value checks on CUDA inputs too (always on CPU), among them that every slot a pick
        can reach fits int32 (the conversion runs in int32).
    backend : {None, "triton", "reference"}

    Returns
    -------
    (slots int32 ``[T_out, K]``, lens int32 ``[T_out]``)
        Pick ``l`` of token ``t`` is valid iff ``0 <= l < n_c(pos_t) = (pos_t + 1) // R``, this rank
        owns row ``l`` and its local block ``lc // S`` lies inside the table; it becomes
        ``bt[lc // S] * S + lc % S``, anything else ``-1``. ``lens[t]`` = number of valid entries
        (0 for padded tokens, whose rows are all ``-1``).

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import topk_to_slots
    >>> qsl = torch.tensor([0, 1, 4], dtype=torch.int32)    # request 0: 1 token, request 1: 3 tokens
    >>> seq = torch.tensor([10, 3], dtype=torch.int32)      # positions 9 and 0, 1, 2
    >>> bt = torch.tensor([[4, 9, 2], [7, 0, 0]], dtype=torch.int32)   # block ids per request
    >>> topk = torch.tensor([[0, 4, 5, -1], [0, 1, 2, 3], [0, 1, 2, 3], [1, 0, 3, 3]], dtype=torch.int32)
    >>> slots, lens = topk_to_slots(topk, qsl, seq, bt, 4, 2)        # S 4, R 2
    >>> slots[0].tolist(), slots[3].tolist(), lens.tolist()   # row 5 is not visible yet at position 9
    ([16, 36, -1, -1], [-1, 28, -1, -1], [2, 0, 1, 1])
    >>> topk_to_slots(topk, qsl, seq, bt, 4, 2, compact=True)[0][3].tolist()   # valid picks first
    [28, -1, -1, -1]
    """
    B, device = check_batch(query_start_loc, seq_lens)
    check_block_table(block_table, device)
    check_tensor("topk", topk, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
    check_int("rows_per_block", rows_per_block, lo=1)
    check_int("compress_ratio", compress_ratio, lo=1)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    idx_mapping = check_per_request("idx_mapping", idx_mapping, B, device)
    outs = {"out": out, "out_lens": out_lens}
    T_out = resolve_rows(query_start_loc, num_tokens, outs)
    check_token_inputs({"topk": topk}, num_tokens, T_out, outs)
    K = topk.shape[1]
    out = token_out("out", out, T_out, num_tokens, torch.int32, device, cols=K, exact_cols=True)
    out_lens = token_out("out_lens", out_lens, T_out, num_tokens, torch.int32, device)
    check = needs_value_checks(device, validate)
    rows = table_rows(block_table, idx_mapping, B, check)
    if check:
        check_compressed_reads({"topk": topk}, query_start_loc, seq_lens, num_tokens, T_out, block_table, rows,
                               rows_per_block, compress_ratio, (cp_world_size, cp_rank, cp_interleave))
    if use_triton(device, backend):
        return kernel.launch(topk, query_start_loc, seq_lens, block_table, idx_mapping, rows_per_block,
                             compress_ratio, cp_world_size, cp_rank, cp_interleave, bool(compact), out,
                             out_lens)
    slots, lens = naive.topk_to_slots(topk, query_start_loc, seq_lens, block_table, rows_per_block,
                                      compress_ratio, rows, cp_world_size, cp_rank, cp_interleave,
                                      bool(compact), T_out)
    out.copy_(slots)
    out_lens.copy_(lens)
    return out, out_lens


def topk_to_slots_rows(topk: torch.Tensor, token_rows: torch.Tensor, token_nc: torch.Tensor,
                       block_table: torch.Tensor, rows_per_block: int, compress_ratio: int,
                       num_rows: int, *, table_width: Optional[int] = None, cp_world_size: int = 1,
                       cp_rank: int = 0, cp_interleave: int = 1, compact: bool = False,
                       out: Optional[torch.Tensor] = None, out_lens: Optional[torch.Tensor] = None,
                       backend: Optional[str] = None):
    """Pipeline form of :func:`topk_to_slots`: per-token table rows and ``n_c`` precomputed by the
    step build, no request search, no value check (no host read of device data).

    Parameters
    ----------
    topk : int32 or int64 ``[rows, K]``
    token_rows : int32 ``[>= num_rows]``
        Block-table row of each token, ``-1`` for padded tokens.
    token_nc : int32 ``[>= num_rows]``
        Visible compressed rows ``(pos + 1) // R`` of each token (every row, DCP or not), 0 for padded.
    block_table : int32 ``[rows, cols]``
    rows_per_block, compress_ratio : int
    num_rows : int
        Rows converted and written (``T_out``, host count).
    table_width : int, optional
        Logical width of a table row (default ``cols``).
    cp_world_size, cp_rank, cp_interleave, compact
        As in :func:`topk_to_slots`.
    out, out_lens : int32 ``[>= num_rows, K]`` and ``[>= num_rows]``, optional
        Rows past ``num_rows`` are left alone.
    backend : {None, "triton", "reference"}

    Returns
    -------
    (out, out_lens), equal to :func:`topk_to_slots` on the batch the rows describe. The caller
    guarantees what that op's value checks would (every reachable slot fits int32).
    """
    device = token_rows.device
    check_tensor("token_rows", token_rows, dtypes=(torch.int32,), ndim=1)
    check_tensor("token_nc", token_nc, dtypes=(torch.int32,), ndim=1, device=device)
    check_tensor("topk", topk, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
    check_block_table(block_table, device)
    check_int("rows_per_block", rows_per_block, lo=1)
    check_int("compress_ratio", compress_ratio, lo=1)
    check_int("num_rows", num_rows, lo=0)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    for name, x in (("token_rows", token_rows), ("token_nc", token_nc)):
        if x.numel() < num_rows:
            raise ValueError(f"{name} has {x.numel()} entries, needs num_rows = {num_rows}")
    if table_width is None:
        table_width = block_table.shape[1]
    check_int("table_width", table_width, lo=0)
    if table_width > block_table.shape[1]:
        raise ValueError(f"table_width = {table_width} exceeds block_table's {block_table.shape[1]} columns")
    K = topk.shape[1]
    out = token_out("out", out, num_rows, num_rows, torch.int32, device, cols=K, exact_cols=True)
    out_lens = token_out("out_lens", out_lens, num_rows, num_rows, torch.int32, device)
    if use_triton(device, backend):
        return kernel.launch_rows(topk, token_rows, token_nc, block_table, rows_per_block,
                                  compress_ratio, table_width, cp_world_size, cp_rank, cp_interleave,
                                  bool(compact), out, out_lens, num_rows)
    slots, lens = naive.topk_to_slots_rows(topk, token_rows, token_nc, block_table, rows_per_block,
                                           compress_ratio, table_width, cp_world_size, cp_rank,
                                           cp_interleave, bool(compact), num_rows)
    out[:num_rows].copy_(slots)
    out_lens[:num_rows].copy_(lens)
    return out, out_lens
