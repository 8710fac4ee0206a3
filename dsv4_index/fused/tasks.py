"""What a builder contributes to the fused launch: :class:`FusedTask` descriptors, and their packed
device form (one int64 row of ``NUM_FIELDS`` per task; the field and kind numbers below are the
only place the layout is written, the kernel imports them).

Token tasks run per tile of ``BLOCK_T`` tokens (and per column tile of ``BLOCK_C`` entries for
index lists); request tasks per tile of ``BLOCK_R`` batch rows. Every output covers ``[0, T_pad)``
(``[0, T_pad]`` for per-request arrays): padded tokens get ``-1`` / ``0``.

=============  ===============================================  =================================
kind           outputs (out0, out1, out2)                        params
=============  ===============================================  =================================
COMMON         token_to_req i32 [T], positions i64 [T],          -
               is_valid_token bool [T]
WINDOW         indices i32 [T, width], lens i32 [T],             a = block size, b = window,
               slot_mapping i64 [T] (or none)                    width, group, floor flags
COMPRESSED     slot_mapping i64 [T], compact i64 [T] (or none)   a = R, b = S, group, extra = cu
CAUSAL         indices i32 [T, width], lens i32 [T]              a = R, b = S, width, group
INDEXER        lens, ks, ke i32 [T]; out3: max(lens, 1) [T]      a = R, group, extra = cu
TOKEN_ROWS     table row i32 [T] (-1 padded), n_c i32 [T]        a = R, group
REQUESTS       query_start_loc, seq_lens, idx_mapping i32        -
               [T_pad + 1]
DECODE_LENS    decode_lens i32 [T_pad, next_n], clamped (>= 1)   a = R, b = next_n, group
               copy i32 [T_pad, next_n] (or none)
STAGED_COPY    copy of staged array ``extra`` i32 [T_pad + 1]    extra
REPLAYS        replay_start, replay_end i32 [T_pad + 1]          -
=============  ===============================================  =================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .._triton import tl
__all__ = ["FusedTask", "TOKEN_KINDS", "REQUEST_KINDS", "NUM_FIELDS"]

# kinds
COMMON: tl.constexpr = tl.constexpr(0)
WINDOW: tl.constexpr = tl.constexpr(1)
COMPRESSED: tl.constexpr = tl.constexpr(2)
CAUSAL: tl.constexpr = tl.constexpr(3)
INDEXER: tl.constexpr = tl.constexpr(4)
TOKEN_ROWS: tl.constexpr = tl.constexpr(5)
REQUESTS: tl.constexpr = tl.constexpr(8)
DECODE_LENS: tl.constexpr = tl.constexpr(9)
STAGED_COPY: tl.constexpr = tl.constexpr(10)
REPLAYS: tl.constexpr = tl.constexpr(11)
KINDS = {"common": 0, "window": 1, "compressed": 2, "causal": 3, "indexer": 4, "token_rows": 5,
         "requests": 8, "decode_lens": 9, "staged_copy": 10, "replays": 11}
TOKEN_KINDS = frozenset({"common", "window", "compressed", "causal", "indexer", "token_rows"})
REQUEST_KINDS = frozenset({"requests", "decode_lens", "staged_copy", "replays"})

# descriptor fields (int64 each)
F_KIND: tl.constexpr = tl.constexpr(0)
F_OUT0: tl.constexpr = tl.constexpr(1)
F_OUT1: tl.constexpr = tl.constexpr(2)
F_OUT2: tl.constexpr = tl.constexpr(3)
F_TABLE: tl.constexpr = tl.constexpr(4)      # address of the group's table row 0
F_STRIDE: tl.constexpr = tl.constexpr(5)     # table row stride
F_TWIDTH: tl.constexpr = tl.constexpr(6)     # logical width bound (int32 max for rings)
F_RING: tl.constexpr = tl.constexpr(7)       # ring width, 0 = plain table
F_A: tl.constexpr = tl.constexpr(8)
F_B: tl.constexpr = tl.constexpr(9)
F_WIDTH: tl.constexpr = tl.constexpr(10)     # index-list row width (= row stride of the output)
F_CPW: tl.constexpr = tl.constexpr(11)
F_CPR: tl.constexpr = tl.constexpr(12)
F_CPI: tl.constexpr = tl.constexpr(13)
F_GROUP: tl.constexpr = tl.constexpr(14)     # overlay group (gid)
F_FLAGS: tl.constexpr = tl.constexpr(15)     # FLAG_* below
F_EXTRA: tl.constexpr = tl.constexpr(16)     # staged array index
F_OUT3: tl.constexpr = tl.constexpr(17)
NUM_FIELDS = 18
FLAG_WRITE_FLOOR: tl.constexpr = tl.constexpr(1)    # writes stop below replay_end (prefix-cacheable group)
FLAG_WINDOW_FLOOR: tl.constexpr = tl.constexpr(2)   # windows start at replay_start at the earliest


@dataclass(frozen=True)
class FusedTask:
    """One piece of the fused launch, as a builder declares it.

    Attributes
    ----------
    kind : str — a key of ``KINDS`` (see the module table).
    outputs : tuple of tensors (or None), up to four, as the kind's table row lists them; each a
        contiguous persistent buffer at capacity.
    gid : int or None — the group whose table, overlay, ring and DCP sharding the task uses.
    a, b : int — the kind's parameters (module table).
    width : int — row width of a 2-D output (its row stride); 0 for 1-D outputs.
    write_floor, window_floor : bool — apply ``replay_end`` to writes / ``replay_start`` to windows.
    extra : int — index of a staged per-request array (the plan fills it from the builder's index).
    """

    kind: str
    outputs: Tuple[Optional[torch.Tensor], ...]
    gid: Optional[int] = None
    a: int = 0
    b: int = 0
    width: int = 0
    write_floor: bool = False
    window_floor: bool = False
    extra: int = -1

    def key(self) -> tuple:
        """Identical tasks (same kind and outputs) run once, whoever declares them."""
        return (self.kind,) + tuple(0 if o is None else o.data_ptr() for o in self.outputs)
