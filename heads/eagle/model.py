"""EAGLE-1 and EAGLE-3 draft heads (Li et al. 2024, 2025): one decoder layer over the target's features.

EAGLE-1: x_t = fc([embed(tok_{t+1}); f_t]) (2H -> H, bias), one Llama decoder layer (no input norm, as vLLM
loads it), output = the predicted next feature f_{t+1}; token logits through the frozen target lm_head.
EAGLE-3: g_t = fc([a_t; b_t; c_t]) (3H_t -> H, no bias) over three target layers' hidden states; the decoder
layer's attention reads [input_layernorm(embed(tok_{t+1})); hidden_norm(g_t)] (2H in); final norm -> lm_head
over a reduced draft vocabulary (d2t[i] = target_id - i, t2d bool over the target vocab). When the head runs on
its own outputs (drafting depth >= 2, or training-time test) the layer input is its previous output instead of
g_t (no fc). Tensor names follow SGLang (eagle3: fc, midlayer.*, norm, lm_head, d2t, t2d) and vLLM (eagle:
fc, layers.0.*). The layer pieces (attention with explicit extra keys, MLP, norms, RoPE) are draftsmith.heads.layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import target_info
from draftsmith.heads.layers import MLP, Attention, LayerShape, RMSNorm, llama_shape, rope_cos_sin
from draftsmith.modeling import base_decoder


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
    """EAGLE-3 default: inputs of layers 2, N//2, N-3 (HF hidden_states indices), made strictly increasing within
    [1, N-1] on small targets (N >= 4: [1, 2, 3] for N = 4, [2, 3, 4] for N = 5 and 6) because the engines' capture
    loops take the inputs of layers 1..N-1 only, in order. Below 4 layers three such ids do not exist: the ids are
    clamped to [1, N-1] (usable by draftsmith, refused by every engine export)."""
    want = (2, num_layers // 2, num_layers - 3)
    if num_layers < 4:
        return [min(max(i, 1), num_layers - 1) for i in want]
    ids, lo = [], 1
    for j, i in enumerate(sorted(want)):
        i = min(max(i, lo), num_layers - 1 - (2 - j))  # leave room for the ids still to come
        ids.append(i)
        lo = i + 1
    return ids


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
        # index metadata stays on the CPU (a cost model builds heads under a `torch.device("cuda")` context)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device="cpu"))
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool, device="cpu")
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
