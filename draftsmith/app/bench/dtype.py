"""fp32 vs bf16 for the target on this machine: forward cost by number of new tokens (a plain step vs verifying a
draft), prefill throughput, and how far bf16 logits move between a one-token step and a multi-token forward
(the rounding `decode.evaluate.tie_tolerance` allows for). All ratios come from one run.

    draftsmith bench dtype [--target smollm2-135m] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith.models import cpu_has_fast_bf16, default_device, load_model


def forward_ms(model, n_new: int, ctx: int = 200, reps: int = 8) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, ctx))
    cache = model(ids, use_cache=True).cache
    x = torch.randint(0, model.config.vocab_size, (1, n_new))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        model(x, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t)
        cache.crop(-n_new)
    return 1000 * sorted(times)[len(times) // 2]


def rounding_ulps(model, trials: int = 3) -> float:
    """Largest |logit(one forward) - logit(one token at a time)| in units of eps x max |logit|."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(trials):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, 120), generator=g)
        full = model(ids).logits[0, 100:].float()
        cache = model(ids[:, :100], use_cache=True).cache
        steps = torch.stack(
            [
                model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1].float()
                for t in range(100, 120)
            ]
        )
        ulp = torch.finfo(next(model.parameters()).dtype).eps * full.abs().max(dim=-1).values
        worst = max(worst, float(((full - steps).abs().max(dim=-1).values / ulp).max()))
    return worst


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)


@torch.no_grad()
def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    dev = default_device()
    print(
        f"device {dev}, {args.threads} threads, CPU native bf16 (AMX or AVX512-BF16): {cpu_has_fast_bf16()}"
    )
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = load_model(args.target, dtype=dtype, device=dev).eval()
        ms = {n: forward_ms(m, n) for n in (1, 5, 11, 32)}
        x = torch.randint(0, m.config.vocab_size, (8, 256))
        t = time.perf_counter()
        m(x)
        prefill = 8 * 256 / (time.perf_counter() - t)
        rows[dtype] = (ms, prefill)
        name = str(dtype).replace("torch.", "")
        print(
            f"{name:9} forward ms by new tokens: "
            + "  ".join(f"{n}: {v:.1f} ({v / ms[1]:.2f}x)" for n, v in ms.items())
            + f" | prefill 8x256: {prefill:.0f} tok/s"
        )
        if dtype == torch.bfloat16:
            print(
                f"bf16 rounding: one-token vs multi-token logits differ by up to {rounding_ulps(m):.1f} ulp of the max logit"
            )
    (f32, p32), (b16, p16) = rows[torch.float32], rows[torch.bfloat16]
    print(
        f"bf16 / fp32 time: 1 token {b16[1] / f32[1]:.2f}x, 32 tokens {b16[32] / f32[32]:.2f}x, "
        f"prefill throughput {p16 / p32:.2f}x"
    )
    return 0
