"""`draftsmith layerskip`: pick the layers a target skips when it drafts for itself, by measured acceptance and
measured cost on THIS machine, and save a `layerskip:DIR` drafter folder (the search: draftsmith.heads.selfspec.search).

    draftsmith layerskip --target smollm2-135m --out runs/layerskip [--prompts builtin:train --limit 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="target: Hub id, folder, .gguf or smollm2-135m")
    p.add_argument("--out", required=True, help="drafter folder to write (refused if it exists)")
    p.add_argument("--prompts", default="builtin:train", help="calibration prompts (never an evaluation set)")
    p.add_argument("--limit", type=int, default=4, help="calibration prompts used")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens the target answers per prompt")
    p.add_argument(
        "--draft-vocab", type=int, default=8192, help="rows of the draft head (0 = full vocabulary)"
    )
    p.add_argument(
        "--vocab-source",
        default="builtin:train-text",
        help="text whose token counts pick the draft head rows",
    )
    p.add_argument("--max-k", type=int, default=6, help="largest draft length considered")
    p.add_argument("--finalists", type=int, default=3, help="skip sets decoded for real at the end")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")


def run(args: argparse.Namespace) -> int:
    from draftsmith import models
    from draftsmith.heads.selfspec.folders import save_layerskip
    from draftsmith.heads.selfspec.search import search
    from draftsmith.prompts import is_eval_source, load_prompts, prompt_ids

    if is_eval_source(args.prompts):
        raise DraftsmithError(
            f"{args.prompts} is an evaluation set; calibrate on builtin:train (or your own)"
        )
    for name in ("limit", "max_new_tokens", "max_k", "finalists"):
        if getattr(args, name) < 1:
            raise DraftsmithError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.draft_vocab < 0:
        raise DraftsmithError(f"--draft-vocab must be >= 0 (0 = full vocabulary), got {args.draft_vocab}")
    out = Path(args.out).expanduser()
    check_output_dir(out)  # before the calibration search; a file is never replaced by a folder
    if out.exists() and not args.overwrite:
        raise DraftsmithError(f"{out} exists; pass --overwrite to replace it or choose another --out")
    prompts = load_prompts(args.prompts, limit=args.limit)
    if not prompts:
        raise DraftsmithError(f"no prompts loaded from {args.prompts}")
    tok = models.load_tokenizer(args.target)
    target = models.load_model(args.target, dtype=args.dtype, device=args.device, inference=True)
    n = target.config.num_hidden_layers
    if n < 2:
        raise DraftsmithError(f"the target has {n} layer(s); layer skipping needs at least 2")
    vocab_ids = None
    if args.draft_vocab and args.draft_vocab < target.config.vocab_size:
        vocab_ids = _vocab(args.vocab_source, tok, target, args.draft_vocab)
    encoded = [torch.tensor([prompt_ids(tok, p)]) for p in prompts]
    res = search(target, tok, encoded, vocab_ids, max_new_tokens=args.max_new_tokens, max_k=args.max_k,
                 finalists=args.finalists)  # fmt: skip
    save_layerskip(out, target, res["skip_layers"], vocab_ids, res)
    best = res["measured"][0]
    skip = res["skip_layers"]
    if res["pays"]:
        print(f"skip {len(skip)}/{n} layers {skip}, k={best['k']}: measured {best['speedup']:.2f}x over plain "
              f"(tau {best['tau']:.2f}) on {len(prompts)} calibration prompts -> {out}")  # fmt: skip
    else:
        print(f"no skip set pays on this machine: the best one (skip {len(skip)}/{n} layers, k={best['k']}) "
              f"measured {best['speedup']:.2f}x, a slowdown (tau {best['tau']:.2f}); folder written with "
              f"pays=false -> {out}")  # fmt: skip
    return 0


def _vocab(source: str, tok, target, size: int) -> torch.Tensor:
    """The `size` most frequent target ids of a text source's responses (+ special tokens)."""
    from draftsmith.examples import examples_from_sources
    from draftsmith.vocab import build_vocab_ids, special_token_ids, token_counts

    (examples,) = examples_from_sources([source], tok, 2000)
    counts = token_counts((e.response_ids for e in examples), target.config.vocab_size)
    return build_vocab_ids(counts, size, always=special_token_ids(tok))
