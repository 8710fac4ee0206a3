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
kernel receives them as runtime arguments (``StageLayout.kernel_args``) and imports every other fact of
the format from here: the header fields (``H_*``), the per-batch-row stride (``rows + ROW_ARRAY_PAD``),
the overlay record (``OVERLAY_STRIDE``, ``OV_LO``, ``OV_HI``, ``OV_PAY``) and the halves of the writes
region (``W_VALUES``, ``W_DESTS``: half ``k`` is ``[writes + k * N, writes + (k + 1) * N)``). One writer
(:meth:`StepStaging.stage`, with :meth:`BlockTables.stage_writes` for the write regions), one reader
(``fused/kernel.py``).
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .plan import StepPlan

__all__ = ["StageLayout", "StepStaging", "HEADER", "OVERLAY_STRIDE", "write_halves"]

HEADER = 8
H_NUM_REQS, H_NUM_TOKENS, H_NUM_DECODES, H_NUM_WRITES, H_REPLAY_START, H_REPLAY_END = range(6)
OVERLAY_STRIDE = 3                     # NOTE: int32 per (group, batch row) overlay record
OV_LO, OV_HI, OV_PAY = 0, 1, 2         # fields of an overlay record
ROW_ARRAY_PAD = 1                      # NOTE: a per-batch-row array holds rows + 1 int32 (qsl's closing entry)
W_VALUES, W_DESTS = 0, 1               # halves of the writes region, N int32 each
WRITE_HALVES = 2


def write_halves(h, writes: int, n: int):
    """``(values, destinations)``: the two halves of the writes region of staging buffer ``h`` (int32, the
    region starting at element ``writes``) for ``n`` staged writes, as views to fill."""
    return (h[writes + W_VALUES * n:writes + (W_VALUES + 1) * n],
            h[writes + W_DESTS * n:writes + (W_DESTS + 1) * n])


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
        n = rows + ROW_ARRAY_PAD
        qsl = HEADER
        seq = qsl + n
        slots = seq + n
        rs = slots + n
        re = rs + n
        tok = re + n
        extra = tok + t_pad + 1
        ov = extra + num_extra * n
        writes = ov + OVERLAY_STRIDE * num_groups * rows
        return cls(t_pad, rows, qsl, seq, slots, rs, re, tok, extra, ov, writes)

    def extra_at(self, i: int) -> int:
        """Offset of extra array ``i``."""
        return self.extra + i * (self.rows + ROW_ARRAY_PAD)

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
                                               max_num_reqs).writes + WRITE_HALVES * max_writes
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.async_copy = pin
        self.host = [torch.zeros(self.capacity, dtype=torch.int32, pin_memory=pin) for _ in range(2 if pin else 1)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        self._dev_np = self.dev.numpy() if device.type == "cpu" else None  # NOTE: CPU: a plain memcpy
        # NOTE: one reusable event per host buffer (recorded after that buffer's copy)
        self._events: List[Optional[torch.cuda.Event]] = (
            [torch.cuda.Event() for _ in self.host] if self.async_copy else [None] * len(self.host))
        self._recorded = [False] * len(self.host)
        self._cur = 0
        self._layouts: Dict[int, StageLayout] = {}
        self._header = np.zeros(HEADER, dtype=np.int32)
        # NOTE: per host buffer, the batch signature whose qsl / slots / tok_row it holds
        self._holds: List[Optional[Hashable]] = [None] * len(self.host)
        # NOTE: per host buffer, the (T_pad, q bytes) its qsl / tok_row hold
        self._q_holds: List[Optional[Tuple[int, bytes]]] = [None] * len(self.host)
        self._host_q: Optional[Tuple[int, bytes]] = None  # NOTE: the (T_pad, q bytes) of host_qsl
        self._host_sig: Optional[Hashable] = None  # NOTE: the batch signature of host_qsl
        self._rows = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)
        self.lay: Optional[StageLayout] = None  # layout of the last staged step
        self.host_qsl: Optional[np.ndarray] = None  # int64 [B + 1] host query_start_loc of the last staged step
        self.pending_writes = 0    # NOTE: ids staged by the last step and not applied on the device yet

    def layout(self, t_pad: int) -> StageLayout:
        lay = self._layouts.get(t_pad)
        if lay is None:
            lay = self._layouts[t_pad] = StageLayout.for_tokens(t_pad, self.num_groups, self.num_extra,
                                                                self.max_num_reqs)
        return lay

    def stage(self, plan: StepPlan, tables, inputs: Sequence[Callable], signature: Optional[Hashable] = None) -> tuple:
        """Write one checked step into the next host buffer and copy it to the device.

        Parameters
        ----------
        plan : StepPlan — the accepted step (batch rows decode first).
        tables : BlockTables — stages the write regions and the overlay (:meth:`BlockTables.stage_writes`).
        inputs : sequence of callables ``fn(seq_lens, num_scheduled, out)`` — per-request int32 arrays
            (``out`` has ``B + 1`` entries), in extra-array order.
        signature : hashable or None — equal signatures promise equal ``qsl`` / ``slots`` / ``tok_row``
            (a steady batch): a buffer already holding them is not rewritten.

        Returns ``(bytes copied, ids staged)``.
        """
        h = self.begin()
        lay = self.layout(plan.num_tokens_padded)
        B, T, q = plan.slots.shape[0], plan.num_tokens, plan.num_scheduled
        hd = self._header
        hd[H_NUM_REQS], hd[H_NUM_TOKENS], hd[H_NUM_DECODES] = B, T, plan.num_decodes
        hd[H_REPLAY_START] = plan.replay_start is not None
        hd[H_REPLAY_END] = plan.replay_end is not None
        sig = None if signature is None else (signature, lay.t_pad)
        qsl = h[lay.qsl:lay.qsl + B + 1]
        if sig is None or self._holds[self._cur] != sig:
            # NOTE: qsl and tok_row depend on (T_pad, q) only: kept while the counts repeat (rows may change)
            qkey = (lay.t_pad, q.tobytes())
            if self._q_holds[self._cur] != qkey:
                qsl[0] = 0
                qsl[1:] = np.add.accumulate(q)  # NOTE: int64 then one cast (an int32 out= of cumsum costs 3x)
                h[lay.tok_row:lay.tok_row + T] = self._rows[:B] if T == B else np.repeat(self._rows[:B], q)
                self._q_holds[self._cur] = qkey
            if self._host_q != qkey:
                self.host_qsl = qsl.astype(np.int64)
                self._host_q = qkey
            h[lay.slots:lay.slots + B] = plan.slots
            self._holds[self._cur] = sig
        elif self._host_sig != sig:  # NOTE: the buffer holds this batch; host_qsl was another step's
            self.host_qsl = qsl.astype(np.int64)
            self._host_q = None
        self._host_sig = sig
        h[lay.seq_lens:lay.seq_lens + B] = plan.seq_lens
        if plan.replay_start is not None:
            h[lay.replay_start:lay.replay_start + B] = plan.replay_start
        if plan.replay_end is not None:
            h[lay.replay_end:lay.replay_end + B] = plan.replay_end
        for i, fn in enumerate(inputs):
            at = lay.extra_at(i)
            fn(plan.seq_lens, q, h[at:at + B + 1])
        N = tables.stage_writes(plan, h, lay)
        hd[H_NUM_WRITES] = N
        h[:HEADER] = hd
        used = lay.writes + WRITE_HALVES * N
        self.copy(used)
        self.lay, self.pending_writes = lay, N
        return 4 * used, N

    def stage_writes_only(self, vals: np.ndarray, dst: np.ndarray) -> int:
        """Stage block-id writes without a step (tables edited row by row outside a pipeline,
        :mod:`dsv4_index.block_table`): the header (``N`` only), the values and flat destinations in
        the writes region of the ``T_pad = 0`` layout; one H2D copy. :meth:`apply_pending` applies
        them. Returns the bytes copied."""
        N = vals.shape[0]
        if N > self.max_writes:
            raise ValueError(f"{N} block ids to stage, more than the staging holds ({self.max_writes})")
        h = self.begin()
        lay = self.layout(0)
        h[:HEADER] = 0
        h[H_NUM_WRITES] = N
        w = lay.writes
        h[w + W_VALUES * N:w + (W_VALUES + 1) * N] = vals
        h[w + W_DESTS * N:w + (W_DESTS + 1) * N] = dst
        self._holds[self._cur] = None  # NOTE: the step regions of this buffer were not written
        self._q_holds[self._cur] = None
        used = w + WRITE_HALVES * N
        self.copy(used)
        self.lay, self.pending_writes = lay, N
        return 4 * used

    def apply_pending(self, flat: torch.Tensor) -> None:
        """Apply the block ids staged by the last step to the device tables ``flat`` (torch ops, no
        host sync): the unfused path, or a staged step that was never built."""
        lay, N = self.lay, self.pending_writes
        if N:
            assert lay is not None  # NOTE: N > 0 only after a stage(), which sets lay
            w = lay.writes
            vals = self.dev[w + W_VALUES * N:w + (W_VALUES + 1) * N]
            flat[self.dev[w + W_DESTS * N:w + (W_DESTS + 1) * N].long()] = vals
        self.pending_writes = 0

    def applied(self) -> None:
        """The fused launch applied the staged writes itself."""
        self.pending_writes = 0

    def begin(self) -> np.ndarray:
        """The host buffer to fill for the next step (waits only while a copy still reads it)."""
        if self._recorded[self._cur]:
            ev = self._events[self._cur]
            assert ev is not None  # NOTE: recorded only on the async (CUDA) path, which has events
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
            ev = self._events[self._cur]
            assert ev is not None  # NOTE: async_copy: one event per host buffer
            ev.record()
            self._recorded[self._cur] = True
            self._cur = (self._cur + 1) % len(self.host)
