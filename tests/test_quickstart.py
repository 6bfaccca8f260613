import json

import pytest

from draftsmith.app.plan import (
    SAFETY,
    DataShape,
    MachineCosts,
    check_budget,
    expected_max,
    minimal,
    plan_quickstart,
    predict,
    scaled,
)
from draftsmith.app.quickstart import FAST, FULL, QuickstartSizes, quickstart
from draftsmith.errors import DraftsmithError


def test_quickstart_end_to_end_on_tiny_target(tiny_dirs, tmp_path, capsys, recwarn):
    sizes = QuickstartSizes(
        train_prompts=12,
        text_examples=8,
        dev_prompts=2,
        max_new_tokens=8,
        steps=3,
        batch_size=4,
        lr=1e-3,
        layers=[0],
        vocab_size=96,
        eval_prompts=2,
        eval_max_new_tokens=8,
    )
    res = quickstart(tmp_path / "qs", target=tiny_dirs["target"], sizes=sizes, progress=False)
    out = capsys.readouterr().out
    assert "[0/4]" in out and "[1/4]" in out and "[4/4]" in out and "tau(k=4)" in out
    # the plan (given sizes: predicted only) is printed before any data is generated
    assert out.index("plan (given sizes)") < out.index("[1/4]") and "predicted minutes" in out
    saved = json.loads((tmp_path / "qs" / "quickstart.json").read_text())
    assert set(saved["plan"]["predicted_s"]) == {"generate", "score", "train", "evals", "decoder_eval"}
    assert saved["costs"]["train_tok_s"] > 0 and saved["costs"]["forward_s"]["5"] > 0
    if saved["measured"]["speedup"] < 1:  # slower than plain decoding: the run says why, from its own costs
        assert saved["why_slower"] and "why slower" in out
    before, after = saved["predicted"]["before"], saved["predicted"]["after"]
    assert before["n_tokens"] == after["n_tokens"] > 0  # the same dev-eval answers scored before and after
    assert saved["predicted"]["tau_k4_ratio"] == pytest.approx(
        after["tau_greedy"]["4"] / before["tau_greedy"]["4"]
    )
    assert saved["train_tokens_per_s"] > 0 and res["timings"]["total_s"] > 0
    # the decoder eval ran on the distilled draft: lossless greedy output, tau >= 1 (bonus token included)
    assert saved["measured"]["lossless"] is True and saved["measured"]["tau"] >= 1.0
    assert (tmp_path / "qs" / "eval" / "eval.json").is_file()
    # no deprecated forward arguments (transformers 5.24 warns about past_key_values= on every such call)
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]
    # dev-eval reference answers are for measuring only: the trainer refuses them as data
    from draftsmith.errors import DraftsmithError
    from draftsmith.examples import examples_from_generated

    with pytest.raises(DraftsmithError, match="evaluation prompts"):
        examples_from_generated(tmp_path / "qs" / "data" / "dev-eval")
    # rerunning (--overwrite) reuses the generated data (resumable), retrains and says what it replaces
    capsys.readouterr()
    quickstart(
        tmp_path / "qs",
        target=tiny_dirs["target"],
        sizes=sizes,
        progress=False,
        run_decoder_eval=False,
        overwrite=True,
    )
    assert "replacing the earlier quickstart.json, distill/ in" in capsys.readouterr().out
    man = json.loads((tmp_path / "qs" / "data" / "train" / "manifest.json").read_text())
    assert man["n_rows"] == len(
        {r["id"] for r in map(json.loads, (tmp_path / "qs" / "data" / "train" / "shard-00000.jsonl").open())}
    )


def test_quickstart_sizes_are_consistent():
    for s in (FAST, FULL):
        assert s.steps > 0 and s.vocab_size > 0 and s.layers == sorted(set(s.layers))
    assert FULL.train_prompts > FAST.train_prompts and FULL.steps > FAST.steps


# --- the budget planner: a pure function of measured costs --------------------------------------------------------

# builtin:train prompts (a few above the 160-token cut), text pairs (mean ~180 tokens, a few ~500), dev-eval prompts
SHAPE = DataShape(
    train_prompt_lens=[30 + (i * 37) % 170 for i in range(400)],
    text_lens=[60 + (i * 53) % 240 + (200 if i % 50 == 0 else 0) for i in range(2000)],
    vicuna_lens=[40 + i % 29 for i in range(40)],
    humaneval_lens=[100 + (i * 31) % 300 for i in range(80)],
)
# rates of the kind calibrate.measure_costs returns: a 2-core CPU with AMX in bf16, one without in fp32 (AVX-512),
# and one 2.5x slower again (no AVX-512)
FWD_BF16 = {1: 0.037, 2: 0.038, 3: 0.039, 5: 0.041, 9: 0.045}
FWD_FP32 = {1: 0.035, 2: 0.045, 3: 0.05, 5: 0.057, 9: 0.072}
AMX = MachineCosts(3700, 0.06, 3000, 2000, 0.004, FWD_BF16, 0.003, 1.0)
FP32 = MachineCosts(860, 0.15, 800, 900, 0.005, FWD_FP32, 0.003, 1.0)
SLOW = FP32.slowed(2.5)
LOADED = 30.0  # seconds spent loading and measuring before the plan


def _total(costs, sizes, elapsed=LOADED):
    return elapsed + sum(predict(costs, SHAPE, sizes).values())


@pytest.mark.parametrize("costs", [AMX, FP32, SLOW], ids=["amx-bf16", "avx512-fp32", "slow-fp32"])
@pytest.mark.parametrize("budget_min", [10, 15, 40])
def test_plan_fits_the_budget_and_is_the_largest_that_does(costs, budget_min):
    budget = 60 * budget_min
    plan = plan_quickstart(costs, SHAPE, budget, LOADED)
    assert plan.total_s == pytest.approx(_total(costs, plan.sizes))
    assert plan.total_s <= LOADED + SAFETY * (budget - LOADED)
    if plan.scale < 1:  # a slightly larger plan would not have fit
        assert _total(costs, scaled(FULL, plan.scale + 0.02)) > LOADED + SAFETY * (budget - LOADED)
    # steps follow the data (the same ~0.83 epochs as the full quickstart), the eval stays whole
    s = plan.sizes
    assert s.steps == round(
        FULL.steps * (s.train_prompts + s.text_examples) / (FULL.train_prompts + FULL.text_examples)
    )
    if plan.note.startswith("minimal plan"):  # 10 min on the slowest machine: the smallest plan
        assert s == minimal(FULL) and (costs, budget_min) == (SLOW, 10)
    else:
        assert (s.dev_prompts, s.eval_prompts) == (FULL.dev_prompts, FULL.eval_prompts)


def test_plan_shrinks_with_the_machine_and_keeps_the_full_quickstart_where_it_fits():
    amx, fp32, slow = (plan_quickstart(c, SHAPE, 15 * 60, LOADED) for c in (AMX, FP32, SLOW))
    assert amx.sizes == FULL and amx.scale == 1.0 and "full quickstart fits" in amx.note
    assert 1.0 > fp32.scale > slow.scale >= 0.1
    assert fp32.sizes.text_examples > slow.sizes.text_examples and fp32.sizes.steps > slow.sizes.steps
    # the plan is printed as sizes + predicted minutes per phase
    lines = fp32.lines()
    assert f"{fp32.sizes.text_examples} builtin:train-text pairs" in lines[0] and "15-min budget" in lines[1]


def test_tiny_budget_is_refused_in_one_line_naming_a_budget_that_works():
    with pytest.raises(DraftsmithError) as e:
        plan_quickstart(SLOW, SHAPE, 3 * 60, LOADED)
    msg = str(e.value)
    assert "\n" not in msg and "too small" in msg and "--budget-min" in msg
    need = int(msg.rsplit("--budget-min ", 1)[1].split()[0])
    plan = plan_quickstart(SLOW, SHAPE, need * 60, LOADED)  # the budget it names is enough
    assert plan.total_s <= need * 60


def test_between_minimal_and_smallest_full_eval_plan_the_minimal_plan_is_explained():
    t_small = _total(FP32, scaled(FULL, 0.1), 0.0)
    t_min = _total(FP32, minimal(FULL), 0.0)
    assert t_min < t_small
    budget = LOADED + (t_min + t_small) / 2 / SAFETY
    plan = plan_quickstart(FP32, SHAPE, budget, LOADED)
    assert plan.sizes == minimal(FULL) and plan.note.startswith("minimal plan")
    assert plan.sizes.eval_prompts < FULL.eval_prompts and "minimal plan" in plan.lines()[1]


def test_replan_after_slow_generation_keeps_the_answers_and_shrinks_text_and_steps():
    first = plan_quickstart(FP32, SHAPE, 15 * 60, LOADED)
    elapsed = LOADED + 2.0 * first.phases["generate"]  # generation ran 2x slower than measured
    again = plan_quickstart(
        FP32.slowed(2.0), SHAPE, 15 * 60, elapsed, max_scale=first.scale, generated=first.sizes.train_prompts
    )
    assert again.sizes.train_prompts == first.sizes.train_prompts and again.phases["generate"] == 0.0
    assert again.sizes.text_examples < first.sizes.text_examples and again.sizes.steps < first.sizes.steps
    assert again.total_s <= elapsed + SAFETY * (15 * 60 - elapsed)


def test_expected_padded_width():
    assert expected_max([1, 2], 2) == pytest.approx(1 * 0.25 + 2 * 0.75)
    assert expected_max([5] * 10, 8) == pytest.approx(5.0)
    assert expected_max(list(range(1, 101)), 8) > 85


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "inf", "abc", "", "100000"])
def test_bad_budget_is_refused_before_anything_runs(bad, tmp_path, capsys):
    from draftsmith.app.cli import main

    with pytest.raises(DraftsmithError, match="--budget-min"):
        check_budget(bad)
    assert main(["quickstart", "--budget-min", bad, "--out", str(tmp_path / "qs")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --budget-min") and "\n" not in err
    assert not (tmp_path / "qs").exists()  # nothing written
    assert check_budget("7.5") == 7.5 and check_budget(15) == 15.0


def test_replan_after_slow_generation_rescales_by_a_fresh_measurement(monkeypatch, capsys):
    """Generation overran its prediction: the re-plan re-measures target scoring, so a machine that got slower
    shrinks the rest more than one whose generation was merely mispredicted; the prompts already answered stay."""
    import draftsmith.app.calibrate as calibrate
    from draftsmith.app.calibrate import replan as _replan

    first = plan_quickstart(FP32, SHAPE, 15 * 60, LOADED)
    gen_s = 1.5 * first.phases["generate"]
    elapsed = LOADED + gen_s
    on_time = _replan(first, FP32, SHAPE, 1.05 * first.phases["generate"], 15 * 60, elapsed, True, None)
    assert on_time is first  # within 10% of the prediction: no re-plan
    monkeypatch.setattr(calibrate, "score_rate", lambda model: FP32.score_tok_s)  # same speed as at the start
    mispredicted = _replan(first, FP32, SHAPE, gen_s, 15 * 60, elapsed, True, None)
    monkeypatch.setattr(calibrate, "score_rate", lambda model: FP32.score_tok_s / 2)  # twice slower now
    slower = _replan(first, FP32, SHAPE, gen_s, 15 * 60, elapsed, True, None)
    for p in (mispredicted, slower):
        assert p.sizes.train_prompts == first.sizes.train_prompts and p.total_s <= 15 * 60
    assert first.sizes.text_examples >= mispredicted.sizes.text_examples > slower.sizes.text_examples
    assert "2.00x slower" in capsys.readouterr().out
