"""KV-cache rollback without recomputation (crop a chain, gather-then-crop a tree path), and what a compiled step
over a static cache is built with: its length and torch.compile's arguments."""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError


def static_len(tokens: int) -> int:
    """Rows of a static cache for `tokens` tokens: whole 256s, so sequences of similar length share a compiled
    step's shapes instead of recompiling."""
    return -(-tokens // 256) * 256


def compile_options(compile: bool | str) -> dict:
    """torch.compile's arguments for a step over a static cache: True = inductor with CUDA graphs (mode
    reduce-overhead), a backend name = that backend (the CPU tests trace with "aot_eager"); an unknown name is one
    DraftsmithError line listing the known ones."""
    if compile is True:
        return {"mode": "reduce-overhead"}
    if compile not in torch._dynamo.list_backends(exclude_tags=()):
        raise DraftsmithError(
            f"unknown compile backend {compile!r}; use True (inductor) or one of "
            f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))}"
        )
    return {"backend": compile}


def crop_to(cache, length: int, current: int | None = None) -> None:
    """Shrink a Dynamic/StaticCache to `length` tokens (negative crop: the form transformers 4.x and 5.x accept).
    Pass `current` (the cache length, when the caller tracks it) to avoid a device sync."""
    remove = (int(cache.get_seq_length()) if current is None else current) - length
    if remove > 0:
        cache.crop(-remove)


def compact_cache(cache, start: int, keep: torch.Tensor, current: int | None = None) -> None:
    """Move KV rows `start + keep` (ascending, within the verify block) to `start .. start+len(keep)`, crop after."""
    n = int(keep.numel())
    for layer in cache.layers:
        # advanced indexing copies first, so overlapping source/destination rows are safe
        layer.keys[:, :, start : start + n] = layer.keys[:, :, start + keep]
        layer.values[:, :, start : start + n] = layer.values[:, :, start + keep]
    crop_to(cache, start + n, current)
