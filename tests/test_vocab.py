import json

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.vocab import (
    DRAFT_VOCAB_FILE,
    build_vocab_ids,
    coverage,
    load_draft_vocab,
    restricted_logits,
    save_draft_vocab,
    special_token_ids,
    to_target_probs,
    token_counts,
)


def test_token_counts():
    counts = token_counts([[1, 2, 2], [], torch.tensor([5, 2])], vocab_size=8)
    assert counts.dtype == torch.long and counts.tolist() == [0, 1, 3, 0, 0, 1, 0, 0]
    with pytest.raises(DraftsmithError, match="outside the vocabulary"):
        token_counts([[1, 8]], vocab_size=8)


def test_coverage_is_the_counted_share_inside_the_vocabulary():
    counts = torch.tensor([0, 0, 0, 9, 1, 7, 7, 3, 0, 5])  # 32 tokens counted
    assert coverage(counts, torch.tensor([3, 5])) == 16 / 32
    assert coverage(counts, torch.arange(10)) == 1.0 and coverage(counts, torch.tensor([0, 1])) == 0.0
    assert coverage(torch.zeros(4, dtype=torch.long), torch.tensor([1])) == 0.0  # nothing counted


def test_build_vocab_ids_top_frequency_plus_always():
    counts = torch.tensor([0, 0, 0, 9, 1, 7, 7, 3, 0, 5])
    ids = build_vocab_ids(counts, 4, always=[2])
    # eos (2) forced in; then 3 (9), then 5 and 6 (tie at 7, both fit)
    assert ids.tolist() == [2, 3, 5, 6]
    assert ids.dtype == torch.long
    # ties broken towards the lower id, deterministic
    assert build_vocab_ids(counts, 2).tolist() == [3, 5]
    assert build_vocab_ids(counts, 10).tolist() == list(range(10))
    for bad in (0, 11):
        with pytest.raises(DraftsmithError, match="draft vocab size"):
            build_vocab_ids(counts, bad)
    with pytest.raises(DraftsmithError, match="do not fit"):
        build_vocab_ids(counts, 1, always=[0, 1])
    with pytest.raises(DraftsmithError, match="always-kept"):
        build_vocab_ids(counts, 3, always=[10])


def test_save_load_round_trip(tmp_path):
    assert load_draft_vocab(tmp_path) is None  # no file: full-vocab draft
    ids = torch.tensor([0, 2, 7, 100], dtype=torch.long)
    save_draft_vocab(tmp_path, ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == [DRAFT_VOCAB_FILE]  # no tmp file left behind
    loaded = load_draft_vocab(tmp_path)
    assert loaded.dtype == torch.long and torch.equal(loaded, ids)
    with pytest.raises(DraftsmithError, match="sorted and unique"):
        save_draft_vocab(tmp_path, torch.tensor([3, 1]))


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({"vocab_ids": torch.tensor([3, 1, 2])}, "sorted and unique"),
        ({"vocab_ids": torch.tensor([1, 1, 2])}, "sorted and unique"),
        ({"vocab_ids": torch.tensor([1.0, 2.0])}, "1-D int64"),
        ({"vocab_ids": torch.tensor([1, 2], dtype=torch.int32)}, "1-D int64"),
        ({"vocab_ids": torch.tensor([[1, 2]])}, "1-D int64"),
        ({"vocab_ids": torch.tensor([-1, 2])}, "out of range"),
        ({"vocab_ids": torch.tensor([1, 50])}, "out of range"),  # config.json says vocab_size 50
        ({"ids": torch.tensor([1, 2])}, "exactly one tensor"),
    ],
)
def test_bad_files_rejected(tmp_path, tensors, match):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    save_file(tensors, str(tmp_path / DRAFT_VOCAB_FILE))
    with pytest.raises(DraftsmithError, match=match):
        load_draft_vocab(tmp_path)


def test_corrupt_file_rejected(tmp_path):
    (tmp_path / DRAFT_VOCAB_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(DraftsmithError, match="not a readable safetensors"):
        load_draft_vocab(tmp_path)


def test_to_target_probs():
    ids = torch.tensor([1, 4])
    probs = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    out = to_target_probs(probs, ids, 6)
    assert out.tolist() == [[0, 0.25, 0, 0, 0.75, 0], [0, 1.0, 0, 0, 0, 0]]
    with pytest.raises(DraftsmithError):
        to_target_probs(probs, torch.tensor([1, 2, 3]), 6)


def test_restricted_logits_match_full(tiny_draft):
    torch.manual_seed(0)
    input_ids = torch.randint(0, 384, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    vocab_ids = torch.tensor([0, 1, 2, 17, 100, 383])
    with torch.no_grad():
        full = tiny_draft(input_ids, attention_mask=attention_mask).logits
        reduced, outputs = restricted_logits(tiny_draft, input_ids, attention_mask, vocab_ids=vocab_ids)
        unrestricted, _ = restricted_logits(tiny_draft, input_ids, attention_mask)
        last, _ = restricted_logits(tiny_draft, input_ids, attention_mask, vocab_ids, logits_to_keep=1)
    assert reduced.shape == (2, 9, 6)
    assert torch.allclose(reduced, full[..., vocab_ids], atol=1e-5)
    assert torch.allclose(unrestricted, full, atol=1e-5)
    assert torch.allclose(last, full[:, -1:, vocab_ids], atol=1e-5)
    assert outputs.last_hidden_state.shape == (2, 9, tiny_draft.config.hidden_size)


def test_restricted_logits_at_rows_run_the_head_there_only(tiny_draft):
    torch.manual_seed(0)
    input_ids = torch.randint(0, 384, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    rows = torch.zeros(2, 9, dtype=torch.bool)
    rows[0, 4:8] = True
    rows[1, 6:] = True
    vocab_ids = torch.tensor([0, 1, 2, 17, 100, 383])
    seen = []
    hook = tiny_draft.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
    with torch.no_grad():
        full = tiny_draft(input_ids, attention_mask=attention_mask).logits
        seen.clear()
        at_rows, _ = restricted_logits(tiny_draft, input_ids, attention_mask, rows=rows)
        reduced, _ = restricted_logits(tiny_draft, input_ids, attention_mask, vocab_ids=vocab_ids, rows=rows)
    hook.remove()
    # one head call, over the 7 marked positions only (the reduced-vocabulary call multiplies by the head's kept
    # rows without calling the module)
    assert seen == [torch.Size([7, tiny_draft.config.hidden_size])]
    assert torch.allclose(at_rows, full[rows], atol=1e-5)
    assert torch.allclose(reduced, full[rows][:, vocab_ids], atol=1e-5)
    with pytest.raises(DraftsmithError, match="rows or logits_to_keep"):
        restricted_logits(tiny_draft, input_ids, attention_mask, rows=rows, logits_to_keep=1)


def test_restricted_logits_through_peft_and_grads(tiny_draft):
    import copy

    from draftsmith.modeling import add_lora

    model = add_lora(copy.deepcopy(tiny_draft), r=4)
    # make the adapters non-trivial so a forward that skipped them would differ
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    input_ids = torch.randint(0, 384, (1, 6), generator=torch.Generator().manual_seed(1))
    vocab_ids = torch.arange(0, 384, 3)
    reduced, _ = restricted_logits(model, input_ids, vocab_ids=vocab_ids)
    full = model(input_ids=input_ids).logits
    assert torch.allclose(reduced, full[..., vocab_ids], atol=1e-5)
    with torch.no_grad(), model.disable_adapter():
        assert not torch.allclose(model(input_ids=input_ids).logits[..., vocab_ids], reduced, atol=1e-3)
    reduced.sum().backward()
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_restricted_logits_rejects_lora_on_lm_head(tiny_draft):
    import copy

    from draftsmith.modeling import add_lora

    model = add_lora(copy.deepcopy(tiny_draft), r=2, target_modules=["q_proj", "lm_head"])
    with pytest.raises(DraftsmithError, match="lm_head"):
        restricted_logits(model, torch.tensor([[1, 2, 3]]), vocab_ids=torch.tensor([1, 2]))


def test_special_token_ids_kept_in_vocab(tiny_tokenizer):
    ids = special_token_ids(tiny_tokenizer)
    assert ids == [0, 1, 2]  # <|endoftext|>, <|im_start|>, <|im_end|> (eos)
    counts = token_counts([tiny_tokenizer("hello world hello").input_ids], len(tiny_tokenizer))
    vocab_ids = build_vocab_ids(counts, 5, always=ids)
    assert tiny_tokenizer.eos_token_id in vocab_ids.tolist() and len(vocab_ids) == 5


def test_special_token_ids_joins_tokenizer_and_model_end_tokens():
    from types import SimpleNamespace

    from draftsmith.vocab import special_token_ids

    tok = SimpleNamespace(all_special_ids=[0, 5], eos_token_id=5, bos_token_id=0, pad_token_id=None)
    model = SimpleNamespace(
        config=SimpleNamespace(eos_token_id=[5, 7], bos_token_id=0, pad_token_id=None),
        generation_config=SimpleNamespace(eos_token_id=9),  # e.g. <|eot_id|>: only the model knows it
    )
    assert special_token_ids(tok) == [0, 5]
    assert special_token_ids(tok, model) == [0, 5, 7, 9]
    assert special_token_ids(None, model) == [0, 5, 7, 9]
