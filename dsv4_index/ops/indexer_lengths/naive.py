"""Reference math of ``indexer_lengths`` (docs/DESIGN.md §4 "Indexer lengths", DCP): plain PyTorch, the spec."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..._common import cp_owned_count, token_positions


def indexer_lengths(query_start_loc, seq_lens, compress_ratio: int, cp_world_size: int, cp_rank: int,
                    cp_interleave: int, num_rows: int, next_n: Optional[int], num_decodes: int,
                    dec_rows: int):
    """(lens ``[num_rows]``, decode_lens ``[dec_rows, next_n]`` or None, ks, ke ``[num_rows]``,
    cu ``[B + 1]``), all int32.

    ``lens[t] = n_c(pos_t) = (pos_t + 1) // R`` (owned rows under DCP); ``cu`` is the prefix sum of
    ``n_c(seq_len_b - 1) = seq_len_b // R``; ``ks[t] = cu[b]``, ``ke[t] = cu[b] + lens[t]``; padded
    tokens get 0. The decode view of the first ``num_decodes`` requests is right-aligned: entry
    ``[b, j]`` is the lens of the request's token ``j - (next_n - q_b)``, 0 before it; rows past
    ``num_decodes`` are 0.
    """
    def owned_visible(pos):  # n_c(pos) = (pos + 1) // R, owned rows only
        n_c = (pos + 1).clamp(min=0) // compress_ratio
        return cp_owned_count(n_c, cp_world_size, cp_rank, cp_interleave)

    req, pos, valid = token_positions(query_start_loc, seq_lens, num_rows)
    lens = torch.where(valid, owned_visible(pos), 0)
    sl = seq_lens.long()
    per_req = owned_visible(sl - 1)  # n_c(seq_len - 1) = seq_len // R
    cu = torch.cat([per_req.new_zeros(1), per_req.cumsum(0)])
    ks = torch.where(valid, cu[req], 0)
    ke = torch.where(valid, ks + lens, 0)
    dec = None
    if next_n is not None:
        nd = num_decodes
        qsl = query_start_loc.long()
        q = (qsl[1:nd + 1] - qsl[:nd])[:, None]
        j = torch.arange(next_n, device=lens.device)[None, :]
        dpos = sl[:nd, None] - next_n + j  # token j - (next_n - q) sits at seq_len - q + that
        dec = torch.zeros((dec_rows, next_n), dtype=torch.long, device=lens.device)
        dec[:nd] = torch.where(j >= next_n - q, owned_visible(dpos), 0)
        dec = dec.to(torch.int32)
    i32 = lambda x: x.to(torch.int32)  # noqa: E731
    return i32(lens), dec, i32(ks), i32(ke), i32(cu)


def staged_cu(seq_lens, num_scheduled, out, *, compress_ratio: int, cp_world_size: int = 1, cp_rank: int = 0,
              cp_interleave: int = 1) -> None:
    """Host twin of ``cu`` (numpy, staged with the step): ``out[0] = 0``, ``out[b + 1] = out[b] +``
    owned rows of ``seq_lens[b] // R``. ``seq_lens`` int64 ``[B]``; ``out`` int32 ``[B + 1]``;
    ``num_scheduled`` is unused (the staged-input signature)."""
    # NOTE: seq_lens >= 0: a shift is the floor division for a power-of-two ratio (and 3x cheaper)
    shift = compress_ratio.bit_length() - 1
    rows = seq_lens >> shift if compress_ratio == 1 << shift else seq_lens // compress_ratio
    if cp_world_size > 1:
        rows = cp_owned_count(rows, cp_world_size, cp_rank, cp_interleave)
    out[0] = 0
    out[1:] = np.add.accumulate(rows)  # NOTE: int64, then one cast (an int32 out= is 3x slower)
