"""`draftsmith vocab`: a reduced output vocabulary for a draft that was trained without one (FR-Spec's observation:
most of a small draft's lm_head rows are tokens it never needs to propose).

    draftsmith vocab --target qwen2.5-coder-1.5b --data runs/data/gen --size 32768 --out runs/vocab-32k
    draftsmith eval --target qwen2.5-coder-1.5b --drafter draft:qwen2.5-coder-0.5b,vocab=runs/vocab-32k

Counts the tokens of the training data (prompts and responses; evaluation sets are refused), keeps the `--size` most
frequent target ids plus every special token, and writes OUT/draft_vocab.safetensors (the file a reduced-vocab draft
carries, draftsmith.vocab) and OUT/vocab.json (size, sources, the data's token coverage). The draft then computes
logits over those rows only; verification is unchanged, so decoding stays lossless. No model weights are loaded.
"""

from __future__ import annotations

import argparse
import time

from draftsmith.errors import DraftsmithError

DEFAULT_SIZE = 32768
"""EAGLE-3's draft vocabulary size."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: Hub id, folder, .gguf or an embedded name")
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="training data: draftsmith generate folders, prompt+response .jsonl files or builtin:train-text",
    )
    p.add_argument(
        "--size",
        type=int,
        default=None,
        help=f"target ids kept (default {DEFAULT_SIZE}, or all of a smaller vocabulary)",
    )
    p.add_argument("--out", required=True, help="folder for draft_vocab.safetensors and vocab.json")
    p.add_argument("--overwrite", action="store_true", help="replace a vocabulary already in --out")
    p.add_argument("--trust-remote-code", action="store_true")


def run(args: argparse.Namespace) -> int:
    from draftsmith import models
    from draftsmith.compat import _vocab_size
    from draftsmith.examples import examples_from_sources
    from draftsmith.fileio import check_output_dir, write_json
    from draftsmith.vocab import (
        DRAFT_VOCAB_FILE,
        build_vocab_ids,
        coverage,
        save_draft_vocab,
        special_token_ids,
        token_counts,
    )

    # a file, a folder under a file, an unwritable folder, an earlier vocabulary: refused before counting tokens
    out = check_output_dir(args.out, (DRAFT_VOCAB_FILE, "vocab.json"), args.overwrite)
    ref = models.resolve(args.target)  # once: config and tokenizer both read from it
    cfg = models.load_config(ref, args.trust_remote_code)
    vocab = _vocab_size(cfg)
    size = min(DEFAULT_SIZE, vocab) if args.size is None else args.size
    if not 0 < size <= vocab:
        raise DraftsmithError(f"--size must be in [1, {vocab}] (the target's vocabulary), got {size}")
    tok = models.load_tokenizer(ref, args.trust_remote_code)
    examples = [e for source in examples_from_sources(args.data, tok) for e in source]
    counts = token_counts((e.prompt_ids + e.response_ids for e in examples), vocab)
    ids = build_vocab_ids(counts, size, always=special_token_ids(tok))
    covered = coverage(counts, ids)
    save_draft_vocab(out, ids)
    info = {
        "size": size,
        "target": args.target,
        "target_vocab_size": vocab,
        "data": list(args.data),
        "examples": len(examples),
        "tokens": int(counts.sum()),
        "distinct_tokens": int((counts > 0).sum()),
        "data_token_coverage": round(covered, 4),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_json(out / "vocab.json", info)
    print(
        f"{out / DRAFT_VOCAB_FILE}: {size} of {vocab} ids, {info['distinct_tokens']} distinct among "
        f"{info['tokens']} data tokens, coverage {covered:.4f}; use it as draft:<draft>,vocab={out}"
    )
    return 0
