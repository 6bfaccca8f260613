"""`draftsmith generate --server`: answers through an OpenAI-compatible server equal the local greedy answers; a
server that is down, serves another model, returns no ids or fails mid-run is one line, and a rerun resumes."""

import json

import pytest
import torch

from draftsmith.app.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.selfdistill import generate_dataset, load_generated
from draftsmith.testserver import StandInServer


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"Question {i}: what is {i} times {i + 1}?", "category": "math"} for i in range(9)]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    return str(f)


@pytest.fixture(scope="module")
def target_model(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dirs["target"]).eval()


def _gen(tiny_dirs, prompts, out, **kw):
    kw = {"max_new_tokens": 10, "shard_size": 3, "progress": False, **kw}
    return generate_dataset(tiny_dirs["target"], prompts, out, **kw)


def _rows(out):
    return {r["id"]: (r["prompt_ids"], r["response_ids"], r["finish"]) for r in load_generated(out)}


@pytest.mark.parametrize("ids", ["logprobs", "token_ids"])
def test_server_answers_equal_local_greedy(tiny_dirs, prompt_file, tmp_path, target_model, ids):
    local = _rows(_gen(tiny_dirs, prompt_file, tmp_path / "local", batch_size=1))
    with StandInServer(target_model, ids=ids) as srv:
        out = _gen(tiny_dirs, prompt_file, tmp_path / "server", server=srv.url, parallel=3)
    assert _rows(out) == local  # ids, eos handling (kept by vLLM, dropped by llama.cpp) and finish alike
    assert any(f == "stop" for _, _, f in local.values()) and any(f == "length" for _, _, f in local.values())
    man = json.loads((out / "manifest.json").read_text())
    assert man["settings"]["engine"] == "server" and man["settings"]["served_model"] == "stand-in"
    assert man["server"]["url"] == srv.url and man["n_rows"] == 9


def test_server_failure_mid_run_keeps_answers_and_resumes(tiny_dirs, prompt_file, tmp_path, target_model):
    out = tmp_path / "gen"
    with StandInServer(target_model, fail_after=5) as srv:
        with pytest.raises(DraftsmithError, match="HTTP 500.*rerun the same command to resume"):
            _gen(tiny_dirs, prompt_file, out, server=srv.url, parallel=1)
    kept = load_generated(out)
    assert len(kept) == 5  # the answers before the failure are written, in whole shards
    with StandInServer(target_model) as srv:
        _gen(tiny_dirs, prompt_file, out, server=srv.url, parallel=2)
    with StandInServer(target_model) as srv:
        whole = _gen(tiny_dirs, prompt_file, tmp_path / "whole", server=srv.url)
    assert _rows(out) == _rows(whole)
    assert len(load_generated(out)) == 9  # nothing answered twice


def test_server_refusals_write_nothing(tiny_dirs, prompt_file, tmp_path, target_model):
    from draftsmith.llamacpp import free_port

    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DraftsmithError, match="not reachable"):
        _gen(tiny_dirs, prompt_file, tmp_path / "a", server=down)
    with StandInServer(target_model, model_id="some-other-model") as srv:
        with pytest.raises(DraftsmithError, match="serves .*some-other-model.*not 'mine'"):
            _gen(tiny_dirs, prompt_file, tmp_path / "b", server=srv.url, served_model="mine")
    with StandInServer(target_model, ids="none") as srv:
        with pytest.raises(DraftsmithError, match="returns no token ids"):
            _gen(tiny_dirs, prompt_file, tmp_path / "c", server=srv.url)
    with pytest.raises(DraftsmithError, match="not an http"):
        _gen(tiny_dirs, prompt_file, tmp_path / "d", server="localhost:8080")
    with pytest.raises(DraftsmithError, match="parallel"):
        _gen(tiny_dirs, prompt_file, tmp_path / "e", server=down, parallel=0)
    with pytest.raises(DraftsmithError, match="loads GGUF files"):
        _gen(tiny_dirs, prompt_file, tmp_path / "f", server="auto")
    # the "no ids" run met its failure at the first answer: its folder holds a manifest and no rows
    assert not any((tmp_path / n).exists() for n in "abdef")


def test_server_and_local_data_never_mix(tiny_dirs, prompt_file, tmp_path, target_model):
    out = tmp_path / "gen"
    _gen(tiny_dirs, prompt_file, out, limit=3)
    with StandInServer(target_model) as srv:
        with pytest.raises(DraftsmithError, match="other settings \\(engine"):
            _gen(tiny_dirs, prompt_file, out, server=srv.url)


def test_generate_cli_server(tiny_dirs, prompt_file, tmp_path, target_model, capsys):
    out = tmp_path / "gen"
    with StandInServer(target_model) as srv:
        rc = main(["generate", "--target", tiny_dirs["target"], "--prompts", prompt_file, "--out", str(out),
                   "--max-new-tokens", "6", "--server", srv.url, "--parallel", "2"])  # fmt: skip
    assert rc == 0 and "9 rows" in capsys.readouterr().out
    rc = main(["generate", "--target", tiny_dirs["target"], "--prompts", prompt_file, "--out", str(tmp_path / "x"),
               "--server", "http://127.0.0.1:1"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and not (tmp_path / "x").exists()


@pytest.mark.llamacpp
@pytest.mark.slow
def test_server_auto_llamacpp_answers_like_the_target(tmp_path):
    """The real llama-server on the embedded SmolLM2 GGUF: every row complete (the end-of-sequence token the server
    drops put back where it stopped) and, greedy, agreeing with the local target's argmax (the Q4_1 kernels and the
    dequantized fp32 copy part at near-ties, so first tokens are compared)."""
    from draftsmith import llamacpp
    from draftsmith.models import load_model, load_tokenizer
    from draftsmith.prompts import load_prompts, prompt_ids

    if not llamacpp.available():
        pytest.skip("llama.cpp is not built (WITH_LLAMACPP=1 bash scripts/setup.sh)")
    f = tmp_path / "p.jsonl"
    asks = [
        "Name three primary colors.",
        "Say hello in French.",
        "What is 12 plus 30?",
        "Write a haiku about rain.",
    ]
    f.write_text("\n".join(json.dumps({"prompt": a}) for a in asks))
    out = generate_dataset("smollm2-135m", str(f), tmp_path / "gen", max_new_tokens=24, server="auto", parallel=2,
                           progress=False)  # fmt: skip
    rows = {r["id"]: r for r in load_generated(out)}
    man = json.loads((out / "manifest.json").read_text())
    assert man["server"]["engine"] == "llama.cpp" and man["settings"]["served_model"] == "smollm2-135m"
    tok = load_tokenizer("smollm2-135m")
    model = load_model("smollm2-135m", dtype="float32", inference=True)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    agree = 0
    for i, p in enumerate(load_prompts(str(f))):
        r = rows[str(i)] if str(i) in rows else rows[p.id]
        assert r["prompt_ids"] == prompt_ids(tok, p)
        resp = r["response_ids"]
        assert 1 <= len(resp) <= 24 and all(0 <= t < len(tok) for t in resp)
        assert (r["finish"] == "stop") == (resp[-1] in eos) and not any(t in eos for t in resp[:-1])
        first = model(torch.tensor([r["prompt_ids"]])).logits[0, -1].argmax().item()
        agree += first == resp[0]
    assert agree >= 3  # greedy: the server's first answer token is the target's argmax (near-ties aside)


@pytest.mark.parametrize("flag", ["--limit", "--max-new-tokens", "--batch-size", "--parallel"])
def test_bench_generate_refuses_a_count_below_one_before_any_phase(tmp_path, capsys, flag):
    """A count below 1 is one line and exit 2 before llama-server is looked for or any folder is written (the
    local phase, which would refuse it too, runs only after the server phase's minutes)."""
    out = tmp_path / "bench"
    assert main(["bench", "generate", flag, "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} must be >= 1, got 0" in err[0] and not out.exists()
