"""Request state by slot: which slots hold a request, and the batch-ordered cache of the last
accepted step that lets a steady step (same rows, same counts, one-id appends) be checked in a few
array comparisons (:mod:`dsv4_index.state.steady`).

The request id -> slot map of the id-keyed front ends is :class:`dsv4_index.batch.SlotMap`; block
counts per (group, slot) live in :class:`~dsv4_index.state.tables.BlockTables`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .owners import BlockOwners
from .plan import StepPlan, plan_step
from .steady import SteadyCache, SteadyGeometry, plan_steady

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
    steady : bool — recognise steady steps (False: every step takes the general checks).

    Attributes
    ----------
    occupied : bool ``[max_num_reqs]`` — slots holding a request.
    cache : SteadyCache or None — the batch of the last accepted step, when a steady step may follow.
    """

    def __init__(self, max_num_reqs: int, tables, *, cp, max_num_tokens: int, max_writes: int,
                 decode_threshold: int, level: str, steady: bool = True):
        self.max_num_reqs = max_num_reqs
        self.occupied = np.zeros(max_num_reqs, dtype=bool)
        self._tables = tables
        self._kw = dict(cp=cp, max_num_tokens=max_num_tokens, max_writes=max_writes,
                        decode_threshold=decode_threshold, level=level)
        self.level = level
        # NOTE: the steady proof assumes replicated groups, plain blocks and a window on every ring group
        self.use_steady = (bool(steady) and not (cp[0] > 1 and tables.sharded.any()) and tables.fmax == 1
                           and bool((tables.window[tables.ring_groups] >= 1).all()))
        self.cache: Optional[SteadyCache] = None
        self._geometry = SteadyGeometry(tables) if self.use_steady else None
        self._generation = 0
        self.owners = BlockOwners(tables, cp=cp, level=level, num_speculative_tokens=decode_threshold - 1)

    def plan(self, batch, pad_to: Optional[int]) -> StepPlan:
        """Check ``batch`` against this state and the tables; the plan, or ``ValueError`` (nothing
        changes either way)."""
        plan = None
        if self.cache is not None:
            plan = plan_steady(batch, self.cache, self._tables, pad_to, self._kw["max_num_tokens"],
                               self._kw["max_writes"], self.level)
        if plan is None:
            plan = plan_step(batch, occupied=self.occupied, tables=self._tables, pad_to=pad_to, **self._kw)
        self.owners.check(plan)  # NOTE: block ownership, rings, no jump (state/owners.py)
        return plan

    def commit(self, plan: StepPlan) -> None:
        """Apply an accepted plan (after :meth:`BlockTables.commit`: the cache reads block counts)."""
        self.owners.commit(plan)  # NOTE: applies what owners.check(plan) computed
        if plan.steady:
            if not self.cache.advance(plan, self._tables):
                self.cache = None
            return
        occ = self.occupied
        if plan.free_slots.size:
            occ[plan.free_slots] = False
        if plan.new_slots.size:
            occ[plan.new_slots] = True
        self._generation += 1
        self.cache = (SteadyCache.build(plan, self._geometry, self._generation, prev=self.cache)
                      if self.use_steady else None)

    @property
    def signature(self) -> Optional[int]:
        """Equal between two steps of one steady batch (same rows, counts, order): the staging
        buffer then keeps their ``qsl`` / ``slots`` / ``tok_row``."""
        return None if self.cache is None else self.cache.generation
