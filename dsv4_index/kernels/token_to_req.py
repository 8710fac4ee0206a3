"""``token_to_req``: Triton kernel + public wrapper; also the in-kernel helpers the other ops share.

``find_request`` (binary search over ``query_start_loc``) and ``owned_count`` (DCP) are
``@triton.jit`` helpers; ``search_iters(B)`` is the host-side iteration count of the search.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._common import use_triton
from ..reference.token_to_req import _check_args, _token_to_req

BLOCK_T = 256


def search_iters(num_reqs: int) -> int:
    """Iterations of ``find_request`` over ``B`` requests: ``ceil(log2(B + 1))``."""
    return int(num_reqs).bit_length()


@triton.jit
def find_request(qsl_ptr,  # [B + 1]
                 t, B, n_iters):
    """Largest ``b < B`` with ``qsl[b] <= t`` (0 when ``B == 0``), elementwise over ``t``.

    NOTE: ``n_iters`` is a runtime int (``search_iters(B)``); every load stays in ``qsl[1 .. B]``.
    """
    lo = tl.zeros_like(t)  # count of qsl[1 .. B] entries <= t lies in [lo, hi]
    hi = tl.zeros_like(t) + B
    for _ in range(n_iters):
        active = lo < hi
        mid = (lo + hi) // 2
        le = tl.load(qsl_ptr + 1 + mid, mask=active, other=0) <= t
        lo = tl.where(active & le, mid + 1, lo)
        hi = tl.where(active & (le == 0), mid, hi)
    return tl.maximum(tl.minimum(lo, B - 1), 0)


@triton.jit
def owned_count(n, cp_world, cp_rank, cp_interleave):
    """How many of ``0 .. n-1`` (``n >= 0``) rank ``cp_rank`` owns under DCP."""
    cycle = cp_interleave * cp_world
    part = tl.minimum(tl.maximum(n % cycle - cp_rank * cp_interleave, 0), cp_interleave)
    return (n // cycle) * cp_interleave + part


@triton.jit(do_not_specialize=["B", "n_iters", "T_out"])
def _token_to_req_kernel(qsl_ptr,  # [B + 1]
                         out_ptr,  # [T_out]
                         B, n_iters, T_out, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = find_request(qsl_ptr, t, B, n_iters)
    valid = t < tl.load(qsl_ptr + B)  # NOTE: validity from the device value qsl[B]
    tl.store(out_ptr + t, tl.where(valid, b, 0), mask=t < T_out)


def _launch(query_start_loc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    B, T_out = query_start_loc.numel() - 1, out.shape[0]
    if T_out:
        _token_to_req_kernel[(triton.cdiv(T_out, BLOCK_T),)](
            query_start_loc, out, B, search_iters(B), T_out, BLOCK_T=BLOCK_T)
    return out


def token_to_req(query_start_loc: torch.Tensor, num_tokens: Optional[int], *, out=None,
                 validate: bool = False, backend=None) -> torch.Tensor:
    """Request index of every token.

    Parameters
    ----------
    query_start_loc : int32 [B + 1]
    num_tokens : int or None
        Padded token count ``T_pad`` (host int); None reads ``query_start_loc[-1]`` (a host sync
        on CUDA) unless ``out`` is given.
    out : int32 [>= num_tokens], optional
        Written in full: ``T_out = out.shape[0]``.
    validate : bool
        Run the value checks on CUDA inputs too (they always run on CPU inputs).
    backend : {None, "triton", "reference"}

    Returns
    -------
    int32 [T_out]: ``b`` for ``qsl[b] <= t < qsl[b+1]``; ``0`` for padded tokens ``t >= qsl[B]``.
    """
    out = _check_args(query_start_loc, num_tokens, out, validate)
    if use_triton(query_start_loc.device, backend):
        return _launch(query_start_loc, out)
    out.copy_(_token_to_req(query_start_loc, out.shape[0]))
    return out
