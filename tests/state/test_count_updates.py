"""``bump`` and ``release`` (``state/ownership_rules.py``), the holder-count updates of every commit, against
``np.add.at`` on randomized tables and key lists (repeated keys included)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hs

from dsv4_index.state.ownership_rules import bump, release


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.integers(0, 3), min_size=1, max_size=40), hs.data())
def test_release_equals_subtract_at(counts, data):
    count = np.asarray(counts, dtype=np.int32)
    held = [k for k, c in enumerate(counts) for _ in range(c)]  # NOTE: one entry per holding
    if not held:
        return
    picks = data.draw(hs.lists(hs.integers(0, len(held) - 1), unique=True, max_size=len(held)))
    keys = np.asarray([held[i] for i in picks], dtype=np.int64)
    want = count.copy()
    np.add.at(want, keys, -1)
    release(count, keys)
    assert np.array_equal(count, want)
    assert (count >= 0).all()


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.integers(0, 15), max_size=40), hs.sampled_from([-1, 1, 2]))
def test_bump_equals_add_at(keys, d):
    count = np.full(16, 5, dtype=np.int32)
    k = np.asarray(keys, dtype=np.int64)
    want = count.copy()
    np.add.at(want, k, d)
    bump(count, k, d)
    assert np.array_equal(count, want)


def test_release_of_a_repeated_key_takes_the_sorting_path():
    count = np.array([0, 2, 1, 0], dtype=np.int32)
    release(count, np.array([1, 1, 2], dtype=np.int64))  # NOTE: key 1 held twice, released twice
    assert count.tolist() == [0, 0, 0, 0]
