import json
from dataclasses import replace

import pytest

from draftsmith.app.plan import (
    DISTILL_MIN_SCALE,
    SAFETY,
    DataShape,
    MachineCosts,
    check_budget,
    expected_max,
    head_draft,
    minimal,
    plan_quickstart,
    predict,
    scaled,
    without_distill,
)
from draftsmith.app.quickstart import FAST, FULL, QuickstartSizes, quickstart
from draftsmith.errors import DraftsmithError

TINY = QuickstartSizes(
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
    head_steps=3,
    head_text_examples=8,
    head_batch_size=4,
    head_vocab_size=96,
)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_quickstart_end_to_end_on_tiny_target(tiny_dirs, tmp_path, capsys, recwarn):
    """Both drafters: the EAGLE-3 head and the distilled draft are trained on the same answers, each is measured
    against plain decoding, and the best of them is reported with both drafters' numbers kept."""
    res = quickstart(tmp_path / "qs", target=tiny_dirs["target"], sizes=TINY, progress=False)
    out = capsys.readouterr().out
    assert "[0/4]" in out and "[1/4]" in out and "[4/4]" in out and "tau(k=4)" in out
    # the plan (given sizes: predicted only) is printed before any data is generated, naming both drafters
    assert out.index("plan (given sizes)") < out.index("[1/4]") and "predicted minutes" in out
    assert "EAGLE-3 head 3 steps x 4" in out and "distilled draft 3 steps x 4" in out
    saved = json.loads((tmp_path / "qs" / "quickstart.json").read_text())
    assert set(saved["plan"]["predicted_s"]) == {
        "generate", "head_train", "head_decoder_eval", "score", "train", "evals", "decoder_eval"
    }  # fmt: skip
    assert saved["plan"]["predicted_s"]["head_train"] > 0 and saved["plan"]["predicted_s"]["train"] > 0
    costs = saved["costs"]
    assert costs["train_tok_s"] > 0 and costs["forward_s"]["5"] > 0
    assert costs["head_train_tok_s"] > 0 and costs["head_step_s"] > 0
    assert set(saved["drafters"]) == {"eagle3", "distill"}
    head, draft = saved["drafters"]["eagle3"], saved["drafters"]["distill"]

    # the head: trained for the planned steps on the answers + text pairs (never dev-eval), evaluated, measured
    events = _lines(tmp_path / "qs" / "eagle3" / "metrics.jsonl")
    assert max(e["step"] for e in events if e["event"] == "train") == TINY.head_steps
    run_yaml = (tmp_path / "qs" / "eagle3" / "run.yaml").read_text()
    assert "data/train" in run_yaml and "builtin:train-text" in run_yaml and "dev-eval" not in run_yaml
    assert (tmp_path / "qs" / "eagle3" / "final" / "model.safetensors").is_file()
    assert len(head["predicted"]["acceptance_per_depth"]) == 4 and head["predicted"]["tau_sim"] >= 1.0
    for d in (head, draft):  # each drafter decoded losslessly against plain decoding in the same run
        assert (
            d["measured"]["lossless"] is True and d["measured"]["tau"] >= 1.0 and d["measured"]["speedup"] > 0
        )
        if d["measured"]["speedup"] < 1:  # slower than plain decoding: the run says why, from its own costs
            assert d["why_slower"] and "why slower" in out
    head_eval = json.loads((tmp_path / "qs" / "eval" / "eagle3" / "eval.json").read_text())
    assert head_eval["conditions"]["drafter"].startswith(f"eagle:{head['dir']},")
    assert head_eval["speedup"] == head["measured"]["speedup"]
    assert (tmp_path / "qs" / "eval" / "distill" / "eval.json").is_file()
    # the best is the faster of the two, and both are in the closing line
    best = max(("eagle3", "distill"), key=lambda n: saved["drafters"][n]["measured"]["speedup"])
    assert saved["best"] == best and saved["speedup"] == saved["drafters"][best]["measured"]["speedup"]
    done = out.strip().splitlines()[-1]
    assert "EAGLE-3 head" in done and "distilled draft" in done and "<- best" in done

    # the distilled draft's predicted numbers stay in the report
    before, after = draft["predicted"]["before"], draft["predicted"]["after"]
    assert before["n_tokens"] == after["n_tokens"] > 0  # the same dev-eval answers scored before and after
    assert draft["predicted"]["tau_k4_ratio"] == pytest.approx(
        after["tau_greedy"]["4"] / before["tau_greedy"]["4"]
    )
    assert draft["train_tokens_per_s"] > 0 and res["timings"]["total_s"] > 0
    assert res["timings"]["head_s"] > 0 and res["timings"]["head_decoder_eval_s"] > 0
    # no deprecated forward arguments (transformers 5.24 warns about past_key_values= on every such call)
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]
    # dev-eval reference answers are for measuring only: the trainer refuses them as data
    from draftsmith.errors import DraftsmithError
    from draftsmith.examples import examples_from_generated

    with pytest.raises(DraftsmithError, match="evaluation prompts"):
        examples_from_generated(tmp_path / "qs" / "data" / "dev-eval")
    # rerunning (--overwrite) reuses the generated data (resumable), says what it replaces, and with the plan a
    # 15-min budget gives the 135M (the head alone: no distilled draft, no dev-eval references) leaves no
    # distilled draft's results beside the head's
    capsys.readouterr()
    head_only = replace(TINY, steps=0, text_examples=0, dev_prompts=0)
    res = quickstart(
        tmp_path / "qs", target=tiny_dirs["target"], sizes=head_only, progress=False, overwrite=True
    )
    out = capsys.readouterr().out
    assert "replacing the earlier quickstart.json, eagle3/, distill/, eval/ in" in out
    assert "no distilled draft" in out and "distilling" not in out
    assert set(res["drafters"]) == {"eagle3"} and res["best"] == "eagle3"
    assert res["speedup"] == res["drafters"]["eagle3"]["measured"]["speedup"]
    assert not (tmp_path / "qs" / "distill").exists() and not (tmp_path / "qs" / "eval" / "distill").exists()
    assert res["plan"]["predicted_s"]["train"] == 0.0 and res["plan"]["predicted_s"]["head_train"] > 0
    assert "head train" in out and "score + evals" not in out  # the time table lists the phases run
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
FWD_BF16 = {1: 0.037, 2: 0.038, 3: 0.039, 5: 0.041, 9: 0.045, 11: 0.046}
FWD_FP32 = {1: 0.035, 2: 0.045, 3: 0.05, 5: 0.057, 9: 0.072, 11: 0.078}
AMX = MachineCosts(3700, 0.06, 3000, 2000, 0.004, FWD_BF16, 0.003, 1.0, 1200, 0.003)
FP32 = MachineCosts(860, 0.15, 800, 900, 0.005, FWD_FP32, 0.003, 1.0, 400, 0.004)
SLOW = FP32.slowed(2.5)
LOADED = 30.0  # seconds spent loading and measuring before the plan
HEAD = without_distill(FULL)  # the quickstart's first drafter alone


def _total(costs, sizes, elapsed=LOADED):
    return elapsed + sum(predict(costs, SHAPE, sizes).values())


def _room(budget, elapsed=LOADED):
    return elapsed + SAFETY * (budget - elapsed)


@pytest.mark.parametrize("costs", [AMX, FP32, SLOW], ids=["amx-bf16", "avx512-fp32", "slow-fp32"])
@pytest.mark.parametrize("budget_min", [12, 15, 40, 90])
def test_plan_fits_the_budget_and_gives_the_head_the_largest_share_that_does(costs, budget_min):
    budget = 60 * budget_min
    plan = plan_quickstart(costs, SHAPE, budget, LOADED)
    s = plan.sizes
    assert plan.total_s == pytest.approx(_total(costs, s)) and plan.total_s <= _room(budget)
    assert s.head_steps > 0  # the head is always planned: it is the drafter that pays on the 135M
    head = head_draft(HEAD, costs)
    if plan.scale < 1:  # a slightly larger head would not have fit, and no distilled draft was added
        assert _total(costs, scaled(head, plan.scale + 0.02)) > _room(budget)
        assert s.steps == 0 and s.dev_prompts == 0
    # each drafter's steps follow its data (the same epochs as the full quickstart's)
    assert s.head_steps == round(
        FULL.head_steps
        * (s.train_prompts + s.head_text_examples)
        / (FULL.train_prompts + FULL.head_text_examples)
    )
    if s.steps:  # the distilled draft only beside the full head, at DISTILL_MIN_SCALE of its data or more
        assert plan.scale == 1.0 and s.text_examples >= DISTILL_MIN_SCALE * FULL.text_examples - 1
        assert s.steps == round(
            FULL.steps * (s.train_prompts + s.text_examples) / (FULL.train_prompts + FULL.text_examples)
        )
        assert s.dev_prompts == FULL.dev_prompts
    if plan.note.startswith("minimal plan"):  # 12 min on the slowest machine: the smallest plan
        assert s == minimal(head) and (costs, budget_min) == (SLOW, 12)
    else:
        assert s.eval_prompts == FULL.eval_prompts


def test_the_head_comes_first_and_the_distilled_draft_joins_where_the_budget_allows():
    head_only = plan_quickstart(AMX, SHAPE, 15 * 60, LOADED)
    assert head_only.sizes == head_draft(HEAD, AMX) and head_only.scale == 1.0
    lines = head_only.lines()
    assert f"EAGLE-3 head {FULL.head_steps} steps x 8" in lines[0] and "no distilled draft" in lines[0]
    assert "the full EAGLE-3 head fits" in lines[1]
    # the plan names the budget that trains both, and that budget does, at full size, on the same answers
    need = int(lines[1].rsplit("--budget-min ", 1)[1].split()[0])
    both = plan_quickstart(AMX, SHAPE, need * 60, LOADED)
    assert both.sizes == head_draft(FULL, AMX) and both.total_s <= _room(need * 60)
    assert both.sizes.train_prompts == head_only.sizes.train_prompts
    assert (
        "distilled draft 250 steps x 8" in both.lines()[0]
        and "trains the distilled draft" not in both.lines()[1]
    )
    # a minute less: the distilled draft shrinks (never below DISTILL_MIN_SCALE), the head stays whole
    less = plan_quickstart(AMX, SHAPE, (need - 1) * 60, LOADED)
    assert less.sizes.head_steps == FULL.head_steps
    assert less.sizes.steps == 0 or DISTILL_MIN_SCALE * FULL.steps <= less.sizes.steps < FULL.steps


def test_the_head_drafts_a_tree_where_verify_is_flat_and_a_chain_where_it_is_not():
    amx, fp32 = head_draft(HEAD, AMX), head_draft(HEAD, FP32)
    assert (amx.head_depth, amx.head_top_k, amx.head_nodes) == (3, 6, 10)  # 11 tokens verify at 1.24x a step
    assert (fp32.head_depth, fp32.head_top_k, fp32.head_nodes) == (2, 1, 2)  # 2.2x a step
    assert plan_quickstart(FP32, SHAPE, 15 * 60, LOADED).sizes.head_top_k == 1
    # the decoder-eval prediction follows the shape: a bigger tree verifies more tokens per step
    costs = replace(AMX, forward_s={**FWD_BF16, 11: 0.046, 3: 0.030})
    assert predict(costs, SHAPE, amx)["head_decoder_eval"] > predict(costs, SHAPE, fp32)["head_decoder_eval"]


def test_plan_shrinks_with_the_machine_and_keeps_the_full_head_where_it_fits():
    amx, fp32, slow = (plan_quickstart(c, SHAPE, 15 * 60, LOADED) for c in (AMX, FP32, SLOW))
    assert amx.scale == 1.0 and amx.sizes.head_steps == FULL.head_steps
    assert 1.0 > fp32.scale > slow.scale >= 0.1
    assert fp32.sizes.head_text_examples > slow.sizes.head_text_examples
    assert fp32.sizes.head_steps > slow.sizes.head_steps
    # the plan is printed as sizes + predicted minutes per phase
    lines = fp32.lines()
    assert (
        f"{fp32.sizes.head_text_examples} builtin:train-text pairs" in lines[0]
        and "15-min budget" in lines[1]
    )


def test_a_plan_without_a_head_plans_the_distilled_draft_alone():
    plan = plan_quickstart(FP32, SHAPE, 15 * 60, LOADED, full=replace(FULL, head_steps=0))
    assert plan.sizes.head_steps == 0 and plan.sizes.steps > 0 and plan.total_s <= _room(15 * 60)
    assert plan.phases["head_train"] == 0.0 and "no EAGLE-3 head" in plan.lines()[0]


def test_tiny_budget_is_refused_in_one_line_naming_a_budget_that_works():
    with pytest.raises(DraftsmithError) as e:
        plan_quickstart(SLOW, SHAPE, 3 * 60, LOADED)
    msg = str(e.value)
    assert "\n" not in msg and "too small" in msg and "--budget-min" in msg and "head steps" in msg
    need = int(msg.rsplit("--budget-min ", 1)[1].split()[0])
    plan = plan_quickstart(SLOW, SHAPE, need * 60, LOADED)  # the budget it names is enough
    assert plan.total_s <= need * 60


def test_between_minimal_and_smallest_full_eval_plan_the_minimal_plan_is_explained():
    head = head_draft(HEAD, FP32)
    t_small = _total(FP32, scaled(head, 0.1), 0.0)
    t_min = _total(FP32, minimal(head), 0.0)
    assert t_min < t_small
    budget = LOADED + (t_min + t_small) / 2 / SAFETY
    plan = plan_quickstart(FP32, SHAPE, budget, LOADED)
    assert plan.sizes == minimal(head) and plan.note.startswith("minimal plan")
    assert plan.sizes.eval_prompts < FULL.eval_prompts and "minimal plan" in plan.lines()[1]


def test_replan_after_slow_generation_keeps_the_answers_and_shrinks_text_and_steps():
    first = plan_quickstart(FP32, SHAPE, 15 * 60, LOADED)
    elapsed = LOADED + 2.0 * first.phases["generate"]  # generation ran 2x slower than measured
    again = plan_quickstart(
        FP32.slowed(2.0), SHAPE, 15 * 60, elapsed, max_scale=first.scale, generated=first.sizes.train_prompts,
        full=HEAD,
    )  # fmt: skip
    assert again.sizes.train_prompts == first.sizes.train_prompts and again.phases["generate"] == 0.0
    assert again.sizes.head_text_examples < first.sizes.head_text_examples
    assert again.sizes.head_steps < first.sizes.head_steps
    assert again.total_s <= elapsed + SAFETY * (15 * 60 - elapsed)


def test_replan_keeps_the_distilled_draft_only_while_it_fits():
    note = plan_quickstart(AMX, SHAPE, 15 * 60, LOADED).note
    need = 60 * int(note.rsplit("--budget-min ", 1)[1].split()[0])  # the budget that just trains both
    first = plan_quickstart(AMX, SHAPE, need, LOADED)
    assert first.sizes.steps == FULL.steps  # both at full size
    kw = dict(max_scale=first.scale, generated=first.sizes.train_prompts, full=FULL)
    on_time = plan_quickstart(AMX, SHAPE, need, LOADED + first.phases["generate"], **kw)
    assert on_time.sizes.steps == FULL.steps and on_time.sizes.head_steps == FULL.head_steps
    late_s = LOADED + 3 * first.phases["generate"]
    late = plan_quickstart(AMX.slowed(1.2), SHAPE, need, late_s, **kw)
    assert late.sizes.steps < FULL.steps and late.total_s <= _room(need, late_s)
    assert late.sizes.train_prompts == first.sizes.train_prompts


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
        assert p.sizes.steps == 0  # the first plan had no distilled draft: none is added now
    assert (
        first.sizes.head_text_examples
        >= mispredicted.sizes.head_text_examples
        > slower.sizes.head_text_examples
    )
    assert "2.00x slower" in capsys.readouterr().out
