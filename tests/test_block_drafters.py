"""Block-parallel drafters (DFlash, P-EAGLE): lossless decoding, training == decoding, losses, trees."""

import pytest
import torch

from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.heads.block.dflash import DFlashDrafter
from draftsmith.heads.block.losses import (
    cod_columns,
    dflash_forward,
    dflash_loss,
    peagle_forward,
    peagle_loss,
    sample_anchors,
)
from draftsmith.heads.block.peagle import PEagleHead
from draftsmith.heads.block.proposers import DFlashProposer, PEagleProposer, best_first_tree
from draftsmith.heads.eagle.model import EagleHead
from draftsmith.heads.hidden import target_features
from draftsmith.sampling import SamplingParams
from draftsmith.testing import assert_greedy_lossless

AUX = [0, 1, 2]


def _dflash(target, vocab=None, block=5, mask=3, layers=2, seed=0):
    torch.manual_seed(seed)
    v = target.config.vocab_size
    ids = torch.arange(0, v, 2) if vocab is None else vocab
    return DFlashDrafter.from_target(
        target, draft_vocab_ids=ids, mask_token_id=mask, block_size=block, num_layers=layers, aux_layers=AUX
    ).eval()


def _peagle(target, vocab=None, depths=4, mask=3, seed=0):
    torch.manual_seed(seed)
    v = target.config.vocab_size
    ids = torch.arange(0, v, 2) if vocab is None else vocab
    e3 = EagleHead.from_target(target, "eagle3", draft_vocab_ids=ids, aux_layers=AUX)
    return PEagleHead.from_target_head(e3, mask_token_id=mask, num_depths=depths).eval()


def _states(target, ids):
    with torch.inference_mode():
        return target(ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_output_equals_plain_decoding_chain_and_tree(tiny_target, k):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(k))
    d, p = _dflash(tiny_target), _peagle(tiny_target)
    props = {
        "dflash-chain": DFlashProposer(d, tiny_target),
        "dflash-tree": DFlashProposer(d, tiny_target, top_k=3, total_tokens=10),
        "peagle-chain": PEagleProposer(p, tiny_target),
        "peagle-tree": PEagleProposer(p, tiny_target, top_k=3, total_tokens=10),
    }
    for name, prop in props.items():
        (res,) = assert_greedy_lossless(dec, prop, [ids], k=k, max_new_tokens=24)
        if name.endswith("chain"):
            assert max(res.proposed) == k, name  # one forward drafts the whole depth
        else:
            assert max(res.proposed) <= k and max(res.proposed) > 1, name


def test_dflash_training_scores_what_the_proposer_proposes(tiny_target):
    """Block logits the trainer scores at anchor a == the proposer's logits after committing tokens 0..a, also
    when the context arrived in two pieces (begin, a propose whose block rows the next context write replaces,
    advance)."""
    d = _dflash(tiny_target)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    feats = target_features(tiny_target, ids, am, AUX)
    emb = tiny_target.get_input_embeddings().weight
    hs = _states(tiny_target, ids)
    for a, split in ((9, None), (14, 6)):
        with torch.no_grad():
            out = dflash_forward(d, emb, feats["aux"], ids, am, torch.tensor([[a]]))
            want = d.logits(out[0, 0, 1:])
        prop = DFlashProposer(d, tiny_target)
        if split is None:
            prop.begin(ids[:, : a + 1], tuple(h[:, :a] for h in (hs[i] for i in AUX)))
        else:
            prop.begin(ids[:, : split + 1], tuple(hs[i][:, :split] for i in AUX))
            prop.propose(4, SamplingParams())  # its block rows sit after the context until the next write
            prop.advance([0], ids[:, split + 1 : a + 1], tuple(hs[i][:, split:a] for i in AUX))
        chain = prop.propose(4, SamplingParams())
        assert torch.allclose(prop.last_logits, want, atol=1e-4)
        assert chain.tokens[0].tolist() == d.vocab_ids[want[:4].argmax(-1)].tolist()


def test_peagle_training_scores_what_the_proposer_proposes(tiny_target):
    p = _peagle(tiny_target, depths=4)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    feats = target_features(tiny_target, ids, am, AUX)
    emb = tiny_target.get_input_embeddings().weight
    lm = torch.ones_like(ids)
    cols = cod_columns(lm, 4, 1.0, 1.0)
    with torch.no_grad():
        out, bounds = peagle_forward(p, emb, feats["aux"], ids, am, cols)
    hs = _states(tiny_target, ids)
    for t in (5, 11):
        want = torch.stack(
            [
                p.logits(out[0, sl][(cols[d - 1] == t).nonzero()[0, 0]] if d else out[0, t])
                for d, sl in enumerate(bounds)
            ]
        )
        prop = PEagleProposer(p, tiny_target)
        prop.begin(ids[:, : t + 2], tuple(hs[i][:, : t + 1] for i in AUX))
        prop.propose(4, SamplingParams())
        assert torch.allclose(prop.last_logits, want, atol=1e-4)


def test_losses_train_and_report_per_position_acceptance(tiny_target):
    from draftsmith.heads.data import collate

    torch.manual_seed(0)
    d, p = _dflash(tiny_target, layers=1), _peagle(tiny_target)
    ex = [
        {"index": i, "input_ids": torch.randint(3, 300, (n,)).tolist(), "loss_mask": [0] * 4 + [1] * (n - 4)}
        for i, n in enumerate((24, 17))
    ]
    for e in ex:
        e["response_mask"] = e["loss_mask"]
    batch = collate(ex)
    feats = target_features(tiny_target, batch["input_ids"], batch["attention_mask"], AUX)
    emb, lmw = tiny_target.get_input_embeddings().weight, tiny_target.get_output_embeddings().weight
    for module, fn in ((d, dflash_loss), (p, peagle_loss)):
        module.train()
        opt = torch.optim.Adam([q for q in module.parameters() if q.requires_grad], lr=1e-2)
        first = None
        for _ in range(10):
            loss, m = fn(module, emb, lmw, feats, batch, generator=torch.Generator().manual_seed(0))
            opt.zero_grad()
            loss.backward()
            opt.step()
            first = first if first is not None else float(loss.detach())
        assert float(loss.detach()) < 0.8 * first, fn.__name__
        assert {"acc_0", "acc_1", "tau_sim"} <= set(m) and 1.0 <= m["tau_sim"]
    _, m = dflash_loss(d, emb, lmw, feats, batch, loss="tvd")  # an acceptance-tied divergence
    assert "acc_2" in m


def test_anchors_and_cod_columns_respect_the_loss_mask():
    lm = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]])
    a, ok = sample_anchors(lm, torch.tensor([6, 4]), 10, torch.Generator().manual_seed(0))
    for row in range(2):
        got = sorted(a[row][ok[row]].tolist())
        want = [x for x in range(1, 7) if x + 1 < [6, 4][row] and lm[row, x + 1]]
        assert got == want
    cols = cod_columns(torch.ones(1, 40, dtype=torch.long), 4, 0.5, 0.2, torch.Generator().manual_seed(0))
    for lo, hi in zip(cols, cols[1:]):
        assert set(hi.tolist()) <= set(lo.tolist())  # nested: lower placeholders of a kept draft exist
    assert len(cols[0]) < 40


def test_best_first_tree_is_closed_under_ancestors_and_ranked():
    logp = torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0], [1.0, 0.5, 0.0], [2.0, 0.0, -1.0]]), -1)
    nodes, parents = best_first_tree(logp, 2, 6)
    assert len(nodes) == 6 and parents[0] == -1
    assert all(p < i for i, p in enumerate(parents))
    assert nodes[0] == (0, 0) and all(
        nodes[i][0] == (nodes[p][0] + 1 if p >= 0 else 0) for i, p in enumerate(parents)
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "peagle"])
def test_sampled_block_drafts_keep_the_target_distribution(kind):
    """Temperature 1 on a 4-token vocabulary: the joint law of generated tokens 1-3 (2 and 3 drafted in one forward,
    sampled chain with q = the warped distribution actually sampled from) equals the target's exact law."""
    from draftsmith.testing import sampled_joint_tvd, tiny_llama

    target = tiny_llama(0, vocab_size=4)
    vocab = torch.arange(4)
    prop = (
        DFlashProposer(_dflash(target, vocab, block=3, mask=3, seed=5), target)
        if kind == "dflash"
        else PEagleProposer(_peagle(target, vocab, depths=2, mask=3, seed=5), target)
    )
    dec = SpeculativeDecoder(target, eos_ids=set())
    assert sampled_joint_tvd(dec, prop, torch.tensor([[1, 3, 0, 2]])) < 0.06
    # batch 2 (one drafter copy per row, decode.rowwise): the first row's law beside a longer prompt
    other = (torch.tensor([[2, 0, 1, 3, 3, 1]]),)
    assert sampled_joint_tvd(dec, prop, torch.tensor([[1, 3, 0, 2]]), batch_with=other) < 0.06


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_dirs):
    from draftsmith.prompts import Prompt
    from draftsmith.selfdistill import generate_dataset

    out = tmp_path_factory.mktemp("gen") / "data"
    prompts = [
        Prompt([{"role": "user", "content": f"Say {i} things about the sea."}], "chat", str(i))
        for i in range(8)
    ]
    generate_dataset(tiny_dirs["target"], prompts, out, max_new_tokens=20, batch_size=8, progress=False)
    return str(out)


def test_recipe_runs_share_the_eagle3_cache_and_decode_losslessly(tiny_dirs, generated, tmp_path):
    """EAGLE-3, DFlash and P-EAGLE train from one hidden-state cache; the saved folders decode losslessly through
    the drafter table (`dflash:DIR`, `peagle:DIR`) and report per-position held-out acceptance."""
    import json

    from draftsmith.app.drafters import build_proposer
    from draftsmith.config import load_config
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.heads.recipe import HeadsConfig, run_heads
    from draftsmith.models import load_model
    from draftsmith.trainer import make_accelerator

    cache = tmp_path / "cache"
    common = [
        f"model.target={tiny_dirs['target']}",
        f"data.source={generated}",
        "data.eval_size=1",
        "head.draft_vocab_size=128",
        "head.aux_layers=0,1,2",
        "train.batch_size=4",
        "train.max_steps=2",
        "loss.ttt_steps=2",
        "eval.depth=3",
        "data.max_length=160",
        "data.hidden_states=hybrid",
        f"data.hidden_cache={cache}",
        "train.log_every=1",
        "head.block_size=4",
        "head.num_depths=3",
        "loss.anchors=4",
    ]
    for kind in ("eagle3", "dflash", "peagle"):
        cfg = load_config(HeadsConfig, None, [*common, f"head.kind={kind}", f"output_dir={tmp_path / kind}"])
        s = run_heads(cfg, make_accelerator(cfg.train), progress=False)
        assert s["step"] == 2
    target = load_model(tiny_dirs["target"])
    ctx = DrafterContext(target, None, torch.device("cpu"))
    dec = SpeculativeDecoder(target, eos_ids=set())
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(3))
    plain = dec.generate(ids, None, max_new_tokens=16).tokens
    for kind, opts in (("dflash", ""), ("peagle", ",top_k=2,total_tokens=6")):
        final = tmp_path / kind / "final"
        acc = json.loads((final / "head_accuracy.json").read_text())
        assert acc["kind"] == kind and len(acc["acceptance_per_position"]) >= 2 and acc["tau_sim"] >= 1.0
        prop = build_proposer(f"{kind}:{final}{opts}", ctx)
        assert dec.generate(ids, prop, k=3, max_new_tokens=16).tokens == plain


def test_eval_cli_reports_alpha_per_position_for_block_drafters(tiny_dirs, tmp_path, capsys):
    import json

    from draftsmith.app.cli import main
    from draftsmith.heads import save_head
    from draftsmith.models import load_model

    target = load_model(tiny_dirs["target"], device="cpu")
    save_head(_dflash(target), tmp_path / "d")
    save_head(_peagle(target), tmp_path / "p")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"say {w}", "category": w}) for w in ("hi", "sea")) + "\n"
    )
    for spec in (f"dflash:{tmp_path / 'd'}", f"peagle:{tmp_path / 'p'},top_k=2,total_tokens=6"):
        out = tmp_path / spec.split(":")[0]
        args = [
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
        assert main(args) == 0
        res = json.loads((out / "eval.json").read_text())
        assert res["lossless"] is True and len(res["alpha_per_position"]) == 3
        assert set(res["per_category"]) == {"hi", "sea"} and (out / "eval.png").is_file()
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--target",
                tiny_dirs["target"],
                "--drafter",
                f"dflash:{tmp_path / 'd'},depth=2",
                "--prompts",
                str(prompts),
                "--no-progress",
            ]
        )
        == 2
    )  # one-line refusal of an unknown option
    assert "depth" in capsys.readouterr().err
