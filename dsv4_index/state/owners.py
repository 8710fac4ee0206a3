"""Who holds each block: the host proof that no step writes into another live request's KV
(docs/DESIGN.md §5 "What `update()` proves about a step"), kept incrementally.

State, per pipeline (``G`` groups, ``num_slots`` request slots):

* ``count`` int32, keyed ``kernel_id * G + gid``: how many live (slot, block position) pairs hold the id
  in that group. The null block (kernel ids ``0 .. f - 1``) is never counted.
* ``floor`` int64 ``[G, num_slots]``: the lowest logical block a sliding row holds: the block of its last
  step's window start (``max(nc - W + 1, replay_start)`` of the first token; blocks wholly behind it are
  released: vLLM frees them when it schedules the request). Full and circular rows hold every block.
* ``ring_lo`` int64 ``[G, num_slots]``: a ring row's columns hold logical blocks ``[max(ring_lo, blocks - ring),
  blocks)`` (the plan's ring check bounds the second term). An append (``s == keep == blocks``) keeps it; a run
  cutting the row back to ``s`` and storing from ``keep`` leaves the old valid blocks below ``s`` when
  ``keep == s`` and ``s`` is not below them, else ``[max(keep, e - ring), e)`` only.
* ``frontier`` int64 ``[num_slots]``: positions a slot's steps ever wrote (the largest ``seq_len``): the *filled
  mark* of every block the slot filled; in full groups a row's prefix hits end at its ``replay_end``:
  their mark is ``max(frontier, replay_mark)``, ``replay_mark`` int64 ``[num_slots]`` the largest ``replay_end``.

The rules (``checks="safe"``), each checked on what a step changes only:

1. **Reads stay in held columns.** A batch row reads a sliding group from the block of its window start;
   that block must be at or above the row's ``ring_lo`` (else the window lists would read a ring column
   that now holds a later block). A row whose window moved back holds the blocks it left again: each
   must have no other holder (the scheduler may have given it to someone else).
2. **No jump.** ``num_computed_tokens`` of a running row is at most its ``frontier``: it may rewind
   (rejected drafts), never skip positions nobody wrote.
3. **A block is filled by one request.** A block id a row acquires at a block position the row writes
   (from its write start on: ``(j + 1) * block_size > write start``; every ring block of a circular
   group) is a *fill*: legal only when no other live row holds the id after this step's releases, other
   than rows that acquire it in this same step, at the same block position, below their own write start,
   while the filler writes the whole block (a *hit* of a fresh block: vLLM registers a block in the prefix
   cache when it schedules the tokens that fill it, so a request admitted later in the same step shares
   the block its allocator fills in that step; a filler whose write start falls inside the block claims
   its head computed, so the block has content and is not fresh). An id
   acquired below the row's write start is a prefix *hit*: always legal to hold, never written by that row.
4. **Writes below a row's frontier touch no shared block.** A row writes from its write start on (``nc``;
   ``max(nc, replay_end)`` in full groups). Below its frontier (its full-group mark in full groups: rejected
   drafts rewritten, ``nc`` rewound, ``replay_end`` dropped during a replay) it writes blocks it already
   held, its own or prefix hits: each must have no other holder after the step (vLLM shares only blocks
   of known tokens, never one holding a draft). This also keeps bounded replay off prefix-shared blocks.

So a write into a shared block is legal exactly when the writer is the block's filler and the positions
are at or beyond its filled mark (the filler's frontier), the pattern vLLM's prefix cache
produces; every other write into a block another live request holds is rejected, naming both holders.
A row holding one id at two positions (its own duplicate) is the ``"full"`` level's to reject.

``"full"`` adds, for sliding groups: no id twice in a row from the window start on, and no null block in
the held blocks a step reads, scanned only below the per-row ``checked`` mark (the lowest block position
from which the row's held ids were verified; a row's window only moves up, so a steady row scans none).

Paths: :mod:`.ownership_batch` (steady, rejected-draft and churn steps against a batch-ordered view),
:mod:`.ownership_fast` (other one-id-append steps), else :mod:`.ownership_rules` + :mod:`.ownership_checks`
(every step; the only path that raises, so every message comes from there). ``count`` changes go through
:func:`~.ownership_rules.bump` (``np.add.at`` costs ~25 µs a call).

Memory: ``count`` grows with the largest kernel id seen (4 bytes x ``G`` per id, written through on growth so
that no step pays lazily zeroed pages); ids beyond
``2**28 / G`` are refused.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from .._common import cp_owned_count
from .checks.naive import held_and_duplicates
from .ownership_fast import commit_fast, plan_fast
from .ownership_batch import BatchView, commit_batch
from .ownership_checks import check_rewinds, check_runs, rewind_suspects
from .ownership_rules import Step, begin, bump, plan_general, release

__all__ = ["BlockOwners", "check_ring_capacity"]

_MAX_KEYS = 1 << 28


def check_ring_capacity(groups, num_speculative_tokens: int) -> None:
    """Circular groups need ``capacity >= window - 1 + num_speculative_tokens`` (a verify step's writes
    must never reach rows the next step reads after a rejection; DESIGN §4, ``from_config(circular=)``)."""
    for g in groups:
        if g.kind == "circular" and g.window is not None:
            need = g.window - 1 + num_speculative_tokens
            if g.ring_capacity < need:
                raise ValueError(f"circular group gid {g.gid} ({g.name!r}): capacity {g.ring_capacity} is below "
                                 f"window - 1 + num_speculative_tokens = {g.window} - 1 + "
                                 f"{num_speculative_tokens} = {need}")


class BlockOwners:
    """Block holders per (group, id), sliding floors and write floors of every slot (module docstring).

    Parameters
    ----------
    tables : BlockTables — geometry, block counts and host mirror (read only).
    cp : (world, rank, interleave) of the sharded groups.
    level : ``"safe"`` or ``"full"``.
    num_speculative_tokens : int — the ring capacity rule (:func:`check_ring_capacity`).
    """

    def __init__(self, tables, *, cp, level: str, num_speculative_tokens: int = 0):
        check_ring_capacity(tables.groups, num_speculative_tokens)
        G, num_slots = len(tables.groups), tables.max_num_reqs
        self.tables, self.G, self.num_slots, self.cp = tables, G, num_slots, cp
        self.full = level == "full"
        self.sliding = ~tables.full & ~tables.circular
        self.S = np.flatnonzero(self.sliding)
        self.sharded = tables.sharded & (cp[0] > 1)
        self.count = np.zeros(max(G, 1) << 10, dtype=np.int32)
        self.floor = np.zeros((G, num_slots), dtype=np.int64)
        self.ring_lo = np.zeros((G, num_slots), dtype=np.int64)
        self.checked = np.zeros((G, num_slots), dtype=np.int64)
        self.frontier = np.zeros(num_slots, dtype=np.int64)
        self.replay_mark = np.zeros(num_slots, dtype=np.int64)
        self.nc = np.zeros(num_slots, dtype=np.int64)           # NOTE: scratch: this step's nc by slot
        self.fa = np.zeros(G * num_slots, dtype=np.int64)       # NOTE: scratch: floors after the runs, by pair key
        self.cut = np.full(G * num_slots, np.iinfo(np.int64).max, dtype=np.int64)  # NOTE: scratch, kept at max
        self.S_key = (self.S * num_slots)[:, None]
        # NOTE: the fast path's geometry (state/ownership_fast.py)
        self.slow_geometry = bool(self.sharded.any()) or tables.fmax > 1
        self.wm1_S = (tables.window[self.S] - 1)[:, None]
        self.bs_S = tables.bs[self.S][:, None]
        self.gpos = np.full(G, -1, dtype=np.int64)
        self.gpos[self.S] = np.arange(self.S.size)
        self.pair_base = (tables.base[:, None] + np.arange(num_slots)[None, :] * tables.cols[:, None]).reshape(-1)
        self.ring_mod_S = np.where(tables.ring[self.S] > 0, tables.ring[self.S], np.iinfo(np.int64).max)[:, None]
        self.S_ring = bool((tables.ring[self.S] > 0).any())
        self.S_geo = list(zip(self.S.tolist(), self.wm1_S[:, 0].tolist(), self.bs_S[:, 0].tolist(),
                              self.ring_mod_S[:, 0].tolist()))  # NOTE: (gid, W - 1, bs, ring modulus), Python ints
        NC = self.NC = np.flatnonzero(~tables.circular)  # NOTE: the batch path's rule 4 (ownership_batch.py)
        self.nc_full, self.nc_bs = tables.full[NC][:, None], tables.bs[NC][:, None]
        self.nc_key = (NC * num_slots)[:, None]
        self.view: Optional[BatchView] = None  # NOTE: the batch path's view of the last batch
        self.view_retry = 0
        self.batch_geometry: Dict[int, dict] = {}  # NOTE: per batch size: the view's per-cell constants
        self.ring_list, self.cols_list = tables.ring.tolist(), tables.cols.tolist()
        self.base_list, self.bs_list = tables.base.tolist(), tables.bs.tolist()
        self.sliding_list, self.gpos_list = self.sliding.tolist(), self.gpos.tolist()
        self.fresh_map = np.zeros(num_slots, dtype=bool)  # NOTE: scratch, all False between calls
        self._pending: Optional[Tuple[object, Step]] = None

    def owned(self, x: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """Rank-local counts of global positions ``x`` for the sharded ones of ``groups`` (broadcast)."""
        sh = self.sharded[groups]
        if not sh.any():
            return x
        return np.where(sh, cp_owned_count(np.maximum(x, 0), *self.cp), x)

    def grow(self, max_key: int) -> None:
        """Room for keys up to ``max_key`` (zeros: ids never seen have no holder)."""
        if max_key < self.count.shape[0]:
            return
        if max_key >= _MAX_KEYS:
            raise ValueError(f"write_ids: block id {max_key // max(self.G, 1)} is beyond the ownership table's "
                             f"limit of {_MAX_KEYS // max(self.G, 1)} ids per group")
        n = 1 << int(max_key).bit_length()
        grown = np.empty(n, dtype=np.int32)  # NOTE: written through now: lazily zeroed pages would fault on
        m = self.count.shape[0]              # the steps' scattered first touches instead (~µs each)
        grown[:m] = self.count
        grown[m:] = 0
        self.count = grown

    # ------------------------------------------------------------------------------------------
    def check(self, plan) -> None:
        """Every ownership rule of ``plan`` (module docstring); raises ``ValueError`` and changes
        nothing observable (the count table may grow, with zeros)."""
        self._pending = None
        st = plan_fast(self, plan, None)
        if st is None:
            st = plan_general(self, plan, begin(self, plan))
            check_runs(self, st)
            check_rewinds(self, st, rewind_suspects(self, st))
            if self.full:
                held_and_duplicates(self, st)
        self._pending = (plan, st)

    def commit(self, plan) -> None:
        """Apply the accepted ``plan`` checked by the last :meth:`check`."""
        if self._pending is None or self._pending[0] is not plan:
            raise RuntimeError("BlockOwners.commit: the plan was not checked by BlockOwners.check")
        st = self._pending[1]
        self._pending = None
        if st.fast == "batch":
            commit_batch(self, st)
            return
        self.view = None
        if st.fast:
            commit_fast(self, st)
        else:
            self._commit_general(st)
        sl, b = st.all_slots, st.b
        if sl.shape[0] != b.shape[0]:  # NOTE: rows without tokens (batch rows: seq_len >= nc)
            self.frontier[sl] = np.maximum(self.frontier.take(sl), st.all_nc)
        if b.size:
            self.frontier[b] = np.maximum(self.frontier.take(b), st.seq)
            if st.re is not None:
                self.replay_mark[b] = np.maximum(self.replay_mark.take(b), st.re)

    def _commit_general(self, st: Step) -> None:
        if st.rel.size:
            release(self.count, st.rel)
        if st.acq.size:
            bump(self.count, st.acq, 1)
        if st.reacq.size:
            bump(self.count, st.reacq, 1)
        for s in (st.free, st.new):
            if s.size:
                self.floor[:, s] = 0
                self.ring_lo[:, s] = 0
                self.checked[:, s] = 0
                self.frontier[s] = 0
                self.replay_mark[s] = 0
        fl, ck, rl = self.floor.reshape(-1), self.checked.reshape(-1), self.ring_lo.reshape(-1)
        if st.kb is not None:
            fl[st.kb] = st.F1b
            ck[st.kb] = st.F1b
            rl[st.kb] = st.La
        if st.kr_s.size:
            fl[st.kr_s] = st.F1r_s
            ck[st.kr_s] = np.where(st.inb_s, st.F1r_s, st.e_s)
            rl[st.kr_s] = st.Lr_s

    def holders_by_key(self, keys: np.ndarray, st: Optional[Step] = None) -> Dict[int, List[Tuple[int, int, str]]]:
        """``{id key: holders}`` (:meth:`holders_of`) of id keys ``keys`` (``id * G + gid``), one table scan per
        group."""
        keys = np.unique(keys)
        out = {}
        for g in np.unique(keys % self.G).tolist():
            for kid, hs in self.holders_of(g, keys[keys % self.G == g] // self.G, st).items():
                out[kid * self.G + g] = hs
        return out

    def holders_of(self, g: int, kids, st: Optional[Step] = None) -> Dict[int, List[Tuple[int, int, str]]]:
        """``{kernel id: [(slot, block position, how)]}``: every holder of each id of ``kids`` in group ``g``
        after the step being checked (``how``: ``"held"``, or ``"fill"`` / ``"hit"`` acquired in this step), with
        one scan of the group's table (a step with many suspects costs one scan per group, not one per
        suspect); slow (suspect and error paths)."""
        t = self.tables
        want = np.unique(np.asarray(kids, dtype=np.int64))
        out: Dict[int, List[Tuple[int, int, str]]] = {k: [] for k in want.tolist()}
        m = t.mirrors[g]
        rows, cols = np.nonzero(np.isin(m, want))
        ring = int(t.ring[g])
        for slot, col, kid in zip(rows.tolist(), cols.tolist(), m[rows, cols].tolist()):
            n0 = int(t.num_blocks[g, slot])
            if st is not None and st.gone(slot):
                continue
            pos = (n0 - 1 - (n0 - 1 - col) % ring) if ring else col
            lo, hi = int(self.floor[g, slot]), n0
            if st is not None:
                lo, hi = st.kept(g, slot, lo, hi)
            if lo <= pos < hi:
                out[int(kid)].append((slot, pos, "held"))
        if st is not None:
            for kid in out:
                out[kid] += st.acquirers(kid * self.G + g)
        return out
