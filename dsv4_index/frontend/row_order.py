"""The engine's row order (issue 40 item 2): ``MetadataPipeline(..., row_order="caller")`` keeps the rows of a step
as the caller lists them, so ``meta`` row ``i`` is the caller's row ``i`` (no permutation of hidden states),
when they are already decode-first; a step that is not is refused here, before any side effect.

* ``ROW_ORDERS``: ``"decode_first"`` (the default: the pipeline orders each step's rows decode-first itself,
  stable, and drops rows that schedule no token) and ``"caller"``.
* :func:`check_caller_order`: the check of ``"caller"``. A row is a decode when it schedules at most
  ``next_n = 1 + num_speculative_tokens`` tokens (the pipeline's threshold, and the one vLLM's
  ``reorder_batch_to_split_decodes_and_prefills`` splits at); decode-first = no decode after a prefill; every row
  must schedule at least one token (a row without tokens has no device row).
* :func:`reorder_rows`: an id-keyed step's batch (and its ``SlotMapDelta``) in the engine's order of request
  ids, e.g. vLLM's ``InputBatch.req_ids`` after ``reorder_batch`` (``dsv4_index.integrations.vllm``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Tuple

import numpy as np

from ..batch import StepBatch
from ..state.requests import SlotMapDelta, frozen

__all__ = ["ROW_ORDERS", "check_row_order", "check_caller_order", "reorder_rows"]

ROW_ORDERS = ("decode_first", "caller")
_NOT_ROWS = frozenset({"free_slots", "write_gids", "write_slots", "write_starts", "write_cu", "write_ids"})


def check_row_order(row_order) -> str:
    """``row_order`` if it is one of :data:`ROW_ORDERS`; ValueError otherwise."""
    if row_order not in ROW_ORDERS:
        raise ValueError(f"row_order must be one of {ROW_ORDERS}, got {row_order!r}")
    return row_order


def check_caller_order(batch: StepBatch, next_n: int, req_ids: Optional[Sequence[str]] = None) -> None:
    """Raise ValueError unless the rows of ``batch`` are decode-first and each schedules a token, naming the
    first row that breaks it (its index, slot, request id when ``req_ids`` is given, and token count).

    Parameters
    ----------
    batch : StepBatch — its ``num_scheduled_tokens`` int ``[B]`` and ``req_slots`` int ``[B]`` are read.
    next_n : int — ``1 + num_speculative_tokens``: a row of at most ``next_n`` tokens is a decode.
    req_ids : sequence of str ``[B]``, optional — the request id of each row, for the message.
    """
    q = np.asarray(batch.num_scheduled_tokens)
    if q.ndim != 1:
        raise ValueError(f"num_scheduled_tokens must be 1-D, got shape {q.shape}")
    if not q.shape[0]:
        return

    def name(i: int) -> str:
        rid = f" (request {req_ids[i]!r})" if req_ids is not None and i < len(req_ids) else ""
        return f"row {i}{rid}, slot {int(np.asarray(batch.req_slots)[i])},"

    empty = np.flatnonzero(q <= 0)
    if empty.size:
        i = int(empty[0])
        raise ValueError(f"row_order='caller': {name(i)} schedules {int(q[i])} tokens; every row must schedule a "
                         f"token (a row without tokens has no device row, so meta rows would not equal the "
                         f"caller's): leave it out of the step")
    dec = q <= next_n
    first_prefill = int(np.argmin(dec)) if not dec.all() else q.shape[0]
    late = np.flatnonzero(dec[first_prefill:])
    if late.size:
        i = first_prefill + int(late[0])
        raise ValueError(f"row_order='caller': {name(i)} is a decode ({int(q[i])} tokens <= next_n = {next_n}) "
                         f"after the prefill row {first_prefill} ({int(q[first_prefill])} tokens): the rows are "
                         f"not decode-first (order decodes first, as vLLM's reorder_batch does, or use "
                         f"row_order='decode_first')")


def reorder_rows(batch: StepBatch, delta: SlotMapDelta, req_ids: Sequence[str]) -> Tuple[StepBatch, SlotMapDelta]:
    """``(batch, delta)`` of an id-keyed conversion with its rows in the order of ``req_ids`` (pure: new
    objects; block-write runs name slots, not rows, and stay as they are).

    ``req_ids`` must list every request of the step's rows exactly once (``delta.order``), and nothing else;
    ValueError naming the first id that differs otherwise.
    """
    order = list(delta.order)
    if list(req_ids) == order:
        return batch, delta
    at = {rid: i for i, rid in enumerate(order)}
    seen = set()
    for j, rid in enumerate(req_ids):
        if rid not in at:
            raise ValueError(f"req_ids[{j}] = {rid!r} is not a request of the step (its rows: {order[:8]!r}"
                             f"{' ...' if len(order) > 8 else ''})")
        if rid in seen:
            raise ValueError(f"req_ids[{j}] = {rid!r} is listed twice")
        seen.add(rid)
    if len(seen) != len(order):
        missing = next(rid for rid in order if rid not in seen)
        raise ValueError(f"req_ids leaves out request {missing!r}, which the step schedules")
    perm = np.fromiter((at[rid] for rid in req_ids), dtype=np.int64, count=len(order))

    # NOTE: every per-row field (req_slots, counts, is_new, replay bounds, drafts, and any added later): all
    # fields but the freed slots and the write runs, which name slots
    rows = {f: np.asarray(v)[perm] for f in batch.__dataclass_fields__ if f not in _NOT_ROWS
            and (v := getattr(batch, f)) is not None}
    new_batch = replace(batch, **rows)
    new_delta = replace(delta, order=list(req_ids),
                        slots=None if delta.slots is None else frozen(np.asarray(delta.slots)[perm]))
    return new_batch, new_delta
