# over 400 lines: the registry of every functional op (a functional op and its _out twin each) in one place
"""The functional ops as ``torch.library`` custom ops (``torch.ops.dsv4_index.<op>``), for forward
passes compiled with ``torch.compile(fullgraph=True)`` and captured in CUDA graphs.

Importing this module registers them::

    import dsv4_index.torch_ops  # noqa: F401  (registers torch.ops.dsv4_index.*)
    idx, lens = torch.ops.dsv4_index.window_indices(qsl, seq_lens, bt, 64, 128, num_tokens=T_pad)

Two forms per op:

* ``dsv4_index::<op>`` is functional: it returns new tensors (shapes from host ints only, so the
  fake implementation needs no device value, and nothing aliases an input). ``num_tokens`` is a
  required keyword: the host-known row count ``T`` of the per-token outputs (the padded count of a
  CUDA-graph batch), so nothing reads ``query_start_loc[-1]`` (no ``.item()``, no graph break).
* ``dsv4_index::<op>_out`` writes caller buffers (keyword-only ``out``, ``out_lens``, ...; declared in
  ``mutates_args``) and returns nothing; ``num_tokens`` is optional (the rows of ``out``).

Signatures, defaults and semantics are those of :mod:`dsv4_index.ops` (``help(dsv4_index.<op>)``),
with these changes: ``compressed_slot_mapping`` has a separate ``compact_compressed_slot_mapping``
(the return type differs); ``indexer_lengths`` takes ``next_n = 0`` for "no decode view" and then
returns ``decode_lens`` of shape ``[num_decodes, 0]``; ``topk_to_slots_rows`` is the pipeline form
(per-token table rows and ``n_c`` from the step build; :func:`topk_to_slots` wraps it for a
:class:`~dsv4_index.metadata.DSV4Metadata`). The real implementation of each op is the public op
(Triton on CUDA, reference on CPU; value checks as documented there); the fake one gives shapes and
dtypes from the arguments.

CUDA graphs (``mode="reduce-overhead"``): call ``pipe.update()`` and ``pipe.build()`` *outside* the
compiled region (``build()`` is host code plus one launch; ``MetadataPipeline(cuda_graphs=True)``
replays its own graph), pass the metadata tensors in, and call the functional ops (above all
:func:`topk_to_slots`, once per indexed layer) inside. Functional ops mutate no graph input, so
Inductor keeps CUDA graphs; an ``_out`` op writing a graph input makes it skip them ("mutated
inputs") unless that buffer is a static address (``torch._dynamo.mark_static_address``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .ops.candidate_blocks_to_physical import candidate_blocks_to_physical_rows
from .ops.candidate_topk_to_slots import candidate_topk_to_slots_rows
from .ops.topk_to_slots import topk_to_slots_rows

__all__ = ["NAMESPACE", "OP_NAMES", "topk_to_slots", "topk_args", "candidate_topk_to_slots",
           "candidate_blocks_to_physical"]

NAMESPACE = "dsv4_index"
I32, I64 = torch.int32, torch.int64
OP_NAMES: List[str] = []  # functional ops; each has a ``<name>_out`` twin


def _register(name: str, mutates=()):
    """``torch.library.custom_op`` under ``dsv4_index::name`` (remembered in :data:`OP_NAMES`)."""
    def deco(fn):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=tuple(mutates))
        if not mutates:
            OP_NAMES.append(name)
        return op
    return deco


def _empty(like: Tensor, shape, dtype) -> Tensor:
    return like.new_empty(shape, dtype=dtype)


# token_to_req
@_register("token_to_req")
def _token_to_req(query_start_loc: Tensor, *, num_tokens: int, validate: bool = False,
                  backend: Optional[str] = None) -> Tensor:
    return ops.token_to_req(query_start_loc, num_tokens, validate=validate, backend=backend)


@_token_to_req.register_fake
def _(query_start_loc, *, num_tokens, **_):
    return _empty(query_start_loc, (num_tokens,), I32)


@_register("token_to_req_out", mutates=("out",))
def _token_to_req_out(query_start_loc: Tensor, out: Tensor, *, num_tokens: Optional[int] = None,
                      validate: bool = False, backend: Optional[str] = None) -> None:
    ops.token_to_req(query_start_loc, num_tokens, out=out, validate=validate, backend=backend)


# slot_mapping
@_register("slot_mapping")
def _slot_mapping(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, block_size: int,
                  idx_mapping: Optional[Tensor] = None, replay_end: Optional[Tensor] = None, *,
                  num_tokens: int, blocks_per_kv_block: int = 1, cp_world_size: int = 1, cp_rank: int = 0,
                  cp_interleave: int = 1, circular_capacity: Optional[int] = None, ring: bool = False,
                  validate: bool = False, backend: Optional[str] = None) -> Tensor:
    return ops.slot_mapping(query_start_loc, seq_lens, block_table, block_size, **_kw(locals()))


@_slot_mapping.register_fake
def _(query_start_loc, *args, num_tokens, **_):
    return _empty(query_start_loc, (num_tokens,), I64)


@_register("slot_mapping_out", mutates=("out",))
def _slot_mapping_out(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, block_size: int,
                      out: Tensor, idx_mapping: Optional[Tensor] = None, replay_end: Optional[Tensor] = None, *,
                      num_tokens: Optional[int] = None, blocks_per_kv_block: int = 1, cp_world_size: int = 1,
                      cp_rank: int = 0, cp_interleave: int = 1, circular_capacity: Optional[int] = None,
                      ring: bool = False, validate: bool = False, backend: Optional[str] = None) -> None:
    ops.slot_mapping(query_start_loc, seq_lens, block_table, block_size, **_kw(locals()))


# compressed_slot_mapping (token-aligned) and its compact form
@_register("compressed_slot_mapping")
def _compressed(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, rows_per_block: int,
                compress_ratio: int, idx_mapping: Optional[Tensor] = None, replay_end: Optional[Tensor] = None, *,
                num_tokens: int, cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                validate: bool = False, backend: Optional[str] = None) -> Tensor:
    return ops.compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                                       **_kw(locals()))


@_compressed.register_fake
def _(query_start_loc, *args, num_tokens, **_):
    return _empty(query_start_loc, (num_tokens,), I64)


@_register("compressed_slot_mapping_out", mutates=("out",))
def _compressed_out(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, rows_per_block: int,
                    compress_ratio: int, out: Tensor, idx_mapping: Optional[Tensor] = None,
                    replay_end: Optional[Tensor] = None, *, num_tokens: Optional[int] = None,
                    cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, validate: bool = False,
                    backend: Optional[str] = None) -> None:
    ops.compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                                **_kw(locals()))


@_register("compact_compressed_slot_mapping")
def _compact(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, rows_per_block: int,
             compress_ratio: int, idx_mapping: Optional[Tensor] = None, replay_end: Optional[Tensor] = None, *,
             num_tokens: int, cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
             validate: bool = False, backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    out, cu = ops.compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block,
                                          compress_ratio, compact=True, **_kw(locals()))
    return out, cu


@_compact.register_fake
def _(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio, *args, num_tokens, **_):
    B = query_start_loc.shape[0] - 1
    return (_empty(query_start_loc, (num_tokens // compress_ratio + B,), I64),
            _empty(query_start_loc, (B + 1,), I32))


@_register("compact_compressed_slot_mapping_out", mutates=("out", "out_cu"))
def _compact_out(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, rows_per_block: int,
                 compress_ratio: int, out: Tensor, out_cu: Tensor, idx_mapping: Optional[Tensor] = None,
                 replay_end: Optional[Tensor] = None, *, num_tokens: Optional[int] = None,
                 cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, validate: bool = False,
                 backend: Optional[str] = None) -> None:
    ops.compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                                compact=True, **_kw(locals()))


# window_indices
@_register("window_indices")
def _window(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, block_size: int, window: int,
            idx_mapping: Optional[Tensor] = None, replay_start: Optional[Tensor] = None, *, num_tokens: int,
            cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, ring: bool = False,
            circular_capacity: Optional[int] = None, validate: bool = False,
            backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    idx, lens = ops.window_indices(query_start_loc, seq_lens, block_table, block_size, window, **_kw(locals()))
    return idx, lens


@_window.register_fake
def _(query_start_loc, seq_lens, block_table, block_size, window, *args, num_tokens, **_):
    return _empty(query_start_loc, (num_tokens, window), I32), _empty(query_start_loc, (num_tokens,), I32)


@_register("window_indices_out", mutates=("out", "out_lens"))
def _window_out(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, block_size: int, window: int,
                out: Tensor, out_lens: Tensor, idx_mapping: Optional[Tensor] = None,
                replay_start: Optional[Tensor] = None, *, num_tokens: Optional[int] = None,
                cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, ring: bool = False,
                circular_capacity: Optional[int] = None, validate: bool = False,
                backend: Optional[str] = None) -> None:
    ops.window_indices(query_start_loc, seq_lens, block_table, block_size, window, **_kw(locals()))


# causal_compressed_indices
@_register("causal_compressed_indices")
def _causal(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, rows_per_block: int,
            compress_ratio: int, width: int, idx_mapping: Optional[Tensor] = None, *, num_tokens: int,
            cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, validate: bool = False,
            backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    idx, lens = ops.causal_compressed_indices(query_start_loc, seq_lens, block_table, rows_per_block,
                                              compress_ratio, width, **_kw(locals()))
    return idx, lens


@_causal.register_fake
def _(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio, width, *args, num_tokens, **_):
    return _empty(query_start_loc, (num_tokens, width), I32), _empty(query_start_loc, (num_tokens,), I32)


@_register("causal_compressed_indices_out", mutates=("out", "out_lens"))
def _causal_out(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, rows_per_block: int,
                compress_ratio: int, width: int, out: Tensor, out_lens: Tensor,
                idx_mapping: Optional[Tensor] = None, *, num_tokens: Optional[int] = None,
                cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, validate: bool = False,
                backend: Optional[str] = None) -> None:
    ops.causal_compressed_indices(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                                  width, **_kw(locals()))


# topk_to_slots (batch form) and topk_to_slots_rows (pipeline form)
@_register("topk_to_slots")
def _topk(topk: Tensor, query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, rows_per_block: int,
          compress_ratio: int, idx_mapping: Optional[Tensor] = None, *, num_tokens: int,
          cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, compact: bool = False,
          validate: bool = False, backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    slots, lens = ops.topk_to_slots(topk, query_start_loc, seq_lens, block_table, rows_per_block,
                                    compress_ratio, **_kw(locals()))
    return slots, lens


@_topk.register_fake
def _(topk, *args, num_tokens, **_):
    return _empty(topk, (num_tokens, topk.shape[1]), I32), _empty(topk, (num_tokens,), I32)


@_register("topk_to_slots_out", mutates=("out", "out_lens"))
def _topk_out(topk: Tensor, query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
              rows_per_block: int, compress_ratio: int, out: Tensor, out_lens: Tensor,
              idx_mapping: Optional[Tensor] = None, *, num_tokens: Optional[int] = None,
              cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, compact: bool = False,
              validate: bool = False, backend: Optional[str] = None) -> None:
    ops.topk_to_slots(topk, query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                      **_kw(locals()))


@_register("topk_to_slots_rows")
def _topk_rows(topk: Tensor, token_rows: Tensor, token_nc: Tensor, block_table: Tensor, rows_per_block: int,
               compress_ratio: int, num_rows: int, *, table_width: Optional[int] = None,
               cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, compact: bool = False,
               backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    slots, lens = topk_to_slots_rows(topk, token_rows, token_nc, block_table, rows_per_block, compress_ratio,
                                     num_rows, **_kw(locals()))
    return slots, lens


@_topk_rows.register_fake
def _(topk, token_rows, token_nc, block_table, rows_per_block, compress_ratio, num_rows, **_):
    return _empty(topk, (num_rows, topk.shape[1]), I32), _empty(topk, (num_rows,), I32)


@_register("topk_to_slots_rows_out", mutates=("out", "out_lens"))
def _topk_rows_out(topk: Tensor, token_rows: Tensor, token_nc: Tensor, block_table: Tensor,
                   rows_per_block: int, compress_ratio: int, num_rows: int, out: Tensor, out_lens: Tensor, *,
                   table_width: Optional[int] = None, cp_world_size: int = 1, cp_rank: int = 0,
                   cp_interleave: int = 1, compact: bool = False, backend: Optional[str] = None) -> None:
    topk_to_slots_rows(topk, token_rows, token_nc, block_table, rows_per_block, compress_ratio, num_rows,
                       **_kw(locals()))


# V4.1 candidate blocks (pipeline forms): candidate_topk_to_slots_rows, candidate_blocks_to_physical_rows
@_register("candidate_topk_to_slots_rows")
def _cand_rows(blocks: Tensor, cols: Tensor, token_rows: Tensor, token_nc: Tensor, block_table: Tensor,
               rows_per_block: int, compress_ratio: int, candidate_block_size: int, num_rows: int, *,
               table_width: Optional[int] = None, cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
               compact: bool = False, backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    slots, lens = candidate_topk_to_slots_rows(blocks, cols, token_rows, token_nc, block_table, rows_per_block,
                                               compress_ratio, candidate_block_size, num_rows, **_kw(locals()))
    return slots, lens


@_cand_rows.register_fake
def _(blocks, cols, token_rows, token_nc, block_table, rows_per_block, compress_ratio, candidate_block_size,
      num_rows, **_):
    return _empty(cols, (num_rows, cols.shape[1]), I32), _empty(cols, (num_rows,), I32)


@_register("candidate_topk_to_slots_rows_out", mutates=("out", "out_lens"))
def _cand_rows_out(blocks: Tensor, cols: Tensor, token_rows: Tensor, token_nc: Tensor, block_table: Tensor,
                   rows_per_block: int, compress_ratio: int, candidate_block_size: int, num_rows: int, out: Tensor,
                   out_lens: Tensor, *, table_width: Optional[int] = None, cp_world_size: int = 1, cp_rank: int = 0,
                   cp_interleave: int = 1, compact: bool = False, backend: Optional[str] = None) -> None:
    candidate_topk_to_slots_rows(blocks, cols, token_rows, token_nc, block_table, rows_per_block, compress_ratio,
                                 candidate_block_size, num_rows, **_kw(locals()))


@_register("candidate_blocks_to_physical_rows")
def _phys_rows(blocks: Tensor, token_rows: Tensor, token_nc: Tensor, block_table: Tensor, rows_per_block: int,
               compress_ratio: int, candidate_block_size: int, num_rows: int, *, table_width: Optional[int] = None,
               backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    phys, counts = candidate_blocks_to_physical_rows(blocks, token_rows, token_nc, block_table, rows_per_block,
                                                     compress_ratio, candidate_block_size, num_rows, **_kw(locals()))
    return phys, counts


@_phys_rows.register_fake
def _(blocks, token_rows, token_nc, block_table, rows_per_block, compress_ratio, candidate_block_size, num_rows,
      **_):
    return _empty(blocks, (num_rows, blocks.shape[1]), I32), _empty(blocks, (num_rows,), I32)


@_register("candidate_blocks_to_physical_rows_out", mutates=("out", "out_counts"))
def _phys_rows_out(blocks: Tensor, token_rows: Tensor, token_nc: Tensor, block_table: Tensor, rows_per_block: int,
                   compress_ratio: int, candidate_block_size: int, num_rows: int, out: Tensor, out_counts: Tensor, *,
                   table_width: Optional[int] = None, backend: Optional[str] = None) -> None:
    candidate_blocks_to_physical_rows(blocks, token_rows, token_nc, block_table, rows_per_block, compress_ratio,
                                      candidate_block_size, num_rows, **_kw(locals()))


# indexer_lengths
@_register("indexer_lengths")
def _indexer(query_start_loc: Tensor, seq_lens: Tensor, compress_ratio: int, *, num_tokens: int,
             next_n: int = 0, num_decodes: int = 0, cp_world_size: int = 1, cp_rank: int = 0,
             cp_interleave: int = 1, validate: bool = False,
             backend: Optional[str] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    r = ops.indexer_lengths(query_start_loc, seq_lens, compress_ratio, **_kw(locals(), decode=True))
    dec = r.decode_lens if next_n and r.decode_lens is not None else query_start_loc.new_empty((num_decodes, 0))
    return r.lens, dec, r.ks, r.ke, r.cu


@_indexer.register_fake
def _(query_start_loc, seq_lens, compress_ratio, *, num_tokens, next_n=0, num_decodes=0, **_):
    t = _empty(query_start_loc, (num_tokens,), I32)
    return (t, _empty(query_start_loc, (num_decodes, next_n), I32), torch.empty_like(t), torch.empty_like(t),
            _empty(query_start_loc, (query_start_loc.shape[0],), I32))


@_register("indexer_lengths_out", mutates=("out", "out_ks", "out_ke", "out_cu", "out_decode"))
def _indexer_out(query_start_loc: Tensor, seq_lens: Tensor, compress_ratio: int, out: Tensor, out_ks: Tensor,
                 out_ke: Tensor, out_cu: Tensor, out_decode: Optional[Tensor] = None, *,
                 num_tokens: Optional[int] = None, next_n: int = 0, num_decodes: int = 0,
                 cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1, validate: bool = False,
                 backend: Optional[str] = None) -> None:
    ops.indexer_lengths(query_start_loc, seq_lens, compress_ratio, **_kw(locals(), decode=True))


def _kw(loc: dict, decode: bool = False) -> dict:
    """Keyword arguments of the public op from a registered function's locals (positional ones and
    the ``next_n = 0`` convention of :func:`_indexer` removed)."""
    skip = {"query_start_loc", "seq_lens", "block_table", "block_size", "rows_per_block", "compress_ratio",
            "window", "width", "topk", "token_rows", "token_nc", "num_rows", "kw", "blocks", "cols",
            "candidate_block_size"}
    kw = {k: v for k, v in loc.items() if k not in skip}
    if decode and not kw.get("next_n"):
        kw["next_n"] = kw["num_decodes"] = None
    return kw


# DSV4Metadata front end
def topk_args(meta, channel: str) -> dict:
    """Everything :func:`topk_to_slots` passes to ``torch.ops.dsv4_index.topk_to_slots_rows`` besides
    ``topk``: per-token table rows and ``n_c`` of the step (int32 ``[T_max]`` builder buffers, filled
    by ``build()``), the group's block table and the channel geometry (host ints).

    Raises ValueError when ``channel`` has no top-k conversion.
    """
    b = meta.builders.get(channel) if channel in meta.channels else None
    if b is None or not hasattr(b, "token_rows"):
        raise ValueError(f"channel {channel!r} does not convert top-k indices")
    s = b.spec
    world, rank, inter = meta.cp if meta.layout.groups[s.gid].sharded else (1, 0, 1)
    bt = meta.block_tables[s.gid]
    return dict(token_rows=b.token_rows, token_nc=b.token_nc, block_table=bt, rows_per_block=s.rows_per_block,
                compress_ratio=s.compress_ratio, num_rows=meta.num_tokens_padded, table_width=bt.shape[1],
                cp_world_size=world, cp_rank=rank, cp_interleave=inter)


def topk_to_slots(meta, channel: str, topk: Tensor, *, compact: bool = False,
                  backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """Compile-friendly :meth:`DSV4Metadata.topk_to_slots`: the same values, as NEW tensors.

    Parameters
    ----------
    meta : DSV4Metadata — this step's (built outside the compiled region).
    channel : str — ``"c4a"``.
    topk : int32 or int64 ``[>= T_pad, K]`` — request-local compressed row ids, ``-1`` = none.
    compact : bool — valid entries first.
    backend : {None, "triton", "reference"}

    Returns
    -------
    (slots int32 ``[T_pad, K]``, lens int32 ``[T_pad]``) — fresh outputs of the functional custom op
    ``dsv4_index::topk_to_slots_rows`` (no graph input is written: CUDA-graph safe).
    """
    a = topk_args(meta, channel)
    return torch.ops.dsv4_index.topk_to_slots_rows(
        topk, a["token_rows"], a["token_nc"], a["block_table"], a["rows_per_block"], a["compress_ratio"],
        a["num_rows"], table_width=a["table_width"], cp_world_size=a["cp_world_size"], cp_rank=a["cp_rank"],
        cp_interleave=a["cp_interleave"], compact=compact, backend=backend)


def candidate_topk_to_slots(meta, channel: str, blocks: Tensor, cols: Tensor, *, compact: bool = False,
                            backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """Compile-friendly :meth:`DSV4Metadata.candidate_topk_to_slots` (NEW tensors, as :func:`topk_to_slots`)."""
    a = topk_args(meta, channel)
    C = _candidate_size(meta)
    return torch.ops.dsv4_index.candidate_topk_to_slots_rows(
        blocks, cols, a["token_rows"], a["token_nc"], a["block_table"], a["rows_per_block"], a["compress_ratio"],
        C, a["num_rows"], table_width=a["table_width"], cp_world_size=a["cp_world_size"], cp_rank=a["cp_rank"],
        cp_interleave=a["cp_interleave"], compact=compact, backend=backend)


def candidate_blocks_to_physical(meta, channel: str, blocks: Tensor, *,
                                 backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """Compile-friendly :meth:`DSV4Metadata.candidate_blocks_to_physical` (NEW tensors)."""
    a = topk_args(meta, channel)
    C = _candidate_size(meta)
    return torch.ops.dsv4_index.candidate_blocks_to_physical_rows(
        blocks, a["token_rows"], a["token_nc"], a["block_table"], a["rows_per_block"], a["compress_ratio"], C,
        a["num_rows"], table_width=a["table_width"], backend=backend)


def _candidate_size(meta) -> int:
    C = getattr(meta.layout, "candidate_block_size", None)
    if C is None:
        raise ValueError("this layout has no two-level indexer (layout.candidate_block_size is None)")
    return C
