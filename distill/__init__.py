"""Distillation library: divergences (DistillSpec), draft initialisation, reduced vocabularies, acceptance metrics.

The public names of the submodules are re-exported here (transformers/peft are imported only inside the functions
that need them, so importing the package stays cheap).
"""

from draftsmith.distill.divergences import LOSSES, DivergenceKind, divergence
from draftsmith.distill.init import add_lora, existing, fresh, select_layers, shrink
from draftsmith.distill.metrics import AcceptanceMeter
from draftsmith.distill.vocab import (
    build_vocab_ids,
    load_draft_vocab,
    restricted_logits,
    save_draft_vocab,
    special_token_ids,
    to_target_probs,
    token_counts,
)

__all__ = [
    "LOSSES",
    "AcceptanceMeter",
    "DivergenceKind",
    "add_lora",
    "build_vocab_ids",
    "divergence",
    "existing",
    "fresh",
    "load_draft_vocab",
    "restricted_logits",
    "save_draft_vocab",
    "select_layers",
    "shrink",
    "special_token_ids",
    "to_target_probs",
    "token_counts",
]
