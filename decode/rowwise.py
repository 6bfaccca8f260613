"""A single-row proposer in a batch: one copy per row, each drafting for its own row.

Proposers written for one sequence (`advance(accepted_nodes: list[int], new_tokens [1, a + 1], hidden [1, a + 1, H])`,
no `retain`: the head drafters) decode a batch through `RowwiseProposer`: row b gets its own shallow copy of the
proposer (shared weights, its own per-sequence state, which `begin` creates), the prompt without its left padding,
and, each step, its own accepted nodes, tokens and hidden rows. The verify is still one target forward over every
row; the drafting costs one proposer call per row (B small forwards instead of one of B rows).

A batch of one runs the proposer itself, with the same arguments it had before batches existed.
"""

from __future__ import annotations

import copy

import torch

from draftsmith.sampling import SamplingParams

from .proposer import Proposal


def batched(proposer):
    """The proposer as the batch protocol wants it: itself if it speaks it (it has `retain`, or it drafts on the
    target's own cache with `attach`), else wrapped in a RowwiseProposer."""
    if proposer is None or hasattr(proposer, "retain") or hasattr(proposer, "attach"):
        return proposer
    return RowwiseProposer(proposer)


class RowwiseProposer:
    """One copy of a single-row proposer per batch row (module docstring)."""

    def __init__(self, proposer):
        self.proto = proposer
        self.name = proposer.name
        self.hidden_state_layers = tuple(proposer.hidden_state_layers)
        if hasattr(proposer, "max_nodes"):
            self.max_nodes = proposer.max_nodes
        self.rows: list = []

    @property
    def tree(self):
        return getattr(self.rows[0] if self.rows else self.proto, "tree", False)

    def begin(self, tokens: torch.Tensor, hidden, pad: list[int] | None = None) -> None:
        pad = pad or [0] * tokens.shape[0]
        # row 0 is the proposer itself: a batch of one is exactly the single-row decoder
        self.rows = [self.proto if b == 0 else copy.copy(self.proto) for b in range(tokens.shape[0])]
        for b, (row, p) in enumerate(zip(self.rows, pad)):
            row_hidden = None if hidden is None else tuple(h[b : b + 1, p:] for h in hidden)
            row.begin(tokens[b : b + 1, p:], row_hidden)

    def retain(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        if len(self.rows) == 1:
            return self.rows[0].propose(k, params, generator)
        return Proposal.stack([row.propose(k, params, generator) for row in self.rows])

    def advance(self, accepted_nodes: list[list[int]], new_tokens: torch.Tensor, hidden) -> None:
        for b, (row, acc) in enumerate(zip(self.rows, accepted_nodes)):
            n = len(acc) + 1
            row_hidden = None if hidden is None else tuple(h[b : b + 1, :n] for h in hidden)
            row.advance(acc, new_tokens[b : b + 1, :n], row_hidden)
