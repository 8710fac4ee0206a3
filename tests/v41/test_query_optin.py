"""``MetadataPipeline(query_batches=...)`` (issue 38 follow-up): only a pipeline built with ``query_batches=True``
builds steps declaring ``query_lens`` (docs/DESIGN.md §5 "Source rows ≠ query rows"); without it such a step is
refused before anything changes, and the fused kernel compiles none of the query paths.

* a declared step (StepBatch or StepInput, ``q == n`` everywhere included) on a pipeline without the option is a
  ``ValueError`` naming ``query_lens`` and ``query_batches=True``; the pipeline is unchanged (every attribute), and
  its next plain step equals a fresh pipeline's;
* plain steps are byte-identical with the option on and off (fused launch, per-op kernels, reference; outputs
  poisoned before each build);
* the option-off launch has no query task (no ``FLAG_QUERY`` bit, no query-map kind, ``QX`` / ``LOG_R`` 0: one
  compiled kernel whatever ``max_num_reqs``); (slow) its PTX for sm_90 is smaller than the option-on one's;
* a trace records the option and replays with it (a trace without it: declared steps accepted, as they were).

Declared steps on a pipeline with the option equal the reference: ``test_query_batch.py`` (its pipelines opt in).
"""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.fused.tasks import FLAG_QUERY, KINDS, NF, QUERY_KINDS, S_FLAGS, S_KIND
from dsv4_index.testing.scheduler import ReferenceScheduler

from helpers.pipelines import DEVICE, HAS_TRITON, POISONS, poison
from helpers.rejections import diff, state
from helpers.ptx import sm90_ptx

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

SPEC, R, T_MAX = 1, 4, 96
REFUSED = (r"query_lens: this pipeline was built without query_batches=True"
           r".*MetadataPipeline\(\.\.\., query_batches=True\)")
KIND_ARGS = dict(reference=dict(backend="reference"), unfused=dict(fused=False, backend="triton"),
                 fused=dict(fused=True, backend="triton"))


def _layout():
    return DSV4Layout.from_config("tiny_v41", max_model_len=512, mla_block_size=16, swa_block_size=8,
                                  indexer_causal_indices=True)


def _pipe(lay, kind="reference", reqs=R, **kw):
    return MetadataPipeline(lay, reqs, T_MAX, DEVICE, SPEC, **KIND_ARGS[kind], **kw)


def _steps(lay, n=4, seed=5):
    sched = ReferenceScheduler(lay, 900, max_num_batched_tokens=T_MAX, max_num_seqs=R, num_speculative_tokens=SPEC,
                               seed=seed)
    return [s for s, _ in sched.random_trace(n, seed, arrival_prob=1.0, prompt_len=(20, 60), max_new_tokens=(4, 8))]


def _outputs(meta) -> dict:
    """Host copies of every tensor of one build (common fields and every channel's fields)."""
    out = {f.name: getattr(meta, f.name).cpu().clone() for f in dataclasses.fields(meta)
           if isinstance(getattr(meta, f.name), torch.Tensor)}
    for name, ch in meta.channels.items():
        for f in dataclasses.fields(ch):
            x = getattr(ch, f.name)
            if isinstance(x, torch.Tensor):
                out[f"{name}.{f.name}"] = x.cpu().clone()
    return out


def _same(a: dict, b: dict, tag) -> None:
    assert a.keys() == b.keys(), (tag, sorted(a.keys() ^ b.keys()))
    for k, x in a.items():
        assert x.dtype == b[k].dtype and torch.equal(x, b[k]), (tag, k)


def _declared(step, every=False):
    """``step`` declaring one query fewer on its first row of several tokens (``every``: ``q == n`` everywhere)."""
    n = dict(step.num_scheduled_tokens)
    if not every:
        rid = next(r for r, k in n.items() if k > 1)
        n[rid] -= 1
    return dataclasses.replace(step, query_lens=n)


# ----------------------------------------------------------------------------------------------
# refusal without the option
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["reference", pytest.param("fused", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="needs Triton (CUDA or TRITON_INTERPRET=1)"))])
@pytest.mark.parametrize("form", ["step_input", "step_batch", "every_token"])
def test_a_declared_step_is_refused_without_the_option_state_intact(kind, form):
    lay = _layout()
    s0, s1, s2 = _steps(lay, 3)
    p = _pipe(lay, kind)
    assert not p.query_batches
    p.update(s0)
    p.build()
    before = state(p)
    if form == "step_batch":
        from dsv4_index.frontend import batch_from_step
        batch, _ = batch_from_step(s1, p.slot_map, len(lay.groups))
        bad = dataclasses.replace(batch, query_lens=np.asarray(batch.num_scheduled_tokens) - (
            np.asarray(batch.num_scheduled_tokens) > 1))
    else:
        bad = _declared(s1, every=form == "every_token")
    with pytest.raises(ValueError, match=REFUSED):
        p.update(bad)
    assert diff(before, state(p)) == []
    # NOTE: the pipeline goes on as if the refused step never came: equal to a fresh pipeline fed the same steps
    fresh = _pipe(lay, kind)
    for i, s in enumerate((s0, s1, s2)):
        if i:
            p.update(s)
        fresh.update(s)
        poison(p, POISONS[0])
        poison(fresh, POISONS[1])
        _same(_outputs(p.build()), _outputs(fresh.build()), (kind, form, i))


def test_the_option_is_a_bool_and_changes_no_allocation():
    lay = _layout()
    with pytest.raises(TypeError, match="query_batches must be a bool"):
        MetadataPipeline(lay, R, T_MAX, "cpu", query_batches="yes")
    with pytest.raises(TypeError, match="query_batches must be a bool"):
        MetadataPipeline.memory_estimate(lay, R, T_MAX, "cpu", query_batches=1)
    assert (MetadataPipeline.memory_estimate(lay, R, T_MAX, "cpu", query_batches=True)
            == MetadataPipeline.memory_estimate(lay, R, T_MAX, "cpu"))


# ----------------------------------------------------------------------------------------------
# plain steps: the same outputs with and without the option
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["reference", pytest.param("fused", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="needs Triton (CUDA or TRITON_INTERPRET=1)")), pytest.param("unfused", marks=[
        pytest.mark.slow, pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (CUDA or TRITON_INTERPRET=1)")])])
def test_plain_steps_are_byte_identical_with_and_without_the_option(kind):
    lay = _layout()
    on, off = _pipe(lay, kind, query_batches=True), _pipe(lay, kind)
    rng = np.random.default_rng(1)
    for i, step in enumerate(_steps(lay, 6, seed=7)):
        pad = min(T_MAX, step.total_tokens + int(rng.integers(1, 4))) if i % 2 else None
        on.update(step, pad_to=pad)
        off.update(step, pad_to=pad)
        poison(on, POISONS[0])
        poison(off, POISONS[1])
        _same(_outputs(on.build()), _outputs(off.build()), (kind, i))


# ----------------------------------------------------------------------------------------------
# the launch: no query code without the option
# ----------------------------------------------------------------------------------------------
def _specs(flat):
    return [flat[i:i + int(NF)] for i in range(0, len(flat), int(NF))]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (CUDA or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("name", ["tiny_v41", "tiny"])
def test_the_launch_without_the_option_has_no_query_task(name):
    lay = _layout() if name == "tiny_v41" else DSV4Layout.from_config("tiny", max_model_len=512, mla_block_size=16)
    query_kinds = {KINDS[k] for k in QUERY_KINDS}
    seen = {}
    for reqs in (R, 40):
        for on in (False, True):
            plan = _pipe(lay, "fused", reqs=reqs, query_batches=on).fused_plan
            assert plan.has_query is on
            assert any(t.query for t in plan.tasks) is on and any(t.kind in QUERY_KINDS for t in plan.tasks) is on
            for v in plan._variants:
                c = v["consts"]
                specs = _specs(c["REQ"]) + _specs(c["TOK"])
                assert any(s[S_FLAGS] & int(FLAG_QUERY) for s in specs) is on
                assert any(s[S_KIND] in query_kinds for s in specs) is on
                assert (c["LOG_R"] > 0) is on
            seen[reqs, on] = [v["consts"] for v in plan._variants]
    # NOTE: without query code the kernel's constants do not depend on max_num_reqs (one compiled kernel)
    assert seen[R, False] == seen[40, False] and seen[R, True] != seen[40, True]


@pytest.mark.slow  # ./dev quick skips it
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (CUDA or TRITON_INTERPRET=1)")
def test_the_kernel_without_the_option_compiles_without_the_query_paths(tmp_path):
    """The tiny tiles' variant of tiny_v41's plan compiled to PTX for sm_90 (no GPU; as
    tests/fused/test_fused_format.py does): the option-off kernel has at most 3/4 of the option-on one's
    instructions and characters (measured: 288k vs 536k characters; the instruction count, unlike the characters,
    does not move with the debug line info: V4-Flash's option-off variants have exactly the instructions of the
    kernel before the query paths existed)."""
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("triton has no NVIDIA backend here")
    from dsv4_index.fused.plan import TINY, FusedPlan
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("builds the plan with TRITON_INTERPRET=1 or on CUDA")
    size = {}
    for on in (False, True):
        pipe = _pipe(_layout(), "fused", query_batches=on)
        p = pipe.fused_plan
        plan = FusedPlan(p.tasks, pipe.tables, pipe.ctx.group_cp, pipe.staging.dev, 2, tiny=TINY, small=TINY,
                         large=TINY)
        v = plan._variants[0]
        size[on] = sm90_ptx(v["consts"], TINY.num_warps, tmp_path)
    assert all(off <= 0.75 * on for off, on in zip(size[False], size[True])), size


# ----------------------------------------------------------------------------------------------
# traces
# ----------------------------------------------------------------------------------------------
def test_a_trace_records_the_option_and_replays_with_it(tmp_path):
    """A pipeline without the option records ``query_batches: false`` and its refused declared step; the replay
    refuses it too. A trace written before the option (no such key) replays declared steps, as it was recorded."""
    from dsv4_index.tools.replay import replay_trace
    from dsv4_index.tools.trace import record_steps
    lay = _layout()
    s0, s1, s2 = _steps(lay, 3)
    for on in (False, True):
        p = _pipe(lay, query_batches=on)
        path = tmp_path / f"trace_{on}.jsonl"
        with record_steps(p, path):
            p.update(s0)
            p.build()
            try:
                p.update(_declared(s1))
            except ValueError:
                assert not on
                p.update(s1)  # NOTE: the engine sends the step again, plain
            p.build()
            p.update(s2)
            p.build()
        header = json.loads(path.read_text().splitlines()[0])
        assert header["pipeline"]["query_batches"] is on
        res = replay_trace(path, backend="reference", log=lambda *a: None)
        assert res.problem is None, res
        assert res.stats["rejected steps (as recorded)"] == int(not on), res.stats
        if on:  # NOTE: the same trace without the key (as written before the option): replayed the same
            lines = path.read_text().splitlines()
            old = json.loads(lines[0])
            del old["pipeline"]["query_batches"]
            path.write_text("\n".join([json.dumps(old)] + lines[1:]) + "\n")
            res = replay_trace(path, backend="reference", log=lambda *a: None)
            assert res.problem is None and res.stats["rejected steps (as recorded)"] == 0, res
