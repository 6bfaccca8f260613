"""`evaluate()`: a drafter spec measured against plain decoding of the same target (what `draftsmith eval` and the
quickstart call). Loads the target, builds the drafter from the drafter table, hands both to
draftsmith.decode.evaluate.measure with the run's `EvalSettings`, and records them as the run's conditions.

`load_drafters` and `encode_prompts` are the one path from drafter specs and prompts to what `measure` takes; every
measurement of named drafters on a loaded target goes through them (`draftsmith eval`, `draftsmith bench drafters`
and the showcase, `draftsmith bench loss-ablation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith import cpulayout, models
from draftsmith.app.drafters import build_proposer, check_against_target, split_spec, validate_spec
from draftsmith.compat import check_compatible
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.drafters import DrafterContext
from draftsmith.decode.evaluate import NamedDrafter, hardware, measure
from draftsmith.decode.report import RESULT_FILES, write_outputs
from draftsmith.decode.rowwise import batched
from draftsmith.errors import DraftsmithError
from draftsmith.evalsettings import EvalSettings, conditions
from draftsmith.fileio import check_output_dir
from draftsmith.prompts import Prompt, load_prompts, prompt_ids

ADAPTIVE_KINDS = ("draft", "ngram")
"""Drafter kinds whose proposers skip a step's draft at no cost (`adaptive_k`), which `--k auto` needs."""


def evaluate(
    target: str | Any,
    drafter: str,
    prompts: str | list[Prompt],
    settings: EvalSettings | None = None,
    *,
    out_dir: str | Path | None = None,
    overwrite: bool = False,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    target_model=None,
    tokenizer=None,
    progress: bool = True,
) -> dict:
    """Run plain and speculative decoding on every prompt; return the eval.json dict (measured numbers, per-prompt
    rows, and the conditions they were measured under: `settings` as used plus what the run ran on).

    `target` is a model spec (Hub id, folder, .gguf, smollm2-135m) or a loaded model; pass `target_model` /
    `tokenizer` to reuse loaded objects. Writes eval.json, report.md and eval.png into `out_dir` if given.
    An `out_dir` holding results is refused unless `overwrite`; it is checked before anything loads.
    """
    settings = settings or EvalSettings()
    if out_dir is not None:  # an unwritable folder must fail now, not after all the decoding
        check_output_dir(out_dir, RESULT_FILES, overwrite)
    if settings.adaptive_k and (kind := split_spec(drafter)[0]) not in ADAPTIVE_KINDS:
        raise DraftsmithError(
            f"--k auto skips drafting for the steps where it does not pay, which {kind}: drafters cannot; use a "
            f"fixed --k, or a {' or '.join(k + ':' for k in ADAPTIVE_KINDS)} drafter"
        )
    kind, drafter_arg = validate_spec(drafter, k=settings.k, batch=max(settings.batch_sizes, default=1))
    load_device = _device(device)  # a device this machine lacks is refused before the prompts are read
    if not isinstance(target, str):
        target_model, target = target, getattr(getattr(target, "config", None), "_name_or_path", "model")
    source, prompts = _load_prompts(prompts, settings.limit)
    if settings.batch_sizes and max(settings.batch_sizes) > len(prompts):
        raise DraftsmithError(
            f"--batch-size {max(settings.batch_sizes)} needs at least as many prompts, got {len(prompts)} from "
            f"{source}; lower the batch size or raise --limit"
        )
    tokenizer = tokenizer if tokenizer is not None else models.load_tokenizer(target)
    # encoded before any weights load: a prompt too long for the context, or no room for the answer, is refused now
    target_config = target_model.config if target_model is not None else models.load_config(target)
    encoded = encode_prompts(_max_positions(target_config), tokenizer, prompts, settings)
    check_against_target(drafter, target_config)
    if target_model is None:
        if kind == "draft":  # tokenizer compatibility from configs + tokenizers, before any weights load
            check_compatible(target, drafter_arg.partition(",")[0])
        target_model = models.load_model(target, dtype=dtype, device=load_device, inference=True)
    decoder, (named,) = load_drafters(
        target_model,
        tokenizer,
        [("drafter", drafter, settings.k, False)],
        target_spec=target,
        device=None if device is None else _device(device),
        dtype=dtype,
        settings=settings,
    )
    proposer = named.proposer
    measured = measure(decoder, [named], prompts, encoded, settings, progress=progress)
    result = measured["drafters"]["drafter"]
    result["conditions"] = run_conditions(
        settings, target, target_model, drafter, proposer, source=source, n_prompts=len(prompts)
    )
    result["prompts"] = result.pop("prompts")  # rows last in eval.json, after the conditions
    if out_dir is not None:
        write_outputs(result, out_dir)
    return result


def load_drafters(
    target_model,
    tokenizer,
    specs: Sequence[tuple[str, str, int, bool]],
    *,
    target_spec: str | None,
    settings: EvalSettings,
    device: torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> tuple[SpeculativeDecoder, list[NamedDrafter]]:
    """The decoder over a loaded target and one NamedDrafter per (name, spec, k, auto), each built from the drafter
    table on that target (device: the target's unless given). A drafter that cannot decode a batch is refused here
    when `settings` asks for batches, before any decoding."""
    dev = next(target_model.parameters()).device if device is None else device
    ctx = DrafterContext(
        target=target_model, tokenizer=tokenizer, device=dev, dtype=dtype, target_spec=target_spec
    )
    drafters = []
    for name, spec, k, auto in specs:
        proposer = build_proposer(spec, ctx, k=k)
        if max(settings.batch_sizes, default=1) > 1 and not hasattr(batched(proposer), "retain"):
            raise DraftsmithError(
                f"drafter {split_spec(spec)[0]!r} cannot decode a batch yet; drop --batch-size"
            )
        drafters.append(NamedDrafter(name, proposer, k, auto=auto))
    return SpeculativeDecoder(target_model, tokenizer, compile=settings.compile), drafters


def _device(device) -> torch.device:
    return models.parse_device(device) if device is not None else models.default_device()


def _load_prompts(prompts: str | list[Prompt], limit: int | None) -> tuple[str, list[Prompt]]:
    """(source name, prompts): a prompt source spec is loaded, a list is taken as given (first `limit`)."""
    if isinstance(prompts, str):
        source, loaded = prompts, load_prompts(prompts, limit=limit)
    else:
        source, loaded = "list", (list(prompts)[:limit] if limit else list(prompts))
    if not loaded:
        raise DraftsmithError(f"no prompts loaded from {source}; check the source")
    return source, loaded


def _max_positions(cfg) -> int:
    """The target's context (SpeculativeDecoder.max_positions), from its config."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(cfg, "max_position_embeddings", 0) or 0)


def encode_prompts(max_positions: int, tokenizer, prompts: list[Prompt], settings: EvalSettings):
    """Token ids [1, T] per prompt, each refused unless it leaves the answer and the k + 1 lookahead room in the
    target's context of `max_positions` (0: unbounded)."""
    room = max_positions - settings.max_new_tokens - settings.k - 1 if max_positions else None
    return [torch.tensor([prompt_ids(tokenizer, p, max_length=room)]) for p in prompts]


def run_conditions(
    settings: EvalSettings, target_spec, target_model, drafter: str, proposer, *, source: str, n_prompts: int
) -> dict:
    """eval.json `conditions` for one drafter measured on a loaded target (draftsmith.evalsettings.conditions)."""
    desc = models.describe(target_spec) if _is_spec(target_spec) else {"name": str(target_spec)}
    dev = next(target_model.parameters()).device
    return conditions(
        settings,
        target=desc.get("hub_id") or desc.get("name"),
        drafter=drafter,
        drafter_kind=drafter.partition(":")[0],
        tree=getattr(proposer, "tree", None) or False,  # tree proposers describe their tree here
        prompts=source,
        n_prompts=n_prompts,
        device=str(dev),
        dtype=str(target_model.dtype).replace("torch.", ""),
        hardware=hardware(dev),
        cpu_layout=cpulayout.describe(getattr(target_model, "draftsmith_cpu_layout", None)),
    )


def _is_spec(spec: str) -> bool:
    try:
        models.resolve(spec)
        return True
    except DraftsmithError:
        return False
