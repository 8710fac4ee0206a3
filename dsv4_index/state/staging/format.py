"""The staging format, defined here only: one int32 buffer per step, copied to the device in one piece.

Regions sized by the padded token count ``T_pad`` and ``rows = min(T_pad, max_num_reqs)`` (a batch never
has more rows than tokens), so that a CUDA graph captured for one ``T_pad`` replays any step of that size::

    header   [HEADER]      num_reqs B, num_tokens T, num_decodes, num_writes N, has_replay_start,
                           has_replay_end, 0, 0
    qsl      [rows + 1]    query_start_loc of the batch rows (decode first): qsl[0] = 0, qsl[b + 1] = qsl[b] + q[b]
    seq_lens [rows + 1]    (entries [0, B) written)
    slots    [rows + 1]    idx_mapping: request slot (block-table row) of each batch row
    replay_start [rows + 1] window floor per batch row (written and read when has_replay_start)
    replay_end   [rows + 1] write floor of prefix-cacheable groups per batch row (has_replay_end)
    tok_row  [T_pad + 1]   batch row of each token (entries [0, T) written)
    extra    [E, rows + 1] per-request arrays staged by channel builders (e.g. the indexer's cu)
    overlay  [G, rows, 3]  per (group, batch row): (lo, hi, payload offset) of the logical blocks
                           staged this step ([lo, hi) empty: nothing staged); the whole region is
                           zeroed every step, then one record per write run on a batch row
    writes   [N] values, then [N] flat destinations in the block-table buffer

The writes of a run ``(g, slot, start, end, keep, ids)``: logical blocks ``l`` from ``first = max(keep,
start)`` while ``l < end`` and ``l - start < len(ids)``, in run order; value ``ids[l - start]``,
destination ``base[g] + slot * cols[g] + ring_col(l, ring[g])`` (:mod:`dsv4_index.state._index`). Its
overlay record is ``(first, end, writes + the ids staged by the runs before it)``.

Only ``[0, used)`` is copied. :class:`StageLayout` gives the offsets for one ``T_pad``; the fused
kernel receives them as runtime arguments (``StageLayout.kernel_args``) and imports every other fact of
the format from here: the header fields (``H_*``), the per-batch-row stride (``rows + ROW_ARRAY_PAD``),
the overlay record (``OVERLAY_STRIDE``, ``OV_LO``, ``OV_HI``, ``OV_PAY``) and the halves of the writes
region (``W_VALUES``, ``W_DESTS``: half ``k`` is ``[writes + k * N, writes + (k + 1) * N)``). One writer
(:mod:`.kernel`, with :mod:`.naive` its definition), one reader (``fused/kernel.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["StageLayout", "HEADER", "OVERLAY_STRIDE", "write_halves", "LAY_FIELDS"]

HEADER = 8
H_NUM_REQS, H_NUM_TOKENS, H_NUM_DECODES, H_NUM_WRITES, H_REPLAY_START, H_REPLAY_END = range(6)
OVERLAY_STRIDE = 3                     # NOTE: int32 per (group, batch row) overlay record
OV_LO, OV_HI, OV_PAY = 0, 1, 2         # fields of an overlay record
ROW_ARRAY_PAD = 1                      # NOTE: a per-batch-row array holds rows + 1 int32 (qsl's closing entry)
W_VALUES, W_DESTS = 0, 1               # halves of the writes region, N int32 each
WRITE_HALVES = 2
# NOTE: the int64 vector a write pass reads the layout from (StageLayout.vector)
LAY_FIELDS = ("qsl", "seq_lens", "slots", "replay_start", "replay_end", "tok_row", "overlay", "writes", "rows",
              "t_pad", "extra")


def write_halves(h, writes: int, n: int):
    """``(values, destinations)``: the two halves of the writes region of staging buffer ``h`` (int32, the
    region starting at element ``writes``) for ``n`` staged writes, as views to fill."""
    return (h[writes + W_VALUES * n:writes + (W_VALUES + 1) * n],
            h[writes + W_DESTS * n:writes + (W_DESTS + 1) * n])


class StageLayout(NamedTuple):
    """Offsets (int32 elements) of every region for one padded token count."""

    t_pad: int
    rows: int
    qsl: int
    seq_lens: int
    slots: int
    replay_start: int
    replay_end: int
    tok_row: int
    extra: int
    overlay: int
    writes: int

    @classmethod
    def for_tokens(cls, t_pad: int, num_groups: int, num_extra: int, max_num_reqs: int) -> "StageLayout":
        rows = max(min(t_pad, max_num_reqs), 1)
        n = rows + ROW_ARRAY_PAD
        qsl = HEADER
        seq = qsl + n
        slots = seq + n
        rs = slots + n
        re = rs + n
        tok = re + n
        extra = tok + t_pad + 1
        ov = extra + num_extra * n
        writes = ov + OVERLAY_STRIDE * num_groups * rows
        return cls(t_pad, rows, qsl, seq, slots, rs, re, tok, extra, ov, writes)

    def extra_at(self, i: int) -> int:
        """Offset of extra array ``i``."""
        return self.extra + i * (self.rows + ROW_ARRAY_PAD)

    def kernel_args(self):
        """The offsets the fused kernel takes, in its argument order."""
        return (self.rows, self.qsl, self.seq_lens, self.slots, self.replay_start, self.replay_end, self.tok_row,
                self.extra, self.overlay, self.writes)

    def vector(self) -> np.ndarray:
        """int64 ``[len(LAY_FIELDS)]``: the offsets a write pass reads, in :data:`LAY_FIELDS` order."""
        return np.array([getattr(self, f) for f in LAY_FIELDS], dtype=np.int64)
