"""scripts/bench_cpu_layout.py: a bad --max-extra-gib or --without is one line and exit 2 before any model loads or
file is written; a run on a tiny model times every variant it names."""

import json
import sys
from pathlib import Path

import pytest

from draftsmith import models
from draftsmith.testing import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_cpu_layout  # noqa: E402


@pytest.mark.parametrize("value", ["-1", "nan", "abc"])
def test_bad_room_for_copies_is_refused_before_any_work(value, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "layout"
    with pytest.raises(SystemExit) as exc:
        bench_cpu_layout.main(["--max-extra-gib", value, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--max-extra-gib" in err[-1] and value in err[-1]
    assert not out.exists()


@pytest.mark.parametrize("value", ["nosuch", "row", ","])
def test_bad_kernel_to_leave_out_is_refused_before_any_work(value, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "layout"
    with pytest.raises(SystemExit) as exc:
        bench_cpu_layout.main(["--without", value, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--without" in err[-1] and "packed" in err[-1]  # names the kernels that can be left out
    assert not out.exists()


def test_a_run_times_the_tuned_target_with_and_without_a_kernel(tmp_path, capsys):
    target = tmp_path / "tiny"
    tiny_llama(seed=0).save_pretrained(target)
    out = tmp_path / "layout"
    args = ["--target", str(target), "--context", "16", "--reps", "1", "--without", "packed,onednn"]
    assert bench_cpu_layout.main([*args, "--out", str(out)]) == 0
    res = json.loads((out / "layout.json").read_text())
    names = ["nn.Linear", "tuned", "tuned without onednn,packed"]
    assert list(res["forward_ms"]) == names and list(res["decode_tok_s"]) == names
    kernels = res["tune"]["tuned without onednn,packed"]["kernels"].values()
    assert not any("packed" in v or "onednn" in v for v in kernels)
    assert "tuned without onednn,packed" in capsys.readouterr().out
