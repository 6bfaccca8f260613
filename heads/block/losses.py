"""Training losses of the block-parallel drafters (DFlash, P-EAGLE), with per-position acceptance.

Both score, at a draft position, exactly the logits the proposer computes there at decode time: the forward
functions below (dflash_forward, peagle_forward) are the decode-time forward with many drafts batched behind one
attention mask. Labels are the frozen target's distributions (self-distillation), scored by an entry of
draftsmith.divergences.LOSSES: soft_ce and the KL-type ones against the target restricted to the draft vocabulary
and renormalised, the acceptance-tied ones (tvd neg_log_accept lk) against the full target distribution.

DFlash (notation: ids x_0..x_{T-1}, f_s = target final state at s, whose logits predict x_{s+1}): a block anchored
at a (the token the target just emitted) sees context rows s < a; block row j predicts x_{a+j}, label = the target
distribution at a+j-1. Anchors are random trained positions (up to `anchors` per sequence). Per-position weight
w_j = exp(-(j-1)/gamma): position j only counts if positions < j were accepted, which happens with probability
~a^(j-1) for per-position acceptance a, i.e. gamma = -1/ln a (gamma 4 <-> a ~ 0.78, speculators' default for B=8;
DFlash uses 7 for B=16). The loss is the weighted mean over positions.
P-EAGLE: row (d, t) = depth d of the draft rooted at column t (d = 0: EAGLE-3's real row (g_t, x_{t+1}) at
position t; d >= 1: placeholder at position t+d) predicts x_{t+2+d}, label = target distribution at t+1+d. COD
sampling (P-EAGLE): depth d keeps a random max(ratio^d, ratio_min) share of the columns kept at depth d-1; the loss
is the mean over all kept rows.
Metrics: acc_j = P(draft argmax == target argmax at j | positions < j accepted) (measured when every position of a
draft is scored: DFlash always, P-EAGLE with cod_ratio 1), top1_j, tau_sim = 1 + sum_j prod_{i<=j} acc_i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.divergences import divergence, loss_entry
from draftsmith.heads.block.dflash import DFlashDrafter
from draftsmith.heads.block.peagle import PEagleHead
from draftsmith.heads.common import DepthAcceptance, shift_left
from draftsmith.heads.layers import rope_cos_sin


def sample_anchors(
    loss_mask: torch.Tensor, lengths: torch.Tensor, n: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block anchors: positions a >= 1 whose next token is trained. loss_mask [B, T] -> (anchors [B, n'],
    valid [B, n']) with n' = min(n, most valid positions in a row); missing anchors are padded (valid False)."""
    b, t = loss_mask.shape
    ok = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    ok[:, 1 : t - 1] = loss_mask[:, 2:].bool()
    ok &= torch.arange(t, device=loss_mask.device)[None] < (lengths[:, None] - 1)
    counts = ok.sum(1)
    m = int(min(n, int(counts.max()) if b else 0))
    if m == 0:
        return torch.ones(b, 1, dtype=torch.long, device=ok.device), torch.zeros(
            b, 1, dtype=torch.bool, device=ok.device
        )
    r = torch.rand(b, t, generator=generator).to(ok.device).masked_fill(~ok, 2.0)
    pick = r.argsort(1)[:, :m]  # valid positions first (random order), then invalid ones
    valid = torch.arange(m, device=ok.device)[None] < counts[:, None]
    return torch.where(valid, pick, torch.ones_like(pick)), valid


def dflash_forward(
    d: DFlashDrafter,
    embed_weight: torch.Tensor,
    aux: torch.Tensor,
    ids: torch.Tensor,
    am: torch.Tensor,
    anchors,
) -> torch.Tensor:
    """Blocks at `anchors` [B, n] in one forward. aux [B, T, n_aux*H_t] target features, ids/am [B, T].
    Returns the blocks' final states [B, n, block_size, H] (row j predicts x_{a+j})."""
    c = d.config
    b, t = ids.shape
    n, blk = anchors.shape[1], c.block_size
    dev, dtype = ids.device, d.fc.weight.dtype
    ctx = d.context(aux.to(dtype))
    cos, sin = rope_cos_sin(torch.arange(t, device=dev)[None].expand(b, t), c.head_dim, c.rope_theta, dtype)
    ctx_kv = d.context_kv(ctx, cos, sin)
    tok = torch.full((b, n, blk), c.mask_token_id, dtype=torch.long, device=dev)
    tok[..., 0] = ids.gather(1, anchors)
    embeds = F.embedding(tok.view(b, n * blk), embed_weight).to(dtype)
    pos = (anchors[..., None] + torch.arange(blk, device=dev)).view(b, n * blk)
    cos_b, sin_b = rope_cos_sin(pos, c.head_dim, c.rope_theta, dtype)
    ctx_ok = (torch.arange(t, device=dev)[None, None] < anchors[..., None]) & am.bool()[:, None]  # [B, n, T]
    blk_id = torch.arange(n * blk, device=dev) // blk
    same = (blk_id[:, None] == blk_id[None]).expand(b, -1, -1)
    mask = torch.cat([ctx_ok.repeat_interleave(blk, 1), same], -1)[:, None]
    return d.block(embeds, cos_b, sin_b, ctx_kv, mask).view(b, n, blk, -1)


def position_terms(
    draft_logits: torch.Tensor,
    tgt_rows: torch.Tensor,
    lm_weight: torch.Tensor,
    vocab_ids: torch.Tensor,
    *,
    loss: str = "soft_ce",
    temperature: float = 1.0,
    beta: float = 0.5,
    exact: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft position over N rows. draft_logits [N, V_d]; tgt_rows [N, H] target final states whose logits are the
    labels; lm_weight [V, H]. Returns (mean loss, draft argmax [N] target ids, target argmax [N])."""
    dtype = draft_logits.dtype
    full_target = loss_entry(loss).full_target  # soft_ce and the KL-type losses read the draft's ids only
    with torch.no_grad():
        w_d = lm_weight[vocab_ids].to(dtype)
        t_d = F.linear(tgt_rows.to(dtype), w_d)
        full = F.linear(tgt_rows.to(dtype), lm_weight.to(dtype)) if (exact or full_target) else None
        tgt_top = full.argmax(-1) if exact else vocab_ids[t_d.argmax(-1)]
    labels = (full if full_target else t_d).float()
    li = divergence(loss, labels, draft_logits, temperature=temperature, beta=beta, vocab_ids=vocab_ids)
    return li, vocab_ids[draft_logits.detach().argmax(-1)], tgt_top


def dflash_loss(
    d: DFlashDrafter,
    embed_weight: torch.Tensor,
    lm_weight: torch.Tensor,
    feats: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    *,
    anchors: int = 16,
    gamma: float = 4.0,
    loss: str = "soft_ce",
    temperature: float = 1.0,
    beta: float = 0.5,
    exact_acceptance: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DFlash training loss over random anchors (module docstring). feats: "aux" [B, T, n_aux*H_t], "last" [B, T, H];
    batch: input_ids, attention_mask, loss_mask, lengths. Returns (scalar loss, metrics)."""
    ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    b, t = ids.shape
    a, a_ok = sample_anchors(lm, batch["lengths"].to(ids.device), anchors, generator)
    out = dflash_forward(d, embed_weight, feats["aux"], ids, am, a)
    last = feats["last"]
    total = out.new_zeros((), dtype=torch.float32)
    wsum, metrics = 0.0, {}
    acc = DepthAcceptance(tuple(a.shape), ids.device)  # a draft = one block; position j-1 = its j-th token
    none = torch.zeros(0, dtype=torch.long, device=ids.device)
    for j in range(1, d.config.block_size):
        pos = a + j  # token predicted by block row j
        v = a_ok & (pos < t)
        v &= lm.gather(1, pos.clamp(max=t - 1)).bool()
        if not bool(v.any()):
            acc.update(j - 1, v, none, none)
            continue
        rows = out[:, :, j][v]
        tgt = last.gather(1, (pos - 1).clamp(max=t - 1)[..., None].expand(-1, -1, last.shape[-1]))[v]
        li, d_top, t_top = position_terms(
            d.logits(rows),
            tgt,
            lm_weight,
            d.vocab_ids,
            loss=loss,
            temperature=temperature,
            beta=beta,
            exact=exact_acceptance,
        )
        acc.update(j - 1, v, d_top, t_top)
        w = float(torch.exp(torch.tensor(-(j - 1) / gamma)))
        total = total + w * li
        wsum += w
        metrics[f"loss_{j - 1}"] = float(li.detach())
    return total / max(wsum, 1e-9), {**metrics, **acc.result(am)}


def cod_columns(
    loss_mask: torch.Tensor,
    depths: int,
    ratio: float,
    ratio_min: float,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """P-EAGLE COD sampling, shared by the batch: the columns kept at depths 1..depths-1 (nested: a column kept at
    depth d was kept at d-1, so its lower placeholder rows exist). Column t is eligible at depth d if some row
    trains x_{t+2+d}. ratio 1 keeps every eligible column."""
    t = loss_mask.shape[1]
    cols: list[torch.Tensor] = []
    prev = torch.arange(t, device=loss_mask.device)
    for d in range(1, depths):
        elig = torch.zeros(t, dtype=torch.bool, device=loss_mask.device)
        if t > 2 + d:
            elig[: t - 2 - d] = loss_mask[:, 2 + d :].bool().any(0)
        cand = prev[elig[prev]]
        keep = cand.numel() if ratio >= 1.0 else int(round(max(ratio**d, ratio_min) * int(elig.sum())))
        keep = min(keep, cand.numel())
        if keep == 0:
            break
        if keep < cand.numel():
            cand = (
                cand[torch.randperm(cand.numel(), generator=generator)[:keep].to(cand.device)].sort().values
            )
        cols.append(cand)
        prev = cand
    return cols


def peagle_forward(
    head: PEagleHead,
    embed_weight: torch.Tensor,
    aux: torch.Tensor,
    ids: torch.Tensor,
    am: torch.Tensor,
    cols: list[torch.Tensor],
) -> tuple[torch.Tensor, list[slice]]:
    """All depths in one forward: [B, T] real rows (depth 0) + one placeholder row per kept column per depth.
    Returns (final states [B, R, H], row slice of each depth)."""
    b, t = ids.shape
    dev, dtype = ids.device, head.fc.weight.dtype
    c = head.config
    col = torch.cat([torch.arange(t, device=dev), *cols])
    depth = torch.cat(
        [torch.zeros(t, dtype=torch.long, device=dev)]
        + [torch.full((x.numel(),), i + 1, dtype=torch.long, device=dev) for i, x in enumerate(cols)]
    )
    n_ph = col.numel() - t
    embeds = torch.cat(
        [F.embedding(shift_left(ids, 1), embed_weight), embed_weight[head.mask_token_id].expand(b, n_ph, -1)],
        1,
    ).to(dtype)
    hidden = torch.cat([head.fc(aux.to(dtype)), head.placeholder(n_ph).expand(b, -1, -1)], 1)
    pos = (col + depth)[None].expand(b, -1)
    k_real = depth[None] == 0
    allowed = (k_real & (col[None] <= col[:, None])) | (
        ~k_real & (col[None] == col[:, None]) & (depth[None] <= depth[:, None]) & (depth[:, None] > 0)
    )
    pad_ok = torch.cat([am.bool(), torch.ones(b, n_ph, dtype=torch.bool, device=dev)], 1)
    mask = (allowed[None] & pad_ok[:, None])[:, None]
    cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, dtype)
    out, _ = head.step(embeds, hidden, pos, mask, from_target=False, rope=(cos, sin))
    bounds, start = [slice(0, t)], t
    for x in cols:
        bounds.append(slice(start, start + x.numel()))
        start += x.numel()
    return out, bounds


def peagle_loss(
    head: PEagleHead,
    embed_weight: torch.Tensor,
    lm_weight: torch.Tensor,
    feats: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    *,
    depths: int | None = None,
    cod_ratio: float = 0.7,
    cod_min: float = 0.2,
    loss: str = "soft_ce",
    temperature: float = 1.0,
    beta: float = 0.5,
    exact_acceptance: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """P-EAGLE training loss (module docstring); depths defaults to head.num_depths. Returns (loss, metrics)."""
    ids, am, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    b, t = ids.shape
    k = depths or head.num_depths
    cols = cod_columns(lm, k, cod_ratio, cod_min, generator)
    out, bounds = peagle_forward(head, embed_weight, feats["aux"], ids, am, cols)
    last = feats["last"]
    total = out.new_zeros((), dtype=torch.float32)
    n_rows, metrics = 0, {}
    # conditional acceptance is exact when cod_ratio = 1 (every column kept at every depth)
    # column t's round drafts x_{t+2}, x_{t+3}, ...: the held-out eval (every column at every depth) walks rounds
    acc = DepthAcceptance((b, t), ids.device, walk=exact_acceptance and cod_ratio >= 1.0)
    for d, sl in enumerate(bounds):
        c_d = torch.arange(t, device=ids.device) if d == 0 else cols[d - 1]
        lab = c_d + 2 + d  # token predicted by row (d, t)
        v = (lab < t)[None] & lm.gather(1, lab.clamp(max=t - 1)[None].expand(b, -1)).bool()
        full = torch.zeros(b, t, dtype=torch.bool, device=ids.device)
        full[:, c_d] = v  # row-major over (b, sorted columns): the order of v's rows below
        d_top = t_top = torch.zeros(0, dtype=torch.long, device=ids.device)
        if bool(v.any()):
            tgt = last[:, (c_d + 1 + d).clamp(max=t - 1)][v]
            li, d_top, t_top = position_terms(
                head.logits(out[:, sl][v]),
                tgt,
                lm_weight,
                head.vocab_ids,
                loss=loss,
                temperature=temperature,
                beta=beta,
                exact=exact_acceptance,
            )
            nv = int(v.sum())
            total = total + li * nv
            n_rows += nv
            metrics[f"loss_{d}"] = float(li.detach())
        acc.update(d, full, d_top, t_top)
    return total / max(n_rows, 1), {**metrics, **acc.result(am)}
