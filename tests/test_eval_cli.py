"""`draftsmith eval` end to end on tiny folders, and its one-line errors (exit 2)."""

import json

import pytest

from draftsmith.app.cli import main
from draftsmith.evalsettings import CONDITION_KEYS

KEYS = {
    "tau",
    "alpha_per_position",
    "accept_length_hist",
    "tokens_per_s",
    "speedup",
    "target_forwards",
    "draft_time_share",
    "lossless",
    "per_category",
    "conditions",
    "prompts",
}


def _prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "The quick brown fox jumps over the lazy dog. The quick", "category": "text"},
        {"prompt": "def add(a, b):\n    return a + b\n\nprint(add(", "category": "code"},
        {"prompt": "Write a short poem about the sea", "category": "text"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(f)


@pytest.mark.parametrize("drafter", ["draft", "ngram:max=2,min=1"])
def test_eval_end_to_end(tiny_dirs, tmp_path, capsys, drafter):
    spec = f"draft:{tiny_dirs['draft']}" if drafter == "draft" else drafter
    out = tmp_path / "ev"
    rc = main(
        [
            "eval",
            "--target",
            tiny_dirs["target"],
            "--drafter",
            spec,
            "--prompts",
            _prompts(tmp_path),
            "--k",
            "3",
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--no-progress",
        ]
    )
    assert rc == 0
    res = json.loads((out / "eval.json").read_text())
    assert KEYS <= set(res) and list(res["conditions"]) == list(CONDITION_KEYS)
    assert res["lossless"] is True and len(res["alpha_per_position"]) == 3
    assert res["lossless_detail"] == {"identical": 3, "near_tie": 0, "mismatch": 0}  # fp32: exact
    assert set(res["per_category"]) == {"text", "code"} and res["per_category"]["text"]["n_prompts"] == 2
    assert res["tau"] >= 1.0 and res["speedup"] > 0
    assert sum(res["accept_length_hist"].values()) == sum(len(r["accepted"]) for r in res["prompts"])
    assert (out / "eval.png").stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert "bonus" in md and "| code |" in md
    assert "tau" in capsys.readouterr().out


def test_evaluate_library_with_loaded_models(tiny_target, tiny_tokenizer, tmp_path):
    from draftsmith.app.evaluate import evaluate
    from draftsmith.evalsettings import EvalSettings
    from draftsmith.prompts import Prompt

    prompts = [Prompt([{"role": "user", "content": "hello there"}], category="a", id="0")]
    settings = EvalSettings(k=2, max_new_tokens=8, temperature=0.7, seed=1)
    res = evaluate(tiny_target, "ngram:", prompts, settings, tokenizer=tiny_tokenizer, progress=False)
    assert (
        res["lossless"] is None
        and res["conditions"]["temperature"] == 0.7
        and res["prompts"][0]["new_tokens"] <= 8
    )


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--drafter", "bogus:x"], "unknown drafter kind"),
        (["--drafter", "draft:/nonexistent/dir"], "not found"),
        (["--drafter", "draft"], "no kind"),
        (["--drafter", "ngram:", "--k", "0"], "k must be"),
        (["--drafter", "ngram:", "--temperature", "-1"], "temperature"),
        (["--drafter", "ngram:max=x"], "ngram option"),
    ],
)
def test_eval_bad_input_exit_2(tiny_dirs, tmp_path, capsys, args, msg):
    rc = main(
        ["eval", "--target", tiny_dirs["target"], "--prompts", _prompts(tmp_path), "--no-progress", *args]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: library progress bars
    assert rc == 2 and err.startswith("error: ") and msg in err


def test_eval_tokenizer_mismatch(tiny_dirs, tmp_path, capsys):
    from transformers import AutoTokenizer

    bad = tmp_path / "bad_draft"
    import shutil

    shutil.copytree(tiny_dirs["draft"], bad)
    tok = AutoTokenizer.from_pretrained(bad)
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(bad)
    rc = main(
        [
            "eval",
            "--target",
            tiny_dirs["target"],
            "--drafter",
            f"draft:{bad}",
            "--prompts",
            _prompts(tmp_path),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith("error: tokenizer mismatch")


def test_divergence_classifies_near_ties_and_real_mismatches(tiny_target):
    import torch

    from draftsmith.decode.evaluate import divergence, tie_tolerance

    prompt = torch.tensor([[1, 5, 9, 14]])
    with torch.no_grad():
        logits = tiny_target(input_ids=prompt).logits[0, -1].float()
    order = logits.argsort(descending=True).tolist()
    best, second, worst = order[0], order[1], order[-1]
    # identical prefix, different token at position 0: the runner-up is a tie only if rounding explains the gap
    gap = float(logits[best] - logits[second])
    res = divergence(tiny_target, prompt, [best, 3], [second, 3])
    assert res["position"] == 0 and res["plain_token"] == best and res["spec_token"] == second
    assert res["margin"] == pytest.approx(gap, abs=1e-5)
    assert res["near_tie"] == (gap <= tie_tolerance(torch.float32, logits))
    assert not divergence(tiny_target, prompt, [best], [worst])[
        "near_tie"
    ]  # a clear loser is a real mismatch
    assert not divergence(tiny_target, prompt, [best, 4], [best])["near_tie"]  # length-only difference
    assert divergence(tiny_target, prompt, [best, 4], [best])["position"] == 1
    # bf16 tolerance is ~65,000x fp32's
    assert tie_tolerance(torch.bfloat16, logits) / tie_tolerance(torch.float32, logits) == pytest.approx(
        2**16
    )


def test_default_dtype_policy(monkeypatch):
    import torch

    from draftsmith import models
    from draftsmith.errors import DraftsmithError

    monkeypatch.setenv("DRAFTSMITH_CPU_DTYPE", "bfloat16")
    assert models.default_dtype("cpu") == torch.bfloat16
    monkeypatch.setenv("DRAFTSMITH_CPU_DTYPE", "float32")
    assert models.default_dtype("cpu") == torch.float32
    monkeypatch.setenv("DRAFTSMITH_CPU_DTYPE", "")
    native = any(
        getattr(torch.cpu, n, lambda: False)()
        for n in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )
    assert models.default_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    # each probe alone decides: a CPU with AVX512-BF16 but no AMX tiles (AMD Zen 4) runs bf16, one with neither fp32
    for amx, avx512_bf16, expected in (
        (True, False, torch.bfloat16),
        (False, True, torch.bfloat16),
        (False, False, torch.float32),
    ):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        assert models.default_dtype("cpu") == expected
    monkeypatch.setenv("DRAFTSMITH_CPU_DTYPE", "int8")
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_CPU_DTYPE"):
        models.default_dtype("cpu")
