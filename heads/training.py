"""The trainable module of every head kind and its held-out evaluation; the kind's record (draftsmith.heads.kinds)
supplies the loss and the eval.

`HeadTrainer.forward(batch) -> (loss, metrics)` does all the work so that DDP/FSDP wrappers (which only
synchronise gradients through `forward`) see it. The frozen target is held outside the module's parameters
(never checkpointed, never in the optimizer) except where the kind trains the target too (Medusa-2's LoRA), which
makes it a submodule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.heads.hidden import HiddenStates


@dataclass
class TrainSetup:
    """What a kind that also trains the target (Training.setup) hands the recipe."""

    target: Any
    """The target the trainer holds (e.g. LoRA-wrapped)."""
    target_training: Any
    """The kind's settings for the trained target (HeadTrainer.target_training)."""
    param_groups: list[dict] | None = None
    """Optimizer groups (e.g. heads and LoRA at different learning rates); None = one group."""
    save_extra: Callable[[nn.Module, Path], None] | None = None
    """Called with (trainer module, checkpoint folder) after the head is saved (e.g. the LoRA adapter)."""


class HeadTrainer(nn.Module):
    """head + its loss on the target's hidden states. kind: the recipe kind (default: the head's own type);
    target_training: the kind's settings when the target is trained too (then the target is a submodule)."""

    def __init__(
        self,
        head: nn.Module,
        target,
        hidden: HiddenStates,
        loss_cfg,
        target_training=None,
        kind: str | None = None,
    ):
        from draftsmith.heads.kinds import head_kind

        super().__init__()
        self.head = head
        self.loss_cfg = loss_cfg
        self.kind = head_kind(kind or head.head_type)
        self.target_training = target_training
        if target_training is not None:
            self.target = target  # trained (LoRA), so it is a submodule
            self.register_buffer("micro_step", torch.zeros((), dtype=torch.long))
        else:
            self._frozen = [target]  # a list keeps it out of parameters(), state_dict() and checkpoints
        self.hidden = hidden

    @property
    def frozen_target(self):
        return self.target if self.target_training is not None else self._frozen[0]

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        loss, m = self.kind.training.loss(self, batch)
        m["n_tokens"] = float(batch["loss_mask"].sum())
        return loss, m


@torch.no_grad()
def evaluate_heads(trainer: HeadTrainer, batches: list[dict], hidden: HiddenStates, eval_cfg) -> dict:
    """Held-out metrics of the trainer's head, by its kind's record (Medusa: rank accuracies and tree tau; EAGLE and
    the block drafters: per-depth conditional acceptance and simulated tau). eval_cfg: the recipe's eval section."""
    return trainer.kind.training.evaluate(trainer, batches, hidden, eval_cfg)


__all__ = ["HeadTrainer", "TrainSetup", "evaluate_heads"]
