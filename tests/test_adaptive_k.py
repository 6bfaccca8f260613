"""The adaptive draft length (decode.adaptive.AdaptiveK, `--k auto`): its decisions on hand-made costs and
acceptances (no model), and decoding with it lossless by the oracles of draftsmith.testing, with steps at k = 0 (no
draft work) between drafted ones."""

import json

import pytest
import torch

from draftsmith.decode.adaptive import AdaptiveK
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer
from draftsmith.decode.speed import StepCosts
from draftsmith.errors import DraftsmithError
from draftsmith.testing import assert_greedy_lossless, exact_joint, joint_tvd, oracle_prompts, tiny_model

FLAT = {2.0: 1.0, 5.0: 1.0}  # a verify of up to 4 drafted tokens costs one plain step (memory-bound target)


def _policy(draft_s: float, verify=FLAT, **kw) -> AdaptiveK:
    return AdaptiveK(StepCosts(step_s=1.0, verify_s=verify, draft_s=draft_s), k_max=4, **kw)


def test_a_draft_that_costs_more_than_it_returns_gets_k_0_then_a_probe():
    """draft_s = 1.2 plain steps: even a draft the target always accepted would return (k + 1) / (1.2 k + 1) < 1
    plain step's worth per step, so the policy decodes plainly, drafting once every probe_every steps to look."""
    policy = _policy(1.2, prior_alpha=1.0, probe_every=5)
    picks = [policy.choose() for _ in range(10)]
    assert picks == [0, 0, 0, 0, picks[4], 0, 0, 0, 0, picks[9]] and picks[4] > 0 and picks[9] > 0
    assert policy.probes == 2 and policy.summary()["plain_steps"] == 8


def test_a_cheap_draft_pays_and_follows_the_measured_acceptance():
    policy = _policy(0.1, prior_alpha=0.8, probe_every=4)
    assert policy.choose() == 4  # 0.1 step a token, a flat verify: the deepest draft pays (3.36 / 1.4 = 2.4x)
    for _ in range(30):  # the target rejects the first drafted token every time
        policy.observe(drafted=4, accepted=0)
    # alpha_1 ~0.07: one drafted token returns 1.07 tokens for 1.1 steps, so plain steps pay
    assert policy.alpha()[0] < 0.1 and policy.choose() == 0
    for _ in range(30):  # text the draft knows: everything accepted
        policy.observe(drafted=4, accepted=4)
    assert policy.choose() == 4


def test_depths_not_drafted_yet_borrow_the_acceptance_measured_above_them():
    """Twenty steps that drafted 2 and kept both: depths 3-4 were never drafted. Their prior is depth 2's estimate
    (~.95), not prior_alpha (0.6): at 0.17 of a step a drafted token the policy goes to k 4 (4.49 tokens for 1.68
    steps = 2.67 a step), where a fixed 0.6 stopped it at k 3 (3.38 / 1.51 = 2.24 against 2.20 at k 4)."""
    policy = _policy(0.17, prior_alpha=0.6)
    for _ in range(20):
        policy.observe(drafted=2, accepted=2)
    a = policy.alpha()
    assert a[0] > 0.9 and a[2] == pytest.approx(a[1]) and a[3] == pytest.approx(a[1])
    assert policy.choose() == 4
    for _ in range(20):  # then depth 3 is drafted and always rejected: depth 4 borrows that instead
        policy.observe(drafted=4, accepted=2)
    assert policy.alpha()[2] < 0.2 and policy.alpha()[3] < 0.2 and policy.choose() == 2


def test_costly_verify_and_middling_acceptance_pick_a_middle_k():
    """A compute-bound target (each drafted token adds 0.3 of a step to the verify) at alpha 0.7: tau(k) / cost(k)
    peaks inside 1..k_max (k = 2 here: 2.19 / 1.7 = 1.288 against 1.270 at k = 1 and 1.256 at k = 3)."""
    verify = {2.0: 1.3, 3.0: 1.6, 4.0: 1.9, 5.0: 2.2}
    policy = _policy(0.05, verify=verify, prior_alpha=0.7, prior_steps=1e9)
    rates = policy.rates()
    assert max(range(5), key=rates.__getitem__) == 2 and policy.choose() == 2


def test_the_drafting_cost_is_measured_on_the_request():
    """The same acceptance (the first drafted token always taken, the second never) pays at the start's 0.05 step
    a drafted token (k = 1: ~1.95 tokens for 1.05 steps; k = 2 is about even with it, as the never-taken second
    token keeps a little of its prior) but not once the request measures 1.5 steps a token (a long prompt makes a
    draft LM costlier per token than the short one timed at the start)."""
    for seconds, drafts in ((0.05, True), (1.5, False)):
        policy = _policy(0.05, prior_alpha=0.6)
        for _ in range(20):
            policy.observe(drafted=4, accepted=1, draft_s=4 * seconds)
        k = policy.choose()
        assert abs(policy.draft_s - seconds) < 0.01 and (k in (1, 2) if drafts else k == 0), (
            seconds,
            policy.rates(),
        )


def _mixing() -> AdaptiveK:
    """A policy that switches whatever the tiny random draft's acceptance: drafting costs more than it returns, so
    plain steps, and every other step a probe at the k the acceptance measured so far favours."""
    return _policy(1.2, probe_every=2)


def test_greedy_adaptive_decoding_is_lossless(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    prompts = oracle_prompts(384, n=2)
    drafters = [
        DraftModelProposer(tiny_draft, 384),
        NGramProposer(),
        DraftModelProposer(tiny_draft, 384, stop_below=0.2),
    ]
    for proposer in drafters:
        policy = _mixing()
        results = assert_greedy_lossless(dec, proposer, prompts, k=policy, max_new_tokens=32)
        for r in results:  # plain steps, and drafts right after them (the draft catches up on what it missed)
            steps = r.k_policy["k_steps"]
            assert steps[0] == "0" and steps[1] != "0" and "0" in steps[2:], steps
        assert all(r.k_policy["chosen"] for r in results)
        # a plain step under the policy verifies the root alone
        for r in results:
            for k, v in zip(r.k_policy["k_steps"], r.verified):
                assert k != "0" or v == 1


@pytest.mark.slow  # ~1 min on 2 busy cores: 2500 sampled generations
def test_sampled_adaptive_decoding_keeps_the_target_law():
    """Temperature 1, 4-token vocabulary: the first step decodes plainly (k = 0), the second drafts after a step the
    draft did not see (it feeds the missed token first), later steps follow the measured acceptance; the joint law
    of tokens 1-3 is the target's exact one (draftsmith.testing.exact_joint)."""
    from draftsmith.sampling import SamplingParams

    target = tiny_model("llama", 0, vocab_size=4)
    draft = tiny_model("llama", 3, vocab_size=4, num_hidden_layers=1)
    dec = SpeculativeDecoder(target, eos_ids=set())
    prompt = torch.tensor([[1, 3, 0, 2]])
    proposer = DraftModelProposer(draft, 4)
    counts, kinds = torch.zeros(4, 4, 4), set()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in range(2500):
            policy = _policy(0.3, prior_alpha=0.2, prior_steps=1.0, probe_every=2)
            out = dec.generate(prompt, proposer, k=policy, params=SamplingParams(temperature=1.0),
                               max_new_tokens=6, seed=s)  # fmt: skip
            counts[tuple(out.tokens[:3])] += 1
            kinds.add(out.k_policy["k_steps"][:2])
    finally:
        torch.set_num_threads(threads)
    assert all(k[0] == "0" and k[1] != "0" for k in kinds), kinds
    tvd = joint_tvd(counts, exact_joint(target, prompt, 3))
    assert tvd < 0.06, tvd


def test_an_adaptive_length_needs_one_prompt_and_a_drafter_that_can_skip(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    prompts = oracle_prompts(384, n=2)
    with pytest.raises(DraftsmithError, match="one prompt at a time"):
        dec.generate_batch([p.reshape(-1) for p in prompts], NGramProposer(), k=_mixing(), max_new_tokens=4)

    class Fixed(NGramProposer):
        adaptive_k = False
        name = "fixed"

    with pytest.raises(DraftsmithError, match="cannot skip drafting"):
        dec.generate(prompts[0], Fixed(), k=_mixing(), max_new_tokens=4)


def test_eval_k_auto_reports_its_decisions_per_prompt(tiny_dirs, tmp_path, capsys):
    """`draftsmith eval --k auto`: lossless, the start costs and the decisions in eval.json (per prompt: k per
    step), the setting in the conditions; a drafter that cannot skip a step is one error line before any load."""
    from draftsmith.app.cli import main

    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "The quick brown fox jumps over the lazy dog. The quick", "category": "text"},
            {"prompt": "def add(a, b):\n    return a + b\n\nprint(add(", "category": "code"}]  # fmt: skip
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "ev"
    argv = ["eval", "--target", tiny_dirs["target"], "--drafter", f"draft:{tiny_dirs['draft']}", "--prompts",
            str(prompts), "--k", "auto:3", "--max-new-tokens", "12", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    ev = json.loads((out / "eval.json").read_text())
    assert ev["lossless"] and ev["conditions"]["adaptive_k"] is True and ev["conditions"]["k"] == 3
    pol = ev["k_policy"]
    assert (
        pol["k_max"] == 3
        and pol["start_costs"]["step_s"] > 0
        and set(pol["start_costs"]["verify_s"]) >= {"4"}
    )
    for row in ev["prompts"]:
        steps = row["k_policy"]["k_steps"]
        assert len(steps) == len(row["accepted"]) and all(c in "0123" for c in steps)
    assert sum(pol["chosen"].values()) == sum(len(r["accepted"]) for r in ev["prompts"])
    capsys.readouterr()
    bad = ["eval", "--target", tiny_dirs["target"], "--drafter", "medusa:/nonexistent", "--prompts", str(prompts),
           "--k", "auto", "--out", str(tmp_path / "bad")]  # fmt: skip
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--k auto" in err and not (tmp_path / "bad").exists()
    assert main([*bad[:-4], "--k", "often"]) == 2 and "--k must be" in capsys.readouterr().err
