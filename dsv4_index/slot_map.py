"""Request id -> slot for the id-keyed front ends (:mod:`dsv4_index.frontend`): the map, the delta a
converted step carries (committed only once the pipeline accepted the step), and the free-slot rules.

NOTE: the map also keeps the rows and slots of the last committed batch, so that a steady step (the
same request order) is converted without a lookup per request (:mod:`dsv4_index.steady_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Dict, List, Optional, Sequence, Set

import numpy as np

__all__ = ["SlotMap", "SlotMapDelta"]


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_EMPTY = _frozen(np.zeros(0, dtype=np.int64))


@dataclass
class SlotMapDelta:
    """What a converted step changes in the :class:`SlotMap` (applied by :meth:`SlotMap.commit`)."""

    freed: List[str] = field(default_factory=list)          # ids releasing their slot
    preempted: List[str] = field(default_factory=list)      # ids remembered as preempted
    forgotten: List[str] = field(default_factory=list)      # finished ids dropped from `preempted`
    taken: Dict[str, int] = field(default_factory=dict)     # id -> slot it takes
    order: List[str] = field(default_factory=list)          # ids of the batch rows
    new: List[str] = field(default_factory=list)            # ids sent as new requests (for error messages)
    slots: Optional[np.ndarray] = field(default=None, compare=False, repr=False)  # their slots


class SlotMap:
    """Request id -> slot, for the id-keyed front ends. Free slots are taken lowest first.

    Change it only through :meth:`commit` (it keeps the last batch's rows and slots to convert the
    next steady step without a lookup per request).

    Parameters
    ----------
    max_num_reqs : int
        Number of slots.
    """

    def __init__(self, max_num_reqs: int):
        self.max_num_reqs = max_num_reqs
        self.slot_of: Dict[str, int] = {}
        self.preempted: Set[str] = set()
        self._free = list(range(max_num_reqs - 1, -1, -1))  # NOTE: a stack; pop() gives the lowest
        self._order: List[str] = []    # NOTE: rows of the last committed batch and their slots (frozen)
        self._order_slots = _EMPTY

    def commit(self, d: SlotMapDelta) -> None:
        for rid in d.freed:
            self._free.append(self.slot_of.pop(rid))
        if d.freed:
            self._free.sort(reverse=True)
        self.preempted.difference_update(d.forgotten)
        self.preempted.update(d.preempted)
        taken = set(d.taken.values())
        if taken:
            self._free = [s for s in self._free if s not in taken]
        for rid, slot in d.taken.items():
            self.slot_of[rid] = slot
            self.preempted.discard(rid)
        if d.slots is not None and len(d.slots) == len(d.order):
            slots = d.slots if not d.slots.flags.writeable else _frozen(d.slots.copy())
            self._order, self._order_slots = list(d.order), slots
        else:
            self._order, self._order_slots = [], _EMPTY


def lowest_free(sm: SlotMap, freed_slots: List[int], k: int) -> List[int]:
    """The ``k`` lowest free slots after ``freed_slots`` are released, in descending order (a stack).

    NOTE: ``sm._free`` is kept sorted descending, so its lowest ``k`` are its last ``k``.
    """
    if not freed_slots:
        return sm._free[-k:] if k else []
    return sorted(sm._free[-k:] + freed_slots)[:k][::-1] if k else []


def gone(sm: SlotMap, finished: Sequence[str], preempted: Sequence[str], d: SlotMapDelta) -> Set[str]:
    """Fill the delta's freed / preempted / forgotten ids; return the finished or preempted ids."""
    out = set()
    for rid in chain(finished, preempted):
        if rid not in out:
            out.add(rid)
            if rid in sm.slot_of:
                d.freed.append(rid)
    d.preempted = [r for r in preempted if r in sm.slot_of or r in sm.preempted]
    d.forgotten = [r for r in finished if r in sm.preempted]
    return out
