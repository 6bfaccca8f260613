"""Block-parallel drafters -> the folders engines load: DFlash (SGLang / z-lab, vLLM speculators) and P-EAGLE
(vLLM speculators).

Facts from the engines' loaders (sglang srt/models/dflash.py + speculative/dflash_utils.py, z-lab dflash model.py,
vllm qwen3_dflash.py, speculators models/dflash + models/peagle, Nov 2026):
- SGLang / z-lab `DFlashDraftModel`: Qwen3 decoder layers (q_norm/k_norm) + fc + hidden_norm + norm, NO lm_head and
  NO embed_tokens: logits come from the TARGET's lm_head over its full vocabulary. Config: Qwen3 fields
  (num_hidden_layers = draft layers), block_size, num_target_layers, dflash_config {target_layer_ids, mask_token_id,
  block_size}. target_layer_ids are layer OUTPUTS (z-lab extract_context_feature reads hidden_states[id + 1];
  SGLang checks 0 <= id < num_target_layers): draftsmith's layer-input id i is written as i - 1.
  fc takes len(ids) * hidden_size inputs: the draft's hidden size must equal the target's.
- speculators `DFlashSpeculator`: the same layers plus lm_head over a reduced draft vocabulary with d2t / t2d
  (embed_tokens excluded), transformer_layer_config (qwen3), draft_vocab_size, block_size, mask_token_id,
  aux_hidden_state_layer_ids. The ids are layer inputs, draftsmith's own: speculators' DFlash converter writes z-lab
  id + 1, and vLLM's speculators config reader (update_dflash) passes them as-is to the capture loop and as id - 1
  to dflash_config.target_layer_ids. speculators sizes fc as n_aux * the draft hidden size (so it must equal the
  target's, as for SGLang). With a full draft vocabulary speculators keeps no d2t / t2d and vLLM has no parameter
  for them (its loader raises on a d2t there), so they are left out; speculators also replaces a full-vocabulary
  lm_head with the verifier's on load, so only a frozen (target) head can go out that way.
- speculators `PEagleSpeculator`: the EAGLE-3 speculators folder + speculators_model_type "peagle", mask_token_id
  (vLLM's pard_token) and the learned `mask_hidden` [1, 1, 3 H_t]; d2t / t2d left out for a full vocabulary, as above.
Checked by loading the exports with speculators 0.9.0's from_pretrained and comparing its DFlash forward with ours
(scripts/check_engine_loaders.sh); vLLM 0.33.0 and SGLang 0.5.23 were read, not run (they need CUDA).
"""

from __future__ import annotations

import torch

from draftsmith.checkpoint import (
    Checkpoint,
    TensorInfo,
    check_tensor_set,
    head_dims,
    head_export,
    int_field,
    llama_layer_tensors,
    target_field,
)
from draftsmith.errors import DraftsmithError
from draftsmith.heads.eagle.export import (
    DTYPES,
    LLAMA_KEYS,
    check_speculators,
    check_vocab_map,
    eagle3_tensors,
    full_vocab,
    speculators_eagle3,
)
from draftsmith.kinds import ExportFormat
from draftsmith.verifier import EMBED, resolve_verifier, target_embeddings

QWEN3_KEYS = (*LLAMA_KEYS, "vocab_size", "num_hidden_layers")  # the decoder-layer fields, plus these


def dflash_tensors(cfg: dict, where: str) -> tuple[dict, dict]:
    """(required, optional) tensor name -> shape of a DFlash drafter: Qwen3-style layers (q/k norms) over
    [context K/V; block], fc over n fused target layers."""
    d = head_dims(cfg, where)
    ht = cfg.get("target_hidden_size") or d["H"]
    n_aux = len(cfg.get("aux_hidden_state_layer_ids") or [])
    vd, n_layers = int_field(cfg, "draft_vocab_size", where), int_field(cfg, "num_hidden_layers", where)
    int_field(cfg, "block_size", where, minimum=2)
    if n_aux < 1:
        raise DraftsmithError(f"{where}: config lists no aux_hidden_state_layer_ids; re-save the drafter")
    req = {"fc.weight": (d["H"], n_aux * ht), "hidden_norm.weight": (d["H"],), "norm.weight": (d["H"],)}
    for i in range(n_layers):
        req.update(llama_layer_tensors(f"layers.{i}.", d, 1, input_norm=True))
        req[f"layers.{i}.self_attn.q_norm.weight"] = req[f"layers.{i}.self_attn.k_norm.weight"] = (d["hd"],)
    req.update({"lm_head.weight": (vd, d["H"]), "d2t": (vd,), "t2d": (d["V"],)})
    return req, {}


def peagle_tensors(cfg: dict, where: str) -> tuple[dict, dict]:
    """P-EAGLE = EAGLE-3 + the learned placeholder features mask_hidden [1, 1, 3 H_t]."""
    req, opt = eagle3_tensors(cfg, where)
    req["mask_hidden"] = (1, 1, req["fc.weight"][1])
    return req, opt


def check_dflash(cfg: dict, where: str) -> list[int]:
    """The aux ids of a DFlash config, checked for the engines' capture loops (every DFlash format)."""
    n = target_field(cfg, "num_hidden_layers", where)
    ids = cfg.get("aux_hidden_state_layer_ids")
    if cfg.get("aux_layer_convention") != "layer_input":
        raise DraftsmithError(
            f"{where}: aux_layer_convention must be 'layer_input'; re-save the drafter with draftsmith"
        )
    if not isinstance(ids, list) or not ids or ids != sorted(set(ids)) or ids[0] < 1 or ids[-1] > n - 1:
        raise DraftsmithError(
            f"{where}: aux_hidden_state_layer_ids {ids} must be increasing and within [1, {n - 1}] (engines capture "
            "the outputs of target layers 0..N-2); retrain with other layers"
        )
    return ids


def check_sglang_dflash(cfg: dict, where: str) -> None:
    """SGLang's DFlash folder: the target's full frozen head (no lm_head) and the target's width."""
    check_dflash(cfg, where)
    if not cfg.get("frozen_lm_head") or cfg.get("draft_vocab_size") != cfg.get("vocab_size"):
        raise DraftsmithError(
            f"{where}: SGLang's DFlash folder has no lm_head (it uses the target's full-vocabulary head) but this "
            f"drafter trains its own {cfg.get('draft_vocab_size')}-row head; export --format speculators-dflash, or "
            "train with head.draft_vocab_size: 0 (the target's frozen head)"
        )
    if cfg.get("hidden_size") != cfg.get("target_hidden_size"):
        raise DraftsmithError(
            f"{where}: SGLang sizes DFlash's fc as n_features * hidden_size, so the draft hidden size "
            f"{cfg.get('hidden_size')} must equal the target's {cfg.get('target_hidden_size')}; use speculators-dflash"
        )


def check_speculators_dflash(cfg: dict, where: str) -> None:
    """speculators' DFlashSpeculator: the target's width, and a full-vocabulary head only if it is the frozen one."""
    check_dflash(cfg, where)
    if cfg.get("hidden_size") != cfg.get("target_hidden_size"):
        raise DraftsmithError(
            f"{where}: speculators sizes DFlash's fc as n_aux * hidden_size, so the draft hidden size "
            f"{cfg.get('hidden_size')} must equal the target's {cfg.get('target_hidden_size')}; retrain at the "
            "target's width"
        )
    if cfg.get("draft_vocab_size") == cfg.get("vocab_size") and not cfg.get("frozen_lm_head"):
        raise DraftsmithError(
            f"{where}: speculators replaces a full-vocabulary DFlash lm_head with the target's on load, but this "
            "drafter trains its own; use a reduced draft vocabulary or head.draft_vocab_size: 0 (frozen)"
        )


def _dflash_common(ckpt: Checkpoint) -> tuple[dict, list[int], dict[str, torch.Tensor]]:
    where = f"dflash checkpoint {ckpt.path}"
    if ckpt.kind != "dflash":
        raise DraftsmithError(f"{ckpt.path} is a {ckpt.kind} checkpoint, not a DFlash drafter")
    cfg = ckpt.config
    ids = check_dflash(cfg, where)
    tensors = ckpt.load()
    check_vocab_map(tensors["d2t"], tensors["t2d"], where)
    layer = {k: cfg[k] for k in QWEN3_KEYS if cfg.get(k) is not None}
    layer.update(
        model_type="qwen3",
        rope_theta=cfg["rope_theta"],
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        attention_bias=False,
        tie_word_embeddings=False,
    )
    return layer, ids, tensors


def _check(tensors: dict[str, torch.Tensor], spec: dict, kind: str, where: str, drop=()) -> None:
    req, opt = (dflash_tensors if kind == "dflash" else peagle_tensors)(spec, where)
    for k in drop:
        req.pop(k, None)
    check_tensor_set({k: TensorInfo(tuple(v.shape), "") for k, v in tensors.items()}, req, opt, where)


def sglang_dflash(ckpt: Checkpoint, opts=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) for SGLang `--speculative-algorithm DFLASH --speculative-draft-model-path DIR`."""
    layer, ids, tensors = _dflash_common(ckpt)
    cfg = ckpt.config
    check_sglang_dflash(cfg, str(ckpt.path))
    block = int(cfg["block_size"])
    out = {k: v.contiguous() for k, v in tensors.items() if k not in ("lm_head.weight", "d2t", "t2d")}
    config = {
        "architectures": ["DFlashDraftModel"],
        **layer,
        "block_size": block,
        "num_target_layers": target_field(cfg, "num_hidden_layers", str(ckpt.path)),
        "dflash_config": {
            "target_layer_ids": [i - 1 for i in ids],  # layer inputs -> layer outputs (module docstring)
            "mask_token_id": int(cfg["mask_token_id"]),
            "block_size": block,
        },
        "torch_dtype": DTYPES.get(tensors["fc.weight"].dtype, "float32"),
    }
    _check(out, cfg, "dflash", f"sglang-dflash export of {ckpt.path}", drop=("lm_head.weight", "d2t", "t2d"))
    return config, out


def check_llamacpp_dflash(cfg: dict, where: str) -> None:
    """llama.cpp's DFlash drafter (src/models/dflash.cpp of the pinned build) sizes fc as n_target_layers x the
    draft's own width, so the draft must have the target's; any head goes (the target's frozen one, its own over the
    full vocabulary, or its own over a reduced one with d2t)."""
    check_dflash(cfg, where)
    if cfg.get("hidden_size") != cfg.get("target_hidden_size"):
        raise DraftsmithError(
            f"{where}: llama.cpp sizes DFlash's fc as n_target_layers * the draft hidden size, so the draft hidden "
            f"size {cfg.get('hidden_size')} must equal the target's {cfg.get('target_hidden_size')}; retrain at the "
            "target's width, or evaluate it with draftsmith eval"
        )


def llamacpp_dflash(ckpt: Checkpoint, opts=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) for llama.cpp's convert_hf_to_gguf.py (with --target-model-dir), which writes one
    GGUF of architecture `dflash` for `--spec-type draft-dflash`. The converter has two classes for it
    (conversion/qwen.py): `DFlashDraftModel` (z-lab's layout: no lm_head means the target's head, an lm_head over
    the full vocabulary is the draft's own) and `DSparkDraftModel`, its subclass, which alone writes a reduced
    vocabulary's `d2t` (draft row -> target id, as offsets, draftsmith's own convention) and a draft_vocab_size-row
    output head; llama.cpp's DFlash graph then scatters the draft's logits to the target vocabulary. A DSpark
    Markov head is optional there and absent here: without one the DSpark class writes a plain DFlash drafter,
    `sample_from_anchor` false (the anchor row predicts nothing: block_size - 1 draft tokens, which is all
    `draft-dflash` reads). Layer ids as for SGLang (layer outputs; the converter adds 1 back)."""
    layer, ids, tensors = _dflash_common(ckpt)
    cfg = ckpt.config
    check_llamacpp_dflash(cfg, str(ckpt.path))
    block = int(cfg["block_size"])
    reduced = not full_vocab(tensors)
    drop = (
        {"t2d"} if reduced else {"d2t", "t2d"} | ({"lm_head.weight"} if cfg.get("frozen_lm_head") else set())
    )
    out = {k: v.contiguous() for k, v in tensors.items() if k not in drop}
    config = {
        "architectures": ["DSparkDraftModel" if reduced else "DFlashDraftModel"],
        **layer,
        "block_size": block,
        "num_target_layers": target_field(cfg, "num_hidden_layers", str(ckpt.path)),
        "dflash_config": {
            "target_layer_ids": [i - 1 for i in ids],  # layer inputs -> layer outputs (module docstring)
            "mask_token_id": int(cfg["mask_token_id"]),
            "block_size": block,
        },
        "torch_dtype": DTYPES.get(tensors["fc.weight"].dtype, "float32"),
    }
    if reduced:
        config.update(draft_vocab_size=int(tensors["d2t"].numel()), sample_from_anchor=False)
    _check(out, cfg, "dflash", f"gguf export of {ckpt.path}", drop=drop)
    return config, out


def _verifier(ckpt: Checkpoint, override: str | None) -> dict:
    target = ckpt.config.get("target") or {}
    name, _ = resolve_verifier(ckpt, override)  # a Hub id or a folder vLLM can load, never a bare folder name
    return {"name_or_path": name, "architectures": list(target.get("architectures") or [])}


def speculators_dflash(ckpt: Checkpoint, opts=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) in vLLM's speculators DFlash layout (reduced vocabulary kept, d2t / t2d)."""
    layer, ids, tensors = _dflash_common(ckpt)
    cfg = ckpt.config
    check_speculators_dflash(cfg, str(ckpt.path))
    full = full_vocab(tensors)
    verifier = getattr(opts, "verifier", None)
    block = int(cfg["block_size"])
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": _verifier(ckpt, verifier),
        },
        "transformer_layer_config": {**layer, "architectures": ["Qwen3ForCausalLM"]},
        "draft_vocab_size": int(tensors["d2t"].numel()),
        "block_size": block,
        "target_hidden_size": int(cfg["target_hidden_size"]),
        "aux_hidden_state_layer_ids": ids,
        "mask_token_id": int(cfg["mask_token_id"]),
        "sample_from_anchor": False,  # the anchor row predicts nothing: block_size - 1 draft tokens
        "torch_dtype": DTYPES.get(tensors["fc.weight"].dtype, "float32"),
    }
    vocab_map = ("d2t", "t2d") if full else ()
    out = {k: v.contiguous() for k, v in tensors.items() if k not in vocab_map}
    _check(out, cfg, "dflash", f"speculators-dflash export of {ckpt.path}", drop=vocab_map)
    if EMBED not in out:
        # speculators' DFlash model (DraftVocabMixin) NaN-fills embed_tokens unless the folder carries it
        name, local = resolve_verifier(ckpt, verifier)
        emb = target_embeddings(ckpt, name, local, shape=(int(cfg["vocab_size"]), int(cfg["hidden_size"])))
        out[EMBED] = emb.to(tensors["fc.weight"].dtype).contiguous()
    return config, out


class _AsEagle3(Checkpoint):
    """A P-EAGLE checkpoint seen as its EAGLE-3 part (mask_hidden left out), for the shared EAGLE-3 mapping."""

    def load(self, names=None):
        return {k: v for k, v in super().load(names).items() if k != "mask_hidden"}


def speculators_peagle(ckpt: Checkpoint, opts=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) in vLLM's speculators P-EAGLE layout: EAGLE-3's + mask_hidden, mask_token_id."""
    if ckpt.kind != "peagle":
        raise DraftsmithError(f"{ckpt.path} is a {ckpt.kind} checkpoint, not a P-EAGLE head")
    depths = int(ckpt.config.get("num_depths", 0))
    base = _AsEagle3(ckpt.path, "eagle3", ckpt.config, ckpt.tensors)
    cfg, out = speculators_eagle3(base, speculative_tokens=depths, verifier=getattr(opts, "verifier", None))
    mask_hidden = ckpt.load(["mask_hidden"])["mask_hidden"]
    want = (1, 1, 3 * int(cfg["target_hidden_size"]))
    if tuple(mask_hidden.shape) != want:
        raise DraftsmithError(
            f"{ckpt.path}: mask_hidden has shape {list(mask_hidden.shape)}, expected {list(want)}"
        )
    out["mask_hidden"] = (
        mask_hidden.contiguous()
    )  # (speculators_eagle3 drops d2t / t2d for a full vocabulary)
    cfg.update(
        architectures=["PEagleSpeculator"],
        speculators_model_type="peagle",
        mask_token_id=int(ckpt.config["mask_token_id"]),
        num_depths=depths,
    )
    cfg["speculators_config"]["algorithm"] = "peagle"
    return cfg, out


def native(ckpt: Checkpoint, opts=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The draftsmith folder itself (config.json with draftsmith_head_type + model.safetensors), re-validated: what
    `draftsmith eval --drafter dflash:DIR | peagle:DIR` and load_head read."""
    tensors = ckpt.load()
    if ckpt.kind == "dflash":
        _dflash_common(ckpt)
    _check(tensors, ckpt.config, ckpt.kind, f"hf export of {ckpt.path}")
    return dict(ckpt.config), {k: v.contiguous() for k, v in tensors.items()}


SGLANG_DFLASH = ExportFormat("sglang-dflash", head_export(sglang_dflash), check=check_sglang_dflash)
SPECULATORS_DFLASH = ExportFormat(
    "speculators-dflash", head_export(speculators_dflash), check=check_speculators_dflash, names_verifier=True
)
NATIVE_DFLASH = ExportFormat("hf", head_export(native), check=check_dflash, library="transformers")
SPECULATORS_PEAGLE = ExportFormat(
    "speculators-peagle", head_export(speculators_peagle), check=check_speculators, names_verifier=True
)
NATIVE_PEAGLE = ExportFormat("hf", head_export(native), library="transformers")
