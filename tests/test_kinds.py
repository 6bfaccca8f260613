"""One record per drafter kind (draftsmith.kinds): every kind decodes losslessly on both tiny architectures from its
record's example, a made-up kind registered in one place trains, saves, loads, decodes, gets its model card and is
timed by the cost model, and spec options are checked alike for every kind before anything loads."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from draftsmith.app.drafters import DRAFTERS, build_proposer, parse_spec
from draftsmith.config import load_config
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.drafters import DrafterContext
from draftsmith.decode.proposer import Proposal
from draftsmith.errors import DraftsmithError
from draftsmith.heads.kinds import HEAD_KINDS
from draftsmith.kinds import Card, CostModel, DrafterKind, Option, Training, parse_options
from draftsmith.testing import (
    ARCHS,
    assert_batch_greedy_lossless,
    assert_greedy_lossless,
    oracle_prompts,
    tiny_model,
    tiny_tokenizer,
)

SPEC_KINDS = sorted(name for name, rec in DRAFTERS.items() if rec.build is not None)


@pytest.fixture(scope="module", params=ARCHS)
def arch_target(request):
    return request.param, tiny_model(request.param, seed=0)


# -- every kind, both architectures: greedy speculative == greedy plain ---------------------------------------------
@pytest.mark.parametrize("kind", SPEC_KINDS)
def test_every_kind_is_greedy_lossless_on_both_architectures(kind, arch_target, tmp_path):
    arch, target = arch_target
    spec = DRAFTERS[kind].example(tmp_path, target)
    proposer = build_proposer(spec, DrafterContext(target, tiny_tokenizer(arch), torch.device("cpu")), k=4)
    results = assert_greedy_lossless(
        SpeculativeDecoder(target, eos_ids=set()), proposer, oracle_prompts(384), k=4
    )
    assert max(max(r.proposed) for r in results) >= 1  # it drafted


@pytest.mark.parametrize("kind", SPEC_KINDS)
def test_every_kind_decodes_batches_losslessly_on_both_architectures(kind, arch_target, tmp_path):
    """B = 2 and 3 prompts of different lengths decoded together, rows stopping at different steps: every row is its
    batch-1 greedy decoding, and a stopped row is in no later target forward."""
    arch, target = arch_target
    spec = DRAFTERS[kind].example(tmp_path, target)
    proposer = build_proposer(spec, DrafterContext(target, tiny_tokenizer(arch), torch.device("cpu")), k=4)
    decoder = SpeculativeDecoder(target, eos_ids=set())
    for rows in (2, 3):
        out = assert_batch_greedy_lossless(decoder, proposer, oracle_prompts(384, rows), k=4)
        assert max(max(r.proposed, default=0) for r in out.rows) >= 1  # it drafted


def test_the_qwen2_model_is_what_it_claims(arch_target):
    arch, target = arch_target
    if arch != "qwen2":
        pytest.skip("qwen2 only")
    attn = target.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert target.lm_head.weight is target.model.embed_tokens.weight  # tied
    assert target.config.vocab_size == 448 > len(tiny_tokenizer("qwen2")) == 390 != len(tiny_tokenizer())


# -- a made-up kind, registered in ONE place ---------------------------------------------------------------------
class SkipHead(nn.Module):
    """A made-up head: one projection of the target's final state at t to the token after next (t+2)."""

    head_type = "skiphead"

    def __init__(self, hidden_size: int, vocab_size: int, target: dict | None = None):
        super().__init__()
        self.proj = nn.Linear(hidden_size, vocab_size, bias=False)
        self.target = target or {}

    def to_config_dict(self) -> dict:
        h, v = self.proj.in_features, self.proj.out_features
        return {"draftsmith_head_type": "skiphead", "hidden_size": h, "vocab_size": v, "target": self.target}


class SkipProposer:
    name = "skiphead"

    def __init__(self, head: SkipHead, num_layers: int):
        self.head, self.hidden_state_layers = head, (num_layers,)

    def begin(self, tokens, hidden) -> None:
        self.last = hidden[0][:, -1]  # the state that predicted the last committed token

    def propose(self, k, params, generator=None) -> Proposal:
        return Proposal.chain(self.head.proj(self.last.to(self.head.proj.weight.dtype)).argmax(-1)[:, None])

    def advance(self, accepted_nodes, new_tokens, hidden) -> None:
        self.last = hidden[0][:, -1]


def _skip_build(cfg, target, examples) -> SkipHead:
    from draftsmith.heads.common import target_info

    head = SkipHead(target.config.hidden_size, target.config.vocab_size, target_info(target))
    head.proj.weight.data.copy_(target.get_output_embeddings().weight.detach())
    return head


def _skip_loss(tr, batch):
    h, ids, mask = tr.hidden(batch)["last"], batch["input_ids"], batch["loss_mask"]
    valid = mask[:, 2:].bool()
    logits = tr.head.proj(h[:, :-2][valid].to(tr.head.proj.weight.dtype)).float()
    labels = ids[:, 2:][valid]
    return F.cross_entropy(logits, labels), {"top1": float((logits.argmax(-1) == labels).float().mean())}


def _skip_eval(tr, batches, hidden, eval_cfg) -> dict:
    hits = total = 0
    for b in batches:
        _, m = _skip_loss(tr, b)
        n = int(b["loss_mask"][:, 2:].sum())
        hits, total = hits + m["top1"] * n, total + n
    return {"acceptance_per_depth": [hits / max(total, 1)]}


def _skip_cost(target, settings, opts) -> SkipProposer:
    head = SkipHead(target.config.hidden_size, target.config.vocab_size).to(settings.device, target.dtype)
    return SkipProposer(head, target.config.num_hidden_layers)


SKIPHEAD = DrafterKind(
    name="skiphead",
    family="tests",
    title="a made-up skip head",
    card=Card(
        tag="skip-head",
        text="a made-up skip head: one projection of the target's last state to the token after next",
        paper="no paper (a test's kind)",
    ),
    build=lambda path, opts, ctx: SkipProposer(
        load_skip(path, ctx.target), ctx.target.config.num_hidden_layers
    ),
    training=Training(
        build=_skip_build, loss=_skip_loss, evaluate=_skip_eval, features=lambda h: ("medusa", [])
    ),
    load=lambda cfg: SkipHead(cfg["hidden_size"], cfg["vocab_size"], cfg.get("target")),
    cost=CostModel(_skip_cost),
    example=None,
)


def load_skip(path, target):
    from draftsmith.heads.io import load_head

    return load_head(path, target)


def test_a_made_up_kind_trains_saves_loads_and_decodes(monkeypatch, tiny_dirs, tmp_path):
    from draftsmith.heads.recipe import HeadsConfig, run_heads
    from draftsmith.models import load_model
    from draftsmith.selfdistill import generate_dataset
    from draftsmith.trainer import make_accelerator

    monkeypatch.setitem(HEAD_KINDS, "skiphead", SKIPHEAD)  # the one place a new kind is listed
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Say {i} things about the sea."}) for i in range(6)))
    data = generate_dataset(
        tiny_dirs["target"], str(prompts), tmp_path / "gen", max_new_tokens=12, progress=False
    )
    cfg = load_config(HeadsConfig, None, [
        f"model.target={tiny_dirs['target']}", f"data.source={data}", "data.eval_size=1", "head.kind=skiphead",
        "train.max_steps=2", "train.batch_size=4", "train.log_every=1", "data.max_length=96",
        f"output_dir={tmp_path / 'run'}",
    ])  # fmt: skip
    summary = run_heads(cfg, make_accelerator(cfg.train), progress=False)
    assert summary["step"] == 2
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["draftsmith_head_type"] == "skiphead"
    assert "acceptance_per_depth" in json.loads((final / "head_accuracy.json").read_text())
    target = load_model(tiny_dirs["target"], device="cpu")
    proposer = build_proposer(f"skiphead:{final}", DrafterContext(target, None, torch.device("cpu")), k=2)
    from safetensors.torch import load_file

    saved = load_file(str(final / "model.safetensors"))["proj.weight"]
    assert torch.equal(proposer.head.proj.weight, saved) and not torch.equal(
        saved, target.lm_head.weight
    )  # trained
    assert_greedy_lossless(SpeculativeDecoder(target, eos_ids=set()), proposer, oracle_prompts(384), k=2)
    with pytest.raises(DraftsmithError, match="holds a made-up skip head .* use --drafter skiphead:"):
        parse_spec(f"eagle:{final}")
    # head.init: target is refused in one line: the record names no copy of the target's layers
    with pytest.raises(DraftsmithError, match="head.init=target does not apply to skiphead"):
        load_config(HeadsConfig, None, ["head.kind=skiphead", "head.init=target"])

    # the model card: its text, paper and tag from the record, served by draftsmith (no export format)
    from draftsmith.modelcard import build_card, describe_folder, parse_card

    card = build_card(describe_folder(final), "me/tiny-skip", None, kinds=DRAFTERS)
    assert "A made-up skip head: one projection" in card and "no paper (a test's kind)" in card
    assert "--drafter skiphead:./tiny-skip" in card and "no serving engine reads this format" in card
    front = parse_card(card)
    assert "skip-head" in front["tags"] and front["library_name"] == "draftsmith"

    # the cost model: timed by default (every kind with a builder), at the tiny target's size
    from draftsmith.app import costbench

    args = costbench.BenchArgs(shape="tiny-target", device="cpu", dtype="float32", context=16, sizes=(1, 2),
                               reps=1, compile="none", plain_tokens=2)  # fmt: skip
    assert "skiphead" in args.drafters
    res = costbench.run(dataclasses.replace(args, drafters=("skiphead",)), progress=lambda s: None)
    assert res["drafters"]["skiphead@k=4"]["step_s"] > 0 and res["drafters"]["skiphead@k=4"]["nodes"] == 1


def test_a_made_up_kind_is_in_the_generated_docs(monkeypatch):
    """The docs generator (draftsmith results) lists the made-up kind from its record alone: its title, the paper
    its card cites, its spec and the engines that serve it."""
    from draftsmith.app import results

    monkeypatch.setitem(HEAD_KINDS, "skiphead", SKIPHEAD)  # the one place a new kind is listed
    rows = {r.name: r for r in results.kind_rows(results.ROOT)}
    row = rows["skiphead"]
    assert (row.title, row.paper, row.engines) == (SKIPHEAD.title, SKIPHEAD.card.paper, ["draftsmith"])
    assert row.spec.startswith("`skiphead:FOLDER")
    assert "## skiphead" in results.drafters_md(list(rows.values()))


# -- the per-kind facts other modules read live on the record --------------------------------------------------------
PAPERS = {  # kind -> what its card must cite (independent of the records: the papers' own names)
    "draft": "DistillSpec", "ngram": "prompt lookup decoding", "medusa": "Medusa-1", "medusa2": "Medusa-2",
    "eagle": "EAGLE (Li et al., 2024)", "eagle3": "EAGLE-3 (Li et al., 2025)", "dflash": "DFlash",
    "peagle": "P-EAGLE", "earlyexit": "LayerSkip", "layerskip": "Draft & Verify",
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_every_shipped_kind_has_its_card(kind):
    from draftsmith.modelcard import build_card, parse_card

    rec = DRAFTERS[kind]
    assert rec.card is not None and PAPERS[kind] in rec.card.paper
    info = {"kind": kind, "format": None, "target": {"hub_id": "someone/tiny-target"}}
    text = build_card(info, f"me/tiny-{kind}", None, kinds=DRAFTERS)
    assert rec.card.text[1:] in text and rec.card.paper in text
    front = parse_card(text)
    assert rec.card.tag in front["tags"]
    assert front["library_name"] == ("transformers" if kind == "draft" else "draftsmith")
    assert set(PAPERS) == set(DRAFTERS)  # a new shipped kind names its paper here too


def test_init_from_target_and_cost_models_are_the_records():
    from draftsmith.app import costbench
    from draftsmith.heads.recipe import HeadsConfig

    copies = {name for name, rec in HEAD_KINDS.items() if rec.training and rec.training.from_target}
    assert copies == {"eagle", "eagle3", "peagle", "dflash", "earlyexit"}  # Medusa heads start from lm_head
    for name in sorted(set(HEAD_KINDS) - copies - {"layerskip"}):
        with pytest.raises(DraftsmithError, match=f"head.init=target does not apply to {name}"):
            load_config(HeadsConfig, None, [f"head.kind={name}", "head.init=target"])
    assert costbench.cost_kinds() == ["dflash", "draft", "eagle3", "medusa", "ngram", "peagle"]
    assert list(costbench.BenchArgs().drafters) == costbench.cost_kinds()
    assert costbench._cost_kind("eagle").name == "eagle3"  # EAGLE-1 is timed as EAGLE-3 (one layer each)
    assert costbench._cost_kind("earlyexit") is None and costbench._cost_kind("nonsense") is None


# -- one option parser and validator, the same bounds for every kind ---------------------------------------------------
def _bad_values(opt: Option) -> list[str]:
    if opt.type is bool:
        return ["7", "2", "-1", "true", "", "0.5"]
    if opt.type is str:  # a path: any text but none (whether it is there is the kind's check_options)
        return ["", "  "]
    bad = ["nan", "inf", "x", ""]
    if opt.type is int:
        bad.append("1.5")
    if opt.min is not None:
        bad.append(str(int(opt.min) - 1) if opt.type is int else str(opt.min - 0.01))
        bad.append("-1")
    if opt.below is not None:
        bad.append(str(opt.below))
    return bad


CASES = [
    (kind, opt, value) for kind in SPEC_KINDS for opt in DRAFTERS[kind].options for value in _bad_values(opt)
]


@pytest.mark.parametrize("kind, opt, value", CASES, ids=[f"{k}-{o.name}={v}" for k, o, v in CASES])
def test_every_out_of_bounds_option_is_one_line(kind, opt, value):
    with pytest.raises(DraftsmithError, match=f"{kind} option {opt.name}=") as e:
        parse_options(DRAFTERS[kind].options, f"{opt.name}={value}", kind)
    assert "\n" not in str(e.value)


def test_option_parser_accepts_the_bounds_and_refuses_repeats():
    assert parse_options(HEAD_KINDS["earlyexit"].options, "reuse=0,stop_below=0,top_k=1", "earlyexit") == {
        "reuse": False, "stop_below": 0.0, "top_k": 1,
    }  # fmt: skip
    assert math.isclose(
        parse_options(HEAD_KINDS["layerskip"].options, "stop_below=0.99", "x")["stop_below"], 0.99
    )
    with pytest.raises(DraftsmithError, match="given twice"):
        parse_options(HEAD_KINDS["eagle"].options, "top_k=2,top_k=3", "eagle")
    with pytest.raises(DraftsmithError, match="bad medusa option 'top_k=2'; valid options: total_tokens="):
        parse_options(HEAD_KINDS["medusa"].options, "top_k=2", "medusa")
    with pytest.raises(DraftsmithError, match="ngram needs min <= max"):
        parse_spec("ngram:max=2,min=3")
