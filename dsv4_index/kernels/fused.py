"""Fused per-step build (DESIGN §8): one Triton launch fills the common token tensors and every
built-in channel's per-step outputs.

One 1-D grid of ``NUM_REQ_PROG + NUM_WRITERS + cdiv(T_pad, BLOCK_T) * NUM_TASKS`` programs, sized
from host-known numbers only (padded token count, static widths, the set of channels):

* request programs (only with an indexer channel): program 0 writes the indexer's ``cu`` (a prefix
  sum over request tiles with a carry), program 1 its ``decode_lens`` ``[max_num_reqs, next_n]``;
* writer programs (``NUM_WRITERS``): apply the step's block-table segments (staged by the pipeline,
  :mod:`dsv4_index.block_table` segment format) to the persistent device tables, piece ``s`` of a
  group by writer ``s % NUM_WRITERS``;
* token programs, tile-major: program ``q`` handles token tile ``q // NUM_TASKS`` and task
  ``q % NUM_TASKS``:

  - task 0 (common): ``token_to_req``, ``is_valid_token``, ``positions``, the raw slot mapping of every
    window channel, every distinct compressed slot mapping (``c4a`` and ``c4i`` share one), and the
    indexer's ``lens`` / ``ks`` / ``ke`` (``ks`` sums the request counts before the token's request
    with a loop over request tiles, so ``cu`` is not needed first);
  - task ``1 + i``: window channel ``i``'s indices ``[BLOCK_T, width]`` and lens;
  - then, per causal list (``c128a``, the optional ``c4i`` list), one task per column tile of
    ``BLOCK_C`` entries (lens written by column tile 0).

Block-table reads and the segment writes share the launch without a race: a token program that
reads entry ``(b, j)`` of a group first looks up row ``b``'s staged range ``[lo, hi)`` (the overlay:
``(lo, hi, payload_offset)`` per batch row) and takes the staged value when ``lo <= j < hi``, the
table value otherwise. NOTE: writers only write staged ranges, so no program reads a table entry
that another program of the same launch writes. Staging layout (int32, ``stage``): header of group
``g`` at ``SEG_HDR + 3 g`` = (pieces, first descriptor, overlay base or -1 when no batch row is staged).

Geometry (block sizes, ratios, windows, widths, DCP rank) is ``constexpr``: it is fixed for a
pipeline. Runtime counts (``T_pad``, ``num_decodes``) are plain arguments that Triton does not
specialise on, so one compilation serves every step (``MetadataPipeline.warmup()`` compiles it). Only
``T_pad`` (the grid) is read from the host: everything else that changes per step, decode rows
included, comes from the staged device data, so a CUDA graph of ``build()`` replays correctly.
Every output matches the unfused builders (the per-op kernels) bit for bit, over ``[0, T_pad)``.

At most ``MAX_WINDOW`` window channels, ``MAX_COMPRESSED`` distinct compressed slot mappings and
``MAX_CAUSAL`` causal lists are fused; builders beyond that, and any builder whose class is not
exactly a built-in one, keep their own launches.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch
import triton
import triton.language as tl

from ..channels.builtin import (CausalCompressedChannel, CompressedChannel, IndexerChannel,
                                WindowChannel)
from ._compressed import find_request, num_search_iters, owned_count

__all__ = ["FusedPlan", "MAX_WINDOW", "MAX_COMPRESSED", "MAX_CAUSAL", "MAX_GROUPS", "segment_header"]

MAX_WINDOW = 3
MAX_COMPRESSED = 2
MAX_CAUSAL = 2
MAX_GROUPS = 4  # kv-cache groups whose block-table segments the launch applies


def segment_header(max_num_reqs: int) -> int:
    """Offset of the per-group segment headers in the staging buffer: after query_start_loc [R + 1],
    seq_lens [R] and replay_start [R]."""
    return 3 * max_num_reqs + 1


# ----------------------------------------------------------------------------------------------
# device functions
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tokens(qsl_ptr, seq_lens_ptr, tile, T_pad, num_reqs, n_iter, BLOCK_T: tl.constexpr):
    """Token tile: (t int32, in_out, request b, valid, pos int64 — 0 where not valid)."""
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    in_out = t < T_pad
    b = find_request(qsl_ptr, t, num_reqs, n_iter)
    valid = in_out & (t < tl.load(qsl_ptr + num_reqs))  # NOTE: validity from the device qsl[B]
    sl = tl.load(seq_lens_ptr + b, mask=valid, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + b + 1, mask=valid, other=0).to(tl.int64)
    pos = tl.where(valid, sl - end + t, 0)
    return t, in_out, b, valid, pos


@triton.jit
def _overlay(stage_ptr, b, valid, HDR: tl.constexpr):
    """Row ``b``'s staged range of the group whose header is at ``HDR``: (lo, hi, payload offset), int32;
    ``lo = hi = 0`` (nothing staged) where not valid or when the group stages no batch row."""
    base = tl.load(stage_ptr + HDR + 2)
    has = valid & (base >= 0)
    o = base + 3 * b
    lo = tl.load(stage_ptr + o, mask=has, other=0)
    hi = tl.load(stage_ptr + o + 1, mask=has, other=0)
    pay = tl.load(stage_ptr + o + 2, mask=has, other=0)
    return lo, hi, pay


@triton.jit
def _bt_read(bt_ptr, stage_ptr, b, blk, ok, lo, hi, pay, STRIDE: tl.constexpr):
    """Entry ``[b, blk]`` as of this step: the staged value inside ``[lo, hi)``, else the table's."""
    staged = ok & (blk >= lo) & (blk < hi)
    v = tl.load(bt_ptr + b.to(tl.int64) * STRIDE + blk, mask=ok & (~staged), other=0)
    w = tl.load(stage_ptr + pay + (blk - lo), mask=staged, other=0)
    return tl.where(staged, w, v)


@triton.jit
def _write_segments(stage_ptr, bt_ptr, w, HDR: tl.constexpr, STRIDE: tl.constexpr,
                    NUM_WRITERS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Writer ``w``: copy pieces ``w, w + NUM_WRITERS, ...`` of one group into its table."""
    n_seg = tl.load(stage_ptr + HDR)
    first = tl.load(stage_ptr + HDR + 1)
    for s in range(w, n_seg, NUM_WRITERS):
        d = first + 4 * s
        row = tl.load(stage_ptr + d).to(tl.int64)
        lo = tl.load(stage_ptr + d + 1)
        n = tl.load(stage_ptr + d + 2)
        pay = tl.load(stage_ptr + d + 3)
        for c in range(0, n, BLOCK_W):
            j = c + tl.arange(0, BLOCK_W)
            m = j < n
            v = tl.load(stage_ptr + pay + j, mask=m, other=0)
            tl.store(bt_ptr + row * STRIDE + lo + j, v, mask=m)


@triton.jit
def _cp_local(p, CP_W: tl.constexpr, CP_R: tl.constexpr, CP_I: tl.constexpr):
    """(owned by this rank, local position) of position / row ``p`` (``p >= 0``)."""
    own = ((p // CP_I) % CP_W) == CP_R
    return own, (p // (CP_I * CP_W)) * CP_I + p % CP_I


@triton.jit
def _raw_slots(bt_ptr, stage_ptr, out_ptr, t, in_out, b, valid, pos,
               BS: tl.constexpr, TW: tl.constexpr, STRIDE: tl.constexpr, HDR: tl.constexpr,
               CP_W: tl.constexpr, CP_R: tl.constexpr, CP_I: tl.constexpr):
    own, lp = _cp_local(pos, CP_W, CP_R, CP_I)
    blk = lp // BS
    ok = valid & (pos >= 0) & own & (blk < TW)
    lo, hi, pay = _overlay(stage_ptr, b, valid, HDR)
    bid = _bt_read(bt_ptr, stage_ptr, b, blk, ok, lo, hi, pay, STRIDE)
    tl.store(out_ptr + t, tl.where(ok, bid.to(tl.int64) * BS + lp % BS, -1), mask=in_out)


@triton.jit
def _compressed_slots(bt_ptr, stage_ptr, out_ptr, t, in_out, b, valid, pos,
                      R: tl.constexpr, S: tl.constexpr, TW: tl.constexpr, STRIDE: tl.constexpr,
                      HDR: tl.constexpr, CP_W: tl.constexpr, CP_R: tl.constexpr, CP_I: tl.constexpr):
    c = pos // R
    own, lc = _cp_local(c, CP_W, CP_R, CP_I)
    blk = lc // S
    ok = valid & (pos >= 0) & ((pos + 1) % R == 0) & own & (blk < TW)
    lo, hi, pay = _overlay(stage_ptr, b, valid, HDR)
    bid = _bt_read(bt_ptr, stage_ptr, b, blk, ok, lo, hi, pay, STRIDE)
    tl.store(out_ptr + t, tl.where(ok, bid.to(tl.int64) * S + lc % S, -1), mask=in_out)


@triton.jit
def _window_task(qsl_ptr, seq_lens_ptr, replay_ptr, bt_ptr, stage_ptr, idx_ptr, lens_ptr,
                 tile, T_pad, num_reqs, n_iter,
                 BS: tl.constexpr, WIN: tl.constexpr, WIDTH: tl.constexpr, WPAD: tl.constexpr,
                 TW: tl.constexpr, STRIDE: tl.constexpr, HDR: tl.constexpr,
                 CP_W: tl.constexpr, CP_R: tl.constexpr, CP_I: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    t, in_out, b, valid, pos = _tokens(qsl_ptr, seq_lens_ptr, tile, T_pad, num_reqs, n_iter, BLOCK_T)
    floor = tl.load(replay_ptr + b, mask=valid, other=0).to(tl.int64)
    start = tl.maximum(tl.maximum(pos - WIN + 1, floor), 0)
    first = owned_count(start, CP_W, CP_R, CP_I)
    count = owned_count(tl.maximum(pos + 1, 0), CP_W, CP_R, CP_I) - first
    count = tl.where(valid, tl.maximum(count, 0), 0)
    j = tl.arange(0, WPAD)[None, :]
    lp = first[:, None] + j
    blk = lp // BS
    ok = (j < count[:, None]) & (blk < TW)
    lo, hi, pay = _overlay(stage_ptr, b, valid, HDR)
    bid = _bt_read(bt_ptr, stage_ptr, b[:, None], blk, ok, lo[:, None], hi[:, None], pay[:, None], STRIDE)
    slot = (bid.to(tl.int64) * BS + lp % BS).to(tl.int32)
    tl.store(idx_ptr + t.to(tl.int64)[:, None] * WIDTH + j, tl.where(ok, slot, -1),
             mask=in_out[:, None] & (j < WIDTH))
    tl.store(lens_ptr + t, tl.sum(ok.to(tl.int32), axis=1), mask=in_out)


@triton.jit
def _causal_task(qsl_ptr, seq_lens_ptr, bt_ptr, stage_ptr, idx_ptr, lens_ptr,
                 tile, col, T_pad, num_reqs, n_iter,
                 R: tl.constexpr, S: tl.constexpr, LIMIT: tl.constexpr, STRIDE: tl.constexpr,
                 HDR: tl.constexpr,
                 WIDTH: tl.constexpr, CP_W: tl.constexpr, CP_R: tl.constexpr, CP_I: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t, in_out, b, valid, pos = _tokens(qsl_ptr, seq_lens_ptr, tile, T_pad, num_reqs, n_iter, BLOCK_T)
    n = owned_count(tl.maximum(pos + 1, 0) // R, CP_W, CP_R, CP_I)
    # NOTE: owned rows ascending are local rows 0 .. n-1; the list is that prefix, truncated to
    # LIMIT = min(WIDTH, table_width * S), so every read stays inside the table.
    lens = tl.where(valid, tl.minimum(n, LIMIT), 0)
    j = col * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    ok = j < lens[:, None]
    lo, hi, pay = _overlay(stage_ptr, b, valid, HDR)
    bid = _bt_read(bt_ptr, stage_ptr, b[:, None], j // S, ok, lo[:, None], hi[:, None], pay[:, None], STRIDE)
    slot = (bid.to(tl.int64) * S + j % S).to(tl.int32)
    tl.store(idx_ptr + t.to(tl.int64)[:, None] * WIDTH + j, tl.where(ok, slot, -1),
             mask=in_out[:, None] & (j < WIDTH))
    if col == 0:
        tl.store(lens_ptr + t, lens.to(tl.int32), mask=in_out)


@triton.jit
def _rows_before(seq_lens_ptr, b, num_reqs, n_req_tiles, R: tl.constexpr,
                 CP_W: tl.constexpr, CP_R: tl.constexpr, CP_I: tl.constexpr, BLOCK_B: tl.constexpr):
    """``sum_{b' < b} owned(seq_lens[b'] // R)`` (int64) for each entry of ``b``."""
    acc = b.to(tl.int64) * 0
    for i in range(n_req_tiles):
        bb = i * BLOCK_B + tl.arange(0, BLOCK_B)
        sl = tl.load(seq_lens_ptr + bb, mask=bb < num_reqs, other=0).to(tl.int64)
        c = owned_count(tl.maximum(sl, 0) // R, CP_W, CP_R, CP_I)
        acc += tl.sum(tl.where(bb[None, :] < b[:, None], c[None, :], 0), axis=1)
    return acc


@triton.jit(do_not_specialize=["T_pad", "num_decodes", "num_reqs", "n_iter", "n_req_tiles",
                               "dec_rows"])
def _fused_step_kernel(
    stage_ptr,      # [stage capacity] int32: step arrays, segment headers, descriptors, payloads, overlays
    g0_tab, g1_tab, g2_tab, g3_tab,  # [B, TW_g] int32: the persistent table of each gid (segment writes)
    qsl_ptr,        # [B + 1] int32 (B = max_num_reqs; rows past the batch: zero-length)
    seq_lens_ptr,   # [B] int32
    replay_ptr,     # [B] int32
    ttr_ptr,        # [T_pad] int32
    valid_ptr,      # [T_pad] bool
    pos_ptr,        # [T_pad] int64
    w0_bt, w0_slots, w0_idx, w0_lens,  # [B, TW] int32, [T_pad] int64, [T_pad, WIDTH] int32, [T_pad] int32
    w1_bt, w1_slots, w1_idx, w1_lens,
    w2_bt, w2_slots, w2_idx, w2_lens,
    c0_bt, c0_out,  # [B, TW] int32, [T_pad] int64
    c1_bt, c1_out,
    ix_lens, ix_ks, ix_ke,  # [T_pad] int32 each
    ix_cu,          # [B + 1] int32
    ix_dec,         # [dec_rows, NEXT_N] int32
    k0_bt, k0_idx, k0_lens,  # [B, TW] int32, [T_pad, WIDTH] int32, [T_pad] int32
    k1_bt, k1_idx, k1_lens,
    T_pad, num_decodes, num_reqs, n_iter, n_req_tiles, dec_rows,
    CP_W: tl.constexpr, CP_R: tl.constexpr, CP_I: tl.constexpr,
    NUM_TASKS: tl.constexpr, NUM_REQ_PROG: tl.constexpr,
    NUM_GROUPS: tl.constexpr, NUM_WRITERS: tl.constexpr, BLOCK_W: tl.constexpr, SEG_HDR: tl.constexpr,
    G0_STRIDE: tl.constexpr, G1_STRIDE: tl.constexpr, G2_STRIDE: tl.constexpr, G3_STRIDE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    NUM_WIN: tl.constexpr,
    W0_BS: tl.constexpr, W0_WIN: tl.constexpr, W0_WIDTH: tl.constexpr, W0_WPAD: tl.constexpr,
    W0_TW: tl.constexpr, W0_STRIDE: tl.constexpr, W0_HDR: tl.constexpr,
    W1_BS: tl.constexpr, W1_WIN: tl.constexpr, W1_WIDTH: tl.constexpr, W1_WPAD: tl.constexpr,
    W1_TW: tl.constexpr, W1_STRIDE: tl.constexpr, W1_HDR: tl.constexpr,
    W2_BS: tl.constexpr, W2_WIN: tl.constexpr, W2_WIDTH: tl.constexpr, W2_WPAD: tl.constexpr,
    W2_TW: tl.constexpr, W2_STRIDE: tl.constexpr, W2_HDR: tl.constexpr,
    NUM_CMP: tl.constexpr,
    C0_R: tl.constexpr, C0_S: tl.constexpr, C0_TW: tl.constexpr, C0_STRIDE: tl.constexpr,
    C0_HDR: tl.constexpr,
    C1_R: tl.constexpr, C1_S: tl.constexpr, C1_TW: tl.constexpr, C1_STRIDE: tl.constexpr,
    C1_HDR: tl.constexpr,
    HAS_IX: tl.constexpr, IX_R: tl.constexpr, NEXT_N: tl.constexpr,
    NUM_CAUSAL: tl.constexpr,
    K0_R: tl.constexpr, K0_S: tl.constexpr, K0_LIMIT: tl.constexpr, K0_STRIDE: tl.constexpr,
    K0_WIDTH: tl.constexpr, K0_START: tl.constexpr, K0_TILES: tl.constexpr, K0_HDR: tl.constexpr,
    K1_R: tl.constexpr, K1_S: tl.constexpr, K1_LIMIT: tl.constexpr, K1_STRIDE: tl.constexpr,
    K1_WIDTH: tl.constexpr, K1_START: tl.constexpr, K1_TILES: tl.constexpr, K1_HDR: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < NUM_REQ_PROG:
        if HAS_IX:
            if pid == 0:
                # cu[0] = 0, cu[b + 1] = cu[b] + owned(seq_lens[b] // R): scan with a carry
                carry = pid.to(tl.int64) * 0
                for i in range(0, tl.cdiv(num_reqs, BLOCK_R)):
                    bb = i * BLOCK_R + tl.arange(0, BLOCK_R)
                    sl = tl.load(seq_lens_ptr + bb, mask=bb < num_reqs, other=0).to(tl.int64)
                    c = owned_count(tl.maximum(sl, 0) // IX_R, CP_W, CP_R, CP_I)
                    tl.store(ix_cu + bb + 1, (tl.cumsum(c, 0) + carry).to(tl.int32), mask=bb < num_reqs)
                    carry += tl.sum(c, 0)
                tl.store(ix_cu, carry.to(tl.int32) * 0)
            else:
                # NOTE: entry [r, j] is token j - (NEXT_N - q_r) of decode r: pos = seq_len - NEXT_N + j
                for i in range(0, tl.cdiv(dec_rows * NEXT_N, BLOCK_R)):
                    e = i * BLOCK_R + tl.arange(0, BLOCK_R)
                    in_dec = e < dec_rows * NEXT_N
                    r = e // NEXT_N
                    j = e % NEXT_N
                    # NOTE: decode rows are found from device data (0 < q_r <= NEXT_N: the pipeline's
                    # one threshold, decode-first order, rows past the batch have q_r = 0), not from the
                    # host's num_decodes, so a replayed CUDA graph fills the right rows.
                    in_tab = in_dec & (r < num_reqs)
                    q = (tl.load(qsl_ptr + r + 1, mask=in_tab, other=0)
                         - tl.load(qsl_ptr + r, mask=in_tab, other=0))
                    is_req = in_tab & (q > 0) & (q <= NEXT_N)
                    sl = tl.load(seq_lens_ptr + r, mask=is_req, other=0).to(tl.int64)
                    n = owned_count(tl.maximum(sl - NEXT_N + j + 1, 0) // IX_R, CP_W, CP_R, CP_I)
                    tl.store(ix_dec + e, tl.where(is_req & (j >= NEXT_N - q), n, 0).to(tl.int32),
                             mask=in_dec)
    elif pid < NUM_REQ_PROG + NUM_WRITERS:
        w = pid - NUM_REQ_PROG
        if NUM_GROUPS > 0:
            _write_segments(stage_ptr, g0_tab, w, SEG_HDR, G0_STRIDE, NUM_WRITERS, BLOCK_W)
        if NUM_GROUPS > 1:
            _write_segments(stage_ptr, g1_tab, w, SEG_HDR + 3, G1_STRIDE, NUM_WRITERS, BLOCK_W)
        if NUM_GROUPS > 2:
            _write_segments(stage_ptr, g2_tab, w, SEG_HDR + 6, G2_STRIDE, NUM_WRITERS, BLOCK_W)
        if NUM_GROUPS > 3:
            _write_segments(stage_ptr, g3_tab, w, SEG_HDR + 9, G3_STRIDE, NUM_WRITERS, BLOCK_W)
    else:
        q_id = pid - NUM_REQ_PROG - NUM_WRITERS
        tile = q_id // NUM_TASKS
        task = q_id % NUM_TASKS
        if task == 0:
            t, in_out, b, valid, pos = _tokens(qsl_ptr, seq_lens_ptr, tile, T_pad, num_reqs, n_iter,
                                               BLOCK_T)
            tl.store(ttr_ptr + t, tl.where(valid, b, 0), mask=in_out)
            tl.store(valid_ptr + t, valid, mask=in_out)
            tl.store(pos_ptr + t, pos, mask=in_out)
            if NUM_WIN > 0:
                _raw_slots(w0_bt, stage_ptr, w0_slots, t, in_out, b, valid, pos, W0_BS, W0_TW,
                           W0_STRIDE, W0_HDR,
                           CP_W, CP_R, CP_I)
            if NUM_WIN > 1:
                _raw_slots(w1_bt, stage_ptr, w1_slots, t, in_out, b, valid, pos, W1_BS, W1_TW,
                           W1_STRIDE, W1_HDR,
                           CP_W, CP_R, CP_I)
            if NUM_WIN > 2:
                _raw_slots(w2_bt, stage_ptr, w2_slots, t, in_out, b, valid, pos, W2_BS, W2_TW,
                           W2_STRIDE, W2_HDR,
                           CP_W, CP_R, CP_I)
            if NUM_CMP > 0:
                _compressed_slots(c0_bt, stage_ptr, c0_out, t, in_out, b, valid, pos, C0_R, C0_S,
                                  C0_TW, C0_STRIDE, C0_HDR, CP_W, CP_R, CP_I)
            if NUM_CMP > 1:
                _compressed_slots(c1_bt, stage_ptr, c1_out, t, in_out, b, valid, pos, C1_R, C1_S,
                                  C1_TW, C1_STRIDE, C1_HDR, CP_W, CP_R, CP_I)
            if HAS_IX:
                n = tl.where(valid, owned_count(tl.maximum(pos + 1, 0) // IX_R, CP_W, CP_R, CP_I), 0)
                ks = tl.where(valid, _rows_before(seq_lens_ptr, b, num_reqs, n_req_tiles, IX_R,
                                                  CP_W, CP_R, CP_I, BLOCK_B), 0)
                tl.store(ix_lens + t, n.to(tl.int32), mask=in_out)
                tl.store(ix_ks + t, ks.to(tl.int32), mask=in_out)
                tl.store(ix_ke + t, tl.where(valid, ks + n, 0).to(tl.int32), mask=in_out)
        if NUM_WIN > 0:
            if task == 1:
                _window_task(qsl_ptr, seq_lens_ptr, replay_ptr, w0_bt, stage_ptr, w0_idx, w0_lens,
                             tile, T_pad, num_reqs, n_iter, W0_BS, W0_WIN, W0_WIDTH, W0_WPAD,
                             W0_TW, W0_STRIDE, W0_HDR,
                             CP_W, CP_R, CP_I, BLOCK_T)
        if NUM_WIN > 1:
            if task == 2:
                _window_task(qsl_ptr, seq_lens_ptr, replay_ptr, w1_bt, stage_ptr, w1_idx, w1_lens,
                             tile, T_pad, num_reqs, n_iter, W1_BS, W1_WIN, W1_WIDTH, W1_WPAD,
                             W1_TW, W1_STRIDE, W1_HDR,
                             CP_W, CP_R, CP_I, BLOCK_T)
        if NUM_WIN > 2:
            if task == 3:
                _window_task(qsl_ptr, seq_lens_ptr, replay_ptr, w2_bt, stage_ptr, w2_idx, w2_lens,
                             tile, T_pad, num_reqs, n_iter, W2_BS, W2_WIN, W2_WIDTH, W2_WPAD,
                             W2_TW, W2_STRIDE, W2_HDR,
                             CP_W, CP_R, CP_I, BLOCK_T)
        if NUM_CAUSAL > 0:
            if (task >= K0_START) & (task < K0_START + K0_TILES):
                _causal_task(qsl_ptr, seq_lens_ptr, k0_bt, stage_ptr, k0_idx, k0_lens, tile,
                             task - K0_START, T_pad, num_reqs, n_iter, K0_R, K0_S, K0_LIMIT,
                             K0_STRIDE, K0_HDR, K0_WIDTH,
                             CP_W, CP_R, CP_I, BLOCK_T, BLOCK_C)
        if NUM_CAUSAL > 1:
            if (task >= K1_START) & (task < K1_START + K1_TILES):
                _causal_task(qsl_ptr, seq_lens_ptr, k1_bt, stage_ptr, k1_idx, k1_lens, tile,
                             task - K1_START, T_pad, num_reqs, n_iter, K1_R, K1_S, K1_LIMIT,
                             K1_STRIDE, K1_HDR, K1_WIDTH,
                             CP_W, CP_R, CP_I, BLOCK_T, BLOCK_C)


# ----------------------------------------------------------------------------------------------
# host plan
# ----------------------------------------------------------------------------------------------
def _check_table(name: str, bt: torch.Tensor) -> Tuple[int, int]:
    if bt.dim() != 2 or bt.dtype != torch.int32 or bt.stride(1) != 1:
        raise ValueError(f"{name} must be an int32 [rows, width] table with unit column stride")
    return bt.shape[1], bt.stride(0)


class FusedPlan:
    """Everything one fused launch needs, bound once at construction (no work per step but the launch).

    Parameters
    ----------
    ctx : BuildContext — the pipeline's context (capacity buffers, DCP rank, block tables per gid).
    builders : dict name -> ChannelBuilder — allocated builders; the ones whose class is exactly a
        built-in class (and that fit the kernel's slots) are covered.
    token_to_req : int32 [max_num_tokens]; positions : int64 [max_num_tokens];
    is_valid_token : bool [max_num_tokens] — the pipeline's common buffers.
    block_t : int, optional — token rows per program (default 32; 64 under the interpreter).
    block_c : int, optional — columns per causal-list program (default 128).
    stage : int32 1-D device tensor, optional — the pipeline's staging buffer (step arrays at its
        start, segment headers at :func:`segment_header`); ``None``: a private one that stages nothing.
    num_writers : int, optional — programs applying block-table segments (default 32; 2 under the
        interpreter). block_w : int — entries per writer store (default 1024).

    Attributes
    ----------
    covered : frozenset of str — channel names whose ``launch`` the plan replaces.
    """

    def __init__(self, ctx, builders: Dict[str, object], *, token_to_req: torch.Tensor,
                 positions: torch.Tensor, is_valid_token: torch.Tensor, block_t: int = None,
                 block_c: int = 128, stage: torch.Tensor = None, num_writers: int = None,
                 block_w: int = 1024):
        from .._common import interpreting
        if block_t is None:
            block_t = 64 if interpreting() else 32
        if num_writers is None:
            num_writers = 2 if interpreting() else 32
        G = len(ctx.block_tables)
        if G > MAX_GROUPS:
            raise ValueError(f"block_tables: the fused launch applies at most {MAX_GROUPS} groups, got {G}")
        hdr = segment_header(ctx.max_num_reqs)
        if stage is None:
            stage = torch.zeros(hdr + 3 * MAX_GROUPS, dtype=torch.int32, device=ctx.device)
            stage[hdr + 2::3] = -1  # NOTE: no overlay, no pieces
        if stage.dtype != torch.int32 or stage.dim() != 1 or stage.numel() < hdr + 3 * G:
            raise ValueError(f"stage must be a 1-D int32 buffer of >= {hdr + 3 * G} entries")
        for name, v in (("block_t", block_t), ("block_c", block_c), ("block_w", block_w)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v!r}")
        T, R = ctx.max_num_tokens, ctx.max_num_reqs
        for name, buf, dt in (("token_to_req", token_to_req, torch.int32), ("positions", positions, torch.int64),
                              ("is_valid_token", is_valid_token, torch.bool)):
            if buf.dtype != dt or buf.dim() != 1 or buf.shape[0] < T or not buf.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dt} buffer of >= {T} entries")
        dummy = positions
        cp = dict(CP_W=ctx.cp_world_size, CP_R=ctx.cp_rank, CP_I=ctx.cp_interleave)

        windows: List = []
        compressed: Dict[tuple, object] = {}   # shared key -> (bt, buffer, spec)
        causal: List = []                      # (bt, idx, lens, spec)
        indexer = None
        covered = []
        for name, bld in builders.items():
            cls = type(bld)
            bt = ctx.block_tables[bld.spec.gid]
            if cls is WindowChannel:
                if len(windows) < MAX_WINDOW:
                    windows.append(bld)
                    covered.append(name)
                continue
            if cls not in (CompressedChannel, IndexerChannel, CausalCompressedChannel):
                continue
            key = bld.shared_key
            need_cmp = key not in compressed
            need_causal = cls is CausalCompressedChannel or (cls is IndexerChannel and bld.with_indices)
            if need_cmp and len(compressed) >= MAX_COMPRESSED:
                continue
            if need_causal and len(causal) >= MAX_CAUSAL:
                continue
            if cls is IndexerChannel and indexer is not None:
                continue
            if need_cmp:
                compressed[key] = (bt, bld.compressed, bld.spec)  # NOTE: spec.gid picks the segment header
            if cls is CausalCompressedChannel:
                causal.append((bt, bld.indices, bld.lens, bld.spec))
            elif cls is IndexerChannel:
                indexer = bld
                if bld.with_indices:
                    causal.append((bt, bld.indices, bld.index_lens, bld.spec))
            covered.append(name)
        self.covered = frozenset(covered)
        self._keys = tuple(compressed)

        if isinstance(num_writers, bool) or not isinstance(num_writers, int) or num_writers < 1:
            raise ValueError(f"num_writers must be an int >= 1, got {num_writers!r}")
        consts = dict(cp, BLOCK_T=block_t, BLOCK_B=64, BLOCK_R=min(1024, triton.next_power_of_2(R + 1)),
                      BLOCK_C=block_c, NUM_GROUPS=G, NUM_WRITERS=num_writers, BLOCK_W=block_w, SEG_HDR=hdr)
        tabs = list(ctx.block_tables) + [ctx.block_tables[0]] * (MAX_GROUPS - G)
        for i, bt in enumerate(tabs):
            if not bt.is_contiguous():
                raise ValueError("block_tables must be contiguous (segments are written at row * width)")
            consts[f"G{i}_STRIDE"] = bt.stride(0)
        self.stage = stage
        args: List[torch.Tensor] = [stage, *tabs, ctx.query_start_loc, ctx.seq_lens, ctx.replay_start,
                                    token_to_req, is_valid_token, positions]
        consts["NUM_WIN"] = len(windows)
        for i in range(MAX_WINDOW):
            if i < len(windows):
                w = windows[i]
                bt = ctx.block_tables[w.spec.gid]
                tw, stride = _check_table("block_tables", bt)
                width = w.indices.shape[1]
                args += [bt, w.slots, w.indices, w.lens]
                g = dict(BS=w.kernel_block_size, WIN=w.spec.window, WIDTH=width,
                         WPAD=triton.next_power_of_2(width), TW=tw, STRIDE=stride, HDR=hdr + 3 * w.spec.gid)
            else:
                args += [ctx.block_tables[0], dummy, dummy, dummy]
                g = dict(BS=1, WIN=1, WIDTH=1, WPAD=1, TW=1, STRIDE=1, HDR=hdr)
            consts.update({f"W{i}_{k}": v for k, v in g.items()})
        consts["NUM_CMP"] = len(compressed)
        cmp = list(compressed.values())
        for i in range(MAX_COMPRESSED):
            if i < len(cmp):
                bt, buf, s = cmp[i]
                tw, stride = _check_table("block_tables", bt)
                args += [bt, buf]
                g = dict(R=s.compress_ratio, S=s.rows_per_block, TW=tw, STRIDE=stride, HDR=hdr + 3 * s.gid)
            else:
                args += [ctx.block_tables[0], dummy]
                g = dict(R=1, S=1, TW=1, STRIDE=1, HDR=hdr)
            consts.update({f"C{i}_{k}": v for k, v in g.items()})
        if indexer is not None:
            args += [indexer.lens, indexer.ks, indexer.ke, indexer.cu, indexer.decode_lens]
            consts.update(HAS_IX=True, IX_R=indexer.spec.compress_ratio, NEXT_N=ctx.next_n)
            dec_rows = indexer.decode_lens.shape[0]
            if indexer.decode_lens.shape[1] != ctx.next_n or indexer.cu.shape[0] != R + 1:
                raise ValueError("builders: indexer buffers do not match the context's capacity")
        else:
            args += [dummy] * 5
            consts.update(HAS_IX=False, IX_R=1, NEXT_N=1)
            dec_rows = 0
        consts["NUM_CAUSAL"] = len(causal)
        start = 1 + len(windows)
        for i in range(MAX_CAUSAL):
            if i < len(causal):
                bt, idx, lens, s = causal[i]
                tw, stride = _check_table("block_tables", bt)
                tiles = triton.cdiv(idx.shape[1], block_c)
                args += [bt, idx, lens]
                g = dict(R=s.compress_ratio, S=s.rows_per_block, LIMIT=min(idx.shape[1], tw * s.rows_per_block),
                         STRIDE=stride, WIDTH=idx.shape[1], START=start, TILES=tiles, HDR=hdr + 3 * s.gid)
                start += tiles
            else:
                args += [ctx.block_tables[0], dummy, dummy]
                g = dict(R=1, S=1, LIMIT=1, STRIDE=1, WIDTH=1, START=0, TILES=0, HDR=hdr)
            consts.update({f"K{i}_{k}": v for k, v in g.items()})
        consts["NUM_TASKS"] = start
        consts["NUM_REQ_PROG"] = 2 if indexer is not None else 0
        self._consts = consts
        self._block_t = block_t
        self._num_tasks = start
        self._num_req_prog = consts["NUM_REQ_PROG"]
        self._num_writers = num_writers
        self._lead = consts["NUM_REQ_PROG"] + num_writers
        # runtime scalars that never change for a pipeline
        self._args = tuple(args)
        self._tail = (R, num_search_iters(R), triton.cdiv(R, consts["BLOCK_B"]), dec_rows)
        self.kernel = _fused_step_kernel
        # Opt-in (DSV4_INDEX_FAST_LAUNCH=1, CUDA only): after the first launch, call the compiled
        # kernel's launcher directly, skipping Triton's per-call argument binding and cache lookup.
        # NOTE: relies on Triton 3.x CompiledKernel.run(grid..., stream, function, packed_metadata,
        # launch_metadata, enter_hook, exit_hook, *all args in signature order).
        self._fast = (os.environ.get("DSV4_INDEX_FAST_LAUNCH", "0") not in ("", "0")
                      and ctx.device.type == "cuda" and not interpreting())
        self._compiled = None
        names = getattr(self.kernel, "arg_names", None)
        if self._fast and names:
            runtime = dict(zip(("T_pad", "num_decodes", "num_reqs", "n_iter", "n_req_tiles", "dec_rows"),
                               (None, None) + self._tail))
            lead = len(self._args)
            self._head = self._args
            self._const_vals = tuple(consts[k] for k in names[lead + len(runtime):])
            if list(names[lead:lead + len(runtime)]) != list(runtime) or len(self._const_vals) != len(consts):
                self._fast = False
        else:
            self._fast = False

    # ------------------------------------------------------------------------------------------
    def num_programs(self, num_tokens_padded: int) -> int:
        """Grid size of one launch for ``num_tokens_padded`` tokens."""
        return self._lead + -(-num_tokens_padded // self._block_t) * self._num_tasks

    def launch(self, ctx) -> None:
        """One launch for the step in ``ctx`` (no host sync, no allocation)."""
        n = self._lead + -(-ctx.num_tokens_padded // self._block_t) * self._num_tasks
        if n:
            if self._compiled is not None:
                self._launch_compiled(n, ctx.num_tokens_padded, ctx.num_decodes)
            else:
                k = self.kernel[(n,)](*self._args, ctx.num_tokens_padded, ctx.num_decodes, *self._tail,
                                      **self._consts)
                if self._fast and hasattr(k, "run") and hasattr(k, "packed_metadata"):
                    self._compiled = k
        # NOTE: builders outside the plan that share a compressed buffer must not recompute it
        ctx._done.update(self._keys)

    def _launch_compiled(self, n: int, T_pad: int, num_decodes: int) -> None:
        k = self._compiled
        stream = torch.cuda.current_stream().cuda_stream
        k.run(n, 1, 1, stream, k.function, k.packed_metadata, None, None, None,
              *self._head, T_pad, num_decodes, *self._tail, *self._const_vals)

    def warmup_specializations(self, ctx) -> None:
        """Compile the kernel: one launch of one padded token. One specialisation serves every step
        (runtime counts are not specialised). Overwrites row 0 of the outputs: call it before
        serving (``MetadataPipeline.warmup()`` compiles the same way through ``build()``)."""
        saved = ctx.num_tokens_padded, ctx.num_decodes
        try:
            ctx.num_tokens_padded, ctx.num_decodes = 1, 0
            self.launch(ctx)
        finally:
            ctx.num_tokens_padded, ctx.num_decodes = saved

    def num_compiled(self) -> int:
        """Compiled specialisations of the fused kernel on the current CUDA device (-1 if unknown)."""
        try:
            dev = torch.cuda.current_device()
            return len(self.kernel.device_caches[dev][0])
        except Exception:  # pragma: no cover - interpreter / other Triton versions
            return -1
