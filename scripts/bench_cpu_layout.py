"""The CPU weight layout (draftsmith.cpulayout) against nn.Linear's own, ONE process, both copies of the target.

    python scripts/bench_cpu_layout.py [--target smollm2-135m] [--context 300] [--reps 9] [--out runs/cpu_layout]
                                       [--max-extra-gib G]

Loads the target twice (one copy re-laid out by cpulayout.tune_linears, one untouched) and, interleaving the two,
times a forward of n = 1..16 new tokens after a `--context`-token KV cache (median of --reps), then plain greedy
decoding of 48 tokens. Prints ms per forward and the ratio untouched/tuned per n, the verify cost in plain steps
(forward(n) / forward(1)) for both, and writes --out/layout.json and layout.png. With two copies loaded, the tuner's
default room for copies in the other layout (a quarter of the memory available) is smaller than when one target is
loaded; --max-extra-gib sets it as a decode would have it.
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
    ids = torch.randint(100, 40000, (1, n), generator=gen)
    t = time.perf_counter()
    model(ids, cache=cache, use_cache=True)
    dt = time.perf_counter() - t
    crop_to(cache, cache_len)
    return dt * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default="runs/cpu_layout")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument(
        "--max-extra-gib", type=float, default=None, help="room for layout copies (default: the tuner's)"
    )
    a = p.parse_args(argv)
    if a.max_extra_gib is not None and not a.max_extra_gib >= 0:
        p.error(f"--max-extra-gib {a.max_extra_gib} is not a size; pass 0 (no copies) or more GiB")
    from transformers import DynamicCache

    from draftsmith import models
    from draftsmith.cpulayout import describe, tune_linears
    from draftsmith.fileio import check_output_dir, write_json

    out = Path(a.out)
    check_output_dir(out, ("layout.json", "layout.png"), overwrite=a.overwrite)
    base = models.load_model(a.target)
    t0 = time.perf_counter()
    tuned = copy.deepcopy(base)
    summary = tune_linears(tuned, None if a.max_extra_gib is None else int(a.max_extra_gib * 2**30))
    tune_s = time.perf_counter() - t0
    print(f"{describe(summary)}, measured in {tune_s:.1f} s")
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 40000, (1, a.context), generator=gen)
    caches = {}
    with torch.inference_mode():
        for name, m in (("nn.Linear", base), ("tuned", tuned)):
            caches[name] = DynamicCache(config=m.config)
            m(ctx, cache=caches[name], use_cache=True)
        times = {name: {n: [] for n in NS} for name in caches}
        for _ in range(a.reps):
            for n in NS:
                for name, m in (("nn.Linear", base), ("tuned", tuned)):
                    times[name][n].append(forward_ms(m, a.context, n, caches[name], gen))
        med = {name: {n: statistics.median(v) for n, v in d.items()} for name, d in times.items()}
        decode = {}
        for name, m in (("nn.Linear", base), ("tuned", tuned)):
            prompt = ctx[:, :64]
            t = time.perf_counter()
            m.generate(prompt, max_new_tokens=48, do_sample=False, min_new_tokens=48, pad_token_id=0)
            decode[name] = 48 / (time.perf_counter() - t)
    print(f"{'n':>3} {'nn.Linear ms':>13} {'tuned ms':>9} {'ratio':>6} {'verify/step old':>16} {'new':>5}")
    for n in NS:
        o, t = med["nn.Linear"][n], med["tuned"][n]
        print(
            f"{n:>3} {o:13.1f} {t:9.1f} {o / t:6.2f}x {o / med['nn.Linear'][1]:16.2f} {t / med['tuned'][1]:5.2f}"
        )
    print(
        f"plain greedy decoding (HF generate, 48 tokens): nn.Linear {decode['nn.Linear']:.1f} tok/s, tuned "
        f"{decode['tuned']:.1f} tok/s ({decode['tuned'] / decode['nn.Linear']:.2f}x)"
    )
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / "layout.json",
        {
            "context": a.context,
            "reps": a.reps,
            "forward_ms": med,
            "decode_tok_s": decode,
            "tune": summary,
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


if __name__ == "__main__":
    raise SystemExit(main())
