"""Training-data generation through llama.cpp's server against `draftsmith generate`'s own engine (continuous
batching on the local bf16 copy, draftsmith.continuous), same target, prompts and settings, one process: answer
tokens/s of each, the ratio, and how many greedy answers differ (the Q4 GGUF runs on llama.cpp's quantized kernels,
the local copy on dequantized weights, so greedy answers part at near-ties; where they part is printed).

    draftsmith bench generate --target qwen2.5-coder-1.5b --limit 32 --max-new-tokens 128 --out runs/bench-gen

Needs `WITH_LLAMACPP=1 bash scripts/setup.sh`. Prompts: builtin:train (training prompts, never an evaluation set).
Writes OUT/local and OUT/server (two generate folders) and OUT/bench_generate.json.
"""

from __future__ import annotations

import argparse
import json
import time

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir, write_json
from draftsmith.llamacpp import binary, build_info
from draftsmith.models import cpu_has_fast_bf16
from draftsmith.selfdistill import generate_dataset, load_generated


def _timed(**kw) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = generate_dataset(**kw)
    seconds = time.perf_counter() - t0
    return seconds, {r["id"]: r for r in load_generated(out)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", default="builtin:train")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64, help="sequences the local engine decodes together")
    ap.add_argument("--parallel", type=int, default=4, help="requests in flight to llama-server")
    ap.add_argument("--out", required=True)


def command(args: argparse.Namespace) -> int:
    # checked before the server phase spends minutes (the local phase would refuse them only after it)
    for name in ("limit", "max_new_tokens", "batch_size", "parallel"):
        if getattr(args, name) < 1:
            raise DraftsmithError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = check_output_dir(args.out, results=("bench_generate.json",))
    binary("llama-server")  # before any minute is spent
    common = {"target": args.target, "prompts": args.prompts, "limit": args.limit,
              "max_new_tokens": args.max_new_tokens}  # fmt: skip
    t_server, server = _timed(out_dir=out / "server", server="auto", parallel=args.parallel, **common)
    t_local, local = _timed(out_dir=out / "local", batch_size=args.batch_size, **common)
    tokens = {name: sum(len(r["response_ids"]) for r in rows.values()) for name, rows in
              (("local", local), ("server", server))}  # fmt: skip
    differ = []
    for key, row in local.items():
        a, b = row["response_ids"], server[key]["response_ids"]
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            differ.append(
                {"id": key, "first_difference_at": first, "len_local": len(a), "len_server": len(b)}
            )
    result = {
        "target": args.target,
        "prompts": args.prompts,
        "n_prompts": len(local),
        "max_new_tokens": args.max_new_tokens,
        "cpu_native_bf16": cpu_has_fast_bf16(),
        "llama.cpp": build_info(),
        "local": {"seconds": t_local, "answer_tokens": tokens["local"], "tok_s": tokens["local"] / t_local,
                  "batch_size": args.batch_size},
        "server": {"seconds": t_server, "answer_tokens": tokens["server"], "tok_s": tokens["server"] / t_server,
                   "parallel": args.parallel},
        "answers_differing": len(differ),
        "differences": differ,
    }  # fmt: skip
    result["speedup"] = result["server"]["tok_s"] / result["local"]["tok_s"]
    write_json(out / "bench_generate.json", result)
    print(json.dumps({k: v for k, v in result.items() if k != "differences"}, indent=1))
    for d in differ:
        print(f"  {d['id']}: first difference at answer token {d['first_difference_at']}")
    return 0
