"""token_to_req: kernel == reference == DESIGN §4 ("Token → request") model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_index

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")  # Triton interpreter noise
from dsv4_index import reference

from helpers.slot_batches import DEVICE, POISON, batch_tensors, needs_triton, poisoned


def py_token_to_req(q_lens, T_out):
    out = [0] * T_out
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    for t in range(qsl[-1]):
        out[t] = next(b for b in range(len(q_lens)) if qsl[b] <= t < qsl[b + 1])
    return out


q_lists = st.lists(st.integers(0, 6), max_size=40)


def test_hand_example():
    qsl = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert reference.token_to_req(qsl, 7).tolist() == [0, 0, 2, 2, 2, 0, 0]


@given(q_lens=q_lists, pad=st.integers(0, 5))
def test_reference_matches_python_model(q_lens, pad):
    qsl, _ = batch_tensors(q_lens, [0] * len(q_lens))
    T = sum(q_lens) + pad
    got = reference.token_to_req(qsl, T, out=poisoned((T,), torch.int32, "cpu"))
    assert got.tolist() == py_token_to_req(q_lens, T)


@needs_triton
@settings(max_examples=15)
@given(q_lens=st.lists(st.integers(0, 40), max_size=300), pad=st.integers(0, 600))
def test_kernel_matches_reference(q_lens, pad):
    qsl, _ = batch_tensors(q_lens, [0] * len(q_lens), DEVICE)
    T = sum(q_lens) + pad
    res = []
    for backend in ("triton", "reference"):
        out = poisoned((T,), torch.int32, DEVICE)
        assert dsv4_index.token_to_req(qsl, T, out=out, backend=backend) is out
        res.append(out.cpu())
    assert torch.equal(res[0], res[1]) and not bool((res[0] == POISON).any())


@needs_triton
@pytest.mark.parametrize("q_lens", [[], [0], [1], [0, 0, 3], [5, 0, 0], [1] * 17])
def test_kernel_edge_batches(device, q_lens):
    qsl, _ = batch_tensors(q_lens, [0] * len(q_lens), device)
    T = sum(q_lens) + 3
    got = dsv4_index.token_to_req(qsl, T, backend="triton")
    assert got.dtype == torch.int32 and got.tolist() == py_token_to_req(q_lens, T)
    out = poisoned((T + 4,), torch.int32, device)  # out= longer than num_tokens: tail is 0
    dsv4_index.token_to_req(qsl, T, out=out, backend="triton")
    assert out.tolist() == py_token_to_req(q_lens, T + 4)


@pytest.mark.parametrize("backend", ["reference", None])
def test_value_errors(backend):
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    cases = [
        (dict(query_start_loc=torch.tensor([0, 3, 2], dtype=torch.int32)), "query_start_loc"),
        (dict(query_start_loc=torch.tensor([1, 3], dtype=torch.int32)), "query_start_loc"),
        (dict(query_start_loc=qsl.long()), "query_start_loc"),
        (dict(num_tokens=4), "num_tokens"),
        (dict(num_tokens=-1), "num_tokens"),
        (dict(out=torch.zeros(5, dtype=torch.int64)), "out"),
        (dict(out=torch.zeros(4, dtype=torch.int32)), "out"),
        (dict(num_tokens=None, out=torch.zeros(4, dtype=torch.int32)), "out"),
        (dict(out=torch.zeros(5, dtype=torch.int32, device="meta")), "out"),
    ]
    for kw, name in cases:
        args = dict(query_start_loc=qsl, num_tokens=5)
        args.update(kw)
        with pytest.raises(ValueError, match=name):
            dsv4_index.token_to_req(args.pop("query_start_loc"), args.pop("num_tokens"),
                                    backend=backend, **args)
    with pytest.raises(ValueError, match="backend"):
        dsv4_index.token_to_req(qsl, 5, backend="cuda")
