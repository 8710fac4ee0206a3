"""Triton kernel of ``slot_mapping``: one program per ``BLOCK_T`` tokens, the body is
:func:`dsv4_index.ops._device.raw_slot`."""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import raw_slot, row_in_table, searched_tokens

BLOCK_T = 256


@triton.jit(do_not_specialize=["T_out", "num_reqs", "n_iter", "table_rows", "row_stride", "table_width",
                               "ring_cols", "block_size", "cp_world", "cp_rank", "cp_interleave"])
def _slot_mapping_kernel(qsl_ptr,         # [B + 1] int32
                         seq_lens_ptr,    # [B] int32
                         idx_ptr,         # [B] int32 table row per request (HAS_IDX)
                         bt_ptr,          # [table_rows, cols] int32, row stride row_stride
                         replay_end_ptr,  # [B] int32 write floor per request (HAS_FLOOR)
                         out_ptr,         # [T_out] int64
                         T_out, num_reqs, n_iter, table_rows, row_stride, table_width, ring_cols,
                         block_size, cp_world, cp_rank, cp_interleave,
                         HAS_IDX: tl.constexpr, HAS_FLOOR: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b, row, valid, pos = searched_tokens(qsl_ptr, seq_lens_ptr, idx_ptr, t, T_out, num_reqs, n_iter,
                                         HAS_IDX)
    valid = row_in_table(row, valid, table_rows, HAS_IDX)
    floor = tl.zeros_like(pos)
    if HAS_FLOOR:
        floor = tl.load(replay_end_ptr + b, mask=valid, other=0)
    slot = raw_slot(bt_ptr, row, pos, valid, floor, block_size, table_width, ring_cols, row_stride,
                    cp_world, cp_rank, cp_interleave, bt_ptr, 0, 0, 0, False)
    tl.store(out_ptr + t, slot, mask=t < T_out)


def launch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
           idx_mapping, replay_end, block_size: int, table_width: int, ring_cols: int,
           cp_world_size: int, cp_rank: int, cp_interleave: int, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (int64 ``[T_out]``) from checked arguments."""
    num_reqs, T_out = seq_lens.numel(), out.shape[0]
    if T_out:
        _slot_mapping_kernel[(triton.cdiv(T_out, BLOCK_T),)](
            query_start_loc, seq_lens, idx_mapping if idx_mapping is not None else seq_lens,
            block_table, replay_end if replay_end is not None else seq_lens, out,
            T_out, num_reqs, num_reqs.bit_length(), block_table.shape[0], block_table.stride(0),
            table_width, ring_cols, block_size, cp_world_size, cp_rank, cp_interleave,
            HAS_IDX=idx_mapping is not None, HAS_FLOOR=replay_end is not None, BLOCK_T=BLOCK_T)
    return out
