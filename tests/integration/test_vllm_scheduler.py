"""vLLM 0.33's own scheduler on CPU against the pipeline (issues 26 item 4 and 28), short loops of
``benchmarks/vllm_scheduler_loop.py``: its KV-cache plan for V4-Flash and V4-Pro (with and without MTP), prefix
caching, chunked prefill, preemption, rejected drafts, and for V4.1-Flash (DSpark drafts, SWA bounded replay)
``replay_start``; every ``SchedulerOutput`` must be accepted by
``update()`` under ``checks="safe"`` and ``"full"``, every output of ``build()`` must equal docs/DESIGN.md §4
computed from vLLM's own block lists, and every corrupted copy (another live request's block id in a new block
list) must be rejected.

Needs vLLM 0.33 (on CPU ``pip install --no-deps vllm==0.33.0`` plus the light packages of
``.ci/requirements-vllm.txt``, run with ``VLLM_TARGET_DEVICE=cpu``): ``./dev test-vllm`` builds that environment
(``.venv-vllm``) and runs ``tests/integration`` in it, as CI does (``.ci/run``). There ``DSV4_REQUIRE_VLLM=1``:
a vLLM that does not import, or another version, fails the run; elsewhere (the main suite's ``.venv``, without
vLLM) this file is skipped.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from helpers.vllm_loop import BURST, load_loop, require_vllm

require_vllm()
loop = load_loop("vllm_scheduler_loop")

FRESH = ["--initial", "8", "--arrival", "0.5", "--burst", "4", "--shared-prefixes", "0", "--max-prompt", "1200",
         "--max-tokens", "8192", "--num-blocks", "6000", "--requests", "800"]  # NOTE: bursts of 4 on a new prefix:
# the first fills blocks the other three hold as hits in the same step (vLLM's pattern, issue 26 item 4)
TIGHT = ["--num-blocks", "1000", "--max-output", "3000", "--stop", "0", "--max-prompt", "800",
         "--max-tokens", "2048", "--initial", "48"]  # NOTE: long outputs in a small pool: preemptions


def _run(*argv):
    """(summary, printed lines) of a loop."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        s = loop.run(loop.parser().parse_args([str(a) for a in argv]))
    return s, out.getvalue()


@pytest.mark.parametrize("argv", [
    ["--config", "flash", "--spec", 1, *BURST],
    ["--config", "pro", "--spec", 2, *BURST],
    ["--config", "flash", "--spec", 0, *BURST],
    ["--config", "flash", "--spec", 1, *FRESH],
    ["--config", "pro", "--spec", 0, "--layout", "shorthand", *BURST],
    ["--config", "flash", "--spec", 2, "--async-scheduling", *FRESH],
    ["--config", "v41", "--spec", 3, *BURST],
    ["--config", "v41", "--spec", 0, "--replay", "off", *BURST],
    ["--config", "v41", "--spec", 7, *BURST],
], ids=["flash-mtp1", "pro-mtp2", "flash-nomtp", "flash-mtp1-same-step-hits", "pro-nomtp-groups-vllm",
        "flash-mtp2-async", "v41-dspark3-replay", "v41-noreplay", "v41-dspark7-ring16"])
def test_every_step_is_accepted(argv):
    s, printed = _run("--steps", 60, "--verify", *argv)
    assert s["steps"] == 60 and s["idle_steps"] == 0, s
    assert s["rejected"] == {"safe": 0, "full": 0}, printed
    assert s["accepted"] == {"safe": 60, "full": 60}, s
    # NOTE: every output of every token equals DESIGN §4 computed from vLLM's own block lists
    assert s["verified_tokens"] == s["tokens"] and s["output_mismatches"] == 0, printed
    # NOTE: the patterns the rules must let through did happen
    assert s["prefix_hits"] > 0 and s["shared_writes"] > 0, s
    assert (s["rejected_drafts"] > 0) == (s["spec"] > 0), s


def test_v41_bounded_replay_is_exercised():
    """V4.1 (vLLM's deepseek_v41 specs, runner V2, SWA bounded replay on): prefix hits come back with a
    ``replay_start``; the replayed tokens write no full-group row (``replay_end``), every output equals DESIGN §4
    with the window floor, and every corrupted copy is rejected."""
    s, printed = _run("--steps", 60, "--config", "v41", "--spec", 1, "--verify", "--mutate", 2, *BURST)
    assert s["groups"][-2:] == ["mla", "c2_state"] and len(s["groups"]) == 10, s  # NOTE: 8 SWA sub-groups
    assert s["replays"] == s["prefix_hits"] > 0 and s["replay_steps"] > 0, s
    assert s["rejected"] == {"safe": 0, "full": 0} and s["accepted"] == {"safe": 60, "full": 60}, printed
    assert s["verified_tokens"] == s["tokens"] and s["output_mismatches"] == 0, printed
    assert s["mutations"]["safe"] > 0 and s["mutations_rejected"] == s["mutations"], printed


def test_v41_short_hits_are_admitted_from_zero():
    """V4.1 with short prompts: a prefix hit of at most ``W`` tokens is dropped by vLLM (the request is admitted
    from 0, no ``replay_start``, none of the hit's blocks); the loop counts them from the prefix-cache lookups
    (``short_hits``) and every such step is accepted with every output equal to DESIGN §4."""
    s, printed = _run("--steps", 80, "--config", "v41", "--spec", 1, "--verify", "--max-prompt", "400")
    assert s["short_hits"] > 0 and 0 < s["short_hit_tokens"] <= 128 * s["short_hits"], s
    assert s["rejected"] == {"safe": 0, "full": 0}, printed
    assert s["verified_tokens"] == s["tokens"] and s["output_mismatches"] == 0, printed


def test_validate_runs_both_planners_and_check_metadata():
    """``validate=True``: the fast and general planners give equal plans on every vLLM step (else AssertionError)
    and ``check_metadata`` passes after every build."""
    s, printed = _run("--steps", 60, "--checks", "validate", "--verify", "--spec", 2, *FRESH)
    assert s["accepted"] == {"validate": 60} and s["output_mismatches"] == 0, printed


def test_preemption_and_resume_are_accepted():
    s, printed = _run("--steps", 200, "--spec", 2, *TIGHT)  # NOTE: the first preemption comes at step 166
    assert s["preempted"] > 0 and s["resumed"] > 0, s
    assert s["rejected"] == {"safe": 0, "full": 0}, printed


def test_v41_preemption_and_resume_are_accepted():
    """V4.1 (the C2 ring, DSpark 3 drafts tagged ``is_draft``) in a small pool: vLLM preempts (19 preemptions in
    200 steps; none resumed yet by then) and every step is accepted."""
    s, printed = _run("--steps", 200, "--config", "v41", "--spec", 3, *TIGHT)
    assert s["preempted"] > 0, s
    assert s["rejected"] == {"safe": 0, "full": 0} and s["accepted"] == {"safe": 200, "full": 200}, printed


def test_another_holders_block_id_is_rejected():
    s, printed = _run("--steps", 60, "--mutate", 4, *BURST)
    assert s["rejected"] == {"safe": 0, "full": 0}, printed  # NOTE: and the real steps after each mutation
    assert s["mutations"]["safe"] > 400, s  # NOTE: running and new requests' block ids
    assert s["mutations_rejected"] == s["mutations"], printed


def test_async_handovers_are_accepted():
    """``--handovers``: under async scheduling a block its holder does not certainly read (behind the window of
    its upper bound) handed to another request is accepted, on a copy of each pipeline, and the copy accepts the
    real steps after it while the holder does not read the block (vllm_handovers.py); the certain ids of
    ``--mutate`` are still all rejected."""
    s, printed = _run("--steps", 40, "--async-scheduling", "--spec", 2, "--handovers", 2, "--mutate", 2, *BURST)
    assert s["rejected"] == {"safe": 0, "full": 0}, printed
    assert s["handovers"] > 40 and s["handovers_accepted"] == s["handovers"], printed
    assert s["handover_reads_accepted"] == 0 and s["handover_other_rejections"] == 0, printed
    assert s["mutations"]["safe"] > 0 and s["mutations_rejected"] == s["mutations"], printed
