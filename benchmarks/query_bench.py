"""GPU time of a step whose source rows != query rows (issue 38 item 2, docs/DESIGN.md §5): V4.1-Flash, ``B``
requests joining with ``ctx`` computed tokens, each scheduling a chunk of ``chunk`` tokens (the compressor /
indexer source) of which the decoder queries the last ``q`` (``StepInput.query_lens``).

Arms, each a CUDA graph of the one fused launch (``k`` launches back to back, median per launch over
``--replays``; and one single-launch graph replay), two pipelines holding the same step (DESIGN §8):

* ``plain``: the step without the declaration (every token queries);
* ``declared``: the same step declaring ``q`` queries per request; ratio against ``plain`` (target <= 1.1);
* ``declared q=chunk``: declaring every token (the plain step again: the same launch), ratio against ``plain``;
* ``plain, no query code``: the plain step on a pipeline built without ``query_batches`` (its kernel compiles no
  query path; the three arms above opt in), ratio against ``plain``: the query paths' cost to a plain step.

    python benchmarks/query_bench.py [--B 1] [--chunk 2048] [--q 128] [--ctx 8192]
    python benchmarks/query_bench.py --smoke --chunk 64 --q 8 --ctx 40     # CPU, no timing: checks the outputs
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from bench_step import graph_time  # noqa: E402

from dsv4_index import DSV4Layout, MetadataPipeline, NewRequest, StepInput  # noqa: E402


def chunk_step(layout, B: int, ctx: int, chunk: int) -> StepInput:
    """``B`` new requests with ``ctx`` computed tokens, ``chunk`` scheduled each (blocks for every position)."""
    news, nxt = [], 1
    for i in range(B):
        lists = []
        for g in layout.groups:
            n = g.ring_blocks if g.kind == "circular" else -(-(ctx + chunk) // g.alloc_block_size)
            lists.append(list(range(nxt, nxt + n)))
            nxt += n
        news.append(NewRequest(f"r{i}", tuple(lists), ctx))
    return StepInput(new_requests=news, running_requests=[], num_scheduled_tokens={f"r{i}": chunk for i in range(B)})


def pipelines(layout, step: StepInput, q: int, budget: int, device: str, **kw):
    """{arm: (pipeline holding its step, meta)}: the plain step, declared with ``q`` and with ``chunk`` queries (on
    pipelines built with ``query_batches=True``), and the plain step on a pipeline without it."""
    out = {}
    n = next(iter(step.num_scheduled_tokens.values()))
    for arm, qq in (("plain", None), ("declared", q), ("declared q=chunk", n), ("plain, no query code", None)):
        s = step if qq is None else dataclasses.replace(step, query_lens={r: qq for r in step.num_scheduled_tokens})
        pipe = MetadataPipeline(layout, len(step.num_scheduled_tokens) + 1, budget, device, 0,
                                query_batches=arm != "plain, no query code", **kw)
        pipe.update(s)
        out[arm] = (pipe, pipe.build())
    return out


def check(arms) -> int:
    """The declared step's query rows == the plain step's rows at q_to_src, every query-side field (the
    definition, DESIGN §5); returns the query rows checked."""
    mp, md, mo = arms["plain"][1], arms["declared"][1], arms["plain, no query code"][1]
    for name in mp.channels:  # NOTE: the plain step: the same outputs with or without the query code
        for f in dataclasses.fields(mp[name]):
            a, b = getattr(mp[name], f.name), getattr(mo[name], f.name)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), (name, f.name)
    src = md.q_to_src[:md.num_query_tokens].long()
    for name, c in md.channels.items():
        fields = mp.builders[name].query_fields()
        for f in fields - {"decode_lens", "decode_lens_clamped"}:
            a, b = getattr(c, f), getattr(mp[name], f)
            if a is not None:
                assert torch.equal(a[:md.num_query_tokens], b[src]), (name, f)
        for f in ("slot_mapping", "compressed_slot_mapping", "tail_slot_mapping"):
            a, b = getattr(c, f), getattr(mp[name], f)
            if a is not None:
                assert torch.equal(a, b), (name, f)
    return md.num_query_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--q", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--max-model-len", type=int, default=1 << 16)
    ap.add_argument("--smoke", action="store_true", help="no timing: build the steps on the CPU and check them")
    args = ap.parse_args(argv)
    if not 1 <= args.q <= args.chunk:
        ap.error(f"--q must be in 1..--chunk ({args.chunk}), got {args.q}")
    dev = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA device (try --smoke --chunk 64 --q 8 --ctx 40)")
        return 2
    lay = DSV4Layout.from_config("v41_flash", 4096 if args.smoke else args.max_model_len)
    step = chunk_step(lay, args.B, args.ctx, args.chunk)
    budget = args.B * args.chunk
    kw = dict(backend="reference") if args.smoke else {}
    arms = pipelines(lay, step, args.q, budget, dev, **kw)
    n = check(arms)
    if args.smoke:
        print(f"smoke OK: V4.1-Flash B={args.B}, chunk {args.chunk}, q {args.q}, ctx {args.ctx}: {n} query rows "
              f"equal the plain step's rows at q_to_src")
        return 0
    res = {}
    for arm, (pipe, _) in arms.items():
        plan, st = pipe.fused_plan, pipe.stage_layout
        assert plan is not None and pipe.num_launches == 1
        res[arm] = graph_time(lambda plan=plan, st=st: plan.launch(st), args.k, args.replays)
    print(f"V4.1-Flash B={args.B}, chunk {args.chunk}, q {args.q}, ctx {args.ctx}, T_pad {budget} "
          f"({torch.cuda.get_device_name()}); {n} query rows checked against the plain step")
    for arm, (g, s1) in res.items():
        print(f"  {arm:<20} {g:8.2f} us graph  {s1:8.2f} us single")
    print(f"  declared / plain         = {res['declared'][0] / res['plain'][0]:.3f}x (target <= 1.1)")
    print(f"  declared q=chunk / plain = {res['declared q=chunk'][0] / res['plain'][0]:.3f}x")
    print(f"  plain, no query code / plain = {res['plain, no query code'][0] / res['plain'][0]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
