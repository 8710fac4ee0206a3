"""Channel-builder protocol, its per-step context, its output record and the registry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Type

import torch

_REGISTRY: Dict[str, Type["ChannelBuilder"]] = {}


@dataclass
class ChannelMetadata:
    """One channel's view of a step. Tensors are views of persistent buffers (CUDA-graph safe);
    fields a channel does not produce are ``None``. ``T`` below is the padded token count.

    Attributes
    ----------
    slot_mapping : int64 [T] — raw slot written by each token (``-1`` for padded / unowned tokens).
    compressed_slot_mapping : int64 [T] — slot of the compressed row a token completes, else ``-1``.
    indices : int32 [T, width] — window (``swa``, state channels) or causal compressed list (``c128a``).
    lens : int32 [T] — valid entries of ``indices`` (for ``c4i``: visible compressed rows ``n_c``).
    ks, ke : int32 [T] — ragged indexer key ranges (``c4i``); cu : int32 [B + 1] — their request offsets.
    decode_lens : int32 [num_decodes, next_n] — right-aligned indexer lengths of decode rows (``c4i``).
    block_table : int32 [B, table_width] — the group's device block table rows of the batch.
    """

    name: str
    gid: int
    compress_ratio: int
    rows_per_block: int
    block_size: int
    window: Optional[int]
    block_table: torch.Tensor
    slot_mapping: Optional[torch.Tensor] = None
    compressed_slot_mapping: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None
    lens: Optional[torch.Tensor] = None
    ks: Optional[torch.Tensor] = None
    ke: Optional[torch.Tensor] = None
    cu: Optional[torch.Tensor] = None
    decode_lens: Optional[torch.Tensor] = None


@dataclass
class BuildContext:
    """What every builder reads: capacity, DCP rank, and the step's common device tensors.

    Device tensors are persistent buffers at capacity; ``update()`` refreshes them. Request arrays
    cover all ``max_num_reqs`` rows (rows past the batch are zero-length requests), so kernels see
    one shape every step.
    """

    layout: object
    device: torch.device
    max_num_reqs: int
    max_num_tokens: int
    num_speculative_tokens: int
    cp_world_size: int
    cp_rank: int
    cp_interleave: int
    query_start_loc: torch.Tensor   # int32 [max_num_reqs + 1]
    seq_lens: torch.Tensor          # int32 [max_num_reqs]
    replay_start: torch.Tensor      # int32 [max_num_reqs]
    block_tables: Tuple[torch.Tensor, ...]  # per gid: int32 [max_num_reqs, table_width]
    # host values of the current step (set by update())
    num_reqs: int = 0
    num_tokens: int = 0
    num_tokens_padded: int = 0
    num_decodes: int = 0
    # shared outputs: identical results computed once per step (e.g. c4a / c4i compressed slots)
    _shared: Dict[tuple, torch.Tensor] = field(default_factory=dict)
    _done: set = field(default_factory=set)

    @property
    def next_n(self) -> int:
        return 1 + self.num_speculative_tokens

    def cp_kwargs(self) -> dict:
        return dict(cp_world_size=self.cp_world_size, cp_rank=self.cp_rank, cp_interleave=self.cp_interleave)

    def shared_buffer(self, key: tuple, shape, dtype) -> torch.Tensor:
        """One persistent buffer per ``key``, shared by every builder that asks for it."""
        buf = self._shared.get(key)
        if buf is None:
            buf = torch.full(tuple(shape), -1, dtype=dtype, device=self.device)
            self._shared[key] = buf
        return buf

    def once(self, key: tuple, fn: Callable[[], None]) -> None:
        """Run ``fn`` the first time ``key`` is seen in this step (reset by :meth:`new_step`)."""
        if key not in self._done:
            self._done.add(key)
            fn()

    def new_step(self) -> None:
        self._done.clear()


class ChannelBuilder:
    """Base class of channel builders.

    A builder declares its channel (``spec``: gid, compress ratio, rows per block, window, outputs),
    allocates persistent buffers once in :meth:`allocate`, and fills them in :meth:`build`, which must
    do no host sync, no allocation and have no data-dependent shape (DESIGN §7).
    """

    def __init__(self, spec, layout):
        self.spec = spec
        self.layout = layout
        self.group = layout.groups[spec.gid]

    # geometry shortcuts
    @property
    def kernel_block_size(self) -> int:
        return self.group.block_size  # NOTE: GroupSpec.block_size is already the kernel block size

    def allocate(self, ctx: BuildContext) -> None:  # pragma: no cover - interface
        """Allocate every persistent buffer at capacity (``ctx.max_num_tokens``, ``ctx.max_num_reqs``)."""
        raise NotImplementedError

    def launch(self, ctx: BuildContext) -> None:  # pragma: no cover - interface
        """Launch the kernels that fill this step's outputs (skipped when a fused plan covers the channel)."""
        raise NotImplementedError

    def views(self, ctx: BuildContext) -> ChannelMetadata:  # pragma: no cover - interface
        """This step's outputs as views of the persistent buffers (no device work)."""
        raise NotImplementedError

    def build(self, ctx: BuildContext) -> ChannelMetadata:
        self.launch(ctx)
        return self.views(ctx)

    def topk_to_slots(self, ctx: BuildContext, topk: torch.Tensor):
        raise ValueError(f"channel {self.spec.name!r} does not convert top-k indices")

    def _meta(self, ctx: BuildContext, **outputs) -> ChannelMetadata:
        s = self.spec
        return ChannelMetadata(name=s.name, gid=s.gid, compress_ratio=s.compress_ratio,
                               rows_per_block=s.rows_per_block, block_size=self.kernel_block_size,
                               window=s.window, block_table=ctx.block_tables[s.gid][:ctx.num_reqs], **outputs)


def register_channel(name: str, builder: Optional[Type[ChannelBuilder]] = None, *, replace: bool = False):
    """Register the builder class of channel ``name`` (usable as a decorator).

    The pipeline builds every channel of its layout with the class registered under the channel's name.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, ChannelBuilder)):
            raise ValueError(f"builder for {name!r} must be a ChannelBuilder subclass, got {cls!r}")
        if name in _REGISTRY and _REGISTRY[name] is not cls and not replace:
            raise ValueError(f"channel {name!r} is already registered to {_REGISTRY[name].__name__}; "
                             "pass replace=True to override")
        _REGISTRY[name] = cls
        return cls

    return deco if builder is None else deco(builder)


def registered_channels() -> Dict[str, Type[ChannelBuilder]]:
    return dict(_REGISTRY)


def builder_for(spec, layout) -> ChannelBuilder:
    cls = _REGISTRY.get(spec.name)
    if cls is None:
        raise ValueError(f"no builder registered for channel {spec.name!r}; "
                         f"known: {sorted(_REGISTRY)} (use register_channel)")
    return cls(spec, layout)
