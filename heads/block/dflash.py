"""DFlash-style block drafter: a few transformer layers draft a whole block of tokens in ONE forward.

Conditioning (as DFlash does it): the target's fused multi-layer features of the context,
ctx_s = hidden_norm(fc(cat(aux states at s))) [T, H], are injected into EVERY draft layer's attention as extra
keys/values: layer l projects ctx with its own k_proj / v_proj (+ k_norm, RoPE at position s) and prepends them to
the block's own keys. The block is [anchor token, mask, ..., mask] (B rows at positions a .. a+B-1, embedded by the
TARGET's embed_tokens; the mask is a target token id that never occurs in the training data) and attends
bidirectionally to itself and to the context rows s < a (the anchor's own target state does not exist yet at
decode time: the anchor is the token the target just emitted). Block row j >= 1 predicts token a+j, so one forward
gives B-1 draft tokens. Layers are Qwen3-style (per-head q_norm / k_norm, pre-norm, SwiGLU), as the published
checkpoints; logits come from a reduced draft vocabulary (lm_head rows initialised from the target's, d2t/t2d as
EAGLE-3) -- the engines that share the target's full head instead are handled at export.

Tensor names follow the z-lab / SGLang / speculators DFlash checkpoints: fc, hidden_norm, layers.{i}.self_attn.
{q,k,v,o}_proj / {q,k}_norm, layers.{i}.mlp.{gate,up,down}_proj, layers.{i}.{input,post_attention}_layernorm, norm,
plus lm_head, d2t, t2d.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import config_from_dict, target_info
from draftsmith.heads.eagle.model import EagleHead, default_aux_layers
from draftsmith.heads.layers import MLP, KVBuffer, LayerShape, RMSNorm, llama_shape, rotate_half
from draftsmith.modeling import base_decoder


@dataclass
class DFlashConfig(LayerShape):
    num_hidden_layers: int = 1
    """Draft layers (1-5; DFlash ships 5 for Qwen3-8B)."""
    target_hidden_size: int = 0
    block_size: int = 8
    """Rows per forward: the anchor + block_size-1 masks -> block_size-1 draft tokens."""
    mask_token_id: int = 0
    aux_hidden_state_layer_ids: list[int] = field(default_factory=list)
    """HF output_hidden_states indices (layer inputs) of the fused target features, as EAGLE-3."""
    aux_layer_convention: str = "layer_input"
    num_target_layers: int = 0
    frozen_lm_head: bool = False
    """lm_head = the target's full head, never trained (the layout SGLang / z-lab load: no lm_head in the folder)."""

    def __post_init__(self):
        if self.block_size < 2:
            raise DraftsmithError(f"dflash block_size must be >= 2 (anchor + masks), got {self.block_size}")
        if self.num_hidden_layers < 1:
            raise DraftsmithError(f"dflash num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if not self.aux_hidden_state_layer_ids:
            raise DraftsmithError("dflash needs at least one aux_hidden_state_layer_id")


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.d, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> post-norm, post-RoPE keys and values [B, h_kv, T, D]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.d).transpose(1, 2)
        return k * cos + rotate_half(k) * sin, v

    def forward(self, x, cos, sin, ctx_kv, mask):
        """x [B, R, H] block rows; ctx_kv: context (k, v) [B, h_kv, S, D], or at decode time the layer's KVBuffer
        (S = its length: the block's keys are written after the context and read in place, without copying the
        context every step; the length does not move, so the next write replaces them); mask [B|1, 1, R, S + R]
        bool or None (None = every row sees every context row and the whole block). Returns [B, R, H]."""
        b, r, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, r, self.n_heads, self.d)).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k, v = self.kv(x, cos, sin)
        if isinstance(ctx_kv, KVBuffer):
            keys, vals = ctx_kv.write(k, v)
        else:
            keys, vals = torch.cat([ctx_kv[0], k], 2), torch.cat([ctx_kv[1], v], 2)
        out = F.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, r, -1))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The block drafter. The target's embed_tokens is passed in at call time, never owned."""

    head_type = "dflash"

    def __init__(self, config: DFlashConfig, target: dict | None = None):
        super().__init__()
        c = self.config = config
        self.target = target or {}
        n_aux = len(c.aux_hidden_state_layer_ids)
        self.fc = nn.Linear(n_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    @classmethod
    def from_target(
        cls,
        target_model,
        *,
        draft_vocab_ids: torch.Tensor,
        mask_token_id: int,
        block_size: int = 8,
        num_layers: int = 1,
        aux_layers: list[int] | None = None,
        intermediate_size: int | None = None,
        freeze_lm_head: bool = False,
    ) -> DFlashDrafter:
        """A new drafter with layers shaped like the target's (hidden size, heads, MLP width). freeze_lm_head: use
        the target's full output head as is (draft_vocab_ids must then be every target id)."""
        t = target_model.config
        shape = llama_shape(t)
        if intermediate_size:
            shape["intermediate_size"] = intermediate_size
        c = DFlashConfig(
            **shape,
            num_hidden_layers=num_layers,
            vocab_size=t.vocab_size,
            draft_vocab_size=int(draft_vocab_ids.numel()),
            target_hidden_size=t.hidden_size,
            block_size=block_size,
            mask_token_id=int(mask_token_id),
            aux_hidden_state_layer_ids=list(aux_layers or default_aux_layers(t.num_hidden_layers)),
            num_target_layers=int(t.num_hidden_layers),
            frozen_lm_head=freeze_lm_head,
        )
        if freeze_lm_head and draft_vocab_ids.numel() != t.vocab_size:
            raise DraftsmithError(
                "a frozen (target) lm_head needs the full target vocabulary as draft vocabulary"
            )
        d = cls(c, target_info(target_model))
        d.set_draft_vocab(draft_vocab_ids)
        w = target_model.get_output_embeddings().weight.detach()
        d.lm_head.weight.data.copy_(w[draft_vocab_ids.to(w.device)].float())
        d.lm_head.weight.requires_grad_(not freeze_lm_head)
        return d.to(base_decoder(target_model).embed_tokens.weight.device)

    set_draft_vocab = EagleHead.set_draft_vocab  # vocab_ids [V_d] sorted target ids -> d2t, t2d

    @property
    def vocab_ids(self) -> torch.Tensor:
        """[V_d] target ids of the draft logits' columns."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    # -- the forward pieces shared by training and decoding -------------------------------------------------------
    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [B, T, n_aux * H_t] -> ctx [B, T, H]."""
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple]:
        """Per layer (k, v) [B, h_kv, T, D] of the context rows (cos/sin at their positions)."""
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block(self, embeds, cos, sin, ctx_kv: list, mask=None) -> torch.Tensor:
        """embeds [B, R, H] (anchor + mask embeddings of one or many blocks); ctx_kv from context_kv, or one
        KVBuffer per layer (decoding; DFlashAttention.forward); mask
        [B|1, 1, R, S + R] or None. Returns the block's final states [B, R, H] (before norm)."""
        x = embeds
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, kv, mask)
        return x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [..., H] -> draft-vocab logits [..., V_d]."""
        return self.lm_head(self.norm(out))

    def to_config_dict(self) -> dict:
        c = self.config
        d = {"draftsmith_head_type": "dflash", **asdict(c), "target": self.target}
        d.update(
            architectures=[
                "DraftsmithDFlashDrafter"
            ],  # engine layouts: draftsmith export --format ...-dflash
            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
            tie_word_embeddings=False,
        )
        return d


def dflash_config_from_dict(data: dict) -> DFlashConfig:
    data = dict(data)
    if "rope_theta" not in data and isinstance(data.get("rope_parameters"), dict):
        data["rope_theta"] = data["rope_parameters"].get("rope_theta", 10000.0)
    return config_from_dict(DFlashConfig, data, "dflash config")
