"""The per-step staging buffer: its format (defined here only), the pinned host buffers and the one
host-to-device copy per step.

Format (int32; regions sized by the padded token count ``T_pad`` and ``rows = min(T_pad,
max_num_reqs)`` (a batch never has more rows than tokens), so that a CUDA graph captured for one
``T_pad`` replays any step of that size)::

    header   [HEADER]      num_reqs B, num_tokens T, num_decodes, num_writes N, has_replay_start,
                           has_replay_end, 0, 0
    qsl      [rows + 1]    query_start_loc of the batch rows (decode first)
    seq_lens [rows + 1]
    slots    [rows + 1]    idx_mapping: request slot (block-table row) of each batch row
    replay_start [rows + 1] window floor per batch row (read when has_replay_start)
    replay_end   [rows + 1] write floor of prefix-cacheable groups per batch row (has_replay_end)
    tok_row  [T_pad + 1]   batch row of each token
    extra    [E, rows + 1] per-request arrays staged by channel builders (e.g. the indexer's cu)
    overlay  [G, rows, 3]  per (group, batch row): (lo, hi, payload offset) of the logical blocks
                           staged this step ([lo, hi) empty: nothing staged)
    writes   [N] values, then [N] flat destinations in the block-table buffer

Only ``[0, used)`` is copied. :class:`StageLayout` gives the offsets for one ``T_pad``; the fused
kernel receives them as runtime arguments, the host fills through the same numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["StageLayout", "StepStaging", "HEADER"]

HEADER = 8
H_NUM_REQS, H_NUM_TOKENS, H_NUM_DECODES, H_NUM_WRITES, H_REPLAY_START, H_REPLAY_END = range(6)


class StageLayout(NamedTuple):
    """Offsets (int32 elements) of every region for one padded token count."""

    t_pad: int
    rows: int
    qsl: int
    seq_lens: int
    slots: int
    replay_start: int
    replay_end: int
    tok_row: int
    extra: int
    overlay: int
    writes: int

    @classmethod
    def for_tokens(cls, t_pad: int, num_groups: int, num_extra: int, max_num_reqs: int) -> "StageLayout":
        rows = max(min(t_pad, max_num_reqs), 1)
        n = rows + 1
        qsl = HEADER
        seq = qsl + n
        slots = seq + n
        rs = slots + n
        re = rs + n
        tok = re + n
        extra = tok + t_pad + 1
        ov = extra + num_extra * n
        writes = ov + 3 * num_groups * rows
        return cls(t_pad, rows, qsl, seq, slots, rs, re, tok, extra, ov, writes)

    def extra_at(self, i: int) -> int:
        """Offset of extra array ``i``."""
        return self.extra + i * (self.rows + 1)

    def kernel_args(self):
        """The offsets the fused kernel takes, in its argument order."""
        return (self.rows, self.qsl, self.seq_lens, self.slots, self.replay_start, self.replay_end, self.tok_row,
                self.extra, self.overlay, self.writes)


class StepStaging:
    """Pinned host buffers (two, used in turn) + one device buffer, allocated once at capacity.

    Parameters
    ----------
    device : torch.device
    max_num_tokens : int
        Largest ``T_pad``.
    num_groups, num_extra : int
        Overlay groups and builder-staged per-request arrays.
    max_writes : int
        Block ids one step may stage (after ring trimming); a larger step is rejected.

    NOTE: a non-blocking copy from pinned memory reads the host buffer when the GPU gets to it; the
    buffer is reused two steps later, after waiting on that copy's event (rarely blocks).
    """

    def __init__(self, device: torch.device, max_num_tokens: int, num_groups: int, num_extra: int,
                 max_writes: int, max_num_reqs: int):
        self.device = device
        self.num_groups, self.num_extra, self.max_writes = num_groups, num_extra, max_writes
        self.max_num_reqs = max_num_reqs
        self.capacity = StageLayout.for_tokens(max_num_tokens, num_groups, num_extra,
                                               max_num_reqs).writes + 2 * max_writes
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.async_copy = pin
        self.host = [torch.zeros(self.capacity, dtype=torch.int32, pin_memory=pin) for _ in range(2 if pin else 1)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        self._dev_np = self.dev.numpy() if device.type == "cpu" else None  # NOTE: CPU: a plain memcpy
        # NOTE: one reusable event per host buffer (recorded after that buffer's copy)
        self._events = [torch.cuda.Event() for _ in self.host] if self.async_copy else [None] * len(self.host)
        self._recorded = [False] * len(self.host)
        self._cur = 0
        self._layouts = {}

    def layout(self, t_pad: int) -> StageLayout:
        lay = self._layouts.get(t_pad)
        if lay is None:
            lay = self._layouts[t_pad] = StageLayout.for_tokens(t_pad, self.num_groups, self.num_extra,
                                                                self.max_num_reqs)
        return lay

    def begin(self) -> np.ndarray:
        """The host buffer to fill for the next step (waits only while a copy still reads it)."""
        if self._recorded[self._cur]:
            ev = self._events[self._cur]
            if not ev.query():
                ev.synchronize()
            self._recorded[self._cur] = False
        return self.host_np[self._cur]

    def copy(self, used: int) -> None:
        """One host-to-device copy of ``[0, used)`` of the buffer filled since :meth:`begin`."""
        if self._dev_np is not None:
            self._dev_np[:used] = self.host_np[self._cur][:used]
            return
        host = self.host[self._cur]
        self.dev[:used].copy_(host[:used], non_blocking=self.async_copy)
        if self.async_copy:
            self._events[self._cur].record()
            self._recorded[self._cur] = True
            self._cur = (self._cur + 1) % len(self.host)
