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
the expected greedy rounds along each scored text (column t is the round whose first draft is x_{t+2};
heads.common.DepthAcceptance), whose tokens per round is the predicted tau (bonus included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftsmith.divergences import divergence, loss_entry
from draftsmith.heads.common import DepthAcceptance, shift_left
from draftsmith.heads.eagle.model import EagleHead
from draftsmith.modeling import base_decoder, output_head


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


def _tables(target):
    """The frozen target's input embeddings and lm_head weight, both [V, H], in the target's dtype."""
    return base_decoder(target).embed_tokens.weight, output_head(target).weight


def eagle3_loss(
    head: EagleHead,
    target,
    feats: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    cfg,
    *,
    ttt_steps: int | None = None,
    exact_acceptance: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE-3: sum_i decay^i * L_i over the training-time-test unroll, L_i = soft CE against the target's
    distribution restricted to the draft vocabulary (or the draftsmith divergence `cfg.kind`).

    target: the frozen target (embeddings, lm_head); feats: "last" [B, T, H] and "aux" [B, T, 3H]
    (draftsmith.heads.hidden); batch: input_ids / attention_mask / loss_mask [B, T]; cfg: the recipe's loss
    section (kind, ttt_steps, decay, temperature, beta); ttt_steps overrides cfg.ttt_steps (evals unroll deeper).
    exact_acceptance: compare with the target's argmax over the FULL vocabulary (one [H, V] matmul per token);
    False compares within the draft vocabulary only (cheaper, slightly optimistic) -- for training logs. The exact
    (held-out) pass also walks the greedy rounds along the text (rounds_per_token_k, heads.common.DepthAcceptance).
    Returns (scalar loss, metrics incl. loss_i, acc_i, top1_i and tau_sim)."""
    input_ids, attention_mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    b, t = input_ids.shape
    dtype = head.fc.weight.dtype  # fp32 master weights; under autocast the matmuls still run in bf16
    embed_weight, lm_weight = _tables(target)
    last = feats["last"].to(dtype)
    vocab_ids = head.vocab_ids
    # gather before casting: a full [V, H] copy of a bf16 target's tables per batch costs ~5% of a CPU step
    w_d = lm_weight[vocab_ids].to(dtype)
    # soft_ce and the KL-type losses read the target at the draft's ids only: its [N, V_d] logits, computed once per
    # batch (the labels of every unroll step are the same rows, shifted); the acceptance-type ones read all of V
    full_target = loss_entry(cfg.kind).full_target
    lm_full = lm_weight.to(dtype) if (exact_acceptance or full_target) else None
    any_valid = shift_left(loss_mask, 1).bool()  # rows t whose distribution predicts a trained token
    with torch.no_grad():
        tgt_top = torch.zeros(b, t, dtype=torch.long, device=input_ids.device)
        draft_vocab_logits = F.linear(last[any_valid], w_d)
        if exact_acceptance:
            tgt_top[any_valid] = F.linear(last[any_valid], lm_full).argmax(-1)
        else:  # one [N, V_d] product serves the argmax and the labels
            tgt_top[any_valid] = vocab_ids[draft_vocab_logits.argmax(-1)]
        if not full_target:
            tgt_logits = torch.zeros(b, t, w_d.shape[0], dtype=torch.float32, device=input_ids.device)
            tgt_logits[any_valid] = draft_vocab_logits.float()
    total = last.new_zeros((), dtype=torch.float32)
    acceptance = DepthAcceptance((b, t), input_ids.device, walk=exact_acceptance)
    steps = ttt_steps or cfg.ttt_steps
    for i, out in ttt_unroll(head, embed_weight, feats["aux"].to(dtype), input_ids, attention_mask, steps):
        valid = shift_left(loss_mask, 2 + i).bool()
        if not valid.any():
            break
        draft_logits = head.logits(out[valid])  # [n, V_d]
        with torch.no_grad():
            labels = (
                F.linear(shift_left(last, 1 + i)[valid], lm_full).float()
                if full_target
                else shift_left(tgt_logits, 1 + i)[valid]
            )
        li = divergence(
            cfg.kind, labels, draft_logits, temperature=cfg.temperature, beta=cfg.beta, vocab_ids=vocab_ids
        )
        total = total + cfg.decay**i * li
        acceptance.metrics[f"loss_{i}"] = float(li.detach())
        acceptance.update(i, valid, vocab_ids[draft_logits.argmax(-1)], shift_left(tgt_top, 1 + i)[valid])
    return total, acceptance.result(attention_mask)


def eagle1_loss(
    head: EagleHead,
    target,
    feats: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    cfg,
    *,
    ttt_steps: int | None = None,
    exact_acceptance: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE-1: L_i = SmoothL1(out, f_{t+1+i}) + cfg.ce_weight * soft CE(p, q), q through the frozen target
    lm_head; uniform noise of width cfg.feature_noise on the input features while training. Same arguments and
    metrics as eagle3_loss (feats: "last" only); acceptance is always exact (the head predicts over the full
    vocabulary), so `exact_acceptance` only asks for the rounds walk, as in eagle3_loss."""
    input_ids, attention_mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    b, t = input_ids.shape
    dtype = head.fc.weight.dtype
    embed_weight, lm_weight = _tables(target)
    lm_full = lm_weight.to(dtype)
    last = feats["last"].to(dtype)
    hidden = last
    if cfg.feature_noise > 0 and head.training:  # robustness to the drift of its own features at decode time
        hidden = hidden + (torch.rand_like(hidden) - 0.5) * cfg.feature_noise
    any_valid = shift_left(loss_mask, 1).bool()
    with torch.no_grad():
        tgt_top = torch.zeros(b, t, dtype=torch.long, device=input_ids.device)
        tgt_top[any_valid] = F.linear(last[any_valid], lm_full).argmax(-1)
    total = last.new_zeros((), dtype=torch.float32)
    acceptance = DepthAcceptance((b, t), input_ids.device, walk=exact_acceptance)
    for i, out in ttt_unroll(
        head, embed_weight, hidden, input_ids, attention_mask, ttt_steps or cfg.ttt_steps
    ):
        valid = shift_left(loss_mask, 2 + i).bool()
        n = int(valid.sum())
        if n == 0:
            break
        tgt_rows, rows = shift_left(last, 1 + i)[valid], out[valid]
        reg = F.smooth_l1_loss(rows.float(), tgt_rows.float(), reduction="none").mean(-1).mean()
        li = reg + cfg.ce_weight * soft_ce_through_head(rows, tgt_rows, lm_full) / n
        total = total + cfg.decay**i * li
        acceptance.metrics[f"reg_{i}"] = float(reg.detach())
        acceptance.metrics[f"loss_{i}"] = float(li.detach())
        with torch.no_grad():
            draft_top = F.linear(rows, lm_full).argmax(-1)
        acceptance.update(i, valid, draft_top, shift_left(tgt_top, 1 + i)[valid])
    return total, acceptance.result(attention_mask)


EAGLE_LOSSES = {"eagle": eagle1_loss, "eagle3": eagle3_loss}
"""Head kind -> its training loss (same signature)."""
