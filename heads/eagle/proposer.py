"""The EAGLE proposer for the speculative decoder (draftsmith.decode.proposer protocol): the drafter kinds `eagle:`
and `eagle3:` (EAGLE-1 or EAGLE-3, read from the head's config), e.g.
`draftsmith eval --drafter eagle:DIR[,top_k=8,total_tokens=24] --k 6`.

It proposes TREES of deterministically chosen tokens (top-k), so `draft_probs` is None: each node is a point mass
and the decoder's verification stays exact under sampling too (greedy output == the target's greedy output).
EAGLE-2 dynamic tree: depth 1 = the top_k tokens after the context; at each further depth the top_k
  nodes of the previous depth (by cumulative draft log-prob) are expanded in ONE head forward, each giving top_k
  children; finally the `total_tokens` best nodes of all depths (by cumulative log-prob) form the tree
  (EAGLE-2, Li et al. 2024, sec. 4). top_k=1 gives the EAGLE chain.
The head keeps a KV cache of context entries (target feature at s, token s+1) at position s; drafted nodes are
never added to it: after verification the accepted tokens are re-run with the target's real features.
"""

from __future__ import annotations

import torch

from draftsmith.decode.proposer import Proposal
from draftsmith.decode.trees import dynamic_tree
from draftsmith.errors import DraftsmithError
from draftsmith.heads.eagle.model import EagleHead
from draftsmith.heads.io import load_head
from draftsmith.heads.layers import KVBuffer, rope_cos_sin
from draftsmith.modeling import base_decoder, output_head
from draftsmith.sampling import SamplingParams


class EagleProposer:
    """EAGLE-1/EAGLE-3 head drafting an EAGLE-2 dynamic tree (top_k=1: a chain).

    Per step: one head forward over the newly committed tokens (context rows, written to a preallocated
    KVBuffer), then depth-1 forwards of top_k rows each. The per-depth work is tensor ops only (ancestor masks
    gathered from the parents' rows, RoPE from a cached table); the host sees the tree once, at the end."""

    name = "eagle"

    def __init__(
        self, head: EagleHead, target, *, top_k: int = 8, depth: int | None = None, total_tokens: int = 24
    ):
        """depth: the tree depth; None = the decoder's k (draft tokens per step) decides."""
        if top_k < 1 or (depth is not None and depth < 1) or total_tokens < 1:
            raise DraftsmithError(
                f"eagle needs top_k, depth, total_tokens >= 1, got {top_k}, {depth}, {total_tokens}"
            )
        self.head, self.c = head, head.config
        self.top_k, self.depth, self.total = top_k, depth, total_tokens
        self.used_depth = depth
        self.max_nodes = total_tokens  # the decoder sizes static caches from it
        self.embed = base_decoder(target).embed_tokens.weight
        self.lm_weight = output_head(target).weight
        n = target.config.num_hidden_layers
        self.eagle3 = self.c.kind == "eagle3"
        self.hidden_state_layers = tuple(self.c.aux_hidden_state_layer_ids) if self.eagle3 else (n,)
        self.vocab_ids = head.vocab_ids
        self.dtype = self.embed.dtype
        self._rope_table(1024)

    @property
    def tree(self) -> str:
        """What eval.json records: the tree as drafted (depth = the deepest step's, min(depth, k); the last steps of a
        generation may draft shallower trees to stay within max_new_tokens)."""
        depth = self.used_depth if self.used_depth is not None else "k"
        return f"eagle2 dynamic top_k={self.top_k} depth={depth} total_tokens={self.total}"

    def _depth(self, k: int) -> int:
        depth = k if self.depth is None else min(self.depth, k)
        self.used_depth = max(depth, self.used_depth or 0)
        return depth

    def _rope_table(self, n: int) -> None:
        pos = torch.arange(n, device=self.embed.device)[None]
        cos, sin = rope_cos_sin(pos, self.c.head_dim, self.c.rope_theta, self.dtype)
        self._cos, self._sin = cos[0, 0], sin[0, 0]  # [n, D]

    def _rope(self, pos: torch.Tensor, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [T] (at most `last`, known on the host: no device sync per draft step) -> (cos, sin) [1, 1, T, D]
        from the cached table (grown on demand)."""
        need = last + 1
        if need > self._cos.shape[0]:
            self._rope_table(max(need, 2 * self._cos.shape[0]))
        return self._cos[pos][None, None], self._sin[pos][None, None]

    # -- context ----------------------------------------------------------------------------------------------
    def begin(self, tokens: torch.Tensor, hidden) -> None:
        c = self.c
        cap = max(256, 2 * tokens.shape[1] + self.total)
        self.kv = KVBuffer(
            tokens.shape[0], c.num_key_value_heads, c.head_dim, self.dtype, self.embed.device, cap
        )
        self._queue(hidden, tokens[:, 1:])

    def advance(self, accepted_nodes, new_tokens, hidden) -> None:
        self._queue(hidden, new_tokens)

    def _queue(self, hidden, tokens) -> None:
        feats = torch.cat(hidden, -1) if self.eagle3 else hidden[0]  # [B, n, 3H | H]
        self.pending = (feats.to(self.dtype), tokens.to(self.embed.device))

    def _run_pending(self) -> torch.Tensor:
        """Context rows (target feature at s, token s+1) at positions s; committed to the KV buffer."""
        feats, toks = self.pending
        b, n = toks.shape
        start = self.kv.length
        dev = toks.device
        pos = start + torch.arange(n, device=dev)
        mask = torch.ones(n, start + n, dtype=torch.bool, device=dev)
        mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        out, _ = self.head.step(
            self.embed[toks],
            feats,
            pos[None].expand(b, n),
            mask[None, None],
            kv_extra=self.kv,
            from_target=True,
            rope=self._rope(pos, start + n - 1),
        )
        self.kv.length = start + n
        self.pending = None
        return out[:, -1]  # [B, H]: its logits give the depth-1 candidates

    def _logp(self, out: torch.Tensor) -> torch.Tensor:
        logits = self.head.logits(out, self.lm_weight)
        return torch.log_softmax(logits.float(), -1)

    # -- the tree ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, k: int, params: SamplingParams, generator=None) -> Proposal:
        if self.pending is not None:
            self.root_out = self._run_pending()
        dev = self.embed.device
        ctx_len = self.kv.length
        parent_out = [
            self.root_out.expand(self.top_k, -1)
        ]  # outputs of the last step: the children's layer input

        def expand(tok, attend, d, parent_local):
            f = tok.shape[0]
            inputs = parent_out[0] if parent_local is None else parent_out[0][parent_local]
            mask = torch.cat([torch.ones(f, ctx_len, dtype=torch.bool, device=dev), attend], 1)  # context too
            ids = tok if self.vocab_ids is None else self.vocab_ids[tok]
            pos = torch.full((f,), ctx_len - 1 + d, device=dev)
            self.kv.length = (
                ctx_len + attend.shape[1] - f
            )  # drafted rows live past the context until the commit
            out, _ = self.head.step(
                self.embed[ids][None],
                inputs[None],
                pos[None],
                mask[None, None],
                kv_extra=self.kv,
                from_target=not self.eagle3,  # EAGLE-1 always fuses [embed; feature]; EAGLE-3 feeds its output
                rope=self._rope(pos, ctx_len - 1 + d),
            )
            parent_out[0] = out[0]
            return self._logp(out[0])

        toks, parents = dynamic_tree(
            self._logp(self.root_out)[0], expand, top_k=self.top_k, depth=self._depth(k), total=self.total
        )
        self.kv.length = ctx_len
        ids = toks if self.vocab_ids is None else self.vocab_ids[toks]
        return Proposal(ids[None], parents)


def build_eagle(path: str, o: dict, ctx) -> EagleProposer:
    """`eagle:DIR[,top_k=8,total_tokens=24]` (EAGLE-1 or EAGLE-3 by config; depth = the decoder's k)."""
    head = load_head(path, ctx.target)
    if not isinstance(head, EagleHead) or head.head_type not in ("eagle", "eagle3"):
        raise DraftsmithError(f"{path} holds a {head.head_type} head, not an EAGLE head")
    return EagleProposer(head, ctx.target, **o)
