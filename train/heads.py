"""Train a head of any kind in draftsmith.heads.kinds on a frozen target (Medusa-2: LoRA target): entry script, thin.

    accelerate launch train/heads.py --config recipes/heads-smollm2-135m-eagle3.yaml [key.sub=value ...] [--resume]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train/heads.py --config recipes/heads-llama3.1-8b-eagle3.yaml
    python train/heads.py --config recipes/heads-smollm2-135m-eagle3.yaml --engine lightning [--devices 2]

Plain `python train/heads.py ...` also works (one process). The head kind is a recipe field (head.kind: medusa,
medusa2, eagle, eagle3, dflash, peagle, earlyexit); the library is draftsmith.heads.recipe. Output: run.yaml,
metrics.jsonl, checkpoints/step-*/, final/ (config.json + model.safetensors in engine-native names +
head_accuracy.json), usable as `draftsmith eval --drafter KIND:DIR/final` (Medusa-2: medusa:) and, where the kind has
engine formats, `draftsmith export`.
Arguments, logging (-v) and exit status: draftsmith.launch; the main function: draftsmith.app.train.heads_main.
"""

from __future__ import annotations

from draftsmith.app.train import heads_main as main
from draftsmith.launch import exit_process

if __name__ == "__main__":
    exit_process(main())
