"""Drafter specs (`kind:arg`) -> Proposer. `DRAFTERS` maps a kind to a builder; `draftsmith.heads.proposers`
registers `medusa` / `eagle` / `eagle3` when imported (lazily, the first time such a spec is used):

    DRAFTERS["medusa"] = build_medusa   # def build_medusa(arg: str, ctx: DrafterContext) -> Proposer

Builders check tokenizer compatibility *before* loading weights and raise DraftsmithError on bad input.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError

from .proposer import Proposer
from .proposers import DraftModelProposer, NGramProposer


@dataclass
class DrafterContext:
    """What a builder gets: the loaded target (and its spec when known), its tokenizer, device and dtype."""

    target: Any
    tokenizer: Any
    device: torch.device
    dtype: str | torch.dtype | None = None
    target_spec: str | None = None

    @property
    def target_vocab_size(self) -> int:
        cfg = self.target.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return int(cfg.vocab_size)


Builder = Callable[[str, DrafterContext], Proposer]


def parse_kv(arg: str, allowed: dict[str, type], kind: str) -> dict[str, Any]:
    """'max=4,min=1' -> {'max': 4, 'min': 1}; unknown keys raise a one-line error listing the valid ones."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in arg.split(","))):
        key, eq, val = part.partition("=")
        if not eq or key not in allowed:
            raise DraftsmithError(f"bad {kind} option {part!r}; valid: {', '.join(f'{k}=' for k in allowed)}")
        try:
            out[key] = allowed[key](val)
        except ValueError:
            raise DraftsmithError(
                f"{kind} option {key} must be {allowed[key].__name__}, got {val!r}"
            ) from None
    return out


def build_ngram(arg: str, ctx: DrafterContext | None) -> Proposer:
    opts = parse_kv(arg, {"max": int, "min": int}, "ngram")
    return NGramProposer(max_n=opts.get("max", 3), min_n=opts.get("min", 1))


def build_draft(arg: str, ctx: DrafterContext) -> Proposer:
    """`draft:<dir|hub id|.gguf>[,stop_below=P]`: a causal LM with the target's tokenizer (reduced vocab
    honoured); stop_below > 0 ends a step's draft at the first token the draft is less sure of than P."""
    from draftsmith import models
    from draftsmith.compat import _vocab_size, check_tokenizers

    path, _, opts = arg.partition(",")
    if not path:
        raise DraftsmithError("drafter 'draft:' needs a model: draft:<folder|hub id>[,stop_below=0.3]")
    stop_below = parse_kv(opts, {"stop_below": float}, "draft").get("stop_below", 0.0)
    if not 0.0 <= stop_below < 1.0:
        raise DraftsmithError(f"draft option stop_below must be in [0, 1), got {stop_below}")
    ref = models.resolve(path)
    d_cfg = models.load_config(ref)
    d_tok = models.load_tokenizer(ref)
    check_tokenizers(ctx.tokenizer, d_tok, ctx.target_vocab_size, _vocab_size(d_cfg))  # before any weights
    vocab_ids = None
    if ref.kind == "dir" and (Path(ref.path) / "draft_vocab.safetensors").is_file():
        try:
            from draftsmith.distill.vocab import load_draft_vocab
        except ImportError:  # the distill library predates this checkpoint: read the contract tensor directly
            from safetensors.torch import load_file

            def load_draft_vocab(d):
                return load_file(str(Path(d) / "draft_vocab.safetensors"))["vocab_ids"]

        vocab_ids = load_draft_vocab(ref.path)
    model = models.load_model(ref, dtype=ctx.dtype, device=ctx.device)
    return DraftModelProposer(model, ctx.target_vocab_size, vocab_ids, stop_below=stop_below)


DRAFTERS: dict[str, Builder] = {"draft": build_draft, "ngram": build_ngram}
LAZY_KINDS = {
    "medusa": "draftsmith.heads.proposers",
    "eagle": "draftsmith.heads.proposers",
    "eagle3": "draftsmith.heads.proposers",
}


def split_spec(spec: str) -> tuple[str, str]:
    kind, sep, arg = spec.partition(":")
    if not sep:
        raise DraftsmithError(
            f"drafter {spec!r} has no kind; use one of {kinds()} as kind:arg, e.g. draft:path/to/dir"
        )
    return kind, arg


def validate_spec(spec: str) -> tuple[str, str]:
    """Cheap checks before anything loads: known kind, and a model path where the kind needs one."""
    kind, arg = split_spec(spec)
    if kind not in DRAFTERS and kind not in LAZY_KINDS:
        raise DraftsmithError(
            f"unknown drafter kind {kind!r}; use one of {kinds()} (e.g. draft:DIR or ngram:)"
        )
    if kind in ("draft", *LAZY_KINDS) and not arg:
        raise DraftsmithError(f"drafter '{kind}:' needs a checkpoint: {kind}:<folder|hub id>")
    if kind == "ngram":
        build_ngram(arg, None)  # options are checked before any weights load
    return kind, arg


def kinds() -> str:
    return ", ".join(sorted(set(DRAFTERS) | set(LAZY_KINDS)))


def build_proposer(spec: str, ctx: DrafterContext) -> Proposer:
    """Turn 'kind:arg' into a Proposer (loading weights if the kind has any)."""
    kind, arg = split_spec(spec)
    if kind not in DRAFTERS and kind in LAZY_KINDS:
        try:
            importlib.import_module(LAZY_KINDS[kind])  # registers its kinds in DRAFTERS
        except ImportError as e:
            raise DraftsmithError(
                f"drafter kind {kind!r} needs {LAZY_KINDS[kind]}, which failed to import ({e})"
            ) from None
    if kind not in DRAFTERS:
        raise DraftsmithError(
            f"unknown drafter kind {kind!r}; use one of {kinds()} (e.g. draft:DIR or ngram:)"
        )
    return DRAFTERS[kind](arg, ctx)
