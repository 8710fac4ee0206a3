"""Each consumer format read the way its consumer reads it (consumers.md §2, §3, §6).

Random keys are written into PAGED caches (``[blocks, page, D]``, NaN until written) through the
metadata's slot mappings; plain-PyTorch emulations of FlashMLA's sparse decode (two pools, one
softmax with the sink), DeepGEMM's ``fp8_paged_mqa_logits`` (fp32 semantics) and FlashMLA's sparse
prefill over a gathered workspace read them through the consumer views only, and must equal attention
(or logits) computed DIRECTLY from each token's position and its request's content (fp64). A key's
content is a function of (request, position), positions in shared prefix blocks taking the owner's
content, so prefix hits read rows another request wrote. Any read of an unwritten row is NaN.
"""

import random
import zlib

import pytest
import torch

from dsv4_index._common import round_up
from dsv4_index.consumers import (gather_workspace, prefill_chunk, prefill_chunks,
                                  prefill_workspace_size)
from dsv4_index.geometry import DSV4Layout
from dsv4_index.pipeline import MetadataPipeline
from dsv4_index.testing.scheduler import ReferenceScheduler
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput
from models.deepseek_v4.sparse_decode import sparse_decode_attention

MAX_LEN, MLA_BLOCK, SPEC, H, D, HI, DI = 256, 32, 1, 4, 16, 2, 8
DT, TOL, SCALE = torch.float64, 1e-12, D ** -0.5
LAYOUT = DSV4Layout.from_config("tiny", MAX_LEN, mla_block_size=MLA_BLOCK, swa_block_size=4)
W, R4, R128, K = LAYOUT.sliding_window, LAYOUT.c4_ratio, LAYOUT.c128_ratio, LAYOUT.index_topk
KINDS = {"swa": None, "c4": "c4a", "c128": "c128a"}
NAN = float("nan")


# ----------------------------------------------------------------------------------------------
# the consumers, emulated in plain PyTorch (they see only their arguments)
# ----------------------------------------------------------------------------------------------
def _softmax_sink(q, keys, ok, sink):
    """q [T, H, D], keys [T, N, D], ok [T, N] -> [T, H, D]; one softmax with a per-head sink logit."""
    keys = torch.where(ok[..., None], keys, 0.0)
    s = (torch.einsum("thd,tnd->thn", q, keys) * SCALE).masked_fill(~ok[:, None, :], float("-inf"))
    p = torch.softmax(torch.cat([s, sink.expand(q.shape[0], -1)[..., None]], -1), -1)[..., :-1]
    return torch.einsum("thn,tnd->thd", p, keys)


def _pool(cache, idx, length):
    """Entries ``j < length`` with ``0 <= slot < blocks * page`` of ``idx [b, width]``, read from the
    page ``slot // page``, row ``slot % page`` of ``cache [blocks, page, 1, D]``."""
    assert idx.dtype == torch.int32 and idx.stride(-1) == 1 and length.dtype == torch.int32
    assert length.shape == idx.shape[:1], "topk_length must be [b]"
    blocks, page = cache.shape[:2]
    i = idx.long()
    ok = (torch.arange(i.shape[1])[None] < length[:, None]) & (i >= 0) & (i < blocks * page)
    s = torch.where(ok, i, 0)
    return cache[s // page, s % page, 0], ok


def flashmla_sparse_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache=None,
                           extra_indices_in_kvcache=None, extra_topk_length=None):
    """``flash_mla_with_kvcache`` sparse mode: q [b, 1, H, D]; lists [b, 1, width] int32."""
    assert q.shape[1] == 1 and indices.shape[:2] == (q.shape[0], 1)
    keys, ok = _pool(k_cache, indices[:, 0], topk_length)
    if extra_k_cache is not None:
        assert extra_indices_in_kvcache.shape[:2] == (q.shape[0], 1)
        k2, ok2 = _pool(extra_k_cache, extra_indices_in_kvcache[:, 0], extra_topk_length)
        keys, ok = torch.cat([keys, k2], 1), torch.cat([ok, ok2], 1)
    return _softmax_sink(q[:, 0], keys, ok, attn_sink)


def flash_mla_sparse_fwd(q, kv, indices, attn_sink, topk_length):
    """q [s_q, H, D], kv [s_kv, 1, D], indices [s_q, 1, topk] int32 (invalid: -1 or >= s_kv)."""
    assert indices.dtype == torch.int32 and topk_length.dtype == torch.int32 and kv.shape[1] == 1
    i = indices[:, 0].long()
    ok = (torch.arange(i.shape[1])[None] < topk_length[:, None]) & (i >= 0) & (i < kv.shape[0])
    return _softmax_sink(q, kv[torch.where(ok, i, 0), 0], ok, attn_sink)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len):
    """DeepGEMM's paged MQA logits in fp32 semantics: q [B, next_n, H, D], kv_cache [blocks, block_kv,
    1, D], weights [B * next_n, H], context_lens [B, next_n] int32 (2-D, contiguous), block_table [B,
    max_blocks] int32. Row ``b * next_n + j``, column ``k < context_lens[b, j]``: ``sum_h w_h relu(q_h .
    K[k])`` with ``K[k]`` at page ``block_table[b, k // block_kv]``, row ``k % block_kv``; other
    columns are garbage (NaN here), so the caller must mask by length."""
    B, n, _, _ = q.shape
    assert context_lens.dim() == 2 and context_lens.is_contiguous() and context_lens.dtype == torch.int32
    assert context_lens.shape == (B, n) and block_table.stride(1) == 1 and block_table.shape[0] == B
    bkv = kv_cache.shape[1]
    k = torch.arange(max_context_len)
    ok = k[None, None] < context_lens[..., None].long()                       # [B, n, C]
    blk = torch.where(ok, k // bkv, 0).clamp(max=block_table.shape[1] - 1)
    page = block_table.long()[torch.arange(B)[:, None, None], blk]
    keys = kv_cache[page, k % bkv, 0]                                         # [B, n, C, D]
    s = torch.relu(torch.einsum("bnhd,bncd->bnhc", q, keys))
    logits = torch.einsum("bnh,bnhc->bnc", weights.view(B, n, -1), s)
    return torch.where(ok, logits, NAN).reshape(B * n, max_context_len)


# ----------------------------------------------------------------------------------------------
# content (independent of the metadata) and paged caches written through the slot mappings
# ----------------------------------------------------------------------------------------------
_VEC = {}


def vec(*key, dim=D):
    if key not in _VEC:
        g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
        _VEC[key] = torch.randn(dim, generator=g, dtype=DT)
    return _VEC[key]


class Content:
    """Keys of request ``rid`` at position ``p`` / compressed row ``j``; a position in a shared
    prefix block (mla group) takes the prefix owner's key."""

    def __init__(self):
        self.blocks = {}

    def add(self, rid, prefix_of=None, prefix_len=0):
        self.blocks[rid] = [self.block(prefix_of, j) for j in range(prefix_len // MLA_BLOCK)]

    def block(self, rid, j):
        bl = self.blocks.get(rid, [])
        return bl[j] if j < len(bl) else (rid, j)

    def key(self, rid, p):
        return self.block(rid, p // MLA_BLOCK), p % MLA_BLOCK

    def raw(self, rid, p):
        return vec("kv", self.key(rid, p))

    def row(self, kind, rid, j, dim=D):  # a row is keyed by its last position (its span is older)
        return vec(kind, self.key(rid, (j + 1) * LAYOUT.channels[kind].compress_ratio - 1), dim=dim)


class Caches:
    def __init__(self, layout, num_blocks):
        rows = {n: c.rows_per_block for n, c in layout.channels.items()}
        self.t = {n: torch.full((num_blocks, rows[n], 1, DI if n == "c4i" else D), NAN, dtype=DT)
                  for n in ("swa", "c4a", "c4i", "c128a") if n in rows}

    def write(self, meta, tok, content):
        """Every write of the step, through the metadata's slot mappings (the token's key at its
        position; compressed rows at the token that completes them)."""
        for name, cache in self.t.items():
            ch = meta[name]
            sm = (ch.slot_mapping if name == "swa" else ch.compressed_slot_mapping)[:len(tok)].tolist()
            flat = cache.view(-1, cache.shape[-1])
            for (rid, pos, _), s in zip(tok, sm, strict=True):
                if s >= 0:
                    if name == "swa":
                        flat[s] = content.raw(rid, pos)
                    else:
                        assert (pos + 1) % ch.compress_ratio == 0, (name, pos)
                        flat[s] = content.row(name, rid, pos // ch.compress_ratio, cache.shape[-1])


def dense_keys(content, kind, rid, pos, floor, picks=()):
    """Keys a token sees, straight from positions: its window ``[max(pos - W + 1, floor, 0), pos]``
    and its compressed rows (c128: all ``(pos + 1) // R``; c4: the valid picks)."""
    keys = [content.raw(rid, p) for p in range(max(pos - W + 1, floor, 0), pos + 1)]
    if kind == "c128":
        keys += [content.row("c128a", rid, j) for j in range((pos + 1) // R128)]
    elif kind == "c4":
        keys += [content.row("c4a", rid, j) for j in picks if 0 <= j < (pos + 1) // R4]
    return torch.stack(keys)


def dense_out(q, keys, sink):
    """q [n, H, D], keys: n tensors [N_i, D] -> [n, H, D] (one batched softmax with the sink)."""
    pad = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)
    ok = torch.arange(pad.shape[1])[None] < torch.tensor([k.shape[0] for k in keys])[:, None]
    return _softmax_sink(q, pad, ok, sink)


def random_picks(rng, vis):
    """A request-local top-k row: distinct visible rows first, some garbage, ``-1`` padded; a
    valid-looking id past the first ``min(vis, K)`` columns must be ignored by the prefill view."""
    row = rng.sample(range(vis), min(vis, K)) + [-1] * max(K - vis, 0)
    if vis and rng.random() < 0.3:
        row[rng.randrange(min(vis, K))] = rng.choice([-1, vis, vis + 7, -5])
    if 0 < vis < K:
        row[vis] = 0
    return row


# ----------------------------------------------------------------------------------------------
# one step: writes, then every consumer
# ----------------------------------------------------------------------------------------------
def indexer_logits(meta, tok, caches, content, g, lens="decode_lens"):
    """DeepGEMM paged MQA logits of the decode tokens, fed by ``meta["c4i"].<lens>`` and the decode
    requests' table rows; checks the lengths (right-aligned) and the visible logits against dense
    ones. Yields (token, logits row, visible rows) per decode token."""
    c4i, n, nd, qsl = meta["c4i"], meta.next_n, meta.num_decodes, meta.host_query_start_loc
    qi = torch.full((nd, n, HI, DI), NAN, dtype=DT)  # empty (left) rows stay NaN
    wi = torch.randn(nd * n, HI, generator=g, dtype=DT)
    where = [(t, b, n - int(qsl[b + 1] - qsl[b]) + i)  # (token, batch row, right-aligned row)
             for b in range(nd) for i, t in enumerate(range(qsl[b], qsl[b + 1]))]
    for _t, b, j in where:
        qi[b, j] = torch.randn(HI, DI, generator=g, dtype=DT)
    bt = c4i.block_table[meta.idx_mapping[:nd].long()]        # slot-indexed table -> batch rows
    ctx = getattr(c4i, lens)
    max_ctx = int(meta.host_seq_lens[:nd].max()) // R4       # host-known, no sync
    logits = fp8_paged_mqa_logits(qi, caches.t["c4i"], wi, ctx, bt, max(max_ctx, int(ctx.max())))
    real = torch.zeros(nd, n, dtype=torch.bool)
    for t, b, j in where:
        rid, pos, _ = tok[t]
        vis = (pos + 1) // R4
        real[b, j] = True
        assert int(ctx[b, j]) == (max(vis, 1) if lens.endswith("clamped") else vis), (lens, t, b, j)
        keys = torch.stack([content.row("c4i", rid, r, DI) for r in range(vis)] + [torch.zeros(DI, dtype=DT)])
        keys = keys[:vis]
        ref = (wi[b * n + j, :, None] * torch.relu(qi[b, j] @ keys.T)).sum(0)
        assert torch.allclose(logits[b * n + j, :vis], ref, rtol=0, atol=TOL), (lens, t)
        yield t, logits[b * n + j], vis
    assert (ctx[~real] == (1 if lens.endswith("clamped") else 0)).all(), (lens, ctx)  # empty rows


def check_decode(meta, tok, caches, content, q, sink, picks, rng, seen):
    """FlashMLA sparse decode fed only by ``meta.sparse_decode_args`` (unpadded and padded), for every
    layer kind; a few steps also run the Triton kernel of models/deepseek_v4 on the same views."""
    T, Tp, Td = meta.num_tokens, meta.num_tokens_padded, meta.num_decode_tokens
    for kind, ch in KINDS.items():
        # NOTE: compact=True: FlashMLA reads only the first extra_topk_length entries
        topk = meta.topk_to_slots("c4a", picks, compact=True) if kind == "c4" else None
        ref = dense_out(q[:Td], [dense_keys(content, kind, *tok[t], picks[t].tolist()) for t in range(Td)],
                        sink)
        for padded in (False, True):
            args = meta.sparse_decode_args(kind, topk, padded=padded)
            n = Tp if padded else Td
            assert args["indices"].shape[:2] == (n, 1)
            extra = {} if ch is None else dict(extra_k_cache=caches.t[ch],
                                               extra_indices_in_kvcache=args["extra_indices"],
                                               extra_topk_length=args["extra_topk_length"])
            out = flashmla_sparse_decode(q[:n, None], caches.t["swa"], args["indices"],
                                         args["topk_length"], sink, **extra)
            bad = torch.nonzero(~((out[:Td] - ref).abs().amax((1, 2)) <= TOL))[:, 0]
            assert not len(bad), (kind, padded, [tok[t] for t in bad])
            if padded and T == Td:  # a decode-only step: padded rows are -1 with length 0
                for name in ("indices", "extra_indices", "topk_length", "extra_topk_length"):
                    if args[name] is not None:
                        assert (args[name][T:] == (0 if name.endswith("length") else -1)).all(), name
                assert (out[T:] == 0).all()
                seen["padded_decode"] += Tp > T
        if seen["kernel"] < 6 and rng.random() < 0.5:
            args = meta.sparse_decode_args(kind, topk)
            flat = {n: c.view(-1, D).float() for n, c in caches.t.items() if n != "c4i"}
            xs = (flat[ch], args["extra_indices"], args["extra_topk_length"]) if ch else (None,) * 3
            o, _ = sparse_decode_attention(q[:Td, None].float(), flat["swa"], args["indices"],
                                           args["topk_length"], *xs, sink.float(), sm_scale=SCALE)
            assert torch.allclose(o[:, 0].double(), ref, rtol=0, atol=1e-5), kind
            seen["kernel"] += 1
        seen["decode_tokens"] += Td


def check_prefill(meta, views, tok, caches, content, q, sink, picks, rng, seen):
    """FlashMLA sparse prefill over each chunk's workspace, gathered from the pages by the plan."""
    nd, per_chunk = meta.num_decodes, rng.choice([1, 2])
    L = {r: views[r].seq_len for r in meta.req_ids[nd:]}
    g = {r: views[r].num_scheduled_tokens + min(views[r].num_computed_tokens, W - 1) for r in L}
    for kind, ch in KINDS.items():
        R, Kc = {"swa": (0, 0), "c4": (R4, K), "c128": (R128, meta["c128a"].indices.shape[1])}[kind]
        chunks = prefill_chunks(meta, kind, picks if kind == "c4" else None, chunk_reqs=per_chunk)
        assert len(chunks) == -(-meta.num_prefills // per_chunk)
        for c in chunks:
            toks, rids = tok[c.tok_start:c.tok_end], meta.req_ids[c.req_start:c.req_end]
            N = max(L.values()) // R if R else 0
            assert (c.N, c.M) == (N, N + max(g.values())), kind
            assert c.indices.shape == (len(toks), 1, round_up(Kc + W, 128))
            assert c.indices.dtype == c.topk_length.dtype == torch.int32
            n_c = [min((p + 1) // R, Kc) if R else 0 for _, p, _ in toks]
            n_w = [p + 1 - max(p - W + 1, f, 0) for _, p, f in toks]
            assert c.topk_length.tolist() == [x + y for x, y in zip(n_c, n_w, strict=True)], kind
            past = torch.arange(c.indices.shape[2])[None] >= c.topk_length[:, None]
            assert (c.indices[:, 0][past] == -1).all()
            ws = torch.full((c.num_reqs, c.M, D), NAN, dtype=DT)  # the engine's gather, page by page
            for b, rid in enumerate(rids):
                for base, slots, cache in ((0, c.comp_slots[b], caches.t.get(ch)),
                                           (c.N, c.raw_slots[b], caches.t["swa"])):
                    for r, s in enumerate(slots.tolist()):
                        if s >= 0:
                            ws[b, base + r] = cache[s // cache.shape[1], s % cache.shape[1], 0]
                assert int((c.comp_slots[b] >= 0).sum()) == (L[rid] // R if R else 0)
                lo = max(L[rid] - g[rid], views[rid].replay_start)
                assert int((c.raw_slots[b] >= 0).sum()) == L[rid] - lo
            lib = gather_workspace(c, caches.t["swa"].view(-1, D), caches.t[ch].view(-1, D) if ch else None)
            assert torch.equal(torch.nan_to_num(ws, 0.0), lib)
            out = flash_mla_sparse_fwd(q[c.tok_start:c.tok_end], ws.view(-1, 1, D), c.indices, sink,
                                       c.topk_length)
            ref = dense_out(q[c.tok_start:c.tok_end], [dense_keys(
                content, kind, *tok[t], picks[t, :min((tok[t][1] + 1) // R4, K)].tolist())
                for t in range(c.tok_start, c.tok_end)], sink)
            bad = torch.nonzero(~((out - ref).abs().amax((1, 2)) <= TOL))[:, 0]
            assert not len(bad), (kind, [toks[i] for i in bad])
            for t, (rid, pos, _) in zip(range(c.tok_start, c.tok_end), toks, strict=True):
                v = views[rid]
                seen["replayed"] += bool(v.replay_start) and pos < v.replay_end
                seen["with_prefix"] += v.num_computed_tokens > v.replay_start
                seen["later_in_chunk"] += int(meta.token_to_req[t]) > c.req_start
            seen["prefill_tokens"] += len(toks)
        seen["multi_chunk_steps"] += len(chunks) > 1


def check_step(meta, views, caches, content, rng, seen):
    """Write the step's keys through the slot mappings, then run every consumer."""
    T, Tp, Td = meta.num_tokens, meta.num_tokens_padded, meta.num_decode_tokens
    qsl, tok = meta.host_query_start_loc, []  # tok: (rid, pos, window floor), from the scheduler
    for b, rid in enumerate(meta.req_ids):
        assert qsl[b + 1] - qsl[b] == views[rid].num_scheduled_tokens
        tok += [(rid, p, views[rid].replay_start) for p in views[rid].positions]
    assert meta.positions[:T].tolist() == [p for _, p, _ in tok]
    caches.write(meta, tok, content)
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    q, sink = torch.randn(Tp, H, D, generator=g, dtype=DT), torch.randn(H, generator=g, dtype=DT)
    picks = torch.full((Tp, K), -1, dtype=torch.int32)
    if Td:  # decode picks: top-k of the DeepGEMM logits (masked by length), as an indexer does
        for t, row, vis in indexer_logits(meta, tok, caches, content, g):
            row = row.masked_fill(torch.arange(row.numel()) >= vis, float("-inf"))
            top = torch.sort(row, descending=True, stable=True).indices[:min(vis, K)]
            picks[t, :top.numel()] = top.to(torch.int32)
            if vis and rng.random() < 0.4:  # a garbage id (NaN logits, #49896) before valid ones
                picks[t, rng.randrange(min(vis, K))] = rng.choice([-1, vis, vis + 9])
            seen["logits_rows"] += 1
        list(indexer_logits(meta, tok, caches, content, g, "decode_lens_clamped"))
        check_decode(meta, tok, caches, content, q, sink, picks, rng, seen)
    for t in range(Td, T):
        picks[t] = torch.tensor(random_picks(rng, (tok[t][1] + 1) // R4), dtype=torch.int32)
    if meta.num_prefills:
        check_prefill(meta, views, tok, caches, content, q, sink, picks, rng, seen)


@pytest.fixture(scope="module")
def trace():
    """A reference-scheduler trace (prefix hits with bounded replay, chunked prefill, spec decode,
    padding), every consumer checked at every step."""
    num_blocks, budget, rng = 80, 40, random.Random(5)
    sched = ReferenceScheduler(LAYOUT, num_blocks, max_num_batched_tokens=budget, max_num_seqs=6,
                               num_speculative_tokens=SPEC, long_prefill_threshold=24, seed=5)
    pipe = MetadataPipeline(LAYOUT, 8, budget + 3, "cpu", num_speculative_tokens=SPEC)
    caches, content = Caches(LAYOUT, num_blocks), Content()
    seen = {k: 0 for k in ("decode_tokens", "prefill_tokens", "replayed", "with_prefix", "kernel",
                           "multi_chunk_steps", "padded_decode", "logits_rows", "later_in_chunk")}
    script = {0: [("a", 70, None, 0), ("b", 30, None, 0), ("c", 9, None, 0)],
              3: [("d", 90, "a", 64), ("e", 40, None, 0), ("f", 12, None, 0)],
              9: [("g", 50, "a", 40), ("h", 5, None, 0)]}
    for i in range(26):
        for rid, plen, of, pl in script.get(i, []):
            content.add(rid, of, pl)
            sched.add_request(rid, plen, rng.randint(3, 9), prefix_of=of, prefix_len=pl)
        step = sched.schedule()
        views = {v.req_id: v for v in sched.batch_view(step)}
        if views:
            pipe.update(step, pad_to=step.total_tokens + rng.choice([0, 3]))
            check_step(pipe.build(), views, caches, content, rng, seen)
        sched.update_after_step(sched.random_acceptance(step, rng))
    return seen


@pytest.mark.slow  # ./dev quick skips it
def test_sparse_decode_views(trace):
    assert trace["decode_tokens"] > 20 and trace["padded_decode"] > 0 and trace["kernel"] >= 3, trace


@pytest.mark.slow  # ./dev quick skips it
def test_paged_mqa_logits_view(trace):
    assert trace["logits_rows"] > 20, trace


@pytest.mark.slow  # ./dev quick skips it
def test_sparse_prefill_combined_matrix(trace):
    assert trace["prefill_tokens"] > 100 and trace["replayed"] > 0 and trace["with_prefix"] > 0, trace
    assert trace["multi_chunk_steps"] > 0 and trace["later_in_chunk"] > 0, trace


# ----------------------------------------------------------------------------------------------
# DeepGEMM lengths at the production page size (64 indexer rows per page) and the clamped copies
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow  # ./dev quick skips it
def test_paged_mqa_logits_64_row_pages_and_clamped_lens():
    """Hand-made steps, mla block 256 (64 c4 rows per page, as DeepGEMM's ``block_kv``): a decode that
    reads two pages, a 1-token decode in a ``next_n = 2`` batch (``[0, n]``) and dummy ``seq_len = 1``
    requests (CUDA-graph capture): ``decode_lens`` has zeros, the clamped copies are ``>= 1``
    everywhere and equal the raw ones where those are ``>= 1``; both feed the emulated kernel."""
    from helpers.pipelines import Pool

    layout = DSV4Layout.from_config("tiny", 512, mla_block_size=256, swa_block_size=4)
    assert layout.channels["c4i"].rows_per_block == 64
    pool, pipe = Pool(layout), MetadataPipeline(layout, 8, 340, "cpu", num_speculative_tokens=SPEC)
    a, b = pool.blocks(268), pool.blocks(71)
    x, y, z = pool.blocks(1), pool.blocks(1), pool.blocks(1)
    caches, content, g = Caches(layout, next(pool.next)), Content(), torch.Generator().manual_seed(0)
    for rid in "abxyz":
        content.add(rid)
    none = tuple([] for _ in layout.groups)
    steps = [StepInput([NewRequest("a", a, 0), NewRequest("b", b, 0)], [], {"a": 266, "b": 70}),
             StepInput([NewRequest("x", x, 0), NewRequest("y", y, 0)],
                       [RunningRequest("a", none, 266), RunningRequest("b", none, 70)],
                       {"a": 2, "b": 1, "x": 1, "y": 1}),
             StepInput([NewRequest("z", z, 0)], [], {"z": 1}, finished_req_ids=["a", "b", "x", "y"])]
    seen_two_pages = False
    for i, step in enumerate(steps):
        pipe.update(step, pad_to=step.total_tokens + 2)
        meta = pipe.build()
        T, c4i = meta.num_tokens, meta["c4i"]
        qsl = meta.host_query_start_loc
        tok = [(rid, int(meta.host_seq_lens[bb]) - int(qsl[bb + 1] - qsl[bb]) + k, 0)
               for bb, rid in enumerate(meta.req_ids) for k in range(int(qsl[bb + 1] - qsl[bb]))]
        assert meta.positions[:T].tolist() == [p for _, p, _ in tok]
        caches.write(meta, tok, content)
        assert torch.equal(c4i.lens_clamped[:T], c4i.lens[:T].clamp(min=1))
        if i == 0:
            continue
        raw, clamped = c4i.decode_lens, c4i.decode_lens_clamped
        assert raw.shape == clamped.shape == (meta.num_decodes, 2)
        assert raw.is_contiguous() and clamped.is_contiguous()
        assert (raw == 0).any() and (clamped >= 1).all()
        assert torch.equal(clamped[raw >= 1], raw[raw >= 1])
        for lens in ("decode_lens", "decode_lens_clamped"):
            for _t, _row, vis in indexer_logits(meta, tok, caches, content, g, lens):
                seen_two_pages |= vis > 64
        if i == 2:  # capture-like: every length is 0, every clamped length 1
            assert (raw == 0).all() and (clamped == 1).all()
    assert seen_two_pages


# ----------------------------------------------------------------------------------------------
# widths at the real geometry, argument errors, no host sync
# ----------------------------------------------------------------------------------------------
def _flash_steps():
    from helpers.pipelines import Pool

    layout = DSV4Layout.from_config("flash", 4096)
    pool = Pool(layout)
    a, b = pool.blocks(202), pool.blocks(300)
    none = tuple([] for _ in layout.groups)
    return layout, [StepInput([NewRequest("a", a, 0), NewRequest("b", b, 100)], [], {"a": 200, "b": 50}),
                    StepInput([], [RunningRequest("a", none, 200), RunningRequest("b", none, 150)],
                              {"a": 2, "b": 2})]


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_widths_at_flash_geometry():
    """consumers.md: prefill widths 640 (C4A, K = 512), 128 (SWA-only), round_up(Wc + 128, 128)
    (C128A); N / M from the host lengths; decode lists 128 / K / Wc wide."""
    layout, (s1, s2) = _flash_steps()
    pipe = MetadataPipeline(layout, 4, 256, "cpu", num_speculative_tokens=1)
    pipe.update(s1)
    meta = pipe.build()
    topk = torch.full((meta.num_tokens_padded, 512), -1, dtype=torch.int32)
    Wc = meta["c128a"].indices.shape[1]
    assert Wc == 128  # round_up(cdiv(4096, 128), 128)
    # a: L 200, g 200; b: L 150, q 50, g 50 + 127
    for kind, width, N in (("c4", 640, 50), ("swa", 128, 0), ("c128", round_up(Wc + 128, 128), 1)):
        (c,) = prefill_chunks(meta, kind, topk if kind == "c4" else None)
        assert c.indices.shape == (250, 1, width) and (c.N, c.M) == (N, N + 200), kind
        assert prefill_workspace_size(meta, kind) == (N, N + 200)
        assert c.topk_length[199].item() == {"c4": 50, "c128": 1, "swa": 0}[kind] + 128  # a at pos 199
    pipe.update(s2)
    meta = pipe.build()
    slots = meta.topk_to_slots("c4a", torch.full((meta.num_tokens_padded, 512), -1, dtype=torch.int32))
    for kind, extra in (("swa", None), ("c4", 512), ("c128", Wc)):
        args = meta.sparse_decode_args(kind, slots if kind == "c4" else None)
        assert args["indices"].shape == (4, 1, 128) and args["indices"].stride(-1) == 1
        x = args["extra_indices"]
        assert x is None if extra is None else x.shape == (4, 1, extra)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_prefill_argument_errors():
    layout, (s1, _) = _flash_steps()
    pipe = MetadataPipeline(layout, 4, 256, "cpu", num_speculative_tokens=1)
    pipe.update(s1)
    meta = pipe.build()
    topk = torch.full((meta.num_tokens_padded, 512), -1, dtype=torch.int32)
    for call, name in ((lambda: prefill_chunks(meta, "c7"), "layer_kind"),
                       (lambda: prefill_chunks(meta, "c4"), "topk"),
                       (lambda: prefill_chunks(meta, "c4", topk[:3]), "topk"),
                       (lambda: prefill_chunks(meta, "swa", chunk_reqs=0), "chunk_reqs"),
                       (lambda: prefill_chunk(meta, "swa", 1, 1), "req_start"),
                       (lambda: prefill_chunk(meta, "c4", 0, 2, topk, N=10), "N"),
                       (lambda: prefill_chunk(meta, "c4", 0, 2, topk, N=50, M=60), "M")):
        with pytest.raises(ValueError, match=name):
            call()


@pytest.mark.slow  # NOTE: builds a Flash step like the tests above
def test_each_helper_refuses_the_other_top_k_form():
    """``prefill_chunk(s)`` take the raw picks (``topk_picks``), ``sparse_decode_args`` the converted
    ``(slots, lens)`` (``topk_slots``): the other form raises a ValueError naming the parameter and the right form."""
    layout, (s1, s2) = _flash_steps()
    pipe = MetadataPipeline(layout, 4, 256, "cpu", num_speculative_tokens=1)
    pipe.update(s1)
    meta = pipe.build()
    picks = torch.full((meta.num_tokens_padded, 512), -1, dtype=torch.int32)
    pair = meta.topk_to_slots("c4a", picks, compact=True)
    for call in (lambda: prefill_chunks(meta, "c4", pair), lambda: prefill_chunk(meta, "c4", 0, 2, pair),
                 lambda: prefill_chunks(meta, "c4", topk_picks=list(pair))):
        with pytest.raises(ValueError, match=r"topk_picks: .*raw .*sparse_decode_args' form"):
            call()
    assert len(prefill_chunks(meta, "c4", topk_picks=picks)) == 1  # NOTE: the right form passes
    pipe.update(s2)
    meta = pipe.build()
    picks = torch.full((meta.num_tokens_padded, 512), -1, dtype=torch.int32)
    pair = meta.topk_to_slots("c4a", picks, compact=True)
    with pytest.raises(ValueError, match=r"topk_slots: .*converted \(slots, lens\) pair.*prefill_chunks' form"):
        meta.sparse_decode_args("c4", picks)
    for bad, what in ((None, "needs its converted top-k"), ((pair[0],), "tensor pair"),
                      ((pair[0][:2], pair[1]), r"need slots \[>= 4, K\]")):
        with pytest.raises(ValueError, match="topk_slots.*" + what):
            meta.sparse_decode_args("c4", bad)
    assert meta.sparse_decode_args("c4", topk_slots=pair)["extra_indices"].shape == (4, 1, 512)


@pytest.mark.gpu
def test_prefill_chunks_make_no_host_sync():
    layout, (s1, _) = _flash_steps()
    pipe = MetadataPipeline(layout, 4, 256, "cuda", num_speculative_tokens=1)
    pipe.update(s1)
    meta = pipe.build()
    topk = torch.full((meta.num_tokens_padded, 512), -1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        chunks = [prefill_chunks(meta, k, topk if k == "c4" else None, chunk_reqs=1) for k in KINDS]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert chunks[1][1].topk_length[-1].item() == 150 // 4 + 128  # b's last token: pos 149
