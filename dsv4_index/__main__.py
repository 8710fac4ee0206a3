"""Command line: ``python -m dsv4_index layout|demo``.

``layout`` prints the groups and channels derived from a DeepSeek-V4 config; ``demo`` builds and prints
the metadata of one sample DeepSeek-V4-Flash step (two decodes, one speculative decode, one prefill chunk).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"  # package data (dsv4_index.config.CONFIG_DIR)


def _config_path(name: str) -> str:
    p = Path(name)
    if p.suffix == ".json" or p.exists():
        return str(p)
    return str(CONFIGS / f"{name}.json")


def sample_step(layout, *, seed: int = 0):
    """One mixed step: 2 decodes (contexts 300 and 1000), 1 spec decode (2 tokens), one 40-token prefill chunk."""
    from .step import NewRequest, StepInput

    g = torch.Generator().manual_seed(seed)
    next_id = [1]

    def blocks(n_tokens):
        out = []
        for grp in layout.groups:
            n = -(-n_tokens // grp.alloc_block_size)
            ids = (torch.randperm(4000, generator=g)[:n] + next_id[0]).tolist()
            next_id[0] += 4000
            out.append(ids)
        return tuple(out)

    reqs = [("decode-a", 299, 1), ("decode-b", 999, 1), ("spec-c", 510, 2), ("prefill-d", 256, 40)]
    new = [NewRequest(rid, blocks(c + n), c) for rid, c, n in reqs]
    return StepInput(new_requests=new, running_requests=[], num_scheduled_tokens={r: n for r, _, n in reqs},
                     finished_req_ids=[], preempted_req_ids=[])


def demo(args) -> None:
    from . import DSV4Layout, MetadataPipeline

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        print("(CPU: functional ops run their PyTorch reference; set TRITON_INTERPRET=1 to run the Triton "
              "kernels in the interpreter)")
    layout = DSV4Layout.from_config(_config_path(args.config), max_model_len=args.max_model_len)
    print(layout)
    pipe = MetadataPipeline(layout, max_num_reqs=8, max_num_batched_tokens=64, device=device,
                            num_speculative_tokens=1)
    pipe.warmup()
    pipe.update(sample_step(layout), pad_to=48)
    meta = pipe.build()
    torch.set_printoptions(linewidth=140, threshold=200, edgeitems=4)
    print(f"\nstep: {meta.num_reqs} requests {meta.req_ids} (decode-first), {meta.num_tokens} tokens padded to "
          f"{meta.num_tokens_padded}; decodes {meta.num_decodes} ({meta.num_decode_tokens} tokens), "
          f"prefills {meta.num_prefills} ({meta.num_prefill_tokens} tokens)")
    print("query_start_loc", meta.query_start_loc.tolist(), " seq_lens", meta.seq_lens.tolist())
    print("positions      ", meta.positions.tolist())
    print("token_to_req   ", meta.token_to_req.tolist())
    show = [0, 1, 2, 3, meta.num_tokens - 1, meta.num_tokens]
    for name, ch in meta.channels.items():
        print(f"\n[{name}] gid {ch.gid}  R={ch.compress_ratio}  S={ch.rows_per_block}  block_size={ch.block_size}"
              f"  window={ch.window}")
        for field in ("slot_mapping", "compressed_slot_mapping", "lens", "ks", "ke", "cu", "decode_lens"):
            v = getattr(ch, field)
            if v is not None:
                print(f"  {field:24s}{list(v.shape)}  {v.flatten()[:48].tolist()}")
        if ch.indices is not None:
            print(f"  indices {list(ch.indices.shape)}: rows of tokens {show} (first 8 / last 2 columns of the row "
                  "prefix that holds entries)")
            for t in show:
                n = int(ch.lens[t]) if ch.lens is not None else 0
                row = ch.indices[t, :max(n, 1)].tolist()
                cut = row if len(row) <= 10 else row[:8] + ["..."] + row[-2:]
                print(f"    t={t:3d} len={n:5d}  {cut}")
    if "c4a" in meta:
        K = layout.index_topk
        topk = torch.full((meta.num_tokens_padded, K), -1, dtype=torch.int32, device=device)
        topk[:, :4] = torch.tensor([0, 3, 70, 10_000], dtype=torch.int32)
        slots, lens = meta.topk_to_slots("c4a", topk)
        print(f"\n[c4a] topk_to_slots of picks [0, 3, 70, 10000] (10000 is beyond every context): "
              f"token 0 -> {slots[0, :4].tolist()} len {int(lens[0])}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsv4_index", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("layout", "demo"):
        p = sub.add_parser(name)
        p.add_argument("--config", default="flash", help="flash | pro | tiny | path to a config.json")
        p.add_argument("--max-model-len", type=int, default=131072)
        p.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "layout":
        from . import DSV4Layout
        print(DSV4Layout.from_config(_config_path(args.config), max_model_len=args.max_model_len))
    else:
        demo(args)


if __name__ == "__main__":
    main()
