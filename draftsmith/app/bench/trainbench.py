"""Training throughput, measured through draftsmith's own training loop (draftsmith.trainer.run) on real shapes.

    draftsmith bench train --out runs/train.json                                 # CUDA: 8B-shaped target
    draftsmith bench train --shape tiny-target --device cpu --out runs/t.json   # seconds, CPU

Two measurements, each a few optimizer steps of the real trainer (bf16 autocast on CUDA, fused AdamW, gradient
clipping, the library's loss), random weights of the published shapes, synthetic token ids:
- `eagle3`: an EAGLE-3 head (heads.training.HeadTrainer) on the target with ONLINE hidden states (the target runs
  inside every step, as `data.hidden_states=online`), training-time-test unroll of 7 (EAGLE-3's default);
- `distill`: a DistillSpec step (distill.recipe.make_loss_fn, forward KL, fixed data) of a 1B-shaped draft
  (fp32 master weights, as the distill recipe keeps them) against the target's logits on the response tokens.
tokens/s = sequence tokens per step (batch x length) / median step time after the first step (which allocates);
peak memory = torch.cuda.max_memory_allocated over the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftsmith.app.costbench import write_result
from draftsmith.app.shapes import DRAFT_FOR, n_params, random_causal_lm
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir
from draftsmith.trainer import TrainArgs, make_accelerator
from draftsmith.trainer import run as train_loop

# What the two best-known EAGLE-3 trainers publish about speed for ~8B targets (read 2026-12-01). Neither
# publishes a single-GPU tokens/s for Llama-3.1-8B; these are the closest published numbers, quoted as given.
PUBLISHED = [
    {
        "source": "vLLM speculators, 'Train Eagle-3 Model Online' tutorial",
        "url": "https://docs.vllm.ai/projects/speculators/en/stable/user_guide/tutorials/train_eagle3_online/",
        "says": "Qwen3-8B target, 5,000 ShareGPT samples, --seq-length 8192: '~17 mins on 4x H100 GPUs (2 for vLLM, "
        "2 for training)' for the whole tutorial (hidden states served by vLLM, not online in the trainer)",
    },
    {
        "source": "SpecForge paper (arXiv 2603.18567)",
        "url": "https://arxiv.org/abs/2603.18567",
        "says": "'up to 9.9x faster EAGLE-3 training for Qwen3-235B-A22B' (relative, multi-GPU); no single-GPU "
        "tokens/s for an 8B target found",
    },
]


@dataclass
class TrainBenchArgs:
    shape: str = "llama-3.1-8b"
    device: str = "cuda"
    steps: int = 6
    """Optimizer steps per measurement (the first is excluded from the median)."""
    eagle_batch: int = 2
    eagle_length: int = 2048
    ttt_steps: int = 7
    distill_batch: int = 4
    distill_length: int = 1024
    which: tuple[str, ...] = ("eagle3", "distill")


def _median_step_s(out_dir: Path) -> tuple[float, list[float]]:
    events = [
        json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    steps = [e["elapsed_s"] for e in events if e.get("event") == "train"]
    if len(steps) < 2:
        raise DraftsmithError(f"trainbench needs >= 2 logged steps, got {len(steps)}; raise --steps")
    return statistics.median(steps[1:]), steps


def _synthetic(vocab: int, batch: int, length: int, n_batches: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch * n_batches)]


def bench_eagle3(target, a: TrainBenchArgs, accelerator, out_dir: Path) -> dict:
    from draftsmith.heads.data import collate
    from draftsmith.heads.eagle.model import EagleHead, default_aux_layers
    from draftsmith.heads.hidden import HiddenStates
    from draftsmith.heads.recipe import LossSection
    from draftsmith.heads.training import HeadTrainer

    cfg = target.config
    aux = default_aux_layers(cfg.num_hidden_layers)
    with torch.device(accelerator.device):  # fp32 head (the optimizer's master weights), autocast to bf16
        head = EagleHead.from_target(
            target, "eagle3", draft_vocab_ids=torch.arange(min(32000, cfg.vocab_size)), aux_layers=aux
        ).float()
    module = HeadTrainer(
        head, target, HiddenStates("online", target, aux), LossSection(ttt_steps=a.ttt_steps)
    )
    half = a.eagle_length // 2  # loss on the second half: a response after its prompt
    seqs = _synthetic(cfg.vocab_size, a.eagle_batch, a.eagle_length, a.steps)
    rows = [
        {"input_ids": s, "loss_mask": [0] * half + [1] * (len(s) - half), "index": i}
        for i, s in enumerate(seqs)
    ]
    batches = [collate(rows[i : i + a.eagle_batch]) for i in range(0, len(rows), a.eagle_batch)]
    res = _timed(module, lambda m, b: m(b), batches, a, accelerator, out_dir)
    res.update(
        head_params=n_params(head),
        batch=a.eagle_batch,
        length=a.eagle_length,
        ttt_steps=a.ttt_steps,
        hidden_states="online",
        draft_vocab=int(head.config.draft_vocab_size),
    )
    return res


def bench_distill(target, a: TrainBenchArgs, accelerator, out_dir: Path) -> dict:
    from draftsmith.distill.policies import DataPolicy
    from draftsmith.distill.recipe import DraftLM, LossArgs, make_loss_fn
    from draftsmith.examples import Example

    cfg = target.config
    draft = random_causal_lm(DRAFT_FOR[a.shape], accelerator.device, torch.float32, seed=1).train()
    draft.requires_grad_(True)
    half = a.distill_length // 2
    seqs = _synthetic(cfg.vocab_size, a.distill_batch, a.distill_length, a.steps, seed=1)
    examples = [Example(s[:half], s[half:]) for s in seqs]
    policy = DataPolicy(
        "fixed", examples, a.distill_batch, pad_id=2, eos_ids=[2], max_length=a.distill_length, seed=0
    )
    res = _timed(
        DraftLM(draft, None),
        make_loss_fn(target, policy, LossArgs(kind="fkl"))[0],
        policy,
        a,
        accelerator,
        out_dir,
    )
    res.update(draft_params=n_params(draft), batch=a.distill_batch, length=a.distill_length, loss="fkl")
    return res


def _timed(module, loss_fn, batches, a: TrainBenchArgs, accelerator, out_dir: Path) -> dict:
    args = TrainArgs(max_steps=a.steps, batch_size=1, log_every=1, eval_before_training=False, lr=1e-4)
    cuda = accelerator.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    # final/ gets nothing: a benchmark keeps no weights (the folder is temporary)
    train_loop(
        accelerator,
        module,
        loss_fn,
        batches,
        args,
        out_dir,
        save_fn=lambda m, d: Path(d).mkdir(),
        progress=False,
    )
    wall = time.perf_counter() - t0
    step_s, steps = _median_step_s(out_dir)
    return {
        "step_s": step_s,
        "step_s_all": steps,
        "wall_s": wall,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def run(a: TrainBenchArgs, progress=print) -> dict:
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(
            "--device cuda but CUDA is not available; pass --device cpu (with a tiny shape)"
        )
    if a.shape not in DRAFT_FOR:
        raise DraftsmithError(f"unknown target shape {a.shape!r}; use one of {', '.join(DRAFT_FOR)}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    accelerator = make_accelerator(
        TrainArgs(mixed_precision="bf16" if device.type == "cuda" else "no"), cpu=device.type == "cpu"
    )
    target = random_causal_lm(a.shape, accelerator.device, dtype)
    out = {
        "args": asdict(a),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "target": {"shape": a.shape, "params": n_params(target), "dtype": str(dtype).replace("torch.", "")},
        "published": PUBLISHED,
    }
    benches = {"eagle3": bench_eagle3, "distill": bench_distill}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.which:
            res = benches[name](target, a, accelerator, Path(tmp) / name)
            res["tokens_per_s"] = res["batch"] * res["length"] / res["step_s"]
            out[name] = res
            mem = f", peak {res['peak_mem_gib']:.1f} GiB" if res["peak_mem_gib"] is not None else ""
            progress(f"{name}: {res['tokens_per_s']:.0f} tokens/s ({res['step_s'] * 1e3:.0f} ms/step){mem}")
    return out


def markdown(res: dict) -> str:
    lines = [
        f"Target `{res['target']['shape']}` ({res['target']['params'] / 1e9:.2f}B params, random weights, "
        f"{res['target']['dtype']}) on {res['device']}, torch {res['torch']}; draftsmith.trainer.run, "
        "median step after the first.",
        "",
        "| run | batch x length | tokens/s | ms/step | peak GiB |",
        "|---|---|---|---|---|",
    ]
    for name in ("eagle3", "distill"):
        if name in res:
            r = res[name]
            mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
            what = (
                f"EAGLE-3 head, online hidden states, TTT {r['ttt_steps']}"
                if name == "eagle3"
                else f"distill 1B-shaped draft ({r['loss']})"
            )
            lines.append(
                f"| {what} | {r['batch']} x {r['length']} | {r['tokens_per_s']:.0f} | {r['step_s'] * 1e3:.0f} | {mem} |"
            )
    lines += ["", "Published beside it (as quoted; not the same measurement):", ""]
    lines += [f"- {p['source']} ({p['url']}): {p['says']}" for p in res["published"]]
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default=TrainBenchArgs.shape, choices=sorted(DRAFT_FOR))
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=TrainBenchArgs.steps)
    ap.add_argument("--eagle-length", type=int, default=TrainBenchArgs.eagle_length)
    ap.add_argument("--distill-length", type=int, default=TrainBenchArgs.distill_length)


def command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        if out.exists():
            raise DraftsmithError(f"{out} exists; pass a new --out path (results are never overwritten)")
        check_output_dir(out.parent)  # its folder can be written: checked before the benchmark runs
        if args.steps < 2:
            raise DraftsmithError("--steps must be >= 2 (the first step is excluded from the median)")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        res = run(
            TrainBenchArgs(
                shape=args.shape,
                device=device,
                steps=args.steps,
                eagle_length=args.eagle_length,
                distill_length=args.distill_length,
            )
        )
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_result(out, res, markdown(res))
    return 0
