"""The CPU weight layout (draftsmith.cpulayout) against nn.Linear's own, ONE process, both copies of the target.

    draftsmith bench cpu-layout [--target smollm2-135m] [--context 300] [--reps 9] [--out runs/cpu_layout]
                                    [--max-extra-gib G] [--without KERNEL[,KERNEL]]...

Loads the target twice (one copy re-laid out by cpulayout.tune_linears, one untouched) and, interleaving the copies,
times a forward of n = 1..16 new tokens after a `--context`-token KV cache (median of --reps), then plain greedy
decoding of 48 tokens. Prints ms per forward and the ratio untouched/tuned per n, the verify cost in plain steps
(forward(n) / forward(1)) for each, and writes --out/layout.json and layout.png. With two copies loaded, the tuner's
default room for copies in another layout (a quarter of the memory available) is smaller than when one target is
loaded; --max-extra-gib sets it as a decode would have it. Each --without adds one more copy, tuned as it would be
if those kernels did not exist (same measurements: cpulayout.plan_without), so one run times what a kernel buys,
e.g. `--without packed` for oneDNN's blocked weight.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from draftsmith.decode.cache import crop_to

NS = (1, 2, 3, 4, 5, 6, 8, 11, 16)


def forward_ms(model, cache_len: int, n: int, cache, gen: torch.Generator) -> float:
    ids = torch.randint(100, min(40000, model.config.vocab_size), (1, n), generator=gen)
    t = time.perf_counter()
    model(ids, cache=cache, use_cache=True)
    dt = time.perf_counter() - t
    crop_to(cache, cache_len)
    return dt * 1e3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default="runs/cpu_layout")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument(
        "--max-extra-gib", type=float, default=None, help="room for layout copies (default: the tuner's)"
    )
    p.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="KERNEL[,KERNEL]",
        help="also time a copy tuned without these kernels (repeatable)",
    )


def command(a: argparse.Namespace) -> int:
    from draftsmith.errors import DraftsmithError

    if a.max_extra_gib is not None and not a.max_extra_gib >= 0:
        raise DraftsmithError(
            f"--max-extra-gib {a.max_extra_gib} is not a size; pass 0 (no copies) or more GiB"
        )
    from draftsmith.cpulayout import KERNELS, describe, tune_linears

    withouts = [frozenset(k.strip() for k in w.split(",") if k.strip()) for w in a.without]
    for w in withouts:
        if not w or not w <= set(KERNELS) - {"row"}:
            raise DraftsmithError(
                f"--without {','.join(sorted(w))!r}: name kernels of {', '.join(sorted(set(KERNELS) - {'row'}))}"
            )
    from transformers import DynamicCache

    from draftsmith import models
    from draftsmith.fileio import check_output_dir, write_json

    out = Path(a.out)
    check_output_dir(out, ("layout.json", "layout.png"), overwrite=a.overwrite)
    base = models.load_model(a.target)
    room = None if a.max_extra_gib is None else int(a.max_extra_gib * 2**30)
    variants, summaries = {"nn.Linear": base}, {}
    t0 = time.perf_counter()
    for w in [frozenset(), *withouts]:
        name = "tuned" if not w else f"tuned without {','.join(sorted(w))}"
        variants[name] = copy.deepcopy(base)
        summaries[name] = tune_linears(variants[name], room, without=w)
        print(f"{name}: {describe(summaries[name])}")
    tune_s = time.perf_counter() - t0
    print(f"measured in {tune_s:.1f} s")
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, min(40000, base.config.vocab_size), (1, a.context), generator=gen)
    caches = {}
    with torch.inference_mode():
        for name, m in variants.items():
            caches[name] = DynamicCache(config=m.config)
            m(ctx, cache=caches[name], use_cache=True)
        times = {name: {n: [] for n in NS} for name in caches}
        for _ in range(a.reps):  # interleaved: a drift of the machine's speed hits every variant alike
            for n in NS:
                for name, m in variants.items():
                    times[name][n].append(forward_ms(m, a.context, n, caches[name], gen))
        med = {name: {n: statistics.median(v) for n, v in d.items()} for name, d in times.items()}
        decode = {}
        for name, m in variants.items():
            prompt = ctx[:, :64]
            t = time.perf_counter()
            m.generate(prompt, max_new_tokens=48, do_sample=False, min_new_tokens=48, pad_token_id=0)
            decode[name] = 48 / (time.perf_counter() - t)
    names = list(variants)
    print(
        "ms per forward by new tokens n (the ratio: nn.Linear / that variant; verify/step: forward(n) / forward(1))"
    )
    print(f"{'n':>3} " + " ".join(f"{nm:>28}" for nm in names))
    for n in NS:
        cells = [
            f"{med[nm][n]:7.1f} ms {med['nn.Linear'][n] / med[nm][n]:5.2f}x {med[nm][n] / med[nm][1]:5.2f}"
            for nm in names
        ]
        print(f"{n:>3} " + " ".join(f"{c:>28}" for c in cells))
    print(
        "plain greedy decoding (HF generate, 48 tokens): "
        + ", ".join(f"{nm} {decode[nm]:.1f} tok/s ({decode[nm] / decode['nn.Linear']:.2f}x)" for nm in names)
    )
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / "layout.json",
        {
            "context": a.context,
            "reps": a.reps,
            "forward_ms": med,
            "decode_tok_s": decode,
            "tune": summaries,
            "tune_s": tune_s,
        },
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in med:
            ax.plot(list(NS), [med[name][n] for n in NS], marker="o", label=name)
        ax.set_xlabel(f"new tokens per forward (after a {a.context}-token cache)")
        ax.set_ylabel("ms per forward")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.set_title(f"{a.target}: weight layout, {next(base.parameters()).dtype}")
        fig.tight_layout()
        fig.savefig(out / "layout.png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")
    return 0
