"""`draftsmith quickstart`: the whole loop on the embedded target, on a CPU, in minutes.

    draftsmith quickstart [--out runs/quickstart] [--fast]

1. the target (SmolLM2-135M-Instruct, embedded) answers builtin:train prompts -> OUT/data/train (token ids);
   it also answers a few builtin:dev-eval prompts -> OUT/data/dev-eval: reference answers used only to *measure*
   the draft (never trained on);
2. a draft is cut from the target (a few of its layers, `distill.init.shrink`) with a reduced output vocabulary
   (the 49152 x 576 output head would otherwise dominate a small draft's cost) and distilled (forward KL on the
   target's top-64 logits) on the generated answers plus `builtin:train-text` pairs the target scores (fixed text:
   no generation needed, and the draft over-fits the generated answers alone) -> OUT/distill (run.yaml,
   metrics.jsonl, final/ = an HF causal LM folder);
3. predicted acceptance before/after on the dev-eval answers (teacher-forced; greedy alpha = top-1 agreement;
   tau(k=4) = 1 + sum_i prod_{j<i} a_{t+j} from the conditional acceptance along the text (exact per start position
   for greedy decoding on the target's own text), the i.i.d. formula shown beside it; bonus token included);
4. the speculative decoder measures the draft on dev-eval prompts: tau, lossless check and wall-clock speedup
   over plain decoding in the same run -> OUT/eval (eval.json, report.md, eval.png).

The recipe `recipes/smollm2-135m-quickstart.yaml` holds the same distillation settings for `train/distill.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith.fileio import write_json

# The decoder eval stops a step's draft at the first token the draft gives less than this probability: on a CPU
# the verify forward grows with every drafted token, so likely-rejected tokens cost more than they bring.
EVAL_STOP_BELOW = 0.5


@dataclass
class QuickstartSizes:
    train_prompts: int
    text_examples: int  # builtin:train-text prompt + response pairs the target scores (fixed data), 0 = none
    dev_prompts: int  # split evenly between vicuna and humaneval
    max_new_tokens: int
    steps: int
    batch_size: int
    lr: float
    layers: list[int]
    vocab_size: int
    eval_prompts: int  # decoder eval
    eval_max_new_tokens: int


FULL = QuickstartSizes(
    train_prompts=400,
    text_examples=2000,
    dev_prompts=24,
    max_new_tokens=80,
    steps=250,
    batch_size=8,
    lr=2e-3,
    layers=[0, 1, 2, 3],  # the first layers: keeping the last layer (30 -> 4) starts at 0% top-1 on SmolLM2
    vocab_size=8192,
    eval_prompts=6,
    eval_max_new_tokens=64,
)
FAST = QuickstartSizes(
    train_prompts=24,
    text_examples=16,
    dev_prompts=4,
    max_new_tokens=24,
    steps=8,
    batch_size=4,
    lr=1e-3,
    layers=[0, 1],
    vocab_size=2048,
    eval_prompts=2,
    eval_max_new_tokens=16,
)


def distill_config(out: Path, target: str, sizes: QuickstartSizes, layers: list[int] | None = None):
    """The quickstart's distillation recipe (mirrored by recipes/smollm2-135m-quickstart.yaml)."""
    from draftsmith.config import from_dict
    from draftsmith.distill.recipe import DistillConfig

    return from_dict(
        DistillConfig,
        {
            "model": {
                "target": target,
                "init": "shrink",
                "layers": layers or sizes.layers,
                "vocab_size": sizes.vocab_size,
            },
            "data": {
                "source": [str(out / "data" / "train")]
                + (["builtin:train-text"] if sizes.text_examples else []),
                "limit": [None] + ([sizes.text_examples] if sizes.text_examples else []),
                "policy": "target",
                "max_length": 512,
                "eval_size": max(1, min(16, sizes.train_prompts // 8)),
                "cache_target_topk": 64,
            },
            "loss": {"kind": "fkl", "temperature": 1.0},
            "train": {
                "max_steps": sizes.steps,
                "batch_size": sizes.batch_size,
                "lr": sizes.lr,
                "warmup_steps": max(sizes.steps // 20, 1),
                "schedule": "cosine",
                "log_every": max(sizes.steps // 20, 1),
                "eval_every": 0,
                "save_every": max(sizes.steps // 4, 1),
                "keep_checkpoints": 1,
                "mixed_precision": "auto",
            },
            "eval": {"temperature": 0.0, "k": 4},
            "output_dir": str(out / "distill"),
        },
    )


def dev_eval_prompts(n: int, tokenizer=None, max_length: int | None = None):
    """n dev-eval prompts, half Vicuna-80 and half HumanEval (evaluation only), skipping any that would not fit
    `max_length` tokens with the chat template applied."""
    from draftsmith.prompts import load_prompts, prompt_ids

    def fits(p) -> bool:
        return tokenizer is None or max_length is None or len(prompt_ids(tokenizer, p)) <= max_length

    vic = [p for p in load_prompts("builtin:vicuna") if fits(p)]
    he = [p for p in load_prompts("builtin:humaneval") if fits(p)]
    return vic[: (n + 1) // 2] + he[: n // 2]


def quickstart(
    out: str | Path = "runs/quickstart",
    *,
    fast: bool = False,
    target: str = "smollm2-135m",
    sizes: QuickstartSizes | None = None,
    run_decoder_eval: bool = True,
    progress: bool = True,
) -> dict:
    """Run the four steps above; returns (and writes to OUT/quickstart.json) the before/after numbers."""
    from draftsmith import models
    from draftsmith.distill.recipe import run_distill
    from draftsmith.examples import examples_from_generated
    from draftsmith.selfdistill import generate_dataset
    from draftsmith.trainer import make_accelerator

    sizes = sizes or (FAST if fast else FULL)
    out = Path(out)
    t_start, c_start = time.perf_counter(), time.process_time()
    timings: dict[str, float] = {}
    tok = models.load_tokenizer(target)
    device = models.default_device()
    model = models.load_model(target, device=device)
    n_layers = model.config.num_hidden_layers
    layers = [i for i in sizes.layers if i < n_layers] or [0]

    t, c = time.perf_counter(), time.process_time()
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    print(
        f"[1/4] {target} ({device}, {dtype}) answers {sizes.train_prompts} builtin:train prompts "
        f"(+{sizes.dev_prompts} dev-eval references)"
    )
    gen_kw = {
        "max_new_tokens": sizes.max_new_tokens,
        "batch_size": 32,
        "model": model,
        "tokenizer": tok,
        "progress": progress,
        "skip_long": True,
        "max_prompt_tokens": 160,  # drops ~7% of builtin:train; long prompts cost padding and prefill time
    }
    generate_dataset(target, "builtin:train", out / "data" / "train", limit=sizes.train_prompts, **gen_kw)
    # prompts must leave room for the answer (and the decoder's k+1 lookahead) in the target's context
    room = model.config.max_position_embeddings - max(sizes.max_new_tokens, sizes.eval_max_new_tokens) - 8
    dev = dev_eval_prompts(sizes.dev_prompts, tok, room)
    generate_dataset(target, dev, out / "data" / "dev-eval", for_eval=True, **gen_kw)
    timings["generate_s"], timings["generate_cpu_s"] = time.perf_counter() - t, time.process_time() - c
    dev_examples = examples_from_generated(out / "data" / "dev-eval", for_eval=True)

    t, c = time.perf_counter(), time.process_time()
    cfg = distill_config(out, target, sizes, layers)
    print(
        f"[2/4] distilling a {len(layers)}-layer draft (target layers {layers}, {sizes.vocab_size}-token head), "
        f"{sizes.steps} steps on the generated answers + {sizes.text_examples} builtin:train-text pairs"
    )
    accelerator = make_accelerator(cfg.train)
    summary = run_distill(
        cfg,
        accelerator,
        overwrite=True,
        progress=progress,
        target=model,
        tokenizer=tok,
        extra_eval={"dev-eval": dev_examples},
    )
    timings["distill_s"], timings["distill_cpu_s"] = time.perf_counter() - t, time.process_time() - c
    events = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    before, after = evals[0]["dev-eval"], evals[-1]["dev-eval"]
    train_ev = [e for e in events if e["event"] == "train" and "tokens_per_s" in e]
    tok_s = sum(e["n_tokens"] for e in train_ev) / max(sum(e["elapsed_s"] for e in train_ev), 1e-9)

    ratio = after["tau_greedy"]["4"] / before["tau_greedy"]["4"]
    print(
        "[3/4] predicted acceptance on dev-eval target answers (greedy, teacher-forced, tau includes the bonus token)"
    )
    ratio_iid = after["tau_greedy_iid"]["4"] / before["tau_greedy_iid"]["4"]
    for name, ev, r in (("before", before, None), ("after", after, ratio)):
        print(
            f"      {name + ':':7} top-1 alpha {ev['top1']:.3f}  tau(k=4) {ev['tau_greedy']['4']:.2f}"
            + (f" ({r:.2f}x)" if r else "")
            + f"  [i.i.d. formula: {ev['tau_greedy_iid']['4']:.2f}"
            + (f", {ratio_iid:.2f}x]" if r else "]")
        )
    print(f"      training: {tok_s:.0f} tokens/s, {timings['distill_s']:.0f} s")
    result = {
        "target": target,
        "draft": summary["final_dir"],
        "init": summary["init"],
        "predicted": {"before": before, "after": after, "tau_k4_ratio": ratio, "tau_k4_ratio_iid": ratio_iid},
        "train_tokens_per_s": tok_s,
        "sizes": sizes.__dict__,
    }
    if run_decoder_eval:
        from draftsmith.app.evaluate import evaluate

        t, c = time.perf_counter(), time.process_time()
        print(
            f"[4/4] speculative decoding vs plain decoding on {sizes.eval_prompts} dev-eval prompts "
            f"(k=4, greedy, a step's draft stops below {EVAL_STOP_BELOW} confidence)"
        )
        res = evaluate(
            target,
            f"draft:{summary['final_dir']},stop_below={EVAL_STOP_BELOW}",
            dev_eval_prompts(sizes.eval_prompts, tok, room),
            k=4,
            max_new_tokens=sizes.eval_max_new_tokens,
            out_dir=out / "eval",
            overwrite=True,  # the quickstart reruns into its own folder (its trainer overwrites too)
            target_model=model,
            tokenizer=tok,
            progress=progress,
        )
        timings["decoder_eval_s"] = time.perf_counter() - t
        timings["decoder_eval_cpu_s"] = time.process_time() - c
        result["measured"] = {
            key: res.get(key) for key in ("tau", "speedup", "tokens_per_s", "lossless", "alpha_per_position")
        }
        print(
            f"      measured tau {res['tau']:.2f} (bonus included), speedup {res['speedup']:.2f}x, "
            f"lossless {res['lossless']}; report: {out / 'eval' / 'report.md'}"
        )
    timings["total_s"], timings["total_cpu_s"] = time.perf_counter() - t_start, time.process_time() - c_start
    result["timings"] = timings
    write_json(out / "quickstart.json", result, default=str)
    print(
        f"done in {timings['total_s'] / 60:.1f} min; draft: {summary['final_dir']}  summary: {out / 'quickstart.json'}"
    )
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/quickstart", help="output folder (data, distill run, eval)")
    p.add_argument(
        "--fast", action="store_true", help="tiny sizes: a smoke test in ~1-2 minutes, numbers meaningless"
    )
    p.add_argument("--target", default="smollm2-135m", help=argparse.SUPPRESS)
    p.add_argument("--no-eval", action="store_true", help="skip the decoder speed/acceptance eval")


def run(args: argparse.Namespace) -> int:
    quickstart(args.out, fast=args.fast, target=args.target, run_decoder_eval=not args.no_eval)
    return 0
