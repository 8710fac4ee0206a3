"""A serving trace through the reference scheduler, the MetadataPipeline and a paged tiny DeepSeek-V4
attention (one layer of each kind: swa, c4, c128), checked step by step against the dense model.

Every step: the scheduler decides (arrivals, chunked prefill, decodes with speculative tokens, partial
acceptance, preemption and resume, prefix-cache hits with bounded replay); ``pipeline.update`` (padded to
the next multiple of 8, like a CUDA-graph batch size) and ``build`` make the metadata; each layer's
``forward_paged`` writes and reads its paged caches only through that metadata; every valid token's
output is compared with ``forward_dense`` over its request's (accepted history ++ this step's inputs).

Bounded replay (docs/DESIGN.md §4): after a prefix-cache hit of N tokens the request is rescheduled from
``replay_start = N - W_max`` to rebuild its sliding-window and compressor-state caches; tokens below
``replay_end = N`` write nothing into the prefix-shared blocks. Replayed tokens are compared too, with
the dense model's sliding window floored at ``replay_start`` (what their window lists hold; their
compressed rows come from the shared blocks). Every cache write of every step (the metadata's slot
mappings) is checked against the scheduler's block ownership: none may land in a block that another
live request holds, nor in one the writer does not hold.

Sliding tables are rings (the default layout); ``--circular`` makes both compressor-state groups
circular (one block of ``capacity`` rows per request; the scheduler caps a request's tokens per step).

    python examples/sparse_decode_loop.py                 # 200 steps, reference backend on CPU
    python examples/sparse_decode_loop.py --validate      # + check_metadata every step
    python examples/sparse_decode_loop.py --circular      # circular c4_state / c128_state groups
    python examples/sparse_decode_loop.py --config tiny_v41   # DeepSeek-V4.1: ratio-2 (C2 ring) and ratio-1 layers
    python examples/sparse_decode_loop.py --groups vllm   # vLLM's group plan (two SWA sub-groups)
    python examples/sparse_decode_loop.py --groups per-layer  # one sliding group per layer (V4.1 engines)
    python examples/sparse_decode_loop.py --kernels       # CPU: Triton kernels in the interpreter (slow)

Exit code 1 when any output differs from dense by more than 1e-4, when a write lands in a block another
request holds (or the writer does not hold), or when an expected event did not happen.
"""

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # examples/_progress.py, _threads.py

import argparse
import random
import statistics
import tempfile
import time
import zlib

import torch  # NOTE: does not import triton; TRITON_INTERPRET is set below before anything does
from _progress import progress  # examples/_progress.py: tqdm on a terminal, plain lines otherwise
from _threads import add_threads_option, set_threads  # examples/_threads.py: --threads (default 1)

TOL = 1e-4
MAX_LEN = 192          # max_model_len of the tiny layout
MLA_BLOCK = 32         # mla group block size (c4a / c4i: 8 rows per block, c128a (R=16): 2)
SWA_BLOCK = 4          # swa group block size (window 8 spans 2-3 blocks)
NUM_BLOCKS = 56        # shared pool: small enough that long requests get preempted
BUDGET = 32            # max_num_batched_tokens per step
CHUNK = 16             # long_prefill_threshold: prompts are prefilled in chunks
SPEC = 2               # speculative tokens per decode
PAD = 8                # token count padded to a multiple of this
# --circular: capacity (rows per request) of each compressor-state group; window 8 (c4) and 16 (c128)
# -> at most min(16 - 8, 28 - 16) + 1 = 9 tokens of a request per step (prefill chunks of 9, not 16)
CIRCULAR = {"c4_state": 16, "c128_state": 28}
NUM_BLOCKS_CIRCULAR = 40  # a circular group holds one block per request: a smaller pool still preempts


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="trace, inputs and weights (default 0)")
    ap.add_argument("--steps", type=int, default=200, help="scheduler steps (default 200)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--validate", action="store_true", help="run dsv4_index.validate.check_metadata every step")
    ap.add_argument("--record", default=None, metavar="PATH",
                    help="write every step to a JSONL trace (replay: python -m dsv4_index replay PATH)")
    ap.add_argument("--circular", action="store_true",
                    help=f"circular compressor-state groups (capacities {CIRCULAR}) instead of ring tables")
    ap.add_argument("--config", choices=("tiny", "tiny_v41"), default="tiny",
                    help="tiny DeepSeek-V4 (swa, c4, c128 layers) or tiny DeepSeek-V4.1 (swa, ratio 2, ratio 1)")
    ap.add_argument("--groups", choices=("default", "vllm", "per-layer"), default="default",
                    help="group plan: one group per role, vLLM's (SWA sub-groups), or one sliding group per layer")
    ap.add_argument("--kernels", action="store_true",
                    help="on CPU: run the Triton kernels in the interpreter (TRITON_INTERPRET=1; slow) "
                         "instead of the PyTorch reference")
    add_threads_option(ap)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    return args


def pick_backend(args) -> str:
    """Set the environment before triton / dsv4_index are imported; return a description."""
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = dev
    if dev.startswith("cuda"):
        os.environ.pop("DSV4_INDEX_BACKEND", None)
        return "triton (CUDA)"
    if args.kernels:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["DSV4_INDEX_BACKEND"] = "triton"
        return "triton (CPU interpreter)"
    # NOTE: an inherited TRITON_INTERPRET=1 (e.g. from the test runner) would make every op interpret.
    os.environ["DSV4_INDEX_BACKEND"] = "reference"
    return "reference (PyTorch)"


class Inputs:
    """Deterministic hidden states. ``real(rid, n)``: rows of positions ``0..n-1`` of the request's real
    tokens; a prompt block shared through the prefix cache takes the rows of the block's content owner,
    so shared blocks hold identical KV. ``draft(rid, n)``: rejected-draft rows (different values)."""

    def __init__(self, hidden: int, seed: int, device):
        self.hidden, self.seed, self.device = hidden, seed, device
        self.keys = {}     # rid -> content key (owner, j) of each full prompt block of the mla group
        self._tables = {}

    def _table(self, name):
        if name not in self._tables:
            g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{name}".encode()))
            self._tables[name] = torch.randn(MAX_LEN, self.hidden, generator=g).to(self.device)
        return self._tables[name]

    def add(self, rid, prompt_len, prefix_of=None, prefix_len=0):
        shared = prefix_len // MLA_BLOCK
        own = self.keys[prefix_of][:shared] if prefix_of in self.keys else [(prefix_of, j) for j in range(shared)]
        self.keys[rid] = own + [(rid, j) for j in range(len(own), prompt_len // MLA_BLOCK)]

    def real(self, rid, n):
        keys = self.keys[rid]
        owners = [keys[p // MLA_BLOCK][0] if p // MLA_BLOCK < len(keys) else rid for p in range(n)]
        if all(o == rid for o in owners):
            return self._table(rid)[:n]
        return torch.stack([self._table(o)[p] for p, o in enumerate(owners)]) if n else self._table(rid)[:0]

    def draft(self, rid, n):
        return self._table(("draft", rid))[:n]


def make_trace(sched, inputs, steps, seed):
    """Scripted start (so every event shows up within ~30 steps), then random arrivals. Yields
    ``(step, views, accepted, holders)`` (``holders``: pool block -> running requests holding it, the
    ownership the step's writes must respect) and advances the scheduler after each."""
    rng = random.Random(seed)
    script = {
        0: [dict(req_id="a", prompt_len=80, max_new_tokens=10, prefix_of="sys", prefix_len=64),
            dict(req_id="b", prompt_len=24, max_new_tokens=30)],
        1: [dict(req_id="c", prompt_len=44, max_new_tokens=12)],
        # a's first 64 tokens are computed by now: d hits them (and replays the last window)
        7: [dict(req_id="d", prompt_len=90, max_new_tokens=8, prefix_of="a", prefix_len=64),
            dict(req_id="e", prompt_len=120, max_new_tokens=16)],
        # a burst of long prompts: the pool runs dry and someone is preempted
        10: [dict(req_id="f", prompt_len=150, max_new_tokens=20), dict(req_id="g", prompt_len=130, max_new_tokens=12)],
    }
    n = 0
    for i in range(steps):
        adds = list(script.get(i, ()))
        if i > max(script) and (rng.random() < 0.25 or not sched.has_unfinished()) \
                and len(sched.waiting_req_ids) < 3:
            new = rng.randint(1, 24)
            plen = rng.randint(1, 150 - new)
            kw = dict(req_id=f"r{n}", prompt_len=plen, max_new_tokens=new)
            n += 1
            if rng.random() < 0.3 and plen > MLA_BLOCK:  # share a prefix with an earlier request
                kw.update(prefix_of=rng.choice(sorted(inputs.keys)), prefix_len=rng.randint(MLA_BLOCK, plen))
            adds.append(kw)
        for kw in adds:
            sched.add_request(**kw)
            inputs.add(kw["req_id"], kw["prompt_len"], kw.get("prefix_of"), kw.get("prefix_len", 0))
        step = sched.schedule()
        views = sched.batch_view(step)
        accepted = sched.random_acceptance(step, rng)
        yield step, views, accepted, sched.block_holders()
        sched.update_after_step(accepted)


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = pick_backend(args)
    set_threads(args.threads)

    from dsv4_index import DSV4Layout, MetadataPipeline
    from dsv4_index.testing.scheduler import ReferenceScheduler, cache_writes
    from dsv4_index.specs import ratio_kinds
    from dsv4_index.validate import check_metadata
    from models.deepseek_v4 import DSV4Attention, PagedCaches, init_weights, load, load_config, save

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # NOTE: fp32 math on both sides of the comparison
        torch.backends.cudnn.allow_tf32 = False
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    cfg = load_config(args.config)
    circular = CIRCULAR if args.circular and args.config == "tiny" else None  # NOTE: V4.1's C2 ring is circular
    groups = dict(default={}, vllm=dict(groups="vllm"), **{"per-layer": dict(swa_group_per_layer=True)})[args.groups]
    layout = DSV4Layout.from_config(cfg.to_dict(), MAX_LEN, mla_block_size=MLA_BLOCK, swa_block_size=SWA_BLOCK,
                                    indexer_causal_indices=True, circular=circular, **groups)
    # one layer of each kind, labelled swa / c4 / c128 (V4) or swa / c1 / c2 (V4.1: by ratio), and on V4.1
    # the first layer of each ratio that reads its kv source's caches (c1_shared / c2_shared)
    kinds = {"swa": cfg.layer_ids("swa")[0],
             **{k.main[:-1]: cfg.compress_ratios.index(k.ratio) for k in ratio_kinds(cfg.compress_ratios)}}
    for k in ratio_kinds(cfg.compress_ratios):  # NOTE: V4.1 KV sharing: a layer reading its kv source's caches
        shared = [i for i, r in enumerate(cfg.compress_ratios) if r == k.ratio and cfg.kv_source(i) != i][:1]
        kinds.update({f"{k.main[:-1]}_shared": i for i in shared})
        reuse = [i for i, r in enumerate(cfg.compress_ratios)  # NOTE: V4.1 top-k reuse: a layer with no indexer
                 if r == k.ratio and cfg.topk_source(i) not in (None, i)][:1]
        kinds.update({f"{k.main[:-1]}_topk": i for i in reuse if i not in kinds.values()})
    assert all(cfg.topk_source(i) in (None, *kinds.values()) for i in kinds.values()), "a top-k source is not run"
    kinds = dict(sorted(kinds.items(), key=lambda kv: kv[1]))  # NOTE: a step runs a source before its sharers

    # weights from the seed, round-tripped through a safetensors file
    ref = torch.nn.ModuleDict({k: init_weights(DSV4Attention(cfg, i), args.seed * 1000 + i) for k, i in kinds.items()})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny_attention.safetensors")
        save(ref, path)
        size = os.path.getsize(path)
        models = load(torch.nn.ModuleDict({k: DSV4Attention(cfg, i) for k, i in kinds.items()}), path)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), models.parameters()))
    models = models.to(device).eval()
    by_layer = {i: models[k] for k, i in kinds.items()}  # NOTE: a layer's kv and index sources, by id
    print(f"{args.config} DSV4 attention: layers {kinds} (kind: layer id); weights seed {args.seed}, "
          f"safetensors round trip {size / 1024:.1f} KiB")
    print(f"device {device}, metadata backend: {backend}")
    print("groups: " + ", ".join(
        f"{g.name} ({g.kind}{', ring of %d blocks' % g.columns(BUDGET)[1] if g.ring else ''}"
        f"{', capacity %d' % g.block_size if g.kind == 'circular' else ''})" for g in layout.groups))

    num_blocks = NUM_BLOCKS_CIRCULAR if args.circular or args.config == "tiny_v41" else NUM_BLOCKS
    num_blocks += 24 * (sum(g.role == "swa" for g in layout.groups) - 1)  # NOTE: sub-groups hold blocks too
    sched = ReferenceScheduler(layout, num_blocks, max_num_batched_tokens=BUDGET, max_num_seqs=6,
                               num_speculative_tokens=SPEC, long_prefill_threshold=CHUNK,
                               enable_prefix_caching=True, seed=args.seed)
    capacity = -(-BUDGET // PAD) * PAD
    pipe = MetadataPipeline(layout, 8, capacity, device, num_speculative_tokens=SPEC)
    t_warm = time.perf_counter()
    pipe.warmup()
    t_warm = time.perf_counter() - t_warm
    cold = " (numba compiled the host passes: the first run after a checkout or a change to dsv4_index; later runs " \
        "load them from __pycache__)"
    print(f"warmup {t_warm:.1f} s" + (cold if t_warm > 3 else ""))
    recording = contextlib.ExitStack()
    if args.record:
        from dsv4_index.tools.trace import record_steps
        recording.enter_context(record_steps(pipe, args.record))  # NOTE: closed after the loop (the end line)
    caches = PagedCaches(cfg, layout, num_blocks, device=device)
    inputs = Inputs(cfg.hidden_size, args.seed, device)

    ev = dict(steps=0, tokens=0, padded=0, prefill_chunks=0, partial_chunks=0, decodes=0, spec_accepted=0,
              spec_rejected=0, preemptions=0, resumes=0, prefix_hits=0, replayed=0, finished=0, compared=0,
              checks=0, writes=0, shared_writes=0, unowned_writes=0)
    reqs, err = set(), {k: 0.0 for k in kinds}
    times = []
    bar = progress(args.steps)
    bad_writes = []
    for step, views, accepted, holders in make_trace(sched, inputs, args.steps, args.seed):
        ev["steps"] += 1
        ev["preemptions"] += len(step.preempted_req_ids)
        ev["resumes"] += sum(r.resumed for r in step.running_requests)
        ev["finished"] += len(step.finished_req_ids)
        # NOTE: a hit happens when a request enters the batch: new, or resumed after preemption
        ev["prefix_hits"] += sum(r.req_id in step.replay_start for r in step.new_requests) + sum(
            r.resumed and r.req_id in step.replay_start for r in step.running_requests)
        T = step.total_tokens
        Tp = min(max(-(-T // PAD) * PAD, PAD), capacity)
        sync()
        t0 = time.perf_counter()
        pipe.update(step, pad_to=Tp)
        meta = pipe.build()
        sync()
        times.append(time.perf_counter() - t0)
        if args.validate:
            check_metadata(meta, num_blocks=num_blocks)
            ev["checks"] += 1
        bar.update(1)
        if T == 0:
            continue
        # every cache write of the step vs the scheduler's ownership (prefix-shared blocks above all)
        for w in cache_writes(meta, holders):
            ev["writes"] += 1
            ev["shared_writes"] += bool(w.others)
            ev["unowned_writes"] += not w.owned
            if (w.others or not w.owned) and len(bad_writes) < 5:
                bad_writes.append((ev["steps"] - 1, w))
        ev["tokens"] += T
        ev["padded"] += Tp - T
        by_id = {v.req_id: v for v in views}
        qsl = meta.query_start_loc.tolist()
        x = torch.full((Tp, cfg.hidden_size), float("nan"), device=device)  # padded rows: NaN, must not leak
        dense_in = {}
        for b, rid in enumerate(meta.req_ids):
            v = by_id[rid]
            reqs.add(rid)
            c, n = v.num_computed_tokens, v.num_scheduled_tokens
            keep = 1 + accepted.get(rid, n - 1) if v.is_decode else n  # tokens that stay (real)
            if v.is_decode:
                ev["decodes"] += 1
                ev["spec_accepted"] += keep - 1
                ev["spec_rejected"] += n - keep
            else:
                ev["prefill_chunks"] += 1
                ev["partial_chunks"] += v.seq_len < sched.req_state(rid).prompt_len
            seq = torch.cat([inputs.real(rid, c + keep), inputs.draft(rid, c + n)[c + keep:]])
            x[qsl[b]:qsl[b + 1]] = seq[c:]
            dense_in[rid] = seq
        with torch.no_grad():
            for kind, m in models.items():
                y = m.forward_paged(x, meta, caches[kinds[kind]], **m.paged_kwargs(by_layer, x, meta, caches))
                e = y[T:].abs().amax().item() if Tp > T else 0.0  # padded tokens must give zeros
                for b, rid in enumerate(meta.req_ids):
                    v = by_id[rid]
                    # NOTE: bounded replay after a prefix hit: window lists start at replay_start at the
                    # earliest (an engine discards the outputs of the replayed tokens, but they are
                    # defined: the dense model with the same floor; no token after them reaches it)
                    ref_y = m.forward_dense(dense_in[rid], window_floor=v.replay_start,
                                            **m.dense_kwargs(by_layer, dense_in[rid]))[v.num_computed_tokens:]
                    d = (y[qsl[b]:qsl[b + 1]] - ref_y).abs()
                    e = max(e, torch.nan_to_num(d, nan=float("inf")).amax().item() if d.numel() else 0.0)
                    if kind == "swa":
                        ev["replayed"] += max(0, min(v.seq_len, v.replay_end) - v.num_computed_tokens)
                        ev["compared"] += v.num_scheduled_tokens
                err[kind] = max(err[kind], e)
        bar.set_postfix_str(f"reqs {len(reqs)} max|err| {max(err.values()):.1e}")
    bar.close()
    recording.close()

    ms = sorted(t * 1e3 for t in times)
    p90 = ms[min(len(ms) - 1, int(round(0.9 * (len(ms) - 1))))]
    rows = [
        ("steps", ev["steps"]), ("tokens (valid / padding)", f"{ev['tokens']} / {ev['padded']}"),
        ("requests seen / finished", f"{len(reqs)} / {ev['finished']}"),
        ("prefill chunks (partial)", f"{ev['prefill_chunks']} ({ev['partial_chunks']})"),
        ("decodes", ev["decodes"]),
        ("spec tokens accepted / rejected", f"{ev['spec_accepted']} / {ev['spec_rejected']}"),
        ("preemptions / resumes", f"{ev['preemptions']} / {ev['resumes']}"),
        ("prefix hits (replayed tokens)", f"{ev['prefix_hits']} ({ev['replayed']})"),
        ("tokens compared with dense (replayed included)", ev["compared"]),
        ("cache writes checked", ev["writes"]),
        ("writes into blocks held by another request", ev["shared_writes"]),
        ("writes into blocks the writer does not hold", ev["unowned_writes"]),
        ("check_metadata passes", ev["checks"] if args.validate else "off (--validate)"),
        ("metadata backend", backend),
        ("state groups", ", ".join(sorted({"circular" if g.kind == "circular" else "sliding (ring tables)"
                                           for g in layout.groups if g.role not in ("mla", "swa")})) or "none"),
        ("groups", f"{layout.num_groups} ({args.groups})"),
        ("update+build ms median / p90", f"{statistics.median(ms):.3f} / {p90:.3f}"),
    ] + [(f"max |paged - dense| {k} (layer {kinds[k]})", f"{err[k]:.2e}") for k in kinds]
    w = max(len(k) for k, _ in rows)
    print("\nsummary")
    print("-" * (w + 24))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("-" * (w + 24))

    ok = True
    if max(err.values()) > TOL or any(e != e for e in err.values()):
        print(f"FAIL: max |paged - dense| {max(err.values()):.2e} > {TOL:g}")
        ok = False
    if ev["shared_writes"] or ev["unowned_writes"]:
        print(f"FAIL: {ev['shared_writes']} writes into blocks held by another request, "
              f"{ev['unowned_writes']} into blocks the writer does not hold; first ones:")
        for i, w in bad_writes:
            print(f"  step {i}: {w}")
        ok = False
    want = dict(partial_chunks="chunked prefill", decodes="decode", spec_accepted="spec tokens accepted",
                spec_rejected="spec tokens rejected", preemptions="preemption", resumes="resume",
                prefix_hits="prefix-cache hit", replayed="replayed tokens")
    missing = [name for key, name in want.items() if ev[key] == 0]
    if missing:
        msg = f"events that did not happen in {ev['steps']} steps: {', '.join(missing)}"
        print(("FAIL: " if ev["steps"] >= 30 else "note: ") + msg)
        ok = ok and ev["steps"] < 30
    else:
        print("events seen: " + ", ".join(want.values()))
    if ok:
        print(f"OK: paged == dense within {TOL:g} for every token (replayed ones included) of every layer "
              f"kind; no write into a block another request holds")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
