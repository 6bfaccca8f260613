"""`draftsmith vocab` and `draft:<model>,vocab=DIR`: a reduced output vocabulary for a draft trained without one.
The draft proposes only the kept ids, decoding stays lossless (greedy == plain, and the sampled tokens follow the
target: the proposer's q is zero outside the kept ids, which rejection sampling handles), and bad input is one line,
exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.app.cli import main
from draftsmith.sampling import SamplingParams
from draftsmith.vocab import DRAFT_VOCAB_FILE, read_draft_vocab, save_draft_vocab


def _data(tmp_path):
    """Prompt+response pairs whose responses repeat a few words, so the frequent ids are known."""
    f = tmp_path / "train.jsonl"
    rows = [
        {"prompt": f"Say something about {i}", "response": "the cat sat on the mat " * 3} for i in range(6)
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _err(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1] if lines else ""


def _vocab(tiny_dirs, data, out, *extra):
    return main(["vocab", "--target", tiny_dirs["target"], "--data", str(data), "--out", str(out), *extra])


def test_vocab_keeps_the_most_frequent_ids_and_specials(tiny_dirs, tmp_path):
    from draftsmith.models import load_tokenizer

    data, out = _data(tmp_path), tmp_path / "v"
    assert _vocab(tiny_dirs, data, out, "--size", "40") == 0
    ids = read_draft_vocab(out, 384)
    tok = load_tokenizer(tiny_dirs["target"])
    assert ids.numel() == 40 and bool((ids[1:] > ids[:-1]).all())
    kept = set(ids.tolist())
    for word_id in tok(" cat sat mat", add_special_tokens=False)["input_ids"]:
        assert word_id in kept  # 18 occurrences each: among the 40 most frequent
    assert tok.eos_token_id in kept  # a special token is always kept, so the draft can end
    info = json.loads((out / "vocab.json").read_text())
    assert info["size"] == 40 and info["examples"] == 6 and 0.9 < info["data_token_coverage"] <= 1.0


def test_eval_with_vocab_option_is_lossless_and_drafts_only_kept_ids(tiny_dirs, tmp_path, capsys):
    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.decoder import SpeculativeDecoder
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.models import load_model, load_tokenizer

    vocab = tmp_path / "v"
    assert _vocab(tiny_dirs, _data(tmp_path), vocab, "--size", "48") == 0
    spec = f"draft:{tiny_dirs['draft']},vocab={vocab}"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about {w}"}) + "\n" for w in ("cats", "mats")))
    out = tmp_path / "ev"
    rc = main(["eval", "--target", tiny_dirs["target"], "--drafter", spec, "--prompts", str(prompts), "--k", "3",
               "--max-new-tokens", "12", "--device", "cpu", "--no-progress", "--out", str(out)])  # fmt: skip
    assert rc == 0, _err(capsys)
    res = json.loads((out / "eval.json").read_text())
    assert res["lossless"] is True and res["conditions"]["drafter"] == spec

    # the proposer drafts from the kept rows only, greedy and sampled; the greedy output is the target's
    target, tok = load_model(tiny_dirs["target"], device="cpu"), load_tokenizer(tiny_dirs["target"])
    ctx = DrafterContext(
        target=target, tokenizer=tok, device=torch.device("cpu"), target_spec=tiny_dirs["target"]
    )
    proposer = build_proposer(spec, ctx, k=3)
    kept = set(read_draft_vocab(vocab, 384).tolist())
    assert proposer.vocab_ids is not None and set(proposer.vocab_ids.tolist()) == kept
    dec = SpeculativeDecoder(target, tok)
    ids = torch.tensor([tok("Tell me about cats")["input_ids"]])
    plain = dec.generate(ids, None, max_new_tokens=16)
    assert dec.generate(ids, proposer, k=3, max_new_tokens=16).tokens == plain.tokens
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        proposer.begin(ids)
        drafted = proposer.propose(3, params, torch.Generator().manual_seed(0))
        assert set(drafted.tokens.reshape(-1).tolist()) <= kept
        if drafted.draft_probs is not None:  # q is zero outside the kept ids
            outside = torch.ones(drafted.draft_probs.shape[-1], dtype=torch.bool)
            outside[sorted(kept)] = False
            assert float(drafted.draft_probs[..., outside].abs().max()) == 0.0


BAD = [
    # (arguments after the target, what the one line says)
    (["--data", "builtin:dev-eval", "--size", "40", "--out", "{tmp}/v"], "evaluation set"),
    (["--data", "{data}", "--size", "0", "--out", "{tmp}/v"], "--size must be in [1, 384]"),
    (["--data", "{data}", "--size", "385", "--out", "{tmp}/v"], "--size must be in [1, 384]"),
    (["--data", "{tmp}/missing", "--size", "40", "--out", "{tmp}/v"], "missing"),
]


@pytest.mark.parametrize("args,says", BAD)
def test_vocab_bad_input_is_one_line_and_writes_nothing(tiny_dirs, tmp_path, capsys, args, says):
    data = _data(tmp_path)
    argv = [a.format(tmp=tmp_path, data=data) for a in args]
    assert main(["vocab", "--target", tiny_dirs["target"], *argv]) == 2
    assert says in _err(capsys)
    assert not (tmp_path / "v").exists()


def test_vocab_refuses_to_overwrite_without_the_flag(tiny_dirs, tmp_path, capsys):
    data, out = _data(tmp_path), tmp_path / "v"
    assert _vocab(tiny_dirs, data, out, "--size", "40") == 0
    before = (out / DRAFT_VOCAB_FILE).read_bytes()
    assert _vocab(tiny_dirs, data, out, "--size", "50") == 2
    assert "--overwrite" in _err(capsys) and (out / DRAFT_VOCAB_FILE).read_bytes() == before
    assert _vocab(tiny_dirs, data, out, "--size", "50", "--overwrite") == 0
    assert read_draft_vocab(out, 384).numel() == 50


def _refuse_loading(monkeypatch):
    from draftsmith import models

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the spec was refused")

    monkeypatch.setattr(models, "load_model", refuse)


def test_spec_vocab_bad_paths_are_refused_before_loading(tiny_dirs, tmp_path, capsys, monkeypatch):
    def run(spec):
        return main(["eval", "--target", tiny_dirs["target"], "--drafter", spec, "--prompts", "builtin:vicuna",
                     "--limit", "1", "--device", "cpu", "--out", str(tmp_path / "ev")])  # fmt: skip

    _refuse_loading(monkeypatch)
    assert run(f"draft:{tiny_dirs['draft']},vocab={tmp_path / 'nowhere'}") == 2
    err = _err(capsys)
    assert "draft vocabulary" in err and "not found" in err
    assert run(f"draft:{tiny_dirs['draft']},vocab=") == 2
    assert "draft option vocab='' is invalid: it must be <path>" in _err(capsys)
    assert not (tmp_path / "ev").exists()


def test_spec_vocab_is_checked_against_the_draft(tiny_dirs, tmp_path):
    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.errors import DraftsmithError
    from draftsmith.models import load_model, load_tokenizer
    from draftsmith.testing import save_tiny

    target, tok = load_model(tiny_dirs["target"], device="cpu"), load_tokenizer(tiny_dirs["target"])
    ctx = DrafterContext(
        target=target, tokenizer=tok, device=torch.device("cpu"), target_spec=tiny_dirs["target"]
    )
    too_high = tmp_path / "high"
    save_draft_vocab(too_high, torch.tensor([1, 2, 400]))  # id 400 is outside the 384-row vocabulary
    with pytest.raises(DraftsmithError, match="out of range"):
        build_proposer(f"draft:{tiny_dirs['draft']},vocab={too_high}", ctx, k=2)
    reduced = save_tiny(tmp_path / "reduced", seed=1, num_hidden_layers=1)
    save_draft_vocab(reduced, torch.arange(64))
    ok = tmp_path / "ok"
    save_draft_vocab(ok, torch.arange(32))
    with pytest.raises(DraftsmithError, match="already has a reduced output vocabulary"):
        build_proposer(f"draft:{reduced},vocab={ok}", ctx, k=2)
