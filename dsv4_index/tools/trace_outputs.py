"""Checks of a trace's ``outputs`` and ``end`` lines, bounded by the trace's own header: every digest
entry's rows and width are checked against what the header's pipeline can produce (its capacities and
layout) before anything is decoded, the decoded size is capped at that, and every recorded ``v``
(values) must hash to its digest ``h``."""

from __future__ import annotations

import re
from typing import Dict, Tuple

from ..geometry import DSV4Layout
from .digest import CHANNEL_FIELDS, COMMON_FIELDS, values_match_digest
from .trace_schema import _At

__all__ = ["entry_bounds", "check_outputs", "check_end"]

_HEX16 = re.compile(r"[0-9a-f]{16}\Z")
_B64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?\Z")
_PER_REQUEST_PLUS_1 = ("cu", "compact_cu")
_NEXT_N = ("decode_lens", "decode_lens_clamped")


def entry_bounds(layout: DSV4Layout, p: dict) -> Dict[Tuple, Tuple[int, int]]:
    """``{(channel or None, field): (most rows, most values per row)}`` of every digest entry a
    pipeline of ``layout`` with the header's arguments ``p`` can record (:func:`output_digests`):
    per-token fields ``max_num_batched_tokens`` rows, per-request ones ``max_num_reqs`` (+ 1), block
    tables ``1 + blocks a row can hold`` values, index lists their channel's width."""
    num_slots, T = p["max_num_reqs"], p["max_num_batched_tokens"]
    next_n = 1 + p["num_speculative_tokens"]
    out: Dict[Tuple, Tuple[int, int]] = {}
    for f in COMMON_FIELDS:
        rows = num_slots + 1 if f == "query_start_loc" else num_slots if f in ("seq_lens", "idx_mapping") else T
        out[(None, f)] = (rows, 1)
    for g in layout.groups:
        held = max(g.table_width, g.ring_blocks) * g.blocks_per_kv_block
        out[(None, f"block_table[{g.name}]")] = (num_slots, 1 + held)
    for name, c in layout.channels.items():
        width = max(1, c.index_width or 0, c.window or 0)
        for f in CHANNEL_FIELDS:
            rows = num_slots + 1 if f in _PER_REQUEST_PLUS_1 else T
            out[(name, f)] = (rows, next_n if f in _NEXT_N else width if f == "indices" else 1)
    return out


def check_outputs(path, n: int, d, expected_index: int, bounds: dict) -> dict:
    """An ``outputs`` line (line ``n``), checked against the header's ``bounds`` (:func:`entry_bounds`)."""
    at = _At(path, n)
    at.dict(d, "", ("type", "index", "digests"))
    at.int(d["index"], "index", expected_index - 1, expected_index - 1)
    dg = at.dict(d["digests"], "digests", ("common", "block_tables", "channels"))
    for part in ("common", "block_tables"):
        keys = tuple(dg[part]) if isinstance(dg[part], dict) else ()
        for k, e in at.dict(dg[part], f"digests.{part}", (), keys).items():
            key = (None, k if part == "common" else f"block_table[{k}]")
            _entry(at, e, f"digests.{part}.{k}", bounds.get(key))
    known = {k[0] for k in bounds if k[0] is not None}
    keys = tuple(dg["channels"]) if isinstance(dg["channels"], dict) else ()
    for ch, fields in at.dict(dg["channels"], "digests.channels", (), keys).items():
        if ch not in known:
            at.err(f"digests.channels.{ch}", "no such channel in the header's layout")
        at.dict(fields, f"digests.channels.{ch}", (), tuple(fields) if isinstance(fields, dict) else ())
        for k, e in fields.items():
            _entry(at, e, f"digests.channels.{ch}.{k}", bounds.get((ch, k)))
    return d


def _entry(at: _At, e, field: str, bound) -> None:
    if bound is None:
        at.err(field, "no such output in the header's layout")
    rows, width = bound
    at.dict(e, field, ("n", "w", "h"), ("v", "r"))
    at.int(e["n"], field + ".n", 0, rows)
    at.int(e["w"], field + ".w", 0, width)
    if not isinstance(e["h"], str) or not _HEX16.match(e["h"]):
        at.err(field + ".h", f"must be 16 lower-case hex digits, got {type(e['h']).__name__} {str(e['h'])[:40]!r}")
    if ("v" in e) == ("r" in e):
        at.err(field, "needs exactly one of 'v' (values) and 'r' (row hashes)")
    k = "v" if "v" in e else "r"
    raw = e["n"] * (4 if k == "r" else 8 * e["w"])
    # NOTE: zlib's stored blocks add at most 5 bytes per 16 KiB block plus a header: a longer 'v' is not
    # this entry (checked before decoding, so a decompression bomb never starts)
    longest = 4 * -(-(raw if k == "r" else raw + raw // 1000 + 64) // 3)
    if not isinstance(e[k], str) or len(e[k]) > longest or not _B64.match(e[k]):
        what = (f"{len(e[k])} characters, more than the {longest} that n = {e['n']} rows of w = {e['w']} "
                "values can take" if isinstance(e[k], str) and len(e[k]) > longest else "not base64 text")
        at.err(f"{field}.{k}", what)
    if k == "r" and len(e[k]) != longest:
        at.err(f"{field}.r", f"{len(e[k])} characters, expected {longest} (n = {e['n']} row hashes)")
    try:
        same = values_match_digest(e)   # NOTE: decompresses at most n * w * 8 bytes (+1 to see more)
    except ValueError as err:
        at.err(f"{field}.v", str(err))
    if not same:
        at.err(f"{field}.v", f"the values do not hash to the entry's digest h = {e['h']} (an edited trace?)")


def check_end(path, n: int, d) -> dict:
    """An ``end`` line's fields (its counts are compared with the trace by the reader)."""
    at = _At(path, n)
    at.dict(d, "", ("type", "steps", "rejected", "outputs"), ("error",))
    for k in ("steps", "rejected", "outputs"):
        at.int(d[k], k, 0)
    if "error" in d:
        at.str(d["error"], "error")
    return d
