"""Reference math of ``compressed_slot_mapping`` (docs/DESIGN.md §4 "Compressed slot mapping", bounded
replay, DCP, compact form): plain PyTorch, the spec."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..._common import cp_local, cp_owner, table_slots, token_positions, token_table_rows


def completed_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, compress_ratio: int):
    """(first row, count) of the compressed rows each request completes this step, int64 ``[B]``.

    Rows ``c`` with ``ctx <= c * R + R - 1 < seq_len`` (``ctx = seq_len - q_len``): from
    ``ctx // R``, ``seq_len // R - ctx // R`` of them. NOTE: negatives (garbage inputs) clamp to 0.
    """
    qsl = query_start_loc.long()
    sl = seq_lens.long()
    ctx = (sl - (qsl[1:] - qsl[:-1])).clamp(min=0)
    first = ctx // compress_ratio
    return first, (sl.clamp(min=0) // compress_ratio - first).clamp(min=0)


def completing_tokens(query_start_loc, seq_lens, num_rows: int, compress_ratio: int,
                      replay_end: Optional[torch.Tensor], cp_world_size: int, cp_rank: int,
                      cp_interleave: int):
    """(req, row c, done, local row, needs-a-slot), each ``[num_rows]`` over the token slots.

    ``done``: the token completes row ``c = pos // R`` (``(pos + 1) % R == 0``). It needs a slot
    when this rank owns ``c`` and the token is not replayed (``pos >= replay_end[req]``).
    """
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_rows)
    done = valid & (pos >= 0) & ((pos + 1) % compress_ratio == 0)
    c = torch.where(done, pos // compress_ratio, -1)
    need = done & (cp_owner(c, cp_world_size, cp_interleave) == cp_rank)
    if replay_end is not None and replay_end.numel():
        need &= pos >= replay_end.long()[req]
    lc = torch.where(need, cp_local(c, cp_world_size, cp_interleave), -1)
    return req, c, done, lc, need


def compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block: int,
                            compress_ratio: int, rows: torch.Tensor, replay_end, cp_world_size: int,
                            cp_rank: int, cp_interleave: int, num_rows: int) -> torch.Tensor:
    """Token-aligned form, int64 ``[num_rows]``: ``bt[rows[req]][lc // S] * S + lc % S`` where a
    slot is needed and its block lies inside the table, ``-1`` elsewhere."""
    req, _, _, lc, need = completing_tokens(query_start_loc, seq_lens, num_rows, compress_ratio,
                                            replay_end, cp_world_size, cp_rank, cp_interleave)
    row, need = token_table_rows(rows, req, need, block_table.shape[0])
    return table_slots(block_table, row, lc, rows_per_block, need)


def compact(query_start_loc, seq_lens, block_table, rows_per_block: int, compress_ratio: int,
            rows: torch.Tensor, replay_end, cp_world_size: int, cp_rank: int, cp_interleave: int,
            num_rows: int, n_out: int, n_cu: int):
    """Compact form over ``num_rows`` token slots: (int64 ``[n_out]``, int32 cu ``[n_cu]``).

    Every completed row is listed, request by request in position order, at ``cu[b] + c -
    first[b]``; its slot is the token-aligned one (``-1`` for rows owned by another rank and for
    replayed tokens, so ``cu`` depends on neither); ``-1`` past the last row; ``cu`` entries past
    ``B`` repeat the total.
    """
    slots = compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block,
                                    compress_ratio, rows, replay_end, cp_world_size, cp_rank,
                                    cp_interleave, num_rows)
    req, c, done, _, _ = completing_tokens(query_start_loc, seq_lens, num_rows, compress_ratio,
                                           None, 1, 0, 1)
    device = slots.device
    first, n = completed_rows(query_start_loc, seq_lens, compress_ratio)
    B = n.numel()
    cu = torch.zeros(n_cu, dtype=torch.long, device=device)
    cu[1:B + 1] = torch.cumsum(n, 0)
    cu[B + 1:] = cu[B]
    out = torch.full((n_out,), -1, dtype=torch.long, device=device)
    if B:
        dst = cu[req] + c - first[req]
        keep = done & (dst >= 0) & (dst < n_out)
        out[dst[keep]] = slots[keep]
    return out, cu.to(torch.int32)


def staged_compact_cu(seq_lens, num_scheduled, out, *, compress_ratio: int) -> None:
    """Host twin of the compact form's ``cu`` (numpy, staged with the step): rows request ``b``
    completes this step, ``seq_lens[b] // R - (seq_lens[b] - num_scheduled[b]) // R``, prefix-summed
    into ``out`` int32 ``[B + 1]`` (every rank lists every row, so it does not depend on the rank)."""
    out[0] = 0
    out[1:] = np.add.accumulate(seq_lens // compress_ratio - (seq_lens - num_scheduled) // compress_ratio)
