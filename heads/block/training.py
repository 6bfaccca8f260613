"""Training of the block-parallel drafters in the heads recipe (head.kind dflash | peagle): the recipe fields,
building the module, the training step and the held-out per-position acceptance.

The data, the hidden-state cache (the same three aux layers + final state as EAGLE-3: one cache serves EAGLE-3,
DFlash and P-EAGLE), the optimizer loop and the head-folder format are the EAGLE-3 recipe's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.heads.block.dflash import DFlashDrafter
from draftsmith.heads.block.losses import dflash_loss, peagle_loss
from draftsmith.heads.block.peagle import PEagleHead
from draftsmith.heads.common import tau_estimates, weighted_means
from draftsmith.heads.eagle.model import EagleHead
from draftsmith.modeling import base_decoder, output_head


@dataclass
class BlockHeadFields:
    block_size: int = 8
    """dflash: rows per drafter forward (the anchor + block_size-1 masks -> block_size-1 draft tokens)."""
    draft_layers: int = 1
    """dflash: transformer layers of the block drafter."""
    mask_token_id: int | None = None
    """dflash / peagle: token id embedded at masked / placeholder positions; null = the least frequent training
    token. dflash with draft_vocab_size 0: the target's frozen full head (the SGLang / z-lab layout)."""
    num_depths: int = 4
    """peagle: draft tokens per forward (1 real row + num_depths-1 placeholders)."""


@dataclass
class BlockLossFields:
    anchors: int = 16
    """dflash: random blocks per conversation per step."""
    gamma: float = 4.0
    """dflash: weight exp(-(j-1)/gamma) of block position j (position j counts only if positions < j are accepted)."""
    cod_ratio: float = 0.7
    """peagle: COD sampling, depth d keeps max(cod_ratio^d, cod_min) of the columns kept at depth d-1."""
    cod_min: float = 0.2


def pick_mask_token(counts: torch.Tensor, special: set[int]) -> int:
    """The mask/placeholder token: the least frequent target id of the training data (never seen, ideally), so its
    frozen embedding carries no meaning the drafter would confuse with text. Ties -> lowest id; specials skipped."""
    c = counts.clone().double()
    for i in special:
        c[i] = float("inf")
    return int(torch.argmin(c))


def _mask_token(h, target, counts: torch.Tensor, special: set[int]) -> int:
    mask = h.mask_token_id if h.mask_token_id is not None else pick_mask_token(counts, special)
    if not 0 <= mask < target.config.vocab_size:
        raise DraftsmithError(
            f"head.mask_token_id {mask} is outside the target vocabulary [0, {target.config.vocab_size})"
        )
    return mask


def dflash_aux_layers(h, num_layers: int) -> list[int]:
    """The aux layers of a DFlash recipe (null = EAGLE-3's default), checked."""
    from draftsmith.heads.eagle.model import default_aux_layers

    aux = h.aux_layers
    if aux is not None and (not aux or aux != sorted(set(aux)) or not all(0 <= i <= num_layers for i in aux)):
        raise DraftsmithError(
            f"head.aux_layers must be increasing hidden_states indices in [0, {num_layers}], got {aux}"
        )
    return list(aux) if aux is not None else default_aux_layers(num_layers)


def _check_dflash_section(h) -> None:
    if not 1 <= h.draft_layers <= 16 or h.block_size < 2:
        raise DraftsmithError(
            f"dflash needs head.draft_layers in [1, 16] and head.block_size >= 2, got {h.draft_layers}, {h.block_size}"
        )


def build_dflash(cfg, target, train_examples) -> DFlashDrafter:
    """A DFlash drafter per the recipe: draft vocabulary by EAGLE-3's rule (draft_vocab_size 0: the target's frozen
    full head), mask token = head.mask_token_id or the least frequent training token."""
    from draftsmith.heads.common import training_vocab

    h = cfg.head
    _check_dflash_section(h)
    vocab_ids, counts, special = training_vocab(target, train_examples, h.draft_vocab_size)
    frozen = h.draft_vocab_size == 0
    return DFlashDrafter.from_target(
        target,
        draft_vocab_ids=torch.arange(target.config.vocab_size) if frozen else vocab_ids,
        mask_token_id=_mask_token(h, target, counts, special),
        block_size=h.block_size,
        num_layers=h.draft_layers,
        aux_layers=dflash_aux_layers(h, target.config.num_hidden_layers),
        intermediate_size=h.intermediate_size,
        freeze_lm_head=frozen,
    )


def build_peagle(cfg, target, train_examples) -> PEagleHead:
    """A P-EAGLE head per the recipe: an EAGLE-3 head (same vocabulary rule and aux layers) + mask_hidden."""
    from draftsmith.heads.common import training_vocab
    from draftsmith.heads.eagle.training import aux_layers

    h = cfg.head
    if h.num_depths < 2:
        raise DraftsmithError(f"peagle needs head.num_depths >= 2 (parallel draft depth), got {h.num_depths}")
    vocab_ids, counts, special = training_vocab(target, train_examples, h.draft_vocab_size)
    base = EagleHead.from_target(
        target,
        "eagle3",
        draft_vocab_ids=vocab_ids,
        aux_layers=aux_layers(h, target.config.num_hidden_layers),
        norm_before_residual=h.norm_before_residual,
        intermediate_size=h.intermediate_size,
    )
    return PEagleHead.from_target_head(
        base, mask_token_id=_mask_token(h, target, counts, special), num_depths=h.num_depths
    )


def plan_dflash(cfg, target_config) -> dict:
    """The config fields of the drafter this recipe will save that the export formats check."""
    h, n, hidden, v = (
        cfg.head,
        target_config.num_hidden_layers,
        target_config.hidden_size,
        target_config.vocab_size,
    )
    _check_dflash_section(h)
    return {
        "aux_hidden_state_layer_ids": dflash_aux_layers(h, n),
        "aux_layer_convention": "layer_input",
        "frozen_lm_head": h.draft_vocab_size == 0,
        "draft_vocab_size": min(h.draft_vocab_size, v) or v,
        "vocab_size": v,
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "target": {"num_hidden_layers": n, "hidden_size": hidden},
    }


def features(head) -> tuple[str, list[int]]:
    """EAGLE-3's features: the same (shareable) eagle3 cache."""
    ids = head.config.aux_hidden_state_layer_ids
    return "eagle3", list(ids)


def loss(tr, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    return block_step(tr.head, tr.frozen_target, tr.hidden(batch), batch, tr.loss_cfg, exact=False)


def evaluate(trainer, batches: list[dict], hidden, eval_cfg) -> dict:
    return evaluate_block(trainer.head, trainer.frozen_target, batches, hidden, trainer.loss_cfg)


def block_step(
    head,
    target,
    feats: dict,
    batch: dict,
    loss_cfg,
    *,
    exact: bool,
    depth: int | None = None,
    full: bool = False,
    generator=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One loss evaluation of a block drafter (training: exact=False, full=False; held-out: exact=True and every
    P-EAGLE draft position scored (full=True), so its per-depth acceptance is conditional)."""
    emb, lmw = base_decoder(target).embed_tokens.weight, output_head(target).weight
    kw = dict(
        loss=loss_cfg.kind,
        temperature=loss_cfg.temperature,
        beta=loss_cfg.beta,
        exact_acceptance=exact,
        generator=generator,
    )
    if isinstance(head, DFlashDrafter):
        return dflash_loss(head, emb, lmw, feats, batch, anchors=loss_cfg.anchors, gamma=loss_cfg.gamma, **kw)
    ratio = 1.0 if full else loss_cfg.cod_ratio
    return peagle_loss(
        head, emb, lmw, feats, batch, depths=depth, cod_ratio=ratio, cod_min=loss_cfg.cod_min, **kw
    )


@torch.no_grad()
def evaluate_block(head, target, batches: list[dict], hidden, loss_cfg) -> dict:
    """Held-out: acceptance per draft position (conditional, exact full-vocab argmax), predicted tau (P-EAGLE: the
    rounds walk along the responses; DFlash, whose blocks sit at random anchors: the chain formula), loss per
    position. Anchors are drawn with a fixed seed so successive evals score the same blocks."""
    dev = next(head.parameters()).device
    gen = torch.Generator().manual_seed(0)
    avg = weighted_means(
        batches,
        dev,
        lambda b: block_step(head, target, hidden(b), b, loss_cfg, exact=True, full=True, generator=gen)[1],
        lambda b, m: float(b["loss_mask"].sum()),
    )
    n_pos = (head.config.block_size - 1) if isinstance(head, DFlashDrafter) else head.num_depths
    acc = [avg[f"acc_{i}"] for i in range(n_pos) if f"acc_{i}" in avg]
    return {
        "acceptance_per_position": acc,
        "acceptance_per_depth": acc,
        **tau_estimates(avg, acc),
        "loss_per_position": [avg[f"loss_{i}"] for i in range(n_pos) if f"loss_{i}" in avg],
    }
