"""Triton kernels of ``topk_to_slots``: indexer top-k picks -> physical slots, once per C4A layer.

Shaped for its work (many tokens x K picks, one table load per pick): a 1-D grid of
``cdiv(T_out, BLOCK_T)`` programs, each converting ``BLOCK_T`` whole rows (``BLOCK_K =
next_pow2(K)`` columns, so ``compact`` packs a row in-program with a prefix sum; K = 512: one row
per program, see :func:`tile_config`). Loads of ``topk``
and stores of the slots are row-contiguous (coalesced); positions, picks, blocks and slots are
int32 (``bt * S + lc % S``: the callers check slots fit int32); ``rows_per_block``,
``compress_ratio`` and the DCP geometry are ``constexpr`` (fixed per channel and rank: divisions
become shifts), the counts are runtime. One body, :func:`dsv4_index.ops._device.store_topk_slots`, two
entry points:

* :func:`launch` (the public op): one binary search per token (``searched_tokens``), never per pick;
  the pick loads do not wait for it;
* :func:`launch_rows` (the pipeline): the table row and ``n_c`` of each token come precomputed by the
  step build, so a token needs no search: load picks and token info -> one table load -> store.

:func:`tile_config` holds the tile / warp choice (tune it on the target GPU).
"""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import row_in_table, searched_tokens, store_topk_slots, visible_rows

TILE_ELEMS = 512  # picks per program (BLOCK_T * BLOCK_K) when a row is shorter


def tile_config(K: int):
    """(BLOCK_T, BLOCK_K, num_warps) for rows of ``K`` picks: the whole row in one tile
    (``BLOCK_K = next_pow2(K)``) and ``BLOCK_T`` rows so that a tile holds ``TILE_ELEMS`` picks.

    NOTE: more, smaller programs win (BENCHMARKS.md "topk_to_slots per C4A layer", the tile sweep):
    K = 512 -> one token per program, 4 warps (4 picks per thread); K = 1024: 8 warps.
    """
    block_k = max(16, triton.next_power_of_2(max(K, 1)))
    block_t = max(1, min(64, TILE_ELEMS // block_k))
    num_warps = 4 if block_t * block_k <= 512 else 8
    return block_t, block_k, num_warps


@triton.jit
def _load_picks(topk_ptr,  # [topk_rows, >= K] int32 | int64, row stride topk_stride
                topk_stride, t, rd, K, BLOCK_K: tl.constexpr):
    """Picks of tokens ``t`` (``[BLOCK_T, BLOCK_K]``, ``-1`` where not read: ``rd`` false or ``k >= K``)."""
    k = tl.arange(0, BLOCK_K)[None, :]
    src = topk_ptr + t.to(tl.int64)[:, None] * topk_stride + k
    return tl.load(src, mask=rd[:, None] & (k < K), other=-1)


# NOTE: runtime counts are never specialised (a count of 1 would otherwise compile a new variant)
@triton.jit(do_not_specialize=["T_out", "topk_rows", "topk_stride", "K", "num_reqs", "n_iter",
                               "table_rows", "row_stride", "table_width", "out_stride"])
def _topk_to_slots_kernel(
        topk_ptr,      # [topk_rows, >= K] int32 | int64, row stride topk_stride
        qsl_ptr,       # [B + 1] int32
        seq_lens_ptr,  # [B] int32
        idx_ptr,       # [B] int32 table row per request (HAS_IDX)
        bt_ptr,        # [table_rows, cols] int32, row stride row_stride
        out_ptr,       # [T_out, K] int32, row stride out_stride
        lens_ptr,      # [T_out] int32
        T_out, topk_rows, topk_stride, K, num_reqs, n_iter, table_rows, row_stride, table_width,
        out_stride,
        S: tl.constexpr, R: tl.constexpr, CP_WORLD: tl.constexpr, CP_RANK: tl.constexpr,
        CP_INTERLEAVE: tl.constexpr, HAS_IDX: tl.constexpr, COMPACT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # NOTE: the picks do not depend on the request search: their loads are issued first (only rows
    # of live tokens, t < qsl[B], are read)
    rd = (t < T_out) & (t < topk_rows) & (t < tl.load(qsl_ptr + num_reqs))
    picks = _load_picks(topk_ptr, topk_stride, t, rd, K, BLOCK_K)
    b, row, valid, pos = searched_tokens(qsl_ptr, seq_lens_ptr, idx_ptr, t, T_out, num_reqs, n_iter,
                                         HAS_IDX)
    valid = row_in_table(row, valid, table_rows, HAS_IDX)
    n_c = visible_rows(pos, valid, R, 1, 0, 1)  # NOTE: every row: picks are global row ids
    store_topk_slots(picks, t, row, valid, n_c, bt_ptr, out_ptr, lens_ptr, row_stride, table_width,
                   out_stride, T_out, K, S, CP_WORLD, CP_RANK, CP_INTERLEAVE, COMPACT, BLOCK_K)


@triton.jit(do_not_specialize=["T_out", "topk_rows", "topk_stride", "K", "table_rows", "row_stride",
                               "table_width", "out_stride"])
def _topk_rows_kernel(
        topk_ptr,        # [topk_rows, >= K] int32 | int64, row stride topk_stride
        token_rows_ptr,  # [>= T_out] int32 table row of each token, -1 = padded
        token_nc_ptr,    # [>= T_out] int32 visible rows n_c of each token, 0 for padded
        bt_ptr,          # [table_rows, cols] int32, row stride row_stride
        out_ptr,         # [>= T_out, K] int32, row stride out_stride
        lens_ptr,        # [>= T_out] int32
        T_out, topk_rows, topk_stride, K, table_rows, row_stride, table_width, out_stride,
        S: tl.constexpr, CP_WORLD: tl.constexpr, CP_RANK: tl.constexpr, CP_INTERLEAVE: tl.constexpr,
        COMPACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_out = t < T_out
    # NOTE: picks and token info are independent loads; a padded token's picks are masked below
    picks = _load_picks(topk_ptr, topk_stride, t, in_out & (t < topk_rows), K, BLOCK_K)
    row = tl.load(token_rows_ptr + t, mask=in_out, other=-1)
    n_c = tl.load(token_nc_ptr + t, mask=in_out, other=0)
    valid = in_out & (row >= 0) & (row < table_rows)
    store_topk_slots(picks, t, row, valid, n_c, bt_ptr, out_ptr, lens_ptr, row_stride, table_width,
                   out_stride, T_out, K, S, CP_WORLD, CP_RANK, CP_INTERLEAVE, COMPACT, BLOCK_K)


def launch(topk: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
           block_table: torch.Tensor, idx_mapping, rows_per_block: int, compress_ratio: int,
           cp_world_size: int, cp_rank: int, cp_interleave: int, compact: bool, out: torch.Tensor,
           out_lens: torch.Tensor):
    """Public op: fill ``out`` (int32 ``[T_out, K]``) and ``out_lens`` (int32 ``[T_out]``) from
    checked arguments; one request search per token."""
    T_out, K = out.shape
    if T_out == 0:
        return out, out_lens
    num_reqs = seq_lens.numel()
    block_t, block_k, num_warps = tile_config(K)
    _topk_to_slots_kernel[(triton.cdiv(T_out, block_t),)](
        topk, query_start_loc, seq_lens, idx_mapping if idx_mapping is not None else seq_lens,
        block_table, out, out_lens,
        T_out, topk.shape[0], max(topk.stride(0), 1), K, num_reqs, num_reqs.bit_length(),
        block_table.shape[0], block_table.stride(0), block_table.shape[1], max(out.stride(0), 1),
        S=rows_per_block, R=compress_ratio, CP_WORLD=cp_world_size, CP_RANK=cp_rank,
        CP_INTERLEAVE=cp_interleave, HAS_IDX=idx_mapping is not None, COMPACT=bool(compact),
        BLOCK_T=block_t, BLOCK_K=block_k, num_warps=num_warps)
    return out, out_lens


def launch_rows(topk: torch.Tensor, token_rows: torch.Tensor, token_nc: torch.Tensor,
                block_table: torch.Tensor, rows_per_block: int, compress_ratio: int, table_width: int,
                cp_world_size: int, cp_rank: int, cp_interleave: int, compact: bool,
                out: torch.Tensor, out_lens: torch.Tensor, T_out: int, tile=None):
    """Pipeline entry: convert rows ``[0, T_out)`` with no request search and no host check.

    Parameters
    ----------
    topk : int32 | int64 ``[rows, K]`` (unit column stride); rows ``>= T_out`` are not read.
    token_rows : int32 ``[>= T_out]``
        Block-table row of each token, ``-1`` for padded tokens (outside ``[0, rows)``: no slot).
    token_nc : int32 ``[>= T_out]``
        Visible compressed rows ``n_c = (pos + 1) // R`` of each token (every row, not the DCP
        owned count: picks are global row ids), 0 for padded tokens.
    block_table : int32 ``[rows, >= table_width]`` (unit column stride)
    rows_per_block, compress_ratio : int
        ``S`` and ``R`` of the channel (``R`` is already folded into ``token_nc``).
    table_width : int
        Logical width of a table row (blocks at or past it give ``-1``).
    cp_world_size, cp_rank, cp_interleave : int
    compact : bool
    out : int32 ``[>= T_out, K]`` (row stride free, unit column stride); out_lens : int32 ``[>= T_out]``
    T_out : int
        Rows written (host count, e.g. the padded token count); rows past it are left alone.
    tile : (rows per program, warps), optional — overrides :func:`tile_config` (benchmark sweeps).

    Returns ``(out, out_lens)``; the caller guarantees what the public op's value checks would:
    slots of every reachable block fit int32.
    """
    K = out.shape[1]
    if T_out == 0:
        return out, out_lens
    block_t, block_k, num_warps = tile_config(K)
    if tile is not None:
        block_t, num_warps = tile
    _topk_rows_kernel[(triton.cdiv(T_out, block_t),)](
        topk, token_rows, token_nc, block_table, out, out_lens,
        T_out, topk.shape[0], max(topk.stride(0), 1), K, block_table.shape[0], block_table.stride(0),
        table_width, max(out.stride(0), 1),
        S=rows_per_block, CP_WORLD=cp_world_size, CP_RANK=cp_rank, CP_INTERLEAVE=cp_interleave,
        COMPACT=bool(compact), BLOCK_T=block_t, BLOCK_K=block_k, num_warps=num_warps)
    return out, out_lens
