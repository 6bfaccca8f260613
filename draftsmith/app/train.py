"""The training entries' main functions: train/distill.py and train/heads.py (accelerate or Lightning) call these,
so tests run them in-process by import and the entry scripts stay two lines of their own.

    accelerate launch train/distill.py --config recipes/smollm2-135m-quickstart.yaml [key.sub=value ...] [--resume]
    accelerate launch train/heads.py --config recipes/heads-smollm2-135m-eagle3.yaml [key.sub=value ...] [--resume]

Everything else lives in draftsmith.distill.recipe and draftsmith.heads.recipe; arguments, logging (-v) and exit
status: draftsmith.launch.
"""

from __future__ import annotations

from functools import partial

from draftsmith.app.drafters import DRAFTERS
from draftsmith.distill.recipe import DistillConfig, run_distill
from draftsmith.heads.recipe import HeadsConfig, run_heads
from draftsmith.launch import train_main

DISTILL_DESCRIPTION = "Distil a draft model from a target (DistillSpec): entry point (accelerate or Lightning), thin on purpose."
HEADS_DESCRIPTION = (
    "Train a head of any kind in draftsmith.heads.kinds on a frozen target (Medusa-2: LoRA target): "
    "entry script, thin."
)


def distill_summary(cfg: DistillConfig, res: dict) -> str:
    held, k = res["eval"].get("heldout", {}), cfg.eval.k
    return (
        f"done: step {res['step']}, held-out alpha {held.get('alpha', float('nan')):.3f}, "
        f"top-1 {held.get('top1', float('nan')):.3f}, predicted tau(k={k}) {held.get(f'tau_k{k}') or float('nan'):.2f} "
        f"-> {res['final_dir']}{_by_margin(held)}{_if_sure(held, k)}{_seen(res['eval'], k)}"
    )


def _seen(evals: dict, k: int) -> str:
    """The same on a sample of the training examples: does the draft learn what it is shown, and carry it over?"""
    seen, held = evals.get("train_sample"), evals.get("heldout", {})
    if not seen:
        return ""
    tau_seen, tau_held = (seen.get("tau_greedy") or {}).get(k), (held.get("tau_greedy") or {}).get(k)
    taus = (
        f", predicted greedy tau(k={k}) {tau_seen:.2f} (held-out {tau_held:.2f})"
        if tau_seen and tau_held
        else ""
    )
    return (
        f"\n  on {seen['n_examples']} training examples: top-1 {seen['top1']:.3f} "
        f"(held-out {held.get('top1', float('nan')):.3f}){taus}"
    )


def _by_margin(held: dict) -> str:
    """Where the greedy misses are: held-out top-1 per bin of the target's own margin p1 - p2 (token counts)."""
    bins = held.get("top1_by_margin")
    if not bins:
        return ""
    parts = [f"{name} {b['top1']:.3f} ({b['n']})" for name, b in bins.items() if b["top1"] is not None]
    return "\n  held-out top-1 by the target's margin p1 - p2: " + ", ".join(parts)


def _if_sure(held: dict, k: int) -> str:
    """What training away the misses where the target is sure can buy: the greedy tau with them turned into hits."""
    now, sure = (held.get("tau_greedy") or {}).get(k), held.get("tau_greedy_if_sure")
    if now is None or not sure:
        return ""
    edges = sorted(sure, key=float, reverse=True)
    return (
        f"\n  predicted greedy tau(k={k}) {now:.2f}; with the misses at a target margin >= {' / '.join(edges)} "
        f"made hits: {' / '.join(f'{sure[m][k]:.2f}' for m in edges)}"
    )


def distill_main(argv: list[str] | None = None) -> int:
    return train_main(
        argv,
        description=DISTILL_DESCRIPTION,
        recipe_hint="recipes/*.yaml",
        config_cls=DistillConfig,
        run_fn=partial(run_distill, kinds=DRAFTERS),  # the drafter table push_to_hub's model card reads
        summary=distill_summary,
    )


def heads_summary(cfg: HeadsConfig, res: dict) -> str:
    ev = res["eval"]
    tau = ev.get("tau_sim", ev.get("tau_tree"))
    return (
        f"done: step {res['step']}, held-out predicted tau {tau if tau is not None else float('nan'):.2f} "
        f"(bonus included; {ev.get('tau_estimate', 'chain')}), cache {res['cache_bytes_per_token']} B/token -> {res['final_dir']}"
    )


def heads_main(argv: list[str] | None = None) -> int:
    return train_main(
        argv,
        description=HEADS_DESCRIPTION,
        recipe_hint="recipes/heads-*.yaml",
        config_cls=HeadsConfig,
        run_fn=run_heads,
        summary=heads_summary,
    )


MAINS = {"distill": distill_main, "heads": heads_main}
"""Entry name (train/<name>.py) -> its main function."""
