"""Defects a new user hit by trying the CLI (issue 13, item 3): each one is refused with one `error:` line, exit 2,
before any compute and with nothing written."""

import json
import shutil

import pytest
import torch

from draftsmith.app.cli import main
from draftsmith.errors import DraftsmithError


def _prompts(tmp_path, n=3):
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": f"Write a short poem about the number {i}", "category": "text"} for i in range(n)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(f)


def _err(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1] if lines else ""


def _eval(tiny_dirs, tmp_path, *args):
    return main(
        [
            "eval",
            "--target",
            tiny_dirs["target"],
            "--prompts",
            _prompts(tmp_path),
            "--k",
            "2",
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
            "--no-progress",
            *args,
        ]
    )


def _no_decoding(monkeypatch):
    """Fail the test if eval gets as far as decoding (bad input must be refused before any compute)."""

    def boom(*a, **k):
        raise AssertionError("decoding ran before the bad input was refused")

    monkeypatch.setattr("draftsmith.app.evaluate.measure", boom)


# ---- --limit ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_eval_refuses_non_positive_limit(tiny_dirs, tmp_path, capsys, monkeypatch, limit):
    _no_decoding(monkeypatch)
    rc = _eval(tiny_dirs, tmp_path, "--drafter", "ngram:", "--limit", limit)
    err = _err(capsys)
    assert rc == 2 and err.startswith("error: ") and "limit" in err and ">= 1" in err


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_generate_refuses_non_positive_limit(tiny_dirs, tmp_path, capsys, limit):
    out = tmp_path / "gen"
    rc = main(
        ["generate", "--target", tiny_dirs["target"], "--prompts", _prompts(tmp_path), "--out", str(out)]
        + ["--limit", limit, "--max-new-tokens", "4"]
    )
    assert rc == 2 and "limit" in _err(capsys) and not out.exists()


def test_load_prompts_refuses_non_positive_limit(tmp_path):
    from draftsmith.prompts import load_prompts

    assert len(load_prompts(_prompts(tmp_path), limit=2)) == 2
    for bad in (0, -1):
        with pytest.raises(DraftsmithError, match="limit"):
            load_prompts(_prompts(tmp_path), limit=bad)


# ---- eval --out -------------------------------------------------------------------------------------------------


def test_eval_unwritable_out_is_refused_before_decoding(tiny_dirs, tmp_path, capsys, monkeypatch):
    _no_decoding(monkeypatch)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    rc = _eval(tiny_dirs, tmp_path, "--drafter", "ngram:", "--out", str(blocker / "ev"))
    err = _err(capsys)
    assert rc == 2 and err.startswith("error: ") and str(blocker) in err


def test_eval_refuses_to_overwrite_results_without_overwrite(tiny_dirs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "ev"
    out.mkdir()
    (out / "eval.json").write_text('{"old": true}\n')
    with monkeypatch.context() as m:
        _no_decoding(m)
        rc = _eval(tiny_dirs, tmp_path, "--drafter", "ngram:", "--out", str(out))
        err = _err(capsys)
    assert rc == 2 and "--overwrite" in err and json.loads((out / "eval.json").read_text()) == {"old": True}
    assert _eval(tiny_dirs, tmp_path, "--drafter", "ngram:", "--out", str(out), "--overwrite") == 0
    assert "tau" in json.loads((out / "eval.json").read_text())


# ---- draft:DIR,stop_below=P -------------------------------------------------------------------------------------


def test_eval_draft_with_stop_below_option(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "ev"
    rc = _eval(
        tiny_dirs, tmp_path, "--drafter", f"draft:{tiny_dirs['draft']},stop_below=0.3", "--out", str(out)
    )
    assert rc == 0, _err(capsys)
    assert json.loads((out / "eval.json").read_text())["conditions"]["drafter"].endswith(",stop_below=0.3")


# ---- broken head folders ----------------------------------------------------------------------------------------


@pytest.fixture
def medusa_head(tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from draftsmith.heads.io import save_head
    from draftsmith.heads.medusa.model import MedusaHeads

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"])
    return save_head(MedusaHeads.from_target(target, num_heads=2), tmp_path / "head")


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:300]),
        lambda d: (d / "model.safetensors").write_bytes(b""),
        lambda d: (d / "config.json").write_text('{"draftsmith_head_type": "medusa", "num_heads": '),
        lambda d: (d / "config.json").write_text('["not", "an", "object"]'),
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "num_heads": "two"})
        ),
    ],
    ids=["truncated-weights", "empty-weights", "truncated-config", "config-not-object", "config-bad-value"],
)
def test_broken_head_folder_is_one_error_line(
    tiny_dirs, tmp_path, capsys, monkeypatch, medusa_head, breakage
):
    from draftsmith.heads.io import load_head
    from draftsmith.testing import tiny_llama

    breakage(medusa_head)
    with pytest.raises(DraftsmithError, match=str(medusa_head)):
        load_head(medusa_head, tiny_llama(seed=0))
    _no_decoding(monkeypatch)
    rc = _eval(tiny_dirs, tmp_path, "--drafter", f"medusa:{medusa_head}")
    err = _err(capsys)
    assert rc == 2 and err.startswith("error: ") and str(medusa_head) in err


# ---- generate --skip-long ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [["--skip-long", "--max-new-tokens", "508"], ["--max-prompt-tokens", "2"]])
def test_generate_that_skips_every_prompt_is_an_error(tiny_dirs, tmp_path, capsys, skip):
    out = tmp_path / "gen"
    rc = main(
        [
            "generate",
            "--target",
            tiny_dirs["target"],
            "--prompts",
            _prompts(tmp_path),
            "--out",
            str(out),
            *skip,
        ]
    )
    err = _err(capsys)
    assert rc == 2 and err.startswith("error: ") and "skipped" in err and not out.exists()


# ---- --temperature nan, --device cuda without CUDA --------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_temperature_is_refused(tiny_dirs, tmp_path, capsys, monkeypatch, value):
    _no_decoding(monkeypatch)
    assert _eval(tiny_dirs, tmp_path, "--drafter", "ngram:", "--temperature", value) == 2
    assert "temperature" in _err(capsys)
    out = tmp_path / "gen"
    rc = main(
        ["generate", "--target", tiny_dirs["target"], "--prompts", _prompts(tmp_path), "--out", str(out)]
        + ["--temperature", value]
    )
    assert rc == 2 and "temperature" in _err(capsys) and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_device_cuda_without_cuda_is_one_error_line(tiny_dirs, tmp_path, capsys, monkeypatch):
    _no_decoding(monkeypatch)
    rc = main(
        ["eval", "--target", tiny_dirs["target"], "--prompts", _prompts(tmp_path), "--drafter", "ngram:"]
        + ["--device", "cuda", "--no-progress"]
    )
    err = _err(capsys)
    assert rc == 2 and err.startswith("error: ") and "cuda" in err.lower() and "--device cpu" in err
    out = tmp_path / "gen"
    rc = main(
        ["generate", "--target", tiny_dirs["target"], "--prompts", _prompts(tmp_path), "--out", str(out)]
        + ["--device", "cuda"]
    )
    assert rc == 2 and "--device cpu" in _err(capsys) and not out.exists()
    assert main(["eval", "--target", tiny_dirs["target"], "--drafter", "ngram:", "--device", "bogus:0"]) == 2
    assert "device" in _err(capsys)


# ---- the eval-set guard looks at content, not only at names ------------------------------------------------------


@pytest.fixture
def humaneval_copy(tmp_path):
    from draftsmith.prompts import BUILTIN, _data_path

    copy = tmp_path / "my_prompts.jsonl.gz"
    shutil.copy(_data_path(BUILTIN["humaneval"][0]), copy)
    return copy


def test_copy_of_an_eval_file_is_refused_for_generation(tiny_dirs, tmp_path, capsys, humaneval_copy):
    out = tmp_path / "gen"
    rc = main(
        ["generate", "--target", tiny_dirs["target"], "--prompts", str(humaneval_copy), "--out", str(out)]
    )
    err = _err(capsys)
    assert rc == 2 and "evaluation" in err and not out.exists()


def test_eval_prompts_inside_a_training_file_are_refused(tmp_path, tiny_tokenizer):
    from draftsmith.examples import examples_from_sources
    from draftsmith.prompts import is_eval_source, load_prompts

    ok = tmp_path / "train.jsonl"
    ok.write_text(json.dumps({"prompt": "Say hi", "response": "hi"}) + "\n")
    assert not is_eval_source(str(ok)) and examples_from_sources([str(ok)], tiny_tokenizer)
    vicuna = load_prompts("builtin:vicuna")[5]
    mixed = tmp_path / "mixed.jsonl"  # one Vicuna question, reformatted, among training rows
    rows = [{"prompt": "Say hi", "response": "hi"}, {"instruction": "  " + vicuna.text + "\n", "output": "x"}]
    mixed.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert is_eval_source(str(mixed))
    with pytest.raises(DraftsmithError, match="evaluation"):
        examples_from_sources([str(ok), str(mixed)], tiny_tokenizer)


def test_shipped_training_sets_share_no_prompt_with_the_eval_sets():
    from draftsmith.prompts import eval_prompt_overlap, load_prompts

    assert eval_prompt_overlap(load_prompts("builtin:train")) == 0
    assert eval_prompt_overlap(load_prompts("builtin:train-text")) == 0
    assert eval_prompt_overlap(load_prompts("builtin:humaneval")) == 164


# ---- push ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def pushable(tmp_path):
    """A Medusa head and an eval.json as `draftsmith eval` writes it when depths 2..4 were never reached."""
    from test_modelcard import EVAL

    from draftsmith.heads.io import save_head
    from draftsmith.heads.medusa.model import MedusaHeads
    from draftsmith.testing import tiny_llama

    head = save_head(MedusaHeads.from_target(tiny_llama(seed=0), num_heads=2), tmp_path / "run" / "final")
    ev = {**EVAL, "alpha_per_position": [0.61, None, None, None]}
    ev["per_category"] = {
        "writing": {"tau": 1.2, "speedup": None, "alpha_per_position": [0.6, None], "n_prompts": 1}
    }
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    return head, tmp_path / "eval.json"


def test_push_card_with_unreached_depths(pushable, tmp_path, capsys):
    from draftsmith.modelcard import parse_card

    head, ev = pushable
    staged = tmp_path / "staged"
    assert main(["push", str(head), "me/tiny-medusa", "--eval", str(ev), "--dry-run", str(staged)]) == 0, (
        _err(capsys)
    )
    card = (staged / "README.md").read_text()
    assert "0.610, n/a, n/a, n/a" in card
    alphas = [
        m
        for m in parse_card(card)["model-index"][0]["results"][0]["metrics"]
        if m["type"] == "acceptance_rate"
    ]
    assert [m["value"] for m in alphas] == [0.61]  # no number is invented for a depth never reached


def test_push_without_network_is_one_error_line(pushable, capsys, monkeypatch):
    from draftsmith import hub

    class ConnectError(Exception):  # what the Hub client raises without a network (its own class)
        pass

    class Offline:
        def __init__(self, token=None):
            pass

        def create_repo(self, **kw):
            raise ConnectError("[Errno 111] Connection refused")

    monkeypatch.setattr(hub, "HfApi", Offline)
    head, ev = pushable
    rc = main(["push", str(head), "me/tiny-medusa", "--eval", str(ev)])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2
        and len(err) == 1
        and err[0].startswith("error: could not push to me/tiny-medusa (ConnectError")
    )
    assert "--dry-run" in err[0]
