"""Teacher-forced acceptance metrics logged at every distillation eval.

On held-out text, for each position the target distribution p and the draft distribution q are warped exactly as
the decoder warps them (`draftsmith.sampling.warp_probs`: temperature, top-k, top-p; temperature 0 = one-hot
argmax) and the per-token acceptance alpha = sum_x min(p(x), q(x)) = 1 - TVD(p, q) is averaged (Leviathan et al.
2023). Greedy acceptance top1 = 1[argmax q == argmax p]. Predicted tau (tokens per target step, bonus token
included) uses the i.i.d. formula `tau_iid(alpha, k)` = (1 - alpha^(k+1)) / (1 - alpha): a teacher-forced
estimate, since at decode time later draft positions condition on the draft's own earlier tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from draftsmith.acceptance import tau_iid
from draftsmith.distill.divergences import flatten_pair
from draftsmith.errors import DraftsmithError
from draftsmith.sampling import SamplingParams, warp_probs


class AcceptanceMeter:
    """Accumulates predicted acceptance over batches of (target, draft) logits; `compute()` summarises them."""

    def __init__(
        self,
        temperature: float,
        ks: Iterable[int] = range(1, 9),
        top_p: float = 1.0,
        top_k: int = 0,
        chunk_size: int = 1024,
    ):
        self.params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        self.ks = [int(k) for k in ks]
        self.chunk_size = int(chunk_size)
        self.reset()

    def reset(self) -> None:
        self._alpha_sum = 0.0
        self._top1_sum = 0.0
        self._n = 0

    @torch.no_grad()
    def update(
        self,
        target_logits: torch.Tensor,
        draft_logits: torch.Tensor,
        mask: torch.Tensor | None = None,
        vocab_ids: torch.Tensor | None = None,
    ) -> None:
        """Add tokens: target_logits [N, V], draft_logits [N, V] or [N, V_d] with vocab_ids [V_d], mask [N].

        Leading dims may be any shape ([B, T, V] works); mask (bool or 0/1, None = all) selects counted tokens.
        With vocab_ids the draft is warped over its own V_d rows (the decoder does the same) and is zero elsewhere.
        """
        target_logits, draft_logits, rows, vocab_ids = flatten_pair(
            target_logits, draft_logits, mask, vocab_ids
        )
        for start in range(0, rows.numel(), self.chunk_size):
            chunk = rows[start : start + self.chunk_size]
            target_chunk = target_logits.index_select(0, chunk)  # [n, V]
            draft_chunk = draft_logits.index_select(0, chunk)  # [n, V or V_d]
            target_probs = warp_probs(target_chunk, self.params)
            draft_probs = warp_probs(draft_chunk, self.params)
            draft_top = draft_chunk.argmax(-1)
            if vocab_ids is not None:
                # q is zero outside the draft vocab, so only its rows can contribute to sum min(p, q)
                target_probs_on = target_probs.index_select(-1, vocab_ids)
                draft_top = vocab_ids[draft_top]
            else:
                target_probs_on = target_probs
            alpha = torch.minimum(target_probs_on, draft_probs).sum(-1)
            # greedy acceptance compares raw argmaxes (warping never moves the argmax)
            top1 = draft_top == target_chunk.argmax(-1)
            self._alpha_sum += float(alpha.double().sum())
            self._top1_sum += float(top1.double().sum())
            self._n += int(chunk.numel())

    def compute(self) -> dict:
        """{"alpha", "top1", "tau": {k: tau_iid(alpha, k)}, "tau_greedy": {k: tau_iid(top1, k)}, "tvd", "n_tokens"}."""
        if self._n == 0:
            raise DraftsmithError("AcceptanceMeter saw no tokens; check the eval data and its loss mask")
        alpha = min(1.0, self._alpha_sum / self._n)
        top1 = self._top1_sum / self._n
        return {
            "alpha": alpha,
            "top1": top1,
            "tau": {k: tau_iid(alpha, k) for k in self.ks},
            "tau_greedy": {k: tau_iid(top1, k) for k in self.ks},
            "tvd": 1.0 - alpha,
            "n_tokens": self._n,
        }
