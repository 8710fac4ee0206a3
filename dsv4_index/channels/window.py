"""Raw-token channel of a sliding or circular group (``swa``, compressor-state caches): the slot
mapping and the window index lists; for a circular group also the write plan
(``tail_slot_mapping``) and window lists split at the chunk start (docs/DESIGN.md §4 "circular group")."""

from __future__ import annotations

from typing import Optional

import torch

from ..fused.tasks import FusedTask
from ..ops import slot_mapping, window_indices
from ..ops.slot_mapping.naive import tail_floor
from .base import BuildContext, ChannelBuilder

__all__ = ["WindowChannel"]


class WindowChannel(ChannelBuilder):
    """``slot_mapping`` int64 ``[T]`` and window ``indices`` int32 ``[T, width]`` + ``lens`` of one
    group (window ``spec.window``, width ``spec.index_width or window``). Circular groups: also
    ``tail_slot_mapping`` int64 ``[T]`` (the write plan), and window entries inside the step's chunk
    are in-step token rows ``-2 - row``.

    The window lists of an ``swa`` group (the decoder's) are per query token (``[T_q_pad]`` rows: docs/DESIGN.md §5
    "Source rows ≠ query rows"); a compressor-state group's are per source token, as its slot mappings."""

    query_batch = True

    @property
    def int32_unit(self) -> int:
        return self.group.block_size

    @property
    def circular(self) -> bool:
        return self.group.kind == "circular"

    def allocate(self, ctx: BuildContext):
        self._window = self.required("window")
        T, width = ctx.max_num_tokens, self.spec.index_width or self._window
        self.slots = torch.full((T,), -1, dtype=torch.int64, device=ctx.device)
        self.indices = torch.full((T, width), -1, dtype=torch.int32, device=ctx.device)
        self.lens = torch.zeros((T,), dtype=torch.int32, device=ctx.device)
        self.tail: Optional[torch.Tensor] = None
        # NOTE: unfused path: per-request write floor of the tail plan (persistent: build allocates nothing)
        self._tail_floor: Optional[torch.Tensor] = None
        if self.circular:
            self.tail = torch.full((T,), -1, dtype=torch.int64, device=ctx.device)
            self._tail_floor = torch.zeros((T + 1,), dtype=torch.int32, device=ctx.device)
        self._ring = not self.circular and ctx.ring_cols[self.spec.gid] > 0
        self._capacity: Optional[int] = self.group.ring_capacity if self.circular else None
        self.query_side = not self.circular and self.group.role == "swa"  # NOTE: the decoder reads these lists

    def fused_tasks(self, ctx: BuildContext):
        return [FusedTask("window", (self.indices, self.lens, self.slots, self.tail), gid=self.spec.gid,
                          a=self.kernel_block_size, b=self._window, width=self.indices.shape[1],
                          write_floor=self.group.prefix_cacheable, window_floor=True, circular=self.circular,
                          query=self.query_side)]

    def launch(self, ctx: BuildContext):
        B, Tp = ctx.num_reqs, ctx.num_tokens_padded
        bt, kw, ring, cap = ctx.tables[self.spec.gid], self.batch_args(ctx), self._ring, self._capacity
        replay_end = ctx.replay_end[:B] if self.group.prefix_cacheable else None
        slot_mapping(ctx.query_start_loc[:B + 1], ctx.seq_lens[:B], bt, self.kernel_block_size,
                     blocks_per_kv_block=self.group.blocks_per_kv_block, replay_end=replay_end,
                     out=self.slots[:Tp], ring=ring, circular_capacity=cap, **kw)
        if self.circular:
            assert self.tail is not None and self._tail_floor is not None  # NOTE: allocated when circular
            floor = tail_floor(ctx.seq_lens[:B], self.group.ring_capacity, replay_end, out=self._tail_floor[:B])
            slot_mapping(ctx.query_start_loc[:B + 1], ctx.seq_lens[:B], bt, self.kernel_block_size,
                         replay_end=floor, out=self.tail[:Tp], ring=ring, circular_capacity=cap, **kw)
        if self.query_side:
            self.launch_query(ctx)
        else:
            window_indices(ctx.query_start_loc[:B + 1], ctx.seq_lens[:B], bt, self.kernel_block_size,
                           self._window, replay_start=ctx.replay_start[:B], out=self.indices[:Tp],
                           out_lens=self.lens[:Tp], ring=ring, circular_capacity=cap, **kw)

    def query_fields(self) -> frozenset:
        return frozenset({"indices", "lens"}) if self.query_side else frozenset()

    def launch_query(self, ctx: BuildContext):
        if not self.query_side:
            return
        B, Tqp = ctx.num_reqs, ctx.num_query_tokens_padded
        window_indices(ctx.query_qsl(), ctx.seq_lens[:B], ctx.tables[self.spec.gid], self.kernel_block_size,
                       self._window, replay_start=ctx.replay_start[:B], out=self.indices[:Tqp],
                       out_lens=self.lens[:Tqp], ring=self._ring, circular_capacity=self._capacity,
                       **self.query_args(ctx))

    def views(self, ctx: BuildContext):
        Tp = ctx.num_tokens_padded
        Tl = ctx.num_query_tokens_padded if self.query_side else Tp
        tail = None if self.tail is None else self.tail[:Tp]  # NOTE: allocated exactly when circular
        return self.meta(ctx, slot_mapping=self.slots[:Tp], tail_slot_mapping=tail, indices=self.indices[:Tl],
                         lens=self.lens[:Tl])
