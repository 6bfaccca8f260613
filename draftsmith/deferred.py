"""Imports deferred until something uses them.

DeepSpeed. accelerate's `extract_model_from_parallel` (called by every `save_pretrained`, through transformers'
`unwrap_model`, and by `Accelerator.unwrap_model`) runs `from deepspeed import DeepSpeedEngine` whenever deepspeed
is *installed*, only to test `isinstance(model, DeepSpeedEngine)`. Importing deepspeed costs ~1 s and prints
"[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU..." on machines without CUDA, so
every quickstart (it saves checkpoints) and the first eval of the embedded target (it saves the dequantized GGUF)
printed it, though nothing there uses DeepSpeed. A model can only be a DeepSpeedEngine once deepspeed has been
imported (accelerate imports it to build one under a ZeRO config), so the check there is asked as "is deepspeed
loaded" instead of "is it installed": the same answer for every model, without the import.
"""

from __future__ import annotations

import sys


def deepspeed_loaded() -> bool:
    return "deepspeed" in sys.modules


def defer_deepspeed() -> None:
    """Make accelerate's unwrap check import deepspeed only when deepspeed is already in use (module docstring).
    Harmless if accelerate changes: without the hook it finds nothing to replace and imports as before."""
    try:
        from accelerate.utils import other
    except ImportError:
        return
    if callable(getattr(other, "is_deepspeed_available", None)):
        other.is_deepspeed_available = deepspeed_loaded
