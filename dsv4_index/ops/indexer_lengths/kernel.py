"""Triton kernel of ``indexer_lengths``: one launch of token programs, decode-view programs and cu
programs; each sums what it needs of the request counts with a bounded loop over request tiles
(:func:`dsv4_index.ops._device.rows_before`), so the grid depends on host counts only. Bodies:
:func:`~dsv4_index.ops._device.visible_rows`, :func:`~dsv4_index.ops._device.decode_row_lens`."""

from __future__ import annotations

import torch

from ..._triton import triton, tl
from .._device import decode_row_lens, rows_before, searched_tokens, visible_rows

BLOCK_T = 128
BLOCK_B = 64


@triton.jit(do_not_specialize=["T_out", "num_reqs", "n_iter", "n_req_tiles", "compress_ratio",
                               "cp_world", "cp_rank", "cp_interleave", "next_n", "num_decodes",
                               "dec_rows", "n_tok_prog", "n_dec_prog"])
def _indexer_lengths_kernel(
        qsl_ptr,       # [B + 1] int32
        seq_lens_ptr,  # [B] int32
        lens_ptr,      # [T_out] int32
        ks_ptr,        # [T_out] int32
        ke_ptr,        # [T_out] int32
        dec_ptr,       # [dec_rows, next_n] int32 (unused when n_dec_prog == 0)
        cu_ptr,        # [B + 1] int32
        T_out, num_reqs, n_iter, n_req_tiles, compress_ratio, cp_world, cp_rank, cp_interleave,
        next_n, num_decodes, dec_rows, n_tok_prog, n_dec_prog,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_tok_prog:
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        in_out = t < T_out
        b, _, valid, pos = searched_tokens(qsl_ptr, seq_lens_ptr, seq_lens_ptr, t, T_out, num_reqs,
                                           n_iter, False)
        n = visible_rows(pos, valid, compress_ratio, cp_world, cp_rank, cp_interleave)
        ks = tl.where(valid, rows_before(seq_lens_ptr, b, num_reqs, n_req_tiles, compress_ratio,
                                         cp_world, cp_rank, cp_interleave, BLOCK_B), 0)
        tl.store(lens_ptr + t, n, mask=in_out)
        tl.store(ks_ptr + t, ks.to(tl.int32), mask=in_out)
        tl.store(ke_ptr + t, tl.where(valid, ks + n, 0).to(tl.int32), mask=in_out)
    elif pid < n_tok_prog + n_dec_prog:
        r = (pid - n_tok_prog) * BLOCK_R + tl.arange(0, BLOCK_R)
        j = tl.arange(0, BLOCK_N)[None, :]
        is_req = r < num_decodes
        start = tl.load(qsl_ptr + r, mask=is_req, other=0)
        end = tl.load(qsl_ptr + r + 1, mask=is_req, other=0)
        seq = tl.load(seq_lens_ptr + r, mask=is_req, other=0)
        n = decode_row_lens(seq, end - start, j, next_n, compress_ratio, cp_world, cp_rank,
                            cp_interleave)
        n = tl.where(is_req[:, None], n, 0)
        tl.store(dec_ptr + r.to(tl.int64)[:, None] * next_n + j, n,
                 mask=(r < dec_rows)[:, None] & (j < next_n))
    else:
        i = (pid - n_tok_prog - n_dec_prog) * BLOCK_T + tl.arange(0, BLOCK_T)
        cu = rows_before(seq_lens_ptr, i, num_reqs, n_req_tiles, compress_ratio, cp_world, cp_rank,
                         cp_interleave, BLOCK_B)
        tl.store(cu_ptr + i, cu.to(tl.int32), mask=i <= num_reqs)


def launch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, compress_ratio: int,
           cp_world_size: int, cp_rank: int, cp_interleave: int, next_n, num_decodes: int,
           lens: torch.Tensor, decode_lens, ks: torch.Tensor, ke: torch.Tensor, cu: torch.Tensor):
    """Fill ``lens``, ``ks``, ``ke`` (int32 ``[T_out]``), ``cu`` (int32 ``[B + 1]``) and, when given,
    ``decode_lens`` (int32 ``[dec_rows, next_n]``) from checked arguments."""
    num_reqs, T_out = seq_lens.numel(), lens.shape[0]
    dec_rows = decode_lens.shape[0] if decode_lens is not None else 0
    nn = next_n or 1
    block_n = triton.next_power_of_2(nn)
    block_r = max(1, BLOCK_T // block_n)
    n_tok, n_dec = triton.cdiv(T_out, BLOCK_T), triton.cdiv(dec_rows, block_r)
    n_cu = triton.cdiv(num_reqs + 1, BLOCK_T)
    _indexer_lengths_kernel[(n_tok + n_dec + n_cu,)](
        query_start_loc, seq_lens, lens, ks, ke, decode_lens if decode_lens is not None else cu, cu,
        T_out, num_reqs, num_reqs.bit_length(), triton.cdiv(num_reqs, BLOCK_B), compress_ratio,
        cp_world_size, cp_rank, cp_interleave, nn, num_decodes, dec_rows, n_tok, n_dec,
        BLOCK_T=BLOCK_T, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_B=BLOCK_B, num_warps=4)
    return lens, decode_lens, ks, ke, cu
