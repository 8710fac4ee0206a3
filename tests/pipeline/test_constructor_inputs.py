"""The constructor's and ``memory_estimate``'s answers to a bad device or layout (issue 39, cases 11 and 13): a
``ValueError`` / ``TypeError`` naming the argument, never torch's ``RuntimeError`` / ``AssertionError`` or an
``AttributeError``; and the Triton message names the extra."""

from __future__ import annotations

import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index._triton import MISSING_MESSAGE


def _lay():
    return DSV4Layout.from_config("tiny", 256)


# NOTE: ids: a test id "gpu" would mark it a GPU test (tests/conftest.py)
@pytest.mark.parametrize("dev", ["gpu", "foo", "cuda:x", "", "cpu:0:1"], ids=lambda d: f"name={d!r}")
def test_a_device_torch_cannot_parse_names_device(dev):
    for fn in (MetadataPipeline, MetadataPipeline.memory_estimate):
        with pytest.raises(ValueError, match=r"^device must be"):
            fn(_lay(), 4, 32, dev)


@pytest.mark.parametrize("dev", [3, None, torch.float32])
def test_a_device_of_another_type_names_device(dev):
    with pytest.raises(TypeError, match=r"^device must be a str or torch.device"):
        MetadataPipeline(_lay(), 4, 32, dev)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only torch")
def test_cuda_without_cuda_names_device_and_the_estimate_still_answers():
    with pytest.raises(ValueError, match=r"device='cuda'.*CUDA"):
        MetadataPipeline(_lay(), 4, 32, "cuda")
    assert MetadataPipeline.memory_estimate(_lay(), 4, 32, "cuda")["pinned"] > 0   # NOTE: planning on a CPU host


@pytest.mark.parametrize("layout", [None, "flash", {"groups": []}])
def test_a_layout_that_is_not_one_names_layout(layout):
    for fn in (MetadataPipeline, MetadataPipeline.memory_estimate):
        with pytest.raises(TypeError, match=r"^layout must be a DSV4Layout"):
            fn(layout, 4, 32)


def test_triton_message_names_the_extra():
    assert "pip install 'dsv4-index[triton]'" in MISSING_MESSAGE


@pytest.mark.parametrize("flag", ["fused", "validate", "cuda_graphs"])
def test_on_off_arguments_are_bools(flag):
    for fn in (MetadataPipeline, MetadataPipeline.memory_estimate):
        with pytest.raises(TypeError, match=rf"^{flag} must be a bool, got 'no'"):
            fn(_lay(), 4, 32, **{flag: "no"})
