"""One planner of record (issue 26 item 3): the incremental path (``state/steady.py``) and the general
checks (``state/plan.py``) accept and reject the same steps, with the same messages and the same plans.

* A hypothesis mutation strategy over serving steps on two tiny layouts (ring sliding tables; a
  circular ``c4_state`` group): rows finishing and joining (a freed slot taken again in the same step),
  rejected drafts (``num_computed_tokens`` advancing by less than was scheduled), rows crossing into
  new blocks, rows holding blocks ahead (the ring bound), and one mutation per step of any field
  (slots, counts, ``is_new``, freed slots, every write-run array, dtypes, ``pad_to``). Pipeline A plans
  incrementally, B takes the general checks only (``steady=False``); both see every step. Both must
  accept or both reject with one message; a rejection leaves A exactly as it was; after an accepted
  step the plans (:func:`plans_equal`), the staged bytes, the tables and the occupancy are equal.
  Under ``checks="full"`` a third pipeline has ``validate=True`` (it runs both planners itself and
  raises ``AssertionError`` on a plan difference) and must give the same verdicts.
* The fast path is really taken on clean serving steps (churn, rejected drafts, crossings).
* :data:`~dsv4_index.state.steady.FAST_CHECKS` lists every check ``plan.py`` / ``plan_runs.py`` raise:
  a new check there fails this test until the fast path proves or declines it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index import MetadataPipeline
from dsv4_index.state.messages import MESSAGES
from dsv4_index.state.plan import plans_equal
from dsv4_index.state.steady import FAST_CHECKS

from helpers import ROOT
from helpers.batches import MUTATION, R, SPEC, T_MAX, Serve, feed as _feed, mutate as _mutate
from helpers.rejections import diff as _diff, layout as _layout, state


def _same(a, b):
    diff = plans_equal(a.last_plan, b.last_plan)
    assert not diff, f"the plans differ in {diff}"
    n = a.last_step_stats.h2d_bytes // 4
    assert n == b.last_step_stats.h2d_bytes // 4 and (a.staging.dev[:n] == b.staging.dev[:n]).all()
    assert (a.tables.mirror == b.tables.mirror).all() and (a.tables.num_blocks == b.tables.num_blocks).all()
    assert (a.occupied == b.occupied).all()




@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("variant", ["ring", "circular"])
@pytest.mark.parametrize("checks", ["safe", "full"])
@settings(max_examples=30, deadline=None)
@given(seed=st.sampled_from(range(2 ** 16)), muts=st.lists(MUTATION, min_size=8, max_size=16))
def test_both_planners_agree_on_mutated_serving_steps(variant, checks, seed, muts):
    lay = _layout(variant)
    a = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, checks=checks, backend="reference")
    b = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, checks=checks, backend="reference", steady=False)
    # NOTE: validate=True runs both planners itself (an AssertionError on a plan difference)
    c = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, checks=checks, backend="reference", validate=checks == "full")
    work = Serve(lay, seed)
    for kind, i, v in muts:
        step = work.step()
        bad, pad = _mutate(step, kind, i, v)
        for s, p_ in ((bad, pad), (step, None)) if bad is not step or pad is not None else ((step, None),):
            before = state(a)
            ea, eb, ec = _feed(a, s, p_), _feed(b, s, p_), _feed(c, s, p_)
            assert ea == eb == ec, f"fast {ea!r} vs general {eb!r} (validate: {ec!r})"
            if ea is not None:
                assert not _diff(before, state(a)), "a rejected step changed the state"
            else:
                _same(a, b)
                break


@pytest.mark.parametrize("variant", ["ring", "circular"])
def test_serving_steps_take_the_fast_path(variant):
    """Clean serving steps (finishes, joins, rejected drafts, crossings, blocks ahead) are planned
    incrementally, and the plans equal the general ones."""
    lay = _layout(variant)
    a = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, backend="reference")
    b = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, backend="reference", steady=False)
    work, fast, churn, n = Serve(lay, 7), 0, 0, 0
    for i in range(80):
        step = work.step()
        ea, eb = _feed(a, step, None), _feed(b, step, None)
        assert ea == eb
        if ea is not None:
            continue
        _same(a, b)
        if i:
            n += 1
            fast += a.last_plan.steady
            churn += a.last_plan.steady and (step.is_new.any() or step.free_slots.size)
    assert n >= 60 and churn >= 10
    # NOTE: the circular variant declines a joining row (its ring runs take the general path)
    assert fast >= (0.9 if variant == "ring" else 0.6) * n, f"{fast} of {n} steps on the fast path"


def _templates(path: Path) -> set:
    """Every literal ``raise ValueError(...)`` message of a module, formatted values as ``{}``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and getattr(node.exc.func, "id", "") == \
                "ValueError" and node.exc.args:
            msg = node.exc.args[0]
            if isinstance(msg, ast.Constant):
                out.add(msg.value)
            elif isinstance(msg, ast.JoinedStr):
                out.add("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in msg.values))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "reject":  # NOTE: state/messages.py
            out.add(re.sub(r"\{[^}]*\}", "{}", MESSAGES[node.args[0].value].template))
    return out


def test_every_general_check_is_proved_or_declined_by_the_fast_path():
    listed = {name for name, _ in FAST_CHECKS}
    found = set().union(*(_templates(ROOT / "dsv4_index" / "state" / f) for f in ("plan.py", "plan_runs.py")))
    assert found, "no check found in plan.py"
    assert not found - listed, f"checks of plan.py the fast path does not list (FAST_CHECKS): {found - listed}"
    assert not listed - found, f"FAST_CHECKS lists checks plan.py no longer has: {listed - found}"
    assert all(how.startswith(("proved", "declined")) for _, how in FAST_CHECKS)
