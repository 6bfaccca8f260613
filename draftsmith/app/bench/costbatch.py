"""The cost model across batch sizes: the speedup each acceptance profile would reach at batch B on this device.

    draftsmith bench cost-batch --shape llama-3.1-8b --out runs/costbatch.json --profiles results/profiles/*.json
    draftsmith bench cost-batch --shape tiny-target --device cpu --batch-sizes 1,2,4 --out runs/cb-tiny.json

Speculation pays while a verify forward over B (k + 1) tokens costs little more than a plain step over B tokens;
as B grows the forward turns compute-bound and the gain shrinks (draftsmith eval --batch-size measures that curve on
this machine). At each batch size B one run measures, with random weights of the real shape (costbench):
1. the target forward over B rows of n new tokens after a `context`-token KV cache, n = 1 .. the widest verify a
   profile needs (decode.speed.measure_forward_costs, the decoder's own forward);
2. a plain batched decoding step (SpeculativeDecoder.generate_batch, host work included);
3. each profile's drafter kind at its real size (costbench's builders), drafting for B rows
   (costbench.time_proposer): in one call where the kind batches natively, one call per row otherwise;
then per profile the speedup at every B (costbench.predict: tau t_step / (t_draft + t_verify(1 + N)), with the
decoder's host work per step added to each verify) and where it falls to 1 (decode.batching.break_even). A profile's
tau was measured at batch 1 on another target; batching does not change a row's acceptance (rows are decoded
independently), so only the costs move with B.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from draftsmith.app import costbench
from draftsmith.app.drafters import tune_proposer
from draftsmith.app.shapes import DRAFT_FOR, n_params, random_causal_lm
from draftsmith.cpulayout import tune_linears
from draftsmith.decode.batching import break_even
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.rowwise import RowwiseProposer, batched
from draftsmith.decode.speed import measure_forward_costs
from draftsmith.errors import DraftsmithError
from draftsmith.evalsettings import parse_batch_sizes

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class CurveArgs:
    shape: str = "llama-3.1-8b"
    """Target shape (draftsmith.app.shapes.SHAPES)."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    context: int = 1024
    """Tokens in every row's KV cache before each timed forward / drafting step."""
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    reps: int = 5
    k: int = 4
    """Draft depth of the drafters timed without a profile (`drafters`)."""
    drafters: tuple[str, ...] = field(default_factory=lambda: tuple(costbench.cost_kinds()))
    """Kinds timed at every batch size even when no profile names them (default: every kind with a cost-model
    builder)."""
    eagle_draft_vocab: int = 32000
    plain_tokens: int = 8
    """Plain decoding steps timed per batch size (after one warm-up run)."""
    budget_s: float = 0.0
    """Stop starting new batch sizes after this many seconds (0 = no limit)."""
    profiles: list[str] = field(default_factory=list)


def plain_step_s(decoder: SpeculativeDecoder, batch: int, context: int, new_tokens: int) -> float:
    """Seconds per plain decoding step of `batch` rows after `context`-token prompts, prefill excluded; best of two
    runs after a warm-up."""
    vocab = decoder.config.vocab_size
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, vocab, (context,), generator=g) for _ in range(batch)]
    runs = [decoder.generate_batch(rows, None, max_new_tokens=new_tokens) for _ in range(3)][1:]
    return min((r.time_total - r.time_prefill) / max(len(r.forward_rows) - 1, 1) for r in runs)


def run(
    a: CurveArgs, progress: Callable[[str], None] = print, on_update: Callable[[dict], None] | None = None
):
    """Every batch size in turn (the report is complete up to the last one measured)."""
    if a.shape not in DRAFT_FOR:
        raise DraftsmithError(f"unknown target shape {a.shape!r}; use one of {', '.join(DRAFT_FOR)}")
    profiles = [costbench.load_profile(p) for p in a.profiles]  # bad input fails before any compute
    bench = costbench.BenchArgs(
        shape=a.shape, device=a.device, dtype=a.dtype, k=a.k, eagle_draft_vocab=a.eagle_draft_vocab
    )
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(
            "--device cuda but CUDA is not available; pass --device cpu (with a tiny shape)"
        )
    t0 = time.perf_counter()
    target = random_causal_lm(a.shape, device, costbench._dtype(a.dtype))
    layout = tune_linears(target)
    decoder = SpeculativeDecoder(target, eos_ids=set())
    needs = {(kind, a.k, ()) for kind in a.drafters} | {
        (p["kind"], p["k"], tuple(sorted(p["opts"].items()))) for p in profiles
    }
    needs = {n for n in needs if costbench._cost_kind(n[0]) is not None}  # kinds with a real-size builder
    built = {
        (kind, opts): tune_proposer(costbench._build(kind, target, bench, dict(opts)))
        for kind, _, opts in needs
    }
    out = {
        "args": asdict(a),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "target": {"shape": a.shape, "params": n_params(target)},
        "cpu_layout": layout,
        "per_batch": {},
        "skipped": [],
    }
    for B in a.batch_sizes:
        if a.budget_s and time.perf_counter() - t0 > a.budget_s:
            out["skipped"].append(B)
            continue
        out["per_batch"][str(B)] = _measure_batch(decoder, target, built, needs, a, B, progress)
        out["profiles"] = _curves(out, profiles)
        if on_update:
            on_update(out)
    out["profiles"] = _curves(out, profiles)
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def _measure_batch(decoder, target, built, needs, a: CurveArgs, B: int, progress) -> dict:
    """Every drafter drafting for B rows, then target forwards over B x n tokens for every verify width a drafter
    needs (and a few more, which the cost curve interpolates between), and a plain batched step."""
    entry: dict = {"drafters": {}}
    for kind, k, opts in sorted(needs):
        proposer = batched(built[(kind, opts)])  # single-row kinds draft each row with its own copy
        res = costbench.time_proposer(proposer, target, a.context, k, steps=a.reps, batch=B)
        native = not isinstance(proposer, RowwiseProposer)  # one drafting call for all rows, or one per row
        entry["drafters"][costbench._key(kind, opts, k)] = {**res, "batched": native}
    widest = 1 + math.ceil(max([a.k] + [d["nodes"] for d in entry["drafters"].values()]))
    sizes = sorted({*range(1, a.k + 2), *(n for n in (8, 16, 32, 64) if n < widest), widest})
    fw = measure_forward_costs(target, sizes, a.context, a.reps, decoder=decoder, batch=B)
    entry["forward_s"] = {str(n): s for n, s in fw.items()}
    entry["plain_step_s"] = plain_step_s(decoder, B, a.context, a.plain_tokens)
    progress(
        f"batch {B}: forward n=1 {fw[1] * 1e3:.2f} ms, n={widest} {fw[widest] * 1e3:.2f} ms; plain step "
        f"{entry['plain_step_s'] * 1e3:.2f} ms"
    )
    return entry


def _curves(out: dict, profiles: list[dict]) -> list[dict]:
    """Each profile's predicted speedup at every batch size measured so far, and its break-even batch size."""
    rows = []
    for p in profiles:
        key = costbench._key(p["kind"], tuple(sorted(p["opts"].items())), p["k"])
        curve = {}
        for B, entry in out["per_batch"].items():
            fw = {int(n): s for n, s in entry["forward_s"].items()}
            draft = entry["drafters"].get(key)
            if draft is not None:
                curve[B] = {
                    **costbench.predict(p, fw, entry["plain_step_s"], draft),
                    "draft_batched": draft["batched"],
                }
        sizes = sorted(int(B) for B in curve)
        row = {key: p[key] for key in ("name", "kind", "k", "opts", "tau", "measured_speedup", "measured_on")}
        row["per_batch"] = curve
        row["break_even_batch"] = break_even(sizes, [curve[str(B)].get("speedup") for B in sizes])
        rows.append(row)
    return rows


def markdown(res: dict) -> str:
    """Speedup by batch size per profile (the table gpu_check's report shows)."""
    sizes = list(res["per_batch"])
    lines = [
        f"Target `{res['target']['shape']}` ({res['target']['params'] / 1e9:.2f}B params, random weights) on "
        f"{res['device']}, {res['args']['dtype']}, KV cache {res['args']['context']} tokens per row.",
        "",
        "| batch | forward n=1 ms | plain step ms | "
        + " | ".join(f"{p['name']}" for p in res.get("profiles", []))
        + " |",
        "|---|---|---|" + "---|" * len(res.get("profiles", [])),
    ]
    for B in sizes:
        e = res["per_batch"][B]
        cells = []
        for p in res.get("profiles", []):
            c = p["per_batch"].get(B) or {}
            mark = "" if c.get("draft_batched", True) else "*"
            cells.append(f"{c['speedup']:.2f}x{mark}" if c.get("speedup") else "-")
        lines.append(
            f"| {B} | {e['forward_s']['1'] * 1e3:.2f} | {e['plain_step_s'] * 1e3:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    if res.get("profiles"):
        lines += [
            "",
            "Break-even batch size (predicted speedup 1, log2-interpolated; - = pays at every size):",
            "",
        ]
        lines += [
            f"- {p['name']} ({p['kind']}, k={p['k']}, tau {p['tau']:.2f}): "
            + (f"{p['break_even_batch']:.1f}" if p["break_even_batch"] is not None else "-")
            for p in res["profiles"]
        ]
        lines += [
            "",
            "* the drafter kind drafts one row at a time (decode.rowwise: one drafter call per row, measured).",
        ]
    if res.get("skipped"):
        lines += ["", f"Skipped (time budget): batch sizes {', '.join(map(str, res['skipped']))}."]
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    costbench.add_common_arguments(ap, CurveArgs)
    ap.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))


def command(args: argparse.Namespace) -> int:
    try:
        out, device, dtype = costbench.checked_cli(args)
        a = CurveArgs(
            shape=args.shape,
            device=device,
            dtype=dtype,
            context=args.context,
            batch_sizes=parse_batch_sizes(args.batch_sizes),
            reps=args.reps,
            k=args.k,
            budget_s=args.budget_s,
            profiles=list(args.profiles),
        )
        res = run(a)
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    costbench.write_result(out, res, markdown(res))
    return 0
