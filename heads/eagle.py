"""EAGLE-1 and EAGLE-3 draft heads (Li et al. 2024, 2025): one decoder layer over the target's features.

EAGLE-1: x_t = fc([embed(tok_{t+1}); f_t]) (2H -> H, bias), one Llama decoder layer (no input norm, as vLLM
loads it), output = the predicted next feature f_{t+1}; token logits through the frozen target lm_head.
EAGLE-3: g_t = fc([a_t; b_t; c_t]) (3H_t -> H, no bias) over three target layers' hidden states; the decoder
layer's attention reads [input_layernorm(embed(tok_{t+1})); hidden_norm(g_t)] (2H in); final norm -> lm_head
over a reduced draft vocabulary (d2t[i] = target_id - i, t2d bool over the target vocab). When the head runs on
its own outputs (drafting depth >= 2, or training-time test) the layer input is its previous output instead of
g_t (no fc). Tensor names follow SGLang (eagle3: fc, midlayer.*, norm, lm_head, d2t, t2d) and vLLM (eagle:
fc, layers.0.*).

Attention takes explicit keys/values from outside (`kv_extra`) and a boolean mask, so the same layer serves
training (causal + training-time-test diagonal keys) and tree drafting (context cache + ancestors).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import target_info
from draftsmith.modeling import base_decoder


@dataclass
class LayerShape:
    """Sizes of one Llama-style decoder layer, copied from the target (`llama_shape`), and the vocabularies: what
    every trained draft layer (EAGLE, DFlash, early exit) records in its config.json."""

    hidden_size: int = 0
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    """Copied from the target: a template value of 2048 collapses acceptance on long-context targets."""
    hidden_act: str = "silu"
    vocab_size: int = 0
    draft_vocab_size: int = 0
    """Rows of the draft's output head (a reduced vocabulary; = vocab_size when the target's head is used)."""


@dataclass
class EagleConfig(LayerShape):
    kind: str = "eagle3"
    """eagle (EAGLE-1) or eagle3."""
    target_hidden_size: int = 0
    aux_hidden_state_layer_ids: list[int] = field(default_factory=list)
    """eagle3: HF output_hidden_states indices of the fused features (index i = state entering layer i)."""
    aux_layer_convention: str = "layer_input"
    norm_before_residual: bool = False
    """eagle3: residual taken after hidden_norm (True) or from the raw fc output (False, SGLang default)."""

    def __post_init__(self):
        if self.kind not in ("eagle", "eagle3"):
            raise DraftsmithError(f"eagle head kind must be eagle or eagle3, got {self.kind!r}")
        if self.kind == "eagle3" and len(self.aux_hidden_state_layer_ids) != 3:
            raise DraftsmithError(
                f"eagle3 needs 3 aux_hidden_state_layer_ids, got {self.aux_hidden_state_layer_ids}"
            )


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3 default: inputs of layers 2, N//2, N-3 (HF hidden_states indices), clamped to [1, N-1] for tiny
    models: index 0 (the embeddings) and N (the final normed state) have no engine equivalent, so exports refuse them."""
    return [min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


def llama_shape(t) -> dict:
    """Decoder-layer sizes of a HF target config (hidden size, heads, MLP width, norm eps, RoPE theta, context): a
    draft layer shaped like one target layer."""
    n_heads = t.num_attention_heads
    rope = getattr(t, "rope_parameters", None) or {}
    return {
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": n_heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", None) or n_heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // n_heads,
        "rms_norm_eps": float(getattr(t, "rms_norm_eps", 1e-5)),
        "rope_theta": float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))),
        "max_position_embeddings": int(t.max_position_embeddings),
        "hidden_act": getattr(t, "hidden_act", "silu"),
    }


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default RoPE for positions [B, T] -> cos, sin [B, 1, T, D]."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KVBuffer:
    """Preallocated keys/values of the head's attention at decode time: rows [0, length) are live. `write`
    stores a call's (k, v) [B, h_kv, T, D] at rows [length, length + T) and returns views of rows
    [0, length + T) -- no concatenation of the whole context per draft depth. The caller moves `length`
    (commit context rows; leave it to drop drafted rows, which are overwritten by the next write)."""

    def __init__(self, batch: int, n_kv: int, head_dim: int, dtype, device, capacity: int = 256):
        self.k = torch.empty(batch, n_kv, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:  # grow geometrically (amortised O(1) per row)
            cap = max(end, 2 * self.k.shape[2])
            grow = (*self.k.shape[:2], cap - self.k.shape[2], self.k.shape[3])
            self.k = torch.cat([self.k, self.k.new_empty(grow)], 2)
            self.v = torch.cat([self.v, self.v.new_empty(grow)], 2)
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, c: EagleConfig, in_dim: int):
        super().__init__()
        self.n_heads, self.n_kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.d, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.d, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.d, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, kv_extra=None, diag_kv=None):
        """x [B, T, in]; mask [B|1, 1, T, S] bool (True = attend). Plain mode (diag_kv None): keys are
        kv_extra ++ this call's keys, S = S_extra + T; kv_extra may also be a KVBuffer (decoding: this call's
        keys are written into it at its `length` and the attention reads rows [0, length + T) in place).
        Training-time-test mode (diag_kv a list, possibly empty): kv_extra are the step-0 keys masked by `mask`
        (S = T, causal) and each column also attends to its own earlier unroll steps (diag_kv) and itself.
        Returns out [B, T, H] and this call's post-RoPE (k, v)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.d).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.n_heads // self.n_kv
        if diag_kv is None:
            keys, vals = k, v
            if isinstance(kv_extra, KVBuffer):
                keys, vals = kv_extra.write(k, v)
            elif kv_extra is not None:
                keys, vals = torch.cat([kv_extra[0], k], 2), torch.cat([kv_extra[1], v], 2)
            # grouped-query attention without materialising repeated keys (SDPA enable_gqa, torch >= 2.5)
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=rep > 1)
        else:
            # EAGLE-3 training-time test, unroll step i >= 1: column t sees the real context through the step-0
            # keys (kv_extra, causal mask) plus its own unroll steps 1..i at the same column -- exactly what a
            # draft chain rooted at t sees at decode time (context cache + its ancestors).
            scale = self.d**-0.5
            ctx_k, ctx_v = kv_extra[0].repeat_interleave(rep, 1), kv_extra[1].repeat_interleave(rep, 1)
            scores = ((q @ ctx_k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
            dk = torch.stack([kk for kk, _ in diag_kv] + [k], -2).repeat_interleave(rep, 1)  # [B, h, T, i, D]
            dv = torch.stack([vv for _, vv in diag_kv] + [v], -2).repeat_interleave(rep, 1)
            dscore = (q[..., None, :] * dk).sum(-1) * scale  # [B, h, T, i]
            w = torch.softmax(torch.cat([scores, dscore], -1).float(), -1).to(q.dtype)
            s = scores.shape[-1]
            out = w[..., :s] @ ctx_v + (w[..., s:, None] * dv).sum(-2)
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """SGLang's LlamaDecoderLayer for EAGLE-3: attention over [norm(embed); norm(hidden)]."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.c = c
        self.self_attn = Attention(c, 2 * c.hidden_size)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, embeds, hidden, cos, sin, mask, kv_extra=None, diag_kv=None):
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.c.norm_before_residual:
            residual = hidden
        x = torch.cat([self.input_layernorm(embeds), hidden], -1)
        attn, kv = self.self_attn(x, cos, sin, mask, kv_extra, diag_kv)
        residual = residual + attn
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        return out, kv


class Eagle1Layer(nn.Module):
    """A Llama decoder layer without input_layernorm (EAGLE-1 drops it for its single layer; vLLM does too)."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.self_attn = Attention(c, c.hidden_size)
        self.mlp = MLP(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_extra=None, diag_kv=None):
        attn, kv = self.self_attn(x, cos, sin, mask, kv_extra, diag_kv)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class EagleHead(nn.Module):
    """EAGLE-1 / EAGLE-3 head. The target's embed_tokens (and, for EAGLE-1, lm_head) are passed in, not owned."""

    def __init__(self, config: EagleConfig, target: dict | None = None):
        super().__init__()
        c = self.config = config
        self.target = target or {}
        self.head_type = c.kind
        if c.kind == "eagle3":
            self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
            self.midlayer = Eagle3Layer(c)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        else:
            self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
            self.layers = nn.ModuleList([Eagle1Layer(c)])

    @classmethod
    def from_target(
        cls,
        target_model,
        kind: str = "eagle3",
        *,
        draft_vocab_ids: torch.Tensor | None = None,
        aux_layers: list[int] | None = None,
        norm_before_residual: bool = False,
        intermediate_size: int | None = None,
    ) -> EagleHead:
        """A new head sized like one target decoder layer. eagle3 needs the sorted target ids of the draft
        vocabulary (draftsmith.vocab.build_vocab_ids on token counts of the training data)."""
        t = target_model.config
        shape = llama_shape(t)
        shape["intermediate_size"] = intermediate_size or shape["intermediate_size"]
        if kind == "eagle3":
            if draft_vocab_ids is None:
                draft_vocab_ids = torch.arange(t.vocab_size)
            v_d = int(draft_vocab_ids.numel())
        else:
            v_d = t.vocab_size
        c = EagleConfig(
            kind=kind,
            **shape,
            vocab_size=t.vocab_size,
            draft_vocab_size=v_d,
            target_hidden_size=t.hidden_size,
            aux_hidden_state_layer_ids=(aux_layers or default_aux_layers(t.num_hidden_layers))
            if kind == "eagle3"
            else [],
            norm_before_residual=norm_before_residual,
        )
        head = cls(c, target_info(target_model))
        if kind == "eagle3":
            head.set_draft_vocab(draft_vocab_ids)
            # start the draft head at the target's rows: the last layer's output space is close to the target's
            w = target_model.get_output_embeddings().weight.detach()
            head.lm_head.weight.data.copy_(w[draft_vocab_ids.to(w.device)].float())
        dev = base_decoder(target_model).embed_tokens.weight.device
        return head.to(dev)

    # -- vocabulary -------------------------------------------------------------------------------------------
    def set_draft_vocab(self, vocab_ids: torch.Tensor) -> None:
        """vocab_ids [V_d] sorted target ids -> d2t (target_id - i) and t2d (bool over the target vocab)."""
        ids = vocab_ids.to(torch.long).cpu()
        if ids.numel() != self.config.draft_vocab_size or not bool((ids[1:] > ids[:-1]).all()):
            raise DraftsmithError("draft vocab ids must be sorted, unique and draft_vocab_size long")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.t2d.copy_(t2d)

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """[V_d] target ids of the draft logits' columns (None for EAGLE-1: full target vocab)."""
        if self.config.kind != "eagle3":
            return None
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    # -- one step ---------------------------------------------------------------------------------------------
    def layer(self):
        return self.midlayer if self.config.kind == "eagle3" else self.layers[0]

    def step(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        kv_extra=None,
        diag_kv=None,
        from_target: bool = True,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """embeds [B, T, H] of tokens t+1; hidden [B, T, H_in]: target features (from_target: fc applied) or the
        head's own previous outputs. position_ids [B, T]; rope: precomputed (cos, sin) [B, 1, T, D] for them
        (decoding caches a table). Returns (out [B, T, H] pre-norm, (k, v))."""
        c = self.config
        if rope is None:
            rope = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, embeds.dtype)
        cos, sin = rope
        if c.kind == "eagle3":
            if from_target:
                hidden = self.fc(hidden)
            return self.midlayer(embeds, hidden, cos, sin, mask, kv_extra, diag_kv)
        x = self.fc(
            torch.cat([embeds, hidden], -1)
        )  # EAGLE-1 always fuses (its features are next-feature preds)
        return self.layers[0](x, cos, sin, mask, kv_extra, diag_kv)

    def logits(self, out: torch.Tensor, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """out [..., H] -> draft-vocab logits [..., V_d] (eagle3) or full logits via the target head (eagle)."""
        if self.config.kind == "eagle3":
            return self.lm_head(self.norm(out))
        return F.linear(out, target_lm_head)

    def to_config_dict(self) -> dict:
        c = self.config
        d = {"draftsmith_head_type": c.kind, **asdict(c), "target": self.target}
        d.pop("kind")
        # Native folders name no serving-engine architecture on purpose: SGLang would read
        # `LlamaForCausalLMEagle3` + eagle_config ids as layer *outputs* (off by one from our "layer_input"
        # ids). `draftsmith export --format sglang-eagle3|speculators` writes the engine layouts.
        d.update(
            architectures=["DraftsmithEagle3Head" if c.kind == "eagle3" else "DraftsmithEagleHead"],
            num_hidden_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
            tie_word_embeddings=False,
        )
        return d


def eagle_config_from_dict(data: dict) -> EagleConfig:
    from draftsmith.heads.common import config_from_dict

    data = dict(data)
    data["kind"] = data.get("draftsmith_head_type", data.get("kind", "eagle3"))
    if "rope_theta" not in data and isinstance(data.get("rope_parameters"), dict):
        data["rope_theta"] = data["rope_parameters"].get("rope_theta", 10000.0)
    return config_from_dict(EagleConfig, data, "eagle config")
