"""Compressed cache read whole (``c128a``): compressed slots + every visible row of each token."""

from __future__ import annotations

import torch

from ..fused.tasks import FusedTask
from ..ops import causal_compressed_indices
from .base import BuildContext
from .compressed import CompressedBase

__all__ = ["CausalCompressedChannel"]


class CausalCompressedChannel(CompressedBase):
    """``indices`` int32 ``[T, spec.index_width]`` (rows ``0 .. n_c - 1`` as slots, then ``-1``) and
    ``lens`` int32 ``[T]``, plus the shared compressed slot mapping. The lists are per query token (``[T_q_pad]``
    rows, docs/DESIGN.md §5 "Source rows ≠ query rows")."""

    query_batch = True

    def allocate(self, ctx: BuildContext):
        super().allocate(ctx)
        T, self._width = ctx.max_num_tokens, self.required("index_width")
        self.indices = torch.full((T, self._width), -1, dtype=torch.int32, device=ctx.device)
        self.lens = torch.zeros((T,), dtype=torch.int32, device=ctx.device)

    def fused_tasks(self, ctx: BuildContext):
        s = self.spec
        return super().fused_tasks(ctx) + [FusedTask("causal", (self.indices, self.lens), gid=s.gid,
                                                     a=s.compress_ratio, b=s.rows_per_block,
                                                     width=self.indices.shape[1], query=True)]

    def launch(self, ctx: BuildContext):
        super().launch(ctx)
        self.launch_query(ctx)

    def query_fields(self) -> frozenset:
        return frozenset({"indices", "lens"})

    def launch_query(self, ctx: BuildContext):
        s, B, Tqp = self.spec, ctx.num_reqs, ctx.num_query_tokens_padded
        causal_compressed_indices(ctx.query_qsl(), ctx.seq_lens[:B], ctx.tables[s.gid],
                                  s.rows_per_block, s.compress_ratio, self._width, out=self.indices[:Tqp],
                                  out_lens=self.lens[:Tqp], **self.query_args(ctx))

    def views(self, ctx: BuildContext):
        Tqp = ctx.num_query_tokens_padded
        return self.meta(ctx, indices=self.indices[:Tqp], lens=self.lens[:Tqp], **self.compressed_views(ctx))
