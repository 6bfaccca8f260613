"""scripts/showcase.py --dry: every Qwen recipe validated with the output paths, the plan printed, nothing written."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import showcase  # noqa: E402


def test_dry_run_plans_every_recipe_and_drafter(tmp_path, capsys):
    out = tmp_path / "sc"
    assert showcase.main([str(out), "--dry"]) == 0
    text = capsys.readouterr().out
    recipes = sorted((ROOT / "recipes").glob("*qwen2.5-coder-1.5b-*.yaml"))
    assert len(recipes) >= 2 and all(f" {p.name} " in text for p in recipes)
    assert f"data.source={out / 'data' / 'gen'}" in text
    heads = sorted((ROOT / "recipes").glob("heads-qwen2.5-coder-1.5b-*.yaml"))
    assert (
        len(heads) == 5 and text.count(f"data.hidden_cache={out / 'data' / 'hidden'}") == 5
    )  # one shared cache
    for p in heads:
        assert f"bench {p.stem.removeprefix('heads-qwen2.5-coder-1.5b-')}:" in text
    for name in ("ngram", "draft-0.5b-as-is", "layerskip"):
        assert f"bench {name}:" in text
    # a full-vocabulary draft LM is benched again drafting from the data's 32k most frequent ids; the pruned draft
    # has its own reduced vocabulary and is not
    vocab = out / "vocab-32k"
    assert f"bench draft-0.5b-as-is-vocab32k: draft:qwen2.5-coder-0.5b,vocab={vocab} @ k=4" in text
    assert (
        f"bench draft-0.5b-lora-vocab32k: draft:{out / 'draft-0.5b-lora' / 'final'},vocab={vocab} @ k=4"
        in text
    )
    assert "draft-0.5b-pruned-vocab32k" not in text
    assert not out.exists()


def test_a_finished_showcase_is_not_measured_over(tmp_path):
    out = tmp_path / "sc"
    out.mkdir()
    (out / "showcase.json").write_text("{}")
    with pytest.raises(SystemExit, match="showcase.json exists"):
        showcase.main([str(out), "--skip", "draft-0.5b-lora", "--skip", "draft-0.5b-pruned"])
    assert sorted(p.name for p in out.iterdir()) == ["showcase.json"]


def test_skip_leaves_out_a_recipe_and_the_layer_skip_search(tmp_path, capsys):
    out = tmp_path / "sc"
    assert showcase.main([str(out), "--dry", "--skip", "draft-0.5b-lora", "--skip", "layerskip"]) == 0
    text = capsys.readouterr().out
    assert "bench draft-0.5b-pruned:" in text and "bench ngram:" in text
    assert "draft-0.5b-lora" not in text and "layerskip" not in text
    assert showcase.main([str(out), "--dry", "--skip", "draft-0.5b-as-is-vocab32k", "--skip", "ngram"]) == 0
    text = capsys.readouterr().out
    assert "bench draft-0.5b-as-is:" in text and "as-is-vocab32k" not in text and "bench ngram" not in text
