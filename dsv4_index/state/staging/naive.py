"""The staging bytes from the format's definition (:mod:`.format`), whole-step numpy: the reference the
write pass (:mod:`.kernel`) is compared with, byte for byte, on randomized steps (same arguments, same
return on a valid step; no range checks: give it checked plans only)."""

from __future__ import annotations

import numpy as np

from ...ops.indexer_lengths.naive import staged_cu

__all__ = ["stage_step"]


def stage_step(h, mirror, geo, lay, scal, slots, q, seq, rs, re, gid, slot, start, end, keep, row, cu, ids):
    """What :func:`.kernel.stage_step` writes, region by region; returns ``(N, 0, 0)``."""
    B, (T, nd, has_rs, has_re, _) = slots.shape[0], scal.tolist()
    o_qsl, o_seq, o_slots, o_rs, o_re, o_tok, o_ov, w0, R, _, o_ext = lay[:11].tolist()
    for k, ratio, world, rank, inter in lay[12:].reshape(-1, 5).tolist():
        at = o_ext + k * (R + 1)
        staged_cu(seq, q, h[at:at + B + 1], compress_ratio=ratio, cp_world_size=world, cp_rank=rank,
                  cp_interleave=inter)
    G = geo.shape[0]
    n = cu[1:] - cu[:-1]
    first = np.maximum(keep, start)
    kept = np.maximum(np.minimum(end, start + n) - first, 0)
    N = int(kept.sum())
    h[:8] = [B, T, nd, N, has_rs, has_re, 0, 0]
    h[o_qsl:o_qsl + B + 1] = np.concatenate([[0], np.cumsum(q)])
    h[o_tok:o_tok + T] = np.repeat(np.arange(B), q)
    h[o_seq:o_seq + B] = seq
    h[o_slots:o_slots + B] = slots
    if has_rs:
        h[o_rs:o_rs + B] = rs
    if has_re:
        h[o_re:o_re + B] = re
    ov = h[o_ov:o_ov + 3 * G * R].reshape(G, R, 3)
    ov[:] = 0
    pay = w0 + np.cumsum(kept) - kept
    on = row >= 0
    ov[gid[on], row[on]] = np.stack([first, end, pay], axis=1)[on]
    # NOTE: every kept id: run index and logical block, from a mask over each run's ids
    run = np.repeat(np.arange(gid.shape[0]), n)
    logical = start[run] + (np.arange(int(cu[-1] - cu[0])) - np.repeat(cu[:-1] - cu[0], n))
    take = (logical >= first[run]) & (logical < end[run])
    run, logical = run[take], logical[take]
    g = gid[run]
    ring = geo[g, 2]
    col = np.where(ring > 0, logical % np.maximum(ring, 1), logical)
    dst = geo[g, 0] + slot[run] * geo[g, 1] + col
    vals = ids[cu[0]:cu[-1]][take]
    h[w0:w0 + N] = vals
    h[w0 + N:w0 + 2 * N] = dst
    mirror[dst] = vals
    return N, 0, 0
