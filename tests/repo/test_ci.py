"""CI's stages (issue 40 item 2): ``.ci/run`` runs lint, the README's test command, then the second environments,
each a ``./dev`` command; the integration stage never skips for want of vLLM."""

from __future__ import annotations

import re

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


def test_integration_tests_fail_without_vllm_in_ci():
    for path in sorted((ROOT / "tests" / "integration").glob("test_*.py")):
        text = path.read_text()
        assert 'os.environ.get("DSV4_REQUIRE_VLLM") == "1"' in text, path.name
