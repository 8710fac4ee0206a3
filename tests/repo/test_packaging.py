"""The wheel installs and runs on its own: built from a copy of the sources, installed into a fresh
virtual environment, run from a folder outside the repository.

The fresh environment reuses this interpreter's torch / triton / numpy (a ``.pth`` line appends the
current site-packages after the environment's own), so nothing is downloaded; ``dsv4_index`` itself
comes only from the wheel.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from helpers.scripts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "dsv4_index")


def sh(args, cwd, env=None, timeout=None):
    p = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout or hang_guard())
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    # build from a copy, so the working tree gets no build/ or egg-info and half-saved files elsewhere
    # in the repository cannot matter
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    wheels = tmp / "wheels"
    rc, out = sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-w", wheels, src], cwd=tmp)
    assert rc == 0, out
    (wheel,) = wheels.glob("dsv4_index-*.whl")

    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    rc, site = sh([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp)
    assert rc == 0, site
    site = Path(site.strip())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    # NOTE: pip must not see the working tree's dsv4-index (an egg-info on PYTHONPATH, or the editable install
    # behind the deps line below): pip 26.3 then installs nothing ("already installed with the same version")
    rc, out = sh([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index",
                  "--ignore-installed", wheel], cwd=tmp, env=env)
    assert rc == 0, out
    assert (site / "dsv4_index" / "__init__.py").is_file(), out
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_dsv4_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(here)))

    run_dir = tmp / "elsewhere"
    run_dir.mkdir()
    return {"wheel": wheel, "py": py, "env_dir": env_dir, "site": site, "cwd": run_dir, "env": env}


@pytest.mark.slow  # builds a wheel, installs it into a fresh venv
def test_wheel_contents(installed):
    with zipfile.ZipFile(installed["wheel"]) as z:
        names = set(z.namelist())
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(meta).decode()
    for cfg in ("flash", "pro", "tiny"):
        assert f"dsv4_index/configs/{cfg}.json" in names, sorted(names)
    assert "dsv4_index/py.typed" in names
    assert "dsv4_index/config.py" in names
    lic = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert lic, sorted(names)
    assert "License-Expression: Apache-2.0" in metadata
    assert "Provides-Extra: test" in metadata and "Provides-Extra: examples" in metadata
    import dsv4_index
    assert f"Version: {dsv4_index.__version__}" in metadata
    # runtime dependencies = what the package imports; the rest only in extras
    base = sorted(line.split(":", 1)[1].strip() for line in metadata.splitlines()
                  if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert [d.split(">")[0].split("<")[0].split("=")[0].strip() for d in base] == ["numba", "numpy", "torch"], base
    for extra in ("triton", "models", "plot", "dev"):
        assert f"Provides-Extra: {extra}" in metadata, extra
    assert "Classifier: Typing :: Typed" in metadata and "Project-URL" not in metadata
    assert not any(n.startswith(("models/", "tests/", "examples/")) for n in names)


@pytest.mark.slow  # builds a wheel, installs it into a fresh venv
def test_imports_from_the_wheel(installed):
    rc, out = sh([installed["py"], "-c", "import dsv4_index.config as c, dsv4_index as d; "
                  "print(d.__file__); print(c.shipped_config('pro')['num_hidden_layers'])"],
                 cwd=installed["cwd"], env=installed["env"])
    assert rc == 0, out
    path, layers = out.strip().splitlines()[-2:]
    assert Path(path).resolve().is_relative_to(installed["site"].resolve()), out
    assert not Path(path).resolve().is_relative_to(ROOT), out
    assert layers == "61"


@pytest.mark.slow  # builds a wheel, installs it into a fresh venv
def test_cli_layout_pro(installed):
    rc, out = sh([installed["py"], "-m", "dsv4_index", "layout", "--config", "pro"],
                 cwd=installed["cwd"], env=installed["env"])
    assert rc == 0, out
    assert "DSV4Layout(max_model_len=32768, layers=62, W=128, c4=4, c128=128, index_topk=1024)" in out, out
    for group in ("mla", "swa", "c4_state", "c128_state"):
        assert group in out, out
    script = installed["env_dir"] / ("Scripts/dsv4-index.exe" if os.name == "nt" else "bin/dsv4-index")
    rc, out = sh([script, "layout", "--config", "tiny"], cwd=installed["cwd"], env=installed["env"])
    assert rc == 0 and "layers=5" in out, out


@pytest.mark.slow  # builds a wheel, installs it into a fresh venv
def test_cli_demo(installed):
    env = dict(installed["env"])
    env.pop("TRITON_INTERPRET", None)          # CPU: the PyTorch reference path (the kernels have their tests)
    rc, out = sh([installed["py"], "-m", "dsv4_index", "demo"], cwd=installed["cwd"], env=env)
    assert rc == 0, out
    assert "DSV4Layout(max_model_len=32768, layers=44" in out, out
    assert "step: 4 requests" in out, out
    for channel in ("[c4a]", "[c4i]", "[c128a]", "[swa]"):
        assert channel in out, out


# ---- without triton: a finder that refuses every `triton` import, installed before anything else ----
# NOTE: a None entry makes `import triton` raise ModuleNotFoundError and importlib.util.find_spec return
# None, as on a host without the package (a finder that raises breaks torch's own CUDA-build probes)
NO_TRITON = r'''
import sys
for _m in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
    del sys.modules[_m]
sys.modules["triton"] = None
def _triton_loaded():
    return any((m == "triton" or m.startswith("triton.")) and sys.modules[m] is not None for m in list(sys.modules))
'''

WITHOUT_TRITON_BODY = r'''
import pytest, torch
import dsv4_index as d
from dsv4_index._triton import HAVE_TRITON, TritonUnavailable
assert not HAVE_TRITON
assert not _triton_loaded(), "triton got imported"

layout = d.DSV4Layout.from_config("tiny", max_model_len=128)
pipe = d.MetadataPipeline(layout, max_num_reqs=4, max_num_batched_tokens=16, device="cpu")
pipe.warmup()
sizes = [g.alloc_block_size for g in layout.groups]
blocks = tuple(list(range(1, 1 + -(-9 // s))) for s in sizes)      # enough blocks for 9 tokens per group
pipe.update(d.StepInput(new_requests=[d.NewRequest("a", block_ids=blocks, num_computed_tokens=0)],
                        running_requests=[], num_scheduled_tokens={"a": 9}))
meta = pipe.build()
assert pipe.num_launches >= 1 and meta.num_tokens == 9

qsl = torch.tensor([0, 3], dtype=torch.int32)
seq = torch.tensor([5], dtype=torch.int32)
bt = torch.tensor([[4, 9]], dtype=torch.int32)
got = d.slot_mapping(qsl, seq, bt, 4).tolist()
assert got == [18, 19, 36], got                      # positions 2, 3, 4: 4*4+2, 4*4+3, 9*4+0
try:
    d.slot_mapping(qsl, seq, bt, 4, backend="triton")
except TritonUnavailable as e:
    assert "pip install 'dsv4-index[triton]'" in str(e), e
else:
    raise AssertionError("backend='triton' without triton did not raise")
print("OK without triton")
'''


def _run_without_triton(extra_env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DSV4_INDEX_BACKEND")}
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-c", NO_TRITON + WITHOUT_TRITON_BODY], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=hang_guard())


@pytest.mark.slow  # ./dev quick skips it
def test_runs_without_triton():
    p = _run_without_triton()
    assert p.returncode == 0 and "OK without triton" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow  # ./dev quick skips it
def test_interpreter_asked_without_triton_says_what_to_install():
    code = NO_TRITON + ("import torch, dsv4_index as d\n"
                        "q = torch.tensor([0, 1], dtype=torch.int32)\n"
                        "d.token_to_req(q, num_tokens=1)\n")
    env = {k: v for k, v in os.environ.items() if k != "DSV4_INDEX_BACKEND"}
    env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=hang_guard())
    assert p.returncode != 0, p.stdout + p.stderr
    assert "TritonUnavailable" in p.stderr and "pip install 'dsv4-index[triton]'" in p.stderr, p.stderr


@pytest.mark.slow  # ./dev quick skips it
def test_cli_demo_without_triton():
    code = NO_TRITON + ("import runpy\n"
                        "sys.argv = ['dsv4_index', 'demo', '--config', 'tiny']\n"
                        "try:\n"
                        "    runpy.run_module('dsv4_index', run_name='__main__')\n"
                        "finally:\n"
                        "    assert not _triton_loaded()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DSV4_INDEX_BACKEND")}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=hang_guard())
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step: 4 requests" in p.stdout and "[c4a]" in p.stdout, p.stdout + p.stderr
