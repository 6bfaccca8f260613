"""One record per drafter kind: everything draftsmith knows about a kind, in one place.

A kind is what a drafter spec names (`eagle3:DIR`), what a head folder's config.json records (`draftsmith_head_type`)
and what a heads recipe trains (`head.kind`). Its `DrafterKind` record holds the spec's options and proposer builder,
the recipe fields, module, loss, held-out eval and hidden-state needs of its trainer, the loader and tensor layout of
its folder, its export formats, its cost-model builder and a small random example (the GPU check's case and the CPU
oracles' case). Each family defines its records in one module (`draftsmith.heads.<family>.kind`; the decoder's own
kinds, `draft:` and `ngram:`, in the app layer) and explicit tables list them: `draftsmith.heads.kinds.HEAD_KINDS`
(what training, save and load look up) and `draftsmith.app.drafters.DRAFTERS` (the head kinds plus the decoder's:
what the CLI looks up). Nothing registers itself on import.

This module is core: the records' callables are typed loosely so that core imports nothing above it; each field's
docstring gives the call signature.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class Option:
    """One `key=value` option of a drafter spec. Bounds are inclusive; `below` is an exclusive upper bound."""

    name: str
    type: type
    """int, float, bool (written 0 or 1) or str (a path: no bounds, not empty)."""
    help: str
    min: float | None = None
    max: float | None = None
    below: float | None = None

    def describe(self) -> str:
        if self.type is bool:
            return f"{self.name}=0|1"
        if self.type is str:
            return f"{self.name}=<path>"
        lo = "" if self.min is None else f">= {self.min:g}"
        hi = (
            f"< {self.below:g}"
            if self.below is not None
            else ("" if self.max is None else f"<= {self.max:g}")
        )
        bounds = " and ".join(b for b in (lo, hi) if b)
        return f"{self.name}=<{self.type.__name__}{' ' + bounds if bounds else ''}>"

    def parse(self, raw: str, kind: str) -> Any:
        """The value of `raw` as this option's type, within its bounds, or one DraftsmithError line."""
        bad = DraftsmithError(
            f"{kind} option {self.name}={raw!r} is invalid: it must be {self.describe().split('=', 1)[1]}"
        )
        raw = raw.strip()
        if self.type is bool:
            if raw not in ("0", "1"):
                raise bad
            return raw == "1"
        if self.type is str:
            if not raw:
                raise bad
            return raw
        try:
            value = int(raw) if self.type is int else float(raw)
        except ValueError:
            raise bad from None
        if isinstance(value, float) and not math.isfinite(value):
            raise bad
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise bad
        if self.below is not None and value >= self.below:
            raise bad
        return value


def parse_options(options: tuple[Option, ...], text: str, kind: str) -> dict[str, Any]:
    """'top_k=4,depth=3' -> {'top_k': 4, 'depth': 3}, each value checked against its Option; an unknown or repeated
    key, a missing value or an out-of-bounds one is one DraftsmithError line naming the valid options."""
    by_name = {o.name: o for o in options}
    valid = ", ".join(o.describe() for o in options) or "none"
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in by_name:
            raise DraftsmithError(f"bad {kind} option {part!r}; valid options: {valid}")
        if key in out:
            raise DraftsmithError(f"{kind} option {key} is given twice; give it once")
        out[key] = by_name[key].parse(val, kind)
    return out


@dataclass(frozen=True)
class ExportOptions:
    """What `draftsmith export` passes to every format writer."""

    speculative_tokens: int = 3
    """speculators EAGLE-3: the default number of draft tokens vLLM proposes."""
    verifier: str | None = None
    """speculators formats: the target's Hub id or folder to name (default: the one recorded with the head)."""


@dataclass(frozen=True)
class ExportFormat:
    """One engine format a kind's folders export to."""

    name: str
    write: Callable[..., dict]
    """(Checkpoint, out: Path, ExportOptions) -> manifest notes; writes the format's files into the empty `out`."""
    check: Callable[[dict, str], None] | None = None
    """(config.json dict, where) -> None or one DraftsmithError line: what the format requires of a folder's config
    (aux-layer ids, vocabulary layout...). The exporter calls it, and so does the heads recipe at start-up on the
    config the run will save, so a run that trains to the end can still be exported (or says at start it cannot)."""
    aux_note: str | None = None
    """How the format's aux-layer ids relate to draftsmith's (written into draftsmith_export.json)."""
    serve_note: str | None = None
    """Which engine versions serve it, and how (written into draftsmith_export.json)."""
    names_verifier: bool = False
    """The folder names the target for the engine to load (speculators formats): `--verifier` applies."""


@dataclass(frozen=True)
class CostSettings:
    """What a cost-model builder gets besides the target (draftsmith.app.costbench)."""

    shape: str
    """The target's shape name (draftsmith.app.shapes.SHAPES): builders pick the published drafter size for it."""
    device: str
    k: int
    draft_vocab: int
    """Reduced draft vocabulary of EAGLE-3-style heads (32k as published for Llama-3.1-8B)."""


@dataclass(frozen=True)
class Training:
    """How the heads recipe (draftsmith.heads.recipe, `head.kind: NAME`) trains a kind."""

    build: Callable[..., Any]
    """(HeadsConfig, target, train examples) -> a new module (random or initialised from the target)."""
    loss: Callable[..., tuple]
    """(HeadTrainer, batch) -> (loss, metrics): one training step's loss."""
    evaluate: Callable[..., dict]
    """(HeadTrainer, held-out batches, HiddenStates, HeadsConfig) -> held-out metrics (acceptance, simulated tau)."""
    features: Callable[[Any], tuple[str, list[int]]]
    """module -> (hidden-state cache kind, HF hidden_states indices it reads besides the final state)."""
    plan: Callable[[Any, Any], dict] | None = None
    """(HeadsConfig, the target's HF config) -> the config.json fields the export formats check, before any weight
    loads (None: nothing to check)."""
    setup: Callable[..., Any] | None = None
    """(HeadsConfig, target, module) -> draftsmith.heads.training.TrainSetup for kinds that also train the target
    (Medusa-2's LoRA); None = frozen target."""
    head_fields: type | None = None
    """A dataclass of this kind's `head:` recipe fields (merged into the recipe's head section)."""
    loss_fields: type | None = None
    """A dataclass of this kind's `loss:` recipe fields."""
    eval_fields: type | None = None
    """A dataclass of this kind's `eval:` recipe fields."""
    sections: type | None = None
    """A dataclass of this kind's own top-level recipe sections (e.g. `medusa2:`)."""
    saves_as: str | None = None
    """The folder kind it writes when that is another kind's (medusa2 -> medusa)."""


@dataclass(frozen=True)
class DrafterKind:
    """Everything about one drafter kind (module docstring). Fields left None do not apply to the kind."""

    name: str
    family: str
    """The subpackage that implements it (draftsmith.heads.<family>), or "decode" for the decoder's own kinds."""
    title: str
    """What it is, for messages: 'an EAGLE-3 head'."""
    build: Callable[..., Any] | None = None
    """(path or None, options dict, DrafterContext) -> Proposer, for the spec `name:PATH[,key=value...]`; None: the
    kind is trained but decodes as another kind (Training.saves_as)."""
    options: tuple[Option, ...] = ()
    needs_path: bool = True
    """The spec starts with a folder / Hub id (`ngram:` has none)."""
    path_is_folder: bool = True
    """The path must be a local folder of one of `accepts` (False: a Hub id or a .gguf will do too: `draft:`)."""
    check_options: Callable[[dict], None] | None = None
    """options dict -> None or one DraftsmithError line: constraints between options (ngram: min <= max)."""
    accepts: tuple[str, ...] = ()
    """Folder kinds its spec decodes (empty: its own name); `eagle:` reads EAGLE-1 and EAGLE-3 folders."""
    max_depth: Callable[[dict], tuple[int, str]] | None = None
    """config.json dict -> (the most draft tokens one step can propose, why: '4 heads'); None: no limit."""
    training: Training | None = None
    load: Callable[[dict], Any] | None = None
    """config.json dict -> the module with random weights (the caller loads the safetensors)."""
    check_folder: Callable[[Any], None] | None = None
    """(Checkpoint) -> None or one DraftsmithError line: the folder's tensors and fields match its config."""
    exports: tuple[ExportFormat, ...] = ()
    cost: Callable[..., Any] | None = None
    """(target, CostSettings, options dict) -> Proposer with random weights at the published size."""
    refuses: Callable[[Any], str | None] | None = None
    """(the target's HF config) -> None, or one line naming the architecture and why this kind cannot draft for it:
    checked from the config alone, before any weight loads (decoding, training, `draftsmith check`)."""
    example: Callable[..., str] | None = None
    """(folder, target) -> the spec of a small random drafter saved under `folder` for `target` (untrained but not
    the identity): the GPU check's case and the CPU losslessness oracles' case."""
    notes: dict[str, str] = field(default_factory=dict)

    def check_target(self, config) -> None:
        """One DraftsmithError line if this kind cannot draft for a target of `config` (refuses)."""
        why = self.refuses(config) if self.refuses is not None else None
        if why:
            raise DraftsmithError(f"{self.name} cannot draft for this target: {why}")

    @property
    def folder_kinds(self) -> tuple[str, ...]:
        return self.accepts or (self.name,)

    def format(self, name: str) -> ExportFormat | None:
        return next((f for f in self.exports if f.name == name), None)

    def format_names(self) -> list[str]:
        return [f.name for f in self.exports]


def folder_kind(path: str | Path) -> str | None:
    """The kind a local folder holds, from its config.json alone (no tensor read): a head's draftsmith_head_type, a
    self-drafter's draftsmith_drafter, "draft" for a causal LM, None when it is none of these (or not a folder)."""
    f = Path(path).expanduser() / "config.json"
    if not f.is_file():
        return None
    try:
        cfg = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(cfg, dict):
        return None
    for key in ("draftsmith_head_type", "draftsmith_drafter"):
        if isinstance(cfg.get(key), str):
            return cfg[key]
    if any(str(a).endswith("ForCausalLM") for a in cfg.get("architectures") or []):
        return "draft"
    return None


def spec_for(kinds: Mapping[str, DrafterKind], folder: str) -> str | None:
    """The spec kind that decodes a folder of kind `folder` (its own name where that is a spec kind), or None."""
    if folder in kinds and kinds[folder].build is not None:
        return folder
    for rec in kinds.values():
        if rec.build is not None and folder in rec.folder_kinds:
            return rec.name
    return None


def describe_kind(kinds: Mapping[str, DrafterKind], folder: str) -> str:
    """'a DFlash-style block drafter (dflash)': what a folder kind is, in words."""
    rec = kinds.get(folder)
    return f"{rec.title} ({folder})" if rec is not None else f"a {folder!r} folder"
