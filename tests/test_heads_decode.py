"""Head proposers in the speculative decoder: lossless greedy output with untrained heads, tree masks, the CLI."""

import json

import pytest
import torch

from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposer import node_depths, tree_attention_mask
from draftsmith.errors import DraftsmithError
from draftsmith.heads import EagleHead, MedusaHeads, save_head
from draftsmith.heads.eagle.proposer import EagleProposer
from draftsmith.heads.io import ACCURACY_FILE
from draftsmith.heads.medusa.proposer import MedusaProposer
from draftsmith.heads.medusa.trees import medusa_tree
from draftsmith.sampling import SamplingParams
from draftsmith.testing import assert_greedy_lossless

AUX = [0, 1, 2]
ACC = [[0.5, 0.2, 0.1], [0.3, 0.2, 0.1], [0.2, 0.1, 0.05]]


def _proposers(target):
    torch.manual_seed(0)
    medusa = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    with torch.no_grad():  # untrained but not the identity: heads disagree with the target
        for blk in medusa.blocks:
            blk.layers[0].weight.normal_(0, 0.5)
    e3 = EagleHead.from_target(
        target, "eagle3", draft_vocab_ids=torch.arange(0, 384, 2), aux_layers=AUX
    ).eval()
    e1 = EagleHead.from_target(target, "eagle").eval()
    return {
        "medusa-tree": MedusaProposer(medusa, 2, medusa_tree(ACC, 10)),
        "eagle3-chain": EagleProposer(e3, target, top_k=1, depth=4, total_tokens=4),
        "eagle3-tree": EagleProposer(e3, target, top_k=4, depth=4, total_tokens=14),
        "eagle1-tree": EagleProposer(e1, target, top_k=3, depth=3, total_tokens=9),
    }


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_output_equals_target_greedy_with_untrained_heads(tiny_target, k):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(k))
    plain = dec.generate(ids, None, max_new_tokens=20).tokens
    hf = tiny_target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)[0, 8:].tolist()
    assert plain == hf
    for prop in _proposers(tiny_target).values():
        (res,) = assert_greedy_lossless(dec, prop, [ids], k=k, max_new_tokens=20)
        assert all(a <= k for a in res.accepted)


def test_sampling_with_head_trees_runs(tiny_target):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    ids = torch.randint(3, 300, (1, 8))
    for prop in _proposers(tiny_target).values():
        res = dec.generate(ids, prop, k=3, max_new_tokens=12, params=SamplingParams(temperature=0.8), seed=1)
        assert len(res.tokens) == 12


def test_eagle_tree_mask_equals_per_path_recompute(tiny_target):
    """The decoder verifies an EAGLE-2 tree in one forward; each node's logits must equal a plain forward over
    prefix + its root-to-node path."""
    prop = _proposers(tiny_target)["eagle3-tree"]
    ids = torch.randint(3, 300, (1, 10))
    with torch.no_grad():
        hs = tiny_target(ids, output_hidden_states=True).hidden_states
        prop.begin(ids, tuple(hs[i][:, :-1] for i in AUX))
        p = prop.propose(4, SamplingParams())
        assert not p.is_chain and len(set(p.parents)) > 1
        prefix, root = ids[:, :-1], ids[:, -1:]
        from transformers import DynamicCache

        cache = DynamicCache(config=tiny_target.config)
        tiny_target(prefix, cache=cache, use_cache=True)
        depths = torch.tensor([0, *node_depths(p.parents)])
        block = torch.cat([root, p.tokens], 1)
        mask = tree_attention_mask(p.parents, prefix.shape[1], torch.float32, "cpu")
        tree_logits = tiny_target(
            block,
            cache=cache,
            use_cache=True,
            attention_mask=mask,
            position_ids=(prefix.shape[1] + depths)[None],
        ).logits
        for i in range(p.num_nodes):
            path, j = [], i
            while j >= 0:
                path.append(int(p.tokens[0, j]))
                j = p.parents[j]
            full = torch.cat([ids, torch.tensor([path[::-1]])], 1)
            ref = tiny_target(full).logits[0, -1]
            torch.testing.assert_close(tree_logits[0, 1 + i], ref, rtol=1e-4, atol=1e-4)


def test_eval_cli_with_head_drafters(tiny_dirs, tmp_path, capsys):
    from draftsmith.app.cli import main
    from draftsmith.models import load_model

    target = load_model(tiny_dirs["target"], device="cpu")
    e3 = EagleHead.from_target(target, "eagle3", draft_vocab_ids=torch.arange(0, 384, 3), aux_layers=AUX)
    save_head(e3, tmp_path / "e3")
    medusa = MedusaHeads.from_target(target, 3, 1)
    save_head(medusa, tmp_path / "m", extra_json={ACCURACY_FILE: {"rank_accuracy": ACC}})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"say {w}", "category": "x"}) for w in ("hi", "sea")) + "\n"
    )
    for spec in (f"eagle:{tmp_path / 'e3'},top_k=3,depth=3,total_tokens=8", f"medusa:{tmp_path / 'm'}"):
        out = tmp_path / spec.split(":")[0]
        rc = main(
            [
                "eval",
                "--target",
                tiny_dirs["target"],
                "--drafter",
                spec,
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "16",
                "--k",
                "3",
                "--out",
                str(out),
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        assert rc == 0
        res = json.loads((out / "eval.json").read_text())
        assert res["lossless"] is True and res["tau"] >= 1.0
    capsys.readouterr()
    # a head trained for another target is refused with one line
    other = tmp_path / "other"
    from draftsmith.testing import save_tiny

    save_tiny(other, seed=7)
    assert (
        main(
            [
                "eval",
                "--target",
                str(other),
                "--drafter",
                f"eagle:{tmp_path / 'e3'}",
                "--prompts",
                str(prompts),
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    assert "weights differ" in capsys.readouterr().err


def test_bad_head_specs(tiny_target, tmp_path):
    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.drafters import DrafterContext

    ctx = DrafterContext(tiny_target, None, torch.device("cpu"))
    with pytest.raises(DraftsmithError, match="not found"):
        build_proposer(f"eagle:{tmp_path / 'missing'}", ctx)
    save_head(MedusaHeads.from_target(tiny_target, 2, 1), tmp_path / "m")
    with pytest.raises(DraftsmithError, match="holds Medusa heads .* use --drafter medusa:"):
        build_proposer(f"eagle:{tmp_path / 'm'}", ctx)
    with pytest.raises(DraftsmithError, match="bad eagle option"):
        build_proposer(f"eagle:{tmp_path / 'm'},width=3", ctx)


def test_medusa2_lora_is_merged_into_the_target_for_decoding(tiny_dirs, tmp_path):
    """medusa:DIR with DIR/target_lora decodes with the fine-tuned backbone: logits of the merged target equal the
    adapter model's, and greedy speculative output equals the merged target's greedy output."""
    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.heads.medusa.training import LORA_DIR
    from draftsmith.modeling import add_lora
    from draftsmith.models import load_model

    torch.manual_seed(0)
    lora_model = add_lora(load_model(tiny_dirs["target"], device="cpu", dtype="float32"), r=4, alpha=8)
    for name, p in lora_model.named_parameters():
        if "lora_B" in name:  # peft zero-inits B: give the adapter a real effect
            p.data.normal_(0, 0.05)
    base = load_model(tiny_dirs["target"], device="cpu", dtype="float32")
    save_head(MedusaHeads.from_target(base, 2, 1), tmp_path / "m2")
    lora_model.save_pretrained(str(tmp_path / "m2" / LORA_DIR))
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 40]])
    with torch.no_grad():
        want = lora_model(ids).logits
        before = base(ids).logits
    assert not torch.allclose(want, before, atol=1e-3)
    proposer = build_proposer(f"medusa:{tmp_path / 'm2'}", DrafterContext(base, None, torch.device("cpu")))
    with torch.no_grad():
        got = base(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not hasattr(base, "peft_config")  # merged and unloaded: a plain HF model again
    dec = SpeculativeDecoder(base, eos_ids=set())
    plain = dec.generate(ids, None, max_new_tokens=12)
    spec = dec.generate(ids, proposer, k=2, max_new_tokens=12)
    assert spec.tokens == plain.tokens
    # a Medusa-1 folder (no adapter) leaves the target alone
    other = load_model(tiny_dirs["target"], device="cpu", dtype="float32")
    save_head(MedusaHeads.from_target(other, 2, 1), tmp_path / "m1")
    build_proposer(f"medusa:{tmp_path / 'm1'}", DrafterContext(other, None, torch.device("cpu")))
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, before)


def _fit(head, loss_of, steps: int = 40):
    """A few Adam steps of `loss_of(head) -> (loss, metrics)`: a head that accepts some tokens and misses others."""
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    head.train()
    for _ in range(steps):
        loss, _ = loss_of(head)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "peagle"])
def test_heldout_rounds_walk_predicts_the_greedy_decoders_target_steps(tiny_target, kind):
    """The heads' predicted tau walks the rounds a greedy decoder takes along teacher-forced text, with acceptance
    per round start and depth (a head chains its own states from the round's start). On the target's own greedy
    text it must count exactly the verify steps of decoding it; the chain formula over start-averaged conditional
    acceptances does not."""
    from types import SimpleNamespace

    from draftsmith.heads.block.losses import peagle_loss
    from draftsmith.heads.block.peagle import PEagleHead
    from draftsmith.heads.block.proposers import PEagleProposer
    from draftsmith.heads.eagle.losses import eagle1_loss, eagle3_loss
    from draftsmith.heads.hidden import target_features
    from draftsmith.modeling import base_decoder, output_head

    target, n_new = tiny_target, 24
    for p in target.parameters():
        p.requires_grad_(False)
    dec = SpeculativeDecoder(target, eos_ids=set())
    prompts = [torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    rows = [p[0].tolist() + dec.generate(p, None, max_new_tokens=n_new).tokens for p in prompts]
    ids = torch.tensor(rows)
    am = torch.ones_like(ids)
    lm = torch.zeros_like(ids)
    lm[:, 9:] = 1  # the response after its first token, which the prefill writes: what the rounds draft
    feats = target_features(target, ids, am, [] if kind == "eagle" else AUX)
    cfg = SimpleNamespace(kind="soft_ce", ttt_steps=3, decay=0.8, temperature=1.0, beta=0.5, ce_weight=0.1)
    cfg.feature_noise = 0.0
    torch.manual_seed(0)
    vocab = torch.arange(target.config.vocab_size)
    if kind == "eagle":
        head = EagleHead.from_target(target, "eagle")
    else:
        head = EagleHead.from_target(target, "eagle3", draft_vocab_ids=vocab, aux_layers=AUX)
    if kind == "peagle":
        head = PEagleHead.from_target_head(head, mask_token_id=3, num_depths=4)
        emb, lmw = base_decoder(target).embed_tokens.weight, output_head(target).weight

        def metrics(h, rows, depths=3):
            b = {"input_ids": ids[rows], "attention_mask": am[rows], "loss_mask": lm[rows]}
            f = {n: v[rows] for n, v in feats.items()}
            return peagle_loss(h, emb, lmw, f, b, depths=depths, cod_ratio=1.0)
    else:
        fn = eagle1_loss if kind == "eagle" else eagle3_loss

        def metrics(h, rows, depths=3):
            b = {"input_ids": ids[rows], "attention_mask": am[rows], "loss_mask": lm[rows]}
            return fn(h, target, {n: v[rows] for n, v in feats.items()}, b, cfg, ttt_steps=depths)

    head = _fit(head, lambda h: metrics(h, slice(0, 2)))
    accepted, chain_off = 0, False
    for k in (2, 4):
        for s in range(4):  # two trained on, two not
            prop = (
                PEagleProposer(head, target, depth=k)
                if kind == "peagle"
                else EagleProposer(head, target, top_k=1, depth=k, total_tokens=k)
            )
            res = dec.generate(prompts[s], prop, k=k, max_new_tokens=n_new)
            assert res.tokens == rows[s][8:]
            with torch.no_grad():
                m = metrics(head, slice(s, s + 1), depths=k)[1]
            walked = m[f"rounds_per_token_{k}"] * (n_new - 1)
            assert walked == pytest.approx(len(res.accepted)), (kind, k, s)
            accepted += sum(res.accepted)
            chain_off |= abs((n_new - 1) / m["tau_sim"] - len(res.accepted)) > 0.5
    assert accepted > 20 and chain_off  # the head accepts, and the walk is not what the chain formula says


def test_predicted_vs_decoded_script_counts_the_same_rounds(tiny_dirs, tmp_path, capsys):
    """`draftsmith bench predicted-vs-decoded` on a saved target and an EAGLE-3 head fitted to its answers: the
    rounds the held-out eval walks along each decoded answer are the rounds the decoder took; bad input is one line,
    exit 2."""
    from types import SimpleNamespace

    from draftsmith.app.cli import main
    from draftsmith.heads.eagle.losses import eagle3_loss
    from draftsmith.heads.hidden import target_features
    from draftsmith.models import load_model, load_tokenizer
    from draftsmith.prompts import load_prompts, prompt_ids

    target = load_model(tiny_dirs["target"], device="cpu").requires_grad_(False)
    tok = load_tokenizer(tiny_dirs["target"])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"count {w}"}) for w in ("sheep", "stars", "waves")))
    dec = SpeculativeDecoder(target, eos_ids=set())
    rows = []
    for p in load_prompts(str(prompts))[
        :2
    ]:  # the head is fitted to two answers; the third prompt is new to it
        ids = torch.tensor([prompt_ids(tok, p)])
        rows.append(ids[0].tolist() + dec.generate(ids, None, max_new_tokens=24).tokens)
    n = min(map(len, rows))
    ids = torch.tensor([r[:n] for r in rows])
    am = torch.ones_like(ids)
    feats = target_features(target, ids, am, AUX)
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": am}
    cfg = SimpleNamespace(kind="soft_ce", ttt_steps=3, decay=0.8, temperature=1.0, beta=0.5)
    torch.manual_seed(0)
    head = EagleHead.from_target(target, "eagle3", draft_vocab_ids=torch.arange(384), aux_layers=AUX)
    head = _fit(head, lambda h: eagle3_loss(h, target, feats, batch, cfg))
    save_head(head, tmp_path / "e3")

    out = tmp_path / "check.json"
    argv = ["--target", tiny_dirs["target"], "--head", str(tmp_path / "e3"), "--prompts", str(prompts)]
    argv += ["--k", "3", "--max-new-tokens", "24"]
    assert main(["bench", "predicted-vs-decoded", *argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 3
    for r in res["rows"]:
        assert r["predicted_rounds"] == pytest.approx(r["decoded_rounds"])
    assert sum(r["decoded_rounds"] for r in res["rows"]) < sum(r["tokens"] for r in res["rows"])  # it accepts
    assert "rounds equal on 3/3 prompts" in capsys.readouterr().out
    # bad input: one line, exit 2, nothing written
    for extra, says in (
        (["--json", str(out)], "exists"),
        (["--head", str(tmp_path / "nope")], "not a drafter folder"),
        (["--k", "0"], "--k"),
    ):
        assert main(["bench", "predicted-vs-decoded", *argv, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and says in err and "\n" not in err
    medusa = tmp_path / "m"
    save_head(
        MedusaHeads.from_target(target, 3, 1), medusa, extra_json={ACCURACY_FILE: {"rank_accuracy": ACC}}
    )
    assert main(["bench", "predicted-vs-decoded", *argv, "--head", str(medusa)]) == 2
    assert "walks rounds" in capsys.readouterr().err
