"""Traces are bounded by their own header: an outputs entry larger than the header's pipeline can produce
is refused before it is decoded (a zip bomb costs nothing), every recorded value list must hash to its
digest, and a trace knows when it is complete (its end line): a cut or header-only trace is reported with
a non-zero exit."""

from __future__ import annotations

import base64
import json
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.testing.scheduler import ReferenceScheduler, scripted_trace
from dsv4_index.tools.cli import main
from dsv4_index.tools.replay import replay_trace
from dsv4_index.tools.trace import TraceError, read_trace, record_steps

SCRIPT = [{"add": [dict(req_id="a", prompt_len=21, max_new_tokens=4), dict(req_id="b", prompt_len=9,
                                                                              max_new_tokens=3)]}, {}, {}]
T_MAX = 32


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bounds") / "steps.jsonl"
    lay = DSV4Layout.from_config("tiny", max_model_len=128, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(lay, 4, T_MAX, "cpu", 1, backend="reference")
    sched = ReferenceScheduler(lay, 64, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1)
    with record_steps(pipe, path, values_limit=64):
        for step, _ in scripted_trace(sched, SCRIPT):
            pipe.update(step)
            pipe.build()
    return path


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def write(path, ds):
    Path(path).write_text("".join(json.dumps(d) + "\n" for d in ds))
    return Path(path)


def refused(path, match, line, field=None):
    with pytest.raises(TraceError, match=match) as e:
        read_trace(path)
    assert e.value.line == line and (field is None or e.value.field == field), (e.value.line, e.value.field)
    assert main(["replay", str(path), "--device", "cpu", "--no-progress"]) == 2
    return e.value


def _v(a) -> str:
    return base64.b64encode(zlib.compress(np.asarray(a, dtype="<i8").tobytes(), 9)).decode()


def test_entries_beyond_the_header_are_refused_before_decoding(trace, tmp_path, capsys):
    ds = lines(trace)
    e = ds[2]["digests"]["common"]["positions"]
    e["n"] = T_MAX + 1                                       # more token rows than max_num_batched_tokens
    refused(write(tmp_path / "n.jsonl", ds), r"positions.n: 33 is out of range \[0, 32\]", 3)
    ds = lines(trace)
    ds[2]["digests"]["channels"]["swa"]["indices"]["w"] = 10 ** 6   # wider than the channel's window
    refused(write(tmp_path / "w.jsonl", ds), r"swa.indices.w: 1000000 is out of range", 3)
    ds = lines(trace)
    ds[2]["digests"]["channels"]["nope"] = {}
    refused(write(tmp_path / "ch.jsonl", ds), "no such output in the header's layout|nope", 3)
    ds = lines(trace)
    ds[2]["digests"]["channels"]["swa"]["no_field"] = dict(ds[2]["digests"]["channels"]["swa"]["lens"])
    refused(write(tmp_path / "f.jsonl", ds), "swa.no_field: no such output in the header's layout", 3)
    capsys.readouterr()


def _peak(path) -> int:
    """Peak Python allocation of reading ``path`` (which must fail)."""
    tracemalloc.start()
    try:
        with pytest.raises(TraceError):
            read_trace(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_zip_bomb_is_refused_without_being_unpacked(trace, tmp_path, capsys):
    bomb = base64.b64encode(zlib.compress(bytes(64 << 20), 9)).decode()     # 64 MiB of zeros, ~87 KB of text
    ds = lines(trace)
    ds[2]["digests"]["common"]["positions"]["v"] = bomb
    p = write(tmp_path / "bomb.jsonl", ds)
    refused(p, r"positions.v: \d+ characters, more than the \d+ that n = \d+ rows of w = 1 values can take", 3)
    assert _peak(p) < 4 << 20                                # NOTE: the file's lines, never the 64 MiB
    # a short payload that unpacks to more than n * w values: the decompression stops at that size
    small = base64.b64encode(zlib.compress(bytes(1 << 17), 9)).decode()     # 128 KiB in ~230 characters
    assert len(small) < 400
    ds = lines(trace)
    e = ds[2]["digests"]["common"]["positions"]
    e["n"], e["v"] = T_MAX, small
    p = write(tmp_path / "small.jsonl", ds)
    refused(p, r"positions.v: v holds 257 bytes\+, expected n \* w \* 8 = 256", 3)
    assert _peak(p) < 100 << 10                              # NOTE: not the 128 KiB it unpacks to
    capsys.readouterr()


def test_edited_values_under_an_unchanged_digest_are_refused(trace, tmp_path, capsys):
    ds = lines(trace)
    e = ds[2]["digests"]["common"]["positions"]
    vals = np.frombuffer(zlib.decompress(base64.b64decode(e["v"])), dtype="<i8").copy()
    vals[0] += 1
    e["v"] = _v(vals)
    refused(write(tmp_path / "v.jsonl", ds), "positions.v: the values do not hash to the entry's digest", 3,
            "digests.common.positions.v")
    # untouched values pass (the check is not a blanket refusal)
    ds = lines(trace)
    e = ds[2]["digests"]["common"]["positions"]
    e["v"] = _v(np.frombuffer(zlib.decompress(base64.b64decode(e["v"])), dtype="<i8"))
    read_trace(write(tmp_path / "same.jsonl", ds))
    capsys.readouterr()


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_a_cut_trace_is_incomplete(trace, tmp_path, capsys):
    ds = lines(trace)
    assert ds[-1]["type"] == "end" and ds[-1] == dict(type="end", steps=3, rejected=0, outputs=3)
    assert main(["replay", str(trace), "--device", "cpu", "--no-progress"]) == 0
    cut = write(tmp_path / "cut.jsonl", ds[:-2])             # the last outputs line and the end line gone
    res = replay_trace(cut, device="cpu", backend="reference")
    assert not res.ok and res.problem.kind == "incomplete", res.report()
    assert "without its end line" in res.problem.message and "3 step(s)" in res.problem.message
    assert main(["replay", str(cut), "--device", "cpu", "--no-progress"]) == 1
    assert "THE TRACE IS INCOMPLETE" in capsys.readouterr().out
    head = write(tmp_path / "head.jsonl", ds[:1])            # header only
    res = replay_trace(head, device="cpu", backend="reference")
    assert not res.ok and res.problem.kind == "incomplete" and "0 step(s)" in res.problem.message
    assert main(["replay", str(head), "--device", "cpu", "--no-progress"]) == 1
    capsys.readouterr()


def test_the_end_line_counts_the_lines_before_it(trace, tmp_path, capsys):
    ds = lines(trace)
    del ds[4]                                                # an outputs line from the middle
    assert ds[3]["type"] == "step"
    refused(write(tmp_path / "lost.jsonl", ds), r"the end line counts 3 outputs lines, the trace holds 2",
            len(ds), "outputs")
    ds = lines(trace) + [lines(trace)[1]]
    refused(write(tmp_path / "after.jsonl", ds), "a line after the trace's end line", len(ds))
    ds = lines(trace)
    ds[-1]["steps"] = -1
    refused(write(tmp_path / "neg.jsonl", ds), r"steps: -1 is out of range", len(ds), "steps")
    capsys.readouterr()


def test_an_error_that_ends_the_recording_is_in_the_end_line(tmp_path):
    lay = DSV4Layout.from_config("tiny", max_model_len=128, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(lay, 4, T_MAX, "cpu", 1, backend="reference")
    sched = ReferenceScheduler(lay, 64, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1)
    path = tmp_path / "crash.jsonl"
    with pytest.raises(RuntimeError, match="device lost"):
        with record_steps(pipe, path):
            for i, (step, _) in enumerate(scripted_trace(sched, SCRIPT)):
                pipe.update(step)
                if i == 1:
                    raise RuntimeError("device lost")   # NOTE: as if step 1's build had crashed
                pipe.build()
    ds = lines(path)
    assert ds[-1] == dict(type="end", steps=2, rejected=0, outputs=1, error="RuntimeError: device lost")
    res = replay_trace(path, device="cpu", backend="reference")
    assert res.ok and "the recording ended with an error" in " ".join(res.notes), res.report()
