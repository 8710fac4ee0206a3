"""The batch path of the ownership checks (``state/ownership_batch.py``) against the general rules: the same
serving steps (finishes and joins in one step, rejected drafts, crossings, blocks ahead) and the same
mutated steps through pipeline A (every path) and pipeline B (ownership on the general rules only, by
declining every fast path). Same verdicts, same messages, A unchanged by a rejection, and after every
accepted step the same holder counts, floors, ring low-water marks, frontiers and replay marks (and the
``checked`` marks under ``checks="full"``). The batch path must really be taken, on churn steps too."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index import MetadataPipeline

from helpers.batches import (MUTATION, R, SPEC, T_MAX, Serve, admit as _admit, batch as _batch, feed as _feed,
                             mutate as _mutate, reject as _reject, repro_pipe as _pipe)
from helpers.rejections import diff as _diff, layout as _layout, state

FIELDS = ("floor", "ring_lo", "frontier", "replay_mark")


def _pipes(monkeypatch, checks):
    import dsv4_index.state.owners as owners

    lay = _layout("ring")
    a = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, checks=checks, backend="reference")
    b = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, checks=checks, backend="reference")
    real, taken = owners.plan_fast, []

    def spy(o, plan, st_=None):
        if o is b.requests.owners:
            return None
        got = real(o, plan, st_)
        taken.append((getattr(got, "fast", None), bool(plan.free_slots.size or plan.new_slots.size)))
        return got

    monkeypatch.setattr(owners, "plan_fast", spy)
    return lay, a, b, taken


def _same_owners(a, b, checks):
    x, y = a.requests.owners, b.requests.owners
    n = max(x.count.shape[0], y.count.shape[0])
    cx, cy = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    cx[:x.count.shape[0]], cy[:y.count.shape[0]] = x.count, y.count
    assert np.array_equal(cx, cy), "holder counts differ"
    for k in FIELDS + (("checked",) if checks == "full" else ()):
        assert np.array_equal(getattr(x, k), getattr(y, k)), k


@pytest.mark.parametrize("checks", ["safe", "full"])
@pytest.mark.parametrize("seed", [3, 11])
def test_batch_path_keeps_the_general_state_on_serving_steps(monkeypatch, checks, seed):
    lay, a, b, taken = _pipes(monkeypatch, checks)
    work = Serve(lay, seed)
    for _ in range(120):
        step = work.step()
        ea, eb = _feed(a, step, None), _feed(b, step, None)
        assert ea == eb
        if ea is None:
            _same_owners(a, b, checks)
    batch = [c for f, c in taken if f == "batch"]
    assert len(batch) >= 40 and sum(batch) >= 10, (len(batch), sum(batch), len(taken))


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("checks", ["safe", "full"])
@settings(max_examples=25, deadline=None)
@given(seed=st.sampled_from(range(2 ** 16)), muts=st.lists(MUTATION, min_size=8, max_size=16))
def test_batch_path_gives_the_general_verdicts_on_mutated_steps(checks, seed, muts):
    with pytest.MonkeyPatch.context() as mp:
        _, a, b, _ = _pipes(mp, checks)
        work = Serve(_layout("ring"), seed)
        for kind, i, v in muts:
            step = work.step()
            bad, pad = _mutate(step, kind, i, v)
            for s, p_ in ((bad, pad), (step, None)) if bad is not step or pad is not None else ((step, None),):
                before = state(a)
                ea, eb = _feed(a, s, p_), _feed(b, s, p_)
                assert ea == eb, f"batch {ea!r} vs general {eb!r}"
                if ea is not None:
                    assert not _diff(before, state(a)), "a rejected step changed the state"
                else:
                    _same_owners(a, b, checks)
                    break


def _appends(p, rows, base):
    """One-id appends giving every row of ``rows`` (slot, nc, q, new) the blocks its ``nc + q`` needs."""
    from dsv4_index.batch import APPEND
    out = []
    for slot, nc, q, _ in rows:
        for g, grp in enumerate(p.layout.groups):
            need = -(-(nc + q) // grp.block_size) - int(p.tables.num_blocks[g, slot])
            out += [(g, slot, APPEND, [base[slot] + 100 * g + 60 + int(p.tables.num_blocks[g, slot]) + j])
                    for j in range(need)]
    return out


def test_a_row_rewinding_into_a_block_a_new_row_shares_is_rejected_on_the_batch_path(monkeypatch):
    """A fills its mla block 2 on the batch path; C joins (a churn step) holding A's blocks 0..2 as a
    prefix hit; A then rewinds (rejected drafts) into block 2: rejected, by the batch path's gather, with
    the general message; the same step without the rewind is accepted."""
    import dsv4_index.state.owners as owners
    taken = []
    real = owners.plan_fast

    def spy(o, plan, st_=None):
        got = real(o, plan, st_)
        taken.append(getattr(got, "fast", None))
        return got

    monkeypatch.setattr(owners, "plan_fast", spy)
    p, base = _pipe(), {0: 1000, 1: 2000, 2: 3000}
    p.update(_batch([(0, 0, 30, True), (1, 0, 30, True)], _admit(0, 1000, 0, 30) + _admit(1, 2000, 0, 30)))
    rows = [(0, 30, 3, False), (1, 30, 3, False)]
    p.update(_batch(rows, _appends(p, rows, base)))
    for nc in range(33, 69, 3):  # NOTE: A's mla block 2 (positions 64..95) is appended on the batch path
        rows = [(0, nc, 3, False), (1, nc, 3, False)]
        p.update(_batch(rows, _appends(p, rows, base)))
    assert taken[-5:] == ["batch"] * 5, taken
    a_mla = [int(x) for x in p.tables.row(0, 0)]
    assert len(a_mla) == 3
    lo = [0, 10, 22, 10]  # NOTE: the window block of position 96 per group
    c_runs = [(0, 2, 0, a_mla + [3003])] + [(g, 2, 0, [0] * lo[g] + [3000 + 100 * g + j for j in
                                                                     range(lo[g], -(-99 // bs))])
                                             for g, bs in enumerate((32, 8, 4, 8)) if g]
    rows = [(0, 67, 3, False), (1, 69, 3, False)]  # NOTE: A rewinds in the step C joins
    _reject(p, _batch(rows + [(2, 96, 3, True)], _appends(p, rows, base) + c_runs),
            r"slot 0 writes gid 0 \(mla\) from position 67, below the position 69 .*but slot 2 holds that block too")
    rows = [(0, 69, 3, False), (1, 69, 3, False)]
    p.update(_batch(rows + [(2, 96, 3, True)], _appends(p, rows, base) + c_runs))
    assert taken[-1] == "batch", taken
    rows = [(0, 70, 3, False), (1, 72, 3, False), (2, 99, 3, False)]
    _reject(p, _batch(rows, _appends(p, rows, base)),
            r"slot 0 writes gid 0 \(mla\) from position 70, below the position 72 .*but slot 2 holds that block too")
    rows = [(0, 72, 3, False), (1, 72, 3, False), (2, 99, 3, False)]
    p.update(_batch(rows, _appends(p, rows, base)))
    assert taken[-1] == "batch", taken
