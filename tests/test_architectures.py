"""Every drafter kind on every tiny architecture (draftsmith.testing.TINY_ARCHS: Llama, Qwen2, Qwen3, Qwen3-MoE,
Mistral with an 8-token sliding window, Gemma-2 with final logit soft-capping and local/global layers, Phi-3), through
the oracle helpers: greedy speculative == greedy plain == greedy by full recompute (no cache: the KV roll-back of
every drafter kind, sliding-window layers included), batches of ragged rows, the sampled joint law, one training
step + save + load + decode, every export format, and the one-line refusal where a kind cannot serve an
architecture. A new architecture is one entry in TINY_ARCHS; a new kind is one record in its family's table."""

from __future__ import annotations

import json
import re

import pytest
import torch

from draftsmith.app.drafters import DRAFTERS, build_proposer
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.drafters import DrafterContext
from draftsmith.decode.proposers import DraftModelProposer
from draftsmith.errors import DraftsmithError
from draftsmith.testing import (
    TINY_ARCHS,
    assert_batch_greedy_lossless,
    assert_greedy_lossless,
    chi2_pvalue,
    joint_tvd,
    oracle_prompts,
    recompute_greedy,
    sampled_joint_counts,
    save_tiny,
    tiny_arch,
    tiny_model,
    tiny_tokenizer,
)

ARCH_NAMES = tuple(TINY_ARCHS)
SPEC_KINDS = sorted(name for name, rec in DRAFTERS.items() if rec.build is not None)
TRAINED = sorted(name for name, rec in DRAFTERS.items() if rec.training is not None)
MATRIX = [(a, k) for a in ARCH_NAMES for k in SPEC_KINDS]


def refusal(kind: str, config) -> str | None:
    rec = DRAFTERS[kind]
    return rec.refuses(config) if rec.refuses is not None else None


@pytest.fixture(scope="module", params=ARCH_NAMES)
def arch_target(request):
    return request.param, tiny_model(request.param, seed=0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny matmuls: threading overhead dominates, worse on a shared CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _context(arch, target):
    return DrafterContext(target, tiny_tokenizer(tiny_arch(arch).tokenizer), torch.device("cpu"))


# -- the models are what they claim ------------------------------------------------------------------------------
def test_every_tiny_model_has_its_architectures_traits():
    qwen3 = tiny_model("qwen3").model.layers[0].self_attn
    assert qwen3.q_norm is not None and qwen3.k_norm is not None
    moe = tiny_model("qwen3_moe")
    assert moe.config.num_experts == 4 and type(moe.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    lens = [p.shape[1] for p in oracle_prompts(384)]
    assert tiny_model("mistral").config.sliding_window < min(lens)  # every oracle sequence slides
    gemma = tiny_model("gemma2")
    assert gemma.config.final_logit_softcapping and set(gemma.config.layer_types) == {
        "sliding_attention",
        "full_attention",
    }
    logits = gemma(oracle_prompts(384)[0]).logits
    assert float(logits.abs().max()) < gemma.config.final_logit_softcapping  # the cap bends them
    phi3 = tiny_model("phi3").model.layers[0]
    assert hasattr(phi3.self_attn, "qkv_proj") and hasattr(phi3.mlp, "gate_up_proj")
    assert {tiny_model(a).config.model_type for a in ARCH_NAMES} == {
        e.model_type for e in TINY_ARCHS.values()
    }


# -- greedy: speculative == plain == full recompute, batch 1 and a ragged batch -----------------------------------
@pytest.mark.parametrize("kind", SPEC_KINDS)
def test_every_kind_on_every_architecture_is_greedy_lossless(kind, arch_target, tmp_path):
    arch, target = arch_target
    why = refusal(kind, target.config)
    if why is not None:
        pytest.skip(f"refused: {why}")  # test_refusals checks the refusal itself
    proposer = build_proposer(DRAFTERS[kind].example(tmp_path, target), _context(arch, target), k=4)
    decoder = SpeculativeDecoder(target, eos_ids=set())
    results = assert_greedy_lossless(decoder, proposer, oracle_prompts(384)[1:], k=4)  # 14 and 23 tokens
    assert max(max(r.proposed) for r in results) >= 1  # it drafted
    out = assert_batch_greedy_lossless(decoder, proposer, oracle_prompts(384, 3), k=4)
    assert max(max(r.proposed, default=0) for r in out.rows) >= 1


def test_plain_decoding_equals_full_recompute_on_every_architecture(arch_target, tmp_path):
    """The decoder's plain decoding (its cache grown and cropped, sliding-window layers included, batch 1 and a
    left-padded batch) is greedy decoding by full forwards without a cache; with the matrix above (speculative ==
    plain), every kind's rolled-back cache gives what recomputing gives."""
    arch, target = arch_target
    decoder = SpeculativeDecoder(target, eos_ids=set())
    prompts = oracle_prompts(384)
    want = [recompute_greedy(target, ids, 24) for ids in prompts]
    assert [decoder.generate(ids, None, max_new_tokens=24).tokens for ids in prompts] == want, arch
    rows = decoder.generate_batch([p.reshape(-1) for p in prompts], None, max_new_tokens=24).rows
    assert [r.tokens for r in rows] == want, arch
    # the static cache (the compiled step's), rolled back after every tree an EAGLE head drafts
    static = SpeculativeDecoder(target, eos_ids=set(), static_cache=True)
    proposer = build_proposer(DRAFTERS["eagle"].example(tmp_path, target), _context(arch, target), k=4)
    spec = static.generate(prompts[2], proposer, k=4, max_new_tokens=24)
    assert spec.tokens == want[2] and max(spec.proposed) >= 1, arch


def test_refusals_are_one_line_naming_the_architecture_before_any_work(tmp_path):
    """A kind that cannot serve an architecture says so from its config alone: at build (before the drafter's
    folder is read) and at the heads recipe's start (before the target loads)."""
    from draftsmith.config import load_config
    from draftsmith.heads.recipe import HeadsConfig, check_against_target

    refused = [(a, k) for a, k in MATRIX if refusal(k, tiny_model(a).config)]
    assert {k for _, k in refused} == {"earlyexit", "layerskip"}
    assert {a for a, _ in refused} == {"mistral", "gemma2"}  # the sliding-window ones
    for arch, kind in refused:
        target = tiny_model(arch)
        with pytest.raises(DraftsmithError, match=f"{kind} cannot draft .*{target.config.model_type}") as e:
            build_proposer(f"{kind}:{tmp_path / 'not-read'}", _context(arch, target), k=2)
        assert "\n" not in str(e.value) and not (tmp_path / "not-read").exists()
    target_dir = save_tiny(tmp_path / "mistral", arch="mistral")
    cfg = load_config(HeadsConfig, None, [f"model.target={target_dir}", "head.kind=earlyexit"])
    with pytest.raises(DraftsmithError, match="earlyexit cannot draft .*mistral has sliding-window"):
        check_against_target(cfg)


# -- the sampled joint law, with a tree of siblings, alone and beside a padded row --------------------------------
# The verify rule is one code path for every architecture and kind; what an architecture changes under it is the
# target's law (Gemma's soft-capped logits, Qwen3's q/k norms, a mixture's routing, Phi-3's fused projections) and
# the masks of windowed layers (Mistral, Gemma's local layers). Llama's and Qwen2's laws are tested in
# test_decode_decoder.py and test_draft_siblings.py; the other five run here (~10 s each on 2 cores).
# arch -> (config overrides for a 4-token vocabulary, the config change that removes the trait, or None where no one
# setting does): a cap of 1 bends 4-token logits enough that 800 draws tell the capped law from the uncapped one
SAMPLED = {
    "gemma2": ({"final_logit_softcapping": 1.0}, {"final_logit_softcapping": None}),
    "mistral": ({}, {"sliding_window": None}),
    "qwen3": ({}, None),
    "qwen3_moe": ({}, None),
    "phi3": ({}, None),
}


@pytest.mark.parametrize("arch", SAMPLED)
def test_sampled_joint_law_on_every_architecture(arch):
    """Speculative sampling draws the target's own joint law: soft-capped logits, and windowed layers (the prompt is
    longer than the 8-token window) under the tree masks the decoder makes itself (a draft LM with siblings). The
    same draws are far from the law of the target without its trait, so a verify that lost it would fail."""
    from draftsmith.testing import exact_joint

    overrides, without = SAMPLED[arch]
    target = tiny_model(arch, 0, vocab_size=4, **overrides)
    draft = tiny_model(arch, 3, vocab_size=4, num_hidden_layers=1)
    dec = SpeculativeDecoder(target, eos_ids=set())
    prompt = torch.tensor([[1, 3, 0, 2, 2, 1, 0, 3, 1, 2]])
    counts, law = sampled_joint_counts(dec, DraftModelProposer(draft, 4, siblings=2), prompt, n=800)
    assert chi2_pvalue(counts, law) > 1e-3, (arch, joint_tvd(counts, law))
    if without is None:
        return
    kept = {key: getattr(target.config, key) for key in without}
    try:
        for key, value in without.items():
            setattr(target.config, key, value)
        other = exact_joint(target, prompt)
    finally:
        for key, value in kept.items():
            setattr(target.config, key, value)
    assert joint_tvd(law, other) > 0.05 and chi2_pvalue(counts, other) < 1e-6, arch


# -- one training step, save, load, decode, export: every trained kind on every architecture ----------------------
@pytest.fixture(scope="module")
def trained_target(arch_target, tmp_path_factory):
    """A 4-layer target folder of the architecture (room for three aux layers the engines capture) and a few of its
    own answers to train on."""
    from draftsmith.prompts import Prompt
    from draftsmith.selfdistill import generate_dataset

    arch, _ = arch_target
    root = tmp_path_factory.mktemp(f"train-{arch}")
    target_dir = save_tiny(root / "target", seed=0, arch=arch, num_hidden_layers=4)
    prompts = [
        Prompt(
            messages=[{"role": "user", "content": f"Tell me about number {i}."}], category="chat", id=str(i)
        )
        for i in range(4)
    ]
    data = generate_dataset(
        target_dir, prompts, root / "data", max_new_tokens=12, batch_size=4, progress=False
    )
    return arch, str(target_dir), str(data), root


@pytest.mark.parametrize("kind", TRAINED)
def test_every_trained_kind_on_every_architecture_trains_saves_loads_and_exports(kind, trained_target):
    from draftsmith.app.export import export
    from draftsmith.config import load_config
    from draftsmith.heads.kinds import head_kind
    from draftsmith.heads.recipe import HeadsConfig, run_heads
    from draftsmith.kinds import spec_for
    from draftsmith.models import load_config as model_config
    from draftsmith.models import load_model
    from draftsmith.trainer import make_accelerator

    arch, target_dir, data, root = trained_target
    out = root / kind
    overrides = [
        f"model.target={target_dir}", f"data.source={data}", "data.eval_size=1", f"head.kind={kind}",
        "head.num_heads=2", "train.batch_size=2", "train.max_steps=1", "loss.ttt_steps=2", "eval.depth=2",
        "data.max_length=96", "train.log_every=1", f"output_dir={out}",
        # heads every format of the kind exports: DFlash on the target's frozen head, the others a reduced vocabulary
        f"head.draft_vocab_size={0 if kind == 'dflash' else 128}",
    ]  # fmt: skip
    cfg = load_config(HeadsConfig, None, overrides)
    why = refusal(head_kind(kind).training.saves_as or kind, model_config(target_dir))
    if why is not None:
        with pytest.raises(DraftsmithError, match=re.escape(f"{kind} cannot draft for this target: {why}")):
            run_heads(cfg, make_accelerator(cfg.train), progress=False)
        assert not out.exists()  # refused before anything is written
        return
    assert run_heads(cfg, make_accelerator(cfg.train), progress=False)["step"] == 1
    final = out / "final"
    saved = head_kind(kind).training.saves_as or kind
    target = load_model(target_dir, device="cpu")
    spec = spec_for(DRAFTERS, saved)
    proposer = build_proposer(f"{spec}:{final}", _context(arch, target), k=2)
    assert_greedy_lossless(SpeculativeDecoder(target, eos_ids=set()), proposer, oracle_prompts(384, 1), k=2)
    for fmt in DRAFTERS[saved].format_names():
        folder = export(final, fmt, root / f"{kind}-{fmt}")
        assert (folder / "config.json").is_file() and any(folder.glob("*.safetensors")), (arch, kind, fmt)
        assert json.loads((folder / "config.json").read_text()), fmt


# -- draftsmith check: the support table of each architecture, from its config alone -------------------------------
def test_check_prints_the_support_table_of_every_architecture(tmp_path, capsys, monkeypatch):
    """Every kind, format and engine row for each tiny architecture, with the reason where not; no weight is read
    (the folder holds config.json and the tokenizer only)."""
    from draftsmith.app.check import format_support
    from draftsmith.app.cli import main

    tables = {}
    for arch in ARCH_NAMES:
        folder = save_tiny(tmp_path / arch, arch=arch, num_hidden_layers=4)
        for weights in folder.glob("*.safetensors"):
            weights.unlink()  # the table is the config's: it must not need them
        capsys.readouterr()
        assert main(["check", "--target", str(folder)]) == 0
        tables[arch] = out = capsys.readouterr().out
        assert out.startswith(f"target {folder}: {tiny_model(arch).config.model_type}, 4 layers"), out
        for kind in SPEC_KINDS:
            why = refusal(kind, tiny_model(arch).config)
            assert f"  {kind:<10} {'yes' if why is None else 'no: ' + why}\n" in out, (arch, kind)
        for kind, fmt, why in format_support(tiny_model(arch, num_hidden_layers=4).config):
            assert f"  {kind:<10} {fmt:<19} {'yes' if why is None else 'no: ' + why}\n" in out, (arch, fmt)
    assert "sliding window 8" in tables["mistral"] and "final logit soft-cap 3" in tables["gemma2"]
    sglang = "  SGLang     eagle3 / dflash          "
    llamacpp = "  llama.cpp  eagle3 / dflash          "
    for arch in ("llama", "qwen2", "qwen3", "qwen3_moe"):  # qwen2: the pinned build's patch
        assert f"{llamacpp}yes" in tables[arch] and f"{sglang}yes" in tables[arch], arch
        assert f"  eagle3     {'gguf':<19} yes" in tables[arch], arch
    for arch in ("gemma2", "phi3"):
        assert (
            f"  eagle3     {'gguf':<19} no: {arch}: its llama.cpp graph records no layer inputs"
            in tables[arch]
        )
    for arch in ("gemma2", "phi3"):
        assert f"{llamacpp}no: {arch}: its llama.cpp graph records no layer inputs" in tables[arch]
    assert f"{sglang}no: gemma2:" in tables["gemma2"]
    assert all("llama.cpp  draft LM (draft-simple)  yes" in t for t in tables.values())
    # --draft keeps its tokenizer check, and a target that is not there is one line, exit 2
    draft = save_tiny(tmp_path / "draft", seed=1, arch="qwen3", num_hidden_layers=1)
    capsys.readouterr()
    assert main(["check", "--target", str(tmp_path / "qwen3"), "--draft", str(draft)]) == 0
    assert capsys.readouterr().out == f"ok: {draft} is tokenizer-compatible with {tmp_path / 'qwen3'}\n"
    assert main(["check", "--target", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
