"""The steady-step path of the checks: a step that repeats the last accepted batch (same slots, same
scheduled counts, ``num_computed_tokens`` equal to the last step's ``seq_lens``, nothing freed or new,
no replay bounds) and whose write runs each append one id to a batch row is checked here in a few
array comparisons; any other step, or any doubt, goes to the general checks of :mod:`.plan`
(which also produce every error message). The plan is then identical to the general one.

Why it is sufficient (issue 18, ``host_path.md`` §3): the cache keeps, per (non-circular group,
batch row), the slack ``x = blocks * block_size - seq_len``. After the step
``x' = x - q + block_size * [the row appends a block]``. Coverage is exactly ``x' >= 0``; the ring
bound ``blocks - lowest_read_block <= ring`` is implied by ``x' <= ring * bs - W - bs + 2 - q_max``
(the lowest block a row reads is ``floor(max(nc - W + 1, 0) / bs)``). One unsigned compare (negative
slack views as huge) against a per-group bound proves both; on failure the general path runs the
exact formulas. Ring trimming is a no-op for one-id appends (the id is at or above the lowest block
read), the circular capacity check depends on ``q`` only (unchanged), and the identical slots, counts
and order prove slot range, distinctness, occupancy, ``T``, the decode-first order and ``qsl``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..batch import StepBatch
from .plan import StepPlan, _full_checks

__all__ = ["SteadyCache", "plan_steady"]

_I64, _U64, _BOOL = np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.bool_)
_EMPTY = np.zeros(0, dtype=np.int64)
_BIG = np.iinfo(np.int64).max


class _Scratch:
    """Buffers the steady check writes before it knows the answer (not state: overwritten each step)."""

    def __init__(self, shape, n_keys: int):
        self.x_next = np.empty(shape, dtype=np.int64)  # C order: x_next.ravel() is a view
        self.keys = np.zeros(max(n_keys, 1), dtype=np.int64)
        self.seq = None


class SteadyCache:
    """The last accepted batch in device order, for :func:`plan_steady` (built by :meth:`build`)."""

    @classmethod
    def build(cls, plan: StepPlan, tables, generation: int, old: Optional["SteadyCache"]):
        """The cache after accepting ``plan`` (general path), or None when no steady step can follow
        (a row without tokens, a sequence at ``max_model_len``)."""
        n_rows, B = plan.all_slots.shape[0], plan.slots.shape[0]
        if B == 0 or n_rows != B or int(plan.seq_lens.max()) > tables.max_model_len:
            return None
        c = cls()
        c.generation, c.B, c.shape = generation, B, (B,)
        c.rows, c.b_slots, c.b_q = plan.rows, plan.slots, plan.num_scheduled
        c.identity = bool((plan.rows == np.arange(B)).all())
        q_all = np.empty(B, dtype=np.int64)
        q_all[plan.rows] = plan.num_scheduled
        c.slots_bytes, c.q_bytes = plan.all_slots.tobytes(), q_all.tobytes()
        c.nc_bytes = (plan.all_computed + q_all).tobytes()
        c.num_tokens, c.num_decodes, c.num_decode_tokens = plan.num_tokens, plan.num_decodes, plan.num_decode_tokens
        R, G = tables.max_num_reqs, len(tables.groups)
        c.row_of = np.full(R, B, dtype=np.int64)  # NOTE: slot -> device batch row; B: not in the batch
        c.row_of[c.b_slots] = np.arange(B)
        c.slots_ext = np.append(c.b_slots, -1)
        groups = np.flatnonzero(~tables.circular)
        c.gpos = np.full(G, -1, dtype=np.int64)
        c.gpos[groups] = np.arange(groups.size)
        # NOTE: the width a steady run may reach: 0 for circular groups (their runs take the general path)
        c.width = np.where(tables.circular, 0, tables.logical)
        bs = tables.bs[groups]
        c.bs_of_gid = tables.bs.copy()
        # NOTE: C order: the steady check adds to a flat view of its copy (fancy indexing may give F order)
        c.x = np.ascontiguousarray(tables.num_blocks[groups][:, c.b_slots] * bs[:, None] - plan.seq_lens[None, :])
        qmax = int(plan.num_scheduled.max())
        ring, win = tables.ring[groups], tables.window[groups]
        U = np.where((ring > 0), ring * bs - win - bs + 2 - qmax, _BIG)
        c.bound = U.astype(np.uint64)[:, None] if (U >= 0).all() else None
        c.max_runs = G * B
        c.arange = np.arange(c.max_runs + 1, dtype=np.int64)
        c.append = np.full(c.max_runs, -1, dtype=np.int64)
        c.scratch = _Scratch(c.x.shape, c.max_runs)
        return c

    def advance(self, plan: StepPlan, tables) -> bool:
        """Accept a steady ``plan``; False when no further steady step can follow."""
        s = self.scratch
        self.x, s.x_next = s.x_next, self.x
        self.nc_bytes = s.seq.tobytes()
        return int(s.seq.max()) <= tables.max_model_len


def plan_steady(batch, c: SteadyCache, tables, pad_to, max_num_tokens: int, max_writes: int,
                level: str) -> Optional[StepPlan]:
    """The plan of a steady step, or None (not steady, or a bound not proven: the general checks
    decide). Writes only the cache's scratch buffers."""
    if type(batch) is not StepBatch or c.bound is None:
        return None
    slots, nc, q = batch.req_slots, batch.num_computed_tokens, batch.num_scheduled_tokens
    for x in (slots, nc, q):
        if type(x) is not np.ndarray or x.dtype != _I64 or x.shape != c.shape:
            return None
    if slots.tobytes() != c.slots_bytes or q.tobytes() != c.q_bytes or nc.tobytes() != c.nc_bytes:
        return None
    if batch.replay_start is not None or batch.replay_end is not None:
        return None
    free, new = batch.free_slots, batch.is_new
    if free is not None and (type(free) is not np.ndarray or free.size):
        return None
    if new is not None and (type(new) is not np.ndarray or new.dtype != _BOOL or new.shape != c.shape
                            or np.count_nonzero(new)):
        return None
    T = c.num_tokens
    if pad_to is None:
        T_pad = T
    elif isinstance(pad_to, bool) or not isinstance(pad_to, (int, np.integer)) or not T <= pad_to <= max_num_tokens:
        return None
    else:
        T_pad = int(pad_to)
    s, B = c.scratch, c.B
    xn = np.subtract(c.x, c.b_q, out=s.x_next)
    gid = batch.write_gids
    if gid is None or len(gid) == 0:
        gid = slot = have = end = r = _EMPTY
        cu, ids = c.arange[:1], _EMPTY
    else:
        slot, start, cu, ids = batch.write_slots, batch.write_starts, batch.write_cu, batch.write_ids
        for x in (gid, slot, start, cu, ids):
            if type(x) is not np.ndarray or x.dtype != _I64 or x.ndim != 1:
                return None
        N = gid.shape[0]
        if N > c.max_runs or N > max_writes or slot.shape[0] != N or start.shape[0] != N or ids.shape[0] != N:
            return None
        if cu.tobytes() != c.arange[:N + 1].tobytes() or start.tobytes() != c.append[:N].tobytes():
            return None
        if int(gid.view(_U64).max()) >= c.gpos.shape[0] or int(ids.view(_U64).max()) > tables.id_max_min:
            return None
        r = c.row_of.take(slot, mode="clip")
        if np.count_nonzero(c.slots_ext.take(r) != slot):  # NOTE: every run's slot is a batch row
            return None
        have = tables.num_blocks.take(gid * tables.max_num_reqs + slot)
        if np.count_nonzero(have >= c.width.take(gid)):    # NOTE: width, and no circular group
            return None
        key = c.gpos.take(gid) * B + r
        keys, runs = s.keys, c.arange[:N]
        keys[key] = runs
        if np.count_nonzero(keys.take(key) != runs):       # NOTE: one run per (group, slot)
            return None
        flat = xn.ravel()
        flat[key] += c.bs_of_gid.take(gid)
        end = have + 1
    if np.count_nonzero(xn.view(_U64) > c.bound):  # NOTE: coverage and every ring bound at once
        return None
    if level == "full" and gid.size:
        _full_checks(tables, gid, slot, have, cu, ids)
    seq = np.add(nc, q)
    s.seq = seq
    return StepPlan(
        rows=c.rows, slots=c.b_slots, num_scheduled=c.b_q, seq_lens=seq if c.identity else seq.take(c.rows),
        replay_start=None, replay_end=None, num_decodes=c.num_decodes, num_decode_tokens=c.num_decode_tokens,
        num_tokens=T, num_tokens_padded=T_pad, free_slots=_EMPTY, new_slots=_EMPTY, all_slots=slots,
        all_computed=nc, w_gid=gid, w_slot=slot, w_start=have, w_end=end, w_keep=have, w_cu=cu, w_ids=ids,
        w_row=r, steady=True)
