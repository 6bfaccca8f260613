"""draftsmith bench showcase --dry: every Qwen recipe validated with the output paths, the plan printed, nothing written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.app.bench import showcase
from draftsmith.app.cli import main
from draftsmith.errors import DraftsmithError

ROOT = Path(__file__).resolve().parents[1]


def run_showcase(argv: list[str]) -> int:
    return main(["bench", "showcase", *argv])


def test_dry_run_plans_every_recipe_and_drafter(tmp_path, capsys):
    out = tmp_path / "sc"
    assert run_showcase([str(out), "--dry"]) == 0
    text = capsys.readouterr().out
    recipes = sorted((ROOT / "recipes").glob("*qwen2.5-coder-1.5b-*.yaml"))
    assert len(recipes) >= 2 and all(f" {p.name} " in text for p in recipes)
    assert f"data.source={out / 'data' / 'gen'}" in text
    heads = sorted((ROOT / "recipes").glob("heads-qwen2.5-coder-1.5b-*.yaml"))
    assert (
        len(heads) == 5 and text.count(f"data.hidden_cache={out / 'data' / 'hidden'}") == 5
    )  # one shared cache
    for p in heads:
        assert f"bench {p.stem.removeprefix('heads-qwen2.5-coder-1.5b-')}:" in text
    for name in ("ngram", "draft-0.5b-as-is", "layerskip"):
        assert f"bench {name}:" in text
    # a full-vocabulary draft LM is benched again drafting from the data's 32k most frequent ids; the pruned draft
    # has its own reduced vocabulary and is not
    vocab = out / "vocab-32k"
    assert f"bench draft-0.5b-as-is-vocab32k: draft:qwen2.5-coder-0.5b,vocab={vocab} @ k=4" in text
    assert (
        f"bench draft-0.5b-lora-vocab32k: draft:{out / 'draft-0.5b-lora' / 'final'},vocab={vocab} @ k=4"
        in text
    )
    assert "draft-0.5b-pruned-vocab32k" not in text
    # each draft LM's last row again with its step compiled
    assert (
        f"bench draft-0.5b-as-is-vocab32k-compiled: draft:qwen2.5-coder-0.5b,vocab={vocab},compile=1 @ k=4"
        in text
    )
    assert (
        f"bench draft-0.5b-pruned-compiled: draft:{out / 'draft-0.5b-pruned' / 'final'},compile=1 @ k=4"
        in text
    )
    assert (
        f"draft-0.5b-lora-vocab32k-compiled: draft:{out / 'draft-0.5b-lora' / 'final'},vocab={vocab},compile=1"
        in text
    )
    # and compiled over int4 weights, at the int4 draft's own k
    assert (
        f"bench draft-0.5b-as-is-vocab32k-compiled-int4: draft:qwen2.5-coder-0.5b,vocab={vocab},compile=1,bits=4 "
        f"@ k={showcase.INT4_K}" in text
    )
    assert (
        f"bench draft-0.5b-pruned-compiled-int4: draft:{out / 'draft-0.5b-pruned' / 'final'},compile=1,bits=4"
        in text
    )
    assert not out.exists()


def test_a_finished_showcase_is_not_measured_over(tmp_path, capsys):
    out = tmp_path / "sc"
    out.mkdir()
    (out / "showcase.json").write_text("{}")
    assert run_showcase([str(out), "--skip", "draft-0.5b-lora", "--skip", "draft-0.5b-pruned"]) == 2
    err = capsys.readouterr().err
    assert "showcase.json exists" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["showcase.json"]


def test_bad_input_exits_2_from_the_command_line(tmp_path):
    """Through the real entry point: a file where OUT should be a folder is one line, status 2, nothing written (a
    failed training or bench step keeps status 1)."""
    out = tmp_path / "a_file"
    out.write_text("x\n")
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.app.cli", "bench", "showcase", str(out), "--dry"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and "OUT" in proc.stderr
    assert out.read_text() == "x\n" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_skip_leaves_out_a_recipe_and_the_layer_skip_search(tmp_path, capsys):
    out = tmp_path / "sc"
    assert run_showcase([str(out), "--dry", "--skip", "draft-0.5b-lora", "--skip", "layerskip"]) == 0
    text = capsys.readouterr().out
    assert "bench draft-0.5b-pruned:" in text and "bench ngram:" in text
    assert "draft-0.5b-lora" not in text and "layerskip" not in text
    assert run_showcase([str(out), "--dry", "--skip", "draft-0.5b-as-is-vocab32k", "--skip", "ngram"]) == 0
    text = capsys.readouterr().out
    assert (
        "bench draft-0.5b-as-is:" in text
        and "bench draft-0.5b-as-is-vocab32k:" not in text
        and "bench ngram" not in text
    )
    assert "bench draft-0.5b-as-is-vocab32k-compiled:" in text  # a row of its own


def test_report_compares_the_libraries_within_the_loop_only():
    """The draftsmith / transformers ratios come from the interleaved loop (ds_* beside hf_*), not from the drafters'
    bench minutes earlier: here that bench ran at half the speed, and the ratio must not move with it."""
    cond = {"hardware": "CPU", "dtype": "float32", "cpu_layout": "off", "prompts": "p", "max_new_tokens": 8}
    draft = {"k": 4, "tau": 3.0, "alpha_per_position": [0.8, 0.7, None, 0.6], "draft_cost_per_token": 0.4,
             "draft_flop_share": 0.7, "draft_weight_share": 0.3, "speedup": 0.9, "lossless": True, "conditions": cond}  # fmt: skip
    peers = {"hf_plain": 2.0, "hf_assistant": 1.6, "hf_prompt_lookup": 1.5, "ds_plain": 2.2, "ds_draft": 2.0,
             "ds_draft_compiled": 2.4}  # fmt: skip
    res = {
        "date": "2026-12-02",
        "n_prompts": 2,
        "drafters": {
            "plain_tokens_per_s": 1.0,
            "plain_ms_per_step": 1000.0,
            "drafters": {"draft-0.5b-as-is": draft},
        },
        "peers": {
            n: {"tokens_per_s": v, "identical_to_hf_plain": 2, "near_ties": 0} for n, v in peers.items()
        },
    }
    text = showcase.report(res)
    assert "| draft-0.5b-as-is | 4 | 3.00 | 0.80 0.70 - 0.60 |" in text
    assert "| ds_draft | 2.00 | 1.00x | 2/2 |" in text
    assert "same loop: 1.25x (plain decoding: draftsmith / transformers 1.10x)" in text
    assert "`draft:...,compile=1` / transformers `assistant_model`: 1.50x" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--limit", "0"], "--limit and --max-new-tokens"),
        (["--prompts", "/no/such/prompts.jsonl"], "not found"),
    ],
)
def test_bench_settings_are_checked_before_anything_trains(tmp_path, capsys, extra, message):
    out = tmp_path / "sc"
    assert run_showcase([str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1
    assert not out.exists()


def test_layer_skip_is_benched_at_the_k_its_search_chose(tmp_path, capsys):
    """Before the search the plan shows the default k; once OUT/layerskip holds a search, its k is the bench's (a
    search that chose k 2 was benched at k 3 and lost, 0.86x, where it had measured 1.05x at k 2)."""
    out = tmp_path / "sc"
    args = [str(out), "--dry", "--skip", "draft-0.5b-lora", "--skip", "draft-0.5b-pruned"]
    assert run_showcase(args) == 0
    assert (
        f"bench layerskip: layerskip:{out / 'layerskip'} @ k={showcase.LAYERSKIP_K}"
        in capsys.readouterr().out
    )
    (out / "layerskip").mkdir(parents=True)
    cfg = out / "layerskip" / "config.json"
    cfg.write_text(json.dumps({"draftsmith_drafter": "layerskip", "skip_layers": [1], "search": {"k": 2}}))
    assert showcase.layerskip_k(out) == 2
    assert ("layerskip", f"layerskip:{out / 'layerskip'}", 2) in showcase.drafter_specs(out, [], {})
    cfg.write_text(json.dumps({"draftsmith_drafter": "layerskip", "skip_layers": [1], "search": {}}))
    with pytest.raises(DraftsmithError, match="search.k"):
        showcase.layerskip_k(out)
