"""Bad drafter specs, kind/format mismatches and runs that could not be exported: one `error:` line, exit 2, before
any model loads or file is written; and eval.json records the draft depth that was used."""

from __future__ import annotations

import json
import re

import pytest
import torch

from draftsmith.app.cli import main
from draftsmith.app.drafters import DRAFTERS
from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_dirs):
    """One example folder of every kind with folders, made for the tiny target of tiny_dirs."""
    from draftsmith.models import load_model

    root = tmp_path_factory.mktemp("kinds")
    target = load_model(tiny_dirs["target"], device="cpu")
    out = {}
    for kind in ("medusa", "eagle", "eagle3", "dflash", "peagle", "earlyexit", "layerskip"):
        spec = DRAFTERS[kind].example(root, target)
        out[kind] = spec.partition(":")[2].partition(",")[0]
    return out


def _no_loading(monkeypatch):
    from draftsmith import models

    def refuse(*a, **k):
        raise AssertionError("a model or tokenizer was loaded before the spec was checked")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_tokenizer", refuse)


BAD_SPECS = [  # (spec with {kind} folders, --k, what the one line must say: a regex where it has a backslash)
    ("medusa:{medusa},depth=0", 4, "medusa option depth='0' is invalid: it must be <int >= 1>"),
    ("medusa:{medusa},total_tokens=-1", 4, "medusa option total_tokens='-1' is invalid"),
    ("medusa:{medusa},chain=2", 4, "medusa option chain='2' is invalid: it must be 0|1"),
    ("layerskip:{layerskip},reuse=7", 4, "layerskip option reuse='7' is invalid: it must be 0|1"),
    ("earlyexit:{earlyexit},reuse=7", 4, "earlyexit option reuse='7' is invalid"),
    (
        "earlyexit:{earlyexit},stop_below=1",
        4,
        "earlyexit option stop_below='1' is invalid: it must be <float >= 0 and < 1>",
    ),
    ("layerskip:{layerskip},stop_below=nan", 4, "stop_below='nan' is invalid"),
    ("peagle:{peagle},depth=0", 4, "peagle option depth='0' is invalid"),
    ("eagle:{eagle3},top_k=nan", 4, "eagle option top_k='nan' is invalid"),
    ("dflash:{dflash},total_tokens=0", 4, "dflash option total_tokens='0' is invalid"),
    ("ngram:max=0", 4, "ngram option max='0' is invalid"),
    ("draft:{eagle3},stop_below=-0.5", 4, "draft option stop_below='-0.5' is invalid"),
    # --k and depth= are one setting: a conflicting pair is refused, and so is a k the drafter cannot draft
    ("eagle:{eagle3},depth=2", 5, "depth=2 and --k 5 both set the draft depth"),
    ("earlyexit:{earlyexit},depth=3", 4, "depth=3 and --k 4 both set the draft depth"),
    ("medusa:{medusa}", 5, "drafts at most 4 tokens per step (4 heads) but --k is 5; pass --k 4 or less"),
    ("dflash:{dflash}", 5, "drafts at most 4 tokens per step (block_size 5"),
    ("peagle:{peagle}", 6, "drafts at most 4 tokens per step (4 depths per forward)"),
    # the folder's real kind is named
    (
        "eagle3:{dflash}",
        4,
        r"holds a DFlash-style block drafter \(dflash\), not what eagle3: decodes .* use --drafter dflash:",
    ),
    ("medusa:{eagle3}", 4, r"holds an EAGLE-3 head \(eagle3\).* use --drafter eagle3:"),
    ("draft:{earlyexit}", 4, r"holds a trained early-exit adapter \(earlyexit\).* use --drafter earlyexit:"),
    ("layerskip:{peagle}", 4, r"holds a P-EAGLE head \(peagle\).* use --drafter peagle:"),
    (
        "medusa2:{medusa}",
        4,
        "medusa2 is a training kind; its folders decode as medusa: use --drafter medusa:DIR",
    ),
]


@pytest.mark.parametrize("spec, k, says", BAD_SPECS, ids=[s for s, _, _ in BAD_SPECS])
def test_bad_specs_are_one_line_before_anything_loads(
    spec, k, says, folders, tiny_dirs, tmp_path, monkeypatch, capsys
):
    _no_loading(monkeypatch)
    out = tmp_path / "out"
    rc = main(["eval", "--target", tiny_dirs["target"], "--drafter", spec.format(**folders), "--k", str(k),
               "--out", str(out), "--limit", "1", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(says, err) if "\\" in says else says in err, err
    assert not out.exists()


def test_eval_json_records_the_depth_used(folders, tiny_dirs, tmp_path):
    from draftsmith.app.evaluate import evaluate
    from draftsmith.evalsettings import EvalSettings
    from draftsmith.prompts import Prompt

    prompts = [
        Prompt(messages=[{"role": "user", "content": "Tell me about the sea."}], category="chat", id="0")
    ]
    res = evaluate(tiny_dirs["target"], f"eagle:{folders['eagle3']},top_k=2,total_tokens=6", prompts,
                   EvalSettings(k=3, max_new_tokens=8), device="cpu", progress=False)  # fmt: skip
    cond = res["conditions"]
    assert cond["k"] == 3 and "depth=3" in cond["tree"], cond
    assert len(res["alpha_per_position"]) == 3


@pytest.mark.parametrize("kind, says", [
    ("earlyexit", r"holds a trained early-exit adapter \(earlyexit\), which cannot be exported as sglang-eagle3; no engine reads it yet: evaluate it with draftsmith eval --drafter earlyexit:"),
    ("layerskip", r"holds a layer-skip drafter .*\(layerskip\), which cannot be exported as sglang-eagle3; no engine"),
    ("eagle", r"holds an EAGLE-1 head \(eagle\), which cannot be exported as sglang-eagle3; no engine reads it yet"),
    ("dflash", r"holds a DFlash-style block drafter \(dflash\), which cannot be exported as sglang-eagle3; it exports to hf or sglang-dflash or speculators-dflash"),
])  # fmt: skip
def test_export_names_what_the_folder_is(kind, says, folders, tmp_path, capsys):
    rc = main(["export", folders[kind], "--format", "sglang-eagle3", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(says, err), err
    assert not (tmp_path / "x").exists()


# -- a run that trains to the end can be exported, or says at start that it cannot -----------------------------------
@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    from draftsmith.testing import save_tiny

    root = tmp_path_factory.mktemp("depths")
    return {n: str(save_tiny(root / f"t{n}", seed=0, num_hidden_layers=n)) for n in (2, 4, 6)}


def _cfg(target: str, *overrides: str):
    from draftsmith.heads.recipe import HeadsConfig

    return load_config(HeadsConfig, None, [f"model.target={target}", *overrides])


def test_explicit_aux_layers_no_engine_captures_are_refused_at_start(targets, tmp_path, monkeypatch):
    from draftsmith.heads.recipe import run_heads
    from draftsmith.trainer import make_accelerator

    _no_loading(monkeypatch)
    for kind in ("eagle3", "peagle", "dflash"):
        out = tmp_path / kind
        cfg = _cfg(targets[6], f"head.kind={kind}", "head.aux_layers=0,1,2", f"output_dir={out}")
        with pytest.raises(
            DraftsmithError,
            match=r"no engine format could export this .* head .* set head.aux_layers: null \(the default, \[2, 3, 4\]\)",
        ):
            run_heads(cfg, make_accelerator(cfg.train), progress=False)
        assert not out.exists() or not any(out.iterdir())


def test_default_aux_layers_of_small_targets_are_exportable(targets, tmp_path):
    from draftsmith.heads.recipe import check_exportable

    for n in (4, 6):
        for kind in ("eagle3", "peagle"):
            said: list[str] = []
            check_exportable(_cfg(targets[n], f"head.kind={kind}"), said.append)
            assert said == [], (n, kind, said)
    said = []
    check_exportable(
        _cfg(targets[2], "head.kind=eagle3"), said.append
    )  # no 3 capturable layers exist: say so
    assert len(said) == 1 and said[0].startswith(
        "warning: this eagle3 run will not export to sglang-eagle3, speculators"
    )
    said = []
    check_exportable(_cfg(targets[6], "head.kind=dflash", "head.draft_vocab_size=128"), said.append)
    assert len(said) == 1 and "will not export to sglang-dflash (" in said[0], said


def test_a_default_eagle3_head_of_a_4_layer_target_exports(targets, tmp_path):
    from draftsmith.app.export import export
    from draftsmith.heads import EagleHead, save_head
    from draftsmith.models import load_model

    target = load_model(targets[4], device="cpu")
    torch.manual_seed(0)
    head = EagleHead.from_target(target, "eagle3", draft_vocab_ids=torch.arange(0, 384, 3))
    assert head.config.aux_hidden_state_layer_ids == [1, 2, 3]
    save_head(head, tmp_path / "head")
    for fmt in ("sglang-eagle3", "speculators"):
        out = export(tmp_path / "head", fmt, tmp_path / fmt)
        assert json.loads((out / "draftsmith_export.json").read_text())["format"] == fmt
