"""`--format hf`: a distilled draft (optionally with a reduced output vocabulary) as an ordinary causal LM."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.app.export import export
from draftsmith.errors import DraftsmithError
from draftsmith.testing import save_tiny, tiny_tokenizer
from draftsmith.vocab import restricted_logits, save_draft_vocab


def _draft(tmp_path, vocab_size=None, **overrides):
    path = save_tiny(tmp_path / "draft", seed=1, num_hidden_layers=1, **overrides)
    (path / "draftsmith_draft.json").write_text(json.dumps({"target": {"name": "tiny", "hub_id": None}}))
    vocab_ids = None
    if vocab_size:
        g = torch.Generator().manual_seed(0)
        vocab_ids = torch.sort(
            torch.cat([torch.tensor([0, 1, 2]), 3 + torch.randperm(381, generator=g)[: vocab_size - 3]])
        ).values
        save_draft_vocab(path, vocab_ids)
    return path, vocab_ids


@pytest.mark.parametrize("tied", [False, True])
def test_reduced_vocab_export_proposes_what_the_draft_proposes(tmp_path, tied):
    src, vocab_ids = _draft(tmp_path, vocab_size=60, tie_word_embeddings=tied)
    out = export(src, "hf", tmp_path / "hf")
    assert not (out / "draft_vocab.safetensors").exists()  # an ordinary full-vocab causal LM
    assert (out / "tokenizer.json").is_file() and (out / "draftsmith_draft.json").is_file()
    manifest = json.loads((out / "draftsmith_export.json").read_text())
    assert manifest["format"] == "hf" and manifest["draft_vocab_size"] == 60
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.tie_word_embeddings is False
    assert torch.equal(
        exported.model.embed_tokens.weight, original.model.embed_tokens.weight
    )  # inputs unchanged
    ids = torch.randint(0, 384, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reduced, _ = restricted_logits(
            original, ids, vocab_ids=vocab_ids
        )  # what draftsmith's decoder computes
        full = exported(ids).logits
    assert torch.equal(full.argmax(-1), vocab_ids[reduced.argmax(-1)])  # greedy proposals identical
    assert torch.allclose(full[..., vocab_ids], reduced, atol=1e-5)  # kept logits untouched
    excluded = torch.ones(384, dtype=torch.bool)
    excluded[vocab_ids] = False
    assert torch.allclose(
        full[..., excluded], reduced.mean(-1, keepdim=True).expand(-1, -1, int(excluded.sum())), atol=1e-4
    )


def test_assisted_generation_with_exported_draft_equals_target_greedy(tmp_path, tiny_dirs):
    src, _ = _draft(tmp_path, vocab_size=80)
    out = export(src, "hf", tmp_path / "hf")
    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = tiny_tokenizer()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 30?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        plain = target.generate(**enc, **kw)
        assisted = target.generate(**enc, assistant_model=draft, **kw)
    assert torch.equal(plain, assisted)


def test_full_vocab_export_keeps_the_weights(tmp_path):
    src, _ = _draft(tmp_path)
    out = export(src, "hf", tmp_path / "hf")
    a = AutoModelForCausalLM.from_pretrained(src).state_dict()
    b = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hf_export_bad_inputs(tmp_path):
    src, _ = _draft(tmp_path)
    (src / "tokenizer.json").unlink()
    (src / "tokenizer_config.json").unlink()
    with pytest.raises(DraftsmithError, match="no tokenizer"):
        export(src, "hf", tmp_path / "o")
    with pytest.raises(DraftsmithError, match="unknown export format"):
        export(src, "onnx", tmp_path / "o")
    (src / "model.safetensors").unlink()
    with pytest.raises(DraftsmithError, match="safetensors"):
        export(src, "hf", tmp_path / "o")
    assert not (tmp_path / "o").exists()
