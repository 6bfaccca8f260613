"""Ways to initialise a draft model before distillation.

- `shrink`: keep a subset of the target's decoder layers (plus embeddings, final norm, lm_head). Starts close to
  the target, so alpha is high from step 0, and shares its tokenizer and vocabulary by construction.
- `fresh`: a new, smaller model of the target's architecture and vocabulary (optionally reusing its embeddings).
- `existing`: a pretrained small model of the same family (compatibility is checked by draftsmith.compat).
- `add_lora`: wrap any of these in LoRA adapters via peft, for parameter-efficient distillation.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.modeling import base_decoder

# config attributes that hold one entry per decoder layer and must follow the kept layers
_PER_LAYER_CONFIG_LISTS = ("layer_types", "no_rope_layers")


def select_layers(num_target_layers: int, n: int) -> list[int]:
    """n layer indices spread over [0, num_target_layers): the first, the last, evenly spaced between.

    n == 1 keeps layer 0 (the layer that reads the embeddings). Indices are distinct and increasing.
    """
    if not 1 <= n <= num_target_layers:
        raise DraftsmithError(
            f"cannot keep {n} of {num_target_layers} target layers; choose 1..{num_target_layers}"
        )
    if n == 1:
        return [0]
    step = (num_target_layers - 1) / (n - 1)  # >= 1, so rounding keeps the indices distinct
    return [int(round(i * step)) for i in range(n)]


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def shrink(target_model, layers: Sequence[int]):
    """A copy of the target keeping only decoder `layers` (in the given order) -> same class, num_hidden_layers=len.

    Embeddings, the chosen layers, the final norm and lm_head are copied (new tensors; tied embeddings stay tied
    when the target ties them). Per-layer config lists (layer_types, ...) follow the kept layers.
    """
    decoder = base_decoder(target_model)
    n_target = len(decoder.layers)
    layers = [int(i) for i in layers]
    if not layers:
        raise DraftsmithError("shrink needs at least one layer; e.g. layers=select_layers(n_target, 4)")
    if len(set(layers)) != len(layers) or any(not 0 <= i < n_target for i in layers):
        raise DraftsmithError(
            f"layers {layers} must be distinct indices in [0, {n_target}) of the target's layers"
        )

    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = len(layers)
    for name in _PER_LAYER_CONFIG_LISTS:
        values = getattr(config, name, None)
        if isinstance(values, (list, tuple)) and len(values) == n_target:
            setattr(config, name, [values[i] for i in layers])
    if isinstance(getattr(config, "max_window_layers", None), int):
        config.max_window_layers = min(config.max_window_layers, len(layers))

    # rename model.layers.{old}. -> model.layers.{new}.; everything outside the layer stack is kept as is
    prefix = f"{getattr(target_model, 'base_model_prefix', 'model')}.layers."
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.(.*)$")
    new_index = {old: new for new, old in enumerate(layers)}
    state = {}
    for key, value in target_model.state_dict().items():
        match = pattern.match(key)
        if match is None:
            state[key] = value
        elif int(match.group(1)) in new_index:
            state[f"{prefix}{new_index[int(match.group(1))]}.{match.group(2)}"] = value

    draft = type(target_model)(config).to(dtype=_model_dtype(target_model))
    # load_state_dict copies into the new parameters, so nothing is shared with the target
    missing, unexpected = draft.load_state_dict(state, strict=False)
    tied = set(getattr(draft, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise DraftsmithError(
            f"shrink could not map the target's weights onto a {type(draft).__name__} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); this architecture is not supported by shrink"
        )
    if hasattr(target_model, "generation_config") and target_model.generation_config is not None:
        draft.generation_config = copy.deepcopy(target_model.generation_config)
    device = next(target_model.parameters()).device
    return draft.to(device).train(target_model.training)


def fresh(
    target_config,
    *,
    hidden_size: int,
    num_layers: int,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    copy_from=None,
):
    """A randomly initialised model of the target's model_type and vocabulary.

    Defaults keep the target's proportions: intermediate_size = hidden_size x (target ratio) rounded to 64,
    num_heads keeps the target's head_dim, num_kv_heads keeps its query/kv grouping. `copy_from` (a model with
    the same vocab and hidden size, e.g. the target) donates its input embeddings and, if untied, its lm_head.
    """
    from transformers import AutoModelForCausalLM

    if hidden_size < 1 or num_layers < 1:
        raise DraftsmithError(
            f"fresh needs hidden_size >= 1 and num_layers >= 1, got {hidden_size}, {num_layers}"
        )
    config = copy.deepcopy(target_config)
    t_hidden, t_heads = config.hidden_size, config.num_attention_heads
    t_kv = getattr(config, "num_key_value_heads", None) or t_heads
    t_head_dim = getattr(config, "head_dim", None) or t_hidden // t_heads
    t_layers = config.num_hidden_layers

    if num_heads is None:
        num_heads = max(1, hidden_size // t_head_dim)
    if hidden_size % num_heads:
        raise DraftsmithError(
            f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; pick num_heads"
        )
    if num_kv_heads is None:
        num_kv_heads = max(1, num_heads // max(1, t_heads // t_kv))
        while num_heads % num_kv_heads:
            num_kv_heads -= 1
    if num_heads % num_kv_heads:
        raise DraftsmithError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
    if intermediate_size is None:
        ratio = getattr(config, "intermediate_size", 4 * t_hidden) / t_hidden
        intermediate_size = max(64, int(round(hidden_size * ratio / 64)) * 64)

    config.hidden_size = hidden_size
    config.num_hidden_layers = num_layers
    config.intermediate_size = intermediate_size
    config.num_attention_heads = num_heads
    config.num_key_value_heads = num_kv_heads
    if hasattr(config, "head_dim"):
        config.head_dim = hidden_size // num_heads
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == t_layers:
        config.layer_types = [layer_types[i % t_layers] for i in range(num_layers)]
    if isinstance(getattr(config, "max_window_layers", None), int):
        config.max_window_layers = min(config.max_window_layers, num_layers)

    model = AutoModelForCausalLM.from_config(config)
    if copy_from is not None:
        donor_in = copy_from.get_input_embeddings().weight
        if tuple(donor_in.shape) != (config.vocab_size, hidden_size):
            raise DraftsmithError(
                f"copy_from embeddings are {tuple(donor_in.shape)}, the draft needs ({config.vocab_size}, "
                f"{hidden_size}); copy only from a model with the same vocab and hidden size"
            )
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(donor_in)
            out, donor_out = model.get_output_embeddings(), copy_from.get_output_embeddings()
            if (
                out is not None
                and donor_out is not None
                and out.weight is not model.get_input_embeddings().weight
            ):
                out.weight.copy_(donor_out.weight)
    return model


def existing(spec: str, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None):
    """A pretrained small causal LM as the draft, loaded trainable (draftsmith.models.load_model(train=True))."""
    from draftsmith.models import load_model

    return load_model(spec, dtype=dtype, device=device, train=True)
