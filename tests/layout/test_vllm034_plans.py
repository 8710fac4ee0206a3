"""vLLM 0.34.0's KV-cache plans (``fixtures/vllm034_*.json``, written by ``make_vllm_fixtures.py`` with vLLM 0.34.0's
own ``get_kv_cache_groups`` / ``KVCacheManager``) beside 0.33's: the layouts ``from_kv_cache_config`` builds from
them, the group lists read from the fixtures' layer names (independently of the library), and the allocations.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsv4_index import DSV4Layout

FIX = Path(__file__).resolve().parent / "fixtures"
PLANS = [("flash", "flash", 4096), ("flash_mtp", "flash", 4096), ("pro", "pro", 4096), ("pro_mtp", "pro", 4096),
         ("v41_flash", "v41_flash", 8192), ("v41_flash_dspark3", "v41_flash", 8192)]


def _load(version: str, name: str) -> dict:
    return json.loads((FIX / f"vllm{version}_{name}.json").read_text())


def _groups(plan: dict) -> list:
    """Per group: (layer indices of its names, block size, window, prefix-cacheable or None), read here."""
    return [(sorted({int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in g["layer_names"]}), g["block_size"],
             g["sliding_window"], g.get("prefix_cacheable")) for g in plan["kv_cache_groups"]]


def test_every_plan_has_a_034_fixture():
    assert sorted(p.name.replace("vllm034_", "") for p in FIX.glob("vllm034_*.json")) == \
        sorted(p.name.replace("vllm033_", "") for p in FIX.glob("vllm033_*.json"))


@pytest.mark.parametrize("name,config,max_len", PLANS, ids=[p[0] for p in PLANS])
def test_034_plan_builds_the_033_layout(name, config, max_len):
    new, old = _load("034", name), _load("033", name)
    assert new["vllm"].startswith("0.34.") and old["vllm"].startswith("0.33.")
    assert _groups(new) == _groups(old)  # NOTE: vLLM 0.34 plans DeepSeek-V4 / V4.1 as 0.33 does
    lay34 = DSV4Layout.from_kv_cache_config(new, config, max_len)
    lay33 = DSV4Layout.from_kv_cache_config(old, config, max_len)
    assert lay34.groups == lay33.groups and lay34.channels == lay33.channels
    assert [g.block_size for g in lay34.groups] == [g[1] for g in _groups(new)]


@pytest.mark.parametrize("name", ["alloc_flash", "alloc_flash_mtp", "alloc_pro", "alloc_pro_mtp"])
def test_034_allocations_equal_033(name):
    new, old = _load("034", name), _load("033", name)
    new.pop("vllm"), old.pop("vllm")
    assert new == old
