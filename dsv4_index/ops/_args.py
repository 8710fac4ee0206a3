"""Host-side argument handling shared by the functional ops: ``out=`` buffers, batch value checks,
table-width, ring-span and int32 checks, the optional ``idx_mapping``, ring tables.

Shape / dtype / device checks always run; checks that read device values run on CPU inputs or with
``validate=True`` (:func:`dsv4_index._common.needs_value_checks`). Every failure is a ``ValueError``
naming the argument.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from .._common import (INT32_MAX, INT32_MIN, check_batch_values, check_int, check_tensor, cp_owned_count,
                       prepare_out, resolve_num_tokens, token_positions)


# out= buffers
def resolve_rows(query_start_loc: torch.Tensor, num_tokens: Optional[int],
                 outs: Mapping[str, Optional[torch.Tensor]]) -> int:
    """Rows ``T_out`` of an op's per-token outputs (the one resolver of every op).

    The rows of the given ``out=`` buffers (all given ones must agree), else ``num_tokens``, else
    ``query_start_loc[-1]`` read back (a host sync on CUDA).
    """
    rows = first = None
    for name, buf in outs.items():
        if buf is None:
            continue
        if not isinstance(buf, torch.Tensor) or buf.dim() < 1:
            raise ValueError(f"{name} must be a torch.Tensor with at least one dimension")
        if rows is None:
            rows, first = buf.shape[0], name
        elif buf.shape[0] != rows:
            raise ValueError(f"{name} has {buf.shape[0]} rows but {first} has {rows}; they must agree")
    if rows is not None:
        if num_tokens is not None:
            resolve_num_tokens(query_start_loc, num_tokens)  # NOTE: type / sign check only
        return rows
    return resolve_num_tokens(query_start_loc, num_tokens)


def token_out(name: str, out, rows: int, num_tokens: Optional[int], dtype: torch.dtype,
              device: torch.device, cols: Optional[int] = None, exact_cols: bool = False) -> torch.Tensor:
    """Checked per-token ``out=`` buffer of ``rows`` rows (at least ``num_tokens``), or a new one."""
    shape = (rows,) if cols is None else (rows, cols)
    return prepare_out(name, out, shape=shape, min_rows=num_tokens or 0, dtype=dtype, device=device,
                       exact_cols=exact_cols)


def prepare_rows(name: str, out, query_start_loc: torch.Tensor, num_tokens: Optional[int],
                 dtype: torch.dtype, cols: Optional[int] = None) -> torch.Tensor:
    """Single-output form of :func:`resolve_rows` + :func:`token_out`: ``T_out`` is ``out.shape[0]``
    when ``out`` is given, else ``num_tokens`` (read from ``query_start_loc[-1]`` when None)."""
    rows = resolve_rows(query_start_loc, num_tokens, {name: out})
    return token_out(name, out, rows, num_tokens, dtype, query_start_loc.device, cols)


# batch and per-request arguments
def check_values(query_start_loc, seq_lens, num_tokens: Optional[int], rows: int) -> None:
    """Batch value checks, and that the live tokens fit the ``rows`` of the output."""
    check_batch_values(query_start_loc, seq_lens, num_tokens=num_tokens)
    live = int(query_start_loc[-1])
    if live > rows:
        raise ValueError(f"out has {rows} rows, but query_start_loc[-1] = {live} tokens are live")


def check_block_table(block_table, device: torch.device, name: str = "block_table") -> torch.Tensor:
    """int32 ``[rows, cols]`` table on ``device`` with unit column stride (rows checked by
    :func:`table_rows`)."""
    return check_tensor(name, block_table, dtypes=(torch.int32,), ndim=2, device=device)


def check_per_request(name: str, x, num_reqs: int, device: torch.device) -> Optional[torch.Tensor]:
    """Optional int32 ``[B]`` per-request array (``replay_start``, ``replay_end``, ``idx_mapping``)."""
    if x is None:
        return None
    check_tensor(name, x, dtypes=(torch.int32,), ndim=1, device=device)
    if x.numel() < num_reqs:
        raise ValueError(f"{name} has {x.numel()} entries, needs B = {num_reqs}")
    return x


def table_rows(block_table: torch.Tensor, idx_mapping: Optional[torch.Tensor], num_reqs: int,
               check: bool) -> torch.Tensor:
    """The table row of each request ``[B]`` (int64): ``idx_mapping[b]``, or ``b``.

    Without ``idx_mapping`` the table needs ``B`` rows (always checked). With it and ``check``
    (value checks), every row must lie in ``[0, block_table.shape[0])``.
    """
    if idx_mapping is None:
        if block_table.shape[0] < num_reqs:
            raise ValueError(f"block_table has {block_table.shape[0]} rows, needs at least B = {num_reqs}")
        return torch.arange(num_reqs, device=block_table.device)
    rows = idx_mapping[:num_reqs].long()
    if check and num_reqs:
        bad = (rows < 0) | (rows >= block_table.shape[0])
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise ValueError(f"idx_mapping[{b}] = {int(rows[b])} is not a row of block_table "
                             f"({block_table.shape[0]} rows)")
    return rows


# ring / circular tables
def check_ring(ring: bool, circular_capacity: Optional[int], block_size: int, cp_world_size: int):
    """Ring / circular table arguments (docs/DESIGN.md §4 "Sliding tables as rings")."""
    if circular_capacity is not None:
        check_int("circular_capacity", circular_capacity, lo=1)
        if circular_capacity % block_size:
            raise ValueError(f"circular_capacity={circular_capacity} must be a multiple of "
                             f"block_size={block_size} (a ring of capacity // block_size blocks)")
        if cp_world_size != 1:
            raise ValueError("circular_capacity needs cp_world_size == 1")
        if ring:
            raise ValueError("ring and circular_capacity are exclusive (a circular group is a ring of "
                             "capacity // block_size columns)")
    if not isinstance(ring, bool):
        raise ValueError(f"ring must be a bool, got {ring!r}")


def ring_cols(block_table: torch.Tensor, ring: bool, circular_capacity: Optional[int],
              block_size: int) -> int:
    """Columns of the ring (0: a plain table). A circular group is a ring of ``capacity // block_size``
    columns (one block of ``capacity`` rows in the pipeline's layouts; vLLM's Triton ring and
    vllm-ascend also use several blocks); its table needs at least that many columns."""
    if circular_capacity is not None:
        cols = circular_capacity // block_size
        if block_table.shape[1] < cols:
            raise ValueError(f"block_table has {block_table.shape[1]} columns, but a circular group of "
                             f"capacity {circular_capacity} in blocks of {block_size} needs {cols}")
        return cols
    return block_table.shape[1] if ring else 0


def check_ring_span(name: str, ring_width: int, block_size: int, first: torch.Tensor,
                    last: torch.Tensor, need: torch.Tensor, req: torch.Tensor,
                    circular: bool = False) -> None:
    """A ring holds the (local) positions ``first .. last`` of a request at once only if they span
    at most ``ring_width`` blocks (older blocks are overwritten by newer ones); a circular group
    (``ring_width`` blocks of ``block_size`` rows, ``capacity`` in all) holds at most ``capacity``
    consecutive positions.
    Tensors are per entry (``need`` marks the entries to check, ``req`` names their request)."""
    if circular:
        span, limit, unit = last - first + 1, block_size * ring_width, "positions"
    else:
        span, limit, unit = last // block_size - first // block_size + 1, ring_width, f"blocks of {block_size}"
    bad = need & (span > limit)
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0])
        what = (f"a circular group of capacity {block_size * ring_width}" if circular
                else f"a ring of {ring_width} columns")
        raise ValueError(f"{name} is {what}, but request {int(req[t])} needs positions "
                         f"{int(first[t])}..{int(last[t])} at once ({int(span[t])} {unit})")


def check_write_plan(name: str, plan: torch.Tensor, req: torch.Tensor) -> None:
    """A circular group's write plan (``tail_slot_mapping``, one slot or ``-1`` per token) must write
    each slot at most once: two requests of one step sharing a ring block collide (docs/DESIGN.md §4
    "circular group"). Checked under ``validate=True`` only, on every device."""
    live = plan >= 0
    if not bool(live.any()):
        return
    slots, order = torch.sort(plan[live], stable=True)
    dup = slots[1:] == slots[:-1]
    if bool(dup.any()):
        k = int(torch.nonzero(dup)[0])
        toks = torch.nonzero(live)[:, 0][order[k:k + 2]]
        a, b = sorted(int(req[t]) for t in toks)
        raise ValueError(f"{name}: requests {a} and {b} both write slot {int(slots[k])} of a circular "
                         f"group this step (they share a ring block)")


def ring_columns_used(width: int, ring_width: int, blk_lo: torch.Tensor, blk_hi: torch.Tensor,
                      any_: torch.Tensor) -> torch.Tensor:
    """bool ``[B, width]``: the columns holding logical blocks ``blk_lo .. blk_hi`` of each request
    (where ``any_``); a ring maps block ``i`` to column ``i % ring_width``."""
    col = torch.arange(width, device=blk_lo.device)[None, :]
    lo, hi = blk_lo[:, None], blk_hi[:, None]
    if ring_width:
        used = (col - lo) % ring_width <= hi - lo
    else:
        used = (col >= lo) & (col <= hi)
    return used & any_[:, None]


# table contents
def check_table_width(name: str, width: int, req: torch.Tensor, blk: torch.Tensor,
                      need: torch.Tensor) -> None:
    """ValueError when an entry that must be read (``need``) has its block outside ``[0, width)``."""
    bad = need & ((blk < 0) | (blk >= width))
    if bool(bad.any()):
        i = tuple(int(x[0]) for x in torch.nonzero(bad, as_tuple=True))
        raise ValueError(f"{name} has {width} columns, but request {int(req.expand(bad.shape)[i])} "
                         f"needs block {int(blk.expand(bad.shape)[i])}")


def check_slots_fit_int32(name: str, block_table: torch.Tensor, rows: torch.Tensor,
                          used_blocks: torch.Tensor, unit: int) -> None:
    """Value check for int32 index lists: every block a request reads (``used_blocks [B, cols]``
    bool over its table row ``rows[b]``) keeps its slots ``bt * unit .. bt * unit + unit - 1``
    inside int32 (slots are stored as int32; a wrapped value would be a silent wrong slot)."""
    if rows.numel() == 0 or block_table.shape[1] == 0:
        return
    bt = block_table.detach()[rows.to(block_table.device)].cpu().long()  # NOTE: the batch's rows only
    used = used_blocks.cpu()
    bad = used & ((bt * unit < INT32_MIN) | (bt * unit + (unit - 1) > INT32_MAX))
    if bool(bad.any()):
        b, k = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"{name}[{int(rows[b])}, {k}] = {int(bt[b, k])} gives slots outside int32 "
                         f"with {unit} slots per block (index lists are int32)")


def prefix_blocks_used(req: torch.Tensor, n_rows: torch.Tensor, need: torch.Tensor, num_reqs: int,
                       width: int, rows_per_block: int) -> torch.Tensor:
    """bool ``[B, width]``: the blocks holding local compressed rows ``0 .. n - 1`` of each request,
    ``n`` the largest ``n_rows`` of its tokens where ``need`` (per-token tensors, host)."""
    most = torch.zeros(num_reqs, dtype=torch.long)
    if num_reqs and bool(need.any()):
        most.scatter_reduce_(0, req[need].cpu(), n_rows[need].cpu().long(), "amax")
    blocks = (most + rows_per_block - 1) // rows_per_block
    return torch.arange(width)[None, :] < blocks[:, None]


def check_token_inputs(inputs: Mapping[str, torch.Tensor], num_tokens: Optional[int], rows: int,
                       outs: Mapping[str, object]) -> None:
    """Shape check of the per-token inputs of a top-k style op (``topk``; ``blocks`` / ``cols``): each has at
    least ``num_tokens`` rows, or ``rows`` (the output rows :func:`resolve_rows` gave) when neither
    ``num_tokens`` nor an ``out=`` buffer of ``outs`` is given."""
    live = num_tokens if num_tokens is not None else (rows if all(o is None for o in outs.values()) else None)
    for name, x in inputs.items():
        if live is not None and x.shape[0] < live:
            raise ValueError(f"{name} has {x.shape[0]} rows, needs at least num_tokens = {live}")


def check_compressed_reads(inputs: Mapping[str, torch.Tensor], query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, num_tokens: Optional[int], rows: int, block_table: torch.Tensor,
                           table_rows_: torch.Tensor, rows_per_block: int, compress_ratio: int,
                           cp: tuple = (1, 0, 1)) -> None:
    """Value checks of a top-k style op (run where :func:`dsv4_index._common.needs_value_checks` says): the
    batch values (:func:`check_values`), each per-token input covering ``query_start_loc[-1]`` rows, and the
    table blocks holding each request's visible compressed rows (``(pos + 1) // compress_ratio``, this rank's
    share under ``cp = (world, rank, interleave)``) keeping their slots inside int32."""
    check_values(query_start_loc, seq_lens, num_tokens, rows)
    n_live = int(query_start_loc[-1])
    for name, x in inputs.items():
        if x.shape[0] < n_live:
            raise ValueError(f"{name} has {x.shape[0]} rows, query_start_loc[-1] = {n_live}")
    # NOTE: the picks of a token reach local rows 0 .. owned(n_c) - 1 of its request
    req, pos, valid = token_positions(query_start_loc.cpu(), seq_lens.cpu(), n_live)
    n = cp_owned_count((pos + 1).clamp(min=0) // compress_ratio, *cp)
    used = prefix_blocks_used(req, n, valid, len(table_rows_), block_table.shape[1], rows_per_block)
    check_slots_fit_int32("block_table", block_table, table_rows_, used, rows_per_block)


def check_int32_total(name: str, total: int, what: str) -> None:
    """ValueError naming ``name`` when a host-summed count stored as int32 would overflow."""
    if total > INT32_MAX:
        raise ValueError(f"{name}: {what} ({total}) exceeds int32")


__all__ = ["resolve_rows", "token_out", "prepare_rows", "check_values", "check_block_table",
           "check_per_request", "table_rows", "check_ring", "ring_cols", "check_ring_span", "check_write_plan",
           "ring_columns_used", "check_table_width", "check_slots_fit_int32", "prefix_blocks_used",
           "check_token_inputs", "check_compressed_reads", "check_int32_total"]
