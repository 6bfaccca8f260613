"""Acceptance math (Leviathan et al. 2023; Chen et al. 2023). p = target, q = draft throughout.

- Per-position acceptance at decode time: alpha = sum_x min(p(x), q(x)) = 1 - TVD(p, q), with p and q warped
  exactly as the decoder warps them. At temperature 0 it is 1[argmax q == argmax p].
- Mean accepted length per target step, *bonus token included* (EAGLE's tau convention; gpt-fast's
  "mean accepted" excludes it):  tau = 1 + sum_{i=1..k} prod_{j<=i} a_j  with a_j the acceptance at depth j
  conditional on depths < j being accepted. i.i.d. case: tau = (1 - alpha^(k+1)) / (1 - alpha).
- Predicted from teacher-forced text: `rounds_along_text` (tau = tokens / expected rounds), per text position for
  a draft LM, per round start and depth for heads that chain their own states.
- Speedup model (Leviathan Thm 3.8): S = tau / (k*c + 1), c = draft step cost / target step cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def alpha_from_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """sum_x min(p, q) over the last dim: the probability a draft token is accepted. [..., V] -> [...]."""
    return torch.minimum(target_probs, draft_probs).sum(-1)


def tau_tree(paths: Sequence[tuple[int, ...]], accept: Sequence[Sequence[float]]) -> float:
    """E[tau] = 1 + sum over drafted nodes of P(the path to the node is accepted), bonus token included.

    A node is a path of ranks (r_1, ..., r_d): the r_j-th candidate at depth j. accept[j][r] is the probability
    that depth j+1 accepts its rank-r candidate given the path above it was accepted. A chain is the paths
    (0,), (0, 0), ... and gives 1 + sum_i prod_{j<=i} a_j; every tau draftsmith predicts is this formula."""
    tau = 1.0
    for path in paths:
        p = 1.0
        for depth, rank in enumerate(path):
            p *= float(accept[depth][rank])
        tau += p
    return tau


def tau_from_conditional(accept: Sequence[float], k: int | None = None) -> float:
    """The chain case of `tau_tree`: 1 + sum_{i<=k} prod_{j<=i} a_j for conditional acceptances a_1..a_k."""
    accept = list(accept)[: len(accept) if k is None else k]
    return tau_tree([(0,) * d for d in range(1, len(accept) + 1)], [[a] for a in accept])


def rounds_along_text(
    accept: Sequence[float] | Sequence[Sequence[float]], ks: Sequence[int]
) -> dict[int, float]:
    """Expected number of target steps (rounds) that decode one teacher-forced sequence at draft length k, for every
    k in ks. accept[t] is the acceptance of the draft token for text position t given the text before it (0/1 for
    greedy, alpha for sampling). A round starting at t accepts depth i with accept[t+i-1] while the earlier depths
    were accepted; its target token follows, and the next round starts after it. Rounds start where the previous
    one ended, not at every position: averaging the chain formula over every start position instead weighs the
    long accepted runs once per position inside them, and overstates tau (on the 1.5B's text with the 0.5B draft:
    3.57 against 3.24 for the rounds, and 3.23 decoded). tau = len(text) / rounds; exact for greedy decoding of the
    target's own greedy text, whose accepted tokens are the text.

    Drafters whose guess for a position depends on where the round started (heads that chain their own states:
    EAGLE, P-EAGLE) give accept per start instead: accept[t][i] = acceptance of depth i + 1 in a round whose first
    drafted position is t (so it drafts t + i), needed for i < min(k, len(text) - t)."""
    n, out = len(accept), {}
    per_start = n > 0 and isinstance(accept[0], Sequence)
    if per_start:
        rows = [[float(x) for x in row] for row in accept]
        if any(len(row) < min(max(ks), n - t) for t, row in enumerate(rows)):
            raise ValueError(
                f"per-start acceptance needs min(k, tokens left) depths per start for k up to {max(ks)}"
            )
    else:
        a = [float(x) for x in accept]
    for k in ks:
        start = [0.0] * (n + k + 2)  # probability that a round starts at position t
        start[0] = 1.0
        for t in range(n):
            p = start[t]
            if p == 0.0:
                continue
            for i in range(min(k, n - t)):  # depth i + 1 drafts text position t + i
                acc = rows[t][i] if per_start else a[t + i]
                start[t + i + 1] += p * (1.0 - acc)  # rejected: the target's token ends the round
                p *= acc
            if t + k < n:
                start[t + k + 1] += p  # every depth accepted: the bonus token ends the round
        out[k] = sum(start[:n])
    return out


def tau_iid(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha), bonus token included."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup_model(tau: float, k: int, cost_ratio: float) -> float:
    """Leviathan Thm 3.8: tau / (k*c + 1)."""
    return tau / (k * cost_ratio + 1.0)


def tau_from_accept_lengths(accepted: Sequence[int]) -> float:
    """Mean tokens per target step given per-step accepted draft counts (adds the bonus/correction token)."""
    return (sum(accepted) + len(accepted)) / max(len(accepted), 1)
