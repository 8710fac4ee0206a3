"""Every bad trace file is one TraceError (a ValueError) naming the file, the line and the field; the CLI
prints that line on stderr and exits 2, never a traceback."""

import json
import subprocess
import sys

import pytest

from helpers.scripts import hang_guard

from dsv4_index import DSV4Layout, MetadataPipeline, NewRequest, RunningRequest, StepInput
from dsv4_index.tools.cli import main
from dsv4_index.tools.replay import replay_trace
from dsv4_index.tools.trace import TraceError, read_trace, record_steps


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """Three steps of one request (tiny layout), with outputs."""
    lay = DSV4Layout.from_config("tiny", max_model_len=128, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(lay, 4, 32, "cpu", 1)
    ids = [list(range(1 + 10 * g, 4 + 10 * g)) for g in range(len(lay.groups))]
    path = tmp_path_factory.mktemp("err") / "good.jsonl"
    with record_steps(pipe, path):
        pipe.update(StepInput([NewRequest("a", tuple(ids), 0)], [], {"a": 5}), pad_to=8)
        pipe.build()
        for n in (5, 6):
            pipe.update(StepInput([], [RunningRequest("a", tuple([] for _ in ids), n)], {"a": 1}))
            pipe.build()
    return path


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def write(tmp_path, ds, name="bad.jsonl"):
    p = tmp_path / name
    if isinstance(ds, bytes):
        p.write_bytes(ds)
    else:
        p.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in ds))
    return p


def fails(capsys, path, match, line=None, field=None):
    """replay_trace and read_trace raise TraceError(match); the CLI exits 2 with one stderr line."""
    with pytest.raises(TraceError, match=match or None) as e:
        replay_trace(path, device="cpu")
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg, msg
    if line is not None:
        assert e.value.line == line and msg.startswith(f"{path}:{line}: " if line else f"{path}: "), msg
    if field is not None:
        assert e.value.field == field and f": {field}: " in msg, msg
    with pytest.raises(TraceError):
        read_trace(path)
    assert main(["replay", str(path), "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and msg in err, err
    return e.value


def edit(trace, fn):
    ds = lines(trace)
    fn(ds)
    return ds


# ---------------------------------------------------------------------------------------------- header
@pytest.mark.parametrize("name,fn,field", [
    ("no layout", lambda h: h.pop("layout"), "layout"),
    ("no pipeline", lambda h: h.pop("pipeline"), "pipeline"),
    ("no max_num_reqs", lambda h: h["pipeline"].pop("max_num_reqs"), "pipeline.max_num_reqs"),
    ("channels a string", lambda h: h["layout"].__setitem__("channels", "swa"), "layout.channels"),
    ("channel gid 9", lambda h: h["layout"]["channels"][0].__setitem__("gid", 9), "layout.channels[0].gid"),
    ("max_num_reqs 10**15", lambda h: h["pipeline"].__setitem__("max_num_reqs", 10 ** 15), "pipeline.max_num_reqs"),
    ("max_num_reqs a float", lambda h: h["pipeline"].__setitem__("max_num_reqs", 4.0), "pipeline.max_num_reqs"),
    ("max_staged_blocks 2**31", lambda h: h["pipeline"].__setitem__("max_staged_blocks", 2 ** 31),
     "pipeline.max_staged_blocks"),
    ("a group kind", lambda h: h["layout"]["groups"][1].__setitem__("kind", "ring"), "layout.groups[1].kind"),
    ("sliding_window 2**40", lambda h: h["layout"].__setitem__("sliding_window", 2 ** 40), "layout.sliding_window"),
    ("an unknown field", lambda h: h["pipeline"].__setitem__("max_num_req", 4), "pipeline.max_num_req"),
])
def test_bad_header(trace, tmp_path, capsys, name, fn, field):
    p = write(tmp_path, edit(trace, lambda ds: fn(ds[0])))
    fails(capsys, p, "", line=1, field=field)


def test_capacities_are_checked_before_allocation(trace, tmp_path, capsys):
    """Each value alone is within its bound; together the per-token buffers would need ~2**28 entries."""
    def big(ds):
        ds[0]["pipeline"]["max_num_reqs"] = 1 << 16
        ds[0]["pipeline"]["max_num_batched_tokens"] = 1 << 20
    e = fails(capsys, write(tmp_path, edit(trace, big)), r"a replay needs \d+ per-token buffers entries", line=1)
    assert e.field == "pipeline"


def test_hand_edited_layout(trace, tmp_path, capsys):
    """A channel field deleted (found by the fuzz test: it reached the window builder)."""
    def edit_(ds):
        c = next(c for c in ds[0]["layout"]["channels"] if c["name"] == "swa")
        del c["window"]
    fails(capsys, write(tmp_path, edit(trace, edit_)), r"is None, but the layout's own fields give 8", line=1,
          field="layout.channels[3].window")
    fails(capsys, write(tmp_path, edit(trace, lambda ds: ds[0]["layout"]["groups"][0].__setitem__(
        "table_width", 1 << 24))), "is 16777216, but the layout's own fields give 8", line=1,
        field="layout.groups[0].table_width")


def test_other_version_names_both(trace, tmp_path, capsys):
    e = fails(capsys, write(tmp_path, edit(trace, lambda ds: ds[0].__setitem__("version", 7))),
              r"trace format version 7 \(written by dsv4_index [^)]+\); this dsv4_index reads versions 1, 2, 3", line=1)
    assert e.field == "version"


# ---------------------------------------------------------------------------------------------- steps
def step_line(ds, i=0):
    return next(d for d in ds if d["type"] == "step" and d["index"] == i)


@pytest.mark.parametrize("name,fn,field,match", [
    ("no step", lambda d: d.pop("step"), "step", "missing"),
    ("step 5", lambda d: d.__setitem__("step", 5), "step", "must be a JSON object, got an integer"),
    ("req_slots [10**30]", lambda d: d["step"].__setitem__("req_slots", [10 ** 30]), "step.req_slots[0]",
     r"1000000000000000000000000000000 is out of range"),
    ("req_slots abc", lambda d: d["step"].__setitem__("req_slots", "abc"), "step.req_slots",
     "must be a list, got a string 'abc'"),
    ("req_slots 0.5", lambda d: d["step"].__setitem__("req_slots", [0.5]), "step.req_slots[0]",
     "must be an integer, got a float 0.5"),
    ("req_slots true", lambda d: d["step"].__setitem__("req_slots", [True]), "step.req_slots[0]",
     "must be an integer, got a boolean"),
    ("is_new 1", lambda d: d["step"].__setitem__("is_new", [1]), "step.is_new[0]", "must be true or false"),
    ("pad_to abc", lambda d: d.__setitem__("pad_to", "abc"), "pad_to", "must be an integer or null"),
    ("index 9", lambda d: d.__setitem__("index", 9), "index", r"9 is out of range \[0, 0\]"),
    ("req_ids short", lambda d: d.__setitem__("req_ids", []), "req_ids", "0 ids for 1 rows"),
    ("type", lambda d: d.__setitem__("type", "stp"), "type",
     r"'stp' is not one of \['step', 'rejected', 'outputs', 'end'\]"),
])
def test_bad_step_line(trace, tmp_path, capsys, name, fn, field, match):
    p = write(tmp_path, edit(trace, lambda ds: fn(step_line(ds))))
    fails(capsys, p, match, line=2, field=field)


def test_bad_outputs_line(trace, tmp_path, capsys):
    ds = lines(trace)
    ds[2]["digests"]["common"]["positions"]["h"] = "xyz"
    fails(capsys, write(tmp_path, ds), "must be 16 lower-case hex digits", line=3,
          field="digests.common.positions.h")
    ds = lines(trace)
    ds[2], ds[3] = ds[3], ds[2]                                     # outputs of step 0 after step 1
    fails(capsys, write(tmp_path, ds), r"index: 0 is out of range \[1, 1\]", line=4, field="index")
    ds = lines(trace)
    ds[2]["digests"]["common"]["positions"]["v"] = "!!!"
    fails(capsys, write(tmp_path, ds), "not base64 text", line=3, field="digests.common.positions.v")
    ds = lines(trace)
    ds[2]["digests"]["common"]["positions"]["v"] = "AAAA"           # base64, but not zlib: found when read
    fails(capsys, write(tmp_path, ds), "v is not zlib data", line=3, field="digests.common.positions.v")


def test_deeply_nested_line(trace, tmp_path, capsys):
    ds = [json.dumps(d) for d in lines(trace)]
    ds[1] = '{"type": "step", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    fails(capsys, write(tmp_path, ds), r"JSON nested 100001 deep \(at most 32 allowed\)", line=2)


# ---------------------------------------------------------------------------------------------- files
def test_files(trace, tmp_path, capsys):
    good = trace.read_bytes()
    fails(capsys, write(tmp_path, b"", "empty.jsonl"), r"empty\.jsonl: empty trace \(no header line\)", line=0)
    fails(capsys, write(tmp_path, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "bin.jsonl"),
          r"bin\.jsonl:1: not UTF-8 text \(byte 0x89 at column 1; a binary file\?\)", line=1)
    cut = good.index(b"\n", good.index(b"\n") + 1)                  # inside line 3
    fails(capsys, write(tmp_path, good[:cut + 40], "cut.jsonl"), r"cut\.jsonl:3: not JSON \(truncated\?\)", line=3)
    bad = good.replace(b'"a"', b'"\xe9"', 1)
    fails(capsys, write(tmp_path, bad, "latin1.jsonl"), r"latin1\.jsonl:2: not UTF-8 text \(byte 0xe9", line=2)
    fails(capsys, write(tmp_path, b"\n" + good, "blank.jsonl"), "first line must be the trace header", line=1)
    fails(capsys, write(tmp_path, b'{"type": "header"}\n', "bare.jsonl"), "version", line=1, field="version")
    headless = b"".join(x + b"\n" for x in good.splitlines()[1:])
    fails(capsys, write(tmp_path, headless, "headless.jsonl"), "the first line must be the trace header "
          r"\(type 'header'\), got 'step'", line=1, field="type")
    fails(capsys, tmp_path / "missing.jsonl", r"missing\.jsonl: no such file", line=0)
    d = tmp_path / "dir.jsonl"
    d.mkdir()
    fails(capsys, d, r"dir\.jsonl: is a directory, not a trace file", line=0)


def test_duplicate_key_and_nan(trace, tmp_path, capsys):
    ds = [json.dumps(d) for d in lines(trace)]
    ds[1] = ds[1].replace('"pad_to"', '"pad_to": 8, "pad_to"', 1)
    fails(capsys, write(tmp_path, ds), r":2: unusable JSON: duplicate key 'pad_to'", line=2)
    ds = [json.dumps(d) for d in lines(trace)]
    ds[1] = ds[1].replace('"pad_to":8', '"pad_to":NaN', 1).replace('"pad_to": 8', '"pad_to": NaN', 1)
    fails(capsys, write(tmp_path, ds), r":2: pad_to: NaN is not a JSON number \(unusable JSON\)", line=2,
          field="pad_to")


@pytest.mark.slow  # ./dev quick skips it
def test_cli_subprocess_no_traceback(tmp_path):
    p = write(tmp_path, b"\x00\x01\x02", "nul.jsonl")
    r = subprocess.run([sys.executable, "-m", "dsv4_index", "replay", str(p), "--no-progress"],
                       capture_output=True, text=True, timeout=hang_guard())
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert str(p) in r.stderr and "python -m dsv4_index: error:" in r.stderr


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_good_trace_still_replays(trace):
    assert replay_trace(trace, device="cpu").ok


def test_a_key_holding_a_newline_stays_one_line(trace, tmp_path, capsys):
    """Found by the long fuzz run: a flipped byte made the key "\\ndex_width" (a JSON escape)."""
    raw = trace.read_bytes().replace(b'"index_width"', b'"\\ndex_width"', 1)
    e = fails(capsys, write(tmp_path, raw), r"\\ndex_width: unknown field", line=1)
    assert e.field == "layout.channels[0].\ndex_width"
