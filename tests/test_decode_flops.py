"""decode.flops: FLOPs of a plain target step and of a drafter per drafted token, counted on a real decode."""

import copy

import pytest
import torch

from draftsmith import cpulayout
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.flops import decode_flops
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer

PROMPT = torch.tensor([[1, 40, 50, 60, 70, 80, 40, 50, 60, 90, 40, 50]])


def _matmul_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and p.dim() == 2)


def test_target_step_and_draft_share_follow_the_weights(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, None)
    plain = decode_flops(dec, None, PROMPT, k=3)
    # one token through every matmul weight (2 FLOPs per weight) plus a little attention over the cache
    assert (
        2 * _matmul_params(tiny_target) <= plain["target_step_flops"] <= 1.1 * 2 * _matmul_params(tiny_target)
    )
    proposer = DraftModelProposer(tiny_draft, 384)
    got = decode_flops(dec, proposer, PROMPT, k=3)
    weights_share = _matmul_params(tiny_draft) / _matmul_params(tiny_target)
    # a draft LM also re-reads the accepted tokens and the correction it did not draft: somewhat above its share
    assert weights_share * 0.9 <= got["flop_share"] <= weights_share * 2.5
    assert got["drafted_tokens"] > 0
    # weights read through matmuls: the plain step reads every matmul weight of the target (the lm_head as the
    # decoder's transposed copy), the draft model its own
    bytes_of = lambda m: 4 * _matmul_params(m)  # noqa: E731  (fp32)
    assert plain["target_weight_bytes"] == bytes_of(tiny_target)
    assert got["draft_weight_bytes"] == bytes_of(tiny_draft)
    assert got["weight_share"] == bytes_of(tiny_draft) / bytes_of(tiny_target)
    assert not set(vars(proposer)) & {"begin", "propose", "advance"}  # the counting wrappers are gone


def test_the_drafts_prompt_prefill_is_not_a_drafted_tokens_cost(tiny_target, tiny_draft):
    """As the target's step excludes its prefill, the draft's cost per drafted token excludes the prompt it runs
    first: with a 200-token prompt the share stays near the draft's weight share (counting the prefill made it
    several times the whole target's step)."""
    dec = SpeculativeDecoder(tiny_target, None)
    long_prompt = torch.randint(3, 384, (1, 200), generator=torch.Generator().manual_seed(0))
    got = decode_flops(dec, DraftModelProposer(tiny_draft, 384), long_prompt, k=3)
    weights_share = _matmul_params(tiny_draft) / _matmul_params(tiny_target)
    assert weights_share * 0.9 <= got["flop_share"] <= weights_share * 2.5


def test_a_lookup_drafter_costs_no_flops(tiny_target):
    dec = SpeculativeDecoder(tiny_target, None)
    proposer = NGramProposer()
    got = decode_flops(dec, proposer, PROMPT, k=4)
    assert got["flop_share"] == 0.0 and "propose" not in vars(proposer)
    assert got["weight_share"] == 0.0


@pytest.mark.parametrize("layout, kernel", [("col", "onednn"), ("row", "packed")])
def test_tuned_cpu_kernels_are_counted_like_f_linear(tiny_target, tiny_draft, monkeypatch, layout, kernel):
    """The layout tuner's oneDNN kernels do not pass through torch's dispatch: decode_flops counts every tuned
    Linear as F.linear, so a tuned target and draft give the untuned counts (FLOPs and weight bytes; a blocked
    copy, which has no storage torch can name, is neither read nor counted)."""
    if kernel not in cpulayout._candidates(torch.float32, 64):
        pytest.skip(f"this torch has no {kernel} kernel for fp32")
    dec = SpeculativeDecoder(tiny_target, None)
    want = decode_flops(dec, DraftModelProposer(tiny_draft, 384), PROMPT, k=3)
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    plan = cpulayout.Plan(layout, {n: kernel for n in cpulayout.ROWS})  # every row count on oneDNN
    monkeypatch.setattr(cpulayout, "measure_shape", lambda i, o, dtype: plan)
    target = copy.deepcopy(tiny_target).requires_grad_(False)
    draft = copy.deepcopy(tiny_draft).requires_grad_(False)
    assert cpulayout.tune_linears(target)["tuned"] and cpulayout.tune_linears(draft)["tuned"]
    got = decode_flops(SpeculativeDecoder(target, None), DraftModelProposer(draft, 384), PROMPT, k=3)
    for key in ("target_step_flops", "draft_flops_per_token", "target_weight_bytes", "draft_weight_bytes"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    assert got["flop_share"] > 0.05 and got["drafted_tokens"] == want["drafted_tokens"]
