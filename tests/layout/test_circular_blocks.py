"""Circular groups of several blocks (DESIGN §4 "circular group"; issue #20): a ring of ``capacity`` rows
per request in ``k = capacity // block_size`` blocks, as vLLM's Triton ring and vllm-ascend run it. Ring
row ``p = pos % capacity`` lives at ``bt[p // block_size] * block_size + p % block_size``.

``from_config(..., circular={name: (capacity, block_size)})`` makes such a group (an int: one block);
the reference scheduler hands out its ``k`` ids at admission. Every output is checked against that
formula written here, the Triton per-op path (interpreter on CPU) against the PyTorch reference, and a
consumer ring (vLLM's ring test) resolves every window. The fused launch takes rings of ``k`` blocks too
(its write plan starts at ``seq_len - capacity``); the traces compare it with the per-op path.
"""

import random

import pytest
import torch

import dsv4_index
from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.specs import GroupSpec
from dsv4_index.testing.scheduler import ReferenceScheduler

from helpers.pipelines import HAS_TRITON, compare_step

BACKENDS = ["reference"] + (["triton"] if HAS_TRITON else [])


def _slot(ids, p, cap, bs):
    """The k-block ring formula, written independently of the library."""
    r = p % cap
    return ids[r // bs] * bs + r % bs


# ----------------------------------------------------------------------------------------------
# from_config forms and errors
# ----------------------------------------------------------------------------------------------
def test_from_config_forms():
    one = DSV4Layout.from_config("flash", max_model_len=2048, circular={"c128_state": 256})
    same = DSV4Layout.from_config("flash", max_model_len=2048, circular={"c128_state": (256, 256)})
    many = DSV4Layout.from_config("flash", max_model_len=2048, circular={"c128_state": (256, 8),
                                                                         "swa": (256, 64)})
    g1, gk, sw = one.group("c128_state"), many.group("c128_state"), many.group("swa")
    assert (g1.kind, g1.block_size, g1.capacity, g1.ring_capacity, g1.ring_blocks) == ("circular", 256, None, 256, 1)
    assert same.groups == one.groups                                  # (cap, cap) is the int form
    assert (gk.kind, gk.block_size, gk.capacity, gk.ring_capacity, gk.ring_blocks) == ("circular", 8, 256, 256, 32)
    assert (sw.kind, sw.block_size, sw.ring_blocks) == ("circular", 64, 4)
    assert gk.columns(600) == (32, 32) and g1.columns(600) == (1, 1)
    assert many.channels["c128_state"].rows_per_block == 8
    assert "tail_slot_mapping" in many.channels["c128_state"].outputs
    assert many.group("c4_state").kind == "sliding" and many.group("mla").capacity is None


@pytest.mark.parametrize("circ, match", [
    ({"c128_state": (250, 8)},
     r"circular\['c128_state'\] = \(250, 8\): capacity 250 is not a multiple of block_size 8"),
    ({"c128_state": (64, 8)}, r"circular\['c128_state'\]: capacity 64 is below the window 128"),
    ({"c128_state": 64}, r"circular\['c128_state'\]: capacity 64 is below the window 128"),
    ({"c128_state": (256,)}, r"circular\['c128_state'\] must be a capacity or \(capacity, block_size\)"),
    ({"c128_state": (256, 8, 1)}, r"must be a capacity or \(capacity, block_size\)"),
    ({"c128_state": (256, 0)}, r"circular\['c128_state'\]\[1\] \(block_size\) must be an int >= 1"),
    ({"c128_state": ("256", 8)}, r"circular\['c128_state'\]\[0\] \(capacity\) must be an int"),
    ({"c128_state": 2.5}, r"circular\['c128_state'\] must be an int"),
    ({"mla": (256, 8)}, r"only sliding groups"),
])
def test_from_config_errors(circ, match):
    with pytest.raises(ValueError, match=match):
        DSV4Layout.from_config("flash", max_model_len=2048, circular=circ)


def test_group_spec_capacity_checks():
    kw = dict(gid=0, name="r", window=16, prefix_cacheable=False, table_width=4)
    assert GroupSpec(kind="circular", block_size=4, capacity=32, **kw).ring_blocks == 8
    with pytest.raises(ValueError, match="capacity of circular group 'r' must be a positive multiple of its "
                                         "block_size 4"):
        GroupSpec(kind="circular", block_size=4, capacity=30, **kw)
    with pytest.raises(ValueError, match="capacity 12 is below its window 16"):
        GroupSpec(kind="circular", block_size=4, capacity=12, **kw)
    with pytest.raises(ValueError, match="capacity is for circular groups"):
        GroupSpec(kind="sliding", block_size=4, capacity=32, **kw)


@pytest.mark.skipif(not HAS_TRITON, reason="the fused launch needs Triton (CUDA or TRITON_INTERPRET=1)")
def test_fused_takes_a_ring_of_several_blocks(device):
    # the fused write plan starts at seq_len - capacity (A * ring blocks), no longer refused
    lay = DSV4Layout.from_config("tiny", max_model_len=512, circular={"c128_state": (32, 4)})
    pipe = MetadataPipeline(lay, 4, 96, device, 3, fused=True)
    assert pipe.num_launches == 1
    from dsv4_index.frontend import NewRequest, StepInput

    ids = list(range(1000, 1008))
    lists = tuple(ids if g.name == "c128_state" else [1 + 100 * g.gid + j for j in range(-(-70 // g.alloc_block_size))]
                  for g in lay.groups)
    pipe.update(StepInput([NewRequest("a", lists, 0)], [], {"a": 70}))   # a chunk of 70 > capacity 32
    m = pipe.build()
    tail = m["c128_state"].tail_slot_mapping[:70].cpu().tolist()
    assert tail == [_slot(ids, p, 32, 4) if p >= 70 - 32 else -1 for p in range(70)]
    assert m["c128_state"].slot_mapping[:70].cpu().tolist() == [_slot(ids, p, 32, 4) for p in range(70)]


# ----------------------------------------------------------------------------------------------
# host checks: a circular row needs its k ids, no more, no id twice
# ----------------------------------------------------------------------------------------------
def test_host_checks_k_ids(device):
    from dsv4_index.frontend import NewRequest, RunningRequest, StepInput

    lay = DSV4Layout.from_config("tiny", max_model_len=512, circular={"c128_state": (32, 4)})
    gid = lay.group("c128_state").gid
    pipe = MetadataPipeline(lay, 2, 96, device, 0, backend="reference", validate=True)

    def lists(ring, off=0):  # NOTE: off: another request's own blocks (sharing them is a "safe" rejection)
        out = [[1 + 100 * g.gid + off + j for j in range(-(-40 // g.alloc_block_size))] for g in lay.groups]
        out[gid] = ring
        return tuple(out)

    with pytest.raises(ValueError, match=r"block ids missing for gid 3 \(c128_state\) of slot 0: 39 tokens need 8 "
                                         r"blocks, the row has 7"):
        pipe.update(StepInput([NewRequest("a", lists(list(range(1000, 1007))), 0)], [], {"a": 39}))
    with pytest.raises(ValueError, match=r"would hold 9 blocks in gid 3 \(c128_state\), the table holds 8 "
                                         r"\(the circular ring\)"):
        pipe.update(StepInput([NewRequest("a", lists(list(range(1000, 1009))), 0)], [], {"a": 39}))
    with pytest.raises(ValueError, match=r"block id 1001 twice in gid 3"):
        twice = [1000, 1001, 1001, 1003, 1004, 1005, 1006, 1007]
        pipe.update(StepInput([NewRequest("a", lists(twice), 0)], [], {"a": 39}))
    pipe.update(StepInput([NewRequest("a", lists(list(range(1000, 1008))), 0)], [], {"a": 39}))  # accepted
    m = pipe.build()
    assert m["c128_state"].slot_mapping[:39].tolist() == [_slot(list(range(1000, 1008)), p, 32, 4) for p in range(39)]
    # a running request sends no more ring ids
    pipe.update(StepInput([], [RunningRequest("a", tuple([] for _ in lay.groups), 39)], {"a": 1}))
    assert pipe.build()["c128_state"].slot_mapping[0].item() == _slot(list(range(1000, 1008)), 39, 32, 4)
    # a ring block another live request holds: both would write it (checks="full"), the state unchanged
    c4 = lay.group("c4_state").gid
    run = RunningRequest("a", tuple([9999] if g.gid == c4 else [] for g in lay.groups), 40)
    other = [2000 + j for j in range(7)] + [1003]
    with pytest.raises(ValueError, match=r"block id 1003 is in the rings of slots 0 and 1 of circular group gid 3"):
        pipe.update(StepInput([NewRequest("b", lists(other, 50), 0)], [run], {"a": 1, "b": 39}))
    pipe3 = MetadataPipeline(lay, 2, 96, device, 0, backend="reference", validate=True)
    with pytest.raises(ValueError, match=r"block id 3000 is in the rings of slots 0 and 1 of circular group gid 3"):
        pipe3.update(StepInput([NewRequest("x", lists([3000 + j for j in range(8)]), 0),
                                NewRequest("z", lists([3100 + j for j in range(7)] + [3000], 50), 0)], [],
                               {"x": 39, "z": 39}))
    pipe.update(StepInput([NewRequest("b", lists([2000 + j for j in range(8)], 50), 0)], [run], {"a": 1, "b": 39}))
    m = pipe.build()
    assert m["c128_state"].slot_mapping[0].item() == _slot(list(range(1000, 1008)), 40, 32, 4)
    assert m["c128_state"].slot_mapping[1:40].tolist() == [_slot(list(range(2000, 2008)), p, 32, 4) for p in range(39)]


# ----------------------------------------------------------------------------------------------
# vLLM's ring test with the ring in 32 blocks of 8
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_ring_case_in_blocks_of_8(backend, device):
    # ring holds 128..249, the chunk is 250..520 (271 tokens), capacity 256 in 32 blocks of 8
    cap, bs, W, s, e = 256, 8, 128, 250, 521
    ids = random.Random(1).sample(range(1, 400), cap // bs)
    bt = torch.tensor([ids], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, e - s], dtype=torch.int32, device=device)
    sl = torch.tensor([e], dtype=torch.int32, device=device)
    T = e - s
    kw = dict(circular_capacity=cap, backend=backend, num_tokens=T, validate=True)
    addr = dsv4_index.slot_mapping(qsl, sl, bt, bs, out=torch.full((T,), 7777, dtype=torch.int64, device=device), **kw)
    tail = dsv4_index.slot_mapping(qsl, sl, bt, bs, tail=True,
                                   out=torch.full((T,), 7777, dtype=torch.int64, device=device), **kw)
    idx, lens = dsv4_index.window_indices(qsl, sl, bt, bs, W,
                                          out=torch.full((T, W), 7777, dtype=torch.int32, device=device),
                                          out_lens=torch.full((T,), 7777, dtype=torch.int32, device=device), **kw)
    addr, tail, idx, lens = addr.cpu(), tail.cpu(), idx.cpu(), lens.cpu()
    pos = list(range(s, e))
    assert addr.tolist() == [_slot(ids, p, cap, bs) for p in pos]
    assert tail.tolist() == [_slot(ids, p, cap, bs) if p >= e - cap else -1 for p in pos]
    store = {_slot(ids, p, cap, bs): p for p in range(128, 250)}            # the consumer's ring
    assert len(store) == 122

    def read(t):
        return [p if x <= -2 else store.get(x) for x, p in
                zip(idx[t, :int(lens[t])].tolist(), [pos[-2 - x] if x <= -2 else None for x in idx[t].tolist()])]

    for p in (255, 383, 511):
        t = p - s
        assert read(t) == list(range(p - W + 1, p + 1)), p
        assert [x <= -2 for x in idx[t].tolist()] == [q >= s for q in range(p - W + 1, p + 1)]
    for t, p in enumerate(pos[W - 123:], W - 123):                          # every window the ring covers
        assert read(t) == list(range(p - W + 1, p + 1)), p
    for t, x in enumerate(tail.tolist()):                                 # the write plan, after the reads
        if x >= 0:
            store[x] = pos[t]
    assert sorted(store.values()) == list(range(265, 521))
    assert len(set(x for x in tail.tolist() if x >= 0)) == cap


# ----------------------------------------------------------------------------------------------
# the pipeline through the reference scheduler: long chunks, drafts, prefix hits, preemption
# ----------------------------------------------------------------------------------------------
def _expect(meta, views, lay, name):
    """Every output of channel ``name`` from the ring formula (independent of the library)."""
    g = lay.groups[lay.channels[name].gid]
    cap, bs, W = g.ring_capacity, g.block_size, lay.channels[name].window
    Tp = meta.num_tokens_padded
    slots, tail = [-1] * Tp, [-1] * Tp
    idx, lens = [[-1] * W for _ in range(Tp)], [0] * Tp
    by_id = {v.req_id: v for v in views}
    qsl = meta.query_start_loc.cpu().tolist()
    for b, rid in enumerate(meta.req_ids):
        v = by_id[rid]
        ids = v.block_ids[g.gid]
        assert len(ids) == cap // bs and 0 not in ids
        s, q = v.num_computed_tokens, v.num_scheduled_tokens
        assert qsl[b + 1] - qsl[b] == q
        for j in range(q):
            t, p = qsl[b] + j, s + j
            slots[t] = _slot(ids, p, cap, bs)
            tail[t] = slots[t] if p >= s + q - cap else -1
            lo = max(p - W + 1, v.replay_start, 0)
            row = [_slot(ids, x, cap, bs) if x < s else -2 - (qsl[b] + x - s) for x in range(lo, p + 1)]
            idx[t] = row + [-1] * (W - len(row))
            lens[t] = len(row)
    return slots, tail, idx, lens


def _trace(lay, device, steps, budget, seed, expect_long, prompt_len):
    pipes = {"reference": MetadataPipeline(lay, 4, budget, device, 3, backend="reference", validate=True)}
    if HAS_TRITON:
        pipes["triton"] = MetadataPipeline(lay, 4, budget, device, 3, fused=False, backend="triton", validate=True)
        pipes["fused"] = MetadataPipeline(lay, 4, budget, device, 3, fused=True, backend="triton", validate=True)
        assert pipes["fused"].num_launches == 1
    sched = ReferenceScheduler(lay, 900, max_num_batched_tokens=budget, max_num_seqs=4, num_speculative_tokens=3,
                               seed=seed)
    circ = [c for c in lay.channels if lay.groups[lay.channels[c].gid].kind == "circular"]
    assert len(circ) == 2
    rings = {c: {} for c in circ}          # the consumer: slot -> (req id, position) written there
    longest, drafts, replays = 0, 0, 0
    for i, (step, views) in enumerate(sched.random_trace(steps, seed, arrival_prob=0.6, prompt_len=prompt_len,
                                                         max_new_tokens=(2, 12))):
        meta, _ = compare_step(pipes, step, pad_to=min(budget, step.total_tokens + 5), tag=i)
        T = meta.num_tokens
        longest = max([longest] + [v.num_scheduled_tokens for v in views])
        drafts += sum(v.is_decode and v.num_scheduled_tokens > 1 for v in views)
        replays += sum(v.replay_start > 0 for v in views)
        tok_req = meta.token_to_req[:T].cpu().tolist()
        pos = meta.positions[:T].cpu().tolist()
        rows = [(meta.req_ids[b], p) for b, p in zip(tok_req, pos)]
        for c in circ:
            ch = meta[c]
            slots, tail, idx, lens = _expect(meta, views, lay, c)
            assert ch.slot_mapping.cpu().tolist() == slots, (i, c)
            assert ch.tail_slot_mapping.cpu().tolist() == tail, (i, c)
            assert ch.indices.cpu().tolist() == idx, (i, c)
            assert ch.lens.cpu().tolist() == lens, (i, c)
            ring = rings[c]
            for t in range(T):                       # every window resolves to its own positions
                rid, p = rows[t]
                got = [rows[-2 - x] if x <= -2 else ring.get(x) for x in idx[t][:lens[t]]]
                lo = p - lens[t] + 1
                assert got == [(rid, x) for x in range(lo, p + 1)], (i, c, t)
            for t, x in enumerate(tail[:T]):         # the write plan, after every read
                if x >= 0:
                    ring[x] = rows[t]
    assert longest > expect_long, longest                 # chunks longer than the capacity ran
    assert drafts > 0
    return replays


@pytest.mark.slow  # pipeline trace in the interpreter (./dev quick skips it)
def test_pipeline_multi_block_rings_tiny(device):
    # c128_state: 32 rows in 8 blocks of 4 (window 16); swa: 24 rows in 6 blocks of 4 (window 8)
    lay = DSV4Layout.from_config("tiny", max_model_len=512, mla_block_size=32,
                                 circular={"c128_state": (32, 4), "swa": (24, 4)})
    assert lay.group("c128_state").ring_blocks == 8 and lay.group("swa").ring_blocks == 6
    assert _trace(lay, device, 24, 96, 3, 32, (30, 300)) > 0       # bounded replay after prefix hits too


@pytest.mark.slow  # pipeline trace in the interpreter (./dev quick skips it)
def test_pipeline_multi_block_rings_flash(device):
    lay = DSV4Layout.from_config("flash", max_model_len=1024, circular={"c128_state": (256, 8), "swa": (256, 64)})
    _trace(lay, device, 16, 400, 5, 256, (150, 500))


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_trace_round_trip(tmp_path):
    # a recorded trace keeps the ring's capacity and block size; the replay rebuilds the same layout
    from dsv4_index.testing.scheduler import scripted_trace
    from dsv4_index.tools.replay import replay_trace
    from dsv4_index.tools.trace import layout_from_json, layout_to_json, read_trace, record_steps
    from dsv4_index.tools.trace_schema import rebuild_layout

    lay = DSV4Layout.from_config("tiny", max_model_len=256, mla_block_size=16, circular={"c128_state": (32, 4)})
    one = DSV4Layout.from_config("tiny", max_model_len=256, mla_block_size=16, circular={"c128_state": 32})
    assert "capacity" not in layout_to_json(one)["groups"][3]                 # one-block layouts: JSON as before
    assert layout_from_json(layout_to_json(lay)) == lay and rebuild_layout(lay, "tiny") == lay
    for k, layout in enumerate((lay, one)):  # NOTE: one-block rings were refused by the reader before
        pipe = MetadataPipeline(layout, 4, 64, "cpu", 1, backend="reference")
        sched = ReferenceScheduler(layout, 300, max_num_batched_tokens=64, max_num_seqs=4, num_speculative_tokens=1)
        script = [{"add": [dict(req_id="a", prompt_len=60, max_new_tokens=4)]},
                  {"add": [dict(req_id="b", prompt_len=50, max_new_tokens=3)]}, {"accept": {"a": 1}}, {}, {}]
        path = tmp_path / f"ring{k}.jsonl"
        with record_steps(pipe, path):
            for step, _ in scripted_trace(sched, script):
                pipe.update(step)
                pipe.build()
        header, steps = read_trace(path)
        assert header["layout"]["groups"][3].get("capacity") == (32 if k == 0 else None)
        assert len(steps) == len(script)
        res = replay_trace(path, device="cpu")
        assert res.ok, res.report()
