"""Pieces of the fused step kernel (:mod:`dsv4_index.fused.kernel`) shared by its token programs, and the
window program of the large tiles (``TileConfig.fold``).

* :func:`out_ptr`: an output's address from the task's ``outs`` row; :func:`token_rows`: a tile's tokens
  (batch row, position); :func:`table_words`: the task's table geometry words; :func:`overlay`: the staged
  overlay record of a group.
* :func:`window_fold`: token rows of ``S_FOLD`` window tasks of one unit whose lists are one chunk; every
  table word, overlay record and table entry is loaded before the first store, so no load waits behind a
  store (a program's loads and stores stay in program order on the GPU). ``S_FOLD = 1`` (the large tiles'
  default) is one task per program; folding two sliding groups into one program measured slower on an
  H200 (benchmarks/results/h200_2026-12-02_s10/PREFILL.md).

The staging format's numbers come from :mod:`dsv4_index.state.staging`, the task fields from
:mod:`dsv4_index.fused.tasks` (as in the kernel).
"""

from __future__ import annotations

from .._triton import triton, tl

from ..ops._device import circular_split, raw_slot, window_blocks, window_from_blocks, window_len, window_row
from ..state.staging import H_NUM_TOKENS, H_REPLAY_END, H_REPLAY_START, OV_HI, OV_LO, OV_PAY, OVERLAY_STRIDE
from .tasks import (FLAG_CIRCULAR, FLAG_WINDOW_FLOOR, FLAG_WRITE_FLOOR, G_GID, G_RING, G_STRIDE, G_TABLE, G_WIDTH,
                    HAS_OUT2, HAS_OUT3, NF, OUTS_GEO, OUTS_WORDS, S_BC, S_BLOCK_SIZE, S_BT, S_CPI, S_CPR, S_CPW,
                    S_FLAGS, S_FOLD, S_HAS, S_MUL, S_RING, S_TASK, S_WIDTH, S_WINDOW)

# NOTE: plain ints of state/staging.py wrapped as tl.constexpr (kernel.py says why)
_H_NUM_TOKENS: tl.constexpr = tl.constexpr(H_NUM_TOKENS)
_H_REPLAY_START: tl.constexpr = tl.constexpr(H_REPLAY_START)
_H_REPLAY_END: tl.constexpr = tl.constexpr(H_REPLAY_END)
_OVERLAY_STRIDE: tl.constexpr = tl.constexpr(OVERLAY_STRIDE)
_OV_LO: tl.constexpr = tl.constexpr(OV_LO)
_OV_HI: tl.constexpr = tl.constexpr(OV_HI)
_OV_PAY: tl.constexpr = tl.constexpr(OV_PAY)


@triton.jit
def out_ptr(base32, base64, base8, orow, TAB: tl.constexpr, TI: tl.constexpr, K: tl.constexpr,
            ESIZE: tl.constexpr):
    """Pointer to output ``K`` of spec ``TI``, ``orow`` its task's row of ``outs`` (element offsets / the
    output's unit)."""
    MUL: tl.constexpr = TAB[TI * NF + S_MUL + K]
    off = tl.load(orow + K) * MUL
    if ESIZE == 8:
        return base64 + off
    elif ESIZE == 1:
        return base8 + off
    else:
        return base32 + off


@triton.jit
def token_rows(stage_ptr, t0, T_pad, off_qsl, off_seq, off_tok, BT: tl.constexpr):
    """Token rows ``t = t0 + [0, BT)``: (t, in_out, batch row b, valid, seq_len, query end, position)."""
    t = t0 + tl.arange(0, BT)
    in_out = t < T_pad
    # NOTE: the token map is read under in_out (entries [T, T_pad] hold stale values, dropped by
    # valid), so it loads beside the header instead of after it
    T = tl.load(stage_ptr + _H_NUM_TOKENS)
    b = tl.load(stage_ptr + off_tok + t, mask=in_out, other=0)
    valid = t < T
    b = tl.where(valid, b, 0)
    seq = tl.load(stage_ptr + off_seq + b, mask=valid, other=0)
    end = tl.load(stage_ptr + off_qsl + b + 1, mask=valid, other=0)
    return t, in_out, b, valid, seq, end, tl.where(valid, seq - end + t, 0)


@triton.jit
def table_words(orow, RING: tl.constexpr):
    """A task's table as its ``outs`` row gives it: (table row 0, row stride, logical width, ring width, gid)."""
    geo = orow + OUTS_GEO
    if RING != 0:
        ring = tl.load(geo + G_RING).to(tl.int32)
    else:
        ring = 0
    return geo, tl.load(geo + G_STRIDE), tl.load(geo + G_WIDTH).to(tl.int32), ring, tl.load(geo + G_GID).to(tl.int32)


@triton.jit
def overlay(stage_ptr, off_ov, gid, rows, b, valid):
    """(lo, hi, payload offset) of the staged overlay record of group ``gid``, batch rows ``b``."""
    ov = off_ov + (gid * rows + b) * _OVERLAY_STRIDE
    return (tl.load(stage_ptr + ov + _OV_LO, mask=valid, other=0),
            tl.load(stage_ptr + ov + _OV_HI, mask=valid, other=0),
            tl.load(stage_ptr + ov + _OV_PAY, mask=valid, other=0))


@triton.jit
def window_fold(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, k0, t0, T_pad, rows, off_qsl, off_seq,
                off_slots, off_rs, off_re, off_tok, off_ov, TAB: tl.constexpr, TI: tl.constexpr,
                BLOCK_LOADS: tl.constexpr):
    """Token rows ``t0 + [0, BT)`` of the ``S_FOLD`` window tasks ``k0, k0 + 1, ...`` of unit ``TI`` (one-chunk
    lists, the outputs of the kernel's ``_window_task``): the tokens, floors and windows once, then every task's table
    words, overlay and entries, and only then the stores (no load waits behind a store)."""
    FLAGS: tl.constexpr = TAB[TI * NF + S_FLAGS]
    HAS: tl.constexpr = TAB[TI * NF + S_HAS]
    BLOCK_SIZE: tl.constexpr = TAB[TI * NF + S_BLOCK_SIZE]
    CPW: tl.constexpr = TAB[TI * NF + S_CPW]
    CPR: tl.constexpr = TAB[TI * NF + S_CPR]
    CPI: tl.constexpr = TAB[TI * NF + S_CPI]
    BC: tl.constexpr = TAB[TI * NF + S_BC]
    WIDTH: tl.constexpr = TAB[TI * NF + S_WIDTH]
    FOLD: tl.constexpr = TAB[TI * NF + S_FOLD]
    t, in_out, b, valid, seq, end, pos = token_rows(stage_ptr, t0, T_pad, off_qsl, off_seq, off_tok,
                                                    TAB[TI * NF + S_BT])
    row = tl.load(stage_ptr + off_slots + b, mask=valid, other=0)
    wfloor = tl.zeros_like(pos)
    if (FLAG_WRITE_FLOOR & FLAGS) != 0:
        wfloor = tl.load(stage_ptr + off_re + b, mask=tl.where(tl.load(stage_ptr + _H_REPLAY_END) != 0, valid, False),
                         other=0)  # NOTE: tl.where, not `valid & flag`: Triton 3.9's interpreter (kernel._request_task)
    floor = tl.zeros_like(pos)
    if (FLAG_WINDOW_FLOOR & FLAGS) != 0:
        floor = tl.load(stage_ptr + off_rs + b, mask=tl.where(tl.load(stage_ptr + _H_REPLAY_START) != 0, valid, False),
                        other=0)  # NOTE: tl.where, not `valid & flag`: Triton 3.9's interpreter (kernel._request_task)
    first, n = window_len(pos, valid, floor, TAB[TI * NF + S_WINDOW], CPW, CPR, CPI)
    q_start = tl.zeros_like(pos)
    if (FLAG_CIRCULAR & FLAGS) != 0:
        q_start = tl.load(stage_ptr + off_qsl + b, mask=valid, other=0)
    j = tl.arange(0, BC)[None, :]
    if WIDTH % BC == 0:
        m = tl.broadcast_to(in_out[:, None], [TAB[TI * NF + S_BT], BC])
    else:
        m = in_out[:, None] & (j < WIDTH)
    done = ()  # type: tuple
    for k in tl.static_range(FOLD):
        orow = outs_ptr + (TAB[TI * NF + S_TASK] + k0 + k) * OUTS_WORDS
        geo, stride, twidth, ring, gid = table_words(orow, TAB[TI * NF + S_RING])
        bt = tables_ptr + tl.load(geo + G_TABLE)
        lo, hi, pay = overlay(stage_ptr, off_ov, gid, rows, b, valid)
        if BLOCK_LOADS and 2 * BLOCK_SIZE >= BC:  # NOTE: the entries now, the columns at the store
            ents = window_blocks(bt, row, first, n, 0, BLOCK_SIZE, twidth, ring, stride, stage_ptr, lo, hi, pay, True,
                                 BC)
        else:
            ents = (window_row(bt, row, first, n, j, BLOCK_SIZE, twidth, ring, stride, stage_ptr, lo, hi, pay, True),)
        slot, out2 = wfloor.to(tl.int64), base64  # NOTE: placeholders of the outputs the task does not have
        tail, out3 = slot, base64
        if (HAS_OUT2 & HAS) != 0:
            slot = raw_slot(bt, row, pos, valid, wfloor, BLOCK_SIZE, twidth, ring, stride, CPW, CPR, CPI, stage_ptr,
                            lo, hi, pay, True)
            out2 = out_ptr(base32, base64, base8, orow, TAB, TI, 2, 8)
        if (HAS_OUT3 & HAS) != 0:
            tail = raw_slot(bt, row, pos, valid, seq - BLOCK_SIZE * tl.maximum(ring, 1), BLOCK_SIZE, twidth, ring,
                            stride, CPW, CPR, CPI, stage_ptr, lo, hi, pay, True)
            out3 = out_ptr(base32, base64, base8, orow, TAB, TI, 3, 8)
        done = done + ((ents, twidth, slot, tail, out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4),
                        out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4), out2, out3),)
    for k in tl.static_range(FOLD):
        ents, twidth, slot, tail, out0, out1, out2, out3 = done[k]
        if BLOCK_LOADS and 2 * BLOCK_SIZE >= BC:
            idx = window_from_blocks(ents[0], ents[1], ents[2], first, n, 0, BLOCK_SIZE, twidth, BC)
        else:
            idx = ents[0]
        if (FLAG_CIRCULAR & FLAGS) != 0:
            idx = circular_split(idx, t, pos, first, n, j, q_start)
        tl.store(out0 + t.to(tl.int64)[:, None] * WIDTH + j, idx, mask=m)
        tl.store(out1 + t, n, mask=in_out)
        if (HAS_OUT2 & HAS) != 0:
            tl.store(out2 + t, slot, mask=in_out)
        if (HAS_OUT3 & HAS) != 0:
            tl.store(out3 + t, tail, mask=in_out)
