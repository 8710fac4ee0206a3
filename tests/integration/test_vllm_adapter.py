"""``dsv4_index.integrations.vllm.VllmStepAdapter`` driven by vLLM 0.33's own scheduler on CPU (issue 40 item 2):
the loop of ``benchmarks/vllm_scheduler_loop.py`` (``test_vllm_scheduler.py``) with its pipelines built with
``row_order="caller"`` and every step fed through the adapter in a model runner's ``InputBatch`` order (the
scheduled requests shuffled, then decode-first as ``reorder_batch`` leaves them): every step accepted, ``meta``
row ``i`` is the runner's row ``i`` (no permutation), and every output of every token equals docs/DESIGN.md §4
computed from vLLM's own block lists (``--verify``).

Needs vLLM 0.33 as ``test_vllm_scheduler.py`` does (``./dev test-vllm``; ``DSV4_REQUIRE_VLLM=1`` there).
"""

from __future__ import annotations

import contextlib
import io
import random

import pytest

from helpers.vllm_loop import BURST, load_loop, require_vllm

require_vllm()
loop = load_loop("vllm_scheduler_loop_adapter")


class AdapterLoop(loop.Loop):
    """The loop, its pipelines ``row_order="caller"`` and fed through ``VllmStepAdapter`` in a runner's order."""

    def __init__(self, args):
        self.rng, self.adapters, self.order_changes = random.Random(0), {}, 0
        super().__init__(args)

    def pipeline(self, lvl):
        from dsv4_index import MetadataPipeline
        from dsv4_index.integrations.vllm import VllmStepAdapter
        pipe = MetadataPipeline(self.layout, self.args.max_seqs, self.args.max_tokens, "cpu",
                                num_speculative_tokens=self.args.spec, backend="reference", fused=False,
                                checks=lvl, row_order="caller")
        self.adapters[id(pipe)] = VllmStepAdapter(pipe)
        return pipe

    def update(self, lvl, pipe, so):
        ids = [r for r, q in so.num_scheduled_tokens.items() if q > 0]
        self.rng.shuffle(ids)
        nn = 1 + self.args.spec
        order = [r for r in ids if so.num_scheduled_tokens[r] <= nn] + \
            [r for r in ids if so.num_scheduled_tokens[r] > nn]
        meta = self.adapters[id(pipe)].prepare(so, order)
        assert list(meta.req_ids) == order and meta.num_decodes == sum(so.num_scheduled_tokens[r] <= nn for r in ids)
        self.order_changes += order != [r.req_id for r in so.scheduled_new_reqs] + \
            [r for r in so.scheduled_cached_reqs.req_ids]
        self.req_ids[lvl] = order


def _run(*argv):
    out = io.StringIO()
    made = []

    class Made(AdapterLoop):
        def __init__(self, args):
            super().__init__(args)
            made.append(self)
    orig = loop.Loop
    loop.Loop = Made
    try:
        with contextlib.redirect_stdout(out):
            s = loop.run(loop.parser().parse_args([str(a) for a in argv]))
    finally:
        loop.Loop = orig
    return s, out.getvalue(), made[0]


# NOTE: three loops keep CI's integration stage short; the rest of the matrix (Pro, preemption, V4.1 without
# drafts, ...) is test_vllm_scheduler.py's, on the same conversion
@pytest.mark.parametrize("argv", [
    ["--config", "flash", "--spec", 1, *BURST],
    ["--config", "pro", "--spec", 2, "--async-scheduling", *BURST],
    ["--config", "v41", "--spec", 3, *BURST],
], ids=["flash-mtp1", "pro-mtp2-async", "v41-dspark3"])
def test_runner_order_through_the_adapter(argv):
    s, printed, lp = _run("--steps", 30, "--verify", "--checks", "safe", *argv)
    assert s["steps"] == 30 and s["rejected"] == {"safe": 0} and s["accepted"] == {"safe": 30}, printed
    assert s["verified_tokens"] == s["tokens"] and s["output_mismatches"] == 0, printed
    assert lp.order_changes > 0, "the runner's order never differed from the scheduler's: nothing was tested"
