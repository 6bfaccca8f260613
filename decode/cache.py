"""KV-cache rollback without recomputation: crop a chain, gather-then-crop a tree path."""

from __future__ import annotations

import torch


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
