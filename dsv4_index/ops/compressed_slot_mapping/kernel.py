"""Triton kernel of ``compressed_slot_mapping``; the body is
:func:`dsv4_index.ops._device.compressed_slot`.

The compact form is one launch: every program sums the rows completed by the requests before each
of its tokens (a loop over request tiles, :func:`dsv4_index.ops._device.completed_rows`), program
0 writes ``cu``, and each program writes ``-1`` past the last row in its own range of output rows.
"""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import completed_rows, compressed_slot, row_in_table, searched_tokens

BLOCK_T = 128
BLOCK_B = 64


@triton.jit(do_not_specialize=["T_out", "num_reqs", "n_iter", "n_rows", "cu_len", "table_rows",
                               "row_stride", "table_width", "rows_per_block", "compress_ratio",
                               "cp_world", "cp_rank", "cp_interleave"])
def _compressed_slot_mapping_kernel(
        qsl_ptr,         # [B + 1] int32
        seq_lens_ptr,    # [B] int32
        idx_ptr,         # [B] int32 table row per request (HAS_IDX)
        bt_ptr,          # [table_rows, cols] int32, row stride row_stride
        replay_end_ptr,  # [B] int32 write floor per request (HAS_FLOOR)
        out_ptr,         # [T_out] int64, or [n_rows] int64 when COMPACT
        cu_ptr,          # [cu_len >= B + 1] int32 (COMPACT only)
        T_out, num_reqs, n_iter, n_rows, cu_len, table_rows, row_stride, table_width,
        rows_per_block, compress_ratio, cp_world, cp_rank, cp_interleave,
        HAS_IDX: tl.constexpr, HAS_FLOOR: tl.constexpr, COMPACT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    b, row, live, pos = searched_tokens(qsl_ptr, seq_lens_ptr, idx_ptr, t, T_out, num_reqs, n_iter,
                                        HAS_IDX)
    valid = row_in_table(row, live, table_rows, HAS_IDX)
    floor = tl.zeros_like(pos)
    if HAS_FLOOR:
        floor = tl.load(replay_end_ptr + b, mask=valid, other=0)
    slot = compressed_slot(bt_ptr, row, pos, valid, floor, compress_ratio, rows_per_block,
                           table_width, row_stride, cp_world, cp_rank, cp_interleave,
                           bt_ptr, 0, 0, 0, False)
    if not COMPACT:
        tl.store(out_ptr + t, slot, mask=t < T_out)
    else:
        # NOTE: every completed row is listed (its slot -1 when owned elsewhere or replayed), so
        # the placement depends on the batch only
        done = live & (pos >= 0) & ((pos + 1) % compress_ratio == 0)
        before = tl.zeros([BLOCK_T], dtype=tl.int32)
        total = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), axis=0)
        for j0 in range(0, num_reqs, BLOCK_B):
            j = j0 + tl.arange(0, BLOCK_B)
            n = completed_rows(qsl_ptr, seq_lens_ptr, j, j < num_reqs, compress_ratio)[1]
            before += tl.sum(tl.where(j[None, :] < b[:, None], n[None, :], 0), axis=1)
            total += tl.sum(n, axis=0)
        first = completed_rows(qsl_ptr, seq_lens_ptr, b, live, compress_ratio)[0]
        dst = before + pos // compress_ratio - first
        tl.store(out_ptr + dst, slot, mask=done & (dst >= 0) & (dst < n_rows))
        # NOTE: rows >= total are written by the program owning that range (disjoint from above)
        r = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_ptr + r, tl.full([BLOCK_T], -1, tl.int64), mask=(r >= total) & (r < n_rows))
        if pid == 0:
            carry = total * 0
            tl.store(cu_ptr, carry)
            for j0 in range(0, num_reqs, BLOCK_B):
                j = j0 + tl.arange(0, BLOCK_B)
                n = completed_rows(qsl_ptr, seq_lens_ptr, j, j < num_reqs, compress_ratio)[1]
                tl.store(cu_ptr + 1 + j, tl.cumsum(n, axis=0) + carry, mask=j < num_reqs)
                carry += tl.sum(n, axis=0)
            for k0 in range(num_reqs + 1, cu_len, BLOCK_B):
                k = k0 + tl.arange(0, BLOCK_B)
                tl.store(cu_ptr + k, tl.zeros([BLOCK_B], dtype=tl.int32) + total, mask=k < cu_len)


def launch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
           idx_mapping, replay_end, rows_per_block: int, compress_ratio: int, cp_world_size: int,
           cp_rank: int, cp_interleave: int, num_rows: int, out: torch.Tensor, out_cu=None):
    """Fill ``out`` (int64 ``[num_rows]`` token-aligned, or ``[n_rows]`` compact with ``out_cu``
    int32 ``[>= B + 1]``) from checked arguments; ``num_rows`` token slots are scanned."""
    num_reqs = seq_lens.numel()
    compact = out_cu is not None
    n_rows = out.shape[0]
    grid = triton.cdiv(max(num_rows, n_rows if compact else 0, 1 if compact else 0), BLOCK_T)
    if grid:
        _compressed_slot_mapping_kernel[(grid,)](
            query_start_loc, seq_lens, idx_mapping if idx_mapping is not None else seq_lens,
            block_table, replay_end if replay_end is not None else seq_lens, out,
            out_cu if compact else out,
            num_rows, num_reqs, num_reqs.bit_length(), n_rows, out_cu.shape[0] if compact else 0,
            block_table.shape[0], block_table.stride(0), block_table.shape[1], rows_per_block,
            compress_ratio, cp_world_size, cp_rank, cp_interleave,
            HAS_IDX=idx_mapping is not None, HAS_FLOOR=replay_end is not None, COMPACT=compact,
            BLOCK_T=BLOCK_T, BLOCK_B=BLOCK_B)
    return (out, out_cu) if compact else out
