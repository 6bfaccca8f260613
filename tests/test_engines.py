"""Every engine the README names, run for real on 2 CPU processes (gloo) through `accelerate launch`.

For each engine and trainer: the per-step loss of a 2-process run equals a 1-process run with the same global batch
and seed (2 processes x grad_accum 1 vs 1 process x grad_accum 2: the same two batches per optimizer step), and
final/ holds the same weights as a plain folder. Tolerance: rtol 1e-4 on losses, atol 1e-5 on weights. The
runs differ only in the order fp32 sums are taken (gloo's all-reduce / reduce-scatter of two per-rank gradients
vs accumulation of two micro-batch gradients in one process); measured differences are <= 4e-6 relative, the
tolerance leaves room for a few Adam steps to amplify them and nothing more (a wrong batch, a gradient not
synchronised or not averaged moves the loss by >1e-2 at step 2). Weights get atol 1e-4: Adam divides by
sqrt(v), so an element whose gradient is ~0 turns rounding into a visible step (seen: 1 of 4096 at 2.3e-5),
while a real error moves most elements by ~lr = 1e-2. A FSDP run killed with SIGKILL resumes to the
same step and loss. DeepSpeed tests need the `deepspeed` extra (skipped without it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from draftsmith.config import load_config

ROOT = Path(__file__).resolve().parents[1]
ACCEL = ROOT / "recipes" / "accelerate"
CONFIGS = {
    "ddp": "cpu_2proc.yaml",
    "fsdp": "cpu_fsdp_2proc.yaml",
    "zero2": "cpu_zero2_2proc.yaml",
    "zero3": "cpu_zero3_2proc.yaml",
}
PORTS = iter(range(29640, 29700))
pytestmark = pytest.mark.slow


def _needs(engine: str) -> None:
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, tiny_dirs):
    from draftsmith.selfdistill import generate_dataset

    root = tmp_path_factory.mktemp("engines")
    f = root / "prompts.jsonl"
    # 18 prompts - 2 held out = 16 examples = 8 batches of 2: an even number per epoch, so one process taking
    # two batches per step and two processes taking one each consume the same batches across epochs
    f.write_text("\n".join(json.dumps({"prompt": f"Explain step {i} of the plan."}) for i in range(18)))
    return str(generate_dataset(tiny_dirs["target"], str(f), root / "gen", max_new_tokens=6, progress=False))


def distill_args(tiny_dirs, gen_dir, out, steps: int) -> list[str]:
    return [
        "--config",
        str(ROOT / "recipes" / "smollm2-135m-quickstart.yaml"),
        f"model.target={tiny_dirs['target']}",
        f"data.source={gen_dir}",
        "data.limit=null",
        "data.eval_size=2",
        "data.max_length=48",
        "data.cache_target_topk=0",
        "model.layers=[0]",
        "model.vocab_size=64",
        "model.dtype=fp32",
        "train.batch_size=2",
        f"train.max_steps={steps}",
        "train.save_every=2",
        "train.log_every=1",
        "train.warmup_steps=0",
        "train.mixed_precision=no",
        "train.lr=1e-2",
        "loss.chunk_size=16",
        f"output_dir={out}",
    ]


def heads_args(tiny_dirs, gen_dir, out, kind: str) -> list[str]:
    return [
        "--config",
        str(ROOT / "recipes" / "heads-smollm2-135m-eagle3.yaml"),
        f"model.target={tiny_dirs['target']}",
        f"data.source={gen_dir}",
        "data.eval_size=2",
        "data.max_length=48",
        "data.hidden_states=online",
        "data.hidden_cache=null",
        f"head.kind={kind}",
        "head.draft_vocab_size=128",
        "head.aux_layers=0,1,2",
        "head.num_heads=2",
        "loss.ttt_steps=2",
        "eval.depth=2",
        "medusa2.warmup_head_steps=1",
        "medusa2.lora_r=4",
        "train.batch_size=2",
        "train.max_steps=3",
        "train.save_every=2",
        "train.log_every=1",
        "train.warmup_steps=0",
        "train.mixed_precision=no",
        f"output_dir={out}",
    ]


def one_process(script: str, args: list[str]) -> None:
    """The reference: the same recipe in this process, 1 process x grad_accum 2."""
    from draftsmith.trainer import make_accelerator

    cfg_path, overrides = args[1], args[2:] + ["train.grad_accum=2"]
    if script == "distill":
        from draftsmith.distill.recipe import DistillConfig, run_distill

        cfg = load_config(DistillConfig, cfg_path, overrides)
        run_distill(cfg, make_accelerator(cfg.train, cpu=True), progress=False)
    else:
        from draftsmith.heads.recipe import HeadsConfig, run_heads

        cfg = load_config(HeadsConfig, cfg_path, overrides)
        run_heads(cfg, make_accelerator(cfg.train, cpu=True), progress=False)


def launch_cmd(engine: str, script: str, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCEL / CONFIGS[engine]),
        "--main_process_port",
        str(next(PORTS)),
        str(ROOT / "train" / f"{script}.py"),
        "--no-progress",
        *args,
    ]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def launch(engine: str, script: str, args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        launch_cmd(engine, script, args), env=ENV, capture_output=True, text=True, timeout=400
    )
    # stdout too: the summary line there tells a rank that aborted after a finished run from one that failed in it
    assert proc.returncode == 0, f"stdout: {proc.stdout[-1000:]}\nstderr: {proc.stderr[-3000:]}"
    return proc


def train_losses(out: Path) -> dict[int, float]:
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["event"] == "train"]
    assert steps == sorted(set(steps)), steps  # one writer, no step logged twice
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


def assert_same_weights(a: Path, b: Path, name: str = "model.safetensors") -> None:
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys()
    for k in wa:
        diff = float((wa[k].float() - wb[k].float()).abs().max())
        assert diff <= 1e-4, f"{name}: {k} differs by {diff}"


def check_final_is_plain_hf(out: Path, ref: Path) -> None:
    """final/: a plain HF folder with whole parameters (no shard), the original architecture name."""
    from transformers import AutoModelForCausalLM

    assert json.loads((out / "final" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert_same_weights(out / "final", ref / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.model.embed_tokens.weight.shape[0] == model.config.vocab_size


# FSDP: test_fsdp_killed_run_resumes_to_same_step_and_loss checks the same and more
@pytest.mark.parametrize("engine", ["ddp", "zero2", "zero3"])
def test_distill_engine_matches_one_process(engine, tiny_dirs, gen_dir, tmp_path):
    _needs(engine)
    ref, out = tmp_path / "one", tmp_path / engine
    one_process("distill", distill_args(tiny_dirs, gen_dir, ref, 4))
    proc = launch(engine, "distill", distill_args(tiny_dirs, gen_dir, out, 4))
    assert "done: step 4" in proc.stdout and proc.stdout.count("done:") == 1  # the main process reports
    assert "Model weights saved" not in proc.stdout + proc.stderr  # accelerate's chatter stays out (no -v)
    ours, theirs = train_losses(out), train_losses(ref)
    assert list(ours) == [1, 2, 3, 4]
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), (step, ours, theirs)
    assert (out / "checkpoints" / "step-0000004" / "trainer_state.json").is_file()
    check_final_is_plain_hf(out, ref)
    if (
        engine == "zero3"
    ):  # final/ (gathered by GatheredParameters) == DeepSpeed's own consolidation of the shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        shards = get_fp32_state_dict_from_zero_checkpoint(
            str(out / "checkpoints" / "step-0000004"), tag="pytorch_model"
        )
        final = load_file(str(out / "final" / "model.safetensors"))
        assert {k.removeprefix("model.") for k in shards} == set(
            final
        )  # DraftLM wraps the HF model as .model
        for k, v in shards.items():
            assert (v == final[k.removeprefix("model.")]).all(), k


@pytest.mark.parametrize("engine,kind", [("fsdp", "eagle3"), ("fsdp", "medusa2"), ("zero3", "medusa2")])
def test_heads_engine_matches_one_process(engine, kind, tiny_dirs, gen_dir, tmp_path):
    _needs(engine)
    ref, out = tmp_path / "one", tmp_path / engine
    # Medusa-2's head-only warm-up leaves the LoRA without gradients; DeepSpeed still takes an Adam step on
    # every parameter of its flat groups (zero gradient, step count +1), torch's AdamW skips them, so the
    # LoRA's bias correction differs once it joins (~0.5% in the loss at step 3). Without warm-up they agree.
    extra = ["medusa2.warmup_head_steps=0"] if engine.startswith("zero") else []
    one_process("heads", heads_args(tiny_dirs, gen_dir, ref, kind) + extra)
    proc = launch(engine, "heads", heads_args(tiny_dirs, gen_dir, out, kind) + extra)
    assert "done: step 3" in proc.stdout
    ours, theirs = train_losses(out), train_losses(ref)
    assert list(ours) == [1, 2, 3]
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), (step, ours, theirs)
    assert_same_weights(out / "final", ref / "final")
    if kind == "medusa2":  # the target's LoRA adapter, trained under the engine too, ships beside the heads
        assert_same_weights(
            out / "final" / "target_lora", ref / "final" / "target_lora", "adapter_model.safetensors"
        )


def test_fsdp_killed_run_resumes_to_same_step_and_loss(tiny_dirs, gen_dir, tmp_path):
    ref, out = tmp_path / "one", tmp_path / "fsdp"
    steps = 30
    one_process("distill", distill_args(tiny_dirs, gen_dir, ref, steps))
    proc = subprocess.Popen(
        launch_cmd("fsdp", "distill", distill_args(tiny_dirs, gen_dir, out, steps)),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while (
        not (out / "checkpoints" / "step-0000004").is_dir() and proc.poll() is None and time.time() < deadline
    ):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run
    proc.wait()
    assert not (out / "final").exists(), "the run finished before it was killed: raise steps"
    killed_at = max(train_losses(out))
    assert killed_at < steps
    launch("fsdp", "distill", distill_args(tiny_dirs, gen_dir, out, steps) + ["--resume"])
    ours, theirs = train_losses(out), train_losses(ref)
    assert list(ours) == list(range(1, steps + 1))  # events after the checkpoint were redone, not duplicated
    for step in ours:  # before the kill, and after the resume
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), (step, ours[step], theirs[step])
    check_final_is_plain_hf(out, ref)


EXIT_SCRIPT = """
import atexit, sys
from draftsmith.launch import exit_process
atexit.register(lambda: print("teardown ran", flush=True))
print("summary", end="")  # buffered: exit_process flushes it
exit_process(int(sys.argv[1]))
"""


@pytest.mark.parametrize("world", ["1", "2"])
def test_exit_process_skips_teardown_only_in_multi_process_runs(world):
    """A rank of a multi-process run leaves without the interpreter's teardown (where gloo's threads can abort
    it), its output flushed and its status kept; a single process ends normally."""
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, "3"],
        env={**ENV, "WORLD_SIZE": world},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith("summary")
    assert ("teardown ran" in proc.stdout) == (world == "1")
