"""Benchmark workloads: steps built directly as arrays (no scheduler), with random contexts and block
ids from per-group counters, for the cases of docs/DESIGN.md §8 / issue 12. Shared by ``bench_step.py`` and
``host_profile.py``.

Every case admits its batch in a first step, then produces steady-state steps (block ids from one counter
per group: no block is held by two requests); each step is
available as a :class:`~dsv4_index.batch.StepBatch` (the fast path, slots owned here) and as the
equivalent :class:`~dsv4_index.frontend.StepInput` (to time the id-keyed front door).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from dsv4_index.batch import APPEND, StepBatch
from dsv4_index import NewRequest, RunningRequest, StepInput

ID_LO = 1          # NOTE: block ids: one counter per group (no id held by two requests: the ownership checks
ID_GAP = 16        # reject a write into another live request's block), a random gap of up to ID_GAP - 1 ids
                   # before each admitted list (ids are not one dense range)


@dataclass(frozen=True)
class Case:
    name: str
    decodes: int = 0
    q_decode: int = 1
    prefill: int = 0
    prefix: int = 0
    ctx_range: tuple = (1024, 65536)

    @property
    def max_tokens(self) -> int:
        return self.decodes * self.q_decode + self.prefill

    @property
    def max_reqs(self) -> int:
        return self.decodes + (1 if self.prefill else 0)


CASES = {
    "decode B=1": Case("decode B=1", decodes=1),
    "decode B=256": Case("decode B=256", decodes=256),
    "decode B=1024": Case("decode B=1024", decodes=1024),
    "MTP 256x2": Case("MTP 256x2", decodes=256, q_decode=2),
    "prefill 8K": Case("prefill 8K", prefill=8192),
    "prefill 8K + 32K cached": Case("prefill 8K + 32K cached", prefill=8192, prefix=32768),
    "mixed 256 + 4K": Case("mixed 256 + 4K", decodes=256, prefill=4096),
}


class Workload:
    """Steps of one case for a layout. ``next_step()`` -> (StepBatch, StepInput) of the same step."""

    def __init__(self, layout, case: Case, seed: int = 0):
        self.layout, self.case = layout, case
        self.rng = np.random.default_rng(seed)
        self.G = len(layout.groups)
        self.alloc = np.asarray([g.alloc_block_size for g in layout.groups], dtype=np.int64)
        self.next_id = np.full(self.G, ID_LO, dtype=np.int64)  # NOTE: per group, the next free block id
        self.slots: Dict[str, int] = {}
        self.computed: Dict[str, int] = {}
        self.blocks: Dict[str, np.ndarray] = {}   # alloc blocks held per group
        self.free = list(range(case.max_reqs + 1))[::-1]
        self.decode_ids: List[str] = []
        self.prefill_id: Optional[str] = None
        self.n = 0
        self.first = True

    def _need(self, seq_len: int) -> np.ndarray:
        return -(-seq_len // self.alloc)

    def _new(self, ctx: int, q: int):
        rid = f"r{self.n}"
        self.n += 1
        need = self._need(ctx + q)
        lists = tuple(self._take(g, n, gap=int(self.rng.integers(0, ID_GAP))) for g, n in enumerate(need.tolist()))
        self.slots[rid] = self.free.pop()
        self.computed[rid] = ctx
        self.blocks[rid] = need
        return rid, lists

    def _append(self, rid: str, q: int):
        need = self._need(self.computed[rid] + q)
        k = np.maximum(need - self.blocks[rid], 0)
        lists = [self._take(g, n) for g, n in enumerate(k.tolist())]
        self.blocks[rid] = np.maximum(need, self.blocks[rid])
        return lists

    def _take(self, g: int, n: int, gap: int = 0) -> np.ndarray:
        """``n`` new block ids of group ``g`` (consecutive, after ``gap`` unused ones)."""
        first = int(self.next_id[g]) + gap
        self.next_id[g] = first + n
        return np.arange(first, first + n, dtype=np.int64)

    def next_step(self):
        c = self.case
        rows = []      # (rid, nc, q, is_new, lists, start)
        free, finished = [], []
        if self.first:
            lo, hi = c.ctx_range
            for ctx in self.rng.integers(lo, hi + 1, size=c.decodes).tolist():
                rid, lists = self._new(ctx, c.q_decode)
                self.decode_ids.append(rid)
                rows.append((rid, ctx, c.q_decode, True, lists, 0))
        else:
            for rid in self.decode_ids:
                rows.append((rid, self.computed[rid], c.q_decode, False, self._append(rid, c.q_decode), APPEND))
        if c.prefill:
            if self.prefill_id is not None:
                finished.append(self.prefill_id)
                free.append(self.slots.pop(self.prefill_id))
                self.free.append(free[-1])
            rid, lists = self._new(c.prefix, c.prefill)
            self.prefill_id = rid
            rows.append((rid, c.prefix, c.prefill, True, lists, 0))
        self.first = False
        batch = self._batch(rows, free)
        step = self._step_input(rows, finished)
        for rid, nc, q, *_ in rows:
            self.computed[rid] = nc + q if rid != self.prefill_id else nc
        return batch, step

    def _batch(self, rows, free) -> StepBatch:
        g_, s_, st_, cu, ids = [], [], [], [0], []
        for rid, _, _, _, lists, start in rows:
            for g, x in enumerate(lists):
                if len(x) or start == 0:
                    g_.append(g)
                    s_.append(self.slots[rid])
                    st_.append(start)
                    ids.append(x)
                    cu.append(cu[-1] + len(x))
        return StepBatch(
            req_slots=np.asarray([self.slots[r[0]] for r in rows], dtype=np.int64),
            num_computed_tokens=np.asarray([r[1] for r in rows], dtype=np.int64),
            num_scheduled_tokens=np.asarray([r[2] for r in rows], dtype=np.int64),
            is_new=np.asarray([r[3] for r in rows], dtype=bool), free_slots=np.asarray(free, dtype=np.int64),
            write_gids=np.asarray(g_, dtype=np.int64), write_slots=np.asarray(s_, dtype=np.int64),
            write_starts=np.asarray(st_, dtype=np.int64), write_cu=np.asarray(cu, dtype=np.int64),
            write_ids=np.concatenate(ids) if ids else np.zeros(0, np.int64))

    def _step_input(self, rows, finished) -> StepInput:
        new, running, nst = [], [], {}
        for rid, nc, q, is_new, lists, _ in rows:
            lists = tuple(x.tolist() for x in lists)
            if is_new:
                new.append(NewRequest(rid, lists, nc))
            else:
                running.append(RunningRequest(rid, lists, nc))
            nst[rid] = q
        return StepInput(new_requests=new, running_requests=running, num_scheduled_tokens=nst,
                         finished_req_ids=list(finished))
