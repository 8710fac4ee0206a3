"""The fused step kernel: one launch applies the step's staged block-table writes and runs every
task of :mod:`dsv4_index.fused.tasks`, calling the formulas of :mod:`dsv4_index.ops._device`.

Grid (1-D, sized from ``T_pad`` only): ``NUM_WRITERS`` writer programs, then ``NUM_REQ x req_tiles``
request programs, then ``cdiv(T_pad, T_SUPER) x P_SUPER`` token programs: each super tile of
``T_SUPER`` tokens runs every token unit's programs (a unit: one task, its token rows per program
and its column chunks, ``tasks.token_units``). What never changes for a layout (kinds, parameters,
widths, DCP, flags, tiles) is ``constexpr`` (flat ``REQ`` / ``TOK`` tuples, ``NF`` ints per task): a
program finds its task by arithmetic on its id, and its chain of dependent loads is header + token
map -> the row's values -> the table entry -> store. Causal lists read one table entry per block
(``S`` columns) in the whole-row variant (``TileConfig.block_loads``). Output addresses and the table geometry
(capacity-dependent) come from ``outs`` (loads off the chain); outputs are element offsets from the
``base*`` pointers (16-byte aligned), so that row stores of index lists are 16-byte vector stores.
A new token kind is one more ``elif KIND == ...`` branch of :func:`_token_task`.

NOTE: writers write only the entries staged this step, and a reader of such an entry takes it from
the stage (the overlay), so no program reads what another program of the launch writes.
"""

from __future__ import annotations

from .._triton import triton, tl

from ..ops._device import (causal_row, causal_row_blocks, circular_split, compressed_slot, decode_row_lens, raw_slot,
                           visible_rows, window_len, window_row)
from ..state.staging import (H_NUM_DECODES, H_NUM_REQS, H_NUM_TOKENS, H_NUM_WRITES, H_REPLAY_END, H_REPLAY_START,
                             OV_HI, OV_LO, OV_PAY, OVERLAY_STRIDE)
from .tasks import (CAUSAL, COMMON, COMPRESSED, DECODE_LENS, INDEXER, NF, REPLAYS, REQUESTS, S_A, S_B, S_BC, S_CPI,
                    S_CPR, S_CPW, S_EXTRA, S_FLAGS, S_GID, S_HAS, S_KIND, S_MUL, S_NCHUNK, S_NCU, S_NPROG, S_RING,
                    S_START, S_STRIDE, S_TASK, S_TOFF, S_TWIDTH, S_WIDTH, STAGED_COPY, TOKEN_ROWS, WINDOW, S_BT)

_H_NUM_REQS: tl.constexpr = tl.constexpr(H_NUM_REQS)
_H_NUM_TOKENS: tl.constexpr = tl.constexpr(H_NUM_TOKENS)
_H_NUM_DECODES: tl.constexpr = tl.constexpr(H_NUM_DECODES)
_H_NUM_WRITES: tl.constexpr = tl.constexpr(H_NUM_WRITES)
_H_REPLAY_START: tl.constexpr = tl.constexpr(H_REPLAY_START)
_H_REPLAY_END: tl.constexpr = tl.constexpr(H_REPLAY_END)
# spec fields (tasks.S_*): field F of the task at index TI (a constexpr) is TAB[TI * NF + F]
# (flat constexpr tuples)
(_KIND, _TASK, _A, _B, _WIDTH, _TOFF, _STRIDE, _TWIDTH, _RING, _CPW, _CPR, _CPI, _GID, _FLAGS, _EXTRA, _HAS, _MUL,
 _BT, _BC, _NCHUNK, _NCU, _START, _NPROG) = [tl.constexpr(v) for v in (
    S_KIND, S_TASK, S_A, S_B, S_WIDTH, S_TOFF, S_STRIDE, S_TWIDTH, S_RING, S_CPW, S_CPR, S_CPI, S_GID, S_FLAGS, S_EXTRA,
    S_HAS, S_MUL, S_BT, S_BC, S_NCHUNK, S_NCU, S_START, S_NPROG)]
_NF: tl.constexpr = tl.constexpr(NF)
_OVERLAY_STRIDE: tl.constexpr = tl.constexpr(OVERLAY_STRIDE)  # NOTE: the overlay record (state/staging.py)
_OV_LO: tl.constexpr = tl.constexpr(OV_LO)
_OV_HI: tl.constexpr = tl.constexpr(OV_HI)
_OV_PAY: tl.constexpr = tl.constexpr(OV_PAY)


@triton.jit
def _out(base32, base64, base8, outs_ptr, TAB: tl.constexpr, TI: tl.constexpr, K: tl.constexpr,
         ESIZE: tl.constexpr):
    """Pointer to output ``K`` of spec ``TI`` (``outs`` holds element offsets / the output's unit)."""
    TASK: tl.constexpr = TAB[TI * _NF + _TASK]
    MUL: tl.constexpr = TAB[TI * _NF + _MUL + K]
    off = tl.load(outs_ptr + TASK * 8 + K) * MUL
    if ESIZE == 8:
        return base64 + off
    elif ESIZE == 1:
        return base8 + off
    else:
        return base32 + off


@triton.jit
def _write_blocks(stage_ptr, tables_ptr, w, off_w, NUM_WRITERS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Writer ``w``: ``tables[dst[i]] = vals[i]`` for ``i = w*BLOCK_W, ...`` (grid-stride)."""
    n = tl.load(stage_ptr + _H_NUM_WRITES)
    for i0 in range(w * BLOCK_W, n, NUM_WRITERS * BLOCK_W):
        i = i0 + tl.arange(0, BLOCK_W)
        m = i < n
        val = tl.load(stage_ptr + off_w + i, mask=m, other=0)
        dst = tl.load(stage_ptr + off_w + n + i, mask=m, other=0)
        tl.store(tables_ptr + dst.to(tl.int64), val, mask=m)


@triton.jit
def _request_task(stage_ptr, base32, base64, base8, outs_ptr, tile, T_pad, rows, off_qsl, off_seq, off_slots,
                  off_rs, off_re, off_extra, TAB: tl.constexpr, TI: tl.constexpr, BLOCK_R: tl.constexpr,
                  NEXT_N_PAD: tl.constexpr):
    KIND: tl.constexpr = TAB[TI * _NF + _KIND]
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    B = tl.load(stage_ptr + _H_NUM_REQS)
    T = tl.load(stage_ptr + _H_NUM_TOKENS)
    if KIND == REQUESTS:
        qsl = tl.load(stage_ptr + off_qsl + r, mask=r <= B, other=0)
        seq = tl.load(stage_ptr + off_seq + r, mask=r < B, other=0)
        slot = tl.load(stage_ptr + off_slots + r, mask=r < B, other=0)
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4) + r, tl.where(r <= B, qsl, T),
                 mask=r <= T_pad)
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 1, 4) + r, seq, mask=r <= T_pad)
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 2, 4) + r, slot, mask=r <= T_pad)
    elif KIND == REPLAYS:
        rs = tl.load(stage_ptr + off_rs + r, mask=(r < B) & (tl.load(stage_ptr + _H_REPLAY_START) != 0), other=0)
        re = tl.load(stage_ptr + off_re + r, mask=(r < B) & (tl.load(stage_ptr + _H_REPLAY_END) != 0), other=0)
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4) + r, rs, mask=r <= T_pad)
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 1, 4) + r, re, mask=r <= T_pad)
    elif KIND == DECODE_LENS:
        NEXT_N: tl.constexpr = TAB[TI * _NF + _B]
        nd = tl.load(stage_ptr + _H_NUM_DECODES)
        dec = r < nd
        seq = tl.load(stage_ptr + off_seq + r, mask=dec, other=0)
        q = tl.load(stage_ptr + off_qsl + r + 1, mask=dec, other=0) - tl.load(stage_ptr + off_qsl + r, mask=dec,
                                                                                other=0)
        j = tl.arange(0, NEXT_N_PAD)[None, :]
        n = decode_row_lens(seq, q, j, NEXT_N, TAB[TI * _NF + _A], TAB[TI * _NF + _CPW], TAB[TI * _NF + _CPR],
                            TAB[TI * _NF + _CPI])
        n = tl.where(dec[:, None], n, 0)
        m = (r < T_pad)[:, None] & (j < NEXT_N)
        off = r.to(tl.int64)[:, None] * NEXT_N + j
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4) + off, n, mask=m)
        if (TAB[TI * _NF + _HAS] & 2) != 0:
            tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 1, 4) + off, tl.maximum(n, 1), mask=m)
    elif KIND == STAGED_COPY:
        src = stage_ptr + off_extra + TAB[TI * _NF + _EXTRA] * (rows + 1)
        last = tl.load(src + B)
        v = tl.load(src + r, mask=r <= B, other=0)
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4) + r, tl.where(r <= B, v, last),
                 mask=r <= T_pad)


@triton.jit
def _causal_chunk(bt, row, n, j0, j, PB: tl.constexpr, stride, stage_ptr, lo, hi, pay, HAS_OV: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr, BLOCK_LOADS: tl.constexpr):
    """Causal columns ``j = j0 + [0, BC)``: one table read per block where the block divides the chunk
    (``BLOCK_LOADS``), else one per column."""
    if BLOCK_LOADS and PB > 1 and BC % PB == 0:
        return causal_row_blocks(bt, row, n, j0, PB, stride, stage_ptr, lo, hi, pay, HAS_OV, BT, BC)
    else:
        return causal_row(bt, row, n, j, PB, stride, stage_ptr, lo, hi, pay, HAS_OV)


@triton.jit
def _index_rows(stage_ptr, bt, out, t, in_out, row, pos, first, n, q_start, lo, hi, pay, col0, twidth, ring, stride,
                TAB: tl.constexpr, TI: tl.constexpr, BLOCK_LOADS: tl.constexpr):
    """Columns ``[col0, col0 + NCHUNK * BC)`` of index-list rows ``t`` (window or causal): chunks that
    reach a token's entries read the table, chunks past every token's length are plain ``-1`` stores.
    A circular group's window entries inside the step's chunk (from ``q_start``) become in-step rows."""
    WIDTH: tl.constexpr = TAB[TI * _NF + _WIDTH]
    BC: tl.constexpr = TAB[TI * _NF + _BC]
    NCHUNK: tl.constexpr = TAB[TI * _NF + _NCHUNK]
    BT: tl.constexpr = TAB[TI * _NF + _BT]
    rowp = out + t.to(tl.int64)[:, None] * WIDTH
    if NCHUNK > 1:
        nmax = tl.max(n, axis=0)
    for c in tl.static_range(NCHUNK):
        j = col0 + c * BC + tl.arange(0, BC)[None, :]
        if WIDTH % BC == 0:
            m = tl.broadcast_to(in_out[:, None], [BT, BC])
        else:
            m = in_out[:, None] & (j < WIDTH)
        if NCHUNK > 1:
            # NOTE: a chunk past every token's length holds only -1: no table read
            if col0 + c * BC < nmax:
                tl.store(rowp + j, _index_chunk(stage_ptr, bt, t, row, pos, first, n, q_start, lo, hi, pay, j,
                                                col0 + c * BC, twidth, ring, stride, TAB, TI, BLOCK_LOADS), mask=m)
            else:
                tl.store(rowp + j, tl.full([BT, BC], -1, tl.int32), mask=m)
        else:
            tl.store(rowp + j, _index_chunk(stage_ptr, bt, t, row, pos, first, n, q_start, lo, hi, pay, j,
                                            col0 + c * BC, twidth, ring, stride, TAB, TI, BLOCK_LOADS), mask=m)


@triton.jit
def _index_chunk(stage_ptr, bt, t, row, pos, first, n, q_start, lo, hi, pay, j, j0, twidth, ring, stride,
                 TAB: tl.constexpr, TI: tl.constexpr, BLOCK_LOADS: tl.constexpr):
    """Entries ``j`` (columns ``j0 + [0, BC)``) of index-list rows: window slots (circular groups: in-step
    rows inside the step's chunk) or causal compressed slots. int32 ``[BT, BC]``."""
    KIND: tl.constexpr = TAB[TI * _NF + _KIND]
    CIRCULAR: tl.constexpr = (TAB[TI * _NF + _FLAGS] & 4) != 0  # FLAG_CIRCULAR
    BC: tl.constexpr = TAB[TI * _NF + _BC]
    BT: tl.constexpr = TAB[TI * _NF + _BT]
    A: tl.constexpr = TAB[TI * _NF + _A]
    PB: tl.constexpr = TAB[TI * _NF + _B]
    if KIND == WINDOW:
        idx = window_row(bt, row, first, n, j, A, twidth, ring, stride, stage_ptr, lo, hi, pay, True)
        if CIRCULAR:
            idx = circular_split(idx, t, pos, first, n, j, q_start)
    else:
        idx = _causal_chunk(bt, row, n, j0, j, PB, stride, stage_ptr, lo, hi, pay, True, BT, BC, BLOCK_LOADS)
    return idx


@triton.jit
def _token_task(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, t0, col0, T_pad, rows, off_qsl, off_seq,
                off_slots, off_rs, off_re, off_tok, off_extra, off_ov, TAB: tl.constexpr, TI: tl.constexpr,
                BLOCK_LOADS: tl.constexpr):
    KIND: tl.constexpr = TAB[TI * _NF + _KIND]
    HAS: tl.constexpr = TAB[TI * _NF + _HAS]
    FLAGS: tl.constexpr = TAB[TI * _NF + _FLAGS]
    A: tl.constexpr = TAB[TI * _NF + _A]
    PB: tl.constexpr = TAB[TI * _NF + _B]
    CPW: tl.constexpr = TAB[TI * _NF + _CPW]
    CPR: tl.constexpr = TAB[TI * _NF + _CPR]
    CPI: tl.constexpr = TAB[TI * _NF + _CPI]
    t = t0 + tl.arange(0, TAB[TI * _NF + _BT])
    in_out = t < T_pad
    # NOTE: the token map is read under in_out (entries [T, T_pad] hold stale values, dropped by
    # valid), so it loads beside the header instead of after it
    T = tl.load(stage_ptr + _H_NUM_TOKENS)
    b = tl.load(stage_ptr + off_tok + t, mask=in_out, other=0)
    valid = t < T
    b = tl.where(valid, b, 0)
    seq = tl.load(stage_ptr + off_seq + b, mask=valid, other=0)
    end = tl.load(stage_ptr + off_qsl + b + 1, mask=valid, other=0)
    pos = tl.where(valid, seq - end + t, 0)
    if KIND == COMMON:
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4) + t, b, mask=in_out)
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 1, 8) + t, pos.to(tl.int64), mask=in_out)
        tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 2, 1) + t, valid.to(tl.int8), mask=in_out)
    else:
        row = tl.load(stage_ptr + off_slots + b, mask=valid, other=0)
        # NOTE: table geometry words: loaded beside the token map, used two loads later
        geo = outs_ptr + TAB[TI * _NF + _TASK] * 8 + 4
        bt = tables_ptr + tl.load(geo)
        stride = tl.load(geo + 1)
        twidth = tl.load(geo + 2).to(tl.int32)
        if TAB[TI * _NF + _RING] != 0:
            ring = tl.load(geo + 3).to(tl.int32)
        else:
            ring = 0
        if KIND == WINDOW or KIND == CAUSAL or KIND == COMPRESSED:
            ov = off_ov + (TAB[TI * _NF + _GID] * rows + b) * _OVERLAY_STRIDE
            lo = tl.load(stage_ptr + ov + _OV_LO, mask=valid, other=0)
            hi = tl.load(stage_ptr + ov + _OV_HI, mask=valid, other=0)
            pay = tl.load(stage_ptr + ov + _OV_PAY, mask=valid, other=0)
        if (FLAGS & 1) != 0:  # FLAG_WRITE_FLOOR
            wfloor = tl.load(stage_ptr + off_re + b, mask=valid & (tl.load(stage_ptr + _H_REPLAY_END) != 0), other=0)
        else:
            wfloor = tl.zeros_like(pos)
        if KIND == WINDOW:
            if (FLAGS & 2) != 0:  # FLAG_WINDOW_FLOOR
                floor = tl.load(stage_ptr + off_rs + b, mask=valid & (tl.load(stage_ptr + _H_REPLAY_START) != 0),
                                other=0)
            else:
                floor = tl.zeros_like(pos)
            first, n = window_len(pos, valid, floor, PB, CPW, CPR, CPI)
            if (FLAGS & 4) != 0:  # FLAG_CIRCULAR: the request's chunk starts at its query_start row
                q_start = tl.load(stage_ptr + off_qsl + b, mask=valid, other=0)
            else:
                q_start = tl.zeros_like(pos)
            _index_rows(stage_ptr, bt, _out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4), t, in_out, row,
                        pos, first, n, q_start, lo, hi, pay, col0, twidth, ring, stride, TAB, TI, BLOCK_LOADS)
            if col0 == 0:
                tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 1, 4) + t, n, mask=in_out)
                if (HAS & 4) != 0:
                    slot = raw_slot(bt, row, pos, valid, wfloor, A, twidth, ring, stride, CPW,
                                    CPR, CPI, stage_ptr, lo, hi, pay, True)
                    tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 2, 8) + t, slot, mask=in_out)
                if (HAS & 8) != 0:
                    # NOTE: circular write plan: the last `capacity` tokens of the request's chunk; the
                    # ring holds `ring` blocks of A rows (a circular group's ring width is its block count)
                    slot = raw_slot(bt, row, pos, valid, seq - A * tl.maximum(ring, 1), A, twidth, ring, stride,
                                    CPW, CPR, CPI, stage_ptr, lo, hi, pay, True)
                    tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 3, 8) + t, slot, mask=in_out)
        elif KIND == CAUSAL:
            n = visible_rows(pos, valid, A, CPW, CPR, CPI)
            n = tl.minimum(tl.minimum(n, TAB[TI * _NF + _WIDTH]), twidth * PB)
            _index_rows(stage_ptr, bt, _out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4), t, in_out, row,
                        pos, n, n, pos, lo, hi, pay, col0, twidth, ring, stride, TAB, TI, BLOCK_LOADS)
            if col0 == 0:
                tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 1, 4) + t, n, mask=in_out)
        elif KIND == COMPRESSED:
            slot = compressed_slot(bt, row, pos, valid, wfloor, A, PB, twidth, stride, CPW, CPR, CPI,
                                   stage_ptr, lo, hi, pay, True)
            tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 0, 8) + t, slot, mask=in_out)
            if (HAS & 2) != 0:
                # NOTE: compact form: the k-th row the request completes this step goes to cu[b] + k;
                # entries from cu[B] on are -1 (written by the token with that index: disjoint stores)
                cu = stage_ptr + off_extra + TAB[TI * _NF + _EXTRA] * (rows + 1)
                start = tl.load(stage_ptr + off_qsl + b, mask=valid, other=0)
                ctx = seq - (end - start)
                done = valid & ((pos + 1) % A == 0)
                e = tl.load(cu + b, mask=valid, other=0) + pos // A - ctx // A
                compact = _out(base32, base64, base8, outs_ptr, TAB, TI, 1, 8)
                tl.store(compact + e, slot, mask=done & (e < T_pad))
                total = tl.load(cu + tl.load(stage_ptr + _H_NUM_REQS))
                tl.store(compact + t, tl.full([TAB[TI * _NF + _BT]], -1, tl.int64), mask=in_out & (t >= total))
        elif KIND == INDEXER:
            n = visible_rows(pos, valid, A, CPW, CPR, CPI)
            ks = tl.load(stage_ptr + off_extra + TAB[TI * _NF + _EXTRA] * (rows + 1) + b, mask=valid, other=0)
            tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4) + t, n, mask=in_out)
            tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 1, 4) + t, ks, mask=in_out)
            tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 2, 4) + t, tl.where(valid, ks + n, 0),
                     mask=in_out)
            if (HAS & 8) != 0:
                tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 3, 4) + t, tl.maximum(n, 1), mask=in_out)
        elif KIND == TOKEN_ROWS:
            tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 0, 4) + t, tl.where(valid, row, -1),
                     mask=in_out)
            # NOTE: n_c of every row, owned or not: top-k picks are global row ids
            tl.store(_out(base32, base64, base8, outs_ptr, TAB, TI, 1, 4) + t, visible_rows(pos, valid, A, 1, 0, 1),
                     mask=in_out)


@triton.jit
def _token_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, r, T_pad, rows, off_qsl, off_seq,
                off_slots, off_rs, off_re, off_tok, off_extra, off_ov, TAB: tl.constexpr, TI: tl.constexpr,
                T_SUPER: tl.constexpr, BLOCK_LOADS: tl.constexpr):
    """Program ``r`` of super tile ``s``, if it belongs to unit ``TI``: its token rows and first column."""
    START: tl.constexpr = TAB[TI * _NF + _START]
    NPROG: tl.constexpr = TAB[TI * _NF + _NPROG]
    BT: tl.constexpr = TAB[TI * _NF + _BT]
    PER: tl.constexpr = T_SUPER // BT
    COLS: tl.constexpr = TAB[TI * _NF + _NCHUNK] * TAB[TI * _NF + _BC]
    if (r >= START) & (r < START + NPROG):
        q = r - START
        _token_task(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s * T_SUPER + (q % PER) * BT,
                    (q // PER) * COLS, T_pad, rows, off_qsl, off_seq, off_slots, off_rs, off_re, off_tok, off_extra,
                    off_ov, TAB, TI, BLOCK_LOADS)


@triton.jit(do_not_specialize=["T_pad", "req_tiles", "rows", "off_qsl", "off_seq", "off_slots", "off_rs", "off_re",
                               "off_tok", "off_extra", "off_ov", "off_w"])
def fused_step_kernel(stage_ptr,   # int32 [*] staging buffer (state/staging.py format)
                      tables_ptr,  # int32 [*] every group's block table
                      base32, base64, base8,  # 16-byte aligned bases of the int32 / int64 / int8 outputs
                      outs_ptr,    # int64 [num_tasks, 8]: output offsets from the bases (/ MUL), table words
                      T_pad, req_tiles, rows,
                      off_qsl, off_seq, off_slots, off_rs, off_re, off_tok, off_extra, off_ov, off_w,
                      REQ: tl.constexpr, TOK: tl.constexpr, NUM_REQ: tl.constexpr, NUM_TOK: tl.constexpr,
                      T_SUPER: tl.constexpr, P_SUPER: tl.constexpr, NUM_WRITERS: tl.constexpr,
                      BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, NEXT_N_PAD: tl.constexpr,
                      BLOCK_LOADS: tl.constexpr):
    pid = tl.program_id(0)
    if pid < NUM_WRITERS:
        _write_blocks(stage_ptr, tables_ptr, pid, off_w, NUM_WRITERS, BLOCK_W)
    else:
        p = pid - NUM_WRITERS
        n_req = NUM_REQ * req_tiles
        if p < n_req:
            unit = p % NUM_REQ
            for i in tl.static_range(NUM_REQ):
                if unit == i:
                    _request_task(stage_ptr, base32, base64, base8, outs_ptr, p // NUM_REQ, T_pad, rows, off_qsl,
                                  off_seq, off_slots, off_rs, off_re, off_extra, REQ, i, BLOCK_R, NEXT_N_PAD)
        else:
            p = p - n_req
            s = p // P_SUPER
            r = p % P_SUPER
            for i in tl.static_range(NUM_TOK):
                _token_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, r, T_pad, rows, off_qsl,
                            off_seq, off_slots, off_rs, off_re, off_tok, off_extra, off_ov, TOK, i, T_SUPER,
                            BLOCK_LOADS)
