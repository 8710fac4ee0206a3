"""``slot_mapping``: Triton kernel + public wrapper (reference: :mod:`dsv4_index.reference.slot_mapping`)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._common import use_triton
from ..reference.slot_mapping import _check_args, _slot_mapping
from .token_to_req import find_request, search_iters

BLOCK_T = 256


@triton.jit(do_not_specialize=["B", "n_iters", "T_out", "bt_stride", "bt_width", "block_size",
                               "cp_world", "cp_rank", "cp_interleave"])
def _slot_mapping_kernel(qsl_ptr,  # [B + 1] int32
                         seq_lens_ptr,  # [B] int32
                         bt_ptr,  # [>= B, bt_width] int32, row stride bt_stride
                         out_ptr,  # [T_out] int64
                         B, n_iters, T_out, bt_stride, bt_width, block_size,
                         cp_world, cp_rank, cp_interleave,
                         CIRCULAR: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = find_request(qsl_ptr, t, B, n_iters)
    live = (t < T_out) & (t < tl.load(qsl_ptr + B))  # NOTE: validity from the device qsl[B]
    seq = tl.load(seq_lens_ptr + b, mask=live, other=0)
    end = tl.load(qsl_ptr + b + 1, mask=live, other=0)
    pos = seq - end + t
    ok = live & (pos >= 0)
    if CIRCULAR:
        lp = pos % block_size
    else:
        ok = ok & ((pos // cp_interleave) % cp_world == cp_rank)
        lp = (pos // (cp_interleave * cp_world)) * cp_interleave + pos % cp_interleave
    blk = lp // block_size
    ok = ok & (blk >= 0) & (blk < bt_width)  # NOTE: every table read is bounded by the width
    bid = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + blk, mask=ok, other=0)
    slot = bid.to(tl.int64) * block_size + lp % block_size
    tl.store(out_ptr + t, tl.where(ok, slot, -1), mask=t < T_out)


def _launch(query_start_loc, seq_lens, block_table, block_size, cp_world_size, cp_rank,
            cp_interleave, circular_capacity, out):
    B, T_out = seq_lens.numel(), out.shape[0]
    if T_out:
        _slot_mapping_kernel[(triton.cdiv(T_out, BLOCK_T),)](
            query_start_loc, seq_lens, block_table, out, B, search_iters(B), T_out,
            block_table.stride(0), block_table.shape[1], block_size, cp_world_size, cp_rank,
            cp_interleave, CIRCULAR=circular_capacity is not None, BLOCK_T=BLOCK_T)
    return out


def slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 block_size: int, *, blocks_per_kv_block: int = 1, cp_world_size: int = 1,
                 cp_rank: int = 0, cp_interleave: int = 1, circular_capacity: Optional[int] = None,
                 num_tokens: Optional[int] = None, out=None, validate: bool = False,
                 backend=None) -> torch.Tensor:
    """Physical cache slot of every scheduled token of one kv-cache group.

    Parameters
    ----------
    query_start_loc : int32 [B + 1]
    seq_lens : int32 [B]
    block_table : int32 [>= B, table_width]
        Block ids of the group (kernel-block ids with hybrid blocks).
    block_size : int
        Tokens per (kernel) block; with ``blocks_per_kv_block = f`` the allocation block is
        ``block_size * f`` and ``cp_interleave`` must divide it.
    cp_world_size, cp_rank, cp_interleave : int
        DCP: tokens owned by other ranks get ``-1``; owned ones use their local position.
    circular_capacity : int, optional
        Ring of ``capacity`` rows per request (needs ``block_size == capacity``, no DCP):
        ``slot = bt[0] * capacity + pos % capacity``.
    num_tokens : int, optional
        Host token count (output length when ``out`` is None); None reads ``qsl[-1]`` (a host
        sync on CUDA).
    out : int64 [>= num_tokens], optional
        Written in full (``T_out = out.shape[0]``).
    validate : bool
        Run the value checks on CUDA inputs too (they always run on CPU inputs).
    backend : {None, "triton", "reference"}

    Returns
    -------
    int64 [T_out]: ``bt[lp // block_size] * block_size + lp % block_size``; ``-1`` for padded
    tokens, tokens owned by another rank, and blocks outside the table.
    """
    out = _check_args(query_start_loc, seq_lens, block_table, block_size, blocks_per_kv_block,
                      cp_world_size, cp_rank, cp_interleave, circular_capacity, num_tokens, out,
                      validate)
    if use_triton(query_start_loc.device, backend):
        return _launch(query_start_loc, seq_lens, block_table, block_size, cp_world_size, cp_rank,
                       cp_interleave, circular_capacity, out)
    out.copy_(_slot_mapping(query_start_loc, seq_lens, block_table, block_size, cp_world_size,
                            cp_rank, cp_interleave, circular_capacity, out.shape[0]))
    return out
