"""Medusa and EAGLE draft heads: modules, losses, hidden-state caches, save/load and tree proposers.

from draftsmith.heads import MedusaHeads, EagleHead, save_head, load_head
heads = MedusaHeads.from_target(target, num_heads=4)
save_head(heads, "out/final"); heads = load_head("out/final", target)
"""

from draftsmith.heads.eagle.model import EagleConfig, EagleHead, default_aux_layers
from draftsmith.heads.io import load_head, read_accuracy, save_head
from draftsmith.heads.medusa.model import MedusaConfig, MedusaHeads

__all__ = [
    "EagleConfig",
    "EagleHead",
    "MedusaConfig",
    "MedusaHeads",
    "default_aux_layers",
    "load_head",
    "read_accuracy",
    "save_head",
]
