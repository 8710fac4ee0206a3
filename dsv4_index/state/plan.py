"""The checked step every pass reads: :class:`StepPlan`, made by the checks (:mod:`.checks`) before
anything changes and committed by :meth:`MetadataPipeline.update` afterwards; the check levels
(docs/DESIGN.md §5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["StepPlan", "plans_equal", "CHECK_LEVELS"]

CHECK_LEVELS = ("safe", "full")


@dataclass
class StepPlan:
    """A checked step. Device batch = the rows with tokens, decode first; ``B`` rows, ``T`` tokens."""

    rows: np.ndarray            # int64 [B]: StepBatch row of each device batch row
    slots: np.ndarray           # int64 [B]
    num_scheduled: np.ndarray   # int64 [B]
    seq_lens: np.ndarray        # int64 [B]
    replay_start: Optional[np.ndarray]  # int64 [B] or None
    replay_end: Optional[np.ndarray]    # int64 [B] or None
    num_decodes: int
    num_decode_tokens: int
    num_tokens: int
    num_tokens_padded: int
    # state changes
    free_slots: np.ndarray      # int64 [F]
    new_slots: np.ndarray       # int64 [K]
    all_slots: np.ndarray       # int64 [rows]: every StepBatch row's slot
    all_computed: np.ndarray    # int64 [rows]
    # kernel-block write runs (validated); ids of logical blocks below w_keep are not stored
    w_gid: np.ndarray           # int64 [N]
    w_slot: np.ndarray
    w_start: np.ndarray
    w_end: np.ndarray
    w_keep: np.ndarray
    w_cu: np.ndarray            # int64 [N + 1]
    w_ids: np.ndarray           # int64 [n]
    w_row: np.ndarray           # int64 [N]: device batch row of each run's slot, -1 when not in the batch
    drafts: Optional[np.ndarray] = None  # int64 [B]: draft tokens per batch row (ownership), or None


def plans_equal(a: StepPlan, b: StepPlan) -> list:
    """Names of the fields in which two plans differ (values, dtypes and shapes), ``[]`` when equal."""
    out = []
    for name in StepPlan.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            same = (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
                    and x.shape == y.shape and bool((x == y).all()))
        else:
            same = x == y
        if not same:
            out.append(name)
    return out
