"""Buffers that never alias (issue 38): no two live metadata buffers share storage unless the layout says so.

A scratch buffer that overlaps an output (vLLM bisected one such bug, vllm#41834) corrupts metadata silently,
and only under some batch shapes. Two checks, both raising :class:`AliasError` (a ``ValueError``) that names
both buffers and their byte ranges:

* :func:`check_pipeline_buffers` (once, when a pipeline is built): every persistent buffer a launch writes
  (the common step tensors, each group's device table, every channel builder's buffers, the staging buffers
  on both sides of the one copy, the fused launch's scratch and argument tables) is disjoint from every other
  one. The same buffer object may be held by several builders only where the sharing is documented:
  ``BuildContext.shared_buffer`` (one buffer per key: the compressed slot mapping of one ``(gid, ratio,
  rows_per_block)`` geometry, shared by ``c4a`` and ``c4i``), the common step tensors and the group tables.
* :func:`check_step_outputs` (the first build, then every build under ``validate=True``): the tensors of one
  step's :class:`~dsv4_index.metadata.DSV4Metadata` (common tensors, block tables, every channel field) and the
  buffers ``meta.topk_to_slots`` / ``meta.candidate_*`` return views of are pairwise disjoint, except identical
  views (same address, shape, strides, dtype) of one documented shared buffer (``meta["c4a"].block_table is
  meta.block_tables[gid]``; ``c4a`` / ``c4i`` compressed slots). A model layer reusing another layer's top-k
  (V4.1's ``index_source_layer_ids``) reuses its *input*, not a metadata buffer: nothing here is shared for it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["AliasError", "Buffer", "find_overlaps", "check_buffers", "pipeline_buffers", "step_outputs",
           "check_pipeline_buffers", "check_step_outputs"]

CONVERSION_BUFFERS = ("topk_flat", "topk_lens", "cand_phys", "cand_counts", "cand_flat", "cand_lens")
"""Builder buffers that ``meta.topk_to_slots`` / ``meta.candidate_*`` return views of (step outputs too)."""


class AliasError(ValueError):
    """Two metadata buffers share storage without a documented reason."""


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One named tensor; ``shared`` is the documented shared buffer it belongs to (None: its own)."""

    name: str
    tensor: torch.Tensor
    shared: Optional[str] = None

    def span(self) -> Tuple[str, int, int]:
        """(device, first byte, one past the last byte) of the elements it addresses."""
        t = self.tensor
        ext = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
        return str(t.device), t.data_ptr(), t.data_ptr() + ext * t.element_size()

    def identical(self, other: "Buffer") -> bool:
        a, b = self.tensor, other.tensor
        return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def find_overlaps(buffers: Iterable[Buffer]) -> List[Tuple[Buffer, Buffer]]:
    """Every pair of buffers whose byte ranges overlap and whose sharing is not documented: documented means the
    same ``shared`` name (not None) and identical views. A sweep over the sorted ranges, pairs tested inside
    each cluster of overlapping ranges only."""
    spans = sorted(((*b.span(), b) for b in buffers if b.tensor.numel() > 0), key=lambda s: (s[0], s[1]))
    bad: List[Tuple[Buffer, Buffer]] = []
    cluster: List[Tuple[str, int, int, Buffer]] = []
    hi = -1
    for s in spans + [("", 0, 0, None)]:  # NOTE: a sentinel closes the last cluster
        if cluster and (s[0] != cluster[0][0] or s[1] >= hi):
            for i, a in enumerate(cluster):
                for b in cluster[i + 1:]:
                    if a[1] < b[2] and b[1] < a[2] and not (a[3].shared is not None and a[3].shared == b[3].shared
                                                            and a[3].identical(b[3])):
                        bad.append((a[3], b[3]))
            cluster, hi = [], -1
        if s[3] is not None:
            cluster.append(s)
            hi = max(hi, s[2])
    return bad


def check_buffers(buffers: Iterable[Buffer], what: str) -> None:
    """:class:`AliasError` naming the first overlapping pair of ``buffers`` (``what``: which set)."""
    bad = find_overlaps(buffers)
    if bad:
        a, b = bad[0]
        (_, a0, a1), (_, b0, b1) = a.span(), b.span()
        raise AliasError(f"{what}: {a.name} (bytes {a0:#x}..{a1:#x}) and {b.name} (bytes {b0:#x}..{b1:#x}) share "
                         f"storage and the layout documents no such sharing ({len(bad)} overlapping pair(s))")


def _documented(ctx) -> Dict[int, Tuple[str, torch.Tensor]]:
    """id(tensor) -> (shared name, tensor) of the buffers a pipeline shares by design."""
    out: Dict[int, Tuple[str, torch.Tensor]] = {}
    for f in dataclasses.fields(ctx):
        v = getattr(ctx, f.name)
        if isinstance(v, torch.Tensor):
            out[id(v)] = (f"ctx.{f.name}", v)
    for gid, t in enumerate(ctx.tables):
        out[id(t)] = (f"table[{gid}]", t)
    for key, t in ctx._shared.items():
        out[id(t)] = (f"shared{key}", t)
    return out


def pipeline_buffers(pipe) -> List[Buffer]:
    """Every persistent buffer of a :class:`~dsv4_index.pipeline.MetadataPipeline` that a launch or ``update()``
    writes, once each (a documented shared buffer under its shared name)."""
    ctx = pipe.ctx
    doc = _documented(ctx)
    out = [Buffer(name, t, name) for name, t in doc.values()]
    # NOTE: a documented buffer counts once however many builders hold it; any other tensor counts under every
    # name it is held by (one tensor under two names is two writers of one storage)
    for cname, b in pipe._builders.items():
        out += [Buffer(f"{cname}.{attr}", v) for attr, v in vars(b).items()
                if isinstance(v, torch.Tensor) and id(v) not in doc]
    out.append(Buffer("staging.dev", pipe.staging.dev))
    out += [Buffer(f"staging.host[{i}]", h) for i, h in enumerate(getattr(pipe.staging, "host", ()))
            if isinstance(h, torch.Tensor)]  # NOTE: the pinned buffers update() writes in turn
    fused = pipe._fused
    if fused is not None:
        out += [Buffer(f"fused.{n}", getattr(fused, n)) for n in ("scratch", "_outs")
                if isinstance(getattr(fused, n, None), torch.Tensor)]
        out += [Buffer(f"fused.base[{k}]", v) for k, v in getattr(fused, "_bases", {}).items()
                if id(v) not in doc and v is not pipe.staging.dev]
    return out


def _base_name(t: torch.Tensor, doc: Dict[int, Tuple[str, torch.Tensor]]) -> Optional[str]:
    """The documented shared buffer a view lies in (same storage, inside its byte range), or None."""
    lo = t.data_ptr()
    for name, base in doc.values():
        if base.numel() and base.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            _, b0, b1 = Buffer(name, base).span()
            if b0 <= lo < b1:
                return name
    return None


def step_outputs(meta) -> List[Buffer]:
    """The tensors of one step's metadata, named, each tagged with the documented shared buffer it is a view
    of (None: its own), plus the conversion buffers of every channel that converts top-k."""
    ctx = next((b.ctx for b in meta.builders.values() if hasattr(b, "ctx")), None)
    doc = _documented(ctx) if ctx is not None else {}
    out: List[Buffer] = []

    def add(name, t):
        if isinstance(t, torch.Tensor):
            out.append(Buffer(name, t, _base_name(t, doc)))

    for f in ("query_start_loc", "seq_lens", "idx_mapping", "positions", "token_to_req", "is_valid_token"):
        add(f"meta.{f}", getattr(meta, f))
    for gid, t in enumerate(meta.block_tables):
        add(f"meta.block_tables[{gid}]", t)
    for cname, ch in meta.channels.items():
        for fld in dataclasses.fields(ch):
            add(f"meta[{cname!r}].{fld.name}", getattr(ch, fld.name))
    for cname, b in meta.builders.items():
        for attr in CONVERSION_BUFFERS:
            add(f"{cname}.{attr}", getattr(b, attr, None))
    return out


def check_pipeline_buffers(pipe) -> None:
    """Once per pipeline: its persistent buffers are pairwise disjoint (:class:`AliasError` otherwise)."""
    check_buffers(pipeline_buffers(pipe), "pipeline buffers")


def check_step_outputs(meta) -> bool:
    """One step's outputs are pairwise disjoint but for documented identical views (:class:`AliasError`
    otherwise); True."""
    check_buffers(step_outputs(meta), "step outputs")
    return True
