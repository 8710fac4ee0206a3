"""The geometry audit (issue 28): the upstream failure geometries are flagged, sound ones are not."""

import json

from dsv4_index import DSV4Layout
from dsv4_index.tools.audit import audit, format_audit
from dsv4_index.tools.cli import main


def _warns(a, tag):
    return [w for w in a["warnings"] if tag in w]


def test_flash_default_is_clean_and_numbers_are_the_formulas():
    a = audit(DSV4Layout.from_config("flash", 8192))
    assert a["warnings"] == []
    assert a["scheduler_block"] == 256 and a["min_prefix_hit"] == 256 and a["min_prefix_hit_spec"] == 512
    g = {r["name"]: r for r in a["groups"]}
    assert g["swa"]["demand"] == {512: 11, 2048: 35, 8192: 131}           # cdiv(127 + C, 64) + 1
    assert g["mla"]["demand"] == {512: 2, 2048: 8, 8192: 32}
    assert g["swa"]["bytes_per_token"] == 44 * 584                          # 43 layers + MTP, one row each
    assert g["mla"]["bytes_per_token"] == 21 * (584 + 132) / 4 + 20 * 584 / 128


def test_vllm_51041_draft_group_reads_outside_the_write_mask():
    lay = DSV4Layout.from_config("flash", 8192, groups="vllm")
    assert audit(lay)["warnings"] == []
    # vLLM 0.33 drops a whole scheduler block for the draft: the read stays on a boundary of the mask
    assert audit(lay, num_speculative_tokens=1)["warnings"] == []
    # before the fix the draft group dropped its own 64-token block: reads [64, 192) against a mask of [128, 256)
    a = audit(lay, num_speculative_tokens=1, draft_drop="block")
    bad = _warns(a, "#51041")
    assert len(bad) == 1 and "'swa_1'" in bad[0]                       # the SWA sub-group holding MTP layer 43
    assert [r["name"] for r in a["groups"] if r["draft"]] == ["swa_1"]
    # a group block equal to the scheduler block: its own block is a scheduler block
    same = DSV4Layout.from_config("flash", 8192, groups="vllm", swa_block_size=256)
    assert _warns(audit(same, num_speculative_tokens=1, draft_drop="block"), "#51041") == []


def test_vllm_ascend_16270_lcm_scheduler_block():
    # C128 main group 4096 tokens (32 rows x 128), SWA 32, C4 state 2, C128 state 8: LCM = 4096
    lay = DSV4Layout.from_config("flash", 262144, mla_block_size=4096, swa_block_size=32, c4_state_block_size=2)
    a = audit(lay)
    assert a["scheduler_block"] == 4096 and a["min_prefix_hit"] == 4096 and a["hash_block"] == 2
    assert len(_warns(a, "#16270")) == 1 and "prefix hits need prompts longer than 4096" in a["warnings"][0]
    assert "8192" in _warns(audit(lay, num_speculative_tokens=1), "#16270")[0]


def test_vllm_ascend_15204_chunks_never_admitted():
    lay = DSV4Layout.from_config("flash", 8192)
    a = audit(lay, max_num_batched_tokens=512, chunks=(512, 2048))
    bad = _warns(a, "#15204")
    assert bad and all("2048 tokens" in w for w in bad)
    assert len(bad) == 3                                                  # swa, c4_state, c128_state rings


def test_cli_table_and_json(capsys):
    assert main(["audit", "--config", "flash", "--groups", "vllm", "--spec", "1", "--draft-drop", "block",
                 "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert [g["name"] for g in a["groups"]] == ["swa_0", "swa_1", "mla", "c4_state", "c128_state"]
    assert main(["audit", "--config", "pro"]) == 0
    out = capsys.readouterr().out
    assert "hash block 4, scheduler block (lcm of hashed block sizes) 256 tokens; minimum prefix hit 256 tokens" \
        in out and "no warnings" in out
    assert format_audit(a).count("WARNING") == 1
