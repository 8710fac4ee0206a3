"""Reference math of ``window_indices`` (docs/DESIGN.md §4 "Sliding-window indices", bounded replay, DCP,
ring and circular tables): plain PyTorch, the spec."""

from __future__ import annotations

import torch

from ..._common import cp_owned_count, no_block, token_positions, token_table_rows


def window_range(query_start_loc, seq_lens, num_rows: int, window: int, replay_start,
                 cp_world_size: int, cp_rank: int, cp_interleave: int):
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


def in_step_entries(query_start_loc, req, pos, lp, listed):
    """Circular groups (docs/DESIGN.md §4 "circular group"): which window entries lie inside the request's
    chunk of this step, and the step's token row holding each, ``query_start + (lp - chunk_start)``.

    ``req``, ``pos`` ``[T]`` (the token); ``lp`` ``[T, W]`` (entry positions); ``listed`` ``[T, W]``.
    Returns (bool ``[T, W]``, int64 ``[T, W]`` token rows). The token's own row is ``t``, so the row of
    position ``lp`` is ``t - (pos - lp)``; it is in the step iff that row is ``>= query_start[req]``.
    """
    t = torch.arange(pos.numel(), device=pos.device)[:, None]
    row = t - pos[:, None] + lp
    return listed & (row >= query_start_loc.long()[req][:, None]), row


def encode_in_step(rows: torch.Tensor) -> torch.Tensor:
    """The one encoding of in-step window entries: token row ``r`` -> ``-2 - r`` (``-1`` stays padding,
    ``>= 0`` stays a ring slot); decode with ``-2 - x``."""
    return -2 - rows


def window_indices(query_start_loc, seq_lens, block_table, block_size: int, window: int,
                   rows: torch.Tensor, ring_width: int, replay_start, cp_world_size: int,
                   cp_rank: int, cp_interleave: int, num_rows: int, width: int, circular: bool = False):
    """(int32 ``[num_rows, width]``, int32 ``[num_rows]``): entry ``j < count`` of a token is the
    slot of local position ``lp = first + j``, ``bt[rows[req]][col(lp // block_size)] * block_size +
    lp % block_size`` (``col(i) = i % ring_width`` for rings, ``i`` otherwise; a circular group is a
    ring of one column); ``-1`` after, and for entries past a plain table's width (not counted).
    ``circular``: entries inside the request's chunk of this step are in-step token rows
    (:func:`encode_in_step`), the others ring slots."""
    req, first, count = window_range(query_start_loc, seq_lens, num_rows, window, replay_start,
                                     cp_world_size, cp_rank, cp_interleave)
    row, live = token_table_rows(rows, req, count > 0, block_table.shape[0])
    j = torch.arange(width, device=first.device)[None, :]
    lp = first[:, None] + j
    blk = lp // block_size
    listed = live[:, None] & (j < count[:, None])
    if ring_width:
        col = blk % ring_width
    else:
        listed &= blk < block_table.shape[1]
        col = blk
    slots = torch.full(listed.shape, -1, dtype=torch.long, device=first.device)
    if bool(listed.any()):
        bid = block_table[row[:, None].expand(listed.shape)[listed], col[listed]].long()
        slots[listed] = no_block(bid * block_size + lp[listed] % block_size)
    if circular:
        _, pos, _ = token_positions(query_start_loc, seq_lens, num_rows)
        in_step, tok = in_step_entries(query_start_loc, req, pos, lp, listed)
        slots = torch.where(in_step, encode_in_step(tok), slots)
    return slots.to(torch.int32), listed.sum(1).to(torch.int32)
