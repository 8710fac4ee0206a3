"""Bounded JSON reading for files a user hands over (config.json, step traces).

``loads_bounded`` checks the size and the nesting depth *before* parsing (no ``RecursionError``, no
huge allocation), rejects duplicate keys and ``NaN`` / ``Infinity``, and raises one ``ValueError``
naming the place (``where``: file and line) for anything it cannot use.
"""

from __future__ import annotations

import json
import re

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
    """``where:line: msg``; ``line`` and ``msg`` kept for callers that re-raise their own error type."""

    def __init__(self, where: str, line: int, msg: str):
        self.where, self.line, self.msg = where, line, msg
        super().__init__(f"{where}:{line}: {msg}")


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


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _pairs(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def loads_bounded(text: str, where: str, *, first_line: int = 1, max_depth: int = MAX_DEPTH, raw: bytes = None):
    """Parse one JSON document (``where``: the file, for messages; ``first_line``: its first line;
    ``raw``: the bytes ``text`` was decoded from, when the caller has them)."""
    raw = text.encode("utf-8", "surrogatepass") if raw is None else raw
    depth = _depth(raw)
    if depth > max_depth:
        raise BadJSON(where, first_line, f"JSON nested {depth} deep (at most {max_depth} allowed)")
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        cut = " (truncated?)" if e.pos >= len(text.rstrip()) else ""
        raise BadJSON(where, first_line + e.lineno - 1, f"not JSON{cut}: {e.msg} at column {e.colno}") from e
    except (ValueError, RecursionError) as e:   # duplicate keys, NaN, ints beyond the digit limit
        raise BadJSON(where, first_line, f"unusable JSON: {e}") from None


def line_of_key(text: str, key: str) -> int:
    """Line (1-based) of the first ``"key":`` in ``text``, 0 when absent."""
    m = re.search(r'"' + re.escape(key) + r'"\s*:', text)
    return 0 if m is None else text.count("\n", 0, m.start()) + 1
