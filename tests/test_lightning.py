"""The Lightning engine (`--engine lightning`) against the accelerate engine, on the same recipes, seed and global batch.

Per trainer (distillation, EAGLE-3, DFlash): the same per-step losses (rtol 1e-4) and final/ weights (1e-4) as the
accelerate loop, final/ a folder eval/export read, checkpoints without a pickle; 2 DDP processes (Lightning's own
launcher, gloo) stopped at a checkpoint and resumed against 1 process taking both batches of each step; a run
killed with SIGKILL at a random step resumes to the bit-exact per-step losses and weights of a run that was not.
Tolerances as in tests/test_engines.py (whose run helpers these reuse): one process runs the same float operations
under both engines (they agree exactly here); 2 processes sum the two gradients in another order.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_engines
from safetensors.torch import load_file
from test_engines import ENV, assert_same_weights, distill_args, heads_args, train_losses

from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("distill", "eagle3", "dflash")
gen_dir = test_engines.gen_dir  # the fixture: 16 generated examples, 8 batches of 2 per epoch


def recipe_args(trainer: str, tiny_dirs, gen_dir, out: Path, steps: int) -> tuple[str, list[str]]:
    """(script, argv) of a tiny run of `trainer` (test_engines' recipes) with `steps` optimizer steps."""
    if trainer == "distill":  # TVD for the first 2 steps, then FKL: the loss the trainer's before_step picks
        return "distill", distill_args(tiny_dirs, gen_dir, out, steps) + [
            "loss.warmup_kind=tvd",
            "loss.warmup_steps=2",
        ]
    return "heads", heads_args(tiny_dirs, gen_dir, out, trainer) + [f"train.max_steps={steps}"]


def in_process(script: str, argv: list[str], engine: str) -> dict:
    """The recipe run in this process by `engine` (accelerate on one CPU process, or Lightning)."""
    from draftsmith.lightning_engine import LightningEngine
    from draftsmith.trainer import make_accelerator

    if script == "distill":
        from draftsmith.distill.recipe import DistillConfig as Config
        from draftsmith.distill.recipe import run_distill as run_fn
    else:
        from draftsmith.heads.recipe import HeadsConfig as Config
        from draftsmith.heads.recipe import run_heads as run_fn
    cfg = load_config(Config, argv[1], argv[2:])
    eng = make_accelerator(cfg.train, cpu=True) if engine == "accelerate" else LightningEngine(cfg.train)
    return run_fn(cfg, eng, progress=False)


def cli(script: str, argv: list[str], *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train" / f"{script}.py"), "--no-progress", *argv, *extra]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_lightning_matches_accelerate(trainer, tiny_dirs, gen_dir, tmp_path):
    from draftsmith.checkpoint import read_checkpoint

    # 5 steps x grad_accum 2 = 10 batches of the 8 in an epoch: accumulation, two checkpoints and an epoch boundary
    ref, out = tmp_path / "accelerate", tmp_path / "lightning"
    script, argv = recipe_args(trainer, tiny_dirs, gen_dir, ref, 5)
    in_process(script, argv + ["train.grad_accum=2"], "accelerate")
    script, argv = recipe_args(trainer, tiny_dirs, gen_dir, out, 5)
    res = in_process(script, argv + ["train.grad_accum=2"], "lightning")
    assert res["step"] == 5
    ours, theirs = train_losses(out), train_losses(ref)
    assert list(ours) == [1, 2, 3, 4, 5] and ours[5] != ours[1]
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), (step, ours, theirs)
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ref_events = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [e["step"] for e in ref_events if e["event"] == "eval"]
    assert evals[-1]["step"] == 5 and evals[-1].keys() == ref_events[-1].keys()
    assert all(e["tokens_per_s"] > 0 and e["grad_norm"] > 0 for e in events if e["event"] == "train")
    assert [e["epoch"] for e in events if e["event"] == "train"] == [
        0,
        0,
        0,
        0,
        1,
    ]  # the accelerate loop's epochs
    assert_same_weights(out / "final", ref / "final")
    assert (
        read_checkpoint(out / "final").kind == read_checkpoint(ref / "final").kind
    )  # eval/export read it alike
    # Lightning's CSV logger got every step; checkpoints hold no pickle
    rows = (out / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "loss" in rows[0].split(",") and len(rows) == 6
    files = {p.name for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert files == {"checkpoint.safetensors", "trainer_state.json"}


@pytest.mark.slow
def test_lightning_ddp_two_processes_match_one_process_and_resume(tiny_dirs, gen_dir, tmp_path):
    # 2 processes x grad_accum 1 vs 1 process x grad_accum 2: the same two batches per optimizer step. The DDP run
    # stops at its step-2 checkpoint and is resumed to step 4 (constant LR: both runs share one schedule).
    ref, out = tmp_path / "one", tmp_path / "ddp"
    const = ["train.schedule=constant"]
    script, argv = recipe_args("distill", tiny_dirs, gen_dir, ref, 4)
    in_process(script, argv + const + ["train.grad_accum=2"], "lightning")
    _, argv = recipe_args("distill", tiny_dirs, gen_dir, out, 2)
    for extra in ([], ["train.max_steps=4", "--resume"]):
        proc = subprocess.run(
            cli(script, argv + const + extra, "--engine", "lightning", "--devices", "2"),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.count("done:") == 1  # the main process reports
    ckpt = out / "checkpoints" / "step-0000004" / "checkpoint.safetensors"
    from draftsmith.statefile import load_state

    assert len(load_state(ckpt, part="draftsmith")[0]["rng"]) == 2  # each process's RNG state
    ours, theirs = train_losses(out), train_losses(ref)
    assert list(ours) == [1, 2, 3, 4]
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), (step, ours, theirs)
    assert_same_weights(out / "final", ref / "final")


@pytest.mark.slow
def test_lightning_killed_run_resumes_bit_exact(tiny_dirs, gen_dir, tmp_path):
    # DFlash draws its training anchors from torch's RNG: a resume that lost the RNG state or the data position
    # would show at the first step after it
    steps, kill_at = 40, 2 * random.randint(2, 10)
    ref, out = tmp_path / "straight", tmp_path / "killed"
    script, argv = recipe_args("dflash", tiny_dirs, gen_dir, ref, steps)
    subprocess.run(
        cli(script, argv, "--engine", "lightning"), env=ENV, check=True, capture_output=True, timeout=400
    )
    _, argv = recipe_args("dflash", tiny_dirs, gen_dir, out, steps)
    proc = subprocess.Popen(
        cli(script, argv, "--engine", "lightning"),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not (out / "checkpoints" / f"step-{kill_at:07d}").is_dir() and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists(), (
        f"the run finished before it was killed at step {kill_at}: raise steps"
    )
    killed = max(train_losses(out))
    proc = subprocess.run(
        cli(script, argv, "--engine", "lightning", "--resume"),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = train_losses(out), train_losses(ref)
    assert list(ours) == list(range(1, steps + 1))  # events after the checkpoint were redone, not duplicated
    assert ours == theirs, f"killed after step {killed}, resumed from step {kill_at} or later"
    wa, wb = (
        load_file(str(out / "final" / "model.safetensors")),
        load_file(str(ref / "final" / "model.safetensors")),
    )
    assert all((wa[k] == wb[k]).all() for k in wb)


def test_lightning_command_line_refusals(tiny_dirs, gen_dir, tmp_path, capsys):
    from draftsmith.app.train import distill_main

    out = tmp_path / "run"
    _, argv = recipe_args("distill", tiny_dirs, gen_dir, out, 2)
    for extra, message in (
        (
            ["--engine", "lightning", "--strategy", "fsdp"],
            "for FSDP or DeepSpeed ZeRO use the accelerate engine",
        ),
        (["--engine", "lightning", "--strategy", "deepspeed_stage_3"], "runs auto (one process) or ddp"),
        (["--engine", "lightning", "--devices", "0"], "--devices must be >= 1"),
        (["--devices", "2"], "--strategy/--devices choose Lightning's processes"),
        (["--engine", "jax"], "choose accelerate or lightning"),
    ):
        assert distill_main(["--no-progress", *argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
        assert not out.exists()


def test_lightning_engine_refuses_a_different_grad_accum(tmp_path):
    from draftsmith.lightning_engine import LightningEngine
    from draftsmith.trainer import TrainArgs, run

    engine = LightningEngine(TrainArgs(grad_accum=2))
    with pytest.raises(DraftsmithError, match="built for train.grad_accum=2"):
        run(engine, None, None, [], TrainArgs(grad_accum=1), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_lightning_callbacks_and_loggers_passed_in(tmp_path):
    # a Lightning user's own ModelCheckpoint and logger run beside draftsmith's: their checkpoints go where they
    # say (safetensors folders, not counted among the run's step checkpoints), their logger gets every step
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from test_trainer import Toy, batches, loss_fn

    from draftsmith.lightning_engine import LightningEngine
    from draftsmith.trainer import TrainArgs, list_checkpoints, run

    args = TrainArgs(max_steps=4, save_every=2, log_every=1, lr=0.05)
    theirs = ModelCheckpoint(dirpath=tmp_path / "theirs", every_n_train_steps=1, save_top_k=-1)
    engine = LightningEngine(args, callbacks=[theirs], loggers=[CSVLogger(tmp_path / "logs", name="mine")])
    run(engine, Toy(), loss_fn([]), batches, args, tmp_path / "run", progress=False)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-0000002", "step-0000004"]
    saved = sorted((tmp_path / "theirs").iterdir())
    assert len(saved) == 4 and all((p / "checkpoint.safetensors").is_file() for p in saved)
    rows = (tmp_path / "logs" / "mine" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "loss" in rows[0].split(",") and len(rows) == 5
