"""draftsmith bench loss-ablation: plans and validates before it writes, trains every loss x seed from one recipe with
one held-out split, resumes, and measures every checkpoint with the decoder in one run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.app.bench import loss_ablation
from draftsmith.app.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_ablation(argv: list[str]) -> int:
    return main(["bench", "loss-ablation", *argv])


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, tiny_dirs):
    from draftsmith.selfdistill import generate_dataset

    root = tmp_path_factory.mktemp("ablation")
    f = root / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"Count the apples in basket {i}."}) for i in range(10)))
    gen = generate_dataset(tiny_dirs["target"], str(f), root / "gen", max_new_tokens=8, progress=False)
    sets = [f"model.target={tiny_dirs['target']}", "model.layers=[0]", "model.vocab_size=0", f"data.source={gen}",
            "data.limit=null", "data.eval_size=3", "data.cache_target_topk=0", "train.max_steps=2",
            "train.batch_size=2", "train.save_every=1", "train.warmup_steps=0", "train.log_every=1",
            "eval.batch_size=2"]  # fmt: skip
    return root, [a for s in sets for a in ("--set", s)], tiny_dirs


def _args(out, sets, *extra):
    return [
        str(out),
        "--trainer",
        "distill",
        *sets,
        "--seeds",
        "0,1",
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        *extra,
    ]


def test_dry_run_validates_and_writes_nothing(tiny_setup, capsys):
    root, sets, _ = tiny_setup
    out = root / "dry"
    assert run_ablation(_args(out, sets, "--losses", "fkl,tvd,fkl>tvd@1", "--dry")) == 0
    text = capsys.readouterr().out
    assert "3 losses x 2 seeds" in text and "loss.warmup_kind=fkl loss.warmup_steps=1" in text
    assert text.count("data.split_seed=0") == 6 and not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--losses", "fkl,nope"], "'nope' is not a distill loss"),
        (["--losses", "fkl>tvd"], "use A>B@STEPS"),
        (["--losses", "fkl,fkl"], "must not repeat"),
        (["--seeds", "0,x"], "comma lists of numbers"),
        (["--set", "train.lr=oops"], "error: fkl-s0:"),
        (
            ["--prompts", "builtin:dev-eval,/no/such/prompts.jsonl"],
            "prompt file /no/such/prompts.jsonl not found",
        ),
        (["--prompts", "builtin:dev-eval,builtin:dev-eval"], "distinct names"),
        (["--untrained"], "--untrained measures the draft the runs start from as it is: it needs"),
    ],
)
def test_bad_arguments_are_one_line_before_anything_is_written(tiny_setup, extra, message, capsys):
    root, sets, _ = tiny_setup
    out = root / "bad"
    status = run_ablation(
        _args(out, sets, "--losses", "fkl", *extra) if "--losses" not in extra else _args(out, sets, *extra)
    )
    err = capsys.readouterr().err
    assert status == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["distill", "--losses", "nope"], "'nope' is not a distill loss"),
        (["medusa"], "must be distill or eagle3"),
    ],
)
def test_the_shell_entry_refuses_bad_input_before_generating_data(tmp_path, extra, message):
    """scripts/loss_ablation.sh checks every argument (a dry plan) before its generate step writes OUT/data."""
    out = tmp_path / "abl"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "loss_ablation.sh"), str(out), *extra],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and message in proc.stderr
    assert not out.exists()


@pytest.mark.slow  # 4 two-step training runs (each its own process) and one decoder run
def test_trains_every_loss_and_seed_then_measures_them_in_one_run(tiny_setup, capsys):
    root, sets, _ = tiny_setup
    out = root / "full"
    heldout = root / "heldout.jsonl"
    heldout.write_text("\n".join(json.dumps({"prompt": f"Weigh the pears in crate {i}."}) for i in range(3)))
    argv = _args(
        out, sets, "--losses", "fkl,tvd", "--temperatures", "0,1", "--prompts", f"builtin:dev-eval,{heldout}"
    )
    assert run_ablation(argv) == 0
    runs = out / "distill" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["fkl-s0", "fkl-s1", "tvd-s0", "tvd-s1"]
    for run in runs.iterdir():
        recipe = (run / "run.yaml").read_text()
        assert "split_seed: 0" in recipe and (run / "final" / "config.json").is_file()
    table = json.loads((out / "distill" / "ablation.json").read_text())["table"]
    for loss in ("fkl", "tvd"):
        for t in ("t0", "t1"):
            row = table[loss][t]
            assert len(row["tau_per_seed"]) == 2 and all(1.0 <= x <= 5.0 for x in row["tau_per_seed"])
            assert row["predicted_tau_mean"] is not None
        assert table[loss]["t0"]["lossless"] == [True, True]  # greedy speculative == greedy plain
    measured = json.loads((out / "distill" / "measured-t0.json").read_text())
    assert sorted(measured["drafters"]) == ["fkl-s0", "fkl-s1", "tvd-s0", "tvd-s1"]
    assert measured["prompts"] == "builtin:dev-eval" and measured["n_prompts"] == 2
    # the second prompt set: measured the same way, shown beside the first
    also = json.loads((out / "distill" / "measured-heldout-t1.json").read_text())
    assert also["prompts"] == str(heldout) and sorted(also["drafters"]) == sorted(measured["drafters"])
    for loss in ("fkl", "tvd"):
        got = [also["drafters"][f"{loss}-s{s}"]["tau"] for s in (0, 1)]
        assert table[loss]["t1"]["also"]["heldout"]["tau_mean"] == pytest.approx(sum(got) / 2)
    md = (out / "distill" / "ablation.md").read_text()
    assert md.count("| fkl |") == 2 and "tau on heldout" in md
    # a rerun trains nothing and measures nothing again
    before = {p: p.stat().st_mtime_ns for p in (out / "distill").glob("measured-*.json")}
    capsys.readouterr()
    assert run_ablation(argv) == 0
    assert capsys.readouterr().out.count(": done, kept") == 4
    assert {p: p.stat().st_mtime_ns for p in (out / "distill").glob("measured-*.json")} == before


def test_untrained_measures_the_draft_the_runs_start_from_beside_them(tiny_setup):
    """--untrained: the off-the-shelf draft (model.init=existing) is decoded in the same run as the checkpoints,
    and its predicted tau is the runs' step-0 held-out eval."""
    root, sets, dirs = tiny_setup
    sets = ["model.init=existing" if s == "model.layers=[0]" else s for s in sets]
    sets += ["--set", f"model.draft={dirs['draft']}", "--set", "model.layers=null"]
    out = root / "untrained"
    argv = _args(out, sets, "--losses", "fkl", "--seeds", "0", "--temperatures", "0", "--untrained")
    assert run_ablation(argv) == 0
    measured = json.loads((out / "distill" / "measured-t0.json").read_text())
    assert sorted(measured["drafters"]) == ["fkl-s0", "untrained"]
    table = json.loads((out / "distill" / "ablation.json").read_text())["table"]
    row = table["untrained"]["t0"]
    assert row["tau_per_seed"] == [measured["drafters"]["untrained"]["tau"]] and row["lossless"] == [True]
    metrics = (out / "distill" / "runs" / "fkl-s0" / "metrics.jsonl").read_text().splitlines()
    step0 = next(e for e in map(json.loads, metrics) if e.get("event") == "eval" and e["step"] == 0)
    assert row["predicted_tau_mean"] == pytest.approx(step0["heldout"]["tau_greedy"]["4"])
    assert "| untrained | 0 |" in (out / "distill" / "ablation.md").read_text()


def test_a_run_stopped_before_its_first_checkpoint_is_resumed(tiny_setup, capsys):
    """A run killed before it saved a checkpoint leaves its run.yaml: a rerun continues it (the trainer's --resume
    starts at step 0) instead of stopping at 'already holds this run'."""
    import shutil

    root, sets, _ = tiny_setup
    out = root / "early-stop"
    argv = _args(out, sets, "--losses", "fkl", "--seeds", "0", "--temperatures", "0")
    assert run_ablation(argv) == 0
    run = out / "distill" / "runs" / "fkl-s0"
    for name in ("final", "checkpoints", "metrics.jsonl"):
        p = run / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    for p in (out / "distill").glob("measured-*.json"):
        p.unlink()
    assert (run / "run.yaml").is_file()
    capsys.readouterr()
    assert run_ablation(argv) == 0
    assert "fkl-s0: resuming" in capsys.readouterr().out
    assert (run / "final" / "config.json").is_file()


def test_eagle3_runs_decode_as_the_chain_their_eval_predicts(tiny_dirs, tmp_path):
    """The heads' held-out eval predicts a chain of k; `eagle:DIR` alone decodes a 24-node tree (more accepted
    tokens per step), so the ablation's spec must ask for the chain."""
    import torch

    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.heads import EagleHead, save_head
    from draftsmith.models import load_model

    target = load_model(tiny_dirs["target"], device="cpu")
    head = EagleHead.from_target(
        target, "eagle3", draft_vocab_ids=torch.arange(0, 384, 2), aux_layers=[0, 1, 2]
    )
    save_head(head, tmp_path / "e3")
    ctx = DrafterContext(
        target=target, tokenizer=None, device=torch.device("cpu"), target_spec=tiny_dirs["target"]
    )
    for k in (2, 3):
        spec = loss_ablation.TRAINERS["eagle3"].spec.format(final=tmp_path / "e3", k=k)
        prop = build_proposer(spec, ctx, k=k)
        assert (prop.top_k, prop.total) == (1, k), spec
