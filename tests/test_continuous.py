"""Continuous batching (draftsmith.continuous): every answer equals the target's own greedy continuation, recomputed
from full forwards (no cache), on every tiny architecture, while slots are refilled, the cache compacted and
answers end at an end-of-sequence id; sampled answers follow the target's law; no hook is left on the model."""

import collections

import pytest
import torch

from draftsmith import continuous
from draftsmith.errors import DraftsmithError
from draftsmith.heads.hidden import target_features
from draftsmith.sampling import SamplingParams
from draftsmith.testing import TINY_ARCHS, exact_joint, joint_tvd, recompute_greedy, tiny_model


def _prompts(model, n: int, seed: int, lo: int = 2, hi: int = 25) -> list[tuple[int, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    top = min(model.config.vocab_size, 380)
    lengths = torch.randint(lo, hi, (n,), generator=g)
    return [(i, torch.randint(3, top, (int(n_),), generator=g).tolist()) for i, n_ in enumerate(lengths)]


def _reference(model, ids: list[int], n: int, eos: int | None) -> list[int]:
    ref = recompute_greedy(model, torch.tensor([ids]), n)
    return ref[: ref.index(eos) + 1] if eos is not None and eos in ref else ref


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_greedy_answers_equal_the_target_with_refills_and_compaction(arch):
    model = tiny_model(arch)
    prompts = _prompts(model, 24, seed=1)
    new = 20
    # an end-of-sequence id the model really emits: its most frequent greedy token on these prompts
    first = list(continuous.answer(model, prompts, [], max_new_tokens=new, slots=5))
    assert all(a.finish == "length" and len(a.tokens) == new for a in first)
    eos = collections.Counter(t for a in first for t in a.tokens).most_common(1)[0][0]
    # 3 slots for 24 prompts: slots refill many times; ~8 rounds of up to 45 columns pass the cache's capacity
    # of 2 * (24 + 20 + 1) = 90 columns, so it compacts too
    answers = continuous.answer(model, prompts, [eos], max_new_tokens=new, slots=3)
    got = {a.key: (a.tokens, a.finish) for a in answers}
    assert sorted(got) == [k for k, _ in prompts]
    finishes = collections.Counter(fin for _, fin in got.values())
    assert finishes["stop"] and finishes["length"]  # both endings exercised
    for key, ids in prompts:
        resp, fin = got[key]
        assert resp == _reference(model, ids, new, eos), f"prompt {key}"
        assert (fin == "stop") == (resp[-1] == eos)


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_captured_states_equal_a_second_pass_over_the_answers(arch):
    """The states an Answer carries (taken from the forwards that decoded it: prefill rows, then one row per
    step) are the ones a head's cache pass computes over prompt + response (heads.hidden.target_features)."""
    model = tiny_model(arch)
    prompts = _prompts(model, 9, seed=5)
    eos = 7
    n_layers = model.config.num_hidden_layers
    answers = list(
        continuous.answer(
            model,
            prompts,
            [eos],
            max_new_tokens=6,
            slots=3,
            capture=[0, n_layers - 1, n_layers],
            capture_dtype=torch.float32,
        )
    )
    assert len(answers) == len(prompts)
    for a in answers:
        ids = dict(prompts)[a.key] + a.tokens
        ref = target_features(
            model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), [0, n_layers - 1, n_layers]
        )
        assert a.features["last"].shape == (len(ids), model.config.hidden_size)
        torch.testing.assert_close(a.features["last"], ref["last"][0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(a.features["aux"], ref["aux"][0], atol=2e-4, rtol=1e-4)


def test_capture_refuses_layers_the_target_lacks():
    model = tiny_model("llama")
    with pytest.raises(DraftsmithError, match="outside the target's hidden_states indices"):
        list(continuous.answer(model, _prompts(model, 2, seed=0), [], max_new_tokens=2, capture=[99]))


def test_slot_counts_and_admission_groups_give_the_same_answers():
    model = tiny_model("qwen2")
    prompts = _prompts(model, 13, seed=2, hi=40)
    runs = []
    for slots, every in ((1, 1), (4, 1), (4, 3), (16, None)):
        answers = continuous.answer(model, prompts, [], max_new_tokens=9, slots=slots, admit_every=every)
        runs.append({a.key: a.tokens for a in answers})
    assert all(run == runs[0] for run in runs[1:])


def test_sampled_answers_follow_the_target_law():
    """2,000 copies of one prompt at temperature 1, 8 slots refilled 250 times: the joint law of the first two
    tokens is the target's exact one (full forwards over every prefix)."""
    model = tiny_model("llama", vocab_size=8)
    prompt = [3, 5, 1, 6, 2, 7]
    copies = [(i, prompt) for i in range(2000)]
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(8, 8)
    for a in continuous.answer(model, copies, [], max_new_tokens=2, slots=8, sampling=params, seed=3):
        counts[a.tokens[0], a.tokens[1]] += 1
    law = exact_joint(model, torch.tensor([prompt]), tokens=2)
    assert joint_tvd(counts, law) < 0.06  # the sampling noise of 2,000 draws over 64 outcomes is ~0.04


def test_sampling_is_seeded():
    model = tiny_model("llama")
    prompts = _prompts(model, 6, seed=4)
    params = SamplingParams(temperature=1.0)

    def run(seed):
        answers = continuous.answer(model, prompts, [], max_new_tokens=8, slots=4, sampling=params, seed=seed)
        return {a.key: a.tokens for a in answers}

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_the_head_reads_a_dense_input_and_no_hook_is_left():
    model = tiny_model("llama")
    head = model.get_output_embeddings()
    before = set(head._forward_pre_hooks)
    seen = []
    wide = torch.randn(3, 7, model.config.hidden_size)[:, -1:]  # hidden[:, -n:], as logits_to_keep makes it
    assert not wide.is_contiguous()
    with continuous.dense_head_input(model):
        probe = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_contiguous()))
        head(wide)
        probe.remove()
    assert seen == [True]
    assert set(head._forward_pre_hooks) == before
