"""Quick GPU sanity check: the compiled fused launch (and top-k conversion) equals the PyTorch
reference pipeline, bit for bit, over reference-scheduler traces; then a first timing.

    python benchmarks/gpu_check.py            # CUDA
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --steps 1 --long-steps 0 --cases tiny
                                              # the suite's smoke: the interpreted kernels == the reference
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_index import DSV4Layout, MetadataPipeline  # noqa: E402
from dsv4_index.testing.scheduler import random_trace  # noqa: E402
from dsv4_index.validate import check_metadata, check_topk  # noqa: E402

FIELDS = ("slot_mapping", "compressed_slot_mapping", "compact_slot_mapping", "compact_cu", "indices", "lens", "ks",
          "ke", "cu", "decode_lens", "lens_clamped", "decode_lens_clamped")


def compare(layout, steps, *, seed, max_reqs, max_tokens, spec, validate_every=0, large_from=None, device="cuda",
            **trace_kw):
    gpu = MetadataPipeline(layout, max_reqs, max_tokens, device, spec)
    if large_from is not None:
        gpu.fused_plan.large_from = large_from  # NOTE: 1 = every step on the large-tile (whole-row) variant
    ref = MetadataPipeline(layout, max_reqs, max_tokens, "cpu", spec, backend="reference")
    gpu.warmup()
    K = layout.index_topk or 1
    n = 0
    for i, (step, _) in enumerate(random_trace(layout, steps, seed=seed, max_num_batched_tokens=max_tokens,
                                               max_num_seqs=max_reqs, num_speculative_tokens=spec, **trace_kw)):
        pad = min(max_tokens, step.total_tokens + (i % 5))
        gpu.update(step, pad_to=pad)
        ref.update(step, pad_to=pad)
        mg, mr = gpu.build(), ref.build()
        for name in ("query_start_loc", "seq_lens", "idx_mapping", "positions", "token_to_req", "is_valid_token"):
            assert torch.equal(getattr(mg, name).cpu(), getattr(mr, name)), (i, name)
        for ch in mg.channels:
            for f in FIELDS:
                a, b = getattr(mg[ch], f), getattr(mr[ch], f)
                assert (a is None) == (b is None), (i, ch, f)
                if a is not None:
                    assert torch.equal(a.cpu(), b), (i, ch, f, a, b)
        for g, (a, b) in enumerate(zip(gpu.tables.tables, ref.tables.tables)):
            assert torch.equal(a.cpu(), b), (i, "table", g)
        if "c4a" in mg:
            topk = torch.randint(-3, 64, (mg.num_tokens_padded, K), dtype=torch.int32)
            for compact in (False, True):
                a = mg.topk_to_slots("c4a", topk.to(device), compact=compact)
                b = mr.topk_to_slots("c4a", topk, compact=compact)
                assert torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].cpu(), b[1]), (i, "topk", compact)
        if validate_every and i % validate_every == 0:
            check_metadata(mg)
            if "c4a" in mg:
                check_topk(mg, "c4a", topk, *mg.topk_to_slots("c4a", topk.to(device)))
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--long-steps", type=int, default=6, help="steps of the flash case with 4K-token steps")
    ap.add_argument("--device", default="cuda", help="cpu: the Triton kernels in the interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--cases", default=None, help="comma-separated case names to run (default: every case)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: no CUDA device (on CPU: TRITON_INTERPRET=1 ... --device cpu)")
    t0 = time.time()
    tiny = DSV4Layout.from_config("tiny", max_model_len=1024, mla_block_size=16, swa_block_size=8,
                                  indexer_causal_indices=True)
    cases = [
        ("tiny", tiny, {}),
        ("tiny full tables + compact", DSV4Layout.from_config("tiny", max_model_len=1024, mla_block_size=16,
                                                              swa_block_size=8, sliding_tables="full",
                                                              compact_compressed=True), {}),
        ("tiny circular", DSV4Layout.from_config("tiny", max_model_len=1024, mla_block_size=16, swa_block_size=8,
                                                 circular={"c128_state": 64}), dict(long_prefill_threshold=32)),
        ("flash", DSV4Layout.from_config("flash", max_model_len=16384), {}),
        # NOTE: five groups, two SWA groups of one code: the large tiles fold them into one program
        ("flash vllm", DSV4Layout.from_config("flash", max_model_len=16384, groups="vllm"), {}),
    ]
    if args.cases is not None:
        cases = [c for c in cases if c[0] in args.cases.split(",")]
    for name, layout, kw in cases:
        for large_from, label in ((None, "default tiles"), (1, "large tiles forced")):
            flash = name.startswith("flash")
            n = compare(layout, args.steps, seed=1, max_reqs=8, max_tokens=256 if flash else 64, spec=1,
                        validate_every=10, num_blocks=4000 if flash else 96, large_from=large_from,
                        device=args.device, **kw)
            print(f"OK {name} ({label}): {n} steps, GPU fused == reference (outputs, tables, top-k)", flush=True)
    if args.long_steps:
        # NOTE: steps of up to 4096 tokens: T_pad crosses the variant threshold on its own
        flash = DSV4Layout.from_config("flash", max_model_len=65536)
        n = compare(flash, args.long_steps, seed=3, max_reqs=8, max_tokens=4096, spec=1, validate_every=0,
                    num_blocks=20000, device=args.device)
        print(f"OK flash 4K-token steps: {n} steps, GPU fused == reference", flush=True)
    print(f"gpu_check passed in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
