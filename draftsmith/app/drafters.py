"""The drafter table: `kind:arg` specs -> Proposer. Every drafter kind draftsmith can decode with is one row here;
its builder lives in the method package that implements it (decode/, heads/, ...).

    build_proposer("eagle:runs/heads/final,top_k=6", DrafterContext(target, tokenizer, device))
"""

from __future__ import annotations

from torch import nn

from draftsmith.cpulayout import tune_linears
from draftsmith.decode.drafters import Builder, DrafterContext, build_draft, build_ngram
from draftsmith.decode.proposer import Proposer
from draftsmith.errors import DraftsmithError
from draftsmith.heads.block.proposers import build_dflash, build_peagle
from draftsmith.heads.eagle.proposer import build_eagle
from draftsmith.heads.medusa.proposer import build_medusa
from draftsmith.heads.selfspec.folders import build_earlyexit, build_layerskip

DRAFTERS: dict[str, Builder] = {
    "draft": build_draft,
    "ngram": build_ngram,
    "medusa": build_medusa,
    "eagle": build_eagle,
    "eagle3": build_eagle,
    "layerskip": build_layerskip,
    "earlyexit": build_earlyexit,
    "dflash": build_dflash,
    "peagle": build_peagle,
}
NEEDS_PATH = {"draft", "medusa", "eagle", "eagle3", "layerskip", "earlyexit", "dflash", "peagle"}
"""Kinds whose argument starts with a model folder or Hub id (checked before anything loads)."""


def kinds() -> str:
    return ", ".join(sorted(DRAFTERS))


def split_spec(spec: str) -> tuple[str, str]:
    kind, sep, arg = spec.partition(":")
    if not sep:
        raise DraftsmithError(
            f"drafter {spec!r} has no kind; use one of {kinds()} as kind:arg, e.g. draft:path/to/dir"
        )
    if kind not in DRAFTERS:
        raise DraftsmithError(
            f"unknown drafter kind {kind!r}; use one of {kinds()} (e.g. draft:DIR or ngram:)"
        )
    return kind, arg


def validate_spec(spec: str) -> tuple[str, str]:
    """Cheap checks before anything loads: known kind, and a model path where the kind needs one."""
    kind, arg = split_spec(spec)
    if kind in NEEDS_PATH and not arg.partition(",")[0]:
        raise DraftsmithError(f"drafter '{kind}:' needs a checkpoint: {kind}:<folder|hub id>")
    if kind == "ngram":
        build_ngram(arg, None)  # options are checked before any weights load
    return kind, arg


def build_proposer(spec: str, ctx: DrafterContext) -> Proposer:
    """Turn 'kind:arg' into a Proposer (loading weights if the kind has any)."""
    kind, arg = split_spec(spec)
    return tune_proposer(DRAFTERS[kind](arg, ctx))


def tune_proposer(proposer: Proposer) -> Proposer:
    """Freeze the proposer's own modules (decode only) and give them the CPU weight layout (draftsmith.cpulayout)."""
    for value in vars(proposer).values():
        if isinstance(value, nn.Module):
            tune_linears(value.requires_grad_(False))
    return proposer
