"""The Medusa family's records: `medusa` (Medusa-1 heads, frozen target; also what a Medusa-2 run saves) and
`medusa2` (a recipe kind: heads trained with a LoRA-tuned target)."""

from __future__ import annotations

import torch

from draftsmith.checkpoint import head_folder_check
from draftsmith.heads.common import config_from_dict
from draftsmith.heads.io import ACCURACY_FILE, save_head
from draftsmith.heads.medusa import training
from draftsmith.heads.medusa.export import VLLM_MEDUSA, medusa_tensors
from draftsmith.heads.medusa.model import MedusaConfig, MedusaHeads
from draftsmith.heads.medusa.proposer import MedusaProposer, build_medusa
from draftsmith.heads.medusa.trees import medusa_tree
from draftsmith.kinds import Card, CostModel, DrafterKind, Option, Training

OPTIONS = (
    Option("total_tokens", int, "nodes of the static tree built from the measured rank accuracies", min=1),
    Option("depth", int, "draft depth: the same as the decoder's --k (at most the number of heads)", min=1),
    Option("chain", bool, "1: the top-1 chain instead of the tree"),
)
MEDUSA_TOP1 = (0.56, 0.32, 0.20, 0.15)  # Medusa paper's per-head top-1 on a 7B: shapes the timed tree only


def load(config: dict) -> MedusaHeads:
    return MedusaHeads(config_from_dict(MedusaConfig, config, "medusa config"), config.get("target"))


def max_depth(config: dict) -> tuple[int, str]:
    n = int(config.get("num_heads", 0))
    return n, f"{n} heads"


def cost(target, settings, opts):
    """Medusa heads at the target's size (4 heads, one residual block), a tree shaped by published accuracies."""

    with torch.device(settings.device):
        heads = MedusaHeads.from_target(target, num_heads=len(MEDUSA_TOP1), num_layers=1)
    heads = heads.to(target.dtype).eval().requires_grad_(False)
    acc = [[top1 * 0.5**r for r in range(10)] for top1 in MEDUSA_TOP1]
    paths = medusa_tree(acc, opts.get("total_tokens", 16), opts.get("depth"))
    return MedusaProposer(heads, target.config.num_hidden_layers, paths)


def example(root, target) -> str:
    """4 untrained heads whose blocks are not the identity (they disagree with the target) and a 4-level tree."""

    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, num_heads=4, num_layers=1)
    with torch.no_grad():
        for blk in heads.blocks:
            blk.layers[0].weight.normal_(0, 0.5)
    acc = [[0.5, 0.2, 0.1], [0.3, 0.2, 0.1], [0.2, 0.1, 0.05], [0.1, 0.05, 0.02]]
    save_head(heads, root / "medusa", extra_json={ACCURACY_FILE: {"rank_accuracy": acc}})
    return f"medusa:{root / 'medusa'},total_tokens=10"


_TRAINING = dict(
    build=training.build,
    loss=training.loss,
    evaluate=training.evaluate,
    features=training.features,
    head_fields=training.MedusaHeadFields,
    loss_fields=training.MedusaLossFields,
    eval_fields=training.MedusaEvalFields,
)

MEDUSA = DrafterKind(
    name="medusa",
    family="medusa",
    title="Medusa heads",
    card=Card(
        tag="medusa",
        text="Medusa heads: extra decoding heads on the target's last hidden state, each predicting one token "
        "further ahead, trained on the frozen target",
        paper="Medusa-1 (Cai et al., 2024)",
    ),
    build=build_medusa,
    options=OPTIONS,
    max_depth=max_depth,
    training=Training(**_TRAINING),
    load=load,
    check_folder=head_folder_check(medusa_tensors),
    exports=(VLLM_MEDUSA,),
    cost=CostModel(cost),
    example=example,
)
MEDUSA2 = DrafterKind(
    name="medusa2",
    family="medusa",
    title="Medusa-2 heads (trained with a LoRA-tuned target)",
    card=Card(
        tag="medusa",
        text="Medusa-2 heads: the heads trained together with a LoRA adapter of the target",
        paper="Medusa-2 (Cai et al., 2024)",
    ),
    training=Training(
        **_TRAINING, setup=training.medusa2_setup, sections=training.Medusa2Sections, saves_as="medusa"
    ),
)
KINDS = (MEDUSA, MEDUSA2)
