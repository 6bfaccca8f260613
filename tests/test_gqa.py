"""draftsmith.gqa: grouped-query attention over a few new columns folds each group's query heads into rows of its
key/value head instead of repeating the cache; it equals transformers' SDPA function, under torch.compile too, and
leaves prompts, ungrouped models and other attention implementations to transformers."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import draftsmith.gqa as gqa
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposers import DraftModelProposer
from draftsmith.testing import ARCHS, tiny_model


class _Attn(torch.nn.Module):
    def __init__(self, n_rep: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = n_rep, True


def _inputs(B, n_rep, T, L=20, kv_heads=2, additive=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, kv_heads * n_rep, T, 8, generator=g)
    k, v = torch.randn(B, kv_heads, L, 8, generator=g), torch.randn(B, kv_heads, L, 8, generator=g)
    allowed = torch.rand(B, 1, T, L, generator=g) > 0.3
    allowed[..., 0] = True
    mask = (
        allowed
        if not additive
        else torch.zeros(B, 1, T, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    )
    return q, k, v, mask


def _no_fallback(*args, **kwargs):
    raise AssertionError("went to transformers' SDPA function")


@pytest.mark.parametrize("n_rep", [2, 7])
@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("additive", [True, False])
def test_folded_attention_equals_transformers_sdpa(monkeypatch, n_rep, T, B, additive):
    q, k, v, mask = _inputs(B, n_rep, T, additive=additive)
    want, _ = sdpa_attention_forward(_Attn(n_rep), q, k, v, mask, scaling=0.3)
    monkeypatch.setattr(gqa, "sdpa_attention_forward", _no_fallback)  # the fold itself answers
    got, weights = gqa.packed_sdpa(_Attn(n_rep), q, k, v, mask, scaling=0.3)
    assert weights is None and got.shape == (B, T, 2 * n_rep, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_one_column_without_a_mask_folds_too(monkeypatch):
    q, k, v, _ = _inputs(1, 4, 1)
    want, _ = sdpa_attention_forward(_Attn(4), q, k, v, None)
    monkeypatch.setattr(gqa, "sdpa_attention_forward", _no_fallback)
    torch.testing.assert_close(gqa.packed_sdpa(_Attn(4), q, k, v, None)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["prompt", "ungrouped", "causal block without a mask", "a mask per head"])
def test_what_it_does_not_fold_goes_to_transformers(monkeypatch, case):
    n_rep, T, per_head, use_mask = 2, 3, False, True
    if case == "prompt":
        T = gqa.MAX_COLUMNS + 1
    elif case == "ungrouped":
        n_rep = 1
    elif case == "causal block without a mask":
        use_mask = False
    else:
        per_head = True
    q, k, v, mask = _inputs(1, n_rep, T)
    if per_head:
        mask = mask.expand(1, q.shape[1], T, mask.shape[-1])
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(gqa, "sdpa_attention_forward", spy)
    gqa.packed_sdpa(_Attn(n_rep), q, k, v, mask if use_mask else None)
    assert calls == [q.shape]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_switched_to_it_computes_the_same_logits(arch):
    model = tiny_model(arch, 0)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # a padded row: a mask, so the block is not plain causal
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        assert gqa.use_packed_gqa(model) and model.config._attn_implementation == gqa.NAME
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_grouped_sdpa_models_switch():
    ungrouped = tiny_model("llama", 0, num_key_value_heads=4)
    assert not gqa.use_packed_gqa(ungrouped) and ungrouped.config._attn_implementation == "sdpa"
    eager = tiny_model("llama", 0)
    eager.set_attn_implementation("eager")
    assert not gqa.use_packed_gqa(eager) and eager.config._attn_implementation == "eager"


def test_the_decoder_and_a_draft_use_it_and_a_compiled_draft_traces_the_fold(tiny_target, monkeypatch):
    """The decoder's target and a draft LM switch to the fold; a compiled draft's steps (one column and two, a
    mask over the static cache) trace the fold, not transformers' repeated cache, and decode as plain decoding."""
    import torch._dynamo

    fallbacks = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        fallbacks.append((query.shape[2], attention_mask is None))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(gqa, "sdpa_attention_forward", spy)
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    assert tiny_target.config._attn_implementation == gqa.NAME
    prompt = torch.tensor([[1, 40, 50, 60, 70, 80, 40, 50, 60, 90, 40, 50]])
    want = dec.generate(prompt, None, max_new_tokens=16).tokens
    torch._dynamo.reset()
    prop = DraftModelProposer(tiny_model("llama", 0), 384, compile="aot_eager")
    assert prop.model.config._attn_implementation == gqa.NAME
    got = dec.generate(prompt, prop, k=3, max_new_tokens=16)
    assert got.tokens == want and sum(got.accepted) > 0
    # only unmasked prompts went to transformers: every masked block, traced or eager, folded
    assert fallbacks and all(no_mask and t > 1 for t, no_mask in fallbacks), fallbacks
    torch._dynamo.reset()
