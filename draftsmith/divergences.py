"""Token-level divergences between the target distribution and the draft distribution (DistillSpec, Zhou et al. 2024).

Notation, used once here and spelled out in names elsewhere: p = target distribution, q = draft distribution,
both softmax(logits / T) at the *decode* temperature T (T = 0, greedy, is not differentiable, so the losses use
T = 1 then; greedy acceptance is what `draftsmith.distill.metrics` reports).

    fkl             KL(p || q)                       mode-covering
    rkl             KL(q || p)                       mode-seeking
    jsd             beta KL(p || m) + (1 - beta) KL(q || m),   m = beta p + (1 - beta) q     (generalised JSD)
    tvd             1/2 sum |p - q|  = 1 - alpha                the acceptance gap itself
    neg_log_accept  -log alpha,      alpha = sum min(p, q)      ("LK" loss)
    lk              lam KL(p || q) + (1 - lam) TVD,  lam = exp(-3 alpha) (detached)   ("LK" loss)
    soft_ce         -sum p log q  = KL(p || q) + H(p)          the heads' native loss (EAGLE-3); not a divergence:
                                                                 its value at q = p is H(p), its gradient fkl's

JSD endpoint convention (the one DistillSpec/GKD use): JSD(beta) -> 0 at both beta = 0 and beta = 1, and
    JSD(beta) / beta        -> KL(p || q)  as beta -> 0   (FKL-like)
    JSD(beta) / (1 - beta)  -> KL(q || p)  as beta -> 1   (RKL-like)
(expand KL(q || m) to second order in beta). The endpoints themselves are degenerate, so beta must lie in (0, 1);
use kind="fkl" / "rkl" for the limits.

Reduced draft vocabulary (`vocab_ids` [V_d], sorted target ids of the draft's output rows): q is zero outside
vocab_ids. KL-type losses (fkl, rkl, jsd and the KL term of lk) use p restricted to vocab_ids and renormalised
(EAGLE-3 convention; KL(p || q) with the full p would be infinite). Acceptance-type losses (tvd, neg_log_accept and
the TVD term / lambda of lk) use the exact full-vocabulary p, so alpha = sum_{x in V_d} min(p(x), q(x)) is the true
acceptance rate and the out-of-vocabulary target mass counts fully towards TVD. The KL-type losses and soft_ce read
the target at the draft's ids only, so their callers may pass just those columns ([n, V_d], the cheaper product
through the draft vocabulary's rows of the lm_head); `LOSSES[kind].full_target` says which losses need [n, V].

Memory: rows are processed `chunk_size` at a time under `torch.utils.checkpoint`, so at most chunk_size x V fp32
intermediates are alive at once, in the forward and in the backward pass.

Cached top-k targets (`fkl_from_topk`): when p is known only through the target's k largest logits per token (the
rest at probability 0), KL(p || q) = sum_k p_k (log p_k - z_k / T) + logsumexp(z / T) over the draft's logits z:
one pass over V instead of building the dense [n, V] target and the several dense passes of `fkl`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from draftsmith.errors import DraftsmithError

DivergenceKind = Literal["fkl", "rkl", "jsd", "tvd", "neg_log_accept", "lk"]
LossKind = Literal["soft_ce", DivergenceKind]
"""Every entry of LOSSES: the divergences and soft_ce (what a heads recipe's loss.kind takes)."""

# below this, -log(alpha) is clamped: a draft with zero overlap has no useful gradient anyway
_MIN_ALPHA = 1e-12


def _target_logp_restricted(target_logits: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """log p over the draft's support, renormalised there (EAGLE-3 convention). [n, V] -> [n, V_d]."""
    if vocab_ids is not None:
        target_logits = target_logits.index_select(-1, vocab_ids)
    return F.log_softmax(target_logits, dim=-1)


def _target_probs_exact(
    target_logits: torch.Tensor, vocab_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact full-vocab p on the draft's support [n, V_d] and the target mass outside it [n]."""
    if vocab_ids is None:
        probs = F.softmax(target_logits, dim=-1)
        return probs, probs.new_zeros(probs.shape[0])
    log_z = torch.logsumexp(target_logits, dim=-1, keepdim=True)
    kept = target_logits.index_select(-1, vocab_ids)
    probs_on = torch.exp(kept - log_z)
    # 1 - mass_in, computed as -expm1(log mass_in) to keep precision when nearly all mass is inside
    log_mass_in = (torch.logsumexp(kept, dim=-1, keepdim=True) - log_z).squeeze(-1)
    return probs_on, -torch.expm1(log_mass_in)


def _kl(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row from log-probabilities [n, V] -> [n] (logits are assumed finite)."""
    return (logp_a.exp() * (logp_a - logp_b)).sum(-1)


def _fkl(t, d, vocab_ids, beta):
    return _kl(_target_logp_restricted(t, vocab_ids), F.log_softmax(d, dim=-1))


def _rkl(t, d, vocab_ids, beta):
    return _kl(F.log_softmax(d, dim=-1), _target_logp_restricted(t, vocab_ids))


def _jsd(t, d, vocab_ids, beta):
    logp = _target_logp_restricted(t, vocab_ids)
    logq = F.log_softmax(d, dim=-1)
    # log m = log(beta p + (1 - beta) q), stably
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    return beta * _kl(logp, logm) + (1.0 - beta) * _kl(logq, logm)


def _tvd_alpha(t, d, vocab_ids) -> tuple[torch.Tensor, torch.Tensor]:
    probs_on, mass_out = _target_probs_exact(t, vocab_ids)
    draft_probs = F.softmax(d, dim=-1)
    # TVD = 1/2 (sum_{V_d} |p - q| + sum_{outside} p), since q = 0 outside V_d
    tvd = 0.5 * ((probs_on - draft_probs).abs().sum(-1) + mass_out)
    alpha = torch.minimum(probs_on, draft_probs).sum(-1)
    return tvd, alpha


def _tvd(t, d, vocab_ids, beta):
    return _tvd_alpha(t, d, vocab_ids)[0]


def _neg_log_accept(t, d, vocab_ids, beta):
    probs_on, _ = _target_probs_exact(t, vocab_ids)
    alpha = torch.minimum(probs_on, F.softmax(d, dim=-1)).sum(-1)
    return -torch.log(alpha.clamp_min(_MIN_ALPHA))


def _lk(t, d, vocab_ids, beta):
    tvd, alpha = _tvd_alpha(t, d, vocab_ids)
    # lam = exp(-3 alpha), detached: KL dominates while acceptance is low, TVD takes over as it rises
    lam = torch.exp(-3.0 * alpha.detach())
    return lam * _fkl(t, d, vocab_ids, beta) + (1.0 - lam) * tvd


def _soft_ce(t, d, vocab_ids, beta):
    # p restricted to the draft's ids and renormalised, as fkl: KL(p || q) + H(p), the same gradient
    return -(_target_logp_restricted(t, vocab_ids).exp() * F.log_softmax(d, dim=-1)).sum(-1)


_RowLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]


@dataclass(frozen=True)
class Loss:
    """One entry of LOSSES: the per-row loss and what it reads of the target."""

    rows: _RowLoss
    """(target logits [n, V] (or [n, V_d] where full_target is False), draft logits [n, V_d], vocab_ids or None,
    beta) -> per-row loss [n], at the temperature already applied."""
    full_target: bool
    """It reads the target's probability outside the draft's ids (the acceptance-type losses): the caller passes
    the target's logits over its full vocabulary. False: only the target's logits at the draft's ids matter."""
    divergence: bool = True
    """Zero exactly when the draft equals the target (soft_ce is a cross-entropy: H(p) there)."""

    def __call__(self, t, d, vocab_ids, beta) -> torch.Tensor:
        return self.rows(t, d, vocab_ids, beta)


LOSSES: dict[str, Loss] = {
    "fkl": Loss(_fkl, full_target=False),
    "rkl": Loss(_rkl, full_target=False),
    "jsd": Loss(_jsd, full_target=False),
    "tvd": Loss(_tvd, full_target=True),
    "neg_log_accept": Loss(_neg_log_accept, full_target=True),
    "lk": Loss(_lk, full_target=True),
    "soft_ce": Loss(_soft_ce, full_target=False, divergence=False),
}


def loss_entry(kind: str) -> Loss:
    """LOSSES[kind], or one DraftsmithError line naming the valid kinds."""
    if kind not in LOSSES:
        raise DraftsmithError(f"unknown divergence {kind!r}; choose one of {', '.join(LOSSES)}")
    return LOSSES[kind]


def _chunk_sum(
    loss_fn: _RowLoss,
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    rows: torch.Tensor,
    vocab_ids: torch.Tensor | None,
    temperature: float,
    beta: float,
) -> torch.Tensor:
    # row selection, fp32 casts and every [n, V] intermediate live inside the checkpointed region
    t = target_logits.index_select(0, rows).float() / temperature
    d = draft_logits.index_select(0, rows).float() / temperature
    return loss_fn(t, d, vocab_ids, beta).sum()


def flatten_pair(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    mask: torch.Tensor | None,
    vocab_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check and flatten a (target, draft) logits pair: -> target [N, V], draft [N, V or V_d], the indices of
    the counted (unmasked) rows [n], vocab_ids on the right device. Shared by the losses and AcceptanceMeter."""
    vocab = target_logits.shape[-1]
    target_logits = target_logits.reshape(-1, vocab)
    draft_logits = draft_logits.reshape(-1, draft_logits.shape[-1])
    if draft_logits.shape[0] != target_logits.shape[0]:
        raise DraftsmithError(
            f"target and draft logits cover different token counts ({target_logits.shape[0]} vs "
            f"{draft_logits.shape[0]}); align them on the same positions before the loss"
        )
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(device=target_logits.device, dtype=torch.long)
        if vocab_ids.dim() != 1 or draft_logits.shape[-1] != vocab_ids.numel():
            raise DraftsmithError(
                f"draft logits have {draft_logits.shape[-1]} columns but vocab_ids has shape "
                f"{tuple(vocab_ids.shape)}; pass the draft's own draft_vocab ids"
            )
    elif draft_logits.shape[-1] != vocab:
        raise DraftsmithError(
            f"draft vocab {draft_logits.shape[-1]} != target vocab {vocab}; pass vocab_ids for a reduced-vocab draft"
        )
    if mask is None:
        rows = torch.arange(target_logits.shape[0], device=target_logits.device)
    else:
        mask = mask.reshape(-1)
        if mask.numel() != target_logits.shape[0]:
            raise DraftsmithError(f"mask has {mask.numel()} entries for {target_logits.shape[0]} tokens")
        rows = mask.to(target_logits.device).bool().nonzero().squeeze(-1)
    return target_logits, draft_logits, rows, vocab_ids


def divergence(
    kind: DivergenceKind,
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
    vocab_ids: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Mean per-token divergence D(p || q) over unmasked tokens -> scalar (float32).

    target_logits [N, V] (or [..., V]; treated as constants), draft_logits [N, V], or [N, V_d] with `vocab_ids`
    [V_d] the sorted target ids of the draft's rows; for a loss that reads the draft's ids only
    (not LOSSES[kind].full_target) target_logits may be those columns alone, [N, V_d]. mask [N] bool or 0/1
    (None = every token). `temperature` is the decode temperature (0 is treated as 1). `beta` is the JSD weight, in
    (0, 1). Returns 0 (still attached to the graph) when no token is unmasked.
    """
    loss_fn = loss_entry(kind)
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise DraftsmithError(
            f"jsd beta must be in (0, 1), got {beta}; for the endpoints use kind='fkl' (beta->0) or 'rkl' (beta->1)"
        )
    if temperature < 0:
        raise DraftsmithError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if chunk_size < 1:
        raise DraftsmithError(f"chunk_size must be >= 1, got {chunk_size}")
    temperature = 1.0 if temperature == 0 else float(temperature)

    if vocab_ids is not None and target_logits.shape[-1] == vocab_ids.numel():
        # the target's logits at the draft's ids already (or vocab_ids is every id, the same thing)
        if loss_fn.full_target and int(vocab_ids[-1]) >= vocab_ids.numel():
            raise DraftsmithError(
                f"{kind} reads the target's mass outside the draft's {vocab_ids.numel()} ids; pass the target's "
                "logits over its full vocabulary"
            )
        vocab_ids = None
    target_logits, draft_logits, rows, vocab_ids = flatten_pair(
        target_logits.detach(), draft_logits, mask, vocab_ids
    )
    n_tokens = rows.numel()
    if n_tokens == 0:
        return draft_logits.sum().float() * 0.0

    use_ckpt = torch.is_grad_enabled() and draft_logits.requires_grad
    total = draft_logits.new_zeros((), dtype=torch.float32)
    for start in range(0, n_tokens, chunk_size):
        chunk = rows[start : start + chunk_size]
        args = (loss_fn, target_logits, draft_logits, chunk, vocab_ids, temperature, beta)
        if use_ckpt:
            total = total + checkpoint(_chunk_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_sum(*args)
    return total / n_tokens


# rows per block of the fused top-k KL: ~4 MB of fp32 logits, which stay in cache; whole [N, V] temporaries are
# several times slower on a CPU (measured: logsumexp over 520 x 151,936 logits 237 ms at once, 57 ms in 8-row blocks)
_BLOCK_ELEMENTS = 1 << 20


class _FklTopk(torch.autograd.Function):
    """sum over rows of KL(p || softmax(z / T)), p given at columns `cols` as log p (-inf: probability 0), in blocks
    of `block` rows. The forward keeps the logsumexp per row only; the backward forms softmax(z / T) once:
    d/dz = (mass q - p) / T."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, logp: torch.Tensor, cols: torch.Tensor, temperature: float, block: int):
        p = logp.exp()
        mass = p.sum(-1, keepdim=True)  # 1, or 0 for a row without p
        lse = z.new_empty((z.shape[0], 1), dtype=torch.float32)
        picked = p.new_empty(p.shape)
        for b in range(0, z.shape[0], block):
            d = z[b : b + block].float() / temperature  # a new tensor even when z is float32 already
            lse[b : b + block] = torch.logsumexp(d, dim=-1, keepdim=True)
            picked[b : b + block] = d.gather(1, cols[b : b + block])
        loss = torch.where(p > 0, p * logp, 0.0).sum() - (p * picked).sum() + (mass * lse).sum()
        ctx.save_for_backward(z, lse, p, cols, mass)
        ctx.temperature, ctx.block = temperature, block
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        z, lse, p, cols, mass = ctx.saved_tensors
        scale = grad_out / ctx.temperature
        grad = torch.empty_like(z)
        for b in range(0, z.shape[0], ctx.block):
            part = slice(b, b + ctx.block)
            g = (z[part].float() / ctx.temperature).sub_(lse[part]).exp_().mul_(mass[part])
            grad[part] = g.scatter_add_(1, cols[part], -p[part]).mul_(scale)
        return grad, None, None, None, None


def fkl_from_topk(
    values: torch.Tensor,
    ids: torch.Tensor,
    draft_logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    columns: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> torch.Tensor:
    """Mean KL(p || q) over N tokens, p given by the target's top-k logits: values [N, k] at target ids [N, k],
    every other id at probability 0; q = softmax(draft_logits [N, V_d] / T).

    Equals divergence("fkl", dense_from_topk(values, ids, ...), draft_logits, temperature=T) without building the
    dense target. `columns` [V] (target id -> draft column, -1 outside a reduced draft vocabulary) restricts p to
    the draft's support and renormalises it there (the `fkl` convention); a token none of whose top-k ids the
    draft can emit has no p there and adds 0 (the dense form would compare q with a uniform p instead).
    Rows go `block_rows` at a time (default: ~4 MB of fp32 logits), the only [rows, V] fp32 alive, forward or
    backward; nothing of [N, V] is kept for the backward beyond draft_logits itself."""
    if temperature < 0:
        raise DraftsmithError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if block_rows is not None and block_rows < 1:
        raise DraftsmithError(f"block_rows must be >= 1, got {block_rows}")
    if values.shape != ids.shape or values.dim() != 2 or values.shape[0] != draft_logits.shape[0]:
        raise DraftsmithError(
            f"top-k values {tuple(values.shape)} and ids {tuple(ids.shape)} must both be [N, k] with N = the "
            f"draft logits' {draft_logits.shape[0]} rows; align them on the same positions before the loss"
        )
    temperature = 1.0 if temperature == 0 else float(temperature)
    n_tokens = values.shape[0]
    if n_tokens == 0:
        return draft_logits.sum().float() * 0.0
    cols = ids.long().to(draft_logits.device)
    scaled = values.detach().float().to(draft_logits.device) / temperature
    if columns is not None:
        cols = columns.to(draft_logits.device)[cols]
        scaled = scaled.masked_fill(cols < 0, float("-inf"))
        has_p = (cols >= 0).any(-1, keepdim=True)
        scaled = torch.where(has_p, scaled, 0.0)  # no kept id: any finite p, weighted 0 below
        logp = torch.log_softmax(scaled, dim=-1).masked_fill(~has_p, float("-inf"))
        cols = cols.clamp_min(0)
    else:
        logp = torch.log_softmax(scaled, dim=-1)
    block = block_rows or max(1, _BLOCK_ELEMENTS // draft_logits.shape[-1])
    return _FklTopk.apply(draft_logits, logp, cols, temperature, block) / n_tokens
