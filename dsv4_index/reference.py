"""Pure-PyTorch references of every functional op (docs/DESIGN.md §6), with the signatures of
:mod:`dsv4_index.ops`: each is the public op pinned to ``backend="reference"`` (its ``naive.py``),
with the same checks. They define what each index means (docs/DESIGN.md §4); the Triton kernels equal them
bit for bit. Usage: ``from dsv4_index import reference; reference.slot_mapping(...)``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ops
from .ops import IndexerLengths

__all__ = ["token_to_req", "slot_mapping", "compressed_slot_mapping", "window_indices",
           "causal_compressed_indices", "topk_to_slots", "indexer_lengths", "candidate_blocks_to_physical",
           "candidate_topk_to_slots"]

Tensor = torch.Tensor


def token_to_req(query_start_loc: Tensor, num_tokens: Optional[int], *, out: Optional[Tensor] = None,
                 validate: bool = False, backend: Optional[str] = None) -> Tensor:
    """Pure-PyTorch :func:`dsv4_index.token_to_req`; backend is ignored."""
    return ops.token_to_req(query_start_loc, num_tokens, out=out, validate=validate, backend="reference")


def slot_mapping(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, block_size: int, *,
                 blocks_per_kv_block: int = 1, cp_world_size: int = 1, cp_rank: int = 0,
                 cp_interleave: int = 1, circular_capacity: Optional[int] = None, ring: bool = False,
                 idx_mapping: Optional[Tensor] = None, replay_end: Optional[Tensor] = None,
                 num_tokens: Optional[int] = None, out: Optional[Tensor] = None, validate: bool = False,
                 backend: Optional[str] = None, tail: bool = False) -> Tensor:
    """Pure-PyTorch :func:`dsv4_index.slot_mapping`; backend is ignored."""
    return ops.slot_mapping(query_start_loc, seq_lens, block_table, block_size,
                            blocks_per_kv_block=blocks_per_kv_block, cp_world_size=cp_world_size,
                            cp_rank=cp_rank, cp_interleave=cp_interleave,
                            circular_capacity=circular_capacity, ring=ring, idx_mapping=idx_mapping,
                            replay_end=replay_end, num_tokens=num_tokens, out=out, validate=validate,
                            backend="reference", tail=tail)


def compressed_slot_mapping(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
                            rows_per_block: int, compress_ratio: int, *, cp_world_size: int = 1,
                            cp_rank: int = 0, cp_interleave: int = 1, compact: bool = False,
                            idx_mapping: Optional[Tensor] = None, replay_end: Optional[Tensor] = None,
                            num_tokens: Optional[int] = None, out: Optional[Tensor] = None,
                            out_cu: Optional[Tensor] = None, validate: bool = False,
                            backend: Optional[str] = None):
    """Pure-PyTorch :func:`dsv4_index.compressed_slot_mapping`; backend is ignored."""
    return ops.compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block,
                                       compress_ratio, cp_world_size=cp_world_size, cp_rank=cp_rank,
                                       cp_interleave=cp_interleave, compact=compact,
                                       idx_mapping=idx_mapping, replay_end=replay_end,
                                       num_tokens=num_tokens, out=out, out_cu=out_cu, validate=validate,
                                       backend="reference")


def window_indices(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, block_size: int,
                   window: int, *, replay_start: Optional[Tensor] = None, cp_world_size: int = 1,
                   cp_rank: int = 0, cp_interleave: int = 1, ring: bool = False,
                   circular_capacity: Optional[int] = None, idx_mapping: Optional[Tensor] = None,
                   num_tokens: Optional[int] = None, out: Optional[Tensor] = None,
                   out_lens: Optional[Tensor] = None, validate: bool = False,
                   backend: Optional[str] = None):
    """Pure-PyTorch :func:`dsv4_index.window_indices`; backend is ignored."""
    return ops.window_indices(query_start_loc, seq_lens, block_table, block_size, window,
                              replay_start=replay_start, cp_world_size=cp_world_size, cp_rank=cp_rank,
                              cp_interleave=cp_interleave, ring=ring,
                              circular_capacity=circular_capacity, idx_mapping=idx_mapping,
                              num_tokens=num_tokens, out=out, out_lens=out_lens, validate=validate,
                              backend="reference")


def causal_compressed_indices(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
                              rows_per_block: int, compress_ratio: int, width: int, *,
                              cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                              idx_mapping: Optional[Tensor] = None, num_tokens: Optional[int] = None,
                              out: Optional[Tensor] = None, out_lens: Optional[Tensor] = None,
                              validate: bool = False, backend: Optional[str] = None):
    """Pure-PyTorch :func:`dsv4_index.causal_compressed_indices`; backend is ignored."""
    return ops.causal_compressed_indices(query_start_loc, seq_lens, block_table, rows_per_block,
                                         compress_ratio, width, cp_world_size=cp_world_size,
                                         cp_rank=cp_rank, cp_interleave=cp_interleave,
                                         idx_mapping=idx_mapping, num_tokens=num_tokens, out=out,
                                         out_lens=out_lens, validate=validate, backend="reference")


def topk_to_slots(topk: Tensor, query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
                  rows_per_block: int, compress_ratio: int, *, cp_world_size: int = 1, cp_rank: int = 0,
                  cp_interleave: int = 1, compact: bool = False, idx_mapping: Optional[Tensor] = None,
                  num_tokens: Optional[int] = None, out: Optional[Tensor] = None,
                  out_lens: Optional[Tensor] = None, validate: bool = False,
                  backend: Optional[str] = None):
    """Pure-PyTorch :func:`dsv4_index.topk_to_slots`; backend is ignored."""
    return ops.topk_to_slots(topk, query_start_loc, seq_lens, block_table, rows_per_block,
                             compress_ratio, cp_world_size=cp_world_size, cp_rank=cp_rank,
                             cp_interleave=cp_interleave, compact=compact, idx_mapping=idx_mapping,
                             num_tokens=num_tokens, out=out, out_lens=out_lens, validate=validate,
                             backend="reference")


def indexer_lengths(query_start_loc: Tensor, seq_lens: Tensor, compress_ratio: int, *,
                    next_n: Optional[int] = None, num_decodes: Optional[int] = None,
                    cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                    num_tokens: Optional[int] = None, out: Optional[Tensor] = None,
                    out_decode: Optional[Tensor] = None, out_ks: Optional[Tensor] = None,
                    out_ke: Optional[Tensor] = None, out_cu: Optional[Tensor] = None,
                    validate: bool = False, backend: Optional[str] = None) -> IndexerLengths:
    """Pure-PyTorch :func:`dsv4_index.indexer_lengths`; backend is ignored."""
    return ops.indexer_lengths(query_start_loc, seq_lens, compress_ratio, next_n=next_n,
                               num_decodes=num_decodes, cp_world_size=cp_world_size, cp_rank=cp_rank,
                               cp_interleave=cp_interleave, num_tokens=num_tokens, out=out,
                               out_decode=out_decode, out_ks=out_ks, out_ke=out_ke, out_cu=out_cu,
                               validate=validate, backend="reference")


def candidate_blocks_to_physical(blocks: Tensor, query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
                                 rows_per_block: int, compress_ratio: int, candidate_block_size: int, *,
                                 idx_mapping: Optional[Tensor] = None, num_tokens: Optional[int] = None,
                                 out: Optional[Tensor] = None, out_counts: Optional[Tensor] = None,
                                 validate: bool = False, backend: Optional[str] = None):
    """Pure-PyTorch :func:`dsv4_index.candidate_blocks_to_physical`; backend is ignored."""
    return ops.candidate_blocks_to_physical(blocks, query_start_loc, seq_lens, block_table, rows_per_block,
                                            compress_ratio, candidate_block_size, idx_mapping=idx_mapping,
                                            num_tokens=num_tokens, out=out, out_counts=out_counts,
                                            validate=validate, backend="reference")


def candidate_topk_to_slots(blocks: Tensor, cols: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                            block_table: Tensor, rows_per_block: int, compress_ratio: int,
                            candidate_block_size: int, *, cp_world_size: int = 1, cp_rank: int = 0,
                            cp_interleave: int = 1, compact: bool = False, idx_mapping: Optional[Tensor] = None,
                            num_tokens: Optional[int] = None, out: Optional[Tensor] = None,
                            out_lens: Optional[Tensor] = None, validate: bool = False,
                            backend: Optional[str] = None):
    """Pure-PyTorch :func:`dsv4_index.candidate_topk_to_slots`; backend is ignored."""
    return ops.candidate_topk_to_slots(blocks, cols, query_start_loc, seq_lens, block_table, rows_per_block,
                                       compress_ratio, candidate_block_size, cp_world_size=cp_world_size,
                                       cp_rank=cp_rank, cp_interleave=cp_interleave, compact=compact,
                                       idx_mapping=idx_mapping, num_tokens=num_tokens, out=out,
                                       out_lens=out_lens, validate=validate, backend="reference")
