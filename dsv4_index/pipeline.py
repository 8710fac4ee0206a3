# over 400 lines: the composer of one step (constructor, update, build, warmup and the views they hand out)
"""The per-step metadata pipeline (docs/DESIGN.md §5): scheduler output in, per-channel device metadata out.

::

    pipe = MetadataPipeline(layout, max_num_reqs=256, max_num_batched_tokens=8192, device="cuda")
    pipe.warmup()
    for step in scheduler:                 # StepInput (ids) or StepBatch (arrays, the fast path)
        pipe.update(step)                  # host: checks, then state + ONE staged H2D copy
        meta = pipe.build()                # device: one fused launch, no host sync
        out = model(hidden, meta)          # meta["swa"].indices, meta["c128a"].lens, meta.topk_to_slots(...)

The composer only wires its owners: request-slot state (:mod:`.state.requests`), block tables (:mod:`.state.tables`),
the checks (:mod:`.state.plan`), the staging buffer (:mod:`.state.staging`), the builders
(:mod:`.channels`) and the fused plan (:mod:`.fused.plan`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ._common import check_device, use_triton
from .batch import StepBatch
from .capacity import check_arguments, check_flags, memory_estimate
from .engine_plan import check_block_counts
from .channels import BuildContext, ChannelBuilder, ChannelMetadata, builder_for
from .fused.plan import FusedPlan
from .fused.tasks import FusedTask, plain_tasks
from .aliasing import check_pipeline_buffers, check_step_outputs
from .metadata import DSV4Metadata, StepStats
from .query_batch import build_query, meta_query_fields, plan_query, refuse_declared
from .geometry import DSV4Layout
from .streams import check_stream, on_stream
from ._numba import compile_pinned
from .frontend import StepInput, batch_from_scheduler_output, batch_from_step, explain
from .frontend.row_order import check_caller_order, check_row_order
from .state import BlockTables, RequestState, StepPlan, StepStaging
from .state.requests import RowIds, SlotMap

__all__ = ["MetadataPipeline"]


class MetadataPipeline:
    """Request slots + block tables per group + one builder per channel + one fused launch.

    Parameters
    ----------
    layout : DSV4Layout — groups and channels (``DSV4Layout.from_config``).
    max_num_reqs : int — request slots (rows of every block table).
    max_num_batched_tokens : int — token capacity of every per-token buffer (padding included).
    device : str or torch.device.
    num_speculative_tokens : int — a request is a decode when it schedules at most ``1 + this`` tokens
        (one threshold for every channel).
    cp_world_size, cp_rank, cp_interleave : decode context parallelism (docs/DESIGN.md §4), applied to the
        groups the layout marks ``sharded``.
    fused : bool — one fused Triton launch per build when the Triton backend is in use; False
        launches each channel's functional ops (same results), circular groups of several blocks included.
    checks : {"safe", "full"} — host check level of ``update()`` (``state/plan.py``; ``"full"`` adds the
        contract checks of ``state/contract.py``: no duplicate ids in a full group's row, no null block
        where a step reads or writes); ``validate=True`` implies ``"full"``.
    validate : bool — debug: full checks, the compiled step checks compared with their definition on every
        step (``AssertionError`` on a difference), and :func:`dsv4_index.validate.check_metadata` after every
        ``build()`` (host copies; never in serving).
    max_staged_blocks : int, optional — block ids one step may stage (default: every table entry,
        capped at 2**20; at most 2**26, and never more than the tables hold); a step staging more is
        rejected.
    backend : {None, "triton", "reference"} — functional-op backend (default: Triton on CUDA or under
        the interpreter, the PyTorch reference otherwise).
    cuda_graphs : bool — CUDA only, every channel fused: ``build()`` replays a CUDA graph of the fused
        launch, one per padded token count (captured on first use, or by ``warmup(pad_sizes=...)``).
    row_order : "decode_first" (default: the pipeline orders rows decode-first) or "caller" (``meta`` row ``i``
        is the step's row ``i``; a step not decode-first is refused naming the row: :mod:`.frontend.row_order`).
    stream : torch.cuda.Stream, optional — CUDA only: ``update()``'s copy, ``build()`` and ``warmup()`` run on it
        whatever stream is current (default None: the current stream at each call; :mod:`.streams`).
    query_batches : bool — accept steps declaring ``query_lens`` (source rows != query rows, V4.1's decoder-suffix
        replay: docs/DESIGN.md §5). Default False: such a step is refused (``ValueError``, the pipeline unchanged)
        and the fused kernel compiles no query code (V4-Flash: 0.56-0.61 of the PTX, about a third of the compile
        time of ``warmup()``'s kernels); plain steps are byte-identical either way.
    """

    def __init__(self, layout: DSV4Layout, max_num_reqs: int, max_num_batched_tokens: int, device="cpu",
                 num_speculative_tokens: int = 0, *, cp_world_size: int = 1, cp_rank: int = 0,
                 cp_interleave: int = 1, fused: bool = True, checks: str = "safe", validate: bool = False,
                 max_staged_blocks: Optional[int] = None, backend: Optional[str] = None,
                 cuda_graphs: bool = False, row_order: str = "decode_first",
                 stream: Optional[torch.cuda.Stream] = None, query_batches: bool = False):
        check_arguments(layout, max_num_reqs, max_num_batched_tokens, num_speculative_tokens, max_staged_blocks,
                         (cp_world_size, cp_rank, cp_interleave), checks)
        check_flags(fused=fused, validate=validate, cuda_graphs=cuda_graphs, query_batches=query_batches)
        self.query_batches = bool(query_batches)
        self.row_order = check_row_order(row_order)
        self.layout = layout
        self.device = check_device(device)
        self.stream = check_stream(stream, self.device)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = T = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.cp = (cp_world_size, cp_rank, cp_interleave)
        self.validate = bool(validate)
        self.checks = "full" if validate else checks
        self._count_rule = layout.cp_world_size <= 1 and any(g.layers is not None for g in layout.groups)
        self.slot_map = SlotMap(max_num_reqs, replay_reach=max([(g.window or 1) - 1 for g in layout.groups], default=0),
                                replay_window=max([g.window or 0 for g in layout.groups if g.role == "swa"], default=0))

        self._builders = {name: builder_for(spec, layout) for name, spec in layout.channels.items()}
        units = [max([1] + [b.int32_unit for b in self._builders.values() if b.spec.gid == g])
                 for g in range(len(layout.groups))]
        compressed = tuple(sorted({(s.gid, s.compress_ratio, s.rows_per_block)
                                   for s in layout.channels.values() if s.compress_ratio > 1}))
        self.tables = BlockTables(layout.groups, max_num_reqs, T, self.device, units,
                                  max_model_len=getattr(layout, "max_model_len", None), compressed=compressed)
        self.ctx = self._build_context(backend)
        for b in self._builders.values():
            b.allocate(self.ctx)  # NOTE: builders declare their staged per-request inputs here
        # NOTE: a step never stages more ids than the tables hold
        cap = min(self.tables.total, 1 << 20 if max_staged_blocks is None else max_staged_blocks)
        self.max_staged_blocks = max(int(cap), 1)
        self.staging = StepStaging(self.device, T, len(layout.groups), len(self.ctx.staged_inputs),
                                   self.max_staged_blocks, max_num_reqs)
        self.requests = RequestState(max_num_reqs, self.tables, cp=self.cp, max_num_tokens=T,
                                     max_writes=self.max_staged_blocks, next_n=1 + num_speculative_tokens,
                                     level=self.checks, cross_check=self.validate)

        self._fused, self._unfused = self._plan_launches(fused and use_triton(self.device, backend))
        if cuda_graphs and (self._fused is None or self._unfused or self.device.type != "cuda"):
            raise ValueError("cuda_graphs needs a CUDA device and every channel in the fused launch")
        self._graphs: Optional[Dict[int, torch.cuda.CUDAGraph]] = {} if cuda_graphs else None
        self._plan: Optional[StepPlan] = None
        self._req_ids: Optional[RowIds] = None
        self._views: Optional[Tuple[Tuple[int, ...], Dict[str, ChannelMetadata], Dict[str, Any]]] = None
        self._converters = {name: (lambda topk, compact=False, _b=b: _b.topk_to_slots(self.ctx, topk, compact=compact))
                            for name, b in self._builders.items()
                            if type(b).topk_to_slots is not ChannelBuilder.topk_to_slots}
        self._num_launches = (1 if self._fused else 0) + len(self._unfused)
        self.last_step_stats = StepStats()
        self._last_batch: Optional[tuple] = None
        check_pipeline_buffers(self)  # NOTE: no two buffers a launch writes share storage (aliasing.py)
        self._outputs_checked = False

    def _build_context(self, backend: Optional[str]) -> BuildContext:
        """The builders' context: capacities, DCP, the tables and the step's common device buffers."""
        dev, i32, T = self.device, torch.int32, self.max_num_tokens
        world, rank, interleave = self.cp
        return BuildContext(
            layout=self.layout, device=dev, max_num_reqs=self.max_num_reqs, max_num_tokens=T,
            next_n=1 + self.num_speculative_tokens, cp_world_size=world, cp_rank=rank,
            cp_interleave=interleave, tables=tuple(self.tables.tables),
            ring_cols=tuple(int(r) for r in self.tables.ring),
            query_start_loc=torch.zeros(T + 1, dtype=i32, device=dev),
            seq_lens=torch.zeros(T + 1, dtype=i32, device=dev),
            idx_mapping=torch.zeros(T + 1, dtype=i32, device=dev),
            replay_start=torch.zeros(T + 1, dtype=i32, device=dev),
            replay_end=torch.zeros(T + 1, dtype=i32, device=dev), token_to_req=torch.zeros(T, dtype=i32, device=dev),
            positions=torch.zeros(T, dtype=torch.int64, device=dev),
            is_valid_token=torch.zeros(T, dtype=torch.bool, device=dev), backend=backend)

    def _plan_launches(self, fuse: bool) -> Tuple[Optional[FusedPlan], List[ChannelBuilder]]:
        """``(fused plan or None, builders launched one by one)``: with ``fuse``, every builder that
        declares fused tasks joins the one fused launch (after the common, request and replay tasks); without
        ``query_batches`` the launch has no query task (:func:`~dsv4_index.fused.tasks.plain_tasks`)."""
        if not fuse:
            return None, list(self._builders.values())
        ctx = self.ctx
        tasks = [FusedTask("common", (ctx.token_to_req, ctx.positions, ctx.is_valid_token)),
                 FusedTask("requests", (ctx.query_start_loc, ctx.seq_lens, ctx.idx_mapping)),
                 FusedTask("replays", (ctx.replay_start, ctx.replay_end)), *ctx.query_tasks()]
        unfused = []
        for b in self._builders.values():
            t = b.fused_tasks(ctx)
            if t:
                tasks += t
            else:
                unfused.append(b)
        if not self.query_batches:
            tasks = plain_tasks(tasks)
        return FusedPlan(tasks, self.tables, ctx.group_cp, self.staging.dev, ctx.next_n), unfused

    @classmethod
    def memory_estimate(cls, layout, max_num_reqs: int, max_num_batched_tokens: int, device="cpu",
                        num_speculative_tokens: int = 0, *, cp_world_size: int = 1, cp_rank: int = 0,
                        cp_interleave: int = 1, fused: bool = True, checks: str = "safe", validate: bool = False,
                        max_staged_blocks: Optional[int] = None, backend: Optional[str] = None,
                        cuda_graphs: bool = False, query_batches: bool = False) -> dict:
        """Bytes a pipeline of these arguments (the constructor's) allocates, computed without allocating:
        ``{"device", "host", "pinned", "parts"}`` (:func:`dsv4_index.capacity.memory_estimate`). Every
        argument is checked as the constructor checks it (the same ``ValueError`` / ``TypeError``; an unknown
        keyword is a ``TypeError``), except that a CUDA ``device`` need not exist here (planning on a host
        without one); ``fused``, ``validate``, ``query_batches`` change no allocation."""
        cp = (cp_world_size, cp_rank, cp_interleave)
        check_arguments(layout, max_num_reqs, max_num_batched_tokens, num_speculative_tokens, max_staged_blocks,
                         cp, checks)
        check_flags(fused=fused, validate=validate, cuda_graphs=cuda_graphs, query_batches=query_batches)
        dev = check_device(device, available=False)
        use_triton(dev, backend)  # NOTE: the constructor's backend check
        if cuda_graphs and dev.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device and every channel in the fused launch")
        return memory_estimate(layout, max_num_reqs, max_num_batched_tokens, dev, num_speculative_tokens,
                               cp_world_size=cp_world_size, cp_rank=cp_rank, cp_interleave=cp_interleave,
                               max_staged_blocks=max_staged_blocks)

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    @on_stream
    def update(self, step, *, pad_to: Optional[int] = None) -> None:
        """Apply one scheduler step on the host and stage it for the device (ONE H2D copy).

        Parameters
        ----------
        step : StepBatch, StepInput or a vLLM-style ``SchedulerOutput`` (duck-typed: has
            ``scheduled_new_reqs``) — the array form (the caller owns the slots), or id-keyed
            (converted through the pipeline's slot map, committed only once the step is accepted).
        pad_to : int, optional — pad the token count to this size (a CUDA-graph batch size); padded
            tokens are invalid (``-1`` slots and rows, ``0`` lengths).

        Raises ValueError naming the culprit; the pipeline is then exactly as it was (tables,
        request state, slot map, staging). A step declaring ``query_lens`` needs ``query_batches=True``.
        """
        delta, src = None, ""  # NOTE: src (the id-keyed form's name) is set with delta
        if type(step) is StepBatch:
            batch = step
        elif isinstance(step, StepInput):
            (batch, delta), src = batch_from_step(step, self.slot_map, len(self.layout.groups)), "step"
        elif hasattr(step, "scheduled_new_reqs"):
            (batch, delta), src = (batch_from_scheduler_output(step, self.slot_map, len(self.layout.groups)),
                                   "scheduler_output")
        elif isinstance(step, StepBatch):
            batch = step
        else:
            raise ValueError(f"step must be a StepBatch, a StepInput or a SchedulerOutput, got {type(step).__name__} "
                             "(no attribute 'scheduled_new_reqs', which a SchedulerOutput has)")
        if not self.query_batches:
            refuse_declared(batch)
        try:
            if self.row_order == "caller":  # NOTE: frontend/row_order.py; the default path skips it
                check_caller_order(batch, self.ctx.next_n, None if delta is None else delta.order)
            if self._count_rule:  # NOTE: engine group plans, no DCP (check_block_counts); first: it names the groups
                try:
                    check_block_counts(self.layout, batch)
                except (IndexError, TypeError, AttributeError):
                    pass  # NOTE: malformed arrays: the plan's checks below name the field
            plan = self.requests.plan(batch, pad_to)
            plan_query(batch, plan, pad_to, self._builders, self.ctx)  # NOTE: last check; sets ctx.query (DESIGN §5)
        except ValueError as e:
            named = e if delta is None else explain(e, batch, delta, src)  # NOTE: id-keyed: name the request
            if named is e:
                raise
            raise named from e
        # NOTE: every check passed; from here on nothing raises
        applies = int(self.staging.pending_writes > 0)
        if applies:
            self.staging.apply_pending(self.tables.flat)  # the previous step was staged but never built
        self.tables.commit(plan)
        self.requests.commit(plan)
        if delta is not None:
            self.slot_map.commit(delta)
        self._req_ids = None if delta is None else self.slot_map.row_ids(plan.rows)  # NOTE: built when read
        nbytes, nwrites = self.staging.stage(plan, self.tables, self.ctx.staged_inputs)
        self.ctx.set_step(plan)
        self._plan = plan
        self._last_batch = (batch, pad_to, None if delta is None else delta.order)
        self.last_step_stats = StepStats(1, nbytes, nwrites, self._num_launches, applies)  # NOTE: its fields' order

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @on_stream
    def build(self) -> DSV4Metadata:
        """Fill every channel's buffers for the step of the last :meth:`update` (no host sync, no
        allocation). Idempotent: a second build of the same step writes the same values."""
        if self._plan is None:
            raise RuntimeError("build() needs a prior update(step)")
        ctx = self.ctx
        ctx.begin_build()
        fused = self._fused
        if fused is not None:
            self._launch_fused(fused)
            self.staging.applied()
        else:
            self.staging.apply_pending(self.tables.flat)
            ctx.fill_requests(self.staging.dev, self.staging.lay)
        build_query(ctx, self.staging, fused is not None)  # NOTE: a declared step's query map (DESIGN §5)
        for b in self._unfused:
            b.launch(ctx)
        meta = self._metadata(self._plan)
        if self.validate or not self._outputs_checked:  # NOTE: the first step, then every step under validate
            self._outputs_checked = check_step_outputs(meta)
        if self.validate:
            from .validate import check_metadata
            check_metadata(meta)
        return meta

    def _launch_fused(self, fused: FusedPlan) -> None:
        lay = self.staging.lay
        assert lay is not None  # NOTE: build() follows an update(), which staged the step
        if self._graphs is None:
            fused.launch(lay)
            return
        graph = self._graphs.get(lay.t_pad)
        if graph is not None:
            graph.replay()
            return
        fused.launch(lay)  # NOTE: this step's work; the capture below records without running
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused.launch(lay)
        self._graphs[lay.t_pad] = graph

    def _metadata(self, plan: StepPlan) -> DSV4Metadata:
        ctx, host_qsl = self.ctx, self.staging.host_qsl
        assert host_qsl is not None  # NOTE: set by the stage() of the step's update()
        B, T, Tp, nd = ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded, ctx.num_decodes
        key = (B, Tp, nd, ctx.num_query_tokens_padded)
        if self._views is None or self._views[0] != key:
            # NOTE: views depend on (B, T_pad, num_decodes, T_q_pad) only: reuse them while those repeat
            common: Dict[str, Any] = dict(
                query_start_loc=ctx.query_start_loc[:B + 1], seq_lens=ctx.seq_lens[:B],
                idx_mapping=ctx.idx_mapping[:B], positions=ctx.positions[:Tp],
                token_to_req=ctx.token_to_req[:Tp], is_valid_token=ctx.is_valid_token[:Tp],
                ring_cols=ctx.ring_cols, layout=self.layout, cp=self.cp, next_n=ctx.next_n,
                builders=self._builders, _converters=self._converters, num_reqs=B,
                num_tokens_padded=Tp, num_decodes=nd, num_prefills=B - nd)
            self._views = (key, {name: b.views(ctx) for name, b in self._builders.items()}, common)
        _, channels, common = self._views
        return DSV4Metadata(**meta_query_fields(ctx, plan),
            num_tokens=T, num_decode_tokens=plan.num_decode_tokens, num_prefill_tokens=T - plan.num_decode_tokens,
            req_slots=plan.slots, req_ids=self._req_ids, host_query_start_loc=host_qsl,
            host_seq_lens=plan.seq_lens, block_tables=list(self.tables.tables), channels=dict(channels),
            replay_start=plan.replay_start, replay_end=plan.replay_end, **common)

    @on_stream
    def warmup(self, pad_sizes=(1,)) -> None:
        """Compile every kernel the pipeline uses (the compiled host passes of ``state/``, each for its one
        signature; an empty step per size in ``pad_sizes``, one top-k
        conversion per channel that has one), check the direct launch of the fused kernel against
        Triton's JIT launch (:meth:`FusedPlan.check_direct_launch`: on a difference the pipeline warns
        and keeps the JIT launch) and, with ``cuda_graphs``, capture a graph per size. Call it before
        the first ``update()``."""
        if self._plan is not None:
            raise RuntimeError("warmup() must run before the first update()")
        compile_pinned()  # NOTE: every compiled host pass, for its one signature (dsv4_index/_numba.py)
        empty = StepBatch(req_slots=np.zeros(0, np.int64), num_computed_tokens=np.zeros(0, np.int64),
                          num_scheduled_tokens=np.zeros(0, np.int64))
        for i, n in enumerate(pad_sizes):
            MetadataPipeline.update(self, empty, pad_to=int(n))  # NOTE: not through a recording wrapper
            if i == 0 and self._fused is not None:
                lay = self.staging.lay
                assert lay is not None  # NOTE: set by the update() above
                # NOTE: before any graph capture: the direct launch must equal the JIT launch
                self._fused.launch(lay)
                self._fused.check_direct_launch(lay)
            self.build()
        self._last_batch = None
        for conv in self._converters.values():
            K = max(1, int(getattr(self.layout, "index_topk", 0) or 1))
            # NOTE: topk needs >= T_pad rows (the last warm-up size), not 1
            conv(torch.full((max(1, self.ctx.num_tokens_padded), K), -1, dtype=torch.int32, device=self.device))
        for b in self._builders.values():  # NOTE: V4.1's candidate kernels (channels/compressed.py)
            getattr(b, "warm_candidates", lambda ctx: None)(self.ctx)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._plan = None

    # convenience
    @property
    def req_ids(self) -> Optional[List[str]]:
        """Request id of each batch row of the last step (id-keyed updates only)."""
        return None if self._req_ids is None else list(self._req_ids)

    def slot_of(self, req_id: str) -> int:
        """Slot (block-table row) of a request (id-keyed updates)."""
        return self.slot_map.slot_of[req_id]

    @property
    def num_launches(self) -> int:
        """Kernel launches per ``build()`` (1 when every channel joins the fused launch)."""
        return self._num_launches

    @property
    def occupied(self) -> np.ndarray:
        """bool ``[max_num_reqs]``: slots holding a request (a read-only copy)."""
        return self.requests.occupied.copy()

    @property
    def builders(self) -> dict:
        """Channel name -> its :class:`~dsv4_index.channels.ChannelBuilder` (read only)."""
        return dict(self._builders)

    @property
    def fused_plan(self) -> Optional[FusedPlan]:
        """The fused launch's plan, or None when every channel launches its own ops."""
        return self._fused

    @property
    def unfused_builders(self) -> list:
        """Builders outside the fused launch (launched one by one in ``build()``)."""
        return list(self._unfused)

    @property
    def stage_layout(self):
        """:class:`~dsv4_index.state.staging.StageLayout` of the last staged step (None before)."""
        return self.staging.lay

    @property
    def last_plan(self) -> Optional[StepPlan]:
        """The checked plan (:class:`~dsv4_index.state.StepPlan`) of the last accepted step; read only."""
        return self._plan

    @property
    def last_batch(self) -> Optional[tuple]:
        """``(StepBatch, pad_to, req_ids)`` of the last accepted ``update()``, whatever its input form
        (a StepInput or SchedulerOutput as the array-form step it was converted to; ``req_ids`` the
        request id of each of its rows, None for a StepBatch input); None before. Read only: what a
        recorder (:func:`dsv4_index.tools.trace.record_steps`) writes."""
        return self._last_batch

