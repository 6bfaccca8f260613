"""One generic training loop, parameterised by a loss closure; accelerate runs it, or Lightning's Trainer.

Distillation (train/distill.py) and the Medusa/EAGLE heads (train/heads.py) both call `run(...)`; nothing
method-specific lives here. `run`'s first argument picks the engine: an accelerate `Accelerator`
(`make_accelerator`) runs the loop below; a `draftsmith.lightning_engine.LightningEngine` runs the same steps
(draftsmith.trainstep) under Lightning's Trainer. Every caller gets the same output folder (draftsmith.rundir):

    out_dir/run.yaml                       resolved config (refuses an out_dir that holds another run)
    out_dir/.lock                          held while the run lives (a second start is refused, naming the pid)
    out_dir/metrics.jsonl                  one JSON per event: {"event": "train"|"eval", "step": ..., ...}
    out_dir/checkpoints/step-0000010/      accelerator.save_state (Lightning: its checkpoint) + trainer_state.json,
                                           written under a tmp name then renamed; the last N are kept
    out_dir/final/                         whatever `save_fn(model, dir)` writes (save_pretrained), with the
                                           whole parameters gathered under sharded engines (FSDP, ZeRO-3)

Resume (`resume=True`) restores model/optimizer/scheduler/RNG from the newest checkpoint and the data position
(epoch, batch index), so a killed run continues where it stopped with the step count continuing.

Data: `batches` is either a re-iterable (list, DataLoader) or a callable `epoch -> iterable`. Items are
dealt round-robin to processes (batch i goes to rank i % world_size), so every rank sees different data and a
resumed run skips exactly the batches already consumed. Keep batch production cheap and deterministic per
epoch (seeded shuffles); expensive per-batch work (on-policy sampling) belongs in the loss closure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from draftsmith.engines import (
    check_distributed,
    full_params,
    make_accelerator,
    resolve_mixed_precision,
    unshard_for_good,
)
from draftsmith.errors import DraftsmithError
from draftsmith.launch import trim_heap
from draftsmith.rundir import (
    Position,
    check_out_dir,
    claim_out_dir,
    list_checkpoints,
    restore_checkpoint,
    save_checkpoint,
    scheduler_state,
    truncate_events,
)
from draftsmith.trainstep import (
    Batches,
    BatchStream,
    MetricWindow,
    checked_loss,
    evaluate_model,
    log_event,
    make_optimizer,
    make_scheduler,
    snapshot_name,
    to_device,
    write_final,
)

__all__ = ["TrainArgs", "run", "make_accelerator", "list_checkpoints", "resolve_mixed_precision"]

log = logging.getLogger(__name__)

LossFn = Callable[[torch.nn.Module, Any], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass
class TrainArgs:
    max_steps: int = 1000
    """Optimizer steps to run (each = grad_accum micro-batches per process)."""
    batch_size: int = 8
    """Sequences per micro-batch per process (used by the data policy that builds the batches)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (accelerator.accumulate)."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay (applied to the parameter groups that do not override it)."""
    adam_betas: list[float] | None = None
    """AdamW betas; null = (0.9, 0.95)."""
    warmup_steps: int = 0
    """Linear warm-up steps before the schedule starts."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """LR schedule after warm-up (transformers.get_scheduler)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    log_every: int = 10
    """Steps between train log events (loss, lr, grad norm, tokens/s) in metrics.jsonl."""
    eval_every: int = 0
    """Steps between evaluations (0 = only at the end). eval_fn also runs before training unless resuming."""
    eval_before_training: bool = True
    """Run eval_fn at step 0 so the log holds the initialisation's numbers (before/after comparisons)."""
    save_every: int = 0
    """Steps between checkpoints (0 = none besides final/)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep (oldest removed first)."""
    snapshot_steps: list[int] = field(default_factory=list)
    """Steps after which the model is evaluated and written in final/'s format to snapshots/step-NNNNNNN/ (kept,
    loadable like final/): a data-scaling curve from one run (one epoch at schedule: constant = the model after N
    unique examples)."""
    seed: int = 0
    """Seed for torch/numpy/python RNGs (accelerate.utils.set_seed) and data order."""
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] | bool = "auto"
    """Autocast mode; auto = bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else no. (YAML 1.1 reads a bare `no` as false: accepted as "no".)"""

    def __post_init__(self) -> None:
        if self.mixed_precision is False:
            self.mixed_precision = "no"
        if self.mixed_precision not in ("no", "bf16", "fp16", "auto"):
            raise DraftsmithError(
                f"train.mixed_precision must be no, bf16, fp16 or auto, got {self.mixed_precision!r}"
            )
        for name in ("max_steps", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise DraftsmithError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "log_every",
            "eval_every",
            "save_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 0:
                raise DraftsmithError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise DraftsmithError(f"train.lr must be > 0, got {self.lr}")
        if self.max_grad_norm < 0:
            raise DraftsmithError(f"train.max_grad_norm must be >= 0 (0 = off), got {self.max_grad_norm}")
        bad = [s for s in self.snapshot_steps if not isinstance(s, int) or not 1 <= s <= self.max_steps]
        if bad:
            raise DraftsmithError(
                f"train.snapshot_steps must be steps in [1, train.max_steps={self.max_steps}], got {bad}"
            )
        if self.adam_betas is not None and len(self.adam_betas) != 2:
            raise DraftsmithError(f"train.adam_betas needs two numbers, got {self.adam_betas}")


# --- the accelerate loop -------------------------------------------------------------------------------------------


class _Loop:
    """The state of one accelerate run and its named steps; `run` below strings them together."""

    def __init__(
        self, accelerator, model, optimizer, scheduler, loss_fn, args, out, eval_fn, save_fn, before_step
    ):
        self.acc, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.loss_fn, self.args, self.out, self.eval_fn = loss_fn, args, out, eval_fn
        self.save_fn, self.before_step = save_fn, before_step
        self.pos = Position()
        self.window = MetricWindow()
        self.last_log: dict = {}
        self.last_eval: dict = {}

    def log_event(self, event: dict) -> None:
        if self.acc.is_main_process:
            log_event(self.out, event)

    def evaluate(self) -> None:
        """eval_fn on the unwrapped model with whole parameters (sharded engines gather them), logged."""
        if self.eval_fn is None:
            return
        with full_params(self.acc, self.model):
            res = evaluate_model(self.acc.unwrap_model(self.model), self.eval_fn)
        self.log_event({"event": "eval", "step": self.pos.step, **res})
        self.last_eval = res

    def snapshot(self) -> None:
        """The model as it stands, evaluated and written to snapshots/step-N/ (final/'s format), training goes on."""
        self.evaluate()
        with full_params(self.acc, self.model):
            if self.acc.is_main_process:
                write_final(
                    self.acc.unwrap_model(self.model), self.out, self.save_fn, snapshot_name(self.pos.step)
                )
            self.acc.wait_for_everyone()
        self.model.train()

    def micro_step(self, batch) -> bool:
        """Forward + backward of one micro-batch (optimizer steps on the last of grad_accum); True if it stepped."""
        args, acc = self.args, self.acc
        with acc.accumulate(self.model):
            loss, metrics = self.loss_fn(self.model, to_device(batch, acc.device))
            acc.backward(checked_loss(loss, self.pos.step))
            synced = acc.sync_gradients
            if synced and args.max_grad_norm > 0:
                norm = acc.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
                if (
                    norm is not None
                ):  # DeepSpeed clips inside its step and reports the norm of the step before
                    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
                    self.window.add("grad_norm", args.grad_accum * float(norm))
            self.optimizer.step()  # accelerate makes this a no-op until the last micro-batch of the step
            self.optimizer.zero_grad(set_to_none=True)
        self.window.add_micro(loss, metrics)
        return synced

    def end_step(self, stream: BatchStream, bar) -> None:
        """After an optimizer step: schedule, log, evaluate and checkpoint as the recipe asks."""
        args, pos, acc = self.args, self.pos, self.acc
        self.scheduler.step()
        trim_heap()
        pos.step += 1
        pos.epoch, pos.batch_index = stream.epoch, stream.batch_index
        bar.update(1)
        if pos.step % max(args.log_every, 1) == 0 or pos.step == args.max_steps:
            lr = self.scheduler.get_last_lr()[0]
            reduce_sum = lambda t: acc.reduce(t, reduction="sum")  # noqa: E731
            self.last_log = self.window.event(
                reduce_sum, acc.device, acc.num_processes, pos.step, pos.epoch, lr
            )
            self.log_event(self.last_log)
            bar.set_postfix(loss=f"{self.last_log['loss']:.4f}", lr=f"{self.last_log['lr']:.2e}")
            self.window = MetricWindow()
        if args.eval_every and pos.step % args.eval_every == 0 and pos.step < args.max_steps:
            self.evaluate()
            self.model.train()
        if pos.step in args.snapshot_steps and pos.step < args.max_steps:  # the last step's is final/
            self.snapshot()
        if args.save_every and pos.step % args.save_every == 0:
            state = {**vars(pos), "scheduler": scheduler_state(self.scheduler)}
            save_checkpoint(acc, self.out, state, args.keep_checkpoints)

    def train(self, batches: Batches, progress: bool) -> None:
        """Optimizer steps until max_steps, this rank's share of each group of batches (draftsmith.trainstep)."""
        from tqdm.auto import tqdm

        args, pos, acc = self.args, self.pos, self.acc
        stream = BatchStream(batches, acc.num_processes, acc.process_index)
        stream.load_state_dict(vars(pos))
        self.model.train()
        bar = tqdm(
            total=args.max_steps,
            initial=pos.step,
            desc="train",
            disable=not (progress and acc.is_main_process),
        )
        new_step = True
        for batch in stream if pos.step < args.max_steps else ():
            if new_step and self.before_step is not None:
                self.before_step(pos.step)
            new_step = self.micro_step(batch)
            if new_step:
                self.end_step(stream, bar)
                if pos.step >= args.max_steps:
                    break
        bar.close()

    def save_final(self, save_fn: Callable[[torch.nn.Module, Path], None] | None) -> None:
        """final/ via save_fn on the main process, whole parameters gathered on every process first."""
        acc = self.acc
        acc.wait_for_everyone()
        unshard_for_good(acc, self.model)
        with full_params(acc, self.model):
            if acc.is_main_process:
                write_final(acc.unwrap_model(self.model), self.out, save_fn)
            acc.wait_for_everyone()


def run(
    accelerator,
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Batches,
    args: TrainArgs,
    out_dir: str | Path,
    *,
    param_groups: list[dict] | None = None,
    eval_fn: Callable[[torch.nn.Module], dict] | None = None,
    save_fn: Callable[[torch.nn.Module, Path], None] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    run_config: dict | None = None,
    progress: bool = True,
    before_step: Callable[[int], None] | None = None,
) -> dict:
    """Train `model` for `args.max_steps` optimizer steps; returns {"step", "train": last log, "eval": last eval}.

    accelerator: an accelerate Accelerator (make_accelerator), or a LightningEngine (draftsmith.lightning_engine)
    to run the same steps under Lightning's Trainer.
    loss_fn(model, batch) -> (scalar loss, {name: float}); it receives the *prepared* model (DDP/FSDP wrapper) so
    gradients synchronise. A metric named "n_tokens" is summed (and turned into tokens/s), others averaged.
    eval_fn(unwrapped_model) -> {name: number | dict}, run on every process (reduce inside if you shard).
    save_fn(unwrapped_model, dir) writes final/ (main process only); default: model.save_pretrained.
    param_groups: AdamW groups (e.g. a higher LR for heads); default all trainable parameters.
    before_step(step) is called before the first micro-batch of each optimizer step (0-based, also right after
    a resume): e.g. to unfreeze a backbone after a warm-up (Medusa-2).
    Nothing is written to out_dir until every check that can fail before training has passed.
    """
    from accelerate.utils import set_seed

    from draftsmith.lightning_engine import LightningEngine

    kw = dict(param_groups=param_groups, eval_fn=eval_fn, save_fn=save_fn, resume=resume, overwrite=overwrite,
              run_config=run_config, progress=progress, before_step=before_step)  # fmt: skip
    if isinstance(accelerator, LightningEngine):
        return accelerator.run(model, loss_fn, batches, args, out_dir, **kw)
    if accelerator.gradient_accumulation_steps != args.grad_accum:
        raise DraftsmithError(
            f"accelerator has gradient_accumulation_steps={accelerator.gradient_accumulation_steps} but "
            f"train.grad_accum={args.grad_accum}; build it with draftsmith.trainer.make_accelerator(args)"
        )
    check_distributed(accelerator)
    out = Path(out_dir)
    check_out_dir(out, run_config, resume, overwrite)  # every process: reads only, so all refuse alike
    set_seed(args.seed)
    optimizer = make_optimizer(model, param_groups, args)
    # the scheduler is NOT passed to accelerator.prepare: a prepared scheduler steps num_processes times per call
    # (it assumes a per-process step count); it is stepped once per optimizer step here. Nor
    # register_for_checkpointing: accelerate would pickle it; its state travels in trainer_state.json instead.
    scheduler = make_scheduler(optimizer, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    loop = _Loop(accelerator, model, optimizer, scheduler, loss_fn, args, out, eval_fn, save_fn, before_step)
    if resume:
        loop.pos = restore_checkpoint(accelerator, out, scheduler)
    accelerator.wait_for_everyone()  # every process has checked the folder before the main one locks it
    lock = claim_out_dir(out, run_config, resume, overwrite) if accelerator.is_main_process else None
    try:
        if accelerator.is_main_process and resume:  # events logged after the checkpoint are redone
            truncate_events(out / "metrics.jsonl", loop.pos.step)
        if args.eval_before_training and loop.pos.step == 0:
            loop.evaluate()
        loop.train(batches, progress)
        loop.evaluate()
        loop.save_final(save_fn)
    finally:
        if lock is not None:
            lock.close()
    return {"step": loop.pos.step, "train": loop.last_log, "eval": loop.last_eval}
