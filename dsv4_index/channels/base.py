# over 400 lines: the channel protocol read top to bottom (output record, build context and query batch, base, registry)
"""Channel builders: the protocol, its per-pipeline context, its output record and the registry.

A builder owns one channel (one cache that reads a group's block table): it allocates the
channel's persistent buffers, says what it contributes to the one fused launch of a step
(:meth:`ChannelBuilder.fused_tasks`, descriptors of :mod:`dsv4_index.fused.tasks`), launches the
per-op kernels when unfused (:meth:`ChannelBuilder.launch`), returns its views
(:meth:`ChannelBuilder.views`) and states what its outputs must equal
(:meth:`ChannelBuilder.expected`, from the references). The pipeline and the fused plan know no
builder class.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple, Type

import torch

from ..fused.tasks import FusedTask
from ..query_batch import QueryBatch, fill_q_to_src, staged_qsl_q
from ..specs import ChannelSpec

if TYPE_CHECKING:
    from ..geometry import DSV4Layout

__all__ = ["BuildContext", "ChannelBuilder", "ChannelMetadata", "register_channel", "registered_channels",
           "builder_for"]

_REGISTRY: Dict[str, Type["ChannelBuilder"]] = {}


@dataclass
class ChannelMetadata:
    """One channel's view of a step. Tensors are views of persistent buffers (CUDA-graph safe);
    fields a channel does not produce are ``None``. ``T`` is the padded token count ``T_pad``,
    ``B`` the batch rows.

    Attributes
    ----------
    slot_mapping : int64 [T] — raw slot written by each token (``-1``: padded / unowned / replayed). For
        a circular group it is the address map of every token: ring row ``p = pos % capacity`` at
        ``bt[p // block_size] * block_size + p % block_size`` (``bt[0] * capacity + p`` for a ring of one
        block; two tokens of a chunk longer than the capacity share a slot).
    tail_slot_mapping : int64 [T] — circular groups only: the write plan, the same slot for the last
        ``capacity`` tokens of each request's chunk (``pos >= seq_len - capacity``), ``-1`` before them
        and for padded tokens; distinct slots. Write the ring with this one, after the step's reads.
    compressed_slot_mapping : int64 [T] — slot of the compressed row a token completes, else ``-1``.
    compact_slot_mapping : int64 [T] — the rows the step completes, request by request (``-1`` after
        ``compact_cu[B]``); compact_cu : int32 [B + 1].
    indices : int32 [T, width] — window (``swa``, state channels) or causal compressed list (``c128a``).
        Circular groups split each window at the request's chunk start ``s``: an entry ``x >= 0`` is a
        ring slot (a position before ``s``), an entry ``x <= -2`` is the step's own token row
        ``-2 - x`` (a position ``p >= s``, row ``query_start + p - s``), ``-1`` is padding.
    lens : int32 [T] — valid entries of ``indices`` (for ``c4i``: visible compressed rows ``n_c``).
    ks, ke : int32 [T] — ragged indexer key ranges (``c4i``); cu : int32 [B + 1] — their request offsets.
    decode_lens : int32 [num_decodes, next_n] — right-aligned indexer lengths of decode rows (``c4i``).
    lens_clamped, decode_lens_clamped — ``max(x, 1)`` copies of ``lens`` / ``decode_lens`` (``c4i``), for
        DeepGEMM-style consumers that crash on zero lengths (docs/DESIGN.md §10); padded rows read 1.
    block_table : int32 [max_num_reqs, cols] — the group's device table, indexed by request slot
        (batch row ``b`` reads row ``idx_mapping[b]``); a ring for ring groups (``ring_cols > 0``).
    """

    name: str
    gid: int
    compress_ratio: int
    rows_per_block: int
    block_size: int
    window: Optional[int]
    block_table: torch.Tensor
    idx_mapping: torch.Tensor
    ring_cols: int = 0
    slot_mapping: Optional[torch.Tensor] = None
    tail_slot_mapping: Optional[torch.Tensor] = None
    compressed_slot_mapping: Optional[torch.Tensor] = None
    compact_slot_mapping: Optional[torch.Tensor] = None
    compact_cu: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None
    lens: Optional[torch.Tensor] = None
    ks: Optional[torch.Tensor] = None
    ke: Optional[torch.Tensor] = None
    cu: Optional[torch.Tensor] = None
    decode_lens: Optional[torch.Tensor] = None
    lens_clamped: Optional[torch.Tensor] = None
    decode_lens_clamped: Optional[torch.Tensor] = None


@dataclass
class BuildContext:
    """What every builder reads: capacities, DCP, the group tables and the step's common buffers.

    Persistent device buffers are allocated once at capacity (``T_max = max_num_batched_tokens``);
    the per-step host values are set by ``update()``. Per-request buffers hold ``T_pad + 1`` rows
    (a batch never has more rows than tokens): rows past the batch are zero-length requests.
    """

    layout: DSV4Layout
    device: torch.device
    max_num_reqs: int
    max_num_tokens: int
    next_n: int
    cp_world_size: int
    cp_rank: int
    cp_interleave: int
    tables: Tuple[torch.Tensor, ...]          # per gid: int32 [max_num_reqs, cols]
    ring_cols: Tuple[int, ...]                # per gid: ring width or 0
    query_start_loc: torch.Tensor             # int32 [T_max + 1]
    seq_lens: torch.Tensor                    # int32 [T_max + 1]
    idx_mapping: torch.Tensor                 # int32 [T_max + 1]: request slot of each batch row
    replay_start: torch.Tensor                # int32 [T_max + 1] (unfused path)
    replay_end: torch.Tensor                  # int32 [T_max + 1] (unfused path)
    token_to_req: torch.Tensor                # int32 [T_max]
    positions: torch.Tensor                   # int64 [T_max]
    is_valid_token: torch.Tensor              # bool [T_max]
    backend: Optional[str] = None             # functional-op backend of the unfused path
    # host values of the current step
    num_reqs: int = 0
    num_tokens: int = 0
    num_tokens_padded: int = 0
    num_decodes: int = 0
    has_replay_start: bool = False
    has_replay_end: bool = False
    _token_ids: Optional[torch.Tensor] = None
    _shared: Dict[tuple, torch.Tensor] = field(default_factory=dict)
    _done: set = field(default_factory=set)
    staged_inputs: List[Callable] = field(default_factory=list)  # per-request host arrays, in stage order
    _staged_keys: Dict[tuple, int] = field(default_factory=dict)
    # the query batch of a step declaring source rows != query rows (query_batch.py; None: the plain step)
    query: Optional[QueryBatch] = None
    query_start_loc_q: torch.Tensor = field(init=False)  # int32 [T_max + 1]
    token_to_req_q: torch.Tensor = field(init=False)     # int32 [T_max]
    q_to_src: torch.Tensor = field(init=False)           # int32 [T_max]
    qsl_q_index: int = field(init=False)                 # the staged query_start_loc_q (extra array)

    def __post_init__(self):
        T, dev, i32 = self.max_num_tokens, self.device, torch.int32
        self.query_start_loc_q = torch.zeros(T + 1, dtype=i32, device=dev)
        self.token_to_req_q = torch.zeros(T, dtype=i32, device=dev)
        self.q_to_src = torch.full((T,), -1, dtype=i32, device=dev)
        self.qsl_q_index = self.staged_input(("query_start_loc_q",), functools.partial(staged_qsl_q,
                                                                                     source=lambda: self.query))

    # -- the query batch (docs/DESIGN.md §5 "Source rows ≠ query rows") --------------------------
    @property
    def num_query_tokens(self) -> int:
        """``T_q`` (``T`` for a plain step)."""
        return self.num_tokens if self.query is None else self.query.num_tokens

    @property
    def num_query_tokens_padded(self) -> int:
        """``T_q_pad``: rows of every query-side output (``T_pad`` for a plain step)."""
        return self.num_tokens_padded if self.query is None else self.query.num_tokens_padded

    def query_qsl(self) -> torch.Tensor:
        """int32 ``[B + 1]``: ``query_start_loc`` of the query batch (the source batch's for a plain step)."""
        B = self.num_reqs
        return self.query_start_loc[:B + 1] if self.query is None else self.query_start_loc_q[:B + 1]

    def fill_query(self, qsl_q: torch.Tensor) -> None:
        """A declared step: ``query_start_loc_q`` from ``qsl_q`` (int32 ``[B + 1]``, e.g. the staged array), then
        ``token_to_req_q`` and ``q_to_src`` of ``[0, T_q_pad)`` (torch ops; the source batch's
        ``query_start_loc`` must be on the device already)."""
        from ..ops import token_to_req
        B, Tq, Tqp = self.num_reqs, self.num_query_tokens, self.num_query_tokens_padded
        q = self.query_start_loc_q
        q[:B + 1].copy_(qsl_q[:B + 1])
        q[:1].zero_()  # NOTE: the staged entry 0 is the step's flag (query_batch.STAGED_*)
        q[B + 1:Tqp + 1].fill_(Tq)
        ttr = token_to_req(q[:B + 1], Tqp, out=self.token_to_req_q[:Tqp], backend=self.backend)
        if self._token_ids is None:  # NOTE: once, at capacity (warmup): later builds allocate nothing
            self._token_ids = torch.arange(self.max_num_tokens, device=self.device)
        fill_q_to_src(self.query_start_loc[:B + 1], q[:B + 1], ttr, Tq, self.q_to_src[:Tqp], self._token_ids)

    def staged_input(self, key: tuple, fill: Callable) -> int:
        """Declare a per-request int32 array ``[B + 1]`` staged with every step (at ``allocate``).

        ``fill(seq_lens, num_scheduled, out)`` computes it on the host (numpy; ``seq_lens`` and
        ``num_scheduled`` int64 ``[B]`` in batch order, ``out`` int32 ``[B + 1]``); keep its formula
        beside the op's reference. Returns the array's index in the staging buffer's extra region (the
        ``extra`` of a :class:`~dsv4_index.fused.tasks.FusedTask`); builders declaring the same
        ``key`` share one array.
        """
        i = self._staged_keys.get(key)
        if i is None:
            i = self._staged_keys[key] = len(self.staged_inputs)
            self.staged_inputs.append(fill)
        return i

    def set_step(self, plan) -> None:
        """The host values of an accepted step (called by ``update()``)."""
        self.num_reqs, self.num_tokens = plan.slots.shape[0], plan.num_tokens
        self.num_tokens_padded, self.num_decodes = int(plan.num_tokens_padded), int(plan.num_decodes)
        self.has_replay_start, self.has_replay_end = plan.replay_start is not None, plan.replay_end is not None

    def query_tasks(self) -> List[FusedTask]:
        """The fused launch's query-batch map (``query_start_loc_q``, ``token_to_req_q``, ``q_to_src``; written
        for a declared step only: fused/query.py)."""
        return [FusedTask("query_map", (self.token_to_req_q, self.q_to_src), extra=self.qsl_q_index),
                FusedTask("query_qsl", (self.query_start_loc_q,), extra=self.qsl_q_index)]

    def query_token_map(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(token_to_req int32 [T_q_pad], is_valid bool [T_q_pad])`` of the query batch (the source batch's
        tensors for a plain step; unfused path)."""
        Tqp = self.num_query_tokens_padded
        if self.query is None:
            return self.token_to_req[:Tqp], self.is_valid_token[:Tqp]
        if self._token_ids is None:  # NOTE: once, at capacity: later builds allocate nothing
            self._token_ids = torch.arange(self.max_num_tokens, device=self.device)
        return self.token_to_req_q[:Tqp], self._token_ids[:Tqp] < self.num_query_tokens

    def group_cp(self, gid: int) -> Tuple[int, int, int]:
        """(world, rank, interleave) that applies to group ``gid`` ((1, 0, 1) when replicated)."""
        g = self.layout.groups[gid]
        if self.cp_world_size > 1 and g.sharded:
            return self.cp_world_size, self.cp_rank, self.cp_interleave
        return 1, 0, 1

    def cp_kwargs(self, gid: int) -> dict:
        w, r, i = self.group_cp(gid)
        return dict(cp_world_size=w, cp_rank=r, cp_interleave=i)

    def shared_buffer(self, key: tuple, shape, dtype) -> torch.Tensor:
        """One persistent buffer per ``key``, shared by every builder that asks for it."""
        buf = self._shared.get(key)
        if buf is None:
            buf = torch.full(tuple(shape), -1, dtype=dtype, device=self.device)
            self._shared[key] = buf
        return buf

    def begin_build(self) -> None:
        """Start a build (the shared outputs of the unfused path are computed once per build)."""
        self._done.clear()

    def fill_requests(self, stage: torch.Tensor, lay) -> None:
        """Unfused path: the per-request and per-token common tensors of this step from the device
        staging buffer ``stage`` (layout ``lay``, ``state/staging.py``), with torch ops."""
        B, T, Tp = self.num_reqs, self.num_tokens, self.num_tokens_padded
        self.query_start_loc[:B + 1].copy_(stage[lay.qsl:lay.qsl + B + 1])
        self.query_start_loc[B + 1:Tp + 1].fill_(T)
        for dst, off, on in ((self.seq_lens, lay.seq_lens, True), (self.idx_mapping, lay.slots, True),
                             (self.replay_start, lay.replay_start, self.has_replay_start),
                             (self.replay_end, lay.replay_end, self.has_replay_end)):
            if on:
                dst[:B].copy_(stage[off:off + B])
                dst[B:Tp + 1].zero_()
            else:
                dst[:Tp + 1].zero_()
        self.fill_token_map()

    def fill_token_map(self) -> None:
        """``token_to_req``, ``is_valid_token`` and ``positions`` of ``[0, T_pad)`` from this step's
        ``query_start_loc`` and ``seq_lens`` (torch ops; the unfused path and the host checker)."""
        from ..ops import token_to_req
        B, T, Tp = self.num_reqs, self.num_tokens, self.num_tokens_padded
        qsl = self.query_start_loc[:B + 1]
        ttr = token_to_req(qsl, Tp, out=self.token_to_req[:Tp], backend=self.backend)
        if self._token_ids is None:  # NOTE: once, at capacity (warmup): later builds allocate nothing
            self._token_ids = torch.arange(self.max_num_tokens, device=self.device)
        t = self._token_ids[:Tp]
        valid = torch.lt(t, T, out=self.is_valid_token[:Tp])
        b = ttr.long()
        pos = self.positions[:Tp]
        if B:
            torch.add(self.seq_lens[b].long() - self.query_start_loc[b + 1].long(), t, out=pos)
        pos.masked_fill_(~valid, 0)

    def once(self, key: tuple) -> bool:
        """True the first time ``key`` is seen in this step (unfused path: shared outputs)."""
        if key in self._done:
            return False
        self._done.add(key)
        return True


class ChannelBuilder:
    """Base class of channel builders (subclass it and :func:`register_channel` the class).

    Required: :meth:`allocate`, :meth:`launch`, :meth:`views`. Optional:
    :meth:`launch_query` with :attr:`query_batch` (outputs per query token: a step declaring source rows != query
    rows, docs/DESIGN.md §5; a builder without it refuses such steps),
    :meth:`fused_tasks` (join the one fused launch; default: none, so :meth:`launch` runs),
    per-request host arrays staged with the step (declare them with :meth:`BuildContext.staged_input`
    in :meth:`allocate`),
    :attr:`int32_unit`, :meth:`expected` (used by :mod:`dsv4_index.validate`), :meth:`topk_to_slots`.
    Device work must do no host sync, no allocation and have no data-dependent shape (docs/DESIGN.md §7).
    """

    #: True when the builder knows the query batch (:meth:`launch_query`); a pipeline with a builder where it is
    #: False refuses a step declaring ``query_lens``
    query_batch: bool = False

    def __init__(self, spec: ChannelSpec, layout: DSV4Layout):
        self.spec = spec
        self.layout = layout
        self.group = layout.groups[spec.gid]

    @property
    def kernel_block_size(self) -> int:
        return self.group.block_size  # NOTE: GroupSpec.block_size is the kernel block size

    @property
    def int32_unit(self) -> int:
        """Slots per block of the group that the channel's int32 index lists address (block size for
        window lists, rows per block for compressed lists); 1 when it writes int64 slots only."""
        return 1

    # -- required ----------------------------------------------------------------------------
    def allocate(self, ctx: BuildContext) -> None:  # pragma: no cover - interface
        """Allocate every persistent buffer at capacity (``ctx.max_num_tokens`` rows)."""
        raise NotImplementedError

    def launch(self, ctx: BuildContext) -> None:  # pragma: no cover - interface
        """Unfused path: fill this step's outputs with the functional ops (``ctx.backend``)."""
        raise NotImplementedError

    def views(self, ctx: BuildContext) -> ChannelMetadata:  # pragma: no cover - interface
        """This step's outputs as views of the persistent buffers (no device work)."""
        raise NotImplementedError

    # -- optional ----------------------------------------------------------------------------
    def launch_query(self, ctx: BuildContext) -> None:
        """The outputs per query token (``[0, T_q_pad)``) over the query batch (``ctx.query_qsl()``, ``T_q``),
        functional ops; :meth:`launch` calls it (the fused launch builds them itself from tasks flagged
        ``query``: fused/query.py). Default: no such outputs."""

    def query_fields(self) -> frozenset:
        """The :class:`ChannelMetadata` fields with a row per query token (``[T_q_pad]`` rows) when a step declares
        source rows != query rows; every other field has a row per source token. Default: none."""
        return frozenset()

    def fused_tasks(self, ctx: BuildContext) -> List[FusedTask]:
        """This channel's share of the one fused launch (identical tasks of several builders run
        once); an empty list keeps the channel on its own :meth:`launch`."""
        return []

    def expected(self, host_ctx: BuildContext) -> ChannelMetadata:
        """What this step's outputs must equal: :meth:`launch` run by a fresh builder of the same
        class on ``host_ctx`` (host copies of the step, PyTorch references; see
        :func:`dsv4_index.validate.host_context`). Override for outputs ``launch`` does not state."""
        twin = type(self)(self.spec, self.layout)
        twin.allocate(host_ctx)
        twin.launch(host_ctx)
        return twin.views(host_ctx)

    def topk_to_slots(self, ctx: BuildContext, topk: torch.Tensor, *, compact: bool = False):
        raise ValueError(f"channel {self.spec.name!r} does not convert top-k indices")

    # -- helpers -----------------------------------------------------------------------------
    def required(self, field: str) -> int:
        """``spec.<field>`` (``window``, ``index_width``) of a builder that needs it (at ``allocate``);
        ``ValueError`` naming the field and the channel when it is None."""
        v = getattr(self.spec, field)
        if v is None:
            raise ValueError(f"spec.{field} of channel {self.spec.name!r} is None; its builder "
                             f"{type(self).__name__} needs it")
        return v

    def batch_args(self, ctx: BuildContext) -> dict:
        """Keyword arguments of the functional ops for this step (unfused path)."""
        B = ctx.num_reqs
        return dict(idx_mapping=ctx.idx_mapping[:B], num_tokens=ctx.num_tokens, backend=ctx.backend,
                    **ctx.cp_kwargs(self.spec.gid))

    def query_args(self, ctx: BuildContext) -> dict:
        """Keyword arguments of the functional ops over the query batch (unfused path)."""
        return dict(self.batch_args(ctx), num_tokens=ctx.num_query_tokens)

    def meta(self, ctx: BuildContext, **outputs) -> ChannelMetadata:
        s = self.spec
        return ChannelMetadata(name=s.name, gid=s.gid, compress_ratio=s.compress_ratio,
                               rows_per_block=s.rows_per_block, block_size=self.kernel_block_size,
                               window=s.window, block_table=ctx.tables[s.gid],
                               idx_mapping=ctx.idx_mapping[:ctx.num_reqs], ring_cols=ctx.ring_cols[s.gid],
                               **outputs)


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


def builder_for(spec: ChannelSpec, layout: DSV4Layout) -> ChannelBuilder:
    builder = getattr(spec, "builder", None)
    cls = _REGISTRY.get(spec.name) or (None if builder is None else _REGISTRY.get(builder))
    if cls is None:
        raise ValueError(f"no builder registered for channel {spec.name!r}; "
                         f"known: {sorted(_REGISTRY)} (use register_channel)")
    return cls(spec, layout)
