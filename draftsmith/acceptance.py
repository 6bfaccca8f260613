"""Acceptance math (Leviathan et al. 2023; Chen et al. 2023). p = target, q = draft throughout.

- Per-position acceptance at decode time: alpha = sum_x min(p(x), q(x)) = 1 - TVD(p, q), with p and q warped
  exactly as the decoder warps them. At temperature 0 it is 1[argmax q == argmax p].
- Mean accepted length per target step, *bonus token included* (EAGLE's tau convention; gpt-fast's
  "mean accepted" excludes it):  tau = 1 + sum_{i=1..k} prod_{j<=i} a_j  with a_j the acceptance at depth j
  conditional on depths < j being accepted. i.i.d. case: tau = (1 - alpha^(k+1)) / (1 - alpha).
- Speedup model (Leviathan Thm 3.8): S = tau / (k*c + 1), c = draft step cost / target step cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def alpha_from_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """sum_x min(p, q) over the last dim: the probability a draft token is accepted. [..., V] -> [...]."""
    return torch.minimum(target_probs, draft_probs).sum(-1)


def tau_from_conditional(accept: Sequence[float], k: int | None = None) -> float:
    """tau = 1 + sum_i prod_{j<=i} a_j for depths 1..k (bonus token included)."""
    k = len(accept) if k is None else k
    tau, run = 1.0, 1.0
    for a in list(accept)[:k]:
        run *= float(a)
        tau += run
    return tau


def tau_iid(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha), bonus token included."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tau_table(alpha: float, ks: Sequence[int] = range(1, 9)) -> dict[int, float]:
    return {k: tau_iid(alpha, k) for k in ks}


def speedup_model(tau: float, k: int, cost_ratio: float) -> float:
    """Leviathan Thm 3.8: tau / (k*c + 1)."""
    return tau / (k * cost_ratio + 1.0)


def tau_from_accept_lengths(accepted: Sequence[int]) -> float:
    """Mean tokens per target step given per-step accepted draft counts (adds the bonus/correction token)."""
    return (sum(accepted) + len(accepted)) / max(len(accepted), 1)
