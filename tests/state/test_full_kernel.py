"""``checks="full"`` compiled (``state/checks/kernel.py`` :func:`full_step`) against its definition
(``state/checks/naive.py`` :func:`full_checks`, whole-step numpy): on serving steps of both tiny layouts,
corrupted toward each full-level rule (a null id where a row reads, an id twice in a full / circular row
or already held there, a ring block of a circular group in two live rows), the two accept alike or reject
with the same message (code and fields). Every one of the three rules must be hit, so the comparison
cannot pass by never reaching them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dsv4_index import MetadataPipeline
from dsv4_index.state.checks import kernel
from dsv4_index.state.checks.naive import plan_step
from dsv4_index.state.messages import MESSAGES, Rejection

from helpers.batches import R, SPEC, T_MAX, Serve, feed
from helpers.rejections import layout as _layout


def _verdict(fn):
    try:
        fn()
    except ValueError as e:
        return e
    return None


def _corrupt(b, p, rng) -> list:
    """Variants of ``b`` aimed at the full rules (ids taken from ``p``'s held rows and the step's own)."""
    out = []
    rep = dataclasses.replace
    ids = b.write_ids
    if ids.size:
        for _ in range(2):
            j = int(rng.integers(ids.size))
            out.append(rep(b, write_ids=np.where(np.arange(ids.size) == j, 0, ids)))        # a null id
            out.append(rep(b, write_ids=np.where(np.arange(ids.size) >= j, 0, ids)))        # several
            k = int(rng.integers(ids.size))
            out.append(rep(b, write_ids=np.where(np.arange(ids.size) == j, ids[k], ids)))   # an id twice
    held = p.tables.mirror[p.tables.mirror > 1]
    if ids.size and held.size:
        for _ in range(3):  # NOTE: an id some live row already holds (its own row, or another's ring)
            j, x = int(rng.integers(ids.size)), int(held[int(rng.integers(held.size))])
            out.append(rep(b, write_ids=np.where(np.arange(ids.size) == j, x, ids)))
    t = p.tables
    for r in np.flatnonzero(t.circular[b.write_gids] & (b.write_cu[1:] > b.write_cu[:-1])).tolist():
        g, s = int(b.write_gids[r]), int(b.write_slots[r])
        others = t.mirrors[g][np.flatnonzero(p.requests.occupied & (np.arange(t.max_num_reqs) != s))]
        others = others[others > 0]
        if others.size:  # NOTE: a ring block another live row holds, in this row's ring
            j = int(b.write_cu[r])
            out.append(rep(b, write_ids=np.where(np.arange(ids.size) == j, int(others[0]), ids)))
    return out


@pytest.mark.parametrize("variant", ["ring", "circular"])
def test_full_pass_equals_definition_on_corrupted_serving_steps(variant):
    lay = _layout(variant)
    rng, codes = np.random.default_rng(3), set()
    for seed in range(6):
        p = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, checks="full", backend="reference")
        rs, work = p.requests, Serve(lay, seed)
        for _ in range(40):
            step = work.step()
            for s in [*_corrupt(step, p, rng), step]:
                got = _verdict(lambda s=s, rs=rs: rs.checks.plan(s, rs.occupied, None))
                ref = _verdict(lambda s=s, rs=rs, p=p: plan_step(s, occupied=rs.occupied, tables=p.tables,
                                                                 pad_to=None, **rs._kw))
                assert type(got) is type(ref) and str(got) == str(ref), f"pass {got!r} vs definition {ref!r}"
                if isinstance(got, Rejection):
                    assert got.code == ref.code and got.positions() == ref.positions()
                    codes.add(got.code)
            assert feed(p, step, None) is None
    want = {"null_block", "id_twice"} | ({"ring_shared"} if variant == "circular" else set())
    assert want <= codes, f"rules never reached: {want - codes}"


def test_every_full_code_is_a_message():
    assert set(kernel.FULL_CODES) - {""} <= {c for c, m in MESSAGES.items() if m.level == "full"}
