"""Trained early exit in the heads recipe (head.kind earlyexit): the recipe field, the adapter built from the target,
one step's loss and the held-out per-depth acceptance (heads.selfspec.earlyexit holds the adapter and its loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.acceptance import tau_from_conditional
from draftsmith.heads.common import training_vocab, weighted_means
from draftsmith.heads.selfspec.earlyexit import EarlyExitAdapter, earlyexit_loss
from draftsmith.modeling import output_head


@dataclass
class EarlyExitHeadFields:
    exit_layer: int = 2
    """earlyexit: the draft shares the target's layers 0..L-1 and its adapter reads hidden_states[L] (an EAGLE-3
    cache holds aux layers 2, N//2, N-3: pick one of them to train from it)."""


def build(cfg, target, train_examples) -> EarlyExitAdapter:
    """The adapter on the target's own head rows over the same reduced vocabulary as EAGLE-3's."""
    h = cfg.head
    vocab_ids, _, _ = training_vocab(target, train_examples, h.draft_vocab_size)
    return EarlyExitAdapter.from_target(target, h.exit_layer, vocab_ids, h.intermediate_size)


def features(adapter) -> tuple[str, list[int]]:
    return "earlyexit", [adapter.config.exit_layer]


def _metrics(trainer, hidden, batch, **kw) -> tuple[torch.Tensor, dict[str, float]]:
    c = trainer.loss_cfg
    return earlyexit_loss(
        trainer.head, output_head(trainer.frozen_target).weight, hidden(batch), hidden.aux_layers,
        batch["attention_mask"], batch["loss_mask"], loss=c.kind, temperature=c.temperature, beta=c.beta, **kw,
    )  # fmt: skip


def loss(tr, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    return _metrics(tr, tr.hidden, batch)


@torch.no_grad()
def evaluate(trainer, batches: list[dict], hidden, eval_cfg) -> dict:
    """Held-out greedy acceptance per chain depth against the target's argmax over the FULL vocabulary
    (teacher-forced along the held-out text) and simulated tau = 1 + sum_i prod_{j<=i} a_i."""
    depth = eval_cfg.depth
    avg = weighted_means(
        batches,
        next(trainer.head.parameters()).device,
        lambda b: _metrics(trainer, hidden, b, depth=depth, exact_acceptance=True)[1],
        lambda b, m: m.get("n_rows", 0.0),
        prefixes=("acc_", "loss_"),
    )
    acc = [avg[f"acc_{i}"] for i in range(depth) if f"acc_{i}" in avg]
    return {
        "acceptance_per_depth": acc,
        "tau_sim": tau_from_conditional(acc),
        "loss_per_depth": [avg["loss_0"]] if "loss_0" in avg else [],
    }
