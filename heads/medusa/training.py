"""Medusa training: the recipe fields, Medusa-1's loss (frozen target), Medusa-2's joint loss (LoRA target + heads)
and the held-out rank accuracies the static decoding tree is built from."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from draftsmith.acceptance import tau_from_conditional, tau_tree
from draftsmith.errors import DraftsmithError
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.heads.medusa.trees import medusa_tree
from draftsmith.modeling import base_decoder, output_head

RANKS = 10  # Medusa rank accuracies measured per head (the static tree picks from these)
LORA_DIR = "target_lora"  # Medusa-2: the target's LoRA adapter (peft save_pretrained), beside the heads


@dataclass
class MedusaHeadFields:
    num_heads: int = 4
    """Medusa: heads (head k predicts token t+2+k)."""
    num_layers: int = 1
    """Medusa: residual blocks per head."""
    reduced_vocab: bool = False
    """Medusa: each head projects onto head.draft_vocab_size tokens (the training data's most frequent, EAGLE-3's
    rule; rows of the target's lm_head, token_map to target ids) instead of the full vocabulary: on a 152k-token
    target four full heads are 0.9B parameters."""


@dataclass
class MedusaLossFields:
    max_rows: int = 0
    """Medusa: positions sampled per head per micro-batch (0 = all); the vocab projections dominate the cost."""
    medusa_labels: Literal["tokens", "target"] = "tokens"
    """Medusa-1: tokens = the data's next tokens (as published); target = self-distillation, the frozen target's
    distribution at t+1+k (what greedy verification checks; needed to learn from fixed, human-written text)."""


@dataclass
class MedusaEvalFields:
    tree_tokens: int = 16
    """Medusa: node budget of the static tree built from measured rank accuracies."""


@dataclass
class Medusa2Section:
    lora_r: int = 16
    lora_alpha: int = 32
    target_loss: Literal["kl", "lm"] = "kl"
    """kl: self-distillation to the adapter-disabled target (keeps its outputs); lm: next-token CE on the data."""
    lambda0: float = 0.2
    """Weight of the heads' loss next to the target term."""
    head_lr: float = 1e-3
    """Heads' learning rate (LoRA uses train.lr)."""
    warmup_head_steps: int = 50
    """Optimizer steps that train the heads only before the LoRA joins."""
    grad_accum: int = 1
    """Set from train.grad_accum (micro-steps per optimizer step); not a user knob."""


@dataclass
class Medusa2Sections:
    medusa2: Medusa2Section = field(default_factory=Medusa2Section)
    """Medusa-2 (head.kind: medusa2): the target's LoRA and the joint loss."""


def build(cfg, target, train_examples) -> MedusaHeads:
    h, ids = cfg.head, None
    if h.reduced_vocab:
        from draftsmith.heads.common import training_vocab

        ids = training_vocab(target, train_examples, h.draft_vocab_size)[0]
    return MedusaHeads.from_target(target, h.num_heads, h.num_layers, draft_vocab_ids=ids)


def features(head) -> tuple[str, list[int]]:
    return "medusa", []  # the final normed state only


def medusa2_setup(cfg, target, head):
    """Medusa-2: the target gets a LoRA adapter, trained with the heads (heads at medusa2.head_lr); the adapter is
    saved beside the heads (target_lora/) and merged into the target when the folder is decoded."""
    from draftsmith.heads.training import TrainSetup
    from draftsmith.modeling import add_lora

    target = add_lora(target, r=cfg.medusa2.lora_r, alpha=cfg.medusa2.lora_alpha)
    m2 = cfg.medusa2
    m2.grad_accum = cfg.train.grad_accum
    lora = [p for p in target.parameters() if p.requires_grad]
    groups = [{"params": list(head.parameters()), "lr": m2.head_lr}, {"params": lora}]

    def save_adapter(module, out_dir: Path) -> None:  # Medusa-2 changed the target: the adapter ships beside
        module.target.save_pretrained(str(Path(out_dir) / LORA_DIR))

    return TrainSetup(target=target, target_training=m2, param_groups=groups, save_extra=save_adapter)


def loss(tr, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    ids, lm = batch["input_ids"], batch["loss_mask"]
    if tr.target_training is not None:
        return _medusa2_loss(tr, ids, batch["attention_mask"], lm)
    soft = getattr(tr.loss_cfg, "medusa_labels", "tokens") == "target"
    return tr.head.loss(
        tr.hidden(batch)["last"],
        ids,
        lm,
        decay=tr.loss_cfg.decay,
        max_rows=getattr(tr.loss_cfg, "max_rows", 0),
        target_head=output_head(tr.frozen_target).weight if soft else None,
    )


def _medusa2_loss(tr, ids, am, lm):
    """Medusa-2: LoRA target + heads. Loss = target term + lambda0 * sum_k 0.8^k CE_k (Medusa sec. 2.2);
    target term = KL(adapter-disabled target || LoRA target) (self-distillation) or the LM loss.
    The first warmup_head_steps optimizer steps train the heads only (target run without grad)."""
    m2 = tr.target_training
    step = int(tr.micro_step) // max(m2.grad_accum, 1)
    if tr.training:
        tr.micro_step += 1
    dec = base_decoder(tr.target)
    warm = step < m2.warmup_head_steps
    with torch.set_grad_enabled(torch.is_grad_enabled() and not warm):
        h = dec(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
    head_loss, m = tr.head.loss(
        h, ids, lm, decay=tr.loss_cfg.decay, max_rows=getattr(tr.loss_cfg, "max_rows", 0)
    )
    if warm:
        m["target_loss"] = 0.0
        return m2.lambda0 * head_loss, m
    valid = lm[:, 1:].bool()
    logits = output_head(tr.target)(h[:, :-1][valid])  # [N, V] rows that predict response tokens
    if m2.target_loss == "kl":
        from draftsmith.divergences import divergence

        with torch.no_grad(), tr.target.disable_adapter():
            h_ref = dec(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
            ref = output_head(tr.target)(h_ref[:, :-1][valid])
        tl = divergence("fkl", ref, logits)
    else:
        tl = F.cross_entropy(logits.float(), ids[:, 1:][valid])
    m["target_loss"] = float(tl.detach())
    return tl + m2.lambda0 * head_loss, m


@torch.no_grad()
def evaluate(trainer, batches: list[dict], hidden, eval_cfg) -> dict:
    """Held-out per-head rank accuracies against the TARGET's greedy token (what greedy verification accepts), chain
    and tree expected tau (the tree of eval.tree_tokens nodes built from them)."""
    head = trainer.head
    dev = next(head.parameters()).device
    k = head.config.num_heads
    hits = torch.zeros(k, RANKS, dtype=torch.float64)
    counts = torch.zeros(k, dtype=torch.float64)
    for batch in batches:
        batch = {n: v.to(dev) for n, v in batch.items()}
        ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        if trainer.target_training is not None:
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
            top = head.target_ids(lmh(blk(rows)).topk(min(RANKS, lmh.out_features), -1).indices)
            hits[j, : top.shape[1]] += (top == greedy[:, None]).double().sum(0).cpu()
            counts[j] += float(valid.sum())
    rank_acc = (hits / counts.clamp(min=1)[:, None]).tolist()
    tree_tokens = getattr(eval_cfg, "tree_tokens", 16)
    paths = medusa_tree(rank_acc, tree_tokens)
    return {
        "head_top1": [r[0] for r in rank_acc],
        "head_top5": [sum(r[:5]) for r in rank_acc],
        "rank_accuracy": rank_acc,
        "tau_chain": tau_from_conditional([row[0] for row in rank_acc]),  # heads treated as independent
        "tau_tree": tau_tree(paths, rank_acc),
        "tree_tokens": tree_tokens,
    }


def merge_target_lora(target_model, head_dir: str | os.PathLike) -> bool:
    """Medusa-2: fold the LoRA adapter saved in `head_dir/target_lora` into `target_model`'s weights IN PLACE
    (W += B A * alpha / r, peft merge_and_unload), so the heads decode with the backbone they were trained with.
    Plain decoding of the same object then runs the merged model too: Medusa-2 speedups are measured against
    the fine-tuned target, whose greedy output is what speculative decoding reproduces. Returns False if the
    folder holds no adapter (Medusa-1)."""
    lora = Path(head_dir) / LORA_DIR
    if not (lora / "adapter_config.json").is_file():
        return False
    from peft import PeftModel

    if hasattr(target_model, "peft_config"):
        raise DraftsmithError(f"target already carries a peft adapter; load a plain target to merge {lora}")
    dtype = next(target_model.parameters()).dtype
    try:
        wrapped = PeftModel.from_pretrained(target_model, str(lora), is_trainable=False)
    except (ValueError, RuntimeError, KeyError) as e:
        raise DraftsmithError(
            f"{lora} does not fit this target ({e}); pass the target the head was trained for"
        ) from None
    merged = wrapped.merge_and_unload()  # the same module tree, LoRA layers replaced by merged Linear layers
    if merged is not target_model:
        raise DraftsmithError(f"merging {lora} did not update the target in place; unsupported peft version")
    target_model.to(dtype)
    return True
