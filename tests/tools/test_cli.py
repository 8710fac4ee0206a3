"""The command line explains itself: every command and option has help, one default for shared options,
``--version``, the layout key, and ``inspect`` without matplotlib says what to install."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.scripts import hang_guard

import dsv4_index
from dsv4_index.tools.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _subparsers(ap):
    (act,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return act


def test_every_command_and_option_has_help():
    ap = build_parser()
    act = _subparsers(ap)
    helped = {c.dest: c.help for c in act._choices_actions}
    assert set(helped) == set(act.choices) == {"layout", "demo", "inspect", "replay", "audit"}, helped
    assert all(h and "\n" not in h for h in helped.values()), helped
    for name, p in act.choices.items():
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help and a.help != argparse.SUPPRESS, (name, a.dest)


def test_shared_options_have_one_default():
    act = _subparsers(build_parser())
    defaults = {}
    for name, p in act.choices.items():
        for a in p._actions:
            if a.dest in ("max_model_len", "config") and name != "replay":
                defaults.setdefault(a.dest, set()).add((a.default, a.help))
    assert all(len(v) == 1 for v in defaults.values()), defaults
    # layout prints tables only: no --device
    assert "device" not in {a.dest for a in act.choices["layout"]._actions}


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for cmd in ("layout", "demo", "inspect", "replay"):
        assert f"\n    {cmd} " in out, out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"dsv4-index {dsv4_index.__version__}"


def test_layout_explains_its_columns(capsys):
    assert main(["layout", "--config", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "DSV4Layout(max_model_len=1024, layers=5" in out, out      # tiny's max_position_embeddings
    assert "f = kernel blocks per allocation block" in out and "width = logical blocks per request" in out, out


@pytest.mark.slow  # ./dev quick skips it
def test_inspect_without_matplotlib_says_what_to_install(tmp_path):
    code = ("import sys\n"
            "class _No:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'matplotlib':\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, _No())\n"
            "from dsv4_index.tools.cli import main\n"
            f"raise SystemExit(main(['inspect', '--config', 'tiny', '--out', {str(tmp_path / 'x.png')!r}]))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=hang_guard())
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().count("\n") == 0 and "pip install 'dsv4-index[plot]'" in p.stderr, p.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow  # ./dev quick skips it
def test_replay_progress_off_when_stderr_is_not_a_terminal():
    code = ("from dsv4_index.tools.cli import build_parser\n"
            "print(build_parser().parse_args(['replay', 'x']).no_progress)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=hang_guard())
    assert p.stdout.strip() == "True", p.stdout + p.stderr
