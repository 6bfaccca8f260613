"""`draftsmith bench SUBCOMMAND`: every measurement the project runs, one module per subcommand.

    draftsmith bench drafters --target T --drafter NAME=SPEC@K ... --out DIR   # drafters against plain decoding
    draftsmith bench showcase OUT [--dry]       # every Qwen2.5-Coder-1.5B recipe trained and benched (resumable)
    draftsmith bench gpu-check OUT [--dry]      # the benchmark half of scripts/gpu_check.sh
    draftsmith bench --help                     # the whole list

Each subcommand module exposes `add_arguments(parser)` and `command(args) -> int` (not `run`: several of them are
libraries whose `run` is the measurement itself, called by other measurements and by tests). Only the invoked one is
imported, so `draftsmith bench --help` stays fast; bad input is one `error: ...` line and exit status 2, as for
every other command.
"""

from __future__ import annotations

import argparse
import importlib

from draftsmith.errors import OneLineArgumentParser

SUBCOMMANDS = {
    "drafters": (
        "draftsmith.app.bench.drafters",
        "drafters against plain decoding on one target in one process: tau, alpha, speedup, lossless, bench.json",
    ),
    "peers": (
        "draftsmith.app.bench.peers",
        "transformers' generate, assistant_model and prompt lookup beside draftsmith's decoding, interleaved",
    ),
    "cpu-layout": (
        "draftsmith.app.bench.cpu_layout",
        "the CPU weight layout (draftsmith.cpulayout) against nn.Linear's own: forward ms by new tokens, tokens/s",
    ),
    "block-cost": (
        "draftsmith.app.bench.block_cost",
        "draft cost per step of block drafters (DFlash, P-EAGLE) against the EAGLE-3 chain of the same depth",
    ),
    "dtype": (
        "draftsmith.app.bench.dtype",
        "fp32 against bf16 for a target on this machine: forward cost by new tokens, prefill, bf16 rounding",
    ),
    "engines": (
        "draftsmith.app.bench.engines",
        "training engines x trainers on 2 CPU processes (run, resume, match 1 process), tokens/s per engine",
    ),
    "generate": (
        "draftsmith.app.bench.generate",
        "llama.cpp's server against draftsmith generate's own engine on the same prompts: tokens/s, differing answers",
    ),
    "engine": (
        "draftsmith.app.bench.engine",
        "measure drafters inside llama.cpp beside draftsmith's decoder",
    ),
    "engine-loaders": (
        "draftsmith.app.bench.engine_loaders",
        "export tiny block drafters, or load them with speculators' own loader and compare (scripts/"
        "check_engine_loaders.sh runs both halves)",
    ),
    "cost": (
        "draftsmith.app.costbench",
        "the hardware cost model at real shapes: target forwards, drafter steps, predicted speedups",
    ),
    "cost-batch": (
        "draftsmith.app.bench.costbatch",
        "the cost model by batch size: predicted speedup at every batch size per acceptance profile",
    ),
    "train": (
        "draftsmith.app.bench.trainbench",
        "training throughput at real shapes: an EAGLE-3 head and a distillation step",
    ),
    "gpu-check": (
        "draftsmith.app.bench.gpu_check",
        "the cost model, the batch curve and training throughput in one report (scripts/gpu_check.sh)",
    ),
    "showcase": (
        "draftsmith.app.bench.showcase",
        "every Qwen2.5-Coder-1.5B recipe trained, then every drafter and transformers' peers benched (resumable)",
    ),
    "loss-ablation": (
        "draftsmith.app.bench.loss_ablation",
        "every loss x seed trained from one recipe, every checkpoint measured in one decoder run (resumable)",
    ),
    "predicted-vs-decoded": (
        "draftsmith.app.bench.predicted_vs_decoded",
        "a head's held-out predicted tau against the rounds the decoder takes on the same answers",
    ),
}


class _LazyParser(OneLineArgumentParser):
    """A subcommand's parser that imports its module and adds its arguments only when that subcommand is parsed."""

    def __init__(self, *args, module: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._module = module

    def parse_known_args(self, args=None, namespace=None):
        if self._module is not None:
            module, self._module = self._module, None
            importlib.import_module(module).add_arguments(self)
        return super().parse_known_args(args, namespace)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", parser_class=_LazyParser)
    for name, (module, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, description=help_, module=module)
    p.set_defaults(bench_parser=p)


def run(args: argparse.Namespace) -> int:
    if args.bench_command is None:
        args.bench_parser.print_help()
        return 2
    return int(importlib.import_module(SUBCOMMANDS[args.bench_command][0]).command(args) or 0)
