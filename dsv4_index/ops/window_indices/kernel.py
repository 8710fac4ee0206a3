"""Triton kernel of ``window_indices``: each program handles ``BLOCK_T`` tokens and loops over the
row width in ``BLOCK_W`` chunks; the body is :func:`dsv4_index.ops._device.window_len` /
:func:`~dsv4_index.ops._device.window_row` / :func:`~dsv4_index.ops._device.window_count`."""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import circular_split, row_in_table, searched_tokens, window_count, window_len, window_row

TILE = 4096  # elements per program tile


def tile_shape(width: int):
    """(BLOCK_T, BLOCK_W) of a row width."""
    block_w = min(triton.next_power_of_2(max(width, 1)), 256)
    return max(1, min(64, TILE // block_w)), block_w


@triton.jit(do_not_specialize=["T_out", "num_reqs", "n_iter", "table_rows", "row_stride",
                               "table_width", "ring_cols", "block_size", "window", "width",
                               "out_stride", "cp_world", "cp_rank", "cp_interleave"])
def _window_indices_kernel(qsl_ptr,       # [B + 1] int32
                           seq_lens_ptr,  # [B] int32
                           idx_ptr,       # [B] int32 table row per request (HAS_IDX)
                           bt_ptr,        # [table_rows, cols] int32, row stride row_stride
                           replay_ptr,    # [B] int32 window floor per request (HAS_REPLAY)
                           out_ptr,       # [T_out, width] int32, row stride out_stride
                           lens_ptr,      # [T_out] int32
                           T_out, num_reqs, n_iter, table_rows, row_stride, table_width, ring_cols,
                           block_size, window, width, out_stride, cp_world, cp_rank, cp_interleave,
                           HAS_IDX: tl.constexpr, HAS_REPLAY: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_W: tl.constexpr, CIRCULAR: tl.constexpr = False):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b, row, valid, pos = searched_tokens(qsl_ptr, seq_lens_ptr, idx_ptr, t, T_out, num_reqs, n_iter,
                                         HAS_IDX)
    valid = row_in_table(row, valid, table_rows, HAS_IDX)
    floor = tl.zeros_like(pos)
    if HAS_REPLAY:
        floor = tl.load(replay_ptr + b, mask=valid, other=0)
    first, n = window_len(pos, valid, floor, window, cp_world, cp_rank, cp_interleave)
    zero = tl.zeros_like(t)
    if CIRCULAR:
        q_start = tl.load(qsl_ptr + b, mask=valid, other=0)
    dst = out_ptr + t.to(tl.int64)[:, None] * out_stride
    for j0 in range(0, width, BLOCK_W):
        j = j0 + tl.arange(0, BLOCK_W)[None, :]
        slot = window_row(bt_ptr, row, first, n, j, block_size, table_width, ring_cols, row_stride,
                          bt_ptr, zero, zero, zero, False)
        if CIRCULAR:
            slot = circular_split(slot, t, pos, first, n, j, q_start)
        tl.store(dst + j, slot, mask=(t < T_out)[:, None] & (j < width))
    tl.store(lens_ptr + t, window_count(first, n, block_size, table_width), mask=t < T_out)


def launch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
           idx_mapping, replay_start, block_size: int, window: int, table_width: int, ring_cols: int,
           cp_world_size: int, cp_rank: int, cp_interleave: int, out: torch.Tensor,
           out_lens: torch.Tensor, circular: bool = False):
    """Fill ``out`` (int32 ``[T_out, width]``) and ``out_lens`` (int32 ``[>= T_out]``, 0 past
    ``T_out``) from checked arguments."""
    num_reqs, (T_out, width) = seq_lens.numel(), out.shape
    if out_lens.shape[0] > T_out:
        out_lens[T_out:] = 0
    if T_out == 0:
        return out, out_lens
    block_t, block_w = tile_shape(width)
    _window_indices_kernel[(triton.cdiv(T_out, block_t),)](
        query_start_loc, seq_lens, idx_mapping if idx_mapping is not None else seq_lens, block_table,
        replay_start if replay_start is not None else seq_lens, out, out_lens,
        T_out, num_reqs, num_reqs.bit_length(), block_table.shape[0], block_table.stride(0),
        table_width, ring_cols, block_size, window, width, out.stride(0), cp_world_size, cp_rank,
        cp_interleave, HAS_IDX=idx_mapping is not None, HAS_REPLAY=replay_start is not None,
        BLOCK_T=block_t, BLOCK_W=block_w, CIRCULAR=circular)
    return out, out_lens
