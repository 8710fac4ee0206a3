"""Top-k -> physical slots (``c4a``): request-local compressed row ids to cache slots, per layer.

Entry ``topk[t, k] = l`` is valid iff ``0 <= l < n_c(pos_t)``, its block (``l // S``, local under
DCP) lies inside the table row and, under DCP, this rank owns row ``l``; valid entries become
``bt[block] * S + l % S`` and the others ``-1`` (in place, or valid ones packed to the front in
order with ``compact=True``). Index lists are int32 (DESIGN §4): comparisons and slots are int64,
so any ``topk`` value (int32 or int64, negative or huge) is safe; the result is stored as int32.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from dsv4_index._common import (cdiv, check_batch, check_batch_values, check_cp, check_positive_int,
                                check_tensor, needs_value_checks, prepare_out, use_triton)
from dsv4_index.kernels._compressed import (check_slots_fit_int32, num_search_iters, resolve_rows,
                                            token_rows, token_tile)


class TopkArgs(NamedTuple):
    num_reqs: int
    rows: int      # T_out
    out: torch.Tensor
    out_lens: torch.Tensor


def check_topk_to_slots_args(topk, query_start_loc, seq_lens, block_table, rows_per_block,
                             compress_ratio, cp_world_size, cp_rank, cp_interleave, num_tokens,
                             out, out_lens, validate) -> TopkArgs:
    """Argument checks shared by the wrapper and the reference; allocates missing outputs."""
    B, device = check_batch(query_start_loc, seq_lens, block_table)
    check_tensor("topk", topk, dtypes=(torch.int32, torch.int64), ndim=2, device=device)
    check_positive_int("rows_per_block", rows_per_block)
    check_positive_int("compress_ratio", compress_ratio)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    rows = resolve_rows(query_start_loc, num_tokens, {"out": out, "out_lens": out_lens})
    live = num_tokens if num_tokens is not None else (rows if out is None and out_lens is None
                                                      else None)
    if live is not None and topk.shape[0] < live:
        raise ValueError(f"topk has {topk.shape[0]} rows, needs at least num_tokens = {live}")
    min_rows = num_tokens or 0
    K = topk.shape[1]
    out = prepare_out("out", out, shape=(rows, K), min_rows=min_rows, dtype=torch.int32,
                      device=device, exact_cols=True)
    out_lens = prepare_out("out_lens", out_lens, shape=(rows,), min_rows=min_rows,
                           dtype=torch.int32, device=device)
    if needs_value_checks(device, validate):
        check_batch_values(query_start_loc, seq_lens, num_tokens=rows)
        n_live = int(query_start_loc[-1])
        if topk.shape[0] < n_live:
            raise ValueError(f"topk has {topk.shape[0]} rows, query_start_loc[-1] = {n_live}")
        check_slots_fit_int32(seq_lens, block_table, rows_per_block, compress_ratio,
                              cp_world_size, cp_rank, cp_interleave)
    return TopkArgs(B, rows, out, out_lens)


# NOTE: runtime counts are never specialised (a count of 1 would otherwise compile a new variant)
@triton.jit(do_not_specialize=["T_out", "topk_rows", "topk_stride", "K", "num_reqs", "n_iter", "bt_stride",
                            "table_width", "rows_per_block", "compress_ratio", "cp_world", "cp_rank",
                            "cp_interleave"])
def _topk_to_slots_kernel(
    topk_ptr,       # [>= T, K] int32 | int64
    qsl_ptr,        # [B + 1] int32
    seq_lens_ptr,   # [B] int32
    bt_ptr,         # [>= B, table_width] int32
    out_ptr,        # [T_out, K] int32
    lens_ptr,       # [T_out] int32
    T_out, topk_rows, topk_stride, K, num_reqs, n_iter, bt_stride, table_width, rows_per_block,
    compress_ratio, cp_world, cp_rank, cp_interleave,
    COMPACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_out = t < T_out
    b, live, n_c = token_rows(qsl_ptr, seq_lens_ptr, t, T_out, num_reqs, n_iter, compress_ratio,
                              1, 0, 1)
    k = tl.arange(0, BLOCK_K)
    # NOTE: only rows t < min(qsl[B], topk_rows) of topk are read.
    rd = (live & (t < topk_rows))[:, None] & (k < K)[None, :]
    t64 = t.to(tl.int64)
    l = tl.load(topk_ptr + t64[:, None] * topk_stride + k[None, :], mask=rd, other=-1)
    l = l.to(tl.int64)
    ok = rd & (l >= 0) & (l < n_c[:, None])
    l = tl.where(ok, l, 0)
    ok = ok & ((l // cp_interleave) % cp_world == cp_rank)
    lc = (l // (cp_interleave * cp_world)) * cp_interleave + l % cp_interleave
    blk = lc // rows_per_block
    ok = ok & (blk < table_width)
    row_ptr = bt_ptr + b.to(tl.int64)[:, None] * bt_stride
    bid = tl.load(row_ptr + blk, mask=ok, other=0).to(tl.int64)
    slot = (bid * rows_per_block + lc % rows_per_block).to(tl.int32)
    n = tl.sum(ok.to(tl.int32), axis=1)
    tl.store(lens_ptr + t, n, mask=in_out)

    row_out = out_ptr + t64[:, None] * K
    st = in_out[:, None] & (k < K)[None, :]
    if COMPACT:
        # NOTE: a valid entry goes to column (number of valid entries up to it) - 1; the columns
        # from n on get -1. The two stores hit disjoint columns.
        dst = tl.cumsum(ok.to(tl.int32), axis=1) - 1
        tl.store(row_out + dst, slot, mask=st & ok)
        tl.store(row_out + k[None, :], tl.full([BLOCK_T, BLOCK_K], -1, tl.int32),
                 mask=st & (k[None, :] >= n[:, None]))
    else:
        tl.store(row_out + k[None, :], tl.where(ok, slot, -1), mask=st)


def topk_to_slots(topk: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, rows_per_block: int, compress_ratio: int, *,
                  cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                  compact: bool = False, num_tokens: Optional[int] = None,
                  out: Optional[torch.Tensor] = None, out_lens: Optional[torch.Tensor] = None,
                  validate: bool = False, backend: Optional[str] = None):
    """Convert indexer top-k (request-local compressed row ids) to physical slots.

    Parameters
    ----------
    topk : int32 or int64 ``[>= T, K]``
        Row ``t`` holds compressed row ids of token ``t``'s request (``-1`` = none); only the first
        ``T`` rows are read (rows of padded tokens are not read at all).
    query_start_loc : int32 ``[B + 1]``
    seq_lens : int32 ``[B]``
    block_table : int32 ``[>= B, table_width]`` block ids of the channel's group.
    rows_per_block, compress_ratio : int
        ``S`` and ``R`` of the channel.
    cp_world_size, cp_rank, cp_interleave : int
        DCP: rows owned by other ranks are invalid; owned rows use their local row.
    compact : bool
        Pack the valid entries to the front of each row (original order kept).
    num_tokens : int, optional
        Host-known live token count; rows of the result when ``out=`` is None.
    out, out_lens : int32 ``[T_out, K]`` and ``[T_out]``, optional
    validate : bool
        Run the value checks on CUDA inputs too (always on CPU).
    backend : {None, "triton", "reference"}

    Returns
    -------
    (slots int32 ``[T_out, K]``, lens int32 ``[T_out]``)
        ``lens[t]`` = number of valid entries (0 for padded tokens, whose rows are all ``-1``).
    """
    a = check_topk_to_slots_args(topk, query_start_loc, seq_lens, block_table, rows_per_block,
                                 compress_ratio, cp_world_size, cp_rank, cp_interleave,
                                 num_tokens, out, out_lens, validate)
    if not use_triton(query_start_loc.device, backend):
        from dsv4_index.reference.topk_to_slots import compute
        return compute(topk, query_start_loc, seq_lens, block_table, rows_per_block,
                       compress_ratio, cp_world_size, cp_rank, cp_interleave, bool(compact), a)
    if a.rows == 0:
        return a.out, a.out_lens
    K = topk.shape[1]
    block_k = max(triton.next_power_of_2(max(K, 1)), 16)
    block_t = token_tile(block_k)
    _topk_to_slots_kernel[(cdiv(a.rows, block_t),)](
        topk, query_start_loc, seq_lens, block_table, a.out, a.out_lens,
        a.rows, topk.shape[0], max(topk.stride(0), 1), K, a.num_reqs,
        num_search_iters(a.num_reqs), block_table.stride(0), block_table.shape[1],
        rows_per_block, compress_ratio, cp_world_size, cp_rank, cp_interleave,
        COMPACT=bool(compact), BLOCK_T=block_t, BLOCK_K=block_k,
        num_warps=8 if block_k * block_t >= 4096 else 4)
    return a.out, a.out_lens
