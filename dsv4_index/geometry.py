"""DSV4 cache geometry: the layout (kv-cache groups and the channels that read their block tables)
derived from a model config (docs/DESIGN.md §3). The spec records live in :mod:`dsv4_index.specs`, the choice of
groups in :mod:`dsv4_index.group_plan`, their sizing (block sizes, table widths, index widths) and the channels in
:mod:`dsv4_index.layout_derive`; this module holds the record and its queries.

Group order is part of the contract: ``mla``, ``swa``, ``c4_state``, ``c128_state``; groups the config
has no layer for are omitted and the remaining ones numbered ``0..G-1`` in that order.

Compress-ratio kinds (:func:`dsv4_index.specs.ratio_kinds`): V4's smaller ratio is the indexed "c4" kind
(``c4a`` + ``c4i``), the larger the "c128" kind (``c128a``); V4.1's ratios 1 and 2 are indexed (``c1a`` ...).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple, Union

from ._common import check_int
from .engine_plan import kv_owners, layout_from_kv_cache_config
from .layout_derive import derive_layout
from .specs import CHANNEL_OUTPUTS, GROUP_ORDER, ChannelSpec, GroupSpec, ratio_kinds

__all__ = ["GroupSpec", "ChannelSpec", "DSV4Layout", "GROUP_ORDER", "CHANNEL_OUTPUTS"]


def _load_config(config) -> dict:
    from .config import normalize_config

    return normalize_config(config)


def _config_label(config) -> Tuple[str, str]:
    """(how an error names ``config``, its ``ConfigError.source``): the name or path as given (quoted),
    ``dict``, or the object's type."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        return repr(path), str(path)
    what = "dict" if isinstance(config, Mapping) else f"{type(config).__name__} object"
    return what, what


@dataclass(frozen=True)
class DSV4Layout:
    """Groups and channels of a DSV4 model at a given ``max_model_len`` (build with :meth:`from_config`).

    Attributes
    ----------
    groups : tuple of GroupSpec
        In gid order.
    channels : dict[str, ChannelSpec]
        By name, built-in channels first (``c4a``, ``c4i``, ``c128a``, ``swa``, ``c4_state``,
        ``c128_state`` as present), then user-registered ones.
    max_model_len : int
    sliding_window : int
    index_topk : int or None
    compress_ratios : tuple of int
        Per layer (MTP layers included); 0 = SWA only.
    num_layers : int
        ``num_hidden_layers + num_nextn_predict_layers``.
    c4_ratio, c128_ratio : int or None
        The two compress ratios (None when absent).
    indexer_causal_indices : bool
        Whether ``c4i`` also produces causal index lists.
    cp_world_size, cp_interleave : int
        DCP geometry the table widths were sized for.
    kv_sources : tuple of int
        DeepSeek-V4.1's ``kv_source_layer_ids`` (empty for V4): the layers that compute a compressed cache and
        a compressor state; every other compressed layer reads its source's (:meth:`kv_source`).
    candidate_block_size, candidate_topk_blocks : int or None
        DeepSeek-V4.1's two-level indexer (config ``candidate_block_size`` ``C``, ``candidate_topk_blocks``
        ``nb``): the candidate source picks ``nb`` blocks of ``C`` consecutive compressed rows per token, the
        consumer layers score only their columns (:meth:`DSV4Metadata.candidate_topk_to_slots
        <dsv4_index.metadata.DSV4Metadata.candidate_topk_to_slots>`); None without it. ``C`` divides the
        compressed rows per block of every top-k channel (checked).
    candidate_source_layer : int or None
        The config's ``candidate_source_layer_id`` (None when absent or without the two-level indexer).
    """

    groups: Tuple[GroupSpec, ...]
    channels: Dict[str, ChannelSpec]
    max_model_len: int
    sliding_window: int
    index_topk: Optional[int]
    compress_ratios: Tuple[int, ...]
    num_layers: int
    c4_ratio: Optional[int] = None
    c128_ratio: Optional[int] = None
    indexer_causal_indices: bool = False
    cp_world_size: int = 1
    cp_interleave: int = 1
    kv_sources: Tuple[int, ...] = ()
    candidate_block_size: Optional[int] = None
    candidate_topk_blocks: Optional[int] = None
    candidate_source_layer: Optional[int] = None

    @classmethod
    def from_config(cls, config, max_model_len: int, *, mla_block_size: int = 256,
                    swa_block_size: int = 64, c4_state_block_size: int = 4,
                    c128_state_block_size: int = 8, indexer_causal_indices: bool = False,
                    kernel_block_size: Union[None, int, Mapping[str, int]] = None,
                    cp_world_size: int = 1, cp_interleave: int = 1, sliding_tables: str = "ring",
                    circular: Optional[Mapping[str, Union[int, Tuple[int, int]]]] = None,
                    compact_compressed: bool = False, groups=None,
                    swa_group_per_layer: bool = False) -> "DSV4Layout":
        """Derive the layout of docs/DESIGN.md §3 from a model config.

        Parameters
        ----------
        config : str, Path, dict or config object
            The model's config (read by :func:`dsv4_index.config.normalize_config`): a shipped name
            (``"flash"``, ``"pro"``, ``"tiny"``), a ``config.json`` path or its folder, a dict, a
            transformers ``PretrainedConfig`` (``DeepseekV4Config``: ``layer_types`` +
            ``compress_rates``) or ``models.deepseek_v4.DSV4Config``. Needs ``num_hidden_layers``,
            ``compress_ratios`` or ``layer_types``, ``sliding_window`` (and ``index_topk`` when a c4
            layer exists); ``num_nextn_predict_layers`` defaults to 0.
        max_model_len : int
            Longest request (tokens); sizes every table width and causal index width.
        mla_block_size, swa_block_size, c4_state_block_size, c128_state_block_size : int
            Allocation block sizes of the groups (DSV4 defaults 256, 64, 4, 8).
        indexer_causal_indices : bool
            Give ``c4i`` a causal index list (width ``round_up(ceil(L / R4), 128)``).
        kernel_block_size : int or dict[str, int], optional
            Hybrid blocks: the kernel block size of the mla group (int), or per group name (dict).
            Must divide the group's allocation block size; the group then stores
            ``f = alloc // kernel`` kernel blocks per allocation block.
        cp_world_size, cp_interleave : int
            DCP: tables of sharded groups (``mla``, ``swa``) hold the tokens one rank stores,
            ``round_up(ceil(max_model_len / cp_world_size), cp_interleave)``; the compressor-state
            groups are replicated (``GroupSpec.sharded = False``).
        sliding_tables : {"ring", "full"}
            Sliding groups store a ring of their newest blocks (default) or full-width rows.
        circular : dict[str, int or (int, int)], optional
            Group name -> ``capacity`` or ``(capacity, block_size)``: make those sliding groups
            circular, a ring of ``capacity`` rows per request (``capacity >= window``). An int is one
            block of ``capacity`` rows (vLLM's ``CircularBufferSpec``; the scheduler gives the group
            one block id per request); ``(capacity, block_size)`` is a ring of ``k = capacity //
            block_size`` blocks (vLLM's Triton ring, vllm-ascend; e.g. ``(256, 8)``: 32 blocks of 8),
            ``capacity`` a multiple of ``block_size``, the group's table ``k`` columns and the
            scheduler giving ``k`` block ids per request at admission; row ``p = pos % capacity``
            lives at ``bt[p // block_size] * block_size + p % block_size`` (a ``kernel_block_size`` for
            the group splits each ring block into kernel blocks: the same slots). vLLM's ring
            semantics (docs/DESIGN.md §4 "circular group"): any chunk length;
            ``slot_mapping`` is the address map, ``tail_slot_mapping`` the write plan, window lists
            split at the chunk start. With speculative decoding use ``capacity >= window - 1 +
            num_speculative_tokens`` (vLLM: ``128 * cdiv(128 + k, 128)``) so that a verify step's
            writes never reach the rows the next step reads after a rejection.
        compact_compressed : bool
            Compressed channels (``c4a``, ``c4i``, ``c128a``) also emit the compact compressed slot
            mapping (``ChannelSpec.compact``).
        groups : None, "vllm" or list of dict
            The kv-cache groups (:func:`dsv4_index.group_plan.plan_groups`): None, one group per role
            (the docs/DESIGN.md §3 table); ``"vllm"``, vLLM's plan (full MLA, SWA sub-groups of strided layers,
            C4 state, C128 state: 5 groups for V4-Flash and V4-Pro); or the engine's own list, one dict
            per group in its gid order (``role`` or ``layer_names``, ``layers``, ``block_size``,
            ``name``). Every sliding group gets a window channel of its name;
            :meth:`layer_channels` says which channels a layer reads. ``kernel_block_size`` and
            ``circular`` keys may name a role (all its groups) or a group.
        swa_group_per_layer : bool
            One sliding group per layer (``swa_0`` .. ``swa_{L-1}`` where ``swa`` stands), as V4.1 engines
            may plan them (vLLM ``deepseek_v41/swa_metadata.py``); needs ``groups=None``. Still one launch.

        DeepSeek-V4.1: ``c1a`` / ``c1i`` (ratio 1, no state) and ``c2a`` / ``c2i`` read the mla group; the
        ratio-2 state is the circular group ``c2_state`` (window 4), one block of 8 rows by default (vLLM's
        ``CompressorStateCache``: ``max(8, pow2(num_speculative_tokens + 2))``; ``circular={"c2_state": 16}``).

        Returns
        -------
        DSV4Layout

        Raises
        ------
        ValueError
            :class:`~dsv4_index.config.ConfigError` naming the config: an unreadable or malformed
            config names its source (and line) itself; every other error (an argument such as
            ``groups[2].layers``, a config field, the layout's own checks) reads
            ``"from_config(<config>): ..."`` with ``<config>`` the name, path, ``dict`` or object type
            given, and has ``source`` set to it.
        """
        cfg = _load_config(config)
        try:
            return cls(**derive_layout(
                cfg, max_model_len, mla_block_size=mla_block_size, swa_block_size=swa_block_size,
                c4_state_block_size=c4_state_block_size, c128_state_block_size=c128_state_block_size,
                indexer_causal_indices=indexer_causal_indices, kernel_block_size=kernel_block_size,
                cp_world_size=cp_world_size, cp_interleave=cp_interleave, sliding_tables=sliding_tables,
                circular=circular, compact_compressed=compact_compressed, groups=groups,
                swa_group_per_layer=swa_group_per_layer))
        except ValueError as e:
            from .config import ConfigError, key_path

            label, source = _config_label(config)
            field = key_path(str(e)) or getattr(e, "field", None)
            raise ConfigError(f"from_config({label}): {e}", source, field=field) from e

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config, model_config, max_model_len: Optional[int] = None,
                             **kwargs) -> "DSV4Layout":
        """The layout of an engine's own KV-cache plan (vLLM's ``KVCacheConfig``, duck-typed): one group
        per engine group in the engine's gid order. Parameters and errors:
        :func:`dsv4_index.engine_plan.layout_from_kv_cache_config`."""
        return layout_from_kv_cache_config(cls, kv_cache_config, model_config, max_model_len, **kwargs)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def group(self, name: str) -> GroupSpec:
        """The group called ``name`` (ValueError if absent)."""
        for g in self.groups:
            if g.name == name:
                return g
        raise ValueError(f"name: no group {name!r} in this layout (groups: "
                         f"{[g.name for g in self.groups]})")

    def has_group(self, name: str) -> bool:
        return any(g.name == name for g in self.groups)

    def channels_of(self, gid: int) -> Tuple[ChannelSpec, ...]:
        """Channels reading group ``gid``'s block table, in registration order."""
        if not 0 <= gid < len(self.groups):
            raise ValueError(f"gid must be in [0, {len(self.groups)}), got {gid!r}")
        return tuple(c for c in self.channels.values() if c.gid == gid)

    def cache_shape(self, channel: str, num_blocks: int):
        """``channel``'s cache for ``num_blocks`` blocks: rows ``num_blocks * rows_per_block``, shape and a
        dtype / FP8 note (:func:`dsv4_index.cache_shape.cache_shape`)."""
        from .cache_shape import cache_shape
        return cache_shape(self, channel, num_blocks)

    def layer_kind(self, layer: int) -> str:
        """``"swa"``, ``"c4"`` (indexed: top-k) or ``"c128"`` (every visible row): the attention kind of
        layer ``layer`` (:func:`dsv4_index.specs.ratio_kinds`)."""
        r = self.compress_ratios[layer]
        return "swa" if r == 0 else next(k.kind for k in ratio_kinds(self.compress_ratios) if k.ratio == r)

    def layer_channels(self, layer: int) -> Dict[str, str]:
        """The channels layer ``layer`` reads, by role: ``{"swa": ..., "c4a": ..., "c4i": ...,
        "c4_state": ...}`` for a c4 layer, ``{"swa", "c128a", "c128_state"}`` for a c128 layer,
        ``{"swa"}`` for an SWA-only layer; values are channel names (``"swa_1"`` for a layer of
        vLLM's second SWA sub-group, ``"c2a"`` / ``"c2i"`` / ``"c2_state"`` for a V4.1 ratio-2 layer; a
        ratio-1 layer has no ``c4_state``). User-registered channels are not listed. A V4.1 layer that is not
        its own :meth:`kv_source` lists the same channels as its source; it writes none of them."""
        check_int("layer", layer, lo=0, hi=self.num_layers - 1)
        kind, r = self.layer_kind(layer), self.compress_ratios[layer]
        wants = {"swa": {"swa"}, "c4": {"swa", "c4a", "c4i", "c4_state"},
                 "c128": {"swa", "c128a", "c128_state"}}[kind]
        mine = set().union(*[{k.main, k.indexer, k.state} for k in ratio_kinds(self.compress_ratios) if k.ratio == r])
        out = {}
        for c in self.channels.values():
            g = self.groups[c.gid]
            if c.role not in wants or (c.role != "swa" and c.name not in mine and g.role not in mine):
                continue
            if g.layers is None or layer in g.layers or g.role == "mla":
                out[c.role] = c.name
        if "swa" not in out:  # NOTE: an engine plan without the MTP draft layers (group_plan)
            raise ValueError(f"layer: layer {layer} is served by no group of this layout (an MTP draft layer "
                             f"the engine's plan leaves out)")
        return out

    def kv_source(self, layer: int) -> Optional[int]:
        """The layer whose compressed cache (and compressor state) compressed layer ``layer`` reads: itself in
        V4 and for a V4.1 source, else the nearest of :attr:`kv_sources` below it (vLLM's ``kv_source_layer_id``,
        :func:`~dsv4_index.engine_plan.kv_owners`); None for an SWA-only layer. Every layer of one ratio reads
        the same channels (slots are per request, not per layer): a consumer that follows the engine writes
        the compressed rows and the compressor state (``layer_channels(layer)``'s ``*_state``) only where
        ``kv_source(layer) == layer``."""
        check_int("layer", layer, lo=0, hi=self.num_layers - 1)
        return kv_owners(self.compress_ratios, self.kv_sources).get(layer)

    def with_channel(self, spec: ChannelSpec) -> "DSV4Layout":
        """A new layout with one more (user-registered) channel."""
        if not isinstance(spec, ChannelSpec):
            raise ValueError(f"spec must be a ChannelSpec, got {type(spec).__name__}")
        if spec.name in self.channels:
            raise ValueError(f"spec: channel {spec.name!r} already exists in this layout")
        if not (isinstance(spec.gid, int) and 0 <= spec.gid < len(self.groups)):
            raise ValueError(f"spec.gid must be in [0, {len(self.groups)}), got {spec.gid!r}")
        g = self.groups[spec.gid]
        if spec.rows_per_block * spec.compress_ratio > g.block_size:
            raise ValueError(f"spec: rows_per_block {spec.rows_per_block} * compress_ratio "
                             f"{spec.compress_ratio} exceeds block_size {g.block_size} of group {g.name!r}")
        return dataclasses.replace(self, channels={**self.channels, spec.name: spec})

    def __str__(self) -> str:
        kinds = ratio_kinds(self.compress_ratios)
        v4 = all(k.main in ("c4a", "c128a") for k in kinds)   # NOTE: V4.1's ratios are named by value
        ratios = (f"c4={self.c4_ratio}, c128={self.c128_ratio}" if v4 else
                  "ratios=" + "/".join(str(k.ratio) for k in kinds))
        lines = [f"DSV4Layout(max_model_len={self.max_model_len}, layers={self.num_layers}, "
                 f"W={self.sliding_window}, {ratios}, index_topk={self.index_topk}"
                 + (f", cp={self.cp_world_size}x{self.cp_interleave}" if self.cp_world_size > 1 else "")
                 + ")"]
        head = f"{'gid':>3}  {'group':<11}{'kind':<8}{'block':>6}{'f':>3}{'window':>7}{'width':>8}  channels"
        lines += [head, "-" * (len(head) + 30)]
        for g in self.groups:
            chans = ", ".join(f"{c.name}(R={c.compress_ratio}, S={c.rows_per_block}"
                              + (f", idx={c.index_width}" if c.index_width is not None else "") + ")"
                              for c in self.channels_of(g.gid))
            win = "-" if g.window is None else str(g.window)
            width = g.ring_blocks if g.kind == "circular" else g.table_width   # NOTE: a ring's blocks
            lines.append(f"{g.gid:>3}  {g.name:<11}{g.kind:<8}{g.block_size:>6}{g.blocks_per_kv_block:>3}"
                         f"{win:>7}{width:>8}  {chans}")
        return "\n".join(lines)
