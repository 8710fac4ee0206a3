"""Reference of ``slot_mapping`` (DESIGN §4 "Slot of a raw position", hybrid blocks, DCP, circular)."""

from __future__ import annotations

from typing import Optional

import torch

from .._common import (check_batch, check_cp, check_positive_int, cp_local,
                       cp_owner, needs_value_checks, table_slots, token_positions)
from .token_to_req import check_values, prepare_rows


def check_table_width(name: str, block_table: torch.Tensor, req: torch.Tensor, blk: torch.Tensor,
                      need: torch.Tensor) -> None:
    """ValueError when an entry that must be read (``need``) has its block outside the table."""
    bad = need & ((blk < 0) | (blk >= block_table.shape[1]))
    if bool(bad.any()):
        i = tuple(int(x[0]) for x in torch.nonzero(bad, as_tuple=True))
        raise ValueError(
            f"{name} has {block_table.shape[1]} columns, but request {int(req.expand(bad.shape)[i])} "
            f"needs block {int(blk.expand(bad.shape)[i])}")


def _local_positions(query_start_loc, seq_lens, num_rows, block_size, cp_world_size, cp_rank,
                     cp_interleave, circular_capacity):
    """(req, local position, needs-a-slot mask), each ``[num_rows]``."""
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_rows)
    need = valid & (pos >= 0)
    if circular_capacity is not None:
        return req, torch.where(need, pos % block_size, -1), need
    need = need & (cp_owner(pos, cp_world_size, cp_interleave) == cp_rank)
    return req, torch.where(need, cp_local(pos, cp_world_size, cp_interleave), -1), need


def _check_args(query_start_loc, seq_lens, block_table, block_size, blocks_per_kv_block,
                cp_world_size, cp_rank, cp_interleave, circular_capacity, num_tokens, out, validate):
    """Shared by the reference and the Triton wrapper; returns the output buffer int64 ``[T_out]``."""
    _, device = check_batch(query_start_loc, seq_lens, block_table)
    check_positive_int("block_size", block_size)
    check_positive_int("blocks_per_kv_block", blocks_per_kv_block)
    check_cp(cp_world_size, cp_rank, cp_interleave, alloc_block=block_size * blocks_per_kv_block)
    if circular_capacity is not None:
        check_positive_int("circular_capacity", circular_capacity)
        if circular_capacity != block_size:
            raise ValueError(f"circular_capacity={circular_capacity} must equal block_size={block_size}")
        if cp_world_size != 1:
            raise ValueError("circular_capacity needs cp_world_size == 1")
    out = prepare_rows("out", out, query_start_loc, num_tokens, torch.int64)
    if needs_value_checks(device, validate):
        check_values(query_start_loc, seq_lens, num_tokens, out.shape[0])
        T = int(query_start_loc[-1])
        req, lp, need = _local_positions(query_start_loc, seq_lens, T, block_size, cp_world_size,
                                         cp_rank, cp_interleave, circular_capacity)
        check_table_width("block_table", block_table, req, lp // block_size, need)
    return out


def _slot_mapping(query_start_loc, seq_lens, block_table, block_size, cp_world_size, cp_rank,
                  cp_interleave, circular_capacity, num_rows):
    req, lp, need = _local_positions(query_start_loc, seq_lens, num_rows, block_size,
                                     cp_world_size, cp_rank, cp_interleave, circular_capacity)
    return table_slots(block_table, req, lp, block_size, need)


def slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 block_size: int, *, blocks_per_kv_block: int = 1, cp_world_size: int = 1,
                 cp_rank: int = 0, cp_interleave: int = 1, circular_capacity: Optional[int] = None,
                 num_tokens: Optional[int] = None, out=None, validate: bool = False,
                 backend=None) -> torch.Tensor:
    """Reference of :func:`dsv4_index.slot_mapping`: same signature, arguments and result (the kernel must equal it).

    Plain PyTorch on any device; ``backend`` is accepted and ignored.
    """
    out = _check_args(query_start_loc, seq_lens, block_table, block_size, blocks_per_kv_block,
                      cp_world_size, cp_rank, cp_interleave, circular_capacity, num_tokens, out,
                      validate)
    out.copy_(_slot_mapping(query_start_loc, seq_lens, block_table, block_size, cp_world_size,
                            cp_rank, cp_interleave, circular_capacity, out.shape[0]))
    return out
