"""One planner (issue 37): the compiled check pass (``state/checks/kernel.py``) and the checks' definition
(``state/checks/naive.py``, whole-step numpy) accept and reject the same steps, with the same message
(code and fields) and the same plan.

* A hypothesis mutation strategy over serving steps on two tiny layouts (ring sliding tables; a
  circular ``c4_state`` group): rows finishing and joining (a freed slot taken again in the same step),
  rejected drafts, rows crossing into new blocks, rows holding blocks ahead (the ring bound), and one
  mutation per step of any field (slots, counts, ``is_new``, freed slots, every write-run array, dtypes,
  ``pad_to``). Before each step the pass and the definition plan it from the same state; both accept
  with equal plans (:func:`plans_equal`) or both reject with one message. A rejection leaves the pipeline
  exactly as it was. ``validate=True`` does the same comparison inside ``update()`` on every step.
* Every code the pass can return is a message of the table, and every step-check message of the table
  is a code the pass returns (or an array conversion of its wrapper).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index import MetadataPipeline
from dsv4_index.state.checks import kernel
from dsv4_index.state.checks.naive import plan_step
from dsv4_index.state.messages import MESSAGES, Rejection
from dsv4_index.state.plan import plans_equal

from helpers.batches import MUTATION, R, SPEC, T_MAX, Serve, feed as _feed, mutate as _mutate
from helpers.rejections import diff as _diff, layout as _layout, state


def _verdict(fn):
    try:
        return fn()
    except ValueError as e:
        return e


def _compare(p, step, pad):
    """The pass and the definition on ``step`` against ``p``'s state: equal plans or equal rejections."""
    rs = p.requests
    got = _verdict(lambda: rs.checks.plan(step, rs.occupied, pad))
    ref = _verdict(lambda: plan_step(step, occupied=rs.occupied, tables=p.tables, pad_to=pad, **rs._kw))
    if isinstance(got, ValueError) or isinstance(ref, ValueError):
        assert type(got) is type(ref) and str(got) == str(ref), f"pass {got!r} vs definition {ref!r}"
        if isinstance(got, Rejection):
            assert got.code == ref.code and got.positions() == ref.positions()
        return False
    diff = plans_equal(got, ref)
    assert not diff, f"the plans differ in {diff}"
    return True


def _run(variant, checks, seed, muts):
    lay = _layout(variant)
    a = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, checks=checks, backend="reference")
    c = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, checks=checks, backend="reference", validate=checks == "full")
    work, accepted = Serve(lay, seed), 0
    for kind, i, v in muts:
        step = work.step()
        bad, pad = _mutate(step, kind, i, v)
        for s, p_ in ((bad, pad), (step, None)) if bad is not step or pad is not None else ((step, None),):
            _compare(a, s, p_)
            before = state(a)
            ea, ec = _feed(a, s, p_), _feed(c, s, p_)
            assert ea == ec, f"{ea!r} vs validate {ec!r}"
            if ea is not None:
                assert not _diff(before, state(a)), "a rejected step changed the state"
            else:
                accepted += 1
                break
    return accepted


@pytest.mark.parametrize("variant", ["ring", "circular"])
@pytest.mark.parametrize("checks", ["safe", "full"])
@settings(max_examples=6, deadline=None)
@given(seed=st.sampled_from(range(2 ** 16)), muts=st.lists(MUTATION, min_size=8, max_size=12))
def test_pass_equals_definition_on_mutated_serving_steps(variant, checks, seed, muts):
    _run(variant, checks, seed, muts)


@pytest.mark.slow  # NOTE: the long run (CI)
@pytest.mark.parametrize("variant", ["ring", "circular"])
@pytest.mark.parametrize("checks", ["safe", "full"])
@settings(max_examples=40, deadline=None)
@given(seed=st.sampled_from(range(2 ** 16)), muts=st.lists(MUTATION, min_size=8, max_size=24))
def test_pass_equals_definition_on_long_mutated_streams(variant, checks, seed, muts):
    _run(variant, checks, seed, muts)


@pytest.mark.parametrize("variant", ["ring", "circular"])
def test_clean_serving_steps_plan_alike(variant):
    """80 clean serving steps (finishes, joins, rejected drafts, crossings, blocks ahead): equal plans."""
    lay = _layout(variant)
    a = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, backend="reference")
    work, n = Serve(lay, 7), 0
    for _ in range(80):
        step = work.step()
        n += _compare(a, step, None)
        _feed(a, step, None)
    assert n >= 60


def test_every_code_of_the_pass_is_a_message_and_back():
    codes = set(kernel.CODES) - {"", "deferred", "lengths"}  # NOTE: the two the wrapper handles itself
    assert codes <= set(MESSAGES)
    wrapper = {"step_type", "not_array", "bad_dtype", "bad_length"}  # NOTE: array conversions, in Python
    steps = {c for c, m in MESSAGES.items() if m.level == "safe"} - wrapper - {"free_twice"}
    assert steps <= codes | {"free_twice"} and "free_twice" in kernel.CODES


@pytest.mark.parametrize("kw", [dict(checks="full"), dict(validate=True)])
def test_full_checks_take_a_step_without_write_arrays(kw):
    """A valid StepBatch with no write arrays at all (a decode that needs no new block) is accepted under
    ``checks="full"`` and ``validate=True`` (issue 37 item 3(iv): the deleted incremental full path read
    ``write_cu`` there)."""
    import dataclasses

    lay = _layout("ring")
    p = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, backend="reference", **kw)
    first = Serve(lay, 5).step()
    p.update(first)
    bare = dataclasses.replace(first, is_new=None, write_gids=None, write_slots=None, write_starts=None,
                               write_cu=None, write_ids=None, free_slots=None,
                               num_computed_tokens=first.num_computed_tokens + first.num_scheduled_tokens,
                               num_scheduled_tokens=first.num_scheduled_tokens * 0 + 1)
    p.update(bare)
    assert p.last_plan.w_gid.size == 0 and p.last_plan.num_tokens == first.num_rows


@pytest.mark.parametrize("variant", ["ring", "circular"])
def test_native_arrays_and_converted_arrays_plan_alike(variant, monkeypatch):
    """The step's own int64 arrays go straight to the pass (``StepChecks._native``); converted one by one
    (``_NATIVE`` off) they give the same plan; the same step as lists / int32 / strided views is not taken
    natively (None) and gives the same plan too. Under ``NUMBA_DISABLE_JIT=1`` (no native path) the forms still
    plan alike."""
    import dataclasses

    import numpy as np

    from dsv4_index.state import checks as checks_mod

    lay = _layout(variant)
    p = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, backend="reference")
    work, native = Serve(lay, 11), 0
    for k in range(40):
        step = work.step()
        chk, occ = p.requests.checks, p.requests.occupied
        native += checks_mod._NATIVE and chk._native(step, occ) is not None
        got = _verdict(lambda c=chk, s=step, o=occ: c.plan(s, o, None))
        with monkeypatch.context() as m:
            m.setattr(checks_mod, "_NATIVE", False)
            ref = _verdict(lambda c=chk, s=step, o=occ: c.plan(s, o, None))
        nc = np.asarray(step.num_computed_tokens)
        alt = dataclasses.replace(step, num_computed_tokens=(nc.tolist(), nc.astype(np.int32),
                                                             np.repeat(nc, 2)[::2])[k % 3])
        assert not checks_mod._NATIVE or chk._native(alt, occ) is None
        other = _verdict(lambda c=chk, s=alt, o=occ: c.plan(s, o, None))
        for x in (ref, other):
            assert (str(x) == str(got)) if isinstance(got, ValueError) else not plans_equal(x, got)
        _feed(p, step, None)
    assert native >= 30 or not checks_mod._NATIVE  # NOTE: NUMBA_DISABLE_JIT=1: every step is converted
