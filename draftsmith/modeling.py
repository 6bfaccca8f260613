"""Finding the parts of a causal LM through whatever wraps it, and wrapping it in LoRA.

A model reaches library code bare (`LlamaForCausalLM`), inside peft (`PeftModel -> LoraModel -> ...ForCausalLM`),
or inside an engine wrapper (DDP / FSDP / `torch.compile` keep the model at `.module` / `._orig_mod`). Every
caller that needs the decoder stack, the output head or the bare causal LM goes through these helpers. Also the
embedding fingerprint that tells two same-shape targets apart (heads record it; exports check it).
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The bare *ForCausalLM inside engine wrappers (DDP/FSDP `.module`, compile `._orig_mod`) and peft."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


def base_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (`model.model` of a Llama/Qwen/Mistral-style *ForCausalLM): embed_tokens, layers, norm."""
    lm = causal_lm(model)
    decoder = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if decoder is None:
        decoder = getattr(lm, "model", None)
    if decoder is None or not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        raise DraftsmithError(
            f"{type(lm).__name__} has no decoder with `.layers` at .model; use a Llama/Qwen/Mistral-style "
            "*ForCausalLM model"
        )
    return decoder


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The output projection (lm_head) of the bare causal LM."""
    head = causal_lm(model).get_output_embeddings()
    if head is None:
        raise DraftsmithError(f"{type(causal_lm(model)).__name__} has no lm_head; use a *ForCausalLM model")
    return head


def last_rows(hidden: torch.Tensor, n: int) -> torch.Tensor:
    """hidden[:, -n:] of [B, T, H] as a dense copy, for the output head. Sliced, it is a strided 3-D tensor that
    torch's matmul cannot fold into one GEMM: it runs aten.bmm against the expanded head, which a CPU copies whole
    per call (~0.5 s for a 150k-row head in bf16; 22 ms -> 565 ms at batch 3, measured on the 1.5B's head)."""
    return hidden[:, -n:].clone()


def add_lora(model, r: int = 16, alpha: int = 32, dropout: float = 0.0, target_modules="all-linear"):
    """Wrap `model` in LoRA adapters (peft). "all-linear" covers every Linear except the output layer (lm_head)."""
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise DraftsmithError(f"LoRA rank r must be >= 1, got {r}")
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def cast_frozen(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store the parameters that do not train (a LoRA model's base) in `dtype`, in place; returns how many changed.
    Under bf16 autocast this saves casting every frozen fp32 weight again in each forward and backward (1.08x a
    LoRA step of Qwen2.5-Coder-0.5B on a 2-core CPU) and half their memory; the weights are those a bf16 decode
    runs. Upcast (`model.float()`) before merging adapters, so the merge adds the update in fp32."""
    n = 0
    for param in model.parameters():
        if not param.requires_grad and param.dtype != dtype and param.is_floating_point():
            param.data = param.data.to(dtype)
            n += 1
    return n


def embedding_fingerprint(emb: torch.Tensor) -> list[float]:
    """Cheap statistics of input embeddings [V, H]: tell two same-shape targets apart (seed, finetune)."""
    rows = emb.detach()[: min(16, emb.shape[0])].float()
    return [round(float(rows.mean()), 6), round(float(rows.norm()), 4), round(float(rows[:, 0].sum()), 5)]


def target_fingerprint(model) -> list[float]:
    """embedding_fingerprint of a causal LM's input embeddings: what heads, caches and captured states record of
    the target they were made with."""
    return embedding_fingerprint(base_decoder(model).embed_tokens.weight)


def fingerprints_match(recorded: list[float], have: list[float]) -> bool:
    return all(abs(a - b) <= 2e-2 * max(1.0, abs(a)) for a, b in zip(recorded, have))


def text_config(config):
    """The decoder's config (a multimodal config's text part; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def sliding_window(config) -> int | None:
    """The attention window of the model's sliding-window layers (Mistral, Gemma 2/3's local layers, Qwen2 with
    use_sliding_window), or None when every layer attends to the whole sequence."""
    cfg = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True):
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def rollback_cache(config, max_len: int | None = None):
    """A KV cache that rolls back by cropping: a DynamicCache, or a StaticCache of `max_len` rows. Every layer keeps
    every column, sliding-window layers included: transformers' sliding layers keep only the last window - 1
    columns and cannot be cropped back past them, so a rejected draft could not be rolled back; here the window is
    applied by the attention mask instead (the model's own mask, or window_masks where a caller passes its own)."""
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import StaticLayer

    if max_len is None:
        # lazily one full DynamicLayer per layer where the config would make sliding ones
        return DynamicCache() if sliding_window(config) else DynamicCache(config=config)
    cache = StaticCache(config=config, max_cache_len=max_len)
    if sliding_window(config):
        cache.layers = [StaticLayer(max_len) if layer.is_sliding else layer for layer in cache.layers]
    return cache


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch for generation (it continues from the last column) -> input_ids, attention_mask [B, W]."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, ids in enumerate(seqs):
        input_ids[r, width - len(ids) :] = torch.tensor(ids)
        attn[r, width - len(ids) :] = 1
    return input_ids, attn


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, kv_len: int | None = None) -> torch.Tensor:
    """bool [B, q, k] (True = attend) -> additive [B, 1, q, kv_len or k] (0 / finfo.min; static buffers: the
    columns past k stay masked). HF attention passes a 4D mask through as-is."""
    b, q, k = allowed.shape
    width = kv_len if kv_len is not None else k
    out = torch.full((b, q, width), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    out[:, :, :k].masked_fill_(allowed, 0.0)
    return out[:, None]


def window_masks(config, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, to_mask):
    """The attention_mask argument for a caller-made mask: `allowed` [B, q, k] bool (True = attend), the token
    positions of its queries q_pos [B, q] and keys k_pos [B, k], `to_mask` turning a bool mask into the model's
    mask. Without sliding-window layers: to_mask(allowed). With them, the sliding layers' mask also hides keys
    window or more positions behind the query (transformers' sliding_window_overlay: q - k < window), which the
    model does not add to a mask it is given: {layer type: mask} where the config lists layer types (Gemma 2/3's
    local and global layers), the windowed mask alone where every layer slides (Mistral, Phi-3, Mixtral)."""
    window = sliding_window(config)
    if window is None:
        return to_mask(allowed)
    near = (q_pos[:, :, None] - k_pos[:, None, :]) < window
    windowed = to_mask(allowed & near)
    if getattr(text_config(config), "layer_types", None) is None:
        return windowed
    return {"full_attention": to_mask(allowed), "sliding_attention": windowed}
