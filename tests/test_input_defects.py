"""Bad inputs a new user hit (issue 22, items 1, 5 and 7), each through the real command line: ONE `error:` line,
exit status 2, before any model loads, with nothing written. scripts/probe_inputs.py runs the same kinds of case
(and more) as separate processes."""

from __future__ import annotations

import json

import pytest

from draftsmith.app.cli import main
from draftsmith.app.train import MAINS
from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError
from draftsmith.testing import folder_snapshot, refused_line


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory):
    from draftsmith.heads.io import save_head
    from draftsmith.heads.medusa.model import MedusaHeads
    from draftsmith.testing import tiny_llama

    root = tmp_path_factory.mktemp("head")
    return str(save_head(MedusaHeads.from_target(tiny_llama(seed=0), num_heads=2), root / "final"))


# ---- item 1: every command checks its output path first ----------------------------------------------------------

COMMANDS = {
    "generate": lambda d, out: ["generate", "--target", d["target"], "--out", out, "--limit", "1"],
    "layerskip": lambda d, out: ["layerskip", "--target", d["target"], "--out", out, "--limit", "1"],
    "export": lambda d, out: ["export", d["head"], "--format", "vllm-medusa", "--out", out],
    "push --dry-run": lambda d, out: ["push", d["head"], "me/tiny", "--no-results", "--dry-run", out],
    "quickstart": lambda d, out: ["quickstart", "--out", out, "--target", d["target"], "--fast"],
}
WHERE = {  # (the path given, what the message names)
    "under-a-file": (lambda tmp: str(tmp / "a_file" / "sub"), "is a file"),
    "a-file": (lambda tmp: str(tmp / "a_file"), "is a file"),
    "proc": (lambda tmp: "/proc/draftsmith-test", "cannot write"),
}


# an existing --out is refused as existing by these three; their --overwrite/--force case is tested below
EXISTING_REFUSED = {("layerskip", "a-file"), ("export", "a-file"), ("push --dry-run", "a-file")}


@pytest.mark.parametrize(
    "command,where",
    [(c, w) for c in sorted(COMMANDS) for w in sorted(WHERE) if (c, w) not in EXISTING_REFUSED],
)
def test_unusable_output_path_is_one_line_before_any_work(
    command, where, tiny_dirs, medusa_dir, tmp_path, capsys, no_model_loads
):
    (tmp_path / "a_file").write_text("not a folder\n")
    path, says = WHERE[where]
    before = folder_snapshot(tmp_path)
    argv = COMMANDS[command]({**tiny_dirs, "head": medusa_dir}, path(tmp_path))
    err = refused_line(capsys, main(argv), tmp_path, before)
    assert says in err


@pytest.mark.parametrize("trainer", ["distill", "heads"])
def test_train_output_dir_under_a_file_is_one_line_before_any_work(
    trainer, tiny_dirs, tmp_path, capsys, no_model_loads
):
    (tmp_path / "a_file").write_text("not a folder\n")
    before = folder_snapshot(tmp_path)
    argv = [f"model.target={tiny_dirs['target']}", f"output_dir={tmp_path / 'a_file' / 'run'}"]
    rc = MAINS[trainer](argv + (["head.kind=medusa"] if trainer == "heads" else []))
    assert "output_dir" in refused_line(capsys, rc, tmp_path, before)


# ---- item 5: numbers that are not numbers, records without their field, results that are not results -------------


@pytest.mark.parametrize(
    "override",
    ["train.lr=nan", "train.lr=inf", "train.lr=.inf", "train.max_steps=.inf", "loss.temperature=nan"],
)
def test_non_finite_config_numbers_are_refused_at_validation(override):
    from draftsmith.distill.recipe import DistillConfig
    from draftsmith.heads.recipe import HeadsConfig

    key = override.split("=")[0]
    for cls in (DistillConfig, HeadsConfig):
        with pytest.raises(DraftsmithError, match=rf"^{key}: expected"):
            load_config(cls, None, [override])
    assert load_config(DistillConfig, None, ["train.lr=3e-4", "train.max_steps=5"]).train.lr == 3e-4


def test_a_prompt_record_without_its_field_is_named_not_dropped(tiny_dirs, tmp_path, capsys, no_model_loads):
    from draftsmith.prompts import load_prompts

    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "Say hi"}, {"promt": "Say hello", "category": "x"}, {"prompt": "Count to 3"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DraftsmithError, match=r"record 2 has no prompt text.*promt"):
        load_prompts(str(f))
    out = tmp_path / "ev"
    before = folder_snapshot(tmp_path)
    rc = main(
        ["eval", "--target", tiny_dirs["target"], "--drafter", "ngram:", "--prompts", str(f)]
        + ["--out", str(out)]
    )
    assert "record 2" in refused_line(capsys, rc, tmp_path, before)


def test_a_training_pair_without_its_response_is_named_not_dropped(tmp_path, tiny_tokenizer):
    from draftsmith.examples import examples_from_file

    f = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "Say hi", "response": "hi"}, {"prompt": "Say hello"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DraftsmithError, match=r"record 2 has no response"):
        examples_from_file(f, tiny_tokenizer)


@pytest.mark.parametrize("key", ["tau", "speedup"])
@pytest.mark.parametrize("value", [float("nan"), None, float("inf")], ids=["nan", "null", "inf"])
def test_push_refuses_results_that_are_not_numbers(key, value, medusa_dir, tmp_path, capsys):
    from test_modelcard import EVAL

    (tmp_path / "eval.json").write_text(json.dumps({**EVAL, key: value}))  # NaN as json.dumps writes it
    before = folder_snapshot(tmp_path)
    staged = tmp_path / "staged"
    rc = main(
        ["push", medusa_dir, "me/tiny", "--eval", str(tmp_path / "eval.json"), "--dry-run", str(staged)]
    )
    err = refused_line(capsys, rc, tmp_path, before)
    assert key in err and "--no-results" in err


# ---- item 7: earlier results are replaced only when asked; a file never by a folder --------------------------------


def test_quickstart_rerun_into_results_needs_overwrite(tiny_dirs, tmp_path, capsys, no_model_loads):
    out = tmp_path / "qs"
    out.mkdir()
    (out / "quickstart.json").write_text('{"earlier": true}\n')
    before = folder_snapshot(tmp_path)
    rc = main(["quickstart", "--out", str(out), "--target", tiny_dirs["target"], "--fast"])
    assert "--overwrite" in refused_line(capsys, rc, tmp_path, before)


@pytest.mark.parametrize(
    "argv",
    [
        lambda d, f: ["layerskip", "--target", d["target"], "--out", f, "--overwrite", "--limit", "1"],
        lambda d, f: ["export", d["head"], "--format", "vllm-medusa", "--out", f, "--force"],
    ],
    ids=["layerskip --overwrite", "export --force"],
)
def test_overwrite_never_replaces_a_file_with_a_folder(
    argv, tiny_dirs, medusa_dir, tmp_path, capsys, no_model_loads
):
    (tmp_path / "a_file").write_text("keep me\n")
    before = folder_snapshot(tmp_path)
    rc = main(argv({**tiny_dirs, "head": medusa_dir}, str(tmp_path / "a_file")))
    assert "is a file" in refused_line(capsys, rc, tmp_path, before)
    assert (tmp_path / "a_file").read_text() == "keep me\n"
