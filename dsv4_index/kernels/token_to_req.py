"""``token_to_req``: Triton kernel + public wrapper; also the in-kernel helpers the other ops share.

``find_request`` / ``lookup_request`` (request of each token by counting ``query_start_loc``
entries, chunk by chunk) and ``owned_count`` (DCP) are ``@triton.jit`` helpers.

NOTE (latency): these kernels are latency bound. The lookup loads ``qsl`` in chunks of
``qsl_chunk(BLOCK_T)`` entries whose addresses depend on nothing (no binary-search chain of
``log2(B)`` dependent loads): one load latency per chunk, one chunk up to ``B = qsl_chunk``.
``lookup_request`` also picks the token's ``seq_lens[b]`` / ``qsl[b + 1]`` out of the same chunk
(the only request with ``qsl[j] <= t < qsl[j + 1]``), so no load waits on ``b``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._common import use_triton
from ..reference.token_to_req import _check_args, _token_to_req

BLOCK_T = 64
QSL_TILE = 16384  # elements of the [BLOCK_T, chunk] compare tile of the request lookup


def search_iters(num_reqs: int) -> int:
    """Legacy: ``ceil(log2(B + 1))``. ``find_request`` no longer uses its ``n_iters`` (it derives
    its chunk count from ``B``); callers still pass this value."""
    return int(num_reqs).bit_length()


def qsl_chunk_size(block_t: int) -> int:
    """``query_start_loc`` entries per lookup chunk for a token tile of ``block_t`` (power of 2)."""
    return max(16, min(1024, QSL_TILE // int(block_t)))


qsl_chunk = triton.constexpr_function(qsl_chunk_size)  # the same, callable inside kernels


@triton.jit
def find_request(qsl_ptr,  # [B + 1]
                 t, B, n_iters):
    """Largest ``b < B`` with ``qsl[b] <= t`` (0 when ``B == 0``), elementwise over 1-D ``t``.

    Counts ``qsl[1 .. B] <= t`` over ``cdiv(B, CHUNK)`` chunks (independent loads, all in
    ``qsl[1 .. B]``); equals the binary search for a non-decreasing ``qsl``. ``n_iters`` is unused
    (kept for the callers' signature).
    """
    CHUNK: tl.constexpr = qsl_chunk(t.shape[0])
    cnt = tl.zeros_like(t)
    for i in range(0, tl.cdiv(B, CHUNK)):
        j = i * CHUNK + tl.arange(0, CHUNK)
        q = tl.load(qsl_ptr + 1 + j, mask=j < B, other=2147483647)
        cnt += tl.sum((q[None, :] <= t[:, None]).to(t.dtype), axis=1)
    return tl.maximum(tl.minimum(cnt, B - 1), 0)


@triton.jit
def lookup_request(qsl_ptr,       # [B + 1]
                   seq_lens_ptr,  # [B]
                   t, B):
    """Per 1-D token ``t``: (``b`` as :func:`find_request`, ``seq_lens[b]``, ``qsl[b + 1]``), int32.

    ``seq_lens[b]`` / ``qsl[b + 1]`` are 0 for tokens outside ``[0, qsl[B])``. NOTE: they are picked
    from the chunk loads (the one ``j`` with ``qsl[j] <= t < qsl[j + 1]``; zero-length requests never
    match), so nothing waits on ``b``; exact for a non-decreasing ``qsl``.
    """
    CHUNK: tl.constexpr = qsl_chunk(t.shape[0])
    cnt = tl.zeros_like(t)
    sl = tl.zeros_like(t)
    end = tl.zeros_like(t)
    for i in range(0, tl.cdiv(B, CHUNK)):
        j = i * CHUNK + tl.arange(0, CHUNK)
        m = j < B
        q1 = tl.load(qsl_ptr + 1 + j, mask=m, other=2147483647)
        q0 = tl.load(qsl_ptr + j, mask=m, other=2147483647)
        s = tl.load(seq_lens_ptr + j, mask=m, other=0)
        le = q1[None, :] <= t[:, None]
        hit = (q0[None, :] <= t[:, None]) & (q1[None, :] > t[:, None])
        cnt += tl.sum(le.to(t.dtype), axis=1)
        sl += tl.sum(tl.where(hit, s[None, :], 0), axis=1)
        end += tl.sum(tl.where(hit, q1[None, :], 0), axis=1)
    return tl.maximum(tl.minimum(cnt, B - 1), 0), sl, end


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
