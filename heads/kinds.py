"""The table of head drafter kinds: one record per kind (draftsmith.kinds), listed by family. Training, save and load
look kinds up here; the app's table (draftsmith.app.drafters.DRAFTERS) adds the decoder's own kinds.

A new kind is a family subpackage whose `kind` module defines its record, and that module listed in FAMILIES once.
"""

from __future__ import annotations

from draftsmith.errors import DraftsmithError
from draftsmith.heads.block import kind as block
from draftsmith.heads.eagle import kind as eagle
from draftsmith.heads.medusa import kind as medusa
from draftsmith.heads.selfspec import kind as selfspec
from draftsmith.kinds import DrafterKind

FAMILIES = (medusa, eagle, block, selfspec)
HEAD_KINDS: dict[str, DrafterKind] = {rec.name: rec for family in FAMILIES for rec in family.KINDS}
"""kind name -> record (what a recipe's head.kind, a folder's draftsmith_head_type and a spec name)."""


def head_kind(name: str) -> DrafterKind:
    """The record of a head kind, or one DraftsmithError line listing the known ones."""
    rec = HEAD_KINDS.get(name)
    if rec is None:
        raise DraftsmithError(f"unknown head kind {name!r}; known: {', '.join(sorted(HEAD_KINDS))}")
    return rec


def trained_kinds() -> list[str]:
    """Kinds the heads recipe trains (head.kind)."""
    return sorted(name for name, rec in HEAD_KINDS.items() if rec.training is not None)


def folder_kinds() -> list[str]:
    """Kinds a head folder (config.json draftsmith_head_type + model.safetensors) can hold."""
    return sorted(name for name, rec in HEAD_KINDS.items() if rec.load is not None)
