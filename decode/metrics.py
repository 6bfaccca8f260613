"""Aggregate per-generation statistics into the eval.json numbers.

- tau: mean tokens committed per verify forward, *bonus/correction token included* (EAGLE convention),
  over every verify step (steps where the drafter proposed nothing count as tau = 1).
- alpha_per_position[i-1]: P(depth i accepted | depths < i accepted and the drafter proposed depth i)
  = #steps accepting >= i / #steps accepting >= i-1 that proposed >= i. With these conditionals,
  tau_from_conditional(alpha) = 1 + sum_i prod_{j<=i} alpha_j predicts tau for full-length proposals.
- speedup: tokens/s of speculative over tokens/s of plain decoding, both measured in the same run, end to end
  (prompt prefills included); speedup_decode: the same after the first token (tokens after the first over the time
  after the target's prefill and the drafter's own), the decode rate serving benchmarks report beside the time to
  first token. The first token comes from the target's prefill alone, so the time to first token is the target's
  prefill with or without a drafter (prefill_s: target, drafter, plain, mean per prompt); the drafter's prefill
  delays the second token.
- costs: seconds per plain step, per verify step, per drafted token (decode.speed.costs_from_results).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from draftsmith.acceptance import tau_from_accept_lengths

from .decoder import GenerationResult
from .speed import costs_from_results


def alpha_per_position(results: Sequence[GenerationResult], k: int) -> list[float | None]:
    """Conditional acceptance per draft depth 1..k (None where no step reached that depth)."""
    out: list[float | None] = []
    steps = [(a, p) for r in results for a, p in zip(r.accepted, r.proposed)]
    for i in range(1, k + 1):
        den = sum(1 for a, p in steps if a >= i - 1 and p >= i)
        num = sum(1 for a, p in steps if a >= i and p >= i)
        out.append(num / den if den else None)
    return out


def decode_rate(results: Sequence[GenerationResult], drafter: bool = False) -> float | None:
    """Tokens per second after the first token: the tokens after it over the time after the target's prefill
    (and the drafter's own, `drafter`); None without such tokens or time."""
    tokens = sum(len(r.tokens) - 1 for r in results)
    seconds = sum(r.time_total - r.time_prefill - (r.time_draft_prefill if drafter else 0.0) for r in results)
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarize(spec: Sequence[GenerationResult], plain: Sequence[GenerationResult], k: int) -> dict:
    """Numbers for one set of prompts: speculative results and the plain baselines of the same prompts."""
    steps = [a for r in spec for a in r.accepted]
    spec_tokens = sum(len(r.tokens) for r in spec)
    plain_tokens = sum(len(r.tokens) for r in plain)
    spec_time = sum(r.time_total for r in spec)
    plain_time = sum(r.time_total for r in plain)
    tps_spec = spec_tokens / spec_time if spec_time > 0 else 0.0
    tps_plain = plain_tokens / plain_time if plain_time > 0 else 0.0
    decode_spec, decode_plain = decode_rate(spec, drafter=True), decode_rate(plain)
    return {
        "tau": tau_from_accept_lengths(steps),
        "alpha_per_position": alpha_per_position(spec, k),
        "accept_length_hist": {str(n): c for n, c in sorted(Counter(steps).items())},
        "tokens_per_s": {"speculative": tps_spec, "plain": tps_plain},
        "speedup": tps_spec / tps_plain if tps_plain > 0 else None,
        "speedup_decode": decode_spec / decode_plain if decode_spec and decode_plain else None,
        "tokens_per_s_decode": {"speculative": decode_spec, "plain": decode_plain},
        "prefill_s": {
            "target": _mean(r.time_prefill for r in spec),
            "drafter": _mean(r.time_draft_prefill for r in spec),
            "plain": _mean(r.time_prefill for r in plain),
        },
        "target_forwards": sum(r.target_forwards for r in spec),  # prefill included
        "target_forwards_plain": sum(r.target_forwards for r in plain),
        "draft_time_share": sum(r.time_draft for r in spec) / spec_time if spec_time > 0 else 0.0,
        "n_prompts": len(spec),
        "new_tokens": {"speculative": spec_tokens, "plain": plain_tokens},
        # per-step costs of this run (decode.speed): what the report's "why slower" explanation is computed from
        "costs": costs.to_dict() if (costs := costs_from_results(spec, plain)) else None,
    }
