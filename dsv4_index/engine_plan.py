"""An engine's own KV-cache plan as data (docs/DESIGN.md §3 "The engine's plan is data"), and the rule that
a step's block lists can belong to the groups of a layout.

:func:`read_engine_plan` reads vLLM's ``KVCacheConfig`` duck-typed (no vLLM import): an object or dict
with ``kv_cache_groups`` (or the list itself), each group with ``layer_names`` and ``kv_cache_spec``
(``block_size``; ``sliding_window`` for sliding specs; vLLM's ``UniformTypeKVCacheSpecs`` wrapper is
looked through) or, for plans stored as JSON, ``block_size`` / ``sliding_window`` / ``spec`` (the spec's
class name) at the group's top level. Spec kinds by exact class name (:data:`SPEC_KINDS`):
``MLAAttentionSpec`` / ``FullAttentionSpec`` (full), ``SlidingWindowSpec`` / ``SlidingWindowMLASpec``
(sliding, window ``sliding_window``), ``CircularBufferSpec`` (a one-block compressor-state ring of
``block_size`` rows); any other kind (``SinkFullAttentionSpec`` included) is refused naming the group and the
spec, and so is a ``UniformTypeKVCacheSpecs`` whose inner specs differ in kind, block size or window.
:meth:`EnginePlan.resolve` maps every layer name to the cache it
holds and checks the plan against the model config; ``DSV4Layout.from_kv_cache_config`` builds the layout.

:func:`check_block_counts` is the count rule of issue 28: the full block lists a step hands over for a
request (new requests, resumed ones) must be lists of one token count ``T >= 1`` in every group
(``len == cdiv(T, block_size)`` for each non-circular group whose list is long enough for the step; a
list too short is left to the pipeline's own "block ids missing" check). Lists in another
group order (vLLM 0.33's ``[swa_0, swa_1, mla, ...]`` read as ``[mla, swa_0, swa_1, ...]``) disagree as
soon as a request's length tells two block sizes apart; a step whose every request fits one block of
each permuted group cannot be told apart by counts (build the layout from the engine's plan).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._common import is_int
from .specs import ratio_kinds

__all__ = ["EngineGroup", "EnginePlan", "read_engine_plan", "check_block_counts", "layout_from_kv_cache_config",
           "kv_owners", "SPEC_KINDS", "PLAN_OWNS"]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
SPEC_KINDS = {"MLAAttentionSpec": "full", "FullAttentionSpec": "full", "SlidingWindowSpec": "sliding",
              "SlidingWindowMLASpec": "sliding", "CircularBufferSpec": "circular"}
"""vLLM spec class name -> group kind, matched exactly: any other name (``SinkFullAttentionSpec``, a subclass, a
spec of a later vLLM) is refused by name until its meaning is read here."""
PLAN_OWNS = ("groups", "circular", "mla_block_size", "swa_block_size", "c4_state_block_size", "c128_state_block_size",
             "swa_group_per_layer")
"""``from_config`` options an engine plan decides (``from_kv_cache_config`` refuses them)."""


@dataclass(frozen=True)
class EngineGroup:
    """One group of an engine plan: ``layer_names`` (the engine's), ``kind`` (``"full"``, ``"sliding"``,
    ``"circular"``), ``block_size`` (tokens per allocation block; the ring's rows for circular),
    ``window`` (sliding groups), ``spec`` (the spec's class name), ``draft`` (vLLM's
    ``is_eagle_group``)."""

    layer_names: Tuple[str, ...]
    kind: str
    block_size: int
    window: Optional[int]
    spec: str
    draft: bool = False


@dataclass(frozen=True)
class EnginePlan:
    """An engine's groups in its gid order (build with :func:`read_engine_plan`)."""

    groups: Tuple[EngineGroup, ...]

    def resolve(self, ratios: Sequence[int], r4: Optional[int], r128: Optional[int], num_hidden_layers: int,
                window: int, kv_sources: Sequence[int] = ()) -> Tuple[List[dict], Dict[str, int]]:
        """``(groups, circular)`` for :meth:`DSV4Layout.from_config`: one explicit group dict per engine
        group (``layer_names``, ``block_size``, ``name``) and the circular groups' capacities.

        ``kv_sources`` (DeepSeek-V4.1's ``kv_source_layer_ids``; empty: every compressed layer owns its
        caches): only those layers own an MLA cache and a compressor state, each other compressed layer
        reads those of the nearest source at or below it (:func:`kv_owners`); a group holding a source's
        cache serves the layers that read it.

        Raises ValueError naming the group (``kv_cache_groups[i]`` and its spec) and the layer for: a
        layer name without ``layers.<i>.`` or past the config's layers; a cache the layer does not have
        (an MLA or state cache of an SWA-only layer, a state of a ratio-1 layer); a group whose spec kind
        does not hold that cache (full MLA / sliding / ring); a sliding window other than the cache's
        (``sliding_window`` for SWA, the state window of its ratio: ``2 * R4`` for the C4 state, ``R128``
        for the C128 state, :func:`~dsv4_index.specs.ratio_kinds`); two caches kinds in one group; a
        compressed layer whose MLA cache (or its kv source's) is in no group.
        """
        kinds = ratio_kinds(ratios)
        owner = kv_owners(ratios, kv_sources)
        wants: Dict[str, Optional[int]] = {"swa": window, **{k.state: k.state_window for k in kinds if k.state}}
        roles: List[str] = []
        layer_sets: List[Tuple[int, ...]] = []
        mla_layers: set = set()
        full_seen: Optional[int] = None
        for i, g in enumerate(self.groups):
            where = f"kv_cache_groups[{i}] ({g.spec}, block_size {g.block_size})"
            if g.kind == "full":
                if full_seen is not None:
                    raise ValueError(f"{where} (first layer {g.layer_names[0]!r}) is a second full MLA group beside "
                                     f"kv_cache_groups[{full_seen}]; this layout serves every MLA cache from one group")
                full_seen = i
            found: Dict[str, str] = {}
            for name in g.layer_names:
                role, layer = _cache_of(where, name, ratios, kinds)
                if role != "swa" and owner[layer] != layer:
                    raise ValueError(f"{where} holds {name!r}, a {role} cache of layer {layer}, but the config's "
                                     f"kv_source_layer_ids {sorted(set(kv_sources))} make layer {layer} read layer "
                                     f"{owner[layer]}'s; the engine and the config disagree")
                found.setdefault(role, name)
                if role == "mla":
                    mla_layers.add(layer)
                if (role == "mla") != (g.kind == "full"):
                    raise ValueError(f"{where} holds {name!r}, the {role} cache of layer {layer}, which a "
                                     f"{g.kind} group cannot hold; this layout does not know such a group")
                if g.kind == "sliding" and g.window != wants[role]:
                    raise ValueError(f"{where} has sliding_window {g.window} but holds {name!r}, the {role} "
                                     f"cache of layer {layer} (window {wants[role]})")
            if len(found) != 1:
                a, b = list(found.items())[:2] if found else (("none", ""), ("none", ""))
                raise ValueError(f"{where} holds caches of several kinds ({a[1]!r}: {a[0]}, {b[1]!r}: {b[0]}) "
                                 f"or none; one group holds one kind")
            roles.append(next(iter(found)))
            layer_sets.append(tuple(sorted({_cache_of(where, n, ratios, kinds)[1] for n in g.layer_names})))
        missing = sorted(i for i, s in owner.items() if s not in mla_layers and i < num_hidden_layers)
        if missing:
            raise ValueError(f"kv_cache_groups: no group holds the MLA cache of compressed layer(s) {missing[:8]}"
                             + (" (nor of their kv source)" if kv_sources else ""))
        # NOTE: a source's state group serves the layers of its ratio that read it (the mla group serves all)
        layer_sets = [ls if role in ("swa", "mla") else tuple(sorted(
            {i for i, s in owner.items() if s in ls and ratios[i] == ratios[s]} | set(ls)))
            for role, ls in zip(roles, layer_sets)]
        names = _names(roles, layer_sets, num_hidden_layers)
        out = [{"role": role, "layers": None if role == "mla" else list(ls), "block_size": g.block_size, "name": n}
               for g, role, ls, n in zip(self.groups, roles, layer_sets, names)]
        circular = {n: g.block_size for g, n in zip(self.groups, names) if g.kind == "circular"}
        return out, circular


def kv_owners(ratios: Sequence[int], kv_sources: Sequence[int] = ()) -> Dict[int, int]:
    """``{layer: owner}`` for every compressed layer (``ratios[layer] > 0``): the layer whose MLA cache and
    compressor state it reads. Without ``kv_sources`` each layer owns its own; with DeepSeek-V4.1's
    ``kv_source_layer_ids`` the owner is the nearest source at or below the layer (vLLM 0.33
    ``models/deepseek_v41/attention.py``, ``DeepseekV4Attention.__init__``: ``kv_source_layer_id = max(s for s
    in kv_source_layers if s <= layer_id)``), or the layer itself when no source lies below it."""
    src = sorted(set(kv_sources))
    out = {}
    for i, r in enumerate(ratios):
        if r > 0:
            below = [s for s in src if s <= i]
            out[i] = below[-1] if below else i
    return out


def topk_owners(ratios: Sequence[int], index_sources: Sequence[int] = ()) -> Dict[int, int]:
    """``{layer: owner}`` for every indexed layer (kind ``"c4"`` of :func:`~dsv4_index.specs.ratio_kinds`): the
    layer whose indexer top-k it attends with. Without ``index_sources`` each runs its own indexer; with
    DeepSeek-V4.1's ``index_source_layer_ids`` a layer that is no index source reuses ("consumes") the top-k of
    the nearest index source at or below it, the last one a step ran (the rule of :func:`kv_owners`), or itself
    when none lies below (``from_config`` refuses that, and a source of another ratio). Its ``topk_to_slots``
    takes that top-k with its own ratio's channel: no metadata of its own."""
    indexed = {k.ratio for k in ratio_kinds(ratios) if k.kind == "c4"}
    return {layer: o for layer, o in kv_owners(ratios, index_sources).items() if ratios[layer] in indexed}


def _cache_of(where: str, name: str, ratios: Sequence[int], kinds) -> Tuple[str, int]:
    """(role, layer) of one engine layer name."""
    m = _LAYER_RE.search(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"{where}: layer name {name!r} has no 'layers.<i>' part")
    layer = int(m.group(1))
    if layer >= len(ratios):
        raise ValueError(f"{where}: layer name {name!r} names layer {layer}; the config has {len(ratios)} "
                         f"(num_hidden_layers + num_nextn_predict_layers)")
    if name.endswith("swa_cache"):
        return "swa", layer
    role = "mla"
    if name.endswith("state_cache"):
        state = next((k.state for k in kinds if k.ratio == ratios[layer]), None)
        if state is None and ratios[layer] > 0:
            raise ValueError(f"{where}: {name!r} is a compressor state of layer {layer}, whose ratio "
                             f"{ratios[layer]} has none")
        role = state or "c4_state"
    if ratios[layer] == 0:
        raise ValueError(f"{where}: {name!r} is a {role} cache of layer {layer}, which is SWA-only "
                         f"(compress ratio 0) in the config")
    return role, layer


def _names(roles: List[str], layer_sets: List[Tuple[int, ...]], num_hidden: int) -> List[str]:
    """``role`` (one group of it), ``role_<k>`` (several), ``role_mtp`` for a group of draft layers only."""
    draft = [bool(ls) and min(ls) >= num_hidden for ls in layer_sets]
    count: Dict[str, int] = {}
    for r, d in zip(roles, draft):
        if not d:
            count[r] = count.get(r, 0) + 1
    seen: Dict[str, int] = {}
    out = []
    for r, d in zip(roles, draft):
        if d:
            out.append(f"{r}_mtp")
            continue
        k = seen.get(r, 0)
        seen[r] = k + 1
        out.append(r if count[r] == 1 else f"{r}_{k}")
    return out


def _get(obj, key: str, default=None):
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _spec_fields(i: int, g) -> Tuple[str, int, object]:
    """(class name, block size, sliding window) of group ``i``'s spec."""
    spec = _get(g, "kv_cache_spec")
    if spec is None:  # NOTE: a plan stored as JSON (tests/layout/fixtures)
        kind = _get(g, "layer_spec") or _get(g, "spec")
        bs, win = _get(g, "block_size"), _get(g, "sliding_window")
    else:
        inner = _get(spec, "kv_cache_specs")
        first = next(iter(inner.values())) if isinstance(inner, Mapping) and inner else spec
        if isinstance(inner, Mapping) and inner:
            _check_uniform(i, spec, inner)
        kind, bs, win = type(first).__name__, _get(spec, "block_size"), _get(first, "sliding_window")
    if not isinstance(kind, str) or not is_int(bs) or bs < 1:
        raise ValueError(f"kv_cache_groups[{i}]: needs a kv_cache_spec with a block_size >= 1, got spec "
                         f"{kind!r} with block_size {bs!r}")
    return kind, bs, win


def _check_uniform(i: int, spec, inner: Mapping) -> None:
    """A ``UniformTypeKVCacheSpecs``'s inner specs (layer name -> spec) must agree with the first one and the
    wrapper: one kind, one block size, one window (the group is read as one spec)."""
    names = list(inner)
    first = inner[names[0]]
    ref = {"kind": type(first).__name__, "block_size": _get(spec, "block_size"),
           "sliding_window": _get(first, "sliding_window")}
    for name in names:
        s = inner[name]
        have = {"kind": type(s).__name__, "block_size": _get(s, "block_size", ref["block_size"]),
                "sliding_window": _get(s, "sliding_window")}
        for k, v in have.items():
            if v != ref[k]:
                raise ValueError(f"kv_cache_groups[{i}].kv_cache_spec ({type(spec).__name__}): its layers' specs "
                                 f"differ: {k} {v!r} for {name!r}, {ref[k]!r} for {names[0]!r}; one group is "
                                 "read as one spec")


def read_engine_plan(kv_cache_config) -> EnginePlan:
    """Read an engine's KV-cache plan (module docstring) into an :class:`EnginePlan`.

    Raises ValueError naming ``kv_cache_groups[i]`` for a group without ``layer_names``, without a
    spec block size, of a spec kind this library does not know (the spec's class name given), or a
    sliding group without a window.
    """
    groups = kv_cache_config if isinstance(kv_cache_config, (list, tuple)) else \
        _get(kv_cache_config, "kv_cache_groups")
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ValueError(f"kv_cache_config must have a non-empty kv_cache_groups list (vLLM's KVCacheConfig), "
                         f"got {type(kv_cache_config).__name__}")
    out = []
    for i, g in enumerate(groups):
        names = _get(g, "layer_names")
        if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)) or not names:
            raise ValueError(f"kv_cache_groups[{i}].layer_names must be a non-empty list of layer names, "
                             f"got {names!r}")
        twice = next((n for j, n in enumerate(names) if n in names[:j]), None)
        if twice is not None:
            raise ValueError(f"kv_cache_groups[{i}].layer_names lists {twice!r} twice")
        eagle = _get(g, "is_eagle_group", None)
        eagle = False if eagle is None else eagle   # NOTE: absent or null: not a draft group
        if not isinstance(eagle, bool):
            raise ValueError(f"kv_cache_groups[{i}].is_eagle_group must be a bool, got {eagle!r}")
        spec, bs, win = _spec_fields(i, g)
        kind = SPEC_KINDS.get(spec)
        if kind is None:
            raise ValueError(f"kv_cache_groups[{i}] (spec {spec}, first layer {names[0]!r}): a spec kind this "
                             f"library does not know yet (known: {sorted(SPEC_KINDS)})")
        window: Optional[int] = None
        if kind == "sliding":
            # NOTE: the ignores: `win` is the engine's duck-typed spec attribute, an int once is_int passed
            if not (is_int(win) and win >= 1):  # type: ignore[operator]
                raise ValueError(f"kv_cache_groups[{i}] (spec {spec}): sliding_window must be an int >= 1, "
                                 f"got {win!r}")
            window = int(win)  # type: ignore[call-overload]
        out.append(EngineGroup(tuple(names), kind, bs, window, spec, eagle))
    return EnginePlan(tuple(out))


def check_block_counts(layout, batch, where: str = "step") -> None:
    """The count rule (module docstring) over a :class:`~dsv4_index.batch.StepBatch`'s full block
    lists (write runs starting at 0: new and resumed requests).

    Parameters
    ----------
    layout : DSV4Layout — its ``groups`` (gid order) and ``cp_world_size`` (under DCP the lists are
        per rank: not checked).
    batch : StepBatch — ``write_gids / write_slots / write_starts / write_cu`` int64 arrays, one entry
        per run; ``req_slots``, ``num_computed_tokens``, ``num_scheduled_tokens`` ``[B]``.

    Raises ValueError naming the slot and the two groups whose lists disagree. Checked: layouts of an
    engine's group plan (a group with a layer list: ``groups="vllm"``, explicit groups with layers,
    :func:`layout_from_kv_cache_config`); the one-group-per-role default layout keeps accepting lists
    longer than the step needs (hand-written steps). Circular groups (a ring of fixed blocks) are not
    checked, nor any layout under DCP.
    """
    if layout.cp_world_size > 1 or all(g.layers is None for g in layout.groups):
        return  # NOTE: only engine group plans (groups="vllm", layer lists, from_kv_cache_config) are checked
    full = np.flatnonzero(batch.write_starts == 0)
    if not full.size:
        return
    groups = layout.groups
    lens = (batch.write_cu[full + 1] - batch.write_cu[full]).astype(np.int64)
    gids = batch.write_gids[full]
    a = np.array([g.alloc_block_size for g in groups], dtype=np.int64)
    skip = np.array([g.kind == "circular" for g in groups], dtype=bool)
    keep = (lens > 0) & ~skip[gids]
    if not keep.any():
        return
    slots, lens, gids = batch.write_slots[full][keep], lens[keep], gids[keep]
    lo, hi = (lens - 1) * a[gids] + 1, lens * a[gids]  # NOTE: the token counts T the list can hold
    need = np.zeros(int(max(slots.max(), batch.req_slots.max(initial=0))) + 1, dtype=np.int64)
    need[batch.req_slots] = batch.num_computed_tokens + batch.num_scheduled_tokens
    enough = hi >= need[slots]  # NOTE: a list too short for the step is the pipeline's "block ids missing"
    if not enough.all():
        slots, lo, hi, gids = slots[enough], lo[enough], hi[enough], gids[enough]
        if not slots.size:
            return
    order = np.argsort(slots, kind="stable")
    slots, lo, hi, gids = slots[order], lo[order], hi[order], gids[order]
    starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
    lo_max, hi_min = np.maximum.reduceat(lo, starts), np.minimum.reduceat(hi, starts)
    bad = np.flatnonzero(lo_max > hi_min)
    if bad.size:
        s = starts[bad[0]]
        e = starts[bad[0] + 1] if bad[0] + 1 < starts.size else slots.size
        i = s + int(np.argmax(lo[s:e]))
        j = s + int(np.argmin(hi[s:e]))
        gi, gj = groups[int(gids[i])], groups[int(gids[j])]
        raise ValueError(
            f"{where}: the block lists of slot {int(slots[s])} cannot belong to these groups: gid {gi.gid} "
            f"({gi.name}, block {gi.alloc_block_size}) holds {(int(lo[i]) - 1) // gi.alloc_block_size + 1} blocks "
            f"({int(lo[i])}..{int(hi[i])} tokens), gid {gj.gid} ({gj.name}, block {gj.alloc_block_size}) holds "
            f"{int(hi[j]) // gj.alloc_block_size} ({int(lo[j])}..{int(hi[j])} tokens); is the engine's group "
            f"order the layout's? (build it with DSV4Layout.from_kv_cache_config)")


def layout_from_kv_cache_config(cls, kv_cache_config, model_config, max_model_len: Optional[int] = None,
                                **kwargs):
    """``DSV4Layout.from_kv_cache_config`` (``cls``: the layout class): the layout of an engine's own
    KV-cache plan, one group per engine group, in the engine's gid order, with its block size and layers.

    Parameters
    ----------
    kv_cache_config : vLLM's ``KVCacheConfig`` (duck-typed: ``kv_cache_groups``, each with
        ``layer_names`` and ``kv_cache_spec``), a dict of that shape, or the group list.
    model_config : the model config :meth:`from_config` takes, or vLLM's ``ModelConfig`` (its
        ``hf_config``, and its ``max_model_len`` when ``max_model_len`` is not given).
    max_model_len : int, optional (required unless ``model_config.max_model_len`` exists).
    **kwargs : the other :meth:`from_config` options (``indexer_causal_indices``, ...), except those the
        plan decides (:data:`PLAN_OWNS`: ``groups``, ``circular``, the per-role block sizes,
        ``swa_group_per_layer``), refused by name. A circular group (``CircularBufferSpec``)
        is a one-block ring of its ``block_size`` rows.

    Raises ConfigError (a ValueError) naming the group (``kv_cache_groups[i]`` and its spec) and the
    layer for a plan this layout cannot serve (:meth:`dsv4_index.engine_plan.EnginePlan.resolve`).
    """
    bad = [k for k in PLAN_OWNS if k in kwargs]
    if bad:
        raise ValueError(f"from_kv_cache_config: {bad} come from the engine plan; do not pass them")
    if getattr(model_config, "hf_config", None) is not None:
        if max_model_len is None:
            max_model_len = getattr(model_config, "max_model_len", None)
        model_config = model_config.hf_config
    if max_model_len is None:
        raise ValueError("max_model_len is required (model_config has no max_model_len)")
    plan = read_engine_plan(kv_cache_config)
    return cls.from_config(model_config, max_model_len, groups=plan, **kwargs)
