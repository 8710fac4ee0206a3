"""The step's arrays as the ownership passes take them (:func:`pack_step`, one compiled call into one buffer the
wrapper keeps between steps): what :meth:`BlockOwners.check` built with a dozen numpy calls a step (``P``, ``R``,
``raw0``, ``A``, ``FN``; layouts in :mod:`.kernel`'s docstring), the draft counts by the default rule
(:func:`.naive.default_drafts`, the definition) and the largest block id (the id limit)."""

from __future__ import annotations

from ..._numba import pin, ro, rw

__all__ = ["pack_step", "pack_size", "first_entries", "OK", "BAD_LENGTH", "BAD_GROUP"]

OK, BAD_LENGTH, BAD_GROUP = 0, 1, 2


def pack_size(B: int, N: int, n: int, F: int) -> int:
    """int64 entries :func:`pack_step` writes: ``P`` ``[7, B]``, ``R`` ``[6, N]``, ``raw0`` ``[N + 1]``, ``A``
    ``[2, n]``, ``FN`` ``[F]``, in that order."""
    return 7 * B + 7 * N + 1 + 2 * n + F


def first_entries(G: int, S: int) -> int:
    """Entries of the wrapper's buffer: the largest step a planner accepts (``B``, ``n`` at most ``S``, one run
    per (group, slot), distinct freed and distinct new slots)."""
    return pack_size(S, G * S, S, 2 * S)


def pack_step(slots, seq, q, rs, re, drafts, opts, gid, wslot, start, end, keep, cu, ids, f, all_slots,
              all_nc, free, new, buf):
    """Fill ``buf`` (:func:`pack_size` entries at least) for a plan of ``B = len(slots)`` batch rows, ``N =
    len(gid)`` write runs, ``n = len(all_slots)`` step rows and ``F = len(free) + len(new)`` freed / new slots.
    ``opts`` int64 ``[4]``: replay start given, replay end given, drafts given (``rs``, ``re``, ``drafts`` are
    read only then), ``next_n``. Returns ``(code, largest block id or 0)``: :data:`OK`, :data:`BAD_LENGTH` (an
    array's length not its count) or :data:`BAD_GROUP` (a run's group not below ``len(f)``): nothing is read out
    of range."""
    B, N, n = slots.shape[0], gid.shape[0], all_slots.shape[0]
    if seq.shape[0] != B or q.shape[0] != B or all_nc.shape[0] != n or cu.shape[0] != N + 1:
        return BAD_LENGTH, 0
    if (opts[0] and rs.shape[0] != B) or (opts[1] and re.shape[0] != B) or (opts[2] and drafts.shape[0] != B):
        return BAD_LENGTH, 0
    if wslot.shape[0] != N or start.shape[0] != N or end.shape[0] != N or keep.shape[0] != N:
        return BAD_LENGTH, 0
    if buf.shape[0] < 7 * B + 7 * N + 1 + 2 * n + free.shape[0] + new.shape[0]:
        return BAD_LENGTH, 0
    next_n = opts[3]
    for i in range(B):
        k = q[i]
        d = max(min(k - 1, next_n - 1), 0) if k <= next_n else 0  # NOTE: naive.default_drafts' rule
        if opts[2] and drafts[i] >= 0:
            d = drafts[i]
        buf[i], buf[B + i], buf[2 * B + i] = slots[i], seq[i], k
        buf[3 * B + i] = rs[i] if opts[0] else 0
        buf[4 * B + i] = re[i] if opts[1] else 0
        buf[5 * B + i], buf[6 * B + i] = d, opts[1]
    at, G = 7 * B, f.shape[0]
    raw = at + 6 * N
    buf[raw] = 0
    for r in range(N):
        g = gid[r]
        if not (0 <= g < G):
            return BAD_GROUP, 0
        buf[at + r], buf[at + N + r], buf[at + 2 * N + r] = g, wslot[r], start[r]
        buf[at + 3 * N + r], buf[at + 4 * N + r], buf[at + 5 * N + r] = end[r], keep[r], cu[r]
        buf[raw + 1 + r] = buf[raw + r] + (cu[r + 1] - cu[r]) // f[g]
    top = 0
    for j in range(ids.shape[0]):
        top = max(top, ids[j])
    at = raw + N + 1
    for j in range(n):
        buf[at + j], buf[at + n + j] = all_slots[j], all_nc[j]
    at += 2 * n
    for j in range(free.shape[0]):
        buf[at + j] = free[j]
    at += free.shape[0]
    for j in range(new.shape[0]):
        buf[at + j] = new[j]
    return OK, top


_I = ro("int64")
pack_step = pin(pack_step, (_I,) * 19 + (rw("int64"),))
