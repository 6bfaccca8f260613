"""Head training recipes: one config for every head kind (draftsmith.heads.kinds), run by `train/heads.py`.

One entry point for every kind because the kinds share everything but the module and the loss: the data
(target-generated conversations), the target's hidden states (online / offline / hybrid cache), the training
loop (draftsmith.trainer), the held-out acceptance eval and the head-folder format. The kind is a recipe field
(`head.kind`), so a recipe file alone says what a run does; the kind's record supplies the module, its loss, eval,
hidden-state needs and its own recipe fields (merged into the head:, loss: and eval: sections below, plus its own
top-level sections such as medusa2:).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import set_seed

from draftsmith.config import to_dict
from draftsmith.engines import plain_model_init
from draftsmith.errors import DraftsmithError
from draftsmith.examples import DataSources
from draftsmith.heads.common import LossKind
from draftsmith.heads.data import data_fingerprint, epoch_batches, load_examples, split_examples
from draftsmith.heads.hidden import (
    CacheSpec,
    HiddenStateCache,
    HiddenStates,
    build_cache,
    bytes_per_token,
    check_cache_dir,
    fill_from_generated,
)
from draftsmith.heads.io import ACCURACY_FILE, save_head
from draftsmith.heads.kinds import HEAD_KINDS, head_kind, trained_kinds
from draftsmith.heads.targetinit import apply_init, check_init
from draftsmith.heads.training import HeadTrainer, TrainSetup, evaluate_heads
from draftsmith.kinds import DrafterKind
from draftsmith.rundir import check_out_dir
from draftsmith.trainer import TrainArgs

log = logging.getLogger(__name__)


def _mixins(attr: str) -> tuple[type, ...]:
    """The recipe-field dataclasses the trained kinds contribute (Training.head_fields, ...), once each."""
    found = (getattr(rec.training, attr) for rec in HEAD_KINDS.values() if rec.training is not None)
    return tuple(dict.fromkeys(t for t in found if t is not None))


@dataclass
class ModelSection:
    target: str = "smollm2-135m"
    """Target: Hub id, folder, .gguf or smollm2-135m (frozen except Medusa-2's LoRA)."""
    dtype: str | None = None
    """Target dtype; null = bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32 (models.default_dtype). Heads train in fp32 master weights (autocast per train)."""


@dataclass
class CommonHeadFields:
    kind: str = "eagle3"
    """The head kind (draftsmith.heads.kinds): medusa (Medusa-1, frozen target), medusa2 (LoRA target + heads),
    eagle (EAGLE-1), eagle3, dflash (DFlash-style block drafter), peagle (P-EAGLE), earlyexit (trained early exit)."""
    draft_vocab_size: int = 32000
    """EAGLE-3, DFlash, P-EAGLE, early exit (and Medusa with head.reduced_vocab): reduced output vocabulary, the most
    frequent tokens of the training data (capped at V; dflash 0 = the target's frozen full head)."""
    aux_layers: list[int] | None = None
    """EAGLE-3, DFlash, P-EAGLE: HF hidden_states indices (inputs of those layers); null = 2, N//2, N-3 (made
    distinct within [1, N-1] on small targets, where the engines can capture them)."""
    intermediate_size: int | None = None
    """EAGLE, DFlash, early exit: MLP width of the draft layer; null = the target's."""
    init: str = "random"
    """EAGLE, EAGLE-3, P-EAGLE, DFlash, early exit: random = the draft layer drawn at random; target = it starts as
    the target's last decoder layer, final norm and (fc) deepest aux state (heads.targetinit says what is copied).
    Embeddings and output rows are the target's either way; Medusa heads always start from its lm_head."""


@dataclass
class HeadSection(*_mixins("head_fields"), CommonHeadFields):
    """head.*: the common fields above and each kind's own (heads.<family>.training *HeadFields)."""

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS or HEAD_KINDS[self.kind].training is None:
            raise DraftsmithError(f"head.kind: {self.kind!r} is not one of {trained_kinds()}")
        check_init(self.init, HEAD_KINDS[self.kind])


@dataclass
class CommonLossFields:
    kind: LossKind = "soft_ce"
    """Per-step loss: soft_ce (native) or a draftsmith divergence (fkl rkl jsd tvd neg_log_accept lk)."""
    ttt_steps: int = 7
    """EAGLE: training-time-test unroll depth (EAGLE-3 uses 7; 1 = no unroll, EAGLE-1's default)."""
    decay: float = 0.8
    """Weight decay^i of unroll step i (EAGLE-3) or head i (Medusa)."""
    temperature: float = 1.0
    """Decode temperature the loss takes both distributions at, soft_ce included (0 treated as 1)."""
    beta: float = 0.5
    """JSD beta."""


@dataclass
class LossSection(*_mixins("loss_fields"), CommonLossFields):
    """loss.*: the common fields above and each kind's own (heads.<family>.training *LossFields)."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise DraftsmithError(f"loss.ttt_steps must be >= 1 (1 = no unroll), got {self.ttt_steps}")


@dataclass
class DataSection(DataSources):
    """data.source / limit / max_length / eval_size: draftsmith.examples.DataSources (shared by every trainer)."""

    loss_on_prompt: bool = False
    """Also train on prompt tokens (EAGLE labels are target distributions; useful when data is scarce)."""
    hidden_states: Literal["online", "offline", "hybrid"] = "online"
    """online: run the target every step; offline: cache all states first; hybrid: cache during epoch 1."""
    hidden_cache: str | None = None
    """Cache folder (offline/hybrid); null = <output_dir>/hidden_cache."""
    cache_dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    """auto: bfloat16 for a bf16 target (its states are bf16 already: lossless, and fp16 can overflow on
    outlier activations), float16 otherwise."""
    shard_size: int = 256
    """Examples per cache shard."""
    cache_layers: list[int] | None = None
    """HF hidden_states indices the cache stores besides this kind's own: list every layer of the kinds that share
    the cache (EAGLE-3 / DFlash / P-EAGLE aux layers, the early exit's layer) so whichever runs first builds it for
    all and the target runs over the data once; null = this kind's layers only."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache_layers is not None and (
            not isinstance(self.cache_layers, list)
            or not all(isinstance(i, int) and i >= 0 for i in self.cache_layers)
        ):
            raise DraftsmithError(
                f"data.cache_layers must be a list of hidden_states indices >= 0 (or null), got {self.cache_layers}"
            )


@dataclass
class CommonEvalFields:
    depth: int = 6
    """Unroll / chain depth of the held-out acceptance eval (per-depth acceptance, simulated tau)."""


@dataclass
class EvalSection(*_mixins("eval_fields"), CommonEvalFields):
    """eval.*: the common fields above and each kind's own (heads.<family>.training *EvalFields)."""


@dataclass
class RecipeSections:
    model: ModelSection = field(default_factory=ModelSection)
    head: HeadSection = field(default_factory=HeadSection)
    loss: LossSection = field(default_factory=LossSection)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    train: TrainArgs = field(default_factory=TrainArgs)
    output_dir: str = "runs/heads"


@dataclass
class HeadsConfig(*_mixins("sections"), RecipeSections):
    """A heads recipe: the sections above and each kind's own top-level sections (e.g. medusa2:)."""


def build_head(cfg: HeadsConfig, target, train_examples: list[dict]) -> torch.nn.Module:
    """A new head of kind cfg.head.kind for `target`: its record's Training.build, then Training.from_target where
    head.init is target."""
    rec = head_kind(cfg.head.kind)
    return apply_init(cfg.head.init, rec.training.build(cfg, target, train_examples), target, rec)


def check_exportable(cfg: HeadsConfig, say=print) -> None:
    """Before the target loads: what the kind's engine formats will require of the head this run saves (its
    record's Training.plan against each ExportFormat.check). A run no engine format could export, whose explicit
    head.aux_layers are the reason (the default would export), is refused in one line; formats the run cannot reach
    otherwise (a target too small for three capturable aux layers, a trained full-vocabulary DFlash head) are named
    in one warning line."""
    from draftsmith import models

    rec = head_kind(cfg.head.kind)
    formats = [f for f in head_kind(rec.training.saves_as or rec.name).exports if f.check is not None]
    if rec.training.plan is None or not formats:
        return
    target_config = models.load_config(cfg.model.target)
    problems = _export_problems(rec, cfg, target_config, formats)
    if not problems:
        return
    if len(problems) == len(formats) and cfg.head.aux_layers is not None:
        default = dataclasses.replace(cfg, head=dataclasses.replace(cfg.head, aux_layers=None))
        if len(_export_problems(rec, default, target_config, formats)) < len(formats):
            name, msg = next(iter(problems.items()))
            raise DraftsmithError(
                f"no engine format could export this {rec.name} head ({name}: {msg}); set head.aux_layers: null "
                f"(the default, {rec.training.plan(default, target_config)['aux_hidden_state_layer_ids']}) or ids "
                "the engines capture"
            )
    say(
        f"warning: this {rec.name} run will not export to {', '.join(problems)} "
        f"({'; '.join(f'{n}: {m}' for n, m in problems.items())}); draftsmith eval reads the folder as it is"
    )


def check_against_target(cfg: HeadsConfig) -> None:
    """Before the target loads, from its config: the kind drafts for its architecture (DrafterKind.refuses),
    data.max_length within its context and data.cache_layers within its hidden_states indices [0, N]."""
    from draftsmith import models

    target_config = models.load_config(cfg.model.target)
    rec = head_kind(cfg.head.kind)
    head_kind(rec.training.saves_as or rec.name).check_target(target_config)
    ctx = getattr(target_config, "max_position_embeddings", None)
    if ctx and cfg.data.max_length > ctx:
        raise DraftsmithError(
            f"data.max_length={cfg.data.max_length} exceeds the target's context ({ctx} tokens, "
            f"max_position_embeddings); set data.max_length <= {ctx}"
        )
    if not cfg.data.cache_layers:
        return
    n = target_config.num_hidden_layers
    bad = [i for i in cfg.data.cache_layers if not 0 <= i <= n]
    if bad:
        raise DraftsmithError(
            f"data.cache_layers {bad} are outside the target's hidden_states indices [0, {n}]; list layers in range"
        )


def _export_problems(rec: DrafterKind, cfg: HeadsConfig, target_config, formats) -> dict[str, str]:
    where = "the head this run trains"
    planned = rec.training.plan(cfg, target_config)
    problems = {}
    for fmt in formats:
        try:
            fmt.check(planned, where)
        except DraftsmithError as e:
            problems[fmt.name] = str(e).removeprefix(f"{where}: ")
    return problems


def run_heads(
    cfg: HeadsConfig, accelerator, *, resume: bool = False, overwrite: bool = False, progress: bool = True
) -> dict:
    """Train a head per `cfg`; returns the trainer summary plus final_dir and cache bytes/token."""
    from draftsmith import models
    from draftsmith.trainer import run

    run_config = to_dict(cfg)
    check_out_dir(cfg.output_dir, run_config, resume, overwrite)  # before any compute or cache write
    check_exportable(cfg, accelerator.print)
    check_against_target(cfg)
    # a file where the cache goes, a damaged meta.json: refused before the target loads
    if cfg.data.hidden_states != "online":
        check_cache_dir(_cache_path(cfg))
    rec = head_kind(cfg.head.kind)
    train_ex, eval_ex, fingerprint = _examples(cfg)
    with plain_model_init(accelerator):  # ZeRO-3 would partition the frozen target as it loads
        target = models.load_model(cfg.model.target, dtype=cfg.model.dtype, device=accelerator.device)
    set_seed(cfg.train.seed)  # before the head (and Medusa-2's LoRA) draw their random weights
    head = build_head(cfg, target, train_ex).to(accelerator.device)
    setup = rec.training.setup(cfg, target, head) if rec.training.setup else TrainSetup(target, None)
    cache_kind, aux = rec.training.features(head)
    cache_dtype = _cache_dtype(cfg, target)
    # a kind that trains the target computes its states every step: no cache
    cache = None if setup.target_training is not None else _cache(cfg, accelerator, target, train_ex, eval_ex, cache_kind, aux, cache_dtype, fingerprint, progress)  # fmt: skip
    mode = cfg.data.hidden_states if cache is not None else "online"
    # a shared cache (a superset of this kind's layers) makes hybrid runs fill in all of its tensors
    hidden = HiddenStates(mode, target, aux, cache)
    # held-out eval: hybrid runs cache the eval rows too (read back at later evals); offline caches hold train rows only
    online = hidden if mode == "hybrid" else HiddenStates("online", target, aux)
    trainer_module = HeadTrainer(head, setup.target, hidden, cfg.loss, setup.target_training, kind=rec.name)
    eval_fn, save_fn = _eval_and_save(cfg, eval_ex, online, setup)
    bpt = bytes_per_token(len(hidden.stored), target.config.hidden_size, getattr(torch, cache_dtype))
    accelerator.print(
        f"{cfg.head.kind} head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters, "
        f"{len(train_ex)} train / {len(eval_ex)} held-out conversations, hidden states {mode} "
        f"({bpt} B/token cached)"
    )
    summary = run(
        accelerator,
        trainer_module,
        lambda m, b: m(b),
        epoch_batches(train_ex, cfg.train.batch_size, cfg.train.seed),
        cfg.train,
        cfg.output_dir,
        param_groups=setup.param_groups,
        eval_fn=eval_fn,
        save_fn=save_fn,
        resume=resume,
        overwrite=overwrite,
        run_config=run_config,
        progress=progress,
    )
    if cache is not None:
        cache.flush()
        summary["cache_bytes"] = cache.disk_bytes()
    summary["cache_bytes_per_token"] = bpt
    summary["final_dir"] = str(Path(cfg.output_dir) / "final")
    return summary


def _examples(cfg: HeadsConfig) -> tuple[list[dict], list[dict], str]:
    """(train, held-out, data fingerprint) of the recipe's data sources, tokenized: read before the target loads, so
    a bad record is refused first (the context was checked against data.max_length: check_against_target)."""
    from draftsmith import models

    sources = cfg.data.sources
    needs_tok = any(not Path(s).is_dir() for s in sources)
    examples = load_examples(
        sources,
        max_length=cfg.data.max_length,
        limit=cfg.data.limit,
        loss_on_prompt=cfg.data.loss_on_prompt,
        tokenizer=models.load_tokenizer(cfg.model.target) if needs_tok else None,
    )
    train_ex, eval_ex = split_examples(examples, cfg.data.eval_size, cfg.train.seed)
    return train_ex, eval_ex, data_fingerprint(examples)


def _cache_dtype(cfg: HeadsConfig, target) -> str:
    if cfg.data.cache_dtype != "auto":
        return cfg.data.cache_dtype
    return "bfloat16" if target.dtype == torch.bfloat16 else "float16"


def _cache_path(cfg: HeadsConfig) -> str:
    return cfg.data.hidden_cache or str(Path(cfg.output_dir) / "hidden_cache")


def _cache(
    cfg, accelerator, target, train_ex, eval_ex, kind, aux, dtype, fingerprint, progress
) -> HiddenStateCache | None:
    """The hidden-state cache of an offline / hybrid run (offline: filled now, by every rank's share), else None."""
    if cfg.data.hidden_states == "online":
        return None
    layers = aux if cfg.data.cache_layers is None else sorted(set(aux) | set(cfg.data.cache_layers))
    spec = CacheSpec(kind, layers, target.config.hidden_size, dtype, fingerprint)
    path = _cache_path(cfg)
    rank, shard = accelerator.process_index, cfg.data.shard_size
    cache = HiddenStateCache(path, spec, target, rank=rank, shard_size=shard)
    if rank == 0:  # states `draftsmith generate --capture-layers` kept: no target pass for those examples
        n = fill_from_generated(cache, train_ex + eval_ex, target)
        if n:
            accelerator.print(
                f"hidden-state cache {path}: {n} examples' states read from their generate folders"
            )
    accelerator.wait_for_everyone()
    cache = HiddenStateCache(path, spec, target, rank=rank, shard_size=shard)
    if cfg.data.hidden_states == "offline":
        build_cache(target, train_ex, cache, batch_size=cfg.train.batch_size, progress=progress, rank=rank,
                    world=accelerator.num_processes)  # fmt: skip
        accelerator.wait_for_everyone()
        cache = HiddenStateCache(path, spec, target, rank=rank, shard_size=shard)
    return cache


def _eval_and_save(cfg: HeadsConfig, eval_ex: list[dict], hidden: HiddenStates, setup: TrainSetup):
    """The trainer's held-out eval (the kind's record) and checkpoint writer (head folder + its measured accuracy,
    + what the kind saves beside it)."""
    eval_batches = epoch_batches(eval_ex, cfg.train.batch_size, seed=0)(0) if eval_ex else []
    last_eval: dict = {}

    def eval_fn(module: HeadTrainer) -> dict:
        if not eval_batches:
            return {}
        res = evaluate_heads(module, eval_batches, hidden, cfg.eval)
        last_eval.clear()
        last_eval.update(res)
        return res

    def save_fn(module: HeadTrainer, out_dir: Path) -> None:
        save_head(module.head, out_dir, extra_json={ACCURACY_FILE: {"kind": cfg.head.kind, **last_eval}})
        if setup.save_extra is not None:
            setup.save_extra(module, out_dir)

    return eval_fn, save_fn
