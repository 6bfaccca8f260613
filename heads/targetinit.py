"""Draft layers started from the target's own weights (recipe `head.init: target`) instead of random ones.

What every trained draft layer already takes from the target whatever `head.init` says: the token embedding (the
target's, passed in at call time) and the output head rows of its vocabulary (EAGLE-3, P-EAGLE, DFlash: lm_head
rows W_lm[vocab_ids]; the early exit reads them from the target). `head.init: target` adds:

- the decoder layer(s): the target's LAST layer (DFlash with n layers: its last n, in order) copied name by name --
  q/k/v/o, the MLP, the norms (Qwen3 targets' q_norm / k_norm where the draft has them). EAGLE-3 / P-EAGLE's
  attention reads [input_layernorm(embed); hidden_norm(g)] (2H wide): the target's q/k/v go into the hidden half,
  the embedding half keeps its random init, and hidden_norm takes the target layer's input_layernorm (input_layernorm
  of the embedding stays ones). Draft layers are bias-free Llama layers (the layout the engines load), so a Qwen2
  target's q/k/v biases are NOT copied: the copy is the target layer without them.
- the final norm: the target's (EAGLE-3, P-EAGLE, DFlash; the early exit has it already).
- the feature fusion fc (EAGLE-3, P-EAGLE, DFlash): the projection onto the DEEPEST aux state (an identity block,
  zeros elsewhere), so the copied layer starts on a state of the target's own residual stream rather than on a
  random mix; the other aux columns learn from zero.

EAGLE-1's fc (2H -> H over [embed; feature]) keeps its random init; Medusa heads always start from the target's
lm_head (their blocks at the identity), so `head.init` does not apply to them.

Each kind's record names its copy (draftsmith.kinds.Training.from_target: eagle3_from_target, ...); a kind whose
record names none refuses `head.init: target`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.kinds import DrafterKind
from draftsmith.modeling import base_decoder

log = logging.getLogger(__name__)

INITS = ("random", "target")


def copy_target_layer(layer: nn.Module, source: nn.Module, rename: dict[str, str] | None = None) -> list[str]:
    """Copy a target decoder layer's parameters into a draft layer, name by name (`rename`: draft name -> target
    name, "" = keep the draft's own). Equal shapes are copied as they are; a draft weight with the same rows and a
    wider input gets the target's weight in its LAST columns (EAGLE-3's 2H attention input: the hidden half).
    Returns the target parameter names that were not copied (e.g. Qwen2's q/k/v biases)."""
    rename = rename or {}
    src = dict(source.named_parameters())
    used = set()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            s = src.get(rename.get(name, name))
            if s is None:
                continue
            if s.shape == p.shape:
                p.copy_(s)
            elif p.dim() == s.dim() == 2 and p.shape[0] == s.shape[0] and p.shape[1] > s.shape[1]:
                p[:, -s.shape[1] :].copy_(s)
            else:
                continue
            used.add(rename.get(name, name))
    return sorted(set(src) - used)


def select_deepest(fc: nn.Linear, aux_layers: list[int]) -> None:
    """fc [H, n_aux * H] over concatenated aux states -> the identity on the deepest one, zeros elsewhere."""
    h = fc.out_features
    if fc.in_features != h * len(aux_layers):
        raise DraftsmithError(f"fc input {fc.in_features} is not {len(aux_layers)} aux states of width {h}")
    j = aux_layers.index(max(aux_layers))
    with torch.no_grad():
        fc.weight.zero_()
        fc.weight[:, j * h : (j + 1) * h].copy_(torch.eye(h))


def _final_norm(dst: nn.Module, target) -> None:
    with torch.no_grad():
        dst.weight.copy_(base_decoder(target).norm.weight)


def eagle3_from_target(head: nn.Module, target: nn.Module) -> list[str]:
    """EAGLE-3 and P-EAGLE: the target's last layer into the midlayer (q/k/v into the hidden half), its final norm,
    fc onto the deepest aux state."""
    skipped = copy_target_layer(
        head.midlayer,
        base_decoder(target).layers[-1],
        {"hidden_norm.weight": "input_layernorm.weight", "input_layernorm.weight": ""},
    )
    _final_norm(head.norm, target)
    select_deepest(head.fc, list(head.config.aux_hidden_state_layer_ids))
    return skipped


def eagle1_from_target(head: nn.Module, target: nn.Module) -> list[str]:
    """EAGLE-1: the target's last layer into the head's layer (fc stays random)."""
    return copy_target_layer(head.layers[0], base_decoder(target).layers[-1])


def dflash_from_target(drafter: nn.Module, target: nn.Module) -> list[str]:
    """DFlash: the target's last n layers in order, hidden_norm, final norm, fc onto the deepest aux state."""
    layers = base_decoder(target).layers
    src = layers[
        max(0, len(layers) - len(drafter.layers)) :
    ]  # more draft layers than target ones: the rest stay random
    skipped = []
    for dst, s in zip(drafter.layers, src):
        skipped += copy_target_layer(dst, s)
    with torch.no_grad():
        drafter.hidden_norm.weight.copy_(src[0].input_layernorm.weight)
    _final_norm(drafter.norm, target)
    select_deepest(drafter.fc, list(drafter.config.aux_hidden_state_layer_ids))
    return skipped


def earlyexit_from_target(adapter: nn.Module, target: nn.Module) -> list[str]:
    """The early exit: the target's last layer into the adapter."""
    return copy_target_layer(adapter, base_decoder(target).layers[-1])


def check_init(init: str, rec: DrafterKind) -> None:
    """head.init at config validation: one of INITS, and `target` only for a kind whose record names its copy."""
    if init not in INITS:
        raise DraftsmithError(f"head.init={init!r} is not one of {', '.join(INITS)}")
    if init == "target" and (rec.training is None or rec.training.from_target is None):
        raise DraftsmithError(
            f"head.init=target does not apply to {rec.name} (its heads start from the target's lm_head already); "
            "remove head.init or set it to random"
        )


def apply_init(init: str, head: nn.Module, target: nn.Module, rec: DrafterKind) -> nn.Module:
    """`head.init: target`: start `head` from the target's weights (the record's Training.from_target); random: as
    it is."""
    if init == "target":
        check_init(init, rec)
        skipped = rec.training.from_target(head, target)
        n = target.config.num_hidden_layers
        log.info(
            "head.init=target: %s starts from the target's layer %d%s",
            head.head_type,
            n - 1,
            f" (not copied: {', '.join(skipped)})" if skipped else "",
        )
    return head
