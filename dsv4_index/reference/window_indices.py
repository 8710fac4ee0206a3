"""Reference of ``window_indices`` (DESIGN §4 "Sliding-window indices", bounded replay, DCP)."""

from __future__ import annotations

from typing import Optional

import torch

from .._common import (check_batch, check_cp, check_positive_int,
                       check_tensor, cp_owned_count, needs_value_checks, prepare_out, table_slots,
                       token_positions)
from .slot_mapping import check_table_width
from .token_to_req import check_values, prepare_rows


def _window_range(query_start_loc, seq_lens, num_rows, window, replay_start, cp_world_size,
                  cp_rank, cp_interleave):
    """(req, first local position, count of listed entries), each int64 ``[num_rows]``.

    The window ``[max(pos - W + 1, floor, 0), pos]`` holds, on rank ``r``, the owned positions
    whose local positions are the consecutive ``[owned(start), owned(pos + 1))``.
    """
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_rows)
    start = (pos - window + 1).clamp(min=0)
    if replay_start is not None and replay_start.numel():
        start = torch.maximum(start, replay_start.long()[req])
    first = cp_owned_count(start, cp_world_size, cp_rank, cp_interleave)
    last = cp_owned_count((pos + 1).clamp(min=0), cp_world_size, cp_rank, cp_interleave)
    count = torch.where(valid, (last - first).clamp(min=0), 0)
    return req, first, count


def _check_args(query_start_loc, seq_lens, block_table, block_size, window, replay_start,
                cp_world_size, cp_rank, cp_interleave, num_tokens, out, out_lens, validate):
    """Shared by the reference and the Triton wrapper; returns ``(out, out_lens)``."""
    B, device = check_batch(query_start_loc, seq_lens, block_table)
    check_positive_int("block_size", block_size)
    check_positive_int("window", window)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    if replay_start is not None:
        check_tensor("replay_start", replay_start, dtypes=(torch.int32,), ndim=1, device=device)
        if replay_start.numel() != B:
            raise ValueError(f"replay_start has {replay_start.numel()} entries, expected B = {B}")
    out = prepare_rows("out", out, query_start_loc, num_tokens, torch.int32, cols=window)
    out_lens = prepare_out("out_lens", out_lens, shape=(out.shape[0],), min_rows=out.shape[0],
                           dtype=torch.int32, device=device)
    if needs_value_checks(device, validate):
        check_values(query_start_loc, seq_lens, num_tokens, out.shape[0])
        if replay_start is not None:
            rs = replay_start.long().cpu()
            qsl = query_start_loc.long().cpu()
            q = qsl[1:] - qsl[:-1]
            first_pos = seq_lens.long().cpu() - q
            bad = (rs < 0) | ((q > 0) & (rs > first_pos))
            if bool(bad.any()):
                b = int(torch.nonzero(bad)[0])
                raise ValueError(f"replay_start[{b}] = {int(rs[b])} must be in [0, {int(first_pos[b])}] "
                                 f"(the first scheduled position of request {b})")
        req, first, count = _window_range(query_start_loc, seq_lens, int(query_start_loc[-1]), window,
                                          replay_start, cp_world_size, cp_rank, cp_interleave)
        last_blk = (first + count - 1) // block_size
        check_table_width("block_table", block_table, req, last_blk, count > 0)
    return out, out_lens


def _window_indices(query_start_loc, seq_lens, block_table, block_size, window, replay_start,
                    cp_world_size, cp_rank, cp_interleave, num_rows, width):
    """(int32 ``[num_rows, width]``, int32 ``[num_rows]``); garbage-safe (no value checks)."""
    req, first, count = _window_range(query_start_loc, seq_lens, num_rows, window, replay_start,
                                      cp_world_size, cp_rank, cp_interleave)
    j = torch.arange(width, device=first.device)
    local = first[:, None] + j
    listed = (j < count[:, None]) & (local // block_size < block_table.shape[1])
    slots = table_slots(block_table, req[:, None], local, block_size, listed)
    return slots.to(torch.int32), listed.sum(1).to(torch.int32)


def window_indices(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   block_size: int, window: int, *, replay_start: Optional[torch.Tensor] = None,
                   cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                   num_tokens: Optional[int] = None, out=None, out_lens=None,
                   validate: bool = False, backend=None):
    """Reference of :func:`dsv4_index.window_indices`: same signature, arguments and result (the kernel must equal it).

    Plain PyTorch on any device; ``backend`` is accepted and ignored.
    """
    out, out_lens = _check_args(query_start_loc, seq_lens, block_table, block_size, window,
                                replay_start, cp_world_size, cp_rank, cp_interleave, num_tokens,
                                out, out_lens, validate)
    idx, lens = _window_indices(query_start_loc, seq_lens, block_table, block_size, window,
                                replay_start, cp_world_size, cp_rank, cp_interleave,
                                out.shape[0], out.shape[1])
    out.copy_(idx)
    out_lens[:out.shape[0]].copy_(lens)
    out_lens[out.shape[0]:] = 0
    return out, out_lens
