"""Verification rules on hand-written distributions: no model involved."""

import pytest
import torch

from draftsmith.decode.proposer import Proposal, node_depths, tree_attention_mask
from draftsmith.decode.verify import verify_greedy, verify_sampling
from draftsmith.sampling import SamplingParams

V = 6


def onehot_logits(ids):
    """Logits [1, len(ids), V] whose argmax row r is ids[r]."""
    out = torch.zeros(1, len(ids), V)
    out[0, torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return out


@pytest.mark.parametrize(
    "draft, target_argmax, accepted, nxt",
    [
        ([3, 1, 4], [2, 1, 4, 5], [], 2),  # accept none: correction = target's token at the root
        ([3, 1, 4], [3, 1, 0, 5], [0, 1], 0),  # accept some: correction at the first miss
        ([3, 1, 4], [3, 1, 4, 5], [0, 1, 2], 5),  # accept all: bonus token from the last row
    ],
)
def test_greedy_chain(draft, target_argmax, accepted, nxt):
    path, token = verify_greedy(onehot_logits(target_argmax), Proposal.chain(torch.tensor([draft])))
    assert path == accepted and int(token) == nxt


def test_greedy_tree_follows_matching_branch():
    # root -> {0: tok 3, 1: tok 2}; node 1 -> {2: tok 4, 3: tok 5}; target wants 2 then 5 then (leaf) bonus 1
    prop = Proposal(torch.tensor([[3, 2, 4, 5]]), [-1, -1, 1, 1])
    rows = [2, 0, 5, 0, 1]  # rows: root, node0, node1, node2, node3
    path, token = verify_greedy(onehot_logits(rows), prop)
    assert path == [1, 3] and int(token) == 1


def test_sampling_accept_all_then_bonus_and_reject_then_residual():
    p = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    # draft certain of token 1 where p(1)=0.5 -> accepted w.p. 0.5; on rejection residual = normalize(max(0, p-q)) = token 2
    q = torch.zeros(V)
    q[1] = 1.0
    prop = Proposal.chain(torch.tensor([[1]]), q.view(1, 1, V))
    target = torch.stack([p, torch.eye(V)[4]])[None]  # after node 0, the target is certain of 4 (bonus)
    seen = {}
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        path, tok = verify_sampling(target, prop, g)
        seen[(tuple(path), int(tok))] = seen.get((tuple(path), int(tok)), 0) + 1
    assert set(seen) == {((0,), 4), ((), 2)}  # accept -> bonus 4; reject -> residual can only be 2
    assert abs(seen[((0,), 4)] / 400 - 0.5) < 0.1

    # p == q: min(1, p/q) = 1, always accepted, bonus drawn from the next row
    prop_eq = Proposal.chain(torch.tensor([[2]]), p.view(1, 1, V))
    for _ in range(50):
        path, tok = verify_sampling(target, prop_eq, g)
        assert path == [0] and int(tok) == 4


def _tvd(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _first_token_hist(p0, q_list, parents, n=20000, sampled=True, seed=0):
    """Empirical distribution of the first emitted token (first accepted node, or the correction)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    n_nodes = len(parents)
    p_rows = torch.stack([p0] + [torch.full((V,), 1.0 / V)] * n_nodes)[None]
    for _ in range(n):
        toks = torch.stack([torch.multinomial(q, 1, generator=g)[0] for q in q_list]) if sampled else q_list
        prop = Proposal(toks.view(1, -1), parents, torch.stack(q_list)[None] if sampled else None)
        path, tok = verify_sampling(p_rows, prop, g)
        first = int(prop.tokens[0, path[0]]) if path else int(tok)
        counts[first] += 1
    return counts


P0 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.07, 0.03])
Q1 = torch.tensor([0.05, 0.10, 0.50, 0.05, 0.20, 0.10])
Q2 = torch.tensor([0.30, 0.30, 0.10, 0.10, 0.10, 0.10])


def test_speculative_sampling_preserves_target_distribution_chain():
    counts = _first_token_hist(P0, [Q1, Q2], [-1, 0])
    assert _tvd(counts, P0) < 0.02


def test_recursive_rejection_over_sampled_siblings_preserves_distribution():
    counts = _first_token_hist(
        P0, [Q1, Q2, Q1], [-1, -1, -1]
    )  # three i.i.d.-style sampled children of the root
    assert _tvd(counts, P0) < 0.02


def test_deterministic_siblings_preserve_distribution():
    # top-k style children (no draft probs): point masses, EAGLE's rule
    counts = _first_token_hist(P0, torch.tensor([4, 0, 2]), [-1, -1, -1], sampled=False)
    assert _tvd(counts, P0) < 0.02


def test_wrong_q_would_be_detected():
    # sanity of the oracle: claiming q = Q2 while sampling from Q1 biases the output distribution
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    p_rows = torch.stack([P0, torch.full((V,), 1.0 / V)])[None]
    for _ in range(20000):
        tok = torch.multinomial(Q1, 1, generator=g)
        path, nxt = verify_sampling(p_rows, Proposal.chain(tok.view(1, 1), Q2.view(1, 1, V)), g)
        counts[int(tok) if path else int(nxt)] += 1
    assert _tvd(counts, P0) > 0.05


def test_tree_mask_and_depths():
    parents = [-1, -1, 0, 2]
    assert node_depths(parents) == [1, 1, 2, 3]
    m = tree_attention_mask(parents, prefix_len=2, dtype=torch.float32, device="cpu")
    allowed = m[0, 0] == 0
    assert allowed.shape == (5, 7) and allowed[:, :2].all()  # everyone sees the prefix
    expect = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(allowed[:, 2:], expect)
    with pytest.raises(ValueError):
        node_depths([1, -1])


def test_greedy_params_is_default():
    assert SamplingParams().greedy
