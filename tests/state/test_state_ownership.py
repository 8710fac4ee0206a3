"""Who writes what (issue 18 item 1) and the one planner on steady and churning batches (issue 37).

* ``pipeline.py`` composes: it assigns no attribute or item of any object but its own (``self.x = ...``,
  ``self._graphs[k] = ...``); the state it changes is changed by its owners' methods (``state/``).
* The compiled check pass (``state/checks/kernel.py``) gives the same plan as its definition
  (``state/checks/naive.py``; pipeline B compares them on every step) and A and B the same staging bytes,
  tables and outputs, on steady decode with mixed counts, a continuing prefill row (decode-first order
  differs from the batch order), padding, rows over-allocating until the ring bound breaks, rows growing to
  the table width, and batches that change; every bad step is rejected with the same message and changes
  nothing.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from dsv4_index import MetadataPipeline
from dsv4_index.batch import APPEND, StepBatch
from dsv4_index.state.plan import plans_equal

from helpers.rejections import diff as _diff, layout, outputs, state

ROOT = Path(__file__).resolve().parents[2]
R, T_MAX, SPEC = 8, 64, 2


def test_pipeline_writes_only_its_own_attributes():
    tree = ast.parse((ROOT / "dsv4_index" / "pipeline.py").read_text())
    bad = []

    def own(node) -> bool:  # self.x, or an item of self.x
        if isinstance(node, ast.Attribute):
            return isinstance(node.value, ast.Name) and node.value.id == "self"
        if isinstance(node, ast.Subscript):
            return isinstance(node.value, ast.Attribute) and own(node.value)
        return True  # a local name

    def targets(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Starred):
            yield from targets(t.value)
        else:
            yield t

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            ts = [x for t in node.targets for x in targets(t)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            ts = list(targets(node.target))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            bad.append(f"line {node.lineno}: {node.func.id}")
            continue
        else:
            continue
        bad += [f"line {t.lineno}: {ast.unparse(t)}" for t in ts if not own(t)]
        # NOTE: self.a.b = ... or self.a.b[i] = ... writes another object's state
        bad += [f"line {t.lineno}: {ast.unparse(t)}" for t in ts
                if isinstance(t, (ast.Attribute, ast.Subscript)) and _depth(t) > 1]
    assert not bad, f"pipeline.py writes other objects' state: {bad}"


def _depth(t) -> int:
    """Attribute hops below ``self`` of an assignment target (``self.x`` -> 1, ``self.x[i]`` -> 1)."""
    while isinstance(t, ast.Subscript):
        t = t.value
    n = 0
    while isinstance(t, ast.Attribute):
        n, t = n + 1, t.value
    return n


# ----------------------------------------------------------------------------------------------
# a steady workload on the tiny layouts: rows admitted once, then every step the same counts
# ----------------------------------------------------------------------------------------------
class Steady:
    """Rows ``SLOTS`` with counts ``Q`` (row 1 a continuing prefill); ``over``: row 0 appends one more
    swa block than it needs every step."""

    SLOTS = [3, 0, 5, 1, 6]
    Q = [1, 4, 2, 1, 3]   # NOTE: 4 > 1 + SPEC: row 1 is a prefill (placed last); <= 4 tokens: one id per run

    def __init__(self, lay, seed: int, over: bool = False):
        rng = np.random.default_rng(seed)
        self.alloc = np.array([1 << 30 if g.kind == "circular" else g.alloc_block_size for g in lay.groups])
        self.nc = rng.integers(5, 60, size=len(self.SLOTS))
        self.have = np.zeros((len(self.SLOTS), len(lay.groups)), dtype=np.int64)
        self.next_id, self.first, self.over = 100, True, over

    def _ids(self, n):
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def step(self) -> StepBatch:
        q = np.array(self.Q)
        g_, s_, st_, cu, ids = [], [], [], [0], []
        for i, slot in enumerate(self.SLOTS):
            need = -(-(self.nc[i] + q[i]) // self.alloc)
            for g, n in enumerate(np.maximum(need - self.have[i], 0).tolist()):
                n += int(self.over and i == 0 and g == 1 and not self.first)
                if n > 0 or self.first:
                    g_.append(g), s_.append(slot), st_.append(0 if self.first else APPEND)
                    ids += self._ids(max(n, 0))
                    cu.append(len(ids))
                    self.have[i, g] += max(n, 0)
        b = StepBatch(req_slots=np.array(self.SLOTS), num_computed_tokens=self.nc.copy(), num_scheduled_tokens=q,
                      is_new=np.full(len(q), self.first), write_gids=np.array(g_, dtype=np.int64),
                      write_slots=np.array(s_, dtype=np.int64), write_starts=np.array(st_, dtype=np.int64),
                      write_cu=np.array(cu, dtype=np.int64), write_ids=np.array(ids, dtype=np.int64))
        self.nc = self.nc + q
        self.first = False
        return b


def _pipes(variant, checks="safe"):
    """Two pipelines; B compares the compiled check pass with its definition on every step."""
    a, b = (MetadataPipeline(layout(variant), R, T_MAX, "cpu", SPEC, checks=checks, backend="reference")
            for _ in range(2))
    b.requests.cross_check = True
    return a, b


def _same(a, b):
    diff = plans_equal(a.last_plan, b.last_plan)  # NOTE: all but the fields saying how a plan was made
    assert not diff, f"the plans differ in {diff}"
    lay, n = a.stage_layout, a.last_step_stats.num_writes
    used = lay.writes + 2 * n
    assert (a.staging.dev[:used] == b.staging.dev[:used]).all()
    assert (a.tables.mirror == b.tables.mirror).all() and (a.tables.num_blocks == b.tables.num_blocks).all()
    assert (a.occupied == b.occupied).all()


def _bad_steps(c, b: StepBatch, pipe):
    """Bad versions of a steady step, each rejected by the checks: (step, pad_to)."""
    rep = dataclasses.replace
    out = []
    if b.num_runs:
        ids = b.write_ids.copy()
        ids[0] = int(pipe.tables.id_max.max()) + 1
        out.append((rep(b, write_ids=ids), None))                          # beyond int32
        ids = b.write_ids.copy()
        ids[-1] = -3
        out.append((rep(b, write_ids=ids), None))                          # negative id
        out.append((rep(b, write_gids=b.write_gids[1:], write_slots=b.write_slots[1:], write_starts=b.write_starts[1:],
                        write_cu=b.write_cu[1:] - 1, write_ids=b.write_ids[1:]), None))  # a needed block missing
        out.append((rep(b, write_gids=np.append(b.write_gids, b.write_gids[0]),      # two runs for one (g, slot)
                        write_slots=np.append(b.write_slots, b.write_slots[0]),
                        write_starts=np.append(b.write_starts, -1), write_cu=np.append(b.write_cu, b.write_cu[-1] + 1),
                        write_ids=np.append(b.write_ids, 9999)), None))
        slots = b.write_slots.copy()
        slots[0] = 2                                                       # a slot holding no request
        out.append((rep(b, write_slots=slots), None))
        cu = b.write_cu.copy()
        cu[-1] += 1
        out.append((rep(b, write_cu=cu), None))
    T = int(b.num_scheduled_tokens.sum())
    out.append((b, T - 1))                                                 # pad_to below T
    out.append((b, T_MAX + 1))                                             # pad_to beyond capacity
    out.append((rep(b, req_slots=np.where(np.arange(b.num_rows) == 2, R, b.req_slots)), None))
    return out


@pytest.mark.parametrize("variant", ["ring", "circular"])
def test_steady_steps_plan_alike(variant):
    a, b = _pipes(variant)
    work = Steady(layout(variant), seed=3)
    for i in range(22):
        step = work.step()
        pad = None if i % 3 else T_MAX
        if i >= 2:
            for bad, pad_to in _bad_steps(work, step, a):
                before = state(a)
                with pytest.raises(ValueError) as ea:
                    a.update(bad, pad_to=pad_to)
                with pytest.raises(ValueError) as eb:
                    b.update(bad, pad_to=pad_to)
                assert str(ea.value) == str(eb.value)
                assert not _diff(before, state(a)), "a rejected steady step changed the state"
        a.update(step, pad_to=pad)
        b.update(step, pad_to=pad)
        _same(a, b)
        if i % 4 == 0:
            assert not _diff(outputs(a.build()), outputs(b.build()))
        else:
            a.build(), b.build()


def test_steady_full_checks_keep_their_errors():
    a, b = _pipes("ring", checks="full")
    work, hits = Steady(layout("ring"), seed=5), 0
    for i in range(40):
        step = work.step()
        if i >= 2 and step.num_runs and step.write_gids[0] == 0 and hits < 3:
            g0 = int(step.write_slots[0])
            dup = int(a.tables.row(0, g0)[0])                  # NOTE: an id already in the full group's row
            ids = step.write_ids.copy()
            ids[0] = dup
            for p in (a, b):
                with pytest.raises(ValueError, match=f"block id {dup} twice in gid 0"):
                    p.update(dataclasses.replace(step, write_ids=ids))
            ids[0] = 0
            for p in (a, b):
                with pytest.raises(ValueError, match="the null block 0 in full group gid 0"):
                    p.update(dataclasses.replace(step, write_ids=ids))
            hits += 1
        a.update(step)
        b.update(step)
        _same(a, b)
    assert hits >= 2


def test_over_allocation_breaks_the_ring_bound_alike():
    a, b = _pipes("ring")
    work = Steady(layout("ring"), seed=3, over=True)
    for _ in range(30):
        step = work.step()
        errs = []
        for p in (a, b):
            try:
                p.update(step)
                errs.append(None)
            except ValueError as e:
                errs.append(str(e))
        assert errs[0] == errs[1]
        if errs[0] is not None:
            assert "is a ring of" in errs[0]
            break
        _same(a, b)
    else:
        pytest.fail("the over-allocating row never broke the ring bound")


@pytest.mark.parametrize("variant", ["ring", "circular"])
def test_rows_growing_to_the_table_width_are_rejected_alike(variant):
    """Rows grow until a table is full (``max_model_len``): the step that no longer fits is rejected with
    one message on both pipelines, state untouched."""
    a, b = _pipes(variant)
    work, err = Steady(layout(variant), seed=7), None
    for i in range(120):
        step = work.step()
        errs = []
        for p in (a, b):
            before = state(p)
            try:
                p.update(step)
                errs.append(None)
            except ValueError as e:
                errs.append(str(e))
                assert not _diff(before, state(p)), "a rejected step changed the state"
        assert errs[0] == errs[1], f"step {i}: steady {errs[0]!r} vs general {errs[1]!r}"
        if errs[0] is not None:
            err = errs[0]
            break
        _same(a, b)
    assert err is not None and "the table holds" in err, err


class Churn(Steady):
    """:class:`Steady` whose batch changes now and then: a row's request finishes and a new one takes
    its place in another slot (``replace``), or two rows trade places (``swap``)."""

    def __init__(self, lay, seed: int):
        super().__init__(lay, seed)
        self.slots, self.q = list(self.SLOTS), list(self.Q)
        self.fresh, self.freed = set(), []
        self.rng = np.random.default_rng(seed + 1)

    def replace(self, i: int, slot: int):
        self.freed.append(self.slots[i])
        self.gone = self.slots[i]
        self.slots[i] = slot
        self.nc[i] = int(self.rng.integers(0, 9))
        self.have[i] = 0
        self.fresh.add(i)

    def swap(self, i: int, j: int):
        for a in (self.slots, self.q):
            a[i], a[j] = a[j], a[i]
        self.nc[[i, j]] = self.nc[[j, i]]
        self.have[[i, j]] = self.have[[j, i]]

    def step(self) -> StepBatch:
        q = np.array(self.q)
        g_, s_, st_, cu, ids = [], [], [], [0], []
        for i, slot in enumerate(self.slots):
            new = self.first or i in self.fresh
            need = -(-(self.nc[i] + q[i]) // self.alloc)
            for g, n in enumerate(np.maximum(need - self.have[i], 0).tolist()):
                if n > 0 or new:
                    g_.append(g), s_.append(slot), st_.append(0 if new else APPEND)
                    ids += self._ids(n)
                    cu.append(len(ids))
                    self.have[i, g] += n
        is_new = np.array([self.first or i in self.fresh for i in range(len(q))])
        b = StepBatch(req_slots=np.array(self.slots), num_computed_tokens=self.nc.copy(), num_scheduled_tokens=q,
                      is_new=is_new, free_slots=np.array(self.freed, dtype=np.int64),
                      write_gids=np.array(g_, dtype=np.int64), write_slots=np.array(s_, dtype=np.int64),
                      write_starts=np.array(st_, dtype=np.int64), write_cu=np.array(cu, dtype=np.int64),
                      write_ids=np.array(ids, dtype=np.int64))
        self.nc = self.nc + q
        self.first, self.fresh, self.freed = False, set(), []
        return b


@pytest.mark.parametrize("variant", ["ring", "circular"])
def test_a_changed_batch_plans_alike(variant):
    """After a batch change (a request replaced in another slot, two rows trading places, a slot
    coming back) the plans, staging, tables and outputs stay equal; bad steps after a change (one for a
    slot that just left the batch) are rejected alike, state untouched."""
    a, b = _pipes(variant)
    work = Churn(layout(variant), seed=11)
    events = {3: ("replace", 0, 2), 7: ("swap", 0, 3), 11: ("replace", 2, 4), 15: ("replace", 4, 3),
              19: ("swap", 1, 2), 23: ("replace", 3, 5)}  # NOTE: slot 3 (freed at 3) and 5 (at 11) come back
    for i in range(28):
        if i in events:
            kind, x, y = events[i]
            getattr(work, kind)(x, y)
        step = work.step()
        if i >= 2 and i - 1 in events:
            bads = _bad_steps(work, step, a)
            if events[i - 1][0] == "replace" and work.gone not in work.slots:
                # NOTE: one more append, for the slot that just left the batch, in a group where its old
                # row appends nothing this step (a stale cache would take it for that row's)
                took = work.slots[events[i - 1][1]]
                busy = set(step.write_gids[step.write_slots == took].tolist())
                g = next(g for g in range(len(a.tables.groups)) if g not in busy)
                bads.append((dataclasses.replace(
                    step, write_gids=np.append(step.write_gids, g), write_slots=np.append(step.write_slots, work.gone),
                    write_starts=np.append(step.write_starts, APPEND),
                    write_cu=np.append(step.write_cu, step.write_cu[-1] + 1),
                    write_ids=np.append(step.write_ids, 9999)), None))
            for bad, pad_to in bads:
                before = state(a)
                with pytest.raises(ValueError) as ea:
                    a.update(bad, pad_to=pad_to)
                with pytest.raises(ValueError) as eb:
                    b.update(bad, pad_to=pad_to)
                assert str(ea.value) == str(eb.value)
                assert not _diff(before, state(a)), "a rejected steady step changed the state"
        a.update(step)
        b.update(step)
        _same(a, b)
        if i % 4 == 1:
            assert not _diff(outputs(a.build()), outputs(b.build()))
        else:
            a.build(), b.build()

