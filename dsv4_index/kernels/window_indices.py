"""``window_indices``: Triton kernel + public wrapper (reference: :mod:`dsv4_index.reference.window_indices`).

Each program handles a ``[BLOCK_T, BLOCK_W]`` tile (tokens x row entries) and loops over the row
width in ``BLOCK_W`` chunks. Entry ``j`` of token ``t`` is the local position ``owned(start) + j``
(the owned positions of a window are consecutive local positions; without DCP ``owned(n) = n``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._common import use_triton
from ..reference.window_indices import _check_args, _window_indices
from .token_to_req import find_request, owned_count, search_iters

TILE = 4096  # elements per program tile


@triton.jit(do_not_specialize=["B", "n_iters", "T_out", "bt_stride", "bt_width", "block_size",
                               "window", "width", "out_stride", "cp_world", "cp_rank",
                               "cp_interleave"])
def _window_indices_kernel(qsl_ptr,  # [B + 1] int32
                           seq_lens_ptr,  # [B] int32
                           bt_ptr,  # [>= B, bt_width] int32, row stride bt_stride
                           replay_ptr,  # [B] int32 (read only when HAS_REPLAY)
                           out_ptr,  # [T_out, width] int32, row stride out_stride
                           lens_ptr,  # [T_out] int32
                           B, n_iters, T_out, bt_stride, bt_width, block_size, window, width,
                           out_stride, cp_world, cp_rank, cp_interleave,
                           HAS_REPLAY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = find_request(qsl_ptr, t, B, n_iters)
    live = (t < T_out) & (t < tl.load(qsl_ptr + B))  # NOTE: validity from the device qsl[B]
    seq = tl.load(seq_lens_ptr + b, mask=live, other=0)
    end = tl.load(qsl_ptr + b + 1, mask=live, other=0)
    pos = seq - end + t
    start = tl.maximum(pos - window + 1, 0)
    if HAS_REPLAY:
        start = tl.maximum(start, tl.load(replay_ptr + b, mask=live, other=0))
    first = owned_count(start, cp_world, cp_rank, cp_interleave)
    count = owned_count(tl.maximum(pos + 1, 0), cp_world, cp_rank, cp_interleave) - first
    count = tl.where(live, tl.maximum(count, 0), 0)
    row_ptr = out_ptr + t.to(tl.int64)[:, None] * out_stride
    bt_row = bt_ptr + b.to(tl.int64)[:, None] * bt_stride
    lens = tl.zeros([BLOCK_T], dtype=tl.int32)
    for j0 in range(0, width, BLOCK_W):
        j = j0 + tl.arange(0, BLOCK_W)[None, :]
        lp = first[:, None] + j
        blk = lp // block_size
        ok = (j < count[:, None]) & (blk < bt_width)  # NOTE: lp >= 0; reads bounded by the width
        bid = tl.load(bt_row + blk, mask=ok, other=0)
        slot = (bid.to(tl.int64) * block_size + lp % block_size).to(tl.int32)
        tl.store(row_ptr + j, tl.where(ok, slot, -1), mask=(t < T_out)[:, None] & (j < width))
        lens += tl.sum(ok.to(tl.int32), axis=1)
    tl.store(lens_ptr + t, lens, mask=t < T_out)


def _launch(query_start_loc, seq_lens, block_table, block_size, window, replay_start,
            cp_world_size, cp_rank, cp_interleave, out, out_lens):
    B, (T_out, width) = seq_lens.numel(), out.shape
    if out_lens.shape[0] > T_out:
        out_lens[T_out:] = 0
    if T_out == 0:
        return out, out_lens
    block_w = min(triton.next_power_of_2(width), 256)
    block_t = max(1, min(64, TILE // block_w))
    _window_indices_kernel[(triton.cdiv(T_out, block_t),)](
        query_start_loc, seq_lens, block_table,
        replay_start if replay_start is not None else seq_lens, out, out_lens,
        B, search_iters(B), T_out, block_table.stride(0), block_table.shape[1], block_size,
        window, width, out.stride(0), cp_world_size, cp_rank, cp_interleave,
        HAS_REPLAY=replay_start is not None, BLOCK_T=block_t, BLOCK_W=block_w)
    return out, out_lens


def window_indices(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   block_size: int, window: int, *, replay_start: Optional[torch.Tensor] = None,
                   cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                   num_tokens: Optional[int] = None, out=None, out_lens=None,
                   validate: bool = False, backend=None):
    """Sliding-window slot list of every token (FlashMLA-style, ``-1`` padded).

    Parameters
    ----------
    query_start_loc : int32 [B + 1]
    seq_lens : int32 [B]
    block_table : int32 [>= B, table_width]
        Block ids of the sliding group.
    block_size : int
    window : int
        ``W``: positions ``[max(pos - W + 1, floor), pos]``, oldest first, the token itself last.
    replay_start : int32 [B], optional
        Per-request ``floor`` of bounded replay (default 0); must be ``<=`` every scheduled position.
    cp_world_size, cp_rank, cp_interleave : int
        DCP: only the owned positions of the window, ascending, local slots, packed to the front.
    num_tokens : int, optional
        Host token count; None reads ``qsl[-1]`` (a host sync on CUDA) when ``out`` is None.
    out : int32 [>= num_tokens, >= window], optional
        Row width is ``out.shape[1]``; written in full.
    out_lens : int32 [>= T_out], optional
        Entries past ``T_out`` are set to 0.
    validate : bool
        Run the value checks on CUDA inputs too (they always run on CPU inputs).
    backend : {None, "triton", "reference"}

    Returns
    -------
    (int32 [T_out, width] slots then ``-1``, int32 [T_out] count of listed slots; ``0`` for padded
    tokens). An entry whose block lies outside the table is ``-1`` and not counted.
    """
    out, out_lens = _check_args(query_start_loc, seq_lens, block_table, block_size, window,
                                replay_start, cp_world_size, cp_rank, cp_interleave, num_tokens,
                                out, out_lens, validate)
    if use_triton(query_start_loc.device, backend):
        return _launch(query_start_loc, seq_lens, block_table, block_size, window, replay_start,
                       cp_world_size, cp_rank, cp_interleave, out, out_lens)
    idx, lens = _window_indices(query_start_loc, seq_lens, block_table, block_size, window,
                                replay_start, cp_world_size, cp_rank, cp_interleave,
                                out.shape[0], out.shape[1])
    out.copy_(idx)
    out_lens[:out.shape[0]].copy_(lens)
    out_lens[out.shape[0]:] = 0
    return out, out_lens
