"""`draftsmith generate`: have a target answer prompts; write a resumable token-id dataset
(draftsmith.selfdistill does the work), with the target loaded here or through a server:

    draftsmith generate --target qwen2.5-coder-1.5b --prompts builtin:train --out data/gen --server auto
    draftsmith generate --target Qwen/Qwen2.5-7B-Instruct --out data/gen --server http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json

from draftsmith.models import DTYPE_HELP
from draftsmith.sampling import SamplingParams
from draftsmith.selfdistill import MANIFEST, generate_dataset


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", default="smollm2-135m", help="target model: Hub id, folder, .gguf or smollm2-135m"
    )
    p.add_argument(
        "--prompts", default="builtin:train", help="prompt source (file, hf:name:split, builtin:train)"
    )
    p.add_argument("--out", required=True, help="output folder (rerun the same command to resume)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="sequences decoded together (continuous batching: a finished one is replaced by the next prompt)",
    )
    p.add_argument(
        "--shard-size", type=int, default=128, help="rows per shard (the unit a killed run can lose)"
    )
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="N prompts drawn at random (seeded by --seed) instead of the first --limit; a larger N later extends "
        "the same set",
    )
    p.add_argument(
        "--skip-long", action="store_true", help="skip prompts that do not fit the context instead of failing"
    )
    p.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="skip prompts longer than this (tokens)"
    )
    p.add_argument(
        "--server",
        default=None,
        metavar="URL|auto",
        help="answer through an OpenAI-compatible server (llama.cpp's llama-server, vLLM, SGLang) instead of "
        "loading the target here; 'auto' starts the pinned llama.cpp for a .gguf or embedded target "
        "(WITH_LLAMACPP=1 bash scripts/setup.sh builds it)",
    )
    p.add_argument(
        "--served-model", default=None, help="with --server URL: the server's id of the target's model"
    )
    p.add_argument(
        "--parallel", type=int, default=4, help="with --server: requests in flight (server slots for auto)"
    )
    p.add_argument(
        "--capture-layers",
        type=_layers,
        default=None,
        metavar="I,J,...",
        help="also keep the target's hidden states over each answer (inputs of these hidden_states layers + the "
        "final state, bf16, beside each shard): a heads run whose data.cache_layers they cover reads them instead "
        "of running the target again (EAGLE-3 on the 1.5B: 2,14,25)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument(
        "--dtype",
        default=None,
        help=DTYPE_HELP,
    )


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices") from None


def run(args: argparse.Namespace) -> int:
    out = generate_dataset(
        args.target,
        args.prompts,
        args.out,
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        limit=args.limit,
        sample=args.sample,
        skip_long=args.skip_long,
        max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        server=args.server,
        served_model=args.served_model,
        parallel=args.parallel,
        capture_layers=args.capture_layers,
    )
    man = json.loads((out / MANIFEST).read_text())
    print(f"{out}: {man['n_rows']} rows in {len(man['shards'])} shards")
    return 0
