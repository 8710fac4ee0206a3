"""The per-step staging: pinned host buffers, the one write pass that fills one of them (:mod:`.kernel`,
defined by :mod:`.naive`) and the one host-to-device copy per step. The format is :mod:`.format`."""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from ..._numba import compile_pinned, ready
from ...ops.indexer_lengths.naive import staged_cu
from ..plan import StepPlan
from .format import (H_NUM_DECODES, H_NUM_REQS, H_NUM_TOKENS, H_NUM_WRITES, H_REPLAY_END, H_REPLAY_START, HEADER,
                     OV_HI, OV_LO, OV_PAY, OVERLAY_STRIDE, ROW_ARRAY_PAD, W_DESTS, W_VALUES, WRITE_HALVES, StageLayout,
                     write_halves)
from .kernel import FIELDS, stage_step

__all__ = ["StageLayout", "StepStaging", "HEADER", "OVERLAY_STRIDE", "write_halves", "H_NUM_REQS", "H_NUM_TOKENS",
           "H_NUM_DECODES", "H_NUM_WRITES", "H_REPLAY_START", "H_REPLAY_END", "OV_LO", "OV_HI", "OV_PAY",
           "ROW_ARRAY_PAD", "W_VALUES", "W_DESTS", "WRITE_HALVES", "stage_args"]

_NONE = np.zeros(0, dtype=np.int64)


def stage_args(plan: StepPlan, tables, lay_vec: np.ndarray, scal: np.ndarray) -> tuple:
    """The arguments after ``h`` of the write pass (:func:`.kernel.stage_step`) for ``plan``; fills ``scal``."""
    scal[0], scal[1] = plan.num_tokens, plan.num_decodes
    scal[2], scal[3] = plan.replay_start is not None, plan.replay_end is not None
    scal[4] = tables.max_num_reqs
    return (tables.mirror, tables.geo, lay_vec, scal, plan.slots, plan.num_scheduled, plan.seq_lens,
            _NONE if plan.replay_start is None else plan.replay_start,
            _NONE if plan.replay_end is None else plan.replay_end, plan.w_gid, plan.w_slot, plan.w_start, plan.w_end,
            plan.w_keep, plan.w_row, plan.w_cu, plan.w_ids)


def _computed(fn) -> Optional[tuple]:
    """``(compress ratio, world, rank, interleave)`` of a staged input the write pass computes (a
    ``partial(staged_cu, ...)`` of keywords only), else None."""
    if isinstance(fn, partial) and fn.func is staged_cu and not fn.args:
        kw = fn.keywords
        return (int(kw["compress_ratio"]), int(kw.get("cp_world_size", 1)), int(kw.get("cp_rank", 0)),
                int(kw.get("cp_interleave", 1)))
    return None


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
        self._vectors: Dict[int, np.ndarray] = {}  # NOTE: T_pad -> vector(T_pad)
        self._inputs: Optional[Sequence[Callable]] = None  # NOTE: the staged inputs the vectors were built for
        self._called: List[tuple] = []  # NOTE: (k, fill) of the staged inputs the pass does not compute
        self._scal = np.zeros(5, dtype=np.int64)
        self.lay: Optional[StageLayout] = None  # layout of the last staged step
        self.host_qsl: Optional[np.ndarray] = None  # int64 [B + 1] host query_start_loc of the last staged step
        self.pending_writes = 0    # NOTE: ids staged by the last step and not applied on the device yet

    def layout(self, t_pad: int) -> StageLayout:
        lay = self._layouts.get(t_pad)
        if lay is None:
            lay = self._layouts[t_pad] = StageLayout.for_tokens(t_pad, self.num_groups, self.num_extra,
                                                                self.max_num_reqs)
        return lay

    def vector(self, t_pad: int, inputs: Sequence[Callable] = ()) -> np.ndarray:
        """int64: what the write pass reads of the layout of ``t_pad`` (:meth:`StageLayout.vector`), then the
        staged inputs it computes itself: their count and ``(k, compress ratio, world, rank, interleave)`` of
        each (those that are :func:`~dsv4_index.ops.indexer_lengths.naive.staged_cu`); the others are called."""
        if inputs is not self._inputs:
            self._inputs, self._vectors = inputs, {}
            self._called = [(k, fn) for k, fn in enumerate(inputs) if _computed(fn) is None]
        v = self._vectors.get(t_pad)
        if v is None:
            spec = [_computed(fn) for fn in inputs]
            ext = [(k, *x) for k, x in enumerate(spec) if x is not None]
            v = self._vectors[t_pad] = np.concatenate([self.layout(t_pad).vector(), [len(ext)],
                                                       np.asarray(ext, dtype=np.int64).reshape(-1)]).astype(np.int64)
        return v

    def stage(self, plan: StepPlan, tables, inputs: Sequence[Callable]) -> tuple:
        """Write one checked step into the next host buffer (one compiled pass: every region and the
        tables' host mirror) and copy it to the device.

        Parameters
        ----------
        plan : StepPlan — the accepted step (batch rows decode first).
        tables : BlockTables — geometry (``geo``) and the host mirror the pass updates.
        inputs : sequence of callables ``fn(seq_lens, num_scheduled, out)`` — per-request int32 arrays
            (``out`` has ``B + 1`` entries), in extra-array order.

        Returns ``(bytes copied, ids staged)``.
        """
        if not ready():
            compile_pinned()
        h = self.begin()
        lay = self.layout(plan.num_tokens_padded)
        vec = self._vectors.get(lay.t_pad) if inputs is self._inputs else None
        N, bad, i = stage_step(h, *stage_args(plan, tables, self.vector(lay.t_pad, inputs) if vec is None else vec,
                                              self._scal))
        N = int(N)
        if bad:  # NOTE: only a plan that bypassed the checks gets here
            raise RuntimeError(f"staging: {FIELDS[bad]} entry {i} is out of range (the plan was not checked)")
        B = plan.slots.shape[0]
        for k, fn in self._called:
            at = lay.extra_at(k)
            fn(plan.seq_lens, plan.num_scheduled, h[at:at + B + 1])
        self.host_qsl = h[lay.qsl:lay.qsl + B + 1].astype(np.int64)
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
