"""The command line never prints a traceback: every command, every class of bad option (values out of
range or not numbers, devices that do not exist or are not available, odd or unwritable ``--out``
paths, missing files, interrupts, unexpected errors) ends in ONE stderr line naming the option and exit
status 2; ``--out`` reports the file it actually wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_index.tools import cli
from dsv4_index.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
HUGE = str(10 ** 20)


def run(capsys, argv):
    try:
        rc = main(argv)
    except SystemExit as e:   # NOTE: argparse's own errors exit through SystemExit(2)
        rc = e.code
    return rc, capsys.readouterr()


def one_line_error(capsys, argv, option):
    rc, out = run(capsys, argv)
    err = out.err.strip()
    assert rc == 2, (argv, rc, out)
    assert err.count("\n") == 0 and "Traceback" not in err and err.startswith("python -m dsv4_index"), (argv, err)
    assert option in err, (argv, option, err)
    return err


NO_CUDA = [] if torch.cuda.is_available() else ["cuda", "cuda:0"]
BAD = {
    "--max-model-len": ["0", "-3", "abc", "1.5", HUGE, ""],
    "--config": ["no_such_config", "missing/config.json"],
    "--device": ["foo", "cuda:99", "meta", "cpu:x", "", *NO_CUDA],
    "--seed": [HUGE, "-1", "x", "0x10"],
    "--requests": ["0", "-1", HUGE, "many"],
    "--backend": ["cuda", ""],
}
OPTIONS = {"layout": ["--max-model-len", "--config"], "demo": ["--max-model-len", "--config", "--device"],
           "inspect": ["--max-model-len", "--config", "--device", "--seed", "--requests"],
           "replay": ["--device", "--seed", "--backend", "--config"]}
CASES = [(cmd, opt, v) for cmd, opts in OPTIONS.items() for opt in opts for v in BAD[opt]]


@pytest.mark.parametrize("cmd,option,value", CASES)
def test_every_bad_option_is_one_line_naming_it(capsys, tmp_path, cmd, option, value, monkeypatch):
    monkeypatch.chdir(tmp_path)                 # NOTE: nothing is written anywhere else
    argv = [cmd] + (["trace.jsonl"] if cmd == "replay" else []) + [option, value]
    if cmd == "replay" and option == "--config":
        _trace(tmp_path / "trace.jsonl")
    if cmd == "inspect":
        argv += ["--out", str(tmp_path / "x.png")]
    one_line_error(capsys, argv, option)
    assert not (tmp_path / "x.png").exists()


def _trace(path: Path) -> Path:
    from dsv4_index import DSV4Layout, MetadataPipeline
    from dsv4_index.tools.trace import record_steps
    lay = DSV4Layout.from_config("tiny", max_model_len=64, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(lay, 2, 8, "cpu", backend="reference")
    with record_steps(pipe, path):
        pass
    return path


@pytest.mark.parametrize("out,why", [
    ("{tmp}", "is a folder"), ("{tmp}/", "is a folder"), ("{tmp}/x.xyz", "unknown picture format '.xyz'"),
    ("{tmp}/afile/x.png", "is not a folder"), ("", "is a folder"), ("{tmp}/ro/x.png", "permission denied"),
])
def test_bad_out_paths_are_refused_before_any_work(capsys, tmp_path, out, why):
    (tmp_path / "afile").write_text("")
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    if os.access(tmp_path / "ro", os.W_OK) and "ro" in out:
        pytest.skip("running as a user that writes into read-only folders (root)")
    err = one_line_error(capsys, ["inspect", "--config", "tiny", "--out", out.format(tmp=tmp_path)], "--out")
    assert why in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ro"]


def test_sample_sizes_are_bounded(capsys):
    err = one_line_error(capsys, ["inspect", "--config", "tiny", "--max-model-len", str(2 ** 20 + 1)],
                         "--max-model-len")
    assert "must be an integer in [1, 1048576]" in err, err
    one_line_error(capsys, ["demo", "--max-model-len", str(2 ** 20 + 1)], "--max-model-len")
    rc, out = run(capsys, ["layout", "--config", "tiny", "--max-model-len", str(2 ** 24)])
    assert rc == 0, out
    # a sample step larger than its pipeline: named by the options that size it
    err = one_line_error(capsys, ["inspect", "--config", "flash", "--requests", "4096", "--max-model-len", "64"],
                         "--requests / --max-model-len")
    assert "no sample step of this size" in err, err


def test_bad_files_and_commands(capsys, tmp_path):
    one_line_error(capsys, ["replay", str(tmp_path / "none.jsonl")], "none.jsonl")
    one_line_error(capsys, ["replay", str(tmp_path)], "is a directory")
    one_line_error(capsys, [], "COMMAND")
    one_line_error(capsys, ["nope"], "invalid choice")
    one_line_error(capsys, ["layout", "--what"], "--what")
    one_line_error(capsys, ["layout", "--config", str(tmp_path)], "--config")


def test_interrupts_and_unexpected_errors_are_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    def broken(args):
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    monkeypatch.setattr(cli, "layout_cmd", interrupted)
    rc, out = run(capsys, ["layout"])
    assert rc == 2 and out.err.strip() == "python -m dsv4_index: error: interrupted", out.err
    monkeypatch.setattr(cli, "layout_cmd", broken)
    rc, out = run(capsys, ["layout"])
    assert rc == 2 and out.err.strip().count("\n") == 0, out.err
    assert "internal error (RuntimeError: CUDA error: an illegal memory access was encountered)" in out.err
    monkeypatch.setenv("DSV4_INDEX_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        main(["layout"])


@pytest.mark.slow  # ./dev quick skips it (draws a picture)
def test_out_reports_the_file_it_wrote(capsys, tmp_path):
    rc, out = run(capsys, ["inspect", "--config", "tiny", "--out", str(tmp_path / "noext")])
    assert rc == 0, out
    written = tmp_path / "noext.png"
    assert sorted(tmp_path.iterdir()) == [written]
    assert f"-> {written} ({written.stat().st_size // 1024} KiB)" in out.out, out.out
    # a place nobody can write (even root): found when the file is written, still one line naming --out
    err = one_line_error(capsys, ["inspect", "--config", "tiny", "--out", "/proc/dsv4_x.png"], "--out")
    assert "cannot write '/proc/dsv4_x.png'" in err, err


@pytest.mark.slow  # ./dev quick skips it (a few interpreter starts)
@pytest.mark.parametrize("argv,option", [
    (["demo", "--device", "foo"], "--device"), (["replay", "x.jsonl", "--seed", HUGE], "--seed"),
    (["inspect", "--config", "tiny", "--out", "."], "--out"), (["layout", "--config", "nope"], "--config"),
    (["demo", "--device", "cuda:99"], "--device"),
])
def test_through_a_real_interpreter(tmp_path, argv, option):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "dsv4_index", *argv], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    err = p.stderr.strip()
    assert p.returncode == 2 and err.count("\n") == 0 and option in err and "Traceback" not in err, p.stderr
    assert list(tmp_path.iterdir()) == []
