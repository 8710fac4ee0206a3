"""What a vLLM model runner holds per step, in; the metadata its DeepSeek-V4 attention layers read, out
(issue 40 item 2). Imports vLLM nowhere: every vLLM object is duck-typed.

A runner (vLLM's ``GPUModelRunner``) holds, per step, the scheduler's ``SchedulerOutput``, its persistent
``InputBatch`` whose ``req_ids`` list the scheduled requests in the order of the step's rows (decode-first once
its attention backend's ``reorder_batch`` has run), and a ``CommonAttentionMetadata`` (``query_start_loc``,
``seq_lens``, ``num_reqs``, ``num_actual_tokens``) of those rows. :class:`VllmStepAdapter` turns the first two
into one :class:`~dsv4_index.metadata.DSV4Metadata` whose rows ARE the runner's rows (a pipeline built with
``row_order="caller"``: no permutation of hidden states), and :meth:`VllmStepAdapter.layer_metadata` hands each
attention layer its :class:`LayerMetadata`::

    pipe = MetadataPipeline(layout, max_num_reqs, max_num_batched_tokens, "cuda",
                            num_speculative_tokens, row_order="caller")
    pipe.warmup(pad_sizes=pad_sizes_from_capture_sizes(compilation_config.cudagraph_capture_sizes,
                                                       max_num_batched_tokens))
    adapter = VllmStepAdapter(pipe)
    # each step, after _update_states() and reorder_batch():
    meta = adapter.prepare(scheduler_output, input_batch.req_ids[:input_batch.num_reqs],
                           num_input_tokens=num_input_tokens)          # the padded (CUDA-graph) token count
    adapter.check_common(meta, common_attn_metadata)                   # optional: the runner's rows == meta's
    per_layer = adapter.layer_metadata(meta, layer_ids)                # {layer name: LayerMetadata}

Errors: a step vLLM's scheduler could get wrong raises ValueError naming the request (the conversion's and the
pipeline's checks, :func:`dsv4_index.frontend.explain`); a row order that is not decode-first raises ValueError
naming the row (:func:`dsv4_index.frontend.row_order.check_caller_order`); nothing is committed then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

import torch

from ..channels.base import ChannelMetadata
from ..frontend import batch_from_scheduler_output, explain
from ..frontend.row_order import reorder_rows
from ..metadata import DSV4Metadata

__all__ = ["VllmStepAdapter", "LayerMetadata", "pad_sizes_from_capture_sizes"]


def pad_sizes_from_capture_sizes(cudagraph_capture_sizes: Sequence[int], max_num_batched_tokens: int) -> tuple:
    """The ``pad_sizes`` of :meth:`MetadataPipeline.warmup` for vLLM's ``cudagraph_capture_sizes``: each size
    ``<= max_num_batched_tokens`` (a runner pads a step of ``T`` tokens to the smallest capture size ``>= T``,
    and runs eagerly above the largest), sorted, without repeats. ValueError for a size that is not a
    positive int, or when none fits (then ``warmup()`` would compile nothing the runner uses)."""
    sizes = set()
    for i, n in enumerate(cudagraph_capture_sizes):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"cudagraph_capture_sizes[{i}] must be a positive int, got {n!r}")
        if n <= max_num_batched_tokens:
            sizes.add(n)
    if not sizes:
        raise ValueError(f"no size of cudagraph_capture_sizes {list(cudagraph_capture_sizes)!r} is <= "
                         f"max_num_batched_tokens = {max_num_batched_tokens}")
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class LayerMetadata:
    """What one DeepSeek-V4 attention layer reads in a step (views of the step's :class:`DSV4Metadata`).

    layer : int; kind : ``"swa"``, ``"c4"`` or ``"c128"`` (``layout.layer_kind``; a V4.1 ratio-2 layer is a
    ``"c4"``-kind layer of its own channels).
    channels : dict role -> ChannelMetadata — ``layout.layer_channels(layer)``: ``"swa"`` always; ``"c4a"`` /
        ``"c4i"`` / ``"c4_state"`` (or ``"c2a"`` ...) or ``"c128a"`` / ``"c128_state"`` by kind.
    meta : the step's DSV4Metadata — the common tensors (``positions`` int64 [T], ``query_start_loc`` int32
        [B + 1], ``seq_lens`` int32 [B], ``token_to_req`` int32 [T], ``is_valid_token`` bool [T],
        ``num_decodes``, ``num_decode_tokens``) and ``topk_to_slots(channel, picks)`` for a c4 layer.
    """

    layer: int
    kind: str
    channels: Dict[str, ChannelMetadata]
    meta: DSV4Metadata


class VllmStepAdapter:
    """One vLLM model runner's step -> the pipeline's metadata, rows in the runner's order.

    Parameters
    ----------
    pipe : MetadataPipeline built with ``row_order="caller"`` (ValueError otherwise).
    """

    def __init__(self, pipe) -> None:
        if getattr(pipe, "row_order", None) != "caller":
            raise ValueError("pipe must be built with row_order='caller' (MetadataPipeline(..., row_order="
                             f"'caller')), got row_order={getattr(pipe, 'row_order', None)!r}")
        self.pipe = pipe
        self.req_ids: Optional[list] = None  # NOTE: the rows of the last prepared step

    def prepare(self, scheduler_output, req_ids: Sequence[str], *, num_input_tokens: Optional[int] = None,
                replay_start: Optional[dict] = None, replay_end: Optional[dict] = None) -> DSV4Metadata:
        """Convert, check, commit and build one step; returns its metadata, row ``i`` = ``req_ids[i]``.

        Parameters
        ----------
        scheduler_output : vLLM's ``SchedulerOutput`` (the fields ``MetadataPipeline.update`` reads).
        req_ids : the runner's ``input_batch.req_ids[:num_reqs]`` after ``reorder_batch``: every request the
            step schedules, once, decode-first.
        num_input_tokens : int, optional — the padded token count (a CUDA-graph capture size); default the
            step's own count.
        replay_start, replay_end : dict, optional — as ``batch_from_scheduler_output``.
        """
        pipe = self.pipe
        batch, delta = batch_from_scheduler_output(scheduler_output, pipe.slot_map, len(pipe.layout.groups),
                                                   replay_start=replay_start, replay_end=replay_end)
        batch, delta = reorder_rows(batch, delta, list(req_ids))
        try:
            pipe.update(batch, pad_to=num_input_tokens)
        except ValueError as e:
            named = explain(e, batch, delta, "scheduler_output")
            if named is e:
                raise
            raise named from e
        pipe.slot_map.commit(delta)
        self.req_ids = list(delta.order)
        meta = pipe.build()
        meta.req_ids = self.req_ids
        return meta

    @staticmethod
    def check_common(meta: DSV4Metadata, common) -> None:
        """Raise ValueError unless the runner's ``CommonAttentionMetadata``-style ``common`` (``num_reqs``,
        ``num_actual_tokens``, ``query_start_loc`` / ``query_start_loc_cpu`` int32 ``[>= B + 1]``, ``seq_lens`` /
        ``seq_lens_cpu`` int32 ``[>= B]``) describes the rows of ``meta`` (a host read: a debug check)."""
        B = meta.num_reqs
        if int(common.num_reqs) != B or int(common.num_actual_tokens) != meta.num_tokens:
            raise ValueError(f"common: {int(common.num_reqs)} requests / {int(common.num_actual_tokens)} tokens, "
                             f"meta: {B} / {meta.num_tokens}")
        for name in ("query_start_loc", "seq_lens"):
            theirs = getattr(common, name + "_cpu", None)
            theirs = getattr(common, name) if theirs is None else theirs
            n = B + 1 if name == "query_start_loc" else B
            a = torch.as_tensor(theirs)[:n].to("cpu", torch.int64)
            b = getattr(meta, name)[:n].to("cpu", torch.int64)
            if not torch.equal(a, b):
                i = int((a != b).nonzero()[0, 0])
                raise ValueError(f"common.{name}[{i}] = {int(a[i])}, meta.{name}[{i}] = {int(b[i])}: the runner's "
                                 f"rows are not the metadata's")

    @staticmethod
    def layer_metadata(meta: DSV4Metadata, layers: Mapping[str, int]) -> Dict[str, LayerMetadata]:
        """``{layer name: LayerMetadata}`` for ``layers`` (a vLLM layer name -> its layer index, e.g.
        ``{"model.layers.3.self_attn": 3}``); the layout's channels of each layer
        (``layout.layer_channels``), views of ``meta``: no copy, no launch."""
        lay = meta.layout
        out = {}
        for name, i in layers.items():
            roles = lay.layer_channels(i)  # type: ignore[attr-defined]
            out[name] = LayerMetadata(i, lay.layer_kind(i), {r: meta[c] for r, c in roles.items()},  # type: ignore[attr-defined]
                                      meta)
        return out
