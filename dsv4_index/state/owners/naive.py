# over 400 lines: the rule's definition in one file (state, geometry, each check, the commit), read top to bottom
"""The ownership rule (:mod:`dsv4_index.state.owners`) by its definition: every step, the table rows as the
step leaves them are rebuilt (a copy of the mirror with the step's runs applied), the holders of every block
the step writes are found by scanning those rows, and every block a row reads is looked up in the fill
records. No holder counts: nothing is kept between steps but what the rule itself names (fills, what each
table cell last saw, frontiers, the bounds of each row's next position, ring low-water marks).

State (``G`` groups, ``S`` slots; block positions are logical kernel blocks, rank-local under DCP):

* ``live`` bool ``[S]``; ``frontier``, ``replay_mark`` int64 ``[S]`` (largest ``seq_len`` / ``replay_end``);
* ``floor`` int64 ``[G, S]``: the window block of the row's lower bound ``nc + n - d`` (sliding groups;
  blocks below are released); ``hold``: the window block of its upper bound ``nc + n`` (from there on a
  row that is not scheduled certainly reads); ``ring_lo``: the ring low-water mark;
* ``fills``: ``{(gid, kernel id): (slot, block position, step)}``, the last fill of each block;
  ``seen`` int64 per mirror cell: the step of the fill the cell's row last wrote or took.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..._common import cp_owned_count
from .messages import check_id_limit, reject

__all__ = ["NaiveOwners", "default_drafts"]


def default_drafts(plan, next_n: int) -> np.ndarray:
    """int64 ``[B]``: the plan's draft counts (``plan.drafts``; -1 entries and None: the default rule), the
    default rule being: ``min(n - 1, next_n - 1)`` for a row of at
    most ``next_n`` tokens, 0 for a prefill chunk."""
    n = np.asarray(plan.num_scheduled, dtype=np.int64)
    rule = np.where(n <= next_n, np.maximum(np.minimum(n - 1, next_n - 1), 0), 0)
    d = getattr(plan, "drafts", None)
    return rule if d is None else np.where(d < 0, rule, d)


class _Step:
    """One step as the rule sees it (scratch of :meth:`NaiveOwners.check`)."""

    def __init__(self, o: "NaiveOwners", plan):
        t = o.t
        self.plan = plan
        self.fresh = set(plan.new_slots.tolist())
        self.freed = set(plan.free_slots.tolist())
        self.live = o.live.copy()
        self.live[plan.free_slots] = False
        self.live[plan.new_slots] = True
        self.nc_of = dict(zip(plan.all_slots.tolist(), plan.all_computed.tolist()))
        self.row_of = {s: i for i, s in enumerate(plan.slots.tolist())}
        self.run_of = {(g, s): r for r, (g, s) in enumerate(zip(plan.w_gid.tolist(), plan.w_slot.tolist()))}
        self.nb = t.num_blocks.copy()
        self.nb[:, plan.free_slots] = 0
        self.nb[:, plan.new_slots] = 0
        self.nb[plan.w_gid, plan.w_slot] = plan.w_end
        self.mirror = t.mirror.astype(np.int64)
        self.acq: Dict[Tuple[int, int, int], Tuple[int, int, bool]] = {}  # (g, slot, pos) -> (run, raw, fill)
        for g, s, a, e, k, c0 in zip(*(x.tolist() for x in (plan.w_gid, plan.w_slot, plan.w_start, plan.w_end,
                                                             plan.w_keep, plan.w_cu[:-1]))):
            for p in range(max(a, k), e):
                self.mirror[o.cell(g, s, p)] = int(plan.w_ids[c0 + p - a])
        self.ring_lo = o.ring_lo.copy()
        self.ring_lo[:, plan.new_slots] = 0
        self.fills: Dict[Tuple[int, int], Tuple[int, int, int]] = {}  # this step's fills
        self.seen: Dict[int, int] = {}                                 # cell -> step (this step's)
        self.refills: List[Tuple[int, int, int, int]] = []             # (g, slot, pos, kid) written anew

    def row(self, s: int) -> int:
        return self.row_of.get(s, -1)


class NaiveOwners:
    """The rule, recomputed (module docstring). ``check(plan)`` raises or stores its scratch; ``commit(plan)``
    applies it (after :meth:`BlockTables.commit`)."""

    def __init__(self, tables, *, cp, full: bool, next_n: int):
        t = self.t = tables
        self.G, self.S = len(t.groups), t.max_num_reqs
        self.cp, self.full, self.next_n = cp, bool(full), int(next_n)
        self.sharded = t.sharded & (cp[0] > 1)
        self.sliding = ~t.full & ~t.circular
        self.live = np.zeros(self.S, dtype=bool)
        self.frontier = np.zeros(self.S, dtype=np.int64)
        self.replay_mark = np.zeros(self.S, dtype=np.int64)
        self.floor = np.zeros((self.G, self.S), dtype=np.int64)
        self.hold = np.zeros((self.G, self.S), dtype=np.int64)
        self.ring_lo = np.zeros((self.G, self.S), dtype=np.int64)
        self.fills: Dict[Tuple[int, int], Tuple[int, int, int]] = {}
        self.seen = np.zeros(t.mirror.shape[0], dtype=np.int64)
        self.steps = 0
        self._pending: Optional[Tuple[Any, _Step]] = None

    # ------------------------------------------------------------------ geometry
    def owned(self, x: int, g: int) -> int:
        return int(cp_owned_count(max(x, 0), *self.cp)) if self.sharded[g] else x

    def cell(self, g: int, s: int, p: int) -> int:
        ring = int(self.t.ring[g])
        return int(self.t.base[g] + s * self.t.cols[g] + (p % ring if ring else p))

    def lo_block(self, g: int, nc: int, rs: int) -> int:
        """The block of the lowest position a row at ``nc`` reads in sliding group ``g``."""
        pos = max(nc - int(self.t.window[g]) + 1, 0, rs)
        return self.owned(pos, g) // int(self.t.bs[g])

    def _bounds(self, st: _Step, g: int, s: int) -> Tuple[int, int, int]:
        """``(lowest held, lowest certainly read, blocks)`` of row ``s`` in group ``g`` after the step."""
        nb, ring = int(st.nb[g, s]), int(self.t.ring[g])
        if not self.sliding[g]:
            lo = max(nb - ring, 0) if ring else 0
            return lo, lo, nb
        i = st.row(s)
        if i >= 0:
            lo = cert = self._read_lo(st, g, i)
        elif s in st.fresh:
            lo = cert = self.lo_block(g, st.nc_of.get(s, 0), 0)
        else:
            lo, cert = int(self.floor[g, s]), int(self.hold[g, s])
        if ring:
            low = max(int(st.ring_lo[g, s]), nb - ring)
            lo, cert = max(lo, low), max(cert, low)
        return lo, cert, nb

    def _read_lo(self, st: _Step, g: int, i: int) -> int:
        p = st.plan
        rs = 0 if p.replay_start is None else int(p.replay_start[i])
        return self.lo_block(g, int(p.seq_lens[i] - p.num_scheduled[i]), rs)

    def _ws(self, st: _Step, g: int, i: int) -> Tuple[int, int]:
        """Rank-local write start and end of batch row ``i`` in group ``g``."""
        p = st.plan
        nc = int(p.seq_lens[i] - p.num_scheduled[i])
        ws = max(nc, int(p.replay_end[i])) if (self.t.full[g] and p.replay_end is not None) else nc
        return self.owned(ws, g), self.owned(int(p.seq_lens[i]), g)

    def holders(self, st: _Step, g: int, kid: int) -> List[Tuple[int, int, bool]]:
        """``[(slot, block position, certain)]``: every live row holding ``kid`` in group ``g`` after the step."""
        t = self.t
        cols, ring = int(t.cols[g]), int(t.ring[g])
        m = st.mirror[int(t.base[g]):int(t.base[g]) + self.S * cols].reshape(self.S, cols)
        out = []
        for s, c in zip(*(x.tolist() for x in np.nonzero(m == kid))):
            if not st.live[s]:
                continue
            lo, cert, nb = self._bounds(st, g, s)
            pos = (nb - 1 - (nb - 1 - c) % ring) if ring else c
            if lo <= pos < nb:
                out.append((s, pos, pos >= cert))
        return out

    def fill_of(self, st: _Step, g: int, kid: int) -> Optional[Tuple[int, int, int]]:
        got = st.fills.get((g, kid))
        return got if got is not None else self.fills.get((g, kid))

    # ------------------------------------------------------------------ check
    def check(self, plan) -> None:
        """Every ownership rule of ``plan``; raises ``ValueError`` (:mod:`.messages`), changes nothing."""
        self._pending = None
        if plan.w_ids.size:
            check_id_limit(int(plan.w_ids.max()), self.G)
        st = _Step(self, plan)
        self._no_jump(st)
        self._rings(st)
        self._acquisitions(st)
        self._writes(st)
        self._moved_back(st)
        self._reads(st)
        if self.full:
            self._held_nulls(st)
        self._pending = (plan, st)

    def _no_jump(self, st: _Step) -> None:
        p = st.plan
        for i, (s, nc) in enumerate(zip(p.all_slots.tolist(), p.all_computed.tolist())):
            if s not in st.fresh and nc > self.frontier[s]:
                reject("own.jump", i=i, nc=nc, slot=s, front=int(self.frontier[s]), last=nc - 1)

    def _rings(self, st: _Step) -> None:
        """Ring low-water marks after the runs; a batch row reading below its own is rejected."""
        t, p = self.t, st.plan
        for (g, s), r in st.run_of.items():
            if not (self.sliding[g] and t.ring[g]):
                continue
            ring, a, keep = int(t.ring[g]), int(p.w_start[r]), int(p.w_keep[r])
            n0 = 0 if s in st.fresh else int(t.num_blocks[g, s])
            l0 = int(st.ring_lo[g, s])
            true_old = max(l0, n0 - ring)
            if not (a == n0 and keep == a):
                st.ring_lo[g, s] = true_old if (keep == a and a >= true_old) else keep
        for i, s in enumerate(p.slots.tolist()):
            for g in np.flatnonzero(self.sliding & (t.ring > 0)).tolist():
                lo = self._read_lo(st, g, i)
                if lo < st.ring_lo[g, s]:
                    nc = int(p.seq_lens[i] - p.num_scheduled[i])
                    rs = 0 if p.replay_start is None else int(p.replay_start[i])
                    why = ("a write run of this step rewrote them" if (g, s) in st.run_of
                           else "earlier write runs rewrote them")
                    reject("own.ring", slot=s, gid=g, name=t.groups[g].name, lo=lo, nc=nc, why=why,
                           lo_pos=max(nc - int(t.window[g]) + 1, 0, rs), ring_lo=int(st.ring_lo[g, s]))

    def _row_writes(self, st: _Step, g: int, s: int) -> Tuple[int, int]:
        """Rank-local ``(write start, write end)`` of slot ``s`` in group ``g`` this step."""
        i = st.row(s)
        if i >= 0:
            return self._ws(st, g, i)
        if s in st.fresh:
            ws = self.owned(st.nc_of.get(s, 0), g)
        else:
            f = int(self.frontier[s])
            ws = self.owned(max(f, int(self.replay_mark[s])) if self.t.full[g] else f, g)
        return ws, ws

    def _acquisitions(self, st: _Step) -> None:
        """The ids the runs put at held positions: fills (where the row writes) before hits."""
        t, p = self.t, st.plan
        raw0 = np.concatenate([[0], np.cumsum((p.w_cu[1:] - p.w_cu[:-1]) // t.f[p.w_gid])]).tolist()
        fills: List[tuple] = []
        hits: List[tuple] = []
        for (g, s), r in st.run_of.items():
            a, e, keep, c0 = (int(x[r]) for x in (p.w_start, p.w_end, p.w_keep, p.w_cu))
            lo = self._bounds(st, g, s)[0]
            ws, we = self._row_writes(st, g, s)
            bs, f = int(t.bs[g]), int(t.f[g])
            for q in range(max(a, keep, lo), e):
                kid = int(p.w_ids[c0 + q - a])
                if kid < f:
                    continue
                fill = bool(t.circular[g]) or (q + 1) * bs > ws
                raw = raw0[r] + (q - a) // f
                st.acq[(g, s, q)] = (r, raw, fill)
                whole = bool(t.circular[g]) or (q * bs >= ws and (q + 1) * bs <= we)
                (fills if fill else hits).append((g, s, q, kid, raw, whole))
        for g, s, q, kid, raw, whole in fills:  # NOTE: every acquisition is known first (same-step hits)
            self._fill(st, g, s, q, kid, raw, whole)
        for g, s, q, kid, raw, _ in hits:
            self._hit(st, g, s, q, kid, raw)

    def _fill(self, st: _Step, g: int, s: int, q: int, kid: int, raw: int, whole: bool) -> None:
        """Prevention: no other live row certainly reads ``kid`` (a same-step hit at the same block position
        of a block written whole aside); the row's own second copy is the ``"full"`` level's."""
        f, name = int(self.t.f[g]), self.t.groups[g].name
        hs = self.holders(st, g, kid)
        for h, pos, cert in hs:
            if h == s or not cert:
                continue
            got = st.acq.get((g, h, pos))
            if got is not None and not got[2] and pos == q and whole:
                continue
            since = " since this step" if (got is not None and got[2]) else ""
            reject("own.fill_held", raw=raw, kid=kid // f, slot=s, pos=q // f, gid=g, name=name, other=h,
                   opos=pos // f, since=since)
        if self.full:
            for h, pos, _ in hs:
                got = st.acq.get((g, h, pos))
                if h == s and pos != q and (got is None or got[2]):  # NOTE: an own hit: own.twice_sliding
                    reject("own.twice", raw=raw, kid=kid // f, slot=s, pos=q // f, gid=g, name=name, opos=pos // f)
        st.fills[(g, kid)] = (s, q, self.steps + 1)
        st.seen[self.cell(g, s, q)] = self.steps + 1

    def _hit(self, st: _Step, g: int, s: int, q: int, kid: int, raw: int) -> None:
        """A prefix hit: the block was filled at the same block position (or nobody known filled it)."""
        t = self.t
        f = int(t.f[g])
        got = self.fill_of(st, g, kid)
        own = got is not None and got[0] == s and (g, kid) in st.fills  # NOTE: its own duplicate: "full"'s
        if got is not None and got[1] != q and not own:
            reject("own.hit_position", raw=raw, kid=kid // f, slot=s, pos=q // f, gid=g, name=t.groups[g].name,
                   fpos=got[1] // f, writer=got[0], step=got[2])
        if self.full and self.sliding[g]:
            for h, pos, _ in self.holders(st, g, kid):
                if h == s and pos != q:
                    reject("own.twice_sliding", kid=kid // f, gid=g, name=t.groups[g].name, slot=s)
        if got is None:
            got = st.fills[(g, kid)] = (s, q, self.steps + 1)
        st.seen[self.cell(g, s, q)] = got[2]

    def _writes(self, st: _Step) -> None:
        """Blocks a batch row writes that it held before the step: an extension of its own fill, or a write
        anew (below its frontier, or into a block someone else filled) that no other row certainly reads."""
        t, p = self.t, st.plan
        for i, s in enumerate(p.slots.tolist()):
            if s in st.fresh:
                continue
            for g in np.flatnonzero(~t.circular).tolist():
                ws, we = self._ws(st, g, i)
                bs, f = int(t.bs[g]), int(t.f[g])
                front = int(self.frontier[s])
                mark = self.owned(max(front, int(self.replay_mark[s])) if t.full[g] else front, g)
                for q in range(ws // bs, -(-we // bs)) if we > ws else ():
                    if (g, s, q) in st.acq or q >= st.nb[g, s]:
                        continue
                    c = self.cell(g, s, q)
                    kid = int(st.mirror[c])
                    if kid < f:
                        continue
                    rewind = ws < min(we, mark) and q * bs < min(we, mark)
                    got = self.fill_of(st, g, kid)
                    if not rewind and got is not None and got[:2] == (s, q) and got[2] == self.seen[c]:
                        continue
                    for h, pos, cert in self.holders(st, g, kid):
                        if h != s and cert:
                            if rewind:
                                reject("own.rewind_held", slot=s, gid=g, name=t.groups[g].name, ws=ws, mark=mark,
                                       nc=int(p.seq_lens[i] - p.num_scheduled[i]), kid=kid // f, pos=q // f,
                                       other=h, opos=pos // f)
                            reject("own.write_held", slot=s, gid=g, name=t.groups[g].name, ws=ws, kid=kid // f,
                                   pos=q // f, other=h, opos=pos // f)
                    st.fills[(g, kid)] = (s, q, self.steps + 1)
                    st.seen[c] = self.steps + 1

    def _moved_back(self, st: _Step) -> None:
        """A batch row whose window moved below its floor holds those blocks again: no other holder."""
        t, p = self.t, st.plan
        for i, s in enumerate(p.slots.tolist()):
            if s in st.fresh:
                continue
            for g in np.flatnonzero(self.sliding).tolist():
                lo = self._read_lo(st, g, i)
                f = int(t.f[g])
                for q in range(lo, min(int(self.floor[g, s]), int(st.nb[g, s]))):
                    if (g, s, q) in st.acq:
                        continue
                    kid = int(st.mirror[self.cell(g, s, q)])
                    if kid < f:
                        continue
                    for h, _, _ in self.holders(st, g, kid):
                        if h != s:
                            reject("own.again", slot=s, gid=g, name=t.groups[g].name, pos=q // f, other=h,
                                   kid=kid // f)

    def _reads(self, st: _Step) -> None:
        """Detection: a sliding block a batch row reads below its write start holds what the row last wrote or
        took (the fill it saw, at the block position it reads)."""
        t, p = self.t, st.plan
        for i, s in enumerate(p.slots.tolist()):
            for g in np.flatnonzero(self.sliding).tolist():
                ws, _ = self._ws(st, g, i)
                bs, f = int(t.bs[g]), int(t.f[g])
                for q in range(self._read_lo(st, g, i), min(-(-ws // bs), int(st.nb[g, s]))):
                    if (g, s, q) in st.acq:
                        continue
                    c = self.cell(g, s, q)
                    kid = int(st.mirror[c])
                    got = self.fill_of(st, g, kid) if kid >= f else None
                    if got is None:
                        continue
                    if got[2] != st.seen.get(c, int(self.seen[c])) or got[1] != q:
                        reject("own.stale_read", slot=s, gid=g, name=t.groups[g].name, kid=kid // f, pos=q // f,
                               nc=int(p.seq_lens[i] - p.num_scheduled[i]), writer=got[0], fpos=got[1] // f,
                               step=got[2])

    def _held_nulls(self, st: _Step) -> None:
        """``"full"``: no null block among the held sliding blocks a batch row reads (a run's own ids were
        checked as write ids)."""
        t, p = self.t, st.plan
        for i, s in enumerate(p.slots.tolist()):
            for g in np.flatnonzero(self.sliding).tolist():
                lo, f = self._read_lo(st, g, i), int(t.f[g])
                r = st.run_of.get((g, s))
                hi = int(st.nb[g, s]) if r is None else min(int(st.nb[g, s]), int(p.w_start[r]))
                bad = [q for q in range(lo, hi) if int(st.mirror[self.cell(g, s, q)]) < f]
                if bad:
                    grp = t.groups[g]
                    col, size = bad[0] // f, grp.alloc_block_size
                    nc = int(p.seq_lens[i] - p.num_scheduled[i])
                    rs = 0 if p.replay_start is None else int(p.replay_start[i])
                    more = len(bad) - 1
                    reject("own.held_null", kind=grp.kind, gid=g, slot=s, row=i, col=col, p0=col * size,
                           p1=(col + 1) * size - 1, local=", rank-local" if self.sharded[g] else "",
                           name=grp.name if grp.role in (None, grp.name) else f"{grp.name}, role {grp.role}",
                           lo_pos=max(nc - int(t.window[g]) + 1, 0, rs), last=int(p.seq_lens[i]) - 1,
                           tail=f"; {more} more null entr{'y' if more == 1 else 'ies'} in this step" if more else "")

    # ------------------------------------------------------------------ commit
    def commit(self, plan) -> None:
        """Apply the accepted ``plan`` checked by the last :meth:`check` (after the tables' commit)."""
        if self._pending is None or self._pending[0] is not plan:
            raise RuntimeError("BlockOwners.commit: the plan was not checked by BlockOwners.check")
        st = self._pending[1]
        self._pending = None
        self.steps += 1
        self.fills.update(st.fills)
        for c, v in st.seen.items():
            self.seen[c] = v
        gone = np.concatenate([plan.free_slots, plan.new_slots])
        for a in (self.frontier, self.replay_mark):
            a[gone] = 0
        for a in (self.floor, self.hold):
            a[:, gone] = 0
        self.ring_lo[...] = st.ring_lo
        self.ring_lo[:, ~st.live] = 0  # NOTE: a slot freed and taken again in this step keeps its new mark
        self.live[:] = st.live
        d = default_drafts(plan, self.next_n)
        for i, s in enumerate(plan.slots.tolist()):
            seq = int(plan.seq_lens[i])
            rs = 0 if plan.replay_start is None else int(plan.replay_start[i])
            self.frontier[s] = max(int(self.frontier[s]), seq)
            if plan.replay_end is not None:
                self.replay_mark[s] = max(int(self.replay_mark[s]), int(plan.replay_end[i]))
            for g in np.flatnonzero(self.sliding).tolist():
                self.floor[g, s] = self.lo_block(g, seq - int(d[i]), rs)
                self.hold[g, s] = self.lo_block(g, seq, rs)
        for s, nc in st.nc_of.items():
            if st.row(s) < 0:
                self.frontier[s] = max(int(self.frontier[s]), nc)
                if s in st.fresh:
                    for g in np.flatnonzero(self.sliding).tolist():
                        self.floor[g, s] = self.hold[g, s] = self.lo_block(g, nc, 0)

    # ------------------------------------------------------------------ inspection (tests, the oracle)
    def held(self, certain: bool = False) -> Dict[Tuple[int, int], int]:
        """``{(gid, kernel id): live holders}`` of the committed state (``certain``: only where the holder
        certainly reads the block next)."""
        t = self.t
        out: Dict[Tuple[int, int], int] = {}
        for g in range(self.G):
            for s in np.flatnonzero(self.live).tolist():
                nb, ring = int(t.num_blocks[g, s]), int(t.ring[g])
                lo, cert = (int(self.floor[g, s]), int(self.hold[g, s])) if self.sliding[g] else (0, 0)
                low = max(int(self.ring_lo[g, s]), nb - ring) if ring else 0
                for q in range(max(cert if certain else lo, low), nb):
                    kid = int(t.mirror[self.cell(g, s, q)])
                    if kid >= int(t.f[g]):
                        out[(g, kid)] = out.get((g, kid), 0) + 1
        return out

    def snapshot(self) -> dict:
        """Every field of the committed state (tests compare two implementations with it)."""
        return {"live": self.live.copy(), "frontier": self.frontier.copy(), "replay_mark": self.replay_mark.copy(),
                "floor": self.floor.copy(), "hold": self.hold.copy(), "ring_lo": self.ring_lo.copy(),
                "fills": dict(self.fills), "seen": self.seen.copy(), "steps": self.steps}
