"""What a drafter costs in arithmetic, beside what it costs in time.

A drafter's measured cost per drafted token (seconds, as a share of a plain target step) should be close to its
share of the target's arithmetic: a draft forward that costs 0.3 of a step while doing 0.05 of the step's FLOPs is
paying Python and kernel-launch overhead, not model work. `decode_flops` counts both with
torch.utils.flop_counter (every matmul and attention op, whatever module or functional call runs it) on one real
decode: the plain target step (prefill excluded) and the drafter's own calls (begin / propose / advance; a
self-speculative drafter's target layers included, since drafting runs them).

Beside the FLOPs, the same decode records which model weights each side reads through its matrix products (the
distinct parameters and buffers of the target and of the drafter's modules that are an operand of a matmul op): the
drafter's weight share is the bytes it reads over the bytes a plain step reads -- its parameter share of the target
for a head, the shared layers plus the adapter for a self-speculative drafter, the draft model for `draft:`.
Embedding lookups read rows, not matrices, and are not counted on either side. Both are counted with every tuned CPU
Linear on F.linear (draftsmith.cpulayout.reference_kernels): the kernels the layout tuner may pick instead (oneDNN's
inner product, stream_linear) do not pass through torch's dispatch, so the counters would not see them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from draftsmith.cpulayout import reference_kernels

from .decoder import SpeculativeDecoder
from .proposer import Proposer

_DRAFT_CALLS = ("begin", "propose", "advance")
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_int_mm", "_weight_int4pack_mm_for_cpu",
            "_weight_int8pack_mm"}  # fmt: skip
"""The ops whose weight operand counts as read (the last two: draftsmith.woq's quantized draft weights)."""


def weight_storages(*objs, depth: int = 3) -> dict[int, int]:
    """storage pointer -> bytes of the parameters and buffers of every nn.Module reachable from `objs` (through
    attributes, lists and tuples, `depth` levels deep): the weights a matmul may read."""
    out: dict[int, int] = {}
    seen: set[int] = set()

    def visit(x, d):
        if d > depth or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, nn.Module):
            for t in [*x.parameters(), *x.buffers()]:
                # a blocked copy (cpulayout's packed kernel) has no storage to name; counting reads its weight
                if t.is_mkldnn:
                    continue
                out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v, d + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, torch.Tensor)):
            for v in vars(x).values():
                visit(v, d + 1)

    for obj in objs:
        visit(obj, 0)
    return out


class WeightReads(TorchDispatchMode):
    """Records which of `weights` (weight_storages) are an operand of a matmul op while active: `.read` = their
    storage pointers."""

    def __init__(self, weights: dict[int, int]):
        super().__init__()
        self.weights, self.read = weights, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _MATMULS:
            for a in args:
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.weights:
                    self.read.add(a.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))

    def bytes(self) -> int:
        return sum(self.weights[p] for p in self.read)


def _target_weights(decoder: SpeculativeDecoder) -> dict[int, int]:
    """The target's weights, with the decoder's transposed CPU copy of its lm_head (what plain steps multiply by)."""
    out = weight_storages(decoder.target)
    head_t = getattr(decoder, "_head_t", None)
    if head_t is not None:
        out[head_t.untyped_storage().data_ptr()] = head_t.untyped_storage().nbytes()
    return out


@contextmanager
def _counting(proposer: Proposer, calls: list[tuple[str, int]], reads: WeightReads | None = None):
    """Append (name, FLOPs) of each of the proposer's own calls to `calls` and, with `reads`, record the weights
    they read from the second proposal on (the prompt's prefill, up to the first, may read other copies:
    draftsmith.woq multiplies a prompt by dense weights) (instance attributes, restored on exit)."""
    originals = {name: getattr(proposer, name) for name in _DRAFT_CALLS}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            with FlopCounterMode(display=False) as fc:
                if reads is None or not any(n == "propose" for n, _ in calls):
                    out = fn(*args, **kwargs)
                else:
                    with reads:
                        out = fn(*args, **kwargs)
            calls.append((name, fc.get_total_flops()))
            return out

        return wrapper

    for name, fn in originals.items():
        setattr(proposer, name, counted(name, fn))
    try:
        yield
    finally:
        for name in _DRAFT_CALLS:
            delattr(proposer, name)  # back to the class's methods (wrappers were instance attributes)


@torch.inference_mode()
@reference_kernels()
def decode_flops(
    decoder: SpeculativeDecoder,
    proposer: Proposer | None,
    ids: torch.Tensor,
    *,
    k: int,
    max_new_tokens: int = 24,
) -> dict:
    """FLOPs of one plain target decode step (prefill excluded) and, with a proposer, of its drafting per drafted
    token (tree nodes count as drafted tokens, as in the decoder's time accounting; the prompt's prefill excluded:
    the calls up to the first proposal), and the weight bytes each side
    reads (module docstring): weight_share = the drafter's over a plain step's. ids: [1, T] a prompt."""
    with FlopCounterMode(display=False) as fc:
        prefill = decoder.generate(ids, None, max_new_tokens=1)
    prefill_flops = fc.get_total_flops()
    target_reads = WeightReads(_target_weights(decoder))
    with FlopCounterMode(display=False) as fc, target_reads:
        plain = decoder.generate(ids, None, max_new_tokens=max_new_tokens)
    steps = plain.target_forwards - prefill.target_forwards
    step = (fc.get_total_flops() - prefill_flops) / max(steps, 1)
    out = {"target_step_flops": step, "target_weight_bytes": target_reads.bytes()}
    if proposer is None:
        return out
    calls: list[tuple[str, int]] = []
    reads = WeightReads({**_target_weights(decoder), **weight_storages(proposer)})
    with _counting(proposer, calls, reads):
        res = decoder.generate(ids, proposer, k=k, max_new_tokens=max_new_tokens)
    drafted = sum(res.verified) - len(res.verified)  # nodes drafted over all verify steps
    # the prompt's prefill (begin and the first propose: a draft LM runs the prompt there, a head its hidden
    # states) is left out, as on the target side: per drafted token from the second verify step on
    first = next((i for i, (name, _) in enumerate(calls) if name == "propose"), len(calls))
    later = res.verified[1:]
    out["draft_flops_per_token"] = sum(f for _, f in calls[first + 1 :]) / max(sum(later) - len(later), 1)
    out["flop_share"] = out["draft_flops_per_token"] / step if step else None
    out["drafted_tokens"] = drafted
    out["draft_weight_bytes"] = reads.bytes()
    out["weight_share"] = reads.bytes() / target_reads.bytes() if target_reads.bytes() else None
    return out
