"""Compressed caches of the full group: the compressed slot mapping (computed once per step for
every channel of one geometry) and the top-k -> slot conversion of ``c4a``."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .._common import use_triton
from ..fused.tasks import FusedTask
from ..ops import compressed_slot_mapping, indexer_lengths
from ..ops.compressed_slot_mapping.naive import staged_compact_cu
from ..ops.candidate_blocks_to_physical import candidate_blocks_to_physical_rows
from ..ops.candidate_blocks_to_physical import kernel as phys_kernel
from ..ops.candidate_topk_to_slots import candidate_topk_to_slots_rows
from ..ops.candidate_topk_to_slots import kernel as cand_kernel
from ..ops.topk_to_slots import kernel as topk_kernel
from ..ops.topk_to_slots import topk_to_slots_rows
from .base import BuildContext, ChannelBuilder

__all__ = ["CompressedBase", "CompressedChannel"]


class CompressedBase(ChannelBuilder):
    """Compressed slot mapping int64 ``[T]`` (shared by channels of one geometry), and with
    ``spec.compact`` its compact form (``compact_slot_mapping`` int64 ``[T]``, ``compact_cu`` int32
    ``[B + 1]``). Every output is per source token (docs/DESIGN.md §5 "Source rows ≠ query rows")."""

    query_batch = True

    @property
    def int32_unit(self) -> int:
        return self.spec.rows_per_block

    def allocate(self, ctx: BuildContext):
        s = self.spec
        self.key = ("compressed", s.gid, s.compress_ratio, s.rows_per_block)
        T = ctx.max_num_tokens
        self.compressed = ctx.shared_buffer(self.key, (T,), torch.int64)
        self.compact: Optional[torch.Tensor] = None      # NOTE: set exactly when spec.compact
        self.compact_cu: Optional[torch.Tensor] = None
        self.compact_cu_index = -1
        if s.compact:
            self.compact = ctx.shared_buffer(self.key + ("compact",), (T,), torch.int64)
            self.compact_cu = ctx.shared_buffer(self.key + ("compact_cu",), (T + 1,), torch.int32)
            # NOTE: the compact cu is a per-request input staged with the step (formula: the op's naive.py)
            self.compact_cu_index = ctx.staged_input(self.key + ("compact_cu",), functools.partial(
                staged_compact_cu, compress_ratio=s.compress_ratio))

    def fused_tasks(self, ctx: BuildContext):
        s = self.spec
        tasks = [FusedTask("compressed", (self.compressed, self.compact), gid=s.gid, a=s.compress_ratio,
                           b=s.rows_per_block, write_floor=self.group.prefix_cacheable, extra=self.compact_cu_index)]
        if s.compact:
            tasks.append(FusedTask("staged_copy", (self.compact_cu,), extra=self.compact_cu_index))
        return tasks

    def launch(self, ctx: BuildContext):
        s, B, Tp = self.spec, ctx.num_reqs, ctx.num_tokens_padded
        if not ctx.once(self.key):
            return
        args = (ctx.query_start_loc[:B + 1], ctx.seq_lens[:B], ctx.tables[s.gid], s.rows_per_block,
                s.compress_ratio)
        floor = ctx.replay_end[:B] if self.group.prefix_cacheable else None
        compressed_slot_mapping(*args, replay_end=floor, out=self.compressed[:Tp], **self.batch_args(ctx))
        if s.compact:
            assert self.compact is not None and self.compact_cu is not None  # NOTE: allocated when spec.compact
            kw = self.batch_args(ctx)
            kw.pop("num_tokens")
            out, cu = compressed_slot_mapping(*args, replay_end=floor, compact=True, num_tokens=ctx.num_tokens,
                                              **kw)
            # NOTE: the pipeline's compact buffer is [T_pad] with -1 after the last row
            self.compact[:Tp].fill_(-1)
            n = min(out.shape[0], Tp)
            self.compact[:n].copy_(out[:n])
            self.compact_cu[:B + 1].copy_(cu)
            self.compact_cu[B + 1:Tp + 1].copy_(cu[B:B + 1].expand(Tp - B))

    def compressed_views(self, ctx: BuildContext) -> dict:
        Tp, B = ctx.num_tokens_padded, ctx.num_reqs
        v = dict(compressed_slot_mapping=self.compressed[:Tp])
        if self.spec.compact:
            assert self.compact is not None and self.compact_cu is not None
            v.update(compact_slot_mapping=self.compact[:Tp], compact_cu=self.compact_cu[:B + 1])
        return v

    def views(self, ctx: BuildContext):
        return self.meta(ctx, **self.compressed_views(ctx))


class CompressedChannel(CompressedBase):
    """Compressed cache read through the indexer's top-k (``c4a``): compressed slots + top-k
    conversion (per layer, after the indexer) from the per-token table row and ``n_c`` the step
    build leaves behind. The table row and ``n_c`` are per query token (``[T_q_pad]``), and so is every
    conversion (docs/DESIGN.md §5 "Source rows ≠ query rows")."""

    def allocate(self, ctx: BuildContext):
        super().allocate(ctx)
        T, dev = ctx.max_num_tokens, ctx.device
        self.k_capacity = max(1, int(getattr(self.layout, "index_topk", 0) or 1))
        self.token_rows = torch.full((T,), -1, dtype=torch.int32, device=dev)
        self.token_nc = torch.zeros((T,), dtype=torch.int32, device=dev)
        self.topk_flat = torch.full((T * self.k_capacity,), -1, dtype=torch.int32, device=dev)
        self.topk_lens = torch.zeros((T,), dtype=torch.int32, device=dev)
        self.ctx = ctx  # NOTE: the meta's candidate methods reach the step through it (DSV4Metadata)
        # NOTE: V4.1's two-level indexer: its own outputs (never the top-k buffers: a consumer holds both)
        C, nb = getattr(self.layout, "candidate_block_size", None), getattr(self.layout, "candidate_topk_blocks", None)
        self.candidate = None if C is None or nb is None else (int(C), int(nb))
        if self.candidate is not None:
            nb = self.candidate[1]
            self.cand_phys = torch.full((T * nb,), -1, dtype=torch.int32, device=dev)
            self.cand_counts = torch.zeros((T,), dtype=torch.int32, device=dev)
            self.cand_flat = torch.full((T * self.k_capacity,), -1, dtype=torch.int32, device=dev)
            self.cand_lens = torch.zeros((T,), dtype=torch.int32, device=dev)

    def fused_tasks(self, ctx: BuildContext):
        return super().fused_tasks(ctx) + [FusedTask("token_rows", (self.token_rows, self.token_nc),
                                                     gid=self.spec.gid, a=self.spec.compress_ratio, query=True)]

    def launch(self, ctx: BuildContext):
        super().launch(ctx)
        self.launch_query(ctx)

    def launch_query(self, ctx: BuildContext):
        s, B, Tqp = self.spec, ctx.num_reqs, ctx.num_query_tokens_padded
        # NOTE: n_c of every row (picks are global row ids; ownership is checked per pick)
        indexer_lengths(ctx.query_qsl(), ctx.seq_lens[:B], s.compress_ratio, out=self.token_nc[:Tqp],
                        num_tokens=ctx.num_query_tokens, backend=ctx.backend)
        ttr, valid = ctx.query_token_map()
        rows = ctx.idx_mapping[:B][ttr.long().clamp(max=max(B - 1, 0))] if B else \
            torch.zeros_like(self.token_rows[:Tqp])
        self.token_rows[:Tqp].copy_(torch.where(valid, rows, -1))

    def _check_picks(self, ctx: BuildContext, name: str, x, dtypes, cap: int, what: str) -> int:
        """A per-token int tensor ``[>= T_pad, <= cap]`` on the channel's device, unit column stride; its
        columns."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [T, K], got {getattr(x, 'shape', x)!r}")
        dev = self.token_rows.device  # NOTE: concrete (cuda:0), where ctx.device may be plain "cuda"
        if x.dtype not in dtypes or x.device != dev:
            raise ValueError(f"{name} must be {' or '.join(str(d)[6:] for d in dtypes)} on {dev}, got {x.dtype} "
                             f"on {x.device}")
        if x.shape[1] > cap:
            raise ValueError(f"{name} has {x.shape[1]} columns, channel {self.spec.name!r} was sized for "
                             f"{what} = {cap}")
        if x.shape[0] < ctx.num_query_tokens_padded:
            what = "T_pad" if ctx.query is None else "query rows T_q_pad"
            raise ValueError(f"{name} has {x.shape[0]} rows, the step has {what} = {ctx.num_query_tokens_padded}")
        if x.stride(1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension")
        return x.shape[1]

    def topk_to_slots(self, ctx: BuildContext, topk: torch.Tensor, *, compact: bool = False):
        K = self._check_picks(ctx, "topk", topk, (torch.int32, torch.int64), self.k_capacity, "index_topk")
        Tp = ctx.num_query_tokens_padded
        s = self.spec
        out = self.topk_flat[:Tp * K].view(Tp, K)
        lens = self.topk_lens[:Tp]
        w, r, i = ctx.group_cp(s.gid)
        bt = ctx.tables[s.gid]
        if use_triton(ctx.device, ctx.backend):
            topk_kernel.launch_rows(topk, self.token_rows, self.token_nc, bt, s.rows_per_block, s.compress_ratio,
                                    bt.shape[1], w, r, i, bool(compact), out, lens, Tp)
        else:
            topk_to_slots_rows(topk, self.token_rows, self.token_nc, bt, s.rows_per_block, s.compress_ratio, Tp,
                               cp_world_size=w, cp_rank=r, cp_interleave=i, compact=bool(compact), out=out,
                               out_lens=lens, backend="reference")
        return out, lens

    def _candidate(self, ctx: BuildContext):
        if self.candidate is None:
            raise ValueError(f"channel {self.spec.name!r}: this layout has no two-level indexer "
                             f"(layout.candidate_block_size is None: the config has no candidate_block_size / "
                             f"candidate_topk_blocks)")
        return self.candidate

    def candidate_blocks_to_physical(self, ctx: BuildContext, blocks: torch.Tensor):
        """``(phys int32 [T_pad, nb], counts int32 [T_pad])`` of this step (docs/DESIGN.md §4 "Candidate
        blocks"): views of persistent buffers, overwritten by the next call."""
        C, nb_cap = self._candidate(ctx)
        nb = self._check_picks(ctx, "blocks", blocks, (torch.int32,), nb_cap, "candidate_topk_blocks")
        s, Tp = self.spec, ctx.num_query_tokens_padded
        if ctx.group_cp(s.gid)[0] > 1:
            raise ValueError(f"candidate_blocks_to_physical: channel {s.name!r} is sharded by DCP (cp_world_size "
                             f"{ctx.group_cp(s.gid)[0]}); a candidate block's rows span ranks (vLLM refuses DCP "
                             f"for this indexer too)")
        out, counts = self.cand_phys[:Tp * nb].view(Tp, nb), self.cand_counts[:Tp]
        bt = ctx.tables[s.gid]
        if use_triton(ctx.device, ctx.backend):
            return phys_kernel.launch(blocks, None, (self.token_rows, self.token_nc), bt, s.rows_per_block,
                                      s.compress_ratio, C, bt.shape[1], out, counts, Tp)
        return candidate_blocks_to_physical_rows(blocks, self.token_rows, self.token_nc, bt, s.rows_per_block,
                                                 s.compress_ratio, C, Tp, out=out, out_counts=counts,
                                                 backend="reference")

    def candidate_topk_to_slots(self, ctx: BuildContext, blocks: torch.Tensor, cols: torch.Tensor, *,
                                compact: bool = False):
        """``(slots int32 [T_pad, K], lens int32 [T_pad])``: a consumer's sparse columns as physical slots
        (docs/DESIGN.md §4 "Candidate blocks"), views overwritten by the next call."""
        C, nb_cap = self._candidate(ctx)
        self._check_picks(ctx, "blocks", blocks, (torch.int32,), nb_cap, "candidate_topk_blocks")
        K = self._check_picks(ctx, "cols", cols, (torch.int32, torch.int64), self.k_capacity, "index_topk")
        s, Tp = self.spec, ctx.num_query_tokens_padded
        out, lens = self.cand_flat[:Tp * K].view(Tp, K), self.cand_lens[:Tp]
        cp, bt = ctx.group_cp(s.gid), ctx.tables[s.gid]
        if use_triton(ctx.device, ctx.backend):
            return cand_kernel.launch(blocks, cols, None, (self.token_rows, self.token_nc), bt, s.rows_per_block,
                                      s.compress_ratio, C, bt.shape[1], cp, bool(compact), out, lens, Tp)
        return candidate_topk_to_slots_rows(blocks, cols, self.token_rows, self.token_nc, bt, s.rows_per_block,
                                            s.compress_ratio, C, Tp, cp_world_size=cp[0], cp_rank=cp[1],
                                            cp_interleave=cp[2], compact=bool(compact), out=out, out_lens=lens,
                                            backend="reference")

    def warm_candidates(self, ctx: BuildContext) -> None:
        """Compile the candidate kernels (``MetadataPipeline.warmup``; nothing without the two-level indexer)."""
        if self.candidate is None or (ctx.group_cp(self.spec.gid)[0] > 1):
            return
        Tp, dev = max(1, ctx.num_query_tokens_padded), self.token_rows.device
        blocks = torch.full((Tp, self.candidate[1]), -1, dtype=torch.int32, device=dev)
        self.candidate_blocks_to_physical(ctx, blocks)
        self.candidate_topk_to_slots(ctx, blocks, torch.full((Tp, self.k_capacity), -1, dtype=torch.int32, device=dev))
