"""decode.speed: per-step costs from an eval run, the speedup model, and the "why slower" explanation, checked
with hand-made costs (no timing claims: the numbers are given, the arithmetic is checked)."""

import pytest

from draftsmith.decode.decoder import GenerationResult
from draftsmith.decode.report import render_markdown
from draftsmith.decode.speed import (
    StepCosts,
    costs_from_results,
    explain,
    explain_result,
    iid_alpha_for_tau,
    measure_forward_costs,
    with_verify_ratios,
)

# a 135M target in fp32 on a 2-core CPU: verifying 5 tokens costs 1.8x a step (compute-bound), a 4-layer draft
# with a reduced head ~4 ms per token
FP32 = StepCosts(step_s=0.035, verify_s={5.0: 0.063}, draft_s=0.004, drafted_per_step=4.0)


def test_speedup_model_and_break_even():
    assert FP32.verify(1) == 0.035 and FP32.verify(5) == 0.063
    assert FP32.verify(3) == pytest.approx(0.035 + 0.028 / 2)  # linear between measured sizes
    assert FP32.verify(9) == pytest.approx(0.063 + 0.028)  # extrapolated from the last two points
    need = FP32.break_even_tau(4)
    assert need == pytest.approx((4 * 0.004 + 0.063) / 0.035)
    assert FP32.speedup(need, 4) == pytest.approx(1.0)
    assert FP32.speedup(1.21, 4) == pytest.approx(1.21 * 0.035 / 0.079)
    assert StepCosts.from_dict(FP32.to_dict()) == FP32


def test_costs_from_results_leave_out_the_prefill():
    plain = [
        GenerationResult(tokens=[0] * 11, prompt_len=5, target_forwards=11, time_total=1.1, time_prefill=0.1)
    ]
    spec = [
        GenerationResult(
            tokens=[0] * 11,
            prompt_len=5,
            accepted=[1, 2, 0, 2, 0],
            proposed=[4, 4, 4, 4, 4],
            verified=[5, 5, 5, 5, 5],
            target_forwards=6,
            time_total=0.9,
            time_draft=0.2,
            time_prefill=0.1,
        )
    ]
    c = costs_from_results(spec, plain)
    assert c.step_s == pytest.approx(0.1)  # (1.1 - 0.1) / 10 steps
    assert c.verify(5) == pytest.approx((0.9 - 0.1 - 0.2) / 5)
    assert c.draft_s == pytest.approx(0.2 / 20) and c.drafted_per_step == 4.0
    assert costs_from_results(spec, []) is None  # no plain steps: nothing to compare against
    # a drafter that proposed nothing (its confidence stop never passed): drafting time per step, and said so
    idle = [GenerationResult([0] * 3, 5, accepted=[0, 0], verified=[1, 1], target_forwards=3, time_total=0.5,
                             time_draft=0.02, time_prefill=0.1)]  # fmt: skip
    c0 = costs_from_results(idle, plain)
    assert c0.drafted_per_step == 0 and c0.draft_s == pytest.approx(0.01)
    assert "proposed no token" in explain(c0, 1.0, 4)[0]


def test_explain_fp32_verify_bound_drafter():
    lines = explain(FP32, tau=1.21, k=4, alpha=[0.3, 0.25, 0.2, 0.2], measured_speedup=0.53)
    text = "\n".join(lines)
    need = FP32.break_even_tau(4)
    assert f"breaking even needs tau >= {need:.2f}" in lines[0] and "measured tau 1.21" in lines[0]
    assert f"= {FP32.speedup(1.21, 4):.2f}x (measured 0.53x)" in lines[0]
    assert lines[1].startswith("The larger cost is verifying")  # 0.8 extra steps vs 0.46 for drafting
    assert "No draft length pays" in text  # k=1: tau 1.3 at (0.004 + 0.042) / 0.035 = 1.31 steps per step
    a_need = iid_alpha_for_tau(need, 4)
    assert f"acceptance of about {a_need:.2f}" in text and 0 < a_need < 1
    assert "`ngram:`" in text and f"tau >= {0.063 / 0.035:.2f}" in text  # a drafter with no forward pass
    # where verifying costs ~ one step, the measured tau would pay: 1.21 / (1 + 4 * 0.004 / 0.035)
    assert "AMX bf16" in text and f"about {1.21 / (1 + 16 / 35):.2f}x" in text


def test_explain_draft_bound_drafter_and_a_k_that_pays():
    # cheap verify (bf16 on AMX), an expensive draft (a full-vocab head): drafting is the cost, a short k pays
    c = StepCosts(step_s=0.037, verify_s={5.0: 0.041, 2.0: 0.0375}, draft_s=0.012, drafted_per_step=4.0)
    lines = explain(c, tau=1.9, k=4, alpha=[0.8, 0.5, 0.3, 0.2], measured_speedup=0.8)
    text = "\n".join(lines)
    assert lines[1].startswith("The larger cost is drafting")
    assert "k=1 would pay" in text  # k=1: tau 1.8 at (0.012 + 0.0375) / 0.037 = 1.34 steps -> 1.35x
    assert "AMX bf16" not in text  # verify already costs about one step here


def test_explain_result_and_report_section_only_below_1x():
    result = {
        "tau": 1.21,
        "speedup": 0.55,
        "alpha_per_position": [0.3, 0.25, None, None],
        "costs": FP32.to_dict(),
        "conditions": {"k": 4, "tree": False},
    }
    assert explain_result(result) == explain(FP32, 1.21, 4, [0.3, 0.25, None, None], measured_speedup=0.55)
    with_curve = explain_result(result, verify_ratios={2: 1.3, 3: 1.45, 5: 9.0})
    assert with_curve[0] == explain_result(result)[0]  # the run's own verify size keeps its measured cost
    assert with_verify_ratios(FP32, {2: 1.3}).verify(2) == pytest.approx(1.3 * 0.035)
    assert explain_result({**result, "speedup": 1.2}) == []
    assert explain_result({**result, "costs": None}) == []

    report = _report({**result})
    assert "## Why slower than plain decoding" in report and "breaking even needs tau" in report
    assert "Why slower" not in _report({**result, "speedup": 1.3})


def _report(extra: dict) -> str:
    cond = {
        "drafter": "draft:x",
        "target": "t",
        "k": 4,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_new_tokens": 8,
        "prompts": "p",
        "n_prompts": 1,
        "seed": 0,
        "device": "cpu",
        "dtype": "float32",
        "hardware": "cpu",
        "torch_version": "x",
        "draftsmith_version": "x",
        "date": "x",
        "tree": False,
    }
    return render_markdown(
        {
            **extra,
            "conditions": cond,
            "tokens_per_s": {"plain": 10.0, "speculative": 5.5},
            "lossless": True,
            "target_forwards": 10,
            "target_forwards_plain": 12,
            "draft_time_share": 0.2,
            "per_category": {},
            "accept_length_hist": {"0": 3},
        }
    )


def test_measure_forward_costs_times_each_size(tiny_target):
    got = measure_forward_costs(tiny_target, sizes=(1, 3), context=16, reps=1)
    assert set(got) == {1, 3} and all(s > 0 for s in got.values())


def test_a_noisy_fast_multi_token_forward_never_puts_break_even_below_one():
    from draftsmith.decode.speed import StepCosts

    costs = StepCosts(step_s=0.050, verify_s={2: 0.047, 5: 0.080})  # the 2-token probe timed faster: noise
    assert costs.verify(2) == 0.050 and costs.break_even_tau(1) >= 1.0
    assert costs.verify(5) == 0.080 and costs.verify(3.5) > 0.050
