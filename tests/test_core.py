import random
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from draftsmith import acceptance
from draftsmith.compat import check_compatible, check_tokenizers
from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError
from draftsmith.prompts import load_prompts, prompt_ids
from draftsmith.sampling import SamplingParams, top_margin, warp_probs


@dataclass
class Optim:
    lr: float = 1e-3
    schedule: Literal["cosine", "constant"] = "cosine"


@dataclass
class Cfg:
    name: str = "x"
    steps: int = 1
    optim: Optim = field(default_factory=Optim)
    layers: list[int] = field(default_factory=list)


def test_config_yaml_and_overrides(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: a\noptim:\n  lr: 1e-4\nlayers: [1, 2]\n")
    cfg = load_config(Cfg, p, ["steps=7", "optim.schedule=constant", "layers=3,4"])
    assert cfg.optim.lr == pytest.approx(1e-4) and isinstance(cfg.optim.lr, float)  # YAML 1.1 '1e-4' string
    assert cfg.steps == 7 and cfg.optim.schedule == "constant" and cfg.layers == [3, 4]


@pytest.mark.parametrize(
    "text,match",
    [
        ("optim:\n  lrr: 1\n", "unknown config key optim.lrr; valid keys in optim: lr, schedule"),
        ("steps: many\n", "steps: expected int"),
        ("optim:\n  schedule: linear\n", "not one of"),
        ("- 1\n", "mapping at the top level"),
    ],
)
def test_config_errors(tmp_path, text, match):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(DraftsmithError, match=match):
        load_config(Cfg, p)


def test_config_missing_file(tmp_path):
    with pytest.raises(DraftsmithError, match="not found"):
        load_config(Cfg, tmp_path / "nope.yaml")


def test_warp_greedy_topk_topp():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert warp_probs(logits, SamplingParams()).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[0, 2:].sum() == 0 and torch.allclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (p[0] > 0).sum() == 2  # the first token alone misses top_p by a hair: two are kept
    with pytest.raises(DraftsmithError):
        SamplingParams(temperature=-1)


def test_top_margin_is_p1_minus_p2_over_the_logits_given():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 3.0, 1.0]], dtype=torch.bfloat16)
    p = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(top_margin(logits), torch.stack([p[0, 0] - p[0, 1], p[1, 1] - p[1, 2]]))
    assert top_margin(logits)[1] == 0  # a tie
    sliced = torch.softmax(logits[:1, :2].float(), -1)[0]  # a top-2 slice: p taken over it
    assert top_margin(logits[:1, :2]).item() == pytest.approx(float(sliced[0] - sliced[1]))
    assert top_margin(torch.zeros(3, 1)).tolist() == [1.0, 1.0, 1.0]


def test_acceptance_math():
    assert acceptance.tau_iid(0.0, 4) == 1.0
    assert acceptance.tau_iid(1.0, 4) == 5.0
    assert acceptance.tau_iid(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert acceptance.tau_from_conditional([0.5, 0.5]) == pytest.approx(acceptance.tau_iid(0.5, 2))
    assert acceptance.tau_from_accept_lengths([0, 4]) == 3.0
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.0, 0.5, 0.5])
    assert acceptance.alpha_from_probs(p, q).item() == pytest.approx(0.5)


def test_tokenizer_compat(tiny_tokenizer, tiny_dirs):
    check_tokenizers(tiny_tokenizer, tiny_tokenizer, 384, 400)  # padding rows are fine
    check_compatible(tiny_dirs["target"], tiny_dirs["draft"])
    with pytest.raises(DraftsmithError, match="smaller than its tokenizer"):
        check_tokenizers(tiny_tokenizer, tiny_tokenizer, 384, 100)


def test_tokenizer_mismatch_detected_without_weights(tiny_dirs, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_dirs["draft"], other)
    (other / "model.safetensors").write_bytes(b"not weights")  # never read by the check
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = [k for k, v in vocab.items() if v in (100, 101)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(DraftsmithError, match="tokenizer mismatch: token .* maps to id"):
        check_compatible(tiny_dirs["target"], str(other))


def test_cli_check_exit_codes(tiny_dirs, capsys):
    from draftsmith.app.cli import main

    assert main(["check", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"]]) == 0
    assert main(["check", "--target", tiny_dirs["target"], "--draft", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model path /nonexistent/model not found")


def test_prompts_shapes(tmp_path, tiny_tokenizer):
    import json

    f = tmp_path / "p.jsonl"
    rows = [
        "plain",
        {"instruction": "do", "input": "this"},
        {"question": "q?"},
        {"turns": ["t1", "t2"]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in [*rows, {"other": 1}]))
    with pytest.raises(DraftsmithError, match="record 7 has no prompt text"):  # not dropped without a word
        load_prompts(str(f))
    f.write_text("\n".join(json.dumps(r) for r in rows))
    ps = load_prompts(str(f))
    assert [p.text for p in ps] == ["plain", "do\n\nthis", "q?", "t1", "hi", "s\n\nu"]
    assert len(load_prompts("builtin:dev-eval")) == 244
    ids = prompt_ids(tiny_tokenizer, ps[0])
    assert ids[0] == tiny_tokenizer.bos_token_id
    with pytest.raises(DraftsmithError, match="only 3 fit the context"):
        prompt_ids(tiny_tokenizer, ps[0], max_length=3)
    f.write_text(json.dumps({"other": 1}))
    with pytest.raises(DraftsmithError, match="record 1 has no prompt text"):
        load_prompts(str(f))
    with pytest.raises(DraftsmithError, match="not found"):
        load_prompts("nope.jsonl")


@pytest.mark.slow
def test_chi2_pvalue_is_the_chi_square_upper_tail():
    """Oracles: the table value (df 3 at 7.815 -> 0.05; df 1 at 3.841 -> 0.05), pooling of rare cells, and under the
    null the p-values of many samples are not piled near 0 (a biased law is caught at the same n)."""
    from draftsmith.testing import chi2_pvalue

    law = torch.tensor([0.25, 0.25, 0.25, 0.25])
    # counts 100 * law + deviations whose Pearson statistic is 7.815: (d^2 / 25) summed = 7.815
    d = (7.815 * 25 / 2) ** 0.5
    counts = torch.tensor([25 + d, 25 - d, 25.0, 25.0])
    assert abs(chi2_pvalue(counts, law) - 0.05) < 1e-3
    # two rare cells (expected 1 each) pool into one that observes 2 against 2 expected: statistic 0, p 1
    # (unpooled, the same counts give a statistic of 2 over df 3, p 0.57)
    rare = torch.tensor([0.49, 0.49, 0.01, 0.01])
    assert abs(chi2_pvalue(torch.tensor([49.0, 49.0, 2.0, 0.0]), rare) - 1.0) < 1e-9
    g = torch.Generator().manual_seed(0)
    law = torch.tensor([0.1, 0.2, 0.3, 0.4])
    null = [
        chi2_pvalue(torch.bincount(torch.multinomial(law, 3000, True, generator=g), minlength=4).float(), law)
        for _ in range(200)
    ]
    assert 0.4 < sum(null) / len(null) < 0.6 and sum(p < 0.01 for p in null) <= 6
    biased = torch.bincount(
        torch.multinomial(torch.tensor([0.13, 0.2, 0.3, 0.37]), 3000, True, generator=g), minlength=4
    )
    assert chi2_pvalue(biased.float(), law) < 1e-3


def test_loaded_models_run_no_hub_kernels(tiny_dirs):
    """transformers >= 5.25 turns Hub kernels on by default when `kernels` is installed: layers replaced by code
    fetched from the Hub (on CUDA; offline, the first .train()/.eval() then fails, as on the first GPU check).
    draftsmith loads the code in the checkout only, like trust_remote_code."""
    from draftsmith import models

    for train in (False, True):
        m = models.load_model(tiny_dirs["target"], device="cpu", train=train)
        assert not m.use_kernels
        m.train(not train)  # a mode switch is where transformers kernelizes
        assert not m.use_kernels


def test_embedded_target_loads_and_saves(tmp_path):
    pytest.importorskip("gguf")
    from draftsmith import models

    cfg = models.load_config("smollm2-135m")
    assert cfg.num_hidden_layers == 30 and cfg.hidden_size == 576 and cfg.vocab_size == 49152
    m = models.load_model("smollm2-135m", device="cpu")
    m.save_pretrained(tmp_path / "saved")
    again = models.load_model(str(tmp_path / "saved"), device="cpu")
    ids = torch.tensor([[1, 2683, 359, 253]])
    torch.testing.assert_close(m(ids).logits, again(ids).logits)


def test_one_tau_formula_chain_tree_and_text_agree():
    from draftsmith import acceptance

    a = [0.9, 0.5, 0.25]
    assert acceptance.tau_from_conditional(a) == pytest.approx(1 + 0.9 + 0.45 + 0.1125)
    assert acceptance.tau_from_conditional([0.6] * 4) == pytest.approx(acceptance.tau_iid(0.6, 4))
    # a tree with a second candidate at depth 1: adds P(rank-1 accepted) = 0.05
    assert acceptance.tau_tree([(0,), (1,), (0, 0)], [[0.9, 0.05], [0.5]]) == pytest.approx(
        1 + 0.9 + 0.05 + 0.45
    )


def _decode_rounds(accept: list[float], k: int, rng: random.Random) -> int:
    """Decode a text of len(accept) tokens once by the rule a decoder follows; return its target steps."""
    t = rounds = 0
    while t < len(accept):
        a = 0
        while a < k and t + a < len(accept) and rng.random() < accept[t + a]:
            a += 1
        t, rounds = t + a + 1, rounds + 1
    return rounds


def test_rounds_along_text_is_what_decoding_the_text_takes():
    # greedy, acceptance in runs: 5 accepted tokens then 5 rejected. Rounds: one of 5 tokens (4 accepted + bonus)
    # then one a round: 10 tokens in 6 rounds (averaging the chain formula over every start position says 2.4)
    acc = [1.0] * 5 + [0.0] * 5
    assert acceptance.rounds_along_text(acc, [4])[4] == 6  # [0-4], then one rejected token per round
    assert acceptance.rounds_along_text(acc, [1])[1] == 3 + 4  # [0,1] [2,3] [4,5], then 6..9 one a round
    assert acceptance.rounds_along_text([1.0] * 6, [4])[4] == 2  # 5 tokens, then the last one alone
    # probabilistic acceptance: the expected rounds match decoding the text many times
    rng = random.Random(0)
    acc = [rng.random() for _ in range(40)]
    for k in (1, 3, 6):
        sims = [_decode_rounds(acc, k, rng) for _ in range(20000)]
        assert acceptance.rounds_along_text(acc, [k])[k] == pytest.approx(sum(sims) / len(sims), rel=0.01)


def test_rounds_along_text_with_acceptance_per_round_start():
    # a draft LM's acceptance depends only on the position: the per-start table a[t][i] = a[t + i] walks the same
    rng = random.Random(1)
    acc = [rng.random() for _ in range(30)]
    table = [acc[t : t + 4] for t in range(30)]
    assert acceptance.rounds_along_text(table, [1, 4]) == pytest.approx(
        acceptance.rounds_along_text(acc, [1, 4])
    )
    # a head that drafts well only from the start of a round (depth 1 right, depth 2 wrong) and never from inside:
    # 6 tokens, k 2: rounds start at 0, 2, 4 and each accepts one token -> 3 rounds
    table = [[1.0, 0.0]] * 6
    assert acceptance.rounds_along_text(table, [2])[2] == 3
    table = [[1.0, 1.0] if t % 3 == 0 else [0.0, 0.0] for t in range(6)]  # good only from 0 and 3
    assert acceptance.rounds_along_text(table, [2])[2] == 2  # [0, 1, +2], [3, 4, +5]
    with pytest.raises(ValueError, match="depths"):
        acceptance.rounds_along_text([[1.0]] * 6, [2])


def test_data_sections_share_one_shape_and_name_renamed_keys():
    from draftsmith.config import load_config
    from draftsmith.distill.recipe import DistillConfig
    from draftsmith.examples import DataSources
    from draftsmith.heads.recipe import HeadsConfig

    for cls in (DistillConfig, HeadsConfig):
        cfg = load_config(cls, None, ["data.source=[a, b]", "data.limit=[null, 5]", "data.eval_size=3"])
        assert (
            isinstance(cfg.data, DataSources) and cfg.data.sources == ["a", "b"] and cfg.data.eval_size == 3
        )
        with pytest.raises(DraftsmithError, match="data.generated is now data.source"):
            load_config(cls, None, ["data.generated=a"])
        with pytest.raises(DraftsmithError, match="data.limit must be >= 1"):
            load_config(cls, None, ["data.limit=0"])
        with pytest.raises(DraftsmithError, match="data.source is required"):
            _ = load_config(cls, None, []).data.sources


def test_split_heldout_draws_from_the_first_source_only():
    from draftsmith.examples import Example, split_heldout

    exs = [Example([1], [2, 3], f"a{i}", source="a") for i in range(6)] + [
        Example([1], [2, 3], f"b{i}", source="b") for i in range(4)
    ]
    train, held = split_heldout(exs, 3, seed=1)
    assert len(held) == 3 and all(e.source == "a" for e in held)
    assert sorted(e.id for e in train + held) == sorted(e.id for e in exs)
    assert not {e.id for e in train} & {e.id for e in held}
    assert split_heldout(exs, 3, seed=1) == (train, held)  # deterministic
    with pytest.raises(DraftsmithError, match="cannot hold out"):
        split_heldout(exs, 7)


def test_split_seed_fixes_the_held_out_draw_across_training_seeds():
    from draftsmith.examples import DataSources

    assert DataSources().held_out_seed(3) == 3  # null: the training seed, as before
    assert DataSources(split_seed=0).held_out_seed(3) == DataSources(split_seed=0).held_out_seed(4) == 0
    with pytest.raises(DraftsmithError, match="data.split_seed must be >= 0"):
        DataSources(split_seed=-1)
