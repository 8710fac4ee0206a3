"""Block tables: a host mirror (numpy over pinned memory) edited row by row, and a device table
updated by ``commit()`` with one H2D copy of the rows changed since the last commit.

Packed update format (shared with the pipeline's own staging buffer, see :meth:`BlockTable.pack_updates`):
for ``k`` dirty rows, ``k`` int32 row ids followed by the ``k * width`` int32 entries of those rows;
``k * (width + 1) * 4`` bytes. The device side scatters them with one ``index_put_``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["BlockTable", "MultiGroupBlockTable"]

_INT32_MAX = np.iinfo(np.int32).max


def _check_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return int(v)


def _default_pin(pin_memory: Optional[bool]) -> bool:
    return torch.cuda.is_available() if pin_memory is None else bool(pin_memory)


class _Staging:
    """An int32 host buffer (pinned when asked) + a device twin, allocated once, reused per commit.

    NOTE: a non-blocking copy from pinned memory may still be reading the host buffer when the next
    commit packs into it; :meth:`wait` blocks on the event recorded after the previous copy.
    """

    def __init__(self, numel: int, device: torch.device, pin: bool):
        self.host = torch.empty(numel, dtype=torch.int32, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = torch.empty(numel, dtype=torch.int32, device=device)
        self.async_copy = pin and device.type == "cuda"
        self._event = None

    def wait(self):
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def copy(self, n: int):
        self.dev[:n].copy_(self.host[:n], non_blocking=self.async_copy)
        if self.async_copy:
            self._event = torch.cuda.Event()
            self._event.record()


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
        Pin the host mirror and the staging buffer (default: ``torch.cuda.is_available()``).

    Attributes
    ----------
    host : torch.Tensor
        int32 ``[max_num_reqs, width]`` host mirror (pinned when ``pin_memory``).
    np : numpy.ndarray
        int32 ``[max_num_reqs, width]`` view of ``host``.
    num_blocks : numpy.ndarray
        int32 ``[max_num_reqs]``: valid kernel blocks per row. Entries past a row's length are stale.
    device_table : torch.Tensor
        int32 ``[max_num_reqs, width]`` on ``device``, allocated once; equals ``host`` after ``commit()``.
    """

    def __init__(self, max_num_reqs: int, width: int, *, device, block_size: int,
                 blocks_per_kv_block: int = 1, pin_memory: Optional[bool] = None):
        self.max_num_reqs = _check_int("max_num_reqs", max_num_reqs)
        self.width = _check_int("width", width)
        self.block_size = _check_int("block_size", block_size)
        self.blocks_per_kv_block = _check_int("blocks_per_kv_block", blocks_per_kv_block)
        self.device = torch.device(device)
        self.pin_memory = _default_pin(pin_memory)
        self.host = torch.zeros((self.max_num_reqs, self.width), dtype=torch.int32,
                                pin_memory=self.pin_memory)
        self.np = self.host.numpy()
        self.num_blocks = np.zeros(self.max_num_reqs, dtype=np.int32)
        self._device_table = torch.zeros((self.max_num_reqs, self.width), dtype=torch.int32,
                                         device=self.device)
        self._dirty = np.zeros(self.max_num_reqs, dtype=bool)
        self._staging: Optional[_Staging] = None  # allocated at first commit(), at capacity
        if self.blocks_per_kv_block > 1:
            self._kernel_offsets = np.arange(self.blocks_per_kv_block, dtype=np.int64)

    # ------------------------------------------------------------------------------------------
    @property
    def device_table(self) -> torch.Tensor:
        """int32 ``[max_num_reqs, width]`` device table (same object for the table's lifetime)."""
        return self._device_table

    @property
    def num_dirty(self) -> int:
        """Rows changed since the last commit / pack."""
        return int(np.count_nonzero(self._dirty))

    def packed_numel(self, num_rows: Optional[int] = None) -> int:
        """int32 elements of the packed update of ``num_rows`` rows (default: the dirty rows)."""
        k = self.num_dirty if num_rows is None else num_rows
        return k * (self.width + 1)

    def row(self, row: int) -> np.ndarray:
        """int32 ``[num_blocks[row]]`` view of the valid part of a host row."""
        row = self._check_row("row", row)
        return self.np[row, : self.num_blocks[row]]

    # ------------------------------------------------------------------------------------------
    def _check_row(self, name: str, row) -> int:
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.max_num_reqs:
            raise ValueError(f"{name} must be an int in [0, {self.max_num_reqs}), got {row!r}")
        return int(row)

    def _expand(self, block_ids, row: int) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() > (_INT32_MAX - self.blocks_per_kv_block + 1)
                         // self.blocks_per_kv_block):
            raise ValueError(f"block_ids of row {row} must be >= 0 and fit int32 as kernel-block ids")
        f = self.blocks_per_kv_block
        if f > 1:
            ids = (ids[:, None] * f + self._kernel_offsets).reshape(-1)
        return ids

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Set row ``row`` to ``block_ids`` (allocation block ids; expanded when ``f > 1``)."""
        row = self._check_row("row", row)
        ids = self._expand(block_ids, row)
        if ids.size > self.width:
            raise ValueError(f"row {row}: {ids.size} kernel blocks exceed the table width {self.width}")
        self.np[row, : ids.size] = ids
        self.num_blocks[row] = ids.size
        self._dirty[row] = True

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Append ``block_ids`` after the row's current ``num_blocks[row]`` entries."""
        row = self._check_row("row", row)
        ids = self._expand(block_ids, row)
        if ids.size == 0:
            return
        start = int(self.num_blocks[row])
        end = start + ids.size
        if end > self.width:
            raise ValueError(f"row {row}: appending {ids.size} kernel blocks to {start} exceeds the "
                             f"table width {self.width}")
        self.np[row, start:end] = ids
        self.num_blocks[row] = end
        self._dirty[row] = True

    def clear_row(self, row: int) -> None:
        """Set the row's length to 0 (entries are left stale; nothing to send to the device)."""
        row = self._check_row("row", row)
        self.num_blocks[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` into row ``dst`` (``src`` is left as is)."""
        src, dst = self._check_row("src", src), self._check_row("dst", dst)
        if src == dst:
            return
        n = int(self.num_blocks[src])
        self.np[dst, :n] = self.np[src, :n]
        self.num_blocks[dst] = n
        self._dirty[dst] = True

    def swap_row(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b``."""
        a, b = self._check_row("a", a), self._check_row("b", b)
        if a == b:
            return
        n = int(max(self.num_blocks[a], self.num_blocks[b]))
        self.np[[a, b], :n] = self.np[[b, a], :n]
        self.num_blocks[[a, b]] = self.num_blocks[[b, a]]
        self._dirty[[a, b]] = True

    def mark_all_dirty(self) -> None:
        """Send every row at the next commit (e.g. after editing ``np`` directly)."""
        self._dirty[:] = True

    # ------------------------------------------------------------------------------------------
    def pack_updates(self, buf: np.ndarray, offset: int = 0) -> int:
        """Pack the dirty rows into ``buf`` and mark them clean.

        Parameters
        ----------
        buf : numpy.ndarray
            int32 1-D buffer (typically a view of a pinned staging tensor).
        offset : int
            First element to write.

        Returns
        -------
        int
            ``k``, the rows packed: ``buf[offset : offset + k]`` holds their row ids and
            ``buf[offset + k : offset + k * (width + 1)]`` their entries, row after row.
        """
        rows = np.flatnonzero(self._dirty)
        k = rows.size
        if k == 0:
            return 0
        end = offset + k * (self.width + 1)
        if buf.dtype != np.int32 or buf.ndim != 1 or end > buf.size:
            raise ValueError(f"buf must be a 1-D int32 array with at least {end} elements")
        buf[offset: offset + k] = rows
        np.take(self.np, rows, axis=0, out=buf[offset + k: end].reshape(k, self.width), mode="clip")
        self._dirty[rows] = False
        return k

    def apply_packed(self, dev_buf: torch.Tensor, offset: int, num_rows: int) -> None:
        """Scatter ``num_rows`` rows packed at ``dev_buf[offset:]`` (device copy of a
        :meth:`pack_updates` output) into the device table with one ``index_put_``."""
        if num_rows == 0:
            return
        ids = dev_buf[offset: offset + num_rows]
        data = dev_buf[offset + num_rows: offset + num_rows * (self.width + 1)].view(num_rows, self.width)
        self._device_table.index_put_((ids,), data)

    def pending_updates(self) -> Tuple[np.ndarray, np.ndarray]:
        """Dirty rows and their entries, marked clean: (int32 ``[k]``, int32 ``[k, width]``) copies."""
        rows = np.flatnonzero(self._dirty).astype(np.int32)
        data = self.np[rows]
        self._dirty[rows] = False
        return rows, data

    def apply_device_updates(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """Scatter rows (int32/int64 ``[k]``) with entries (int32 ``[k, width]``), both on the device."""
        if rows.numel():
            self._device_table.index_put_((rows,), data)

    def commit(self) -> int:
        """Send the rows changed since the last commit with one H2D copy; returns the bytes copied
        (``4 * k * (width + 1)`` for ``k`` changed rows, 0 when nothing changed)."""
        if not self._dirty.any():
            return 0
        if self._staging is None:
            self._staging = _Staging(self.max_num_reqs * (self.width + 1), self.device, self.pin_memory)
        st = self._staging
        st.wait()
        k = self.pack_updates(st.np, 0)
        n = k * (self.width + 1)
        st.copy(n)
        self.apply_packed(st.dev, 0, k)
        return 4 * n


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
        self.pin_memory = _default_pin(pin_memory)
        self.tables: List[BlockTable] = [
            BlockTable(max_num_reqs, w, device=self.device, block_size=bs, blocks_per_kv_block=f,
                       pin_memory=self.pin_memory) for (w, bs, f) in params]
        self.max_num_reqs = self.tables[0].max_num_reqs
        self._staging: Optional[_Staging] = None

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

    def packed_numel(self) -> int:
        """int32 elements the dirty rows of every group take when packed."""
        return sum(t.packed_numel() for t in self.tables)

    def commit(self) -> int:
        """Send the changed rows of every group with ONE H2D copy; returns the bytes copied."""
        if not any(t._dirty.any() for t in self.tables):
            return 0
        if self._staging is None:
            cap = sum(t.max_num_reqs * (t.width + 1) for t in self.tables)
            self._staging = _Staging(cap, self.device, self.pin_memory)
        st = self._staging
        st.wait()
        offset, packed = 0, []
        for t in self.tables:
            k = t.pack_updates(st.np, offset)
            packed.append((offset, k))
            offset += k * (t.width + 1)
        st.copy(offset)
        for t, (off, k) in zip(self.tables, packed):
            t.apply_packed(st.dev, off, k)
        return 4 * offset
