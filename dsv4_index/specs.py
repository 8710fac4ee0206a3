"""The two spec records of a layout: a kv-cache group (:class:`GroupSpec`) and a channel that reads its
block table (:class:`ChannelSpec`), with the constants they are checked against. :mod:`dsv4_index.geometry`
derives them from a model config (:meth:`DSV4Layout.from_config`); :mod:`dsv4_index.group_plan` says which
groups an engine uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple

from ._common import cdiv, check_int, is_int

__all__ = ["GroupSpec", "ChannelSpec", "RatioKind", "ratio_kinds", "GROUP_ORDER", "GROUP_KINDS", "CHANNEL_OUTPUTS",
           "INDEX_ALIGN", "LOW_RATIOS", "parse_circular"]

GROUP_ORDER = ("mla", "swa", "c4_state", "c128_state")
GROUP_KINDS = ("full", "sliding", "circular")
INDEX_ALIGN = 128  # NOTE: causal compressed widths are rounded up to this (docs/DESIGN.md §4)
LOW_RATIOS = (1, 2)  # NOTE: DeepSeek-V4.1's compress ratios (vLLM deepseek_v41: compress_ratio in {0, 1, 2})
INDEXED_MAX_RATIO = 4  # NOTE: ratios up to this are read through the indexer's top-k in the V4.1 family

# outputs each built-in channel produces (names of ChannelMetadata fields)
CHANNEL_OUTPUTS: Dict[str, FrozenSet[str]] = {
    "swa": frozenset({"slot_mapping", "indices", "lens"}),
    "c4_state": frozenset({"slot_mapping", "indices", "lens"}),
    "c128_state": frozenset({"slot_mapping", "indices", "lens"}),
    "c4a": frozenset({"compressed_slot_mapping"}),
    "c4i": frozenset({"compressed_slot_mapping", "lens", "ks", "ke", "cu", "decode_lens"}),
    "c128a": frozenset({"compressed_slot_mapping", "indices", "lens"}),
}


@dataclass(frozen=True)
class GroupSpec:
    """One kv-cache group: its own block ids per request, from the shared block pool.

    Attributes
    ----------
    gid : int
        Group id (index into ``DSV4Layout.groups`` and into per-gid block-id lists).
    name : str
        ``"mla"``, ``"swa"``, ``"c4_state"``, ``"c128_state"`` (or a user name).
    kind : str
        ``"full"`` (every block kept), ``"sliding"`` (only the last ``window`` tokens are read) or
        ``"circular"`` (a ring of ``capacity`` rows per request in ``k = capacity // block_size``
        blocks: row ``p = pos % capacity`` lives at ``bt[p // block_size] * block_size + p %
        block_size``; ``k = 1``: ``bt[0] * capacity + pos % capacity``; vLLM's ``CircularBufferSpec``).
    block_size : int
        Tokens per block *as stored in the table*: the kernel block size. With
        ``blocks_per_kv_block = f > 1`` (hybrid) the scheduler allocates blocks of
        ``alloc_block_size = block_size * f`` tokens and the table holds kernel-block ids ``b*f + j``.
    window : int or None
        Sliding window in tokens (None for full groups).
    prefix_cacheable : bool
        Whether blocks of this group can be shared through prefix caching.
    table_width : int
        Logical blocks (kernel blocks) per request: enough for ``max_model_len`` tokens (per rank
        under DCP). The stored table has this many columns unless it is a ring (:meth:`columns`).
    blocks_per_kv_block : int
        Kernel blocks per allocation block ``f``.
    ring : bool
        Sliding groups: store a ring of the newest blocks (``ring_cols = cdiv(window - 1 +
        max_num_batched_tokens, block_size) + blocks_per_kv_block`` columns; logical block ``i`` in
        column ``i % ring_cols``) instead of ``table_width`` columns (docs/DESIGN.md §4). Default for sliding
        groups.
    sharded : bool
        DCP: the group's positions are sharded over ranks (ownership rule); False for groups
        replicated on every rank (the compressor-state groups: a row's pooling span straddles ranks).
    role : str or None
        The cache the group holds: ``"mla"``, ``"swa"``, ``"c4_state"``, ``"c128_state"`` (None: a
        user group; :mod:`dsv4_index.group_plan`). Several groups may share a role (vLLM's SWA
        sub-groups).
    layers : tuple of int or None
        The layers whose ``role`` cache lives in this group; None: every layer that has one.
    capacity : int or None
        Circular groups: rows of the ring per request, a multiple of ``block_size`` and at least the
        window (None: ``block_size``, a ring of one block). Only for circular groups.
    """

    gid: int
    name: str
    kind: str
    block_size: int
    window: Optional[int]
    prefix_cacheable: bool
    table_width: int
    blocks_per_kv_block: int = 1
    ring: bool = False
    sharded: bool = True
    role: Optional[str] = None
    layers: Optional[Tuple[int, ...]] = None
    capacity: Optional[int] = None

    def __post_init__(self):
        if self.layers is not None:  # NOTE: JSON round trips hand lists
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        if self.ring and self.kind != "sliding":
            raise ValueError(f"ring tables are for sliding groups (group {self.name!r} is {self.kind})")
        if (self.window is None) != (self.kind == "full"):
            raise ValueError(f"window must be None exactly for full groups (group {self.name!r}, "
                             f"kind {self.kind!r}, window {self.window!r})")
        for name in ("block_size", "table_width", "blocks_per_kv_block"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} of group {self.name!r} must be an int >= 1, got {v!r}")
        if self.capacity is not None:
            if self.kind != "circular":
                raise ValueError(f"capacity is for circular groups (group {self.name!r} is {self.kind})")
            if not is_int(self.capacity) or self.capacity < 1 or self.capacity % self.block_size:
                raise ValueError(f"capacity of circular group {self.name!r} must be a positive multiple of "
                                 f"its block_size {self.block_size}, got {self.capacity!r}")
        if self.kind == "circular" and self.window is not None and self.ring_capacity < self.window:
            raise ValueError(f"circular group {self.name!r}: capacity {self.ring_capacity} "
                             f"is below its window {self.window}")

    @property
    def ring_capacity(self) -> int:
        """Circular groups: rows of the ring per request (``capacity``, default ``block_size``)."""
        return self.capacity if self.capacity is not None else self.block_size

    @property
    def ring_blocks(self) -> int:
        """Circular groups: blocks of the ring per request, ``capacity // block_size`` (1 otherwise)."""
        return self.ring_capacity // self.block_size if self.kind == "circular" else 1

    def blocks_for(self, num_tokens: int) -> int:
        """Block ids a request of ``num_tokens`` tokens (computed + scheduled) holds in this group, as a
        scheduler allocates them (blocks of :attr:`alloc_block_size` tokens): ``cdiv(num_tokens,
        alloc_block_size)`` for full and sliding groups (a sliding group's blocks behind the window may
        be freed and sent as the null block, but the list keeps their places), :attr:`ring_blocks` for a
        circular group whatever ``num_tokens`` (its ring is allocated once). ``num_tokens`` int >= 0."""
        if not is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if self.kind == "circular":
            return self.ring_blocks
        return -(-int(num_tokens) // self.alloc_block_size)

    @property
    def kernel_block_size(self) -> int:
        """Tokens per stored (kernel) block; same as ``block_size``."""
        return self.block_size

    @property
    def alloc_block_size(self) -> int:
        """Tokens per block the scheduler allocates: ``block_size * blocks_per_kv_block``."""
        return self.block_size * self.blocks_per_kv_block

    def columns(self, max_num_batched_tokens: int) -> Tuple[int, int]:
        """(columns of the stored table, ring width or 0) for a pipeline of that token capacity.

        A sliding ring keeps ``cdiv(window - 1 + max_num_batched_tokens, block_size) + f`` columns,
        ``f = blocks_per_kv_block``: the blocks one step can read or write, plus one for a window
        that starts inside a block, plus ``f - 1`` because the scheduler hands out whole allocation
        blocks (a row may hold up to ``f - 1`` kernel blocks past the step's last token), unless that
        is not smaller than the full width; a circular group keeps its ``capacity // block_size``
        blocks (a ring of that width).
        """
        if self.kind == "circular":
            return self.ring_blocks, self.ring_blocks
        if self.ring and self.window is not None:  # NOTE: ring groups are sliding, so windowed
            ring = cdiv(self.window - 1 + max_num_batched_tokens, self.block_size) + self.blocks_per_kv_block
            if ring < self.table_width:
                return ring, ring
        return self.table_width, 0


@dataclass(frozen=True)
class ChannelSpec:
    """One cache that reads a group's block table.

    Attributes
    ----------
    name : str
        Channel name (``c4a``, ``c4i``, ``c128a``, ``swa``, ``c4_state``, ``c128_state`` or user's).
    gid : int
        Group whose block table the channel reads.
    compress_ratio : int
        Tokens per cache row ``R`` (1 for raw tokens).
    rows_per_block : int
        Cache rows per (kernel) block ``S = block_size // R``.
    window : int or None
        Sliding window in tokens for windowed channels, else None.
    index_width : int or None
        Columns of the channel's per-token index list (capacity, never from the batch), or None when
        the channel has no index list of fixed width.
    outputs : frozenset of str
        Names of the ChannelMetadata fields the channel produces.
    compact : bool
        Compressed channels: also emit the compact compressed slot mapping (``compact_slot_mapping``
        ``[T_pad]`` with ``compact_cu [B + 1]``: the rows the step completes, request by request).
    builder : str or None
        Registry name of the builder class (:func:`dsv4_index.channels.register_channel`) when it
        differs from ``name`` (e.g. ``"swa"`` for the window channel ``"swa_1"`` of an SWA sub-group);
        also the channel's role for :meth:`DSV4Layout.layer_channels`.
    """

    name: str
    gid: int
    compress_ratio: int
    rows_per_block: int
    window: Optional[int] = None
    index_width: Optional[int] = None
    outputs: FrozenSet[str] = frozenset()
    compact: bool = False
    builder: Optional[str] = None

    @property
    def role(self) -> str:
        """Built-in role (``c4a``, ``c4i``, ``c128a``, ``swa``, ``c4_state``, ``c128_state``) or the name."""
        return self.builder or self.name

    def __post_init__(self):
        object.__setattr__(self, "outputs", frozenset(self.outputs))
        for name in ("compress_ratio", "rows_per_block"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} of channel {self.name!r} must be an int >= 1, got {v!r}")


@dataclass(frozen=True)
class RatioKind:
    """What one non-zero compress ratio of a config gives (:func:`ratio_kinds`).

    Attributes
    ----------
    ratio : int
        ``R``.
    kind : str
        ``"c4"``: read through the indexer's top-k (channels ``main`` + ``indexer``, builders ``c4a`` /
        ``c4i``); ``"c128"``: every visible row (channel ``main``, builder ``c128a``).
    main, indexer : str, str or None
        Channel names of the compressed cache and of the indexer (None for the c128 kind).
    state : str or None
        Role and default name of the compressor-state group (None for ``R = 1``: a ratio-1 row is one
        token, pooled from nothing; vLLM V4.1 has no state cache for it).
    state_window : int
        Window of the state group: ``2 R`` for the c4 kind (overlapping spans), ``R`` for the c128 kind.
    """

    ratio: int
    kind: str
    main: str
    indexer: Optional[str]
    state: Optional[str]
    state_window: int

    @property
    def state_builder(self) -> str:
        """Builder (and ``layer_channels`` role) of the state group's window channel."""
        return "c4_state" if self.kind == "c4" else "c128_state"


def ratio_kinds(ratios) -> Tuple[RatioKind, ...]:
    """The kind and channel names of every distinct non-zero ratio of ``compress_ratios``, ascending.

    DeepSeek-V4 (at most two ratios, none below 3): the smaller ratio is the indexed kind (``c4a``,
    ``c4i``, ``c4_state``), the larger the causal one (``c128a``, ``c128_state``), whatever their values;
    a single ratio ``R`` is the indexed kind if ``R <= 4``. The V4.1 family (a ratio of 1 or 2, or more
    than two ratios; docs/DESIGN.md §3): every ratio ``R <= 4`` is indexed, larger ones causal, and names carry
    the ratio (``c1a``, ``c1i``; ``c2a``, ``c2i``, ``c2_state``; ``c4a`` ...; ``c128a``, ``c128_state``).
    """
    distinct = sorted({int(r) for r in ratios if r > 0})
    if not distinct:
        return ()
    if any(r in LOW_RATIOS for r in distinct) or len(distinct) > 2:
        out = []
        for r in distinct:
            indexed = r <= INDEXED_MAX_RATIO
            out.append(RatioKind(r, "c4" if indexed else "c128", f"c{r}a", f"c{r}i" if indexed else None,
                                 f"c{r}_state" if r > 1 else None, 2 * r if indexed else r))
        return tuple(out)
    c4 = RatioKind(distinct[0], "c4", "c4a", "c4i", "c4_state", 2 * distinct[0])
    if len(distinct) == 2:
        return c4, RatioKind(distinct[1], "c128", "c128a", None, "c128_state", distinct[1])
    if distinct[0] <= INDEXED_MAX_RATIO:
        return (c4,)
    return (RatioKind(distinct[0], "c128", "c128a", None, "c128_state", distinct[0]),)


def parse_circular(circular) -> Tuple[Dict[str, int], Dict[str, int]]:
    """``from_config(circular=...)`` checked: (group -> capacity, group -> block size of a ring of
    several blocks). ValueError naming the entry."""
    circular = dict(circular or {})
    ring_bs = {}  # NOTE: group -> block size of a ring of several blocks
    for g, capacity in circular.items():
        if g in ("mla",) or not isinstance(g, str):
            raise ValueError(f"circular names {g!r}; only sliding groups (swa, c4_state, c128_state) "
                             f"can be circular")
        if isinstance(capacity, (tuple, list)):
            if len(capacity) != 2:
                raise ValueError(f"circular[{g!r}] must be a capacity or (capacity, block_size), "
                                 f"got {capacity!r}")
            cap = check_int(f"circular[{g!r}][0] (capacity)", capacity[0], lo=1)
            bs = check_int(f"circular[{g!r}][1] (block_size)", capacity[1], lo=1)
            if cap % bs:
                raise ValueError(f"circular[{g!r}] = {tuple(capacity)!r}: capacity {cap} is not a "
                                 f"multiple of block_size {bs}")
            circular[g] = cap
            if bs != cap:
                ring_bs[g] = bs
        else:
            check_int(f"circular[{g!r}]", capacity, lo=1)
    return circular, ring_bs
