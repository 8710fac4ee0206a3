"""dsv4-index: DeepSeek-V4 attention metadata built on the GPU.

Functional layer (DESIGN §6): ``token_to_req``, ``slot_mapping``, ``compressed_slot_mapping``,
``window_indices``, ``causal_compressed_indices``, ``topk_to_slots``, ``indexer_lengths``; each runs
its Triton kernel on CUDA tensors (or under ``TRITON_INTERPRET=1``) and its pure-PyTorch reference
(:mod:`dsv4_index.reference`) otherwise.

Object layer: :class:`DSV4Layout`, :class:`BlockTable`, :class:`MultiGroupBlockTable`,
:class:`StepInput`, :class:`MetadataPipeline`, :class:`DSV4Metadata`, ``register_channel``.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    # functional ops: public wrappers live next to their kernels
    "token_to_req": "dsv4_index.kernels.token_to_req",
    "slot_mapping": "dsv4_index.kernels.slot_mapping",
    "compressed_slot_mapping": "dsv4_index.kernels.compressed_slot_mapping",
    "window_indices": "dsv4_index.kernels.window_indices",
    "causal_compressed_indices": "dsv4_index.kernels.causal_compressed_indices",
    "topk_to_slots": "dsv4_index.kernels.topk_to_slots",
    "indexer_lengths": "dsv4_index.kernels.indexer_lengths",
    "IndexerLengths": "dsv4_index.kernels.indexer_lengths",
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

__all__ = sorted(_LAZY) + ["reference"]


def __getattr__(name):
    if name in _LAZY:
        obj = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = obj
        return obj
    if name == "reference":
        return importlib.import_module("dsv4_index.reference")
    raise AttributeError(f"module 'dsv4_index' has no attribute {name!r}")


def __dir__():
    return __all__
