"""Engines x trainers on 2 CPU processes: does each run, resume, match a 1-process run, and write a loadable
final/? Then training tokens/s per engine on the embedded target, 2 processes as a ratio to 1 process, and the
Lightning engine's tokens/s as a ratio to accelerate's on the same runs.

    flock /tmp/coord/heavy.lock draftsmith bench engines [--part matrix|speed|lightning|all] [--steps 8]
    draftsmith bench engines --part lightning --tiny --steps 3    # a check that it runs (no timing)

matrix: tiny random models (draftsmith.testing), 4 steps; the 2-process run (accelerate's engines and Lightning's
DDP) stops at step 2 (checkpoint) and is resumed to step 4 with --resume; its per-step losses are compared with one
process taking both batches of each step (grad_accum 2, same seed), rtol 1e-4 (see tests/test_engines.py for why).
speed: smollm2-135m, distillation of a 4-layer shrunk draft on builtin:train-text, the same global batch in every
run; one process gets 2 threads, two processes 1 thread each (the machine's 2 cores either way). lightning: the same
run under `--engine lightning` and under accelerate, 1 process x 2 threads and 2 DDP processes x 1 thread.
--tiny: the tiny random target instead of smollm2-135m (checks the script, times nothing). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from draftsmith.app.bench.runs import ROOT

ACCEL = ROOT / "recipes" / "accelerate"
TRAINERS = ("distill", "eagle3", "medusa2")
CONFIGS = {
    "ddp": "cpu_2proc.yaml",
    "fsdp": "cpu_fsdp_2proc.yaml",
    "zero2": "cpu_zero2_2proc.yaml",
    "zero3": "cpu_zero3_2proc.yaml",
}


LIGHTNING = {"lightning": 1, "lightning-ddp": 2}  # engine name -> processes


def launch(engine: str | None, script: str, args: list[str], threads: int) -> subprocess.CompletedProcess:
    """One run: engine None = accelerate on one process, a CONFIGS key = `accelerate launch` with its config, a
    LIGHTNING key = `--engine lightning` with that many processes."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    pre, post = [sys.executable], []
    if engine in LIGHTNING:
        post = ["--engine", "lightning", "--devices", str(LIGHTNING[engine])]
    elif engine is not None:
        pre += ["-m", "accelerate.commands.launch", "--config_file", str(ACCEL / CONFIGS[engine])]
    cmd = [*pre, str(ROOT / "train" / f"{script}.py"), "--no-progress", *args, *post]
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def events(out: Path) -> list[dict]:
    f = out / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


def losses(out: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(out) if e["event"] == "train"}


def tiny_data(root: Path) -> tuple[str, str]:
    from draftsmith.selfdistill import generate_dataset
    from draftsmith.testing import save_tiny

    target = save_tiny(root / "target", seed=0)
    f = root / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"Explain step {i} of the plan."}) for i in range(18)))
    return str(target), str(
        generate_dataset(str(target), str(f), root / "gen", max_new_tokens=6, progress=False)
    )


def trainer_args(trainer: str, target: str, gen: str, out: Path, steps: int) -> tuple[str, list[str]]:
    common = [f"model.target={target}", f"data.source={gen}", "data.eval_size=2", "data.max_length=48"]
    common += ["train.batch_size=2", f"train.max_steps={steps}", "train.save_every=2", "train.log_every=1"]
    # constant LR: the stopped run (max_steps=2) and its resumption (max_steps=4) share one schedule
    common += [
        "train.warmup_steps=0",
        "train.schedule=constant",
        "train.mixed_precision=no",
        f"output_dir={out}",
    ]
    if trainer == "distill":
        recipe = ROOT / "recipes" / "smollm2-135m-quickstart.yaml"
        extra = ["data.limit=null", "data.cache_target_topk=0", "model.layers=[0]", "model.vocab_size=64"]
        return "distill", ["--config", str(recipe), *common, *extra, "model.dtype=fp32", "train.lr=1e-2"]
    recipe = ROOT / "recipes" / "heads-smollm2-135m-eagle3.yaml"
    extra = [f"head.kind={trainer}", "head.draft_vocab_size=128", "head.aux_layers=0,1,2", "head.num_heads=2"]
    extra += ["loss.ttt_steps=2", "eval.depth=2", "medusa2.lora_r=4", "data.hidden_states=online"]
    extra += ["data.hidden_cache=null", "medusa2.warmup_head_steps=0"]
    return "heads", ["--config", str(recipe), *common, *extra]


def final_loads(trainer: str, final: Path) -> bool:
    try:
        if trainer == "distill":
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(final)
        else:
            from safetensors.torch import load_file

            json.loads((final / "config.json").read_text())
            load_file(str(final / "model.safetensors"))
        return True
    except Exception:  # noqa: BLE001 - any failure to load is the answer
        return False


def matrix(root: Path) -> list[str]:
    target, gen = tiny_data(root)
    rows = [
        "| engine | trainer | runs | resumes (stop at 2, --resume to 4) | matches 1-process loss (rtol 1e-4) | final/ loads |",
        "|---|---|---|---|---|---|",
    ]
    for trainer in TRAINERS:
        script, ref_args = trainer_args(trainer, target, gen, root / f"{trainer}-one", 4)
        ref = launch(None, script, ref_args + ["train.grad_accum=2"], 2)
        assert ref.returncode == 0, ref.stderr[-2000:]
        for engine in (*CONFIGS, "lightning-ddp"):
            out = root / f"{trainer}-{engine}"
            _, args = trainer_args(trainer, target, gen, out, 4)
            first = launch(
                engine, script, [a if a != "train.max_steps=4" else "train.max_steps=2" for a in args], 1
            )
            second = launch(engine, script, args + ["--resume"], 1) if first.returncode == 0 else first
            ours, theirs = losses(out), losses(root / f"{trainer}-one")
            match = sorted(ours) == [1, 2, 3, 4] and all(
                abs(ours[s] - theirs[s]) <= 1e-4 * abs(theirs[s]) for s in ours
            )
            worst = max(
                (abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in ours if s in theirs), default=float("nan")
            )
            err = (
                ""
                if second.returncode == 0
                else " (" + (second.stderr.strip().splitlines() or ["?"])[-1][:80] + ")"
            )
            rows.append(
                f"| {engine} | {trainer} | {'yes' if first.returncode == 0 else 'NO' + err} | "
                f"{'yes' if second.returncode == 0 and 'resuming from' in second.stdout + second.stderr else 'NO' + err} | "
                f"{'yes' if match else 'NO'} (max rel diff {worst:.1e}) | {'yes' if final_loads(trainer, out / 'final') else 'NO'} |"
            )
            print(rows[-1], flush=True)
    return rows


def speed_args(root: Path, steps: int, tiny: bool) -> list[str]:
    """The timed distillation run (the same global batch of 8 sequences per optimizer step in every run)."""
    recipe = ROOT / "recipes" / "smollm2-135m-quickstart.yaml"
    base = [
        "--config",
        str(recipe),
        "data.cache_target_topk=0",
        "train.batch_size=4",
        f"train.max_steps={steps}",
    ]
    base += [
        "train.save_every=0",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_before_training=false",
    ]
    base += ["train.warmup_steps=0", "model.dtype=fp32", "train.mixed_precision=no"]
    if tiny:
        target, gen = tiny_data(root / "tiny")
        return base + [f"model.target={target}", f"data.source={gen}", "data.limit=null", "data.eval_size=2",
                       "data.max_length=48", "model.layers=[0]", "model.vocab_size=64"]  # fmt: skip
    return base + ["data.source=builtin:train-text", "data.limit=400", "data.eval_size=8", "data.max_length=128",
                   "model.vocab_size=8192"]  # fmt: skip


def tokens_per_s(engine: str | None, args: list[str], out: Path, procs: int) -> float | None:
    """Training tokens/s of one run (steps 2.. timed: step 1 warms up); 2 threads per run on the 2-core machine."""
    args = args + [f"output_dir={out}", f"train.grad_accum={2 // procs}"]
    proc = launch(engine, "distill", args, 2 // procs)
    ev = [e for e in events(out) if e["event"] == "train" and e["step"] > 1]
    tps = (
        sum(e["n_tokens"] for e in ev) / sum(e["elapsed_s"] for e in ev)
        if ev and proc.returncode == 0
        else None
    )
    print(engine or "1 process", tps, "" if proc.returncode == 0 else proc.stderr[-500:], flush=True)
    return tps


def speed(root: Path, steps: int, tiny: bool = False) -> list[str]:
    base = speed_args(root, steps, tiny)
    res = {
        engine or "1 process": tokens_per_s(
            engine, base, root / f"speed-{engine or 'one'}", 1 if engine is None else 2
        )
        for engine in (None, *CONFIGS)
    }
    one = res["1 process"]
    rows = ["| engine | processes x threads | train tokens/s | ratio to 1 process |", "|---|---|---|---|"]
    for name, tps in res.items():
        pt = "1 x 2" if name == "1 process" else "2 x 1"
        cell = f"{tps:.0f} | {tps / one:.2f}x" if tps and one else "failed | -"
        rows.append(f"| {name} | {pt} | {cell} |")
    return rows


def lightning_speed(root: Path, steps: int, tiny: bool = False) -> list[str]:
    """Lightning vs accelerate on the same run: one process, and DDP on two."""
    base = speed_args(root, steps, tiny)
    rows = ["| processes x threads | accelerate tokens/s | lightning tokens/s | lightning / accelerate |"]
    rows.append("|---|---|---|---|")
    for procs, (acc, lit) in ((1, (None, "lightning")), (2, ("ddp", "lightning-ddp"))):
        a = tokens_per_s(acc, base, root / f"lspeed-acc-{procs}", procs)
        b = tokens_per_s(lit, base, root / f"lspeed-lit-{procs}", procs)
        ratio = f"{b / a:.2f}x" if a and b else "-"
        rows.append(f"| {procs} x {2 // procs} | {a or 0:.0f} | {b or 0:.0f} | {ratio} |")
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--part", choices=["matrix", "speed", "lightning", "all"], default="all")
    ap.add_argument(
        "--steps", type=int, default=8, help="speed: optimizer steps per run (the first is not timed)"
    )
    ap.add_argument("--tiny", action="store_true", help="speed parts on the tiny random target (no timing)")


def command(a: argparse.Namespace) -> int:
    (ROOT / "runs").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as tmp:
        if a.part in ("speed", "all"):
            print("\n".join(speed(Path(tmp), a.steps, a.tiny)), flush=True)
        if a.part in ("lightning", "all"):
            print("\n".join(lightning_speed(Path(tmp), a.steps, a.tiny)), flush=True)
        if a.part in ("matrix", "all"):
            print("\n".join(matrix(Path(tmp))))
    return 0
