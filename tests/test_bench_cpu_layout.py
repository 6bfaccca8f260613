"""scripts/bench_cpu_layout.py: a bad --max-extra-gib is one line and exit 2 before any model loads or file is written."""

import sys
from pathlib import Path

import pytest

from draftsmith import models

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
