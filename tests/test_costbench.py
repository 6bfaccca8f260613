"""The hardware cost-model benchmark and the training-throughput benchmark on tiny shapes on the CPU: every
measurement runs, the predicted speedups follow from the measured costs, bad input is refused before compute."""

import json

import pytest
import torch

from draftsmith.app import costbench
from draftsmith.app.bench import trainbench
from draftsmith.app.cli import main
from draftsmith.errors import DraftsmithError


def _profile(path, kind="draft", k=3, tau=2.5, drafter=None):
    data = {
        "tau": tau,
        "alpha_per_position": [0.7, 0.6, 0.5][:k],
        "speedup": 1.3,
        "conditions": {
            "drafter": drafter or f"{kind}:somewhere",
            "drafter_kind": kind,
            "k": k,
            "device": "cpu",
        },
    }
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiles")
    profiles = [
        _profile(root / "draft.json", "draft", k=3),
        _profile(
            root / "eagle.json", "eagle", k=3, tau=2.0, drafter="eagle:dir,top_k=2,depth=3,total_tokens=6"
        ),
        _profile(root / "dflash.json", "dflash", k=3, tau=1.5, drafter="dflash:dir,top_k=2,total_tokens=6"),
        _profile(root / "peagle.json", "peagle", k=3, tau=1.6, drafter="peagle:dir,depth=3"),
    ]
    args = costbench.BenchArgs(
        shape="tiny-target",
        device="cpu",
        dtype="float32",
        context=64,
        sizes=(1, 2, 4),
        reps=1,
        compile="eager",  # the decoder's compile path traced by dynamo, without code generation
        plain_tokens=4,
        profiles=profiles,
        profile_steps=1,
    )
    return costbench.run(args, progress=lambda s: None)


def test_costbench_measures_every_part(tiny_run):
    res = tiny_run
    assert set(res["forward_s"]) == {"eager", "compiled"}
    for mode in ("eager", "compiled"):
        assert set(res["forward_s"][mode]) == {"1", "2", "4"}
        assert all(s > 0 for s in res["forward_s"][mode].values())
        assert res["plain_step_s"][mode] > 0
    # every default drafter kind at k=4, plus the profiles' own (kind, options, k)
    for key in ("draft@k=4", "ngram@k=4", "medusa@k=4", "eagle3@k=4", "draft@k=3"):
        assert res["drafters"][key]["step_s"] > 0, key
    assert res["drafters"]["draft@k=4"]["nodes"] == 4  # a chain of k
    assert res["drafters"]["ngram@k=4"]["nodes"] == 4  # the repeating context: lookups hit
    assert res["drafters"]["eagle3,depth=3,top_k=2,total_tokens=6@k=3"]["nodes"] == 6  # the profile's tree
    assert res["drafters"]["eagle3@k=4"]["nodes"] == 24  # EagleProposer's total_tokens
    # block drafters (one forward per draft) at the profiles' settings: a top-2 tree of 6 nodes, a chain of 3
    assert res["drafters"]["dflash,top_k=2,total_tokens=6@k=3"]["nodes"] == 6
    assert res["drafters"]["peagle,depth=3@k=3"]["nodes"] == 3
    assert res["skipped"] == []
    for key, d in res["drafters"].items():  # one profiled step each: the ops a step dispatches, on the host
        assert len(d["step_s_all"]) == 1 and d["step_s"] == d["step_s_all"][0], key  # reps=1: the one step
        p = d["profile"]
        assert p["aten_ops"] > 0 and p["host_ms"] > 0 and p["device_ms"] == 0, key
        assert p["top"] and all(t["host_ms"] >= 0 for t in p["top"]), key
    assert "Where a drafting step's time goes" in costbench.markdown(res)


def test_step_profile_counts_a_known_step():
    """Oracle: a step of exactly 5 adds and 2 matrix products -> 5 and 2 calls per step, summed over 3 steps."""
    x = torch.randn(64, 64)

    def step():
        y = x
        for _ in range(5):
            y = torch.add(y, 1)
        return y @ x @ x

    p = costbench.step_profile(step, 3, torch.device("cpu"))
    calls = {t["op"]: t["calls"] for t in p["top"]}
    assert calls["aten::add"] == 5 and calls["aten::matmul"] == 2
    assert p["steps"] == 3 and p["device_ms"] == 0 and 0 < p["host_ms"] and p["aten_ops"] >= 7


def test_costbench_speedup_follows_from_measured_costs(tiny_run):
    """Oracle: the speedup formula written out by hand from the run's own numbers (draft chain k=3 -> a verify of
    1 + 3 = 4 tokens, a measured size: no interpolation)."""
    res = tiny_run
    row = next(p for p in res["profiles"] if p["kind"] == "draft")
    for mode in ("eager", "compiled"):
        fw = res["forward_s"][mode]
        step = res["plain_step_s"][mode]
        host = max(step - fw["1"], 0.0)
        draft = res["drafters"]["draft@k=3"]["step_s"]
        # a verify never costs less than a plain step (a faster 4-token forward is timing noise on a tiny model)
        verify = max(fw["4"] + host, step)
        want = 2.5 * step / (draft + verify)
        assert row[mode]["speedup"] == pytest.approx(want, rel=1e-9)
        assert row[mode]["break_even_tau"] == pytest.approx((draft + verify) / step, rel=1e-9)
    md = costbench.markdown(res)
    assert "Predicted speedup" in md and "| 64 |" not in md and "| 4 |" in md


def test_costbench_budget_skips_and_says_so():
    args = costbench.BenchArgs(
        shape="tiny-target",
        device="cpu",
        dtype="float32",
        context=16,
        sizes=(1, 2),
        reps=1,
        compile="none",
        drafters=("ngram",),
        plain_tokens=3,
        budget_s=1e-9,
    )
    res = costbench.run(args, progress=lambda s: None)
    assert (
        res["forward_s"] == {} and "forward/eager" in res["skipped"] and "drafter/ngram@k=4" in res["skipped"]
    )


def test_bad_profiles_and_outputs_are_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tau": 2.0, "conditions": {"k": 4}}))
    with pytest.raises(DraftsmithError, match="drafter_kind"):
        costbench.load_profile(bad)
    with pytest.raises(DraftsmithError, match="no cost builder"):
        costbench.load_profile(_profile(tmp_path / "x.json", "nonsense"))
    (tmp_path / "junk.json").write_text("{not json")
    out = tmp_path / "out.json"
    assert (
        main(
            [
                "bench",
                "cost",
                "--out",
                str(out),
                "--shape",
                "tiny-target",
                "--device",
                "cpu",
                "--profiles",
                str(tmp_path / "junk.json"),
            ]
        )
        == 2
    )
    assert "error: profile" in capsys.readouterr().err and not out.exists()
    out.write_text("{}")
    assert main(["bench", "cost", "--out", str(out), "--device", "cpu"]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "{}"


def test_trainbench_runs_both_trainers_through_the_training_loop():
    a = trainbench.TrainBenchArgs(
        shape="tiny-target",
        device="cpu",
        steps=2,
        eagle_batch=2,
        eagle_length=24,
        ttt_steps=2,
        distill_batch=2,
        distill_length=24,
    )
    res = trainbench.run(a, progress=lambda s: None)
    for name, tokens in (("eagle3", 2 * 24), ("distill", 2 * 24)):
        r = res[name]
        assert len(r["step_s_all"]) == 2 and r["step_s"] == r["step_s_all"][1]  # the first step is excluded
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"])
        assert r["peak_mem_gib"] is None  # CPU: no device allocator to read
    assert res["eagle3"]["ttt_steps"] == 2 and res["eagle3"]["draft_vocab"] == 2048
    assert "Published beside it" in trainbench.markdown(res)
    assert torch.get_default_dtype() == torch.float32


def test_load_profile_reads_what_draftsmith_eval_writes(tiny_dirs, tmp_path):
    from draftsmith.app.evaluate import evaluate
    from draftsmith.evalsettings import EvalSettings
    from draftsmith.prompts import Prompt

    prompts = [Prompt(messages=[{"role": "user", "content": "count: 1 2 3 1 2 3 1 2"}], category="x", id="0")]
    settings = EvalSettings(k=3, max_new_tokens=8)
    evaluate(tiny_dirs["target"], "ngram:max=2", prompts, settings, out_dir=tmp_path / "run", device="cpu",
             progress=False)  # fmt: skip
    p = costbench.load_profile(tmp_path / "run" / "eval.json")
    assert p["name"] == "run" and p["kind"] == "ngram" and p["k"] == 3 and p["opts"] == {"max": 2}
    assert p["tau"] >= 1.0 and len(p["alpha_per_position"]) == 3 and p["measured_on"]["device"] == "cpu"


def test_predict_by_hand_and_no_extrapolation():
    """Hand-written costs (ms): forward 10/11/12/16 for n = 1/2/4/8, a plain decoder step 12 (so 2 of host work per
    step), a drafter step of 4 drafting 3 nodes: a step costs 4 + 12 + 2 = 18 -> tau 2.7 gives 2.7 * 12 / 18."""
    fw = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.016}
    got = costbench.predict({"tau": 2.7}, fw, 0.012, {"step_s": 0.004, "nodes": 3})
    assert got["speedup"] == pytest.approx(2.7 * 12 / 18) and got["break_even_tau"] == pytest.approx(18 / 12)
    far = costbench.predict(
        {"tau": 2.7}, fw, 0.012, {"step_s": 0.004, "nodes": 9}
    )  # verify of 10 > 8 measured
    assert far["speedup"] is None and "exceeds" in far["note"]
