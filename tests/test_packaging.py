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

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "dsv4_index")


def sh(args, cwd, env=None, timeout=240):
    p = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
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
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_dsv4_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(here)))
    rc, out = sh([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel],
                 cwd=tmp)
    assert rc == 0, out

    run_dir = tmp / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return {"wheel": wheel, "py": py, "env_dir": env_dir, "site": site, "cwd": run_dir, "env": env}


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
    assert not any(n.startswith(("models/", "tests/", "examples/")) for n in names)


def test_imports_from_the_wheel(installed):
    rc, out = sh([installed["py"], "-c", "import dsv4_index.config as c, dsv4_index as d; "
                  "print(d.__file__); print(c.shipped_config('pro')['num_hidden_layers'])"],
                 cwd=installed["cwd"], env=installed["env"])
    assert rc == 0, out
    path, layers = out.strip().splitlines()[-2:]
    assert Path(path).resolve().is_relative_to(installed["site"].resolve()), out
    assert not Path(path).resolve().is_relative_to(ROOT), out
    assert layers == "61"


def test_cli_layout_pro(installed):
    rc, out = sh([installed["py"], "-m", "dsv4_index", "layout", "--config", "pro"],
                 cwd=installed["cwd"], env=installed["env"])
    assert rc == 0, out
    assert "DSV4Layout(max_model_len=131072, layers=62, W=128, c4=4, c128=128, index_topk=1024)" in out, out
    for group in ("mla", "swa", "c4_state", "c128_state"):
        assert group in out, out
    script = installed["env_dir"] / ("Scripts/dsv4-index.exe" if os.name == "nt" else "bin/dsv4-index")
    rc, out = sh([script, "layout", "--config", "tiny"], cwd=installed["cwd"], env=installed["env"])
    assert rc == 0 and "layers=5" in out, out


def test_cli_demo(installed):
    env = dict(installed["env"])
    env.pop("TRITON_INTERPRET", None)          # CPU: the PyTorch reference path (the kernels have their tests)
    rc, out = sh([installed["py"], "-m", "dsv4_index", "demo"], cwd=installed["cwd"], env=env)
    assert rc == 0, out
    assert "DSV4Layout(max_model_len=131072, layers=44" in out, out
    assert "step: 4 requests" in out, out
    for channel in ("[c4a]", "[c4i]", "[c128a]", "[swa]"):
        assert channel in out, out
