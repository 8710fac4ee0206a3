"""dsv4-index: DeepSeek-V4 attention metadata built on the GPU.

Functional layer (docs/DESIGN.md §6): ``token_to_req``, ``slot_mapping``, ``compressed_slot_mapping``,
``window_indices``, ``causal_compressed_indices``, ``topk_to_slots``, ``indexer_lengths`` and V4.1's
``candidate_blocks_to_physical``, ``candidate_topk_to_slots``; each runs
its Triton kernel on CUDA tensors (or under ``TRITON_INTERPRET=1``) and its pure-PyTorch reference
(:mod:`dsv4_index.reference`) otherwise.

Object layer: :class:`DSV4Layout`, :class:`BlockTable`, :class:`MultiGroupBlockTable`,
:class:`StepInput` / :class:`StepBatch`, :class:`MetadataPipeline`, :class:`DSV4Metadata`,
``register_channel``.
"""

from . import reference
from .batch import StepBatch
from .block_table import BlockTable, MultiGroupBlockTable
from .channels import ChannelBuilder, ChannelMetadata, register_channel
from .geometry import ChannelSpec, DSV4Layout, GroupSpec
from .metadata import DSV4Metadata, StepStats
from .ops import (IndexerLengths, candidate_blocks_to_physical, candidate_topk_to_slots,
                  causal_compressed_indices, compressed_slot_mapping, indexer_lengths,
                  slot_mapping, token_to_req, topk_to_slots, window_indices)
from .frontend import NewRequest, RunningRequest, StepInput, batch_from_scheduler_output, batch_from_step
from .pipeline import MetadataPipeline
from .state.requests import SlotMap

__version__ = "0.2.0"

__all__ = ["token_to_req", "slot_mapping", "compressed_slot_mapping", "window_indices",
           "causal_compressed_indices", "topk_to_slots", "indexer_lengths", "IndexerLengths", "reference",
           "candidate_blocks_to_physical", "candidate_topk_to_slots",
           "GroupSpec", "ChannelSpec", "DSV4Layout", "NewRequest", "RunningRequest", "StepInput", "StepBatch",
           "SlotMap", "batch_from_step", "batch_from_scheduler_output", "BlockTable", "MultiGroupBlockTable",
           "ChannelBuilder", "ChannelMetadata", "register_channel", "MetadataPipeline", "DSV4Metadata",
           "StepStats"]
