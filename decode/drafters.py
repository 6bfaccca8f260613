"""Builders for the decoder's own drafter kinds (`draft:`, `ngram:`) and the `DrafterContext` every builder gets.

A builder is `def build_x(path: str | None, options: dict, ctx: DrafterContext) -> Proposer`, called with options
already parsed and checked against the kind's record (draftsmith.kinds: `kind:PATH,key=value`); the records and the
table from kind to record live in the app layer (draftsmith.app.drafters). Builders check tokenizer compatibility
*before* loading weights and raise DraftsmithError on bad input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.woq import GROUP, check_group_divides, check_quantizable

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


Builder = Callable[[str | None, dict, DrafterContext], Proposer]


def build_ngram(path: str | None, opts: dict, ctx: DrafterContext | None) -> Proposer:
    """`ngram:[max=N,min=M]`: prompt lookup, no weights."""
    return NGramProposer(max_n=opts.get("max", 3), min_n=opts.get("min", 1))


def build_draft(path: str, opts: dict, ctx: DrafterContext) -> Proposer:
    """`draft:<dir|hub id|.gguf>[,stop_below=P,vocab=PATH,compile=1,bits=4|8,group=G,siblings=S,nodes=N]`: a
    causal LM with the target's tokenizer (reduced vocab honoured); stop_below > 0 ends a step's draft at the first
    token the draft is less sure of than P; vocab= gives a draft without one a reduced output vocabulary (a
    draft_vocab.safetensors or a folder holding one); compile=1 runs its step as one torch.compile graph over a
    static cache; bits= reads its matmul weights as int4 (in groups of `group` input columns) / int8
    (DraftModelProposer, draftsmith.woq); siblings=S adds S alternatives per depth beside the chain (a tree
    verified in the same target forward); nodes=N fills the tree to N nodes with the siblings the draft rates
    highest instead (at most S, default 3, per depth)."""
    from draftsmith import models
    from draftsmith.compat import _vocab_size, check_tokenizers
    from draftsmith.vocab import load_draft_vocab, read_draft_vocab

    stop_below = opts.get("stop_below", 0.0)
    group = opts.get("group", GROUP)
    if opts.get("bits"):
        check_quantizable(opts["bits"], group, device=ctx.device)
    ref = models.resolve(path)
    d_cfg = models.load_config(ref)
    if opts.get("bits") == 4:
        check_group_divides(group, d_cfg)
    d_tok = models.load_tokenizer(ref)
    check_tokenizers(ctx.tokenizer, d_tok, ctx.target_vocab_size, _vocab_size(d_cfg))  # before any weights
    vocab_ids = load_draft_vocab(ref.path) if ref.kind == "dir" else None
    if "vocab" in opts:
        if vocab_ids is not None:
            raise DraftsmithError(
                f"{path} already has a reduced output vocabulary ({vocab_ids.numel()} ids); drop vocab="
            )
        vocab_ids = read_draft_vocab(opts["vocab"], min(_vocab_size(d_cfg), ctx.target_vocab_size))
    model = models.load_model(ref, dtype=ctx.dtype, device=ctx.device)  # app.drafters tunes it
    return DraftModelProposer(
        model,
        ctx.target_vocab_size,
        vocab_ids,
        stop_below=stop_below,
        compile=opts.get("compile", False),
        bits=opts.get("bits", 0),
        group=group,
        siblings=opts.get("siblings", 0),
        nodes=opts.get("nodes", 0),
    )
