"""The drafter table: `kind:arg` specs -> Proposer. Every drafter kind draftsmith can decode with is one record
(draftsmith.kinds) in DRAFTERS: the head kinds of draftsmith.heads.kinds.HEAD_KINDS plus the decoder's own kinds
(`draft:`, `ngram:`), whose records are defined here.

    build_proposer("eagle:runs/heads/final,top_k=6", DrafterContext(target, tokenizer, device), k=4)

A spec is checked before anything loads (`parse_spec`): the kind, its options against the record's Option bounds,
the folder's kind (read from its config.json), and the draft depth. `--k` (draft tokens per step, the tree depth of
tree drafters) is THE depth: a spec's `depth=` may repeat it but not contradict it, and a drafter that cannot draft
k tokens per step (Medusa with fewer heads, a DFlash block or P-EAGLE head with fewer positions) is refused.
"""

from __future__ import annotations

import json
from collections import ChainMap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from draftsmith.cpulayout import tune_linears
from draftsmith.decode.drafters import DrafterContext, build_draft, build_ngram
from draftsmith.decode.proposer import Proposer
from draftsmith.errors import DraftsmithError
from draftsmith.heads.io import check_aux_layers
from draftsmith.heads.kinds import HEAD_KINDS
from draftsmith.kinds import (
    Card,
    CostModel,
    DrafterKind,
    ExportFormat,
    Option,
    describe_kind,
    folder_kind,
    parse_options,
    spec_for,
)
from draftsmith.vocab import read_draft_vocab
from draftsmith.woq import GROUP, check_quantizable


def _draft_cost(target, settings, opts) -> Proposer:
    """A random causal LM of the draft size published for this target shape (draftsmith.app.shapes.DRAFT_FOR)."""
    from draftsmith.app.shapes import DRAFT_FOR, random_causal_lm
    from draftsmith.decode.proposers import DraftModelProposer

    dtype = next(target.parameters()).dtype
    model = random_causal_lm(DRAFT_FOR[settings.shape], settings.device, dtype, seed=1)
    return DraftModelProposer(
        model, target.config.vocab_size, bits=opts.get("bits", 0), group=opts.get("group", GROUP)
    )


def _draft_example(root: Path, target) -> str:
    from draftsmith.testing import save_tiny_like

    return f"draft:{save_tiny_like(root / 'draft', target, seed=1, num_hidden_layers=1)}"


def _check_draft(opts: dict) -> None:
    """vocab= names a readable vocabulary file, before anything loads (its ids are checked against the draft's vocab
    size when the drafter is built);
    bits= is a width the CPU kernels take and group= one of int4's group sizes, only with bits=4 (the device and
    the draft's widths are checked when the drafter is built, before its weights)."""
    if "vocab" in opts:
        read_draft_vocab(opts["vocab"], None)
    if "bits" in opts:
        check_quantizable(opts["bits"], opts.get("group", GROUP))
    if "nodes" in opts and opts.get("siblings", 1) == 0:
        raise DraftsmithError(
            f"nodes={opts['nodes']} fills the tree with siblings, and siblings=0 allows none; drop one of them"
        )
    if "group" in opts and opts.get("bits") != 4:
        raise DraftsmithError(f"group={opts['group']} sets int4's group size; add bits=4 or drop group=")


def _check_ngram(opts: dict) -> None:
    lo, hi = opts.get("min", 1), opts.get("max", 3)
    if lo > hi:
        raise DraftsmithError(f"ngram needs min <= max, got min={lo} max={hi}; e.g. ngram:max=3,min=1")


def _export_hf(ckpt, out: Path, opts) -> dict:
    from draftsmith.app.exporters.hf import export_hf

    return export_hf(ckpt, out)


DRAFT = DrafterKind(
    name="draft",
    family="decode",
    title="a draft LM (a causal LM with the target's tokenizer)",
    card=Card(
        tag="distillspec",
        text="a distilled draft model: a small causal LM trained by knowledge distillation to agree with the target",
        paper="DistillSpec (Zhou et al., 2024) on speculative decoding (Leviathan et al., 2023)",
        causal_lm=True,
    ),
    build=build_draft,
    options=(
        Option(
            "stop_below",
            float,
            "end a step's draft at the first token drafted below this probability",
            min=0,
            below=1,
        ),
        Option(
            "vocab",
            str,
            "a draft_vocab.safetensors (or a folder holding one, e.g. from draftsmith vocab): draft only those ids",
        ),
        Option(
            "compile",
            bool,
            "run the draft step as one torch.compile graph over a static cache (batch size 1; a CPU: inductor "
            "freezing lays the weights out)",
        ),
        Option(
            "bits",
            int,
            "read the draft's matmul weights as int4 (4, in groups of 32) or int8 (8) on a CPU: fewer bytes a draft "
            "step, decoding still lossless",
            min=4,
            max=8,
        ),
        Option(
            "group",
            int,
            "with bits=4: input columns per scale and zero (32, 64, 128 or 256; default 32); larger reads fewer "
            "bytes, smaller stays closer to the weights",
            min=32,
            max=256,
        ),
        Option(
            "siblings",
            int,
            "beside the chain's token at every depth, verify this many more of the draft's candidates (its next "
            "best greedy, more draws when sampling): a tree from the same draft forwards, for a wider verify",
            min=0,
            max=8,
        ),
        Option(
            "nodes",
            int,
            "a budget of drafted nodes a step (the verify block is 1 + N): the chain, then the siblings the draft "
            "rates most likely to be taken, where its chain is unsure (at most siblings=S per depth, default 3)",
            min=1,
            max=64,
        ),
    ),  # fmt: skip
    check_options=_check_draft,
    path_is_folder=False,
    exports=(ExportFormat("hf", _export_hf, library="transformers"),),
    cost=CostModel(_draft_cost),
    example=_draft_example,
)
NGRAM = DrafterKind(
    name="ngram",
    family="decode",
    title="prompt lookup (n-gram)",
    card=Card(
        tag="prompt-lookup",
        text="n-gram prompt lookup: drafts copied from earlier matches in the context, no weights",
        paper="prompt lookup decoding (Saxena, 2023)",
    ),
    build=build_ngram,
    options=(
        Option("max", int, "longest n-gram looked up", min=1),
        Option("min", int, "shortest n-gram looked up", min=1),
    ),
    needs_path=False,
    check_options=_check_ngram,
    cost=CostModel(lambda target, settings, opts: build_ngram(None, opts, None)),
    example=lambda root, target: "ngram:max=3",
)
DECODER_KINDS: dict[str, DrafterKind] = {"draft": DRAFT, "ngram": NGRAM}
DRAFTERS = ChainMap(DECODER_KINDS, HEAD_KINDS)
"""kind name -> record: every kind a spec, a checkpoint folder or an export can name (a view: a kind added to
HEAD_KINDS is here too)."""


def kinds() -> str:
    """The spec kinds, for messages."""
    return ", ".join(sorted(name for name, rec in DRAFTERS.items() if rec.build is not None))


@dataclass
class DrafterSpec:
    """A checked `kind:arg` spec."""

    record: DrafterKind
    path: str | None
    options: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.record.name


def split_spec(spec: str) -> tuple[str, str]:
    kind, sep, arg = spec.partition(":")
    if not sep:
        raise DraftsmithError(
            f"drafter {spec!r} has no kind; use one of {kinds()} as kind:arg, e.g. draft:path/to/dir"
        )
    rec = DRAFTERS.get(kind)
    if rec is None:
        raise DraftsmithError(
            f"unknown drafter kind {kind!r}; use one of {kinds()} (e.g. draft:DIR or ngram:)"
        )
    if rec.build is None:
        saved = rec.training.saves_as if rec.training else None
        raise DraftsmithError(
            f"{kind} is a training kind; its folders decode as {saved}: use --drafter {saved}:DIR"
            if saved
            else f"{kind} cannot draft; use one of {kinds()}"
        )
    return kind, arg


def parse_spec(spec: str, k: int | None = None) -> DrafterSpec:
    """Check a spec before anything loads (module docstring); `k` is the decoder's draft tokens per step."""
    kind, arg = split_spec(spec)
    rec = DRAFTERS[kind]
    path, text = (arg.partition(",")[::2]) if rec.needs_path else (None, arg)
    if rec.needs_path and not path:
        raise DraftsmithError(f"drafter '{kind}:' needs a {'folder' if rec.path_is_folder else 'checkpoint'}: "
                              f"{kind}:<{'folder' if rec.path_is_folder else 'folder|hub id'}>[,key=value...]")  # fmt: skip
    opts = parse_options(rec.options, text, kind)
    if rec.check_options is not None:
        rec.check_options(opts)
    config = _folder_config(rec, path) if path else None
    if k is not None:
        _check_depth(rec, path, opts, config, k)
    return DrafterSpec(rec, path, opts)


def _folder_config(rec: DrafterKind, path: str) -> dict | None:
    """The folder's config.json (None for a Hub id), after checking it holds a kind this spec decodes."""
    p = Path(path).expanduser()
    if not p.is_dir():
        if rec.path_is_folder:
            raise DraftsmithError(
                f"{rec.name} folder {path} not found; pass the folder written by train/heads.py (final/) or "
                "draftsmith layerskip"
            )
        return None
    held = folder_kind(p)
    if held is None and rec.path_is_folder:
        if not (p / "config.json").is_file():
            raise DraftsmithError(
                f"{path} has no config.json: not a drafter folder; pass the final/ folder written by train/heads.py "
                "or draftsmith layerskip"
            )
        try:
            json.loads((p / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None  # the builder reports an unreadable config.json in its own words
        raise DraftsmithError(
            f"{path}/config.json names no draftsmith drafter kind; pass a {rec.name} folder"
        )
    if held is not None and held not in rec.folder_kinds:
        use = spec_for(DRAFTERS, held)
        raise DraftsmithError(
            f"{path} holds {describe_kind(DRAFTERS, held)}, not what {rec.name}: decodes "
            f"({', '.join(rec.folder_kinds)}); "
            + (f"use --drafter {use}:{path}" if use else f"{held} folders do not draft")
        )
    try:
        return json.loads((p / "config.json").read_text()) if held is not None else None
    except (OSError, json.JSONDecodeError):
        return None  # the builder reports an unreadable config in its own words


def _check_depth(rec: DrafterKind, path: str | None, opts: dict, config: dict | None, k: int) -> None:
    if k < 1:
        raise DraftsmithError(f"k must be >= 1 (draft tokens per step), got {k}")
    if "depth" in opts and opts["depth"] != k:
        raise DraftsmithError(
            f"{rec.name} option depth={opts['depth']} and --k {k} both set the draft depth (tokens per step, the "
            f"tree depth of trees); drop depth= and pass --k {opts['depth']}"
        )
    if rec.max_depth is not None and config is not None:
        try:
            most, why = rec.max_depth(config)
        except (TypeError, ValueError):
            return  # a hand-edited config: the builder refuses it in its own words
        if k > most:
            raise DraftsmithError(
                f"{path} drafts at most {most} tokens per step ({why}) but --k is {k}; pass --k {most} or less"
            )


def validate_spec(spec: str, k: int | None = None, batch: int = 1) -> tuple[str, str]:
    """Cheap checks before anything loads (parse_spec; a compiled step decodes batch size 1); returns (kind, arg)."""
    if parse_spec(spec, k).options.get("compile") and batch > 1:
        raise DraftsmithError(
            f"{spec}: compile=1 drafts one prompt at a time; drop compile=1 or the batch sizes above 1"
        )
    return split_spec(spec)


def check_against_target(spec: str, target_config) -> None:
    """What a drafter folder asks of the target, checked from the target's config before its weights load: the
    kind supports the architecture, and a head's hidden-state taps lie inside the target's layers."""
    DRAFTERS[split_spec(spec)[0]].check_target(target_config)
    s = parse_spec(spec)
    config = _folder_config(s.record, s.path) if s.path else None
    if config is not None and "aux_hidden_state_layer_ids" in config:
        check_aux_layers(config, target_config, s.path)


def build_proposer(spec: str, ctx: DrafterContext, k: int | None = None) -> Proposer:
    """Turn 'kind:arg' into a Proposer (loading weights if the kind has any)."""
    DRAFTERS[split_spec(spec)[0]].check_target(ctx.target.config)  # the architecture, before the folder
    s = parse_spec(spec, k)
    return tune_proposer(s.record.build(s.path, s.options, ctx))


def tune_proposer(proposer: Proposer) -> Proposer:
    """Freeze the proposer's own modules (decode only) and give them the CPU weight layout (draftsmith.cpulayout),
    unless the proposer compiles its step (inductor lays the weights out in its graph)."""
    for value in vars(proposer).values():
        if isinstance(value, nn.Module):
            value.requires_grad_(False)
            if not getattr(proposer, "compiles", False):
                tune_linears(value)
    return proposer
