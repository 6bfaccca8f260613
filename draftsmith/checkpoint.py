"""Read a draftsmith checkpoint folder and check its tensors against the format it claims, before any export.

Kinds:
- "draft": a distilled draft, an ordinary HF causal-LM folder (+ optional draft_vocab.safetensors);
- "medusa" / "eagle" / "eagle3": a head folder, config.json with `draftsmith_head_type` + model.safetensors.

Serving engines load weights by name and silently skip names they do not know, leaving random weights in
their place, so every export first compares the exact tensor-name set and shapes with what the config implies.
Shapes are read from the safetensors header; no tensor is loaded for validation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError

HEAD_KINDS = ("medusa", "eagle", "eagle3", "earlyexit", "dflash", "peagle")
SELF_DRAFTERS = ("layerskip",)  # no weights of their own: config.json names the target layers they run
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
        if self.kind in HEAD_KINDS or self.kind in SELF_DRAFTERS:
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


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Identify and validate a native checkpoint folder (no tensors loaded)."""
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
    if cfg.get("draftsmith_drafter") in SELF_DRAFTERS:
        if not isinstance(cfg.get("skip_layers"), list) or not isinstance(cfg.get("target"), dict):
            raise DraftsmithError(f"{p}: a layerskip config.json needs skip_layers and target; re-run draftsmith layerskip")
        return Checkpoint(p, cfg["draftsmith_drafter"], cfg)
    head_type = cfg.get("draftsmith_head_type")
    if head_type is not None:
        if head_type not in HEAD_KINDS:
            raise DraftsmithError(
                f"{p}: unknown draftsmith_head_type {head_type!r}; expected one of {list(HEAD_KINDS)}"
            )
        weights = p / "model.safetensors"
        if not weights.is_file():
            raise DraftsmithError(f"{p} has no model.safetensors; heads are saved as one safetensors file")
        ckpt = Checkpoint(p, head_type, cfg, tensor_headers(weights))
        validate_head(ckpt)
        return ckpt
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


def _int(cfg: dict, key: str, where: str, minimum: int = 1) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise DraftsmithError(
            f"{where}: config field {key!r} must be an integer >= {minimum}, got {v!r}; re-save the head"
        )
    return v


def target_field(cfg: dict, key: str, where: str) -> int:
    return _int(cfg.get("target") or {}, key, f"{where} (target)")


def head_dims(cfg: dict, where: str) -> dict[str, int]:
    """Llama-layer sizes of an EAGLE/EAGLE-3 head config."""
    h = _int(cfg, "hidden_size", where)
    nh = _int(cfg, "num_attention_heads", where)
    d = {
        "H": h,
        "I": _int(cfg, "intermediate_size", where),
        "nh": nh,
        "nkv": _int(cfg, "num_key_value_heads", where) if "num_key_value_heads" in cfg else nh,
        "hd": _int(cfg, "head_dim", where) if cfg.get("head_dim") is not None else h // nh,
        "V": cfg.get("vocab_size") or target_field(cfg, "vocab_size", where),
    }
    return d


def _llama_layer(
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


def expected_head_tensors(
    kind: str, cfg: dict, where: str = "head", layer_prefix: str | None = None
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) tensor name -> shape implied by a head config (native names unless layer_prefix)."""
    if kind == "medusa":
        n_heads, h = _int(cfg, "num_heads", where), _int(cfg, "hidden_size", where)
        n_layers = _int(cfg, "num_layers", where, minimum=0)
        v = _int(cfg, "vocab_size", where)
        req: dict[str, tuple[int, ...]] = {}
        for i in range(n_heads):
            for j in range(n_layers):
                req[f"blocks.{i}.layers.{j}.weight"] = (h, h)
                if cfg.get("medusa_fc_bias", True):
                    req[f"blocks.{i}.layers.{j}.bias"] = (h,)
            req[f"lm_heads.{i}.weight"] = (v, h)
        return req, {}
    d = head_dims(cfg, where)
    if kind in ("eagle3", "peagle"):  # P-EAGLE = EAGLE-3 + the learned placeholder features mask_hidden
        ht = cfg.get("target_hidden_size") or (
            target_field(cfg, "hidden_size", where) if cfg.get("target") else d["H"]
        )
        vd = _int(cfg, "draft_vocab_size", where)
        req = {"fc.weight": (d["H"], 3 * ht)}
        req.update(_llama_layer(layer_prefix or "midlayer.", d, 2, input_norm=True))
        req[f"{layer_prefix or 'midlayer.'}hidden_norm.weight"] = (d["H"],)
        req.update({"norm.weight": (d["H"],), "lm_head.weight": (vd, d["H"]), "d2t": (vd,), "t2d": (d["V"],)})
        if kind == "peagle":
            req["mask_hidden"] = (1, 1, 3 * ht)
        return req, {"embed_tokens.weight": (d["V"], d["H"])}
    if kind == "dflash":  # Qwen3-style layers (q/k norms) over [context K/V; block]; fc over n fused target layers
        ht = cfg.get("target_hidden_size") or d["H"]
        n_aux = len(cfg.get("aux_hidden_state_layer_ids") or [])
        vd, n_layers = _int(cfg, "draft_vocab_size", where), _int(cfg, "num_hidden_layers", where)
        _int(cfg, "block_size", where, minimum=2)
        if n_aux < 1:
            raise DraftsmithError(f"{where}: config lists no aux_hidden_state_layer_ids; re-save the drafter")
        req = {"fc.weight": (d["H"], n_aux * ht), "hidden_norm.weight": (d["H"],), "norm.weight": (d["H"],)}
        for i in range(n_layers):
            req.update(_llama_layer(f"layers.{i}.", d, 1, input_norm=True))
            req[f"layers.{i}.self_attn.q_norm.weight"] = req[f"layers.{i}.self_attn.k_norm.weight"] = (d["hd"],)
        req.update({"lm_head.weight": (vd, d["H"]), "d2t": (vd,), "t2d": (d["V"],)})
        return req, {}
    if kind == "earlyexit":  # one Llama layer over the exit layer's states + final norm; head rows = target's
        req = _llama_layer(layer_prefix or "", d, 1, input_norm=True)
        req.update({"norm.weight": (d["H"],), "vocab_ids": (_int(cfg, "draft_vocab_size", where),)})
        return req, {}
    if kind == "eagle":
        req = {"fc.weight": (d["H"], 2 * d["H"]), "fc.bias": (d["H"],)}
        req.update(_llama_layer(layer_prefix or "layers.0.", d, 1, input_norm=False))
        return req, {"embed_tokens.weight": (d["V"], d["H"])}
    raise DraftsmithError(f"{where}: unknown head kind {kind!r}")


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


def validate_head(ckpt: Checkpoint) -> None:
    """Check a head checkpoint's tensor names, shapes and index dtypes against its config."""
    where = f"{ckpt.kind} checkpoint {ckpt.path}"
    req, opt = expected_head_tensors(ckpt.kind, ckpt.config, where)
    check_tensor_set(ckpt.tensors, req, opt, where)
    if ckpt.kind in ("eagle3", "dflash", "peagle"):
        for name, dtype in (("d2t", "I64"), ("t2d", "BOOL")):
            if ckpt.tensors[name].dtype != dtype:
                raise DraftsmithError(
                    f"{where}: {name} must be {dtype}, found {ckpt.tensors[name].dtype}; re-save the head"
                )
