"""The two model-free / small-model proposers: a draft causal LM and n-gram prompt lookup.

Both are chains. Instances are reusable across prompts: `begin()` resets all per-sequence state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.sampling import SamplingParams, sample, warp_probs

from .cache import crop_to
from .proposer import Proposal


class DraftModelProposer:
    """A small causal LM drafting k tokens autoregressively with its own KV cache (Leviathan et al. 2023).

    With a reduced output vocabulary `vocab_ids` [V_d] (target ids of the kept lm_head rows, sorted), draft
    logits are computed over those rows only and mapped back to target ids; q is zero outside them.
    """

    name = "draft"
    hidden_state_layers: tuple[int, ...] = ()

    def __init__(
        self,
        model,
        target_vocab_size: int,
        vocab_ids: torch.Tensor | None = None,
        stop_below: float = 0.0,
    ):
        """stop_below: stop drafting (this step) at the first token whose draft probability (softmax at
        temperature 1 over the draft's outputs) is below it — a dynamic draft length in the spirit of EAGLE-2's
        confidence / SpecDec++'s stopping rule. The decision depends on the draft alone, so verification stays
        lossless; it saves the draft steps and the wider verify forward that would likely be rejected."""
        self.model = model
        self.stop_below = float(stop_below)
        self.target_vocab_size = int(target_vocab_size)
        self.device = next(model.parameters()).device
        self.decoder = model.get_decoder()
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(self.device, torch.long)
        lm_w = model.get_output_embeddings().weight
        # rows the draft may emit: the kept vocabulary, or every row the target also has
        self.head_weight = lm_w[self.vocab_ids] if self.vocab_ids is not None else None
        self.out_size = (
            self.vocab_ids.numel()
            if self.vocab_ids is not None
            else min(lm_w.shape[0], self.target_vocab_size)
        )

    def begin(self, tokens: torch.Tensor, hidden=None) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.seq = tokens.to(self.device)  # [B, L] committed tokens
        self.n_cached = 0  # committed tokens already in the draft cache

    def _last_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, out_size] at the last position only (logits_to_keep=1 / one row of a reduced head)."""
        if self.head_weight is not None:
            h = self.decoder(ids, cache=self.cache, use_cache=True).last_hidden_state[:, -1]
            return F.linear(h, self.head_weight)
        return self.model(ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits[
            :, -1, : self.out_size
        ]

    def _to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator | None = None) -> Proposal:
        ids = self.seq[
            :, self.n_cached :
        ]  # committed tokens the draft has not seen (1, or 2 after a full accept)
        tokens, probs = [], []
        for i in range(k):
            logits = self._last_logits(ids)
            if self.stop_below > 0.0 and float(torch.softmax(logits.float(), -1).amax()) < self.stop_below:
                break  # the cache now also holds the last drafted token; advance() crops what is not kept
            if params.greedy:
                idx = logits.argmax(-1)  # [B]
            else:
                q = warp_probs(logits, params)  # [B, out_size]: the distribution the token is drawn from
                idx = sample(q, generator)
                full = q.new_zeros(q.shape[0], self.target_vocab_size)
                if self.vocab_ids is not None:
                    full.index_copy_(1, self.vocab_ids, q)
                else:
                    full[:, : self.out_size] = q
                probs.append(full)
            tok = self._to_target(idx)
            tokens.append(tok)
            if i < k - 1:
                ids = tok[:, None]
        self.proposed = len(tokens)
        if not tokens:
            return Proposal.empty(self.seq.shape[0], self.device)
        return Proposal.chain(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None)

    def advance(self, accepted_nodes: list[int], new_tokens: torch.Tensor, hidden=None) -> None:
        # the cache holds seq + drafted[:k-1] (seq + drafted[:n] after an early stop at n tokens); only
        # seq + drafted[:a] stays valid, and at most seq + drafted[:n-1] is known to be in it (no recomputation)
        L = self.seq.shape[1]
        keep = min(L + min(len(accepted_nodes), self.proposed - 1), self.cache.get_seq_length())
        crop_to(self.cache, keep)
        self.n_cached = keep
        self.seq = torch.cat([self.seq, new_tokens.to(self.device)], 1)


class NGramProposer:
    """Prompt lookup (Saxena 2023; transformers `prompt_lookup_num_tokens`, vLLM `ngram`): find the most recent
    earlier occurrence of the last n tokens (n = max_n .. min_n) in the context and propose what followed it."""

    name = "ngram"
    hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            from draftsmith.errors import DraftsmithError

            raise DraftsmithError(
                f"ngram needs 1 <= min <= max, got min={min_n} max={max_n}; e.g. ngram:max=3,min=1"
            )
        self.max_n, self.min_n = max_n, min_n

    def begin(self, tokens: torch.Tensor, hidden=None) -> None:
        self.device = tokens.device
        self.buf = (
            tokens[0].detach().to("cpu", torch.long).clone()
        )  # lookup runs on the host: tiny integer work
        self.len = self.buf.numel()

    def propose(self, k: int, params: SamplingParams | None = None, generator=None) -> Proposal:
        ctx, L = self.buf, self.len
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows over ctx[:L-1] so every match has at least one following token
            windows = ctx[: L - 1].unfold(0, n, 1)  # [L-n, n]
            hits = (windows == ctx[L - n : L]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return Proposal.chain(ctx[None, start : min(start + k, L)].to(self.device))
        return Proposal.empty(1, self.device)

    def advance(self, accepted_nodes: list[int], new_tokens: torch.Tensor, hidden=None) -> None:
        new = new_tokens[0].to("cpu", torch.long)
        if self.len + new.numel() > self.buf.numel():  # grow geometrically, not per step
            grown = torch.empty(max(2 * self.buf.numel(), self.len + new.numel()), dtype=torch.long)
            grown[: self.len] = self.buf[: self.len]
            self.buf = grown
        self.buf[self.len : self.len + new.numel()] = new
        self.len += new.numel()
