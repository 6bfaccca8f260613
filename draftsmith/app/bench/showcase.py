"""The whole table on the memory-bound embedded target (Qwen2.5-Coder-1.5B-Instruct), rebuilt by one resumable command.

    bash scripts/showcase.sh OUT [--limit 8] [--max-new-tokens 64] [--skip NAME ...] [--dry]

1. data: the target answers builtin:train prompts once (`draftsmith generate`, resumable) -> OUT/data/gen; every
   recipe trains on it (the distill recipes share one top-k score file, the heads one hidden-state cache); its
   32,768 most frequent ids are the reduced output vocabulary OUT/vocab-32k (`draftsmith vocab`).
2. training: every recipe `recipes/qwen2.5-coder-1.5b-*.yaml` and `recipes/heads-qwen2.5-coder-1.5b-*.yaml` whose
   OUT/<name>/final is missing is trained (an unfinished run resumes); then the training-free layer-skip search.
3. one benchmark process: the target loaded once; plain decoding, every trained drafter, `ngram:`, the 0.5B as it
   is, layer skip (at the k its search chose), and every draft LM without a reduced vocabulary again with OUT/vocab-32k (`<name>-vocab32k`:
   FR-Spec's cheaper lm_head, still lossless), that row once more with its step compiled (`<name>-compiled`) and
   compiled over int4 weights (`<name>-compiled-int4`: bits=4, the draft's matmuls read 4-bit weights)
   (draftsmith.decode.evaluate.measure: per prompt, all of them back to back in a rotated order),
   then transformers' `generate`, `assistant_model` (the same 0.5B) and prompt lookup the same way, in one loop
   with draftsmith's plain and `draft:` decoding of the same 0.5B, eager and compiled (the ratios between the two libraries come from
   that loop only); on dev-eval prompts no recipe tuned on. Writes OUT/showcase.json (every number, per prompt),
   OUT/showcase.md (the table: tau, alpha per position, speedup, the drafter's time and FLOP share of a target step,
   lossless) and OUT/showcase.png. A rerun after a stop skips what is done.

--dry checks every recipe (with the OUT paths) and prints the plan; it writes nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.app.bench.runs import ROOT, RecipeRun
from draftsmith.errors import DraftsmithError

TARGET, SMALL = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
GENERATE = ["--prompts", "builtin:train", "--limit", "256", "--max-new-tokens", "160", "--batch-size", "32"]
"""The data every recipe's header names (recipes/qwen2.5-coder-1.5b-*.yaml)."""
SPECS = {
    "distill": ("draft:{final}", 4),
    "eagle3": ("eagle:{final},top_k=1", 3),
    "eagle": ("eagle:{final},top_k=1", 3),
    "dflash": ("dflash:{final}", 4),
    "peagle": ("peagle:{final}", 3),
    "medusa": ("medusa:{final}", 3),
    "medusa2": ("medusa:{final}", 3),
    "earlyexit": ("earlyexit:{final}", 3),
}
"""kind -> (the eval spec of a trained folder, its draft length k): chains, the setting the CPU recipes measured best."""
BASELINES = [("ngram", "ngram:", 4), ("draft-0.5b-as-is", f"draft:{SMALL}", 4)]
LAYERSKIP_K = 3
"""Layer skip's draft length in the plan before the search has run; once OUT/layerskip exists, the bench decodes it
at the k the search measured best (config.json search.k), not at a k it was not chosen for."""
COMPILED = "compiled"
"""Every draft LM's best row (its reduced vocabulary) is benched again with `compile=1` (`<name>-compiled`): its step
as one torch.compile graph (inductor freezing on a CPU), beside the eager one in the same run; and once more with
its matmul weights read as int4 (`<name>-compiled-int4`: bits=4, draftsmith.woq), at INT4_K."""
INT4 = "int4"
INT4_K = 5
"""The int4 draft's draft length: it costs ~0.2 of a target step per token, not ~0.33, which moves the best k up
(RESULTS.md: the 0.5B on the AMX Xeon)."""
VOCAB, VOCAB_SIZE = "vocab-32k", 32768
"""OUT/vocab-32k: the data's most frequent target ids (`draftsmith vocab`), the reduced output vocabulary the bench
gives every full-vocabulary draft LM as a second row (`<name>-vocab32k`: draft:<model>,vocab=OUT/vocab-32k)."""


def recipe_runs(out: Path) -> list[RecipeRun]:
    runs = []
    for path in sorted((ROOT / "recipes").glob(f"{TARGET}-*.yaml")):
        name = path.stem.removeprefix(f"{TARGET}-")
        runs.append(RecipeRun(name, "distill", path, out / name, [
            f"data.source={out / 'data' / 'gen'}", f"data.target_topk_file={out / 'data' / 'target-top64.safetensors'}"]))  # fmt: skip
    for path in sorted((ROOT / "recipes").glob(f"heads-{TARGET}-*.yaml")):
        name = path.stem.removeprefix(f"heads-{TARGET}-")
        runs.append(RecipeRun(name, "heads", path, out / name, [
            f"data.source={out / 'data' / 'gen'}", f"data.hidden_cache={out / 'data' / 'hidden'}"]))  # fmt: skip
    return runs


def drafter_specs(
    out: Path, runs: list[RecipeRun], configs: dict, skip: list[str] = ()
) -> list[tuple[str, str, int]]:
    """(name, spec, k) of every drafter benched: the baselines, every recipe's final/, layer skip; each draft LM
    without a reduced vocabulary of its own also with OUT/vocab-32k (`<name>-vocab32k`), and each draft LM's last row
    again compiled (`<name>-compiled`) and compiled over int4 weights (`<name>-compiled-int4`). --skip names any of
    them."""
    vocab = out / VOCAB
    small = f"draft:{SMALL},vocab={vocab}"
    specs = list(BASELINES) + [("draft-0.5b-as-is-vocab32k", small, 4)]
    specs += _compiled_rows("draft-0.5b-as-is-vocab32k", small, 4)
    for run in runs:
        kind = "distill" if run.trainer == "distill" else configs[run.name].head.kind
        template, k = SPECS[kind]
        specs.append((run.name, template.format(final=run.final), k))
        if kind == "distill" and not configs[run.name].model.vocab_size:
            specs.append((f"{run.name}-vocab32k", f"{template.format(final=run.final)},vocab={vocab}", k))
        if kind == "distill":
            specs += _compiled_rows(*specs[-1])
    specs.append(("layerskip", f"layerskip:{out / 'layerskip'}", layerskip_k(out)))
    return [s for s in specs if s[0] not in skip]


def _compiled_rows(name: str, spec: str, k: int) -> list[tuple[str, str, int]]:
    """A draft LM's row again compiled, and compiled over int4 weights."""
    return [(f"{name}-{COMPILED}", f"{spec},compile=1", k), (f"{name}-{COMPILED}-{INT4}", f"{spec},compile=1,bits=4", INT4_K)]  # fmt: skip


def layerskip_k(out: Path) -> int:
    """The k the layer-skip search in OUT/layerskip chose (LAYERSKIP_K while it has not run)."""
    from draftsmith.checkpoint import read_json

    cfg = out / "layerskip" / "config.json"
    if not cfg.is_file():
        return LAYERSKIP_K
    again = f"move {cfg.parent} away to search again"
    search = read_json(cfg, again).get("search")
    k = search.get("k") if isinstance(search, dict) else None
    if not isinstance(k, int) or k < 1:
        raise DraftsmithError(f"{cfg} has no search.k; {again}")
    return k


def _exists(spec: str) -> bool:
    """A spec whose folders (its path, a vocab= folder) are there; an embedded name or ngram: has none."""
    arg, _, opts = spec.partition(":")[2].partition(",")
    paths = [arg] + [o.partition("=")[2] for o in opts.split(",") if o.startswith("vocab=")]
    return all("/" not in p or Path(p).exists() for p in paths)


def vocab(out: Path) -> None:
    if (out / VOCAB / "draft_vocab.safetensors").is_file():
        print(f"{VOCAB}: done, kept", flush=True)
        return
    cmd = [sys.executable, "-m", "draftsmith.app.cli", "vocab", "--target", TARGET, "--data", str(out / "data" / "gen"),
           "--size", str(VOCAB_SIZE), "--out", str(out / VOCAB)]  # fmt: skip
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise SystemExit("error: building the reduced draft vocabulary failed; rerun the same command")


def generate(out: Path) -> None:
    cmd = [sys.executable, "-m", "draftsmith.app.cli", "generate", "--target", TARGET, *GENERATE]
    print("data:", " ".join(cmd[3:]), flush=True)
    if subprocess.run([*cmd, "--out", str(out / "data" / "gen")], cwd=ROOT).returncode != 0:
        raise SystemExit("error: generating the data failed; rerun the same command to resume it")


def layerskip(out: Path) -> None:
    if (out / "layerskip" / "config.json").is_file():
        print("layerskip: done, kept", flush=True)
        return
    cmd = [
        sys.executable,
        "-m",
        "draftsmith.app.cli",
        "layerskip",
        "--target",
        TARGET,
        "--out",
        str(out / "layerskip"),
    ]
    print("layerskip: searching", flush=True)
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise SystemExit("error: the layer-skip search failed; rerun the same command")


def bench(args, specs: list[tuple[str, str, int]]) -> dict:
    """Drafters (bench.drafters.bench, with FLOP shares) and transformers' peers, in this one process."""
    import torch

    from draftsmith import models
    from draftsmith.app.bench import drafters as bench_drafters
    from draftsmith.app.bench import peers as bench_peers
    from draftsmith.decode.decoder import SpeculativeDecoder
    from draftsmith.prompts import load_prompts, prompt_ids

    tok = models.load_tokenizer(TARGET)
    target = models.load_model(TARGET, inference=True)
    ns = argparse.Namespace(target=TARGET, prompts=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens, dtype=None)  # fmt: skip
    drafters = bench_drafters.bench(ns, specs, target=target, tok=tok, flops=True)
    small = models.load_model(SMALL, inference=True)
    dec = SpeculativeDecoder(target, tok)
    methods = bench_peers.hf_methods(target, tok, dec, small, args.max_new_tokens, pld_tokens=10)
    # draftsmith's plain and `draft:` decoding with the same 0.5B once more, in this loop: the machine's speed drifts
    # over the minutes between the drafters' bench and this one (same-run plain steps of 321 to 517 ms were seen), so
    # draftsmith vs transformers is compared only within one interleaved loop
    k = next(k for name, _, k in BASELINES if name == "draft-0.5b-as-is")
    plain_small = models.load_model(SMALL)  # nn.Linears, for the compiled step (inductor lays them out)
    methods.update(bench_peers.ds_methods(dec, small, k, args.max_new_tokens, compiled_draft=plain_small))
    prompts = load_prompts(args.prompts, limit=args.limit)
    encoded = [
        torch.tensor([prompt_ids(tok, p)]) for p in prompts[:1] + prompts
    ]  # the first one twice: warm-up
    tokens, seconds, same, ties = bench_peers.run_interleaved(methods, encoded, target, torch.device("cpu"))
    peers = {n: {"tokens_per_s": tokens[n] / seconds[n], "identical_to_hf_plain": same[n], "near_ties": ties[n]}
             for n in methods}  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d"),
        "drafters": drafters,
        "peers": peers,
        "n_prompts": len(prompts),
    }


def report(res: dict) -> str:
    d = res["drafters"]
    c = next(iter(d["drafters"].values()))["conditions"]
    hf = res["peers"]
    lines = [
        f"# {TARGET}: every drafter against plain decoding, one run ({res['date']})", "",
        f"{c['hardware']}, {c['dtype']}, {c['cpu_layout']}; {res['n_prompts']} prompts of {c['prompts']}, "
        f"{c['max_new_tokens']} new tokens, greedy. tau includes the bonus token. Plain decoding: "
        f"{d['plain_tokens_per_s']:.2f} tokens/s ({d['plain_ms_per_step']:.0f} ms a step); transformers' plain "
        f"generate: {hf['hf_plain']['tokens_per_s']:.2f} tokens/s.", "",
        "| drafter | k | tau | alpha per position | draft time / step per token | its weight share | its FLOP share | speedup | lossless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, r in d["drafters"].items():
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in r["alpha_per_position"])
        cost = "-" if r["draft_cost_per_token"] is None else f"{r['draft_cost_per_token']:.3f}"
        share = "-" if r["draft_flop_share"] is None else f"{r['draft_flop_share']:.3f}"
        weights = "-" if r.get("draft_weight_share") is None else f"{r['draft_weight_share']:.3f}"
        lines.append(f"| {name} | {r['k']} | {r['tau']:.2f} | {alpha} | {cost} | {weights} | {share} | {r['speedup']:.2f}x | {r['lossless']} |")  # fmt: skip
    lines += [
        "",
        "| transformers and draftsmith, one interleaved loop | tokens/s | vs transformers' plain generate | same output as plain generate |",
        "|---|---|---|---|",
    ]  # fmt: skip
    for name, r in hf.items():
        ratio = r["tokens_per_s"] / hf["hf_plain"]["tokens_per_s"]
        lines.append(
            f"| {name} | {r['tokens_per_s']:.2f} | {ratio:.2f}x | {r['identical_to_hf_plain']}/{res['n_prompts']} |"
        )
    tps = {name: r["tokens_per_s"] for name, r in hf.items()}
    lines += [
        "",
        f"draftsmith `draft:` / transformers `assistant_model`, the same 0.5B, same loop: "
        f"{tps['ds_draft'] / tps['hf_assistant']:.2f}x (plain decoding: draftsmith / transformers "
        f"{tps['ds_plain'] / tps['hf_plain']:.2f}x)",
    ]
    if "ds_draft_compiled" in tps:
        lines.append(
            f"draftsmith `draft:...,compile=1` / transformers `assistant_model`: "
            f"{tps['ds_draft_compiled'] / tps['hf_assistant']:.2f}x"
        )
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["drafters"]["drafters"]
    names = list(rows)
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names)), 4))
    ax.bar(names, [rows[n]["speedup"] for n in names])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(
        ylabel="speedup over plain decoding (same run)",
        title=f"{TARGET}, {res['n_prompts']} dev-eval prompts",
    )
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompts", default="builtin:dev-eval")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        help="a recipe not to train or bench, or a drafter not to bench (layerskip, ngram, ...; repeatable)",
    )
    ap.add_argument("--dry", action="store_true")


def command(args: argparse.Namespace) -> int:
    """Bad input: one `error: ...` line, exit status 2, nothing written (a DraftsmithError, which the CLI prints);
    a failed step: one line, status 1 (SystemExit)."""
    from draftsmith.fileio import check_output_dir
    from draftsmith.prompts import load_prompts

    if args.limit < 1 or args.max_new_tokens < 1:
        raise DraftsmithError("--limit and --max-new-tokens must be >= 1")
    load_prompts(args.prompts, limit=args.limit)  # a missing or empty set is refused before hours of training
    check_output_dir(args.out, flag="OUT")  # before any recipe is read or run
    runs = [r for r in recipe_runs(args.out) if r.name not in args.skip]
    configs = {r.name: r.validate() for r in runs}  # every recipe, strictly, before anything is written
    specs = drafter_specs(args.out, runs, configs, args.skip)
    from draftsmith.app.bench.drafters import parse_drafters

    # the specs of folders that training or the layer-skip search will write are checked before the bench
    parse_drafters([f"{n}={s}@{k}" for n, s, k in specs if _exists(s)])
    results = args.out / "showcase.json"
    print(f"{len(runs)} recipes ({sum(r.state() == 'done' for r in runs)} done), {len(specs)} drafters, "
          f"{len(BASELINES)} baselines, then 3 transformers methods beside draftsmith's plain and draft: decoding")  # fmt: skip
    if args.dry:
        for r in runs:
            print(f"  {r.state():6s} {r.name}: {r.config.name} {' '.join(r.overrides)}")
        for n, s, k in specs:
            print(f"  bench {n}: {s} @ k={k}")
        return 0
    if results.is_file():
        raise DraftsmithError(f"{results} exists; move it away to measure again (training stays done)")
    args.out.mkdir(parents=True, exist_ok=True)
    generate(args.out)
    vocab(args.out)
    for i, r in enumerate(runs):
        r.run(label=f"[{i + 1}/{len(runs)}] ")
    if any(n == "layerskip" for n, _, _ in specs):
        layerskip(args.out)
        specs = drafter_specs(args.out, runs, configs, args.skip)  # the k the search chose
    parse_drafters(
        [f"{n}={s}@{k}" for n, s, k in specs]
    )  # every folder is there now: all checked before loading
    res = bench(args, specs)
    from draftsmith.fileio import atomic_write, write_json, write_text

    write_json(results, res)
    write_text(args.out / "showcase.md", report(res))
    atomic_write(args.out / "showcase.png", lambda p: plot(res, p))
    print(report(res))
    return 0
