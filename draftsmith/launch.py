"""The one entry-script helper behind train/*.py: arguments, logging, the engine, errors, exit status.

    accelerate launch train/<script>.py --config RECIPE [key.sub=value ...] [--resume] [--overwrite] [-v]
    python train/<script>.py --config RECIPE --engine lightning [--devices N] [--strategy auto|ddp] [...]

Flags and dotted overrides may come in any order. A bad recipe or bad input prints ONE `error: ...` line (from the
first process only) and the script exits 2 before any process group is formed or file written. Under `accelerate
launch` that status is the child's: accelerate then reports the failed child and itself exits 1 (one process:
a CalledProcessError traceback unless `accelerate launch -q`; several: torchrun's ChildFailedError summary).
Run `python train/<script>.py` (one process) to get the status 2 itself. The scripts end through `exit_process`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError, OneLineArgumentParser


def _parser(description: str, recipe_hint: str) -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(description=description)
    parser.add_argument("--config", help=f"recipe YAML ({recipe_hint}); omitted = defaults")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in output_dir"
    )
    parser.add_argument("--overwrite", action="store_true", help="delete a previous run in output_dir first")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show accelerate/transformers logs")
    parser.add_argument(
        "--engine",
        default="accelerate",
        help="accelerate (default; engines from `accelerate launch --config_file`) or lightning (Lightning's Trainer)",
    )
    parser.add_argument("--strategy", help="lightning: auto (one process) or ddp")
    parser.add_argument(
        "--devices", type=int, help="lightning: processes (DDP when > 1; default 1, or torchrun's)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10 train.lr=3e-4"
    )
    return parser


def setup_logging(verbose: bool) -> None:
    """draftsmith's INFO lines on the console; libraries' INFO/DEBUG (checkpoint chatter) only with -v."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s", force=True)
    logging.getLogger("draftsmith").setLevel(logging.DEBUG if verbose else logging.INFO)


# glibc's malloc serves a freed large block's size from its heap afterwards (the mmap threshold rises to it, up
# to 32 MiB), and a heap whose top is pinned by one small live block never shrinks: with the sequence length
# changing every batch, a training process's resident memory grew ~100 MB a step (9 -> 14 GB in 50 steps of an
# EAGLE-3 run on a 1.5B target). A fixed threshold sends every block of 4 MiB or more back to the OS when freed.
MMAP_THRESHOLD = 4 << 20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@functools.lru_cache(maxsize=1)
def _glibc():
    """glibc's handle (None elsewhere: musl and others have no mallopt / malloc_trim, nor this heap)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def bound_heap() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD for this process; False where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim, under a millisecond): called after every
    optimizer step, it keeps blocks under the threshold that the step freed from piling up."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _first_process() -> bool:
    # set by accelerate/torchrun before the script starts: usable before any process group exists
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


def train_main(
    argv: list[str] | None,
    *,
    description: str,
    recipe_hint: str,
    config_cls: type,
    run_fn: Callable[..., dict],
    summary: Callable[[Any, dict], str],
) -> int:
    """Parse, load the recipe (strictly), build the engine (an Accelerator, or a LightningEngine), run
    `run_fn(cfg, accelerator, resume=, overwrite=, progress=)`, print `summary(cfg, result)` on the main process.
    Returns the exit status."""
    from draftsmith.deferred import defer_deepspeed
    from draftsmith.lightning_engine import LightningEngine

    args = _parser(description, recipe_hint).parse_intermixed_args(argv)
    setup_logging(args.verbose)
    bound_heap()
    defer_deepspeed()  # imported by the ZeRO engines that use it, not by every checkpoint save (draftsmith.deferred)
    accelerator = None
    try:
        from draftsmith import cpulayout
        from draftsmith.fileio import check_cache_dir

        cpulayout.mode()  # the environment's switches are checked before any recipe loads or writes
        check_cache_dir()
        cfg = load_config(config_cls, args.config, args.overrides)
        accelerator = make_engine(args, cfg.train)
        result = run_fn(
            cfg, accelerator, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress
        )
    except DraftsmithError as e:
        if _first_process():
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank at the first exit: give the first process the time to print its line
            time.sleep(2.0)
        if isinstance(accelerator, LightningEngine):  # processes Lightning started end with this one
            accelerator.close(timeout=30.0)
        return e.exit_code
    if accelerator.is_main_process:
        print(summary(cfg, result))
    _close_process_group()
    if isinstance(accelerator, LightningEngine):
        accelerator.close()
    return 0


def make_engine(args: argparse.Namespace, train_args):
    """The engine the command line asks for; a wrong combination of flags is a DraftsmithError."""
    if args.engine == "lightning":
        from draftsmith.lightning_engine import LightningEngine

        return LightningEngine(train_args, strategy=args.strategy or "auto", devices=args.devices)
    if args.engine != "accelerate":
        raise DraftsmithError(f"--engine {args.engine}: choose accelerate or lightning")
    if args.strategy is not None or args.devices is not None:
        raise DraftsmithError(
            "--strategy/--devices choose Lightning's processes (--engine lightning); the accelerate engine takes "
            "them from `accelerate launch --config_file recipes/accelerate/<engine>.yaml`"
        )
    from draftsmith.engines import make_accelerator

    return make_accelerator(train_args)


def _close_process_group() -> None:
    """Leave the process group before exiting: a rank that exits with gloo / DeepSpeed communication threads still
    running can abort at interpreter shutdown ("terminate called without an active exception", status -6) after
    a run that has finished and written everything."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(status: int) -> NoReturn:
    """End an entry script with `status`. A rank of a multi-process run (WORLD_SIZE > 1) flushes its output and
    leaves with os._exit, skipping the interpreter's teardown: there gloo's C++ worker threads can still hold work
    after destroy_process_group and abort the rank ("terminate called without an active exception", status -6;
    torch's own discussion: pytorch/pytorch#179291), and one aborted rank fails the whole launch. Nothing is left
    to flush by then: a run's files are written and closed inside it, the run folder's flock goes with the process.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        os._exit(status)
    sys.exit(status)
