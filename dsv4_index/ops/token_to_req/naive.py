"""Reference math of ``token_to_req`` (docs/DESIGN.md §4 "Token → request"): plain PyTorch, the spec."""

from __future__ import annotations

import torch

from ..._common import token_positions


def token_to_req(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 ``[num_rows]``: ``b`` for ``qsl[b] <= t < qsl[b + 1]``, ``0`` for ``t >= qsl[B]``."""
    dummy = torch.zeros(max(query_start_loc.numel() - 1, 0), dtype=torch.int32,
                        device=query_start_loc.device)
    req, _, _ = token_positions(query_start_loc, dummy, num_rows)
    return req.to(torch.int32)
