# over 400 lines: one schema, the checks of every field a trace line carries (header, layout, step, outputs)
"""Checks of every line of a step trace before the replay uses it: one :class:`TraceError` naming the
file, the line and the field for anything a replay cannot use (types, bounds, capacities)."""

from __future__ import annotations

import dataclasses
import re
from typing import NoReturn, Optional

from .._json import one_line
from ..capacity import check_capacities
from ..group_plan import ROLES
from ..geometry import DSV4Layout
from ..layout_derive import check_kv_sources
from ..specs import CHANNEL_OUTPUTS, GROUP_KINDS as KINDS, GROUP_ORDER, ChannelSpec, GroupSpec

__all__ = ["TraceError", "check_header", "check_line", "check_capacity", "rebuild_layout", "LIMITS"]

LIMITS = dict(max_num_reqs=1 << 16, max_num_batched_tokens=1 << 20, max_model_len=1 << 24, window=1 << 17,
              block_size=1 << 20, ratio=1 << 16, layers=1 << 12, topk=1 << 16, cp=1 << 10, value=1 << 62,
              staged_blocks=1 << 22, buffer_entries=1 << 27)
"""Bounds of the values a trace may carry (a replay allocates from them; see :func:`check_capacity`).
``buffer_entries`` bounds the block tables and the per-token buffers of one pipeline each (V4-Flash at
``max_model_len`` 2**20 with 8192 tokens needs about 2**26 per-token entries)."""

_STEP_FIELDS = ("req_slots", "num_computed_tokens", "num_scheduled_tokens", "is_new", "free_slots", "write_gids",
                "write_slots", "write_starts", "write_cu", "write_ids", "replay_start", "replay_end", "query_lens",
                "drafts")
_OUTPUT_FIELDS = frozenset().union(*CHANNEL_OUTPUTS.values(), {"compact_slot_mapping", "compact_cu", "indices",
                                                               "lens_clamped", "decode_lens_clamped",
                                                               "tail_slot_mapping"})


class TraceError(ValueError):
    """A trace file a replay cannot use. ``path``, ``line`` (1-based, 0 = the file as a whole) and
    ``field`` (dotted, e.g. ``"pipeline.max_num_reqs"``; None when not about a field)."""

    def __init__(self, path, line: int, field: Optional[str], message: str):
        self.path, self.line, self.field = str(path), line, field
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(one_line(f"{where}: {field}: {message}" if field else f"{where}: {message}"))


class _At:
    """Raises :class:`TraceError` at one line."""

    def __init__(self, path, line: int):
        self.path, self.line = path, line
        self.unchecked = False      # NOTE: a field this module does not know was passed on

    def err(self, field, msg) -> NoReturn:
        raise TraceError(self.path, self.line, field, msg)

    def dict(self, d, field, required=(), optional=()):
        if not isinstance(d, dict):
            self.err(field, f"must be a JSON object, got {_kind(d)}")
        missing = [k for k in required if k not in d]
        if missing:
            self.err(f"{field}.{missing[0]}" if field else missing[0], "missing")
        extra = sorted(set(d) - set(required) - set(optional))
        if extra:
            self.err(f"{field}.{extra[0]}" if field else extra[0], "unknown field")
        return d

    def int(self, v, field, lo=0, hi=LIMITS["value"], none=False):
        if v is None and none:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.err(field, f"must be an integer{' or null' if none else ''}, got {_kind(v)} {_short(v)}")
        if not lo <= v <= hi:
            self.err(field, f"{_short(v)} is out of range [{lo}, {hi}]")
        return v

    def bool(self, v, field):
        if not isinstance(v, bool):
            self.err(field, f"must be true or false, got {_kind(v)} {_short(v)}")
        return v

    def str(self, v, field, choices=None, none=False):
        if v is None and none:
            return None
        if not isinstance(v, str):
            self.err(field, f"must be a string, got {_kind(v)} {_short(v)}")
        if choices is not None and v not in choices:
            self.err(field, f"{v!r} is not one of {list(choices)}")
        return v

    def list(self, v, field, none=False):
        if v is None and none:
            return None
        if not isinstance(v, list):
            self.err(field, f"must be a list, got {_kind(v)} {_short(v)}")
        return v


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", float: "a float",
            int: "an integer", type(None): "null"}.get(type(v), type(v).__name__)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


# ----------------------------------------------------------------------------------------------
def _others(cls, known) -> tuple:
    """Dataclass fields of ``cls`` this module does not check (added after it was written): passed on
    as they are (lists as tuples), and the layout is then not re-derived (see :func:`_derivable`)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in known)


def _passthrough(d, names, kw) -> bool:
    for k in names:
        if k in d:
            kw[k] = _tuples(d[k])
    return any(k in d for k in names)


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


_G_REQ = ("gid", "name", "kind", "block_size", "window", "prefix_cacheable", "table_width")
_G_OPT = ("blocks_per_kv_block", "ring", "sharded", "role", "layers", "capacity")
_C_REQ = ("name", "gid", "compress_ratio", "rows_per_block")
_C_OPT = ("window", "index_width", "outputs", "compact", "builder")
_L_REQ = ("groups", "channels", "max_model_len", "sliding_window", "index_topk", "compress_ratios", "num_layers")
_L_OPT = ("c4_ratio", "c128_ratio", "indexer_causal_indices", "cp_world_size", "cp_interleave", "kv_sources",
          "candidate_block_size", "candidate_topk_blocks", "candidate_source_layer")


def _group(at: _At, d, f: str, i: int) -> GroupSpec:
    extra = _others(GroupSpec, _G_REQ + _G_OPT)
    at.dict(d, f, _G_REQ, _G_OPT + extra)
    if at.int(d["gid"], f + ".gid", 0, LIMITS["layers"]) != i:
        at.err(f + ".gid", f"is {d['gid']}, expected {i} (groups are listed by gid)")
    kw = dict(gid=i, name=at.str(d["name"], f + ".name"), kind=at.str(d["kind"], f + ".kind", KINDS),
              block_size=at.int(d["block_size"], f + ".block_size", 1, LIMITS["block_size"]),
              window=at.int(d["window"], f + ".window", 1, LIMITS["window"], none=True),
              prefix_cacheable=at.bool(d["prefix_cacheable"], f + ".prefix_cacheable"),
              table_width=at.int(d["table_width"], f + ".table_width", 1, LIMITS["max_model_len"]))
    for k in ("ring", "sharded"):
        if k in d:
            kw[k] = at.bool(d[k], f"{f}.{k}")
    if "blocks_per_kv_block" in d:
        kw["blocks_per_kv_block"] = at.int(d["blocks_per_kv_block"], f + ".blocks_per_kv_block", 1, 1 << 10)
    if "role" in d:
        # NOTE: V4.1-family state roles carry their ratio (c2_state; dsv4_index.specs.ratio_kinds)
        state = isinstance(d["role"], str) and re.fullmatch(r"c[1-9][0-9]*_state", d["role"]) is not None
        kw["role"] = at.str(d["role"], f + ".role", None if state else ROLES, none=True)
    if d.get("capacity") is not None:  # NOTE: a circular ring of several blocks
        kw["capacity"] = at.int(d["capacity"], f + ".capacity", 1, LIMITS["max_model_len"])
    if d.get("layers") is not None:
        layers = at.list(d["layers"], f + ".layers")
        if len(layers) > LIMITS["layers"]:
            at.err(f + ".layers", f"{len(layers)} layers, at most {LIMITS['layers']}")
        kw["layers"] = tuple(at.int(x, f"{f}.layers[{j}]", 0, LIMITS["layers"]) for j, x in enumerate(layers))
    at.unchecked |= _passthrough(d, extra, kw)
    try:
        return GroupSpec(**kw)
    except ValueError as e:
        at.err(f, str(e))


def _channel(at: _At, d, f: str, num_groups: int) -> ChannelSpec:
    extra = _others(ChannelSpec, _C_REQ + _C_OPT)
    at.dict(d, f, _C_REQ, _C_OPT + extra)
    kw = dict(name=at.str(d["name"], f + ".name"), gid=at.int(d["gid"], f + ".gid", 0, num_groups - 1),
              compress_ratio=at.int(d["compress_ratio"], f + ".compress_ratio", 1, LIMITS["ratio"]),
              rows_per_block=at.int(d["rows_per_block"], f + ".rows_per_block", 1, LIMITS["block_size"]),
              window=at.int(d.get("window"), f + ".window", 1, LIMITS["window"], none=True),
              index_width=at.int(d.get("index_width"), f + ".index_width", 1, LIMITS["max_model_len"], none=True),
              compact=at.bool(d.get("compact", False), f + ".compact"))
    outs = at.list(d.get("outputs", []), f + ".outputs")
    for j, o in enumerate(outs):
        at.str(o, f"{f}.outputs[{j}]", sorted(_OUTPUT_FIELDS))
    kw["outputs"] = frozenset(outs)
    if d.get("builder") is not None:
        kw["builder"] = at.str(d["builder"], f + ".builder")
    at.unchecked |= _passthrough(d, extra, kw)
    try:
        return ChannelSpec(**kw)
    except ValueError as e:
        at.err(f, str(e))


def _layout(at: _At, d) -> DSV4Layout:
    extra = _others(DSV4Layout, _L_REQ + _L_OPT)
    at.dict(d, "layout", _L_REQ, _L_OPT + extra)
    groups = at.list(d["groups"], "layout.groups")
    if not groups or len(groups) > 64:
        at.err("layout.groups", f"must hold 1 to 64 groups, got {len(groups)}")
    groups = tuple(_group(at, g, f"layout.groups[{i}]", i) for i, g in enumerate(groups))
    chans = at.list(d["channels"], "layout.channels")
    if len(chans) > 64:
        at.err("layout.channels", f"at most 64 channels, got {len(chans)}")
    channels = {}
    for i, c in enumerate(chans):
        spec = _channel(at, c, f"layout.channels[{i}]", len(groups))
        if spec.name in channels:
            at.err(f"layout.channels[{i}].name", f"channel {spec.name!r} listed twice")
        channels[spec.name] = spec
    ratios = at.list(d["compress_ratios"], "layout.compress_ratios")
    if len(ratios) > LIMITS["layers"]:
        at.err("layout.compress_ratios", f"{len(ratios)} layers, at most {LIMITS['layers']}")
    kw = dict(max_model_len=at.int(d["max_model_len"], "layout.max_model_len", 1, LIMITS["max_model_len"]),
              sliding_window=at.int(d["sliding_window"], "layout.sliding_window", 1, LIMITS["window"]),
              index_topk=at.int(d["index_topk"], "layout.index_topk", 1, LIMITS["topk"], none=True),
              compress_ratios=tuple(at.int(r, f"layout.compress_ratios[{i}]", 0, LIMITS["ratio"])
                                    for i, r in enumerate(ratios)),
              num_layers=at.int(d["num_layers"], "layout.num_layers", 0, LIMITS["layers"]))
    for k in ("c4_ratio", "c128_ratio"):
        kw[k] = at.int(d.get(k), f"layout.{k}", 1, LIMITS["ratio"], none=True)
    kw["indexer_causal_indices"] = at.bool(d.get("indexer_causal_indices", False), "layout.indexer_causal_indices")
    kw["cp_world_size"] = at.int(d.get("cp_world_size", 1), "layout.cp_world_size", 1, LIMITS["cp"])
    kw["cp_interleave"] = at.int(d.get("cp_interleave", 1), "layout.cp_interleave", 1, LIMITS["block_size"])
    kw["kv_sources"] = tuple(at.int(x, f"layout.kv_sources[{i}]", 0, max(kw["num_layers"] - 1, 0))
                             for i, x in enumerate(at.list(d.get("kv_sources", []), "layout.kv_sources")))
    try:  # NOTE: from_config's rule, also for layouts that are not re-derived (custom or V4.1 channels)
        check_kv_sources(list(kw["kv_sources"]), kw["compress_ratios"], len(kw["compress_ratios"]))
    except ValueError as e:
        at.err("layout.kv_sources", str(e))
    for k, hi in (("candidate_block_size", LIMITS["ratio"]), ("candidate_topk_blocks", LIMITS["topk"]),
                  ("candidate_source_layer", LIMITS["layers"])):  # NOTE: V4.1's two-level indexer (issue 38)
        kw[k] = at.int(d.get(k), f"layout.{k}", 0 if k == "candidate_source_layer" else 1, hi, none=True)
    at.unchecked |= _passthrough(d, extra, kw)
    try:
        layout = DSV4Layout(groups=groups, channels=channels, **kw)
    except (ValueError, TypeError) as e:
        at.err("layout", str(e))
    if not at.unchecked:
        _derivable(at, layout)
    return layout


def rebuild_layout(recorded: DSV4Layout, config) -> DSV4Layout:
    """``config`` with the recorded geometry arguments (block sizes, rings, circular groups, DCP)."""
    g = {x.name: x for x in recorded.groups}
    circ = {n: x.block_size if x.capacity is None else (x.capacity, x.block_size)
            for n, x in g.items() if x.kind == "circular"}
    sizes: dict = {f"{n}_block_size": x.alloc_block_size for n, x in g.items() if n not in circ}
    if not set(g) <= set(GROUP_ORDER):  # NOTE: an engine's own groups (e.g. groups="vllm"): list them
        sizes = dict(groups=[dict(role=x.role, layers=None if x.layers is None else list(x.layers), name=x.name,
                                  block_size=x.alloc_block_size) for x in recorded.groups])
    kbs = {n: x.block_size for n, x in g.items() if x.blocks_per_kv_block > 1}
    sliding = [x for x in recorded.groups if x.kind == "sliding"]
    return DSV4Layout.from_config(
        config, recorded.max_model_len, **sizes, kernel_block_size=kbs or None, circular=circ or None,
        sliding_tables="ring" if not sliding or any(x.ring for x in sliding) else "full",
        indexer_causal_indices=recorded.indexer_causal_indices, cp_world_size=recorded.cp_world_size,
        cp_interleave=recorded.cp_interleave, compact_compressed=any(c.compact for c in recorded.channels.values()))


def _derivable(at: _At, layout: DSV4Layout) -> None:
    """A layout of built-in channels must be the one ``from_config`` derives from its own scalars
    (a hand-edited channel or group would otherwise reach the builders); custom channels skip this."""
    engine_groups = all(g.role is not None for g in layout.groups)
    if not engine_groups and not set(g.name for g in layout.groups) <= set(GROUP_ORDER):
        return
    if not all(c.builder is None and (c.name in CHANNEL_OUTPUTS or engine_groups) for c in layout.channels.values()):
        return
    config = dict(num_hidden_layers=len(layout.compress_ratios), num_nextn_predict_layers=0,
                  compress_ratios=list(layout.compress_ratios), sliding_window=layout.sliding_window,
                  index_topk=layout.index_topk, kv_source_layer_ids=list(layout.kv_sources))
    if layout.candidate_block_size is not None:
        config.update(candidate_block_size=layout.candidate_block_size,
                      candidate_topk_blocks=layout.candidate_topk_blocks)
        if layout.candidate_source_layer is not None:
            config["candidate_source_layer_id"] = layout.candidate_source_layer
    try:
        derived = rebuild_layout(layout, config)
    except ValueError as e:
        at.err("layout", f"inconsistent: {e}")
    if derived != layout:
        a, b = layout_diff(layout, derived)
        at.err(f"layout.{a}", f"is {b[0]!r}, but the layout's own fields give {b[1]!r} (a hand-edited layout?)")


def layout_diff(a: DSV4Layout, b: DSV4Layout):
    """(dotted field, (value in a, value in b)) of the first difference of two layouts."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x == y:
            continue
        if f.name == "groups" and len(x) == len(y):
            for i, (g, h) in enumerate(zip(x, y, strict=True)):
                for k in dataclasses.fields(g):
                    if getattr(g, k.name) != getattr(h, k.name):
                        return f"groups[{i}].{k.name}", (getattr(g, k.name), getattr(h, k.name))
        if f.name == "channels" and list(x) == list(y):
            for i, name in enumerate(x):
                for k in dataclasses.fields(x[name]):
                    if getattr(x[name], k.name) != getattr(y[name], k.name):
                        u, w = getattr(x[name], k.name), getattr(y[name], k.name)
                        if k.name == "outputs":
                            u, w = sorted(u), sorted(w)
                        return f"channels[{i}].{k.name}", (u, w)
        return f.name, (x, y)
    return "", (None, None)


_PIPELINE_REQUIRED = ("max_num_reqs", "max_num_batched_tokens", "num_speculative_tokens", "cp_world_size", "cp_rank",
                      "cp_interleave", "max_staged_blocks")
_PIPELINE_OPTIONAL = ("checks", "backend", "device", "fused", "query_batches")


def check_header(path, d, versions) -> tuple:
    """``(version, DSV4Layout, pipeline dict)`` of a header line (line 1)."""
    at = _At(path, 1)
    if not isinstance(d, dict) or d.get("type") != "header":
        at.err("type", f"the first line must be the trace header (type 'header'), got "
               f"{_short(d.get('type')) if isinstance(d, dict) else _kind(d)}")
    v = d.get("version")
    if v not in versions:
        by = d.get("dsv4_index")
        by_whom = f" (written by dsv4_index {by})" if isinstance(by, str) else ""
        at.err("version", f"trace format version {_short(v)}{by_whom}"
               f"; this dsv4_index reads version{'s' if len(versions) > 1 else ''} "
               f"{', '.join(map(str, versions))}: replay it with the dsv4_index that wrote it")
    at.dict(d, "", ("type", "version", "layout", "pipeline"), ("dsv4_index", "outputs"))
    at.str(d.get("dsv4_index", ""), "dsv4_index")
    at.str(d.get("outputs"), "outputs", ("rowmix64",), none=True)
    layout = _layout(at, d["layout"])
    p = at.dict(d["pipeline"], "pipeline", _PIPELINE_REQUIRED, _PIPELINE_OPTIONAL)
    out = dict(max_num_reqs=at.int(p["max_num_reqs"], "pipeline.max_num_reqs", 1, LIMITS["max_num_reqs"]),
               max_num_batched_tokens=at.int(p["max_num_batched_tokens"], "pipeline.max_num_batched_tokens", 1,
                                             LIMITS["max_num_batched_tokens"]),
               num_speculative_tokens=at.int(p["num_speculative_tokens"], "pipeline.num_speculative_tokens", 0,
                                             1 << 10),
               cp_world_size=at.int(p["cp_world_size"], "pipeline.cp_world_size", 1, LIMITS["cp"]))
    out["cp_rank"] = at.int(p["cp_rank"], "pipeline.cp_rank", 0, out["cp_world_size"] - 1)
    out["cp_interleave"] = at.int(p["cp_interleave"], "pipeline.cp_interleave", 1, LIMITS["block_size"])
    # NOTE: the staging buffers hold 2 * max_staged_blocks ids (found by the fuzz test: 2**31 took 32 GB)
    out["max_staged_blocks"] = at.int(p["max_staged_blocks"], "pipeline.max_staged_blocks", 1,
                                      LIMITS["staged_blocks"], none=True)
    out["checks"] = at.str(p.get("checks", "safe"), "pipeline.checks", ("safe", "full"))
    out["backend"] = at.str(p.get("backend"), "pipeline.backend", none=True)
    out["device"] = at.str(p.get("device", "?"), "pipeline.device")
    out["fused"] = at.bool(p.get("fused", True), "pipeline.fused")
    # NOTE: absent in traces written before the argument existed: their pipelines accepted declared steps
    out["query_batches"] = at.bool(p.get("query_batches", True), "pipeline.query_batches")
    check_capacity(at, layout, out)
    return v, layout, out


def check_capacity(at: _At, layout: DSV4Layout, p: dict) -> None:
    """Bound what a replay of ``layout`` / ``p`` allocates before anything is allocated: the pipeline's
    own bounds (:func:`dsv4_index.capacity.check_capacities`), then the replay's tighter budget (a replay
    builds two pipelines, on a machine that may not be the recording's)."""
    num_slots, T = p["max_num_reqs"], p["max_num_batched_tokens"]
    try:
        check_capacities(layout, num_slots, T, p["num_speculative_tokens"], p["max_staged_blocks"],
                         (p["cp_world_size"], p["cp_rank"], p["cp_interleave"]))
    except ValueError as e:
        at.err("pipeline", str(e))
    table = sum(g.columns(T)[0] for g in layout.groups) * num_slots
    per_token = T * (sum(c.index_width or 0 for c in layout.channels.values()) + (layout.index_topk or 0)
                     + 16 * (len(layout.channels) + 1))
    cap = LIMITS["buffer_entries"]
    for name, n in (("block tables", table), ("per-token buffers", per_token)):
        if n > cap:
            at.err("pipeline", f"a replay needs {n} {name} entries (max_num_reqs {num_slots}, "
                   f"max_num_batched_tokens {T}, max_model_len {layout.max_model_len}), more than the bound of {cap}")


def _ints(at: _At, v, field, *, boolean=False):
    at.list(v, field)
    for i, x in enumerate(v):
        if boolean:
            at.bool(x, f"{field}[{i}]")
        else:
            at.int(x, f"{field}[{i}]", -LIMITS["value"], LIMITS["value"])
    return v


def check_line(path, n: int, d, expected_index: int, version: int) -> dict:
    """A step / rejected line (line ``n``), checked; returned as is."""
    at = _At(path, n)
    kinds = ("step", "rejected") + (("outputs",) if version >= 2 else ()) + (("end",) if version >= 3 else ())
    if not isinstance(d, dict):
        at.err(None, f"must be a JSON object (a trace line), got {_kind(d)}")
    kind = at.str(d.get("type"), "type", kinds)
    if kind not in ("step", "rejected"):   # NOTE: outputs and end lines: trace_outputs.check_outputs / check_end
        at.err("type", f"a {kind!r} line is checked by tools.trace_outputs, not here")
    at.dict(d, "", ("type", "index", "pad_to", "step") + (("error",) if kind == "rejected" else ()), ("req_ids",))
    at.int(d["index"], "index", expected_index, expected_index)
    at.int(d["pad_to"], "pad_to", -LIMITS["value"], LIMITS["value"], none=True)
    if kind == "rejected":
        at.str(d["error"], "error")
    s = d["step"]
    if s is None and kind == "rejected":
        return d
    at.dict(s, "step", _STEP_FIELDS[:3], _STEP_FIELDS[3:])
    for k in _STEP_FIELDS:
        if k in s and (s[k] is not None or k in _STEP_FIELDS[:3]):
            _ints(at, s[k], f"step.{k}", boolean=k == "is_new")
    ids = at.list(d.get("req_ids"), "req_ids", none=True)
    if ids is not None:
        if len(ids) != len(s["req_slots"]):
            at.err("req_ids", f"{len(ids)} ids for {len(s['req_slots'])} rows of step.req_slots")
        for i, r in enumerate(ids):
            if isinstance(r, bool) or not isinstance(r, (str, int)):
                at.err(f"req_ids[{i}]", f"must be a string or an integer, got {_kind(r)}")
    return d
