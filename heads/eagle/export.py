"""EAGLE-3 heads -> SGLang's `LlamaForCausalLMEagle3` folder and vLLM's *speculators* `Eagle3Speculator` folder.

Both engines run the same math as draftsmith's head: fc(cat(aux states)) -> one decoder layer whose attention
reads cat(input_layernorm(embed), hidden_norm(fc_out)) -> norm -> lm_head over the draft vocab, draft id i ->
target id i + d2t[i]. What differs is naming and, dangerously, the meaning of the aux-layer ids.

Aux-layer ids (checked in the released sources: sglang 0.5.23 and vllm 0.33.0 wheels, Nov 2026):
- draftsmith stores `aux_hidden_state_layer_ids` as *layer inputs*: id i = the residual stream entering decoder
  layer i = HF `output_hidden_states[i]` ("aux_layer_convention": "layer_input").
- vLLM (model_executor/models/llama.py `LlamaModel.forward`) appends `hidden_states + residual` *before* running
  layer idx when idx is in `aux_hidden_state_layers`; gpu_model_runner `_get_eagle3_aux_layers_from_config` takes
  the draft config's top-level `eagle_aux_hidden_state_layer_ids`, else `eagle_config`'s, as-is: vLLM ids are
  layer inputs, the same as ours. The speculators library trains from vLLM-captured states, same convention.
- SGLang (srt/models/llama.py `set_eagle3_layers_to_capture`) stores `val + 1` for each id of
  `eagle_config.eagle_aux_hidden_state_layer_ids` ("for the ith layer, it takes the output of the (i-1)th layer")
  and captures at the start of layer val+1: SGLang ids are layer *outputs*, so eagle_config gets i - 1.
  SGLang reads the top-level key only to count the aux states, so the SGLang folder also carries our ids
  top-level, where vLLM looks first: one folder then loads correctly in both engines.
- Both engines capture inside `for idx in range(num_layers)` with a `residual` that is None before layer 0, and
  concatenate in layer order: ids must be increasing and within [1, N-1].

Other silent traps handled here: SGLang ties lm_head to embed_tokens when `tie_word_embeddings` is true (we
write false); SGLang loads the target's lm_head when `draft_vocab_size` is missing (we always write it); vLLM's
speculators loader defaults `norm_before_residual` to True (we always write it); SGLang's Eagle-3 layer keeps the
un-normalised residual, so a head trained with norm_before_residual=true cannot be served by it; the speculators
library leaves `embed_tokens` unset (NaN) when a checkpoint lacks it and the verifier cannot be loaded, so the
speculators folder always carries the target's embeddings and names a verifier that resolves (exporters/verifier).
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
from draftsmith.kinds import ExportFormat
from draftsmith.verifier import EMBED, resolve_verifier, target_embeddings

LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
)
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def eagle3_tensors(cfg: dict, where: str, layer_prefix: str = "midlayer.") -> tuple[dict, dict]:
    """(required, optional) tensor name -> shape of an EAGLE-3 head (SGLang's names; speculators': layer_prefix
    `layers.0.`)."""
    d = head_dims(cfg, where)
    ht = cfg.get("target_hidden_size") or (
        target_field(cfg, "hidden_size", where) if cfg.get("target") else d["H"]
    )
    vd = int_field(cfg, "draft_vocab_size", where)
    req = {"fc.weight": (d["H"], 3 * ht)}
    req.update(llama_layer_tensors(layer_prefix, d, 2, input_norm=True))
    req[f"{layer_prefix}hidden_norm.weight"] = (d["H"],)
    req.update({"norm.weight": (d["H"],), "lm_head.weight": (vd, d["H"]), "d2t": (vd,), "t2d": (d["V"],)})
    return req, {"embed_tokens.weight": (d["V"], d["H"])}


def eagle1_tensors(cfg: dict, where: str) -> tuple[dict, dict]:
    """(required, optional) tensor name -> shape of an EAGLE-1 head (vLLM's names)."""
    d = head_dims(cfg, where)
    req = {"fc.weight": (d["H"], 2 * d["H"]), "fc.bias": (d["H"],)}
    req.update(llama_layer_tensors("layers.0.", d, 1, input_norm=False))
    return req, {"embed_tokens.weight": (d["V"], d["H"])}


def aux_layer_ids(cfg: dict, num_target_layers: int, where: str) -> list[int]:
    """The head's aux ids in draftsmith's layer-input convention, validated for the engines' capture loops."""
    ids = cfg.get("aux_hidden_state_layer_ids")
    conv = cfg.get("aux_layer_convention")
    if conv != "layer_input":
        raise DraftsmithError(
            f"{where}: aux_layer_convention is {conv!r}, expected 'layer_input'; re-save the head with draftsmith "
            "so the aux-layer ids can be converted to the engines' conventions"
        )
    if (
        not isinstance(ids, list)
        or len(ids) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise DraftsmithError(
            f"{where}: aux_hidden_state_layer_ids must be 3 integers, got {ids!r}; re-save the head"
        )
    if ids != sorted(set(ids)):
        raise DraftsmithError(
            f"{where}: aux_hidden_state_layer_ids {ids} must be strictly increasing (engines concatenate aux states "
            "in layer order); retrain with sorted ids"
        )
    if ids[0] < 1 or ids[-1] > num_target_layers - 1:
        raise DraftsmithError(
            f"{where}: aux_hidden_state_layer_ids {ids} must lie in [1, {num_target_layers - 1}] (inputs of target "
            "layers 1..N-1; engines cannot capture the embeddings or the final state); retrain with other layers"
        )
    return ids


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """d2t[i] = target_id - i must map draft rows to distinct target ids, and t2d must mark exactly those ids."""
    target_ids = d2t + torch.arange(d2t.numel(), dtype=d2t.dtype)
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= t2d.numel():
        raise DraftsmithError(
            f"{where}: d2t maps draft ids outside the target vocab [0, {t2d.numel()}); re-save the head"
        )
    if target_ids.unique().numel() != target_ids.numel():
        raise DraftsmithError(f"{where}: d2t maps two draft ids to one target id; rebuild the draft vocab")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[target_ids].all()):
        raise DraftsmithError(
            f"{where}: t2d does not mark exactly the target ids of d2t; rebuild the draft vocab"
        )


def llama_fields(cfg: dict, where: str) -> dict:
    """The decoder-layer fields both engines read, with rope written both ways (transformers 4 and 5 readers)."""
    if not cfg.get("max_position_embeddings"):
        raise DraftsmithError(
            f"{where}: config lacks max_position_embeddings; set it to the target's (a template 2048 collapses "
            "acceptance on long contexts)"
        )
    out = {k: cfg[k] for k in LLAMA_KEYS if cfg.get(k) is not None}
    out.setdefault("hidden_act", "silu")
    out.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    out.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    params = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise DraftsmithError(
            f"{where}: config has neither rope_theta nor rope_parameters; copy them from the target"
        )
    params.setdefault("rope_type", (cfg.get("rope_scaling") or {}).get("rope_type", "default"))
    params["rope_theta"] = theta
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    out.update(rope_theta=theta, rope_scaling=scaling, rope_parameters=params)
    out.update(
        model_type="llama",
        num_hidden_layers=1,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    return out


def _common(ckpt: Checkpoint) -> tuple[dict, list[int], dict[str, torch.Tensor]]:
    where = f"eagle3 checkpoint {ckpt.path}"
    if ckpt.kind != "eagle3":
        raise DraftsmithError(f"{ckpt.path} is a {ckpt.kind} checkpoint, not an EAGLE-3 head")
    ids = checked_aux_ids(ckpt.config, where)
    tensors = ckpt.load()
    check_vocab_map(tensors["d2t"], tensors["t2d"], where)
    return llama_fields(ckpt.config, where), ids, tensors


def _target_hidden(ckpt: Checkpoint) -> int:
    return int(
        ckpt.config.get("target_hidden_size") or target_field(ckpt.config, "hidden_size", str(ckpt.path))
    )


def _dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    return DTYPES.get(tensors["fc.weight"].dtype, "float32")


def _check_out(tensors: dict[str, torch.Tensor], fmt: str, cfg: dict, layer_prefix: str) -> None:
    # re-derive the expected names from the *written* sizes, independently of the mapping that produced them
    spec = {**cfg, "vocab_size": cfg["vocab_size"], "target": {"hidden_size": cfg["target_hidden_size"]}}
    req, opt = eagle3_tensors(spec, f"{fmt} export", layer_prefix)
    infos = {k: TensorInfo(tuple(v.shape), "") for k, v in tensors.items()}
    check_tensor_set(infos, req, opt, f"{fmt} export")


def checked_aux_ids(cfg: dict, where: str) -> list[int]:
    """The aux ids of a head config (draftsmith's layer-input convention), checked for the engines' capture loops."""
    return aux_layer_ids(cfg, target_field(cfg, "num_hidden_layers", where), where)


def check_sglang(cfg: dict, where: str) -> None:
    """What SGLang's LlamaForCausalLMEagle3 requires of a head config (export and training start-up)."""
    checked_aux_ids(cfg, where)
    if cfg.get("norm_before_residual"):
        raise DraftsmithError(
            f"{where}: norm_before_residual=true, but SGLang's LlamaForCausalLMEagle3 keeps the un-normalised "
            "residual; export --format speculators for vLLM instead"
        )


def check_speculators(cfg: dict, where: str) -> None:
    """What speculators' Eagle3Speculator requires of a head config (export and training start-up)."""
    checked_aux_ids(cfg, where)
    h, ht = cfg.get("hidden_size"), cfg.get("target_hidden_size") or target_field(cfg, "hidden_size", where)
    if h != ht:
        raise DraftsmithError(
            f"{where}: head hidden size {h} differs from the target's {ht}; speculators requires them equal "
            "(its loader refuses the verifier otherwise) - export --format sglang-eagle3 instead"
        )


def sglang_eagle3(ckpt: Checkpoint, opts=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) for SGLang `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR`."""
    fields, ids, tensors = _common(ckpt)
    check_sglang(ckpt.config, str(ckpt.path))
    h, ht = ckpt.config["hidden_size"], _target_hidden(ckpt)
    if h != ht and "embed_tokens.weight" not in tensors:
        raise DraftsmithError(
            f"{ckpt.path}: head hidden size {h} differs from the target's {ht} and the head has no embed_tokens; "
            "SGLang only shares the target's embeddings when the sizes match - save embed_tokens with the head"
        )
    sglang_ids = [i - 1 for i in ids]  # layer inputs -> SGLang layer outputs (see module docstring)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **fields,
        "vocab_size": int(tensors["t2d"].numel()),
        "draft_vocab_size": int(tensors["d2t"].numel()),
        "target_hidden_size": ht,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids,  # read first by vLLM (layer inputs); SGLang only counts them
        "norm_before_residual": False,
        "torch_dtype": _dtype_name(tensors),
        "dtype": _dtype_name(tensors),
    }
    out = {k: v.contiguous() for k, v in tensors.items()}
    _check_out(out, "sglang-eagle3", cfg, "midlayer.")
    return cfg, out


def speculators_eagle3(
    ckpt: Checkpoint, speculative_tokens: int = 3, verifier: str | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) in vLLM's speculators format (`vllm serve DIR` or speculative_config model=DIR).
    `verifier`: the target's Hub id or folder to name in the config (default: the one recorded with the head).
    The target's input embeddings are written as embed_tokens.weight [V, H] when the head has none (see verifier)."""
    if speculative_tokens < 1:
        raise DraftsmithError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    fields, ids, tensors = _common(ckpt)
    target = ckpt.config["target"]
    check_speculators(ckpt.config, str(ckpt.path))
    name, local = resolve_verifier(ckpt, verifier)
    if EMBED not in tensors:
        tensors[EMBED] = target_embeddings(ckpt, name, local).to(tensors["fc.weight"].dtype)
    layer_cfg = {**fields, "vocab_size": int(tensors["t2d"].numel()), "architectures": ["LlamaForCausalLM"]}
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name, "architectures": list(target.get("architectures") or [])},
        },
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": int(tensors["d2t"].numel()),
        "norm_before_residual": bool(ckpt.config.get("norm_before_residual", False)),
        "norm_before_fc": False,
        "target_hidden_size": _target_hidden(ckpt),
        "eagle_aux_hidden_state_layer_ids": ids,  # vLLM convention == draftsmith's layer inputs
        "torch_dtype": _dtype_name(tensors),
        "dtype": _dtype_name(tensors),
    }
    # speculators names the decoder layer `layers.0.` (vLLM also maps `midlayer.` there, but speculators does not)
    out = {
        (("layers.0." + k[len("midlayer.") :]) if k.startswith("midlayer.") else k): v.contiguous()
        for k, v in tensors.items()
    }
    flat = {
        **layer_cfg,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
    }
    _check_out(out, "speculators", flat, "layers.0.")  # embed_tokens.weight is checked as [V, H] here
    if full_vocab(
        out
    ):  # speculators keeps no d2t / t2d then, and vLLM's load_weights raises on a d2t it has no slot for
        del out["d2t"], out["t2d"]
    return cfg, out


def full_vocab(tensors: dict[str, torch.Tensor]) -> bool:
    """The draft vocabulary is the whole target vocabulary (d2t all zeros: draft id == target id)."""
    return tensors["d2t"].numel() == tensors["t2d"].numel()


SGLANG_EAGLE3 = ExportFormat(
    "sglang-eagle3",
    head_export(sglang_eagle3),
    check=check_sglang,
    aux_note="eagle_config.eagle_aux_hidden_state_layer_ids are SGLang layer-output ids (draftsmith id - 1; SGLang "
    "captures the input of layer id+1); the top-level eagle_aux_hidden_state_layer_ids are vLLM layer-input ids "
    "(= draftsmith's), which vLLM reads first",
    library="sglang",
)
SPECULATORS_EAGLE3 = ExportFormat(
    "speculators",
    head_export(lambda ckpt, opts: speculators_eagle3(ckpt, opts.speculative_tokens, opts.verifier)),
    check=check_speculators,
    aux_note="eagle_aux_hidden_state_layer_ids are vLLM layer-input ids (= draftsmith's, unchanged)",
    names_verifier=True,
    library="vllm",
)
