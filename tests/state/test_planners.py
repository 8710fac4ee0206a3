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
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.batch import APPEND, StepBatch
from dsv4_index.state.plan import plans_equal
from dsv4_index.state.steady import FAST_CHECKS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_rejections import _diff, state  # noqa: E402

R, T_MAX, SPEC = 8, 64, 2
LAYOUTS = {"ring": {}, "circular": dict(circular={"c4_state": 12})}


def _layout(variant):
    return DSV4Layout.from_config("tiny", max_model_len=256, mla_block_size=16, swa_block_size=8,
                                  indexer_causal_indices=True, **LAYOUTS[variant])


class Serve:
    """Serving steps on a tiny layout: decodes with ``SPEC`` drafts (some rejected), short prefills,
    finishes and joins, a block exactly when ``nc + q`` needs one (sometimes one ahead)."""

    def __init__(self, lay, seed: int):
        self.rng = np.random.default_rng(seed)
        self.alloc = np.array([1 << 30 if g.kind == "circular" else g.alloc_block_size for g in lay.groups])
        self.G = len(lay.groups)
        self.free = list(range(R))
        self.rows, self.pending, self.next_id = [], [], 100
        for _ in range(4):
            self._join()

    def _join(self):
        slot = self.free.pop(int(self.rng.integers(len(self.free))))
        self.rows.append(dict(slot=slot, nc=int(self.rng.integers(0, 40)), new=True,
                              held=np.zeros(self.G, dtype=np.int64)))

    def step(self) -> StepBatch:
        rng = self.rng
        freed, self.pending = self.pending, []
        old = [k for k, r in enumerate(self.rows) if not r["new"]]
        if len(old) > 1 and rng.random() < 0.3:              # a finish, reported now
            freed.append(self.rows.pop(old[int(rng.integers(len(old)))])["slot"])
        self.free += freed                                   # NOTE: a join may take a freed slot at once
        if self.free and len(self.rows) < 6 and rng.random() < 0.4:
            self._join()
        g_, s_, st_, cu, ids, q = [], [], [], [0], [], []
        for k, r in enumerate(self.rows):
            qi = int(rng.integers(1, 13)) if r["new"] or rng.random() < 0.1 else 1 + SPEC
            qi = min(qi, 200 - r["nc"], T_MAX - sum(q) - 3 * (len(self.rows) - k - 1))
            q.append(max(qi, 1))
            need = -(-(r["nc"] + q[-1]) // self.alloc)
            extra = np.zeros(self.G, dtype=np.int64)
            if rng.random() < 0.1:
                extra[int(rng.integers(self.G))] = 1                     # a block ahead
            add = np.maximum(need - r["held"], 0) + extra * (self.alloc < (1 << 30))
            for g, n in enumerate(add.tolist()):
                if n or r["new"]:
                    g_.append(g), s_.append(r["slot"]), st_.append(0 if r["new"] else APPEND)
                    ids += list(range(self.next_id, self.next_id + n))
                    self.next_id += n
                    cu.append(len(ids))
            r["held"] = r["held"] + add
        a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        b = StepBatch(req_slots=a([r["slot"] for r in self.rows]), num_computed_tokens=a([r["nc"] for r in self.rows]),
                      num_scheduled_tokens=a(q), is_new=np.asarray([r["new"] for r in self.rows]),
                      free_slots=a(freed), write_gids=a(g_), write_slots=a(s_), write_starts=a(st_),
                      write_cu=a(cu), write_ids=a(ids))
        for r, qi in zip(self.rows, q):
            rej = int(rng.integers(0, qi)) if qi == 1 + SPEC and not r["new"] else 0
            r["nc"] += qi - rej                                          # rejected drafts
            r["new"] = False
        self.pending = [r["slot"] for r in self.rows if r["nc"] >= 190]
        self.rows = [r for r in self.rows if r["nc"] < 190]
        return b


def _mutate(b: StepBatch, kind: int, i: int, v: int):
    """One mutation of ``b`` (``kind`` picks the field, ``i`` the entry, ``v`` the value): (step, pad_to)."""
    rep = dataclasses.replace
    n, N = b.num_rows, b.num_runs
    i_r, i_w = i % max(n, 1), i % max(N, 1)
    vals = [-1, 0, 1, 2, 3, R - 1, R, 7, 15, 16, 17, 40, 2 ** 31, -(2 ** 40), 2 ** 62]
    x = vals[v % len(vals)]
    if kind == 1 and n:
        return rep(b, req_slots=_set(b.req_slots, i_r, x)), None
    if kind == 2 and n:
        return rep(b, num_computed_tokens=_set(b.num_computed_tokens, i_r, b.num_computed_tokens[i_r] + x)), None
    if kind == 3 and n:
        return rep(b, num_scheduled_tokens=_set(b.num_scheduled_tokens, i_r, x)), None
    if kind == 4 and n:
        new = b.is_new.copy()
        new[i_r] = ~new[i_r]
        return rep(b, is_new=new), None
    if kind == 5:
        return rep(b, free_slots=np.append(b.free_slots, x)), None
    if kind == 6 and b.write_ids.size:
        j = i % b.write_ids.size
        y = [0, -3, 2 ** 31 // 16, int(b.write_ids[(j + 1) % b.write_ids.size]), 100][v % 5]
        return rep(b, write_ids=_set(b.write_ids, j, y)), None
    if kind == 7 and N:
        return rep(b, write_starts=_set(b.write_starts, i_w, [-2, -1, 0, 1, 5, 100][v % 6])), None
    if kind == 8 and N:
        field = "write_gids" if v % 2 else "write_slots"
        return rep(b, **{field: _set(getattr(b, field), i_w, x)}), None
    if kind == 9 and N:
        return rep(b, write_cu=_set(b.write_cu, 1 + i_w, b.write_cu[1 + i_w] + (1 if v % 2 else -1))), None
    if kind == 10 and N:
        keep = np.arange(N) != i_w
        k = b.write_cu[1:] - b.write_cu[:-1]
        ids = np.concatenate([b.write_ids[b.write_cu[r]:b.write_cu[r + 1]] for r in np.flatnonzero(keep)] or
                             [np.zeros(0, np.int64)])
        return rep(b, write_gids=b.write_gids[keep], write_slots=b.write_slots[keep], write_starts=b.write_starts[keep],
                   write_cu=np.concatenate([[0], np.cumsum(k[keep])]).astype(np.int64), write_ids=ids), None
    if kind == 11 and n:                                     # one more one-id append
        g, s = v % 5, int(b.req_slots[i_r]) if v % 3 else x
        return rep(b, write_gids=np.append(b.write_gids, g), write_slots=np.append(b.write_slots, s),
                   write_starts=np.append(b.write_starts, APPEND), write_cu=np.append(b.write_cu, b.write_cu[-1] + 1),
                   write_ids=np.append(b.write_ids, 5000 + v)), None
    if kind == 12:
        T = int(b.num_scheduled_tokens.sum())
        return b, [T - 1, T, T + 1, T_MAX, T_MAX + 1, True][v % 6]
    if kind == 13:                                           # other dtypes (accepted alike)
        field = ["req_slots", "num_computed_tokens", "write_ids", "write_cu"][v % 4]
        return rep(b, **{field: getattr(b, field).astype(np.int32)}), None
    return b, None


def _set(a: np.ndarray, i: int, x: int) -> np.ndarray:
    out = a.astype(np.int64).copy()
    out[i] = np.int64(x) if -(2 ** 63) <= x < 2 ** 63 else 0
    return out


def _feed(p, b, pad):
    try:
        p.update(b, pad_to=pad)
    except ValueError as e:
        return str(e)
    p.staging.applied()
    return None


def _same(a, b):
    diff = plans_equal(a.last_plan, b.last_plan)
    assert not diff, f"the plans differ in {diff}"
    n = a.last_step_stats.h2d_bytes // 4
    assert n == b.last_step_stats.h2d_bytes // 4 and (a.staging.dev[:n] == b.staging.dev[:n]).all()
    assert (a.tables.mirror == b.tables.mirror).all() and (a.tables.num_blocks == b.tables.num_blocks).all()
    assert (a.occupied == b.occupied).all()


MUTATION = st.tuples(st.sampled_from(range(14)), st.sampled_from(range(64)), st.sampled_from(range(64)))


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
    return out


def test_every_general_check_is_proved_or_declined_by_the_fast_path():
    listed = {name for name, _ in FAST_CHECKS}
    found = set().union(*(_templates(ROOT / "dsv4_index" / "state" / f) for f in ("plan.py", "plan_runs.py")))
    assert found, "no check found in plan.py"
    assert not found - listed, f"checks of plan.py the fast path does not list (FAST_CHECKS): {found - listed}"
    assert not listed - found, f"FAST_CHECKS lists checks plan.py no longer has: {listed - found}"
    assert all(how.startswith(("proved", "declined")) for _, how in FAST_CHECKS)
