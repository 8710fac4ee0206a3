"""The fused step kernel: one launch applies the step's staged block-table writes and runs every
task of :mod:`dsv4_index.fused.tasks`, calling the formulas of :mod:`dsv4_index.ops._device`.

Grid (1-D, sized from ``T_pad`` only): ``NUM_WRITERS`` writer programs, then ``num_req_units x
req_tiles`` request programs, then ``tok_tiles x num_tok_units`` token programs (tile-major). A unit
is (task, column tile). Every address comes from the task table (int64 addresses of persistent
buffers); every per-step count from the staged header, so a CUDA graph of the launch replays any
step of the same ``T_pad``.

NOTE: writers write only the entries staged this step, and a reader of such an entry takes it from
the stage (the overlay), so no program reads what another program of the launch writes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops._device import (causal_row, compressed_slot, decode_row_lens, raw_slot, visible_rows, window_len,
                           window_row)
from ..state.staging import (H_NUM_DECODES, H_NUM_REQS, H_NUM_TOKENS, H_NUM_WRITES, H_REPLAY_END, H_REPLAY_START,
                             OV_HI, OV_LO, OV_PAY, OVERLAY_STRIDE)
from .tasks import (CAUSAL, COMMON, COMPRESSED, DECODE_LENS, F_A, F_B, F_CPI, F_CPR, F_CPW, F_EXTRA, F_FLAGS,
                    F_GROUP, F_KIND, F_OUT0, F_OUT1, F_OUT2, F_OUT3, F_RING, F_STRIDE, F_TABLE, F_TWIDTH, F_WIDTH,
                    FLAG_WINDOW_FLOOR, FLAG_WRITE_FLOOR, INDEXER, REPLAYS, REQUESTS, STAGED_COPY, TOKEN_ROWS, WINDOW)

_H_NUM_REQS: tl.constexpr = tl.constexpr(H_NUM_REQS)
_H_NUM_TOKENS: tl.constexpr = tl.constexpr(H_NUM_TOKENS)
_H_NUM_DECODES: tl.constexpr = tl.constexpr(H_NUM_DECODES)
_H_NUM_WRITES: tl.constexpr = tl.constexpr(H_NUM_WRITES)
_H_REPLAY_START: tl.constexpr = tl.constexpr(H_REPLAY_START)
_H_REPLAY_END: tl.constexpr = tl.constexpr(H_REPLAY_END)
_OVERLAY_STRIDE: tl.constexpr = tl.constexpr(OVERLAY_STRIDE)  # NOTE: the overlay record (state/staging.py)
_OV_LO: tl.constexpr = tl.constexpr(OV_LO)
_OV_HI: tl.constexpr = tl.constexpr(OV_HI)
_OV_PAY: tl.constexpr = tl.constexpr(OV_PAY)


@triton.jit
def _ptr(desc_ptr, field, DT: tl.constexpr):
    return tl.load(desc_ptr + field).to(tl.pointer_type(DT))


@triton.jit
def _field(desc_ptr, field):
    return tl.load(desc_ptr + field).to(tl.int32)


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
def _request_unit(stage_ptr, desc_ptr, tile, T_pad, rows, off_qsl, off_seq, off_slots, off_rs, off_re, off_extra,
                  BLOCK_R: tl.constexpr, NEXT_N_PAD: tl.constexpr, HAS_CP: tl.constexpr):
    kind = _field(desc_ptr, F_KIND)
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    B = tl.load(stage_ptr + _H_NUM_REQS)
    T = tl.load(stage_ptr + _H_NUM_TOKENS)
    if kind == REQUESTS:
        qsl = tl.load(stage_ptr + off_qsl + r, mask=r <= B, other=0)
        tl.store(_ptr(desc_ptr, F_OUT0, tl.int32) + r, tl.where(r <= B, qsl, T), mask=r <= T_pad)
        seq = tl.load(stage_ptr + off_seq + r, mask=r < B, other=0)
        tl.store(_ptr(desc_ptr, F_OUT1, tl.int32) + r, seq, mask=r <= T_pad)
        slot = tl.load(stage_ptr + off_slots + r, mask=r < B, other=0)
        tl.store(_ptr(desc_ptr, F_OUT2, tl.int32) + r, slot, mask=r <= T_pad)
    elif kind == REPLAYS:
        rs = tl.load(stage_ptr + off_rs + r, mask=(r < B) & (tl.load(stage_ptr + _H_REPLAY_START) != 0), other=0)
        tl.store(_ptr(desc_ptr, F_OUT0, tl.int32) + r, rs, mask=r <= T_pad)
        re = tl.load(stage_ptr + off_re + r, mask=(r < B) & (tl.load(stage_ptr + _H_REPLAY_END) != 0), other=0)
        tl.store(_ptr(desc_ptr, F_OUT1, tl.int32) + r, re, mask=r <= T_pad)
    elif kind == DECODE_LENS:
        next_n = _field(desc_ptr, F_B)
        nd = tl.load(stage_ptr + _H_NUM_DECODES)
        dec = r < nd
        seq = tl.load(stage_ptr + off_seq + r, mask=dec, other=0)
        q = tl.load(stage_ptr + off_qsl + r + 1, mask=dec, other=0) - tl.load(stage_ptr + off_qsl + r, mask=dec,
                                                                                other=0)
        j = tl.arange(0, NEXT_N_PAD)[None, :]
        if HAS_CP:
            n = decode_row_lens(seq, q, j, next_n, _field(desc_ptr, F_A), _field(desc_ptr, F_CPW),
                                _field(desc_ptr, F_CPR), _field(desc_ptr, F_CPI))
        else:
            n = decode_row_lens(seq, q, j, next_n, _field(desc_ptr, F_A), 1, 0, 1)
        n = tl.where(dec[:, None], n, 0)
        m = (r < T_pad)[:, None] & (j < next_n)
        off = r.to(tl.int64)[:, None] * next_n + j
        tl.store(_ptr(desc_ptr, F_OUT0, tl.int32) + off, n, mask=m)
        clamped = tl.load(desc_ptr + F_OUT1)
        if clamped != 0:
            tl.store(clamped.to(tl.pointer_type(tl.int32)) + off, tl.maximum(n, 1), mask=m)
    elif kind == STAGED_COPY:
        src = stage_ptr + off_extra + _field(desc_ptr, F_EXTRA) * (rows + 1)
        last = tl.load(src + B)
        v = tl.load(src + r, mask=r <= B, other=0)
        tl.store(_ptr(desc_ptr, F_OUT0, tl.int32) + r, tl.where(r <= B, v, last), mask=r <= T_pad)


@triton.jit
def _token_unit(stage_ptr, desc_ptr, tile, col, T_pad, rows, off_qsl, off_seq, off_slots, off_rs, off_re, off_tok,
                off_extra, off_ov, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_CP: tl.constexpr):
    kind = _field(desc_ptr, F_KIND)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    in_out = t < T_pad
    valid = t < tl.load(stage_ptr + _H_NUM_TOKENS)
    b = tl.load(stage_ptr + off_tok + t, mask=valid, other=0)
    seq = tl.load(stage_ptr + off_seq + b, mask=valid, other=0)
    end = tl.load(stage_ptr + off_qsl + b + 1, mask=valid, other=0)
    row = tl.load(stage_ptr + off_slots + b, mask=valid, other=0)
    pos = tl.where(valid, seq - end + t, 0)
    if kind == COMMON:
        tl.store(_ptr(desc_ptr, F_OUT0, tl.int32) + t, tl.where(valid, b, 0), mask=in_out)
        tl.store(_ptr(desc_ptr, F_OUT1, tl.int64) + t, pos.to(tl.int64), mask=in_out)
        tl.store(_ptr(desc_ptr, F_OUT2, tl.int8) + t, valid.to(tl.int8), mask=in_out)
    else:
        gid = _field(desc_ptr, F_GROUP)
        flags = _field(desc_ptr, F_FLAGS)
        bt = _ptr(desc_ptr, F_TABLE, tl.int32)
        stride = tl.load(desc_ptr + F_STRIDE)
        twidth = _field(desc_ptr, F_TWIDTH)
        ring = _field(desc_ptr, F_RING)
        a = _field(desc_ptr, F_A)
        pb = _field(desc_ptr, F_B)
        if HAS_CP:
            cpw = _field(desc_ptr, F_CPW)
            cpr = _field(desc_ptr, F_CPR)
            cpi = _field(desc_ptr, F_CPI)
        else:
            cpw = 1  # NOTE: Python ints are constexprs: the ownership math folds away
            cpr = 0
            cpi = 1
        ov = off_ov + (gid * rows + b) * _OVERLAY_STRIDE
        lo = tl.load(stage_ptr + ov + _OV_LO, mask=valid, other=0)
        hi = tl.load(stage_ptr + ov + _OV_HI, mask=valid, other=0)
        pay = tl.load(stage_ptr + ov + _OV_PAY, mask=valid, other=0)
        if kind == WINDOW:
            floor = tl.zeros_like(pos)
            if ((flags & FLAG_WINDOW_FLOOR) != 0) & (tl.load(stage_ptr + _H_REPLAY_START) != 0):
                floor = tl.load(stage_ptr + off_rs + b, mask=valid, other=0)
            first, n = window_len(pos, valid, floor, pb, cpw, cpr, cpi)
            width = _field(desc_ptr, F_WIDTH)
            j = col * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
            idx = window_row(bt, row, first, n, j, a, twidth, ring, stride, stage_ptr, lo, hi, pay, True)
            out = _ptr(desc_ptr, F_OUT0, tl.int32) + t.to(tl.int64)[:, None] * width + j
            tl.store(out, idx, mask=in_out[:, None] & (j < width))
            if col == 0:
                tl.store(_ptr(desc_ptr, F_OUT1, tl.int32) + t, n, mask=in_out)
                out2 = tl.load(desc_ptr + F_OUT2)
                if out2 != 0:
                    wfloor = tl.zeros_like(pos)
                    if ((flags & FLAG_WRITE_FLOOR) != 0) & (tl.load(stage_ptr + _H_REPLAY_END) != 0):
                        wfloor = tl.load(stage_ptr + off_re + b, mask=valid, other=0)
                    slot = raw_slot(bt, row, pos, valid, wfloor, a, twidth, ring, stride, cpw, cpr, cpi,
                                    stage_ptr, lo, hi, pay, True)
                    tl.store(out2.to(tl.pointer_type(tl.int64)) + t, slot, mask=in_out)
        elif kind == COMPRESSED:
            wfloor = tl.zeros_like(pos)
            if ((flags & FLAG_WRITE_FLOOR) != 0) & (tl.load(stage_ptr + _H_REPLAY_END) != 0):
                wfloor = tl.load(stage_ptr + off_re + b, mask=valid, other=0)
            slot = compressed_slot(bt, row, pos, valid, wfloor, a, pb, twidth, stride, cpw, cpr, cpi,
                                   stage_ptr, lo, hi, pay, True)
            tl.store(_ptr(desc_ptr, F_OUT0, tl.int64) + t, slot, mask=in_out)
            out1 = tl.load(desc_ptr + F_OUT1)
            if out1 != 0:
                # NOTE: compact form: the k-th row the request completes this step goes to cu[b] + k;
                # entries from cu[B] on are -1 (written by the token with that index: disjoint stores)
                cu = stage_ptr + off_extra + _field(desc_ptr, F_EXTRA) * (rows + 1)
                start = tl.load(stage_ptr + off_qsl + b, mask=valid, other=0)
                ctx = seq - (end - start)
                done = valid & ((pos + 1) % a == 0)
                e = tl.load(cu + b, mask=valid, other=0) + pos // a - ctx // a
                compact = out1.to(tl.pointer_type(tl.int64))
                tl.store(compact + e, slot, mask=done & (e < T_pad))
                total = tl.load(cu + tl.load(stage_ptr + _H_NUM_REQS))
                tl.store(compact + t, tl.full([BLOCK_T], -1, tl.int64), mask=in_out & (t >= total))
        elif kind == CAUSAL:
            width = _field(desc_ptr, F_WIDTH)
            n = visible_rows(pos, valid, a, cpw, cpr, cpi)
            n = tl.minimum(tl.minimum(n, width), twidth * pb)
            j = col * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
            idx = causal_row(bt, row, n, j, pb, stride, stage_ptr, lo, hi, pay, True)
            out = _ptr(desc_ptr, F_OUT0, tl.int32) + t.to(tl.int64)[:, None] * width + j
            tl.store(out, idx, mask=in_out[:, None] & (j < width))
            if col == 0:
                tl.store(_ptr(desc_ptr, F_OUT1, tl.int32) + t, n, mask=in_out)
        elif kind == INDEXER:
            n = visible_rows(pos, valid, a, cpw, cpr, cpi)
            cu = stage_ptr + off_extra + _field(desc_ptr, F_EXTRA) * (rows + 1)
            ks = tl.load(cu + b, mask=valid, other=0)
            tl.store(_ptr(desc_ptr, F_OUT0, tl.int32) + t, n, mask=in_out)
            tl.store(_ptr(desc_ptr, F_OUT1, tl.int32) + t, tl.where(valid, ks, 0), mask=in_out)
            tl.store(_ptr(desc_ptr, F_OUT2, tl.int32) + t, tl.where(valid, ks + n, 0), mask=in_out)
            clamped = tl.load(desc_ptr + F_OUT3)
            if clamped != 0:
                tl.store(clamped.to(tl.pointer_type(tl.int32)) + t, tl.maximum(n, 1), mask=in_out)
        elif kind == TOKEN_ROWS:
            tl.store(_ptr(desc_ptr, F_OUT0, tl.int32) + t, tl.where(valid, row, -1), mask=in_out)
            # NOTE: n_c of every row, owned or not: top-k picks are global row ids
            tl.store(_ptr(desc_ptr, F_OUT1, tl.int32) + t, visible_rows(pos, valid, a, 1, 0, 1), mask=in_out)


@triton.jit(do_not_specialize=["stage_addr", "tables_addr", "tasks_addr", "units_addr", "T_pad", "num_req_units",
                               "req_tiles", "num_tok_units", "rows", "off_qsl", "off_seq", "off_slots", "off_rs",
                               "off_re", "off_tok", "off_extra", "off_ov", "off_w"])
def fused_step_kernel(stage_addr,   # int64 address: int32 [*] staging buffer (state/staging.py format)
                      tables_addr,  # int64 address: int32 [*] every group's block table
                      tasks_addr,   # int64 address: int64 [num_tasks, NF] task descriptors
                      units_addr,   # int64 address: int32 [num_units, 2] (task, column tile)
                      T_pad, num_req_units, req_tiles, num_tok_units, rows,
                      off_qsl, off_seq, off_slots, off_rs, off_re, off_tok, off_extra, off_ov, off_w,
                      NF: tl.constexpr, NUM_WRITERS: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                      NEXT_N_PAD: tl.constexpr, HAS_CP: tl.constexpr):
    stage_ptr = stage_addr.to(tl.pointer_type(tl.int32))
    tasks_ptr = tasks_addr.to(tl.pointer_type(tl.int64))
    units_ptr = units_addr.to(tl.pointer_type(tl.int32))
    pid = tl.program_id(0)
    if pid < NUM_WRITERS:
        _write_blocks(stage_ptr, tables_addr.to(tl.pointer_type(tl.int32)), pid, off_w, NUM_WRITERS, BLOCK_W)
    else:
        p = pid - NUM_WRITERS
        n_req = num_req_units * req_tiles
        if p < n_req:
            unit = p % num_req_units
            task = tl.load(units_ptr + 2 * unit)
            _request_unit(stage_ptr, tasks_ptr + task.to(tl.int64) * NF, p // num_req_units, T_pad, rows, off_qsl,
                          off_seq, off_slots, off_rs, off_re, off_extra, BLOCK_R, NEXT_N_PAD, HAS_CP)
        else:
            p = p - n_req
            unit = num_req_units + p % num_tok_units
            task = tl.load(units_ptr + 2 * unit)
            col = tl.load(units_ptr + 2 * unit + 1)
            _token_unit(stage_ptr, tasks_ptr + task.to(tl.int64) * NF, p // num_tok_units, col, T_pad, rows, off_qsl,
                        off_seq, off_slots, off_rs, off_re, off_tok, off_extra, off_ov, BLOCK_T, BLOCK_C, HAS_CP)
