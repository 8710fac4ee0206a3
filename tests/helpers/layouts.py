"""The small layouts the tests share."""

from __future__ import annotations

from dsv4_index import DSV4Layout

from helpers import ROOT

TINY = ROOT / "dsv4_index" / "configs" / "tiny.json"
# two layers (ratios 4 and 16) of the tiny model's shape, for the scheduler and ownership tests
TWO_LAYERS = dict(num_hidden_layers=2, compress_ratios=[4, 16], sliding_window=16, index_topk=8)
# circular c128_state (W 16, capacity 24: at most 9 tokens per request and step); and c4_state too
# (W 8, capacity 12: at most 5 tokens)
CIRCULAR = {"c128_state": 24}
CIRCULAR_BOTH = {"c128_state": 24, "c4_state": 12}


def tiny_layout(**kw) -> DSV4Layout:
    """``configs/tiny.json``: mla blocks of 32, swa blocks of 4, causal indexer indices; ``kw`` overrides."""
    args = dict(max_model_len=256, mla_block_size=32, swa_block_size=4, indexer_causal_indices=True)
    args.update(kw)
    return DSV4Layout.from_config(TINY, **args)


def two_layer_layout(max_model_len=256, circular=None) -> DSV4Layout:
    """:data:`TWO_LAYERS`: mla bs 32 (full, prefix-cacheable), swa bs 8 W 16, c4_state bs 4 W 8, c128_state bs 8
    W 16 (ring tables by default); ``circular``: group name -> capacity."""
    return DSV4Layout.from_config(TWO_LAYERS, max_model_len, mla_block_size=32, swa_block_size=8,
                                  c4_state_block_size=4, c128_state_block_size=8, circular=circular)


def flash_layout(**kw) -> DSV4Layout:
    """The shipped V4-Flash config (``max_model_len`` 2048 unless given)."""
    return DSV4Layout.from_config("flash", max_model_len=kw.pop("max_model_len", 2048), **kw)


def trace_layout(kind: str) -> DSV4Layout:
    """:data:`TWO_LAYERS` for the scheduler traces of the ownership tests: mla bs 32 (full, prefix-cacheable), swa
    bs 8 W 16, c4_state bs 4 W 8, c128_state bs 8 W 16; ``kind``: ``"rings"``, ``"full_tables"`` (plain sliding
    tables), ``"circular"`` (c128_state 24, c4_state 12) or ``"hybrid"`` (kernel blocks mla 16, swa 4)."""
    kw: dict = dict(mla_block_size=32, swa_block_size=8, c4_state_block_size=4, c128_state_block_size=8)
    if kind == "circular":
        kw["circular"] = {"c128_state": 24, "c4_state": 12}
    elif kind == "full_tables":
        kw["sliding_tables"] = "full"
    elif kind == "hybrid":
        kw["kernel_block_size"] = {"mla": 16, "swa": 4}
    return DSV4Layout.from_config(TWO_LAYERS, 256, **kw)
