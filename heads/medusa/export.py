"""Medusa heads -> vLLM's `MedusaModel` folder (`speculative_config={"method": "medusa", "model": DIR}`).

vLLM (model_executor/models/medusa.py) builds `blocks[h].layers[l]` = Linear(H, H, bias=medusa_fc_bias) applied
as x + SiLU(layer(x)), and one `lm_heads[h]` [V, H] per head (unless `original_lm_head`), over the target's final
(normed) hidden state; it proposes the top-1 token of each head. Our native names are already these.

vLLM versions (checked in the released wheels' file lists): the V1 engine's Medusa proposer
(vllm/v1/spec_decode/medusa.py, `{"method": "medusa"}`) ships from 0.9.0 through 0.32.0 (Oct 2026), beside the
model (model_executor/models/medusa.py) and its config class; 0.33.0 (Nov 2026) removed all three, so this folder
serves with vLLM 0.9.0-0.32.x only (the export's draftsmith_export.json says so under "serve_with").

Traps, from vllm/transformers_utils/configs/medusa.py: `medusa_fc_bias` defaults to False (our blocks have biases,
which would be skipped silently), and `MedusaConfig.from_pretrained` renames *every* key containing "num" and
"heads" to num_heads and "num" and "layers" to num_hidden_layers, so the config may hold no other such key.
"""

from __future__ import annotations

import torch

from draftsmith.checkpoint import Checkpoint, TensorInfo, check_tensor_set, head_export, int_field
from draftsmith.errors import DraftsmithError
from draftsmith.kinds import ExportFormat

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _num_keys(cfg: dict) -> list[str]:
    return [k for k in cfg if "num" in k and ("heads" in k or "layers" in k)]


def medusa_tensors(cfg: dict, where: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) tensor name -> shape of a Medusa folder (vLLM's names)."""
    n_heads, h = int_field(cfg, "num_heads", where), int_field(cfg, "hidden_size", where)
    n_layers = int_field(cfg, "num_layers", where, minimum=0)
    v = int_field(cfg, "vocab_size", where)
    v_d = int(cfg.get("draft_vocab_size") or 0)
    req: dict[str, tuple[int, ...]] = {}
    if 0 < v_d < v:  # a reduced vocabulary: vLLM's truncated_vocab_size + token_map
        req["token_map"] = (v_d,)
        v = v_d
    for i in range(n_heads):
        for j in range(n_layers):
            req[f"blocks.{i}.layers.{j}.weight"] = (h, h)
            if cfg.get("medusa_fc_bias", True):
                req[f"blocks.{i}.layers.{j}.bias"] = (h,)
        req[f"lm_heads.{i}.weight"] = (v, h)
    return req, {}


def vllm_medusa(ckpt: Checkpoint, opts=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) for vLLM's Medusa loader."""
    if ckpt.kind != "medusa":
        raise DraftsmithError(f"{ckpt.path} is a {ckpt.kind} checkpoint, not Medusa heads")
    c = ckpt.config
    tensors = {k: v.contiguous() for k, v in ckpt.load().items()}
    bias = bool(c.get("medusa_fc_bias", True))
    cfg = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": c["hidden_size"],
        "vocab_size": c["vocab_size"],
        "num_heads": c["num_heads"],
        "num_hidden_layers": c["num_layers"],  # ResBlock layers per head
        "medusa_fc_bias": bias,
        # a reduced vocabulary ships its token_map (vLLM reads it when truncated_vocab_size < vocab_size)
        "truncated_vocab_size": c.get("draft_vocab_size") or c["vocab_size"],
        "torch_dtype": DTYPES.get(tensors["lm_heads.0.weight"].dtype, "float32"),
    }
    assert sorted(_num_keys(cfg)) == ["num_heads", "num_hidden_layers"], _num_keys(cfg)
    spec = {
        "num_heads": cfg["num_heads"],
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "medusa_fc_bias": bias,
        "draft_vocab_size": cfg["truncated_vocab_size"],
    }
    req, opt = medusa_tensors(spec, "vllm-medusa export")
    check_tensor_set(
        {k: TensorInfo(tuple(v.shape), "") for k, v in tensors.items()}, req, opt, "vllm-medusa export"
    )
    return cfg, tensors


VLLM_MEDUSA = ExportFormat(
    "vllm-medusa",
    head_export(vllm_medusa),
    # checked in the released wheels: vllm/v1/spec_decode/medusa.py first ships in 0.9.0 and is gone from 0.33.0
    serve_note='for vLLM 0.9.0 to 0.32.x: speculative_config={"method": "medusa", "model": DIR, '
    '"num_speculative_tokens": N} (top-1 chain per head); vLLM 0.33.0 and later have no Medusa at all',
    library="vllm",
)
