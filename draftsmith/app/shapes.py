"""Models of a real architecture and size with random weights, built directly on the device (no download).

The benchmarks (`costbench`, `trainbench`) time dense layers, whose cost does not depend on the weights' values,
so a random model of the published shape times like the real one. Shapes are copied from the models' config.json
(architecture fields only); `tiny-*` shapes keep the same structure at a size a CPU test runs in seconds.
"""

from __future__ import annotations

import torch

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ROPE_MAX = {"original_max_position_embeddings": 8192}

SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B(-Instruct)
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, **_LLAMA3_ROPE_MAX},
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # meta-llama/Llama-3.2-1B(-Instruct): the draft-LM shape for a Llama-3.1-8B target (same tokenizer)
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, **_LLAMA3_ROPE_MAX},
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct: the embedded target (`smollm2-135m`), where the acceptance profiles in
    # results/profiles/ were measured; its 4-layer draft is the quickstart's shrunken target
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # CPU-test sizes with the same structure (GQA, untied / tied heads, a vocabulary larger than the width)
    "tiny-target": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "tiny-draft": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}
SHAPES["smollm2-135m-4l"] = {**SHAPES["smollm2-135m"], "num_hidden_layers": 4}
DRAFT_FOR = {"llama-3.1-8b": "llama-3.2-1b", "smollm2-135m": "smollm2-135m-4l", "tiny-target": "tiny-draft"}
"""The draft-LM shape paired with each target shape (same vocabulary)."""


def random_causal_lm(shape: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """A LlamaForCausalLM of `shape` (a SHAPES key) with random weights, created on `device` in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):  # weights initialised where they live: no host copy of an 8B model
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
