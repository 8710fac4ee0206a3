import json
import math
import re
from pathlib import Path

import pytest
import torch

from dsv4_index._common import cp_owned_count
from dsv4_index.geometry import ChannelSpec, DSV4Layout, GroupSpec

CONFIGS = Path(__file__).resolve().parents[2] / "dsv4_index" / "configs"
BLOCKS = {"mla": 256, "swa": 64, "c4_state": 4, "c128_state": 8}


def load(name):
    with open(CONFIGS / f"{name}.json") as f:
        return json.load(f)


def small_cfg(ratios, window=16, topk=8):
    return {"num_hidden_layers": len(ratios) - 1, "num_nextn_predict_layers": 1,
            "compress_ratios": list(ratios), "sliding_window": window, "index_topk": topk}


def causal_width(L, R):
    return math.ceil(math.ceil(L / R) / 128) * 128


@pytest.mark.parametrize("name", ["flash", "pro", "tiny"])
@pytest.mark.parametrize("L", [1, 255, 256, 257, 4096, 100_003])
def test_published_layouts(name, L):
    cfg = load(name)
    lay = DSV4Layout.from_config(CONFIGS / f"{name}.json", L)
    nz = sorted({r for r in cfg["compress_ratios"] if r})
    r4, r128 = nz
    W = cfg["sliding_window"]
    assert [g.name for g in lay.groups] == ["mla", "swa", "c4_state", "c128_state"]
    assert [g.gid for g in lay.groups] == [0, 1, 2, 3]
    assert [g.kind for g in lay.groups] == ["full", "sliding", "sliding", "sliding"]
    assert [g.window for g in lay.groups] == [None, W, 2 * r4, r128]
    assert [g.prefix_cacheable for g in lay.groups] == [True, False, False, False]
    assert [g.ring for g in lay.groups] == [False, True, True, True]  # sliding tables are rings by default
    assert [g.sharded for g in lay.groups] == [True, True, False, False]
    for g in lay.groups:
        assert g.block_size == BLOCKS[g.name] and g.blocks_per_kv_block == 1
        assert g.table_width == -(-L // BLOCKS[g.name])
    assert list(lay.channels) == ["c4a", "c4i", "c128a", "swa", "c4_state", "c128_state"]
    ch = lay.channels
    assert (ch["c4a"].gid, ch["c4a"].compress_ratio, ch["c4a"].rows_per_block) == (0, r4, 256 // r4)
    assert (ch["c4i"].gid, ch["c4i"].compress_ratio, ch["c4i"].index_width) == (0, r4, None)
    assert (ch["c128a"].gid, ch["c128a"].compress_ratio, ch["c128a"].rows_per_block) == (0, r128, 256 // r128)
    assert ch["c128a"].index_width == causal_width(L, r128)
    assert (ch["swa"].gid, ch["swa"].window, ch["swa"].index_width, ch["swa"].rows_per_block) == (1, W, W, 64)
    assert (ch["c4_state"].gid, ch["c4_state"].window, ch["c4_state"].index_width) == (2, 2 * r4, 2 * r4)
    assert (ch["c128_state"].gid, ch["c128_state"].window, ch["c128_state"].index_width) == (3, r128, r128)
    assert ch["swa"].outputs == {"slot_mapping", "indices", "lens"}
    assert ch["c4_state"].outputs == ch["c128_state"].outputs == {"slot_mapping", "indices", "lens"}
    assert ch["c4a"].outputs == {"compressed_slot_mapping"}  # top-k conversion is a method, per layer
    assert ch["c4i"].outputs == {"compressed_slot_mapping", "lens", "ks", "ke", "cu", "decode_lens"}
    assert ch["c128a"].outputs == {"compressed_slot_mapping", "indices", "lens"}
    assert lay.compress_ratios == tuple(cfg["compress_ratios"])
    assert lay.num_layers == cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    assert lay.index_topk == cfg["index_topk"] and lay.sliding_window == W
    assert (lay.c4_ratio, lay.c128_ratio) == (r4, r128)
    assert lay.max_model_len == L
    assert not any(c.compact for c in ch.values())


@pytest.mark.parametrize("L,expect", [(1, 128), (128 * 128, 128), (128 * 128 + 1, 256), (1 << 20, 8192)])
def test_c128a_width_values(L, expect):
    assert DSV4Layout.from_config(load("flash"), L).channels["c128a"].index_width == expect


def test_sources_agree():
    a = DSV4Layout.from_config(load("tiny"), 1000)
    b = DSV4Layout.from_config(str(CONFIGS / "tiny.json"), 1000)
    assert a == b


def test_only_swa_and_c128_layers():
    lay = DSV4Layout.from_config(small_cfg([0, 128, 128, 0]), 1000)
    assert [(g.gid, g.name) for g in lay.groups] == [(0, "mla"), (1, "swa"), (2, "c128_state")]
    assert list(lay.channels) == ["c128a", "swa", "c128_state"]
    assert lay.channels["c128_state"].gid == 2 and lay.channels["c128_state"].window == 128
    assert lay.c4_ratio is None and lay.c128_ratio == 128
    assert [lay.layer_kind(i) for i in range(4)] == ["swa", "c128", "c128", "swa"]


def test_only_swa_and_c4_layers():
    lay = DSV4Layout.from_config(small_cfg([4, 0, 4]), 1000)
    assert [(g.gid, g.name) for g in lay.groups] == [(0, "mla"), (1, "swa"), (2, "c4_state")]
    assert list(lay.channels) == ["c4a", "c4i", "swa", "c4_state"]
    assert lay.channels["c4_state"].gid == 2


def test_only_swa_layers():
    lay = DSV4Layout.from_config(small_cfg([0, 0]), 1000)
    assert [(g.gid, g.name) for g in lay.groups] == [(0, "swa")]
    assert list(lay.channels) == ["swa"] and lay.channels["swa"].gid == 0
    with pytest.raises(ValueError, match="mla"):
        lay.group("mla")


def test_indexer_causal_indices():
    lay = DSV4Layout.from_config(load("tiny"), 1000, indexer_causal_indices=True)
    c4i = lay.channels["c4i"]
    assert c4i.index_width == causal_width(1000, 4) == 256
    assert "indices" in c4i.outputs and "indices" not in lay.channels["c4a"].outputs


def test_custom_block_sizes():
    lay = DSV4Layout.from_config(load("tiny"), 1000, mla_block_size=64, swa_block_size=16,
                                 c4_state_block_size=8, c128_state_block_size=16)
    assert [g.block_size for g in lay.groups] == [64, 16, 8, 16]
    assert [g.table_width for g in lay.groups] == [16, 63, 125, 63]
    assert lay.channels["c128a"].rows_per_block == 64 // 16
    assert lay.channels["swa"].rows_per_block == 16


def test_kernel_block_size_hybrid():
    lay = DSV4Layout.from_config(load("tiny"), 1000, kernel_block_size=64)
    mla = lay.group("mla")
    assert (mla.block_size, mla.blocks_per_kv_block, mla.alloc_block_size) == (64, 4, 256)
    assert mla.table_width == math.ceil(1000 / 64)
    assert lay.channels["c4a"].rows_per_block == 16 and lay.channels["c128a"].rows_per_block == 4
    assert lay.group("swa").blocks_per_kv_block == 1
    with pytest.raises(ValueError, match="kernel_block_size"):
        DSV4Layout.from_config(load("tiny"), 1000, kernel_block_size=96)
    with pytest.raises(ValueError, match="kernel_block_size"):
        DSV4Layout.from_config(load("flash"), 1000, kernel_block_size=64)  # 64 % 128 != 0


@pytest.mark.parametrize("L", [1, 1000, 4097, 65536])
@pytest.mark.parametrize("wc,il", [(2, 1), (4, 16), (8, 64), (3, 4)])
def test_cp_widths(L, wc, il):
    lay = DSV4Layout.from_config(load("flash"), L, cp_world_size=wc, cp_interleave=il)
    assert (lay.cp_world_size, lay.cp_interleave) == (wc, il)
    per_rank = math.ceil(math.ceil(L / wc) / il) * il
    n = torch.tensor(L)
    for g in lay.groups:
        if not g.sharded:  # NOTE: replicated state groups hold every position on every rank
            assert g.name in ("c4_state", "c128_state") and g.table_width == math.ceil(L / g.block_size)
            continue
        assert g.table_width >= math.ceil(per_rank / g.block_size)
        for r in range(wc):  # every rank's tokens fit in its row
            assert int(cp_owned_count(n, wc, r, il)) <= g.table_width * g.block_size
        for c in lay.channels_of(g.gid):
            rows = torch.tensor(-(-L // c.compress_ratio))
            for r in range(wc):
                assert int(cp_owned_count(rows, wc, r, il)) <= g.table_width * c.rows_per_block
    assert lay.group("swa").table_width == math.ceil(per_rank / 64)


def test_cp_width_formula_when_tokens_dominate():
    lay = DSV4Layout.from_config(load("flash"), 1 << 16, cp_world_size=4, cp_interleave=64)
    assert [g.table_width for g in lay.groups] == [(1 << 14) // 256, (1 << 14) // 64, (1 << 16) // 4, (1 << 16) // 8]


@pytest.mark.parametrize("mutate,match", [
    (lambda c: c.pop("compress_ratios"), "compress_ratios"),
    (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
    (lambda c: c.pop("sliding_window"), "sliding_window"),
    (lambda c: c.pop("index_topk"), "index_topk"),
    (lambda c: c["compress_ratios"].append(0), "num_nextn_predict_layers"),
    (lambda c: c.__setitem__("compress_ratios", [0, 4, 16, 24, 0]), "divisible"),  # NOTE: 3 ratios: V4.1 family
    (lambda c: c.__setitem__("compress_ratios", [0, 4, 3, 4, 0]), "divisible"),
    (lambda c: c.__setitem__("compress_ratios", [0, 4, -1, 4, 0]), "compress_ratios"),
    (lambda c: c.__setitem__("sliding_window", 0), "sliding_window"),
])
def test_config_errors(mutate, match):
    cfg = load("tiny")
    mutate(cfg)
    with pytest.raises(ValueError, match=match):
        DSV4Layout.from_config(cfg, 1000)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_model_len=1000, mla_block_size=200), "mla_block_size"),
    (dict(max_model_len=1000, swa_block_size=0), "swa_block_size"),
    (dict(max_model_len=1000, cp_world_size=0), "cp_world_size"),
    (dict(max_model_len=1000, kernel_block_size={"nope": 4}), "nope"),
    (dict(max_model_len=1000, sliding_tables="rings"), "sliding_tables"),
    (dict(max_model_len=1000, circular={"mla": 64}), "circular"),
    (dict(max_model_len=1000, circular={"nope": 64}), "circular"),
    (dict(max_model_len=1000, circular={"c128_state": 8}), "circular"),        # below its window 16
    (dict(max_model_len=1000, circular={"c4_state": 0}), "circular"),
    (dict(max_model_len=1000, circular={"c4_state": 8.0}), "circular"),
    (dict(max_model_len=1000, circular={"c4_state": 8}, kernel_block_size={"c4_state": 3}), "kernel_block_size"),
    (dict(max_model_len=1000, cp_interleave=0), "cp_interleave"),
])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DSV4Layout.from_config(load("tiny"), **kwargs)


def test_bad_config_sources(tmp_path):
    with pytest.raises(ValueError, match="config"):
        DSV4Layout.from_config(tmp_path / "missing.json", 100)
    with pytest.raises(ValueError, match="config"):
        DSV4Layout.from_config(42, 100)
    (tmp_path / "config.json").write_text(json.dumps(load("tiny")))
    assert DSV4Layout.from_config(tmp_path, 100) == DSV4Layout.from_config(load("tiny"), 100)


def test_group_channels_of_and_str():
    lay = DSV4Layout.from_config(load("flash"), 4096)
    assert lay.group("swa").gid == 1
    assert [c.name for c in lay.channels_of(0)] == ["c4a", "c4i", "c128a"]
    assert [c.name for c in lay.channels_of(3)] == ["c128_state"]
    with pytest.raises(ValueError, match="gid"):
        lay.channels_of(4)
    text = str(lay)
    for g in lay.groups:
        assert g.name in text
    for c in lay.channels:
        assert c in text
    assert "16" in text and "1024" in text  # widths of mla (4096/256) and c4_state (4096/4)


def test_with_channel():
    lay = DSV4Layout.from_config(load("tiny"), 1000)
    spec = ChannelSpec("my_c16", gid=0, compress_ratio=16, rows_per_block=16, outputs={"slot_mapping"})
    new = lay.with_channel(spec)
    assert new.channels["my_c16"] is spec and "my_c16" not in lay.channels
    assert [c.name for c in new.channels_of(0)][-1] == "my_c16"
    assert new.groups == lay.groups
    assert isinstance(spec.outputs, frozenset)
    with pytest.raises(ValueError, match="already"):
        new.with_channel(spec)
    with pytest.raises(ValueError, match="gid"):
        lay.with_channel(ChannelSpec("x", gid=9, compress_ratio=1, rows_per_block=1))
    with pytest.raises(ValueError, match="rows_per_block"):
        lay.with_channel(ChannelSpec("x", gid=1, compress_ratio=1, rows_per_block=65))
    with pytest.raises(ValueError, match="rows_per_block"):
        ChannelSpec("x", gid=0, compress_ratio=4, rows_per_block=0)


# ----------------------------------------------------------------------------------------------
# ring tables, circular groups, compact compressed channels
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 64, 1000, 8192])
def test_ring_columns(T):
    lay = DSV4Layout.from_config(load("flash"), 1 << 20)
    for g in lay.groups:
        cols, ring = g.columns(T)
        if g.kind == "full":
            assert (cols, ring) == (g.table_width, 0)
            continue
        want = math.ceil((g.window - 1 + T) / g.block_size) + 1  # newest blocks one step can read or write
        assert want < g.table_width and (cols, ring) == (want, want), (g.name, T)
    assert lay.group("c4_state").columns(8192) == (2051, 2051)     # instead of 262144 columns
    small = DSV4Layout.from_config(load("flash"), 1024)            # a ring no narrower than the row: full width
    assert small.group("swa").columns(8192) == (16, 0) and small.group("swa").ring


def test_full_sliding_tables():
    lay = DSV4Layout.from_config(load("flash"), 1 << 20, sliding_tables="full")
    for g in lay.groups:
        assert not g.ring and g.columns(8192) == (g.table_width, 0)
    assert lay.group("c4_state").table_width == (1 << 20) // 4
    ring = DSV4Layout.from_config(load("flash"), 1 << 20)
    assert ring.channels == lay.channels and [g.table_width for g in ring.groups] == [g.table_width for g in lay.groups]


def test_circular_groups():
    lay = DSV4Layout.from_config(load("tiny"), 1000, circular={"c4_state": 16, "c128_state": 32})
    c4s, c128s, swa = lay.group("c4_state"), lay.group("c128_state"), lay.group("swa")
    assert (c4s.kind, c4s.block_size, c4s.window, c4s.ring) == ("circular", 16, 8, False)
    assert (c128s.kind, c128s.block_size, c128s.window, c128s.ring) == ("circular", 32, 16, False)
    assert (swa.kind, swa.ring) == ("sliding", True)
    assert c4s.columns(64) == c128s.columns(8192) == (1, 1)  # one block of `capacity` rows per request
    assert lay.channels["c4_state"].rows_per_block == 16 and lay.channels["c4_state"].index_width == 8
    exact = DSV4Layout.from_config(load("tiny"), 1000, circular={"swa": 8})  # capacity == window
    assert exact.group("swa").kind == "circular" and exact.group("swa").block_size == 8


@pytest.mark.parametrize("kw,match", [
    (dict(kind="ring"), "kind"),
    (dict(kind="full", ring=True, window=None), "ring"),
    (dict(kind="circular", ring=True), "ring"),
    (dict(kind="circular", block_size=4, window=8), "capacity"),
    (dict(kind="sliding", window=None), "window"),
    (dict(kind="full", window=8), "window"),
    (dict(block_size=0), "block_size"),
    (dict(table_width=True), "table_width"),
    (dict(blocks_per_kv_block=0), "blocks_per_kv_block"),
])
def test_group_spec_errors(kw, match):
    args = dict(gid=0, name="g", kind="sliding", block_size=8, window=8, prefix_cacheable=False, table_width=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        GroupSpec(**args)


def test_group_spec_defaults():
    g = GroupSpec(0, "g", "full", 16, None, True, 4)
    assert (g.ring, g.sharded, g.blocks_per_kv_block) == (False, True, 1)
    assert g.alloc_block_size == g.kernel_block_size == 16
    h = GroupSpec(1, "h", "sliding", 16, 32, False, 100, blocks_per_kv_block=4, ring=True, sharded=False)
    assert h.alloc_block_size == 64 and h.columns(10) == (math.ceil(41 / 16) + 4, 7)  # + f: whole allocation blocks


def test_compact_compressed():
    lay = DSV4Layout.from_config(load("tiny"), 1000, compact_compressed=True, indexer_causal_indices=True)
    for name, c in lay.channels.items():
        extra = {"compact_slot_mapping", "compact_cu"}
        if c.compress_ratio > 1:
            assert c.compact and extra <= c.outputs, name
        else:
            assert not c.compact and not extra & c.outputs, name
    plain = DSV4Layout.from_config(load("tiny"), 1000, indexer_causal_indices=True)
    assert {n: c.outputs - {"compact_slot_mapping", "compact_cu"} for n, c in lay.channels.items()} == \
        {n: c.outputs for n, c in plain.channels.items()}


def test_layouts_by_name():
    for name in ("flash", "pro", "tiny"):
        assert DSV4Layout.from_config(name, 4096) == DSV4Layout.from_config(CONFIGS / f"{name}.json", 4096)


def _readme_table():
    """Rows of the README's layout table, as dicts keyed by its header."""
    lines = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    head = next(i for i, ln in enumerate(lines) if re.match(r"\|\s*gid\s*\|\s*group\s*\|", ln))
    keys = [c.strip() for c in lines[head].strip().strip("|").split("|")]
    rows = []
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(keys, (c.strip() for c in line.strip().strip("|").split("|")))))
    return rows


def test_readme_layout_table_matches_the_flash_layout():
    lay = DSV4Layout.from_config("flash", 1 << 17)
    rows = _readme_table()
    assert len(rows) == len(lay.groups) and {"gid", "group", "block size", "channels"} <= set(rows[0])
    for row, g in zip(rows, lay.groups):
        group = row["group"]
        assert int(row["gid"]) == g.gid and re.match(r"`(\w+)`", group).group(1) == g.name
        assert int(row["block size"]) == g.block_size
        win = re.search(r"window (\d+)", group)
        assert (g.window is None and "full" in group) or (win and int(win.group(1)) == g.window), group
        if "sharded" in group or "replicated" in group:
            assert ("sharded" in group) == g.sharded, group
        if "table" in row:
            assert ("ring" in row["table"]) == g.ring, row["table"]
        listed = re.findall(r"`(\w+)`(?: \(R (\d+), S (\d+)\))?", row["channels"])
        assert [n for n, _, _ in listed] == [c.name for c in lay.channels_of(g.gid)], row["channels"]
        for n, r, s in listed:
            if r:
                c = lay.channels[n]
                assert (int(r), int(s)) == (c.compress_ratio, c.rows_per_block), n
