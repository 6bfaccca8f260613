"""The decoder-layer pieces every trained draft layer is made of (EAGLE-1/-3, P-EAGLE, DFlash, the early-exit
adapter): the layer shape copied from the target, RMSNorm, default RoPE, the preallocated KV buffer of decode time,
grouped-query attention with explicit extra keys, and the SwiGLU MLP.

Attention takes explicit keys/values from outside (`kv_extra`) and a boolean mask, so the same layer serves training
(causal + training-time-test diagonal keys) and tree drafting (context cache + ancestors). Draft layers are Llama
layers (no q/k/v bias) whatever the target's own layers are (Qwen2 has q/k/v biases): the layout SGLang, vLLM and
speculators load for EAGLE-3 and DFlash drafters of every target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation: (x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
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
    def __init__(self, c: LayerShape, in_dim: int):
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
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
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
    def __init__(self, c: LayerShape):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
