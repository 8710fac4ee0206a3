"""CUDA-graph contract on a real GPU (DESIGN §7, issue 13): ``update()`` and ``build()`` of a steady
step, and a top-k conversion, make no host sync (``set_sync_debug_mode("error")`` raises on one) and no
new CUDA allocation; the metadata's addresses do not move between steps."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["decode B=1", "decode B=256", "MTP 256x2", "prefill 8K"])
def test_no_sync_no_allocation(name):
    from workload import CASES, Workload

    from dsv4_index import DSV4Layout, MetadataPipeline
    layout = DSV4Layout.from_config("flash", max_model_len=131072)
    case = CASES[name]
    pipe = MetadataPipeline(layout, 1024, 8192, "cuda", case.q_decode - 1)
    pipe.warmup()
    wl = Workload(layout, case, seed=0)
    addresses = None
    topk = torch.full((8192, layout.index_topk), -1, dtype=torch.int32, device="cuda")
    for i in range(6):
        batch, _ = wl.next_step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        if i >= 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            pipe.update(batch)
            meta = pipe.build()
            meta.topk_to_slots("c4a", topk)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        if i >= 2:
            assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == before
            now = [meta.positions.data_ptr(), meta["swa"].indices.data_ptr(), meta["c128a"].indices.data_ptr(),
                   meta["c4i"].decode_lens.data_ptr(), meta.query_start_loc.data_ptr()]
            assert addresses is None or now == addresses
            addresses = now
