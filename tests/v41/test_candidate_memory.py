"""``memory_estimate`` counts V4.1's candidate buffers (issue 38 item 1's per-step buffers behind
``meta.candidate_blocks_to_physical`` / ``meta.candidate_topk_to_slots``) and the query-batch buffers (item 2): each
part equals the bytes the built pipeline's tensor holds (and the sizes written out here), and the buffers of the
context and the builders add up to what the pipeline holds."""

import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline

CANDIDATE = ("cand_phys", "cand_counts", "cand_flat", "cand_lens")
QUERY = ("query_start_loc_q", "token_to_req_q", "q_to_src")


@pytest.mark.parametrize("config,reqs,tokens", [("tiny_v41", 4, 96), ("v41_flash", 8, 256)])
def test_candidate_and_query_buffers_are_counted(config, reqs, tokens):
    lay = DSV4Layout.from_config(config, max_model_len=4096)
    C, nb = lay.candidate_block_size, lay.candidate_topk_blocks
    assert C and nb
    est = MetadataPipeline.memory_estimate(lay, reqs, tokens, "cpu", 1)
    pipe = MetadataPipeline(lay, reqs, tokens, "cpu", 1, backend="reference")
    parts = est["parts"]
    seen = 0
    for name, b in pipe.builders.items():
        if not hasattr(b, "cand_phys"):
            continue
        seen += 1
        K = max(1, lay.index_topk)
        # written out here: per token nb physical blocks, K consumer slots, one count and one length (int32)
        want = dict(cand_phys=4 * tokens * nb, cand_counts=4 * tokens, cand_flat=4 * tokens * K, cand_lens=4 * tokens)
        for f in CANDIDATE:
            t = getattr(b, f)
            held = t.numel() * t.element_size()
            assert parts[f"{name}.{f}"] == ("device", held) and held == want[f], (name, f)
    assert seen == sum(c.role == "c4a" for c in lay.channels.values()) >= 2
    for f in QUERY:
        t = getattr(pipe.ctx, f)
        assert parts[f"ctx.{f}"] == ("device", t.numel() * t.element_size()), f
    # every persistent tensor of the context and the builders, counted once, exactly
    held = sum(t.untyped_storage().nbytes() for t in _tensors(pipe))
    counted = sum(n for k, (w, n) in parts.items() if k.split(".")[0] in set(pipe.builders) | {"ctx"})
    assert counted == held, (counted, held)


def _tensors(pipe):
    """Every distinct persistent device tensor of the builders and the build context (shared ones once)."""
    seen, out = set(), []
    for d in [vars(pipe.ctx), pipe.ctx._shared] + [vars(b) for b in pipe.builders.values()]:
        for k, v in d.items():
            if isinstance(v, torch.Tensor) and k != "tables" and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                out.append(v)
    return out
