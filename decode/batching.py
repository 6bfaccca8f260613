"""How speculation pays as the batch grows: drafters against plain batched decoding at several batch sizes.

Speculation trades spare compute for fewer target forwards. At batch 1 a verify forward over k + 1 tokens costs
little more than a one-token step (memory-bound); at batch B it carries B (k + 1) tokens, and once that is compute-
bound the verify is no longer free: the speedup falls with B, and the best draft length shrinks. Per batch size B
this measures, in one run (`measure_batches`):

- tau (bonus included), alpha per position, tokens/s of speculative and plain batched decoding and their ratio:
  the prompts in consecutive groups of B (a last group short of B rows is filled from the first prompts), plain
  decoding and every drafter on the same group back to back, in an order rotated per group, after a warm-up;
  the target rows each method ran (a row that stops leaves the batch);
- the verify cost t_B(k + 1) / t_B(1): a target forward over B rows of k + 1 new tokens against B rows of one,
  after a KV cache of the run's typical length (decode.speed.measure_forward_costs);
- the speedup predicted for every k <= K from the run's acceptance by depth and that measured cost curve
  (decode.speed.StepCosts: tau(k) t_step / (k t_draft + t_verify(1 + k)), t_step the run's plain batched step,
  t_draft its drafting time per draft depth), and the best k it predicts; with `sweep_k`, the speedup measured at
  every k as well, and the best k measured;
- lossless (greedy): every row's speculative tokens equal plain batched decoding's, and the batch-1 reference's.
The break-even batch size is where the measured (and the predicted) speedup crosses 1, interpolated in log2 B.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from draftsmith.acceptance import tau_from_accept_lengths, tau_from_conditional
from draftsmith.evalsettings import EvalSettings

from .decoder import BatchResult, GenerationResult, SpeculativeDecoder
from .metrics import alpha_per_position
from .speed import StepCosts, measure_forward_costs

PLAIN = "plain"


def groups(n_prompts: int, batch: int) -> list[list[int]]:
    """Prompt indices in consecutive groups of `batch`; the last group is filled from the first prompts."""
    out = []
    for start in range(0, n_prompts, batch):
        g = list(range(start, min(start + batch, n_prompts)))
        out.append(g + list(range(batch - len(g))))
    return out


def as_batch(res: GenerationResult) -> BatchResult:
    """A batch-1 generation as the batch of one it was."""
    return BatchResult(
        [res],
        time_total=res.time_total,
        time_prefill=res.time_prefill,
        time_draft=res.time_draft,
        forward_rows=[1] * res.target_forwards,
        step_depths=list(res.proposed),
    )


def measure_batches(
    decoder: SpeculativeDecoder,
    drafters: Sequence,
    encoded: list[torch.Tensor],
    settings: EvalSettings,
    *,
    batch1: dict[str, list[GenerationResult]] | None = None,
    progress: bool = True,
) -> dict[str, dict]:
    """Every batch size of `settings.batch_sizes` for every drafter (decode.evaluate.NamedDrafter): {drafter name:
    eval.json's `batch` section}. batch1: the per-prompt runs a batch-1 measurement already made ({"plain": [..],
    name: [..]}, prompt order), reused as the batch size 1 point instead of decoding it again."""
    from tqdm.auto import tqdm

    context = int(sum(t.numel() for t in encoded) / len(encoded)) + settings.max_new_tokens // 2
    per_size: dict[str, dict[int, dict]] = {d.name: {} for d in drafters}
    reference = None  # batch-1 plain tokens per prompt
    for B in settings.batch_sizes:
        gs = groups(len(encoded), B)
        if B == 1 and batch1 is not None and not settings.sweep_k:
            runs = {name: {d.k: [as_batch(r) for r in batch1[d.name]]} for name, d in _named(drafters)}
            plain = [as_batch(r) for r in batch1[PLAIN]]
        else:
            plain, runs = _decode_groups(decoder, drafters, encoded, gs, settings, B, progress, tqdm)
        if B == 1:
            reference = [o.rows[0].tokens for o in plain]
        max_k = max(d.k for d in drafters)
        forward_s = measure_forward_costs(
            decoder.target, range(1, max_k + 2), context, reps=3, decoder=decoder, batch=B
        )
        for name, d in _named(drafters):
            per_size[name][B] = _size_entry(B, gs, plain, runs[name], d.k, settings, forward_s, reference)
    return {name: _section(settings, sizes) for name, sizes in per_size.items()}


def _named(drafters):
    return [(d.name, d) for d in drafters]


def _decode_groups(decoder, drafters, encoded, gs, settings: EvalSettings, B: int, progress: bool, tqdm):
    """Plain decoding and every drafter (at every k of the sweep) on every group; -> (plain, {name: {k: runs}})."""
    methods = [(None, PLAIN, settings.k)]
    for d in drafters:
        methods += [(d.proposer, d.name, k) for k in (range(1, d.k + 1) if settings.sweep_k else [d.k])]
    kw = dict(params=settings.params)
    rows0 = [encoded[i] for i in gs[0]]
    for prop, _, k in methods:  # warm-up: allocator, kernels, this batch shape; excluded from every number
        n = min(settings.warmup_tokens, settings.max_new_tokens)
        decoder.generate_batch(rows0, prop, k=k, max_new_tokens=n, seed=settings.seed, **kw)
    plain: list[BatchResult] = []
    runs: dict[str, dict[int, list[BatchResult]]] = {d.name: {} for d in drafters}
    for j, g in enumerate(tqdm(gs, desc=f"batch {B}", disable=not progress)):
        rows = [encoded[i] for i in g]
        for prop, name, k in (
            methods[j % len(methods) :] + methods[: j % len(methods)]
        ):  # rotate who runs first
            out = decoder.generate_batch(
                rows, prop, k=k, max_new_tokens=settings.max_new_tokens, seed=settings.seed + j, **kw
            )
            (plain if prop is None else runs[name].setdefault(k, [])).append(out)
    return plain, runs


def _tokens_per_s(outs: Sequence[BatchResult]) -> float:
    seconds = sum(o.time_total for o in outs)
    return sum(len(r.tokens) for o in outs for r in o.rows) / seconds if seconds > 0 else 0.0


def step_costs(
    plain: Sequence[BatchResult], spec: Sequence[BatchResult], forward_s: dict[int, float]
) -> StepCosts:
    """Per-step costs at one batch size: the run's plain batched step (prefill excluded), target forwards over n new
    tokens per row from the probe plus the decoder's host work per step (plain step - probe forward of 1), and
    the run's drafting time per draft depth (a step drafts every row at once)."""
    steps = sum(len(o.forward_rows) - 1 for o in plain)
    step_s = sum(o.time_total - o.time_prefill for o in plain) / max(steps, 1)
    host = max(step_s - forward_s[1], 0.0)
    depth = sum(sum(o.step_depths) for o in spec)
    n_steps = sum(len(o.step_depths) for o in spec)
    return StepCosts(
        step_s=step_s,
        verify_s={float(n): s + host for n, s in forward_s.items() if n > 1},
        draft_s=sum(o.time_draft for o in spec) / max(depth, 1),
        drafted_per_step=depth / max(n_steps, 1),
    )


def _size_entry(
    B, gs, plain, runs: dict[int, list[BatchResult]], K: int, settings, forward_s, reference
) -> dict:
    """One batch size of one drafter: measured, predicted, lossless."""
    main = runs[K]
    rows = [r for o in main for r in o.rows]
    tps_plain = _tokens_per_s(plain)
    measured = {}
    for k, outs in sorted(runs.items()):
        tps = _tokens_per_s(outs)
        measured[str(k)] = {
            "tau": tau_from_accept_lengths([a for o in outs for r in o.rows for a in r.accepted]),
            "tokens_per_s": tps,
            "speedup": tps / tps_plain if tps_plain > 0 else None,
        }
    alpha = alpha_per_position(rows, K)
    costs = step_costs(plain, main, forward_s)
    predicted = {
        k: costs.speedup(tau_from_conditional([a or 0.0 for a in alpha], k), k) for k in range(1, K + 1)
    }
    prompt_of = [i for g in gs for i in g]
    plain_rows = [r.tokens for o in plain for r in o.rows]
    spec_rows = [r.tokens for r in rows]
    greedy = settings.params.greedy
    return {
        "batch_size": B,
        "batches": len(gs),
        "rows": len(rows),
        "k": K,
        "tau": measured[str(K)]["tau"],
        "alpha_per_position": alpha,
        "tokens_per_s": {"speculative": measured[str(K)]["tokens_per_s"], "plain": tps_plain},
        "speedup": measured[str(K)]["speedup"],
        "verify_cost": forward_s[1 + K] / forward_s[1],
        "forward_s": {str(n): s for n, s in sorted(forward_s.items())},
        "costs": costs.to_dict(),
        "predicted": {
            "speedup": predicted[K],
            "per_k": {str(k): v for k, v in predicted.items()},
            "best_k": max(predicted, key=predicted.get),
        },
        "measured_per_k": measured if len(measured) > 1 else None,
        "best_k_measured": int(max(measured, key=lambda k: measured[k]["speedup"] or 0.0))
        if len(measured) > 1
        else None,
        "target_rows": {
            "speculative": sum(sum(o.forward_rows) for o in main),
            "plain": sum(sum(o.forward_rows) for o in plain),
        },
        "lossless": (spec_rows == plain_rows) if greedy else None,
        "identical_rows": sum(a == b for a, b in zip(spec_rows, plain_rows)) if greedy else None,
        "same_as_batch1": (
            sum(reference[i] == t for i, t in zip(prompt_of, plain_rows)) if greedy and reference else None
        ),
    }


def _section(settings: EvalSettings, sizes: dict[int, dict]) -> dict:
    order = sorted(sizes)
    return {
        "batch_sizes": order,
        "sweep_k": settings.sweep_k,
        "per_size": {str(B): sizes[B] for B in order},
        "break_even_batch": break_even(order, [sizes[B]["speedup"] for B in order]),
        "break_even_batch_predicted": break_even(order, [sizes[B]["predicted"]["speedup"] for B in order]),
        "lossless": None if not settings.params.greedy else all(sizes[B]["lossless"] for B in order),
        "method": "prompts in consecutive groups of B (the last group filled from the first prompts); plain and "
        "speculative batched decoding of each group back to back, order rotated per group, warm-up excluded; "
        "verify cost and the predicted curve from target forwards over B rows x n new tokens "
        "(decode.speed.measure_forward_costs) and this run's step and drafting times",
    }


def break_even(batch_sizes: Sequence[int], speedups: Sequence[float | None]) -> float | None:
    """The batch size where the speedup falls to 1: interpolated in log2 B between the last size above 1 and the
    first at or below it; None if no measured size is at or below 1 (it pays at every size measured); the first
    size if it is already at or below 1 there."""
    pts = [(B, s) for B, s in zip(batch_sizes, speedups) if s is not None]
    for i, (B, s) in enumerate(pts):
        if s <= 1.0:
            if i == 0:
                return float(B)
            (b0, s0), (b1, s1) = pts[i - 1], (B, s)
            x0, x1 = math.log2(b0), math.log2(b1)
            return 2 ** (x0 + (x1 - x0) * (s0 - 1.0) / (s0 - s1))
    return None
