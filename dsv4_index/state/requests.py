"""Request state by slot: which slots hold a request, and the transaction of a step — the checks
(:mod:`dsv4_index.state.checks`, then the ownership checks of :mod:`dsv4_index.state.owners`) write
scratch only; :meth:`RequestState.commit` applies an accepted plan.

Request identity (:class:`SlotMap`): the request id -> slot map of the id-keyed front ends
(:mod:`dsv4_index.frontend`), its free slots, the ids of the last accepted batch in row order with
their slots (so a step that repeats that order needs no lookup per request: ids are strings, the one
cache of the last batch), and the delta a converted step carries (:class:`SlotMapDelta`, committed only
once the pipeline accepted the step). Block counts per (group, slot) live in
:class:`~dsv4_index.state.tables.BlockTables`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from ..batch import StepBatch
from .checks import StepChecks
from .checks.naive import plan_step
from .owners import BlockOwners, drafts_of
from .plan import StepPlan, plans_equal
from .tables import BlockTables

__all__ = ["RequestState", "SlotMap", "SlotMapDelta", "RowIds", "frozen", "EMPTY"]


class RequestState:
    """Occupancy of ``max_num_reqs`` request slots, and the planner of a step.

    Parameters
    ----------
    max_num_reqs : int
    tables : BlockTables — read by the checks, never written here.
    cp : (world, rank, interleave) of the sharded groups.
    max_num_tokens, max_writes : capacities (tokens per step, staged ids per step).
    next_n : query tokens of a decode row (``1 + num_speculative_tokens``): a row with
        ``1 <= q <= next_n`` tokens is a decode.
    level : ``"safe"`` or ``"full"`` (docs/DESIGN.md §5).
    cross_check : bool — also plan every step by the checks' definition (:func:`.checks.naive.plan_step`)
        and raise ``AssertionError`` when the compiled pass differs (``validate=True``; debug).

    Attributes
    ----------
    occupied : bool ``[max_num_reqs]`` — slots holding a request.
    checks : StepChecks — the compiled check pass.
    owners : BlockOwners — block ownership (``owners.check(plan)`` after the checks, ``owners.commit``).
    """

    def __init__(self, max_num_reqs: int, tables: BlockTables, *, cp: Tuple[int, int, int], max_num_tokens: int,
                 max_writes: int, next_n: int, level: str, cross_check: bool = False):
        self.max_num_reqs = max_num_reqs
        self.occupied = np.zeros(max_num_reqs, dtype=bool)
        self._tables = tables
        self._kw: Dict[str, Any] = dict(cp=cp, max_num_tokens=max_num_tokens, max_writes=max_writes, next_n=next_n,
                                        level=level)
        self.level = level
        self.cross_check = bool(cross_check)
        self.checks = StepChecks(tables, **self._kw)
        self.owners = BlockOwners(tables, cp=cp, level=level, num_speculative_tokens=next_n - 1)

    def plan(self, batch: StepBatch, pad_to: Optional[int]) -> StepPlan:
        """Check ``batch`` against this state and the tables; the plan, or ``ValueError`` (nothing
        changes either way)."""
        if not self.cross_check:
            plan = self.checks.plan(batch, self.occupied, pad_to)
        else:
            got, ref = (_outcome(fn, batch, pad_to) for fn in (
                lambda b, p: self.checks.plan(b, self.occupied, p),
                lambda b, p: plan_step(b, occupied=self.occupied, tables=self._tables, pad_to=p, **self._kw)))
            _same(got, ref)
            if isinstance(got, ValueError):
                raise got
            plan = got
        plan.drafts = drafts_of(batch, plan)  # NOTE: StepBatch.drafts in device order, checked (state/owners)
        self.owners.check(plan)  # NOTE: block ownership, rings, no jump (state/owners/)
        return plan

    def commit(self, plan: StepPlan) -> None:
        """Apply an accepted plan (after :meth:`BlockTables.commit`)."""
        self.owners.commit(plan)  # NOTE: applies what owners.check(plan) computed
        occ = self.occupied
        if plan.free_slots.size:
            occ[plan.free_slots] = False
        if plan.new_slots.size:
            occ[plan.new_slots] = True


def _outcome(fn, batch, pad_to):
    try:
        return fn(batch, pad_to)
    except ValueError as e:
        return e


def _same(got, ref) -> None:
    """The compiled pass's verdict (a plan or a rejection) equals the definition's."""
    if isinstance(got, ValueError) or isinstance(ref, ValueError):
        if not (type(got) is type(ref) and str(got) == str(ref)):
            raise AssertionError(f"the compiled check pass says {got!r}, its definition {ref!r}")
        return
    diff = plans_equal(got, ref)
    if diff:
        raise AssertionError(f"the compiled check pass differs from its definition in {diff}")


# ----------------------------------------------------------------------------------------------
# request identity: request id -> slot
# ----------------------------------------------------------------------------------------------
def frozen(a: np.ndarray) -> np.ndarray:
    """``a``, made read-only (shared between steps without a copy)."""
    a.flags.writeable = False
    return a


EMPTY = frozen(np.zeros(0, dtype=np.int64))  # NOTE: int64 [0], read-only


@dataclass
class SlotMapDelta:
    """What a converted step changes in the :class:`SlotMap` (applied by :meth:`SlotMap.commit`)."""

    freed: List[str] = field(default_factory=list)          # ids releasing their slot
    preempted: List[str] = field(default_factory=list)      # ids remembered as preempted
    forgotten: List[str] = field(default_factory=list)      # finished ids dropped from `preempted`
    taken: Dict[str, int] = field(default_factory=dict)     # id -> slot it takes
    order: List[str] = field(default_factory=list)          # ids of the batch rows
    new: List[str] = field(default_factory=list)            # ids sent as new requests (for error messages)
    slots: Optional[np.ndarray] = field(default=None, compare=False, repr=False)  # int64 [rows]: their slots
    replay: Dict[str, int] = field(default_factory=dict)   # id -> replay_start to remember (vLLM sends it once)
    replay_done: List[str] = field(default_factory=list)   # ids whose remembered replay_start no longer matters


class RowIds(Sequence):
    """The request id of each device batch row (``order[rows[i]]``), built on first read.

    ``order``: the ids of the batch rows (a list nobody mutates); ``rows``: int ``[B]``, the batch
    row of each device row. Compares equal to a list of the same ids.
    """

    def __init__(self, order: List[str], rows: np.ndarray):
        self._src = (order, rows if not rows.flags.writeable else rows.copy())
        self._ids: Optional[List[str]] = None

    def _list(self) -> List[str]:
        if self._ids is None:
            order, rows = self._src
            self._ids = list(map(order.__getitem__, rows.tolist()))
        return self._ids

    def __len__(self) -> int:
        return len(self._src[1])

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __contains__(self, rid) -> bool:
        return rid in self._list()

    def __eq__(self, other) -> bool:
        if isinstance(other, (RowIds, list, tuple)):
            return self._list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # NOTE: compares like a list, so unhashable like one

    def __repr__(self) -> str:
        return repr(self._list())


class SlotMap:
    """Request id -> slot, for the id-keyed front ends. Free slots are taken lowest first.

    Change it only through :meth:`commit`. It keeps the ids of the last committed batch in row order
    with their slots, so that a step listing the same rows (less finished or preempted ones) is
    converted without a lookup per request (:meth:`held_slots`).

    Parameters
    ----------
    max_num_reqs : int
        Number of slots.
    replay_reach : int
        How far past a request's ``replay_start`` its windows reach down to it: the layout's largest window
        minus 1 (0: no windowed group).
    replay_window : int
        ``W`` of the scheduler's bounded replay: the window of the layout's ``swa`` groups (vLLM's
        ``Scheduler.prefix_replay_tokens``; 0: none). The ``replay_end`` of a scheduler-sent ``replay_start``
        is ``replay_start + replay_window`` unless the caller gives one
        (:func:`~dsv4_index.frontend.batch_from_scheduler_output`). A remembered ``replay_start`` applies to
        the request's steps with ``num_computed_tokens < replay_start + max(replay_reach, replay_window)``.

    Attributes
    ----------
    slot_of : dict[str, int] — the slot each request in the batch holds (read only).
    preempted : set[str] — preempted requests that may come back as resumed (read only).
    replay : dict[str, int] — the ``replay_start`` a live request was admitted with (vLLM's V4.1
        ``NewRequestData.replay_start`` comes only in the admitting step; its later chunks need it too).
    """

    def __init__(self, max_num_reqs: int, replay_reach: int = 0, replay_window: int = 0):
        self.max_num_reqs = max_num_reqs
        self.replay_reach, self.replay_window = replay_reach, replay_window
        self.slot_of: Dict[str, int] = {}
        self.preempted: Set[str] = set()
        self.replay: Dict[str, int] = {}
        self._free = list(range(max_num_reqs))  # NOTE: ascending; updated by bisection, never rebuilt
        self._order: List[str] = []             # NOTE: rows of the last committed batch, and their slots
        self._order_slots: Optional[np.ndarray] = EMPTY

    @property
    def num_free(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    @property
    def free_slots(self) -> List[int]:
        """The slots no request holds, ascending (a copy)."""
        return list(self._free)

    @property
    def last_slots(self) -> Optional[np.ndarray]:
        """int64 ``[rows]``, read-only: the slots of the last committed batch's rows (None when unknown)."""
        return self._order_slots

    @property
    def last_order(self) -> List[str]:
        """The request ids of the last committed batch, in row order (a copy)."""
        return list(self._order)

    def row_ids(self, rows: np.ndarray) -> RowIds:
        """The ids of the last committed batch's rows ``rows`` (built when read)."""
        return RowIds(self._order, rows)

    def lowest_free(self, freed_slots: List[int], k: int) -> List[int]:
        """The ``k`` lowest free slots once ``freed_slots`` are released, ascending (fewer when there
        are not ``k``). Nothing changes."""
        if not k:
            return []
        if not freed_slots:
            return self._free[:k]
        return sorted(self._free[:k] + freed_slots)[:k]

    def gone(self, finished: Sequence, preempted: Sequence, d: SlotMapDelta) -> Set[str]:
        """Fill the delta's freed / preempted / forgotten ids; return the finished or preempted ids."""
        out: Set[str] = set()
        slot_of = self.slot_of
        for rid in chain(finished, preempted):
            if rid not in out:
                out.add(rid)
                if rid in slot_of:
                    d.freed.append(rid)
        d.preempted = [r for r in preempted if r in slot_of or r in self.preempted]
        d.forgotten = [r for r in finished if r in self.preempted] if self.preempted else []
        return out

    def held_slots(self, ids: list, freed: List[str]) -> Optional[np.ndarray]:
        """int64 ``[len(ids)]``: the slots of the running rows ``ids`` (read-only); None unless every
        one is held, distinct and not in ``freed``.

        NOTE: every id of the last committed batch holds the slot at its position in the cached
        slots, so ``ids`` equal to those rows, less the ``freed`` ones, needs no lookup.
        """
        order, cached = self._order, self._order_slots
        if cached is not None and len(freed) <= 8:
            pos = []
            for rid in freed:  # NOTE: only a held id can be a row of the last batch
                try:
                    pos.append(order.index(rid))
                except ValueError:
                    pass
            if not pos:
                if ids == order:
                    return cached
            elif len(order) - len(pos) == len(ids):
                pos.sort()
                kept = order[:pos[0]]
                for a, b in zip(pos, pos[1:] + [len(order)]):
                    kept += order[a + 1:b]
                if ids == kept:
                    return frozen(np.concatenate([cached[:pos[0]], cached[pos[0] + 1:]]) if len(pos) == 1
                                  else np.delete(cached, pos))
        sl = list(map(self.slot_of.get, ids))
        if None in sl or len(set(ids)) != len(ids) or (freed and not set(freed).isdisjoint(ids)):
            return None
        return frozen(np.array(sl, dtype=np.int64))

    def commit(self, d: SlotMapDelta) -> None:
        """Apply the delta of an accepted step: O(changes), plus one copy of the row ids."""
        free, slot_of = self._free, self.slot_of
        for rid in d.freed:
            insort(free, slot_of.pop(rid))
        if d.forgotten:
            self.preempted.difference_update(d.forgotten)
        if d.preempted:
            self.preempted.update(d.preempted)
        for rid, slot in d.taken.items():
            i = bisect_left(free, slot)
            if i < len(free) and free[i] == slot:
                del free[i]
            slot_of[rid] = slot
            self.preempted.discard(rid)
        if self.replay or d.replay:
            for rid in chain(d.freed, d.preempted, d.replay_done):
                self.replay.pop(rid, None)
            self.replay.update(d.replay)
        self._order = list(d.order)
        if d.slots is not None and len(d.slots) == len(d.order):
            self._order_slots = d.slots if not d.slots.flags.writeable else frozen(d.slots.copy())
        else:
            self._order_slots = None
