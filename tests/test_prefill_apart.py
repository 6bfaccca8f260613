"""The drafter's prompt prefill reported apart from its cost per drafted token, and speedup with and without the
prefills (decode.metrics: the decode rate after the first token beside the end-to-end rate)."""

import pytest
import torch

from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.metrics import summarize
from draftsmith.decode.proposers import DraftModelProposer
from draftsmith.decode.results import GenerationResult
from draftsmith.decode.speed import StepCosts, costs_from_results


def _hand_made():
    """9 tokens each. Speculative: 1.0 s in all, 0.2 s target prefill, 0.5 s drafting of which 0.3 s is the
    drafter's prefill, 2 steps drafting 3 tokens each. Plain: 1.2 s, 0.2 s prefill, 8 steps."""
    spec = GenerationResult(tokens=list(range(9)), prompt_len=5, accepted=[3, 3], proposed=[3, 3],
                            verified=[4, 4], target_forwards=3, time_total=1.0, time_draft=0.5,
                            time_prefill=0.2, time_draft_prefill=0.3)  # fmt: skip
    plain = GenerationResult(tokens=list(range(9)), prompt_len=5, accepted=[0] * 8, proposed=[0] * 8,
                             verified=[1] * 8, target_forwards=9, time_total=1.2, time_prefill=0.2)  # fmt: skip
    return spec, plain


def test_the_drafters_prefill_is_not_a_cost_per_drafted_token():
    spec, plain = _hand_made()
    costs = costs_from_results([spec], [plain])
    assert costs.draft_s == pytest.approx(0.2 / 6) and costs.draft_prefill_s == pytest.approx(0.3)
    assert costs.step_s == pytest.approx(1.0 / 8)
    assert StepCosts.from_dict(costs.to_dict()) == costs


def test_speedup_with_and_without_the_prefills():
    spec, plain = _hand_made()
    s = summarize([spec], [plain], k=3)
    assert s["speedup"] == pytest.approx(1.2)  # end to end: 9 / 1.0 against 9 / 1.2
    # after the first token: 8 tokens in 1.0 - 0.2 - 0.3 s against 8 in 1.2 - 0.2 s
    assert s["speedup_decode"] == pytest.approx((8 / 0.5) / (8 / 1.0))
    assert s["prefill_s"] == pytest.approx({"target": 0.2, "drafter": 0.3, "plain": 0.2})


def test_a_draft_lms_prompt_is_fed_in_its_prefill_not_in_a_draft_step(tiny_target, tiny_draft):
    """The decoder times the draft's prompt forward apart (prefill_prompt): every forward inside a propose is one
    or two columns wide, the prompt's is not, and the tokens stay plain decoding's."""
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    prompt = torch.randint(1, 384, (1, 60), generator=torch.Generator().manual_seed(0))
    prop = DraftModelProposer(tiny_draft, 384)
    widths, where = [], ["other"]
    run, prefill = prop._run, prop.prefill_prompt

    def run_hook(ids, *a, **kw):
        widths.append((where[0], ids.shape[1]))
        return run(ids, *a, **kw)

    def prefill_hook():
        where[0] = "prefill"
        prefill()
        where[0] = "other"

    prop._run, prop.prefill_prompt = run_hook, prefill_hook
    res = dec.generate(prompt, prop, k=3, max_new_tokens=20)
    assert res.tokens == dec.generate(prompt, None, max_new_tokens=20).tokens
    assert [w for w in widths if w[0] == "prefill"] == [
        ("prefill", 61)
    ]  # the prompt + the target's first token
    assert all(n <= 2 for place, n in widths if place == "other")
    assert 0 < res.time_draft_prefill < res.time_draft
