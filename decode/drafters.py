"""Builders for the decoder's own drafter kinds (`draft:`, `ngram:`) and what every builder shares: the
`DrafterContext` it gets and `parse_kv` for its `kind:path,key=value` options.

A builder is `def build_x(arg: str, ctx: DrafterContext) -> Proposer`; the table from kind to builder lives in the
app layer (draftsmith.app.drafters). Builders check tokenizer compatibility *before* loading weights and raise
DraftsmithError on bad input.
"""

from __future__ import annotations

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
    from draftsmith.vocab import load_draft_vocab

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
        vocab_ids = load_draft_vocab(ref.path)
    model = models.load_model(ref, dtype=ctx.dtype, device=ctx.device)  # app.drafters tunes it
    return DraftModelProposer(model, ctx.target_vocab_size, vocab_ids, stop_below=stop_below)
