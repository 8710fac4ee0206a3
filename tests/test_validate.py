"""check_metadata / check_topk / check_cp_partition: real metadata passes; every claimed check is
shown to fire by injecting its fault into a copy of the metadata."""

import pytest
import torch

from dsv4_index.step import StepInput
from dsv4_index.validate import MetadataError, check_cp_partition, check_metadata, check_topk

from _meta_helpers import Pool, clone_meta, make_pipeline, tiny_layout, two_steps

NUM_BLOCKS = 97  # two_steps hands out ids 1..96


@pytest.fixture(scope="module")
def built():
    layout = tiny_layout()
    pipe = make_pipeline(layout)
    s1, s2 = two_steps(layout)
    pipe.update(s1)
    check_metadata(pipe.build(), num_blocks=NUM_BLOCKS)
    pipe.update(s2, pad_to=40)
    return pipe, pipe.build()


@pytest.fixture
def meta(built):
    return clone_meta(built[1])


def _tok(m, pred):
    """First valid token satisfying pred(t)."""
    return next(t for t in range(m.num_tokens) if pred(t))


def test_real_metadata_passes(built, meta):
    pipe, m = built
    assert m.num_decodes == 1 and m.num_tokens_padded > m.num_tokens  # decodes, prefills and padding
    check_metadata(m, num_blocks=NUM_BLOCKS)
    check_metadata(meta, pipe.layout, num_blocks=NUM_BLOCKS, cp=(1, 0, 1), replay_start={"d": 6}, next_n=2)
    with pytest.raises(MetadataError, match="capacity"):
        check_metadata(m, num_blocks=76)  # request d's blocks (ids >= 76) lie outside such a pool


def test_replay_start_is_the_window_floor(meta):
    # without the floor, request d's first windows are too short
    with pytest.raises(MetadataError) as e:
        check_metadata(meta, replay_start={"d": 0})
    assert e.value.channel in ("swa", "c4_state", "c128_state") and e.value.req_id == "d"
    with pytest.raises(MetadataError, match="replay_start"):
        check_metadata(meta, replay_start={"d": 11})


def _swap01(x, t):
    x[t, 0], x[t, 1] = x[t, 1].clone(), x[t, 0].clone()


def _completing(m, ch):
    cs = m[ch].compressed_slot_mapping
    return [t for t in range(m.num_tokens) if int(cs[t]) != -1]


def _set(obj, name, value):
    setattr(obj, name, value)


def _shift_left(m, ch, t):
    row, n = m[ch].indices[t].clone(), int(m[ch].lens[t])
    m[ch].indices[t, :n - 1] = row[1:n]
    m[ch].indices[t, n - 1] = -1
    m[ch].lens[t] = n - 1


def _hole(m, ch, t):
    n = int(m[ch].lens[t])
    m[ch].indices[t, n] = m[ch].indices[t, 0]
    m[ch].indices[t, 0] = -1


def _causal_skip(m, ch):
    t = _tok(m, lambda t: int((m[ch].indices[t] != -1).sum()) >= 3)
    m[ch].indices[t, 1] = m[ch].indices[t, 2]


# (name, corruption, channel named, message fragment); tokens: 0-1 decode 'a', 2-18 prefill 'b',
# 19-31 prefill 'd' (replay floor 6), 32-39 padding.
FAULTS = [
    ("duplicate slot", lambda m: m["swa"].slot_mapping.__setitem__(5, m["swa"].slot_mapping[20]),
     "swa", "two tokens write"),
    ("duplicate compressed slot", lambda m: m["c4a"].compressed_slot_mapping.__setitem__(
        _completing(m, "c4a")[1], m["c4a"].compressed_slot_mapping[_completing(m, "c4a")[0]]),
     "c4a", "two tokens write"),
    ("slot past capacity", lambda m: m["swa"].slot_mapping.__setitem__(3, NUM_BLOCKS * 4), "swa", "capacity"),
    ("negative slot", lambda m: m["c128_state"].slot_mapping.__setitem__(3, -7), "c128_state", "capacity"),
    ("index past capacity", lambda m: m["c128a"].indices.__setitem__((1, 0), NUM_BLOCKS * 2), "c128a", "capacity"),
    ("slot in null block", lambda m: m["c4_state"].slot_mapping.__setitem__(3, 1), "c4_state", "null block"),
    ("padded token with slot", lambda m: m["swa"].slot_mapping.__setitem__(35, 1000), "swa", "padded"),
    ("padded token with compressed slot", lambda m: m["c4i"].compressed_slot_mapping.__setitem__(35, 1000),
     "c4i", "padded"),
    ("padded token with window row", lambda m: m["c128_state"].indices.__setitem__((35, 0), 1000),
     "c128_state", "padded"),
    ("padded token with len", lambda m: m["c128a"].lens.__setitem__(35, 1), "c128a", "padded"),
    ("padded token with indexer len", lambda m: m["c4i"].lens.__setitem__(35, 1), "c4i", "padded"),
    ("window not ascending", lambda m: _swap01(m["swa"].indices, 5), "swa", "ascending"),
    ("window not ending at own slot", lambda m: m["swa"].indices.__setitem__((5, 7), m["swa"].indices[5, 6]),
     "swa", "own slot"),
    ("window lens != count", lambda m: m["swa"].lens.__setitem__(5, 7), "swa", "count of listed"),
    ("window len != min(W, pos+1-floor)", lambda m: _shift_left(m, "swa", 20), "swa", "min(W"),
    ("window hole", lambda m: _hole(m, "swa", 20), "swa", "entries after len"),
    ("window entry wrong", lambda m: m["swa"].indices.__setitem__((5, 0), m["swa"].indices[25, 0]),
     "swa", "entry 0"),
    ("window narrower than W", lambda m: _set(m["swa"], "indices", m["swa"].indices[:, :4].contiguous()),
     "swa", "width"),
    ("causal row skipped", lambda m: _causal_skip(m, "c128a"), "c128a", "entry 1"),
    ("causal lens != count", lambda m: m["c128a"].lens.__setitem__(1, 5), "c128a", "count of listed"),
    ("causal len != n_c", lambda m: (m["c128a"].indices.__setitem__((1, 3), -1),
                                     m["c128a"].lens.__setitem__(1, 3)), "c128a", "n_c"),
    ("indexer causal row skipped", lambda m: _causal_skip(m, "c4i"), "c4i", "entry 1"),
    ("indexer len", lambda m: m["c4i"].lens.__setitem__(4, m["c4i"].lens[4] + 1), "c4i", "indexer length"),
    ("ks", lambda m: m["c4i"].ks.__setitem__(4, m["c4i"].ks[4] + 1), "c4i", "ks"),
    ("ke", lambda m: m["c4i"].ke.__setitem__(4, m["c4i"].ke[4] + 1), "c4i", "ke"),
    ("cu", lambda m: m["c4i"].cu.__setitem__(2, m["c4i"].cu[2] + 1), "c4i", "cu"),
    ("decode_lens", lambda m: m["c4i"].decode_lens.__setitem__((0, 1), m["c4i"].decode_lens[0, 1] + 1),
     "c4i", "decode_lens"),
    ("decode_lens shape", lambda m: _set(m["c4i"], "decode_lens", m["c4i"].decode_lens[:, :1]),
     "c4i", "decode_lens shape"),
    ("compressed slot on a non-completing token", lambda m: m["c128a"].compressed_slot_mapping.__setitem__(
        0, m["c128a"].compressed_slot_mapping[1]), "c128a", "completes no"),
    ("compressed slot value", lambda m: m["c128a"].compressed_slot_mapping.__setitem__(
        1, m["c128a"].compressed_slot_mapping[1] + 1), "c128a", "completed row"),
    ("raw slot value", lambda m: m["swa"].slot_mapping.__setitem__(31, m["swa"].slot_mapping[31] + 1),
     "swa", "token's position"),
    ("channel length", lambda m: _set(m["c4a"], "compressed_slot_mapping", m["c4a"].compressed_slot_mapping[:8]),
     "c4a", "length"),
    ("channel block_table rows", lambda m: _set(m["swa"], "block_table", m["swa"].block_table[:1]),
     "swa", "block_table"),
    # batch / token map
    ("decode after prefill", lambda m: (_set(m, "num_decodes", 0), _set(m, "num_prefills", 3)),
     "batch", "decode-first"),
    ("prefill counted as decode", lambda m: (_set(m, "num_decodes", 2), _set(m, "num_prefills", 1)),
     "batch", "decode row"),
    ("num_decodes + num_prefills", lambda m: _set(m, "num_prefills", 1), "batch", "num_prefills"),
    ("token counts", lambda m: _set(m, "num_decode_tokens", 3), "batch", "num_decode_tokens"),
    ("req_ids", lambda m: m.req_ids.pop(), "batch", "req_ids"),
    ("qsl[0]", lambda m: m.query_start_loc.__setitem__(0, 1), "query_start_loc", "query_start_loc[0]"),
    ("qsl decreasing", lambda m: m.query_start_loc.__setitem__(1, 25), "query_start_loc", "negative"),
    ("qsl total", lambda m: _set(m, "num_tokens", 31), "query_start_loc", "num_tokens"),
    ("padding", lambda m: _set(m, "num_tokens_padded", 30), "batch", "num_tokens_padded"),
    ("seq_lens", lambda m: m.seq_lens.__setitem__(1, 3), "seq_lens", "below its query length"),
    ("positions", lambda m: m.positions.__setitem__(3, m.positions[3] + 1), "positions", "positions"),
    ("positions length", lambda m: _set(m, "positions", m.positions[:5]), "positions", "length"),
    ("token_to_req", lambda m: m.token_to_req.__setitem__(3, 0), "token_to_req", "token_to_req"),
    ("padded token_to_req", lambda m: m.token_to_req.__setitem__(35, 2), "token_to_req", "token_to_req"),
    ("is_valid_token", lambda m: m.is_valid_token.__setitem__(35, True), "is_valid_token", "is_valid_token"),
    ("block_tables rows", lambda m: m.block_tables.__setitem__(0, m.block_tables[0][:2]), "block_tables", "rows"),
]


@pytest.mark.parametrize("corrupt,channel,fragment", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_fault_is_caught(meta, corrupt, channel, fragment):
    check_metadata(clone_meta(meta), num_blocks=NUM_BLOCKS)  # the copy passes before the fault
    corrupt(meta)
    with pytest.raises(MetadataError) as e:
        check_metadata(meta, num_blocks=NUM_BLOCKS)
    assert e.value.channel == channel, str(e.value)
    assert fragment in str(e.value)
    assert str(e.value).startswith(f"{channel}: ")
    if e.value.row is not None:  # token-level errors name the request and its batch row
        assert e.value.req_id == meta.req_ids[e.value.row]
        assert f"request {e.value.req_id!r}, batch row {e.value.row}" in str(e.value)


def test_error_names_token_request_expected_found(meta):
    good = int(meta["swa"].slot_mapping[31])
    meta["swa"].slot_mapping[31] = good + 1
    with pytest.raises(MetadataError) as e:
        check_metadata(meta)
    err = e.value
    assert (err.channel, err.token, err.req_id, err.row) == ("swa", 31, "d", 2)
    assert (err.expected, err.found) == (good, good + 1)
    assert isinstance(err, ValueError) and f"expected {good}, found {good + 1}" in str(err)


def test_null_block_check_can_be_disabled(meta):
    meta["c4_state"].slot_mapping[3] = 1
    with pytest.raises(MetadataError, match="null block"):
        check_metadata(meta)
    with pytest.raises(MetadataError, match="token's position"):  # still not the right slot
        check_metadata(meta, null_block=None)


# ------------------------------------------------------------------------------------------------
# top-k conversion
# ------------------------------------------------------------------------------------------------
def _topk(m, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_c = (m.positions.long() + 1) // 4
    topk = (torch.rand(m.num_tokens_padded, K, generator=g) * (n_c[:, None] + 3)).long() - 1
    return topk.to(torch.int32)  # a mix of -1, visible rows and rows past n_c


def test_check_topk(built):
    pipe, m = built
    topk = _topk(m)
    slots, lens = m.topk_to_slots("c4a", topk)
    check_topk(m, "c4a", topk, slots, lens, num_blocks=NUM_BLOCKS)
    n_c = (m.positions.long() + 1) // 4
    assert bool(((topk.long() >= n_c[:, None]) & m.is_valid_token[:, None]).any())  # invisible picks exist

    # a pick past the token's visible rows converted to a slot anyway
    t, k = next((t, k) for t in range(m.num_tokens) for k in range(topk.shape[1])
                if int(topk[t, k]) >= int(n_c[t]) and int(topk[t, k]) // 8 < 2)
    l, b = int(topk[t, k]), int(m.token_to_req[t])
    bad = slots.clone()
    bad[t, k] = int(m.block_tables[0][b, l // 8]) * 8 + l % 8   # the picked row's slot (S = 8)
    with pytest.raises(MetadataError, match="past the token's visible rows") as e:
        check_topk(m, "c4a", topk, bad, lens + (torch.arange(lens.numel()) == t).int())
    assert e.value.channel == "c4a" and e.value.token == t

    bad = slots.clone()
    bad[35, 0] = 8
    with pytest.raises(MetadataError, match="padded"):
        check_topk(m, "c4a", topk, bad, lens)
    bad_lens = lens.clone()
    bad_lens[3] += 1
    with pytest.raises(MetadataError, match="count of converted"):
        check_topk(m, "c4a", topk, slots, bad_lens)
    bad = slots.clone()
    tv = _tok(m, lambda t: int(slots[t, 0]) != -1)
    bad[tv, 0] = NUM_BLOCKS * 8
    with pytest.raises(MetadataError, match="capacity"):
        check_topk(m, "c4a", topk, bad, lens, num_blocks=NUM_BLOCKS)
    with pytest.raises(MetadataError, match="top-k entry"):  # compact layout claimed but not given
        check_topk(m, "c4a", topk, slots, lens, compact=True)


# ------------------------------------------------------------------------------------------------
# pipeline option and DCP
# ------------------------------------------------------------------------------------------------
def test_pipeline_validate_option(monkeypatch):
    layout = tiny_layout()
    pipe = make_pipeline(layout, validate=True)
    s1, s2 = two_steps(layout)
    pipe.update(s1)
    pipe.build()
    swa = pipe._builders["swa"]
    views = swa.views

    def corrupt(ctx):  # NOTE: views() runs whether or not a fused plan covers the channel
        v = views(ctx)
        v.slot_mapping[1] = v.slot_mapping[0]
        return v

    monkeypatch.setattr(swa, "views", corrupt)
    pipe.update(s2)
    with pytest.raises(MetadataError, match="two tokens write") as e:
        pipe.build()
    assert e.value.channel == "swa"
    monkeypatch.undo()
    quiet = make_pipeline(layout)  # default: no check
    monkeypatch.setattr(quiet._builders["swa"], "views", corrupt)
    quiet.update(s1)
    quiet.build()


def _cp_metas(world=2, interleave=4):
    layout = tiny_layout(cp_world_size=world, cp_interleave=interleave)
    metas = []
    for rank in range(world):
        pipe = make_pipeline(layout, cp_world_size=world, cp_rank=rank, cp_interleave=interleave)
        pool = Pool(layout, start=1 + 100 * rank)
        for i, s in enumerate(two_steps(layout, pool)):
            pipe.update(s, pad_to=40 if i else None)
            m = pipe.build()
        check_metadata(m)
        metas.append(clone_meta(m))
    return metas


def test_cp_partition():
    metas = _cp_metas()
    check_cp_partition(metas)
    assert int((metas[0]["swa"].slot_mapping != -1).sum()) not in (0, metas[0].num_tokens)

    m0 = clone_meta(metas[0])  # rank 0 also lists a token rank 1 owns
    t = _tok(m0, lambda t: int(metas[1]["swa"].slot_mapping[t]) != -1)
    m0["swa"].slot_mapping[t] = 5000
    with pytest.raises(MetadataError, match="ranks listing") as e:
        check_cp_partition([m0, metas[1]])
    assert e.value.channel == "swa" and e.value.found == [0, 1]

    m1 = clone_meta(metas[1])  # a compressed row nobody writes
    t = _tok(m1, lambda t: int(m1["c4a"].compressed_slot_mapping[t]) != -1)
    m1["c4a"].compressed_slot_mapping[t] = -1
    with pytest.raises(MetadataError, match="ranks listing") as e:
        check_cp_partition([metas[0], m1])
    assert e.value.channel == "c4a"

    m1 = clone_meta(metas[1])
    m1["c128a"].lens[3] += 1
    with pytest.raises(MetadataError, match="summed over ranks") as e:
        check_cp_partition([metas[0], m1])
    assert e.value.channel == "c128a"

    m1 = clone_meta(metas[1])
    m1.req_ids.reverse()
    with pytest.raises(MetadataError, match="another batch"):
        check_cp_partition([metas[0], m1])
