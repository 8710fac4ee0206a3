"""Row-editing block tables (add / append / move / swap / clear rows, incremental uploads) for engines
that keep their own rows: a thin facade over the pipeline's tables, :mod:`dsv4_index.state`.

One implementation (the pipeline's): the storage is a :class:`dsv4_index.state.BlockTables` (host mirror,
device table, block counts, one flat device buffer for every group of a
:class:`MultiGroupBlockTable`) and an upload goes through the pipeline's staging buffer,
:class:`dsv4_index.state.StepStaging` (``stage_writes_only``: the changed entries as ``(value, flat
destination)`` pairs, ONE host-to-device copy, applied on the device by ``apply_pending``). This module
adds only what the pipeline does not need: the row operations, whose rows may move, and their dirty
ranges. :class:`~dsv4_index.MetadataPipeline` keeps rows in place (slots) and stages its writes itself.

Dirty tracking is per row: one column range ``[lo, hi)`` (empty when ``lo >= hi``) covering every
entry of the row's valid prefix ``[0, num_blocks)`` that changed since the last upload. ``append_row``
marks only the new columns; ``add_row`` / ``move_row`` / ``swap_row`` mark the new valid prefix of the
rows they rewrite (stale columns past ``num_blocks`` are never read, so they are never sent). An upload
sends ``4 * (H + 2 * n)`` bytes for ``n`` changed entries (``H``: the staging format's fixed part,
``state/staging.py``).

The rules are the state's: integer arguments go through :func:`dsv4_index._common.check_int`, block
ids are bounded like the pipeline's write runs (kernel-block ids fit int32, ``BlockTables.id_max``),
expanded as :meth:`BlockTables.expand` expands them (block ``b``'s kernel ids are ``b * f`` plus those of
block 0, taken from it once) and placed at :func:`dsv4_index.state._index.flat_offset`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ._common import check_int
from .geometry import GroupSpec
from .state import BlockTables, StepStaging
from .state._index import flat_offset

__all__ = ["BlockTable", "MultiGroupBlockTable"]


def _check_int(name: str, v) -> int:
    return check_int(name, v, lo=1, numpy_ok=True)


def _store(params, max_num_reqs: int, device: torch.device) -> BlockTables:
    """State tables of plain groups ``(width, block_size, f)`` (no ring, no window: rows of ``width``)."""
    groups = [GroupSpec(gid=g, name=f"table{g}", kind="full", block_size=bs, window=None, prefix_cacheable=False,
                        table_width=w, blocks_per_kv_block=f, sharded=False) for g, (w, bs, f) in enumerate(params)]
    return BlockTables(groups, max_num_reqs, 1, device, [1] * len(groups))


class _Upload:
    """The shared store and its staging buffer (allocated at the first upload, at capacity)."""

    def __init__(self, store: BlockTables):
        self.store = store
        self.staging: Optional[StepStaging] = None

    def send(self, tables) -> int:
        """Stage the dirty entries of ``tables`` (facades over ``store``) and apply them: one copy."""
        vals, dsts = [], []
        for t in tables:
            d = t._dirty_offsets()
            if d is not None:
                dsts.append(d)
                vals.append(self.store.mirror[d])
        if not dsts:
            return 0
        if self.staging is None:
            st = self.store
            self.staging = StepStaging(st.flat.device, 0, len(st.groups), 0, st.total, st.max_num_reqs)
        dst = dsts[0] if len(dsts) == 1 else np.concatenate(dsts)
        val = vals[0] if len(vals) == 1 else np.concatenate(vals)
        nbytes = self.staging.stage_writes_only(val, dst)
        self.staging.apply_pending(self.store.flat)
        for t in tables:
            t._clean()
        return nbytes


class BlockTable:
    """Block table of one kv-cache group for up to ``max_num_reqs`` request rows.

    Parameters
    ----------
    max_num_reqs : int
        Rows (persistent batch capacity).
    width : int
        Columns, in kernel blocks (``GroupSpec.table_width``).
    device : torch.device or str
        Where the device table lives.
    block_size : int
        Kernel block size in tokens (kept for consumers; not used by the row operations).
    blocks_per_kv_block : int
        ``f``: an allocation block id ``b`` is stored as the kernel-block ids ``b*f + j``, ``j < f``.

    NOTE: the staging's transfer buffers are pinned when the device is CUDA; the host mirror is not.

    Attributes
    ----------
    host : torch.Tensor
        int32 ``[max_num_reqs, width]`` host mirror (a view of :attr:`BlockTables.mirror`).
    np : numpy.ndarray
        int32 ``[max_num_reqs, width]`` view of ``host``.
    num_blocks : numpy.ndarray
        int64 ``[max_num_reqs]``: valid kernel blocks per row (a view of the state tables' block
        counts). Entries past a row's length are stale.
    dirty_lo, dirty_hi : numpy.ndarray
        int32 ``[max_num_reqs]``: the changed column range ``[lo, hi)`` of each row (empty: ``lo >= hi``).
        NOTE: ``0 <= lo`` and ``hi <= num_blocks`` always; rows never read past ``num_blocks``.
    device_table : torch.Tensor
        int32 ``[max_num_reqs, width]`` on ``device`` (a view of the state tables' flat buffer),
        allocated once; its valid prefix ``[r, :num_blocks[r]]`` equals the host's after ``upload()``.
    """

    def __init__(self, max_num_reqs: int, width: int, *, device, block_size: int,
                 blocks_per_kv_block: int = 1, _shared=None):
        self.max_num_reqs = _check_int("max_num_reqs", max_num_reqs)
        self.width = _check_int("width", width)
        self.block_size = _check_int("block_size", block_size)
        self.blocks_per_kv_block = _check_int("blocks_per_kv_block", blocks_per_kv_block)
        self.device = torch.device(device)
        if _shared is None:
            _shared = (_Upload(_store([(self.width, self.block_size, self.blocks_per_kv_block)],
                                      self.max_num_reqs, self.device)), 0)
        self._upload, gid = _shared
        store = self._upload.store
        self._base, self._cols = int(store.base[gid]), int(store.cols[gid])
        f = self.blocks_per_kv_block
        self._id_max = (int(store.id_max[gid]) - (f - 1)) // f  # NOTE: the write runs' rule (state/plan.py)
        zero = np.zeros(1, dtype=np.int64)  # NOTE: the state's kernel ids of allocation block 0 (arange(f))
        self._kernel_offsets = store.expand(np.full(1, gid), zero, np.array([0, 1]), zero)[2]
        self.np = store.mirrors[gid]
        self.host = torch.from_numpy(self.np)
        self.num_blocks = store.num_blocks[gid]
        self._device_table = store.tables[gid]
        self.dirty_lo = np.zeros(self.max_num_reqs, dtype=np.int32)
        self.dirty_hi = np.zeros(self.max_num_reqs, dtype=np.int32)

    # ------------------------------------------------------------------------------------------
    @property
    def device_table(self) -> torch.Tensor:
        """int32 ``[max_num_reqs, width]`` device table (same object for the table's lifetime)."""
        return self._device_table

    @property
    def staging(self) -> Optional[StepStaging]:
        """The state staging buffer uploads go through (shared by the groups of a
        :class:`MultiGroupBlockTable`; None before the first upload)."""
        return self._upload.staging

    @property
    def num_dirty(self) -> int:
        """Rows changed since the last upload."""
        return int(np.count_nonzero(self.dirty_hi > self.dirty_lo))

    def row(self, row: int) -> np.ndarray:
        """int32 ``[num_blocks[row]]`` view of the valid part of a host row."""
        row = self._check_row("row", row)
        return self.np[row, : self.num_blocks[row]]

    # ------------------------------------------------------------------------------------------
    def _check_row(self, name: str, row) -> int:
        return check_int(name, row, lo=0, hi=self.max_num_reqs - 1, numpy_ok=True)

    def _check_ids(self, ids: np.ndarray, what: str) -> None:
        if ids.size and (ids.min() < 0 or ids.max() > self._id_max):
            raise ValueError(f"{what} must be >= 0 and fit int32 as kernel-block ids")

    def _kernel_ids(self, ids: np.ndarray) -> np.ndarray:
        """int64 allocation ids ``[n]`` -> their kernel-block ids ``[n * f]``, as :meth:`BlockTables.expand`."""
        f = self.blocks_per_kv_block
        return ids if f == 1 else (ids[:, None] * f + self._kernel_offsets).reshape(-1)

    def _expand(self, block_ids, row: int):
        if self.blocks_per_kv_block == 1 and type(block_ids) is list and len(block_ids) <= 8:
            # NOTE: fast path for the few ids a running request appends per step (no numpy round trip)
            if block_ids and (min(block_ids) < 0 or max(block_ids) > self._id_max):
                raise ValueError(f"block_ids of row {row} must be >= 0 and fit int32 as kernel-block ids")
            return block_ids
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        self._check_ids(ids, f"block_ids of row {row}")
        return self._kernel_ids(ids)

    def _mark_prefix(self, row: int, n: int) -> None:
        self.dirty_lo[row], self.dirty_hi[row] = 0, n

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Set row ``row`` to ``block_ids`` (allocation block ids; expanded when ``f > 1``)."""
        row = self._check_row("row", row)
        ids = self._expand(block_ids, row)
        n = len(ids)
        if n > self.width:
            raise ValueError(f"row {row}: {n} kernel blocks exceed the table width {self.width}")
        self.np[row, :n] = ids
        self.num_blocks[row] = n
        self._mark_prefix(row, n)

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Append ``block_ids`` after the row's current ``num_blocks[row]`` entries (marks only the
        new columns dirty)."""
        row = self._check_row("row", row)
        ids = self._expand(block_ids, row)
        n = len(ids)
        if n == 0:
            return
        start = int(self.num_blocks[row])
        end = start + n
        if end > self.width:
            raise ValueError(f"row {row}: appending {n} kernel blocks to {start} exceeds the "
                             f"table width {self.width}")
        self.np[row, start:end] = ids
        self.num_blocks[row] = end
        if self.dirty_hi[row] <= self.dirty_lo[row]:
            self.dirty_lo[row] = start
        self.dirty_hi[row] = end  # NOTE: hull of the old range (inside [0, start)) and the new columns

    def append_rows(self, rows, counts, block_ids) -> None:
        """Bulk :meth:`append_row`: append ``counts[i]`` ids to row ``rows[i]`` for every ``i``.

        Parameters
        ----------
        rows : array-like of int, ``[k]``
            Distinct rows in ``[0, max_num_reqs)``.
        counts : array-like of int, ``[k]``
            Allocation block ids appended per row (``>= 0``).
        block_ids : array-like of int, ``[sum(counts)]``
            The ids, row after row (allocation ids; expanded to kernel blocks when ``f > 1``).

        Raises ValueError (nothing written) on a bad row, a repeated row, a bad id, or a row that
        would exceed the table width.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if counts.shape != rows.shape or (counts.size and counts.min() < 0) or ids.size != int(counts.sum()):
            raise ValueError(f"counts must hold one count >= 0 per row and sum to len(block_ids) = {ids.size}")
        if rows.size and (rows.min() < 0 or rows.max() >= self.max_num_reqs or np.unique(rows).size != rows.size):
            raise ValueError(f"rows must be distinct ints in [0, {self.max_num_reqs}), got {rows.tolist()}")
        self._check_ids(ids, "block_ids")
        start = self.num_blocks[rows].astype(np.int64)
        n = counts * self.blocks_per_kv_block
        end = start + n
        over = np.flatnonzero(end > self.width)
        if over.size:
            i = int(over[0])
            raise ValueError(f"row {int(rows[i])}: appending {int(n[i])} kernel blocks to {int(start[i])} exceeds "
                             f"the table width {self.width}")
        m = counts > 0
        self._append_rows(rows[m], counts[m], ids, start[m])

    def _append_rows(self, rows: np.ndarray, counts: np.ndarray, ids: np.ndarray,
                     start: Optional[np.ndarray] = None) -> None:
        """:meth:`append_rows` without checks (int64 arrays; the caller checked rows, ids and width).

        NOTE: every count must be > 0 (then ``sum(counts) == len(rows)`` means one id per row)."""
        if ids.size == 0:
            return
        f = self.blocks_per_kv_block
        if start is None:
            start = self.num_blocks[rows].astype(np.int64)
        if f == 1 and ids.size == rows.size:
            # NOTE: one id per row (steady decode): no repeat / cumsum
            self.np[rows, start] = ids
            end = start + 1
        else:
            # NOTE: kernel entry e of row i goes to column start[i] + (e - first kernel entry of row i)
            n = counts * f
            first = np.cumsum(n) - n
            col = np.repeat(start - first, n) + np.arange(int(n.sum()))
            self.np[np.repeat(rows, n), col] = self._kernel_ids(ids)
            end = start + n
        self.num_blocks[rows] = end
        lo, hi = self.dirty_lo, self.dirty_hi
        lo[rows] = np.where(hi[rows] <= lo[rows], start, lo[rows])
        hi[rows] = end  # NOTE: hull of the old range (inside [0, start)) and the new columns

    def clear_row(self, row: int) -> None:
        """Set the row's length to 0 (entries are left stale; nothing to send to the device)."""
        row = self._check_row("row", row)
        self.num_blocks[row] = 0
        self._mark_prefix(row, 0)

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` into row ``dst`` (``src`` is left as is)."""
        src, dst = self._check_row("src", src), self._check_row("dst", dst)
        if src == dst:
            return
        n = int(self.num_blocks[src])
        self.np[dst, :n] = self.np[src, :n]
        self.num_blocks[dst] = n
        self._mark_prefix(dst, n)

    def swap_row(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (the valid prefixes; stale columns are not exchanged)."""
        a, b = self._check_row("a", a), self._check_row("b", b)
        if a == b:
            return
        na, nb = int(self.num_blocks[a]), int(self.num_blocks[b])
        tmp = self.np[a, :na].copy()
        self.np[a, :nb] = self.np[b, :nb]
        self.np[b, :na] = tmp
        self.num_blocks[a], self.num_blocks[b] = nb, na
        self._mark_prefix(a, nb)
        self._mark_prefix(b, na)

    def _clean(self) -> None:
        self.dirty_lo[:] = 0
        self.dirty_hi[:] = 0

    def _dirty_offsets(self) -> Optional[np.ndarray]:
        """int64 flat offsets (in the state tables' buffer) of every dirty entry, or None."""
        lo, hi = self.dirty_lo, self.dirty_hi
        rows = np.flatnonzero(hi > lo)
        if rows.size == 0:
            return None
        r_lo = lo[rows].astype(np.int64)
        n = hi[rows] - r_lo
        first = np.cumsum(n) - n
        return np.repeat(flat_offset(self._base, self._cols, rows, r_lo - first), n) + np.arange(int(n.sum()))

    def upload(self) -> int:
        """Send the entries changed since the last upload with one H2D copy through the state staging
        buffer (applied on the device, no host sync); returns the bytes copied (0 when nothing changed)."""
        return self._upload.send([self])


def _group_params(g) -> Tuple[int, int, int]:
    if hasattr(g, "table_width"):
        return g.table_width, g.block_size, getattr(g, "blocks_per_kv_block", 1)
    if isinstance(g, (tuple, list)) and len(g) in (2, 3):
        return (g[0], g[1], g[2] if len(g) == 3 else 1)
    raise ValueError(f"groups: each entry must be a GroupSpec or (width, block_size[, f]), got {g!r}")


class MultiGroupBlockTable:
    """One :class:`BlockTable` per gid; row operations take one block-id list per gid.

    Parameters
    ----------
    groups : DSV4Layout, sequence of GroupSpec, or sequence of (width, block_size, f)
        In gid order.
    max_num_reqs : int
    device : torch.device or str
    """

    def __init__(self, groups, max_num_reqs: int, device):
        if hasattr(groups, "groups"):
            groups = groups.groups
        params = [_group_params(g) for g in groups]
        if not params:
            raise ValueError("groups must not be empty")
        self.device = torch.device(device)
        params = [(_check_int("width", w), _check_int("block_size", bs), _check_int("blocks_per_kv_block", f))
                  for (w, bs, f) in params]
        # NOTE: one state store (one flat device buffer) for every group: one copy per upload
        self._upload = _Upload(_store(params, _check_int("max_num_reqs", max_num_reqs), self.device))
        self.tables: List[BlockTable] = [
            BlockTable(max_num_reqs, w, device=self.device, block_size=bs, blocks_per_kv_block=f,
                       _shared=(self._upload, g)) for g, (w, bs, f) in enumerate(params)]
        self.max_num_reqs = self.tables[0].max_num_reqs

    def __getitem__(self, gid: int) -> BlockTable:
        return self.tables[gid]

    def __len__(self) -> int:
        return len(self.tables)

    def _per_gid(self, name: str, lists) -> Sequence:
        if len(lists) != len(self.tables):
            raise ValueError(f"{name} has {len(lists)} per-gid lists, expected {len(self.tables)}")
        return lists

    def add_row(self, block_ids_per_gid, row: int) -> None:
        for t, ids in zip(self.tables, self._per_gid("block_ids_per_gid", block_ids_per_gid), strict=True):
            t.add_row(ids, row)

    def append_row(self, block_ids_per_gid, row: int) -> None:
        for t, ids in zip(self.tables, self._per_gid("block_ids_per_gid", block_ids_per_gid), strict=True):
            if len(ids):
                t.append_row(ids, row)

    def clear_row(self, row: int) -> None:
        for t in self.tables:
            t.clear_row(row)

    def move_row(self, src: int, dst: int) -> None:
        for t in self.tables:
            t.move_row(src, dst)

    def swap_row(self, a: int, b: int) -> None:
        for t in self.tables:
            t.swap_row(a, b)

    def upload(self) -> int:
        """Send the changed entries of every group with ONE H2D copy; returns the bytes copied."""
        return self._upload.send(self.tables)
