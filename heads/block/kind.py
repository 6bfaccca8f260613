"""The block-parallel family's records: `dflash` (DFlash-style block drafter) and `peagle` (P-EAGLE). Both train on
EAGLE-3's features and share its hidden-state cache."""

from __future__ import annotations

import torch

from draftsmith.checkpoint import head_folder_check
from draftsmith.heads.block import training
from draftsmith.heads.block.dflash import DFlashDrafter, dflash_config_from_dict
from draftsmith.heads.block.export import (
    NATIVE_DFLASH,
    NATIVE_PEAGLE,
    SGLANG_DFLASH,
    SPECULATORS_DFLASH,
    SPECULATORS_PEAGLE,
    dflash_tensors,
    peagle_tensors,
)
from draftsmith.heads.block.peagle import PEagleHead, peagle_from_config_dict
from draftsmith.heads.block.proposers import DFlashProposer, PEagleProposer, build_dflash, build_peagle
from draftsmith.heads.eagle.training import plan_eagle3
from draftsmith.heads.io import save_head
from draftsmith.heads.targetinit import dflash_from_target, eagle3_from_target
from draftsmith.kinds import Card, CostModel, DrafterKind, Option, Training

TOP_K = Option("top_k", int, "1: a chain; more: a best-first tree of each position's top_k", min=1)
TOTAL = Option("total_tokens", int, "nodes of the tree (top_k > 1)", min=1)
BLOCK_SHAPES = {  # target shape -> (DFlash block size, DFlash layers, draft vocab; 0 = the target's full head)
    "llama-3.1-8b": (16, 5, 0),  # recipes/heads-llama3.1-8b-dflash.yaml: z-lab's published shape
    "smollm2-135m": (8, 1, 8192),  # recipes/heads-smollm2-135m-dflash.yaml
    "tiny-target": (8, 1, 0),
}


def cost_dflash(target, settings, opts) -> DFlashProposer:
    """A DFlash drafter of the published shape for this target shape (BLOCK_SHAPES)."""
    block, layers, vocab = BLOCK_SHAPES.get(settings.shape, (8, 1, 0))
    v = target.config.vocab_size
    with torch.device(settings.device):
        d = DFlashDrafter.from_target(
            target,
            draft_vocab_ids=torch.arange(min(vocab, v) if vocab else v),
            mask_token_id=0,
            block_size=block,
            num_layers=layers,
            freeze_lm_head=not vocab,
        )
    d = d.to(target.dtype).eval().requires_grad_(False)
    return DFlashProposer(d, target, top_k=opts.get("top_k", 1), total_tokens=opts.get("total_tokens", 16))


def cost_peagle(target, settings, opts) -> PEagleProposer:
    """A P-EAGLE head at the target's size; one forward computes every depth it has, so it has the draft's depth."""
    from draftsmith.heads.eagle.kind import random_eagle3

    depth = opts.get("depth") or settings.k
    base = random_eagle3(target, settings.draft_vocab, settings.device)
    head = PEagleHead.from_target_head(base, mask_token_id=0, num_depths=max(depth, 2))
    head = head.to(target.dtype).eval().requires_grad_(False)
    return PEagleProposer(
        head, target, top_k=opts.get("top_k", 1), total_tokens=opts.get("total_tokens", 16), depth=depth
    )


def example_dflash(root, target) -> str:
    from draftsmith.heads.eagle.kind import example_aux

    torch.manual_seed(0)
    d = DFlashDrafter.from_target(
        target,
        draft_vocab_ids=torch.arange(0, target.config.vocab_size, 2),
        mask_token_id=3,
        block_size=5,
        num_layers=2,
        aux_layers=example_aux(target),
    )
    save_head(d, root / "dflash")
    return f"dflash:{root / 'dflash'},top_k=3,total_tokens=10"


def example_peagle(root, target) -> str:
    from draftsmith.heads.eagle.kind import example_aux
    from draftsmith.heads.eagle.model import EagleHead

    torch.manual_seed(0)
    e3 = EagleHead.from_target(
        target,
        "eagle3",
        draft_vocab_ids=torch.arange(0, target.config.vocab_size, 2),
        aux_layers=example_aux(target),
    )
    save_head(PEagleHead.from_target_head(e3, mask_token_id=3, num_depths=4), root / "peagle")
    return f"peagle:{root / 'peagle'},top_k=2,total_tokens=6"


def _max_dflash(config: dict) -> tuple[int, str]:
    b = int(config.get("block_size", 2))
    return b - 1, f"block_size {b}: {b - 1} draft tokens per forward"


def _max_peagle(config: dict) -> tuple[int, str]:
    n = int(config.get("num_depths", 1))
    return n, f"{n} depths per forward"


_TRAINING = dict(
    loss=training.loss,
    evaluate=training.evaluate,
    features=training.features,
    head_fields=training.BlockHeadFields,
    loss_fields=training.BlockLossFields,
)
DFLASH = DrafterKind(
    name="dflash",
    family="block",
    title="a DFlash-style block drafter",
    card=Card(
        tag="dflash",
        text="a DFlash-style block drafter: a few layers conditioned on the target's hidden features draft a whole "
        "block in one forward",
        paper="DFlash (Chen et al., 2026)",
    ),
    build=build_dflash,
    options=(TOP_K, TOTAL),
    max_depth=_max_dflash,
    training=Training(
        build=training.build_dflash, plan=training.plan_dflash, from_target=dflash_from_target, **_TRAINING
    ),
    load=lambda config: DFlashDrafter(dflash_config_from_dict(config), config.get("target")),
    check_folder=head_folder_check(dflash_tensors),
    exports=(NATIVE_DFLASH, SGLANG_DFLASH, SPECULATORS_DFLASH),
    cost=CostModel(cost_dflash),
    example=example_dflash,
)
PEAGLE = DrafterKind(
    name="peagle",
    family="block",
    title="a P-EAGLE head",
    card=Card(
        tag="peagle",
        text="a P-EAGLE head: an EAGLE-3 head that drafts every depth in one forward",
        paper="P-EAGLE (arXiv 2602.01469, 2026) on EAGLE-3 (Li et al., 2025)",
    ),
    build=build_peagle,
    options=(TOP_K, TOTAL, Option("depth", int, "draft depth: the same as the decoder's --k", min=1)),
    max_depth=_max_peagle,
    # the copy of head.init: target is EAGLE-3's: a P-EAGLE head is an EAGLE-3 head plus its placeholder state
    training=Training(
        build=training.build_peagle, plan=plan_eagle3, from_target=eagle3_from_target, **_TRAINING
    ),
    load=peagle_from_config_dict,
    check_folder=head_folder_check(peagle_tensors),
    exports=(NATIVE_PEAGLE, SPECULATORS_PEAGLE),
    cost=CostModel(cost_peagle),
    example=example_peagle,
)
KINDS = (DFLASH, PEAGLE)
