"""Request state by slot: which slots hold a request, and the batch-ordered state of the last
accepted step that lets any following step be checked incrementally, at the cost of what changed
(:mod:`dsv4_index.state.steady`).

The request id -> slot map of the id-keyed front ends is :class:`dsv4_index.batch.SlotMap`; block
counts per (group, slot) live in :class:`~dsv4_index.state.tables.BlockTables`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .plan import StepPlan, plan_step, plans_equal
from .steady import BatchCache, FastGeometry, plan_fast

__all__ = ["RequestState"]


class RequestState:
    """Occupancy of ``max_num_reqs`` request slots, and the planner of a step.

    Parameters
    ----------
    max_num_reqs : int
    tables : BlockTables — read by the checks, never written here.
    cp : (world, rank, interleave) of the sharded groups.
    max_num_tokens, max_writes : capacities (tokens per step, staged ids per step).
    decode_threshold : a row with ``1 <= q <= decode_threshold`` tokens is a decode.
    level : ``"safe"`` or ``"full"`` (``state/plan.py``).
    steady : bool — plan on the incremental path (False: every step takes the general checks).
    cross_check : bool — run both planners on every step and raise ``AssertionError`` when the
        incremental plan differs from the general one (``validate=True``; debug).

    Attributes
    ----------
    occupied : bool ``[max_num_reqs]`` — slots holding a request.
    cache : BatchCache or None — the batch of the last accepted step (None: none, or no fast path).
    """

    def __init__(self, max_num_reqs: int, tables, *, cp, max_num_tokens: int, max_writes: int,
                 decode_threshold: int, level: str, steady: bool = True, cross_check: bool = False):
        self.max_num_reqs = max_num_reqs
        self.occupied = np.zeros(max_num_reqs, dtype=bool)
        self._tables = tables
        self._kw = dict(cp=cp, max_num_tokens=max_num_tokens, max_writes=max_writes,
                        decode_threshold=decode_threshold, level=level)
        self.level = level
        self.cross_check = bool(cross_check)
        # NOTE: the incremental proof assumes replicated groups, plain blocks and a window on every ring group
        self.use_steady = (bool(steady) and not (cp[0] > 1 and tables.sharded.any()) and tables.fmax == 1
                           and bool((tables.window[tables.ring_groups] >= 1).all()))
        self.cache: Optional[BatchCache] = None
        self._geometry = FastGeometry(tables) if self.use_steady else None
        self._generation = 0

    def plan(self, batch, pad_to: Optional[int]) -> StepPlan:
        """Check ``batch`` against this state and the tables; the plan, or ``ValueError`` (nothing
        changes either way)."""
        if self.cache is not None:
            kw = self._kw
            plan = plan_fast(batch, self.cache, self._tables, self.occupied, pad_to, kw["max_num_tokens"],
                             kw["max_writes"], kw["decode_threshold"], self.level)
            if plan is not None:
                if self.cross_check:
                    ref = plan_step(batch, occupied=self.occupied, tables=self._tables, pad_to=pad_to, **kw)
                    diff = plans_equal(plan, ref)
                    if diff:
                        raise AssertionError(f"the incremental plan differs from the general one in {diff}")
                return plan
        return plan_step(batch, occupied=self.occupied, tables=self._tables, pad_to=pad_to, **self._kw)

    def commit(self, plan: StepPlan) -> None:
        """Apply an accepted plan (after :meth:`BlockTables.commit`: the cache reads block counts)."""
        occ = self.occupied
        if plan.free_slots.size:
            occ[plan.free_slots] = False
        if plan.new_slots.size:
            occ[plan.new_slots] = True
        c = self.cache
        if plan.steady and c is not None and c.scratch.plan is plan:
            c.advance(plan)
            return
        self._generation = (self._generation if c is None else c.generation) + 1
        self.cache = (BatchCache.from_plan(plan, self._geometry, self._tables, c, self._generation)
                      if self.use_steady else None)

    @property
    def signature(self) -> Optional[int]:
        """Equal between two steps of one batch (same rows, counts, order): the staging buffer then
        keeps their ``qsl`` / ``slots`` / ``tok_row``."""
        return None if self.cache is None else self.cache.generation
