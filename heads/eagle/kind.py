"""The EAGLE family's records: `eagle` (EAGLE-1) and `eagle3` (EAGLE-3). Both spec kinds decode both folder kinds
(`eagle:` is the documented spec, `eagle3:` its alias)."""

from __future__ import annotations

import torch

from draftsmith.checkpoint import head_folder_check
from draftsmith.heads.eagle import training
from draftsmith.heads.eagle.export import SGLANG_EAGLE3, SPECULATORS_EAGLE3, eagle1_tensors, eagle3_tensors
from draftsmith.heads.eagle.model import EagleHead, default_aux_layers, eagle_config_from_dict
from draftsmith.heads.eagle.proposer import EagleProposer, build_eagle
from draftsmith.heads.io import save_head
from draftsmith.heads.targetinit import eagle1_from_target, eagle3_from_target
from draftsmith.kinds import Card, CostModel, DrafterKind, Option, Training

OPTIONS = (
    Option("top_k", int, "children of each expanded node (1: a chain)", min=1),
    Option("depth", int, "tree depth: the same as the decoder's --k", min=1),
    Option("total_tokens", int, "nodes of the tree (the best by cumulative draft log-prob)", min=1),
)
COST_DEFAULTS = {"top_k": 8, "total_tokens": 24}  # EagleProposer's defaults


def load(config: dict) -> EagleHead:
    return EagleHead(eagle_config_from_dict(config), config.get("target"))


def random_eagle3(target, draft_vocab: int, device) -> EagleHead:
    """A random EAGLE-3 head at the target's shape with a `draft_vocab`-token draft vocabulary (cost models)."""
    v = target.config.vocab_size
    with torch.device(device):
        head = EagleHead.from_target(
            target,
            "eagle3",
            draft_vocab_ids=torch.arange(min(draft_vocab, v)),
            aux_layers=default_aux_layers(target.config.num_hidden_layers),
        )
    return head.to(target.dtype).eval().requires_grad_(False)


def cost(target, settings, opts):
    """An EAGLE-3 head at the target's size (an EAGLE-1 head is one layer as well: `eagle:` is timed with it)."""
    return EagleProposer(
        random_eagle3(target, settings.draft_vocab, settings.device), target, **{**COST_DEFAULTS, **opts}
    )


def example_aux(target) -> list[int]:
    """Three distinct aux layers of any target with >= 2 layers: the embeddings, the middle, the final state."""
    n = target.config.num_hidden_layers
    return sorted({0, n // 2, n})


def example_eagle3(root, target) -> str:

    path = root / "eagle3"
    if not path.is_dir():
        torch.manual_seed(0)
        v = target.config.vocab_size
        head = EagleHead.from_target(
            target, "eagle3", draft_vocab_ids=torch.arange(0, v, 2), aux_layers=example_aux(target)
        )
        save_head(head, path)
    return f"eagle3:{path},top_k=4,total_tokens=14"


def example_eagle1(root, target) -> str:

    torch.manual_seed(0)
    save_head(EagleHead.from_target(target, "eagle"), root / "eagle1")
    return f"eagle:{root / 'eagle1'},top_k=3,total_tokens=9"


EAGLE1 = DrafterKind(
    name="eagle",
    family="eagle",
    title="an EAGLE-1 head",
    card=Card(
        tag="eagle",
        text="an EAGLE head: one decoder layer over the target's last hidden state and the next token's embedding, "
        "drafting features autoregressively",
        paper="EAGLE (Li et al., 2024)",
    ),
    build=build_eagle,
    options=OPTIONS,
    accepts=("eagle", "eagle3"),
    training=Training(
        build=training.build_eagle1,
        loss=training.loss,
        evaluate=training.evaluate,
        features=training.features,
        loss_fields=training.EagleLossFields,
        from_target=eagle1_from_target,
    ),
    load=load,
    check_folder=head_folder_check(eagle1_tensors),
    cost=CostModel(timed_as="eagle3"),  # one decoder layer, as EAGLE-3's: timed with an EAGLE-3 head
    example=example_eagle1,
)
EAGLE3 = DrafterKind(
    name="eagle3",
    family="eagle",
    title="an EAGLE-3 head",
    card=Card(
        tag="eagle3",
        text="an EAGLE-3 head: one decoder layer over three of the target's layers, trained with training-time "
        "test, drafting over a reduced vocabulary",
        paper="EAGLE-3 (Li et al., 2025)",
    ),
    build=build_eagle,
    options=OPTIONS,
    accepts=("eagle", "eagle3"),
    training=Training(
        build=training.build_eagle3,
        loss=training.loss,
        evaluate=training.evaluate,
        features=training.features,
        plan=training.plan_eagle3,
        head_fields=training.EagleHeadFields,
        loss_fields=training.EagleLossFields,
        from_target=eagle3_from_target,
    ),
    load=load,
    check_folder=head_folder_check(eagle3_tensors),
    exports=(SGLANG_EAGLE3, SPECULATORS_EAGLE3),
    cost=CostModel(cost),
    example=example_eagle3,
)
KINDS = (EAGLE1, EAGLE3)
