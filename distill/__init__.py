"""Distillation library (DistillSpec): draft initialisation, data policies, the distillation recipe, acceptance
metrics. Divergences, reduced vocabularies and LoRA live in core (draftsmith.divergences, .vocab, .modeling).

The public names of the submodules are re-exported here (transformers/peft are imported only inside the functions
that need them, so importing the package stays cheap).
"""

from draftsmith.distill.init import existing, fresh, select_layers, shrink
from draftsmith.distill.metrics import AcceptanceMeter

__all__ = ["AcceptanceMeter", "existing", "fresh", "select_layers", "shrink"]
