"""The ``--handovers K`` oracle of ``vllm_scheduler_loop.py``: hand-overs of blocks a holder may still read.

A sliding block that a live request ``q`` holds but does not certainly read (``Loop.certain``: behind the window
of ``q``'s first token in this step, or of the upper bound ``nc + n`` of its last step) may be handed on by a
scheduler that knows the drafts' fate (docs/DESIGN.md §5): the write is accepted and recorded, and a later step
in which ``q`` reads the block is rejected. Under ``--async-scheduling`` vLLM schedules a step before the drafts
of the one before are judged, so ``q``'s window can come back over such a block (drafts rejected: ``nc``
falls). Each hand-over copy replaces one new block id of a running request by such an id and is fed to a copy
(``copy.deepcopy``) of every pipeline, which must accept it; the copy then follows the real steps, and at each
step in which ``q`` is scheduled its window in that SchedulerOutput decides: the copy must reject the step when
the window covers the block (``q`` would read another request's fill) and accept it otherwise. The copy is
dropped once ``q`` can no longer read the block (its lower bound ``nc + n - d`` is past it, ``d`` its drafts),
``q`` ends, vLLM frees the block, or after ``HORIZON`` steps; a rejection on the copy for another reason is
counted apart (``handover_other_rejections``, the first messages printed): the copy's history differs from
vLLM's from the hand-over on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Tuple

HORIZON = 4  # NOTE: steps a copy follows; async scheduling corrects nc one step late (batch queue of two)


@dataclass
class Fork:
    """Copies of the pipelines after an accepted hand-over of block ``block`` (group ``g``, position ``j`` of
    holder ``q``'s list), made at step ``step``."""

    pipes: Dict[str, object]
    q: str
    g: int
    j: int
    block: int
    step: int
    band: bool


class Handovers:
    """Hand-over copies of each step and the forks that follow them (module docstring). ``loop``: the Loop
    (its owners' block lists, layout, ``certain``, random source and stats)."""

    def __init__(self, loop, limit: int):
        self.loop, self.limit, self.forks = loop, limit, []  # type: ignore[var-annotated]
        self.lower: Dict[str, int] = {}  # NOTE: request id -> nc + n - d of its last step (its lower bound)
        for key in ("handovers", "handovers_band", "handovers_accepted", "handover_reads_rejected",
                    "handover_reads_accepted", "handover_other_rejections"):
            loop.stats[key] = 0
        for key in ("handovers_never_read", "band_handovers_never_read"):
            loop.stats[key] = dict(past=0, ended=0, freed=0, horizon=0)

    def candidates(self, so, rid: str, g: int) -> Tuple[list, list]:
        """``(band, free)`` lists of ``(q, j, block)``: ids of group ``g`` held by exactly one live request
        ``q != rid`` that it does not certainly read (and ``rid`` does not hold); ``band``: ``q`` may still read
        it (``q`` not scheduled in ``so``, the block within the window of its lower bound, its last step's
        ``nc + n - d``), ``free``: behind that window too, or ``q`` scheduled in ``so`` (it moves past ``nc``)."""
        lp, held = self.loop, {}  # type: ignore[var-annotated]
        for r, lists in lp.owners.lists.items():
            for j, b in enumerate(lists[g]):
                if b:
                    held.setdefault(b, []).append((r, j))
        mine = set(lp.owners.lists[rid][g])
        band: list = []
        free: list = []
        for b, who in sorted(held.items()):
            (q, j), = who[:1]
            if len(who) > 1 or q == rid or b in mine or lp.certain(so, q, g, j):
                continue
            if q in so.num_scheduled_tokens:  # NOTE: its next nc is at least nc + n - d > nc: never read again
                free.append((q, j, b))
                continue
            lb = self.lower.get(q, 0)
            (band if (j + 1) * lp.owners.bs[g] - 1 >= lb - lp.layout.groups[g].window + 1 else free).append((q, j, b))
        return band, free

    def feed(self, so, step: int) -> List[str]:
        """Before the real step ``so``: advance every fork by it, then make up to ``limit`` hand-over copies of
        it, each fed to a deep copy of every pipeline (which must accept it)."""
        errors = self._advance(so, step)
        lp, c, made = self.loop, so.scheduled_cached_reqs, 0
        nc = dict(zip(c.req_ids, c.num_computed_tokens))
        for i, (rid, nb) in enumerate(zip(c.req_ids, c.new_block_ids)):
            if nb is None or rid in c.resumed_req_ids:
                continue
            for g, ids in enumerate(nb):
                if made >= self.limit or not ids or lp.layout.groups[g].kind != "sliding":
                    continue
                band, free = self.candidates(so, rid, g)
                cands = band or free  # NOTE: a band id when there is one: the hand-overs a read can follow
                if not cands:
                    continue
                q, j, b = cands[lp.mrng.randrange(len(cands))]
                lp.stats["handovers_band"] += bool(band)
                bad = copy.deepcopy(so)
                bad.scheduled_cached_reqs.new_block_ids[i][g][lp.mrng.randrange(len(ids))] = b
                made += 1
                errors += self._fork(bad, step, Fork({}, q, g, j, b, step, bool(band)),
                                     f"{rid!r} gid {g} took {q!r}'s block {b}")
        for r, n in so.num_scheduled_tokens.items():  # NOTE: the lower bounds this step leaves
            base = nc[r] if r in nc else next(x.num_computed_tokens for x in so.scheduled_new_reqs if x.req_id == r)
            self.lower[r] = base + n - len(so.scheduled_spec_decode_tokens.get(r, ()))
        return errors

    def _fork(self, bad, step: int, f: Fork, what: str) -> List[str]:
        st = self.loop.stats
        st["handovers"] += 1
        pipes = {lvl: copy.deepcopy(p) for lvl, p in self.loop.pipes.items()}
        for lvl, pipe in pipes.items():
            try:
                pipe.update(bad)
            except ValueError as e:
                return [f"HANDOVER REJECTED step {step} checks={lvl}: {what} (not certainly read): {e}"]
        st["handovers_accepted"] += 1
        f.pipes = pipes
        self.forks.append(f)
        return []

    def _reads(self, so, f: Fork) -> bool:
        """Whether ``f.q`` reads its block position ``f.j`` of group ``f.g`` in ``so`` (its window as sent)."""
        lp = self.loop
        c = so.scheduled_cached_reqs
        nc = dict(zip(c.req_ids, c.num_computed_tokens))[f.q]
        lo = max(nc - lp.layout.groups[f.g].window + 1, 0, lp.live.get(f.q, (0, 0))[0])
        bs = lp.owners.bs[f.g]
        return lo <= (f.j + 1) * bs - 1 and nc + so.num_scheduled_tokens[f.q] - 1 >= f.j * bs

    def _past(self, so, f: Fork) -> bool:
        """Whether ``f.q``'s window, at the lower bound ``nc + n - d`` its step ``so`` leaves, is past the block."""
        lp = self.loop
        c = so.scheduled_cached_reqs
        nc = dict(zip(c.req_ids, c.num_computed_tokens))[f.q]
        lb = nc + so.num_scheduled_tokens[f.q] - len(so.scheduled_spec_decode_tokens.get(f.q, ()))
        return lb - lp.layout.groups[f.g].window + 1 > (f.j + 1) * lp.owners.bs[f.g] - 1

    def _done(self, so, f: Fork, step: int) -> str:
        """Why ``f`` can be dropped before ``so`` (``""``: it cannot): ``q`` ended, vLLM freed the block, or
        the horizon passed."""
        lists = self.loop.owners.lists.get(f.q)
        if f.q in so.finished_req_ids or f.q in (so.preempted_req_ids or ()) or lists is None:
            return "ended"
        if f.j >= len(lists[f.g]) or lists[f.g][f.j] != f.block:
            return "freed"  # NOTE: vLLM freed it (q's committed window is past it); the copy would diverge
        return "horizon" if step - f.step > HORIZON else ""

    def _close(self, f: Fork, why: str) -> None:
        self.loop.stats["handovers_never_read" if not f.band else "band_handovers_never_read"][why] += 1

    def _advance(self, so, step: int) -> List[str]:
        """Feed ``so`` to every fork and judge it (module docstring); the errors."""
        st, errors, keep = self.loop.stats, [], []
        for f in self.forks:
            why = self._done(so, f, step)
            if why:
                self._close(f, why)
                continue
            scheduled = f.q in so.num_scheduled_tokens and f.q not in {r.req_id for r in so.scheduled_new_reqs}
            reads = scheduled and self._reads(so, f)
            verdicts = {}
            for lvl, pipe in f.pipes.items():
                try:
                    pipe.update(so)
                    verdicts[lvl] = None
                except ValueError as e:
                    verdicts[lvl] = str(e)
            rejected = [lvl for lvl, v in verdicts.items() if v is not None]
            if reads:
                for lvl in set(verdicts) - set(rejected):
                    st["handover_reads_accepted"] += 1
                    errors.append(f"HANDOVER READ ACCEPTED step {step} checks={lvl}: {f.q!r} reads gid {f.g} "
                                  f"block {f.block} (position {f.j}), filled by another request at step {f.step}")
                st["handover_reads_rejected"] += len(rejected) == len(verdicts)
            elif rejected:
                st["handover_other_rejections"] += 1
                if st["handover_other_rejections"] <= 3:
                    print(f"note: hand-over copy of step {f.step} rejected step {step} ({f.q!r} does not read "
                          f"the block): {verdicts[rejected[0]]}")
            elif scheduled and self._past(so, f):
                self._close(f, "past")
            else:
                keep.append(f)
        self.forks = keep
        return errors
