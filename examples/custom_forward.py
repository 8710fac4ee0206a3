"""The shortest wiring of DSV4Metadata into your own forward pass.

A minimal MQA-style attention (one KV head, key = value) over a sliding window plus C128A-style
compressed rows. It touches its paged caches ONLY through the metadata:

* ``meta["swa"].slot_mapping``            where each token writes its KV (int64 [T], -1 = no write)
* ``meta["swa"].indices / .lens``         which slots each token reads (int32 [T, W], oldest first)
* ``meta["c128a"].compressed_slot_mapping``  where a token that completes a compressed row writes it
* ``meta["c128a"].indices / .lens``       every compressed row a token may see (int32 [T, Wc])
* ``meta.topk_to_slots("c4a", topk)``     an indexer's request-local picks -> physical C4A slots

Two hand-written steps: two requests prefill, then one decodes and one decodes with a speculative token.
Writes go through ``index_copy_`` into a scratch row for ``-1`` slots (no data-dependent shape), so the
forward compiles with ``torch.compile(fullgraph=True)``; inside a compiled forward, convert top-k picks
with ``dsv4_index.torch_ops.topk_to_slots(meta, "c4a", topk)`` (a registered custom op).

    python examples/custom_forward.py [device] [--compile]   # default: cuda if available, else cpu
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # examples/_threads.py

import argparse

import torch

from dsv4_index import DSV4Layout, MetadataPipeline, NewRequest, RunningRequest, StepInput
from _threads import add_threads_option, set_threads  # examples/_threads.py

HIDDEN, HEADS, D = 64, 4, 32
NUM_BLOCKS = 64


def my_attention(x, meta, cache, w):
    """x float [T_pad, HIDDEN] (batch order of ``meta``) -> float [T_pad, HEADS * D]."""
    T = x.shape[0]
    q = (x @ w["q"]).view(T, HEADS, D)
    kv = x @ w["kv"]                                   # [T, D]: one KV head, key = value
    comp = x @ w["comp"]                               # stand-in for a compressor's pooled row
    swa, c128 = meta["swa"], meta["c128a"]
    ok = meta.is_valid_token                           # padded tokens write and read nothing

    # writes: raw KV of every token; a compressed row from each token that completes one; tokens
    # with slot -1 (padding, no completed row) write the scratch row at the end of the cache
    def write(rows, slots, vals):
        scratch = rows.shape[0] - 1
        rows.index_copy_(0, torch.where(ok & (slots >= 0), slots, scratch), vals)

    write(cache["swa"], swa.slot_mapping, kv)
    write(cache["c128"], c128.compressed_slot_mapping, comp)

    # reads: per-token key lists, -1 padded, first `lens` entries valid
    def gather(rows, idx, lens):
        valid = (torch.arange(idx.shape[1], device=idx.device) < lens[:, None]) & (idx >= 0)
        keys = torch.where(valid[..., None], rows[idx.clamp(min=0).long()], 0.0)
        return keys, valid                             # [T, N, D], [T, N]

    k_win, v_win = gather(cache["swa"], swa.indices, swa.lens)
    k_cmp, v_cmp = gather(cache["c128"], c128.indices, c128.lens)
    keys, valid = torch.cat([k_win, k_cmp], 1), torch.cat([v_win, v_cmp], 1)

    s = torch.einsum("thd,tnd->thn", q, keys) * D ** -0.5
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)           # rows with no key (padded tokens) -> 0
    return torch.einsum("thn,tnd->thd", p, keys).reshape(T, HEADS * D)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("device", nargs="?", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="run my_attention under torch.compile(fullgraph=True)")
    add_threads_option(ap)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    # the tiny DSV4 config shipped with the package: window 8, compress ratios 4 and 16, top-k 4
    layout = DSV4Layout.from_config("tiny", max_model_len=128, mla_block_size=32, swa_block_size=4)
    pipe = MetadataPipeline(layout, max_num_reqs=4, max_num_batched_tokens=64, device=device,
                            num_speculative_tokens=1)
    pipe.warmup()
    attention = my_attention
    if args.compile:
        attention = torch.compile(my_attention, fullgraph=True,
                                  backend="inductor" if device.type == "cuda" else "aot_eager")

    next_id = iter(range(1, NUM_BLOCKS))               # block 0 is the null block

    def blocks(n_tokens):                              # fresh block ids per group (mla, swa, c4_state, c128_state)
        return tuple([next(next_id) for _ in range(g.blocks_for(n_tokens))] for g in layout.groups)

    none = tuple([] for _ in layout.groups)
    steps = [
        StepInput(new_requests=[NewRequest("a", blocks(40), num_computed_tokens=0),
                                NewRequest("b", blocks(40), num_computed_tokens=0)],
                  running_requests=[], num_scheduled_tokens={"a": 20, "b": 35}),
        StepInput(new_requests=[],
                  running_requests=[RunningRequest("a", none, num_computed_tokens=20),
                                    RunningRequest("b", none, num_computed_tokens=35)],
                  num_scheduled_tokens={"a": 1, "b": 2}),  # a decodes; b decodes + 1 draft token
    ]

    w = {k: torch.randn(HIDDEN, n, device=device) / HIDDEN ** 0.5
         for k, n in (("q", HEADS * D), ("kv", D), ("comp", D))}
    rows = {name: NUM_BLOCKS * layout.channels[ch].rows_per_block for name, ch in (("swa", "swa"), ("c128", "c128a"))}
    # NaN: unwritten; one scratch row at the end takes the writes of slot -1
    cache = {name: torch.full((n + 1, D), float("nan"), device=device) for name, n in rows.items()}

    for i, step in enumerate(steps):
        T = step.total_tokens
        pipe.update(step, pad_to=-(-T // 8) * 8)       # pad like a CUDA-graph batch size
        meta = pipe.build()
        x = torch.randn(meta.num_tokens_padded, HIDDEN, device=device)
        before = {k: v.clone() for k, v in cache.items()} if args.compile else None
        out = attention(x, meta, cache, w)
        if args.compile:                               # the compiled forward equals eager, writes included
            ref = my_attention(x, meta, before, w)
            torch.testing.assert_close(out, ref)
            assert all(torch.equal(cache[k][:-1].nan_to_num(7.0), before[k][:-1].nan_to_num(7.0)) for k in cache)
            print(f"step {i}: compiled forward (fullgraph) == eager, max |diff| {float((out - ref).abs().max()):.1e}")
        assert torch.isfinite(out).all() and not out[T:].any()  # NaN-poisoned cache: no unwritten read

        topk = torch.full((meta.num_tokens_padded, layout.index_topk), -1, dtype=torch.int32, device=device)
        topk[:, :3] = torch.tensor([0, 1, 7], dtype=torch.int32)  # made-up indexer picks (request-local rows)
        slots, lens = meta.topk_to_slots("c4a", topk)

        print(f"step {i}: requests {meta.req_ids} ({meta.num_decodes} decodes first), tokens {T} padded to "
              f"{meta.num_tokens_padded}, query_start_loc {meta.query_start_loc.tolist()}, "
              f"seq_lens {meta.seq_lens.tolist()}")
        for name, t in [("swa.slot_mapping", meta["swa"].slot_mapping), ("swa.indices", meta["swa"].indices),
                        ("swa.lens", meta["swa"].lens),
                        ("c128a.compressed_slot_mapping", meta["c128a"].compressed_slot_mapping),
                        ("c128a.indices", meta["c128a"].indices), ("c128a.lens", meta["c128a"].lens),
                        ("topk_to_slots(c4a) slots", slots), ("topk_to_slots(c4a) lens", lens), ("output", out)]:
            print(f"  {name:30s} {str(tuple(t.shape)):10s} {t.dtype}")
        last = T - 1
        print(f"  last token (pos {int(meta.positions[last])}): window slots {meta['swa'].indices[last].tolist()}, "
              f"c128a row slots {meta['c128a'].indices[last, :int(meta['c128a'].lens[last])].tolist()}, "
              f"picks [0, 1, 7] -> c4a slots {slots[last, :3].tolist()} (len {int(lens[last])})")


if __name__ == "__main__":
    main()
