"""The Lightning engine: draftsmith's training run with Lightning's Trainer doing the loop.

    python train/distill.py --config RECIPE --engine lightning                    # one process
    python train/heads.py --config RECIPE --engine lightning --devices 2          # DDP: Lightning starts 2 processes
    torchrun --nproc_per_node 2 train/distill.py --config RECIPE --engine lightning   # DDP: torchrun starts them

A `LightningEngine` stands where the recipes take an accelerate Accelerator (device, process index and count,
wait_for_everyone, print) and `draftsmith.trainer.run` hands it the run. The model, the recipe's loss closure, the
data stream, AdamW and its schedule, the loss check and the metric sums are draftsmith.trainstep's, the run folder
(lock, run.yaml, metrics.jsonl, step checkpoints, final/) draftsmith.rundir's: the accelerate loop's own. Lightning
does the loop, gradient accumulation (`accumulate_grad_batches`), clipping (`gradient_clip_val`), precision
(`32-true`, `bf16-mixed`, `16-mixed`; it autocasts the whole training step, accelerate the trained module's
forward), DDP, checkpointing (`trainer.save_checkpoint`, `fit(ckpt_path=...)`), the progress bar and its loggers
(CSV under out_dir/lightning_logs/, plus any passed in).

A checkpoint is Lightning's checkpoint dict (weights, optimizer, scheduler, loop counters, callback states) plus
every process's RNG state, in one safetensors file (draftsmith.statefile, written by a CheckpointIO plugin: no
pickle). The data position is the `BatchStream`, which Lightning saves with its loops because it has
state_dict/load_state_dict; it has a length, so Lightning reads no batch ahead and the saved position is that of
the last batch trained on. A resume that does not get the position or the RNG state back stops with one line.

Strategies: one process ("auto") and DDP ("ddp"). Lightning runs FSDP and DeepSpeed only on CUDA devices; this
engine refuses them everywhere (FSDP2 and ZeRO-2/3 run under the accelerate engine, on CPUs and GPUs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from draftsmith.engines import resolve_mixed_precision
from draftsmith.errors import DraftsmithError
from draftsmith.rundir import Position, check_out_dir, claim_out_dir, newest_checkpoint, truncate_events
from draftsmith.trainstep import Batches, BatchStream, make_optimizer, make_scheduler, write_final

STRATEGIES = ("auto", "ddp")
PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
# Lightning's notes that say nothing about a draftsmith run (shown with -v): torch 2.13 deprecates a call inside
# Lightning's pytree helper
NOISE = (r".*isinstance\(treespec, LeafSpec\)",)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's INFO lines (devices found, tips, "fit stopped") and NOISE warnings hidden unless -v."""
    if logging.getLogger("draftsmith").isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for pattern in NOISE:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class LightningEngine:
    """Lightning's strategy for a run, set up before the recipe loads anything: under DDP the other processes are
    started now (Lightning's launcher reruns the script with LOCAL_RANK set; torchrun starts them itself) and the
    process group formed, because the recipe's set-up already needs every process and its rank.

    callbacks / loggers: more Lightning callbacks and loggers for the Trainer (Python API)."""

    def __init__(self, args, *, strategy: str = "auto", devices: int | None = None, callbacks=(), loggers=()):
        if strategy not in STRATEGIES:
            raise DraftsmithError(
                f"--strategy {strategy}: the lightning engine runs auto (one process) or ddp (--devices N); "
                "for FSDP or DeepSpeed ZeRO use the accelerate engine (recipes/accelerate/*.yaml), Lightning runs "
                "those only on CUDA GPUs"
            )
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if devices is None else devices
        if devices < 1:
            raise DraftsmithError(f"--devices must be >= 1, got {devices}")
        try:
            import lightning.pytorch as pl
        except ImportError:
            raise DraftsmithError(
                "--engine lightning needs Lightning: pip install 'draftsmith[lightning]' (or lightning>=2.3)"
            ) from None
        self.args, self.callbacks, self.loggers = args, list(callbacks), list(loggers)
        precision = PRECISION[resolve_mixed_precision(args.mixed_precision)]
        self.trainer_kw = dict(accelerator="auto", devices=devices, num_nodes=1, precision=precision,
                               strategy="ddp" if strategy == "auto" and devices > 1 else strategy)  # fmt: skip
        with quiet_lightning():
            probe = pl.Trainer(**self.trainer_kw, logger=False, enable_checkpointing=False,
                               enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
            launcher = probe.strategy.launcher
            if launcher is not None:  # a no-op in a process Lightning or torchrun started
                launcher.launch(lambda: None, trainer=probe)
            probe.strategy.setup_environment()  # DDP: the process group; the Trainer of the run reuses it
        self.children = list(getattr(launcher, "procs", []))
        self.device: torch.device = probe.strategy.root_device
        self.process_index: int = probe.global_rank
        self.num_processes: int = probe.world_size
        self.engine_name = "ddp" if self.num_processes > 1 else "single"  # draftsmith.engines.engine_name
        self.gradient_accumulation_steps = args.grad_accum

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    def wait_for_everyone(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the processes Lightning started (the main process's last act); after `timeout` s, kill them."""
        import subprocess

        for proc in self.children:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def run(self, model, loss_fn, batches: Batches, args, out_dir, *, param_groups=None, eval_fn=None,
            save_fn=None, resume=False, overwrite=False, run_config=None, progress=True, before_step=None) -> dict:  # fmt: skip
        """draftsmith.trainer.run under Lightning (same arguments, same result, same run folder)."""
        from accelerate.utils import set_seed

        from draftsmith.lightning_loop import LoopModule, RunHooks, checkpoint_rng

        if args.grad_accum != self.args.grad_accum:
            raise DraftsmithError(
                f"the engine was built for train.grad_accum={self.args.grad_accum}, the run has {args.grad_accum}"
            )
        out = Path(out_dir)
        check_out_dir(out, run_config, resume, overwrite)  # every process: reads only, so all refuse alike
        set_seed(args.seed)
        optimizer = make_optimizer(model, param_groups, args)
        module = LoopModule(model, loss_fn, optimizer, make_scheduler(optimizer, args), args, before_step)
        ckpt, start, rng = None, Position(), None
        if resume:
            found = newest_checkpoint(out, "lightning")
            if found is None:
                self.print(f"--resume: no checkpoint in {out}/checkpoints yet; starting at step 0")
            else:
                ckpt, state = found
                start = Position(int(state["step"]), int(state["epoch"]), int(state["batch_index"]))
                rng = checkpoint_rng(ckpt, self.num_processes, self.process_index)
        stream = BatchStream(
            batches, self.num_processes, self.process_index, length=args.max_steps * args.grad_accum
        )
        hooks = RunHooks(self, out, args, eval_fn, save_fn, stream, start, rng)
        self.wait_for_everyone()  # every process has checked the folder before the main one locks it
        lock = claim_out_dir(out, run_config, resume, overwrite) if self.is_main_process else None
        try:
            if self.is_main_process and resume:  # events logged after the checkpoint are redone
                truncate_events(out / "metrics.jsonl", start.step)
            if args.eval_before_training and start.step == 0:
                hooks.evaluate(model, 0)
            trainer = self._trainer(args, out, hooks, progress)
            with quiet_lightning():
                trainer.fit(module, train_dataloaders=stream, ckpt_path=str(ckpt) if ckpt else None)
            model.to(self.device)  # Lightning's teardown leaves the module on the CPU
            hooks.evaluate(model, trainer.global_step)
            self.wait_for_everyone()
            if self.is_main_process:
                write_final(model, out, save_fn)
            self.wait_for_everyone()
        finally:
            if lock is not None:
                lock.close()
        return {"step": trainer.global_step, "train": hooks.last_log, "eval": hooks.last_eval}

    def _trainer(self, args, out: Path, hooks, progress: bool):
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import Checkpoint, ProgressBar, TQDMProgressBar
        from lightning.pytorch.loggers import CSVLogger

        from draftsmith.lightning_loop import RunFolderIO

        # tqdm, as the accelerate loop's bar (Lightning would pick its rich bar when rich is installed)
        own_bar = progress and not any(isinstance(c, ProgressBar) for c in self.callbacks)
        with quiet_lightning():
            return pl.Trainer(
                **self.trainer_kw,
                max_steps=args.max_steps,
                max_epochs=-1,  # the stream is one epoch as long as the run: draftsmith's epochs are inside it
                accumulate_grad_batches=args.grad_accum,
                gradient_clip_val=args.max_grad_norm or None,
                gradient_clip_algorithm="norm",
                callbacks=[hooks, *([TQDMProgressBar()] if own_bar else []), *self.callbacks],
                logger=[CSVLogger(out, name="lightning_logs"), *self.loggers],
                plugins=[RunFolderIO(out, args.keep_checkpoints)],
                enable_checkpointing=any(isinstance(c, Checkpoint) for c in self.callbacks),
                enable_progress_bar=progress,
                enable_model_summary=logging.getLogger("draftsmith").isEnabledFor(logging.DEBUG),
                num_sanity_val_steps=0,
                log_every_n_steps=max(args.log_every, 1),
                use_distributed_sampler=False,
                default_root_dir=out,
            )
