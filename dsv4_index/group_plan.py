"""Which kv-cache groups a layout has and which layers each one serves (docs/DESIGN.md §3 "An engine's own
groups"): the default plan (one group per role), vLLM's plan (``groups="vllm"``), or an engine's explicit
group list. :meth:`dsv4_index.geometry.DSV4Layout.from_config` turns a plan into ``GroupSpec`` s.

Roles (the cache a group holds): ``"mla"`` (full: C4A / C128A main caches and the C4I indexer keys),
``"swa"`` (sliding KV of every layer), ``"c4_state"`` (compressor state of C4A and C4I), ``"c128_state"``
(compressor state of C128A).

vLLM's plan (its KV-cache planner, ``get_kv_cache_groups`` / ``DeepseekV4KVCachePlanner``, as described in
docs/DESIGN.md §3 "An engine's own groups"; vLLM main around PR #58074): every MLA-spec layer in one full group;
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

__all__ = ["PlannedGroup", "ROLES", "plan_groups", "vllm_plan", "layers_of_role"]

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


def layers_of_role(role: str, ratios: Sequence[int], r4: Optional[int], r128: Optional[int]) -> Tuple[int, ...]:
    """Layers that have a cache of ``role``: mla every compressed layer, swa every layer, states the
    layers of their ratio."""
    if role == "swa":
        return tuple(range(len(ratios)))
    if role == "mla":
        return tuple(i for i, r in enumerate(ratios) if r > 0)
    want = r4 if role == "c4_state" else r128
    return tuple(i for i, r in enumerate(ratios) if want is not None and r == want)


def _approx_gcd(counts: List[int]) -> int:
    def padding(d: int) -> int:
        return sum(cdiv(n, d) * d - n for n in counts)

    # NOTE: min keeps the first minimum: the smallest d on ties
    return min(range(max(counts[0], 1), max(counts) + 1), key=padding)


def vllm_plan(ratios: Sequence[int], r4: Optional[int], r128: Optional[int]) -> List[PlannedGroup]:
    """vLLM's group plan for a DSV4 config (module docstring)."""
    layers = {role: layers_of_role(role, ratios, r4, r128) for role in ROLES}
    n4, n128 = len(layers["c4_state"]), len(layers["c128_state"])
    kinds = [(role, len(layers[role])) for role in ("swa", "c4_state", "c128_state") if layers[role]]
    full = max(n4, n128)
    counts = ([full] if full else []) + [n for _, n in kinds]
    d = _approx_gcd(counts)
    plan = [PlannedGroup("mla", "mla")] if full else []
    for role, n in kinds:
        k = cdiv(n, d)
        for i in range(k):
            plan.append(PlannedGroup(role, role if k == 1 else f"{role}_{i}", layers[role][i::k]))
    return plan


def _role_of_layer_name(name: str, ratios, r4, r128, where: str = "groups") -> Tuple[str, int]:
    m = _LAYER_RE.search(name)
    if m is None:
        raise ValueError(f"{where}: layer name {_short(name)} has no 'layers.<i>.' part")
    layer = int(m.group(1))
    if not 0 <= layer < len(ratios):
        raise ValueError(f"{where}: layer name {_short(name)} names layer {layer}, the config has {len(ratios)}")
    if name.endswith("swa_cache"):
        return "swa", layer
    if name.endswith("state_cache"):
        return ("c4_state" if ratios[layer] == r4 else "c128_state"), layer
    return "mla", layer


_GROUP_KEYS = ("role", "layers", "layer_names", "block_size", "name")


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _check_group(i: int, g) -> None:
    """The keys and value types of ``groups[i]``; ``ValueError`` naming the key path
    (``groups[2].layer_names[0]``). Explicit groups accept only the keys they use."""
    if not isinstance(g, Mapping):
        raise ValueError(f"groups[{i}] must be a dict (role / layers / layer_names / block_size / name), "
                         f"got {type(g).__name__}")
    for k in g:
        if k not in _GROUP_KEYS:
            why = (" (a group's window is the config's sliding_window; explicit groups take "
                   if k == "window" else " (explicit groups take ") + ", ".join(_GROUP_KEYS) + ")"
            raise ValueError(f"groups[{i}].{_short(k) if not isinstance(k, str) else k}: unknown key{why}")
    for k in ("name", "role"):
        v = g.get(k)
        if v is not None and (not isinstance(v, str) or not v.isprintable()):
            raise ValueError(f"groups[{i}].{k} must be a string, got {type(v).__name__} {_short(v)}")
    for k, what in (("layer_names", "a layer name (a string)"), ("layers", "a layer index (an int)")):
        v = g.get(k)
        if v is None:
            continue
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"groups[{i}].{k} must be a list of layer {'names' if k == 'layer_names' else 'indices'}"
                             f", got {_short(v)}")
        for j, x in enumerate(v):
            if not (isinstance(x, str) if k == "layer_names" else is_int(x)):
                raise ValueError(f"groups[{i}].{k}[{j}] must be {what}, got {type(x).__name__} {_short(x)}")


def _explicit(groups: Sequence, ratios, r4, r128) -> List[PlannedGroup]:
    plan = []
    for i, g in enumerate(groups):
        _check_group(i, g)
        role, layers = g.get("role"), g.get("layers")
        if g.get("layer_names") is not None:
            found = {_role_of_layer_name(n, ratios, r4, r128, f"groups[{i}].layer_names[{j}]")
                     for j, n in enumerate(g["layer_names"])}
            roles = {r for r, _ in found}
            if len(roles) != 1 or (role is not None and roles != {role}):
                raise ValueError(f"groups[{i}]: layer_names hold caches of roles {sorted(roles)}; one group "
                                 f"holds one role" + (f" ({role!r})" if role else ""))
            role = roles.pop()
            if role != "mla":  # NOTE: the mla group serves every compressed layer through one table
                layers = sorted({layer for _, layer in found})
        if role not in ROLES:
            raise ValueError(f"groups[{i}].role must be one of {list(ROLES)}, got {role!r}")
        if layers is not None:
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
    """The plan of ``from_config(groups=...)``: None (one group per present role, docs/DESIGN.md §3 order),
    ``"vllm"``, or an explicit list of dicts, one per engine group in the engine's gid order: ``role``
    (or ``layer_names``: vLLM's layer names ``model.layers.<i>.<...>`` ending in ``swa_cache`` (swa),
    ``state_cache`` (the layer's compressor state) or anything else (mla)), optional ``layers`` (indices;
    default every layer of the role), ``block_size`` (allocation block size), ``name``.

    Checks: names unique; one mla group at most; every layer that has a cache of a role is served by
    exactly one group of that role; a group serves only layers of its role.
    """
    if groups is None:
        plan = [PlannedGroup(r, r) for r in ROLES if layers_of_role(r, ratios, r4, r128)]
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
    for role in ROLES:
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
