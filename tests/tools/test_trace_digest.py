"""Traces carry digests of their outputs: a replay names the first step / channel / field / row that
differs from the recording; digests are of the values only (independent of padding and capacity)."""

import json

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.testing.scheduler import ReferenceScheduler, scripted_trace
from dsv4_index.tools.cli import main
from dsv4_index.tools.replay import replay_trace
from dsv4_index.tools.trace import TraceError, read_trace, record_steps

SCRIPT = [
    {"add": [dict(req_id="a", prompt_len=21, max_new_tokens=9), dict(req_id="b", prompt_len=13, max_new_tokens=8)]},
    {},
    {"add": [dict(req_id="c", prompt_len=30, max_new_tokens=6)], "accept": {}},
    {"accept": {"a": 1}},
    {"accept": {"b": 1}},
    {},
    {},
]
TAMPERED = 3     # the step the tamper tests change


def layout():
    return DSV4Layout.from_config("tiny", max_model_len=128, mla_block_size=16, swa_block_size=8)


def record(path, *, max_reqs=4, max_tokens=32, pad=lambda i, n: min(32, n + i % 3), backend="reference", **kw):
    """NOTE: the module's trace is recorded with the default backend (the Triton interpreter under
    TRITON_INTERPRET=1), the others with the reference: replays compare across backends."""
    lay = layout()
    pipe = MetadataPipeline(lay, max_reqs, max_tokens, "cpu", 1, backend=backend)
    sched = ReferenceScheduler(lay, 64, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1)
    with record_steps(pipe, path, **kw):
        for i, (step, _) in enumerate(scripted_trace(sched, SCRIPT)):
            pipe.update(step, pad_to=pad(i, step.total_tokens))
            pipe.build()
            pipe.build()           # NOTE: a second build of one step records nothing more
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return record(tmp_path_factory.mktemp("digest") / "steps.jsonl", backend=None)


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def write(path, ds):
    path.write_text("".join(json.dumps(d) + "\n" for d in ds))
    return path


def tampered(src, dst, fn, step=TAMPERED):
    ds = lines(src)
    d = next(d for d in ds if d["type"] == "step" and d["index"] == step)
    fn(d)
    return write(dst, ds)


@pytest.mark.slow  # ./dev quick skips it
def test_outputs_lines_follow_their_steps(trace):
    ds = lines(trace)
    kinds = [d["type"] for d in ds]
    assert kinds == ["header"] + ["step", "outputs"] * len(SCRIPT) + ["end"]
    assert [d["index"] for d in ds if d["type"] == "outputs"] == list(range(len(SCRIPT)))
    dg = ds[2]["digests"]
    assert list(dg["common"])[:2] == ["query_start_loc", "seq_lens"]
    assert set(dg["block_tables"]) == {g.name for g in layout().groups}
    assert set(dg["channels"]) == set(layout().channels)
    n = sum(ds[1]["step"]["num_scheduled_tokens"])
    assert n == 24 and dg["common"]["positions"]["n"] == n and "v" in dg["common"]["positions"]  # budget 24
    _, steps = read_trace(trace)
    assert all(s["outputs"] is not None for s in steps)


@pytest.mark.slow  # ./dev quick skips it
def test_untouched_trace_matches_its_recording(trace, capsys):
    res = replay_trace(trace, device="cpu")
    assert res.ok, res.report()
    assert res.stats["steps matching the recording"] == len(SCRIPT) and not res.notes
    assert main(["replay", str(trace), "--device", "cpu", "--no-progress"]) == 0
    assert "steps matching the recording" in capsys.readouterr().out


def _first_accepted(src, tmp_path, name, change, backend=None):
    """Tamper each row of the step in turn; the first tamper the pipeline accepts (enough blocks,
    pad and capacity) is the one tested. Returns (result, row index, recorded step line)."""
    d0 = next(d for d in lines(src) if d["type"] == "step" and d["index"] == TAMPERED)
    for r in range(len(d0["step"]["req_slots"])):
        def fn(d, r=r):
            change(d["step"], r)
            d["pad_to"] = None if d["pad_to"] is None else d["pad_to"] + 3
        res = replay_trace(tampered(src, tmp_path / f"{name}{r}.jsonl", fn), device="cpu", backend=backend)
        if res.problem is None or res.problem.kind != "rejected":
            return res, r, d0
    raise AssertionError(f"no row of step {TAMPERED} takes the tamper {name}")


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_one_more_scheduled_token_is_named(trace, tmp_path):
    res, r, d0 = _first_accepted(trace, tmp_path, "sched", lambda s, r: s["num_scheduled_tokens"].__setitem__(
        r, s["num_scheduled_tokens"][r] + 1))
    p = res.problem
    assert p is not None and p.kind == "recording" and p.step == TAMPERED, res.report()
    assert (p.channel, p.field) == (None, "query_start_loc") and p.row is not None
    assert p.found[0] == p.expected[0] + 1, p        # the recorded and the replayed cumulative count
    assert "more field(s) differ: seq_lens" in p.message and "positions" in p.message   # the others that differ


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_three_fewer_computed_tokens_are_named(trace, tmp_path):
    # NOTE: three fewer (a rewind): three more would skip positions nobody wrote, a rejected step
    res, r, d0 = _first_accepted(trace, tmp_path, "comp", lambda s, r: s["num_computed_tokens"].__setitem__(
        r, s["num_computed_tokens"][r] - 3))
    p = res.problem
    assert p is not None and p.kind == "recording" and p.step == TAMPERED, res.report()
    assert (p.channel, p.field) == (None, "seq_lens") and p.found[0] == p.expected[0] - 3, p
    assert p.req_id == d0["req_ids"][r]


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_a_swapped_block_id_is_named(trace, tmp_path, capsys):
    """Step 2 admits request c: swap two of the block ids it writes into one group."""
    def swap(d):
        s = d["step"]
        for run, _g in enumerate(s["write_gids"]):
            lo, hi = s["write_cu"][run], s["write_cu"][run + 1]
            if hi - lo >= 2:
                s["write_ids"][lo], s["write_ids"][lo + 1] = s["write_ids"][lo + 1], s["write_ids"][lo]
                return
        raise AssertionError("no run of two blocks in step 2")

    bad = tampered(trace, tmp_path / "swap.jsonl", swap, step=2)
    res = replay_trace(bad, device="cpu")
    p = res.problem
    assert p is not None and p.kind == "recording" and p.step == 2, res.report()
    assert p.field.startswith("block_table[") and p.row is not None and p.req_id in ("a", "b", "c")
    assert p.expected != p.found and sorted(p.expected[1:3]) == sorted(p.found[1:3]), p
    assert main(["replay", str(bad), "--device", "cpu", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "step 2 (line 6): DIFFERS FROM THE RECORDING" in out and "recorded" in out and "replayed" in out, out


def test_row_hashes_only_still_name_the_row(tmp_path):
    """values_limit=0: no recorded values, the row hashes still locate the first row that differs."""
    src = record(tmp_path / "hashes.jsonl", values_limit=0)
    assert "v" not in lines(src)[2]["digests"]["common"]["seq_lens"]
    res, r, d0 = _first_accepted(src, tmp_path, "comp", lambda s, r: s["num_computed_tokens"].__setitem__(
        r, s["num_computed_tokens"][r] - 3), backend="reference")
    p = res.problem
    assert p.kind == "recording" and p.field == "seq_lens" and p.req_id == d0["req_ids"][r], res.report()
    assert p.expected.startswith("row hash 0x") and isinstance(p.found, list)


def test_digests_do_not_depend_on_padding_or_capacity(trace, tmp_path):
    """The same steps, other pad sizes and another pipeline capacity (larger rings, more slots)."""
    other = record(tmp_path / "other.jsonl", max_reqs=8, max_tokens=64, pad=lambda i, n: n + 7)
    a = [d["digests"] for d in lines(trace) if d["type"] == "outputs"]
    b = [d["digests"] for d in lines(other) if d["type"] == "outputs"]
    assert a == b
    assert lines(trace)[1]["pad_to"] != lines(other)[1]["pad_to"]


def test_version_1_trace_replays_without_digests(trace, tmp_path, capsys):
    ds = [d for d in lines(trace) if d["type"] not in ("outputs", "end")]
    ds[0]["version"] = 1
    del ds[0]["outputs"]
    old = write(tmp_path / "v1.jsonl", ds)
    res = replay_trace(old, device="cpu", backend="reference")
    assert res.ok and res.stats["steps matching the recording"] == 0, res.report()
    assert any("no digests recorded" in n and "version-1" in n for n in res.notes)
    assert main(["replay", str(old), "--device", "cpu", "--backend", "reference", "--no-progress"]) == 0
    assert "note: no digests recorded" in capsys.readouterr().out


def test_recorded_without_outputs(tmp_path):
    path = record(tmp_path / "plain.jsonl", outputs=False)
    assert [d["type"] for d in lines(path)] == ["header"] + ["step"] * len(SCRIPT) + ["end"]
    res = replay_trace(path, device="cpu", backend="reference")
    assert res.ok and res.notes == ["no digests recorded (recorded with outputs=False): outputs compared with the "
                                    "reference only"], res.notes


def test_other_format_version_is_a_clear_error(trace, tmp_path, capsys):
    ds = lines(trace)
    ds[0]["version"] = 4
    p = write(tmp_path / "v4.jsonl", ds)
    with pytest.raises(TraceError, match=r"v4.jsonl:1: version: trace format version 4 \(written by dsv4_index "
                                         r".*\); this dsv4_index reads versions 1, 2, 3"):
        replay_trace(p, device="cpu")
    assert main(["replay", str(p), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trace format version 4" in err and "Traceback" not in err


def test_recording_after_warmup_records_outputs(tmp_path):
    lay = layout()
    path = tmp_path / "rec.jsonl"
    pipe = MetadataPipeline(lay, 4, 32, "cpu", 1, backend="reference")
    pipe.warmup()                                    # NOTE: warm-up is not recorded
    assert pipe.last_batch is None
    sched = ReferenceScheduler(lay, 64, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1)
    with record_steps(pipe, path):
        for step, _ in scripted_trace(sched, SCRIPT[:3]):
            pipe.update(step)
            pipe.build()
    assert [d["type"] for d in lines(path)] == ["header"] + ["step", "outputs"] * 3 + ["end"]
    res = replay_trace(path, device="cpu", backend="reference")
    assert res.ok and res.stats["steps matching the recording"] == 3, res.report()


def test_a_step_without_outputs_is_noted(trace, tmp_path):
    ds = lines(trace)
    assert ds[-2]["type"] == "outputs" and ds[-1]["type"] == "end"
    del ds[-2]                                        # the last step's outputs (its build crashed)
    ds[-1]["outputs"] -= 1                            # NOTE: the recording closed after the crash
    res = replay_trace(write(tmp_path / "cut.jsonl", ds), device="cpu", backend="reference")
    assert res.ok and res.stats["steps matching the recording"] == len(SCRIPT) - 1
    assert any("1 accepted step(s) have no recorded outputs" in n for n in res.notes), res.notes


@pytest.mark.gpu
def test_cpu_recording_replays_on_cuda(trace):
    """A trace recorded on the CPU (reference backend) replayed by the Triton pipeline on CUDA: every
    recorded output digest matches."""
    res = replay_trace(trace, device="cuda")
    assert res.ok and res.backend == "triton", res.report()
    assert res.stats["steps matching the recording"] == len(SCRIPT), res.report()


def test_digest_is_of_the_values_only():
    """int32 / int64 / bool of the same values digest alike; one changed entry changes the digest and
    the hash of its row only."""
    import numpy as np
    import torch
    from dsv4_index.tools.digest import _entry, _matrix, row_hashes

    x = torch.tensor([[3, -1, 7], [0, 1, 1]], dtype=torch.int32)
    a, b = _entry(_matrix(x, 2), 0), _entry(_matrix(x.long(), 2), 0)
    assert a == b and a["n"] == 2 and a["w"] == 3
    assert _entry(_matrix(torch.tensor([True, False]), 2), 0)["h"] == _entry(_matrix(torch.tensor([1, 0]), 2), 0)["h"]
    assert _entry(_matrix(torch.cat([x, x]), 2), 0) == a                 # rows past n are not digested
    y = x.clone()
    y[1, 2] = 2
    h0, h1 = row_hashes(_matrix(x, 2)), row_hashes(_matrix(y, 2))
    assert h0[0] == h1[0] and h0[1] != h1[1] and _entry(_matrix(y, 2), 0)["h"] != a["h"]
    z = x.clone()
    z[0] = torch.tensor([-1, 3, 7], dtype=torch.int32)                  # same entries, other order
    assert row_hashes(_matrix(z, 2))[0] != h0[0]
    assert np.asarray(row_hashes(np.zeros((0, 4), np.int64))).size == 0
