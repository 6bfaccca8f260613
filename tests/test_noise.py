"""What a user sees: `draftsmith eval` (and a command that saves a model) print draftsmith's lines, not library noise.

Each command runs in a fresh interpreter (an import made by another test would hide an import this one makes),
with every Python warning shown (-W default) and the import log on (-X importtime)."""

import json
import subprocess
import sys

import pytest

NOISE = (
    "Setting accelerator to CPU",  # DeepSpeed's accelerator probe: printed when deepspeed is imported
    "`past_key_values` is deprecated",  # transformers' FutureWarning for the old forward argument
    "Passing `generation_config` together with generation-related",
    "Warning",
    "warn(",
)


def _run(args: list[str]) -> tuple[str, set[str]]:
    """(what the command printed, the modules it imported)."""
    cmd = [sys.executable, "-W", "default", "-X", "importtime", "-m", "draftsmith.app.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    imports = {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:")}
    said = proc.stdout + "\n".join(ln for ln in lines if not ln.startswith("import time:"))
    return said, imports


@pytest.mark.parametrize("drafter", ["draft", "ngram:"])
def test_cli_eval_and_save_print_no_library_noise(tiny_dirs, tmp_path, drafter):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The quick brown fox jumps over"}) + "\n")
    spec = f"draft:{tiny_dirs['draft']}" if drafter == "draft" else drafter
    said, imports = _run(["eval", "--target", tiny_dirs["target"], "--drafter", spec, "--prompts", str(prompts),
                          "--max-new-tokens", "6", "--k", "2", "--no-progress", "--out", str(tmp_path / "ev")])  # fmt: skip
    assert "lossless: True" in said
    for noise in NOISE:
        assert noise not in said, noise
    assert "deepspeed" not in imports and "accelerate" in imports
    if drafter == "draft":  # save_pretrained: accelerate's unwrap check imported deepspeed on every save
        said, imports = _run(["export", tiny_dirs["draft"], "--format", "hf", "--out", str(tmp_path / "hf")])
        assert (tmp_path / "hf" / "model.safetensors").is_file()
        for noise in NOISE:
            assert noise not in said, noise
        assert "deepspeed" not in imports


def test_deepspeed_stays_importable_for_the_engines_that_use_it():
    """The deferral only changes how accelerate asks; once deepspeed is loaded its engines are recognised."""
    pytest.importorskip("deepspeed")
    code = (
        "import sys\n"
        "from draftsmith.deferred import defer_deepspeed\n"
        "defer_deepspeed()\n"
        "from accelerate.utils import other\n"
        "assert other.is_deepspeed_available() is False\n"
        "import deepspeed\n"
        "assert other.is_deepspeed_available() is True\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True)
