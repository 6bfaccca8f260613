"""Self-speculative drafting: the target drafts for itself with a subset of its own decoder layers.

Two drafters share this machinery (no weight is copied, the target is never modified):
- layer skipping (Draft&Verify, SWIFT): the draft runs the target's layers minus a skip set, then its final norm
  and lm_head (optionally only the rows of a reduced vocabulary);
- early exit (Kangaroo): the target's first L layers, then a small trained adapter (draftsmith.heads.selfspec.earlyexit)
  and the target's lm_head rows.

KV cache sharing. The draft runs on the TARGET's DynamicCache: a drafted token's query in layer i attends to the
full model's keys/values of the committed context in that layer (what the verify pass wrote there) plus the
drafted rows the draft itself appended to layer i. No second KV cache for the layers it runs.

Shared work (`reuse`). The leading layers 0..P-1 that the draft runs unchanged (P = the first skipped layer, or
L for early exit) compute exactly what the verify pass computes for the drafted tokens: same weights, same
inputs (the token embedding and the same context rows). With reuse on, their K/V rows stay in the target cache
and their layer-P outputs are kept; the verify pass (`verify_forward`, called by the decoder instead of its own
forward) runs layers 0..P-1 only for block tokens the draft did not process (the last drafted token, usually
one) and layers P..N-1 for the whole block. Rows of the other layers the draft ran are inexact (their inputs
differ from the full model's) and are cropped before the verify. Lossless: the verify logits are the target's
own layers applied to the target's own states; only the row grouping of layers 0..P-1 differs from a block
recompute (one-token steps, as in plain decoding). Trees: the draft's rows are cropped and the decoder's own
tree-masked forward verifies (reuse is implemented for chains).

Timeline of one step (P shared layers, cache length c = committed tokens minus the root):
    propose: root, d1, .. through the draft layers at positions c, c+1, ..; each appends to the layers it runs
    end of propose: layers >= P cropped to c; layers < P keep rows [root, d1 .. d_j] (reuse) or are cropped
    verify_forward: layers < P for d_{j+1} .. d_n, layers >= P for [root, d1 .. d_n] -> logits [1, 1 + n, V]
    the decoder then crops / compacts every layer to the accepted path as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from draftsmith.decode.proposer import Proposal
from draftsmith.decode.trees import dynamic_tree
from draftsmith.errors import DraftsmithError
from draftsmith.heads.selfspec.targetlayers import TargetLayers, crop_layers
from draftsmith.sampling import SamplingParams, sample, warp_probs


class DraftTop(Protocol):
    """What turns the draft layers' output into draft logits (the target's norm + head, or a trained adapter)."""

    hidden_state_layers: tuple[
        int, ...
    ]  # target states the top needs for committed tokens (decoder protocol)
    vocab_ids: torch.Tensor | None  # [V_d] target ids of the logits' columns (None = the full vocabulary)

    def begin(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...] | None, pad: list[int]) -> None:
        """tokens [B, L] left-padded by pad[b] (decode.proposer: batches), hidden per layer [B, L - 1, H]."""
        ...

    def advance(self, new_tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...] | None, counts: list[int]):
        """Row b committed its first counts[b] columns of new_tokens [B, A] (hidden [B, A, H])."""
        ...

    def retain(self, rows: list[int]) -> None:
        """Keep only these batch rows (ascending)."""
        ...

    def logits(self, h: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor | None, m: int):
        """h [B, n, H] drafted rows after the draft layers -> logits [B, n, V_d]; rows see the context, the m
        rows drafted before this call and themselves as `block_mask` [n, m + n] says (None: causal)."""
        ...

    def end_draft(self) -> None:
        """Forget the drafted rows (the context stays)."""
        ...


class NormHeadTop:
    """Layer skipping's top: the target's own final norm and lm_head (rows of `vocab_ids` only, if given)."""

    hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, target, vocab_ids: torch.Tensor | None = None):
        self.norm = target.get_decoder().norm
        w = target.get_output_embeddings().weight
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(w.device, torch.long)
        # a contiguous copy of the kept rows: gathering them every draft step would cost more than the matmul
        self.weight = w if self.vocab_ids is None else w[self.vocab_ids].detach().clone()

    def begin(self, tokens, hidden, pad) -> None:
        pass

    def advance(self, new_tokens, hidden, counts) -> None:
        pass

    def retain(self, rows) -> None:
        pass

    def logits(self, h, positions, block_mask, m):
        return F.linear(self.norm(h), self.weight)

    def end_draft(self) -> None:
        pass


class SelfSpecProposer:
    """Drafts a chain (top_k = 1) or an EAGLE-2-style dynamic tree with the target's own layers `draft_layers`
    and a `top`. `exact_prefix` = P: layers 0..P-1 are run unchanged by the draft (reusable by the verify pass).
    stop_below > 0 ends a chain at the first draft token whose probability (temperature 1) is below it.
    Needs the decoder's `attach` hook (it drafts on the target's cache)."""

    def __init__(
        self,
        target,
        draft_layers: Sequence[int],
        top: DraftTop,
        *,
        name: str = "selfspec",
        top_k: int = 1,
        depth: int | None = None,
        total_tokens: int | None = None,
        stop_below: float = 0.0,
        reuse: bool = True,
    ):
        self.t = TargetLayers(target)
        layers = sorted(set(int(i) for i in draft_layers))
        if not layers or layers[0] < 0 or layers[-1] >= self.t.num_layers:
            raise DraftsmithError(
                f"draft layers must lie in [0, {self.t.num_layers}), got {list(draft_layers)}"
            )
        if top_k < 1 or (depth is not None and depth < 1) or (total_tokens is not None and total_tokens < 1):
            raise DraftsmithError(
                f"{name} needs top_k, depth and total_tokens >= 1, got {top_k}, {depth}, {total_tokens}"
            )
        if not 0.0 <= stop_below < 1.0:
            raise DraftsmithError(f"{name} option stop_below must be in [0, 1), got {stop_below}")
        self.name, self.top, self.draft_layers = name, top, layers
        self.exact = next(
            (j for j, i in enumerate(layers) if i != j), len(layers)
        )  # P: leading unchanged layers
        self.shared = list(range(self.exact))
        self.rest = list(range(self.exact, self.t.num_layers))
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self.used_depth = depth
        self.max_nodes = self._total(depth) if depth is not None else total_tokens
        self.stop_below = float(stop_below)
        self.reuse = bool(reuse)
        self.hidden_state_layers = tuple(top.hidden_state_layers)
        for i in self.hidden_state_layers:
            if i != self.exact:
                raise DraftsmithError(
                    f"{name}: the top may only read layer {self.exact}'s input states, not {i}"
                )
        self.vocab_ids = top.vocab_ids
        self.target_vocab_size = int(target.get_output_embeddings().weight.shape[0])
        self.decoder = self.cache = self.ragged = None

    def _total(self, depth: int) -> int:
        return self.total_tokens or (depth if self.top_k == 1 else self.top_k * depth)

    @property
    def tree(self) -> str | bool:
        """What eval.json records: False for a chain, else the tree as drafted (depth = min(depth, k))."""
        if self.top_k == 1:
            return False
        d = self.used_depth
        total = self._total(d) if d is not None else self.total_tokens or "top_k*k"
        return f"dynamic top_k={self.top_k} depth={d if d is not None else 'k'} total_tokens={total}"

    # -- decoder hooks ----------------------------------------------------------------------------------------
    def attach(self, decoder, ragged) -> None:
        """Called by the decoder after the prefill: the target's cache (a RaggedCache holding the prompts) and the
        decoder."""
        cache = ragged.cache
        if type(cache).__name__ != "DynamicCache":
            raise DraftsmithError(
                f"{self.name} drafts on a DynamicCache; run it without --compile / static_cache"
            )
        self.decoder, self.cache, self.ragged = decoder, cache, ragged

    def begin(self, tokens: torch.Tensor, hidden, pad: list[int] | None = None) -> None:
        if self.cache is None:
            raise DraftsmithError(
                f"{self.name} drafts on the target's cache; use draftsmith's SpeculativeDecoder"
            )
        self.root = tokens[:, -1:].to(self.t.device)  # [B, 1] (prompts are left-padded: the last column)
        self.pending = None  # what verify_forward may reuse: (rows processed, layer-P states [B, j, H])
        self.top.begin(tokens, hidden, pad or [0] * tokens.shape[0])

    def advance(self, accepted_nodes: list[list[int]], new_tokens: torch.Tensor, hidden) -> None:
        """The decoder rolled its cache (self.ragged) back to each row's accepted path; row b's new root is its
        last committed token, column a_b of new_tokens."""
        counts = [len(a) + 1 for a in accepted_nodes]
        last = torch.tensor(counts, device=new_tokens.device)[:, None] - 1
        self.root = new_tokens.gather(1, last).to(self.t.device)
        self.pending = None
        self.top.advance(new_tokens, hidden, counts)

    def retain(self, rows: list[int]) -> None:
        """Rows that stopped leave (the decoder has already dropped them from its cache)."""
        self.root = self.root[rows]
        self.top.retain(rows)

    def _positions(self, offsets: torch.Tensor) -> torch.Tensor:
        """Positions of new rows at `offsets` ([n] or [B, n]) past each row's root: [n] while every row is alike
        (a batch of one), else [B, n] (each row's root sits at its own committed length)."""
        r = self.ragged
        if r.uniform:
            return r.cols + offsets
        base = torch.tensor([n - p for n, p in zip(r.lengths, r.pads)], device=offsets.device)[:, None]
        return base + offsets

    # -- drafting ---------------------------------------------------------------------------------------------
    def _step(self, ids: torch.Tensor, positions: torch.Tensor, block_mask, m: int):
        """Draft layers + top on new rows ids [B, n] -> (logits [B, n, V_d], layer-P states [B, n, H])."""
        h = self.t.embed(ids)
        h = self.t.run(h, self.shared, self.cache, positions, block_mask, self.ragged)
        h_p = h
        deeper = self.draft_layers[self.exact :]
        if deeper:
            h = self.t.run(h, deeper, self.cache, positions, block_mask, self.ragged)
        return self.top.logits(h, positions, block_mask, m), h_p

    def _to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    @torch.inference_mode()
    def propose(self, k: int, params: SamplingParams, generator: torch.Generator | None = None) -> Proposal:
        depth = self.used_depth = k if self.depth is None else min(self.depth, k)
        if self.top_k == 1:
            prop = self._chain(depth, params, generator)
        else:
            prop = self._tree(depth)
        self.top.end_draft()
        return prop

    def _chain(self, depth: int, params: SamplingParams, generator) -> Proposal:
        """All rows draft in step; a row whose next token is unsure (stop_below) proposes fewer tokens, and the
        chain ends once every row has stopped."""
        c, dev, B = self.ragged.cols, self.t.device, self.root.shape[0]
        ids, tokens, probs, states = self.root, [], [], []
        sizes = [depth] * B  # draft tokens per row
        for i in range(depth):
            logits, h_p = self._step(ids, self._positions(torch.tensor([i], device=dev)), None, i)
            states.append(h_p)
            logits = logits[:, -1]
            if self.stop_below > 0.0:
                unsure = (torch.softmax(logits.float(), -1).amax(-1) < self.stop_below).tolist()
                sizes = [i if u and s == depth else s for u, s in zip(unsure, sizes)]
                if all(s < depth for s in sizes):
                    break
            if params.greedy:
                idx = logits.argmax(-1)
            else:
                q = warp_probs(logits, params)  # the distribution the token is drawn from
                idx = sample(q, generator)
                if self.vocab_ids is None:
                    probs.append(q)
                else:
                    probs.append(
                        q.new_zeros(q.shape[0], self.target_vocab_size).index_copy_(1, self.vocab_ids, q)
                    )
            ids = self._to_target(idx)[:, None]
            tokens.append(ids[:, 0])
        crop_layers(self.cache, self.draft_layers[self.exact :], c)  # inexact rows: never verified
        if self.reuse:
            self.pending = (len(states), torch.cat(states, 1))
        else:
            crop_layers(self.cache, self.shared, c)
        width = max(sizes)
        if width == 0:
            return Proposal.empty(B, dev)
        draft_probs = torch.stack(probs[:width], 1) if probs else None
        return Proposal.chain(
            torch.stack(tokens[:width], 1), draft_probs, None if min(sizes) == width else sizes
        )

    def _tree(self, depth: int) -> Proposal:
        """EAGLE-2 dynamic tree (decode/trees.dynamic_tree) over the root row drafted first; one tree per row of a
        batch, every row's frontier in the same forward."""
        c, dev, B = self.ragged.cols, self.t.device, self.root.shape[0]
        logits, _ = self._step(self.root, self._positions(torch.tensor([0], device=dev)), None, 0)

        def expand(tok, attend, d, parent_local):  # tok [B, F], attend [B, F, m0 + F] (or without B alone)
            f = tok.shape[-1]
            ids = self._to_target(tok).reshape(-1, f)
            block = attend if B > 1 else attend[None]
            logits, _ = self._step(
                ids, self._positions(torch.full((f,), d, device=dev)), block, block.shape[2] - f
            )
            out = torch.log_softmax(logits.float(), -1)
            return out if B > 1 else out[0]

        root_logp = torch.log_softmax(logits[:, -1].float(), -1)
        toks, parents = dynamic_tree(
            root_logp if B > 1 else root_logp[0], expand, top_k=self.top_k, depth=depth,
            total=self._total(depth), drafted=1,
        )  # fmt: skip
        crop_layers(self.cache, self.draft_layers, c)  # trees: the decoder's tree-masked forward verifies
        return Proposal(self._to_target(toks).reshape(B, -1), parents)

    # -- verification with shared work ------------------------------------------------------------------------
    @torch.inference_mode()
    def verify_forward(self, block: torch.Tensor, proposal: Proposal):
        """The decoder's verify forward over block [B, 1 + n] (root + chain), reusing the draft's rows of layers
        0..P-1. Returns (logits [B, 1 + n, V], hidden per hidden_state_layers [B, 1 + n, H]) or None (no
        reusable rows: the decoder runs its own forward)."""
        pending, self.pending = self.pending, None
        if pending is None or not proposal.is_chain:
            return None
        j, h_done = pending  # rows [root, d1 .. d_{j-1}] went through layers 0..P-1 while drafting
        n = block.shape[1]
        dev = self.t.device
        parts = [h_done[:, :n]]
        if j < n:  # block tokens the draft never ran (usually the last drafted one)
            # the new rows see the j drafted rows and are causal among themselves; one row (the usual case) sees
            # everything, so it runs exactly like a drafting step (mask None)
            mask = None if n - j == 1 else torch.ones(n - j, n, dtype=torch.bool, device=dev).tril(j)
            h_new = self.t.run(
                self.t.embed(block[:, j:]),
                self.shared,
                self.cache,
                self._positions(torch.arange(j, n, device=dev)),
                mask,
                self.ragged,
            )
            parts.append(h_new)
        h_p = torch.cat(parts, 1)
        positions = self._positions(torch.arange(n, device=dev))
        h = self.t.run(h_p, self.rest, self.cache, positions, None, self.ragged)
        h = self.t.dec.norm(h)
        head_t = getattr(self.decoder, "_head_t", None)
        logits = h @ head_t if head_t is not None else self.decoder.target.get_output_embeddings()(h)
        hidden = tuple(h_p for _ in self.hidden_state_layers) if self.hidden_state_layers else None
        return logits, hidden
