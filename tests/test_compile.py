"""The decoder's compile path (StaticCache + torch.compile of the target step) on the CPU, so it cannot rot between
GPU runs. The fast test compiles with the `aot_eager` backend: dynamo traces the step with the StaticCache (in-place
cache writes, tree masks, hidden-state outputs) and AOT autograd functionalises it, which is where a StaticCache
step breaks; only the code generation is skipped (inductor's C++ build of even a 2-layer model takes 1-3 minutes on
2 cores). The slow test runs inductor itself, once."""

import pytest
import torch

from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer
from draftsmith.testing import tiny_model

PROMPTS = [
    torch.tensor([[1, 40, 50, 60, 70, 80, 40, 50, 60, 90, 40, 50]]),
    torch.tensor([[5, 9, 33, 70, 2, 40, 9]]),
]


def _tree_proposer(target):
    from draftsmith.heads import EagleHead
    from draftsmith.heads.eagle.proposer import EagleProposer

    torch.manual_seed(0)
    head = EagleHead.from_target(
        target, "eagle3", draft_vocab_ids=torch.arange(0, 384, 2), aux_layers=[0, 1, 2]
    )
    return EagleProposer(head.eval(), target, top_k=3, depth=3, total_tokens=8)


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _compare(compiled, eager, proposers, new=12, prompts=PROMPTS):
    for prop in proposers:
        for ids in prompts:
            want = eager.generate(ids, prop, k=3, max_new_tokens=new).tokens
            assert compiled.generate(ids, prop, k=3, max_new_tokens=new).tokens == want, getattr(
                prop, "name", "plain"
            )


@pytest.mark.slow  # ~20 s of CPU: dynamo + AOT tracing of four step variants
def test_compiled_static_cache_step_equals_eager(tiny_target, tiny_draft):
    """Plain, chain (draft LM, n-gram) and tree (EAGLE-3) decoding through the compiled StaticCache step give the
    eager tokens, on two prompt lengths, with a bounded number of graphs: the prefill runs eagerly (no graph per
    prompt length) and verify blocks of different lengths share one dynamic graph instead of one graph each."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = SpeculativeDecoder(tiny_target, eos_ids=set())
    compiled = SpeculativeDecoder(tiny_target, eos_ids=set(), compile="aot_eager")
    assert compiled.static and compiled._forward_fn is not tiny_target
    _compare(compiled, eager, [None, DraftModelProposer(tiny_draft, 384), NGramProposer()])
    assert _graphs() == 2, _graphs()  # plain steps (n = 1), then one dynamic-length graph for every chain
    _compare(compiled, eager, [_tree_proposer(tiny_target)], prompts=PROMPTS[:1])
    # trees add a 4D mask and hidden-state outputs (HF's mask code specialises some lengths): a few, not one per step
    assert _graphs() <= 6, _graphs()
    torch._dynamo.reset()


def test_compile_backend_must_be_known(tiny_target):
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="compile"):
        SpeculativeDecoder(tiny_target, eos_ids=set(), compile="no-such-backend")


@pytest.mark.slow
def test_inductor_compiled_step_equals_eager_on_cpu(tiny_target, tiny_draft, monkeypatch):
    """The decoder's real --compile (inductor; CUDA graphs are skipped on CPU tensors) on a 1-layer target, and a
    draft's compiled step (inductor with freezing) against plain eager decoding."""
    import torch._dynamo

    from draftsmith.testing import tiny_llama

    target = tiny_llama(0, num_hidden_layers=1)
    torch._dynamo.reset()
    eager = SpeculativeDecoder(target, eos_ids=set())
    compiled = SpeculativeDecoder(target, eos_ids=set(), compile=True)
    _compare(compiled, eager, [None, DraftModelProposer(tiny_draft, 384)], new=12)
    # a compiled draft step too: on a CPU, inductor with freezing (weights folded into the graph). Its tokens are
    # lossless whatever it drafts, so its drafts are checked too: the same accepted counts as the eager draft's.
    # CACHE_ROOM 0: the short prompts share 256-row buffers, the 270-token one needs larger ones, the last one gets
    # new 256-row buffers (a graph that kept the buffers it was compiled with would draft from stale keys).
    monkeypatch.setattr(DraftModelProposer, "CACHE_ROOM", 0)
    compiled_draft, eager_draft = (
        DraftModelProposer(tiny_draft, 384, compile=True),
        DraftModelProposer(tiny_draft, 384),
    )
    long = torch.randint(1, 384, (1, 270), generator=torch.Generator().manual_seed(0))
    graphs = [_graphs()]
    for i, ids in enumerate([*PROMPTS, long, torch.tensor([[7, 3, 99, 12]])]):
        if i == 3:  # drop the buffers: the next prompt gets new ones of a length compiled before
            del compiled_draft.cache
        want = eager.generate(ids, eager_draft, k=3, max_new_tokens=16)
        got = eager.generate(ids, compiled_draft, k=3, max_new_tokens=16)
        assert got.tokens == want.tokens and got.accepted == want.accepted, (got.accepted, want.accepted)
        graphs.append(_graphs())
    # the first prompt compiled both step graphs (one column, several: dynamo specialises a length of 1), so the
    # second, on the same buffers, compiles nothing whatever it accepts
    assert graphs[1] - graphs[0] == 2 and graphs[2] == graphs[1], graphs
    assert compiled_draft.cache.kv_len == 256  # new buffers of the first prompts' length
    torch._dynamo.reset()


def test_compiled_draft_step_equals_eager_draft(tiny_target, tiny_draft, monkeypatch):
    """`draft:...,compile=1` (DraftModelProposer(compile=...)): the draft step traced as one graph over a static cache
    gives the eager draft's tokens — greedy (== plain greedy decoding) and sampled with the same seeds (so its q is the
    eager draft's, which the sampling oracles cover), with a reduced output vocabulary too, and across a sequence that
    outgrows the static buffers (CACHE_ROOM 0: refilled into larger ones several times in 300 tokens)."""
    import torch._dynamo

    from draftsmith.sampling import SamplingParams

    torch._dynamo.reset()
    monkeypatch.setattr(DraftModelProposer, "CACHE_ROOM", 0)
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    ids = PROMPTS[0]
    want = dec.generate(ids, None, k=3, max_new_tokens=300).tokens
    vocab = torch.arange(0, 384, 3)
    for v in (None, vocab):
        compiled = DraftModelProposer(tiny_draft, 384, v, compile="aot_eager")
        got = dec.generate(ids, compiled, k=3, max_new_tokens=300)
        assert got.tokens == want
        assert compiled.cache.kv_len > 256  # the sequence did outgrow the first buffers
        sampled = SamplingParams(temperature=1.0)
        eager_s = dec.generate(
            ids, DraftModelProposer(tiny_draft, 384, v), k=3, params=sampled, max_new_tokens=40
        )
        comp_s = dec.generate(ids, compiled, k=3, params=sampled, max_new_tokens=40)
        assert comp_s.tokens == eager_s.tokens and comp_s.accepted == eager_s.accepted
    torch._dynamo.reset()


def test_every_compiled_draft_builds_its_own_graphs(tiny_target, monkeypatch):
    """Under freezing (compile=1 on a CPU; traced here with aot_eager and freezing set as that path sets it) a draft's
    weights are graph constants, guarded by identity, so each compiled draft builds its own graphs. dynamo counts
    graphs against recompile_limit per code object: with one code object shared by every draft, the fifth draft of
    a process went past the limit (8) and drafted eagerly. And one draft whose buffers grow past the process's limit
    (here lowered to 2) keeps compiling its steps."""
    import torch._dynamo

    torch._dynamo.reset()
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    want = dec.generate(PROMPTS[0], None, max_new_tokens=10).tokens
    for i in range(5):
        prop = DraftModelProposer(tiny_model("llama", 0), 384, compile="aot_eager")
        prop._freezing = True
        before = _graphs()
        assert dec.generate(PROMPTS[0], prop, k=3, max_new_tokens=10).tokens == want
        assert _graphs() - before == 2, i  # one column and several: compiled, not eager
    torch._dynamo.reset()
    monkeypatch.setattr(DraftModelProposer, "CACHE_ROOM", 0)
    prop = DraftModelProposer(tiny_model("llama", 0), 384, compile="aot_eager")
    prop._freezing = True
    want = dec.generate(PROMPTS[0], None, max_new_tokens=300).tokens
    # config.patch, not monkeypatch: undoing a monkeypatch deletes the option, which hides it from dynamo for good
    with torch._dynamo.config.patch(recompile_limit=2):
        before = _graphs()
        assert dec.generate(PROMPTS[0], prop, k=3, max_new_tokens=300).tokens == want
    assert prop.cache.kv_len > 256 and _graphs() - before == 4  # two buffer lengths, two graphs each
    torch._dynamo.reset()


def test_compiled_draft_decodes_one_prompt_at_a_time(tiny_target, tiny_draft):
    from draftsmith.errors import DraftsmithError

    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    with pytest.raises(DraftsmithError, match="one prompt at a time; use batch size 1"):
        dec.generate_batch(
            PROMPTS, DraftModelProposer(tiny_draft, 384, compile="aot_eager"), k=2, max_new_tokens=4
        )


def test_a_compiled_draft_keeps_plain_linears(tiny_dirs, monkeypatch):
    """build_proposer gives a draft the CPU weight layout (draftsmith.cpulayout) unless it compiles: inductor's
    freezing lays out plain nn.Linear weights itself."""
    import draftsmith.app.drafters as drafters
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.models import load_model, load_tokenizer

    tuned = []
    monkeypatch.setattr(drafters, "tune_linears", lambda module: tuned.append(module))
    target = load_model(tiny_dirs["target"])
    ctx = DrafterContext(target, load_tokenizer(tiny_dirs["target"]), torch.device("cpu"))
    plain = drafters.build_proposer(f"draft:{tiny_dirs['draft']}", ctx, k=2)
    assert plain.model in tuned and not plain.compiles
    before = len(tuned)
    compiled = drafters.build_proposer(f"draft:{tiny_dirs['draft']},compile=1", ctx, k=2)
    assert compiled.compiles and len(tuned) == before
    assert not any(p.requires_grad for p in compiled.model.parameters())
