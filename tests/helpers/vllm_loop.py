"""The preamble of ``tests/integration``: vLLM 0.33 required or the module skipped, and
``benchmarks/vllm_scheduler_loop.py`` loaded as a module.

Under ``./dev test-vllm`` (CI's integration stage) ``DSV4_REQUIRE_VLLM=1``: a vLLM that does not import, or
another version, fails the run loudly; elsewhere (the main suite's ``.venv``, without vLLM) the calling test
module is skipped. ``VLLM_TARGET_DEVICE`` defaults to ``cpu``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from helpers import ROOT

# NOTE: 48 prompts of 2 prefixes at once: same-step prefix hits
BURST = ["--initial", "48", "--arrival", "0.9", "--shared-prefixes", "2", "--max-prompt", "600",
         "--max-tokens", "4096"]


def require_vllm():
    """The ``vllm`` module (0.33.x); call at a test module's top level (a skip there skips the module)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.get("DSV4_REQUIRE_VLLM") == "1":  # NOTE: ./dev test-vllm (CI): an import failure fails loudly
        import vllm
        assert vllm.__version__.startswith("0.33."), f"written against vLLM 0.33's scheduler, found {vllm.__version__}"
        return vllm
    vllm = pytest.importorskip("vllm", reason="needs vLLM 0.33: ./dev test-vllm (CI's integration stage)")
    if not vllm.__version__.startswith("0.33."):
        pytest.skip(f"written against vLLM 0.33's scheduler, found {vllm.__version__}", allow_module_level=True)
    return vllm


def load_loop(name: str):
    """``benchmarks/vllm_scheduler_loop.py`` as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "vllm_scheduler_loop.py")
    loop = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(loop)  # type: ignore[union-attr]
    return loop
