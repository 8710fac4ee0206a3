"""DeepSeek-V4 attention config: the fields of ``dsv4_index/configs/*.json`` (package data of ``dsv4_index``:
V4 ``flash``, ``pro``, ``tiny``; V4.1 ``v41_flash``, ``tiny_v41``) that the attention uses.

Block sizes are not config fields: they belong to the cache layout (``DSV4Layout.from_config`` takes
them as arguments) and the model never needs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, Tuple, Union

from dsv4_index.config import CONFIG_DIR, SHIPPED  # the shipped configs are package data of dsv4_index
from dsv4_index.engine_plan import kv_owners, topk_owners
from dsv4_index.specs import ratio_kinds

__all__ = ["DSV4Config", "load_config", "CONFIG_DIR"]


@dataclass(frozen=True)
class DSV4Config:
    """Attention geometry of a DSV4 model.

    ``compress_ratios[layer_id]`` picks a layer's kind (see :meth:`layer_kind`); it has one entry per
    layer, MTP layers included (``num_hidden_layers + num_nextn_predict_layers`` entries).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    sliding_window: int
    compress_ratios: Tuple[int, ...]
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    num_nextn_predict_layers: int = 0
    num_key_value_heads: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1 << 20
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        n = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != n:
            raise ValueError(f"compress_ratios must have num_hidden_layers + num_nextn_predict_layers "
                             f"= {n} entries, got {len(self.compress_ratios)}")
        if any(r < 0 for r in self.compress_ratios):
            raise ValueError(f"compress_ratios must hold ints >= 0, got {sorted(set(self.compress_ratios))}")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and in (0, head_dim], "
                             f"got {self.qk_rope_head_dim}")
        if self.num_key_value_heads != 1:
            raise ValueError(f"num_key_value_heads must be 1, got {self.num_key_value_heads}")

    @property
    def ratios(self) -> Tuple[int, ...]:
        """Distinct non-zero compress ratios, ascending."""
        return tuple(sorted({r for r in self.compress_ratios if r > 0}))

    @property
    def num_layers(self) -> int:
        """Layers with attention, MTP layers included."""
        return len(self.compress_ratios)

    def layer_kind(self, layer_id: int) -> str:
        """``"swa"`` (ratio 0), ``"c4"`` (indexed through the top-k) or ``"c128"`` (every visible
        compressed row): the layout's rule, :func:`dsv4_index.specs.ratio_kinds` (DeepSeek-V4: the smaller
        of two ratios is c4; V4.1: ratios 1 and 2 are c4)."""
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id must be in [0, {self.num_layers}), got {layer_id}")
        r = self.compress_ratios[layer_id]
        return "swa" if r == 0 else next(k.kind for k in ratio_kinds(self.compress_ratios) if k.ratio == r)

    def compressor_span(self, layer_id: int) -> int:
        """Tokens pooled into one compressed row of a compressed layer: ``2 R`` for c4 layers with a
        compressor state (overlapping spans), ``R`` for c128 layers, 1 for ratio-1 layers (V4.1: no
        state, a row is its own token)."""
        r = self.compress_ratios[layer_id]
        k = next(k for k in ratio_kinds(self.compress_ratios) if k.ratio == r)
        return k.state_window if k.state else r

    def kv_source(self, layer_id: int):
        """The layer whose compressed cache and compressor state a compressed layer reads: itself, or on
        DeepSeek-V4.1 the nearest of ``kv_source_layer_ids`` at or below it (vLLM's ``kv_source_layer_id``,
        :func:`dsv4_index.engine_plan.kv_owners`); None for an SWA-only layer."""
        self.layer_kind(layer_id)  # NOTE: the range check
        return kv_owners(self.compress_ratios, self.raw.get("kv_source_layer_ids") or ()).get(layer_id)

    def topk_source(self, layer_id: int):
        """The layer whose indexer top-k an indexed (``"c4"``) layer attends with: itself, or on DeepSeek-V4.1
        when it is no index source the nearest of ``index_source_layer_ids`` at or below it
        (:func:`dsv4_index.engine_plan.topk_owners`); None for other layers."""
        self.layer_kind(layer_id)  # NOTE: the range check
        return topk_owners(self.compress_ratios, self.raw.get("index_source_layer_ids") or ()).get(layer_id)

    @property
    def candidate(self):
        """DeepSeek-V4.1's two-level indexer: ``(candidate_source_layer_id, candidate_block_size C,
        candidate_topk_blocks nb)``, or None without it (a size of 0 or a negative / absent source)."""
        r = self.raw
        src, C, nb = r.get("candidate_source_layer_id"), r.get("candidate_block_size"), r.get("candidate_topk_blocks")
        if src is None or src < 0 or not C or not nb:
            return None
        return int(src), int(C), int(nb)

    def candidate_role(self, layer_id: int):
        """``"source"`` (the layer picking the candidate blocks), ``"consumer"`` (an index-source layer of the
        source's ratio above it, in the backbone: it scores only the candidate blocks' columns) or None."""
        self.layer_kind(layer_id)  # NOTE: the range check
        cand = self.candidate
        if cand is None:
            return None
        src = cand[0]
        if layer_id == src:
            return "source"
        if (src < layer_id < self.num_hidden_layers and self.topk_source(layer_id) == layer_id
                and self.compress_ratios[layer_id] == self.compress_ratios[src]):
            return "consumer"
        return None

    def layer_ids(self, kind: str):
        """Layer ids of one kind, ascending."""
        return [i for i in range(self.num_layers) if self.layer_kind(i) == kind]

    def to_dict(self) -> Dict[str, Any]:
        """The JSON dict (the raw one, so ``DSV4Layout.from_config`` sees every original key)."""
        d = dict(self.raw)
        for f in fields(self):
            if f.name != "raw":
                v = getattr(self, f.name)
                d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DSV4Config":
        """Build from a HF-style config dict; unknown keys are kept in ``raw`` only."""
        if not isinstance(d, dict):
            raise ValueError(f"d must be a dict, got {type(d).__name__}")
        names = {f.name for f in fields(cls)} - {"raw"}
        return cls(**{k: v for k, v in d.items() if k in names}, raw=dict(d))

    @classmethod
    def from_json(cls, path: Union[str, Path]) -> "DSV4Config":
        """Read a ``config.json``."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


def load_config(name: str) -> DSV4Config:
    """One of the shipped configs (``dsv4_index.config.SHIPPED``: ``"tiny"``, ``"flash"``, ``"pro"``,
    ``"v41_flash"``, ``"tiny_v41"``)."""
    path = CONFIG_DIR / f"{name}.json"
    if name not in SHIPPED or not path.exists():
        raise ValueError(f"name must be one of {list(SHIPPED)}, got {name!r}")
    return DSV4Config.from_json(path)
