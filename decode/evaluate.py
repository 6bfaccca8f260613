"""`evaluate()`: measure a drafter against plain decoding of the same target, in the same run.

For each prompt, plain and speculative decoding run back to back, alternating which goes first (so slow drift
of a shared machine hits both equally); one warm-up prompt runs first and is excluded from every number.
Greedy runs also check losslessness: the speculative tokens must equal the plain tokens. Where they differ, the
target is run once over the common prefix and the two candidate tokens' logits compared: in bf16/fp16 a verify
forward over several tokens rounds differently from a one-token step, so a near-tie (margin within the dtype's
rounding, `tie_tolerance`) can flip the argmax without any bug. Such rows are counted as `near_tie`, reported with
their margin, and do not fail the check; any other difference does.
"""

from __future__ import annotations

import datetime
import logging
import platform
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

import draftsmith
from draftsmith import models
from draftsmith.errors import DraftsmithError
from draftsmith.prompts import Prompt, load_prompts, prompt_ids
from draftsmith.sampling import SamplingParams

from .decoder import SpeculativeDecoder
from .drafters import DrafterContext, build_proposer, validate_spec
from .metrics import summarize

log = logging.getLogger(__name__)


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:  # Linux: the CPU model is more useful than "x86_64"
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


def evaluate(
    target: str | Any,
    drafter: str,
    prompts: str | list[Prompt],
    *,
    k: int = 4,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 128,
    limit: int | None = None,
    seed: int = 0,
    out_dir: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
    target_model=None,
    tokenizer=None,
    compile: bool = False,
) -> dict:
    """Run plain and speculative decoding on every prompt; return the eval.json dict (COMMON.md contract 3).

    `target` is a model spec (Hub id, folder, .gguf, smollm2-135m) or a loaded model; pass `target_model` /
    `tokenizer` to reuse loaded objects. Writes eval.json, report.md and eval.png into `out_dir` if given.
    `compile`: StaticCache + torch.compile of the target forward (CUDA; see SpeculativeDecoder).
    """
    if k < 1:
        raise DraftsmithError(f"k must be >= 1 (draft tokens per step), got {k}")
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # validates, one-line errors
    kind, drafter_arg = validate_spec(drafter)
    if not isinstance(target, str):
        target_model, target = target, getattr(getattr(target, "config", None), "_name_or_path", "model")
    target_spec = target
    if tokenizer is None:
        tokenizer = models.load_tokenizer(target_spec)
    dev = (
        torch.device(device)
        if device is not None
        else (next(target_model.parameters()).device if target_model is not None else models.default_device())
    )
    if isinstance(prompts, str):
        source = prompts
        prompts = load_prompts(prompts, limit=limit)
    else:
        source = "list"
        prompts = list(prompts)[:limit] if limit else list(prompts)
    if not prompts:
        raise DraftsmithError(f"no prompts loaded from {source}; check the source")
    if target_model is None:
        if kind == "draft":  # tokenizer compatibility from configs + tokenizers, before any weights load
            from draftsmith.compat import check_compatible

            check_compatible(target_spec, drafter_arg)
        target_model = models.load_model(target_spec, dtype=dtype, device=dev)
    ctx = DrafterContext(
        target=target_model, tokenizer=tokenizer, device=dev, dtype=dtype, target_spec=target_spec
    )
    proposer = build_proposer(drafter, ctx)
    decoder = SpeculativeDecoder(target_model, tokenizer, compile=compile)
    limit_len = (decoder.max_positions - max_new_tokens - k - 1) if decoder.max_positions else None
    encoded = [torch.tensor([prompt_ids(tokenizer, p, max_length=limit_len)]) for p in prompts]

    # warm-up (allocator, kernels, caches): excluded from every reported number
    warm = encoded[0]
    decoder.generate(warm, None, k=k, params=params, max_new_tokens=min(16, max_new_tokens), seed=seed)
    decoder.generate(warm, proposer, k=k, params=params, max_new_tokens=min(16, max_new_tokens), seed=seed)

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
        rows.append(
            {
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
                "identical": spec.tokens == plain.tokens if params.greedy else None,
                "stop_reason": spec.stop_reason,
            }
        )
        if params.greedy and spec.tokens != plain.tokens:
            rows[-1]["divergence"] = divergence(target_model, ids, plain.tokens, spec.tokens)

    result = summarize(spec_res, plain_res, k)
    if params.greedy:
        n_same = sum(r["identical"] for r in rows)
        n_tie = sum(bool(r.get("divergence", {}).get("near_tie")) for r in rows)
        result["lossless"] = n_same + n_tie == len(rows)
        result["lossless_detail"] = {
            "identical": n_same,
            "near_tie": n_tie,
            "mismatch": len(rows) - n_same - n_tie,
        }
    else:
        result["lossless"] = None

    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_cat[p.category].append(i)
    result["per_category"] = {}
    for cat, idx in sorted(by_cat.items()):
        s = summarize([spec_res[i] for i in idx], [plain_res[i] for i in idx], k)
        result["per_category"][cat] = {
            key: s[key] for key in ("tau", "speedup", "alpha_per_position", "n_prompts")
        }
    desc = models.describe(target_spec) if _is_spec(target_spec) else {"name": str(target_spec)}
    result["conditions"] = {
        "target": desc.get("hub_id") or desc.get("name"),
        "drafter": drafter,
        "drafter_kind": kind,
        "k": k,
        "tree": getattr(proposer, "tree", None) or False,  # tree proposers describe their tree here
        "compile": compile,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
        "prompts": source,
        "n_prompts": len(prompts),
        "seed": seed,
        "device": str(dev),
        "dtype": str(target_model.dtype).replace("torch.", ""),
        "hardware": _hardware(dev),
        "torch_version": torch.__version__,
        "draftsmith_version": draftsmith.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tau_convention": "tau = tokens per target verify forward, bonus/correction token included",
        "warmup": "first prompt decoded once (16 tokens, plain and speculative) before timing; excluded",
    }
    result["prompts"] = rows
    if out_dir is not None:
        from .report import write_outputs

        write_outputs(result, out_dir)
    return result


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


def _is_spec(spec: str) -> bool:
    try:
        models.resolve(spec)
        return True
    except DraftsmithError:
        return False
