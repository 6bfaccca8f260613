"""Grouped-query attention over a few new columns without repeating the cache's key/value heads.

With grouped-query attention (Llama 3, Qwen2, Mistral: several query heads share one key/value head) transformers'
SDPA path repeats every key/value head of the cache once per query head of its group (`repeat_kv`) whenever an
attention mask is passed and it cannot use SDPA's own `enable_gqa`; its cheaper single-column fold (`pack_gqa`)
is skipped under torch.compile. A compiled draft step, which always passes a mask over its static cache, thus
copied its whole cache n_rep times per layer and token: for the Qwen2.5-Coder-0.5B draft (14 query heads over 2
key/value heads, a 1024-column static buffer) 3.7 MB per layer, and ~4 ms of a ~22 ms step (RESULTS.md).

`packed_sdpa` folds instead: the n_rep query heads of a group become n_rep x T query rows of that key/value head
(row g*T + t = head g of the group, column t), the mask's rows are repeated to match, and one SDPA call attends
over the cache as it is. Same products, same softmax per row: the output equals the repeated form's up to float
rounding. Longer blocks (prefill), masks with one row per head, and models without groups go to transformers' own
SDPA function unchanged. `use_packed_gqa(model)` registers it (with SDPA's mask builder) and switches a model to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from draftsmith.modeling import causal_lm

NAME = "draftsmith_packed_sdpa"
MAX_COLUMNS = 16
"""The longest block folded (decode steps and verify blocks); a longer one (a prompt) runs transformers' SDPA."""


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An AttentionInterface function: query [B, H, T, D], key / value [B, Hkv, L, D], attention_mask [B, 1, T, L]
    (additive or bool) or None -> ([B, T, H, D], None), as transformers' `sdpa_attention_forward`."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    B, H, T, D = query.shape
    fold = (
        n_rep > 1
        and T <= MAX_COLUMNS
        and (attention_mask is not None or T == 1)  # T > 1 without a mask: causal inside the block
        and (attention_mask is None or attention_mask.shape[1] == 1)
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and key.shape[1] * n_rep == H
    )
    if not fold:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    q = query.reshape(B, H // n_rep, n_rep * T, D)
    mask = attention_mask
    if mask is not None and T > 1:
        mask = (
            mask[:, :, None]
            .expand(mask.shape[0], 1, n_rep, T, mask.shape[-1])
            .reshape(mask.shape[0], 1, n_rep * T, mask.shape[-1])
        )
    out = F.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    return out.reshape(B, H, T, D).transpose(1, 2).contiguous(), None


def use_packed_gqa(model) -> bool:
    """Switch an SDPA transformers model with grouped-query attention to packed_sdpa (registered once); -> whether
    it switched (other implementations and models without groups are left as they are)."""
    model = causal_lm(model)
    config = model.config
    heads = getattr(config, "num_attention_heads", 0)
    groups = heads // (getattr(config, "num_key_value_heads", None) or heads or 1)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME) or groups <= 1:
        return False
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_sdpa)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
