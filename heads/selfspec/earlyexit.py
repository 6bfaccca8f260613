"""Trained early exit (Kangaroo, Liu et al. 2024): the target's first L layers, shared as they are, then a small
adapter that maps layer-L states to the final-layer space, then the target's own lm_head (rows of a reduced
vocabulary). The target's weights are never touched: the adapter reads its layer-L states (HF hidden_states[L],
the input of layer L) and is trained to reproduce its output distribution at the same position.

Adapter = one Llama-style decoder layer (input norm, attention over the adapter's own keys of the context, MLP)
+ final norm: about one target layer of parameters (2.6% of SmolLM2-135M). Its output projections start at
zero, so an untrained adapter is the plain early exit norm(h_L) -> lm_head.

Training needs no unroll (unlike EAGLE's training-time test): at decode time the drafted tokens' layer-L states
are computed by the target's own layers (exact), so teacher-forced training sees exactly what drafting sees.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.divergences import divergence, loss_entry
from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import shift_left, target_info
from draftsmith.heads.layers import MLP, Attention, LayerShape, RMSNorm, llama_shape, rope_cos_sin

HEAD_TYPE = "earlyexit"


@dataclass
class EarlyExitConfig(LayerShape):
    exit_layer: int = 2
    """L: the draft runs the target's layers 0..L-1 and reads hidden_states[L] (the input of layer L)."""
    num_target_layers: int = 0

    def __post_init__(self):
        if self.num_target_layers and not 1 <= self.exit_layer < self.num_target_layers:
            raise DraftsmithError(
                f"earlyexit exit_layer must be in [1, {self.num_target_layers - 1}], got {self.exit_layer}"
            )


class EarlyExitAdapter(nn.Module):
    """h_L [B, T, H] -> adapter output [B, T, H]; logits through the target's head rows `vocab_ids`."""

    head_type = HEAD_TYPE

    def __init__(self, config: EarlyExitConfig, target: dict | None = None):
        super().__init__()
        c = self.config = config
        self.target = target or {}
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("vocab_ids", torch.arange(c.draft_vocab_size, dtype=torch.long))

    @classmethod
    def from_target(
        cls,
        target_model,
        exit_layer: int,
        draft_vocab_ids: torch.Tensor | None = None,
        intermediate_size: int | None = None,
    ) -> EarlyExitAdapter:
        """A new adapter sized like one target layer; norms start as the target's final norm (h_L is read
        through it by an untrained adapter), output projections at zero (identity residual path)."""
        t = target_model.config
        ids = torch.arange(t.vocab_size) if draft_vocab_ids is None else draft_vocab_ids.to(torch.long).cpu()
        if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()) or int(ids[-1]) >= t.vocab_size:
            raise DraftsmithError("earlyexit draft vocab ids must be sorted, unique target ids")
        c = EarlyExitConfig(
            exit_layer=int(exit_layer),
            **{**llama_shape(t), "intermediate_size": intermediate_size or t.intermediate_size},
            vocab_size=t.vocab_size,
            draft_vocab_size=int(ids.numel()),
            num_target_layers=t.num_hidden_layers,
        )
        ad = cls(c, target_info(target_model))
        ad.vocab_ids.copy_(ids)
        with torch.no_grad():
            ad.norm.weight.copy_(target_model.get_decoder().norm.weight.detach().float())
            ad.self_attn.o_proj.weight.zero_()
            ad.mlp.down_proj.weight.zero_()
        return ad.to(target_model.get_output_embeddings().weight.device)

    def forward(self, h: torch.Tensor, cos, sin, mask, kv_extra=None) -> torch.Tensor:
        """h [B, T, H]; cos/sin [B, 1, T, D]; mask bool [B|1, 1, T, S] (True = attend); kv_extra: context keys
        (a heads.eagle.KVBuffer at decode time). Returns the pre-norm output [B, T, H]."""
        attn, _ = self.self_attn(self.input_layernorm(h), cos, sin, mask, kv_extra)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
        """out [..., H] -> logits [..., V_d] over the target head rows head_rows [V_d, H] (= W_lm[vocab_ids])."""
        return F.linear(self.norm(out), head_rows)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def to_config_dict(self) -> dict:
        return {"draftsmith_head_type": HEAD_TYPE, **asdict(self.config), "target": self.target}


def exit_states(feats: dict[str, torch.Tensor], aux_layers: list[int], exit_layer: int) -> torch.Tensor:
    """The layer-L input states [B, T, H] out of heads.hidden features ("aux" = aux_layers' states concatenated)."""
    if exit_layer not in aux_layers:
        raise DraftsmithError(
            f"the hidden states hold layers {aux_layers}, not the exit layer {exit_layer}; use another "
            "data.hidden_cache or data.hidden_states=online"
        )
    j = aux_layers.index(exit_layer)
    h = feats["aux"]
    d = h.shape[-1] // len(aux_layers)
    return h[..., j * d : (j + 1) * d]


def earlyexit_loss(
    adapter: EarlyExitAdapter,
    lm_weight: torch.Tensor,
    feats: dict[str, torch.Tensor],
    aux_layers: list[int],
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss: str = "soft_ce",
    temperature: float = 1.0,
    beta: float = 0.5,
    depth: int = 6,
    exact_acceptance: bool = False,
    chunk: int = 512,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of the adapter against the frozen target's distribution at the same position. lm_weight [V, H] (the
    target head, never trained); feats: heads.hidden features ("aux" holding layer L, "last" [B, T, H] the
    final normed state); attention_mask/loss_mask [B, T]. loss: a draftsmith.divergences.LOSSES kind (soft_ce
    and the KL-type ones on p restricted to the draft vocabulary; tvd, neg_log_accept, lk on the full target).
    Metrics: acc_i = greedy acceptance at chain depth i+1 conditional on the shallower depths (teacher-forced
    along the data), tau_sim. exact_acceptance: compare with the target argmax over the full vocabulary."""
    from draftsmith.acceptance import tau_from_conditional

    c = adapter.config
    b, t = attention_mask.shape
    dev = attention_mask.device
    dtype = adapter.norm.weight.dtype
    h = exit_states(feats, aux_layers, c.exit_layer).to(dtype)
    last = feats["last"].to(dtype)
    pos = torch.arange(t, device=dev)[None].expand(b, t)
    cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, dtype)
    mask = (
        torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None, None]
        & attention_mask.bool()[:, None, None]
    )
    valid = shift_left(loss_mask, 1).bool()  # rows whose distribution predicts a trained token
    n = int(valid.sum())
    if n == 0:
        return h.sum() * 0.0, {"n_rows": 0.0}
    out = adapter(h, cos, sin, mask)[valid]  # [n, H]
    w_d = lm_weight[adapter.vocab_ids].to(dtype)
    d_logits = adapter.logits(out, w_d)  # [n, V_d]
    tgt = last[valid]
    with torch.no_grad():  # soft_ce and the KL-type losses read the target at the draft's ids only
        labels = F.linear(tgt, lm_weight.to(dtype) if loss_entry(loss).full_target else w_d).float()
    li = divergence(loss, labels, d_logits, temperature=temperature, beta=beta, vocab_ids=adapter.vocab_ids)
    with torch.no_grad():
        d_top = adapter.vocab_ids[d_logits.argmax(-1)]
        if exact_acceptance:
            w = lm_weight.to(dtype)
            t_top = torch.cat([F.linear(tgt[s : s + chunk], w).argmax(-1) for s in range(0, n, chunk)])
        else:
            t_top = adapter.vocab_ids[F.linear(tgt, w_d).argmax(-1)]
        ok = torch.zeros(b, t, dtype=torch.bool, device=dev)
        ok[valid] = d_top == t_top
        metrics = {"loss_0": float(li.detach()), "n_rows": float(n)}
        acc, alive, seen = [], ok, valid
        for i in range(depth):  # a chain rooted at t is accepted to depth i+1 iff rows t..t+i all agree
            if i > 0:
                seen = alive & shift_left(valid, i)
                alive = alive & shift_left(ok, i)
            den = int(seen.sum())
            if den == 0:
                break
            acc.append(float(alive.sum()) / den)
            metrics[f"acc_{i}"] = acc[-1]
        metrics["tau_sim"] = tau_from_conditional(acc)
    return li, metrics
