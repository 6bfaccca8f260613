"""Medusa-1/2 heads: the module (model), its static trees (trees), proposer, training loss and held-out eval
(training), vLLM export (export) and the kind records (kind)."""

from draftsmith.heads.medusa.model import MedusaBlock, MedusaConfig, MedusaHeads

__all__ = ["MedusaBlock", "MedusaConfig", "MedusaHeads"]
