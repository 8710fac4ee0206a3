"""The audit's numbers on layouts beyond V4's two ratios, and its arguments (issue 39, cases 2, 9, 10, 11)."""

from __future__ import annotations

import pytest

from dsv4_index import DSV4Layout
from dsv4_index.tools.audit import audit

MLA, IDX, C4_STATE, C128_STATE = 584, 132, 2 * 2 * (512 + 128) * 4, 2 * 512 * 4   # fp8_ds_mla rows (bytes)


def _cfg(ratios, **extra):
    return dict(num_hidden_layers=len(ratios), compress_ratios=list(ratios), sliding_window=8, index_topk=4, **extra)


def test_bytes_per_token_divides_each_layer_by_its_own_ratio():
    # three ratios: 4 is indexed (cache + indexer rows), 16 and 8 causal (cache rows only); each by its own ratio
    a = audit(DSV4Layout.from_config(_cfg([0, 4, 16, 8, 0]), 1024))
    g = {r["name"]: r for r in a["groups"]}
    assert g["mla"]["bytes_per_token"] == (MLA + IDX) / 4 + MLA / 16 + MLA / 8 == 288.5
    assert g["swa"]["bytes_per_token"] == 5 * MLA


def test_bytes_per_token_of_v41_counts_the_kv_sources_only():
    # tiny_v41: ratios (0, 2, 2, 1, 1, 0), kv sources 1 and 3: layers 2 and 4 read their source's cache and state
    a = audit(DSV4Layout.from_config("tiny_v41", 1024))
    g = {r["name"]: r for r in a["groups"]}
    assert g["mla"]["bytes_per_token"] == (MLA + IDX) / 2 + (MLA + IDX) / 1
    assert g["c2_state"]["bytes_per_token"] == C4_STATE          # layer 1's state only (indexed kind: kv + index)
    assert g["swa"]["bytes_per_token"] == 6 * MLA
    assert a["warnings"] == [] or all("#16270" in w for w in a["warnings"])


# ---------------------------------------------------------------------------------------------- cases 9 and 11
@pytest.mark.parametrize("kw,name", [
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(num_speculative_tokens="2"), "num_speculative_tokens"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"),
    (dict(max_num_batched_tokens=2 ** 70), "max_num_batched_tokens"),
    (dict(chunks=[-100]), "chunks"), (dict(chunks=512), "chunks"), (dict(chunks=[0]), "chunks"),
    (dict(chunks=["512"]), "chunks"), (dict(chunks=[2 ** 70]), "chunks"),
    (dict(draft_groups=["nope"]), "draft_groups"), (dict(draft_groups="swa"), "draft_groups"),
    (dict(short_prompt=-1), "short_prompt"), (dict(num_hidden_layers=-1), "num_hidden_layers"),
    (dict(num_hidden_layers=99), "num_hidden_layers"), (dict(draft_drop="x"), "draft_drop")])
def test_bad_arguments_are_refused_by_name(kw, name):
    lay = DSV4Layout.from_config("flash", 8192)
    with pytest.raises((ValueError, TypeError), match=rf"^{name}"):
        audit(lay, **kw)


@pytest.mark.parametrize("layout", [None, "flash", {"groups": []}])
def test_a_layout_that_is_not_one_is_a_type_error(layout):
    with pytest.raises(TypeError, match=r"^layout must be a DSV4Layout"):
        audit(layout)


def test_good_arguments_still_audit():
    lay = DSV4Layout.from_config("flash", 8192, groups="vllm")
    a = audit(lay, num_speculative_tokens=1, max_num_batched_tokens=1 << 20, chunks=(1, 512),
              draft_groups=("swa_1",), num_hidden_layers=43)
    assert [g["name"] for g in a["groups"] if g["draft"]] == ["swa_1"] and a["groups"][0]["demand"][1] >= 1
