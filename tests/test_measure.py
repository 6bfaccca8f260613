"""One measurement path: `measure` with N named drafters, the settings object that writes eval.json's conditions,
and `draftsmith bench drafters` as a thin caller of both."""

import json

import pytest
import torch

from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.evaluate import NamedDrafter, measure
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer
from draftsmith.errors import DraftsmithError
from draftsmith.evalsettings import CONDITION_KEYS, RUN_KEYS, SETTING_KEYS, EvalSettings, conditions
from draftsmith.prompts import Prompt


def _prompts(n):
    return [Prompt([{"role": "user", "content": f"prompt {i}"}], category="c" if i % 2 else "d", id=str(i))
            for i in range(n)]  # fmt: skip


def test_measure_n_drafters_in_one_run(tiny_target, tiny_draft):
    """Every drafter and plain decoding decode every prompt; each drafter's result is lossless and counts its own
    steps; the warm-up is not counted; the same plain runs are the baseline of every drafter."""
    torch.manual_seed(0)
    encoded = [torch.randint(3, 380, (1, n)) for n in (5, 9, 7)]
    settings = EvalSettings(k=3, max_new_tokens=10)
    drafters = [
        NamedDrafter("draft", DraftModelProposer(tiny_draft, 384), 3),
        NamedDrafter("ngram", NGramProposer(2, 1), 2),
        NamedDrafter("self", DraftModelProposer(tiny_target, 384), 4),
    ]
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    calls = []
    real = dec.generate
    dec.generate = lambda ids, prop, **kw: calls.append((prop, kw["max_new_tokens"])) or real(ids, prop, **kw)
    out = measure(dec, drafters, _prompts(3), encoded, settings, progress=False)
    assert len(calls) == 4 + 3 * 4  # warm-up of every method, then every prompt with every method
    assert [n for _, n in calls[:4]] == [10] * 4 and all(n == 10 for _, n in calls[4:])
    # the order rotates per prompt: plain first, then the first drafter first, ...
    firsts = [calls[4 + 4 * i][0] for i in range(3)]
    assert firsts == [None, drafters[0].proposer, drafters[1].proposer]
    assert set(out["drafters"]) == {"draft", "ngram", "self"} and out["plain"]["new_tokens"] == 30
    for name, r in out["drafters"].items():
        assert r["lossless"] is True and r["lossless_detail"]["identical"] == 3, name
        assert (
            len(r["prompts"]) == 3
            and len(r["alpha_per_position"]) == {"draft": 3, "ngram": 2, "self": 4}[name]
        )
        assert r["tokens_per_s"]["plain"] == pytest.approx(out["plain"]["tokens_per_s"])
    # the target as its own draft accepts everything it proposes
    assert out["drafters"]["self"]["alpha_per_position"][0] == 1.0
    with pytest.raises(ValueError, match="unique"):
        measure(dec, [drafters[0], drafters[0]], _prompts(3), encoded, settings, progress=False)


def test_settings_validate_and_write_every_condition_once():
    with pytest.raises(DraftsmithError, match="k must be"):
        EvalSettings(k=0)
    with pytest.raises(DraftsmithError, match="max_new_tokens"):
        EvalSettings(max_new_tokens=0)
    with pytest.raises(DraftsmithError, match="top_p"):
        EvalSettings(top_p=0.0)
    with pytest.raises(DraftsmithError, match="--limit"):
        EvalSettings(limit=0)
    s = EvalSettings(k=3, temperature=0.5, max_new_tokens=7)
    assert s.params.temperature == 0.5 and s.with_k(2).k == 2 and s.with_k(2).max_new_tokens == 7
    run = {key: f"<{key}>" for key in RUN_KEYS}
    c = conditions(s, **run)
    assert list(c) == list(CONDITION_KEYS) and set(SETTING_KEYS) <= set(c)
    assert c["k"] == 3 and c["temperature"] == 0.5 and c["target"] == "<target>"  # recorded as used
    with pytest.raises(TypeError, match="missing"):
        conditions(s, **{k: v for k, v in run.items() if k != "dtype"})


def test_bench_drafters_is_a_thin_caller(tiny_dirs, tmp_path, capsys):
    from draftsmith.app import costbench
    from draftsmith.app.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p, "category": c}) for p, c in
                  [("def f(a):\n    return a", "humaneval"), ("Hello there, the quick", "vicuna")]) + "\n"
    )  # fmt: skip
    out, prof = tmp_path / "bench", tmp_path / "profiles"
    argv = ["--target", tiny_dirs["target"], "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "6",
            "--drafter", f"d=draft:{tiny_dirs['draft']}@3", "--drafter", "n=ngram:max=2@2",
            "--out", str(out), "--profiles-out", str(prof), "--flops"]  # fmt: skip
    assert main(["bench", "drafters", *argv]) == 0
    res = json.loads((out / "bench.json").read_text())
    assert set(res["drafters"]) == {"d", "n"} and (out / "bench.png").stat().st_size > 1000
    for name, r in res["drafters"].items():
        assert r["lossless"] is True and set(r["tau_by_group"]) == {"chat", "humaneval"}
        assert (
            list(r["conditions"]) == list(CONDITION_KEYS) and r["conditions"]["k"] == {"d": 3, "n": 2}[name]
        )
        p = costbench.load_profile(prof / f"{name}.json")  # the cost model reads what the bench measured
        assert p["name"] == name and p["k"] == r["k"] and p["tau"] == r["tau"]
    assert res["drafters"]["d"]["draft_flop_share"] > 0.2 and res["drafters"]["n"]["draft_flop_share"] == 0.0
    assert (
        0.2 < res["drafters"]["d"]["draft_weight_share"] < 1
        and res["drafters"]["n"]["draft_weight_share"] == 0.0
    )
    table = capsys.readouterr().out
    assert (
        "| d | 3 |" in table and "| draft cost / target step | its weight share | its FLOP share |" in table
    )
    # bad input: one line, exit 2, nothing loaded or written
    for bad, msg in (
        (["--drafter", "x=bogus:1@2"], "unknown drafter kind"),
        (["--drafter", "x=ngram:"], "NAME=SPEC@K"),
    ):
        assert (
            main(["bench", "drafters", "--target", tiny_dirs["target"], "--out", str(tmp_path / "o2"), *bad])
            == 2
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0]
    assert not (tmp_path / "o2").exists()
