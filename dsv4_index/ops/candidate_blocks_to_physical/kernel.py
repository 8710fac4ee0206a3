"""Triton kernel of ``candidate_blocks_to_physical``: the candidate source's request-local blocks -> physical
candidate blocks (``slot(blk * C) / C``, SGLang's ``phys_blocks``) and valid counts, once per step.

A 1-D grid of ``cdiv(T_out, BLOCK_T)`` programs of whole rows (``BLOCK_N = next_pow2(nb)``), one table load
per block (:func:`dsv4_index.ops._device.candidate_phys`); ``C`` and ``S`` are ``constexpr``. Two prologues
(``SEARCH``) as in ``candidate_topk_to_slots``.
"""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import candidate_phys, row_in_table, searched_tokens, visible_rows

TILE_ELEMS = 512


def tile_config(nb: int):
    """(BLOCK_T, BLOCK_N, num_warps): whole rows, ``TILE_ELEMS`` blocks per tile."""
    block_n = max(16, triton.next_power_of_2(max(nb, 1)))
    block_t = max(1, min(64, TILE_ELEMS // block_n))
    return block_t, block_n, 4 if block_t * block_n <= 512 else 8


@triton.jit(do_not_specialize=["T_out", "blocks_rows", "blocks_stride", "NB", "num_reqs", "n_iter", "table_rows",
                               "row_stride", "table_width", "out_stride"])
def _candidate_phys_kernel(
        blocks_ptr,      # [blocks_rows, >= NB] int32, row stride blocks_stride
        qsl_ptr,         # [B + 1] int32 (SEARCH)
        seq_lens_ptr,    # [B] int32 (SEARCH)
        idx_ptr,         # [B] int32 (SEARCH and HAS_IDX)
        token_rows_ptr,  # [>= T_out] int32, -1 = padded (not SEARCH)
        token_nc_ptr,    # [>= T_out] int32 (not SEARCH)
        bt_ptr,          # [table_rows, cols] int32, row stride row_stride
        out_ptr,         # [>= T_out, NB] int32, row stride out_stride
        counts_ptr,      # [>= T_out] int32
        T_out, blocks_rows, blocks_stride, NB, num_reqs, n_iter, table_rows, row_stride, table_width, out_stride,
        S: tl.constexpr, R: tl.constexpr, C: tl.constexpr, HAS_IDX: tl.constexpr, SEARCH: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_out = t < T_out
    if SEARCH:
        b, row, valid, pos = searched_tokens(qsl_ptr, seq_lens_ptr, idx_ptr, t, T_out, num_reqs, n_iter, HAS_IDX)
        valid = row_in_table(row, valid, table_rows, HAS_IDX)
        n_c = visible_rows(pos, valid, R, 1, 0, 1)
    else:
        row = tl.load(token_rows_ptr + t, mask=in_out, other=-1)
        n_c = tl.load(token_nc_ptr + t, mask=in_out, other=0)
        valid = in_out & (row >= 0) & (row < table_rows)
    rd = valid & (t < blocks_rows)
    i = tl.arange(0, BLOCK_N)[None, :]
    ld = rd[:, None] & (i < NB)
    blk = tl.load(blocks_ptr + t.to(tl.int64)[:, None] * blocks_stride + i, mask=ld, other=-1)
    phys, ok = candidate_phys(bt_ptr, row[:, None], blk, ld, n_c[:, None], S, table_width, row_stride, C)
    tl.store(counts_ptr + t, tl.sum(ok.to(tl.int32), axis=1), mask=in_out)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * out_stride + i, phys, mask=in_out[:, None] & (i < NB))


def launch(blocks: torch.Tensor, batch, token, block_table: torch.Tensor, rows_per_block: int,
           compress_ratio: int, candidate_block_size: int, table_width: int, out: torch.Tensor,
           out_counts: torch.Tensor, T_out: int):
    """Fill rows ``[0, T_out)`` of ``out`` (int32 ``[>= T_out, nb]``) and ``out_counts``; ``batch`` /
    ``token`` as in ``candidate_topk_to_slots.kernel.launch``."""
    nb = out.shape[1]
    if T_out == 0:
        return out, out_counts
    block_t, block_n, num_warps = tile_config(nb)
    if batch is not None:
        qsl, seq, idx = batch
        trows = tnc = seq
        B = seq.numel()
    else:
        trows, tnc = token
        qsl = seq = idx = trows
        B = 0
    _candidate_phys_kernel[(triton.cdiv(T_out, block_t),)](
        blocks, qsl, seq, idx if idx is not None else seq, trows, tnc, block_table, out, out_counts,
        T_out, blocks.shape[0], max(blocks.stride(0), 1), nb, B, B.bit_length(), block_table.shape[0],
        block_table.stride(0), table_width, max(out.stride(0), 1),
        S=rows_per_block, R=compress_ratio, C=candidate_block_size, HAS_IDX=batch is not None and idx is not None,
        SEARCH=batch is not None, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=num_warps)
    return out, out_counts
