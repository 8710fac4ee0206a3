"""Step streams of a serving engine as :class:`~dsv4_index.batch.StepBatch` arrays (issue 26): a
realistic serving mix and a churn stream, in vLLM V1 semantics.

* ``serving mix``: ``B`` running requests, MTP with ``k = 1`` draft accepted with probability 0.7 (a row
  schedules 2 tokens and computes 1 + accepted of them), geometric outputs (mean 600 tokens), each
  finished request reported in the next step where a new one arrives with its prompt (log-uniform
  256-4096 tokens) prefilled in that step; the running order is kept and new requests are appended;
  pure-decode steps are padded to a CUDA-graph size. About 0.74 finishes and arrivals per step.
* ``churn``: ``B`` decodes with MTP ``k = 1``, every step one random request finishes and a short one
  (16-64 cached tokens, a decode-sized first step) joins; half the drafts are rejected; a row needing
  rows hold their blocks ``AHEAD`` tokens ahead and a rotating tenth of them appends one block per step
  (the "10 % of rows crossing a block" of the churn target, BENCHMARKS.md).

A group gets a block id exactly when ``nc + q`` needs one (the row keeps blocks that rejected drafts
needed). Ids come from one pool shared by the groups, as in vLLM's block pool: a finished request's ids
return to the pool's tail when its finish is reported (the step where new requests may take them), and
allocation takes from the head, so a bounded set of ids is reused; the pool grows from a counter only when
it runs short. A joining row's cached blocks (below its first scheduled token) are prefix hits: ids from the
counter, never a recycled block (which would hold another request's KV at another position).
"""

from __future__ import annotations

from typing import List

import numpy as np

from dsv4_index.batch import APPEND, StepBatch

AHEAD = 2048    # NOTE: churn: rows hold blocks for this many tokens ahead (no natural crossing) ...
AHEAD_JOIN = 512  # ... joining rows for this many (more than 300 steps of decode)
CROSS_GID = 2   # ... and a rotating tenth appends one block of this group (c4_state) per step
GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512]


class Stream:
    """Running requests, their slots, counts and held blocks; ``next_step()`` -> StepBatch."""

    def __init__(self, layout, B: int, seed: int, churn: bool, num_slots: int = 1024):
        self.rng = np.random.default_rng(seed)
        self.bs = np.asarray([g.alloc_block_size for g in layout.groups], dtype=np.int64)
        self.G, self.B, self.churn = len(layout.groups), B, churn
        self.next_id = 1
        self.pool = np.zeros(0, dtype=np.int64)  # NOTE: freed ids, oldest first
        self.pending_ids: List[np.ndarray] = []  # NOTE: ids of the finished requests not reported yet
        self.free = list(range(num_slots))[::-1]
        self.run: List[dict] = []
        self.pending_free: List[int] = []
        self.first = True
        self.stats = dict(steps=0, finishes=0, arrivals=0, runs=0, crossing=0, rejected=0, drafts=0)

    def _ids(self, n: int) -> np.ndarray:
        k = min(n, self.pool.shape[0])
        out, self.pool = self.pool[:k], self.pool[k:]
        if k < n:
            out = np.concatenate([out, np.arange(self.next_id, self.next_id + n - k, dtype=np.int64)])
            self.next_id += n - k
        return out

    def _fresh(self, n: int) -> np.ndarray:
        """``n`` ids never handed out: a new row's cached blocks (its prefix hits hold what was written at their
        own block positions, never a recycled block: docs/DESIGN.md §5)."""
        out = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        self.next_id += n
        return out

    def _request(self, nc: int, q: int, out_len: int) -> dict:
        return dict(slot=self.free.pop(), nc=nc, q=q, held=np.zeros(self.G, dtype=np.int64), new=True,
                    left=out_len, ids=[])

    def _arrival(self) -> dict:
        if self.churn:
            return self._request(int(self.rng.integers(16, 65)), 2, 10 ** 9)
        prompt = int(np.exp(self.rng.uniform(np.log(256), np.log(4096))))
        return self._request(0, prompt, int(self.rng.geometric(1 / 600)))

    def next_step(self):
        st = self.stats
        if self.first:
            for _ in range(self.B):
                r = self._request(int(self.rng.integers(1024, 16385)), 2, int(self.rng.geometric(1 / 600)))
                self.run.append(r)
        free, self.pending_free = self.pending_free, []
        freed, self.pending_ids = self.pending_ids, []
        if not self.first:
            if self.churn:
                r = self.run.pop(int(self.rng.integers(len(self.run))))
                free.append(r["slot"])
                freed += r["ids"]
            st["finishes"] += len(free)
            if freed:  # NOTE: reported finished: their blocks go back to the pool before this step allocates
                self.pool = np.concatenate([self.pool, *freed])
            self.free += free[::-1]  # NOTE: a freed slot is taken again first (free + new in one step)
            while len(self.run) < self.B:
                self.run.append(self._arrival())
                st["arrivals"] += 1
        g_, s_, st_, cu, ids = [], [], [], [0], []
        for r in self.run:
            ahead = (AHEAD if self.first else AHEAD_JOIN) if self.churn and r["new"] else 0
            need = -(-(r["nc"] + r["q"] + ahead) // self.bs)
            add = np.maximum(need - r["held"], 0)
            if self.churn and not r["new"] and (r["slot"] + st["steps"]) % 10 == 0:
                add[CROSS_GID] += 1  # NOTE: a rotating tenth of the rows crosses into a new block
            for g, n in enumerate(add.tolist()):
                if n or r["new"]:
                    g_.append(g), s_.append(r["slot"]), st_.append(0 if r["new"] else APPEND)
                    hit = min(r["nc"] // int(self.bs[g]), n) if r["new"] else 0
                    ids.append(np.concatenate([self._fresh(hit), self._ids(n - hit)]))
                    r["ids"].append(ids[-1])
                    cu.append(cu[-1] + n)
                    st["crossing"] += not r["new"]
            r["held"] = r["held"] + add
        st["runs"] += len(g_)
        batch = StepBatch(
            req_slots=np.asarray([r["slot"] for r in self.run], dtype=np.int64),
            num_computed_tokens=np.asarray([r["nc"] for r in self.run], dtype=np.int64),
            num_scheduled_tokens=np.asarray([r["q"] for r in self.run], dtype=np.int64),
            is_new=np.asarray([r["new"] for r in self.run], dtype=bool), free_slots=np.asarray(free, dtype=np.int64),
            write_gids=np.asarray(g_, dtype=np.int64), write_slots=np.asarray(s_, dtype=np.int64),
            write_starts=np.asarray(st_, dtype=np.int64), write_cu=np.asarray(cu, dtype=np.int64),
            write_ids=np.concatenate(ids) if ids else np.zeros(0, np.int64))
        T = int(batch.num_scheduled_tokens.sum())
        decode = all(r["q"] <= 2 for r in self.run)
        pad = next((s for s in GRAPH_SIZES if s >= T), None) if decode else None
        self._advance()
        self.first = False
        st["steps"] += 1
        return batch, pad

    def _advance(self) -> None:
        keep = []
        for r in self.run:
            if r["q"] > 2:       # NOTE: a prefill: its prompt is computed, it decodes next step
                r["nc"] += r["q"]
                acc = 1
            else:
                p = 0.5 if self.churn else 0.7
                ok = int(self.rng.random() < p)
                self.stats["drafts"] += 1
                self.stats["rejected"] += 1 - ok
                acc = 1 + ok
                r["nc"] += acc
            r["q"], r["new"] = 2, False
            r["left"] -= acc
            if r["left"] <= 0 and not self.churn:
                self.pending_free.append(r["slot"])
                self.pending_ids += r["ids"]
            else:
                keep.append(r)
        self.run = keep
