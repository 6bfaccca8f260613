"""Weight-only quantization of a frozen draft's nn.Linears, for drafting on a CPU (int4 in groups, int8 per row).

A draft LM's step on a CPU is memory-bound like the target's: it costs about its bytes of weights over the
target's (RESULTS.md: the Qwen2.5-Coder-0.5B draft of the 1.5B drafts at ~0.30-0.35 of a target step per token in
bf16, its weight share 0.25-0.32). Reading its matmul weights as 4-bit integers cuts those bytes ~4x; the draft's
tokens are only proposals, which the target's verification accepts or replaces, so decoding stays exactly the
target's (lossless) whatever the draft's precision, and only acceptance can change (measured, RESULTS.md).

torch's own CPU kernels do the products: `aten._weight_int4pack_mm_for_cpu` (asymmetric 4-bit values in groups of
`group` input columns along each output row, one scale and one zero per group, the weight packed once by
`aten._convert_weight_to_int4pack_for_cpu`) and `aten._weight_int8pack_mm` (symmetric int8, one scale per output
row). Both run in the activations' dtype (bf16 or fp32) and trace under torch.compile. A GGUF Q4_K tensor, as the
embedded Qwen models ship, is itself asymmetric 4-bit in groups of 32, so int4 with group 32 stays close to the
file's own values (Q6_K tensors lose their two extra bits).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import register_flop_formula

from draftsmith.errors import DraftsmithError

BITS = (4, 8)
"""Weight widths quantize_linears offers."""
GROUPS = (32, 64, 128, 256)
"""Input columns per int4 scale/zero pair (the group sizes torch's int4 CPU kernel takes)."""
GROUP = 32
"""The default group: GGUF Q4_K's sub-block, the finest the kernel takes."""
DENSE_ROWS = 4
"""Products over more input rows than this (a prompt's prefill) use the Linear's own weights: the int4 kernel
dequantizes the weight again for every row (2-core Xeon, 896 x 4864 in bf16: 0.11 ms for one row against 0.34
dense, but 12.2 ms for 256 rows against 0.96), so a 0.5B draft's 250-token prefill took ~1 s in int4."""


class Int4Linear(nn.Module):
    """y = x W^T + b with W [out, in] held as 4-bit values in groups of `group` input columns: W[n, g*G + j] ~=
    (q - 8) * scale[g, n] + zero[g, n], q in 0..15 (the min and max of each group map to 0 and 15). More than
    DENSE_ROWS input rows at once (a prefill) multiply by the Linear's own weight, kept beside the 4-bit copy (a
    buffer outside the state dict; weight_bytes counts what a decode step reads)."""

    def __init__(self, linear: nn.Linear, group: int = GROUP):
        super().__init__()
        w = linear.weight.detach()
        self.out_features, in_f = w.shape
        self.in_features, self.group = in_f, group
        # the kernel packs output rows in 16s: a width that is not a multiple gets zero rows, sliced off after
        w = torch.cat([w, w.new_zeros(-self.out_features % 16, in_f)])
        out_f = w.shape[0]
        wf = w.float().reshape(out_f, in_f // group, group)
        lo, hi = wf.amin(-1), wf.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = (
            ((wf - lo[..., None]) / scale[..., None])
            .round()
            .clamp(0, 15)
            .to(torch.int32)
            .reshape(out_f, in_f)
        )
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [groups, out, 2]: the kernel's scale and its zero, the value of q = 8
        zeros = lo + 8 * scale
        self.register_buffer(
            "scales_zeros", torch.stack([scale, zeros], -1).transpose(0, 1).contiguous().to(w.dtype)
        )
        self.register_buffer("dense", linear.weight.detach(), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # the kernels read dense rows
        if rows.shape[0] > DENSE_ROWS:
            y = torch.nn.functional.linear(rows, self.dense)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_zeros)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, group={self.group}"


class Int8Linear(nn.Module):
    """y = x W^T + b with W [out, in] held as int8 with one scale per output row (symmetric: W ~= q * scale)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        scale = (w.float().abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer(
            "weight_int8", (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("scales", scale.to(w.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # the kernels read dense rows
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@register_flop_formula(torch.ops.aten._weight_int4pack_mm_for_cpu)
def _int4_flops(x_shape, packed_shape, group, scales_zeros_shape, out_shape=None, **kwargs) -> int:
    """A product of rows [M, K] by the [N, K] weight, for torch.utils.flop_counter (decode.flops)."""
    return 2 * x_shape[0] * x_shape[1] * scales_zeros_shape[1]


@register_flop_formula(torch.ops.aten._weight_int8pack_mm)
def _int8_flops(x_shape, w_shape, scales_shape, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[0]


def check_quantizable(bits: int, group: int = GROUP, device: torch.device | str = "cpu") -> None:
    """One DraftsmithError line, before any weight loads, for a width, group or device the kernels do not take."""
    if bits not in BITS:
        raise DraftsmithError(f"bits={bits} is not a weight width draftsmith quantizes; use bits=4 or bits=8")
    if bits == 4 and group not in GROUPS:
        raise DraftsmithError(
            f"group={group} is not an int4 group size; use one of {', '.join(map(str, GROUPS))}"
        )
    if torch.device(device).type != "cpu":
        raise DraftsmithError(
            f"bits={bits} quantizes a draft for the CPU's int{bits} kernels; on {torch.device(device).type} drop bits="
        )


def check_group_divides(group: int, config) -> None:
    """One DraftsmithError line, from a model's config before its weights load, when `group` does not divide the
    input width of its Linears (hidden_size, intermediate_size): those would stay unquantized."""
    widths = {
        getattr(config, name) for name in ("hidden_size", "intermediate_size") if getattr(config, name, None)
    }
    bad = sorted(w for w in widths if w % group)
    if bad:
        fits = [g for g in GROUPS if all(w % g == 0 for w in widths)]
        fix = f"use group={max(fits)} or a smaller one" if fits else "no int4 group divides it: use bits=8"
        raise DraftsmithError(f"group={group} does not divide the draft's width {bad[0]}; {fix}")


def quantize_linear(linear: nn.Linear, bits: int, group: int = GROUP) -> nn.Module:
    """The quantized stand-in for one frozen nn.Linear (int4 needs its input width divisible by `group`: a Linear
    whose width is not stays as it is)."""
    if bits == 4:
        return Int4Linear(linear, group) if linear.in_features % group == 0 else linear
    return Int8Linear(linear)


def quantize_linears(module: nn.Module, bits: int, group: int = GROUP) -> int:
    """Replace every nn.Linear under `module` (in place) by its quantized stand-in; returns how many were replaced.
    For inference only: the stand-ins hold no trainable weight."""
    check_quantizable(bits, group, next(module.parameters()).device)
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]  # fmt: skip
    done = 0
    for parent, name, child in swaps:
        new = quantize_linear(child, bits, group)
        if new is not child:
            setattr(parent, name, new)
            done += 1
    return done


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the matmul weights a forward of `module` reads: nn.Linear weights and the quantized stand-ins'
    buffers (packed values and their scales)."""
    total = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, (Int4Linear, Int8Linear)):
            total += sum(
                b.numel() * b.element_size() for n, b in m.named_buffers(recurse=False) if n != "dense"
            )
    return total
