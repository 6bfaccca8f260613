"""Hardware cost model, measured: what each part of a speculative step costs on this device at real model sizes,
and the speedup that acceptance profiles measured elsewhere would reach here.

    draftsmith bench cost --shape llama-3.1-8b --out runs/cost.json [--profiles results/profiles/*.json]
    draftsmith bench cost --shape tiny-target --device cpu --out runs/cost-tiny.json     # seconds, CPU

One run measures, on one device:
1. the target's forward over n = 1, 2, 4, ..., 64 new tokens after a 1k-token KV cache, eager (DynamicCache, the
   decoder's default) and compiled (StaticCache + torch.compile: the decoder's `compile` path), through
   `SpeculativeDecoder._forward` (decode.speed.measure_forward_costs);
2. the per-step cost of each drafter kind with a cost model (its record's CostModel: random weights of the
   published shapes, e.g. a 1B-shaped draft LM, Medusa heads, an EAGLE-3 head, a DFlash block drafter, n-gram
   lookup), through its Proposer: propose + advance with `ACCEPT` tokens accepted, host work included;
3. plain decoding tokens/s through `SpeculativeDecoder.generate`, eager and compiled;
4. for each acceptance profile (a `draftsmith eval` eval.json: tau, drafter kind, k, tree options), the speedup
   tau * t_step / (t_draft_step + t_verify(1 + N)) (Leviathan et al. 2023, Thm 3.8 with measured costs,
   decode.speed.StepCosts), where t_step is a plain decoder step and the decoder's host work per step
   (t_step - forward(1)) is added to every verify. The profile's tau was measured on another target: the number
   says what that acceptance would buy at this target's costs, not what this target would accept;
5. with --profile-steps N, N more drafting steps per drafter under torch.profiler (step_profile): wall, host and
   device ms per step and the costliest ops, which say whether a step waits on Python and launches or on the model.
Random weights time like trained ones (dense layers do not depend on the values); acceptance does not, which is
why it comes from profiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftsmith.app.drafters import DRAFTERS, tune_proposer
from draftsmith.app.shapes import DRAFT_FOR, SHAPES, n_params, random_causal_lm
from draftsmith.cpulayout import tune_linears
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposer import Proposer
from draftsmith.decode.rowwise import batched
from draftsmith.decode.speed import StepCosts, measure_forward_costs
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir, write_json, write_text
from draftsmith.kinds import CostSettings, DrafterKind, parse_options
from draftsmith.sampling import SamplingParams

SIZES = (1, 2, 4, 8, 16, 32, 64)
ACCEPT = 2  # draft tokens accepted per measured step (advance work grows with it; 2 is typical of trained drafters)


@dataclass
class BenchArgs:
    shape: str = "llama-3.1-8b"
    """Target shape (draftsmith.app.shapes.SHAPES); the draft LM uses DRAFT_FOR[shape]."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    context: int = 1024
    """Tokens in the KV cache before each timed forward / drafting step."""
    sizes: tuple[int, ...] = SIZES
    reps: int = 10
    compile: str = "inductor"
    """inductor (the decoder's --compile: CUDA graphs where available), a torch.compile backend name (eager,
    aot_eager: the same code path without code generation, for dry runs), or none."""
    drafters: tuple[str, ...] = field(default_factory=lambda: tuple(cost_kinds()))
    """Kinds timed even when no profile names them (default: every kind whose record has a cost model)."""
    k: int = 4
    """Draft depth for drafter timings when no profile asks for another."""
    eagle_draft_vocab: int = 32000
    """EAGLE-3 reduced draft vocabulary (32k as published for Llama-3.1-8B; the smollm2 profiles used 8192)."""
    plain_tokens: int = 64
    """New tokens per plain-decoding tokens/s measurement."""
    budget_s: float = 0.0
    """Stop starting new measurements after this many seconds (0 = no limit); skipped items are listed."""
    profiles: list[str] = field(default_factory=list)
    profile_steps: int = 0
    """After a drafter's timing, this many more steps under torch.profiler: where a step's time goes (host vs
    device, the costliest ops). 0 = none."""


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds, self.skipped = time.perf_counter(), seconds, []

    def ok(self, item: str) -> bool:
        if self.seconds and time.perf_counter() - self.t0 > self.seconds:
            self.skipped.append(item)
            return False
        return True


# -- drafters at real size: each kind's record builds its own (DrafterKind.cost) ---------------------------------
def _cost_kind(kind: str) -> DrafterKind | None:
    """The record whose builder times `kind` (CostModel.timed_as followed: `eagle` -> `eagle3`), or None."""
    rec = DRAFTERS.get(kind)
    if rec is not None and rec.cost is not None and rec.cost.timed_as is not None:
        rec = DRAFTERS.get(rec.cost.timed_as)
    return rec if rec is not None and rec.cost is not None and rec.cost.build is not None else None


def cost_kinds() -> list[str]:
    """Kinds with a cost-model builder of their own (a kind timed as another is timed under that one's name)."""
    return sorted(
        name for name, rec in DRAFTERS.items() if rec.cost is not None and rec.cost.build is not None
    )


def _build(kind: str, target, a: BenchArgs, opts: dict) -> Proposer:
    settings = CostSettings(shape=a.shape, device=a.device, k=a.k, draft_vocab=a.eagle_draft_vocab)
    return _cost_kind(kind).cost.build(target, settings, opts)


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def time_proposer(
    proposer: Proposer,
    target,
    context: int,
    k: int,
    steps: int,
    accept: int = ACCEPT,
    batch: int = 1,
    profile_steps: int = 0,
) -> dict:
    """Seconds per drafting step (propose(k) + advance with `accept` nodes of each row's deepest path) for `batch`
    rows after a `context`-token prompt each, median of `steps` after two warm-ups; and the mean nodes per row.
    profile_steps > 0: that many more steps under torch.profiler, summarised as "profile" (step_profile)."""
    dev = next(target.parameters()).device
    cfg = target.config
    gen = torch.Generator().manual_seed(0)
    # a context that repeats a 64-token pattern: n-gram lookup finds matches (as in code or quoted text); the
    # other drafters' costs do not depend on the token values
    pattern = torch.randint(3, cfg.vocab_size, (64,), generator=gen)
    tokens = pattern.repeat(batch, context // 64 + 2)[:, : context + 1].to(dev)

    def hid(n: int):  # random target states of the right shape: the drafters' costs do not depend on values
        states = [torch.randn(batch, n, cfg.hidden_size, device=dev, dtype=target.dtype) for _ in layers]
        return tuple(states) or None

    proposer = batched(proposer)  # the batch protocol (a single-row kind: one copy per row)
    layers = proposer.hidden_state_layers
    proposer.begin(tokens, hid(context))
    params, draft_gen = SamplingParams(), torch.Generator(device=dev).manual_seed(1)
    times, nodes, committed = [], [], [context + 1] * batch

    def step():
        prop = proposer.propose(k, params, draft_gen)
        paths = [_deepest_path(prop.row_parents(b))[:accept] for b in range(batch)]
        new = torch.empty(batch, 1 + max(len(p) for p in paths), dtype=torch.long)
        for b, path in enumerate(paths):
            committed[b] += len(path) + 1
            new[b] = pattern[(committed[b] - 1) % 64]  # the bonus keeps n-gram lookups on the pattern
            new[b, : len(path)] = prop.tokens[b, path].cpu()
        proposer.advance(paths, new.to(dev), hid(new.shape[1]))
        return prop

    for s in range(steps + 2):
        _sync(dev)
        t0 = time.perf_counter()
        prop = step()
        _sync(dev)
        if s >= 2:
            times.append(time.perf_counter() - t0)
            nodes.append(statistics.mean(prop.row_size(b) for b in range(batch)))
    # every timed step kept: on the first H200 check one drafter's median was 4.5x another's with the same nodes
    res = {"step_s": statistics.median(times), "step_s_all": times, "nodes": statistics.mean(nodes)}
    if profile_steps > 0:
        res["profile"] = step_profile(step, profile_steps, dev)
    return res


def step_profile(step: Callable[[], object], steps: int, dev: torch.device, top: int = 8) -> dict:
    """Run step() `steps` times under torch.profiler -> per step: wall ms (profiler overhead included), the host
    ms of the torch ops and runtime calls (their own time), the device ms of the kernels and copies, aten ops
    dispatched, and the `top` rows by that time. Host ms near wall with device ms far below says the step waits on
    Python and launches, not on the model."""
    act = torch.profiler.ProfilerActivity
    acts = [act.CPU] + ([act.CUDA] if dev.type == "cuda" else [])
    _sync(dev)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        _sync(dev)
    wall = (time.perf_counter() - t0) / steps
    rows = []  # (name, host ms, device ms, calls) per step; an op's own host time, a kernel's own device time
    for e in prof.key_averages():
        # a CPU op's self device time repeats its kernels' rows: device time is counted on the kernels alone
        on_host = e.device_type == torch.autograd.DeviceType.CPU
        host = e.self_cpu_time_total if on_host else 0.0
        device = 0.0 if on_host else e.self_device_time_total
        rows.append((e.key, host / 1e3 / steps, device / 1e3 / steps, e.count / steps))
    ops = [r for r in rows if r[0].startswith("aten::")]
    rows.sort(key=lambda r: r[1] + r[2], reverse=True)
    return {
        "steps": steps,
        "wall_ms": wall * 1e3,
        "host_ms": sum(r[1] for r in rows),
        "device_ms": sum(r[2] for r in rows),
        "aten_ops": sum(r[3] for r in ops),
        "top": [{"op": name, "host_ms": h, "device_ms": d, "calls": c} for name, h, d, c in rows[:top]],
    }


def _deepest_path(parents: Sequence[int]) -> list[int]:
    """Root-to-leaf node indices ending at the first deepest node."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    if not depth:
        return []
    node, path = depth.index(max(depth)), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@torch.inference_mode()
def plain_step_s(decoder: SpeculativeDecoder, context: int, new_tokens: int, reps: int = 2) -> float:
    """Seconds per token of plain decoding through the decoder after a `context`-token prompt, prefill excluded
    (GenerationResult.time_prefill); best of `reps` after one warm-up (which compiles, if any)."""
    vocab = decoder.config.vocab_size
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(2))
    decoder.generate(ids, None, max_new_tokens=new_tokens)
    runs = [decoder.generate(ids, None, max_new_tokens=new_tokens) for _ in range(reps)]
    return min((r.time_total - r.time_prefill) / (len(r.tokens) - 1) for r in runs)


# -- profiles ---------------------------------------------------------------------------------------------------
def load_profile(path: str | Path) -> dict:
    """An eval.json (or its subset: tau, alpha_per_position, conditions.{drafter, drafter_kind, k}) -> profile."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(
            f"profile {p}: not a readable eval.json ({e}); pass a `draftsmith eval` output"
        ) from None
    cond = data.get("conditions") or {}
    missing = [k for k in ("tau",) if k not in data] + [k for k in ("drafter_kind", "k") if k not in cond]
    if missing:
        raise DraftsmithError(
            f"profile {p}: missing {', '.join(missing)}; pass a `draftsmith eval` eval.json"
        )
    rec = _cost_kind(cond["drafter_kind"])
    if rec is None:
        raise DraftsmithError(
            f"profile {p}: drafter kind {cond['drafter_kind']!r} has no cost builder; known: {', '.join(cost_kinds())}"
        )
    kind = rec.name
    # the spec's key=value options (a leading folder, `ngram:` has none, is skipped)
    spec_arg = str(cond.get("drafter", "")).partition(":")[2]
    allowed = {o.name for o in rec.options}
    known = ",".join(o for o in spec_arg.split(",") if "=" in o and o.partition("=")[0] in allowed)
    return {
        "name": data.get("name") or (p.parent.name if p.stem == "eval" else p.stem),
        "kind": kind,
        "k": int(cond["k"]),
        "opts": parse_options(rec.options, known, kind),
        "tau": float(data["tau"]),
        "alpha_per_position": data.get("alpha_per_position"),
        "measured_speedup": data.get("speedup"),
        "measured_on": {key: cond.get(key) for key in ("target", "device", "dtype", "hardware", "date")},
        "source": data.get("source", str(p)),
    }


def predict(profile: dict, forward_s: dict[int, float], step_s: float, draft: dict) -> dict:
    """Speedup of `profile` at these costs: forward_s {n: s} (target forward over n new tokens), step_s (a plain
    decoder step), draft {"step_s", "nodes"} (the drafter at the profile's k)."""
    host = max(step_s - forward_s[1], 0.0)
    nodes = max(float(draft["nodes"]), 1e-9)
    if 1 + nodes > max(forward_s):  # no extrapolation: a forward's cost is not linear in its length
        return {
            "speedup": None,
            "note": f"verify of {1 + nodes:g} tokens exceeds the measured n <= {max(forward_s)}",
        }
    costs = StepCosts(
        step_s=step_s,
        verify_s={float(n): s + host for n, s in forward_s.items() if n > 1},
        draft_s=draft["step_s"] / nodes,
        drafted_per_step=nodes,
    )
    return {
        "speedup": costs.speedup(profile["tau"], nodes),
        "break_even_tau": costs.break_even_tau(nodes),
        "verify_over_step": costs.verify(1 + nodes) / step_s,
        "draft_over_step": draft["step_s"] / step_s,
    }


# -- the run ----------------------------------------------------------------------------------------------------
def run(
    a: BenchArgs,
    progress: Callable[[str], None] = print,
    *,
    modes: Sequence[str] = ("eager", "compiled"),
    prior: dict | None = None,
    on_update: Callable[[dict], None] | None = None,
) -> dict:
    """All measurements of one run -> the result dict (see the module docstring).

    modes: which target paths to time ("compiled" only if a.compile != "none"). prior: an earlier result of the same
    target shape and device to extend (its drafter timings are reused, not redone): gpu_check times the eager path
    and the drafters first, trains, and only then spends the compile time. on_update(result) runs after every item,
    so a caller can keep partial results of a run that is cut short."""
    if a.shape not in SHAPES or a.shape not in DRAFT_FOR:
        raise DraftsmithError(f"unknown target shape {a.shape!r}; use one of {', '.join(DRAFT_FOR)}")
    profiles = [load_profile(p) for p in a.profiles]  # bad input fails before any compute
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(
            "--device cuda but CUDA is not available; pass --device cpu (with a tiny shape)"
        )
    budget = Budget(a.budget_s)
    t0 = time.perf_counter()
    target = random_causal_lm(a.shape, device, _dtype(a.dtype))
    layout = tune_linears(target.requires_grad_(False))  # as draftsmith eval loads a target (a no-op on GPUs)
    out: dict = {
        "args": asdict(a),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "target": {"shape": a.shape, "params": n_params(target), "build_s": time.perf_counter() - t0},
        "forward_s": {},
        "plain_step_s": {},
        "drafters": {},
        "skipped": [],
        "cpu_layout": layout,
    }
    for key in ("forward_s", "plain_step_s", "drafters", "skipped"):
        out[key] = {**(prior or {}).get(key, {})} if key != "skipped" else list((prior or {}).get(key, []))
    update = on_update or (lambda res: None)
    progress(f"target {a.shape}: {out['target']['params'] / 1e9:.2f}B params on {out['device']}")
    flags = {
        "eager": False,
        "compiled": None if a.compile == "none" else (a.compile == "inductor" or a.compile),
    }
    for mode in modes:
        if flags[mode] is None or not budget.ok(f"forward/{mode}"):
            continue
        dec = SpeculativeDecoder(target, eos_ids=set(), compile=flags[mode])
        # cudagraph trees record on the 2nd call of a shape and replay from the 3rd: warm up past both
        fw = measure_forward_costs(
            target, a.sizes, a.context, a.reps, decoder=dec, warmup=3 if flags[mode] else 1
        )
        out["forward_s"][mode] = {str(n): s for n, s in fw.items()}
        progress(f"forward {mode}: " + ", ".join(f"n={n} {s * 1e3:.2f} ms" for n, s in fw.items()))
        update(_with_predictions(out, profiles, budget, t0))
        if budget.ok(f"plain/{mode}"):
            out["plain_step_s"][mode] = plain_step_s(dec, a.context, a.plain_tokens)
            progress(f"plain decoding {mode}: {1 / out['plain_step_s'][mode]:.1f} tokens/s")
            update(_with_predictions(out, profiles, budget, t0))
    needs = {(kind, a.k, ()) for kind in a.drafters} | {(p["kind"], p["k"], _opts(p)) for p in profiles}
    built: dict[tuple, Proposer] = {}
    for kind, k, opts in sorted(needs):
        key = _key(kind, opts, k)
        if key in out["drafters"] or not budget.ok(f"drafter/{key}"):
            continue
        if (kind, opts) not in built:
            built[(kind, opts)] = tune_proposer(_build(kind, target, a, dict(opts)))
        res = time_proposer(
            built[(kind, opts)], target, a.context, k, steps=a.reps, profile_steps=a.profile_steps
        )
        out["drafters"][key] = res
        progress(f"drafter {key}: {res['step_s'] * 1e3:.2f} ms/step, {res['nodes']:.1f} nodes")
        update(_with_predictions(out, profiles, budget, t0))
    return _with_predictions(out, profiles, budget, t0)


def _opts(profile: dict) -> tuple:
    return tuple(sorted(profile["opts"].items()))


def _key(kind: str, opts: tuple, k: int) -> str:
    return kind + "".join(f",{o}={v}" for o, v in opts) + f"@k={k}"


def _with_predictions(out: dict, profiles: list[dict], budget: Budget, t0: float) -> dict:
    """`out` with the profiles' predicted speedups for every mode measured so far (recomputed from scratch)."""
    rows = []
    for p in profiles:
        key = _key(p["kind"], _opts(p), p["k"])
        row = {k: p[k] for k in ("name", "kind", "k", "opts", "tau", "measured_speedup", "measured_on")}
        for mode, fw in out["forward_s"].items():
            if key in out["drafters"] and mode in out["plain_step_s"]:
                sizes = {int(n): s for n, s in fw.items()}
                row[mode] = predict(p, sizes, out["plain_step_s"][mode], out["drafters"][key])
        rows.append(row)
    out["profiles"] = rows
    out["skipped"] = sorted(set(out["skipped"]) | set(budget.skipped))
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def markdown(res: dict) -> str:
    """The result as Markdown tables (what gpu_check's report shows)."""
    ms = 1e3
    lines = [
        f"Target `{res['target']['shape']}` ({res['target']['params'] / 1e9:.2f}B params, random weights) on "
        f"{res['device']}, {res['args']['dtype']}, KV cache {res['args']['context']} tokens, torch {res['torch']}, "
        f"compile = {res['args']['compile']}.",
        "",
        "| new tokens n | " + " | ".join(f"{m} ms" for m in res["forward_s"]) + " |",
        "|---|" + "---|" * len(res["forward_s"]),
    ]
    for n in res["args"]["sizes"]:
        cells = [f"{res['forward_s'][m].get(str(n), float('nan')) * ms:.2f}" for m in res["forward_s"]]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "| plain decoding | tokens/s |", "|---|---|"]
    lines += [f"| {m} | {1 / s:.1f} |" for m, s in res["plain_step_s"].items()]
    lines += ["", "| drafter (sized for this target) | ms per step | nodes per step |", "|---|---|---|"]
    lines += [f"| {k} | {v['step_s'] * ms:.2f} | {v['nodes']:.1f} |" for k, v in res["drafters"].items()]
    profiled = {k: v["profile"] for k, v in res["drafters"].items() if "profile" in v}
    if profiled:
        lines += [
            "",
            "Where a drafting step's time goes (torch.profiler, per step; host = the torch ops' own CPU time):",
            "",
            "| drafter | wall ms | host ms | device ms | aten ops | costliest ops (host / device ms) |",
            "|---|---|---|---|---|---|",
        ]
        for k, p in profiled.items():
            top = ", ".join(f"{t['op']} {t['host_ms']:.2f}/{t['device_ms']:.2f}" for t in p["top"][:4])
            lines.append(
                f"| {k} | {p['wall_ms']:.2f} | {p['host_ms']:.2f} | {p['device_ms']:.2f} | {p['aten_ops']:.0f} "
                f"| {top} |"
            )
    if res["profiles"]:
        lines += [
            "",
            "Predicted speedup for acceptance profiles measured elsewhere (tau from the profile; every cost from "
            "this run):",
            "",
            "| profile | kind, k | tau | measured speedup there | predicted here, eager | predicted here, compiled |",
            "|---|---|---|---|---|---|",
        ]
        for p in res["profiles"]:
            pred = [
                f"{p[m]['speedup']:.2f}x" if (p.get(m) or {}).get("speedup") else "-"
                for m in ("eager", "compiled")
            ]
            there = f"{p['measured_speedup']:.2f}x" if p.get("measured_speedup") else "-"
            lines.append(
                f"| {p['name']} | {p['kind']}, {p['k']} | {p['tau']:.2f} | {there} | {pred[0]} | {pred[1]} |"
            )
    if res.get("skipped"):
        lines += ["", f"Skipped (time budget): {', '.join(res['skipped'])}."]
    return "\n".join(lines) + "\n"


def add_common_arguments(ap: argparse.ArgumentParser, defaults) -> None:
    """The options both cost benchmarks take (this one and costbatch): defaults from their settings dataclass."""
    ap.add_argument("--out", required=True, help="result JSON (a Markdown twin is written beside it)")
    ap.add_argument("--shape", default=defaults.shape, choices=sorted(DRAFT_FOR))
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default: bf16 on CUDA"
    )
    ap.add_argument("--context", type=int, default=defaults.context)
    ap.add_argument("--reps", type=int, default=defaults.reps)
    ap.add_argument("--k", type=int, default=defaults.k)
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument(
        "--profiles", nargs="*", default=[], help="draftsmith eval.json files (acceptance profiles)"
    )


def checked_cli(args: argparse.Namespace) -> tuple[Path, str, str]:
    """Validate the shared options before anything is timed -> (out, device, dtype); raises DraftsmithError."""
    out = Path(args.out)
    if out.exists():
        raise DraftsmithError(f"{out} exists; pass a new --out path (results are never overwritten)")
    check_output_dir(out.parent)  # its folder can be written: checked before the benchmark runs
    if args.context < 1 or args.reps < 1 or args.k < 1:
        raise DraftsmithError("--context, --reps and --k must be >= 1")
    if getattr(args, "profile_steps", 0) < 0:
        raise DraftsmithError("--profile-steps must be >= 0 (0: no profile)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return out, device, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """`draftsmith bench cost`'s options."""
    add_common_arguments(ap, BenchArgs)
    ap.add_argument("--compile", default=BenchArgs.compile, help="inductor | eager | aot_eager | none")
    ap.add_argument("--eagle-draft-vocab", type=int, default=BenchArgs.eagle_draft_vocab)
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="drafting steps per drafter under torch.profiler (0: none)",
    )


def command(args: argparse.Namespace) -> int:
    """`draftsmith bench cost`: bad input is one line and exit 2 before anything is timed."""
    try:
        out, device, dtype = checked_cli(args)
        res = run(
            BenchArgs(
                shape=args.shape,
                device=device,
                dtype=dtype,
                context=args.context,
                reps=args.reps,
                compile=args.compile,
                k=args.k,
                eagle_draft_vocab=args.eagle_draft_vocab,
                budget_s=args.budget_s,
                profiles=list(args.profiles),
                profile_steps=args.profile_steps,
            )
        )
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_result(out, res, markdown(res))
    return 0


def write_result(out: Path, res: dict, md: str) -> None:
    """A benchmark's JSON at `out` and its Markdown twin beside it (atomic writes)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, res)
    write_text(out.with_suffix(".md"), md)
    print(f"wrote {out} and {out.with_suffix('.md')}")
