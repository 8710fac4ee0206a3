"""Triton kernel of ``candidate_topk_to_slots``: a consumer layer's sparse columns -> physical slots.

The body of ``topk_to_slots`` (:func:`dsv4_index.ops._device.store_topk_slots`) behind one gather: column
``j`` of token ``t`` becomes the request-local row ``blocks[t, j // C] * C + j % C``
(:func:`dsv4_index.ops._device.candidate_row`), then converts like a top-k pick. A 1-D grid of
``cdiv(T_out, BLOCK_T)`` programs of whole rows (``BLOCK_K = next_pow2(K)``); ``C``, ``S`` and the DCP
geometry are ``constexpr``. Two prologues (``SEARCH``): the public op searches the token's request, the
pipeline form loads the table row and ``n_c`` its step build left behind.
"""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import candidate_row, row_in_table, searched_tokens, store_topk_slots, visible_rows

TILE_ELEMS = 512  # columns per program when a row is shorter


def tile_config(K: int):
    """(BLOCK_T, BLOCK_K, num_warps): whole rows, ``TILE_ELEMS`` columns per tile (as ``topk_to_slots``)."""
    block_k = max(16, triton.next_power_of_2(max(K, 1)))
    block_t = max(1, min(64, TILE_ELEMS // block_k))
    return block_t, block_k, 4 if block_t * block_k <= 512 else 8


@triton.jit(do_not_specialize=["T_out", "cols_rows", "cols_stride", "K", "blocks_rows", "blocks_stride", "NB",
                               "num_reqs", "n_iter", "table_rows", "row_stride", "table_width", "out_stride"])
def _candidate_topk_kernel(
        cols_ptr,        # [cols_rows, >= K] int32 | int64, row stride cols_stride
        blocks_ptr,      # [blocks_rows, >= NB] int32, row stride blocks_stride
        qsl_ptr,         # [B + 1] int32 (SEARCH)
        seq_lens_ptr,    # [B] int32 (SEARCH)
        idx_ptr,         # [B] int32 table row per request (SEARCH and HAS_IDX)
        token_rows_ptr,  # [>= T_out] int32 table row of each token, -1 = padded (not SEARCH)
        token_nc_ptr,    # [>= T_out] int32 n_c of each token (not SEARCH)
        bt_ptr,          # [table_rows, cols] int32, row stride row_stride
        out_ptr,         # [>= T_out, K] int32, row stride out_stride
        lens_ptr,        # [>= T_out] int32
        T_out, cols_rows, cols_stride, K, blocks_rows, blocks_stride, NB, num_reqs, n_iter, table_rows,
        row_stride, table_width, out_stride,
        S: tl.constexpr, R: tl.constexpr, C: tl.constexpr, CP_WORLD: tl.constexpr, CP_RANK: tl.constexpr,
        CP_INTERLEAVE: tl.constexpr, HAS_IDX: tl.constexpr, SEARCH: tl.constexpr, COMPACT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_out = t < T_out
    if SEARCH:
        b, row, valid, pos = searched_tokens(qsl_ptr, seq_lens_ptr, idx_ptr, t, T_out, num_reqs, n_iter, HAS_IDX)
        valid = row_in_table(row, valid, table_rows, HAS_IDX)
        n_c = visible_rows(pos, valid, R, 1, 0, 1)  # NOTE: every row: candidate rows are global row ids
    else:
        row = tl.load(token_rows_ptr + t, mask=in_out, other=-1)
        n_c = tl.load(token_nc_ptr + t, mask=in_out, other=0)
        valid = in_out & (row >= 0) & (row < table_rows)
    rd = valid & (t < cols_rows) & (t < blocks_rows)
    k = tl.arange(0, BLOCK_K)[None, :]
    cols = tl.load(cols_ptr + t.to(tl.int64)[:, None] * cols_stride + k, mask=rd[:, None] & (k < K), other=-1)
    picks = candidate_row(blocks_ptr, blocks_stride, t[:, None], rd[:, None], cols, n_c[:, None], NB, C)
    store_topk_slots(picks, t, row, valid, n_c, bt_ptr, out_ptr, lens_ptr, row_stride, table_width,
                     out_stride, T_out, K, S, CP_WORLD, CP_RANK, CP_INTERLEAVE, COMPACT, BLOCK_K)


def launch(blocks: torch.Tensor, cols: torch.Tensor, batch, token, block_table: torch.Tensor,
           rows_per_block: int, compress_ratio: int, candidate_block_size: int, table_width: int,
           cp: tuple, compact: bool, out: torch.Tensor, out_lens: torch.Tensor, T_out: int):
    """Fill rows ``[0, T_out)`` of ``out`` (int32 ``[>= T_out, K]``) and ``out_lens`` from checked arguments.

    ``batch`` = ``(query_start_loc, seq_lens, idx_mapping or None)`` for the public op (request search), or
    None; ``token`` = ``(token_rows, token_nc)`` for the pipeline form, or None. ``cp`` = ``(world, rank,
    interleave)``.
    """
    K = out.shape[1]
    if T_out == 0:
        return out, out_lens
    block_t, block_k, num_warps = tile_config(K)
    if batch is not None:
        qsl, seq, idx = batch
        trows = tnc = seq
        B = seq.numel()
    else:
        trows, tnc = token
        qsl = seq = idx = trows
        B = 0
    _candidate_topk_kernel[(triton.cdiv(T_out, block_t),)](
        cols, blocks, qsl, seq, idx if idx is not None else seq, trows, tnc, block_table, out, out_lens,
        T_out, cols.shape[0], max(cols.stride(0), 1), K, blocks.shape[0], max(blocks.stride(0), 1),
        blocks.shape[1], B, B.bit_length(), block_table.shape[0], block_table.stride(0), table_width,
        max(out.stride(0), 1),
        S=rows_per_block, R=compress_ratio, C=candidate_block_size, CP_WORLD=cp[0], CP_RANK=cp[1],
        CP_INTERLEAVE=cp[2], HAS_IDX=batch is not None and idx is not None, SEARCH=batch is not None,
        COMPACT=bool(compact), BLOCK_T=block_t, BLOCK_K=block_k, num_warps=num_warps)
    return out, out_lens
