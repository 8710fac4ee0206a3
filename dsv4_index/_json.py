"""Bounded JSON reading for files a user hands over (config.json, step traces).

``loads_bounded`` checks the size and the nesting depth *before* parsing (no ``RecursionError``, no
huge allocation), rejects duplicate keys and ``NaN`` / ``Infinity``, and raises one ``ValueError``
naming the place (``where``: file and line) for anything it cannot use.
"""

from __future__ import annotations

import json
import re
from typing import Optional

import numpy as np

__all__ = ["BadJSON", "loads_bounded", "decode_utf8", "line_of_key", "one_line", "MAX_DEPTH"]

_ESCAPES = {c: repr(chr(c))[1:-1] for c in [*range(32), 127, 0x85, 0x2028, 0x2029]}


def one_line(s: str) -> str:
    """``s`` with control and line-break characters escaped (a key or a path read from a file may hold them)."""
    return s.translate(_ESCAPES)

MAX_DEPTH = 32
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # NOTE: unrolled: no regex stack per character
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class BadJSON(ValueError):
    """``where:line: msg``; ``line``, ``msg`` and ``key`` (the key path the problem is at, when known)
    kept for callers that re-raise their own error type."""

    def __init__(self, where: str, line: int, msg: str, key: Optional[str] = None):
        self.where, self.line, self.msg, self.key = where, line, msg, key
        super().__init__(f"{where}:{line}: {key + ': ' if key else ''}{msg}")


def decode_utf8(raw: bytes, where: str, first_line: int = 1) -> str:
    """``raw`` as text, or ``ValueError`` naming the line and column of the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise BadJSON(where, line, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {col}; "
                         "a binary file?)") from None


def _depth(raw: bytes) -> int:
    """Deepest ``[`` / ``{`` nesting outside string literals."""
    b = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not b:
        return 0
    a = np.frombuffer(b, dtype=np.uint8)
    step = np.where((a == ord("[")) | (a == ord("{")), 1, -1)
    return int(np.cumsum(step).max())


class _NonFinite(float):
    """What ``NaN`` / ``Infinity`` parse to, so that the reader can name the key holding one."""


def _constant(name):
    return _NonFinite(float(name))


def _non_finite_path(v, path: str = ""):
    """Key path (``a.b[2]``) of the first non-finite constant in a parsed document, or None."""
    if isinstance(v, _NonFinite):
        return path or "(the document)"
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        got = _non_finite_path(x, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if got is not None:
            return got
    return None


_CONSTANT = re.compile(r"-?Infinity|NaN")


def _pairs(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def loads_bounded(text: str, where: str, *, first_line: int = 1, max_depth: int = MAX_DEPTH,
                  raw: Optional[bytes] = None):
    """Parse one JSON document (``where``: the file, for messages; ``first_line``: its first line;
    ``raw``: the bytes ``text`` was decoded from, when the caller has them)."""
    raw = text.encode("utf-8", "surrogatepass") if raw is None else raw
    depth = _depth(raw)
    if depth > max_depth:
        raise BadJSON(where, first_line, f"JSON nested {depth} deep (at most {max_depth} allowed)")
    try:
        out = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except json.JSONDecodeError as e:
        cut = " (truncated?)" if e.pos >= len(text.rstrip()) else ""
        raise BadJSON(where, first_line + e.lineno - 1, f"not JSON{cut}: {e.msg} at column {e.colno}") from e
    except (ValueError, RecursionError) as e:   # duplicate keys, ints beyond the digit limit
        raise BadJSON(where, first_line, f"unusable JSON: {e}") from None
    path = _non_finite_path(out)
    if path is not None:   # NOTE: NaN / Infinity: named by key path, on the line of the first one
        bare = _STRING.sub(lambda m: b" " * len(m.group(0)), raw).decode("utf-8", "replace")  # strings hold no newline
        m = _CONSTANT.search(bare)
        line = first_line + (bare.count("\n", 0, m.start()) if m else 0)
        name = m.group(0) if m else "NaN"
        raise BadJSON(where, line, f"{name} is not a JSON number (unusable JSON)", key=path)
    return out


def line_of_key(text: str, key: str) -> int:
    """Line (1-based) of the first ``"key":`` in ``text``, 0 when absent."""
    m = re.search(r'"' + re.escape(key) + r'"\s*:', text)
    return 0 if m is None else text.count("\n", 0, m.start()) + 1
