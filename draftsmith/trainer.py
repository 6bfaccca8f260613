"""One generic training loop (accelerate), parameterised by a loss closure.

Distillation (train/distill.py) and the Medusa/EAGLE heads (train/heads.py) both call `run(...)`; nothing
method-specific lives here. The loop gives every caller the same output-dir contract:

    out_dir/run.yaml                       resolved config (refuses an out_dir that holds another run)
    out_dir/metrics.jsonl                  one JSON per event: {"event": "train"|"eval", "step": ..., ...}
    out_dir/checkpoints/step-0000010/      accelerator.save_state (safetensors) + trainer_state.json,
                                           written under a tmp name then renamed; the last N are kept
    out_dir/final/                         whatever `save_fn(model, dir)` writes (save_pretrained)

Resume (`resume=True`) restores model/optimizer/scheduler/RNG from the newest checkpoint and the data position
(epoch, batch index), so a killed run continues where it stopped with the step count continuing.

Data: `batches` is either a re-iterable (list, DataLoader) or a callable `epoch -> iterable`. Items are
dealt round-robin to processes (batch i goes to rank i % world_size), so every rank sees different data and a
resumed run skips exactly the batches already consumed. Keep batch production cheap and deterministic per
epoch (seeded shuffles); expensive per-batch work (on-policy sampling) belongs in the loss closure.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

LossFn = Callable[[torch.nn.Module, Any], "tuple[torch.Tensor, dict[str, float]]"]
STATE_FILE = "trainer_state.json"
# keys a resumed run may change without being "another run"
RESUMABLE_CHANGES = {"max_steps", "log_every", "eval_every", "save_every", "keep_checkpoints", "num_workers"}


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
    seed: int = 0
    """Seed for torch/numpy/python RNGs (accelerate.utils.set_seed) and data order."""
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] | bool = "auto"
    """Autocast mode; auto = bf16 on CUDA and on CPUs with AMX, else no. (YAML 1.1 reads a bare `no` as false: accepted as "no".)"""
    num_workers: int = 0
    """DataLoader workers, for callers that build loaders."""

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
            "num_workers",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 0:
                raise DraftsmithError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise DraftsmithError(f"train.lr must be > 0, got {self.lr}")
        if self.max_grad_norm < 0:
            raise DraftsmithError(f"train.max_grad_norm must be >= 0 (0 = off), got {self.max_grad_norm}")
        if self.adam_betas is not None and len(self.adam_betas) != 2:
            raise DraftsmithError(f"train.adam_betas needs two numbers, got {self.adam_betas}")


def resolve_mixed_precision(mode: str) -> str:
    if mode == "auto":  # bf16 autocast where bf16 matmuls are native (CUDA, AMX CPUs): models.default_dtype
        from draftsmith.models import default_device, default_dtype

        return "bf16" if default_dtype(default_device()) == torch.bfloat16 else "no"
    return mode


def make_accelerator(args: TrainArgs, cpu: bool | None = None):
    """An Accelerator configured for `args` (grad accumulation, mixed precision). Env/launch config still apply."""
    from accelerate import Accelerator

    kw = {} if cpu is None else {"cpu": cpu}
    return Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        mixed_precision=resolve_mixed_precision(args.mixed_precision),
        **kw,
    )


# --- output dir and checkpoints ------------------------------------------------------------------------------


def _strip_resumable(cfg: Any) -> Any:
    if isinstance(cfg, dict):
        return {k: _strip_resumable(v) for k, v in cfg.items() if k not in RESUMABLE_CHANGES}
    return cfg


def prepare_out_dir(out_dir: str | Path, run_config: dict | None, resume: bool, overwrite: bool) -> Path:
    """Check `out_dir` is ours to write (same run, or resume/overwrite asked) and write run.yaml. Main process only."""
    out = Path(out_dir)
    run_yaml = out / "run.yaml"
    has_run = run_yaml.is_file() or (out / "checkpoints").is_dir() or (out / "metrics.jsonl").is_file()
    if has_run and overwrite:
        for name in ("checkpoints", "final"):
            shutil.rmtree(out / name, ignore_errors=True)
        for name in ("metrics.jsonl", "run.yaml"):
            (out / name).unlink(missing_ok=True)
    elif has_run:
        old = yaml.safe_load(run_yaml.read_text()) if run_yaml.is_file() else None
        if (
            run_config is not None
            and old is not None
            and _strip_resumable(old) != _strip_resumable(run_config)
        ):
            diff = _first_diff(_strip_resumable(old), _strip_resumable(run_config))
            raise DraftsmithError(
                f"{out} holds another run (run.yaml differs at {diff}); use a new output_dir or pass --overwrite"
            )
        if not resume:
            raise DraftsmithError(
                f"{out} already holds this run; pass --resume to continue it or --overwrite to restart"
            )
    elif resume:
        raise DraftsmithError(f"--resume: {out} holds no run to resume; drop --resume to start one")
    out.mkdir(parents=True, exist_ok=True)
    if run_config is not None:
        tmp = run_yaml.with_suffix(".yaml.tmp")
        tmp.write_text(yaml.safe_dump(run_config, sort_keys=False))
        os.replace(tmp, run_yaml)
    return out


def _first_diff(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_diff(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    return f"{path or '<root>'} ({a!r} vs {b!r})"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Renamed (hence complete) checkpoints, oldest first. Tmp dirs are never listed."""
    ckpt = Path(out_dir) / "checkpoints"
    if not ckpt.is_dir():
        return []
    return sorted(
        p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()
    )


def read_checkpoint_state(path: Path) -> dict:
    """The trainer_state.json of a checkpoint; a missing/corrupt one is a DraftsmithError naming it."""
    f = path / STATE_FILE
    try:
        state = json.loads(f.read_text())
        int(state["step"]), int(state["epoch"]), int(state["batch_index"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DraftsmithError(
            f"checkpoint {path} is corrupt or incomplete ({type(e).__name__} reading {STATE_FILE}); "
            "delete it to resume from the previous one"
        ) from None
    return state


def _scheduler_state(scheduler) -> dict:
    """The LR scheduler's state as JSON (its lr_lambdas are functions and are rebuilt from the recipe)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def _save_checkpoint(accelerator, out: Path, state: dict, keep: int) -> None:
    ckpt_dir = out / "checkpoints"
    final = ckpt_dir / f"step-{state['step']:07d}"
    tmp = ckpt_dir / f".tmp-step-{state['step']:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(
            json.dumps(state, indent=1)
        )  # written last: its presence marks completion
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(out)[: max(len(list_checkpoints(out)) - keep, 0)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


# --- the loop ----------------------------------------------------------------------------------------------------


def _epoch_iter(batches: Iterable | Callable[[int], Iterable], epoch: int) -> Iterable:
    return batches(epoch) if callable(batches) else batches


def _make_optimizer(
    model: torch.nn.Module, param_groups: list[dict] | None, args: TrainArgs
) -> torch.optim.Optimizer:
    if param_groups is None:
        param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    groups = [g for g in param_groups if any(p.requires_grad for p in g["params"])]
    if not groups:
        raise DraftsmithError("nothing to train: the model has no parameter with requires_grad=True")
    betas = tuple(args.adam_betas) if args.adam_betas else (0.9, 0.95)
    kw = dict(lr=args.lr, weight_decay=args.weight_decay, betas=betas)
    params = [p for g in groups for p in g["params"]]
    # the fused kernel: 5x faster than the default per-tensor loop on a CPU (measured: 45 vs 235 ms per step for
    # a draft with a 49152 x 576 embedding), where the optimizer was ~40% of a small draft's step
    if all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in params):
        try:
            return torch.optim.AdamW(groups, fused=True, **kw)
        except (RuntimeError, TypeError, ValueError):  # e.g. a dtype the fused kernel lacks
            pass
    return torch.optim.AdamW(groups, **kw)


def _shard(items: Iterable, world: int, rank: int, start: int):
    """Yield (index of the group's last item, this rank's item) for each complete group of `world` items at or
    after index `start`. Incomplete trailing groups are dropped so every rank takes the same number of steps."""
    mine = None
    for i, item in enumerate(items):
        if i < start:
            continue
        if (i - start) % world == rank:
            mine = item
        if (i - start) % world == world - 1:
            yield i, mine
            mine = None


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def run(
    accelerator,
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable | Callable[[int], Iterable],
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

    loss_fn(model, batch) -> (scalar loss, {name: float}); it receives the *prepared* model (DDP/FSDP wrapper) so
    gradients synchronise. A metric named "n_tokens" is summed (and turned into tokens/s), others averaged.
    eval_fn(unwrapped_model) -> {name: number | dict}, run on every process (reduce inside if you shard).
    save_fn(unwrapped_model, dir) writes final/ (main process only); default: model.save_pretrained.
    param_groups: AdamW groups (e.g. a higher LR for heads); default all trainable parameters.
    before_step(step) is called before the first micro-batch of each optimizer step (0-based, also right after
    a resume): e.g. to unfreeze a backbone after a warm-up (Medusa-2).
    """
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    if accelerator.gradient_accumulation_steps != args.grad_accum:
        raise DraftsmithError(
            f"accelerator has gradient_accumulation_steps={accelerator.gradient_accumulation_steps} but "
            f"train.grad_accum={args.grad_accum}; build it with draftsmith.trainer.make_accelerator(args)"
        )
    out = Path(out_dir)
    if accelerator.is_main_process:
        prepare_out_dir(out, run_config, resume, overwrite)
    accelerator.wait_for_everyone()
    set_seed(args.seed)

    optimizer = _make_optimizer(model, param_groups, args)
    # The scheduler is NOT passed to accelerator.prepare: a prepared scheduler steps num_processes times per call
    # (it assumes a per-process step count); we step it once per optimizer step ourselves.
    scheduler = get_scheduler(
        {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[args.schedule],
        optimizer,
        num_warmup_steps=args.warmup_steps,
        num_training_steps=args.max_steps,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not register_for_checkpointing: accelerate would pickle the scheduler and unpickle it with
    # weights_only=False on resume. Its state is a few numbers; it travels in trainer_state.json instead.

    step, epoch, batch_index = 0, 0, 0
    if resume:
        ckpts = list_checkpoints(out)
        if ckpts:
            state = read_checkpoint_state(ckpts[-1])
            try:
                accelerator.load_state(str(ckpts[-1]))
            except Exception as e:  # noqa: BLE001 - accelerate/safetensors raise many types
                raise DraftsmithError(
                    f"checkpoint {ckpts[-1]} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                    "delete it to resume from the previous one, or check the model config matches"
                ) from None
            step, epoch, batch_index = int(state["step"]), int(state["epoch"]), int(state["batch_index"])
            if "scheduler" in state:
                sched = state["scheduler"]
                scheduler.load_state_dict({"lr_lambdas": [None] * len(sched["base_lrs"]), **sched})
            if accelerator.is_main_process:  # drop events logged after the checkpoint: they are redone
                _truncate_metrics(out / "metrics.jsonl", step)
            accelerator.print(f"resuming from {ckpts[-1]} (step {step}, epoch {epoch}, batch {batch_index})")
        else:
            accelerator.print(f"--resume: no checkpoint in {out}/checkpoints yet; starting at step 0")

    metrics_path = out / "metrics.jsonl"

    def log_event(event: dict) -> None:
        if accelerator.is_main_process:
            with metrics_path.open("a") as f:
                f.write(json.dumps(event) + "\n")

    def do_eval() -> dict:
        if eval_fn is None:
            return {}
        unwrapped = accelerator.unwrap_model(model)
        was_training = unwrapped.training
        unwrapped.eval()
        with torch.no_grad():
            res = eval_fn(unwrapped)
        unwrapped.train(was_training)
        log_event({"event": "eval", "step": step, **res})
        return res

    last_eval = do_eval() if (args.eval_before_training and step == 0) else {}
    model.train()
    world, rank = accelerator.num_processes, accelerator.process_index
    bar = tqdm(
        total=args.max_steps,
        initial=step,
        desc="train",
        disable=not (progress and accelerator.is_main_process),
    )
    sums: dict[str, float] = {}
    n_micro, n_tokens, t_window = 0, 0.0, time.perf_counter()
    last_log: dict = {}
    new_step = True
    while step < args.max_steps:
        seen_this_epoch = False
        for i_last, batch in _shard(_epoch_iter(batches, epoch), world, rank, batch_index):
            seen_this_epoch = True
            if new_step and before_step is not None:
                before_step(step)
            new_step = False
            batch = _to_device(batch, accelerator.device)
            with accelerator.accumulate(model):
                loss, metrics = loss_fn(model, batch)
                if not torch.isfinite(loss):
                    raise DraftsmithError(
                        f"loss is {loss.item()} at step {step}; lower train.lr or check the data"
                    )
                accelerator.backward(loss)
                synced = accelerator.sync_gradients
                if synced and args.max_grad_norm > 0:
                    sums["grad_norm"] = sums.get("grad_norm", 0.0) + args.grad_accum * float(
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    )
                optimizer.step()  # accelerate makes this a no-op until the last micro-batch of the step
                optimizer.zero_grad(set_to_none=True)
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for k, v in metrics.items():
                if k == "n_tokens":
                    n_tokens += float(v)
                else:
                    sums[k] = sums.get(k, 0.0) + float(v)
            n_micro += 1
            if not synced:
                continue
            new_step = True
            scheduler.step()
            step += 1
            batch_index = i_last + 1
            bar.update(1)
            if step % max(args.log_every, 1) == 0 or step == args.max_steps:
                last_log = _log_train(accelerator, sums, n_micro, n_tokens, t_window, step, epoch, scheduler)
                log_event(last_log)
                bar.set_postfix(loss=f"{last_log['loss']:.4f}", lr=f"{last_log['lr']:.2e}")
                sums, n_micro, n_tokens, t_window = {}, 0, 0.0, time.perf_counter()
            if args.eval_every and step % args.eval_every == 0 and step < args.max_steps:
                last_eval = do_eval()
                model.train()
            if args.save_every and step % args.save_every == 0:
                state = {
                    "step": step,
                    "epoch": epoch,
                    "batch_index": batch_index,
                    "scheduler": _scheduler_state(scheduler),
                }
                _save_checkpoint(accelerator, out, state, args.keep_checkpoints)
            if step >= args.max_steps:
                break
        else:
            if not seen_this_epoch and batch_index == 0:
                raise DraftsmithError(
                    f"the training data produced no batch for process {rank} in epoch {epoch}; "
                    f"add data (each epoch needs >= {world} batches) or lower batch_size"
                )
            epoch, batch_index = epoch + 1, 0
    bar.close()
    last_eval = do_eval() if eval_fn is not None else last_eval
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final, tmp = out / "final", out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        (save_fn or (lambda m, d: m.save_pretrained(d)))(unwrapped, tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return {"step": step, "train": last_log, "eval": last_eval}


def _truncate_metrics(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _log_train(
    accelerator, sums: dict, n_micro: int, n_tokens: float, t0: float, step: int, epoch: int, scheduler
) -> dict:
    keys = sorted(sums)
    vals = torch.tensor([sums[k] / max(n_micro, 1) for k in keys] + [n_tokens], device=accelerator.device)
    vals = accelerator.reduce(vals, reduction="sum")
    world = accelerator.num_processes
    dt = max(time.perf_counter() - t0, 1e-9)
    event = {"event": "train", "step": step, "epoch": epoch, "lr": scheduler.get_last_lr()[0]}
    event.update({k: float(v) / world for k, v in zip(keys, vals[:-1].tolist())})
    if n_tokens or float(vals[-1]):
        event["n_tokens"] = int(vals[-1])
        event["tokens_per_s"] = float(vals[-1]) / dt
    event["elapsed_s"] = dt
    if not math.isfinite(event.get("loss", 0.0)):
        raise DraftsmithError(f"loss became {event['loss']} at step {step}; lower train.lr or check the data")
    return event
