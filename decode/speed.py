"""Why a drafter is (not) faster than plain decoding, from costs measured in the same run.

Speedup model (Leviathan et al. 2023, Thm 3.8, with measured costs instead of a cost ratio): a speculative step
drafts n tokens (n_bar on average) for n * t_draft, then verifies them in one target forward over 1 + n tokens
for t_verify(1 + n), and commits tau tokens (bonus included); plain decoding commits one token per t_step. So

    speedup = tau * t_step / (n * t_draft + t_verify(1 + n)),   break-even tau = (n * t_draft + t_verify(1 + n)) / t_step.

On a GPU (or a CPU with native bf16 matrix units) t_verify(1 + n) ~ t_step for small n and the draft cost
dominates; on a CPU in fp32 a 135M target is compute-bound as soon as it sees more than one token, so
t_verify(5) ~ 1.6-1.9 t_step and a drafter needs tau ~ 2 just to break even. `explain` turns the measured costs
into that argument, and into what would pay: another k, a drafter without a forward pass, other hardware.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from draftsmith.acceptance import tau_from_conditional, tau_iid

from .results import GenerationResult


@dataclass(frozen=True)
class StepCosts:
    """Seconds measured on one machine in one run (batch 1).

    verify_s maps tokens in one target forward (1 = a plain step; 1 + n = a verify of n drafted tokens/nodes) to
    seconds; other sizes are interpolated linearly (and extrapolated from the last two points)."""

    step_s: float
    verify_s: dict[float, float] = field(default_factory=dict)
    draft_s: float = 0.0  # drafter time per drafted token (bookkeeping included, its prompt prefill not)
    drafted_per_step: float = 0.0  # mean tokens (tree nodes) drafted per verify step in the run
    draft_prefill_s: float = 0.0  # the drafter's prefill of a prompt, mean per prompt (once per request)

    def verify(self, n_tokens: float) -> float:
        """Seconds of one target forward over n_tokens (>= 1) new tokens; never below a plain step (a measured
        multi-token forward faster than a one-token step is timing noise, and would put break-even tau below 1)."""
        return max(self.step_s, self._interpolate(n_tokens))

    def _interpolate(self, n_tokens: float) -> float:
        pts = sorted({1.0: self.step_s, **{float(n): s for n, s in self.verify_s.items()}}.items())
        if len(pts) == 1 or n_tokens <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if n_tokens <= x1:
                return y0 + (y1 - y0) * (n_tokens - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) * (n_tokens - x1) / (x1 - x0)

    def step_cost(self, drafted: float) -> float:
        """Seconds of one speculative step drafting `drafted` tokens (draft + verify)."""
        return drafted * self.draft_s + self.verify(1 + drafted)

    def break_even_tau(self, drafted: float) -> float:
        """The tau (bonus included) at which drafting `drafted` tokens per step matches plain decoding."""
        return self.step_cost(drafted) / self.step_s

    def speedup(self, tau: float, drafted: float) -> float:
        """Predicted speculative / plain tokens per second."""
        return tau * self.step_s / self.step_cost(drafted)

    def to_dict(self) -> dict:
        return {
            "step_s": self.step_s,
            "verify_s": {f"{n:g}": s for n, s in sorted(self.verify_s.items())},
            "draft_s": self.draft_s,
            "drafted_per_step": self.drafted_per_step,
            "draft_prefill_s": self.draft_prefill_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> StepCosts:
        return cls(
            step_s=float(d["step_s"]),
            verify_s={float(n): float(s) for n, s in d.get("verify_s", {}).items()},
            draft_s=float(d.get("draft_s", 0.0)),
            drafted_per_step=float(d.get("drafted_per_step", 0.0)),
            draft_prefill_s=float(d.get("draft_prefill_s", 0.0)),
        )


def costs_from_results(
    spec: Sequence[GenerationResult], plain: Sequence[GenerationResult]
) -> StepCosts | None:
    """Per-step costs of one eval run: plain step = plain decoding time per forward after the prefill; verify =
    speculative time outside drafting per step, at the run's mean 1 + drafted tokens; draft = drafting time per
    drafted token, the drafter's own prompt prefill apart (draft_prefill_s, per prompt); per step, with
    drafted_per_step 0, when the drafter proposed nothing (a confidence stop that never passed, an adaptive draft
    length at 0). None when the run has no plain or no speculative steps to measure."""
    plain_steps = sum(r.target_forwards - 1 for r in plain)
    spec_steps = sum(len(r.accepted) for r in spec)
    drafted = sum(sum(r.verified) - len(r.verified) for r in spec)
    if plain_steps <= 0 or spec_steps <= 0:
        return None
    step_s = sum(r.time_total - r.time_prefill for r in plain) / plain_steps
    drafting = sum(r.time_draft - r.time_draft_prefill for r in spec)
    prefill = sum(r.time_draft_prefill for r in spec) / len(spec)
    if drafted <= 0:
        return StepCosts(step_s=step_s, draft_s=drafting / spec_steps, draft_prefill_s=prefill)
    verify_s = sum(r.time_total - r.time_prefill - r.time_draft for r in spec) / spec_steps
    n_bar = drafted / spec_steps
    return StepCosts(
        step_s=step_s,
        verify_s={1 + n_bar: verify_s},
        draft_s=drafting / drafted,
        drafted_per_step=n_bar,
        draft_prefill_s=prefill,
    )


def with_verify_ratios(costs: StepCosts, ratios: dict[int, float]) -> StepCosts:
    """Add verify costs for other sizes, given as multiples of a plain step measured elsewhere in the same run
    (e.g. `measure_forward_costs`); sizes already measured keep their values."""
    extra = {float(n): r * costs.step_s for n, r in ratios.items() if n > 1}
    near = {round(n) for n in costs.verify_s}
    extra = {n: s for n, s in extra.items() if round(n) not in near}
    return replace(costs, verify_s={**extra, **costs.verify_s})


def iid_alpha_for_tau(tau: float, k: int) -> float | None:
    """The per-token acceptance alpha with tau_iid(alpha, k) = tau (i.i.d. model); None if tau > k + 1."""
    if tau > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # tau_iid grows with alpha: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_iid(mid, k) < tau else (lo, mid)
    return hi


def explain(
    costs: StepCosts,
    tau: float,
    k: int,
    alpha: Sequence[float | None] | None = None,
    measured_speedup: float | None = None,
    tree: bool = False,
) -> list[str]:
    """Lines (Markdown bullets without the bullet) saying why the drafter is slower than plain decoding and what
    would pay, from `costs` measured in the run that measured `tau` (bonus included) and the conditional
    acceptance `alpha` by depth at draft length `k`."""
    n = costs.drafted_per_step
    ms = 1000.0
    if n <= 0:
        return [
            f"The drafter proposed no token in this run (none passed its confidence stop), so every step was a "
            f"plain step ({costs.step_s * ms:.1f} ms) plus {costs.draft_s * ms:.2f} ms of drafting: a slowdown "
            f"of {costs.step_s / (costs.step_s + costs.draft_s):.2f}x at best. It needs training (or a lower "
            "stop_below) before it can pay."
        ]
    v_ratio = costs.verify(1 + n) / costs.step_s
    d_ratio = n * costs.draft_s / costs.step_s
    need = costs.break_even_tau(n)
    what = f"its tree of {n:.1f} nodes" if tree else f"1 + {n:.2f} tokens (mean drafted per step)"
    lines = [
        f"Each step verifies {what} in one target forward costing {v_ratio:.2f}x a plain step "
        f"({costs.verify(1 + n) * ms:.1f} vs {costs.step_s * ms:.1f} ms), and drafting costs "
        f"{costs.draft_s * ms:.2f} ms per drafted token ({d_ratio:.2f} plain steps per step): breaking even "
        f"needs tau >= {need:.2f}, measured tau {tau:.2f} (bonus included). Speedup model "
        f"tau * t_step / (n * t_draft + t_verify(1 + n)) = {costs.speedup(tau, n):.2f}x"
        + (f" (measured {measured_speedup:.2f}x)." if measured_speedup is not None else "."),
        "The larger cost is "
        + (
            f"verifying ({v_ratio - 1:.2f} extra plain steps per step, vs {d_ratio:.2f} for drafting): the "
            "target is compute-bound on this hardware as soon as a forward holds more than one token."
            if v_ratio - 1 >= d_ratio
            else f"drafting ({d_ratio:.2f} plain steps per step, vs {v_ratio - 1:.2f} extra for verifying): a "
            "cheaper drafter (fewer layers, a reduced output vocabulary) or fewer drafted tokens pays first."
        ),
    ]
    if alpha and not tree:
        options = []
        for kk in range(1, k + 1):
            t = tau_from_conditional([a or 0.0 for a in alpha], kk)
            options.append((costs.speedup(t, kk), kk, t))
        best = max(options)
        per_k = ", ".join(f"k={kk}: tau {t:.2f} -> {sp:.2f}x" for sp, kk, t in options)
        # a stop rule drafts only confident tokens: their acceptance overstates that of fixed-length drafts
        caveat = " (upper bounds: this run's drafts stopped early)" if n < k - 0.05 else ""
        if best[0] > 1.0:
            lines.append(
                f"At this run's acceptance by depth, fixed-length drafts give {per_k}{caveat}: "
                f"k={best[1]} would pay."
            )
        else:
            lines.append(
                f"No draft length pays at this run's acceptance by depth ({per_k}){caveat}: the drafter needs a "
                "higher acceptance (more training data or steps, a larger draft)."
            )
        kk = max(round(n), 1)
        a_need = iid_alpha_for_tau(costs.break_even_tau(kk), kk)
        if a_need is not None:
            lines.append(
                f"Drafting {kk} token(s) per step at these costs breaks even at a per-token acceptance of about "
                f"{a_need:.2f} (i.i.d. model)."
            )
    m = max(n, 1.0)
    lines.append(
        f"A drafter without a forward pass (`ngram:`, prompt lookup) pays from tau >= "
        f"{costs.verify(1 + m) / costs.step_s:.2f} at {m:.1f} drafted tokens per step: text that repeats its "
        "context (code edits, summaries) reaches that."
    )
    if v_ratio > 1.15:
        lines.append(
            "On hardware where a forward over a few tokens costs about one step (memory-bound: a GPU, or a CPU "
            f"with AMX bf16) the same drafter would need tau >= {1 + d_ratio:.2f}: its measured tau {tau:.2f} "
            f"would give about {tau / (1 + d_ratio):.2f}x there (if its draft/target cost ratio stayed)."
        )
    return lines


def explain_result(result: dict, verify_ratios: dict[int, float] | None = None) -> list[str]:
    """`explain` for a `draftsmith eval` result (eval.json) whose speedup is below 1; [] otherwise (or when the
    run measured no drafted tokens). `verify_ratios` {n: forward over n tokens / over 1}, measured in the same
    process, adds verify costs for draft lengths the run did not use."""
    speedup, raw = result.get("speedup"), result.get("costs")
    if speedup is None or speedup >= 1.0 or not raw:
        return []
    costs = StepCosts.from_dict(raw)
    if verify_ratios:
        costs = with_verify_ratios(costs, verify_ratios)
    cond = result.get("conditions", {})
    return explain(
        costs,
        result["tau"],
        int(cond.get("k", round(costs.drafted_per_step) or 1)),
        result.get("alpha_per_position"),
        measured_speedup=speedup,
        tree=bool(cond.get("tree")),
    )


@torch.inference_mode()
def measure_forward_costs(
    model,
    sizes: Sequence[int] = (1, 2, 3, 5, 9),
    context: int = 128,
    reps: int = 3,
    *,
    decoder=None,
    warmup: int = 1,
    batch: int = 1,
) -> dict[int, float]:
    """Seconds of one target forward over `batch` rows of n new tokens (n in `sizes`) after a `context`-token KV cache,
    the way the decoder runs it (`SpeculativeDecoder._forward`, which uses a transposed lm_head on CPUs; pass a
    `decoder` built with compile=... to time its StaticCache + compiled step); the cache is cropped back after each
    forward. Median of `reps` runs after `warmup` runs per size (CUDA graphs record on the 2nd call: use 3)."""
    import time

    from .cache import crop_to
    from .decoder import SpeculativeDecoder

    dec = decoder if decoder is not None else SpeculativeDecoder(model, eos_ids=set())
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, context + max(sizes)), generator=gen).to(dec.device)
    cache = dec._new_cache(dec._cache_len(context + max(sizes)))
    dec._forward(ids[:, :context], cache, (), logits_to_keep=1, eager=True)
    out = {}
    for n in sizes:
        times = []
        for _ in range(reps + warmup):
            dec._sync()
            t0 = time.perf_counter()
            dec._forward(ids[:, context : context + n], cache, ())
            dec._sync()
            times.append(time.perf_counter() - t0)
            crop_to(cache, context, current=context + n)
        out[int(n)] = sorted(times[warmup:])[len(times[warmup:]) // 2]
    return out
