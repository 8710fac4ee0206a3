"""Block ownership: what a row of a step may read, checked on the host before anything is built
(docs/DESIGN.md §5 "What `update()` proves about a step").

**The rule.** A row reads only cache positions it wrote itself (since it was last admitted or resumed), or, in
a prefix-cacheable group, positions of a prefix-shared block that was filled at the same block position and
not refilled since. Everything below follows from it.

* *Release.* After an accepted step a row's next position is in ``[nc + n - d, nc + n]``: ``d`` its draft
  tokens in that step (``StepBatch.drafts``; ``len(scheduled_spec_decode_tokens[req])`` from a
  SchedulerOutput; by default ``min(n - 1, num_speculative_tokens)`` for a row of at most
  ``1 + num_speculative_tokens`` tokens, 0 for a prefill chunk). A sliding block wholly behind the window of
  the lower bound is free, for every live row, scheduled in a step or not (rings: per column).
* *Prevention at write time.* A block another live row reads whatever its drafts' fate (a batch row: from its
  window start in this step; any other row: its window at the upper bound ``nc + n``) is certainly held: a
  write into it is rejected at once. The one exception is vLLM's same-step prefix hit: a request admitted in
  the step that fills a block takes it as a hit at the same block position while the filler writes it whole.
  A block only the band between the two bounds keeps may be handed on (the scheduler knows the acceptance):
  the write is accepted and recorded.
* *Detection at read time.* Each (group, block) keeps its last fill: writer, block position, step. A step in
  which a row would read a sliding block filled since this row last wrote or took it, or takes a "prefix
  hit" of a block filled at another block position, is rejected before anything is built, naming the fill.
* Also: prefix-shared full blocks are read-only for every holder (every full block a live row holds is
  certainly read), so bounded replay writes nothing into them; a row's ring columns hold what it reads (ring
  low-water marks); ``num_computed_tokens`` never jumps past what the row's steps wrote; a window that moves
  back onto blocks another live row holds now is rejected. ``checks="full"`` adds: no id twice in a row, no
  null block among the held sliding blocks a step reads.

Layout: :mod:`.naive` is the rule by its definition (the holders of a written block found by scanning the
table rows as the step leaves them); :mod:`.messages` words every rejection (code, level, template, fields).
:class:`BlockOwners` is the face the request state uses.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .messages import reject
from .naive import NaiveOwners, default_drafts

__all__ = ["BlockOwners", "check_ring_capacity", "default_drafts", "drafts_of"]


def drafts_of(batch, plan) -> Optional[np.ndarray]:
    """int64 ``[B]``: ``batch.drafts`` in device order (-1 entries: the default rule, as -1), or None
    when the batch gives none. Raises ``ValueError`` naming the row for a count outside ``-1 ..
    num_scheduled_tokens - 1`` (the first scheduled token is never a draft)."""
    d = batch.drafts
    if d is None:
        return None
    a = np.asarray(d)
    n = batch.num_rows
    if a.ndim != 1 or a.shape[0] != n or a.dtype.kind not in "iu":
        raise ValueError(f"drafts must be a 1-D integer array of {n} entries (one per batch row), got "
                         f"{a.dtype} of shape {a.shape}")
    a = a.astype(np.int64)
    q = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
    bad = (a < -1) | (a > np.maximum(q - 1, 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"drafts[{i}] = {int(a[i])}: expected -1 (the default rule) or 0.."
                         f"{max(int(q[i]) - 1, 0)} (num_scheduled_tokens {int(q[i])}; the first scheduled token is "
                         f"never a draft)")
    return a.take(plan.rows)


def check_ring_capacity(groups, num_speculative_tokens: int) -> None:
    """Circular groups need ``capacity >= window - 1 + num_speculative_tokens`` (a verify step's writes
    must never reach rows the next step reads after a rejection; DESIGN §4, ``from_config(circular=)``)."""
    for g in groups:
        if g.kind == "circular" and g.window is not None:
            need = g.window - 1 + num_speculative_tokens
            if g.ring_capacity < need:
                reject("own.ring_capacity", gid=g.gid, name=g.name, cap=g.ring_capacity, window=g.window,
                       spec=num_speculative_tokens, need=need)


class BlockOwners(NaiveOwners):
    """The ownership state of one pipeline.

    Parameters
    ----------
    tables : BlockTables — geometry, block counts and host mirror (read only).
    cp : (world, rank, interleave) of the sharded groups.
    level : ``"safe"`` or ``"full"``.
    num_speculative_tokens : int — draft tokens per decode row (the default draft count, the ring rule).
    """

    def __init__(self, tables, *, cp, level: str, num_speculative_tokens: int = 0):
        check_ring_capacity(tables.groups, num_speculative_tokens)
        super().__init__(tables, cp=cp, full=level == "full", next_n=1 + num_speculative_tokens)
