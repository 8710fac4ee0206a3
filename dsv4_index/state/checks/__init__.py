"""The checks of one step, before anything changes: :class:`StepChecks` turns a :class:`StepBatch` into a
:class:`~dsv4_index.state.plan.StepPlan` or raises the :class:`~dsv4_index.state.messages.Rejection` that
names the culprit. One planner for every step: the array conversions (dtypes, shapes) here, every
``"safe"`` check in one compiled pass (:mod:`.kernel`; its definition, by whole-step numpy, is
:mod:`.naive`), then ``"full"`` in a second compiled pass (:func:`.kernel.full_step`; its definition
:func:`.naive.full_checks`). Nothing here writes state; the levels are docs/DESIGN.md §5.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ..._numba import compile_pinned, numba, ready
from ...batch import StepBatch
from ..messages import reject
from ..plan import StepPlan
from .._index import window_start
from .kernel import _LENGTHS, CODES, FULL_CODES, HEAD, LIM, check_step, full_step, out_size
from .naive import arr, null_block_message

__all__ = ["StepChecks"]

_EMPTY = np.zeros(0, dtype=np.int64)
_CU0 = np.zeros(1, dtype=np.int64)
_NATIVE = not numba.config.DISABLE_JIT  # NOTE: interpreted, the pass would take any type: always convert
_NO_NEW: Dict[int, np.ndarray] = {}


def _no_new(n: int) -> np.ndarray:
    """bool ``[n]`` zeros, read-only, shared between steps (``is_new`` None)."""
    a = _NO_NEW.get(n)
    if a is None:
        if len(_NO_NEW) > 64:
            _NO_NEW.clear()
        a = _NO_NEW[n] = np.zeros(n, dtype=bool)
        a.flags.writeable = False
    return a
_NAMES = ("req_slots", "free_slots", "write_gids", "write_slots")
_WHAT = ("a slot", "a slot", "a group", "a slot")


class StepChecks:
    """The check pass of a pipeline: geometry stacked once (``geo``, ``comp``, ``lim``: :mod:`.kernel`)."""

    def __init__(self, tables, *, cp, max_num_tokens: int, max_writes: int, next_n: int, level: str):
        self.tables, self.cp, self.level = tables, tuple(cp), level
        t = tables
        sharded = t.sharded & (cp[0] > 1)
        cols = (t.bs, t.window, t.ring, t.circular, t.logical, t.f, t.id_max, sharded)
        self.geo = np.ascontiguousarray(np.stack([np.asarray(c, dtype=np.int64) for c in cols], axis=1)
                                        if len(t.groups) else np.zeros((0, 8), dtype=np.int64))
        self.comp = np.asarray(list(t.compressed) or np.zeros((0, 3)), dtype=np.int64).reshape(-1, 3)
        sliding = ~t.full & ~t.circular
        fcols = (t.full, t.circular, sliding, t.base, t.cols, t.f, t.bs, t.window, sharded)  # NOTE: kernel.FGEO
        self.fgeo = np.ascontiguousarray(np.stack([np.asarray(c, dtype=np.int64) for c in fcols], axis=1)
                                         if len(t.groups) else np.zeros((0, 9), dtype=np.int64))
        self._err = np.zeros(8, dtype=np.int64)
        self.lim = np.zeros(len(LIM), dtype=np.int64)
        self.lim[:11] = (t.max_num_reqs, t.max_model_len, max_num_tokens, max_writes, 0, next_n, *cp, t.fmax,
                         t.id_max_min)

    def plan(self, batch: StepBatch, occupied: np.ndarray, pad_to: Optional[int]) -> StepPlan:
        """Check ``batch`` against the occupancy and the tables; the plan, or ``ValueError``."""
        if not isinstance(batch, StepBatch):
            raise reject("step_type", type=type(batch).__name__)
        if not ready():
            compile_pinned()
        lim = self.lim
        lim[14] = 0 if pad_to is None else 1 if _is_int(pad_to) and -2 ** 63 <= pad_to < 2 ** 63 else 2
        lim[4] = int(pad_to) if pad_to is not None and lim[14] == 1 else 0
        got = self._native(batch, occupied) if _NATIVE else None
        deferred: list = []
        if got is None:
            got = self._converted(batch, occupied, deferred)
        out, ids_k, n, req_slots, nc, q, free, cu, ids, gid, slot = got
        if out[0]:
            raise self._word(out[:6].tolist(), q, pad_to, deferred)
        nd, ndt, T, T_pad, B, K = out[6:12].tolist()
        N, at, fmax = gid.shape[0], HEAD + 7 * n, lim[9] > 1
        plan = object.__new__(StepPlan)  # NOTE: a template fill (a dict display), not a 28-keyword dataclass call
        plan.__dict__ = {
            "rows": out[HEAD:HEAD + B], "slots": out[HEAD + n:HEAD + n + B],
            "num_scheduled": out[HEAD + 2 * n:HEAD + 2 * n + B], "seq_lens": out[HEAD + 3 * n:HEAD + 3 * n + B],
            "replay_start": out[HEAD + 5 * n:HEAD + 5 * n + B] if lim[11] else None,
            "replay_end": out[HEAD + 6 * n:HEAD + 6 * n + B] if lim[12] else None, "num_decodes": nd,
            "num_decode_tokens": ndt, "num_tokens": T, "num_tokens_padded": T_pad, "free_slots": free,
            "new_slots": out[HEAD + 4 * n:HEAD + 4 * n + K], "all_slots": req_slots, "all_computed": nc,
            "w_gid": gid, "w_slot": slot, "w_start": out[at:at + N], "w_end": out[at + N:at + 2 * N],
            "w_keep": out[at + 2 * N:at + 3 * N], "w_row": out[at + 3 * N:at + 4 * N],
            "w_cu": out[at + 4 * N:at + 5 * N + 1] if fmax else cu, "w_ids": ids_k if fmax else ids, "drafts": None}
        if self.level == "full":
            self._full(plan, cu)
        return plan

    def _native(self, batch: StepBatch, occupied: np.ndarray):
        """The pass over the step's own arrays when they are what it takes (int64 / bool, 1-D, C-contiguous:
        the compiled call's types; the pass checks the lengths), else None (:meth:`_converted` then names the
        field)."""
        lim, b = self.lim, batch
        slot: Any
        start: Any
        cu: Any
        ids: Any
        try:
            req_slots, gid = b.req_slots, b.write_gids
            n = req_slots.shape[0]
            is_new = _no_new(n) if b.is_new is None else b.is_new
            free = _EMPTY if b.free_slots is None else b.free_slots
            rs, re = b.replay_start, b.replay_end
            lim[11], lim[12] = rs is not None, re is not None
            if gid is None or gid.shape[0] == 0:
                lim[13], gid, slot, start, cu, ids = 0, _EMPTY, _EMPTY, _EMPTY, _CU0, _EMPTY
            else:
                lim[13], slot, start, cu, ids = 1, b.write_slots, b.write_starts, b.write_cu, b.write_ids
            out = np.empty(out_size(n, gid.shape[0]), dtype=np.int64)
            ids_k = check_step(occupied, self.tables.num_blocks, self.geo, self.comp, lim, req_slots,
                               b.num_computed_tokens, b.num_scheduled_tokens, is_new, free,
                               _EMPTY if rs is None else rs, _EMPTY if re is None else re, gid, slot, start, cu, ids,
                               out)
        except (TypeError, ValueError, AttributeError, IndexError):
            return None  # NOTE: a type the compiled call does not take (a list, int32, 2-D, a strided view)
        if out[0] == _LENGTHS:
            return None
        return out, ids_k, n, req_slots, b.num_computed_tokens, b.num_scheduled_tokens, free, cu, ids, gid, slot

    def _converted(self, batch: StepBatch, occupied: np.ndarray, deferred: list) -> tuple:
        """The pass over the step's arrays converted one by one (each conversion names its field; those of
        replay and run arrays are kept in ``deferred``, raised where the pass reaches them)."""
        lim = self.lim
        req_slots = arr("req_slots", batch.req_slots)
        n = req_slots.shape[0]
        nc = arr("num_computed_tokens", batch.num_computed_tokens, n)
        q = arr("num_scheduled_tokens", batch.num_scheduled_tokens, n)
        is_new = _no_new(n) if batch.is_new is None else arr("is_new", batch.is_new, n, dtype_kind="b")
        free = _EMPTY if batch.free_slots is None else arr("free_slots", batch.free_slots)
        rs = self._later(deferred, 11, "replay_start", batch.replay_start, n)
        re = self._later(deferred, 12, "replay_end", batch.replay_end, n)
        gid, slot, start, cu, ids = self._runs(batch, deferred)
        out = np.empty(out_size(n, gid.shape[0]), dtype=np.int64)  # NOTE: one fresh buffer: the plan's arrays are views
        ids_k = check_step(occupied, self.tables.num_blocks, self.geo, self.comp, lim, req_slots, nc, q, is_new, free,
                           rs, re, gid, slot, start, cu, ids, out)
        return out, ids_k, n, req_slots, nc, q, free, cu, ids, gid, slot

    def _full(self, plan: StepPlan, raw_cu: np.ndarray) -> None:
        """The ``"full"`` checks of a plan (:func:`.kernel.full_step`; definition :func:`.naive.full_checks`)."""
        t, err = self.tables, self._err
        full_step(err, self.fgeo, self.lim, t.mirror, t.num_blocks, plan.seq_lens, plan.num_scheduled,
                  _EMPTY if plan.replay_start is None else plan.replay_start, plan.free_slots, plan.new_slots,
                  plan.w_gid, plan.w_slot, plan.w_start, plan.w_row, plan.w_cu, plan.w_ids, raw_cu)
        if not err[0]:
            return
        c, v = FULL_CODES[err[0]], err[1:].tolist()
        if c == "null_block":
            g, slot, b, logical, raw, count = v[:6]
            lo_pos = None
            if b >= 0:
                rs = None if plan.replay_start is None else int(plan.replay_start[b])
                nc = int(plan.seq_lens[b] - plan.num_scheduled[b])
                lo_pos = int(window_start(nc, int(t.window[g]), rs, self.cp if self.fgeo[g, 8] else None))
            raise null_block_message(t, g, slot, b, logical, raw, lo_pos, int(plan.seq_lens[b]) if b >= 0 else None,
                                     bool(self.fgeo[g, 8]), count - 1)
        if c == "id_twice":
            raise reject(c, r=v[0], value=v[1], g=v[2], slot=v[3])
        raise reject(c, value=v[0], a=v[1], b=v[2], g=v[3], name=t.groups[v[3]].name)

    def _later(self, deferred: list, at: int, name: str, x, n: int) -> np.ndarray:
        """``arr(name, x, n)``, its error kept for the pass to raise in the definition's order."""
        self.lim[at] = x is not None
        if x is None:
            return _EMPTY
        try:
            return arr(name, x, n)
        except ValueError as e:
            deferred.append(e)
            self.lim[at] = -1
            return _EMPTY

    def _runs(self, batch: StepBatch, deferred: list) -> tuple:
        """``(gid, slot, start, cu, ids)`` int64 (empty when the step writes nothing)."""
        self.lim[13] = 0
        if batch.write_gids is None or len(batch.write_gids) == 0:
            return _EMPTY, _EMPTY, _EMPTY, _CU0, _EMPTY
        try:
            gid = arr("write_gids", batch.write_gids)
            N = gid.shape[0]
            got = (gid, arr("write_slots", batch.write_slots, N), arr("write_starts", batch.write_starts, N),
                   arr("write_cu", batch.write_cu, N + 1), arr("write_ids", batch.write_ids))
        except ValueError as e:
            deferred.append(e)
            self.lim[13] = -1
            return _EMPTY, _EMPTY, _EMPTY, _CU0, _EMPTY
        self.lim[13] = 1
        return got

    def _word(self, err: list, q: np.ndarray, pad_to, deferred: list) -> ValueError:
        """The rejection of the pass's ``(code, i, j, k, v, w)``."""
        code, i, j, k, v, w = err
        c, t = CODES[code], self.tables
        if c == "deferred":
            return deferred[0]
        if c == "out_of_range":
            return reject(c, name=_NAMES[k], i=i, value=j, what=_WHAT[k], hi=v)
        if c == "negative":
            return reject(c, name=("num_computed_tokens", "num_scheduled_tokens")[k], i=i, value=j)
        if c == "too_many_tokens":
            return reject(c, total=sum(q.tolist()) if i < 0 else j, limit=v)  # NOTE: Python ints: no wrap
        if c == "pad_to":
            return reject(c, lo=j, hi=v, pad_to=repr(pad_to))
        if c in ("slot_twice", "two_runs"):
            return reject(c, **({"slot": i, "count": j} if c == "slot_twice" else {"g": i, "slot": j}))
        if c in ("free_not_held", "new_held", "not_held", "write_slot_free", "beyond_model_len"):
            return reject(c, i=i, value=j, limit=v)
        if c in ("replay_start", "replay_end_negative", "replay_end_int32"):
            return reject(c, slot=i, value=j, nc=v)
        if c == "hole":
            return reject(c, i=i, value=j, g=k, slot=v, have=w)
        if c == "run_too_long":
            grp = t.groups[k]
            return reject(c, r=i, slot=j, end=v, g=grp.gid, name=grp.name, limit=int(t.logical[k]),
                          why="the circular ring" if grp.kind == "circular" else "max_model_len")
        if c in ("id_negative", "id_int32"):
            return reject(c, j=i, value=j, g=k, name=t.groups[k].name, limit=v)
        if c == "ring_short":
            return reject(c, g=i, name=t.groups[i].name, ring=int(t.ring[i]), slot=j, have=k, lo=v)
        if c == "blocks_missing":
            return reject(c, g=i, name=t.groups[i].name, slot=j, seq=k, need=v, have=w)
        if c == "too_many_staged":
            return reject(c, staged=j, limit=v)
        return reject(c, n=v)  # NOTE: write_cu; free_twice has no field


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
