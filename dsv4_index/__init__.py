"""dsv4-index: DeepSeek-V4 attention metadata built on the GPU.

Functional layer (DESIGN §6): ``token_to_req``, ``slot_mapping``, ``compressed_slot_mapping``,
``window_indices``, ``causal_compressed_indices``, ``topk_to_slots``, ``indexer_lengths``; each runs
its Triton kernel on CUDA tensors (or under ``TRITON_INTERPRET=1``) and its pure-PyTorch reference
(:mod:`dsv4_index.reference`) otherwise.

Object layer: :class:`DSV4Layout`, :class:`BlockTable`, :class:`MultiGroupBlockTable`,
:class:`StepInput`, :class:`MetadataPipeline`, :class:`DSV4Metadata`, ``register_channel``.
"""

import importlib

from .ops import (IndexerLengths, causal_compressed_indices, compressed_slot_mapping, indexer_lengths,
                  slot_mapping, token_to_req, topk_to_slots, window_indices)
from . import reference  # noqa: E402  (after .ops: reference.py pins the ops to backend="reference")

__version__ = "0.1.0"

_OPS = ["token_to_req", "slot_mapping", "compressed_slot_mapping", "window_indices",
        "causal_compressed_indices", "topk_to_slots", "indexer_lengths", "IndexerLengths"]

_LAZY = {
    # object layer
    "GroupSpec": "dsv4_index.geometry",
    "ChannelSpec": "dsv4_index.geometry",
    "DSV4Layout": "dsv4_index.geometry",
    "NewRequest": "dsv4_index.step",
    "RunningRequest": "dsv4_index.step",
    "StepInput": "dsv4_index.step",
    "BlockTable": "dsv4_index.block_table",
    "MultiGroupBlockTable": "dsv4_index.block_table",
    "ChannelBuilder": "dsv4_index.channels",
    "ChannelMetadata": "dsv4_index.channels",
    "register_channel": "dsv4_index.channels",
    "MetadataPipeline": "dsv4_index.pipeline",
    "DSV4Metadata": "dsv4_index.pipeline",
}

__all__ = sorted(_OPS + list(_LAZY)) + ["reference"]


def __getattr__(name):
    if name in _LAZY:
        obj = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = obj
        return obj
    raise AttributeError(f"module 'dsv4_index' has no attribute {name!r}")


def __dir__():
    return __all__
