"""examples/flash_decode_step.py (issue 15): the scaled-down V4-Flash decode passes its own check on CPU
(reference metadata, the Triton attention kernel in the interpreter, caches of 2**31 reserved rows), its
layer counts come from the config, a corrupted index list fails the check, and a cache row outside the
block pool is not memory at all."""

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.scripts import hang_guard

pytestmark = pytest.mark.slow  # runs the V4-Flash example (./dev quick skips it)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "flash_decode_step.py"
FLASH = ROOT / "dsv4_index" / "configs" / "flash.json"
KINDS = ("swa", "c4", "c128")


def run(tmp_path, *args):
    out = tmp_path / "res.json"
    # NOTE: CPU runs the attention kernel in the interpreter; on a CUDA machine the example runs there
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = subprocess.run([sys.executable, str(SCRIPT), "--small", "--device", device, "--out", str(out), *map(str, args)],
                       cwd=ROOT, capture_output=True, text=True, timeout=hang_guard())
    return p.returncode, p.stdout + p.stderr, json.loads(out.read_text()) if out.exists() else None


def example():
    spec = importlib.util.spec_from_file_location("flash_decode_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def counts_from_json(cfg: dict) -> dict:
    """Independent count: ratio 0 -> swa, the smaller non-zero ratio -> c4, the larger -> c128."""
    n, ratios = cfg["num_hidden_layers"], cfg["compress_ratios"]
    lo = min(r for r in ratios if r)
    kind = lambda r: "swa" if r == 0 else ("c4" if r == lo else "c128")
    return ({k: sum(kind(r) == k for r in ratios[:n]) for k in KINDS},
            {k: sum(kind(r) == k for r in ratios[n:]) for k in KINDS})


def test_small_decode_passes_its_check(tmp_path):
    rc, out, res = run(tmp_path)
    assert rc == 0 and res["ok"] and res["fails"] == [], out
    assert "OK: every checked token" in out, out
    assert (res["storage"], res["attention_backend"], res["args"]["steps"], res["shape"]["B"]) == \
        ("virtual", "triton", 6, 8), out
    for k in KINDS:
        e = res["errors"][k]
        assert 6 * 4 <= e["tokens"] <= 6 * 4 * 2, (k, e)
        assert e["index_mismatch"] == 0 and e["value_mismatch"] == 0, (k, e)
        # NOTE: > 0: the kernel's bf16 output really is compared with an independent fp32 reference
        assert 1e-4 < e["rel"] < res["tolerances"]["rel"] and e["lse"] < res["tolerances"]["lse"], (k, e)
    assert res["counts"] == {"bad_writes": 0, "lens": 0, "below_-1": 0, "pad_out": 0}, res["counts"]
    # large values: slots at the top of int32 (C4A up to 2**31 - 1), a request at max_model_len
    ms = res["max_slot"]
    assert ms["c4"] >= 2 ** 31 - 2 ** 16 and ms["w_c4"] >= 2 ** 31 - 2 ** 16, ms
    assert min(ms["swa"], ms["w_swa"]) >= 2 ** 30 and ms["c128"] >= 2 ** 25, ms
    assert res["max_pos"] == res["shape"]["max_model_len"] - 1, res["max_pos"]
    assert res["pool"]["top"] * 64 == 2 ** 31, res["pool"]
    main, mtp = counts_from_json(json.loads(FLASH.read_text()))
    assert res["layer_counts"] == {"main": main, "mtp": mtp} and main == {"swa": 2, "c4": 21, "c128": 20}, res


def test_layer_counts_come_from_the_config():
    f = example()
    cfg = json.loads(FLASH.read_text())
    main, mtp = counts_from_json(cfg)
    assert f.layer_counts("flash") == f.layer_counts(str(FLASH)) == {"main": main, "mtp": mtp}
    changed = dict(cfg, compress_ratios=[0] * 6 + cfg["compress_ratios"][6:])
    main2, mtp2 = counts_from_json(changed)
    assert main2 == {"swa": 6, "c4": 19, "c128": 18}
    assert f.layer_counts(changed) == {"main": main2, "mtp": mtp2}


@pytest.mark.parametrize("kinds", [("c4",), ("swa", "c128")])
def test_a_corrupted_list_fails_the_check(tmp_path, kinds):
    """Entry 0 of every token's list repeats entry 1 (a duplicated key): only those kinds fail, both
    on the exact index rows and on the numerics."""
    rc, out, res = run(tmp_path, "--steps", 1, "--fault", *kinds)
    assert rc == 1 and not res["ok"] and "FAIL:" in out, out
    for k in KINDS:
        bad = k in kinds
        assert (f"{k} index rows" in res["fails"]) == bad and (f"{k} numerics" in res["fails"]) == bad, res["fails"]
        assert (res["errors"][k]["index_mismatch"] > 0) == bad, (k, res["errors"])


def test_virtual_cache_backs_only_the_pool():
    """The kernel's [2**31, D] view: pool rows are memory (NaN until written), row 0 too (the base
    pointer), anything else faults instead of returning data."""
    code = ("import sys, torch; sys.path.insert(0, 'examples'); import flash_decode_step as f\n"
            "c = f.Cache('x', 2**30, 2**30 + 64, 8, torch.bfloat16, torch.device('cpu'), True)\n"
            "assert c.full.shape == (2**31, 8) and c.phys.shape == (64, 8)\n"
            "assert c.full[2**30 + 5].isnan().all() and c.full[0].isnan().all()\n"
            "bad = torch.zeros((), dtype=torch.int64)\n"
            "c.write(torch.tensor([2**30 + 5, -1, 7]), torch.ones(3, 8, dtype=torch.bfloat16), bad)\n"
            "assert c.phys[5].eq(1).all() and c.full[2**30 + 5].eq(1).all() and int(bad) == 1\n"
            "print('pool rows ok', flush=True)\n"
            "c.full[2**29].sum()\n"
            "print('read outside the pool', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=hang_guard())
    assert "pool rows ok" in p.stdout and "outside" not in p.stdout, p.stdout + p.stderr
    assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stderr)


def test_share_is_computed_from_its_parts(tmp_path, capsys):
    """The timing table on made-up per-step times: counts x kernel times, metadata parts, share."""
    f = example()
    counts = {"main": {"swa": 2, "c4": 21, "c128": 20}, "mtp": {"swa": 1, "c4": 0, "c128": 0}}
    times = {"update_host_us": [None, 100.0, 300.0], "build_gpu_us": [None, 20.0, 20.0],
             "topk_gpu_us": [None, 80.0, 80.0], "attn_swa_us": [None, 10.0, 10.0],
             "attn_c4_us": [None, 50.0, 50.0], "attn_c128_us": [None, 30.0, 30.0]}
    err = {k: dict(rel=1e-3, lse=1e-6, index_mismatch=0, value_mismatch=0, tokens=8) for k in KINDS}
    res = dict(layer_counts=counts, errors=err, counts=dict.fromkeys(("bad_writes", "lens", "below_-1", "pad_out"), 0),
               storage="dense", starved=0, wall_s=1.0,
               max_slot=dict(w_swa=1, w_c4=1, w_c128=1, swa=1, c4=1, c128=1), max_pos=9, finished=0,
               shape=dict(B=1, T_pad=2))
    assert f.report(res, times, str(tmp_path / "r.json")) == 0
    t = json.loads((tmp_path / "r.json").read_text())["timings"]
    attn = 2 * 10 + 21 * 50 + 20 * 30
    assert t["step_attention_us"]["median"] == attn
    assert t["step_metadata_us"]["median"] == (200 + 400) / 2          # median of 200 and 400
    assert t["metadata_share"]["median"] == pytest.approx((200 / (200 + attn) + 400 / (400 + attn)) / 2)
    assert t["metadata_share_gpu"]["median"] == pytest.approx(100 / (100 + attn))
    out = capsys.readouterr().out
    assert "attention c4: 21 layers x 50.0 us" in out and "1050.0 us" in out and "OK:" in out, out
