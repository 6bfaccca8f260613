"""The target's own decoder layers run one by one over its own KV cache (self-speculative drafting,
draftsmith.heads.selfspec.drafting), with the masks of drafted rows: a chain, a tree, rows of a batch that differ in
padding and length (decode.ragged)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.decode.ragged import block_mask as ragged_mask
from draftsmith.errors import DraftsmithError
from draftsmith.modeling import sliding_window, text_config


def full_attention_only(config) -> str | None:
    """The draft runs the target's own layers over its own KV cache with masks of its own (no sliding window)."""
    window = sliding_window(config)
    if window is None:
        return None
    return (
        f"{text_config(config).model_type} has sliding-window attention ({window} tokens) and self-speculative "
        "drafting runs full-attention layers only; use a draft:, eagle3:, dflash: or ngram: drafter"
    )


class TargetLayers:
    """The target's decoder (HF Llama-family layer API: embed_tokens, layers, norm, rotary_emb) run layer by
    layer over its own DynamicCache. Holds references only."""

    def __init__(self, target):
        dec = target.get_decoder()
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(dec, name):
                raise DraftsmithError(
                    f"self-speculative drafting needs a Llama-style decoder ({name} missing on "
                    f"{type(dec).__name__}); use a draft:, eagle: or ngram: drafter for this target"
                )
        why = full_attention_only(target.config)
        if why:
            raise DraftsmithError(why)
        self.dec = dec
        self.layers = dec.layers
        self.num_layers = len(dec.layers)
        self.dtype = dec.embed_tokens.weight.dtype
        self.device = dec.embed_tokens.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, n] -> embeddings [B, n, H]."""
        return self.dec.embed_tokens(ids)

    def run(
        self,
        h: torch.Tensor,
        layer_ids: Sequence[int],
        cache,
        positions: torch.Tensor,
        block_mask: torch.Tensor | None = None,
        ragged=None,
    ) -> torch.Tensor:
        """Run layers `layer_ids` (ascending) on h [B, n, H] at positions [n] (or [B, n]), appending K/V to `cache`.

        block_mask [n, m + n] (or [B, n, m + n]) bool: what the n new rows see among the last m rows already in
        each layer and themselves (True = attend); everything before those is the committed context, visible to
        all. None: one row sees everything; several rows are causal among themselves (m = 0). ragged: the cache's
        decode.ragged.RaggedCache, where rows differ in padding or length (each row sees its own committed columns
        only)."""
        n = h.shape[1]
        if block_mask is None and n > 1:
            block_mask = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        pos = positions if positions.dim() == 2 else positions.view(1, n)
        rope = self.dec.rotary_emb(h, pos)
        masks: dict[int, torch.Tensor | None] = {}
        for i in layer_ids:
            past = cache.layers[i].get_seq_length()
            if past not in masks:
                masks[past] = _layer_mask(block_mask, past, n, h.dtype, ragged)
            h = self.layers[i](
                h, attention_mask=masks[past], position_ids=pos, cache=cache, use_cache=True,
                position_embeddings=rope,
            )  # fmt: skip
        return h


def _layer_mask(block_mask, past: int, n: int, dtype, ragged) -> torch.Tensor | None:
    """The additive mask of n new rows in a layer holding `past` rows (TargetLayers.run)."""
    if ragged is None or ragged.uniform:
        return None if block_mask is None else _additive(block_mask, past, dtype)
    m = past - ragged.cols  # rows drafted into this layer since the last commit
    if block_mask is None:  # one row: it sees every drafted row
        block_mask = torch.ones(n, m + n, dtype=torch.bool, device=ragged.cache.layers[0].keys.device)
    visible = block_mask.expand(ragged.batch, n, m + n) if block_mask.dim() == 2 else block_mask
    return ragged_mask(ragged.pads, ragged.lengths, ragged.cols, visible, dtype)


def _additive(block_mask: torch.Tensor, past: int, dtype) -> torch.Tensor:
    """bool [n, m + n] (or [B, n, m + n]) over the last m + n keys of a layer holding `past` rows before this call
    -> additive [1 | B, 1, n, past + n] mask (0 = attend, finfo.min = masked); HF attention passes it as-is."""
    block_mask = block_mask if block_mask.dim() == 3 else block_mask[None]
    b, n, w = block_mask.shape
    full = torch.ones(b, n, past + n, dtype=torch.bool, device=block_mask.device)
    full[:, :, past + n - w :] = block_mask
    out = torch.zeros(b, n, past + n, dtype=dtype, device=block_mask.device)
    return out.masked_fill_(~full, torch.finfo(dtype).min)[:, None]


def crop_layers(cache, layer_ids: Sequence[int], length: int) -> None:
    """Drop rows past `length` from the given layers of a DynamicCache (the others are left alone)."""
    for i in layer_ids:
        extra = cache.layers[i].get_seq_length() - length
        if extra > 0:
            cache.layers[i].crop(-extra)
