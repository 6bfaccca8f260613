"""CUDA checks (marked gpu: skipped without CUDA; `pytest -m gpu` runs them, scripts/gpu_check.sh too).

- greedy speculative output == plain greedy output on CUDA in bf16 for EVERY drafter kind in the drafter table, on
  the drafter its record's `example` makes (a difference passes only at a bf16 near-tie of the target, checked with
  the same rule `draftsmith eval` uses);
- the compile path (StaticCache + torch.compile with CUDA graphs) gives the eager path's tokens, without
  recompiling per step or per prompt;
- speculative sampling on CUDA reproduces the target's joint distribution;
- one bf16 training step of every trainer (distill, and every head kind of the heads recipe).
One test runs on the CPU too: every drafter kind's record has an example, so a new kind cannot skip the GPU check.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.app.drafters import DRAFTERS, build_proposer
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.drafters import DrafterContext
from draftsmith.decode.evaluate import divergence
from draftsmith.sampling import SamplingParams
from draftsmith.testing import tiny_llama

gpu = pytest.mark.gpu
CUDA = torch.device("cuda")
BF16 = torch.bfloat16


# -- one drafter checkpoint per kind: its record's example (draftsmith.kinds DrafterKind.example) -------------------
def test_every_drafter_kind_has_a_gpu_case():
    missing = sorted(name for name, rec in DRAFTERS.items() if rec.build is not None and rec.example is None)
    assert not missing, f"drafter kinds without an example (the GPU case) in their record: {missing}"


def _spec(kind: str, root, target) -> str:
    return DRAFTERS[kind].example(root, target)


SPEC_KINDS = sorted(name for name, rec in DRAFTERS.items() if rec.build is not None)


# -- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_target():
    return tiny_llama(0).to(CUDA, BF16)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 380, (1, n), generator=g) for n in (9, 14, 23)]


def _lossless(target, prompt, plain: list[int], spec: list[int]) -> bool:
    """Identical, or the first difference is a bf16 near-tie of the target (draftsmith eval's rule)."""
    return spec == plain or divergence(target, prompt, plain, spec)["near_tie"]


def _check_lossless(dec, target, proposer, prompts, k=4, new=32) -> int:
    identical = 0
    for ids in prompts:
        plain = dec.generate(ids, None, max_new_tokens=new).tokens
        spec = dec.generate(ids, proposer, k=k, max_new_tokens=new)
        assert _lossless(target, ids, plain, spec.tokens), (proposer.name, ids.shape, plain, spec.tokens)
        assert spec.target_forwards == 1 + len(spec.accepted)
        identical += spec.tokens == plain
    return identical


# -- greedy losslessness per drafter kind ---------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("kind", SPEC_KINDS)
def test_greedy_speculative_equals_plain_bf16(kind, cuda_target, prompts, tmp_path, tiny_tokenizer):
    spec = _spec(kind, tmp_path, cuda_target)
    ctx = DrafterContext(cuda_target, tiny_tokenizer, CUDA, dtype=BF16)
    proposer = build_proposer(spec, ctx)
    dec = SpeculativeDecoder(cuda_target, eos_ids=set())
    identical = _check_lossless(dec, cuda_target, proposer, prompts)
    assert identical >= 1  # near-ties are rare: a run where every prompt "ties" is a bug, not rounding


# -- compile path -------------------------------------------------------------------------------------------------
@gpu
def test_compiled_cuda_graph_path_equals_eager(cuda_target, prompts, tmp_path, tiny_tokenizer):
    """StaticCache + torch.compile(mode=reduce-overhead: CUDA graphs) gives the eager tokens for plain decoding,
    a chain drafter and a tree drafter, over prompts of three lengths, within a bounded number of graphs."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ctx = DrafterContext(cuda_target, tiny_tokenizer, CUDA, dtype=BF16)
    chain = build_proposer(_spec("draft", tmp_path, cuda_target), ctx)
    tree = build_proposer(_spec("eagle3", tmp_path, cuda_target), ctx)
    eager = SpeculativeDecoder(cuda_target, eos_ids=set())
    compiled = SpeculativeDecoder(cuda_target, eos_ids=set(), compile=True)
    assert compiled.static
    for proposer in (None, chain, tree):
        for ids in prompts:
            want = eager.generate(ids, proposer, k=4, max_new_tokens=24).tokens
            got = compiled.generate(ids, proposer, k=4, max_new_tokens=24).tokens
            assert _lossless(cuda_target, ids, want, got), (getattr(proposer, "name", "plain"), want, got)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # plain steps, one dynamic-length chain graph, a few tree variants (CPU, aot_eager: 5); dynamo's recompile limit
    # is 8, past which it would fall back to eager silently
    assert 1 <= graphs < 8, f"{graphs} compiled graphs: the step recompiles per length or per prompt"


@gpu
def test_compiled_draft_step_equals_eager_on_cuda(cuda_target, prompts, tmp_path, tiny_tokenizer):
    """`draft:...,compile=1` on CUDA (the draft's step under CUDA graphs, static cache) decodes the plain tokens."""
    import torch._dynamo

    torch._dynamo.reset()
    ctx = DrafterContext(cuda_target, tiny_tokenizer, CUDA, dtype=BF16)
    chain = build_proposer(_spec("draft", tmp_path, cuda_target) + ",compile=1", ctx)
    assert chain.compiles
    dec = SpeculativeDecoder(cuda_target, eos_ids=set())
    for ids in prompts:
        want = dec.generate(ids, None, k=4, max_new_tokens=24).tokens
        got = dec.generate(ids, chain, k=4, max_new_tokens=24).tokens
        assert _lossless(cuda_target, ids, want, got), (want, got)
    torch._dynamo.reset()


# -- sampling -------------------------------------------------------------------------------------------------------
@gpu
def test_sampled_decoding_matches_target_distribution_cuda():
    """Temperature 1, 4-token vocabulary, a disagreeing draft, k=2: the joint law of the first three tokens equals
    the target's exact joint law (computed by full forwards on the same device and dtype)."""
    from draftsmith.decode.proposers import DraftModelProposer

    target = tiny_llama(0, vocab_size=4).to(CUDA, BF16)
    draft = tiny_llama(3, vocab_size=4, num_hidden_layers=1).to(CUDA, BF16)
    prompt = torch.tensor([[1, 3, 0, 2]])
    dec = SpeculativeDecoder(target, eos_ids=set())
    prop = DraftModelProposer(draft, 4)
    counts = torch.zeros(4, 4, 4)
    n = 3000
    for s in range(n):
        t = dec.generate(
            prompt, prop, k=2, params=SamplingParams(temperature=1.0), max_new_tokens=3, seed=s
        ).tokens
        counts[t[0], t[1], t[2]] += 1
    with torch.inference_mode():
        p = lambda ids: torch.softmax(target(ids.to(CUDA)).logits[0, -1].float(), -1).cpu()  # noqa: E731
        exact = torch.zeros(4, 4, 4)
        p1 = p(prompt)
        for a in range(4):
            pa = p(torch.cat([prompt, torch.tensor([[a]])], 1))
            for b in range(4):
                exact[a, b] = p1[a] * pa[b] * p(torch.cat([prompt, torch.tensor([[a, b]])], 1))
    tvd = 0.5 * float((counts / n - exact).abs().sum())
    assert tvd < 0.06, tvd


# -- one bf16 training step of every trainer -------------------------------------------------------------------------
def _head_kinds() -> list[str]:
    from draftsmith.heads.kinds import trained_kinds

    return trained_kinds()


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, tiny_dirs):
    from draftsmith.selfdistill import generate_dataset

    root = tmp_path_factory.mktemp("gpu-gen")
    f = root / "prompts.jsonl"
    f.write_text(
        "\n".join(json.dumps({"prompt": f"Tell me about the number {i} and the sea."}) for i in range(10))
    )
    return str(generate_dataset(tiny_dirs["target"], str(f), root / "gen", max_new_tokens=12, progress=False))


def _train_event(out):
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("event") == "train"][-1]


@gpu
def test_one_bf16_distill_step_on_cuda(tiny_dirs, gen_dir, tmp_path):
    from draftsmith.config import load_config
    from draftsmith.distill.recipe import DistillConfig, run_distill
    from draftsmith.trainer import make_accelerator

    out = tmp_path / "distill"
    cfg = load_config(
        DistillConfig,
        None,
        [
            f"model.target={tiny_dirs['target']}",
            "model.init=shrink",
            "model.num_layers=1",
            f"data.source={gen_dir}",
            "data.eval_size=2",
            "data.max_length=64",
            "train.max_steps=1",
            "train.batch_size=4",
            "train.log_every=1",
            "train.mixed_precision=bf16",
            f"output_dir={out}",
        ],
    )
    acc = make_accelerator(cfg.train)
    assert acc.device.type == "cuda" and acc.mixed_precision == "bf16"
    assert run_distill(cfg, acc, progress=False)["step"] == 1
    ev = _train_event(out)
    assert torch.isfinite(torch.tensor(ev["loss"])) and ev["loss"] > 0
    assert (out / "final" / "model.safetensors").is_file()


HEAD_EXTRA = {
    "dflash": ["head.block_size=4", "loss.anchors=4"],
    "peagle": ["head.num_depths=3"],
    "earlyexit": ["head.exit_layer=1"],
}  # the kind-specific recipe fields, at tiny sizes


@gpu
@pytest.mark.parametrize("kind", _head_kinds())
def test_one_bf16_heads_step_on_cuda(kind, tiny_dirs, gen_dir, tmp_path):
    from draftsmith.config import load_config
    from draftsmith.heads.recipe import HeadsConfig, run_heads
    from draftsmith.trainer import make_accelerator

    out = tmp_path / kind
    cfg = load_config(
        HeadsConfig,
        None,
        [
            f"model.target={tiny_dirs['target']}",
            f"data.source={gen_dir}",
            "data.eval_size=1",
            f"head.kind={kind}",
            "head.draft_vocab_size=128",
            "head.aux_layers=0,1,2",
            "head.num_heads=2",
            "train.batch_size=4",
            "train.max_steps=1",
            "train.log_every=1",
            "train.mixed_precision=bf16",
            "loss.ttt_steps=2",
            "eval.depth=2",
            "data.max_length=96",
            "data.hidden_states=online",
            f"output_dir={out}",
            *HEAD_EXTRA.get(kind, ()),
        ],
    )
    acc = make_accelerator(cfg.train)
    assert acc.device.type == "cuda" and acc.mixed_precision == "bf16"
    assert run_heads(cfg, acc, progress=False)["step"] == 1
    ev = _train_event(out)
    assert torch.isfinite(torch.tensor(ev["loss"])) and ev["loss"] > 0
    assert (out / "final" / "config.json").is_file()
