"""Reference math of ``candidate_blocks_to_physical`` (docs/DESIGN.md §4 "Candidate blocks"): plain PyTorch."""

from __future__ import annotations

import torch

from ..._common import no_block


def blocks_to_physical_rows(blocks: torch.Tensor, token_rows: torch.Tensor, token_nc: torch.Tensor,
                            block_table: torch.Tensor, rows_per_block: int, candidate_block_size: int,
                            table_width: int, num_rows: int):
    """(phys int32 ``[num_rows, nb]``, counts int32 ``[num_rows]``) from per-token table rows and ``n_c``.

    Block ``c = blocks[t, i]`` of a token whose row ``r = token_rows[t]`` lies in the table is valid iff
    ``0 <= c * C < token_nc[t]``, its cache block ``c * C // S`` lies in ``[0, table_width)`` and holds no
    negative id; then ``phys = (bt[r][c * C // S] * S + c * C % S) // C``, else ``-1``. int64 throughout.
    """
    C, S, nb = candidate_block_size, rows_per_block, blocks.shape[1]
    device = blocks.device
    r = token_rows[:num_rows].long()
    valid = (r >= 0) & (r < block_table.shape[0])
    c = torch.full((num_rows, nb), -1, dtype=torch.long, device=device)
    m = min(num_rows, blocks.shape[0])
    c[:m] = blocks[:m].long()
    ok = valid[:, None] & (c >= 0) & (c * C < token_nc[:num_rows].long()[:, None])
    first = torch.where(ok, c * C, 0)
    blk = first // S
    ok &= blk < min(table_width, block_table.shape[1])
    phys = torch.full((num_rows, nb), -1, dtype=torch.long, device=device)
    if bool(ok.any()):
        rr = torch.where(valid, r, 0)[:, None].expand(ok.shape)
        slot = no_block(block_table[rr[ok], blk[ok]].long() * S + first[ok] % S)
        phys[ok] = torch.where(slot >= 0, slot // C, -1)
        ok &= phys >= 0
    return phys.to(torch.int32), ok.sum(1).to(torch.int32)
