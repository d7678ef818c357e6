"""The wheel is complete and installs beside transformers: built from this
checkout, installed (not editable) into a clean venv with transformers and its
`kernels` package, and run from a directory outside the checkout."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from repo_paths import ROOT, SUPPORT

CSRC = ROOT / "conveyor" / "kernels" / "csrc"


def _constraints() -> list[str]:
    """The lock, as `make` passes it (`make test-latest` passes none)."""
    path = os.environ.get("CONVEYOR_CONSTRAINTS", str(ROOT / "constraints.txt"))
    return ["-c", path] if path else []


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert r.returncode == 0, f"{cmd[:6]}... exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)])
    (whl,) = out.glob("conveyor-*.whl")
    return whl


def test_the_wheel_installs_one_name_with_every_kernel_source(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"conveyor"}, tops
    for src in CSRC.iterdir():  # every .cpp and every header the .cpp files include
        assert f"conveyor/kernels/csrc/{src.name}" in names, src.name
    assets = ROOT / "conveyor" / "cluster" / "demo" / "assets"
    for asset in assets.iterdir():
        assert f"conveyor/cluster/demo/assets/{asset.name}" in names, asset.name
    demo_config = zipfile.ZipFile(wheel).read("conveyor/cluster/demo/tiny-cpu.yaml")
    assert demo_config == (ROOT / "configs" / "tiny-cpu.yaml").read_bytes()  # a file, not a link
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "conveyor = conveyor.cluster.cli.main:main" in entry


def test_the_installed_wheel_generates_beside_transformers(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = str(venv / "bin" / "python")
    # This pip installs into the new venv; torch first, so pip takes the local CPU build.
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", *_constraints()]
    _run([*pip, "torch==2.13.0"])
    _run([*pip, str(wheel), "transformers", "kernels"])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = shutil.copy(SUPPORT / "wheel_probe.py", outside)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")  # compile, do not reuse the checkout's
    r = _run([py, "-I", probe, str(outside)], cwd=outside, env=env)
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    site = str(venv / "lib")
    assert facts["conveyor"].startswith(site) and facts["csrc"].startswith(site), facts
    assert facts["kernels"].startswith(site) and "conveyor" not in facts["kernels"], facts
    assert tuple(int(x) for x in facts["transformers"].split(".")[:2]) >= (5, 25), facts
    assert facts["extension"].startswith(env["TORCH_EXTENSIONS_DIR"]) and facts["built_from_csrc"], facts
    assert facts["isa"] in ("avx512", "avx2", "portable"), facts
    assert facts["conveyor_tokens"] == facts["hf"] and len(facts["hf"]) == 8, facts
