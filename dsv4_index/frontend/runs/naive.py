"""The write runs of a step's appended blocks by their definition, whole-array numpy: what the compiled pass
(:mod:`.kernel`) must equal (``tests/frontend/test_runs_kernel.py``)."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ..rules import LIMIT

__all__ = ["runs_of"]


def runs_of(a: np.ndarray, n_checked: int, at_lens: int, n_lens: int, at_rows: int, n_rows: int, G: int,
            req_slots: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(write_gids, write_slots, write_cu)`` of the non-empty lists (:func:`.kernel.runs_of`'s layout of ``a``),
    or None when a value of ``a[:n_checked]`` is outside ``[0, LIMIT]`` (negatives are huge as uint64)."""
    if n_checked and a[:n_checked].view(np.uint64).max() > LIMIT:
        return None
    lens = a[at_lens:at_lens + n_lens]
    nz = np.flatnonzero(lens)
    rows = nz // G if not n_rows else a[at_rows:at_rows + n_rows][nz // G]
    cu = np.zeros(nz.size + 1, dtype=np.int64)
    np.cumsum(lens[nz], out=cu[1:])
    return nz % G, np.asarray(req_slots, dtype=np.int64)[rows], cu
