"""Lightning-Indexer lengths (``c4i``): visible compressed rows per token, decode view, ks/ke.

``lens[t] = n_c(pos_t)`` (owned rows under DCP); the decode view ``[num_decodes, next_n]`` is
right-aligned like the tokens it describes; ``cu`` is the prefix sum over requests of
``seq_len_b // R`` (owned count under DCP), ``ks[t] = cu[b]``, ``ke[t] = cu[b] + lens[t]``. One
launch: token programs, decode-view programs and cu programs; each sums what it needs of the
request counts with a bounded loop over request tiles (no device-dependent grid).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from dsv4_index._common import (cdiv, check_batch, check_batch_values, check_cp, check_positive_int,
                                cp_owned_count, needs_value_checks, prepare_out, use_triton)
from dsv4_index.kernels._compressed import (INT32_MAX, num_search_iters, owned_count, resolve_rows,
                                            token_rows)


class IndexerLengths(NamedTuple):
    """Outputs of :func:`indexer_lengths`, all int32."""
    lens: torch.Tensor                    # [T_out]
    decode_lens: Optional[torch.Tensor]   # [>= num_decodes, next_n] or None
    ks: torch.Tensor                      # [T_out]
    ke: torch.Tensor                      # [T_out]
    cu: torch.Tensor                      # [B + 1]


class IndexerArgs(NamedTuple):
    num_reqs: int
    rows: int      # T_out
    next_n: Optional[int]
    num_decodes: int
    outs: IndexerLengths


def check_indexer_lengths_args(query_start_loc, seq_lens, compress_ratio, next_n, num_decodes,
                               cp_world_size, cp_rank, cp_interleave, num_tokens, out, out_decode,
                               out_ks, out_ke, out_cu, validate) -> IndexerArgs:
    """Argument checks shared by the wrapper and the reference; allocates missing outputs."""
    B, device = check_batch(query_start_loc, seq_lens)
    check_positive_int("compress_ratio", compress_ratio)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    if (next_n is None) != (num_decodes is None):
        raise ValueError("next_n and num_decodes must be given together "
                         f"(got next_n={next_n!r}, num_decodes={num_decodes!r})")
    if next_n is None and out_decode is not None:
        raise ValueError("out_decode needs next_n and num_decodes")
    if next_n is not None:
        check_positive_int("next_n", next_n)
        check_positive_int("num_decodes", num_decodes, minimum=0)
        if num_decodes > B:
            raise ValueError(f"num_decodes = {num_decodes} exceeds the batch size B = {B}")
    rows = resolve_rows(query_start_loc, num_tokens,
                        {"out": out, "out_ks": out_ks, "out_ke": out_ke})
    min_rows = num_tokens or 0
    lens, ks, ke = (prepare_out(name, buf, shape=(rows,), min_rows=min_rows, dtype=torch.int32,
                                device=device)
                    for name, buf in (("out", out), ("out_ks", out_ks), ("out_ke", out_ke)))
    cu = prepare_out("out_cu", out_cu, shape=(B + 1,), min_rows=B + 1, dtype=torch.int32,
                     device=device)
    if cu.shape[0] != B + 1:
        raise ValueError(f"out_cu has {cu.shape[0]} entries, expected B + 1 = {B + 1}")
    dec = None
    if next_n is not None:
        dec = prepare_out("out_decode", out_decode, shape=(num_decodes, next_n),
                          min_rows=num_decodes, dtype=torch.int32, device=device, exact_cols=True)
    if needs_value_checks(device, validate):
        check_batch_values(query_start_loc, seq_lens, num_tokens=rows)
        qsl = query_start_loc.detach().cpu().long()
        if next_n is not None:
            q = qsl[1:num_decodes + 1] - qsl[:num_decodes]
            bad = torch.nonzero(q > next_n)
            if bad.numel():
                b = int(bad[0])
                raise ValueError(f"next_n = {next_n} is below the query length {int(q[b])} of "
                                 f"decode request {b} (query_start_loc)")
        n = cp_owned_count(seq_lens.detach().cpu().long().clamp(min=0) // compress_ratio,
                           cp_world_size, cp_rank, cp_interleave)
        if int(n.sum()) > INT32_MAX:
            raise ValueError("seq_lens: the compressed-row total of the batch exceeds int32 (cu)")
    return IndexerArgs(B, rows, next_n, num_decodes or 0, IndexerLengths(lens, dec, ks, ke, cu))


@triton.jit
def _rows_before(seq_lens_ptr, b, num_reqs, n_req_tiles, compress_ratio, cp_world, cp_rank,
                 cp_interleave, BLOCK_B: tl.constexpr):
    """``sum_{b' < b} owned(seq_lens[b'] // R)`` (int64) for each entry of ``b``."""
    acc = b.to(tl.int64) * 0
    for i in range(n_req_tiles):
        bb = i * BLOCK_B + tl.arange(0, BLOCK_B)
        sl = tl.load(seq_lens_ptr + bb, mask=bb < num_reqs, other=0).to(tl.int64)
        c = owned_count(tl.maximum(sl, 0) // compress_ratio, cp_world, cp_rank, cp_interleave)
        acc += tl.sum(tl.where(bb[None, :] < b[:, None], c[None, :], 0), axis=1)
    return acc


# NOTE: runtime counts are never specialised (a count of 1 would otherwise compile a new variant)
@triton.jit(do_not_specialize=["T_out", "num_reqs", "n_iter", "n_req_tiles", "compress_ratio", "cp_world",
                            "cp_rank", "cp_interleave", "next_n", "num_decodes", "dec_rows", "n_tok_prog",
                            "n_dec_prog"])
def _indexer_lengths_kernel(
    qsl_ptr,        # [B + 1] int32
    seq_lens_ptr,   # [B] int32
    lens_ptr,       # [T_out] int32
    ks_ptr,         # [T_out] int32
    ke_ptr,         # [T_out] int32
    dec_ptr,        # [dec_rows, next_n] int32 (unused when n_dec_prog == 0)
    cu_ptr,         # [B + 1] int32
    T_out, num_reqs, n_iter, n_req_tiles, compress_ratio, cp_world, cp_rank, cp_interleave,
    next_n, num_decodes, dec_rows, n_tok_prog, n_dec_prog,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK_T)
    if pid < n_tok_prog:
        t = pid * BLOCK_T + idx
        in_out = t < T_out
        b, live, n = token_rows(qsl_ptr, seq_lens_ptr, t, T_out, num_reqs, n_iter, compress_ratio,
                                cp_world, cp_rank, cp_interleave)
        ks = tl.where(live, _rows_before(seq_lens_ptr, b, num_reqs, n_req_tiles, compress_ratio,
                                         cp_world, cp_rank, cp_interleave, BLOCK_B), 0)
        tl.store(lens_ptr + t, n.to(tl.int32), mask=in_out)
        tl.store(ks_ptr + t, ks.to(tl.int32), mask=in_out)
        tl.store(ke_ptr + t, tl.where(live, ks + n, 0).to(tl.int32), mask=in_out)
    elif pid < n_tok_prog + n_dec_prog:
        # NOTE: entry [b, j] is token j - (next_n - q_b) of request b: pos = seq_len_b - next_n + j.
        e = (pid - n_tok_prog) * BLOCK_T + idx
        in_dec = e < dec_rows * next_n
        r = e // next_n
        j = e % next_n
        is_req = in_dec & (r < num_decodes)
        start = tl.load(qsl_ptr + r, mask=is_req, other=0)
        end = tl.load(qsl_ptr + r + 1, mask=is_req, other=0)
        sl = tl.load(seq_lens_ptr + r, mask=is_req, other=0).to(tl.int64)
        present = is_req & (j >= next_n - (end - start))
        n_c = tl.maximum(sl - next_n + j + 1, 0) // compress_ratio
        n = owned_count(n_c, cp_world, cp_rank, cp_interleave)
        tl.store(dec_ptr + e, tl.where(present, n, 0).to(tl.int32), mask=in_dec)
    else:
        i = (pid - n_tok_prog - n_dec_prog) * BLOCK_T + idx
        cu = _rows_before(seq_lens_ptr, i, num_reqs, n_req_tiles, compress_ratio, cp_world,
                          cp_rank, cp_interleave, BLOCK_B)
        tl.store(cu_ptr + i, cu.to(tl.int32), mask=i <= num_reqs)


def indexer_lengths(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, compress_ratio: int, *,
                    next_n: Optional[int] = None, num_decodes: Optional[int] = None,
                    cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                    num_tokens: Optional[int] = None, out: Optional[torch.Tensor] = None,
                    out_decode: Optional[torch.Tensor] = None, out_ks: Optional[torch.Tensor] = None,
                    out_ke: Optional[torch.Tensor] = None, out_cu: Optional[torch.Tensor] = None,
                    validate: bool = False, backend: Optional[str] = None) -> IndexerLengths:
    """Indexer context lengths of every token (``c4i``).

    Parameters
    ----------
    query_start_loc : int32 ``[B + 1]``
    seq_lens : int32 ``[B]``
    compress_ratio : int
        ``R`` of the indexer cache.
    next_n, num_decodes : int, optional (together)
        Build the decode view ``[num_decodes, next_n]`` of the first ``num_decodes`` requests
        (each must have ``q_len <= next_n``).
    cp_world_size, cp_rank, cp_interleave : int
        DCP: count only the rows this rank owns.
    num_tokens : int, optional
        Host-known live token count; rows of the per-token outputs when no ``out=`` is given.
    out, out_ks, out_ke : int32 ``[T_out]``, optional (same rows)
    out_decode : int32 ``[>= num_decodes, next_n]``, optional; rows past ``num_decodes`` get 0.
    out_cu : int32 ``[B + 1]``, optional
    validate : bool
        Run the value checks on CUDA inputs too (always on CPU).
    backend : {None, "triton", "reference"}

    Returns
    -------
    IndexerLengths(lens, decode_lens, ks, ke, cu)
        ``lens[t] = n_c(pos_t) = (pos_t + 1) // R`` (owned count under DCP); ``decode_lens[b, j]``
        = lens of token ``j - (next_n - q_b)`` of request ``b``, 0 before it (None without
        ``next_n``); ``cu[b + 1] = cu[b] + seq_len_b // R`` (owned), ``cu[0] = 0``;
        ``ks[t] = cu[b]``, ``ke[t] = cu[b] + lens[t]``. Padded tokens: ``lens = ks = ke = 0``.
    """
    a = check_indexer_lengths_args(query_start_loc, seq_lens, compress_ratio, next_n, num_decodes,
                                   cp_world_size, cp_rank, cp_interleave, num_tokens, out,
                                   out_decode, out_ks, out_ke, out_cu, validate)
    if not use_triton(query_start_loc.device, backend):
        from dsv4_index.reference.indexer_lengths import compute
        return compute(query_start_loc, seq_lens, compress_ratio, cp_world_size, cp_rank,
                       cp_interleave, a)
    o = a.outs
    block_t, block_b = 128, 64
    dec_rows = o.decode_lens.shape[0] if o.decode_lens is not None else 0
    nn = a.next_n or 1
    n_tok, n_dec = cdiv(a.rows, block_t), cdiv(dec_rows * nn, block_t)
    n_cu = cdiv(a.num_reqs + 1, block_t)
    _indexer_lengths_kernel[(n_tok + n_dec + n_cu,)](
        query_start_loc, seq_lens, o.lens, o.ks, o.ke,
        o.decode_lens if o.decode_lens is not None else o.cu, o.cu,
        a.rows, a.num_reqs, num_search_iters(a.num_reqs), cdiv(a.num_reqs, block_b),
        compress_ratio, cp_world_size, cp_rank, cp_interleave,
        nn, a.num_decodes, dec_rows, n_tok, n_dec,
        BLOCK_T=block_t, BLOCK_B=block_b, num_warps=4)
    return o
