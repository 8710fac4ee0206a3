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
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ._common import is_int

__all__ = ["SHIPPED", "CONFIG_DIR", "LAYER_TYPES", "DEFAULT_COMPRESS_RATES", "normalize_config",
           "shipped_config", "shipped_config_path"]

SHIPPED = ("flash", "pro", "tiny")
"""Names of the configs shipped as package data."""

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""Folder of the shipped ``{flash,pro,tiny}.json``."""

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
"""``layer_types`` names of transformers' ``DeepseekV4Config``."""

DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
"""``DeepseekV4Config.default_compress_rates``: ratio of each compressed layer type."""

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
    raw, where = _read_source(config)
    return _normalize_dict(raw, where)


# ---------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"config: {path} is not valid JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"config: {path} is not valid JSON: {e}") from e
    except OSError as e:
        raise ValueError(f"config: cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _read_source(config) -> Tuple[Dict[str, Any], str]:
    """``(raw dict, description of the source for error messages)``."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if isinstance(config, str) and config in SHIPPED and not path.exists():
            p = shipped_config_path(config)
            return _read_json(p), f"shipped config {config!r} ({p})"
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            hint = "" if path.suffix else f" (shipped names: {list(SHIPPED)})"
            raise ValueError(f"config: no such file {str(path)!r}{hint}")
        return _read_json(path), str(path)
    if isinstance(config, Mapping):
        return dict(config), "dict"
    kind = type(config).__name__
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict) and not isinstance(config, type):
        d = to_dict()
        if not isinstance(d, Mapping):
            raise ValueError(f"config: {kind}.to_dict() returned {type(d).__name__}, not a dict")
        return dict(d), f"{kind} object"
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, f"{kind} object"
    if hasattr(config, "__dict__") and not isinstance(config, type):
        return dict(vars(config)), f"{kind} object"
    raise ValueError(f"config must be a shipped name {list(SHIPPED)}, a config.json path or model "
                     f"directory, a dict or a config object, got {kind}")


def _is_int(v, minimum: int) -> bool:
    return is_int(v) and v >= minimum


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
        raise ValueError(f"{src} is missing key(s) {missing}{extra}")

    n_hidden = raw["num_hidden_layers"]
    if not _is_int(n_hidden, 1):
        raise ValueError(f"{src}: num_hidden_layers must be an int >= 1, got {n_hidden!r}")
    n_mtp = raw.get("num_nextn_predict_layers")
    n_mtp = 0 if n_mtp is None else n_mtp
    if not _is_int(n_mtp, 0):
        raise ValueError(f"{src}: num_nextn_predict_layers must be an int >= 0, got {n_mtp!r}")
    n_all = n_hidden + n_mtp

    ratios = None
    if has_ratios:
        r = raw["compress_ratios"]
        if not isinstance(r, (list, tuple)) or not all(_is_int(x, 0) for x in r):
            raise ValueError(f"{src}: compress_ratios must be a list of ints >= 0, got {r!r}")
        ratios = [int(x) for x in r]
        if len(ratios) != n_all:
            raise ValueError(f"{src}: compress_ratios has {len(ratios)} entries, expected "
                             f"num_hidden_layers + num_nextn_predict_layers = {n_all}")
    if has_types:
        from_types = _ratios_from_layer_types(raw, src, n_hidden, n_mtp)
        if ratios is None:
            ratios = from_types
        else:
            k = len(raw["layer_types"])
            bad = [i for i in range(k) if ratios[i] != from_types[i]]
            if bad:
                i = bad[0]
                raise ValueError(f"{src}: layer_types and compress_ratios disagree at {len(bad)} layer(s), "
                                 f"first layer {i}: layer_types[{i}] = {raw['layer_types'][i]!r} "
                                 f"(ratio {from_types[i]}) but compress_ratios[{i}] = {ratios[i]}")
    out["compress_ratios"] = ratios
    out["num_hidden_layers"] = n_hidden
    out["num_nextn_predict_layers"] = n_mtp

    distinct = sorted({x for x in ratios if x > 0})
    # same rule as DSV4Layout.from_config: the smaller of two ratios, or a single ratio <= 4, is the
    # indexed c4 kind that needs index_topk
    has_c4 = len(distinct) == 2 or (len(distinct) == 1 and distinct[0] <= 4)
    if raw.get("index_topk") is None:
        if has_c4:
            raise ValueError(f"{src} is missing key(s) ['index_topk'] (needed by c4 layers)")
        out["index_topk"] = None
    return out


def _ratios_from_layer_types(raw: Dict[str, Any], src: str, n_hidden: int, n_mtp: int) -> List[int]:
    types = raw["layer_types"]
    if not isinstance(types, (list, tuple)) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"{src}: layer_types must be a list of str, got {types!r}")
    given = raw.get("compress_rates")
    if given is not None and not isinstance(given, Mapping):
        raise ValueError(f"{src}: compress_rates must be a dict, got {given!r}")
    rates = {**DEFAULT_COMPRESS_RATES, **(given or {})}
    for key, name in _LEGACY_RATE_KEYS.items():
        if raw.get(key) is not None:
            rates[name] = raw[key]
    for name in DEFAULT_COMPRESS_RATES:
        if not _is_int(rates[name], 1):
            raise ValueError(f"{src}: compress_rates[{name!r}] must be an int >= 1, got {rates[name]!r}")
    table = {"sliding_attention": 0, **{k: int(rates[k]) for k in DEFAULT_COMPRESS_RATES}}
    unknown = sorted({t for t in types if t not in table})
    if unknown:
        raise ValueError(f"{src}: unknown layer type(s) {unknown} in layer_types; expected one of "
                         f"{list(LAYER_TYPES)}")
    if len(types) == n_hidden:
        # MTP layers have no layer_types entry in transformers: SWA-only as in the published configs
        return [table[t] for t in types] + [0] * n_mtp
    if len(types) == n_hidden + n_mtp:
        return [table[t] for t in types]
    raise ValueError(f"{src}: layer_types has {len(types)} entries, expected num_hidden_layers = "
                     f"{n_hidden} (or num_hidden_layers + num_nextn_predict_layers = {n_hidden + n_mtp})")
