"""EAGLE-1 and EAGLE-3 heads: the module (model), the training-time-test losses (losses), the EAGLE-2 dynamic-tree
proposer (proposer), SGLang / speculators exports (export) and the kind records (kind)."""

from draftsmith.heads.eagle.model import EagleConfig, EagleHead, default_aux_layers, eagle_config_from_dict

__all__ = ["EagleConfig", "EagleHead", "default_aux_layers", "eagle_config_from_dict"]
