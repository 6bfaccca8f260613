import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.divergences import LOSSES, divergence
from draftsmith.errors import DraftsmithError

KINDS = list(LOSSES)


def _logits(n=12, v=50, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


def _reference(kind, target_logits, draft_logits, beta=0.5, temperature=1.0):
    """Straightforward unchunked per-token formulas in float64, averaged over rows."""
    p = F.softmax(target_logits.double() / temperature, -1)
    q = F.softmax(draft_logits.double() / temperature, -1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)  # noqa: E731
    if kind == "fkl":
        per = kl(p, q)
    elif kind == "rkl":
        per = kl(q, p)
    elif kind == "jsd":
        m = beta * p + (1 - beta) * q
        per = beta * kl(p, m) + (1 - beta) * kl(q, m)
    elif kind == "tvd":
        per = 0.5 * (p - q).abs().sum(-1)
    elif kind == "neg_log_accept":
        per = -torch.minimum(p, q).sum(-1).log()
    elif kind == "lk":
        alpha = torch.minimum(p, q).sum(-1)
        lam = torch.exp(-3 * alpha)
        per = lam * kl(p, q) + (1 - lam) * 0.5 * (p - q).abs().sum(-1)
    elif kind == "soft_ce":
        per = -(p * q.log()).sum(-1)
    return per.mean()


@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference_formula(kind):
    t, d = _logits(seed=0), _logits(seed=1)
    for temperature in (1.0, 0.7):
        got = divergence(kind, t, d, temperature=temperature, beta=0.3)
        want = _reference(kind, t, d, beta=0.3, temperature=temperature)
        assert got.dtype == torch.float32 and got.dim() == 0
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-6), (kind, temperature)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_on_equal_and_nonnegative(kind):
    t = _logits(seed=2)
    # soft_ce is a cross-entropy, not a divergence: at q = p it is the target's entropy H(p)
    floor = (
        0.0 if LOSSES[kind].divergence else float(-(F.softmax(t, -1) * F.log_softmax(t, -1)).sum(-1).mean())
    )
    assert (divergence(kind, t, t.clone()) - floor).abs() < 1e-5
    for seed in range(3, 8):
        assert divergence(kind, t, _logits(seed=seed)) > floor


def test_soft_ce_is_fkl_plus_the_target_entropy_with_fkls_gradient():
    """The heads' native loss as an entry of the table: -sum p log q = KL(p || q) + H(p), p restricted to the
    draft's ids and renormalised, at the loss temperature; the target's logits may be given at those ids alone."""
    t, d_reduced, vocab_ids = _reduced_case(seed=3)
    for temperature in (1.0, 0.7):
        p_r = F.softmax(t[:, vocab_ids].double() / temperature, -1)
        entropy = -(p_r * p_r.log()).sum(-1).mean()
        x, y = d_reduced.clone().requires_grad_(True), d_reduced.clone().requires_grad_(True)
        ce = divergence("soft_ce", t, x, vocab_ids=vocab_ids, temperature=temperature)
        fkl = divergence("fkl", t, y, vocab_ids=vocab_ids, temperature=temperature)
        assert torch.allclose(ce.double(), fkl.double() + entropy, atol=1e-5)
        ce.backward()
        fkl.backward()
        assert torch.allclose(x.grad, y.grad, atol=1e-7)
        on_ids = divergence(
            "soft_ce", t[:, vocab_ids], d_reduced, vocab_ids=vocab_ids, temperature=temperature
        )
        assert torch.allclose(on_ids, ce.detach(), atol=1e-6)
    with pytest.raises(DraftsmithError, match="full vocabulary"):  # an acceptance loss needs the mass outside
        divergence("tvd", t[:, vocab_ids], d_reduced, vocab_ids=vocab_ids)


def test_temperature_zero_is_treated_as_one():
    t, d = _logits(seed=0), _logits(seed=1)
    assert torch.equal(divergence("fkl", t, d, temperature=0.0), divergence("fkl", t, d, temperature=1.0))


def test_fkl_gradient_matches_kl_div():
    t, d = _logits(seed=0), _logits(seed=1)
    d1 = d.clone().requires_grad_(True)
    divergence("fkl", t, d1).backward()
    d2 = d.clone().requires_grad_(True)
    # kl_div(input=log q, target=log p, log_target) = sum p (log p - log q); batchmean divides by N
    F.kl_div(F.log_softmax(d2, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean").backward()
    assert torch.allclose(d1.grad, d2.grad, atol=1e-6)


def test_rkl_gradient_matches_kl_div():
    t, d = _logits(seed=0), _logits(seed=1)
    d1 = d.clone().requires_grad_(True)
    divergence("rkl", t, d1).backward()
    d2 = d.clone().requires_grad_(True)
    F.kl_div(F.log_softmax(t, -1), F.log_softmax(d2, -1), log_target=True, reduction="batchmean").backward()
    assert torch.allclose(d1.grad, d2.grad, atol=1e-6)


def test_target_gets_no_gradient():
    t = _logits(seed=0).requires_grad_(True)
    d = _logits(seed=1).requires_grad_(True)
    divergence("jsd", t, d).backward()
    assert t.grad is None and d.grad is not None


def _grad(kind, target_logits, draft_logits, beta=0.5, scale=1.0):
    x = draft_logits.clone().requires_grad_(True)
    (divergence(kind, target_logits, x, beta=beta) / scale).backward()
    return x.grad


def test_jsd_endpoints_scale_to_fkl_and_rkl():
    # JSD(beta) = beta KL(p||q) + O(beta^2): JSD/beta -> FKL as beta->0 and JSD/(1-beta) -> RKL as beta->1,
    # in value and in gradient (float32 limits how small beta can go before cancellation noise takes over)
    t, d = _logits(seed=0, scale=1.0), _logits(seed=1, scale=1.0)
    fkl, rkl = divergence("fkl", t, d), divergence("rkl", t, d)
    g_fkl, g_rkl = _grad("fkl", t, d), _grad("rkl", t, d)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    errors = []
    for eps in (1e-2, 1e-4):
        assert abs(divergence("jsd", t, d, beta=eps).item() / eps / fkl.item() - 1) < 4 * eps + 1e-3
        assert abs(divergence("jsd", t, d, beta=1 - eps).item() / eps / rkl.item() - 1) < 4 * eps + 1e-3
        errors.append(
            (rel(_grad("jsd", t, d, eps, eps), g_fkl), rel(_grad("jsd", t, d, 1 - eps, eps), g_rkl))
        )
    assert errors[1][0] < 5e-3 and errors[1][1] < 5e-3
    assert (
        errors[1][0] < errors[0][0] / 10 and errors[1][1] < errors[0][1] / 10
    )  # converging, not coincidence
    # in between it is bounded by log 2 and by both KLs
    mid = divergence("jsd", t, d, beta=0.5)
    assert 0 < mid < min(fkl, rkl) and mid <= math.log(2) + 1e-6


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.1])
def test_jsd_rejects_degenerate_beta(beta):
    with pytest.raises(DraftsmithError, match="fkl"):
        divergence("jsd", _logits(), _logits(seed=1), beta=beta)


@pytest.mark.parametrize("kind", KINDS)
def test_masked_tokens_contribute_nothing(kind):
    t, d = _logits(seed=0), _logits(seed=1)
    mask = torch.tensor([1, 0] * 6, dtype=torch.bool)
    garbage = d.clone()
    garbage[~mask] = torch.randn_like(garbage[~mask]) * 50  # masked rows may hold anything
    x = garbage.clone().requires_grad_(True)
    loss = divergence(kind, t, x, mask)
    assert torch.allclose(loss, divergence(kind, t[mask], d[mask]), atol=1e-6)
    loss.backward()
    assert torch.all(x.grad[~mask] == 0) and x.grad[mask].abs().sum() > 0
    # 0/1 integer masks and leading [B, T] dims are accepted
    loss2 = divergence(kind, t.view(3, 4, -1), garbage.view(3, 4, -1), mask.long().view(3, 4))
    assert torch.allclose(loss, loss2, atol=1e-6)


def test_all_masked_is_zero_with_graph():
    d = _logits(seed=1).requires_grad_(True)
    loss = divergence("fkl", _logits(), d, torch.zeros(12, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(d.grad == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_equals_unchunked(kind):
    t, d = _logits(n=37, seed=0), _logits(n=37, seed=1)
    mask = torch.rand(37, generator=torch.Generator().manual_seed(0)) > 0.3
    results = []
    for chunk in (1000, 5):
        x = d.clone().requires_grad_(True)
        loss = divergence(kind, t, x, mask, chunk_size=chunk, temperature=0.8)
        loss.backward()
        results.append((loss.detach(), x.grad))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-7)


def test_chunking_bounds_saved_memory():
    # with checkpointing the graph keeps references to the inputs (shared storage), not chunk x V intermediates
    from torch.autograd.graph import saved_tensors_hooks

    n, v, chunk = 64, 400, 8
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    def saved_bytes(chunk_size):
        storages.clear()
        t, d = _logits(n=n, v=v, seed=0), _logits(n=n, v=v, seed=1).requires_grad_(True)
        with saved_tensors_hooks(pack, lambda x: x):
            divergence("jsd", t, d, chunk_size=chunk_size)
        return sum(storages.values()) - 2 * n * v * 4  # minus the two input tensors

    # beyond the inputs, only O(n) bookkeeping survives the forward pass, however many chunks
    assert saved_bytes(chunk) < n * v
    # sanity check of the measurement: without checkpointing (plain autograd) the intermediates are kept
    t, d = _logits(n=n, v=v, seed=0), _logits(n=n, v=v, seed=1).requires_grad_(True)
    storages.clear()
    with saved_tensors_hooks(pack, lambda x: x):
        LOSSES["jsd"](t, d, None, 0.5).sum()
    assert sum(storages.values()) > 4 * n * v * 4


# ---- reduced vocabulary -----------------------------------------------------------------------------------


def _reduced_case(seed=0, n=10, v=60, vd=20):
    g = torch.Generator().manual_seed(seed)
    vocab_ids = torch.sort(torch.randperm(v, generator=g)[:vd]).values
    t = torch.randn(n, v, generator=g) * 2
    d_reduced = torch.randn(n, vd, generator=g) * 2
    return t, d_reduced, vocab_ids


def test_reduced_vocab_alpha_is_exact():
    t, d_reduced, vocab_ids = _reduced_case()
    # full-vocab draft with q scattered back (zero outside vocab_ids)
    d_full = torch.full((t.shape[0], t.shape[1]), float("-inf"))
    d_full[:, vocab_ids] = d_reduced
    p, q = F.softmax(t, -1), F.softmax(d_full, -1)
    alpha = torch.minimum(p, q).sum(-1)
    tvd = 0.5 * (p - q).abs().sum(-1)
    got_nla = divergence("neg_log_accept", t, d_reduced, vocab_ids=vocab_ids)
    got_tvd = divergence("tvd", t, d_reduced, vocab_ids=vocab_ids)
    assert torch.allclose(got_nla, -alpha.log().mean(), atol=1e-6)
    assert torch.allclose(got_tvd, tvd.mean(), atol=1e-6)
    assert torch.allclose(got_tvd, 1 - alpha.mean(), atol=1e-6)
    # lk: lambda from the exact alpha, KL term on the renormalised restricted p
    p_r = F.softmax(t[:, vocab_ids], -1)
    q_r = F.softmax(d_reduced, -1)
    lam = torch.exp(-3 * alpha)
    want_lk = (lam * (p_r * (p_r.log() - q_r.log())).sum(-1) + (1 - lam) * tvd).mean()
    assert torch.allclose(divergence("lk", t, d_reduced, vocab_ids=vocab_ids), want_lk, atol=1e-6)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd"])
def test_reduced_vocab_kl_uses_renormalised_target(kind):
    t, d_reduced, vocab_ids = _reduced_case(seed=1)
    got = divergence(kind, t, d_reduced, vocab_ids=vocab_ids)
    want = _reference(kind, t[:, vocab_ids], d_reduced)
    assert torch.allclose(got.double(), want, atol=1e-5)
    # a draft equal to the restricted target has zero KL-type loss but positive TVD (mass outside V_d)
    same = t[:, vocab_ids].clone()
    assert divergence(kind, t, same, vocab_ids=vocab_ids).abs() < 1e-5
    assert divergence("tvd", t, same, vocab_ids=vocab_ids) > 0.01


def test_reduced_vocab_chunked_gradients_match():
    t, d_reduced, vocab_ids = _reduced_case(seed=2, n=25)
    grads = []
    for chunk in (1024, 4):
        x = d_reduced.clone().requires_grad_(True)
        divergence("lk", t, x, vocab_ids=vocab_ids, chunk_size=chunk).backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_bad_inputs_raise():
    t, d = _logits(), _logits(seed=1)
    with pytest.raises(DraftsmithError, match="unknown divergence"):
        divergence("kl", t, d)
    with pytest.raises(DraftsmithError, match="vocab_ids"):
        divergence("fkl", t, d[:, :10])
    with pytest.raises(DraftsmithError, match="vocab_ids"):
        divergence("fkl", t, d[:, :10], vocab_ids=torch.arange(11))
    with pytest.raises(DraftsmithError, match="token counts"):
        divergence("fkl", t, d[:5])
    with pytest.raises(DraftsmithError, match="mask"):
        divergence("fkl", t, d, torch.ones(3, dtype=torch.bool))


def test_bf16_inputs_computed_in_float32():
    t, d = _logits(seed=0), _logits(seed=1)
    got = divergence("fkl", t.bfloat16(), d.bfloat16())
    want = divergence("fkl", t.bfloat16().float(), d.bfloat16().float())
    assert got.dtype == torch.float32 and torch.allclose(got, want)


# --- gradient direction: one small step of each loss raises the acceptance rate alpha = sum min(p, q) -----------

# hand-made (target logits, draft logits) pairs over 6 tokens: the draft's mode elsewhere, a broad draft against a
# peaked target, a peaked draft against a broad target, and a near miss
DIRECTION_PAIRS = [
    ([4.0, 1.0, 0.0, 0.0, -1.0, -2.0], [0.0, 0.5, 3.0, 0.0, 0.0, 0.0]),
    ([5.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.2, 0.1, 0.0, 0.0, 0.1, 0.0]),
    ([1.0, 0.8, 0.6, 0.4, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 4.0]),
    ([2.0, 1.9, 0.0, -1.0, -1.0, -1.0], [1.9, 2.0, 0.0, -1.0, -1.0, -1.0]),
]


def _alpha(target_logits, draft_logits, temperature, vocab_ids=None):
    p = torch.softmax(target_logits / temperature, -1)
    q_small = torch.softmax(draft_logits / temperature, -1)
    q = torch.zeros_like(p)
    q[:, vocab_ids if vocab_ids is not None else slice(None)] = q_small
    return float(torch.minimum(p, q).sum(-1).mean())


def _step(loss_fn, draft, lr):
    draft = draft.clone().requires_grad_(True)
    loss_fn(draft).backward()
    g = draft.grad
    return (draft - lr * g / g.norm().clamp_min(1e-12)).detach()  # a fixed-length step along -gradient


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_a_step_of_each_loss_raises_alpha(kind, temperature):
    for target, draft in DIRECTION_PAIRS:
        t, d = torch.tensor([target]), torch.tensor([draft])
        before = _alpha(t, d, temperature)
        after = _alpha(
            t, _step(lambda x, t=t: divergence(kind, t, x, temperature=temperature), d, 0.05), temperature
        )
        assert after > before, (kind, target, draft, before, after)


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_a_step_raises_alpha_with_a_reduced_draft_vocab(kind):
    vocab_ids = torch.tensor([0, 2, 3, 5])  # the draft can only propose these ids
    raised = 0
    for target, draft in DIRECTION_PAIRS:
        t, d = torch.tensor([target]), torch.tensor([draft])[:, vocab_ids]
        before = _alpha(t, d, 1.0, vocab_ids)
        after = _alpha(
            t, _step(lambda x, t=t: divergence(kind, t, x, vocab_ids=vocab_ids), d, 0.05), 1.0, vocab_ids
        )
        # alpha can reach at most the target's mass on the draft's ids (q >= p there); at that ceiling (the near
        # miss: token 1 is out of reach) no step can raise it, and none may lower it
        ceiling = float(torch.softmax(t, -1)[0, vocab_ids].sum())
        if before < ceiling - 1e-6:
            assert after > before, (kind, target, draft, before, after)
            raised += 1
        else:
            assert after >= before - 1e-6, (kind, target, draft, before, after)
    assert raised == 3


def test_a_step_of_the_heads_soft_ce_raises_alpha():
    from draftsmith.heads.eagle.losses import soft_ce_through_head

    weight = torch.eye(6)  # logits = hidden states, so the pairs above are the head's logits
    for target, draft in DIRECTION_PAIRS:
        t, d = torch.tensor([target]), torch.tensor([draft])
        before = _alpha(t, d, 1.0)
        step = _step(lambda x, t=t: soft_ce_through_head(x, t, weight), d, 0.05)
        assert _alpha(t, step, 1.0) > before, (target, draft)


def test_warmup_schedule_picks_the_divergence_per_step():
    from draftsmith.distill.recipe import LossArgs
    from draftsmith.errors import DraftsmithError

    cfg = LossArgs(kind="tvd", warmup_kind="fkl", warmup_steps=3)
    assert [cfg.kind_at(s) for s in range(5)] == ["fkl", "fkl", "fkl", "tvd", "tvd"]
    assert [LossArgs(kind="lk").kind_at(s) for s in (0, 100)] == ["lk", "lk"]
    with pytest.raises(DraftsmithError, match="warmup_kind and loss.warmup_steps go together"):
        LossArgs(kind="tvd", warmup_steps=3)
    with pytest.raises(DraftsmithError, match="warmup_steps must be >= 0"):
        LossArgs(kind="tvd", warmup_kind="fkl", warmup_steps=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("reduced", [False, True])
def test_fkl_from_topk_equals_fkl_over_the_dense_top_k_target(temperature, reduced):
    # the oracle: the dense [N, V] target built from the same top-k, then the dense fkl; value and gradient
    from draftsmith.distill.policies import dense_from_topk
    from draftsmith.divergences import fkl_from_topk

    g = torch.Generator().manual_seed(3)
    vocab, n, k = 60, 9, 6
    values, ids = (torch.randn(n, vocab, generator=g) * 3).topk(k, dim=-1)
    values = values.half()  # as cached
    columns, d_vocab = None, vocab
    if reduced:  # some top-k ids fall outside the draft vocabulary (never the whole row here)
        vocab_ids = torch.tensor(sorted(set(ids[:, :2].flatten().tolist()) | {0, 5, 17}))
        columns = torch.full((vocab,), -1, dtype=torch.long)
        columns[vocab_ids] = torch.arange(vocab_ids.numel())
        d_vocab = vocab_ids.numel()
        assert (columns[ids] < 0).any()
    dense = dense_from_topk(values, ids.int(), d_vocab, columns)
    draft = (torch.randn(n, d_vocab, generator=g) * 2).requires_grad_(True)
    want = divergence("fkl", dense, draft, temperature=temperature)
    (want_grad,) = torch.autograd.grad(want, draft)
    for block in (None, 2):  # one block; blocks of 2 rows and a last one of 1
        got = fkl_from_topk(
            values, ids.int(), draft, temperature=temperature, columns=columns, block_rows=block
        )
        (got_grad,) = torch.autograd.grad(got, draft)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
    assert want > 0
    low = (
        draft.detach().bfloat16().requires_grad_(True)
    )  # the trainer's logits: the gradient comes back in bf16
    (low_grad,) = torch.autograd.grad(
        fkl_from_topk(values, ids, low, temperature=temperature, columns=columns), low
    )
    assert low_grad.dtype == torch.bfloat16
    torch.testing.assert_close(low_grad.float(), want_grad, atol=2e-3, rtol=2e-2)


def test_fkl_from_topk_row_the_draft_cannot_emit_adds_nothing():
    from draftsmith.divergences import fkl_from_topk

    values = torch.tensor([[2.0, 1.0], [3.0, 0.0]])
    ids = torch.tensor([[0, 1], [2, 3]])
    columns = torch.tensor([0, 1, -1, -1])  # row 1's ids are both outside the draft's two columns
    draft = torch.randn(2, 2, requires_grad=True)
    both = fkl_from_topk(values, ids, draft, columns=columns)
    first = fkl_from_topk(values[:1], ids[:1], draft[:1], columns=columns)
    torch.testing.assert_close(both, first / 2)  # the mean still counts the row
    (grad,) = torch.autograd.grad(both, draft)
    assert torch.isfinite(grad).all() and grad[1].abs().sum() == 0
    with pytest.raises(DraftsmithError, match=r"\[N, k\]"):
        fkl_from_topk(values, ids[:1], draft, columns=columns)
