"""``window_indices``: the sliding-window slot list of every token (FlashMLA-style, ``-1`` padded).

Checks and dispatch live here; the Triton kernel in :mod:`.kernel`, the PyTorch reference in
:mod:`.naive` (they never import each other).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import INT32_MAX, check_batch, check_cp, check_int, needs_value_checks, prepare_out, use_triton
from .._args import (check_block_table, check_per_request, check_ring, check_ring_span,
                     check_slots_fit_int32, check_table_width, check_values, prepare_rows,
                     ring_cols, ring_columns_used, table_rows)
from . import kernel, naive

__all__ = ["window_indices"]


def window_indices(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   block_size: int, window: int, *, replay_start: Optional[torch.Tensor] = None,
                   cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                   ring: bool = False, circular_capacity: Optional[int] = None,
                   idx_mapping: Optional[torch.Tensor] = None, num_tokens: Optional[int] = None,
                   out: Optional[torch.Tensor] = None, out_lens: Optional[torch.Tensor] = None,
                   validate: bool = False, backend: Optional[str] = None):
    """Sliding-window slot list of every token (oldest first, the token itself last, ``-1`` padded).

    Parameters
    ----------
    query_start_loc : int32 ``[B + 1]``
    seq_lens : int32 ``[B]``
    block_table : int32 ``[rows, cols]``
        Block ids of the sliding group; request ``b`` reads row ``idx_mapping[b]`` (or row ``b``).
    block_size : int
    window : int
        ``W``: positions ``[max(pos - W + 1, floor), pos]``.
    replay_start : int32 ``[B]``, optional
        Per-request ``floor`` of bounded replay (default 0); must be ``<=`` every scheduled position.
    cp_world_size, cp_rank, cp_interleave : int
        DCP: only the owned positions of the window, ascending, local slots, packed to the front.
    ring : bool
        The table's columns form a ring: logical block ``i`` is in column ``i % cols`` (docs/DESIGN.md §4
        "Sliding tables as rings"). The ring must hold every position the request's tokens read
        in this step (value check).
    circular_capacity : int, optional
        Circular group (vLLM's ring, docs/DESIGN.md §4 "circular group"): a ring of ``capacity`` rows per
        request in ``capacity // block_size`` blocks (as in :func:`slot_mapping`; no DCP). Reads split
        at the request's chunk start ``s`` (its first scheduled position): an entry at position
        ``p < s`` is the ring slot of ``p`` (``>= 0``; ``-1`` in a negative block id: no block); an
        entry at ``p >= s`` is read from the step's own token row ``r = query_start + (p - s)`` and
        encoded ``-2 - r`` (``<= -2``; decode with ``-2 - x``); ``-1`` stays padding. Any chunk length
        is accepted; the ring part of a request's reads (positions ``max(s - W + 1, floor) .. s - 1``)
        must fit the capacity (value check).
    idx_mapping : int32 ``[B]``, optional
        Table row of each request (tables indexed by request slot, e.g. the pipeline's).
    num_tokens : int, optional
        Host token count; None reads ``qsl[-1]`` (a host sync on CUDA) when ``out`` is None.
    out : int32 ``[T_out, >= window]``, optional
        Row width is ``out.shape[1]``; written in full (``T_out = out.shape[0] >= num_tokens``).
    out_lens : int32 ``[>= T_out]``, optional
        Entries past ``T_out`` are set to 0.
    validate : bool
        Run the value checks on CUDA inputs too (they always run on CPU inputs): tables wide enough
        (or rings large enough), ``replay_start`` in range, ``idx_mapping`` rows inside the table,
        and every listed slot inside int32 (index lists are int32).
    backend : {None, "triton", "reference"}

    Returns
    -------
    (int32 ``[T_out, width]`` slots ``bt[col(lp // block_size)] * block_size + lp % block_size`` of the
    listed local positions ``lp`` (in-step rows ``-2 - r`` for circular groups), then ``-1``; int32
    ``[T_out]`` count of listed entries, ``0`` for padded tokens). On unchecked inputs an entry whose
    block lies outside a plain table is ``-1`` and not counted.

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import window_indices
    >>> qsl = torch.tensor([0, 1, 4], dtype=torch.int32)    # request 0: 1 token, request 1: 3 tokens
    >>> seq = torch.tensor([10, 3], dtype=torch.int32)      # positions 9 and 0, 1, 2
    >>> bt = torch.tensor([[4, 9, 2], [7, 0, 0]], dtype=torch.int32)   # block ids per request
    >>> idx, lens = window_indices(qsl, seq, bt, 4, 4, num_tokens=5)   # block_size 4, window 4
    >>> idx[0].tolist(), idx[3].tolist()                # positions 6..9 of request 0; 0..2 of request 1
    ([38, 39, 8, 9], [28, 29, 30, -1])
    >>> lens.tolist()
    [4, 1, 2, 3, 0]
    """
    B, device = check_batch(query_start_loc, seq_lens)
    check_block_table(block_table, device)
    check_int("block_size", block_size, lo=1)
    check_int("window", window, lo=1)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    check_ring(ring, circular_capacity, block_size, cp_world_size)
    idx_mapping = check_per_request("idx_mapping", idx_mapping, B, device)
    replay_start = check_per_request("replay_start", replay_start, B, device)
    out = prepare_rows("out", out, query_start_loc, num_tokens, torch.int32, cols=window)
    T_out = out.shape[0]
    out_lens = prepare_out("out_lens", out_lens, shape=(T_out,), min_rows=T_out, dtype=torch.int32,
                           device=device)
    ring_width = ring_cols(block_table, ring, circular_capacity, block_size)
    if ring_width and block_table.shape[1] == 0:
        raise ValueError("block_table needs at least one column for a ring / circular table")
    check = needs_value_checks(device, validate)
    rows = table_rows(block_table, idx_mapping, B, check)
    if check:
        check_values(query_start_loc, seq_lens, num_tokens, T_out)
        _check_window_values(query_start_loc, seq_lens, block_table, block_size, window, rows,
                             ring_width, circular_capacity is not None, replay_start, cp_world_size,
                             cp_rank, cp_interleave)
    table_width = INT32_MAX if ring_width else block_table.shape[1]
    if use_triton(device, backend):
        return kernel.launch(query_start_loc, seq_lens, block_table, idx_mapping, replay_start,
                             block_size, window, table_width, ring_width, cp_world_size, cp_rank,
                             cp_interleave, out, out_lens, circular=circular_capacity is not None)
    idx, lens = naive.window_indices(query_start_loc, seq_lens, block_table, block_size, window, rows,
                                     ring_width, replay_start, cp_world_size, cp_rank, cp_interleave,
                                     T_out, out.shape[1], circular=circular_capacity is not None)
    out.copy_(idx)
    out_lens[:T_out].copy_(lens)
    out_lens[T_out:] = 0
    return out, out_lens


def _check_window_values(query_start_loc, seq_lens, block_table, block_size, window, rows, ring_width,
                         circular, replay_start, cp_world_size, cp_rank, cp_interleave) -> None:
    """Value checks that read the batch: replay floor, table width / ring span, int32 slots."""
    qsl = query_start_loc.detach().cpu().long()
    sl = seq_lens.detach().cpu().long()
    B = sl.numel()
    if replay_start is not None:
        rs = replay_start.detach().cpu().long()[:B]
        q = qsl[1:] - qsl[:-1]
        first_pos = sl - q
        bad = (rs < 0) | ((q > 0) & (rs > first_pos))
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise ValueError(f"replay_start[{b}] = {int(rs[b])} must be in [0, {int(first_pos[b])}] "
                             f"(the first scheduled position of request {b})")
        replay_start = rs
    req, first, count = naive.window_range(qsl, sl, int(qsl[-1]), window, replay_start,
                                           cp_world_size, cp_rank, cp_interleave)
    need = count > 0
    last = first + count - 1
    if circular:
        # NOTE: only the entries before the chunk start are read from the ring (the rest from the step)
        q = qsl[1:] - qsl[:-1]
        last = torch.minimum(last, (sl - q)[req] - 1)
        need &= last >= first
    # NOTE: the positions a request's tokens read in one step form one range of local positions
    # (consecutive tokens' windows overlap or touch): [lo, hi] per request
    lo = torch.full((B,), INT32_MAX, dtype=torch.long).scatter_reduce_(0, req[need], first[need], "amin")
    hi = torch.full((B,), -1, dtype=torch.long).scatter_reduce_(0, req[need], last[need], "amax")
    used = hi >= 0
    if ring_width:
        check_ring_span("block_table", ring_width, block_size, lo, hi, used, torch.arange(B),
                        circular=circular)
    else:
        check_table_width("block_table", block_table.shape[1], req, last // block_size, need)
    blk_lo, blk_hi = torch.where(used, lo // block_size, 0), torch.where(used, hi // block_size, -1)
    cols = ring_columns_used(block_table.shape[1], ring_width, blk_lo, blk_hi, used)
    check_slots_fit_int32("block_table", block_table, rows.cpu(), cols, block_size)
