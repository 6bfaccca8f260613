"""Head training recipes: one config for Medusa-1/2, EAGLE-1 and EAGLE-3, run by `train/heads.py`.

One entry point for every kind because the kinds share everything but the module and the loss: the data
(target-generated conversations), the target's hidden states (online / offline / hybrid cache), the training
loop (draftsmith.trainer), the held-out acceptance eval and the head-folder format. The kind is a recipe field, so
a recipe file alone says what a run does.
"""

from __future__ import annotations

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
from draftsmith.heads.data import data_fingerprint, epoch_batches, load_examples, split_examples
from draftsmith.heads.eagle.losses import EagleLoss
from draftsmith.heads.eagle.model import EagleHead, default_aux_layers
from draftsmith.heads.hidden import CacheSpec, HiddenStateCache, HiddenStates, build_cache, bytes_per_token
from draftsmith.heads.io import ACCURACY_FILE, LORA_DIR, save_head
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.heads.training import HeadTrainer, evaluate_heads
from draftsmith.rundir import check_out_dir
from draftsmith.trainer import TrainArgs

log = logging.getLogger(__name__)


@dataclass
class ModelSection:
    target: str = "smollm2-135m"
    """Target: Hub id, folder, .gguf or smollm2-135m (frozen except Medusa-2's LoRA)."""
    dtype: str | None = None
    """Target dtype; null = bf16 on CUDA and AMX CPUs, else fp32 (models.default_dtype). Heads train in fp32 master weights (autocast per train)."""


@dataclass
class HeadSection:
    kind: Literal["medusa", "medusa2", "eagle", "eagle3", "earlyexit", "dflash", "peagle"] = "eagle3"
    """medusa (Medusa-1, frozen target), medusa2 (LoRA target + heads), eagle (EAGLE-1), eagle3."""
    num_heads: int = 4
    """Medusa: heads (head k predicts token t+2+k)."""
    num_layers: int = 1
    """Medusa: residual blocks per head."""
    draft_vocab_size: int = 32000
    """EAGLE-3: reduced output vocabulary, the most frequent tokens of the training data (capped at V)."""
    aux_layers: list[int] | None = None
    """EAGLE-3: HF hidden_states indices (inputs of those layers); null = 2, N//2, N-3."""
    norm_before_residual: bool = False
    """EAGLE-3: take the residual after hidden_norm."""
    intermediate_size: int | None = None
    block_size: int = 8
    """dflash: rows per drafter forward (the anchor + block_size-1 masks -> block_size-1 draft tokens)."""
    draft_layers: int = 1
    """dflash: transformer layers of the block drafter."""
    mask_token_id: int | None = None
    """dflash / peagle: token id embedded at masked / placeholder positions; null = the least frequent training token.
    dflash with draft_vocab_size 0: the target's frozen full head (the SGLang / z-lab layout)."""
    num_depths: int = 4
    """peagle: draft tokens per forward (1 real row + num_depths-1 placeholders)."""
    exit_layer: int = 2
    """earlyexit: the draft shares the target's layers 0..L-1 and its adapter reads hidden_states[L] (an EAGLE-3
    cache holds aux layers 2, N//2, N-3: pick one of them to train from it)."""
    """EAGLE: MLP width of the draft layer; null = the target's."""


@dataclass
class LossSection:
    kind: EagleLoss = "soft_ce"
    """EAGLE-3 per-step loss: soft_ce (native) or a draftsmith divergence (fkl rkl jsd tvd neg_log_accept lk)."""
    ttt_steps: int = 7
    """EAGLE: training-time-test unroll depth (EAGLE-3 uses 7; 1 = no unroll, EAGLE-1's default)."""
    decay: float = 0.8
    """Weight decay^i of unroll step i (EAGLE-3) or head i (Medusa)."""
    temperature: float = 1.0
    """Decode temperature the divergence losses target (0 treated as 1)."""
    beta: float = 0.5
    """JSD beta."""
    feature_noise: float = 0.0
    """EAGLE-1: width of uniform noise added to the input features (0.2 in EAGLE-1)."""
    ce_weight: float = 0.1
    """EAGLE-1: weight of the token CE next to the feature regression (weight 1)."""
    max_rows: int = 0
    """Medusa: positions sampled per head per micro-batch (0 = all); the vocab projections dominate the cost."""
    anchors: int = 16
    """dflash: random blocks per conversation per step."""
    gamma: float = 4.0
    """dflash: weight exp(-(j-1)/gamma) of block position j (position j counts only if positions < j are accepted)."""
    cod_ratio: float = 0.7
    """peagle: COD sampling, depth d keeps max(cod_ratio^d, cod_min) of the columns kept at depth d-1."""
    cod_min: float = 0.2
    medusa_labels: Literal["tokens", "target"] = "tokens"
    """Medusa-1: tokens = the data's next tokens (as published); target = self-distillation, the frozen target's
    distribution at t+1+k (what greedy verification checks; needed to learn from fixed, human-written text)."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise DraftsmithError(f"loss.ttt_steps must be >= 1 (1 = no unroll), got {self.ttt_steps}")


@dataclass
class Medusa2Section:
    lora_r: int = 16
    lora_alpha: int = 32
    target_loss: Literal["kl", "lm"] = "kl"
    """kl: self-distillation to the adapter-disabled target (keeps its outputs); lm: next-token CE on the data."""
    lambda0: float = 0.2
    """Weight of the heads' loss next to the target term."""
    head_lr: float = 1e-3
    """Heads' learning rate (LoRA uses train.lr)."""
    warmup_head_steps: int = 50
    """Optimizer steps that train the heads only before the LoRA joins."""
    grad_accum: int = 1
    """Set from train.grad_accum (micro-steps per optimizer step); not a user knob."""


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


@dataclass
class EvalSection:
    depth: int = 6
    """EAGLE: unroll depth of the held-out acceptance eval (per-depth acceptance, simulated tau)."""
    tree_tokens: int = 16
    """Medusa: node budget of the static tree built from measured rank accuracies."""


@dataclass
class HeadsConfig:
    model: ModelSection = field(default_factory=ModelSection)
    head: HeadSection = field(default_factory=HeadSection)
    loss: LossSection = field(default_factory=LossSection)
    medusa2: Medusa2Section = field(default_factory=Medusa2Section)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    train: TrainArgs = field(default_factory=TrainArgs)
    output_dir: str = "runs/heads"


def build_head(cfg: HeadsConfig, target, train_examples: list[dict]) -> torch.nn.Module:
    h = cfg.head
    if h.kind in ("medusa", "medusa2"):
        return MedusaHeads.from_target(target, h.num_heads, h.num_layers)
    if h.kind == "eagle":
        return EagleHead.from_target(target, "eagle", intermediate_size=h.intermediate_size)
    from draftsmith.vocab import build_vocab_ids, special_token_ids, token_counts

    v = target.config.vocab_size
    counts = token_counts((e["input_ids"] for e in train_examples), v)
    special = set(special_token_ids(None, target))
    if h.kind in ("dflash", "peagle"):
        from draftsmith.heads.block.training import build_block_head

        size = min(h.draft_vocab_size, v) or v  # dflash 0: the target's frozen full head
        return build_block_head(
            h, target, counts, build_vocab_ids(counts, size, always=sorted(special)), special
        )
    vocab_ids = build_vocab_ids(counts, min(h.draft_vocab_size, v), always=sorted(special))
    if h.kind == "earlyexit":  # the target's own head rows over the same reduced vocabulary as EAGLE-3's
        from draftsmith.heads.selfspec.earlyexit import EarlyExitAdapter

        return EarlyExitAdapter.from_target(target, h.exit_layer, vocab_ids, h.intermediate_size)
    n = target.config.num_hidden_layers
    aux = h.aux_layers or default_aux_layers(n)
    if len(aux) != 3 or not all(0 <= i <= n for i in aux):
        raise DraftsmithError(f"head.aux_layers must be 3 hidden_states indices in [0, {n}], got {aux}")
    return EagleHead.from_target(
        target,
        "eagle3",
        draft_vocab_ids=vocab_ids,
        aux_layers=aux,
        norm_before_residual=h.norm_before_residual,
        intermediate_size=h.intermediate_size,
    )


def run_heads(
    cfg: HeadsConfig, accelerator, *, resume: bool = False, overwrite: bool = False, progress: bool = True
) -> dict:
    """Train a head per `cfg`; returns the trainer summary plus final_dir and cache bytes/token."""
    from draftsmith import models
    from draftsmith.trainer import run

    run_config = to_dict(cfg)
    check_out_dir(cfg.output_dir, run_config, resume, overwrite)  # before any compute or cache write
    with plain_model_init(accelerator):  # ZeRO-3 would partition the frozen target as it loads
        target = models.load_model(cfg.model.target, dtype=cfg.model.dtype, device=accelerator.device)
    ctx = getattr(target.config, "max_position_embeddings", None)
    if ctx and cfg.data.max_length > ctx:
        raise DraftsmithError(
            f"data.max_length={cfg.data.max_length} exceeds the target's context ({ctx} tokens, "
            f"max_position_embeddings); set data.max_length <= {ctx}"
        )
    sources = cfg.data.sources
    needs_tok = any(not Path(s).is_dir() for s in sources)
    examples = load_examples(
        sources,
        max_length=cfg.data.max_length,
        limit=cfg.data.limit,
        loss_on_prompt=cfg.data.loss_on_prompt,
        tokenizer=models.load_tokenizer(cfg.model.target) if needs_tok else None,
    )
    cache_dtype = cfg.data.cache_dtype
    if cache_dtype == "auto":
        cache_dtype = "bfloat16" if target.dtype == torch.bfloat16 else "float16"
    train_ex, eval_ex = split_examples(examples, cfg.data.eval_size, cfg.train.seed)
    set_seed(cfg.train.seed)  # before the head (and Medusa-2's LoRA) draw their random weights
    head = build_head(cfg, target, train_ex).to(accelerator.device)
    kind = cfg.head.kind if cfg.head.kind in ("eagle3", "eagle", "earlyexit") else "medusa"
    if cfg.head.kind in ("dflash", "peagle"):  # EAGLE-3's features: the same (shareable) eagle3 cache
        kind = "eagle3"
    aux = list(head.config.aux_hidden_state_layer_ids) if kind == "eagle3" else []
    if kind == "earlyexit":
        aux = [head.config.exit_layer]

    cache = None
    if cfg.data.hidden_states != "online" and cfg.head.kind != "medusa2":
        spec = CacheSpec(kind, aux, target.config.hidden_size, cache_dtype, data_fingerprint(examples))
        path = cfg.data.hidden_cache or str(Path(cfg.output_dir) / "hidden_cache")
        cache = HiddenStateCache(
            path, spec, target, rank=accelerator.process_index, shard_size=cfg.data.shard_size
        )
        if cfg.data.hidden_states == "offline":
            build_cache(
                target,
                train_ex,
                cache,
                batch_size=cfg.train.batch_size,
                progress=progress,
                rank=accelerator.process_index,
                world=accelerator.num_processes,
            )
            accelerator.wait_for_everyone()
            cache = HiddenStateCache(
                path, spec, target, rank=accelerator.process_index, shard_size=cfg.data.shard_size
            )
    mode = cfg.data.hidden_states if cache is not None else "online"
    # a reused EAGLE-3 cache (superset) makes hybrid runs of other kinds fill in all of its tensors
    hidden = HiddenStates(mode, target, cache.spec.aux_layers if cache is not None else aux, cache)
    # held-out eval: hybrid runs cache the eval rows too (read back at later evals); offline caches hold train rows only
    online = hidden if mode == "hybrid" else HiddenStates("online", target, aux)

    medusa2 = None
    if cfg.head.kind == "medusa2":
        from draftsmith.modeling import add_lora

        target = add_lora(target, r=cfg.medusa2.lora_r, alpha=cfg.medusa2.lora_alpha)
        medusa2 = cfg.medusa2
        medusa2.grad_accum = cfg.train.grad_accum
    trainer_module = HeadTrainer(head, target, hidden, cfg.loss, medusa2)
    groups = None
    if medusa2 is not None:
        lora = [p for n, p in trainer_module.target.named_parameters() if p.requires_grad]
        groups = [{"params": list(head.parameters()), "lr": medusa2.head_lr}, {"params": lora}]

    eval_batches = epoch_batches(eval_ex, cfg.train.batch_size, seed=0)(0) if eval_ex else []
    last_eval: dict = {}

    def eval_fn(module: HeadTrainer) -> dict:
        if not eval_batches:
            return {}
        res = evaluate_heads(
            module, eval_batches, online, eval_depth=cfg.eval.depth, tree_tokens=cfg.eval.tree_tokens
        )
        last_eval.clear()
        last_eval.update(res)
        return res

    def save_fn(module: HeadTrainer, out_dir: Path) -> None:
        save_head(module.head, out_dir, extra_json={ACCURACY_FILE: {"kind": cfg.head.kind, **last_eval}})
        if medusa2 is not None:  # Medusa-2 changed the target: the adapter ships beside the heads
            module.target.save_pretrained(str(Path(out_dir) / LORA_DIR))

    bpt = bytes_per_token(
        kind,
        target.config.hidden_size,
        {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[cache_dtype],
    )
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
        param_groups=groups,
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
