"""The Proposer protocol: what every drafter (draft LM, n-gram, Medusa, EAGLE) gives the decoder.

Timeline of one decoding step (B = batch, N = proposed nodes, V = target vocabulary):

    committed tokens  x_1 .. x_L        target KV cache holds x_1 .. x_{L-1}; x_L ("root") is not in it yet
    proposer.propose(k, params, gen) -> Proposal(tokens [B, N], parents [N], draft_probs [B, N, V] | None)
    target forward over [x_L, node_1 .. node_N] with a tree mask       (one forward, N + 1 positions)
    accept a root-to-leaf path of a nodes, then one target token (correction or bonus)
    proposer.advance(accepted_nodes, new_tokens [B, a + 1], hidden)    (hidden only if requested)

Hidden states (EAGLE, Medusa): a proposer with `hidden_state_layers = (i, ...)` receives, for every committed
token x, the target hidden state *at the position that predicted x* (the row whose logits x was sampled from),
one tensor [B, n, H] per requested index. Indices follow HF `output_hidden_states`: index i < num_layers is the
state *entering* decoder layer i (0 = embeddings); index num_layers is the final hidden state after the final
norm (what the lm_head reads; HF transformers 5 returns the normed state there).

Tree proposals: `parents[i]` is the index of node i's parent, -1 for children of the root; parents must come
before children (parents[i] < i). A chain of k tokens is parents = [-1, 0, 1, ..., k-2].

Draft probabilities (speculative sampling): `draft_probs[:, i]` is the warped distribution node i's token was
*sampled* from, independently of its siblings. Proposers that choose tokens deterministically (argmax, top-k,
n-gram lookup) pass `draft_probs=None`: each node then counts as a point mass on its token, which keeps
verification exact (accept with prob p(x), else drop x from p and renormalise; EAGLE's rule for trees).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from draftsmith.sampling import SamplingParams


@dataclass
class Proposal:
    """Draft tokens as a tree (a chain is a tree). tokens: [B, N] target ids; parents: [N] (-1 = root)."""

    tokens: torch.Tensor
    parents: list[int]
    draft_probs: torch.Tensor | None = None  # [B, N, V] warped draft distributions, or None (point masses)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[-1])

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @staticmethod
    def chain(tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> Proposal:
        """A chain of tokens [B, n]: parents = [-1, 0, 1, ...]."""
        return Proposal(tokens, list(range(-1, tokens.shape[-1] - 1)), draft_probs)

    @staticmethod
    def empty(batch: int, device: torch.device | str) -> Proposal:
        """No draft: the step is a plain autoregressive step."""
        return Proposal(torch.empty(batch, 0, dtype=torch.long, device=device), [], None)


@runtime_checkable
class Proposer(Protocol):
    """A drafter. Reused across prompts: `begin()` resets all per-sequence state (KV cache, committed tokens).
    Proposals must be at most k deep (the decoder raises otherwise)."""

    name: str
    # HF output_hidden_states indices the proposer needs (empty = none); see the module docstring.
    hidden_state_layers: tuple[int, ...]
    # Optional attribute `max_nodes: int`: the most nodes one Proposal may hold (sizes static caches; default k).
    # Optional attribute `tree`: a short description of the tree shape, copied into eval.json conditions.
    # Optional hooks (self-speculative drafters, heads.selfspec): `attach(decoder, cache)` right after the
    # prefill hands over the target's KV cache; `verify_forward(block, proposal) -> (logits, hidden) | None`
    # replaces the decoder's verify forward when the proposer can reuse shared-layer work (None = not this step).

    def begin(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...] | None) -> None:
        """Start a sequence. tokens: [B, L] prompt + first generated token; hidden: per layer [B, L-1, H]
        (the prefill rows, i.e. the states that predicted tokens[:, 1:])."""
        ...

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """Draft up to k tokens deep after the last committed token (fewer, even zero, is allowed)."""
        ...

    def advance(
        self, accepted_nodes: list[int], new_tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...] | None
    ) -> None:
        """Commit. accepted_nodes: indices into the last Proposal, root to leaf (length a);
        new_tokens: [B, a + 1] (accepted tokens + the target's correction/bonus); hidden: per layer [B, a + 1, H]."""
        ...


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
    """Additive mask [B, 1, 1 + N, kv_len] for the verify block [root, node_1..node_N] (kv_len defaults to
    prefix_len + 1 + N; a static cache passes its full length, columns past the block stay masked).

    Every row sees the whole committed prefix; inside the block a row sees its ancestors and itself
    (SpecInfer/Medusa tree attention). 0 = attend, finfo.min = masked; HF passes a 4D mask through as-is.
    """
    n = len(parents) + 1
    allowed = torch.eye(n, dtype=torch.bool)
    allowed[:, 0] = True  # the root is everyone's ancestor
    for i, p in enumerate(parents):  # row i+1 inherits its parent's ancestors (parents precede children)
        if p >= 0:
            allowed[i + 1] |= allowed[p + 1]
    block = torch.zeros(n, n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    kv_len = prefix_len + n if kv_len is None else kv_len
    mask = torch.full((batch, 1, n, kv_len), torch.finfo(dtype).min, dtype=dtype)
    mask[:, 0, :, :prefix_len] = 0.0
    mask[:, 0, :, prefix_len : prefix_len + n] = block
    return mask.to(device)
