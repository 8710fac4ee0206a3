"""Lightning-indexer cache (``c4i``): compressed slots (shared with ``c4a``), indexer lengths
(``lens``, ``ks``, ``ke``, ``cu``, ``decode_lens``) and optionally every visible row as a causal list."""

from __future__ import annotations

import functools

import torch

from ..fused.tasks import FusedTask
from ..ops import causal_compressed_indices, indexer_lengths
from ..ops.indexer_lengths.naive import staged_cu
from .base import BuildContext
from .compressed import CompressedBase

__all__ = ["IndexerChannel"]


class IndexerChannel(CompressedBase):
    """Per token ``lens = n_c(pos)``, ``ks = cu[b]``, ``ke = cu[b] + n_c`` (int32 ``[T]``); ``cu``
    int32 ``[B + 1]`` (staged by the host with the step); ``decode_lens`` int32 ``[num_decodes,
    next_n]`` right-aligned; with ``"indices"`` in ``spec.outputs`` a causal list of width
    ``spec.index_width``. Every output but the compressed slot mappings is per query token (``[T_q_pad]`` rows;
    ``decode_lens`` over the decode rows' query tokens: docs/DESIGN.md §5 "Source rows ≠ query rows")."""

    def allocate(self, ctx: BuildContext):
        super().allocate(ctx)
        T, dev = ctx.max_num_tokens, ctx.device
        self.lens = torch.zeros((T,), dtype=torch.int32, device=dev)
        self.ks = torch.zeros((T,), dtype=torch.int32, device=dev)
        self.ke = torch.zeros((T,), dtype=torch.int32, device=dev)
        self.cu = torch.zeros((T + 1,), dtype=torch.int32, device=dev)
        self.decode_lens = torch.zeros((T, ctx.next_n), dtype=torch.int32, device=dev)
        # NOTE: clamped (>= 1) copies for DeepGEMM-style consumers (zero lengths crash some of them)
        self.lens_clamped = torch.ones((T,), dtype=torch.int32, device=dev)
        self.decode_lens_clamped = torch.ones((T, ctx.next_n), dtype=torch.int32, device=dev)
        self.with_indices = "indices" in self.spec.outputs
        # NOTE: cu is a per-request input staged with the step (formula: ops/indexer_lengths/naive.py)
        w, r, i = ctx.group_cp(self.spec.gid)
        self.cu_index = ctx.staged_input(("indexer_cu", self.spec.gid, self.spec.compress_ratio), functools.partial(
            staged_cu, compress_ratio=self.spec.compress_ratio, cp_world_size=w, cp_rank=r, cp_interleave=i))
        if self.with_indices:
            self._width = self.required("index_width")
            self.indices = torch.full((T, self._width), -1, dtype=torch.int32, device=dev)
            self.index_lens = torch.zeros((T,), dtype=torch.int32, device=dev)

    def fused_tasks(self, ctx: BuildContext):
        s, cu_index = self.spec, self.cu_index
        tasks = super().fused_tasks(ctx) + [
            FusedTask("indexer", (self.lens, self.ks, self.ke, self.lens_clamped), gid=s.gid, a=s.compress_ratio,
                      extra=cu_index, query=True),
            FusedTask("staged_copy", (self.cu,), extra=cu_index),
            FusedTask("decode_lens", (self.decode_lens, self.decode_lens_clamped), gid=s.gid, a=s.compress_ratio,
                      b=ctx.next_n, query=True)]
        if self.with_indices:
            tasks.append(FusedTask("causal", (self.indices, self.index_lens), gid=s.gid, a=s.compress_ratio,
                                   b=s.rows_per_block, width=self.indices.shape[1], query=True))
        return tasks

    def launch(self, ctx: BuildContext):
        super().launch(ctx)
        self.launch_query(ctx)

    def query_fields(self) -> frozenset:
        return frozenset({"lens", "ks", "ke", "decode_lens", "lens_clamped", "decode_lens_clamped", "indices"})

    def launch_query(self, ctx: BuildContext):
        s, B, Tp = self.spec, ctx.num_reqs, ctx.num_query_tokens_padded
        kw = self.query_args(ctx)
        kw.pop("idx_mapping")
        qsl, seq = ctx.query_qsl(), ctx.seq_lens[:B]
        indexer_lengths(qsl, seq, s.compress_ratio, next_n=ctx.next_n, num_decodes=ctx.num_decodes,
                        out=self.lens[:Tp], out_decode=self.decode_lens[:max(ctx.num_decodes, 1)],
                        out_ks=self.ks[:Tp], out_ke=self.ke[:Tp], out_cu=self.cu[:B + 1], **kw)
        self.cu[B + 1:Tp + 1].copy_(self.cu[B:B + 1].expand(Tp - B))
        self.decode_lens[ctx.num_decodes:Tp].zero_()
        torch.clamp(self.lens[:Tp], min=1, out=self.lens_clamped[:Tp])
        torch.clamp(self.decode_lens[:Tp], min=1, out=self.decode_lens_clamped[:Tp])
        if self.with_indices:
            causal_compressed_indices(qsl, seq, ctx.tables[s.gid], s.rows_per_block, s.compress_ratio,
                                      self._width, out=self.indices[:Tp], out_lens=self.index_lens[:Tp],
                                      **self.query_args(ctx))

    def views(self, ctx: BuildContext):
        Tp, B = ctx.num_query_tokens_padded, ctx.num_reqs
        extra = {"indices": self.indices[:Tp]} if self.with_indices else {}
        nd = ctx.num_decodes
        return self.meta(ctx, lens=self.lens[:Tp], ks=self.ks[:Tp], ke=self.ke[:Tp], cu=self.cu[:B + 1],
                         decode_lens=self.decode_lens[:nd], lens_clamped=self.lens_clamped[:Tp],
                         decode_lens_clamped=self.decode_lens_clamped[:nd], **self.compressed_views(ctx), **extra)
