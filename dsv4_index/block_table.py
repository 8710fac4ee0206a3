"""Row-editing block tables (add / append / move / swap / clear rows, incremental commits) for engines
that keep their own rows: a thin facade over the pipeline's tables, :mod:`dsv4_index.state`.

One implementation (the pipeline's): the storage is a :class:`dsv4_index.state.BlockTables` (host mirror,
device table, block counts, one flat device buffer for every group of a
:class:`MultiGroupBlockTable`) and a commit goes through the pipeline's staging buffer,
:class:`dsv4_index.state.StepStaging` (``stage_writes_only``: the changed entries as ``(value, flat
destination)`` pairs, ONE host-to-device copy, applied on the device by ``apply_pending``). This module
adds only what the pipeline does not need: the row operations, whose rows may move, and their dirty
ranges. :class:`~dsv4_index.MetadataPipeline` keeps rows in place (slots) and stages its writes itself.

Dirty tracking is per row: one column range ``[lo, hi)`` (empty when ``lo >= hi``) covering every
entry of the row's valid prefix ``[0, num_blocks)`` that changed since the last commit. ``append_row``
marks only the new columns; ``add_row`` / ``move_row`` / ``swap_row`` mark the new valid prefix of the
rows they rewrite (stale columns past ``num_blocks`` are never read, so they are never sent). A commit
sends ``4 * (W + 2 * n)`` bytes for ``n`` changed entries (``W``: the staging format's fixed part,
``state/staging.py``).

Segment export (for an engine with its own transfer; the commit does not use it):
:meth:`BlockTable.pack_segments` writes ``k`` descriptors of ``SEGMENT_INTS = 4`` int32 ``(row, col_lo,
n, payload_offset)`` then the payloads, ``n`` int32 entries each, contiguous in descriptor order
(``payload_offset`` absolute in the buffer); :func:`apply_segments` applies them with torch ops.

NOTE: over 400 lines because of the public row API (seven operations, each with its checks and
dirty ranges) and the segment export; the storage and the transfer are ``state/``'s.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .geometry import GroupSpec
from .state import BlockTables, StepStaging

__all__ = ["BlockTable", "MultiGroupBlockTable", "SEGMENT_INTS", "apply_segments"]

_INT32_MAX = np.iinfo(np.int32).max
SEGMENT_INTS = 4  # (row, col_lo, n, payload_offset)


def _check_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return int(v)


def _store(params, max_num_reqs: int, device: torch.device) -> BlockTables:
    """State tables of plain groups ``(width, block_size, f)`` (no ring, no window: rows of ``width``)."""
    groups = [GroupSpec(gid=g, name=f"table{g}", kind="full", block_size=bs, window=None, prefix_cacheable=False,
                        table_width=w, blocks_per_kv_block=f, sharded=False) for g, (w, bs, f) in enumerate(params)]
    return BlockTables(groups, max_num_reqs, 1, device, [1] * len(groups))


class _Commit:
    """The shared store and its staging buffer (allocated at the first commit, at capacity)."""

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


def apply_segments(table: torch.Tensor, dev_buf: torch.Tensor, offset: int, num_segments: int,
                   payload_numel: int) -> None:
    """Write ``num_segments`` segments packed at ``dev_buf[offset:]`` (a device copy of a
    :meth:`BlockTable.pack_segments` output) into ``table`` with torch ops (no host sync).

    Parameters
    ----------
    table : torch.Tensor
        int32 ``[rows, width]`` contiguous device table.
    dev_buf : torch.Tensor
        int32 1-D device buffer holding descriptors and payloads (offsets absolute in it).
    offset, num_segments, payload_numel : int
        Host-known: first descriptor, descriptors, payload entries (sum of ``n``).
    """
    if num_segments == 0 or payload_numel == 0:
        return
    k = num_segments
    d = dev_buf[offset: offset + SEGMENT_INTS * k].view(k, SEGMENT_INTS).long()
    rows, lo, n, pay = d.unbind(1)
    dev = dev_buf.device
    # NOTE: segment of each payload entry = number of piece starts at or before it, minus one
    starts = pay - pay[:1]
    seg = torch.zeros(payload_numel, dtype=torch.int64, device=dev)
    seg.index_add_(0, starts[1:], torch.ones_like(starts[1:]))
    seg = seg.cumsum_(0)
    e = torch.arange(payload_numel, device=dev)
    # NOTE: payloads are contiguous in descriptor order: entry e of the run is column lo + e - (pay - pay0)
    dst = (rows * table.stride(0) + lo - pay + pay[:1])[seg] + e
    pay0 = offset + SEGMENT_INTS * k
    table.view(-1).index_copy_(0, dst, dev_buf[pay0: pay0 + payload_numel])


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
    pin_memory : bool, optional
        Accepted for compatibility: the transfer buffers (the staging's) are pinned whenever the
        device is CUDA; the host mirror is the state tables' (not pinned).

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
        allocated once; its valid prefix ``[r, :num_blocks[r]]`` equals the host's after ``commit()``.
    """

    def __init__(self, max_num_reqs: int, width: int, *, device, block_size: int,
                 blocks_per_kv_block: int = 1, pin_memory: Optional[bool] = None, _shared=None):
        self.max_num_reqs = _check_int("max_num_reqs", max_num_reqs)
        self.width = _check_int("width", width)
        self.block_size = _check_int("block_size", block_size)
        self.blocks_per_kv_block = _check_int("blocks_per_kv_block", blocks_per_kv_block)
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        if _shared is None:
            _shared = (_Commit(_store([(self.width, self.block_size, self.blocks_per_kv_block)],
                                      self.max_num_reqs, self.device)), 0)
        self._commit, gid = _shared
        store = self._commit.store
        self._base = int(store.base[gid])
        self.np = store.mirrors[gid]
        self.host = torch.from_numpy(self.np)
        self.num_blocks = store.num_blocks[gid]
        self._device_table = store.tables[gid]
        self.dirty_lo = np.zeros(self.max_num_reqs, dtype=np.int32)
        self.dirty_hi = np.zeros(self.max_num_reqs, dtype=np.int32)
        if self.blocks_per_kv_block > 1:
            self._kernel_offsets = np.arange(self.blocks_per_kv_block, dtype=np.int64)

    # ------------------------------------------------------------------------------------------
    @property
    def device_table(self) -> torch.Tensor:
        """int32 ``[max_num_reqs, width]`` device table (same object for the table's lifetime)."""
        return self._device_table

    @property
    def staging(self) -> Optional[StepStaging]:
        """The state staging buffer commits go through (shared by the groups of a
        :class:`MultiGroupBlockTable`; None before the first commit)."""
        return self._commit.staging

    @property
    def num_dirty(self) -> int:
        """Rows changed since the last commit / pack."""
        return int(np.count_nonzero(self.dirty_hi > self.dirty_lo))

    def segments_numel(self, max_piece: Optional[int] = None) -> Tuple[int, int]:
        """(descriptors, payload entries) that :meth:`pack_segments` would write now."""
        n = (self.dirty_hi - self.dirty_lo).astype(np.int64)
        n = n[n > 0]
        k = n.size if max_piece is None else int(((n + max_piece - 1) // max_piece).sum())
        return k, int(n.sum())

    def row(self, row: int) -> np.ndarray:
        """int32 ``[num_blocks[row]]`` view of the valid part of a host row."""
        row = self._check_row("row", row)
        return self.np[row, : self.num_blocks[row]]

    # ------------------------------------------------------------------------------------------
    def _check_row(self, name: str, row) -> int:
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.max_num_reqs:
            raise ValueError(f"{name} must be an int in [0, {self.max_num_reqs}), got {row!r}")
        return int(row)

    def _expand(self, block_ids, row: int):
        if self.blocks_per_kv_block == 1 and type(block_ids) is list and len(block_ids) <= 8:
            # NOTE: fast path for the few ids a running request appends per step (no numpy round trip)
            if block_ids and (min(block_ids) < 0 or max(block_ids) > _INT32_MAX):
                raise ValueError(f"block_ids of row {row} must be >= 0 and fit int32 as kernel-block ids")
            return block_ids
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() > (_INT32_MAX - self.blocks_per_kv_block + 1)
                         // self.blocks_per_kv_block):
            raise ValueError(f"block_ids of row {row} must be >= 0 and fit int32 as kernel-block ids")
        f = self.blocks_per_kv_block
        if f > 1:
            ids = (ids[:, None] * f + self._kernel_offsets).reshape(-1)
        return ids

    def _mark_prefix(self, row: int, n: int) -> None:
        self.dirty_lo[row] = 0
        self.dirty_hi[row] = n

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
        f = self.blocks_per_kv_block
        if counts.shape != rows.shape or (counts.size and counts.min() < 0) or ids.size != int(counts.sum()):
            raise ValueError(f"counts must hold one count >= 0 per row and sum to len(block_ids) = {ids.size}")
        if rows.size and (rows.min() < 0 or rows.max() >= self.max_num_reqs or np.unique(rows).size != rows.size):
            raise ValueError(f"rows must be distinct ints in [0, {self.max_num_reqs}), got {rows.tolist()}")
        if ids.size and (ids.min() < 0 or ids.max() > (_INT32_MAX - f + 1) // f):
            raise ValueError("block_ids must be >= 0 and fit int32 as kernel-block ids")
        start = self.num_blocks[rows].astype(np.int64)
        n = counts * f
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
            # NOTE: entry e of row i goes to column start[i] + (e - first entry of row i) (times f, plus j)
            first = np.cumsum(counts) - counts
            r = np.repeat(rows, counts)
            col = np.repeat(start - first * f, counts) + np.arange(ids.size) * f
            if f > 1:
                col = (col[:, None] + self._kernel_offsets).reshape(-1)
                r = np.repeat(r, f)
                ids = (ids[:, None] * f + self._kernel_offsets).reshape(-1)
            self.np[r, col] = ids
            end = start + counts * f
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

    def _clean(self, rows=None) -> None:
        if rows is None:
            self.dirty_lo[:] = 0
            self.dirty_hi[:] = 0
        else:
            self.dirty_lo[rows] = 0
            self.dirty_hi[rows] = 0

    # ------------------------------------------------------------------------------------------
    def pack_segments(self, buf: np.ndarray, offset: int = 0, *, max_piece: Optional[int] = None,
                      rows_out: Optional[np.ndarray] = None) -> Tuple[int, int]:
        """Pack the dirty column ranges into ``buf`` (segment format, module docstring); mark clean.

        Parameters
        ----------
        buf : numpy.ndarray
            int32 1-D buffer (typically a view of a pinned staging array).
        offset : int
            First element to write: ``k`` descriptors at ``buf[offset : offset + 4k]``, then the payload.
        max_piece : int, optional
            Split a row's range into descriptors of at most this many columns (payload unchanged).

        Returns
        -------
        (int, int)
            ``k`` descriptors written and the end offset (``offset + 4k + sum(n)``).
        """
        k, end, rows, _, _ = self._pack(buf, offset, max_piece)
        if rows_out is not None:
            rows_out[: rows.size] = rows
        return k, end

    def _pack(self, buf: np.ndarray, offset: int, max_piece: Optional[int]):
        """:meth:`pack_segments`; also returns the dirty rows (ascending) and their int64 ``lo``, ``n``."""
        lo, hi = self.dirty_lo, self.dirty_hi
        rows = np.flatnonzero(hi > lo)
        if rows.size == 0:
            return 0, offset, rows, rows, rows
        r_lo = lo[rows].astype(np.int64)
        r_n = hi[rows] - r_lo
        if max_piece is not None and int(r_n.max()) > max_piece:
            pieces = (r_n + max_piece - 1) // max_piece
            seg = np.repeat(np.arange(rows.size), pieces)
            first = np.cumsum(pieces) - pieces
            j = (np.arange(seg.size) - first[seg]) * max_piece
            d_row, d_lo, d_n = rows[seg], r_lo[seg] + j, np.minimum(r_n[seg] - j, max_piece)
        else:
            d_row, d_lo, d_n = rows, r_lo, r_n
        k, total = d_row.size, int(r_n.sum())
        pay = offset + SEGMENT_INTS * k
        end = pay + total
        if buf.dtype != np.int32 or buf.ndim != 1 or end > buf.size or end > _INT32_MAX:
            raise ValueError(f"buf must be a 1-D int32 array with at least {end} elements")
        d = buf[offset: pay].reshape(k, SEGMENT_INTS)
        d[:, 0] = d_row
        d[:, 1] = d_lo
        d[:, 2] = d_n
        starts = np.cumsum(d_n) - d_n
        d[:, 3] = starts + pay
        # payload: the ranges of the table, flattened (entry e of piece i: column d_lo[i] + e - starts[i])
        src = np.repeat(d_row * self.width + d_lo - starts, d_n) + np.arange(total)
        np.take(self.np.reshape(-1), src, out=buf[pay:end])
        lo[rows] = 0
        hi[rows] = 0
        return k, end, rows, r_lo, r_n

    def _dirty_offsets(self) -> Optional[np.ndarray]:
        """int64 flat offsets (in the state tables' buffer) of every dirty entry, or None."""
        lo, hi = self.dirty_lo, self.dirty_hi
        rows = np.flatnonzero(hi > lo)
        if rows.size == 0:
            return None
        r_lo = lo[rows].astype(np.int64)
        n = hi[rows] - r_lo
        first = np.cumsum(n) - n
        return np.repeat(self._base + rows * self.width + r_lo - first, n) + np.arange(int(n.sum()))

    def commit(self) -> int:
        """Send the entries changed since the last commit with one H2D copy through the state staging
        buffer (applied on the device, no host sync); returns the bytes copied (0 when nothing changed)."""
        return self._commit.send([self])


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
    pin_memory : bool, optional
        As in :class:`BlockTable`.
    """

    def __init__(self, groups, max_num_reqs: int, device, *, pin_memory: Optional[bool] = None):
        if hasattr(groups, "groups"):
            groups = groups.groups
        params = [_group_params(g) for g in groups]
        if not params:
            raise ValueError("groups must not be empty")
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        params = [(_check_int("width", w), _check_int("block_size", bs), _check_int("blocks_per_kv_block", f))
                  for (w, bs, f) in params]
        # NOTE: one state store (one flat device buffer) for every group: one copy per commit
        self._commit = _Commit(_store(params, _check_int("max_num_reqs", max_num_reqs), self.device))
        self.tables: List[BlockTable] = [
            BlockTable(max_num_reqs, w, device=self.device, block_size=bs, blocks_per_kv_block=f,
                       pin_memory=pin_memory, _shared=(self._commit, g)) for g, (w, bs, f) in enumerate(params)]
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
        for t, ids in zip(self.tables, self._per_gid("block_ids_per_gid", block_ids_per_gid)):
            t.add_row(ids, row)

    def append_row(self, block_ids_per_gid, row: int) -> None:
        for t, ids in zip(self.tables, self._per_gid("block_ids_per_gid", block_ids_per_gid)):
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

    @property
    def device_tables(self) -> List[torch.Tensor]:
        return [t.device_table for t in self.tables]

    def capacity_numel(self, max_piece: Optional[int] = None) -> int:
        """int32 elements the segments of every group can take at most (every row fully dirty)."""
        cap = 0
        for t in self.tables:
            pieces = 1 if max_piece is None else -(-t.width // max_piece)
            cap += t.max_num_reqs * (t.width + SEGMENT_INTS * pieces)
        return cap

    def commit(self) -> int:
        """Send the changed entries of every group with ONE H2D copy; returns the bytes copied."""
        return self._commit.send(self.tables)
