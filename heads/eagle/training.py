"""EAGLE-1 / EAGLE-3 training in the heads recipe: the recipe fields, the module built from the target, one step's
loss (training-time test, heads.eagle.losses) and the held-out per-depth acceptance."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import tau_estimates, weighted_means
from draftsmith.heads.eagle.losses import EAGLE_LOSSES
from draftsmith.heads.eagle.model import EagleHead, default_aux_layers


@dataclass
class EagleHeadFields:
    norm_before_residual: bool = False
    """EAGLE-3: take the residual after hidden_norm (SGLang cannot serve such a head)."""


@dataclass
class EagleLossFields:
    feature_noise: float = 0.0
    """EAGLE-1: width of uniform noise added to the input features (0.2 in EAGLE-1)."""
    ce_weight: float = 0.1
    """EAGLE-1: weight of the token CE next to the feature regression (weight 1)."""


def aux_layers(h, num_layers: int) -> list[int]:
    """The EAGLE-3 aux layers a recipe's head section asks for (null = the default), checked."""
    aux = h.aux_layers or default_aux_layers(num_layers)
    if len(aux) != 3 or not all(0 <= i <= num_layers for i in aux):
        raise DraftsmithError(
            f"head.aux_layers must be 3 hidden_states indices in [0, {num_layers}], got {aux}"
        )
    return list(aux)


def build_eagle1(cfg, target, train_examples) -> EagleHead:
    return EagleHead.from_target(target, "eagle", intermediate_size=cfg.head.intermediate_size)


def build_eagle3(cfg, target, train_examples) -> EagleHead:
    from draftsmith.heads.common import training_vocab

    h = cfg.head
    vocab_ids, _, _ = training_vocab(target, train_examples, h.draft_vocab_size)
    return EagleHead.from_target(
        target,
        "eagle3",
        draft_vocab_ids=vocab_ids,
        aux_layers=aux_layers(h, target.config.num_hidden_layers),
        norm_before_residual=h.norm_before_residual,
        intermediate_size=h.intermediate_size,
    )


def plan_eagle3(cfg, target_config) -> dict:
    """The config fields of the head this recipe will save that the export formats check."""
    n, hidden = target_config.num_hidden_layers, target_config.hidden_size
    return {
        "aux_hidden_state_layer_ids": aux_layers(cfg.head, n),
        "aux_layer_convention": "layer_input",
        "norm_before_residual": cfg.head.norm_before_residual,
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "target": {"num_hidden_layers": n, "hidden_size": hidden},
    }


def features(head) -> tuple[str, list[int]]:
    if head.config.kind == "eagle3":
        return "eagle3", list(head.config.aux_hidden_state_layer_ids)
    return "eagle", []


def loss(tr, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    return EAGLE_LOSSES[tr.head.config.kind](
        tr.head,
        tr.frozen_target,
        tr.hidden(batch),
        batch,
        tr.loss_cfg,
        exact_acceptance=False,  # training logs: within-draft-vocab agreement; the eval is exact
    )


@torch.no_grad()
def evaluate(trainer, batches: list[dict], hidden, eval_cfg) -> dict:
    """Per-depth conditional acceptance (training-time-test unroll of eval.depth steps) and the predicted greedy
    tau: tokens per expected round along the held-out responses, for every k up to eval.depth (heads.common.
    tau_estimates; bonus included)."""
    head, c, t = trainer.head, trainer.loss_cfg, trainer.frozen_target
    depth = eval_cfg.depth
    avg = weighted_means(
        batches,
        next(head.parameters()).device,
        lambda b: EAGLE_LOSSES[head.config.kind](head, t, hidden(b), b, c, ttt_steps=depth)[1],
        lambda b, m: float(b["loss_mask"].sum()),
    )
    acc = [avg[f"acc_{i}"] for i in range(depth) if f"acc_{i}" in avg]
    return {
        "acceptance_per_depth": acc,
        **tau_estimates(avg, acc),
        "loss_per_depth": [avg[f"loss_{i}"] for i in range(depth) if f"loss_{i}" in avg],
    }
