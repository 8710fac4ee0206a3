"""Reference of ``token_to_req`` (DESIGN §4 "Token → request")."""

from __future__ import annotations

from typing import Optional

import torch

from .._common import (check_batch, check_batch_values, needs_value_checks, prepare_out,
                       resolve_num_tokens, token_positions)


def prepare_rows(name: str, out, query_start_loc: torch.Tensor, num_tokens: Optional[int],
                 dtype: torch.dtype, cols: Optional[int] = None) -> torch.Tensor:
    """Checked ``out=`` buffer (or a new one) with ``T_out`` rows.

    ``T_out`` is ``out.shape[0]`` when ``out`` is given, else ``num_tokens`` (read from
    ``query_start_loc[-1]`` when None: a host sync on CUDA). ``cols`` makes it 2-D.
    """
    if out is not None and num_tokens is None:
        rows = 0  # NOTE: no read-back; the buffer's length is the output length
    else:
        rows = resolve_num_tokens(query_start_loc, num_tokens)
    shape = (rows,) if cols is None else (rows, cols)
    return prepare_out(name, out, shape=shape, min_rows=rows, dtype=dtype,
                       device=query_start_loc.device)


def check_values(query_start_loc, seq_lens, num_tokens: Optional[int], rows: int) -> None:
    """Batch value checks, and that the live tokens fit the ``rows`` of the output."""
    check_batch_values(query_start_loc, seq_lens, num_tokens=num_tokens)
    live = int(query_start_loc[-1])
    if live > rows:
        raise ValueError(f"out has {rows} rows, but query_start_loc[-1] = {live} tokens are live")


def _check_args(query_start_loc, num_tokens, out, validate):
    """Shared by the reference and the Triton wrapper; returns the output buffer ``[T_out]``."""
    _, device = check_batch(query_start_loc, None)
    out = prepare_rows("out", out, query_start_loc, num_tokens, torch.int32)
    if needs_value_checks(device, validate):
        check_values(query_start_loc, None, num_tokens, out.shape[0])
    return out


def _token_to_req(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    dummy = torch.zeros(max(query_start_loc.numel() - 1, 0), dtype=torch.int32,
                        device=query_start_loc.device)
    req, _, _ = token_positions(query_start_loc, dummy, num_rows)
    return req.to(torch.int32)


def token_to_req(query_start_loc: torch.Tensor, num_tokens: Optional[int], *, out=None,
                 validate: bool = False, backend=None) -> torch.Tensor:
    """Reference of :func:`dsv4_index.token_to_req`: same signature, arguments and result (the kernel must equal it).

    Plain PyTorch on any device; ``backend`` is accepted and ignored.
    """
    out = _check_args(query_start_loc, num_tokens, out, validate)
    out.copy_(_token_to_req(query_start_loc, out.shape[0]))
    return out
