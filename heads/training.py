"""The trainable module for every head kind and its held-out evaluation.

`HeadTrainer.forward(batch) -> (loss, metrics)` does all the work so that DDP/FSDP wrappers (which only
synchronise gradients through `forward`) see it. The frozen target is held outside the module's parameters
(never checkpointed, never in the optimizer) except for Medusa-2, whose LoRA-wrapped target is a submodule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.acceptance import tau_from_conditional, tau_tree
from draftsmith.heads.common import weighted_means
from draftsmith.heads.eagle.losses import EAGLE_LOSSES
from draftsmith.heads.hidden import HiddenStates
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.heads.medusa.trees import chain_tree, medusa_tree
from draftsmith.modeling import base_decoder, output_head

RANKS = 10  # Medusa rank accuracies measured per head (the static tree picks from these)


class HeadTrainer(nn.Module):
    def __init__(self, head: nn.Module, target, hidden: HiddenStates, loss_cfg, medusa2=None):
        super().__init__()
        self.head = head
        self.loss_cfg = loss_cfg
        self.medusa2 = medusa2
        if medusa2 is not None:
            self.target = target  # LoRA-wrapped: trained, so it is a submodule
            self.register_buffer("micro_step", torch.zeros((), dtype=torch.long))
        else:
            self._frozen = [target]  # a list keeps it out of parameters(), state_dict() and checkpoints
        self.hidden = hidden

    @property
    def frozen_target(self):
        return self.target if self.medusa2 is not None else self._frozen[0]

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        loss, m = HEAD_LOSSES[self.head.head_type](self, batch)
        m["n_tokens"] = float(batch["loss_mask"].sum())
        return loss, m

    def _medusa2(self, ids, am, lm):
        """Medusa-2: LoRA target + heads. Loss = target term + lambda0 * sum_k 0.8^k CE_k (Medusa sec. 2.2);
        target term = KL(adapter-disabled target || LoRA target) (self-distillation) or the LM loss.
        The first warmup_head_steps optimizer steps train the heads only (target run without grad)."""
        m2 = self.medusa2
        step = int(self.micro_step) // max(m2.grad_accum, 1)
        if self.training:
            self.micro_step += 1
        dec = base_decoder(self.target)
        warm = step < m2.warmup_head_steps
        with torch.set_grad_enabled(torch.is_grad_enabled() and not warm):
            h = dec(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        head_loss, m = self.head.loss(h, ids, lm, decay=self.loss_cfg.decay, max_rows=self.loss_cfg.max_rows)
        if warm:
            m["target_loss"] = 0.0
            return m2.lambda0 * head_loss, m
        valid = lm[:, 1:].bool()
        logits = output_head(self.target)(h[:, :-1][valid])  # [N, V] rows that predict response tokens
        if m2.target_loss == "kl":
            from draftsmith.divergences import divergence

            with torch.no_grad(), self.target.disable_adapter():
                h_ref = dec(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
                ref = output_head(self.target)(h_ref[:, :-1][valid])
            tl = divergence("fkl", ref, logits)
        else:
            tl = F.cross_entropy(logits.float(), ids[:, 1:][valid])
        m["target_loss"] = float(tl.detach())
        return tl + m2.lambda0 * head_loss, m


# -- one training loss per head type (HeadTrainer.forward dispatches on head.head_type) ---------------------------
def _medusa_loss(tr: HeadTrainer, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    ids, lm = batch["input_ids"], batch["loss_mask"]
    if tr.medusa2 is not None:
        return tr._medusa2(ids, batch["attention_mask"], lm)
    soft = getattr(tr.loss_cfg, "medusa_labels", "tokens") == "target"
    return tr.head.loss(
        tr.hidden(batch)["last"],
        ids,
        lm,
        decay=tr.loss_cfg.decay,
        max_rows=tr.loss_cfg.max_rows,
        target_head=output_head(tr.frozen_target).weight if soft else None,
    )


def _eagle_loss(tr: HeadTrainer, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    return EAGLE_LOSSES[tr.head.config.kind](
        tr.head,
        tr.frozen_target,
        tr.hidden(batch),
        batch,
        tr.loss_cfg,
        exact_acceptance=False,  # training logs: within-draft-vocab agreement; the eval is exact
    )


def _block_loss(tr: HeadTrainer, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    from draftsmith.heads.block.training import block_step

    return block_step(tr.head, tr.frozen_target, tr.hidden(batch), batch, tr.loss_cfg, exact=False)


def _earlyexit_loss(tr: HeadTrainer, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    from draftsmith.heads.selfspec.earlyexit import earlyexit_loss

    c = tr.loss_cfg
    return earlyexit_loss(
        tr.head, output_head(tr.frozen_target).weight, tr.hidden(batch), tr.hidden.aux_layers,
        batch["attention_mask"], batch["loss_mask"], loss=c.kind, temperature=c.temperature, beta=c.beta,
    )  # fmt: skip


HEAD_LOSSES = {
    "medusa": _medusa_loss,
    "eagle": _eagle_loss,
    "eagle3": _eagle_loss,
    "dflash": _block_loss,
    "peagle": _block_loss,
    "earlyexit": _earlyexit_loss,
}
"""head_type -> training loss(trainer, batch) -> (loss, metrics)."""


@torch.no_grad()
def evaluate_heads(
    trainer: HeadTrainer, batches: list[dict], hidden: HiddenStates, *, eval_depth: int, tree_tokens: int
) -> dict:
    """Held-out acceptance. Medusa: per-head rank accuracies against the TARGET's greedy token (what greedy
    verification accepts), chain and tree expected tau. EAGLE: per-depth conditional acceptance (training-time
    test unroll of eval_depth steps) and simulated tau = 1 + sum_i prod_{j<=i} a_j (bonus included)."""
    head = trainer.head
    dev = next(head.parameters()).device
    if isinstance(head, MedusaHeads):
        k = head.config.num_heads
        hits = torch.zeros(k, RANKS, dtype=torch.float64)
        counts = torch.zeros(k, dtype=torch.float64)
        for batch in batches:
            batch = {n: v.to(dev) for n, v in batch.items()}
            ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
            if trainer.medusa2 is not None:
                h = base_decoder(trainer.target)(
                    input_ids=ids, attention_mask=am, use_cache=False
                ).last_hidden_state
            else:
                h = hidden(batch)["last"]
            lm_w = output_head(trainer.frozen_target).weight
            for j, (blk, lmh) in enumerate(zip(head.blocks, head.lm_heads)):
                s = j + 1  # head j at t drafts token t+2+j, which the target predicts from position t+1+j
                n = h.shape[1] - s - 1
                if n <= 0:
                    continue
                valid = lm[:, s + 1 :].bool()  # [B, n]
                greedy = F.linear(h[:, s : s + n][valid].to(lm_w.dtype), lm_w).argmax(-1)
                # the eval runs outside autocast: fp32 heads read a bf16 target's states in their own dtype
                rows = h[:, :n][valid].to(lmh.weight.dtype)
                top = lmh(blk(rows)).topk(min(RANKS, lmh.out_features), -1).indices
                hits[j, : top.shape[1]] += (top == greedy[:, None]).double().sum(0)
                counts[j] += float(valid.sum())
        rank_acc = (hits / counts.clamp(min=1)[:, None]).tolist()
        chain = tau_from_conditional([row[0] for row in rank_acc])  # heads treated as independent
        paths = medusa_tree(rank_acc, tree_tokens)
        out = {
            "head_top1": [r[0] for r in rank_acc],
            "head_top5": [sum(r[:5]) for r in rank_acc],
            "rank_accuracy": rank_acc,
            "tau_chain": chain,
            "tau_tree": tau_tree(paths, rank_acc),
            "tree_tokens": tree_tokens,
        }
        return out
    c = trainer.loss_cfg
    t = trainer.frozen_target
    if getattr(head, "head_type", None) == "earlyexit":
        return _evaluate_earlyexit(trainer, batches, hidden, eval_depth)
    if getattr(head, "head_type", None) in ("dflash", "peagle"):
        from draftsmith.heads.block.training import evaluate_block

        return evaluate_block(head, t, batches, hidden, c)
    avg = weighted_means(
        batches,
        dev,
        lambda b: EAGLE_LOSSES[head.config.kind](head, t, hidden(b), b, c, ttt_steps=eval_depth)[1],
        lambda b, m: float(b["loss_mask"].sum()),
    )
    acc = [avg[f"acc_{i}"] for i in range(eval_depth) if f"acc_{i}" in avg]
    return {
        "acceptance_per_depth": acc,
        "tau_sim": tau_from_conditional(acc),
        "loss_per_depth": [avg[f"loss_{i}"] for i in range(eval_depth) if f"loss_{i}" in avg],
    }


def _evaluate_earlyexit(
    trainer: HeadTrainer, batches: list[dict], hidden: HiddenStates, eval_depth: int
) -> dict:
    """Early exit: held-out greedy acceptance per chain depth against the target's argmax over the FULL
    vocabulary (teacher-forced along the held-out text) and simulated tau = 1 + sum_i prod_{j<=i} a_i."""
    from draftsmith.heads.selfspec.earlyexit import earlyexit_loss

    head, c = trainer.head, trainer.loss_cfg
    dev = next(head.parameters()).device

    def metrics_of(batch):
        return earlyexit_loss(
            head, output_head(trainer.frozen_target).weight, hidden(batch), hidden.aux_layers,
            batch["attention_mask"], batch["loss_mask"], loss=c.kind, temperature=c.temperature, beta=c.beta,
            depth=eval_depth, exact_acceptance=True,
        )[1]  # fmt: skip

    avg = weighted_means(
        batches, dev, metrics_of, lambda b, m: m.get("n_rows", 0.0), prefixes=("acc_", "loss_")
    )
    acc = [avg[f"acc_{i}"] for i in range(eval_depth) if f"acc_{i}" in avg]
    return {
        "acceptance_per_depth": acc,
        "tau_sim": tau_from_conditional(acc),
        "loss_per_depth": [avg["loss_0"]] if "loss_0" in avg else [],
    }


__all__ = ["HeadTrainer", "chain_tree", "evaluate_heads"]
