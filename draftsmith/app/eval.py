"""`draftsmith eval`: measure a drafter (acceptance per position, tau with bonus, speedup over plain decoding).

draftsmith eval --target smollm2-135m --drafter draft:runs/distill/final --prompts builtin:dev-eval --limit 20 --out runs/eval
draftsmith eval --target smollm2-135m --drafter ngram:max=3,min=1 --prompts builtin:humaneval --limit 20
"""

from __future__ import annotations

import argparse

from draftsmith.models import DTYPE_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target: Hub id, folder, .gguf or smollm2-135m")
    p.add_argument(
        "--drafter",
        required=True,
        help="kind:arg, e.g. draft:DIR, ngram: or ngram:max=4,min=1, medusa:DIR, eagle:DIR",
    )
    p.add_argument(
        "--prompts",
        default="builtin:dev-eval",
        help="file, hf:dataset:split or builtin:{dev-eval,vicuna,humaneval}",
    )
    p.add_argument(
        "--k",
        default="4",
        help="draft tokens per step (tree depth for tree drafters); auto = each step's from 0 (a plain step) to "
        "6 by the acceptance measured on the prompt and the costs measured at the start (auto:N: at most N)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless check on)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write eval.json, report.md, eval.png here")
    p.add_argument("--overwrite", action="store_true", help="replace the results already in --out")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default=None,
        help=DTYPE_HELP,
    )
    p.add_argument(
        "--compile", action="store_true", help="CUDA: StaticCache + torch.compile of the target step"
    )
    p.add_argument(
        "--batch-size",
        default=None,
        metavar="B1,B2,..",
        help="also decode the prompts in batches of these sizes (e.g. 1,2,4,8,16): tau, tokens/s, speedup, verify "
        "cost and the best k per batch size, and the break-even batch size",
    )
    p.add_argument(
        "--sweep-k", action="store_true", help="with --batch-size: also measure every k from 1 to --k"
    )
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from draftsmith.decode.report import batch_table, summary_table
    from draftsmith.errors import DraftsmithError
    from draftsmith.evalsettings import EvalSettings, parse_batch_sizes, parse_k

    from .evaluate import evaluate

    if args.sweep_k and args.batch_size is None:
        raise DraftsmithError("--sweep-k measures draft lengths per batch size; pass --batch-size too")
    k, adaptive = parse_k(args.k)
    settings = EvalSettings(
        k=k,
        adaptive_k=adaptive,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        compile=args.compile,
        limit=args.limit,
        batch_sizes=parse_batch_sizes(args.batch_size) if args.batch_size is not None else (),
        sweep_k=args.sweep_k,
    )
    result = evaluate(
        args.target,
        args.drafter,
        args.prompts,
        settings,
        out_dir=args.out,
        overwrite=args.overwrite,
        device=args.device,
        dtype=args.dtype,
        progress=not args.no_progress,
    )
    tps = result["tokens_per_s"]
    print(summary_table(result))
    print(
        f"tau {result['tau']:.2f} (bonus token included) | speedup {result['speedup']:.2f}x "
        f"({tps['speculative']:.1f} vs {tps['plain']:.1f} tok/s, same run) | lossless: {result['lossless']}"
    )
    if "batch" in result:
        print(batch_table(result["batch"]))
    if args.out:
        print(f"wrote {args.out}/eval.json, report.md, eval.png")
    return 0 if result["lossless"] in (True, None) else 1
