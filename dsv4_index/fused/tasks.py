"""What a builder contributes to the fused launch: :class:`FusedTask` descriptors, and their packed
device form (a ``constexpr`` tuple per task plus a row of output addresses and table words; the kind,
field, flag and word numbers below are the only place that form is written, the kernel imports them).

Token tasks run per tile of token rows (and column chunks for index lists, :class:`TileConfig`);
request tasks per tile of ``BLOCK_R`` batch rows. Every output covers ``[0, T_pad)``
(``[0, T_pad]`` for per-request arrays): padded tokens get ``-1`` / ``0``.

The parameters ``a`` / ``b`` of a task mean what its row says; the packed fields have one name per
meaning (``S_BLOCK_SIZE``, ``S_WINDOW``, ``S_RATIO``, ``S_ROWS_PER_BLOCK``, ``S_NEXT_N``).

=============  ===============================================  =================================
kind           outputs (out0, out1, out2)                        params
=============  ===============================================  =================================
COMMON         token_to_req i32 [T], positions i64 [T],          -
               is_valid_token bool [T]
WINDOW         indices i32 [T, width], lens i32 [T],             a = block_size, b = W,
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
QUERY_MAP      token_to_req_q i32 [T], q_to_src i32 [T]          - (query rows; a plain step: none)
QUERY_QSL      query_start_loc_q i32 [T_pad + 1]                 - (a plain step: none)
=============  ===============================================  =================================

A task flagged ``query`` (``FLAG_QUERY``: window lists of ``swa`` groups, causal lists, indexer lengths,
token rows, decode lengths) runs over the query batch of a step declaring source rows != query rows
(docs/DESIGN.md §5; :mod:`dsv4_index.fused.query`): its rows are query rows, each read at its source row's
batch row and position; a flagged window task still writes its slot mapping per source token. A plain step
runs it as an unflagged one.

NOTE: the numbers are ``tl.constexpr`` objects (Triton reads a global in ``@triton.jit`` code only as
one; the interpreter reads plain ints too, so a plain int would pass the CPU tests and fail to compile).
On the host they index lists and arrays (``__index__``); convert with ``int()`` before arithmetic whose
result is stored (``constexpr + int`` is a ``constexpr``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .._triton import tl
__all__ = ["FusedTask", "TileConfig", "TOKEN_KINDS", "REQUEST_KINDS", "QUERY_KINDS", "plain_tasks"]

KINDS = {"common": 0, "window": 1, "compressed": 2, "causal": 3, "indexer": 4, "token_rows": 5, "query_map": 6,
         "query_qsl": 7, "requests": 8, "decode_lens": 9, "staged_copy": 10, "replays": 11}
TOKEN_KINDS = frozenset({"common", "window", "compressed", "causal", "indexer", "token_rows", "query_map"})
REQUEST_KINDS = frozenset({"requests", "decode_lens", "staged_copy", "replays", "query_qsl"})
QUERY_KINDS = frozenset({"query_map", "query_qsl"})  # the query batch's own tasks (a declared step only)
COMMON: tl.constexpr = tl.constexpr(KINDS["common"])
WINDOW: tl.constexpr = tl.constexpr(KINDS["window"])
COMPRESSED: tl.constexpr = tl.constexpr(KINDS["compressed"])
CAUSAL: tl.constexpr = tl.constexpr(KINDS["causal"])
INDEXER: tl.constexpr = tl.constexpr(KINDS["indexer"])
TOKEN_ROWS: tl.constexpr = tl.constexpr(KINDS["token_rows"])
REQUESTS: tl.constexpr = tl.constexpr(KINDS["requests"])
DECODE_LENS: tl.constexpr = tl.constexpr(KINDS["decode_lens"])
STAGED_COPY: tl.constexpr = tl.constexpr(KINDS["staged_copy"])
REPLAYS: tl.constexpr = tl.constexpr(KINDS["replays"])
QUERY_MAP: tl.constexpr = tl.constexpr(KINDS["query_map"])
QUERY_QSL: tl.constexpr = tl.constexpr(KINDS["query_qsl"])

# NOTE: what never changes for a layout (kinds, parameters, widths, DCP, flags, tiles) is packed into
# ``NF`` ints per task (fields ``S_*``, one flat ``constexpr`` tuple per launch variant: field F of task
# TI is ``TAB[TI * NF + F]``), so the kernel is compiled once per layout and tile variant; only the output
# addresses and the table geometry (capacity-dependent) stay in device memory (``outs``, below).
S_KIND: tl.constexpr = tl.constexpr(0)     # KINDS value
S_TASK: tl.constexpr = tl.constexpr(1)     # the task's row of ``outs``
_S_A = 2                                   # FusedTask.a, read under its per-kind names below
_S_B = 3                                   # FusedTask.b, read under its per-kind names below
S_WIDTH: tl.constexpr = tl.constexpr(4)    # row width (row stride) of a 2-D output
S_RING: tl.constexpr = tl.constexpr(5)     # 1: the group's table is a ring (its width is a runtime word)
S_CPW: tl.constexpr = tl.constexpr(6)      # DCP world size, rank, interleave of the group
S_CPR: tl.constexpr = tl.constexpr(7)
S_CPI: tl.constexpr = tl.constexpr(8)
S_GID: tl.constexpr = tl.constexpr(9)      # the group, 0 without one (the kernel reads the runtime word G_GID)
S_FLAGS: tl.constexpr = tl.constexpr(10)   # FLAG_* bits
S_EXTRA: tl.constexpr = tl.constexpr(11)   # index of the staged per-request array (state/staging.py "extra")
S_HAS: tl.constexpr = tl.constexpr(12)     # bit k (HAS_OUTk): output k is given
S_MUL: tl.constexpr = tl.constexpr(13)     # S_MUL + k: output k's offset unit (16 // esize if 16-byte aligned, else 1)
# tile fields of a token unit (token_units; 0 in request specs)
S_BT: tl.constexpr = tl.constexpr(17)      # token rows per program
S_BC: tl.constexpr = tl.constexpr(18)      # columns per chunk
S_NCHUNK: tl.constexpr = tl.constexpr(19)  # chunks per program (whole rows: every chunk of the row)
S_START: tl.constexpr = tl.constexpr(20)   # first program of the unit in a super tile
S_NPROG: tl.constexpr = tl.constexpr(21)   # programs of one task of the unit per super tile
S_REP: tl.constexpr = tl.constexpr(22)     # tasks of the unit: S_TASK, S_TASK + 1, ... (same code, own outs rows)
S_FOLD: tl.constexpr = tl.constexpr(23)    # window units of one-chunk lists: tasks per program (0: one, unfolded)
S_SPLIT: tl.constexpr = tl.constexpr(24)   # 1: a folded unit's rows run one per lane, then its tiles (fused/rows.py)
NF: tl.constexpr = tl.constexpr(25)
MAX_OUTPUTS = 4

# the parameter fields under their per-kind names (module table)
S_BLOCK_SIZE: tl.constexpr = tl.constexpr(_S_A)      # WINDOW: block_size of the table as the kernel reads it
S_WINDOW: tl.constexpr = tl.constexpr(_S_B)          # WINDOW: W
S_RATIO: tl.constexpr = tl.constexpr(_S_A)           # COMPRESSED, CAUSAL, INDEXER, TOKEN_ROWS, DECODE_LENS: R
S_ROWS_PER_BLOCK: tl.constexpr = tl.constexpr(_S_B)  # COMPRESSED, CAUSAL: S
S_NEXT_N: tl.constexpr = tl.constexpr(_S_B)          # DECODE_LENS: next_n

# S_FLAGS bits
FLAG_WRITE_FLOOR: tl.constexpr = tl.constexpr(1)   # writes stop below replay_end (prefix-cacheable group)
FLAG_WINDOW_FLOOR: tl.constexpr = tl.constexpr(2)  # windows start at replay_start at the earliest
FLAG_CIRCULAR: tl.constexpr = tl.constexpr(4)      # circular group: in-step window entries -2 - row, out3 = write plan
FLAG_QUERY: tl.constexpr = tl.constexpr(8)         # rows of the query batch (a step declaring query_lens)


def has_bit(k: int) -> int:
    """The ``S_HAS`` bit of output ``k``."""
    return 1 << k


# S_HAS bits the kernel tests (the optional outputs of the module table)
HAS_OUT1: tl.constexpr = tl.constexpr(has_bit(1))
HAS_OUT2: tl.constexpr = tl.constexpr(has_bit(2))
HAS_OUT3: tl.constexpr = tl.constexpr(has_bit(3))

# ``outs``: int64 [num_tasks, OUTS_WORDS]; words [0, MAX_OUTPUTS): output k's offset from its dtype's base (in
# units of S_MUL + k), then from OUTS_GEO the table words of geometry(): G_TABLE (the table's offset in the flat
# buffer), G_STRIDE (row stride), G_WIDTH (logical width), G_RING (ring width), G_GID (the group: overlay records);
# last, O_SCRATCH: a split window task's scratch (int32 offset from the 4-byte base, ``SPLIT_WORDS`` words a token)
GEO_WORDS = 5
OUTS_GEO: tl.constexpr = tl.constexpr(MAX_OUTPUTS)
O_SCRATCH: tl.constexpr = tl.constexpr(MAX_OUTPUTS + GEO_WORDS)
OUTS_WORDS: tl.constexpr = tl.constexpr(MAX_OUTPUTS + GEO_WORDS + 1)
SPLIT_WORDS: tl.constexpr = tl.constexpr(11)
G_TABLE: tl.constexpr = tl.constexpr(0)
G_STRIDE: tl.constexpr = tl.constexpr(1)
G_WIDTH: tl.constexpr = tl.constexpr(2)
G_RING: tl.constexpr = tl.constexpr(3)
G_GID: tl.constexpr = tl.constexpr(4)
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
        instead of one per column; window lists one per block when a chunk spans at most three.
    fold : window units whose lists are one chunk (``width <= bc``) run ``fold`` of their ``S_REP`` tasks
        in one program, every table read before any store (``fold`` divides ``S_REP``, else 1); 0: off.
    split : folded units whose chunk spans at most three blocks (``block_loads``) run ``split`` token rows
        (at least their own) a program, one row per lane first, then their tiles (``fused/rows.py``); 0: off.
    maxnreg : registers per thread the compiled variant may use (0: the compiler's choice).
    """

    bt1: int = 8
    bt2: int = 8
    bc: int = 128
    whole_row: bool = False
    num_warps: int = 4
    block_loads: bool = False
    fold: int = 0
    maxnreg: int = 0
    split: int = 0

    def __post_init__(self):
        for name in ("bt1", "bt2", "bc") + (("split",) if self.split else ()):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def task_spec(i: int, t: "FusedTask", group_cp, muls: Sequence[int], ring: bool) -> Tuple[int, ...]:
    """The pipeline-constant fields of task ``i`` (every field but the tile fields, which are 0).

    NOTE: the table's offset, row stride, logical width and ring width depend on the capacity
    (``max_num_reqs``, ``max_num_batched_tokens``), so they are runtime words (``geometry``) and a
    server-sized and an exactly-sized pipeline of one layout share the compiled kernel;
    ``S_RING`` only says whether the table is a ring.
    """
    s = [0] * int(NF)
    s[S_KIND], s[S_TASK], s[_S_A], s[_S_B], s[S_WIDTH] = KINDS[t.kind], i, int(t.a), int(t.b), int(t.width)
    s[S_RING] = int(ring)
    s[S_CPW], s[S_CPR], s[S_CPI] = map(int, group_cp(t.gid)) if t.gid is not None else (1, 0, 1)
    s[S_GID] = t.gid if t.gid is not None else 0
    s[S_FLAGS] = sum(int(bit) for bit, on in ((FLAG_WRITE_FLOOR, t.write_floor), (FLAG_WINDOW_FLOOR, t.window_floor),
                                             (FLAG_CIRCULAR, t.circular), (FLAG_QUERY, t.query)) if on)
    s[S_EXTRA] = int(t.extra)
    s[S_HAS] = sum(has_bit(k) for k, o in enumerate(t.outputs) if o is not None)
    for k, m in enumerate(muls):
        s[S_MUL + k] = int(m)
    return tuple(s)


def geometry(t: "FusedTask", tables) -> Tuple[int, ...]:
    """Runtime table words of a task, in ``G_*`` order: (table offset in the flat buffer, row stride,
    logical width, ring width, gid); zeros without a group."""
    words = [0] * GEO_WORDS
    if t.gid is None:
        return tuple(words)
    g = t.gid
    words[G_TABLE] = (tables.tables[g].data_ptr() - tables.flat.data_ptr()) // 4
    words[G_STRIDE] = int(tables.tables[g].stride(0))
    words[G_WIDTH], words[G_RING], words[G_GID] = int(tables.width[g]), int(tables.ring[g]), int(g)
    return tuple(words)


def _same_code(a: Sequence[int], b: Sequence[int]) -> bool:
    """Specs that compile to the same code: equal in every field but the task's row and its group."""
    return all(x == y for f, (x, y) in enumerate(zip(a, b)) if f not in (S_TASK, S_GID))


def code_order(tasks: Sequence["FusedTask"]) -> List[int]:
    """An order of token tasks in which tasks that would compile to the same code (:func:`_same_code`:
    e.g. one window task per sliding group of equal geometry) are adjacent, the first of each kind of
    code keeping its place (a layout without such repeats keeps its order)."""
    def sig(t: "FusedTask") -> tuple:
        return (t.kind, t.a, t.b, t.width, t.write_floor, t.window_floor, t.circular, t.query, t.extra,
                tuple(None if o is None else (o.dtype, o.data_ptr() % 16 == 0) for o in t.outputs))
    groups: dict = {}
    for i, t in enumerate(tasks):
        groups.setdefault(sig(t), []).append(i)
    return [i for idx in groups.values() for i in idx]


def token_units(specs: Sequence[Tuple[int, ...]], tasks: Sequence["FusedTask"], cfg: TileConfig):
    """Unit specs (task spec with its tile fields ``S_BT`` .. ``S_NPROG``, flattened) of the token tasks
    under ``cfg``, and the super tile (tokens, programs): every super tile of ``T_SUPER`` tokens runs
    ``P_SUPER`` programs."""
    shapes = []
    for t in tasks:
        if t.kind in TWO_D:
            bc = min(cfg.bc, _pow2(t.width))
            bt = min(cfg.bt2 * max(cfg.bc // bc, 1), max(cfg.bt1, cfg.bt2))
            chunks = -(-t.width // bc)
            shapes.append((bt, bc, chunks, 1) if cfg.whole_row else (bt, bc, 1, chunks))
        else:
            shapes.append((cfg.bt1, 1, 1, 1))
    t_super = max([bt for bt, *_ in shapes] or [1])
    units: List[List[int]] = []
    for s, (bt, bc, nchunk, ncu) in zip(specs, shapes):
        nprog = ncu * (t_super // bt)
        u = list(s)
        u[S_BT], u[S_BC], u[S_NCHUNK], u[S_NPROG], u[S_REP] = bt, bc, nchunk, nprog, 1
        last = units[-1] if units else None
        # NOTE: a task compiling to the last unit's code, in the next outs row, joins that unit (the
        # kernel's code grows with the kinds of code, not with the number of groups)
        if last is not None and _same_code(last[:S_START], u[:S_START]) and last[S_NPROG] == nprog \
                and u[S_TASK] == last[S_TASK] + last[S_REP]:
            last[S_REP] += 1
        else:
            units.append(u)
    start = 0
    for u in units:
        # NOTE: a folded window program runs S_FOLD tasks of its unit (one chunk each: width <= bc)
        one_chunk = u[S_KIND] == KINDS["window"] and u[S_NCHUNK] == 1 and u[S_NPROG] == t_super // u[S_BT]
        u[S_FOLD] = (cfg.fold if u[S_REP] % cfg.fold == 0 else 1) if cfg.fold > 0 and one_chunk else 0
        if u[S_FOLD] and cfg.split and cfg.block_loads and 2 * u[S_BLOCK_SIZE] >= u[S_BC]:
            u[S_SPLIT], u[S_BT] = 1, min(max(u[S_BT], cfg.split), t_super)
            u[S_NPROG] = t_super // u[S_BT]
        u[S_START] = start
        start += u[S_NPROG] * (u[S_REP] // max(u[S_FOLD], 1))
    return tuple(v for u in units for v in u), t_super, max(start, 1)


def request_specs(specs: Sequence[Tuple[int, ...]]) -> Tuple[int, ...]:
    """Request task specs, flattened (tile fields 0)."""
    return tuple(v for s in specs for v in s)


@dataclass(frozen=True)
class FusedTask:
    """One piece of the fused launch, as a builder declares it.

    Attributes
    ----------
    kind : str — a key of ``KINDS`` (see the module table).
    outputs : tuple of tensors (or None), up to four, as the kind's table row lists them; each a
        contiguous persistent buffer at capacity.
    gid : int or None — the group whose table, overlay, ring and DCP sharding the task uses.
    a, b : int — the kind's parameters (module table; packed as ``S_BLOCK_SIZE`` / ``S_RATIO`` and
        ``S_WINDOW`` / ``S_ROWS_PER_BLOCK`` / ``S_NEXT_N``).
    width : int — row width of a 2-D output (its row stride); 0 for 1-D outputs.
    write_floor, window_floor : bool — apply ``replay_end`` to writes / ``replay_start`` to windows.
    circular : bool — window task of a circular group (docs/DESIGN.md §4): entries inside the step's chunk
        are in-step token rows ``-2 - row``; ``out3`` (when given) is the write plan.
    extra : int — index of a staged per-request array (the plan fills it from the builder's index).
    query : bool — rows of the query batch (``FLAG_QUERY``, module docstring).
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
    query: bool = False

    def key(self) -> tuple:
        """Identical tasks (same kind and outputs) run once, whoever declares them."""
        return (self.kind,) + tuple(0 if o is None else o.data_ptr() for o in self.outputs)


def plain_tasks(tasks: Sequence[FusedTask]) -> List[FusedTask]:
    """``tasks`` for a launch that never sees a declared step: the query-map tasks dropped and ``query`` cleared
    (the plain step's outputs are the same; ``FLAG_QUERY`` and the query kinds are ``constexpr``, so the kernel
    then compiles none of the query paths)."""
    return [dataclasses.replace(t, query=False) if t.query else t for t in tasks if t.kind not in QUERY_KINDS]
