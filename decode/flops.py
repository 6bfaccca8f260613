"""What a drafter costs in arithmetic, beside what it costs in time.

A drafter's measured cost per drafted token (seconds, as a share of a plain target step) should be close to its
share of the target's arithmetic: a draft forward that costs 0.3 of a step while doing 0.05 of the step's FLOPs is
paying Python and kernel-launch overhead, not model work. `decode_flops` counts both with
torch.utils.flop_counter (every matmul and attention op, whatever module or functional call runs it) on one real
decode: the plain target step (prefill excluded) and the drafter's own calls (begin / propose / advance; a
self-speculative drafter's target layers included, since drafting runs them).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils.flop_counter import FlopCounterMode

from .decoder import SpeculativeDecoder
from .proposer import Proposer

_DRAFT_CALLS = ("begin", "propose", "advance")


@contextmanager
def _counting(proposer: Proposer, totals: list[int]):
    """Count the FLOPs of the proposer's own calls into totals[0] (instance attributes, restored on exit)."""
    originals = {name: getattr(proposer, name) for name in _DRAFT_CALLS}

    def counted(fn):
        def wrapper(*args, **kwargs):
            with FlopCounterMode(display=False) as fc:
                out = fn(*args, **kwargs)
            totals[0] += fc.get_total_flops()
            return out

        return wrapper

    for name, fn in originals.items():
        setattr(proposer, name, counted(fn))
    try:
        yield
    finally:
        for name in _DRAFT_CALLS:
            delattr(proposer, name)  # back to the class's methods (wrappers were instance attributes)


@torch.inference_mode()
def decode_flops(
    decoder: SpeculativeDecoder,
    proposer: Proposer | None,
    ids: torch.Tensor,
    *,
    k: int,
    max_new_tokens: int = 24,
) -> dict:
    """FLOPs of one plain target decode step (prefill excluded) and, with a proposer, of its drafting per drafted
    token (tree nodes count as drafted tokens, as in the decoder's time accounting). ids: [1, T] a prompt."""
    with FlopCounterMode(display=False) as fc:
        prefill = decoder.generate(ids, None, max_new_tokens=1)
    prefill_flops = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        plain = decoder.generate(ids, None, max_new_tokens=max_new_tokens)
    steps = plain.target_forwards - prefill.target_forwards
    step = (fc.get_total_flops() - prefill_flops) / max(steps, 1)
    out = {"target_step_flops": step}
    if proposer is None:
        return out
    totals = [0]
    with _counting(proposer, totals):
        res = decoder.generate(ids, proposer, k=k, max_new_tokens=max_new_tokens)
    drafted = sum(res.verified) - len(res.verified)  # nodes drafted over all verify steps
    out["draft_flops_per_token"] = totals[0] / max(drafted, 1)
    out["flop_share"] = out["draft_flops_per_token"] / step if step else None
    out["drafted_tokens"] = drafted
    return out
