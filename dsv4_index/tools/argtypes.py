"""argparse types of the command line (``python -m dsv4_index``: :mod:`.cli` and its ``audit`` command)."""

from __future__ import annotations

import argparse

__all__ = ["int_in"]


def int_in(lo: int, hi: int):
    """An argparse type: an int in ``[lo, hi]`` (argparse names the option in its one-line error)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {s[:40]!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {s[:40]}")
        return v
    parse.__name__ = "integer"
    return parse
