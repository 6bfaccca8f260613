"""No compilation inside a request: a run sizes the compiled target's and a compiled draft's static buffers once,
for its longest prompt (decode.evaluate.reserve), and compiles their steps at warm-up, so prompts of growing
lengths decode with no new graph after the warm-up. Traced with the `aot_eager` backend (dynamo builds and counts
the same graphs as inductor, without the C++ build)."""

import pytest
import torch

from draftsmith.decode import evaluate as ev
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposers import DraftModelProposer
from draftsmith.evalsettings import EvalSettings
from draftsmith.prompts import Prompt

# without a reservation: draft buffers of 768, 768, 768, 1024 rows; the target's of 256 to 512
LENGTHS = (6, 40, 150, 330)


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _prompts():
    gen = torch.Generator().manual_seed(0)
    encoded = [torch.randint(1, 384, (1, n), generator=gen) for n in LENGTHS]
    return [Prompt([{"role": "user", "content": f"p{n}"}], "len", str(n)) for n in LENGTHS], encoded


def _measure(decoder, drafter, monkeypatch, reserve=True):
    """measure() over prompts of growing lengths -> (graphs compiled by the warm-up, graphs compiled after it)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    seen = {}
    warm_up = ev._warm_up

    def counted(*args):
        warm_up(*args)
        seen["warm"] = _graphs()

    monkeypatch.setattr(ev, "_warm_up", counted)
    if not reserve:
        monkeypatch.setattr(ev, "reserve", lambda *a: None)
    prompts, encoded = _prompts()
    settings = EvalSettings(k=3, max_new_tokens=12, warmup_tokens=6)
    out = ev.measure(decoder, [ev.NamedDrafter("d", drafter, 3)], prompts, encoded, settings, progress=False)
    assert out["drafters"]["d"]["lossless"]
    torch._dynamo.reset()
    return seen["warm"], _graphs() - seen["warm"]


def test_a_compiled_draft_and_target_compile_nothing_after_warm_up(tiny_target, tiny_draft, monkeypatch):
    decoder = SpeculativeDecoder(tiny_target, eos_ids=set(), compile="aot_eager")
    drafter = DraftModelProposer(tiny_draft, 384, compile="aot_eager")
    warm, after = _measure(decoder, drafter, monkeypatch)
    # the warm-up compiles the target's plain and chain graphs and the draft's one-column and several-column ones
    assert warm >= 4 and after == 0, (warm, after)
    # the longest sequence fits the buffers of the first prompt: one draft buffer length, one target length
    assert drafter.cache.kv_len == decoder.reserved == 512


@pytest.mark.slow  # ~25 s: the negative control of the test above
def test_without_the_reservation_longer_prompts_compile_inside_requests(tiny_target, tiny_draft, monkeypatch):
    """The same run with per-prompt buffers (what compile=1 did before): the check above can fail."""
    decoder = SpeculativeDecoder(tiny_target, eos_ids=set(), compile="aot_eager")
    drafter = DraftModelProposer(tiny_draft, 384, compile="aot_eager")
    warm, after = _measure(decoder, drafter, monkeypatch, reserve=False)
    assert after > 0, (warm, after)


def test_a_compiled_int4_draft_catches_up_after_plain_steps_without_compiling(tiny_target):
    """An adaptive draft length's plain steps leave the draft several committed tokens to feed at once, more than
    woq.DENSE_ROWS: an int4 draft's Linears take their dense branch there, a graph the warm-up compiles too."""
    from draftsmith.decode.adaptive import AdaptiveK
    from draftsmith.decode.speed import StepCosts
    from draftsmith.testing import tiny_model

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    prompt = torch.randint(1, 384, (1, 20), generator=torch.Generator().manual_seed(0))
    want = dec.generate(prompt, None, max_new_tokens=30).tokens
    prop = DraftModelProposer(tiny_model("llama", 1, num_hidden_layers=1), 384, compile="aot_eager", bits=4)
    prop.reserve(64)
    prop.warm_up()
    warm = _graphs()
    # drafting costs more than it returns: plain steps, a probe every 6th step (6 tokens to feed first)
    policy = AdaptiveK(StepCosts(step_s=1.0, verify_s={4.0: 1.0}, draft_s=1.2), k_max=3, probe_every=6)
    res = dec.generate(prompt, prop, k=policy, max_new_tokens=30)
    assert res.tokens == want and "00000" in res.k_policy["k_steps"]
    assert _graphs() == warm, (warm, _graphs())
    torch._dynamo.reset()
