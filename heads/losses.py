"""Training losses of the EAGLE heads, with the training-time test (TTT) unroll and per-depth acceptance.

Notation (per sequence): ids x_0..x_{T-1}; f_t = target final normed hidden state at t (its logits predict x_{t+1});
g_t = fused aux features (EAGLE-3). Unroll step i (0-based) at column t feeds token x_{t+1+i} and
  step 0: the target features at t (fc applied);  step i >= 1: the head's own step-(i-1) output at column t
and is scored against the target distribution at position t+1+i (which predicts x_{t+2+i}). Column t at step i
attends to step-0 keys at columns <= t and to its own steps 1..i -- what a draft chain rooted at t sees at decode
time. Loss = sum_i decay^i * L_i (EAGLE-3 sec. 3.2, decay 0.8).
  eagle3: L_i = soft CE(p restricted to the draft vocab and renormalised, q)   (or any draftsmith divergence)
  eagle : L_i = SmoothL1(out, f_{t+1+i}) + 0.1 * soft CE(p, q), q through the frozen target lm_head (EAGLE-1)
Per-depth greedy acceptance a_i = P(argmax q == argmax p at depth i | depths < i accepted), teacher-forced, and
the simulated tau = 1 + sum_i prod_{j<=i} a_j (draftsmith.acceptance.tau_from_conditional; bonus included).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftsmith.acceptance import tau_from_conditional
from draftsmith.heads.eagle import EagleHead

EagleLoss = Literal["soft_ce", "fkl", "rkl", "jsd", "tvd", "neg_log_accept", "lk"]


def shift_left(x: torch.Tensor, s: int) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t+s] (zeros past the end)."""
    if s == 0:
        return x
    return torch.cat([x[:, s:], x.new_zeros(x[:, :s].shape)], 1)


def _soft_ce_chunk(draft_h, target_h, weight):
    p = torch.softmax(F.linear(target_h, weight).float(), -1)
    return -(p * torch.log_softmax(F.linear(draft_h, weight).float(), -1)).sum()


def soft_ce_through_head(
    draft_h: torch.Tensor, target_h: torch.Tensor, weight: torch.Tensor, chunk: int = 512
):
    """sum over rows of -sum_x p(x) log q(x), p = softmax(W f_target), q = softmax(W h_draft), chunked and
    checkpointed so only chunk x V logits live at once. draft_h, target_h [N, H]; weight [V, H] -> scalar."""
    total = draft_h.new_zeros((), dtype=torch.float32)
    for s in range(0, draft_h.shape[0], chunk):
        args = (draft_h[s : s + chunk], target_h[s : s + chunk].detach(), weight)
        total = total + (
            checkpoint(_soft_ce_chunk, *args, use_reentrant=False)
            if torch.is_grad_enabled()
            else _soft_ce_chunk(*args)
        )
    return total


def ttt_unroll(
    head: EagleHead,
    embed_weight: torch.Tensor,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    steps: int,
):
    """Yield (i, out [B, T, H]) for unroll steps i = 0..steps-1 (see the module docstring). hidden: the target
    features [B, T, 3H | H]; step i feeds tokens input_ids[:, t+1+i] at positions t+i."""
    b, t = input_ids.shape
    dev = input_ids.device
    causal = (
        torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None, None]
        & attention_mask.bool()[:, None, None, :]
    )
    ctx_kv, diag = None, []
    dtype = hidden.dtype
    for i in range(steps):
        embeds = F.embedding(shift_left(input_ids, 1 + i), embed_weight).to(dtype)
        pos = (torch.arange(t, device=dev) + i)[None].expand(b, t)
        if i == 0:
            out, ctx_kv = head.step(embeds, hidden, pos, causal, from_target=True)
        else:
            out, kv = head.step(embeds, hidden, pos, causal, kv_extra=ctx_kv, diag_kv=diag, from_target=False)
            diag.append(kv)
        hidden = out
        yield i, out


def eagle_loss(
    head: EagleHead,
    embed_weight: torch.Tensor,
    lm_weight: torch.Tensor,
    feats: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    ttt_steps: int = 1,
    decay: float = 0.8,
    loss: EagleLoss = "soft_ce",
    temperature: float = 1.0,
    beta: float = 0.5,
    feature_noise: float = 0.0,
    ce_weight: float = 0.1,
    exact_acceptance: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Training loss of an EAGLE-1/3 head. embed_weight [V, H], lm_weight [V, H]: the frozen target's input
    embeddings and lm_head; feats from draftsmith.heads.hidden ("last" [B, T, H], "aux" [B, T, 3H] for eagle3);
    input_ids/attention_mask/loss_mask [B, T]. Returns (scalar loss, metrics incl. acc_i and tau_sim).
    exact_acceptance: compare with the target's argmax over the FULL vocabulary (one [H, V] matmul per token);
    False compares within the draft vocabulary only (EAGLE-3; cheaper, slightly optimistic) -- for training logs."""
    c = head.config
    b, t = input_ids.shape
    dev = input_ids.device
    dtype = head.fc.weight.dtype  # fp32 master weights; under autocast the matmuls still run in bf16
    last = feats["last"].to(dtype)
    eagle3 = c.kind == "eagle3"
    vocab_ids = head.vocab_ids
    # gather before casting: a full [V, H] copy of a bf16 target's tables per batch costs ~5% of a CPU step
    if eagle3:
        w_d = lm_weight[vocab_ids].to(dtype)
        lm_full = lm_weight.to(dtype) if (exact_acceptance or loss != "soft_ce") else None
    else:
        lm_full = w_d = lm_weight.to(dtype)
    hidden = feats["aux"].to(dtype) if eagle3 else last
    if (
        feature_noise > 0 and head.training
    ):  # EAGLE-1: uniform noise on the input features (robustness to drift)
        hidden = hidden + (torch.rand_like(hidden) - 0.5) * feature_noise
    total = last.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    alive = torch.ones(b, t, dtype=torch.bool, device=dev)
    accepts = []
    # the labels of every unroll step are the same target rows, shifted: compute them once per batch
    any_valid = shift_left(loss_mask, 1).bool()  # rows t whose distribution predicts a trained token
    with torch.no_grad():
        tgt_top = torch.zeros(b, t, dtype=torch.long, device=dev)
        full_vocab = exact_acceptance or not eagle3
        rows_v = last[any_valid]
        draft_vocab_logits = F.linear(rows_v, w_d) if eagle3 else None
        if full_vocab:
            tgt_top[any_valid] = F.linear(rows_v, lm_full).argmax(-1)
        else:  # one [N, V_d] product serves the argmax and the soft labels
            tgt_top[any_valid] = vocab_ids[draft_vocab_logits.argmax(-1)]
        if eagle3 and loss == "soft_ce":
            tgt_probs = torch.zeros(b, t, w_d.shape[0], dtype=torch.float32, device=dev)
            tgt_probs[any_valid] = torch.softmax(draft_vocab_logits.float(), -1)
    for i, out in ttt_unroll(head, embed_weight, hidden, input_ids, attention_mask, ttt_steps):
        valid = shift_left(loss_mask, 2 + i).bool()
        n = int(valid.sum())
        if n == 0:
            break
        tgt_rows = shift_left(last, 1 + i)[valid]  # [n, H] target states whose logits are the labels
        rows = out[valid]
        if eagle3:
            draft_logits = head.logits(rows)  # [n, V_d]
            if loss == "soft_ce":
                p = shift_left(tgt_probs, 1 + i)[valid]  # p restricted to V_d, renormalised
                li = -(p * torch.log_softmax(draft_logits.float(), -1)).sum(-1).mean()
            else:
                from draftsmith.divergences import divergence

                with torch.no_grad():
                    full = F.linear(tgt_rows, lm_full).float()
                li = divergence(
                    loss, full, draft_logits, temperature=temperature, beta=beta, vocab_ids=vocab_ids
                )
        else:
            reg = F.smooth_l1_loss(rows.float(), tgt_rows.float(), reduction="none").mean(-1).mean()
            ce = soft_ce_through_head(rows, tgt_rows, lm_full) / n
            li = reg + ce_weight * ce
            metrics[f"reg_{i}"] = float(reg.detach())
        total = total + decay**i * li
        metrics[f"loss_{i}"] = float(li.detach())
        with torch.no_grad():  # greedy acceptance at depth i, conditional on depths < i accepted
            d_top = (draft_logits if eagle3 else F.linear(rows, lm_full)).argmax(-1)
            if eagle3:
                d_top = vocab_ids[d_top]
            ok = torch.zeros(b, t, dtype=torch.bool, device=dev)
            ok[valid] = d_top == shift_left(tgt_top, 1 + i)[valid]
            prev = alive & valid
            metrics[f"acc_{i}"] = float((ok & prev).sum()) / max(int(prev.sum()), 1)
            metrics[f"top1_{i}"] = float(ok.sum()) / n
            accepts.append(metrics[f"acc_{i}"])
            alive = alive & ok  # a chain rooted at column t uses steps 0..i at the same column t
    metrics["tau_sim"] = tau_from_conditional(accepts)
    metrics["n_tokens"] = float(attention_mask.sum())
    return total, metrics
