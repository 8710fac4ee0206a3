"""Sparse-attention decode over FlashMLA-shaped index lists (an example consumer, not library API).

The DeepSeek-V4 decode convention of FlashMLA's sparse mode (consumers.md §2), in bf16 instead of the
FP8 cache: every decode token is its own batch entry (``s_q = 1``) and reads two pools through int32
physical-slot lists -- the sliding-window cache (``indices`` / ``topk_length``, e.g.
``meta["swa"].indices[:, None]``) and, on C4A / C128A layers, the compressed cache (``extra_*``, e.g.
``meta.topk_to_slots("c4a", topk)`` or ``meta["c128a"].indices``). One KV head: the gathered row is both
key and value. One softmax runs over both lists plus a per-head sink logit that takes probability mass
and gives no value back.

Entry ``j`` of a list is used iff ``j < length``, ``0 <= slot`` and ``slot < cache.shape[0]``; nothing
else is ever dereferenced (a slot past the cache counts as invalid, like FlashMLA's sparse prefill).

* :func:`sparse_decode_attention` -- Triton kernel on CUDA tensors or under ``TRITON_INTERPRET=1``,
  else the reference; ``backend="triton" | "reference"`` forces either.
* :func:`sparse_decode_attention_reference` -- plain PyTorch in fp32: the spec.
* :func:`bench_sparse_decode` -- times the kernel on a CUDA device (``triton.testing.do_bench``).
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

__all__ = ["sparse_decode_attention", "sparse_decode_attention_reference", "bench_sparse_decode"]

LOG2E = 1.4426950408889634
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# kernel
@triton.jit
def _attend_list(acc, m_i, l_i, q, cache_ptr, idx_ptr, length, width, num_slots, stride_cache,
                 offs_d, d_mask, qk_scale,
                 BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Online-softmax pass over one index list (base-2 logits); returns the updated (acc, m, l).

    cache_ptr: [num_slots, D] rows; idx_ptr: [width] int32 slots of this token's list.
    acc: fp32 [BLOCK_H, BLOCK_D]; m_i, l_i: fp32 [BLOCK_H]; q: [BLOCK_H, BLOCK_D] (0 outside H, D).
    """
    n_end = tl.minimum(length, width)  # NOTE: a length past the list's width reads no further
    for start in range(0, n_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_list = offs_n < n_end
        idx = tl.load(idx_ptr + offs_n, mask=in_list, other=-1)
        # NOTE: -1, out-of-cache slots and entries past the length are masked: never dereferenced
        valid = in_list & (idx >= 0) & (idx < num_slots)
        rows = tl.load(cache_ptr + idx.to(tl.int64)[:, None] * stride_cache + offs_d[None, :],
                       mask=valid[:, None] & d_mask[None, :], other=0.0)        # [BLOCK_N, BLOCK_D]
        p_ty = rows.dtype  # NOTE: P is rounded to the cache dtype for the PV dot, as on tensor cores
        if UPCAST:
            rows = rows.to(tl.float32)
        s = tl.dot(q, tl.trans(rows), input_precision=DOT_PREC) * qk_scale       # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # NOTE: a head that has seen nothing valid keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(p_ty).to(rows.dtype), rows, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _sparse_decode_kernel(
    q_ptr,      # [T, 1, H, D] q dtype; last dim contiguous
    swa_ptr,    # [num_slots, D] q dtype; last dim contiguous
    idx_ptr,    # [T, 1, W] int32 physical slots into swa, -1 = invalid
    len_ptr,    # [T] int32 valid prefix of each idx row
    xc_ptr,     # [num_extra_slots, D] q dtype (swa_ptr again when HAS_EXTRA is False; never read then)
    xidx_ptr,   # [T, 1, K] int32 slots into the extra cache (dummy when not HAS_EXTRA)
    xlen_ptr,   # [T] int32 (dummy when not HAS_EXTRA)
    sink_ptr,   # [H] fp32 sink logits (dummy when not HAS_SINK)
    out_ptr,    # [T, 1, H, D] q dtype; written in full
    lse_ptr,    # [T, 1, H] fp32; written in full
    H, D, W, K, num_slots, num_extra_slots,
    stride_qt, stride_qh, stride_c, stride_it, stride_lt,
    stride_xc, stride_xit, stride_xlt, stride_ot, stride_oh, stride_lse_t,
    qk_scale,   # sm_scale * log2(e)
    HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 on bf16 values (the interpreter's bf16 dot is broken)
    EVEN_D: tl.constexpr,  # D == BLOCK_D
):
    """One program per (token, block of BLOCK_H heads): gather BLOCK_N listed rows at a time."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < H
    d_mask = offs_d < (BLOCK_D if EVEN_D else D)  # NOTE: constant when D == BLOCK_D: vector loads
    hd_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hd_mask, other=0.0)                                          # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc, m_i, l_i = _attend_list(acc, m_i, l_i, q, swa_ptr, idx_ptr + t * stride_it,
                                 tl.load(len_ptr + t * stride_lt), W, num_slots, stride_c,
                                 offs_d, d_mask, qk_scale, BLOCK_N, DOT_PREC, UPCAST)
    if HAS_EXTRA:
        acc, m_i, l_i = _attend_list(acc, m_i, l_i, q, xc_ptr, xidx_ptr + t * stride_xit,
                                     tl.load(xlen_ptr + t * stride_xlt), K, num_extra_slots,
                                     stride_xc, offs_d, d_mask, qk_scale, BLOCK_N, DOT_PREC, UPCAST)
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=float("-inf")) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        m_safe = tl.where(m_f == float("-inf"), 0.0, m_f)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.exp2(sink - m_safe)  # NOTE: the sink adds mass, no value
        acc = acc * alpha[:, None]
        m_i = m_f
    has_mass = l_i > 0.0
    inv_l = tl.where(has_mass, 1.0 / tl.where(has_mass, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]                      # NOTE: nothing visible -> acc = 0 -> out = 0
    lse = tl.where(has_mass, (m_i + tl.log2(tl.where(has_mass, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=hd_mask)
    tl.store(lse_ptr + t * stride_lse_t + offs_h, lse, mask=h_mask)


# argument checks and dispatch
def _check_tensor(name, x, dtypes, ndim, device):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")
    if x.numel() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.stride()}")


def _check_args(q, swa_cache, indices, topk_length, extra_cache, extra_indices, extra_topk_length,
                attn_sink, sm_scale, out) -> Tuple[bool, float]:
    """Validate every argument (ValueError naming it); returns (has_extra, sm_scale)."""
    _check_tensor("q", q, FLOAT_DTYPES, 4, None)
    T, s_q, H, D = q.shape
    dev = q.device
    if s_q != 1:
        raise ValueError(f"q must be [T, 1, H, D] (one query token per batch entry), got {tuple(q.shape)}")
    if H < 1 or D < 1:
        raise ValueError(f"q needs H >= 1 and D >= 1, got shape {tuple(q.shape)}")
    pools = [("swa_cache", "indices", "topk_length", swa_cache, indices, topk_length)]
    given = [x is not None for x in (extra_cache, extra_indices, extra_topk_length)]
    if any(given) and not all(given):
        missing = [n for n, g in zip(("extra_cache", "extra_indices", "extra_topk_length"), given) if not g]
        raise ValueError(f"{', '.join(missing)} must be given with the other extra_* arguments (or all None)")
    if all(given):
        pools.append(("extra_cache", "extra_indices", "extra_topk_length",
                      extra_cache, extra_indices, extra_topk_length))
    for cname, iname, lname, cache, idx, length in pools:
        _check_tensor(cname, cache, (q.dtype,), 2, dev)
        if cache.shape[1] != D:
            raise ValueError(f"{cname} must be [num_slots, D={D}], got {tuple(cache.shape)}")
        _check_tensor(iname, idx, (torch.int32,), 3, dev)
        if idx.shape[:2] != (T, 1):
            raise ValueError(f"{iname} must be [T={T}, 1, width], got {tuple(idx.shape)}")
        _check_tensor(lname, length, (torch.int32,), 1, dev)
        if length.shape[0] != T:
            raise ValueError(f"{lname} must be [T={T}], got {tuple(length.shape)}")
    if attn_sink is not None:
        _check_tensor("attn_sink", attn_sink, (torch.float32,), 1, dev)
        if attn_sink.shape[0] != H:
            raise ValueError(f"attn_sink must be [H={H}], got {tuple(attn_sink.shape)}")
    if sm_scale is None:
        sm_scale = D ** -0.5
    elif isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) \
            or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
    if out is not None:
        _check_tensor("out", out, (q.dtype,), 4, dev)
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    return len(pools) == 2, float(sm_scale)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _use_triton(device: torch.device, backend: Optional[str]) -> bool:
    """``backend`` beats ``DSV4_INDEX_BACKEND``, which beats: Triton on CUDA or when interpreting."""
    choice = backend if backend is not None else os.environ.get("DSV4_INDEX_BACKEND") or None
    if choice is None:
        return device.type == "cuda" or _interpreting()
    if choice not in ("triton", "reference"):
        raise ValueError(f"backend must be 'triton', 'reference' or None, got {choice!r}")
    if choice == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1")
    return choice == "triton"


def default_config(T: int, H: int, D: int) -> dict:
    """Tile sizes for ``T`` tokens of ``H`` heads of width ``D`` (full D per tile; tuned on an H200).

    NOTE (sm_90, D = 512, bf16; measured with :func:`bench_sparse_decode`): one program owns a token's
    whole list, so the kernel is latency-bound while programs are few. Few tokens: BLOCK_H = 16
    (4x the programs; mma.sync; 128 regs, no spills; a token's rows are re-read from L2 by its other
    head blocks). Once BLOCK_H = 64 gives >= 128 programs (about one per SM): BLOCK_H = 64 (wgmma, rows
    read once), 8 warps, 3 stages, ~193 KB shared memory (fits sm_90's 227 KB, not smaller parts).
    """
    block_d = max(16, triton.next_power_of_2(D))
    if block_d < 256:
        return dict(BLOCK_H=min(64, max(16, triton.next_power_of_2(H))), BLOCK_N=64, num_warps=4,
                    num_stages=2)
    if T * triton.cdiv(H, 64) >= 128:
        return dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_H=16, BLOCK_N=64, num_warps=8, num_stages=2)


# public functions
def sparse_decode_attention(q, swa_cache, indices, topk_length, extra_cache=None, extra_indices=None,
                            extra_topk_length=None, attn_sink=None, *, sm_scale=None, out=None,
                            backend: Optional[str] = None, config: Optional[dict] = None):
    """Sparse decode attention over a window list and an optional compressed list, one softmax + sink.

    Parameters
    ----------
    q : bf16 / fp16 / fp32 [T, 1, H, D] -- one query token per batch entry; last dim contiguous.
    swa_cache : q.dtype [num_slots, D] -- flat slot view of the paged SWA cache (slot = block * 64 + off).
    indices : int32 [T, 1, W] -- physical slots into ``swa_cache``, ``-1`` = invalid.
    topk_length : int32 [T] -- entry ``j`` of row ``t`` is used only if ``j < topk_length[t]``.
    extra_cache : q.dtype [num_extra_slots, D] or None -- compressed cache (C4A / C128A rows).
    extra_indices : int32 [T, 1, K] or None -- slots into ``extra_cache``, ``-1`` = invalid.
    extra_topk_length : int32 [T] or None -- valid prefix of ``extra_indices``.
    attn_sink : fp32 [H] or None -- per-head sink logit (unscaled); joins the softmax, adds no value.
    sm_scale : float, default ``D ** -0.5`` -- logits are ``sm_scale * q . k``.
    out : q.dtype [T, 1, H, D] or None -- written in full and returned.
    backend : None | "triton" | "reference" -- default: Triton on CUDA or under TRITON_INTERPRET=1.
    config : dict or None -- tile overrides (BLOCK_H, BLOCK_N, num_warps, num_stages); Triton only.

    Returns
    -------
    out : q.dtype [T, 1, H, D] -- ``sum_j p_j v_j`` (0 where nothing is visible).
    lse : fp32 [T, 1, H] -- log-sum-exp of the scaled logits and the sink (``-inf`` if none at all).
    """
    has_extra, scale = _check_args(q, swa_cache, indices, topk_length, extra_cache, extra_indices,
                                   extra_topk_length, attn_sink, sm_scale, out)
    if not _use_triton(q.device, backend):
        return sparse_decode_attention_reference(q, swa_cache, indices, topk_length, extra_cache,
                                                 extra_indices, extra_topk_length, attn_sink,
                                                 sm_scale=scale, out=out)
    T, _, H, D = q.shape
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((T, 1, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    cfg = default_config(T, H, D)
    cfg.update(config or {})
    xc, xi, xl = (extra_cache, extra_indices, extra_topk_length) if has_extra else \
        (swa_cache, indices, topk_length)
    sink = attn_sink if attn_sink is not None else lse  # dummy pointer, never read
    grid = (T, triton.cdiv(H, cfg["BLOCK_H"]))
    # NOTE: Triton 3.6's interpreter multiplies bf16 operands as their raw uint16 bits; there the dots
    # run in fp32 on the same bf16 values (products are exact in fp32 either way; P is still rounded)
    upcast = _interpreting() and q.dtype == torch.bfloat16
    _sparse_decode_kernel[grid](
        q, swa_cache, indices, topk_length, xc, xi, xl, sink, out, lse,
        H, D, indices.shape[2], xi.shape[2] if has_extra else 0, swa_cache.shape[0], xc.shape[0],
        q.stride(0), q.stride(2), swa_cache.stride(0), indices.stride(0), topk_length.stride(0),
        xc.stride(0), xi.stride(0), xl.stride(0), out.stride(0), out.stride(2), lse.stride(0),
        scale * LOG2E,
        HAS_EXTRA=has_extra, HAS_SINK=attn_sink is not None,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=max(16, triton.next_power_of_2(D)),
        DOT_PREC="ieee" if q.dtype == torch.float32 or upcast else "tf32",  # NOTE: fp32: no TF32 rounding
        UPCAST=upcast, EVEN_D=D == max(16, triton.next_power_of_2(D)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


def sparse_decode_attention_reference(q, swa_cache, indices, topk_length, extra_cache=None,
                                      extra_indices=None, extra_topk_length=None, attn_sink=None, *,
                                      sm_scale=None, out=None):
    """Plain-PyTorch fp32 spec of :func:`sparse_decode_attention` (same arguments and results)."""
    has_extra, scale = _check_args(q, swa_cache, indices, topk_length, extra_cache, extra_indices,
                                   extra_topk_length, attn_sink, sm_scale, out)
    pools = [(swa_cache, indices, topk_length)]
    if has_extra:
        pools.append((extra_cache, extra_indices, extra_topk_length))
    keys, valid = [], []
    for cache, idx, length in pools:
        idx = idx[:, 0].long()                                                   # [T, W]
        j = torch.arange(idx.shape[1], device=idx.device)
        ok = (j[None, :] < length[:, None].long()) & (idx >= 0) & (idx < cache.shape[0])
        if cache.shape[0] > 0:
            rows = cache[torch.where(ok, idx, 0)].float()                        # [T, W, D]
        else:
            rows = torch.zeros(idx.shape + (cache.shape[1],), device=cache.device)
        keys.append(torch.where(ok[..., None], rows, 0.0))   # unlisted rows (NaN too) never mix in
        valid.append(ok)
    keys, valid = torch.cat(keys, dim=1), torch.cat(valid, dim=1)                # [T, N, D], [T, N]
    qf = q[:, 0].float()                                                         # [T, H, D]
    s = torch.einsum("thd,tnd->thn", qf, keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    if attn_sink is not None:
        s = torch.cat([s, attn_sink.float().expand(q.shape[0], -1)[..., None]], dim=-1)
    lse = torch.logsumexp(s, dim=-1)                                             # [T, H]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])[..., :keys.shape[1]]
    o = torch.einsum("thn,tnd->thd", p, keys)[:, None].to(q.dtype)               # [T, 1, H, D]
    if out is None:
        out = o
    else:
        out.copy_(o)
    return out, lse[:, None]


# timing (CUDA only)
def bench_sparse_decode(T: int = 64, H: int = 64, D: int = 512, W: int = 128, K: int = 512,
                        num_slots: int = 1 << 18, dtype: torch.dtype = torch.bfloat16,
                        device="cuda", *, invalid_frac: float = 0.05, seed: int = 0,
                        config: Optional[dict] = None) -> dict:
    """Time :func:`sparse_decode_attention` on random inputs with ``triton.testing.do_bench`` (median).

    Lists hold random slots of ``[0, num_slots)`` (both pools have ``num_slots`` rows), about
    ``invalid_frac`` of them ``-1``; lengths are uniform in ``[W // 2, W]`` and ``[K // 2, K]``
    (``K = 0``: SWA-only layer, no extra pool); a sink is given.

    Returns
    -------
    dict -- ``ms`` (median), ``rows`` (valid gathered rows), ``bytes`` (rows x D x itemsize + q + out,
    each row counted once per token), ``gbps`` (bytes / time), ``config`` (tiles used), and the shape.
    NOTE: rows re-read by a token's other head blocks come from L2 and are not counted.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("bench_sparse_decode needs a CUDA device; timings on CPU mean nothing")
    g = torch.Generator(device="cpu").manual_seed(seed)

    def lists(width):
        idx = torch.randint(0, num_slots, (T, 1, width), generator=g, dtype=torch.int32)
        idx[torch.rand(idx.shape, generator=g) < invalid_frac] = -1
        lens = torch.randint(width // 2, width + 1, (T,), generator=g, dtype=torch.int32)
        ok = (torch.arange(width)[None, :] < lens[:, None]) & (idx[:, 0] >= 0)
        return idx.to(device), lens.to(device), int(ok.sum())

    q = torch.randn((T, 1, H, D), generator=g).to(device=device, dtype=dtype)
    swa = torch.randn((num_slots, D), generator=g).to(device=device, dtype=dtype)
    idx, lens, rows = lists(W)
    args = [q, swa, idx, lens]
    if K > 0:
        xidx, xlens, xrows = lists(K)
        args += [torch.randn((num_slots, D), generator=g).to(device=device, dtype=dtype), xidx, xlens]
        rows += xrows
    else:
        args += [None, None, None]
    sink = torch.randn((H,), generator=g).to(device)
    out = torch.empty_like(q)

    def fn():
        sparse_decode_attention(*args, sink, out=out, backend="triton", config=config)

    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    nbytes = rows * D * q.element_size() + 2 * q.numel() * q.element_size()
    cfg = default_config(T, H, D)
    cfg.update(config or {})
    return dict(T=T, H=H, D=D, W=W, K=K, dtype=str(dtype), ms=ms, rows=rows, bytes=nbytes,
                gbps=nbytes / (ms * 1e-3) / 1e9, config=cfg)
