"""Medusa and EAGLE proposers for the speculative decoder (draftsmith.decode.proposer protocol).

Importing this module registers the drafter kinds `medusa:` and `eagle:` (EAGLE-1 or EAGLE-3, read from the
head's config; `eagle3:` is an alias) in draftsmith.decode.drafters.DRAFTERS, so
`draftsmith eval --drafter eagle:DIR[,top_k=8,depth=6,total_tokens=24]` works.

Both propose TREES of deterministically chosen tokens (top-k), so `draft_probs` is None: each node is a point mass
and the decoder's verification stays exact under sampling too (greedy output == the target's greedy output).
- Medusa: static sparse tree from the head folder's measured rank accuracies (head_accuracy.json, written by the
  training eval; falls back to the top-1 chain without it).
- EAGLE: EAGLE-2 dynamic tree. Depth 1 = the top_k tokens after the context; at each further depth the top_k
  nodes of the previous depth (by cumulative draft log-prob) are expanded in ONE head forward, each giving top_k
  children; finally the `total_tokens` best nodes of all depths (by cumulative log-prob) form the tree
  (EAGLE-2, Li et al. 2024, sec. 4). top_k=1 gives the EAGLE chain.
The head keeps a KV cache of context entries (target feature at s, token s+1) at position s; drafted nodes are
never added to it: after verification the accepted tokens are re-run with the target's real features.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.decode.drafters import DRAFTERS, DrafterContext, parse_kv
from draftsmith.decode.proposer import Proposal
from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import base_decoder, output_head
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.io import load_head, read_accuracy
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.heads.trees import chain_tree, medusa_tree, tree_parents
from draftsmith.sampling import SamplingParams


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

    def begin(self, tokens: torch.Tensor, hidden) -> None:
        self.last = hidden[0][:, -1]  # [B, H]: the state that predicted the last committed token

    def propose(self, k: int, params: SamplingParams, generator=None) -> Proposal:
        keep = [i for i, d in enumerate(self.depths) if d <= k]
        logits = self.heads(self.last)  # [K, B, V]
        top = logits.topk(self.topk, dim=-1).indices  # [K, B, topk]
        toks = torch.stack([top[len(p) - 1, :, p[-1]] for p in (self.paths[i] for i in keep)], 1)  # [B, N]
        if len(keep) == len(self.paths):
            return Proposal(toks, self.parents)
        remap = {old: new for new, old in enumerate(keep)}  # depth-capped subtree (parents precede children)
        return Proposal(toks, [remap[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep])

    def advance(self, accepted_nodes, new_tokens, hidden) -> None:
        self.last = hidden[0][:, -1]


class EagleProposer:
    """EAGLE-1/EAGLE-3 head drafting an EAGLE-2 dynamic tree (top_k=1: a chain)."""

    name = "eagle"

    def __init__(self, head: EagleHead, target, *, top_k: int = 8, depth: int = 6, total_tokens: int = 24):
        if top_k < 1 or depth < 1 or total_tokens < 1:
            raise DraftsmithError(
                f"eagle needs top_k, depth, total_tokens >= 1, got {top_k}, {depth}, {total_tokens}"
            )
        self.head, self.c = head, head.config
        self.top_k, self.depth, self.total = top_k, depth, total_tokens
        self.embed = base_decoder(target).embed_tokens.weight
        self.lm_weight = output_head(target).weight
        n = target.config.num_hidden_layers
        self.eagle3 = self.c.kind == "eagle3"
        self.hidden_state_layers = tuple(self.c.aux_hidden_state_layer_ids) if self.eagle3 else (n,)
        self.vocab_ids = head.vocab_ids

    # -- context ----------------------------------------------------------------------------------------------
    def begin(self, tokens: torch.Tensor, hidden) -> None:
        self.kv = None  # (k, v) [B, h_kv, S, D] of context entries 0..S-1
        self._queue(hidden, tokens[:, 1:])

    def advance(self, accepted_nodes, new_tokens, hidden) -> None:
        self._queue(hidden, new_tokens)

    def _queue(self, hidden, tokens) -> None:
        feats = torch.cat(hidden, -1) if self.eagle3 else hidden[0]  # [B, n, 3H | H]
        self.pending = (feats.to(self.embed.dtype), tokens.to(self.embed.device))

    def _run_pending(self) -> torch.Tensor:
        feats, toks = self.pending
        b, n = toks.shape
        start = 0 if self.kv is None else self.kv[0].shape[2]
        pos = (start + torch.arange(n, device=toks.device))[None].expand(b, n)
        mask = torch.ones(n, start + n, dtype=torch.bool, device=toks.device)
        mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=toks.device).tril()
        out, (k, v) = self.head.step(
            self.embed[toks], feats, pos, mask[None, None], kv_extra=self.kv, from_target=True
        )
        self.kv = (
            (k, v) if self.kv is None else (torch.cat([self.kv[0], k], 2), torch.cat([self.kv[1], v], 2))
        )
        self.pending = None
        return out[:, -1]  # [B, H]: its logits give the depth-1 candidates

    def _logp(self, out: torch.Tensor) -> torch.Tensor:
        logits = self.head.logits(out, self.lm_weight)
        return torch.log_softmax(logits.float(), -1)

    # -- the tree ---------------------------------------------------------------------------------------------
    def propose(self, k: int, params: SamplingParams, generator=None) -> Proposal:
        if self.pending is not None:
            self.root_out = self._run_pending()
        depth = min(self.depth, k)
        dev = self.embed.device
        ctx_len = self.kv[0].shape[2]
        # candidate nodes across all depths: draft-vocab index, cumulative log-prob, parent candidate (-1 = root)
        top = self._logp(self.root_out)[0].topk(self.top_k)  # batch 1 (leading dim kept in the protocol)
        frontier = torch.arange(self.top_k, device=dev)  # candidate ids of the nodes to expand next
        frontier_out = self.root_out.expand(
            self.top_k, -1
        )  # parents' outputs (the layer input of their children)
        tree_k = tree_v = None  # keys of expanded nodes [1, h, M, D]
        anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # ancestor-or-self among expanded nodes [M, M]
        n_cand = self.top_k
        all_tok, all_score = top.indices, top.values
        all_parent = torch.full((self.top_k,), -1, device=dev, dtype=torch.long)
        expanded_ids = []  # candidate id of each expanded node (row of tree_k)
        self._level_sizes = []
        for d in range(1, depth):
            m0 = len(expanded_ids)
            toks = all_tok[frontier]
            ids = toks if self.vocab_ids is None else self.vocab_ids[toks]
            # rows: frontier nodes; each sees the context, its expanded ancestors and itself
            par_rows = [
                expanded_ids.index(int(p)) if int(p) >= 0 else -1 for p in all_parent[frontier].tolist()
            ]
            new_anc = torch.zeros(len(par_rows), m0 + len(par_rows), dtype=torch.bool, device=dev)
            for r, pr in enumerate(par_rows):
                if pr >= 0:
                    new_anc[r, :m0] = anc[pr]
                new_anc[r, m0 + r] = True
            mask = torch.cat([torch.ones(len(par_rows), ctx_len, dtype=torch.bool, device=dev), new_anc], 1)
            extra = (
                self.kv
                if tree_k is None
                else (torch.cat([self.kv[0], tree_k], 2), torch.cat([self.kv[1], tree_v], 2))
            )
            pos = torch.full((1, len(par_rows)), ctx_len - 1 + d, device=dev)
            out, (k_new, v_new) = self.head.step(
                self.embed[ids][None],
                frontier_out[None],
                pos,
                mask[None, None],
                kv_extra=extra,
                from_target=not self.eagle3,
            )
            # EAGLE-1 always fuses [embed; feature] through fc; EAGLE-3 feeds its own output without fc
            tree_k = k_new if tree_k is None else torch.cat([tree_k, k_new], 2)
            tree_v = v_new if tree_v is None else torch.cat([tree_v, v_new], 2)
            anc = torch.cat(
                [torch.cat([anc, torch.zeros(m0, len(par_rows), dtype=torch.bool, device=dev)], 1), new_anc],
                0,
            )
            expanded_ids += frontier.tolist()
            logp = self._logp(out[0])  # [F, V_d]
            child = logp.topk(self.top_k, dim=-1)
            score = (all_score[frontier][:, None] + child.values).flatten()  # cumulative log-prob
            ctok = child.indices.flatten()
            cpar = frontier[:, None].expand(-1, self.top_k).flatten()
            best = score.topk(min(self.top_k, score.numel())).indices  # next depth expands the top_k of these
            all_tok, all_score = torch.cat([all_tok, ctok]), torch.cat([all_score, score])
            all_parent = torch.cat([all_parent, cpar])
            frontier = n_cand + best
            frontier_out = out[0][best // self.top_k]
            n_cand += score.numel()
            self._level_sizes.append(score.numel())
        # rerank every candidate by cumulative log-prob; the depth penalty breaks ties (log-prob 0.0) in favour
        # of parents, so a child never outranks its parent and the chosen set is closed under ancestors
        depth_of = torch.cat(
            [torch.zeros(self.top_k, device=dev)]
            + [torch.full((n,), float(i + 1), device=dev) for i, n in enumerate(self._level_sizes)]
        )
        keep = (all_score - 1e-4 * depth_of).topk(min(self.total, n_cand)).indices.sort().values
        where = {c: i for i, c in enumerate(keep.tolist())}
        parents = [where[p] if p >= 0 else -1 for p in all_parent[keep].tolist()]
        toks = all_tok[keep]
        ids = toks if self.vocab_ids is None else self.vocab_ids[toks]
        return Proposal(ids[None], parents)


def _split(arg: str) -> tuple[str, str]:
    path, _, opts = arg.partition(",")
    if not path:
        raise DraftsmithError(
            "head drafters need a folder: medusa:DIR or eagle:DIR[,top_k=8,depth=6,total_tokens=24]"
        )
    if not Path(path).is_dir():
        raise DraftsmithError(
            f"head folder {path} not found; pass the final/ folder written by train/heads.py"
        )
    return path, opts


def build_medusa(arg: str, ctx: DrafterContext) -> MedusaProposer:
    """`medusa:DIR[,total_tokens=N,depth=D,chain=1]`: static tree from DIR/head_accuracy.json."""
    path, opts = _split(arg)
    o = parse_kv(opts, {"total_tokens": int, "depth": int, "chain": int}, "medusa")
    heads = load_head(path, ctx.target)
    if not isinstance(heads, MedusaHeads):
        raise DraftsmithError(f"{path} holds a {heads.head_type} head; use eagle:{path}")
    depth = min(o.get("depth", heads.config.num_heads), heads.config.num_heads)
    acc = (read_accuracy(path) or {}).get("rank_accuracy")
    if o.get("chain") or acc is None:
        paths = chain_tree(depth)
    else:
        # measured accuracies of zero everywhere (an untrained head) give no tree: fall back to the chain
        paths = medusa_tree(acc, o.get("total_tokens", 16), depth) or chain_tree(depth)
    return MedusaProposer(heads, ctx.target.config.num_hidden_layers, paths)


def build_eagle(arg: str, ctx: DrafterContext) -> EagleProposer:
    """`eagle:DIR[,top_k=8,depth=6,total_tokens=24]` (EAGLE-1 or EAGLE-3 by config)."""
    path, opts = _split(arg)
    o = parse_kv(opts, {"top_k": int, "depth": int, "total_tokens": int}, "eagle")
    head = load_head(path, ctx.target)
    if not isinstance(head, EagleHead):
        raise DraftsmithError(f"{path} holds a medusa head; use medusa:{path}")
    return EagleProposer(head, ctx.target, **o)


DRAFTERS["medusa"] = build_medusa
DRAFTERS["eagle"] = build_eagle
DRAFTERS["eagle3"] = build_eagle
