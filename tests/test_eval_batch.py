"""`draftsmith eval --batch-size`: the speedup curve over batch sizes, its report, its one-line errors; the batch cost
model (app.bench.costbatch) on tiny shapes."""

import json

import pytest

from draftsmith.app.cli import main
from draftsmith.decode.batching import break_even, groups


def _prompts(tmp_path, n=3):
    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "The quick brown fox jumps over the lazy dog. The quick", "category": "text"},
        {"prompt": "def add(a, b):\n    return a + b\n\nprint(add(", "category": "code"},
        {"prompt": "Write a short poem about the sea", "category": "text"},
    ][:n]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(f)


def test_eval_batch_sizes_end_to_end(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "ev"
    rc = main(["eval", "--target", tiny_dirs["target"], "--drafter", f"draft:{tiny_dirs['draft']}", "--prompts",
               _prompts(tmp_path), "--k", "2", "--max-new-tokens", "6", "--batch-size", "3,2", "--sweep-k",
               "--out", str(out), "--device", "cpu", "--no-progress"])  # fmt: skip
    assert rc == 0
    res = json.loads((out / "eval.json").read_text())
    batch = res["batch"]
    assert batch["batch_sizes"] == [1, 2, 3] and res["conditions"]["batch_sizes"] == [1, 2, 3]
    assert batch["lossless"] is True
    for B, r in batch["per_size"].items():
        assert r["rows"] == 3 * (B == "1") + 4 * (B == "2") + 3 * (
            B == "3"
        )  # 3 prompts; 2 groups of 2 at B=2
        assert r["identical_rows"] == r["rows"] and r["same_as_batch1"] == r["rows"]
        assert r["tau"] >= 1.0 and r["speedup"] > 0 and r["verify_cost"] > 0
        assert set(r["predicted"]["per_k"]) == {"1", "2"} and r["predicted"]["best_k"] in (1, 2)
        assert set(r["measured_per_k"]) == {"1", "2"} and r["best_k_measured"] in (1, 2)
        assert r["target_rows"]["speculative"] > 0 and set(r["forward_s"]) == {"1", "2", "3"}
    # batch size 1 is the per-prompt run: the same tau as the top-level numbers
    assert batch["per_size"]["1"]["tau"] == pytest.approx(res["tau"])
    md = (out / "report.md").read_text()
    assert "## Batch size" in md and "Break-even batch size" in md and "| 3 |" in md
    assert (out / "eval.png").stat().st_size > 1000
    assert "Break-even" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--batch-size", "0"], "--batch-size must be"),
        (["--batch-size", "1,x"], "--batch-size must be"),
        (["--batch-size", ""], "--batch-size must be"),
        (["--batch-size", "4"], "needs at least as many prompts"),
        (["--sweep-k"], "pass --batch-size"),
        (["--batch-size", "2", "--compile"], "--compile decodes one prompt at a time"),
        (
            ["--drafter", "draft:org/draft,compile=1", "--batch-size", "2"],
            "compile=1 drafts one prompt at a time",
        ),
    ],
)
def test_eval_batch_bad_input_before_anything_loads(tmp_path, capsys, args, msg):
    """A target that does not exist: the batch check must fail first (nothing loads before it)."""
    rc = main(["eval", "--target", str(tmp_path / "no-target"), "--drafter", "ngram:", "--prompts",
               _prompts(tmp_path), "--no-progress", "--out", str(tmp_path / "o"), *args])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err
    assert not (tmp_path / "o").exists()


def test_groups_and_break_even():
    assert groups(5, 2) == [[0, 1], [2, 3], [4, 0]] and groups(4, 4) == [[0, 1, 2, 3]]
    assert break_even([1, 2, 4, 8], [2.0, 1.5, 1.0, 0.8]) == pytest.approx(4.0)
    assert break_even([1, 2, 4], [2.0, 1.5, 0.5]) == pytest.approx(2 ** (1 + 0.5 / 1.0))
    assert break_even([1, 2], [1.3, 1.1]) is None and break_even([1, 2], [0.9, 0.5]) == 1.0


def test_costbatch_predicts_a_curve_per_profile(tiny_dirs, tmp_path):
    """The batch cost model on tiny shapes: every batch size timed, each profile priced at every size."""
    from draftsmith.app.cli import main

    prof = tmp_path / "ngram.json"
    prof.write_text(json.dumps({"tau": 1.8, "speedup": 1.2, "alpha_per_position": [0.6, 0.3],
                                "conditions": {"drafter": "ngram:max=2", "drafter_kind": "ngram", "k": 2}}))  # fmt: skip
    out = tmp_path / "cb.json"
    argv = ["--shape", "tiny-target", "--device", "cpu", "--batch-sizes", "1,2", "--context", "16", "--reps", "1",
            "--k", "2", "--out", str(out), "--profiles", str(prof)]  # fmt: skip
    assert main(["bench", "cost-batch", *argv]) == 0
    res = json.loads(out.read_text())
    assert set(res["per_batch"]) == {"1", "2"}
    for entry in res["per_batch"].values():
        assert {"draft@k=2", "ngram@k=2", "ngram,max=2@k=2"} <= set(entry["drafters"])
        assert entry["plain_step_s"] > 0 and {"eagle3@k=2", "medusa@k=2", "dflash@k=2"} <= set(
            entry["drafters"]
        )
        native = {key: d["batched"] for key, d in entry["drafters"].items()}
        assert native["draft@k=2"] and native["ngram@k=2"] and native["medusa@k=2"]  # one call for all rows
        assert not native["eagle3@k=2"]  # one drafter copy per row (decode.rowwise)
    (p,) = res["profiles"]
    assert set(p["per_batch"]) == {"1", "2"} and all(c["speedup"] > 0 for c in p["per_batch"].values())
    assert "| 2 |" in out.with_suffix(".md").read_text()
    assert main(["bench", "cost-batch", *argv]) == 2  # never overwrites


@pytest.mark.slow
def test_bench_batch_script_runs_both_targets_on_tiny_settings(tmp_path):
    """scripts/bench_batch.sh (the CPU measurement by batch size) with tiny stand-ins for both targets: one process per
    target, every drafter measured at every batch size, lossless; bad input is one line, exit 2."""
    import subprocess
    import sys
    from pathlib import Path

    from draftsmith.heads.eagle.kind import example_eagle3
    from draftsmith.testing import save_tiny, save_tiny_like, tiny_model

    folders = {}
    for arch in ("llama", "qwen2"):
        target_dir = save_tiny(tmp_path / arch / "target", arch=arch)
        target = tiny_model(arch)
        draft = save_tiny_like(tmp_path / arch / "draft", target, num_hidden_layers=1)
        eagle = example_eagle3(tmp_path / arch, target).split(":", 1)[1].split(",")[0]
        folders[arch] = (str(target_dir), str(draft), eagle)
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_batch.sh"
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PROMPTS": _prompts(tmp_path), "LIMIT": "3",
           "NEW": "5", "BATCH": "1,2", "K_DRAFT": "2", "K_NGRAM": "2", "SMOL_TARGET": folders["llama"][0],
           "QWEN_TARGET": folders["qwen2"][0]}  # fmt: skip
    args = ["bash", str(script), str(out), *folders["llama"][1:], *folders["qwen2"][1:]]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b"):
        res = json.loads((out / name / "bench.json").read_text())
        assert set(res["drafters"]) == {"ngram", "draft", "eagle3"}
        for r in res["drafters"].values():
            assert r["batch"]["batch_sizes"] == [1, 2] and r["batch"]["lossless"] is True
        assert (out / name / "bench-batch.png").stat().st_size > 1000
    again = subprocess.run(args, env=env, capture_output=True, text=True)  # never overwrites
    assert (
        again.returncode == 2 and again.stderr.startswith("error: ") and len(again.stderr.splitlines()) == 1
    )
