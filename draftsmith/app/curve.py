"""`draftsmith curve`: a drafter's data-scaling curve from one training run with snapshots (train.snapshot_steps),
beside a reference drafter measured in the same decoding run.

    python train/heads.py --config recipes/data-engine/heads-qwen2.5-coder-1.5b-eagle3-1m.yaml
    draftsmith bench drafters --target qwen2.5-coder-1.5b --prompts builtin:dev-eval \
        --drafter step-0000070=eagle:RUN/snapshots/step-0000070@3 ... --drafter final=eagle:RUN/final@3 \
        --drafter 0.5b=draft:qwen2.5-coder-0.5b,vocab=32k,bits=4,compile=1@5 --out RUN/bench
    draftsmith curve RUN --bench RUN/bench/bench.json --reference 0.5b --out RUN/curve

Each point is a snapshot (and final/): the unique training tokens read up to its step (the trainer's own n_tokens,
summed over metrics.jsonl's train events; inside a logging window, pro rata), the held-out τ the trainer measured
at that step (its eval event: the decoder's rounds at depth --k), and, where --bench names a drafter after the
snapshot's folder (step-NNNNNNN, final), the decoded τ and speedup on the bench's prompts. The crossing is the
first point whose speedup reaches the reference's; when none does, a straight line through the points' speedup
against log(tokens) says where it would (marked as an extrapolation). Writes OUT/curve.json and OUT/curve.png.
No model loads.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from draftsmith.errors import DraftsmithError

CURVE_FILES = ("curve.json", "curve.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run", help="a training run folder with snapshots/ (train.snapshot_steps) and metrics.jsonl"
    )
    p.add_argument("--bench", default=None, help="a bench.json whose drafters are named step-NNNNNNN / final")
    p.add_argument(
        "--reference", default=None, help="the bench drafter to cross (e.g. the stock draft model)"
    )
    p.add_argument("--k", type=int, default=3, help="draft length of the held-out τ (default 3)")
    p.add_argument("--out", required=True, help="folder for curve.json and curve.png")
    p.add_argument("--overwrite", action="store_true", help="replace a curve already in --out")


def read_events(run: Path) -> list[dict]:
    """The run's metrics.jsonl events (draftsmith.rundir: a live run's torn last line is skipped)."""
    from draftsmith.rundir import read_events as run_events

    path = run / "metrics.jsonl"
    if not path.is_file():
        raise DraftsmithError(
            f"{run} has no metrics.jsonl; pass a training run folder (train/heads.py output_dir)"
        )
    return run_events(path, warn=False)


def tokens_at(events: list[dict], step: int) -> float:
    """Training tokens read by the end of `step`: whole logging windows before it, pro rata inside its own."""
    done, last = 0.0, 0
    for e in (e for e in events if e.get("event") == "train"):
        n = float(e.get("n_tokens", 0.0))
        if e["step"] >= step:
            return done + n * (step - last) / (e["step"] - last)
        done, last = done + n, e["step"]
    raise DraftsmithError(
        f"metrics.jsonl logs no training past step {last}; step {step} has not been trained"
    )


def points(run: Path, events: list[dict], k: int) -> list[dict]:
    """One point per snapshot folder and final/ that the run wrote, in step order."""
    evals = {e["step"]: e for e in events if e.get("event") == "eval"}
    folders = sorted((run / "snapshots").glob("step-*")) if (run / "snapshots").is_dir() else []
    found = [
        (int(f.name.removeprefix("step-")), f.name) for f in folders if f.name.removeprefix("step-").isdigit()
    ]
    if (run / "final").is_dir():
        found.append((max(evals, default=0), "final"))
    if not found:
        raise DraftsmithError(
            f"{run} holds no snapshots/step-* or final/; train with train.snapshot_steps set"
        )
    out = []
    for step, name in found:
        ev = evals.get(step, {})
        rounds = ev.get("tau_rounds") or {}
        out.append(
            {
                "name": name,
                "step": step,
                "tokens": tokens_at(events, step),
                "held_out_tau": rounds.get(str(k), ev.get("tau_sim")),
                "held_out_acceptance": ev.get("acceptance_per_depth"),
            }
        )
    return out


def crossing(pts: list[dict], reference: float) -> dict:
    """Where the points' speedup reaches `reference`: measured (between two points) or extrapolated on a least
    squares line of speedup against ln(tokens); None where the points do not rise."""
    pts = [p for p in pts if p.get("speedup") is not None]
    for prev, p in zip([None, *pts], pts):
        if p["speedup"] >= reference:
            return {"measured": True, "tokens": p["tokens"], "after": prev["tokens"] if prev else 0.0}
    if len(pts) < 2:
        return {"measured": False, "tokens": None, "why": "fewer than two decoded points: no trend yet"}
    xs, ys = [math.log(p["tokens"]) for p in pts], [p["speedup"] for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:
        return {
            "measured": False,
            "tokens": None,
            "slope_per_e": slope,
            "why": "its speedup does not rise with tokens",
        }
    return {"measured": False, "tokens": math.exp(mx + (reference - my) / slope), "slope_per_e": slope}


def build(run: Path, bench: dict | None, reference: str | None, k: int) -> dict:
    events = read_events(run)
    pts = points(run, events, k)
    ref = None
    if bench is not None:
        drafters = bench.get("drafters", {})
        for p in pts:
            r = drafters.get(p["name"])
            if r is not None:
                p.update(tau=r.get("tau"), speedup=r.get("speedup"), decoded_k=r.get("k"))
        if reference is not None:
            r = drafters[reference]
            ref = {"name": reference, "tau": r.get("tau"), "speedup": r.get("speedup"), "k": r.get("k")}
    out = {"run": str(run), "k": k, "points": pts, "reference": ref}
    if ref is not None and ref["speedup"] is not None:
        out["crossing"] = crossing(pts, ref["speedup"])
    if bench is not None:
        first = next(iter(bench.get("drafters", {}).values()), {})
        out["bench_conditions"] = first.get("conditions")
    return out


def plot(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = curve["points"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [p["tokens"] / 1e6 for p in pts]
    a1.plot(xs, [p["held_out_tau"] for p in pts], marker="o", label=f"held-out (trainer, k {curve['k']})")
    if any(p.get("tau") is not None for p in pts):
        a1.plot(xs, [p.get("tau") for p in pts], marker="s", label="decoded (bench prompts)")
    a2.plot(xs, [p.get("speedup") for p in pts], marker="s", label="trained drafter")
    ref = curve.get("reference")
    if ref:
        if ref.get("tau") is not None:
            a1.axhline(ref["tau"], color="C3", ls="--", label=f"{ref['name']} (k {ref['k']})")
        if ref.get("speedup") is not None:
            a2.axhline(ref["speedup"], color="C3", ls="--", label=ref["name"])
    a2.axhline(1.0, color="k", lw=0.8)
    for ax, ylabel in ((a1, "τ (tokens per target step)"), (a2, "speedup over plain (same run)")):
        ax.set(xscale="log", xlabel="unique training tokens (millions)", ylabel=ylabel)
        ax.set_xticks(xs, [f"{x:.2g}" for x in xs])  # the points' own token counts, not log-axis minor labels
        ax.minorticks_off()
        ax.legend(fontsize=8)
    fig.suptitle(Path(curve["run"]).name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(curve: dict) -> str:
    rows = ["point          tokens   held-out τ   decoded τ   speedup"]
    for p in curve["points"]:
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append(
            f"{p['name']:<13} {p['tokens'] / 1e6:6.3f}M   {f(p['held_out_tau']):>10}   {f(p.get('tau')):>9}   "
            f"{f(p.get('speedup')):>7}"
        )
    ref, cross = curve.get("reference"), curve.get("crossing")
    if ref:
        rows.append(f"reference {ref['name']}: τ {ref['tau']:.2f}, speedup {ref['speedup']:.2f}x")
    if cross:
        if cross["measured"]:
            rows.append(
                f"crosses the reference between {cross['after'] / 1e6:.3f}M and {cross['tokens'] / 1e6:.3f}M"
            )
        elif cross["tokens"] is None:
            rows.append(f"does not cross the reference; no extrapolation: {cross['why']}")
        else:
            rows.append(
                f"not crossed; a log-linear extrapolation crosses at ~{cross['tokens'] / 1e6:.1f}M tokens"
            )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from draftsmith.fileio import atomic_write, check_output_dir, write_json

    out = check_output_dir(args.out, CURVE_FILES, args.overwrite)
    if args.k < 1:
        raise DraftsmithError(f"--k must be >= 1, got {args.k}")
    bench = None
    if args.bench is not None:
        try:
            bench = json.loads(Path(args.bench).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DraftsmithError(
                f"--bench {args.bench} is not a readable bench.json ({e}); pass draftsmith bench drafters' output"
            ) from None
        names = sorted(bench.get("drafters", {})) if isinstance(bench, dict) else []
        if args.reference is not None and args.reference not in names:
            raise DraftsmithError(
                f"--reference {args.reference!r} is not a drafter of {args.bench} ({', '.join(names)})"
            )
    elif args.reference is not None:
        raise DraftsmithError("--reference names a drafter of --bench; pass --bench too")
    curve = build(Path(args.run), bench, args.reference, args.k)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "curve.json", curve)
    atomic_write(out / "curve.png", lambda p: plot(curve, p))
    print(table(curve))
    return 0
