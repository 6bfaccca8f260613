"""Drafters side by side (any `draftsmith eval` specs), ONE process, same target, prompts and settings (greedy).

    draftsmith bench drafters --prompts builtin:dev-eval --prompts shared:spec-bench-half --limit 12 \
        --max-new-tokens 64 \
        --drafter eagle3=eagle:runs/heads-eagle3/final,top_k=6,depth=3,total_tokens=10@6 \
        --drafter earlyexit=earlyexit:runs/earlyexit/final,stop_below=0.3@6 \
        --drafter earlyexit-noreuse=earlyexit:runs/earlyexit/final,stop_below=0.3,reuse=0@6 \
        --drafter layerskip=layerskip:runs/layerskip@4

Each `--drafter NAME=SPEC@K` is a `draftsmith eval` drafter spec and its draft length (`@auto` / `@auto:N`: an
adaptive one, each step's from 0 to 6 / N, decode.adaptive, its decisions in bench.json). The measurement is
`draftsmith.decode.evaluate.measure` with every drafter at once (plain decoding and every drafter per prompt, in an
order rotated per prompt, after a warm-up of each; the lossless check with near-ties). Printed per drafter: tau
(bonus included), alpha per position, draft cost per drafted token as a fraction of a plain target step, verify
time per step, with --flops the drafter's weight share (bytes of weights its calls read through matmuls over a
plain step's: its parameter share of the target) and FLOP share (decode.flops) beside that measured cost, speedup
(tokens/s over plain's, same run), extra bytes (tensors the drafter holds that are not the
target's own), lossless (greedy output == plain), tau per prompt group (HumanEval vs chat).
Writes --out/bench.json and bench.png; --profiles-out DIR one costbench profile (an eval.json subset) per drafter.
`--batch-size 1,2,4,8,16` also measures every drafter at every batch size (decode.batching, as `draftsmith eval
--batch-size`): bench.json's `batch` per drafter, a table per drafter and bench-batch.png (scripts/bench_batch.sh).
"""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import replace
from pathlib import Path

import torch

from draftsmith import models
from draftsmith.acceptance import tau_from_accept_lengths
from draftsmith.app.drafters import split_spec, validate_spec
from draftsmith.app.evaluate import ADAPTIVE_KINDS, encode_prompts, load_drafters, run_conditions
from draftsmith.decode.evaluate import measure
from draftsmith.decode.flops import decode_flops
from draftsmith.decode.report import batch_table, plot_batch_curves, plot_drafters
from draftsmith.errors import DraftsmithError
from draftsmith.evalsettings import EvalSettings, parse_batch_sizes, parse_k
from draftsmith.fileio import atomic_write, check_output_dir, write_json
from draftsmith.prompts import load_prompts

BENCH_FILES = ("bench.json", "bench.png", "bench-batch.png")


def extra_bytes(obj, target) -> int:
    """Bytes of the tensors reachable from a proposer's attributes (modules included) that do not live in the
    target's own parameter/buffer storage: what drafting adds to memory beside the target (KV caches excluded)."""
    own = {
        t.untyped_storage().data_ptr() for t in [*target.parameters(), *target.buffers()] if not t.is_mkldnn
    }
    seen: set[int] = set()
    total = 0

    def visit(x, depth=0):
        nonlocal total
        if depth > 4 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor) and x.is_mkldnn:  # a blocked copy (cpulayout): no storage to name
            total += x.numel() * x.element_size()
        elif isinstance(x, torch.Tensor):
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
        # (not a module object: a compiled draft holds inductor's config module)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, types.ModuleType)):
            for k, v in vars(x).items():
                if k not in ("cache", "decoder", "kv", "pending", "seq", "buf"):  # per-sequence state
                    visit(v, depth + 1)

    visit(obj)
    return total


def group(category: str) -> str:
    """HumanEval vs the rest (chat prompts: Vicuna, training-set chat), as the block-drafter comparison reports."""
    return "humaneval" if category == "humaneval" else "chat"


def tau_by_group(rows: list[dict]) -> dict[str, float]:
    """tau per prompt group from a result's per-prompt rows."""
    groups = sorted({group(r["category"]) for r in rows})
    return {
        g: tau_from_accept_lengths([a for r in rows if group(r["category"]) == g for a in r["accepted"]])
        for g in groups
    }


def write_profiles(bench: dict, folder: Path, note: str = "") -> list[Path]:
    """One acceptance profile per drafter of a bench.json (the eval.json subset `draftsmith.app.costbench` reads:
    tau, alpha_per_position, conditions), so the GPU cost model can price what was measured here."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, r in bench["drafters"].items():
        c = r["conditions"]
        prof = {
            "name": name,
            "source": f"draftsmith bench drafters on {c['prompts']} ({c['n_prompts']} prompts, "
            f"{c['max_new_tokens']} tokens, greedy){note}",
            **{key: r[key] for key in ("tau", "speedup", "alpha_per_position", "conditions")},
        }
        paths.append(write_json(folder / f"{name}.json", prof))
    return paths


RESULT_KEYS = (
    "tau",
    "alpha_per_position",
    "speedup",
    "speedup_decode",
    "prefill_s",
    "lossless",
    "lossless_detail",
    "per_category",
)
"""What bench.json keeps of each drafter's measured result (decode.evaluate.measure)."""


def sources(prompts: str | list[str] | None) -> list[str]:
    """--prompts as given once, several times, or not at all (builtin:dev-eval)."""
    if not prompts:
        return ["builtin:dev-eval"]
    return [prompts] if isinstance(prompts, str) else list(prompts)


def parse_drafters(values: list[str], batch: int = 1) -> list[tuple[str, str, int | str]]:
    """`NAME=SPEC@K` strings -> (name, spec, k: an int, or "auto" / "auto:N" as written); checked (kinds, options)
    before anything loads."""
    out = []
    for d in values:
        name, _, rest = d.partition("=")
        spec, _, k = rest.rpartition("@")
        auto = k.startswith("auto")
        if not name or not spec or not (k.isdigit() or auto) or (not auto and int(k) < 1) or name == "plain":
            raise DraftsmithError(
                f"--drafter {d!r} must be NAME=SPEC@K (K >= 1 or auto, NAME not 'plain'), e.g. eagle3=eagle:DIR@6"
            )
        depth, _ = parse_k(k)
        if auto and batch > 1:
            raise DraftsmithError(f"--drafter {d!r}: @auto decodes one prompt at a time; drop --batch-size")
        if auto and split_spec(spec)[0] not in ADAPTIVE_KINDS:
            raise DraftsmithError(
                f"--drafter {d!r}: @auto needs a drafter that skips a step's draft ({', '.join(ADAPTIVE_KINDS)})"
            )
        validate_spec(spec, k=depth, batch=batch)
        out.append((name, spec, k if auto else depth))
    if len({n for n, _, _ in out}) != len(out):
        raise DraftsmithError("--drafter names must be unique")
    return out


def bench(
    args: argparse.Namespace, specs: list[tuple[str, str, int]], target=None, tok=None, flops: bool = False
) -> dict:
    """Load (unless `target`/`tok` are given), measure every drafter and plain decoding in one run, return
    bench.json. `flops`: also count each drafter's FLOPs per drafted token as a share of a plain step
    (decode.flops, one short decode of the first prompt each), beside its measured time share."""
    settings = EvalSettings(
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        k=max(parse_k(str(k))[0] for _, _, k in specs),
        batch_sizes=getattr(args, "batch_sizes", ()),
        sweep_k=getattr(args, "sweep_k", False),
    )
    prompts = [p for source in sources(args.prompts) for p in load_prompts(source, limit=settings.limit)]
    tok = tok or models.load_tokenizer(args.target)
    target = target or models.load_model(args.target, dtype=args.dtype, inference=True)
    named = [(name, spec, *parse_k(str(k))) for name, spec, k in specs]
    dec, drafters = load_drafters(target, tok, named, target_spec=args.target, settings=settings)
    encoded = encode_prompts(dec.max_positions, tok, prompts, settings)
    measured = measure(dec, drafters, prompts, encoded, settings)
    arithmetic = {d.name: decode_flops(dec, d.proposer, encoded[0], k=d.k) for d in drafters} if flops else {}
    plain = measured["plain"]
    rows = {}
    for (name, spec, _), d in zip(specs, drafters):
        r, k = measured["drafters"][name], d.k
        costs = r["costs"] or {}
        verify_s = next(iter((costs.get("verify_s") or {}).values()), None)
        rows[name] = {
            "spec": spec,
            "k": f"auto:{k}" if d.auto else k,
            **{key: r[key] for key in RESULT_KEYS},
            # @auto: the start costs and the decisions (each prompt's own in its row)
            "k_policy": r.get("k_policy"),
            "min_prompt_speedup": min((p["speedup"] for p in r["prompts"] if p["speedup"]), default=None),
            "draft_cost_per_token": costs["draft_s"] / costs["step_s"] if costs else None,
            "draft_flop_share": arithmetic[name]["flop_share"] if name in arithmetic else None,
            "draft_weight_share": arithmetic[name]["weight_share"] if name in arithmetic else None,
            "verify_ms_per_step": 1e3 * verify_s if verify_s is not None else None,
            "extra_bytes": extra_bytes(d.proposer, target),
            "tau_by_group": tau_by_group(r["prompts"]),
            "conditions": run_conditions(
                replace(settings.with_k(k), adaptive_k=d.auto),
                args.target,
                target,
                spec,
                d.proposer,
                source="+".join(sources(args.prompts)),
                n_prompts=len(prompts),
            ),  # fmt: skip
            "prompts": r["prompts"],
            "batch": r.get("batch"),  # --batch-size: decode.batching's curve
        }
    return {
        "target": args.target,
        "plain_ms_per_step": 1e3 * plain["step_s"] if plain["step_s"] else None,
        "plain_tokens_per_s": plain["tokens_per_s"],
        "drafters": rows,
    }


def print_table(out: dict) -> None:
    c = next(iter(out["drafters"].values()))["conditions"]
    print(f"\nplain: {out['plain_tokens_per_s']:.1f} tokens/s, {out['plain_ms_per_step'] or float('nan'):.1f} ms per "
          f"target step ({c['n_prompts']} prompts, {c['hardware']})")  # fmt: skip
    print("| drafter | k | tau | tau chat / humaneval | alpha per position | draft cost / target step | its weight share | "
          "its FLOP share | verify ms/step | speedup | extra MB | lossless |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m, r in out["drafters"].items():
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in r["alpha_per_position"])
        groups = " / ".join(f"{t:.2f}" for t in r["tau_by_group"].values())
        cost = "-" if r["draft_cost_per_token"] is None else f"{r['draft_cost_per_token']:.3f}"
        verify = "-" if r["verify_ms_per_step"] is None else f"{r['verify_ms_per_step']:.1f}"
        share = "-" if r.get("draft_flop_share") is None else f"{r['draft_flop_share']:.3f}"
        weights = "-" if r.get("draft_weight_share") is None else f"{r['draft_weight_share']:.3f}"
        print(f"| {m} | {r['k']} | {r['tau']:.2f} | {groups} | {alpha} | {cost} | {weights} | {share} | {verify} | {r['speedup']:.2f}x | "
              f"{r['extra_bytes'] / 2**20:.1f} | {r['lossless']} |")  # fmt: skip
    print_categories(out)


def print_categories(out: dict) -> None:
    """Per prompt category: speedup end to end and after the prefills, tau; the slowest prompt; an adaptive draft
    length's plain steps."""
    _x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    print("\n| drafter | category | prompts | tau | speedup | after prefill |")
    print("|---|---|---|---|---|---|")
    for m, r in out["drafters"].items():
        for cat, c in r["per_category"].items():
            print(f"| {m} | {cat} | {c['n_prompts']} | {c['tau']:.2f} | {_x(c['speedup'])} | "
                  f"{_x(c.get('speedup_decode'))} |")  # fmt: skip
        line = f"{m}: slowest prompt {_x(r['min_prompt_speedup'])} of plain"
        if r.get("k_policy"):
            pol = r["k_policy"]
            steps = sum(pol["chosen"].values())
            line += f"; k auto: {pol['plain_steps']} of {steps} steps plain, k chosen {pol['chosen']}"
        print(line)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--prompts",
        action="append",
        help="a prompt source (default builtin:dev-eval); repeat to mix sets, e.g. --prompts builtin:dev-eval "
        "--prompts shared:spec-bench-half (results per category)",
    )
    ap.add_argument("--limit", type=int, default=12, help="the first N prompts of each --prompts source")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", action="append", required=True, help="NAME=SPEC@K (repeatable)")
    ap.add_argument("--out", default="runs/bench_drafters")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--profiles-out", default=None, help="also write one costbench profile per drafter here")
    ap.add_argument(
        "--flops", action="store_true", help="also report each drafter's FLOP share of a target step"
    )
    ap.add_argument(
        "--batch-size",
        default=None,
        metavar="B1,B2,..",
        help="also decode the prompts in batches of these sizes (draftsmith eval --batch-size; bench-batch.png)",
    )
    ap.add_argument("--sweep-k", action="store_true", help="with --batch-size: every k from 1 to each K")


def command(args: argparse.Namespace) -> int:
    try:  # before anything loads: bad input fails now, not after the benchmark
        check_output_dir(args.out, BENCH_FILES, overwrite=True)
        if args.profiles_out:
            check_output_dir(args.profiles_out)
        if args.sweep_k and args.batch_size is None:
            raise DraftsmithError("--sweep-k measures draft lengths per batch size; pass --batch-size too")
        args.batch_sizes = parse_batch_sizes(args.batch_size) if args.batch_size is not None else ()
        specs = parse_drafters(args.drafter, max(args.batch_sizes, default=1))
        if args.batch_sizes and max(args.batch_sizes) > args.limit:
            raise DraftsmithError(
                f"--batch-size {max(args.batch_sizes)} needs at least as many prompts; raise --limit "
                f"({args.limit}) or lower the batch size"
            )
        out = bench(args, specs, flops=args.flops)
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "bench.json", out)
    title = f"{args.target}, {next(iter(out['drafters'].values()))['conditions']['n_prompts']} prompts"
    atomic_write(folder / "bench.png", lambda p: plot_drafters(out["drafters"], p, title))
    if args.profiles_out:
        write_profiles(out, Path(args.profiles_out))
    batches = {name: r["batch"] for name, r in out["drafters"].items() if r.get("batch")}
    if batches:
        atomic_write(folder / "bench-batch.png", lambda p: plot_batch_curves(batches, p, title))
        for name, batch in batches.items():
            print(f"\n{name} by batch size (k = {out['drafters'][name]['k']}):\n{batch_table(batch)}")
    print_table(out)
    return 0
