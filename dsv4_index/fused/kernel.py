# over 400 lines: one kernel, read top to bottom (request, token and table tasks, the query batch's dispatch)
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
The staging format's numbers come from :mod:`dsv4_index.state.staging`, the task fields, flags and
``outs`` words from :mod:`dsv4_index.fused.tasks`; none is spelled here. A new token kind that reads a
table is one more ``elif KIND == ...`` branch of :func:`_table_task`.

NOTE: writers write only the entries staged this step, and a reader of such an entry takes it from
the stage (the overlay), so no program reads what another program of the launch writes.
"""

from __future__ import annotations

from .._triton import triton, tl

from ..ops._device import (causal_row, causal_row_blocks, circular_split, compressed_slot, decode_row_lens, raw_slot,
                           visible_rows, window_chunk, window_len)
from ..state.staging import (H_NUM_DECODES, H_NUM_REQS, H_NUM_TOKENS, H_NUM_WRITES, H_REPLAY_END, H_REPLAY_START,
                             ROW_ARRAY_PAD, W_DESTS, W_VALUES)
from .tasks import (CAUSAL, COMMON, COMPRESSED, DECODE_LENS, FLAG_CIRCULAR, FLAG_QUERY, FLAG_WINDOW_FLOOR,
                    FLAG_WRITE_FLOOR, G_TABLE, HAS_OUT1, HAS_OUT2, HAS_OUT3, INDEXER, NF, OUTS_WORDS, QUERY_MAP,
                    QUERY_QSL, REPLAYS, REQUESTS, S_BC, S_BLOCK_SIZE, S_BT, S_CPI, S_CPR, S_CPW, S_EXTRA, S_FLAGS,
                    S_FOLD, S_HAS, S_KIND, S_NCHUNK, S_NEXT_N, S_NPROG, S_RATIO, S_REP, S_RING, S_ROWS_PER_BLOCK,
                    S_SPLIT, S_START, S_TASK, S_WIDTH, S_WINDOW, STAGED_COPY, TOKEN_ROWS, WINDOW)
from .query import declared, query_array, query_map_task, query_qsl_task, query_rows
from .rows import window_split
from .window import out_ptr, overlay, table_words, token_rows, window_fold

# NOTE: the staging format's numbers are plain ints (state/staging.py is host code); Triton reads a
# global in @triton.jit code only as a tl.constexpr (the interpreter reads plain ints too), hence the
# wrapping here. The task numbers of .tasks are tl.constexpr already; a bit is tested as
# ``(FLAG_X & FLAGS)``: under TRITON_INTERPRET=1 the spec fields are plain ints, and ``int & constexpr``
# has no reflected form.
_H_NUM_REQS: tl.constexpr = tl.constexpr(H_NUM_REQS)
_H_NUM_TOKENS: tl.constexpr = tl.constexpr(H_NUM_TOKENS)
_H_NUM_DECODES: tl.constexpr = tl.constexpr(H_NUM_DECODES)
_H_NUM_WRITES: tl.constexpr = tl.constexpr(H_NUM_WRITES)
_H_REPLAY_START: tl.constexpr = tl.constexpr(H_REPLAY_START)
_H_REPLAY_END: tl.constexpr = tl.constexpr(H_REPLAY_END)
_ROW_ARRAY_PAD: tl.constexpr = tl.constexpr(ROW_ARRAY_PAD)
_W_VALUES: tl.constexpr = tl.constexpr(W_VALUES)
_W_DESTS: tl.constexpr = tl.constexpr(W_DESTS)
_UNROLL_CHUNKS: tl.constexpr = tl.constexpr(16)  # whole rows of more chunks loop over them (kernel size, compile time)


@triton.jit
def _staged_array(stage_ptr, off_extra, rows, TAB: tl.constexpr, TI: tl.constexpr):
    """Pointer to entry 0 of the per-request array staged for spec ``TI`` (``S_EXTRA``)."""
    return stage_ptr + off_extra + TAB[TI * NF + S_EXTRA] * (rows + _ROW_ARRAY_PAD)


@triton.jit
def _write_blocks(stage_ptr, tables_ptr, w, off_w, NUM_WRITERS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Writer ``w``: ``tables[dst[i]] = vals[i]`` for ``i = w*BLOCK_W, ...`` (grid-stride)."""
    n = tl.load(stage_ptr + _H_NUM_WRITES)
    for i0 in range(w * BLOCK_W, n, NUM_WRITERS * BLOCK_W):
        i = i0 + tl.arange(0, BLOCK_W)
        m = i < n
        val = tl.load(stage_ptr + off_w + _W_VALUES * n + i, mask=m, other=0)
        dst = tl.load(stage_ptr + off_w + _W_DESTS * n + i, mask=m, other=0)
        tl.store(tables_ptr + dst.to(tl.int64), val, mask=m)


@triton.jit
def _request_task(stage_ptr, base32, base64, base8, outs_ptr, tile, T_pad, rows, off_qsl, off_seq, off_slots,
                  off_rs, off_re, off_extra, TAB: tl.constexpr, TI: tl.constexpr, BLOCK_R: tl.constexpr,
                  NEXT_N_PAD: tl.constexpr, QX: tl.constexpr):
    """Batch rows ``tile * BLOCK_R + [0, BLOCK_R)`` of request task ``TI`` (rows ``(B, T_pad]`` padded)."""
    KIND: tl.constexpr = TAB[TI * NF + S_KIND]
    orow = outs_ptr + TAB[TI * NF + S_TASK] * OUTS_WORDS
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    B = tl.load(stage_ptr + _H_NUM_REQS)
    T = tl.load(stage_ptr + _H_NUM_TOKENS)
    if KIND == REQUESTS:
        qsl = tl.load(stage_ptr + off_qsl + r, mask=r <= B, other=0)
        seq = tl.load(stage_ptr + off_seq + r, mask=r < B, other=0)
        slot = tl.load(stage_ptr + off_slots + r, mask=r < B, other=0)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + r, tl.where(r <= B, qsl, T),
                 mask=r <= T_pad)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + r, seq, mask=r <= T_pad)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 2, 4) + r, slot, mask=r <= T_pad)
    elif KIND == REPLAYS:
        # NOTE: `tl.where(scalar flag, block mask, False)`, never `block mask & scalar flag`: Triton 3.9's
        # interpreter makes the latter int32 and refuses it as a mask ("mask has unsupported dtype")
        rs = tl.load(stage_ptr + off_rs + r, mask=tl.where(tl.load(stage_ptr + _H_REPLAY_START) != 0, r < B, False),
                     other=0)
        re = tl.load(stage_ptr + off_re + r, mask=tl.where(tl.load(stage_ptr + _H_REPLAY_END) != 0, r < B, False),
                     other=0)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + r, rs, mask=r <= T_pad)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + r, re, mask=r <= T_pad)
    elif KIND == DECODE_LENS:
        NEXT_N: tl.constexpr = TAB[TI * NF + S_NEXT_N]
        nd = tl.load(stage_ptr + _H_NUM_DECODES)
        dec = r < nd
        seq = tl.load(stage_ptr + off_seq + r, mask=dec, other=0)
        q = tl.load(stage_ptr + off_qsl + r + 1, mask=dec, other=0) - tl.load(stage_ptr + off_qsl + r, mask=dec,
                                                                                other=0)
        if (FLAG_QUERY & TAB[TI * NF + S_FLAGS]) != 0:  # a declared step: the decode rows' query tokens
            qslq = query_array(stage_ptr, off_extra, rows, QX)
            qq = tl.load(qslq + r + 1, mask=dec, other=0) - tl.load(qslq + r, mask=dec & (r > 0), other=0)
            q = tl.where(declared(qslq), qq, q)
        j = tl.arange(0, NEXT_N_PAD)[None, :]
        n = decode_row_lens(seq, q, j, NEXT_N, TAB[TI * NF + S_RATIO], TAB[TI * NF + S_CPW], TAB[TI * NF + S_CPR],
                            TAB[TI * NF + S_CPI])
        n = tl.where(dec[:, None], n, 0)
        m = (r < T_pad)[:, None] & (j < NEXT_N)
        off = r.to(tl.int64)[:, None] * NEXT_N + j
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + off, n, mask=m)
        if (HAS_OUT1 & TAB[TI * NF + S_HAS]) != 0:  # the clamped copy
            tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + off, tl.maximum(n, 1), mask=m)
    elif KIND == STAGED_COPY:
        src = _staged_array(stage_ptr, off_extra, rows, TAB, TI)
        last = tl.load(src + B)
        v = tl.load(src + r, mask=r <= B, other=0)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + r, tl.where(r <= B, v, last),
                 mask=r <= T_pad)
    elif KIND == QUERY_QSL:
        query_qsl_task(query_array(stage_ptr, off_extra, rows, QX), base32, base64, base8, orow, r, B, T_pad, TAB, TI)


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
    WIDTH: tl.constexpr = TAB[TI * NF + S_WIDTH]
    BC: tl.constexpr = TAB[TI * NF + S_BC]
    NCHUNK: tl.constexpr = TAB[TI * NF + S_NCHUNK]
    rowp = out + t.to(tl.int64)[:, None] * WIDTH
    nmax = 0
    if NCHUNK > 1:
        nmax = tl.max(n, axis=0)
    if NCHUNK > _UNROLL_CHUNKS:  # NOTE: a very wide row (e.g. 65536 columns): a loop, not NCHUNK copies to compile
        for c in range(NCHUNK):
            _index_rows_chunk(stage_ptr, bt, rowp, t, in_out, row, pos, first, n, q_start, lo, hi, pay,
                              col0 + c * BC, nmax, twidth, ring, stride, TAB, TI, BLOCK_LOADS)
    else:
        for c in tl.static_range(NCHUNK):
            _index_rows_chunk(stage_ptr, bt, rowp, t, in_out, row, pos, first, n, q_start, lo, hi, pay,
                              col0 + c * BC, nmax, twidth, ring, stride, TAB, TI, BLOCK_LOADS)


@triton.jit
def _index_rows_chunk(stage_ptr, bt, rowp, t, in_out, row, pos, first, n, q_start, lo, hi, pay, j0, nmax, twidth,
                      ring, stride, TAB: tl.constexpr, TI: tl.constexpr, BLOCK_LOADS: tl.constexpr):
    """Columns ``j0 + [0, BC)`` of :func:`_index_rows`' rows (``nmax``: the rows' longest length)."""
    WIDTH: tl.constexpr = TAB[TI * NF + S_WIDTH]
    BC: tl.constexpr = TAB[TI * NF + S_BC]
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    j = j0 + tl.arange(0, BC)[None, :]
    if WIDTH % BC == 0:
        m = tl.broadcast_to(in_out[:, None], [BT, BC])
    else:
        m = in_out[:, None] & (j < WIDTH)
    if TAB[TI * NF + S_NCHUNK] > 1:
        # NOTE: a chunk past every token's length holds only -1: no table read
        if j0 < nmax:
            tl.store(rowp + j, _index_chunk(stage_ptr, bt, t, row, pos, first, n, q_start, lo, hi, pay, j, j0, twidth,
                                            ring, stride, TAB, TI, BLOCK_LOADS), mask=m)
        else:
            tl.store(rowp + j, tl.full([BT, BC], -1, tl.int32), mask=m)
    else:
        tl.store(rowp + j, _index_chunk(stage_ptr, bt, t, row, pos, first, n, q_start, lo, hi, pay, j, j0, twidth,
                                        ring, stride, TAB, TI, BLOCK_LOADS), mask=m)


@triton.jit
def _index_chunk(stage_ptr, bt, t, row, pos, first, n, q_start, lo, hi, pay, j, j0, twidth, ring, stride,
                 TAB: tl.constexpr, TI: tl.constexpr, BLOCK_LOADS: tl.constexpr):
    """Entries ``j`` (columns ``j0 + [0, BC)``) of index-list rows: window slots (circular groups: in-step
    rows inside the step's chunk) or causal compressed slots. int32 ``[BT, BC]``."""
    KIND: tl.constexpr = TAB[TI * NF + S_KIND]
    CIRCULAR: tl.constexpr = (FLAG_CIRCULAR & TAB[TI * NF + S_FLAGS]) != 0
    BC: tl.constexpr = TAB[TI * NF + S_BC]
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    if KIND == WINDOW:
        idx = window_chunk(bt, row, first, n, j0, j, TAB[TI * NF + S_BLOCK_SIZE], twidth, ring, stride, stage_ptr, lo,
                           hi, pay, True, BC, BLOCK_LOADS)
        if CIRCULAR:
            idx = circular_split(idx, t, pos, first, n, j, q_start)
    else:
        idx = _causal_chunk(bt, row, n, j0, j, TAB[TI * NF + S_ROWS_PER_BLOCK], stride, stage_ptr, lo, hi, pay, True,
                            BT, BC, BLOCK_LOADS)
    return idx


@triton.jit
def _token_task(stage_ptr, tables_ptr, base32, base64, base8, orow, t0, col0, T_pad, rows, off_qsl, off_seq,
                off_slots, off_rs, off_re, off_tok, off_extra, off_ov, TAB: tl.constexpr, TI: tl.constexpr,
                BLOCK_LOADS: tl.constexpr, QX: tl.constexpr, LOG_R: tl.constexpr):
    """Token rows ``t0 + [0, BT)`` (index-list columns from ``col0``) of token task ``TI``: each token's
    batch row ``b`` and position, then the kind's outputs (:func:`_table_task` for the kinds that read
    the group's table). A task flagged ``FLAG_QUERY`` of a declared step runs over query rows (fused/query.py);
    a window task's slot mappings stay per source token."""
    KIND: tl.constexpr = TAB[TI * NF + S_KIND]
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    # NOTE: the token map first: on a plain step a flagged task's flag load runs beside it, not before it
    t, in_out, b, valid, seq, end, pos = token_rows(stage_ptr, t0, T_pad, off_qsl, off_seq, off_tok, BT)
    if KIND == QUERY_MAP:
        query_map_task(stage_ptr, query_array(stage_ptr, off_extra, rows, QX), base32, base64, base8, orow, t0, T_pad,
                       rows, off_qsl, off_seq, TAB, TI, BT, LOG_R)
    elif (FLAG_QUERY & TAB[TI * NF + S_FLAGS]) != 0:
        qslq = query_array(stage_ptr, off_extra, rows, QX)
        if declared(qslq):
            # NOTE: the query rows' loads before the source rows' stores (no load waits behind a store)
            u, in_out_q, b_q, valid_q, seq_q, end_q, pos_q = query_rows(stage_ptr, qslq, t0, T_pad, rows, off_seq, BT,
                                                                          LOG_R)
            if KIND == WINDOW:  # NOTE: the slot mappings of the source rows t0 + [0, BT)
                _table_task(stage_ptr, tables_ptr, base32, base64, base8, orow, t, in_out, b, valid, seq, end, pos,
                            col0, T_pad, rows, off_qsl, off_slots, off_rs, off_re, off_extra, off_ov, TAB, TI,
                            BLOCK_LOADS, 1)
            if KIND == WINDOW:
                _table_task(stage_ptr, tables_ptr, base32, base64, base8, orow, u, in_out_q, b_q, valid_q, seq_q,
                            end_q, pos_q, col0, T_pad, rows, off_qsl, off_slots, off_rs, off_re, off_extra, off_ov,
                            TAB, TI, BLOCK_LOADS, 2)
            else:
                _table_task(stage_ptr, tables_ptr, base32, base64, base8, orow, u, in_out_q, b_q, valid_q, seq_q,
                            end_q, pos_q, col0, T_pad, rows, off_qsl, off_slots, off_rs, off_re, off_extra, off_ov,
                            TAB, TI, BLOCK_LOADS, 0)
        else:
            _table_task(stage_ptr, tables_ptr, base32, base64, base8, orow, t, in_out, b, valid, seq, end, pos, col0,
                        T_pad, rows, off_qsl, off_slots, off_rs, off_re, off_extra, off_ov, TAB, TI, BLOCK_LOADS, 0)
    elif KIND == COMMON:
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + t, b, mask=in_out)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 8) + t, pos.to(tl.int64), mask=in_out)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 2, 1) + t, valid.to(tl.int8), mask=in_out)
    else:
        _table_task(stage_ptr, tables_ptr, base32, base64, base8, orow, t, in_out, b, valid, seq, end, pos, col0,
                    T_pad, rows, off_qsl, off_slots, off_rs, off_re, off_extra, off_ov, TAB, TI, BLOCK_LOADS, 0)


@triton.jit
def _table_task(stage_ptr, tables_ptr, base32, base64, base8, orow, t, in_out, b, valid, seq, end, pos, col0,
                T_pad, rows, off_qsl, off_slots, off_rs, off_re, off_extra, off_ov, TAB: tl.constexpr,
                TI: tl.constexpr, BLOCK_LOADS: tl.constexpr, PART: tl.constexpr):
    """A token task that reads its group's table (every kind but COMMON), for tokens ``t`` of batch rows
    ``b``: the table row and geometry, the staged overlay record, the write floor, then the kind's outputs
    (a window task's: all with ``PART`` 0, its slot mappings only with 1, its lists and lens only with 2)."""
    KIND: tl.constexpr = TAB[TI * NF + S_KIND]
    R: tl.constexpr = TAB[TI * NF + S_RATIO]  # NOTE: the ratio of the kinds but WINDOW (_window_task)
    CPW: tl.constexpr = TAB[TI * NF + S_CPW]
    CPR: tl.constexpr = TAB[TI * NF + S_CPR]
    CPI: tl.constexpr = TAB[TI * NF + S_CPI]
    row = tl.load(stage_ptr + off_slots + b, mask=valid, other=0)
    # NOTE: table geometry words: loaded beside the token map, used two loads later
    geo, stride, twidth, ring, gid = table_words(orow, TAB[TI * NF + S_RING])
    bt = tables_ptr + tl.load(geo + G_TABLE)
    if KIND == WINDOW or KIND == CAUSAL or KIND == COMPRESSED:
        lo, hi, pay = overlay(stage_ptr, off_ov, gid, rows, b, valid)
    if (FLAG_WRITE_FLOOR & TAB[TI * NF + S_FLAGS]) != 0:
        wfloor = tl.load(stage_ptr + off_re + b, mask=tl.where(tl.load(stage_ptr + _H_REPLAY_END) != 0, valid, False),
                         other=0)  # NOTE: tl.where, not `valid & flag`: Triton 3.9's interpreter (_request_task)
    else:
        wfloor = tl.zeros_like(pos)
    if KIND == WINDOW:
        _window_task(stage_ptr, base32, base64, base8, orow, t, in_out, b, valid, seq, pos, row, bt, stride,
                     twidth, ring, lo, hi, pay, wfloor, col0, off_qsl, off_rs, TAB, TI, BLOCK_LOADS, PART)
    elif KIND == CAUSAL:
        PB: tl.constexpr = TAB[TI * NF + S_ROWS_PER_BLOCK]
        n = visible_rows(pos, valid, R, CPW, CPR, CPI)
        n = tl.minimum(tl.minimum(n, TAB[TI * NF + S_WIDTH]), twidth * PB)
        _index_rows(stage_ptr, bt, out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4), t, in_out, row,
                    pos, n, n, pos, lo, hi, pay, col0, twidth, ring, stride, TAB, TI, BLOCK_LOADS)
        if col0 == 0:
            tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + t, n, mask=in_out)
    elif KIND == COMPRESSED:
        _compressed_task(stage_ptr, base32, base64, base8, orow, t, in_out, b, valid, seq, end, pos, row, bt,
                         stride, twidth, lo, hi, pay, wfloor, T_pad, rows, off_qsl, off_extra, TAB, TI)
    elif KIND == INDEXER:
        n = visible_rows(pos, valid, R, CPW, CPR, CPI)
        ks = tl.load(_staged_array(stage_ptr, off_extra, rows, TAB, TI) + b, mask=valid, other=0)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + t, n, mask=in_out)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + t, ks, mask=in_out)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 2, 4) + t, tl.where(valid, ks + n, 0), mask=in_out)
        if (HAS_OUT3 & TAB[TI * NF + S_HAS]) != 0:  # max(lens, 1)
            tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 3, 4) + t, tl.maximum(n, 1), mask=in_out)
    elif KIND == TOKEN_ROWS:
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + t, tl.where(valid, row, -1), mask=in_out)
        # NOTE: n_c of every row, owned or not: top-k picks are global row ids
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + t, visible_rows(pos, valid, R, 1, 0, 1),
                 mask=in_out)


@triton.jit
def _window_task(stage_ptr, base32, base64, base8, orow, t, in_out, b, valid, seq, pos, row, bt, stride, twidth,
                 ring, lo, hi, pay, wfloor, col0, off_qsl, off_rs, TAB: tl.constexpr, TI: tl.constexpr,
                 BLOCK_LOADS: tl.constexpr, PART: tl.constexpr):
    """WINDOW: the window index lists (columns from ``col0``), and with the first column the lens, the
    slot mapping (out2) and a circular group's write plan (out3); ``PART`` (:func:`_table_task`) picks them."""
    FLAGS: tl.constexpr = TAB[TI * NF + S_FLAGS]
    HAS: tl.constexpr = TAB[TI * NF + S_HAS]
    BLOCK_SIZE: tl.constexpr = TAB[TI * NF + S_BLOCK_SIZE]
    CPW: tl.constexpr = TAB[TI * NF + S_CPW]
    CPR: tl.constexpr = TAB[TI * NF + S_CPR]
    CPI: tl.constexpr = TAB[TI * NF + S_CPI]
    if (FLAG_WINDOW_FLOOR & FLAGS) != 0:
        floor = tl.load(stage_ptr + off_rs + b, mask=tl.where(tl.load(stage_ptr + _H_REPLAY_START) != 0, valid, False),
                        other=0)  # NOTE: tl.where, not `valid & flag`: Triton 3.9's interpreter (_request_task)
    else:
        floor = tl.zeros_like(pos)
    first, n = window_len(pos, valid, floor, TAB[TI * NF + S_WINDOW], CPW, CPR, CPI)
    if (FLAG_CIRCULAR & FLAGS) != 0:  # the request's chunk starts at its query_start row
        q_start = tl.load(stage_ptr + off_qsl + b, mask=valid, other=0)
    else:
        q_start = tl.zeros_like(pos)
    if PART != 1:
        _index_rows(stage_ptr, bt, out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4), t, in_out, row,
                    pos, first, n, q_start, lo, hi, pay, col0, twidth, ring, stride, TAB, TI, BLOCK_LOADS)
    if col0 == 0 and PART != 1:
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + t, n, mask=in_out)
    if col0 == 0 and PART != 2:
        if (HAS_OUT2 & HAS) != 0:  # slot_mapping
            slot = raw_slot(bt, row, pos, valid, wfloor, BLOCK_SIZE, twidth, ring, stride, CPW,
                            CPR, CPI, stage_ptr, lo, hi, pay, True)
            tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 2, 8) + t, slot, mask=in_out)
        if (HAS_OUT3 & HAS) != 0:  # tail_slot_mapping
            # NOTE: circular write plan: the last `capacity` tokens of the request's chunk; the
            # ring holds `ring` blocks of BLOCK_SIZE rows (a circular group's ring width is its block count)
            slot = raw_slot(bt, row, pos, valid, seq - BLOCK_SIZE * tl.maximum(ring, 1), BLOCK_SIZE, twidth, ring,
                            stride, CPW, CPR, CPI, stage_ptr, lo, hi, pay, True)
            tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 3, 8) + t, slot, mask=in_out)


@triton.jit
def _compressed_task(stage_ptr, base32, base64, base8, orow, t, in_out, b, valid, seq, end, pos, row, bt, stride,
                     twidth, lo, hi, pay, wfloor, T_pad, rows, off_qsl, off_extra, TAB: tl.constexpr,
                     TI: tl.constexpr):
    """COMPRESSED: the slot mapping, and the compact form (out1) when given."""
    R: tl.constexpr = TAB[TI * NF + S_RATIO]
    slot = compressed_slot(bt, row, pos, valid, wfloor, R, TAB[TI * NF + S_ROWS_PER_BLOCK], twidth, stride,
                           TAB[TI * NF + S_CPW], TAB[TI * NF + S_CPR], TAB[TI * NF + S_CPI], stage_ptr, lo, hi, pay,
                           True)
    tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 8) + t, slot, mask=in_out)
    if (HAS_OUT1 & TAB[TI * NF + S_HAS]) != 0:
        # NOTE: compact form: the k-th row the request completes this step goes to cu[b] + k;
        # entries from cu[B] on are -1 (written by the token with that index: disjoint stores)
        cu = _staged_array(stage_ptr, off_extra, rows, TAB, TI)
        start = tl.load(stage_ptr + off_qsl + b, mask=valid, other=0)
        ctx = seq - (end - start)
        done = valid & ((pos + 1) % R == 0)
        e = tl.load(cu + b, mask=valid, other=0) + pos // R - ctx // R
        compact = out_ptr(base32, base64, base8, orow, TAB, TI, 1, 8)
        tl.store(compact + e, slot, mask=done & (e < T_pad))
        total = tl.load(cu + tl.load(stage_ptr + _H_NUM_REQS))
        tl.store(compact + t, tl.full([TAB[TI * NF + S_BT]], -1, tl.int64), mask=in_out & (t >= total))


@triton.jit
def _token_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, r, T_pad, rows, off_qsl, off_seq,
                off_slots, off_rs, off_re, off_tok, off_extra, off_ov, TAB: tl.constexpr, TI: tl.constexpr,
                T_SUPER: tl.constexpr, BLOCK_LOADS: tl.constexpr, QX: tl.constexpr, LOG_R: tl.constexpr):
    """Program ``r`` of super tile ``s``, if it belongs to unit ``TI``: its task (one of the unit's ``S_REP``
    tasks of the same code, outs rows ``S_TASK + k``), token rows and first column."""
    START: tl.constexpr = TAB[TI * NF + S_START]
    NPROG: tl.constexpr = TAB[TI * NF + S_NPROG]
    REP: tl.constexpr = TAB[TI * NF + S_REP]
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    PER: tl.constexpr = T_SUPER // BT
    COLS: tl.constexpr = TAB[TI * NF + S_NCHUNK] * TAB[TI * NF + S_BC]
    FOLD: tl.constexpr = TAB[TI * NF + S_FOLD]
    if FOLD > 0:
        if (r >= START) & (r < START + NPROG * (REP // FOLD)):
            q = r - START
            if (FLAG_QUERY & TAB[TI * NF + S_FLAGS]) != 0:
                qslq = query_array(stage_ptr, off_extra, rows, QX)
                if declared(qslq):
                    _declared_fold_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, q, T_pad, rows,
                                        off_qsl, off_seq, off_slots, off_rs, off_re, off_tok, off_extra, off_ov, qslq,
                                        TAB, TI, T_SUPER, BLOCK_LOADS, QX, LOG_R)
                else:
                    _fold_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, q, T_pad, rows, off_qsl,
                               off_seq, off_slots, off_rs, off_re, off_tok, off_ov, TAB, TI, T_SUPER, BLOCK_LOADS)
            else:
                _fold_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, q, T_pad, rows, off_qsl, off_seq,
                           off_slots, off_rs, off_re, off_tok, off_ov, TAB, TI, T_SUPER, BLOCK_LOADS)
    elif (r >= START) & (r < START + NPROG * REP):
        q = r - START
        if REP > 1:
            orow = outs_ptr + (TAB[TI * NF + S_TASK] + q // NPROG) * OUTS_WORDS
            q = q % NPROG
        else:
            orow = outs_ptr + TAB[TI * NF + S_TASK] * OUTS_WORDS
        _token_task(stage_ptr, tables_ptr, base32, base64, base8, orow, s * T_SUPER + (q % PER) * BT,
                    (q // PER) * COLS, T_pad, rows, off_qsl, off_seq, off_slots, off_rs, off_re, off_tok, off_extra,
                    off_ov, TAB, TI, BLOCK_LOADS, QX, LOG_R)


@triton.jit
def _declared_fold_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, q, T_pad, rows, off_qsl, off_seq,
                        off_slots, off_rs, off_re, off_tok, off_extra, off_ov, qslq, TAB: tl.constexpr,
                        TI: tl.constexpr, T_SUPER: tl.constexpr, BLOCK_LOADS: tl.constexpr, QX: tl.constexpr,
                        LOG_R: tl.constexpr):
    """Program ``q`` of a folded window unit in a declared step: split (fused/rows.py, lists of query rows), else
    each folded task as a plain one (one chunk: width <= BC) over query rows."""
    NPROG: tl.constexpr = TAB[TI * NF + S_NPROG]
    FOLD: tl.constexpr = TAB[TI * NF + S_FOLD]
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    if TAB[TI * NF + S_SPLIT] != 0:
        window_split(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, (q // NPROG) * FOLD,
                     s * T_SUPER + (q % NPROG) * BT, T_pad, rows, off_qsl, off_seq, off_slots, off_rs, off_re,
                     off_tok, off_ov, qslq, TAB, TI, True, LOG_R)
    else:
        for k in tl.static_range(FOLD):
            _token_task(stage_ptr, tables_ptr, base32, base64, base8,
                        outs_ptr + (TAB[TI * NF + S_TASK] + (q // NPROG) * FOLD + k) * OUTS_WORDS,
                        s * T_SUPER + (q % NPROG) * BT, 0, T_pad, rows, off_qsl, off_seq, off_slots, off_rs, off_re,
                        off_tok, off_extra, off_ov, TAB, TI, BLOCK_LOADS, QX, LOG_R)


@triton.jit
def _fold_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, q, T_pad, rows, off_qsl, off_seq, off_slots,
               off_rs, off_re, off_tok, off_ov, TAB: tl.constexpr, TI: tl.constexpr, T_SUPER: tl.constexpr,
               BLOCK_LOADS: tl.constexpr):
    """Program ``q`` of a folded window unit (``S_FOLD`` tasks a program): split (fused/rows.py) or folded
    (fused/window.py)."""
    NPROG: tl.constexpr = TAB[TI * NF + S_NPROG]
    FOLD: tl.constexpr = TAB[TI * NF + S_FOLD]
    BT: tl.constexpr = TAB[TI * NF + S_BT]
    if TAB[TI * NF + S_SPLIT] != 0:
        window_split(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, (q // NPROG) * FOLD,
                     s * T_SUPER + (q % NPROG) * BT, T_pad, rows, off_qsl, off_seq, off_slots, off_rs, off_re,
                     off_tok, off_ov, stage_ptr, TAB, TI, False, 1)
    else:
        window_fold(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, (q // NPROG) * FOLD,
                    s * T_SUPER + (q % NPROG) * BT, T_pad, rows, off_qsl, off_seq, off_slots, off_rs, off_re,
                    off_tok, off_ov, TAB, TI, BLOCK_LOADS)


@triton.jit(do_not_specialize=["T_pad", "req_tiles", "rows", "off_qsl", "off_seq", "off_slots", "off_rs", "off_re",
                               "off_tok", "off_extra", "off_ov", "off_w"])
def fused_step_kernel(stage_ptr,   # int32 [*] staging buffer (state/staging.py format)
                      tables_ptr,  # int32 [*] every group's block table
                      base32, base64, base8,  # 16-byte aligned bases of the int32 / int64 / int8 outputs
                      outs_ptr,    # int64 [num_tasks, OUTS_WORDS]: output offsets (/ MUL), table words
                      T_pad, req_tiles, rows,
                      off_qsl, off_seq, off_slots, off_rs, off_re, off_tok, off_extra, off_ov, off_w,
                      REQ: tl.constexpr, TOK: tl.constexpr, NUM_REQ: tl.constexpr, NUM_TOK: tl.constexpr,
                      T_SUPER: tl.constexpr, P_SUPER: tl.constexpr, NUM_WRITERS: tl.constexpr,
                      BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, NEXT_N_PAD: tl.constexpr,
                      BLOCK_LOADS: tl.constexpr, QX: tl.constexpr, LOG_R: tl.constexpr):
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
                                  off_seq, off_slots, off_rs, off_re, off_extra, REQ, i, BLOCK_R, NEXT_N_PAD, QX)
        else:
            p = p - n_req
            s = p // P_SUPER
            r = p % P_SUPER
            for i in tl.static_range(NUM_TOK):
                _token_unit(stage_ptr, tables_ptr, base32, base64, base8, outs_ptr, s, r, T_pad, rows, off_qsl,
                            off_seq, off_slots, off_rs, off_re, off_tok, off_extra, off_ov, TOK, i, T_SUPER,
                            BLOCK_LOADS, QX, LOG_R)
