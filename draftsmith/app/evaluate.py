"""`evaluate()`: a drafter spec measured against plain decoding of the same target (what `draftsmith eval`, the
quickstart and the trainers' final eval call). Loads the target, builds the drafter from the drafter table, hands
both to draftsmith.decode.evaluate.measure, and records the conditions of the measurement.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch

import draftsmith
from draftsmith import cpulayout, models
from draftsmith.app.drafters import build_proposer, validate_spec
from draftsmith.compat import check_compatible
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.drafters import DrafterContext
from draftsmith.decode.evaluate import hardware, measure
from draftsmith.decode.report import RESULT_FILES, write_outputs
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir
from draftsmith.prompts import Prompt, check_limit, load_prompts, prompt_ids
from draftsmith.sampling import SamplingParams


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
    overwrite: bool = False,
) -> dict:
    """Run plain and speculative decoding on every prompt; return the eval.json dict (measured numbers, per-prompt
    rows, and the conditions they were measured under).

    `target` is a model spec (Hub id, folder, .gguf, smollm2-135m) or a loaded model; pass `target_model` /
    `tokenizer` to reuse loaded objects. Writes eval.json, report.md and eval.png into `out_dir` if given.
    `compile`: StaticCache + torch.compile of the target forward (CUDA; see SpeculativeDecoder).
    An `out_dir` holding results is refused unless `overwrite`; it is checked before anything loads.
    """
    if out_dir is not None:  # an unwritable folder must fail now, not after all the decoding
        check_output_dir(out_dir, RESULT_FILES, overwrite)
    check_limit(limit)
    if k < 1:
        raise DraftsmithError(f"k must be >= 1 (draft tokens per step), got {k}")
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # validates, one-line errors
    kind, drafter_arg = validate_spec(drafter, k=k)
    if not isinstance(target, str):
        target_model, target = target, getattr(getattr(target, "config", None), "_name_or_path", "model")
    target_spec = target
    if tokenizer is None:
        tokenizer = models.load_tokenizer(target_spec)
    dev = (
        models.parse_device(device)
        if device is not None or target_model is None
        else next(target_model.parameters()).device
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
            check_compatible(target_spec, drafter_arg.partition(",")[0])
        target_model = models.load_model(target_spec, dtype=dtype, device=dev, inference=True)
    ctx = DrafterContext(
        target=target_model, tokenizer=tokenizer, device=dev, dtype=dtype, target_spec=target_spec
    )
    proposer = build_proposer(drafter, ctx)
    decoder = SpeculativeDecoder(target_model, tokenizer, compile=compile)
    limit_len = (decoder.max_positions - max_new_tokens - k - 1) if decoder.max_positions else None
    encoded = [torch.tensor([prompt_ids(tokenizer, p, max_length=limit_len)]) for p in prompts]

    result = measure(
        decoder,
        proposer,
        prompts,
        encoded,
        k=k,
        params=params,
        max_new_tokens=max_new_tokens,
        seed=seed,
        progress=progress,
    )
    result["conditions"] = _conditions(
        target_spec,
        drafter,
        kind,
        proposer,
        target_model,
        dev,
        source=source,
        n_prompts=len(prompts),
        k=k,
        compile=compile,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    result["prompts"] = result.pop("prompts")  # rows last in eval.json, after the conditions
    if out_dir is not None:
        write_outputs(result, out_dir)
    return result


def _conditions(target_spec, drafter, kind, proposer, target_model, dev, **settings) -> dict:
    desc = models.describe(target_spec) if _is_spec(target_spec) else {"name": str(target_spec)}
    return {
        "target": desc.get("hub_id") or desc.get("name"),
        "drafter": drafter,
        "drafter_kind": kind,
        "k": settings.pop("k"),
        "tree": getattr(proposer, "tree", None) or False,  # tree proposers describe their tree here
        "compile": settings.pop("compile"),
        "temperature": settings["temperature"],
        "top_p": settings["top_p"],
        "top_k": settings["top_k"],
        "max_new_tokens": settings["max_new_tokens"],
        "prompts": settings["source"],
        "n_prompts": settings["n_prompts"],
        "seed": settings["seed"],
        "device": str(dev),
        "dtype": str(target_model.dtype).replace("torch.", ""),
        "hardware": hardware(dev),
        "cpu_layout": cpulayout.describe(getattr(target_model, "draftsmith_cpu_layout", None)),
        "torch_version": torch.__version__,
        "draftsmith_version": draftsmith.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tau_convention": "tau = tokens per target verify forward, bonus/correction token included",
        "warmup": "first prompt decoded once (16 tokens, plain and speculative) before timing; excluded",
    }


def _is_spec(spec: str) -> bool:
    try:
        models.resolve(spec)
        return True
    except DraftsmithError:
        return False
