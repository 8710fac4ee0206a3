"""Torch's intra-op threads for the library's own scripts (examples, benchmarks, ``./dev demo``); imports
neither triton nor dsv4_index, so a script may import it before it sets TRITON_INTERPRET.

One thread by default, as an engine's GPU worker runs (vLLM's workers set one): the host work of a step is
many tiny ops, which only contend with intra-op threads, and on a shared machine torch's default (one thread
per core) makes every tiny op wait for busy cores (issue 40: the demo took 6x its idle time at load 3 with
the default). ``--threads N`` overrides it. The library itself never sets a thread count: an engine's own.
"""

from __future__ import annotations

import argparse

__all__ = ["add_threads_option", "set_threads"]


def add_threads_option(ap: argparse.ArgumentParser) -> None:
    """Add ``--threads N`` (default 1) to a script's parser."""
    ap.add_argument("--threads", type=int, default=1, metavar="N",
                    help="torch intra-op threads (default 1, as an engine's worker runs; 0: torch's default)")


def set_threads(n: int) -> int:
    """``torch.set_num_threads(n)`` for ``n >= 1`` (``0`` leaves torch's default); returns the count in force.
    Raises ValueError for a negative ``n``."""
    import torch

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"--threads must be an int >= 0 (0: torch's default), got {n!r}")
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
