"""The per-step metadata pipeline (DESIGN §5): scheduler output in, per-channel device metadata out.

::

    pipe = MetadataPipeline(layout, max_num_reqs=256, max_num_batched_tokens=8192, device="cuda")
    pipe.warmup()
    for step in scheduler:                 # StepInput per step
        pipe.update(step)                  # host: request rows, block tables, decode-first order, one H2D
        meta = pipe.build()                # device: kernels only, no host sync
        out = model(hidden, meta)          # meta["swa"].indices, meta["c128a"].lens, meta.topk_to_slots(...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ._common import cdiv, cp_owned_count
from .block_table import MultiGroupBlockTable
from .channels import BuildContext, ChannelMetadata, builder_for
from .step import StepInput


@dataclass
class DSV4Metadata:
    """One step's metadata. Device tensors are views of the pipeline's persistent buffers.

    Attributes
    ----------
    num_reqs, num_tokens, num_tokens_padded : int — live requests, live tokens, tokens incl. padding (host).
    req_ids : list[str] — request of each batch row, decode requests first.
    num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens : int (host).
    query_start_loc : int32 [num_reqs + 1]; seq_lens : int32 [num_reqs].
    positions : int64 [T]; token_to_req : int32 [T]; is_valid_token : bool [T]  (T = num_tokens_padded).
    block_tables : list of int32 [num_reqs, table_width], one per gid.
    channels : dict name -> ChannelMetadata; ``meta["swa"]`` is ``meta.channels["swa"]``.
    """

    num_reqs: int
    num_tokens: int
    num_tokens_padded: int
    req_ids: List[str]
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    token_to_req: torch.Tensor
    is_valid_token: torch.Tensor
    block_tables: List[torch.Tensor]
    channels: Dict[str, ChannelMetadata] = field(default_factory=dict)
    _pipeline: Optional["MetadataPipeline"] = field(default=None, repr=False)

    def __getitem__(self, name: str) -> ChannelMetadata:
        try:
            return self.channels[name]
        except KeyError:
            raise KeyError(f"no channel {name!r} in this layout; channels: {sorted(self.channels)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.channels

    def topk_to_slots(self, channel: str, topk: torch.Tensor):
        """Convert one layer's indexer picks into physical slots of ``channel``'s cache.

        Parameters
        ----------
        channel : str — a channel with top-k conversion (``"c4a"``).
        topk : int32 or int64 [T, K] — request-local compressed row ids, ``-1`` = none (T = num_tokens_padded).

        Returns
        -------
        (slots int32 [T, K], lens int32 [T]) — views of persistent buffers, overwritten by the next call.
        """
        if channel not in self.channels:
            raise KeyError(f"no channel {channel!r} in this layout; channels: {sorted(self.channels)}")
        pipe = self._pipeline
        return pipe._builders[channel].topk_to_slots(pipe._ctx, topk)


class _Request:
    __slots__ = ("req_id", "row", "num_computed", "replay_start")

    def __init__(self, req_id, row, num_computed, replay_start=0):
        self.req_id, self.row, self.num_computed, self.replay_start = req_id, row, num_computed, replay_start


class MetadataPipeline:
    """Persistent request rows + block tables per group + one builder per channel.

    Parameters
    ----------
    layout : DSV4Layout — groups and channels (``DSV4Layout.from_config``).
    max_num_reqs : int — request rows (capacity of every per-request buffer).
    max_num_batched_tokens : int — token capacity of every per-token buffer (padding included).
    device : str or torch.device.
    num_speculative_tokens : int — a request is a decode when it schedules at most ``1 + this`` tokens
        (one threshold for every channel).
    cp_world_size, cp_rank, cp_interleave : decode context parallelism (DESIGN §4); tables hold this
        rank's local blocks.
    fused : bool — build with one fused Triton launch (:mod:`dsv4_index.kernels.fused`) where the
        Triton backend is in use; False launches each channel's per-op kernels (same results).
    validate : bool — debug: run :func:`dsv4_index.validate.check_metadata` after every ``build()``
        (host copies; never in serving).
    """

    def __init__(self, layout, max_num_reqs: int, max_num_batched_tokens: int, device="cpu",
                 num_speculative_tokens: int = 0, *, cp_world_size: int = 1, cp_rank: int = 0,
                 cp_interleave: int = 1, fused: bool = True, validate: bool = False):
        for name, v, lo in (("max_num_reqs", max_num_reqs, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                            ("num_speculative_tokens", num_speculative_tokens, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        from ._common import check_cp
        check_cp(cp_world_size, cp_rank, cp_interleave,
                 min(g.alloc_block_size for g in layout.groups) if cp_world_size > 1 else None)
        self.layout = layout
        self.device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.cp = dict(cp_world_size=cp_world_size, cp_rank=cp_rank, cp_interleave=cp_interleave)
        self.validate = bool(validate)  # NOTE: debug only: check_metadata after every build (host syncs)

        self.tables = MultiGroupBlockTable(layout.groups, max_num_reqs, self.device)
        pin = torch.cuda.is_available() and self.device.type == "cuda"
        R = max_num_reqs
        # host step arrays (pinned on CUDA): query_start_loc | seq_lens | replay_start
        self._host = torch.zeros(3 * R + 1, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(3 * R + 1, dtype=torch.int32, device=self.device)
        qsl, seq_lens, replay = self._dev[:R + 1], self._dev[R + 1:2 * R + 1], self._dev[2 * R + 1:]
        T = max_num_batched_tokens
        self.positions = torch.zeros(T, dtype=torch.int64, device=self.device)
        self.token_to_req = torch.zeros(T, dtype=torch.int32, device=self.device)
        self.is_valid_token = torch.zeros(T, dtype=torch.bool, device=self.device)
        self._token_ids = torch.arange(T, dtype=torch.int64, device=self.device)

        self._ctx = BuildContext(
            layout=layout, device=self.device, max_num_reqs=R, max_num_tokens=T,
            num_speculative_tokens=num_speculative_tokens, cp_world_size=cp_world_size, cp_rank=cp_rank,
            cp_interleave=cp_interleave, query_start_loc=qsl, seq_lens=seq_lens, replay_start=replay,
            block_tables=tuple(self.tables[g.gid].device_table for g in layout.groups))
        self._builders = {name: builder_for(spec, layout) for name, spec in layout.channels.items()}
        for b in self._builders.values():
            b.allocate(self._ctx)
        # NOTE: the fused plan (one launch for the common tensors and every built-in channel it knows)
        # replaces the builders' own launches; channels it does not cover still launch their kernels.
        self._fused = None
        from ._common import use_triton
        if fused and use_triton(self.device):
            from .kernels.fused import FusedPlan
            self._fused = FusedPlan(self._ctx, self._builders, token_to_req=self.token_to_req,
                                    positions=self.positions, is_valid_token=self.is_valid_token)

        self._reqs: Dict[str, _Request] = {}        # requests holding a row
        self._known: Dict[str, int] = {}            # preempted requests (id -> num_computed), may resume
        self._row_req: List[Optional[str]] = [None] * R
        self._batch: List[str] = []
        self._counts = dict(num_decodes=0, num_prefills=0, num_decode_tokens=0, num_prefill_tokens=0)
        self._updated = False

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    def _blocks_needed(self, group, seq_len: int) -> int:
        local = seq_len
        if self.cp["cp_world_size"] > 1:
            local = int(cp_owned_count(torch.tensor(seq_len), self.cp["cp_world_size"], self.cp["cp_rank"],
                                       self.cp["cp_interleave"]))
        return cdiv(local, group.block_size)

    def _check_step(self, step: StepInput) -> None:
        """Every check that can reject the step, before any state changes (ValueError)."""
        if not isinstance(step, StepInput):
            raise ValueError(f"step must be a StepInput, got {type(step).__name__}")
        if hasattr(step, "validate_static"):
            step.validate_static()
        G = len(self.layout.groups)
        gone = set(step.finished_req_ids) | set(step.preempted_req_ids)
        for rid in gone:
            if rid not in self._reqs and rid not in self._known:
                raise ValueError(f"finished/preempted request {rid!r} is unknown to the pipeline")
        live = {rid for rid in self._reqs if rid not in gone}
        blocks = {rid: [int(self.tables[g.gid].num_blocks[r.row]) for g in self.layout.groups]
                  for rid, r in self._reqs.items()}
        computed = {}
        for r in step.new_requests:
            if r.req_id in live or r.req_id in self._known and r.req_id not in gone:
                raise ValueError(f"new request {r.req_id!r} is already known to the pipeline")
            if len(r.block_ids) != G:
                raise ValueError(f"new request {r.req_id!r}: block_ids has {len(r.block_ids)} lists, "
                                 f"the layout has {G} groups")
            live.add(r.req_id)
            blocks[r.req_id] = [len(b) * g.blocks_per_kv_block for b, g in zip(r.block_ids, self.layout.groups)]
            computed[r.req_id] = r.num_computed_tokens
        for r in step.running_requests:
            if len(r.new_block_ids) != G:
                raise ValueError(f"running request {r.req_id!r}: new_block_ids has {len(r.new_block_ids)} "
                                 f"lists, the layout has {G} groups")
            if r.resumed:
                if r.req_id not in self._known and r.req_id not in self._reqs:
                    raise ValueError(f"resumed request {r.req_id!r} is unknown to the pipeline")
                blocks[r.req_id] = [len(b) * g.blocks_per_kv_block
                                    for b, g in zip(r.new_block_ids, self.layout.groups)]
            else:
                if r.req_id not in self._reqs or r.req_id in gone:
                    raise ValueError(f"running request {r.req_id!r} is unknown to the pipeline "
                                     "(never added, finished or preempted without resumed=True)")
                blocks[r.req_id] = [n + len(b) * g.blocks_per_kv_block for n, b, g in
                                    zip(blocks[r.req_id], r.new_block_ids, self.layout.groups)]
                # NOTE: duplicates against the blocks already in the row; only full groups keep every
                # block — a sliding group's released (stale) entries may come back.
                for g, new in zip(self.layout.groups, r.new_block_ids):
                    if new and g.kind == "full":
                        f = g.blocks_per_kv_block
                        old = set((self._row_blocks(self._reqs[r.req_id].row, g)[::f] // f).tolist())
                        dup = set(new) & old - {0}
                        if dup:
                            raise ValueError(f"running request {r.req_id!r}: block id {min(dup)} appears twice "
                                             f"in group {g.name!r}")
            live.add(r.req_id)
            computed[r.req_id] = r.num_computed_tokens
        if len(live) > self.max_num_reqs:
            raise ValueError(f"the step holds {len(live)} requests, max_num_reqs is {self.max_num_reqs}")
        total = 0
        for rid, n in step.num_scheduled_tokens.items():
            if rid not in live:
                raise ValueError(f"num_scheduled_tokens names request {rid!r}, which is not in the batch")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"num_scheduled_tokens[{rid!r}] must be an int >= 0, got {n!r}")
            total += n
            c = computed.get(rid, self._reqs[rid].num_computed if rid in self._reqs else 0)
            seq_len = c + n
            for g, nb in zip(self.layout.groups, blocks[rid]):
                need = self._blocks_needed(g, seq_len)
                if need > g.table_width:
                    raise ValueError(f"request {rid!r}: {seq_len} tokens need {need} blocks in group {g.name!r}, "
                                     f"the table holds {g.table_width}")
                if n and need > nb:
                    raise ValueError(f"request {rid!r}: block ids missing for gid {g.gid} ({g.name}): "
                                     f"{seq_len} tokens need {need} blocks, the row has {nb}")
            rs = step.replay_start.get(rid)
            if rs is not None and not 0 <= rs <= c:
                raise ValueError(f"replay_start[{rid!r}] = {rs} must lie in [0, num_computed_tokens = {c}]")
        if total > self.max_num_tokens:
            raise ValueError(f"the step schedules {total} tokens, max_num_batched_tokens is {self.max_num_tokens}")
        for rid in step.replay_start:
            if rid not in step.num_scheduled_tokens:
                raise ValueError(f"replay_start names request {rid!r}, which schedules no tokens")

    def _row_blocks(self, row: int, group) -> np.ndarray:
        return self.tables[group.gid].row(row)

    def _free_row(self) -> int:
        for row, rid in enumerate(self._row_req):
            if rid is None:
                return row
        raise ValueError("no free request row")  # unreachable after _check_step

    def update(self, step: StepInput, *, pad_to: Optional[int] = None) -> None:
        """Apply one scheduler step on the host and copy what changed to the device.

        Parameters
        ----------
        step : StepInput
        pad_to : int, optional — pad the token count to this size (a CUDA-graph batch size); padded
            tokens are invalid (``-1`` slots and rows, ``0`` lengths).

        Raises ValueError on bad input; the pipeline state is then unchanged.
        """
        self._check_step(step)
        T = step.total_tokens if hasattr(step, "total_tokens") else sum(step.num_scheduled_tokens.values())
        Tp = T if pad_to is None else pad_to
        if isinstance(Tp, bool) or not isinstance(Tp, int) or not T <= Tp <= self.max_num_tokens:
            raise ValueError(f"pad_to must be an int in [{T}, {self.max_num_tokens}], got {pad_to!r}")

        for rid in list(step.finished_req_ids) + list(step.preempted_req_ids):
            r = self._reqs.pop(rid, None)
            if r is not None:
                self.tables.clear_row(r.row)
                self._row_req[r.row] = None
            if rid in step.preempted_req_ids:
                self._known[rid] = r.num_computed if r is not None else self._known.get(rid, 0)
            else:
                self._known.pop(rid, None)
        for r in step.new_requests:
            row = self._free_row()
            self.tables.add_row(r.block_ids, row)
            self._row_req[row] = r.req_id
            self._reqs[r.req_id] = _Request(r.req_id, row, r.num_computed_tokens)
        for r in step.running_requests:
            if r.resumed:
                old = self._reqs.get(r.req_id)
                row = old.row if old is not None else self._free_row()
                self._known.pop(r.req_id, None)
                self.tables.add_row(r.new_block_ids, row)
                self._row_req[row] = r.req_id
                self._reqs[r.req_id] = _Request(r.req_id, row, r.num_computed_tokens)
            else:
                req = self._reqs[r.req_id]
                self.tables.append_row(r.new_block_ids, req.row)
                req.num_computed = r.num_computed_tokens
        for rid, rs in step.replay_start.items():
            self._reqs[rid].replay_start = rs

        self._order_batch(step)
        self._fill_host(step, T, Tp)
        self._updated = True

    def _order_batch(self, step: StepInput) -> None:
        """Decode-first batch order in rows ``[0, B)``: scheduled decodes, scheduled prefills, the rest."""
        sched = step.num_scheduled_tokens
        threshold = 1 + self.num_speculative_tokens
        by_row = sorted(self._reqs.values(), key=lambda r: r.row)
        decodes = [r.req_id for r in by_row if 0 < sched.get(r.req_id, 0) <= threshold]
        prefills = [r.req_id for r in by_row if sched.get(r.req_id, 0) > threshold]
        rest = [r.req_id for r in by_row if sched.get(r.req_id, 0) == 0]
        order = decodes + prefills + rest
        for target, rid in enumerate(order):
            cur = self._reqs[rid].row
            if cur != target:
                other = self._row_req[target]
                self.tables.swap_row(cur, target)
                self._row_req[cur], self._row_req[target] = other, rid
                self._reqs[rid].row = target
                if other is not None:
                    self._reqs[other].row = cur
        self._batch = decodes + prefills
        nd = len(decodes)
        self._counts = dict(num_decodes=nd, num_prefills=len(prefills),
                            num_decode_tokens=sum(sched[r] for r in decodes),
                            num_prefill_tokens=sum(sched[r] for r in prefills))

    def _fill_host(self, step: StepInput, T: int, Tp: int) -> None:
        R = self.max_num_reqs
        h = self._host_np
        qsl, seq_lens, replay = h[:R + 1], h[R + 1:2 * R + 1], h[2 * R + 1:]
        B = len(self._batch)
        q = np.fromiter((step.num_scheduled_tokens[r] for r in self._batch), dtype=np.int64, count=B)
        c = np.fromiter((self._reqs[r].num_computed for r in self._batch), dtype=np.int64, count=B)
        qsl[0] = 0
        np.cumsum(q, out=qsl[1:B + 1]) if B else None
        qsl[B + 1:] = T                    # NOTE: rows past the batch are zero-length requests
        seq_lens[:B] = c + q
        seq_lens[B:] = 0
        replay[:B] = [self._reqs[r].replay_start for r in self._batch]
        replay[B:] = 0
        ctx = self._ctx
        ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded = B, T, Tp
        ctx.num_decodes = self._counts["num_decodes"]
        self.tables.commit()
        self._dev.copy_(self._host, non_blocking=True)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    def build(self) -> DSV4Metadata:
        """Fill every channel's buffers for the step given to the last :meth:`update` (no host sync)."""
        if not self._updated:
            raise RuntimeError("build() needs a prior update(step)")
        ctx = self._ctx
        ctx.new_step()
        B, T, Tp = ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded
        qsl, seq_lens = ctx.query_start_loc, ctx.seq_lens
        covered = ()
        if self._fused is not None:
            self._fused.launch(ctx)
            covered = self._fused.covered
        else:
            self._build_common()
        for name, builder in self._builders.items():
            if name not in covered:
                builder.launch(ctx)
        channels = {name: builder.views(ctx) for name, builder in self._builders.items()}
        ttr, pos, valid = self.token_to_req[:Tp], self.positions[:Tp], self.is_valid_token[:Tp]
        meta = DSV4Metadata(
            num_reqs=B, num_tokens=T, num_tokens_padded=Tp, req_ids=list(self._batch), **self._counts,
            query_start_loc=qsl[:B + 1], seq_lens=seq_lens[:B], positions=pos, token_to_req=ttr,
            is_valid_token=valid, block_tables=[bt[:B] for bt in ctx.block_tables], channels=channels,
            _pipeline=self)
        if self.validate:
            from .validate import check_metadata
            check_metadata(meta)
        return meta

    def _build_common(self) -> None:
        """Unfused path: token -> request, validity and positions (a few small launches)."""
        from . import token_to_req as token_to_req_op
        ctx = self._ctx
        Tp = ctx.num_tokens_padded
        qsl, seq_lens = ctx.query_start_loc, ctx.seq_lens
        ttr = token_to_req_op(qsl, Tp, out=self.token_to_req[:Tp])
        t = self._token_ids[:Tp]
        valid = torch.lt(t, qsl[-1].to(torch.int64), out=self.is_valid_token[:Tp])
        b = ttr.long()
        pos = self.positions[:Tp]
        torch.add(seq_lens[b].long() - qsl[b + 1].long(), t, out=pos)
        pos.masked_fill_(~valid, 0)

    def warmup(self) -> None:
        """Run one empty build so every kernel the pipeline uses is compiled before serving."""
        saved = (self._updated, self._ctx.num_reqs, self._ctx.num_tokens, self._ctx.num_tokens_padded)
        saved_dev = self._dev.clone()
        self._dev.zero_()
        ctx = self._ctx
        ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded = 0, 0, 1
        self._updated = True
        self.build()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._dev.copy_(saved_dev)
        self._updated, ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded = saved

    # convenience
    @property
    def req_ids(self) -> List[str]:
        return list(self._batch)

    def row_of(self, req_id: str) -> int:
        return self._reqs[req_id].row
