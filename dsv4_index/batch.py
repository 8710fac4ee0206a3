"""The array-form step (:class:`StepBatch`): the contract between the front door and the request state.

A serving engine keeps each request in a persistent *slot* (a row of every block table, like vLLM's
model runner v2 ``RequestState``) from arrival to finish; a step is then a handful of arrays::

    batch row i (the engine's order)   req_slots[i], num_computed_tokens[i], num_scheduled_tokens[i]
    block writes (one run per (group, slot))   write_gids[r], write_slots[r], write_starts[r],
                                               write_ids[write_cu[r]:write_cu[r + 1]]
    slots released before the step     free_slots

:meth:`MetadataPipeline.update` takes a ``StepBatch`` directly (the fast path). The front door,
:mod:`dsv4_index.frontend`, builds one from id-keyed inputs (a ``StepInput`` or a vLLM-style
``SchedulerOutput``) through the request-id -> slot map (:class:`~dsv4_index.state.requests.SlotMap`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["StepBatch", "APPEND"]

_OPTIONAL_IN_JSON = ("drafts", "query_lens")  # NOTE: fields added later: left out of a trace while None
APPEND = -1  # NOTE: a write run starting at APPEND continues the row where it ends (the slot's block count)


@dataclass
class StepBatch:
    """One scheduler step as arrays (all 1-D numpy integer arrays; int32 or int64).

    Attributes
    ----------
    req_slots : int [B]
        Request slot (block-table row, ``0 <= slot < max_num_reqs``) of each batch row, distinct.
        The pipeline orders the device batch decode-first itself (stable), so any order is accepted.
    num_computed_tokens : int [B]
        Tokens of the row's request whose KV is cached before this step; the step schedules
        positions ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``.
    num_scheduled_tokens : int [B]
        Tokens scheduled per row (speculative tokens included), ``>= 0``. Rows with 0 tokens update
        the request's state and blocks but are not part of the device batch.
    is_new : bool [B], optional
        The row's request starts in this step (new, or back after preemption): its slot must be
        free (after ``free_slots``) and its block lists start empty. Default: no new rows.
    free_slots : int [F], optional
        Slots released before this step (finished and preempted requests).
    write_gids, write_slots, write_starts : int [N], optional
        Block writes, one run per (group, slot): the run sets the slot's logical blocks
        ``[start, start + n)`` of group ``gid`` to its ids and cuts the row there. ``start`` is in
        allocation blocks (the scheduler's unit); ``APPEND`` (-1) continues the row. A run may not
        leave a hole (``start <= `` the row's current length).
    write_cu : int [N + 1], optional
        Offsets of each run's ids in ``write_ids`` (``write_cu[0] == 0``).
    write_ids : int [write_cu[-1]], optional
        Allocation block ids (expanded to kernel-block ids by the tables for hybrid blocks).
    replay_start, replay_end : int [B], optional
        Bounded replay (docs/DESIGN.md §4): window lists of a row start at ``replay_start`` at the earliest;
        tokens at ``pos < replay_end`` write nothing into prefix-cacheable groups.
    drafts : int [B], optional
        Draft (speculative) tokens among each row's scheduled tokens: ``0 <= d <= num_scheduled_tokens - 1``
        (the first scheduled token is never a draft), or -1 for the default rule: ``min(n - 1,
        num_speculative_tokens)`` for a row of at most ``1 + num_speculative_tokens`` tokens, 0 for a prefill
        chunk. The ownership rule releases a sliding block once the window of ``nc + n - d`` (the lowest next
        position) has passed it (docs/DESIGN.md §5). Default (None): the default rule for every row.
    query_lens : int [B], optional
        V4.1 decoder-suffix replay (docs/DESIGN.md §5 "Source rows ≠ query rows"): the decoder queries of each row,
        its last ``q`` scheduled tokens, ``1 <= q <= num_scheduled_tokens`` (0 for a row of 0 tokens). The row's
        compressor / indexer source still covers every scheduled token. Default (None): every token queries (a
        declaration with ``q == num_scheduled_tokens`` on every row is the same step).
    """

    req_slots: np.ndarray
    num_computed_tokens: np.ndarray
    num_scheduled_tokens: np.ndarray
    is_new: Optional[np.ndarray] = None
    free_slots: Optional[np.ndarray] = None
    write_gids: Optional[np.ndarray] = None
    write_slots: Optional[np.ndarray] = None
    write_starts: Optional[np.ndarray] = None
    write_cu: Optional[np.ndarray] = None
    write_ids: Optional[np.ndarray] = None
    replay_start: Optional[np.ndarray] = None
    replay_end: Optional[np.ndarray] = None
    drafts: Optional[np.ndarray] = None
    query_lens: Optional[np.ndarray] = None

    @property
    def num_rows(self) -> int:
        return len(self.req_slots)

    @property
    def num_tokens(self) -> int:
        return int(np.sum(self.num_scheduled_tokens)) if len(self.num_scheduled_tokens) else 0

    @property
    def num_runs(self) -> int:
        return 0 if self.write_gids is None else len(self.write_gids)

    def to_json(self) -> dict:
        """Plain-list form (for traces); inverse of :meth:`from_json`."""
        return {k: (None if v is None else np.asarray(v).tolist()) for k, v in self.__dict__.items()
                if v is not None or k not in _OPTIONAL_IN_JSON}  # NOTE: traces without them keep their schema

    @classmethod
    def from_json(cls, d: dict) -> "StepBatch":
        def arr(k, dtype=np.int64):
            v = d.get(k)
            return None if v is None else np.asarray(v, dtype=dtype)
        return cls(**{k: arr(k, bool if k == "is_new" else np.int64) for k in cls.__dataclass_fields__})
