"""Reference: Lightning-Indexer lengths (DESIGN §4, INTERFACES.md)."""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_index._common import cp_owned_count, token_positions
from dsv4_index.kernels.indexer_lengths import (IndexerArgs, IndexerLengths,
                                                check_indexer_lengths_args)

__all__ = ["indexer_lengths", "IndexerLengths"]


def compute(query_start_loc, seq_lens, compress_ratio, cp_world_size, cp_rank, cp_interleave,
            a: IndexerArgs) -> IndexerLengths:
    """Fill ``a.outs`` from checked arguments."""
    def owned_visible(pos):                   # n_c(pos) = (pos + 1) // R, owned rows only
        n_c = (pos + 1).clamp(min=0) // compress_ratio
        return cp_owned_count(n_c, cp_world_size, cp_rank, cp_interleave)

    req, pos, valid = token_positions(query_start_loc, seq_lens, a.rows)
    lens = torch.where(valid, owned_visible(pos), 0)
    sl = seq_lens.long()
    per_req = owned_visible(sl - 1)           # n_c(seq_len - 1) = seq_len // R
    cu = torch.cat([per_req.new_zeros(1), per_req.cumsum(0)])
    ks = torch.where(valid, cu[req], 0)
    o = a.outs
    o.lens.copy_(lens.to(torch.int32))
    o.ks.copy_(ks.to(torch.int32))
    o.ke.copy_(torch.where(valid, ks + lens, 0).to(torch.int32))
    o.cu.copy_(cu.to(torch.int32))
    if o.decode_lens is not None:
        nd, nn = a.num_decodes, a.next_n
        qsl = query_start_loc.long()
        q = (qsl[1:nd + 1] - qsl[:nd])[:, None]
        j = torch.arange(nn, device=lens.device)[None, :]
        dpos = sl[:nd, None] - nn + j          # token j - (nn - q) sits at seq_len - q + that
        dec = torch.where(j >= nn - q, owned_visible(dpos), 0)
        o.decode_lens.fill_(0)
        o.decode_lens[:nd].copy_(dec.to(torch.int32))
    return o


def indexer_lengths(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, compress_ratio: int, *,
                    next_n: Optional[int] = None, num_decodes: Optional[int] = None,
                    cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                    num_tokens: Optional[int] = None, out: Optional[torch.Tensor] = None,
                    out_decode: Optional[torch.Tensor] = None, out_ks: Optional[torch.Tensor] = None,
                    out_ke: Optional[torch.Tensor] = None, out_cu: Optional[torch.Tensor] = None,
                    validate: bool = False, backend: Optional[str] = None) -> IndexerLengths:
    """Pure-PyTorch :func:`dsv4_index.indexer_lengths` (``backend`` is ignored)."""
    a = check_indexer_lengths_args(query_start_loc, seq_lens, compress_ratio, next_n, num_decodes,
                                   cp_world_size, cp_rank, cp_interleave, num_tokens, out,
                                   out_decode, out_ks, out_ke, out_cu, validate)
    return compute(query_start_loc, seq_lens, compress_ratio, cp_world_size, cp_rank,
                   cp_interleave, a)
