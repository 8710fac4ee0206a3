"""Functional ops (docs/DESIGN.md §6): one folder per op (``__init__`` checks and dispatches, ``kernel.py``
Triton, ``naive.py`` PyTorch reference); every index formula is one device function in
:mod:`._device`, shared with the fused step kernel."""

from .candidate_blocks_to_physical import candidate_blocks_to_physical
from .candidate_topk_to_slots import candidate_topk_to_slots
from .causal_compressed_indices import causal_compressed_indices
from .compressed_slot_mapping import compressed_slot_mapping
from .indexer_lengths import IndexerLengths, indexer_lengths
from .slot_mapping import slot_mapping
from .token_to_req import token_to_req
from .topk_to_slots import topk_to_slots
from .window_indices import window_indices

__all__ = ["token_to_req", "slot_mapping", "compressed_slot_mapping", "window_indices",
           "causal_compressed_indices", "topk_to_slots", "indexer_lengths", "IndexerLengths",
           "candidate_blocks_to_physical", "candidate_topk_to_slots"]
