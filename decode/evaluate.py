"""`measure()`: a drafter against plain decoding of the same target, in the same run (`draftsmith eval` builds the
target and the drafter from their specs in draftsmith.app.evaluate, then calls this).

For each prompt, plain and speculative decoding run back to back, alternating which goes first (so slow drift
of a shared machine hits both equally); one warm-up prompt runs first and is excluded from every number.
Greedy runs also check losslessness: the speculative tokens must equal the plain tokens. Where they differ, the
target is run once over the common prefix and the two candidate tokens' logits compared: in bf16/fp16 a verify
forward over several tokens rounds differently from a one-token step, so a near-tie (margin within the dtype's
rounding, `tie_tolerance`) can flip the argmax without any bug. Such rows are counted as `near_tie`, reported with
their margin, and do not fail the check; any other difference does.
"""

from __future__ import annotations

import logging
import platform
from collections import defaultdict

import torch

from draftsmith.prompts import Prompt
from draftsmith.sampling import SamplingParams

from .decoder import SpeculativeDecoder
from .metrics import summarize

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


def measure(
    decoder: SpeculativeDecoder,
    proposer,
    prompts: list[Prompt],
    encoded: list[torch.Tensor],
    *,
    k: int,
    params: SamplingParams,
    max_new_tokens: int,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Decode every prompt plainly and speculatively, back to back; return the measured part of eval.json:
    summary numbers, `lossless` (greedy only), `per_category` and one row per prompt. `encoded[i]` [1, T_i]."""
    _warm_up(decoder, proposer, encoded[0], k=k, params=params, max_new_tokens=max_new_tokens, seed=seed)
    rows, spec_res, plain_res = [], [], []
    from tqdm.auto import tqdm

    for i, (prompt, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc="eval", disable=not progress)):
        gen_kw = dict(k=k, params=params, max_new_tokens=max_new_tokens, seed=seed + i)
        if i % 2 == 0:  # alternate which runs first
            plain = decoder.generate(ids, None, **gen_kw)
            spec = decoder.generate(ids, proposer, **gen_kw)
        else:
            spec = decoder.generate(ids, proposer, **gen_kw)
            plain = decoder.generate(ids, None, **gen_kw)
        spec_res.append(spec)
        plain_res.append(plain)
        rows.append(_prompt_row(prompt, ids, spec, plain, params.greedy))
        if params.greedy and spec.tokens != plain.tokens:
            rows[-1]["divergence"] = divergence(decoder.target, ids, plain.tokens, spec.tokens)

    result = summarize(spec_res, plain_res, k)
    result.update(lossless_check(rows) if params.greedy else {"lossless": None})
    result["per_category"] = _per_category(prompts, spec_res, plain_res, k)
    result["prompts"] = rows
    return result


def _warm_up(decoder, proposer, ids, *, k, params, max_new_tokens, seed) -> None:
    """Allocator, kernels, caches: one short plain and one speculative run, excluded from every number."""
    n = min(16, max_new_tokens)
    decoder.generate(ids, None, k=k, params=params, max_new_tokens=n, seed=seed)
    decoder.generate(ids, proposer, k=k, params=params, max_new_tokens=n, seed=seed)


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
        "target_forwards": spec.target_forwards,
        "identical": spec.tokens == plain.tokens if greedy else None,
        "stop_reason": spec.stop_reason,
    }


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
        out[cat] = {key: s[key] for key in ("tau", "speedup", "alpha_per_position", "n_prompts")}
    return out


def tie_tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """Largest margin between two tokens' logits that rounding alone explains: 8 units in the last place of the
    largest logit. Measured on SmolLM2-135M in bf16 (scripts/bench_dtype.py): a logit differs by up to 3.0-3.4 ulp
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
