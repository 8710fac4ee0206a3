"""Many requests (ten binary-search steps of the request lookup) with zero-length rows, leading and
trailing runs included: token_to_req / topk_to_slots kernels == reference."""

import random

import pytest
import torch

import dsv4_index
from dsv4_index import reference

from helpers.slot_batches import DEVICE, POISON, needs_triton, poisoned

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def many(B=600, seed=0, zero_frac=0.3, max_q=3):
    """(q_lens, ctx_lens): B requests, about ``zero_frac`` of them zero-length (runs included)."""
    rng = random.Random(seed)
    q = [0 if rng.random() < zero_frac else rng.randint(1, max_q) for _ in range(B)]
    q[:3] = [0, 0, 2]          # leading zero-length rows
    q[-4:] = [1, 0, 0, 0]      # trailing zero-length rows
    ctx = [rng.randint(0, 400) for _ in range(B)]
    return q, ctx


def tensors(q, ctx, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0] + torch.tensor(q).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor([c + n for c, n in zip(ctx, q)], dtype=torch.int32)
    bt = torch.randint(1, 1 << 20, (len(q) + 1, width), generator=g, dtype=torch.int32)
    return qsl.to(DEVICE), sl.to(DEVICE), bt.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("B,pad", [(600, 0), (600, 37), (1, 5), (0, 4)])
def test_token_to_req_many(B, pad):
    q, _ = many(B) if B > 4 else ([3] * B, None)
    qsl = torch.tensor([0] + torch.tensor(q, dtype=torch.long).cumsum(0).tolist(),
                       dtype=torch.int32, device=DEVICE)
    T = int(qsl[-1]) + pad
    got = dsv4_index.token_to_req(qsl, T, out=poisoned((T,), torch.int32, DEVICE), backend="triton")
    want = reference.token_to_req(qsl.cpu(), T)
    assert torch.equal(got.cpu(), want) and not bool((got == POISON).any())


@needs_triton
@pytest.mark.parametrize("K,compact", [(16, False), (16, True), (512, False), (512, True)])
@pytest.mark.slow  # ./dev quick skips it
def test_topk_to_slots_many(K, compact):
    q, ctx = many(600, seed=K + compact, max_q=2 if K == 512 else 3)
    if K == 512:  # NOTE: one program per token under the interpreter: keep the tokens few
        q = [min(v, 1) if i % 8 == 0 else 0 for i, v in enumerate(q)]
    qsl, sl, bt = tensors(q, ctx, width=32, seed=K)
    T = int(qsl[-1])
    g = torch.Generator().manual_seed(K)
    topk = torch.randint(-3, 130, (T + 2, K), generator=g, dtype=torch.int32).to(DEVICE)
    res = []
    for backend in ("triton", "reference"):
        out = poisoned((T + 2, K), torch.int32, DEVICE)
        lens = poisoned((T + 2,), torch.int32, DEVICE)
        dsv4_index.topk_to_slots(topk, qsl, sl, bt, 16, 4, compact=compact, out=out, out_lens=lens,
                                 backend=backend)
        res.append((out.cpu(), lens.cpu()))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert not bool((res[0][0] == POISON).any()) and int(res[0][1].sum()) > 0
