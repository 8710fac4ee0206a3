"""The steady-step path of the checks: a step that repeats the last accepted batch (same slots, same
scheduled counts, at most a block of tokens per row, ``num_computed_tokens`` equal to the last step's
``seq_lens``, nothing freed or new, no replay bounds) and whose write runs each append one id to a batch
row is checked here in a few array comparisons; any other step, or any doubt, goes to the general checks of :mod:`.plan`
(which also produce every error message). The plan is then identical to the general one.

Why it is sufficient: the cache keeps, per (non-circular group,
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
from .plan import StepPlan

__all__ = ["SteadyGeometry", "SteadyCache", "plan_steady"]

_I64, _U64, _BOOL = np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.bool_)
_EMPTY = np.zeros(0, dtype=np.int64)
_count = np.count_nonzero
_ONE = np.array(1, dtype=np.int64)
_BIG = np.iinfo(np.int64).max
_POISON = -(1 << 40)  # NOTE: the poison cell after the slack matrix: a run outside the batch lands there


class _Scratch:
    """Buffers the steady check writes before it knows the answer (not state: overwritten each step)."""

    def __init__(self, shape):
        self.flat, self.x_next = _slack_buffer(shape)
        self.over = np.empty(shape, dtype=bool)
        self.seen = np.zeros(shape[0] * shape[1] + 1, dtype=bool)
        self.seq = None


_CONSTANTS = {}


def _constants(n: int):
    """``arange(n + 1)``, its bytes and the bytes of ``n`` APPEND starts (built once per size)."""
    got = _CONSTANTS.get(n)
    if got is None:
        arange = np.arange(n + 1, dtype=np.int64)
        got = _CONSTANTS[n] = (arange, arange.tobytes(), np.full(n, -1, dtype=np.int64).tobytes())
    return got


def _slack_buffer(shape):
    """A flat int64 buffer of ``prod(shape) + 1`` cells (the last: poison) and its ``shape`` view."""
    flat = np.full(shape[0] * shape[1] + 1, _POISON, dtype=np.int64)
    return flat, flat[:-1].reshape(shape)


class SteadyGeometry:
    """What the steady path needs of the tables, computed once per pipeline.

    Non-circular groups (``groups``, their block sizes ``bs_x``), the ring bound before ``q_max``
    (``bound0 = ring * bs - W - bs + 2``, huge for plain tables), the width a steady append may reach
    (0 for circular groups: their runs take the general path), and the flat (group, slot) keys.
    """

    def __init__(self, tables):
        G, num_slots = len(tables.groups), tables.max_num_reqs
        self.num_groups, self.num_slots, self.num_keys = G, num_slots, G * num_slots
        self.max_model_len = tables.max_model_len
        self.groups = np.flatnonzero(~tables.circular)
        bs = tables.bs[self.groups]
        self.bs_x = bs[:, None]
        self.max_q = int(bs.min()) if bs.size else 0
        ring, win = tables.ring[self.groups], tables.window[self.groups]
        self.bound0 = np.where(ring > 0, ring * bs - win - bs + 2, _BIG // 2)
        self.bs = tables.bs.copy()
        self.width = np.where(tables.circular, 0, tables.logical)
        self.logical_x = tables.logical[self.groups]
        self.key_base = (np.arange(G, dtype=np.int64) * num_slots)[:, None]
        self.nb_flat = tables.num_blocks.ravel()  # NOTE: a view of the live block counts
        self.arange, self.arange_bytes, self.append_bytes = _constants(G * num_slots)


class SteadyCache:
    """The last accepted batch in device order, for :func:`plan_steady` (built by :meth:`build`).

    Attributes (``G'`` non-circular groups, ``B`` batch rows, ``R`` slots, ``G`` groups)
    ----------
    x : int64 ``[G', B]`` — slack ``blocks * block_size - seq_len`` per (group, batch row), a view of
        a flat buffer whose extra last cell is the poison cell.
    bound : uint64 ``[G', B]`` — the sufficient bound of ``x`` (module docstring), per group.
    key_x, key_row : int64 ``[G * num_slots + 1]`` — for the flat (group, slot) key ``gid * num_slots + slot``: its
        flat cell of ``x`` (the poison cell unless a non-circular group of a batch slot; keys past
        ``G * num_slots`` clip to the last entry, poison too) and its batch row.
    """

    @classmethod
    def build(cls, plan: StepPlan, geo: "SteadyGeometry", generation: int, prev: "SteadyCache" = None):
        """The cache after accepting ``plan`` (general path), or None when no steady step can follow
        (a row without tokens or with more than the smallest block's, a sequence at ``max_model_len``,
        a ring too small for its window).

        ``prev``: the cache of the last batch, if any. When the new batch has as many rows (a request
        finished, another took its place; rows traded places), ``prev`` is patched in place for the
        rows whose slot changed (its key tables and buffers are kept) instead of rebuilt; the result
        is the same cache.
        """
        n_rows, B = plan.all_slots.shape[0], plan.slots.shape[0]
        qmax = int(plan.num_scheduled.max()) if B else 0
        # NOTE: a row scheduling more tokens than the smallest block appends several ids per run some
        # step (it is a prefill: never steady); such batches build no cache
        if B == 0 or n_rows != B or qmax > geo.max_q or int(plan.seq_lens.max()) > geo.max_model_len:
            return None
        U = geo.bound0 - qmax
        if int(U.min()) < 0:
            return None
        Gx = geo.groups.size
        changed = None
        if prev is not None and prev.B == B and prev.geo is geo:
            changed = np.flatnonzero(plan.slots != prev.held_slots)  # NOTE: the cost grows with these only
        if changed is None:
            c = cls()
            c.B, c.shape, c.geo, c.num_slots = B, (B,), geo, geo.num_slots
            c.num_slots_0d = np.array(geo.num_slots, dtype=np.int64)
            c.x_flat, c.x = _slack_buffer((Gx, B))
            c.scratch = _Scratch(c.x.shape)
            c.key_x = np.full(geo.num_keys + 1, Gx * B, dtype=np.int64)
            c.key_row = np.full(geo.num_keys + 1, -1, dtype=np.int64)
            c._set_keys(geo.arange[:B], plan.slots)
            c.bs_of_gid, c.width, c.max_runs = geo.bs, geo.width, geo.num_groups * B
            c.arange, c.arange_bytes, c.append_bytes = geo.arange, geo.arange_bytes, geo.append_bytes
            c.covered_min = int((geo.logical_x * geo.bs_x[:, 0]).min())
            c.bound_min = None
        else:
            c = prev
            if changed.shape[0]:
                # NOTE: first every leaving key back to poison, then the arriving ones (a slot may move rows)
                old = (geo.key_base + prev.held_slots.take(changed)[None, :]).ravel()
                c.key_x[old], c.key_row[old] = Gx * B, -1
                c._set_keys(changed, plan.slots.take(changed))
        c.generation = generation
        c.rows, c.b_slots, c.b_q = plan.rows, plan.slots, plan.num_scheduled
        c.held_slots = plan.slots.copy()  # NOTE: what the key tables hold (the caller may reuse its arrays)
        c.identity = bool((plan.rows == geo.arange[:B]).all())
        q_all = np.empty(B, dtype=np.int64)
        q_all[plan.rows] = plan.num_scheduled
        c.slots_bytes, c.q_bytes = plan.all_slots.tobytes(), q_all.tobytes()
        c.nc_bytes = (plan.all_computed + q_all).tobytes()
        c.num_tokens, c.num_decodes, c.num_decode_tokens = plan.num_tokens, plan.num_decodes, plan.num_decode_tokens
        # NOTE: flat (group, slot) keys of the non-circular groups for the batch slots, group-major
        kx = (geo.key_base[geo.groups] + c.b_slots[None, :]).ravel()
        np.subtract(geo.nb_flat.take(kx).reshape(Gx, B) * geo.bs_x, plan.seq_lens, out=c.x)
        c.x_flat[-1] = _POISON
        if c.bound_min != int(U.min()) or changed is None or not np.array_equal(c.bound_u, U):
            c.bound_u = U
            c.bound = np.repeat(U.astype(np.uint64), B).reshape(Gx, B)
            # NOTE: one scalar for the common case: x' <= min(U) proves coverage and every ring bound, and
            # x' <= min(logical * bs) - max(seq') proves the table width of every appended row
            c.bound_min = int(U.min())
        c.plan_fields = dict(rows=c.rows, slots=c.b_slots, num_scheduled=c.b_q, replay_start=None, replay_end=None,
                             num_decodes=c.num_decodes, num_decode_tokens=c.num_decode_tokens,
                             num_tokens=c.num_tokens, free_slots=_EMPTY, new_slots=_EMPTY, steady=True)
        return c

    def _set_keys(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Point the keys of ``slots`` (every group) at batch ``rows`` and their cells of ``x``."""
        geo, B = self.geo, self.B
        keys = geo.key_base + slots[None, :]                        # [G, k]
        self.key_row[keys.ravel()] = np.tile(rows, geo.num_groups)
        cells = (geo.arange[:geo.groups.size, None] * B + rows[None, :]).ravel()
        self.key_x[keys[geo.groups].ravel()] = cells

    def advance(self, plan: StepPlan, tables) -> bool:
        """Accept a steady ``plan``; False when no further steady step can follow."""
        s = self.scratch
        self.x, s.x_next = s.x_next, self.x
        self.x_flat, s.flat = s.flat, self.x_flat
        self.nc_bytes = s.seq.tobytes()
        return s.seq_max <= tables.max_model_len


def plan_steady(batch, c: SteadyCache, tables, pad_to, max_num_tokens: int, max_writes: int,
                level: str) -> Optional[StepPlan]:
    """The plan of a steady step, or None (not steady, or a bound not proven: the general checks
    decide). Writes only the cache's scratch buffers."""
    if type(batch) is not StepBatch:
        return None
    slots, nc, q = batch.req_slots, batch.num_computed_tokens, batch.num_scheduled_tokens
    for x in (slots, nc, q):
        if type(x) is not np.ndarray or x.dtype is not _I64 or x.shape != c.shape:  # NOTE: identity: fast, and
            return None                                                               # a miss only costs speed
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
    s = c.scratch
    xn = np.subtract(c.x, c.b_q, out=s.x_next)
    flat = s.flat
    gid = batch.write_gids
    if gid is None or len(gid) == 0:
        gid = slot = have = end = row = key = _EMPTY
        cu, ids = c.arange[:1], _EMPTY
    else:
        slot, start, cu, ids = batch.write_slots, batch.write_starts, batch.write_cu, batch.write_ids
        for x in (gid, slot, start, cu, ids):
            if type(x) is not np.ndarray or x.dtype is not _I64 or x.ndim != 1:
                return None
        N = gid.shape[0]
        if N > c.max_runs or N > max_writes or slot.shape[0] != N or start.shape[0] != N or ids.shape[0] != N:
            return None
        if cu.tobytes() != c.arange_bytes[:8 * N + 8] or start.tobytes() != c.append_bytes[:8 * N]:
            return None  # NOTE: not one APPEND id per run
        num_slots = c.num_slots
        # NOTE: gid, slot < num_slots (G <= num_slots is not needed: keys past G * num_slots clip to the poison entry)
        both, u = np.bitwise_or(gid, slot).view(_U64), ids.view(_U64)
        if both.item(both.argmax()) >= num_slots or u.item(u.argmax()) > tables.id_max_min:  # NOTE: argmax: no wrapper
            return None
        key = np.multiply(gid, c.num_slots_0d)  # NOTE: 0-d operands: a Python int costs a conversion per call
        key += slot
        have = tables.num_blocks.take(key, mode="clip")
        add = c.bs_of_gid.take(gid, mode="clip")
        flat[-1] = _POISON
        cells = c.key_x.take(key, mode="clip")
        flat[cells] += add  # NOTE: a run outside the batch lands on the poison cell
        seen = s.seen
        seen[cells] = True
        distinct = _count(seen)
        seen[cells] = False
        if flat[-1] != _POISON or distinct != N:  # NOTE: one run per (group, slot)
            return None
        row = c.key_row.take(key, mode="clip")
        end = np.add(have, _ONE)
    seq = np.add(nc, q)
    seq_max = seq.item(seq.argmax())
    u = xn.view(_U64)  # NOTE: negative slack (not covered) views as huge
    if u.item(u.argmax()) > min(c.bound_min, c.covered_min - seq_max):
        # NOTE: the scalar bound failed: the exact per-group bounds and the width of each appended row
        if gid.size and _count(have >= c.width.take(gid, mode="clip")):  # NOTE: width, and no circular group
            return None
        if _count(np.greater(u, c.bound, out=s.over)):  # NOTE: coverage and every ring bound at once
            return None
    if level == "full" and gid.size and not _full_ok(tables, gid, slot, have, ids):
        return None  # NOTE: the general path raises its message (state/contract.py)
    s.seq, s.seq_max = seq, seq_max
    plan = _new_plan()
    plan.__dict__.update(c.plan_fields)  # NOTE: the fields a steady batch repeats (a dict update, not 25 kwargs)
    d = plan.__dict__
    d["seq_lens"] = seq if c.identity else seq.take(c.rows)
    d["num_tokens_padded"], d["all_slots"], d["all_computed"] = T_pad, slots, nc
    d["w_gid"], d["w_slot"], d["w_start"], d["w_end"], d["w_keep"] = gid, slot, have, end, have
    d["w_cu"], d["w_ids"], d["w_row"], d["w_key"] = cu, ids, row, key
    return plan


def _new_plan() -> StepPlan:
    return object.__new__(StepPlan)


def _full_ok(tables, gid, slot, have, ids) -> bool:
    """``checks="full"`` for one-id appends: no null id in any group (a steady append lands at or past
    the window start of its row: ``nc <= blocks * bs``), and, vectorised per full group, no id already
    in the row. False: the general path finds the culprit (:mod:`.contract`, it raises)."""
    if not ids.all():  # NOTE: plain blocks on this path (f == 1): the null block is id 0
        return False
    full = tables.full.take(gid)
    if not _count(full):
        return True
    sel = full.nonzero()[0]
    g_sel = gid.take(sel)
    for g in np.unique(g_sel).tolist():
        m = sel if g_sel.shape[0] == 1 or (g_sel == g).all() else sel[g_sel == g]
        rows = tables.mirrors[g][slot.take(m)]                       # int32 [k, cols]
        held = tables.iota_cols[:rows.shape[1]] < have.take(m)[:, None]
        if _count((rows == ids.take(m)[:, None]) & held):
            return False
    return True
