"""Read a draftsmith checkpoint folder and check its tensors against the format it claims, before any export.

Folders:
- "draft": a distilled draft, an ordinary HF causal-LM folder (+ optional draft_vocab.safetensors);
- a head folder: config.json with `draftsmith_head_type` (its kind) + model.safetensors;
- a weightless self-drafter folder: config.json with `draftsmith_drafter` (layerskip).

Serving engines load weights by name and silently skip names they do not know, leaving random weights in
their place, so every export first compares the exact tensor-name set and shapes with what the config implies.
Shapes are read from the safetensors header; no tensor is loaded for validation. What a kind's folder must hold is
its record's `check_folder` (draftsmith.kinds): `read_checkpoint(path, kinds)` runs it; the layout helpers below are
what the families' checks are made of.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError

EXPORT_MANIFEST = "draftsmith_export.json"
DRAFT_META = "draftsmith_draft.json"


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: F32, BF16, I64, BOOL, ...


@dataclass
class Checkpoint:
    """A native checkpoint: its folder, kind, raw config.json and (for heads) tensor headers."""

    path: Path
    kind: str
    config: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def weights_file(self) -> Path:
        return self.path / "model.safetensors"

    @property
    def target(self) -> dict:
        """The target's description: head config "target" or draftsmith_draft.json "target" ({} if unknown)."""
        if self.kind != "draft":
            return dict(self.config.get("target") or {})
        meta = self.path / DRAFT_META
        if meta.is_file():
            try:
                return dict(json.loads(meta.read_text()).get("target") or {})
            except (json.JSONDecodeError, AttributeError):
                raise DraftsmithError(
                    f"{meta} is not valid JSON; re-save the draft with draftsmith"
                ) from None
        return {}

    def load(self, names: list[str] | None = None) -> dict:
        """Load tensors (all, or `names`) from model.safetensors -> {name: torch.Tensor}."""
        from safetensors import safe_open

        with safe_open(str(self.weights_file), framework="pt") as f:
            return {n: f.get_tensor(n) for n in (names if names is not None else list(f.keys()))}


def target_hub_id(target: dict) -> str | None:
    """The target's Hub id: recorded, or recovered for a draftsmith GGUF cache folder (DRAFTSMITH_SOURCE.txt names
    the .gguf; an embedded target's GGUF maps to its Hub id) so cards and engine configs get a portable name."""
    if target.get("hub_id"):
        return str(target["hub_id"])
    from draftsmith.models import EMBEDDED_TARGETS

    name = str(target.get("name_or_path") or target.get("name") or "")
    if name in EMBEDDED_TARGETS:
        return EMBEDDED_TARGETS[name].hub_id
    source = Path(name) / "DRAFTSMITH_SOURCE.txt" if name else None
    if source is not None and source.is_file():
        gguf_name = Path(source.read_text().strip()).name
        for model in EMBEDDED_TARGETS.values():
            if model.gguf_file == gguf_name:
                return model.hub_id
    return None


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise DraftsmithError(f"{path} not found; {what}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); {what}") from None
    if not isinstance(data, dict):
        raise DraftsmithError(f"{path} must hold a JSON object; {what}")
    return data


def tensor_headers(path: Path) -> dict[str, TensorInfo]:
    """Name -> (shape, dtype) from a safetensors header, without reading the tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = TensorInfo(tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype()))
            return out
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftsmithError(
            f"{path} is not a readable safetensors file ({e}); re-save the checkpoint"
        ) from None


def read_checkpoint(path: str | Path, kinds: Mapping[str, Any] | None = None) -> Checkpoint:
    """Identify a native checkpoint folder (no tensors loaded). With `kinds` (a table of draftsmith.kinds records:
    draftsmith.heads.kinds.HEAD_KINDS, draftsmith.app.drafters.DRAFTERS) an unknown kind is refused and the kind's
    `check_folder` validates the folder against its config."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise DraftsmithError(
            f"checkpoint {p} not found; pass the folder that holds config.json and model.safetensors"
        )
    if (p / EXPORT_MANIFEST).is_file():
        fmt = read_json(p / EXPORT_MANIFEST, "re-run draftsmith export").get("format")
        raise DraftsmithError(
            f"{p} is already a {fmt!r} export; export from the original draftsmith checkpoint"
        )
    cfg = read_json(p / "config.json", "pass a draftsmith checkpoint folder (final/ or checkpoints/step-N/)")
    ckpt = _identify(p, cfg)
    if kinds is not None:
        folders = {
            k: r for k, r in kinds.items() if r.load or r.check_folder or r.exports
        }  # kinds with folders
        rec = folders.get(ckpt.kind)
        if rec is None:
            known = sorted(folders)
            raise DraftsmithError(f"{p}: unknown draftsmith kind {ckpt.kind!r}; expected one of {known}")
        if rec.check_folder is not None:
            rec.check_folder(ckpt)
    return ckpt


def _identify(p: Path, cfg: dict) -> Checkpoint:
    if isinstance(
        cfg.get("draftsmith_drafter"), str
    ):  # no weights of its own: config.json names what it runs
        return Checkpoint(p, cfg["draftsmith_drafter"], cfg)
    head_type = cfg.get("draftsmith_head_type")
    if head_type is not None:
        weights = p / "model.safetensors"
        if not weights.is_file():
            raise DraftsmithError(f"{p} has no model.safetensors; heads are saved as one safetensors file")
        return Checkpoint(p, str(head_type), cfg, tensor_headers(weights))
    archs = cfg.get("architectures") or []
    if not any(str(a).endswith("ForCausalLM") for a in archs):
        raise DraftsmithError(
            f"{p}: config.json has neither draftsmith_head_type nor a *ForCausalLM architecture; "
            "pass a draftsmith head folder or a distilled draft folder"
        )
    if not ((p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()):
        raise DraftsmithError(
            f"{p} holds no model.safetensors; draftsmith only reads safetensors (re-save with save_pretrained)"
        )
    return Checkpoint(p, "draft", cfg)


def int_field(cfg: dict, key: str, where: str, minimum: int = 1) -> int:
    """cfg[key] as an integer >= minimum, or one DraftsmithError line."""
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise DraftsmithError(
            f"{where}: config field {key!r} must be an integer >= {minimum}, got {v!r}; re-save the head"
        )
    return v


def target_field(cfg: dict, key: str, where: str) -> int:
    return int_field(cfg.get("target") or {}, key, f"{where} (target)")


def head_dims(cfg: dict, where: str) -> dict[str, int]:
    """Llama-layer sizes of an EAGLE/EAGLE-3 head config."""
    h = int_field(cfg, "hidden_size", where)
    nh = int_field(cfg, "num_attention_heads", where)
    d = {
        "H": h,
        "I": int_field(cfg, "intermediate_size", where),
        "nh": nh,
        "nkv": int_field(cfg, "num_key_value_heads", where) if "num_key_value_heads" in cfg else nh,
        "hd": int_field(cfg, "head_dim", where) if cfg.get("head_dim") is not None else h // nh,
        "V": cfg.get("vocab_size") or target_field(cfg, "vocab_size", where),
    }
    return d


def llama_layer_tensors(
    prefix: str, d: dict[str, int], in_mult: int, input_norm: bool
) -> dict[str, tuple[int, ...]]:
    h, qkv_in = d["H"], in_mult * d["H"]
    names = {
        f"{prefix}self_attn.q_proj.weight": (d["nh"] * d["hd"], qkv_in),
        f"{prefix}self_attn.k_proj.weight": (d["nkv"] * d["hd"], qkv_in),
        f"{prefix}self_attn.v_proj.weight": (d["nkv"] * d["hd"], qkv_in),
        f"{prefix}self_attn.o_proj.weight": (h, d["nh"] * d["hd"]),
        f"{prefix}mlp.gate_proj.weight": (d["I"], h),
        f"{prefix}mlp.up_proj.weight": (d["I"], h),
        f"{prefix}mlp.down_proj.weight": (h, d["I"]),
        f"{prefix}post_attention_layernorm.weight": (h,),
    }
    if input_norm:  # EAGLE-1 drops the input norm of its single layer (as vLLM's EAGLE loader does)
        names[f"{prefix}input_layernorm.weight"] = (h,)
    return names


def check_tensor_set(
    actual: dict[str, TensorInfo],
    required: dict[str, tuple[int, ...]],
    optional: dict[str, tuple[int, ...]],
    where: str,
) -> None:
    """Raise naming the first problem unless names == required (+ any of optional) and every shape matches."""
    missing = sorted(set(required) - set(actual))
    unexpected = sorted(set(actual) - set(required) - set(optional))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''} ({len(missing)})")
        if unexpected:
            parts.append(
                f"unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''} ({len(unexpected)})"
            )
        raise DraftsmithError(
            f"{where}: tensor names do not match its config: {', '.join(parts)}; engines would silently run with "
            "random weights - re-save the checkpoint with draftsmith"
        )
    for name, info in actual.items():
        want = required.get(name, optional.get(name))
        if tuple(info.shape) != tuple(want):
            raise DraftsmithError(
                f"{where}: tensor {name} has shape {list(info.shape)} but its config implies {list(want)}; "
                "config.json and model.safetensors disagree - re-save the checkpoint"
            )


Layout = Callable[[dict, str], tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]]
"""config.json dict, where -> (required, optional) tensor name -> shape: a head kind's folder layout."""


def head_folder_check(layout: Layout) -> Callable[[Checkpoint], None]:
    """A record's `check_folder` for head folders: tensor names and shapes == what `layout` derives from the config,
    and index tensors (d2t, t2d) of the right dtype."""

    def check(ckpt: Checkpoint) -> None:
        where = f"{ckpt.kind} checkpoint {ckpt.path}"
        req, opt = layout(ckpt.config, where)
        check_tensor_set(ckpt.tensors, req, opt, where)
        for name, dtype in (("d2t", "I64"), ("t2d", "BOOL")):
            if name in ckpt.tensors and ckpt.tensors[name].dtype != dtype:
                raise DraftsmithError(
                    f"{where}: {name} must be {dtype}, found {ckpt.tensors[name].dtype}; re-save the head"
                )

    return check


def head_export(
    build: Callable[[Checkpoint, Any], tuple[dict, dict]],
) -> Callable[[Checkpoint, Path, Any], dict]:
    """An ExportFormat.write from `build(ckpt, ExportOptions) -> (config.json dict, tensors)`: writes config.json and
    model.safetensors into `out`; returns the manifest notes (architectures, the verifier named)."""

    def write(ckpt: Checkpoint, out: Path, opts: Any) -> dict:
        from safetensors.torch import save_file

        cfg, tensors = build(ckpt, opts)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=False) + "\n")
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        notes = {"config": cfg.get("architectures")}
        verifier = (cfg.get("speculators_config") or {}).get("verifier")
        if verifier:  # the target the engine will load: a Hub id, or a folder on this machine only
            notes["verifier"] = verifier["name_or_path"]
        return notes

    return write
