"""`draftsmith quickstart`: the whole loop on the embedded target, on a CPU, within a time budget.

    draftsmith quickstart [--out runs/quickstart] [--budget-min 15] [--fast] [--overwrite]

0. the target loads, and the first seconds measure what each phase costs on this machine (a batched generation
   step, scoring with the target, a training step of the draft, batch-1 decode and verify forwards:
   draftsmith.app.calibrate); the planner (draftsmith.app.plan) scales the data and steps so the predicted time
   fits --budget-min, and the plan (sizes, predicted minutes per phase) is printed before any of it is spent;
1. the target (SmolLM2-135M-Instruct, embedded) answers builtin:train prompts -> OUT/data/train (token ids);
   it also answers a few builtin:dev-eval prompts -> OUT/data/dev-eval: reference answers used only to *measure*
   the draft (never trained on). If generation ran slower than predicted, text pairs and steps shrink to fit;
2. a draft is cut from the target (a few of its layers, `distill.init.shrink`) with a reduced output vocabulary
   (the 49152 x 576 output head would otherwise dominate a small draft's cost) and distilled (forward KL on the
   target's top-64 logits) on the generated answers plus `builtin:train-text` pairs the target scores (fixed text:
   no generation needed, and the draft over-fits the generated answers alone) -> OUT/distill (run.yaml,
   metrics.jsonl, final/ = an HF causal LM folder);
3. predicted acceptance before/after on the dev-eval answers (teacher-forced; greedy alpha = top-1 agreement;
   tau(k=4) = the text's tokens over the expected rounds that decode it, from the acceptance along the text (exact
   for greedy decoding on the target's own text), the i.i.d. formula shown beside it; bonus token included), for
   the sizes the plan chose;
4. the speculative decoder measures the draft on dev-eval prompts: tau, lossless check and wall-clock speedup
   over plain decoding in the same run -> OUT/eval (eval.json, report.md, eval.png); below 1x it says why, from
   the costs measured in that run (decode.speed).

The recipe `recipes/smollm2-135m-quickstart.yaml` holds the full-size distillation settings for `train/distill.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.app.plan import (
    FAST,
    FULL,
    GEN_BATCH,
    MAX_LENGTH,
    MAX_PROMPT_TOKENS,
    Plan,
    QuickstartSizes,
    check_budget,
    costs_line,
    dev_eval_prompts,
    dev_eval_sets,
    heldout_size,
    plan_quickstart,
    plan_record,
    predict,
    time_table,
)
from draftsmith.fileio import check_output_dir, write_json

__all__ = ["FAST", "FULL", "QuickstartSizes", "distill_config", "quickstart"]

# The decoder eval stops a step's draft at the first token the draft gives less than this probability: on a CPU
# the verify forward grows with every drafted token, so likely-rejected tokens cost more than they bring.
EVAL_STOP_BELOW = 0.5
# what a run leaves in OUT that a rerun would replace (OUT/data is resumable and reused)
RESULTS = ("quickstart.json", "distill", "eval")


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
                "max_length": MAX_LENGTH,
                "eval_size": heldout_size(sizes),
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


def _plan(model, tok, base: QuickstartSizes, fixed: bool, sets, budget_s: float, t_start: float, evals: bool):
    """Measure this machine and plan (fixed: `base` as given, only predicted). -> (plan, costs, shape)."""
    from draftsmith.app.calibrate import data_shape, measure_costs, train_width
    from draftsmith.trainer import resolve_mixed_precision

    shape, text_load_s = data_shape(tok, base, *sets)
    bf16 = resolve_mixed_precision("auto") == "bf16"
    costs = measure_costs(model, tok, base, train_width(shape, base), bf16, text_load_s)
    elapsed = time.perf_counter() - t_start
    if not fixed:
        return plan_quickstart(costs, shape, budget_s, elapsed, decoder_eval=evals), costs, shape
    phases = predict(costs, shape, base, decoder_eval=evals)
    over = elapsed + sum(phases.values()) > budget_s
    return Plan(base, phases, budget_s, elapsed, None, "over the budget" if over else ""), costs, shape


@dataclass
class _Run:
    """What the quickstart's steps share: the loaded target and tokenizer, where it writes, timings."""

    target: str
    out: Path
    model: Any
    tok: Any
    sets: tuple
    progress: bool
    t_start: float
    overwrite: bool  # --overwrite: the steps may replace earlier results (checked and said at the start)
    timings: dict[str, float] = field(default_factory=dict)


def quickstart(
    out: str | Path = "runs/quickstart",
    *,
    fast: bool = False,
    target: str = "smollm2-135m",
    sizes: QuickstartSizes | None = None,
    run_decoder_eval: bool = True,
    progress: bool = True,
    budget_min: float | str = 15.0,
    overwrite: bool = False,
) -> dict:
    """Measure, plan within `budget_min` minutes, run the four steps above; returns (and writes to
    OUT/quickstart.json) the plan, the before/after numbers and predicted vs measured time per phase.
    `sizes` (or `fast`) fixes the sizes instead of planning them (the plan is still predicted and printed).
    Earlier results in OUT (RESULTS) are refused unless `overwrite`; generated data is reused (resumable)."""
    from draftsmith.app.calibrate import replan

    budget_s = 60 * check_budget(budget_min)  # before anything loads
    out = Path(out).expanduser()
    _check_out(out, overwrite, run_decoder_eval)
    fixed = sizes or (FAST if fast else None)
    c_start = time.process_time()
    run = _load_target(target, out, fixed or FULL, progress, overwrite)
    first_plan, costs, shape = _measure_and_plan(
        run, fixed or FULL, fixed is not None, budget_s, run_decoder_eval
    )
    _generate_data(run, first_plan.sizes)
    plan = first_plan
    if fixed is None:
        elapsed = time.perf_counter() - run.t_start
        plan = replan(
            plan, costs, shape, run.timings["generate_s"], budget_s, elapsed, run_decoder_eval, run.model
        )
    summary, before, after, tok_s = _distill(run, plan.sizes)
    result = _predicted(run, plan.sizes, summary, before, after, tok_s)
    result.update(costs=asdict(costs), plan=plan_record(first_plan))
    result["replan"] = plan_record(plan) if plan is not first_plan else None
    if run_decoder_eval:
        result.update(_decoder_eval(run, plan.sizes, summary["final_dir"], costs))
    timings = run.timings
    timings["total_s"] = time.perf_counter() - run.t_start
    timings["total_cpu_s"] = time.process_time() - c_start
    result["timings"] = timings
    write_json(run.out / "quickstart.json", result, default=str)
    for line in time_table(first_plan, plan, timings):
        print(f"      {line}")
    print(
        f"done in {timings['total_s'] / 60:.1f} min; draft: {summary['final_dir']}  summary: "
        f"{run.out / 'quickstart.json'}"
    )
    return result


def _check_out(out: Path, overwrite: bool, evals: bool) -> None:
    """The output folder is writable, and earlier results are replaced only when asked (and then named)."""
    check_output_dir(out, RESULTS, overwrite)
    replaced = [name for name in RESULTS if evals or name != "eval"]
    held = [f"{name}/" if (out / name).is_dir() else name for name in replaced if (out / name).exists()]
    if held:
        print(f"--overwrite: replacing the earlier {', '.join(held)} in {out} (generated data is reused)")


def _load_target(target: str, out: Path, base: QuickstartSizes, progress: bool, overwrite: bool) -> _Run:
    """The target and tokenizer, and the dev-eval prompt sets that fit its context beside the answers."""
    from draftsmith import models

    t_start = time.perf_counter()
    tok = models.load_tokenizer(target)
    model = models.load_model(target, device=models.default_device(), inference=True)
    # prompts must leave room for the answer (and the decoder's k+1 lookahead) in the target's context
    room = model.config.max_position_embeddings - max(base.max_new_tokens, base.eval_max_new_tokens) - 8
    return _Run(target, out, model, tok, dev_eval_sets(tok, room), progress, t_start, overwrite)


def _measure_and_plan(run: _Run, base: QuickstartSizes, fixed: bool, budget_s: float, evals: bool):
    """Step 0: measure this machine, plan, print the plan. -> (plan, costs, shape)."""
    device = next(run.model.parameters()).device
    dtype = str(next(run.model.parameters()).dtype).replace("torch.", "")
    t = time.perf_counter()
    print(
        f"[0/4] {run.target} ({device}, {dtype}): measuring this machine, planning for {budget_s / 60:g} min"
    )
    plan, costs, shape = _plan(run.model, run.tok, base, fixed, run.sets, budget_s, run.t_start, evals)
    run.timings["load_and_measure_s"] = time.perf_counter() - run.t_start
    print(f"      {costs_line(costs, time.perf_counter() - t)}")
    for line in plan.lines():
        print(f"      {line}")
    return plan, costs, shape


def _generate_data(run: _Run, sizes: QuickstartSizes) -> None:
    """Step 1: the target answers builtin:train prompts (training data) and dev-eval prompts (references)."""
    from draftsmith.selfdistill import generate_dataset

    t, c = time.perf_counter(), time.process_time()
    print(
        f"[1/4] the target answers {sizes.train_prompts} builtin:train prompts "
        f"(+{sizes.dev_prompts} dev-eval references)"
    )
    gen_kw = {
        "max_new_tokens": sizes.max_new_tokens,
        "batch_size": GEN_BATCH,
        "model": run.model,
        "tokenizer": run.tok,
        "progress": run.progress,
        "skip_long": True,
        "max_prompt_tokens": MAX_PROMPT_TOKENS,  # long prompts cost padding and prefill time
    }
    data = run.out / "data"
    generate_dataset(run.target, "builtin:train", data / "train", limit=sizes.train_prompts, **gen_kw)
    dev = dev_eval_prompts(sizes.dev_prompts, sets=run.sets)
    generate_dataset(run.target, dev, data / "dev-eval", for_eval=True, **gen_kw)
    run.timings["generate_s"] = time.perf_counter() - t
    run.timings["generate_cpu_s"] = time.process_time() - c


def _distill(run: _Run, sizes: QuickstartSizes):
    """Step 2: cut the draft from the target and distil it. -> (summary, dev-eval before, after, train tokens/s)."""
    from draftsmith.distill.recipe import run_distill
    from draftsmith.examples import examples_from_generated
    from draftsmith.trainer import make_accelerator

    dev_examples = examples_from_generated(run.out / "data" / "dev-eval", for_eval=True)
    layers = [i for i in sizes.layers if i < run.model.config.num_hidden_layers] or [0]
    t, c = time.perf_counter(), time.process_time()
    cfg = distill_config(run.out, run.target, sizes, layers)
    print(
        f"[2/4] distilling a {len(layers)}-layer draft (target layers {layers}, {sizes.vocab_size}-token head), "
        f"{sizes.steps} steps on the generated answers + {sizes.text_examples} builtin:train-text pairs"
    )
    summary = run_distill(
        cfg,
        make_accelerator(cfg.train),
        overwrite=run.overwrite,
        progress=run.progress,
        target=run.model,
        tokenizer=run.tok,
        extra_eval={"dev-eval": dev_examples},
    )
    run.timings["distill_s"] = time.perf_counter() - t
    run.timings["distill_cpu_s"] = time.process_time() - c
    events = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    train_ev = [e for e in events if e["event"] == "train" and "tokens_per_s" in e]
    run.timings["train_s"] = sum(
        e["elapsed_s"] for e in train_ev
    )  # the training steps (and checkpoint saves)
    tok_s = sum(e["n_tokens"] for e in train_ev) / max(run.timings["train_s"], 1e-9)
    return summary, evals[0]["dev-eval"], evals[-1]["dev-eval"], tok_s


def _predicted(
    run: _Run, sizes: QuickstartSizes, summary: dict, before: dict, after: dict, tok_s: float
) -> dict:
    """Step 3: predicted acceptance before and after training, printed; the start of quickstart.json."""
    ratio = after["tau_greedy"]["4"] / before["tau_greedy"]["4"]
    ratio_iid = after["tau_greedy_iid"]["4"] / before["tau_greedy_iid"]["4"]
    print(
        "[3/4] predicted acceptance on dev-eval target answers (greedy, teacher-forced, tau includes the bonus token)"
    )
    for name, ev, r in (("before", before, None), ("after", after, ratio)):
        print(
            f"      {name + ':':7} top-1 alpha {ev['top1']:.3f}  tau(k=4) {ev['tau_greedy']['4']:.2f}"
            + (f" ({r:.2f}x)" if r else "")
            + f"  [i.i.d. formula: {ev['tau_greedy_iid']['4']:.2f}"
            + (f", {ratio_iid:.2f}x]" if r else "]")
        )
    print(
        f"      for the sizes planned: {sizes.train_prompts} prompts + {sizes.text_examples} text pairs, "
        f"{sizes.steps} steps; training {tok_s:.0f} tokens/s"
    )
    return {
        "target": run.target,
        "draft": summary["final_dir"],
        "init": summary["init"],
        "predicted": {"before": before, "after": after, "tau_k4_ratio": ratio, "tau_k4_ratio_iid": ratio_iid},
        "train_tokens_per_s": tok_s,
        "sizes": asdict(sizes),
        "dtype": str(next(run.model.parameters()).dtype).replace("torch.", ""),
    }


def _decoder_eval(run: _Run, sizes: QuickstartSizes, draft_dir: str, costs) -> dict:
    """Step 4: the decoder measures the draft against plain decoding; below 1x it says why."""
    from draftsmith.app.evaluate import evaluate
    from draftsmith.decode.speed import explain_result
    from draftsmith.evalsettings import EvalSettings

    t, c = time.perf_counter(), time.process_time()
    print(
        f"[4/4] speculative decoding vs plain decoding on {sizes.eval_prompts} dev-eval prompts "
        f"(k=4, greedy, a step's draft stops below {EVAL_STOP_BELOW} confidence)"
    )
    res = evaluate(
        run.target,
        f"draft:{draft_dir},stop_below={EVAL_STOP_BELOW}",
        dev_eval_prompts(sizes.eval_prompts, sets=run.sets),
        EvalSettings(k=4, max_new_tokens=sizes.eval_max_new_tokens),
        out_dir=run.out / "eval",
        overwrite=run.overwrite,
        target_model=run.model,
        tokenizer=run.tok,
        progress=run.progress,
    )
    run.timings["decoder_eval_s"] = time.perf_counter() - t
    run.timings["decoder_eval_cpu_s"] = time.process_time() - c
    measured = {
        key: res.get(key)
        for key in ("tau", "speedup", "tokens_per_s", "lossless", "alpha_per_position", "costs")
    }
    print(
        f"      measured tau {res['tau']:.2f} (bonus included), speedup {res['speedup']:.2f}x, "
        f"lossless {res['lossless']}; report: {run.out / 'eval' / 'report.md'}"
    )
    # verify costs for other draft lengths, as multiples of a step, from this run's own measurements
    ratios = {n: s / costs.forward_s[1] for n, s in costs.forward_s.items()}
    why = explain_result(res, verify_ratios=ratios)
    if why:
        print("      why slower than plain decoding (costs measured in this run):")
        for line in why:
            print(f"      - {line}")
    return {"measured": measured, "why_slower": why}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/quickstart", help="output folder (data, distill run, eval)")
    p.add_argument(
        "--budget-min",
        default="15",
        metavar="MIN",
        help="wall-clock minutes to fit in (default 15): the first seconds measure this machine and size the "
        "data, steps and eval to fit",
    )
    p.add_argument(
        "--fast", action="store_true", help="tiny sizes: a smoke test in ~1-2 minutes, numbers meaningless"
    )
    p.add_argument("--target", default="smollm2-135m", help=argparse.SUPPRESS)
    p.add_argument("--no-eval", action="store_true", help="skip the decoder speed/acceptance eval")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --out")


def run(args: argparse.Namespace) -> int:
    quickstart(
        args.out,
        fast=args.fast,
        target=args.target,
        run_decoder_eval=not args.no_eval,
        budget_min=args.budget_min,
        overwrite=args.overwrite,
    )
    return 0
