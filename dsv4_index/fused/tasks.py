"""What a builder contributes to the fused launch: :class:`FusedTask` descriptors, and their packed
device form (a ``constexpr`` tuple per task plus the output addresses; the field and kind numbers
below are the only place the layout is written, the kernel imports them).

Token tasks run per tile of token rows (and column chunks for index lists, :class:`TileConfig`);
request tasks per tile of ``BLOCK_R`` batch rows. Every output covers ``[0, T_pad)``
(``[0, T_pad]`` for per-request arrays): padded tokens get ``-1`` / ``0``.

=============  ===============================================  =================================
kind           outputs (out0, out1, out2)                        params
=============  ===============================================  =================================
COMMON         token_to_req i32 [T], positions i64 [T],          -
               is_valid_token bool [T]
WINDOW         indices i32 [T, width], lens i32 [T],             a = block size, b = window,
               slot_mapping i64 [T] (or none),                   width, group, floor flags,
               out3: tail_slot_mapping i64 [T] (or none)         circular flag (in-step split)
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
__all__ = ["FusedTask", "TileConfig", "TOKEN_KINDS", "REQUEST_KINDS"]

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

# NOTE: what never changes for a layout (kinds, parameters, widths, DCP, flags, tiles) is packed into
# ``NF`` ints per task (fields ``S_*``, one flat ``constexpr`` tuple per launch variant), so the kernel
# is compiled once per layout and tile variant; only the output addresses and the table geometry
# (capacity-dependent) stay in device memory (``outs``, int64 [num_tasks, 8]: four output offsets,
# then ``geometry()``). ``S_MUL + k``: output k's offset unit (elements per 16 bytes when 16-byte
# aligned, else 1). ``S_TOFF``, ``S_STRIDE``, ``S_TWIDTH`` are unused (0).
S_KIND, S_TASK, S_A, S_B, S_WIDTH, S_TOFF, S_STRIDE, S_TWIDTH, S_RING, S_CPW, S_CPR, S_CPI, S_GID, S_FLAGS, \
    S_EXTRA, S_HAS, S_MUL, S_BT, S_BC, S_NCHUNK, S_NCU, S_START, S_NPROG = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, \
    12, 13, 14, 15, 16, 20, 21, 22, 23, 24, 25
NF = 26
FLAG_WRITE_FLOOR = 1    # writes stop below replay_end (prefix-cacheable group)
FLAG_WINDOW_FLOOR = 2   # windows start at replay_start at the earliest
FLAG_CIRCULAR = 4       # circular group: in-step window entries -2 - row, out3 = the write plan
TWO_D = frozenset({"window", "causal"})
ESIZE = {torch.int32: 4, torch.int64: 8, torch.int8: 1, torch.bool: 1}


@dataclass(frozen=True)
class TileConfig:
    """How token tasks are cut into programs (one compiled variant per config).

    bt1 : token rows per program of 1-D tasks; bt2 : token rows per program of index lists at
    ``bc`` columns (narrower lists get proportionally more rows, up to ``max(bt1, bt2)``); bc :
    columns per chunk;
    whole_row : one program writes whole index-list rows (a loop over chunks, the chunks past
    every token's length stored as ``-1`` with no table work) instead of one chunk per program.
    block_loads : causal lists read one table entry per block (``S`` columns) and expand it,
        instead of one per column.
    """

    bt1: int = 8
    bt2: int = 8
    bc: int = 128
    whole_row: bool = False
    num_warps: int = 4
    block_loads: bool = False

    def __post_init__(self):
        for name in ("bt1", "bt2", "bc"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def task_spec(i: int, t: "FusedTask", group_cp, muls, ring: bool) -> tuple:
    """The pipeline-constant fields of task ``i`` (``S_KIND`` .. ``S_MUL + 3``).

    NOTE: the table's offset, row stride, logical width and ring width depend on the capacity
    (``max_num_reqs``, ``max_num_batched_tokens``), so they are runtime words (``geometry``) and a
    server-sized and an exactly-sized pipeline of one layout share the compiled kernel;
    ``S_RING`` only says whether the table is a ring.
    """
    cp = tuple(map(int, group_cp(t.gid))) if t.gid is not None else (1, 0, 1)
    flags = (FLAG_WRITE_FLOOR if t.write_floor else 0) | (FLAG_WINDOW_FLOOR if t.window_floor else 0) | \
        (FLAG_CIRCULAR if t.circular else 0)
    has = sum(1 << k for k, o in enumerate(t.outputs) if o is not None)
    return (KINDS[t.kind], i, int(t.a), int(t.b), int(t.width), 0, 0, 0, int(ring), *cp,
            t.gid if t.gid is not None else 0, flags, int(t.extra), has, *muls)


def geometry(t: "FusedTask", tables) -> tuple:
    """Runtime table words of a task: (table offset in the flat buffer, row stride, logical width,
    ring width); zeros without a group."""
    if t.gid is None:
        return (0, 0, 0, 0)
    g = t.gid
    return ((tables.tables[g].data_ptr() - tables.flat.data_ptr()) // 4, int(tables.tables[g].stride(0)),
            int(tables.width[g]), int(tables.ring[g]))


def token_units(specs, tasks, cfg: TileConfig):
    """Unit specs (task spec + ``S_BT`` .. ``S_NPROG``, flattened) of the token tasks under ``cfg``, and
    the super tile (tokens, programs): every super tile of ``T_SUPER`` tokens runs ``P_SUPER`` programs."""
    shapes = []
    for s, t in zip(specs, tasks):
        if t.kind in TWO_D:
            bc = min(cfg.bc, _pow2(t.width))
            bt = min(cfg.bt2 * max(cfg.bc // bc, 1), max(cfg.bt1, cfg.bt2))
            chunks = -(-t.width // bc)
            shapes.append((bt, bc, chunks, 1) if cfg.whole_row else (bt, bc, 1, chunks))
        else:
            shapes.append((cfg.bt1, 1, 1, 1))
    t_super = max([bt for bt, *_ in shapes] or [1])
    units, start = [], 0
    for s, (bt, bc, nchunk, ncu) in zip(specs, shapes):
        nprog = ncu * (t_super // bt)
        units += list(s) + [bt, bc, nchunk, ncu, start, nprog]
        start += nprog
    return tuple(units), t_super, max(start, 1)


def request_specs(specs) -> tuple:
    """Request task specs, flattened (tile fields 0)."""
    return tuple(v for s in specs for v in tuple(s) + (0,) * (NF - len(s)))


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
    circular : bool — window task of a circular group (docs/DESIGN.md §4): entries inside the step's chunk
        are in-step token rows ``-2 - row``; ``out3`` (when given) is the write plan.
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
    circular: bool = False

    def key(self) -> tuple:
        """Identical tasks (same kind and outputs) run once, whoever declares them."""
        return (self.kind,) + tuple(0 if o is None else o.data_ptr() for o in self.outputs)
