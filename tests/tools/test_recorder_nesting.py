"""``record_steps`` blocks inside each other (issue 39, case 1): each trace holds every step of its own block, and
leaving the inner block gives the pipeline back the outer block's recorder; ``record_steps``'s arguments are
checked before the file is created (case 11)."""

from __future__ import annotations

import json

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.testing.scheduler import ReferenceScheduler, scripted_trace
from dsv4_index.tools.replay import replay_trace
from dsv4_index.tools.trace import record_steps

SCRIPT = [{"add": [dict(req_id="a", prompt_len=21, max_new_tokens=6)]}, {}, {}, {}]


def _steps():
    lay = DSV4Layout.from_config("tiny", max_model_len=128, mla_block_size=16, swa_block_size=8)
    sched = ReferenceScheduler(lay, 64, max_num_batched_tokens=24, max_num_seqs=4)
    return lay, [s for s, _ in scripted_trace(sched, SCRIPT)]


def _types(path):
    return [json.loads(x)["type"] for x in path.read_text().splitlines()]


def test_nested_blocks_each_record_their_own_steps(tmp_path):
    lay, steps = _steps()
    assert len(steps) == 4
    pipe = MetadataPipeline(lay, 4, 32, "cpu", backend="reference")
    outer, inner = tmp_path / "outer.jsonl", tmp_path / "inner.jsonl"
    with record_steps(pipe, outer) as ro:
        pipe.update(steps[0])
        pipe.build()
        with record_steps(pipe, inner) as ri:
            pipe.update(steps[1])
            pipe.build()
        pipe.update(steps[2])           # NOTE: after the inner block: the outer one still records
        pipe.build()
        pipe.update(steps[3])
        pipe.build()
    assert (ro.num_steps, ri.num_steps) == (4, 1)
    assert _types(outer) == ["header"] + ["step", "outputs"] * 4 + ["end"]
    assert _types(inner) == ["header", "step", "outputs", "end"]
    assert "update" not in pipe.__dict__ and "build" not in pipe.__dict__   # NOTE: the pipeline's own methods back
    res = replay_trace(outer, device="cpu", backend="reference")
    assert res.ok and res.stats["steps matching the recording"] == 4, res.report()


def test_values_limit_is_checked_before_the_file_is_created(tmp_path):
    lay, _ = _steps()
    pipe = MetadataPipeline(lay, 4, 32, "cpu", backend="reference")
    for bad in ("x", -1, 1.5, True):
        path = tmp_path / "t.jsonl"
        with pytest.raises((TypeError, ValueError), match="values_limit"):
            with record_steps(pipe, path, values_limit=bad):
                pass
        assert not path.exists()
    with pytest.raises(TypeError, match="outputs"):
        with record_steps(pipe, tmp_path / "u.jsonl", outputs="yes"):
            pass
    assert not (tmp_path / "u.jsonl").exists()
    with pytest.raises(TypeError, match="pipe must be a MetadataPipeline"):
        with record_steps(None, tmp_path / "v.jsonl"):
            pass
    assert not (tmp_path / "v.jsonl").exists()
    assert "update" not in pipe.__dict__
