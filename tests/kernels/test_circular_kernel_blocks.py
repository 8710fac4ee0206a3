"""``kernel_block_size`` on a circular group (issue 28): a ring of one allocation block of ``capacity``
rows, stored as ``f = capacity // kernel_block_size`` kernel blocks ``b * f + j``. Row ``p = pos %
capacity`` then lives at ``bt[p // kb] * kb + p % kb`` -- the same physical slot as the one-block form
``b * capacity + p``. Every step of a scheduler trace is fed to both layouts (same block ids) and every
output of the ring channel must be equal; the reference, the per-op Triton path and the fused launch
must agree on the kernel-block layout (outputs poisoned before each build)."""

import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.testing.scheduler import ReferenceScheduler

from helpers.pipelines import HAS_TRITON, compare_step

FIELDS = ("slot_mapping", "tail_slot_mapping", "indices", "lens")


def test_layout_of_kernel_blocks():
    lay = DSV4Layout.from_config("tiny", max_model_len=512, circular={"c128_state": 32},
                                 kernel_block_size={"c128_state": 4})
    g = lay.group("c128_state")
    assert (g.kind, g.block_size, g.blocks_per_kv_block, g.alloc_block_size, g.ring_capacity, g.ring_blocks) == \
        ("circular", 4, 8, 32, 32, 8)
    assert g.columns(96) == (8, 8) and lay.channels["c128_state"].rows_per_block == 4
    with pytest.raises(ValueError, match=r"kernel_block_size\['c128_state'\] = 5 does not divide"):
        DSV4Layout.from_config("tiny", max_model_len=512, circular={"c128_state": 32},
                               kernel_block_size={"c128_state": 5})


@pytest.mark.slow  # pipeline trace in the interpreter
def test_kernel_blocks_equal_the_one_block_ring(device):
    kw = dict(max_model_len=512, mla_block_size=32, circular={"c128_state": 32, "swa": (24, 8)})
    lay = DSV4Layout.from_config("tiny", kernel_block_size={"c128_state": 4, "swa": 4}, **kw)
    plain = DSV4Layout.from_config("tiny", **kw)
    assert lay.group("swa").ring_blocks == 6 and plain.group("swa").ring_blocks == 3
    budget = 96
    pipes = {"reference": MetadataPipeline(lay, 4, budget, device, 3, backend="reference", validate=True)}
    if HAS_TRITON:
        pipes["triton"] = MetadataPipeline(lay, 4, budget, device, 3, fused=False, backend="triton", validate=True)
        pipes["fused"] = MetadataPipeline(lay, 4, budget, device, 3, fused=True, backend="triton", validate=True)
    base = MetadataPipeline(plain, 4, budget, device, 3, backend="reference", validate=True)
    # NOTE: the scheduler allocates blocks of the allocation size, the same for both layouts
    assert [g.alloc_block_size for g in lay.groups] == [g.alloc_block_size for g in plain.groups]
    sched = ReferenceScheduler(plain, 900, max_num_batched_tokens=budget, max_num_seqs=4, num_speculative_tokens=3,
                               seed=7)
    longest = 0
    for i, (step, views) in enumerate(sched.random_trace(14, 7, arrival_prob=0.6, prompt_len=(20, 200),
                                                         max_new_tokens=(2, 10))):
        pad = min(budget, step.total_tokens + 3)
        meta, _ = compare_step(pipes, step, pad_to=pad, tag=i)
        base.update(step, pad_to=pad)
        ref = base.build()
        longest = max([longest] + [v.num_scheduled_tokens for v in views])
        for name in ("c128_state", "swa"):
            for f in FIELDS:
                a, b = getattr(meta[name], f), getattr(ref[name], f)
                assert torch.equal(a.cpu(), b.cpu()), (i, name, f)
    assert longest > 32
