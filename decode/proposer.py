"""The Proposer protocol: what every drafter (draft LM, n-gram, Medusa, EAGLE) gives the decoder.

Timeline of one decoding step (B = batch rows, N = proposed nodes, V = target vocabulary):

    committed tokens  x_1 .. x_L        target KV cache holds x_1 .. x_{L-1}; x_L ("root") is not in it yet
    proposer.propose(k, params, gen) -> Proposal(tokens [B, N], parents, draft_probs [B, N, V] | None, sizes)
    target forward over [x_L, node_1 .. node_N] with a tree mask       (one forward, N + 1 positions per row)
    accept a root-to-leaf path of a_b nodes per row, then one target token (correction or bonus)
    proposer.advance(accepted_nodes, new_tokens [B, A], hidden)        (hidden only if requested)
    proposer.retain(rows)                                              (only when rows finished)

Batches. Rows are prompts of different lengths decoded together. `begin` gets them left-padded to one width with
`pad[b]` padding tokens in row b (the argument is left out when no row is padded, so a batch of one calls
`begin(tokens, hidden)`). Each row accepts its own number of nodes: `accepted_nodes[b]` lists row b's (length
a_b), and `new_tokens` / `hidden` hold row b's a_b + 1 committed tokens in their first a_b + 1 columns (right
padding after: A = 1 + max_b a_b). A row that stops (EOS, stop string, length) leaves the batch: `retain(rows)`
keeps the listed rows (ascending batch indices) and drops the rest, after the step's `advance`. A proposer without
`retain` is a single-row proposer: `advance(accepted_nodes: list[int], new_tokens [1, a + 1], hidden)`, and the
decoder gives each row of a batch its own copy (decode.rowwise); one that drafts on the target's cache (`attach`)
must speak the batch protocol itself.

Hidden states (EAGLE, Medusa): a proposer with `hidden_state_layers = (i, ...)` receives, for every committed
token x, the target hidden state *at the position that predicted x* (the row whose logits x was sampled from),
one tensor [B, n, H] per requested index. Indices follow HF `output_hidden_states`: index i < num_layers is the
state *entering* decoder layer i (0 = embeddings); index num_layers is the final hidden state after the final
norm (what the lm_head reads; HF transformers 5 returns the normed state there).

Tree proposals: `parents[i]` is the index of node i's parent, -1 for children of the root; parents must come
before children (parents[i] < i). A chain of k tokens is parents = [-1, 0, 1, ..., k-2]. Rows share one parents
list, or carry one each (a list of lists) when their trees differ; `sizes[b]` < N marks a row with fewer nodes
(its remaining columns are padding, never verified).

Draft probabilities (speculative sampling): `draft_probs[:, i]` is the warped distribution node i's token was
*sampled* from, independently of its siblings. Proposers that choose tokens deterministically (argmax, top-k,
n-gram lookup) pass `draft_probs=None`: each node then counts as a point mass on its token, which keeps
verification exact (accept with prob p(x), else drop x from p and renormalise; EAGLE's rule for trees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from draftsmith.sampling import SamplingParams


@dataclass
class Proposal:
    """Draft tokens as a tree (a chain is a tree), for every row of the batch. tokens: [B, N] target ids;
    parents: [N] shared by every row (-1 = root), or one list per row when the rows' trees differ; sizes: the
    nodes of each row when rows propose different numbers (the rest of a row's tokens is padding), None = N."""

    tokens: torch.Tensor
    parents: list[int] | list[list[int]]
    draft_probs: torch.Tensor | None = None  # [B, N, V] warped draft distributions, or None (point masses)
    sizes: list[int] | None = None

    @property
    def num_nodes(self) -> int:
        """N: the nodes of the widest row (the width of the verify block after its root)."""
        return int(self.tokens.shape[-1])

    @property
    def per_row(self) -> bool:
        return bool(self.parents) and isinstance(self.parents[0], list)

    def row_size(self, b: int) -> int:
        return self.num_nodes if self.sizes is None else self.sizes[b]

    def row_parents(self, b: int) -> list[int]:
        parents = self.parents[b] if self.per_row else self.parents
        return list(parents[: self.row_size(b)])

    @property
    def is_chain(self) -> bool:
        rows = self.parents if self.per_row else [self.parents]
        return all(p == i - 1 for row in rows for i, p in enumerate(row))

    def row(self, b: int) -> Proposal:
        """Row b alone (a batch of one) with its own nodes only."""
        n = self.row_size(b)
        probs = None if self.draft_probs is None else self.draft_probs[b : b + 1, :n]
        return Proposal(self.tokens[b : b + 1, :n], self.row_parents(b), probs)

    @staticmethod
    def chain(tokens: torch.Tensor, draft_probs: torch.Tensor | None = None, sizes: list[int] | None = None):
        """A chain of tokens [B, n] (row b: its first sizes[b]): parents = [-1, 0, 1, ...]."""
        return Proposal(tokens, list(range(-1, tokens.shape[-1] - 1)), draft_probs, sizes)

    @staticmethod
    def empty(batch: int, device: torch.device | str) -> Proposal:
        """No draft: the step is a plain autoregressive step."""
        return Proposal(torch.empty(batch, 0, dtype=torch.long, device=device), [], None)

    @staticmethod
    def stack(rows: Sequence[Proposal]) -> Proposal:
        """One proposal per row (each a batch of one) -> a batch proposal, rows padded to the widest."""
        n = max(r.num_nodes for r in rows)
        device = rows[0].tokens.device
        tokens = torch.zeros(len(rows), n, dtype=torch.long, device=device)
        for b, r in enumerate(rows):
            tokens[b, : r.num_nodes] = r.tokens[0].to(device)
        probs = None
        if any(r.draft_probs is not None for r in rows):
            if not all(r.draft_probs is not None or r.num_nodes == 0 for r in rows):
                raise ValueError("a batch mixes sampled and point-mass proposals")
            v = next(r.draft_probs.shape[-1] for r in rows if r.draft_probs is not None)
            probs = torch.zeros(len(rows), n, v, device=device)
            for b, r in enumerate(rows):
                if r.num_nodes:
                    probs[b, : r.num_nodes] = r.draft_probs[0].to(device)
        sizes = [r.num_nodes for r in rows]
        parents = [list(r.parents) for r in rows]
        if all(p == parents[0] for p in parents) and len(set(sizes)) == 1:
            return Proposal(tokens, parents[0], probs)
        return Proposal(tokens, parents, probs, sizes)


@runtime_checkable
class Proposer(Protocol):
    """A drafter. Reused across prompts: `begin()` resets all per-sequence state (KV cache, committed tokens).
    Proposals must be at most k deep (the decoder raises otherwise)."""

    name: str
    # HF output_hidden_states indices the proposer needs (empty = none); see the module docstring.
    hidden_state_layers: tuple[int, ...]
    # Optional attribute `max_nodes: int` (or a function of k): the most nodes one Proposal may hold (sizes static
    # caches; default k); `proposal_nodes` reads it.
    # Optional attribute `tree`: a short description of the tree shape, copied into eval.json conditions.
    # Optional hooks (self-speculative drafters, heads.selfspec): `attach(decoder, cache)` right after the
    # prefill hands over the target's KV cache (a decode.ragged.RaggedCache: the HF cache and its rows' lengths);
    # `verify_forward(block, proposal) -> (logits, hidden) | None`
    # Optional attribute `adaptive_k = True`: `propose(0, ...)` drafts nothing at no cost and `advance` after it
    # keeps the proposer's state whole, so an adaptive draft length (decode.adaptive) may skip drafting for a step.
    # `prefill_prompt()` right after `begin`: run the drafter's forward over the prompts now (else the first
    # propose does), so the decoder reports the drafter's prefill apart from its cost per drafted token.
    # replaces the decoder's verify forward when the proposer can reuse shared-layer work (None = not this step).

    def begin(
        self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...] | None, pad: list[int] = ...
    ) -> None:
        """Start sequences. tokens: [B, L] prompt + first generated token, row b left-padded by pad[b] (the argument
        is passed only when some row is padded); hidden: per layer [B, L-1, H] (the prefill rows, i.e. the states
        that predicted tokens[:, 1:])."""
        ...

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """Draft up to k tokens deep after the last committed token (fewer, even zero, is allowed)."""
        ...

    def advance(
        self,
        accepted_nodes: list[list[int]],
        new_tokens: torch.Tensor,
        hidden: tuple[torch.Tensor, ...] | None,
    ) -> None:
        """Commit. accepted_nodes[b]: row b's indices into the last Proposal, root to leaf (length a_b);
        new_tokens: [B, A] (row b: its a_b accepted tokens + the target's correction/bonus, then padding);
        hidden: per layer [B, A, H] (the same columns)."""
        ...

    # Optional (batches): `retain(rows: list[int])` keeps only those rows (ascending batch indices) of every
    # per-row state, after a step's advance; a proposer without it is single-row (decode.rowwise wraps it).


def proposal_nodes(proposer, k: int) -> int:
    """The most nodes a proposal of `proposer` may hold at draft depth k (its `max_nodes`, at least k)."""
    most = getattr(proposer, "max_nodes", 0) or 0
    return max(k, int(most(k) if callable(most) else most))


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the root have depth 1)."""
    depth: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree parents must precede children: parents[{i}] = {p}")
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def tree_attention_mask(
    parents: list[int],
    prefix_len: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batch: int = 1,
    kv_len: int | None = None,
) -> torch.Tensor:
    """Additive mask [B, 1, 1 + N, kv_len] for the verify block [root, node_1..node_N] after prefix_len committed
    tokens (kv_len defaults to prefix_len + 1 + N; a static cache passes its full length, columns past the block
    stay masked): every row sees the whole committed prefix; inside the block a row sees its ancestors and itself
    (SpecInfer/Medusa tree attention). 0 = attend, finfo.min = masked; HF passes a 4D mask through as-is.
    The one-row case of decode.ragged.block_mask, which the decoder uses."""
    from .ragged import block_mask, block_visibility

    visible = block_visibility([parents] * batch, len(parents) + 1, device)
    return block_mask([0] * batch, [prefix_len] * batch, prefix_len, visible, dtype, kv_len)
