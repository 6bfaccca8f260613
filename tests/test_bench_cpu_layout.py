"""draftsmith bench cpu-layout: a bad --max-extra-gib or --without is one line and exit 2 before any model loads or
file is written; a run on a tiny model times every variant it names."""

import json

import pytest

from draftsmith import models
from draftsmith.app.cli import main
from draftsmith.testing import tiny_llama


@pytest.mark.parametrize(
    "flag, value, named",
    [
        *[("--max-extra-gib", v, v) for v in ("-1", "nan", "abc")],  # a room for copies that is not a size
        *[
            ("--without", v, "packed") for v in ("nosuch", "row", ",")
        ],  # names the kernels that can be left out
    ],
)
def test_bad_input_is_refused_before_any_work(flag, value, named, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "layout"
    assert main(["bench", "cpu-layout", flag, value, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert flag in err[-1] and named in err[-1]
    assert not out.exists()


def test_a_run_times_the_tuned_target_with_and_without_a_kernel(tmp_path, capsys):
    target = tmp_path / "tiny"
    tiny_llama(seed=0).save_pretrained(target)
    out = tmp_path / "layout"
    args = ["--target", str(target), "--context", "16", "--reps", "1", "--without", "packed,onednn"]
    assert main(["bench", "cpu-layout", *args, "--out", str(out)]) == 0
    res = json.loads((out / "layout.json").read_text())
    names = ["nn.Linear", "tuned", "tuned without onednn,packed"]
    assert list(res["forward_ms"]) == names and list(res["decode_tok_s"]) == names
    kernels = res["tune"]["tuned without onednn,packed"]["kernels"].values()
    assert not any("packed" in v or "onednn" in v for v in kernels)
    assert "tuned without onednn,packed" in capsys.readouterr().out
