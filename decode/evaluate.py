"""`measure()`: named drafters against plain decoding of the same target, in the same run (`draftsmith eval` builds
the target and one drafter from their specs in draftsmith.app.evaluate, `draftsmith bench drafters` several).

For each prompt, plain decoding and every drafter run back to back, in an order rotated per prompt (so slow drift
of a shared machine hits every method equally); one warm-up of the first prompt per method runs first and is
excluded from every number. Greedy runs also check losslessness: the speculative tokens must equal the plain tokens.
Where they differ, the target is run once over the common prefix and the two candidate tokens' logits compared: in
bf16/fp16 a verify forward over several tokens rounds differently from a one-token step, so a near-tie (margin
within the dtype's rounding, `tie_tolerance`) can flip the argmax without any bug. Such rows are counted as
`near_tie`, reported with their margin, and do not fail the check; any other difference does.
"""

from __future__ import annotations

import logging
import platform
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.evalsettings import EvalSettings
from draftsmith.prompts import Prompt

from .adaptive import AdaptiveK, start_policy
from .batching import PLAIN, measure_batches
from .decoder import GenerationResult, SpeculativeDecoder
from .metrics import decode_rate, summarize
from .proposer import Proposer, proposal_nodes

log = logging.getLogger(__name__)


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:  # Linux: the CPU model is more useful than "x86_64"
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


@dataclass
class NamedDrafter:
    """One drafter of a measurement: its name in the results, its proposer and its draft length."""

    name: str
    proposer: Proposer
    k: int
    """Draft tokens per step (with `adaptive`, the most a step may take)."""
    auto: bool = False
    """An adaptive draft length for this drafter alone (settings.adaptive_k: for every drafter)."""
    adaptive: AdaptiveK | None = None
    """Each step's draft length from this policy (auto; measure() builds it after the warm-up)."""


def measure(
    decoder: SpeculativeDecoder,
    drafters: Sequence[NamedDrafter],
    prompts: list[Prompt],
    encoded: list[torch.Tensor],
    settings: EvalSettings,
    *,
    progress: bool = True,
) -> dict:
    """Decode every prompt plainly and with every drafter, back to back; return {"plain": plain decoding's numbers,
    "drafters": {name: the measured part of an eval.json}}: summary numbers, `lossless` (greedy only),
    `per_category` and one row per prompt. `encoded[i]` [1, T_i]."""
    names = [d.name for d in drafters]
    if PLAIN in names or len(set(names)) != len(names):
        raise ValueError(f"drafter names must be unique and not {PLAIN!r}: {names}")
    methods: list[NamedDrafter | None] = [None, *drafters]  # None: plain decoding
    reserve(decoder, drafters, encoded, settings.max_new_tokens)
    warm = _warm_up(decoder, methods, encoded[0], settings)
    for d in drafters:  # an adaptive draft length's policy, from costs measured now (decode.adaptive)
        if d.auto or settings.adaptive_k:
            d.adaptive = start_policy(decoder, d.proposer, d.k, warm[d.name], warm[PLAIN])
    runs: dict[str, list[GenerationResult]] = {PLAIN: [], **{n: [] for n in names}}
    from tqdm.auto import tqdm

    for i, ids in enumerate(tqdm(encoded, desc="eval", disable=not progress)):
        for m in methods[i % len(methods) :] + methods[: i % len(methods)]:  # rotate which runs first
            runs[m.name if m else PLAIN].append(_generate(decoder, m, ids, settings, seed=settings.seed + i))
    plain = runs[PLAIN]
    greedy = settings.params.greedy
    results = {
        d.name: _drafter_result(decoder, prompts, encoded, runs[d.name], plain, d.k, greedy) for d in drafters
    }
    for d in drafters:
        if d.adaptive is not None:
            results[d.name]["k_policy"] = policy_summary(d.adaptive, runs[d.name])
    if settings.batch_sizes:  # batch size 1 is the run above; the others decode the prompts in batches
        sections = measure_batches(decoder, drafters, encoded, settings, batch1=runs, progress=progress)
        for name, section in sections.items():
            results[name]["batch"] = section
    return {PLAIN: _plain_numbers(plain), "drafters": results}


def _generate(
    decoder, method: NamedDrafter | None, ids, settings: EvalSettings, seed: int, max_new_tokens=None
):
    return decoder.generate(
        ids,
        method.proposer if method else None,
        k=(method.adaptive or method.k) if method else settings.k,
        params=settings.params,
        max_new_tokens=max_new_tokens or settings.max_new_tokens,
        seed=seed,
    )


def reserve(
    decoder, drafters: Sequence[NamedDrafter], encoded: list[torch.Tensor], max_new_tokens: int
) -> None:
    """Size every static buffer of the run once, for its longest prompt (`encoded`: [1, T] each): the compiled
    target's caches and a compiled draft's (their `reserve`), so that no prompt compiles a step for new buffer
    lengths inside its measured time."""
    longest = max(ids.shape[-1] for ids in encoded) + max_new_tokens + 1
    nodes = max((proposal_nodes(d.proposer, d.k) for d in drafters), default=0)
    decoder.reserve(longest + nodes)
    for d in drafters:
        if hasattr(d.proposer, "reserve"):
            d.proposer.reserve(longest + d.k)


def _warm_up(decoder, methods, ids, settings: EvalSettings) -> dict[str, GenerationResult]:
    """Allocator, kernels, caches, compiled graphs: every drafter's own warm-up (a compiled draft compiles its
    steps), then one short run of every method, excluded from every number."""
    n = min(settings.warmup_tokens, settings.max_new_tokens)
    for m in methods:
        if m is not None and hasattr(m.proposer, "warm_up"):
            m.proposer.warm_up()
    return {
        m.name if m else PLAIN: _generate(decoder, m, ids, settings, seed=settings.seed, max_new_tokens=n)
        for m in methods
    }


def _plain_numbers(plain: list[GenerationResult]) -> dict:
    tokens = sum(len(r.tokens) for r in plain)
    seconds = sum(r.time_total for r in plain)
    steps = sum(r.target_forwards - 1 for r in plain)
    return {
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "new_tokens": tokens,
        "target_forwards": sum(r.target_forwards for r in plain),
        # one plain step after the prefill (what decode.speed.costs_from_results calls step_s)
        "step_s": sum(r.time_total - r.time_prefill for r in plain) / steps if steps > 0 else None,
    }


def _drafter_result(decoder, prompts, encoded, spec: list, plain: list, k: int, greedy: bool) -> dict:
    rows = []
    for prompt, ids, s, p in zip(prompts, encoded, spec, plain):
        rows.append(_prompt_row(prompt, ids, s, p, greedy))
        if greedy and s.tokens != p.tokens:
            rows[-1]["divergence"] = divergence(decoder.target, ids, p.tokens, s.tokens)
    result = summarize(spec, plain, k)
    result.update(lossless_check(rows) if greedy else {"lossless": None})
    result["per_category"] = _per_category(prompts, spec, plain, k)
    result["prompts"] = rows
    return result


def _prompt_row(prompt: Prompt, ids: torch.Tensor, spec, plain, greedy: bool) -> dict:
    return {
        "id": prompt.id,
        "category": prompt.category,
        "prompt_tokens": ids.shape[1],
        "new_tokens": len(spec.tokens),
        "new_tokens_plain": len(plain.tokens),
        "tau": spec.tau,
        "accepted": spec.accepted,
        "time_s": spec.time_total,
        "time_plain_s": plain.time_total,
        "draft_time_s": spec.time_draft,
        # prefills apart: the target's (the first token, plain and speculative alike) and the drafter's own
        "prefill_s": spec.time_prefill,
        "prefill_plain_s": plain.time_prefill,
        "draft_prefill_s": spec.time_draft_prefill,
        "speedup": (len(spec.tokens) / spec.time_total) / (len(plain.tokens) / plain.time_total)
        if spec.time_total > 0 and plain.time_total > 0
        else None,
        "speedup_decode": _ratio(decode_rate([spec], drafter=True), decode_rate([plain])),
        "target_forwards": spec.target_forwards,
        "identical": spec.tokens == plain.tokens if greedy else None,
        "stop_reason": spec.stop_reason,
        **({"k_policy": spec.k_policy} if spec.k_policy is not None else {}),
    }


def policy_summary(policy: AdaptiveK, spec: list[GenerationResult]) -> dict:
    """eval.json's `k_policy`: the costs the adaptive draft length started from and its decisions over the run
    (each prompt's row holds its own)."""
    chosen: dict[str, int] = defaultdict(int)
    for r in spec:
        for k, n in (r.k_policy or {}).get("chosen", {}).items():
            chosen[k] += n
    return {
        "k_max": policy.k_max,
        "start_costs": policy.costs.to_dict(),
        "chosen": dict(sorted(chosen.items(), key=lambda kv: int(kv[0]))),
        "plain_steps": chosen.get("0", 0),
        "probes": sum((r.k_policy or {}).get("probes", 0) for r in spec),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def lossless_check(rows: list[dict]) -> dict:
    """Greedy rows -> {"lossless", "lossless_detail"}: identical rows and near-ties pass, anything else fails."""
    n_same = sum(r["identical"] for r in rows)
    n_tie = sum(bool(r.get("divergence", {}).get("near_tie")) for r in rows)
    return {
        "lossless": n_same + n_tie == len(rows),
        "lossless_detail": {"identical": n_same, "near_tie": n_tie, "mismatch": len(rows) - n_same - n_tie},
    }


def _per_category(prompts: list[Prompt], spec_res: list, plain_res: list, k: int) -> dict:
    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_cat[p.category].append(i)
    out = {}
    for cat, idx in sorted(by_cat.items()):
        s = summarize([spec_res[i] for i in idx], [plain_res[i] for i in idx], k)
        out[cat] = {
            key: s[key] for key in ("tau", "speedup", "speedup_decode", "alpha_per_position", "n_prompts")
        }
    return out


def tie_tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """Largest margin between two tokens' logits that rounding alone explains: 8 units in the last place of the
    largest logit. Measured on SmolLM2-135M in bf16 (`draftsmith bench dtype`): a logit differs by up to 3.0-3.4 ulp
    (~0.6 at logits of 34) between one-token steps and a multi-token forward, so a margin moves by up to ~7 ulp.
    In fp32 the same rule gives ~3e-5: effectively exact."""
    return 8.0 * torch.finfo(dtype).eps * float(logits.abs().max())


@torch.no_grad()
def divergence(model, prompt: torch.Tensor, plain: list[int], spec: list[int]) -> dict:
    """Where greedy speculative output `spec` first leaves `plain`, and whether the target's logits there are a
    near-tie between the two tokens (see module docstring). A length-only difference is never a tie."""
    j = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    out = {"position": j, "plain_token": None, "spec_token": None, "margin": None, "near_tie": False}
    if j >= min(len(plain), len(spec)):
        return out
    dev = next(model.parameters()).device
    ids = torch.cat([prompt.reshape(1, -1), torch.tensor([plain[:j]], dtype=torch.long)], dim=1).to(dev)
    logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    margin = float(logits[plain[j]] - logits[spec[j]])
    tol = tie_tolerance(next(model.parameters()).dtype, logits)
    out.update(
        plain_token=plain[j],
        spec_token=spec[j],
        margin=round(margin, 6),
        tolerance=round(tol, 6),
        near_tie=abs(margin) <= tol,
    )
    return out
