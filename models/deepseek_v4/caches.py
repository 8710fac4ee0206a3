"""Paged caches of the small DeepSeek-V4 attention: per layer, the channels it reads, sized from a
``DSV4Layout`` (any group plan: one group per role, vLLM's sub-groups, one sliding group per layer, V4.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from dsv4_index._common import check_int

from .config import DSV4Config

__all__ = ["LayerCache", "PagedCaches", "layer_channels"]


@dataclass
class LayerCache:
    """One layer's caches (rows = slots of its channel). ``None`` where the kind has no such cache.

    swa [swa slots, D]; state [state slots, 2 D]; comp [compressed slots, D];
    c4 only: idx_state [c4_state slots, 2 d_idx], idx_comp [c4i slots, d_idx].
    """

    swa: torch.Tensor
    state: Optional[torch.Tensor] = None
    comp: Optional[torch.Tensor] = None
    idx_state: Optional[torch.Tensor] = None
    idx_comp: Optional[torch.Tensor] = None


class PagedCaches:
    """Per-layer cache tensors sized from a ``DSV4Layout`` and the block pool size.

    Each layer's caches are the channels it reads (:meth:`DSV4Layout.layer_channels`: its own SWA group
    under vLLM's sub-groups or one group per layer, ``c2a`` / ``c1a`` on V4.1 ...); a channel's cache has
    ``num_blocks * rows_per_block`` rows (its slots). A V4.1 layer that shares its kv source's caches
    (``config.kv_source(layer) != layer``) gets the source's compressed and state tensors themselves.
    ``fill`` pre-poisons every row (NaN by default) so a read of a row nobody wrote shows up in the output.

    Raises ValueError at construction when the layout does not describe ``config``'s layers or lacks an
    option a layer needs (``indexer_causal_indices=True``: the c4 layers score every visible row).
    """

    def __init__(self, config: DSV4Config, layout, num_blocks: int, *, device=None,
                 dtype: torch.dtype = torch.float32, fill: float = float("nan")):
        check_int("num_blocks", num_blocks, lo=1)
        D, d = config.head_dim, config.index_head_dim

        def alloc(channel: str, width: int) -> torch.Tensor:
            rows = num_blocks * layout.channels[channel].rows_per_block
            return torch.full((rows, width), fill, dtype=dtype, device=device)

        self.layers: Dict[int, LayerCache] = {}
        for layer_id in range(config.num_layers):
            kind = config.layer_kind(layer_id)
            ch = layer_channels(layout, layer_id, config)
            lc = LayerCache(swa=alloc(ch["swa"], D))
            src = config.kv_source(layer_id)
            if src is not None and src != layer_id:  # NOTE: V4.1 KV sharing: the source's tensors (same channels)
                s = self.layers[src]
                lc.state, lc.comp, lc.idx_state, lc.idx_comp = s.state, s.comp, s.idx_state, s.idx_comp
            elif kind == "c4":
                lc.comp, lc.idx_comp = alloc(ch["c4a"], D), alloc(ch["c4i"], d)
                if "c4_state" in ch:  # NOTE: V4.1's ratio-1 layers have no compressor state
                    lc.state, lc.idx_state = alloc(ch["c4_state"], 2 * D), alloc(ch["c4_state"], 2 * d)
            elif kind == "c128":
                lc.state, lc.comp = alloc(ch["c128_state"], 2 * D), alloc(ch["c128a"], D)
            self.layers[layer_id] = lc

    def __getitem__(self, layer_id: int) -> LayerCache:
        return self.layers[layer_id]


def layer_channels(layout, layer_id: int, config: DSV4Config) -> Dict[str, str]:
    """The channels layer ``layer_id`` reads (``layout.layer_channels``), checked against what the
    model needs: the layout must describe ``config``'s layers, and a c4 layer needs the indexer's causal
    lists (``DSV4Layout.from_config(..., indexer_causal_indices=True)``). ValueError naming the option."""
    if tuple(layout.compress_ratios) != tuple(config.compress_ratios):
        raise ValueError(f"layout: its compress_ratios {list(layout.compress_ratios)[:8]}... differ from the "
                         f"model config's {list(config.compress_ratios)[:8]}...: build it from the same config")
    ch = layout.layer_channels(layer_id)
    if config.layer_kind(layer_id) == "c4" and layout.channels[ch["c4i"]].index_width is None:
        raise ValueError(f"layout: layer {layer_id} (c4) scores every visible compressed row through the "
                         f"indexer's causal list {ch['c4i']!r}.indices; build the layout with "
                         f"DSV4Layout.from_config(..., indexer_causal_indices=True)")
    return ch
