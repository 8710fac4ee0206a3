"""``compressed_slot_mapping``: Triton kernel + public wrapper.

Reference: :mod:`dsv4_index.reference.compressed_slot_mapping`. The compact form is one launch:
every program sums the rows completed by the requests before each of its tokens (a bounded loop
over request tiles), program 0 writes ``cu``, and each program writes ``-1`` past the last row
in its own range of output rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._common import use_triton
from ..reference.compressed_slot_mapping import _check_args, _compact, _compressed_slot_mapping
from .token_to_req import find_request, search_iters

BLOCK_T = 128
BLOCK_B = 64


@triton.jit
def _rows_this_step(qsl_ptr, seq_lens_ptr, j, mask, ratio):
    """(first completed row, count) of requests ``j`` this step; 0 where not ``mask``.

    NOTE: the same clamping as the reference (negatives from garbage inputs count as 0).
    """
    start = tl.load(qsl_ptr + j, mask=mask, other=0)
    end = tl.load(qsl_ptr + j + 1, mask=mask, other=0)
    seq = tl.load(seq_lens_ptr + j, mask=mask, other=0)
    first = tl.maximum(seq - (end - start), 0) // ratio
    n = tl.maximum(tl.maximum(seq, 0) // ratio - first, 0)
    return first, tl.where(mask, n, 0)


@triton.jit(do_not_specialize=["B", "n_iters", "T_out", "n_rows", "cu_len", "bt_stride",
                               "bt_width", "rows_per_block", "ratio", "cp_world", "cp_rank",
                               "cp_interleave"])
def _compressed_slot_mapping_kernel(
        qsl_ptr,  # [B + 1] int32
        seq_lens_ptr,  # [B] int32
        bt_ptr,  # [>= B, bt_width] int32, row stride bt_stride
        out_ptr,  # [T_out] int64, or [n_rows] int64 when COMPACT
        cu_ptr,  # [cu_len >= B + 1] int32 (COMPACT only)
        B, n_iters, T_out, n_rows, cu_len, bt_stride, bt_width, rows_per_block, ratio,
        cp_world, cp_rank, cp_interleave,
        COMPACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    b = find_request(qsl_ptr, t, B, n_iters)
    live = (t < T_out) & (t < tl.load(qsl_ptr + B))  # NOTE: validity from the device qsl[B]
    seq = tl.load(seq_lens_ptr + b, mask=live, other=0)
    end = tl.load(qsl_ptr + b + 1, mask=live, other=0)
    pos = seq - end + t
    done = live & (pos >= 0) & ((pos + 1) % ratio == 0)
    c = pos // ratio
    ok = done & ((c // cp_interleave) % cp_world == cp_rank)
    lc = (c // (cp_interleave * cp_world)) * cp_interleave + c % cp_interleave
    blk = lc // rows_per_block
    ok = ok & (blk >= 0) & (blk < bt_width)  # NOTE: every table read is bounded by the width
    bid = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + blk, mask=ok, other=0)
    slot = tl.where(ok, bid.to(tl.int64) * rows_per_block + lc % rows_per_block, -1)
    if not COMPACT:
        tl.store(out_ptr + t, slot, mask=t < T_out)
    else:
        # rows completed by requests before b (per token) and in the whole batch
        before = tl.zeros([BLOCK_T], dtype=tl.int32)
        total = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), axis=0)
        for j0 in range(0, B, BLOCK_B):
            j = j0 + tl.arange(0, BLOCK_B)
            n = _rows_this_step(qsl_ptr, seq_lens_ptr, j, j < B, ratio)[1]
            before += tl.sum(tl.where(j[None, :] < b[:, None], n[None, :], 0), axis=1)
            total += tl.sum(n, axis=0)
        first = _rows_this_step(qsl_ptr, seq_lens_ptr, b, live, ratio)[0]
        row = before + c - first
        tl.store(out_ptr + row, slot, mask=done & (row >= 0) & (row < n_rows))
        # NOTE: rows >= total are written by the program owning that range (no overlap with above)
        r = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_ptr + r, tl.full([BLOCK_T], -1, tl.int64), mask=(r >= total) & (r < n_rows))
        if pid == 0:
            carry = total * 0
            tl.store(cu_ptr, carry)
            for j0 in range(0, B, BLOCK_B):
                j = j0 + tl.arange(0, BLOCK_B)
                n = _rows_this_step(qsl_ptr, seq_lens_ptr, j, j < B, ratio)[1]
                tl.store(cu_ptr + 1 + j, tl.cumsum(n, axis=0) + carry, mask=j < B)
                carry += tl.sum(n, axis=0)
            for k0 in range(B + 1, cu_len, BLOCK_B):
                k = k0 + tl.arange(0, BLOCK_B)
                tl.store(cu_ptr + k, tl.zeros([BLOCK_B], dtype=tl.int32) + total, mask=k < cu_len)


def _launch(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
            cp_world_size, cp_rank, cp_interleave, T, out, out_cu):
    B = seq_lens.numel()
    compact = out_cu is not None
    n_rows = out.shape[0]
    grid = triton.cdiv(max(T, n_rows if compact else 0, 1 if compact else 0), BLOCK_T)
    if grid:
        _compressed_slot_mapping_kernel[(grid,)](
            query_start_loc, seq_lens, block_table, out, out_cu if compact else out,
            B, search_iters(B), T, n_rows, out_cu.shape[0] if compact else 0,
            block_table.stride(0), block_table.shape[1], rows_per_block, compress_ratio,
            cp_world_size, cp_rank, cp_interleave,
            COMPACT=compact, BLOCK_T=BLOCK_T, BLOCK_B=BLOCK_B)
    return (out, out_cu) if compact else out


def compressed_slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, rows_per_block: int, compress_ratio: int, *,
                            cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                            compact: bool = False, num_tokens: Optional[int] = None, out=None,
                            out_cu=None, validate: bool = False, backend=None):
    """Cache slot of the compressed row each token completes.

    Parameters
    ----------
    query_start_loc : int32 [B + 1]
    seq_lens : int32 [B]
    block_table : int32 [>= B, table_width]
    rows_per_block : int
        ``S = block_size // R`` compressed rows per block.
    compress_ratio : int
        ``R``: the token at ``pos`` completes row ``c = pos // R`` iff ``(pos + 1) % R == 0``.
    cp_world_size, cp_rank, cp_interleave : int
        DCP over compressed rows: rows owned by another rank get ``-1``.
    compact : bool
        List only the rows completed this step, request by request, with offsets ``cu``.
    num_tokens : int, optional
        Host token count; None reads ``qsl[-1]`` (a host sync on CUDA; always for ``compact``).
    out : int64, optional
        ``[>= num_tokens]`` (token-aligned, written in full) or ``[>= num_tokens // R + B]`` (compact).
    out_cu : int32 [>= B + 1], optional
        Compact offsets; entries past ``B`` repeat the total.
    validate : bool
        Run the value checks on CUDA inputs too (they always run on CPU inputs).
    backend : {None, "triton", "reference"}

    Returns
    -------
    int64 [T_out] with ``bt[lc // S] * S + lc % S`` for completing tokens, ``-1`` elsewhere; or with
    ``compact=True`` (int64 [T // R + B] or [len(out)], ``-1`` past the last row; int32 cu [B + 1]).
    Under DCP a compact row owned elsewhere is listed as ``-1`` (cu is rank independent).
    """
    out, out_cu, T = _check_args(query_start_loc, seq_lens, block_table, rows_per_block,
                                 compress_ratio, cp_world_size, cp_rank, cp_interleave, compact,
                                 num_tokens, out, out_cu, validate)
    if use_triton(query_start_loc.device, backend):
        return _launch(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                       cp_world_size, cp_rank, cp_interleave, T, out, out_cu)
    slots, req, c, done = _compressed_slot_mapping(query_start_loc, seq_lens, block_table,
                                                   rows_per_block, compress_ratio, cp_world_size,
                                                   cp_rank, cp_interleave, T)
    if not compact:
        return out.copy_(slots)
    rows, cu = _compact(query_start_loc, seq_lens, slots, req, c, done, compress_ratio,
                        out.shape[0], out_cu.shape[0])
    out.copy_(rows)
    out_cu.copy_(cu)
    return out, out_cu
