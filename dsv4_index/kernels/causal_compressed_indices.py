"""Causal compressed index lists (``c128a``): every visible compressed row of each token, as slots.

Row ``t`` lists the slots of compressed rows ``0 .. n_c(pos_t) - 1`` (``n_c(pos) = (pos + 1) // R``),
``-1`` after them; under DCP only the rows this rank owns, ascending, as local slots, packed to
the front. Index lists are int32 (DESIGN §4): slots are computed in int64 and stored as int32.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from dsv4_index._common import (cdiv, check_batch, check_batch_values, check_cp, check_positive_int,
                                needs_value_checks, prepare_out, use_triton)
from dsv4_index.kernels._compressed import (check_slots_fit_int32, num_search_iters, resolve_rows,
                                            token_rows, token_tile)


class CausalArgs(NamedTuple):
    num_reqs: int
    rows: int      # T_out
    width: int     # row width actually written (out.shape[1] when out= is given)
    out: torch.Tensor
    out_lens: torch.Tensor


def check_causal_compressed_indices_args(query_start_loc, seq_lens, block_table, rows_per_block,
                                         compress_ratio, width, cp_world_size, cp_rank,
                                         cp_interleave, num_tokens, out, out_lens,
                                         validate) -> CausalArgs:
    """Argument checks shared by the wrapper and the reference; allocates missing outputs."""
    B, device = check_batch(query_start_loc, seq_lens, block_table)
    check_positive_int("rows_per_block", rows_per_block)
    check_positive_int("compress_ratio", compress_ratio)
    check_positive_int("width", width)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    rows = resolve_rows(query_start_loc, num_tokens, {"out": out, "out_lens": out_lens})
    min_rows = num_tokens or 0
    out = prepare_out("out", out, shape=(rows, width), min_rows=min_rows, dtype=torch.int32,
                      device=device)
    out_lens = prepare_out("out_lens", out_lens, shape=(rows,), min_rows=min_rows,
                           dtype=torch.int32, device=device)
    width = out.shape[1]
    if needs_value_checks(device, validate):
        check_batch_values(query_start_loc, seq_lens, num_tokens=rows)
        check_slots_fit_int32(seq_lens, block_table, rows_per_block, compress_ratio,
                              cp_world_size, cp_rank, cp_interleave, max_rows=width)
    return CausalArgs(B, rows, width, out, out_lens)


# NOTE: runtime counts are never specialised (a count of 1 would otherwise compile a new variant)
@triton.jit(do_not_specialize=["T_out", "num_reqs", "n_iter", "bt_stride", "out_stride", "width", "max_len",
                            "rows_per_block", "compress_ratio", "cp_world", "cp_rank", "cp_interleave"])
def _causal_compressed_indices_kernel(
    qsl_ptr,        # [B + 1] int32
    seq_lens_ptr,   # [B] int32
    bt_ptr,         # [>= B, table_width] int32
    out_ptr,        # [T_out, width] int32
    lens_ptr,       # [T_out] int32
    T_out, num_reqs, n_iter, bt_stride, out_stride, width, max_len, rows_per_block,
    compress_ratio, cp_world, cp_rank, cp_interleave,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_out = t < T_out
    b, live, cnt = token_rows(qsl_ptr, seq_lens_ptr, t, T_out, num_reqs, n_iter, compress_ratio,
                              cp_world, cp_rank, cp_interleave)
    # NOTE: max_len = min(width, table_width * S): rows listed are the prefix 0 .. n-1 of local rows,
    # so j < n bounds both the row width and the table width.
    n = tl.minimum(cnt, max_len)
    tl.store(lens_ptr + t, n.to(tl.int32), mask=in_out & (tl.program_id(1) == 0))

    j = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = (j[None, :] < n[:, None]) & live[:, None]
    blk = j // rows_per_block
    row_ptr = bt_ptr + b.to(tl.int64)[:, None] * bt_stride
    bid = tl.load(row_ptr + blk[None, :], mask=ok, other=0).to(tl.int64)
    slot = bid * rows_per_block + (j % rows_per_block)[None, :]
    res = tl.where(ok, slot, -1).to(tl.int32)
    dst = out_ptr + t.to(tl.int64)[:, None] * out_stride + j[None, :]
    tl.store(dst, res, mask=in_out[:, None] & (j[None, :] < width))


def causal_compressed_indices(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              block_table: torch.Tensor, rows_per_block: int, compress_ratio: int,
                              width: int, *, cp_world_size: int = 1, cp_rank: int = 0,
                              cp_interleave: int = 1, num_tokens: Optional[int] = None,
                              out: Optional[torch.Tensor] = None,
                              out_lens: Optional[torch.Tensor] = None, validate: bool = False,
                              backend: Optional[str] = None):
    """Slots of every visible compressed row of each token (``c128a``, no indexer).

    Parameters
    ----------
    query_start_loc : int32 ``[B + 1]``
    seq_lens : int32 ``[B]``
    block_table : int32 ``[>= B, table_width]`` block ids of the compressed channel's group.
    rows_per_block : int
        ``S = block_size // R``.
    compress_ratio : int
        ``R``.
    width : int
        Row width (capacity, e.g. ``round_up(ceil(max_model_len / R), 128)``); ``out.shape[1]``
        when ``out=`` is given (it must be ``>= width``).
    cp_world_size, cp_rank, cp_interleave : int
        DCP: list only the rows this rank owns (local slots, ascending, packed).
    num_tokens : int, optional
        Host-known live token count; rows of the result when ``out=`` is None (read from
        ``query_start_loc[-1]`` otherwise: one host sync on CUDA).
    out, out_lens : int32 ``[T_out, >= width]`` and ``[T_out]``, optional
    validate : bool
        Run the value checks on CUDA inputs too (always on CPU).
    backend : {None, "triton", "reference"}

    Returns
    -------
    (indices int32 ``[T_out, width]``, lens int32 ``[T_out]``)
        ``indices[t, j] = bt[j // S] * S + j % S`` for ``j < lens[t]``, ``-1`` after;
        ``lens[t] = min(owned n_c(pos_t), width, table_width * S)``; padded tokens
        (``t >= query_start_loc[B]``) get ``-1`` rows and length 0.
    """
    a = check_causal_compressed_indices_args(
        query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio, width,
        cp_world_size, cp_rank, cp_interleave, num_tokens, out, out_lens, validate)
    if not use_triton(query_start_loc.device, backend):
        from dsv4_index.reference.causal_compressed_indices import compute
        return compute(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                       cp_world_size, cp_rank, cp_interleave, a)
    if a.rows == 0:
        return a.out, a.out_lens
    block_w = min(triton.next_power_of_2(a.width), 256)
    block_t = token_tile(block_w)
    grid = (cdiv(a.rows, block_t), cdiv(a.width, block_w))
    _causal_compressed_indices_kernel[grid](
        query_start_loc, seq_lens, block_table, a.out, a.out_lens,
        a.rows, a.num_reqs, num_search_iters(a.num_reqs), block_table.stride(0), a.out.stride(0),
        a.width, min(a.width, block_table.shape[1] * rows_per_block), rows_per_block,
        compress_ratio, cp_world_size, cp_rank, cp_interleave,
        BLOCK_T=block_t, BLOCK_W=block_w, num_warps=4)
    return a.out, a.out_lens
