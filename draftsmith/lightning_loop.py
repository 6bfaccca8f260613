"""The Lightning classes of draftsmith.lightning_engine (imported only when that engine runs): the LightningModule
around the recipe's model and loss closure, the callback that does draftsmith's part of each step, and the
CheckpointIO plugin that writes Lightning's checkpoints as draftsmith step folders."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import CheckpointIO

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import replace_dir
from draftsmith.launch import trim_heap
from draftsmith.rundir import Position, begin_checkpoint, finish_checkpoint, read_checkpoint_state
from draftsmith.statefile import dumps_state, load_state, loads_state, rng_state, save_state, set_rng_state
from draftsmith.trainstep import (
    BatchStream,
    MetricWindow,
    checked_loss,
    evaluate_model,
    log_event,
    snapshot_name,
    to_device,
    write_final,
)

if TYPE_CHECKING:
    from draftsmith.lightning_engine import LightningEngine

CHECKPOINT_FILE = "checkpoint.safetensors"


class LoopModule(pl.LightningModule):
    """The recipe's model and loss closure as a LightningModule: training_step is the accelerate loop's micro-step
    without the backward and optimizer calls, which Lightning makes. The model is a submodule (Lightning's DDP
    wraps this module and calls training_step through the wrapper, so gradients synchronise)."""

    def __init__(self, model, loss_fn, optimizer, scheduler, args, before_step):
        super().__init__()
        self.model = model
        self.loss_fn, self.optimizer, self.scheduler, self.before_step = (
            loss_fn,
            optimizer,
            scheduler,
            before_step,
        )
        self.train_args = args
        self.window = MetricWindow()
        self.micro = 0

    def configure_optimizers(self):
        return {
            "optimizer": self.optimizer,
            "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"},
        }

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return to_device(batch, device)

    def training_step(self, batch, batch_idx):
        if self.micro % self.train_args.grad_accum == 0 and self.before_step is not None:
            self.before_step(self.trainer.global_step)
        self.micro += 1
        loss, metrics = self.loss_fn(self.model, batch)
        checked_loss(loss, self.trainer.global_step)
        self.window.add_micro(loss, metrics)
        return loss

    def on_before_optimizer_step(self, optimizer):
        # the norm Lightning's clipping is about to take (accelerate's clip_grad_norm_ returns it)
        if self.train_args.max_grad_norm > 0:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            self.window.add("grad_norm", self.train_args.grad_accum * float(norm))


class RunHooks(pl.Callback):
    """draftsmith's part of the run inside Lightning's loop, in the accelerate loop's order after each optimizer
    step: log (metrics.jsonl, Lightning's loggers, the progress bar), evaluate, checkpoint. Also the RNG states and
    the data position in and out of checkpoints, and the check that a resume got them back."""

    def __init__(self, engine: LightningEngine, out: Path, args, eval_fn, save_fn, stream: BatchStream,
                 start: Position, rng: dict | None):  # fmt: skip
        self.engine, self.out, self.args, self.eval_fn, self.stream = engine, out, args, eval_fn, stream
        self.save_fn = save_fn
        self.start, self.last_step, self.rng_to_restore = start, start.step, rng
        self.last_log: dict = {}
        self.last_eval: dict = {}

    def evaluate(self, model: torch.nn.Module, step: int) -> None:
        if self.eval_fn is None:
            return
        self.last_eval = evaluate_model(model, self.eval_fn)
        if self.engine.is_main_process:
            log_event(self.out, {"event": "eval", "step": step, **self.last_eval})

    def on_train_start(self, trainer, pl_module) -> None:
        self.last_step = trainer.global_step
        want = {"epoch": self.start.epoch, "batch_index": self.start.batch_index}
        if trainer.global_step != self.start.step or self.stream.state_dict() != want:
            raise DraftsmithError(
                f"Lightning restored step {trainer.global_step} at data position {self.stream.state_dict()}, the "
                f"checkpoint holds step {self.start.step} at {want}; the resume would diverge"
            )
        if self.rng_to_restore is not None:  # the last thing before the first step, as in the accelerate loop
            set_rng_state(self.rng_to_restore)
            self.rng_to_restore = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, args = trainer.global_step, self.args
        if step == self.last_step:  # a micro-batch inside an optimizer step
            return
        self.last_step = step
        trim_heap()  # as the accelerate loop after each optimizer step
        if step % max(args.log_every, 1) == 0 or step == args.max_steps:
            self._log(trainer, pl_module, step)
        if args.eval_every and step % args.eval_every == 0 and step < args.max_steps:
            self.evaluate(pl_module.model, step)
            pl_module.model.train()
        if (
            step in args.snapshot_steps and step < args.max_steps
        ):  # as the accelerate loop: the last step's is final/
            self.evaluate(pl_module.model, step)
            if self.engine.is_main_process:
                write_final(pl_module.model, self.out, self.save_fn, snapshot_name(step))
            self.engine.wait_for_everyone()
            pl_module.model.train()
        if args.save_every and step % args.save_every == 0:
            trainer.save_checkpoint(self.out / "checkpoints" / f"step-{step:07d}")

    def _log(self, trainer, pl_module: LoopModule, step: int) -> None:
        eng = self.engine
        lr = pl_module.scheduler.get_last_lr()[0]
        reduce_sum = lambda t: trainer.strategy.reduce(t, reduce_op="sum")  # noqa: E731
        event = pl_module.window.event(reduce_sum, eng.device, eng.num_processes, step, self.stream.epoch, lr)
        pl_module.window = MetricWindow()
        self.last_log = event
        if eng.is_main_process:
            log_event(self.out, event)
        numbers = {
            k: v for k, v in event.items() if isinstance(v, (int, float)) and k not in ("event", "step")
        }
        for logger in trainer.loggers:
            logger.log_metrics(numbers, step=step)
        pl_module.log_dict({"loss": event["loss"], "lr": lr}, prog_bar=True, logger=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        blob = torch.frombuffer(bytearray(dumps_state(rng_state())), dtype=torch.uint8)
        checkpoint["draftsmith"] = {
            "step": trainer.global_step,
            **self.stream.state_dict(),
            "rng": gather_blobs(blob, self.engine.num_processes),
        }


def checkpoint_rng(ckpt: Path, world: int, rank: int) -> dict:
    """This process's RNG state in a step folder, checked with the folder's step and the process count before the
    run claims its folder or Lightning loads anything (only the draftsmith part of the file is read)."""
    step = read_checkpoint_state(ckpt)["step"]
    try:
        ours, meta = load_state(ckpt / CHECKPOINT_FILE, part="draftsmith")
        if meta.get("step") != str(step) or ours.get("step") != step:
            raise DraftsmithError(
                f"{ckpt / CHECKPOINT_FILE} holds step {meta.get('step')}, its folder step {step}"
            )
    except DraftsmithError as e:
        raise DraftsmithError(f"{e}; delete checkpoint {ckpt} to resume from the previous one") from None
    states = ours.get("rng") or []
    if len(states) != world:
        raise DraftsmithError(
            f"checkpoint {ckpt} holds the RNG states of {len(states)} processes, this run has {world}; resume "
            "with as many processes as the run started with"
        )
    return loads_state(bytes(states[rank].numpy()), f"RNG state of process {rank} in {ckpt}")[0]


def gather_blobs(blob: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every process's byte blob (uint8 [n]), on every process (call on all of them)."""
    if world == 1:
        return [blob]
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([blob.numel()]))
    longest = int(max(sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: blob.numel()] = blob
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded)
    return [o[: int(n)] for o, n in zip(out, sizes)]


class RunFolderIO(CheckpointIO):
    """Lightning's checkpoints as draftsmith step folders: out/checkpoints/step-N/ holding checkpoint.safetensors
    and trainer_state.json, written under a tmp name then renamed, the oldest beyond `keep` removed. A checkpoint
    another callback writes elsewhere (a ModelCheckpoint passed in) is a folder holding checkpoint.safetensors at
    its own path, not one of the run's step checkpoints."""

    def __init__(self, out: Path, keep: int):
        self.out, self.keep = out, keep

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path, step = Path(path), checkpoint["global_step"]
        meta = {"step": str(step)}
        if path != self.out / "checkpoints" / f"step-{step:07d}":
            tmp = path.with_name(f".tmp-{path.name}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_state(tmp / CHECKPOINT_FILE, checkpoint, meta=meta)
            replace_dir(tmp, path)
            return
        ours = checkpoint["draftsmith"]
        tmp = begin_checkpoint(self.out, step)
        save_state(tmp / CHECKPOINT_FILE, checkpoint, meta=meta)
        state = {
            "step": step,
            "epoch": ours["epoch"],
            "batch_index": ours["batch_index"],
            "engine": "lightning",
        }
        finish_checkpoint(self.out, tmp, state, self.keep)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        try:
            return load_state(Path(path) / CHECKPOINT_FILE)[0]
        except DraftsmithError as e:
            raise DraftsmithError(f"{e}; delete checkpoint {path} to resume from the previous one") from None

    def remove_checkpoint(self, path) -> None:
        shutil.rmtree(path, ignore_errors=True)
