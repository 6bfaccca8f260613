"""Medusa / EAGLE modules, losses, save/load and trees on tiny random models (fast, CPU)."""

import json

import pytest
import torch

from draftsmith.acceptance import tau_tree as expected_tau
from draftsmith.errors import DraftsmithError
from draftsmith.heads import EagleHead, MedusaHeads, load_head, save_head
from draftsmith.heads.eagle.losses import eagle3_loss, ttt_unroll
from draftsmith.heads.eagle.proposer import EagleProposer
from draftsmith.heads.hidden import target_features
from draftsmith.heads.medusa.trees import medusa_tree, tree_parents
from draftsmith.heads.recipe import LossSection
from draftsmith.testing import tiny_llama

AUX = [0, 1, 2]


def _eagle3(target, v_d=200, seed=0):
    torch.manual_seed(seed)
    ids = torch.sort(torch.randperm(target.config.vocab_size)[:v_d]).values
    ids[:3] = torch.tensor([0, 1, 2])  # specials kept
    ids = torch.sort(torch.unique(ids)).values
    return EagleHead.from_target(target, "eagle3", draft_vocab_ids=ids, aux_layers=AUX)


def _randomize(head, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return head


def test_medusa_layers_are_distinct_modules_and_start_as_the_target_head(tiny_target):
    heads = MedusaHeads.from_target(tiny_target, num_heads=3, num_layers=2)
    lins = [lin for blk in heads.blocks for lin in blk.layers]
    assert len({id(m) for m in lins}) == 6 and len({m.weight.data_ptr() for m in lins}) == 6
    with torch.no_grad():
        lins[0].weight.add_(1.0)  # training one block must not move another (the `[ResBlock] * n` bug)
    assert all(float(m.weight.detach().abs().sum()) == 0 for m in lins[1:])
    with torch.no_grad():
        lins[0].weight.zero_()
    ids = torch.randint(3, 300, (1, 7))
    out = tiny_target(ids, output_hidden_states=True)
    logits = heads(out.hidden_states[-1])  # zero-init blocks: every head == the target's lm_head
    for k in range(3):
        torch.testing.assert_close(logits[k], out.logits, rtol=1e-5, atol=1e-5)


def test_medusa_loss_labels_are_t_plus_2_plus_k(tiny_target):
    heads = MedusaHeads.from_target(tiny_target, num_heads=2, num_layers=1)
    h = torch.randn(1, 6, 64)
    ids = torch.randint(3, 300, (1, 6))
    mask = torch.ones_like(ids)
    loss, m = heads.loss(h, ids, mask, decay=0.5)
    lg = heads(h)
    ce0 = torch.nn.functional.cross_entropy(lg[0, 0, :4], ids[0, 2:])
    ce1 = torch.nn.functional.cross_entropy(lg[1, 0, :3], ids[0, 3:])
    torch.testing.assert_close(loss, ce0 + 0.5 * ce1, rtol=1e-5, atol=1e-5)
    assert set(m) >= {"head0/top1", "head1/top5", "head1/ce"}


def test_medusa_self_distillation_labels_are_the_target_distribution_at_t_plus_1_plus_k(tiny_target):
    """loss.medusa_labels=target: head k at t learns softmax(W f_{t+1+k}); its top-1 metric is agreement with
    the target's argmax there (what greedy verification accepts), whatever the data's own tokens are."""
    heads = MedusaHeads.from_target(tiny_target, num_heads=2, num_layers=1)
    _ = [torch.nn.init.normal_(blk.layers[0].weight, 0, 0.3) for blk in heads.blocks]
    w = tiny_target.get_output_embeddings().weight.detach()
    h = torch.randn(1, 7, 64)
    ids = torch.randint(3, 300, (1, 7))
    mask = torch.ones_like(ids)
    loss, m = heads.loss(h, ids, mask, decay=0.5, target_head=w)
    lg = heads(h)
    want, hits = 0.0, []
    for k, n in ((0, 5), (1, 4)):
        p = torch.softmax(h[0, 1 + k : 1 + k + n] @ w.T, -1)
        ce = -(p * torch.log_softmax(lg[k, 0, :n], -1)).sum(-1).mean()
        want = want + 0.5**k * ce
        hits.append(float((lg[k, 0, :n].argmax(-1) == p.argmax(-1)).float().mean()))
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert [m["head0/top1"], m["head1/top1"]] == pytest.approx(hits)
    # the data's tokens are not labels: changing them (same mask) leaves the loss unchanged
    loss2, _ = heads.loss(h, torch.randint(3, 300, (1, 7)), mask, decay=0.5, target_head=w)
    torch.testing.assert_close(loss2, loss)
    loss.backward()
    assert heads.blocks[1].layers[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_save_load_round_trip_reproduces_logits(tiny_target, tmp_path, kind):
    if kind == "medusa":
        head = _randomize(MedusaHeads.from_target(tiny_target, 2, 2))
    elif kind == "eagle":
        head = _randomize(EagleHead.from_target(tiny_target, "eagle"))
    else:
        head = _randomize(_eagle3(tiny_target))
    save_head(head, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["draftsmith_head_type"] == kind and cfg["target"]["hidden_size"] == 64
    loaded = load_head(tmp_path / "h", tiny_target)
    assert type(loaded) is type(head)
    x = torch.randn(1, 5, 64)
    if kind == "medusa":
        torch.testing.assert_close(loaded(x), head(x))
        return
    ids = torch.randint(3, 300, (1, 5))
    feats = target_features(tiny_target, ids, torch.ones_like(ids), AUX if kind == "eagle3" else [])
    hid = feats["aux"] if kind == "eagle3" else feats["last"]
    a = [
        o
        for _, o in ttt_unroll(
            head.eval(), tiny_target.model.embed_tokens.weight, hid, ids, torch.ones_like(ids), 2
        )
    ]
    b = [
        o
        for _, o in ttt_unroll(
            loaded, tiny_target.model.embed_tokens.weight, hid, ids, torch.ones_like(ids), 2
        )
    ]
    for x1, x2 in zip(a, b):
        torch.testing.assert_close(
            head.logits(x1, tiny_target.lm_head.weight), loaded.logits(x2, tiny_target.lm_head.weight)
        )
    if kind == "eagle3":
        assert torch.equal(loaded.vocab_ids, head.vocab_ids) and loaded.t2d.sum() == head.d2t.numel()


def test_eagle3_native_tensor_names(tiny_target):
    names = set(_eagle3(tiny_target).state_dict())
    want = {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.post_attention_layernorm.weight",
    }
    want |= {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")
    }
    assert names == want
    head = _eagle3(tiny_target)
    assert head.fc.weight.shape == (64, 3 * 64) and head.midlayer.self_attn.q_proj.weight.shape[1] == 128
    assert torch.equal(head.d2t + torch.arange(head.d2t.numel()), head.vocab_ids)


def test_draft_vocab_is_set_under_another_default_device(tiny_target):
    """Cost models build heads inside `with torch.device("cuda")`: the vocabulary maps are index metadata built on
    the CPU, so a default device set around the call must not put half of that arithmetic elsewhere (the first GPU
    check failed this way: cuda:0 and cpu). A meta default device reproduces that mix on the CPU."""
    head = _eagle3(tiny_target)
    want_d2t, want_t2d = head.d2t.clone(), head.t2d.clone()
    head.d2t.zero_(), head.t2d.zero_()
    with torch.device("meta"):
        head.set_draft_vocab(want_d2t + torch.arange(want_d2t.numel(), device="cpu"))
    assert torch.equal(head.d2t, want_d2t) and torch.equal(head.t2d, want_t2d)


def test_head_refuses_another_target(tiny_target, tmp_path):
    save_head(MedusaHeads.from_target(tiny_target, 2, 1), tmp_path / "h")
    other = tiny_llama(seed=5)  # same shapes, different weights
    with pytest.raises(DraftsmithError, match="weights differ"):
        load_head(tmp_path / "h", other)
    bigger = tiny_llama(seed=0, num_hidden_layers=3)
    with pytest.raises(DraftsmithError, match="num_hidden_layers"):
        load_head(tmp_path / "h", bigger)


def test_load_rejects_bad_folders(tiny_target, tmp_path):
    with pytest.raises(DraftsmithError, match="not a head folder"):
        load_head(tmp_path, tiny_target)
    save_head(MedusaHeads.from_target(tiny_target, 2, 1), tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["num_heads"] = 3
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="tensor names"):
        load_head(tmp_path / "h", tiny_target)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_training_time_test_matches_decode_time_drafting(tiny_target, kind):
    """The TTT unroll (training) and the proposer's cached chain drafting (decode) compute the same thing: feed the
    proposer's own greedy chain back as teacher-forced tokens and the unroll must predict that chain."""
    head = _randomize(
        _eagle3(tiny_target) if kind == "eagle3" else EagleHead.from_target(tiny_target, "eagle")
    ).eval()
    layers = AUX if kind == "eagle3" else [2]
    prop = EagleProposer(head, tiny_target, top_k=1, depth=3, total_tokens=3)
    seen = []  # the head outputs the proposer turns into draft logits, depth by depth
    real_logp = prop._logp
    prop._logp = lambda out: (seen.append(out.reshape(-1, out.shape[-1])[0].clone()), real_logp(out))[1]
    ctx = torch.randint(3, 300, (1, 9))
    with torch.no_grad():
        hs = tiny_target(ctx, output_hidden_states=True).hidden_states
        prop.begin(ctx, tuple(hs[i][:, :-1] for i in layers))
        chain = prop.propose(3, None).tokens  # [1, 3]
        seq = torch.cat([ctx, chain], 1)
        feats = target_features(tiny_target, seq, torch.ones_like(seq), AUX if kind == "eagle3" else [])
        hid = feats["aux"] if kind == "eagle3" else feats["last"]
        col = ctx.shape[1] - 2  # last context entry: (feature at 7, token 8)
        for i, out in ttt_unroll(
            head, tiny_target.model.embed_tokens.weight, hid, seq, torch.ones_like(seq), 3
        ):
            torch.testing.assert_close(out[0, col], seen[i], rtol=2e-3, atol=2e-3)
            top = head.logits(out[0, col], tiny_target.lm_head.weight).argmax()
            tok = head.vocab_ids[top] if kind == "eagle3" else top
            assert int(tok) == int(chain[0, i]), f"depth {i + 1}"


def test_eagle_loss_backward_and_acceptance_metrics(tiny_target):
    head = _eagle3(tiny_target)
    ids = torch.randint(3, 300, (2, 10))
    am = torch.ones_like(ids)
    lm = am.clone()
    lm[:, :3] = 0
    feats = target_features(tiny_target, ids, am, AUX)
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm}
    loss, m = eagle3_loss(head.train(), tiny_target, feats, batch, LossSection(ttt_steps=3))
    loss.backward()
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    assert {"acc_0", "acc_2", "tau_sim", "loss_1"} <= set(m)
    assert 1.0 <= m["tau_sim"] <= 4.0
    # a "draft" that copies the target exactly has acceptance 1 at depth 0
    loss2, m2 = eagle3_loss(head, tiny_target, feats, batch, LossSection(ttt_steps=1, kind="tvd"))
    assert torch.isfinite(loss2)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_losses_depth0_acceptance_matches_an_independent_count(tiny_target, kind):
    import torch.nn.functional as F

    from draftsmith.heads.eagle.losses import EAGLE_LOSSES, shift_left

    torch.manual_seed(1)
    head = _randomize(
        _eagle3(tiny_target) if kind == "eagle3" else EagleHead.from_target(tiny_target, "eagle")
    )
    ids = torch.randint(3, 300, (2, 12))
    am, lm = torch.ones_like(ids), torch.ones_like(ids)
    lm[:, :2] = 0
    feats = target_features(tiny_target, ids, am, AUX if kind == "eagle3" else None)
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm}
    loss, m = EAGLE_LOSSES[kind](head.eval(), tiny_target, feats, batch, LossSection(ttt_steps=2))
    assert torch.isfinite(loss) and loss > 0 and m["tau_sim"] >= 1.0
    # independently: the head's step-0 output at column t drafts x_{t+2}; the target's argmax at t+1 is the label
    with torch.no_grad():
        hidden = feats["aux"] if kind == "eagle3" else feats["last"]
        _, out = next(iter(ttt_unroll(head, tiny_target.model.embed_tokens.weight, hidden, ids, am, 1)))
        if kind == "eagle3":
            draft_top = head.vocab_ids[head.logits(out).argmax(-1)]
        else:
            draft_top = F.linear(out, tiny_target.lm_head.weight).argmax(-1)
        target_top = shift_left(
            F.linear(feats["last"], tiny_target.lm_head.weight).argmax(-1, keepdim=True), 1
        )
        valid = shift_left(lm, 2).bool()
        expect = float((draft_top[valid] == target_top[..., 0][valid]).float().mean())
    assert m["acc_0"] == pytest.approx(expect)
    assert m["top1_0"] == pytest.approx(expect)


def test_medusa_tree_from_accuracies():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    paths = medusa_tree(acc, 8)
    assert paths[0] == (0,) and len(paths) == 8
    parents = tree_parents(paths)
    assert all(p < i for i, p in enumerate(parents))
    # greedy choice: no unchosen frontier node is more probable than a chosen one
    assert expected_tau(paths, acc) > expected_tau([(0,), (0, 0), (0, 0, 0)], acc)
    assert expected_tau(paths, acc) == pytest.approx(
        1 + sum(__import__("math").prod(acc[j][r] for j, r in enumerate(p)) for p in paths)
    )
