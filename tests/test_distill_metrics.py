import math

import pytest
import torch

from draftsmith.acceptance import tau_iid
from draftsmith.distill.metrics import AcceptanceMeter
from draftsmith.errors import DraftsmithError

LOG = math.log


def _logits_from_probs(*rows):
    return torch.tensor([[LOG(p) if p > 0 else -1e4 for p in row] for row in rows])


def test_hand_made_alpha_at_temperature_one():
    # p = (.5, .3, .2), q = (.2, .3, .5): sum min = .2 + .3 + .2 = .7, argmax differ
    # p = (.6, .4, 0),  q = (.9, .1, 0):  sum min = .6 + .1 = .7, argmax agree
    target = _logits_from_probs([0.5, 0.3, 0.2], [0.6, 0.4, 0.0])
    draft = _logits_from_probs([0.2, 0.3, 0.5], [0.9, 0.1, 0.0])
    meter = AcceptanceMeter(temperature=1.0, ks=[1, 3])
    meter.update(target, draft, torch.tensor([True, True]))
    out = meter.compute()
    assert out["alpha"] == pytest.approx(0.7, abs=1e-5)
    assert out["tvd"] == pytest.approx(0.3, abs=1e-5)
    assert out["top1"] == pytest.approx(0.5)
    assert out["n_tokens"] == 2
    assert out["tau"] == {1: pytest.approx(1.7, abs=1e-5), 3: pytest.approx(1 + 0.7 + 0.49 + 0.343, abs=1e-5)}
    assert out["tau_greedy"] == {1: pytest.approx(1.5), 3: pytest.approx(tau_iid(0.5, 3))}


def test_greedy_alpha_equals_top1_and_mask():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(4, 6, 10, generator=g)
    draft = target + 1.5 * torch.randn(4, 6, 10, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    meter = AcceptanceMeter(temperature=0.0)
    meter.update(target, draft, mask)
    out = meter.compute()
    agree = (target.argmax(-1) == draft.argmax(-1))[mask].double().mean().item()
    assert out["alpha"] == pytest.approx(agree) and out["top1"] == pytest.approx(agree)
    assert 0 < agree < 1 and out["n_tokens"] == int(mask.sum())
    assert list(out["tau"]) == list(range(1, 9))


def test_accumulates_across_updates_and_chunks():
    g = torch.Generator().manual_seed(1)
    target, draft = torch.randn(30, 12, generator=g), torch.randn(30, 12, generator=g)
    whole = AcceptanceMeter(temperature=0.8, top_p=0.9, top_k=5)
    whole.update(target, draft)
    parts = AcceptanceMeter(temperature=0.8, top_p=0.9, top_k=5, chunk_size=4)
    parts.update(target[:11], draft[:11])
    parts.update(target[11:], draft[11:])
    a, b = whole.compute(), parts.compute()
    assert a["alpha"] == pytest.approx(b["alpha"], abs=1e-6) and a["n_tokens"] == b["n_tokens"] == 30


def test_uses_decode_warp_top_k():
    # with top_k=1 both distributions become one-hot: alpha collapses to argmax agreement
    target = _logits_from_probs([0.5, 0.3, 0.2], [0.4, 0.35, 0.25])
    draft = _logits_from_probs([0.45, 0.35, 0.2], [0.2, 0.5, 0.3])
    meter = AcceptanceMeter(temperature=1.0, top_k=1)
    meter.update(target, draft)
    assert meter.compute()["alpha"] == pytest.approx(0.5)


def test_reduced_vocab_matches_scattered_full_vocab():
    g = torch.Generator().manual_seed(2)
    target = torch.randn(20, 16, generator=g) * 2
    vocab_ids = torch.tensor([0, 2, 3, 7, 8, 15])
    reduced = torch.randn(20, 6, generator=g) * 2
    scattered = torch.full((20, 16), float("-inf"))
    scattered[:, vocab_ids] = reduced
    for temperature in (1.0, 0.0):
        a, b = AcceptanceMeter(temperature), AcceptanceMeter(temperature)
        a.update(target, reduced, vocab_ids=vocab_ids)
        b.update(target, scattered)
        ra, rb = a.compute(), b.compute()
        assert ra["alpha"] == pytest.approx(rb["alpha"], abs=1e-6)
        assert ra["top1"] == pytest.approx(rb["top1"])
    # exact: alpha = sum over the draft vocab of min(p, q)
    p = torch.softmax(target, -1)[:, vocab_ids]
    q = torch.softmax(reduced, -1)
    meter = AcceptanceMeter(1.0)
    meter.update(target, reduced, vocab_ids=vocab_ids)
    assert meter.compute()["alpha"] == pytest.approx(torch.minimum(p, q).sum(-1).mean().item(), abs=1e-6)


def test_errors():
    meter = AcceptanceMeter(1.0)
    with pytest.raises(DraftsmithError, match="no tokens"):
        meter.compute()
    with pytest.raises(DraftsmithError):
        meter.update(torch.zeros(3, 5), torch.zeros(3, 4))
    with pytest.raises(DraftsmithError):
        meter.update(torch.zeros(3, 5), torch.zeros(2, 5))
    with pytest.raises(DraftsmithError):
        AcceptanceMeter(-1.0)


def test_predicted_tau_counts_the_rounds_that_decode_each_sequence():
    """tau(k) = tokens / rounds, a round starting where the last one ended and never crossing a sequence boundary
    (hand-computed)."""
    V = 5
    target = torch.tensor([0, 1, 2, 3, 4, 0])
    match = [1, 1, 0, 1, 1, 1]
    draft = torch.tensor([t if m else (t + 1) % V for t, m in zip(target.tolist(), match)])
    t_logits = torch.nn.functional.one_hot(target, V).float() * 10
    d_logits = torch.nn.functional.one_hot(draft, V).float() * 10
    meter = AcceptanceMeter(0.0, ks=[1, 4])
    meter.update(t_logits, d_logits, segments=torch.zeros(6, dtype=torch.long))
    res = meter.compute()
    # k=4: [0, 1, 2 rejected] [3, 4, 5, text ends] -> 6 / 2; k=1: [0, 1] [2 rejected] [3, 4] [5] -> 6 / 4
    assert res["tau_estimate"] == "rounds"
    assert res["tau_greedy"][4] == pytest.approx(3.0) and res["tau_greedy"][1] == pytest.approx(1.5)
    assert res["tau_greedy_iid"][4] == pytest.approx((1 - (5 / 6) ** 5) / (1 - 5 / 6))
    # all tokens accepted, two sequences of 3: rounds stop at the boundary -> 6 / 2 = 3.0 (i.i.d. says 5)
    meter = AcceptanceMeter(0.0, ks=[4])
    meter.update(t_logits, t_logits, segments=torch.tensor([0, 0, 0, 1, 1, 1]))
    res = meter.compute()
    assert res["tau_greedy"][4] == pytest.approx(3.0) and res["tau_greedy_iid"][4] == pytest.approx(5.0)
    # without segments the i.i.d. formula is reported, and says so
    meter = AcceptanceMeter(0.0, ks=[4])
    meter.update(t_logits, t_logits)
    assert meter.compute()["tau_estimate"] == "iid"


def test_top1_is_split_by_the_target_margin():
    # target margins p1 - p2: .1 (near-tie), .1, .3, .5, .9, .9; the draft agrees on rows 0, 3, 4
    target = _logits_from_probs(
        [0.45, 0.35, 0.2],
        [0.35, 0.45, 0.2],
        [0.5, 0.2, 0.3],
        [0.7, 0.2, 0.1],
        [0.95, 0.05, 0.0],
        [0.0, 0.05, 0.95],
    )
    draft = _logits_from_probs(
        [0.9, 0.05, 0.05],
        [0.9, 0.05, 0.05],
        [0.1, 0.1, 0.8],
        [0.6, 0.3, 0.1],
        [0.5, 0.4, 0.1],
        [0.6, 0.3, 0.1],
    )
    meter = AcceptanceMeter(temperature=0.0, chunk_size=4)  # the bins add up across chunks
    meter.update(target, draft)
    bins = meter.compute()["top1_by_margin"]
    assert list(bins) == ["0-0.2", "0.2-0.4", "0.4-0.7", "0.7-1"]
    assert bins["0-0.2"] == {"top1": pytest.approx(0.5), "n": 2}
    assert bins["0.2-0.4"] == {"top1": 0.0, "n": 1}
    assert bins["0.4-0.7"] == {"top1": 1.0, "n": 1}
    assert bins["0.7-1"] == {"top1": pytest.approx(0.5), "n": 2}
    meter = AcceptanceMeter(temperature=0.0)
    meter.update(target[:1], draft[:1])
    assert meter.compute()["top1_by_margin"]["0.7-1"] == {"top1": None, "n": 0}


def test_tau_if_sure_turns_the_misses_at_a_confident_target_into_hits():
    """tau_greedy_if_sure[m]: the rounds walked again with every miss at target margin >= m a hit (hand-computed)."""
    margin_probs = {0.9: [0.95, 0.05, 0.0], 0.5: [0.7, 0.2, 0.1], 0.3: [0.6, 0.3, 0.1]}
    margins = [0.9, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.3, 0.9, 0.9]
    hits = [1, 0, 1, 1, 1, 1, 1, 0, 0, 1]  # misses at margins .5, .3 and .9
    target = _logits_from_probs(*(margin_probs[m] for m in margins))
    draft = _logits_from_probs(*([0.8, 0.1, 0.1] if h else [0.1, 0.8, 0.1] for h in hits))
    meter = AcceptanceMeter(0.0, ks=[4], chunk_size=3)
    meter.update(target, draft, segments=torch.zeros(10, dtype=torch.long))
    res = meter.compute()
    # k 4, as drafted: [0, 1 rejected] [2, 3, 4, 5, bonus 6] [7 rejected] [8 rejected] [9] -> 10 / 5
    assert res["tau_greedy"][4] == pytest.approx(2.0)
    sure = res["tau_greedy_if_sure"]
    assert list(sure) == ["0.2", "0.4", "0.7"]
    assert sure["0.7"][4] == pytest.approx(10 / 4)  # 8 a hit: [0, 1] [2-5, 6] [7] [8, 9]
    assert sure["0.4"][4] == pytest.approx(10 / 3)  # 1 too: [0-3, 4] [5, 6, 7 rejected] [8, 9]
    assert sure["0.2"][4] == pytest.approx(10 / 2)  # all: [0-3, 4] [5-8, 9]
    meter = AcceptanceMeter(0.0, ks=[4])
    meter.update(target, draft)
    assert meter.compute()["tau_greedy_if_sure"] is None  # no sequences, no rounds


def test_distill_summary_prints_top1_by_margin():
    from draftsmith.app.train import distill_summary
    from draftsmith.distill.recipe import DistillConfig

    bins = {
        "0-0.2": {"top1": 0.4, "n": 10},
        "0.2-0.4": {"top1": None, "n": 0},
        "0.7-1": {"top1": 0.96, "n": 50},
    }
    held = {"alpha": 0.8, "top1": 0.83, "tau_k4": 3.4, "top1_by_margin": bins}
    text = distill_summary(DistillConfig(), {"step": 5, "eval": {"heldout": held}, "final_dir": "out/final"})
    assert text.splitlines()[1].endswith("p1 - p2: 0-0.2 0.400 (10), 0.7-1 0.960 (50)")
    assert len(text.splitlines()) == 2  # no walked rounds: no ceiling line
    held["tau_greedy"] = {4: 3.3}
    held["tau_greedy_if_sure"] = {"0.2": {4: 4.1}, "0.4": {4: 3.7}, "0.7": {4: 3.5}}
    text = distill_summary(DistillConfig(), {"step": 5, "eval": {"heldout": held}, "final_dir": "out/final"})
    assert text.splitlines()[2].endswith(
        "3.30; with the misses at a target margin >= 0.7 / 0.4 / 0.2 made hits: 3.50 / 3.70 / 4.10"
    )
    del held["top1_by_margin"], held["tau_greedy_if_sure"]
    assert "\n" not in distill_summary(
        DistillConfig(), {"step": 5, "eval": {"heldout": held}, "final_dir": "x"}
    )
    seen = {"top1": 0.871, "tau_greedy": {4: 3.72}, "n_examples": 32}
    text = distill_summary(
        DistillConfig(), {"step": 5, "eval": {"heldout": held, "train_sample": seen}, "final_dir": "x"}
    )
    assert text.splitlines()[1] == (
        "  on 32 training examples: top-1 0.871 (held-out 0.830), predicted greedy tau(k=4) 3.72 (held-out 3.30)"
    )
