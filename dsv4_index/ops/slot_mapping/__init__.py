"""``slot_mapping``: the physical cache slot every scheduled token writes, for one kv-cache group.

Checks and dispatch live here; the Triton kernel in :mod:`.kernel`, the PyTorch reference in
:mod:`.naive` (they never import each other).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._common import INT32_MAX, check_batch, check_cp, check_int, needs_value_checks, use_triton
from .._args import (check_block_table, check_per_request, check_ring, check_ring_span, check_table_width, check_values,
                     check_write_plan, prepare_rows, ring_cols, table_rows)
from . import kernel, naive

__all__ = ["slot_mapping"]


def slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 block_size: int, *, blocks_per_kv_block: int = 1, cp_world_size: int = 1,
                 cp_rank: int = 0, cp_interleave: int = 1, circular_capacity: Optional[int] = None,
                 ring: bool = False, idx_mapping: Optional[torch.Tensor] = None,
                 replay_end: Optional[torch.Tensor] = None, num_tokens: Optional[int] = None,
                 out: Optional[torch.Tensor] = None, validate: bool = False,
                 backend: Optional[str] = None, tail: bool = False) -> torch.Tensor:
    """Physical cache slot of every scheduled token of one kv-cache group.

    Parameters
    ----------
    query_start_loc : int32 ``[B + 1]``
    seq_lens : int32 ``[B]``
    block_table : int32 ``[rows, cols]``
        Block ids of the group (kernel-block ids with hybrid blocks); request ``b`` reads row
        ``idx_mapping[b]`` (or row ``b``).
    block_size : int
        Tokens per (kernel) block; with ``blocks_per_kv_block = f`` the allocation block is
        ``block_size * f`` and ``cp_interleave`` must divide it.
    cp_world_size, cp_rank, cp_interleave : int
        DCP: tokens owned by other ranks get ``-1``; owned ones use their local position.
    circular_capacity : int, optional
        Circular group (vLLM's ring, docs/DESIGN.md §4 "circular group"): a ring of ``capacity`` rows per
        request in ``k = capacity // block_size`` blocks (``block_size`` must divide it; ``k = 1`` in
        the pipeline's layouts; no DCP): row ``p = pos % capacity`` lives at
        ``bt[p // block_size] * block_size + p % block_size`` for every token — the *address map*; a
        chunk may be longer than the capacity, two of its tokens then share a slot. A negative block id
        is no block (``-1``). With ``validate=True`` (on every device) the write plan of the step must be
        free of collisions between requests (two requests sharing a ring block).
    ring : bool
        The table's columns form a ring: logical block ``i`` is in column ``i % cols`` (docs/DESIGN.md §4
        "Sliding tables as rings"); no logical width limit.
    idx_mapping : int32 ``[B]``, optional
        Table row of each request (tables indexed by request slot, e.g. the pipeline's).
    replay_end : int32 ``[B]``, optional
        Bounded replay of a prefix-cacheable (full) group: tokens at ``pos < replay_end[b]`` write
        nothing (``-1``); their KV is already cached in blocks shared with other requests.
    num_tokens : int, optional
        Host token count (output length when ``out`` is None); None reads ``qsl[-1]`` (a host
        sync on CUDA).
    out : int64 ``[T_out]``, optional
        Written in full (``T_out = out.shape[0]``): live tokens, then ``-1``.
    validate : bool
        Run the value checks on CUDA inputs too (they always run on CPU inputs).
    backend : {None, "triton", "reference"}
    tail : bool
        Circular groups only: return the *write plan* (``tail_slot_mapping``) instead of the address
        map: the same slot for the last ``capacity`` tokens of each request's chunk
        (``pos >= seq_len - capacity``), ``-1`` before them; distinct rows within a request.

    Returns
    -------
    int64 ``[T_out]``: ``bt[col(lp // block_size)] * block_size + lp % block_size``; ``-1`` for
    padded tokens, tokens owned by another rank, replayed tokens and blocks outside the table.

    Examples
    --------
    >>> import torch
    >>> from dsv4_index import slot_mapping
    >>> qsl = torch.tensor([0, 1, 4], dtype=torch.int32)    # request 0: 1 token, request 1: 3 tokens
    >>> seq = torch.tensor([10, 3], dtype=torch.int32)      # positions 9 and 0, 1, 2
    >>> bt = torch.tensor([[4, 9, 2], [7, 0, 0]], dtype=torch.int32)   # block ids per request
    >>> slot_mapping(qsl, seq, bt, 4, num_tokens=6).tolist()   # block_size 4: bt[b, pos // 4] * 4 + pos % 4
    [9, 28, 29, 30, -1, -1]
    """
    B, device = check_batch(query_start_loc, seq_lens)
    check_block_table(block_table, device)
    check_int("block_size", block_size, lo=1)
    check_int("blocks_per_kv_block", blocks_per_kv_block, lo=1)
    check_cp(cp_world_size, cp_rank, cp_interleave, alloc_block=block_size * blocks_per_kv_block)
    check_ring(ring, circular_capacity, block_size, cp_world_size)
    idx_mapping = check_per_request("idx_mapping", idx_mapping, B, device)
    replay_end = check_per_request("replay_end", replay_end, B, device)
    out = prepare_rows("out", out, query_start_loc, num_tokens, torch.int64)
    ring_width = ring_cols(block_table, ring, circular_capacity, block_size)
    if ring_width and block_table.shape[1] == 0:
        raise ValueError("block_table needs at least one column for a ring / circular table")
    if not isinstance(tail, bool):
        raise ValueError(f"tail must be a bool, got {tail!r}")
    if tail and circular_capacity is None:
        raise ValueError("tail=True (the write plan) needs circular_capacity")
    check = needs_value_checks(device, validate)
    rows = table_rows(block_table, idx_mapping, B, check)
    if check:
        check_values(query_start_loc, seq_lens, num_tokens, out.shape[0])
    if circular_capacity is not None and (validate or tail):
        # NOTE: the write plan: tokens before the request's last `capacity` write nothing
        plan_floor = naive.tail_floor(seq_lens[:B], circular_capacity, replay_end)
        if validate:
            T = int(query_start_loc[-1])
            plan = naive.slot_mapping(query_start_loc, seq_lens, block_table, block_size, rows, ring_width,
                                      plan_floor, 1, 0, 1, T)
            req = naive.local_positions(query_start_loc, seq_lens, T, None, 1, 0, 1)[0]
            check_write_plan("block_table", plan, req)
        if tail:
            replay_end = plan_floor
    if check and circular_capacity is None:
        T = int(query_start_loc[-1])
        req, pos, lp, need = naive.local_positions(query_start_loc, seq_lens, T, replay_end,
                                                   cp_world_size, cp_rank, cp_interleave)
        if ring_width:
            # NOTE: a ring holds a request's newest blocks: the step's writes must fit in it
            first = torch.full((B,), INT32_MAX, dtype=torch.long).scatter_reduce_(
                0, req[need].cpu(), lp[need].cpu(), "amin")
            check_ring_span("block_table", ring_width, block_size, first[req.cpu()], lp.cpu(),
                            need.cpu(), req.cpu())
        else:
            check_table_width("block_table", block_table.shape[1], req, lp // block_size, need)
    table_width = INT32_MAX if ring_width else block_table.shape[1]
    if use_triton(device, backend):
        return kernel.launch(query_start_loc, seq_lens, block_table, idx_mapping, replay_end, block_size,
                             table_width, ring_width, cp_world_size, cp_rank, cp_interleave, out)
    out.copy_(naive.slot_mapping(query_start_loc, seq_lens, block_table, block_size, rows, ring_width,
                                 replay_end, cp_world_size, cp_rank, cp_interleave, out.shape[0]))
    return out
