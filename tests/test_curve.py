"""`draftsmith curve`: the points of a snapshotted run (tokens from the trainer's log, held-out τ from its eval
events, decoded τ and speedup from a bench.json), the crossing with a reference drafter, and its refusals."""

import json
import math

import pytest

from draftsmith.app.cli import main
from draftsmith.app.curve import build, crossing, tokens_at


def _run(tmp_path, steps=(2, 5), last=8):
    run = tmp_path / "run"
    for s in steps:
        (run / "snapshots" / f"step-{s:07d}").mkdir(parents=True)
    (run / "final").mkdir()
    events = [{"event": "eval", "step": 0, "tau_rounds": {"3": 1.0}}]
    for s in range(2, last + 1, 2):  # logged every 2 steps, 100 tokens a step
        events.append({"event": "train", "step": s, "n_tokens": 200})
    for s in (*steps, last):
        events.append({"event": "eval", "step": s, "tau_rounds": {"3": 1 + s / 10}, "tau_sim": 9.0})
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, events)) + "\n")
    return run


def _bench(tmp_path, speedups, ref=1.5):
    drafters = {name: {"tau": 1 + v, "speedup": v, "k": 3} for name, v in speedups.items()}
    drafters["ref"] = {"tau": 3.0, "speedup": ref, "k": 5, "conditions": {"n_prompts": 4}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"drafters": drafters}))
    return path


def test_points_tokens_and_held_out_tau_from_the_log(tmp_path):
    run = _run(tmp_path)
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert tokens_at(events, 2) == 200 and tokens_at(events, 5) == 500  # step 5: half of the 4-6 window
    curve = build(run, None, None, k=3)
    assert [(p["name"], p["step"], p["tokens"], p["held_out_tau"]) for p in curve["points"]] == [
        ("step-0000002", 2, 200, 1.2), ("step-0000005", 5, 500, 1.5), ("final", 8, 800, 1.8)]  # fmt: skip
    with pytest.raises(Exception, match="no training past step 8"):
        tokens_at(events, 9)


def test_crossing_measured_or_extrapolated_on_log_tokens():
    pts = [{"tokens": 1e5, "speedup": 1.1}, {"tokens": 1e6, "speedup": 1.3}]
    assert crossing(pts, 1.2) == {"measured": True, "tokens": 1e6, "after": 1e5}
    far = crossing(pts, 1.5)  # +0.2 per decade: 1.5 one decade further
    assert not far["measured"] and math.isclose(far["tokens"], 1e7, rel_tol=1e-9)
    falling = crossing([{"tokens": 1e5, "speedup": 1.3}, {"tokens": 1e6, "speedup": 1.2}], 1.5)
    assert falling["tokens"] is None and "does not rise" in falling["why"]
    one = crossing([{"tokens": 1e5, "speedup": 1.0}], 1.5)
    assert one["tokens"] is None and "fewer than two" in one["why"]


def test_cli_writes_the_curve_with_a_bench_and_a_reference(tmp_path, capsys):
    run = _run(tmp_path)
    bench = _bench(tmp_path, {"step-0000002": 1.0, "step-0000005": 1.2, "final": 1.6})
    assert (
        main(["curve", str(run), "--bench", str(bench), "--reference", "ref", "--out", str(tmp_path / "c")])
        == 0
    )
    curve = json.loads((tmp_path / "c" / "curve.json").read_text())
    assert [p["speedup"] for p in curve["points"]] == [1.0, 1.2, 1.6] and curve["reference"]["speedup"] == 1.5
    assert curve["crossing"] == {"measured": True, "tokens": 800, "after": 500}
    assert (
        tmp_path / "c" / "curve.png"
    ).stat().st_size > 0 and "crosses the reference" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--reference", "ref"], "pass --bench too"),
        (["--bench", "BENCH", "--reference", "nope"], "'nope' is not a drafter"),
        (["--bench", "MISSING"], "is not a readable bench.json"),
        (["--k", "0"], "--k must be >= 1"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, extra, message):
    run = _run(tmp_path)
    bench = _bench(tmp_path, {})
    extra = [
        str(bench) if a == "BENCH" else str(tmp_path / "missing.json") if a == "MISSING" else a for a in extra
    ]
    assert main(["curve", str(run), *extra, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not (tmp_path / "c").exists()


def test_a_folder_that_is_not_a_run_is_refused(tmp_path, capsys):
    assert main(["curve", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err and not (tmp_path / "c").exists()
