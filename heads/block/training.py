"""Recipe glue of the block-parallel drafters (head.kind dflash | peagle): building the module, the training step and
the held-out per-position acceptance, so heads/recipe.py and heads/training.py only dispatch here.

The data, the hidden-state cache (the same three aux layers + final state as EAGLE-3: one cache serves EAGLE-3,
DFlash and P-EAGLE), the optimizer loop and the head-folder format are the EAGLE-3 recipe's.
"""

from __future__ import annotations

import torch

from draftsmith.acceptance import tau_from_conditional
from draftsmith.errors import DraftsmithError
from draftsmith.heads.block.dflash import DFlashDrafter
from draftsmith.heads.block.losses import dflash_loss, peagle_loss
from draftsmith.heads.block.peagle import PEagleHead
from draftsmith.heads.common import weighted_means
from draftsmith.heads.eagle.model import EagleHead
from draftsmith.modeling import base_decoder, output_head

BLOCK_KINDS = ("dflash", "peagle")


def is_block(head) -> bool:
    return isinstance(head, (DFlashDrafter, PEagleHead))


def pick_mask_token(counts: torch.Tensor, special: set[int]) -> int:
    """The mask/placeholder token: the least frequent target id of the training data (never seen, ideally), so its
    frozen embedding carries no meaning the drafter would confuse with text. Ties -> lowest id; specials skipped."""
    c = counts.clone().double()
    for i in special:
        c[i] = float("inf")
    return int(torch.argmin(c))


def build_block_head(h, target, counts: torch.Tensor, vocab_ids: torch.Tensor, special: set[int]):
    """h: the recipe's HeadSection; counts [V] token counts of the training data; vocab_ids: the draft vocabulary
    (EAGLE-3's rule). Returns a DFlashDrafter or PEagleHead."""
    n = target.config.num_hidden_layers
    mask = h.mask_token_id if h.mask_token_id is not None else pick_mask_token(counts, special)
    if not 0 <= mask < target.config.vocab_size:
        raise DraftsmithError(
            f"head.mask_token_id {mask} is outside the target vocabulary [0, {target.config.vocab_size})"
        )
    if h.kind == "dflash":
        aux = h.aux_layers
        if aux is not None and (not aux or aux != sorted(set(aux)) or not all(0 <= i <= n for i in aux)):
            raise DraftsmithError(
                f"head.aux_layers must be increasing hidden_states indices in [0, {n}], got {aux}"
            )
        if not 1 <= h.draft_layers <= 16 or h.block_size < 2:
            raise DraftsmithError(
                f"dflash needs head.draft_layers in [1, 16] and head.block_size >= 2, got {h.draft_layers}, {h.block_size}"
            )
        frozen = h.draft_vocab_size == 0
        return DFlashDrafter.from_target(
            target,
            draft_vocab_ids=torch.arange(target.config.vocab_size) if frozen else vocab_ids,
            mask_token_id=mask,
            block_size=h.block_size,
            num_layers=h.draft_layers,
            aux_layers=aux,
            intermediate_size=h.intermediate_size,
            freeze_lm_head=frozen,
        )
    if h.num_depths < 2:
        raise DraftsmithError(f"peagle needs head.num_depths >= 2 (parallel draft depth), got {h.num_depths}")
    base = EagleHead.from_target(
        target,
        "eagle3",
        draft_vocab_ids=vocab_ids,
        aux_layers=h.aux_layers,
        norm_before_residual=h.norm_before_residual,
        intermediate_size=h.intermediate_size,
    )
    return PEagleHead.from_target_head(base, mask_token_id=mask, num_depths=h.num_depths)


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
    """Held-out: acceptance per draft position (conditional, exact full-vocab argmax), simulated tau, loss per
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
        "tau_sim": tau_from_conditional(acc),
        "loss_per_position": [avg[f"loss_{i}"] for i in range(n_pos) if f"loss_{i}" in avg],
    }
