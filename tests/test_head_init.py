"""`head.init: target` (draftsmith.heads.targetinit): the draft layers start as the target's last layer(s), final norm
and deepest aux state, on both tiny architectures; the heads stay greedy-lossless; a bad value is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftsmith.app.drafters import build_proposer
from draftsmith.config import load_config
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.drafters import DrafterContext
from draftsmith.errors import DraftsmithError
from draftsmith.heads.io import save_head
from draftsmith.heads.recipe import HeadsConfig, build_head
from draftsmith.modeling import base_decoder, output_head
from draftsmith.testing import ARCHS, assert_greedy_lossless, oracle_prompts, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SPECS = {  # kind -> the spec of its saved folder
    "eagle3": "eagle:{},top_k=2,total_tokens=6",
    "peagle": "peagle:{},top_k=2,total_tokens=6",
    "dflash": "dflash:{},top_k=2,total_tokens=6",
    "earlyexit": "earlyexit:{}",
    "eagle": "eagle:{},top_k=2,total_tokens=6",
}


@pytest.fixture(scope="module", params=ARCHS)
def arch_target(request):
    return request.param, tiny_model(request.param, seed=0)


def _build(target, kind: str, init: str):
    cfg = load_config(
        HeadsConfig,
        None,
        [f"head.kind={kind}", f"head.init={init}", "head.draft_vocab_size=96", "head.aux_layers=[0,1,2]",
         "head.draft_layers=2", "head.exit_layer=1", "head.num_depths=3", "head.block_size=4"],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, 380, (40,), generator=g).tolist()} for _ in range(4)]
    torch.manual_seed(0)
    return build_head(cfg, target, examples)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.float(), b.float())


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_eagle3_layer_norm_and_fc_start_from_the_target(arch_target, kind):
    arch, target = arch_target
    last, h = base_decoder(target).layers[-1], target.config.hidden_size
    head = _build(target, kind, "target")
    mid = head.midlayer
    for p in ("q_proj", "k_proj", "v_proj"):  # 2H input: the target's weight in the hidden half
        assert _same(getattr(mid.self_attn, p).weight[:, h:], getattr(last.self_attn, p).weight), p
        assert not _same(getattr(mid.self_attn, p).weight[:, :h], getattr(last.self_attn, p).weight), p
    assert _same(mid.self_attn.o_proj.weight, last.self_attn.o_proj.weight)
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert _same(getattr(mid.mlp, p).weight, getattr(last.mlp, p).weight), p
    assert _same(mid.hidden_norm.weight, last.input_layernorm.weight)
    assert _same(mid.post_attention_layernorm.weight, last.post_attention_layernorm.weight)
    assert _same(mid.input_layernorm.weight, torch.ones(h))  # the embedding's norm: not a target weight
    assert _same(head.norm.weight, base_decoder(target).norm.weight)
    fc = head.fc.weight  # aux [0, 1, 2]: the identity on the deepest (2), zeros elsewhere
    assert _same(fc[:, 2 * h :], torch.eye(h)) and not fc[:, : 2 * h].any()
    assert _same(head.lm_head.weight, output_head(target).weight[head.vocab_ids])  # as with init=random
    rand = _build(target, kind, "random")
    assert not _same(rand.midlayer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert _same(rand.lm_head.weight, head.lm_head.weight)


def test_dflash_layers_are_the_targets_last_layers(arch_target):
    arch, target = arch_target
    layers = base_decoder(target).layers
    d = _build(target, "dflash", "target")
    assert len(d.layers) == len(layers) == 2
    for dst, src in zip(d.layers, layers):  # 2 draft layers <- the target's last 2, in order
        for name, p in dst.named_parameters():
            if name.startswith("self_attn.q_norm") or name.startswith("self_attn.k_norm"):
                continue  # Qwen3-style norms: the tiny Llama / Qwen2 targets have none
            assert _same(p, dict(src.named_parameters())[name]), name
    assert _same(d.hidden_norm.weight, layers[0].input_layernorm.weight)
    assert _same(d.norm.weight, base_decoder(target).norm.weight)


def test_earlyexit_adapter_is_the_targets_last_layer(arch_target):
    arch, target = arch_target
    last = base_decoder(target).layers[-1]
    ad = _build(target, "earlyexit", "target")
    assert _same(ad.self_attn.o_proj.weight, last.self_attn.o_proj.weight)  # no longer zero
    assert _same(ad.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert _same(ad.input_layernorm.weight, last.input_layernorm.weight)
    assert not _build(target, "earlyexit", "random").self_attn.o_proj.weight.any()  # the plain early exit


def test_qwen2_biases_are_named_as_not_copied():
    from draftsmith.heads.eagle.model import EagleHead
    from draftsmith.heads.targetinit import copy_target_layer

    target = tiny_model("qwen2", seed=0)
    head = EagleHead.from_target(target, "eagle", intermediate_size=None)
    skipped = copy_target_layer(head.layers[0], base_decoder(target).layers[-1])
    assert skipped == ["input_layernorm.weight", "self_attn.k_proj.bias", "self_attn.q_proj.bias",
                       "self_attn.v_proj.bias"]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_target_initialised_heads_are_greedy_lossless(arch_target, kind, tmp_path):
    arch, target = arch_target
    save_head(_build(target, kind, "target"), tmp_path / kind)
    spec = SPECS[kind].format(tmp_path / kind)
    proposer = build_proposer(spec, DrafterContext(target, tiny_tokenizer(arch), torch.device("cpu")), k=3)
    results = assert_greedy_lossless(
        SpeculativeDecoder(target, eos_ids=set()), proposer, oracle_prompts(384), k=3
    )
    assert max(max(r.proposed) for r in results) >= 1


def test_a_bad_init_is_refused_at_config_validation(tmp_path, capsys):
    with pytest.raises(DraftsmithError, match="head.init='warm' is not one of random, target"):
        load_config(HeadsConfig, None, ["head.init=warm"])
    with pytest.raises(DraftsmithError, match="does not apply to medusa"):
        load_config(HeadsConfig, None, ["head.kind=medusa2", "head.init=target"])
    from draftsmith.app.train import heads_main

    out = tmp_path / "run"
    recipe = ROOT / "recipes" / "heads-smollm2-135m-eagle3.yaml"
    assert heads_main(["--config", str(recipe), "head.init=warm", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "head.init" in err[0]
    assert not out.exists()


def test_reduced_vocabulary_medusa_heads(arch_target, tmp_path):
    """head.reduced_vocab: each head holds the target's lm_head rows of the kept ids and a token_map; it decodes
    greedy-lossless, trains on both label kinds, and its folder and vLLM export carry the truncated layout."""
    from draftsmith.checkpoint import read_checkpoint
    from draftsmith.heads.io import load_head
    from draftsmith.heads.kinds import HEAD_KINDS
    from draftsmith.heads.medusa.export import vllm_medusa

    arch, target = arch_target
    cfg = load_config(HeadsConfig, None, ["head.kind=medusa", "head.reduced_vocab=true", "head.draft_vocab_size=96",
                                          "head.num_heads=3"])  # fmt: skip
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, 380, (40,), generator=g).tolist()} for _ in range(4)]
    heads = build_head(cfg, target, examples)
    ids = heads.token_map
    assert ids.numel() == 96 and bool((ids[1:] > ids[:-1]).all())
    for lm in heads.lm_heads:
        assert _same(lm.weight, output_head(target).weight[ids])
    with torch.no_grad():
        for blk in heads.blocks:  # not the identity: the heads disagree with the target
            blk.layers[0].weight.normal_(0, 0.5)
    h = torch.randn(2, 12, target.config.hidden_size)
    tokens = torch.randint(3, 380, (2, 12))
    for head_w in (None, output_head(target).weight):
        loss, m = heads.loss(h, tokens, torch.ones_like(tokens), target_head=head_w)
        assert torch.isfinite(loss) and "head0/top1" in m
    save_head(heads, tmp_path / "m")
    again = load_head(tmp_path / "m", target)
    assert torch.equal(again.token_map, ids) and again.lm_heads[0].weight.shape[0] == 96
    cfg_out, tensors = vllm_medusa(read_checkpoint(tmp_path / "m", HEAD_KINDS))  # the folder check passes too
    assert cfg_out["truncated_vocab_size"] == 96 and torch.equal(tensors["token_map"], ids)
    ctx = DrafterContext(target, tiny_tokenizer(arch), torch.device("cpu"))
    proposer = build_proposer(f"medusa:{tmp_path / 'm'},chain=1", ctx, k=3)
    results = assert_greedy_lossless(
        SpeculativeDecoder(target, eos_ids=set()), proposer, oracle_prompts(384), k=3
    )
    assert max(max(r.proposed) for r in results) >= 1
    drafted = proposer.propose(3, None).tokens
    assert set(drafted.flatten().tolist()) <= set(ids.tolist())  # drafts are target ids of the kept rows
