"""Every CLI command on every shipped config (issue 39, cases 10-12): ``layout``, ``demo``, ``audit``, ``inspect``
and ``replay`` on V4-Flash, V4-Pro, tiny, V4.1-Flash and tiny V4.1, with what they print true for V4.1 (its
ratios 1 and 2, the one-block ``c2_state`` ring); ``--groups`` files that cannot be used are named."""

from __future__ import annotations

import json

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.config import SHIPPED
from dsv4_index.tools.cli import build_parser, main, sample_step
from dsv4_index.tools.trace import record_steps

SMALL = ["--max-model-len", "4096"]


def run(capsys, argv):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_shipped_configs_are_the_five():
    assert SHIPPED == ("flash", "pro", "tiny", "v41_flash", "tiny_v41")


@pytest.mark.parametrize("config", SHIPPED)
def test_layout(capsys, config):
    rc, out, err = run(capsys, ["layout", "--config", config] + SMALL)
    assert rc == 0 and not err, err
    ratios = sorted({r for r in DSV4Layout.from_config(config, 4096).compress_ratios if r})
    assert "None" not in out.splitlines()[0], out
    if ratios[0] <= 2:   # NOTE: V4.1: its ratios by value, the state ring one block wide
        assert "ratios=1/2" in out.splitlines()[0], out
        ring = next(x for x in out.splitlines() if "c2_state " in x)
        assert ring.split()[1:7] == ["c2_state", "circular", "8", "1", "4", "1"], ring
    else:
        assert f"c4={ratios[0]}, c128={ratios[-1]}" in out.splitlines()[0], out


@pytest.mark.parametrize("config", SHIPPED)
def test_demo(capsys, config):
    rc, out, err = run(capsys, ["demo", "--config", config, "--device", "cpu"] + SMALL)
    assert rc == 0 and not err, err
    assert "step: 4 requests" in out
    lay = DSV4Layout.from_config(config, 4096)
    for name in lay.channels:
        assert f"\n[{name}] gid" in out, (name, out)
    indexed = [c for c in lay.channels if c.endswith("a") and c[:-1] + "i" in lay.channels]
    assert f"[{indexed[0]}] topk_to_slots of picks" in out, out


@pytest.mark.parametrize("config", SHIPPED)
def test_demo_sample_step_holds_each_groups_blocks(config):
    lay = DSV4Layout.from_config(config, 4096)
    step = sample_step(lay)
    for r in step.new_requests:
        n = r.num_computed_tokens + step.num_scheduled_tokens[r.req_id]
        assert [len(ids) for ids in r.block_ids] == [g.blocks_for(n) for g in lay.groups]


@pytest.mark.parametrize("config", SHIPPED)
def test_audit(capsys, config):
    rc, out, err = run(capsys, ["audit", "--config", config, "--json"] + SMALL)
    assert rc == 0 and not err, err
    a = json.loads(out)
    assert all(g["bytes_per_token"] > 0 for g in a["groups"]), a
    rc, out, err = run(capsys, ["audit", "--config", config, "--groups", "vllm", "--spec", "1"] + SMALL)
    assert rc == 0 and not err and "scheduler block" in out, err


@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow) if c in ("flash", "pro") else c
                                    for c in SHIPPED])   # NOTE: flash / pro: 6-8 s each on the CPU
def test_inspect(capsys, tmp_path, config):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "step.png"
    rc, out, err = run(capsys, ["inspect", "--config", config, "--requests", "4", "--out", str(out_png)] + SMALL)
    assert rc == 0 and not err and out_png.stat().st_size > 1000, err


def test_inspect_title_names_the_ratios(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from dsv4_index.tools import plot

    titles = []
    real = plot.draw_step

    def spy(meta, path, **kw):
        import matplotlib.figure

        save = matplotlib.figure.Figure.suptitle

        def suptitle(self, t, *a, **k):
            titles.append(t)
            return save(self, t, *a, **k)
        monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", suptitle)
        return real(meta, path, **kw)
    monkeypatch.setattr(plot, "draw_step", spy)
    assert main(["inspect", "--config", "tiny_v41", "--requests", "3", "--out", str(tmp_path / "a.png")]) == 0
    assert "ratios 1/2" in titles[0] and "None" not in titles[0], titles


@pytest.mark.parametrize("config", SHIPPED)
def test_replay(capsys, tmp_path, config):
    lay = DSV4Layout.from_config(config, 4096)
    pipe = MetadataPipeline(lay, 8, 64, "cpu", 1, backend="reference")
    path = tmp_path / "t.jsonl"
    with record_steps(pipe, path):
        pipe.update(sample_step(lay), pad_to=48)
        pipe.build()
    rc, out, err = run(capsys, ["replay", str(path), "--device", "cpu", "--backend", "reference"])
    assert rc == 0 and "OK" in out, (out, err)


def test_help_names_every_shipped_config_and_max_model_len_where_taken(capsys):
    act = next(a for a in build_parser()._actions if a.dest == "cmd")
    for name, p in act.choices.items():
        opts = {o for a in p._actions for o in a.option_strings}
        assert ("--max-model-len" in opts) == (name != "replay"), name
        cfg = next(a for a in p._actions if a.dest == "config")
        for c in SHIPPED:
            assert c in cfg.help, (name, cfg.help)
    rc, out, _ = run(capsys, ["--help"])
    assert "replay" in out and "--max-model-len" in out
    assert "Every command takes" not in out


@pytest.mark.parametrize("content,why", [
    (None, "No such file"), ("{", "not valid JSON"), ("[" * 100_000 + "]" * 100_000, "nested"),
    ('{"kv_cache_groups": 3}', "kv_cache_groups"), (b"\xff\xfe", "UTF-8")])
def test_audit_groups_file_that_cannot_be_used_is_named(capsys, tmp_path, content, why):
    path = tmp_path / "bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    rc, out, err = run(capsys, ["audit", "--config", "flash", "--groups", str(path)])
    assert rc == 2 and err.count("\n") == 1 and "internal error" not in err, err
    assert "--groups" in err and str(path) in err and why in err, err


def test_audit_of_vllms_own_v41_plan(capsys):
    from pathlib import Path

    plan = Path(__file__).resolve().parents[1] / "layout" / "fixtures" / "vllm033_v41_flash.json"
    rc, out, err = run(capsys, ["audit", "--config", "v41_flash", "--groups", str(plan), "--json"])
    assert rc == 0 and not err, err
    g = {r["name"]: r for r in json.loads(out)["groups"]}
    assert g["c2_state"]["kind"] == "circular" and g["mla"]["bytes_per_token"] > 0


def test_audit_default_max_model_len_is_the_documented_one(monkeypatch):
    """No --max-model-len: the config's max_position_embeddings, at most 32768 (tiny: 1024), as every command."""
    from argparse import Namespace

    from dsv4_index.tools.cli import max_model_len_of

    seen = []
    orig = DSV4Layout.from_config.__func__

    def spy(cls, config, max_model_len, **kw):
        seen.append(max_model_len)
        return orig(cls, config, max_model_len, **kw)
    monkeypatch.setattr(DSV4Layout, "from_config", classmethod(spy))
    assert main(["audit", "--config", "tiny"]) == 0
    assert seen == [max_model_len_of(Namespace(config="tiny", max_model_len=None))] == [1024]


@pytest.mark.parametrize("option,value", [("--spec", "-1"), ("--spec", "x"), ("--spec", str(2 ** 70)),
                                          ("--max-num-batched-tokens", "0"), ("--max-num-batched-tokens", "-5")])
def test_audit_options_out_of_range_name_the_option(capsys, option, value):
    rc, out, err = run(capsys, ["audit", "--config", "tiny", option, value])
    assert rc == 2 and err.count("\n") == 1 and f"argument {option}" in err, err
