"""PEFT-style save/load for every head kind: `save_head(head, dir)`, `load_head(dir, target_model)`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import (
    check_target,
    config_from_dict,
    load_state_strict,
    read_head_dir,
    write_head_dir,
)
from draftsmith.heads.eagle.model import EagleHead, eagle_config_from_dict
from draftsmith.heads.medusa.model import MedusaConfig, MedusaHeads

Head = MedusaHeads | EagleHead
ACCURACY_FILE = (
    "head_accuracy.json"  # measured per-head/per-depth top-k accuracy (Medusa trees are built from it)
)
LORA_DIR = "target_lora"  # Medusa-2: the target's LoRA adapter (peft save_pretrained), beside the heads


def save_head(head: Head, out_dir: str | os.PathLike, extra_json: dict | None = None) -> Path:
    """Write config.json (head fields + target record) and model.safetensors in engine-native names."""
    state = dict(head.state_dict())
    return write_head_dir(out_dir, head.to_config_dict(), state, extra_json)


def load_head(
    path: str | os.PathLike,
    target_model,
    *,
    device=None,
    dtype: torch.dtype | None = None,
    check: bool = True,
) -> Head:
    """Load a head folder for `target_model` (refuses a target other than the one recorded in config.json)."""
    config, state = read_head_dir(path)
    if check:
        check_target(config.get("target", {}), target_model, f"head {path}")
    kind = config["draftsmith_head_type"]
    try:  # a config.json edited by hand (a wrong type, an impossible size) fails inside the constructors
        if kind == "medusa":
            head = MedusaHeads(config_from_dict(MedusaConfig, config, "medusa config"), config.get("target"))
        elif kind == "earlyexit":
            from draftsmith.heads.selfspec.earlyexit import EarlyExitAdapter, EarlyExitConfig

            head = EarlyExitAdapter(
                config_from_dict(EarlyExitConfig, config, "earlyexit config"), config.get("target")
            )
        elif kind == "dflash":
            from draftsmith.heads.block.dflash import DFlashDrafter, dflash_config_from_dict

            head = DFlashDrafter(dflash_config_from_dict(config), config.get("target"))
        elif kind == "peagle":
            from draftsmith.heads.block.peagle import peagle_from_config_dict

            head = peagle_from_config_dict(config)
        else:
            head = EagleHead(eagle_config_from_dict(config), config.get("target"))
    except (TypeError, ValueError) as e:
        raise DraftsmithError(
            f"head {path}: config.json does not describe a valid {kind} head ({e}); re-save the head"
        ) from None
    load_state_strict(head, state, f"head {path}")
    ref = target_model.get_output_embeddings().weight
    head.to(
        device=device or ref.device, dtype=dtype or ref.dtype
    )  # .to(dtype) leaves the int/bool d2t, t2d alone
    return head.eval().requires_grad_(False)


def read_accuracy(path: str | os.PathLike) -> dict | None:
    f = Path(path) / ACCURACY_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{f} is not valid JSON ({e}); re-run the head eval to rewrite it") from None


def merge_target_lora(target_model, head_dir: str | os.PathLike) -> bool:
    """Medusa-2: fold the LoRA adapter saved in `head_dir/target_lora` into `target_model`'s weights IN PLACE
    (W += B A * alpha / r, peft merge_and_unload), so the heads decode with the backbone they were trained with.
    Plain decoding of the same object then runs the merged model too: Medusa-2 speedups are measured against
    the fine-tuned target, whose greedy output is what speculative decoding reproduces. Returns False if the
    folder holds no adapter (Medusa-1)."""
    lora = Path(head_dir) / LORA_DIR
    if not (lora / "adapter_config.json").is_file():
        return False
    from peft import PeftModel

    if hasattr(target_model, "peft_config"):
        raise DraftsmithError(f"target already carries a peft adapter; load a plain target to merge {lora}")
    dtype = next(target_model.parameters()).dtype
    try:
        wrapped = PeftModel.from_pretrained(target_model, str(lora), is_trainable=False)
    except (ValueError, RuntimeError, KeyError) as e:
        raise DraftsmithError(
            f"{lora} does not fit this target ({e}); pass the target the head was trained for"
        ) from None
    merged = wrapped.merge_and_unload()  # the same module tree, LoRA layers replaced by merged Linear layers
    if merged is not target_model:
        raise DraftsmithError(f"merging {lora} did not update the target in place; unsupported peft version")
    target_model.to(dtype)
    return True
