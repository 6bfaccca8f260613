"""The Medusa proposer for the speculative decoder (draftsmith.decode.proposer protocol): the drafter kind `medusa:`.

It proposes a static sparse TREE of deterministically chosen tokens (top-k of each head), so `draft_probs` is None:
each node is a point mass and the decoder's verification stays exact under sampling too. Every row of a batch
drafts from its own last state in the same head forward (one tree shape for all rows). The tree comes from the
head folder's measured rank accuracies (head_accuracy.json, written by the training eval; the top-1 chain without
it).
"""

from __future__ import annotations

import logging

import torch

from draftsmith.decode.proposer import Proposal
from draftsmith.errors import DraftsmithError
from draftsmith.heads.io import load_head, read_accuracy
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.heads.medusa.training import merge_target_lora
from draftsmith.heads.medusa.trees import chain_tree, medusa_tree, tree_parents
from draftsmith.sampling import SamplingParams

log = logging.getLogger(__name__)


class MedusaProposer:
    """Medusa heads on the target's final normed hidden state (HF hidden_states index num_layers)."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, num_layers: int, paths: list[tuple[int, ...]]):
        self.heads = heads
        self.hidden_state_layers = (num_layers,)
        self.paths = paths
        self.parents = tree_parents(paths)
        self.topk = 1 + max(r for p in paths for r in p)
        self.depths = [len(p) for p in paths]
        self.used_depth = max(self.depths)

    @property
    def tree(self) -> str | bool:
        """What eval.json records: the static tree as drafted (its depth capped by k)."""
        keep = [d for d in self.depths if d <= self.used_depth]
        return (
            False
            if len(keep) == self.used_depth
            else f"medusa static {len(keep)} nodes depth={self.used_depth}"
        )

    def begin(self, tokens: torch.Tensor, hidden, pad: list[int] | None = None) -> None:
        """Batches: rows are left-padded, so every row's last column is its own last state."""
        self.last = hidden[0][:, -1]  # [B, H]: the state that predicted the last committed token

    def retain(self, rows: list[int]) -> None:
        self.last = self.last[rows]

    def propose(self, k: int, params: SamplingParams, generator=None) -> Proposal:
        keep = [i for i, d in enumerate(self.depths) if d <= k]
        self.used_depth = min(k, max(self.depths))
        logits = self.heads(self.last)  # [K, B, V_d]
        top = self.heads.target_ids(logits.topk(self.topk, dim=-1).indices)  # [K, B, topk] target ids
        toks = torch.stack([top[len(p) - 1, :, p[-1]] for p in (self.paths[i] for i in keep)], 1)  # [B, N]
        if len(keep) == len(self.paths):
            return Proposal(toks, self.parents)
        remap = {old: new for new, old in enumerate(keep)}  # depth-capped subtree (parents precede children)
        return Proposal(toks, [remap[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep])

    def advance(self, accepted_nodes: list[list[int]], new_tokens, hidden) -> None:
        """Row b's committed tokens fill its first a_b + 1 columns (decode.proposer: batches)."""
        h = hidden[0]
        if h.shape[0] == 1:
            self.last = h[:, len(accepted_nodes[0])]
        else:
            self.last = h[torch.arange(h.shape[0]), torch.tensor([len(a) for a in accepted_nodes])]


def build_medusa(path: str, o: dict, ctx) -> MedusaProposer:
    """`medusa:DIR[,total_tokens=N,depth=D,chain=1]`: static tree from DIR/head_accuracy.json. A Medusa-2
    folder (DIR/target_lora) has its LoRA merged into ctx.target first, in place: plain decoding in the same
    run then uses the fine-tuned target as well, which is the model Medusa-2 speculative decoding reproduces."""
    heads = load_head(path, ctx.target)
    if not isinstance(heads, MedusaHeads):
        raise DraftsmithError(f"{path} holds a {heads.head_type} head, not Medusa heads")
    if merge_target_lora(ctx.target, path):
        log.warning(
            "medusa: merged the Medusa-2 LoRA adapter of %s into the target (plain decoding too)", path
        )
    depth = min(o.get("depth", heads.config.num_heads), heads.config.num_heads)
    acc = (read_accuracy(path) or {}).get("rank_accuracy")
    if o.get("chain") or acc is None:
        paths = chain_tree(depth)
    else:
        # measured accuracies of zero everywhere (an untrained head) give no tree: fall back to the chain
        paths = medusa_tree(acc, o.get("total_tokens", 16), depth) or chain_tree(depth)
    return MedusaProposer(heads, ctx.target.config.num_hidden_layers, paths)
