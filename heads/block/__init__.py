"""Block-parallel drafters, a block of draft tokens per forward on EAGLE-3's features and cache: the DFlash-style
block drafter (dflash) and P-EAGLE (peagle), their losses, proposers, recipe glue (training), exports (export) and
kind records (kind)."""

from draftsmith.heads.block.dflash import DFlashConfig, DFlashDrafter
from draftsmith.heads.block.peagle import PEagleHead

__all__ = ["DFlashConfig", "DFlashDrafter", "PEagleHead"]
