"""Digests of one step's outputs, for traces that carry what they built (:mod:`dsv4_index.tools.trace`).

A digest covers the values only: every field is cut to its valid rows (never the padded tail or the
capacity), converted to int64 (``bool`` -> 0/1, int32 -> int64) and hashed on the host, so a CPU
recording and a CUDA replay, or two recordings with other pad sizes or capacities, digest alike.

Valid rows of each field (``B = num_reqs``, ``T = num_tokens``, ``D = num_decodes``):

* ``[T]`` / ``[T, width]``: ``positions``, ``token_to_req``, ``is_valid_token``, ``slot_mapping``,
  ``compressed_slot_mapping``, ``indices``, ``lens``, ``ks``, ``ke``, ``lens_clamped``;
* ``[B + 1]``: ``query_start_loc``, ``cu``, ``compact_cu``; ``[B]``: ``seq_lens``, ``idx_mapping``;
  ``[D, next_n]``: ``decode_lens``, ``decode_lens_clamped``; ``[compact_cu[B]]``: ``compact_slot_mapping``;
* block tables: for batch row ``b`` of group ``g`` the logical blocks the step can read, as
  ``[count, id_0, id_1, ...]`` (``-1`` after ``count``): ``[0, n)`` for full groups, ``[lo, n)`` for
  sliding groups (``lo``: the block of the row's first window position this step, the same bound the
  ring tables keep), the ring's ``capacity // block_size`` blocks for circular groups; ``n`` = blocks the
  row holds.

Entry of one field: ``{"n": rows, "w": values per row, "h": 64-bit hex digest, "v" or "r"}`` with
``"v"`` the values themselves (base64 of zlib'd int64 little-endian, when ``n * w <= values_limit``)
or ``"r"`` the low 32 bits of every row hash (base64 of uint32 little-endian), enough to name the
first row that differs. Row hash (``rowmix64``): ``splitmix64(sum_j x[j] * K_j + w)`` mod 2**64 with
``K_j = splitmix64(j + 1) | 1``; the digest is blake2b-64 of ``(n, w)`` and the row hashes.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["DIGEST", "output_digests", "first_difference", "values_match_digest", "COMMON_FIELDS", "CHANNEL_FIELDS"]

DIGEST = "rowmix64"
COMMON_FIELDS = ("query_start_loc", "seq_lens", "idx_mapping", "positions", "token_to_req", "is_valid_token")
CHANNEL_FIELDS = ("slot_mapping", "compressed_slot_mapping", "compact_slot_mapping", "compact_cu", "indices",
                  "lens", "ks", "ke", "cu", "decode_lens", "lens_clamped", "decode_lens_clamped")
PER_TOKEN = {"positions", "token_to_req", "is_valid_token", "slot_mapping", "compressed_slot_mapping", "indices",
             "lens", "ks", "ke", "lens_clamped"}
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_K: np.ndarray = np.zeros(0, dtype=np.uint64)


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _keys(w: int) -> np.ndarray:
    global _K
    if _K.size < w:
        _K = _splitmix(np.arange(1, max(w, 2 * _K.size, 256) + 1, dtype=np.uint64)) | np.uint64(1)
    return _K[:w]


def row_hashes(a: np.ndarray) -> np.ndarray:
    """uint64 ``[n]`` rowmix64 hashes of an int64 ``[n, w]`` matrix."""
    n, w = a.shape
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        s = a.view(np.uint64) @ _keys(w) if w else np.zeros(n, dtype=np.uint64)
        return _splitmix(s + np.uint64(w))


def _digest(n: int, w: int, h: np.ndarray) -> str:
    """The 64-bit hex digest of an entry from its shape and row hashes."""
    return hashlib.blake2b(np.asarray([n, w], dtype="<i8").tobytes() + h.astype("<u8").tobytes(),
                           digest_size=8).hexdigest()


def values_match_digest(e: dict) -> bool:
    """True when an entry's recorded values ``v`` hash to its digest ``h`` (an entry without
    values: True). ValueError when ``v`` is not what its shape says (see :func:`_decode_values`)."""
    v = _decode_values(e)
    return v is None or _digest(e["n"], e["w"], row_hashes(v)) == e["h"]


def _entry(a: np.ndarray, values_limit: int) -> dict:
    a = np.ascontiguousarray(a, dtype=np.int64)
    n, w = a.shape
    h = row_hashes(a)
    out = {"n": n, "w": w, "h": _digest(n, w, h)}
    if a.size <= values_limit:
        out["v"] = base64.b64encode(zlib.compress(a.astype("<i8").tobytes(), 1)).decode()
    else:
        out["r"] = base64.b64encode((h & np.uint64(0xFFFFFFFF)).astype("<u4").tobytes()).decode()
    return out


def _matrix(x: torch.Tensor, n: int) -> np.ndarray:
    """The first ``n`` rows of a device tensor as int64 ``[n, w]`` (one copy to the host)."""
    a = x[:n].detach().cpu().numpy()
    return a.reshape(a.shape[0], int(np.prod(a.shape[1:], dtype=np.int64))).astype(np.int64)


def _table_rows(meta, pipe, g: int) -> np.ndarray:
    """``[B, 1 + m]`` int64: per batch row the count and the logical blocks the step can read."""
    from ..state._index import cp_owned, window_start
    grp, tables = meta.layout.groups[g], pipe.tables
    req_slots = np.asarray(meta.req_slots, dtype=np.int64)
    B = req_slots.size
    n = tables.num_blocks[g, req_slots].astype(np.int64) if B else np.zeros(0, np.int64)
    if grp.kind == "full":
        lo = np.zeros(B, dtype=np.int64)
    elif grp.kind == "circular":
        lo = np.maximum(n - grp.ring_blocks, 0)
    else:
        q = np.diff(np.asarray(meta.host_query_start_loc, dtype=np.int64))
        rs = None if meta.replay_start is None else np.asarray(meta.replay_start, dtype=np.int64)
        start = window_start(np.asarray(meta.host_seq_lens, dtype=np.int64) - q, grp.window, rs)
        if grp.sharded and meta.cp[0] > 1:
            start = cp_owned(start, meta.cp)
        lo = np.minimum(start // grp.block_size, n)
    cnt = n - lo
    m = int(cnt.max()) if B else 0
    out = np.full((B, 1 + m), -1, dtype=np.int64)
    out[:, 0] = cnt
    if B and m:
        t = meta.block_tables[g]
        # NOTE: one gather and one copy of the B rows (on the CPU a numpy gather: torch's is slower)
        if t.device.type == "cpu":
            rows = t.numpy()[req_slots]
        else:
            rows = t.index_select(0, meta.idx_mapping.long()).cpu().numpy()
        logical = lo[:, None] + np.arange(m)[None, :]
        ring = rows.shape[1]
        col = logical % ring if grp.kind != "full" and ring < grp.table_width else np.minimum(logical, ring - 1)
        got = np.take_along_axis(rows, col, axis=1).astype(np.int64)
        keep = np.arange(m)[None, :] < cnt[:, None]
        out[:, 1:] = np.where(keep, got, -1)
    return out


def output_digests(meta, pipe, *, values_limit: int = 4096, keep: Optional[dict] = None) -> Dict[str, dict]:
    """Digests of every output of ``meta`` (a ``build()`` of ``pipe``): ``{"common": {field: entry},
    "block_tables": {group: entry}, "channels": {channel: {field: entry}}}`` (see the module docstring).
    ``keep``: a dict that receives the host matrices, keyed ``(channel or None, field)``."""
    B, T, D = meta.num_reqs, meta.num_tokens, meta.num_decodes
    rows = dict(query_start_loc=B + 1, seq_lens=B, idx_mapping=B, cu=B + 1, compact_cu=B + 1,
                decode_lens=D, decode_lens_clamped=D)
    keep = {} if keep is None else keep

    def entry(ch, f, a):
        keep[(ch, f)] = a
        return _entry(a, values_limit)

    common = {f: entry(None, f, _matrix(getattr(meta, f), rows.get(f, T))) for f in COMMON_FIELDS}
    tables = {grp.name: entry(None, f"block_table[{grp.name}]", _table_rows(meta, pipe, g))
              for g, grp in enumerate(meta.layout.groups)}
    channels = {}
    for name, c in meta.channels.items():
        d, ncompact = {}, None
        for f in CHANNEL_FIELDS:
            x = getattr(c, f)
            if x is None:
                continue
            if f == "compact_slot_mapping":
                ncompact = int(c.compact_cu[B]) if c.compact_cu is not None else 0
                a = _matrix(x, ncompact)
            else:
                a = _matrix(x, rows.get(f, T))
            d[f] = entry(name, f, a)
        channels[name] = d
    return {"common": common, "block_tables": tables, "channels": channels}


def _b64(s: str, what: str) -> bytes:
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ValueError(f"{what} is not base64") from None


def _decode_values(e: dict) -> Optional[np.ndarray]:
    """The recorded values of an entry (None when only row hashes were recorded); ValueError if corrupt."""
    if "v" not in e:
        return None
    size = 8 * e["n"] * e["w"]
    try:
        z = zlib.decompressobj()
        raw = z.decompress(_b64(e["v"], "v"), size + 1)
    except zlib.error as err:
        raise ValueError(f"v is not zlib data ({err})") from None
    if len(raw) != size or z.unconsumed_tail:
        raise ValueError(f"v holds {len(raw)} bytes{'+' if z.unconsumed_tail else ''}, expected n * w * 8 = {size}")
    return np.frombuffer(raw, dtype="<i8").reshape(e["n"], e["w"]).astype(np.int64)


def _decode_rows(e: dict) -> np.ndarray:
    v = _decode_values(e)
    if v is not None:
        return (row_hashes(v) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    raw = _b64(e["r"], "r")
    if len(raw) != 4 * e["n"]:
        raise ValueError(f"r holds {len(raw)} bytes, expected n * 4 = {4 * e['n']}")
    return np.frombuffer(raw, dtype="<u4").astype(np.uint32)


def flat_entries(dg: dict) -> List[Tuple[Optional[str], str, dict]]:
    """``(channel or None, field, entry)`` in comparison order: common fields, block tables, channels."""
    out: List[Tuple[Optional[str], str, dict]] = [(None, f, e) for f, e in dg.get("common", {}).items()]
    out += [(None, f"block_table[{g}]", e) for g, e in dg.get("block_tables", {}).items()]
    for ch, fields in dg.get("channels", {}).items():
        out += [(ch, f, e) for f, e in fields.items()]
    return out


def first_difference(recorded: dict, replayed: dict, replayed_values: Dict[Tuple[Optional[str], str], np.ndarray]):
    """The first field whose digest differs: ``None`` when all agree, else a dict with ``channel``,
    ``field``, ``row`` (first row that differs), ``expected`` / ``found`` (recorded / replayed row
    values; the recorded row hash when only hashes were recorded) and ``fields`` (every field that
    differs, ``channel.field``)."""
    rec = {(c, f): e for c, f, e in flat_entries(recorded)}
    rep = {(c, f): e for c, f, e in flat_entries(replayed)}
    bad = [k for k in rep if k not in rec or rec[k]["h"] != rep[k]["h"]] + [k for k in rec if k not in rep]
    if not bad:
        return None
    c, f = bad[0]
    names = [f if ch is None else f"{ch}.{f}" for ch, f in bad]
    if (c, f) not in rec or (c, f) not in rep:
        return dict(channel=c, field=f, row=None, fields=names, expected="(absent)" if (c, f) not in rec else
                    "(present)", found="(absent)" if (c, f) not in rep else "(present)")
    e_rec, e_rep = rec[(c, f)], rep[(c, f)]
    mine = replayed_values[(c, f)]
    a, b = _decode_rows(e_rec), _decode_rows(e_rep)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    theirs = _decode_values(e_rec)
    if not diff.size and a.size == b.size:
        if e_rec["w"] == e_rep["w"]:   # NOTE: every 32-bit row hash agrees, the 64-bit digest does not
            return dict(channel=c, field=f, row=None, fields=names, expected=f"digest {e_rec['h']}",
                        found=f"digest {e_rep['h']}")
        row = 0
    else:
        row = int(diff[0]) if diff.size else n
    expected = ("(no such row: recorded {} rows)".format(e_rec["n"]) if row >= e_rec["n"] else
                theirs[row].tolist() if theirs is not None else f"row hash 0x{int(a[row]):08x} "
                "(recorded without values)")
    found = (f"(no such row: replayed {e_rep['n']} rows)" if row >= e_rep["n"] else mine[row].tolist())
    return dict(channel=c, field=f, row=row, fields=names, expected=expected, found=found)
