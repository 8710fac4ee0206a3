"""CI's stages (issue 40 item 2): ``.ci/run`` runs lint, the README's test command, then the second environments,
each a ``./dev`` command; the integration stage never skips for want of vLLM."""

from __future__ import annotations

import ast
import re
import sys

import pytest

from helpers import ROOT


def test_ci_stages_in_order():
    stages = re.findall(r"^stage (\S+)", (ROOT / ".ci" / "run").read_text(), re.M)
    assert stages == ["lint", "test", "test-triton39", "test-vllm", "test-nojit"]
    dev = (ROOT / "dev").read_text()
    for s in stages:
        assert re.search(rf"^  {re.escape(s)}\)", dev, re.M), s


def test_extra_envs_pin_their_stacks():
    t39 = (ROOT / ".ci" / "requirements-triton39.txt").read_text().split()
    assert "triton==3.9.0" in t39 and "numba==0.65.0" in t39 and "torch==2.13.0" in t39
    vl = (ROOT / ".ci" / "requirements-vllm.txt").read_text().split()
    assert "numba==0.65.0" in vl and not any(x.startswith("vllm") for x in vl)  # NOTE: vLLM goes in --no-deps
    dev = (ROOT / "dev").read_text()
    assert '--no-deps "vllm==$VLLM_VERSION"' in dev and "DSV4_REQUIRE_VLLM=1" in dev


def test_integration_tests_fail_without_vllm_in_ci(monkeypatch):
    """Every integration module calls ``require_vllm()`` at its top level (tests/helpers/vllm_loop.py), which
    raises ImportError where vLLM does not import under ``DSV4_REQUIRE_VLLM=1`` (CI) and skips elsewhere."""
    from helpers.vllm_loop import require_vllm

    for path in sorted((ROOT / "tests" / "integration").glob("test_*.py")):
        top = [n.value.func.id for n in ast.parse(path.read_text()).body if isinstance(n, ast.Expr)
               and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)]
        assert "require_vllm" in top, path.name
    monkeypatch.setitem(sys.modules, "vllm", None)  # NOTE: `import vllm` raises ImportError
    monkeypatch.setenv("DSV4_REQUIRE_VLLM", "1")
    with pytest.raises(ImportError):
        require_vllm()
    monkeypatch.delenv("DSV4_REQUIRE_VLLM")
    with pytest.raises(pytest.skip.Exception):
        require_vllm()
