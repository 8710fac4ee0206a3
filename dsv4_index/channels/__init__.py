"""Channel builders: one per cache that consumes a kv-cache group's block table (DESIGN §2, §6).

A builder owns persistent output buffers, allocated once at capacity in :meth:`ChannelBuilder.allocate`,
and fills them in :meth:`ChannelBuilder.build` from the step's common tensors (:class:`BuildContext`).
Built-in builders cover ``swa``, ``c4_state``, ``c128_state`` (raw slots + window lists), ``c4a``
(compressed slots + per-layer top-k conversion), ``c4i`` (compressed slots + indexer lengths) and
``c128a`` (compressed slots + causal compressed lists).

Adding a channel needs no edit inside the package::

    from dsv4_index import ChannelSpec, register_channel
    from dsv4_index.channels import CompressedChannel

    register_channel("c2", CompressedChannel)            # or a ChannelBuilder subclass of your own
    layout = layout.with_channel(ChannelSpec(name="c2", gid=0, compress_ratio=2, rows_per_block=128,
                                             window=None, index_width=None,
                                             outputs=frozenset({"compressed_slot_mapping", "topk"})))
"""

from __future__ import annotations

from .base import BuildContext, ChannelBuilder, ChannelMetadata, builder_for, register_channel, registered_channels
from .builtin import CausalCompressedChannel, CompressedChannel, IndexerChannel, WindowChannel

__all__ = ["BuildContext", "ChannelBuilder", "ChannelMetadata", "register_channel", "registered_channels",
           "builder_for", "WindowChannel", "CompressedChannel", "IndexerChannel", "CausalCompressedChannel"]
