"""`draftsmith bench engine`: plain and speculative decoding measured inside llama.cpp, beside draftsmith's decoder.

    draftsmith bench engine --target qwen2.5-coder-1.5b --drafter draft:qwen2.5-coder-0.5b --drafter ngram-simple \\
        --prompts shared:dev-eval --limit 8 --max-new-tokens 128 --k 3 --out results/engine

One llama-server per method (plain, then one per drafter) on the same target GGUF, all started before the first
request; every prompt (the same token ids draftsmith's decoder gets) is sent to every server back to back in an order
rotated per prompt, after one warm-up request each. Greedy: top-1 of the raw logits.

Per drafter, from the server's own timings (`predicted_n`, `predicted_ms`, `draft_n`, `draft_n_accepted`):
- tau = tokens per target verify step = (predicted_n - 1) / (predicted_n - 1 - draft_n_accepted): the first token
  comes from the prefill, then each step commits its accepted drafts plus one token of the target's (a step without
  drafts one token), as draftsmith's decoder counts it;
- accept rate = draft_n_accepted / draft_n; tokens/s = predicted_n / predicted_ms (the server's generation time, the
  prompt's prefill apart); speedup = its tokens/s over plain's; a plain step = predicted_ms / (predicted_n - 1);
- the engine's per-drafted-token cost = (ms per speculative step - ms per plain step) / drafted tokens per step: the
  drafter's forward plus the wider verify, as the engine pays them;
- lossless in the engine: the speculative tokens == the plain tokens; where they part, draftsmith.app.bench.
  engine_lossless scores the shared prefix on a plain server through the one-token path and through a replay of the
  speculative run's own verify batches, and the divergence passes as the engine's numerics only when each path
  puts its own run's token first (anything else fails); reported per prompt;
- prediction (draftsmith.decode.speed.StepCosts): the speedup a tau buys given the plain step and the per-drafted-token
  cost. The prompts are split in two folds and each fold is predicted from the other fold's cost, so the prediction
  is not its own measurement; the decoder's tau is priced with the engine's costs the same way;
- consistency gate (with --decoder, drafters with a draftsmith counterpart): draftsmith's decoder on the same prompts
  and k (a chain: EAGLE-3 `top_k=1`); tau in the engine within CONSISTENCY of the decoder's, else the report says
  where they part (per prompt, and whether the two decoded the same tokens: a quantized GGUF does not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from draftsmith import llamacpp, models
from draftsmith.app.bench.engine_lossless import ENGINE_NUMERICS, check_lossless
from draftsmith.app.exporters.gguf import GGUF_TYPES
from draftsmith.decode.speed import StepCosts
from draftsmith.errors import DraftsmithError
from draftsmith.prompts import Prompt, load_prompts, prompt_ids

log = logging.getLogger(__name__)

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
CONSISTENCY = 0.10  # tau in the engine vs the decoder's, relative
RESULT_FILE = "engine.json"


@dataclass
class EngineDrafter:
    """One drafter as llama-server runs it."""

    name: str
    """As given on the command line."""
    flags: list[str]
    """llama-server arguments that turn it on."""
    decoder_spec: str | None
    """The same drafter as draftsmith's decoder spec (None: no counterpart, e.g. llama.cpp's n-gram types)."""


def parse_drafter(spec: str) -> tuple[str, str]:
    """(kind, argument) of an engine drafter spec, refused in one line before anything loads."""
    if spec in NGRAM_TYPES:
        return spec, ""
    kind, _, arg = spec.partition(":")
    if kind not in ("draft", "eagle3", "dflash") or not arg:
        raise DraftsmithError(
            f"engine drafter {spec!r} is not one of draft:MODEL (a draft LM: folder, .gguf or embedded name), "
            f"eagle3:HEAD_DIR, dflash:DIR, {', '.join(NGRAM_TYPES)}"
        )
    return kind, arg


def _gguf_of(model: str) -> Path | None:
    """The GGUF file of a .gguf path or an embedded model, None for a folder."""
    ref = models.resolve(model)
    if ref.kind == "gguf":
        return Path(ref.path) / ref.gguf_file
    if ref.kind == "hub":
        raise DraftsmithError(
            f"{model} is a Hub id; llama.cpp needs a local folder or .gguf: download it first"
        )
    return None


def target_gguf(target: str, workdir: Path, gguf_type: str) -> Path:
    """The target's GGUF: as given (.gguf, embedded name) or converted from its HF folder into `workdir`."""
    found = _gguf_of(target)
    return found or llamacpp.convert(target, workdir / f"target.{gguf_type}.gguf", outtype=gguf_type)


def engine_drafter(spec: str, k: int, target_dir: str | None, workdir: Path, gguf_type: str) -> EngineDrafter:
    """Export the drafter for llama.cpp (a draft folder or EAGLE-3 head through `draftsmith export --format gguf`)
    and the server flags that run it with k draft tokens per step."""
    from draftsmith.app.export import export

    kind, arg = parse_drafter(spec)
    if kind in NGRAM_TYPES:
        return EngineDrafter(spec, ["--spec-type", kind, "--spec-draft-n-max", str(k)], None)
    out = workdir / f"drafter{len(list(workdir.glob('drafter*')))}"
    if kind == "draft":
        file = _gguf_of(arg)
        if file is None:
            export(arg, "gguf", out, gguf_type=gguf_type)
            file = out / json.loads((out / "draftsmith_export.json").read_text())["gguf_file"]
        spec_type, decoder = "draft-simple", f"draft:{arg}"
    else:
        export(arg, "gguf", out, verifier=target_dir, gguf_type=gguf_type)
        file = out / json.loads((out / "draftsmith_export.json").read_text())["gguf_file"]
        spec_type, decoder = (
            ("draft-eagle3", f"eagle3:{arg},top_k=1,total_tokens={k}")
            if kind == "eagle3"
            else ("draft-dflash", f"dflash:{arg}")
        )
    # always k drafts a step (no confidence stop), as the decoder's chain: the two tau are comparable
    flags = ["-md", str(file), "--spec-type", spec_type, "--spec-draft-n-max", str(k)]
    flags += ["--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    return EngineDrafter(spec, flags, decoder)


def _request(url: str, ids: list[int], n: int) -> dict:
    r = llamacpp.complete_ids(url, ids, n)
    t = r.get("timings") or {}
    return {
        "tokens": list(r.get("tokens") or []),
        "predicted_n": int(t.get("predicted_n", 0)),
        "predicted_ms": float(t.get("predicted_ms", 0.0)),
        "prompt_ms": float(t.get("prompt_ms", 0.0)),
        "draft_n": int(t.get("draft_n", 0)),
        "draft_n_accepted": int(t.get("draft_n_accepted", 0)),
    }


def _context(encoded: list[list[int]], max_new_tokens: int) -> int:
    return max(len(ids) for ids in encoded) + max_new_tokens + 64


def run_engine(
    gguf: Path,
    drafters: list[EngineDrafter],
    encoded: list[list[int]],
    max_new_tokens: int,
    threads: int | None,
) -> dict[str, list[dict]]:
    """{method: one row per prompt}: every server up first, a warm-up request each, then every prompt to every
    server back to back, the order rotated per prompt (slow drift of a shared machine hits every method alike)."""
    context = _context(encoded, max_new_tokens)
    methods = [("plain", [])] + [(d.name, d.flags) for d in drafters]
    rows: dict[str, list[dict]] = {name: [] for name, _ in methods}
    with contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                llamacpp.LlamaServer(gguf, alias=name, context=context, threads=threads, extra=flags)
            ).url
            for name, flags in methods
        }
        for name, _ in methods:
            _request(urls[name], encoded[0], min(16, max_new_tokens))
        for i, ids in enumerate(encoded):
            for name, _ in methods[i % len(methods) :] + methods[: i % len(methods)]:
                rows[name].append(_request(urls[name], ids, max_new_tokens))
    return rows


def _steps(row: dict) -> int:
    """Target steps after the prefill's token: each commits its accepted drafts + 1."""
    return max(row["predicted_n"] - 1 - row["draft_n_accepted"], 0)


def _totals(rows: list[dict]) -> dict:
    return {"tokens": sum(r["predicted_n"] for r in rows), "ms": sum(r["predicted_ms"] for r in rows),
            "draft_n": sum(r["draft_n"] for r in rows), "accepted": sum(r["draft_n_accepted"] for r in rows),
            "steps": sum(_steps(r) for r in rows), "after_first": sum(max(r["predicted_n"] - 1, 0) for r in rows)}  # fmt: skip


def engine_costs(spec_rows: list[dict], plain_step_s: float) -> StepCosts | None:
    """The engine's cost model from speculative rows: plain step (measured plainly) + a cost per drafted token
    that holds the drafter's forward and the wider verify (None when nothing was drafted)."""
    t = _totals(spec_rows)
    if t["draft_n"] <= 0 or t["steps"] <= 0:
        return None
    per_step = t["ms"] / 1000.0 / t["steps"]
    drafted = t["draft_n"] / t["steps"]
    return StepCosts(
        step_s=plain_step_s, draft_s=(per_step - plain_step_s) / drafted, drafted_per_step=drafted
    )


def summarize(spec_rows: list[dict], plain_rows: list[dict], k: int) -> dict:
    """The engine's numbers for one drafter over all prompts, with the two-fold prediction of its speedup."""
    p, s = _totals(plain_rows), _totals(spec_rows)
    plain_tps = p["after_first"] / (p["ms"] / 1000.0) if p["ms"] > 0 else 0.0
    spec_tps = s["after_first"] / (s["ms"] / 1000.0) if s["ms"] > 0 else 0.0
    step_s = p["ms"] / 1000.0 / p["steps"] if p["steps"] else 0.0
    costs = engine_costs(spec_rows, step_s)
    out = {
        "k": k,
        "tau": s["after_first"] / s["steps"] if s["steps"] else None,
        "accept_rate": s["accepted"] / s["draft_n"] if s["draft_n"] else None,
        "drafted_per_step": costs.drafted_per_step if costs else 0.0,
        "tokens_per_s": spec_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": spec_tps / plain_tps if plain_tps else None,
        "plain_step_ms": step_s * 1000.0,
        "draft_token_ms": costs.draft_s * 1000.0 if costs else None,
        "lossless": _lossless(spec_rows),
    }
    out["predicted_speedup"] = _two_fold_prediction(spec_rows, step_s)
    return out


def _lossless(rows: list[dict]) -> dict:
    div = [r["divergence"] for r in rows if "divergence" in r]
    numerics = sum(1 for d in div if d["verdict"] == ENGINE_NUMERICS)
    return {"identical": len(rows) - len(div), "engine_numerics": numerics, "differ": len(div) - numerics,
            "passed": len(div) == numerics, "of": len(rows)}  # fmt: skip


def _two_fold_prediction(rows: list[dict], step_s: float) -> float | None:
    """Predicted speedup: each half of the prompts priced with the per-drafted-token cost of the other half and its
    own tau (None with a single prompt or nothing drafted)."""
    folds = [rows[0::2], rows[1::2]]
    if not all(folds):
        return None
    tokens = seconds = 0.0
    for mine, other in ((folds[0], folds[1]), (folds[1], folds[0])):
        costs, t = engine_costs(other, step_s), _totals(mine)
        if costs is None or t["steps"] <= 0:
            return None
        tokens += t["after_first"]
        seconds += t["steps"] * costs.step_cost(t["draft_n"] / t["steps"])
    return (tokens / seconds) * step_s if seconds > 0 else None


def consistency(engine: dict, spec_rows: list[dict], plain_rows: list[dict], decoded: dict) -> dict:
    """Tau in the engine vs draftsmith's decoder on the same prompts and k, and where they part."""
    tau_d = decoded.get("tau")
    tau_e = engine["tau"]
    rel = abs(tau_e - tau_d) / tau_d if tau_e and tau_d else None
    rows = []
    for i, (row, d) in enumerate(zip(spec_rows, decoded.get("prompts") or [])):
        steps = _steps(row)
        rows.append({"prompt": i, "tau_engine": (row["predicted_n"] - 1) / steps if steps else None,
                     "tau_decoder": d.get("tau"), "new_tokens_engine": row["predicted_n"],
                     "new_tokens_decoder": d.get("new_tokens")})  # fmt: skip
    costs = engine_costs(spec_rows, engine["plain_step_ms"] / 1000.0)
    return {
        "tau_decoder": tau_d,
        "tau_engine": tau_e,
        "relative_difference": rel,
        "passed": rel is not None and rel <= CONSISTENCY,
        "decoder_lossless": decoded.get("lossless"),
        # what the decoder's tau buys at the engine's costs (the decoder predicting the engine)
        "predicted_speedup_from_decoder_tau": costs.speedup(tau_d, costs.drafted_per_step)
        if costs and tau_d
        else None,
        "prompts": rows,
    }


def bench(
    target: str,
    drafters: list[str],
    prompts: list[Prompt],
    *,
    k: int = 3,
    max_new_tokens: int = 64,
    decoder: bool = False,
    gguf_type: str = "f16",
    threads: int | None = None,
    target_gguf_file: str | None = None,
) -> dict:
    """Measure every drafter against plain decoding in llama.cpp (and, with `decoder`, draftsmith's decoder on the
    same prompts); returns the engine.json dict. `target`: a .gguf, an embedded name or an HF folder (converted;
    `target_gguf_file` overrides the GGUF served while the folder still serves the decoder and the tokenizer)."""
    for spec in drafters:
        parse_drafter(spec)
    if k < 1 or max_new_tokens < 1:
        raise DraftsmithError(f"--k and --max-new-tokens must be >= 1, got {k} and {max_new_tokens}")
    if not prompts:
        raise DraftsmithError("no prompts to measure; check --prompts / --limit")
    llamacpp.binary("llama-server")
    ref = models.resolve(target)
    target_dir = ref.path if ref.kind == "dir" else None
    if target_gguf_file:
        _check_same_model(target_gguf_file, target)
    tokenizer = models.load_tokenizer(target)
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    with tempfile.TemporaryDirectory(prefix="draftsmith-engine-") as tmp:
        work = Path(tmp)
        gguf = Path(target_gguf_file) if target_gguf_file else target_gguf(target, work, gguf_type)
        if target_dir is None and any(s.startswith(("eagle3:", "dflash:")) for s in drafters):
            target_dir = str(
                models.materialize(ref).path
            )  # the HF copy the converter reads the tokenizer from
        engine_drafters = [engine_drafter(s, k, target_dir, work, gguf_type) for s in drafters]
        rows = run_engine(gguf, engine_drafters, encoded, max_new_tokens, threads)
        checks = check_lossless(
            gguf, {d.name: (gguf, d.flags) for d in engine_drafters}, encoded, rows,
            max_new_tokens=max_new_tokens, context=_context(encoded, max_new_tokens), threads=threads,
        )  # fmt: skip
        for name, parted in checks.items():
            for i, record in parted.items():
                rows[name][i]["divergence"] = record
    result = {
        "engine": "llama.cpp",
        "build": llamacpp.build_info(),
        "target": target,
        "target_gguf": str(gguf),
        "k": k,
        "max_new_tokens": max_new_tokens,
        "threads": threads or os.cpu_count(),
        "n_prompts": len(prompts),
        "drafters": {},
        "rows": rows,
    }
    for d in engine_drafters:
        result["drafters"][d.name] = summarize(rows[d.name], rows["plain"], k)
        if decoder and d.decoder_spec:
            result["drafters"][d.name]["consistency"] = consistency(
                result["drafters"][d.name], rows[d.name], rows["plain"], _decode(target, d.decoder_spec, prompts,
                                                                                  k, max_new_tokens)
            )  # fmt: skip
    return result


def _check_same_model(gguf_file: str, target: str) -> None:
    """--target-gguf must be the target's model: an EAGLE-3 head reading a layer the GGUF lacks aborts the engine,
    and another model's tokens would make the decoder comparison meaningless (layer count and vocabulary checked)."""
    from gguf import GGUFReader

    if not Path(gguf_file).is_file():
        raise DraftsmithError(f"--target-gguf {gguf_file} not found; check the path")
    fields = GGUFReader(gguf_file).fields
    arch = fields["general.architecture"].contents()
    layers = fields[f"{arch}.block_count"].contents() if f"{arch}.block_count" in fields else None
    cfg = models.load_config(target)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if layers is not None and layers != cfg.num_hidden_layers:
        raise DraftsmithError(
            f"--target-gguf {gguf_file} has {layers} layers but {target} has {cfg.num_hidden_layers}; pass a GGUF "
            "of the same model (or leave --target-gguf out to convert it)"
        )


def _decode(target: str, spec: str, prompts: list[Prompt], k: int, max_new_tokens: int) -> dict:
    """draftsmith's decoder on the same prompts: its tau, per-prompt rows with their tokens."""
    from draftsmith.app.evaluate import evaluate
    from draftsmith.evalsettings import EvalSettings

    result = evaluate(target, spec, prompts, EvalSettings(k=k, max_new_tokens=max_new_tokens), progress=False)
    return result


def report_lines(result: dict) -> list[str]:
    """A Markdown table of the engine's numbers, the prediction beside the measurement."""
    lines = [
        f"llama.cpp ({result['build']}), target {result['target']}, k={result['k']}, {result['n_prompts']} prompts "
        f"x {result['max_new_tokens']} tokens greedy, {result['threads']} threads",
        "",
        "| drafter | tau | accept | tok/s | plain tok/s | speedup | predicted | ms/drafted token | lossless |"
        " tau decoder | gate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in result["drafters"].items():
        c = d.get("consistency") or {}
        ll = d["lossless"]
        lines.append(
            f"| {name} | {_f(d['tau'])} | {_f(d['accept_rate'])} | {_f(d['tokens_per_s'], 1)} | "
            f"{_f(d['plain_tokens_per_s'], 1)} | {_f(d['speedup'])} | {_f(d['predicted_speedup'])} | "
            f"{_f(d['draft_token_ms'], 1)} | {ll['identical']}/{ll['of']} identical, {ll['engine_numerics']} "
            f"engine numerics, {ll['differ']} differ | {_f(c.get('tau_decoder'))} | "
            f"{'-' if not c else ('pass' if c['passed'] else 'PARTS')} |"
        )
    parted = [
        (name, i, r["divergence"])
        for name, rows in result["rows"].items()
        for i, r in enumerate(rows)
        if "divergence" in r
    ]
    if parted:
        lines += [
            "",
            "Where a drafter's greedy tokens part from plain decoding (log-prob leads in nats: the plain token's on the "
            "one-token path, the speculative token's on the replayed verify batches):",
            "",
            "| drafter | prompt | at | plain token | speculative token | one-token lead | verify lead | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, i, v in parted:
            why = f" ({v['why']})" if v.get("why") else ""
            lines.append(
                f"| {name} | {i} | {v['at']} | {v['plain_token']} | {v['spec_token']} | {_f(v['one_token_gap'], 3)} "
                f"| {_f(v['verify_gap'], 3)} | {v['verdict']}{why} |"
            )
    return lines


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", required=True, help="target: .gguf, embedded name (qwen2.5-coder-1.5b) or HF folder"
    )
    p.add_argument(
        "--target-gguf", help="serve this GGUF of the target (default: the target's own or converted)"
    )
    p.add_argument(
        "--drafter",
        action="append",
        required=True,
        help=f"draft:MODEL, eagle3:HEAD_DIR, dflash:DIR or one of {', '.join(NGRAM_TYPES)} (repeatable)",
    )
    p.add_argument("--prompts", required=True, help="prompt source (as draftsmith eval --prompts)")
    p.add_argument("--limit", type=int, default=8, help="first N prompts (default 8)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--decoder", action="store_true", help="also run draftsmith's decoder: the consistency gate"
    )
    p.add_argument(
        "--gguf-type", default="f16", choices=GGUF_TYPES, help="type of converted GGUF files (default f16)"
    )
    p.add_argument("--threads", type=int, help="llama.cpp threads (default: every core)")
    p.add_argument("--out", help="folder for engine.json and engine.md (must not hold them already)")


def command(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    if out is not None and any((out / f).exists() for f in (RESULT_FILE, "engine.md")):
        raise DraftsmithError(f"{out} already holds {RESULT_FILE}; choose another --out")
    prompts = load_prompts(args.prompts, limit=args.limit)
    result = bench(args.target, args.drafter, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                   decoder=args.decoder, gguf_type=args.gguf_type, threads=args.threads,
                   target_gguf_file=args.target_gguf)  # fmt: skip
    lines = report_lines(result)
    print("\n".join(lines))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
        (out / "engine.md").write_text("\n".join(lines) + "\n")
    return 0
