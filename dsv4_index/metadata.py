"""One step's metadata (:class:`DSV4Metadata`) and the per-step counters (:class:`StepStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .channels.base import ChannelMetadata

__all__ = ["DSV4Metadata", "StepStats"]


@dataclass
class DSV4Metadata:
    """One step's metadata. Device tensors are views of persistent buffers (CUDA-graph safe): the
    same addresses every step; ``T = num_tokens_padded``, ``B = num_reqs`` (decode rows first).

    Attributes
    ----------
    num_reqs, num_tokens, num_tokens_padded : int — batch rows, live tokens, tokens incl. padding.
    num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens : int (host).
    req_slots : int64 numpy [B] — request slot of each batch row (host copy of ``idx_mapping``).
    host_query_start_loc : int64 numpy [B + 1]; host_seq_lens : int64 numpy [B] — host copies.
    req_ids : sequence of str or None — request id of each batch row (id-keyed front ends only).
    query_start_loc : int32 [B + 1]; seq_lens : int32 [B]; idx_mapping : int32 [B] (device).
    positions : int64 [T]; token_to_req : int32 [T] (batch row); is_valid_token : bool [T].
    block_tables : list of int32 [max_num_reqs, cols] per gid — slot-indexed device tables (batch row
        ``b`` reads row ``idx_mapping[b]``); ``ring_cols[gid] > 0`` marks a ring (logical block ``i`` in
        column ``i % ring_cols``).
    channels : dict name -> ChannelMetadata; ``meta["swa"]`` is ``meta.channels["swa"]``.
    layout : DSV4Layout; cp : (world, rank, interleave); next_n : int.
    replay_start, replay_end : int64 numpy [B] or None (host).
    builders : dict name -> ChannelBuilder — who produced each channel (what its outputs must equal:
        ``ChannelBuilder.expected``, used by :mod:`dsv4_index.validate`).

    The query batch (docs/DESIGN.md §5 "Source rows ≠ query rows"; a step declaring ``StepBatch.query_lens``):
    num_query_tokens, num_query_tokens_padded, num_query_decode_tokens : int — ``T_q``, ``T_q_pad`` and the decode
        rows' query tokens (``T``, ``T_pad``, ``num_decode_tokens`` for a plain step).
    query_lens : int64 numpy [B]; host_query_start_loc_q : int64 numpy [B + 1] — host copies (None: plain step).
    query_start_loc_q : int32 [B + 1]; q_to_src : int32 [T_q_pad] — the query batch's row offsets and the source
        row of each query row (``-1`` for padded query rows); None for a plain step (the identity).
    Per source token (``[T_pad]`` rows): ``positions``, ``token_to_req``, ``is_valid_token`` and every slot mapping
    (``slot_mapping``, ``tail_slot_mapping``, ``compressed_slot_mapping``, ``compact_slot_mapping``), and the
    window lists of compressor-state groups. Per query token (``[T_q_pad]`` rows): the ``swa`` groups' window lists,
    causal compressed lists (``c128a``), indexer ``lens`` / ``ks`` / ``ke`` (``decode_lens`` over the decode rows'
    query tokens) and every top-k / candidate conversion; such a row equals the plain step's row ``q_to_src[u]``.
    """

    num_reqs: int
    num_tokens: int
    num_tokens_padded: int
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    req_slots: np.ndarray
    req_ids: Optional[Sequence[str]]
    host_query_start_loc: np.ndarray
    host_seq_lens: np.ndarray
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    idx_mapping: torch.Tensor
    positions: torch.Tensor
    token_to_req: torch.Tensor
    is_valid_token: torch.Tensor
    block_tables: List[torch.Tensor]
    ring_cols: Tuple[int, ...]
    channels: Dict[str, ChannelMetadata]
    layout: object
    cp: Tuple[int, int, int]
    next_n: int
    replay_start: Optional[np.ndarray] = None
    replay_end: Optional[np.ndarray] = None
    builders: Dict[str, object] = field(default_factory=dict, repr=False)
    _converters: Dict[str, Callable] = field(default_factory=dict, repr=False)
    num_query_tokens: Optional[int] = None
    num_query_tokens_padded: Optional[int] = None
    num_query_decode_tokens: Optional[int] = None
    query_lens: Optional[np.ndarray] = None
    host_query_start_loc_q: Optional[np.ndarray] = None
    query_start_loc_q: Optional[torch.Tensor] = None
    q_to_src: Optional[torch.Tensor] = None

    def __post_init__(self):
        # NOTE: a plain step: the query batch is the source batch
        if self.num_query_tokens is None:
            self.num_query_tokens = self.num_tokens
        if self.num_query_tokens_padded is None:
            self.num_query_tokens_padded = self.num_tokens_padded
        if self.num_query_decode_tokens is None:
            self.num_query_decode_tokens = self.num_decode_tokens

    def __getitem__(self, name: str) -> ChannelMetadata:
        try:
            return self.channels[name]
        except KeyError:
            raise KeyError(f"no channel {name!r} in this layout; channels: {sorted(self.channels)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.channels

    def topk_to_slots(self, channel: str, topk: torch.Tensor, *, compact: bool = False):
        """Convert one layer's indexer picks into physical slots of ``channel``'s cache.

        Parameters
        ----------
        channel : str — a channel with top-k conversion (``"c4a"``).
        topk : int32 or int64 [>= T, K] — request-local compressed row ids, ``-1`` = none.
        compact : bool — valid entries first (order kept), then ``-1``.

        Returns
        -------
        (slots int32 [T, K], lens int32 [T]) — views of persistent buffers, overwritten by the next
        call; ``lens`` counts the valid entries (0 for padded tokens).
        """
        if channel not in self.channels:
            raise KeyError(f"no channel {channel!r} in this layout; channels: {sorted(self.channels)}")
        if torch.compiler.is_compiling():
            # NOTE: inside torch.compile: the registered functional op (no host checks, no graph break)
            from .torch_ops import topk_to_slots as compiled_topk
            return compiled_topk(self, channel, topk, compact=compact)
        conv = self._converters.get(channel)
        if conv is None:
            raise ValueError(f"channel {channel!r} does not convert top-k indices")
        return conv(topk, compact=compact)

    def _candidate_builder(self, channel: str):
        if channel not in self.channels:
            raise KeyError(f"no channel {channel!r} in this layout; channels: {sorted(self.channels)}")
        b = self.builders.get(channel)
        if b is None or not hasattr(b, "candidate_topk_to_slots"):
            raise ValueError(f"channel {channel!r} does not convert top-k indices")
        return b

    def candidate_blocks_to_physical(self, channel: str, blocks: torch.Tensor):
        """V4.1's two-level indexer: the candidate source's blocks as physical candidate blocks.

        Parameters
        ----------
        channel : str — a channel with top-k conversion (``"c1a"``, ``"c2a"``; ``"c4a"`` in a V4 layout given
            the config fields).
        blocks : int32 [>= T, nb] — request-local candidate block ids (``-1`` = none), ``nb <=
            layout.candidate_topk_blocks``.

        Returns
        -------
        (phys int32 [T, nb], counts int32 [T]) — ``phys[t, i]`` = slot of compressed row ``blocks[t, i] * C``
        divided by ``C`` (``-1`` for a ``-1`` block or one whose first row the token cannot see yet), ``counts``
        the valid entries (0 for padded tokens): docs/DESIGN.md §4 "Candidate blocks". Views of persistent
        buffers, overwritten by the next call. Refused under DCP and without the two-level indexer.
        """
        b = self._candidate_builder(channel)
        if torch.compiler.is_compiling():
            from .torch_ops import candidate_blocks_to_physical as compiled
            return compiled(self, channel, blocks)
        return b.candidate_blocks_to_physical(b.ctx, blocks)

    def candidate_topk_to_slots(self, channel: str, blocks: torch.Tensor, cols: torch.Tensor, *,
                                compact: bool = False):
        """A candidate consumer layer's sparse columns as physical slots of ``channel``'s cache.

        Parameters
        ----------
        channel : str — as :meth:`candidate_blocks_to_physical`.
        blocks : int32 [>= T, nb] — this step's candidate blocks (one expansion serves every consumer layer).
        cols : int32 or int64 [>= T, K] — the layer's sparse columns (``-1`` = none), ``K <= index_topk``.
        compact : bool — valid entries first (order kept), then ``-1``.

        Returns
        -------
        (slots int32 [T, K], lens int32 [T]) — exactly :meth:`topk_to_slots` of the rows
        ``blocks[t, cols[t, k] // C] * C + cols[t, k] % C`` (``-1`` where ``cols`` or that block is ``-1``); views
        of persistent buffers (not the top-k ones), overwritten by the next call.
        """
        b = self._candidate_builder(channel)
        if torch.compiler.is_compiling():
            from .torch_ops import candidate_topk_to_slots as compiled
            return compiled(self, channel, blocks, cols, compact=compact)
        return b.candidate_topk_to_slots(b.ctx, blocks, cols, compact=compact)

    def decode_view(self, channel: str, *, padded: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """A channel's index list for the decode tokens in FlashMLA's sparse-decode shape (no copy).

        Every decode token is its own batch entry (``s_q = 1``).

        Parameters
        ----------
        channel : str — a channel with ``indices`` and ``lens`` (``"swa"``, ``"c128a"``, state channels).
        padded : bool — cover all ``T_pad`` rows (padded tokens: ``-1`` rows, length 0) instead of the
            ``num_decode_tokens`` decode rows; use it inside CUDA graphs captured per ``T_pad``.

        Returns
        -------
        (indices int32 [Td, 1, width], lens int32 [Td]) — ``Td = num_decode_tokens`` (or ``T_pad``); for lists per
        query token (``swa``, ``c128a``) of a step declaring query rows, ``num_query_decode_tokens`` (or ``T_q_pad``).
        """
        c = self[channel]
        if c.indices is None or c.lens is None:
            raise ValueError(f"channel {channel!r} has no index list")
        qf = getattr(self.builders.get(channel), "query_fields", None)
        if qf is not None and "indices" in qf():  # NOTE: lists per query token (docs/DESIGN.md §5)
            n = self.num_query_tokens_padded if padded else self.num_query_decode_tokens
        else:
            n = self.num_tokens_padded if padded else self.num_decode_tokens
        assert n is not None  # NOTE: set by __post_init__
        return c.indices[:n].unsqueeze(1), c.lens[:n]

    def sparse_decode_args(self, layer_kind: str, topk_slots: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                           *, padded: bool = False, layer: Optional[int] = None) -> Dict[str, Optional[torch.Tensor]]:
        """The index arguments of FlashMLA's sparse decode (two pools) for one layer kind, as views.

        Parameters
        ----------
        layer_kind : {"swa", "c4", "c128"}
        topk_slots : (slots int32 [>= Td, K], lens int32 [>= Td]), for ``"c4"`` — the **converted** top-k:
            this layer's :meth:`topk_to_slots` result with ``compact=True`` (FlashMLA reads only the first
            ``extra_topk_length`` entries; uncompacted, a valid slot after an invalid pick is dropped). Not the
            raw indexer picks (those are ``consumers.prefill_chunks``' form; one tensor raises).
        padded : bool — see :meth:`decode_view`.
        layer : int, optional — the layer index: its own SWA and C128A channels (``layout.layer_channels``,
            found by role); needed when the layout has several of them (``from_config(groups="vllm")``).

        Returns
        -------
        dict with ``indices [Td, 1, 128]`` + ``topk_length [Td]`` (the SWA list) and
        ``extra_indices [Td, 1, K or Wc]`` + ``extra_topk_length [Td]`` (converted top-k for ``"c4"``,
        the causal C128A list for ``"c128"``, None for ``"swa"``). Widths are multiples of 128.
        """
        from .consumers import compressed_channel, swa_channel  # NOTE: lazy: consumers sits above metadata
        idx, lens = self.decode_view(swa_channel(self.layout, layer_kind, layer), padded=padded)
        n = idx.shape[0]
        extra = extra_len = None
        if layer_kind == "c4":
            slots, slot_lens = _converted_topk(topk_slots, n)
            extra, extra_len = slots[:n].unsqueeze(1), slot_lens[:n]
        elif layer_kind == "c128":
            extra, extra_len = self.decode_view(compressed_channel(self.layout, layer_kind, layer), padded=padded)
        elif layer_kind != "swa":
            raise ValueError(f"layer_kind must be 'swa', 'c4' or 'c128', got {layer_kind!r}")
        return dict(indices=idx, topk_length=lens, extra_indices=extra, extra_topk_length=extra_len)


def _converted_topk(topk_slots, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(slots, lens)`` of :meth:`DSV4Metadata.sparse_decode_args`' ``topk_slots``, checked: the converted pair
    (``slots [>= n, K]``, ``lens [>= n]``), not the raw picks."""
    conv = "meta.topk_to_slots('c4a', picks, compact=True)"
    if topk_slots is None:
        raise ValueError(f"topk_slots: a c4 layer needs its converted top-k, the (slots, lens) of {conv}")
    if isinstance(topk_slots, torch.Tensor):
        raise ValueError(f"topk_slots: sparse_decode_args takes the converted (slots, lens) pair of {conv}, got one "
                         f"tensor {tuple(topk_slots.shape)}: raw indexer picks are consumers.prefill_chunks' form")
    if not (isinstance(topk_slots, (tuple, list)) and len(topk_slots) == 2
            and all(isinstance(t, torch.Tensor) for t in topk_slots)):
        raise ValueError(f"topk_slots must be the (slots, lens) tensor pair of {conv}, got {type(topk_slots).__name__}")
    slots, lens = topk_slots
    if slots.dim() != 2 or lens.dim() != 1 or slots.shape[0] < n or lens.shape[0] < n:
        raise ValueError(f"topk_slots: need slots [>= {n}, K] and lens [>= {n}] (Td = {n} rows), got "
                         f"{tuple(slots.shape)} and {tuple(lens.shape)}")
    return slots, lens


@dataclass
class StepStats:
    """What one ``update()`` staged and what the following ``build()`` launches (host counts).

    Attributes
    ----------
    num_h2d_copies : int — host-to-device copies made by ``update()`` (1).
    h2d_bytes : int — bytes of that copy.
    num_writes : int — block ids staged (after ring trimming).
    num_launches : int — kernel launches ``build()`` makes (1 when every channel is fused).
    num_applies : int — extra launches ``update()`` made to apply a staged step that was never built.
    """

    num_h2d_copies: int = 0
    h2d_bytes: int = 0
    num_writes: int = 0
    num_launches: Optional[int] = None
    num_applies: int = 0
