import json

import pytest

from draftsmith.app.quickstart import FAST, FULL, QuickstartSizes, quickstart


def test_quickstart_end_to_end_on_tiny_target(tiny_dirs, tmp_path, capsys):
    sizes = QuickstartSizes(
        train_prompts=12,
        text_examples=8,
        dev_prompts=2,
        max_new_tokens=8,
        steps=3,
        batch_size=4,
        lr=1e-3,
        layers=[0],
        vocab_size=96,
        eval_prompts=2,
        eval_max_new_tokens=8,
    )
    res = quickstart(tmp_path / "qs", target=tiny_dirs["target"], sizes=sizes, progress=False)
    out = capsys.readouterr().out
    assert "[1/4]" in out and "[4/4]" in out and "tau(k=4)" in out
    saved = json.loads((tmp_path / "qs" / "quickstart.json").read_text())
    before, after = saved["predicted"]["before"], saved["predicted"]["after"]
    assert before["n_tokens"] == after["n_tokens"] > 0  # the same dev-eval answers scored before and after
    assert saved["predicted"]["tau_k4_ratio"] == pytest.approx(
        after["tau_greedy"]["4"] / before["tau_greedy"]["4"]
    )
    assert saved["train_tokens_per_s"] > 0 and res["timings"]["total_s"] > 0
    # the decoder eval ran on the distilled draft: lossless greedy output, tau >= 1 (bonus token included)
    assert saved["measured"]["lossless"] is True and saved["measured"]["tau"] >= 1.0
    assert (tmp_path / "qs" / "eval" / "eval.json").is_file()
    # dev-eval reference answers are for measuring only: the trainer refuses them as data
    from draftsmith.errors import DraftsmithError
    from draftsmith.examples import examples_from_generated

    with pytest.raises(DraftsmithError, match="evaluation prompts"):
        examples_from_generated(tmp_path / "qs" / "data" / "dev-eval")
    # rerunning reuses the generated data (resumable) and retrains
    quickstart(
        tmp_path / "qs", target=tiny_dirs["target"], sizes=sizes, progress=False, run_decoder_eval=False
    )
    man = json.loads((tmp_path / "qs" / "data" / "train" / "manifest.json").read_text())
    assert man["n_rows"] == len(
        {r["id"] for r in map(json.loads, (tmp_path / "qs" / "data" / "train" / "shard-00000.jsonl").open())}
    )


def test_quickstart_sizes_are_consistent():
    for s in (FAST, FULL):
        assert s.steps > 0 and s.vocab_size > 0 and s.layers == sorted(set(s.layers))
    assert FULL.train_prompts > FAST.train_prompts and FULL.steps > FAST.steps
