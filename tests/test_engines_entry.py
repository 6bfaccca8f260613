"""The train/*.py entry scripts as a user meets them: one error line and status 2 with nothing written for a bad
recipe (also under `accelerate launch`, as far as accelerate lets a child decide), identical repeated runs,
and the recipe -> DeepSpeed config mapping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.app.train import MAINS
from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, tiny_dirs):
    from draftsmith.selfdistill import generate_dataset

    root = tmp_path_factory.mktemp("entry")
    f = root / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"Explain step {i} of the plan."}) for i in range(10)))
    return str(generate_dataset(tiny_dirs["target"], str(f), root / "gen", max_new_tokens=6, progress=False))


def distill_ov(tiny_dirs, gen_dir, out) -> list[str]:
    return [
        f"model.target={tiny_dirs['target']}",
        f"data.source={gen_dir}",
        "data.eval_size=2",
        "data.max_length=48",
        "model.init=fresh",
        "model.num_layers=1",
        "model.dtype=fp32",
        "train.batch_size=2",
        "train.max_steps=1",
        "train.log_every=1",
        "train.mixed_precision=no",
        f"output_dir={out}",
    ]


def heads_ov(tiny_dirs, gen_dir, out) -> list[str]:
    return [
        f"model.target={tiny_dirs['target']}",
        f"data.source={gen_dir}",
        "data.eval_size=2",
        "data.max_length=48",
        "data.hidden_states=online",
        "head.kind=eagle3",
        "head.draft_vocab_size=128",
        "head.aux_layers=0,1,2",
        "loss.ttt_steps=2",
        "eval.depth=2",
        "train.batch_size=2",
        "train.max_steps=1",
        "train.log_every=1",
        "train.mixed_precision=no",
        f"output_dir={out}",
    ]


@pytest.mark.parametrize(
    "script,bad,message",
    [
        ("distill", "eval.batch_size=0", "eval.batch_size must be >= 1"),
        ("distill", "data.max_length=1000", "exceeds the target's context (512 tokens"),
        ("heads", "loss.ttt_steps=0", "loss.ttt_steps must be >= 1"),
        ("heads", "data.max_length=1000", "exceeds the target's context (512 tokens"),
    ],
)
def test_bad_recipe_is_one_line_status_2_and_writes_nothing(
    script, bad, message, tiny_dirs, gen_dir, tmp_path, capsys
):
    out = tmp_path / "run"
    ov = (distill_ov if script == "distill" else heads_ov)(tiny_dirs, gen_dir, out)
    assert MAINS[script](["--no-progress", *ov, bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err
    assert not out.exists()  # no run.yaml to block the corrected rerun
    # the corrected rerun then just works
    assert MAINS[script](["--no-progress", *ov]) == 0


@pytest.mark.parametrize("script", ["distill", "heads"])
def test_two_identical_runs_are_identical_from_step_1(script, tiny_dirs, gen_dir, tmp_path):
    # init=fresh drafts and heads draw random weights: the seed must be set before they are built
    from safetensors.torch import load_file

    ov = distill_ov if script == "distill" else heads_ov
    runs = []
    for i, name in enumerate(("a", "b")):
        torch.manual_seed(1000 + i)  # whatever ran before in this process must not matter
        assert MAINS[script](["--no-progress", *ov(tiny_dirs, gen_dir, tmp_path / name)]) == 0
        events = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs.append(([e for e in events if e["event"] == "train"][0]["loss"], tmp_path / name / "final"))
    assert runs[0][0] == runs[1][0]
    wa, wb = (load_file(str(d / "model.safetensors")) for _, d in runs)
    assert all((wa[k] == wb[k]).all() for k in wa)


@pytest.mark.slow
def test_bad_recipe_under_accelerate_launch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    missing = str(tmp_path / "nope.yaml")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd += [str(ROOT / "recipes" / "accelerate" / "cpu_2proc.yaml"), "--main_process_port", "29631"]
    proc = subprocess.run(
        [*cmd, str(ROOT / "train" / "distill.py"), "--config", missing],
        env=env,
        capture_output=True,
        text=True,
    )
    # the children exit 2 after one error line (first process only); accelerate (torchrun) reports the failed
    # children and exits 1 itself: a launcher's status is not the script's to set
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "nope.yaml" in errors[0], proc.stderr[-2000:]
    assert "exitcode: 2" in proc.stderr
    plain = subprocess.run(
        [sys.executable, str(ROOT / "train" / "heads.py"), "--config", missing],
        env=env,
        capture_output=True,
        text=True,
    )
    assert plain.returncode == 2 and plain.stderr.strip().startswith("error: ")


def test_recipe_to_deepspeed_config(monkeypatch):
    pytest.importorskip("deepspeed")
    from draftsmith.engines import deepspeed_plugin_for
    from draftsmith.trainer import TrainArgs

    # what `accelerate launch --config_file recipes/accelerate/zero3.yaml` puts in the environment
    for k, v in {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "auto",
        "ACCELERATE_GRADIENT_CLIPPING": "auto",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
    }.items():
        monkeypatch.setenv(k, v)
    ds = deepspeed_plugin_for(TrainArgs(grad_accum=4, max_grad_norm=0.5, batch_size=3)).deepspeed_config
    assert ds["zero_optimization"]["stage"] == 3
    assert (
        ds["gradient_accumulation_steps"],
        ds["gradient_clipping"],
        ds["train_micro_batch_size_per_gpu"],
    ) == (4, 0.5, 3)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")  # a launch config that fixes a number
    with pytest.raises(DraftsmithError, match="gradient_accumulation_steps=2 but the recipe says 4"):
        deepspeed_plugin_for(TrainArgs(grad_accum=4))
    for name in (
        "zero2",
        "zero3",
        "cpu_zero2_2proc",
        "cpu_zero3_2proc",
    ):  # shipped configs leave them to the recipe
        text = (ROOT / "recipes" / "accelerate" / f"{name}.yaml").read_text()
        assert "gradient_accumulation_steps: auto" in text and "gradient_clipping: auto" in text


def test_sampling_from_a_sharded_draft_is_refused_at_start(tiny_dirs, gen_dir, tmp_path, monkeypatch):
    from draftsmith.distill import recipe

    cfg = load_config(
        recipe.DistillConfig, None, distill_ov(tiny_dirs, gen_dir, tmp_path / "r") + ["data.policy=mixture"]
    )
    monkeypatch.setattr(recipe, "params_sharded", lambda acc: True)
    monkeypatch.setattr(recipe, "engine_name", lambda acc: "fsdp")
    with pytest.raises(
        DraftsmithError, match="data.policy=mixture samples from the draft, whose parameters fsdp"
    ):
        recipe.run_distill(cfg, object())
    assert not (tmp_path / "r").exists()
