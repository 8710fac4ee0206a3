"""The derivation behind :meth:`DSV4Layout.from_config <dsv4_index.geometry.DSV4Layout.from_config>`
(docs/DESIGN.md §3), step by step on a normalised config dict: the arguments, the model's fields, the
group plan, each group's sizes (block size, table width), the channels.

Every error is one ``ValueError`` naming the argument or config field (``from_config`` adds the config's
name). :func:`derive_layout` returns the layout's fields; :mod:`dsv4_index.geometry` builds the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ._common import cdiv, check_int, is_int, round_up
from .engine_plan import EnginePlan, topk_owners
from .group_plan import PlannedGroup, plan_groups
from .specs import CHANNEL_OUTPUTS, INDEX_ALIGN, ChannelSpec, GroupSpec, RatioKind, parse_circular, ratio_kinds

__all__ = ["derive_layout", "check_kv_sources"]


@dataclass
class _Args:
    """The checked arguments of ``from_config``; ``circular`` and ``alloc`` grow with the plan (engine
    rings, V4.1 state groups)."""

    max_model_len: int
    sliding_tables: str
    circular: Dict[str, int]        # group or role -> ring capacity
    ring_bs: Dict[str, int]         # group or role -> block size of a ring of several blocks
    cp_world_size: int
    cp_interleave: int
    alloc: Dict[str, int]           # role -> allocation block size
    kbs: Dict[str, int]             # group or role -> kernel block size

    @property
    def per_rank(self) -> int:
        """Tokens one rank stores; equals ``max_model_len`` without DCP."""
        return round_up(cdiv(self.max_model_len, self.cp_world_size), self.cp_interleave)

    def rows_per_rank(self, ratio: int) -> int:
        """Compressed rows (ratio ``ratio``) one rank stores."""
        n = cdiv(self.max_model_len, ratio)
        w, i = self.cp_world_size, self.cp_interleave
        return cdiv(n, i * w) * i if w > 1 else n


@dataclass
class _Model:
    """The fields of a normalised config the layout reads."""

    n_hidden: int
    ratios: Tuple[int, ...]
    window: int
    kinds: Tuple[RatioKind, ...]
    r4: Optional[int]
    r128: Optional[int]
    index_topk: Optional[int]
    kv_sources: Tuple[int, ...] = ()  # NOTE: V4.1's kv_source_layer_ids (engine_plan.kv_owners)
    candidate: Tuple[Optional[int], Optional[int], Optional[int]] = (None, None, None)  # NOTE: C, nb, source


def derive_layout(cfg: dict, max_model_len: int, *, mla_block_size, swa_block_size, c4_state_block_size,
                  c128_state_block_size, indexer_causal_indices, kernel_block_size, cp_world_size,
                  cp_interleave, sliding_tables, circular, compact_compressed, groups,
                  swa_group_per_layer=False) -> Dict[str, Any]:
    """The fields of :class:`~dsv4_index.geometry.DSV4Layout` (its constructor's keywords) for a
    normalised config; arguments as :meth:`~dsv4_index.geometry.DSV4Layout.from_config`. Raises
    ``ValueError`` naming the argument or config field."""
    args = _check_arguments(max_model_len, sliding_tables, circular, cp_world_size, cp_interleave,
                            mla_block_size, swa_block_size, c4_state_block_size, c128_state_block_size)
    model = _read_config(cfg)
    args.kbs = _kernel_block_sizes(kernel_block_size)
    plan = _plan(groups, model, args, swa_group_per_layer)
    specs: List[GroupSpec] = []
    for p in plan:
        specs.append(_size_group(len(specs), p, model, args))
    channels = _channels(specs, model, args.max_model_len, bool(indexer_causal_indices), compact_compressed)
    _check_candidate(model.candidate[0], channels)
    return dict(groups=tuple(specs), channels=channels, max_model_len=args.max_model_len,
                sliding_window=model.window, index_topk=model.index_topk, compress_ratios=model.ratios,
                num_layers=len(model.ratios), c4_ratio=model.r4, c128_ratio=model.r128,
                indexer_causal_indices=bool(indexer_causal_indices), cp_world_size=args.cp_world_size,
                cp_interleave=args.cp_interleave, kv_sources=model.kv_sources,
                candidate_block_size=model.candidate[0], candidate_topk_blocks=model.candidate[1],
                candidate_source_layer=model.candidate[2])


def _check_arguments(max_model_len, sliding_tables, circular, cp_world_size, cp_interleave, mla_block_size,
                     swa_block_size, c4_state_block_size, c128_state_block_size) -> _Args:
    """Step 1: the arguments that do not depend on the config, in their order of the signature."""
    max_model_len = check_int("max_model_len", max_model_len, lo=1)
    if sliding_tables not in ("ring", "full"):
        raise ValueError(f"sliding_tables must be 'ring' or 'full', got {sliding_tables!r}")
    capacities, ring_bs = parse_circular(circular)
    cp_world_size = check_int("cp_world_size", cp_world_size, lo=1)
    cp_interleave = check_int("cp_interleave", cp_interleave, lo=1)
    alloc = {"mla": check_int("mla_block_size", mla_block_size, lo=1),
             "swa": check_int("swa_block_size", swa_block_size, lo=1),
             "c4_state": check_int("c4_state_block_size", c4_state_block_size, lo=1),
             "c128_state": check_int("c128_state_block_size", c128_state_block_size, lo=1)}
    return _Args(max_model_len, sliding_tables, capacities, ring_bs, cp_world_size, cp_interleave, alloc, {})


def _read_config(cfg: dict) -> _Model:
    """Step 2: the config's layers, compress ratios (and their kinds), window and ``index_topk``."""
    missing = [k for k in ("num_hidden_layers", "compress_ratios", "sliding_window") if k not in cfg]
    if missing:
        raise ValueError(f"config is missing key(s) {missing}")
    n_hidden = check_int("config['num_hidden_layers']", cfg["num_hidden_layers"], lo=1)
    n_mtp = check_int("config['num_nextn_predict_layers']", cfg.get("num_nextn_predict_layers", 0), lo=0)
    ratios = cfg["compress_ratios"]
    if not isinstance(ratios, (list, tuple)) or any(not is_int(r) or r < 0 for r in ratios):
        raise ValueError(f"config['compress_ratios'] must be a list of ints >= 0, got {ratios!r}")
    ratios = tuple(ratios)
    if len(ratios) != n_hidden + n_mtp:
        raise ValueError(f"config['compress_ratios'] has {len(ratios)} entries, expected "
                         f"num_hidden_layers + num_nextn_predict_layers = {n_hidden + n_mtp}")
    window = check_int("config['sliding_window']", cfg["sliding_window"], lo=1)
    kinds = ratio_kinds(ratios)
    r4 = next((k.ratio for k in kinds if k.kind == "c4"), None)
    r128 = next((k.ratio for k in reversed(kinds) if k.kind == "c128"), None)
    index_topk = cfg.get("index_topk")
    if r4 is not None:
        index_topk = check_int("config['index_topk']", index_topk, lo=1) if "index_topk" in cfg else None
        if index_topk is None:
            raise ValueError("config is missing key(s) ['index_topk'] (needed by c4 layers)")
    sources = check_kv_sources(cfg.get("kv_source_layer_ids"), ratios, n_hidden)
    _check_index_sources(_layer_list(cfg.get("index_source_layer_ids"), "index_source_layer_ids", ratios, n_hidden),
                         ratios)
    return _Model(n_hidden, ratios, window, kinds, r4, r128, index_topk, sources,
                  _read_candidate(cfg, ratios, n_hidden))


def check_kv_sources(sources, ratios, n_hidden: int) -> Tuple[int, ...]:
    """V4.1's ``kv_source_layer_ids`` checked (None: no sources, every compressed layer owns its caches): a list of
    compressed backbone layers such that every compressed layer has a source of its own ratio at or below it (vLLM's
    ``kv_source_layer_id`` rule, :func:`~dsv4_index.engine_plan.kv_owners`). The one rule ``from_config`` and the
    trace reader apply; ValueError naming ``config['kv_source_layer_ids']`` and the layer."""
    src = sorted(set(int(s) for s in _layer_list(sources, "kv_source_layer_ids", ratios, n_hidden)))
    if src:  # NOTE: a layer reads the nearest source at or below it: that cache must be of its ratio
        for i, r in enumerate(ratios):
            below = [s for s in src if s <= i]
            if r > 0 and (not below or ratios[below[-1]] != r):
                raise ValueError(f"config['kv_source_layer_ids'] {list(src)}: compressed layer {i} (ratio {r}) "
                                 + (f"reads layer {below[-1]}'s cache, of ratio {ratios[below[-1]]}" if below else
                                    "has no source at or below it") + ": every compressed layer needs a source of "
                                 "its own ratio at or below it (vLLM's kv_source_layer_id rule)")
    return tuple(src)


def _read_candidate(cfg: dict, ratios, n_hidden: int):
    """V4.1's two-level indexer: ``(candidate_block_size C, candidate_topk_blocks nb, candidate_source_layer_id)``
    of the config, or ``(None, None, None)`` without it. On iff both sizes are ints > 0 (vLLM's rule,
    ``sparse_indexer.py``) and ``candidate_source_layer_id``, when present, is not None or negative (the
    transformers config's "off"); the source, when given, must be an indexed backbone layer."""
    c, nb = cfg.get("candidate_block_size"), cfg.get("candidate_topk_blocks")
    src = cfg.get("candidate_source_layer_id", -2)
    if c is None and nb is None:
        return None, None, None
    c = check_int("config['candidate_block_size']", c, lo=0)
    nb = check_int("config['candidate_topk_blocks']", nb, lo=0)
    off = src is None or (is_int(src) and src < 0 and "candidate_source_layer_id" in cfg)
    if c == 0 or nb == 0 or off:
        return None, None, None
    if src == -2:
        return c, nb, None
    kinds = {k.ratio: k.kind for k in ratio_kinds(ratios)}
    if not is_int(src) or not 0 <= src < n_hidden or kinds.get(ratios[src]) != "c4":
        raise ValueError(f"config['candidate_source_layer_id'] must be an indexed backbone layer (one whose "
                         f"compress ratio has an indexer), got {src!r}")
    return c, nb, int(src)


def _check_candidate(c: Optional[int], channels: Dict[str, ChannelSpec]) -> None:
    """A candidate block of ``C`` rows must sit inside one cache block of every channel that converts top-k
    (``phys = slot(block * C) / C``): ``C`` divides the channel's compressed rows per block."""
    if c is None:
        return
    for ch in channels.values():
        if (ch.builder or ch.name) == "c4a" and ch.rows_per_block % c:
            raise ValueError(f"config['candidate_block_size'] = {c} does not divide the {ch.rows_per_block} "
                             f"compressed rows per cache block of channel {ch.name!r} (a candidate block must "
                             f"lie inside one cache block; pick a kernel_block_size whose rows it divides)")


def _layer_list(layers, key: str, ratios, n_hidden: int):
    """``layers`` (the config's ``key``; None or absent: empty), a list of compressed backbone layers (V4.1's source
    lists). ``0``, ``False`` or any other non-list is refused, not read as "no sources"."""
    if layers is None:
        return ()
    what = (f"config[{key!r}] must be a list of compressed backbone layers (ints in [0, {n_hidden}) with a "
            f"compress ratio > 0)")
    if not isinstance(layers, (list, tuple)):
        raise ValueError(f"{what}, got {layers!r}")
    for j, s in enumerate(layers):
        if not is_int(s) or not 0 <= s < n_hidden or ratios[s] == 0:
            why = f": layer {s} is SWA-only (compress ratio 0)" if is_int(s) and 0 <= s < n_hidden else ""
            raise ValueError(f"{what}, got {list(layers)!r}: [{j}] is {s!r}{why}")
    return layers


def _check_index_sources(sources, ratios) -> None:
    """V4.1's ``index_source_layer_ids``: every indexed layer that is no index source attends with the top-k of the
    nearest one below it (:func:`~dsv4_index.engine_plan.topk_owners`), whose row ids must be of its own ratio
    (its ``topk_to_slots`` reads its own ratio's channel)."""
    if not sources:
        return
    for layer, owner in topk_owners(ratios, sources).items():
        if owner == layer and layer not in sources or ratios[owner] != ratios[layer]:
            raise ValueError(f"config['index_source_layer_ids'] {sorted(set(sources))}: indexed layer {layer} (ratio "
                             f"{ratios[layer]}) " + (f"would attend with layer {owner}'s top-k, rows of ratio "
                                                     f"{ratios[owner]}" if owner != layer else
                                                     "runs no indexer and has no index source below it")
                             + ": every indexed layer needs an index source of its own ratio at or below it")


def _kernel_block_sizes(kernel_block_size) -> Dict[str, int]:
    """Step 3: ``kernel_block_size`` as group or role -> size (an int is the mla group's)."""
    if kernel_block_size is None:
        return {}
    kbs = dict(kernel_block_size) if isinstance(kernel_block_size, Mapping) else {"mla": kernel_block_size}
    for g, k in kbs.items():
        check_int(f"kernel_block_size[{g!r}]", k, lo=1)
    return kbs


def _plan(groups, model: _Model, args: _Args, swa_group_per_layer: bool) -> List[PlannedGroup]:
    """Step 4: the groups, in gid order (:func:`~dsv4_index.group_plan.plan_groups`; an engine's plan
    resolved first, one sliding group per layer on request), the V4.1 state rings added to ``args``,
    and every group ``kernel_block_size`` / ``circular`` names checked against them."""
    kinds, circular, alloc = model.kinds, args.circular, args.alloc
    if isinstance(groups, EnginePlan):
        groups, rings = groups.resolve(model.ratios, model.r4, model.r128, model.n_hidden, model.window,
                                       model.kv_sources)
        circular.update(rings)
    plan = plan_groups(groups, model.ratios, model.r4, model.r128, model.n_hidden)
    if swa_group_per_layer:  # NOTE: one sliding group per layer, in layer order, where the swa group was
        if groups is not None:
            raise ValueError("swa_group_per_layer=True builds the default plan; pass groups=None "
                             "(an explicit groups list names its sliding groups itself)")
        plan = [q for p in plan for q in ([PlannedGroup("swa", f"swa_{i}", (i,)) for i in range(len(model.ratios))]
                                          if p.role == "swa" else [p])]
    v41 = {k.state: k for k in kinds if k.state and k.state not in alloc}
    for st, k in v41.items():  # NOTE: V4.1 state rings: vLLM's CircularBufferSpec of max(8, pow2(2 + MTP))
        alloc[st] = alloc["c4_state"] if k.kind == "c4" else alloc["c128_state"]
        circular.setdefault(st, max(8, 1 << (k.state_window - 1).bit_length()))
    known = {p.name for p in plan} | {p.role for p in plan}
    for what, keys in (("kernel_block_size", args.kbs), ("circular", circular)):
        bad = sorted(set(keys) - known - (set(alloc) if what == "kernel_block_size" else set()))
        if bad or (what == "circular" and any(k in ("mla",) for k in keys)):
            raise ValueError(f"{what} names unknown group(s) {bad}; groups: {sorted(known)}")
    return plan


def _size_group(gid: int, p: PlannedGroup, model: _Model, args: _Args) -> GroupSpec:
    """Step 5, one group: its kind, kernel block size, blocks per allocation block and table width."""
    name, role, circular = p.name, p.role, args.circular
    window = {"mla": None, "swa": model.window, **{k.state: k.state_window for k in model.kinds if k.state}}[role]
    sharded = role in ("mla", "swa")
    cap = circular.get(name, circular.get(role))
    cap_key = name if name in circular else role
    kind = "full" if role == "mla" else ("circular" if cap is not None else "sliding")
    a = p.block_size or args.alloc[role]
    kb = args.kbs.get(name, args.kbs.get(role))
    if kind == "circular" and cap is not None:  # NOTE: kind is circular exactly when cap is set
        a = args.ring_bs.get(cap_key, cap)  # NOTE: a kernel block size splits each ring block in f
        if window is not None and cap < window:
            raise ValueError(f"circular[{cap_key!r}]: capacity {cap} is below the window "
                             f"{window} of group {name!r}")
    bs = kb or a
    if a % bs:
        raise ValueError(f"kernel_block_size[{name!r}] = {bs} does not divide the group's block size {a}")
    width = cdiv(args.per_rank if sharded else args.max_model_len, bs)
    if role == "mla":
        width = _mla_width(a, bs, width, model.kinds, args.rows_per_rank)
    return GroupSpec(gid, name, kind, bs, window, role == "mla", width, a // bs,
                     ring=kind == "sliding" and args.sliding_tables == "ring", sharded=sharded, role=role,
                     layers=p.layers, capacity=cap if kind == "circular" and cap != bs else None)


def _mla_width(a: int, bs: int, width: int, kinds, rows_per_rank: Callable[[int], int]) -> int:
    """The mla group's table width: enough kernel blocks for the raw tokens and for the compressed
    rows of every ratio (``bs // R`` rows per block); its block sizes divisible by every ratio."""
    for cname, r in ((k.main, k.ratio) for k in kinds):
        if r is not None:
            if a % r:
                raise ValueError(f"mla_block_size {a} is not divisible by the "
                                 f"compress ratio {r} of channel {cname!r}")
            if bs % r:
                raise ValueError(f"kernel_block_size {bs} of the mla group is not "
                                 f"divisible by the compress ratio {r} of channel {cname!r}")
            width = max(width, cdiv(rows_per_rank(r), bs // r))
    return width


def _rows_per_block(channel: str, block_size: int, ratio: int) -> int:
    if block_size % ratio:
        raise ValueError(f"block size {block_size} of channel {channel!r} is not divisible by its "
                         f"compress ratio {ratio}")
    return block_size // ratio


def _channels(groups: List[GroupSpec], model: _Model, max_model_len: int, indexer_causal_indices: bool,
              compact_compressed: bool) -> Dict[str, ChannelSpec]:
    """Step 6: the built-in channels: by ratio kind on the mla group (``c4a`` + ``c4i``, or ``c128a``),
    then one window channel per sliding or circular group, named like it."""
    channels: Dict[str, ChannelSpec] = {}
    mla_gid: Optional[int] = None
    for g in groups:
        if g.role == "mla":
            mla_gid = g.gid

    def add(name, gid, ratio, win, index_width, outputs, builder=None):
        block = groups[gid].block_size
        compact = compact_compressed and ratio > 1
        if compact:
            outputs = set(outputs) | {"compact_slot_mapping", "compact_cu"}
        if groups[gid].kind == "circular" and "slot_mapping" in outputs:
            outputs = set(outputs) | {"tail_slot_mapping"}  # NOTE: the ring's write plan
        channels[name] = ChannelSpec(name, gid, ratio, _rows_per_block(name, block, ratio),
                                     win, index_width, frozenset(outputs), compact=compact,
                                     builder=None if builder == name else builder)

    def causal_width(ratio):
        return round_up(cdiv(max_model_len, ratio), INDEX_ALIGN)

    for k in model.kinds:  # NOTE: builders by kind (c4a / c4i / c128a), names by ratio in the V4.1 family
        if k.kind == "c4":
            add(k.main, mla_gid, k.ratio, None, None, CHANNEL_OUTPUTS["c4a"], builder="c4a")
            c4i_out = CHANNEL_OUTPUTS["c4i"] | ({"indices"} if indexer_causal_indices else set())
            add(k.indexer, mla_gid, k.ratio, None, causal_width(k.ratio) if indexer_causal_indices else None,
                c4i_out, builder="c4i")
        else:
            add(k.main, mla_gid, k.ratio, None, causal_width(k.ratio), CHANNEL_OUTPUTS["c128a"], builder="c128a")
    state_builder = {k.state: k.state_builder for k in model.kinds if k.state}
    for g in groups:
        if g.role != "mla":  # NOTE: one window channel per sliding / circular group, named like it
            assert g.role is not None  # NOTE: _size_group gives every group its plan's role
            role = state_builder.get(g.role, g.role)
            add(g.name, g.gid, 1, g.window, g.window, CHANNEL_OUTPUTS[role], builder=role)
    return channels
