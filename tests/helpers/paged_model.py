"""The paged == dense harness of the small DSV4 attention (``models/deepseek_v4``): :func:`run_trace` drives a
reference-scheduler trace through MetadataPipeline metadata and paged caches (written and read only through that
metadata) and compares every token of every request with the dense forward of its sequence, for one layer of every
kind (:func:`layer_picks`); it returns what the trace exercised (preemptions, rejected drafts, prefix hits ...)."""

import random
import zlib

import torch

from dsv4_index.geometry import DSV4Layout
from dsv4_index.pipeline import MetadataPipeline
from dsv4_index.testing.scheduler import ReferenceScheduler, cache_writes
from models.deepseek_v4 import DSV4Attention, PagedCaches, init_weights, load_config

TOL = 1e-4
CFG = load_config("tiny")
MAX_LEN = 256
SPEC = 2

MLA_BLOCK = 32
_ROWS = {}


def _row(key) -> torch.Tensor:
    if key not in _ROWS:
        seed = zlib.crc32(repr(key).encode())
        _ROWS[key] = torch.randn(CFG.hidden_size, generator=torch.Generator().manual_seed(seed))
    return _ROWS[key]


def x_of(rid: str, length: int, draft: bool, keys=()) -> torch.Tensor:
    """Input rows of request ``rid`` at positions ``0..length-1``: real tokens, or draft tokens
    (a different x at the same positions). Deterministic in (request, position, draft); a prompt
    position in a block with a shared prefix key (``keys[j]`` of mla block j) takes that key's row."""
    rows = []
    for p in range(length):
        j = p // MLA_BLOCK
        owner = keys[j] if j < len(keys) else (rid, j)
        rows.append(_row((rid, p, "draft") if draft else (owner, p % MLA_BLOCK)))
    return torch.stack(rows) if rows else torch.zeros(0, CFG.hidden_size)


def layer_picks(cfg):
    """One layer of every kind of ``cfg``, ascending (a step runs a kv source before the layers sharing its
    caches): the first SWA-only layer, the first of each ratio and, on V4.1, the first layer of each ratio that
    reads its kv source's caches and the first that attends with an index source's top-k (with their sources)."""
    picks = {cfg.layer_ids("swa")[0]} | {cfg.compress_ratios.index(r) for r in cfg.ratios}
    for r in cfg.ratios:
        picks |= set([i for i, x in enumerate(cfg.compress_ratios) if x == r and cfg.kv_source(i) != i][:1])
        picks |= set([i for i, x in enumerate(cfg.compress_ratios)
                      if x == r and cfg.topk_source(i) not in (None, i)][:1])
    picks |= {cfg.topk_source(i) for i in picks} - {None}                 # NOTE: the sources a pick reads
    picks |= {cfg.kv_source(i) for i in picks} - {None}
    return sorted(picks)


def run_trace(seed, num_steps, *, num_blocks, budget, chunk, pad=3, prefix=False, prefix_prob=0.5,
              prompt_hi=90, circular=None, cfg=CFG, **layout_kw):
    """``cfg``: the model config (hidden size 64: ``tiny`` or ``tiny_v41``); ``layout_kw``: more
    ``DSV4Layout.from_config`` options (``groups="vllm"``, ``swa_group_per_layer=True`` ...)."""
    layout = DSV4Layout.from_config(cfg.to_dict(), MAX_LEN, mla_block_size=MLA_BLOCK, swa_block_size=4,
                                    indexer_causal_indices=True, circular=circular, **layout_kw)
    assert all(g.ring for g in layout.groups if g.kind == "sliding")
    sched = ReferenceScheduler(layout, num_blocks, max_num_batched_tokens=budget, max_num_seqs=5,
                               num_speculative_tokens=SPEC, long_prefill_threshold=chunk,
                               enable_prefix_caching=prefix, seed=seed)
    pipe = MetadataPipeline(layout, 8, 2 * budget + pad, "cpu", num_speculative_tokens=SPEC)
    models = {layer: init_weights(DSV4Attention(cfg, layer), 10 + layer).eval() for layer in layer_picks(cfg)}
    caches = PagedCaches(cfg, layout, num_blocks)
    rng = random.Random(seed)
    seen = dict(preempted=0, finished=0, rejected=0, split_group=0, replayed=0, hits=0, steps=0, writes=0)
    keys = {}  # rid -> content key of each full prompt block of the mla group (as the scheduler keeps)
    for _ in range(num_steps):
        if rng.random() < 0.5 and len(sched.waiting_req_ids) < 3:
            rid, plen = f"r{len(keys)}", rng.randint(1, prompt_hi)
            of, shared = None, 0
            if prefix and rng.random() < prefix_prob:
                of = rng.choice(list(keys) + ["sys0"])
                shared = rng.randint(0, plen) // MLA_BLOCK
            own = keys[of][:shared] if of in keys else [(of, j) for j in range(shared)]
            keys[rid] = own + [(rid, j) for j in range(len(own), plen // MLA_BLOCK)]
            sched.add_request(rid, plen, rng.randint(1, 12), prefix_of=of, prefix_len=shared * MLA_BLOCK)
        step = sched.schedule()
        views = {v.req_id: v for v in sched.batch_view(step)}
        accepted = sched.random_acceptance(step, rng)
        seen["preempted"] += len(step.preempted_req_ids)
        seen["finished"] += len(step.finished_req_ids)
        seen["hits"] += len(step.replay_end)
        if not views:
            sched.update_after_step(accepted)
            continue
        T = sum(step.num_scheduled_tokens.values())
        pipe.update(step, pad_to=T + pad)
        meta = pipe.build()
        # no write lands in a block another live request holds (the prefix owner's), nor in a foreign one
        writes = cache_writes(meta, sched.block_holders())
        bad = [w for w in writes if w.others or not w.owned]
        assert not bad, (seen["steps"], bad[:3])
        seen["writes"] += len(writes)
        qsl = meta.query_start_loc.tolist()
        # this step's x per request: real for computed / prompt / accepted tokens, draft for rejected
        x, dense_in = torch.zeros(T + pad, cfg.hidden_size), {}
        for b, rid in enumerate(meta.req_ids):
            v = views[rid]
            c, n = v.num_computed_tokens, v.num_scheduled_tokens
            assert qsl[b + 1] - qsl[b] == n
            real, draft = x_of(rid, c + n, False, keys[rid]), x_of(rid, c + n, True)
            keep = 1 + accepted.get(rid, n - 1) if v.is_decode else n  # tokens that stay real
            seq = torch.cat([real[:c + keep], draft[c + keep:]])
            if v.replay_start:  # bounded replay after a prefix hit: the prefix's rows come from its owner
                seq = torch.cat([x_of(rid, v.replay_start, False, keys[rid]), seq[v.replay_start:]])
            seen["rejected"] += n - keep
            seen["split_group"] += not v.is_decode and (c + n) % 4 != 0 and n < v.seq_len
            x[qsl[b]:qsl[b + 1]] = seq[c:]
            dense_in[rid] = seq
        x[T:] = float("nan")  # padded tokens: must give zeros and write nothing
        with torch.no_grad():
            for layer, m in models.items():
                y = m.forward_paged(x, meta, caches[layer], **m.paged_kwargs(models, x, meta, caches))
                assert torch.equal(y[T:], torch.zeros_like(y[T:])), (layer, "padded token output")
                for b, rid in enumerate(meta.req_ids):
                    v = views[rid]
                    # every token, replayed ones included: window lists start at replay_start
                    ref = m.forward_dense(dense_in[rid], window_floor=v.replay_start,
                                          **m.dense_kwargs(models, dense_in[rid]))[v.num_computed_tokens:]
                    if layer == layer_picks(cfg)[0]:
                        seen["replayed"] += max(0, min(v.seq_len, v.replay_end) - v.num_computed_tokens)
                    err = (y[qsl[b]:qsl[b + 1]] - ref).abs().amax(-1)
                    assert (err <= TOL).all(), (seen["steps"], layer, m.kind, rid, v, err.tolist())
        seen["steps"] += 1
        sched.update_after_step(accepted)
    return seen
