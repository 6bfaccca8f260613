"""PEFT-style save/load for every head kind: `save_head(head, dir)`, `load_head(dir, target_model)`. The module a
folder holds is built by its kind's record (`DrafterKind.load`, draftsmith.heads.kinds)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import check_target, load_state_strict, read_head_dir, write_head_dir

Head = torch.nn.Module
ACCURACY_FILE = (
    "head_accuracy.json"  # measured per-head/per-depth top-k accuracy (Medusa trees are built from it)
)


def save_head(head: Head, out_dir: str | os.PathLike, extra_json: dict | None = None) -> Path:
    """Write config.json (head fields + target record) and model.safetensors in engine-native names."""
    state = dict(head.state_dict())
    return write_head_dir(out_dir, head.to_config_dict(), state, extra_json)


def check_aux_layers(config: dict, target_config, path: str | os.PathLike) -> None:
    """Refuse a head whose hidden-state taps (config.json's aux_hidden_state_layer_ids) lie outside the target's
    layers: from the two configs alone, so it runs before any weights load (else an IndexError at the first
    prefill)."""
    n = int(target_config.num_hidden_layers)
    aux = config.get("aux_hidden_state_layer_ids") or []
    if not isinstance(aux, list) or not all(isinstance(i, int) and 0 <= i <= n for i in aux):
        raise DraftsmithError(
            f"head {path}: aux_hidden_state_layer_ids {aux} must be hidden_states indices in [0, {n}] (the target "
            f"has {n} layers); fix config.json or retrain the head for this target"
        )


def load_head(
    path: str | os.PathLike,
    target_model,
    *,
    device=None,
    dtype: torch.dtype | None = None,
    check: bool = True,
) -> Head:
    """Load a head folder for `target_model` (refuses a target other than the one recorded in config.json)."""
    from draftsmith.heads.kinds import head_kind

    config, state = read_head_dir(path)
    if check:
        check_target(config.get("target", {}), target_model, f"head {path}")
    kind = config["draftsmith_head_type"]
    check_aux_layers(config, target_model.config, path)
    try:  # a config.json edited by hand (a wrong type, an impossible size) fails inside the constructors
        head = head_kind(kind).load(config)
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
