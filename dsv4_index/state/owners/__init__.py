"""Block ownership: what a row of a step may read, checked on the host before anything is built
(docs/DESIGN.md §5 "What `update()` proves about a step").

**The rule.** A row reads only cache positions it wrote itself (since it was last admitted or resumed), or, in
a prefix-cacheable group, positions of a prefix-shared block that was filled at the same block position and
not refilled since. Everything below follows from it.

* *Release.* After an accepted step a row's next position is in ``[nc + n - d, nc + n]``: ``d`` its draft
  tokens in that step (``StepBatch.drafts``; ``len(scheduled_spec_decode_tokens[req])`` from a
  SchedulerOutput; by default ``min(n - 1, num_speculative_tokens)`` for a row of at most
  ``1 + num_speculative_tokens`` tokens, 0 for a prefill chunk). A sliding block wholly behind the window of
  the lower bound is free, for every live row, scheduled in a step or not (rings: per column).
* *Prevention at write time.* A block another live row reads whatever its drafts' fate (a batch row: from its
  window start in this step; any other row: its window at the upper bound ``nc + n``) is certainly held: a
  write into it is rejected at once. The one exception is vLLM's same-step prefix hit: a request admitted in
  the step that fills a block takes it as a hit at the same block position while the filler writes it whole.
  A block only the band between the two bounds keeps may be handed on (the scheduler knows the acceptance):
  the write is accepted and recorded.
* *Detection at read time.* Each (group, block) keeps its last fill: writer, block position, step. A step in
  which a row would read a sliding block filled since this row last wrote or took it, or takes a "prefix
  hit" of a block filled at another block position, is rejected before anything is built, naming the fill.
  A row's own rewrite (below its frontier: drafts rejected, replay) of a block it filled is a new fill, even
  when no other live row holds the block then: a row that took it as a hit and released it may read it again
  (its window moved back below its floor), and must find it changed.
* Also: prefix-shared full blocks are read-only for every holder (every full block a live row holds is
  certainly read), so bounded replay writes nothing into them; a row's ring columns hold what it reads (ring
  low-water marks); ``num_computed_tokens`` never jumps past what the row's steps wrote; a window that moves
  back onto blocks another live row holds now is rejected. ``checks="full"`` adds: no id twice in a row, no
  null block among the held sliding blocks a step reads.

Layout: :mod:`.naive` is the rule by its definition (the holders of a written block found by scanning the
table rows as the step leaves them); :mod:`.messages` words every rejection (code, level, template, fields).
:class:`BlockOwners` is the face the request state uses.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..._numba import compile_pinned, ready
from .kernel import CODES, check_pass, commit_pass, rehash
from .messages import check_id_limit, reject
from .naive import default_drafts
from .pack import first_entries, pack_size, pack_step

__all__ = ["BlockOwners", "check_ring_capacity", "default_drafts", "drafts_of", "first_sizes"]

TABLE_RECORDS_MAX = 1 << 17  # NOTE: the first table's ceiling: 8 MiB of records (65,536 before it first grows)
LIST_ENTRIES_MAX = 1 << 14


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def first_sizes(G: int, cells: int) -> tuple:
    """(records of the first (group, id) table, entries of each of the three lists) for ``G`` groups and a
    table mirror of ``cells`` entries, both powers of two. The live rows hold at most ``cells`` (group, id)
    keys at once; the table holds them at most half full (it grows, between steps, past half load), up to
    :data:`TABLE_RECORDS_MAX` records (the fills of blocks nobody holds accumulate beyond: the table grows
    with the pool the scheduler uses, a few times in a pipeline's life). The lists hold a step's releases,
    acquisitions and count-filter touches (a pass that overflows them runs again on longer ones)."""
    table = _pow2(max(256 * max(G, 1), min(2 * cells, TABLE_RECORDS_MAX)))
    return table, _pow2(max(1024, min(cells, LIST_ENTRIES_MAX)))


def drafts_of(batch, plan) -> Optional[np.ndarray]:
    """int64 ``[B]``: ``batch.drafts`` in device order (-1 entries: the default rule, as -1), or None
    when the batch gives none. Raises ``ValueError`` naming the row for a count outside ``-1 ..
    num_scheduled_tokens - 1`` (the first scheduled token is never a draft)."""
    d = batch.drafts
    if d is None:
        return None
    a = np.asarray(d)
    n = batch.num_rows
    if a.ndim != 1 or a.shape[0] != n or a.dtype.kind not in "iu":
        raise ValueError(f"drafts must be a 1-D integer array of {n} entries (one per batch row), got "
                         f"{a.dtype} of shape {a.shape}")
    a = a.astype(np.int64)
    q = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
    bad = (a < -1) | (a > np.maximum(q - 1, 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"drafts[{i}] = {int(a[i])}: expected -1 (the default rule) or 0.."
                         f"{max(int(q[i]) - 1, 0)} (num_scheduled_tokens {int(q[i])}; the first scheduled token is "
                         f"never a draft)")
    return a.take(plan.rows)


def check_ring_capacity(groups, num_speculative_tokens: int) -> None:
    """Circular groups need ``capacity >= window - 1 + num_speculative_tokens`` (a verify step's writes
    must never reach rows the next step reads after a rejection; DESIGN §4, ``from_config(circular=)``)."""
    for g in groups:
        if g.kind == "circular" and g.window is not None:
            need = g.window - 1 + num_speculative_tokens
            if g.ring_capacity < need:
                reject("own.ring_capacity", gid=g.gid, name=g.name, cap=g.ring_capacity, window=g.window,
                       spec=num_speculative_tokens, need=need)


_I64 = np.int64
_NONE = np.zeros(0, dtype=_I64)


class BlockOwners:
    """The ownership state of one pipeline, on the compiled passes of :mod:`.kernel`.

    Parameters
    ----------
    tables : BlockTables — geometry, block counts and host mirror (read only).
    cp : (world, rank, interleave) of the sharded groups.
    level : ``"safe"`` or ``"full"``.
    num_speculative_tokens : int — draft tokens per decode row (the default draft count, the ring rule).
    """

    def __init__(self, tables, *, cp, level: str, num_speculative_tokens: int = 0):
        check_ring_capacity(tables.groups, num_speculative_tokens)
        t = self.t = tables
        G, S = self.G, self.S = len(t.groups), t.max_num_reqs
        self.full, self.next_n = level == "full", 1 + num_speculative_tokens
        sliding = ~t.full & ~t.circular
        sharded = t.sharded & (cp[0] > 1)
        self.geo = np.ascontiguousarray(np.stack([t.base, t.cols, t.ring, t.bs, t.f, t.window, t.full, t.circular,
                                                  sliding, sharded], axis=1).astype(_I64).reshape(G, 10))
        self.cp = np.asarray(cp, dtype=_I64)
        self.slot_st = np.zeros((4, S), dtype=_I64)
        self.meta = np.zeros(1, dtype=_I64)
        self.cell_st = np.zeros((5, G, S), dtype=_I64)
        self.cell_st[3] = -1
        records, entries = first_sizes(G, t.mirror.shape[0])
        self.fill = self._fills(records)  # NOTE: sized for the held keys up front: no growth within the first steps
        self.seen = np.zeros(t.mirror.shape[0], dtype=_I64)  # NOTE: 2 * step + own (kernel's docstring)
        self.steps = 0
        self._pending: Optional[tuple] = None
        # NOTE: the passes' scratch, kept between steps (run_of all -1 between passes); grown on demand
        self.X = np.zeros((4 + 2 * G, S), dtype=_I64)
        self.run_of = np.full(G * S, -1, dtype=_I64)
        self.F4, self.seen_l = np.zeros((entries, 4), dtype=_I64), np.zeros((entries, 6), dtype=_I64)
        self.L, self.E = np.zeros((3, entries), dtype=_I64), np.zeros(16, dtype=_I64)
        self._buf, self._opts = np.zeros(first_entries(G, S), dtype=_I64), np.zeros(4, dtype=_I64)

    @staticmethod
    def _fills(cap: int) -> np.ndarray:
        """int64 ``[cap + 2, 8]``: an empty open-addressing table of ``cap`` (a power of two) records, one
        cache line each (kernel docstring), then the header row (records used, overflow flag) and a spare row.
        The rows start on a 64-byte boundary (a view into a slightly larger buffer): a large numpy array starts 16
        bytes past one, which split every record over two cache lines (two misses a lookup)."""
        n = (cap + 2) * 8
        buf = np.zeros(n + 8, dtype=_I64)
        off = (-buf.ctypes.data % 64) // 8
        fill = buf[off:off + n].reshape(cap + 2, 8)
        fill[:cap, :3] = -1
        fill[:cap, 6] = -1
        return fill

    @property
    def _keys(self) -> np.ndarray:
        """int64 ``[n]``: the table rows that hold a key."""
        return np.flatnonzero(self.fill[:-2, 6] >= 0)

    def grow(self) -> None:
        """Rebuild the table at four times the records in use, when the last pass found it more than half
        full (records that hold neither a fill nor a holder are dropped)."""
        if not self.fill[-2, 1]:
            return
        used = int(self.fill[-2, 0])
        fill = self._fills(1 << (4 * used - 1).bit_length())
        rehash(self.fill, fill)
        self.fill = fill

    def check(self, plan) -> None:
        """Every ownership rule of ``plan`` (module docstring); raises ``ValueError`` and changes nothing
        observable (the table of fills and counts may grow)."""
        self._pending = None
        if not ready():
            compile_pinned()  # NOTE: the passes' one signature (warmup() does this first)
        t = self.t
        P, R, raw0, A, FN, w_ids, top = self._pack(plan)
        if R.shape[1]:
            check_id_limit(top, self.G)
        self.grow()
        nf = int(plan.free_slots.shape[0])
        while True:
            res = check_pass(self.geo, self.cp, P, R, w_ids, raw0, A, FN, nf, self.full, self.steps + 1, t.mirror,
                             t.num_blocks, self.slot_st, self.cell_st, self.fill, self.seen, self.meta,
                             self.X, self.run_of, self.F4, self.seen_l, self.L, self.E)
            big, full = max(res[2], res[3], res[4]), bool(self.fill[-2, 2])
            more = max(res[0], res[1])
            if not full and big <= self.L.shape[1] and more <= self.F4.shape[0]:
                break
            # NOTE: the verdict and the lists of this run are void: a list overflowed (compared with the length
            # the run had, before it grows) or the table filled up. An overflowed count-filter log left the
            # touches past its end in fill[:, 5] (only the logged ones are zeroed): cleared before the rerun (a
            # fill past the end of F4 never marked its record)
            if big > self.L.shape[1]:
                self.L = np.zeros((3, _pow2(big)), dtype=_I64)
                self.fill[:-2, 5] = 0
            if more > self.F4.shape[0]:
                self.F4, self.seen_l = np.zeros((_pow2(more), 4), dtype=_I64), np.zeros((_pow2(more), 6), dtype=_I64)
            if full:
                self.grow()
        if self.E[0]:
            self._reject(self.E[:12], plan)
        self._pending = (plan, P, R, A, FN, nf, res)

    def _pack(self, plan) -> tuple:
        """``(P, R, raw0, A, FN, w_ids, largest id)`` of ``plan`` (:func:`.pack.pack_step`): views into a buffer kept
        between steps (the passes read them until :meth:`commit`); a plan's arrays not int64 and C-contiguous are
        converted first."""
        B, N, n = plan.slots.shape[0], plan.w_gid.shape[0], plan.all_slots.shape[0]
        F = plan.free_slots.shape[0] + plan.new_slots.shape[0]
        need = pack_size(B, N, n, F)
        if need > self._buf.shape[0]:
            self._buf = np.zeros(need, dtype=_I64)  # NOTE: never, for a plan of the planner (first_entries)
        buf, o, d = self._buf, self._opts, getattr(plan, "drafts", None)
        rs, re = plan.replay_start, plan.replay_end
        o[0], o[1], o[2], o[3] = rs is not None, re is not None, d is not None, self.next_n
        arrays = [plan.slots, plan.seq_lens, plan.num_scheduled, _NONE if rs is None else rs,
                  _NONE if re is None else re, _NONE if d is None else d, o, plan.w_gid, plan.w_slot, plan.w_start,
                  plan.w_end, plan.w_keep, plan.w_cu, plan.w_ids, self.t.f, plan.all_slots, plan.all_computed,
                  plan.free_slots, plan.new_slots, buf]
        try:
            code, top = pack_step(*arrays)
        except TypeError:  # NOTE: another dtype or a strided view (a plan built by hand): converted, same pass
            code, top = pack_step(*[np.ascontiguousarray(x, dtype=_I64) for x in arrays])  # o, buf: unchanged
        if code:
            raise ValueError(f"ownership check: the plan's arrays disagree with its counts (internal code {code}; "
                             f"the planner should have refused this step)")
        r = 7 * B + 6 * N
        at = r + N + 1
        return (buf[:7 * B].reshape(7, B), buf[7 * B:r].reshape(6, N), buf[r:at], buf[at:at + 2 * n].reshape(2, n),
                buf[at + 2 * n:at + 2 * n + F].reshape(1, F), np.ascontiguousarray(plan.w_ids, dtype=_I64), int(top))

    def commit(self, plan) -> None:
        """Apply the accepted ``plan`` checked by the last :meth:`check` (after the tables' commit)."""
        if self._pending is None or self._pending[0] is not plan:
            raise RuntimeError("BlockOwners.commit: the plan was not checked by BlockOwners.check")
        _, P, R, A, FN, nf, (nF, nS, nd, ni, _) = self._pending
        self._pending = None
        commit_pass(self.geo, self.cp, P, R, A, FN, nf, self.slot_st, self.cell_st, self.fill, self.seen,
                    self.X, self.F4, nF, self.seen_l, nS, self.L, nd, ni, self.meta, self.steps + 1,
                    bool(self.E[11]))
        self.steps += 1

    def _reject(self, e: np.ndarray, plan) -> None:
        code = int(e[0])
        if code < 0:
            raise ValueError(f"ownership check: an index out of range (internal code {code}; the planner "
                             f"should have refused this step)")
        v = [int(x) for x in e]
        at = {4: 5, 8: 5, 9: 5, 11: 1}.get(code, 2)  # NOTE: where each code keeps its gid (code 1 has none)
        name = self.t.groups[v[at]].name if code != 1 else ""
        f: dict = {}
        if code == 1:
            f = dict(i=v[1], nc=v[2], slot=v[3], front=v[4], last=v[2] - 1)
        elif code == 2:
            why = "a write run of this step rewrote them" if v[7] else "earlier write runs rewrote them"
            f = dict(slot=v[1], gid=v[2], name=name, lo=v[3], nc=v[4], lo_pos=v[5], ring_lo=v[6], why=why)
        elif code == 3:
            f = dict(slot=v[1], gid=v[2], name=name, pos=v[3], other=v[4], kid=v[5])
        elif code == 4:
            f = dict(raw=v[1], kid=v[2], slot=v[3], pos=v[4], gid=v[5], name=name, other=v[6], opos=v[7],
                     since=" since this step" if v[8] else "")
        elif code in (5, 6):
            f = dict(slot=v[1], gid=v[2], name=name, ws=v[3], kid=v[4], pos=v[5], other=v[6], opos=v[7])
            if code == 5:
                f.update(mark=v[8], nc=v[9])
        elif code == 7:
            f = dict(slot=v[1], gid=v[2], name=name, kid=v[3], pos=v[4], nc=v[5], writer=v[6], fpos=v[7], step=v[8])
        elif code == 8:
            f = dict(raw=v[1], kid=v[2], slot=v[3], pos=v[4], gid=v[5], name=name, fpos=v[6], writer=v[7], step=v[8])
        elif code == 9:
            f = dict(raw=v[1], kid=v[2], slot=v[3], pos=v[4], gid=v[5], name=name, opos=v[6])
        elif code == 10:
            f = dict(kid=v[1], gid=v[2], name=name, slot=v[3])
        else:
            f = self._null_fields(v)
        reject(CODES[code], **f)

    def _null_fields(self, v) -> dict:
        g, grp = v[1], self.t.groups[v[1]]
        fk = int(self.t.f[g])
        col, size = v[4] // fk, grp.alloc_block_size
        more = v[5]
        return dict(kind=grp.kind, gid=g, slot=v[2], row=v[3], col=col, p0=col * size, p1=(col + 1) * size - 1,
                    local=", rank-local" if self.geo[g, 9] else "",
                    name=grp.name if grp.role in (None, grp.name) else f"{grp.name}, role {grp.role}",
                    lo_pos=v[6], last=v[7],
                    tail=f"; {more} more null entr{'y' if more == 1 else 'ies'} in this step" if more else "")

    # ------------------------------------------------------------------ inspection (tests, the oracle)
    def held(self, certain: bool = False) -> dict:
        """``{(gid, kernel id): live holders}`` of the committed state (``certain``: only where the holder
        certainly reads the block next); the counts (not ``certain``) are the kernel's own."""
        if not certain:
            k = self._keys
            c, key = self.fill[k, 4], self.fill[k, 6]
            return {(int(x) % self.G, int(x) // self.G): int(n) for x, n in zip(key.tolist(), c.tolist()) if n}
        t = self.t
        out: dict = {}
        for g in range(self.G):
            for s in np.flatnonzero(self.slot_st[0]).tolist():
                nb, ring = int(t.num_blocks[g, s]), int(t.ring[g])
                cert = int(self.cell_st[1, g, s]) if self.geo[g, 8] else 0
                low = max(int(self.cell_st[2, g, s]), nb - ring) if ring else 0
                for q in range(max(cert, low), nb):
                    kid = int(t.mirror[int(t.base[g] + s * t.cols[g] + (q % ring if ring else q))])
                    if kid >= int(t.f[g]):
                        out[(g, kid)] = out.get((g, kid), 0) + 1
        return out

    def snapshot(self) -> dict:
        """Every field of the committed state, in :meth:`NaiveOwners.snapshot`'s form."""
        k = self._keys
        k = k[self.fill[k, 0] >= 0]
        fills = {(int(x) % self.G, int(x) // self.G): tuple(int(y) for y in self.fill[h, :3])
                 for h, x in zip(k.tolist(), self.fill[k, 6].tolist())}
        return {"live": self.slot_st[0].astype(bool), "frontier": self.slot_st[1].copy(),
                "replay_mark": self.slot_st[2].copy(), "floor": self.cell_st[0].copy(),
                "hold": self.cell_st[1].copy(), "ring_lo": self.cell_st[2].copy(), "fills": fills,
                "seen": self.seen >> 1, "steps": self.steps}
