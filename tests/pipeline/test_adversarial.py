"""Malformed input: the pipeline rejects bad steps with ValueError naming the culprit and keeps its
state; garbage array-form steps are either rejected (state unchanged) or built exactly, every listed
slot inside a block the request holds; the functional ops reject bad arguments with ValueError naming
them, and on hostile values (huge block ids, null blocks, zero-length requests, garbage top-k) give
the formula's answer (or -1), never a crash."""

import dataclasses
import os

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dsv4_index as di
from dsv4_index import reference as ref
from dsv4_index.batch import StepBatch
from dsv4_index.frontend import batch_from_step
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput
from dsv4_index.validate import check_metadata

from helpers.expected import check_rows, request_view
from helpers.layouts import tiny_layout
from helpers.pipelines import Pool, clone_meta, make_pipeline, two_steps

I32 = torch.int32
INTERP = bool(os.environ.get("TRITON_INTERPRET")) or torch.cuda.is_available()


def _i32(*v):
    return torch.tensor(v, dtype=I32)


# ------------------------------------------------------------------------------------------------
# pipeline: malformed steps
# ------------------------------------------------------------------------------------------------
def _empty(layout):
    return tuple([] for _ in layout.groups)


def _bad_steps(layout, pool):
    """Malformed steps after two_steps (live: a seq 64 in slot 0, b seq 37 in slot 1, d seq 23 with
    replay floor 6): name -> (step, check level that rejects it, message fragment)."""
    G = len(layout.groups)
    e = _empty(layout)
    short = list(pool.blocks(20))
    short[1] = short[1][:-1]                            # swa: one block short
    dup_new = list(pool.blocks(8))
    dup_new[0] = dup_new[0] + dup_new[0][:1]            # mla: the same id twice
    a_mla = [[3]] + [[] for _ in range(G - 1)]          # a's mla row already holds block 3 (pool ids 1..)
    return {
        "unknown running request": (StepInput([], [RunningRequest("zz", e, 0)], {"zz": 1}), "safe",
                                    "request 'zz' is not in the batch"),
        "block ids missing for a gid": (StepInput([NewRequest("n", tuple(short), 0)], [], {"n": 20}), "safe",
                                        "block ids missing for gid 1 (swa)"),
        "more blocks than the table holds": (StepInput([NewRequest("n", pool.blocks(260), 250)], [], {"n": 10}),
                                             "safe", "the table holds 8 (max_model_len)"),
        "more tokens than the blocks cover": (StepInput([NewRequest("n", pool.blocks(256), 250)], [], {"n": 10}),
                                              "safe", "block ids missing for gid 0 (mla)"),
        "duplicate block id in a new request": (StepInput([NewRequest("n", tuple(dup_new), 0)], [], {"n": 8}),
                                                "full", f"block id {dup_new[0][0]} twice in gid 0"),
        "appended block already in the row": (StepInput([], [RunningRequest("a", tuple(a_mla), 64)], {"a": 1}),
                                              "full", "block id 3 twice in gid 0 of slot 0"),
        "null block in a full group": (StepInput([NewRequest("n", ([0],) + pool.blocks(8)[1:], 0)], [], {"n": 8}),
                                       "full", "null block 0 in full group gid 0"),
        "new request id already live": (StepInput([NewRequest("b", pool.blocks(4), 0)], [], {"b": 4}), "safe",
                                        "request 'b' already holds a slot"),
        "replay_start beyond num_computed": (StepInput([], [RunningRequest("b", e, 37)], {"b": 1},
                                                       replay_start={"b": 38}), "safe", "'b'] = 38 is outside"),
        "resumed unknown request": (StepInput([], [RunningRequest("zz", pool.blocks(4), 0, resumed=True)],
                                              {"zz": 4}), "safe", "'zz' is resumed but was never preempted"),
        "finished ids as a bare string": (StepInput([], [], {}, finished_req_ids="ab"), "safe", "bare string 'ab'"),
        "scheduled request not in the batch": (StepInput([], [], {"zz": 3}), "safe", "num_scheduled_tokens lists 'zz'"),
        "wrong number of block lists": (StepInput([NewRequest("n", ([1],), 0)], [], {"n": 1}), "safe",
                                        "'n' has 1 per-gid block lists, expected 4"),
        "too many tokens": (StepInput([NewRequest("n", pool.blocks(97), 0)], [], {"n": 97}), "safe",
                            "more than max_num_batched_tokens = 96"),
        "block id beyond int32": (StepInput([NewRequest("n", pool.blocks(4)[:3] + ([2**31 - 1],), 0)], [], {"n": 4}),
                                  "safe", "gives slots beyond int32"),
    }


def _meta_equal(m1, m2):
    for f in dataclasses.fields(m1):
        if f.name in ("channels", "block_tables", "layout", "builders", "_converters"):
            continue
        x, y = getattr(m1, f.name), getattr(m2, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f.name
        else:
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f.name
    assert all(torch.equal(x, y) for x, y in zip(m1.block_tables, m2.block_tables))
    assert m1.channels.keys() == m2.channels.keys()
    for name, c1 in m1.channels.items():
        for f in dataclasses.fields(c1):
            x, y = getattr(c1, f.name), getattr(m2[name], f.name)
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), (name, f.name)


def _next_step(layout):
    e = _empty(layout)
    return StepInput([], [RunningRequest("a", e, 64), RunningRequest("b", e, 37), RunningRequest("d", e, 23)],
                     {"a": 1, "b": 2, "d": 5}, replay_start={"d": 6})


def _host_state(pipe):
    """What a rejected step must leave as it was (host and device tables, request slots, slot map)."""
    t = pipe.tables
    return (t.mirror.tobytes(), t.num_blocks.tobytes(), t.flat.cpu().numpy().tobytes(), pipe.occupied.tobytes(),
            dict(pipe.slot_map.slot_of), set(pipe.slot_map.preempted), pipe.last_step_stats)


@pytest.mark.slow  # ./dev quick skips it
def test_rejected_steps_leave_the_pipeline_unchanged():
    layout = tiny_layout()
    # NOTE: the reference pipeline and every bad step draw ids from separate pools
    fresh = make_pipeline(layout)
    for i, s in enumerate(two_steps(layout)):
        fresh.update(s, pad_to=40 if i else None)
        fresh.build()
    fresh.update(_next_step(layout))
    want = clone_meta(fresh.build())
    check_metadata(want)

    pipe = make_pipeline(layout, checks="full")
    for i, s in enumerate(two_steps(layout)):
        pipe.update(s, pad_to=40 if i else None)
        pipe.build()
    before = _host_state(pipe)
    for name, (step, _, fragment) in _bad_steps(layout, Pool(layout, start=1000)).items():
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            pipe.update(step)
        assert _host_state(pipe) == before, name
    with pytest.raises(ValueError, match="pad_to"):
        pipe.update(_next_step(layout), pad_to=3)
    pipe.update(_next_step(layout))
    got = pipe.build()
    check_metadata(got)
    _meta_equal(got, want)


@pytest.mark.parametrize("name", list(_bad_steps(tiny_layout(), Pool(tiny_layout(), start=1000))))
def test_each_bad_step_raises_at_its_level(name):
    layout = tiny_layout()
    step, level, fragment = _bad_steps(layout, Pool(layout, start=1000))[name]
    for checks in ("safe", "full"):
        pipe = make_pipeline(layout, checks=checks, backend="reference")
        for s in two_steps(layout):
            pipe.update(s)
        if level == "full" and checks == "safe":
            pipe.update(step)  # NOTE: a contract check, not a memory-safety one: only "full" rejects it
            continue
        with pytest.raises(ValueError) as e:
            pipe.update(step)
        assert fragment in str(e.value)


def test_unknown_finished_id_is_a_no_op():
    """A finished id the pipeline never saw (aborted while waiting) changes nothing."""
    layout = tiny_layout()
    pipes = [make_pipeline(layout, backend="reference") for _ in range(2)]
    for p in pipes:
        for s in two_steps(layout):
            p.update(s)
            p.build()
    pipes[0].update(dataclasses.replace(_next_step(layout), finished_req_ids={"never-seen"}))
    pipes[1].update(_next_step(layout))
    assert _host_state(pipes[0])[:-1] == _host_state(pipes[1])[:-1]
    _meta_equal(pipes[0].build(), pipes[1].build())


# ------------------------------------------------------------------------------------------------
# pipeline: garbage array-form steps
# ------------------------------------------------------------------------------------------------
_FIELDS = ("req_slots", "num_computed_tokens", "num_scheduled_tokens", "is_new", "free_slots", "write_gids",
           "write_slots", "write_starts", "write_cu", "write_ids", "replay_start", "replay_end")
_VALUES = st.one_of(st.integers(-2, 8), st.integers(0, 120), st.integers(-2**31, 2**31),
                    st.sampled_from([2**31 - 1, 2**31, 2**28, 2**28 - 1, 2**29, -2**31, 2**40]))


def _garbage_base(layout):
    """A real next step: b finishes, a decodes, d replays up to 26, e arrives (runs in every group)."""
    e = _empty(layout)
    return StepInput([NewRequest("e", Pool(layout, start=500).blocks(20), 0)],
                     [RunningRequest("a", e, 64), RunningRequest("d", e, 23)], {"a": 2, "d": 5, "e": 20},
                     finished_req_ids={"b"}, replay_start={"d": 6}, replay_end={"d": 26})


@st.composite
def _mutations(draw):
    out = []
    for _ in range(draw(st.integers(1, 3))):
        out.append((draw(st.sampled_from(_FIELDS)), draw(st.sampled_from(["set"] * 6 + ["drop", "append", "dtype"])),
                    draw(st.integers(0, 40)), draw(_VALUES)))
    return out


def _mutate(b: StepBatch, muts) -> StepBatch:
    for field, op, i, v in muts:
        a = getattr(b, field)
        a = np.zeros(b.num_rows, np.int64) if a is None else np.array(a)
        if op == "set" and a.size:
            if a.dtype == bool:
                v = bool(v & 1)
            elif a.dtype.kind != "f":
                a = a.astype(np.int64)
            a[i % a.size] = v
        elif op == "drop" and a.size:
            a = np.delete(a, i % a.size)
        elif op == "append":
            a = np.append(a.astype(np.int64), v)
        elif op == "dtype":
            a = a.astype([np.float64, np.int32, np.uint8, bool][i % 4])
        b = dataclasses.replace(b, **{field: a})
    return b


def _inside_own_blocks(pipe, meta):
    """Every slot a token writes or lists lies in a block its request's row holds (host mirror), and
    no token below its request's replay_end writes into a prefix-cacheable group (DESIGN §4)."""
    assert torch.equal(pipe.tables.flat.cpu(), torch.from_numpy(pipe.tables.mirror))  # device == mirror
    T = meta.num_tokens
    req = meta.token_to_req[:T].long().cpu()
    pos = meta.positions[:T].cpu()
    replayed = torch.zeros(T, dtype=torch.bool)
    if meta.replay_end is not None:  # NOTE: the host's int64 values, not what was staged
        replayed = pos < torch.as_tensor(np.asarray(meta.replay_end, dtype=np.int64))[req]
    for name, ch in meta.channels.items():
        g = pipe.layout.groups[ch.gid]
        for field in ("slot_mapping", "compressed_slot_mapping", "indices"):
            x = getattr(ch, field)
            if x is None:
                continue
            unit = g.block_size if field == "slot_mapping" or ch.compress_ratio == 1 else ch.rows_per_block
            x = x[:T].cpu().reshape(T, -1)
            if g.prefix_cacheable and field != "indices":
                assert bool((x[replayed] == -1).all()), (name, field, "a replayed token writes shared KV")
            for t, b in zip(*torch.nonzero(x != -1, as_tuple=True)):
                slot = int(meta.req_slots[int(req[t])])
                held = set(pipe.tables.row(ch.gid, slot).tolist())
                assert int(x[t, b]) // unit in held, (name, field, int(t), int(x[t, b]))


@given(_mutations())
@example([])                        # NOTE: the unmutated base: the comparison runs at least once
@example([("write_ids", "set", 25, 3)])   # NOTE: a block id of another group's range: accepted, built
def test_garbage_batches_are_rejected_or_built_exactly(muts):
    _garbage(muts, "reference")


@pytest.mark.skipif(not INTERP, reason="the fused kernel needs CUDA or TRITON_INTERPRET=1")
@settings(max_examples=8)
@given(_mutations())
@pytest.mark.slow  # ./dev quick skips it
def test_garbage_batches_fused(muts):
    _garbage(muts, None)


def _garbage(muts, backend):
    layout = tiny_layout()
    pipe = make_pipeline(layout, backend=backend)
    for s in two_steps(layout):
        pipe.update(s)
        pipe.build()
    bad = _mutate(batch_from_step(_garbage_base(layout), pipe.slot_map, len(layout.groups))[0], muts)
    before = _host_state(pipe)
    try:
        pipe.update(bad)
    except ValueError:
        assert _host_state(pipe) == before
        return
    meta = pipe.build()
    _inside_own_blocks(pipe, meta)
    # NOTE: every output equals DESIGN §4 in plain Python (helpers/expected.py, not the package's references) over
    # what the accepted step says: each row's slot, computed and scheduled tokens, replay bounds, and the blocks its
    # slot holds (the host mirror, equal to the device tables: _inside_own_blocks)
    check_rows(layout, meta, _views(pipe, bad, meta), pipe.num_speculative_tokens + 1)


def _views(pipe, batch: StepBatch, meta) -> list:
    """:func:`helpers.expected.request_view` of each batch row of ``meta``, from the accepted array-form step."""
    row = {int(s): i for i, s in enumerate(np.asarray(batch.req_slots).tolist())}
    views = []
    for slot in meta.req_slots.tolist():
        i = row[int(slot)]
        rs = 0 if batch.replay_start is None else int(np.asarray(batch.replay_start)[i])
        re_ = 0 if batch.replay_end is None else int(np.asarray(batch.replay_end)[i])
        blocks = [pipe.tables.row(g.gid, int(slot)).tolist() for g in pipe.layout.groups]
        views.append(request_view(blocks, int(np.asarray(batch.num_computed_tokens)[i]),
                                  int(np.asarray(batch.num_scheduled_tokens)[i]), rs, re_))
    return views


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_garbage_base_is_accepted():
    """The unmutated base of the garbage test is a valid step (so mutations probe real checks)."""
    layout = tiny_layout()
    pipe = make_pipeline(layout)
    for s in two_steps(layout):
        pipe.update(s)
        pipe.build()
    pipe.update(batch_from_step(_garbage_base(layout), pipe.slot_map, len(layout.groups))[0])
    meta = pipe.build()
    check_metadata(meta)
    _inside_own_blocks(pipe, meta)


def test_request_on_null_blocks_and_zero_length_request_in_pipeline():
    layout = tiny_layout()
    pipe = make_pipeline(layout)
    pool = Pool(layout)
    zero = tuple([0] * len(ids) for ids in pool.blocks(8))
    pipe.update(StepInput([NewRequest("z", pool.blocks(8), 0), NewRequest("n", zero, 0)], [], {"z": 0, "n": 8}))
    m = pipe.build()
    assert m.req_ids == ["n"] and m.num_tokens == 8
    assert torch.equal(m["swa"].slot_mapping, torch.arange(8) % 4)    # the formula on block 0
    with pytest.raises(ValueError, match="null block"):  # writes into block 0 are flagged by default
        check_metadata(m)
    with pytest.raises(ValueError, match="two tokens write"):  # positions 0 and 4 share slot 0
        check_metadata(m, null_block=None)


# ------------------------------------------------------------------------------------------------
# functional ops: bad arguments
# ------------------------------------------------------------------------------------------------
QSL, SL = _i32(0, 3, 5), _i32(7, 2)
BT = torch.arange(1, 9, dtype=I32).reshape(2, 4)

OPS = {
    "slot_mapping": lambda q, s, b, **kw: di.slot_mapping(q, s, b, 4, **kw),
    "compressed_slot_mapping": lambda q, s, b, **kw: di.compressed_slot_mapping(q, s, b, 2, 2, **kw),
    "window_indices": lambda q, s, b, **kw: di.window_indices(q, s, b, 4, 4, **kw),
    "causal_compressed_indices": lambda q, s, b, **kw: di.causal_compressed_indices(q, s, b, 2, 2, 8, **kw),
    "topk_to_slots": lambda q, s, b, **kw: di.topk_to_slots(torch.zeros(5, 2, dtype=I32), q, s, b, 2, 2, **kw),
    "indexer_lengths": lambda q, s, b, **kw: di.indexer_lengths(q, s, 2, **kw),
}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("arg,bad", [
    ("query_start_loc", QSL.long()),
    ("seq_lens", SL.float()),
    ("seq_lens", _i32(7, 2, 1)),
    ("query_start_loc", QSL.reshape(1, 3)),
    ("query_start_loc", torch.empty(3, dtype=I32, device="meta")),
    ("seq_lens", torch.empty(2, dtype=I32, device="meta")),
    ("query_start_loc", _i32(0, 4, 3)),
    ("seq_lens", _i32(1, 2)),
])
def test_bad_batch_arguments(op, arg, bad):
    args = {"query_start_loc": QSL, "seq_lens": SL}
    args[arg] = bad
    with pytest.raises(ValueError, match=arg):
        OPS[op](args["query_start_loc"], args["seq_lens"], BT)


@pytest.mark.parametrize("op", [o for o in OPS if o != "indexer_lengths"])
@pytest.mark.parametrize("bad", [BT.long(), BT[0], BT[:1], torch.empty(2, 4, dtype=I32, device="meta")])
def test_bad_block_table(op, bad):
    with pytest.raises(ValueError, match="block_table"):
        OPS[op](QSL, SL, bad)


@pytest.mark.parametrize("op", list(OPS))
def test_out_too_small_or_wrong(op):
    out_dtype = torch.int64 if "slot_mapping" in op else I32
    for out in (torch.empty(2, dtype=out_dtype), torch.empty(5, dtype=torch.float32)):
        with pytest.raises(ValueError, match="out"):
            if op in ("window_indices", "causal_compressed_indices", "topk_to_slots"):
                OPS[op](QSL, SL, BT, num_tokens=5, out=torch.empty(2, 8, dtype=out.dtype))
            else:
                OPS[op](QSL, SL, BT, num_tokens=5, out=out)


def test_geometry_arguments():
    with pytest.raises(ValueError, match="cp_interleave"):  # interleave must divide the block
        di.slot_mapping(QSL, SL, BT, 4, cp_world_size=2, cp_interleave=3)
    with pytest.raises(ValueError, match="cp_rank"):
        di.slot_mapping(QSL, SL, BT, 4, cp_world_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="block_size"):
        di.slot_mapping(QSL, SL, BT, 0)
    with pytest.raises(ValueError, match="compress_ratio"):
        di.compressed_slot_mapping(QSL, SL, BT, 2, 0)
    with pytest.raises(ValueError, match="window"):
        di.window_indices(QSL, SL, BT, 4, 0)
    with pytest.raises(ValueError, match="divisible"):  # R must divide the block size
        tiny_layout(mla_block_size=30)
    with pytest.raises(ValueError, match="kernel_block_size"):
        tiny_layout(kernel_block_size=12)
    with pytest.raises(ValueError, match="topk"):
        di.topk_to_slots(torch.zeros(5, 2, dtype=torch.float32), QSL, SL, BT, 2, 2)
    with pytest.raises(ValueError, match="topk"):
        di.topk_to_slots(torch.zeros(2, 2, dtype=I32), QSL, SL, BT, 2, 2)
    with pytest.raises(ValueError, match="table"):  # more tokens than the table covers
        di.slot_mapping(QSL, _i32(70, 2), BT, 4)


# ------------------------------------------------------------------------------------------------
# functional ops: hostile values -> formula answer or ValueError, kernel == reference
# ------------------------------------------------------------------------------------------------
def _expected_slots(qsl, sl, bt, bs):
    out = []
    for b in range(sl.numel()):
        q = int(qsl[b + 1] - qsl[b])
        for p in range(int(sl[b]) - q, int(sl[b])):
            out.append(int(bt[b, p // bs]) * bs + p % bs)
    return torch.tensor(out, dtype=torch.int64)


def _both(op, *args, **kw):
    """(kernel result, reference result); kw['out'] style buffers are not passed."""
    return getattr(di, op)(*args, **kw), getattr(ref, op)(*args, **kw)


def _eq(x, y):
    if x is None or y is None:
        return x is y
    if isinstance(x, tuple):
        return len(x) == len(y) and all(_eq(a, b) for a, b in zip(x, y))
    return torch.equal(x, y)


@pytest.mark.parametrize("bs", [1, 64])
def test_slots_beyond_int32(bs):
    top = (2**31 - 1) if bs == 1 else 2**31 // bs + 7   # block ids at the top of an int32 pool
    bt = torch.tensor([[top, top - 1, 5, 0], [1, 2, top - 2, top]], dtype=I32)
    qsl, sl = _i32(0, 2, 4), _i32(2 * bs, 4 * bs)
    got, want = _both("slot_mapping", qsl, sl, bt, bs)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(got, _expected_slots(qsl, sl, bt, bs))
    assert int(got.max()) >= 2**31 - 1
    # int32 index lists cannot hold such slots: a clear ValueError, or (if representable) the formula
    for op, args in (("window_indices", (qsl, sl, bt, bs, 2)),
                     ("causal_compressed_indices", (qsl, sl, bt, 1, bs, 4))):
        try:
            got = getattr(di, op)(*args)
        except ValueError:
            continue
        assert _eq(got, getattr(ref, op)(*args))


def test_null_blocks_and_zero_length_requests():
    bt = torch.tensor([[0, 0, 0, 0], [3, 4, 0, 0], [0, 0, 0, 0], [6, 7, 8, 9]], dtype=I32)
    qsl, sl = _i32(0, 3, 3, 3, 7), _i32(5, 6, 0, 13)    # rows 1 and 2 schedule nothing
    got, want = _both("slot_mapping", qsl, sl, bt, 4)
    assert torch.equal(got, want) and torch.equal(got, _expected_slots(qsl, sl, bt, 4))
    for op, args in (("compressed_slot_mapping", (qsl, sl, bt, 2, 2)), ("window_indices", (qsl, sl, bt, 4, 4)),
                     ("causal_compressed_indices", (qsl, sl, bt, 2, 2, 8)), ("indexer_lengths", (qsl, sl, 2)),
                     ("token_to_req", (qsl, 9))):
        got, want = _both(op, *args)
        assert _eq(tuple(got), tuple(want)) if isinstance(got, tuple) else torch.equal(got, want), op
    ttr = di.token_to_req(qsl, 9)
    assert ttr.tolist() == [0, 0, 0, 3, 3, 3, 3, 0, 0]


def test_replay_start_beyond_position():
    with pytest.raises(ValueError, match="replay_start"):
        di.window_indices(QSL, SL, BT, 4, 4, replay_start=_i32(6, 0))   # request 0 starts at pos 4
    got, want = _both("window_indices", QSL, SL, BT, 4, 4, replay_start=_i32(4, 0))
    assert _eq(got, want)


@pytest.mark.parametrize("kind", ["int32_max", "negative", "random"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_topk_garbage(kind, dtype):
    qsl, sl = _i32(0, 3, 5), _i32(40, 20)
    bt = torch.arange(1, 9, dtype=I32).reshape(2, 4)
    g = torch.Generator().manual_seed(hash(kind) % 1000)
    if kind == "int32_max":
        topk = torch.full((6, 4), 2**31 - 1, dtype=torch.int64)
        topk[:, 1] = 0
    elif kind == "negative":
        topk = -torch.randint(2, 2**31, (6, 4), generator=g)
        topk[:, 2] = 1
    else:
        lo, hi = (-2**31, 2**31 - 1) if dtype == torch.int32 else (-2**62, 2**62)
        topk = torch.randint(lo, hi, (6, 4), generator=g, dtype=torch.int64)
        topk[:, 3] = torch.randint(0, 10, (6,), generator=g)
    topk = topk.to(dtype)
    for compact in (False, True):
        (slots, lens), (rs, rl) = _both("topk_to_slots", topk, qsl, sl, bt, 8, 4, compact=compact, num_tokens=6)
        assert torch.equal(slots, rs) and torch.equal(lens, rl)
        # formula: valid iff 0 <= l < n_c(pos) (and inside the table)
        for t in range(6):
            if t >= 5:
                assert lens[t] == 0 and bool((slots[t] == -1).all())
                continue
            b = 0 if t < 3 else 1
            pos = int(sl[b]) - (3 if b == 0 else 2) + (t if b == 0 else t - 3)
            n_c = (pos + 1) // 4
            want = [int(bt[b, int(p) // 8]) * 8 + int(p) % 8 if 0 <= int(p) < n_c and int(p) // 8 < 4 else -1
                    for p in topk[t]]
            if compact:
                want = [w for w in want if w != -1] + [w for w in want if w == -1]
            assert slots[t].tolist() == want and int(lens[t]) == sum(w != -1 for w in want)
