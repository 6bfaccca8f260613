"""llama.cpp runs draftsmith's drafters: GGUF export through llama.cpp's converter, plain and speculative decoding in
llama-server (lossless there, tau within tolerance of draftsmith's decoder), and the refusals.

The engine tests need the pinned build (WITH_LLAMACPP=1 bash scripts/setup.sh) and skip without it; the refusals
need no build. Tiny random models in fp32 (a GGUF in f32: the engine and the decoder compute the same numbers).
"""

import io
import json

import pytest
import torch

from draftsmith import llamacpp
from draftsmith.app.export import export
from draftsmith.errors import DraftsmithError
from draftsmith.prompts import Prompt

needs_build = pytest.mark.skipif(
    not llamacpp.available(), reason=f"llama.cpp not built; {llamacpp.BUILD_HINT}"
)

AUX = [1, 2, 3]  # inputs of target layers 1..3 of a 4-layer target
PROMPTS = [
    Prompt([{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}], id="a"),
    Prompt([{"role": "user", "content": "def add(a, b): return a + b"}], id="b"),
    Prompt([{"role": "user", "content": "Question: what is 12 plus 30?"}], id="c"),
]


def _with_spm_tokenizer(folder):
    """Add a SentencePiece tokenizer.model (same corpus, ids bos 1 / eos 2 as the tiny BPE): llama.cpp's converter
    recognises BPE tokenizers by a hash of known pre-tokenizers, which the tiny BPE is not, and reads a
    tokenizer.model first. Requests send token ids, so the engine's vocabulary only has to cover them."""
    import sentencepiece as spm

    from draftsmith import testing

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(testing._CORPUS), model_writer=buf, vocab_size=340, hard_vocab_limit=False,
        byte_fallback=True, model_type="bpe", minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer tiny Llama target, a draft LM (the target with noise on its MLPs: it agrees with the target on
    some tokens, not all) and an EAGLE-3 head for it (random weights)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.heads.block.dflash import DFlashDrafter
    from draftsmith.heads.eagle.model import EagleHead
    from draftsmith.heads.io import save_head
    from draftsmith.models import load_tokenizer
    from draftsmith.testing import save_tiny

    root = tmp_path_factory.mktemp("lcpp")
    target = _with_spm_tokenizer(save_tiny(root / "target", seed=0, num_hidden_layers=4))
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    noisy = AutoModelForCausalLM.from_pretrained(target).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, w in noisy.named_parameters():
            if ".mlp." in name:
                w.add_(0.1 * w.std() * torch.randn(w.shape, generator=g))
    noisy.save_pretrained(root / "draft")
    load_tokenizer(str(target)).save_pretrained(root / "draft")
    draft = _with_spm_tokenizer(root / "draft")
    torch.manual_seed(0)
    head = EagleHead.from_target(
        model, "eagle3", draft_vocab_ids=torch.arange(0, model.config.vocab_size, 2), aux_layers=AUX
    )
    save_head(head, root / "eagle3")
    dflash = DFlashDrafter.from_target(
        model, draft_vocab_ids=torch.arange(model.config.vocab_size), mask_token_id=3, block_size=4,
        aux_layers=AUX, freeze_lm_head=True,
    )  # fmt: skip
    save_head(dflash, root / "dflash")
    for name, vocab in (("dflash-own", torch.arange(model.config.vocab_size)),
                        ("dflash-reduced", torch.arange(0, model.config.vocab_size, 2))):  # fmt: skip
        torch.manual_seed(1)
        own = DFlashDrafter.from_target(
            model, draft_vocab_ids=vocab, mask_token_id=3, block_size=4, aux_layers=AUX, freeze_lm_head=False
        )
        save_head(own, root / name)
    return {"root": root, "target": target, "draft": draft, "head": root / "eagle3", "model": model,
            "dflash": root / "dflash", "dflash-own": root / "dflash-own",
            "dflash-reduced": root / "dflash-reduced"}  # fmt: skip


# ---- refusals (no build needed) ---------------------------------------------------------------------------------


def test_medusa_refused_in_one_line_naming_what_works(tiny, tmp_path, capsys):
    from draftsmith.app.cli import main
    from draftsmith.heads.io import save_head
    from draftsmith.heads.medusa.model import MedusaHeads

    save_head(MedusaHeads.from_target(tiny["model"], num_heads=2, num_layers=1), tmp_path / "medusa")
    status = main(["export", str(tmp_path / "medusa"), "--format", "gguf", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert (
        "llama.cpp has no Medusa" in err[0] and "--format vllm-medusa" in err[0] and "draft-eagle3" in err[0]
    )
    assert not (tmp_path / "o").exists()


def test_eagle3_for_a_target_llama_cpp_cannot_feed_is_refused(tmp_path):
    """phi3's llama.cpp graph records no layer inputs: the engine would abort at the first draft."""
    from transformers import AutoModelForCausalLM

    from draftsmith.heads.eagle.model import EagleHead
    from draftsmith.heads.io import save_head
    from draftsmith.testing import save_tiny

    target = save_tiny(tmp_path / "phi3", seed=0, arch="phi3", num_hidden_layers=4)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    save_head(EagleHead.from_target(model, "eagle3", aux_layers=AUX), tmp_path / "head")
    with pytest.raises(
        DraftsmithError, match="cannot run this eagle3 drafter for a 'phi3' target.*sglang-eagle3"
    ):
        export(tmp_path / "head", "gguf", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_bad_gguf_type_and_engine_drafter_refused_before_work(tiny, tmp_path):
    from draftsmith.app.bench.engine import bench

    with pytest.raises(DraftsmithError, match="--gguf-type 'q4' is not one of"):
        export(tiny["head"], "gguf", tmp_path / "o", gguf_type="q4")
    with pytest.raises(DraftsmithError, match="--gguf-type applies to --format gguf only"):
        export(tiny["head"], "sglang-eagle3", tmp_path / "o", gguf_type="f32")
    with pytest.raises(DraftsmithError, match="engine drafter 'medusa:x' is not one of"):
        bench(str(tiny["target"]), ["medusa:x"], PROMPTS)
    if llamacpp.available():  # a GGUF of another model: refused before any server starts
        from draftsmith.testing import save_tiny

        other = llamacpp.convert(
            _with_spm_tokenizer(save_tiny(tmp_path / "two", seed=0)), tmp_path / "two.gguf"
        )
        with pytest.raises(DraftsmithError, match="has 2 layers but .* has 4"):
            bench(str(tiny["target"]), [f"eagle3:{tiny['head']}"], PROMPTS, target_gguf_file=str(other))
    assert not (tmp_path / "o").exists()


# ---- in the engine ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_gguf(tiny):
    return llamacpp.convert(tiny["target"], tiny["root"] / "target.f32.gguf", outtype="f32")


@pytest.mark.llamacpp
@needs_build
def test_converted_target_decodes_greedy_like_transformers(tiny, target_gguf):
    """Conversion + llama-server: the engine's greedy tokens are the HF model's (fp32 both)."""
    from draftsmith.models import load_tokenizer
    from draftsmith.prompts import prompt_ids
    from draftsmith.testing import recompute_greedy

    tok = load_tokenizer(str(tiny["target"]))
    with llamacpp.LlamaServer(target_gguf, alias="t", context=256) as server:
        for p in PROMPTS:
            ids = prompt_ids(tok, p)
            got = llamacpp.complete_ids(server.url, ids, 16)
            assert got["tokens"] == recompute_greedy(tiny["model"], torch.tensor([ids]), 16)


def test_dflash_narrower_than_its_target_refused_for_gguf(tiny, tmp_path):
    """llama.cpp sizes DFlash's fc by the draft's own width: a narrower drafter is refused before anything is read."""
    from dataclasses import replace

    from draftsmith.heads.block.dflash import DFlashDrafter
    from draftsmith.heads.io import save_head

    base = DFlashDrafter.from_target(
        tiny["model"], draft_vocab_ids=torch.arange(0, tiny["model"].config.vocab_size, 2), mask_token_id=3,
        block_size=4, aux_layers=AUX,
    )  # fmt: skip
    narrow = DFlashDrafter(
        replace(base.config, hidden_size=32, intermediate_size=64, num_attention_heads=2), base.target
    )
    narrow.set_draft_vocab(base.vocab_ids)
    save_head(narrow, tmp_path / "narrow")
    with pytest.raises(DraftsmithError, match="llama.cpp sizes DFlash's fc .* must equal the target's"):
        export(tmp_path / "narrow", "gguf", tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.llamacpp
@needs_build
def test_dflash_reduced_vocab_gguf_export_files(tiny, tmp_path):
    """A DFlash drafter with its own reduced vocabulary: one dflash GGUF whose d2t holds the draft rows' target ids
    (llama.cpp scatters the draft logits through it) and whose output head has one row per draft token."""
    from gguf import GGUFReader

    out = export(tiny["dflash-reduced"], "gguf", tmp_path / "g", gguf_type="f32")
    reader = GGUFReader(out / "dflash.f32.gguf")
    assert reader.fields["general.architecture"].contents() == "dflash"
    tensors = {t.name: t for t in reader.tensors}
    vocab = tiny["model"].config.vocab_size
    assert tensors["d2t"].data.tolist() == list(range(0, vocab, 2))
    assert sorted(int(n) for n in tensors["output.weight"].shape) == sorted(
        [vocab // 2, tiny["model"].config.hidden_size]
    )
    assert list(reader.fields["dflash.target_layers"].contents()) == AUX  # layer inputs, as for EAGLE-3
    assert reader.fields["dflash.sample_from_anchor"].contents() is False


@pytest.mark.llamacpp
@needs_build
def test_eagle3_gguf_export_files(tiny, tmp_path):
    out = export(tiny["head"], "gguf", tmp_path / "g", gguf_type="f32")
    manifest = json.loads((out / "draftsmith_export.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["draftsmith_export.json", "eagle3.f32.gguf"]
    assert manifest["format"] == "gguf" and manifest["target_dir"] == str(tiny["target"].resolve())
    assert manifest["aux_hidden_state_layer_ids_draftsmith"] == AUX
    from gguf import GGUFReader  # the installed gguf package reads what the build's converter wrote

    reader = GGUFReader(out / "eagle3.f32.gguf")
    assert reader.fields["general.architecture"].contents() == "eagle3"
    layers = next(f for name, f in reader.fields.items() if name.endswith("target_layers"))
    assert list(layers.contents()) == AUX  # layer inputs, as llama.cpp's t_layer_inp reads them


@pytest.mark.llamacpp
@needs_build
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dflash-own", "dflash-reduced", "draft"])
def test_speculative_in_engine_is_lossless_and_tau_matches_decoder(tiny, target_gguf, kind, monkeypatch):
    """Every kind draftsmith exports to GGUF, in llama-server: DFlash with the target's frozen head, its own head
    over the full vocabulary, and its own over a reduced one (d2t)."""
    from draftsmith.app.bench.engine import bench

    monkeypatch.setenv(
        "DRAFTSMITH_CPU_LAYOUT", "off"
    )  # no layout tuning of a tiny model: seconds, not minutes
    spec = {
        "eagle3": f"eagle3:{tiny['head']}",
        "dflash": f"dflash:{tiny['dflash']}",
        "dflash-own": f"dflash:{tiny['dflash-own']}",
        "dflash-reduced": f"dflash:{tiny['dflash-reduced']}",
        "draft": f"draft:{tiny['draft']}",
    }[kind]
    result = bench(str(tiny["target"]), [spec], PROMPTS, k=3, max_new_tokens=24, decoder=True, gguf_type="f32",
                   threads=2, target_gguf_file=str(target_gguf))  # fmt: skip
    d = result["drafters"][spec]
    assert d["lossless"] == {"identical": 3, "engine_numerics": 0, "differ": 0, "passed": True, "of": 3}
    assert all(r["draft_n"] > 0 for r in result["rows"][spec])  # it drafted on every prompt
    assert 1.0 <= d["tau"] <= 4.0 and d["predicted_speedup"] is not None and d["draft_token_ms"] is not None
    c = d["consistency"]
    assert c["decoder_lossless"] is True
    assert c["passed"], c  # tau within 10% of draftsmith's decoder on the same prompts and k
    if kind == "draft":  # the noisy copy agrees on some drafts, not all: tau measures something in both
        assert 1.2 < d["tau"] < 3.9 and 0.05 < d["accept_rate"] < 0.97


def test_engine_numbers_from_server_timings():
    """tau, accept rate, per-drafted-token cost and the two-fold prediction from llama-server timings (hand-made:
    plain steps of 10 ms; speculative steps drafting 3 tokens at 25 ms = 10 ms + 3 x 5 ms)."""
    from draftsmith.app.bench.engine import summarize

    def row(steps, accepted, ms_per_step, drafted=3):
        return {"predicted_n": 1 + steps + accepted, "predicted_ms": steps * ms_per_step,
                "draft_n": drafted * steps, "draft_n_accepted": accepted}  # fmt: skip

    plain = [row(64, 0, 10.0, 0) for _ in range(4)]
    spec = [row(40, 24, 25.0), row(30, 34, 25.0), row(50, 14, 25.0), row(20, 44, 25.0)]
    d = summarize(spec, plain, k=3)
    assert d["tau"] == pytest.approx(256 / 140) and d["accept_rate"] == pytest.approx(116 / 420)
    assert d["plain_step_ms"] == pytest.approx(10.0) and d["draft_token_ms"] == pytest.approx(5.0)
    assert d["speedup"] == pytest.approx((256 / (140 * 25.0)) / (1 / 10.0))
    # every prompt costs the same per drafted token: the prediction from the other half's costs is exact
    assert d["predicted_speedup"] == pytest.approx(d["speedup"])
    slow = [
        row(40, 24, 25.0),
        row(30, 34, 40.0),
        row(50, 14, 25.0),
        row(20, 44, 40.0),
    ]  # odd prompts pay more
    d = summarize(slow, plain, k=3)
    assert d["predicted_speedup"] != pytest.approx(
        d["speedup"], rel=0.05
    )  # priced with the other fold's cost
    assert d["lossless"] == {"identical": 4, "engine_numerics": 0, "differ": 0, "passed": True, "of": 4}
    slow[0]["divergence"] = {"at": 5, "verdict": "engine numerics"}
    assert summarize(slow, plain, k=3)["lossless"]["passed"]  # the engine's own numerics do not fail
    slow[1]["divergence"] = {"at": 2, "verdict": "differs"}
    assert summarize(slow, plain, k=3)["lossless"] == {
        "identical": 2, "engine_numerics": 1, "differ": 1, "passed": False, "of": 4
    }  # fmt: skip


@needs_build
def test_checks_draft_lm_row_agrees_with_the_pinned_converter():
    """`draftsmith check`'s llama.cpp draft-LM row is a hand list of model types (it must answer without a build);
    the pinned build's converter is the source it copies: every listed type's causal-LM class is registered there,
    and every tiny test architecture the converter registers is listed (neither side drifts silently)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.app.check import ENGINE_TARGETS
    from draftsmith.testing import TINY_ARCHS

    (row,) = [e for e in ENGINE_TARGETS if e.engine == "llama.cpp" and e.method.startswith("draft LM")]
    registered = llamacpp.converter_architectures()
    missing = [t for t in row.model_types if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] not in registered]
    assert not missing, f"listed for llama.cpp but its converter does not register them: {missing}"
    unlisted = [t for t, a in TINY_ARCHS.items() if a.model in registered and t not in row.model_types]
    assert not unlisted, (
        f"the converter registers these tiny architectures but check does not list them: {unlisted}"
    )


# ---- lossless in the engine: the engine's numerics told apart from a loss ---------------------------------------


def test_divergence_verdict_from_the_two_paths():
    """Engine numerics only when each path puts its own run's token first, both tokens in both top lists."""
    from draftsmith.app.bench.engine_lossless import DIFFERS, ENGINE_NUMERICS, verdict

    one = {7: -0.60, 9: -0.70, 3: -3.0}  # the one-token path: plain token 7 leads by 0.1
    verify = {9: -0.62, 7: -0.66, 3: -3.1}  # the replayed verify: speculative token 9 leads by 0.04
    v = verdict(7, 9, one, verify)
    assert v["verdict"] == ENGINE_NUMERICS and v["why"] is None
    assert v["one_token_gap"] == pytest.approx(0.10) and v["verify_gap"] == pytest.approx(0.04)
    assert verdict(7, 9, one, one)["verdict"] == DIFFERS  # the verify path agrees with plain: a real loss
    assert "does not lead the verify path" in verdict(7, 9, one, one)["why"]
    assert "does not lead the one-token path" in verdict(7, 9, verify, verify)["why"]
    far = {9: -0.1, 3: -2.0}  # the plain token is not even among the verify path's top tokens
    assert verdict(7, 9, one, far) == {
        "one_token_gap": pytest.approx(0.10), "verify_gap": None, "verdict": DIFFERS,
        "why": "a token is outside the top 10 of a path",
    }  # fmt: skip


def test_verify_schedule_read_from_a_debug_log():
    """The batches of the last request in llama-server's debug lines (generate_draft / accepted / decode token)."""
    from draftsmith.app.bench.engine_lossless import Step, schedule_problem, verify_schedule

    log = "\n".join([
        "slot launch_slot_: id  0 | task 4 | processing task, is_child = 0",
        "slot handle_last_: id  0 | task 4 | generate_draft: id=5, #tokens=9, #draft=3, pos_next=9",
        "slot launch_slot_: id  0 | task 9 | processing task, is_child = 0",
        "slot handle_last_: id  0 | task 9 | generate_draft: id=5, #tokens=12, #draft=3, pos_next=12",
        "slot update_slot: id  0 | task 9 | accepted 2/3 draft tokens, new n_tokens = 15",
        "slot handle_last_: id  0 | task 9 | slot decode token, id=8, n_ctx = 256, n_tokens = 15, truncated = 0",
        "slot handle_last_: id  0 | task 9 | generate_draft: id=6, #tokens=16, #draft=2, pos_next=16",
    ])  # fmt: skip
    steps = verify_schedule(log)
    assert steps == [Step(12, 4, 3), Step(15, 1, 1), Step(16, 3, None)]
    assert schedule_problem(steps, 12, 8) is None
    assert "not after the 11-token prompt" in schedule_problem(steps, 11, 8)
    assert "next starts at" in schedule_problem([Step(12, 4, 2), Step(15, 1, 1)], 12, 8)


@pytest.fixture(scope="module")
def noisy_gguf(tiny):
    """The noisy copy of the target (the tiny draft LM) as a GGUF."""
    return llamacpp.convert(tiny["draft"], tiny["root"] / "noisy.f32.gguf", outtype="f32")


@pytest.fixture(scope="module")
def near_gguf(tiny):
    """Another model close to the target (a tenth of the draft's noise on its MLPs): it decodes the target's
    tokens for a while, then parts, as a lossy drafter path would."""
    from transformers import AutoModelForCausalLM

    near = AutoModelForCausalLM.from_pretrained(tiny["target"]).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, w in near.named_parameters():
            if ".mlp." in name:
                w.add_(0.01 * w.std() * torch.randn(w.shape, generator=g))
    folder = tiny["root"] / "near"
    near.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"):
        if (tiny["draft"] / f).is_file():
            (folder / f).write_bytes((tiny["draft"] / f).read_bytes())
    return llamacpp.convert(folder, tiny["root"] / "near.f32.gguf", outtype="f32")


def _spec_rows(gguf, flags, encoded, n):
    from draftsmith.app.bench.engine import EngineDrafter, run_engine

    return run_engine(gguf, [EngineDrafter("d", flags, None)], encoded, n, threads=2)


@pytest.mark.llamacpp
@needs_build
def test_verify_replay_reproduces_the_speculative_run(tiny, target_gguf, noisy_gguf):
    """On the fp32 tiny target the two paths compute the same numbers: at every position tried, the replay of the
    speculative run's batches (each row count checked by the server's prompt_n) and the one-token path both put
    the run's own token first; the debug log's batches add up to the server's draft counts."""
    from draftsmith.app.bench.engine_lossless import PlainScorer, schedule_problem, verify_schedule
    from draftsmith.models import load_tokenizer
    from draftsmith.prompts import prompt_ids

    tok = load_tokenizer(str(tiny["target"]))
    ids = prompt_ids(tok, PROMPTS[0])
    flags = ["-md", str(noisy_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", "3",
             "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]  # fmt: skip
    with (
        llamacpp.LlamaServer(target_gguf, alias="p", context=256, threads=2) as plain,
        llamacpp.LlamaServer(
            target_gguf, alias="s", context=256, threads=2, extra=[*flags, "-lv", "5"]
        ) as spec,
    ):
        start = spec.log_size()
        r = llamacpp.complete_ids(spec.url, ids, 24)
        steps = verify_schedule(spec.log_since(start, until="stop processing"))
        tokens, t = r["tokens"], r["timings"]
        assert schedule_problem(steps, len(ids), len(tokens)) is None
        assert sum(s.rows - 1 for s in steps) == t["draft_n"] > 0
        assert sum(s.kept - 1 for s in steps if s.kept) <= t["draft_n_accepted"]
        assert any(s.kept and s.kept < s.rows for s in steps)  # some drafts were rejected: fillers replayed
        scorer = PlainScorer(plain.url)
        for at in (2, 9, 17, 23):
            verify, window = scorer.verify_path(ids, tokens, at, steps)
            assert max(verify, key=verify.get) == tokens[at] and window["rows"] in {s.rows for s in steps}
            one = scorer.one_token(ids, tokens, at)  # greedy plain == greedy speculative here
            assert max(one, key=one.get) == tokens[at]
            assert verify[tokens[at]] == pytest.approx(one[tokens[at]], abs=1e-3)


@pytest.mark.llamacpp
@needs_build
def test_lossy_comparison_fails_the_check(tiny, target_gguf, noisy_gguf, near_gguf):
    """A deliberately lossy comparison: speculative runs of another model (a near copy of the target served, the
    target as its draft) checked against the target's plain decoding. No prompt passes as the engine's numerics:
    the target's replayed verify batches do not put the other model's token first. The honest drafter beside it
    (the target served, the noisy copy drafting) decodes the plain tokens exactly (fp32)."""
    from draftsmith.app.bench.engine_lossless import DIFFERS, check_lossless
    from draftsmith.models import load_tokenizer
    from draftsmith.prompts import prompt_ids

    tok = load_tokenizer(str(tiny["target"]))
    encoded = [prompt_ids(tok, p) for p in PROMPTS]
    spec = ["--spec-type", "draft-simple", "--spec-draft-n-max", "3", "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0"]  # fmt: skip
    lossy_flags, honest_flags = ["-md", str(target_gguf), *spec], ["-md", str(noisy_gguf), *spec]
    lossy = _spec_rows(near_gguf, lossy_flags, encoded, 32)
    honest = _spec_rows(target_gguf, honest_flags, encoded, 32)
    rows = {"plain": honest["plain"], "honest": honest["d"], "lossy": lossy["d"]}
    checks = check_lossless(
        target_gguf, {"honest": (target_gguf, honest_flags), "lossy": (near_gguf, lossy_flags)}, encoded, rows,
        max_new_tokens=32, context=256, threads=2,
    )  # fmt: skip
    assert checks["honest"] == {}
    assert checks["lossy"], "the near copy decoded the target's tokens on every prompt"
    for v in checks["lossy"].values():
        assert v["verdict"] == DIFFERS and v["spec_token"] != v["plain_token"], v
        assert v["why"] in (
            "the speculative token does not lead the verify path",
            "the first token comes from the prompt's prefill in both runs",
        ), v
    replayed = [v for v in checks["lossy"].values() if v["at"] >= 4]  # a last batch of generated rows only
    assert replayed and all(not v["window"]["inexact"] and v["one_token_gap"] > 0 for v in replayed), replayed
