"""``indexer_lengths``: Lightning-Indexer lengths (``c4i``): visible compressed rows per token, the
decode view, ``ks`` / ``ke`` and ``cu``.

Checks and dispatch live here; the Triton kernel in :mod:`.kernel`, the PyTorch reference in
:mod:`.naive` (they never import each other).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..._common import (check_batch, check_cp, check_int, cp_owned_count, needs_value_checks,
                        prepare_out, use_triton)
from .._args import check_int32_total, check_values, resolve_rows, token_out
from . import kernel, naive

__all__ = ["indexer_lengths", "IndexerLengths"]


class IndexerLengths(NamedTuple):
    """Outputs of :func:`indexer_lengths`, all int32."""
    lens: torch.Tensor                    # [T_out]
    decode_lens: Optional[torch.Tensor]   # [>= num_decodes, next_n] or None
    ks: torch.Tensor                      # [T_out]
    ke: torch.Tensor                      # [T_out]
    cu: torch.Tensor                      # [B + 1]


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
        Build the decode view ``[num_decodes, next_n]`` of the first ``num_decodes`` requests (the
        decode rows of a decode-first batch, a host count; each must have ``q_len <= next_n``).
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
        = lens of token ``j - (next_n - q_b)`` of request ``b``, 0 before it (right-aligned; None
        without ``next_n``); ``cu[b + 1] = cu[b] + seq_len_b // R`` (owned), ``cu[0] = 0``;
        ``ks[t] = cu[b]``, ``ke[t] = cu[b] + lens[t]``. Padded tokens: ``lens = ks = ke = 0``.

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import indexer_lengths
    >>> qsl = torch.tensor([0, 1, 4], dtype=torch.int32)    # request 0: 1 token, request 1: 3 tokens
    >>> seq = torch.tensor([10, 3], dtype=torch.int32)      # positions 9 and 0, 1, 2
    >>> bt = torch.tensor([[4, 9, 2], [7, 0, 0]], dtype=torch.int32)   # block ids per request
    >>> r = indexer_lengths(qsl, seq, 2, next_n=1, num_decodes=1, num_tokens=5)   # R 2; 1 decode request
    >>> r.lens.tolist(), r.ks.tolist(), r.ke.tolist(), r.cu.tolist(), r.decode_lens.tolist()
    ([5, 0, 1, 1, 0], [0, 5, 5, 5, 0], [5, 5, 6, 6, 0], [0, 5, 6], [[5]])
    """
    B, device = check_batch(query_start_loc, seq_lens)
    check_int("compress_ratio", compress_ratio, lo=1)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    if (next_n is None) != (num_decodes is None):
        raise ValueError("next_n and num_decodes must be given together "
                         f"(got next_n={next_n!r}, num_decodes={num_decodes!r})")
    decodes = num_decodes or 0
    if next_n is None and out_decode is not None:
        raise ValueError("out_decode needs next_n and num_decodes")
    if next_n is not None:
        check_int("next_n", next_n, lo=1)
        check_int("num_decodes", num_decodes, lo=0)
        if num_decodes > B:
            raise ValueError(f"num_decodes = {num_decodes} exceeds the batch size B = {B}")
    T_out = resolve_rows(query_start_loc, num_tokens, {"out": out, "out_ks": out_ks, "out_ke": out_ke})
    lens, ks, ke = (token_out(name, buf, T_out, num_tokens, torch.int32, device)
                    for name, buf in (("out", out), ("out_ks", out_ks), ("out_ke", out_ke)))
    cu = prepare_out("out_cu", out_cu, shape=(B + 1,), min_rows=B + 1, dtype=torch.int32, device=device)
    if cu.shape[0] != B + 1:
        raise ValueError(f"out_cu has {cu.shape[0]} entries, expected B + 1 = {B + 1}")
    dec = None
    if next_n is not None:
        dec = prepare_out("out_decode", out_decode, shape=(decodes, next_n), min_rows=decodes,
                          dtype=torch.int32, device=device, exact_cols=True)
    if needs_value_checks(device, validate):
        check_values(query_start_loc, seq_lens, num_tokens, T_out)
        if next_n is not None:
            qsl = query_start_loc.detach().cpu().long()
            q = qsl[1:decodes + 1] - qsl[:decodes]
            bad = torch.nonzero(q > next_n)
            if bad.numel():
                b = int(bad[0])
                raise ValueError(f"next_n = {next_n} is below the query length {int(q[b])} of "
                                 f"decode request {b} (query_start_loc)")
        n = cp_owned_count(seq_lens.detach().cpu().long().clamp(min=0) // compress_ratio,
                           cp_world_size, cp_rank, cp_interleave)
        check_int32_total("seq_lens", int(n.sum()), "the compressed-row total of the batch (cu)")
    outs = IndexerLengths(lens, dec, ks, ke, cu)
    if use_triton(device, backend):
        kernel.launch(query_start_loc, seq_lens, compress_ratio, cp_world_size, cp_rank, cp_interleave,
                      next_n, decodes, lens, dec, ks, ke, cu)
        return outs
    res = naive.indexer_lengths(query_start_loc, seq_lens, compress_ratio, cp_world_size, cp_rank,
                                cp_interleave, T_out, next_n, decodes,
                                dec.shape[0] if dec is not None else 0)
    for buf, val in zip(outs, res):
        if buf is not None:
            buf.copy_(val)
    return outs
