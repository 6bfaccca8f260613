"""Write eval.json, report.md and eval.png (acceptance by position; speedup per category). Atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.fileio import atomic_write

from .speed import explain_result


def _fmt(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def summary_table(result: dict) -> str:
    """Markdown table: overall + per category (tau includes the bonus token)."""
    lines = [
        "| set | prompts | tau (bonus incl.) | speedup | after prefill | alpha by position |",
        "|---|---|---|---|---|---|",
    ]
    c = result["conditions"]
    rows = [("all", {**result, "n_prompts": c["n_prompts"]})] + list(result["per_category"].items())
    for name, r in rows:
        alphas = " ".join(_fmt(a, 2) for a in r["alpha_per_position"])
        lines.append(
            f"| {name} | {r['n_prompts']} | {_fmt(r['tau'], 2)} | {_fmt(r['speedup'], 2)}x | "
            f"{_fmt(r.get('speedup_decode'), 2)}x | {alphas} |"
        )
    return "\n".join(lines)


def batch_table(batch: dict) -> str:
    """Markdown: one row per batch size (decode.batching), then the break-even batch size."""
    lines = [
        "| batch | tau | tok/s speculative | tok/s plain | speedup | predicted | verify cost t(B(k+1))/t(B) "
        "| best k measured | best k predicted | identical rows |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for B, r in batch["per_size"].items():
        tps = r["tokens_per_s"]
        same = "-" if r["identical_rows"] is None else f"{r['identical_rows']}/{r['rows']}"
        lines.append(
            f"| {B} | {_fmt(r['tau'], 2)} | {_fmt(tps['speculative'], 1)} | {_fmt(tps['plain'], 1)} | "
            f"{_fmt(r['speedup'], 2)}x | {_fmt(r['predicted']['speedup'], 2)}x | {_fmt(r['verify_cost'], 2)} | "
            f"{r['best_k_measured'] or '-'} | {r['predicted']['best_k']} | {same} |"
        )
    be, bp = batch["break_even_batch"], batch["break_even_batch_predicted"]
    lines += [
        "",
        "Break-even batch size (speedup 1, log2-interpolated): measured "
        + (
            f"{be:.1f}"
            if be is not None
            else f"beyond {batch['batch_sizes'][-1]} (pays at every size measured)"
        )
        + ", predicted "
        + (f"{bp:.1f}" if bp is not None else f"beyond {batch['batch_sizes'][-1]}")
        + ".",
    ]
    return "\n".join(lines)


def render_markdown(result: dict) -> str:
    c = result["conditions"]
    tps = result["tokens_per_s"]
    lossless = {
        True: "yes (greedy outputs identical to plain decoding)",
        False: "NO: outputs differ from plain decoding",
        None: "not checked (sampling)",
    }[result["lossless"]]
    detail = result.get("lossless_detail") or {}
    if detail.get("near_tie") or detail.get("mismatch"):
        ties = [
            f"{r['divergence']['margin']:.3f}"
            for r in result.get("prompts", [])
            if r.get("divergence", {}).get("near_tie")
        ]
        lossless += (
            f" - {detail['identical']} prompts identical, {detail['near_tie']} diverge at a {c['dtype']} near-tie "
            f"of the target (logit margins {', '.join(ties)} within rounding "
            f"tolerance), {detail['mismatch']} mismatched"
        )
    return "\n".join(
        [
            f"# draftsmith eval: {c['drafter']} on {c['target']}",
            "",
            f"- k = {c['k']}, temperature {c['temperature']}, top_p {c['top_p']}, top_k {c['top_k']}, "
            f"max_new_tokens {c['max_new_tokens']}, prompts `{c['prompts']}` ({c['n_prompts']}), seed {c['seed']}",
            f"- {c['device']} / {c['dtype']} / {c['hardware']}; torch {c['torch_version']}, draftsmith {c['draftsmith_version']}, {c['date']}",
            "- **tau counts the bonus/correction token** (tokens committed per target verify forward; EAGLE's convention, "
            "gpt-fast's 'mean accepted' is tau - 1).",
            f"- speedup = speculative / plain tokens per second, both measured in this run, prompt by prompt, "
            f"alternating order; warm-up excluded. Plain {_fmt(tps['plain'], 1)} tok/s, speculative {_fmt(tps['speculative'], 1)} tok/s.",
            f"- target forwards: {result['target_forwards']} speculative vs {result['target_forwards_plain']} plain; "
            f"drafting took {100 * result['draft_time_share']:.1f}% of speculative time.",
            f"- lossless: {lossless}",
            *_prefill_line(result),
            *_policy_line(result),
            "",
            summary_table(result),
            "",
            "Accepted draft tokens per step: "
            + ", ".join(f"{n}: {v}" for n, v in result["accept_length_hist"].items()),
            "",
            *_why_slower(result),
            *_batch_section(result),
            "![eval](eval.png)",
            "",
        ]
    )


def _prefill_line(result: dict) -> list[str]:
    """Prefills apart: time to first token (the target's prefill) and the decode rate after it."""
    pre, dec = result.get("prefill_s"), result.get("tokens_per_s_decode")
    if not pre or not dec or pre.get("target") is None:
        return []
    ms = 1000.0
    return [
        f"- prefill, mean per prompt: target {pre['target'] * ms:.1f} ms (plain run {pre['plain'] * ms:.1f} ms; the "
        f"first token comes from it alone, so this is the time to first token either way), drafter "
        f"{(pre['drafter'] or 0.0) * ms:.1f} ms (delays the second token; left out of the drafter's cost per "
        f"drafted token). After the first token: {_fmt(dec['speculative'], 1)} vs {_fmt(dec['plain'], 1)} tok/s, "
        f"speedup {_fmt(result.get('speedup_decode'), 2)}x (end to end, prefills included: "
        f"{_fmt(result['speedup'], 2)}x)."
    ]


def _policy_line(result: dict) -> list[str]:
    """`--k auto`: what the adaptive draft length started from and what it chose (per prompt: eval.json)."""
    pol = result.get("k_policy")
    if not pol:
        return []
    c, steps = pol["start_costs"], sum(pol["chosen"].values())
    return [
        f"- draft length auto (0 to {pol['k_max']} per step, decode.adaptive): {pol['plain_steps']} of {steps} steps "
        f"plain (k = 0), {pol['probes']} probes; k chosen {pol['chosen']}. Costs measured at the start: plain step "
        f"{c['step_s'] * 1000:.1f} ms, drafting {c['draft_s'] * 1000:.2f} ms per token."
    ]


def _why_slower(result: dict) -> list[str]:
    """A section explaining a speedup below 1 from the run's own costs (decode.speed); nothing otherwise."""
    lines = explain_result(result)
    return ["## Why slower than plain decoding", "", *(f"- {line}" for line in lines), ""] if lines else []


def _batch_section(result: dict) -> list[str]:
    batch = result.get("batch")
    if not batch:
        return []
    return [
        "## Batch size",
        "",
        f"k = {result['conditions']['k']}; {batch['method']}. Predicted: from this run's acceptance by depth and "
        "the measured cost of a target forward over B rows of n tokens (decode.speed.StepCosts).",
        "",
        batch_table(batch),
        "",
    ]


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = result.get("batch")
    fig, axes = plt.subplots(1, 3 if batch else 2, figsize=(15 if batch else 10, 3.8))
    ax1, ax2 = axes[0], axes[1]
    alphas = result["alpha_per_position"]
    xs = list(range(1, len(alphas) + 1))
    ax1.bar(xs, [a or 0.0 for a in alphas], color="tab:blue")
    ax1.set(
        xlabel="draft position",
        ylabel="conditional acceptance",
        ylim=(0, 1),
        xticks=xs,
        title=f"acceptance by position (tau={result['tau']:.2f}, bonus incl.)",
    )
    cats = list(result["per_category"])
    ax2.bar(
        ["all", *cats],
        [result["speedup"] or 0.0] + [result["per_category"][c]["speedup"] or 0.0 for c in cats],
        color="tab:green",
    )
    ax2.axhline(1.0, color="gray", lw=1, ls="--")
    ax2.set(ylabel="speedup vs plain (same run)", title="wall-clock speedup")
    ax2.tick_params(axis="x", labelrotation=30)
    if batch:
        _plot_batch(axes[2], batch)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_batch_curves(batches: dict[str, dict], path: str | Path, title: str) -> None:
    """Speedup against batch size for several drafters measured in one run: {name: eval.json's `batch`}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (name, batch) in enumerate(batches.items()):
        _plot_batch(ax, batch, f"{name} ", f"C{i}")
    ax.set_title(f"{title}: speedup by batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_batch(ax, batch: dict, name: str = "", color: str = "C0") -> None:
    """Speedup against batch size: measured points, the predicted curve, 1x."""
    sizes = batch["batch_sizes"]
    rows = [batch["per_size"][str(B)] for B in sizes]
    ax.plot(sizes, [r["speedup"] or 0.0 for r in rows], marker="o", color=color, label=f"{name}measured")
    pred = [r["predicted"]["speedup"] or 0.0 for r in rows]
    ax.plot(sizes, pred, ls="--", marker="x", color=color, label=f"{name}predicted")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="batch size", ylabel="speedup vs plain batched", title="speedup by batch size", xticks=sizes
    )
    ax.set_xticklabels([str(B) for B in sizes])
    ax.legend(fontsize=8)


def plot_drafters(results: dict[str, dict], path: str | Path, title: str) -> None:
    """Several drafters measured in one run: acceptance by position (one line each) and speedup (one bar each).
    results: {name: the eval.json-shaped result of one drafter}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        xs = [i + 1 for i, a in enumerate(r["alpha_per_position"]) if a is not None]
        a1.plot(xs, [a for a in r["alpha_per_position"] if a is not None], marker="o", label=name)
    a1.set(xlabel="draft position", ylabel="alpha (conditional acceptance)", ylim=(0, 1), title="acceptance")
    a1.legend(fontsize=8)
    a2.bar(list(results), [r["speedup"] or 0.0 for r in results.values()])
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set(ylabel="speedup over plain (same run)", title=title)
    a2.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RESULT_FILES = ("eval.json", "report.md", "eval.png")
"""What write_outputs puts in an eval folder (a folder holding any of them holds an earlier run's results)."""


def write_outputs(result: dict, out_dir: str | Path) -> None:
    """out_dir/eval.json, report.md, eval.png (each written to a temp name, then renamed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "eval.png", lambda p: plot(result, p))
    atomic_write(out / "eval.json", lambda p: p.write_text(json.dumps(result, indent=2) + "\n"))
    atomic_write(out / "report.md", lambda p: p.write_text(render_markdown(result)))
