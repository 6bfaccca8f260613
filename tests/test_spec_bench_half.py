"""`shared:spec-bench-half`: the Spec-Bench evaluation prompts kept beside the checkout (../shared/data), loadable by
category and refused as training data like builtin:dev-eval. Skipped where the folder is absent (a clone without
shared/ beside it)."""

import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.prompts import SHARED, is_eval_source, load_prompts, shared_data_dir

HERE = shared_data_dir() / SHARED["spec-bench-half"]
needs_data = pytest.mark.skipif(
    not HERE.is_file(), reason=f"{HERE} is absent (shared/ not beside the checkout)"
)
CATEGORIES = {"translation", "summarization", "qa", "math_reasoning", "rag"}


@needs_data
def test_every_category_loads_and_one_alone():
    prompts = load_prompts("shared:spec-bench-half")
    cats = {}
    for p in prompts:
        cats[p.category] = cats.get(p.category, 0) + 1
    assert cats == dict.fromkeys(CATEGORIES, 40)
    rag = load_prompts("shared:spec-bench-half:rag")
    assert len(rag) == 40 and {p.category for p in rag} == {"rag"}
    assert [p.id for p in rag] == [p.id for p in prompts if p.category == "rag"]


@needs_data
def test_it_is_an_evaluation_set_by_name_and_by_content(tmp_path, tiny_tokenizer):
    from draftsmith.examples import examples_from_sources

    assert is_eval_source("shared:spec-bench-half") and is_eval_source(str(HERE))
    summary = load_prompts("shared:spec-bench-half:summarization")[3]
    copy = tmp_path / "train.jsonl"  # one of its prompts, reformatted, among training rows
    rows = [{"prompt": "Say hi", "response": "hi"}, {"instruction": " " + summary.text + "\n", "output": "x"}]
    copy.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert is_eval_source(str(copy))
    for source in ("shared:spec-bench-half", str(copy)):
        with pytest.raises(DraftsmithError, match="evaluation"):
            examples_from_sources([source], tiny_tokenizer)


def test_a_missing_folder_or_name_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_SHARED_DATA", str(tmp_path))
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_SHARED_DATA"):
        load_prompts("shared:spec-bench-half")
    with pytest.raises(DraftsmithError, match="spec-bench-half"):
        load_prompts("shared:no-such-set")
    assert is_eval_source("shared:spec-bench-half")  # by name, even where the file is absent


@needs_data
def test_bench_drafters_mixes_sources_and_reports_per_category(tiny_dirs, tmp_path, capsys):
    """`draftsmith bench drafters` with --prompts twice: the first N of each set, results per category, the
    adaptive draft length beside a fixed one."""
    from draftsmith.app.cli import main

    chat = tmp_path / "p.jsonl"
    chat.write_text(json.dumps({"prompt": "Hello there, the quick", "category": "vicuna"}) + "\n")
    out = tmp_path / "bench"
    argv = ["--target", tiny_dirs["target"], "--prompts", str(chat), "--prompts", "shared:spec-bench-half:qa",
            "--limit", "1", "--max-new-tokens", "6", "--drafter", f"d=draft:{tiny_dirs['draft']}@3",
            "--drafter", f"auto=draft:{tiny_dirs['draft']}@auto:3", "--out", str(out)]  # fmt: skip
    assert main(["bench", "drafters", *argv]) == 0
    result = json.loads((out / "bench.json").read_text())
    for name, row in result["drafters"].items():
        assert set(row["per_category"]) == {"vicuna", "qa"}, name
        assert all("speedup_decode" in c for c in row["per_category"].values())
        assert row["conditions"]["prompts"] == f"{chat}+shared:spec-bench-half:qa"
    assert (
        result["drafters"]["auto"]["k"] == "auto:3" and result["drafters"]["auto"]["k_policy"]["k_max"] == 3
    )
    assert result["drafters"]["d"]["k_policy"] is None
    printed = capsys.readouterr().out
    assert "| auto | qa | 1 |" in printed and "k auto:" in printed
