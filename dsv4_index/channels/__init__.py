"""Channel builders: the protocol (:mod:`.base`) and one module per built-in kind.

A new *instance* of a built-in kind is ``register_channel(name, Kind)`` + ``layout.with_channel``; it
joins the fused launch like the built-in ones. A new *kind* subclasses :class:`ChannelBuilder`.
"""

from .base import BuildContext, ChannelBuilder, ChannelMetadata, builder_for, register_channel, registered_channels
from .causal import CausalCompressedChannel
from .compressed import CompressedChannel
from .indexer import IndexerChannel
from .window import WindowChannel

__all__ = ["BuildContext", "ChannelBuilder", "ChannelMetadata", "register_channel", "registered_channels",
           "builder_for", "WindowChannel", "CompressedChannel", "IndexerChannel", "CausalCompressedChannel"]

for _name, _cls in (("swa", WindowChannel), ("c4_state", WindowChannel), ("c128_state", WindowChannel),
                    ("c4a", CompressedChannel), ("c4i", IndexerChannel), ("c128a", CausalCompressedChannel)):
    register_channel(_name, _cls)
