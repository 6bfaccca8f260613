"""`draftsmith check`: what a target supports, from its config alone (no weights loaded), or whether a draft's
tokenizer matches it.

    draftsmith check --target Qwen/Qwen3-8B            # drafter kinds, export formats and engines for this target
    draftsmith check --target T --draft D              # tokenizer compatibility of a draft LM with the target

The support table has three parts, each row `yes` or `no: <why>`:
- drafter kinds: every kind draftsmith decodes with, refused where its record says it cannot serve the architecture
  (DrafterKind.refuses: the same check decoding and training run before any weight loads);
- export formats: every format of every kind, checked on the config a heads run with the recipe defaults would save
  for this target (Training.plan against ExportFormat.check: aux layers the engines capture, vocabulary layout);
- engines: whether vLLM, SGLang and llama.cpp serve each method for this architecture (ENGINE_TARGETS below).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from draftsmith.app.exporters import gguf
from draftsmith.errors import DraftsmithError
from draftsmith.llamacpp import EAGLE3_TARGET_TYPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: Hub id, folder, .gguf or smollm2-135m")
    p.add_argument(
        "--draft",
        help="draft model (Hub id, folder or .gguf): check its tokenizer against the target's instead",
    )
    p.add_argument("--trust-remote-code", action="store_true")


def run(args: argparse.Namespace) -> int:
    from draftsmith import models

    if args.draft:
        from draftsmith.compat import check_compatible

        check_compatible(args.target, args.draft, args.trust_remote_code)
        print(f"ok: {args.draft} is tokenizer-compatible with {args.target}")
        return 0
    config = models.load_config(args.target, args.trust_remote_code)
    for line in support_table(config, args.target):
        print(line)
    return 0


# -- engines ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineTargets:
    """Which target architectures (HF model_type) one engine serves one method for, and why not elsewhere."""

    engine: str
    method: str
    formats: tuple[str, ...]
    """draftsmith export formats the engine reads for it (empty: the draft LM's own folder or a GGUF of it)."""
    model_types: tuple[str, ...] | None
    """Targets it serves (None: any architecture the engine loads)."""
    why_not: str
    notes: dict[str, str] = field(default_factory=dict)
    """model_type -> a more specific reason than why_not."""


_SGLANG_CAPTURE = ("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe")
_VLLM_EAGLE3 = ("llama", "qwen", "minicpm", "gpt_oss")  # matched as substrings of model_type, as vLLM does
_LLAMACPP_LAYER_INPUTS = tuple(EAGLE3_TARGET_TYPES)  # qwen2 through the pinned build's patch
ENGINE_TARGETS = (
    EngineTargets("vLLM", "medusa", ("vllm-medusa",), None, ""),
    EngineTargets(
        "vLLM",
        "eagle3 / dflash / peagle",
        ("speculators", "speculators-dflash", "speculators-peagle"),
        _VLLM_EAGLE3,
        "vLLM's EAGLE-3 target check accepts model types naming llama, qwen, minicpm or gpt_oss",
    ),
    EngineTargets(
        "SGLang",
        "eagle3 / dflash",
        ("sglang-eagle3", "sglang-dflash"),
        _SGLANG_CAPTURE,
        "its SGLang model class captures no aux hidden states (set_eagle3_layers_to_capture: Llama and its "
        "Mistral/Phi-3 subclasses, Qwen2, Qwen3, Qwen3-MoE)",
    ),
    EngineTargets(
        "llama.cpp",
        "draft LM (draft-simple)",
        (),
        (
            "llama",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen3",
            "qwen3_moe",
            "gemma2",
            "gemma3",
            "gemma3_text",
            "phi3",
        ),
        "convert_hf_to_gguf does not convert this architecture",
    ),
    EngineTargets(
        "llama.cpp",
        "eagle3 / dflash",
        (),
        _LLAMACPP_LAYER_INPUTS,
        "its llama.cpp graph records no layer inputs, which EAGLE-3 and DFlash heads read (llama, qwen3, qwen3moe "
        "and gemma4 graphs do, and qwen2 in draftsmith's pinned build, patched)",
    ),
)


def engine_support(config) -> list[tuple[str, str, str | None]]:
    """(engine, method, None or why not) for a target config."""
    from draftsmith.modeling import text_config

    model_type = text_config(config).model_type
    rows = []
    for e in ENGINE_TARGETS:
        note = e.notes.get(model_type)
        if e.model_types is None:
            ok = True
        elif e.model_types is _VLLM_EAGLE3:
            ok = any(name in model_type for name in e.model_types)
        else:
            ok = model_type in e.model_types
        rows.append((e.engine, e.method, note if note else (None if ok else f"{model_type}: {e.why_not}")))
    return rows


# -- kinds and formats -----------------------------------------------------------------------------------------------
def kind_support(config) -> dict[str, str | None]:
    """Every spec kind -> None (it drafts for this target) or why not."""
    from draftsmith.app.drafters import DRAFTERS

    out = {}
    for name in sorted(DRAFTERS):
        rec = DRAFTERS[name]
        if rec.build is None:
            continue
        out[name] = rec.refuses(config) if rec.refuses is not None else None
    return out


def format_support(config) -> list[tuple[str, str, str | None]]:
    """(kind, format, None or why not) for every export format of every kind: the kind's refusal, else the format's
    check on the config a heads run with the recipe defaults would save for this target."""
    from draftsmith.app.drafters import DRAFTERS
    from draftsmith.config import load_config
    from draftsmith.heads.recipe import HeadsConfig

    kinds = kind_support(config)
    rows = []
    for name in sorted(DRAFTERS):
        rec = DRAFTERS[name]
        for fmt in rec.exports:
            why = kinds.get(name)
            if why is None and fmt.check is not None and rec.training is not None and rec.training.plan:
                cfg = load_config(HeadsConfig, None, [f"head.kind={name}"])
                try:
                    fmt.check(rec.training.plan(cfg, config), "a head trained with the recipe defaults")
                except DraftsmithError as e:
                    why = str(e)
            rows.append((name, fmt.name, why))
        if gguf.format_for(name) is not None:
            rows.append((name, gguf.GGUF, kinds.get(name) or _gguf_refusal(name, config)))
    return rows


def _gguf_refusal(kind: str, config) -> str | None:
    """Why llama.cpp cannot run a `kind` GGUF for this target (None: it can): its engine row."""
    method = "draft LM (draft-simple)" if kind == "draft" else "eagle3 / dflash"
    return next(why for engine, m, why in engine_support(config) if engine == "llama.cpp" and m == method)


def support_table(config, name: str) -> list[str]:
    """The lines `draftsmith check --target` prints."""
    from draftsmith.modeling import sliding_window, text_config

    cfg = text_config(config)
    head = "tied to the embeddings" if getattr(cfg, "tie_word_embeddings", False) else "untied"
    cap = getattr(cfg, "final_logit_softcapping", None)
    window = sliding_window(cfg)
    lines = [
        f"target {name}: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocabulary "
        f"{cfg.vocab_size}, output head {head}"
        + (f", final logit soft-cap {cap:g}" if cap else "")
        + (f", sliding window {window}" if window else ""),
        "drafter kinds:",
    ]
    lines += [f"  {k:<10} {_verdict(why)}" for k, why in kind_support(config).items()]
    lines.append("export formats (a head trained with the recipe defaults):")
    lines += [f"  {k:<10} {f:<19} {_verdict(why)}" for k, f, why in format_support(config)]
    lines.append("engines:")
    lines += [f"  {e:<10} {m:<24} {_verdict(why)}" for e, m, why in engine_support(config)]
    return lines


def _verdict(why: str | None) -> str:
    return "yes" if why is None else f"no: {why}"
