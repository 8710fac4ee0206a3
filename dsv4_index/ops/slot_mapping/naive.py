"""Reference math of ``slot_mapping`` (docs/DESIGN.md §4 "Slot of a raw position"): plain PyTorch, the spec."""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import cp_local, cp_owner, no_block, token_positions, token_table_rows


def local_positions(query_start_loc, seq_lens, num_rows: int, replay_end: Optional[torch.Tensor],
                    cp_world_size: int, cp_rank: int, cp_interleave: int):
    """(req, pos, local position, needs-a-slot mask), each ``[num_rows]`` int64 / bool.

    A token needs a slot when it is live, this rank owns its position, and it is not a replayed
    token of a prefix-cacheable group (``pos < replay_end[req]``).
    """
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_rows)
    need = valid & (pos >= 0)
    if replay_end is not None and replay_end.numel():
        need &= pos >= replay_end.long()[req]
    need &= cp_owner(pos, cp_world_size, cp_interleave) == cp_rank
    return req, pos, torch.where(need, cp_local(pos, cp_world_size, cp_interleave), -1), need


def tail_floor(seq_lens: torch.Tensor, capacity: int, replay_end: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write floor of a circular group's write plan (``tail_slot_mapping``), int32 ``[B]``: only the
    last ``capacity`` tokens of each request's chunk write, ``pos >= seq_len - capacity`` (combined
    with ``replay_end`` by max when given)."""
    floor = torch.sub(seq_lens, capacity, out=out)
    if replay_end is not None and replay_end.numel():
        torch.maximum(floor, replay_end[:floor.numel()], out=floor)
    return floor


def slot_mapping(query_start_loc, seq_lens, block_table, block_size: int, rows: torch.Tensor,
                 ring_width: int, replay_end, cp_world_size: int, cp_rank: int, cp_interleave: int,
                 num_rows: int) -> torch.Tensor:
    """int64 ``[num_rows]``: ``bt[rows[req]][col(lp // block_size)] * block_size + lp % block_size``,
    ``-1`` where no slot (a negative block id is no block); ``col(i) = i % ring_width`` for rings, ``i``
    otherwise."""
    req, _, lp, need = local_positions(query_start_loc, seq_lens, num_rows, replay_end, cp_world_size,
                                       cp_rank, cp_interleave)
    row, need = token_table_rows(rows, req, need, block_table.shape[0])
    blk = torch.where(need, lp // block_size, 0)
    if ring_width:
        col = blk % ring_width
    else:
        need = need & (blk < block_table.shape[1])
        col = blk
    out = torch.full((num_rows,), -1, dtype=torch.long, device=query_start_loc.device)
    if bool(need.any()):
        bid = block_table[row[need], col[need]].long()
        out[need] = no_block(bid * block_size + lp[need] % block_size)
    return out
