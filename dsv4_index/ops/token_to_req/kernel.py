"""Triton kernel of ``token_to_req``: one program per ``BLOCK_T`` tokens, the body is
:func:`dsv4_index.ops._device.find_request`."""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import find_request

BLOCK_T = 256


@triton.jit(do_not_specialize=["T_out", "num_reqs", "n_iter"])
def _token_to_req_kernel(qsl_ptr,  # [B + 1] int32
                         out_ptr,  # [T_out] int32
                         T_out, num_reqs, n_iter, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = find_request(qsl_ptr, t, num_reqs, n_iter)
    valid = t < tl.load(qsl_ptr + num_reqs)  # NOTE: validity from the device value qsl[B]
    tl.store(out_ptr + t, tl.where(valid, b, 0), mask=t < T_out)


def launch(query_start_loc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (int32 ``[T_out]``) from checked arguments."""
    num_reqs, T_out = query_start_loc.numel() - 1, out.shape[0]
    if T_out:
        _token_to_req_kernel[(triton.cdiv(T_out, BLOCK_T),)](
            query_start_loc, out, T_out, num_reqs, num_reqs.bit_length(), BLOCK_T=BLOCK_T)
    return out
