"""Drafters side by side (any `draftsmith eval` specs), ONE process, same target, prompts and settings (greedy).

    python scripts/bench_drafters.py --prompts builtin:dev-eval --limit 12 --max-new-tokens 64 \
        --drafter eagle3=eagle:runs/heads-eagle3/final,top_k=6,depth=3,total_tokens=10@6 \
        --drafter earlyexit=earlyexit:runs/earlyexit/final,stop_below=0.3@6 \
        --drafter earlyexit-noreuse=earlyexit:runs/earlyexit/final,stop_below=0.3,reuse=0@6 \
        --drafter layerskip=layerskip:runs/layerskip@4

Each `--drafter NAME=SPEC@K` is a `draftsmith eval` drafter spec and its draft length. Per prompt, plain decoding
and every drafter run once, in an order rotated per prompt, after a 16-token warm-up of each (not counted). Printed per
drafter: tau (bonus included), alpha per position, draft cost per drafted token as a fraction of a plain target
step, verify time per step, speedup (tokens/s over plain's, same run), extra bytes (tensors the drafter holds
that are not the target's own), lossless (greedy output == plain), tau per prompt group (HumanEval vs chat).
Writes --out/bench.json and bench.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from draftsmith import models
from draftsmith.acceptance import tau_from_accept_lengths
from draftsmith.app.drafters import build_proposer
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.drafters import DrafterContext
from draftsmith.decode.evaluate import hardware
from draftsmith.decode.metrics import alpha_per_position
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir
from draftsmith.prompts import load_prompts, prompt_ids


def extra_bytes(obj, target) -> int:
    """Bytes of the tensors reachable from a proposer's attributes (modules included) that do not live in the
    target's own parameter/buffer storage: what drafting adds to memory beside the target (KV caches excluded)."""
    own = {t.untyped_storage().data_ptr() for t in [*target.parameters(), *target.buffers()]}
    seen: set[int] = set()
    total = 0

    def visit(x, depth=0):
        nonlocal total
        if depth > 4 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            if ptr not in own and ptr not in seen:
                seen.add(ptr)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, torch.nn.Module):
            if x is target:
                return
            for t in [*x.parameters(), *x.buffers()]:
                visit(t, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v, depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            for k, v in vars(x).items():
                if k not in ("cache", "decoder", "kv", "pending", "seq", "buf"):  # per-sequence state
                    visit(v, depth + 1)

    visit(obj)
    return total


def group(prompt) -> str:
    """HumanEval vs the rest (chat prompts: Vicuna, training-set chat), as the block-drafter comparison reports."""
    return "humaneval" if prompt.category == "humaneval" else "chat"


def tau_of(results) -> float:
    return tau_from_accept_lengths([a for r in results for a in r.accepted])


def tau_by_group(results, groups: list[str]) -> dict[str, float]:
    return {g: tau_of([r for r, gi in zip(results, groups) if gi == g]) for g in sorted(set(groups))}


def write_profiles(bench: dict, folder: Path, note: str = "") -> list[Path]:
    """One acceptance profile per drafter of a bench.json (the eval.json subset `draftsmith.app.costbench` reads:
    tau, alpha_per_position, conditions.drafter/drafter_kind/k), so the GPU cost model can price what was
    measured here."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, r in bench["drafters"].items():
        cond = {
            "drafter": r["spec"],
            "drafter_kind": r["spec"].partition(":")[0],
            "k": r["k"],
            "target": bench["target"],
            "device": "cpu",
            "dtype": bench["dtype"].replace("torch.", ""),
            "hardware": bench.get("hardware"),
            "date": bench.get("date"),
        }
        prof = {"name": name, "source": f"scripts/bench_drafters.py on {bench['prompts']} ({bench['n_prompts']} "
                f"prompts, {bench['max_new_tokens']} tokens, greedy){note}", "tau": r["tau"],
                "speedup": r["speedup"], "alpha_per_position": r["alpha_per_position"], "conditions": cond}  # fmt: skip
        paths.append(folder / f"{name}.json")
        paths[-1].write_text(json.dumps(prof, indent=1) + "\n")
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="builtin:dev-eval")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", action="append", required=True, help="NAME=SPEC@K (repeatable)")
    ap.add_argument("--out", default="runs/bench_drafters")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--profiles-out", default=None, help="also write one costbench profile per drafter here")
    args = ap.parse_args()
    try:  # before anything loads: a bad output folder fails now, not after the benchmark
        check_output_dir(args.out, ("bench.json", "bench.png"), overwrite=True)
        if args.profiles_out:
            check_output_dir(args.profiles_out)
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    warnings.filterwarnings("ignore")
    specs = []
    for d in args.drafter:
        name, _, rest = d.partition("=")
        spec, _, k = rest.rpartition("@")
        if not name or not spec or not k.isdigit():
            raise SystemExit(f"error: --drafter {d!r} must be NAME=SPEC@K, e.g. eagle3=eagle:DIR@6")
        specs.append((name, spec, int(k)))
    tok = models.load_tokenizer(args.target)
    target = models.load_model(args.target, dtype=args.dtype, inference=True)
    dev = next(target.parameters()).device
    ctx = DrafterContext(target=target, tokenizer=tok, device=dev, target_spec=args.target)
    props = {name: (build_proposer(spec, ctx), k) for name, spec, k in specs}
    dec = SpeculativeDecoder(target, tok)
    prompts = load_prompts(args.prompts, limit=args.limit)
    encoded = [torch.tensor([prompt_ids(tok, p)]) for p in prompts]
    methods = ["plain", *props]
    res: dict[str, list] = {m: [] for m in methods}
    for m in methods:  # warm-up (allocator, kernels): the first prompt, 16 tokens, every method; not counted
        p, k = props.get(m, (None, 4))
        dec.generate(encoded[0], p, k=k, max_new_tokens=16)
    t0 = time.time()
    for i, ids in enumerate(encoded):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        for m in order:
            p, k = props.get(m, (None, 4))
            res[m].append(dec.generate(ids, p, k=k, max_new_tokens=args.max_new_tokens))
        print(f"prompt {i + 1}/{len(encoded)} done ({time.time() - t0:.0f} s)", flush=True)
    plain = res["plain"]
    p_tokens = sum(len(r.tokens) for r in plain)
    p_time = sum(r.time_total for r in plain)
    step_s = p_time / max(sum(r.target_forwards for r in plain), 1)  # one plain target step (prefill included)
    rows = {}
    for m, (p, k) in props.items():
        rs = res[m]
        steps = sum(len(r.accepted) for r in rs)
        tokens = sum(len(r.tokens) for r in rs)
        t_total, t_draft = sum(r.time_total for r in rs), sum(r.time_draft for r in rs)
        drafted = sum(sum(r.proposed) for r in rs)
        rows[m] = {
            "spec": next(s for n, s, _ in specs if n == m),
            "k": k,
            "tau": tau_of(rs),
            "alpha_per_position": alpha_per_position(rs, k),
            "draft_cost_per_token": (t_draft / max(drafted, 1)) / step_s,
            "verify_ms_per_step": 1e3 * (t_total - t_draft) / max(steps, 1),
            "speedup": (tokens / t_total) / (p_tokens / p_time),
            "extra_bytes": extra_bytes(p, target),
            "lossless": all(a.tokens == b.tokens for a, b in zip(rs, plain)),
            "tau_by_group": tau_by_group(rs, [group(q) for q in prompts]),
        }
    out = {"target": args.target, "prompts": args.prompts, "n_prompts": len(plain), "max_new_tokens":
           args.max_new_tokens, "dtype": str(target.dtype), "threads": torch.get_num_threads(),
           "hardware": hardware(dev), "date": time.strftime("%Y-%m-%d"), "plain_ms_per_step": 1e3 * step_s, "plain_tokens_per_s": p_tokens / p_time, "drafters": rows}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench.json").write_text(json.dumps(out, indent=1) + "\n")
    if args.profiles_out:
        write_profiles(out, Path(args.profiles_out))
    print(f"\nplain: {p_tokens / p_time:.1f} tokens/s, {1e3 * step_s:.1f} ms per target step ({len(plain)} prompts)")
    print("| drafter | k | tau | tau chat / humaneval | alpha per position | draft cost / target step | verify ms/step | "
          "speedup | extra MB | lossless |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m, r in rows.items():
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in r["alpha_per_position"])
        groups = " / ".join(f"{t:.2f}" for t in r["tau_by_group"].values())
        print(f"| {m} | {r['k']} | {r['tau']:.2f} | {groups} | {alpha} | {r['draft_cost_per_token']:.3f} | "
              f"{r['verify_ms_per_step']:.1f} | {r['speedup']:.2f}x | {r['extra_bytes'] / 2**20:.1f} | {r['lossless']} |")  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for m, r in rows.items():
            xs = [i + 1 for i, a in enumerate(r["alpha_per_position"]) if a is not None]
            a1.plot(xs, [a for a in r["alpha_per_position"] if a is not None], marker="o", label=m)
        a1.set(xlabel="draft position", ylabel="alpha (conditional acceptance)", ylim=(0, 1), title="acceptance")
        a1.legend(fontsize=8)
        a2.bar(list(rows), [r["speedup"] for r in rows.values()])
        a2.axhline(1.0, color="k", lw=0.8)
        a2.set(ylabel="speedup over plain (same run)", title=f"{args.target}, {len(plain)} prompts")
        a2.tick_params(axis="x", labelrotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(Path(args.out) / "bench.png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
