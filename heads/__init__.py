"""Trained draft heads and self-speculative drafters, one subpackage per family, one record per kind (kinds.py):

    medusa/    Medusa-1/2 heads (static trees from measured rank accuracies)
    eagle/     EAGLE-1 and EAGLE-3 heads (training-time test, EAGLE-2 dynamic trees)
    block/     block-parallel drafters on EAGLE-3's features: DFlash-style block drafter, P-EAGLE
    selfspec/  the target drafting with its own layers: layer skip, trained early exit

Shared by every family: the draft-layer pieces (layers.py), the head-folder format and target record (common.py,
io.py), hidden-state caches (hidden.py), training data (data.py), the trainer module (training.py) and the one heads
recipe (recipe.py, run by train/heads.py).

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
