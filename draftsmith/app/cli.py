"""The `draftsmith` command. Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; only the invoked one is imported, so `draftsmith --help` stays fast.

    draftsmith quickstart                      # embedded target: generate data, distill, eval
    draftsmith generate --target ... --prompts ... --out DIR
    draftsmith eval --target T --drafter draft:DIR --prompts builtin:dev-eval
    draftsmith check --target T               # drafter kinds, export formats, engines for T (no weights loaded)
    draftsmith check --target T --draft D     # tokenizer compatibility, no weights loaded
    draftsmith export CKPT --format FORMAT --out DIR   # the formats of the checkpoint's kind
    draftsmith push CKPT REPO_ID [--private] [--dry-run DIR]
    draftsmith layerskip --target T --out DIR  # measured skip set: a layerskip:DIR drafter
    draftsmith vocab --target T --data DIR --out DIR   # reduced draft vocabulary: draft:D,vocab=DIR
    draftsmith curve RUN [--bench B.json --reference NAME] --out DIR   # data-scaling curve of a run's snapshots
    draftsmith bench SUBCOMMAND ...            # every measurement: draftsmith bench --help lists them
    draftsmith results [--check]              # RESULTS.md, docs/drafters.md, README tables from their sources
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from draftsmith.errors import DraftsmithError, OneLineArgumentParser
from draftsmith.launch import bound_heap

COMMANDS = {
    "quickstart": (
        "draftsmith.app.quickstart",
        "generate data with the embedded target, distill a draft, evaluate it",
    ),
    "generate": (
        "draftsmith.app.generate",
        "have a target answer prompts; write a resumable token-id dataset",
    ),
    "eval": ("draftsmith.app.eval", "measure a drafter: acceptance, tau, speedup over plain decoding"),
    "check": (
        "draftsmith.app.check",
        "which drafter kinds, export formats and engines support a target; with --draft, whether a draft's "
        "tokenizer matches it (no weights loaded)",
    ),
    "export": ("draftsmith.app.export", "export a checkpoint for transformers, vLLM or SGLang"),
    "bench": (
        "draftsmith.app.bench",
        "measurements: drafters, peers, llama.cpp, the cost model, the showcase, ... (draftsmith bench --help)",
    ),
    "push": ("draftsmith.app.push", "publish a checkpoint with a model card to the Hugging Face Hub"),
    "layerskip": (
        "draftsmith.app.layerskip",
        "pick the layers a target skips to draft for itself (measured here); write a layerskip: drafter",
    ),
    "vocab": (
        "draftsmith.app.vocab",
        "a reduced output vocabulary from training data, for draft:<model>,vocab=DIR (no weights loaded)",
    ),
    "curve": (
        "draftsmith.app.curve",
        "a drafter's data-scaling curve from a run's snapshots, beside a reference drafter (no model loads)",
    ),
    "results": (
        "draftsmith.app.results",
        "regenerate RESULTS.md, docs/drafters.md and README's tables from results/*.json and the drafter table",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="draftsmith", description="Train and measure speculative-decoding drafters."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if name == command:
            importlib.import_module(module).add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    try:
        args = parser.parse_args(argv)
    # --help (0) or a bad argument (2, its one line printed): returned as a status, as for every other error
    except SystemExit as e:
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    bound_heap()  # eval and bench decode prompts of every length: the heap would keep each one's peak
    try:
        from draftsmith import cpulayout  # here, not at the top: `draftsmith --help` does not need torch
        from draftsmith.deferred import defer_deepspeed
        from draftsmith.fileio import check_cache_dir

        cpulayout.enabled()  # the environment's switches are checked before any command loads or writes
        check_cache_dir()
        defer_deepspeed()  # no command imports DeepSpeed unless it uses it (draftsmith.deferred)
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
