"""Which kv-cache groups a layout has and which layers each one serves (DESIGN §3 "An engine's own
groups"): the default plan (one group per role), vLLM's plan (``groups="vllm"``), or an engine's explicit
group list. :meth:`dsv4_index.geometry.DSV4Layout.from_config` turns a plan into ``GroupSpec`` s.

Roles (the cache a group holds): ``"mla"`` (full: C4A / C128A main caches and the C4I indexer keys),
``"swa"`` (sliding KV of every layer), ``"c4_state"`` (compressor state of C4A and C4I), ``"c128_state"``
(compressor state of C128A).

vLLM's plan (its KV-cache planner, ``get_kv_cache_groups`` / ``DeepseekV4KVCachePlanner``, as described in
``reviews/engine_integration.md`` §1; vLLM main around PR #58074): every MLA-spec layer in one full group;
sliding-like layers grouped by ``(block_size, window)``; per kind the count of layer tuples (full: the
larger of the C4 and C128 layer counts, SWA: every layer, states: their layers); ``d`` = the ``d >=
counts[0]`` with the least round-up padding ``sum(cdiv(n, d) * d - n)`` (searched up to the largest
count, the smallest ``d`` on ties: our reading, it decides nothing for Flash or Pro); a kind of ``n``
tuples splits into ``k = cdiv(n, d)`` sub-groups, sub-group ``i`` taking tuples ``i::k``; groups in the
order full, SWA sub-groups, C4 state, C128 state. V4-Flash:
counts ``[21, 44, 21, 20]``, ``d = 22``; V4-Pro ``[31, 62, 30, 31]``, ``d = 31``: 5 groups each. Newer vLLM
planners infer block sizes and may group differently: pass the engine's actual groups then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ._common import cdiv, check_int, is_int
from .specs import ratio_kinds

__all__ = ["PlannedGroup", "ROLES", "plan_groups", "vllm_plan", "layers_of_role", "roles_of"]

ROLES = ("mla", "swa", "c4_state", "c128_state")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class PlannedGroup:
    """One group of a plan: ``role``, ``name``, the layers it serves (None: every layer of its role)
    and an optional allocation block size (None: the ``from_config`` default of the role)."""

    role: str
    name: str
    layers: Optional[Tuple[int, ...]] = None
    block_size: Optional[int] = None


def roles_of(ratios: Sequence[int]) -> Tuple[str, ...]:
    """Roles of a config: ``mla``, ``swa`` and the state role of each ratio that has one
    (:func:`dsv4_index.specs.ratio_kinds`: ``c4_state`` / ``c128_state`` for DeepSeek-V4, ``c2_state``
    for V4.1; ratio 1 has none), ascending by ratio; :data:`ROLES` for DeepSeek-V4 configs."""
    states = tuple(k.state for k in ratio_kinds(ratios) if k.state)
    return ROLES if set(states) <= set(ROLES) else ("mla", "swa") + states


def layers_of_role(role: str, ratios: Sequence[int], r4: Optional[int], r128: Optional[int]) -> Tuple[int, ...]:
    """Layers that have a cache of ``role``: mla every compressed layer, swa every layer, states the
    layers of their ratio (``r4`` / ``r128`` are unused: the ratio of a state role follows from
    ``ratios``, :func:`dsv4_index.specs.ratio_kinds`)."""
    if role == "swa":
        return tuple(range(len(ratios)))
    if role == "mla":
        return tuple(i for i, r in enumerate(ratios) if r > 0)
    want = [k.ratio for k in ratio_kinds(ratios) if k.state == role]
    return tuple(i for i, r in enumerate(ratios) if r in want)


def _approx_gcd(counts: List[int]) -> int:
    def padding(d: int) -> int:
        return sum(cdiv(n, d) * d - n for n in counts)

    # NOTE: min keeps the first minimum: the smallest d on ties
    return min(range(max(counts[0], 1), max(counts) + 1), key=padding)


def vllm_plan(ratios: Sequence[int], r4: Optional[int], r128: Optional[int]) -> List[PlannedGroup]:
    """vLLM's group plan for a DSV4 config (module docstring)."""
    roles = roles_of(ratios)
    layers = {role: layers_of_role(role, ratios, r4, r128) for role in roles}
    kinds = [(role, len(layers[role])) for role in roles[1:] if layers[role]]
    # NOTE: the full group's tuples: the most layers of one compressed ratio (V4: C4 or C128 layers)
    full = max([sum(r == k.ratio for r in ratios) for k in ratio_kinds(ratios)] or [0])
    counts = ([full] if full else []) + [n for _, n in kinds]
    d = _approx_gcd(counts)
    plan = [PlannedGroup("mla", "mla")] if full else []
    for role, n in kinds:
        k = cdiv(n, d)
        for i in range(k):
            plan.append(PlannedGroup(role, role if k == 1 else f"{role}_{i}", layers[role][i::k]))
    return plan


def _role_of_layer_name(name: str, ratios, r4, r128) -> Tuple[str, int]:
    m = _LAYER_RE.search(name)
    if m is None:
        raise ValueError(f"groups: layer name {name!r} has no 'layers.<i>.' part")
    layer = int(m.group(1))
    if not 0 <= layer < len(ratios):
        raise ValueError(f"groups: layer name {name!r} names layer {layer}, the config has {len(ratios)}")
    if name.endswith("swa_cache"):
        return "swa", layer
    if name.endswith("state_cache"):
        state = [k.state for k in ratio_kinds(ratios) if k.ratio == ratios[layer]]
        if not state or state[0] is None:
            raise ValueError(f"groups: layer name {name!r} is a compressor state, but layer {layer} (ratio "
                             f"{ratios[layer]}) has none")
        return state[0], layer
    return "mla", layer


def _explicit(groups: Sequence, ratios, r4, r128) -> List[PlannedGroup]:
    plan = []
    for i, g in enumerate(groups):
        if not isinstance(g, Mapping):
            raise ValueError(f"groups[{i}] must be a dict (role / layers / layer_names / block_size / name), "
                             f"got {type(g).__name__}")
        unknown = set(g) - {"role", "layers", "layer_names", "block_size", "name", "window"}
        if unknown:
            raise ValueError(f"groups[{i}] has unknown key(s) {sorted(unknown)}")
        role, layers = g.get("role"), g.get("layers")
        if g.get("layer_names") is not None:
            found = {_role_of_layer_name(n, ratios, r4, r128) for n in g["layer_names"]}
            roles = {r for r, _ in found}
            if len(roles) != 1 or (role is not None and roles != {role}):
                raise ValueError(f"groups[{i}]: layer_names hold caches of roles {sorted(roles)}; one group "
                                 f"holds one role" + (f" ({role!r})" if role else ""))
            role = roles.pop()
            if role != "mla":  # NOTE: the mla group serves every compressed layer through one table
                layers = sorted({layer for _, layer in found})
        if role not in roles_of(ratios):
            raise ValueError(f"groups[{i}].role must be one of {list(roles_of(ratios))}, got {role!r}")
        if layers is not None:
            if isinstance(layers, (str, bytes)) or not all(is_int(x) for x in layers):
                raise ValueError(f"groups[{i}].layers must be a list of layer indices, got {layers!r}")
            layers = tuple(layers)
        bs = g.get("block_size")
        if bs is not None:
            check_int(f"groups[{i}].block_size", bs, lo=1)
        plan.append(PlannedGroup(role, g.get("name") or "", layers, bs))
    # names: the role, or role_<k> when a role has several groups
    per_role: Dict[str, int] = {}
    for p in plan:
        per_role[p.role] = per_role.get(p.role, 0) + 1
    seen: Dict[str, int] = {}
    out = []
    for p in plan:
        k = seen.get(p.role, 0)
        seen[p.role] = k + 1
        name = p.name or (p.role if per_role[p.role] == 1 else f"{p.role}_{k}")
        out.append(PlannedGroup(p.role, name, p.layers, p.block_size))
    return out


def plan_groups(groups, ratios: Sequence[int], r4: Optional[int], r128: Optional[int]) -> List[PlannedGroup]:
    """The plan of ``from_config(groups=...)``: None (one group per present role, DESIGN §3 order),
    ``"vllm"``, or an explicit list of dicts, one per engine group in the engine's gid order: ``role``
    (or ``layer_names``: vLLM's layer names ``model.layers.<i>.<...>`` ending in ``swa_cache`` (swa),
    ``state_cache`` (the layer's compressor state) or anything else (mla)), optional ``layers`` (indices;
    default every layer of the role), ``block_size`` (allocation block size), ``name``.

    Checks: names unique; one mla group at most; every layer that has a cache of a role is served by
    exactly one group of that role; a group serves only layers of its role.
    """
    if groups is None:
        plan = [PlannedGroup(r, r) for r in roles_of(ratios) if layers_of_role(r, ratios, r4, r128)]
    elif isinstance(groups, str):
        if groups != "vllm":
            raise ValueError(f"groups must be None, 'vllm' or a list of group dicts, got {groups!r}")
        plan = vllm_plan(ratios, r4, r128)
    elif isinstance(groups, (list, tuple)):
        plan = _explicit(groups, ratios, r4, r128)
    else:
        raise ValueError(f"groups must be None, 'vllm' or a list of group dicts, got {type(groups).__name__}")
    names = [p.name for p in plan]
    if len(set(names)) != len(names):
        raise ValueError(f"groups: group names must be unique, got {names}")
    if sum(p.role == "mla" for p in plan) > 1:
        raise ValueError("groups: at most one mla group (every compressed layer reads one full table)")
    for role in roles_of(ratios):
        need = set(layers_of_role(role, ratios, r4, r128))
        mine = [p for p in plan if p.role == role]
        if not need:
            if mine:
                raise ValueError(f"groups: group {mine[0].name!r} has role {role!r}, but no layer has that cache")
            continue
        if not mine:
            raise ValueError(f"groups: no group serves the {role!r} caches of layers {sorted(need)[:8]}...")
        if len(mine) == 1 and mine[0].layers is None:
            continue
        served: Dict[int, str] = {}
        for p in mine:
            if p.layers is None:
                raise ValueError(f"groups: group {p.name!r} needs 'layers' (role {role!r} has several groups)")
            for layer in p.layers:
                if layer not in need:
                    raise ValueError(f"groups: group {p.name!r} (role {role!r}) lists layer {layer}, which has "
                                     f"no {role} cache")
                if layer in served:
                    raise ValueError(f"groups: layer {layer} is in groups {served[layer]!r} and {p.name!r}")
                served[layer] = p.name
        missing = sorted(need - set(served))
        if missing:
            raise ValueError(f"groups: layers {missing[:8]} have a {role} cache but no group of role {role!r}")
    return plan
