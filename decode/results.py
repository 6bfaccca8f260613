"""What a generation returns: one row's tokens and acceptance statistics, and a batch of rows decoded together."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    """One generation. `accepted[s]` = draft tokens accepted at verify step s (the step also adds one token)."""

    tokens: list[int]  # generated ids (prompt excluded)
    prompt_len: int
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)  # proposal depth per step (0 = plain step)
    target_forwards: int = 0  # including the prefill forward
    time_total: float = 0.0
    time_draft: float = 0.0  # proposer.begin/propose/advance
    time_draft_prefill: float = 0.0  # the drafter's own prompt prefill (begin, prefill): part of time_draft
    time_prefill: float = 0.0  # the prompt's forward (part of time_total): per-step costs leave it out
    verified: list[int] = field(default_factory=list)  # tokens in each verify forward (1 + proposal nodes)
    stop_reason: str = "length"
    k_policy: dict | None = None  # an adaptive draft length's decisions (decode.adaptive.AdaptiveK.summary)

    @property
    def tau(self) -> float:
        """Mean tokens per verify forward, bonus/correction token included."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)


@dataclass
class BatchResult:
    """A batch decoded together: one GenerationResult per prompt (in order; each row's time_total is when it
    finished) and what the batch cost."""

    rows: list[GenerationResult]
    time_total: float = 0.0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_draft_prefill: float = 0.0
    forward_rows: list[int] = field(
        default_factory=list
    )  # batch rows in each target forward, the prefill first
    step_depths: list[int] = field(
        default_factory=list
    )  # deepest proposal of each verify step (drafting work)
