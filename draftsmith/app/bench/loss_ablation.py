"""Which training loss buys the most accepted tokens, measured by the decoder (resumable).

    draftsmith bench loss-ablation OUT --trainer distill [--config R] [--losses fkl,tvd,fkl>tvd@60]
        [--seeds 0,1] [--set key=value ...] [--prompts builtin:dev-eval --limit 16 --max-new-tokens 64]
        [--k 4] [--temperatures 0,1] [--untrained] [--dry]
    bash scripts/loss_ablation.sh OUT distill            # the same, with the defaults below

For one trainer (`distill`: a draft LM, `train/distill.py`; `eagle3`: an EAGLE-3 head, `train/heads.py`), every loss
in --losses is trained with every seed in --seeds from the SAME recipe: same data, steps, tokens and held-out split
(data.split_seed=0 whatever the seed); only loss.kind (and train.seed) change. `A>B@N` is a schedule: loss A for
the first N optimizer steps, then B (loss.warmup_kind / loss.warmup_steps). Then ONE process loads the target once
and decodes every checkpoint, each interleaved with plain decoding, on prompts no run tuned on (dev-eval by
default), greedy and at temperature 1, at the draft length --k (EAGLE-3 heads as a chain of k, the shape their
held-out eval predicts; `eagle:` alone would decode a 24-node tree). --prompts may name more sets, comma-separated: the
first is the one the table ranks by; the others are measured the same way and shown beside it (loss_ablation.sh adds
training prompts the data did not use: the distribution the trainer's held-out prediction is taken on, so a gap
between predicted and measured tau splits into the prediction's own error and the shift to the evaluation prompts).
Written to OUT/<trainer>/:

  runs/<loss>-s<seed>/     the training runs (a rerun skips finished runs and resumes unfinished ones)
  measured-t<T>.json        the decoder's numbers per checkpoint on the first prompt set (measured-<set>-t<T>.json
                            on the others; a rerun skips what was measured with the same drafters and settings)
  ablation.json / .md / .png  per loss: measured tau mean and spread over seeds, alpha_1, speedup, and the
                              trainer's predicted tau beside the measured one

--untrained also measures the draft the runs start from, as it is (distill recipes with model.init=existing and
no layer pruning: the off-the-shelf small model), beside the checkpoints in the same decoder run; its predicted tau
is the runs' step-0 held-out eval (one split for every run).

--dry validates the recipe, every override and the output folder and prints the plan; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from draftsmith.app.bench.runs import ROOT, RecipeRun, config_class
from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class Trainer:
    script: str  # runs.RecipeRun trainer: distill | heads
    config: str
    spec: str  # the eval drafter spec of a finished run, {final} = its final/ folder, {k} = the draft length
    k: int  # the draft length users pick for it (the recipe's documented choice)
    schedules: bool  # the trainer takes loss.warmup_kind / loss.warmup_steps


TRAINERS = {
    "distill": Trainer("distill", "recipes/smollm2-135m-quickstart.yaml", "draft:{final}", 4, True),
    "eagle3": Trainer(
        "heads", "recipes/heads-smollm2-135m-eagle3.yaml", "eagle:{final},top_k=1,total_tokens={k}", 3, False
    ),
}


def trainer_losses(trainer: str) -> tuple[str, ...]:
    """Every loss the trainer offers, from its config's Literal (the one list the trainer validates against)."""
    if trainer == "distill":
        from draftsmith.divergences import DivergenceKind

        return get_args(DivergenceKind)
    from draftsmith.heads.common import LossKind

    return get_args(LossKind)


def parse_loss(loss: str, trainer: str) -> tuple[str, str | None, int]:
    """'tvd' -> ('tvd', None, 0); 'fkl>tvd@60' -> ('tvd', 'fkl', 60): fkl for 60 optimizer steps, then tvd.
    Refuses names the trainer does not offer and schedules it cannot run."""
    first, sched, rest = loss.partition(">")
    then, _, steps = rest.partition("@")
    if sched and (not TRAINERS[trainer].schedules or not steps.isdigit() or int(steps) < 1):
        raise DraftsmithError(
            f"--losses {loss!r}: " + ("use A>B@STEPS, e.g. fkl>tvd@60 (fkl for 60 steps, then tvd)"
            if TRAINERS[trainer].schedules else f"the {trainer} trainer has no loss schedule; use single losses")
        )  # fmt: skip
    offered = trainer_losses(trainer)
    for name in (first, then) if sched else (first,):
        if name not in offered:
            raise DraftsmithError(
                f"--losses: {name!r} is not a {trainer} loss; offered: {', '.join(offered)}"
            )
    return (then, first, int(steps)) if sched else (first, None, 0)


def loss_overrides(loss: str, trainer: str) -> list[str]:
    kind, warmup_kind, warmup_steps = parse_loss(loss, trainer)
    if warmup_kind is None:
        return [f"loss.kind={kind}"]
    return [f"loss.kind={kind}", f"loss.warmup_kind={warmup_kind}", f"loss.warmup_steps={warmup_steps}"]


def slug(loss: str) -> str:
    return loss.replace(">", "-then-").replace("@", "-at-")


@dataclass(frozen=True)
class Cell:
    """One (loss, seed) of the ablation and its training run."""

    loss: str
    seed: int
    run: RecipeRun


def plan(args) -> list[Cell]:
    """One run per (loss, seed), each validated strictly (every override) before anything runs."""
    extra = ["eval.temperature=1.0"] if args.trainer == "distill" else []  # predicts T=1 and greedy at once
    cells = []
    for loss in args.losses:
        for seed in args.seeds:
            run = RecipeRun(
                f"{loss}-s{seed}",
                TRAINERS[args.trainer].script,
                args.config,
                args.out / args.trainer / "runs" / f"{slug(loss)}-s{seed}",
                [
                    *args.set,
                    *extra,
                    *loss_overrides(loss, args.trainer),
                    f"train.seed={seed}",
                    "data.split_seed=0",
                ],
            )
            run.validate()
            cells.append(Cell(loss, seed, run))
    return cells


UNTRAINED = "untrained"
"""The row of --untrained: the draft the runs start from, as it is."""


def untrained_spec(args) -> str | None:
    """--untrained: the drafter spec of the model every run starts from; refused (one line) where that model is not
    one to decode as it is. parse() keeps it as args.untrained_spec."""
    if not args.untrained:
        return None
    cfg = _config(args)
    if args.trainer != "distill" or cfg.model.init != "existing" or cfg.model.layers is not None:
        raise DraftsmithError(
            "--untrained measures the draft the runs start from as it is: it needs the distill trainer with "
            "model.init=existing and model.layers=null (a pruned or built draft is not a model to decode); drop "
            "--untrained or use such a recipe"
        )
    return f"draft:{cfg.model.draft}"


def predicted(run_dir: Path, trainer: str, k: int, first: bool = False) -> dict:
    """The trainer's own prediction at the end of training (its last held-out eval in metrics.jsonl), or with
    `first` at its step-0 eval (the model it started from)."""
    evals = [e for e in _events(run_dir / "metrics.jsonl") if e.get("event") == "eval"]
    if first:
        evals = [e for e in evals if e.get("step") == 0][:1]
    if not evals:
        return {}
    last = evals[-1]
    if trainer == "distill":
        held = last.get("heldout") or {}
        taus, greedy = held.get("tau") or {}, held.get("tau_greedy") or {}
        return {"alpha_t1": held.get("alpha"), "top1": held.get("top1"), "tau_t1": taus.get(str(k), taus.get(k)),
                "tau_greedy": greedy.get(str(k), greedy.get(k))}  # fmt: skip
    from draftsmith.acceptance import tau_from_conditional

    acc = (last.get("acceptance_per_depth") or [])[:k]  # EAGLE heads: greedy (top-1) acceptance per depth
    rounds = last.get("tau_rounds") or {}  # the rounds walk (runs before it: the chain formula)
    tau = rounds.get(str(k), rounds.get(k)) or (tau_from_conditional(acc) if acc else None)
    return {"alpha_per_depth_greedy": acc, "tau_greedy": tau}


def _events(path: Path) -> list[dict]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
    return out


def measure(args, cells: list[Cell]) -> dict[float, dict]:
    """Decode every finished run at each temperature in ONE process: target loaded once, every checkpoint and plain
    decoding back to back per prompt in a rotated order (draftsmith.decode.evaluate.measure)."""

    from draftsmith import models
    from draftsmith.app.evaluate import encode_prompts, load_drafters
    from draftsmith.decode.evaluate import measure as decode_measure
    from draftsmith.evalsettings import EvalSettings
    from draftsmith.fileio import write_json
    from draftsmith.prompts import load_prompts

    target_spec = _config(args).model.target
    reference = args.untrained_spec
    names = [c.run.name for c in cells] + ([UNTRAINED] if reference else [])
    results, todo = {}, []
    for src in args.prompt_sets:
        for t in args.temperatures:
            f = measured_path(args, src, t)
            have = json.loads(f.read_text()) if f.is_file() else None
            same = have and sorted(have["drafters"]) == sorted(names) and all(
                have.get(k) == v for k, v in
                (("prompts", src), ("k", args.k), ("max_new_tokens", args.max_new_tokens), ("limit", args.limit))
            )  # fmt: skip
            if same:
                results[(src, t)] = have
            else:
                todo.append((src, t))
    if not todo:
        return results
    tok = models.load_tokenizer(target_spec)
    target = models.load_model(target_spec, inference=True)
    spec = TRAINERS[args.trainer].spec
    named = [(c.run.name, spec.format(final=c.run.final, k=args.k), args.k, False) for c in cells]
    named += [(UNTRAINED, reference, args.k, False)] if reference else []
    decoder, drafters = load_drafters(
        target, tok, named, target_spec=target_spec, settings=EvalSettings(k=args.k, limit=args.limit)
    )
    for src, t in todo:
        prompts = load_prompts(src, limit=args.limit)
        settings = EvalSettings(k=args.k, temperature=t, max_new_tokens=args.max_new_tokens, limit=args.limit)
        encoded = encode_prompts(decoder.max_positions, tok, prompts, settings)
        print(
            f"measuring {len(drafters)} checkpoints at T={t:g} on {src} ({len(prompts)} prompts, one run)",
            flush=True,
        )
        res = decode_measure(decoder, drafters, prompts, encoded, settings, progress=False)
        rows = {name: {k: v for k, v in r.items() if k != "prompts"} for name, r in res["drafters"].items()}
        results[(src, t)] = {"temperature": t, "k": args.k, "target": target_spec, "prompts": src,
                             "limit": args.limit, "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                             "dtype": str(target.dtype), "date": time.strftime("%Y-%m-%d"), "plain": res["plain"],
                             "drafters": rows}  # fmt: skip
        write_json(measured_path(args, src, t), results[(src, t)])
    return results


def set_label(src: str) -> str:
    """A prompt set's short name: builtin:dev-eval -> dev-eval, a file -> its stem."""
    return src.split(":", 1)[1] if src.startswith("builtin:") else Path(src).name.split(".")[0]


def measured_path(args, src: str, t: float) -> Path:
    tag = "" if src == args.prompt_sets[0] else f"{set_label(src)}-"
    return args.out / args.trainer / f"measured-{tag}t{t:g}.json"


def _config(args):
    """The recipe with every --set override, as the trainer reads it."""
    from draftsmith.config import load_config

    return load_config(config_class(TRAINERS[args.trainer].script), str(args.config), args.set)


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / 2 if len(xs) > 1 else 0.0


def aggregate(args, cells: list[Cell], measured: dict[float, dict]) -> dict:
    """Per loss and temperature: tau mean +- half-range over seeds, alpha_1, speedup; predicted tau beside it."""
    table = {}
    primary, others = args.prompt_sets[0], args.prompt_sets[1:]
    rows = [
        (
            loss,
            [c.run.name for c in cells if c.loss == loss],
            [predicted(c.run.out, args.trainer, args.k) for c in cells if c.loss == loss],
        )
        for loss in args.losses
    ]
    if args.untrained_spec:  # every run's step 0 is this model on the same held-out split: the first one's
        rows.append((UNTRAINED, [UNTRAINED], [predicted(cells[0].run.out, args.trainer, args.k, first=True)]))
    for loss, names, preds in rows:
        entry = {}
        for t in args.temperatures:
            m = measured[(primary, t)]
            got = [m["drafters"][name] for name in names]
            taus = [g["tau"] for g in got]
            alpha1 = [g["alpha_per_position"][0] for g in got if g.get("alpha_per_position")]
            key = "tau_greedy" if t == 0 else "tau_t1"
            pred = [p[key] for p in preds if p.get(key) is not None]
            also = {}
            for src in others:
                tau_o = [measured[(src, t)]["drafters"][name]["tau"] for name in names]
                also[set_label(src)] = {"tau_mean": statistics.mean(tau_o), "tau_spread": _spread(tau_o),
                                        "predicted_over_measured": statistics.mean(pred) / statistics.mean(tau_o)
                                        if pred else None}  # fmt: skip
            entry[f"t{t:g}"] = {
                "tau_mean": statistics.mean(taus),
                "tau_spread": _spread(taus),
                "tau_per_seed": taus,
                "alpha1_mean": statistics.mean(alpha1) if alpha1 else None,
                "speedup_mean": statistics.mean(g["speedup"] for g in got),
                "speedup_spread": _spread([g["speedup"] for g in got]),
                "lossless": [g.get("lossless") for g in got] if t == 0 else None,
                "predicted_tau_mean": statistics.mean(pred) if pred else None,
                "predicted_over_measured": statistics.mean(pred) / statistics.mean(taus) if pred else None,
                "also": also,
            }
        table[loss] = entry
    return table


def report(args, table: dict, measured: dict) -> str:
    base = "fkl" if "fkl" in table else next(iter(table))
    primary = args.prompt_sets[0]
    some = measured[(primary, args.temperatures[0])]
    sizes = ", ".join(
        f"{measured[(s, args.temperatures[0])]['n_prompts']} of {s}" for s in args.prompt_sets[1:]
    )
    labels = [set_label(s) for s in args.prompt_sets[1:]]
    lines = [f"# Loss ablation: {args.trainer} ({args.config})", "",
             f"Target {some['target']} ({some['dtype']}), {some['n_prompts']} prompts of {primary}"
             + (f" (also: {sizes})" if sizes else "") + f", {args.max_new_tokens} new tokens, k={args.k}, seeds "
             f"{', '.join(map(str, args.seeds))} (spread = half the range over seeds), measured {some['date']}. tau "
             f"includes the bonus token. Predicted tau: the trainer's last held-out eval.", "",
             "| loss | T | measured tau (mean ± spread) | vs " + base + " | alpha_1 | speedup | predicted tau | "
             "predicted / measured |" + "".join(f" tau on {x} | predicted / that |" for x in labels),
             "|---|---|---|---|---|---|---|---|" + "---|---|" * len(labels)]  # fmt: skip
    for loss, entry in table.items():
        for t, e in entry.items():
            ref = table[base][t]["tau_mean"]
            pred = "–" if e["predicted_tau_mean"] is None else f"{e['predicted_tau_mean']:.2f}"
            ratio = "–" if e["predicted_over_measured"] is None else f"{e['predicted_over_measured']:.2f}"
            a1 = "–" if e["alpha1_mean"] is None else f"{e['alpha1_mean']:.2f}"
            also = "".join(
                f" {o['tau_mean']:.3f} ± {o['tau_spread']:.3f} | "
                + ("–" if o["predicted_over_measured"] is None else f"{o['predicted_over_measured']:.2f}")
                + " |"
                for o in (e["also"][x] for x in labels)
            )
            lines.append(f"| {loss} | {t[1:]} | {e['tau_mean']:.3f} ± {e['tau_spread']:.3f} | {e['tau_mean'] / ref:.3f} | "
                         f"{a1} | {e['speedup_mean']:.2f}× ± {e['speedup_spread']:.2f} | {pred} | {ratio} |{also}")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(table: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    temps = list(next(iter(table.values())))
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        names = list(table)
        ax.bar(
            names, [table[n][t]["tau_mean"] for n in names], yerr=[table[n][t]["tau_spread"] for n in names]
        )
        ax.set(title=f"T = {t[1:]}", ylabel="measured tau (bonus included)")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("out", type=Path)
    ap.add_argument("--trainer", choices=sorted(TRAINERS), default="distill")
    ap.add_argument("--config", type=Path, default=None, help="recipe (default: the trainer's CPU recipe)")
    ap.add_argument("--losses", default=None, help="comma list; default: every loss the trainer offers")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--set", action="append", default=[], help="recipe override for every run (repeatable)")
    ap.add_argument(
        "--prompts", default="builtin:dev-eval", help="comma list of prompt sets; the first ranks"
    )
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=None, help="draft length (default: the trainer's usual one)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument(
        "--untrained",
        action="store_true",
        help="also measure the draft the runs start from, as it is (distill, model.init=existing)",
    )
    ap.add_argument("--dry", action="store_true", help="validate and print the plan; write nothing")


def check(args: argparse.Namespace) -> argparse.Namespace:
    """Every argument checked and resolved in place before anything is written (one DraftsmithError line)."""
    tr = TRAINERS[args.trainer]
    args.config = args.config or ROOT / tr.config
    if not args.config.is_file():
        raise DraftsmithError(f"--config {args.config} not found; pass a recipe YAML")
    args.losses = [x for x in (args.losses or ",".join(trainer_losses(args.trainer))).split(",") if x]
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
        args.temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise DraftsmithError(
            "--seeds and --temperatures are comma lists of numbers, e.g. --seeds 0,1"
        ) from None
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.losses)) != len(args.losses):
        raise DraftsmithError("--seeds and --losses must not repeat an entry")
    if any(t < 0 or t != t for t in args.temperatures):
        raise DraftsmithError("--temperatures must be >= 0 (0 = greedy)")
    args.k = args.k or tr.k
    if args.k < 1 or args.limit < 1 or args.max_new_tokens < 1:
        raise DraftsmithError("--k, --limit and --max-new-tokens must be >= 1")
    from draftsmith.fileio import check_output_dir
    from draftsmith.prompts import load_prompts

    args.prompt_sets = [x for x in args.prompts.split(",") if x]
    labels = [set_label(x) for x in args.prompt_sets]
    if not args.prompt_sets or len(set(labels)) != len(labels):
        raise DraftsmithError(f"--prompts {args.prompts!r}: name one or more prompt sets with distinct names")
    for src in args.prompt_sets:
        load_prompts(src, limit=args.limit)  # a missing or empty set is refused before any run trains
    check_output_dir(args.out, flag="OUT")  # before any run trains
    args.untrained_spec = untrained_spec(args)  # refused here, before any run trains
    return args


def command(args: argparse.Namespace) -> int:
    """Bad input: one `error: ...` line, exit status 2, nothing written (a DraftsmithError, which the CLI prints);
    a failed step: one line, status 1 (SystemExit)."""
    check(args)
    cells = plan(args)
    states = [c.run.state() for c in cells]
    print(f"{args.trainer}: {len(args.losses)} losses x {len(args.seeds)} seeds from {args.config}; "
          f"{states.count('done')} done, {states.count('resume')} to resume")  # fmt: skip
    if args.dry:
        for c, state in zip(cells, states):
            print(f"  {state:6s} {c.run.out}: {' '.join(c.run.overrides)}")
        return 0
    (args.out / args.trainer).mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(cells):
        c.run.run(label=f"[{i + 1}/{len(cells)}] ")
    measured = measure(args, cells)
    table = aggregate(args, cells, measured)
    from draftsmith.fileio import write_json, write_text

    write_json(args.out / args.trainer / "ablation.json", {"trainer": args.trainer, "config": str(args.config),
               "losses": args.losses, "seeds": args.seeds, "k": args.k, "table": table})  # fmt: skip
    md = report(args, table, measured)
    write_text(args.out / args.trainer / "ablation.md", md)
    plot(table, args.out / args.trainer / "ablation.png")
    print(md)
    return 0
