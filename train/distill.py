"""Distil a draft model from a target (DistillSpec): entry point (accelerate or Lightning), thin on purpose.

    accelerate launch train/distill.py --config recipes/smollm2-135m-quickstart.yaml [key.sub=value ...] [--resume]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train/distill.py --config recipes/llama3.1-8b-to-3.2-1b.yaml
    python train/distill.py --config recipes/smollm2-135m-quickstart.yaml --engine lightning [--devices 2]

Plain `python train/distill.py ...` also works (one process). Everything lives in draftsmith.distill.recipe;
the output folder holds run.yaml, metrics.jsonl, checkpoints/step-*/ and final/ (an HF causal LM folder).
Arguments, logging (-v) and exit status: draftsmith.launch; the main function: draftsmith.app.train.distill_main.
"""

from __future__ import annotations

from draftsmith.app.train import distill_main as main
from draftsmith.launch import exit_process

if __name__ == "__main__":
    exit_process(main())
