"""Every shipped distillation recipe loads (strict config) and runs 2 steps on tiny models, then resumes;
the accelerate configs parse; one recipe runs under `accelerate launch` with 2 CPU processes (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftsmith.config import load_config, to_dict
from draftsmith.distill.recipe import DistillConfig, run_distill
from draftsmith.testing import recipe_header
from draftsmith.trainer import make_accelerator

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("heads"))
ACCEL = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, tiny_dirs):
    from draftsmith.selfdistill import generate_dataset

    root = tmp_path_factory.mktemp("recipes")
    f = root / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"Explain step {i} of the plan."}) for i in range(10)))
    return str(generate_dataset(tiny_dirs["target"], str(f), root / "gen", max_new_tokens=6, progress=False))


def test_recipes_exist_and_open_with_launch_command():
    names = {p.name for p in RECIPES}
    assert {
        "smollm2-135m-quickstart.yaml",
        "qwen2.5-7b-to-0.5b-lora.yaml",
        "llama3.1-8b-to-3.2-1b.yaml",
    } <= names
    for p in RECIPES:  # the launch command is in the recipe's opening comment, not anywhere in the file
        assert any("train/distill.py --config recipes/" + p.name in line for line in recipe_header(p)), p.name
    assert {p.stem for p in ACCEL} >= {"single_gpu", "ddp", "fsdp", "zero2", "zero3", "cpu_2proc"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_strictly(recipe):
    cfg = load_config(DistillConfig, recipe)
    assert cfg.train.max_steps > 0 and cfg.output_dir
    text = yaml.safe_load(recipe.read_text())
    assert text["model"]["target"] == cfg.model.target  # nothing silently dropped


@pytest.mark.parametrize("path", ACCEL, ids=lambda p: p.stem)
def test_accelerate_configs_parse(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    assert cfg.num_processes >= 1 and str(path.name) in path.read_text().splitlines()[0] + path.read_text()


def test_quickstart_recipe_matches_quickstart_command():
    from draftsmith.app.quickstart import FULL, distill_config

    ours = to_dict(distill_config(Path("runs/quickstart"), "smollm2-135m", FULL))
    shipped = to_dict(load_config(DistillConfig, ROOT / "recipes" / "smollm2-135m-quickstart.yaml"))
    assert ours == shipped


def _tiny_overrides(tiny_dirs, gen_dir, out, cfg):
    ov = [
        f"model.target={tiny_dirs['target']}",
        f"data.source={gen_dir}",
        "data.limit=null",
        f"output_dir={out}",
        "data.eval_size=2",
        "data.max_length=48",
        "data.on_policy_max_new_tokens=4",
        "train.batch_size=2",
        "train.grad_accum=1",
        "train.max_steps=2",
        "train.save_every=1",
        "train.eval_every=0",
        "train.warmup_steps=0",
        "train.mixed_precision=no",
        "loss.chunk_size=16",
        "model.dtype=fp32",
    ]
    if cfg.model.init == "existing":
        ov.append(f"model.draft={tiny_dirs['draft']}")
    if cfg.model.init == "shrink" or cfg.model.layers:
        ov.append("model.layers=[0]")
    if cfg.data.target_topk_file:
        ov.append(f"data.target_topk_file={out}-topk.safetensors")
    if cfg.model.vocab_size:
        ov.append("model.vocab_size=64")
    if cfg.eval.train_sample:
        ov.append("eval.train_sample=2")
    return ov


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_two_steps_and_resumes(recipe, tiny_dirs, gen_dir, tmp_path):
    base = load_config(DistillConfig, recipe)
    ov = _tiny_overrides(tiny_dirs, gen_dir, tmp_path / "run", base)
    cfg = load_config(DistillConfig, recipe, ov)
    res = run_distill(cfg, make_accelerator(cfg.train, cpu=True), progress=False)
    assert res["step"] == 2 and (tmp_path / "run" / "final" / "config.json").is_file()
    assert (tmp_path / "run" / "run.yaml").is_file() and (
        tmp_path / "run" / "checkpoints" / "step-0000002"
    ).is_dir()
    cfg3 = load_config(DistillConfig, recipe, ov + ["train.max_steps=3"])
    assert run_distill(cfg3, make_accelerator(cfg3.train, cpu=True), resume=True, progress=False)["step"] == 3


@pytest.mark.slow
def test_two_cpu_processes_with_accelerate_launch(tiny_dirs, gen_dir, tmp_path):
    out = tmp_path / "ddp"
    recipe = ROOT / "recipes" / "smollm2-135m-quickstart.yaml"
    ov = _tiny_overrides(tiny_dirs, gen_dir, out, load_config(DistillConfig, recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "recipes" / "accelerate" / "cpu_2proc.yaml"),
        "--main_process_port",
        "29561",
        str(ROOT / "train" / "distill.py"),
        "--config",
        str(recipe),
        "--no-progress",
        *ov,
        "train.max_steps=3",
        "train.log_every=1",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: step 3" in proc.stdout
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3]  # one writer: the main process
    assert (out / "final" / "model.safetensors").is_file()
    # 2 processes x batch_size 2 = 4 sequences per step: both ranks trained on different batches
    assert all(e["n_tokens"] > 0 for e in events if e["event"] == "train")
