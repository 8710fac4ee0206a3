"""The pipeline's block tables: one device buffer holding every group's table, indexed by request
slot, a host mirror of it, and the block count of every (group, slot).

Rows never move: a request keeps its slot from arrival to finish, and the batch order is an
``idx_mapping`` (batch row -> slot). Block ids arrive as write runs (group, slot, first logical
block, ids) and are staged as ``(flat destination, value)`` pairs that the fused launch applies
(:mod:`dsv4_index.state.staging`); the host mirror is updated at the same time.

Column of logical (kernel) block ``i`` of group ``g``: ``i`` for plain tables, ``i % ring_cols`` for
ring tables (sliding groups, docs/DESIGN.md §4) and circular groups (``capacity // block_size`` blocks per
request, a ring of that width: one column for a ring of one block).

The tables own their writes: :meth:`BlockTables.commit` applies a checked step's block counts,
:meth:`BlockTables.stage_writes` fills the write regions and the overlay of the staging buffer and
the host mirror.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._common import INT32_MAX
from ._index import col_modulus, flat_offset, ring_col
from .plan import StepPlan
from .staging import OV_HI, OV_LO, OV_PAY, OVERLAY_STRIDE, StageLayout, write_halves

__all__ = ["BlockTables"]

_FEW_RUNS = 16  # NOTE: up to this many runs, stage_writes copies slices per run
_RECORD = np.dtype((np.void, 4 * OVERLAY_STRIDE))  # NOTE: one overlay record as a scalar (a single scatter)


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
        self._num_blocks_flat = self.num_blocks.ravel()  # NOTE: a view (C order), keyed gid * num_slots + slot
        # NOTE: per (gid, slot) key: flat offset of the row, and the column modulus (ring width, also of
        # circular groups: capacity // block_size; huge for plain tables: the logical block)
        self._ring_list, self._base_list = self.ring.tolist(), self.base.tolist()
        self._cols_list = self.cols.tolist()
        self._iota = np.arange(int(self.cols.max()) + 1 if G else 1, dtype=np.int32)
        self.iota_cols = self._iota.astype(np.int64)  # NOTE: column numbers (the full checks' row masks)
        self._payload = np.arange(G * num_slots + 1, dtype=np.int64)
        # NOTE: layout -> preset overlay records (the steady path's one scatter)
        self._trips: Dict[StageLayout, Tuple[np.ndarray, np.ndarray]] = {}
        self._mixed = np.zeros((G * num_slots + 1, OVERLAY_STRIDE), dtype=np.int32)  # NOTE: _stage_mixed's records
        self._row_base = flat_offset(self.base[:, None], self.cols[:, None], np.arange(num_slots)[None, :], 0).ravel()
        self._col_mod = np.repeat(col_modulus(self.ring), num_slots)

    # ------------------------------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> None:
        """Block counts after a checked step (freed and new slots start empty)."""
        nb = self.num_blocks
        if plan.free_slots.size:
            nb[:, plan.free_slots] = 0
        if plan.new_slots.size:
            nb[:, plan.new_slots] = 0
        if plan.w_key is not None:
            self._num_blocks_flat[plan.w_key] = plan.w_end
        elif plan.w_gid.size:
            nb[plan.w_gid, plan.w_slot] = plan.w_end

    def stage_writes(self, plan: StepPlan, h: np.ndarray, lay: StageLayout) -> int:
        """Stage a checked step's block ids into host buffer ``h`` (format of ``state/staging.py``):
        the values and flat destinations of the kept ids, the overlay of every (group, batch row),
        and the host mirror. Returns the number of ids staged."""
        ov = h[lay.overlay:lay.overlay + OVERLAY_STRIDE * len(self.groups) * lay.rows]
        ov[:] = 0  # NOTE: every row of the layout (one contiguous memset; rows past B are never read)
        ov = ov.reshape(len(self.groups), lay.rows, OVERLAY_STRIDE)
        if not plan.w_gid.size:
            return 0
        if plan.w_key is not None:  # NOTE: fast path: every run on a batch row
            if plan.w_other is None:  # NOTE: one kept id per run
                return self._stage_appends(plan, h, lay, ov)
            return self._stage_mixed(plan, h, lay)
        w0 = lay.writes
        N = self._stage_runs(plan, h, w0) if plan.w_gid.shape[0] <= _FEW_RUNS else None
        keep: Union[np.ndarray, bool, None] = False  # NOTE: False: staged run by run (_stage_runs)
        if N is None:
            keep, dst = self.destinations(plan.w_gid, plan.w_slot, plan.w_start, plan.w_keep, plan.w_cu)
            vals = plan.w_ids if keep is None else plan.w_ids[keep]
            N = vals.shape[0]
            hv, hd = write_halves(h, w0, N)
            hv[:] = vals
            hd[:] = dst
            self.mirror[dst] = vals
        if keep is None:
            # NOTE: every id kept (one per run): run i's id is value i
            first, pay = plan.w_start, w0 + np.arange(plan.w_gid.shape[0])
        else:
            first = np.maximum(plan.w_keep, plan.w_start)
            # NOTE: np.maximum, not .clip (a Python wrapper)
            kept = np.maximum(np.minimum(plan.w_end - first, plan.w_cu[1:] - plan.w_cu[:-1]), 0)
            pay = w0 + np.cumsum(kept) - kept
        r, end = plan.w_row, plan.w_end
        at = lay.overlay + OVERLAY_STRIDE * (plan.w_gid * lay.rows + r)
        m = r >= 0
        if not m.all():
            at, first, end, pay = at[m], first[m], end[m], pay[m]
        h[at + OV_LO] = first
        h[at + OV_HI] = end
        h[at + OV_PAY] = pay
        return N

    def _stage_runs(self, plan: StepPlan, h: np.ndarray, w0: int):
        """:meth:`stage_writes` of a few runs (a prefill): each run's kept ids are one slice, or two
        where a ring wraps (it keeps at most ``ring`` ids); no array over every id. None when a run
        keeps more ids than its ring (the general path handles it)."""
        runs, total = [], 0
        cu = plan.w_cu.tolist()
        for i, (g, slot, start, end, keep) in enumerate(zip(plan.w_gid.tolist(), plan.w_slot.tolist(),
                                                            plan.w_start.tolist(), plan.w_end.tolist(),
                                                            plan.w_keep.tolist())):
            first = max(keep, start)
            k = max(min(end - first, cu[i + 1] - cu[i]), 0)
            ring = self._ring_list[g]
            if ring and k > ring:
                return None
            if k:
                runs.append((g, slot, first, k, cu[i] + first - start, ring))
                total += k
        (vals, dsts), ids = write_halves(h, w0, total), plan.w_ids
        pos = 0
        for g, slot, first, k, src, ring in runs:
            row = flat_offset(self._base_list[g], self._cols_list[g], slot, 0)
            col = ring_col(first, ring)
            a = min(k, ring - col) if ring else k
            run_ids = ids[src:src + k]
            vals[pos:pos + k] = run_ids
            d = dsts[pos:pos + a]
            np.add(self._iota[:a], row + col, out=d)
            self.mirror[row + col:row + col + a] = run_ids[:a]
            if a < k:  # NOTE: the ring wraps once: the rest starts at column 0
                np.add(self._iota[:k - a], row, out=dsts[pos + a:pos + k])
                self.mirror[row:row + k - a] = run_ids[a:]
            pos += k
        return total

    def _stage_mixed(self, plan: StepPlan, h: np.ndarray, lay: StageLayout) -> int:
        """:meth:`stage_writes` of one-id appends (vectorised) and a few other runs ``plan.w_other``
        (one or two slices each), every run on a batch row; the bytes of the general staging."""
        other, a, cu, w0, w_key = plan.w_other, plan.w_app, plan.w_cu, lay.writes, plan.w_key
        assert other is not None and a is not None and w_key is not None  # NOTE: stage_writes' dispatch
        # NOTE: on the fast path start <= keep <= end and end - start is the run's length: every id from keep on
        first = plan.w_keep
        kept = plan.w_end - first
        kept_cu = np.add.accumulate(kept)
        N = int(kept_cu[-1])
        pay = kept_cu - kept
        vals, dsts = write_halves(h, w0, N)
        if a.shape[0]:
            key, at = w_key.take(a), pay.take(a)
            dst = self._row_base.take(key)
            dst += plan.w_start.take(a) % self._col_mod.take(key)
            vals[at] = plan.w_ids.take(cu.take(a))
            dsts[at] = dst
            self.mirror[dst] = vals[at]
        ids = plan.w_ids
        for g, slot, f, k, p, c0, s0 in zip(plan.w_gid.take(other).tolist(), plan.w_slot.take(other).tolist(),
                                            first.take(other).tolist(), kept.take(other).tolist(),
                                            pay.take(other).tolist(), cu.take(other).tolist(),
                                            plan.w_start.take(other).tolist()):
            if not k:
                continue
            src = c0 + f - s0
            row = flat_offset(self._base_list[g], self._cols_list[g], slot, 0)
            ring = self._ring_list[g]
            col = ring_col(f, ring)
            n1 = min(k, ring - col) if ring else k
            run_ids = ids[src:src + k]
            vals[p:p + k] = run_ids
            np.add(self._iota[:n1], row + col, out=dsts[p:p + n1])
            self.mirror[row + col:row + col + n1] = vals[p:p + n1]
            if n1 < k:  # NOTE: the ring wraps: the rest from column 0 (at most ring ids are kept)
                np.add(self._iota[:k - n1], row, out=dsts[p + n1:p + k])
                self.mirror[row:row + k - n1] = vals[p + n1:p + k]
        # NOTE: the overlay as one scatter of 12-byte records
        R = plan.w_gid.shape[0]
        trip = self._mixed
        trip[:R, OV_LO] = first
        trip[:R, OV_HI] = plan.w_end
        np.add(pay, w0, out=trip[:R, OV_PAY], casting="unsafe")
        at = np.multiply(plan.w_gid, lay.rows)
        at += plan.w_row
        ov = h[lay.overlay:lay.overlay + OVERLAY_STRIDE * len(self.groups) * lay.rows]
        ov.view(_RECORD)[at] = trip[:R].reshape(-1).view(_RECORD)
        return N

    def _stage_appends(self, plan: StepPlan, h: np.ndarray, lay: StageLayout, ov: np.ndarray) -> int:
        """:meth:`stage_writes` of runs that append one id each to batch rows (run ``i``'s id is value ``i``)."""
        key, ids, N, w0 = plan.w_key, plan.w_ids, plan.w_ids.shape[0], lay.writes
        assert key is not None  # NOTE: stage_writes' dispatch: the fast path's runs
        dst = self._row_base.take(key)
        dst += plan.w_start % self._col_mod.take(key)
        vals, dsts = write_halves(h, w0, N)
        vals[:] = ids
        dsts[:] = dst
        self.mirror[dst] = vals  # NOTE: from the int32 copy (a scatter that casts costs 5x)
        # NOTE: one scatter of whole 12-byte records from a buffer whose payload column is preset
        trip, rows = self._records(lay)
        trip[:N, OV_LO] = plan.w_start
        trip[:N, OV_HI] = plan.w_end
        at = np.multiply(plan.w_gid, rows)
        at += plan.w_row
        ov.reshape(-1).view(_RECORD)[at] = trip[:N].reshape(-1).view(_RECORD)
        return N

    def _records(self, lay: StageLayout) -> Tuple[np.ndarray, np.ndarray]:
        """int32 ``[G * max_num_reqs, OVERLAY_STRIDE]`` overlay records for :meth:`_stage_appends`,
        payload column ``lay.writes + i``, and ``lay.rows`` as a 0-d int64 (built once per layout)."""
        got = self._trips.get(lay)
        if got is None:
            n = len(self.groups) * self.max_num_reqs
            trip = np.zeros((n, OVERLAY_STRIDE), dtype=np.int32)
            trip[:, OV_PAY] = lay.writes + np.arange(n)
            got = self._trips[lay] = (trip, np.array(lay.rows, dtype=np.int64))
        return got

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

    def destinations(self, gid: np.ndarray, slot: np.ndarray, start: np.ndarray, keep_from: np.ndarray,
                     cu: np.ndarray) -> Tuple[Optional[np.ndarray], np.ndarray]:
        """Where the kept ids of validated kernel-block runs go.

        A run sets logical blocks ``[start, start + n)``; only those from ``keep_from`` on are stored
        (rings keep a row's newest blocks, from the lowest block a request can still read).
        Returns ``(keep, dst)``: ``keep`` bool ``[n]`` or None (every id kept), ``dst`` int64 flat
        offsets of the kept ids, in run order.
        """
        N = gid.shape[0]
        n_ids = int(cu[-1])
        ring = self.ring[gid]
        if n_ids == N and (keep_from <= start).all():
            # NOTE: fast path (steady decode): one id per run, all kept
            return None, flat_offset(self.base[gid], self.cols[gid], slot, ring_col(start, ring))
        n = np.diff(cu)
        k = _ragged_arange(n)
        run = np.repeat(np.arange(N), n)
        logical = start[run] + k
        keep = logical >= keep_from[run]
        logical, run = logical[keep], run[keep]
        r = ring[run]
        g = gid[run]
        return keep, flat_offset(self.base[g], self.cols[g], slot[run], ring_col(logical, r))


def _ragged_arange(n: np.ndarray) -> np.ndarray:
    """``concat(arange(k) for k in n)`` without a Python loop."""
    total = int(n.sum()) if len(n) else 0
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.zeros(len(n), dtype=np.int64)
    np.cumsum(n[:-1], out=starts[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(starts, n)
