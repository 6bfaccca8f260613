"""`draftsmith push`: dry-run folder, upload at the HfApi boundary (mocked, no network), token hygiene, refusals."""

import json
import logging

import pytest
from test_modelcard import EVAL

from draftsmith import hub
from draftsmith.app.drafters import DRAFTERS
from draftsmith.errors import DraftsmithError
from draftsmith.modelcard import parse_card

TOKEN = "hf_SeCrEtToKeN0123456789abcdef"


@pytest.fixture
def run_dir(tmp_path):
    """A training run: run.yaml, eval/eval.json + report.md, final/ with a Medusa head (+ a pickle to skip)."""
    from draftsmith.heads.io import save_head
    from draftsmith.heads.medusa.model import MedusaHeads
    from draftsmith.testing import tiny_llama

    run = tmp_path / "run"
    save_head(MedusaHeads.from_target(tiny_llama(seed=0), num_heads=2), run / "final")
    (run / "final" / "optimizer.pt").write_bytes(b"pickle")
    (run / "run.yaml").write_text("recipe: medusa\noptim:\n  lr: 0.001\n")
    (run / "eval").mkdir()
    (run / "eval" / "eval.json").write_text(json.dumps(EVAL))
    (run / "eval" / "report.md").write_text("# report\n")
    return run


class FakeApi:
    calls: list = []

    def __init__(self, token=None):
        FakeApi.calls.append(("init", token))

    def create_repo(self, **kw):
        FakeApi.calls.append(("create_repo", kw))

    def upload_folder(self, **kw):
        from pathlib import Path

        folder = Path(kw["folder_path"])
        files = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        FakeApi.calls.append(("upload_folder", kw, files))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{kw['repo_id']}/commit/abc"})()


@pytest.fixture
def fake_api(monkeypatch):
    FakeApi.calls = []
    monkeypatch.setattr(hub, "HfApi", FakeApi)
    return FakeApi


def test_dry_run_folder_is_what_would_be_uploaded(run_dir, tmp_path, fake_api):
    dest = tmp_path / "staged"
    where = hub.push_to_hub(
        run_dir / "final", "me/tiny-medusa", dry_run_dir=dest, token=TOKEN, kinds=DRAFTERS
    )
    assert where == str(dest) and fake_api.calls == []  # nothing uploaded
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert files == [
        "README.md",
        "config.json",
        "eval/eval.json",
        "eval/report.md",
        "model.safetensors",
        "run.yaml",
    ]
    card = parse_card((dest / "README.md").read_text())
    assert card["model-index"][0]["results"][0]["metrics"][0]["value"] == EVAL["tau"]
    assert json.loads((dest / "eval" / "eval.json").read_text()) == EVAL
    assert "lr: 0.001" in (dest / "README.md").read_text()


def test_upload_goes_through_hfapi_and_never_writes_the_token(
    run_dir, tmp_path, fake_api, caplog, monkeypatch
):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    url = hub.push_to_hub(
        run_dir / "final",
        "me/tiny-medusa",
        private=True,
        eval_json=run_dir / "eval" / "eval.json",
        token=TOKEN,
        kinds=DRAFTERS,
    )
    assert url.endswith("/commit/abc")
    init, create, upload = fake_api.calls
    assert init == ("init", TOKEN)
    assert create[1] == {"repo_id": "me/tiny-medusa", "repo_type": "model", "private": True, "exist_ok": True}
    assert upload[1]["repo_id"] == "me/tiny-medusa"
    uploaded = upload[2]
    assert {"README.md", "config.json", "model.safetensors", "eval/eval.json", "run.yaml"} <= set(uploaded)
    assert "optimizer.pt" not in uploaded  # pickles are never published
    assert all(TOKEN.encode() not in data for data in uploaded.values())
    assert TOKEN not in caplog.text
    assert not any(TOKEN.encode() in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())


@pytest.mark.parametrize("repo_id", ["no-namespace", "me/bad name", "me/x/y", "me/--bad--", ""])
def test_malformed_repo_id_is_refused_before_anything(run_dir, fake_api, repo_id):
    with pytest.raises(DraftsmithError, match="invalid repo id"):
        hub.push_to_hub(run_dir / "final", repo_id, kinds=DRAFTERS)
    assert fake_api.calls == []


def test_refusals_upload_nothing(run_dir, tmp_path, fake_api):
    (run_dir / "eval" / "eval.json").unlink()
    with pytest.raises(DraftsmithError, match="no eval.json given or found"):
        hub.push_to_hub(run_dir / "final", "me/x", kinds=DRAFTERS)
    with pytest.raises(DraftsmithError, match="not found"):
        hub.push_to_hub(tmp_path / "missing", "me/x", require_results=False, kinds=DRAFTERS)
    with pytest.raises(DraftsmithError, match="eval JSON .* not found"):
        hub.push_to_hub(run_dir / "final", "me/x", eval_json=tmp_path / "nope.json", kinds=DRAFTERS)
    (run_dir / "final" / "notes.txt").write_text(f"token={TOKEN}\n")
    with pytest.raises(DraftsmithError, match="notes.txt contains your Hub token"):
        hub.push_to_hub(run_dir / "final", "me/x", require_results=False, token=TOKEN, kinds=DRAFTERS)
    (run_dir / "final" / "notes.txt").unlink()
    cfg = json.loads((run_dir / "final" / "config.json").read_text())
    (run_dir / "final" / "config.json").write_text(json.dumps({**cfg, "num_heads": 3}))  # tensors for 2 heads
    with pytest.raises(DraftsmithError, match="missing"):
        hub.push_to_hub(run_dir / "final", "me/x", require_results=False, kinds=DRAFTERS)
    assert fake_api.calls == []


def test_no_results_card_and_cli(run_dir, tmp_path, fake_api, monkeypatch, capsys):
    from draftsmith.app.cli import main

    dest = tmp_path / "staged"
    monkeypatch.setenv("MY_HUB_TOKEN", TOKEN)
    assert (
        main(
            [
                "push",
                str(run_dir / "final"),
                "me/tiny",
                "--dry-run",
                str(dest),
                "--no-results",
                "--token-env",
                "MY_HUB_TOKEN",
            ]
        )
        == 0
    )
    assert "model-index" not in parse_card((dest / "README.md").read_text()) and not (dest / "eval").exists()
    assert TOKEN not in capsys.readouterr().out
    assert main(["push", str(run_dir / "final"), "me/tiny", "--token-env", "UNSET_VAR_XYZ"]) == 2
    assert "UNSET_VAR_XYZ is not set" in capsys.readouterr().err
    assert fake_api.calls == []
