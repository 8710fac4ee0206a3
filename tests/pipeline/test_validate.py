"""check_metadata / check_topk / check_cp_partition: real metadata passes; every output field of every
channel, the common tensors and each claimed invariant are shown to be checked by injecting one
fault into a copy of a real step's metadata (fresh tensors: the pipeline's buffers stay intact)."""

import dataclasses

import numpy as np
import pytest
import torch

from dsv4_index.validate import MetadataError, check_cp_partition, check_metadata, check_topk

from helpers.layouts import tiny_layout
from helpers.pipelines import Pool, make_pipeline, two_steps

NUM_BLOCKS = 97  # two_steps hands out ids 1..96
# NOTE: batch of the second step: 'a' decode (tokens 0-1), 'd' prefill with replay floor 6 (2-14),
# 'b' prefill (15-31), padding 32-39
A_DEC, B_PRE, D_PRE, PAD = 1, 8, 20, 35  # NOTE: rows a (decode), b, d: running first, new appended
PER_REQUEST = ("cu", "compact_cu", "compact_slot_mapping", "decode_lens", "decode_lens_clamped")
FIELDS = ("slot_mapping", "compressed_slot_mapping", "compact_slot_mapping", "compact_cu", "indices", "lens",
          "ks", "ke", "cu", "decode_lens", "lens_clamped", "decode_lens_clamped")


def _clone(meta):
    """Deep copy of one step's metadata: every tensor and host array its own (c4a and c4i share a
    compressed-slot buffer in the pipeline; the copy gives each channel its own)."""
    def c(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, np.ndarray):
            return x.copy()
        return list(x) if isinstance(x, list) and x and isinstance(x[0], str) else x

    chans = {n: dataclasses.replace(ch, **{f.name: c(getattr(ch, f.name)) for f in dataclasses.fields(ch)})
             for n, ch in meta.channels.items()}
    top = {f.name: c(getattr(meta, f.name)) for f in dataclasses.fields(meta)
           if f.name not in ("channels", "layout", "builders", "_converters", "block_tables")}
    return dataclasses.replace(meta, channels=chans, block_tables=[t.clone() for t in meta.block_tables], **top)


@pytest.fixture(scope="module")
def built():
    layout = tiny_layout(compact_compressed=True)
    pipe = make_pipeline(layout)   # NOTE: the fused kernel under TRITON_INTERPRET=1 / CUDA
    s1, s2 = two_steps(layout)
    pipe.update(s1)
    check_metadata(pipe.build(), num_blocks=NUM_BLOCKS)
    pipe.update(s2, pad_to=40)
    return pipe, pipe.build()


@pytest.fixture
def meta(built):
    return _clone(built[1])


def _raises(meta, channel, fragment, token="any", **kw) -> MetadataError:
    with pytest.raises(MetadataError) as e:
        check_metadata(meta, **kw)
    err = e.value
    assert err.channel == channel and str(err).startswith(f"{channel}: "), str(err)
    assert fragment in err.what, str(err)
    if token != "any":
        assert err.token == token, str(err)
    if err.row is not None:  # token-level errors name the request and its batch row
        assert err.req_id == meta.req_ids[err.row] and f"request {err.req_id!r}, batch row {err.row}" in str(err)
    return err


def test_real_metadata_passes(built, meta):
    pipe, m = built
    assert m.req_ids == ["a", "b", "d"] and m.num_decodes == 1 and (m.num_tokens, m.num_tokens_padded) == (32, 40)
    check_metadata(m, num_blocks=NUM_BLOCKS)
    check_metadata(meta, num_blocks=NUM_BLOCKS)
    _raises(meta, "c4a", "outside the cache", num_blocks=76)  # d's blocks (ids >= 76) lie outside such a pool


# ------------------------------------------------------------------------------------------------
# one fault per output field of every channel: check_metadata names channel, field and token
# ------------------------------------------------------------------------------------------------
FIELD_FAULTS = [("c4a", "compressed_slot_mapping"), ("c4a", "compact_slot_mapping"), ("c4a", "compact_cu")]
FIELD_FAULTS += [("c4i", f) for f in ("compressed_slot_mapping", "compact_slot_mapping", "compact_cu", "indices",
                                      "lens", "ks", "ke", "cu", "decode_lens", "lens_clamped", "decode_lens_clamped")]
FIELD_FAULTS += [("c128a", f) for f in ("compressed_slot_mapping", "compact_slot_mapping", "compact_cu", "indices",
                                        "lens")]
FIELD_FAULTS += [(ch, f) for ch in ("swa", "c4_state", "c128_state") for f in ("slot_mapping", "indices", "lens")]


def test_field_faults_cover_every_output(built):
    m = built[1]
    have = {(n, f) for n, ch in m.channels.items() for f in FIELDS if getattr(ch, f) is not None}
    assert have == set(FIELD_FAULTS)


def _corrupt_field(m, name, field):
    """Change one entry of ``m[name].<field>`` to a wrong value; the token it belongs to (None for
    per-request fields). Slots / indices move by 10**6 (no other check can claim them first)."""
    x = getattr(m[name], field)
    if field in PER_REQUEST:
        if x.dim() == 2:
            x[0, -1] += 1
        else:
            i = int(torch.nonzero(x != (-1 if "slot" in field else 0))[-1]) if "slot" in field else 1
            x[i] += 10**6 if "slot" in field else 1
        return None
    if x.dim() == 2:  # an index list: the first entry of a token listing at least two
        t = next(t for t in range(B_PRE, m.num_tokens) if int((x[t] != -1).sum()) >= 2)
        x[t, 0] += 10**6
    elif "slot" in field:
        t = next(t for t in range(B_PRE, m.num_tokens) if int(x[t]) != -1)
        x[t] += 10**6
    else:
        t = next(t for t in range(B_PRE, m.num_tokens) if int(x[t]) > 0)
        x[t] += 1
    return t


@pytest.mark.parametrize("name,field", FIELD_FAULTS, ids=[f"{n}.{f}" for n, f in FIELD_FAULTS])
def test_field_fault_is_caught(meta, name, field):
    t = _corrupt_field(meta, name, field)
    err = _raises(meta, name, field, token=t)
    if t is not None:
        assert err.row is not None and err.found != err.expected


# ------------------------------------------------------------------------------------------------
# invariants and common tensors
# ------------------------------------------------------------------------------------------------
def _set(obj, name, value):
    setattr(obj, name, value)


def _completing(m, ch):
    return [t for t in range(m.num_tokens) if int(m[ch].compressed_slot_mapping[t]) != -1]


def _short_row(m, ch):
    """First token whose window lists at least two entries and fewer than the width."""
    x = m[ch].lens
    return next(t for t in range(m.num_tokens) if 1 < int(x[t]) < m[ch].indices.shape[1])


def _hole(m, ch):
    t = _short_row(m, ch)
    n = int(m[ch].lens[t])
    m[ch].indices[t, n] = m[ch].indices[t, 0]
    m[ch].indices[t, 0] = -1


def _swap01(x, t):
    x[t, 0], x[t, 1] = x[t, 1].clone(), x[t, 0].clone()


# (name, corruption, channel named, fragment of the message, token named or "any")
FAULTS = [
    ("two tokens write one slot", lambda m: m["swa"].slot_mapping.__setitem__(B_PRE, m["swa"].slot_mapping[D_PRE]),
     "swa", "two tokens write", D_PRE),
    ("two tokens write one compressed slot", lambda m: m["c4a"].compressed_slot_mapping.__setitem__(
        _completing(m, "c4a")[1], m["c4a"].compressed_slot_mapping[_completing(m, "c4a")[0]]),
     "c4a", "two tokens write", "any"),
    ("negative slot", lambda m: m["c128_state"].slot_mapping.__setitem__(3, -7), "c128_state", "outside the cache", 3),
    ("slot in the null block", lambda m: m["c4_state"].slot_mapping.__setitem__(3, 1), "c4_state", "null block", 3),
    ("slot past the pool", lambda m: m["swa"].slot_mapping.__setitem__(3, NUM_BLOCKS * 4), "swa",
     "outside the cache", 3),
    ("index past the pool", lambda m: m["c128a"].indices.__setitem__((A_DEC, 0), NUM_BLOCKS * 2), "c128a",
     "outside the cache", A_DEC),
    ("padded token with a slot", lambda m: m["swa"].slot_mapping.__setitem__(PAD, 1000), "swa", "padded", PAD),
    ("padded token with a compressed slot", lambda m: m["c4i"].compressed_slot_mapping.__setitem__(PAD, 1000),
     "c4i", "padded", PAD),
    ("padded token with a window row", lambda m: m["c128_state"].indices.__setitem__((PAD, 0), 1000),
     "c128_state", "padded", PAD),
    ("padded token with a length", lambda m: m["c128a"].lens.__setitem__(PAD, 1), "c128a", "padded", PAD),
    ("padded token with ks", lambda m: m["c4i"].ks.__setitem__(PAD, 1), "c4i", "padded", PAD),
    ("window not ascending", lambda m: _swap01(m["swa"].indices, B_PRE), "swa", "indices", B_PRE),
    ("window not ending at the own slot", lambda m: m["swa"].indices.__setitem__(
        (B_PRE, int(m["swa"].lens[B_PRE]) - 1), m["swa"].indices[B_PRE, 0]), "swa", "own slot", B_PRE),
    ("lens != listed entries", lambda m: m["swa"].lens.__setitem__(B_PRE, 3), "swa", "lens entries listed", B_PRE),
    ("hole in a window", lambda m: _hole(m, "swa"), "swa", "lens entries listed", "any"),
    ("lens past the width", lambda m: m["c128_state"].lens.__setitem__(B_PRE, 17), "c128_state", "lens", B_PRE),
    ("window narrower than W", lambda m: _set(m["swa"], "indices", m["swa"].indices[:, :4].contiguous()),
     "swa", "indices shape", None),
    ("compressed list too short", lambda m: _set(m["c4a"], "compressed_slot_mapping",
                                                 m["c4a"].compressed_slot_mapping[:8].clone()),
     "c4a", "compressed_slot_mapping shape", None),
    ("decode after a prefill", lambda m: (_set(m, "num_decodes", 0), _set(m, "num_prefills", 3)), "batch",
     "decode-first", None),
    ("prefill counted as a decode", lambda m: (_set(m, "num_decodes", 2), _set(m, "num_prefills", 1)), "batch",
     "decode row", None),
    ("decodes + prefills != rows", lambda m: _set(m, "num_prefills", 1), "batch", "counts", None),
    ("token counts", lambda m: _set(m, "num_decode_tokens", 3), "batch", "num_decode_tokens", None),
    ("padding below the tokens", lambda m: _set(m, "num_tokens_padded", 30), "batch", "inconsistent step", None),
    ("query_start_loc total", lambda m: _set(m, "num_tokens", 31), "query_start_loc", "query_start_loc", None),
    ("positions", lambda m: m.positions.__setitem__(3, m.positions[3] + 1), "positions", "positions", 3),
    ("token_to_req", lambda m: m.token_to_req.__setitem__(3, 0), "token_to_req", "token_to_req", 3),
    ("padded token_to_req", lambda m: m.token_to_req.__setitem__(PAD, 2), "token_to_req", "token_to_req", PAD),
    ("is_valid_token", lambda m: m.is_valid_token.__setitem__(PAD, True), "is_valid_token", "is_valid_token", PAD),
]


@pytest.mark.parametrize("corrupt,channel,fragment,token", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_fault_is_caught(meta, corrupt, channel, fragment, token):
    corrupt(meta)
    _raises(meta, channel, fragment, token=token, num_blocks=NUM_BLOCKS)


def test_error_names_token_request_expected_found(meta):
    good = int(meta["swa"].slot_mapping[B_PRE])
    meta["swa"].slot_mapping[B_PRE] = good + 10**6
    err = _raises(meta, "swa", "slot_mapping", token=B_PRE)
    assert (err.req_id, err.row) == ("b", 1)
    assert (err.expected, err.found) == (good, good + 10**6)
    assert isinstance(err, ValueError) and f"expected {good}, found {good + 10**6}" in str(err)


def test_null_block_check_can_be_disabled(meta):
    meta["c4_state"].slot_mapping[3] = 1
    _raises(meta, "c4_state", "null block")
    _raises(meta, "c4_state", "slot_mapping", token=3, null_block=None)  # still not the formula's slot


# ------------------------------------------------------------------------------------------------
# top-k conversion
# ------------------------------------------------------------------------------------------------
def _topk(m, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_c = (m.positions.long().cpu() + 1) // 4
    topk = (torch.rand(m.num_tokens_padded, K, generator=g) * (n_c[:, None] + 3)).long() - 1
    return topk.to(torch.int32)  # a mix of -1, visible rows and rows past n_c


def _topk_raises(m, fragment, token, *args, **kw):
    with pytest.raises(MetadataError) as e:
        check_topk(m, "c4a", *args, **kw)
    assert e.value.channel == "c4a" and fragment in e.value.what and e.value.token == token, str(e.value)


def test_check_topk(built):
    pipe, m = built
    topk = _topk(m).to(pipe.device)
    slots, lens = (x.clone() for x in m.topk_to_slots("c4a", topk))
    check_topk(m, "c4a", topk, slots, lens, num_blocks=NUM_BLOCKS)
    n_c = (m.positions.long().cpu() + 1) // 4
    tk = topk.cpu()
    # a pick past the token's visible rows converted to a slot anyway (S = 8 rows per block)
    t, k = next((t, k) for t in range(m.num_tokens) for k in range(tk.shape[1])
                if int(tk[t, k]) >= int(n_c[t]) and int(tk[t, k]) // 8 < 2)
    bad = slots.clone()
    row, slot = int(tk[t, k]), int(m.req_slots[int(m.token_to_req[t])])
    bad[t, k] = int(m.block_tables[0][slot, row // 8]) * 8 + row % 8
    _topk_raises(m, "top-k slots", t, topk, bad, lens)
    bad = slots.clone()
    bad[PAD, 0] = 8
    _topk_raises(m, "top-k slots", PAD, topk, bad, lens)
    bad_lens = lens.clone()
    bad_lens[3] += 1
    _topk_raises(m, "top-k lens", 3, topk, slots, bad_lens)
    bad = slots.clone()
    tv = next(t for t in range(m.num_tokens) if int(slots[t, 0]) != -1)
    bad[tv, 0] = NUM_BLOCKS * 8
    _topk_raises(m, "outside the cache", tv, topk, bad, lens, num_blocks=NUM_BLOCKS)
    compacted = [sorted(r, key=lambda v: v == -1) for r in slots.tolist()]
    tc = next(t for t, r in enumerate(slots.tolist()) if r != compacted[t])
    _topk_raises(m, "top-k slots", tc, topk, slots, lens, compact=True)  # compact claimed, not given


# ------------------------------------------------------------------------------------------------
# pipeline option and DCP
# ------------------------------------------------------------------------------------------------
def test_pipeline_validate_option(monkeypatch):
    layout = tiny_layout()
    pipe = make_pipeline(layout, validate=True, backend="reference")
    s1, s2 = two_steps(layout)
    pipe.update(s1)
    pipe.build()
    swa = pipe.builders["swa"]
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
    quiet = make_pipeline(layout, backend="reference")  # default: no check
    monkeypatch.setattr(quiet.builders["swa"], "views", corrupt)
    quiet.update(s1)
    quiet.build()


@pytest.fixture(scope="module")
def cp_metas():
    world, interleave = 2, 4
    layout = tiny_layout(cp_world_size=world, cp_interleave=interleave)
    metas = []
    for rank in range(world):
        pipe = make_pipeline(layout, cp_world_size=world, cp_rank=rank, cp_interleave=interleave, backend="reference")
        pool = Pool(layout, start=1 + 100 * rank)
        for i, s in enumerate(two_steps(layout, pool)):
            pipe.update(s, pad_to=40 if i else None)
            m = pipe.build()
        check_metadata(m)
        metas.append(_clone(m))
    return metas


def _partition_raises(metas, channel, fragment, found=None):
    with pytest.raises(MetadataError) as e:
        check_cp_partition(metas)
    assert e.value.channel == channel and fragment in e.value.what, str(e.value)
    if found is not None:
        assert e.value.found == found, str(e.value)
    return e.value


def _owned_by(metas, rank, ch, field):
    x = getattr(metas[rank][ch], field)
    return next(t for t in range(metas[rank].num_tokens) if int(x[t]) != -1)


@pytest.mark.parametrize("ch,field", [("swa", "slot_mapping"), ("c4a", "compressed_slot_mapping"),
                                      ("c4i", "compressed_slot_mapping")])
def test_cp_partition_owned_twice_or_by_nobody(cp_metas, ch, field):
    check_cp_partition(cp_metas)
    m0, m1 = _clone(cp_metas[0]), _clone(cp_metas[1])
    assert int((getattr(m0[ch], field) != -1).sum()) not in (0, m0.num_tokens)  # both ranks own some
    # rank 0 also writes a token rank 1 owns: owned twice
    t = _owned_by(cp_metas, 1, ch, field)
    getattr(m0[ch], field)[t] = getattr(m1[ch], field)[t] + 10**6
    err = _partition_raises([m0, cp_metas[1]], ch, "ranks writing", found=[0, 1])
    assert err.token == t
    # rank 1 drops its own token: owned by nobody
    m1 = _clone(cp_metas[1])
    getattr(m1[ch], field)[t] = -1
    err = _partition_raises([cp_metas[0], m1], ch, "ranks writing", found=[])
    assert err.token == t
    # the two ranks' slots of a token swapped: each writes a token it does not own
    m0, m1 = _clone(cp_metas[0]), _clone(cp_metas[1])
    t0 = _owned_by(cp_metas, 0, ch, field)
    x0, x1 = getattr(m0[ch], field), getattr(m1[ch], field)
    x0[t0], x1[t0] = x1[t0].clone(), x0[t0].clone()
    _partition_raises([m0, m1], ch, "ranks writing", found=[1])


def test_cp_partition_lens_and_batch(cp_metas):
    m1 = _clone(cp_metas[1])
    m1["c4i"].lens[3] += 1
    err = _partition_raises([cp_metas[0], m1], "c4i", "summed over ranks")
    assert err.token == 3
    m1 = _clone(cp_metas[1])
    m1.seq_lens[0] += 1
    _partition_raises([cp_metas[0], m1], "batch", "another batch")
    with pytest.raises(ValueError, match="cp_world_size"):
        check_cp_partition(cp_metas[:1])
