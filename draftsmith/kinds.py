"""One record per drafter kind: everything draftsmith knows about a kind, in one place.

A kind is what a drafter spec names (`eagle3:DIR`), what a head folder's config.json records (`draftsmith_head_type`)
and what a heads recipe trains (`head.kind`). Its `DrafterKind` record holds the spec's options and proposer builder,
the recipe fields, module, loss, held-out eval and hidden-state needs of its trainer, the loader and tensor layout of
its folder, its export formats, its cost-model builder and a small random example (the GPU check's case and the CPU
oracles' case). Each family defines its records in one module (`draftsmith.heads.<family>.kind`; the decoder's own
kinds, `draft:` and `ngram:`, in the app layer) and explicit tables list them: `draftsmith.heads.kinds.HEAD_KINDS`
(what training, save and load look up) and `draftsmith.app.drafters.DRAFTERS` (the head kinds plus the decoder's:
what the CLI looks up). Nothing registers itself on import.

This module is core and imports nothing above it, so the types the records' callables take from the method packages
(a heads recipe's config, a HeadTrainer, a DrafterContext, a Proposer) are `Any` in the signatures below and named in
each field's docstring; everything core knows (checkpoints, configs, modules, paths) is typed.

A kind's record also holds what other modules once kept in tables of their own: the model card's tag and text (Card),
whether `head.init: target` applies (Training.from_target) and how the cost benchmarks time it (CostModel). A kind
added to the tables is on the card, in the cost model and in the docs without another edit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.errors import DraftsmithError

if TYPE_CHECKING:
    from torch import Tensor, nn
    from transformers import PretrainedConfig

    from draftsmith.checkpoint import Checkpoint

# The call signatures of the records' slots. `Any` stands for a type of a layer above core (named in the comment).
Options = dict[str, Any]
"""A spec's parsed `key=value` options (parse_options)."""
FolderConfig = dict[str, Any]
"""A drafter folder's config.json."""
BuildProposer = Callable[[str | None, Options, Any], Any]
"""(path or None, options, draftsmith.decode.drafters.DrafterContext) -> draftsmith.decode.proposer.Proposer."""
BuildCostProposer = Callable[["nn.Module", "CostSettings", Options], Any]
"""(target, CostSettings, options) -> Proposer with random weights at the published size."""
WriteExport = Callable[["Checkpoint", Path, "ExportOptions"], dict[str, Any]]
"""(Checkpoint, out, ExportOptions) -> manifest notes."""
BuildHead = Callable[[Any, "nn.Module", list[dict[str, Any]]], "nn.Module"]
"""(draftsmith.heads.recipe.HeadsConfig, target, train examples) -> a new module."""
StepLoss = Callable[[Any, dict[str, "Tensor"]], tuple["Tensor", dict[str, float]]]
"""(draftsmith.heads.training.HeadTrainer, batch) -> (scalar loss, metrics)."""
EvaluateHead = Callable[[Any, list[dict[str, "Tensor"]], Any, Any], dict[str, Any]]
"""(HeadTrainer, held-out batches, draftsmith.heads.hidden.HiddenStates, the recipe's eval section) -> metrics."""
InitFromTarget = Callable[["nn.Module", "nn.Module"], list[str]]
"""(module, target) -> the target parameter names not copied; copies the target's weights into the module."""


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
    write: WriteExport
    """(Checkpoint, out: Path, ExportOptions) -> manifest notes; writes the format's files into the empty `out`."""
    check: Callable[[FolderConfig, str], None] | None = None
    """(config.json dict, where) -> None or one DraftsmithError line: what the format requires of a folder's config
    (aux-layer ids, vocabulary layout...). The exporter calls it, and so does the heads recipe at start-up on the
    config the run will save, so a run that trains to the end can still be exported (or says at start it cannot)."""
    aux_note: str | None = None
    """How the format's aux-layer ids relate to draftsmith's (written into draftsmith_export.json)."""
    serve_note: str | None = None
    """Which engine versions serve it, and how (written into draftsmith_export.json)."""
    names_verifier: bool = False
    """The folder names the target for the engine to load (speculators formats): `--verifier` applies."""
    library: str = "draftsmith"
    """The Hub `library_name` of a folder in this format: the library that loads it (a model card's front matter)."""


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
class CostModel:
    """How the cost benchmarks (draftsmith.app.costbench, costbatch) time a kind at a real model size."""

    build: BuildCostProposer | None = None
    """(target, CostSettings, options dict) -> Proposer with random weights at the published size."""
    timed_as: str | None = None
    """Another kind whose drafter times this one, and under whose name its profiles are keyed (`eagle` -> `eagle3`:
    an EAGLE-1 head is one layer as well); set instead of `build`."""

    def __post_init__(self) -> None:
        if (self.build is None) == (self.timed_as is None):
            raise ValueError("a CostModel has a builder or a kind it is timed as, not both and not neither")


@dataclass(frozen=True)
class Card:
    """What a model card (draftsmith.modelcard) says of a kind's folders."""

    tag: str
    """The Hub tag naming the method, beside speculative-decoding and draftsmith."""
    text: str
    """What a drafter of the kind is: the card's opening line ('an EAGLE-3 head: one decoder layer over ...')."""
    paper: str
    """The method it follows, as cited: 'EAGLE-3 (Li et al., 2025)' (the card and the generated docs name it)."""
    causal_lm: bool = False
    """The folder is a causal LM transformers loads as it is: the card's library is transformers and its usage is
    assisted generation (`assistant_model=`) and vLLM's draft_model."""


@dataclass(frozen=True)
class Training:
    """How the heads recipe (draftsmith.heads.recipe, `head.kind: NAME`) trains a kind."""

    build: BuildHead
    """(HeadsConfig, target, train examples) -> a new module with random draft layers (the recipe's build_head then
    applies `from_target` for head.init: target)."""
    loss: StepLoss
    """(HeadTrainer, batch) -> (loss, metrics): one training step's loss."""
    evaluate: EvaluateHead
    """(HeadTrainer, held-out batches, HiddenStates, the recipe's eval section) -> held-out metrics (acceptance,
    simulated tau)."""
    features: Callable[[nn.Module], tuple[str, list[int]]]
    """module -> (hidden-state cache kind, HF hidden_states indices it reads besides the final state)."""
    plan: Callable[[Any, PretrainedConfig], FolderConfig] | None = None
    """(HeadsConfig, the target's HF config) -> the config.json fields the export formats check, before any weight
    loads (None: nothing to check)."""
    setup: Callable[[Any, nn.Module, nn.Module], Any] | None = None
    """(HeadsConfig, target, module) -> draftsmith.heads.training.TrainSetup for kinds that also train the target
    (Medusa-2's LoRA); None = frozen target."""
    from_target: InitFromTarget | None = None
    """`head.init: target`: (the built module, target) -> the names not copied, after copying the target's own layers
    into the draft layers (draftsmith.heads.targetinit); None: head.init: target does not apply to the kind."""
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
    card: Card | None = None
    """What a model card says of the kind (every shipped kind has one)."""
    build: BuildProposer | None = None
    """(path or None, options dict, DrafterContext) -> Proposer, for the spec `name:PATH[,key=value...]`; None: the
    kind is trained but decodes as another kind (Training.saves_as)."""
    options: tuple[Option, ...] = ()
    needs_path: bool = True
    """The spec starts with a folder / Hub id (`ngram:` has none)."""
    path_is_folder: bool = True
    """The path must be a local folder of one of `accepts` (False: a Hub id or a .gguf will do too: `draft:`)."""
    check_options: Callable[[Options], None] | None = None
    """options dict -> None or one DraftsmithError line: constraints between options (ngram: min <= max)."""
    accepts: tuple[str, ...] = ()
    """Folder kinds its spec decodes (empty: its own name); `eagle:` reads EAGLE-1 and EAGLE-3 folders."""
    max_depth: Callable[[FolderConfig], tuple[int, str]] | None = None
    """config.json dict -> (the most draft tokens one step can propose, why: '4 heads'); None: no limit."""
    training: Training | None = None
    load: Callable[[FolderConfig], nn.Module] | None = None
    """config.json dict -> the module with random weights (the caller loads the safetensors)."""
    check_folder: Callable[[Checkpoint], None] | None = None
    """(Checkpoint) -> None or one DraftsmithError line: the folder's tensors and fields match its config."""
    exports: tuple[ExportFormat, ...] = ()
    cost: CostModel | None = None
    """How the cost benchmarks time it (None: they do not)."""
    refuses: Callable[[PretrainedConfig], str | None] | None = None
    """(the target's HF config) -> None, or one line naming the architecture and why this kind cannot draft for it:
    checked from the config alone, before any weight loads (decoding, training, `draftsmith check`)."""
    example: Callable[[Path, nn.Module], str] | None = None
    """(folder, target) -> the spec of a small random drafter saved under `folder` for `target` (untrained but not
    the identity): the GPU check's case and the CPU losslessness oracles' case."""
    notes: dict[str, str] = field(default_factory=dict)

    def check_target(self, config: PretrainedConfig) -> None:
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
