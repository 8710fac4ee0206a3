"""The judging half of :mod:`.owners`' rules on a planned :class:`~.ownership_rules.Step`: fills against
other holders (rule 3), blocks held again after a window moved back, and rows writing below their frontier
(rule 4). The suspects go through :meth:`BlockOwners.holders_by_key` (one table scan per group: the rare
path) before a one-line error naming both holders.
"""

from __future__ import annotations

import numpy as np

from .ownership_rules import Step, count_in, old_keys

__all__ = ["check_runs", "check_rewinds", "rewind_suspects"]

_SLOTS = 1 << 16  # NOTE: above every slot (capacity.py bounds max_num_reqs by 2**16); keys stay below 2**28


def check_runs(o, st: Step) -> None:
    """Rule 3: a fill acquisition has no other live holder (same-step hits aside); an old block a row
    holds again (its window moved back) has no other holder at all."""
    if st.reacq.size:
        _check_reacquired(o, st)
    fill = np.flatnonzero(st.acq_fill)
    if not fill.size:
        return
    fk = st.acq.take(fill)
    base = o.count.take(fk)
    if st.rel.size:
        base = base - count_in(st.rel_sorted, fk)
    bad = base > 0
    if fill.size < st.acq.size:  # NOTE: another row's prefix hit of the id in this same step holds it too
        hit = ~st.acq_fill
        hk = st.acq[hit]
        mine = count_in(np.sort(hk * _SLOTS + st.acq_slot[hit]), fk * _SLOTS + st.acq_slot.take(fill))
        bad |= count_in(np.sort(hk), fk) > mine  # NOTE: the row's own duplicate is the "full" level's
    if fk.size > 1:
        srt = np.sort(fk)
        d = srt[1:] == srt[:-1]
        if d.any():
            bad |= count_in(srt, fk) > 1
    sus = fill[bad]
    if sus.size:
        held = o.holders_by_key(st.acq.take(sus), st)
        for i in sus.tolist():
            _judge(o, st, i, held[int(st.acq[i])])


def _judge(o, st: Step, i: int, hs: list) -> None:
    """Slow path of one suspicious fill acquisition ``i`` (``hs``: the holders of its id): name the other
    holder, or accept an own duplicate."""
    key, slot, pos = int(st.acq[i]), int(st.acq_slot[i]), int(st.acq_pos[i])
    g, kid = key % o.G, key // o.G
    # NOTE: a same-step hit is the vLLM pattern only at the filler's block position (prefix sharing) and
    # when the filler writes the whole block (a fresh block; one whose head it claims computed has content)
    fresh = bool(st.acq_fresh[i])
    others = [h for h in hs if h[0] != slot and not (h[2] == "hit" and h[1] == pos and fresh)]
    mine = [h for h in hs if h[0] == slot and h[1] != pos]
    if not others and not (mine and o.full):
        return  # NOTE: its own duplicate under "safe" (the "full" level rejects it)
    t = o.tables
    grp, f = t.groups[g], int(t.f[g])
    r = int(st.acq_run[i])
    raw = _raw_index(o, st, r, pos)
    what = (f"write_ids[{raw}] = {kid // f} gives slot {slot} block position {pos // f} of gid {g} ({grp.name}), "
            f"where it writes")
    if others:
        h = others[0]
        when = " since this step" if h[2] == "fill" else ""
        raise ValueError(f"{what}, but slot {h[0]} holds block {kid // f} too (block position {h[1] // f}{when}): "
                         f"a token would write into a block another live request holds")
    raise ValueError(f"{what}, but the row holds block {kid // f} at block position {mine[0][1] // f} too: "
                     f"one block id twice in gid {g} of slot {slot}")


def _raw_index(o, st: Step, r: int, pos: int) -> int:
    """``write_ids`` index (allocation ids) of run ``r``'s kernel block at logical position ``pos``."""
    f = o.tables.f.take(st.gid)
    n_raw = (st.plan.w_cu[1:] - st.plan.w_cu[:-1]) // f
    return int(n_raw[:r].sum()) + (pos - int(st.s[r])) // int(f[r])


def rewind_suspects(o, st: Step):
    """Rule 4's candidates: ``(keys, slots, block positions)`` of old blocks rows rewrite below their
    frontier that another row may hold (count above one, or acquired in this step), or None."""
    b = st.b
    if not b.size:
        return None
    front = o.frontier.take(b)
    mark = np.maximum(front, o.replay_mark.take(b))
    low = (st.nc_b < front) | (st.ws_full < mark)
    if st.fresh is not None:
        low &= ~st.fresh.take(b)
    if not low.any():
        return None
    t, rows = o.tables, np.flatnonzero(low)
    G = np.flatnonzero(~t.circular)  # NOTE: circular blocks are never shared (always fills)
    n = rows.shape[0]
    gg = np.repeat(G, n)
    slots = np.tile(st.b[rows], G.shape[0])
    full = t.full[gg]
    top = np.where(full, np.tile(np.minimum(st.seq[rows], mark[rows]), G.shape[0]),
                   np.tile(np.minimum(st.seq[rows], front[rows]), G.shape[0]))
    ws = np.where(full, np.tile(st.ws_full[rows], G.shape[0]), np.tile(st.nc_b[rows], G.shape[0]))
    bs = t.bs.take(gg)
    lo, hi = o.owned(ws, gg) // bs, -(-o.owned(top, gg) // bs)
    key = gg * o.num_slots + slots
    held_hi = t.num_blocks.reshape(-1).take(key)  # NOTE: old ids only: below a run's start
    if st.N:
        o.cut[st.kr] = st.s
        held_hi = np.minimum(held_hi, o.cut.take(key))
        o.cut[st.kr] = np.iinfo(np.int64).max
    keys, who, pos = old_keys(o, gg, slots, np.maximum(lo, o.floor.reshape(-1).take(key)),
                               np.minimum(hi, held_hi), detail=True)
    if not keys.size:
        return None
    maybe = o.count.take(keys) > 1
    if st.acq.size:  # NOTE: acquired in this step by anyone (few keys: search the acquisitions into them)
        ks = np.sort(keys)
        at = np.minimum(np.searchsorted(ks, st.acq), ks.shape[0] - 1)
        found = ks[at[ks[at] == st.acq]]
        if found.size:
            maybe |= count_in(np.sort(found), keys) > 0
    if not maybe.any():
        return None
    return keys[maybe], who[maybe], pos[maybe]


def check_rewinds(o, st: Step, suspects) -> None:
    """Rule 4: blocks a row rewrites below its frontier (old ids, not replaced by a run) have no other holder."""
    if suspects is None:
        return
    t, b = o.tables, st.b
    held = o.holders_by_key(suspects[0], st)
    for key, slot, p in zip(*(x.tolist() for x in suspects)):
        g, kid = key % o.G, key // o.G
        others = [h for h in held[key] if h[0] != slot]
        if others:
            i = int(np.flatnonzero(b == slot)[0])
            ws = int(st.ws_full[i] if t.full[g] else st.nc_b[i])
            f, grp = int(t.f[g]), t.groups[g]
            mark = int(max(o.frontier[slot], o.replay_mark[slot]) if t.full[g] else o.frontier[slot])
            raise ValueError(f"slot {slot} writes gid {g} ({grp.name}) from position {ws}, below the position "
                             f"{mark} its steps already wrote or hold as a prefix (num_computed_tokens "
                             f"{int(st.nc_b[i])}), into block {kid // f} (block position {p // f}), but slot "
                             f"{others[0][0]} holds that block too (block position {others[0][1] // f}): a "
                             f"token would write into a block another live request holds")


def _check_reacquired(o, st: Step) -> None:
    base = o.count.take(st.reacq)
    if st.rel.size:
        base = base - count_in(st.rel_sorted, st.reacq)
    bad = base > 0
    if st.acq.size:
        bad |= count_in(np.sort(st.acq), st.reacq) > 0
    if not bad.any():
        return
    keys, slots, pos = (np.concatenate(x) for x in zip(*(old_keys(o, g_, s_, lo_, hi_, detail=True)
                                                         for g_, s_, lo_, hi_ in st.back)))
    sus = np.isin(keys, st.reacq[bad])  # NOTE: only these can have another holder (one table scan each)
    keys, slots, pos = keys[sus], slots[sus], pos[sus]
    t = o.tables
    held = o.holders_by_key(keys, st) if keys.size else {}
    for key, slot, p in zip(keys.tolist(), slots.tolist(), pos.tolist()):
        g, kid = key % o.G, key // o.G
        others = [h for h in held[key] if h[0] != slot]
        if others:
            f = int(t.f[g])
            raise ValueError(f"slot {slot} reads gid {g} ({t.groups[g].name}) at block position {p // f} again (its "
                             f"window moved back to blocks it had left; num_computed_tokens), but slot "
                             f"{others[0][0]} holds that block ({kid // f}) now: it would read another live "
                             f"request's KV")
