"""`draft:...,siblings=S`: a draft LM's chain with S alternatives per depth, verified as a tree in the same target
forward. Greedy speculative == greedy plain on both tiny architectures, alone and in batches (rows whose drafts
stop apart included); the sampled law == the target's; the siblings add accepted tokens at no extra draft
forward; static target caches are sized for the wider block."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.app.drafters import build_proposer
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.drafters import DrafterContext
from draftsmith.decode.proposer import proposal_nodes
from draftsmith.decode.proposers import DraftModelProposer
from draftsmith.sampling import SamplingParams
from draftsmith.testing import (
    ARCHS,
    assert_batch_greedy_lossless,
    assert_greedy_lossless,
    oracle_prompts,
    sampled_joint_tvd,
    save_tiny_like,
    tiny_model,
    tiny_tokenizer,
)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    arch = request.param
    return arch, tiny_model(arch, seed=0), tiny_model(arch, seed=1, num_hidden_layers=1)


def test_the_tree_is_the_chain_with_the_next_best_tokens_beside_it(pair):
    arch, target, draft = pair
    prop = DraftModelProposer(draft, 384, siblings=2)
    chain = DraftModelProposer(draft, 384)
    prompt = oracle_prompts(384)[0]
    greedy = SamplingParams(temperature=0.0)
    prop.begin(prompt, None)
    chain.begin(prompt, None)
    out, ref = prop.propose(3, greedy), chain.propose(3, greedy)
    assert out.num_nodes == 3 * 3 == proposal_nodes(prop, 3)
    assert out.parents == [-1, 0, 1, -1, -1, 0, 0, 1, 1]  # chain, then depth 1's two siblings, depth 2's, ...
    assert torch.equal(out.tokens[:, :3], ref.tokens)  # the chain is the chain a plain draft proposes
    # depth 1's siblings: the draft's 2nd and 3rd choices after the prompt
    logits = draft(prompt).logits[0, -1, :384]
    assert out.tokens[0, 3:5].tolist() == logits.topk(3).indices[1:].tolist()
    for d in range(3):
        sib = out.tokens[0, 3 + 2 * d : 5 + 2 * d].tolist()
        assert out.tokens[0, d].item() not in sib and len(set(sib)) == 2
    # sampling: every sibling carries the distribution it was drawn from, its depth's q
    prop.begin(prompt, None)
    s = prop.propose(3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    q = s.draft_probs[0]
    assert q.shape == (9, 384)
    for d in range(3):
        assert torch.equal(q[3 + 2 * d], q[d]) and torch.equal(q[4 + 2 * d], q[d])


STOP = 0.05  # a confidence the near copy's drafts fall below at some depths, not at all


def near_copy(target, scale: float = 0.1, seed: int = 5):
    """The target with every weight moved by `scale` of its std: a draft whose first choice is often the target's
    and whose second often is when the first is not."""
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    return draft


@pytest.mark.parametrize("siblings", [2])
def test_greedy_lossless_alone_and_in_batches_on_both_architectures(pair, siblings):
    arch, target, _ = pair
    near = near_copy(target)
    dec = SpeculativeDecoder(target, eos_ids=set())
    prop = DraftModelProposer(near, 384, siblings=siblings)
    alone = assert_greedy_lossless(dec, prop, oracle_prompts(384), k=4)
    for rows in (2, 3):  # rows of different lengths, accepting siblings at different depths
        assert_batch_greedy_lossless(dec, prop, oracle_prompts(384, rows), k=4)
    # the same draft as a chain accepts fewer tokens in more steps: the siblings are what the target took
    chain = assert_greedy_lossless(dec, DraftModelProposer(near, 384), oracle_prompts(384), k=4)
    assert sum(sum(r.accepted) for r in alone) > sum(sum(r.accepted) for r in chain)
    assert sum(len(r.accepted) for r in alone) < sum(len(r.accepted) for r in chain)
    # drafts that stop at different depths (rows with trees of their own)
    stop = DraftModelProposer(near, 384, stop_below=STOP, siblings=siblings)
    out = assert_greedy_lossless(dec, stop, oracle_prompts(384), k=4)
    assert {p for r in out for p in r.proposed} > {0, 4}, "no confidence stop inside the draft"
    for rows in (2, 3):
        assert_batch_greedy_lossless(dec, stop, oracle_prompts(384, rows), k=4)


def test_the_spec_option_builds_a_lossless_tree_drafter(pair, tmp_path):
    arch, target, _ = pair
    path = save_tiny_like(tmp_path / "draft", target, seed=1, num_hidden_layers=1)
    ctx = DrafterContext(target, tiny_tokenizer(arch), torch.device("cpu"))
    prop = build_proposer(f"draft:{path},siblings=2", ctx, k=4)
    assert prop.siblings == 2 and proposal_nodes(prop, 4) == 12
    assert_greedy_lossless(SpeculativeDecoder(target, eos_ids=set()), prop, oracle_prompts(384), k=4)


def test_rows_whose_drafts_stop_apart_get_trees_of_their_own():
    target = tiny_model("llama", seed=0)
    prop = DraftModelProposer(near_copy(target), 384, stop_below=STOP, siblings=1)
    prompts = [p[0] for p in oracle_prompts(384, 3, seed=1)]
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    prop.begin(torch.stack([torch.cat([p.new_zeros(n), p]) for p, n in zip(prompts, pad)]), None, pad)
    out = prop.propose(4, SamplingParams(temperature=0.0))
    assert len(set(prop.proposed)) == 3 and out.per_row  # e.g. 4, 2 and 0 tokens deep
    for b, n in enumerate(prop.proposed):
        assert out.row_size(b) == 2 * n
        assert out.row_parents(b) == list(range(-1, n - 1)) + list(range(-1, n - 1))


@pytest.mark.parametrize("depth", [1, 3])
def test_after_a_sibling_is_accepted_the_draft_continues_from_it(pair, depth):
    """Accepting depth `depth`'s sibling (the draft never fed it) leaves the draft's cache as a fresh draft's on the
    committed text: its next proposal is the one a draft begun on that text makes."""
    arch, target, _ = pair
    near = near_copy(target)
    prompt = oracle_prompts(384)[1]
    greedy = SamplingParams(temperature=0.0)
    prop = DraftModelProposer(near, 384, siblings=2)
    prop.begin(prompt, None)
    out = prop.propose(4, greedy)
    path = list(range(depth - 1)) + [4 + 2 * (depth - 1) + 1]  # the chain to depth - 1, then its 2nd sibling
    new = torch.cat([out.tokens[0, path], torch.tensor([7])])[None]
    prop.advance([path], new)
    fresh = DraftModelProposer(near, 384, siblings=2)
    fresh.begin(torch.cat([prompt, new], 1), None)
    assert torch.equal(prop.propose(4, greedy).tokens, fresh.propose(4, greedy).tokens)


def test_a_static_target_cache_holds_the_wider_block(pair):
    """The static cache (--compile's path) is sized from the proposer's max_nodes(k), k (1 + S) nodes: a prompt +
    answer + k filling its 256 rows exactly still decodes to the end."""
    arch, target, draft = pair
    dec = SpeculativeDecoder(target, eos_ids=set(), static_cache=True)
    prompt = oracle_prompts(384)[1]
    new = 256 - prompt.shape[1] - 1 - 4  # a block of k + 1 rows fits at every step, one of 1 + 4 k does not
    ref = dec.generate(prompt, None, max_new_tokens=new).tokens
    prop = DraftModelProposer(near_copy(target), 384, siblings=3)
    assert dec.generate(prompt, prop, k=4, max_new_tokens=new).tokens == ref


def test_a_compiled_draft_with_siblings_is_lossless(pair):
    arch, target, draft = pair
    dec = SpeculativeDecoder(target, eos_ids=set())
    prop = DraftModelProposer(near_copy(target), 384, compile="aot_eager", siblings=2)
    assert_greedy_lossless(dec, prop, oracle_prompts(384), k=3)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_decoding_with_siblings_matches_target_distribution(arch):
    """Temperature 1 on a 4-token vocabulary, k 2 with 2 siblings (6 nodes): the joint law of tokens 1-3 equals the
    target's exact law, alone and beside a longer prompt."""
    target = tiny_model(arch, 0, vocab_size=4)
    draft = tiny_model(arch, 3, vocab_size=4, num_hidden_layers=1)
    dec = SpeculativeDecoder(target, eos_ids=set())
    prompt = torch.tensor([[1, 3, 0, 2]])
    tvd = sampled_joint_tvd(dec, DraftModelProposer(draft, 4, siblings=2), prompt, n=3000)
    assert tvd < 0.06, tvd
    other = (torch.tensor([[2, 0, 1, 3, 3, 1, 0]]),)
    tvd = sampled_joint_tvd(dec, DraftModelProposer(draft, 4, siblings=2), prompt, batch_with=other)
    assert tvd < 0.06, ("B=2", tvd)
