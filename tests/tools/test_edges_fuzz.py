"""Fuzz the edges users meet: command-line arguments (every command, random options and values) and config
dicts with explicit ``groups=`` lists. A CLI run must end in exit status 0 or 1 (a replay that found a
problem), or 2 with ONE stderr line and no traceback; a config must give a layout (and a pipeline) or a
one-line ``ValueError`` naming the config, whose ``groups`` errors carry the key path as their field.
Anything else fails.

Bounded by time, deterministic by seed: ``DSV4_FUZZ_SECONDS`` (default 20, split between the two),
``DSV4_FUZZ_SEED`` (default 0). A long run::

    nice python tests/tools/test_edges_fuzz.py --seconds 600 --seed 1
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

SECONDS = float(os.environ.get("DSV4_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("DSV4_FUZZ_SEED", "0"))
NUMBERS = ["0", "1", "-1", "7", "64", "1.5", "1e3", "0x10", "", " ", "abc", "\u00e9", str(2 ** 31), str(2 ** 63),
           str(10 ** 20), "-" + str(10 ** 20), "nan", "inf", "--", "1_000"]
DEVICES = ["cpu", "cuda", "cuda:0", "cuda:7", "cuda:-1", "meta", "mps", "xpu", "foo", "", "cpu:0", "CPU", "cuda:x"]
CONFIGS = ["tiny", "flash", "pro", "nope", "", "/", "{tmp}", "{tmp}/missing.json", "{tmp}/bad.json",
           "{tmp}/good.json", "{tmp}/trace.jsonl"]
OUTS = ["{tmp}/x.png", "{tmp}", "{tmp}/", "{tmp}/x", "{tmp}/x.xyz", "{tmp}/bad.json/x.png", "", "/proc/x.png",
        "{tmp}/new/dir/x.svg"]
OPTIONS = {
    "layout": {"--config": CONFIGS, "--max-model-len": NUMBERS},
    "demo": {"--config": CONFIGS, "--max-model-len": ["64", "1024", *NUMBERS], "--device": DEVICES},
    # NOTE: inspect draws ~3 s per valid run; its sizes stay small (a valid 2**24 context would be minutes)
    "inspect": {"--config": ["tiny", "nope", "{tmp}/bad.json"], "--max-model-len": ["0", "abc", "-5", str(10 ** 20)],
                "--device": DEVICES, "--seed": NUMBERS, "--requests": ["0", "-1", "x", str(10 ** 9), "3"],
                "--out": OUTS},
    "replay": {"--config": CONFIGS, "--device": DEVICES, "--seed": NUMBERS, "--backend": ["triton", "reference", "x"],
               "--no-progress": None},
}
TRACES = ["{tmp}/trace.jsonl", "{tmp}/missing.jsonl", "{tmp}", "{tmp}/bad.json", "{tmp}/good.json", ""]


def _files(tmp: Path) -> None:
    from dsv4_index import DSV4Layout, MetadataPipeline
    from dsv4_index.config import shipped_config
    from dsv4_index.tools.trace import record_steps

    (tmp / "good.json").write_text(json.dumps(shipped_config("tiny")))
    (tmp / "bad.json").write_text('{"num_hidden_layers": NaN')
    lay = DSV4Layout.from_config("tiny", max_model_len=64, mla_block_size=16, swa_block_size=8)
    with record_steps(MetadataPipeline(lay, 2, 8, "cpu", backend="reference"), tmp / "trace.jsonl"):
        pass


def random_argv(rng: random.Random, tmp: Path) -> list:
    cmd = rng.choice(list(OPTIONS) + ["nope", "--version", ""])
    argv = [cmd] if cmd else []
    if cmd == "replay" and rng.random() < 0.9:
        argv.append(rng.choice(TRACES).format(tmp=tmp))
    opts = OPTIONS.get(cmd, {"--config": CONFIGS})
    for _ in range(rng.randint(0, 3)):
        opt = rng.choice(list(opts) + ["--bogus"])
        vals = opts.get(opt, NUMBERS)
        argv += [opt] if vals is None else [opt, rng.choice(vals).format(tmp=tmp)]
    if cmd == "inspect" and "--out" not in argv:
        argv += ["--out", str(tmp / "pic.png")]
    if cmd == "inspect" and "--config" not in argv:
        argv += ["--config", "tiny"]   # NOTE: the default (flash, 300 requests) takes 10 s a picture
    if rng.random() < 0.05:
        argv.pop(rng.randrange(len(argv))) if argv else None
    return argv


def run_cli(tmp: Path, seconds: float, seed: int) -> Counter:
    from dsv4_index.tools.cli import main

    _files(tmp)
    rng, out, stop = random.Random(seed), Counter(), time.monotonic() + seconds
    while time.monotonic() < stop:
        argv = random_argv(rng, tmp)
        err, so = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(so):
                try:
                    rc = main(argv)
                except SystemExit as e:
                    rc = e.code
        except BaseException as e:   # noqa: BLE001 -- the property under test
            raise AssertionError(f"cli {argv!r} (seed {seed}): {type(e).__name__}: {e}") from e
        text = err.getvalue().strip()
        if argv and argv[0] == "--version" or (rc == 0 and "--help" in argv):
            out["version / help"] += 1
            continue
        assert rc in (0, 1, 2), (argv, rc, text)
        assert "Traceback" not in text, (argv, text)
        if rc == 2:
            assert text.count("\n") == 0 and text.startswith("python -m dsv4_index"), (argv, text)
        out[f"exit {rc}"] += 1
    return out


SWAPS = [None, True, 0, -1, 1, 2, 4, 0.5, float("nan"), float("inf"), -float("inf"), "x", "", [], {}, [5], ["x"],
         {"a": 1}, 2 ** 31, 2 ** 63, 10 ** 30, "model.layers.3.attn.swa_cache", "mla", "swa", "c4_state"]
GROUP_KEYS = ["role", "layers", "layer_names", "block_size", "name", "window", "x"]


def _swap(rng: random.Random):
    return copy.deepcopy(rng.choice(SWAPS))   # NOTE: a fresh copy: mutants never share (or grow) a list


def random_groups(rng: random.Random, ratios):
    base = [dict(role="mla"), dict(role="swa"), dict(role="c4_state"), dict(role="c128_state")]
    if rng.random() < 0.2:
        return rng.choice([_swap(rng), "vllm", base])
    groups = [dict(g) for g in base]
    for _ in range(rng.randint(1, 3)):
        g = rng.choice(groups)
        if not isinstance(g, dict):
            continue
        k = rng.choice(GROUP_KEYS)
        r = rng.random()
        if r < 0.4:
            g[k] = _swap(rng)
        elif r < 0.6 and k in ("layers", "layer_names"):
            g[k] = [_swap(rng) if rng.random() < 0.3 else
                    (rng.randrange(len(ratios)) if k == "layers" else f"model.layers.{rng.randrange(len(ratios))}."
                     + rng.choice(["attn", "swa_cache", "state_cache"])) for _ in range(rng.randint(0, 4))]
        elif r < 0.8:
            g.pop(k, None)
        else:
            groups.insert(rng.randrange(len(groups) + 1), rng.choice([dict(g), _swap(rng)]))
    return groups


def run_config_dicts(seconds: float, seed: int) -> Counter:
    from dsv4_index import DSV4Layout, MetadataPipeline
    from dsv4_index.config import ConfigError, shipped_config

    rng, out, stop = random.Random(seed), Counter(), time.monotonic() + seconds
    fields = ["num_hidden_layers", "num_nextn_predict_layers", "sliding_window", "index_topk", "compress_ratios",
              "layer_types", "compress_rates", "compress_rate_csa"]
    while time.monotonic() < stop:
        d = shipped_config(rng.choice(["tiny", "flash"]))
        for _ in range(rng.randint(0, 2)):
            k = rng.choice(fields)
            if rng.random() < 0.7:
                d[k] = _swap(rng)
            elif k == "compress_ratios" and isinstance(d.get(k), list) and d[k]:
                d[k][rng.randrange(len(d[k]))] = _swap(rng)
            else:
                d.pop(k, None)
        ratios = d.get("compress_ratios") if isinstance(d.get("compress_ratios"), list) else None
        groups = random_groups(rng, ratios or [0]) if rng.random() < 0.7 else None
        mml = rng.choice([64, 1024, 4096, 0, -1, 2 ** 40, 1.5, "x"])
        what = f"config {json.dumps(d, default=str)[:200]} groups {groups!r} max_model_len {mml!r}"
        try:
            lay = DSV4Layout.from_config(d, max_model_len=mml, groups=groups)
            MetadataPipeline(lay, 2, 16, "cpu", backend="reference")
        except ValueError as e:
            msg = str(e)
            assert "\n" not in msg, (what, msg)
            if isinstance(e, ConfigError) and msg.startswith("from_config(dict): groups"):
                assert e.field and msg.startswith(f"from_config(dict): {e.field}"), (what, msg, e.field)
            out["clean error"] += 1
            continue
        except Exception as e:   # noqa: BLE001 -- the property under test
            raise AssertionError(f"{what} (seed {seed}): {type(e).__name__}: {e}") from e
        assert not any(isinstance(v, float) and not math.isfinite(v) for v in (lay.sliding_window, lay.index_topk))
        out["accepted"] += 1
    return out


@pytest.mark.slow  # ./dev quick skips it
def test_cli_argument_fuzz(tmp_path):
    out = run_cli(tmp_path, 0.6 * SECONDS, SEED)
    print(dict(out))
    assert out["exit 2"] > 0 and sum(out.values()) > 5


@pytest.mark.slow  # ./dev quick skips it
def test_config_dict_fuzz():
    out = run_config_dicts(0.4 * SECONDS, SEED)
    print(dict(out))
    assert out["clean error"] > 0 and out["accepted"] > 0


if __name__ == "__main__":
    import argparse
    import sys
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=SECONDS, help="total, split 60/40 between the CLI and configs")
    ap.add_argument("--seed", type=int, default=SEED)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        cli = run_cli(Path(d), 0.6 * a.seconds, a.seed)
        cfg = run_config_dicts(0.4 * a.seconds, a.seed)
        print(f"seed {a.seed}, {time.monotonic() - t0:.0f} s")
        print(f"cli    : {sum(cli.values())} runs, {dict(cli)}")
        print(f"configs: {sum(cfg.values())} dicts, {dict(cfg)}")
