"""``compressed_slot_mapping``: the cache slot of the compressed row each token completes
(token-aligned or compact), for one compressed channel.

Checks and dispatch live here; the Triton kernel in :mod:`.kernel`, the PyTorch reference in
:mod:`.naive` (they never import each other).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import (check_batch, check_cp, check_int, needs_value_checks, prepare_out,
                        resolve_num_tokens, use_triton)
from .._args import (check_block_table, check_per_request, check_table_width, check_values,
                     prepare_rows, table_rows)
from . import kernel, naive

__all__ = ["compressed_slot_mapping"]


def compressed_slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, rows_per_block: int, compress_ratio: int, *,
                            cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                            compact: bool = False, idx_mapping: Optional[torch.Tensor] = None,
                            replay_end: Optional[torch.Tensor] = None,
                            num_tokens: Optional[int] = None, out: Optional[torch.Tensor] = None,
                            out_cu: Optional[torch.Tensor] = None, validate: bool = False,
                            backend: Optional[str] = None):
    """Cache slot of the compressed row each token completes.

    Parameters
    ----------
    query_start_loc : int32 ``[B + 1]``
    seq_lens : int32 ``[B]``
    block_table : int32 ``[rows, cols]``
        Block ids of the channel's group; request ``b`` reads row ``idx_mapping[b]`` (or row ``b``).
    rows_per_block : int
        ``S = block_size // R`` compressed rows per block.
    compress_ratio : int
        ``R``: the token at ``pos`` completes row ``c = pos // R`` iff ``(pos + 1) % R == 0``.
    cp_world_size, cp_rank, cp_interleave : int
        DCP over compressed rows: rows owned by another rank get ``-1``; owned rows use their local
        row ``lc``.
    compact : bool
        List only the rows completed this step, request by request in position order, with
        offsets ``cu``.
    idx_mapping : int32 ``[B]``, optional
        Table row of each request (tables indexed by request slot, e.g. the pipeline's).
    replay_end : int32 ``[B]``, optional
        Bounded replay (docs/DESIGN.md §4): tokens at ``pos < replay_end[b]`` write nothing (``-1``); their
        rows are cached in blocks shared with other requests. In the compact form such rows are
        still listed (as ``-1``), like rows owned by another rank, so ``cu`` depends on neither.
    num_tokens : int, optional
        Host token count; None reads ``qsl[-1]`` (a host sync on CUDA; always for ``compact``
        without it).
    out : int64, optional
        Token-aligned: ``[T_out]`` (``T_out = out.shape[0] >= num_tokens``), written in full.
        Compact: ``[>= num_tokens // R + B]``, ``-1`` past the last row.
    out_cu : int32 ``[>= B + 1]``, optional (compact only)
        Offsets; entries past ``B`` repeat the total.
    validate : bool
        Run the value checks on CUDA inputs too (they always run on CPU inputs).
    backend : {None, "triton", "reference"}

    Returns
    -------
    int64 ``[T_out]``: ``bt[lc // S] * S + lc % S`` for completing tokens, ``-1`` elsewhere (padded
    tokens, rows owned by another rank, replayed tokens); or with ``compact=True`` the tuple
    (int64 ``[T // R + B]`` or ``[len(out)]``, int32 cu ``[B + 1]`` or ``[len(out_cu)]``).

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import compressed_slot_mapping
    >>> qsl = torch.tensor([0, 1, 4], dtype=torch.int32)    # request 0: 1 token, request 1: 3 tokens
    >>> seq = torch.tensor([10, 3], dtype=torch.int32)      # positions 9 and 0, 1, 2
    >>> bt = torch.tensor([[4, 9, 2], [7, 0, 0]], dtype=torch.int32)   # block ids per request
    >>> compressed_slot_mapping(qsl, seq, bt, 4, 2, num_tokens=5).tolist()   # S = 4 rows per block, R = 2
    [36, -1, 28, -1, -1]

    Position 9 completes row 4 (block ``bt[0, 1] = 9``: slot 36), position 1 row 0 of request 1.
    """
    B, device = check_batch(query_start_loc, seq_lens)
    check_block_table(block_table, device)
    check_int("rows_per_block", rows_per_block, lo=1)
    check_int("compress_ratio", compress_ratio, lo=1)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    idx_mapping = check_per_request("idx_mapping", idx_mapping, B, device)
    replay_end = check_per_request("replay_end", replay_end, B, device)
    if not compact:
        if out_cu is not None:
            raise ValueError("out_cu is only used with compact=True")
        out = prepare_rows("out", out, query_start_loc, num_tokens, torch.int64)
        T = out.shape[0]
    else:
        T = resolve_num_tokens(query_start_loc, num_tokens)
        cap = T // compress_ratio + B
        out = prepare_out("out", out, shape=(cap,), min_rows=cap if num_tokens is not None else 0,
                          dtype=torch.int64, device=device)
        out_cu = prepare_out("out_cu", out_cu, shape=(B + 1,), min_rows=B + 1, dtype=torch.int32,
                             device=device)
    check = needs_value_checks(device, validate)
    rows = table_rows(block_table, idx_mapping, B, check)
    if check:
        check_values(query_start_loc, seq_lens, num_tokens, T)
        if compact:
            _, n = naive.completed_rows(query_start_loc, seq_lens, compress_ratio)
            if int(n.sum()) > out.shape[0]:
                raise ValueError(f"out has {out.shape[0]} rows, the step completes {int(n.sum())}")
        req, _, _, lc, need = naive.completing_tokens(query_start_loc, seq_lens, int(query_start_loc[-1]),
                                                      compress_ratio, replay_end, cp_world_size,
                                                      cp_rank, cp_interleave)
        check_table_width("block_table", block_table.shape[1], req, lc // rows_per_block, need)
    if use_triton(device, backend):
        return kernel.launch(query_start_loc, seq_lens, block_table, idx_mapping, replay_end,
                             rows_per_block, compress_ratio, cp_world_size, cp_rank, cp_interleave,
                             T, out, out_cu)
    if not compact:
        out.copy_(naive.compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block,
                                                compress_ratio, rows, replay_end, cp_world_size,
                                                cp_rank, cp_interleave, T))
        return out
    assert out_cu is not None  # NOTE: compact: prepare_out gave it above
    listed, cu = naive.compact(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                               rows, replay_end, cp_world_size, cp_rank, cp_interleave, T,
                               out.shape[0], out_cu.shape[0])
    out.copy_(listed)
    out_cu.copy_(cu)
    return out, out_cu
