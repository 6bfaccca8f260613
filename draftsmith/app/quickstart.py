"""`draftsmith quickstart`: the whole loop on the embedded target, on a CPU, within a time budget.

    draftsmith quickstart [--out runs/quickstart] [--budget-min 15] [--fast] [--overwrite]

0. the target loads, and the first seconds measure what each phase costs on this machine (a batched generation
   step, scoring with the target, a training step of each drafter, batch-1 decode and verify forwards:
   draftsmith.app.calibrate); the planner (draftsmith.app.plan) picks the drafters and scales their data and steps
   so the predicted time fits --budget-min, and the plan (drafters, sizes, predicted minutes per phase) is printed
   before any of it is spent. The EAGLE-3 head comes first (on the 135M its tree costs ~0.1 of a target step);
   the distilled draft is trained beside it where the budget leaves room (the plan says which budget does);
1. the target (SmolLM2-135M-Instruct, embedded) answers builtin:train prompts -> OUT/data/train (token ids);
   with a distilled draft planned it also answers a few builtin:dev-eval prompts -> OUT/data/dev-eval: reference
   answers used only to *measure* the draft (never trained on). If generation ran slower than predicted, text
   pairs and steps shrink to fit;
2. an EAGLE-3 head learns to draft from the target's hidden states (draftsmith.heads.recipe.run_heads: one
   decoder layer over three of the target's layers, soft cross-entropy against the target's distributions,
   unrolled 3 steps) on the generated answers plus `builtin:train-text` pairs (fixed text: the labels are still
   the target's own distributions) -> OUT/eagle3 (run.yaml, metrics.jsonl, final/ = a head folder);
   then, if planned, a draft is cut from the target (a few of its layers, `distill.init.shrink`) with a reduced
   output vocabulary (the 49152 x 576 output head would otherwise dominate a small draft's cost) and distilled
   (forward KL on the target's top-64 logits) on the same answers plus text pairs the target scores -> OUT/distill
   (an HF causal LM folder in final/);
3. predicted acceptance: the head's per-depth acceptance and tau on answers held out from its data; the distilled
   draft's before/after on the dev-eval answers (teacher-forced; greedy alpha = top-1 agreement; tau(k=4) = the
   text's tokens over the expected rounds that decode it, from the acceptance along the text (exact for greedy
   decoding on the target's own text), the i.i.d. formula shown beside it; bonus token included);
4. the speculative decoder measures each trained drafter on dev-eval prompts: tau, lossless check and wall-clock
   speedup over plain decoding in the same run -> OUT/eval/<drafter> (eval.json, report.md, eval.png); the best
   is reported; below 1x it says why, from the costs measured in that run (decode.speed).

`recipes/smollm2-135m-quickstart.yaml` holds the full-size distillation for `train/distill.py`, and
`recipes/heads-smollm2-135m-eagle3.yaml` a longer EAGLE-3 head for `train/heads.py`.
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
    head_draft,
    heldout_size,
    plan_quickstart,
    plan_record,
    predict,
    time_table,
)
from draftsmith.fileio import check_output_dir, write_json

__all__ = ["FAST", "FULL", "QuickstartSizes", "distill_config", "head_config", "quickstart"]

# The decoder eval stops a step's draft at the first token the draft gives less than this probability: on a CPU
# the verify forward grows with every drafted token, so likely-rejected tokens cost more than they bring.
EVAL_STOP_BELOW = 0.5
# what a run leaves in OUT that a rerun would replace (OUT/data is resumable and reused)
RESULTS = ("quickstart.json", "eagle3", "distill", "eval")
HEAD_EVAL_DEPTH = 4  # the head's held-out eval unrolls this deep (its tree drafts 3)


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


def head_config(out: Path, target: str, sizes: QuickstartSizes):
    """The quickstart's EAGLE-3 head recipe: recipes/heads-smollm2-135m-eagle3.yaml's settings at the planned
    size, hidden states online (less than an epoch: a cache would be written and never read)."""
    from draftsmith.config import from_dict
    from draftsmith.heads.recipe import HeadsConfig

    text = ["builtin:train-text"] if sizes.head_text_examples else []
    return from_dict(
        HeadsConfig,
        {
            "model": {"target": target},
            "head": {"kind": "eagle3", "draft_vocab_size": sizes.head_vocab_size},
            "loss": {"kind": "soft_ce", "ttt_steps": 3, "decay": 0.8},
            "data": {
                "source": [str(out / "data" / "train")] + text,
                "limit": [None] + ([sizes.head_text_examples] if text else []),
                "max_length": MAX_LENGTH,
                "loss_on_prompt": True,  # the prompt's target states are computed anyway: more signal per pass
                "eval_size": heldout_size(sizes),
                "hidden_states": "online",
            },
            "eval": {"depth": HEAD_EVAL_DEPTH},
            "train": {
                "max_steps": sizes.head_steps,
                "batch_size": sizes.head_batch_size,
                "lr": sizes.head_lr,
                "warmup_steps": max(sizes.head_steps // 12, 1),
                "schedule": "cosine",
                "max_grad_norm": 0.5,
                "log_every": max(sizes.head_steps // 20, 1),
                "eval_every": 0,
                "eval_before_training": False,
                "save_every": sizes.head_steps,
                "keep_checkpoints": 1,
                "seed": 0,
                "mixed_precision": "auto",
            },
            "output_dir": str(out / "eagle3"),
        },
    )


def _plan(run, base: QuickstartSizes, fixed: bool, budget_s: float, evals: bool):
    """Measure this machine and plan (fixed: `base` as given, only predicted). -> (plan, costs, shape)."""
    from draftsmith import models
    from draftsmith.app.calibrate import data_shape, head_width, measure_costs, train_width
    from draftsmith.trainer import resolve_mixed_precision

    shape, text_load_s = data_shape(run.tok, base, *run.sets)
    bf16 = resolve_mixed_precision("auto") == "bf16"
    # the head trains on the target as its trainer loads it (the decoding copy's Linears are re-laid out)
    head_model = models.load_model(run.target, device=run.model.device) if base.head_steps else None
    costs = measure_costs(
        run.model,
        run.tok,
        base,
        train_width(shape, base),
        bf16,
        text_load_s,
        head_model=head_model,
        head_width=head_width(shape, base),
    )
    del head_model
    elapsed = time.perf_counter() - run.t_start
    if not fixed:
        return plan_quickstart(costs, shape, budget_s, elapsed, full=base, decoder_eval=evals), costs, shape
    base = head_draft(base, costs) if base.head_steps else base
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
    """Measure, plan within `budget_min` minutes, run the steps above; returns (and writes to OUT/quickstart.json)
    the plan, each trained drafter's predicted and measured numbers, the best drafter, and predicted vs measured
    time per phase. `sizes` (or `fast`) fixes the sizes instead of planning them (the plan is still predicted and
    printed); sizes with head_steps 0 train no head, with steps 0 no distilled draft.
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
    sz = plan.sizes
    _drop_unplanned(run.out, sz)
    result: dict = {
        "target": run.target,
        "dtype": str(next(run.model.parameters()).dtype).replace("torch.", ""),
        "sizes": asdict(sz),
        "costs": asdict(costs),
        "plan": plan_record(first_plan),
        "replan": plan_record(plan) if plan is not first_plan else None,
        "drafters": {},
    }
    trained = {}  # drafter name -> (spec for the decoder eval, EvalSettings' k)
    if sz.head_steps:
        head = _train_head(run, sz)
        result["drafters"]["eagle3"] = head
        spec = f"eagle:{head['dir']},top_k={sz.head_top_k},total_tokens={sz.head_nodes}"
        trained["eagle3"] = (spec, sz.head_depth)
    if sz.steps:
        summary, before, after, tok_s = _distill(run, sz)
        result["drafters"]["distill"] = _predicted(run, sz, summary, before, after, tok_s)
        trained["distill"] = (f"draft:{summary['final_dir']},stop_below={EVAL_STOP_BELOW}", 4)
    if run_decoder_eval:
        for name, (spec, k) in trained.items():
            result["drafters"][name].update(_decoder_eval(run, sz, name, spec, k, costs))
        result.update(_best(result["drafters"]))
    timings = run.timings
    timings["total_s"] = time.perf_counter() - run.t_start
    timings["total_cpu_s"] = time.process_time() - c_start
    result["timings"] = timings
    write_json(run.out / "quickstart.json", result, default=str)
    for line in time_table(first_plan, plan, timings):
        print(f"      {line}")
    print(
        f"done in {timings['total_s'] / 60:.1f} min; {_done_line(result)}  summary: {run.out / 'quickstart.json'}"
    )
    return result


def _best(drafters: dict) -> dict:
    """The drafter with the highest measured speedup, and that speedup (quickstart.json's `best`, `speedup`)."""
    name = max(drafters, key=lambda n: drafters[n]["measured"]["speedup"])
    return {"best": name, "speedup": drafters[name]["measured"]["speedup"]}


def _done_line(result: dict) -> str:
    names = {"eagle3": "EAGLE-3 head", "distill": "distilled draft"}
    if "best" not in result:
        return "; ".join(f"{names[n]}: {d['dir']}" for n, d in result["drafters"].items()) + ";"
    parts = [
        f"{names[n]} {d['measured']['speedup']:.2f}x (tau {d['measured']['tau']:.2f})"
        + (" <- best" if n == result["best"] else "")
        for n, d in result["drafters"].items()
    ]
    return f"measured speedup over plain decoding: {', '.join(parts)}; best: {result['drafters'][result['best']]['dir']}"


def _check_out(out: Path, overwrite: bool, evals: bool) -> None:
    """The output folder is writable, and earlier results are replaced only when asked (and then named)."""
    check_output_dir(out, RESULTS, overwrite)
    replaced = [name for name in RESULTS if evals or name != "eval"]
    held = [f"{name}/" if (out / name).is_dir() else name for name in replaced if (out / name).exists()]
    if held:
        print(f"--overwrite: replacing the earlier {', '.join(held)} in {out} (generated data is reused)")


def _drop_unplanned(out: Path, sizes: QuickstartSizes) -> None:
    """A drafter this plan does not train leaves no earlier results beside this run's (only --overwrite gets here
    with earlier results: _check_out)."""
    import shutil

    for name, planned in (("eagle3", sizes.head_steps), ("distill", sizes.steps)):
        for path in (out / name, out / "eval" / name):
            if not planned and path.exists():
                shutil.rmtree(path)
                print(f"      removed the earlier {path} (this plan trains no {name})")


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
    plan, costs, shape = _plan(run, base, fixed, budget_s, evals)
    run.timings["load_and_measure_s"] = time.perf_counter() - run.t_start
    print(f"      {costs_line(costs, time.perf_counter() - t)}")
    for line in plan.lines():
        print(f"      {line}")
    return plan, costs, shape


def _generate_data(run: _Run, sizes: QuickstartSizes) -> None:
    """Step 1: the target answers builtin:train prompts (training data) and, for the distilled draft's predicted
    numbers, dev-eval prompts (references)."""
    from draftsmith.selfdistill import generate_dataset

    t, c = time.perf_counter(), time.process_time()
    refs = f" (+{sizes.dev_prompts} dev-eval references)" if sizes.dev_prompts else ""
    print(f"[1/4] the target answers {sizes.train_prompts} builtin:train prompts{refs}")
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
    if sizes.dev_prompts:
        dev = dev_eval_prompts(sizes.dev_prompts, sets=run.sets)
        generate_dataset(run.target, dev, data / "dev-eval", for_eval=True, **gen_kw)
    run.timings["generate_s"] = time.perf_counter() - t
    run.timings["generate_cpu_s"] = time.process_time() - c


def _train_head(run: _Run, sizes: QuickstartSizes) -> dict:
    """Step 2 (and 3 for the head): train the EAGLE-3 head; print its held-out acceptance. -> its record."""
    from draftsmith.heads.recipe import run_heads
    from draftsmith.trainer import make_accelerator

    t, c = time.perf_counter(), time.process_time()
    cfg = head_config(run.out, run.target, sizes)
    print(
        f"[2/4] training an EAGLE-3 head ({sizes.head_vocab_size}-token draft vocabulary), {sizes.head_steps} "
        f"steps x {sizes.head_batch_size} on the generated answers + {sizes.head_text_examples} "
        "builtin:train-text pairs, the target's hidden states computed as it goes"
    )
    summary = run_heads(cfg, make_accelerator(cfg.train), overwrite=run.overwrite, progress=run.progress)
    run.timings["head_s"] = time.perf_counter() - t
    run.timings["head_cpu_s"] = time.process_time() - c
    events = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    train_ev = [e for e in events if e["event"] == "train" and "tokens_per_s" in e]
    tok_s = sum(e["n_tokens"] for e in train_ev) / max(sum(e["elapsed_s"] for e in train_ev), 1e-9)
    ev = summary["eval"]
    acc = " ".join(f"{a:.2f}" for a in ev["acceptance_per_depth"])
    print(
        f"[3/4] EAGLE-3 head, predicted on {heldout_size(sizes)} held-out answers (greedy, teacher-forced, tau "
        f"includes the bonus token): acceptance per depth {acc}, tau(k={HEAD_EVAL_DEPTH}) {ev['tau_sim']:.2f}; "
        f"training {tok_s:.0f} tokens/s"
    )
    return {"dir": summary["final_dir"], "predicted": ev, "train_tokens_per_s": tok_s}


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
    """Step 3 for the distilled draft: predicted acceptance before and after training, printed. -> its record."""
    ratio = after["tau_greedy"]["4"] / before["tau_greedy"]["4"]
    ratio_iid = after["tau_greedy_iid"]["4"] / before["tau_greedy_iid"]["4"]
    print(
        "[3/4] distilled draft, predicted on dev-eval target answers (greedy, teacher-forced, tau includes the "
        "bonus token)"
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
        "dir": summary["final_dir"],
        "init": summary["init"],
        "predicted": {"before": before, "after": after, "tau_k4_ratio": ratio, "tau_k4_ratio_iid": ratio_iid},
        "train_tokens_per_s": tok_s,
    }


def _decoder_eval(
    run: _Run, sizes: QuickstartSizes, name: str, spec: str, k: int, costs, fresh: bool = True
) -> dict:
    """Step 4: the decoder measures one drafter against plain decoding; below 1x it says why. `fresh`: in a process
    of its own, as `draftsmith eval` would: after the training steps this process decoded the 135M ~1.3x slower
    (plain 15.9 against 20.4 tokens/s on a 2-core AMX Xeon; the head measured 1.07x here and 1.34x there), which no
    user of the trained drafter would see."""
    from draftsmith.app.evaluate import evaluate
    from draftsmith.decode.speed import explain_result
    from draftsmith.evalsettings import EvalSettings

    t, c = time.perf_counter(), time.process_time()
    how = (
        f"k={k}, a step's draft stops below {EVAL_STOP_BELOW} confidence"
        if name == "distill"
        else f"a dynamic tree of {sizes.head_nodes} tokens, depth {k}"
        if sizes.head_top_k > 1
        else f"a chain of {k}"
    )
    label = {"eagle3": "EAGLE-3 head", "distill": "distilled draft"}[name]
    print(
        f"[4/4] {label}: speculative decoding vs plain decoding on {sizes.eval_prompts} dev-eval prompts "
        f"(greedy, {how})"
    )
    args = (run.target, spec, dev_eval_prompts(sizes.eval_prompts, sets=run.sets))
    kw = {
        "settings": EvalSettings(k=k, max_new_tokens=sizes.eval_max_new_tokens),
        "out_dir": run.out / "eval" / name,
        "overwrite": run.overwrite,
        "progress": run.progress,
    }
    res = _fresh_process(evaluate, args, kw) if fresh else evaluate(*args, **kw, target_model=run.model)
    phase = "head_decoder_eval" if name == "eagle3" else "decoder_eval"
    run.timings[f"{phase}_s"] = time.perf_counter() - t
    run.timings[f"{phase}_cpu_s"] = time.process_time() - c
    measured = {
        key: res.get(key)
        for key in ("tau", "speedup", "tokens_per_s", "lossless", "alpha_per_position", "costs")
    }
    print(
        f"      measured tau {res['tau']:.2f} (bonus included), speedup {res['speedup']:.2f}x, "
        f"lossless {res['lossless']}; report: {run.out / 'eval' / name / 'report.md'}"
    )
    # verify costs for other draft lengths, as multiples of a step, from this run's own measurements
    ratios = {n: s / costs.forward_s[1] for n, s in costs.forward_s.items()}
    why = explain_result(res, verify_ratios=ratios)
    if why:
        print("      why slower than plain decoding (costs measured in this run):")
        for line in why:
            print(f"      - {line}")
    return {"measured": measured, "why_slower": why}


def _fresh_process(fn, args: tuple, kw: dict) -> dict:
    """fn(*args, **kw) in a new (spawned) Python process; its result, or its error in one line."""
    import multiprocessing

    from draftsmith.errors import DraftsmithError

    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply(fn, args, kw)
    except DraftsmithError:
        raise
    except Exception as e:  # noqa: BLE001
        raise DraftsmithError(
            f"the decoder eval failed in its own process: {type(e).__name__}: {e}"
        ) from None
    finally:  # the worker exits on its own (a terminated one can leave its semaphores to the resource tracker)
        pool.close()
        pool.join()


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
