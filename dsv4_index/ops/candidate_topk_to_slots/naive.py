"""Reference math of ``candidate_topk_to_slots`` (docs/DESIGN.md §4 "Candidate blocks"): the expansion of a
consumer's sparse columns into request-local rows, in plain PyTorch; the slots are then the top-k
reference's (``topk_to_slots.naive``, composed in ``__init__``)."""

from __future__ import annotations

import torch


def expand_rows(blocks: torch.Tensor, cols: torch.Tensor, candidate_block_size: int, num_rows: int) -> torch.Tensor:
    """int64 ``[num_rows, K]``: ``rows[t, k] = blocks[t, j // C] * C + j % C`` for ``j = cols[t, k]``, ``-1``
    where ``j < 0``, ``j // C >= nb`` (``nb = blocks.shape[1]``), the block is negative, or the row ``t`` lies
    past ``cols`` or ``blocks``. int64 throughout, so any input value is safe."""
    C, nb, K = candidate_block_size, blocks.shape[1], cols.shape[1]
    device = cols.device
    j = torch.full((num_rows, K), -1, dtype=torch.long, device=device)
    m = min(num_rows, cols.shape[0], blocks.shape[0])
    j[:m] = cols[:m].long()
    ok = (j >= 0) & (j < nb * C)
    jj = torch.where(ok, j, 0)
    blk = torch.full((num_rows, max(nb, 1)), -1, dtype=torch.long, device=device)
    blk[:m, :nb] = blocks[:m].long()
    b = blk.gather(1, jj // C)
    ok &= b >= 0
    return torch.where(ok, b * C + jj % C, -1)
