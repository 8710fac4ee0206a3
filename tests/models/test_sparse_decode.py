"""models/deepseek_v4/sparse_decode.py: Triton kernel == PyTorch reference == the model's sink attention.

Kernel tests run on CUDA or in the Triton interpreter (``./dev test`` sets TRITON_INTERPRET=1); they
call ``backend="triton"`` explicitly, so they never compare the reference with itself.
"""

import os
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from models.deepseek_v4.attention import sink_attention_lse
from models.deepseek_v4.sparse_decode import (bench_sparse_decode, sparse_decode_attention,
                                              sparse_decode_attention_reference)

pytestmark = pytest.mark.slow  # attention kernel in the interpreter (./dev quick skips it)

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
needs_kernel = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRETING),
    reason="the Triton path needs CUDA or TRITON_INTERPRET=1 (./dev test sets it); without either "
           "the wrapper falls back to the reference, so there is no kernel to compare")
MORE = settings(max_examples=4 * settings().max_examples)  # reference-only: cheap
GARBAGE = [-1, -7, 2**31 - 1, -2**31]  # plus num_slots (one past the cache), added per pool


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def make_pool(g, T, width, N, D, dtype, *, p_bad, full, device=DEV):
    """(cache [N, D], idx [T, 1, width], lens [T]) with random slots, bad entries and lengths.

    Every cache row that no used entry names (j < len, 0 <= slot < N) is NaN, so any read of an
    unlisted row poisons the output.
    """
    idx = torch.randint(0, N, (T, 1, width), generator=g, dtype=torch.int64)
    bad = torch.rand(idx.shape, generator=g) < p_bad
    choice = torch.tensor(GARBAGE + [N])[torch.randint(0, len(GARBAGE) + 1, idx.shape, generator=g)]
    idx = torch.where(bad, choice, idx).to(torch.int32)
    lens = torch.full((T,), width, dtype=torch.int32) if full else \
        torch.randint(-1, width + 3, (T,), generator=g, dtype=torch.int32)
    used = (torch.arange(width)[None, :] < lens[:, None]) & (idx[:, 0] >= 0) & (idx[:, 0] < N)
    listed = torch.zeros(N, dtype=torch.bool)
    listed[idx[:, 0][used].long()] = True
    cache = torch.randn((N, D), generator=g)
    cache[~listed] = float("nan")
    return cache.to(device=device, dtype=dtype), idx.to(device), lens.to(device)


@st.composite
def cases(draw):
    return dict(T=draw(st.integers(1, 6)), H=draw(st.sampled_from([2, 4, 16])),
                D=draw(st.sampled_from([32, 64])), W=draw(st.integers(1, 16)),
                K=draw(st.integers(1, 24)), N=draw(st.integers(1, 48)),
                extra=draw(st.booleans()), sink=draw(st.booleans()),
                p_bad=draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])), full=draw(st.booleans()),
                block_n=draw(st.sampled_from([16, None])), seed=draw(st.integers(0, 2**31 - 1)))


def build(c, dtype=torch.float32):
    """Positional arguments of sparse_decode_attention for case ``c``."""
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn((c["T"], 1, c["H"], c["D"]), generator=g).to(device=DEV, dtype=dtype)
    args = [q, *make_pool(g, c["T"], c["W"], c["N"], c["D"], dtype, p_bad=c["p_bad"], full=c["full"])]
    if c["extra"]:
        args += make_pool(g, c["T"], c["K"], c["N"] + 5, c["D"], dtype, p_bad=c["p_bad"], full=c["full"])
    else:
        args += [None, None, None]
    args.append(torch.randn((c["H"],), generator=g).to(DEV) * 2 if c["sink"] else None)
    return args


def kernel(*args, block_n=None, **kw):
    return sparse_decode_attention(*args, backend="triton",
                                   config=None if block_n is None else dict(BLOCK_N=block_n), **kw)


# ----------------------------------------------------------------------------------------------
# kernel == reference
# ----------------------------------------------------------------------------------------------
@needs_kernel
@given(cases())
def test_kernel_matches_reference_fp32(c):
    args = build(c)
    out, lse = kernel(*args, block_n=c["block_n"])
    ref_out, ref_lse = sparse_decode_attention_reference(*args)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    assert lse.dtype == torch.float32 and lse.shape == args[0].shape[:3]
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)  # -inf where nothing is visible


@needs_kernel
def test_kernel_matches_reference_bf16():
    c = dict(T=6, H=16, D=64, W=16, K=24, N=40, extra=True, sink=True, p_bad=0.2, full=False,
             seed=3)
    args = build(c, torch.bfloat16)
    out, lse = kernel(*args, block_n=16, sm_scale=0.2)
    ref_out, ref_lse = sparse_decode_attention_reference(*args, sm_scale=0.2)
    assert out.dtype == torch.bfloat16
    # Same bf16 values on both sides; the reference upcasts and computes in fp32. The kernel's QK
    # products are exact in its fp32 accumulator, so lse agrees to fp32 rounding; its PV dot takes the
    # probabilities rounded to bf16 (rel. 2^-8) and the output is rounded to bf16 (rel. 2^-8): with
    # |v| <~ 4, |err| <~ 2 * 2^-8 * 4 = 3e-2 worst case, a few 1e-3 typically.
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    rel = (out.float() - ref_out.float()).norm() / ref_out.float().norm()
    assert rel < 1e-2, rel


@needs_kernel
def test_poisoned_out_is_written_in_full():
    c = dict(T=5, H=4, D=32, W=12, K=20, N=30, extra=True, sink=False, p_bad=0.3, full=False, seed=7)
    args = build(c)
    args[3][1] = 0
    args[6][1] = 0                                # token 1 sees nothing: out 0, lse -inf
    out = torch.full_like(args[0], float("nan"))
    got, lse = kernel(*args, block_n=16, out=out)
    assert got is out
    ref_out, ref_lse = sparse_decode_attention_reference(*args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()


@needs_kernel
@pytest.mark.parametrize("extra", [False, True])
def test_unlisted_and_garbage_slots_are_never_read(extra):
    T, H, D, N = 3, 4, 32, 20
    g = torch.Generator().manual_seed(11)
    q = torch.randn((T, 1, H, D), generator=g).to(DEV)
    cache = torch.full((N, D), float("nan"))
    used = [2, 5, 9, 13]
    cache[used] = torch.randn((len(used), D), generator=g)
    # within the length: valid slots, a -1 and an out-of-cache slot (invalid, skipped);
    # past the length: -1, a huge garbage slot and the sign bit -- none may be dereferenced
    row = [2, -1, 5, N, 9, 13, -1, 2**31 - 1, -2**31, 7]
    idx = torch.tensor([[row]] * T, dtype=torch.int32)
    lens = torch.tensor([6, 0, 3], dtype=torch.int32)
    args = [q, cache.to(DEV), idx.to(DEV), lens.to(DEV)]
    if extra:
        xcache = torch.full((N, D), float("nan"))
        xcache[[0, 19]] = torch.randn((2, D), generator=g)
        xidx = torch.tensor([[[19, 0, 2**31 - 1, -1, 3]]] * T, dtype=torch.int32)
        args += [xcache.to(DEV), xidx.to(DEV), torch.tensor([2, 2, 1], dtype=torch.int32, device=DEV)]
    out, lse = kernel(*args, block_n=16)
    ref_out, ref_lse = sparse_decode_attention_reference(*args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("sink", [False, True])
def test_zero_length_tokens(sink):
    c = dict(T=4, H=2, D=32, W=8, K=8, N=10, extra=True, sink=sink, p_bad=0.0, full=True, seed=5)
    args = build(c)
    args[3].zero_()
    args[6].zero_()
    out, lse = kernel(*args)
    assert (out == 0).all()
    want = args[7].expand(4, 1, 2) if sink else torch.full((4, 1, 2), float("-inf"), device=DEV)
    torch.testing.assert_close(lse, want)      # the sink alone: lse = sink, its mass carries no value
    # no tokens at all
    q, cache, idx, lens, xcache, xidx, xlens, attn_sink = args
    out, lse = kernel(q[:0], cache, idx[:0], lens[:0], xcache, xidx[:0], xlens[:0], attn_sink)
    assert out.shape == (0, 1, 2, 32) and lse.shape == (0, 1, 2)


@needs_kernel
def test_default_backend_is_triton_when_interpreting_or_on_cuda():
    c = dict(T=3, H=4, D=32, W=10, K=12, N=25, extra=True, sink=True, p_bad=0.2, full=False, seed=9)
    args = build(c)
    a, b = sparse_decode_attention(*args), kernel(*args)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------------------------
# the reference is the model's attention (models/deepseek_v4/attention.py)
# ----------------------------------------------------------------------------------------------
@MORE
@given(cases())
def test_reference_matches_model_sink_attention(c):
    args = build(c)
    q, pools = args[0], [args[1:4]] + ([args[4:7]] if c["extra"] else [])
    keys, valid = [], []
    for cache, idx, lens in pools:
        idx = idx[:, 0].long()
        ok = (torch.arange(idx.shape[1], device=DEV) < lens[:, None]) & (idx >= 0) & (idx < cache.shape[0])
        keys.append(cache[idx.clamp(0, cache.shape[0] - 1)])
        valid.append(ok)
    want_out, want_lse = sink_attention_lse(q[:, 0], torch.cat(keys, 1), torch.cat(valid, 1), args[7])
    out, lse = sparse_decode_attention_reference(*args)
    torch.testing.assert_close(out[:, 0], want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[:, 0], want_lse, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# argument errors name the argument
# ----------------------------------------------------------------------------------------------
def _base():
    c = dict(T=2, H=4, D=32, W=8, K=8, N=10, extra=True, sink=True, p_bad=0.0, full=True, seed=1)
    return dict(zip(["q", "swa_cache", "indices", "topk_length", "extra_cache", "extra_indices",
                     "extra_topk_length", "attn_sink"], build(c)))


BAD = [
    ("q", lambda a: a.update(q=a["q"].to(torch.int32))),
    ("q", lambda a: a.update(q=a["q"][:, 0])),
    ("q", lambda a: a.update(q=a["q"].expand(2, 2, 4, 32))),
    ("q", lambda a: a.update(q=a["q"].transpose(2, 3))),
    ("swa_cache", lambda a: a.update(swa_cache=a["swa_cache"].double())),
    ("swa_cache", lambda a: a.update(swa_cache=a["swa_cache"][:, :16])),
    ("swa_cache", lambda a: a.update(swa_cache=a["swa_cache"].to("meta"))),
    ("indices", lambda a: a.update(indices=a["indices"].long())),
    ("indices", lambda a: a.update(indices=a["indices"][:1])),
    ("indices", lambda a: a.update(indices=a["indices"].repeat(1, 1, 2)[..., ::2])),
    ("topk_length", lambda a: a.update(topk_length=a["topk_length"].long())),
    ("topk_length", lambda a: a.update(topk_length=a["topk_length"][None])),
    ("extra_indices", lambda a: a.update(extra_indices=None)),
    ("extra_cache", lambda a: a.update(extra_cache=None)),
    ("extra_cache", lambda a: a.update(extra_cache=a["extra_cache"].half())),
    ("extra_indices", lambda a: a.update(extra_indices=a["extra_indices"].long())),
    ("extra_topk_length", lambda a: a.update(extra_topk_length=a["extra_topk_length"][:1])),
    ("attn_sink", lambda a: a.update(attn_sink=a["attn_sink"].bfloat16())),
    ("attn_sink", lambda a: a.update(attn_sink=a["attn_sink"][:2])),
    ("sm_scale", lambda a: a.update(sm_scale=-1.0)),
    ("sm_scale", lambda a: a.update(sm_scale=float("nan"))),
    ("out", lambda a: a.update(out=torch.empty(2, 1, 4, 16, device=DEV))),
    ("out", lambda a: a.update(out=torch.empty(2, 1, 4, 32, device=DEV, dtype=torch.bfloat16))),
    ("backend", lambda a: a.update(backend="cuda")),
]


@pytest.mark.parametrize("fn", [sparse_decode_attention, sparse_decode_attention_reference])
@pytest.mark.parametrize("name,mutate", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_argument_errors_name_the_argument(fn, name, mutate):
    a = _base()
    mutate(a)
    if name == "backend" and fn is sparse_decode_attention_reference:
        pytest.skip("the reference takes no backend")
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}\b"):
        fn(**a)


@pytest.mark.skipif(HAS_CUDA or INTERPRETING, reason="only without CUDA and without the interpreter")
def test_triton_backend_refused_without_cuda_or_interpreter():
    with pytest.raises(ValueError, match="^backend"):
        sparse_decode_attention(**_base(), backend="triton")


def test_bench_refuses_cpu():
    with pytest.raises(RuntimeError, match="CUDA"):
        bench_sparse_decode(T=2, H=4, D=32, W=8, K=8, num_slots=16, dtype=torch.float32, device="cpu")


# ----------------------------------------------------------------------------------------------
# V4-Flash shape on the GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T,H,K,extra", [(64, 64, 512, True), (64, 64, 512, False),   # V4-Flash
                                         (256, 64, 512, True), (64, 128, 1024, True)],  # BLOCK_H=64 tiles
                         ids=["flash-c4a", "flash-swa", "flash-T256", "pro-c4a"])
def test_flash_shape_bf16_gpu(T, H, K, extra):
    c = dict(T=T, H=H, D=512, W=128, K=K, N=8192, extra=extra, sink=True, p_bad=0.05, full=False,
             seed=2)
    args = build(c, torch.bfloat16)
    out, lse = sparse_decode_attention(*args)
    ref_out, ref_lse = sparse_decode_attention_reference(*args)
    assert torch.isfinite(out.float()).all()
    rel = (out.float() - ref_out.float()).norm() / ref_out.float().norm()
    assert rel < 1e-2, f"relative Frobenius error {rel:.2e}"
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
