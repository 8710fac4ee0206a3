"""Record a step trace, replay it clean, and replay corrupted copies: the replay names the step."""

import json

import numpy as np
import pytest

from dsv4_index import DSV4Layout, MetadataPipeline, NewRequest, RunningRequest, StepBatch, StepInput
from dsv4_index.tools.cli import main
from dsv4_index.testing.scheduler import ReferenceScheduler, scripted_trace
from dsv4_index.tools.replay import replay_trace
from dsv4_index.tools.trace import layout_from_json, layout_to_json, read_trace, record_steps

SCRIPT = [
    {"add": [dict(req_id="a", prompt_len=21, max_new_tokens=6), dict(req_id="b", prompt_len=13, max_new_tokens=5)]},
    {},
    {"add": [dict(req_id="c", prompt_len=30, max_new_tokens=4)], "accept": {}},
    {"accept": {"a": 1}},
    {"accept": {"b": 1}},
    {},
]


def layout():
    return DSV4Layout.from_config("tiny", max_model_len=128, mla_block_size=16, swa_block_size=8)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A 6-step trace (two requests arrive together, a third later, speculative decodes), padded."""
    path = tmp_path_factory.mktemp("trace") / "steps.jsonl"
    lay = layout()
    pipe = MetadataPipeline(lay, 4, 32, "cpu", 1)
    sched = ReferenceScheduler(lay, 64, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1)
    with record_steps(pipe, path) as rec:
        for i, (step, _) in enumerate(scripted_trace(sched, SCRIPT)):
            pipe.update(step, pad_to=min(32, step.total_tokens + i % 3))
            pipe.build()
    assert "update" not in pipe.__dict__   # NOTE: the wrapper is gone after the block
    assert rec.num_steps == len(SCRIPT) and rec.num_rejected == 0
    return path


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def rewrite(src, dst, step, fn):
    out = lines(src)
    fn(next(d for d in out if d["type"] == "step" and d["index"] == step)["step"])
    dst.write_text("".join(json.dumps(d) + "\n" for d in out))
    return dst


def test_trace_format(trace):
    header, steps = read_trace(trace)
    assert header["type"] == "header" and header["version"] == 3 and header["outputs"] == "rowmix64"
    assert header["pipeline"]["max_num_reqs"] == 4 and header["pipeline"]["num_speculative_tokens"] == 1
    assert layout_from_json(header["layout"]) == layout()
    assert layout_from_json(json.loads(json.dumps(layout_to_json(layout())))) == layout()
    assert [d["index"] for d in steps] == list(range(len(SCRIPT)))
    assert steps[0]["req_ids"] == ["a", "b"]
    b = StepBatch.from_json(steps[0]["step"])
    assert steps[0]["pad_to"] == b.num_tokens == 24 and steps[1]["pad_to"] == StepBatch.from_json(
        steps[1]["step"]).num_tokens + 1
    assert list(b.is_new) == [True, True] and list(b.num_computed_tokens) == [0, 0]
    assert b.write_ids.size > 0 and b.write_cu[-1] == b.write_ids.size


@pytest.mark.slow  # ./dev quick skips it
def test_replay_clean_prints_a_summary(trace, capsys):
    res = replay_trace(trace, device="cpu")
    assert res.ok, res.report()
    assert res.stats["accepted steps"] == len(SCRIPT) and res.stats["top-k conversions"] == len(SCRIPT)
    assert res.values["swa"] > 0 and res.values["c128a"] > 0
    assert main(["replay", str(trace), "--device", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "accepted steps" in out and "values compared: c4i" in out, out
    assert main(["replay", str(trace), "--device", "cpu", "--no-progress", "--config", "tiny"]) == 0


def test_replay_reports_a_missing_block(trace, tmp_path, capsys):
    """Step 3: drop the last id of request a's mla run -> its tokens are not covered."""
    def drop(s):
        for r, (g, slot) in enumerate(zip(s["write_gids"], s["write_slots"], strict=True)):
            if g == 0 and slot == 0:
                del s["write_ids"][s["write_cu"][r + 1] - 1]
                s["write_cu"][r + 1:] = [c - 1 for c in s["write_cu"][r + 1:]]
                return
        raise AssertionError("no mla run of slot 0 in step 0")

    bad = rewrite(trace, tmp_path / "missing.jsonl", 0, drop)
    res = replay_trace(bad, device="cpu")
    assert not res.ok and res.problem.step == 0 and res.problem.kind == "rejected", res.report()
    assert "block ids missing for gid 0" in res.problem.message
    assert main(["replay", str(bad), "--device", "cpu", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "step 0 (line 2): REJECTED" in out, out


def test_replay_reports_a_duplicate_write(trace, tmp_path, capsys):
    """Step 0: request b's first swa block becomes request a's -> two tokens would write one slot; the
    host's block ownership check (state/owners.py) rejects the step before anything is built."""
    def dup(s):
        runs = [r for r, g in enumerate(s["write_gids"]) if g == 1]
        first = [s["write_ids"][s["write_cu"][r]] for r in runs]
        s["write_ids"][s["write_cu"][runs[1]]] = first[0]

    bad = rewrite(trace, tmp_path / "dup.jsonl", 0, dup)
    res = replay_trace(bad, device="cpu")
    p = res.problem
    assert p is not None and p.step == 0 and p.kind == "rejected", res.report()
    assert "of gid 1 (swa)" in p.message and "another live request holds" in p.message, p.message
    assert main(["replay", str(bad), "--device", "cpu", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "step 0 (line 2): REJECTED" in out, out


def test_replay_reports_a_divergence_from_the_reference(trace, monkeypatch):
    """With the checker silenced, a poisoned output of the checked pipeline is still found by the
    comparison with the reference pipeline (step, channel, field, token, values)."""
    import dsv4_index.validate as validate
    build = MetadataPipeline.build

    def poisoned(self):
        meta = build(self)
        if self.validate and meta.num_tokens > 5:
            meta["c128a"].indices[5, 0] = 12345
        return meta

    monkeypatch.setattr(validate, "check_metadata", lambda *a, **k: None)
    monkeypatch.setattr(MetadataPipeline, "build", poisoned)
    p = replay_trace(trace, device="cpu").problem
    assert p is not None and p.kind == "divergence" and p.step == 0, p
    assert (p.channel, p.field, p.token) == ("c128a", "indices", 5)
    assert p.found[0] == 12345 and p.expected[0] != 12345


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_rejected_steps_are_recorded_and_replayed_as_rejected(tmp_path):
    lay = layout()
    pipe = MetadataPipeline(lay, 4, 32, "cpu", 1)
    ids = [list(range(1 + 10 * g, 3 + 10 * g)) for g in range(len(lay.groups))]
    path = tmp_path / "rej.jsonl"
    with record_steps(pipe, path) as rec:
        pipe.update(StepInput([NewRequest("a", tuple(ids), 0)], [], {"a": 5}), pad_to=8)
        with pytest.raises(ValueError, match="pad_to"):   # NOTE: a refused StepBatch is recorded with its step
            pipe.update(StepBatch(req_slots=np.array([pipe.slot_of("a")]), num_computed_tokens=np.array([5]),
                                  num_scheduled_tokens=np.array([1])), pad_to=40)
        with pytest.raises(ValueError, match="not in the batch"):
            pipe.update(StepInput([], [RunningRequest("zz", tuple([] for _ in ids), 5)], {"zz": 1}))
        pipe.update(StepInput([], [RunningRequest("a", tuple([] for _ in ids), 5)], {"a": 1}), pad_to=4)
    assert (rec.num_steps, rec.num_rejected) == (2, 2)
    d = lines(path)
    assert [x["type"] for x in d] == ["header", "step", "rejected", "rejected", "step", "end"]
    assert "pad_to" in d[2]["error"] and d[2]["step"] is not None and d[3]["step"] is None
    res = replay_trace(path, device="cpu")
    assert res.ok and res.stats["rejected steps (as recorded)"] == 2 and res.stats["accepted steps"] == 2, res.report()
    # a recorded rejection that the replay accepts is reported
    d[2]["pad_to"] = 8
    path.write_text("".join(json.dumps(x) + "\n" for x in d))
    p = replay_trace(path, device="cpu").problem
    assert p is not None and p.kind == "accepted" and p.step == 1


def test_bad_trace_files(trace, tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"type": "step"}\n')
    with pytest.raises(ValueError, match="first line must be the trace header"):
        read_trace(p)
    p.write_text(json.dumps(lines(trace)[0]) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"x.jsonl:2: not JSON"):
        read_trace(p)


@pytest.mark.gpu
def test_replay_on_cuda(trace):
    """The checked pipeline on CUDA (Triton, fused) against the CPU reference, every step."""
    res = replay_trace(trace, device="cuda")
    assert res.ok and res.backend == "triton" and res.stats["accepted steps"] == len(SCRIPT), res.report()


def test_engine_groups_trace_replays(tmp_path):
    """A trace of a layout with vLLM's own groups (5 groups, two SWA sub-groups) replays clean, and a
    tampered step of it is named."""
    lay = DSV4Layout.from_config("flash", max_model_len=1024, groups="vllm")
    assert [g.name for g in lay.groups] == ["swa_0", "swa_1", "mla", "c4_state", "c128_state"]
    path = tmp_path / "vllm.jsonl"
    pipe = MetadataPipeline(lay, 4, 64, "cpu", 1, backend="reference")
    sched = ReferenceScheduler(lay, 256, max_num_batched_tokens=48, max_num_seqs=4, num_speculative_tokens=1)
    with record_steps(pipe, path):
        for step, _ in scripted_trace(sched, SCRIPT):
            pipe.update(step)
            pipe.build()
    assert layout_from_json(read_trace(path)[0]["layout"]) == lay
    res = replay_trace(str(path), device="cpu", backend="reference")
    assert res.ok, res.report()
    bad = rewrite(path, tmp_path / "bad.jsonl", 3, lambda s: s.__setitem__(
        "num_computed_tokens", [n + 3 for n in s["num_computed_tokens"]]))
    res = replay_trace(str(bad), device="cpu", backend="reference")
    assert not res.ok and "step 3" in res.report()
