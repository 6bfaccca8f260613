"""The decoder's compile path (StaticCache + torch.compile of the target step) on the CPU, so it cannot rot between
GPU runs. The fast test compiles with the `aot_eager` backend: dynamo traces the step with the StaticCache (in-place
cache writes, tree masks, hidden-state outputs) and AOT autograd functionalises it, which is where a StaticCache
step breaks; only the code generation is skipped (inductor's C++ build of even a 2-layer model takes 1-3 minutes on
2 cores). The slow test runs inductor itself, once."""

import pytest
import torch

from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer

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
def test_inductor_compiled_step_equals_eager_on_cpu(tiny_target, tiny_draft):
    """The decoder's real --compile (inductor; CUDA graphs are skipped on CPU tensors) on a 1-layer target."""
    import torch._dynamo

    from draftsmith.testing import tiny_llama

    target = tiny_llama(0, num_hidden_layers=1)
    torch._dynamo.reset()
    eager = SpeculativeDecoder(target, eos_ids=set())
    compiled = SpeculativeDecoder(target, eos_ids=set(), compile=True)
    _compare(compiled, eager, [None, DraftModelProposer(tiny_draft, 384)], new=12)
    torch._dynamo.reset()
