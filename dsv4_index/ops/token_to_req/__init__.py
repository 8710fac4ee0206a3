"""``token_to_req``: the request of every token (checks and dispatch; kernel in :mod:`.kernel`,
reference in :mod:`.naive`)."""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import check_batch, needs_value_checks, use_triton
from .._args import check_values, prepare_rows
from . import kernel, naive

__all__ = ["token_to_req"]


def token_to_req(query_start_loc: torch.Tensor, num_tokens: Optional[int], *,
                 out: Optional[torch.Tensor] = None, validate: bool = False,
                 backend: Optional[str] = None) -> torch.Tensor:
    """Request index of every token.

    Parameters
    ----------
    query_start_loc : int32 ``[B + 1]``
    num_tokens : int or None
        Padded token count ``T_pad`` (host int, output length when ``out`` is None); None reads
        ``query_start_loc[-1]`` (a host sync on CUDA) unless ``out`` is given.
    out : int32 ``[T_out]``, optional
        Written in full (``T_out = out.shape[0] >= num_tokens``).
    validate : bool
        Run the value checks on CUDA inputs too (they always run on CPU inputs).
    backend : {None, "triton", "reference"}

    Returns
    -------
    int32 ``[T_out]``: ``b`` for ``qsl[b] <= t < qsl[b + 1]``; ``0`` for padded tokens ``t >= qsl[B]``.

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import token_to_req
    >>> qsl = torch.tensor([0, 1, 4], dtype=torch.int32)    # request 0: 1 token, request 1: 3 tokens
    >>> token_to_req(qsl, num_tokens=6).tolist()          # 2 padded tokens at the end
    [0, 1, 1, 1, 0, 0]
    """
    _, device = check_batch(query_start_loc, None)
    out = prepare_rows("out", out, query_start_loc, num_tokens, torch.int32)
    if needs_value_checks(device, validate):
        check_values(query_start_loc, None, num_tokens, out.shape[0])
    if use_triton(device, backend):
        return kernel.launch(query_start_loc, out)
    out.copy_(naive.token_to_req(query_start_loc, out.shape[0]))
    return out
