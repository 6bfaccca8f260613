"""Head exports (sglang-eagle3, speculators, vllm-medusa): exact files/keys/shapes, bad input, and round trips, on a
tiny Llama and a tiny Qwen2 target.

The round trips read the exported folder back with plain safetensors + json, rebuild the head with the small
reference implementation below (written from the engines' source, not from draftsmith's modules), capture the
target's aux hidden states the way each engine does (before decoder layer idx, for idx in its capture set), and
must reproduce the logits of draftsmith's own head (draftsmith.heads) on the same inputs.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.app.export import export
from draftsmith.errors import DraftsmithError
from draftsmith.testing import ARCHS

N_LAYERS = 6
AUX = [1, 3, 4]  # draftsmith ids: inputs of target layers 1, 3, 4


@pytest.fixture(scope="module", params=ARCHS)
def target(request, tmp_path_factory):
    """A 6-layer tiny target of each architecture (Llama; Qwen2: q/k/v biases, tied embeddings, padded vocabulary):
    every export's key validation and round trip runs on both."""
    from transformers import AutoModelForCausalLM

    from draftsmith.testing import save_tiny

    path = save_tiny(
        tmp_path_factory.mktemp("t") / "target6", seed=0, arch=request.param, num_hidden_layers=N_LAYERS
    )
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):  # norms away from 1 so a swapped norm changes the logits
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _eagle3_head(target, out, norm_before_residual=False, full_vocab=False):
    from draftsmith.heads.eagle.model import EagleHead
    from draftsmith.heads.io import save_head

    vocab_ids = torch.sort(
        torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(3))[:40]
    ).values
    if full_vocab:
        vocab_ids = torch.arange(target.config.vocab_size)
    head = EagleHead.from_target(
        target, "eagle3", draft_vocab_ids=vocab_ids, aux_layers=AUX, norm_before_residual=norm_before_residual
    )
    _randomize(head, 5)
    save_head(head, out)
    return head


def _medusa_head(target, out, num_layers=2):
    from draftsmith.heads.io import save_head
    from draftsmith.heads.medusa.model import MedusaHeads

    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=num_layers)
    _randomize(heads, 7)
    save_head(heads, out)
    return heads


# ---- independent reader + reference math --------------------------------------------------------------------


def read_export(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return json.loads((folder / "config.json").read_text()), tensors


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):  # x [T, n, D], neox style (rotate half), as SGLang/vLLM default for llama
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def eagle3_reference(cfg, t, embeds, aux, prefix, norm_before_residual):
    """One EAGLE-3 draft step over T positions (causal) -> target-vocab logits [T, V] (-inf off the draft vocab)."""
    eps, nh, nkv, hd = (
        cfg["rms_norm_eps"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    theta = cfg["rope_theta"]
    g = aux @ t["fc.weight"].T
    hn = rms(g, t[prefix + "hidden_norm.weight"], eps)
    residual = hn if norm_before_residual else g
    x = torch.cat([rms(embeds, t[prefix + "input_layernorm.weight"], eps), hn], -1)
    T = x.shape[0]
    pos = torch.arange(T).float()
    q = rope((x @ t[prefix + "self_attn.q_proj.weight"].T).view(T, nh, hd), pos, theta)
    k = rope((x @ t[prefix + "self_attn.k_proj.weight"].T).view(T, nkv, hd), pos, theta)
    v = (x @ t[prefix + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, nh * hd)
    x = residual + att @ t[prefix + "self_attn.o_proj.weight"].T
    y = rms(x, t[prefix + "post_attention_layernorm.weight"], eps)
    y = (F.silu(y @ t[prefix + "mlp.gate_proj.weight"].T) * (y @ t[prefix + "mlp.up_proj.weight"].T)) @ t[
        prefix + "mlp.down_proj.weight"
    ].T
    logits_d = rms(x + y, t["norm.weight"], eps) @ t["lm_head.weight"].T
    ids = torch.arange(t["d2t"].numel()) + t["d2t"]  # engines: target id = i + d2t[i]
    out = torch.full((T, cfg["vocab_size"]), float("-inf"))
    out[:, ids] = logits_d
    return out


def engine_capture(target, input_ids, capture):
    """Residual stream entering each target layer idx in `capture` (the engines' `hidden_states + residual`
    appended before running layer idx), concatenated in layer order."""
    got, hooks = {}, []
    for idx in capture:
        hooks.append(
            target.model.layers[idx].register_forward_pre_hook(
                lambda m, args, kw, idx=idx: got.__setitem__(
                    idx, (args[0] if args else kw["hidden_states"])[0]
                ),
                with_kwargs=True,
            )
        )
    try:
        with torch.no_grad():
            target(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i] for i in sorted(capture)], -1)


def _native_logits(head, target, input_ids):
    """draftsmith's head on HF output_hidden_states at its aux ids -> target-vocab logits [T, V]."""
    with torch.no_grad():
        hs = target(input_ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in head.config.aux_hidden_state_layer_ids], -1)
        embeds = target.model.embed_tokens(input_ids)
        T = input_ids.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        out, _ = head.step(embeds, aux, torch.arange(T)[None], mask)
        logits_d = head.logits(out)[0]
    full = torch.full((T, target.config.vocab_size), float("-inf"))
    full[:, head.vocab_ids] = logits_d
    return full


# ---- EAGLE-3 -------------------------------------------------------------------------------------------------

SGLANG_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{n}.weight"
    for n in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "hidden_norm",
        "post_attention_layernorm",
    )
}


def test_sglang_eagle3_files_config_and_round_trip(target, tmp_path):
    head = _eagle3_head(target, tmp_path / "head")
    out = export(tmp_path / "head", "sglang-eagle3", tmp_path / "sg")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "draftsmith_export.json",
        "model.safetensors",
    ]
    cfg, t = read_export(out)
    assert set(t) == SGLANG_KEYS
    H, V = target.config.hidden_size, target.config.vocab_size
    assert t["fc.weight"].shape == (H, 3 * H) and t["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert (
        t["lm_head.weight"].shape == (40, H)
        and t["d2t"].dtype == torch.int64
        and t["t2d"].dtype == torch.bool
    )
    assert t["t2d"].shape == (V,) and int(t["t2d"].sum()) == 40
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == V and cfg["draft_vocab_size"] == 40
    assert cfg["target_hidden_size"] == H and cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] == target.config.max_position_embeddings
    # SGLang ids index layer outputs: captured before layer id + 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    manifest = json.loads((out / "draftsmith_export.json").read_text())
    assert manifest["format"] == "sglang-eagle3" and manifest["aux_hidden_state_layer_ids_draftsmith"] == AUX

    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8, 77]])
    capture = {i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}  # SGLang: val + 1
    aux = engine_capture(target, ids, capture)
    embeds = target.model.embed_tokens(ids)[0].detach()
    engine = eagle3_reference(
        cfg, t, embeds, aux, "midlayer.", norm_before_residual=False
    )  # SGLang: raw residual
    native = _native_logits(head, target, ids)
    assert torch.allclose(engine, native, atol=1e-4, rtol=1e-4)
    assert torch.equal(engine.argmax(-1), native.argmax(-1))
    # vLLM loads the same folder (arch LlamaForCausalLMEagle3 -> Eagle3LlamaForCausalLM): it reads the top-level
    # ids first and uses them as layer inputs, and norm_before_residual from the config (default False)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX and "eagle_aux_layer_semantics" not in cfg
    vllm_ids = (
        cfg.get("eagle_aux_hidden_state_layer_ids") or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    aux_v = engine_capture(target, ids, set(vllm_ids))
    engine_v = eagle3_reference(cfg, t, embeds, aux_v, "midlayer.", cfg.get("norm_before_residual", False))
    assert torch.allclose(engine_v, native, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_speculators_files_config_and_round_trip(target, tmp_path, norm_before_residual):
    head = _eagle3_head(target, tmp_path / "head", norm_before_residual)
    out = export(tmp_path / "head", "speculators", tmp_path / "spec", speculative_tokens=5)
    cfg, t = read_export(out)
    # speculators' own checkpoints carry the target's input embeddings; its loader leaves them NaN otherwise
    assert set(t) == {k.replace("midlayer.", "layers.0.") for k in SGLANG_KEYS} | {"embed_tokens.weight"}
    assert torch.equal(t["embed_tokens.weight"], target.model.embed_tokens.weight.detach())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    ]
    local_folder = str(Path(head.target["name_or_path"]).resolve())
    assert sc["verifier"]["name_or_path"] == local_folder
    assert sc["verifier"]["architectures"] == list(target.config.architectures)  # the target's own
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == target.config.vocab_size and layer["head_dim"] == head.config.head_dim
    assert cfg["norm_before_residual"] is norm_before_residual and cfg["draft_vocab_size"] == 40
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM ids index layer inputs, like ours

    ids = torch.tensor([[9, 2, 140, 33, 7, 61]])
    aux = engine_capture(target, ids, set(cfg["eagle_aux_hidden_state_layer_ids"]))  # vLLM: idx as-is
    embeds = target.model.embed_tokens(ids)[0].detach()
    flat = {**layer, "vocab_size": layer["vocab_size"]}
    engine = eagle3_reference(flat, t, embeds, aux, "layers.0.", cfg["norm_before_residual"])
    assert torch.allclose(engine, _native_logits(head, target, ids), atol=1e-4, rtol=1e-4)


def test_speculators_full_vocab_has_no_vocab_map(target, tmp_path):
    """With the whole target vocabulary as draft vocabulary speculators creates no d2t / t2d, and vLLM 0.33's
    Eagle3 load_weights renames d2t to a parameter that only exists for a reduced vocabulary (it raises)."""
    _eagle3_head(target, tmp_path / "head", full_vocab=True)
    cfg, t = read_export(export(tmp_path / "head", "speculators", tmp_path / "spec"))
    assert "d2t" not in t and "t2d" not in t
    assert cfg["draft_vocab_size"] == target.config.vocab_size == t["lm_head.weight"].shape[0]


def _sglang_param_for(name):
    """SGLang 0.5.23 LlamaForCausalLMEagle3.load_weights name mapping (srt/models/llama_eagle3.py)."""
    name = name.replace("midlayer", "layers.0")  # its legacy_name_map
    if "d2t" in name or "t2d" in name:
        return name
    for shard, fused in (
        (".q_proj", ".qkv_proj"),
        (".k_proj", ".qkv_proj"),
        (".v_proj", ".qkv_proj"),
        (".gate_proj", ".gate_up_proj"),
        (".up_proj", ".gate_up_proj"),
    ):
        if shard in name:
            name = name.replace(shard, fused)
            break
    return name if name == "lm_head.weight" else f"model.{name}"


def _vllm_param_for(name):
    """vLLM Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights (model_executor/models/llama_eagle3.py)."""
    if "t2d" in name:
        return name
    if "d2t" in name:
        return "draft_id_to_target_id"
    name = name.replace("midlayer.", "layers.0.")
    for shard, fused in (
        (".q_proj", ".qkv_proj"),
        (".k_proj", ".qkv_proj"),
        (".v_proj", ".qkv_proj"),
        (".gate_proj", ".gate_up_proj"),
        (".up_proj", ".gate_up_proj"),
    ):
        name = name.replace(shard, fused)
    return name if "lm_head" in name else f"model.{name}"


ENGINE_PARAMS = {  # parameters the engines' EAGLE-3 modules create (embed_tokens shared from the target)
    "sglang": {"model.fc.weight", "model.norm.weight", "lm_head.weight", "d2t", "t2d"}
    | {
        f"model.layers.0.{n}.weight"
        for n in (
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
        )
    },
    "vllm": {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id", "t2d"}
    | {
        f"model.layers.0.{n}.weight"
        for n in (
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
        )
    },
}


@pytest.mark.parametrize(
    "fmt,engine", [("sglang-eagle3", "sglang"), ("sglang-eagle3", "vllm"), ("speculators", "vllm")]
)
def test_engine_weight_loaders_cover_every_parameter(target, tmp_path, fmt, engine):
    _eagle3_head(target, tmp_path / "head")
    _, t = read_export(export(tmp_path / "head", fmt, tmp_path / "out"))
    mapped = {(_sglang_param_for if engine == "sglang" else _vllm_param_for)(k) for k in t}
    # vLLM loads embed_tokens when the folder has it (speculators does), else shares the target's
    want = ENGINE_PARAMS[engine] | ({"model.embed_tokens.weight"} if fmt == "speculators" else set())
    assert mapped == want  # nothing unknown (silently skipped), nothing left random


def test_eagle3_bad_inputs(target, tmp_path):
    _eagle3_head(target, tmp_path / "head")
    cfg_path = tmp_path / "head" / "config.json"
    base = json.loads(cfg_path.read_text())

    def broken(**changes):
        cfg_path.write_text(json.dumps({**base, **changes}))
        return tmp_path / "head"

    with pytest.raises(DraftsmithError, match="layer_input"):
        export(broken(aux_layer_convention="layer_output"), "sglang-eagle3", tmp_path / "o1")
    with pytest.raises(DraftsmithError, match="strictly increasing"):
        export(broken(aux_hidden_state_layer_ids=[3, 1, 4]), "speculators", tmp_path / "o2")
    with pytest.raises(DraftsmithError, match=r"\[1, 5\]"):
        export(broken(aux_hidden_state_layer_ids=[0, 2, 4]), "sglang-eagle3", tmp_path / "o3")
    with pytest.raises(DraftsmithError, match="norm_before_residual"):
        export(broken(norm_before_residual=True), "sglang-eagle3", tmp_path / "o4")
    with pytest.raises(DraftsmithError, match="max_position_embeddings"):
        export(broken(max_position_embeddings=None), "speculators", tmp_path / "o5")
    with pytest.raises(DraftsmithError, match="vllm-medusa|sglang-eagle3 or speculators"):
        export(broken(), "vllm-medusa", tmp_path / "o6")
    cfg_path.write_text(json.dumps(base))
    assert not any(p.name.startswith(("o", ".o")) for p in tmp_path.iterdir())  # nothing half-written


def _rewrite(folder, fn):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    save_file(fn(t), str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", r"missing \['midlayer.hidden_norm.weight'\]"),
        ("unexpected", r"unexpected \['midlayer.extra.weight'\]"),
        ("shape", "shape"),
        ("d2t", "d2t maps two draft ids"),
    ],
)
def test_eagle3_wrong_tensors_are_refused(target, tmp_path, case, match):
    _eagle3_head(target, tmp_path / "head")

    def edit(t):
        if case == "missing":
            del t["midlayer.hidden_norm.weight"]
        elif case == "unexpected":
            t["midlayer.extra.weight"] = torch.zeros(2)
        elif case == "shape":
            t["fc.weight"] = t["fc.weight"][:, :-1].contiguous()
        else:
            t["d2t"] = t["d2t"].clone()
            t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id
        return t

    _rewrite(tmp_path / "head", edit)
    with pytest.raises(DraftsmithError, match=match):
        export(tmp_path / "head", "sglang-eagle3", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- Medusa ---------------------------------------------------------------------------------------------------


def vllm_medusa_config(raw: dict) -> dict:
    """vLLM MedusaConfig.from_pretrained key renaming (transformers_utils/configs/medusa.py)."""
    cfg = dict(raw)
    for k in list(cfg):
        if "num" in k:
            if "heads" in k:
                cfg["num_heads"] = cfg.pop(k)
            elif "layers" in k:
                cfg["num_hidden_layers"] = cfg.pop(k)
    return cfg


def test_vllm_medusa_files_config_and_round_trip(target, tmp_path):
    heads = _medusa_head(target, tmp_path / "head", num_layers=2)
    out = export(tmp_path / "head", "vllm-medusa", tmp_path / "m")
    raw, t = read_export(out)
    cfg = vllm_medusa_config(raw)
    assert cfg == raw  # survives vLLM's key renaming unchanged
    assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"]) == (3, 2, True)
    H, V = target.config.hidden_size, target.config.vocab_size
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["truncated_vocab_size"]) == (H, V, V)
    assert set(t) == {
        f"blocks.{h}.layers.{j}.{w}" for h in range(3) for j in range(2) for w in ("weight", "bias")
    } | {f"lm_heads.{h}.weight" for h in range(3)}
    assert not torch.equal(t["blocks.0.layers.0.weight"], t["blocks.0.layers.1.weight"])  # distinct layers
    hidden = torch.randn(5, H)
    engine = []
    for h in range(cfg["num_heads"]):  # vLLM ResidualBlock: x = x + SiLU(layer(x)); then lm_heads[h]
        x = hidden
        for j in range(cfg["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, t[f"blocks.{h}.layers.{j}.weight"], t[f"blocks.{h}.layers.{j}.bias"]))
        engine.append(x @ t[f"lm_heads.{h}.weight"].T)
    with torch.no_grad():
        assert torch.allclose(torch.stack(engine), heads(hidden), atol=1e-5)


def test_medusa_bad_inputs(target, tmp_path):
    _medusa_head(target, tmp_path / "head")
    # a kind/format mismatch names what the folder is and the formats it does export to
    with pytest.raises(
        DraftsmithError,
        match=r"holds Medusa heads \(medusa\), which cannot be exported as sglang-eagle3; it exports to vllm-medusa",
    ):
        export(tmp_path / "head", "sglang-eagle3", tmp_path / "o")
    with pytest.raises(DraftsmithError, match="--format vllm-medusa"):
        export(tmp_path / "head", "hf", tmp_path / "o")
    with pytest.raises(DraftsmithError, match="not found"):
        export(tmp_path / "nope", "vllm-medusa", tmp_path / "o")
    _rewrite(tmp_path / "head", lambda t: {k: v for k, v in t.items() if k != "blocks.1.layers.0.bias"})
    with pytest.raises(DraftsmithError, match="missing"):
        export(tmp_path / "head", "vllm-medusa", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_out_folder_rules_and_cli(target, tmp_path, capsys):
    from draftsmith.app.cli import main

    _medusa_head(target, tmp_path / "head")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(DraftsmithError, match="--force"):
        export(tmp_path / "head", "vllm-medusa", tmp_path / "out")
    assert (
        main(
            [
                "export",
                str(tmp_path / "head"),
                "--format",
                "vllm-medusa",
                "--out",
                str(tmp_path / "out"),
                "--force",
            ]
        )
        == 0
    )
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").is_file()
    assert (
        main(["export", str(tmp_path / "out"), "--format", "vllm-medusa", "--out", str(tmp_path / "x")]) == 2
    )
    assert "already a 'vllm-medusa' export" in capsys.readouterr().err


# ---- what the engines' own loaders need beyond the tensor names ---------------------------------------------------


def _head_for_loaded_target(tmp_path, seed=0):
    """An EAGLE-3 head trained against a target loaded the way draftsmith loads one (models.load_model on a folder),
    so its config records the target as draftsmith does for a user's local folder."""
    from draftsmith import models
    from draftsmith.testing import save_tiny

    folder = save_tiny(tmp_path / "my-target", seed=seed, num_hidden_layers=N_LAYERS)
    loaded = models.load_model(str(folder), device="cpu")
    _eagle3_head(loaded, tmp_path / "head")
    return folder, loaded


def test_speculators_verifier_is_a_path_vllm_can_load(tmp_path, capsys):
    from draftsmith.app.cli import main

    folder, loaded = _head_for_loaded_target(tmp_path)
    cfg, t = read_export(export(tmp_path / "head", "speculators", tmp_path / "spec"))
    verifier = cfg["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str(folder.resolve()) and (Path(verifier) / "config.json").is_file()  # not "my-target"
    assert torch.equal(t["embed_tokens.weight"], loaded.model.embed_tokens.weight)
    # a Hub id given by the user is what a portable folder names; the embeddings still come from the local copy
    rc = main(
        ["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(tmp_path / "hub")]
        + ["--verifier", "someone/my-target"]
    )
    assert rc == 0 and "verifier: someone/my-target" in capsys.readouterr().out
    cfg, t = read_export(tmp_path / "hub")
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "someone/my-target"
    assert (
        json.loads((tmp_path / "hub" / "draftsmith_export.json").read_text())["verifier"]
        == "someone/my-target"
    )


def test_speculators_refuses_a_verifier_it_cannot_name_or_read(tmp_path, capsys):
    from draftsmith.app.cli import main
    from draftsmith.testing import save_tiny

    folder, _ = _head_for_loaded_target(tmp_path)
    moved = tmp_path / "elsewhere"
    folder.rename(moved)  # the head was copied to another machine: only the basename and a dead path remain
    rc = main(["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "'my-target'" in err and "--verifier" in err and not (tmp_path / "o").exists()
    # naming the folder fixes it; another model's folder is refused (its embeddings are not the target's)
    assert (
        main(
            ["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(tmp_path / "o")]
            + ["--verifier", str(moved)]
        )
        == 0
    )
    other = save_tiny(tmp_path / "other", seed=1, num_hidden_layers=N_LAYERS)
    rc = main(
        ["export", str(tmp_path / "head"), "--format", "speculators", "--out", str(tmp_path / "o2")]
        + ["--verifier", str(other)]
    )
    assert rc == 2 and "differ" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    rc = main(
        ["export", str(tmp_path / "head"), "--format", "vllm-medusa", "--out", str(tmp_path / "o3")]
        + ["--verifier", str(moved)]
    )
    assert rc == 2 and "speculators formats only" in capsys.readouterr().err


def test_vllm_medusa_export_says_which_vllm_serves_it(target, tmp_path, capsys):
    from draftsmith.app.cli import main

    _medusa_head(target, tmp_path / "head")
    assert (
        main(["export", str(tmp_path / "head"), "--format", "vllm-medusa", "--out", str(tmp_path / "m")]) == 0
    )
    printed = capsys.readouterr().out
    note = json.loads((tmp_path / "m" / "draftsmith_export.json").read_text())["serve_with"]
    assert "0.9.0" in note and "0.32" in note and "0.33.0" in note and note in printed


def test_push_refuses_a_speculators_export_naming_a_local_folder(tmp_path, capsys):
    from draftsmith.app.cli import main

    _head_for_loaded_target(tmp_path)
    export(tmp_path / "head", "speculators", tmp_path / "local")
    export(tmp_path / "head", "speculators", tmp_path / "hub", verifier="someone/my-target")
    args = ["--no-results", "--dry-run"]
    assert main(["push", str(tmp_path / "local"), "me/d", *args, str(tmp_path / "s1")]) == 2
    err = capsys.readouterr().err
    assert "--verifier HUB_ID" in err and not (tmp_path / "s1").exists()
    assert main(["push", str(tmp_path / "hub"), "me/d", *args, str(tmp_path / "s2")]) == 0
    assert "vllm serve me/d" in (tmp_path / "s2" / "README.md").read_text()
    assert "(https://huggingface.co/someone/my-target)" in (tmp_path / "s2" / "README.md").read_text()
