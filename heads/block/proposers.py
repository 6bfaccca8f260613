"""Proposers for the block-parallel drafters: every draft position comes out of ONE drafter forward.

    draftsmith eval --drafter dflash:DIR[,top_k=1,total_tokens=16]   (DFlash block drafter)
    draftsmith eval --drafter peagle:DIR[,top_k=1,total_tokens=16]   (P-EAGLE)

The forward gives one distribution q_j per draft position j = 1..P (P = min(k, block_size-1) for DFlash,
min(k, depth) for P-EAGLE); q_j does not depend on the tokens chosen at positions < j (they are masks/placeholders
in that forward).
- top_k = 1 (default): a chain. Greedy: argmax_j. Sampling: x_j ~ warp(q_j) independently, and draft_probs[j] =
  warp(q_j) -- exactly the distribution x_j was drawn from, so speculative sampling stays lossless.
- top_k > 1: a tree of the top_k tokens of every position, grown best-first by cumulative draft log-prob until
  total_tokens nodes (each node's children are the top_k of the next position). Nodes are chosen
  deterministically, so draft_probs is None (point masses; the decoder's recursive rejection stays exact).
"""

from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F

from draftsmith.decode.proposer import Proposal
from draftsmith.errors import DraftsmithError
from draftsmith.heads.block.dflash import DFlashDrafter
from draftsmith.heads.block.peagle import PEagleHead
from draftsmith.heads.eagle.proposer import EagleProposer
from draftsmith.heads.layers import KVBuffer, rope_cos_sin
from draftsmith.modeling import base_decoder
from draftsmith.sampling import SamplingParams, sample, warp_probs
from draftsmith.vocab import to_target_probs


def best_first_tree(logp: torch.Tensor, top_k: int, total: int) -> tuple[list[tuple[int, int]], list[int]]:
    """logp [P, V] per-position log-probs -> (nodes as (position, vocab column), parents) of the `total` best
    root paths by cumulative log-prob, each position offering its top_k columns. Parents precede children."""
    top = logp.topk(min(top_k, logp.shape[-1]), -1)
    vals, cols = top.values.tolist(), top.indices.tolist()
    heap = [(-vals[0][r], 0, r, -1) for r in range(len(vals[0]))]
    heapq.heapify(heap)
    nodes: list[tuple[int, int]] = []
    parents: list[int] = []
    while heap and len(nodes) < total:
        neg, j, r, parent = heapq.heappop(heap)
        nodes.append((j, cols[j][r]))
        parents.append(parent)
        if j + 1 < len(vals):
            me = len(nodes) - 1
            for r2, v in enumerate(vals[j + 1]):
                heapq.heappush(heap, (neg - v, j + 1, r2, me))
    return nodes, parents


def block_proposal(
    logits: torch.Tensor,
    vocab_ids: torch.Tensor,
    vocab_size: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    top_k: int,
    total: int,
) -> Proposal:
    """Draft logits [P, V_d] of one forward -> a chain (top_k 1) or a best-first tree (module docstring)."""
    if top_k <= 1:
        if params.greedy:
            return Proposal.chain(vocab_ids[logits.argmax(-1)][None])
        q = warp_probs(logits, params)  # [P, V_d]: what each position's token is drawn from
        idx = sample(q, generator)
        return Proposal.chain(vocab_ids[idx][None], to_target_probs(q, vocab_ids, vocab_size)[None])
    nodes, parents = best_first_tree(torch.log_softmax(logits.float(), -1), top_k, total)
    cols = torch.tensor([c for _, c in nodes], device=logits.device)
    return Proposal(vocab_ids[cols][None], parents)


def _tree_opts(o: dict, depth: int) -> tuple[int, int]:
    top_k, total = o.get("top_k", 1), o.get("total_tokens", 16)
    if top_k < 1 or total < 1:
        raise DraftsmithError(f"top_k and total_tokens must be >= 1, got {top_k}, {total}")
    return top_k, (depth if top_k == 1 else total)


class DFlashProposer:
    """DFlash block drafter. Context K/V (target features of the committed tokens) live in one KVBuffer per
    layer; a step runs the new context rows' projections, then ONE forward of [anchor, mask x (B-1)]."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, target, *, top_k: int = 1, total_tokens: int = 16):
        self.d, self.c = drafter, drafter.config
        self.embed = base_decoder(target).embed_tokens.weight
        self.dtype = drafter.fc.weight.dtype
        self.vocab_ids = drafter.vocab_ids
        self.vocab_size = self.c.vocab_size
        self.hidden_state_layers = tuple(self.c.aux_hidden_state_layer_ids)
        self.top_k, self.total = top_k, total_tokens
        self.max_nodes = max(total_tokens, self.c.block_size - 1)
        self.tree = f"dflash block {self.c.block_size}" + (
            f" top_k={top_k} total_tokens={total_tokens}" if top_k > 1 else " chain"
        )
        self.last_logits: torch.Tensor | None = (
            None  # [B-1, V_d] of the last propose (tests compare with training)
        )

    def begin(self, tokens: torch.Tensor, hidden) -> None:
        c = self.c
        cap = max(256, 2 * tokens.shape[1])
        dev = self.embed.device
        self.kv = [
            KVBuffer(1, c.num_key_value_heads, c.head_dim, self.dtype, dev, cap) for _ in self.d.layers
        ]
        self.pending = torch.cat(hidden, -1).to(self.dtype)  # states at positions 0..L-2
        self.anchor = tokens[:, -1:].to(dev)
        self.anchor_pos = tokens.shape[1] - 1

    def advance(self, accepted_nodes, new_tokens, hidden) -> None:
        feats = torch.cat(hidden, -1).to(self.dtype)  # states at the old anchor .. the last accepted node
        self.pending = feats if self.pending is None else torch.cat([self.pending, feats], 1)
        self.anchor = new_tokens[:, -1:].to(self.embed.device)
        self.anchor_pos += new_tokens.shape[1]

    @torch.inference_mode()
    def _logits(self) -> torch.Tensor:
        c, dev = self.c, self.embed.device
        if self.pending is not None and self.pending.shape[1] > 0:
            start, n = self.kv[0].length, self.pending.shape[1]
            pos = torch.arange(start, start + n, device=dev)[None]
            cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, self.dtype)
            for buf, (k, v) in zip(self.kv, self.d.context_kv(self.d.context(self.pending), cos, sin)):
                buf.write(k, v)
                buf.length = start + n
        self.pending = None
        blk = c.block_size
        tok = torch.full((1, blk), c.mask_token_id, dtype=torch.long, device=dev)
        tok[:, 0] = self.anchor[:, 0]
        pos = (self.anchor_pos + torch.arange(blk, device=dev))[None]
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, self.dtype)
        out = self.d.block(F.embedding(tok, self.embed).to(self.dtype), cos, sin, self.kv)
        return self.d.logits(out[0, 1:])  # [B-1, V_d]: row j predicts the token j after the anchor

    def propose(self, k: int, params: SamplingParams, generator=None) -> Proposal:
        self.last_logits = self._logits()
        p = min(k, self.c.block_size - 1)
        return block_proposal(
            self.last_logits[:p], self.vocab_ids, self.vocab_size, params, generator, self.top_k, self.total
        )


class PEagleProposer(EagleProposer):
    """P-EAGLE: EAGLE-3's context handling (KVBuffer of (feature at s, token s+1) rows) and ONE head forward over
    [new context rows; depth-1 placeholders]; the last context row gives depth 1, placeholder d gives depth d+1."""

    name = "peagle"

    def __init__(
        self, head: PEagleHead, target, *, top_k: int = 1, total_tokens: int = 16, depth: int | None = None
    ):
        if depth is not None and depth < 1:
            raise DraftsmithError(f"peagle depth must be >= 1, got {depth}")
        depth = head.num_depths if depth is None else min(depth, head.num_depths)
        super().__init__(head, target, top_k=1, depth=depth, total_tokens=max(total_tokens, depth))
        self.block_top_k, self.block_total = top_k, total_tokens
        self.vocab_size = head.config.vocab_size
        self.last_logits: torch.Tensor | None = None

    @property
    def tree(self) -> str:
        """What eval.json records: depth as drafted (min(the head's depths or depth=, k))."""
        shape = (
            f" top_k={self.block_top_k} total_tokens={self.block_total}" if self.block_top_k > 1 else " chain"
        )
        return f"peagle depth={self.used_depth}{shape}"

    @torch.inference_mode()
    def _logits(self, depth: int) -> torch.Tensor:
        h: PEagleHead = self.head
        feats, toks = self.pending
        b, n = toks.shape
        m = depth - 1
        dev = toks.device
        start = self.kv.length
        pos = torch.cat(
            [start + torch.arange(n, device=dev), start + n - 1 + torch.arange(1, m + 1, device=dev)]
        )
        mask = torch.ones(n + m, start + n + m, dtype=torch.bool, device=dev)
        mask[:, start:] = torch.ones(n + m, n + m, dtype=torch.bool, device=dev).tril()
        embeds = torch.cat([self.embed[toks], self.embed[h.mask_token_id].expand(b, m, -1)], 1)
        hidden = torch.cat([h.fc(feats), h.placeholder(m).expand(b, -1, -1)], 1)
        out, _ = h.step(
            embeds,
            hidden,
            pos[None],
            mask[None, None],
            kv_extra=self.kv,
            from_target=False,
            rope=self._rope(pos, start + n - 1 + m),
        )
        self.kv.length = start + n  # placeholders are not context
        self.pending = None
        return h.logits(out[0, n - 1 :])  # [depth, V_d]

    def propose(self, k: int, params: SamplingParams, generator=None) -> Proposal:
        depth = self._depth(k)
        if self.pending is not None:
            self.last_logits = self._logits(self.depth)
        return block_proposal(
            self.last_logits[:depth],
            self.vocab_ids,
            self.vocab_size,
            params,
            generator,
            self.block_top_k,
            self.block_total,
        )


def _load(path: str, ctx, kind: str, cls):
    from draftsmith.heads.io import load_head

    head = load_head(path, ctx.target)
    if not isinstance(head, cls):
        raise DraftsmithError(
            f"{path} holds a {getattr(head, 'head_type', type(head).__name__)} head, not {kind}"
        )
    return head


def build_dflash(path: str, o: dict, ctx) -> DFlashProposer:
    """`dflash:DIR[,top_k=1,total_tokens=16]`."""
    d = _load(path, ctx, "dflash", DFlashDrafter)
    top_k, total = _tree_opts(o, d.config.block_size - 1)
    return DFlashProposer(d, ctx.target, top_k=top_k, total_tokens=total)


def build_peagle(path: str, o: dict, ctx) -> PEagleProposer:
    """`peagle:DIR[,top_k=1,total_tokens=16,depth=D]` (depth: at most the head's num_depths; default: all of them,
    cut to the decoder's k)."""
    h = _load(path, ctx, "peagle", PEagleHead)
    depth = min(o.get("depth", h.num_depths), h.num_depths)
    top_k, total = _tree_opts(o, depth)
    return PEagleProposer(h, ctx.target, top_k=top_k, total_tokens=total, depth=depth)
