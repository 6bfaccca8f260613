"""Self-speculative decoding (heads.selfspec: drafting, earlyexit, folders, search; `draftsmith layerskip`):
greedy output == plain decoding (chains, trees, with and without shared-layer reuse), sampled output ~ the target's
law, the reuse oracle, the target untouched by adapter training, drafter folders refused for other targets."""

import json

import pytest
import torch

from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposer import Proposal
from draftsmith.errors import DraftsmithError
from draftsmith.heads.selfspec.drafting import NormHeadTop, SelfSpecProposer
from draftsmith.heads.selfspec.earlyexit import EarlyExitAdapter
from draftsmith.heads.selfspec.folders import EarlyExitTop
from draftsmith.heads.selfspec.targetlayers import TargetLayers
from draftsmith.sampling import SamplingParams
from draftsmith.testing import (
    assert_batch_greedy_lossless,
    assert_greedy_lossless,
    oracle_prompts,
    tiny_llama,
)


@pytest.fixture(scope="module")
def target4():
    return tiny_llama(0, num_hidden_layers=4)


def _adapter(target, exit_layer=2, vocab=None, seed=0):
    torch.manual_seed(seed)
    ad = EarlyExitAdapter.from_target(target, exit_layer, vocab)
    with torch.no_grad():  # an untrained adapter is the identity: give it a real (disagreeing) effect
        ad.self_attn.o_proj.weight.normal_(0, 0.3)
        ad.mlp.down_proj.weight.normal_(0, 0.3)
    return ad.eval()


def _proposers(target):
    n = target.config.num_hidden_layers
    vocab = torch.arange(0, target.config.vocab_size, 2)
    out = {}
    for reuse in (True, False):
        out[f"skip-chain-reuse{int(reuse)}"] = SelfSpecProposer(
            target, [0, 1, 3], NormHeadTop(target), reuse=reuse
        )
        out[f"exit-chain-reuse{int(reuse)}"] = SelfSpecProposer(
            target, range(2), EarlyExitTop(_adapter(target), target), reuse=reuse
        )
    out["skip-tree"] = SelfSpecProposer(
        target, [0, 2], NormHeadTop(target, vocab), top_k=3, depth=3, total_tokens=8
    )
    out["exit-tree"] = SelfSpecProposer(
        target, range(1), EarlyExitTop(_adapter(target, 1, vocab), target), top_k=3, depth=4, total_tokens=10
    )
    out["exit-chain-stop"] = SelfSpecProposer(
        target, range(2), EarlyExitTop(_adapter(target), target), stop_below=0.2
    )
    out["all-layers"] = SelfSpecProposer(target, range(n), NormHeadTop(target))
    return out


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_equals_plain_decoding(target4, k):
    dec = SpeculativeDecoder(target4, eos_ids=set())
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(k))
    plain = dec.generate(ids, None, max_new_tokens=20)
    ref = target4.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)[0, 9:].tolist()
    assert plain.tokens == ref
    for name, prop in _proposers(target4).items():
        if k == 1 and name not in ("skip-chain-reuse1", "exit-chain-reuse1", "skip-tree", "exit-tree"):
            continue  # one-token drafts: the reuse path and both trees suffice; k=4 runs every variant
        assert_greedy_lossless(dec, prop, [ids], k=k, max_new_tokens=20)
    # the draft that runs every layer IS the target: every drafted token is accepted
    full = _proposers(target4)["all-layers"]
    res = dec.generate(ids, full, k=k, max_new_tokens=20)
    assert all(a == p for a, p in zip(res.accepted, res.proposed)) and max(res.accepted) == k


def test_every_variant_decodes_batches_losslessly(target4):
    """Chains with and without reuse, trees (one per row), confidence stops that end rows' drafts apart, and the
    early-exit adapter's own context buffer: rows of different lengths on the target's ragged cache, B = 2 and 3."""
    dec = SpeculativeDecoder(target4, eos_ids=set())
    for name, prop in _proposers(target4).items():
        for rows in (2, 3):
            out = assert_batch_greedy_lossless(dec, prop, oracle_prompts(300, rows), k=4, max_new_tokens=20)
            assert max(max(r.proposed, default=0) for r in out.rows) >= 1, name


def test_layer_sets_and_trees_are_drafted_as_told(target4):
    p = SelfSpecProposer(target4, [0, 1, 3], NormHeadTop(target4))
    assert p.exact == 2 and p.shared == [0, 1] and p.rest == [2, 3]
    assert SelfSpecProposer(target4, [1, 2], NormHeadTop(target4)).exact == 0
    tree = _proposers(target4)["skip-tree"]
    dec = SpeculativeDecoder(target4, eos_ids=set())
    res = dec.generate(torch.tensor([[5, 9, 33, 70]]), tree, k=3, max_new_tokens=6)
    assert len(res.tokens) == 6
    with pytest.raises(DraftsmithError, match="draft layers"):
        SelfSpecProposer(target4, [0, 7], NormHeadTop(target4))


@torch.inference_mode()
def test_reuse_gives_bitwise_the_logits_of_a_full_recompute(target4):
    """fp32 oracle. Reuse: the drafted tokens' rows of the shared layers 0..P-1 (K/V in the target cache and the
    layer-P states) are taken from the draft. Oracle: a snapshot of the cache taken BEFORE drafting, and every
    layer recomputed for the verify block with the target's own layers, shared layers in the same one-token
    steps as plain decoding. Same bits iff every reused row is exactly the target's own (no stale or extra rows,
    right positions, no adapter/inexact-layer rows leaking into the verify); a block recompute differs only in
    row grouping (checked to 1e-5), and a corrupted reuse is caught."""
    from transformers import DynamicCache

    n = target4.config.num_hidden_layers
    ids = torch.tensor([[5, 9, 33, 70, 12, 150, 7, 99]])
    for make in (
        lambda: SelfSpecProposer(target4, [0, 1, 3], NormHeadTop(target4)),  # layers 0, 1 shared
        lambda: SelfSpecProposer(target4, range(2), EarlyExitTop(_adapter(target4), target4)),
    ):
        prop = make()
        dec = SpeculativeDecoder(target4, eos_ids=set())
        cache = DynamicCache(config=target4.config)
        prefill = target4(ids[:, :-1], cache=cache, use_cache=True, output_hidden_states=True)
        rows = tuple(prefill.hidden_states[i] for i in prop.hidden_state_layers)
        snap, snap2 = _copy(cache, target4), _copy(cache, target4)
        c = ids.shape[1] - 1
        prop.attach(dec, _ragged(cache, c))
        prop.begin(ids, rows)
        proposal = prop.propose(4, SamplingParams())
        block = torch.cat([ids[:, -1:], proposal.tokens], 1)
        got, hidden = prop.verify_forward(block, proposal)
        assert all(layer.get_seq_length() == c + block.shape[1] for layer in cache.layers)

        t = TargetLayers(target4)
        steps = [
            t.run(t.embed(block[:, j : j + 1]), prop.shared, snap, torch.tensor([c + j]))
            for j in range(block.shape[1])
        ]
        hp = torch.cat(steps, 1)
        h = t.run(hp, range(prop.exact, n), snap, torch.arange(c, c + block.shape[1]))
        want = target4.get_decoder().norm(h) @ dec._head_t
        assert torch.equal(got, want)
        if hidden is not None:
            assert torch.equal(hidden[0], hp)
        # a block recompute (the decoder's own forward) agrees up to row-grouping round-off
        full = target4(torch.cat([ids, proposal.tokens], 1)).logits[:, c:]
        torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
        # the oracle can fail: one reused layer-P state nudged by ~1e-6 relative changes the bits
        prop.attach(dec, _ragged(snap2, c))
        prop.begin(ids, rows)
        prop.propose(4, SamplingParams())
        j, states = prop.pending
        states = states.clone()
        states[:, 1] *= 1 + 1e-6
        prop.pending = (j, states)
        bad, _ = prop.verify_forward(block, proposal)
        assert not torch.equal(bad, want)


def _ragged(cache, length: int):
    """The decoder's view of a one-row cache holding `length` tokens (what `attach` receives)."""
    from draftsmith.decode.ragged import RaggedCache

    rc = RaggedCache(cache, [0])
    rc.prefilled(length)
    return rc


def _copy(cache, target):
    from transformers import DynamicCache

    out = DynamicCache(config=target.config)
    for layer, src in zip(out.layers, cache.layers):
        layer.update(src.keys.clone(), src.values.clone())
    return out


def test_verify_cost_reuse_flag_changes_only_work_not_output(target4):
    dec = SpeculativeDecoder(target4, eos_ids=set())
    ids = torch.tensor([[5, 9, 33, 70, 12]])
    a = SelfSpecProposer(target4, range(2), EarlyExitTop(_adapter(target4), target4), reuse=True)
    b = SelfSpecProposer(target4, range(2), EarlyExitTop(_adapter(target4), target4), reuse=False)
    calls = []
    orig = b.verify_forward
    b.verify_forward = lambda *x: calls.append(orig(*x)) or calls[-1]
    ra, rb = dec.generate(ids, a, k=3, max_new_tokens=16), dec.generate(ids, b, k=3, max_new_tokens=16)
    assert ra.tokens == rb.tokens and ra.accepted == rb.accepted
    assert calls and all(c is None for c in calls)  # no reuse: the decoder's own forward verified every step


@pytest.mark.slow
def test_sampled_self_speculative_decoding_matches_target_distribution():
    """Temperature 1 on a 4-token vocabulary: the joint law of 3 generated tokens, drafted by an early-exit chain
    (sampled, draft probabilities) and a layer-skip tree (deterministic top-k, point masses), equals the target's
    exact joint law."""
    from draftsmith.testing import sampled_joint_tvd

    target = tiny_llama(0, vocab_size=4, num_hidden_layers=3)
    dec = SpeculativeDecoder(target, eos_ids=set())
    props = {
        "exit-chain": SelfSpecProposer(target, range(1), EarlyExitTop(_adapter(target, 1), target)),
        "skip-tree": SelfSpecProposer(target, [0, 2], NormHeadTop(target), top_k=2, depth=2, total_tokens=4),
    }
    for name, prop in props.items():
        tvd = sampled_joint_tvd(dec, prop, torch.tensor([[1, 3, 0, 2]]))
        assert tvd < 0.065, (name, tvd)
        # the same law for a row decoded beside a longer one (left padding, ragged acceptance)
        tvd = sampled_joint_tvd(
            dec, prop, torch.tensor([[1, 3, 0, 2]]), batch_with=(torch.tensor([[2, 0, 1, 3, 3, 1]]),)
        )
        assert tvd < 0.065, (name, "B=2", tvd)


def test_sampling_chain_carries_draft_probabilities(target4):
    prop = SelfSpecProposer(
        target4, range(2), EarlyExitTop(_adapter(target4, vocab=torch.arange(0, 384, 3)), target4)
    )
    dec = SpeculativeDecoder(target4, eos_ids=set())
    seen = []
    orig = prop.propose
    prop.propose = lambda *a: seen.append(orig(*a)) or seen[-1]
    dec.generate(
        torch.tensor([[5, 9, 33]]), prop, k=3, params=SamplingParams(temperature=0.7), max_new_tokens=8
    )
    p = next(x for x in seen if x.num_nodes)
    assert isinstance(p, Proposal) and p.draft_probs is not None
    assert p.draft_probs.shape[-1] == 384 and torch.allclose(
        p.draft_probs.sum(-1), torch.ones(1, p.num_nodes)
    )
    assert bool((p.draft_probs[..., 1::3] == 0).all())  # nothing outside the draft vocabulary


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_dirs):
    from draftsmith.prompts import Prompt
    from draftsmith.selfdistill import generate_dataset

    out = tmp_path_factory.mktemp("gen") / "data"
    prompts = [Prompt(messages=[{"role": "user", "content": f"Say {i} things about the sea."}], category="chat", id=str(i))
               for i in range(8)]  # fmt: skip
    generate_dataset(tiny_dirs["target"], prompts, out, max_new_tokens=16, batch_size=8, progress=False)
    return str(out)


def test_adapter_training_leaves_the_target_unchanged_and_decodes(tiny_dirs, generated, tmp_path):
    """train/heads.py with head.kind=earlyexit: a few steps move the adapter, never a target weight (bitwise), the
    folder decodes losslessly as earlyexit:DIR and is refused for another target."""
    from draftsmith.app.drafters import build_proposer
    from draftsmith.config import load_config
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.heads.io import load_head
    from draftsmith.heads.recipe import HeadsConfig, run_heads
    from draftsmith.models import load_model
    from draftsmith.testing import save_tiny
    from draftsmith.trainer import make_accelerator

    cfg = load_config(HeadsConfig, None, [
        f"model.target={tiny_dirs['target']}", f"data.source={generated}", "data.eval_size=1", "head.kind=earlyexit",
        "head.exit_layer=1", "head.draft_vocab_size=200", "train.batch_size=4", "train.max_steps=3", "train.lr=1e-2",
        "data.max_length=120", "eval.depth=3", "data.hidden_states=hybrid", f"output_dir={tmp_path / 'run'}",
    ])  # fmt: skip
    acc = make_accelerator(cfg.train)
    seen = {}
    import draftsmith.heads.recipe as recipe

    orig = recipe.HeadTrainer
    recipe.HeadTrainer = lambda head, target, *a, **kw: seen.setdefault("t", orig(head, target, *a, **kw))
    try:
        s = run_heads(cfg, acc, progress=False)
    finally:
        recipe.HeadTrainer = orig
    target = seen["t"].frozen_target
    fresh = load_model(tiny_dirs["target"], device="cpu", dtype="float32")
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), fresh.state_dict().values()))
    assert not any(p.requires_grad for p in target.parameters())
    ev = json.loads((tmp_path / "run" / "final" / "head_accuracy.json").read_text())
    assert (
        1 <= len(ev["acceptance_per_depth"]) <= 3 and ev["tau_sim"] >= 1.0
    )  # undefined past a depth none reach
    ad = load_head(tmp_path / "run" / "final", fresh)
    assert ad.config.exit_layer == 1 and float(ad.mlp.down_proj.weight.abs().sum()) > 0  # trained away from 0
    assert s["step"] == 3
    prop = build_proposer(
        f"earlyexit:{tmp_path / 'run' / 'final'},depth=3", DrafterContext(fresh, None, torch.device("cpu"))
    )
    dec = SpeculativeDecoder(fresh, eos_ids=set())
    ids = torch.tensor([[1, 5, 9, 33, 70, 40]])
    assert (
        dec.generate(ids, prop, k=3, max_new_tokens=12).tokens
        == dec.generate(ids, None, max_new_tokens=12).tokens
    )
    from draftsmith.app.cli import main

    stage = tmp_path / "stage"  # the Hub path accepts the folder (tensor names checked against its config)
    assert (
        main(["push", str(tmp_path / "run" / "final"), "user/ee", "--dry-run", str(stage), "--no-results"])
        == 0
    )
    assert "early exit" in (stage / "README.md").read_text() and (stage / "model.safetensors").is_file()
    other = load_model(save_tiny(tmp_path / "other", seed=7), device="cpu")
    with pytest.raises(DraftsmithError, match="weights differ"):
        build_proposer(
            f"earlyexit:{tmp_path / 'run' / 'final'}", DrafterContext(other, None, torch.device("cpu"))
        )


def test_layerskip_search_writes_a_folder_eval_accepts_and_others_refuse(tiny_dirs, tmp_path, capsys):
    """`draftsmith layerskip` on the tiny target: folder written, its verdict matches what it measured (never a
    slowdown called a speedup), `eval --drafter layerskip:DIR` is lossless, other targets and bad input refused."""
    from draftsmith.app.cli import main
    from draftsmith.checkpoint import read_checkpoint
    from draftsmith.testing import save_tiny

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"say {w} and more"}) for w in ("hi", "sea", "sky")) + "\n"
    )
    out = tmp_path / "ls"
    argv = ["layerskip", "--target", tiny_dirs["target"], "--prompts", str(prompts), "--limit", "2",
            "--max-new-tokens", "8", "--draft-vocab", "0", "--max-k", "3", "--finalists", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    best = cfg["search"]["measured"][0]
    assert cfg["search"]["pays"] == (best["speedup"] > 1.0)
    assert ("no skip set pays on this machine" in printed) == (not cfg["search"]["pays"])
    assert f"{best['speedup']:.2f}x" in printed
    assert read_checkpoint(out).kind == "layerskip" and read_checkpoint(out).target["num_hidden_layers"] == 2
    assert main(argv) == 2 and "exists" in capsys.readouterr().err  # never overwritten silently
    assert main([*argv[:-2], "--out", str(tmp_path / "x"), "--prompts", "builtin:dev-eval"]) == 2
    assert "evaluation set" in capsys.readouterr().err and not (tmp_path / "x").exists()
    ev = tmp_path / "ev"
    rc = main(["eval", "--target", tiny_dirs["target"], "--drafter", f"layerskip:{out},depth=2", "--prompts",
               str(prompts), "--max-new-tokens", "10", "--k", "2", "--out", str(ev), "--no-progress", "--device", "cpu"])  # fmt: skip
    assert rc == 0
    res = json.loads((ev / "eval.json").read_text())
    assert res["lossless"] is True and len(res["alpha_per_position"]) == 2
    stage = tmp_path / "stage"  # the Hub path: a dry-run push stages the folder with a model card
    assert main(["push", str(out), "user/ls", "--dry-run", str(stage), "--eval", str(ev / "eval.json")]) == 0
    card = (stage / "README.md").read_text()
    assert "layer-skip" in card and "layerskip:" in card and (stage / "config.json").is_file()
    other = save_tiny(tmp_path / "other", seed=7)
    capsys.readouterr()
    rc = main(["eval", "--target", str(other), "--drafter", f"layerskip:{out}", "--prompts", str(prompts),
               "--no-progress", "--device", "cpu"])  # fmt: skip
    assert rc == 2 and "weights differ" in capsys.readouterr().err
