"""Verification: which drafted nodes the target accepts, and the one token the target adds.

p = target distribution, q = draft distribution, both warped by `draftsmith.sampling.warp_probs` with the same
SamplingParams. Rows of the verify block are [root, node_1 .. node_N]; row 0 is the target's distribution after
the last committed token, row 1 + i the distribution after node i.

- Greedy: follow the child whose token equals the target argmax; the argmax at the first miss is the
  correction, and at a leaf it is the bonus token. Output == plain greedy decoding, token for token.
- Sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): accept x ~ q with prob min(1, p(x)/q(x)); on
  rejection draw from normalize(max(0, p - q)). Trees use the recursive form (SpecInfer, Miao et al. 2024,
  Alg. 2 / EAGLE): try the children of the current node in order; each rejection replaces p by the residual
  normalize(max(0, p - q_child)) and the next child is tested against that residual; if every child is
  rejected, draw from the residual. A point-mass proposal (draft_probs None) has q = one-hot(x): accept with
  prob p(x), residual = p with x removed. Every branch leaves the emitted token distributed exactly as p.
"""

from __future__ import annotations

import torch

from draftsmith.sampling import SamplingParams, sample, warp_probs

from .proposer import Proposal


def _children(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


def verify_greedy(target_logits: torch.Tensor, proposal: Proposal) -> tuple[list[int], torch.Tensor]:
    """target_logits: [B, 1 + N, V] (B = 1). Returns (accepted node indices root->leaf, next token [B])."""
    argmax = target_logits.argmax(-1)  # [B, 1 + N]
    n = proposal.num_nodes
    if n == 0:
        return [], argmax[:, 0]
    if proposal.is_chain:
        # accepted = length of the matching prefix; one host sync per step
        matches = (proposal.tokens == argmax[:, :n]).long()  # [B, N]
        a = int(matches.cumprod(-1).sum(-1)[0])
        return list(range(a)), argmax[:, a]
    best = argmax[0].tolist()
    toks = proposal.tokens[0].tolist()
    kids = _children(proposal.parents)
    path: list[int] = []
    cur = -1
    while True:
        want = best[cur + 1]
        nxt = next((c for c in kids.get(cur, ()) if toks[c] == want), None)
        if nxt is None:
            return path, argmax[:, cur + 1]
        path.append(nxt)
        cur = nxt


def verify_sampling(
    target_probs: torch.Tensor, proposal: Proposal, generator: torch.Generator | None = None
) -> tuple[list[int], torch.Tensor]:
    """Speculative sampling over a tree. target_probs: [B, 1 + N, V] warped (B = 1); proposal.draft_probs:
    [B, N, V] or None (point masses). Returns (accepted node indices root->leaf, next token [B])."""
    device = target_probs.device
    p_all = target_probs[0].float().cpu()  # the walk is sequential and tiny: do it on the host
    q_all = None if proposal.draft_probs is None else proposal.draft_probs[0].float().cpu()
    toks = proposal.tokens[0].tolist()
    kids = _children(proposal.parents)
    path: list[int] = []
    cur = -1
    p = p_all[0]
    while True:
        accepted = None
        for c in kids.get(cur, ()):
            x = toks[c]
            r = float(torch.rand((), generator=generator))
            if q_all is None:  # point mass on x: min(1, p(x)/1)
                if r < float(p[x]):
                    accepted = c
                    break
                p = p.clone()
                p[x] = 0.0
            else:
                q = q_all[c]
                if r < min(1.0, float(p[x]) / max(float(q[x]), 1e-30)):
                    accepted = c
                    break
                p = (p - q).clamp_min_(0.0)  # residual max(0, p - q) (Leviathan eq. in Alg. 1)
            total = float(p.sum())
            if total <= 0.0:  # only reachable through round-off when p == q (acceptance was certain)
                p = p_all[cur + 1].clone()
            else:
                p = p / total
        if accepted is None:
            token = sample(p, generator)  # correction from the residual, or the bonus token at a leaf
            return path, token.view(1).to(device)
        path.append(accepted)
        cur = accepted
        p = p_all[cur + 1]


def verify(
    target_logits: torch.Tensor,
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Accept a root-to-leaf path of the proposal and pick the target's next token. target_logits: [B, 1+N, V]."""
    if params.greedy:
        return verify_greedy(target_logits, proposal)
    return verify_sampling(warp_probs(target_logits, params), proposal, generator)


def verify_rows(
    target_logits: torch.Tensor,
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[list[list[int]], torch.Tensor]:
    """`verify` for every row of a batch: target_logits [B, 1 + N, V] -> (accepted nodes per row, next token [B]).
    Greedy chains are checked for all rows at once (one host sync); trees and sampling walk row by row, each row
    over its own nodes (`Proposal.row`), drawing from the one generator in row order."""
    B = target_logits.shape[0]
    if B == 1:
        path, nxt = verify(target_logits, proposal, params, generator)
        return [path], nxt
    if params.greedy and proposal.is_chain:
        argmax = target_logits.argmax(-1)  # [B, 1 + N]
        n = proposal.num_nodes
        sizes = torch.tensor([proposal.row_size(b) for b in range(B)], device=argmax.device)
        ok = (proposal.tokens.to(argmax.device) == argmax[:, :n]) & (
            torch.arange(n, device=argmax.device) < sizes[:, None]
        )
        a = ok.long().cumprod(-1).sum(-1)  # [B] the matching prefix of each row
        return [list(range(x)) for x in a.tolist()], argmax.gather(1, a[:, None])[:, 0]
    paths, nxt = [], []
    for b in range(B):
        row = proposal.row(b)
        path, tok = verify(target_logits[b : b + 1, : 1 + row.num_nodes], row, params, generator)
        paths.append(path)
        nxt.append(tok.reshape(1))
    return paths, torch.cat(nxt)
