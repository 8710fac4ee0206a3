"""``StepBatch`` steps for the ownership and planner tests (``tests/state/``).

* Random serving steps (:class:`Serve`: decodes with drafts, some rejected, short prefills, finishes and joins, blocks
  exactly when needed or one ahead) and one mutation of any field per step (:func:`mutate`, drawn from
  :data:`MUTATION`), fed with :func:`feed` (the message of a rejection, or ``None``).
* Hand-written steps on :func:`~helpers.layouts.two_layer_layout` (``rows``: (slot, nc, q, new); ``runs``: (gid,
  slot, start, ids)), and :func:`reject`: a step refused with one line that leaves the pipeline and its ownership
  records exactly as they were.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import strategies as st

from dsv4_index import MetadataPipeline
from dsv4_index.batch import APPEND, StepBatch

from helpers.layouts import two_layer_layout
from helpers.rejections import diff, state

# ----------------------------------------------------------------------------------------------
# random serving steps and their mutations
# ----------------------------------------------------------------------------------------------
R, T_MAX, SPEC = 8, 64, 2  # slots, token capacity, draft tokens


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


def mutate(b: StepBatch, kind: int, i: int, v: int):
    """One mutation of ``b`` (``kind`` picks the field, ``i`` the entry, ``v`` the value): (step, pad_to)."""
    rep = dataclasses.replace
    n, N = b.num_rows, b.num_runs
    i_r, i_w = i % max(n, 1), i % max(N, 1)
    vals = [-1, 0, 1, 2, 3, R - 1, R, 7, 15, 16, 17, 40, 2 ** 31, -(2 ** 40), 2 ** 62]
    x = vals[v % len(vals)]
    if kind == 1 and n:
        return rep(b, req_slots=set_entry(b.req_slots, i_r, x)), None
    if kind == 2 and n:
        return rep(b, num_computed_tokens=set_entry(b.num_computed_tokens, i_r, b.num_computed_tokens[i_r] + x)), None
    if kind == 3 and n:
        return rep(b, num_scheduled_tokens=set_entry(b.num_scheduled_tokens, i_r, x)), None
    if kind == 4 and n:
        new = b.is_new.copy()
        new[i_r] = ~new[i_r]
        return rep(b, is_new=new), None
    if kind == 5:
        return rep(b, free_slots=np.append(b.free_slots, x)), None
    if kind == 6 and b.write_ids.size:
        j = i % b.write_ids.size
        y = [0, -3, 2 ** 31 // 16, int(b.write_ids[(j + 1) % b.write_ids.size]), 100][v % 5]
        return rep(b, write_ids=set_entry(b.write_ids, j, y)), None
    if kind == 7 and N:
        return rep(b, write_starts=set_entry(b.write_starts, i_w, [-2, -1, 0, 1, 5, 100][v % 6])), None
    if kind == 8 and N:
        field = "write_gids" if v % 2 else "write_slots"
        return rep(b, **{field: set_entry(getattr(b, field), i_w, x)}), None
    if kind == 9 and N:
        return rep(b, write_cu=set_entry(b.write_cu, 1 + i_w, b.write_cu[1 + i_w] + (1 if v % 2 else -1))), None
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


def set_entry(a: np.ndarray, i: int, x: int) -> np.ndarray:
    """An int64 copy of ``a`` with entry ``i`` set to ``x`` (0 where ``x`` does not fit int64)."""
    out = a.astype(np.int64).copy()
    out[i] = np.int64(x) if -(2 ** 63) <= x < 2 ** 63 else 0
    return out


def feed(p, b, pad):
    """``p.update(b, pad_to=pad)``: the message of its ``ValueError``, or ``None`` (the staging then applied)."""
    try:
        p.update(b, pad_to=pad)
    except ValueError as e:
        return str(e)
    p.staging.applied()
    return None


MUTATION = st.tuples(st.sampled_from(range(14)), st.sampled_from(range(64)), st.sampled_from(range(64)))


# ----------------------------------------------------------------------------------------------
# hand-written steps on the two-layer layout
# ----------------------------------------------------------------------------------------------
BS = (32, 8, 4, 8)  # block size per gid


def repro_pipe(checks="safe", max_model_len=256, **kw):
    """A reference pipeline on :func:`~helpers.layouts.two_layer_layout`: 4 slots, 64 tokens, 2 draft tokens."""
    return MetadataPipeline(two_layer_layout(max_model_len), 4, 64, "cpu", 2, backend="reference", checks=checks, **kw)


def block_ids(base, upto):
    """Block lists of a request holding positions [0, upto): ids ``base + 100 * gid + j``."""
    return tuple([base + 100 * g + j for j in range(-(-upto // bs))] for g, bs in enumerate(BS))


def batch(rows, runs=(), free=(), replay_end=None, replay_start=None):
    """``rows``: (slot, nc, q, new); ``runs``: (gid, slot, start, ids)."""
    cu = np.cumsum([0] + [len(r[3]) for r in runs])
    a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return StepBatch(req_slots=a([r[0] for r in rows]), num_computed_tokens=a([r[1] for r in rows]),
                     num_scheduled_tokens=a([r[2] for r in rows]), is_new=np.asarray([r[3] for r in rows], bool),
                     free_slots=a(free), write_gids=a([r[0] for r in runs]), write_slots=a([r[1] for r in runs]),
                     write_starts=a([r[2] for r in runs]), write_cu=a(cu),
                     write_ids=a([i for r in runs for i in r[3]]),
                     replay_start=None if replay_start is None else a(replay_start),
                     replay_end=None if replay_end is None else a(replay_end))


def admit(slot, base, nc, q):
    """The runs of a new row at ``slot`` holding ``nc + q`` tokens (ids from :func:`block_ids`)."""
    return [(g, slot, 0, ids) for g, ids in enumerate(block_ids(base, nc + q))]


def owners_of(pipe):
    """A copy of the pipeline's ownership records (``BlockOwners.snapshot``: fills, floors, ring marks, frontiers)."""
    return pipe.requests.owners.snapshot()


def same_owners(a: dict, b: dict) -> bool:
    """Two :func:`owners_of` snapshots are equal."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
                                        for k in a)


def reject(pipe, step, pattern):
    """``step`` is refused with one line matching ``pattern``; the pipeline and its ownership records unchanged."""
    before, own = state(pipe), owners_of(pipe)
    with pytest.raises(ValueError) as e:
        pipe.update(step)
    msg = str(e.value)
    assert re.search(pattern, msg), msg
    assert "\n" not in msg, msg
    assert not diff(before, state(pipe)), "the rejected step changed the pipeline"
    after = owners_of(pipe)
    assert same_owners(own, after)
    return msg
