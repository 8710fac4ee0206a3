"""Built-in channel builders (DESIGN §3–§4). Each one calls the functional ops into its persistent buffers."""

from __future__ import annotations

import torch

from .. import (causal_compressed_indices, compressed_slot_mapping, indexer_lengths, slot_mapping,
                topk_to_slots, window_indices)
from .base import BuildContext, ChannelBuilder, register_channel


def _batch(ctx: BuildContext, builder: ChannelBuilder):
    return ctx.query_start_loc, ctx.seq_lens, ctx.block_tables[builder.spec.gid]


class WindowChannel(ChannelBuilder):
    """Raw-token channel of a sliding group: slot mapping and window index lists (``swa``, state caches)."""

    def allocate(self, ctx):
        T, W = ctx.max_num_tokens, self.spec.index_width or self.spec.window
        self.slots = torch.full((T,), -1, dtype=torch.int64, device=ctx.device)
        self.indices = torch.full((T, W), -1, dtype=torch.int32, device=ctx.device)
        self.lens = torch.zeros((T,), dtype=torch.int32, device=ctx.device)

    def launch(self, ctx):
        qsl, sl, bt = _batch(ctx, self)
        Tp = ctx.num_tokens_padded
        slot_mapping(qsl, sl, bt, self.kernel_block_size, blocks_per_kv_block=self.group.blocks_per_kv_block,
                     num_tokens=ctx.num_tokens, out=self.slots[:Tp], **ctx.cp_kwargs())
        window_indices(qsl, sl, bt, self.kernel_block_size, self.spec.window, replay_start=ctx.replay_start,
                       num_tokens=ctx.num_tokens, out=self.indices[:Tp], out_lens=self.lens[:Tp],
                       **ctx.cp_kwargs())

    def views(self, ctx):
        Tp = ctx.num_tokens_padded
        return self._meta(ctx, slot_mapping=self.slots[:Tp], indices=self.indices[:Tp], lens=self.lens[:Tp])


class _CompressedBase(ChannelBuilder):
    """Compressed slot mapping, computed once per step for every channel of identical geometry."""

    def allocate(self, ctx):
        s = self.spec
        self.shared_key = ("compressed_slot_mapping", s.gid, s.compress_ratio, s.rows_per_block)
        self.compressed = ctx.shared_buffer(self.shared_key, (ctx.max_num_tokens,), torch.int64)

    def launch(self, ctx):
        qsl, sl, bt = _batch(ctx, self)
        s, Tp = self.spec, ctx.num_tokens_padded
        ctx.once(self.shared_key, lambda: compressed_slot_mapping(
            qsl, sl, bt, s.rows_per_block, s.compress_ratio, num_tokens=ctx.num_tokens,
            out=self.compressed[:Tp], **ctx.cp_kwargs()))


class CompressedChannel(_CompressedBase):
    """Compressed cache read through the indexer's top-k (``c4a``): compressed slots + top-k conversion."""

    def allocate(self, ctx):
        super().allocate(ctx)
        self.k_capacity = max(1, int(getattr(self.layout, "index_topk", 0) or 1))
        self.topk_flat = torch.full((ctx.max_num_tokens * self.k_capacity,), -1, dtype=torch.int32,
                                    device=ctx.device)
        self.topk_lens = torch.zeros((ctx.max_num_tokens,), dtype=torch.int32, device=ctx.device)

    def views(self, ctx):
        return self._meta(ctx, compressed_slot_mapping=self.compressed[:ctx.num_tokens_padded])

    def topk_to_slots(self, ctx, topk):
        if not isinstance(topk, torch.Tensor) or topk.dim() != 2:
            raise ValueError(f"topk must be a 2-D tensor [T, K], got {getattr(topk, 'shape', topk)!r}")
        Tp, K = ctx.num_tokens_padded, topk.shape[1]
        if K > self.k_capacity:
            raise ValueError(f"topk has K = {K} columns, channel {self.spec.name!r} was sized for "
                             f"index_topk = {self.k_capacity}")
        qsl, sl, bt = _batch(ctx, self)
        out = self.topk_flat[:Tp * K].view(Tp, K)
        return topk_to_slots(topk, qsl, sl, bt, self.spec.rows_per_block, self.spec.compress_ratio,
                             num_tokens=ctx.num_tokens, out=out, out_lens=self.topk_lens[:Tp],
                             **ctx.cp_kwargs())


class IndexerChannel(_CompressedBase):
    """Lightning-indexer cache (``c4i``): compressed slots (shared with ``c4a``) and indexer lengths.

    With ``"indices"`` among the spec's outputs it also lists every visible compressed row per token
    (causal list of width ``spec.index_width``), which small reference models use to gather index keys.
    """

    def allocate(self, ctx):
        super().allocate(ctx)
        T, B, dev = ctx.max_num_tokens, ctx.max_num_reqs, ctx.device
        self.lens = torch.zeros((T,), dtype=torch.int32, device=dev)
        self.ks = torch.zeros((T,), dtype=torch.int32, device=dev)
        self.ke = torch.zeros((T,), dtype=torch.int32, device=dev)
        self.cu = torch.zeros((B + 1,), dtype=torch.int32, device=dev)
        self.decode_lens = torch.zeros((B, ctx.next_n), dtype=torch.int32, device=dev)
        self.with_indices = "indices" in self.spec.outputs
        if self.with_indices:
            self.indices = torch.full((T, self.spec.index_width), -1, dtype=torch.int32, device=dev)
            self.index_lens = torch.zeros((T,), dtype=torch.int32, device=dev)

    def launch(self, ctx):
        super().launch(ctx)
        s, Tp = self.spec, ctx.num_tokens_padded
        qsl, sl, bt = _batch(ctx, self)
        indexer_lengths(qsl, sl, s.compress_ratio, next_n=ctx.next_n, num_decodes=ctx.num_decodes,
                        num_tokens=ctx.num_tokens, out=self.lens[:Tp], out_decode=self.decode_lens,
                        out_ks=self.ks[:Tp], out_ke=self.ke[:Tp], out_cu=self.cu, **ctx.cp_kwargs())
        if self.with_indices:
            causal_compressed_indices(qsl, sl, bt, s.rows_per_block, s.compress_ratio, s.index_width,
                                      num_tokens=ctx.num_tokens, out=self.indices[:Tp],
                                      out_lens=self.index_lens[:Tp], **ctx.cp_kwargs())

    def views(self, ctx):
        Tp = ctx.num_tokens_padded
        extra = {"indices": self.indices[:Tp]} if self.with_indices else {}
        return self._meta(ctx, compressed_slot_mapping=self.compressed[:Tp], lens=self.lens[:Tp],
                          ks=self.ks[:Tp], ke=self.ke[:Tp], cu=self.cu[:ctx.num_reqs + 1],
                          decode_lens=self.decode_lens[:ctx.num_decodes], **extra)


class CausalCompressedChannel(_CompressedBase):
    """Compressed cache read whole (``c128a``): compressed slots + every visible row per token."""

    def allocate(self, ctx):
        super().allocate(ctx)
        T = ctx.max_num_tokens
        self.indices = torch.full((T, self.spec.index_width), -1, dtype=torch.int32, device=ctx.device)
        self.lens = torch.zeros((T,), dtype=torch.int32, device=ctx.device)

    def launch(self, ctx):
        super().launch(ctx)
        s, Tp = self.spec, ctx.num_tokens_padded
        qsl, sl, bt = _batch(ctx, self)
        causal_compressed_indices(qsl, sl, bt, s.rows_per_block, s.compress_ratio, s.index_width,
                                  num_tokens=ctx.num_tokens, out=self.indices[:Tp], out_lens=self.lens[:Tp],
                                  **ctx.cp_kwargs())

    def views(self, ctx):
        Tp = ctx.num_tokens_padded
        return self._meta(ctx, compressed_slot_mapping=self.compressed[:Tp], indices=self.indices[:Tp],
                          lens=self.lens[:Tp])


for _name, _cls in (("swa", WindowChannel), ("c4_state", WindowChannel), ("c128_state", WindowChannel),
                    ("c4a", CompressedChannel), ("c4i", IndexerChannel), ("c128a", CausalCompressedChannel)):
    register_channel(_name, _cls)
