"""Split window programs of the large tiles (``TileConfig.split``): the per-row chain one row per lane, then the
tiles.

A window program's cost is warp-instructions, and most of them are its per-row chain (token map, ``seq_lens`` /
``query_start_loc``, table row, floors, window start, overlay record, three table entries, slot mapping): in a
``[BT, BC]`` tile every row's values are replicated over the 32 lanes of the row's warp, so each warp runs the
chain once per row it holds (benchmarks/results/h200_2026-12-02_s10/PREFILL.md). A split program runs the chain on
1-D tensors of its ``BT`` rows, one row per lane (the chain's cost per warp is one row's, whatever ``BT``), stores
the 1-D outputs (lens, slot mappings) from there and the words its tiles need (:func:`_words`, ``SPLIT_WORDS`` per
row) into the task's scratch (allocated once by the plan, ``O_SCRATCH``), then, after a barrier, every warp reads
its rows' words back in the tile's layout and writes the index lists (:func:`_tile`).

Tile entry ``j`` of a row is the slot of local position ``first + j``; with ``off = first % S`` it lies in block
``b0 + k``, ``k = (off + j) // S`` (``j < c1 = S - off``: k = 0, ``j < c1 + S``: 1, else 2; ``2 S >= BC``), and is
``S_k + j`` with ``S_k = e_k * S + off - k S`` (int32: the int64 slot truncated, as :func:`window_from_blocks`),
``-1`` unless ``j < L_k`` (``L_k``: the row's listed entries inside the table, ``-1`` for a negative ``e_k``).
"""

from __future__ import annotations

from .._triton import triton, tl

from ..ops._device import raw_slot, window_blocks, window_len
from ..state.staging import H_REPLAY_END, H_REPLAY_START
from .tasks import (FLAG_CIRCULAR, FLAG_WINDOW_FLOOR, FLAG_WRITE_FLOOR, G_TABLE, HAS_OUT2, HAS_OUT3, NF, O_SCRATCH,
                    OUTS_WORDS, S_BC, S_BLOCK_SIZE, S_BT, S_CPI, S_CPR, S_CPW, S_FLAGS, S_FOLD, S_HAS, S_RING, S_TASK,
                    S_WIDTH, S_WINDOW, SPLIT_WORDS)
from .query import query_rows_padded
from .window import out_ptr, overlay, table_words, token_rows

# NOTE: plain ints of state/staging.py wrapped as tl.constexpr (kernel.py says why)
_H_REPLAY_START: tl.constexpr = tl.constexpr(H_REPLAY_START)
_H_REPLAY_END: tl.constexpr = tl.constexpr(H_REPLAY_END)


@triton.jit
def window_split(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, k0, t0, T_pad, rows, off_qsl, off_seq,
                 off_slots, off_rs, off_re, off_tok, off_ov, qslq, TAB: tl.constexpr, TI: tl.constexpr,
                 QUERY: tl.constexpr, LOG_R: tl.constexpr):
    """Token rows ``t0 + [0, BT)`` of the ``S_FOLD`` window tasks ``k0, k0 + 1, ...`` of unit ``TI``: every task's
    loads, then its 1-D stores and scratch words, a barrier, then every task's tile. ``QUERY`` (a declared step,
    ``qslq`` its staged ``query_start_loc_q``, fused/query.py): the lists and lens are those of query rows
    ``t0 + [0, BT)``, the slot mappings stay per source token."""
    FLAGS: tl.constexpr = TAB[TI * NF + S_FLAGS]
    HAS: tl.constexpr = TAB[TI * NF + S_HAS]
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    FOLD: tl.constexpr = TAB[TI * NF + S_FOLD]
    t, in_out, b, valid, seq, end, pos = token_rows(stage_ptr, t0, T_pad, off_qsl, off_seq, off_tok, BT)
    row = tl.load(stage_ptr + off_slots + b, mask=valid, other=0)
    if QUERY:  # NOTE: the lists' rows: query rows (their loads beside the source rows')
        u, in_q, b_q, valid_q, seq_q, end_q, pos_q, lim = query_rows_padded(stage_ptr, qslq, t0, T_pad, rows, off_seq,
                                                                            BT, LOG_R)
        row_q = tl.load(stage_ptr + off_slots + b_q, mask=valid_q, other=0)
    else:
        u, in_q, b_q, valid_q, pos_q, row_q, lim = t, in_out, b, valid, pos, row, T_pad
    wfloor = tl.zeros_like(pos)
    if (FLAG_WRITE_FLOOR & FLAGS) != 0:
        wfloor = tl.load(stage_ptr + off_re + b, mask=tl.where(tl.load(stage_ptr + _H_REPLAY_END) != 0, valid, False),
                         other=0)  # NOTE: tl.where, not `valid & flag`: Triton 3.9's interpreter (kernel._request_task)
    floor = tl.zeros_like(pos)
    if (FLAG_WINDOW_FLOOR & FLAGS) != 0:
        floor = tl.load(stage_ptr + off_rs + b_q,
                        mask=tl.where(tl.load(stage_ptr + _H_REPLAY_START) != 0, valid_q, False),
                        other=0)  # NOTE: tl.where, not `valid & flag`: Triton 3.9's interpreter (kernel._request_task)
    first, n = window_len(pos_q, valid_q, floor, TAB[TI * NF + S_WINDOW], TAB[TI * NF + S_CPW], TAB[TI * NF + S_CPR],
                          TAB[TI * NF + S_CPI])
    q_start = tl.zeros_like(pos)
    if (FLAG_CIRCULAR & FLAGS) != 0:
        q_start = tl.load(stage_ptr + off_qsl + b_q, mask=valid_q, other=0)
    done = ()  # type: tuple
    for k in tl.static_range(FOLD):  # NOTE: every task's loads before the first store
        orow = outs_ptr + (TAB[TI * NF + S_TASK] + k0 + k) * OUTS_WORDS
        done = done + (_words(stage_ptr, tables_ptr, orow, valid, seq, pos, row, wfloor, b, u, valid_q, pos_q, row_q,
                              first, n, b_q, rows, off_ov, TAB, TI, QUERY),)
    r = tl.arange(0, BT)
    slow = 0
    for k in tl.static_range(FOLD):
        orow = outs_ptr + (TAB[TI * NF + S_TASK] + k0 + k) * OUTS_WORDS
        words, slot, tail, neg = done[k]
        slow = slow | tl.max(neg, axis=0)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + u, n, mask=in_q)
        if (HAS_OUT2 & HAS) != 0:
            tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 2, 8) + t, slot, mask=in_out)
        if (HAS_OUT3 & HAS) != 0:
            tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 3, 8) + t, tail, mask=in_out)
        scr = base32 + tl.load(orow + O_SCRATCH) + t0 * SPLIT_WORDS + r
        for w in tl.static_range(len(words)):
            tl.store(scr + w * BT, words[w], mask=in_q)
        if (FLAG_CIRCULAR & FLAGS) != 0:
            tl.store(scr + 9 * BT, n, mask=in_q)
            tl.store(scr + 10 * BT, q_start, mask=in_q)
    tl.debug_barrier()  # NOTE: a row's words, stored by one lane, are read by the warp that holds the row's tile
    if QUERY:
        if t0 < lim:  # NOTE: a declared step's programs past its query rows have no tile
            _tiles(base32, base64, base8, outs_ptr, k0, t0, lim, slow, TAB, TI)
    else:
        _tiles(base32, base64, base8, outs_ptr, k0, t0, lim, slow, TAB, TI)


@triton.jit
def _tiles(base32, base64, base8, outs_ptr, k0, t0, lim, slow, TAB: tl.constexpr, TI: tl.constexpr):
    """Every task's tile of :func:`window_split` (rows ``t0 + [0, BT)`` below ``lim``)."""
    FOLD: tl.constexpr = TAB[TI * NF + S_FOLD]
    for k in tl.static_range(FOLD):
        orow = outs_ptr + (TAB[TI * NF + S_TASK] + k0 + k) * OUTS_WORDS
        scr = base32 + tl.load(orow + O_SCRATCH) + t0 * SPLIT_WORDS
        out0 = out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4)
        if slow != 0:  # NOTE: a listed block id is negative: each block's own limit
            _tile(scr, out0, t0, lim, True, TAB, TI)
        else:
            _tile(scr, out0, t0, lim, False, TAB, TI)


@triton.jit
def _words(stage_ptr, tables_ptr, orow, valid, seq, pos, row, wfloor, b, u, valid_q, pos_q, row_q, first, n, b_q,
           rows, off_ov, TAB: tl.constexpr, TI: tl.constexpr, QUERY: tl.constexpr):
    """One task's loads: for list rows ``u`` (1-D; batch rows ``b_q``, positions ``pos_q``, table rows ``row_q``)
    the tile's words ``c1, S_0..S_2, L, L_0..L_2`` and, circular groups, ``u - pos_q + first``; for token rows
    (``b``, ``pos``, ``row``) the slot mapping and the write plan (zeros where the task has none); and whether a
    listed block id is negative (int32). Without ``QUERY`` both are the same rows."""
    HAS: tl.constexpr = TAB[TI * NF + S_HAS]
    S: tl.constexpr = TAB[TI * NF + S_BLOCK_SIZE]
    CPW: tl.constexpr = TAB[TI * NF + S_CPW]
    CPR: tl.constexpr = TAB[TI * NF + S_CPR]
    CPI: tl.constexpr = TAB[TI * NF + S_CPI]
    geo, stride, twidth, ring, gid = table_words(orow, TAB[TI * NF + S_RING])
    bt = tables_ptr + tl.load(geo + G_TABLE)
    lo, hi, pay = overlay(stage_ptr, off_ov, gid, rows, b, valid)
    if QUERY:
        lo_q, hi_q, pay_q = overlay(stage_ptr, off_ov, gid, rows, b_q, valid_q)
    else:
        lo_q, hi_q, pay_q = lo, hi, pay
    e = window_blocks(bt, row_q, first, n, 0, S, twidth, ring, stride, stage_ptr, lo_q, hi_q, pay_q, True,
                      TAB[TI * NF + S_BC])
    slot = tl.zeros_like(pos).to(tl.int64)
    tail = slot
    if (HAS_OUT2 & HAS) != 0:
        slot = raw_slot(bt, row, pos, valid, wfloor, S, twidth, ring, stride, CPW, CPR, CPI, stage_ptr, lo, hi, pay,
                        True)
    if (HAS_OUT3 & HAS) != 0:
        tail = raw_slot(bt, row, pos, valid, seq - S * tl.maximum(ring, 1), S, twidth, ring, stride, CPW, CPR, CPI,
                        stage_ptr, lo, hi, pay, True)
    off = first % S
    # NOTE: the listed entries inside the table's logical width (window_from_blocks' ok), int64: no wrap
    lim = tl.maximum(tl.minimum(n.to(tl.int64), twidth.to(tl.int64) * S - first), -1).to(tl.int32)
    words = ()  # type: tuple
    words = words + (S - off, e[0] * S + off, e[1] * S + (off - S), e[2] * S + (off - 2 * S), lim,
                     tl.where(e[0] < 0, -1, lim), tl.where(e[1] < 0, -1, lim), tl.where(e[2] < 0, -1, lim))
    if (FLAG_CIRCULAR & TAB[TI * NF + S_FLAGS]) != 0:
        words = words + (u - pos_q + first,)
    return words, slot, tail, ((e[0] < 0) | (e[1] < 0) | (e[2] < 0)).to(tl.int32)


@triton.jit
def _tile(scr, out0, t0, T_pad, SLOW: tl.constexpr, TAB: tl.constexpr, TI: tl.constexpr):
    """Index-list rows ``t0 + [0, BT)`` from their scratch words, ``SLAB`` rows at a time (8 entries a thread), a
    slab's words loaded before the previous slab's store; ``SLOW``: some listed block id is negative (``L_k`` per
    block, else the row's limit ``L``)."""
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    BC: tl.constexpr = TAB[TI * NF + S_BC]
    WIDTH: tl.constexpr = TAB[TI * NF + S_WIDTH]
    S: tl.constexpr = TAB[TI * NF + S_BLOCK_SIZE]
    CIRCULAR: tl.constexpr = (FLAG_CIRCULAR & TAB[TI * NF + S_FLAGS]) != 0
    SLAB: tl.constexpr = BT // ((BT * BC + 1023) // 1024)
    j = tl.arange(0, BC)[None, :]
    nxt = _slab_words(scr, 0, SLOW, TAB, TI)
    for s in tl.static_range(BT // SLAB):
        w = nxt
        if s + 1 < BT // SLAB:  # NOTE: the next slab's words load before this slab's store
            nxt = _slab_words(scr, (s + 1) * SLAB, SLOW, TAB, TI)
        a = j < w[0]
        b = j < w[0] + S
        if SLOW:
            idx = tl.where(j < tl.where(a, w[4], tl.where(b, w[5], w[6])),
                           tl.where(a, w[1], tl.where(b, w[2], w[3])) + j, -1)
        else:
            idx = tl.where(j < w[4], tl.where(a, w[1], tl.where(b, w[2], w[3])) + j, -1)
        if CIRCULAR:  # in-step entries: -2 - their token row
            rr = w[len(w) - 3] + j
            idx = tl.where((j < w[len(w) - 2]) & (rr >= w[len(w) - 1]), -2 - rr, idx)
        tt = t0 + s * SLAB + tl.arange(0, SLAB)
        if WIDTH % BC == 0:
            m = tl.broadcast_to((tt < T_pad)[:, None], [SLAB, BC])
        else:
            m = (tt < T_pad)[:, None] & (j < WIDTH)
        tl.store(out0 + tt.to(tl.int64)[:, None] * WIDTH + j, idx, mask=m)


@triton.jit
def _slab_words(scr, r0, SLOW: tl.constexpr, TAB: tl.constexpr, TI: tl.constexpr):
    """The scratch words :func:`_tile` needs for rows ``r0 + [0, SLAB)``, ``[SLAB, 1]`` each."""
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    SLAB: tl.constexpr = BT // ((BT * TAB[TI * NF + S_BC] + 1023) // 1024)
    p = scr + r0 + tl.arange(0, SLAB)[:, None]
    w = ()  # type: tuple
    w = w + (tl.load(p), tl.load(p + BT), tl.load(p + 2 * BT), tl.load(p + 3 * BT))
    if SLOW:
        w = w + (tl.load(p + 5 * BT), tl.load(p + 6 * BT), tl.load(p + 7 * BT))
    else:
        w = w + (tl.load(p + 4 * BT),)
    if (FLAG_CIRCULAR & TAB[TI * NF + S_FLAGS]) != 0:  # NOTE: words 8, 9, 10: t - pos + first, n, query_start
        w = w + (tl.load(p + 8 * BT), tl.load(p + 9 * BT), tl.load(p + 10 * BT))
    return w
