"""Tests of :mod:`dsv4_index.frontend`; the shared helpers of ``tests/`` are importable from here."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
