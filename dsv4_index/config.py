"""Model configs from every source an engine holds, normalised to the keys the layout needs.

:func:`normalize_config` accepts

- a shipped name, ``"flash"``, ``"pro"`` or ``"tiny"`` (package data in ``dsv4_index/configs/``),
- a path (``str`` or ``os.PathLike``) to a ``config.json`` or to a model directory holding one,
- a mapping (the parsed ``config.json``),
- an object with ``to_dict()``: a transformers ``PretrainedConfig`` such as ``DeepseekV4Config``
  (transformers >= 5.17) or ``models.deepseek_v4.DSV4Config``,
- any other dataclass or plain object (its fields / attributes),

and returns a dict holding ``num_hidden_layers``, ``num_nextn_predict_layers``, ``compress_ratios`` (one
entry per layer, MTP layers included; 0 = SWA-only), ``sliding_window`` and ``index_topk``, plus every
original key.

Two spellings of the per-layer attention kinds exist:

``compress_ratios``
    The published ``config.json``: ``num_hidden_layers + num_nextn_predict_layers`` ints.
``layer_types`` (+ ``compress_rates``)
    transformers' ``DeepseekV4Config``: ``num_hidden_layers`` names, one of
    ``"sliding_attention"`` (ratio 0), ``"compressed_sparse_attention"`` (CSA, default ratio 4) and
    ``"heavily_compressed_attention"`` (HCA, default ratio 128); ``compress_rates`` maps the two
    compressed names to their ratios (the legacy top-level ``compress_rate_csa`` /
    ``compress_rate_hca`` override it, as in transformers). transformers keeps no entry for the MTP
    layers (it only counts them in ``num_nextn_predict_layers``); they are taken as SWA-only
    (ratio 0), which is what every published DeepSeek-V4 ``compress_ratios`` holds for them. A
    ``layer_types`` list that already has ``num_hidden_layers + num_nextn_predict_layers`` entries
    is used as it is.

When both are given they must agree on the layers ``layer_types`` covers; ``compress_ratios`` then
supplies the MTP entries.

Every problem raises :class:`ConfigError` (a ``ValueError``) naming the source (the file, and the
line of the key where the source is a file) and the field. A file is bounded before it is parsed
(:data:`MAX_CONFIG_BYTES`, nesting depth 32; duplicate keys, ``NaN`` and non-UTF-8 bytes rejected),
and the sizes the layout allocates from are bounded (:data:`BOUNDS`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ._common import is_int
from ._json import BadJSON, decode_utf8, line_of_key, loads_bounded, one_line
from .specs import ratio_kinds

__all__ = ["SHIPPED", "CONFIG_DIR", "LAYER_TYPES", "DEFAULT_COMPRESS_RATES", "BOUNDS", "MAX_CONFIG_BYTES",
           "ConfigError", "normalize_config", "shipped_config", "shipped_config_path"]

SHIPPED = ("flash", "pro", "tiny", "v41_flash", "tiny_v41")
"""Names of the configs shipped as package data."""

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""Folder of the shipped ``{flash,pro,tiny}.json``."""

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
"""``layer_types`` names of transformers' ``DeepseekV4Config``."""

DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
"""``DeepseekV4Config.default_compress_rates``: ratio of each compressed layer type."""

MAX_CONFIG_BYTES = 16 << 20
"""Largest config file read (published DeepSeek-V4 configs are a few KiB)."""

BOUNDS = {"num_hidden_layers": 1 << 12, "num_nextn_predict_layers": 1 << 8, "sliding_window": 1 << 16,
          "index_topk": 1 << 16, "compress_ratio": 1 << 16}
"""Largest accepted value of each field. The window and the top-k size buffers of
``[max_num_batched_tokens, sliding_window]`` and ``[max_num_batched_tokens, index_topk]`` int32 entries
(DeepSeek-V4: 128 and 512 / 1024), so a larger value is a broken config, not a model."""


class ConfigError(ValueError):
    """A config that cannot be used; ``source`` (the file's path, or a description such as ``"dict"``),
    ``line`` (0 when unknown or not a file) and ``field`` (None when not about one field)."""

    def __init__(self, message: str, source: str = "", line: int = 0, field: Optional[str] = None):
        super().__init__(one_line(message))
        self.source, self.line, self.field = source, line, field


_LEGACY_RATE_KEYS = {"compress_rate_csa": "compressed_sparse_attention",
                     "compress_rate_hca": "heavily_compressed_attention"}


def shipped_config_path(name: str) -> Path:
    """Path of a shipped config file.

    Parameters
    ----------
    name : str
        One of :data:`SHIPPED`.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ValueError
        ``name`` is not a shipped config, or its file is missing from the installation.
    """
    if name not in SHIPPED:
        raise ValueError(f"name must be one of {list(SHIPPED)}, got {name!r}")
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"config: shipped config {name!r} is missing from the installation "
                         f"(no file {str(path)!r})")
    return path


def shipped_config(name: str) -> Dict[str, Any]:
    """The raw ``config.json`` dict of a shipped config (a fresh copy).

    Parameters
    ----------
    name : str
        ``"flash"`` (DeepSeek-V4-Flash), ``"pro"`` (DeepSeek-V4-Pro) or ``"tiny"`` (a 4-layer model
        for tests and examples).

    Returns
    -------
    dict
        The file's content as published (not normalised: see :func:`normalize_config`).

    Raises
    ------
    ValueError
        ``name`` is not one of :data:`SHIPPED`.
    """
    return _read_json(shipped_config_path(name))


def normalize_config(config) -> Dict[str, Any]:
    """Read a model config from any supported source into the dict ``DSV4Layout.from_config`` uses.

    Parameters
    ----------
    config : str, os.PathLike, Mapping or config object
        A shipped name (:data:`SHIPPED`; an existing path of that name wins), a ``config.json`` path
        or a model directory holding ``config.json``, a dict, a transformers ``PretrainedConfig``
        (``DeepseekV4Config``: ``layer_types`` + ``compress_rates``), a
        ``models.deepseek_v4.DSV4Config``, or any object with ``to_dict()``, dataclass fields or
        attributes.

    Returns
    -------
    dict
        Every original key, with ``num_hidden_layers`` (int), ``num_nextn_predict_layers`` (int,
        default 0), ``compress_ratios`` (list of int, ``num_hidden_layers +
        num_nextn_predict_layers`` entries, 0 = SWA-only), ``sliding_window`` and ``index_topk``
        (None when absent and no layer needs it) set.

    Raises
    ------
    ValueError
        Naming the problem and the source (the file's path where there is one): missing file, file
        that is not valid JSON or not a JSON object, unsupported type, missing key(s), malformed or
        inconsistent ``compress_ratios`` / ``layer_types``, unknown layer type names, a
        ``layer_types`` length that fits neither ``num_hidden_layers`` nor ``num_hidden_layers +
        num_nextn_predict_layers``.
    """
    raw, where, text = _read_source(config)
    try:
        return _normalize_dict(raw, where)
    except ConfigError as e:
        line = line_of_key(text, e.field) if text is not None and e.field else 0
        if not line:
            raise
        msg = str(e).replace(f"config ({where})", f"config ({where}:{line})", 1)
        raise ConfigError(msg, where, line, e.field) from None


# ---------------------------------------------------------------------------------------------------
def _read_json(path: Path, with_text: bool = False):
    where = f"config: {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config: cannot read {path}: {e.strerror or e}", str(path)) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config: {path} is larger than {MAX_CONFIG_BYTES} bytes; not a config.json", str(path))
    try:
        text = decode_utf8(raw, str(path))
        data = loads_bounded(text, str(path), raw=raw)
    except BadJSON as e:
        key = f"{e.key}: " if e.key else ""
        raise ConfigError(f"{where} is not valid JSON: line {e.line}: {key}{e.msg}", str(path), e.line,
                          field=e.key) from e.__cause__
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a JSON object, got {type(data).__name__}", str(path), 1)
    return (data, text) if with_text else data


def _read_source(config) -> Tuple[Dict[str, Any], str, Optional[str]]:
    """``(raw dict, description of the source for error messages, the file's text or None)``."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if isinstance(config, str) and config in SHIPPED and not path.exists():
            p = shipped_config_path(config)
            return _read_json(p), f"shipped config {config!r} ({p})", None
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            hint = "" if path.suffix else f" (shipped names: {list(SHIPPED)})"
            what = "is a directory" if path.is_dir() else "no such file"
            raise ConfigError(f"config: {what} {str(path)!r}{hint}", str(path))
        data, text = _read_json(path, with_text=True)
        return data, str(path), text
    if isinstance(config, Mapping):
        return dict(config), "dict", None
    kind = type(config).__name__
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict) and not isinstance(config, type):
        d = to_dict()
        if not isinstance(d, Mapping):
            raise ConfigError(f"config: {kind}.to_dict() returned {type(d).__name__}, not a dict", kind)
        return dict(d), f"{kind} object", None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, f"{kind} object", None
    if hasattr(config, "__dict__") and not isinstance(config, type):
        return dict(vars(config)), f"{kind} object", None
    raise ConfigError(f"config must be a shipped name {list(SHIPPED)}, a config.json path or model "
                     f"directory, a dict or a config object, got {kind}")


def key_path(message: str) -> Optional[str]:
    """The ``groups[...]`` key path an argument error starts with (``"groups[2].layer_names[0]"``), or None."""
    m = re.match(r"groups(?:\[\d+\](?:\.\w+(?:\[\d+\])?)?)?", message)
    return m.group(0) if m else None


def _is_int(v, minimum: int, maximum: Optional[int] = None) -> bool:
    return is_int(v) and v >= minimum and (maximum is None or v <= maximum)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _int_field(src: str, where: str, raw: Dict[str, Any], key: str, minimum: int, *, what: str = "") -> int:
    v = raw[key]
    hi = BOUNDS.get(key)
    if not _is_int(v, minimum, hi):
        rng = f"an int >= {minimum}" if hi is None else f"an int in [{minimum}, {hi}]"
        raise ConfigError(f"{src}: {key} must be {rng}{what}, got {_short(v)}", where, field=key)
    return v


def _normalize_dict(raw: Dict[str, Any], where: str) -> Dict[str, Any]:
    src = f"config ({where})"
    out = dict(raw)
    missing = [k for k in ("num_hidden_layers", "sliding_window") if raw.get(k) is None]
    has_ratios = raw.get("compress_ratios") is not None
    has_types = raw.get("layer_types") is not None
    if not has_ratios and not has_types:
        missing.append("compress_ratios")
    if missing:
        extra = " (or 'layer_types')" if "compress_ratios" in missing else ""
        raise ConfigError(f"{src} is missing key(s) {missing}{extra}", where, field=missing[0])

    n_hidden = _int_field(src, where, raw, "num_hidden_layers", 1)
    if raw.get("num_nextn_predict_layers") is None:
        n_mtp = 0
    else:
        n_mtp = _int_field(src, where, raw, "num_nextn_predict_layers", 0)
    n_all = n_hidden + n_mtp
    _int_field(src, where, raw, "sliding_window", 1, what=" (tokens)")
    if raw.get("index_topk") is not None:
        # NOTE: checked even without c4 layers: a layout carries it and consumers size buffers from it
        _int_field(src, where, raw, "index_topk", 1)

    ratios = None
    if has_ratios:
        r = raw["compress_ratios"]
        hi = BOUNDS["compress_ratio"]
        if not isinstance(r, (list, tuple)):
            raise ConfigError(f"{src}: compress_ratios must be a list of ints in [0, {hi}], got {_short(r)}",
                              where, field="compress_ratios")
        bad = next((i for i, x in enumerate(r) if not _is_int(x, 0, hi)), None)
        if bad is not None:
            raise ConfigError(f"{src}: compress_ratios must be a list of ints in [0, {hi}]: compress_ratios[{bad}] "
                              f"is {_short(r[bad])}", where, field="compress_ratios")
        ratios = [int(x) for x in r]
        if len(ratios) != n_all:
            raise ConfigError(f"{src}: compress_ratios has {len(ratios)} entries, expected "
                              f"num_hidden_layers + num_nextn_predict_layers = {n_all}", where, field="compress_ratios")
    if has_types:
        from_types = _ratios_from_layer_types(raw, src, where, n_hidden, n_mtp)
        if ratios is None:
            ratios = from_types
        else:
            k = len(raw["layer_types"])
            differ = [i for i in range(k) if ratios[i] != from_types[i]]
            if differ:
                i = differ[0]
                raise ConfigError(f"{src}: layer_types and compress_ratios disagree at {len(differ)} layer(s), "
                                  f"first layer {i}: layer_types[{i}] = {raw['layer_types'][i]!r} "
                                  f"(ratio {from_types[i]}) but compress_ratios[{i}] = {ratios[i]}",
                                  where, field="layer_types")
    out["compress_ratios"] = ratios
    out["num_hidden_layers"] = n_hidden
    out["num_nextn_predict_layers"] = n_mtp

    # NOTE: the rule of DSV4Layout.from_config (dsv4_index.specs.ratio_kinds): indexed kinds need index_topk
    has_c4 = any(k.kind == "c4" for k in ratio_kinds(ratios))
    if raw.get("index_topk") is None:
        if has_c4:
            raise ConfigError(f"{src} is missing key(s) ['index_topk'] (needed by c4 layers)", where,
                              field="index_topk")
        out["index_topk"] = None
    return out


def _ratios_from_layer_types(raw: Dict[str, Any], src: str, where: str, n_hidden: int, n_mtp: int) -> List[int]:
    types = raw["layer_types"]
    bad = None if not isinstance(types, (list, tuple)) else next(
        (i for i, t in enumerate(types) if not isinstance(t, str)), None)
    if not isinstance(types, (list, tuple)) or bad is not None:
        at = "" if bad is None else f": layer_types[{bad}] is {_short(types[bad])}"
        raise ConfigError(f"{src}: layer_types must be a list of str{at or ', got ' + _short(types)}", where,
                          field="layer_types")
    given = raw.get("compress_rates")
    if given is not None and not isinstance(given, Mapping):
        raise ConfigError(f"{src}: compress_rates must be a dict, got {_short(given)}", where, field="compress_rates")
    rates = {**DEFAULT_COMPRESS_RATES, **(given or {})}
    field = {name: "compress_rates" for name in DEFAULT_COMPRESS_RATES}
    for key, name in _LEGACY_RATE_KEYS.items():
        if raw.get(key) is not None:
            rates[name], field[name] = raw[key], key
    hi = BOUNDS["compress_ratio"]
    for name in DEFAULT_COMPRESS_RATES:
        if not _is_int(rates[name], 1, hi):
            raise ConfigError(f"{src}: compress_rates[{name!r}] must be an int in [1, {hi}], got "
                              f"{_short(rates[name])}", where, field=field[name])
    table = {"sliding_attention": 0, **{k: int(rates[k]) for k in DEFAULT_COMPRESS_RATES}}
    unknown = sorted({t for t in types if t not in table})
    if unknown:
        raise ConfigError(f"{src}: unknown layer type(s) {_short(unknown)} in layer_types; expected one of "
                          f"{list(LAYER_TYPES)}", where, field="layer_types")
    if len(types) == n_hidden:
        # MTP layers have no layer_types entry in transformers: SWA-only as in the published configs
        return [table[t] for t in types] + [0] * n_mtp
    if len(types) == n_hidden + n_mtp:
        return [table[t] for t in types]
    raise ConfigError(f"{src}: layer_types has {len(types)} entries, expected num_hidden_layers = "
                      f"{n_hidden} (or num_hidden_layers + num_nextn_predict_layers = {n_hidden + n_mtp})",
                      where, field="layer_types")
