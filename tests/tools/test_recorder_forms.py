"""The recorder writes what the pipeline accepted (``pipe.last_batch``), whatever the input form: the same
steps given as StepInput, as a vLLM-style SchedulerOutput and as the StepBatch the pipeline converted them
to record the same trace (request ids aside), and each replays clean. The core does not import the tools."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.testing.scheduler import ReferenceScheduler, scripted_trace
from dsv4_index.tools.replay import replay_trace
from dsv4_index.tools.trace import record_steps


from helpers.vllm_stub import from_step

SCRIPT = [
    {"add": [dict(req_id="a", prompt_len=21, max_new_tokens=6), dict(req_id="b", prompt_len=13, max_new_tokens=5)]},
    {},
    {"add": [dict(req_id="c", prompt_len=30, max_new_tokens=4)], "accept": {}},
    {"accept": {"a": 1}},
    {"accept": {"b": 1}},
    {},
]


def _layout():
    return DSV4Layout.from_config("tiny", max_model_len=128, mla_block_size=16, swa_block_size=8)


def _record(path: Path, steps, pads):
    pipe = MetadataPipeline(_layout(), 4, 32, "cpu", 1, backend="reference")
    accepted = []
    with record_steps(pipe, path) as rec:
        for step, pad in zip(steps, pads, strict=True):
            pipe.update(step, pad_to=pad)
            pipe.build()
            accepted.append(pipe.last_batch[0])
    assert rec.num_steps == len(steps) and rec.num_rejected == 0
    return accepted


def _lines(path: Path, ids: bool):
    out = [json.loads(x) for x in path.read_text().splitlines()]
    for d in out:
        if not ids:
            d.pop("req_ids", None)
        if d.get("step") and d["step"].get("free_slots") is not None:
            # NOTE: a SchedulerOutput's finished_req_ids is a set: the order it frees slots in follows the
            # string hash seed; which slots are freed is what the step says
            d["step"]["free_slots"] = sorted(d["step"]["free_slots"])
    return out


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_three_input_forms_record_three_equal_traces(tmp_path):
    sched = ReferenceScheduler(_layout(), 64, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1)
    steps = [s for s, _ in scripted_trace(sched, SCRIPT)]
    pads = [min(32, s.total_tokens + i % 3) for i, s in enumerate(steps)]
    batches = _record(tmp_path / "input.jsonl", steps, pads)
    _record(tmp_path / "sched.jsonl", [from_step(s) for s in steps], pads)
    _record(tmp_path / "batch.jsonl", batches, pads)
    a, b, c = (_lines(tmp_path / f"{n}.jsonl", ids=False) for n in ("input", "sched", "batch"))
    assert [d["type"] for d in a] == ["header"] + ["step", "outputs"] * len(steps) + ["end"]
    assert a == b == c
    # the id-keyed forms carry the request ids of their rows, the array form none
    ia, ib, ic = (_lines(tmp_path / f"{n}.jsonl", ids=True) for n in ("input", "sched", "batch"))
    assert [d.get("req_ids") for d in ia] == [d.get("req_ids") for d in ib]
    assert all(d.get("req_ids") is None for d in ic)
    assert sorted(ia[1]["req_ids"]) == ["a", "b"]
    for n in ("input", "sched", "batch"):
        res = replay_trace(tmp_path / f"{n}.jsonl", device="cpu", backend="reference")
        assert res.ok and res.stats["steps matching the recording"] == len(steps), res.report()


def test_last_batch_is_set_only_by_an_accepted_update(tmp_path):
    pipe = MetadataPipeline(_layout(), 4, 32, "cpu", 1, backend="reference")
    assert pipe.last_batch is None
    pipe.warmup()
    assert pipe.last_batch is None          # NOTE: warm-up steps are not "accepted steps"
    sched = ReferenceScheduler(_layout(), 64, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1)
    step = next(iter(scripted_trace(sched, SCRIPT)))[0]
    pipe.update(from_step(step), pad_to=30)
    batch, pad, ids = pipe.last_batch
    assert pad == 30 and sorted(ids) == ["a", "b"] and batch.num_tokens == step.total_tokens
    with pytest.raises(ValueError):
        pipe.update(from_step(step))        # NOTE: the same new requests again: refused
    assert pipe.last_batch[0] is batch
    with pytest.raises(AttributeError):
        pipe.last_batch = None              # NOTE: read only


def test_the_pipeline_takes_no_record_argument_and_imports_no_tools():
    import ast
    import inspect

    import dsv4_index.pipeline as mod
    assert "record" not in inspect.signature(MetadataPipeline).parameters
    tree = ast.parse(Path(mod.__file__).read_text())
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [n for n in names if "tools" in n], names
    trace_src = (Path(mod.__file__).parent / "tools" / "trace.py").read_text()
    assert "replay" not in {a for n in ast.walk(ast.parse(trace_src)) if isinstance(n, ast.ImportFrom)
                            for a in [(n.module or "").split(".")[-1]]}


def test_a_step_with_draft_counts_records_and_replays(tmp_path):
    """``StepBatch.drafts`` (issue 37: the draft tokens among a row's scheduled tokens) travels in a trace: a
    SchedulerOutput's ``scheduled_spec_decode_tokens`` become the step's draft counts, the reader accepts the
    field, and the replay equals the recording."""
    from dsv4_index.tools.trace import read_trace
    sched = ReferenceScheduler(_layout(), 64, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1)
    steps = [from_step(dataclasses.replace(s, drafts={r: n - 1 for r, n in s.num_scheduled_tokens.items()
                                                      if n == 2 and r not in {x.req_id for x in s.new_requests}}))
             for s, _ in scripted_trace(sched, SCRIPT)]
    path = tmp_path / "drafts.jsonl"
    _record(path, steps, [None] * len(steps))
    _, lines = read_trace(path)
    assert any(d["step"].get("drafts") and max(d["step"]["drafts"]) > 0 for d in lines), \
        "the script's decode steps carry draft tokens"
    res = replay_trace(path, backend="reference", log=lambda *a: None)
    assert res.problem is None and res.stats["accepted steps"] == len(steps), res
