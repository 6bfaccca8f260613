"""Decode-time warping, shared by the decoder, the trainers' acceptance metrics and the losses.

Acceptance depends on the distributions *as warped at decode time*, so there is exactly one warp function,
applied identically to draft and target: temperature, then top-k, then top-p (nucleus).
Temperature 0 means greedy: the warped distribution is one-hot at the argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError

MIN_TEMPERATURE = 1e-4
"""The smallest temperature > 0: far below it float32 logits / T overflow to inf (then nan probabilities), and at it
the draw is already the argmax unless two logits lie within a few T of each other; 0 is greedy."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:  # nan passes `< 0`, then samples nan
            raise DraftsmithError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise DraftsmithError(
                f"temperature {self.temperature:g} is too small to sample with (logits / T overflow to inf); "
                f"pass 0 for greedy or a temperature >= {MIN_TEMPERATURE:g}"
            )
        if self.top_k < 0:
            raise DraftsmithError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise DraftsmithError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature/top-k/top-p to logits [..., V]; filtered entries become -inf. Not for greedy."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        remove = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    return logits


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warped probabilities [..., V] (float32). Greedy gives a one-hot at the argmax."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(warp_logits(logits, params), dim=-1)


def top_margin(logits: torch.Tensor) -> torch.Tensor:
    """p1 - p2 of softmax(logits [..., V]) at temperature 1, per position [...]: how decided a model is between its
    two best tokens (1: sure, 0: a tie). Given a top-k slice of the logits (a cached top-64), p is taken over it."""
    logits = logits.float()
    if logits.shape[-1] < 2:
        return logits.new_ones(logits.shape[:-1])
    top = torch.topk(logits, 2, dim=-1).values
    p = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    return p[..., 0] - p[..., 1]


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from probs [..., V] -> ids [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])
