"""scripts/gpu_check.sh end to end in its dry mode (tiny shapes on the CPU): it installs nothing here, collects the
gpu-marked tests, runs both benchmarks and writes one JSON + Markdown report. Bad arguments are refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def _run(*args, env_extra=None):
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow  # ~30 s: three Python processes (pytest collection, benchmarks) on tiny shapes
def test_gpu_check_dry_mode_end_to_end(tmp_path):
    out = tmp_path / "check"
    r = _run(str(out), "--dry", env_extra={"DRAFTSMITH_COMMIT": "abc1234"})  # a tree copied without .git
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["mode"] == "dry" and not rep.get("errors"), rep.get("errors")
    assert rep["commit"] == "abc1234" and "commit abc1234" in (out / "gpu_check.md").read_text()
    py = rep["pytest"]
    assert py["tests"] >= 10 and py["failures"] == 0 and py["errors"] == 0  # the gpu set is collected ...
    assert py["skipped"] == py["tests"]  # ... and skipped: no CUDA here
    assert set(rep["cost"]["forward_s"]) == {"eager", "compiled"} and rep["cost"]["drafters"]
    assert rep["train"]["eagle3"]["tokens_per_s"] > 0 and rep["train"]["distill"]["tokens_per_s"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "Dry mode" in md and "## Cost model" in md and "## Training throughput" in md


def test_gpu_check_refuses_bad_arguments(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    r = _run(str(full), "--dry")
    assert r.returncode == 2 and "not empty" in r.stderr and sorted(os.listdir(full)) == ["keep.txt"]
    r = _run(str(tmp_path / "new"), "--fast")
    assert r.returncode == 2 and "usage" in r.stderr and not (tmp_path / "new").exists()


def test_a_wheel_install_carries_every_package():
    """gpu_check installs draftsmith with `pip install --target` (a wheel, not editable): every folder with an
    __init__.py must be listed in pyproject's packages, or the bare machine gets a draftsmith without it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = SCRIPT.parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]
    found = set()
    for pkg, folder in dirs.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            found.add(".".join((pkg, *rel)))
    assert found == set(tool["packages"]), sorted(found ^ set(tool["packages"]))
