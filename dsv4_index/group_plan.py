"""Which kv-cache groups a layout has and which layers each one serves (docs/DESIGN.md §3 "An engine's own
groups"): the default plan (one group per role), vLLM's plan (``groups="vllm"``), or an engine's explicit
group list. :meth:`dsv4_index.geometry.DSV4Layout.from_config` turns a plan into ``GroupSpec`` s.

Roles (the cache a group holds): ``"mla"`` (full: C4A / C128A main caches and the C4I indexer keys),
``"swa"`` (sliding KV of every layer), ``"c4_state"`` (compressor state of C4A and C4I), ``"c128_state"``
(compressor state of C128A).

vLLM's plan (vLLM 0.33's ``get_kv_cache_groups`` for the block-outermost layout that DeepSeek-V4's mixed
cache shapes resolve to, ``_get_packed_kv_cache_groups``; checked against that function's own output in
``tests/layout/fixtures/vllm033_*.json``): layers are bucketed by spec type in the order the model
registers its caches (per layer: indexer K cache (mla) and indexer compressor state, SWA cache, the
attention layer (mla), its compressor state), so the buckets come in order of first appearance: SWA
(layer 0 has one), MLA, then the state kind of the first compressed layer. A bucket is "balanced"
when each of its page sizes has as many layers (SWA, each state kind; the MLA bucket only when the C4
and C128 layer counts are equal); ``d`` = the ``d >= `` (the largest balanced bucket with several page
sizes: the C4 state) with the least round-up padding ``sum(cdiv(n, d) * d - n)`` over the balanced
buckets' counts, the larger ``d`` on ties; a balanced bucket of ``n`` layer tuples splits into ``k =
cdiv(n, d)`` sub-groups, sub-group ``i`` taking tuples ``i::k``; the MLA bucket, unbalanced, stays
whole. V4-Flash: ``[swa_0, swa_1, mla, c4_state, c128_state]``, Pro: ``[swa_0, swa_1, mla, c128_state,
c4_state]`` (d = 22 and 31). A config without C4 layers is not split (vLLM then splits sliding buckets
by page bytes, which this plan does not model: pass the engine's groups). Newer planners infer block
sizes and may group differently: build the layout from the engine's own plan then
(:meth:`dsv4_index.geometry.DSV4Layout.from_kv_cache_config`).

MTP draft layers (``num_nextn_predict_layers``, the last layers of ``compress_ratios``): an engine
without speculative decoding does not create them, so an explicit plan may leave them out (they are
then served by no group and :meth:`~dsv4_index.geometry.DSV4Layout.layer_channels` refuses them); an
engine may also give them a group of their own (vLLM #55390): a group whose layers are all draft
layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ._common import cdiv, check_int, is_int
from .specs import LOW_RATIOS, ratio_kinds

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


def _approx_gcd(counts: List[int], lower: int) -> int:
    def padding(d: int) -> int:
        return sum(cdiv(n, d) * d - n for n in counts)

    lo = max(lower, 1)
    if lo > max(counts):
        return lo
    best = lo
    for d in range(lo, max(counts) + 1):  # NOTE: the larger d on ties, as vLLM 0.33
        if padding(d) <= padding(best):
            best = d
    return best


def _registration_order(ratios: Sequence[int], r4: Optional[int]) -> List[str]:
    """Roles in the order vLLM's DeepSeek-V4 modules first register a cache of them."""
    order: List[str] = []
    for r in ratios:
        state = "c4_state" if r == r4 else "c128_state"
        roles = (["mla", state] if r == r4 else []) + ["swa"] + (["mla", state] if r > 0 else [])
        for x in roles:
            if x not in order:
                order.append(x)
    return order


def vllm_plan(ratios: Sequence[int], r4: Optional[int], r128: Optional[int]) -> List[PlannedGroup]:
    """vLLM 0.33's group plan for a DSV4 config (module docstring); a config with V4.1's low ratios
    takes :func:`_vllm_plan_low_ratios` (no engine plan of record to copy yet: pass the engine's groups)."""
    if any(r in LOW_RATIOS for r in ratios):
        return _vllm_plan_low_ratios(ratios, r4, r128)
    layers = {role: layers_of_role(role, ratios, r4, r128) for role in ROLES}
    n4, n128 = len(layers["c4_state"]), len(layers["c128_state"])
    balanced = {"swa": len(layers["swa"]), "c4_state": n4, "c128_state": n128}
    if n4 and n128 and n4 == n128 or n4 and not n128 or n128 and not n4:
        balanced["mla"] = max(n4, n128)
    balanced = {k: v for k, v in balanced.items() if v}
    lower = n4  # NOTE: the C4 state bucket (indexer + attention states) and a balanced mla have 2+ page sizes
    d = _approx_gcd(list(balanced.values()), lower) if lower else None
    plan = []
    for role in _registration_order(ratios, r4):
        n = balanced.get(role)
        k = 1 if d is None or n is None or role == "mla" else cdiv(n, d)
        if role == "mla":
            plan.append(PlannedGroup("mla", "mla"))
            continue
        for i in range(k):
            plan.append(PlannedGroup(role, role if k == 1 else f"{role}_{i}", layers[role][i::k]))
    return plan


def _vllm_plan_low_ratios(ratios: Sequence[int], r4: Optional[int], r128: Optional[int]) -> List[PlannedGroup]:
    """The strided plan generalised to V4.1's ratio kinds (full group first, then each kind's sub-groups)."""
    roles = roles_of(ratios)
    layers = {role: layers_of_role(role, ratios, r4, r128) for role in roles}
    kinds = [(role, len(layers[role])) for role in roles[1:] if layers[role]]
    # NOTE: the full group's tuples: the most layers of one compressed ratio (V4: C4 or C128 layers)
    full = max([sum(r == k.ratio for r in ratios) for k in ratio_kinds(ratios)] or [0])
    counts = ([full] if full else []) + [n for _, n in kinds]
    d = _approx_gcd(counts, counts[0])
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
        state = [k.state for k in ratio_kinds(ratios) if k.ratio == ratios[layer]]
        if not state or state[0] is None:
            raise ValueError(f"groups: layer name {name!r} is a compressor state, but layer {layer} (ratio "
                             f"{ratios[layer]}) has none")
        return state[0], layer
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
        if role not in roles_of(ratios):
            raise ValueError(f"groups[{i}].role must be one of {list(roles_of(ratios))}, got {role!r}")
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


def plan_groups(groups, ratios: Sequence[int], r4: Optional[int], r128: Optional[int],
                num_hidden_layers: Optional[int] = None) -> List[PlannedGroup]:
    """The plan of ``from_config(groups=...)``: None (one group per present role, docs/DESIGN.md §3 order),
    ``"vllm"``, or an explicit list of dicts, one per engine group in the engine's gid order: ``role``
    (or ``layer_names``: vLLM's layer names ``model.layers.<i>.<...>`` ending in ``swa_cache`` (swa),
    ``state_cache`` (the layer's compressor state) or anything else (mla)), optional ``layers`` (indices;
    default every layer of the role), ``block_size`` (allocation block size), ``name``.

    Checks: names unique; one mla group at most; every layer that has a cache of a role is served by
    exactly one group of that role (an explicit list may leave out the MTP draft layers, those at or
    past ``num_hidden_layers``, entirely: an engine without speculative decoding has none); a group
    serves only layers of its role.
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
    unserved: set = set()
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
        if missing and num_hidden_layers is not None and min(missing) >= num_hidden_layers:
            unserved.update(missing)
            missing = []
        if missing:
            raise ValueError(f"groups: layers {missing[:8]} have a {role} cache but no group of role {role!r}")
    if unserved:
        held = sorted({x for p in plan if p.layers is not None for x in p.layers} & unserved)
        if held:
            raise ValueError(f"groups: MTP layer(s) {held} are served for some caches but not all; an engine "
                             f"plan holds every cache of a draft layer or none")
    return plan
