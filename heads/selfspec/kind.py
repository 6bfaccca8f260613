"""The self-speculative family's records: `earlyexit` (trained early exit: the target's first layers + an adapter)
and `layerskip` (the target minus a measured skip set, made by `draftsmith layerskip`, no weights)."""

from __future__ import annotations

import torch

from draftsmith.checkpoint import head_dims, head_folder_check, int_field, llama_layer_tensors
from draftsmith.heads.common import config_from_dict
from draftsmith.heads.io import save_head
from draftsmith.heads.selfspec import training
from draftsmith.heads.selfspec.earlyexit import EarlyExitAdapter, EarlyExitConfig
from draftsmith.heads.selfspec.folders import build_earlyexit, build_layerskip, check_layerskip_folder
from draftsmith.heads.selfspec.targetlayers import full_attention_only
from draftsmith.heads.targetinit import earlyexit_from_target
from draftsmith.kinds import Card, DrafterKind, Option, Training

OPTIONS = (
    Option("top_k", int, "1: a chain; more: an EAGLE-2-style dynamic tree", min=1),
    Option("depth", int, "draft depth: the same as the decoder's --k", min=1),
    Option("total_tokens", int, "nodes of the tree (default top_k * depth)", min=1),
    Option(
        "stop_below",
        float,
        "end a chain at the first token drafted with probability below it",
        min=0,
        below=1,
    ),
    Option("reuse", bool, "1: the verify reuses the shared layers' rows of the drafted tokens"),
)


def earlyexit_tensors(cfg: dict, where: str) -> tuple[dict, dict]:
    """One Llama layer over the exit layer's states + final norm; its head rows are the target's (vocab_ids)."""
    d = head_dims(cfg, where)
    req = llama_layer_tensors("", d, 1, input_norm=True)
    req.update({"norm.weight": (d["H"],), "vocab_ids": (int_field(cfg, "draft_vocab_size", where),)})
    return req, {}


def example_earlyexit(root, target) -> str:
    """An adapter on layer 1 whose output projections are not zero (an untrained one is the plain early exit)."""

    torch.manual_seed(0)
    ad = EarlyExitAdapter.from_target(target, 1, None)
    with torch.no_grad():
        ad.self_attn.o_proj.weight.normal_(0, 0.3)
        ad.mlp.down_proj.weight.normal_(0, 0.3)
    save_head(ad, root / "earlyexit")
    return f"earlyexit:{root / 'earlyexit'}"


def example_layerskip(root, target) -> str:
    from draftsmith.heads.selfspec.folders import save_layerskip

    save_layerskip(
        root / "layerskip", target, skip=[target.config.num_hidden_layers - 1], vocab_ids=None, search={}
    )
    return f"layerskip:{root / 'layerskip'}"


EARLYEXIT = DrafterKind(
    name="earlyexit",
    family="selfspec",
    title="a trained early-exit adapter",
    card=Card(
        tag="self-speculative",
        text="a trained early exit: the target's first layers and a small adapter draft for the whole target",
        paper="self-speculative early exit: Kangaroo (Liu et al., 2024); LayerSkip (Elhoushi et al., 2024)",
    ),
    build=build_earlyexit,
    options=OPTIONS,
    training=Training(
        build=training.build,
        loss=training.loss,
        evaluate=training.evaluate,
        features=training.features,
        head_fields=training.EarlyExitHeadFields,
        from_target=earlyexit_from_target,
    ),
    load=lambda config: EarlyExitAdapter(
        config_from_dict(EarlyExitConfig, config, "earlyexit config"), config.get("target")
    ),
    check_folder=head_folder_check(earlyexit_tensors),
    refuses=full_attention_only,
    example=example_earlyexit,
)
LAYERSKIP = DrafterKind(
    name="layerskip",
    family="selfspec",
    title="a layer-skip drafter (the target minus a skip set)",
    card=Card(
        tag="self-speculative",
        text="a layer-skip set: the target drafts with a measured set of its own layers skipped, no weights",
        paper="self-speculative layer skipping: Draft & Verify (Zhang et al., 2024)",
    ),
    build=build_layerskip,
    options=OPTIONS,
    check_folder=check_layerskip_folder,
    refuses=full_attention_only,
    example=example_layerskip,
)
KINDS = (EARLYEXIT, LAYERSKIP)
