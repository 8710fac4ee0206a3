"""The pipeline's block tables: one device buffer holding every group's table, indexed by request
slot, a host mirror of it, and the block count of every (group, slot).

Rows never move: a request keeps its slot from arrival to finish, and the batch order is an
``idx_mapping`` (batch row -> slot). Block ids arrive as write runs (group, slot, first logical
block, ids) and are staged as ``(flat destination, value)`` pairs that the fused launch applies
(:mod:`dsv4_index.state.staging`); the host mirror is updated at the same time.

Column of logical (kernel) block ``i`` of group ``g``: ``i`` for plain tables, ``i % ring_cols`` for
ring tables (sliding groups, docs/DESIGN.md §4) and circular groups (``capacity // block_size`` blocks per
request, a ring of that width: one column for a ring of one block).

The tables own their block counts (:meth:`BlockTables.commit` applies a checked step's); the staging pass
(:mod:`dsv4_index.state.staging`) writes the staged ids and the host mirror from ``geo``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._common import INT32_MAX
from .._numba import pin, ro, rw
from ._index import ring_col
from .plan import StepPlan

__all__ = ["BlockTables"]



class BlockTables:
    """Block tables of every group of a layout, for ``max_num_reqs`` request slots.

    Parameters
    ----------
    groups : sequence of GroupSpec
    max_num_reqs : int
    max_num_batched_tokens : int
        Sizes ring tables (:meth:`GroupSpec.columns`).
    device : torch.device
    max_model_len : int, optional
        Bound of every token count the host accepts (default: the widest group's tokens).
    compressed : sequence of (gid, compress_ratio, rows_per_block)
        Geometry of the compressed channels (their block needs under DCP).
    int32_units : sequence of int
        Per group: the largest number of slots per block that an int32 index list of the group
        addresses (block size for window lists, rows per block for compressed lists; 1 when the
        group feeds int64 slot mappings only). Block ids are limited so those slots fit int32.

    Attributes
    ----------
    flat : int32 ``[total]`` device buffer; ``tables[g]`` int32 ``[max_num_reqs, cols[g]]`` views.
    mirror : int32 ``[total]`` numpy host mirror; ``mirrors[g]`` views like ``tables``.
    num_blocks : int64 ``[G, max_num_reqs]`` logical (kernel) blocks of each (group, slot).
    base, cols, ring, width, logical, f, id_max : int64 ``[G]`` per-group geometry (flat offset,
        stored columns, ring width or 0, kernel read bound, logical blocks a row may hold, kernel
        blocks per allocation block, largest kernel-block id).
    """

    def __init__(self, groups: Sequence, max_num_reqs: int, max_num_batched_tokens: int,
                 device: torch.device, int32_units: Sequence[int], max_model_len: Optional[int] = None,
                 compressed: Sequence[Tuple[int, int, int]] = ()):
        G, num_slots = len(groups), max_num_reqs
        self.groups = tuple(groups)
        self.max_num_reqs = num_slots
        # NOTE: the bound of every token count (num_computed_tokens) the host accepts
        self.max_model_len = int(max_model_len if max_model_len is not None else
                                 max((g.table_width * g.block_size for g in groups), default=0))
        cols, ring = zip(*(g.columns(max_num_batched_tokens) for g in groups)) if G else ((), ())
        self.cols = np.asarray(cols, dtype=np.int64)
        self.ring = np.asarray(ring, dtype=np.int64)
        # NOTE: `width` bounds logical blocks in kernels (a ring has none: columns wrap);
        # `logical` bounds the runs the host accepts (max_model_len, per rank when sharded)
        self.width = np.asarray([INT32_MAX if r else g.table_width for g, r in zip(groups, ring)],
                                dtype=np.int64)
        self.logical = np.asarray([g.ring_blocks if g.kind == "circular" else g.table_width for g in groups],
                                  dtype=np.int64)
        self.f = np.asarray([g.blocks_per_kv_block for g in groups], dtype=np.int64)
        self.fmax = int(self.f.max()) if G else 1
        self.circular = np.asarray([g.kind == "circular" for g in groups], dtype=bool)
        self.bs = np.asarray([g.block_size for g in groups], dtype=np.int64)
        self.window = np.asarray([g.window or 0 for g in groups], dtype=np.int64)
        self.sharded = np.asarray([g.sharded for g in groups], dtype=bool)
        self.full = np.asarray([g.kind == "full" for g in groups], dtype=bool)
        self.full_gids = np.flatnonzero(self.full).tolist()
        self.ring_groups = np.flatnonzero((self.ring > 0) & ~self.circular)
        self.compressed = tuple(compressed)  # NOTE: (gid, compress ratio, rows per block) of compressed channels
        units = np.maximum(np.asarray(int32_units, dtype=np.int64), 1)
        self.id_max = (INT32_MAX - (units - 1)) // units  # NOTE: largest kernel-block id
        self.id_max_min = int(self.id_max.min()) if G else INT32_MAX
        self.base = np.zeros(G, dtype=np.int64)
        if G:
            self.base[1:] = np.cumsum(self.cols * num_slots)[:-1]
        total = int((self.cols * num_slots).sum())
        if total > INT32_MAX:
            raise ValueError(f"block tables need {total} entries, beyond int32 offsets; lower "
                             f"max_num_reqs or max_model_len")
        self.total = total
        self.flat = torch.zeros(max(total, 1), dtype=torch.int32, device=device)
        self.mirror = np.zeros(max(total, 1), dtype=np.int32)
        self.tables: List[torch.Tensor] = []
        self.mirrors: List[np.ndarray] = []
        for g in range(G):
            lo, n = int(self.base[g]), int(self.cols[g]) * num_slots
            self.tables.append(self.flat[lo:lo + n].view(num_slots, int(self.cols[g])))
            self.mirrors.append(self.mirror[lo:lo + n].reshape(num_slots, int(self.cols[g])))
        self.num_blocks = np.zeros((G, num_slots), dtype=np.int64)
        self.iota_cols = np.arange(int(self.cols.max()) + 1 if G else 1, dtype=np.int64)  # NOTE: full checks
        # NOTE: per group (flat base, stored columns, ring width or 0): what the staging pass reads
        self.geo = np.ascontiguousarray(np.stack([self.base, self.cols, self.ring], axis=1), dtype=np.int64)

    # ------------------------------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> None:
        """Block counts after a checked step (freed and new slots start empty; one compiled call)."""
        args = (plan.free_slots, plan.new_slots, plan.w_gid, plan.w_slot, plan.w_end)
        try:
            ok = commit_counts(self.num_blocks, *args)
        except TypeError:  # NOTE: another dtype or a strided view (a plan built by hand): converted, same pass
            ok = commit_counts(self.num_blocks, *(np.ascontiguousarray(a, dtype=np.int64) for a in args))
        if not ok:
            raise IndexError("BlockTables.commit: a slot or group out of range (the plan was not checked)")

    def row(self, gid: int, slot: int) -> np.ndarray:
        """Host copy of the valid logical blocks of a slot, in logical order (int32 ``[n]``).

        For rings only the newest ``ring`` blocks are stored; older ones read as ``-1``.
        """
        n = int(self.num_blocks[gid, slot])
        logical = np.arange(n)
        r = int(self.ring[gid])
        col = ring_col(logical, r)
        out = self.mirrors[gid][slot, col].astype(np.int32)
        if r:
            out[logical < n - r] = -1
        return out

    def expand(self, gid: np.ndarray, starts: np.ndarray, cu: np.ndarray, ids: np.ndarray):
        """Allocation-block runs -> kernel-block runs (hybrid blocks ``f > 1``): ``(starts, cu, ids)``."""
        if self.fmax == 1:
            return starts, cu, ids
        f = self.f[gid] if len(gid) else np.zeros(0, dtype=np.int64)
        if not (f > 1).any():
            return starts, cu, ids
        n = np.diff(cu)
        per_id = np.repeat(f, n)
        k_ids = np.repeat(ids * per_id, per_id) + _ragged_arange(per_id)
        k_cu = np.zeros(len(cu), dtype=np.int64)
        np.cumsum(n * f, out=k_cu[1:])
        return starts * f, k_cu, k_ids


def commit_counts(nb, free, new, gid, slot, end) -> bool:
    """``nb[:, free] = 0``, ``nb[:, new] = 0``, then ``nb[gid, slot] = end`` (in that order); False, and nothing
    written, when an index is out of range or ``slot`` / ``end`` are shorter than ``gid``."""
    G, S = nb.shape
    N = gid.shape[0]
    if slot.shape[0] < N or end.shape[0] < N:
        return False
    for j in range(free.shape[0]):
        if not (0 <= free[j] < S):
            return False
    for j in range(new.shape[0]):
        if not (0 <= new[j] < S):
            return False
    for r in range(N):
        if not (0 <= gid[r] < G and 0 <= slot[r] < S):
            return False
    for g in range(G):
        for j in range(free.shape[0]):
            nb[g, free[j]] = 0
        for j in range(new.shape[0]):
            nb[g, new[j]] = 0
    for r in range(N):
        nb[gid[r], slot[r]] = end[r]
    return True


commit_counts = pin(commit_counts, (rw("int64", 2),) + (ro("int64"),) * 5)


def _ragged_arange(n: np.ndarray) -> np.ndarray:
    """``concat(arange(k) for k in n)`` without a Python loop."""
    total = int(n.sum()) if len(n) else 0
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.zeros(len(n), dtype=np.int64)
    np.cumsum(n[:-1], out=starts[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(starts, n)
