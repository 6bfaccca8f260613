import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.selfdistill import data_files, generate_dataset, load_generated


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": f"Question {i}: what is {i} plus {i}?", "category": "math" if i % 2 else "chat"}
        for i in range(7)
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    return str(f)


def _gen(tiny_dirs, prompts, out, **kw):
    kw = {"max_new_tokens": 6, "batch_size": 3, "shard_size": 2, "progress": False, **kw}
    return generate_dataset(tiny_dirs["target"], prompts, out, **kw)


def test_generate_writes_loadable_token_ids(tiny_dirs, prompt_file, tmp_path, tiny_tokenizer, tiny_target):
    out = _gen(tiny_dirs, prompt_file, tmp_path / "gen")
    rows = load_generated(out)
    assert sorted(r["id"] for r in rows) == [str(i) for i in range(7)]
    man = json.loads((out / "manifest.json").read_text())
    assert man["n_rows"] == 7 and len(man["shards"]) >= 3  # shard_size=2: several shards
    assert not list(out.glob("*.tmp"))
    for r in rows:
        assert r["finish"] in ("stop", "length") and 1 <= len(r["response_ids"]) <= 6
        if r["finish"] == "stop":
            assert r["response_ids"][-1] == tiny_tokenizer.eos_token_id
    # greedy: the stored response is exactly the target's greedy continuation of the stored prompt ids
    import torch

    r = rows[0]
    seq = tiny_target.generate(
        torch.tensor([r["prompt_ids"]]), max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=2
    )
    expect = seq[0, len(r["prompt_ids"]) :].tolist()
    assert r["response_ids"] == expect[: len(r["response_ids"])]
    import datasets

    ds = datasets.load_dataset("json", data_files=data_files(out), split="train")
    assert len(ds) == 7 and set(ds.column_names) >= {"prompt_ids", "response_ids", "category", "id", "finish"}


def test_generate_resumes_and_skips_done(tiny_dirs, prompt_file, tmp_path):
    out = tmp_path / "gen"
    _gen(tiny_dirs, prompt_file, out, limit=4)
    with pytest.raises(DraftsmithError, match="other settings"):
        _gen(tiny_dirs, prompt_file, out, limit=4, max_new_tokens=5)
    man = json.loads((out / "manifest.json").read_text())
    # simulate a run killed after its first shard: drop the later shards from the manifest
    (out / "shard-00001.jsonl").unlink()
    (out / "shard-00002.jsonl.tmp").write_text('{"id": "garbage"')  # a half-written shard is never trusted
    man["shards"], man["n_rows"] = man["shards"][:1], man["shards"][0]["n_rows"]
    (out / "manifest.json").write_text(json.dumps(man))
    first = {r["id"] for r in load_generated(out)}
    _gen(tiny_dirs, prompt_file, out, limit=4)
    rows = load_generated(out)
    assert sorted(r["id"] for r in rows) == ["0", "1", "2", "3"]  # no duplicates, nothing lost
    assert first < {r["id"] for r in rows}
    _gen(tiny_dirs, prompt_file, out, limit=6)  # a larger limit extends the dataset
    assert sorted(r["id"] for r in load_generated(out)) == [str(i) for i in range(6)]


def test_generate_bad_inputs(tiny_dirs, tmp_path, prompt_file):
    with pytest.raises(DraftsmithError, match="evaluation set"):
        _gen(tiny_dirs, "builtin:dev-eval", tmp_path / "a")
    with pytest.raises(DraftsmithError, match="not found"):
        _gen(tiny_dirs, str(tmp_path / "missing.jsonl"), tmp_path / "b")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"other": 1}\n')
    with pytest.raises(DraftsmithError, match="record 1 has no prompt text"):
        _gen(tiny_dirs, str(empty), tmp_path / "c")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 600}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    with pytest.raises(DraftsmithError, match="fit the context"):
        _gen(tiny_dirs, str(long), tmp_path / "d")
    assert len(load_generated(_gen(tiny_dirs, str(long), tmp_path / "e", skip_long=True))) == 1
    with pytest.raises(DraftsmithError, match="not found"):
        load_generated(tmp_path / "nothing")
    (tmp_path / "notgen").mkdir()
    with pytest.raises(DraftsmithError, match="manifest"):
        load_generated(tmp_path / "notgen")


def test_generate_cli(tiny_dirs, prompt_file, tmp_path, capsys):
    from draftsmith.app.cli import main

    out = tmp_path / "cli"
    rc = main(
        [
            "generate",
            "--target",
            tiny_dirs["target"],
            "--prompts",
            prompt_file,
            "--out",
            str(out),
            "--max-new-tokens",
            "4",
            "--limit",
            "3",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
        ]
    )
    assert rc == 0 and "3 rows" in capsys.readouterr().out
    assert (
        main(["generate", "--target", tiny_dirs["target"], "--prompts", "builtin:vicuna", "--out", str(out)])
        == 2
    )
    assert "evaluation set" in capsys.readouterr().err


def test_sampled_generation_is_seeded_and_recorded(tiny_dirs, prompt_file, tmp_path):
    from draftsmith.sampling import SamplingParams

    hot = SamplingParams(temperature=1.5)
    a = load_generated(_gen(tiny_dirs, prompt_file, tmp_path / "a", sampling=hot, seed=3))
    b = load_generated(_gen(tiny_dirs, prompt_file, tmp_path / "b", sampling=hot, seed=3))
    greedy = load_generated(_gen(tiny_dirs, prompt_file, tmp_path / "g"))
    by_id = lambda rows: {r["id"]: r["response_ids"] for r in rows}  # noqa: E731
    assert by_id(a) == by_id(b)  # same seed, same samples
    assert by_id(a) != by_id(greedy)  # a random tiny model at temperature 1.5 does not follow its argmax
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert man["settings"]["temperature"] == 1.5
    with pytest.raises(DraftsmithError, match="other settings"):  # resuming with other sampling is refused
        _gen(tiny_dirs, prompt_file, tmp_path / "a", seed=3)


def test_generate_refuses_what_does_not_fit_before_the_load(tiny_dirs, prompt_file, tmp_path, no_model_loads):
    from draftsmith import models

    ctx = models.load_config(tiny_dirs["target"]).max_position_embeddings
    with pytest.raises(DraftsmithError, match="no room is left"):
        _gen(tiny_dirs, prompt_file, tmp_path / "a", max_new_tokens=ctx + 5)
    with pytest.raises(DraftsmithError, match="only .* fit the context"):
        _gen(tiny_dirs, prompt_file, tmp_path / "b", max_new_tokens=ctx - 3)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_sample_draws_a_seeded_random_set_that_a_larger_sample_extends(tiny_dirs, prompt_file, tmp_path):
    out = tmp_path / "gen"
    _gen(tiny_dirs, prompt_file, out, sample=3, seed=5)
    first = sorted(r["id"] for r in load_generated(out))
    assert len(first) == 3 and first != ["0", "1", "2"]  # seed 5 draws another set than the first three
    _gen(tiny_dirs, prompt_file, out, sample=5, seed=5)  # resumes: the same three plus two more
    second = sorted(r["id"] for r in load_generated(out))
    assert len(second) == 5 and set(first) <= set(second)
    other = tmp_path / "other"
    _gen(tiny_dirs, prompt_file, other, sample=5, seed=5)  # the same draw in a fresh folder
    assert sorted(r["id"] for r in load_generated(other)) == second
    with pytest.raises(DraftsmithError, match="other settings"):
        _gen(tiny_dirs, prompt_file, out, sample=5, seed=6)
    with pytest.raises(DraftsmithError, match="not both"):
        _gen(tiny_dirs, prompt_file, tmp_path / "both", sample=2, limit=2)
    assert not (tmp_path / "both").exists()


def test_a_folder_another_live_run_writes_is_refused(tiny_dirs, prompt_file, tmp_path):
    from draftsmith.rundir import lock_dir

    out = tmp_path / "gen"
    held = lock_dir(out)  # as a generate run in another process holds it
    try:
        with pytest.raises(DraftsmithError, match="being written by a live generate run"):
            _gen(tiny_dirs, prompt_file, out)
        assert not (out / "manifest.json").exists()
    finally:
        held.close()
    _gen(tiny_dirs, prompt_file, out)  # free again
    assert (out / "manifest.json").is_file()
