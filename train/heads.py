"""Train a Medusa / EAGLE-1 / EAGLE-3 head on a frozen target (Medusa-2: LoRA target): accelerate entry, thin.

    accelerate launch train/heads.py --config recipes/heads-smollm2-135m-eagle3.yaml [key.sub=value ...] [--resume]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train/heads.py --config recipes/heads-llama3.1-8b-eagle3.yaml

Plain `python train/heads.py ...` also works (one process). The head kind is a recipe field (head.kind); the
library is draftsmith.heads.recipe. Output: run.yaml, metrics.jsonl, checkpoints/step-*/, final/ (config.json +
model.safetensors in engine-native names + head_accuracy.json), usable as `draftsmith eval --drafter eagle:DIR/final`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError
from draftsmith.heads.recipe import HeadsConfig, run_heads
from draftsmith.trainer import make_accelerator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="recipe YAML (recipes/heads-*.yaml); omitted = defaults")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in output_dir"
    )
    parser.add_argument("--overwrite", action="store_true", help="delete a previous run in output_dir first")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10 head.kind=medusa"
    )
    args = parser.parse_intermixed_args(argv)  # flags and key=value overrides in any order
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(HeadsConfig, args.config, args.overrides)
        accelerator = make_accelerator(cfg.train)
        summary = run_heads(
            cfg, accelerator, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress
        )
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if accelerator.is_main_process:
        ev = summary["eval"]
        tau = ev.get("tau_sim", ev.get("tau_tree"))
        print(
            f"done: step {summary['step']}, held-out simulated tau {tau if tau is not None else float('nan'):.2f} "
            f"(bonus included), cache {summary['cache_bytes_per_token']} B/token -> {summary['final_dir']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
