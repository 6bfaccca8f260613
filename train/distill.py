"""Distil a draft model from a target (DistillSpec): accelerate entry point, thin on purpose.

    accelerate launch train/distill.py --config recipes/smollm2-135m-quickstart.yaml [key.sub=value ...] [--resume]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train/distill.py --config recipes/llama3.1-8b-to-3.2-1b.yaml

Plain `python train/distill.py ...` also works (one process). Everything lives in draftsmith.distill.recipe;
the output folder holds run.yaml, metrics.jsonl, checkpoints/step-*/ and final/ (an HF causal LM folder).
"""

from __future__ import annotations

import argparse
import logging
import sys

from draftsmith.config import load_config
from draftsmith.distill.recipe import DistillConfig, run_distill
from draftsmith.errors import DraftsmithError
from draftsmith.trainer import make_accelerator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="recipe YAML (recipes/*.yaml); omitted = defaults")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in output_dir"
    )
    parser.add_argument("--overwrite", action="store_true", help="delete a previous run in output_dir first")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10 loss.kind=jsd"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(DistillConfig, args.config, args.overrides)
        accelerator = make_accelerator(cfg.train)
        summary = run_distill(
            cfg, accelerator, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress
        )
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if accelerator.is_main_process:
        held = summary["eval"].get("heldout", {})
        k = cfg.eval.k
        print(
            f"done: step {summary['step']}, held-out alpha {held.get('alpha', float('nan')):.3f}, "
            f"top-1 {held.get('top1', float('nan')):.3f}, predicted tau(k={k}) {held.get(f'tau_k{k}') or float('nan'):.2f} "
            f"-> {summary['final_dir']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
