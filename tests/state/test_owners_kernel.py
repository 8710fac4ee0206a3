"""The compiled ownership passes (``state/owners/kernel.py``, the pipeline's) against the rule's definition
(``state/owners/naive.py``: holders rescanned from the table rows every step) on the same steps: the same
verdict, the same code, fields and message, and after every accepted step the same state (fills, what each
cell saw, frontiers, floors, ring marks), the kernel's holder counts equal to the holders recounted from
scratch.

Streams: the hypothesis mutation streams of ``tests/helpers/batches`` (serving steps with finishes, joins,
rejected drafts, crossings, blocks ahead, one mutation of any field per step) on the ring and circular
layouts, ``"safe"`` and ``"full"``; and reference-scheduler traces (prefix hits, bounded replay, preemption,
chunked prefill) on ring, circular and hybrid layouts, with the scheduler's free policies.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index import MetadataPipeline
from dsv4_index.state.owners.naive import NaiveOwners
from dsv4_index.testing.scheduler import ReferenceScheduler

from helpers.batches import MUTATION, R, SPEC, T_MAX, Serve, mutate, same_owners
from helpers.layouts import trace_layout
from helpers.rejections import diff, layout, state


def pair(lay, n, t, spec, checks):
    """A pipeline on the kernel and one whose ownership state is :class:`NaiveOwners`."""
    a = MetadataPipeline(lay, n, t, "cpu", spec, checks=checks, backend="reference")
    b = MetadataPipeline(lay, n, t, "cpu", spec, checks=checks, backend="reference")
    b.requests.owners = NaiveOwners(b.tables, cp=(1, 0, 1), full=checks == "full", next_n=1 + spec)
    # NOTE: the kernel's lists (L, F4, seen_l) cut to 2 entries: these steps are far below the default lengths, and
    # a pass that overflows them must run again (h37o's wrapper kept the overflowed run's void lists: counts lost)
    o = a.requests.owners
    o.L, o.F4, o.seen_l = (np.zeros(shape, dtype=np.int64) for shape in ((3, 2), (2, 4), (2, 6)))
    return a, b


def feed(p, step, pad=None):
    try:
        p.update(step, pad_to=pad)
    except ValueError as e:
        return str(e), getattr(e, "code", None), getattr(e, "fields", None)
    p.staging.applied()
    return None


def same(a, b):
    x, y = a.requests.owners, b.requests.owners
    assert same_owners(x.snapshot(), y.snapshot())
    assert x.held() == y.held()
    assert x.held(True) == y.held(True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ring", "circular"])
@pytest.mark.parametrize("checks", ["safe", "full"])
@settings(max_examples=25, deadline=None)
@given(seed=st.sampled_from(range(2 ** 16)), muts=st.lists(MUTATION, min_size=8, max_size=16))
def test_kernel_equals_naive_on_mutated_serving_steps(variant, checks, seed, muts):
    a, b = pair(layout(variant), R, T_MAX, SPEC, checks)
    work = Serve(layout(variant), seed)
    for kind, i, v in muts:
        step = work.step()
        bad, pad = mutate(step, kind, i, v)
        for s, p_ in ((bad, pad), (step, None)) if bad is not step or pad is not None else ((step, None),):
            before = state(a)
            ea, eb = feed(a, s, p_), feed(b, s, p_)
            assert ea == eb, f"kernel {ea!r} vs naive {eb!r}"
            if ea is not None:
                assert not diff(before, state(a)), "a rejected step changed the state"
            else:
                same(a, b)
                break


@pytest.mark.parametrize("variant", ["ring", "circular"])
@pytest.mark.parametrize("checks", ["safe", "full"])
def test_kernel_equals_naive_on_clean_serving_steps(variant, checks):
    a, b = pair(layout(variant), R, T_MAX, SPEC, checks)
    work = Serve(layout(variant), 11)
    for _ in range(40):
        step = work.step()
        assert feed(a, step) is None and feed(b, step) is None
        same(a, b)


@pytest.mark.parametrize("kind", ["rings", "circular", "hybrid"])
@pytest.mark.parametrize("policy", ["vllm", "eager", "optimistic"])
def test_kernel_equals_naive_on_scheduler_traces(kind, policy):
    lay = trace_layout(kind)
    for checks in ("safe", "full"):
        sched = ReferenceScheduler(lay, 36, max_num_batched_tokens=24, max_num_seqs=5, num_speculative_tokens=2,
                                   long_prefill_threshold=16, seed=3, cache_when_scheduled=True, free_policy=policy)
        a, b = pair(lay, 6, 32, 2, checks)
        for step, _ in sched.random_trace(80, 3, prompt_len=(1, 120), max_new_tokens=(1, 20), prefix_prob=0.6):
            ea, eb = feed(a, step), feed(b, step)
            assert ea == eb, (ea, eb)
            if ea is not None:
                break                                   # NOTE: an optimistic trace may read a handed-over block
            same(a, b)
            assert np.array_equal(a.tables.mirror, b.tables.mirror)


def test_kernel_scratch_grows_within_a_step():
    """The kernel's id table starts at 4 records and its lists at 2 entries: the first steps fill the table
    up mid-pass (the pass runs again on a larger one), later ones pass half load (rebuilt before the next
    step); the count filter's log and the holder deltas overflow (the pass runs again on longer lists). The
    verdicts and the state stay the naive rule's, and the scratch is clean after every step."""
    a, b = pair(layout("ring"), R, T_MAX, SPEC, "safe")
    o = a.requests.owners
    o.fill, o.L = o._fills(4), np.zeros((3, 2), dtype=np.int64)
    work = Serve(layout("ring"), 5)
    sizes, lists = {o.fill.shape[0]}, {o.L.shape[1]}
    for _ in range(30):
        step = work.step()
        assert feed(a, step) is None and feed(b, step) is None
        same(a, b)
        assert not o.fill[:-2, 3].any() and not o.fill[:-2, 5].any(), "the passes' scratch columns not zeroed"
        assert (o.run_of == -1).all()
        sizes.add(o.fill.shape[0])
        lists.add(o.L.shape[1])
    assert len(sizes) >= 3 and len(lists) >= 2, (sizes, lists)
