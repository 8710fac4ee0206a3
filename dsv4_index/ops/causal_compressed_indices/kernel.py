"""Triton kernel of ``causal_compressed_indices``: a 2-D grid of (``BLOCK_T`` tokens) x
(``BLOCK_W`` row entries); the body is :func:`dsv4_index.ops._device.visible_rows` /
:func:`~dsv4_index.ops._device.causal_row`."""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import causal_row, row_in_table, searched_tokens, visible_rows

TILE = 4096  # elements per program tile


def tile_shape(width: int):
    """(BLOCK_T, BLOCK_W) of a row width."""
    block_w = min(triton.next_power_of_2(max(width, 1)), 256)
    return max(1, min(128, TILE // block_w)), block_w


@triton.jit(do_not_specialize=["T_out", "num_reqs", "n_iter", "table_rows", "row_stride", "out_stride",
                               "width", "max_len", "rows_per_block", "compress_ratio", "cp_world",
                               "cp_rank", "cp_interleave"])
def _causal_compressed_indices_kernel(
        qsl_ptr,       # [B + 1] int32
        seq_lens_ptr,  # [B] int32
        idx_ptr,       # [B] int32 table row per request (HAS_IDX)
        bt_ptr,        # [table_rows, cols] int32, row stride row_stride
        out_ptr,       # [T_out, width] int32, row stride out_stride
        lens_ptr,      # [T_out] int32
        T_out, num_reqs, n_iter, table_rows, row_stride, out_stride, width, max_len, rows_per_block,
        compress_ratio, cp_world, cp_rank, cp_interleave,
        HAS_IDX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_out = t < T_out
    b, row, valid, pos = searched_tokens(qsl_ptr, seq_lens_ptr, idx_ptr, t, T_out, num_reqs, n_iter,
                                         HAS_IDX)
    valid = row_in_table(row, valid, table_rows, HAS_IDX)
    # NOTE: max_len = min(width, cols * S): a clamp for memory safety on unchecked inputs (the
    # value checks reject rows wider than either)
    n = tl.minimum(visible_rows(pos, valid, compress_ratio, cp_world, cp_rank, cp_interleave), max_len)
    # NOTE: tl.where, not `in_out & (scalar)`: Triton 3.9's interpreter makes that int32 ("mask has unsupported dtype")
    tl.store(lens_ptr + t, n, mask=tl.where(tl.program_id(1) == 0, in_out, False))
    j = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    zero = tl.zeros_like(t)
    slot = causal_row(bt_ptr, row, n, j, rows_per_block, row_stride, bt_ptr, zero, zero, zero, False)
    dst = out_ptr + t.to(tl.int64)[:, None] * out_stride + j
    tl.store(dst, slot, mask=in_out[:, None] & (j < width))


def launch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
           idx_mapping, rows_per_block: int, compress_ratio: int, cp_world_size: int, cp_rank: int,
           cp_interleave: int, out: torch.Tensor, out_lens: torch.Tensor):
    """Fill ``out`` (int32 ``[T_out, width]``) and ``out_lens`` (int32 ``[T_out]``) from checked
    arguments."""
    num_reqs, (T_out, width) = seq_lens.numel(), out.shape
    if T_out == 0:
        return out, out_lens
    block_t, block_w = tile_shape(width)
    max_len = min(width, block_table.shape[1] * rows_per_block, 2 ** 31 - 1)
    grid = (triton.cdiv(T_out, block_t), triton.cdiv(width, block_w))
    _causal_compressed_indices_kernel[grid](
        query_start_loc, seq_lens, idx_mapping if idx_mapping is not None else seq_lens, block_table,
        out, out_lens, T_out, num_reqs, num_reqs.bit_length(), block_table.shape[0],
        block_table.stride(0), out.stride(0), width, max_len, rows_per_block, compress_ratio,
        cp_world_size, cp_rank, cp_interleave,
        HAS_IDX=idx_mapping is not None, BLOCK_T=block_t, BLOCK_W=block_w, num_warps=4)
    return out, out_lens
